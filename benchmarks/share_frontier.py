"""The frontier by what a user saves: quality against the share of the up-projection that became rows, whole
layers against a share of every layer's neurons (issue 48).

    python benchmarks/share_frontier.py                          # 1/6, 1/3 and 1/2 of W_up, every mode
    python benchmarks/share_frontier.py --shares 1/3 --modes neurons --steps neurons=6
    python benchmarks/share_frontier.py --heldout news=data/ood/news.txt --heldout speeches=data/ood/speeches.txt

Each point runs the CPU recipe (`--recipe`, recipes/smollm2-135m-cpu.yaml: calibration, the layer fit, end-to-end
recovery) with one way of replacing SHARE of all W_up columns by table columns:

- layers: SHARE of the layers, evenly spaced from layer 0, whole (`model.layers=N/30`): the recipe as it was
  (`model.columns=all`, 4 epochs of the layer fit: frontier.WHOLE_LAYERS);
- neurons: SHARE of every layer's neurons, the cheapest by their error as table columns (`model.layers=all,
  model.columns=SHARE`);
- spread: SHARE of all layers' neurons together, spread over the layers by that error (`model.columns=auto:SHARE`);
- unshrunk: as neurons, a calibrated mean taken as it is however few its positions (`model.shrink=0`), the parent's
  row only for a token the calibration never shows;
- ridge: as neurons without the parent's rows (`model.parent_contexts=0`): calibrated means as they are, a ridge map
  from the embedding for unseen tokens (the rows before issue 53).

The three replace as many W_up columns (SHARE x layers x d_ff), so their tables hold as many numbers. A token reads
the rest: the share of the FFN's weights it reads that became rows is SHARE / 3. Equal wall time: the layer fit
walks 30 layers for the neuron modes and SHARE x 30 for whole layers, so each mode's end-to-end steps are set apart
(`--steps MODE=N`; the recipe's otherwise; `--mode-set MODE:KEY=VALUE` sets any other key of a mode's points) and
every point's wall time is printed and kept, to set them equal.

Every point is scored as frontier.py scores its points, each part in its own process: the perplexity ratio to the
parent on the recipe's held-out sets and `--heldout` ones, facts (`stem-upcycle eval --facts`), last-word accuracy
(lm-evaluation-harness), greedy decode tokens/s against the parent (eager, mmap), the weight files. Figures are kept
in OUTPUT/POINT/frontier.json as they are measured; a second run measures only what is missing (a `--heldout` set
added since: that set alone). Compiled decode at the same share, and at Llama-3.2-1B's shape:
benchmarks/compiled_decode.py --columns.
"""

import argparse
import json
import os
import sys
import time
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import ROOT, WHOLE_LAYERS, decode_speed, evaluate, file_bytes, lastword, train  # noqa: E402
from inference import machine  # noqa: E402

MODES = ("layers", "neurons", "spread", "unshrunk", "ridge")
PARTS = ("train", "eval", "lastword", "decode")


def overrides(mode: str, share: Fraction, layers: int) -> tuple[str, list[str]]:
    """(model.layers, the other overrides) of a point."""
    if mode == "layers":
        return f"{round(share * layers)}/{layers}", list(WHOLE_LAYERS)
    rows = {"unshrunk": ["model.shrink=0"], "ridge": ["model.parent_contexts=0"]}.get(mode, [])
    return "all", [f"model.columns={'auto:' if mode == 'spread' else ''}{share.numerator}/{share.denominator}", *rows]


def measure(name: str, folder: Path, args, sets: dict, source: str, layers: str | None, extra: list[str]) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "frontier.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    model = str(folder / "model") if layers else source
    steps = {
        "train": lambda: train(args.recipe, Path(model), layers, [*args.set, *extra]) if layers else None,
        "eval": lambda: evaluate(model, source, sets, args.eval_tokens),
        "lastword": lambda: lastword(model, folder / "lastword.json"),
        "decode": lambda: decode_speed(model, source) if layers else None,
    }
    scored = (record.get("eval") or {}).get("ratio")
    if scored is not None and set(sets) - set(scored):  # held-out sets added since: scored alone, the rest kept
        missing = {name: files for name, files in sets.items() if name not in scored}
        scored.update(evaluate(model, source, missing, args.eval_tokens)["ratio"])
        path.write_text(json.dumps(record, indent=1))
    for part, step in steps.items():
        if part in record or part in args.skip:
            continue
        started = time.perf_counter()
        record[part] = step()
        print(f"{name}: {part} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        path.write_text(json.dumps(record, indent=1))
    if layers:
        config = json.loads((Path(model) / "config.json").read_text())
        d_ff, count = config["intermediate_size"], config["num_hidden_layers"]
        columns = config.get("stem_table_columns") or {str(layer): d_ff for layer in config["stem_layers"]}
        record.update(file_bytes=file_bytes(model), table_columns=columns,
                      up_share=sum(columns.values()) / (d_ff * count))
        path.write_text(json.dumps(record, indent=1))
    return record


def markdown(results: dict, sets: list[str]) -> str:
    head = ["point", "W_up as rows", "layers", "wall time", "converted, mean"] + sets + ["facts", "last word",
                                                                                        "decode", "files GB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        t, e, w, d = (r.get(k) or {} for k in ("train", "eval", "lastword", "decode"))
        start = t.get("start_ratio") or {}
        cells = [name, f"{r['up_share']:.1%}" if "up_share" in r else "-", str(len(t.get("layers", []))) or "-",
                 f"{t['seconds'] / 60:.1f} min" if t.get("seconds") else "-",
                 f"{sum(start.values()) / len(start):.2f}x" if start else "-"]
        cells += [f"{e['ratio'][s]:.3f}x" if s in e.get("ratio", {}) else "-" for s in sets]
        cells += [f"{e['facts']}/{e['facts_total']}" if e else "-",
                  f"{sum(w.values()) / len(w):.1%}" if w else "-", f"{d['speedup']:.2f}x" if d else "-",
                  f"{r['file_bytes'] / 1e9:.2f}" if r.get("file_bytes") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.yaml")
    parser.add_argument("--output", type=Path, default=Path("runs/share-frontier"))
    parser.add_argument("--shares", default="1/6,1/3,1/2", help="shares of all W_up columns replaced")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--steps", action="append", default=[], metavar="MODE=N",
                        help="end-to-end steps of a mode's points (default: the recipe's)")
    parser.add_argument("--mode-set", action="append", default=[], metavar="MODE:SECTION.KEY=VALUE",
                        help="a recipe override for a mode's points (the layer fit's epochs, say)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a recipe override for every point (as `train --set`)")
    parser.add_argument("--heldout", action="append", default=[], metavar="NAME=FILE",
                        help="another held-out set to score (beside the recipe's data.eval)")
    parser.add_argument("--eval-tokens", type=int, default=8192, help="tokens scored per held-out set")
    parser.add_argument("--skip", default="", help=f"parts not measured: {', '.join(PARTS[1:])}")
    parser.add_argument("--plot", type=Path, help="also draw every point measured into OUTPUT to this PNG")
    args = parser.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    os.chdir(ROOT)
    from stem_upcycle.source import open_source
    from stem_upcycle.training.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.set)
    sets = {name: list(files) for name, files in recipe.data.eval.items()}
    for item in args.heldout:
        name, _, path = item.partition("=")
        sets.setdefault(name, []).append(path)
    steps = dict(item.split("=") for item in args.steps)
    layers = open_source(recipe.model.source).config.num_hidden_layers
    print(machine(), file=sys.stderr)
    measure("parent", args.output / "parent", args, sets, recipe.model.source, None, [])
    for share in map(Fraction, args.shares.split(",")):
        for mode in args.modes.split(","):
            spec, extra = overrides(mode, share, layers)
            if mode in steps:
                extra += [f"train.steps={steps[mode]}", f"train.eval_every={steps[mode]}"]
            extra += [item.split(":", 1)[1] for item in args.mode_set if item.split(":", 1)[0] == mode]
            name = f"{mode}-{share.numerator}of{share.denominator}"
            measure(name, args.output / name, args, sets, recipe.model.source, spec, extra)
            (args.output / "frontier.md").write_text(markdown(every_point(args.output), list(sets)) + "\n")
    print(markdown(every_point(args.output), list(sets)))
    if args.plot:
        plot(every_point(args.output), list(sets), args.plot)


def plot(results: dict, sets: list[str], path: Path) -> None:
    """Per mode, the mean and the worst perplexity ratio over the held-out sets against the share of W_up as rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.6), dpi=110)
    for mode, color in zip(MODES, ("tab:red", "tab:blue", "tab:green", "tab:orange", "tab:grey")):
        points = sorted((r["up_share"], [r["eval"]["ratio"][s] for s in sets if s in r["eval"]["ratio"]])
                        for name, r in results.items() if name.startswith(mode + "-") and "eval" in r)
        if points:
            shares = [100 * share for share, _ in points]
            axis.plot(shares, [max(ratios) for _, ratios in points], "o-", color=color, label=f"{mode}: worst genre")
            axis.plot(shares, [sum(ratios) / len(ratios) for _, ratios in points], "s--", color=color,
                      label=f"{mode}: mean of genres")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel("share of all W_up columns as table rows (%)")
    axis.set_ylabel("perplexity / parent's")
    axis.set_title("SmolLM2-135M, CPU recipe: whole layers vs a share of every layer's neurons", fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


def every_point(output: Path) -> dict:
    records = {p.parent.name: json.loads(p.read_text()) for p in output.glob("*/frontier.json")}
    order = lambda name: (name != "parent", records[name].get("up_share", 0), name)
    return {name: records[name] for name in sorted(records, key=order)}


if __name__ == "__main__":
    main()
