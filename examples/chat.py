"""Chat with a converted STEM model through plain Transformers (stem-upcycle need not be installed).

    python examples/chat.py out/smollm2-stem "What is the capital of France?"
    python examples/chat.py out/smollm2-stem "..." --tables memory   # mmap (the default), memory, host

`--tables` is `from_pretrained`'s `stem_tables`: where the tables live (README, "Loading").
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("path")
parser.add_argument("question", nargs="?", default="What is the capital of France?")
parser.add_argument("--tables", choices=["memory", "mmap", "host"], default=None)
args = parser.parse_args()
placement = {"stem_tables": args.tables} if args.tables else {}
model = AutoModelForCausalLM.from_pretrained(args.path, trust_remote_code=True, **placement).eval()
tokenizer = AutoTokenizer.from_pretrained(args.path, trust_remote_code=True)
prompt = tokenizer.apply_chat_template(
    [{"role": "user", "content": args.question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
)
with torch.no_grad():
    out = model.generate(**prompt, max_new_tokens=40, do_sample=False)
print(f"{type(model).__name__}, STEM layers {model.config.stem_layers}, tables: {model.stem_tables}")
print("user:     ", args.question)
print("assistant:", tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True))
