"""Chat with a converted STEM model through plain Transformers (stem-upcycle need not be installed).

    python examples/chat.py out/smollm2-stem "What is the capital of France?"
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
question = sys.argv[2] if len(sys.argv) > 2 else "What is the capital of France?"
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
prompt = tokenizer.apply_chat_template(
    [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
)
with torch.no_grad():
    out = model.generate(**prompt, max_new_tokens=40, do_sample=False)
print(f"{type(model).__name__}, STEM layers {model.config.stem_layers}")
print("user:     ", question)
print("assistant:", tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True))
