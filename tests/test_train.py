"""`stem-upcycle train` end to end on tiny models: learning, exact resume, export, processes."""

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from stem_upcycle.cli import main
from stem_upcycle.evaluate import evaluate
from stem_upcycle.training import checkpoint
from stem_upcycle.training.tables import distinct_ids
from stem_upcycle.training.recipe import load_recipe
from stem_upcycle.training.trainer import Trainer
from stem_upcycle.modeling.table_files import read_header

from .conftest import VOCAB, crashing_at, markov_text, save_tiny_tokenizer, train_log, train_overrides


def test_training_lowers_held_out_perplexity_and_exports_a_stem_model(workspace):
    from transformers import AutoModelForCausalLM

    out = workspace / "out"
    recipe = load_recipe(None, train_overrides(workspace, "train.steps=30", "train.lr=3e-3",
                                          "train.trainable=[tables, gate_down, norms, attention]"))
    trainer = Trainer(recipe, out, progress=False)
    trainer.run()
    log = train_log(out)
    assert log[-1]["eval"]["heldout"]["ppl"] < 0.7 * log[0]["eval"]["heldout"]["ppl"]
    assert log[-1]["loss"] < log[1]["loss"]
    # rows covered: none before training (the init was given, not calibrated here), then those of the ids trained
    trained = torch.cat([trainer.batches.step(s)[0][:, 1:-1].flatten() for s in range(30)]).unique()
    read = trainer.heldout["heldout"][:, 1:-1]
    assert log[0]["eval"]["heldout"]["rows_covered"] == 0
    assert log[-1]["eval"]["heldout"]["rows_covered"] == pytest.approx(torch.isin(read, trained).float().mean().item())
    # Same tensors, shapes, dtypes and order as the converted checkpoint; W_up in STEM layers for the first token.
    def layout(path):  # (shard, name, shape, dtype) in the order of the bytes (safe_open lists names sorted)
        index = json.loads((path / "model.safetensors.index.json").read_text())
        tensors = []
        for shard in sorted(set(index["weight_map"].values())):
            header = read_header(str(path / shard))[0]
            tensors += [(shard, k, v["shape"], v["dtype"]) for k, v in
                        sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]) if k != "__metadata__"]
        return tensors
    assert layout(out) == layout(workspace / "stem")
    names = [name for _, name, _, _ in layout(out)]
    assert any("layers.0.mlp.up_proj" in name for name in names)
    # layers 0 and 2 side by side, where layer 0's table would be: after layer 0's tensors, before layer 1's
    assert ("model.stem_table_groups.0.weight", [VOCAB, 2 * 48], "F32") in [entry[1:] for entry in layout(out)]
    assert names.index("model.layers.0.mlp.up_proj.weight") < names.index("model.stem_table_groups.0.weight") \
        < names.index("model.layers.1.mlp.up_proj.weight")
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ids = trainer.heldout["heldout"][:2, :-1]
    for table in trainer.tables.values():
        table.gather(distinct_ids(ids))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trainer.causal_lm.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    heldout = trainer.heldout["heldout"]  # the training log's perplexity is the one `stem-upcycle eval` gives
    scored = evaluate(loaded, heldout.flatten(), window=heldout.shape[1])
    assert scored["tokens"] == log[-1]["eval"]["heldout"]["tokens"]
    assert scored["ppl"] == pytest.approx(log[-1]["eval"]["heldout"]["ppl"], rel=1e-4)
    card = (out / "README.md").read_text()
    assert "Recovery training" in card and "> At conversion, before training: A converted" in card  # not "not trained"
    assert (workspace / "stem" / "config.json").exists()  # a given init_from is never removed
    # a run from a trained model keeps its own log and recipe, not those of the run that made its starting point
    again = workspace / "again"
    Trainer(load_recipe(None, [*train_overrides(workspace, "train.steps=2"), f"model.init_from={out}"]), again,
            progress=False).run()
    assert [r["step"] for r in train_log(again)] == [0, 1, 2]
    assert "steps: 2" in (again / "recipe.yaml").read_text()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradient_checkpointing_recomputes_the_layers_during_backward(workspace, checkpointing):
    """Transformers checkpoints only in training mode: the trainer must put the model in it (and
    evaluation back in eval mode), else `gradient_checkpointing: true` silently does nothing."""
    recipe = load_recipe(None, train_overrides(workspace, "train.steps=1", "train.trainable=[tables, gate_down]",
                                          f"train.gradient_checkpointing={str(checkpointing).lower()}"))
    trainer = Trainer(recipe, workspace / "out", progress=False)
    calls = []
    # A submodule's hook: Transformers checkpoints a layer's `forward`, inside its hooks, so the layer's
    # own hooks see one call; the recomputation calls the attention again.
    trainer.causal_lm.model.layers[1].self_attn.register_forward_hook(lambda *_: calls.append(1))
    trainer.train_step(0)
    micro_batches = 2  # batch_size 8 / micro_batch_size 4
    assert len(calls) == micro_batches * (2 if checkpointing else 1)
    assert trainer.causal_lm.training
    trainer.evaluate()
    assert trainer.causal_lm.training  # evaluation ran in eval mode and handed training mode back


@pytest.mark.parametrize("export_dtype", ["auto", "float32"])
def test_export_keeps_the_source_dtype_unless_told(workspace, export_dtype):
    """The training copy is fp32; a bf16 source comes back bf16 (auto), not twice its size."""
    from transformers import AutoModelForCausalLM

    source = workspace / "dense16"
    AutoModelForCausalLM.from_pretrained(workspace / "dense", dtype=torch.bfloat16).save_pretrained(source)
    save_tiny_tokenizer(source)
    overrides = [o for o in train_overrides(workspace, "train.steps=1", f"model.export_dtype={export_dtype}",
                                       f"model.source={source}", "model.layers=0,2")
                 if not o.startswith("model.init_from") and o != f"model.source={workspace / 'dense'}"]
    out = Trainer(load_recipe(None, overrides), workspace / "out", progress=False).run()
    expected = torch.bfloat16 if export_dtype == "auto" else torch.float32
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {expected}
    assert json.loads((out / "config.json").read_text())["dtype"] == str(expected).removeprefix("torch.")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert loaded.dtype == expected and loaded.stem_tables == "mmap"
    with pytest.raises(Exception, match="model.export_dtype 'int8' is unknown"):
        load_recipe(None, [*overrides, "model.export_dtype=int8"])


def test_resume_continues_exactly(workspace, monkeypatch):
    extra = ("train.steps=5", "train.checkpoint_every=2", "train.trainable=[tables, lora, norms]", "handoff.steps=3")
    Trainer(load_recipe(None, train_overrides(workspace, *extra)), workspace / "a", progress=False).run()
    uninterrupted = train_log(workspace / "a")

    with crashing_at(monkeypatch, 3):
        Trainer(load_recipe(None, train_overrides(workspace, *extra)), workspace / "b", progress=False).run()
    assert not (workspace / "b" / "config.json").exists()  # nothing that looks like a finished model
    stale = workspace / "b" / "checkpoints" / "step.partial-999999999"  # a checkpoint write cut short by SIGKILL
    stale.mkdir()
    (stale / "tables.safetensors").write_bytes(b"half written")
    Trainer(load_recipe(None, train_overrides(workspace, *extra)), workspace / "b", resume=True, progress=False).run()
    assert not stale.exists()
    resumed = train_log(workspace / "b")
    assert [r["step"] for r in resumed] == [r["step"] for r in uninterrupted] == [0, 1, 2, 3, 4, 5]
    for a, b in zip(uninterrupted, resumed):
        assert a.get("loss") == b.get("loss") and a.get("eval") == b.get("eval")


def test_train_cli_refuses_to_mix_runs(workspace):
    recipe = workspace / "r.yaml"
    recipe.write_text("model: {source: x}\n")
    runner = CliRunner()
    (workspace / "busy").mkdir()
    (workspace / "busy" / "keep.txt").write_text("user data")
    sets = [w for o in train_overrides(workspace, "train.steps=1") for w in ("--set", o)]
    result = runner.invoke(main, ["train", str(recipe), "--output", str(workspace / "busy"), *sets])
    assert result.exit_code == 1 and "is not empty" in result.output
    assert (workspace / "busy" / "keep.txt").read_text() == "user data"
    result = runner.invoke(main, ["train", str(recipe), "--output", str(workspace / "fresh"), "--resume", *sets])
    assert result.exit_code == 1 and "no training run" in result.output
    with pytest.MonkeyPatch.context() as env:  # launched as 2 processes, but not as a distributed run
        env.setenv("WORLD_SIZE", "2")
        result = runner.invoke(main, ["train", str(recipe), "--output", str(workspace / "fresh"), *sets])
    assert result.exit_code == 1 and "ACCELERATE_USE_CPU=1" in result.output and not (workspace / "fresh").exists()
    result = runner.invoke(main, ["train", str(recipe), "--output", str(workspace / "x"), "--set", "train.steps=0"])
    assert result.exit_code == 1 and "train.steps must be > 0, got 0" in result.output
    for overrides, says in [(["generated.tokens=2000", "generated.length=100"],
                             "generated.length 100 passes the teacher's context of 64 positions; give at most 64"),
                            (["train.trainable=[lora]", "lora.r=33"], "lora.r 33 is above the model's hidden size 32")]:
        sets = [w for o in train_overrides(workspace, "train.steps=1", *overrides) for w in ("--set", o)]
        result = runner.invoke(main, ["train", str(recipe), "--output", str(workspace / "bad"), *sets])
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert result.exit_code == 1 and len(errors) == 1 and says in errors[0], result.output
        assert not (workspace / "bad").exists()  # so that the corrected command can use the same --output


def test_a_checkpoint_is_complete_only_once_every_process_wrote_its_part(tmp_path, monkeypatch):
    """accelerate's save_state writes a file per process (its RNG state) and returns without waiting for the
    others: the checkpoint must not be renamed into place before the slowest process wrote. Two threads stand
    in for two processes, the second one late."""
    import accelerate.utils

    barrier, sent = threading.Barrier(2, timeout=20), []

    def broadcast(objects):  # the main process's list reaches every process
        sent.extend(o for o in objects if o is not None)
        barrier.wait()
        return list(sent)

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)

    class Process:
        num_processes = 2

        def __init__(self, rank):
            self.rank, self.is_main_process = rank, rank == 0

        def wait_for_everyone(self):
            barrier.wait()

        def save_state(self, folder):
            time.sleep(0.5 * self.rank)
            os.makedirs(folder, exist_ok=True)
            (Path(folder) / f"random_states_{self.rank}.pkl").write_bytes(b"state")

    errors = []

    def save(rank):
        try:
            checkpoint.save(Process(rank), tmp_path, 3, {}, None, tokens_seen=0, keep=2)
        except Exception as error:  # reported below, the other thread released
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=save, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert [p.name for p in tmp_path.iterdir()] == ["step-3"]  # no staging folder left behind
    assert sorted(p.name for p in (tmp_path / "step-3" / "accelerate").iterdir()) == ["random_states_0.pkl",
                                                                                     "random_states_1.pkl"]


def test_generated_text_mixes_into_batches_and_named_sets_are_scored_apart(workspace):
    """Teacher-generated sequences fill their share of each batch (KL only), calibrate the conversion, and are
    cached; every held-out set is scored against the teacher on its own; checkpoints go once the model is out."""
    (workspace / "other.txt").write_text(markov_text(800, 2))
    cache = workspace / "generated"
    common = [f"model.source={workspace / 'dense'}", "model.layers=0,2", "model.calib_tokens=1024",
              "model.calib_seq_len=32", "data.seq_len=32", "data.eval_tokens=128", "train.batch_size=4",
              "train.micro_batch_size=2", "train.eval_every=2", "train.steps=4", "train.checkpoint_every=2",
              "train.trainable=[tables, gate_down]", "generated.tokens=660", "generated.length=16",
              "generated.batch_size=8",
              f"generated.cache_dir={cache}", "generated.calib_share=0.5",
              f"data.eval={{markov: [{workspace / 'heldout.txt'}], other: [{workspace / 'other.txt'}]}}"]
    mixed = Trainer(load_recipe(None, [*common, f"data.train=[{workspace / 'train.txt'}]"]), workspace / "mixed",
                    progress=False)
    assert mixed.generated.shape == (42, 16)  # 660 tokens, rounded up to whole sequences of generated.length
    batch, generated = mixed.batches.step(0)
    assert generated.tolist() == [False, False, True, True]  # train_share 0.5 of a batch of 4
    stream = torch.cat([mixed.generated, torch.full((42, 1), VOCAB - 2)], 1).flatten()  # joined with EOS
    assert all(any(torch.equal(row, stream[i : i + 33]) for i in range(0, stream.numel() - 32, 32)) for row in batch[2:])
    mixed.run()
    log = train_log(workspace / "mixed")
    assert log[0]["generated"]["tokens"] == 6 * 8 * 16  # whole batches of 8, of which 42 sequences are used
    assert log[0]["generated"]["tokens_per_s"] > 0
    assert [sorted(r["eval"]) for r in log if "eval" in r] == [["markov", "other"]] * 3
    assert all(r["eval"]["markov"]["ref_ppl"] == log[0]["eval"]["markov"]["ref_ppl"] for r in log if "eval" in r)
    assert log[0]["eval"]["markov"]["ppl"] != log[0]["eval"]["other"]["ppl"]
    assert not (workspace / "mixed" / "checkpoints").exists()  # the output is the model, ready to share
    assert not (workspace / "mixed" / "init").exists()
    assert not (workspace / "mixed" / "host-tables").exists()  # the shared tables went with the export
    card = (workspace / "mixed" / "README.md").read_text()
    assert "| markov |" in card and "| other |" in card and "660 tokens sampled" in card

    # Data-free: generated text only (read back from the cache), calibration on it too; checkpoints kept.
    free = Trainer(load_recipe(None, [*common, "generated.train_share=1", "train.keep_checkpoints_at_end=true",
                                      "model.keep_init=true"]),
                   workspace / "free", progress=False)
    assert torch.equal(free.generated, mixed.generated) and free.generation_stats == {}
    assert free.batches.step(0)[1].all()
    before = free.tables[0].weight.clone()
    free.run()
    log = train_log(workspace / "free")
    assert all(r["ce"] is None and r["kd"] > 0 for r in log[1:])  # KL only: no cross-entropy on generated text
    changed = (free.tables[0].weight != before).any(1).nonzero()[:, 0]
    read = torch.cat([free.batches.step(s)[0][:, :-1] for s in range(4)]).unique()
    assert changed.numel() > 0 and torch.isin(changed, read).all()  # the rows of the generated text trained
    assert (workspace / "free" / "checkpoints" / "step-2").exists() and (workspace / "free" / "init" / "config.json").exists()


def test_the_recipe_fine_tunes_the_dense_model_itself_as_the_baseline(workspace):
    """`model.init_from` = the dense model, dense parts trainable: the baseline a STEM run is compared with
    (benchmarks/dense_finetune.py, train_gpu.py); it trains, has no rows and exports a dense model."""
    from transformers import AutoModelForCausalLM

    out = workspace / "dense-ft"
    overrides = [o for o in train_overrides(workspace, "train.steps=4", "train.lr=3e-3", "train.eval_every=4",
                                       "train.trainable=[mlp, norms, attention]") if not o.startswith("model.init_from")]
    Trainer(load_recipe(None, overrides + [f"model.init_from={workspace / 'dense'}"]), out, progress=False).run()
    log = train_log(out)
    assert log[-1]["eval"]["heldout"]["ppl"] < log[0]["eval"]["heldout"]["ppl"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama" and not any("up_table" in n for n in model.state_dict())
