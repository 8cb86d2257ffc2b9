"""The fair comparison: the dense model fine-tuned by the same recipe, on the same tokens.

    python benchmarks/dense_finetune.py --stem-run runs/smollm2-stem      # after the CPU recipe

Runs `stem-upcycle train` with the recipe's data, batches, steps, losses and learning rate on the
dense source itself (`model.init_from` = the dense model, trainable = mlp, norms, attention: all
but the embeddings, as the STEM recipe trains all but embeddings and tables), then prints the
held-out curves of both runs side by side (same held-out tokens, same dense reference).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import CONVERTED_ALREADY  # noqa: E402
from stem_upcycle.loading import load_tokenizer, model_from_source  # noqa: E402
from stem_upcycle.source import open_source  # noqa: E402
from stem_upcycle.training.recipe import load_recipe  # noqa: E402
from stem_upcycle.training.trainer import Trainer  # noqa: E402


def curve(run: Path) -> dict[int, dict]:
    """{tokens trained: {held-out set: figures}} from a run's log."""
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return {r["tokens"]: r["eval"] for r in records if "eval" in r}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.yaml")
    parser.add_argument("--output", default="runs/dense-finetune")
    parser.add_argument("--stem-run", type=Path, help="output directory of the STEM run to compare with")
    args = parser.parse_args()

    recipe = load_recipe(args.recipe)
    with tempfile.TemporaryDirectory() as tmp:
        source = open_source(recipe.model.source)
        model_from_source(source).save_pretrained(tmp)  # a GGUF source becomes a plain directory
        load_tokenizer(source).save_pretrained(tmp)
        recipe = load_recipe(args.recipe, [f"model.init_from={tmp}", "train.trainable=[mlp, norms, attention]",
                                           "train.checkpoint_every=0", *CONVERTED_ALREADY])
        Trainer(recipe, Path(args.output), progress=True).run()
    dense = curve(Path(args.output))
    stem = curve(args.stem_run) if args.stem_run else {}
    for name in next(iter(dense.values())):
        print(f"held-out set {name}: perplexity (ratio to the untrained dense model)")
        print(f"{'tokens':>8} {'dense (untrained)':>18} {'dense fine-tuned':>22} {'STEM':>22}")
        for tokens, sets in dense.items():
            d = sets[name]
            other = stem.get(tokens, {}).get(name)
            stem_cell = f"{other['ppl']:.2f} ({other['ppl_ratio']:.3f}x)" if other else "-"
            print(f"{tokens:>8} {d['ref_ppl']:>18.2f} {d['ppl']:>12.2f} ({d['ppl_ratio']:.3f}x) {stem_cell:>22}")


if __name__ == "__main__":
    main()
