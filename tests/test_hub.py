"""A STEM model loaded by hub id, as users load a published model: from a Hub served locally (`hub_server.py`;
no internet), in a process where stem_upcycle cannot be imported, with an empty cache and then offline from the
cache, for every placement and for a model built from its config (as vLLM builds it)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

from stem_upcycle.cli import main

from .conftest import save_tiny_tokenizer, tiny_dense
from .hub_server import LocalHub

REPO = "someorg/tiny-stem"

LOAD_BY_ID = """
import sys
sys.modules["stem_upcycle"] = None  # as if stem-upcycle were not installed
import torch
from transformers import AutoConfig, AutoModelForCausalLM

repo, data = sys.argv[1], torch.load(sys.argv[2])
torch.accelerator.is_available = lambda: True  # `host` runs with the CPU as its device
for placement in sys.argv[3].split(","):
    if placement == "from_config":  # vLLM's way: a config by id, a model built from it, its tables read by id
        config = AutoConfig.from_pretrained(repo, trust_remote_code=True, stem_tables="mmap")
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True).eval()
        with torch.no_grad():
            for layer in config.stem_layers:
                assert torch.equal(model.stem_table_rows(layer, data["ids"][0]), data["rows"][layer]), layer
    else:
        model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True, stem_tables=placement).eval()
        assert model.stem_tables == placement.split(",")[0]
        with torch.no_grad():
            torch.testing.assert_close(model(data["ids"]).logits, data["logits"], rtol=1e-6, atol=1e-6)
    print(placement, "OK")
"""


@pytest.fixture
def hub(tmp_path, ids):
    """A converted model (tables in a group of layers, convert's default layout, in several shards) served as REPO,
    a file of ids with the logits and table rows that loading the folder gives, and the shards' names."""
    from transformers import AutoModelForCausalLM

    dense = tmp_path / "dense"
    tiny_dense("llama").save_pretrained(dense)
    save_tiny_tokenizer(dense)
    folder = tmp_path / "stem"
    result = CliRunner().invoke(main, ["convert", str(dense), str(folder), "--layers", "0,2", "--layer-groups", "2",
                                       "--max-shard-size", "20KB", "--init", "closed-form", "--quiet"])
    assert result.exit_code == 0, result.output
    assert len(list(folder.glob("*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(folder, stem_tables="memory").eval()
    with torch.no_grad():
        rows = {layer: model.stem_table_rows(layer, ids[0]) for layer in model.config.stem_layers}
        torch.save({"ids": ids, "logits": model(ids).logits, "rows": rows}, tmp_path / "data.pt")
    server = LocalHub({REPO: folder})
    yield server, tmp_path / "data.pt", tmp_path / "hf-home", {p.name for p in folder.glob("*.safetensors")}
    server.close()


def load_by_id(server, data, home, placements: str, offline: bool = False) -> str:
    env = {**os.environ, "HF_ENDPOINT": server.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1" if offline else "0",
           "HF_HUB_DISABLE_XET": "1"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(LOAD_BY_ID), REPO, data, placements],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("placement", ["mmap", "memory", "host", "from_config"])
def test_a_sharded_model_loads_by_hub_id_into_an_empty_cache_then_offline_from_it(hub, placement):
    server, data, home, shards = hub
    assert load_by_id(server, data, home, placement).split() == [placement, "OK"]
    assert shards <= server.fetched(), server.fetched()
    server.requests.clear()
    assert load_by_id(server, data, home, placement, offline=True).split() == [placement, "OK"]
    assert server.requests == []  # offline: everything from the cache
