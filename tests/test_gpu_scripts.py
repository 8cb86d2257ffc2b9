"""The GPU benchmark scripts' CPU-runnable parts (the device machine's minutes are few): the 1B-shaped
models built in their dtype where asked, and `train_gpu.py --smoke` streaming every run's log."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True)


def test_inference_gpu_builds_the_stem_model_in_its_dtype_with_the_dense_weights(tmp_path):
    sys.path.insert(0, str(ROOT))
    from benchmarks.inference_gpu import make

    dense_dir, stem_dir = make(tmp_path, TINY, [0, 2], torch.bfloat16, device="cpu")
    dense = AutoModelForCausalLM.from_pretrained(dense_dir)
    stem = AutoModelForCausalLM.from_pretrained(stem_dir, stem_tables="memory")
    assert dense.dtype == stem.dtype == stem.model.layers[0].mlp.up_table.weight.dtype == torch.bfloat16
    assert stem.config.stem_layers == [0, 2]
    dense_weights = dense.state_dict()
    for name, tensor in stem.state_dict().items():
        if "up_table" not in name:
            assert torch.equal(tensor, dense_weights[name]), name
    assert float(stem.model.layers[2].mlp.up_table.weight.float().std()) > 0  # random, not empty


def test_inference_gpu_compressed_check_runs_with_the_cpu_as_its_device(tmp_path, host_on_cpu, capsys):
    sys.path.insert(0, str(ROOT))
    from benchmarks.inference_gpu import check_compressed, make

    _, stem_dir = make(tmp_path, TINY | {"intermediate_size": 128}, [0, 2], torch.float32, device="cpu")
    prompt = torch.randint(0, TINY["vocab_size"], (2, 12))
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    check_compressed(stem_dir, tmp_path / "int4", prompt, mask, device="cpu")
    assert capsys.readouterr().out.count("equal to memory, int4 tables") == 2
    assert json.loads((tmp_path / "int4" / "config.json").read_text())["stem_table_format"]["dtype"] == "int4"


def _pack_texts(folder: Path) -> Path:
    """The texts `train_gpu.py pack` ships (data/shakespeare, data/ood), as small stand-ins of random words: the
    real ones are downloaded by scripts/get-*.sh, which CI does not run."""
    import random

    words = "the king of a land said that his man would go to the sea and bring back gold for all".split()
    files = ["shakespeare/hamlet_gut.txt", "shakespeare/macbeth_gut.txt", "shakespeare/othello_gut.txt",
             "ood/botchan.txt", "ood/lcet10.txt", "ood/flask_docs.txt"]
    for i, name in enumerate(files):
        rng = random.Random(i)
        (folder / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "data" / name).write_text(" ".join(rng.choice(words) for _ in range(3000)))
    return folder


@pytest.mark.slow
def test_train_gpu_smoke_run_streams_each_log_to_the_log_dir(tmp_path):
    pytest.importorskip("gguf")
    logs = tmp_path / "logs"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_gpu.py"), "run", "--smoke", "--work",
                          str(tmp_path / "work"), "--log-dir", str(logs), "--pack", str(_pack_texts(tmp_path / "pack"))],
                         capture_output=True, text=True, timeout=1200, env={**os.environ, "OUT": str(tmp_path / "not-this")})
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("stem", "dense"):
        records = [json.loads(line) for line in (logs / f"{name}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "eval" in r] == [0, 1, 2]
        assert f"{name} step 2: plays" in run.stdout
    assert "perplexity / the dense model's" in run.stdout
