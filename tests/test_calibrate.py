"""Calibrated initialisation: gate-weighted and plain per-token means, ridge fit for unseen tokens."""

import json
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

import stem_upcycle  # noqa: F401
import stem_upcycle.table_init.calibrated as calibrate_module
from stem_upcycle.cli import main
from stem_upcycle.evaluate import evaluate
from stem_upcycle.table_init import InitOptions

from .conftest import save_tiny_tokenizer


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def calib_text(tmp_path, words=(0, 40), n=600, seed=0):
    """Random words drawn from ids [words[0], words[1]): the other ids stay unseen."""
    g = torch.Generator().manual_seed(seed)
    path = tmp_path / f"calib{seed}.txt"
    path.write_text(" ".join(f"w{i}" for i in torch.randint(*words, (n,), generator=g).tolist()))
    return path


def convert(src, out, *args):
    result = run_cli("convert", src, out, "--quiet", "--dtype", "float32", *args)
    assert result.exit_code == 0, result.output
    return AutoModelForCausalLM.from_pretrained(out, stem_tables="memory").eval()


@pytest.fixture
def dense_with_tokenizer(dense_dir):
    def make(zero_first_attention=False, **kw):
        dense, src = dense_dir("llama", **kw)
        if zero_first_attention:
            with torch.no_grad():
                dense.model.layers[0].self_attn.o_proj.weight.zero_()
            dense.save_pretrained(src)
        save_tiny_tokenizer(src)
        return dense, src

    return make


def mlp_inputs_at(dense, layer, ids):
    """The dense model's MLP inputs at `layer` for a [1, T] id sequence: [T, d]."""
    captured = []
    hook = dense.model.layers[layer].mlp.register_forward_pre_hook(lambda m, a: captured.append(a[0][0]))
    with torch.no_grad():
        dense(ids)
    hook.remove()
    return captured[0]


def test_where_closed_form_is_exact_calibration_reproduces_it(dense_with_tokenizer, tmp_path):
    dense, src = dense_with_tokenizer(zero_first_attention=True)
    text = calib_text(tmp_path)
    closed = convert(src, tmp_path / "closed", "--layers", "0", "--init", "closed-form")
    calib = convert(src, tmp_path / "calib", "--layers", "0", "--init", "calib", "--calib-data", text,
                    "--calib-seq-len", "64", "--parent-reads", "16")  # every token after every context
    exact = closed.model.layers[0].mlp.up_table.weight
    table = calib.model.layers[0].mlp.up_table.weight
    seen = torch.arange(0, 40)
    torch.testing.assert_close(table[seen], exact[seen], rtol=1e-4, atol=1e-5)
    unseen = torch.arange(40, 96)  # read by the parent after contexts: exact too, attention adding nothing
    torch.testing.assert_close(table[unseen], exact[unseen], rtol=1e-4, atol=1e-5)
    ridge = convert(src, tmp_path / "ridge", "--layers", "0", "--init", "calib", "--calib-data", text,
                    "--calib-seq-len", "64", "--parent-contexts", "0").model.layers[0].mlp.up_table.weight
    torch.testing.assert_close(ridge[seen], exact[seen], rtol=1e-4, atol=1e-5)
    # without parent rows, a linear map fitted on exact rows predicts the others closely
    assert (ridge[unseen] - exact[unseen]).norm() / exact[unseen].norm() < 0.05
    assert calib.config.stem_init == "calib"


@pytest.mark.parametrize("init, first_token", [("calib", "dense"), ("calib-mean", "dense"), ("calib", "table")])
def test_rows_are_the_gate_weighted_or_plain_mean_of_the_dense_up_projection(dense_with_tokenizer, tmp_path, init,
                                                                             first_token):
    dense, src = dense_with_tokenizer()
    text = calib_text(tmp_path, n=256)
    stem = convert(src, tmp_path / init, "--layers", "1", "--init", init, "--calib-data", text, "--calib-seq-len", "64",
                   "--first-token", first_token, "--shrink", "0")  # the means themselves, not shrunk toward the parent
    ids = torch.tensor([int(w[1:]) for w in text.read_text().split()]).view(-1, 64)
    mlp = dense.model.layers[1].mlp
    skip = 1 if first_token == "dense" else 0  # a window's first token keeps W_up: its occurrence is no row's

    def error(rows):  # what a row stands in for at its token's occurrences: act(gate x) * W_up x for calib
        total = 0.0
        for window in ids:
            with torch.no_grad():
                x = mlp_inputs_at(dense, 1, window[None])[skip:]
                u, s = mlp.up_proj(x), mlp.act_fn(mlp.gate_proj(x))
            weight = s if init == "calib" else 1.0
            total = total + (weight * (u - rows[window[skip:]])).square().sum()
        return total

    # each seen row is the least-squares best one: the error's gradient there is zero, against its size at zero rows
    table = stem.model.layers[1].mlp.up_table.weight.detach().clone().requires_grad_()
    zero = torch.zeros_like(table, requires_grad=True)
    error(table).backward()
    error(zero).backward()
    seen = ids[:, skip:].unique()
    assert table.grad[seen].norm() < 1e-5 * zero.grad[seen].norm()


def test_rows_calibrated_from_a_choices_kept_inputs_equal_a_fresh_read_of_the_text(dense_with_tokenizer, tmp_path):
    """A neuron choice reads the text's MLP inputs once; the chosen columns' rows are calibrated from them, with no
    second forward over the text, and equal the rows of a calibration that reads the text again."""
    from stem_upcycle.convert import stem_config
    from stem_upcycle.families import family_for
    from stem_upcycle.neurons import NeuronSplit
    from stem_upcycle.source import open_source
    from stem_upcycle.table_init import INITIALISERS, InitTarget
    from stem_upcycle.table_init.mlp_inputs import MlpInputs
    from stem_upcycle.table_init.parent_rows import ParentRowOptions

    dense, src = dense_with_tokenizer()
    source, family = open_source(str(src)), family_for("llama")
    config = stem_config(source.config, family, [0, 2], "calib", torch.float32, False, True)
    split = NeuronSplit(torch.tensor([5, 40, 17, *[i for i in range(48) if i not in (5, 40, 17)]]), 3)
    target = InitTarget(source, family, config, [0, 2], {2: split})
    options = InitOptions(calib_data=[str(calib_text(tmp_path, n=256))], calib_seq_len=64, dense_model=dense,
                          parent=ParentRowOptions(contexts=0))
    fresh = INITIALISERS["calib"](target, options)
    windows = calibrate_module.calibration_windows(source, options)
    kept = MlpInputs(dense, [0, 1, 2], windows)
    forwards = []
    hook = dense.register_forward_pre_hook(lambda *a: forwards.append(1))
    reused = INITIALISERS["calib"](target, replace(options, mlp_inputs=kept))
    hook.remove()
    assert not forwards  # the text was not read again
    for layer in (0, 2):
        torch.testing.assert_close(reused.means[layer], fresh.means[layer], rtol=1e-5, atol=1e-6)
    assert reused.means[2].shape == (fresh.seen.numel(), 3)
    # past the budget of one file (mlp_inputs.MLP_INPUTS_BYTES) the text is read a group of layers at a time
    import stem_upcycle.table_init.mlp_inputs as mlp_inputs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mlp_inputs, "MLP_INPUTS_BYTES", 1)
        grouped = INITIALISERS["calib"](target, options)
    for layer in (0, 2):
        torch.testing.assert_close(grouped.means[layer], fresh.means[layer], rtol=1e-5, atol=1e-6)


def test_calibration_beats_the_closed_form_on_its_own_text(dense_with_tokenizer, tmp_path):
    dense, src = dense_with_tokenizer()
    text = calib_text(tmp_path, words=(0, 94), n=1024)
    closed = convert(src, tmp_path / "closed", "--layers", "1,2", "--init", "closed-form")
    calib = convert(src, tmp_path / "calib", "--layers", "1,2", "--init", "calib", "--calib-data", text,
                    "--calib-seq-len", "64")
    ids = torch.tensor([int(w[1:]) for w in text.read_text().split()])
    kl_closed = evaluate(closed, ids, 64, reference=dense)["kl"]
    kl_calib = evaluate(calib, ids, 64, reference=dense)["kl"]
    assert kl_calib < kl_closed


def test_calibrated_init_without_data_is_a_one_line_error(dense_with_tokenizer, tmp_path):
    _, src = dense_with_tokenizer()
    result = run_cli("convert", src, tmp_path / "out", "--init", "calib", "--calib-generate", "0")
    assert result.exit_code == 1 and "--init calib needs calibration text: pass --calib-data" in result.output
    assert not (tmp_path / "out").exists()


def test_calibration_text_shorter_than_a_window_is_an_error(dense_with_tokenizer, tmp_path):
    _, src = dense_with_tokenizer()
    short = calib_text(tmp_path, n=10)
    result = run_cli("convert", src, tmp_path / "out", "--init", "calib", "--calib-data", short, "--quiet")
    assert result.exit_code == 1 and "fewer than --calib-seq-len 512" in result.output
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_auto_layers_score_each_layer_as_the_converted_model_scores(dense_with_tokenizer, tmp_path, monkeypatch):
    """`--layers auto:1/3` scores every layer alone with calibrated rows (a STEM MLP in a hook) on windows
    that the calibration leaves out, and converts the cheapest: the score of the chosen layer is the
    converted model's own perplexity ratio on those windows, and its rows are those of a calibration on
    the other windows alone."""
    import math

    import torch.nn.functional as F

    import stem_upcycle.table_init.layer_choice as sensitivity

    dense, src = dense_with_tokenizer()
    text = calib_text(tmp_path)
    measured = []  # the text's costs, then the facts'
    measure = sensitivity.measure_costs
    monkeypatch.setattr(sensitivity, "measure_costs", lambda *a: measured.append(measure(*a)) or measured[-1])
    monkeypatch.setattr(sensitivity, "MEASURE_WINDOWS", 2)
    facts_file = tmp_path / "facts.jsonl"  # in the tiny tokenizer's words, of different lengths
    facts_file.write_text("\n".join(json.dumps({"prompt": " ".join(f"w{(7 * i + j) % 90}" for j in range(2 + i % 4)),
                                               "answers": [" ".join(f"w{(5 * i + j) % 90}" for j in range(1 + i % 3))]})
                                   for i in range(12)))
    monkeypatch.setattr(sensitivity, "RANKING_FACTS", facts_file)
    flags = ("--init", "calib", "--calib-seq-len", "64", "--parent-reads", "16")  # the parent rows alike wherever read
    auto = convert(src, tmp_path / "auto", "--layers", "auto:1/3", "--calib-data", text, *flags)
    chosen = auto.config.stem_layers
    costs, fact_costs = measured
    assert len(chosen) == 1 and set(costs) == set(fact_costs) == {0, 1, 2}
    assert chosen[0] == min(costs, key=lambda k: costs[k] * fact_costs[k])  # the product of the two ratios
    assert auto.config.stem_layer_costs == {str(k): round(v, 4) for k, v in costs.items()}  # kept for the user
    assert auto.config.stem_layer_fact_costs == {str(k): round(v, 4) for k, v in fact_costs.items()}
    facts = sensitivity.fact_completions(AutoTokenizer.from_pretrained(src), facts_file)

    def completion_ppl(model):  # each fact alone, unpadded: its completion's tokens only
        nll = []
        with torch.no_grad():
            for ids, scored in zip(facts.ids, facts.scored):
                length = int(scored.nonzero().max()) + 2
                logits = model(ids[None, :length]).logits[0, :-1]
                nll.append(F.cross_entropy(logits, ids[1:length], reduction="none")[scored[: length - 1]])
        return math.exp(torch.cat(nll).mean().item())

    # the converted model, each prompt's first token dense, scores its own facts as the ranking did
    assert math.isclose(fact_costs[chosen[0]], completion_ppl(auto) / completion_ppl(dense), rel_tol=1e-5)
    assert len(facts.ids) == 12 and (facts.ids != 95).all()  # no unknown word
    windows = calibrate_module.calibration_windows(
        stem_upcycle.source.open_source(str(src)), InitOptions(calib_data=[str(text)], calib_seq_len=64,
                                                               calib_tokens=131072))
    scored = torch.tensor([0, len(windows) - 1])  # two windows spread over the text: its first and last

    def ppl(model, ids):
        with torch.no_grad():
            nll = sum(F.cross_entropy(model(w[None]).logits[0, :-1], w[1:], reduction="sum").item() for w in ids)
        return math.exp(nll / ids[:, 1:].numel())

    assert math.isclose(costs[chosen[0]], ppl(auto, windows[scored]) / ppl(dense, windows[scored]), rel_tol=1e-6)
    rest = tmp_path / "rest.txt"  # the other windows, as text (one word a token)
    rest.write_text(" ".join(f"w{i}" for i in windows[1:-1].flatten().tolist()))
    alone = convert(src, tmp_path / "alone", "--layers", str(chosen[0]), "--calib-data", rest, *flags)
    layer = auto.model.layers[chosen[0]].mlp.up_table.weight
    torch.testing.assert_close(layer, alone.model.layers[chosen[0]].mlp.up_table.weight, rtol=1e-6, atol=1e-6)


def test_layer_choice_scores_facts_apart_from_those_eval_scores():
    """A layer chosen on the ranking facts is checked on `eval --facts`' set: no prompt is in both."""
    from stem_upcycle.facts import load_facts
    from stem_upcycle.table_init.layer_choice import RANKING_FACTS

    ranking, scored = load_facts(RANKING_FACTS), load_facts()
    assert len(ranking) == 45 and not {f.prompt for f in ranking} & {f.prompt for f in scored}


def test_a_dry_run_with_auto_layers_computes_nothing(dense_with_tokenizer, tmp_path, monkeypatch):
    import stem_upcycle.table_init.row_choice as choice_module

    _, src = dense_with_tokenizer()

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run measured the layers or the neurons")

    monkeypatch.setattr(choice_module, "select_layers", refuse)
    monkeypatch.setattr(choice_module, "column_costs", refuse)
    result = run_cli("convert", src, tmp_path / "out", "--dry-run", "--layers", "auto:1/3", "--init", "calib",
                     "--calib-data", calib_text(tmp_path))
    assert result.exit_code == 0, result.output
    assert "1 of 3 layers: chosen by the real run (auto:1/3" in result.output and "[96, 48]" in result.output
    result = run_cli("convert", src, tmp_path / "out", "--dry-run", "--layers", "auto:1/3", "--columns", "auto:1/3",
                     "--init", "calib", "--calib-data", calib_text(tmp_path))
    assert result.exit_code == 0, result.output
    assert "16 of 48 in each layer; which neurons, the real run chooses (auto:1/3" in result.output
    assert "[96, 16]" in result.output
    assert not (tmp_path / "out").exists()
    refused = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--dry-run", "--layers", "auto:1/3",
                                        "--init", "closed-form"])
    assert refused.exit_code == 1 and "use --init calib" in refused.output


def test_processes_sharing_the_windows_give_the_calibration_of_one(dense_with_tokenizer, tmp_path):
    """Two processes (threads here), each reading every other window, their sums reduced: the means of one."""
    import threading

    from stem_upcycle.convert import plan_conversion
    from stem_upcycle.source import open_source

    _, src = dense_with_tokenizer()
    options = InitOptions(calib_data=[str(calib_text(tmp_path, n=512))], calib_seq_len=32)
    # A model per process, loaded here in turn: from_pretrained in two threads at once can leave
    # Transformers' meta-device initialisation patched in for every later model.
    models = [AutoModelForCausalLM.from_pretrained(src).eval() for _ in range(2)]

    def calibrated(model=None, **extra):
        plan = plan_conversion(open_source(str(src)), layers="0,2", init="calib", init_options=options)
        return calibrate_module.CalibratedInit(plan.init_target, replace(options, dense_model=model, **extra))

    one = calibrated()
    barrier, parts, results = threading.Barrier(2), {}, {}

    def reduce_of(rank):
        def reduce(t):  # an all-reduce (sum) between the two threads
            parts[rank] = t.clone()
            barrier.wait()
            total = parts[0] + parts[1]
            barrier.wait()
            return total
        return reduce

    def run(rank):
        results[rank] = calibrated(models[rank], shard=(rank, 2, reduce_of(rank)))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert one.windows.shape[0] >= 4
    for rank in range(2):
        for layer in (0, 2):
            torch.testing.assert_close(results[rank].means[layer], one.means[layer], rtol=1e-5, atol=1e-6)
    # A process alone with half the windows would not: the reduction is what makes them equal.
    half = calibrated(shard=(0, 2, None))
    assert not torch.allclose(half.means[0], one.means[0], rtol=1e-3, atol=1e-4)


def test_calibration_and_layer_scoring_run_under_bf16_autocast(dense_with_tokenizer, tmp_path):
    """A multi-process `train` converts inside `accelerator.autocast()`: the teacher's forward runs in bf16 and
    the calibration's sums, ridge fit and layer scores stay fp32, close to those of an fp32 conversion."""
    _, src = dense_with_tokenizer()
    # every token's parent rows after all 16 contexts: layers 1 and 2 of this tiny model score within bf16's noise of
    # each other with the rows of 4 reads
    args = ("--layers", "auto:2/3", "--init", "calib", "--calib-data", calib_text(tmp_path, n=1600), "--calib-seq-len", "64",
            "--parent-reads", "16")
    plain = convert(src, tmp_path / "fp32", *args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = convert(src, tmp_path / "bf16", *args)
    assert mixed.config.stem_layers == plain.config.stem_layers
    for layer in plain.config.stem_layers:
        rows = mixed.model.layers[layer].mlp.up_table.weight
        assert rows.dtype == torch.float32
        torch.testing.assert_close(rows, plain.model.layers[layer].mlp.up_table.weight, rtol=0, atol=5e-3)  # bf16 inputs: ~2e-3
