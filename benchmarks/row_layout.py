"""Cold reads of a prompt's table rows in three on-disk layouts, against the dense parent's prefill of it.

    bash scripts/get-shakespeare.sh && bash scripts/get-ood-texts.sh
    python benchmarks/row_layout.py                        # SmolLM2-135M, all 30 layers, fp32 rows
    python benchmarks/row_layout.py --groups 1,6,30 --prompts 6

A checkpoint stores each STEM layer's table as its own tensor (layer-major): a prefill of n distinct
ids reads n rows from each of L tables, n x L small reads, and on this machine's disk, which serves
some 20,000 reads a second whatever their size, those reads are what cold prefill waits on
(cold_rows.py). Stored token-major, as PLE stores its per-layer embeddings, a token's rows of every
layer lie side by side: n reads of L rows each. Grouped, G layers' rows of a token side by side:
n x L/G reads, and the first group's rows arrive before the later groups' are read.

This measures the reads alone, outside a forward, so that the layouts can be compared before one is
built: for each layout, the rows of ids 0-19999 of every table of `cold_rows.py`'s all-layers model
are copied into a scratch file under --work (G = 1 too: a tensor per table), synced and dropped
from the page cache. Then, for each of `--prompts` new prompts of 512 random ids in 100-19999 (as
cold_rows.py draws them; the worst case), each layout in turn (the order rotated per prompt, so a
shared machine's drift falls on all alike): the page cache dropped, every group's reads advised at
once (posix_fadvise(WILLNEED), on one thread of a pool of `STEM_READ_THREADS`, as `MmapTables` does
at forward start), and each group's rows read on the pool, in the order the forward would take them.
*First group*: when the rows of the first G layers were all in; *all rows*: when every row was; then
the same prompt again, *warm*. The dense parent's prefill of the same 512 ids (fp32, one process,
median of 3) is the time the reads could hide behind. Milliseconds are medians over the prompts.
The scratch files are deleted at the end.
"""

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cold_rows import PROMPT_TOKENS, load, prefill  # noqa: E402
from inference import machine, prepare  # noqa: E402
from stem_upcycle.modeling.stem_tables import READ_THREADS  # noqa: E402
from stem_upcycle.loading import stem_tables  # noqa: E402
from stem_upcycle.modeling.table_files import TableFile, advise_rows, read_rows  # noqa: E402
from stem_upcycle.source import open_source  # noqa: E402

ROWS = 20000  # the prompts' ids are drawn below this
COPY_ROWS = 2048  # rows per layer copied at a time into a layout's scratch file


def write_layout(placed, group: int, path: Path) -> list[TableFile]:
    """Rows 0..ROWS-1 of the tables of `placed` (the checkpoint's, `MmapTables`) into `path`, `group` layers'
    rows of each token side by side; the groups as tables of [ROWS, group x d_ff] rows. The file is synced so
    that dropping it from the page cache works."""
    layers, groups, offset = sorted(placed.stored), [], 0
    with open(path, "wb") as out:
        for first in range(0, len(layers), group):
            members = layers[first : first + group]
            for begin in range(0, ROWS, COPY_ROWS):
                stop = min(begin + COPY_ROWS, ROWS)
                out.write(torch.cat([placed.read_range(layer, begin, stop) for layer in members], dim=1)
                          .view(torch.uint8).numpy().tobytes())
            table = placed.stored[members[0]]
            width, dtype = len(members) * table.shape[1], table.float_dtype
            groups.append(TableFile(str(path), offset, (ROWS, width), dtype))
            offset += ROWS * width * dtype.itemsize
        out.flush()
        os.fsync(out.fileno())
    return groups


def drop(paths: set[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def read_all(groups: list[TableFile], fds: dict[str, int], ids: torch.Tensor, pool: ThreadPoolExecutor) -> tuple[float, float]:
    """(ms until the first group's rows were in, ms until all were): the advice of every group on the pool,
    then each group's rows read on it in shares, group after group, as `MmapTables` reads a forward's rows."""
    started = time.perf_counter()
    advice = pool.submit(lambda: [advise_rows(fds[g.path], g, ids) for g in groups])
    step = -(-ids.numel() // READ_THREADS)
    reads = []
    for g in groups:
        out = torch.empty(ids.numel(), g.shape[1], dtype=g.dtype)
        reads.append([pool.submit(read_rows, fds[g.path], g, ids[b : b + step], out[b : b + step])
                      for b in range(0, ids.numel(), step)])
    wait(reads[0])
    first = time.perf_counter() - started
    wait([read for group in reads for read in group] + [advice])
    for read in [read for group in reads for read in group]:
        read.result()
    return 1000 * first, 1000 * (time.perf_counter() - started)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=str(ROOT / "runs" / "inference-bench"), help="where cold_rows.py makes its models")
    parser.add_argument("--groups", default="1,5,10,30", help="layers per group, comma-separated (1: layer-major, a "
                        "tensor per table; the number of STEM layers: token-major)")
    parser.add_argument("--prompts", type=int, default=6, help="new prompts of 512 random ids")
    args = parser.parse_args()
    work = Path(args.work)
    paths = prepare(work, "smollm2", variants={"stem-all": "all"})
    placed = stem_tables(open_source(str(paths["stem-all"])))
    layers = len(placed.stored)
    scratch = work / "smollm2" / "row-layouts"
    scratch.mkdir(exist_ok=True)
    layouts = {}
    try:
        for group in [int(g) for g in args.groups.split(",")]:
            name = "layer-major" if group == 1 else "token-major" if group >= layers else f"groups of {group}"
            layouts[name] = write_layout(placed, group, scratch / f"g{group}.bin")
        torch.set_num_threads(2)
        dense = load(str(paths["dense"]), "float32")
        ids = [torch.randint(100, ROWS, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(i)).unique()
               for i in range(args.prompts)]
        prefill(dense, ids[0])
        dense_ms = statistics.median(1000 * PROMPT_TOKENS / prefill(dense, ids[0]) for _ in range(3))
        fds = {g.path: os.open(g.path, os.O_RDONLY) for groups in layouts.values() for g in groups}
        for fd in fds.values():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        results = {name: {"first": [], "all": [], "warm": []} for name in layouts}
        names = list(layouts)
        with ThreadPoolExecutor(READ_THREADS) as pool:
            for i, prompt in enumerate(ids):
                for name in names[i % len(names):] + names[: i % len(names)]:
                    groups = layouts[name]
                    drop({g.path for g in groups})
                    first, all_ = read_all(groups, fds, prompt, pool)
                    results[name]["first"].append(first)
                    results[name]["all"].append(all_)
                    results[name]["warm"].append(read_all(groups, fds, prompt, pool)[1])
        table = next(iter(placed.stored.values()))
        print(f"SmolLM2-135M, all {layers} layers, {table.float_dtype} rows of "
              f"{table.shape[1] * table.float_dtype.itemsize} bytes: "
              f"{machine()}; STEM_READ_THREADS={READ_THREADS}")
        print(f"{args.prompts} prompts of {PROMPT_TOKENS} random ids ({statistics.median(p.numel() for p in ids):.0f} "
              f"distinct); the dense parent's prefill of one: {dense_ms:.0f} ms")
        print("| layout | reads per prompt | first group ready, cold (ms) | all rows, cold (ms) | all rows, warm (ms) "
              "| all cold rows / dense prefill |")
        print("|---|---|---|---|---|---|")
        n = statistics.median(p.numel() for p in ids)
        for name, r in results.items():
            cold = statistics.median(r["all"])
            print(f"| {name} | {n * len(layouts[name]):.0f} | {statistics.median(r['first']):.0f} | {cold:.0f} "
                  f"| {statistics.median(r['warm']):.0f} | {cold / dense_ms:.2f}x |")
    finally:
        for file in scratch.glob("g*.bin"):
            file.unlink()


if __name__ == "__main__":
    main()
