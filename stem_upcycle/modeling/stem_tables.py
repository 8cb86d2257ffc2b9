"""Where a STEM model's tables live at inference, chosen at load time: `from_pretrained(..., stem_tables=...)`.

- "memory": tables are ordinary parameters (`nn.Embedding`), as training needs them; compressed
  tables (int8, fp8, int4: `table_format.py`) are held whole as stored and decoded row by row.
- "mmap": tables stay in the safetensors shards (read-only); each forward reads the rows of its
  distinct ids, decoded and cast to the compute dtype as they are gathered. Nothing reads a whole table.
- "host": for accelerators: tables in host memory, a row cache on the device
  shared by all STEM layers; a forward copies its missing rows for every layer in one pass, on a
  side stream, so the copy overlaps the layers before the first STEM layer.

A forward's ids travel from the base model's pre-hook to the STEM MLPs in a `ForwardIds`, kept per
thread (`IdHandoff`), which also holds the copies the row sources need (on each device, on the
CPU, distinct ids) so that each is made once per forward. A run-time edit (`RowEdit`) adds the ids
whose rows replace those of some positions to the ids a forward looks up, so that every placement
serves them as it serves the rest (a device row cache included).

Exported next to the weights, so it imports only torch, transformers and the standard library.
"""

import json
import math
import os
import struct
import threading
import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from .table_format import FLOAT_DTYPES, TableFormat

PLACEMENTS = ("memory", "mmap", "host")
DEFAULT_CACHE_ROWS = 2048  # the official STEM engine's LFU cache size
# safetensors' dtype codes; the one table of them (shards.py and source.py read it too): this file is exported
# next to the weights and imports only torch.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class StemTablesError(ValueError):
    """A table placement that cannot work here; the message names the problem and the fix."""


# --- a forward's ids -------------------------------------------------------------------------------


class ForwardIds:
    """The input ids of one forward [batch, seq], the ids its tables are read at, and the copies made
    of those, each made once.

    Without an edit the lookup ids are the input ids. With one (`ForwardEdit`), they are the input
    ids flattened [batch * seq] followed by the edit's target ids [m]: the placements read those rows
    like any other, and `edited` puts them in place."""

    def __init__(self, ids: torch.Tensor, edit: "ForwardEdit | None" = None,
                 first: "tuple[torch.Tensor, torch.Tensor] | None" = None):
        self.ids = ids
        self.edit = edit
        self.first = first  # (batch rows, positions) of the sequences' first tokens in this forward (`first_tokens`)
        self.lookup = ids if edit is None else torch.cat([ids.flatten(), edit.target_ids.flatten().to(ids.device)])
        self._on = {self.lookup.device: self.lookup}
        self._unique = None
        self.plan = None  # what a placement prepared for this forward (host: slots or staged rows)

    def on(self, device: torch.device) -> torch.Tensor:
        """The lookup ids on `device` (a split model's layers sit on several devices)."""
        if device not in self._on:
            # non_blocking only toward an accelerator: a non-blocking copy to the host returns a pinned buffer
            # still being written, and the host reads these ids at once (`unique`, row reads)
            self._on[device] = self.lookup.to(device, non_blocking=device.type != "cpu")
        return self._on[device]

    @property
    def cpu(self) -> torch.Tensor:
        return self.on(torch.device("cpu"))

    def unique(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted distinct lookup ids, index of each lookup into them), on the CPU."""
        if self._unique is None:
            self._unique = torch.unique(self.cpu, return_inverse=True)
        return self._unique

    def edited(self, rows: torch.Tensor, layer: int | None) -> torch.Tensor:
        """The rows [batch, seq, d_ff] of the input ids from the rows read at the lookup ids; at the
        edit's positions, in the layers it edits, the weighted sums of its target rows instead."""
        if self.edit is None:
            return rows
        batch, seq = self.ids.shape
        own, extra = rows[: batch * seq].view(batch, seq, -1), rows[batch * seq :]  # [b, s, d_ff], [m, d_ff]
        if not self.edit.edits(layer):
            return own
        target = extra.view(*self.edit.target_ids.shape, -1)  # [n, k, d_ff]
        weights = self.edit.weights.to(target.device, target.dtype)[..., None]  # [n, k, 1]
        own = own.clone()
        own[self.edit.rows.to(own.device), self.edit.positions.to(own.device)] = (target * weights).sum(1)
        return own


@dataclass(frozen=True)
class ForwardEdit:
    """The part of a `RowEdit` that falls in one forward: batch rows and positions of its input."""

    rows: torch.Tensor  # [n]
    positions: torch.Tensor  # [n] counted from the forward's first token
    target_ids: torch.Tensor  # [n, k]
    weights: torch.Tensor  # [n, k]
    layers: frozenset | None

    def edits(self, layer: int | None) -> bool:
        return self.layers is None or layer in self.layers


@dataclass(frozen=True)
class RowEdit:
    """A run-time edit of the rows a STEM model looks up: at some positions of a prompt, the weighted
    sum of other ids' rows replaces the row of the id there, in some STEM layers. Input ids, tables
    and every other position are untouched. Set on a model with `model.set_stem_row_edit(edit)`, for
    the forwards of the calling thread.

    It is made for a prompt, or a padded batch of prompts (`prompt_ids`, -1 at the padding), and a
    forward is checked to hold every token of them: an input that is another prompt, or the batch
    padded otherwise, is refused rather than edited at the wrong tokens. A batch of b*m rows is the
    b prompts each repeated m times in place (as generate() repeats them for beams or several
    returned sequences); one prompt edits every row of a batch of it. Positions count from the
    sequence's first token (padding included), so the edit follows the prompt through a KV cache:
    the forward reading positions p..p+s-1 (p: tokens already cached) edits those that fall there."""

    prompt_ids: torch.Tensor  # [b, L] the prompts as the input holds them, -1 at the padding
    rows: torch.Tensor  # [n] the prompt (row of prompt_ids) of each edited position
    positions: torch.Tensor  # [n] positions in the padded prompt; (row, position) pairs distinct
    target_ids: torch.Tensor  # [n, k] ids whose rows, weighted, replace the row at each position
    weights: torch.Tensor  # [n, k] (0 for the padding of positions that read fewer than k ids)
    layers: frozenset | None = None  # STEM layers edited; None: all

    def for_forward(self, ids: torch.Tensor, past: int) -> ForwardEdit | None:
        """The edit of a forward of `ids` [batch, seq] after `past` cached tokens; None if it edits none."""
        inside = (self.positions >= past) & (self.positions < past + ids.shape[1])
        if not bool(inside.any()):
            return None
        prompts, length = self.prompt_ids.shape
        if ids.shape[0] % prompts:
            raise ValueError(f"the row edit was made for {prompts} prompts and the input holds {ids.shape[0]} rows: "
                             f"the input is not the batch the edit was made for")
        copies = ids.shape[0] // prompts  # rows per prompt, in place: prompt r is rows r*copies .. r*copies+copies-1
        stop = min(past + ids.shape[1], length)
        expected = self.prompt_ids[:, past:stop].repeat_interleave(copies, 0)  # [batch, stop - past]
        found = ids[:, : stop - past].cpu()  # a copy per forward that edits (the prompt's)
        wrong = ((expected >= 0) & (expected != found)).any(1)
        if bool(wrong.any()):
            row = int(wrong.nonzero()[0])
            raise ValueError(f"the row edit expects ids {expected[row].tolist()} at positions {past}-{stop - 1} of row "
                             f"{row} (-1: padding) and the input holds {found[row].tolist()}: the input is not the "
                             f"prompt the edit was made for (a batch: padded as the tokenizer pads it)")
        rows = (self.rows[inside][:, None] * copies + torch.arange(copies)).flatten()  # [n * copies]
        return ForwardEdit(rows, (self.positions[inside] - past).repeat_interleave(copies),
                           self.target_ids[inside].repeat_interleave(copies, 0),
                           self.weights[inside].repeat_interleave(copies, 0), self.layers)


def first_tokens(ids: torch.Tensor, kwargs: dict, past: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(batch rows, positions) in a forward of `ids` [batch, seq] of each sequence's first token: where
    the position ids are 0 if the forward has them on the CPU, or has them with neither a mask nor a
    cache (vLLM packs a batch's sequences into one row [1, tokens], each numbered from 0); else the
    first position its 2-D attention mask admits (left padding skipped), position 0 without a mask.

    That token attends to itself alone, so its hidden states are a function of its id alone, unlike
    any other position's; the dense model makes it its attention sink. A forward after `past` cached
    tokens holds first tokens only where the padding reaches past the cache, which is checked where
    the mask is on the CPU; on an accelerator that check would stall every decode step on a copy to
    the host, so there first tokens are taken to be in the forward that starts the sequence (as in
    `generate()`, unless it prefills in chunks shorter than a left padding)."""
    mask = kwargs.get("attention_mask")
    batch, seq = ids.shape
    positions = kwargs.get("position_ids")
    if (positions is not None and positions.shape == ids.shape
            and (positions.device.type == "cpu" or (mask is None and not past))):
        rows, starts = (positions == 0).nonzero(as_tuple=True)
        return (rows, starts) if rows.numel() else None
    usable = mask is not None and mask.dim() == 2 and mask.shape == (batch, past + seq)
    if past and not (usable and mask.device.type == "cpu"):
        return None
    start = mask.int().argmax(1) if usable else torch.zeros(batch, dtype=torch.long, device=ids.device)  # [batch]
    rows = torch.arange(batch, device=start.device)
    if past:  # on the CPU: only the sequences whose first token falls in this forward
        inside = (start >= past) & (start < past + seq)
        if not bool(inside.any()):
            return None
        rows, start = rows[inside], start[inside]
    return rows, start - past


def cached_length(kwargs: dict) -> int:
    """Tokens already in the KV cache a decoder forward was given (`cache` in Transformers 5,
    `past_key_values` before)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    return int(cache[0][0].shape[-2]) if len(cache) else 0  # legacy tuple of (key, value) per layer


class IdHandoff:
    """The current forward's ids of one model, per thread, so that two threads can run the model at once.

    Decoder layers hand only hidden states to their MLP. Gradient checkpointing recomputes layers
    during backward, which on an accelerator runs in autograd's own threads; there the ids of the
    model's latest forward are used (training runs one forward at a time).
    """

    def __init__(self):
        self._local = threading.local()
        self._latest = None

    @property
    def edit(self) -> "RowEdit | None":
        """The run-time edit of this thread's forwards (`RowEdit`), if any."""
        return getattr(self._local, "edit", None)

    @edit.setter
    def edit(self, edit: "RowEdit | None") -> None:
        self._local.edit = edit

    def start(self, ids: torch.Tensor, edit: ForwardEdit | None = None,
              first: tuple[torch.Tensor, torch.Tensor] | None = None) -> ForwardIds:
        forward = ForwardIds(ids, edit, first)
        self._local.current = self._latest = forward
        return forward

    def current_of_thread(self) -> ForwardIds | None:
        return getattr(self._local, "current", None)

    def current(self, x: torch.Tensor) -> ForwardIds:
        forward = getattr(self._local, "current", None) or self._latest
        if forward is None or forward.ids.shape != x.shape[:-1]:
            raise RuntimeError(
                "STEM MLP called without matching input ids; call the model with input_ids so that "
                "its STEM layers can look up their table rows"
            )
        return forward


def check_ids(ids: torch.Tensor, vocab: int) -> None:
    """Ids outside the tables are a clear error. Checked only where the ids already are on the CPU:
    on an accelerator the check would stall every decode step on a device-to-host copy."""
    if ids.device.type == "cpu" and ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"input_ids must lie in [0, {vocab - 1}] (the STEM tables have {vocab} rows); "
                             f"got values from {low} to {high}")


# --- the tables' files -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TableFile:
    """Where one tensor of a table is: a safetensors shard and the tensor's byte range in it."""

    path: str
    offset: int  # from the start of the file
    shape: tuple[int, int]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return self.shape[1] * self.dtype.itemsize


@dataclass(frozen=True)
class StoredTable:
    """One STEM layer's table as its checkpoint holds it: the format of its rows and, per stored part
    (`weight` for float rows; `qweight` and `scales` for compressed ones), where that tensor is."""

    format: TableFormat
    parts: dict  # part name -> TableFile
    shape: tuple[int, int]  # [vocab, d_ff] of the decoded table

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts.values())

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype rows are read in: a float table's own; float32 for a compressed one."""
        return torch.float32 if self.format.compressed else self.parts["weight"].dtype


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


def locate_tables(checkpoint_files: dict[str, str], names: dict[int, str], shape: tuple[int, int],
                  table_format: TableFormat | None = None) -> dict[int, StoredTable]:
    """Per STEM layer, its table's parts (files and byte ranges), checked against `shape`, the format
    (`table_format`; None: float rows, as the files say) and the files' sizes (`read_header`: a mapped
    read past the end of a file is a SIGBUS, never an error message)."""
    headers = {}
    located = {}
    vocab, d_ff = shape
    for layer, prefix in names.items():
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


def checkpoint_files(pretrained_model_name_or_path, hub_kwargs: dict) -> dict[str, str] | None:
    """Tensor name -> local safetensors file of a checkpoint (a directory or a hub id already downloaded),
    or None when it has no safetensors files (tables can then only be loaded into memory)."""
    from transformers.utils import cached_file

    def find(filename):
        return cached_file(pretrained_model_name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                           **hub_kwargs)

    index = find("model.safetensors.index.json")
    if index:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        folder = os.path.dirname(index)
        return {name: os.path.join(folder, shard) for name, shard in weight_map.items()}
    single = find("model.safetensors")
    if single:
        header, _ = read_header(single)
        return {name: single for name in header}
    return None


# --- placements ------------------------------------------------------------------------------------


class PlacedTable(nn.Module):
    """A STEM MLP's `up_table` when the rows live outside the model: no parameter, no buffer, so that
    `.to()`, `device_map` and dtype casts never touch the table."""

    def __init__(self, placement, layer: int):
        super().__init__()
        self.placement, self.layer = placement, layer

    def forward(self, forward: ForwardIds, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self.placement.rows(self.layer, forward, device, dtype)  # [batch, seq, d_ff]

    @property
    def weight(self):
        raise StemTablesError(
            f"the table of layer {self.layer} is placed with stem_tables={self.placement.name!r}: it is not a "
            f"parameter and cannot be trained or assigned; {self.placement.parameters_advice()}"
        )

    def extra_repr(self) -> str:
        return f"layer={self.layer}, stem_tables={self.placement.name!r}"


class RowAccess:
    """What every placement offers over the stored parts of its tables (`read_parts`, `set_parts`):
    rows decoded from them and rows encoded into them, so that a compressed row is replaced with its
    scales and read back as every forward reads it."""

    stored: dict  # layer -> StoredTable

    def read_rows(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """[n, d_ff] rows of `ids` [n] in the table's float dtype (float32 for a compressed table)."""
        table = self.stored[layer]
        return table.format.decode(self.read_parts(layer, ids), table.float_dtype)

    def set_rows(self, layer: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows of `ids` [n] from now on: `rows` [n, d_ff], stored as the table stores rows."""
        self.set_parts(layer, ids, self.stored[layer].format.encode(rows.cpu()))

    def parameters_advice(self) -> str:
        """How to have these tables as parameters, which training, resizing and saving need."""
        compressed = next((t.format.dtype for t in self.stored.values() if t.format.compressed), None)
        if compressed is None:
            return "load the model with stem_tables='memory'"
        return (f"its tables are stored as {compressed}: decompress them into a new folder "
                f"(`stem-upcycle compress MODEL OUT --table-dtype float32`) and load that with stem_tables='memory'")


class MmapTables(RowAccess):
    """Tables left in the checkpoint's files: each forward reads the rows of its distinct ids.

    Rows are read with positioned reads (pread), not by touching a memory map: a fault on a mapped
    file maps the whole page-cache folio around the row (up to 2 MB; measured 1.3 MB of RSS per
    random SmolLM2 row on kernel 6.18, where MADV_RANDOM does not help), so a 512-token prefill
    would map most of every table. A read copies the row alone: RSS grows by the rows gathered,
    and repeated rows come from the page cache. A compressed table's scales (1.6% of its int8
    values' bytes with 128-element blocks, 6% of int4's) are read whole when the model loads, so a
    row costs one read, as a float row does, rather than two (a cold row's scales lie on another page).

    The files are never written: rows set on a loaded model (`set_rows`, a knowledge edit) are kept
    in memory and shadow the files' rows in every read.
    """

    name = "mmap"

    def __init__(self, stored: dict[int, StoredTable]):
        self.stored = stored
        self._fds = {}
        for table in stored.values():
            for part in table.parts.values():
                if part.path not in self._fds:
                    self._fds[part.path] = fd = os.open(part.path, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # cold reads: no readahead around rows
                    weakref.finalize(self, os.close, fd)
        self.overlay = {}  # layer -> {id: {part: row} set on the loaded model}
        self.resident = {layer: {name: _read_whole(where) for name, where in table.parts.items() if name == "scales"}
                         for layer, table in stored.items()}  # layer -> {part: the whole tensor in memory}

    def read_parts(self, layer: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per part, [n, ...] the stored rows of the ids `ids` [n], read from the files."""
        table = self.stored[layer]
        check_ids(ids, table.shape[0])  # a read past a table would return another tensor's bytes
        overlay = self.overlay.get(layer, {})
        tokens = ids.tolist()
        parts = {}
        for name, where in table.parts.items():
            if name in self.resident[layer]:
                parts[name] = self.resident[layer][name][ids]
                for i, token in enumerate(tokens):
                    if token in overlay:
                        parts[name][i] = overlay[token][name]
                continue
            rows = torch.empty(len(tokens), where.shape[1], dtype=where.dtype)
            buffer = memoryview(rows.view(torch.uint8).numpy()).cast("B")
            fd, size = self._fds[where.path], where.row_bytes
            for i, token in enumerate(tokens):
                if token in overlay:
                    rows[i] = overlay[token][name]
                else:
                    os.preadv(fd, [buffer[i * size:(i + 1) * size]], where.offset + token * size)
            parts[name] = rows
        return parts

    def read_range(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """[stop - start, d_ff] rows start..stop-1, decoded, in one positioned read per part (nothing is mapped)."""
        table = self.stored[layer]
        if not 0 <= start <= stop <= table.shape[0]:
            raise ValueError(f"rows {start}..{stop - 1} lie outside the table's {table.shape[0]} rows")
        parts = {}
        for name, where in table.parts.items():
            if name in self.resident[layer]:
                rows = parts[name] = self.resident[layer][name][start:stop].clone()
            else:
                rows = parts[name] = torch.empty(stop - start, where.shape[1], dtype=where.dtype)
                os.preadv(self._fds[where.path], [memoryview(rows.view(torch.uint8).numpy()).cast("B")],
                          where.offset + start * where.row_bytes)
            for token, row in self.overlay.get(layer, {}).items():
                if start <= token < stop:
                    rows[token - start] = row[name]
        return table.format.decode(parts, table.float_dtype)

    def set_parts(self, layer: int, ids: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Stored rows of `ids` [n] from now on, held in memory (the files stay as they are)."""
        overlay = self.overlay.setdefault(layer, {})
        for i, token in enumerate(ids.tolist()):
            overlay[token] = {name: rows[i].clone() for name, rows in parts.items()}

    def rows(self, layer: int, forward: ForwardIds, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        unique, inverse = forward.unique()
        rows = self.stored[layer].format.decode(self.read_parts(layer, unique), dtype)  # [n_distinct, d_ff]
        return rows[inverse].to(device, non_blocking=True)  # [batch, seq, d_ff]

    def begin(self, forward: ForwardIds) -> None:
        pass

    def end(self, forward: ForwardIds) -> None:
        pass


class CompressedMemoryTables(RowAccess):
    """`memory` for compressed tables: their stored parts held whole, where the STEM MLPs' weights are
    (they follow the weights to a device at the next forward). Each forward gathers its ids' parts and
    decodes those rows alone. Float tables in memory are parameters instead (`MemoryTable`), which
    training needs; compressed ones are not trained (see `train`)."""

    name = "memory"

    def __init__(self, stored: dict[int, StoredTable]):
        self.stored = stored
        self.tables = {layer: {name: _read_whole(where) for name, where in table.parts.items()}
                       for layer, table in stored.items()}
        self.mlps = {}  # layer -> its StemMLP (set by the model)

    def read_parts(self, layer: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: part[ids.to(part.device)].cpu() for name, part in self.tables[layer].items()}

    def set_parts(self, layer: int, ids: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        for name, part in self.tables[layer].items():
            part[ids.to(part.device)] = parts[name].to(part.device)

    def begin(self, forward: ForwardIds) -> None:
        for layer, mlp in self.mlps.items():
            device = _home(mlp)[0]
            self.tables[layer] = {name: part.to(device) for name, part in self.tables[layer].items()}

    def rows(self, layer: int, forward: ForwardIds, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        parts = self.tables[layer]
        ids = forward.on(next(iter(parts.values())).device)  # [*lookup]
        rows = self.stored[layer].format.decode({name: part[ids.flatten()] for name, part in parts.items()}, dtype)
        return rows.view(*ids.shape, -1).to(device, non_blocking=True)  # [*lookup, d_ff]

    def end(self, forward: ForwardIds) -> None:
        pass


def accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator else torch.cuda.is_available()


class HostTables(RowAccess):
    """Tables in host memory; on the device, a row cache shared by every STEM layer (one slot holds a
    token's rows for all layers), least-frequently-used rows evicted first. A compressed table's rows
    are copied and cached as stored (values and scales: fewer bytes per row) and decoded as gathered.

    Per forward (`begin`, from the base model's pre-hook): the distinct ids are looked up in the
    cache; the missing ones take the slots of the least used rows that neither this forward nor
    another thread's running forward reads, and their rows of every layer are copied to the device
    on a side stream. A forward with more distinct ids than the cache can give (a long prefill)
    stages its rows in tensors of its own instead and leaves the cache as it is.
    """

    name = "host"

    def __init__(self, stored: dict[int, StoredTable], cache_rows: int):
        self.stored = stored
        # Pageable: the device never reads a table, only rows the host gathers into page-locked staging (`_gather`);
        # registering whole tables page-locked (GBs each) would lock RAM for nothing.
        self.tables = {layer: {name: _read_whole(where) for name, where in table.parts.items()}
                       for layer, table in stored.items()}
        self.mlps = {}  # layer -> its StemMLP, whose weights say device and dtype (set by the model)
        vocab = next(iter(stored.values())).shape[0]
        self.capacity = int(cache_rows)
        # host bookkeeping, device="cpu" also when the model is built under a meta-device context (vLLM)
        self.slot_of = torch.full((vocab,), -1, dtype=torch.long, device="cpu")  # id -> slot; -1: not cached
        self.owner = torch.full((self.capacity,), -1, dtype=torch.long, device="cpu")  # slot -> id; -1: free
        self.uses = torch.zeros(vocab, dtype=torch.long, device="cpu")  # per id: forwards that needed it (LFU)
        self.leases = torch.zeros(self.capacity, dtype=torch.long, device="cpu")  # per slot: forwards reading it
        self.cache = {}  # layer -> {part: [capacity, ...]} on the layer's device (float rows in its dtype)
        self.stats = {"hits": 0, "misses": 0, "staged": 0}  # distinct ids per forward
        self._lock = threading.RLock()
        self._streams = {}  # device -> side stream of the copies
        self._last_copies = {}  # device -> event at the end of the latest copies into its cache
        self._last_reads = {}  # thread id -> {device: event at the end of its latest forward}
        self._local = threading.local()

    def invalidate(self, ids: torch.Tensor | None = None) -> None:
        """Forget cached rows (all, or those of `ids`); called whenever host rows change."""
        with self._lock:
            slots = torch.arange(self.capacity) if ids is None else self.slot_of[ids.cpu()]
            slots = slots[self.owner[slots] >= 0] if ids is None else slots[slots >= 0]
            self.slot_of[self.owner[slots]] = -1
            self.owner[slots] = -1

    def read_parts(self, layer: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per part, the stored rows of `ids` [n] in host memory."""
        return {name: part[ids.cpu()] for name, part in self.tables[layer].items()}

    def set_parts(self, layer: int, ids: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Write stored rows of a host table; the cache forgets them."""
        with self._lock:
            for name, part in self.tables[layer].items():
                part[ids.cpu()] = parts[name].cpu()
            self.invalidate(ids)

    def begin(self, forward: ForwardIds) -> None:
        unique, inverse = forward.unique()
        mlps = self.mlps
        with self._lock:
            self._release(getattr(self._local, "forward", None))  # this thread's last forward, if it raised
            self._local.forward = forward
            self._follow_weights(mlps)
            self.uses[unique] += 1
            slots = self._admit(unique)
            if slots is None:
                self.stats["staged"] += unique.numel()
                staged, events = self._copy(unique, mlps)
                forward.plan = {"staged": staged, "index": self._on_devices(inverse, mlps), "events": events}
                return
            self.leases[slots] += 1
            missing = self.owner[slots] != unique
            misses = int(missing.sum())
            self.stats["hits"] += unique.numel() - misses
            self.stats["misses"] += misses
            if misses:
                evicted = self.owner[slots[missing]]
                self.slot_of[evicted[evicted >= 0]] = -1
                self.owner[slots[missing]] = unique[missing]
                self.slot_of[unique[missing]] = slots[missing]
                _, events = self._copy(unique[missing], mlps, slots[missing])
            else:  # every row cached: no copy, but an earlier forward's copies into those slots may still run
                events = dict(self._last_copies)
            forward.plan = {"index": self._on_devices(slots[inverse], mlps), "leased": slots, "events": events}

    @staticmethod
    def _on_devices(index: torch.Tensor, mlps) -> dict[torch.device, torch.Tensor]:
        """The forward's row index [batch, seq] on every device holding a cache, copied once per forward
        from page-locked memory (a copy from pageable memory would stall the host, once per layer)."""
        devices = {_home(mlp)[0] for mlp in mlps.values()}
        pinned = index.pin_memory() if any(d.type == "cuda" for d in devices) else index
        return {d: pinned.to(d, non_blocking=True) for d in devices}

    def _follow_weights(self, mlps) -> None:
        """(Re)allocate the cache where the STEM MLPs' weights are, float rows in their dtype (after `.to()`)."""
        for layer, mlp in mlps.items():
            device, dtype = _home(mlp)
            wanted = {name: (part.shape[1], _cached_dtype(name, part, dtype)) for name, part in self.tables[layer].items()}
            cache = self.cache.get(layer)
            if cache is None or any(c.device != device or (c.shape[1], c.dtype) != wanted[n] for n, c in cache.items()):
                self.invalidate()
                self.cache[layer] = {name: torch.empty(self.capacity, width, device=device, dtype=kind)
                                     for name, (width, kind) in wanted.items()}

    def _admit(self, unique: torch.Tensor) -> torch.Tensor | None:
        """Slots for `unique` (sorted ids): cached ones where they are, missing ones in the slots of the
        least used rows that nobody reads now; None when there are not enough such slots."""
        if unique.numel() > self.capacity:
            return None
        slots = self.slot_of[unique].clone()
        missing = slots < 0
        needed = int(missing.sum())
        if needed:
            score = torch.where(self.owner >= 0, self.uses[self.owner.clamp(min=0)], -1).double()
            score[slots[~missing]] = math.inf  # this forward's cached rows stay
            score[self.leases > 0] = math.inf  # rows that running forwards read stay
            victims = torch.topk(score, needed, largest=False).indices
            if bool(torch.isinf(score[victims]).any()):
                return None
            slots[missing] = victims
        return slots

    def _copy(self, ids: torch.Tensor, mlps, slots: torch.Tensor | None = None):
        """Copy the rows of `ids` of every layer to its device, into the cache's `slots`, or (no slots)
        into new tensors. Returns (those tensors by layer, {device: event marking the copies' end})."""
        staged, events, slots_on = {}, {}, {}
        for layer, mlp in mlps.items():
            device, dtype = _home(mlp)
            stream = self._side_stream(device)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                if stream is not None:
                    for reads in self._last_reads.values():  # slots that earlier forwards may still read
                        if device in reads:
                            stream.wait_event(reads[device])
                if slots is not None and device not in slots_on:  # once per forward and device, on its stream
                    slots_on[device] = (slots.pin_memory() if stream is not None else slots).to(device, non_blocking=True)
                for name, part in self.tables[layer].items():
                    rows = _gather(part, ids, pin=stream is not None)  # [n, ...] in host memory
                    moved = rows.to(device, _cached_dtype(name, part, dtype), non_blocking=True)
                    if slots is None:
                        staged.setdefault(layer, {})[name] = moved
                    else:
                        self.cache[layer][name].index_copy_(0, slots_on[device], moved)
                if stream is not None:
                    events[device] = self._last_copies[device] = stream.record_event()
        return staged, events

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None  # CPU: the copies run in order, in this thread
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def rows(self, layer: int, forward: ForwardIds, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        plan = forward.plan
        bank = plan["staged"][layer] if "staged" in plan else self.cache[layer]  # {part: [rows, ...]}
        home = next(iter(bank.values())).device
        if home in plan["events"]:  # the copies on the side stream come first
            torch.cuda.current_stream(home).wait_event(plan["events"][home])
            if "staged" in plan:
                for part in bank.values():  # made on the side stream, read here
                    part.record_stream(torch.cuda.current_stream(home))
        index = plan["index"][home]  # [batch, seq]
        rows = self.stored[layer].format.decode({name: part[index.flatten()] for name, part in bank.items()}, dtype)
        # `device` differs from the bank's only for a layer offloaded by accelerate (weights kept on the CPU)
        return rows.view(*index.shape, -1).to(device, non_blocking=True)  # [batch, seq, d_ff]

    def end(self, forward: ForwardIds) -> None:
        with self._lock:
            self._release(forward)
            self._local.forward = None
            devices = {_home(mlp)[0] for mlp in self.mlps.values()}
            self._last_reads[threading.get_ident()] = {
                d: torch.cuda.current_stream(d).record_event() for d in devices if d.type == "cuda"}

    def _release(self, forward: ForwardIds | None) -> None:
        if forward is not None and forward.plan is not None and "leased" in forward.plan:
            self.leases[forward.plan.pop("leased")] -= 1



def _home(mlp) -> tuple[torch.device, torch.dtype]:
    """Where a STEM MLP's rows are cached, and in which dtype: those of its weights (the CPU where
    accelerate keeps an offloaded layer's weights on the meta device)."""
    weight = mlp.gate_proj.weight
    return (torch.device("cpu") if weight.device.type == "meta" else weight.device), weight.dtype


def _cached_dtype(name: str, part: torch.Tensor, compute: torch.dtype) -> torch.dtype:
    """What a device cache holds a stored part in: float rows (`weight`) in the compute dtype, the
    parts of compressed rows as stored."""
    return compute if name == "weight" else part.dtype


def _gather(source: torch.Tensor, ids: torch.Tensor, pin: bool) -> torch.Tensor:
    """`source[ids]` in new host memory; with `pin`, gathered straight into page-locked memory, which an
    asynchronous copy to the device needs (one host copy, not two as with `.pin_memory()` after it). Torch's
    page-locked allocator keeps such a buffer from reuse until the copies that read it have run."""
    out = torch.empty(ids.numel(), *source.shape[1:], dtype=source.dtype, device="cpu", pin_memory=pin)
    return torch.index_select(source, 0, ids, out=out)


def _read_whole(table: TableFile) -> torch.Tensor:
    """The tensor read from its file into host memory."""
    # device="cpu" also under a `torch.device("meta")` context, where vLLM builds its models
    tensor = torch.empty(table.shape, dtype=table.dtype, device="cpu")
    buffer = memoryview(tensor.view(torch.uint8).numpy()).cast("B")
    with open(table.path, "rb") as f:
        f.seek(table.offset)
        done = 0
        while done < table.nbytes:
            n = f.readinto(buffer[done:])
            if not n:
                raise StemTablesError(f"{table.path} ended while reading a table; download or export it again")
            done += n
    return tensor


def open_tables(path, config, hub_kwargs: dict):
    """The placement of `config.stem_tables` for the checkpoint at `path` (a directory or a hub id
    already downloaded), its table files checked; None for float tables in `memory` (parameters)."""
    requested = config.stem_tables or "auto"
    if requested not in (*PLACEMENTS, "auto"):
        raise StemTablesError(f"stem_tables={requested!r} is not a placement; use one of {', '.join(PLACEMENTS)}")
    table_format = TableFormat.from_config(config)
    if not config.stem_layers or (requested == "memory" and table_format is None):
        return None
    files = checkpoint_files(path, hub_kwargs)
    if files is None:
        if requested == "auto" and table_format is None:  # e.g. a .bin checkpoint: nothing to map
            return None
        raise StemTablesError(f"stem_tables={requested!r} reads tables from safetensors files, and {path} has none; "
                              f"load it with stem_tables='memory'" if table_format is None else
                              f"{path} has no safetensors files, where its {table_format.dtype} tables should be; "
                              f"download or export it again")
    tables = locate_tables(files, table_names(files, config.stem_layers), (config.vocab_size, config.intermediate_size),
                           table_format)
    return open_placement("mmap" if requested == "auto" else requested, tables, config.stem_cache_rows)


def table_names(files: dict[str, str], layers) -> dict[int, str]:
    """Per STEM layer, the name of its table among a checkpoint's tensors, without the part (whatever
    the base model's prefix): `model.layers.L.mlp.up_table`."""
    names = {}
    for layer in layers:
        suffix = f"layers.{layer}.mlp.up_table."
        names[layer] = next((n.rpartition(".")[0] for n in files if suffix in n), f"model.{suffix[:-1]}")
    return names


def open_placement(name: str, stored: dict[int, StoredTable], cache_rows: int):
    if name == "mmap":
        return MmapTables(stored)
    if name == "memory":  # compressed tables (float ones in memory are parameters)
        return CompressedMemoryTables(stored)
    if not accelerator_available():
        raise StemTablesError("stem_tables='host' keeps tables in host memory for an accelerator, and this machine "
                              "has none; use stem_tables='mmap' on a CPU")
    return HostTables(stored, cache_rows)
