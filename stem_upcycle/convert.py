"""Convert a dense checkpoint into a STEM checkpoint, out of core.

`plan_conversion` decides everything (layers, output tensors, shards, sizes) without reading a
weight; `run_conversion` streams: dense tensors are read one at a time and copied, tables are
computed in chunks of vocabulary rows and written as they are computed, on a writer thread.
Everything goes into a temporary directory beside OUT that is moved into place only when complete.
"""

import math
import os
import queue
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers.utils.hub import convert_file_size_to_int

from . import card
from .errors import UserError
from .hub import DiskNeed
from .families import (EMBEDDING, LAYER_PREFIX, LM_HEAD, STEM_GATE, STEM_NEURON_ORDER, STEM_TABLE_PREFIX, STEM_UP,
                       STEM_UP_REST, Family, family_for, layer_name)
from .layers import DEFAULT_LAYERS
from .neurons import NeuronSplit, column_step, default_columns, describe_columns
from .modeling.configuration_stem import table_columns
from .modeling import StemConfig
from .modeling.table_files import TABLE_GROUP_PREFIX
from .modeling.table_format import TableFormat, TableFormatError
from .atomic import existing_parent, write_staged
from .shards import BackgroundWriter, ShardWriter, TensorSpec, plan_shards
from .stages import stage
from .source import DTYPES, TOKENIZER_FILES, Source
from .summary import describe_widths, table_layout
from .table_init import INITIALISERS, InitOptions, InitTarget
from .table_init.layer_choice import is_auto
from .table_init.layer_fit import describe_options, fit_record
from .table_init.row_choice import RowChoice, choose_rows

MODELING_DIR = Path(__file__).parent / "modeling"
MODELING_FILES = ("configuration_stem.py", "modeling_stem.py", "forward_ids.py", "stem_tables.py", "table_files.py",
                  "table_format.py")
AUTO_MAP = {
    "AutoConfig": "configuration_stem.StemConfig",
    "AutoModel": "modeling_stem.StemModel",
    "AutoModelForCausalLM": "modeling_stem.StemForCausalLM",
}
CHUNK_BYTES = 64 * 2**20  # rows of a table computed at once
POOL_BUFFERS = 3  # chunk buffers in circulation: one computing, up to two queued for the disk
# Tables are computed in fp32 and cast when written. Measured on this project's AVX2 CPU (no native
# bf16): fp32 mm ~100 GFLOP/s, bf16 1-15 GFLOP/s depending on layout, fp16 slower still.
COMPUTE_DTYPE = torch.float32
FIRST_TOKEN = ("dense", "table")  # --first-token: what a sequence's first token reads in a STEM layer (StemMLP)


class ConversionError(UserError):
    """A conversion refused before anything was written; the message names the problem and the fix."""


@dataclass(frozen=True, eq=False)
class Copy:
    """An output tensor taken from a source tensor: rows [start, stop) of it when rows is set; then, with `neurons`,
    those intermediate neurons in that order (`NeuronSplit`): rows of a gate or up-projection (axis 0), columns of
    a down-projection (axis 1)."""

    source_name: str
    rows: tuple[int, int] | None = None
    neurons: torch.Tensor | None = None
    axis: int = 0

    def shape(self, source: tuple[int, ...]) -> tuple[int, ...]:
        """The output's shape, of a source tensor of shape `source`."""
        shape = list(source)
        if self.rows is not None:
            shape[0] = self.rows[1] - self.rows[0]
        if self.neurons is not None:
            shape[self.axis] = self.neurons.numel()
        return tuple(shape)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            tensor = tensor[self.rows[0] : self.rows[1]]
        return tensor if self.neurons is None else tensor.index_select(self.axis, self.neurons)


@dataclass(frozen=True, eq=False)
class Constant:
    """An output tensor the plan holds itself (a layer's `neuron_order`)."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class Table:
    """An output tensor that is a table, or one stored part of it (`TableFormat.parts`)."""

    layer: int
    part: str = "weight"


@dataclass(frozen=True)
class TableGroup:
    """An output tensor holding the float tables of `layers` side by side, a token's rows of each layer
    next to each other (`config.stem_table_groups`)."""

    layers: tuple[int, ...]
    part: str = "weight"


@dataclass
class ConversionPlan:
    source: Source
    family: Family
    layers: list[int]
    dtype: torch.dtype
    init: str
    specs: list[TensorSpec]
    producers: dict  # output name -> Copy | Table | TableGroup
    shards: list[list[TensorSpec]]
    config: StemConfig
    init_options: InitOptions  # what the init reads besides the checkpoint (calibration text, ...)
    # For `--layers auto:` in a dry run: the spec; `layers` then stands for the chosen count (sizes only)
    auto_spec: str | None = None
    table_format: TableFormat | None = None  # how the tables' rows are stored; None: float, in `dtype`
    choice: RowChoice | None = None  # the layers and, in each, the neurons that became rows (`choose_rows`)
    columns_spec: str = "all"  # --columns, for the plan's description

    @property
    def columns(self) -> dict[int, NeuronSplit]:
        """Per converted layer whose table holds some of its neurons, their split (empty: whole layers)."""
        return self.choice.columns if self.choice is not None else {}

    @property
    def init_target(self) -> InitTarget:
        return InitTarget(self.source, self.family, self.config, self.layers, self.columns)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def table_specs(self) -> list[TensorSpec]:
        return [s for s in self.specs if isinstance(self.producers[s.name], (Table, TableGroup))]

    @property
    def table_bytes(self) -> int:
        return sum(s.nbytes for s in self.table_specs)

    @property
    def layer_groups(self) -> int:
        """The most STEM layers whose tables share a tensor (`config.stem_table_groups`; 1: a tensor per table)."""
        return max(map(len, self.config.stem_table_groups or [[0]]))

    @property
    def group_columns(self) -> int:
        """The most table columns that share a tensor (a group's, or the widest table's)."""
        cfg = self.config
        return max(sum(table_columns(cfg, layer) for layer in group)
                   for group in cfg.stem_table_groups or [[layer] for layer in self.layers])

    @property
    def chunk_rows(self) -> int:
        return chunk_rows(self.config.intermediate_size)

    @property
    def reads_parent_rows(self) -> bool:
        """Whether the init reads every token's row from the parent (`InitOptions.parent`): a calibrating init's."""
        return INITIALISERS[self.init].needs_data and self.init_options.parent.contexts > 0

    @property
    def parent_positions(self) -> int:
        """Forward positions of the parent the whole vocabulary's rows take (vocab x contexts); 0: none read."""
        return self.init_options.parent.positions(self.config.vocab_size) if self.reads_parent_rows else 0

    @property
    def parent_bytes(self) -> int:
        """Bytes of the whole vocabulary's parent rows, kept on OUT's disk while the tables are written."""
        if not self.reads_parent_rows:
            return 0
        width = sum(table_columns(self.config, layer) for layer in self.layers)
        itemsize = 4 if self.dtype == torch.float32 else 2  # as the init keeps them: fp32 for fp32 tables, else bf16
        return self.config.vocab_size * width * itemsize

    def parent_flops(self) -> float:
        """FLOPs of the parent's forwards that read every token's rows: 2 x the weights of its layers up to the
        last STEM layer per position (the contexts' own positions are 1/10 of it more)."""
        cfg = self.config
        d, d_ff, heads, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or d // heads
        per_layer = d * head_dim * (2 * heads + 2 * kv) + 3 * d * d_ff
        return 2.0 * per_layer * (max(self.layers) + 1) * self.parent_positions

    @property
    def fits(self) -> bool:
        """Whether the init fits the layers one after another (`FitOptions`), a calibrating init's option."""
        return INITIALISERS[self.init].needs_data and self.init_options.fit.active

    def ram_estimate(self) -> int:
        """Peak bytes held: the embedding, chunk buffers, one W_up, two dense tensors in flight."""
        tensors = self.source.tensors
        cfg = self.config
        embedding = tensors.nbytes(EMBEDDING)
        chunk = self.chunk_rows * cfg.intermediate_size * COMPUTE_DTYPE.itemsize
        # a group's layers' W_up (of their table columns) are held together
        up = self.group_columns * cfg.hidden_size * (4 + COMPUTE_DTYPE.itemsize)
        largest = max(s.nbytes for s in self.specs if not isinstance(self.producers[s.name], (Table, TableGroup)))
        runtime = 600 * 2**20  # Python, torch and transformers themselves
        if INITIALISERS[self.init].needs_data:  # the dense model in fp32, the seen tokens' means and a layer's sums
            params = sum(math.prod(tensors.shape(n)) for n in tensors.names())
            # distinct tokens in n tokens of text, about 3 n^0.75 (SmolLM2's sampled text: 11,539 in 65,536)
            seen = min(cfg.vocab_size, int(3 * (self.init_options.calib_tokens or cfg.vocab_size) ** 0.75))
            widths = [table_columns(cfg, layer) for layer in self.layers]
            runtime += 4 * params + 4 * seen * (sum(widths) + 2 * max(widths))
            # the parent read in bf16 beside it (fp32 where bf16 is emulated: the model itself). Not counted: the
            # whole vocabulary's parent rows, a mapped file whose pages the kernel may drop (they show in the RSS:
            # SmolLM2 by default, 6.9 GB peak RSS against this estimate's 4.9 GB and 1.5 GB of rows)
            runtime += 2 * params
        if self.fits:  # the windows' stream, one layer's inputs and targets (fp32), a Gram matrix and its solve
            tokens = self.init_options.calib_tokens or 0
            runtime += 3 * 4 * tokens * cfg.hidden_size + 3 * 8 * (cfg.intermediate_size + 1) ** 2
        return embedding + (POOL_BUFFERS + 1) * chunk + up + 3 * largest + self.source.in_memory_bytes + runtime

    def describe(self) -> str:
        cfg, gb = self.config, 1e9
        lines = [
            f"source     {self.source.spec}{f' at commit {self.source.revision[:12]}' if self.source.revision else ''} "
            f"({cfg.dense_model_type}, {cfg.num_hidden_layers} layers, "
            f"vocab {cfg.vocab_size}, d {cfg.hidden_size}, d_ff {cfg.intermediate_size})",
            f"stem       {len(self.layers)} of {cfg.num_hidden_layers} layers: "
            + (f"chosen by the real run ({self.auto_spec}: every layer calibrated, then each converted alone "
               f"and scored on calibration windows)" if self.auto_spec else f"{self.layers}"),
            f"columns    {self.describe_columns()}",
            f"init       {self.init}: {INITIALISERS[self.init].description}",
            *([f"fit        {describe_options(self.init_options.fit)}"] if self.fits else []),
            f"tables     {len(self.layers)} x [{cfg.vocab_size}, {describe_widths(cfg)}] {self.table_format.describe()}"
            f" = {self.table_bytes / gb:.2f} GB ({self.table_bytes / len(self.layers) / gb:.2f} GB each), "
            f"{table_layout(cfg.stem_table_groups)}",
            *([f"parent     every token read after {self.init_options.parent.per_token} of {self.init_options.parent.contexts} "
               f"contexts of {self.init_options.parent.context_length} tokens: {self.parent_positions:,} positions of "
               f"the source "
               f"({self.parent_flops() / 1e12:.0f} TFLOP), its rows kept on OUT's disk while the tables are written "
               f"({self.parent_bytes / gb:.2f} GB)"] if self.reads_parent_rows else []),
            f"output     {self.total_bytes / gb:.2f} GB in {len(self.shards)} shard(s)",
            f"peak RAM   ~{self.ram_estimate() / gb:.1f} GB (estimate)",
        ]
        return "\n".join(lines)

    def describe_columns(self) -> str:
        """What became table columns, in a line (in a dry run of a measured choice: how many, not which)."""
        line = describe_columns(self.columns, self.config.intermediate_size, self.layers)
        if self.columns_spec != "all" and self.choice is not None and not self.choice.measured:
            return f"{line}; which neurons, the real run chooses ({self.columns_spec}: each neuron's error as a " \
                   f"table column scored on calibration windows kept out of its rows)"
        return line


def chunk_rows(d_ff: int) -> int:
    """Rows of a table computed (or re-encoded) at once."""
    return max(1, CHUNK_BYTES // (d_ff * COMPUTE_DTYPE.itemsize))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else -1


def tensor_order_key(name: str):
    # Embedding first, then layers in numeric order, then the final norm and the head.
    layer = _layer_of(name)
    if layer >= 0:
        return (1, layer, name)
    return (0 if name == EMBEDDING else 2, 0, name)


def plan_conversion(
    source: Source,
    layers: str = DEFAULT_LAYERS,
    dtype: str = "auto",
    init: str = "closed-form",
    max_shard_size: str | int = "5GB",
    init_options: InitOptions | None = None,
    progress: bool = False,
    dry_run: bool = False,
    first_token: str = "dense",
    table_dtype: str | None = None,
    block_size: int | None = None,
    layer_groups: int | None = None,
    columns: str | None = None,
) -> ConversionPlan:
    """Decide every output tensor and shard without reading any weight (choices that measure, `--layers auto:` and
    `--columns`, read them to score layers and neurons, except in a dry run, which plans for as many without
    choosing them: `choose_rows`).

    `first_token`: "dense" keeps each STEM layer's up-projection of its table columns for the sequences' first
    tokens (see `StemMLP`), "table" reads their rows like any other token's. `table_dtype` stores the tables'
    rows as a float dtype or compressed (int8, float8, int4 with per-`block_size` scales); None: `dtype`.
    `layer_groups`: float tables stored in groups of that many consecutive STEM layers (`table_groups`).
    `columns`: which of each converted layer's neurons become table columns (neurons.py); the others keep a dense
    up-projection, and the layer's neurons are ordered table columns first; None: `default_columns`."""
    if init not in INITIALISERS:
        raise ConversionError(f"--init {init!r} is unknown; choose one of {', '.join(INITIALISERS)}")
    columns = default_columns(layers, INITIALISERS[init].needs_data) if columns is None else columns
    dense = source.config
    family = family_for(dense.model_type)
    check_source(source, family)
    if first_token not in FIRST_TOKEN:
        raise ConversionError(f"--first-token {first_token!r} is unknown; choose {' or '.join(FIRST_TOKEN)}")
    dense_first = first_token == "dense"
    init_options = replace(init_options or InitOptions())  # the plan's own: --layers auto adds its calibration
    if init_options.fit.active and not INITIALISERS[init].needs_data:
        raise ConversionError(f"fitting the layers to the parent (--sequential, --refit-down, --local-epochs) starts "
                              f"from calibrated rows, and --init is {init}: use --init calib with --calib-data")
    if INITIALISERS[init].needs_data and not init_options.has_text:
        raise ConversionError(f"--init {init} needs calibration text: pass --calib-data FILE (plain text) "
                              f"or --calib-generate TOKENS (text sampled from the model itself)")
    out_dtype = resolve_dtype(dtype, source)
    d_ff = dense.intermediate_size
    table_format = resolve_table_format(table_dtype or _dtype_name(out_dtype), block_size, d_ff)
    provisional = stem_config(dense, family, [0], init, torch.float32, False, dense_first)
    choice = choose_rows(source, family, provisional, layers, columns, init, init_options,
                         column_step(d_ff, table_format.block_size), progress, dry_run)
    if choice.calibration is not None:  # --layers auto calibrated every layer already: the init reuses it
        init_options.calibration = choice.calibration
    if choice.text_inputs is not None:  # a neuron choice read the text's MLP inputs: the rows are calibrated from them
        init_options.mlp_inputs, init_options.reading_model = choice.text_inputs, choice.reading_model
    stem_layers, splits = choice.layers, choice.columns
    widths = choice.table_columns(d_ff)
    check_blocks(table_format, widths)
    shard_bytes = parse_shard_size(max_shard_size)
    if layer_groups is None and table_format.compressed:  # compressed tables: a tensor (and scales) per table
        groups = None
    elif layer_groups is None:  # the columns of DEFAULT_LAYER_GROUPS whole tables a group, at most what a shard holds
        column_bytes = dense.vocab_size * table_format.parts(d_ff)["weight"][1].itemsize
        groups = groups_of_columns(stem_layers, widths, min(DEFAULT_LAYER_GROUPS * d_ff, shard_bytes // column_bytes))
    else:
        groups = table_groups(stem_layers, layer_groups, table_format)
    first_of_group = {group[0]: (k, group) for k, group in enumerate(groups or [])}
    tensors = source.tensors

    specs, producers = [], {}
    dropped = set()
    for layer in stem_layers:  # the up-projection (and its bias) is what the table replaces
        if not (family.fused_gate_up or dense_first or layer in splits):  # a fused gate_up is cut below
            dropped |= {layer_name(layer, family.up + ".weight"), layer_name(layer, family.up + ".bias")}
    if getattr(dense, "tie_word_embeddings", False):
        dropped.add(LM_HEAD)  # tied: stored once, as the embedding
    names = sorted((n for n in tensors.names() if n not in dropped), key=tensor_order_key)
    for position, name in enumerate(names):
        layer = _layer_of(name)
        kind = tensors.dtype(name)
        outputs = _mlp_outputs(name, layer, family, splits.get(layer), dense_first, d_ff) if layer in stem_layers \
            else None
        for out_name, producer in outputs or [(name, Copy(name))]:
            shape = producer.shape(tuple(tensors.shape(name)))
            specs.append(TensorSpec(out_name, shape, out_dtype if kind.is_floating_point else kind))
            producers[out_name] = producer
        last_of_layer = position + 1 == len(names) or _layer_of(names[position + 1]) != layer
        if layer in splits and last_of_layer:  # which parent neuron each of the STEM MLP's is
            order = layer_name(layer, STEM_NEURON_ORDER)
            specs.append(TensorSpec(order, (d_ff,), torch.int64))
            producers[order] = Constant(splits[layer].order)
        if layer in first_of_group and last_of_layer:  # a group's tables where its first layer's would be
            k, group = first_of_group[layer]
            specs.append(TensorSpec(table_group_name(k), (dense.vocab_size, sum(widths[i] for i in group)),
                                    table_format.parts(d_ff)["weight"][1]))
            producers[table_group_name(k)] = TableGroup(tuple(group))
        elif layer in stem_layers and last_of_layer and not groups:
            for part, (width, part_dtype) in table_format.parts(widths[layer]).items():
                table = layer_name(layer, f"{STEM_TABLE_PREFIX}.{part}")
                specs.append(TensorSpec(table, (dense.vocab_size, width), part_dtype))
                producers[table] = Table(layer, part)
    has_bias = layer_name(stem_layers[0], STEM_GATE + ".bias") in producers
    config = stem_config(dense, family, stem_layers, init, out_dtype, has_bias, dense_first)
    config.stem_table_format = table_format.to_config()
    if source.hub_id:  # where the parent comes from, to the commit where known: what a user fetches to compare
        config.stem_base_model = source.hub_id
        config.stem_base_revision = source.revision
    config.stem_table_groups = groups
    config.stem_table_columns = {str(layer): k for layer, k in widths.items()} if splits else None
    if choice.layer_costs is not None:  # what the choice rests on, kept for the user (and for choosing other counts)
        config.stem_layer_costs = {str(layer): round(cost, 4) for layer, cost in choice.layer_costs.items()}
        config.stem_layer_fact_costs = {str(layer): round(cost, 4) for layer, cost in choice.fact_costs.items()}
    shards = plan_shards(specs, shard_bytes)
    auto_spec = layers if is_auto(layers) and dry_run else None
    return ConversionPlan(source, family, stem_layers, out_dtype, init, specs, producers, shards, config, init_options,
                          auto_spec, table_format, choice, columns)


def _mlp_outputs(name: str, layer: int, family: Family, split: NeuronSplit | None, dense_first: bool,
                 d_ff: int) -> list[tuple[str, Copy]] | None:
    """The output tensors a STEM layer's MLP tensor `name` becomes: a fused gate_up cut into the gate and the up
    rows of the table columns (the first token's); with a split, gate rows and down columns reordered, table
    columns first, and the up rows cut into the table columns' (`up_proj`, the first token's) and the others'
    (`up_rest`). None: copied as it is."""
    order, table, rest = (None, None, None) if split is None else (split.order, split.table, split.rest)
    for kind in ("weight", "bias"):
        if family.fused_gate_up and name == layer_name(layer, f"{family.fused_gate_up}.{kind}"):
            up = (d_ff, 2 * d_ff)
            return [(layer_name(layer, f"{STEM_GATE}.{kind}"), Copy(name, (0, d_ff), order)),
                    *([(layer_name(layer, f"{STEM_UP}.{kind}"), Copy(name, up, table))] if dense_first else []),
                    *([(layer_name(layer, f"{STEM_UP_REST}.{kind}"), Copy(name, up, rest))] if split else [])]
        if split is None:
            continue
        if name == layer_name(layer, f"{family.gate}.{kind}"):
            return [(name, Copy(name, neurons=order))]
        if name == layer_name(layer, f"{family.up}.{kind}"):
            return [*([(layer_name(layer, f"{STEM_UP}.{kind}"), Copy(name, neurons=table))] if dense_first else []),
                    (layer_name(layer, f"{STEM_UP_REST}.{kind}"), Copy(name, neurons=rest))]
    if split is not None and name == layer_name(layer, f"{family.down}.weight"):
        return [(name, Copy(name, neurons=order, axis=1))]
    return None


# Consecutive STEM layers whose tables a conversion stores side by side (`config.stem_table_groups`), at
# most: fewer where a group would not fit in a shard (--max-shard-size; Llama-3.2-1B's bf16 tables in 5 GB: 2).
# benchmarks/row_layout.py, all 30 SmolLM2 layers, 504 cold random ids: groups of 5 read a forward's rows
# in a third of the time a tensor per table takes (3,027 reads instead of 15,135), while the first STEM
# layer waits about as long as it does for its own table's rows (21-25 ms against 16-20 ms).
DEFAULT_LAYER_GROUPS = 5


def table_groups(layers: list[int], layer_groups: int, table_format: TableFormat) -> list[list[int]] | None:
    """`config.stem_table_groups`: the STEM layers `layers` in groups of `layer_groups` consecutive ones;
    None for a tensor per table (1)."""
    if layer_groups < 1:
        raise ConversionError(f"--layer-groups {layer_groups}: give 1 (a tensor per table) or more layers per group")
    if layer_groups > 1 and table_format.compressed:
        raise ConversionError(f"--layer-groups {layer_groups} stores float tables side by side, and {table_format.dtype} "
                              f"is compressed: give a float --table-dtype (float32, bfloat16, float16) or --layer-groups 1")
    layers = sorted(layers)
    groups = [layers[i : i + layer_groups] for i in range(0, len(layers), layer_groups)]
    return groups if layer_groups > 1 and len(layers) > 1 else None


def groups_of_columns(layers: list[int], widths: dict[int, int], columns: int) -> list[list[int]] | None:
    """`config.stem_table_groups` of convert's default: consecutive STEM layers side by side while their tables'
    columns (`widths`) add up to at most `columns` (a table wider alone is a group of its own); None for a tensor
    per table. Narrow tables (`--columns`) so lie in as few groups as whole ones of as many columns, and a forward
    reads a token's rows in as many reads."""
    groups, width = [], columns + 1
    for layer in sorted(layers):
        if width + widths[layer] > columns:
            groups.append([])
            width = 0
        groups[-1].append(layer)
        width += widths[layer]
    return groups if any(len(group) > 1 for group in groups) else None


def table_group_name(k: int) -> str:
    """The tensor of the `k`-th group of tables: `model.stem_table_groups.K.weight`."""
    return LAYER_PREFIX[: LAYER_PREFIX.index("layers.")] + f"{TABLE_GROUP_PREFIX}.{k}.weight"


# Tensors that only quantized checkpoints hold: per-block or per-channel scales, packed integer weights.
QUANTIZATION_TENSORS = ("weight_scale", "weight_scale_inv", "input_scale", ".scales", ".qweight", ".qzeros", ".absmax")
# The dtypes of a dense checkpoint's weights as they are: float8 or integer weights are quantized ones (the tables'
# own float dtypes are table_format.FLOAT_DTYPES)
UNQUANTIZED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_mlp_tensors(source: Source, family: Family) -> None:
    """Every layer's MLP weights and the embedding are there with the config's shapes: a missing or
    misshapen tensor would otherwise surface as an error deep inside the init, or as a written model
    that cannot load."""
    cfg, tensors = source.config, source.tensors
    d, d_ff = cfg.hidden_size, cfg.intermediate_size
    expected = {EMBEDDING: (cfg.vocab_size, d)}
    for layer in range(cfg.num_hidden_layers):
        if family.fused_gate_up:
            expected[layer_name(layer, family.fused_gate_up + ".weight")] = (2 * d_ff, d)
        else:
            expected[layer_name(layer, family.gate + ".weight")] = (d_ff, d)
            expected[layer_name(layer, family.up + ".weight")] = (d_ff, d)
        expected[layer_name(layer, family.down + ".weight")] = (d, d_ff)
    for name, shape in expected.items():
        if name not in tensors:
            raise ConversionError(f"{source.spec} lacks {name}, which every {cfg.model_type} checkpoint has; the "
                                  f"checkpoint is incomplete: restore it from the original")
        if tuple(tensors.shape(name)) != shape:
            raise ConversionError(f"{source.spec}: {name} has shape {list(tensors.shape(name))}, its config says "
                                  f"{list(shape)}; the weights and config.json do not belong together")


def check_source(source: Source, family: Family) -> None:
    """A checkpoint that converts: unquantized, every MLP tensor there with its config's shape (dtypes and shapes
    read alone: a hub id's before its weights download)."""
    _refuse_quantized(source, family)
    _check_mlp_tensors(source, family)


def _refuse_quantized(source: Source, family: Family) -> None:
    """A quantized checkpoint's weights are not the model's weights until their scales are applied; casting
    them (and dropping the scales) would write a silently wrong model, so conversion refuses them.

    Judged by the tensors, not by the label: a model loaded from GGUF (dequantised by Transformers) and
    saved keeps `quantization_config: {quant_method: gguf}` over plain float weights, which convert as
    they are. A label over tensors that are not the model's (missing or misshapen) is refused as quantized."""
    tensors = source.tensors
    scales = next((n for n in tensors.names() if n.endswith(QUANTIZATION_TENSORS)), None)
    packed = next((n for n in tensors.names() if n.endswith(".weight") and tensors.dtype(n) not in UNQUANTIZED_DTYPES), None)
    found = f"tensor {scales}" if scales else f"{packed} in {tensors.dtype(packed)}" if packed else None
    quantization = getattr(source.config, "quantization_config", None)
    if quantization and not found:
        method = (quantization.get("quant_method") if isinstance(quantization, dict)
                  else getattr(quantization, "quant_method", None))
        try:
            _check_mlp_tensors(source, family)
        except ConversionError:
            found = f"quantization_config {method or quantization}"
        else:
            print(f"note: {source.spec}'s config.json says quantization_config {method or quantization}, and its "
                  f"weights are plain {tensors.dtype(EMBEDDING)}: converting them as they are", file=sys.stderr)
    if found:
        raise ConversionError(f"{source.spec} is a quantized checkpoint ({found}); stem-upcycle converts "
                              f"unquantized weights: give the bf16/fp16/fp32 original")


def parse_shard_size(max_shard_size: str | int) -> int:
    """Bytes of `--max-shard-size` (2GB, 500MB, or a number of bytes)."""
    try:
        max_bytes = convert_file_size_to_int(max_shard_size)
    except ValueError:
        raise ConversionError(f"--max-shard-size {max_shard_size!r} does not parse; give a size such as 2GB or "
                              f"500MB") from None
    if not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ConversionError(f"--max-shard-size {max_shard_size!r} is not a size such as 5GB or 500MB")
    return max_bytes


def check_blocks(table_format: TableFormat, widths: dict[int, int]) -> None:
    """Each table's columns (`widths`) split into the compressed format's blocks, or a one-line error."""
    if not table_format.compressed:
        return
    block, bad = table_format.block_size, [layer for layer, width in widths.items() if width % table_format.block_size]
    if bad:
        raise ConversionError(f"--table-dtype {table_format.dtype}: rows of {widths[bad[0]]} elements (layer {bad[0]}'s "
                              f"table) do not split into blocks of {block}; give a block size that divides every "
                              f"table's columns, {math.gcd(*widths.values())} (--table-block)")


def resolve_table_format(table_dtype: str, block_size: int | None, d_ff: int | None) -> TableFormat:
    try:
        return TableFormat.of(table_dtype, block_size, d_ff)
    except TableFormatError as err:
        raise ConversionError(f"--table-dtype {table_dtype}: {err}") from None


def resolve_dtype(dtype: str, source: Source) -> torch.dtype:
    if dtype == "auto":  # what the checkpoint says it is, else what its embedding is stored in
        stored = getattr(source.config, "dtype", None) or getattr(source.config, "torch_dtype", None)
        if isinstance(stored, str):
            stored = DTYPES.get(stored)
        resolved = stored if isinstance(stored, torch.dtype) else source.tensors.dtype(EMBEDDING)
        return resolved if resolved in DTYPES.values() else torch.float32
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is unknown; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def stem_config(dense, family: Family, layers: list[int], init: str, dtype: torch.dtype, has_bias: bool,
                dense_first_token: bool = True) -> StemConfig:
    """The STEM model's config: the dense config, flat, plus the STEM fields and auto_map."""
    fields = dense.to_dict()
    for key in ("model_type", "architectures", "auto_map", "quantization_config", "_name_or_path",
                "transformers_version", "torch_dtype", "dtype"):
        fields.pop(key, None)
    config = StemConfig(
        dense_model_type=dense.model_type,
        stem_layers=layers,
        stem_init=init,
        stem_activation=getattr(dense, family.activation_attr),
        stem_mlp_bias=has_bias,
        stem_dense_first_token=dense_first_token,
        **fields,
    )
    config.dtype = _dtype_name(dtype)
    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["StemForCausalLM"]
    return config


OUTPUT_SLACK = 64 * 2**20  # a converted model's bytes besides its weights: tokenizer, config, card, some slack


def check_output(out: Path, overwrite: bool, source: Source, needed_bytes: int, scratch_bytes: int = 0) -> None:
    """Refuse, before writing anything, what would lose data or cannot finish (`scratch_bytes`: what is kept on the
    disk while the output is written, the parent rows)."""
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out} is a file; give a directory for the converted model")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConversionError(f"{out} is not empty; choose an empty directory or pass --overwrite to replace it")
    if source.directory is not None and out.resolve() == source.directory.resolve():
        raise ConversionError(f"{out} is the source checkpoint itself; write the STEM model elsewhere")
    parent = existing_parent(out)
    try:  # a read-only or virtual file system (/proc, /sys) reports no free space: say what it is instead
        os.rmdir(tempfile.mkdtemp(prefix=".stem-upcycle-probe-", dir=parent))
    except OSError as err:
        raise ConversionError(f"cannot write to {parent} ({err.strerror}); choose an OUT on a writable disk") from None
    free = shutil.disk_usage(parent).free
    needed = needed_bytes + OUTPUT_SLACK
    if free < needed + scratch_bytes:
        meanwhile = f" and the parent's rows {scratch_bytes / 1e9:.2f} GB while it is written" if scratch_bytes else ""
        raise ConversionError(
            f"not enough disk space at {parent}: the output needs {needed / 1e9:.2f} GB{meanwhile}, {free / 1e9:.2f} GB "
            f"are free; free space, choose another OUT, or convert fewer layers with --layers"
        )


def output_disk_need(plan: ConversionPlan, out: Path, overwrite: bool) -> DiskNeed:
    """OUT checked as `run_conversion` will check it, and what the conversion writes there (to check with a
    download's bytes where both share a disk): the output, and the parent rows kept beside it while it is written."""
    check_output(out, overwrite, plan.source, plan.total_bytes, plan.parent_bytes)
    return DiskNeed(out, plan.total_bytes + plan.parent_bytes + OUTPUT_SLACK, "the output")


def run_conversion(plan: ConversionPlan, out: Path, overwrite: bool = False, progress: bool = True, command: str = "") -> Path:
    """Write the STEM checkpoint to OUT; nothing appears at OUT unless the whole model was written."""
    out = Path(out)
    check_output(out, overwrite, plan.source, plan.total_bytes, plan.parent_bytes)
    plan.init_options.scratch_dir = existing_parent(out)  # the parent rows, on OUT's disk, gone once written

    def write(staging: Path) -> None:
        _write_weights(plan, staging, progress)
        _write_side_files(plan, staging, command)

    return write_staged(out, write)


def _write_weights(plan: ConversionPlan, directory: Path, progress: bool) -> None:
    init = INITIALISERS[plan.init](plan.init_target, plan.init_options, progress=progress)  # calibrating inits read their data here
    widths = {layer: table_columns(plan.config, layer) for layer in plan.layers}
    write_tensors(plan.specs, plan.producers, plan.shards, plan.source.tensors, init.table_rows, plan.table_format,
                  widths, plan.chunk_rows, directory, progress, init.dense_weights)
    if init.dense_weights:  # what the fit did, for the model card and the benchmarks
        plan.config.stem_fit = fit_record(plan.init_options.fit, init.fit_reports)


def write_tensors(specs: list[TensorSpec], producers: dict, shards, tensors, table_rows, table_format: TableFormat,
                  widths: dict[int, int], chunk_rows: int, directory: Path, progress: bool,
                  replaced: dict | None = None) -> None:
    """Write `specs` in order into `shards` under `directory`: copies of `tensors` (or the tensor of the same
    name in `replaced`, a fit's gate and down projections), and tables whose rows (of `widths[layer]` columns)
    `table_rows(layer)` fills chunk by chunk (`fill(start, stop, out)`), stored in `table_format`; a group's
    (`TableGroup`) with the rows of its layers side by side."""
    total = sum(s.nbytes for s in specs)
    with stage("write", f"{total / 1e9:.2f} GB"):
        _write_in_order(specs, producers, shards, tensors, table_rows, table_format, widths, chunk_rows, directory,
                        progress, replaced, total)


def _write_in_order(specs, producers, shards, tensors, table_rows, table_format, widths, chunk_rows, directory,
                    progress, replaced, total) -> None:
    """write_tensors' work."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, desc="write", disable=not progress, file=sys.stderr)
    writer = BackgroundWriter(ShardWriter(directory, shards, on_bytes=bar.update))
    later = {}  # (layer, part) -> a compressed table's other parts, written after its values
    try:
        for spec in specs:
            producer = producers[spec.name]
            if isinstance(producer, Table) and (producer.layer, producer.part) in later:
                writer.submit(spec.name, later.pop((producer.layer, producer.part)))
            elif isinstance(producer, Table):
                later.update(_write_table(table_rows(producer.layer), spec, producer, table_format,
                                          widths[producer.layer], chunk_rows, writer))
            elif isinstance(producer, TableGroup):  # float rows only: nothing written later
                group = [widths[layer] for layer in producer.layers]
                fill = side_by_side([table_rows(layer) for layer in producer.layers], group)
                rows = max(1, chunk_rows * max(widths.values()) // sum(group))  # as many bytes as a widest table's chunk
                _write_table(fill, spec, producer, table_format, sum(group), rows, writer)
            elif replaced and spec.name in replaced:
                writer.submit(spec.name, replaced[spec.name].to(spec.dtype))
            elif isinstance(producer, Constant):
                writer.submit(spec.name, producer.tensor.to(spec.dtype))
            else:
                writer.submit(spec.name, producer.take(tensors.get(producer.source_name)).to(spec.dtype))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()


def side_by_side(fills: list, widths: list[int]):
    """One `fill(start, stop, out)` of a group's rows [rows, sum(widths)] from its layers' fills, each writing its
    layer's `widths[i]` columns (through a buffer: a fill may compute into `out` as a contiguous matrix)."""
    def fill(start: int, stop: int, out: torch.Tensor) -> None:
        column = 0
        for width, layer_fill in zip(widths, fills):
            rows = torch.empty(stop - start, width, dtype=out.dtype)
            layer_fill(start, stop, rows)
            out[:, column : column + width].copy_(rows)
            column += width
    return fill


def _write_table(fill, spec: TensorSpec, producer: Table | TableGroup, table_format: TableFormat, width: int,
                 chunk_rows: int, writer: BackgroundWriter) -> dict:
    """Compute the table chunk by chunk into recycled buffers while earlier chunks are written.

    A compressed table's values (`spec`) are written as they are encoded; its scales, 1/64 of its bytes
    or less, are gathered and returned ({(layer, part): tensor}) to be written next, since each shard
    holds its tensors one after another."""
    rows = spec.shape[0]
    free = queue.Queue()
    for _ in range(POOL_BUFFERS):
        free.put(torch.empty(chunk_rows, width, dtype=COMPUTE_DTYPE))
    others = {}
    for start in range(0, rows, chunk_rows):
        stop = min(rows, start + chunk_rows)
        buffer = free.get()
        chunk = buffer[: stop - start]
        fill(start, stop, chunk)
        if chunk.dtype == spec.dtype:
            writer.submit(spec.name, chunk, release=lambda _, b=buffer: free.put(b))
            continue
        parts = table_format.encode(chunk)
        writer.submit(spec.name, parts.pop(producer.part))
        free.put(buffer)
        for part, data in parts.items():
            others.setdefault((producer.layer, part), []).append(data)
    return {key: torch.cat(chunks) for key, chunks in others.items()}


def _write_side_files(plan: ConversionPlan, directory: Path, command: str) -> None:
    from transformers import GenerationConfig

    plan.config.save_pretrained(directory)
    for name in MODELING_FILES:
        shutil.copyfile(MODELING_DIR / name, directory / name)
    source = plan.source
    try:
        generation = GenerationConfig.from_pretrained(source.directory) if source.directory else None
    except OSError:
        generation = None
    (generation or GenerationConfig.from_model_config(source.config)).save_pretrained(directory)
    _write_tokenizer(source, directory)
    (directory / "README.md").write_text(card.model_card(plan, command))


def _write_tokenizer(source: Source, directory: Path) -> None:
    """Copy a directory's tokenizer files verbatim; a GGUF file's tokenizer is rebuilt and saved."""
    if source.directory is not None:
        found = [f for f in TOKENIZER_FILES if (source.directory / f).exists()]
        for name in found:
            shutil.copyfile(source.directory / name, directory / name)
        if not found:
            print(f"warning: {source.spec} has no tokenizer files; the output has none either", file=sys.stderr)
        return
    from .loading import load_tokenizer

    load_tokenizer(source, "the converted model's tokenizer is saved from it").save_pretrained(directory)
