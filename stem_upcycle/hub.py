"""Checkpoints named by Hugging Face Hub id, fetched as `from_pretrained` fetches them: by huggingface_hub, into
its standard cache (HF_HOME, HF_HUB_CACHE) where Transformers and vLLM find them again, with its progress bars,
its retries, and a cut download resumed; under HF_HUB_OFFLINE=1 nothing is requested.

Only what stem-upcycle reads is fetched: config, tokenizer, generation config, the card (the base model's licence
for the output's card) and the weights in one format: safetensors with their index, `.bin` only where there are
none; never the copies in other formats or folders (`original/`, `.gguf`). A STEM model is fetched whole: every
file of it belongs to its format (tables, modeling code, edit records). The small files come first, so that the
caller can check the model (its family, what a conversion of it writes) before the weights; the weights follow
a check of the free disk, where the download and the caller's output are summed per disk.
"""

import errno
import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import existing_parent
from .checkpoint_files import SMALL_FILES, TOKENIZER_FILES, WEIGHT_FORMATS, weight_file_names
from .errors import UserError

GB = 1e9


class HubError(UserError):
    """A checkpoint that cannot be fetched from the Hub; the message says why and what to do."""


@dataclass(frozen=True)
class HubOptions:
    """How a source named by hub id is fetched (and a local one opened)."""

    revision: str | None = None  # a branch, tag or commit of a hub id; None: main
    revision_from: str = "--revision"  # where the user gave it, for messages (--reference-revision, model.revision)
    token: str | None = None  # None: HF_TOKEN or the stored `hf auth login`, as huggingface_hub resolves them
    trust_remote_code: bool = False  # run the code of a checkpoint whose config needs its own classes
    progress: bool = True  # huggingface_hub's download bars


@dataclass(frozen=True)
class DiskNeed:
    """Bytes a run will write under `path` (a folder, which may not exist yet)."""

    path: Path
    bytes: int
    what: str  # "the download", "the output"


@dataclass
class Snapshot:
    """A revision of a hub repository in the local cache: its small files at least."""

    repo_id: str
    folder: Path  # HF_HUB_CACHE/models--ORG--NAME/snapshots/COMMIT
    pending: dict[str, int] = field(default_factory=dict)  # files still to download: name -> bytes
    wanted: list[str] = field(default_factory=list)  # every file the checkpoint needs
    stem: bool = False  # a STEM model (fetched whole)

    @property
    def commit(self) -> str:
        return self.folder.name

    @property
    def pending_bytes(self) -> int:
        return sum(self.pending.values())


def fetch_small_files(repo_id: str, options: HubOptions) -> Snapshot:
    """The repository's config, tokenizer, index and card in the cache, and which weights are still to come."""
    from huggingface_hub import constants

    revision = f" at revision {options.revision}" if options.revision else ""
    if constants.HF_HUB_OFFLINE:
        folder = _cached_folder(repo_id, options)
        if folder is None:
            raise HubError(f"HF_HUB_OFFLINE=1 forbids downloading, and {repo_id}{revision} is not in the Hugging Face "
                           f"cache ({constants.HF_HUB_CACHE}): run once online, or pass a local directory")
        if not _complete(folder):
            raise HubError(f"HF_HUB_OFFLINE=1 forbids downloading, and the cache holds {repo_id}{revision} only in "
                           f"part ({folder}): run once online to finish the download (it resumes)")
        return Snapshot(repo_id, folder)
    try:
        with _one_line_errors(repo_id, options):
            files, commit = _repository_files(repo_id, options)
    except HubError as err:
        folder = _cached_folder(repo_id, options) if str(err).startswith(UNREACHABLE) else None
        if folder is None or not _complete(folder):
            raise
        print(f"warning: {err}; using the cached {repo_id}{revision} ({folder.name[:12]})", file=sys.stderr)
        return Snapshot(repo_id, folder)  # from_pretrained's way: the cache, when the Hub does not answer
    top = {name: size for name, size in files.items() if "/" not in name}
    if "config.json" not in top:
        raise HubError(f"{repo_id} has no config.json at its top level (it is no Transformers checkpoint); for a "
                       f".gguf file, download it (`hf download {repo_id} FILE`) and pass its path")
    small = [n for n in (*SMALL_FILES, *TOKENIZER_FILES) if n in top]
    small += [f"{single}.index.json" for single, _ in WEIGHT_FORMATS if f"{single}.index.json" in top]
    if options.trust_remote_code:  # the checkpoint's own classes, which its config names
        small += [n for n in top if n.endswith(".py")]
    with _one_line_errors(repo_id, options):
        folder = _download(repo_id, options, small, options.revision)
    if folder.name != commit:  # the branch moved between the file list and the download
        raise HubError(f"{repo_id}{revision} changed while it was being fetched (commit {commit[:12]}, then "
                       f"{folder.name[:12]}): run again, or pin a commit with {options.revision_from}")
    stem = _model_type(folder) == "stem"
    if stem:
        wanted = list(files)  # a STEM model: all of it
    else:
        try:
            weights = weight_file_names(set(top), lambda index: json.loads((folder / index).read_text()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise HubError(f"{repo_id}'s weight index is not valid JSON with a weight_map: the repository is "
                           f"broken at commit {commit[:12]}; tell its authors, or pin a revision that works "
                           f"({options.revision_from})") from None
        if not weights:
            raise HubError(f"{repo_id} has no safetensors or PyTorch .bin weights at its top level; for a .gguf "
                           f"file, download it (`hf download {repo_id} FILE`) and pass its path")
        if missing := [name for name in weights if name not in files]:
            raise HubError(f"{repo_id}'s weight index names {missing[0]}, which the repository does not hold at "
                           f"commit {commit[:12]}: the repository is broken there; tell its authors, or pin a "
                           f"revision that works ({options.revision_from})")
        wanted = small + weights
    pending = {name: files[name] for name in wanted if not (folder / name).is_file()}
    return Snapshot(repo_id, folder, pending, wanted, stem)


def fetch_weights(snapshot: Snapshot, options: HubOptions, also: list[DiskNeed] = ()) -> None:
    """Download what `snapshot` still lacks, once the disk holds it and `also` (the caller's output)."""
    if not snapshot.pending:
        return
    check_disk([download_need(snapshot.pending_bytes), *also])
    with _one_line_errors(snapshot.repo_id, options):  # the commit of the small files, whatever the branch does
        _download(snapshot.repo_id, options, snapshot.wanted, snapshot.commit)
    snapshot.pending = {}


def download_need(size: int) -> DiskNeed:
    from huggingface_hub import constants

    return DiskNeed(Path(constants.HF_HUB_CACHE), size, "the download")


def describe_download(repo_id: str, size: int) -> str:
    """A plan's line for weights still to download."""
    from huggingface_hub import constants

    return f"download   {size / GB:.2f} GB of {repo_id} into {constants.HF_HUB_CACHE} (its weights, not yet cached)"


def check_disk(needs: list[DiskNeed]) -> None:
    """Refuse, in one line naming every size, a disk that cannot take what will be written to it."""
    disks: dict[int, list[tuple[DiskNeed, Path]]] = {}
    for need in needs:
        where = existing_parent(need.path)
        disks.setdefault(where.stat().st_dev, []).append((need, where))
    for group in disks.values():
        free = shutil.disk_usage(group[0][1]).free
        if sum(need.bytes for need, _ in group) > free:
            parts = " and ".join(f"{need.what} {need.bytes / GB:.2f} GB in {need.path}" for need, _ in group)
            raise HubError(f"not enough disk space: {parts}, {free / GB:.2f} GB free "
                           f"{'on that disk' if len(group) == 1 else 'on the disk of both'}; free space, or set "
                           f"HF_HUB_CACHE (the download) or choose OUT on another disk")


def _repository_files(repo_id: str, options: HubOptions) -> tuple[dict[str, int], str]:
    """(every file of the revision and its size, its commit): the repository's info, asked once and not retried
    (as `from_pretrained` asks), so that an unreachable Hub falls back to the cache at once."""
    from huggingface_hub import HfApi

    info = HfApi(token=options.token).model_info(repo_id, revision=options.revision, files_metadata=True)
    return {sibling.rfilename: sibling.size or 0 for sibling in info.siblings or []}, info.sha


def _download(repo_id: str, options: HubOptions, names: list[str], revision: str | None) -> Path:
    """`names` of the revision into the cache (a branch or tag: its ref is written, for offline runs)."""
    from huggingface_hub import snapshot_download

    with _progress_bars(options.progress):  # snapshot_download's pattern match: the names as they are
        return Path(snapshot_download(repo_id, revision=revision, token=options.token,
                                      allow_patterns=[_literal(n) for n in names]))


def _literal(name: str) -> str:
    """`name` as an fnmatch pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _cached_folder(repo_id: str, options: HubOptions) -> Path | None:
    """The cached revision's folder (no request is made), None when its config is not there."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json", revision=options.revision)
    return Path(config).parent if isinstance(config, str) else None


def _complete(folder: Path) -> bool:
    """Whether a cached snapshot holds every weight file its index (or its files) name."""
    try:
        weights = weight_file_names({p.name for p in folder.iterdir()},
                                    lambda index: json.loads((folder / index).read_text()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return bool(weights) and all((folder / name).is_file() for name in weights)


def _model_type(folder: Path) -> str | None:
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError):
        return None  # opening the folder says what is wrong with it


UNREACHABLE = "cannot reach the Hub"


@contextmanager
def _one_line_errors(repo_id: str, options: HubOptions, repo_type: str = "model") -> Iterator[None]:
    """huggingface_hub's errors, and a disk that fills, as one line with the fix (of a checkpoint, or of a dataset's
    files: `repo_type` "dataset")."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (DisabledRepoError, GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    page = f"{constants.ENDPOINT}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
    try:
        yield
    except GatedRepoError:
        raise HubError(f"{repo_id} is gated: accept its licence at {page}, then `hf auth login` or set HF_TOKEN "
                       f"(or pass --token) with a token of that account") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo_id} has no revision {options.revision!r} ({options.revision_from}): give a branch, "
                       f"tag or commit it has ({page}/tree/main)") from None
    except RepositoryNotFoundError:
        kind = "dataset repository" if repo_type == "dataset" else "repository"
        raise HubError(f"{repo_id} is not a {kind} on {constants.ENDPOINT}, or it is private and this token cannot "
                       f"see it: check the id, or log in (`hf auth login`, HF_TOKEN or --token)") from None
    except DisabledRepoError:
        raise HubError(f"{repo_id} is disabled on the Hub: its files cannot be downloaded; use another "
                       f"repository") from None
    except RemoteEntryNotFoundError as err:  # listed, then gone: the repository changed under the download
        raise HubError(f"{repo_id} no longer holds a file it listed ({_cause(err)}): run again, or pin a commit "
                       f"with {options.revision_from}") from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status == 401:
            raise HubError(f"the Hub refused the token (401, invalid credentials) for {repo_id}: check --token, "
                           f"HF_TOKEN or `hf auth login`") from None
        if status == 403:
            raise HubError(f"the token may not read {repo_id} (403): give it read access to the repository (a "
                           f"fine-grained token) or use another (--token, HF_TOKEN)") from None
        if status is None or status == 429 or status >= 500:  # the Hub down or busy: the cache may do
            raise HubError(f"{UNREACHABLE}: it answered {status} for {repo_id} after retries; try again "
                           f"later") from None
        raise HubError(f"the Hub answered {status} for {repo_id} ({_cause(err)}); check the id and "
                       f"{options.revision_from}") from None
    except OSError as err:  # LocalEntryNotFoundError (the Hub unreachable, the files not cached) is one too
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise HubError(f"the disk filled while downloading {repo_id} into {constants.HF_HUB_CACHE} "
                           f"({err.strerror}): free space (or set HF_HUB_CACHE to a larger disk) and run again; the "
                           f"download resumes") from None
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise HubError(f"cannot write to the Hugging Face cache {constants.HF_HUB_CACHE} ({err.strerror}): "
                           f"set HF_HOME or HF_HUB_CACHE to a folder of yours") from None
        if not (isinstance(err, LocalEntryNotFoundError) or _is_network_error(err)):
            raise
        raise _unreachable(repo_id, err) from None
    except Exception as err:
        if not _is_network_error(err):
            raise
        raise _unreachable(repo_id, err) from None


def _unreachable(repo_id: str, err: Exception) -> HubError:
    from huggingface_hub import constants

    return HubError(f"{UNREACHABLE} at {constants.ENDPOINT} ({_cause(err)}) to fetch {repo_id}: check the network, "
                    f"then run again (a cut download resumes)")


def _is_network_error(err: Exception) -> bool:
    # huggingface_hub raises its HTTP client's own errors once its retries are spent; the client has changed
    # between its versions (requests, httpx, httpx2), so they are known by their module
    return isinstance(err, (ConnectionError, TimeoutError)) or \
        type(err).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3")


def _cause(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no answer'}"


@contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hidden = are_progress_bars_disabled()
    if not show:
        disable_progress_bars()
    try:
        yield
    finally:
        if not show and not hidden:
            enable_progress_bars()
