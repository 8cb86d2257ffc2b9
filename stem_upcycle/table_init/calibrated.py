"""Calibrated table initialisation: the dense model's own up-projections, averaged per token.

The dense model reads a calibration corpus; at every STEM layer and every position, the MLP input
x gives the up-projection u = W_up x and the gate s = act(W_gate x). A token's calibrated mean is
the gate-weighted mean sum s^2 * u / sum s^2 (elementwise), which minimises the error of s * U against
s * u before the down-projection (`calib`), or the plain mean of u (`calib-mean`).

One estimate per row weighs that mean by its evidence: the parent reads every vocabulary token after
contexts of the same text (parent_rows.py), and a token the calibration shows n times gets
(n * mean + k * parent row) / (n + k) (`InitOptions.shrink`, k): its calibrated mean where the text has
seen it often, its parent row where it has seen it once or never. Empirical Bayes' shrinkage, the
parent's own reading of the token as the prior. With no parent rows (`parent.contexts` 0), tokens the
corpus never shows get a row from a ridge fit, per layer, of the calibrated rows on the closed-form
inputs norm_l(E[v]) of the tokens that were seen, and seen tokens their mean.

Accumulators hold one row per distinct calibration token and layer; when they exceed the memory
budget the layers are calibrated in groups, one pass over the corpus per group. The dense model
reads the corpus where it is (a GPU if the caller put it there), in its dtype; the accumulators
are fp32. Several processes can share the work (`InitOptions.shard = (rank, world, reduce)`):
each reads every world-th window and the accumulators are summed across them by `reduce`; the
parent rows are read by the first process alone.
"""

import copy
import functools
import math
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.activations import ACT2FN

from ..errors import UserError
from ..evaluate import read_token_ids
from ..loading import fast_dtype, load_tokenizer, model_from_source
from ..modeling.modeling_stem import fit_ridge
from .closed_form import ClosedFormInit, stem_projections
from .layer_fit import LayerFitter, fitted_weights
from .parent_rows import ContextSets, ParentPrior, ParentReader, cut_contexts
from ..stages import stage
from .mlp_inputs import MlpInputs, layer_groups
from .protocol import InitOptions, InitTarget, RowsFn

# Tokens of the parent's own text a calibrating `convert` samples when given no text (generate.py): its contexts, the
# windows a neuron choice scores on, the means shrunk toward the parent rows. SmolLM2-135M, a sixth of every layer's
# neurons, conversion only (issue 53): 64k sampled tokens give 1.21x-1.38x the parent on seven genres, as good as 16k
# of plays with 48k sampled on the six genres other than plays; 100 s to sample on 2 AMX cores in bf16.
DEFAULT_GENERATED = 65536
CALIBRATION_NEEDS_TOKENIZER = ("--init calib reads text with it (--calib-data, or the text sampled from the model): "
                               "add the model's tokenizer files, or convert with --init closed-form (no text)")
CALIB_WINDOWS = 8  # windows of MLP inputs added to the sums at once


class CalibrationError(UserError):
    pass


def shrink(means: torch.Tensor, prior: torch.Tensor, counts: torch.Tensor, k: float) -> torch.Tensor:
    """(n mean + k prior) / (n + k) per row: `means` [m, c] over `counts` [m] positions each, `prior` [m, c]."""
    n = counts.to(means.dtype)[:, None]
    return (n * means + k * prior) / (n + k)


def in_dtype(model, dtype: str):
    """`model` computing in `dtype` (a name, or auto: `loading.fast_dtype` of its device): itself, or a copy."""
    wanted = fast_dtype(model.device) if dtype == "auto" else getattr(torch, dtype)
    return model if next(model.parameters()).dtype == wanted else copy.deepcopy(model).to(wanted)


def calibration_windows(source, options: InitOptions) -> torch.Tensor:
    """[n, seq_len] token ids: the calibration text's, then those of `calib_generated` (ids sampled from the
    dense model itself, see generate.py), together at most `calib_tokens`; a tail that fills no window is dropped.
    Each entry of `calib_data` (a file, or a list of files: a genre) gives an equal share of the text's tokens, read
    from its start, so that a mix of genres is calibrated on all of them."""
    seq_len = options.calib_seq_len
    generated = options.calib_generated
    generated = torch.zeros(0, dtype=torch.long) if generated is None else generated.flatten().long()
    total = options.calib_tokens
    text_budget = None if total is None else max(0, total - generated.numel())
    parts = [generated[:total]]
    groups = [[entry] if isinstance(entry, (str, Path)) else list(entry) for entry in options.calib_data]
    if groups and text_budget != 0:
        tokenizer = load_tokenizer(source, CALIBRATION_NEEDS_TOKENIZER)
        share = None if text_budget is None else max(1, text_budget // len(groups))
        parts[:0] = [read_token_ids(group, tokenizer, share, options.text_field) for group in groups]
    ids = torch.cat(parts)
    if ids.numel() < seq_len:
        raise CalibrationError(f"the calibration text has {ids.numel()} tokens, fewer than --calib-seq-len {seq_len}")
    return ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)


def skipped_positions(config) -> int:
    """Positions at the start of each window whose up-projections calibrate no row: the first token's, where it
    keeps the dense up-projection (StemMLP): its rows never serve it, and its hidden states (its id's alone, the
    attention sink) are no context of the token's other uses. None for a dense model (a fine-tuned baseline)."""
    return 1 if getattr(config, "stem_dense_first_token", False) else 0


def calibrated_ids(windows: torch.Tensor, config) -> torch.Tensor:
    """The sorted distinct ids whose rows `windows` [n, seq_len] calibrate."""
    return windows[:, skipped_positions(config):].unique()


def calibrated_counts(windows: torch.Tensor, config, seen: torch.Tensor) -> torch.Tensor:
    """[len(seen)] float: how many positions of `windows` calibrate each id of `seen` (sorted)."""
    return torch.bincount(torch.searchsorted(seen, windows[:, skipped_positions(config):].flatten()),
                          minlength=seen.numel()).float()


def in_fp32(fn):
    """`fn` computing in fp32 whatever autocast its caller runs: a multi-process `train` converts inside
    `accelerator.autocast()` (bf16), for the teacher's forward; the sums, fits and rows of the tables stay fp32.
    (torch.amp.custom_fwd does this for autograd Functions of one device type only.)"""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return run


def reading_model(model, options: InitOptions):
    """The dense model as it reads text without gradients (the calibration's inputs, the parent's rows, a choice's
    scores), in `parent.dtype` (auto: bf16 where native, 5x fp32's tokens/s on 2 AMX cores; a fit trains in fp32):
    the one a caller made already (`options.reading_model`), or a copy."""
    return options.reading_model or in_dtype(model, options.parent.dtype)


@in_fp32
def accumulate(num, den, x, index, weights, activation, gate_weighted: bool, dtype: torch.dtype = torch.float32):
    """Add the MLP inputs x [..., d] at rows `index` [...] of the sums: num += w * W_up x, den += w (w: the squared
    gate, or 1), over the columns of `weights` ("up" [k, d], "gate" [>= k, d] and biases: its first k rows),
    projected in `dtype` (fp32: the rows; the model's own bf16 where a neuron choice sums every column)."""
    x = x.reshape(-1, x.shape[-1]).to(num.device, dtype)  # [tokens, d]
    index = index.reshape(-1).to(num.device)
    up = torch.nn.functional.linear(x, weights["up"].to(dtype), _cast(weights["up_bias"], dtype)).float()  # [tokens, k]
    if gate_weighted:
        k = up.shape[-1]
        bias = None if weights["gate_bias"] is None else weights["gate_bias"][:k]
        w = activation(torch.nn.functional.linear(x, weights["gate"][:k].to(dtype), _cast(bias, dtype)).float()).square()
    else:
        w = torch.ones_like(up)
    num.index_add_(0, index, w * up)
    den.index_add_(0, index, w)


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def token_sums(inputs: MlpInputs, layer: int, windows: torch.Tensor, compact: torch.Tensor, rows: int, weights: dict,
               activation, skip: int, gate_weighted: bool, dtype: torch.dtype = torch.float32):
    """(num, den) [rows, k] fp32 where `weights` lie: `accumulate` over `layer`'s MLP inputs at the positions of
    `windows` (indices into `inputs.windows`, `skip` first positions of each left out) whose token has a row,
    `compact[id]` (-1: none)."""
    device = weights["up"].device
    k = weights["up"].shape[0]
    num, den = torch.zeros(rows, k, device=device), torch.zeros(rows, k, device=device)
    x_all = inputs.layer(layer)
    for group in windows.split(CALIB_WINDOWS):
        index = compact[inputs.windows[group][:, skip:]]  # [g, seq - skip]
        kept = index >= 0
        accumulate(num, den, x_all[group][:, skip:][kept], index[kept], weights, activation, gate_weighted, dtype)
    return num, den


@in_fp32
def fit_projection(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The ridge fit x -> y as one matrix [d + 1, d_out], the last row the intercept (`torch.addmm(p[-1], x, p[:-1])`)."""
    weight, bias = fit_ridge(x, y)
    return torch.cat([weight, bias[None]])


class CalibratedInit(ClosedFormInit):
    name = "calib"
    description = ("gate-weighted mean of W_up x per token over calibration text, shrunk toward the token's row read "
                   "from the parent after contexts of that text (the row of an unseen token; with no parent rows, a "
                   "ridge fit)")
    gate_weighted = True
    needs_data = True

    def __init__(self, target: InitTarget, options: InitOptions, progress: bool = False):
        super().__init__(target)
        self.progress = progress
        self.fit = options.fit
        self.dense_weights, self.fit_reports = {}, {}
        self.shrink, self.shard = options.shrink, options.shard or (0, 1, None)
        reused = options.calibration  # computed already, for every layer, by --layers auto (or by every process)
        if (isinstance(reused, CalibratedInit) and reused.gate_weighted == self.gate_weighted
                and reused.fit == self.fit and reused.columns == self.columns):
            self.seen, self.counts, self.means, self.projections = reused.seen, reused.counts, reused.means, reused.projections
            self.prior, self.shrink, self.reading_model = reused.prior, reused.shrink, reused.reading_model
            self.dense_weights, self.fit_reports = reused.dense_weights, reused.fit_reports
            return
        self.windows = calibration_windows(self.source, options)
        if scoring := options.scoring_windows:  # kept out of the calibration (--layers auto)
            if len(self.windows) <= 2 * scoring:
                raise CalibrationError(f"choosing what becomes rows (--layers auto:, --columns) scores on {scoring} "
                                       f"windows kept out of the calibration; give more than "
                                       f"{2 * scoring * self.windows.shape[1]} calibration tokens")
            picked = torch.linspace(0, len(self.windows) - 1, scoring).round().long()  # spread over every text
            kept = torch.ones(len(self.windows), dtype=torch.bool)
            kept[picked] = False
            self.scoring_windows, self.windows = self.windows[picked], self.windows[kept]
        self.seen = calibrated_ids(self.windows, target.config)  # sorted ids the corpus calibrates
        self.counts = calibrated_counts(self.windows, target.config, self.seen)
        model = options.dense_model or model_from_source(self.source)
        self.reading_model = reading_model(model, options)
        shard = self.shard
        self.prior = self._parent_prior(target, options) if options.parent.contexts else None
        if self.fit.active:  # layer after layer (layer_fit.py): rows, and the gate and down projections
            with stage("fit", f"{len(target.layers)} layers", not shard[0]):
                self.means = self._fit(target, shard, model)  # shrunk before they are fitted: the rows as they are
        else:  # the calibrated means, shrunk where their rows are read (`_seen_rows`), beside their parent rows
            rank, world, _ = shard
            windows = self.windows[rank::world]  # this process's share of the text
            inputs = options.mlp_inputs  # read already by a neuron choice, on the same windows
            reused = inputs is not None and torch.equal(inputs.windows, windows) and set(target.layers) <= set(inputs.layers)
            dtype = next(self.reading_model.parameters()).dtype
            self.means = {}  # layer -> [n_seen, k]
            for layers in [target.layers] if reused else layer_groups(target.layers, windows.shape,
                                                                       target.config.hidden_size, dtype):
                if not reused:
                    inputs = MlpInputs(self.reading_model, layers, windows, options.scratch_dir,
                                       self.progress and not rank, report=not rank)
                with stage("rows", f"{len(layers)} layers, {self.seen.numel():,} tokens", not rank):
                    self.means |= self._calibrate(target.config, layers, shard, inputs)
            if self.prior is not None and self.prior.read_whole and not rank:
                self.prior.read(self.seen)  # every token's, now: the tables are written after
        self.projections = {} if self.prior is not None else {layer: self._fit_projection(layer) for layer in target.layers}
        vocab = target.config.vocab_size
        rank, world, _ = shard
        if rank:
            return  # the main process reports
        print(
            f"calibration: {self.windows.numel()} tokens, {self.seen.numel()} distinct "
            f"({self.seen.numel() / vocab:.1%} of the vocabulary)" + (f", read by {world} processes" if world > 1 else "")
            + ("; unseen tokens use the ridge fit" if self.prior is None else
               f"; every token's row shrunk toward the parent's (k = {self.shrink:g}), read after "
               f"{options.parent.contexts} contexts of {options.parent.context_length} tokens"),
            file=sys.stderr,
        )
        if options.heldout_data:  # how much of the text to be scored has calibrated rows
            tokenizer = load_tokenizer(self.source)
            shares = {name: torch.isin(read_token_ids(files, tokenizer, options.heldout_tokens,
                                                        options.text_field), self.seen).float().mean().item()
                      for name, files in options.heldout_data.items()}
            print("calibrated rows cover " + ", ".join(f"{share:.1%} of {name}" for name, share in shares.items())
                  + " (held-out tokens)", file=sys.stderr)

    def _fit(self, target: InitTarget, shard, model) -> dict[int, torch.Tensor]:
        """Every STEM layer fitted in turn (layer_fit.LayerFitter): {layer: rows [n_seen, k]}; the fitted gate
        and down projections go to `dense_weights`, each layer's errors to `fit_reports`."""
        rank, world, reduce = shard
        compact = torch.full((target.config.vocab_size,), -1, dtype=torch.long, device=model.device)
        compact[self.seen.to(model.device)] = torch.arange(self.seen.numel(), device=model.device)
        activation = ACT2FN[target.config.stem_activation]
        skip = skipped_positions(target.config)
        projections = {}

        def calibrate(layer: int, inputs: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
            weights = projections[layer] = self._dense_mlp(layer, model.device)
            k = weights["up"].shape[0]  # the table's columns
            num = torch.zeros(self.seen.numel(), k, device=model.device)
            den = torch.zeros_like(num)
            for x, ids in zip(inputs.split(CALIB_WINDOWS), windows.split(CALIB_WINDOWS)):
                accumulate(num, den, x[:, skip:], compact[ids[:, skip:]], weights, activation, self.gate_weighted)
            if reduce is not None:
                num, den = reduce(num), reduce(den)
            return self._shrunk(layer, num / den.clamp_min(1e-12))

        steps = math.ceil(len(self.windows) // world / max(1, self.fit.batch_tokens // self.windows.shape[1]))
        fitter = LayerFitter(model, self.family, target.config, self.windows[rank::world], self.seen, self.fit,
                             activation, lambda layer: projections[layer], reduce, max(1, steps),
                             progress=self.progress and not rank)
        mlps, self.fit_reports = fitter.run(target.layers, calibrate)
        self.dense_weights = fitted_weights(mlps, self.family)
        return {layer: mlp.up_table.rows.weight.detach().cpu() for layer, mlp in mlps.items()}

    def _parent_prior(self, target: InitTarget, options: InitOptions) -> ParentPrior:
        """Every token's parent row for the target's layers and columns, read after contexts of the calibration
        windows: on demand for the tokens a choice scores (`scoring_windows`), else for the whole vocabulary, at
        the first use, into a file in `scratch_dir`."""
        reader = ParentReader(self.reading_model, self.family, target.config.stem_activation, target.layers,
                              cut_contexts(self.windows, options.parent), self.columns, self.gate_weighted,
                              ContextSets(options.parent, target.config.vocab_size))
        widths = {layer: self._width(layer, target.config.intermediate_size) for layer in target.layers}
        stored = torch.float32 if str(target.config.dtype).removeprefix("torch.") == "float32" else torch.bfloat16
        return ParentPrior(reader, widths, target.config.vocab_size, stored, options.scratch_dir,
                           whole=not options.scoring_windows, progress=self.progress and not self.shard[0],
                           report=not self.shard[0])

    @in_fp32
    def _shrunk(self, layer: int, means: torch.Tensor) -> torch.Tensor:
        """[n_seen, k] the seen tokens' calibrated `means` shrunk toward their parent rows, for a fit to start from.
        With several processes the first reads the parent rows and hands them to the others (a sum with zeros)."""
        if self.prior is None:
            return means
        rank, world, reduce = self.shard
        prior = self.prior.rows(layer, self.seen) if not rank else torch.zeros(means.shape)
        if world > 1 and reduce is not None:
            prior = reduce(prior.to(means.device))
        return shrink(means, prior.to(means.device), self.counts.to(means.device), self.shrink)

    def _seen_rows(self, layer: int, lo: int, hi: int, prior: torch.Tensor | None) -> torch.Tensor:
        """The rows of seen tokens [lo, hi) (indices into `seen`), given their parent rows `prior` (None: none): a
        fit's rows as they are, else their calibrated means shrunk toward `prior`."""
        means = self.means[layer][lo:hi]
        if self.fit.active or prior is None:
            return means
        return shrink(means, prior, self.counts[lo:hi], self.shrink)

    def _dense_mlp(self, layer: int, device) -> dict[str, torch.Tensor | None]:
        """The parent's MLP weights of `layer` in fp32 on `device`, in the STEM MLP's order (`stem_projections`):
        gate, up of the table columns, up_rest (and biases) and down."""
        weights = stem_projections(self.source.tensors, self.family, layer, self.columns.get(layer), down=True)
        return {k: None if v is None else v.to(device, torch.float32) for k, v in weights.items()}

    def _calibrate(self, config, layers: list[int], shard, inputs: MlpInputs) -> dict[int, torch.Tensor]:
        """{layer: [n_seen, k] the seen tokens' calibrated means} of `layers` from the MLP inputs of this process's
        windows, computed in fp32 where the model reads (the teacher may already sit on a GPU)."""
        compact = torch.full((config.vocab_size,), -1, dtype=torch.long)
        compact[self.seen] = torch.arange(self.seen.numel())
        activation = ACT2FN[config.stem_activation]
        skip = skipped_positions(config)
        _, _, reduce = shard
        device = self.reading_model.device
        means = {}
        for layer in tqdm(layers, desc="rows", unit="layer", disable=not self.progress or bool(shard[0]), file=sys.stderr):
            weights = {k: (None if v is None else v.to(device, torch.float32)) for k, v in
                       stem_projections(self.source.tensors, self.family, layer, self.columns.get(layer)).items()}
            num, den = token_sums(inputs, layer, torch.arange(len(inputs.windows)), compact, self.seen.numel(),
                                  weights, activation, skip, self.gate_weighted)
            if reduce is not None:  # the sums over every process's windows
                num, den = reduce(num), reduce(den)
            means[layer] = (num / den.clamp_min(1e-12)).cpu()
        return means

    def _width(self, layer: int, d_ff: int) -> int:
        """The columns of `layer`'s table: the neurons of its split, or every one."""
        return self.columns[layer].columns if layer in self.columns else d_ff

    def _fit_projection(self, layer: int) -> torch.Tensor:
        return fit_projection(self.mlp_inputs(layer, self.embedding[self.seen]), self.means[layer])

    def table_rows(self, layer: int) -> RowsFn:
        @in_fp32
        def fill(start: int, stop: int, out: torch.Tensor) -> None:
            if self.prior is not None:  # every token's parent row
                out.copy_(self.prior.block(layer, start, stop))
            else:  # the ridge map from the embedding, for every row
                projection = self.projections[layer]
                torch.addmm(projection[-1], self.mlp_inputs(layer, self.embedding[start:stop]), projection[:-1], out=out)
            lo, hi = torch.searchsorted(self.seen, torch.tensor([start, stop])).tolist()
            where = self.seen[lo:hi] - start
            out[where] = self._seen_rows(layer, lo, hi, out[where] if self.prior is not None else None)

        return fill

    def read_ahead(self, ids: torch.Tensor) -> None:
        """The parent rows of `ids` read now, for a caller that asks `rows_for` from inside a forward of the model
        that reads them (a hook: the reader's forward would run the hook again)."""
        if self.prior is not None:
            self.prior.read(ids)

    @in_fp32
    def rows_for(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), k] table rows of `ids` (sorted, distinct), as `table_rows` would write them."""
        if self.prior is not None:
            out = self.prior.rows(layer, ids)
        else:
            projection = self.projections[layer]
            out = torch.addmm(projection[-1], self.mlp_inputs(layer, self.embedding[ids]), projection[:-1])
        where = torch.searchsorted(self.seen, ids).clamp_max(self.seen.numel() - 1)
        hit = self.seen[where] == ids
        index = where[hit]
        rows = self.means[layer][index]
        if not self.fit.active and self.prior is not None:
            rows = shrink(rows, out[hit], self.counts[index], self.shrink)
        out[hit] = rows
        return out


class CalibratedMeanInit(CalibratedInit):
    name = "calib-mean"
    description = ("plain mean of W_up x per token over calibration text, shrunk toward the token's row read from the "
                   "parent after contexts of that text (the row of an unseen token; with no parent rows, a ridge fit)")
    gate_weighted = False
