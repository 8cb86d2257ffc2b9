"""The token cache: one exact token stream per corpus, tokenised once (in pieces, by several processes)."""

import threading

import numpy as np
import pytest
import torch

from stem_upcycle.training.tokens import BATCH_PIECES, DataError, Sequences, plan_pieces, tokenize_corpus

from .conftest import VOCAB, save_tiny_tokenizer

EOS = VOCAB - 2


def _words(n, seed, per_line=7):
    g = np.random.default_rng(seed)
    words = [f"w{i}" for i in g.integers(0, VOCAB - 2, n)]
    return "\n".join(" ".join(words[i : i + per_line]) for i in range(0, n, per_line))


@pytest.fixture
def corpus(tmp_path):
    tokenizer = save_tiny_tokenizer(tmp_path / "tok")
    (tmp_path / "a.jsonl").write_text('{"text": "w1 w2 w3"}\n\n{"text": "w4 w5"}\n')
    (tmp_path / "b.txt").write_text("w6 w7 w8 w9")
    (tmp_path / "big.txt").write_text(_words(3000, 0))
    (tmp_path / "big.jsonl").write_text("".join(f'{{"text": "{_words(20, s, 20)}"}}\n' for s in range(150)))
    return tmp_path, tokenizer


def _expected(tmp_path, tokenizer, names):
    """Every document tokenised whole, EOS after each: the stream the cache must hold."""
    import json

    stream = []
    for name in names:
        path = tmp_path / name
        docs = ([json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
                if path.suffix == ".jsonl" else [path.read_text()])
        for doc in docs:
            stream += tokenizer(doc, add_special_tokens=False)["input_ids"] + [EOS]
    return torch.tensor(stream)


def test_stream_is_every_document_tokenised_whole_with_eos_between(corpus):
    tmp_path, tokenizer = corpus
    names = ["a.jsonl", "b.txt", "big.txt", "big.jsonl"]
    files = [tmp_path / n for n in names]
    pieces = plan_pieces(files, piece_bytes=1000)
    assert len(pieces) > 20  # the big files are cut into many pieces, each starting a line
    for p in pieces:
        assert p.start == 0 or p.path.read_bytes()[p.start - 1 : p.start] == b"\n"
    expected = _expected(tmp_path, tokenizer, names)
    stream = tokenize_corpus(files, tokenizer, "text", tmp_path / "cache", piece_bytes=1000)
    assert stream.dtype == np.uint16 and len(stream) == expected.numel()
    assert torch.equal(stream.read(0, len(stream)), expected)
    assert torch.equal(stream.read(5, 3), expected[5:8])


def test_processes_share_the_tokenising_and_the_cache_is_reused(corpus, monkeypatch):
    tmp_path, tokenizer = corpus
    files = [tmp_path / "big.txt", tmp_path / "big.jsonl"]
    barrier = threading.Barrier(2)
    results, calls = {}, []
    original = type(tokenizer).__call__

    def counting(self, texts, **kwargs):
        calls.append(threading.current_thread().name)
        return original(self, texts, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)

    def run(rank):
        results[rank] = tokenize_corpus(files, tokenizer, "text", tmp_path / "cache", rank, 2, barrier.wait,
                                        piece_bytes=500, run="threads")

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = _expected(tmp_path, tokenizer, ["big.txt", "big.jsonl"])
    assert {"rank0", "rank1"} <= set(calls)  # both processes encoded pieces
    for rank in range(2):
        assert torch.equal(results[rank].read(0, len(results[rank])), expected)
    folders = results[0].folders
    for folder in folders:  # a folder a file
        assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "tokens.bin"]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(f.name for f in folders)  # no parts left
    calls.clear()
    again = tokenize_corpus(files, tokenizer, "text", tmp_path / "cache", piece_bytes=500)
    assert calls == [] and again.folders == folders  # read back, not tokenised again
    (tmp_path / "big.txt").write_text(_words(100, 1))  # a changed file is tokenised again, the other read back
    changed = tokenize_corpus(files, tokenizer, "text", tmp_path / "cache", piece_bytes=500)
    assert changed.folders[0] != folders[0] and changed.folders[1] == folders[1]
    assert len(calls) == -(-len(plan_pieces([tmp_path / "big.txt"], 500)) // BATCH_PIECES)  # its pieces' batches only
    grown = tokenize_corpus([*files, tmp_path / "a.jsonl"], tokenizer, "text", tmp_path / "cache", piece_bytes=500)
    assert grown.folders[:2] == changed.folders  # a corpus that grows by a file tokenises that file alone
    assert torch.equal(grown.read(0, len(grown)),
                       _expected(tmp_path, tokenizer, ["big.txt", "big.jsonl", "a.jsonl"]))


def test_sequences_cut_the_stream_with_one_shared_token(corpus):
    tmp_path, tokenizer = corpus
    stream = tokenize_corpus([tmp_path / "a.jsonl", tmp_path / "b.txt"], tokenizer, "text", tmp_path / "cache")
    seqs = Sequences(stream, seq_len=4)
    assert seqs.tensor().tolist() == [[1, 2, 3, EOS, 4], [4, 5, EOS, 6, 7]]  # neighbours share one token
    assert len(Sequences(stream, 4, max_tokens=8)) == 1
    head, tail = seqs.split(1)
    assert head.tensor().tolist() == [[1, 2, 3, EOS, 4]] and tail.tensor().tolist() == [[4, 5, EOS, 6, 7]]
    in_memory = Sequences(stream.read(0, len(stream)), 4)
    assert torch.equal(in_memory[torch.tensor([1, 0])], seqs[torch.tensor([1, 0])])


def test_a_bad_record_names_its_line(corpus):
    tmp_path, tokenizer = corpus
    lines = [f'{{"text": "w{i}"}}' for i in range(300)]
    lines[250] = '{"txt": "w1"}'
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:251 has no string field 'text'"):
        tokenize_corpus([tmp_path / "bad.jsonl"], tokenizer, "text", tmp_path / "cache", piece_bytes=200)
    (tmp_path / "bad.jsonl").write_text('{"text": "w1"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 is not valid JSON"):
        tokenize_corpus([tmp_path / "bad.jsonl"], tokenizer, "text", tmp_path / "cache")


def _parquet(path, texts, row_group_size, column="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), path, row_group_size=row_group_size)


def test_parquet_rows_are_documents_and_hub_datasets_come_from_the_local_cache(corpus, monkeypatch):
    from stem_upcycle.evaluate import read_token_ids
    from stem_upcycle.hub_datasets import DatasetSpec, resolve

    tmp_path, tokenizer = corpus
    texts = [_words(15, s, 15) for s in range(10)]
    _parquet(tmp_path / "rows.parquet", texts, row_group_size=3)  # 4 row groups: 4 pieces
    stream = tokenize_corpus([tmp_path / "rows.parquet"], tokenizer, "text", tmp_path / "cache")
    expected = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [EOS]]
    assert stream.read(0, len(stream)).tolist() == expected
    with pytest.raises(DataError, match="has no column 'body'"):
        tokenize_corpus([tmp_path / "rows.parquet"], tokenizer, "body", tmp_path / "cache")
    # Calibration and eval read documents too: a .jsonl record's text, never its JSON syntax.
    ids = read_token_ids([str(tmp_path / "a.jsonl"), str(tmp_path / "rows.parquet")], tokenizer, 6)
    assert ids.tolist() == [1, 2, 3, 4, 5] + tokenizer(texts[0], add_special_tokens=False)["input_ids"][:1]

    # A dataset already in the Hugging Face cache, as the hub lays it out.
    hub = tmp_path / "hub"
    snapshot = hub / "datasets--some-org--tiny-text" / "snapshots" / "abc123"
    (snapshot / "data").mkdir(parents=True)
    (hub / "datasets--some-org--tiny-text" / "refs").mkdir()
    (hub / "datasets--some-org--tiny-text" / "refs" / "main").write_text("abc123")
    _parquet(snapshot / "data" / "train-00000.parquet", texts, 3)
    (snapshot / "README.md").write_text("# a card, not data")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # offline: the cache's files are the listing
    monkeypatch.setenv("STEM_UPCYCLE_CACHE", str(tmp_path / "records"))
    resolved = resolve(DatasetSpec.parse("hf:some-org/tiny-text", "data.train"), 10, tokenizer, "text")
    assert resolved.paths == [snapshot / "data" / "train-00000.parquet"] and resolved.pending == []
    with pytest.raises(DataError, match="some-org/absent is not in the Hugging Face cache"):
        resolve(DatasetSpec.parse("hf:some-org/absent", "data.train"), 10, tokenizer, "text")


def test_a_bad_record_in_one_process_share_stops_every_process(corpus):
    """The process that meets the error tells the others at the barrier: all stop with it, none waits forever."""
    tmp_path, tokenizer = corpus
    lines = [f'{{"text": "w{i}"}}' for i in range(300)]
    lines[290] = "not json"
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    barrier, errors = threading.Barrier(2, timeout=30), {}

    def run(rank):
        try:
            tokenize_corpus([tmp_path / "bad.jsonl"], tokenizer, "text", tmp_path / "cache", rank, 2, barrier.wait,
                            piece_bytes=200, run="threads")
        except DataError as err:
            errors[rank] = str(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors[0] == errors[1] and "bad.jsonl:291 is not valid JSON" in errors[0]


def test_a_held_out_prefix_is_the_stream_s_first_ids_and_tokenises_only_the_pieces_it_takes(corpus, monkeypatch):
    from stem_upcycle.training.tokens import tokenize_prefix

    tmp_path, tokenizer = corpus
    files = [tmp_path / "big.txt", tmp_path / "big.jsonl"]
    whole = tokenize_corpus(files, tokenizer, "text", tmp_path / "cache", piece_bytes=500)
    calls = []
    original = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, texts, **kw: calls.append(1) or original(self, texts, **kw))
    prefix = tokenize_prefix(files, tokenizer, "text", tmp_path / "cache", 300, piece_bytes=500)
    assert torch.equal(prefix.read(0, len(prefix)), whole.read(0, 300)) and len(prefix) == 300
    assert 0 < len(calls) < -(-len(plan_pieces(files, 500)) // BATCH_PIECES)  # not every batch of pieces
    calls.clear()
    again = tokenize_prefix(files, tokenizer, "text", tmp_path / "cache", 300, piece_bytes=500)
    assert calls == [] and again.folder == prefix.folder  # cached
    more = tokenize_prefix(files, tokenizer, "text", tmp_path / "cache", 10**9, piece_bytes=500)
    assert len(more) == len(whole)  # a corpus shorter than asked: all of it
    (tmp_path / "bad.jsonl").write_text('{"text": "w1"}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl:2 is not valid JSON"):
        tokenize_prefix([tmp_path / "bad.jsonl"], tokenizer, "text", tmp_path / "cache", 10)
