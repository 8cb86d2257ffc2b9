"""Variants of a recipe side by side: each held-out set's perplexity ratio to the dense model, per variant.

    python benchmarks/recipe_variants.py --recipe recipes/smollm2-135m-cpu.yaml --output runs/variants \
        --common model.init_from=runs/init --common train.steps=10 \
        --variant "base=" --variant "ce-on-generated=generated.ce=true" \
        --variant "more-generated=generated.train_share=0.75 generated.tokens=61952"

A variant is NAME=OVERRIDES (space-separated `section.key=value`, as `train --set` takes them), applied
after the `--common` ones. Each runs `stem-upcycle train` in its own process (so that peak memory is
its own); a variant whose output is complete is read back rather than run again. Printed: each set's
ratio to the dense model at the start and at the end, tokens/s and peak RSS.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run(recipe: str, out: Path, overrides: list[str]) -> tuple[dict, dict, float]:
    """(first log record, last log record, wall seconds or 0 when read back) of `train` with `overrides`."""
    seconds = 0.0
    if not (out / "config.json").exists():  # finished runs are read back, not repeated
        command = [sys.executable, "-m", "stem_upcycle.cli", "train", recipe, "--output", str(out), "--quiet"]
        started = time.perf_counter()
        subprocess.run(command + [w for s in overrides for w in ("--set", s)], check=True)
        seconds = time.perf_counter() - started
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return log[0], log[-1], seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.yaml")
    parser.add_argument("--output", type=Path, default=Path("runs/variants"))
    parser.add_argument("--common", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=OVERRIDES")
    args = parser.parse_args()
    results = {}
    for item in args.variant:
        name, _, overrides = item.partition("=")
        results[name] = run(args.recipe, args.output / name, [*args.common, *overrides.split()])
    sets = list(next(iter(results.values()))[1]["eval"])
    print(f"{'variant':<24}" + "".join(f"{s:>22}" for s in sets) + f"{'tok/s':>7}{'peak RSS GB':>12}{'wall s':>8}")
    for name, (first, last, seconds) in results.items():
        cells = "".join(f"{first['eval'][s]['ppl_ratio']:>9.3f}x ->{last['eval'][s]['ppl_ratio']:>7.3f}x  " for s in sets)
        print(f"{name:<24}{cells}{last['tokens_per_s']:>7.0f}{last['peak_rss_gb']:>12.2f}{seconds:>8.0f}")


if __name__ == "__main__":
    main()
