"""What training starts from: text sampled from the teacher, and the STEM checkpoint (converted here unless given).

Both run in every process of a run: generation splits its batches, a calibrated conversion its
windows (sums reduced across processes); the main process writes the converted checkpoint.
"""

import dataclasses
import sys
from pathlib import Path

import torch

from ..convert import plan_conversion, run_conversion
from ..generate import GeneratedText, Sampling, as_stream
from ..loading import fast_dtype
from ..neurons import parse_columns
from ..source import open_source
from ..stages import stage
from ..table_init import INITIALISERS, FitOptions, InitOptions
from ..table_init.calibrated import calibrated_ids, calibration_windows
from ..table_init.layer_choice import is_auto
from ..table_init.parent_rows import ParentRowOptions
from .data import eval_files, expand_files, heldout_paths
from .recipe import RecipeError


def generated_text(recipe, source, teacher, tokenizer, acc, progress: bool) -> tuple[torch.Tensor | None, dict]:
    """[n, generated.length] ids sampled from the teacher (generated once, then read from the cache), and how
    fast this run generated them."""
    g = recipe.generated
    if not g.tokens:
        return None, {}
    length, context = g.length, getattr(teacher.config, "max_position_embeddings", None)
    if context and length > context:
        raise RecipeError(f"generated.length {length} passes the teacher's context of {context} positions; "
                          f"give at most {context}")
    sampling = Sampling.covering(g.tokens, length=length, batch_size=g.batch_size, first_tokens=g.first_tokens,
                                 first_top_k=g.first_top_k, temperature=g.temperature, seed=g.seed,
                                 dtype=fast_dtype(teacher.device))
    text = GeneratedText(source, sampling, g.cache_dir)
    with stage("sample", f"{g.tokens:,} tokens read from {text.folder}", acc.is_main_process) as note:
        with acc.autocast():  # every process generates its share of the missing batches
            mine = text.generate(teacher, tokenizer, acc.process_index, acc.num_processes,
                                 progress=progress and acc.is_main_process)
        acc.wait_for_everyone()
        tokens = mine["tokens"]
        if acc.num_processes > 1:
            tokens = int(acc.reduce(torch.tensor(tokens, device=acc.device), reduction="sum").item())
        stats = {}
        if tokens:
            stats = {"tokens": tokens, "seconds": mine["seconds"], "tokens_per_s": tokens / max(mine["seconds"], 1e-9)}
            note["work"] = text.describe(tokens, stats["seconds"], acc.num_processes)
    return text.load(), stats


def initial_model(recipe, source, teacher, tokenizer, generated, acc, output: Path, progress: bool,
                  datasets: dict | None = None) -> tuple[Path, torch.Tensor | None]:
    """(the STEM checkpoint training starts from: model.init_from, or `source` converted into OUTPUT/init;
    the ids whose rows a calibrated conversion of this run set from text, None when it set none).

    A calibrated init reads its text in every process (each a share, on its device; the sums are
    reduced), then the main process writes the checkpoint. `datasets`: the recipe's `hf:` entries, fetched."""
    m = recipe.model
    if m.init_from:
        start = open_source(m.init_from)
        stored = getattr(start.config, "stem_table_format", None)
        if stored:  # rows trained in place would need an fp32 master per table, and be re-quantised at export anyway
            raise RecipeError(f"model.init_from {m.init_from} stores its tables as {stored['dtype']}, and training "
                              f"updates float rows: decompress it (`stem-upcycle compress {m.init_from} OUT "
                              f"--table-dtype float32`), train OUT, then compress the result")
        return Path(start.directory or m.init_from), None
    init_dir = output / "init"
    heldout = heldout_paths(recipe, datasets)
    patterns = (m.calib_data or recipe.data.train_sources()) if INITIALISERS[m.init].needs_data else []
    # each entry (a file, a glob, a dataset: a genre) an equal share of the calibration text; held-out files never
    calib = [group for group in ([str(f) for f in expand_files([pattern], "model.calib_data", datasets)
                                  if f.resolve() not in heldout] for pattern in patterns) if group]
    options = InitOptions(calib_data=calib, calib_tokens=m.calib_tokens, calib_seq_len=m.calib_seq_len,
                          text_field=recipe.data.text_field,
                          heldout_data={name: [str(f) for f in fs] for name, fs in eval_files(recipe, datasets).items()},
                          heldout_tokens=recipe.data.eval_tokens,  # what each evaluation scores
                          dense_model=teacher,  # held-out text is never calibrated on either
                          fit=FitOptions(**dataclasses.asdict(recipe.local)),
                          parent=ParentRowOptions(contexts=m.parent_contexts, reads=m.parent_reads), shrink=m.shrink, fact_weight=m.fact_weight)
    if generated is not None and recipe.generated.calib_share:
        share = recipe.generated.calib_share if calib else 1.0
        stream = as_stream(generated, tokenizer.eos_token_id)  # as training packs it
        options.calib_generated = stream[: round(m.calib_tokens * share)]
    plan = None
    if not (init_dir / "config.json").exists():
        # --layers auto and --columns score layers and neurons on the main process alone; an explicit layer set of
        # whole layers calibrates in every one
        split = (acc.num_processes > 1 and INITIALISERS[m.init].needs_data and not is_auto(m.layers)
                 and not parse_columns(m.columns).measured)
        if split:
            options.shard = (acc.process_index, acc.num_processes, lambda t: acc.reduce(t, reduction="sum"))
        if split or acc.is_main_process:
            with acc.autocast():
                plan = plan_conversion(source, layers=m.layers, init=m.init, dtype="float32",
                                       init_options=options, first_token=m.first_token, columns=m.columns)
                if split:  # reused by the conversion below instead of calibrating again
                    plan.init_options.calibration = INITIALISERS[m.init](
                        plan.init_target, plan.init_options, progress=progress and acc.is_main_process)
        if acc.is_main_process:
            print(plan.describe(), file=sys.stderr)
            run_conversion(plan, init_dir, overwrite=True, progress=progress,
                           command=f"stem-upcycle train (conversion of {m.source})")
    acc.wait_for_everyone()
    calibrated = None
    if INITIALISERS[m.init].needs_data:
        done = plan.init_options.calibration if plan is not None else None  # kept by --layers auto, split runs
        # Else (a plain conversion, a resumed run) from the text; a resumed --layers auto run then also counts the
        # windows its layer scoring kept out of the calibration.
        calibrated = done.seen if done is not None else calibrated_ids(calibration_windows(source, options),
                                                                      open_source(str(init_dir)).config)
    return init_dir, calibrated
