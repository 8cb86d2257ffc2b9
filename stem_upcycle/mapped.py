"""Tensors backed by a file (MAP_SHARED), for data larger than memory: a training run's shared tables, a conversion's
parent rows. The file's blocks are reserved before it is mapped: a page of a mapped file with no block behind it
kills the process with SIGBUS when the disk is full, where reserving them is an error a caller can report."""

import errno
import math
import os
from pathlib import Path

import torch


class NoSpace(OSError):
    """The disk (or the quota) has no room for a file of that size."""


def reserve(file, size: int) -> None:
    """Give the open `file` `size` bytes of zeros, its blocks reserved now; `NoSpace` (the file emptied) if the
    disk cannot hold them."""
    try:
        if size and hasattr(os, "posix_fallocate"):  # 0 bytes: EINVAL; macOS lacks it (the file stays sparse)
            os.posix_fallocate(file.fileno(), 0, size)
        else:
            file.truncate(size)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        file.truncate(0)
        raise NoSpace(err.errno, err.strerror) from None


def map_file(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The file at `path` as a tensor of `shape`, written through to the file."""
    return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)


def mapped_zeros(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new file at `path` of zeros, reserved (`reserve`), mapped as a tensor of `shape`."""
    with Path(path).open("wb") as f:
        reserve(f, math.prod(shape) * dtype.itemsize)
    return map_file(path, shape, dtype)
