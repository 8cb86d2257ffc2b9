"""`inspect --tables` and `inspect --nearest`: statistics of the table rows, checked against direct computation."""

import json

import pytest
import torch
from click.testing import CliRunner

from stem_upcycle.cli import main
from stem_upcycle.table_stats import seeded_sample, spread

from .conftest import VOCAB, save_tiny_tokenizer, tiny_stem


@pytest.fixture
def stem_dir(tmp_path):
    model = tiny_stem("llama", layers=(0, 2))
    with torch.no_grad():  # row 7 of layer 2 close to row 5; rows far from orthogonal in layer 0
        table = model.model.layers[2].mlp.up_table.weight
        table[7] = table[5] + 0.01 * table[6]
        model.model.layers[0].mlp.up_table.weight.add_(3.0)
    path = tmp_path / "stem"
    model.save_pretrained(path, max_shard_size="40KB")
    save_tiny_tokenizer(path)
    return model, path


def invoke(*args):
    """(exit code, stdout); errors are on stdout too (Click's `Error:` line goes to stderr: joined here)."""
    run = CliRunner().invoke(main, [str(a) for a in args])
    return run.exit_code, run.stdout if run.exit_code == 0 else run.output


def test_table_statistics_match_a_direct_computation_and_are_seeded(stem_dir, dense_dir, tmp_path):
    model, path = stem_dir
    dense, dense_path = dense_dir()
    text = tmp_path / "text.txt"
    torch.manual_seed(0)
    text.write_text(" ".join(f"w{i}" for i in torch.randint(0, VOCAB - 2, (300,)).tolist()))
    code, out = invoke("inspect", path, "--tables", "--sample", 40, "--seed", 3, "--reference", dense_path,
                       "--text", text, "--json")
    assert code == 0, out
    stats = json.loads(out)
    assert stats["sample"] == 40 and stats["seed"] == 3
    sample = seeded_sample(VOCAB, 40, 3)
    for layer in (0, 2):
        table = model.model.layers[layer].mlp.up_table.weight.detach()
        got = stats["layers"][str(layer)]
        assert got["norms"]["mean"] == pytest.approx(float(table.norm(dim=1).mean()), rel=1e-5)
        unit = torch.nn.functional.normalize(table[sample], dim=1)
        pairs = (unit @ unit.T).abs()[torch.triu_indices(40, 40, 1).unbind()]
        assert got["spread"]["pairs"] == 40 * 39 // 2
        assert got["spread"]["P95"] == pytest.approx(float(pairs.quantile(0.95)), rel=1e-4)
        assert sum(got["spread"]["histogram"]) == pytest.approx(1.0, abs=1e-4)
        assert "spread_text_tokens" in got and str(layer) in stats["dense_up"]["layers"]
    assert stats["layers"]["0"]["spread"]["P50"] > 0.5 > stats["layers"]["2"]["spread"]["P50"]  # +3: aligned rows
    # the dense statistic: W_up x of the parent at the sampled positions of the text
    ids = torch.tensor([int(w[1:]) for w in text.read_text().split()])
    positions = seeded_sample(len(ids), 40, 3)
    with torch.no_grad():
        x = dense.model.layers[2].post_attention_layernorm(_hidden_before_mlp(dense, ids, 2))
        direct = spread(dense.model.layers[2].mlp.up_proj(x)[0, positions])
    assert stats["dense_up"]["layers"]["2"]["P95"] == pytest.approx(direct["P95"], rel=1e-4)
    again = json.loads(invoke("inspect", path, "--tables", "--sample", 40, "--seed", 3, "--json")[1])
    assert again["layers"]["2"]["spread"] == stats["layers"]["2"]["spread"]  # the same sample, the same numbers
    one = json.loads(invoke("inspect", path, "--tables", "--layer", 2, "--sample", 40, "--seed", 3, "--json")[1])
    assert list(one["layers"]) == ["2"] and one["layers"]["2"] == again["layers"]["2"]  # one layer read, the same

    code, out = invoke("inspect", path, "--tables", "--sample", 40, "--text", text, "--plot", tmp_path / "spread.png")
    assert code == 0, out
    assert "over every pair of 40 rows" in out and (tmp_path / "spread.png").read_bytes()[:4] == b"\x89PNG"


def _hidden_before_mlp(model, ids, layer):
    """The residual stream entering layer `layer`'s MLP (after its attention), for `ids` [n]."""
    captured = {}
    hook = model.model.layers[layer].post_attention_layernorm.register_forward_hook(
        lambda m, args, out: captured.setdefault("x", args[0]))
    model(ids[None], use_cache=False)
    hook.remove()
    return captured["x"]


def test_nearest_rows_find_the_planted_neighbour(stem_dir):
    _, path = stem_dir
    code, out = invoke("inspect", path, "--nearest", "w5", "--layer", 2, "--top", 3, "--json")
    assert code == 0, out
    found = json.loads(out)
    assert found["token"] == 5 and found["nearest"][0]["id"] == 7 and found["nearest"][0]["cos"] > 0.99
    assert 5 not in [r["id"] for r in found["nearest"]] and len(found["nearest"]) == 3
    code, out = invoke("inspect", path, "--nearest", "id:7", "--layer", 2, "--top", 1)
    assert code == 0 and "'w5' (id 5)" in out


def test_table_inspection_errors_are_one_line(stem_dir, dense_dir, tmp_path):
    _, path = stem_dir
    _, dense = dense_dir()
    cases = [
        (["inspect", dense, "--tables"], "dense checkpoint"),
        (["inspect", path, "--nearest", "w5", "--layer", 1], "layer 1 is not a STEM layer"),
        (["inspect", path, "--nearest", "w5 w6", "--layer", 2], "is 2 tokens"),
        (["inspect", path, "--nearest", "w5"], "needs --layer"),
        (["inspect", path, "--tables", "--reference", dense], "needs --text"),
        (["inspect", path, "--plot", tmp_path / "x.png"], "--plot goes with --tables"),
        (["inspect", path, "--sample", 10, "--seed", 1], "--sample goes with --tables"),
        (["inspect", path, "--layer", 2], "--layer goes with --tables or --nearest"),
        (["inspect", path, "--nearest", "id:96", "--layer", 2], "ids 0-95"),
        (["inspect", path, "--tables", "--sample", 1], "--sample"),
        (["inspect", path, "--tables", "--layer", 1], "layer 1 is not a STEM layer"),
        (["inspect", path, "--tables", "--top", 3], "--top goes with --nearest"),
        (["inspect", path, "--nearest", "w5", "--layer", 2, "--text-tokens", 9], "--text-tokens goes with --tables"),
    ]
    for args, message in cases:
        code, out = invoke(*args)
        assert code != 0 and message in out, (args, out)
        assert len([line for line in out.splitlines() if line.startswith("Error")]) == 1 and "Traceback" not in out


def test_dense_up_outputs_of_a_fused_gate_up_family_are_its_up_half(dense_dir, tmp_path):
    """Phi-3 keeps gate and up in one matrix (gate rows first): W_up x is the second half of its output."""
    stem = tiny_stem("phi3", layers=(1,))
    stem.save_pretrained(tmp_path / "stem")
    save_tiny_tokenizer(tmp_path / "stem")
    dense, dense_path = dense_dir("phi3")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 90}" for i in range(0, 700, 7)))
    code, out = invoke("inspect", tmp_path / "stem", "--tables", "--sample", 30, "--reference", dense_path,
                       "--text", text, "--json")
    assert code == 0, out
    ids = torch.tensor([int(w[1:]) for w in text.read_text().split()])
    captured = []
    hook = dense.model.layers[1].mlp.gate_up_proj.register_forward_hook(lambda m, a, o: captured.append(o[0]))
    with torch.no_grad():
        dense(ids[None], use_cache=False)
    hook.remove()
    up = captured[0][:, dense.config.intermediate_size:]
    direct = spread(up[seeded_sample(len(ids), 30, 0)])
    assert json.loads(out)["dense_up"]["layers"]["1"]["P95"] == pytest.approx(direct["P95"], rel=1e-4)
