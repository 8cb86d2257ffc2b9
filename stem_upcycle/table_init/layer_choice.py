"""`--layers auto:FRACTION`: convert the layers whose conversion alone costs the least.

Every layer is calibrated (the chosen calibrated init), then each is converted alone in the dense
model, by a forward hook that swaps its MLP output for down(act(gate(x)) * U[ids]), and the
perplexity on windows of the calibration text that the calibration left out (spread over it, so
that a mix of the user's and generated text is scored on both) is compared with the dense model's:
scored on the windows its rows were fitted to, a layer would look better than it is on new text. The layers with the
smallest ratio are converted. Single layers differ widely (SmolLM2-135M: layer 15 alone costs
~1.1x, layer 29 ~2.8x), and where they sit in the stack is not what decides it.
"""

import dataclasses
import re
import sys

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..evaluate import evaluate
from ..families import Family, layer_name
from ..layers import LayerSpecError, parse_layers
from ..loading import model_from_source
from ..modeling.modeling_stem import StemMLP
from ..modeling.forward_ids import IdHandoff
from . import INITIALISERS
from .closed_form import mlp_projections
from .protocol import InitOptions, InitTarget

AUTO = re.compile(r"auto\s*:\s*(\d+\s*/\s*\d+)")
MEASURE_WINDOWS = 8  # windows of the calibration text, left out of it, each layer is scored on


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
    """(layers, calibrated init covering every layer, {layer: perplexity ratio converted alone}) for
    `auto:FRACTION`."""
    count = len(parse_layers(auto_fraction(spec), config.num_hidden_layers))
    check_auto(spec, init)
    model = options.dense_model or model_from_source(source)
    every = list(range(config.num_hidden_layers))
    options = dataclasses.replace(options, dense_model=model, scoring_windows=MEASURE_WINDOWS)
    calibrated = INITIALISERS[init](InitTarget(source, family, config, every), options, progress=progress)
    costs = measure_costs(model, calibrated, family, config, calibrated.scoring_windows)
    chosen = sorted(sorted(every, key=costs.__getitem__)[:count])
    ranked = ", ".join(f"{i}: {costs[i]:.3f}x" for i in sorted(every, key=costs.__getitem__))
    print(f"layer sensitivity (perplexity ratio when converted alone): {ranked}\nchosen: {chosen}", file=sys.stderr)
    return chosen, calibrated, costs


def measure_costs(model, calibrated, family: Family, config, windows: torch.Tensor) -> dict[int, float]:
    """Per layer, the perplexity ratio on `windows` [n, seq] with only that layer converted."""
    dense = perplexity_with(model, calibrated, family, config, [], windows)
    return {layer: perplexity_with(model, calibrated, family, config, [layer], windows) / dense
            for layer in range(config.num_hidden_layers)}


@torch.no_grad()
def perplexity_with(model, calibrated, family: Family, config, layers: list[int], windows: torch.Tensor) -> float:
    """Perplexity of the dense `model` on `windows` [n, seq] with `layers` converted (calibrated rows):
    a forward hook makes each such layer's MLP return a STEM MLP's output on the same input."""
    token_ids = IdHandoff()
    device = model.device  # scored where the model is (a GPU with `convert --device`)
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
    first = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))  # each window starts a text
    try:
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
