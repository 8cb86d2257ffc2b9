"""`stem-upcycle inspect`: what a dense or STEM checkpoint holds and costs per token."""

import math
from dataclasses import asdict, dataclass

from .families import EMBEDDING, STEM_NEURON_ORDER, STEM_UP, family_for, layer_name
from .modeling.configuration_stem import table_columns
from .modeling.stem_tables import DEFAULT_CACHE_ROWS
from .modeling.table_files import is_table_tensor
from .modeling.table_format import TableFormat
from .source import Source


@dataclass
class Summary:
    family: str
    is_stem: bool
    num_layers: int
    stem_layers: list[int]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    table_columns: dict  # STEM only: {layer: its table's columns}, where some layer's table holds some neurons only
    params_total: int
    params_active_per_token: int
    ffn_flops_per_token_dense: int  # every layer dense
    ffn_flops_per_token: int  # this checkpoint
    bytes_on_disk: int
    placements: dict  # STEM only: placement -> {"device": bytes, "host": bytes} of weights, as stored
    table_format: str  # STEM only: how the tables store rows (a float dtype, or compressed with its block size)
    edits: list  # knowledge edits recorded by `stem-upcycle edit` (config.json `stem_edits`)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        ratio = self.ffn_flops_per_token / self.ffn_flops_per_token_dense
        kind = f"STEM ({len(self.stem_layers)} of {self.num_layers} layers)" if self.is_stem else "dense"
        rows = [
            ("model", f"{kind}, family {self.family}"),
            ("shape", f"{self.num_layers} layers, vocab {self.vocab_size}, d {self.hidden_size}, d_ff {self.intermediate_size}"),
            ("STEM layers", str(self.stem_layers) if self.is_stem else "none"),
            ("parameters", f"{self.params_total / 1e6:,.1f} M in total"),
            ("active/token", f"{self.params_active_per_token / 1e6:,.1f} M (one row of the embedding and of each table)"),
            ("FFN FLOPs/token", f"{self.ffn_flops_per_token / 1e6:,.1f} M vs {self.ffn_flops_per_token_dense / 1e6:,.1f} M dense ({ratio:.2f}x)"),
            ("on disk", f"{self.bytes_on_disk / 1e9:.2f} GB of weights"),
        ]
        if self.is_stem:
            rows.insert(3, ("tables", self.table_format))
        if self.table_columns:
            converted = sum(self.table_columns.values())
            share = converted / (self.intermediate_size * len(self.stem_layers))
            widths = sorted(set(self.table_columns.values()))
            each = f"{widths[0]}" if len(widths) == 1 else f"{widths[0]}-{widths[-1]}"
            rows.insert(4, ("table columns", f"{each} of {self.intermediate_size} neurons a layer ({share:.1%} of the "
                                             f"STEM layers'; the others keep a dense up-projection, up_rest)"))
        lines = [f"{k:<16} {v}" for k, v in rows]
        if self.placements:
            lines.append("memory by placement (weights as stored, without activations and KV cache; the device is "
                         "where the model runs, RAM on a CPU):")
            for name, need in self.placements.items():
                lines.append(f"  {name:<7} device {need['device'] / 1e9:6.2f} GB   host RAM {need['host'] / 1e9:6.2f} GB"
                             f"   {PLACEMENT_NOTES[name]}")
        for number, edit in enumerate(self.edits, 1):
            lines.append(f"{'edits' if number == 1 else '':<16} {number}. {', '.join(edit['swaps'])} (mode {edit['mode']}, "
                         f"layers {edit['layers']}; undo: stem-upcycle edit PATH --undo)")
        return "\n".join(lines)


PLACEMENT_NOTES = {
    "memory": "(tables are parameters, or compressed rows as stored, on the device with the rest)",
    "mmap": "(tables stay in the files; a forward reads its tokens' rows, and the OS caches what it may)",
    "host": f"(tables in host RAM; the device holds the dense weights and {DEFAULT_CACHE_ROWS} cached rows)",
}


def placement_memory(dense_bytes: int, table_bytes: int, row_bytes: int) -> dict:
    """Bytes each placement needs on the device where the model runs (RAM on a CPU) and in host RAM
    besides; `row_bytes`: one token's rows, all layers. For mmap, the rows a forward reads (a few
    MB) are left out, and the page cache is the OS's to size."""
    return {
        "memory": {"device": dense_bytes + table_bytes, "host": 0},
        "mmap": {"device": dense_bytes, "host": 0},
        "host": {"device": dense_bytes + DEFAULT_CACHE_ROWS * row_bytes, "host": table_bytes},
    }


def summarize(source: Source) -> Summary:
    cfg = source.config
    is_stem = cfg.model_type == "stem"
    family_name = cfg.dense_model_type if is_stem else cfg.model_type
    family_for(family_name)  # a clear error for architectures we know nothing about
    stem_layers = list(cfg.stem_layers) if is_stem else []
    tensors = source.tensors
    # a layer's neuron_order (`--columns`) records where its neurons came from: no parameter
    total = sum(math.prod(tensors.shape(n)) for n in tensors.names() if not n.endswith(STEM_NEURON_ORDER))
    vocab, d, d_ff = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    # A token reads one row of the embedding and of each table; a tied head still reads all of E.
    tied_head = vocab * d if getattr(cfg, "tie_word_embeddings", False) and EMBEDDING in tensors else 0
    unread = (vocab - 1) * d if EMBEDDING in tensors else 0
    # A table's tensors: float rows, or compressed values and scales; a token reads one row of each.
    tables = [n for n in tensors.names() if is_table_tensor(n)]  # or groups of them (config.stem_table_groups)
    unread += sum(math.prod(tensors.shape(n)) // vocab * (vocab - 1) for n in tables)
    # A STEM layer's up-projection of its table columns, where kept (`--first-token dense`), is read for a sequence's
    # first token only.
    unread += sum(math.prod(tensors.shape(n)) for i in stem_layers if (n := layer_name(i, STEM_UP + ".weight")) in tensors)
    layers = cfg.num_hidden_layers
    columns = {i: table_columns(cfg, i) for i in stem_layers}
    dense_flops = 2 * 3 * d * d_ff * layers  # gate, up, down: one multiply-add each per weight
    flops = dense_flops - 2 * d * sum(columns.values())  # the table columns' up-projection became a lookup
    table_bytes = sum(tensors.nbytes(n) for n in tables)
    dense_bytes = sum(tensors.nbytes(n) for n in tensors.names()) - table_bytes
    row_bytes = sum(tensors.nbytes(n) // vocab for n in tables)
    return Summary(
        family=family_name,
        is_stem=is_stem,
        num_layers=layers,
        stem_layers=stem_layers,
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=d_ff,
        table_columns=columns if any(k < d_ff for k in columns.values()) else {},
        params_total=total,
        params_active_per_token=total - unread + tied_head,
        ffn_flops_per_token_dense=dense_flops,
        ffn_flops_per_token=flops,
        bytes_on_disk=source.files_bytes,
        placements=placement_memory(dense_bytes, table_bytes, row_bytes) if is_stem else {},
        table_format=_table_format(cfg, tensors, tables) if is_stem else "",
        edits=list(getattr(cfg, "stem_edits", None) or []),
    )


def _table_format(config, tensors, tables: list[str]) -> str:
    compressed = TableFormat.from_config(config)
    if compressed is not None:
        return compressed.describe()
    if not tables:
        return "none stored"
    groups = getattr(config, "stem_table_groups", None)
    return str(tensors.dtype(tables[0])).removeprefix("torch.") + (f", {table_layout(groups)}" if groups else "")


def describe_widths(config) -> str:
    """The tables' widths for a line: d_ff for whole layers, else each distinct width (`config.table_columns`)."""
    widths = sorted({table_columns(config, layer) for layer in config.stem_layers})
    return "/".join(map(str, widths))


def table_layout(groups: list | None) -> str:
    """How the tables lie in the files, in words."""
    if not groups:
        return "a tensor per table"
    return (f"{len(groups)} group{'s' if len(groups) > 1 else ''} of up to {max(map(len, groups))} layers "
            f"side by side")

