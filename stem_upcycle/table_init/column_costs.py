"""Each intermediate neuron's cost as a table column, measured out of sample (`convert --columns`).

A neuron j of a layer whose up-activation u_j becomes a row r_j[token] adds to the layer's output the error
W_down[:, j] * g_j * (u_j - r_j[token]), with g_j = act(gate_j x). Its cost is the mean square of that error over
positions, ||W_down[:, j]||^2 x mean (g_j (u_j - r_j[token]))^2: the output error the neuron alone would add.

It is scored on calibration windows that the rows were not fitted to, with the rows as the conversion makes them (a
ridge row for a token the calibration never showed): scored on the windows its rows came from, a neuron looks
cheaper than it is on new text, most on a genre whose tokens the calibration covers least (SmolLM2-135M, a third
of every layer's neurons chosen on in-sample costs: 2.76x the parent's perplexity on a science text whose distinct
tokens the calibration covered a third of; issue 48). The cost ranks neurons within a layer well, and whole layers
badly: whole layers are chosen by `--layers auto:` (layer_choice.py), which scores perplexity.
"""

import torch
from transformers.activations import ACT2FN

from ..families import Family, layer_name
from .calibrated import in_fp32, skipped_positions
from .closed_form import mlp_projections
from .layer_choice import ScoredTokens

WINDOWS_PER_FORWARD = 8  # scoring windows read at once


class _Stop(Exception):
    """Raised after the last scored layer: the rest of the forward is not needed."""


@torch.no_grad()
def column_costs(model, calibrated, family: Family, config, layers: list[int], windows: torch.Tensor,
                 facts: ScoredTokens | None = None, fact_weight: float = 0.0) -> dict[int, torch.Tensor]:
    """{layer: [d_ff] each neuron's cost} of the dense `model` on `windows` [n, seq] (kept out of the calibration
    `calibrated`, whose `rows_for` gives the rows the conversion would write), every layer of `layers` in one pass;
    with `facts` (prompts and the parent's completions), plus `fact_weight` x its mean cost over their tokens: what
    the model knows weighs that much beside the text."""
    device = model.device
    tensors = calibrated.source.tensors
    activation = ACT2FN[config.stem_activation]
    skip = skipped_positions(config)  # a dense first token reads no row
    scored = [(windows, torch.ones(windows.shape, dtype=torch.bool), 1.0)]
    if facts is not None and fact_weight:
        real = torch.arange(facts.ids.shape[1])[None] < completion_lengths(facts)[:, None]  # no padding
        scored.append((facts.ids, real, fact_weight))
    sums = [{layer: torch.zeros(config.intermediate_size, dtype=torch.float64, device=device) for layer in layers}
            for _ in scored]
    current = {}

    def scorer(layer: int):
        @in_fp32
        def hook(module, args):
            where = current["where"]
            x = args[0][:, skip:][where].float()  # [tokens, d]
            # one layer's weights in fp32 at a time (a bf16 source's every layer at once would be a copy of them all)
            w = {k: None if v is None else v.to(device, torch.float32)
                 for k, v in mlp_projections(tensors, family, layer).items()}
            gate = activation(torch.nn.functional.linear(x, w["gate"], w["gate_bias"]))  # [tokens, d_ff]
            up = torch.nn.functional.linear(x, w["up"], w["up_bias"])
            rows = calibrated.rows_for(layer, current["unique"]).to(device)[current["inverse"]]  # [tokens, d_ff]
            current["sums"][layer] += (gate * (up - rows)).square().sum(0, dtype=torch.float64)
            if layer == layers[-1]:
                raise _Stop
        return hook

    # rows the hooks ask for, read before the model runs them
    calibrated.read_ahead(torch.cat([ids[:, skip:][mask[:, skip:]] for ids, mask, _ in scored]).unique())
    hooks = [model.base_model.layers[layer].mlp.register_forward_pre_hook(scorer(layer)) for layer in layers]
    counted = [0] * len(scored)
    try:
        for s, (ids, mask, _) in enumerate(scored):
            for batch, kept in zip(ids.split(WINDOWS_PER_FORWARD), mask.split(WINDOWS_PER_FORWARD)):
                where = kept[:, skip:]
                unique, inverse = batch[:, skip:][where].unique(return_inverse=True)
                current.update(unique=unique, inverse=inverse.to(device), where=where.to(device), sums=sums[s])
                counted[s] += inverse.numel()
                try:
                    model(batch.to(device), use_cache=False)
                except _Stop:
                    pass
    finally:
        for hook in hooks:
            hook.remove()
    costs = {}
    for layer in layers:
        down = tensors.get(layer_name(layer, family.down + ".weight")).double()  # [d, d_ff]
        mean = sum(weight * sums[s][layer].cpu() / counted[s] for s, (_, _, weight) in enumerate(scored))
        costs[layer] = (down.square().sum(0) * mean).float()
    return costs


def completion_lengths(facts: ScoredTokens) -> torch.Tensor:
    """[n] each fact sequence's tokens, its padding aside: the completion ends it, and target j is token j + 1."""
    targets = torch.arange(facts.scored.shape[1])[None].expand_as(facts.scored)
    return targets.masked_fill(~facts.scored, -1).max(1).values + 2
