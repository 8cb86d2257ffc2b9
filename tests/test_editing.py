"""Knowledge editing: run-time and persistent swaps of table rows, undo, and their errors."""

import hashlib
import json
import os
import shutil
import threading

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from stem_upcycle import editing
from stem_upcycle.cli import main
from stem_upcycle.editing import EditError, Swap, plan_edit

from .conftest import save_tiny_tokenizer, tiny_stem

PROMPT = "w1 w5 w2 w3 w5 w4"  # "w5" (id 5) at positions 1 and 4


@pytest.fixture
def stem_dir(tmp_path):
    """A tiny STEM model (layers 0 and 2) in several shards, with the word-level tokenizer (wN is id N); its
    first tokens read their rows (`first_token="table"`), so that an edit reaches every position."""
    model = tiny_stem("llama", layers=(0, 2), dense_first_token=False)
    path = tmp_path / "model"
    model.save_pretrained(path, max_shard_size="40KB")
    save_tiny_tokenizer(path)
    return path


def load(path, placement="memory", **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, stem_tables=placement, **kwargs).eval()


def ids_of(text):
    return torch.tensor([[int(w[1:]) for w in text.split()]])


def files_digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def up_rows(model, ids):
    """Per STEM layer, the rows [seq, d_ff] its MLP multiplies the gate with, for `ids` [1, seq]."""
    seen = {}

    def keep(layer):
        return lambda mlp, args, out: seen.__setitem__(layer, mlp.up(args[0])[0].clone())

    hooks = [model.model.layers[i].mlp.register_forward_hook(keep(i)) for i in model.config.stem_layers]
    with torch.no_grad():
        logits = model(ids).logits
    for hook in hooks:
        hook.remove()
    return seen, logits


def test_each_length_mode_gives_the_rows_it_promises(stem_dir):
    model, tokenizer = load(stem_dir), AutoTokenizer.from_pretrained(stem_dir)
    with torch.no_grad():  # row v holds v everywhere: which rows a source token reads is then visible
        for layer in model.config.stem_layers:
            weight = model.model.layers[layer].mlp.up_table.weight
            weight.copy_(torch.arange(weight.shape[0], dtype=torch.float32)[:, None].expand_as(weight))
    pad = tokenizer.eos_token_id  # the tiny tokenizer has no pad token: EOS pads
    source, target = "w10 w11 w12", {"long": "w20 w21 w22 w23", "short": "w30 w31", "same": "w40 w41 w42"}
    expected = {  # per mode and target: the value of each source token's row after the edit
        ("one_to_one", "same"): [40, 41, 42],
        ("auto", "same"): [40, 41, 42],
        ("auto", "short"): [30.5, 30.5, 30.5],
        ("average", "long"): [21.5, 21.5, 21.5],
        ("copy", "short"): [30, 31, 30],
        ("copy", "long"): [20, 21, 22],
        ("left_pad", "short"): [pad, 30, 31],
        ("left_pad", "long"): [21, 22, 23],
        ("right_pad", "short"): [30, 31, pad],
        ("right_pad", "long"): [20, 21, 22],
    }
    for (mode, which), values in expected.items():
        plan = plan_edit(tokenizer, model.config, [Swap(source, target[which])], mode)
        changes = editing.apply_edit(model, plan)
        for layer in model.config.stem_layers:
            rows = model.stem_table_rows(layer, torch.tensor([10, 11, 12]))
            assert torch.equal(rows, torch.tensor(values, dtype=rows.dtype)[:, None].expand_as(rows)), (mode, which)
        editing.revert_edit(model, changes)
        assert model.stem_table_rows(0, torch.tensor([10, 11, 12]))[:, 0].tolist() == [10, 11, 12]
    with pytest.raises(EditError, match="one_to_one needs as many"):
        plan_edit(tokenizer, model.config, [Swap(source, target["short"])], "one_to_one")


@pytest.mark.parametrize("placement", ["memory", "mmap", "host"])
def test_run_time_edit_equals_the_persistent_edit_and_leaves_other_positions_bit_identical(
        stem_dir, placement, host_on_cpu):
    model, tokenizer = load(stem_dir, placement, stem_cache_rows=16), AutoTokenizer.from_pretrained(stem_dir)
    ids = ids_of(PROMPT)
    plain_rows, plain = up_rows(model, ids)
    plan = plan_edit(tokenizer, model.config, ["w5=w9"])
    with editing.runtime_edit(model, tokenizer, PROMPT, plan) as found:
        assert [o.positions for o in found] == [(1,), (4,)]
        rows, runtime = up_rows(model, ids)
    for layer in model.config.stem_layers:
        target = model.stem_table_rows(layer, torch.tensor([9]))[0].to(plain_rows[layer])
        keep = torch.tensor([p not in (1, 4) for p in range(ids.shape[1])])
        assert torch.equal(rows[layer][keep], plain_rows[layer][keep])  # bit-identical outside the entity
        assert torch.equal(rows[layer][1], target) and torch.equal(rows[layer][4], target)
    assert torch.equal(runtime[0, 0], plain[0, 0])  # the position before the entity: untouched
    assert not torch.allclose(runtime[0, 1:], plain[0, 1:])  # the edit is seen after it
    assert model.stem_row_edit is None  # gone after the block
    assert torch.equal(up_rows(model, ids)[1], plain)

    changes = editing.apply_edit(model, plan)  # the persistent edit of the loaded model
    assert torch.equal(up_rows(model, ids)[1], runtime)  # identical logits
    editing.revert_edit(model, changes)
    assert torch.equal(up_rows(model, ids)[1], plain)  # and no stale row (the host cache forgot them)


def test_a_first_token_keeps_its_dense_up_projection_under_run_time_and_persistent_edits(tmp_path):
    """In a model whose first tokens keep the dense up-projection, an entity that is the prompt's first token
    reads no row: run-time and persistent edits leave it alike (with a warning), and edit its other occurrences."""
    path = tmp_path / "dense-first"
    tiny_stem("llama", layers=(0, 2)).save_pretrained(path)
    save_tiny_tokenizer(path)
    model, tokenizer = load(path), AutoTokenizer.from_pretrained(path)
    prompt = "w5 w1 w5 w2"
    ids = ids_of(prompt)
    plain_rows, plain = up_rows(model, ids)
    plan = plan_edit(tokenizer, model.config, ["w5=w9"])
    with pytest.warns(UserWarning, match="first token"), editing.runtime_edit(model, tokenizer, prompt, plan):
        rows, runtime = up_rows(model, ids)
    for layer in model.config.stem_layers:
        assert torch.equal(rows[layer][0], plain_rows[layer][0])  # W_up x of the first token, not a row
        assert torch.equal(rows[layer][2], model.stem_table_rows(layer, torch.tensor([9]))[0])
    assert torch.equal(runtime[0, :2], plain[0, :2]) and not torch.allclose(runtime[0, 2:], plain[0, 2:])
    editing.apply_edit(model, plan)
    assert torch.equal(up_rows(model, ids)[1], runtime)


def test_run_time_edit_follows_the_prompt_through_the_kv_cache_and_last_occurrence_only(stem_dir):
    model, tokenizer = load(stem_dir, "mmap"), AutoTokenizer.from_pretrained(stem_dir)
    plan = plan_edit(tokenizer, model.config, ["w5=w9"])
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    at_start = "w5 w1 w2 w5"  # position 0 edited: a decode step (position 0 of its forward) must not be
    ids = ids_of(at_start)
    with editing.runtime_edit(model, tokenizer, at_start, plan):
        cached = model.generate(ids, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences[:, :ids.shape[1]], ids)  # input ids unchanged
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(uncached.scores), rtol=1e-5, atol=1e-5)
    ids = ids_of(PROMPT)

    plain_rows, _ = up_rows(model, ids)
    with editing.runtime_edit(model, tokenizer, PROMPT, plan, occurrences="last") as found:
        assert [o.positions for o in found] == [(4,)]
        rows, _ = up_rows(model, ids)
    assert torch.equal(rows[0][:4], plain_rows[0][:4]) and not torch.equal(rows[0][4], plain_rows[0][4])
    with editing.runtime_edit(model, tokenizer, PROMPT, plan), pytest.raises(ValueError, match="not the prompt"):
        model(ids_of("w1 w6 w2 w3 w5 w4"))  # another input: refused, not edited at the wrong tokens


@pytest.mark.parametrize("side", ["left", "right"])
def test_run_time_edit_of_a_padded_batch_edits_each_prompt_at_its_own_positions(stem_dir, side):
    """A batch of prompts of different lengths, padded as the tokenizer pads it: each row's edited
    rows are where its own prompt holds the entity, and each row's logits are those of its prompt
    edited alone; the padding and every other position keep their rows."""
    model, tokenizer = load(stem_dir), AutoTokenizer.from_pretrained(stem_dir)
    tokenizer.pad_token, tokenizer.padding_side = "<eos>", side
    prompts = ["w5 w2", "w1 w3 w4 w5 w5 w2"]  # the entity at position 0 of one, 3 and 4 of the other
    plan = plan_edit(tokenizer, model.config, ["w5=w9"])
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    pad = 4 if side == "left" else 0  # the short prompt's offset in the batch
    seen = {}
    hook = model.model.layers[0].mlp.register_forward_hook(lambda mlp, args, out: seen.update(rows=mlp.up(args[0])))
    position_ids = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)  # padding does not move the positions
    with torch.no_grad():
        plain = model(**batch, position_ids=position_ids).logits
        plain_rows = seen["rows"]
        with editing.runtime_edit(model, tokenizer, prompts, plan) as found:
            assert [[o.positions for o in f] for f in found] == [[(0,)], [(3,), (4,)]]
            edited = model(**batch, position_ids=position_ids).logits
            rows = seen["rows"]
            tokenizer.padding_side = "right" if side == "left" else "left"
            with pytest.raises(ValueError, match="not the prompt"):  # padded on the other side: refused
                model(tokenizer(prompts, padding=True, return_tensors="pt")["input_ids"])
            tokenizer.padding_side = side
    hook.remove()
    target = model.model.layers[0].mlp.up_table.weight.detach()[9]
    changed = [(0, pad), (1, 3), (1, 4)]
    for row, position in changed:
        assert torch.equal(rows[row, position], target)
    keep = torch.ones(rows.shape[:2], dtype=torch.bool)
    keep[[r for r, _ in changed], [p for _, p in changed]] = False
    assert torch.equal(rows[keep], plain_rows[keep])  # padding and other tokens: bit-identical
    for row, prompt in enumerate(prompts):  # each row = its prompt edited alone
        ids = ids_of(prompt)
        with editing.runtime_edit(model, tokenizer, prompt, plan):
            alone = up_rows(model, ids)[1][0]
        real = batch["attention_mask"][row].bool()
        torch.testing.assert_close(edited[row][real], alone, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(edited[row][real], plain[row][real])
    with pytest.raises(EditError, match="w5.*does not occur in the prompt 'w1 w2'"):
        with editing.runtime_edit(model, tokenizer, ["w5 w1", "w1 w2"], plan):
            pass


def test_run_time_edit_of_a_batch_through_generate_beams_and_a_wrong_padding(stem_dir):
    """generate() on a left-padded batch = each prompt edited alone; beams repeat each prompt in place
    and every copy is edited; a batch padded otherwise, even where the entity's tokens line up, a batch
    of another size and a tokenizer without a pad token are refused."""
    model, tokenizer = load(stem_dir), AutoTokenizer.from_pretrained(stem_dir)
    plan = plan_edit(tokenizer, model.config, ["w5=w9"])
    prompts = ["w5 w5", "w1 w5 w5"]
    with pytest.raises(EditError, match="no pad token"):
        with editing.runtime_edit(model, tokenizer, prompts, plan):
            pass
    tokenizer.pad_token, tokenizer.padding_side = "<eos>", "left"
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    with editing.runtime_edit(model, tokenizer, prompts, plan, occurrences="last"):
        together = model.generate(**batch, **kwargs)
    for row, prompt in enumerate(prompts):
        with editing.runtime_edit(model, tokenizer, prompt, plan, occurrences="last"):
            alone = model.generate(ids_of(prompt), **kwargs)
        assert torch.equal(together.sequences[row, -4:], alone.sequences[0, -4:])
        torch.testing.assert_close(torch.stack(together.scores)[:, row], torch.stack(alone.scores)[:, 0],
                                   rtol=1e-5, atol=1e-5)

    prefill = []
    hook = model.model.layers[0].mlp.register_forward_hook(
        lambda mlp, args, out: prefill.append(mlp.up(args[0])) if not prefill else None)
    with editing.runtime_edit(model, tokenizer, prompts, plan, occurrences="last"):
        model.generate(**batch, num_beams=2, num_return_sequences=2, max_new_tokens=2, pad_token_id=0)
    hook.remove()
    rows, target = prefill[0], model.model.layers[0].mlp.up_table.weight.detach()[9]
    assert rows.shape[0] == 4  # each prompt twice, in place: [p0, p0, p1, p1]
    for row in range(4):  # the last w5 of each prompt stands at padded position 2
        assert torch.equal(rows[row, 2], target) and not torch.equal(rows[row, 1], target)

    with editing.runtime_edit(model, tokenizer, prompts, plan, occurrences="last"):
        with pytest.raises(ValueError, match="made for 2 prompts and the input holds 3 rows"):
            model(torch.cat([batch["input_ids"], batch["input_ids"][:1]]))
    tokenizer.padding_side = "right"  # the edit made for right padding: row 0's last w5 at position 1 ...
    with editing.runtime_edit(model, tokenizer, prompts, plan, occurrences="last"):
        with pytest.raises(ValueError, match="not the prompt"):  # ... where the left-padded batch holds a w5 too
            model(batch["input_ids"])


def test_layers_subset_edits_only_those_layers(stem_dir):
    model, tokenizer = load(stem_dir), AutoTokenizer.from_pretrained(stem_dir)
    ids = ids_of(PROMPT)
    plain_rows, _ = up_rows(model, ids)
    with editing.runtime_edit(model, tokenizer, PROMPT, plan_edit(tokenizer, model.config, ["w5=w9"], layers=[2])):
        rows, _ = up_rows(model, ids)
    assert torch.equal(rows[0], plain_rows[0]) and not torch.equal(rows[2], plain_rows[2])


def test_run_time_edits_mix_modes_stay_in_their_thread_and_nest(stem_dir):
    model, tokenizer = load(stem_dir), AutoTokenizer.from_pretrained(stem_dir)
    prompt = "w1 w5 w2 w3"
    ids = ids_of(prompt)
    table = model.model.layers[0].mlp.up_table.weight.detach()
    plain_rows, plain = up_rows(model, ids)
    both = plan_edit(tokenizer, model.config, ["w5=w20 w21", "w3=w9"])  # average (k=2) beside one_to_one (k=1)
    with editing.runtime_edit(model, tokenizer, prompt, both):
        rows, edited = up_rows(model, ids)
        other = {}
        thread = threading.Thread(target=lambda: other.update(logits=up_rows(model, ids)[1]))
        thread.start()
        thread.join()
        with editing.runtime_edit(model, tokenizer, prompt, plan_edit(tokenizer, model.config, ["w2=w9"])):
            inner = up_rows(model, ids)[0]
        assert torch.equal(up_rows(model, ids)[1], edited)  # the outer edit is back after the inner block
    torch.testing.assert_close(rows[0][1], (table[20] + table[21]) / 2, rtol=1e-6, atol=1e-6)
    assert torch.equal(rows[0][3], table[9]) and torch.equal(rows[0][[0, 2]], plain_rows[0][[0, 2]])
    assert torch.equal(inner[0][2], table[9]) and torch.equal(inner[0][1], plain_rows[0][1])
    assert torch.equal(other["logits"], plain)  # another thread's forwards are not edited


def test_spellings_and_positions_with_a_sentencepiece_style_tokenizer_and_bos(tmp_path):
    """A Metaspace BPE tokenizer (word starts marked, BOS added): ' Spain' and 'Spain' at the start are
    one spelling, '(Spain' another; an entity inside a longer word is no occurrence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "▁", "a", "(", ")", "S", "p", "i", "n", "v", "l", "e", "G", "r", "m", "y",
              "Sp", "ai", "ain", "Spain", "▁Spain", "▁(", "▁a", "Ge", "Ger", "Germ", "Germa", "German", "Germany",
              "▁Germany", "vi", "vil", "vill", "ville"]
    merges = [("S", "p"), ("a", "i"), ("ai", "n"), ("Sp", "ain"), ("▁", "Spain"), ("▁", "("), ("▁", "a"),
              ("G", "e"), ("Ge", "r"), ("Ger", "m"), ("Germ", "a"), ("Germa", "n"), ("German", "y"),
              ("▁", "Germany"), ("v", "i"), ("vi", "l"), ("vil", "l"), ("vill", "e")]
    backend = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")
    spain = editing.spellings(tokenizer, "Spain")
    assert [(s.text, s.ids) for s in spain] == [(" Spain", (21,)), ("(Spain", (20,))]
    config = tiny_stem("llama", layers=(0, 2)).config
    plan = plan_edit(tokenizer, config, ["Spain=Germany"])
    assert [(m.source.ids, m.target.ids) for m in plan.maps] == [((21,), (30,)), ((20,), (29,))]
    prompt = "Spain (Spain) a Spainville a Spain"
    found = editing.find_occurrences(tokenizer, prompt, plan)
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == 1  # BOS first: positions count it
    assert [(o.chars, o.positions) for o in found] == [((0, 5), (1,)), ((7, 12), (3,)), ((29, 34), (9,))]
    assert [ids[o.positions[0]] for o in found] == [21, 20, 21]
    with pytest.raises(EditError, match="does not know"):
        editing.spellings(tokenizer, "Spaix")


def test_persistent_edit_writes_a_new_model_and_undo_restores_every_file_byte_for_byte(stem_dir, tmp_path):
    (stem_dir / "README.md").write_bytes(b"---\r\nlicense: mit\r\n---\r\n# A card with CRLF line ends\r\n")
    before = files_digest(stem_dir)
    edited, again = tmp_path / "edited", tmp_path / "edited-twice"
    run = CliRunner().invoke(main, ["edit", str(stem_dir), "--swap", "w5=w9", "--output", str(edited)])
    assert run.exit_code == 0, run.output
    assert "' w5' ['w5'] -> ' w9' ['w9']" in run.output
    assert files_digest(stem_dir) == before  # MODEL untouched
    index = json.loads((stem_dir / "model.safetensors.index.json").read_text())["weight_map"]
    table_shards = {index[f"model.layers.{i}.mlp.up_table.weight"] for i in (0, 2)}
    for shard in set(index.values()):
        linked = os.stat(stem_dir / shard).st_ino == os.stat(edited / shard).st_ino
        assert linked == (shard not in table_shards), shard  # unchanged shards linked, edited ones copied
    # the written model reads the target's rows at the source's tokens, like a live persistent edit
    model, tokenizer = load(stem_dir), AutoTokenizer.from_pretrained(stem_dir)
    editing.apply_edit(model, plan_edit(tokenizer, model.config, ["w5=w9"]))
    ids = ids_of(PROMPT)
    for placement in ("memory", "mmap"):
        assert torch.equal(up_rows(load(edited, placement), ids)[1], up_rows(model, ids)[1])
    config = json.loads((edited / "config.json").read_text())
    assert config["stem_edits"][0]["swaps"] == ["w5=w9"] and "w5=w9" in (edited / "README.md").read_text()
    inspect = CliRunner().invoke(main, ["inspect", str(edited)])
    assert "edits" in inspect.output and "w5=w9" in inspect.output

    # a second edit on the edited model, then MODEL removed: undo still restores the original bytes
    run = CliRunner().invoke(main, ["edit", str(edited), "--swap", "w9=w5", "--swap", "w7=w8", "--output", str(again)])
    assert run.exit_code == 0, run.output
    shutil.rmtree(stem_dir)
    run = CliRunner().invoke(main, ["edit", str(again), "--undo"])
    assert run.exit_code == 0, run.output
    assert "undid 2 edit(s)" in run.output
    assert files_digest(again) == before
    restored = tmp_path / "restored"
    run = CliRunner().invoke(main, ["edit", str(edited), "--undo", "--output", str(restored)])
    assert run.exit_code == 0, run.output
    assert files_digest(restored) == before and "stem_edits" in (edited / "config.json").read_text()


def test_an_undo_that_fails_midway_changes_no_file(stem_dir, tmp_path, monkeypatch):
    before = files_digest(stem_dir)
    edited = tmp_path / "edited"
    run = CliRunner().invoke(main, ["edit", str(stem_dir), "--swap", "w5=w9", "--swap", "w7=w8", "--output", str(edited)])
    assert run.exit_code == 0, run.output
    edited_digest, write_rows, calls = files_digest(edited), editing._write_rows, []

    def fail_second(*args):  # the first restored rows are written, then the disk fills
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        write_rows(*args)

    monkeypatch.setattr(editing, "_write_rows", fail_second)
    with pytest.raises(OSError):
        editing.undo_edits(edited)
    assert files_digest(edited) == edited_digest and not list(edited.glob(".*"))  # no file changed, no temporary
    monkeypatch.setattr(editing, "_write_rows", write_rows)
    assert editing.undo_edits(edited) == 1 and files_digest(edited) == before


def test_prompt_prints_before_and_after_and_writes_nothing(stem_dir):
    before = files_digest(stem_dir)
    run = CliRunner().invoke(main, ["edit", str(stem_dir), "--swap", "w5=w9", "--prompt", PROMPT,
                                    "--max-new-tokens", "4"])
    assert run.exit_code == 0, run.output
    lines = run.output.splitlines()
    assert any(line.startswith("before") for line in lines) and any(line.startswith("after edit") for line in lines)
    assert "tokens [1]" in run.output and "tokens [4]" in run.output
    assert files_digest(stem_dir) == before


def test_editing_errors_are_one_line(stem_dir, dense_dir, tmp_path):
    _, dense = dense_dir()
    save_tiny_tokenizer(dense)
    cases = [
        (["edit", str(dense), "--swap", "w5=w9"], "dense checkpoint"),
        (["edit", str(stem_dir), "--swap", "w5=w9", "--layers", "1"], "layer 1 is not a STEM layer"),
        (["edit", str(stem_dir), "--swap", "w5=w9", "--prompt", "w1 w2"], "does not occur in the prompt"),
        (["edit", str(stem_dir), "--swap", "w5"], "is not SOURCE=TARGET"),
        (["edit", str(stem_dir), "--swap", "w5=w9", "--output", str(stem_dir)], "not empty"),
        (["edit", str(stem_dir), "--undo"], "records no edit"),
        (["edit", str(stem_dir), "--swap", "w10 w11=w12", "--mode", "one_to_one"], "one_to_one needs"),
        (["edit", str(stem_dir), "--swap", "w5=w9", "--output", str(stem_dir / "inside")], "lies inside"),
        (["edit", str(stem_dir), "--swap", "w5=w999"], "does not know"),
    ]
    for args, message in cases:
        run = CliRunner().invoke(main, args)
        assert run.exit_code == 1 and message in run.output, (args, run.output)
        assert len(run.output.strip().splitlines()) == 1, run.output
    run = CliRunner().invoke(main, ["edit", str(stem_dir), "--undo", "--mode", "copy", "--layers", "0"])
    assert run.exit_code == 2 and "Error: --undo takes only MODEL and --output, not --mode, --layers" in run.output
    tokenizer = AutoTokenizer.from_pretrained(stem_dir)
    with pytest.raises(EditError, match="tokenises to nothing"):
        plan_edit(tokenizer, load(stem_dir).config, [Swap("w5", " ")])
