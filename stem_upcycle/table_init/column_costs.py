"""Each intermediate neuron's cost as a table column, measured out of sample (`convert --columns`).

A neuron j of a layer whose up-activation u_j becomes a row r_j[token] adds to the layer's output the error
W_down[:, j] * g_j * (u_j - r_j[token]), with g_j = act(gate_j x). Its cost is the mean square of that error over
positions, ||W_down[:, j]||^2 x mean (g_j (u_j - r_j[token]))^2: the output error the neuron alone would add.

It is scored on calibration windows that the rows were not fitted to, with the rows as the conversion makes them
(the calibrated mean over the other windows shrunk toward the parent's row; a ridge row for a token they never
showed where there are no parent rows): scored on the windows its rows came from, a neuron looks cheaper than it is
on new text, most on a genre whose tokens the calibration covers least (SmolLM2-135M, a third of every layer's
neurons chosen on in-sample costs: 2.76x the parent's perplexity on a science text whose distinct tokens the
calibration covered a third of; issue 48). The cost ranks neurons within a layer well, and whole layers badly: whole
layers are chosen by `--layers auto:` (layer_choice.py), which scores perplexity.

Everything comes from the text's MLP inputs read once (mlp_inputs.py): only the scored tokens' rows are computed,
every neuron's, one layer at a time.
"""

import sys

import torch
from tqdm.auto import tqdm
from transformers.activations import ACT2FN

from ..families import Family, layer_name
from ..modeling.modeling_stem import fit_ridge
from .calibrated import in_fp32, shrink, token_sums
from .closed_form import mlp_projections
from .mlp_inputs import MlpInputs
from .parent_rows import ParentPrior
from ..stages import stage


class ScoredText:
    """Positions to score neurons on: the MLP inputs `inputs` of `ids` [n, seq] at the positions `where` [n, seq]
    (bool), weighing `weight` in the cost."""

    def __init__(self, inputs: MlpInputs, ids: torch.Tensor, where: torch.Tensor, weight: float = 1.0):
        self.inputs, self.ids, self.where, self.weight = inputs, ids, where, weight


def column_costs(text: MlpInputs, scoring: torch.Tensor, scored: list[ScoredText], prior: ParentPrior | None,
                 closed_form, family: Family, config, layers: list[int], shrink_k: float, skip: int,
                 gate_weighted: bool = True, progress: bool = False, device="cpu", report: bool = True
                 ) -> dict[int, torch.Tensor]:
    """{layer: [d_ff] each neuron's cost}: `scored` (the windows `scoring` of the calibration text's MLP inputs
    `text`, and maybe factual completions) scored with rows calibrated on the other windows of `text`, shrunk by
    `shrink_k` toward `prior` (every neuron's rows, read for the scored tokens; None: for a scored token the other
    windows never show, a ridge map from the embedding's closed-form inputs (`closed_form`, a ClosedFormInit of the
    source) fitted on the scored tokens they do); `skip`: positions at the start of a window that read no row."""
    ids = torch.cat([s.ids[s.where] for s in scored]).unique()  # the tokens whose rows are scored
    with stage("score neurons", f"{len(layers)} layers, {ids.numel():,} tokens' rows", report):
        return _costs(text, scoring, scored, prior, closed_form, family, config, layers, shrink_k, skip, gate_weighted,
                      progress, device, ids)


@torch.no_grad()
@in_fp32
def _costs(text, scoring, scored, prior, closed_form, family, config, layers, shrink_k, skip, gate_weighted, progress,
           device, ids) -> dict[int, torch.Tensor]:
    """column_costs' work, for the tokens `ids` [n] whose rows are scored."""
    tensors = closed_form.source.tensors
    compact = torch.full((config.vocab_size,), -1, dtype=torch.long)
    compact[ids] = torch.arange(ids.numel())
    calibrating = torch.ones(len(text.windows), dtype=torch.bool)
    calibrating[scoring] = False
    windows = calibrating.nonzero()[:, 0]
    counts = torch.bincount(compact[text.windows[windows, skip:]].flatten() + 1, minlength=ids.numel() + 1)[1:].float()
    if prior is not None:
        prior.read(ids)
    activation = ACT2FN[config.stem_activation]
    costs = {}
    for layer in tqdm(layers, desc="score neurons", unit="layer", disable=not progress, file=sys.stderr):
        weights = {k: None if v is None else v.to(device, torch.float32)
                   for k, v in mlp_projections(tensors, family, layer).items()}
        num, den = token_sums(text, layer, windows, compact, ids.numel(), weights, activation, skip,
                              gate_weighted, text.inputs.dtype)
        means = (num / den.clamp_min(1e-12)).cpu()
        if prior is not None:
            rows = shrink(means, prior.rows(layer, ids), counts, shrink_k)
        else:  # the conversion's ridge map for unseen tokens, fitted on the scored tokens the other windows show
            seen, rows = counts > 0, means
            inputs = closed_form.mlp_inputs(layer, closed_form.embedding[ids])
            weight, bias = fit_ridge(inputs[seen], means[seen])
            rows[~seen] = torch.addmm(bias, inputs[~seen], weight)
        sums, rows = 0.0, rows.to(device)
        for s in scored:
            x = s.inputs.layer(layer)[s.where].to(device, torch.float32)  # [positions, d]
            gate = activation(torch.nn.functional.linear(x, weights["gate"], weights["gate_bias"]))
            up = torch.nn.functional.linear(x, weights["up"], weights["up_bias"])
            error = (gate * (up - rows[compact[s.ids[s.where]].to(device)])).square()
            sums = sums + s.weight * error.mean(0, dtype=torch.float64).cpu()
        down = tensors.get(layer_name(layer, family.down + ".weight")).double()  # [d, d_ff]
        costs[layer] = (down.square().sum(0) * sums).float()
    return costs


def completion_lengths(facts) -> torch.Tensor:
    """[n] each fact sequence's tokens (a `ScoredTokens`), its padding aside: the completion ends it, and target j is
    token j + 1."""
    targets = torch.arange(facts.scored.shape[1])[None].expand_as(facts.scored)
    return targets.masked_fill(~facts.scored, -1).max(1).values + 2
