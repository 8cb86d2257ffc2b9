"""Parent rows: every token read by the dense model after contexts (table_init/parent_rows.py), and the one estimate
per row that weighs a calibrated mean against it (calibrated.py, `InitOptions.shrink`)."""

import json
from pathlib import Path

import pytest
import torch
from transformers.activations import ACT2FN

from stem_upcycle.families import family_for
from stem_upcycle.neurons import NeuronSplit
from stem_upcycle.table_init.closed_form import mlp_projections
from stem_upcycle.table_init.parent_rows import ParentPrior, ParentReader, ParentRowOptions, cut_contexts

from .conftest import FAMILY_CONFIGS, VOCAB, tiny_dense
from .test_calibrate import calib_text, convert, dense_with_tokenizer  # noqa: F401 (a fixture)


def reference_rows(model, family, layers, contexts, ids, gate_weighted=True):
    """{layer: [len(ids), d_ff]} by brute force: one forward per (context, token), the token appended to the context
    alone (no batch, no mask but the model's own), its MLP input at the token's position projected by the layer's
    own weights in fp64, averaged over the contexts (weighted by the squared gate)."""
    activation = ACT2FN[getattr(model.config, family.activation_attr)]
    state = model.state_dict()
    rows = {layer: [] for layer in layers}
    for v in ids.tolist():
        num = {layer: 0 for layer in layers}
        den = {layer: 0 for layer in layers}
        for context in contexts:
            inputs = {}
            hooks = [model.base_model.layers[layer].mlp.register_forward_pre_hook(
                lambda module, args, layer=layer: inputs.__setitem__(layer, args[0][0, -1].double())) for layer in layers]
            with torch.no_grad():
                model(torch.cat([context, torch.tensor([v])])[None], use_cache=False)
            for hook in hooks:
                hook.remove()
            for layer in layers:
                w = {k: None if t is None else t.double() for k, t in mlp_projections(state, family, layer).items()}
                gate = w["gate"] @ inputs[layer] + (0 if w["gate_bias"] is None else w["gate_bias"])
                up = w["up"] @ inputs[layer] + (0 if w["up_bias"] is None else w["up_bias"])
                weight = activation(gate).square() if gate_weighted else torch.ones_like(up)
                num[layer] = num[layer] + weight * up
                den[layer] = den[layer] + weight
        for layer in layers:
            rows[layer].append((num[layer] / den[layer]).float())
    return {layer: torch.stack(r) for layer, r in rows.items()}


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_a_tokens_parent_row_is_the_mean_of_brute_force_forwards_after_each_context(model_type):
    model = tiny_dense(model_type)
    family = family_for(model_type)
    activation = getattr(model.config, family.activation_attr)
    layers = [0, 2]
    g = torch.Generator().manual_seed(1)
    contexts = torch.randint(0, VOCAB, (3, 7), generator=g)  # longer than Gemma's sliding window of 4
    ids = torch.tensor([5, 17, 60, 95])
    reader = ParentReader(model, family, activation, layers, contexts)
    got = reader.rows(ids)
    expected = reference_rows(model, family, layers, contexts, ids)
    for l in layers:
        torch.testing.assert_close(got[l], expected[l], rtol=1e-4, atol=1e-5)
    plain = ParentReader(model, family, activation, layers, contexts, gate_weighted=False).rows(ids)
    expected = reference_rows(model, family, layers, contexts, ids, gate_weighted=False)
    torch.testing.assert_close(plain[2], expected[2], rtol=1e-4, atol=1e-5)


def test_a_split_reads_its_table_columns_and_chunks_give_one_result(monkeypatch):
    import stem_upcycle.table_init.parent_rows as parent_rows

    model = tiny_dense("llama")
    family = family_for("llama")
    contexts = torch.randint(0, VOCAB, (5, 6), generator=torch.Generator().manual_seed(2))
    ids = torch.arange(VOCAB)
    whole = ParentReader(model, family, "silu", [1], contexts).rows(ids)[1]  # [VOCAB, 48]
    split = NeuronSplit(torch.tensor([7, 3, 40, *[i for i in range(48) if i not in (7, 3, 40)]]), 3)
    columns = ParentReader(model, family, "silu", [1], contexts, {1: split}).rows(ids)[1]
    torch.testing.assert_close(columns, whole[:, split.table])
    # chunks of 10 candidates, 2 contexts a forward: the same rows, and rows given to `emit` chunk by chunk
    monkeypatch.setattr(parent_rows, "CANDIDATES", 10)
    monkeypatch.setattr(parent_rows, "ROWS_PER_FORWARD", 2)
    chunked = ParentReader(model, family, "silu", [1], contexts).rows(ids)[1]
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    seen = []
    ParentReader(model, family, "silu", [1], contexts).rows(ids, emit=lambda chunk, rows: seen.append((chunk, rows[1])))
    assert [c.numel() for c, _ in seen] == [10] * 9 + [6]
    torch.testing.assert_close(torch.cat([r for _, r in seen]), whole, rtol=1e-5, atol=1e-6)


def test_contexts_are_spread_over_the_text_and_seeded():
    windows = torch.arange(40 * 16).view(40, 16)
    options = ParentRowOptions(contexts=4, context_length=5, seed=3)
    contexts = cut_contexts(windows, options)
    assert contexts.shape == (4, 5)
    assert [int(c[0]) // 16 for c in contexts] == [0, 13, 26, 39]  # first, last and evenly between
    assert all(torch.equal(c, torch.arange(int(c[0]), int(c[0]) + 5)) for c in contexts)  # a run of the window
    assert torch.equal(contexts, cut_contexts(windows, options))
    assert not torch.equal(contexts, cut_contexts(windows, ParentRowOptions(contexts=4, context_length=5, seed=4)))


def test_the_prior_reads_asked_ids_or_the_whole_vocabulary_into_a_file(tmp_path):
    model = tiny_dense("llama")
    family = family_for("llama")
    contexts = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    reader = ParentReader(model, family, "silu", [0, 2], contexts)
    expected = reader.rows(torch.arange(VOCAB))
    on_demand = ParentPrior(reader, {0: 48, 2: 48}, VOCAB, torch.float32, whole=False)
    torch.testing.assert_close(on_demand.rows(2, torch.tensor([9, 3])), expected[2][[9, 3]])
    torch.testing.assert_close(on_demand.rows(0, torch.tensor([3, 50, 9])), expected[0][[3, 50, 9]])
    assert on_demand.known_ids.tolist() == [3, 9, 50] and on_demand.whole is None  # only what was asked
    whole = ParentPrior(reader, {0: 48, 2: 48}, VOCAB, torch.float32, folder=tmp_path)
    torch.testing.assert_close(whole.block(2, 10, 20), expected[2][10:20])
    torch.testing.assert_close(whole.rows(0, torch.tensor([95, 1])), expected[0][[95, 1]])
    assert whole.nbytes == VOCAB * 96 * 4 and [p.stat().st_size for p in tmp_path.iterdir()] == [whole.nbytes]
    del whole
    assert not list(tmp_path.iterdir())  # the file goes with the prior


def test_shrinkage_weighs_each_calibrated_mean_against_the_parent_row_by_its_count(dense_with_tokenizer, tmp_path,
                                                                                  monkeypatch):
    """k = 0: today's calibrated rows where the text shows a token, the parent's where it does not; k large: the
    parent's rows everywhere; k = 3: (n mean + 3 parent) / (n + 3), n the token's calibrated positions."""
    import stem_upcycle.table_init.calibrated as calibrated
    from stem_upcycle.source import open_source
    from stem_upcycle.table_init import InitOptions

    dense, src = dense_with_tokenizer()
    text = calib_text(tmp_path, n=256)  # words 0-39: the other ids unseen
    common = ("--layers", "0,2", "--init", "calib", "--calib-data", text, "--calib-seq-len", "64", "--parent-reads", "4")
    tables = {name: convert(src, tmp_path / name, *common, *args) for name, args in {
        "ridge": ("--parent-contexts", "0"), "k0": ("--parent-contexts", "4", "--shrink", "0"),
        "k3": ("--parent-contexts", "4", "--shrink", "3"), "large": ("--parent-contexts", "4", "--shrink", "1e9")}.items()}
    windows = calibrated.calibration_windows(open_source(str(src)), InitOptions(calib_data=[str(text)], calib_seq_len=64))
    contexts = cut_contexts(windows, ParentRowOptions(contexts=4))
    parent = ParentReader(dense, family_for("llama"), "silu", [0, 2], contexts).rows(torch.arange(VOCAB))
    seen = windows[:, 1:].unique()  # a window's first token keeps W_up: its positions calibrate nothing
    n = torch.bincount(windows[:, 1:].flatten(), minlength=VOCAB).float()[:, None]
    unseen = torch.ones(VOCAB, dtype=torch.bool)
    unseen[seen] = False
    assert 20 < seen.numel() < 45 and unseen.sum() > 50
    for layer in (0, 2):
        row = {name: model.model.layers[layer].mlp.up_table.weight.detach() for name, model in tables.items()}
        torch.testing.assert_close(row["k0"][seen], row["ridge"][seen], rtol=1e-5, atol=1e-6)  # calibrated means
        torch.testing.assert_close(row["k0"][unseen], parent[layer][unseen], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(row["ridge"][unseen], parent[layer][unseen], atol=1e-3)
        torch.testing.assert_close(row["large"], parent[layer], rtol=1e-4, atol=1e-5)
        expected = (n * row["k0"] + 3 * parent[layer]) / (n + 3)
        torch.testing.assert_close(row["k3"], expected, rtol=1e-5, atol=1e-6)
    card = (tmp_path / "k3" / "README.md").read_text()
    assert "--parent-contexts 4 --parent-reads 4 --shrink 3" in card


def test_the_default_conversion_reads_the_parents_own_text_and_converts_a_share_of_every_layer(dense_with_tokenizer,
                                                                                             tmp_path):
    """`convert SRC OUT` with no text: text sampled from SRC (the count given here, to be quick), a sixth of every
    layer's neurons (a step of 16 of the tiny model's 48) chosen on it, rows from its means and the parent's rows; the
    plan names the parent's positions; no parent rows are left beside OUT."""
    from click.testing import CliRunner

    from stem_upcycle.cli import main

    _, src = dense_with_tokenizer()
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--calib-generate", "8192",
                                       "--calib-seq-len", "64"])
    assert result.exit_code == 0, result.output
    assert "every token read after 4 of 16 contexts of 48 tokens: 384 positions" in result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["stem_init"] == "calib" and config["stem_layers"] == [0, 1, 2]
    assert config["stem_table_columns"] == {"0": 16, "1": 16, "2": 16}
    card = (tmp_path / "out" / "README.md").read_text()
    assert "--columns 1/6 --fact-weight 0.25 --init calib" in card and "--calib-generate 8192" in card and "--shrink 8" in card
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # the parent rows' file is gone


def test_a_budget_that_reads_every_token_after_every_context_gives_the_rows_of_before_budgets(dense_with_tokenizer,
                                                                                            tmp_path):
    """--parent-reads >= --parent-contexts: one set of every context, no effect taken off, the text read once for the
    choice and the rows: the tables of the code before reads were budgeted (tests/data/todays_rows.safetensors, that
    code's output of these two commands, whole layers and a third of every layer's neurons)."""
    from safetensors.torch import load_file

    _, src = dense_with_tokenizer()
    text = calib_text(tmp_path, n=3000)
    before = load_file(str(Path(__file__).parent / "data" / "todays_rows.safetensors"))
    whole = convert(src, tmp_path / "whole", "--layers", "0,2", "--init", "calib", "--calib-data", text,
                    "--calib-seq-len", "64", "--parent-contexts", "4", "--parent-reads", "4", "--shrink", "3")
    share = convert(src, tmp_path / "share", "--layers", "all", "--columns", "1/3", "--init", "calib",
                    "--calib-data", text, "--calib-tokens", "4096", "--calib-seq-len", "32", "--parent-contexts", "4",
                    "--parent-reads", "4")
    for name, model, layers in (("whole", whole, (0, 2)), ("share", share, (0, 1, 2))):
        for layer in layers:
            mlp = model.model.layers[layer].mlp
            if name == "share":
                assert torch.equal(mlp.neuron_order, before[f"share.order.{layer}"])  # the same neurons chosen
            torch.testing.assert_close(mlp.up_table.weight.detach(), before[f"{name}.{layer}"], rtol=1e-4, atol=1e-5)


def test_fewer_reads_give_each_token_its_sets_contexts_with_the_sets_effect_taken_off():
    """B of P contexts a token: its row the mean after its set's B contexts, less that set's effect (its mean row
    against every set's, weighed n / (n + SET_EFFECT_SHRINK)); every context serves as many tokens."""
    from stem_upcycle.table_init.parent_rows import SET_EFFECT_SHRINK, ContextSets

    model = tiny_dense("llama")
    family = family_for("llama")
    contexts = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(5))
    sets = ContextSets(ParentRowOptions(contexts=4, reads=2), VOCAB)
    assert sets.members == [[0, 1], [2, 3]] and torch.bincount(sets.of_token).tolist() == [VOCAB // 2] * 2
    ids = torch.arange(VOCAB)
    reader = ParentReader(model, family, "silu", [0, 2], contexts, sets=sets)
    got = reader.rows(ids)
    raw = {layer: torch.zeros(VOCAB, 48) for layer in (0, 2)}
    for s, members in enumerate(sets.members):
        mine = ids[sets.of_token == s]
        expected = reference_rows(model, family, [0, 2], contexts[members], mine)
        for layer in (0, 2):
            raw[layer][mine] = expected[layer]
    for layer in (0, 2):
        torch.testing.assert_close(got[layer], raw[layer], rtol=1e-4, atol=1e-5)
    prior = ParentPrior(reader, {0: 48, 2: 48}, VOCAB, torch.float32)
    grand = raw[2].mean(0)
    for s in range(2):
        mine = ids[sets.of_token == s]
        effect = (raw[2][mine].mean(0) - grand) * len(mine) / (len(mine) + SET_EFFECT_SHRINK)
        torch.testing.assert_close(prior.rows(2, mine), raw[2][mine] - effect, rtol=1e-4, atol=1e-5)
