"""lm-evaluation-harness on the held-out sets, for several models side by side, in one table.

    pip install -e '.[lm-eval]'
    python benchmarks/lm_eval_suite.py parent=smollm2-135m converted=runs/smollm2-stem-init \
        recovered=runs/smollm2-stem dense-finetuned=runs/dense-finetune

Each NAME=MODEL is any SOURCE form stem-upcycle accepts (a directory, a cached hub id, a .gguf,
`smollm2-135m`); it is loaded by stem-upcycle in fp32 and handed to lm-eval's `hf` model, so a GGUF
parent is scored by the same code as the exported STEM models. The tasks are the local ones in
`benchmarks/lm_eval_tasks/` (last-word accuracy and rolling word perplexity on each held-out set).
A STEM model directory can equally be scored with lm-eval's own command line:

    lm_eval --model hf --model_args pretrained=runs/smollm2-stem,trust_remote_code=True,dtype=float32 \
        --include_path benchmarks/lm_eval_tasks --tasks stem_heldout --device cpu --batch_size 8
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local tasks and models only: never reach for the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stem_upcycle.loading import load_model, load_tokenizer  # noqa: E402

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
SETS = ("plays", "novel", "proceedings", "docs")


def run_lm_eval(spec: str, tasks: list[str], batch_size: int, limit: int | None) -> dict:
    """{task: {metric: value}} for one model."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, source = load_model(spec)
    lm = HFLM(pretrained=model, tokenizer=load_tokenizer(source), backend="causal", batch_size=batch_size, device="cpu")
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit)
    return {task: {k.split(",")[0]: v for k, v in metrics.items() if k.endswith(",none")}
            for task, metrics in out["results"].items()}


def table(results: dict[str, dict]) -> str:
    head = (f"{'model':<18}" + "".join(f"{'acc ' + s:>17}" for s in SETS) + f"{'acc mean':>10}"
            + "".join(f"{'word ppl ' + s:>22}" for s in SETS))
    lines = [head]
    for name, r in results.items():
        accs = [r.get(f"stem_lastword_{s}", {}).get("acc") for s in SETS]
        known = [a for a in accs if a is not None]
        row = f"{name:<18}" + "".join(f"{a:>17.1%}" if a is not None else f"{'-':>17}" for a in accs)
        row += f"{sum(known) / len(known):>10.1%}" if known else f"{'-':>10}"
        for s in SETS:
            ppl = r.get(f"stem_rolling_{s}", {}).get("word_perplexity")
            row += f"{ppl:>22.2f}" if ppl is not None else f"{'-':>22}"
        lines.append(row)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="NAME=MODEL")
    parser.add_argument("--tasks", default="stem_heldout", help="comma-separated tasks or groups")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--limit", type=int, help="documents per task (for a quick look; lm-eval warns)")
    parser.add_argument("--output", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    print(f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores", file=sys.stderr)
    results = {}
    for item in args.models:
        name, _, spec = item.partition("=")
        if not spec:
            parser.error(f"{item!r}: give NAME=MODEL, e.g. parent=smollm2-135m")
        started = time.perf_counter()
        results[name] = run_lm_eval(spec, args.tasks.split(","), args.batch_size, args.limit)
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        if args.output:
            args.output.write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
