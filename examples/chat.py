"""Chat with a converted STEM model through plain Transformers (stem-upcycle need not be installed).

    python examples/chat.py out/smollm2-stem                                   # a chat: turns from stdin until EOF
    python examples/chat.py out/smollm2-stem "What is the capital of France?"  # one question, one answer
    python examples/chat.py out/smollm2-stem --tables memory                  # mmap (the default), memory, host

MODEL is a converted folder, or a hub id already in the local Hugging Face cache (nothing is downloaded).
Each turn is put through the model's chat template with the turns before it. `--tables` is `from_pretrained`'s
`stem_tables`: where the tables live (README, "Loading").
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def looks_local(spec: str) -> bool:
    """Whether MODEL names a folder on this machine rather than a hub id (`org/name`)."""
    path = Path(spec).expanduser()
    return path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1 or path.parent.is_dir()


def local_folder(spec: str) -> str:
    """MODEL's folder on this machine: MODEL itself, or a hub id's snapshot in the local cache (looked up
    without the network: from_pretrained would ask the Hub about files first, offline or not)."""
    from huggingface_hub import snapshot_download

    if Path(spec).expanduser().is_dir():
        return str(Path(spec).expanduser())
    if looks_local(spec):
        sys.exit(f"error: {spec}: no such folder; make it first (the README's convert command writes one in about "
                 f"30 seconds), or give a converted model's folder")
    try:
        return snapshot_download(spec, local_files_only=True)
    except Exception:  # not in the cache (the error class varies between huggingface_hub versions)
        sys.exit(f"error: {spec} is neither a folder here nor a model in the local Hugging Face cache "
                 f"(nothing is downloaded); give a converted model's folder")


def load(spec: str, tables: str | None):
    folder = local_folder(spec)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                 **({"stem_tables": tables} if tables else {})).eval()
    return model, AutoTokenizer.from_pretrained(folder, trust_remote_code=False)  # a tokenizer runs no model code


@torch.no_grad()
def answer(model, tokenizer, turns: list[dict], max_new_tokens: int) -> str:
    prompt = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("prompt", nargs="?", help="one question; without it, questions are read from stdin")
    parser.add_argument("--tables", choices=["memory", "mmap", "host"], default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_intermixed_args()  # the prompt may come after the options
    model, tokenizer = load(args.model, args.tables)
    print(f"{type(model).__name__}, STEM layers {getattr(model.config, 'stem_layers', [])}, "
          f"tables: {getattr(model, 'stem_tables', 'dense')}", file=sys.stderr)
    if args.prompt is not None:
        print(answer(model, tokenizer, [{"role": "user", "content": args.prompt}], args.max_new_tokens))
        return
    interactive = sys.stdin.isatty()
    if interactive:
        print("type a question, Enter to send; Ctrl-D to leave", file=sys.stderr)
    turns = []
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:  # EOF
            break
        if not line.strip():
            continue
        turns.append({"role": "user", "content": line.strip()})
        reply = answer(model, tokenizer, turns, args.max_new_tokens)
        turns.append({"role": "assistant", "content": reply})
        print("model> " + reply, flush=True)  # a reply may span lines: each turn's starts so


if __name__ == "__main__":
    main()
