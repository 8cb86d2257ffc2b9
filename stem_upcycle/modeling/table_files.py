"""A STEM checkpoint's table files: where each table's tensors lie (safetensors headers read directly), and
reading one whole or some of its rows.

Exported next to the weights, so it imports only torch, transformers and the standard library.
"""

import json
import math
import os
import re
import struct
from dataclasses import dataclass

import torch

from .table_format import FLOAT_DTYPES, TableFormat

# safetensors' dtype codes; the one table of them (shards.py and source.py read it too): this file is exported
# next to the weights and imports only torch.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


# A group of tables (`config.stem_table_groups`) is the tensor `<base prefix>.stem_table_groups.K.weight`.
TABLE_GROUP_PREFIX = "stem_table_groups"
# The name of every tensor that holds table rows, whatever the base model's prefix: a table's own (float rows, or
# compressed values and scales: table_format.py) or a group's. The one test of it: `is_table_tensor`, and Transformers'
# and vLLM's loaders skip what it matches where the tables are not parameters.
TABLE_TENSOR = rf"(^|\.)layers\.\d+\.mlp\.up_table\.(weight|qweight|scales)$|(^|\.){TABLE_GROUP_PREFIX}\.\d+\.weight$"


def is_table_tensor(name: str) -> bool:
    return re.search(TABLE_TENSOR, name) is not None


class StemTablesError(ValueError):
    """A table placement that cannot work here; the message names the problem and the fix."""


@dataclass(frozen=True)
class TableFile:
    """Where one tensor of a table is: a safetensors shard and the tensor's byte range in it."""

    path: str
    offset: int  # from the start of the file
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return self.shape[1] * self.dtype.itemsize


@dataclass(frozen=True)
class StoredTable:
    """One STEM layer's table as its checkpoint holds it: the format of its rows and, per stored part
    (`weight` for float rows; `qweight` and `scales` for compressed ones), where that tensor is. A table
    stored in a group of layers (`config.stem_table_groups`) is `columns` of the group's tensor, whose
    row holds the rows of every layer of the group side by side."""

    format: TableFormat
    parts: dict  # part name -> TableFile
    shape: tuple[int, int]  # [vocab, k] of the decoded table (k: the layer's table columns)
    columns: tuple[int, int] | None = None  # (first, stop) of the stored row's columns that are this table's

    @property
    def nbytes(self) -> int:
        """The bytes of this table's rows (of a grouped table: its share of the group's)."""
        share = 1 if self.columns is None else (self.columns[1] - self.columns[0]) / self.parts["weight"].shape[1]
        return round(sum(part.nbytes for part in self.parts.values()) * share)

    def own(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Of stored rows [n, ...] of each part, this table's columns (a grouped table's, of its group's rows)."""
        if self.columns is None:
            return parts
        return {name: rows[:, self.columns[0] : self.columns[1]] for name, rows in parts.items()}

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype rows are read in: a float table's own; float32 for a compressed one."""
        return torch.float32 if self.format.compressed else self.parts["weight"].dtype


def stored_tensors(stored: dict[int, StoredTable]) -> dict[TableFile, list[int]]:
    """Each tensor the tables are stored in, and the STEM layers whose rows it holds (several: a group's,
    `config.stem_table_groups`), in layer order: where every reader learns what to read once for several layers."""
    tensors = {}
    for layer in sorted(stored):
        for where in stored[layer].parts.values():
            tensors.setdefault(where, []).append(layer)
    return tensors


def read_header(path: str) -> tuple[dict, int]:
    """(tensor entries, offset of the data) of a safetensors file.

    The format is an 8-byte length and a JSON header; the safetensors library does not expose the
    byte offsets that mapping a tensor needs, so the header is read here."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or 8 + length > size:
            raise StemTablesError(f"{path} is truncated or not a safetensors file; download or export it again")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise StemTablesError(f"{path} has a corrupt safetensors header; download or export it again") from None
    header.pop("__metadata__", None)
    end = 8 + length + max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if end > size:
        raise StemTablesError(f"{path} is truncated ({size} bytes, its header describes {end}); "
                              f"download or export it again")
    return header, 8 + length


def locate_tables(checkpoint_files: dict[str, str], names: dict[int, str], shapes: dict[int, tuple[int, int]],
                  table_format: TableFormat | None = None, headers: dict | None = None) -> dict[int, StoredTable]:
    """Per STEM layer, its table's parts (files and byte ranges), checked against its shape in `shapes` ([vocab,
    its columns]), the format (`table_format`; None: float rows, as the files say) and the files' sizes
    (`read_header`: a mapped read past the end of a file is a SIGBUS, never an error message). `headers`: file ->
    `read_header` of it, filled as files are read (one dict for several calls reads each file's header once)."""
    headers = {} if headers is None else headers
    located = {}
    for layer, prefix in names.items():
        vocab, d_ff = shapes[layer]
        found = table_format or TableFormat("float32")  # a float table's dtype is the file's
        parts = {}
        for part, (per_row, dtype) in found.parts(d_ff).items():
            name = f"{prefix}.{part}"
            path = checkpoint_files.get(name)
            if path is None:
                raise StemTablesError(f"the checkpoint has no tensor {name} (layer {layer} is a STEM layer"
                                      + (f" with {found.dtype} tables" if found.compressed else "")
                                      + "); the checkpoint is incomplete: export it again")
            if not os.path.isfile(path):
                raise StemTablesError(f"{path} holds {name} but is missing; download or export the checkpoint again")
            if path not in headers:
                headers[path] = read_header(path)
            header, data_start = headers[path]
            entry = header.get(name)
            stored = SAFETENSORS_DTYPES.get(entry.get("dtype")) if entry else None
            if stored != dtype if found.compressed else stored not in FLOAT_DTYPES.values():
                raise StemTablesError(f"{path} does not hold {name} as {'a float tensor' if not found.compressed else dtype}; "
                                      f"the index, the shard and config.json disagree: export the checkpoint again")
            begin, end = entry["data_offsets"]
            table = TableFile(path, data_start + begin, tuple(entry["shape"]), stored)
            if table.shape != (vocab, per_row) or end - begin != table.nbytes:
                raise StemTablesError(f"{name} in {path} has shape {list(table.shape)}, the config says "
                                      f"{[vocab, per_row]}")
            parts[part] = table
        if not found.compressed:
            found = TableFormat(next(k for k, v in FLOAT_DTYPES.items() if v == parts["weight"].dtype))
        located[layer] = StoredTable(found, parts, (vocab, d_ff))
    return located


def locate_table_groups(checkpoint_files: dict[str, str], groups: list[list[int]], shapes: dict[int, tuple[int, int]],
                        headers: dict | None = None) -> dict[int, StoredTable]:
    """Per STEM layer, its table as `columns` of its group's tensor (`model.stem_table_groups.K.weight`
    [vocab, its layers' columns side by side], float rows; `groups`: `config.stem_table_groups`; `shapes`: each
    layer's table's [vocab, columns]), checked as `locate_tables` checks a table."""
    located = {}
    for k, group in enumerate(groups):
        suffix = f"{TABLE_GROUP_PREFIX}.{k}.weight"
        name = next((n for n in checkpoint_files if n == suffix or n.endswith("." + suffix)), f"model.{suffix}")
        if name not in checkpoint_files:
            raise StemTablesError(f"the checkpoint has no tensor {name}, where config.stem_table_groups stores the "
                                  f"tables of layers {group}; the checkpoint is incomplete: export it again")
        vocab, start = shapes[group[0]][0], 0
        width = sum(shapes[layer][1] for layer in group)
        group_table = locate_tables(checkpoint_files, {k: name.removesuffix(".weight")}, {k: (vocab, width)}, None,
                                    headers)[k]
        for layer in group:
            stop = start + shapes[layer][1]
            located[layer] = StoredTable(group_table.format, group_table.parts, shapes[layer], (start, stop))
            start = stop
    return located


def locate_tensor(checkpoint_files: dict[str, str], suffix: str, shape: tuple[int, ...], headers: dict) -> TableFile:
    """Where the float tensor whose name ends in `suffix` (whatever the base model's prefix) lies,
    checked against `shape`; `headers` as `locate_tables` takes it."""
    name = next((n for n in checkpoint_files if n.endswith(suffix)), None)
    path = checkpoint_files.get(name)
    if path is None or not os.path.isfile(path):
        raise StemTablesError(f"the checkpoint has no tensor *{suffix}, or its file is missing; export it again")
    if path not in headers:
        headers[path] = read_header(path)
    header, data_start = headers[path]
    entry = header.get(name)
    if entry is None:
        raise StemTablesError(f"{path} does not hold {name}, which the checkpoint's index places there; "
                              f"export the checkpoint again")
    begin, end = entry["data_offsets"]
    tensor = TableFile(path, data_start + begin, tuple(entry["shape"]), SAFETENSORS_DTYPES.get(entry["dtype"]))
    if tensor.dtype not in FLOAT_DTYPES.values() or tensor.shape != shape or end - begin != tensor.nbytes:
        raise StemTablesError(f"{name} in {path} is a {entry['dtype']} tensor of shape {list(tensor.shape)}, the "
                              f"config says a float tensor of shape {list(shape)}; export the checkpoint again")
    return tensor


def checkpoint_files(pretrained_model_name_or_path, hub_kwargs: dict) -> dict[str, str] | None:
    """Tensor name -> local safetensors file of a checkpoint (a directory, or a hub id: its files downloaded as
    `from_pretrained` downloads them, or found in the cache), or None when it has no safetensors files (tables can
    then only be loaded into memory). Runs before Transformers fetches the weights: the tables are located first."""
    from transformers.utils import cached_file
    from transformers.utils.hub import get_checkpoint_shard_files

    def find(filename):
        return cached_file(pretrained_model_name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                           **hub_kwargs)

    if not os.path.isdir(pretrained_model_name_or_path):  # a hub id neither cached nor reachable raises OSError here,
        cached_file(pretrained_model_name_or_path, "config.json", **hub_kwargs)  # not "no safetensors files" below
    index = find("model.safetensors.index.json")
    if index:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        # every shard, fetched by Transformers' own resolution (a hub id's shards are not downloaded yet); the
        # weights' load then finds them in the cache
        shards, _ = get_checkpoint_shard_files(pretrained_model_name_or_path, index, **hub_kwargs)
        local = {os.path.basename(shard): shard for shard in shards}
        return {name: local.get(os.path.basename(shard), os.path.join(os.path.dirname(index), shard))
                for name, shard in weight_map.items()}
    single = find("model.safetensors")
    if single:
        header, _ = read_header(single)
        return {name: single for name in header}
    return None


def read_whole(table: TableFile) -> torch.Tensor:
    """The tensor read from its file into host memory."""
    # device="cpu" also under a `torch.device("meta")` context, where vLLM builds its models
    tensor = torch.empty(table.shape, dtype=table.dtype, device="cpu")
    fd = os.open(table.path, os.O_RDONLY)
    try:
        read_rows(fd, table, torch.arange(table.shape[0], device="cpu"), tensor)  # one run: every row
    finally:
        os.close(fd)
    return tensor


def runs_of(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first id, begin, stop) of each run of consecutive ids (ids[i + 1] == ids[i] + 1) in `ids` [n]:
    ids[begin:stop], whose rows lie side by side in a table."""
    n = ids.numel()
    if not n:
        return []
    starts = torch.cat([ids.new_zeros(1), (ids[1:] != ids[:-1] + 1).nonzero().flatten() + 1])  # ids' device: the CPU
    bounds = torch.cat([starts, starts.new_tensor([n])]).tolist()
    return list(zip(ids[starts].tolist(), bounds, bounds[1:]))


def read_rows(fd: int, table: TableFile, ids: torch.Tensor, out: torch.Tensor, runs: list | None = None) -> None:
    """Rows `ids` [n] of `table` into `out` [n, width], by positioned reads of the open file `fd`: one
    read per run of consecutive ids, repeated where the kernel returns less (a read stops at 2 GB on Linux).
    os.preadv releases the GIL, so reads issued from several threads wait on the disk together. `runs`: `runs_of(ids)`,
    where the caller found them already (one forward's ids, read from every table)."""
    if not ids.numel():
        return
    buffer = memoryview(out.view(torch.uint8).numpy()).cast("B")
    size = table.row_bytes
    for token, begin, stop in runs_of(ids) if runs is None else runs:
        _read_fully(fd, table, buffer[begin * size : stop * size], table.offset + token * size)


def read_columns(fd: int, table: TableFile, start: int, columns: tuple[int, int], out: torch.Tensor) -> None:
    """Columns `columns` (first, stop) of rows start.. of `table` into `out` [rows, stop - first], one positioned
    read per row: a grouped table's own share of its group's rows, which lie apart in the file. The rows' range is
    asked of the disk first, in one advice, and `fd` should read ahead (the kernel's default): without either, as
    `MmapTables` opens files for a forward's rows, a cold table waits on the disk once per row, 3-4x slower than
    a read of the group's rows whole (benchmarks/whole_tables.py)."""
    buffer = memoryview(out.view(torch.uint8).numpy()).cast("B")
    size = (columns[1] - columns[0]) * table.dtype.itemsize
    os.posix_fadvise(fd, table.offset + start * table.row_bytes, out.shape[0] * table.row_bytes, os.POSIX_FADV_WILLNEED)
    offset = table.offset + start * table.row_bytes + columns[0] * table.dtype.itemsize
    for i in range(out.shape[0]):
        _read_fully(fd, table, buffer[i * size : (i + 1) * size], offset + i * table.row_bytes)


def _read_fully(fd: int, table: TableFile, view: memoryview, offset: int) -> None:
    """`view` filled from `offset` of `table`'s file, read again where the kernel returns less (a read stops at
    2 GB on Linux)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise StemTablesError(f"{table.path} ended while reading table rows; download or export it again")
        done += got


def advise_rows(fd: int, table: TableFile, ids: torch.Tensor, runs: list | None = None) -> None:
    """Ask the kernel to start reading rows `ids` [n] of `table` into the page cache, and return without
    waiting (posix_fadvise(WILLNEED), one call per run of consecutive ids). The reads of rows not yet
    cached then wait on the disk all together, not a few at a time as blocking reads on a few threads
    do: on 2 cores, 15,000 cold SmolLM2 rows were read in 0.4 s instead of 1.0 s (cold_rows.py)."""
    size = table.row_bytes
    for token, begin, stop in runs_of(ids) if runs is None else runs:
        os.posix_fadvise(fd, table.offset + token * size, (stop - begin) * size, os.POSIX_FADV_WILLNEED)
