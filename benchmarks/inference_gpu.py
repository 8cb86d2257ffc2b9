"""The `host` placement on a CUDA GPU: equality with `memory`, then speed and memory against all-in-VRAM.

    python benchmarks/inference_gpu.py               # a few minutes on one GPU; writes nothing outside --work

Run on one H200 on 2026-12-04 (figures in benchmarks/README.md, section inference_gpu.py):

1. Equality (fp32, a small Llama-shaped STEM model, 3 of 8 layers): `host` (row cache of 64 rows, so
   that forwards evict and long prompts are staged) and `mmap` against `memory`, all with
   `device_map="cuda"`: prefill logits, greedy decoding with `generate()` (scores), a left-padded
   batch, a forward after evictions; also `device_map` with half the layers offloaded to the CPU.
   The tables must not be in VRAM: allocated bytes after loading ~ the dense weights only. Then the
   same model with int4 tables: `host` and `mmap` against `memory`.
2. Speed (bf16, a Llama-3.2-1B-shaped random STEM model with 5 of 16 layers; its dense parent has the
   same dense weights): load time, VRAM after loading and peak, prefill tok/s (512 tokens), decode
   tok/s (128 greedy tokens, batch 1, KV cache), for dense / memory (tables in VRAM) / host / mmap;
   the host cache's hits and misses; and the host gather of one packed table against per-layer ones.
"""

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMALL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, tie_word_embeddings=True)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True)


def make(folder: Path, shape: dict, stem_layers: list[int], dtype: torch.dtype, device: str = "cuda") -> tuple[Path, Path]:
    """A random dense Llama and the STEM model with the same dense weights (random tables), saved. Built in
    `dtype` on `device`: the 1B shape initialised in fp32 on the CPU would spend minutes of device time."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from stem_upcycle import StemForCausalLM
    from stem_upcycle.convert import stem_config
    from stem_upcycle.families import family_for

    dense_dir, stem_dir = folder / "dense", folder / "stem"
    if (stem_dir / "config.json").exists():
        return dense_dir, stem_dir
    torch.manual_seed(0)
    with torch.device(device):
        dense = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype)
        dense.save_pretrained(dense_dir)
        config = stem_config(dense.config, family_for("llama"), stem_layers, "random", dtype, False)
        stem = StemForCausalLM._from_config(config, dtype=dtype)
    missing, _ = stem.load_state_dict(dense.state_dict(), strict=False)
    assert all("up_table" in m for m in missing), missing
    stem.save_pretrained(stem_dir)
    del dense, stem
    free()
    return dense_dir, stem_dir


def free() -> None:
    """Release deleted models' memory now: a STEM placement and its MLPs reference each other, so `del` alone
    leaves them to the cycle collector, and the next model's VRAM figures would carry this one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


@torch.no_grad()
def check_equality(work: Path) -> None:
    _, stem_dir = make(work / "small", SMALL, [0, 3, 6], torch.float32)
    memory = load(stem_dir, device_map="cuda", stem_tables="memory")
    torch.manual_seed(1)
    prompt = torch.randint(0, SMALL["vocab_size"], (2, 48), device="cuda")
    mask = torch.ones_like(prompt)
    mask[0, :10] = 0
    gen = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, output_scores=True,
               return_dict_in_generate=True)
    want_prefill = memory(prompt, attention_mask=mask).logits
    want = memory.generate(prompt, **gen)
    offload = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
    offload |= {f"model.layers.{i}": (0 if i < 4 else "cpu") for i in range(SMALL["num_hidden_layers"])}
    for placement, kwargs in (("host", dict(stem_cache_rows=64)), ("mmap", {}), ("host", dict(device_map=offload))):
        torch.cuda.reset_peak_memory_stats()
        model = load(stem_dir, stem_tables=placement, **({"device_map": "cuda"} | kwargs))
        allocated = torch.cuda.memory_allocated()
        got_prefill = model(prompt, attention_mask=mask).logits
        got = model.generate(prompt, **gen)
        torch.testing.assert_close(got_prefill, want_prefill, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.sequences, want.sequences), placement
        torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-5, atol=1e-5)
        for length in (5, 70, 3, 64, 1):  # 70 distinct ids > 64 cached rows: staged; the others evict
            x = torch.randint(0, SMALL["vocab_size"], (1, length), device="cuda")
            torch.testing.assert_close(model(x).logits, memory(x).logits, rtol=1e-5, atol=1e-5)
        stats = getattr(model.stem_placement, "stats", None)
        print(f"equal to memory: {placement} {kwargs or ''} (VRAM after loading {allocated / 2**20:.0f} MiB; "
              f"cache {stats})", flush=True)
        del model
        free()
    print(f"memory placement VRAM: {memory.get_memory_footprint() / 2**20:.0f} MiB", flush=True)
    del memory
    free()
    check_compressed(stem_dir, work / "small" / "int4", prompt, mask)


@torch.no_grad()
def check_compressed(stem_dir: Path, out: Path, prompt: torch.Tensor, mask: torch.Tensor, device: str = "cuda") -> None:
    """int4 tables (`stem-upcycle compress`): `host` (rows copied as stored, decoded on the GPU) and `mmap` give
    the logits of `memory` (compressed tensors on the GPU, decoded there). `device`: the CPU in the tests."""
    from stem_upcycle.compress import plan_compression, run_compression
    from stem_upcycle.source import open_source

    if not (out / "config.json").exists():
        run_compression(plan_compression(open_source(str(stem_dir)), "int4"), out, progress=False)
    memory = load(out, device_map=device, stem_tables="memory")
    want = memory(prompt, attention_mask=mask).logits
    for placement, kwargs in (("host", dict(stem_cache_rows=64)), ("mmap", {})):
        model = load(out, device_map=device, stem_tables=placement, **kwargs)
        torch.testing.assert_close(model(prompt, attention_mask=mask).logits, want, rtol=1e-5, atol=1e-5)
        for length in (5, 70, 3):  # staged, then cached and evicted rows
            x = torch.randint(0, memory.config.vocab_size, (1, length), device=device)
            torch.testing.assert_close(model(x).logits, memory(x).logits, rtol=1e-5, atol=1e-5)
        print(f"equal to memory, int4 tables: {placement}", flush=True)
        del model
        free()
    del memory
    free()


@torch.no_grad()
def speed(work: Path) -> None:
    dense_dir, stem_dir = make(work / "llama1b", LLAMA_1B, [0, 3, 6, 9, 12], torch.bfloat16)
    ids = torch.randint(0, 49152, (1, 512), device="cuda")  # ids below 49152, as in the CPU benchmark
    print(f"{torch.cuda.get_device_name()}, bf16, Llama-3.2-1B shape, 5 of 16 layers STEM")
    print(f"{'model':<14} {'load s':>7} {'VRAM load':>10} {'VRAM peak':>10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    base = None
    for name, path, kwargs in (("dense", dense_dir, {}), ("stem memory", stem_dir, {"stem_tables": "memory"}),
                               ("stem host", stem_dir, {"stem_tables": "host"}),
                               ("stem mmap", stem_dir, {"stem_tables": "mmap"})):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        model = load(path, dtype=torch.bfloat16, device_map="cuda", **kwargs)
        load_s, vram = time.perf_counter() - started, torch.cuda.memory_allocated()
        for _ in range(2):  # warm-up, then measured
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = model(ids, use_cache=True)
            torch.cuda.synchronize()
            prefill = ids.numel() / (time.perf_counter() - started)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            started = time.perf_counter()
            for _ in range(128):
                out = model(token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            decode = 128 / (time.perf_counter() - started)
        base = base or decode
        stats = getattr(model.stem_placement, "stats", "") if name != "dense" else ""
        print(f"{name:<14} {load_s:>7.1f} {vram / 2**30:>9.2f}G {torch.cuda.max_memory_allocated() / 2**30:>9.2f}G "
              f"{prefill:>14.0f} {decode:>8.1f} ({decode / base:.2f}x) {stats}", flush=True)
        del model, out, cache
        free()


def packed_copy() -> None:
    """Host gather + copy to the GPU of a decode step's and a prefill's rows: per layer vs one packed table."""
    layers, rows, d_ff = 5, 32768, 8192
    separate = [torch.randn(rows, d_ff).to(torch.bfloat16) for _ in range(layers)]
    packed = torch.cat(separate, 1)
    for n in (1, 300):
        ids = torch.randint(0, rows, (n,)).sort().values
        timings = {}
        for name, step in (("per layer", lambda: [t.index_select(0, ids).pin_memory().to("cuda", non_blocking=True)
                                                  for t in separate]),
                           ("packed", lambda: packed.index_select(0, ids).pin_memory().to("cuda", non_blocking=True))):
            step()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(200):
                step()
            torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - started) / 200 * 1e6
        print(f"gather + copy of {n} ids' rows, {layers} layers: per layer {timings['per layer']:.0f} us, "
              f"packed {timings['packed']:.0f} us", flush=True)


def guarded(name: str, step, *args):
    """Run one stage of a device session; a failure prints its traceback and lets the next stages run, since the
    machine's minutes are too few to rerun a whole script for one broken stage."""
    started = time.perf_counter()
    try:
        return step(*args)
    except Exception:
        traceback.print_exc()
        print(f"{name}: FAILED", flush=True)
    finally:
        print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/stem-gpu")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: this script measures the host placement on one")
    work = Path(args.work)
    guarded("equality", check_equality, work)
    guarded("speed", speed, work)
    guarded("packed copy", packed_copy)


if __name__ == "__main__":
    main()
