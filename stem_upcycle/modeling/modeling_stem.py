"""STEM models for Hugging Face Transformers.

A STEM model is the dense family's own model (Llama, Qwen3, Gemma2, ...) in which the MLP of some
decoder layers computes ``down_proj(act(gate_proj(x)) * up_table[token_id])``: the up-projection is
replaced by a per-layer table with one row per vocabulary entry.

One mechanism serves every family: ``StemForCausalLM(config)`` builds a subclass of the dense
family's class (``StemLlamaForCausalLM``, ...) that differs in the MLPs of the STEM layers and in
where their tables are loaded. Everything else (attention, caches, logit soft-capping, weight tying, gradient
checkpointing, generation) is the family's own code.

Where the tables live (parameters, memory maps, host memory with a device row cache) is chosen at
load time, `from_pretrained(..., stem_tables=...)`; see `stem_tables.py`.

Exported next to the weights, so it imports only torch and transformers.
"""

import copy
import threading

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.generation import GenerationMixin
from transformers.models.auto import modeling_auto
import transformers

from .configuration_stem import StemConfig, table_columns, table_offsets
from .forward_ids import ForwardIds, IdHandoff, RowEdit, cached_length, check_ids, first_token_mask, first_tokens
from .stem_tables import (HANDLES, ROWS_AT_ONCE, MappedLinear, PlacedTable, custom_op, handle, open_tables,
                          rows_of_layers)
from .table_files import TABLE_TENSOR, StemTablesError
from .table_format import FLOAT_DTYPES, TableFormat

HUB_KWARGS = ("cache_dir", "local_files_only", "revision", "token", "subfolder")


class MemoryTable(nn.Embedding):
    """The `memory` placement of a table: an ordinary parameter (named `up_table.weight`), as training needs."""

    def forward(self, forward, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return super().forward(forward.on(self.weight.device)).to(device, dtype)  # [*lookup, k]


class TableGroup(nn.Embedding):
    """The `memory` placement of the tables of a group of layers (`config.stem_table_groups`): one parameter
    [vocab, the sum of its layers' columns], named as the checkpoint names it (`model.stem_table_groups.K.weight`), so that
    Transformers' and vLLM's loaders fill it by name, a device map places (or offloads) it as any module, and
    save_pretrained writes the layout the config describes. Each layer reads its columns through `GroupColumns`."""

    def forward(self, forward, columns: tuple[int, int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        # called, not read: accelerate brings an offloaded module's weight in around its forward
        weight = self.weight[:, columns[0] : columns[1]]
        return nn.functional.embedding(forward.on(weight.device), weight).to(device, dtype)  # [*lookup, k]


class GroupColumns(nn.Module):
    """A STEM MLP's `up_table` in memory when its table is stored in a group: the layer's columns of the group's
    parameter (not a parameter of its own, so that the group's is saved once, under its name)."""

    def __init__(self, group: TableGroup, columns: tuple[int, int]):
        super().__init__()
        self.__dict__["group"] = group  # not a submodule: the group's parameter belongs to the base model
        self.columns = columns

    def forward(self, forward, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self.group(forward, self.columns, device, dtype)

    @property
    def weight(self) -> torch.Tensor:
        """[vocab, k]: a view of the group's parameter (rows written to it are the group's)."""
        return self.group.weight[:, self.columns[0] : self.columns[1]]

    def extra_repr(self) -> str:
        return f"columns={self.columns} of a table group"


def fit_ridge(x: torch.Tensor, y: torch.Tensor, strength: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression y ~ x @ weight + bias for x [n, d], y [n, d_out]: (weight [d, d_out], bias [d_out]).
    Fitted on centred data, so that the ridge (`strength` times the mean eigenvalue of x^T x) acts on x alone.
    Rows of tokens no text showed: new tokens (`resize_token_embeddings`) and the calibrated inits' unseen ones."""
    x_mean, y_mean = x.mean(0), y.mean(0)
    x, y = x - x_mean, y - y_mean
    gram = x.T @ x
    gram += strength * gram.diagonal().mean() * torch.eye(len(gram), device=gram.device, dtype=gram.dtype)
    weight = torch.linalg.solve(gram, x.T @ y)  # [d, d_out]
    return weight, y_mean - x_mean @ weight


def _resized_table(table: MemoryTable, embedding: torch.Tensor, old: int, new: int) -> MemoryTable:
    """`table` [old, k] cut or grown to [new, k]. A new row is a ridge fit of the rows on the
    embedding rows of up to 8192 evenly spaced old tokens, applied to the new token's embedding."""
    resized = MemoryTable(new, table.weight.shape[1], device=table.weight.device, dtype=table.weight.dtype)
    kept = min(old, new)
    with torch.no_grad():
        resized.weight[:kept] = table.weight[:kept]
        if new > old:
            sample = torch.linspace(0, old - 1, min(old, 8192), device=embedding.device).long()
            weight, bias = fit_ridge(embedding[sample].float(), table.weight[sample].float())  # [d, k], [k]
            added = torch.addmm(bias, embedding[old:new].float(), weight)
            resized.weight[old:] = added.to(resized.weight.dtype)
    resized.weight.requires_grad_(table.weight.requires_grad)
    return resized


def _dense_at(up_proj: nn.Module, x: torch.Tensor, rows: torch.Tensor, batch: torch.Tensor,
              position: torch.Tensor) -> torch.Tensor:
    """`rows` [batch, seq, k] with up_proj(x) [batch, seq, d] at the tokens (batch, position)."""
    return rows.index_put((batch, position), up_proj(x[batch, position]).to(rows.dtype))


def _dense_first_tokens(x: torch.Tensor, rows: torch.Tensor, first: torch.Tensor, mlp: int) -> torch.Tensor:
    """`rows` [batch, seq, k] with the dense up-projection of x [batch, seq, d] at the `first` [batch, seq]
    tokens, by the `up_proj` of the StemMLP with handle `mlp` (a Linear, or W_up left in the files: MappedLinear).
    An op of its own in compiled graphs (`dense_first_tokens`): how many first tokens a forward holds is known
    only from the data, which a graph cannot branch on without a host read (and torch.cond, which could, trips
    dynamo on the context variables the `kernels` package wraps attention in)."""
    batch, position = first.to(x.device).nonzero(as_tuple=True)
    if not batch.numel():
        return rows.clone()  # a custom op returns no alias of its inputs
    return _dense_at(HANDLES[mlp].up_proj, x, rows, batch, position)


dense_first_tokens = custom_op("dense_first_tokens", _dense_first_tokens,
                               lambda x, rows, first, mlp: torch.empty_like(rows))


def _first_token_ups(ids: torch.Tensor, first: torch.Tensor, model: int, columns: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """[*ids.shape, columns]: at the `first` [batch, seq] tokens, the dense up-projection of the table columns of
    every STEM layer side by side (`ups_of_first_token`, `config.table_offsets`) of the base model with handle
    `model`; zeros elsewhere. A small compiled forward's (`ROWS_AT_ONCE`), in place of an op per layer
    (`dense_first_tokens`): each costs a decode step the op's call and the fusion it breaks, 5% of a token at
    Llama-3.2-1B's shape (benchmarks/README.md, compiled_decode.py)."""
    ups = ids.new_zeros((*ids.shape, columns), dtype=dtype)
    for batch, position in first.nonzero().tolist():
        ups[batch, position] = ups_of_first_token(HANDLES[model], int(ids[batch, position]), dtype)
    return ups


first_token_ups = custom_op("first_token_ups", _first_token_ups, lambda ids, first, model, columns, dtype:
                            ids.new_empty((*ids.shape, columns), dtype=dtype))


def ups_of_first_token(base: nn.Module, token: int, dtype: torch.dtype) -> torch.Tensor:
    """[every STEM layer's table columns]: what each STEM layer's dense up-projection of its table columns gives
    `token` as its sequence's first token, side by side in layer order (`config.table_offsets`). That token attends
    to itself alone, so its attention output is its own value vector wherever it stands, and every STEM layer gives
    it the dense up-projection: it depends on its id alone. So it is computed once per id, by a one-token forward,
    and kept with the parameters' versions, so that weights changed since (training, a load) have it computed
    again."""
    versions = tuple(0 if p.is_inference() else p._version for p in base.parameters())
    kept = base.stem_first_token_ups.get((token, dtype))
    if kept is None or kept[0] != versions:
        ups = {}  # layer -> [1, k]; a layer whose dense up-projection was taken away keeps zeros (never read)
        layers = base.config.stem_layers
        hooks = [up.register_forward_hook(lambda module, args, out, index=index: ups.__setitem__(index, out))
                 for index in layers if (up := base.layers[index].mlp.up_proj) is not None]
        device = base.get_input_embeddings().weight.device
        try:
            with torch.no_grad():
                base(input_ids=torch.tensor([[token]], device=device), use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        kept = base.stem_first_token_ups[token, dtype] = (versions, torch.cat([
            ups[i][0].to(device, dtype) if i in ups
            else torch.zeros(table_columns(base.config, i), dtype=dtype, device=device) for i in layers]))
    return kept[1]


class StemMLP(nn.Module):
    """Gated MLP whose up-projection is a lookup: down(act(gate(x)) * up_table[ids]).

    The one STEM MLP of inference, training and layer scoring; what differs is `up_table`, the
    source of the rows: a `MemoryTable`, a `PlacedTable` (rows read from the checkpoint files or host memory),
    the trainer's offloaded table, or calibrated rows. Each is called as
    `up_table(forward_ids, device, dtype) -> [*lookup, k]`, the rows of the forward's lookup ids:
    its input ids, or those and a run-time edit's target ids (`ForwardIds.edited` puts them in place).

    With `up_proj` (`config.stem_dense_first_token`), each sequence's first token keeps the dense
    up-projection up_proj(x). That token attends to itself alone: its hidden states depend on its id
    and nothing else, and the dense model makes it its attention sink, which every later token reads.
    A row, an average over the contexts a token is seen in, is wrong there and the error reaches the
    whole sequence (SmolLM2-135M, 10 layers converted: 2.96x the parent's perplexity on a novel with
    rows at the first token, 2.21x with the dense up-projection; 2 of 53 facts against 11). It costs
    one [k, d] matrix per STEM layer and one row of it per sequence, at the prefill only.

    With `up_rest` (`config.stem_table_columns`), only the first k of the layer's intermediate neurons are table
    columns (the conversion ordered them so: an FFN does not depend on the order of its neurons) and the others
    keep their dense up-projection: up = cat(up_table[ids] [.., k], up_rest(x) [.., d_ff - k]). Gate and down
    keep their size; the table and `up_proj` hold k columns. A whole-layer STEM MLP is the case k = d_ff.
    """

    def __init__(self, gate_proj: nn.Module, down_proj: nn.Module, act_fn, up_table, token_ids: IdHandoff,
                 layer: int | None = None, up_proj: nn.Module | None = None, up_rest: nn.Module | None = None,
                 neuron_order: torch.Tensor | None = None):
        super().__init__()
        self.gate_proj, self.down_proj, self.act_fn = gate_proj, down_proj, act_fn
        self.up_table = up_table
        self.token_ids = token_ids
        self.layer = layer  # the decoder layer's index, which run-time edits name
        self.up_proj = up_proj  # the table columns' dense up-projection, for first tokens only (None: rows there too)
        self.up_rest = up_rest  # the dense up-projection of the neurons that are no table columns (None: none are)
        if neuron_order is not None:  # the parent's index of each intermediate neuron (table columns first): saved
            self.register_buffer("neuron_order", neuron_order)  # with the weights, for a hand-off from the parent
        handle(self, "mlp")

    def __setstate__(self, state):  # a copy (deepcopy, pickle) is an MLP of its own for `dense_first_tokens`
        super().__setstate__(state)
        handle(self, "mlp")

    @classmethod
    def from_config(cls, config: StemConfig, up_table, token_ids: IdHandoff, layer: int) -> "StemMLP":
        bias, d, d_ff = config.stem_mlp_bias, config.hidden_size, config.intermediate_size
        k = table_columns(config, layer)
        gate = nn.Linear(d, d_ff, bias=bias)
        down = nn.Linear(d_ff, d, bias=bias)
        up = nn.Linear(d, k, bias=bias) if config.stem_dense_first_token else None
        rest = nn.Linear(d, d_ff - k, bias=bias) if k < d_ff else None
        order = torch.arange(d_ff) if k < d_ff else None  # the checkpoint's, as it loads
        return cls(gate, down, ACT2FN[config.stem_activation], up_table, token_ids, layer, up, rest, order)

    def up(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.table_up(x)  # [batch, seq, k]
        if self.up_rest is None:
            return rows
        return torch.cat([rows, self.up_rest(x).to(rows.dtype)], -1)  # [batch, seq, d_ff]: the table's columns first

    def table_up(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, seq, k]: the table columns' up-projection, the rows of the forward's ids."""
        forward = self.token_ids.current(x)
        rows = forward.edited(self.up_table(forward, x.device, x.dtype), self.layer)  # [batch, seq, k]
        # The first tokens' rows give way to their dense up-projection (an edit's too: a first
        # token reads no row, so a persistent edit of the rows could not reach it either).
        if self.up_proj is not None and forward.first_ups is not None:  # compiled, small: every layer's at the start
            return torch.where(forward.first_mask[..., None].to(rows.device), forward.first_ups[self.layer].to(rows),
                               rows)
        if self.up_proj is not None and forward.first_mask is not None:  # compiled: an op the graph calls
            return dense_first_tokens(x, rows, forward.first_mask, self.stem_handle)
        if self.up_proj is not None and forward.first is not None:
            rows = _dense_at(self.up_proj, x, rows, *(t.to(x.device) for t in forward.first))
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up(x))  # [batch, seq, d]


def _start_forward(module, args, kwargs):
    """Forward pre-hook of the base model: check the ids, hand them to the STEM MLPs, let the
    placement prepare the rows this forward needs."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        raise ValueError(
            "STEM layers look up table rows by token id: pass input_ids (inputs_embeds alone "
            "cannot be used with a STEM model)"
        )
    if torch.compiler.is_compiling():
        _start_compiled_forward(module, ids, kwargs)
        return
    check_ids(ids, module.config.vocab_size)
    past = cached_length(kwargs)
    edit = module.stem_token_ids.edit  # this thread's run-time knowledge edit, if one is set
    first = first_tokens(ids, kwargs, past) if module.config.stem_dense_first_token else None
    forward = module.stem_token_ids.start(ids, edit.for_forward(ids, past) if edit else None, first)
    if module.stem_tables_placement is not None:
        module.stem_tables_placement.begin(forward)


def _start_compiled_forward(module, ids: torch.Tensor, kwargs: dict) -> None:
    """What `_start_forward` does, in a form torch.compile traces whole (fullgraph): the ids and a mask of the
    first tokens handed over as tensors; tables in memory are gathered inside the graph, placed ones read by an
    op (`placed_rows`). Not done here: the id range check (eager forwards make it) and run-time edits."""
    placement = module.stem_tables_placement
    if placement is not None and not placement.compiles:
        raise RuntimeError(f"a compiled STEM model reads its rows inside the graph: from tables in memory, or by an "
                           f"op that reads them from the checkpoint's files (mmap); stem_tables={placement.name!r} "
                           f"stages rows around each forward: load with stem_tables='memory' or 'mmap' to compile, "
                           f"or run eagerly")
    if module.stem_token_ids.edit is not None:
        raise RuntimeError("a run-time row edit (set_stem_row_edit) applies to eager forwards only: clear it with "
                           "set_stem_row_edit(None) to run compiled, or run eagerly")
    first = first_token_mask(ids, kwargs) if module.config.stem_dense_first_token else None
    forward = module.stem_token_ids.compiled = ForwardIds(ids, first_mask=first)
    # A small forward's (a decode step's) rows and first tokens' up-projections of every layer, an op each at its
    # start; only where the graph's sizes are fixed (a guard on a dynamic size would specialise it: vLLM marks the
    # token count dynamic), and the up-projections without gradients (the op gives their weights none).
    if not (isinstance(ids.numel(), int) and ids.numel() <= ROWS_AT_ONCE):
        return
    offsets = module.stem_table_offsets  # each layer's columns among every layer's, side by side
    columns = module.stem_table_width
    dtype = module.get_input_embeddings().weight.dtype
    if placement is not None and sorted(placement.stored) == sorted(offsets):
        rows = rows_of_layers(ids, placement.stem_handle, columns, dtype)  # [*ids.shape, columns]
        forward.plan = {layer: rows[..., start:stop] for layer, (start, stop) in offsets.items()}
    if first is not None and not torch.is_grad_enabled():
        ups = first_token_ups(ids, first, module.stem_handle, columns, dtype)  # [*ids.shape, columns]
        forward.first_ups = {layer: ups[..., start:stop] for layer, (start, stop) in offsets.items()}


def _end_forward(module, args, kwargs, output):
    if torch.compiler.is_compiling():
        module.stem_token_ids.compiled = None  # no later forward may read these ids
        return
    if module.stem_tables_placement is not None:
        module.stem_tables_placement.end(module.stem_token_ids.current_of_thread())


# The placement a `from_pretrained` in this thread is loading tables for, read by `post_init`; unset
# outside `from_pretrained` (a model built from its config alone).
_loading = threading.local()


def placement_of_config(config):
    """The placement of a model built from its config alone (`from_config`, as vLLM builds models): None
    (tables in memory, as parameters), unless `config.stem_tables` asks for mmap or host; then the tables
    are read from the checkpoint the config was loaded from (`config._name_or_path`: a local folder, or a hub id
    whose files are fetched as `from_pretrained` fetches them), as `from_pretrained` would; compressed tables in
    `memory` are held as read. With vLLM: `hf_overrides={"stem_tables": "mmap"}`."""
    if config.stem_tables in (None, "auto", "memory") and TableFormat.from_config(config) is None:
        return None  # parameters, as any model built from its config has (a loader fills them by name)
    source = config._name_or_path or ""
    try:
        return open_tables(source, config, {})
    except StemTablesError:
        raise
    except (OSError, ValueError) as err:  # no such folder, nor a hub id whose files could be fetched
        raise StemTablesError(f"a model built from its config reads its tables from the checkpoint the config came "
                              f"from, and {source!r} is neither a local folder nor a hub id whose files can be "
                              f"fetched ({type(err).__name__}); load the config from the checkpoint's folder or id") from None


def _with_pattern(patterns, pattern: str):
    """Transformers' `_keys_to_ignore_on_load_*` (a set in recent versions, a list or None before) and `pattern`."""
    return patterns | {pattern} if isinstance(patterns, set) else [*(patterns or []), pattern]


class _StemDispatch:
    """Turns ``StemX(config)`` into an instance of a STEM subclass of the dense family's class.

    Subclasses set ``_dense_mapping``: the Transformers table from model_type to class name.
    """

    _dense_mapping: dict = {}
    _family_classes: dict = {}

    @classmethod
    def family_class(cls, dense_model_type: str) -> type:
        """The STEM subclass of the dense family's class, created once per family."""
        if not cls._is_dispatcher():
            return cls
        key = (cls.__name__, dense_model_type)
        if key not in _StemDispatch._family_classes:
            if dense_model_type not in cls._dense_mapping:
                raise ValueError(f"no {cls.__name__} for dense model type {dense_model_type!r}")
            dense_cls = getattr(transformers, cls._dense_mapping[dense_model_type])
            name = "Stem" + dense_cls.__name__
            family_cls = type(name, (cls, dense_cls), {"__module__": __name__, "config_class": StemConfig})
            globals()[name] = family_cls  # importable by name, so that instances pickle
            _StemDispatch._family_classes[key] = family_cls
        return _StemDispatch._family_classes[key]

    @classmethod
    def _is_dispatcher(cls) -> bool:
        return "_dense_mapping" in cls.__dict__

    def __new__(cls, config=None, *args, **kwargs):
        if config is not None and cls._is_dispatcher():
            cls = cls.family_class(config.dense_model_type)
        return super().__new__(cls)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, **kwargs):
        # Difference from the dense family: `stem_tables` (and `stem_cache_rows`) choose where the
        # tables live; the placement opens (and checks) the table files before the dense weights load.
        hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
        # Recognised by its model_type, not its class: through remote code, Transformers imports the
        # configuration and the modeling file as two dynamic modules (each under its own hash), so the
        # config that AutoModel passes (holding the `stem_tables=` it took from the kwargs) is an
        # instance of another StemConfig class than this module's.
        given = config if getattr(config, "model_type", None) == StemConfig.model_type else None
        config = copy.deepcopy(given) if given is not None else StemConfig.from_pretrained(
            pretrained_model_name_or_path, **hub_kwargs)
        for key in ("stem_tables", "stem_cache_rows"):
            if key in kwargs:
                setattr(config, key, kwargs.pop(key))
        cls = cls.family_class(config.dense_model_type)
        _loading.placement = open_tables(pretrained_model_name_or_path, config, hub_kwargs)
        try:
            return super(_StemDispatch, cls).from_pretrained(pretrained_model_name_or_path, *args, config=config,
                                                             **kwargs)
        finally:
            del _loading.placement

    @classmethod
    def _from_config(cls, config, **kwargs):
        return super(_StemDispatch, cls.family_class(config.dense_model_type))._from_config(config, **kwargs)

    def post_init(self):
        # Difference from the dense family: before the usual post-init (weight init, tying), the
        # MLPs of the STEM layers are replaced and the id hooks are installed on the base model.
        base = self.base_model
        base.stem_token_ids = IdHandoff()
        base.stem_first_token_ups = {}  # (token, dtype) -> (parameters' versions, its ups: `ups_of_first_token`)
        # each STEM layer's columns among every layer's side by side, and their sum (a compiled small forward's
        # layout of every layer's rows and first-token up-projections: `rows_of_layers`, `first_token_ups`)
        base.stem_table_offsets = table_offsets(self.config)
        base.stem_table_width = sum(stop - start for start, stop in base.stem_table_offsets.values())
        handle(base, "model")
        loading = hasattr(_loading, "placement")
        placement = base.stem_tables_placement = _loading.placement if loading else placement_of_config(self.config)
        columns = {}  # layer -> (its group, its columns of the group's rows)
        if placement is None and self.config.stem_table_groups:  # memory: the groups' parameters, named as stored
            widths = [[table_columns(self.config, layer) for layer in group] for group in self.config.stem_table_groups]
            base.stem_table_groups = nn.ModuleList(
                [TableGroup(self.config.vocab_size, sum(group)) for group in widths])
            columns = {layer: (base.stem_table_groups[k], (sum(widths[k][:i]), sum(widths[k][: i + 1])))
                       for k, group in enumerate(self.config.stem_table_groups) for i, layer in enumerate(group)}
        for index in self.config.stem_layers:
            if placement is None:
                table = (GroupColumns(*columns[index]) if index in columns
                         else MemoryTable(self.config.vocab_size, table_columns(self.config, index)))
            else:
                table = PlacedTable(placement, index)
            base.layers[index].mlp = StemMLP.from_config(self.config, table, base.stem_token_ids, index)
            if index in getattr(placement, "first_token_up", {}):  # mmap: left in the files with the tables
                base.layers[index].mlp.up_proj = MappedLinear(*placement.first_token_up[index], placement.mappings)
        if placement is not None:
            placement.mlps = {i: base.layers[i].mlp for i in self.config.stem_layers}
        if base is not self:  # a StemModel starts its forwards in its own `forward`
            base.register_forward_pre_hook(_start_forward, with_kwargs=True)
            base.register_forward_hook(_end_forward, with_kwargs=True)
        super().post_init()
        if placement is not None:  # the tables in the checkpoint are not this model's parameters
            table = TABLE_TENSOR
            if getattr(placement, "first_token_up", None):  # and nor are the up-projections left in the files;
                # vLLM skips the keys these patterns match (Transformers only keeps quiet about them), so no
                # dense layer's up_proj may match
                table += rf"|layers\.({'|'.join(map(str, placement.first_token_up))})\.mlp\.up_proj\.(weight|bias)"
            self._keys_to_ignore_on_load_unexpected = _with_pattern(self._keys_to_ignore_on_load_unexpected, table)

    @property
    def stem_placement(self):
        """The object holding the tables when they live outside the model (None: `memory`)."""
        return self.base_model.stem_tables_placement

    @property
    def stem_tables(self) -> str:
        """Where the tables live: "memory", "mmap" or "host"."""
        return "memory" if self.stem_placement is None else self.stem_placement.name

    @property
    def stem_row_edit(self) -> RowEdit | None:
        """The run-time edit of the calling thread's forwards, if any."""
        return self.base_model.stem_token_ids.edit

    def set_stem_row_edit(self, edit: RowEdit | None) -> None:
        """Edit the rows that this thread's forwards look up (a run-time knowledge edit; None: none).
        The weights stay as they are; see `RowEdit`."""
        for layer in (edit.layers or ()) if edit is not None else ():
            self._table_of(layer)  # a clear error for a layer that is not a STEM layer
        self.base_model.stem_token_ids.edit = edit

    def stem_table_rows(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """[n, k] rows of `ids` [n] in the table of STEM layer `layer`, wherever it is placed: as
        stored (float tables), or decoded to float32 (compressed ones)."""
        return self._table_of(layer).read_rows(layer, ids.cpu())

    def stem_table_format(self, layer: int) -> TableFormat:
        """How the table of STEM layer `layer` stores its rows."""
        table = self._table_of(layer)
        if isinstance(table, _MemoryRows):  # parameters: float rows in the parameter's dtype
            dtype = self.base_model.layers[layer].mlp.up_table.weight.dtype
            return TableFormat(next((n for n, d in FLOAT_DTYPES.items() if d == dtype), "float32"))
        return table.stored[layer].format

    def stem_table_parts(self, layer: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored rows of `ids` [n] in the table of STEM layer `layer`, per part (`weight`; or
        `qweight` and `scales` for a compressed table): what `set_stem_table_parts` puts back exactly."""
        return self._table_of(layer).read_parts(layer, ids.cpu())

    def set_stem_table_parts(self, layer: int, ids: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Make `parts` (as `stem_table_parts` gives them) the stored rows of `ids` [n]: a compressed row
        moves with its scales, unchanged."""
        self._table_of(layer).set_parts(layer, ids.cpu(), parts)

    def set_stem_table_rows(self, layer: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Make `rows` [n, k] the rows of `ids` [n] in the table of STEM layer `layer` (a persistent
        knowledge edit of the loaded model): a parameter's rows are written; placed tables keep them
        in memory over their files (mmap) or write host memory and drop the rows from the device
        cache (host), so that no read serves the old rows."""
        self._table_of(layer).set_rows(layer, ids.cpu(), rows)

    def _table_of(self, layer: int):
        if layer not in self.config.stem_layers:
            raise StemTablesError(f"layer {layer} is not a STEM layer; this model's are {self.config.stem_layers}")
        return self.stem_placement or _MemoryRows(self.base_model.layers)

    def resize_token_embeddings(self, *args, **kwargs):
        # Difference from the dense family: the tables grow (or shrink) with the embedding, so that
        # added tokens (chat, domain) have rows. A new token's row comes, as for tokens the converter's
        # calibration never saw, from a ridge fit of the table's rows on the embedding's.
        if self.stem_placement is not None:  # checked first: nothing is resized then
            raise StemTablesError(f"resizing the vocabulary rewrites the tables, and these are placed with "
                                  f"stem_tables={self.stem_tables!r}; {self.stem_placement.parameters_advice()}")
        old = self.get_input_embeddings().weight.shape[0]
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        new = embeddings.weight.shape[0]
        if new != old:
            for index in self.config.stem_layers:
                mlp = self.base_model.layers[index].mlp
                mlp.up_table = _resized_table(mlp.up_table, embeddings.weight.detach(), old, new)
            if self.config.stem_table_groups:  # now a parameter per table, saved so
                del self.base_model.stem_table_groups
                self.config.stem_table_groups = None
        return embeddings

    def save_pretrained(self, *args, **kwargs):
        # Difference from the dense family: placed tables are no parameters, so they would be left out.
        if self.stem_placement is not None:
            raise StemTablesError(f"this model's tables are placed with stem_tables={self.stem_tables!r} and are not "
                                  f"in its state dict; copy its files, or {self.stem_placement.parameters_advice()} "
                                  f"to save it")
        return super().save_pretrained(*args, **kwargs)


class _MemoryRows:
    """Row access to tables placed in memory (parameters), as placed tables offer it."""

    def __init__(self, layers):
        self.layers = layers

    def read_rows(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        weight = self.layers[layer].mlp.up_table.weight
        return weight.detach()[ids.to(weight.device)]

    @torch.no_grad()
    def set_rows(self, layer: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        weight = self.layers[layer].mlp.up_table.weight
        weight[ids.to(weight.device)] = rows.to(weight.device, weight.dtype)

    def read_parts(self, layer: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": self.read_rows(layer, ids).cpu()}

    def set_parts(self, layer: int, ids: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        self.set_rows(layer, ids, parts["weight"])


class StemPreTrainedModel(_StemDispatch, PreTrainedModel):
    config_class = StemConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True


class StemModel(StemPreTrainedModel):
    """The STEM decoder without LM head (a subclass of the dense family's base model)."""

    _dense_mapping = modeling_auto.MODEL_MAPPING_NAMES

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, **kwargs):
        # Difference from the dense family: the forward hands its ids to the STEM MLPs. Here rather
        # than in forward hooks (as for the base model inside StemForCausalLM): vLLM, which serves a
        # Transformers model through its base model, calls `forward` directly, past nn.Module's hooks
        # (and reads the names of its arguments).
        kwargs.update(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      inputs_embeds=inputs_embeds)
        if past_key_values is not None:  # handed on only when given: Transformers 5.25 names it `cache` (in kwargs)
            kwargs["past_key_values"] = past_key_values  # and warns of the old name, even as None
        _start_forward(self, (), kwargs)
        output = super().forward(**kwargs)
        _end_forward(self, (), kwargs, output)
        return output


class StemForCausalLM(StemPreTrainedModel, GenerationMixin):
    """The STEM causal LM (a subclass of the dense family's ...ForCausalLM)."""

    _dense_mapping = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def __getattr__(name: str):
    """The class of one family (`StemLlamaForCausalLM`, ...) by name, built on first use: a model saved by
    `save_pretrained` names its own class in the saved config's auto_map, and a process loading that folder (or
    unpickling a model) has not built it yet."""
    for dispatcher in (StemModel, StemForCausalLM):
        for dense_model_type, dense_name in dispatcher._dense_mapping.items():
            if isinstance(dense_name, str) and name == "Stem" + dense_name:  # a few map to tuples of classes
                return dispatcher.family_class(dense_model_type)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["StemPreTrainedModel", "StemModel", "StemForCausalLM", "StemMLP", "StemTablesError"]
