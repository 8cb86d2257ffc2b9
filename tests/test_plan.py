"""Planning without weights: Llama-3.2-1B's real shapes, layer specs, and the shard writer."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM

from stem_upcycle.cli import main
from stem_upcycle.convert import plan_conversion
from stem_upcycle.layers import LayerSpecError, parse_layers
from stem_upcycle.shards import INDEX_NAME, ShardWriter, TensorSpec, index_json, plan_shards
from stem_upcycle.shapes import LLAMA_32_1B
from stem_upcycle.source import Source, StateDictStore, open_source
from stem_upcycle.training.plan import Launch, plan_training
from stem_upcycle.training.recipe import load_recipe

from .conftest import train_overrides


@pytest.fixture(scope="module")
def llama_1b_source():
    config = LlamaConfig(**LLAMA_32_1B)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return Source(spec="meta-llama/Llama-3.2-1B", config=config, tensors=StateDictStore(tensors), tokenizer_args=("", {}))


@pytest.mark.parametrize("first_token", ["table", "dense"])
def test_llama_32_1b_plan_has_the_expected_tables_sizes_and_index(llama_1b_source, first_token):
    plan = plan_conversion(llama_1b_source, layers="1::2", first_token=first_token)
    assert plan.layers == [1, 3, 5, 7, 9, 11, 13, 15]
    assert plan.dtype == torch.bfloat16
    # a table is 1.05B parameters, 2.1 GB: two side by side (`config.stem_table_groups`) fill a 5 GB shard
    assert plan.config.stem_table_groups == [[1, 3], [5, 7], [9, 11], [13, 15]]
    tables = plan.table_specs
    assert [t.name for t in tables] == [f"model.stem_table_groups.{k}.weight" for k in range(4)]
    assert all(t.shape == (128256, 2 * 8192) and t.dtype == torch.bfloat16 for t in tables)
    assert tables[0].nbytes == 2 * 128256 * 8192 * 2 == 2 * 2_101_346_304
    dense_params = 1_235_814_400  # Llama-3.2-1B with the tied head counted once
    up_params = 8 * 8192 * 2048 if first_token == "table" else 0  # kept for the first token: 1.6% of a table
    assert plan.total_bytes == 2 * (dense_params - up_params + 8 * 128256 * 8192)
    index = index_json(plan.shards)
    assert index["metadata"]["total_size"] == plan.total_bytes
    assert len(index["weight_map"]) == len(plan.specs) and "lm_head.weight" not in index["weight_map"]
    kept = [n for n in index["weight_map"] if "up_proj" in n and any(f"layers.{i}." in n for i in plan.layers)]
    assert len(kept) == (8 if first_token == "dense" else 0)
    for shard in plan.shards:  # 5 GB shards: a group of two tables fits
        assert sum(s.nbytes for s in shard) <= 5_000_000_000
    assert plan_conversion(llama_1b_source, layers="1::2", max_shard_size="10GB").config.stem_table_groups == [
        [1, 3, 5, 7], [9, 11, 13, 15]]  # four in 10 GB shards
    per_table = plan_conversion(llama_1b_source, layers="1::2", first_token=first_token, layer_groups=1)
    assert [t.name for t in per_table.table_specs] == [f"model.layers.{i}.mlp.up_table.weight" for i in plan.layers]
    assert per_table.config.stem_table_groups is None and per_table.total_bytes == plan.total_bytes
    assert plan.ram_estimate() < 6e9
    assert plan.config.stem_layers == plan.layers and plan.config.vocab_size == 128256


def test_llama_32_1b_by_default_converts_a_sixth_of_every_layers_neurons(llama_1b_source):
    """Every layer, a sixth of each one's neurons (in multiples of 64) with a calibrating init; whole layers without
    one, where no neuron can be scored; whole layers where --layers names some."""
    from stem_upcycle.table_init import InitOptions

    text = InitOptions(calib_generated=torch.zeros(0, dtype=torch.long))  # stands for the text a run samples
    plan = plan_conversion(llama_1b_source, init="calib", init_options=text, dry_run=True)
    assert plan.layers == list(range(16)) and set(plan.config.stem_table_columns.values()) == {1344}  # 8192 / 6
    assert "every token read after 4 of 16 contexts of 48 tokens: 513,024 positions" in plan.describe()
    assert plan.parent_bytes == 128256 * 16 * 1344 * 2  # bf16, beside the output while its tables are written
    assert plan_conversion(llama_1b_source).config.stem_table_columns is None  # closed-form: whole layers
    assert plan_conversion(llama_1b_source, layers="1/3", init="calib", init_options=text,
                           dry_run=True).config.stem_table_columns is None


@pytest.mark.parametrize("spec, n, expected", [
    ("all", 4, [0, 1, 2, 3]),
    ("1/3", 30, list(range(0, 30, 3))),
    ("1/2", 16, list(range(0, 16, 2))),
    ("1/3", 16, [0, 3, 6, 9, 12]),
    ("1/1", 5, [0, 1, 2, 3, 4]),
    ("1::2", 16, list(range(1, 16, 2))),
    ("2:10:4", 16, [2, 6]),
    ("0,4,8-11", 16, [0, 4, 8, 9, 10, 11]),
    ("3,1,3", 16, [1, 3]),
])
def test_layer_specs(spec, n, expected):
    assert parse_layers(spec, n) == expected


@pytest.mark.parametrize("spec", ["16", "0/3", "4/3", "x", "9-2", "::0", "20:30", "1,,2"])
def test_bad_layer_specs_name_the_valid_range(spec):
    with pytest.raises(LayerSpecError, match="--layers"):
        parse_layers(spec, 16)


def test_shard_writer_round_trips_chunked_tensors(tmp_path):
    torch.manual_seed(0)
    tensors = {"a": torch.randn(10, 4), "b": torch.randn(7, 3).to(torch.bfloat16), "c": torch.arange(5), "d": torch.randn(3)}
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    shards = plan_shards(specs, 100)
    written = []
    writer = ShardWriter(tmp_path, shards, on_bytes=written.append)
    writer.write("a", tensors["a"][:3])
    writer.write("a", tensors["a"][3:])
    for name in "bcd":
        writer.write(name, tensors[name])
    writer.close()
    assert sum(written) == sum(s.nbytes for s in specs)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    loaded = {}
    for shard_name in set(index["weight_map"].values()):
        loaded.update(load_file(tmp_path / shard_name))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)


def test_shard_writer_refuses_out_of_order_overlong_and_incomplete_writes(tmp_path):
    specs = [TensorSpec("a", (2, 2), torch.float32), TensorSpec("b", (2,), torch.float32)]
    writer = ShardWriter(tmp_path, plan_shards(specs, 1000))
    with pytest.raises(RuntimeError, match="plan order"):
        writer.write("b", torch.zeros(2))
    with pytest.raises(RuntimeError, match="past the"):
        writer.write("a", torch.zeros(3, 2))
    writer.write("a", torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="not written completely"):
        writer.close()


RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.mark.parametrize("recipe, launch", [("llama-3.2-1b.yaml", None), ("llama-3.2-1b-fsdp.yaml", "accelerate/fsdp.yaml")])
def test_the_gpu_recipes_state_their_plans(llama_1b_source, recipe, launch):
    """The figures in the comments of the Llama recipes are `train --plan`'s, for Llama-3.2-1B's real shapes."""
    launched = Launch.from_accelerate_config(str(RECIPES / launch)) if launch else Launch(device="cuda")
    plan = plan_training(load_recipe(str(RECIPES / recipe)), launched, llama_1b_source)
    comments = [line.removeprefix("# ") for line in (RECIPES / recipe).read_text().splitlines() if line.startswith("#")]
    text = plan.describe().splitlines()
    start = comments.index(text[0])
    assert comments[start : start + len(text)] == text


def test_a_plan_counts_each_part_and_divides_what_fsdp_shards(workspace, monkeypatch, capsys):
    recipe = load_recipe(None, train_overrides(workspace, "train.trainable=[tables, mlp]", "tables.optimizer=adam",
                                               "train.micro_batch_size=2",
                                               "train.checkpoint_every=1", "train.keep_checkpoints=2"))
    source = open_source(str(workspace / "dense"))
    one = plan_training(recipe, Launch(), source, distinct_rows=40)
    four = plan_training(recipe, Launch(processes=2, machines=2, fsdp=True), source, distinct_rows=40)
    vocab, d_ff, layers = 96, 48, 2
    # the embedding (tied head), 3 layers (2 norms, q o [32, 32], k v [16, 32], MLP: gate, up (kept for the first
    # token in the STEM layers), down [48, 32]), the final norm; the tables are not dense weights
    dense = 96 * 32 + 3 * (2 * 32 + 2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 48) + 32
    mlp = 3 * 3 * 32 * 48  # gate, up (kept for the first token in STEM layers), down of every layer
    lines = {line.what.split(" (")[0]: line.bytes for line in one.device}
    assert lines["student dense weights"] == 4 * dense
    assert lines["gradients of the trainable weights"] == 4 * mlp and lines["AdamW state"] == 8 * mlp
    assert lines["a step's rows and their gradients"] == 40 * d_ff * 8 * layers
    sharded = {line.what.split(" (")[0]: line.bytes for line in four.device}
    for part in ("student dense weights", "gradients of the trainable weights", "AdamW state"):
        assert sharded[part] == math.ceil(lines[part] / 4)
    assert sharded["teacher"] == lines["teacher"] and "two decoder layers gathered" in sharded
    host = {line.what.split(" (")[0]: line.bytes for line in one.host}
    assert host["tables"] == layers * vocab * d_ff * 4 and host["table optimizer state"] == layers * (2 * vocab * d_ff * 4 + vocab * 8)
    frozen = plan_training(load_recipe(None, train_overrides(workspace, "train.trainable=[mlp]")), Launch(), source, 40)
    assert {line.what.split(" (")[0]: line.bytes for line in frozen.host}["table optimizer state"] == 0
    assert {line.what.split(" (")[0]: line.bytes for line in frozen.device}["a step's rows"] == 40 * d_ff * 4 * layers
    # the CLI prints the plan, writes nothing, and fails in one line when OUTPUT's disk is too small
    recipe_file = workspace / "r.yaml"
    recipe_file.write_text("{}\n")
    sets = [w for o in train_overrides(workspace) for w in ("--set", o)]
    result = CliRunner().invoke(main, ["train", str(recipe_file), "--output", str(workspace / "out"), "--plan", *sets])
    assert result.exit_code == 0 and "each process" in result.output and "fits this machine" in result.output, result.output
    assert not (workspace / "out").exists()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    result = CliRunner().invoke(main, ["train", str(recipe_file), "--output", str(workspace / "out"), "--plan", *sets])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 1 and len(errors) == 1 and "disk: OUTPUT needs" in errors[0] and "0.0 GB free" in errors[0]
    launch = workspace / "launch.yaml"
    launch.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    result = CliRunner().invoke(main, ["train", str(recipe_file), "--output", str(workspace / "out"), "--launch-config",
                                       str(launch), *sets])  # without --plan: the launch is accelerate's to make
    assert result.exit_code == 2 and "--launch-config describes the launch for --plan" in result.output
