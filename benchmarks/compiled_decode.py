"""Decode speed of a STEM model against its dense parent, eager and compiled, side by side in one run.

    python benchmarks/compiled_decode.py            # SmolLM2-135M, a third of its layers converted
    python benchmarks/compiled_decode.py --runs 5   # more runs of each (the last is reported)

Transformers' generate(): batch 1, a 32-token prompt of real text, 64 greedy new tokens, fp32; STEM with its
tables in memory (a compiled graph gathers their rows itself) and left in the files (mmap: an op of the graph
reads them). "compiled": a static KV cache and `torch.compile(model.forward, mode="reduce-overhead",
fullgraph=True)`, through which generate() runs the prompt and every decode step ("reduce-overhead" means CUDA
graphs on a GPU, untested with STEM: this benchmark is the CPU's).
Each model and mode is loaded fresh, STEM with this checkout's code (not the copy in the converted folder);
the third run of each is reported (the first compiles). The models are benchmarks/inference.py's (made once
under --work): the parent and its conversion with a third of the layers (closed-form tables: values do not
change speed).
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
    args = parser.parse_args()
    print(machine())
    paths = prepare(args.work, "smollm2", {"stem-third": "1/3"})
    ids = prompt_ids(args.work)[:PROMPT_TOKENS]
    models = {"parent": (paths["dense"], None), "STEM memory": (paths["stem-third"], "memory"),
              "STEM mmap": (paths["stem-third"], "mmap")}
    speed = {(name, mode): tokens_per_s(path, placement, mode == "compiled", ids, args.runs)
             for mode in ("eager", "compiled") for name, (path, placement) in models.items()}
    print(f"SmolLM2-135M, a third of the layers STEM, batch 1, {PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new "
          f"tokens, fp32, run {args.runs} of each; tokens/s and STEM / parent")
    print("| | parent | STEM memory | STEM mmap |")
    print("|---|---|---|---|")
    for mode in ("eager", "compiled"):
        parent = speed["parent", mode]
        cells = [f"{speed[name, mode]:.1f} ({speed[name, mode] / parent:.2f}x)" for name in ("STEM memory", "STEM mmap")]
        print(f"| {mode} | {parent:.1f} | " + " | ".join(cells) + " |")
    print("compiled / eager: " + ", ".join(f"{name} {speed[name, 'compiled'] / speed[name, 'eager']:.2f}x"
                                           for name in models))


if __name__ == "__main__":
    main()
