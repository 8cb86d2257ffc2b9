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

WINDOWS_PER_FORWARD = 8  # scoring windows read at once


class _Stop(Exception):
    """Raised after the last scored layer: the rest of the forward is not needed."""


@torch.no_grad()
def column_costs(model, calibrated, family: Family, config, layers: list[int], windows: torch.Tensor
                 ) -> dict[int, torch.Tensor]:
    """{layer: [d_ff] each neuron's cost} of the dense `model` on `windows` [n, seq] (kept out of the calibration
    `calibrated`, whose `rows_for` gives the rows the conversion would write), every layer of `layers` in one pass."""
    device = model.device
    tensors = calibrated.source.tensors
    activation = ACT2FN[config.stem_activation]
    skip = skipped_positions(config)  # a dense first token reads no row
    sums = {layer: torch.zeros(config.intermediate_size, dtype=torch.float64, device=device) for layer in layers}
    current, counted = {}, [0]

    def scorer(layer: int):
        @in_fp32
        def hook(module, args):
            x = args[0][:, skip:].float().flatten(0, 1)  # [tokens, d]
            # one layer's weights in fp32 at a time (a bf16 source's every layer at once would be a copy of them all)
            w = {k: None if v is None else v.to(device, torch.float32)
                 for k, v in mlp_projections(tensors, family, layer).items()}
            gate = activation(torch.nn.functional.linear(x, w["gate"], w["gate_bias"]))  # [tokens, d_ff]
            up = torch.nn.functional.linear(x, w["up"], w["up_bias"])
            rows = calibrated.rows_for(layer, current["unique"]).to(device)[current["inverse"]]  # [tokens, d_ff]
            sums[layer] += (gate * (up - rows)).square().sum(0, dtype=torch.float64)
            if layer == layers[-1]:
                raise _Stop
        return hook

    calibrated.read_ahead(windows[:, skip:].unique())  # rows the hooks ask for, read before the model runs them
    hooks = [model.base_model.layers[layer].mlp.register_forward_pre_hook(scorer(layer)) for layer in layers]
    try:
        for batch in windows.split(WINDOWS_PER_FORWARD):
            unique, inverse = batch[:, skip:].flatten().unique(return_inverse=True)
            current.update(unique=unique, inverse=inverse.to(device))
            counted[0] += inverse.numel()
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
        costs[layer] = (down.square().sum(0) * sums[layer].cpu() / counted[0]).float()
    return costs
