"""Text named by Hugging Face dataset id, `hf:ORG/NAME[/GLOB][@REVISION]`, fetched only as far as a run reads it.

A corpus of tens of GB is never fetched whole. Its data files (.parquet, .jsonl, .jsonl.gz, .json.gz, .txt, .txt.gz;
those matching GLOB, where `*` also crosses folders: FineWeb-Edu's `sample/10BT/*.parquet` picks a config) are taken
in the repository's order (by path) until their tokens cover what the run reads, times MARGIN. The tokens are
estimated before any file is downloaded: each file's size from the repository's listing, times the tokens per byte
of a sample of the first file (its first parquet row group, or its first MiB), read by range requests through
huggingface_hub's HfFileSystem and tokenised by the run's tokenizer. So `train --plan` names the files a run will
fetch, and the disk check covers them and their token cache before the first byte.

Files are downloaded by huggingface_hub into its standard cache (resumable, its progress bars, HF_TOKEN), as a
checkpoint is (hub.py, whose one-line errors serve both). What a resolution learns is recorded in stem-upcycle's
cache (`datasets/`): the revision's listing (the commit a branch named the first time) and the sample's tokens per
byte. A later run, and each later process of a machine, reads those records and the Hugging Face cache and asks the
Hub nothing, offline (HF_HUB_OFFLINE=1) too. A branch is therefore pinned to the commit of its first resolution:
name a newer one with @REVISION, or delete the record (`train --plan` prints where it is).
"""

import fnmatch
import hashlib
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from .documents import DataError, is_data_file, jsonl_documents, parquet_texts
from .generate import cache_root
from .hub import GB, HubOptions, _literal, _one_line_errors, _progress_bars

MARGIN = 1.25  # files are taken until their estimated tokens pass the need by this factor
SAMPLE_BYTES = 1 << 20  # a .jsonl/.txt sample: the first MiB (a parquet sample: the first row group)
SPEC = re.compile(r"hf:(?P<repo>[\w.-]+/[\w.-]+)(?:/(?P<glob>[^@]+?))?/?(?:@(?P<revision>.+))?")


@dataclass(frozen=True)
class DatasetSpec:
    text: str  # as the recipe gives it
    repo: str  # ORG/NAME
    glob: str  # "" : every data file
    revision: str | None  # None: main

    @classmethod
    def parse(cls, text: str, what: str) -> "DatasetSpec":
        match = SPEC.fullmatch(text)
        if not match:
            raise DataError(f"{what}: {text!r} must look like hf:ORG/NAME, hf:ORG/NAME/GLOB or hf:ORG/NAME/GLOB@REVISION")
        return cls(text, match["repo"], match["glob"] or "", match["revision"])

    def hub(self, token: str | None, progress: bool) -> HubOptions:
        return HubOptions(revision=self.revision, token=token, progress=progress,
                          revision_from=f"the @REVISION of {self.text}")


@dataclass
class Resolved:
    """What a run reads of one dataset: the first `len(files)` data files of a revision, in the repository's order."""

    spec: DatasetSpec
    commit: str
    files: list[tuple[str, int]]  # (path in the repository, bytes), taken
    matching: int  # data files the glob matches
    matching_bytes: int
    tokens_per_byte: float  # measured on a sample of the first file
    need: int  # tokens the run reads of it
    records: list[Path] = field(default_factory=list)  # the cache records this resolution read or wrote

    @property
    def folder(self) -> Path:
        return _snapshot(self.spec.repo, self.commit)

    @property
    def paths(self) -> list[Path]:
        return [self.folder / name for name, _ in self.files]

    @property
    def pending(self) -> list[tuple[str, int]]:
        """The taken files not in the Hugging Face cache yet."""
        return [(name, size) for name, size in self.files if not (self.folder / name).is_file()]

    @property
    def estimated_tokens(self) -> int:
        return round(sum(size for _, size in self.files) * self.tokens_per_byte)

    @property
    def short(self) -> str:
        """What a dataset too small for the run says: "" when its files cover the need."""
        if len(self.files) < self.matching or self.estimated_tokens >= self.need or not self.tokens_per_byte:
            return ""
        return (f"{self.spec.text} holds ~{self.estimated_tokens:,} tokens in all {self.matching} files, for "
                f"{self.need:,} read: the steps read its sequences more than once")

    def describe(self, token_bytes: int | None) -> list[str]:
        """The plan's lines: which files, their size, what is still to download, the token cache (`token_bytes` an
        id; None: no cache, as a conversion's calibration reads the files)."""
        taken = sum(size for _, size in self.files)
        pending = sum(size for _, size in self.pending)
        names = [name for name, _ in self.files]
        shown = ", ".join(names[:3]) + (f", ... {names[-1]}" if len(names) > 3 else "")
        return [f"  {self.spec.text}: {self.spec.repo} at commit {self.commit[:12]}, {len(self.files)} of "
                f"{self.matching} files ({taken / GB:.2f} of {self.matching_bytes / GB:.2f} GB): {shown}",
                f"    ~{self.estimated_tokens:,} tokens ({self.tokens_per_byte:.3f} tokens/byte, measured on the first "
                f"file) for {self.need:,} read x {MARGIN}; to download {pending / GB:.2f} GB"
                + (f"; token cache {self.estimated_tokens * token_bytes / GB:.2f} GB" if token_bytes else ""),
                f"    recorded in {self.records[0].parent}" if self.records else "",
                f"    warning: {self.short}" if self.short else ""]

    def record(self) -> dict:
        """What the output's config and card say of it, and what a resumed run reads again."""
        return {"dataset": self.spec.repo, "revision": self.commit, "glob": self.spec.glob,
                "files": [[name, size] for name, size in self.files], "matching": self.matching,
                "matching_bytes": self.matching_bytes, "tokens_per_byte": self.tokens_per_byte}


def is_dataset(text: str) -> bool:
    return isinstance(text, str) and text.startswith("hf:")


def resolve(spec: DatasetSpec, need: int, tokenizer, text_field: str, token: str | None = None,
            pinned: dict | None = None) -> Resolved:
    """Which files of `spec` cover `need` tokens, from the records, or the Hub's listing and a sample of the first
    file (nothing is downloaded); `pinned`: a resumed run's record of it (`Resolved.record`), used as it is."""
    if pinned is not None:
        files = [(name, size) for name, size in pinned["files"]]
        return Resolved(spec, pinned["revision"], files, pinned["matching"], pinned["matching_bytes"],
                        pinned["tokens_per_byte"], need)
    (commit, listing), listing_record = _listing(spec, token), _listing_record(spec)
    matching = sorted((name, size) for name, size in listing.items() if is_data_file(name) and _matches(name, spec.glob))
    if not matching:
        data = sorted(name for name in listing if is_data_file(name))
        example = (f"; its data files are e.g. {', '.join(data[:3])}" if data else
                   f"; it has no folder {_folder(spec)}" if _folder(spec) and not listing else "; it has no data file")
        raise DataError(f"{spec.text}: the glob {spec.glob or '*'!r} matches no .parquet, .jsonl(.gz), .json.gz or "
                        f".txt file of {spec.repo} at commit {commit[:12]}{example}: fix the glob")
    ratio, ratio_record = _tokens_per_byte(spec, commit, matching[0], tokenizer, text_field, token)
    total, taken = 0.0, 0
    for taken, (_, size) in enumerate(matching, 1):
        total += size * ratio
        if total >= need * MARGIN:
            break
    return Resolved(spec, commit, matching[:taken], len(matching), sum(size for _, size in matching), ratio, need,
                    [listing_record, ratio_record])


def _matches(name: str, glob: str) -> bool:
    """Whether the glob takes the file `name`: fnmatch's match (`*` crosses folders), or a folder named without a
    wildcard holds it."""
    if not glob or fnmatch.fnmatchcase(name, glob):
        return True
    return not any(c in glob for c in "*?[") and name.startswith(glob.rstrip("/") + "/")


def download(resolved: Resolved, token: str | None, progress: bool) -> list[Path]:
    """The taken files in the Hugging Face cache (downloaded now where missing); their local paths."""
    from huggingface_hub import constants, snapshot_download

    spec = resolved.spec
    if missing := resolved.pending:
        if constants.HF_HUB_OFFLINE:
            raise DataError(f"HF_HUB_OFFLINE=1 forbids downloading, and the Hugging Face cache lacks {len(missing)} of "
                            f"the {len(resolved.files)} files of {spec.text} this run reads ({missing[0][0]} first): "
                            f"run once online (a cut download resumes)")
        options = spec.hub(token, progress)
        with _one_line_errors(spec.repo, options, "dataset"), _progress_bars(progress):
            snapshot_download(spec.repo, repo_type="dataset", revision=resolved.commit, token=token,
                              allow_patterns=[_literal(name) for name, _ in missing])
    return resolved.paths


# -- the revision's listing ---------------------------------------------------------------------------
def _records_folder(spec: DatasetSpec) -> Path:
    """The records of a repository, apart for each Hub (HF_ENDPOINT: a mirror's listing is its own)."""
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    hub = "" if endpoint == "https://huggingface.co" else hashlib.sha256(endpoint.encode()).hexdigest()[:8]
    return cache_root(None, "datasets") / hub / spec.repo.replace("/", "--")


def _folder(spec: DatasetSpec) -> str:
    """The folder the glob names before its first wildcard ("" : the top): all that is listed of the repository."""
    parts = spec.glob.split("/")[:-1]
    wild = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
    return "/".join(parts[:wild])


def _listing_record(spec: DatasetSpec) -> Path:
    where = hashlib.sha256(_folder(spec).encode()).hexdigest()[:12]
    return _records_folder(spec) / f"listing-{quote(spec.revision or 'main', safe='')}-{where}.json"


def _listing(spec: DatasetSpec, token: str | None) -> tuple[str, dict[str, int]]:
    """(commit, {path: bytes} of the files under the glob's folder): the record, or the Hub's answer (recorded), or
    offline the revision's folder in the Hugging Face cache."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.hf_api import RepoFile

    record = _listing_record(spec)
    if record.is_file():
        saved = json.loads(record.read_text())
        return saved["commit"], saved["files"]
    at = f" at revision {spec.revision}" if spec.revision else ""
    if constants.HF_HUB_OFFLINE:
        folder = _cached_folder(spec)
        if folder is None:
            raise DataError(f"HF_HUB_OFFLINE=1 forbids downloading, and {spec.repo}{at} is not in the Hugging Face "
                            f"cache ({constants.HF_HUB_CACHE}) nor recorded by an earlier run: run once online")
        files = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
        return folder.name, files
    from huggingface_hub.errors import RemoteEntryNotFoundError

    api = HfApi(token=token)
    with _one_line_errors(spec.repo, spec.hub(token, False), "dataset"):
        commit = api.dataset_info(spec.repo, revision=spec.revision).sha  # then the folder at that commit alone: a
        # corpus such as allenai/c4 holds tens of thousands of files
        try:
            files = {entry.path: entry.size or 0 for entry in api.list_repo_tree(
                spec.repo, _folder(spec) or None, recursive=True, revision=commit, repo_type="dataset")
                if isinstance(entry, RepoFile)}
        except RemoteEntryNotFoundError:  # no such folder
            files = {}
    if files:  # a folder that does not exist (yet) is asked again next time
        _write(record, {"commit": commit, "files": files})
    return commit, files


def _snapshot(repo: str, commit: str) -> Path:
    """Where the Hugging Face cache holds a dataset's files at `commit`."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"datasets--{repo.replace('/', '--')}" / "snapshots" / commit


def _cached_folder(spec: DatasetSpec) -> Path | None:
    from .source import cached_snapshot

    return cached_snapshot(spec.repo, "dataset", spec.revision)


# -- tokens per byte ----------------------------------------------------------------------------------
def _tokens_per_byte(spec: DatasetSpec, commit: str, first: tuple[str, int], tokenizer, text_field: str,
                     token: str | None) -> tuple[float, Path]:
    """Tokens per byte of the file `first` (path, bytes) on a sample of it: the record, else measured (recorded)."""
    from huggingface_hub import HfFileSystem, constants

    name, _ = first
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    key = hashlib.sha256(json.dumps([commit, name, text_field, vocab]).encode()).hexdigest()[:20]
    record = _records_folder(spec) / f"sample-{key}.json"
    if record.is_file():
        return json.loads(record.read_text())["tokens_per_byte"], record
    local = _snapshot(spec.repo, commit) / name
    where = f"{spec.repo}/{name}"
    if local.is_file():
        with local.open("rb") as f:
            documents, disk = sample_documents(f, name, text_field, where)
    elif constants.HF_HUB_OFFLINE:
        raise DataError(f"HF_HUB_OFFLINE=1 forbids downloading, and {where}, whose sample sizes the download, is not "
                        f"in the Hugging Face cache: run once online")
    else:
        with _one_line_errors(spec.repo, spec.hub(token, False), "dataset"):
            # a new instance: fsspec's cache of them would keep one with an earlier endpoint and listing
            fs = HfFileSystem(endpoint=constants.ENDPOINT, token=token, skip_instance_cache=True)
            with fs.open(f"datasets/{spec.repo}@{commit}/{name}", "rb", block_size=SAMPLE_BYTES) as f:
                documents, disk = sample_documents(f, name, text_field, where)
    ids = tokenizer(documents, add_special_tokens=False, return_attention_mask=False)["input_ids"] if documents else []
    tokens = sum(map(len, ids)) + len(ids)  # and an EOS after each document
    if not tokens or not disk:
        raise DataError(f"{where} holds no text in its sample ({text_field!r}): check the file, or the glob")
    ratio = tokens / disk
    _write(record, {"tokens_per_byte": ratio, "file": name, "sample_tokens": tokens, "sample_bytes": disk})
    return ratio, record


def sample_documents(f, name: str, text_field: str, where: str) -> tuple[list[str], int]:
    """(documents of the start of the open file `f` named `name`, the bytes of the file they take)."""
    lower = name.lower()
    if lower.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(f)
            group = table.metadata.row_group(0)
        except (pa.ArrowException, IndexError) as err:  # not parquet, or no row group (the Hub's errors go through)
            raise DataError(f"{where} is not a readable parquet file ({type(err).__name__}); check the glob") from None
        return parquet_texts(table, 0, text_field, where), sum(group.column(i).total_compressed_size
                                                                 for i in range(group.num_columns))
    if lower.endswith(".gz"):
        data, disk = _gunzip_start(f, where)
    else:
        data = f.read(SAMPLE_BYTES)
        while b"\n" not in data and (more := f.read(SAMPLE_BYTES)):  # a first record longer than the sample
            data += more
        disk = len(data)
    kept = data[: data.rfind(b"\n") + 1] or data  # whole lines: the last one may be cut
    disk = max(1, round(disk * len(kept) / max(1, len(data))))
    text = kept.decode("utf-8", errors="replace")
    if lower.endswith((".jsonl", ".jsonl.gz", ".json.gz")):
        return jsonl_documents(text, text_field, lambda number: f"{where}:{number + 1}"), disk
    return [text], disk


def _gunzip_start(f, where: str) -> tuple[bytes, int]:
    """(the first SAMPLE_BYTES of a gzip file's content, and up to its first newline at least; the compressed bytes
    they took), counted exactly: GzipFile's read-ahead would count bytes it has not used."""
    inflate = zlib.decompressobj(wbits=31)
    data, fed = b"", 0
    try:
        while len(data) < SAMPLE_BYTES or b"\n" not in data:
            chunk = inflate.unconsumed_tail or f.read(1 << 16)
            if not inflate.unconsumed_tail:
                fed += len(chunk)
            if not chunk:
                break
            data += inflate.decompress(chunk, SAMPLE_BYTES)
            if inflate.eof:
                break
    except zlib.error as err:
        raise DataError(f"{where} is not a readable gzip file ({err}); check the file") from None
    return data, max(1, fed - len(inflate.unconsumed_tail) - len(inflate.unused_data))


def _write(path: Path, content: dict) -> None:
    from .atomic import staged_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with staged_file(path) as partial:
        partial.write_text(json.dumps(content) + "\n")

