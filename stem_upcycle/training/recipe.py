"""Training recipes: a YAML file read into dataclasses, with `section.key=value` overrides.

Every field has a default and a comment saying what it does; an unknown key or a value of the
wrong kind is a one-line error naming the valid keys.
"""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..convert import FIRST_TOKEN
from ..source import DTYPES
from ..errors import UserError
from ..generate import Sampling
from ..hub import HubOptions
from ..layers import DEFAULT_LAYERS
from ..neurons import ALL as ALL_COLUMNS, default_columns, parse_columns


class RecipeError(UserError):
    pass


@dataclass
class ModelSection:
    source: str = ""  # the dense checkpoint: teacher for distillation, and what is converted
    revision: str = ""  # a branch, tag or commit of `source` when it is a hub id; empty: main
    trust_remote_code: bool = False  # allow a `source` whose config needs its own code (as convert --trust-remote-code)
    init_from: str = ""  # an existing STEM checkpoint to start from; empty: convert `source` first
    layers: str = DEFAULT_LAYERS  # STEM layers when converting (as `convert --layers`)
    # which neurons of each STEM layer become table columns (as `convert --columns`); empty: convert's default
    # (neurons.default_columns: a share of every layer's with layers all, else whole layers)
    columns: str = ""
    init: str = "calib"  # table init when converting (as `convert --init`)
    first_token: str = "dense"  # what a sequence's first token reads in a STEM layer (as `convert --first-token`)
    # calibration text: files, globs or hf:ORG/NAME[/GLOB][@REVISION] datasets, each entry an equal share; default:
    # the training text's entries
    calib_data: list = field(default_factory=list)
    calib_tokens: int = 65536
    calib_seq_len: int = 512
    parent_contexts: int = 16  # contexts every token's row is read from the source after some of (as convert --parent-contexts)
    parent_reads: int = 4  # of those, how many each token is read after (as convert --parent-reads)
    shrink: float = 8.0  # a calibrated mean over n positions weighs n / (n + shrink) against the parent row (convert --shrink)
    fact_weight: float = 0.25  # the neurons also scored on completions of factual prompts (as convert --fact-weight)
    keep_init: bool = False  # keep the converted starting point in OUTPUT/init after export (to compare with it)
    export_dtype: str = "auto"  # dtype of the exported model: auto (the source's, as `convert --dtype auto`),
    # bfloat16, float32 or float16; training itself runs on an fp32 copy

    def hub(self, token: str | None = None, progress: bool = True) -> HubOptions:
        """How `source` is fetched when it is a hub id."""
        return HubOptions(revision=self.revision or None, token=token, trust_remote_code=self.trust_remote_code,
                          progress=progress, revision_from="model.revision")


@dataclass
class LocalSection:
    """Each converted layer fitted to its parent before end-to-end training (model.init calib or calib-mean;
    table_init/layer_fit.py), on the calibration windows: the stages run in this order, each switchable."""

    sequential: bool = False  # 1: a layer's rows calibrated on the inputs of the model whose earlier layers are fitted
    refit_down: float = 0.0  # 2: ridge strength of the refit of W_down to the parent MLP's outputs; 0: off
    epochs: int = 0  # 3: passes of local training (rows, gate, down on the error to the parent MLP's output); 0: off
    lr: float = 1.0e-3  # local training: peak learning rate of gate and down (Adam, cosine decay)
    row_lr: float = 1.0e-2  # local training: peak learning rate of the rows (sparse Adam)
    batch_tokens: int = 2048  # local training: tokens per step (whole calibration windows)


@dataclass
class DataSection:
    # Training text: .txt, .jsonl, .parquet (and .jsonl.gz, .json.gz, .txt.gz) files, globs, or Hugging Face datasets
    # `hf:ORG/NAME[/GLOB][@REVISION]` (downloaded as far as the run reads them: hub_datasets.py). Plain entries are
    # one corpus; entries {source: ..., weight: w} (all of them) are a mixture, each step's sequences drawn by weight.
    train: list = field(default_factory=list)
    # Held-out sets, each scored and reported on its own: {name: files}, or a plain list of files
    # (one set, "heldout"); datasets too. Never trained or calibrated on. Empty: the last `heldout_fraction` of
    # the training sequences.
    eval: dict = field(default_factory=dict)
    heldout_fraction: float = 0.05
    text_field: str = "text"  # the field of a .jsonl record or the column of a .parquet file that holds the document
    seq_len: int = 512  # tokens per packed training sequence (documents joined with EOS)
    max_train_tokens: int = 0  # 0: all
    eval_tokens: int = 8192  # held-out tokens of each set scored at each evaluation
    cache_dir: str = ""  # tokenised text; default: $STEM_UPCYCLE_CACHE/tokens or ~/.cache/stem-upcycle/tokens

    def train_sources(self) -> list[str]:
        """The training entries' files, globs or datasets."""
        return [entry["source"] if isinstance(entry, dict) else entry for entry in self.train]

    def train_weights(self) -> list[float] | None:
        """The mixture's weights, normalised; None when the entries are one corpus."""
        if not self.train or not isinstance(self.train[0], dict):
            return None
        total = sum(float(entry["weight"]) for entry in self.train)
        return [float(entry["weight"]) / total for entry in self.train]


@dataclass
class TrainSection:
    steps: int = 100  # optimizer steps
    batch_size: int = 8  # sequences per optimizer step, all processes together
    micro_batch_size: int = 8  # sequences per forward on one process (gradient accumulation above it)
    trainable: list = field(default_factory=lambda: ["tables"])  # tables, gate_down, mlp, norms, attention, embeddings, lora
    lr: float = 1e-4  # dense parts (AdamW)
    warmup_steps: int = 10
    weight_decay: float = 0.0
    min_lr_ratio: float = 0.1  # cosine decay to this fraction of the peak LR
    max_grad_norm: float = 1.0  # 0: no clipping
    precision: str = "auto"  # auto (bf16 autocast on GPUs that support it, fp32 on CPU), fp32, bf16
    gradient_checkpointing: bool = False
    seed: int = 0
    eval_every: int = 50  # steps; 0: only at the end
    checkpoint_every: int = 0  # steps; 0: no checkpoints
    keep_checkpoints: int = 2  # the newest checkpoints kept during the run
    keep_checkpoints_at_end: bool = False  # false: OUTPUT/checkpoints is removed once the model is exported
    log_every: int = 1


@dataclass
class GeneratedSection:
    """Text sampled from the dense source itself (LLM-QAT's data-free distillation; see generate.py)."""

    tokens: int = 0  # tokens to generate; 0: none
    length: int = Sampling.length  # tokens per generated sequence; joined with EOS, cut into data.seq_len + 1
    batch_size: int = Sampling.batch_size  # sequences generated at once
    first_tokens: int = Sampling.first_tokens  # after a random start token, these are among the top first_top_k
    first_top_k: int = Sampling.first_top_k
    temperature: float = Sampling.temperature  # every later token sampled from the full distribution
    seed: int = Sampling.seed
    train_share: float = 0.5  # share of each training batch's sequences that are generated
    calib_share: float = 0.5  # share of model.calib_tokens that are generated (when converting)
    ce: bool = False  # cross-entropy on generated text too; false: KL to the teacher only
    cache_dir: str = ""  # default: $STEM_UPCYCLE_CACHE/generated or ~/.cache/stem-upcycle/generated


@dataclass
class TablesSection:
    optimizer: str = "rowwise_adagrad"  # rowwise_adagrad (a scalar per row), adam (lazy, full state), adamw (dense)
    lr: float = 1e-2
    warmup_steps: int = 0
    weight_decay: float = 0.0  # decoupled, applied to the rows a step touches
    max_grad_norm: float = 0.0  # clipping of the table gradients, separate from the dense parts; 0: none
    eps: float = 1e-8
    # Where each machine's one copy of the tables and their optimizer state lives while training
    # (fp32 files mapped by every process, in a subfolder per run and machine); default
    # OUTPUT/host-tables, removed after export. /dev/shm keeps it in RAM, off the disk.
    host_dir: str = ""


@dataclass
class LossSection:
    kd_weight: float = 1.0  # KL(teacher || student) on the next-token distributions
    ce_weight: float = 1.0  # cross-entropy on the data
    temperature: float = 1.0
    chunk_tokens: int = 0  # positions per LM-head chunk; 0: as many as fit 64 MiB of logits


@dataclass
class HandoffSection:
    steps: int = 0  # blend up = (1 - a) W_up x + a U[ids], a rising 0 -> 1 over these steps; 0: no blend


@dataclass
class LoraSection:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])


def bf16_autocast(train: TrainSection, gpu_with_bf16: bool) -> bool:
    """Whether training runs under bf16 autocast: asked for (`precision: bf16`), or `auto` on a GPU with bf16."""
    return train.precision == "bf16" or (train.precision == "auto" and gpu_with_bf16)


def check_batch(train: TrainSection, processes: int) -> None:
    """A step's sequences split evenly over the processes and their micro-batches, or a RecipeError."""
    if train.batch_size % (processes * train.micro_batch_size):
        raise RecipeError(f"train.batch_size {train.batch_size} must be a multiple of processes x micro_batch_size "
                          f"({processes} x {train.micro_batch_size})")


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    local: LocalSection = field(default_factory=LocalSection)
    data: DataSection = field(default_factory=DataSection)
    generated: GeneratedSection = field(default_factory=GeneratedSection)
    train: TrainSection = field(default_factory=TrainSection)
    tables: TablesSection = field(default_factory=TablesSection)
    loss: LossSection = field(default_factory=LossSection)
    handoff: HandoffSection = field(default_factory=HandoffSection)
    lora: LoraSection = field(default_factory=LoraSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


TRAINABLE_PARTS = ("tables", "gate_down", "mlp", "norms", "attention", "embeddings", "lora")
TABLE_OPTIMIZERS = ("rowwise_adagrad", "adam", "adamw")
PRECISIONS = ("auto", "fp32", "bf16")


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    """Read a recipe file (or start from the defaults) and apply `section.key=value` overrides."""
    raw = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise RecipeError(f"recipe {path} does not exist") from None
        except yaml.YAMLError as err:
            raise RecipeError(f"recipe {path} is not valid YAML: {str(err).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise RecipeError(f"recipe {path} must be a mapping of sections (model, data, train, ...)")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise RecipeError(f"override {item!r} must look like section.key=value, e.g. train.steps=200")
        section, name = key.strip().split(".", 1)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise RecipeError(f"recipe section {section!r} must be a mapping")
        raw[section][name] = yaml.safe_load(value)
    recipe = _build(Recipe, raw, "")
    if not recipe.model.columns:  # a conversion's default; a model given as init_from has its own
        recipe.model.columns = (ALL_COLUMNS if recipe.model.init_from else
                                default_columns(recipe.model.layers, recipe.model.init in ("calib", "calib-mean")))
    _validate(recipe)
    return recipe


def _build(cls, raw: dict, where: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe section {where.rstrip('.')!r} must be a mapping")
    if unknown := sorted(set(raw) - set(fields)):
        raise RecipeError(f"recipe key {where}{unknown[0]!r} is unknown; valid keys: {', '.join(fields)}")
    values = {}
    for name, value in raw.items():
        default = fields[name].default_factory() if fields[name].default_factory is not dataclasses.MISSING else fields[name].default
        if dataclasses.is_dataclass(default):
            values[name] = _build(type(default), value or {}, f"{where}{name}.")
        else:
            values[name] = _coerce(value, default, f"{where}{name}")
    return cls(**values)


def _coerce(value, default, key: str):
    if isinstance(default, dict):  # named file lists; a plain list (or one file) is one set
        if not isinstance(value, dict):
            return {"heldout": _coerce(value, [], key)} if value else {}
        return {str(name): _coerce(files, [], f"{key}.{name}") for name, files in value.items()}
    if isinstance(default, list):  # one entry (a file, a mapping) or a list of them
        return [value] if isinstance(value, (str, dict)) else list(value or [])
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise RecipeError(f"recipe key {key} must be true or false, got {value!r}")
        return value
    if isinstance(default, (int, float)):
        try:
            number = float(value)  # YAML reads 1e-4 as a string
        except (TypeError, ValueError):
            raise RecipeError(f"recipe key {key} must be a number, got {value!r}") from None
        if isinstance(default, int) and not number.is_integer():
            raise RecipeError(f"recipe key {key} must be a whole number, got {value!r}")
        return int(number) if isinstance(default, int) else number
    return "" if value is None else str(value)


# The range of every numeric key, in one place ("> 0", ">= 0", "[0, 1]", "[0, 1)"); a value outside is a
# one-line error. Every numeric field of Recipe is listed (a test checks it).
RANGES = {
    "model.calib_tokens": "> 0", "model.calib_seq_len": ">= 2", "model.parent_contexts": ">= 0", "model.parent_reads": ">= 1", "model.shrink": ">= 0",
    "model.fact_weight": ">= 0",
    "local.refit_down": ">= 0", "local.epochs": ">= 0", "local.lr": "> 0", "local.row_lr": "> 0",
    "local.batch_tokens": "> 0",
    "data.heldout_fraction": "[0, 1)", "data.seq_len": "> 0", "data.max_train_tokens": ">= 0", "data.eval_tokens": "> 0",
    "train.steps": "> 0", "train.batch_size": "> 0", "train.micro_batch_size": "> 0", "train.lr": ">= 0",
    "train.warmup_steps": ">= 0", "train.weight_decay": ">= 0", "train.min_lr_ratio": "[0, 1]",
    "train.max_grad_norm": ">= 0", "train.seed": "[0, 9.2e18]", "train.eval_every": ">= 0", "train.checkpoint_every": ">= 0",
    "train.keep_checkpoints": "> 0", "train.log_every": "> 0",
    "generated.tokens": ">= 0", "generated.length": "> 0", "generated.batch_size": "> 0",
    "generated.first_tokens": ">= 0", "generated.first_top_k": "> 0", "generated.temperature": "> 0",
    "generated.seed": "[0, 9.2e18]", "generated.train_share": "[0, 1]", "generated.calib_share": "[0, 1]",
    "tables.lr": ">= 0", "tables.warmup_steps": ">= 0", "tables.weight_decay": ">= 0", "tables.max_grad_norm": ">= 0",
    "tables.eps": "> 0",
    "loss.kd_weight": ">= 0", "loss.ce_weight": ">= 0", "loss.temperature": "> 0", "loss.chunk_tokens": ">= 0",
    "handoff.steps": ">= 0",
    "lora.r": "> 0", "lora.alpha": "> 0", "lora.dropout": "[0, 1)",
}


def in_range(value: float, bounds: str) -> bool:
    if bounds.startswith(">"):
        op, limit = bounds.split()
        return value > float(limit) if op == ">" else value >= float(limit)
    low, high = (float(x) for x in bounds[1:-1].split(","))
    return low <= value and (value <= high if bounds.endswith("]") else value < high)


def _validate(recipe: Recipe) -> None:
    for key, bounds in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(recipe, section), name)
        if not in_range(value, bounds):
            raise RecipeError(f"recipe key {key} must be {bounds if bounds[0] == '>' else 'in ' + bounds}, got {value}")
    t = recipe.train
    if bad := [p for p in t.trainable if p not in TRAINABLE_PARTS]:
        raise RecipeError(f"train.trainable: {bad[0]!r} is unknown; choose from {', '.join(TRAINABLE_PARTS)}")
    if not t.trainable:
        raise RecipeError("train.trainable is empty; name what trains, e.g. [tables]")
    if recipe.tables.optimizer not in TABLE_OPTIMIZERS:
        raise RecipeError(f"tables.optimizer {recipe.tables.optimizer!r} is unknown; choose {', '.join(TABLE_OPTIMIZERS)}")
    if t.precision not in PRECISIONS:
        raise RecipeError(f"train.precision {t.precision!r} is unknown; choose {', '.join(PRECISIONS)}")
    if t.batch_size % t.micro_batch_size:
        raise RecipeError(f"train.batch_size {t.batch_size} is not a multiple of train.micro_batch_size {t.micro_batch_size}")
    if recipe.loss.kd_weight + recipe.loss.ce_weight == 0:
        raise RecipeError("loss.kd_weight and loss.ce_weight are both 0: nothing to learn from")
    g = recipe.generated
    if g.first_tokens >= g.length:
        raise RecipeError(f"generated.first_tokens {g.first_tokens} must be below generated.length {g.length}")
    if g.tokens and g.tokens < recipe.data.seq_len + 1:
        raise RecipeError(f"generated.tokens {g.tokens} makes no training sequence of data.seq_len + 1 = "
                          f"{recipe.data.seq_len + 1} tokens")
    _validate_train_entries(recipe.data)
    _validate_text_entries(recipe)
    if (not g.tokens or g.train_share < 1) and not recipe.data.train:
        raise RecipeError("data.train is empty; list training text files, or train on generated text alone "
                          "(generated.tokens > 0 and generated.train_share: 1)")
    if not recipe.data.train and not recipe.data.eval:
        raise RecipeError("with no training text there is nothing to hold out: name held-out sets in data.eval")
    if bad := [name for name, files in recipe.data.eval.items() if not files]:
        raise RecipeError(f"data.eval set {bad[0]!r} names no file")
    if recipe.model.export_dtype not in ("auto", *DTYPES):
        raise RecipeError(f"model.export_dtype {recipe.model.export_dtype!r} is unknown; choose auto, {', '.join(DTYPES)}")
    local = recipe.local
    fits = local.sequential or local.refit_down or local.epochs
    if fits and recipe.model.init_from:
        raise RecipeError(f"the local: stages run when this recipe converts model.source, and model.init_from "
                          f"{recipe.model.init_from} is converted already: drop model.init_from, or the local: stages")
    if fits and recipe.model.init not in ("calib", "calib-mean"):
        raise RecipeError(f"the local: stages fit calibrated rows, and model.init is {recipe.model.init!r}: set "
                          f"model.init: calib, or turn the stages off (local.sequential false, refit_down 0, epochs 0)")
    try:
        columns = parse_columns(recipe.model.columns)
    except UserError as err:
        raise RecipeError(f"model.columns: {err}") from None
    if columns.measured and recipe.model.init_from:
        raise RecipeError(f"model.columns {recipe.model.columns} applies to a conversion of model.source, and "
                          f"model.init_from {recipe.model.init_from} is converted already (its columns are its own): "
                          f"drop model.columns or model.init_from")
    if columns.measured and recipe.model.init not in ("calib", "calib-mean"):
        raise RecipeError(f"model.columns {recipe.model.columns} chooses neurons by their error with calibrated rows, "
                          f"and model.init is {recipe.model.init!r}: set model.init: calib")
    if recipe.model.first_token not in FIRST_TOKEN:
        raise RecipeError(f"model.first_token {recipe.model.first_token!r} is unknown; choose {' or '.join(FIRST_TOKEN)}")
    if not recipe.model.source:
        raise RecipeError("model.source is empty; name the dense checkpoint (the teacher), e.g. smollm2-135m")


def _validate_text_entries(recipe: Recipe) -> None:
    """Every text entry a file, glob or well-formed `hf:` dataset (a mapping only in data.train: a mixture's)."""
    from ..hub_datasets import DatasetSpec, is_dataset

    entries = [("model.calib_data", e) for e in recipe.model.calib_data]
    entries += [(f"data.eval.{name}", e) for name, files in recipe.data.eval.items() for e in files]
    entries += [("data.train", e) for e in recipe.data.train_sources()]
    for key, entry in entries:
        if not isinstance(entry, str):
            raise RecipeError(f"{key} entry {entry!r} must be a file, a glob or an hf: dataset (weights belong to "
                              f"data.train entries)")
        if is_dataset(entry):
            try:
                DatasetSpec.parse(entry, key)
            except UserError as err:
                raise RecipeError(str(err)) from None


def _validate_train_entries(data: DataSection) -> None:
    example = "e.g. {source: hf:HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet, weight: 0.8}"
    weighted = [isinstance(entry, dict) for entry in data.train]
    for entry in data.train:
        if isinstance(entry, dict):
            if set(entry) != {"source", "weight"} or not isinstance(entry["source"], str):
                raise RecipeError(f"data.train entry {entry!r} must have the keys source and weight ({example})")
            try:
                weight = float(entry["weight"])
            except (TypeError, ValueError):
                weight = -1.0
            if not weight > 0:
                raise RecipeError(f"data.train entry {entry['source']}: weight must be a number > 0, got {entry['weight']!r}")
        elif not isinstance(entry, str):
            raise RecipeError(f"data.train entry {entry!r} must be a file, a glob, an hf: dataset or a mapping "
                              f"({example})")
    if any(weighted) and not all(weighted):
        raise RecipeError(f"data.train mixes weighted and plain entries: give every entry a weight ({example}), or "
                          f"none (one corpus)")
    if any(weighted) and not data.eval:
        raise RecipeError("a weighted data.train is not split for held-out text: name held-out sets in data.eval")
