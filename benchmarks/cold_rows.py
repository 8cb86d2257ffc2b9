"""Prefill with cold rows: new prompts whose table rows are not in the page cache, dense parent against STEM.

    bash scripts/get-shakespeare.sh && bash scripts/get-ood-texts.sh
    python benchmarks/cold_rows.py                                   # SmolLM2-135M, a third and all layers
    python benchmarks/cold_rows.py --models llama1b --llama-layers 5 # the Llama-3.2-1B shape, random weights
    STEM_READ_THREADS=0 python benchmarks/cold_rows.py               # every row read in the forward's thread
    python benchmarks/cold_rows.py --layer-groups 1                  # also each model with a tensor per table

A server sees new prompts all the time, and the rows of a new prompt's ids are seldom in the page
cache. Each setting (model, dtype) runs `--repeats` processes that load the dense parent and the
STEM model and take turns on every prompt, so that a shared machine's drift falls on both alike.
For each prompt kind, `--prompts` new 512-token prompts are prefilled (one forward, batch 1), each
after the STEM model's table files were dropped from the page cache (posix_fadvise(DONTNEED), no
root needed): every row it reads is cold. Kinds: *natural* (consecutive slices of a novel, Botchan,
by SmolLM2's tokenizer) and *random* (ids drawn uniformly from 100-19999, seeded per prompt: the
worst case, few ids repeat). Then, twice, the last random prompt again (*warm*: its rows are
cached) and 32 greedy tokens of decode after it, with the KV cache. Peak RSS: each model alone in
a process (load, a cold prompt, a decode), its high-water mark.

Tables are placed with `mmap` (the default), whose reads `STEM_READ_THREADS` and
`STEM_READ_AHEAD_LAYERS` tune. tok/s are medians over prompts and processes; ratios are medians of
the per-prompt ratios. Models are made once under --work by benchmarks/inference.py's `prepare`
(closed-form tables: row values do not change speed; the tables in `convert`'s default groups of
layers, a token's rows of a group side by side: one read per group, not per layer); with
`--layer-groups G`, each STEM model is measured again with its tables stored in groups of G layers
(`stem-upcycle compress --layer-groups G`; 1: a tensor per table, as `convert` stored them before
groups were its default).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from inference import drop_page_cache, machine, memory_mb, prepare  # noqa: E402

PROMPT_TOKENS, DECODE_TOKENS = 512, 32
NOVEL = ROOT / "data/ood/botchan.txt"


def prompts(work: Path, count: int) -> dict[str, list[torch.Tensor]]:
    """{kind: `count` prompts of PROMPT_TOKENS ids}, the same for every model of a run."""
    from transformers import AutoTokenizer

    if not NOVEL.exists():
        sys.exit(f"{NOVEL} is missing: run `bash scripts/get-ood-texts.sh` first")
    tokenizer = AutoTokenizer.from_pretrained(work / "smollm2" / "dense")
    ids = torch.tensor(tokenizer(NOVEL.read_text()[: 40 * PROMPT_TOKENS * count])["input_ids"])
    natural = [ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS] for i in range(count)]
    random = [torch.randint(100, 20000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(i))
              for i in range(count)]
    return {"natural": natural, "random": random}


def load(path: str, dtype: str):
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    import stem_upcycle  # noqa: F401  (registers the STEM classes)

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def prefill(model, ids: torch.Tensor) -> float:
    started = time.perf_counter()
    model(ids[None], use_cache=False)
    return ids.numel() / (time.perf_counter() - started)


def decode(model, ids: torch.Tensor) -> float:
    out = model(ids[None], use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    started = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return DECODE_TOKENS / (time.perf_counter() - started)


@torch.no_grad()
def run_setting(setting: dict) -> dict:
    """Speed: the dense parent and the STEM model in one process, in turns on each prompt, so that the
    machine's drift (a shared VM's) falls on both alike. Memory: one model alone, one cold prompt and a decode."""
    kinds = torch.load(setting["prompts"])
    stem_path = Path(setting["stem"])
    if setting["mode"] == "memory":
        model = load(setting["model"], setting["dtype"])
        drop_page_cache(stem_path)
        prefill(model, kinds["random"][0])
        decode(model, kinds["random"][-1])
        return {"peak_mb": memory_mb()["peak_mb"]}
    models = {"dense": load(setting["dense"], setting["dtype"]), "stem": load(str(stem_path), setting["dtype"])}
    for model in models.values():
        prefill(model, kinds["natural"][0][:16])  # one-off costs of a first forward (thread pools, allocator)
    result = {name: {} for name in models}
    for kind, prompts_ in kinds.items():
        for ids in prompts_:
            for name, model in models.items():
                drop_page_cache(stem_path)  # every row of the prompt cold for the STEM model
                result[name].setdefault(kind, []).append(prefill(model, ids))
    for _ in range(2):
        for name, model in models.items():
            result[name].setdefault("warm", []).append(prefill(model, kinds["random"][-1]))
            result[name].setdefault("decode", []).append(decode(model, kinds["random"][-1]))
    return result


def measure(setting: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--setting", json.dumps(setting)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{setting} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(model: str, results: dict) -> str:
    """results: {(variant, dtype): {"speed": [per process {"dense": {kind: [tok/s]}, "stem": ...}],
    "peak_mb": {"dense": MB, "stem": MB}}}."""
    threads = os.environ.get("STEM_READ_THREADS", "4 (the default)")
    lines = [f"{model}: {machine()}; STEM_READ_THREADS={threads}",
             "| model | dtype | cold natural tok/s (dense) | vs dense | cold random tok/s (dense) | vs dense "
             "| warm tok/s (dense) | vs dense | decode tok/s (dense) | vs dense | peak RSS GB (dense) | vs dense |",
             "|" + "---|" * 12]
    for (variant, dtype), r in results.items():
        cells = []
        for kind in ("natural", "random", "warm", "decode"):
            stem = [v for run in r["speed"] for v in run["stem"][kind]]
            dense = [v for run in r["speed"] for v in run["dense"][kind]]
            ratios = [a / b for run in r["speed"] for a, b in zip(run["stem"][kind], run["dense"][kind])]
            digits = 1 if kind == "decode" else 0
            cells += [f"{statistics.median(stem):.{digits}f} ({statistics.median(dense):.{digits}f})",
                      f"{statistics.median(ratios):.2f}x"]
        peak = r["peak_mb"]
        cells += [f"{peak['stem'] / 1024:.2f} ({peak['dense'] / 1024:.2f})", f"{peak['stem'] / peak['dense']:.2f}x"]
        lines.append(f"| {variant} | {dtype} | " + " | ".join(cells) + " |")
    lines.append("tok/s: medians over prompts and processes; vs dense: the median of the ratios of turns taken "
                 "on the same prompt in the same process")
    return "\n".join(lines)


def grouped(paths: dict[str, Path], group: int) -> dict[str, Path]:
    """{variant with groups: directory}: each STEM model of `paths` with its tables in groups of `group`
    layers, made once beside it."""
    from stem_upcycle.compress import plan_compression, run_compression
    from stem_upcycle.source import open_source

    made = {}
    for variant, path in paths.items():
        if variant == "dense":
            continue
        out = path.with_name(f"{path.name}-groups-of-{group}")
        if not (out / "config.json").exists():
            print(f"storing {path}'s tables in groups of {group} layers into {out}", file=sys.stderr, flush=True)
            run_compression(plan_compression(open_source(str(path)), None, layer_groups=group), out, overwrite=True)
        made[f"{variant}, " + ("a tensor per table" if group == 1 else f"groups of {group}")] = out
    return made


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2", help="smollm2, llama1b, or both, comma-separated")
    parser.add_argument("--work", default=str(ROOT / "runs" / "inference-bench"), help="where the models are made")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--variants", default="stem-third,stem-all", help="besides the dense parent")
    parser.add_argument("--llama-layers", default="5", help="llama1b: STEM layers of each converted model (of 16), "
                        "comma-separated")
    parser.add_argument("--prompts", type=int, default=3, help="new prompts of each kind per process")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per setting")
    parser.add_argument("--layer-groups", type=int, help="also measure each STEM model with its tables in groups of "
                        "this many layers (1: a tensor per table)")
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setting:
        print(json.dumps(run_setting(json.loads(args.setting))))
        return
    work = Path(args.work)
    prepare(work, "smollm2", variants={})  # its tokenizer cuts the prompts
    prompt_file = work / "cold-prompts.pt"
    torch.save(prompts(work, args.prompts), prompt_file)
    for model in args.models.split(","):
        layers = {"stem-third": "1/3", "stem-all": "all"} if model == "smollm2" else {
            f"stem-{n}": f"{n}/16" for n in args.llama_layers.split(",")}
        chosen = [v for v in args.variants.split(",") if v in layers] if model == "smollm2" else list(layers)
        paths = prepare(work, model, variants={v: layers[v] for v in chosen})
        if args.layer_groups:
            paths.update(grouped(paths, args.layer_groups))
        results = {}
        for dtype in args.dtypes.split(","):
            for variant, path in paths.items():
                if variant == "dense":
                    continue
                common = {"dtype": dtype, "stem": str(path), "prompts": str(prompt_file)}
                speed = [measure({**common, "mode": "speed", "dense": str(paths["dense"])})
                         for _ in range(args.repeats)]
                peak = {name: measure({**common, "mode": "memory", "model": str(paths[name])})["peak_mb"]
                        for name in ("dense", variant)}
                results[(variant, dtype)] = {"speed": speed, "peak_mb": {"dense": peak["dense"], "stem": peak[variant]}}
                print(f"{model} {variant} {dtype}: {json.dumps(results[(variant, dtype)])}", file=sys.stderr, flush=True)
        print(report(model, results), flush=True)


if __name__ == "__main__":
    main()
