"""`stem-upcycle eval`: perplexity in windows, and KL / top-1 agreement against a reference."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import stem_upcycle  # noqa: F401
from stem_upcycle.cli import main
from stem_upcycle.evaluate import evaluate
from stem_upcycle.loading import load_model

from .conftest import save_tiny_tokenizer


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def only_set(output: str) -> dict:
    """The figures of the one held-out set of an `eval --json` run."""
    (figures,) = json.loads(output)["sets"].values()
    return figures


def text_file(tmp_path, n_words=200, seed=0):
    torch.manual_seed(seed)
    words = " ".join(f"w{i}" for i in torch.randint(0, 94, (n_words,)).tolist())
    path = tmp_path / f"text{seed}.txt"
    path.write_text(words)
    return path


def test_perplexity_is_the_mean_nll_over_windows(dense_dir, tmp_path):
    dense, src = dense_dir("llama")
    save_tiny_tokenizer(src)
    text = text_file(tmp_path)
    result = only_set(run_cli("eval", src, "--data", text, "--window", 50, "--json", "--quiet").stdout)
    ids = torch.tensor([int(w[1:]) for w in text.read_text().split()])
    with torch.no_grad():  # four windows of 50 tokens, each predicting 49
        losses = [dense(ids[s : s + 50][None], labels=ids[s : s + 50][None]).loss for s in range(0, 200, 50)]
    assert result["tokens"] == 4 * 49
    assert math.isclose(result["ppl"], math.exp(torch.stack(losses).mean().item()), rel_tol=1e-5)
    assert "ref_ppl" not in result


def test_a_model_against_itself_agrees_fully(dense_dir, tmp_path):
    _, src = dense_dir("llama")
    save_tiny_tokenizer(src)
    result = only_set(run_cli("eval", src, "--data", text_file(tmp_path), "--reference", src, "--window", 40,
                              "--json", "--quiet").stdout)
    assert result["ppl_ratio"] == 1.0 and result["ref_ppl"] == result["ppl"]
    assert abs(result["kl"]) < 1e-6 and result["top1_agreement"] == 1.0


def test_stem_model_against_its_dense_reference(dense_dir, tmp_path):
    dense, src = dense_dir("llama")
    save_tiny_tokenizer(src)
    out = tmp_path / "stem"
    assert run_cli("convert", src, out, "--layers", "all", "--init", "closed-form", "--quiet").exit_code == 0
    result = only_set(run_cli("eval", out, "--data", text_file(tmp_path), "--reference", src, "--window", 40,
                              "--json", "--quiet").stdout)
    model, _ = load_model(str(out))
    ids = torch.tensor([int(w[1:]) for w in text_file(tmp_path).read_text().split()])
    windows = ids[: ids.numel() // 40 * 40].view(-1, 40)  # the CLI's windows: 5 of 40 tokens
    with torch.no_grad():
        p = F.log_softmax(dense(windows).logits[:, :-1].double(), -1)
        q = F.log_softmax(model(windows).logits[:, :-1].double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()  # KL(reference || model), per predicted token
    assert kl > 1e-6  # the converted layers change the distribution (a little: tiny random models)
    assert result["kl"] == pytest.approx(kl, rel=0.02)  # eval sums fp32 log-probabilities: ~1e-7 each
    assert result["top1_agreement"] == pytest.approx((p.argmax(-1) == q.argmax(-1)).float().mean().item())
    assert result["ppl"] == pytest.approx(math.exp(F.nll_loss(q.flatten(0, 1), windows[:, 1:].flatten()).item()),
                                          rel=1e-5)
    assert math.isclose(result["ppl_ratio"], result["ppl"] / result["ref_ppl"], rel_tol=1e-6)
    text = run_cli("eval", out, "--data", text_file(tmp_path), "--reference", src, "--window", 40, "--quiet").output
    assert "top-1 agreement" in text and "ratio" in text and "\ntext0 " in text
    in_memory = only_set(run_cli("eval", out, "--data", text_file(tmp_path), "--window", 40, "--tables", "memory",
                                 "--json", "--quiet").stdout)
    assert in_memory["ppl"] == result["ppl"]  # the default, mmap, scores the same
    failed = CliRunner().invoke(main, ["eval", str(out), "--data", str(text_file(tmp_path)), "--tables", "host"])
    assert failed.exit_code == 1 and "this machine has none; use stem_tables='mmap'" in failed.output
    assert "Traceback" not in failed.output and len(failed.output.strip().splitlines()) == 1


def test_evaluate_refuses_text_shorter_than_a_window(dense_dir, tmp_path):
    _, src = dense_dir("llama")
    save_tiny_tokenizer(src)
    result = run_cli("eval", src, "--data", text_file(tmp_path, n_words=30), "--window", 64)
    assert result.exit_code == 1 and "fewer than one window of 64" in result.output


def test_reference_with_another_vocabulary_is_refused(dense_dir, tmp_path):
    _, src = dense_dir("llama")
    save_tiny_tokenizer(src)
    _, other = dense_dir("llama", name="other", vocab_size=128)
    result = run_cli("eval", src, "--data", text_file(tmp_path), "--reference", other)
    assert result.exit_code == 1 and "must share the tokenizer" in result.output


def test_model_without_tokenizer_is_a_clear_error(dense_dir, tmp_path):
    _, src = dense_dir("llama")
    result = run_cli("eval", src, "--data", text_file(tmp_path))
    assert result.exit_code == 1 and "has no tokenizer that loads" in result.output


def test_evaluate_function_matches_cli_figures(dense_dir, tmp_path):
    dense, src = dense_dir("llama")
    save_tiny_tokenizer(src)
    text = text_file(tmp_path, n_words=90)
    ids = torch.tensor([int(w[1:]) for w in text.read_text().split()])
    figures = evaluate(dense.eval(), ids, window=30)
    assert figures["tokens"] == 3 * 29
    cli = only_set(run_cli("eval", src, "--data", text, "--window", 30, "--json", "--quiet").stdout)
    assert cli["tokens"] == figures["tokens"] and cli["ppl"] == pytest.approx(figures["ppl"], rel=1e-6)


def test_named_sets_are_scored_apart_and_files_of_one_name_are_joined(dense_dir, tmp_path):
    _, src = dense_dir("llama")
    save_tiny_tokenizer(src)
    a, b, c = (text_file(tmp_path, seed=i) for i in range(3))
    result = json.loads(run_cli("eval", src, "--data", f"ab={a}", "--data", f"ab={b}", "--data", c, "--window", 50,
                                "--json", "--quiet").stdout)
    assert list(result["sets"]) == ["ab", "text2"]
    assert result["sets"]["ab"]["tokens"] == 8 * 49  # two files of 200 words: 400 tokens, 8 windows
    alone = only_set(run_cli("eval", src, "--data", c, "--window", 50, "--json", "--quiet").stdout)
    assert result["sets"]["text2"] == alone
    for bad in (f"x={tmp_path / 'missing.txt'}", str(tmp_path / "missing.txt")):
        failed = CliRunner().invoke(main, ["eval", str(src), "--data", bad])
        assert failed.exit_code == 1 and "missing.txt is not a file" in failed.output
    failed = CliRunner().invoke(main, ["eval", str(src)])
    assert failed.exit_code == 2 and "--data" in failed.output


def test_factual_recall_scores_greedy_completions(dense_dir, tmp_path):
    from stem_upcycle.facts import complete, load_facts

    dense, src = dense_dir("llama")
    tokenizer = save_tiny_tokenizer(src)
    said = complete(dense.eval(), tokenizer, "w1 w2 w3").split()
    facts = tmp_path / "facts.jsonl"
    facts.write_text(json.dumps({"prompt": "w1 w2 w3", "answers": ["w999", said[2]]}) + "\n\n"
                     + json.dumps({"prompt": "w1 w2 w3", "answers": ["w999"]}) + "\n")
    result = json.loads(run_cli("eval", src, "--facts", facts, "--reference", src, "--json", "--quiet").stdout)
    assert (result["facts"]["correct"], result["facts"]["total"]) == (1, 2)
    assert [r["correct"] for r in result["facts"]["completions"]] == [True, False]
    assert result["reference_facts"]["correct"] == 1 and result["sets"] == {}
    assert len(load_facts()) >= 30  # the packaged set
    (tmp_path / "bad.jsonl").write_text('{"prompt": "w1"}\n')
    failed = CliRunner().invoke(main, ["eval", str(src), "--facts", str(tmp_path / "bad.jsonl")])
    assert failed.exit_code == 1 and "bad.jsonl:1 is not a JSON object with a prompt" in failed.output


def test_device_and_dtype_options(dense_dir, tmp_path):
    """bf16 compute scores close to fp32 (the dtype reaches both models); impossible choices are one-line errors."""
    _, src = dense_dir("llama")
    save_tiny_tokenizer(src)
    out = tmp_path / "stem"
    assert run_cli("convert", src, out, "--layers", "1", "--init", "closed-form", "--quiet").exit_code == 0
    args = ("eval", out, "--data", text_file(tmp_path), "--reference", src, "--window", 40, "--json", "--quiet")
    fp32 = json.loads(run_cli(*args, "--device", "cpu").stdout)
    bf16 = json.loads(run_cli(*args, "--device", "cpu", "--dtype", "bfloat16").stdout)
    assert (fp32["device"], fp32["dtype"], bf16["dtype"]) == ("cpu", "float32", "bfloat16")
    a, b = only_set(json.dumps(fp32)), only_set(json.dumps(bf16))
    assert a["ppl"] != b["ppl"] and math.isclose(a["ppl"], b["ppl"], rel_tol=0.03)
    assert math.isclose(a["ref_ppl"], b["ref_ppl"], rel_tol=0.03) and a["ref_ppl"] != b["ref_ppl"]
    bad = [("--device", "cpu", "--dtype", "float16"), ("--device", "warp9")]
    if not torch.cuda.is_available():
        bad.append(("--device", "cuda"))
    for options in bad:
        failed = CliRunner().invoke(main, ["eval", str(out), "--data", str(text_file(tmp_path)), *options])
        assert failed.exit_code == 1 and options[-1] in failed.output, failed.output
        assert "Traceback" not in failed.output and len(failed.output.strip().splitlines()) == 1
