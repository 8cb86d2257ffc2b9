"""Where a converted model loses the parent's facts: at which prompt positions, and whether better rows would
bring them back. No training.

    python benchmarks/fact_positions.py runs/smollm2-stem/init        # a conversion of smollm2-135m
    python benchmarks/fact_positions.py CONVERTED --per-layer         # which layers cost facts, each alone

For each packaged factual prompt ("The capital of Spain is" -> " Madrid"), the dense model's top-1 next
token after the prompt is compared with the answer's first token, with the up-projection of the
converted layers replaced by the STEM table row (U[token id]) at chosen positions: nowhere (the dense
model), everywhere (the converted model), everywhere but the prompt's last token, the last token only.
Then the rows of the prompts' tokens are recalibrated on the prompts themselves (the gate-weighted mean
of `--init calib`): an upper bound for what better-estimated rows can give back.

"Converted" reads the rows where the converted model does: every position, or every position but each
prompt's first with the dense first token (`stem_dense_first_token`). `--per-layer` scores each of the
conversion's layers converted alone that way (convert every layer, `--layers all`, to rank them all):
which layers a model that must keep its facts can convert.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stem_upcycle.loading import load_model, load_tokenizer  # noqa: E402
from stem_upcycle.facts import load_facts  # noqa: E402


class PromptRows:
    """One layer's rows of the prompts' distinct ids, indexed by token id as the whole table would be."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor):
        self.ids, self.rows = ids, rows  # sorted [k], [k, intermediate]

    def __getitem__(self, tokens):
        return self.rows[torch.searchsorted(self.ids, torch.as_tensor(tokens))]

    def __setitem__(self, token, row):
        self.rows[torch.searchsorted(self.ids, torch.as_tensor(token))] = row


def read_tables(converted: str, ids: torch.Tensor) -> tuple[dict[int, PromptRows], bool]:
    """({layer: its rows of the sorted `ids`} of a STEM checkpoint written by `convert` or `train`, whether it
    keeps the dense first token). Only those rows are read (`mmap`), whatever the tables weigh."""
    stem, _ = load_model(converted, stem_tables="mmap")
    if getattr(stem.config, "stem_table_columns", None):  # rows of some neurons, in the STEM MLP's order
        raise SystemExit(f"{converted}: its tables hold a share of each layer's neurons (config.stem_table_columns); "
                         f"this benchmark swaps whole layers' rows into the parent: give a model of whole layers")
    tables = {layer: PromptRows(ids, stem.stem_table_rows(layer, ids).float()) for layer in stem.config.stem_layers}
    return tables, bool(getattr(stem.config, "stem_dense_first_token", False))


class TableRows:
    """Forward hooks that replace the dense up-projection's output by table rows where `mask` is set."""

    def __init__(self, model, tables: dict[int, PromptRows]):
        self.tables, self.ids, self.mask = tables, None, None
        self.only = None  # the layers whose rows are read (None: every layer of `tables`)
        for layer in tables:
            model.model.layers[layer].mlp.up_proj.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def replace(module, inputs, out):  # out: [1, T, intermediate]
            if self.mask is None or (self.only is not None and layer not in self.only):
                return out
            return torch.where(self.mask[None, :, None], self.tables[layer][self.ids], out)
        return replace


@torch.no_grad()
def recalibrate_on(model, tables: dict[int, PromptRows], prompts: list[torch.Tensor]) -> None:
    """Rows of the prompts' tokens set to the gate-weighted mean of W_up x over the prompts (dense forward).

    Not CalibratedInit: it cuts one stream into windows (each prompt would see the ones before it) and refits
    every row; here each prompt is run alone and only its tokens' rows change."""
    sums = {layer: {} for layer in tables}

    def accumulate(layer: int, ids: torch.Tensor):
        def hook(mlp, inputs, out):
            x = inputs[0][0]  # [T, hidden]
            weight, up = mlp.act_fn(mlp.gate_proj(x)) ** 2, mlp.up_proj(x)  # [T, intermediate] each
            for position, token in enumerate(ids.tolist()):
                num, den = sums[layer].get(token, (0.0, 0.0))
                sums[layer][token] = (num + weight[position] * up[position], den + weight[position])
        return hook

    for ids in prompts:
        hooks = [model.model.layers[layer].mlp.register_forward_hook(accumulate(layer, ids[0])) for layer in tables]
        model(ids)
        for hook in hooks:
            hook.remove()
    for layer, rows in sums.items():
        for token, (num, den) in rows.items():
            tables[layer][token] = num / den.clamp_min(1e-12)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("converted", help="a STEM conversion of --parent (its tables are read)")
    parser.add_argument("--parent", default="smollm2-135m")
    parser.add_argument("--per-layer", action="store_true", help="facts kept with each layer converted alone")
    args = parser.parse_args()

    model, source = load_model(args.parent)
    tokenizer = load_tokenizer(source)
    facts = load_facts()
    prompts = [tokenizer(f.prompt, return_tensors="pt")["input_ids"] for f in facts]
    tables, dense_first = read_tables(args.converted, torch.cat([ids[0] for ids in prompts]).unique())
    rows = TableRows(model, tables)
    answers = [tokenizer(" " + f.answers[0])["input_ids"][0] for f in facts]

    @torch.no_grad()
    def correct(where) -> int:
        hits = 0
        for ids, answer in zip(prompts, answers):
            rows.ids, rows.mask = ids, where(ids.shape[1])
            hits += int(model(ids).logits[0, -1].argmax()) == answer
        rows.mask = None
        return hits

    last = lambda n: torch.arange(n) == n - 1  # noqa: E731
    converted = lambda n: torch.arange(n) >= int(dense_first)  # noqa: E731  (where the converted model reads rows)
    print(f"{len(facts)} prompts, layers {sorted(tables)}; answer's first token is the top-1 next token:")
    print(f"  dense model:                  {correct(lambda n: None)}")
    if args.per_layer:
        for layer in sorted(tables):
            rows.only = {layer}
            print(f"  layer {layer} alone (converted): {correct(converted)}", flush=True)
        return
    print(f"  rows as converted:            {correct(converted)}")
    print(f"  rows all but the last token:  {correct(lambda n: ~last(n))}")
    print(f"  rows at the last token only:  {correct(last)}")
    recalibrate_on(model, tables, prompts)
    print(f"  rows everywhere, recalibrated on the prompts themselves: {correct(lambda n: torch.ones(n, dtype=torch.bool))}")


if __name__ == "__main__":
    main()
