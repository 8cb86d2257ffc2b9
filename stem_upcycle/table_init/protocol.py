"""What a table initialiser is given and what it answers.

An initialiser is built from an `InitTarget` (the checkpoint and the layers whose tables it fills) and
`InitOptions` (what it may read besides the checkpoint), and answers, per STEM layer, a function that
fills rows [start, stop) of that layer's table into a given buffer. Conversion streams those rows to
disk chunk by chunk, so an initialiser never returns a whole table.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from ..families import Family
from ..source import Source
from .parent_rows import ParentRowOptions

RowsFn = Callable[[int, int, torch.Tensor], None]  # (start, stop, out: fp32 [stop - start, the table's columns])
Reduce = Callable[[torch.Tensor], torch.Tensor]  # an all-reduce (sum) across processes


@dataclass(frozen=True)
class InitTarget:
    """The tables to fill: the dense checkpoint, its family, the STEM model's config, the STEM layers, and per layer
    whose table holds some of its neurons only, their split (`NeuronSplit`: the table's columns are those neurons)."""

    source: Source
    family: Family
    config: Any  # StemConfig (stem_activation, stem_dense_first_token, vocab and d_ff)
    layers: list[int]
    columns: dict = field(default_factory=dict)  # layer -> NeuronSplit; a layer not in it: every neuron


@dataclass(frozen=True)
class FitOptions:
    """How the calibrated inits fit each STEM layer to its parent beyond a mean per token (layer_fit.py). The
    defaults fit nothing more: each layer's rows calibrated on the dense model's MLP inputs."""

    sequential: bool = False  # rows calibrated on the inputs of the model whose earlier STEM layers are fitted
    refit_down: float = 0.0  # ridge strength of the refit of W_down to the parent MLP's outputs; 0: no refit
    epochs: int = 0  # passes of local training (rows, gate, down) over the calibration windows; 0: none
    lr: float = 1e-3  # peak learning rate of the gate and down projections (Adam, cosine decay)
    row_lr: float = 1e-2  # peak learning rate of the rows (sparse Adam)
    batch_tokens: int = 2048  # tokens per step of local training (whole windows)

    @property
    def active(self) -> bool:
        """Whether the layers are walked one after another (layer_fit.LayerFitter) rather than calibrated together."""
        return self.sequential or self.refit_down > 0 or self.epochs > 0


@dataclass
class InitOptions:
    """What an initialiser may read besides the checkpoint. Only calibrating inits (`needs_data`) read any."""

    calib_data: list = field(default_factory=list)  # the user's text: files, or lists of files (a genre each), each an equal share
    calib_tokens: int | None = None  # at most this many calibration tokens (generated ones included); None: all
    calib_seq_len: int = 512  # tokens per calibration window
    text_field: str = "text"  # the field of a .jsonl record or column of a .parquet file that holds the document
    calib_generated: torch.Tensor | None = None  # a token stream sampled from the dense model itself (generate.py)
    heldout_data: dict[str, list[str]] | None = None  # {set: files} never calibrated on; their coverage is reported
    heldout_tokens: int | None = None  # of each held-out set's first tokens (None: all; a Hub file may hold 100M)
    dense_model: Any = None  # the dense model already loaded (e.g. a teacher on a GPU); else loaded when needed
    reading_model: Any = None  # the dense model as it reads text (`calibrated.reading_model`), made once and shared
    mlp_inputs: Any = None  # the calibration windows' MLP inputs read already (mlp_inputs.MlpInputs), by a choice
    shard: tuple[int, int, Reduce] | None = None  # (rank, world, reduce): this process calibrates every world-th window
    calibration: Any = None  # a calibration of every layer made already (by --layers auto), reused as it is
    scoring_windows: int = 0  # windows kept out of the calibration to score layers on (--layers auto)
    fit: FitOptions = field(default_factory=FitOptions)  # stages beyond the mean per token (calibrated inits)
    # Every token's row read from the parent after contexts of the calibration text (parent_rows.py): the prior a
    # calibrated mean is shrunk toward, and the row of a token the text never shows; contexts 0: none (the ridge map
    # from the embedding for unseen tokens, no shrinkage)
    parent: ParentRowOptions = field(default_factory=ParentRowOptions)
    shrink: float = 8.0  # k: a token's calibrated mean over n positions weighs n / (n + k), its parent row the rest
    # A choice of neurons (--columns) also scores the parent's completions of factual prompts (facts_layer_choice.jsonl),
    # weighing this many times the text windows: what the model knows weighs beside its perplexity
    fact_weight: float = 0.25
    scratch_dir: Any = None  # a folder on the output's disk for the whole vocabulary's parent rows (None: the temp dir)

    @property
    def has_text(self) -> bool:
        return bool(self.calib_data) or self.calib_generated is not None


class TableInit(Protocol):
    name: str  # what `--init` calls it
    description: str  # one line for the plan and the model card
    needs_data: bool  # reads calibration text (and so the dense model), not the checkpoint alone

    def __init__(self, target: InitTarget, options: InitOptions, progress: bool = False): ...

    def table_rows(self, layer: int) -> RowsFn: ...

    # Dense tensors of the STEM checkpoint that the init computed in place of the parent's (a fit's gate, down and
    # up_rest projections), by output name; empty for most inits.
    dense_weights: dict[str, torch.Tensor]
