"""Text sampled from the dense model: seeded batches, the top-k start, the on-disk cache, calibration."""

import json

import torch
from safetensors import safe_open

from stem_upcycle.calibrate import calibration_windows
from stem_upcycle.generate import GeneratedText, Sampling, sample_batch
from stem_upcycle.source import open_source

from .conftest import VOCAB, save_tiny_tokenizer, tiny_dense

EOS = VOCAB - 2  # the tiny tokenizer's <eos>; <unk> is VOCAB - 1


def _model_and_tokenizer(tmp_path):
    model = tiny_dense("llama")
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(tmp_path / "dense")
    tokenizer = save_tiny_tokenizer(tmp_path / "dense")
    return model, tokenizer, open_source(str(tmp_path / "dense"))


def test_batches_are_seeded_start_greedy_then_sample_and_never_end(tmp_path):
    model, tokenizer, _ = _model_and_tokenizer(tmp_path)
    sampling = Sampling(sequences=20, length=24, batch_size=8, first_tokens=3, first_top_k=1, seed=5)
    first = sample_batch(model, tokenizer, sampling, 0)
    assert first.shape == (8, 24) and first.dtype == torch.int32
    assert torch.equal(first, sample_batch(model, tokenizer, sampling, 0))  # same seed and index: same text
    assert not torch.equal(first, sample_batch(model, tokenizer, sampling, 1))
    assert sample_batch(model, tokenizer, sampling, 2).shape == (4, 24)  # the last batch holds what is left
    assert not torch.isin(first[:, 0], torch.tensor(tokenizer.all_special_ids)).any()  # start: no special token
    assert not (first[:, 1:] == EOS).any()  # end-of-text is suppressed: every row is one text of full length
    with torch.no_grad():  # tokens 1..3 are the greedy continuation; later ones are sampled
        logits = model(first.long()).logits
    assert torch.equal(logits[:, :3].argmax(-1), first[:, 1:4].long())
    assert not torch.equal(logits[:, 3:-1].argmax(-1), first[:, 4:].long())


def test_top_k_start_keeps_the_first_tokens_among_the_k_most_likely(tmp_path):
    model, tokenizer, _ = _model_and_tokenizer(tmp_path)
    ids = sample_batch(model, tokenizer, Sampling(sequences=16, length=8, batch_size=16, first_tokens=4,
                                                  first_top_k=3), 0).long()
    with torch.no_grad():
        top3 = model(ids).logits[:, :4].topk(3, -1).indices  # [16, 4, 3]
    assert (top3 == ids[:, 1:5, None]).any(-1).all()


def test_generated_text_is_cached_and_independent_of_the_number_of_processes(tmp_path):
    model, tokenizer, source = _model_and_tokenizer(tmp_path)
    sampling = Sampling(sequences=10, length=12, batch_size=4, seed=1)
    one = GeneratedText(source, sampling, tmp_path / "cache1")
    assert not one.cached()
    stats = one.generate(model, tokenizer, progress=False)
    assert stats["tokens"] == 120 and stats["tokens_per_s"] > 0
    one.finish()
    assert one.cached() and not one.parts.exists()
    two = GeneratedText(source, sampling, tmp_path / "cache2")
    for rank in (1, 0):  # two processes, each its share of the batches
        two.generate(model, tokenizer, rank=rank, world=2, progress=False)
    two.finish()
    assert torch.equal(one.load(), two.load())
    assert one.load().shape == (10, 12)
    # A run cut short resumes at the missing batch: the others are not generated again.
    three = GeneratedText(source, sampling, tmp_path / "cache3")
    three.generate(model, tokenizer, progress=False)
    (three.parts / "batch-000001.safetensors").unlink()
    assert three.generate(model, tokenizer, progress=False)["tokens"] == 4 * 12
    three.finish()
    assert torch.equal(three.load(), one.load())
    # The key covers the settings: other settings are other text in another file.
    other = GeneratedText(source, Sampling(sequences=10, length=12, batch_size=4, seed=2), tmp_path / "cache1")
    assert other.path != one.path and not other.cached()
    with safe_open(str(one.path), "pt") as f:  # the file says how its text was sampled
        assert json.loads(f.metadata()["sampling"])["seed"] == 1


def test_calibration_windows_take_text_first_then_generated_ids(tmp_path):
    _, tokenizer, source = _model_and_tokenizer(tmp_path)
    (tmp_path / "calib.txt").write_text(" ".join(f"w{i % 50}" for i in range(100)))
    generated = torch.arange(60, 90).repeat(2)  # 60 ids
    options = {"calib_data": [str(tmp_path / "calib.txt")], "calib_tokens": 80, "calib_seq_len": 10,
               "calib_generated": generated}
    windows = calibration_windows(source, options)
    assert windows.shape == (8, 10)  # 20 text tokens + 60 generated = the budget of 80
    assert windows.flatten()[:20].tolist() == [i % 50 for i in range(20)]
    assert torch.equal(windows.flatten()[20:], generated)
    only_generated = calibration_windows(source, {**options, "calib_data": []})
    assert torch.equal(only_generated.flatten(), generated)
