"""`closed-form`: table rows from the dense weights alone, and the dense MLP projections every init reads."""

from typing import Mapping

import torch

from ..families import EMBEDDING, Family, embed_multiplier, layer_name
from ..neurons import NeuronSplit, split_projections
from ..source import TensorStore
from .protocol import InitOptions, InitTarget, RowsFn


def mlp_projections(tensors: TensorStore | Mapping[str, torch.Tensor], family: Family,
                    layer: int) -> dict[str, torch.Tensor | None]:
    """The layer's dense gate and up weights [d_ff, d] and biases; Phi-3's fused gate_up is split.

    `tensors`: a source's lazy store, or a loaded model's state dict (the same checkpoint names)."""
    if family.fused_gate_up:
        fused = tensors.get(layer_name(layer, family.fused_gate_up + ".weight"))
        d_ff = fused.shape[0] // 2
        return {"gate": fused[:d_ff], "gate_bias": None, "up": fused[d_ff:], "up_bias": None}  # gate rows first

    def get(name):
        return tensors.get(name) if name in tensors else None

    return {
        "gate": get(layer_name(layer, family.gate + ".weight")),
        "gate_bias": get(layer_name(layer, family.gate + ".bias")),
        "up": get(layer_name(layer, family.up + ".weight")),
        "up_bias": get(layer_name(layer, family.up + ".bias")),
    }


def stem_projections(tensors: TensorStore | Mapping[str, torch.Tensor], family: Family, layer: int,
                     split: NeuronSplit | None, down: bool = False) -> dict[str, torch.Tensor | None]:
    """The layer's MLP weights in the STEM MLP's order (`split_projections`): gate, "up" of the table columns,
    "up_rest" of the others, biases; with `down`, the down-projection (and bias) too."""
    weights = mlp_projections(tensors, family, layer)
    if down:
        name = layer_name(layer, family.down)
        weights["down"] = tensors.get(name + ".weight")
        weights["down_bias"] = tensors.get(name + ".bias") if name + ".bias" in tensors else None
    return split_projections(weights, split)


class ClosedFormInit:
    """U_l[v] = W_up_l · norm_l(scale · E[v]): the up-projection of what layer l's MLP would see at
    token v if attention had added nothing to the residual stream. Data-free, exact for layer 0 of
    a model whose first attention outputs zero, and far from the truth in later layers: on its own
    it breaks a model; calibration and recovery training are needed."""

    name = "closed-form"
    description = "closed form W_up · norm(E[v]) (data-free; needs recovery training)"

    needs_data = False

    def __init__(self, target: InitTarget, options: InitOptions | None = None, progress: bool = False):
        self.source, self.family = target.source, target.family
        self.embedding = self.source.tensors.get(EMBEDDING)  # [vocab, d], kept in its stored dtype
        self.scale = embed_multiplier(self.family, self.source.config)
        self.eps = float(getattr(self.source.config, "rms_norm_eps", 1e-6))
        self.dense_weights = {}  # the parent's dense tensors are written as they are
        self.columns = target.columns  # layer -> NeuronSplit: its table's columns are those neurons

    def mlp_inputs(self, layer: int, embeddings: torch.Tensor) -> torch.Tensor:
        """norm_l(scale * E[v]) in fp32 for rows E[v]: layer l's MLP input if attention added nothing."""
        x = embeddings.float() * self.scale  # [rows, d]
        if self.family.pre_mlp_norm:  # RMSNorm in fp32, as the families compute it
            norm = self.source.tensors.get(layer_name(layer, self.family.pre_mlp_norm + ".weight")).float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (norm + self.family.norm_offset)
        return x

    def table_rows(self, layer: int) -> RowsFn:
        weights = stem_projections(self.source.tensors, self.family, layer, self.columns.get(layer))
        up_t = weights["up"].float().t().contiguous()  # [d, k]: the table columns' up-projection
        bias = None if weights["up_bias"] is None else weights["up_bias"].float()

        def fill(start: int, stop: int, out: torch.Tensor) -> None:
            torch.mm(self.mlp_inputs(layer, self.embedding[start:stop]), up_t, out=out)  # [rows, k], fp32
            if bias is not None:
                out += bias

        return fill
