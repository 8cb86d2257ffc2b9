"""Serving a converted SmolLM2 with vLLM (offline and over its OpenAI-compatible HTTP server): greedy text equal
to Transformers' `generate()`, several requests batched at once, tables in vLLM's memory or in their files.

Runs in vLLM's own environment (scripts/install-vllm.sh): `.venv-vllm/bin/python -m pytest -m vllm`."""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")]

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The largest planet in the solar system is", "Water boils at", "Shakespeare wrote"]
NEW_TOKENS = 16
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache: plenty for these requests


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """SmolLM2-135M with three layers converted (the first included, so that every prompt's first token is one a
    STEM layer keeps dense), and Transformers' greedy continuation of every prompt."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stem_upcycle.cli import main

    out = tmp_path_factory.mktemp("vllm") / "stem"
    result = CliRunner().invoke(main, ["convert", "smollm2-135m", str(out), "--layers", "0,15,21", "--quiet"])
    assert result.exit_code == 0, result.output
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32,
                                                 stem_tables="memory").eval()
    expected = {}
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        ids = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        expected[prompt] = ids[0, inputs["input_ids"].shape[1]:].tolist()
    return out, expected, tokenizer


def vllm_greedy(path, tables: str | None, env: dict | None = None, compile: bool = False) -> dict:
    """{prompt: token ids} of vLLM's greedy continuations (examples/vllm_generate.py); `tables`: the placement,
    None for the model's default; `env`: added to the process's environment; `compile`: vLLM's torch.compile
    (else eager)."""
    command = [sys.executable, str(ROOT / "examples" / "vllm_generate.py"), str(path), *PROMPTS,
               "--max-tokens", str(NEW_TOKENS), "--max-model-len", "512", *(["--tables", tables] if tables else []),
               *(["--compile"] if compile else [])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**ENV, **(env or {})})
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return {r["prompt"]: r["token_ids"] for r in map(json.loads, filter(lambda l: l.startswith("{"),
                                                                         result.stdout.splitlines()))}


@pytest.mark.parametrize("tables", ["memory", "mmap"])
def test_offline_batched_greedy_text_equals_transformers(converted, tables):
    path, expected, _ = converted
    assert vllm_greedy(path, tables) == expected


@pytest.mark.parametrize("tables", ["memory", "mmap"])
def test_compiled_serving_gives_the_greedy_text_of_transformers(converted, tables):
    """Without enforce_eager: vLLM traces the model whole with torch.compile (its STEM layers gather their rows
    inside the graph, or read them by an op: mmap) and serves the text Transformers' eager generate() gives."""
    path, expected, _ = converted
    assert vllm_greedy(path, tables, compile=True) == expected


@pytest.mark.parametrize("tables", [None, "mmap"])
def test_tables_a_tensor_per_table_serve_the_same_greedy_text(converted, tables):
    """The converted tables lie in one group of layers (`config.stem_table_groups`, convert's default, held as read
    in memory); stored a tensor per table (`compress --layer-groups 1`), vLLM loads them as parameters by name (the
    default), or `mmap` reads them a layer at a time."""
    from stem_upcycle.cli import main

    path, expected, _ = converted
    assert json.loads((path / "config.json").read_text())["stem_table_groups"] == [[0, 15, 21]]
    out = path.parent / "per-table"
    if not out.exists():
        result = CliRunner().invoke(main, ["compress", str(path), str(out), "--layer-groups", "1", "--quiet"])
        assert result.exit_code == 0, result.output
    assert vllm_greedy(out, tables) == expected


@pytest.mark.parametrize("tables", [None, "mmap"])
def test_a_sharded_model_is_served_by_hub_id(converted, tables, tmp_path):
    """By id from a Hub served locally (tests/hub_server.py), into an empty cache: the tables, read before vLLM
    fetches the weights, are fetched first (grouped tables: held as read by default; mmap: read from the files)."""
    from stem_upcycle.cli import main

    from .hub_server import LocalHub

    path, expected, _ = converted
    sharded = path.parent / "sharded"
    if not sharded.exists():
        result = CliRunner().invoke(main, ["convert", "smollm2-135m", str(sharded), "--layers", "0,15,21",
                                           "--max-shard-size", "300MB", "--quiet"])  # `converted`, in shards
        assert result.exit_code == 0, result.output
    assert len(list(sharded.glob("*.safetensors"))) > 1
    hub = LocalHub({"someorg/smollm2-stem": sharded})
    try:
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "0",
               "HF_HUB_DISABLE_XET": "1"}
        assert vllm_greedy("someorg/smollm2-stem", tables, env) == expected
    finally:
        hub.close()


@pytest.fixture(scope="module")
def compressed(converted):
    """The converted model with int8 tables (`stem-upcycle compress`), and Transformers' greedy continuations."""
    from transformers import AutoModelForCausalLM

    from stem_upcycle.cli import main

    path, _, tokenizer = converted
    out = path.parent / "int8"
    result = CliRunner().invoke(main, ["compress", str(path), str(out), "--table-dtype", "int8", "--quiet"])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    expected = {}
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        ids = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        expected[prompt] = ids[0, inputs["input_ids"].shape[1]:].tolist()
    return out, expected


@pytest.mark.parametrize("tables", [None, "memory"])
def test_compressed_tables_serve_the_greedy_text_of_transformers(compressed, tables):
    path, expected = compressed
    assert vllm_greedy(path, tables) == expected


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_answers_concurrent_requests_with_the_greedy_text_of_transformers(converted):
    from openai import OpenAI

    path, expected, tokenizer = converted
    port = _free_port()
    # `python -m vllm.entrypoints.openai.api_server` is `vllm serve`; vllm-cpu's `vllm` command looks up the
    # metadata of a package named vllm, which it is not, and fails before serving.
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
                               "--model-impl", "transformers", "--trust-remote-code", "--dtype", "float32",
                               "--enforce-eager", "--max-model-len", "512", "--host", "127.0.0.1",
                               "--port", str(port)],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, server.stdout.read()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up in 10 minutes"
                time.sleep(2)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")

        def complete(prompt):
            return client.completions.create(model=str(path), prompt=prompt, max_tokens=NEW_TOKENS,
                                             temperature=0).choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all in flight at once: batched by the server
            answers = dict(zip(PROMPTS, pool.map(complete, PROMPTS)))
        assert answers == {p: tokenizer.decode(ids) for p, ids in expected.items()}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
