"""Documents of the text files training and evaluation read: .txt (the file is one document),
.jsonl (one document per record, in `text_field`) and .parquet (one per row, in the column
`text_field`; read with pyarrow, as a Hugging Face dataset's files are).
A .gz file (.jsonl.gz, .json.gz: JSON lines, as FineWeb and Dolma ship them; .txt.gz) is read as
its decompressed bytes.

Files are cut into pieces that can be read (and tokenised) apart: byte ranges of about
`PIECE_BYTES` cut after a line break (before a non-space character in a .txt file, where
byte-level BPE pre-tokenisers split anyway), or a parquet file's row groups.
"""

import gzip
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import UserError

PIECE_BYTES = 1 << 18  # text per encode call: ~80k tokens, whose encodings take ~20 MB
TXT_CUT = re.compile(rb"\n(?=[^\s])")  # a cut point: after a newline, before a non-space byte
JSONL_CUT = re.compile(rb"\n")


# Names of the files a dataset's folder offers as text: .json.gz is JSON lines, as the Hub's datasets name it
DATA_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".json.gz", ".parquet")


class DataError(UserError):
    pass


def is_data_file(name: str) -> bool:
    return name.lower().endswith(DATA_SUFFIXES)


def _kind(path: Path) -> str:
    """parquet, jsonl or txt (any other name is read as text)."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    return "jsonl" if name.endswith((".jsonl", ".jsonl.gz", ".json.gz")) else "txt"


_open_gzip: dict[tuple, gzip.GzipFile] = {}  # the one .gz file read now: pieces are read in order, so a seek goes on


def _open(path: Path):
    """`path`'s (decompressed) bytes, seekable. A .gz file's handle stays open for the next piece: GzipFile seeks
    forward by decompressing, so reading its pieces in order decompresses it once."""
    if not _gzipped(path):
        return path.open("rb")
    stat = path.stat()
    key = (path, stat.st_size, stat.st_mtime_ns)  # a file rewritten since is opened again
    if key not in _open_gzip:
        for old in _open_gzip.values():
            old.close()
        _open_gzip.clear()
        _open_gzip[key] = gzip.open(path, "rb")
    return _Kept(_open_gzip[key])


class _Kept:
    """A file kept open across `with` blocks."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self.f

    def __exit__(self, *exc):
        return False


def _gzipped(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def _size(path: Path) -> int:
    """Bytes of `path` as read (a .gz file: decompressed, counted by reading it once)."""
    if not _gzipped(path):
        return path.stat().st_size
    with _open(path) as f:
        f.seek(0)
        size = 0
        try:
            while chunk := f.read(1 << 24):
                size += len(chunk)
        except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError; bad data a zlib.error
            raise DataError(f"{path} is not a readable gzip file ({err}); check the file") from None
        return size


@dataclass(frozen=True)
class Piece:
    path: Path
    start: int  # byte range [start, stop) of the file (a .parquet file: row groups)
    stop: int
    ends_document: bool  # EOS after each of its documents (a .txt file's last piece; every .jsonl piece)


def plan_pieces(files: list[Path], piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """The files' byte ranges of about `piece_bytes`, cut where tokenising the parts apart changes nothing."""
    pieces = []
    for path in files:
        kind = _kind(path)
        if kind == "parquet":
            pieces += [Piece(path, g, g + 1, True) for g in range(_parquet(path).num_row_groups)]
            continue
        size = _size(path)
        cut = JSONL_CUT if kind == "jsonl" else TXT_CUT
        start = 0
        with _open(path) as f:
            while start < size:
                stop = _next_cut(f, cut, start + piece_bytes, size)
                pieces.append(Piece(path, start, stop, kind == "jsonl" or stop == size))
                start = stop
    return pieces


def _next_cut(f, cut: re.Pattern, at: int, size: int) -> int:
    """The first cut point at or after byte `at` (the file's end if none)."""
    while at < size:
        f.seek(at)
        window = f.read(1 << 16)
        if match := cut.search(window[:-1] if at + len(window) < size else window):  # the look-ahead needs a byte
            return at + match.end()
        at += max(1, len(window) - 1)
    return size


def documents_of(piece: Piece, text_field: str) -> list[str]:
    """The documents in `piece`, in order."""
    kind = _kind(piece.path)
    if kind == "parquet":
        return _parquet_documents(piece, text_field)
    with _open(piece.path) as f:
        f.seek(piece.start)
        data = f.read(piece.stop - piece.start)
    if kind != "jsonl":
        return [data.decode("utf-8", errors="replace")]
    return jsonl_documents(data.decode("utf-8", errors="replace"), text_field,
                           lambda number: f"{piece.path}:{_line_number(piece, number)}")


def jsonl_documents(text: str, text_field: str, where) -> list[str]:
    """The `text_field` of each JSON line of `text`; `where(i)` names line i in an error."""
    documents = []
    for number, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            if record is None:
                raise DataError(f"{where(number)} is not valid JSON; a .jsonl file has one object per line")
            fields = f" (its fields: {', '.join(map(str, record))})" if isinstance(record, dict) and record else ""
            raise DataError(f"{where(number)} has no string field {text_field!r}{fields}; set data.text_field")
        documents.append(record[text_field])
    return documents


def _line_number(piece: Piece, line_in_piece: int) -> int:
    with _open(piece.path) as f:
        f.seek(0)
        return f.read(piece.start).count(b"\n") + line_in_piece + 1


def _parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path.name} needs pyarrow, a dependency of stem-upcycle: pip install pyarrow") from None
    try:
        return pq.ParquetFile(path)
    except Exception as err:  # pyarrow's errors for a file that is not parquet have no common base
        raise DataError(f"{path} is not a readable parquet file ({type(err).__name__}); check the file") from None


def _parquet_documents(piece: Piece, text_field: str) -> list[str]:
    return parquet_texts(_parquet(piece.path), piece.start, text_field, str(piece.path))


def parquet_texts(table, group: int, text_field: str, where: str) -> list[str]:
    """The column `text_field` of row group `group` of the open ParquetFile `table`."""
    if text_field not in table.schema_arrow.names:
        raise DataError(f"{where} has no column {text_field!r} (columns: {', '.join(table.schema_arrow.names)}); "
                        f"set data.text_field")
    column = table.read_row_group(group, columns=[text_field]).column(text_field).to_pylist()
    bad = next((i for i, v in enumerate(column) if not isinstance(v, str)), None)
    if bad is not None:
        raise DataError(f"{where}: column {text_field!r} holds a {type(column[bad]).__name__}, not text, "
                        f"in row group {group}")
    return column


def read_documents(files: list[Path], text_field: str = "text", max_chars: int | None = None) -> Iterator[str]:
    """Every document of `files` in order, whole (a .txt file read to at most `max_chars` characters)."""
    for path in files:
        if _kind(path) != "txt":
            for piece in plan_pieces([path]):
                yield from documents_of(piece, text_field)
        else:
            gz = _gzipped(path)
            with (gzip.open if gz else open)(path, "rt", encoding="utf-8", errors="replace") as f:
                # at most the file's size (characters <= bytes): read(n) reserves n characters up front
                yield f.read(max_chars if gz else min(max_chars, path.stat().st_size)) if max_chars else f.read()
