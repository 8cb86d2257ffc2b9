"""Staged recovery: what each stage of the layer fit adds, against today's recipe at equal wall time.

    python benchmarks/staged_recovery.py --layers 1/3 --steps 14 --baseline-steps 20
    python benchmarks/staged_recovery.py --layers 0,5,8,10,12 --steps 3 --baseline-steps 8 --output runs/staged/five

For one choice of layers (`model.layers`), each point runs `stem-upcycle train RECIPE` in its own process:

- `stage1`: rows calibrated layer after layer on the converted model's inputs (`local.sequential`);
- `stage12`: and W_down refit to the parent MLP's outputs (`local.refit_down`);
- `staged`: and `local.epochs` of local training; its starting point (OUTPUT/staged/model/init) is the point
  `stage123`, the model after `--steps` end-to-end steps is `staged`;
- `today`: the recipe without a fit (calibration on the dense model's inputs), `--baseline-steps` end-to-end
  steps: pick them so that its wall time matches `staged`'s (both are printed).

The stage points train one step only to write their starting point (kept as OUTPUT/POINT/model/init), which is
what is scored. Every model is scored by `stem-upcycle eval --facts` on the recipe's held-out sets and the
`--heldout` ones (perplexity ratio to the parent, facts), and the trained ones on last-word accuracy
(lm-evaluation-harness, `--skip lastword` to leave it out). Figures are kept in OUTPUT/POINT/staged.json as they
are measured; a second run measures only what is missing. The local stage's tokens/s (tokens x converted layers x
epochs / its seconds, and per whole model: / converted layers) is printed next to end-to-end training's.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import ROOT, evaluate, lastword, run, stem  # noqa: E402
from inference import machine  # noqa: E402

FIT = {"local.sequential": "true", "local.refit_down": "1e-3", "local.epochs": "4"}
OFF = {"local.sequential": "false", "local.refit_down": "0", "local.epochs": "0"}
POINTS = {  # name: (local settings, trained end to end, the model scored: its starting point or the trained one)
    "today": (OFF, "baseline", ["model"]),
    "stage1": ({**OFF, "local.sequential": "true"}, "one", ["init"]),
    "stage12": ({**OFF, "local.sequential": "true", "local.refit_down": FIT["local.refit_down"]}, "one", ["init"]),
    "staged": (FIT, "steps", ["init", "model"]),
}


def train(recipe: str, out: Path, overrides: list[str]) -> dict:
    """Train into `out` (once) and return its wall time, the log's figures and the fit's record."""
    record = {}
    if not (out / "config.json").exists():
        started = time.perf_counter()
        run(stem("train", recipe, "--output", out, "--quiet", *[w for o in overrides for w in ("--set", o)]))
        record["seconds"] = time.perf_counter() - started
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    init = json.loads((out / "init" / "config.json").read_text()) if (out / "init").exists() else {}
    steps = [entry for entry in log if "tokens_per_s" in entry]
    record.update(tokens=log[-1]["tokens"], layers=json.loads((out / "config.json").read_text())["stem_layers"],
                  e2e_tokens_per_s=sum(e["tokens_per_s"] for e in steps) / len(steps),
                  generated_seconds=log[0].get("generated", {}).get("seconds", 0.0),  # 0: cached by an earlier run
                  fit=init.get("stem_fit"))
    return record


def measure(name: str, folder: Path, args, sets: dict) -> dict:
    local, steps, scored = POINTS[name]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "staged.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    steps = {"baseline": args.baseline_steps, "one": 1, "steps": args.steps}[steps]
    overrides = [f"model.layers={args.layers}", "model.columns=all", f"train.steps={steps}",
                 f"train.eval_every={steps}",
                 *(["model.keep_init=true"] if "init" in scored else []), *(f"{k}={v}" for k, v in local.items()), *args.set]
    if "train" not in record:
        record["train"] = train(args.recipe, folder / "model", overrides)
        path.write_text(json.dumps(record, indent=1))
    if "start_ratio" not in record["train"]:  # the conversion before end-to-end training, on data.eval_tokens
        first = json.loads((folder / "model" / "train_log.jsonl").read_text().splitlines()[0])
        record["train"]["start_ratio"] = {n: e["ppl_ratio"] for n, e in first["eval"].items()}
        path.write_text(json.dumps(record, indent=1))
    for which in scored:
        model = folder / "model" if which == "model" else folder / "model" / "init"
        for part, step in (("eval", lambda: evaluate(str(model), args.source, sets, args.eval_tokens)),
                           ("lastword", lambda: lastword(str(model), folder / f"lastword-{which}.json"))):
            key = f"{part}_{which}"
            if key in record or {part, which} & args.skip or (part == "lastword" and which == "init"):
                continue
            started = time.perf_counter()
            record[key] = step()
            print(f"{name} {which}: {part} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
            path.write_text(json.dumps(record, indent=1))
    return record


def rows(records: dict, set_names: list[str]) -> list[dict]:
    """One row per scored model: stage1, stage12, stage123 (staged's starting point), staged, today."""
    order = [("stage1", "init"), ("stage12", "init"), ("stage123", "init"), ("staged", "model"), ("today", "model")]
    table = []
    for label, which in order:
        record = records.get("staged" if label == "stage123" else label)
        if not record or f"eval_{which}" not in record:
            continue
        t, e = record["train"], record[f"eval_{which}"]
        trained = which == "model"
        fit_seconds = sum((t.get("fit") or {}).get("seconds", {}).values())
        table.append({"point": label, "e2e_tokens": t["tokens"] if trained else 0,
                      "minutes": (t["seconds"] - t["generated_seconds"]) / 60 if trained and t.get("seconds") else None,
                      "fit_seconds": fit_seconds, "ratio": e["ratio"], "facts": f"{e['facts']}/{e['facts_total']}",
                      "lastword": record.get(f"lastword_{which}")})
    return table


def markdown(table: list[dict], set_names: list[str]) -> str:
    head = ["point", "end-to-end tokens", "fit s", "wall min"] + set_names + ["facts", "last word (mean of 4)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        lw = r["lastword"]
        cells = [r["point"], f"{r['e2e_tokens'] // 1024}k", f"{r['fit_seconds']:.0f}",
                 f"{r['minutes']:.1f}" if r["minutes"] else "-"]
        cells += [f"{r['ratio'][s]:.3f}x" for s in set_names]
        cells += [r["facts"], f"{sum(lw.values()) / len(lw):.1%}" if lw else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.yaml")
    parser.add_argument("--layers", default="1/3", help="model.layers of every point")
    parser.add_argument("--steps", type=int, default=14, help="end-to-end steps after the fit (the staged point)")
    parser.add_argument("--baseline-steps", type=int, default=20, help="end-to-end steps of today's recipe")
    parser.add_argument("--points", default=",".join(POINTS), help="points to measure, comma-separated")
    parser.add_argument("--output", type=Path, default=Path("runs/staged/third"))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a recipe override for every point (as `train --set`)")
    parser.add_argument("--heldout", action="append", default=[], metavar="NAME=FILE",
                        help="another held-out set to score (beside the recipe's data.eval)")
    parser.add_argument("--eval-tokens", type=int, default=8192, help="tokens scored per held-out set")
    parser.add_argument("--skip", default="", help="parts not measured: lastword, init (the starting points' scores)")
    args = parser.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    os.chdir(ROOT)
    from stem_upcycle.training.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.set)
    args.source = recipe.model.source
    sets = {name: list(files) for name, files in recipe.data.eval.items()}
    for item in args.heldout:
        name, _, path = item.partition("=")
        sets.setdefault(name, []).append(path)
    print(machine(), file=sys.stderr)
    records = {}
    for name in args.points.split(","):
        records[name] = measure(name, args.output / name, args, sets)
        (args.output / "staged.md").write_text(markdown(rows(records, list(sets)), list(sets)) + "\n")
    staged = records.get("staged", {}).get("train", {})
    if fit := staged.get("fit"):
        layer_tokens = recipe.model.calib_tokens * len(staged["layers"]) * fit["epochs"]
        print(f"local stage: {layer_tokens / fit['seconds']['train']:.0f} layer-tokens/s "
              f"({layer_tokens / len(staged['layers']) / fit['seconds']['train']:.0f} tokens/s through every converted "
              f"layer); end-to-end training: {staged['e2e_tokens_per_s']:.0f} tokens/s; fit seconds {fit['seconds']}")
    print(markdown(rows(records, list(sets)), list(sets)))
    for name, record in records.items():  # today's starting point is the calibration without stage 1
        start = record["train"]["start_ratio"]
        print(f"{name} before end-to-end training ({recipe.data.eval_tokens} tokens a set, train_log step 0): "
              + ", ".join(f"{n} {r:.3f}x" for n, r in start.items()))


if __name__ == "__main__":
    main()
