"""Dense parent vs STEM model served by vLLM, side by side: load time, peak memory, throughput.

    .venv-vllm/bin/python benchmarks/vllm_throughput.py runs/smollm2-stem            # parent: smollm2-135m
    .venv-vllm/bin/python benchmarks/vllm_throughput.py STEM_DIR --parent DENSE_DIR --requests 64

Each setting runs in its own process, one after another: the dense parent (vLLM's own Llama), then the STEM
model as vLLM serves it with stem-upcycle installed (vLLM's own model with STEM MLPs, stem_upcycle/vllm_model.py),
its tables in vLLM's memory (the default: parameters, or groups of layers held as read) and in their files
(`hf_overrides={"stem_tables": "mmap"}`), and the STEM model through vLLM's Transformers backend with the exported
code (as where stem-upcycle is not installed), tables in memory. A setting creates `vllm.LLM` (compiled, as vLLM
runs a model by default; `--eager` runs every setting with enforce_eager), then generates
`--new-tokens` tokens for each of `--requests` prompts submitted at once (continuous batching; greedy,
end-of-text ignored so that every request is as long). Reported: load seconds, generated tokens/s, and
the peak RSS of the process and its children (vLLM's engine and worker), sampled every 0.1 s.

A parent given as `smollm2-135m` (the demo GGUF) is first written as a Transformers folder under
runs/vllm-parent. On a CUDA machine the script is the same (vLLM's CUDA build, `--dtype bfloat16`);
that path has not run: see the README's GPU section.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the river ran past the old mill and the children watched the boats go by while their mother sang "
         "a song about the sea the wind and the long road home").split()


def prompt_text(index: int, words: int) -> str:
    """A prompt of about `words` words, different for every request (no shared prefix to cache)."""
    return " ".join(WORDS[(index * 7 + i * 3) % len(WORDS)] for i in range(words))


def worker(args) -> None:
    """One setting, in this process: prints one JSON line."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=args.model, model_impl=args.impl, trust_remote_code=True, dtype=args.dtype,
              enforce_eager=args.eager, max_model_len=args.prompt_words * 2 + args.new_tokens + 64,
              hf_overrides={"stem_tables": args.tables} if args.tables else None)
    loaded = time.perf_counter() - started
    prompts = [prompt_text(i, args.prompt_words) for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print("RESULT " + json.dumps({"load_s": loaded, "seconds": seconds, "generated": generated,
                                  "prompt_tokens": prompt_tokens, "tokens_per_s": generated / seconds}), flush=True)


def peak_rss_of(process: subprocess.Popen) -> tuple[list[str], float]:
    """(the process's output lines, the peak RSS in GB of it and its children while it ran)."""
    import psutil

    peak, lines = 0, []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    root = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.1)
    reader.join()
    return lines, peak / 1e9


def parent_folder(spec: str) -> str:
    """A folder vLLM can load: `spec` itself, or the GGUF demo model written as a Transformers folder."""
    if Path(spec).is_dir():
        return spec
    folder = ROOT / "runs" / "vllm-parent" / spec
    if not (folder / "config.json").exists():
        from stem_upcycle.loading import load_model, load_tokenizer

        model, source = load_model(spec)
        model.save_pretrained(folder)
        load_tokenizer(source).save_pretrained(folder)
    return str(folder)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="the STEM model's folder")
    parser.add_argument("--parent", default="smollm2-135m", help="the dense parent (a folder, or smollm2-135m)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action="store_true", help="every setting with enforce_eager (no torch.compile)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tables", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    settings = {"dense parent": (parent_folder(args.parent), None, "auto"),
                "STEM, tables in memory": (args.model, "memory", "auto"),
                "STEM, tables mmap": (args.model, "mmap", "auto"),
                "STEM, Transformers backend": (args.model, "memory", "transformers")}
    cpu = platform.processor() or platform.machine()
    print(f"cpu: {cpu}, {os.cpu_count()} cores; {args.requests} requests x {args.new_tokens} new tokens, "
          f"prompts of {args.prompt_words} words, {args.dtype}, {'eager' if args.eager else 'compiled'}", flush=True)
    results = {}
    for name, (model, tables, impl) in settings.items():
        command = [sys.executable, __file__, model, "--worker", "--requests", str(args.requests), "--prompt-words",
                   str(args.prompt_words), "--new-tokens", str(args.new_tokens), "--dtype", args.dtype,
                   "--impl", impl, *(["--eager"] if args.eager else [])]
        process = subprocess.Popen(command + (["--tables", tables] if tables else []), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env={"VLLM_CPU_KVCACHE_SPACE": "2", **os.environ})
        lines, peak = peak_rss_of(process)
        found = [line for line in lines if line.startswith("RESULT ")]
        if process.returncode or not found:
            sys.exit(f"{name} failed:\n" + "".join(lines[-40:]))
        results[name] = {**json.loads(found[-1][7:]), "peak_rss_gb": peak}
        r = results[name]
        print(f"{name:26s} load {r['load_s']:5.1f} s  {r['tokens_per_s']:7.1f} tok/s  peak RSS {peak:5.2f} GB",
              flush=True)
    dense = results["dense parent"]
    print("\n| setting | load s | generated tok/s | vs parent | peak RSS GB | vs parent |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['load_s']:.1f} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / dense['tokens_per_s']:.2f}x"
              f" | {r['peak_rss_gb']:.2f} | {r['peak_rss_gb'] / dense['peak_rss_gb']:.2f}x |")


if __name__ == "__main__":
    main()
