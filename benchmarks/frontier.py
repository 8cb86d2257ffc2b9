"""The frontier: how many layers to convert, and which, against what a converted model keeps.

    python benchmarks/frontier.py                                  # SmolLM2-135M, the CPU recipe, 1-15 layers
    python benchmarks/frontier.py --counts 1,3 --select auto --skip edits,lastword
    python benchmarks/frontier.py --counts '' --layers 15,21                  # a point of chosen layers

Each point converts COUNT of the source's layers, chosen by `--layers auto:COUNT/N` (every layer
calibrated, each scored alone on calibration windows left out of it and on the completions of the
ranking facts; the calibration text is the recipe's mix of the user's text and text the parent
generated) or evenly spaced from layer 0 (`COUNT/N`), and recovers it with the recipe unchanged
otherwise (`stem-upcycle train RECIPE --set model.layers=...`, its own process). The ranking is
measured once: the first auto point's conversion keeps every layer's costs in its config
(`stem_layer_costs`, `stem_layer_fact_costs`), and the other auto points convert the cheapest COUNT
layers of it as an explicit list (the same choice, without calibrating and scoring all layers
again). Then, each in its own process:

- perplexity ratio to the parent on every held-out set of the recipe (and `--heldout NAME=FILE`
  ones), on the first `--eval-tokens` tokens of each, and factual recall (`stem-upcycle eval --facts`);
- last-word accuracy on the held-out sets (lm-evaluation-harness, `benchmarks/lm_eval_tasks`);
- knowledge-edit success (`examples/knowledge_edit.py`, run-time, mode auto);
- decode speed against the parent (greedy, 64 new tokens after a 64-token prompt, the two models in
  turns in one process, tables placed with mmap);
- the model's weight files on disk (tables and dense weights).

A point's model is OUTPUT/POINT/model; every figure of it is kept in OUTPUT/POINT/frontier.json as it
is measured: a second run reads them back and measures only what is missing (a training cut short
is resumed with `stem-upcycle train --resume` by hand, or its folder removed). The parent's row is
measured the same way.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stem_upcycle.table_init.layer_choice import rank_layers  # noqa: E402
from stem_upcycle.training.recipe import load_recipe  # noqa: E402

PARTS = ("train", "eval", "lastword", "edits", "decode")


def run(command: list[str]) -> str:
    """stdout of `command` (stderr passes through); a failure stops the benchmark."""
    return subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT).stdout


# Whole layers as their points were measured: the recipe's fit with 4 local epochs, whatever columns and epochs the
# recipe names now (recipes/smollm2-135m-cpu.yaml converts a share of every layer's neurons, with 2)
WHOLE_LAYERS = ["model.columns=all", "local.epochs=4"]
# A run whose model.init_from is converted already (or dense): the recipe's conversion keys, which it refuses beside
# init_from, turned off
CONVERTED_ALREADY = ["model.columns=all", "local.sequential=false", "local.refit_down=0", "local.epochs=0"]


def stem(*args) -> list[str]:
    return [sys.executable, "-m", "stem_upcycle.cli", *map(str, args)]


def train(recipe: str, out: Path, layers: str, overrides: list[str]) -> dict:
    if not (out / "config.json").exists():
        started = time.perf_counter()
        sets = [w for o in [f"model.layers={layers}", *overrides] for w in ("--set", o)]
        run(stem("train", recipe, "--output", out, "--quiet", *sets))
        seconds = time.perf_counter() - started
    else:
        seconds = None  # trained by an earlier run of this benchmark, not timed now
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    config = json.loads((out / "config.json").read_text())
    return {"seconds": seconds, "layers": config["stem_layers"], "tokens": log[-1]["tokens"],
            "peak_rss_gb": log[-1].get("peak_rss_gb"), "layer_costs": config.get("stem_layer_costs"),
            "start_ratio": {n: e["ppl_ratio"] for n, e in log[0]["eval"].items()},  # the conversion, untrained
            "rows_covered": {n: e.get("rows_covered") for n, e in log[-1]["eval"].items()}}


def evaluate(model: str, reference: str, sets: dict[str, list[str]], tokens: int) -> dict:
    data = [w for name, files in sets.items() for f in files for w in ("--data", f"{name}={f}")]
    out = json.loads(run(stem("eval", model, *data, "--reference", reference, "--max-tokens", tokens, "--facts",
                              "--json", "--quiet")))
    return {"ratio": {n: r["ppl_ratio"] for n, r in out["sets"].items()},
            "facts": out["facts"]["correct"], "facts_total": out["facts"]["total"],
            "reference_facts": out["reference_facts"]["correct"]}


def lastword(model: str, output: Path) -> dict:
    tasks = "stem_lastword_plays,stem_lastword_novel,stem_lastword_proceedings,stem_lastword_docs"
    run([sys.executable, "benchmarks/lm_eval_suite.py", f"m={model}", "--tasks", tasks, "--output", output])
    figures = json.loads(output.read_text())["m"]
    return {task.removeprefix("stem_lastword_"): m["acc"] for task, m in figures.items()}


def edits(model: str, output: Path) -> dict:
    run([sys.executable, "examples/knowledge_edit.py", model, "--json", output])
    summary = json.loads(output.read_text())["modes"]["auto"]["summary"]
    return {k: summary[k] for k in ("knows_source", "runtime_success", "persistent_success")}


def decode_speed(model: str, reference: str, rounds: int = 3) -> dict:
    """Tokens/s of greedy decoding, the STEM model and its parent in turns: medians and their ratio."""
    from stem_upcycle.loading import load_model

    stem_model, _ = load_model(model, stem_tables="mmap")
    dense, _ = load_model(reference)
    prompt = torch.randint(0, dense.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    speeds = {"stem": [], "dense": []}
    with torch.no_grad():
        for m in (stem_model, dense):
            m.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        for _ in range(rounds):
            for name, m in (("stem", stem_model), ("dense", dense)):
                started = time.perf_counter()
                m.generate(prompt, **kwargs)
                speeds[name].append(64 / (time.perf_counter() - started))
    stem_s, dense_s = statistics.median(speeds["stem"]), statistics.median(speeds["dense"])
    return {"stem_tokens_per_s": stem_s, "dense_tokens_per_s": dense_s, "speedup": stem_s / dense_s}


def file_bytes(model: str) -> int:
    """The model's weight files on disk: its tables, and the dense weights (W_up kept for first tokens)."""
    return sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))


def measure(name: str, model: str, folder: Path, args, sets, recipe, layers: str | None) -> dict:
    """Every figure of one point, read back where an earlier run measured it."""
    folder.mkdir(parents=True, exist_ok=True)
    record_path = folder / "frontier.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    steps = {
        "train": lambda: train(args.recipe, Path(model), layers, [*WHOLE_LAYERS, *args.set]) if layers else None,
        "eval": lambda: evaluate(model, recipe.model.source, sets, args.eval_tokens),
        "lastword": lambda: lastword(model, folder / "lastword.json"),
        "edits": lambda: edits(model, folder / "edits.json") if layers else None,
        "decode": lambda: decode_speed(model, recipe.model.source) if layers else None,
    }
    for part, step in steps.items():
        if part in record or part in args.skip:
            continue
        started = time.perf_counter()
        record[part] = step()
        print(f"{name}: {part} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        record_path.write_text(json.dumps(record, indent=1))
    if layers:
        record["file_bytes"] = file_bytes(model)
        record_path.write_text(json.dumps(record, indent=1))
    return record


def measured_ranking(output: Path) -> list[int] | None:
    """Every layer, cheapest first, as an earlier auto point's conversion ranked them (None before)."""
    for config in sorted(output.glob("auto-*/model/config.json")):
        config = json.loads(config.read_text())
        if costs := config.get("stem_layer_costs"):
            fact_costs = config.get("stem_layer_fact_costs")  # absent where a conversion ranked by text alone
            return rank_layers({int(k): v for k, v in costs.items()},
                               fact_costs and {int(k): v for k, v in fact_costs.items()})
    return None


def markdown(results: dict, set_names: list[str]) -> str:
    head = (["point", "layers", "trained (tokens, min)", "converted, mean ratio"] + [f"{s} ratio" for s in set_names] + ["facts"]
            + [f"last word {s}" for s in ("plays", "novel", "proceedings", "docs")]
            + ["edits (run-time)", "decode vs parent", "files GB"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        t, e, w, ed, d = (r.get(k) or {} for k in ("train", "eval", "lastword", "edits", "decode"))
        start = t.get("start_ratio") or {}
        trained = f"{t['tokens'] // 1024}k, " + (f"{t['seconds'] / 60:.0f}" if t.get("seconds") else "-") if t else "-"
        cells = [name, str(t.get("layers", "-")), trained,
                 f"{statistics.fmean(start.values()):.3f}x" if start else "-"]
        cells += [f"{e['ratio'][s]:.3f}x" if e.get("ratio") and s in e["ratio"] else "-" for s in set_names]
        cells += [f"{e['facts']}/{e['facts_total']}" if e else "-"]
        cells += [f"{w[s]:.1%}" if s in w else "-" for s in ("plays", "novel", "proceedings", "docs")]
        cells += [f"{ed['runtime_success']:.0%}" if ed else "-", f"{d['speedup']:.2f}x" if d else "-",
                  f"{r['file_bytes'] / 1e9:.2f}" if r.get("file_bytes") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.yaml")
    parser.add_argument("--output", type=Path, default=Path("runs/frontier"))
    parser.add_argument("--counts", default="1,3,5,10,15", help="layers converted, comma-separated")
    parser.add_argument("--select", default="auto,even", help="auto (--layers auto:), even (evenly spaced), or both")
    parser.add_argument("--layers", action="append", default=[], metavar="L1,L2,...",
                        help="a point converting exactly these layers (beside --counts; --counts '' for none)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a recipe override for every point (as `train --set`)")
    parser.add_argument("--heldout", action="append", default=[], metavar="NAME=FILE",
                        help="another held-out set to score (beside the recipe's data.eval)")
    parser.add_argument("--eval-tokens", type=int, default=8192, help="tokens scored per held-out set")
    parser.add_argument("--skip", default="", help=f"parts not measured: {', '.join(PARTS[1:])}")
    args = parser.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    os.chdir(ROOT)
    recipe = load_recipe(args.recipe, args.set)
    sets = {name: list(files) for name, files in recipe.data.eval.items()}
    for item in args.heldout:
        name, _, path = item.partition("=")
        sets.setdefault(name, []).append(path)
    from stem_upcycle.source import open_source

    layers_total = open_source(recipe.model.source).config.num_hidden_layers
    print(f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
          file=sys.stderr)
    measure("parent", recipe.model.source, args.output / "parent", args, sets, recipe, None)
    for count in map(int, filter(None, args.counts.split(","))):
        for select in args.select.split(","):
            ranking = measured_ranking(args.output) if select == "auto" else None
            spec = (f"{count}/{layers_total}" if select == "even" else f"auto:{count}/{layers_total}" if ranking is None
                    else ",".join(map(str, sorted(ranking[:count]))))
            name = f"{select}-{count}"
            folder = args.output / name
            measure(name, str(folder / "model"), folder, args, sets, recipe, spec)
            (args.output / "frontier.md").write_text(markdown(every_point(args.output), list(sets)) + "\n")
    for spec in args.layers:
        folder = args.output / f"layers-{spec.replace(',', '-')}"
        measure(folder.name, str(folder / "model"), folder, args, sets, recipe, spec)
        (args.output / "frontier.md").write_text(markdown(every_point(args.output), list(sets)) + "\n")
    print(markdown(every_point(args.output), list(sets)))


def every_point(output: Path) -> dict:
    """The parent and every point measured into OUTPUT so far (by this run or earlier ones), by layer count."""
    records = {p.parent.name: json.loads(p.read_text()) for p in output.glob("*/frontier.json")}
    order = lambda name: (name != "parent", len((records[name].get("train") or {}).get("layers", [])), name)
    return {name: records[name] for name in sorted(records, key=order)}


if __name__ == "__main__":
    main()
