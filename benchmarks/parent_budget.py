"""The default conversion's quality against the parent positions its rows read (issue 58).

    python benchmarks/parent_budget.py --reads 1,2,4,16                      # every budget, on one sampled text
    python benchmarks/parent_budget.py --reads 2 --seeds 0,1,2 --before DIR  # the default against the code in DIR
                                                                             # (a checkout from before budgets)
    python benchmarks/parent_budget.py --reads 2 --tokens 65536,32768 --seeds 0,2  # half the sampled text

Each point is `stem-upcycle convert smollm2-135m OUT --parent-reads B` (every other option its default: a sixth of
every layer's neurons, 16 contexts, the text sampled from SmolLM2), scored as `stem-upcycle eval OUT --reference
smollm2-135m --facts --max-tokens 4096` on eight held-out genres (scripts/get-shakespeare.sh, get-ood-texts.sh): the
perplexity ratio of each, the mean of the first seven, and the facts kept of 53. `--seeds`: the calibration text is
sampled at each seed (convert samples at seed 0 and has no option for it; the child process sets it), once, into a
cache the points of that seed share, so that a point differs from the others of its seed by its code or its budget
alone: the text sampled changes a model's quality more than the budget does (see benchmarks/README.md). `--before
DIR` converts with the package in DIR (`git worktree add DIR COMMIT`) as well, for a pairwise comparison. Results are
kept in OUTPUT/SEED/POINT/result.json; a second run measures only what is missing.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GENRES = {"plays": ["data/shakespeare/hamlet_gut.txt", "data/shakespeare/macbeth_gut.txt"],
          "novel": ["data/ood/botchan.txt"], "proceedings": ["data/ood/lcet10.txt"], "docs": ["data/ood/flask_docs.txt"],
          "news": ["data/ood/news.txt"], "speeches": ["data/ood/speeches.txt"], "science": ["data/ood/science.txt"],
          "scripture": ["data/ood/scripture.txt"]}
# the calibration text's seed, set where either code's convert asks for its sampling (128 sequences a batch, as the
# default samples; an older convert's 32 are overridden, so that both read the same text)
SEEDED = """import sys, stem_upcycle.generate as g
covering = g.Sampling.covering.__func__
def seeded(cls, tokens, **settings):
    settings["batch_size"], settings["seed"] = 128, {seed}
    return covering(cls, tokens, **settings)
g.Sampling.covering = classmethod(seeded)
from stem_upcycle.cli import main
main(sys.argv[1:])
"""


def convert(out: Path, seed: int, cache: Path, code: Path | None, extra: list[str]) -> float:
    env = {**os.environ, "STEM_UPCYCLE_CACHE": str(cache)}
    if code is not None:  # that checkout's package ahead of this one's
        env["PYTHONPATH"] = str(code)
    started = time.perf_counter()
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-c", SEEDED.format(seed=seed), "convert", "smollm2-135m", str(out),
                               *extra], env=env, cwd=code or ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"convert failed: {log}")
    return time.perf_counter() - started


def scores(model: str) -> dict:
    """{"ppl": {genre: perplexity}, "facts": facts kept} of `model` by `stem-upcycle eval` (each point alone: the
    parent is scored once, its ratios taken against it)."""
    data = [w for name, files in GENRES.items() for f in files for w in ("--data", f"{name}={ROOT / f}")]
    done = subprocess.run(["stem-upcycle", "eval", model, *data, "--max-tokens", "4096", "--facts", "--json",
                           "--quiet"], capture_output=True, text=True, check=True)
    out = json.loads(done.stdout)
    return {"ppl": {name: s["ppl"] for name, s in out["sets"].items()}, "facts": out["facts"]["correct"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", default="1,2,4,16", help="--parent-reads of each point")
    parser.add_argument("--seeds", default="0", help="the calibration text's sampling seeds")
    parser.add_argument("--tokens", default="65536", help="--calib-generate (and --calib-tokens) of each point")
    parser.add_argument("--before", type=Path, default=None, help="a checkout whose convert is a point too")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "parent_budget")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    points = {f"reads {b}" + (f", {t} tokens" if t != "65536" else ""):
              (None, ["--parent-reads", b, *(["--calib-generate", t, "--calib-tokens", t] if t != "65536" else [])])
              for t in args.tokens.split(",") for b in args.reads.split(",")}
    if args.before:
        points["before"] = (args.before.resolve(), [])
    reference = args.output / "reference.json"
    if not reference.exists():
        args.output.mkdir(parents=True, exist_ok=True)
        reference.write_text(json.dumps(scores("smollm2-135m")))
    parent = json.loads(reference.read_text())
    print(f"the parent: {parent['facts']} facts")
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, (code, extra) in points.items():
            folder = args.output / f"seed-{seed}" / name.replace(", ", "-").replace(" ", "-")
            result = folder / "result.json"
            if not result.exists():
                folder.mkdir(parents=True, exist_ok=True)
                model = folder / "model"
                seconds = convert(model, seed, args.output / "cache", code, extra)
                scored = scores(str(model))
                ratio = {name: scored["ppl"][name] / parent["ppl"][name] for name in GENRES}
                result.write_text(json.dumps({"convert_seconds": seconds, "ratio": ratio, "facts": scored["facts"]}))
                subprocess.run(["rm", "-rf", str(model)])
            rows.append((seed, name, json.loads(result.read_text())))
    print("| seed | point | " + " | ".join(GENRES) + " | mean of 7 | facts | convert s |")
    print("|---" * (len(GENRES) + 5) + "|")
    for seed, name, r in rows:
        ratios = [r["ratio"][g] for g in GENRES]
        print(f"| {seed} | {name} | " + " | ".join(f"{x:.3f}" for x in ratios)
              + f" | {sum(ratios[:7]) / 7:.3f} | {r['facts']} | {r['convert_seconds']:.0f} |")


if __name__ == "__main__":
    main()
