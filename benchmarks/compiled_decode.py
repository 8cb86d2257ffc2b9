"""Decode speed of a STEM model against its dense parent, eager and compiled, side by side in one run.

    python benchmarks/compiled_decode.py            # SmolLM2-135M, a third of its layers converted
    python benchmarks/compiled_decode.py --runs 5   # more runs of each (the last is reported)
    python benchmarks/compiled_decode.py --model llama-1b   # Llama-3.2-1B's shape, every layer converted

Transformers' generate(): batch 1, a 32-token prompt of real text, 64 greedy new tokens, fp32; STEM with its
tables in memory (a compiled graph gathers their rows itself) and left in the files (mmap: an op of the graph
reads them). "compiled": a static KV cache and `torch.compile(model.forward, mode="reduce-overhead",
fullgraph=True)`, through which generate() runs the prompt and every decode step ("reduce-overhead" means CUDA
graphs on a GPU, untested with STEM: this benchmark is the CPU's).
Each model and mode is loaded fresh, STEM with this checkout's code (not the copy in the converted folder);
the third run of each is reported (the first compiles). The models are benchmarks/inference.py's (made once
under --work): the parent and its conversion with a third of the layers (closed-form tables: values do not
change speed). `--model llama-1b`: a random model of Llama-3.2-1B's shape (bf16 checkpoint) and its conversion
with every layer, tables stored int8 (all 16 in bf16 are 33.6 GB, more than this machine's RAM and free disk; int8
are 16.8 GB) and left in the files (mmap): the dense parts (0.97 of the parent's 1.24 billion parameters) are
what a decode step reads; both run in fp32.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from inference import machine, prepare, prompt_ids  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS = 32, 64


@torch.no_grad()
def tokens_per_s(path: Path, placement: str | None, compiled: bool, ids: torch.Tensor, runs: int) -> float:
    """New tokens per second of generate() in the last of `runs` runs; `placement`: the STEM model's tables
    (None: the dense parent)."""
    from transformers import AutoModelForCausalLM

    from stem_upcycle import StemForCausalLM

    if placement is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = StemForCausalLM.from_pretrained(path, dtype=torch.float32, stem_tables=placement)
    model.eval()
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    if compiled:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        kwargs["cache_implementation"] = "static"
    for _ in range(runs):
        started = time.perf_counter()
        model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), **kwargs)
        seconds = time.perf_counter() - started
    return NEW_TOKENS / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-inference")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", choices=["smollm2", "llama-1b"], default="smollm2")
    args = parser.parse_args()
    print(machine())
    prepare(args.work, "smollm2", {})  # its tokenizer gives the prompt
    ids = prompt_ids(args.work)[:PROMPT_TOKENS]
    if args.model == "smollm2":
        paths = prepare(args.work, "smollm2", {"stem-third": "1/3"})
        title = "SmolLM2-135M, a third of the layers STEM"
        models = {"parent": (paths["dense"], None), "STEM memory": (paths["stem-third"], "memory"),
                  "STEM mmap": (paths["stem-third"], "mmap")}
    else:
        paths = prepare(args.work, "llama-1b", {"stem-all-int8": {"layers": "all", "table_dtype": "int8"}})
        title = "Llama-3.2-1B shape, every layer STEM (int8 tables)"
        models = {"parent": (paths["dense"], None), "STEM mmap": (paths["stem-all-int8"], "mmap")}
    speed = {(name, mode): tokens_per_s(path, placement, mode == "compiled", ids, args.runs)
             for mode in ("eager", "compiled") for name, (path, placement) in models.items()}
    stem = [name for name in models if name != "parent"]
    print(f"{title}, batch 1, {PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, fp32, run {args.runs} of each; "
          f"tokens/s and STEM / parent")
    print("| | parent | " + " | ".join(stem) + " |")
    print("|---" * (len(stem) + 2) + "|")
    for mode in ("eager", "compiled"):
        parent = speed["parent", mode]
        cells = [f"{speed[name, mode]:.1f} ({speed[name, mode] / parent:.2f}x)" for name in stem]
        print(f"| {mode} | {parent:.1f} | " + " | ".join(cells) + " |")
    print("compiled / eager: " + ", ".join(f"{name} {speed[name, 'compiled'] / speed[name, 'eager']:.2f}x"
                                           for name in models))


if __name__ == "__main__":
    main()
