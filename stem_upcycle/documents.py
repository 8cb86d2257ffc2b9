"""Documents of the text files training and evaluation read: .txt (the file is one document),
.jsonl (one document per record, in `text_field`) and .parquet (one per row, in the column
`text_field`; read with pyarrow, which `datasets` brings, as a Hugging Face dataset's files are).

Files are cut into pieces that can be read (and tokenised) apart: byte ranges of about
`PIECE_BYTES` cut after a line break (before a non-space character in a .txt file, where
byte-level BPE pre-tokenisers split anyway), or a parquet file's row groups.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import UserError

PIECE_BYTES = 1 << 18  # text per encode call: ~80k tokens, whose encodings take ~20 MB
TXT_CUT = re.compile(rb"\n(?=[^\s])")  # a cut point: after a newline, before a non-space byte
JSONL_CUT = re.compile(rb"\n")


class DataError(UserError):
    pass


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
        if path.suffix == ".parquet":
            pieces += [Piece(path, g, g + 1, True) for g in range(_parquet(path).num_row_groups)]
            continue
        size = path.stat().st_size
        cut = JSONL_CUT if path.suffix == ".jsonl" else TXT_CUT
        start = 0
        with path.open("rb") as f:
            while start < size:
                stop = _next_cut(f, cut, start + piece_bytes, size)
                pieces.append(Piece(path, start, stop, path.suffix == ".jsonl" or stop == size))
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
    if piece.path.suffix == ".parquet":
        return _parquet_documents(piece, text_field)
    with piece.path.open("rb") as f:
        f.seek(piece.start)
        data = f.read(piece.stop - piece.start)
    if piece.path.suffix != ".jsonl":
        return [data.decode("utf-8", errors="replace")]
    documents = []
    for number, line in enumerate(data.decode("utf-8", errors="replace").split("\n")):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            where = f"{piece.path}:{_line_number(piece, number)}"
            if record is None:
                raise DataError(f"{where} is not valid JSON; a .jsonl file has one object per line")
            raise DataError(f"{where} has no string field {text_field!r}; set data.text_field")
        documents.append(record[text_field])
    return documents


def _line_number(piece: Piece, line_in_piece: int) -> int:
    with piece.path.open("rb") as f:
        return f.read(piece.start).count(b"\n") + line_in_piece + 1


def _parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path.name} needs pyarrow: pip install 'stem-upcycle[parquet]' (or pyarrow)") from None
    try:
        return pq.ParquetFile(path)
    except Exception as err:  # pyarrow's errors for a file that is not parquet have no common base
        raise DataError(f"{path} is not a readable parquet file ({type(err).__name__}); check the file") from None


def _parquet_documents(piece: Piece, text_field: str) -> list[str]:
    table = _parquet(piece.path)
    if text_field not in table.schema_arrow.names:
        raise DataError(f"{piece.path} has no column {text_field!r} (columns: {', '.join(table.schema_arrow.names)}); "
                        f"set data.text_field")
    column = table.read_row_group(piece.start, columns=[text_field]).column(text_field).to_pylist()
    bad = next((i for i, v in enumerate(column) if not isinstance(v, str)), None)
    if bad is not None:
        raise DataError(f"{piece.path}: column {text_field!r} holds a {type(column[bad]).__name__}, not text, "
                        f"in row group {piece.start}")
    return column


def read_documents(files: list[Path], text_field: str = "text", max_chars: int | None = None) -> Iterator[str]:
    """Every document of `files` in order, whole (a .txt file read to at most `max_chars` characters)."""
    for path in files:
        if path.suffix in (".jsonl", ".parquet"):
            for piece in plan_pieces([path]):
                yield from documents_of(piece, text_field)
        else:
            with path.open(encoding="utf-8", errors="replace") as f:
                # at most the file's size (characters <= bytes): read(n) reserves n characters up front
                yield f.read(min(max_chars, path.stat().st_size)) if max_chars else f.read()
