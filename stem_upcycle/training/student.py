"""The model being trained: a STEM checkpoint whose STEM MLPs read offloaded tables.

Each `StemMLP` is swapped for a `TrainingStemMLP` that shares its gate and down projections (so
parameter names are unchanged) and looks its up rows up in an `OffloadedTable` instead of an
`nn.Embedding`. During a hand-off it blends in the teacher's dense up-projection:

    up = (1 - a) * W_up x + a * U[ids]      a = 0: exactly the dense MLP; a = 1: the STEM MLP

What trains is chosen by name, in one declarative table (`PARTS`); LoRA adapters come from peft.
"""

import re
from functools import partial

import torch
import torch.nn.functional as F

from ..families import family_for
from ..table_init.closed_form import mlp_projections
from ..modeling.configuration_stem import table_columns
from ..modeling.modeling_stem import StemMLP
from ..modeling.stem_tables import MappedLinear
from .recipe import RecipeError
from .tables import OffloadedTable, SharedTables

# Which dense parameters each trainable part names (regular expressions on parameter names).
PARTS = {
    "gate_down": None,  # the gate and down projections of the STEM layers, and their up_rest (set per model below)
    "mlp": r"\.mlp\.",
    "norms": r"norm",
    "attention": r"\.self_attn\.",
    "embeddings": r"embed_tokens|lm_head",
}


class TrainingStemMLP(StemMLP):
    """The STEM MLP with its rows from an `OffloadedTable` and, during a hand-off, blended with the
    dense up-projection of the table columns."""

    def __init__(self, mlp: StemMLP, table: OffloadedTable):
        # The converted MLP's own gate, down and up_rest projections (and neuron order); the table is not a module:
        # kept out of parameters, state dicts, DDP and FSDP.
        super().__init__(mlp.gate_proj, mlp.down_proj, mlp.act_fn, table, mlp.token_ids, mlp.layer, mlp.up_proj,
                         mlp.up_rest, getattr(mlp, "neuron_order", None))
        # The frozen dense up-projection of the table columns (weight [k, d], bias), only during a hand-off: rows of
        # the teacher's own tensors and, like the table, no parameter of this model.
        self.dense_up: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.blend = 1.0

    def table_up(self, x: torch.Tensor) -> torch.Tensor:
        up = super().table_up(x)  # [batch, seq, k]
        if self.blend < 1.0:
            up = (1.0 - self.blend) * F.linear(x, *self.dense_up) + self.blend * up
        return up


def base_model(model):
    return getattr(model, model.base_model_prefix)


def attach_tables(model, device: torch.device, shared: SharedTables | None = None) -> dict[int, OffloadedTable]:
    """Swap the STEM MLPs for training ones. Without `shared`, the tables' storage moves out of the
    model uncopied; with it, each table is copied (in fp32) into the machine's shared copy, from the
    model's memory or from the checkpoint files it was loaded with (`stem_tables="mmap"`)."""
    tables = {}
    base = base_model(model)
    placed = getattr(base, "stem_tables_placement", None)  # tables left in the checkpoint's files (mmap)
    for index in getattr(model.config, "stem_layers", []):  # none in a dense baseline
        mlp = base.layers[index].mlp
        shape = (model.config.vocab_size, table_columns(model.config, index))
        if shared is None:
            tables[index] = OffloadedTable(mlp.up_table.weight.data, device)
        else:
            # Read from the files by positioned reads: a mapping would add the checkpoint's pages to RSS.
            read = (partial(placed.read_range, index) if placed is not None
                    else lambda start, stop, w=mlp.up_table.weight.data: w[start:stop])
            weight = shared.tensor(f"table.{index}", shape, torch.float32,
                                   fill=lambda start, stop, read=read: read(start, stop).float())
            tables[index] = OffloadedTable(weight, device, owner=(shared.local_rank, shared.local_world))
        if isinstance(mlp.up_proj, MappedLinear):  # left in the files by mmap: trained and exported, so in memory
            mlp.up_proj = mlp.up_proj.to_linear(mlp.gate_proj.weight.dtype).to(mlp.gate_proj.weight.device)
        base.layers[index].mlp = TrainingStemMLP(mlp, tables[index])
    if placed is not None:
        base.stem_tables_placement = None  # lookups go to the training tables now, not to the checkpoint
    return tables


def stem_mlps(model) -> list[TrainingStemMLP]:
    return [m for m in model.modules() if isinstance(m, TrainingStemMLP)]


def set_handoff(model, dense=None) -> None:
    """Start a blended hand-off at a = 0 with the up-projections of `dense` (the teacher, a dense model
    of the same family) of each STEM layer's table columns (its rows of `neuron_order`, where a layer's table holds
    some of its neurons only); None ends it, dropping them."""
    if dense is None:
        for mlp in stem_mlps(model):
            mlp.dense_up, mlp.blend = None, 1.0
        return
    weights = dense.state_dict(keep_vars=True)  # checkpoint names, no copies
    family = family_for(dense.config.model_type)
    layers = base_model(model).layers
    for index in model.config.stem_layers:
        mlp = layers[index].mlp
        w = mlp_projections(weights, family, index)
        table = getattr(mlp, "neuron_order", None)  # the parent's index of each neuron, table columns first
        up, bias = w["up"].detach(), None if w["up_bias"] is None else w["up_bias"].detach()
        if table is not None:
            table = table[: table_columns(model.config, index)].to(up.device)
            up, bias = up[table], None if bias is None else bias[table]
        mlp.dense_up, mlp.blend = (up, bias), 0.0


def set_blend(model, blend: float) -> None:
    for mlp in stem_mlps(model):
        mlp.blend = blend


def select_trainable(model, parts: list[str], lora=None):
    """Freeze everything, then unfreeze the named parts; with `lora` in parts, add peft adapters.

    Returns the model to train (a peft model when LoRA is used)."""
    if "lora" in parts:
        from peft import LoraConfig, get_peft_model

        if lora.r > model.config.hidden_size:  # an adapter's rank is bounded by the matrices it adapts
            raise RecipeError(f"lora.r {lora.r} is above the model's hidden size {model.config.hidden_size}, where a "
                              f"rank stops adding anything; give at most {model.config.hidden_size}")
        config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.target_modules), bias="none")
        model = get_peft_model(model, config)  # freezes the base weights; adapters train
    else:
        model.requires_grad_(False)
    for name, param in model.named_parameters():
        if is_trainable(name, parts, _stem_layers(model)) and "lora_" not in name:
            param.requires_grad_(True)
    return model


def is_trainable(name: str, parts: list[str], stem_layers: list[int]) -> bool:
    """Whether the dense parameter NAME is among the trainable PARTS (the tables and LoRA adapters aside)."""
    stem = "|".join(rf"\.layers\.{i}\.mlp\.(gate_proj|down_proj|up_rest)\." for i in stem_layers)
    patterns = [stem if part == "gate_down" else PARTS[part] for part in parts if part not in ("tables", "lora")]
    return any(re.search(p, name) for p in patterns if p)  # gate_down names nothing without STEM layers


def _stem_layers(model) -> list[int]:
    return list(getattr(model.config, "stem_layers", []))


def unwrap_lora(model):
    """The plain model with LoRA adapters merged into their base weights (a no-op without LoRA)."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
