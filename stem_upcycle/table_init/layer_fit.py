"""Each STEM layer fitted to its parent, layer after layer, before any end-to-end training (`FitOptions`).

`calib` gives a token the mean of its up-projections over the calibration text, every layer on the
dense model's own MLP inputs. A fit walks the STEM layers in forward order instead, carrying the
calibration windows' residual stream from one to the next (about one forward of the model in all),
and at each layer:

1. calibrates its rows on its MLP inputs in the model whose earlier STEM layers are already fitted
   (`sequential`; else on the dense model's inputs, as `calib`): GPTQ's and SVD-LLM's rule, so that a
   layer is fitted to the inputs it will see, not to ones its predecessors no longer produce;
2. refits W_down by ridge least squares so that the STEM MLP's output matches the parent MLP's output on
   the same inputs (`refit_down`: the ridge, towards the parent's W_down): one [d_ff, d_ff] solve;
3. trains rows, gate and down (and up_rest, where a layer keeps some neurons dense: `--columns`) on the squared
   error to the parent MLP's output (`epochs` passes over the windows; the local stage of LoLCATs and
   LLM-Streamline): one MLP forward and backward per token.

Then the stream moves on through the fitted layer. The windows' first positions keep the dense
up-projection (`stem_dense_first_token`) and are fitted with it. Several processes share the windows
(`InitOptions.shard`): each carries its own windows' stream; the sums, Gram matrices and gradients are
summed across them.
"""

import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ..families import STEM_GATE, STEM_UP_REST, Family, layer_name
from ..modeling.forward_ids import IdHandoff
from ..modeling.modeling_stem import StemMLP
from .protocol import FitOptions

WINDOWS_PER_FORWARD = 8  # windows read at once while the stream is carried, and per chunk of the sums


class _Captured(Exception):
    """Raised at the MLP of the layer being fitted: the rest of the forward is not needed."""


class FittedRows(nn.Module):
    """A STEM MLP's row source while it is fitted: trainable rows [n, k] of the sorted ids `ids`."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor):
        super().__init__()
        self.register_buffer("ids", ids)
        self.rows = nn.Embedding.from_pretrained(rows.float(), freeze=False, sparse=True)  # sparse: SparseAdam

    def forward(self, forward, device, dtype) -> torch.Tensor:
        index = torch.searchsorted(self.ids, forward.ids.to(self.ids.device).contiguous()).clamp_max(len(self.ids) - 1)
        return self.rows(index).to(device, dtype)  # [batch, seq, k]


@dataclass
class LayerReport:
    """A fitted layer's relative error |STEM MLP - parent MLP|^2 / |parent MLP|^2 on the windows after each stage."""

    calibrated: float
    refit: float | None = None
    trained: float | None = None
    kept: bool = True  # whether the local training's result was kept (it is not where it raised the error)
    seconds: dict = field(default_factory=dict)  # stream, calibrate, refit, train


def fp32_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A trainable fp32 nn.Linear holding copies of `weight` [out, in] and `bias` (the parent's stay as they are)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
        if bias is not None:
            linear.bias.copy_(bias.float())
    return linear


class LayerFitter:
    """Fits `layers` of the dense `model` one after another on `windows` [n, seq] (this process's share of them).

    `calibrate(layer, inputs, windows) -> rows [len(seen), k]` gives a layer's calibrated rows from its MLP
    inputs [n, seq, d]; `dense(layer) -> {"gate", "up", "up_rest", "down"}` (and their "..._bias") its parent's MLP
    weights in the STEM MLP's order (`stem_projections`); `reduce` sums a tensor across processes (None: one)."""

    def __init__(self, model, family: Family, config, windows: torch.Tensor, seen: torch.Tensor, options: FitOptions,
                 activation, dense, reduce=None, steps_per_epoch: int | None = None, progress: bool = False):
        self.model, self.family, self.config, self.options = model, family, config, options
        self.activation, self.dense, self.reduce, self.progress = activation, dense, reduce, progress
        self.device = model.device
        self.windows, self.seen = windows.to(self.device), seen.to(self.device)
        per_batch = max(1, options.batch_tokens // windows.shape[1])
        # the same number of steps in every process (their shares differ by a window at most)
        self.per_batch, self.batches = per_batch, steps_per_epoch or math.ceil(len(windows) / per_batch)
        self.token_ids = IdHandoff()
        self.fitted: dict[int, StemMLP] = {}

    def run(self, layers: list[int], calibrate) -> tuple[dict[int, StemMLP], dict[int, LayerReport]]:
        stream, start, reports = None, 0, {}
        for layer in sorted(layers):
            began = time.perf_counter()
            stream, inputs = self.advance(stream, start, layer)  # the stream entering `layer`, its MLP's input
            seconds = {"stream": time.perf_counter() - began}
            began = time.perf_counter()
            mlp = self.stem_mlp(layer, calibrate(layer, inputs, self.windows))
            targets = self.targets(layer, inputs)
            seconds["calibrate"] = time.perf_counter() - began
            report = LayerReport(self.relative_error(mlp, inputs, targets), seconds=seconds)
            if self.options.refit_down:
                began = time.perf_counter()
                self.refit_down(mlp, inputs, targets)
                report.refit, seconds["refit"] = self.relative_error(mlp, inputs, targets), time.perf_counter() - began
            if self.options.epochs:
                began = time.perf_counter()
                before = {k: v.clone() for k, v in mlp.state_dict().items()}
                self.train(mlp, inputs, targets)
                report.trained, seconds["train"] = self.relative_error(mlp, inputs, targets), time.perf_counter() - began
                if report.trained >= (report.refit or report.calibrated):  # too high a learning rate: kept as it was
                    mlp.load_state_dict(before)
                    report.kept = False
            self.fitted[layer] = mlp.requires_grad_(False)
            reports[layer] = report
            if self.progress:
                print(f"fit layer {layer}: relative error {describe(report)}", file=sys.stderr)
            start = layer  # the stream goes on from here: through this layer fitted with `sequential`, else dense
            del inputs, targets
        return self.fitted, reports

    # -- the residual stream -------------------------------------------------------------------
    @contextmanager
    def _layers(self, start: int, stop: int):
        """The model's decoder layers cut to [start, stop] for the forwards inside; with `sequential`, fitted
        layers among them return their STEM MLP's output."""
        base = self.model.base_model
        every = base.layers
        fitted = [i for i in self.fitted if start <= i <= stop] if self.options.sequential else []
        hooks = [every[i].mlp.register_forward_hook(self._fitted_output(self.fitted[i])) for i in fitted]
        base.layers = nn.ModuleList(list(every)[start : stop + 1])
        # Models with layers of several kinds (Gemma 2's sliding and full attention) pick a layer's mask by its
        # position in the loop, config.layer_types[i]: the list is cut with the layers.
        types = getattr(base.config, "layer_types", None)
        if types is not None:
            base.config.layer_types = types[start : stop + 1]
        try:
            yield base.layers[0]
        finally:
            base.layers = every
            if types is not None:
                base.config.layer_types = types
            for hook in hooks:
                hook.remove()

    @staticmethod
    def _fitted_output(mlp: StemMLP):
        return lambda module, args, output: mlp(args[0].float()).to(output.dtype)

    def _start(self, windows: torch.Tensor) -> None:
        """Hand a forward's ids to the STEM MLPs; each window's first position is a sequence's first token."""
        first = torch.arange(len(windows), device=windows.device)
        self.token_ids.start(windows, first=(first, torch.zeros_like(first)))

    @torch.no_grad()
    def advance(self, stream: torch.Tensor | None, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stream entering layer `stop` [n, seq, d], the input of its MLP [n, seq, d] in fp32) from `stream`,
        the stream entering layer `start` (None: the embeddings, and `start` is 0).

        The model runs whole (its masks and position embeddings are its own) with its decoder layers cut to
        [start, stop]: the first of them reads `stream` in place of the embeddings, and the forward ends at
        layer `stop`'s MLP."""
        entering, inputs, carried = [], [], {}
        layers = self.model.base_model.layers

        def carry(module, args, kwargs):
            if carried["stream"] is None:
                return None
            if args:
                return (carried["stream"], *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": carried["stream"]}

        def enter(module, args, kwargs):
            entering.append(args[0] if args else kwargs["hidden_states"])

        def capture(module, args):
            inputs.append(args[0].float())
            raise _Captured

        with self._layers(start, stop) as first:
            hooks = [first.register_forward_pre_hook(carry, with_kwargs=True),
                     layers[stop].register_forward_pre_hook(enter, with_kwargs=True),
                     layers[stop].mlp.register_forward_pre_hook(capture)]
            try:
                batches = range(0, len(self.windows), WINDOWS_PER_FORWARD)
                for i in tqdm(batches, desc=f"fit: inputs of layer {stop}", unit="batch", leave=False,
                              disable=not self.progress, file=sys.stderr):
                    batch = self.windows[i : i + WINDOWS_PER_FORWARD]
                    carried["stream"] = None if stream is None else stream[i : i + WINDOWS_PER_FORWARD]
                    self._start(batch)
                    try:
                        self.model(batch, use_cache=False)
                    except _Captured:
                        pass
            finally:
                for hook in hooks:
                    hook.remove()
        return torch.cat(entering), torch.cat(inputs)

    # -- one layer -----------------------------------------------------------------------------
    def stem_mlp(self, layer: int, rows: torch.Tensor) -> StemMLP:
        """`layer`'s STEM MLP to fit: trainable fp32 copies of the parent's gate, down and up_rest (the up-projection
        of the neurons that are no table columns), the calibrated rows, and the parent's W_up of the table columns
        (frozen) for the windows' first positions; in the STEM MLP's order of the neurons (`dense`'s)."""
        w = self.dense(layer)
        up = fp32_linear(w["up"], w["up_bias"]).requires_grad_(False) if self.config.stem_dense_first_token else None
        rest = fp32_linear(w["up_rest"], w["up_rest_bias"]) if w.get("up_rest") is not None else None
        return StemMLP(fp32_linear(w["gate"], w["gate_bias"]), fp32_linear(w["down"], w["down_bias"]), self.activation,
                       FittedRows(self.seen, rows.to(self.device)), self.token_ids, layer, up, rest)

    @torch.no_grad()
    def targets(self, layer: int, inputs: torch.Tensor) -> torch.Tensor:
        """The parent MLP's output on `inputs` [n, seq, d], fp32 (the parent's own module, in its dtype)."""
        mlp = self.model.base_model.layers[layer].mlp
        dtype = next(mlp.parameters()).dtype
        return torch.cat([mlp(x.to(dtype)).float() for x in inputs.split(WINDOWS_PER_FORWARD)])

    def _batches(self, *tensors: torch.Tensor):
        """The windows and `tensors` [n, ...] in chunks of WINDOWS_PER_FORWARD windows, the chunk's ids handed over."""
        for i in range(0, len(self.windows), WINDOWS_PER_FORWARD):
            self._start(self.windows[i : i + WINDOWS_PER_FORWARD])
            yield [t[i : i + WINDOWS_PER_FORWARD] for t in tensors]

    @torch.no_grad()
    def refit_down(self, mlp: StemMLP, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """W_down (and its bias) := argmin |W h - y|^2 + r |W - W_down|^2 over every window's tokens, h = act(gate x)
        * up, y the parent MLP's output, r = refit_down x the mean diagonal of the Gram matrix of h."""
        down = mlp.down_proj
        bias = down.bias is not None
        width = down.in_features + bias
        gram = torch.zeros(width, width, dtype=torch.float64, device=self.device)
        cross = torch.zeros(width, down.out_features, dtype=torch.float64, device=self.device)
        for x, y in self._batches(inputs, targets):
            h = (mlp.act_fn(mlp.gate_proj(x)) * mlp.up(x)).flatten(0, 1)  # [tokens, d_ff]
            if bias:
                h = torch.cat([h, torch.ones_like(h[:, :1])], 1)
            # a chunk's products in fp32 (a few thousand tokens each), summed in fp64: 3x faster than fp64 products
            gram += (h.T @ h).double()
            cross += (h.T @ y.flatten(0, 1)).double()
        if self.reduce is not None:
            gram, cross = self.reduce(gram), self.reduce(cross)
        prior = down.weight.T.double()  # [d_ff, d]
        if bias:
            prior = torch.cat([prior, down.bias.double()[None]])
        ridge = self.options.refit_down * gram.diagonal().mean()
        solved = torch.linalg.solve(gram + ridge * torch.eye(width, dtype=gram.dtype, device=gram.device),
                                    cross + ridge * prior)  # [width, d]
        down.weight.copy_(solved[: down.in_features].T)
        if bias:
            down.bias.copy_(solved[-1])

    def train(self, mlp: StemMLP, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """`epochs` passes of Adam (gate, down, up_rest) and sparse Adam (rows), cosine-decayed from their peaks, on
        the squared error to `targets` relative to their mean square."""
        o = self.options
        dense = [p for m in (mlp.gate_proj, mlp.down_proj, mlp.up_rest) if m is not None for p in m.parameters()]
        optimizers = [(torch.optim.Adam(dense, lr=o.lr), o.lr),
                      (torch.optim.SparseAdam(list(mlp.up_table.parameters()), lr=o.row_lr), o.row_lr)]
        scale = targets.pow(2).mean()
        world = 1
        if self.reduce is not None:
            world = int(self.reduce(torch.ones((), device=self.device)).item())
            scale = self.reduce(scale) / world
        total = o.epochs * self.batches
        generator = torch.Generator().manual_seed(len(self.fitted))
        with torch.enable_grad():
            for step in range(total):
                if step % self.batches == 0:
                    order = torch.randperm(len(self.windows), generator=generator).to(self.device)
                pick = order[(step % self.batches) * self.per_batch :][: self.per_batch]
                self._start(self.windows[pick])
                loss = (mlp(inputs[pick]) - targets[pick]).pow(2).mean() / scale
                for optimizer, _ in optimizers:
                    optimizer.zero_grad()
                loss.backward()
                if world > 1:
                    self._average_gradients(mlp, dense, world)
                decay = 0.5 * (1 + math.cos(math.pi * step / total))
                for optimizer, peak in optimizers:
                    for group in optimizer.param_groups:
                        group["lr"] = peak * decay
                    optimizer.step()

    def _average_gradients(self, mlp: StemMLP, dense: list[torch.Tensor], world: int) -> None:
        for p in dense:
            p.grad = self.reduce(p.grad) / world
        rows = mlp.up_table.rows.weight
        # sparse gradients do not all-reduce: the dense [n, k] sum, zero outside every process's batch rows
        rows.grad = (self.reduce(rows.grad.to_dense()) / world).to_sparse()

    @torch.no_grad()
    def relative_error(self, mlp: StemMLP, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """|STEM MLP - parent MLP|^2 / |parent MLP|^2 over the windows of every process."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for x, y in self._batches(inputs, targets):
            sums += torch.stack([(mlp(x) - y).pow(2).sum(), y.pow(2).sum()]).double()
        if self.reduce is not None:
            sums = self.reduce(sums)
        return (sums[0] / sums[1]).item()


def describe(report: LayerReport) -> str:
    trained = "trained" if report.kept else "trained (worse: not kept)"
    stages = [("calibrated", report.calibrated), ("refit", report.refit), (trained, report.trained)]
    return ", ".join(f"{value:.4f} {name}" for name, value in stages if value is not None)


def fitted_weights(mlps: dict[int, StemMLP], family: Family) -> dict[str, torch.Tensor]:
    """{output tensor name: fp32 tensor on the CPU} of the fitted layers' gate, down and up_rest projections."""
    weights = {}
    for layer, mlp in mlps.items():
        parts = [(mlp.gate_proj, STEM_GATE), (mlp.down_proj, family.down), (mlp.up_rest, STEM_UP_REST)]
        for module, prefix in [(m, prefix) for m, prefix in parts if m is not None]:
            for kind, tensor in (("weight", module.weight), ("bias", module.bias)):
                if tensor is not None:
                    name = layer_name(layer, f"{prefix}.{kind}")
                    weights[name] = tensor.detach().cpu()
    return weights


def fit_record(options: FitOptions, reports: dict[int, LayerReport]) -> dict:
    """`config.stem_fit`: the stages a conversion ran and each layer's relative error after each of them."""
    return {**asdict(options),
            "relative_error": {str(layer): {k: v for k, v in asdict(r).items()
                                            if k not in ("seconds", "kept") and v is not None}
                               for layer, r in reports.items()},
            "training_not_kept": [layer for layer, r in reports.items() if not r.kept],
            "seconds": {k: round(sum(r.seconds.get(k, 0.0) for r in reports.values()), 1)
                        for k in ("stream", "calibrate", "refit", "train")}}


def describe_options(options: FitOptions) -> str:
    """One line for the plan: the stages of a fit."""
    stages = ["rows calibrated " + ("layer after layer on the fitted layers' outputs" if options.sequential
                                    else "on the dense model's inputs")]
    if options.refit_down:
        stages.append(f"W_down refit to the parent's outputs (ridge {options.refit_down:g})")
    if options.epochs:
        stages.append(f"{options.epochs} epoch(s) of local training (lr {options.lr:g}, rows {options.row_lr:g})")
    return "; ".join(stages)
