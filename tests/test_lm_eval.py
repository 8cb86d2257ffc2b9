"""The local lm-evaluation-harness tasks (benchmarks/lm_eval_tasks) on a tiny STEM model, when lm-eval is installed."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from stem_upcycle.convert import plan_conversion, run_conversion
from stem_upcycle.source import open_source

from .conftest import save_tiny_tokenizer, tiny_dense

TASKS = Path(__file__).resolve().parents[1] / "benchmarks" / "lm_eval_tasks"


def _heldout_module():
    spec = importlib.util.spec_from_file_location("heldout", TASKS / "heldout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_last_word_task_scores_a_stem_model_as_computed_by_hand(tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    tiny_dense("llama", max_position_embeddings=256).save_pretrained(tmp_path / "dense")  # no passage truncated
    save_tiny_tokenizer(tmp_path / "dense")
    run_conversion(plan_conversion(open_source(str(tmp_path / "dense")), layers="0,2"), tmp_path / "stem", progress=False)
    g = torch.Generator().manual_seed(0)  # sentences of 5 to 30 words w0..w93, each ending with a period
    sentences = [" ".join(f"w{int(i)}" for i in torch.randint(0, 94, (int(n),), generator=g)) + "."
                 for n in torch.randint(5, 30, (120,), generator=g)]
    (tmp_path / "data" / "ood").mkdir(parents=True)
    (tmp_path / "data" / "ood" / "botchan.txt").write_text(" ".join(sentences))
    monkeypatch.setenv("STEM_UPCYCLE_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # lm-eval's datasets cache stays in the test

    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'stem'},trust_remote_code=True,"
                                  "dtype=float32", tasks=["stem_lastword_novel"], task_manager=manager, device="cpu",
                                  batch_size=4)
    figures = out["results"]["stem_lastword_novel"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "stem", trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "stem")
    docs = _heldout_module().lastword_docs(" ".join(sentences), 300)
    assert len(docs) > 10 and out["n-samples"]["stem_lastword_novel"]["effective"] == len(docs)
    hits, logliks = 0, []
    with torch.no_grad():
        for doc in docs:  # the word-level tokenizer: one token per word, so the target is one token
            ids = torch.tensor([tokenizer(doc["context"])["input_ids"]])
            (target,) = tokenizer(doc["target"])["input_ids"]
            logp = model(ids).logits[0, -1].log_softmax(-1)
            hits += int(logp.argmax()) == target
            logliks.append(logp[target].item())
    assert figures["acc,none"] == pytest.approx(hits / len(docs))
    assert figures["perplexity,none"] == pytest.approx(math.exp(-sum(logliks) / len(logliks)), rel=1e-4)
