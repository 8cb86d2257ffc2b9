"""End-to-end tokens a recovery would need to bring each genre to a target ratio, extrapolated from its curve.

    python benchmarks/tokens_to_target.py runs/smollm2-stem/train_log.jsonl --target 1.10
    python benchmarks/tokens_to_target.py --points novel=0.82M:1.460,1.64M:1.419,2.46M:1.397,3.28M:1.379

Per genre, the excess over the parent (perplexity ratio - 1) at the evaluations after training began is fitted by
a power law in the tokens trained, excess = a * tokens^-b (least squares on the logs), and solved for the target.
A run logs its evaluations in train_log.jsonl (`train.eval_every`); step 0, before training, is left out (no
power law passes through it). The fit holds the learning-rate schedule fixed: a cosine that decays to nothing by the
last step flattens the curve's end, so a longer run at the same peak rate would do better than this says. Read it
as the order of magnitude a GPU run must be sized for, not a promise.
"""

import argparse
import json
import math
from pathlib import Path

import numpy


def curves_from_log(path: Path) -> dict[str, list[tuple[float, float]]]:
    """{genre: [(tokens, ratio)]} of a train_log.jsonl's evaluations after step 0."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("tokens") and "eval" in record:
            for genre, figures in record["eval"].items():
                curves.setdefault(genre, []).append((float(record["tokens"]), figures["ppl_ratio"]))
    return curves


def parse_points(text: str) -> tuple[str, list[tuple[float, float]]]:
    """'NAME=TOKENS:RATIO,...' with TOKENS as 820000, 820k or 0.82M."""
    name, _, points = text.partition("=")
    scale = {"k": 1e3, "M": 1e6, "B": 1e9}
    curve = []
    for point in points.split(","):
        tokens, _, ratio = point.partition(":")
        factor = scale.get(tokens[-1], 1)
        curve.append((float(tokens.rstrip("kMB")) * factor, float(ratio)))
    return name, curve


def tokens_to(curve: list[tuple[float, float]], target: float) -> tuple[float, float]:
    """(b, tokens at which the fitted excess reaches target - 1); tokens inf where the excess does not fall."""
    points = [(math.log(t), math.log(r - 1)) for t, r in curve if r > 1]
    if len(points) < 2:
        raise SystemExit("a power law needs two evaluations after training began with a ratio above 1")
    slope, intercept = numpy.polyfit(*zip(*points), 1)  # least squares on the logs
    if slope >= 0:
        return -slope, math.inf
    return -slope, math.exp((math.log(target - 1) - intercept) / slope)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="*", type=Path, help="train_log.jsonl files")
    parser.add_argument("--points", action="append", default=[], metavar="GENRE=TOKENS:RATIO,...")
    parser.add_argument("--target", type=float, default=1.10)
    args = parser.parse_args()
    curves = {}
    for log in args.logs:
        curves.update(curves_from_log(log))
    curves.update(parse_points(p) for p in args.points)
    print(f"{'genre':<12} {'last tokens':>12} {'last ratio':>10} {'b':>7} {'tokens to ' + str(args.target) + 'x':>16}")
    for genre, curve in curves.items():
        last_tokens, last_ratio = curve[-1]
        if last_ratio <= args.target:
            print(f"{genre:<12} {last_tokens:>12.3g} {last_ratio:>10.3f} {'-':>7} {'reached':>16}")
            continue
        b, needed = tokens_to(curve, args.target)
        shown = "never" if math.isinf(needed) else f"{needed:.3g}"
        print(f"{genre:<12} {last_tokens:>12.3g} {last_ratio:>10.3f} {b:>7.3f} {shown:>16}")


if __name__ == "__main__":
    main()
