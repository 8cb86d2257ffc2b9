"""STEM models served natively by vLLM: vLLM's own model of the dense family, with a STEM MLP in place of its
MLP in each converted layer.

Registered by `vllm_plugin.py`: with stem-upcycle installed beside vLLM, `LLM(model=FOLDER)` builds this model for
a config whose architecture is `StemForCausalLM`; `model_impl="transformers"` still serves the folder through
vLLM's Transformers backend with the modeling code exported next to the weights, as where stem-upcycle is not
installed.

One mechanism serves every family, as `modeling_stem.py` does for Transformers: `StemForCausalLM(...)` builds a
subclass of the vLLM class of the dense family (`StemLlamaForCausalLM`, ...) that differs in the MLPs of the
STEM layers, in how they learn the batch's token ids and positions, and in loading the STEM tensors. Attention,
KV cache, norms, logits and weight names of the dense parts are vLLM's own. A family vLLM runs only through its
Transformers backend is served that way.

Inside vLLM's torch.compile graph: forward pre-hooks of the embedding and of each STEM decoder layer hand the
token ids and positions to the STEM MLPs (traced, so they are tensors of the graph); tables in memory (vLLM's, or
pinned host memory read in place: `host`) are gathered in the graph; tables read from the files (mmap, or
compressed and held as stored) are read by the `placed_rows` op of `modeling/stem_tables.py`; each sequence's
first token (position 0) keeps the dense up-projection through the op below, which computes it for those tokens
alone.
"""

import torch
from torch import nn
from transformers.models.auto import modeling_auto
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.utils import maybe_prefix
from vllm.model_executor.utils import set_weight_attrs
from vllm.platforms import current_platform
from vllm.utils.platform_utils import is_uva_available
from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

from .modeling.configuration_stem import table_columns
from .modeling.modeling_stem import placement_of_config
from .modeling.stem_tables import HANDLES, custom_op, handle, placed_rows
from .modeling.table_files import StemTablesError, is_table_tensor
from .modeling.table_format import TableFormat

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, which vLLM configures and prints


class BatchIds:
    """The token ids and positions [n] of the running batch, set by hooks as the model's forward runs (a plain
    object, so that inside a compiled forward the attributes hold the graph's tensors)."""

    ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def _first_token_up(x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, mlp: int) -> torch.Tensor:
    """`rows` [n, k / tp] with the dense up-projection of x [n, d] at the tokens at position 0, by the `up_proj`
    of the StemMLP with handle `mlp` (a module, not its weight: vLLM may repack a layer's weight for its kernels).
    An op: how many such tokens a batch holds is known only from the data."""
    (first,) = (positions == 0).nonzero(as_tuple=True)
    if not first.numel():
        return rows.clone()  # a custom op returns no alias of its inputs
    up, _ = HANDLES[mlp].up_proj(x[first])
    return rows.index_put((first,), up.to(rows.dtype))


first_token_up = custom_op("vllm_first_token_up", _first_token_up,
                           lambda x, rows, positions, mlp: torch.empty_like(rows))


def _columns(width: int) -> slice:
    """This tensor-parallel rank's share of `width` columns (of a table: its share of the table columns' gate
    outputs, which the rows meet; `rank_order`)."""
    size = width // get_tensor_model_parallel_world_size()
    rank = get_tensor_model_parallel_rank()
    return slice(rank * size, (rank + 1) * size)


def rank_order(d_ff: int, k: int) -> torch.Tensor | None:
    """The order of a STEM MLP's d_ff neurons (k table columns first, `config.stem_table_columns`) that gives each
    tensor-parallel rank, as the gate's output columns and the down-projection's input columns are split, its share
    of the table columns and then its share of the others (`up_rest`'s outputs): each rank holds a share of both,
    and its up-projection is cat(its table columns' rows, its up_rest outputs). None for whole layers (k = d_ff),
    and for one rank: the checkpoint's order."""
    tp = get_tensor_model_parallel_world_size()
    if k == d_ff or tp == 1:
        return None
    if k % tp or (d_ff - k) % tp:
        raise StemTablesError(f"a STEM layer with {k} table columns of {d_ff} neurons does not split over "
                              f"{tp} tensor-parallel ranks; serve it with a tensor-parallel size dividing both "
                              f"{k} and {d_ff - k}")
    table, rest = torch.arange(k).chunk(tp), torch.arange(k, d_ff).chunk(tp)
    return torch.cat([part for pair in zip(table, rest) for part in pair])


def _reordered(param: nn.Parameter, order: torch.Tensor | None, axis: int) -> None:
    """Make `param`'s weight loader take the checkpoint's tensor in `order` along `axis` (`rank_order`)."""
    if order is not None:
        load = param.weight_loader
        param.weight_loader = lambda param, loaded, *args: load(param, loaded.index_select(axis, order.to(loaded.device)),
                                                                *args)


class TableColumns(nn.Module):
    """A table in memory, or the tables of a group of layers side by side: [vocab, sum of k / tp], each layer's
    share of its own k columns (stored [vocab, sum of k]: `mlp.up_table.weight`, or `model.stem_table_groups.K.weight`;
    k: `config.table_columns`). Gathered inside the graph.

    In vLLM's memory (RAM or VRAM) by default, a parameter its loader fills by name. With `host` (stem_tables
    "host"), in host memory, pinned where an accelerator can read it in place (UVA, as vLLM's Engram reads its
    tables): the graph gathers a batch's rows from there over the bus, with no copy staged around the forward, so
    that CUDA graphs replay it; the tables cost no device memory. On a CPU the host tensor is the table itself."""

    def __init__(self, vocab: int, widths: list[int], host: bool = False):
        super().__init__()
        self.widths, self.host = widths, host  # each layer's table columns, stored
        tp = get_tensor_model_parallel_world_size()
        self.starts = [sum(w // tp for w in widths[:i]) for i in range(len(widths) + 1)]  # this rank's, per layer
        width = self.starts[-1]
        if host:
            on_cpu = current_platform.is_cpu()
            if not on_cpu and not is_uva_available():
                raise StemTablesError("stem_tables='host' has the accelerator read the tables in place from pinned "
                                      "host memory (UVA), which this platform does not offer: serve with "
                                      "stem_tables 'memory' or 'mmap'")
            self.host_rows = torch.empty(vocab, width, device="cpu", pin_memory=not on_cpu)
            self.__dict__["weight"] = self.host_rows if on_cpu else get_accelerator_view_from_cpu_tensor(self.host_rows)
        else:
            self.weight = nn.Parameter(torch.empty(vocab, width), requires_grad=False)
            set_weight_attrs(self.weight, {"weight_loader": self.load})

    def load(self, param: nn.Parameter | None, stored: torch.Tensor) -> None:
        """This rank's columns of each layer's table in `stored`."""
        target = self.host_rows if self.host else param.data
        per_layer = stored.split(self.widths, 1)  # [vocab, k] each
        target.copy_(torch.cat([table[:, _columns(table.shape[1])] for table in per_layer], 1))

    def rows(self, ids: torch.Tensor, index: int) -> torch.Tensor:  # [n] -> [n, k / tp]
        return nn.functional.embedding(ids, self.weight[:, self.starts[index] : self.starts[index + 1]])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # a table of its own
        return self.rows(ids, 0)


class GroupColumns(nn.Module):
    """A layer's table when it is stored in a group: its columns of the group's `TableColumns`."""

    def __init__(self, group: TableColumns, index: int):
        super().__init__()
        self.__dict__["group"] = group  # not a submodule: the group belongs to the model, named as stored
        self.index = index

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.group.rows(ids, self.index)


class PlacedRows(nn.Module):
    """A table read from the checkpoint's files as the batch needs its rows (mmap; compressed tables held as
    stored and decoded row by row): the placement of `modeling/stem_tables.py`, through its op."""

    def __init__(self, placement, layer: int, dtype: torch.dtype):
        super().__init__()
        self.placement, self.layer, self.dtype = placement, layer, dtype
        self.columns = placement.stored[layer].shape[1]  # k
        handle(placement, "placement")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, k / tp]
        rows = placed_rows(ids, self.placement.stem_handle, self.layer, self.columns, self.dtype)
        return rows[:, _columns(self.columns)]


class StemMLP(nn.Module):
    """down(act(gate(x)) * cat(rows[ids], up_rest(x))), with vLLM's tensor-parallel layers: each rank holds a share
    of the table columns and of the others (`rank_order`), the gate's output columns and the up-projection's split
    alike; the down-projection reduces. Whole layers (k = d_ff) have no up_rest. With `up_proj`, each sequence's
    first token keeps the table columns' dense up-projection (`StemMLP` of modeling_stem.py says why)."""

    def __init__(self, config, layer: int, rows: nn.Module, batch: BatchIds, quant_config, prefix: str):
        super().__init__()
        hidden, d_ff, bias = config.hidden_size, config.intermediate_size, config.stem_mlp_bias
        k = table_columns(config, layer)
        order = rank_order(d_ff, k)
        self.gate_proj = ColumnParallelLinear(hidden, d_ff, bias=bias, quant_config=quant_config,
                                              prefix=f"{prefix}.gate_proj")
        self.down_proj = RowParallelLinear(d_ff, hidden, bias=bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        for param in self.gate_proj.parameters():  # the weight's rows and the bias: this rank's neurons in its order
            _reordered(param, order, 0)
        _reordered(self.down_proj.weight, order, 1)  # the weight's columns (the bias is the output's)
        self.up_proj = ColumnParallelLinear(hidden, k, bias=bias, quant_config=quant_config,
                                            prefix=f"{prefix}.up_proj") if config.stem_dense_first_token else None
        self.up_rest = ColumnParallelLinear(hidden, d_ff - k, bias=bias, quant_config=quant_config,
                                            prefix=f"{prefix}.up_rest") if k < d_ff else None
        self.act_fn = get_act_fn(config.stem_activation)
        self.up_table = rows
        self.__dict__["batch"] = batch  # shared by the model's STEM MLPs
        handle(self, "vllm-mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, d] -> [n, d]
        rows = self.up_table(self.batch.ids).to(x.dtype)  # [n, k / tp]
        if self.up_proj is not None:
            rows = first_token_up(x, rows, self.batch.positions, self.stem_handle)
        if self.up_rest is not None:
            rows = torch.cat([rows, self.up_rest(x)[0]], -1)  # [n, d_ff / tp]: this rank's table columns first
        gate, _ = self.gate_proj(x)
        out, _ = self.down_proj(self.act_fn(gate) * rows)
        return out


def _hold_ids(batch: BatchIds):
    def hook(module, args):
        batch.ids = args[0]  # embed_tokens(input_ids)
    return hook


def _hold_positions(batch: BatchIds):
    def hook(module, args, kwargs):
        batch.positions = args[0] if args else kwargs["positions"]  # layer(positions, hidden_states, ...)
    return hook


class _StemLayers:
    """What the STEM subclass of a dense family's vLLM class adds to it."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # Difference from the dense family: the MLPs of the STEM layers are replaced, before any weight loads.
        config = vllm_config.model_config.hf_config
        if vllm_config.model_config.enable_prompt_embeds:
            raise ValueError("STEM layers look up table rows by token id, which prompt embeddings do not give: "
                             "serve a STEM model without enable_prompt_embeds")
        host = config.stem_tables == "host"
        if host and TableFormat.from_config(config) is not None:
            raise StemTablesError("stem_tables='host' holds float tables in host memory; compressed tables are read "
                                  "from the files (stem_tables='mmap') or held as stored ('memory')")
        placement = None if host else placement_of_config(config)  # host: read by the loader into host memory
        inner, batch = self.model, BatchIds()
        inner.embed_tokens.register_forward_pre_hook(_hold_ids(batch))
        groups = {}
        if placement is None and config.stem_table_groups:
            inner.stem_table_groups = nn.ModuleList([
                TableColumns(config.vocab_size, [table_columns(config, layer) for layer in group], host)
                for group in config.stem_table_groups])
            groups = {layer: GroupColumns(inner.stem_table_groups[k], i)
                      for k, group in enumerate(config.stem_table_groups) for i, layer in enumerate(group)}
        for index in config.stem_layers:
            if placement is not None:
                rows = PlacedRows(placement, index, vllm_config.model_config.dtype)
            else:
                rows = groups.get(index) or TableColumns(config.vocab_size, [table_columns(config, index)], host=host)
            layer = inner.layers[index]
            layer.mlp = StemMLP(config, index, rows, batch, vllm_config.quant_config,
                                maybe_prefix(prefix, f"model.layers.{index}.mlp"))
            layer.register_forward_pre_hook(_hold_positions(batch), with_kwargs=True)
        self.stem_placement = placement
        self._stem_prefixes = tuple(f"model.layers.{i}.mlp." for i in config.stem_layers) + ("model.stem_table_groups.",)

    def load_weights(self, weights):
        # Difference from the dense family: the STEM MLPs' tensors (gate, down, the first token's up, up_rest, the
        # tables) load into their own parameters (host tables: into host memory); tables read from the files are not
        # loaded, nor is the record of which parent neuron each of an MLP's is (`neuron_order`: weights hold it).
        params = dict(self.named_parameters())
        host = {f"{name}.weight": table for name, table in self.named_modules()
                if isinstance(table, TableColumns) and table.host}
        loaded = set()

        def dense(weights):
            for name, tensor in weights:
                if not name.startswith(self._stem_prefixes):
                    yield name, tensor
                elif name in params:
                    param = params[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                    loaded.add(name)
                elif name in host:
                    host[name].load(None, tensor)
                elif name.endswith(".mlp.neuron_order"):
                    continue
                elif not (self.stem_placement is not None and is_table_tensor(name)):
                    raise ValueError(f"the checkpoint holds {name}, which this STEM model has no place for: is its "
                                     f"config.json the one written with these weights?")

        return loaded | set(super().load_weights(dense(weights)))


class StemForCausalLM(nn.Module):
    """What vLLM's registry knows as `StemForCausalLM`: building it builds the STEM subclass of the vLLM class of
    the config's dense family (created once per family), or vLLM's Transformers backend for a family vLLM has no
    class of its own for. Not a pipeline-parallel model (it declares no SupportsPP): stages after the first would
    not see the token ids."""

    _family_classes: dict = {}

    def __new__(cls, *, vllm_config, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        dense_type = config.dense_model_type
        dense = ModelRegistry._try_load_model_cls(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[dense_type])
        if dense is None or "transformers" in dense.__module__.split("."):  # vLLM serves the family through it
            from vllm.model_executor.models.transformers import TransformersForCausalLM

            logger.info("STEM model of dense type %r: served by vLLM's Transformers backend (vLLM has no model "
                        "class of its own for the family)", dense_type)
            return TransformersForCausalLM(vllm_config=vllm_config, prefix=prefix)
        if dense not in cls._family_classes:
            cls._family_classes[dense] = type("Stem" + dense.__name__, (_StemLayers, dense), {"__module__": __name__})
        model = cls._family_classes[dense](vllm_config=vllm_config, prefix=prefix)
        logger.info("STEM model served natively: %s, tables %s", type(model).__name__,
                    model.stem_placement.name if model.stem_placement else config.stem_tables or "memory")
        return model

    # What vLLM's registry inspects the registered class for (a generative model's methods and their keywords);
    # never run: `__new__` returns an instance of another class, which has them.
    def __init__(self, *, vllm_config, prefix: str = ""): ...
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds=None) -> torch.Tensor: ...
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...
