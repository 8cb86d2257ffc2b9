"""`--layers auto:FRACTION`: convert the layers whose conversion alone costs the least.

Every layer is calibrated (the chosen calibrated init), then each is converted alone in the dense
model, by a forward hook that swaps its MLP output for down(act(gate(x)) * U[ids]), and the
perplexity on windows of the calibration text that the calibration left out (spread over it, so
that a mix of the user's and generated text is scored on both) is compared with the dense model's:
scored on the windows its rows were fitted to, a layer would look better than it is on new text.

Perplexity alone picks layers that cost facts: SmolLM2-135M's layers 15 and 21 are the cheapest after
layer 0 by perplexity (1.047x each) and among the worst for facts (33 and 26 of the parent's 47
prompts kept, converted alone), while layer 10 costs the same perplexity and keeps 44
(benchmarks/README.md, fact_positions.py). So each layer is also scored on facts: the perplexity of
the parent's own completions of short factual prompts (`facts_layer_choice.jsonl`, a set apart from
the one `eval --facts` scores, so that a choice made on it is checked on others), converted alone
against dense. The layers with the smallest product of the two ratios are converted. Single layers
differ widely, and where they sit in the stack is not what decides it.
"""

import dataclasses
import math
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ..evaluate import evaluate
from ..facts import load_facts
from ..families import Family, layer_name
from ..layers import LayerSpecError, parse_layers
from ..loading import load_tokenizer, model_from_source
from ..modeling.modeling_stem import StemMLP
from ..modeling.forward_ids import IdHandoff
from . import INITIALISERS
from .closed_form import mlp_projections
from .protocol import FitOptions, InitOptions, InitTarget

AUTO = re.compile(r"auto\s*:\s*(\d+\s*/\s*\d+)")
MEASURE_WINDOWS = 8  # windows of the calibration text, left out of it, each layer is scored on
# Prompts with the completion SmolLM2-135M-Instruct gives them, up to its right answer (45 facts, none of
# them in facts.jsonl): what each layer is scored on for facts
RANKING_FACTS = Path(__file__).resolve().parent.parent / "facts_layer_choice.jsonl"


def is_auto(spec: str) -> bool:
    return AUTO.fullmatch(spec.strip().lower()) is not None


def auto_fraction(spec: str) -> str:
    """"1/3" of "auto:1/3"."""
    return AUTO.fullmatch(spec.strip().lower()).group(1)


def check_auto(spec: str, init: str) -> None:
    if not INITIALISERS[init].needs_data:
        raise LayerSpecError(f"--layers {spec} measures each layer with calibrated rows: use --init calib "
                             f"(or calib-mean) with --calib-data")


def select_layers(spec: str, source, family: Family, config, init: str, options: InitOptions, progress: bool = True):
    """(layers, calibrated init covering every layer, {layer: perplexity ratio converted alone},
    {layer: ratio of the perplexity of fact completions converted alone}) for `auto:FRACTION`."""
    count = len(parse_layers(auto_fraction(spec), config.num_hidden_layers))
    check_auto(spec, init)
    model = options.dense_model or model_from_source(source)
    every = list(range(config.num_hidden_layers))
    # each layer is scored converted alone on the dense model, so calibrated on its inputs and fitted no further
    options = dataclasses.replace(options, dense_model=model, scoring_windows=MEASURE_WINDOWS, fit=FitOptions())
    calibrated = INITIALISERS[init](InitTarget(source, family, config, every), options, progress=progress)
    costs = measure_costs(model, calibrated, family, config, calibrated.scoring_windows)
    fact_costs = measure_costs(model, calibrated, family, config, fact_completions(load_tokenizer(source), RANKING_FACTS))
    ranked = rank_layers(costs, fact_costs)
    chosen = sorted(ranked[:count])
    table = ", ".join(f"{i}: {costs[i]:.3f}x/{fact_costs[i]:.2f}x" for i in ranked)
    print(f"layer costs converted alone (perplexity ratio on held-out calibration windows / on fact completions), "
          f"cheapest first: {table}\nchosen: {chosen}", file=sys.stderr)
    return chosen, calibrated, costs, fact_costs


def rank_layers(costs: dict, fact_costs: dict | None = None) -> list:
    """The layers (keys of `costs`) cheapest first: by the product of the two ratios (text alone where a
    conversion measured no facts)."""
    return sorted(costs, key=lambda layer: costs[layer] * (fact_costs[layer] if fact_costs else 1.0))


@dataclasses.dataclass(frozen=True)
class ScoredTokens:
    """Sequences to score a conversion on: ids [n, seq] (right-padded) and which targets count [n, seq - 1]."""

    ids: torch.Tensor
    scored: torch.Tensor


def fact_completions(tokenizer, path: Path) -> ScoredTokens:
    """Each fact's (of `path`) prompt followed by its completion, scored on the completion's tokens alone."""
    sequences, scored = [], []
    for fact in load_facts(path):
        prompt = tokenizer(fact.prompt, return_token_type_ids=False)["input_ids"]
        answer = tokenizer(" " + fact.answers[0], add_special_tokens=False)["input_ids"]
        sequences.append(prompt + answer)
        scored.append([False] * (len(prompt) - 1) + [True] * len(answer))  # targets are the next tokens
    width = max(map(len, sequences))
    # padded on the right with the last token: causal attention keeps the scored positions as they are
    ids = torch.tensor([s + s[-1:] * (width - len(s)) for s in sequences])
    mask = torch.tensor([m + [False] * (width - 1 - len(m)) for m in scored])
    return ScoredTokens(ids, mask)


def measure_costs(model, calibrated, family: Family, config, scored) -> dict[int, float]:
    """Per layer, the perplexity ratio with only that layer converted, on windows [n, seq] of text or on
    `ScoredTokens`."""
    dense = perplexity_with(model, calibrated, family, config, [], scored)
    return {layer: perplexity_with(model, calibrated, family, config, [layer], scored) / dense
            for layer in range(config.num_hidden_layers)}


@torch.no_grad()
def perplexity_with(model, calibrated, family: Family, config, layers: list[int], scored) -> float:
    """Perplexity of the dense `model` on windows [n, seq] of text (or on `ScoredTokens`) with `layers`
    converted (calibrated rows): a forward hook makes each such layer's MLP return a STEM MLP's output on
    the same input."""
    token_ids = IdHandoff()
    device = model.device  # scored where the model is (a GPU with `convert --device`)
    windows = scored.ids if isinstance(scored, ScoredTokens) else scored
    ids = windows.unique().to(device)
    hooks = []

    def stem_mlp(layer):
        tensors = calibrated.source.tensors
        w = mlp_projections(tensors, family, layer)
        down_bias = layer_name(layer, family.down + ".bias")
        mlp = StemMLP(_linear(w["gate"], w["gate_bias"]),
                      _linear(tensors.get(layer_name(layer, family.down + ".weight")),
                              tensors.get(down_bias) if down_bias in tensors else None),
                      ACT2FN[config.stem_activation], CalibratedRows(ids, calibrated.rows_for(layer, ids.cpu()).to(device)),
                      token_ids, layer, _linear(w["up"], w["up_bias"]) if config.stem_dense_first_token else None).to(device)
        return lambda module, args, output: mlp(args[0].float()).to(output.dtype)

    for layer in layers:
        hooks.append(model.base_model.layers[layer].mlp.register_forward_hook(stem_mlp(layer)))
    try:
        if isinstance(scored, ScoredTokens):  # one batch; every sequence starts a text
            batch = windows.to(device)
            token_ids.start(batch, first=(torch.arange(len(batch)), torch.zeros(len(batch), dtype=torch.long)))
            logits = model(batch, use_cache=False).logits[:, :-1].float()  # [n, seq - 1, vocab]
            nll = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")  # [n, seq - 1]
            return math.exp(nll[scored.scored.to(device)].mean().item())
        first = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))  # each window starts a text
        return evaluate(model, windows.flatten(), window=windows.shape[1],
                        before_window=lambda chunk: token_ids.start(chunk, first=first))["ppl"]
    finally:
        for hook in hooks:
            hook.remove()


class CalibratedRows:
    """A STEM MLP's row source for scoring: calibrated rows of the sorted ids `ids`."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor):
        self.ids, self.rows = ids, rows.float()  # [n], [n, d_ff]

    def __call__(self, forward, device, dtype) -> torch.Tensor:
        return self.rows[torch.searchsorted(self.ids, forward.ids)].to(device, dtype)  # [batch, seq, d_ff]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear over existing fp32 copies of `weight` [out, in] and `bias`."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.float(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.float(), requires_grad=False)
    return layer
