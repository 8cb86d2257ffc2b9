"""Training text as token ids on disk: tokenised once, in parallel, then read a sequence at a time.

A corpus (.txt, .jsonl, .parquet files and their .gz forms, see documents.py) is cached file by file:
each file's tokens in a folder of their own, so that a corpus that grows by a file (a Hub dataset
read further, hub_datasets.py) tokenises that file alone. The files not cached yet are cut into
pieces. Processes take the pieces in turns (piece i on process i % world); each encodes its pieces a
batch at a time with the fast tokenizer, whose Rust thread pool encodes the pieces of a batch in
parallel, and appends the ids to a part file of its own. The main process then joins the parts, in
piece order, into each file's flat file of uint16 ids (uint32 for vocabularies over 65,536) with EOS
after every document, and writes its `meta.json` last: a cache folder is complete only once that
exists. A folder's name is a digest of its file (path, size, modification time), the text field, the
tokenizer's vocabulary and this format, so a later run, the dense baseline on the same data, and
every process of this run read the same file. The corpus is the files' streams one after another
(`TokenStream`). Runs that tokenise the same files at once (two jobs on one machine) encode into part
folders of their own and each publishes the same two files by an atomic rename. A held-out set needs
only its first ids: `tokenize_prefix` tokenises its pieces in order until it has them.

Reads go through `os.pread` of the sequences a step needs: nothing is mapped and no process ever
holds the corpus, so a process's memory does not grow with it.

Why not `datasets`: its text loader makes every line an example (or holds a whole file as one),
and its packing recipes drop each map batch's remainder; what training needs is one exact token
stream, which a flat file gives with less machinery.

A .txt file larger than a piece is tokenised piece by piece, cut only after a line break that is
followed by a non-space character, where byte-level BPE pre-tokenisers split anyway; tokenizers
that prefix a space to every text (SentencePiece with `add_prefix_space`) may tokenise the first
word of a piece differently, once per `PIECE_BYTES` of text.
"""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from ..atomic import staged_file
from ..documents import PIECE_BYTES, DataError, Piece, documents_of, plan_pieces

BATCH_PIECES = 2 * (os.cpu_count() or 1)  # pieces encoded at once, in parallel by the tokenizer's thread pool
FORMAT = 2  # bump when the file layout or the piece rule changes: old caches are then ignored


def _encode(pieces: list[Piece], tokenizer, text_field: str, eos: int) -> list[np.ndarray]:
    """Each piece's ids, EOS after each document; the pieces' documents encoded in one batch call."""
    docs = [documents_of(p, text_field) for p in pieces]
    flat = [d for ds in docs for d in ds]
    ids = tokenizer(flat, add_special_tokens=False, return_attention_mask=False)["input_ids"] if flat else []
    out, at = [], 0
    for piece, ds in zip(pieces, docs):
        parts = []
        for i in range(len(ds)):  # a .txt piece holds one document (or part of one), a .jsonl piece whole records
            parts += [ids[at + i], [eos] if piece.ends_document else []]
        at += len(ds)
        out.append(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0, np.int64))
    return out


def cache_key(files: list[Path], tokenizer, text_field: str, piece_bytes: int) -> str:
    identity = [_identity(f) for f in files]
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    payload = json.dumps({"files": identity, "text_field": text_field, "vocab": vocab, "class": type(tokenizer).__name__,
                          "eos": tokenizer.eos_token_id, "piece_bytes": piece_bytes, "format": FORMAT})
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def _identity(path: Path) -> tuple:
    """What names a file's content: its path, size and modification time; a file of the Hugging Face cache, its blob
    (named by its hash) and size, so that machines that each downloaded it into a cache of their own, at other
    times, share one token cache."""
    real = path.resolve()
    if real.parent.name == "blobs" and real.parent.parent.name.startswith(("datasets--", "models--")):
        return ("hub", real.parent.parent.name, real.name, real.stat().st_size)
    return (str(real), real.stat().st_size, real.stat().st_mtime_ns)


class TokenFile:
    """A complete cache folder's flat token stream, read by `pread`."""

    def __init__(self, folder: Path):
        meta = json.loads((folder / "meta.json").read_text())
        self.folder, self.tokens, self.dtype = folder, meta["tokens"], np.dtype(meta["dtype"])
        self._fd = os.open(folder / "tokens.bin", os.O_RDONLY)

    def __len__(self) -> int:
        return self.tokens

    def read(self, start: int, count: int) -> torch.Tensor:
        """[count] int64 ids from token `start`."""
        size = self.dtype.itemsize
        data = os.pread(self._fd, count * size, start * size)
        return torch.from_numpy(np.frombuffer(data, dtype=self.dtype).astype(np.int64))

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


def tokenised(path: Path, tokenizer, text_field: str, root: Path, piece_bytes: int = PIECE_BYTES) -> bool:
    """Whether `path` (a file not there yet: no) is in the token cache `root`."""
    return path.exists() and (root / cache_key([path], tokenizer, text_field, piece_bytes) / "meta.json").exists()


class TokenStream:
    """The token streams of a corpus's files one after another, as one."""

    def __init__(self, files: list[TokenFile]):
        self.files = files
        self.starts = np.cumsum([0] + [len(f) for f in files])
        self.dtype = files[0].dtype if files else np.dtype(np.uint16)

    @property
    def folders(self) -> list[Path]:
        return [f.folder for f in self.files]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, count: int) -> torch.Tensor:
        """[count] int64 ids from token `start`, across files where it crosses one's end."""
        parts, at, stop = [], start, start + count
        while at < stop:
            k = int(np.searchsorted(self.starts, at, side="right")) - 1
            take = min(stop, int(self.starts[k + 1])) - at
            parts.append(self.files[k].read(at - int(self.starts[k]), take))
            at += take
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def tokenize_corpus(files: list[Path], tokenizer, text_field: str, root: Path, rank: int = 0, world: int = 1,
                    wait=lambda: None, piece_bytes: int = PIECE_BYTES, run: str = "", progress: bool = False
                    ) -> TokenStream:
    """The corpus's token stream: each file's, tokenised now (this process's share of the pieces of the files not
    cached in `root` yet) or read from the cache, where each file has a folder of its own. A corpus that grows by
    a file (a Hub dataset read further) tokenises that file alone.

    Every process of a run calls this with the same arguments; `wait` is a barrier across them. `run` names
    the run, the same in all its processes (needed with several; one process: its own): runs that tokenise
    the same files at once write their parts into folders of their own and each publishes the same
    tokens.bin atomically. Which files this run tokenises is decided once, by its rank 0, so that its processes
    agree even when another run publishes a file meanwhile. `progress`: a bar of this process's pieces."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token to put between documents")
    if world > 1 and not run:
        raise ValueError("several processes tokenise into one folder: give them the same `run`")
    folders = [root / cache_key([f], tokenizer, text_field, piece_bytes) for f in files]
    staging = root / f"parts-{cache_key(files, tokenizer, text_field, piece_bytes)}-{run or os.getpid()}-of-{world}"
    decided = staging / "tokenise.json"  # written by rank 0: the files not cached yet
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a killed run's parts
        if missing := [i for i, folder in enumerate(folders) if not (folder / "meta.json").exists()]:
            staging.mkdir(parents=True)
            decided.write_text(json.dumps(missing))
    wait()
    todo = json.loads(decided.read_text()) if decided.exists() else []
    if todo:  # each process encodes pieces rank, rank + world, ... into its own part file
        failed = staging / f"part-{rank}.error"
        try:
            _encode_share([files[i] for i in todo], tokenizer, text_field, piece_bytes, rank, world, staging, progress)
        except DataError as err:  # told to every process after the barrier, so that none waits for this one
            failed.write_text(str(err))
    wait()
    if todo and (errors := sorted(staging.glob("part-*.error"))):
        raise DataError(errors[0].read_text())
    if todo and rank == 0:
        _join([folders[i] for i in todo], staging, world, token_dtype(tokenizer))
        shutil.rmtree(staging, ignore_errors=True)
    wait()
    return TokenStream([TokenFile(folder) for folder in folders])


def tokenize_prefix(files: list[Path], tokenizer, text_field: str, root: Path, tokens: int, rank: int = 0,
                    wait=lambda: None, piece_bytes: int = PIECE_BYTES) -> TokenFile:
    """The first `tokens` ids of the corpus's stream (fewer if it holds fewer), as `tokenize_corpus` would give them,
    tokenising its pieces in order only until there are that many: a held-out set scored on 65k tokens of a
    2 GB Hub file reads a few pieces of it. Rank 0 tokenises (a few pieces), the others wait for it."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token to put between documents")
    folder = root / f"{cache_key(files, tokenizer, text_field, piece_bytes)}-first-{tokens}"
    failed = root / f".{folder.name}.error-{os.getpid()}"
    if rank == 0 and not (folder / "meta.json").exists():
        try:
            ids, pieces = [], plan_pieces(files, piece_bytes)
            for at in range(0, len(pieces), BATCH_PIECES):
                ids += _encode(pieces[at : at + BATCH_PIECES], tokenizer, text_field, tokenizer.eos_token_id)
                if sum(map(len, ids)) >= tokens:
                    break
            stream = np.concatenate(ids)[:tokens] if ids else np.zeros(0, np.int64)
            folder.mkdir(parents=True, exist_ok=True)
            with staged_file(folder / "tokens.bin") as partial:
                partial.write_bytes(stream.astype(token_dtype(tokenizer)).tobytes())
            _complete(folder, int(stream.size), token_dtype(tokenizer))
        except DataError as err:  # told to every process after the barrier, so that none waits for this one
            root.mkdir(parents=True, exist_ok=True)
            failed.write_text(str(err))
    wait()
    if not (folder / "meta.json").exists():
        errors = sorted(root.glob(f".{folder.name}.error-*"))
        message = errors[-1].read_text() if errors else f"the held-out text of {files[0]} was not tokenised"
        wait()
        if rank == 0:
            for error in errors:
                error.unlink(missing_ok=True)
        raise DataError(message)
    return TokenFile(folder)


def _encode_share(files, tokenizer, text_field: str, piece_bytes: int, rank: int, world: int, staging: Path,
                  progress: bool = False) -> None:
    """This process's pieces of `files` into part-RANK.bin; part-RANK.json: each piece's [file, tokens]."""
    from tqdm.auto import tqdm

    pieces = plan_pieces(files, piece_bytes)
    which = {path: k for k, path in enumerate(files)}
    mine = list(range(rank, len(pieces), world))
    counts = []
    bar = tqdm(total=len(mine), desc=f"tokenising {len(files)} file(s)", unit="piece", disable=not progress,
               file=sys.stderr)
    with (staging / f"part-{rank}.bin").open("wb") as part, bar:
        for at in range(0, len(mine), BATCH_PIECES):
            batch = [pieces[i] for i in mine[at : at + BATCH_PIECES]]
            for piece, ids in zip(batch, _encode(batch, tokenizer, text_field, tokenizer.eos_token_id)):
                part.write(ids.astype(token_dtype(tokenizer)).tobytes())
                counts.append([which[piece.path], int(ids.size)])
            bar.update(len(batch))
    (staging / f"part-{rank}.json").write_text(json.dumps(counts))


def _join(folders: list[Path], staging: Path, world: int, dtype: np.dtype) -> None:
    """Each file's tokens.bin: its pieces from the parts in piece order (piece i is the (i // world)-th of part
    i % world; a file's pieces are consecutive), then its meta.json, which makes its folder complete."""
    if missing := [r for r in range(world) if not (staging / f"part-{r}.json").exists()]:
        raise DataError(f"the token parts of processes {missing} are not in {staging}: processes on other machines "
                        f"wrote them elsewhere; several machines need data.cache_dir (and generated.cache_dir) on "
                        f"a file system they all share")
    counts = [json.loads((staging / f"part-{r}.json").read_text()) for r in range(world)]
    order = [counts[i % world][i // world] for i in range(sum(map(len, counts)))]  # [file, tokens] by piece
    parts = [(staging / f"part-{r}.bin").open("rb") for r in range(world)]
    for k, folder in enumerate(folders):
        folder.mkdir(parents=True, exist_ok=True)
        total = 0
        with staged_file(folder / "tokens.bin") as partial, partial.open("wb") as out:
            for i, (file, tokens) in enumerate(order):
                if file == k:
                    out.write(parts[i % world].read(tokens * dtype.itemsize))
                    total += tokens
        _complete(folder, total, dtype)
    for f in parts:
        f.close()


def _complete(folder: Path, tokens: int, dtype: np.dtype) -> None:
    """meta.json, which makes a folder whose tokens.bin is written complete (another run may read it meanwhile)."""
    with staged_file(folder / "meta.json") as partial:
        partial.write_text(json.dumps({"tokens": tokens, "dtype": dtype.name, "format": FORMAT}) + "\n")


def token_dtype(tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32)


class Sequences:
    """Sequences of `seq_len + 1` tokens cut from a token stream (a `TokenFile` or a 1-D tensor):
    sequence i is stream[(first + i) * seq_len : (first + i + 1) * seq_len + 1], so consecutive
    sequences share one token and every token but the first is a target exactly once."""

    def __init__(self, stream, seq_len: int, first: int = 0, count: int | None = None, max_tokens: int = 0):
        tokens = min(len(stream), max_tokens) if max_tokens else len(stream)
        available = max(0, (tokens - 1) // seq_len - first)
        self.stream, self.seq_len, self.first = stream, seq_len, first
        self.count = available if count is None else min(count, available)

    def __len__(self) -> int:
        return self.count

    def split(self, tail: int) -> tuple["Sequences", "Sequences"]:
        """(all but the last `tail` sequences, the last `tail`)."""
        head = self.count - tail
        return (Sequences(self.stream, self.seq_len, self.first, head),
                Sequences(self.stream, self.seq_len, self.first + head, tail))

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        """[len(index), seq_len + 1] int64 ids of the sequences `index` (a 1-D tensor)."""
        n = self.seq_len
        starts = [(self.first + int(i)) * n for i in index]
        if isinstance(self.stream, torch.Tensor):
            return torch.stack([self.stream[s : s + n + 1] for s in starts]).long()
        return torch.stack([self.stream.read(s, n + 1) for s in starts])

    def tensor(self) -> torch.Tensor:
        """[len(self), seq_len + 1]: every sequence, in order (for small sets: held-out text)."""
        return self[torch.arange(self.count)] if self.count else torch.zeros(0, self.seq_len + 1, dtype=torch.long)
