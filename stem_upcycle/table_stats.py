"""`stem-upcycle inspect --tables / --nearest`: what a STEM model's table rows look like.

- Row norms over every row of each table, read in chunks from the files (nothing loaded whole).
- Angular spread, the statistic the STEM paper reports: percentiles of |cos| between rows, over
  every pair of a fixed, seeded sample of rows. The paper finds STEM rows nearly orthogonal (P95
  |cos| ~0.03) against ~0.15 for a dense model's up-projection outputs `W_up x`; with the dense
  parent and a text, the same statistic for `W_up x` on the text, and for the STEM rows of the
  text's tokens (the rows that text reads), so that the three compare on equal terms.
- Nearest rows: the tokens whose rows in a layer lie closest (cosine) to a given token's.
"""

import torch

from .errors import UserError
from .families import STEM_NEURON_ORDER, family_for, layer_name
from .modeling.configuration_stem import table_columns

PERCENTILES = (5, 50, 95)
BINS = 50  # histogram of |cos| over [0, 1], kept for the plot and the JSON
CHUNK_ROWS = 4096  # rows per read when scanning a whole table


class StatsError(UserError):
    pass


def spread(rows: torch.Tensor) -> dict:
    """|cos| over every pair of `rows` [n, d]: {"P5", "P50", "P95", "pairs": n(n-1)/2, "histogram": the
    fraction of pairs in each of BINS equal bins of [0, 1]}."""
    unit = torch.nn.functional.normalize(rows.float(), dim=1)
    cos = (unit @ unit.T).abs()
    pairs = cos[torch.triu_indices(len(cos), len(cos), offset=1).unbind()].clamp(max=1.0)
    histogram = torch.histc(pairs, bins=BINS, min=0.0, max=1.0) / pairs.numel()
    return {**{f"P{p}": float(torch.quantile(pairs, p / 100)) for p in PERCENTILES}, "pairs": pairs.numel(),
            "histogram": [round(float(h), 6) for h in histogram]}


def seeded_sample(population: int, size: int, seed: int) -> torch.Tensor:
    """Sorted distinct indices in [0, population): the same for the same (population, size, seed)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(population, generator=generator)[:size].sort().values


def chunks(tables, layer: int):
    """(first row, rows [<= CHUNK_ROWS, k] in fp32) over a whole table, read a chunk at a time."""
    vocab = tables.stored[layer].shape[0]
    for start in range(0, vocab, CHUNK_ROWS):
        yield start, tables.read_range(layer, start, min(start + CHUNK_ROWS, vocab)).float()


def row_norms(tables, layer: int) -> dict:
    """Mean and P5/P50/P95 of the L2 norms of every row of a table."""
    norms = torch.cat([rows.norm(dim=1) for _, rows in chunks(tables, layer)])
    return {"mean": float(norms.mean()), **{f"P{p}": float(torch.quantile(norms, p / 100)) for p in PERCENTILES}}


def table_statistics(tables, sample: int = 2048, seed: int = 0, text_ids: torch.Tensor | None = None) -> dict:
    """Per STEM layer: row norms, the spread of a seeded sample of rows (uniform over the vocabulary)
    and, given a text's ids, of (a seeded sample of) the rows of its distinct tokens."""
    vocab = next(iter(tables.stored.values())).shape[0]
    ids = seeded_sample(vocab, sample, seed)
    text_tokens = None
    if text_ids is not None:
        distinct = text_ids.unique()
        text_tokens = distinct[seeded_sample(len(distinct), sample, seed)]
    layers = {}
    for layer in sorted(tables.stored):
        stats = {"norms": row_norms(tables, layer), "spread": spread(tables.read_rows(layer, ids))}
        if text_tokens is not None:
            stats["spread_text_tokens"] = spread(tables.read_rows(layer, text_tokens))
        layers[layer] = stats
    return {"sample": len(ids), "seed": seed, "text_tokens": None if text_tokens is None else len(text_tokens),
            "layers": layers}


def table_neurons(source, layers) -> dict[int, torch.Tensor]:
    """Per STEM layer of `layers` whose table holds some of its neurons only (`convert --columns`), the parent's
    index of each of its table's columns (the first k of its `neuron_order`)."""
    found = {}
    for layer in layers:
        name = layer_name(layer, STEM_NEURON_ORDER)
        if name in source.tensors:
            found[layer] = source.tensors.get(name)[: table_columns(source.config, layer)].long()
    return found


@torch.no_grad()
def dense_up_spread(model, ids: torch.Tensor, layers, sample: int = 2048, seed: int = 0, window: int = 512,
                    columns: dict[int, torch.Tensor] | None = None) -> dict:
    """Per layer of `layers`, the spread of the dense model's up-projection outputs `W_up x` [d_ff] at a
    seeded sample of the positions of `ids` [n] (read in windows of `window` tokens); of a layer in `columns`
    (`table_neurons`), its table columns' outputs alone, as the table holds them."""
    family = family_for(model.config.model_type)
    d_ff = model.config.intermediate_size
    positions = seeded_sample(len(ids), sample, seed)
    outputs = {layer: [] for layer in layers}
    columns = columns or {}

    def keep(layer):
        def hook(module, args, out):  # [1, seq, d_ff], or [1, seq, 2 d_ff] for a fused gate-up (gate first)
            up = out[0, :, -d_ff:].float()
            outputs[layer].append(up[:, columns[layer].to(up.device)] if layer in columns else up)
        return hook

    hooks = []
    for layer in layers:
        up = model.base_model.layers[layer].get_submodule(family.fused_gate_up or family.up)
        hooks.append(up.register_forward_hook(keep(layer)))
    try:
        for start in range(0, len(ids), window):
            model(ids[None, start:start + window].to(model.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return {"positions": len(positions),
            "layers": {layer: spread(torch.cat(outputs[layer])[positions]) for layer in layers}}


def nearest_rows(tables, layer: int, token: int, top: int = 10) -> list[tuple[int, float]]:
    """The `top` tokens (other than `token`) whose rows in `layer` have the highest cosine with `token`'s."""
    query = torch.nn.functional.normalize(tables.read_rows(layer, torch.tensor([token])).float(), dim=1)[0]
    best_cos, best_ids = torch.empty(0), torch.empty(0, dtype=torch.long)
    for start, rows in chunks(tables, layer):
        cos = torch.nn.functional.normalize(rows, dim=1) @ query
        ids = torch.arange(start, start + len(rows))
        cos, ids = cos[ids != token], ids[ids != token]
        best_cos, order = torch.cat([best_cos, cos]).topk(min(top, len(best_cos) + len(cos)))
        best_ids = torch.cat([best_ids, ids])[order]
    return list(zip(best_ids.tolist(), best_cos.tolist()))


def token_id(tokenizer, text: str, vocab: int) -> int:
    """The id of TOKEN: a text that is one token as written (e.g. " Spain"), or id:N; below `vocab`."""
    if text.startswith("id:") and text[3:].isdigit():
        if int(text[3:]) >= vocab:
            raise StatsError(f"--nearest {text}: the tables have {vocab} rows, ids 0-{vocab - 1}")
        return int(text[3:])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) == 1 and ids[0] >= vocab:
        raise StatsError(f"--nearest {text!r} is token id {ids[0]}, past the tables' {vocab} rows")
    if len(ids) != 1:
        pieces = [tokenizer.convert_ids_to_tokens(i) for i in ids]
        raise StatsError(f"--nearest {text!r} is {len(ids)} tokens {pieces}; give one token (mind the leading space, "
                         f"e.g. ' Spain'), or id:N")
    return ids[0]


def describe(stats: dict, dense: dict | None = None) -> str:
    lines = [f"table rows: |cos| over every pair of {stats['sample']} rows sampled uniformly from the vocabulary "
             f"(seed {stats['seed']})"]
    if stats["text_tokens"]:
        lines.append(f"text rows:  the same over {stats['text_tokens']} distinct tokens of the text")
    if dense:
        lines.append(f"dense W_up x: the same over the parent's up-projection outputs at {dense['positions']} "
                     f"positions of the text")
    header = f"{'layer':>5}  {'row norm mean (P5-P95)':>24}  {'table rows |cos| P5/P50/P95':>28}"
    if stats["text_tokens"]:
        header += f"  {'text rows':>17}"
    if dense:
        header += f"  {'dense W_up x':>17}"
    lines.append(header)

    def triple(s):
        return f"{s['P5']:.3f}/{s['P50']:.3f}/{s['P95']:.3f}"

    for layer, s in stats["layers"].items():
        n = s["norms"]
        line = f"{layer:>5}  {n['mean']:>10.3f} ({n['P5']:.3f}-{n['P95']:.3f})  {triple(s['spread']):>28}"
        if "spread_text_tokens" in s:
            line += f"  {triple(s['spread_text_tokens']):>17}"
        if dense:
            line += f"  {triple(dense['layers'][layer]):>17}"
        lines.append(line)
    return "\n".join(lines)


def plot(stats: dict, dense: dict | None, path: str, title: str) -> None:
    """Histograms of |cos| per STEM layer (table rows, text rows, dense W_up x) in one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise StatsError("--plot needs matplotlib, an optional extra: pip install 'stem-upcycle[plot]'") from None
    layers = list(stats["layers"])
    columns = min(5, len(layers))
    rows = -(-len(layers) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.6 * rows), squeeze=False, sharex=True)
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    for ax, layer in zip(axes.flat, layers):
        series = [("table rows", stats["layers"][layer]["spread"])]
        if "spread_text_tokens" in stats["layers"][layer]:
            series.append(("text rows", stats["layers"][layer]["spread_text_tokens"]))
        if dense:
            series.append(("dense W_up x", dense["layers"][layer]))
        for label, s in series:
            ax.stairs(s["histogram"], [i / BINS for i in range(BINS + 1)], label=f"{label} (P95 {s['P95']:.2f})")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_yscale("log")
        ax.legend(fontsize=6)
    figure.supxlabel("|cos| between rows")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
