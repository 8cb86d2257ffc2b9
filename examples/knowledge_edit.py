"""Knowledge editing on a STEM model: make one entity's tokens read another's table rows, and measure it.

    python examples/knowledge_edit.py runs/smollm2-stem                  # the recovered demo model
    python examples/knowledge_edit.py runs/smollm2-stem/init --json out.json

1. One edit, before and after: "The capital of Spain is" with Spain's rows swapped for Germany's.
2. Injection: a made-up word given the rows of a description ("the capital of France").
3. The pairs of examples/data/entity_pairs.jsonl (countries and capitals, people and professions,
   companies and products), kept only where the dense parent answers both prompts correctly:
   - edit success: the edited model's answer to the source's prompt is the target's answer;
   - collateral (persistent edits): prompts about the other entities whose answer changes, i.e.
     whose correctness flips (and, stricter, whose greedy text changes at all).
   A run-time edit changes rows only at the entity's positions in its own prompt, so it has no
   collateral on other prompts by construction; it is measured for success only.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from stem_upcycle import editing
from stem_upcycle.facts import Fact, complete
from stem_upcycle.loading import load_model, load_tokenizer

PAIRS = Path(__file__).parent / "data" / "entity_pairs.jsonl"
NEW_TOKENS = 8  # as stem_upcycle.facts scores recall


def load_pairs(path):
    pairs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for pair in pairs:
        pair["source_fact"] = Fact(pair["prompt"].format(pair["source"]), tuple(pair["source_answers"]))
        pair["target_fact"] = Fact(pair["prompt"].format(pair["target"]), tuple(pair["target_answers"]))
    return pairs


@torch.no_grad()
def complete_all(model, tokenizer, prompts):
    """Greedy completions of many prompts in one left-padded batch (used before and after an edit alike)."""
    tokenizer.padding_side = "left"
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, return_token_type_ids=False)
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def show(model, tokenizer, prompt, swap, mode="auto"):
    plan = editing.plan_edit(tokenizer, model.config, [swap], mode)
    before = complete(model, tokenizer, prompt, 16)
    with editing.runtime_edit(model, tokenizer, prompt, plan) as found:
        after = complete(model, tokenizer, prompt, 16)
    print(f"  {swap} ({', '.join(m.mode for m in plan.maps)}; tokens {[o.positions for o in found]})")
    print(f"    prompt      {prompt!r}\n    before      {before!r}\n    after edit  {after!r}")


def measure(model, tokenizer, pairs, mode, layers=None):
    """Success of run-time and persistent edits, and the collateral of persistent ones."""
    others = [p[key].prompt for p in pairs for key in ("source_fact", "target_fact")]
    facts = [p[key] for p in pairs for key in ("source_fact", "target_fact")]
    baseline = complete_all(model, tokenizer, others)
    rows = []
    for pair in pairs:
        prompt, swap = pair["source_fact"].prompt, editing.Swap(pair["source"], pair["target"])
        plan = editing.plan_edit(tokenizer, model.config, [swap], mode, layers)
        with editing.runtime_edit(model, tokenizer, prompt, plan) as found:
            runtime = complete(model, tokenizer, prompt, NEW_TOKENS)
        row_map = found[-1].row_map  # the spelling the prompt holds
        changes = editing.apply_edit(model, plan)
        try:
            persistent = complete(model, tokenizer, prompt, NEW_TOKENS)
            after = complete_all(model, tokenizer, others)
        finally:
            editing.revert_edit(model, changes)
        # the other entities' prompts: those that hold neither the source nor the target entity
        kept = [i for i, p in enumerate(others) if pair["source"] not in p and pair["target"] not in p]
        flipped = sum(facts[i].is_answered_by(baseline[i]) != facts[i].is_answered_by(after[i]) for i in kept)
        changed = sum(baseline[i] != after[i] for i in kept)
        rows.append({"swap": str(swap), "category": pair["category"], "prompt": prompt,
                     "tokens": [len(row_map.source.ids), len(row_map.target.ids)],
                     "before": baseline[others.index(prompt)], "runtime": runtime, "persistent": persistent,
                     "knows_source": pair["source_fact"].is_answered_by(baseline[others.index(prompt)]),
                     "knows_target": pair["target_fact"].is_answered_by(baseline[others.index(pair["target_fact"].prompt)]),
                     "runtime_success": pair["target_fact"].is_answered_by(runtime),
                     "persistent_success": pair["target_fact"].is_answered_by(persistent),
                     "other_prompts": len(kept), "collateral_flipped": flipped, "collateral_changed": changed})
    return rows


def summary(rows):
    n, others = len(rows), sum(r["other_prompts"] for r in rows)
    knows = [r for r in rows if r["knows_target"]]
    return {
        "pairs": n,
        "knows_source": sum(r["knows_source"] for r in rows) / n,
        "knows_target": len(knows) / n,
        "runtime_success": sum(r["runtime_success"] for r in rows) / n,
        "persistent_success": sum(r["persistent_success"] for r in rows) / n,
        "runtime_success_where_target_known": sum(r["runtime_success"] for r in knows) / max(len(knows), 1),
        "persistent_success_where_target_known": sum(r["persistent_success"] for r in knows) / max(len(knows), 1),
        "collateral_flipped": sum(r["collateral_flipped"] for r in rows) / others,
        "collateral_changed": sum(r["collateral_changed"] for r in rows) / others,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a STEM model directory (e.g. runs/smollm2-stem)")
    parser.add_argument("--reference", default="smollm2-135m", help="its dense parent, on which the pairs are checked")
    parser.add_argument("--pairs", default=str(PAIRS))
    parser.add_argument("--modes", default="auto", help="comma-separated length modes to measure, e.g. auto,copy")
    parser.add_argument("--layers", help="edit only these STEM layers (comma-separated)")
    parser.add_argument("--json", help="write every completion and the rates here")
    args = parser.parse_args()

    model, source = load_model(args.model, stem_tables="mmap")
    tokenizer = load_tokenizer(source)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    print(f"{args.model}: STEM layers {model.config.stem_layers}\n\none edit, at run time:")
    show(model, tokenizer, "The capital of Spain is", "Spain=Germany")
    print("\ninjection: a made-up word read with the rows of a description (mode average):")
    show(model, tokenizer, "The city of Zorblax is the capital of", "Zorblax=the capital of France", "average")

    pairs = load_pairs(args.pairs)
    dense, _ = load_model(args.reference)
    checked = complete_all(dense, tokenizer, [p[k].prompt for p in pairs for k in ("source_fact", "target_fact")])
    pairs = [p for i, p in enumerate(pairs)
             if p["source_fact"].is_answered_by(checked[2 * i]) and p["target_fact"].is_answered_by(checked[2 * i + 1])]
    print(f"\n{len(pairs)} entity pairs that the dense parent answers correctly for both entities")
    del dense
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    results = {"model": args.model, "pairs": len(pairs), "layers": layers or model.config.stem_layers, "modes": {}}
    for mode in args.modes.split(","):
        rows = measure(model, tokenizer, pairs, mode, layers)
        results["modes"][mode] = {"summary": summary(rows), "rows": rows}
        s = results["modes"][mode]["summary"]
        print(f"\nmode {mode}: the STEM model answers {s['knows_source']:.0%} of the source prompts and "
              f"{s['knows_target']:.0%} of the target prompts itself")
        print(f"  edit success   run-time {s['runtime_success']:.0%}   persistent {s['persistent_success']:.0%}"
              f"   (where the model knows the target's answer: {s['runtime_success_where_target_known']:.0%} / "
              f"{s['persistent_success_where_target_known']:.0%})")
        print(f"  collateral     persistent: {s['collateral_flipped']:.1%} of the other prompts' answers flip, "
              f"{s['collateral_changed']:.1%} change their text; run-time: none by construction")
        for r in rows:
            if r["runtime_success"] or r["persistent_success"]:
                print(f"    {r['swap']:<32} {r['before']!r:<40} -> {r['runtime']!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
