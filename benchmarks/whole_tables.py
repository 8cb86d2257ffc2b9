"""Whole tables read from a grouped checkpoint, as training's shared copy, `compress` and `inspect --tables` read
them: each STEM layer's table by ranges of rows, a table after another.

    python benchmarks/whole_tables.py                      # SmolLM2-135M shapes, 10 layers in groups of 5, fp32
    python benchmarks/whole_tables.py --layers 30 --group 5

Tables stored in groups of layers (`convert`'s default, 5 layers a group) hold a token's rows of the group's layers
side by side. Two ways of reading one layer's table, in one run on the same files:

- *group rows* (stem-upcycle before issue 38): each range's rows of the whole group, the layer's columns kept:
  reading every table reads each group once per layer in it;
- *own columns* (`MmapTables.read_range` now): one positioned read per row, of the layer's columns alone.

The checkpoint is random tables of the shapes asked for, written under --work and deleted at the end. Each way runs
cold (the files dropped from the page cache first) and then warm; bytes are those the reads asked for (counted at
os.preadv), seconds the wall time of the reads alone.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from inference import machine  # noqa: E402
from row_layout import drop  # noqa: E402
from stem_upcycle.modeling.stem_tables import MmapTables  # noqa: E402
from stem_upcycle.modeling.table_files import locate_table_groups  # noqa: E402
from stem_upcycle.training.tables import ROWS_PER_COPY  # noqa: E402


def write_groups(folder: Path, groups: list[list[int]], vocab: int, d_ff: int) -> dict[str, str]:
    """A safetensors file per group (`model.stem_table_groups.K.weight`); tensor name -> file."""
    files = {}
    for k, group in enumerate(groups):
        name, path = f"model.stem_table_groups.{k}.weight", folder / f"group-{k}.safetensors"
        save_file({name: torch.randn(vocab, len(group) * d_ff)}, str(path))
        with open(path, "rb+") as f:  # on disk, so that `drop` can take its pages from the page cache
            os.fsync(f.fileno())
        files[name] = str(path)
    return files


def group_rows(tables: MmapTables, layer: int, start: int, stop: int) -> torch.Tensor:
    """The reading before: the group's rows of the range, the layer's columns kept."""
    table = tables.stored[layer]
    return table.format.decode(tables.read_parts(layer, torch.arange(start, stop)), table.float_dtype)


def read_all(read, tables: MmapTables, vocab: int) -> None:
    for layer in sorted(tables.stored):
        for start in range(0, vocab, ROWS_PER_COPY):
            read(layer, start, min(start + ROWS_PER_COPY, vocab))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10, help="STEM layers")
    parser.add_argument("--group", type=int, default=5, help="layers per group")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--d-ff", type=int, default=1536)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "whole-tables")
    args = parser.parse_args()
    print(machine())
    groups = [list(range(i, min(i + args.group, args.layers))) for i in range(0, args.layers, args.group)]
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        files = write_groups(args.work, groups, args.vocab, args.d_ff)
        shapes = {layer: (args.vocab, args.d_ff) for group in groups for layer in group}
        tables = MmapTables(locate_table_groups(files, groups, shapes))
        table_bytes = args.layers * args.vocab * args.d_ff * 4
        print(f"{args.layers} tables of [{args.vocab}, {args.d_ff}] fp32 in groups of {args.group}: "
              f"{table_bytes / 1e9:.2f} GB of tables")
        counted = []
        preadv = os.preadv
        os.preadv = lambda fd, buffers, offset: counted.append(sum(map(len, buffers))) or preadv(fd, buffers, offset)
        print("| way | GB read | cold s | warm s |\n|---|---|---|---|")
        for label, read in (("group rows (before)", lambda *a: group_rows(tables, *a)),
                            ("own columns (now)", tables.read_range)):
            seconds = []
            for cold in (True, False):
                if cold:
                    drop(files.values())
                counted.clear()
                started = time.perf_counter()
                read_all(read, tables, args.vocab)
                seconds.append(time.perf_counter() - started)
            print(f"| {label} | {sum(counted) / 1e9:.2f} | {seconds[0]:.1f} | {seconds[1]:.1f} |")
        os.preadv = preadv
    finally:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
