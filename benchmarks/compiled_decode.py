"""Decode speed of a STEM model against its dense parent, eager and compiled, side by side in one run.

    python benchmarks/compiled_decode.py            # SmolLM2-135M, a third of its layers converted
    python benchmarks/compiled_decode.py --rounds 9 # more rounds (the median is reported)
    python benchmarks/compiled_decode.py --model llama-1b   # Llama-3.2-1B's shape, every layer converted
    python benchmarks/compiled_decode.py --dtype float32    # the compute dtype (auto: bf16 where the CPU has it)
    python benchmarks/compiled_decode.py --columns          # whole layers against a share of every layer's neurons
    python benchmarks/compiled_decode.py --columns --model llama-1b

Transformers' generate(): batch 1, a 32-token prompt of real text, 64 greedy new tokens; STEM with its tables in
memory (a compiled graph gathers their rows itself) and left in the files (mmap: an op of the graph reads them).
"compiled": a static KV cache and `torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`, through
which generate() runs the prompt and every decode step ("reduce-overhead" means CUDA graphs on a GPU, untested
with STEM: this benchmark is the CPU's). For each mode, the parent and the STEM models are loaded into one process
(STEM with this checkout's code, not the copy in the converted folder), run twice each (compiling), then measured
in turns, round after round, so that the machine's drift (clock, neighbours) hits them alike; reported: each
model's median tokens/s and the median of its per-round ratios to the parent. Compute dtype: bf16 where the CPU
has native bf16 (avx512_bf16, amx_bf16; measured here: the parent decodes 2.2x faster than in fp32), else fp32
(emulated bf16 is slower than fp32). The models are benchmarks/inference.py's (made once under --work): the
parent and its conversion with a third of the layers (closed-form tables: values do not change speed).
`--model llama-1b`: a random model of Llama-3.2-1B's shape (bf16 checkpoint) and its conversion with every layer,
tables stored int8 (all 16 in bf16 are 33.6 GB, more than this machine's RAM) and left in the files (mmap): the
dense parts (0.97 of the parent's 1.24 billion parameters) are what a decode step reads.
`--columns` (issue 48): the same share of W_up as rows two ways, side by side with the parent: whole layers (a third
of them, evenly spaced) and that many columns of every layer's neurons (`convert --layers all --columns N`, N = the
whole layers' columns spread over every layer: 512 of SmolLM2's 1536, 2560 of Llama's 8192 for its 5 of 16 layers),
both left in the files (mmap). The neurons are chosen by their error with calibrated rows (4,096 tokens of the plays,
64-token windows; the random Llama reads them as ids): what a user's conversion does; the values do not change speed.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from inference import machine, prepare, prompt_ids  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS = 32, 64


def native_bf16() -> bool:
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load(path: Path, placement: str | None, compiled: bool, dtype: torch.dtype):
    """The parent (`placement` None) or the STEM model with its tables placed so, compiled or not."""
    from transformers import AutoModelForCausalLM

    from stem_upcycle import StemForCausalLM

    if placement is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    else:
        model = StemForCausalLM.from_pretrained(path, dtype=dtype, stem_tables=placement).eval()
    if compiled:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return model


@torch.no_grad()
def tokens_per_s(model, compiled: bool, ids: torch.Tensor) -> float:
    """New tokens per second of one generate()."""
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    if compiled:
        kwargs["cache_implementation"] = "static"
    started = time.perf_counter()
    model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), **kwargs)
    return NEW_TOKENS / (time.perf_counter() - started)


def in_turns(models: dict[str, tuple[Path, str | None]], compiled: bool, dtype: torch.dtype, ids: torch.Tensor,
             rounds: int) -> dict[str, tuple[float, float]]:
    """{name: (median tokens/s, median of its per-round ratios to the first model)}, the models loaded together
    and measured in turns."""
    loaded = {name: load(path, placement, compiled, dtype) for name, (path, placement) in models.items()}
    for model in loaded.values():  # compiles (the prompt's graph and the decode step's)
        tokens_per_s(model, compiled, ids), tokens_per_s(model, compiled, ids)
    speeds = {name: [] for name in loaded}
    for _ in range(rounds):
        for name, model in loaded.items():
            speeds[name].append(tokens_per_s(model, compiled, ids))
    reference = speeds[next(iter(speeds))]
    return {name: (statistics.median(v), statistics.median(a / b for a, b in zip(v, reference)))
            for name, v in speeds.items()}


def columns_models(work: Path, model: str) -> tuple[str, dict]:
    """The parent, a third of its layers whole and as many columns of every layer's neurons, both mmap."""
    from stem_upcycle.table_init import InitOptions

    prepare(work, "smollm2", {})  # SmolLM2's folder first: prompt_ids reads its tokenizer, whatever the model
    calibration = InitOptions(calib_generated=prompt_ids(work, 4096), calib_seq_len=64)  # ids of the plays
    if model == "smollm2":
        paths = prepare(work, "smollm2", {"stem-third": "1/3", "stem-neurons-512": dict(
            layers="all", columns="512", init="calib", init_options=calibration)})
        return ("SmolLM2-135M, a third of W_up as rows: 10 whole layers, or 512 of 1536 neurons in each layer",
                {"parent": (paths["dense"], None), "10 whole layers": (paths["stem-third"], "mmap"),
                 "512 neurons x 30": (paths["stem-neurons-512"], "mmap")})
    paths = prepare(work, "llama-1b", {"stem-5-int8": dict(layers="1/3", table_dtype="int8"),
                                       "stem-neurons-2560-int8": dict(layers="all", columns="2560", init="calib",
                                                                      init_options=calibration, table_dtype="int8")})
    return ("Llama-3.2-1B shape, 5/16 of W_up as rows (int8 tables): 5 whole layers, or 2560 of 8192 neurons in "
            "each layer", {"parent": (paths["dense"], None), "5 whole layers": (paths["stem-5-int8"], "mmap"),
                           "2560 neurons x 16": (paths["stem-neurons-2560-int8"], "mmap")})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-inference")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", choices=["smollm2", "llama-1b"], default="smollm2")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--columns", action="store_true",
                        help="whole layers against as many columns of every layer's neurons (issue 48)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.bfloat16 if native_bf16() else torch.float32
    print(machine())
    prepare(args.work, "smollm2", {})  # its tokenizer gives the prompt
    ids = prompt_ids(args.work)[:PROMPT_TOKENS]
    if args.columns:
        title, models = columns_models(args.work, args.model)
    elif args.model == "smollm2":
        paths = prepare(args.work, "smollm2", {"stem-third": "1/3"})
        title = "SmolLM2-135M, a third of the layers STEM"
        models = {"parent": (paths["dense"], None), "STEM memory": (paths["stem-third"], "memory"),
                  "STEM mmap": (paths["stem-third"], "mmap")}
    else:
        paths = prepare(args.work, "llama-1b", {"stem-all-int8": {"layers": "all", "table_dtype": "int8"}})
        title = "Llama-3.2-1B shape, every layer STEM (int8 tables)"
        models = {"parent": (paths["dense"], None), "STEM mmap": (paths["stem-all-int8"], "mmap")}
    speed = {mode: in_turns(models, mode == "compiled", dtype, ids, args.rounds) for mode in ("eager", "compiled")}
    stem = [name for name in models if name != "parent"]
    print(f"{title}, batch 1, {PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, {str(dtype)[6:]}, median of "
          f"{args.rounds} rounds in turns; tokens/s and STEM / parent (median of the rounds' ratios)")
    print("| | parent | " + " | ".join(stem) + " |")
    print("|---" * (len(stem) + 2) + "|")
    for mode in ("eager", "compiled"):
        cells = [f"{speed[mode][name][0]:.1f} ({speed[mode][name][1]:.2f}x)" for name in stem]
        print(f"| {mode} | {speed[mode]['parent'][0]:.1f} | " + " | ".join(cells) + " |")
    print("compiled / eager (medians): " + ", ".join(
        f"{name} {speed['compiled'][name][0] / speed['eager'][name][0]:.2f}x" for name in models))


if __name__ == "__main__":
    main()
