"""Stream tensors into size-bounded safetensors shards with an index, chunk by chunk.

Every tensor's name, dtype and shape are known before the first byte is written, so each shard's
header is written up front and tensor data follows in order, possibly in chunks of rows. No tensor
has to be whole in memory. A background thread does the writing so that computing the next chunk
overlaps with writing the last one.
"""

import json
import math
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .modeling.table_files import SAFETENSORS_DTYPES

INDEX_NAME = "model.safetensors.index.json"

DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}  # torch dtype -> safetensors' code


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors, in order, into shards of at most max_shard_bytes (a larger tensor gets its own).

    Not huggingface_hub's `split_torch_state_dict_into_shards`: it sends a tensor larger than the
    limit to a shard of its own ahead of the shard being filled, so the tensors would no longer
    reach the files in the order they are produced, and the streamed writer (one shard open at a
    time, each tensor written as it is computed) would need every shard open at once."""
    shards, current, size = [], [], 0
    for spec in specs:
        if current and size + spec.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        shards.append(current)
    return shards


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def index_json(shards: list[list[TensorSpec]]) -> dict:
    weight_map = {s.name: shard_file_name(i, len(shards)) for i, shard in enumerate(shards) for s in shard}
    total = sum(s.nbytes for shard in shards for s in shard)
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def _header(shard: list[TensorSpec]) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for spec in shard:
        header[spec.name] = {
            "dtype": DTYPE_CODES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return len(encoded).to_bytes(8, "little") + encoded


class ShardWriter:
    """Writes the planned tensors in order; `write` takes a whole tensor or its next rows."""

    def __init__(self, directory: Path, shards: list[list[TensorSpec]], on_bytes=None):
        self.directory = Path(directory)
        self.shards = shards
        self.on_bytes = on_bytes or (lambda n: None)
        self._order = [(i, s) for i, shard in enumerate(shards) for s in shard]
        self._next = 0  # position in _order of the tensor being written
        self._left = self._order[0][1].nbytes if self._order else 0
        self._file = None
        self._shard = -1

    def write(self, name: str, data: torch.Tensor) -> None:
        shard, spec = self._order[self._next]
        if name != spec.name:
            raise RuntimeError(f"expected {spec.name}, got {name}: tensors must be written in plan order")
        if data.dtype != spec.dtype:
            raise RuntimeError(f"{name}: dtype {data.dtype} written, {spec.dtype} planned")
        if shard != self._shard:
            self._open(shard)
        raw = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if raw.nbytes > self._left:
            raise RuntimeError(f"{name}: {raw.nbytes} bytes written past the {spec.nbytes} planned")
        self._file.write(raw.data)
        self._left -= raw.nbytes
        self.on_bytes(raw.nbytes)
        while self._left == 0 and self._next < len(self._order):
            self._next += 1
            if self._next < len(self._order):
                self._left = self._order[self._next][1].nbytes  # zero-size tensors complete at once

    def _open(self, shard: int) -> None:
        self._close_file()
        self._shard = shard
        self._file = open(self.directory / shard_file_name(shard, len(self.shards)), "wb")
        self._file.write(_header(self.shards[shard]))

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Finish the last shard and write the index; every planned byte must have been written."""
        if self._next < len(self._order):
            raise RuntimeError(f"{self._order[self._next][1].name} was not written completely")
        self._close_file()
        (self.directory / INDEX_NAME).write_text(json.dumps(index_json(self.shards), indent=2) + "\n")

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class BackgroundWriter:
    """Runs a ShardWriter on a thread; `submit` returns once the chunk is queued.

    `release` is called with the chunk once it is on disk, so callers can recycle buffers. At
    most `depth` chunks wait in the queue, which bounds the memory in flight.
    """

    def __init__(self, writer: ShardWriter, depth: int = 2):
        self.writer = writer
        self._queue = queue.Queue(maxsize=depth)
        self._error = None
        self._thread = threading.Thread(target=self._run, name="stem-shard-writer", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            job = self._queue.get()
            if job is None:
                return
            name, data, release = job
            if self._error is None:
                try:
                    self.writer.write(name, data)
                except BaseException as err:  # handed to the producer at its next call
                    self._error = err
            if release is not None:
                release(data)

    def submit(self, name: str, data: torch.Tensor, release=None) -> None:
        self._raise_if_failed()
        self._queue.put((name, data, release))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        self.writer.close()

    def abort(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.writer.abort()

    def _raise_if_failed(self):
        if self._error is not None:
            raise self._error
