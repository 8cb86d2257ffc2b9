"""Which intermediate neurons of a STEM layer become table columns (`convert --columns`), and the order that puts
them first.

In a layer, some neurons' up-activations are decided almost entirely by the token (a row per token reproduces
them) and others by the context; converting a whole layer converts both kinds. `--columns` converts the former: in
each converted layer, the neurons whose measured cost is least (table_init/column_costs.py) become table columns and
the others keep a dense up-projection (`up_rest`). Each converted layer's neurons are then reordered, table columns
first (gate rows, up rows and down columns together: an FFN does not depend on the order of its neurons), so that
the table's columns are contiguous and the forward is down(act(gate x) * cat(table[ids], up_rest x)), with gate and
down of the parent's size.

Forms of `--columns` (d_ff: a layer's intermediate neurons):
  all        every neuron of each converted layer: whole layers
  1/3        that share of each converted layer's neurons
  512        that many neurons of each converted layer
  auto:1/3   that share of all converted layers' neurons together, spread over the layers by cost (a layer left
             with none stays dense)
"""

import math
import re
from dataclasses import dataclass

import torch

from .errors import UserError

ALL = "all"
# Table columns per layer come in multiples of this (fewer where d_ff is no multiple of it: tiny models), and of a
# compressed format's block: a row's columns fill whole 64-element blocks of int4 scales and whole cache lines.
COLUMN_STEP = 64
AUTO = re.compile(r"auto\s*:\s*(\d+)\s*/\s*(\d+)")
SHARE = re.compile(r"(\d+)\s*/\s*(\d+)")


# `convert`'s share of each layer's neurons when --layers is all (its default) and --columns is not given. Measured on
# SmolLM2-135M with no text but the parent's own (issue 53; rows from 64k sampled tokens shrunk toward the parent's,
# conversion only): a sixth of every layer's neurons 1.21x-1.38x the parent's perplexity on seven genres, a third
# 1.51x-1.97x. A sixth keeps every genre well within 2x; a third is a model to recover.
DEFAULT_SHARE = "1/6"


class ColumnSpecError(UserError):
    pass


def default_columns(layers: str, calibrated: bool = True) -> str:
    """`--columns` not given: `DEFAULT_SHARE` of every layer's neurons where every layer converts (`--layers all`) with
    calibrated rows (which the choice of neurons is measured with), else whole layers (a user who picks layers means
    them whole)."""
    return DEFAULT_SHARE if str(layers).strip().lower() == "all" and calibrated else ALL


@dataclass(frozen=True)
class ColumnSpec:
    """A parsed `--columns`: a `share` of the neurons (per layer, or over all layers when `spread`), or a `count`
    per layer; neither: every neuron (whole layers)."""

    text: str
    share: float | None = None
    count: int | None = None
    spread: bool = False

    @property
    def whole(self) -> bool:
        return self.share is None and self.count is None or self.share == 1.0 and not self.spread

    @property
    def measured(self) -> bool:
        """Whether choosing the columns needs each neuron's cost (anything but whole layers)."""
        return not self.whole


def parse_columns(spec: str) -> ColumnSpec:
    """`--columns` read, or a one-line error naming the forms."""
    text = str(spec).strip().lower()
    if text == ALL:
        return ColumnSpec(text)
    if m := AUTO.fullmatch(text) or SHARE.fullmatch(text):
        num, den = int(m.group(1)), int(m.group(2))
        if den == 0 or num == 0 or num > den:
            raise ColumnSpecError(f"--columns {spec!r}: a share must lie in (0, 1], e.g. 1/3")
        return ColumnSpec(text, share=num / den, spread=text.startswith("auto"))
    if text.isdigit() and int(text) > 0:
        return ColumnSpec(text, count=int(text))
    raise ColumnSpecError(f"--columns {spec!r} is not understood; use all, a share of each layer's neurons (1/3), "
                          f"a count per layer (512), or a share of all layers' neurons spread by cost (auto:1/3)")


def column_step(d_ff: int, block_size: int = 0) -> int:
    """The multiple that a layer's table columns come in (`COLUMN_STEP`, with a compressed table's `block_size`)."""
    step = math.lcm(COLUMN_STEP, block_size) if block_size else COLUMN_STEP
    while d_ff % step:
        step //= 2
    return max(step, 1)


@dataclass(frozen=True, eq=False)
class NeuronSplit:
    """One STEM layer's neurons in the STEM MLP's order: `order` [d_ff] holds the parent's index of each, the
    `columns` table columns first, then the neurons that keep a dense up-projection (each part in the parent's
    order)."""

    order: torch.Tensor
    columns: int

    @classmethod
    def cheapest(cls, costs: torch.Tensor, columns: int) -> "NeuronSplit":
        """The `columns` neurons of least cost (`costs` [d_ff]) as table columns."""
        table = torch.topk(costs.double(), columns, largest=False).indices.sort().values
        rest = torch.ones(costs.numel(), dtype=torch.bool)
        rest[table] = False
        return cls(torch.cat([table, rest.nonzero()[:, 0]]), columns)

    @property
    def table(self) -> torch.Tensor:
        return self.order[: self.columns]

    @property
    def rest(self) -> torch.Tensor:
        return self.order[self.columns :]


def split_projections(weights: dict, split: NeuronSplit | None) -> dict:
    """A layer's MLP weights ({"gate", "gate_bias", "up", "up_bias"} and maybe {"down", "down_bias"}, as
    `mlp_projections` gives them) in the STEM MLP's order: gate rows reordered, "up" the table columns' rows,
    "up_rest" the others' (None without a split, where "up" is every row), down columns reordered."""
    if split is None:
        return {**weights, "up_rest": None, "up_rest_bias": None}

    def rows(tensor, index):
        return None if tensor is None else tensor.index_select(0, index.to(tensor.device))

    out = {**weights, "gate": rows(weights["gate"], split.order), "gate_bias": rows(weights["gate_bias"], split.order),
           "up": rows(weights["up"], split.table), "up_bias": rows(weights["up_bias"], split.table),
           "up_rest": rows(weights["up"], split.rest), "up_rest_bias": rows(weights["up_bias"], split.rest)}
    if weights.get("down") is not None:
        out["down"] = weights["down"].index_select(1, split.order.to(weights["down"].device))
    return out


def choose_columns(spec: ColumnSpec, costs: dict[int, torch.Tensor], step: int) -> dict[int, NeuronSplit]:
    """Per converted layer, its split: the cheapest neurons by `costs` ({layer: [d_ff]}) as table columns, as many as
    `spec` gives it in multiples of `step`; a layer given none is left out (it stays dense). Over all layers together
    (`spread`), the budget goes to the cheapest neurons wherever they are, each layer's count rounded to the step
    so that the counts add up to the budget (largest remainders)."""
    d_ff = {layer: cost.numel() for layer, cost in costs.items()}
    if spec.count is not None:
        if any(spec.count > n for n in d_ff.values()):
            raise ColumnSpecError(f"--columns {spec.text}: a layer has {min(d_ff.values())} intermediate neurons; "
                                  f"give at most that many")
        counts = {layer: _rounded(spec.count, step, d_ff[layer]) for layer in costs}
    elif not spec.spread:
        counts = {layer: _rounded(spec.share * d_ff[layer], step, d_ff[layer]) for layer in costs}
    else:
        budget = round(spec.share * sum(d_ff.values()) / step)  # in steps
        everything = torch.cat([costs[layer].double() for layer in costs])
        owner = torch.cat([torch.full((d_ff[layer],), i) for i, layer in enumerate(costs)])
        taken = torch.bincount(owner[torch.topk(everything, budget * step, largest=False).indices],
                               minlength=len(costs)).tolist()
        steps = {layer: n / step for layer, n in zip(costs, taken)}
        counts = {layer: math.floor(s) for layer, s in steps.items()}
        for layer in sorted(steps, key=lambda l: steps[l] - counts[l], reverse=True)[: budget - sum(counts.values())]:
            counts[layer] += 1
        counts = {layer: n * step for layer, n in counts.items()}
    return {layer: NeuronSplit.cheapest(costs[layer], n) for layer, n in counts.items() if n}


def _rounded(count: float, step: int, d_ff: int) -> int:
    """`count` to the nearest multiple of `step`, at least one step and at most `d_ff`."""
    return min(d_ff, max(step, round(count / step) * step))


def describe_columns(splits: dict[int, NeuronSplit] | None, d_ff: int, layers: list[int]) -> str:
    """One line for the plan and the model card: how many of the converted layers' neurons are table columns."""
    if not splits:
        return f"every neuron of each converted layer ({d_ff} columns a table)"
    total = sum(s.columns for s in splits.values())
    counts = sorted({s.columns for s in splits.values()})
    each = (f"{counts[0]} of {d_ff} in each layer" if len(counts) == 1
            else f"{counts[0]}-{counts[-1]} of {d_ff} per layer")
    return f"{total} of {d_ff * len(layers)} neurons ({total / (d_ff * len(layers)):.1%}) are table columns: {each}"
