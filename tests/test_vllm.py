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

from stem_upcycle.convert import plan_conversion, run_conversion
from stem_upcycle.source import open_source

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
    result = CliRunner().invoke(main, ["convert", "smollm2-135m", str(out), "--layers", "0,15,21", "--init",
                                       "closed-form", "--quiet"])
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


NATIVE = "STEM model served natively"  # what the plugin's model logs when vLLM builds it (stem_upcycle/vllm_model.py)


def vllm_greedy(path, tables: str | None, env: dict | None = None, compile: bool = False, impl: str = "auto",
                served: str | None = NATIVE, max_model_len: int = 512, prompts=PROMPTS, args=(),
                logprobs: bool = False) -> dict:
    """{prompt: token ids} of vLLM's greedy continuations (examples/vllm_generate.py); `tables`: the placement,
    None for the model's default; `env`: added to the process's environment; `compile`: vLLM's torch.compile
    (else eager); `impl`: vLLM's model implementation ("auto": the STEM plugin's model, as stem-upcycle installed
    beside vLLM gives; "transformers": the Transformers backend with the exported code); `served`: a line vLLM's
    log must hold (None: the plugin's model must not have served); `args`: more of the example's options;
    `logprobs`: {prompt: (token ids, their logprobs)} instead."""
    command = [sys.executable, str(ROOT / "examples" / "vllm_generate.py"), str(path), *prompts,
               "--max-tokens", str(NEW_TOKENS), "--full-length", "--max-model-len", str(max_model_len),
               "--impl", impl, *(["--tables", tables] if tables else []), *(["--compile"] if compile else []), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**ENV, **(env or {})})
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    log = result.stdout + result.stderr
    assert (served in log) if served else (NATIVE not in log), log[-4000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {r["prompt"]: (r["token_ids"], r["logprobs"]) if logprobs else r["token_ids"] for r in records}


@pytest.mark.parametrize("tables, impl", [("memory", "auto"), ("mmap", "auto"), ("host", "auto"),
                                          ("memory", "transformers"), ("mmap", "transformers")])
def test_offline_batched_greedy_text_equals_transformers(converted, tables, impl):
    """vLLM's own Llama with STEM MLPs (the plugin, "auto"; `host`: the tables in host memory, not parameters,
    gathered in place) and the Transformers backend with the exported code."""
    path, expected, _ = converted
    assert vllm_greedy(path, tables, impl=impl, served=NATIVE if impl == "auto" else None) == expected


@pytest.mark.parametrize("tables, impl", [("memory", "auto"), ("mmap", "auto"), ("host", "auto"),
                                          ("mmap", "transformers")])
def test_compiled_serving_gives_the_greedy_text_of_transformers(converted, tables, impl):
    """Without enforce_eager: vLLM traces the model whole with torch.compile (its STEM layers gather their rows
    inside the graph, or read them by an op: mmap) and serves the text Transformers' eager generate() gives."""
    path, expected, _ = converted
    assert vllm_greedy(path, tables, compile=True, impl=impl, served=NATIVE if impl == "auto" else None) == expected


@pytest.mark.parametrize("family, served", [("qwen3", NATIVE), ("gemma", NATIVE), ("granite", NATIVE),
                                            ("phi3", NATIVE), ("olmo2", "served by vLLM's Transformers backend")])
def test_every_family_is_served_with_the_greedy_text_of_transformers(family, served, tmp_path):
    """A tiny random STEM model of each family vLLM has a class for, with its numerics (Qwen3's q/k norms, Gemma's
    GELU and embedding scale, Granite's multipliers and MLP biases, Phi-3's fused dense gate/up), served by that
    class with STEM MLPs; OLMo2, which vLLM serves through its Transformers backend, is served so."""
    from transformers import AutoModelForCausalLM

    from .conftest import export_stem, save_tiny_tokenizer, tiny_stem

    # heads of 32: vLLM's CPU attention has kernels for some head sizes alone; special tokens in the vocabulary
    special = dict(bos_token_id=94, eos_token_id=94, pad_token_id=94)
    path = export_stem(tiny_stem(family, layers=(0, 2), hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=32, **special), tmp_path / family)
    save_tiny_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32,
                                                 stem_tables="memory").eval()
    prompts = ["w1 w5 w9 w13", "w40 w2", "w7"]
    expected = {}
    for prompt, ids in zip(prompts, ([1, 5, 9, 13], [40, 2], [7])):
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)
        expected[prompt] = out[0, len(ids):].tolist()
    assert vllm_greedy(path, None, served=served, max_model_len=64, prompts=prompts) == expected


@pytest.mark.parametrize("tables, columns", [(None, "all"), ("mmap", "all"), ("host", "all"), (None, "1/3"),
                                             ("mmap", "1/3"), ("host", "1/3")])
def test_two_tensor_parallel_processes_split_the_tables_and_give_the_logprobs_of_transformers(tables, columns,
                                                                                             tmp_path):
    """Tensor parallelism (2 CPU processes, one core each): each rank holds its columns of the gate, of the rows
    (grouped tables in memory, split per layer; mmap: read whole, then cut) and of the first token's up_proj, and
    the down-projection sums the ranks'. With a third of each layer's neurons as table columns, each rank holds
    its share of the table columns and of up_rest (the gate and down reordered as they load). Tokens and their
    logprobs equal Transformers' (a rank reading the wrong columns moves them)."""
    from transformers import AutoModelForCausalLM

    from stem_upcycle.table_init import InitOptions

    from .conftest import markov_text, save_tiny_tokenizer, tiny_dense

    dense = tiny_dense("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, bos_token_id=94,
                       eos_token_id=94, pad_token_id=94)
    dense.save_pretrained(tmp_path / "dense")
    save_tiny_tokenizer(tmp_path / "dense")
    (tmp_path / "calib.txt").write_text(markov_text(4000, 0))
    init = "closed-form" if columns == "all" else "calib"  # neurons are chosen with calibrated rows
    options = InitOptions(calib_data=[str(tmp_path / "calib.txt")], calib_seq_len=32)
    run_conversion(plan_conversion(open_source(str(tmp_path / "dense")), layers="0,2", init=init, columns=columns,
                                   init_options=options), tmp_path / "stem", progress=False)
    config = json.loads((tmp_path / "stem" / "config.json").read_text())
    assert config["stem_table_groups"] == [[0, 2]]
    assert config["stem_table_columns"] == (None if columns == "all" else {"0": 16, "2": 16})
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "stem", trust_remote_code=True, dtype=torch.float32,
                                                 stem_tables="memory").eval()
    prompts = ["w1 w5 w9 w13", "w40 w2", "w7"]
    served = vllm_greedy(tmp_path / "stem", tables, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, max_model_len=64,
                         prompts=prompts, args=("--tensor-parallel-size", "2"), logprobs=True)
    for prompt in prompts:
        ids = torch.tensor([[int(word[1:]) for word in prompt.split()]])
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # raw, as vLLM's logprobs
        tokens = out.sequences[0, ids.shape[1]:]
        expected = torch.stack(out.logits)[:, 0].log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        assert served[prompt][0] == tokens.tolist(), prompt
        torch.testing.assert_close(torch.tensor(served[prompt][1]), expected, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def converted_columns(tmp_path_factory):
    """SmolLM2-135M with a third of the neurons of three layers as table columns (the others keep up_rest),
    calibrated on this project's documentation, and Transformers' greedy continuation of every prompt."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stem_upcycle.cli import main

    out = tmp_path_factory.mktemp("vllm-columns") / "stem"
    result = CliRunner().invoke(main, ["convert", "smollm2-135m", str(out), "--layers", "0,15,21", "--columns", "1/3",
                                       "--init", "calib", "--calib-data", str(ROOT / "README.md"), "--calib-data",
                                       str(ROOT / "docs" / "cli.md"), "--calib-seq-len", "256", "--parent-contexts", "2",
                                       "--quiet"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["stem_table_columns"] == {"0": 512, "15": 512, "21": 512}
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32,
                                                 stem_tables="memory").eval()
    expected = {}
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        ids = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        expected[prompt] = ids[0, inputs["input_ids"].shape[1]:].tolist()
    return out, expected


@pytest.mark.parametrize("tables, impl, compile", [("memory", "auto", False), ("host", "auto", False),
                                                   ("mmap", "auto", True), ("mmap", "transformers", True)])
def test_a_share_of_each_layers_neurons_as_table_columns_serves_the_greedy_text_of_transformers(
        converted_columns, tables, impl, compile):
    """The plugin's model (rows of the table columns cat up_rest's outputs; tables in memory, host memory or the
    files) and the Transformers backend, eager and compiled."""
    path, expected = converted_columns
    served = NATIVE if impl == "auto" else None
    assert vllm_greedy(path, tables, compile=compile, impl=impl, served=served) == expected


@pytest.mark.parametrize("tables", [None, "mmap"])
def test_a_folder_exported_before_per_neuron_tables_is_served_with_its_own_configuration_class(tables, tmp_path):
    """vLLM reads the folder's config with the folder's own configuration class (its remote code), which for a model
    exported before `stem_table_columns` (tests/data, made at 1e5b8a9) has no methods for it: the plugin's model
    reads the config with functions of any config, and serves the greedy text of Transformers."""
    import shutil

    from transformers import AutoModelForCausalLM

    from .conftest import save_tiny_tokenizer

    path = tmp_path / "before"
    shutil.copytree(ROOT / "tests" / "data" / "whole_layers_before_columns", path)
    assert "table_columns" not in (path / "configuration_stem.py").read_text()
    save_tiny_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, stem_tables="memory").eval()
    prompts = ["w1 w5 w9 w13", "w40 w2", "w7"]
    expected = {}
    for prompt in prompts:
        ids = torch.tensor([[int(word[1:]) for word in prompt.split()]])
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        expected[prompt] = out[0, ids.shape[1]:].tolist()
    assert vllm_greedy(path, tables, max_model_len=64, prompts=prompts) == expected


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
        result = CliRunner().invoke(main, ["convert", "smollm2-135m", str(sharded), "--layers", "0,15,21", "--init",
                                           "closed-form", "--max-shard-size", "300MB", "--quiet"])  # `converted`, in shards
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
                               "--trust-remote-code", "--dtype", "float32",
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
