"""Where a STEM model's tables live at inference, chosen at load time: `from_pretrained(..., stem_tables=...)`.

- "memory": float tables are parameters, named as the checkpoint stores them (a tensor per table,
  `MemoryTable`, or per group of layers, `TableGroup`, `config.stem_table_groups`), as training, saving,
  device maps and every loader (Transformers', vLLM's) need them, also in a model built from its config;
  compressed tables (int8, fp8, int4: `table_format.py`) are held whole as stored and decoded row by row.
- "mmap": tables stay in the safetensors shards (read-only); each forward reads the rows of its
  distinct ids, decoded and cast to the compute dtype as they are gathered. Nothing reads a whole table.
- "host": for accelerators: tables in host memory, a row cache on the device
  shared by all STEM layers; a forward copies its missing rows for every layer in one pass, on a
  side stream, so the copy overlaps the layers before the first STEM layer.

A forward's ids reach the placements in a `ForwardIds` (forward_ids.py); where each table lies in
the checkpoint's files is table_files.py's.

Exported next to the weights, so it imports only torch, transformers and the standard library.
"""

import math
import mmap
import os
import threading
import weakref
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import nullcontext

import torch
from torch import nn

from .configuration_stem import table_columns
from .forward_ids import ForwardIds, check_ids
from .table_files import (StemTablesError, StoredTable, TableFile, advise_rows, checkpoint_files, locate_table_groups,
                          locate_tables, locate_tensor, read_columns, read_rows, read_whole, runs_of, stored_tensors)
from .table_format import TableFormat

PLACEMENTS = ("memory", "mmap", "host")
DEFAULT_CACHE_ROWS = 2048  # the official STEM engine's LFU cache size


def custom_op(name: str, fn, fake):
    """`fn` as a custom op of this copy of the modeling files, with the shape function `fake`. These files may
    be imported more than once in a process (as stem_upcycle's modules, and as each exported model's remote
    code), each copy with its own registries and maybe other code: the op's name carries the module's, so that
    each copy calls its own. Tagged unsafe for CUDA graphs (it reads the host and branches on data), so that a
    compiled graph on a GPU runs it outside any captured graph. A compiled graph calls it as it is."""
    qualified = f"{name}_{zlib.crc32(__name__.encode()):08x}"
    if not hasattr(torch.ops.stem_upcycle, qualified):  # registered once per copy (a reload keeps the first)
        tags = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
        op = torch.library.custom_op(f"stem_upcycle::{qualified}", fn, mutates_args=(), tags=tags)
        op.register_fake(fake)
    return getattr(torch.ops.stem_upcycle, qualified)


HANDLES = weakref.WeakValueDictionary()  # number -> object an op works with (ops take tensors and numbers)
_HANDLES_MADE = Counter()  # handles made so far in this process, per kind of object


def handle(obj, kind: str) -> int:
    """A number that names `obj` to this copy's ops (`HANDLES`) for as long as it lives, kept as `obj.stem_handle`
    (traced code passes it: registering inside a graph cannot be traced). A compiled graph holds the number as a
    constant, and a cache of compiled graphs (vLLM's) may run it in another process: so the number is not the
    object's id but follows from `kind` and how many handles of that kind this process made before, the same in
    every process that builds the same model."""
    made = _HANDLES_MADE[kind]
    number = zlib.crc32(f"{kind}#{made}".encode())
    while number in HANDLES:  # another kind's number, by chance
        number = (number + 1) % 2**32
    _HANDLES_MADE[kind] = made + 1
    HANDLES[number] = obj
    obj.stem_handle = number
    return number


def _placed_rows(ids: torch.Tensor, placement: int, layer: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """[*ids.shape, columns] rows of `ids` in the table of `layer`, read by the placement with that handle."""
    return HANDLES[placement].placed_rows(layer, ids, dtype)


placed_rows = custom_op("placed_rows", _placed_rows,
                        lambda ids, placement, layer, columns, dtype: ids.new_empty((*ids.shape, columns), dtype=dtype))

# A compiled forward of at most this many lookups (a decode step's) reads every STEM layer's rows at its start, in
# one op (`rows_of_layers`), rather than one op per layer: inside a compiled decode at Llama-3.2-1B's shape a call
# took 350 us (45 us called in a loop: between the graph's matrix products the caches are cold), 6 ms of a 90 ms
# token with 16 layers (benchmarks/README.md, compiled_decode.py). A graph of dynamic sizes (vLLM's) keeps an op per
# layer, whose first layer's call reads them all (`RowAccess.placed_rows`). Bounds what they hold at once: 16
# layers x 64 x 8192 fp32 rows are 34 MB.
ROWS_AT_ONCE = 64


def _rows_of_layers(ids: torch.Tensor, placement: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """[*ids.shape, columns]: the rows of `ids` in every table of the placement with that handle, side by side in
    layer order (`columns`: their widths' sum; `columns_of_layers` says where each lies)."""
    return HANDLES[placement].rows_of_layers(ids, dtype)


rows_of_layers = custom_op("rows_of_layers", _rows_of_layers, lambda ids, placement, columns, dtype:
                           ids.new_empty((*ids.shape, columns), dtype=dtype))


def columns_of_layers(stored: dict) -> dict[int, tuple[int, int]]:
    """Per layer of `stored` (layer -> StoredTable), (first, stop) of its columns in its tables' rows side by side,
    in layer order, as `rows_of_layers` gives them (`config.table_offsets` of a placement's every layer)."""
    offsets, start = {}, 0
    for layer in sorted(stored):
        offsets[layer] = (start, start + stored[layer].shape[1])
        start += stored[layer].shape[1]
    return offsets


class PlacedTable(nn.Module):
    """A STEM MLP's `up_table` when the rows live outside the model: no parameter, no buffer, so that
    `.to()`, `device_map` and dtype casts never touch the table."""

    def __init__(self, placement, layer: int):
        super().__init__()
        self.placement, self.layer = placement, layer
        handle(placement, "placement")

    def __setstate__(self, state):  # a copy's placement (deepcopy, pickle) is one of its own for `placed_rows`
        super().__setstate__(state)
        handle(self.placement, "placement")

    def forward(self, forward: ForwardIds, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if torch.compiler.is_compiling() and isinstance(forward.plan, dict):  # every layer's, read at the start
            return forward.plan[self.layer].to(device, dtype)
        if torch.compiler.is_compiling():  # the reads as one op of the graph (each layer's on its own)
            k = self.placement.stored[self.layer].shape[1]
            return placed_rows(forward.ids, self.placement.stem_handle, self.layer, k, dtype).to(device)
        return self.placement.rows(self.layer, forward, device, dtype)  # [batch, seq, k]

    @property
    def weight(self):
        raise StemTablesError(
            f"the table of layer {self.layer} is placed with stem_tables={self.placement.name!r}: it is not a "
            f"parameter and cannot be trained or assigned; {self.placement.parameters_advice()}"
        )

    def extra_repr(self) -> str:
        return f"layer={self.layer}, stem_tables={self.placement.name!r}"


FOLIO_BYTES = 2 << 20  # the largest page-cache folio a fault maps at once (a PMD on x86-64 and arm64's 4K pages)


class MappedLinear(nn.Module):
    """A STEM MLP's dense first-token up-projection (`config.stem_dense_first_token`) under `mmap`: its
    weight and bias stay in the checkpoint's files, as the tables do. In memory it would cost what the
    STEM layer saves by dropping the dense up-projection (SmolLM2-135M with all 30 layers converted:
    0.106 GB of fp32 weights), so the model would need as much memory as its parent. It runs at the
    prefill alone, for one token per sequence: each call maps the weight, multiplies, and lets its
    pages go (madvise(DONTNEED); the page cache keeps them), so RSS grows by one layer's weight for the
    moment of the call. Like a placed table it has no parameter: it neither trains nor casts.

    On an accelerator, the projection is copied there at its first call and kept (per device and dtype): copied
    from pageable memory at every prefill, it was what each first token's layer waited on; there it costs the
    device the dense up-projection of each STEM layer, a third of the MLP weights the dense parts hold anyway."""

    def __init__(self, weight: TableFile, bias: TableFile | None, mappings: dict):
        super().__init__()
        self.stored, self.stored_bias, self.mappings = weight, bias, mappings
        self.on_device = {}  # (device, dtype) -> [weight, bias] kept on an accelerator

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, d] -> [n, k]
        stored = [self.stored] + ([self.stored_bias] if self.stored_bias is not None else [])
        key = (x.device, x.dtype)
        if key in self.on_device:
            return nn.functional.linear(x, *self.on_device[key])
        try:
            if x.device.type == "cpu":
                return nn.functional.linear(x, *(self._mapped(t).to(x.device, x.dtype) for t in stored))
            with torch.inference_mode(False):  # kept for later forwards, which may run outside inference mode
                self.on_device[key] = [self._mapped(t).to(x.device, x.dtype) for t in stored]
            return nn.functional.linear(x, *self.on_device[key])
        finally:
            for t in stored:
                if t.path in self.mappings:  # with the pages mapped around the tensor's (a fault maps a whole folio)
                    mapping = self.mappings[t.path]
                    start = t.offset // FOLIO_BYTES * FOLIO_BYTES
                    mapping.madvise(mmap.MADV_DONTNEED, start, min(len(mapping), t.offset + t.nbytes + FOLIO_BYTES) - start)

    def to_linear(self, dtype: torch.dtype) -> nn.Linear:
        """The projection as a module of parameters, read into memory (to train or save it)."""
        linear = nn.Linear(self.stored.shape[1], self.stored.shape[0], bias=self.stored_bias is not None, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(read_whole(self.stored))
            if self.stored_bias is not None:
                linear.bias.copy_(read_whole(self.stored_bias))
        return linear

    def _mapped(self, stored: TableFile) -> torch.Tensor:
        mapping = self.mappings.get(stored.path)
        if mapping is None:  # private (copy-on-write, never written): a buffer torch can take
            with open(stored.path, "rb") as f:  # setdefault: of two threads mapping the file at once, one mapping stays
                mapping = self.mappings.setdefault(stored.path, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
        return torch.frombuffer(mapping, dtype=stored.dtype, count=math.prod(stored.shape),
                                offset=stored.offset).view(stored.shape)

    def extra_repr(self) -> str:
        return f"in_features={self.stored.shape[1]}, out_features={self.stored.shape[0]}, stem_tables='mmap'"


class RowAccess:
    """What every placement offers over the stored parts of its tables (`read_parts`, `set_parts`):
    rows decoded from them and rows encoded into them, so that a compressed row is replaced with its
    scales and read back as every forward reads it."""

    stored: dict  # layer -> StoredTable
    compiles = True  # whether `rows` serves a compiled graph as an op, with no `begin`/`end` around the forward

    def read_rows(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """[n, k] rows of `ids` [n] in the table's float dtype (float32 for a compressed table)."""
        table = self.stored[layer]
        return table.format.decode(self.read_parts(layer, ids), table.float_dtype)

    def set_rows(self, layer: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows of `ids` [n] from now on: `rows` [n, k], stored as the table stores rows."""
        self.set_parts(layer, ids, self.stored[layer].format.encode(rows.cpu()))

    def rows_of_layers(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[*ids.shape, columns]: the rows of `ids` in every table side by side, in layer order (`ROWS_AT_ONCE`)."""
        forward = ForwardIds(ids)  # its distinct ids found once for every layer
        return torch.cat([self.rows(layer, forward, ids.device, dtype) for layer in sorted(self.stored)], -1)

    def placed_rows(self, layer: int, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The `placed_rows` op's read: [*ids.shape, k]. A graph whose token count is dynamic (vLLM's) calls the op
        layer by layer, so a lookup of at most `ROWS_AT_ONCE` ids reads every layer's rows at the first STEM layer, as
        `rows_of_layers` reads them for a graph of fixed sizes, and the layers after take theirs from what it read
        (this thread's, while their ids are the same). The first layer reads again every forward: rows written
        between forwards (`set_rows`) are seen."""
        if ids.numel() > ROWS_AT_ONCE:
            return self.rows(layer, ForwardIds(ids), ids.device, dtype)
        order = sorted(self.stored)
        start, stop = columns_of_layers(self.stored)[layer]
        held = self._rows_read_at_once.__dict__
        same = (held.get("dtype") == dtype and held["ids"].shape == ids.shape and held["ids"].device == ids.device
                and torch.equal(held["ids"], ids)) if held else False
        if layer == order[0] or not same:
            held.update(ids=ids.clone(), dtype=dtype, rows=self.rows_of_layers(ids, dtype))
        # a copy: the op's output is the graph's to write over, and the held rows serve the layers after
        return held["rows"][..., start:stop].clone()

    @property
    def _rows_read_at_once(self) -> threading.local:
        """This thread's rows of every layer read by `placed_rows` for the ids of the forward in flight."""
        return self.__dict__.setdefault("_rows_at_once", threading.local())

    def parameters_advice(self) -> str:
        """How to have these tables as parameters, which training, resizing and saving need."""
        compressed = next((t.format.dtype for t in self.stored.values() if t.format.compressed), None)
        if compressed is None:
            return "load the model with stem_tables='memory'"
        return (f"its tables are stored as {compressed}: decompress them into a new folder "
                f"(`stem-upcycle compress MODEL OUT --table-dtype float32`) and load that with stem_tables='memory'")


# Reads in flight at once (threads; 0: every read in the forward's own thread), and how many STEM layers ahead
# of the running one a forward's rows are read (the rows held at once are bounded by it). Measured on 2 cores
# (benchmarks/README.md, cold_rows.py): 4 threads read 15,120 cold SmolLM2 rows 4.5x faster than one; 16
# were slower than 4, cold and warm, for the GIL each read takes back.
READ_THREADS = int(os.environ.get("STEM_READ_THREADS", "4"))
LOOKAHEAD_LAYERS = int(os.environ.get("STEM_READ_AHEAD_LAYERS", "8"))
MIN_ROWS_PER_READ_TASK = 64  # fewer (a decode step's) are read in the forward's thread: a hand-off to a thread
                             # costs more than the reads when the compute threads keep the cores busy


class MmapTables(RowAccess):
    """Tables left in the checkpoint's files: each forward reads the rows of its distinct ids.

    Rows are read with positioned reads (pread), not by touching a memory map: a fault on a mapped
    file maps the whole page-cache folio around the row (up to 2 MB; measured 1.3 MB of RSS per
    random SmolLM2 row on kernel 6.18, where MADV_RANDOM does not help), so a 512-token prefill
    would map most of every table. A read copies the row alone: RSS grows by the rows gathered,
    and repeated rows come from the page cache. A compressed table's scales (1.6% of its int8
    values' bytes with 128-element blocks, 6% of int4's) are read whole when the model loads, so a
    row costs one read, as a float row does, rather than two (a cold row's scales lie on another page).

    A forward's ids are known before its first layer runs: `begin` asks the kernel to read every
    STEM layer's rows into the page cache, without waiting (`advise_rows`, on the pool), and issues
    the reads of the first STEM layers' rows at once, on a pool of threads (`READ_THREADS`); each
    layer that takes its rows issues those of the layer `LOOKAHEAD_LAYERS` further on. Rows not in
    the page cache then wait on the disk together, and later layers' rows arrive while earlier
    layers compute, as the official STEM engine stages a chunk's rows while the previous one computes.

    The files are never written: rows set on a loaded model (`set_rows`, a knowledge edit) are kept
    in memory and shadow the files' rows in every read.
    """

    name = "mmap"

    def __init__(self, stored: dict[int, StoredTable]):
        self.stored = stored
        self._fds = {}  # file -> this placement's descriptor of it
        self._sequential_fds = {}  # file -> a descriptor that reads ahead (`_sequential_fd`)
        for table in stored.values():
            for part in table.parts.values():
                self._open(part.path)
        self.overlay = {}  # layer -> {"ids": sorted ids [m], part: [m, ...] their stored rows set on the loaded model}
        self.resident = {layer: {name: read_whole(where) for name, where in table.parts.items() if name == "scales"}
                         for layer, table in stored.items()}  # layer -> {part: the whole tensor in memory}
        self.first_token_up = {}  # layer -> (weight, bias or None): `leave_first_token_up`
        self.mappings = {}  # file -> its private mapping, where `MappedLinear`s read the first-token up-projections
        self._pool, self._pool_pid = None, None  # made by the first forward of each process (`pool`)
        self._local = threading.local()  # this thread's forward in flight (`RowPrefetch`)

    def _open(self, path: str) -> None:
        if path not in self._fds:
            self._fds[path] = fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # cold reads: no readahead around rows
            weakref.finalize(self, os.close, fd)

    def _sequential_fd(self, path: str) -> int:
        """A descriptor of `path` that reads ahead, for whole tables read in order (`read_range`)."""
        if path not in self._sequential_fds:
            self._sequential_fds[path] = fd = os.open(path, os.O_RDONLY)
            weakref.finalize(self, os.close, fd)
        return self._sequential_fds[path]

    def leave_first_token_up(self, projections: dict[int, tuple[TableFile, TableFile | None]]) -> None:
        """Per STEM layer, (weight, bias or None) of its dense first-token up-projection, which stays in
        the files (`MappedLinear`). Every prefill reads them, so a forward's advice asks for them too."""
        self.first_token_up = projections
        for weight, _ in projections.values():
            self._open(weight.path)

    def read_parts(self, layer: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per part, [n, ...] the stored rows of the ids `ids` [n], read from the files."""
        return self._finish(layer, ids, self._start(layer, ids, pool=None))

    def _start(self, layer: int, ids: torch.Tensor, pool, shared: dict | None = None,
               runs: list | None = None) -> tuple[dict, list]:
        """(the parts' stored rows of `ids` [n], being read; the reads in flight): on `pool` in tasks of a
        share of the ids each, or here and now without one. `shared`: stored tensor -> (its rows, their
        reads) that this forward started already; a grouped table's rows are its group's, read once for
        all the group's layers. `runs`: the runs of `ids` (`runs_of`), which the caller found and checked."""
        table = self.stored[layer]
        if runs is None:
            check_ids(ids, table.shape[0])  # a read past a table would return another tensor's bytes
        parts, reads = {}, []
        for name, where in table.parts.items():
            if name in self.resident[layer]:
                parts[name] = self.resident[layer][name][ids]
                continue
            if shared is not None and where in shared:
                parts[name], started = shared[where]
                reads += started
                continue
            rows = parts[name] = torch.empty(ids.numel(), where.shape[1], dtype=where.dtype, device="cpu")
            fd, started = self._fds[where.path], []
            if pool is None or ids.numel() < MIN_ROWS_PER_READ_TASK:
                read_rows(fd, where, ids, rows, runs)
            else:
                step = max(MIN_ROWS_PER_READ_TASK, -(-ids.numel() // READ_THREADS))
                started = [pool.submit(read_rows, fd, where, ids[b : b + step], rows[b : b + step])
                           for b in range(0, ids.numel(), step)]
            reads += started
            if shared is not None:
                shared[where] = (rows, started)
        return parts, reads

    def _finish(self, layer: int, ids: torch.Tensor, started: tuple[dict, list]) -> dict[str, torch.Tensor]:
        """The table's parts' rows once their reads are done, with the rows set on the loaded model in place."""
        parts, reads = started
        for read in reads:
            read.result()
        return self._overlaid(layer, ids, self.stored[layer].own(parts))  # a grouped table's columns of its group's

    def _overlaid(self, layer: int, ids: torch.Tensor, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The table's stored rows `parts` of `ids` [n], with the rows set on the loaded model in their place."""
        overlay = self.overlay.get(layer)
        if overlay is not None:
            where = torch.searchsorted(overlay["ids"], ids).clamp(max=overlay["ids"].numel() - 1)
            hit = overlay["ids"][where] == ids  # [n]
            if bool(hit.any()):
                for name, rows in parts.items():
                    rows[hit] = overlay[name][where[hit]]
        return parts

    def advise(self, ids: torch.Tensor, prefetch: "RowPrefetch") -> None:
        """Start the disk reads of every STEM layer's rows of `ids` [n] and of its first-token up-projection
        (left in the files: a page cache that lost it would read it at the layer, 3.5 MB for SmolLM2, while
        the forward waits), in the order the forward runs the layers, until the forward is over; a group's
        rows (`config.stem_table_groups`) once."""
        first_reader = {where: layers[0] for where, layers in stored_tensors(self.stored).items()}
        for layer in sorted(self.stored):
            reads = [(where, ids) for name, where in self.stored[layer].parts.items()
                     if name not in self.resident[layer] and first_reader[where] == layer]
            if layer in self.first_token_up:  # the whole weight, in one run; its bias, a few kB, is read when used
                weight = self.first_token_up[layer][0]
                reads.insert(0, (weight, torch.arange(weight.shape[0])))
            for where, rows in reads:
                if prefetch.done:
                    return
                advise_rows(self._fds[where.path], where, rows)

    def read_range(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """[stop - start, k] rows start..stop-1, decoded, in one positioned read per part (nothing is mapped). Of
        a table stored in a group, its own columns alone, a read per row: whole-table readers (training's shared
        copy, `compress`, statistics) read a table after another, and reading the group's rows for each of its
        layers read the group as many times as it has layers."""
        table = self.stored[layer]
        if not 0 <= start <= stop <= table.shape[0]:
            raise ValueError(f"rows {start}..{stop - 1} lie outside the table's {table.shape[0]} rows")
        ids = torch.arange(start, stop, device="cpu")
        if table.columns is None:
            parts = self.read_parts(layer, ids)
        else:  # grouped tables hold float rows: one part
            where = table.parts["weight"]
            rows = torch.empty(stop - start, table.shape[1], dtype=where.dtype, device="cpu")
            read_columns(self._sequential_fd(where.path), where, start, table.columns, rows)
            parts = self._overlaid(layer, ids, {"weight": rows})
        return table.format.decode(parts, table.float_dtype)

    def set_parts(self, layer: int, ids: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Stored rows of `ids` [n] from now on, held in memory (the files stay as they are); of an id
        given twice, the later rows."""
        ids = ids.cpu().long()
        old = self.overlay.get(layer)
        if old is not None:  # rows set earlier, for ids not set again now, stay
            kept = ~torch.isin(old["ids"], ids)
            ids = torch.cat([old["ids"][kept], ids])
            parts = {name: torch.cat([old[name][kept], rows.cpu()]) for name, rows in parts.items()}
        distinct, inverse = torch.unique(ids, return_inverse=True)
        last = torch.zeros_like(distinct).scatter_reduce_(0, inverse, torch.arange(ids.numel()), reduce="amax")
        self.overlay[layer] = {"ids": distinct, **{name: rows.cpu()[last].clone() for name, rows in parts.items()}}

    def pool(self) -> ThreadPoolExecutor | None:
        """The reading threads of this process: a process forked after loading (a data loader's worker)
        has none of its parent's threads, and a pool of them would never run a read."""
        if READ_THREADS > 0 and self._pool_pid != os.getpid():
            self._pool, self._pool_pid = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="stem-rows"), os.getpid()
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool

    def begin(self, forward: ForwardIds) -> None:
        self._cancel()  # a forward of this thread that failed midway leaves no read behind
        if self.pool() is not None:
            self._local.prefetch = forward.plan = RowPrefetch(self, forward.unique()[0])

    def rows(self, layer: int, forward: ForwardIds, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        unique, inverse = forward.unique()
        plan = forward.plan if isinstance(forward.plan, RowPrefetch) else None
        parts = plan.take(layer) if plan is not None else self.read_parts(layer, unique)
        rows = self.stored[layer].format.decode(parts, dtype)  # [n_distinct, k]
        return rows[inverse].to(device, non_blocking=True)  # [batch, seq, k]

    def rows_of_layers(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`RowAccess.rows_of_layers` with every layer's reads asked of the disk before the first waits (a decode
        step's 16 cold rows then wait on it together, not one after another) and a group's rows read once."""
        formats = {table.format for table in self.stored.values()}
        if len(formats) > 1:  # float tables of several dtypes (as their files hold them): decoded a table at a time
            return super().rows_of_layers(ids, dtype)
        unique, inverse = ForwardIds(ids).unique()
        check_ids(unique, min(table.shape[0] for table in self.stored.values()))  # once, and the runs once, for all
        runs = runs_of(unique)
        for where in {where for layer, table in self.stored.items() for name, where in table.parts.items()
                      if name not in self.resident[layer]}:
            advise_rows(self._fds[where.path], where, unique, runs)
        shared = {}  # a group's rows, read by its first layer
        layers = sorted(self.stored)
        started = {layer: self._start(layer, unique, pool=None, shared=shared, runs=runs) for layer in layers}
        parts = [self._finish(layer, unique, reads) for layer, reads in started.items()]  # [n_distinct, ...] each
        # decoded in one go, not per layer: side by side, each table's columns whole blocks of the format's scales
        together = {name: torch.cat([p[name] for p in parts], 1) for name in parts[0]}
        rows = formats.pop().decode(together, dtype)  # [n_distinct, columns]
        return rows[inverse].to(ids.device)  # [*ids.shape, columns]

    def end(self, forward: ForwardIds) -> None:
        self._cancel()

    def _cancel(self) -> None:
        prefetch = getattr(self._local, "prefetch", None)
        if prefetch is not None:
            prefetch.cancel()
            self._local.prefetch = None


class RowPrefetch:
    """One forward's row reads, issued `LOOKAHEAD_LAYERS` STEM layers ahead of the layer that takes its rows."""

    def __init__(self, tables: MmapTables, ids: torch.Tensor):
        self.tables, self.ids = tables, ids  # sorted distinct lookup ids [n]
        self.layers = iter(sorted(tables.stored))  # in the order the forward runs them
        self.started = {}  # layer -> (parts being read, reads in flight)
        self.shared = {}  # stored tensor -> (its rows being read, the reads): a group's, for each of its layers
        self.readers = Counter({where: len(layers) for where, layers in stored_tensors(tables.stored).items()})
        self.done = False  # the forward is over: the advice stops
        self.advice = tables.pool().submit(tables.advise, ids, self) if ids.numel() >= MIN_ROWS_PER_READ_TASK else None
        for _ in range(LOOKAHEAD_LAYERS):
            self._start_next()

    def _start_next(self) -> None:
        layer = next(self.layers, None)
        if layer is not None:
            self.started[layer] = self.tables._start(layer, self.ids, self.tables.pool(), self.shared)

    def take(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's rows; a layer run again (gradient checkpointing's recompute) reads them again, here."""
        started = self.started.pop(layer, None)
        self._start_next()
        if started is None:
            return self.tables.read_parts(layer, self.ids)
        try:
            return self.tables._finish(layer, self.ids, started)
        except BaseException:
            self.cancel(started[1])  # the layer's other reads too
            raise
        finally:
            for where in self.tables.stored[layer].parts.values():  # a group's rows go with its last layer
                self.readers[where] -= 1
                if not self.readers[where]:
                    self.shared.pop(where, None)

    def cancel(self, taken: list = ()) -> None:
        """Drop the reads not started; wait for those running, which write into this forward's buffers."""
        reads = [*taken, *(read for _, pending in self.started.values() for read in pending)]
        reads += [self.advice] if self.advice is not None else []
        self.done = True
        self.started.clear()
        self.shared.clear()
        self.layers = iter(())
        for read in reads:
            read.cancel()
        wait(reads)


class HeldTables(RowAccess):
    """`memory` for compressed tables (int8, float8, int4), which are not parameters (they are not trained: see
    `train`): their stored parts held whole, where the STEM MLPs' weights are (they follow the weights to a device
    at the next forward). Each forward gathers its ids' parts and decodes those rows alone. Float tables in memory
    are parameters (`MemoryTable`, `TableGroup`)."""

    name = "memory"

    def __init__(self, stored: dict[int, StoredTable]):
        self.stored = stored
        self.tables = read_tables(stored)
        self.mlps = {}  # layer -> its StemMLP (set by the model)

    def read_parts(self, layer: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: part[ids.to(part.device)].cpu() for name, part in self.tables[layer].items()}

    def set_parts(self, layer: int, ids: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        for name, part in self.tables[layer].items():
            part[ids.to(part.device)] = parts[name].to(part.device)

    def begin(self, forward: ForwardIds) -> None:
        for layer, mlp in self.mlps.items():
            device = _home(mlp)[0]
            with torch.inference_mode(False):  # held for later forwards and edits, outside inference mode too
                self.tables[layer] = {name: part.to(device) for name, part in self.tables[layer].items()}

    def rows(self, layer: int, forward: ForwardIds, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        parts = self.tables[layer]
        ids = forward.on(next(iter(parts.values())).device)  # [*lookup]
        rows = self.stored[layer].format.decode({name: part[ids.flatten()] for name, part in parts.items()}, dtype)
        return rows.view(*ids.shape, -1).to(device, non_blocking=True)  # [*lookup, k]

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

    compiles = False  # each forward's rows are staged into the device cache by `begin`

    name = "host"

    def __init__(self, stored: dict[int, StoredTable], cache_rows: int):
        self.stored = stored
        # Pageable: the device never reads a table, only rows the host gathers into page-locked staging (`_gather`);
        # registering whole tables page-locked (GBs each) would lock RAM for nothing.
        self.tables = read_tables(stored)
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
                with torch.inference_mode(False):  # kept for later forwards, which may run outside inference mode
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
                        _bytes(self.cache[layer][name]).index_copy_(0, slots_on[device], _bytes(moved))
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
        return rows.view(*index.shape, -1).to(device, non_blocking=True)  # [batch, seq, k]

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


def read_tables(stored: dict[int, StoredTable]) -> dict[int, dict[str, torch.Tensor]]:
    """Per layer, its table's stored parts read whole into host memory; a group's tensor
    (`config.stem_table_groups`) once, each of its layers' tables a view of its columns."""
    read = {where: read_whole(where) for where in stored_tensors(stored)}
    return {layer: table.own({name: read[where] for name, where in table.parts.items()}) for layer, table in stored.items()}


def _home(mlp) -> tuple[torch.device, torch.dtype]:
    """Where a STEM MLP's rows are cached, and in which dtype: those of its weights (the CPU where
    accelerate keeps an offloaded layer's weights on the meta device)."""
    weight = mlp.gate_proj.weight
    return (torch.device("cpu") if weight.device.type == "meta" else weight.device), weight.dtype


def _cached_dtype(name: str, part: torch.Tensor, compute: torch.dtype) -> torch.dtype:
    """What a device cache holds a stored part in: float rows (`weight`) in the compute dtype, the
    parts of compressed rows as stored."""
    return compute if name == "weight" else part.dtype


def _bytes(part: torch.Tensor) -> torch.Tensor:
    """A one-byte part as uint8, for the copies that have no float8 kernel in torch (`index_copy_`)."""
    return part.view(torch.uint8) if part.element_size() == 1 else part


def _gather(source: torch.Tensor, ids: torch.Tensor, pin: bool) -> torch.Tensor:
    """`source[ids]` in new host memory; with `pin`, gathered straight into page-locked memory, which an
    asynchronous copy to the device needs (one host copy, not two as with `.pin_memory()` after it). Torch's
    page-locked allocator keeps such a buffer from reuse until the copies that read it have run."""
    out = torch.empty(ids.numel(), *source.shape[1:], dtype=source.dtype, device="cpu", pin_memory=pin)
    return torch.index_select(source, 0, ids, out=out)


def open_tables(path, config, hub_kwargs: dict):
    """The placement of `config.stem_tables` for the checkpoint at `path` (a directory or a hub id), its table
    files checked; None for float tables in `memory`, which are parameters (a tensor per table, or per group of
    layers: named as stored)."""
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
    headers = {}  # each file's header read once, for the tables and the first-token projections
    tables = locate_stem_tables(files, config, config.stem_layers, headers)
    placement = open_placement("mmap" if requested == "auto" else requested, tables, config.stem_cache_rows)
    if isinstance(placement, MmapTables) and config.stem_dense_first_token:
        shapes = {layer: (table_columns(config, layer), config.hidden_size) for layer in config.stem_layers}
        placement.leave_first_token_up({
            layer: (locate_tensor(files, f".layers.{layer}.mlp.up_proj.weight", shapes[layer], headers),
                    locate_tensor(files, f".layers.{layer}.mlp.up_proj.bias", shapes[layer][:1], headers)
                    if config.stem_mlp_bias else None)
            for layer in config.stem_layers})
    return placement


def locate_stem_tables(files: dict[str, str], config, layers, headers: dict | None = None) -> dict[int, StoredTable]:
    """Per STEM layer of `layers`, where its table lies in the checkpoint's files (`files`: tensor name ->
    file), each its own tensor or a share of its group's (`config.stem_table_groups`)."""
    shapes = {layer: (config.vocab_size, table_columns(config, layer)) for layer in config.stem_layers}
    groups = getattr(config, "stem_table_groups", None)
    if not groups:
        return locate_tables(files, table_names(files, layers), shapes, TableFormat.from_config(config), headers)
    if sorted(layer for group in groups for layer in group) != sorted(config.stem_layers):
        raise StemTablesError(f"config.stem_table_groups {groups} does not hold each STEM layer "
                              f"({config.stem_layers}) once; the checkpoint is inconsistent: export it again")
    if TableFormat.from_config(config) is not None:
        raise StemTablesError("config.stem_table_groups stores float tables, and config.stem_table_format names "
                              "compressed ones; the checkpoint is inconsistent: export it again")
    located = locate_table_groups(files, groups, shapes, headers)
    return {layer: located[layer] for layer in layers}


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
    if name == "memory":  # compressed tables
        return HeldTables(stored)
    if not accelerator_available():
        raise StemTablesError("stem_tables='host' keeps tables in host memory for an accelerator, and this machine "
                              "has none; use stem_tables='mmap' on a CPU")
    return HostTables(stored, cache_rows)
