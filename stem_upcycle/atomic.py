"""Output that appears whole or not at all: written under a temporary name beside its destination and
renamed into place once complete, so that an interrupted run never leaves output that looks finished.

- `write_staged(out, write)`: a whole folder (a converted, compressed or edited model);
- `staging_dir(parent, name)`: a staging folder a caller fills and moves itself (checkpoints, export);
- `staged_file(path)`: one file (token caches, generated batches, restored files).

Temporaries of runs that were killed (SIGKILL, power loss: no `finally` ran) are known by the PID in
their name, which no longer runs, and removed when the next run stages the same output.
"""

import glob
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


def staging_dir(parent: Path, name: str) -> Path:
    """A fresh, empty `parent/name.partial-PID`, to be renamed into place once complete."""
    _remove_stale(parent, name)
    staging = parent / f"{name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def write_staged(out: Path, write: Callable[[Path], None]) -> Path:
    """`write(folder)` into a hidden staging folder beside OUT, moved into place only once it returned
    (an existing OUT, which the caller allowed to be replaced, is swapped out and then deleted); removed
    if it raised."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out.parent, f".{out.name}")
    try:
        write(staging)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


@contextmanager
def staged_file(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write; renamed to `path` when the block ends, removed if it raised.
    `path` is then a new file: one that was a link (to another model's file) is replaced, never written into."""
    _remove_stale(path.parent, f".{path.name}")
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _remove_stale(parent: Path, name: str) -> None:
    for stale in parent.glob(f"{glob.escape(name)}.partial-*"):
        pid = stale.name.rpartition("-")[2]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def existing_parent(path: Path) -> Path:
    """The nearest folder of PATH that exists: PATH itself, or its closest existing ancestor."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path
