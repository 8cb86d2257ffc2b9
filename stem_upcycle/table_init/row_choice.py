"""What becomes rows: which layers are converted (`--layers`) and, in each, which of its neurons (`--columns`),
decided in one step before anything is written, with one result (`RowChoice`) that the conversion's plan is made of.

Choices that measure (`--layers auto:`, `--columns` other than all) calibrate the dense model on the calibration
text with some windows kept out, and score on those: layers by the perplexity each costs converted alone
(layer_choice.py), neurons by the output error each adds as a table column (column_costs.py). A dry run (`convert
--dry-run`, `train --plan`) measures nothing: it plans for as many layers and columns, sized alike.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..families import Family
from ..layers import LayerSpecError, parse_layers
from ..loading import load_tokenizer, model_from_source
from ..neurons import ColumnSpecError, NeuronSplit, choose_columns, parse_columns
from . import INITIALISERS
from .calibrated import CalibrationError, calibration_windows, reading_model, skipped_positions
from .closed_form import ClosedFormInit
from .column_costs import ScoredText, column_costs, completion_lengths
from .layer_choice import RANKING_FACTS, auto_fraction, check_auto, fact_completions, is_auto, select_layers
from .mlp_inputs import MlpInputs, layer_groups
from .parent_rows import ContextSets, ParentPrior, ParentReader, cut_contexts
from .protocol import InitOptions, InitTarget

COLUMN_SCORING_WINDOWS = 16  # calibration windows kept out of the rows that neurons are scored on


@dataclass
class RowChoice:
    """The layers to convert and, per layer whose table holds some of its neurons only, their split; with what the
    choice measured (kept in the config for the user) and a calibration the init may reuse."""

    layers: list[int]
    columns: dict[int, NeuronSplit] = field(default_factory=dict)  # empty: whole layers
    calibration: Any = None  # every layer calibrated by --layers auto, reusable by the init (whole layers only)
    text_inputs: Any = None  # the calibration text's MLP inputs a neuron choice read (mlp_inputs.py), for the init
    reading_model: Any = None  # the dense model as it read them
    layer_costs: dict | None = None  # {layer: perplexity ratio converted alone} (--layers auto)
    fact_costs: dict | None = None  # {layer: fact-completion perplexity ratio converted alone} (--layers auto)
    measured: bool = True  # False in a dry run of a measured choice: counts and sizes only, no neuron chosen

    def table_columns(self, d_ff: int) -> dict[int, int]:
        """Per converted layer, its table's columns."""
        return {layer: self.columns[layer].columns if layer in self.columns else d_ff for layer in self.layers}


def choose_rows(source, family: Family, config, layers: str, columns: str, init: str, options: InitOptions,
                step: int, progress: bool = False, dry_run: bool = False) -> RowChoice:
    """The conversion's choice of rows for `--layers LAYERS --columns COLUMNS`; `config`: a STEM config of the
    source (the activation, the first-token rule), `step`: the multiple table columns come in (`column_step`)."""
    dense, spec = source.config, parse_columns(columns)
    check_columns(spec, init, dense.intermediate_size, dense.num_hidden_layers, step, dry_run)
    check_calibration_budget(spec, options)
    choice = RowChoice([])
    if is_auto(layers) and dry_run:  # sizes depend on the count alone: no calibration, no measurement
        check_auto(layers, init)
        choice = RowChoice(parse_layers(auto_fraction(layers), dense.num_hidden_layers), measured=False)
    elif is_auto(layers):  # calibrates every layer and scores each; the init reuses that calibration
        chosen, calibration, layer_costs, fact_costs = select_layers(layers, source, family, config, init, options,
                                                                     progress)
        choice = RowChoice(chosen, calibration=calibration, layer_costs=layer_costs, fact_costs=fact_costs)
    else:
        choice.layers = parse_layers(layers, dense.num_hidden_layers)
    if spec.whole:
        return choice
    d_ff = dense.intermediate_size
    if dry_run:  # as many columns as the real run gives the layers on average, in no particular neurons
        costs = {layer: torch.zeros(d_ff) for layer in choice.layers}
        even = dataclasses.replace(spec, spread=False)
        splits = {layer: s for layer, s in choose_columns(even, costs, step).items() if s.columns < d_ff}
        return dataclasses.replace(choice, columns=splits, measured=False)
    inputs, reading, costs = neuron_costs(source, family, config, choice.layers, init, options, progress)
    splits = choose_columns(spec, costs, step)
    if not splits:
        raise LayerSpecError(f"--columns {columns} leaves no neuron of layers {choice.layers} as a table column; "
                             f"give a larger share")
    # layers given no column stay dense; their rows are calibrated from the same inputs, for the chosen columns
    return RowChoice(sorted(splits), {layer: s for layer, s in splits.items() if s.columns < d_ff},
                     layer_costs=choice.layer_costs, fact_costs=choice.fact_costs, text_inputs=inputs,
                     reading_model=reading)


def neuron_costs(source, family: Family, config, layers: list[int], init: str, options: InitOptions,
                 progress: bool = False):
    """(the calibration text's MLP inputs, the reading model, {layer: [d_ff] each neuron's cost}): the text read
    once, COLUMN_SCORING_WINDOWS of its windows (spread over every text) kept out of the rows and scored on, with the
    parent's completions of the ranking facts weighing `options.fact_weight`."""
    model = options.dense_model or model_from_source(source)
    reading = reading_model(model, options)
    windows = calibration_windows(source, options)
    if len(windows) <= 2 * COLUMN_SCORING_WINDOWS:
        raise CalibrationError(f"choosing what becomes rows (--columns) scores on {COLUMN_SCORING_WINDOWS} windows "
                               f"kept out of the calibration; give more than "
                               f"{2 * COLUMN_SCORING_WINDOWS * windows.shape[1]} calibration tokens")
    scoring = torch.linspace(0, len(windows) - 1, COLUMN_SCORING_WINDOWS).round().long()
    skip = skipped_positions(config)  # a dense first token reads no row
    where = torch.zeros(windows.shape, dtype=torch.bool)
    where[scoring, skip:] = True
    facts = fact_completions(load_tokenizer(source), RANKING_FACTS) if options.fact_weight else None
    if facts is not None:  # the completions' scored positions: no padding, no dense first token
        real = torch.arange(facts.ids.shape[1])[None] < completion_lengths(facts)[:, None]
        real[:, :skip] = False
    target = InitTarget(source, family, config, layers)
    contexts = None
    if options.parent.contexts:
        # contexts cut from the windows the rows are calibrated on, as they were when the choice read them apart
        # (cut from every window, the choice lost 6 of 37 facts on SmolLM2-135M at 16 and at 2 reads)
        calibrated = torch.ones(len(windows), dtype=torch.bool)
        calibrated[scoring] = False
        contexts = cut_contexts(windows[calibrated], options.parent)
    groups = layer_groups(layers, windows.shape, config.hidden_size, next(reading.parameters()).dtype)
    costs = {}
    for some in groups:
        inputs = MlpInputs(reading, some, windows, options.scratch_dir, progress)
        scored = [ScoredText(inputs, windows, where)]
        if facts is not None:
            fact_inputs = MlpInputs(reading, some, facts.ids, options.scratch_dir, report=False)
            scored.append(ScoredText(fact_inputs, facts.ids, real, options.fact_weight))
        prior = None
        if contexts is not None:  # every neuron's parent rows of the scored tokens, after the rows' own contexts
            reader = ParentReader(reading, family, config.stem_activation, some, contexts,
                                  gate_weighted=INITIALISERS[init].gate_weighted,
                                  sets=ContextSets(options.parent, config.vocab_size))
            prior = ParentPrior(reader, {layer: config.intermediate_size for layer in some}, config.vocab_size,
                                torch.float32, whole=False)
        costs |= column_costs(inputs, scoring, scored, prior, ClosedFormInit(target), family, config, some,
                              options.shrink, skip, INITIALISERS[init].gate_weighted, progress, reading.device)
    # the inputs are kept for the rows where every layer's fit the budget at once; else the rows read the text again
    return (inputs if len(groups) == 1 else None), reading, costs


def check_calibration_budget(spec, options: InitOptions) -> None:
    """A choice of neurons whose --calib-tokens cannot hold its scoring windows twice over, refused before any text
    is read (a shorter text than --calib-tokens is refused later, when it is read: CalibratedInit)."""
    needed = 2 * COLUMN_SCORING_WINDOWS * options.calib_seq_len
    if spec.measured and options.calib_tokens is not None and options.calib_tokens <= needed:
        raise ColumnSpecError(f"--columns {spec.text} scores neurons on {COLUMN_SCORING_WINDOWS} calibration windows "
                              f"kept out of the rows: give --calib-tokens more than {needed} (or --columns all)")


def check_columns(spec, init: str, d_ff: int, layers: int, step: int, dry_run: bool = False) -> None:
    """`--columns` refused in one line before anything is computed: a choice that measures without calibrated rows
    (a dry run plans sizes alone: `train --plan` plans any init as closed-form), more neurons than a layer has, a
    share of all layers' neurons that rounds to none."""
    if spec.measured and not INITIALISERS[init].needs_data and not dry_run:
        raise ColumnSpecError(f"--columns {spec.text} chooses neurons by their error with calibrated rows: use --init "
                              f"calib (or calib-mean) with --calib-data")
    if spec.count is not None and spec.count > d_ff:
        raise ColumnSpecError(f"--columns {spec.text}: a layer has {d_ff} intermediate neurons; give at most that many")
    if spec.spread and round(spec.share * d_ff * layers / step) == 0:
        raise ColumnSpecError(f"--columns {spec.text} gives no layer a table column (they come in multiples of "
                              f"{step}); give a larger share")
