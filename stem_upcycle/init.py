"""Table initialisers: how the rows of a new STEM table are computed.

An initialiser is built from the opened source and answers, per STEM layer, a function that fills
rows [start, stop) of that layer's table into a given buffer. Conversion streams those rows to disk
chunk by chunk, so an initialiser never returns a whole table. Register new ones in INITIALISERS.
"""

from typing import Callable, Protocol

import torch

from .families import EMBEDDING, Family, embed_multiplier, layer_name
from .source import Source

RowsFn = Callable[[int, int, torch.Tensor], None]  # (start, stop, out: fp32 [stop - start, d_ff])


class TableInit(Protocol):
    name: str
    description: str

    def table_rows(self, layer: int) -> RowsFn: ...


def up_projection(source: Source, family: Family, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's dense W_up [d_ff, d] and its bias, splitting Phi-3's fused gate_up."""
    tensors = source.tensors
    if family.fused_gate_up:
        fused = tensors.get(layer_name(layer, family.fused_gate_up + ".weight"))
        d_ff = fused.shape[0] // 2
        return fused[d_ff:], None  # gate rows come first
    bias_name = layer_name(layer, family.up + ".bias")
    bias = tensors.get(bias_name) if bias_name in tensors else None
    return tensors.get(layer_name(layer, family.up + ".weight")), bias


class ClosedFormInit:
    """U_l[v] = W_up_l · norm_l(scale · E[v]): the up-projection of what layer l's MLP would see at
    token v if attention had added nothing to the residual stream. Data-free, exact for layer 0 of
    a model whose first attention outputs zero, and far from the truth in later layers: on its own
    it breaks a model; calibration and recovery training are needed."""

    name = "closed-form"
    description = "closed form W_up · norm(E[v]) (data-free; needs recovery training)"

    def __init__(self, source: Source, family: Family):
        self.source, self.family = source, family
        self.embedding = source.tensors.get(EMBEDDING)  # [vocab, d], kept in its stored dtype
        self.scale = embed_multiplier(family, source.config)
        self.eps = float(getattr(source.config, "rms_norm_eps", 1e-6))

    def table_rows(self, layer: int) -> RowsFn:
        up, bias = up_projection(self.source, self.family, layer)
        up_t = up.float().t().contiguous()  # [d, d_ff]
        bias = None if bias is None else bias.float()
        norm = None
        if self.family.pre_mlp_norm:
            norm = self.source.tensors.get(layer_name(layer, self.family.pre_mlp_norm + ".weight")).float()
            norm = norm + self.family.norm_offset

        def fill(start: int, stop: int, out: torch.Tensor) -> None:
            x = self.embedding[start:stop].float() * self.scale  # [rows, d]
            if norm is not None:  # RMSNorm in fp32, as the families compute it
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * norm
            torch.mm(x, up_t, out=out)  # [rows, d_ff], fp32
            if bias is not None:
                out += bias

        return fill


INITIALISERS = {ClosedFormInit.name: ClosedFormInit}
