"""Conversion speed and memory on a Llama-3.2-1B-shaped checkpoint, against its two floors.

Writes a checkpoint with Llama-3.2-1B's real shapes (random bf16 weights), converts it with
`stem-upcycle convert` in a child process, and measures in the same run the two floors the
conversion cannot beat: the bare chunked matmuls that compute the tables, and a plain file write of
the same number of bytes. Target: within 1.3x of the larger floor, peak RSS under 6 GB.

    python benchmarks/convert.py --workdir /tmp/stem-bench --layers 1::2
    python benchmarks/convert.py --layers 0 --hub   # by hub id, downloaded from a Hub served on 127.0.0.1

`--hub`: the checkpoint is served as meta-llama/Llama-3.2-1B by tests/hub_server.py and converted by that id into
an empty Hugging Face cache (HF_HOME under WORKDIR): the time then includes the download (over the loopback, so
the network's share is left out) and the disk check before it.
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stem_upcycle.convert import CHUNK_BYTES
from stem_upcycle.layers import parse_layers
from stem_upcycle.shapes import LLAMA_32_1B
from stem_upcycle.shards import ShardWriter, TensorSpec, plan_shards


def write_random_checkpoint(path: Path) -> int:
    """Llama-3.2-1B shapes, random bf16 weights, 5 GB shards; returns bytes written."""
    config = LlamaConfig(**LLAMA_32_1B)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items() if k != "lm_head.weight"}
    specs = [TensorSpec(k, s, torch.bfloat16) for k, s in shapes.items()]
    path.mkdir(parents=True)
    config.save_pretrained(path)
    writer = ShardWriter(path, plan_shards(specs, 5 * 10**9))
    generator = torch.Generator().manual_seed(0)
    for spec in specs:
        tensor = torch.randn(spec.shape, generator=generator).mul_(0.02).to(torch.bfloat16)
        writer.write(spec.name, tensor)
    writer.close()
    return sum(s.nbytes for s in specs)


def matmul_floor(n_tables: int, vocab: int, d: int, d_ff: int) -> float:
    """Seconds for the chunked fp32 matmuls of n_tables tables, nothing else."""
    rows = max(1, CHUNK_BYTES // (d_ff * 4))
    x, w, out = torch.randn(rows, d), torch.randn(d, d_ff), torch.empty(rows, d_ff)
    start = time.perf_counter()
    for _ in range(n_tables):
        for first in range(0, vocab, rows):
            n = min(rows, vocab - first)
            torch.mm(x[:n], w, out=out[:n])
    return time.perf_counter() - start


def write_floor(path: Path, nbytes: int) -> float:
    """Seconds to write nbytes with plain file writes of 64 MiB buffers, then fsync."""
    block = bytes(64 * 2**20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


@click.command()
@click.option("--workdir", default="/tmp/stem-bench", show_default=True, type=click.Path(file_okay=False))
@click.option("--layers", default="1::2", show_default=True, help="STEM layers (1::2 = 8 of 16).")
@click.option("--keep", is_flag=True, help="Keep the checkpoints in WORKDIR.")
@click.option("--hub", is_flag=True, help="Convert by hub id from a Hub served locally (the download included).")
def main(workdir, layers, keep, hub):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from inference import machine

    print(f"machine            {machine()}")
    work = Path(workdir)
    if work.exists():
        shutil.rmtree(work)
    source, out = work / "dense", work / "stem"
    cfg = LlamaConfig(**LLAMA_32_1B)
    n_tables = len(parse_layers(layers, cfg.num_hidden_layers))

    t = time.perf_counter()
    dense_bytes = write_random_checkpoint(source)
    print(f"dense checkpoint   {dense_bytes / 1e9:.2f} GB written in {time.perf_counter() - t:.1f}s")

    env, spec, server = dict(os.environ), str(source), None
    if hub:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.hub_server import LocalHub

        spec = "meta-llama/Llama-3.2-1B"
        server = LocalHub({spec: source})
        env.update(HF_ENDPOINT=server.url, HF_HOME=str(work / "hf-home"), HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1")
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "stem_upcycle.cli", "convert", spec, str(out), "--layers", layers, "--init", "closed-form",
           "--quiet"]  # the data-free init: what the two floors bound (the calibrated default: convert_time.py)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    convert_s = time.perf_counter() - t
    if server is not None:
        server.close()
        shutil.rmtree(work / "hf-home")
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    written = sum(p.stat().st_size for p in out.iterdir())
    if not keep:  # room for the write floor's file of as many bytes
        shutil.rmtree(out)

    mm_s = matmul_floor(n_tables, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size)
    io_s = write_floor(work / "floor.bin", written)
    floor = max(mm_s, io_s)
    result = {
        "stem_layers": n_tables,
        "by_hub_id": hub,
        "convert_s": round(convert_s, 1),
        "written_gb": round(written / 1e9, 2),
        "peak_rss_gb": round(peak_rss / 1e9, 2),
        "floor_matmul_s": round(mm_s, 1),
        "floor_write_s": round(io_s, 1),
        "ratio_to_larger_floor": round(convert_s / floor, 2),
    }
    print(f"convert            {convert_s:.1f}s{' (by hub id, the download included)' if hub else ''}, "
          f"{written / 1e9:.2f} GB written, peak RSS {peak_rss / 1e9:.2f} GB")
    print(f"floor: matmuls     {mm_s:.1f}s ({n_tables} tables, fp32, chunks of {CHUNK_BYTES >> 20} MiB)")
    print(f"floor: file write  {io_s:.1f}s ({written / 1e9:.2f} GB, fsync)")
    print(f"ratio              {convert_s / floor:.2f}x the larger floor (target <= 1.3x), "
          f"peak RSS {peak_rss / 1e9:.2f} GB (target < 6 GB)")
    print(json.dumps(result))
    if not keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
