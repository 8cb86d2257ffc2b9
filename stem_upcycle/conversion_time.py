"""A conversion's time, stage by stage (stages.py), estimated before it runs: one unit of each stage's work timed
on this machine with the model the run computes with, times the units the plan holds.

Units: a decode step of the sampling batch (sample), a forward of windows (read text), a layer's projections of a
slice of positions at the width the stage computes (score neurons: every neuron; rows: the table columns), a
forward of the parent's rows (parent rows), a slice of bytes written beside OUT (write). Each is timed after one
warm-up run. What the plan cannot know before the text is read (the tokens a neuron choice scores) is counted as
text of its size holds them (about 3 n^0.75 distinct tokens in n).
"""

import os
import tempfile
import time
from pathlib import Path

import torch
from transformers.activations import ACT2FN

from .stages import Estimate
from .table_init import INITIALISERS
from .table_init.calibrated import CALIB_WINDOWS, accumulate
from .table_init.mlp_inputs import WINDOWS_PER_FORWARD
from .table_init.parent_rows import CANDIDATES, ROWS_PER_FORWARD, ParentReader

WRITE_SLICE_BYTES = 64 * 2**20
FILL_SLICE_ROWS = 4096  # the tables' rows filled from the parent's in one timed slice


def timed(fn, repeat: int = 1, warm=None) -> float:
    """Seconds of one call of `fn`, the least of `repeat` after a warm-up (`warm`, a smaller call of the same work
    where `fn` is a large one: the first call's costs are paid once either way)."""
    (warm or fn)()
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def distinct_tokens(tokens: int, vocab_size: int) -> int:
    """Distinct tokens in `tokens` of text, about 3 n^0.75 (SmolLM2's sampled text: 11,539 in 65,536)."""
    return min(vocab_size, int(3 * tokens**0.75))


def estimate_conversion(plan, reading, text_tokens: int, sampling=None, sample_batches: int = 0,
                        out: Path | None = None, sampler=None) -> list[Estimate]:
    """The stages of `plan` (a ConversionPlan; a dry run's plans as many layers and columns as the run converts),
    timed with `reading`, the dense model as the run reads text (its device, its dtype): sampling `sample_batches`
    batches of `sampling` (generate.Sampling) with `sampler` (the model in the dtype it samples in),
    the calibration on `text_tokens` tokens, a neuron choice, the parent's rows, the rows and the files, written
    beside `out`."""
    options, config = plan.init_options, plan.config
    estimates = []
    if sample_batches:
        estimates.append(Estimate("sample", f"{sample_batches * sampling.batch_size * sampling.length:,} tokens",
                                  sample_batches * sampling.length * _decode_step(sampler, sampling)))
    if not INITIALISERS[plan.init].needs_data:
        return estimates + [_write(plan, out)]
    # a window no longer than the text or the model's positions (a longer one is refused when the text is read)
    seq = min(options.calib_seq_len, max(2, text_tokens), getattr(config, "max_position_embeddings", None) or 2**31)
    windows = max(1, text_tokens // seq)
    layers = plan.layers if plan.auto_spec is None else list(range(config.num_hidden_layers))
    last = max(layers)
    batch = torch.randint(0, config.vocab_size, (WINDOWS_PER_FORWARD, seq))
    window = timed(lambda: _forward(reading, batch, last), warm=lambda: _forward(reading, batch[:1], last))
    window /= WINDOWS_PER_FORWARD
    measured = plan.columns_spec != "all"
    estimates.append(Estimate("read text", f"{windows:,} windows of {seq} tokens", windows * window))
    d_ff, per_token = config.intermediate_size, options.parent.per_token
    parent_position = _parent_position(reading, plan, last) if plan.reads_parent_rows else 0.0
    if measured:
        from .table_init.row_choice import COLUMN_SCORING_WINDOWS

        scored = distinct_tokens(COLUMN_SCORING_WINDOWS * seq, config.vocab_size)
        every = _projection(reading, d_ff, seq, reading_dtype=True) * windows / CALIB_WINDOWS * len(layers)
        scoring = _projection(reading, d_ff, seq) * COLUMN_SCORING_WINDOWS / CALIB_WINDOWS * len(layers)
        estimates.append(Estimate("score neurons", f"{len(layers)} layers, ~{scored:,} tokens",
                                  every + scoring + scored * per_token * parent_position))
    widths = plan.choice.table_columns(d_ff) if plan.choice is not None else {layer: d_ff for layer in layers}
    rows = sum(_projection(reading, width, seq) for width in set(widths.values())) / len(set(widths.values()))
    estimates.append(Estimate("rows", f"{len(widths)} layers", rows * windows / CALIB_WINDOWS * len(widths)))
    if plan.reads_parent_rows:
        estimates.append(Estimate("parent rows", f"{plan.parent_positions:,} positions",
                                  plan.parent_positions * parent_position))
    return estimates + [_write(plan, out, list(widths.values()) if plan.reads_parent_rows else [])]


@torch.no_grad()
def _decode_step(model, sampling) -> float:
    """Seconds of one decode step of `sampling`'s batch with a cache of half its sequence (the mean a step sees),
    each step the forward and the draw, as generate.sample_batch runs it."""
    from .generate import cache_argument, draw

    n, half = sampling.batch_size, max(1, sampling.length // 2)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.config.vocab_size, (1, half), generator=generator).to(model.device)
    cache = cache_argument(model)
    first = model(prefix, use_cache=True, logits_to_keep=1)  # one sequence's cache, repeated for the batch: the
    past = first[cache if cache in first else "past_key_values"]  # prefix's forward costs less than n of them
    past.batch_repeat_interleave(n)
    state = {"logits": first.logits.expand(n, -1, -1), "past": past}

    def step():  # the forward and the draw, the cache one longer each time
        ids = draw(state["logits"][:, -1].float(), generator)[:, None]
        out = model(ids, use_cache=True, logits_to_keep=1, **{cache: state["past"]})
        state["logits"], state["past"] = out.logits, out[cache if cache in out else "past_key_values"]

    return timed(step, repeat=3)


def model_for_timing(source):
    """The source's model when its weights are here, else one of its shapes with random weights (a dry run of a
    hub id, whose weights are not downloaded): what a slice of the run's work is timed with."""
    from transformers import AutoModelForCausalLM

    from .loading import model_from_source

    if not source.pending_download:
        return model_from_source(source)
    return AutoModelForCausalLM.from_config(source.config, dtype=torch.float32).eval()


def describe_machine(device: torch.device, reading) -> str:
    """The machine the estimate holds for, in a few words: its CPU (or GPU), and the dtype the parent reads in."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                    None) if Path("/proc/cpuinfo").exists() else None
        name = f"{name or 'CPU'}, {torch.get_num_threads()} threads"
    dtype = str(next(reading.parameters()).dtype).removeprefix("torch.") if reading is not None else "float32"
    return f"{name}, the parent read in {dtype}"


class _Stop(Exception):
    """Raised after the last layer a stage computes."""


@torch.no_grad()
def _forward(model, ids: torch.Tensor, last: int, **kwargs) -> None:
    """A forward of `ids` stopped after layer `last`, as the calibration and the parent's rows stop it."""
    def stop(module, args, output):
        raise _Stop

    hook = model.base_model.layers[last].register_forward_hook(stop)
    try:
        model.base_model(input_ids=ids.to(model.device), use_cache=False, **kwargs)
    except _Stop:
        pass
    finally:
        hook.remove()


def _parent_position(model, plan, last: int) -> float:
    """Seconds per token of the parent's rows: a forward of ROWS_PER_FORWARD contexts of random tokens and their
    candidates, read by the reader as the run reads them (its hooks, its sums)."""
    config, parent = plan.config, plan.init_options.parent
    contexts = torch.randint(0, config.vocab_size, (ROWS_PER_FORWARD, parent.context_length))
    reader = ParentReader(model, plan.family, config.stem_activation, plan.layers, contexts, plan.columns)
    candidates = torch.randint(0, config.vocab_size, (CANDIDATES,))
    few = ParentReader(model, plan.family, config.stem_activation, plan.layers, contexts[:1], plan.columns)
    return timed(lambda: reader.rows(candidates), warm=lambda: few.rows(candidates[:8])) / (ROWS_PER_FORWARD * CANDIDATES)


@torch.no_grad()
def _projection(model, width: int, seq: int, reading_dtype: bool = False) -> float:
    """Seconds of a layer's sums over CALIB_WINDOWS windows of `seq` positions at `width` columns (token_sums' unit):
    gate and up, the squared gate, added at rows of a table, in fp32 or in the model's dtype."""
    d, device = model.config.hidden_size, model.device
    dtype = next(model.parameters()).dtype if reading_dtype else torch.float32
    weights = {"gate": torch.randn(width, d, device=device), "up": torch.randn(width, d, device=device),
               "gate_bias": None, "up_bias": None}
    x = torch.randn(CALIB_WINDOWS * seq, d, device=device)
    index = torch.randint(0, 4096, (CALIB_WINDOWS * seq,), device=device)
    num, den = torch.zeros(4096, width, device=device), torch.zeros(4096, width, device=device)
    return timed(lambda: accumulate(num, den, x, index, weights, ACT2FN["silu"], True, dtype))


def _write(plan, out: Path | None, prior_widths: list[int] = ()) -> Estimate:
    """The output's bytes at the rate a slice of them is written beside OUT, and where the tables are filled from the
    parent's rows (`prior_widths`: each table's columns), those rows copied out of their file a slice at a time."""
    folder = Path(out).resolve().parent if out is not None else Path(tempfile.gettempdir())
    while not folder.exists():
        folder = folder.parent
    data = os.urandom(WRITE_SLICE_BYTES)

    def write():  # synced, as each shard is when it is closed: the disk's rate, not the page cache's
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    seconds = timed(write, repeat=1) * plan.total_bytes / WRITE_SLICE_BYTES
    if prior_widths:  # the tables' rows, each a column range of the parent rows' file, in its dtype, in fp32
        stored = plan.parent_bytes // (plan.config.vocab_size * sum(prior_widths))
        prior = torch.zeros(FILL_SLICE_ROWS, sum(prior_widths), dtype=torch.bfloat16 if stored == 2 else torch.float32)
        table = torch.empty(FILL_SLICE_ROWS, max(prior_widths))

        def fill():
            lo = 0
            for width in prior_widths:
                table[:, :width].copy_(prior[:, lo : lo + width].float())
                lo += width

        seconds += timed(fill) * plan.config.vocab_size / FILL_SLICE_ROWS
    return Estimate("write", f"{plan.total_bytes / 1e9:.2f} GB", seconds)
