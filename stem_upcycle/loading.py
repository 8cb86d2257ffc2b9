"""Loading a model or tokenizer from any SOURCE form `convert` accepts, for eval, calibration,
layer scoring and training alike."""

import os
from pathlib import Path

import torch

from .errors import UserError
from .hub import HubOptions
from .source import DTYPES, TOKENIZER_FILES, Source, open_source


class LoadError(UserError):
    pass


def resolve_device(device: str = "auto") -> torch.device:
    """`auto`: the accelerator if there is one (CUDA, or whatever torch.accelerator reports), else the CPU."""
    if device == "auto":
        accelerator = getattr(torch, "accelerator", None)
        current = accelerator.current_accelerator() if accelerator and accelerator.is_available() else None
        return current or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise LoadError(f"--device {device!r} is not a device; give auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise LoadError(f"--device {device}: this machine has no CUDA GPU that torch can use; give --device cpu")
    return resolved


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 natively: a CUDA GPU that supports it, or a CPU with AVX512-BF16 or AMX. Where
    a CPU emulates bf16 it is far slower than fp32 (1.2 GFLOP/s against 110 on an AVX2 CPU, benchmarks/README.md)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


FAST_DTYPE_ENV = "STEM_UPCYCLE_FAST_DTYPE"  # float32 or bfloat16: the same figures on every machine (tests set it)


def fast_dtype(device: torch.device) -> torch.dtype:
    """The dtype that reads text fastest on `device` for work that keeps no gradients (sampling the parent's text,
    reading its rows): bf16 where computed natively (5x fp32's tokens/s for SmolLM2 on 2 AMX cores), else fp32;
    $STEM_UPCYCLE_FAST_DTYPE chooses one for every machine."""
    chosen = os.environ.get(FAST_DTYPE_ENV)
    if chosen:
        if chosen not in ("float32", "bfloat16"):
            raise LoadError(f"{FAST_DTYPE_ENV}={chosen} is not a dtype stem-upcycle reads text in; give float32 or "
                            f"bfloat16, or unset it")
        return getattr(torch, chosen)
    return torch.bfloat16 if native_bf16(device) else torch.float32


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype models compute in on `device` (a name of source.DTYPES, or `auto`: bf16 on an accelerator
    that supports it, fp32 otherwise). fp16 is refused on the CPU (where torch computes it slowly and, for
    some operators, not at all)."""

    if dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    resolved = DTYPES[dtype]
    if resolved == torch.float16 and device.type == "cpu":
        raise LoadError("--dtype float16 on the CPU is not supported; use bfloat16 (on CPUs with native bf16) or "
                        "float32")
    return resolved


def load_model(spec: str, dtype: torch.dtype = torch.float32, stem_tables: str | None = None,
               hub: HubOptions = HubOptions()):
    """(model, source) for any SOURCE form `convert` accepts, STEM checkpoints included; `stem_tables`
    places a STEM model's tables (None: the checkpoint's default), and is ignored for a dense model; `hub`:
    how a hub id is fetched."""
    source = open_source(spec, hub)
    return model_from_source(source, dtype, stem_tables), source


def model_from_source(source: Source, dtype: torch.dtype = torch.float32, stem_tables: str | None = None):
    from transformers import AutoModelForCausalLM

    from .modeling.table_files import StemTablesError

    if source.directory is not None:
        placement = {"stem_tables": stem_tables} if stem_tables and source.config.model_type == "stem" else {}
        try:
            model, loading = AutoModelForCausalLM.from_pretrained(source.directory, dtype=dtype, output_loading_info=True,
                                                                  trust_remote_code=source.trust_remote_code, **placement)
        except StemTablesError as err:
            raise LoadError(f"{source.spec}: {err}") from None
        except RuntimeError as err:  # Transformers' report of checkpoint tensors shaped unlike the config's
            if "mismatch" not in str(err).lower() and "size" not in str(err).lower():
                raise
            raise LoadError(f"{source.spec} holds tensors shaped unlike its config.json says; the weights and the "
                            f"config do not belong together") from None
        missing = loading["missing_keys"]
    else:  # GGUF: the source already holds the dequantised weights
        model = AutoModelForCausalLM.from_config(source.config, dtype=dtype)
        missing, _ = model.load_state_dict({n: source.tensors.get(n) for n in source.tensors.names()}, strict=False)
        model.tie_weights()
    # Transformers fills weights missing from a checkpoint with random values, with a warning only.
    missing = sorted(k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings))
    if missing:
        raise LoadError(f"{source.spec} lacks {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1
                        else "") + "; the checkpoint is incomplete: restore it from the original")
    return model.eval()


def load_tokenizer(source: Source, needed_for: str = "eval needs one to read text"):
    """`source`'s tokenizer, or a one-line error ending in `needed_for` (what needs it, and the way out); loaded once
    per source (a GGUF file's is rebuilt from its vocabulary: 4 s for SmolLM2's on 2 cores)."""
    from transformers import AutoTokenizer

    if source.loaded_tokenizer is not None:
        return source.loaded_tokenizer

    path, kwargs = source.tokenizer_args
    folder = Path(path)
    # Some Transformers versions hand back a placeholder tokenizer for a folder without one.
    if folder.is_dir() and "gguf_file" not in kwargs and not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise LoadError(f"{source.spec} has no tokenizer that loads (no tokenizer files in {folder}); {needed_for}")
    try:
        source.loaded_tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as err:  # any failure means the same to the user: there is no usable tokenizer
        raise LoadError(f"{source.spec} has no tokenizer that loads ({type(err).__name__}); {needed_for}") from None
    return source.loaded_tokenizer


def stem_layers_of(config, layers=None) -> list[int]:
    """The STEM layers of a STEM model's config (all, or those of `layers`, checked)."""
    if getattr(config, "model_type", None) != "stem" or not getattr(config, "stem_layers", None):
        raise LoadError("this is a dense checkpoint: it has no STEM tables; convert it first with `stem-upcycle convert`")
    if layers is None:
        return list(config.stem_layers)
    if bad := sorted(set(layers) - set(config.stem_layers)):
        raise LoadError(f"layer {bad[0]} is not a STEM layer; this model's STEM layers are {config.stem_layers}")
    return sorted(set(layers))


def stem_tables(source: Source, layers=None):
    """The tables of a STEM checkpoint's layers (all STEM layers, or `layers`) as `MmapTables`: rows
    read from the safetensors files by positioned reads, nothing loaded whole."""
    from .modeling.stem_tables import MmapTables, locate_stem_tables
    from .modeling.table_files import StemTablesError, checkpoint_files

    config = source.config
    layers = stem_layers_of(config, layers)
    files = checkpoint_files(str(source.directory), {}) if source.directory is not None else None
    if files is None:
        raise LoadError(f"{source.spec} holds no safetensors files; its tables can only be read loaded whole")
    try:
        return MmapTables(locate_stem_tables(files, config, layers))
    except StemTablesError as err:
        raise LoadError(f"{source.spec}: {err}") from None
