"""Conversion time, stage by stage: the plan's estimates (each stage timed on a slice of its work before the run
starts) against the clock.

    python benchmarks/convert_time.py smollm2            # the README's first command, defaults, fresh cache
    STEM_UPCYCLE_FAST_DTYPE=float32 python benchmarks/convert_time.py smollm2   # as a CPU without native bf16 reads
    python benchmarks/convert_time.py llama              # Llama-3.2-1B's shapes, random weights: the plan's time,
                                                         # its two longest stages clocked on a slice
    python benchmarks/convert_time.py sampling           # the parent's text: tokens/s by sequences a batch

`smollm2` runs `stem-upcycle convert smollm2-135m OUT` in a child process with an empty cache for the sampled text
(STEM_UPCYCLE_CACHE under WORKDIR) and prints, for each stage, the plan's estimate, the stage's own line and their
ratio (target: within 2x), the whole command's wall time (target: 3 minutes where bf16 is native, 5 where it is not)
and its peak RSS. `llama` writes a checkpoint of Llama-3.2-1B's shapes (benchmarks/convert.py), prints the plan of
`convert --dry-run` (target: at most 3 hours on 2 cores), then clocks the parent's rows of a slice of the vocabulary
and a slice of the sampling with the run's own code, against the rate the plan assumed. The time on one GPU is an
estimate from the plan's FLOPs, labelled as such.
"""

import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import torch

from stem_upcycle.conversion_time import describe_machine
from stem_upcycle.stages import STAGES

STAGE_LINE = re.compile(rf"^({'|'.join(STAGES)}): .* in ([\d.]+) (s|min|h)$")
ESTIMATE = re.compile(rf"({'|'.join(STAGES)}) ([\d.]+) (s|min|h) \(")
UNIT = {"s": 1.0, "min": 60.0, "h": 3600.0}
GPU_TFLOPS = 300.0  # an H100's bf16 at about 30% of its 989 dense TFLOP/s: an assumption, not a measurement


def seconds(value: str, unit: str) -> float:
    return float(value) * UNIT[unit]


def estimates_in(output: str) -> dict[str, float]:
    """{stage: estimated seconds} from the plan's `time` line."""
    line = next(line for line in output.splitlines() if line.startswith("time "))
    return {name: seconds(v, u) for name, v, u in ESTIMATE.findall(line)}


def stages_in(output: str) -> dict[str, float]:
    """{stage: seconds} from the lines the stages print as they end (a stage run twice is summed)."""
    found: dict[str, float] = {}
    for line in output.splitlines():
        if m := STAGE_LINE.match(line.strip()):
            found[m[1]] = found.get(m[1], 0.0) + seconds(m[2], m[3])
    return found


def run(command: list[str], env: dict) -> tuple[str, float]:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr, wall


def cpu() -> str:
    return describe_machine(torch.device("cpu"), None).removesuffix(", the parent read in float32")


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` ids ("w0".., the last two <eos> and <unk>): what a random checkpoint
    of real shapes lacks to be planned with text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 2)} | {"<eos>": vocab_size - 2, "<unk>": vocab_size - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)


@click.group()
def main():
    pass


@main.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=None, help="Default: a temporary folder.")
@click.option("--keep", is_flag=True, help="Keep the converted model (WORKDIR/out), e.g. to score it.")
def smollm2(workdir, keep):
    """The README's first command, `stem-upcycle convert smollm2-135m OUT`, fresh cache."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="stem-convert-time-"))
    shutil.rmtree(workdir / "cache", ignore_errors=True)
    shutil.rmtree(workdir / "out", ignore_errors=True)
    env = {**os.environ, "STEM_UPCYCLE_CACHE": str(workdir / "cache")}
    output, wall = run(["stem-upcycle", "convert", "smollm2-135m", str(workdir / "out")], env)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    planned, clocked = estimates_in(output), stages_in(output)
    print(f"CPU: {cpu()}; STEM_UPCYCLE_FAST_DTYPE={os.environ.get('STEM_UPCYCLE_FAST_DTYPE', '(unset)')}")
    print(next(line for line in output.splitlines() if line.startswith("time ")))
    print(f"{'stage':<14} {'plan s':>8} {'run s':>8} {'run/plan':>9}")
    for name in STAGES:
        if name in planned or name in clocked:
            p, c = planned.get(name), clocked.get(name)
            ratio = f"{c / p:.2f}x" if p and c else "-"
            print(f"{name:<14} {p or 0:>8.1f} {c or 0:>8.1f} {ratio:>9}")
    total = sum(planned.values())
    print(f"{'stages':<14} {total:>8.1f} {sum(clocked.values()):>8.1f} {sum(clocked.values()) / total:>8.2f}x")
    print(f"whole command: {wall:.1f} s wall ({wall / 60:.2f} min), peak RSS {rss:.2f} GB")
    if not keep:
        shutil.rmtree(workdir / "out", ignore_errors=True)


@main.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=None, help="Default: a temporary folder.")
@click.option("--tokens", default=2048, show_default=True, help="The vocabulary slice whose parent rows are clocked.")
@click.option("--steps", default=16, show_default=True, help="Decode steps of the sampling batch clocked.")
def llama(workdir, tokens, steps):
    """Llama-3.2-1B's shapes (random weights): the plan of the default conversion and two of its stages clocked."""
    from convert import write_random_checkpoint  # benchmarks/convert.py, next to this script

    from stem_upcycle.conversion_time import _decode_step
    from stem_upcycle.convert import plan_conversion
    from stem_upcycle.families import family_for
    from stem_upcycle.generate import cache_argument, calibration_sampling, draw
    from stem_upcycle.loading import model_from_source
    from stem_upcycle.shapes import LLAMA_32_1B
    from stem_upcycle.source import open_source
    from stem_upcycle.table_init import InitOptions
    from stem_upcycle.table_init.calibrated import in_dtype
    from stem_upcycle_cli.options import DEFAULT_SHARE
    from stem_upcycle.table_init.parent_rows import ContextSets, ParentReader, ParentRowOptions

    workdir = workdir or Path(tempfile.mkdtemp(prefix="stem-convert-time-"))
    dense = workdir / "dense"
    if not (dense / "config.json").exists():
        write_random_checkpoint(dense)
    if not (dense / "tokenizer.json").exists():  # the calibrated default reads text: a tokenizer of the vocabulary
        save_word_tokenizer(dense, LLAMA_32_1B["vocab_size"])
    output, _ = run(["stem-upcycle", "convert", str(dense), str(workdir / "out"), "--dry-run"], dict(os.environ))
    print(f"CPU: {cpu()}; STEM_UPCYCLE_FAST_DTYPE={os.environ.get('STEM_UPCYCLE_FAST_DTYPE', '(unset)')}")
    print("\n".join(line for line in output.splitlines() if line.split(" ", 1)[0] in ("parent", "time", "")))
    planned = estimates_in(output)
    print(f"plan: {sum(planned.values()) / 3600:.2f} h on this machine (target: at most 3 h on 2 cores)")
    tflop = float(re.search(r"\(([\d,.]+) TFLOP\)", output)[1].replace(",", ""))
    print(f"parent rows on one GPU: ~{tflop / GPU_TFLOPS:.0f} s (an estimate, not measured: {tflop:,.0f} TFLOP at "
          f"{GPU_TFLOPS:.0f} TFLOP/s, an H100's bf16 at about 30%)")

    source = open_source(str(dense))
    family = family_for(source.config.model_type)
    plan = plan_conversion(source, init="calib", columns=DEFAULT_SHARE, dry_run=True,  # convert's defaults
                           init_options=InitOptions(calib_generated=torch.zeros(0, dtype=torch.long)))
    reading = in_dtype(model_from_source(source), "auto")
    options, config = ParentRowOptions(), plan.config
    contexts = torch.randint(0, config.vocab_size, (options.contexts, options.context_length),
                             generator=torch.Generator().manual_seed(0))
    sets = ContextSets(options, config.vocab_size)
    reader = ParentReader(reading, family, config.stem_activation, plan.layers, contexts, plan.columns, sets=sets)
    ids = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(1))[:tokens]
    started = time.perf_counter()
    reader.rows(ids)
    clocked = time.perf_counter() - started
    expected = planned["parent rows"] * tokens / config.vocab_size
    print(f"parent rows of {tokens:,} tokens: {clocked:.1f} s clocked, {expected:.1f} s planned "
          f"({clocked / expected:.2f}x)")

    sampling = calibration_sampling(65536, reading.device)
    step = _decode_step(reading, sampling)
    n, half, cache = sampling.batch_size, sampling.length // 2, cache_argument(reading)
    prefix = torch.randint(0, config.vocab_size, (n, half))
    with torch.no_grad():
        out = reading(prefix, use_cache=True, logits_to_keep=1)
        started = time.perf_counter()
        for _ in range(steps):
            token = draw(out.logits[:, -1].float(), torch.Generator().manual_seed(0))[:, None]
            past = out[cache if cache in out else "past_key_values"]
            out = reading(token, use_cache=True, logits_to_keep=1, **{cache: past})
    clocked = (time.perf_counter() - started) / steps
    print(f"sampling: {clocked:.2f} s a step of {n} sequences clocked over {steps} steps, {step:.2f} s planned "
          f"({clocked / step:.2f}x)")


@main.command()
@click.option("--batches", default="32,128,256", show_default=True, help="Sequences sampled at once.")
@click.option("--steps", default=64, show_default=True, help="Decode steps clocked after a prefix of half a sequence.")
def sampling(batches, steps):
    """Tokens/s of sampling SmolLM2-135M's text (256 tokens a sequence) by batch size, in the dtype convert samples
    in here (STEM_UPCYCLE_FAST_DTYPE chooses): what CALIBRATION_BATCH is set by."""
    from stem_upcycle.generate import Sampling, cache_argument, draw
    from stem_upcycle.loading import fast_dtype, model_from_source
    from stem_upcycle.source import open_source

    dtype = fast_dtype(torch.device("cpu"))
    model = model_from_source(open_source("smollm2-135m")).to(dtype)
    print(f"CPU: {cpu()}; sampling in {str(dtype).removeprefix('torch.')}")
    length, cache = Sampling(sequences=1).length, cache_argument(model)
    for n in [int(b) for b in batches.split(",")]:
        generator = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, model.config.vocab_size, (n, length // 2), generator=generator)
        with torch.no_grad():
            out = model(prefix, use_cache=True, logits_to_keep=1)
            started = time.perf_counter()
            for _ in range(steps):
                ids = draw(out.logits[:, -1].float(), generator)[:, None]
                past = out[cache if cache in out else "past_key_values"]
                out = model(ids, use_cache=True, logits_to_keep=1, **{cache: past})
        print(f"batch {n}: {n * steps / (time.perf_counter() - started):.0f} tokens/s")


if __name__ == "__main__":
    main()
