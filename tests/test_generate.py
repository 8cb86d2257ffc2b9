"""Text sampled from the dense model: seeded batches, the top-k start, the on-disk cache, calibration."""

import json
from dataclasses import replace

import torch

from stem_upcycle.generate import GeneratedText, Sampling, as_stream, sample_batch
from stem_upcycle.source import open_source
from stem_upcycle.table_init import InitOptions
from stem_upcycle.table_init.calibrated import calibration_windows

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
    assert sample_batch(model, tokenizer, sampling, 2).shape == (8, 24)  # batches are always whole
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
        logits = model(ids).logits[:, :4]
    logits[..., EOS] = float("-inf")  # end-of-text is never drawn, so never among the k
    top3 = logits.topk(3, -1).indices  # [16, 4, 3]
    assert (top3 == ids[:, 1:5, None]).any(-1).all()


def test_generated_text_is_cached_batch_by_batch_whatever_the_processes_or_the_size(tmp_path):
    model, tokenizer, source = _model_and_tokenizer(tmp_path)
    sampling = Sampling(sequences=10, length=12, batch_size=4, seed=1)
    one = GeneratedText(source, sampling, tmp_path / "cache1")
    assert one.missing() == [0, 1, 2]
    stats = one.generate(model, tokenizer, progress=False)
    assert stats["tokens"] == 3 * 4 * 12 and stats["tokens_per_s"] > 0  # whole batches
    assert one.missing() == [] and one.load().shape == (10, 12)
    two = GeneratedText(source, sampling, tmp_path / "cache2")
    for rank in (1, 0):  # two processes, each its share of the batches
        two.generate(model, tokenizer, rank=rank, world=2, progress=False)
    assert torch.equal(one.load(), two.load())
    # A run cut short resumes at the missing batch; a larger request generates only the batches it adds.
    (two.folder / "batch-000001.safetensors").unlink()
    assert two.generate(model, tokenizer, progress=False)["tokens"] == 4 * 12
    larger = GeneratedText(source, Sampling(sequences=14, length=12, batch_size=4, seed=1), tmp_path / "cache2")
    assert larger.folder == two.folder and larger.missing() == [3]
    ids, stats = larger.ensure(model, tokenizer, progress=False)
    assert stats["tokens"] == 4 * 12 and torch.equal(ids[:10], one.load())
    assert larger.ensure(model, tokenizer, progress=False)[1] == {}  # all on disk now
    # The key covers the settings: other settings are other text in another folder.
    other = GeneratedText(source, Sampling(sequences=10, length=12, batch_size=4, seed=2), tmp_path / "cache1")
    assert other.folder != one.folder and other.missing() == [0, 1, 2]
    assert json.loads((one.folder / "sampling.json").read_text())["seed"] == 1  # the folder says what it holds


def test_generated_sequences_are_joined_with_eos_as_documents_are_packed():
    sequences = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    assert as_stream(sequences, 9).tolist() == [1, 2, 3, 9, 4, 5, 6, 9]
    assert as_stream(sequences, None).tolist() == [1, 2, 3, 4, 5, 6]  # a tokenizer without EOS


def test_calibration_windows_take_text_first_then_generated_ids(tmp_path):
    _, tokenizer, source = _model_and_tokenizer(tmp_path)
    (tmp_path / "calib.txt").write_text(" ".join(f"w{i % 50}" for i in range(100)))
    generated = torch.arange(60, 90).repeat(2)  # 60 ids
    options = InitOptions(calib_data=[str(tmp_path / "calib.txt")], calib_tokens=80, calib_seq_len=10,
                          calib_generated=generated)
    windows = calibration_windows(source, options)
    assert windows.shape == (8, 10)  # 20 text tokens + 60 generated = the budget of 80
    assert windows.flatten()[:20].tolist() == [i % 50 for i in range(20)]
    assert torch.equal(windows.flatten()[20:], generated)
    only_generated = calibration_windows(source, replace(options, calib_data=[]))
    assert torch.equal(only_generated.flatten(), generated)


def test_convert_calibrates_on_generated_text_without_any_data(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from stem_upcycle.cli import main
    from stem_upcycle.stages import STAGES

    _model_and_tokenizer(tmp_path)
    monkeypatch.setenv("STEM_UPCYCLE_CACHE", str(tmp_path / "cache"))
    args = ["convert", str(tmp_path / "dense"), "--layers", "0,2", "--init", "calib", "--calib-generate", "1024",
            "--calib-tokens", "1024", "--calib-seq-len", "32", "--quiet"]
    first = CliRunner().invoke(main, [*args[:2], str(tmp_path / "a"), *args[2:]])
    assert first.exit_code == 0, first.output
    assert "sample: 1,024 tokens generated (" in first.output  # 4 sequences of 256, one batch (Sampling.covering)
    # --quiet: no bar, the plan's time and a line as each stage ends
    ended = [line.split(":")[0] for line in first.output.splitlines() if line.split(":")[0] in STAGES]
    assert ended == ["sample", "read text", "rows", "parent rows", "write"], first.output
    assert "time       ~" in first.output and "sample " in first.output.split("time       ~")[1].splitlines()[0]
    second = CliRunner().invoke(main, [*args[:2], str(tmp_path / "b"), *args[2:]])
    assert second.exit_code == 0 and "tokens generated" not in second.output  # read back from the cache
    assert f"sample: 1,024 tokens read from {tmp_path / 'cache'}" in second.output
    weights = "model-00001-of-00001.safetensors"
    assert (tmp_path / "a" / weights).read_bytes() == (tmp_path / "b" / weights).read_bytes()
    assert "--calib-generate 1024" in (tmp_path / "a" / "README.md").read_text()
    dry = CliRunner().invoke(main, [*args[:2], str(tmp_path / "c"), *args[2:], "--dry-run"])
    assert dry.exit_code == 0 and "dry run: nothing written" in dry.output
    too_many = CliRunner().invoke(main, [*args[:2], str(tmp_path / "d"), *args[2:7], "2048", *args[8:]])
    assert too_many.exit_code == 1 and "more than --calib-tokens" in too_many.output
