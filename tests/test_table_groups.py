"""Tables stored in groups of layers (`compress --layer-groups`, `config.stem_table_groups`): a token's
rows of a group's layers side by side, read once per forward for the whole group by `mmap`; the round
trip back to a tensor per table; what refuses them; loading through remote code alone."""

import hashlib
import json
import re

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from stem_upcycle import editing
from stem_upcycle.cli import main
from stem_upcycle.modeling.table_files import checkpoint_files

from .conftest import VOCAB, export_stem, run_without_stem_upcycle, save_tiny_tokenizer, tiny_stem

D_FF = 48


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def load(path, placement="mmap", **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, stem_tables=placement, **kwargs).eval()


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name, path in checkpoint_files(str(folder), {}).items():
        with safe_open(path, "pt") as f:
            out[name] = f.get_tensor(name)
    return out


@pytest.fixture
def layer_major(tmp_path):
    """A tiny float32 STEM model, every layer converted (0, 1, 2), a tensor per table, in several shards."""
    path = export_stem(tiny_stem("llama", layers=(0, 1, 2)), tmp_path / "layer-major")
    save_tiny_tokenizer(path)
    return path


@pytest.fixture
def grouped(layer_major, tmp_path):
    out = tmp_path / "grouped"
    result = run("compress", layer_major, out, "--layer-groups", 2, "--quiet", "--max-shard-size", "40KB")
    assert result.exit_code == 0, result.output
    return out


def test_grouped_tables_hold_each_layers_rows_side_by_side_and_give_the_same_logits(layer_major, grouped, ids):
    config = json.loads((grouped / "config.json").read_text())
    assert config["stem_table_groups"] == [[0, 1], [2]] and "stem_table_format" not in config
    before, after = tensors(layer_major), tensors(grouped)
    assert not any("up_table" in name for name in after)
    assert after["model.stem_table_groups.0.weight"].shape == (VOCAB, 2 * D_FF)
    for layer, (name, column) in {0: ("0", 0), 1: ("0", 1), 2: ("1", 0)}.items():
        stored = after[f"model.stem_table_groups.{name}.weight"][:, column * D_FF : (column + 1) * D_FF]
        assert torch.equal(stored, before[f"model.layers.{layer}.mlp.up_table.weight"])
    dense = [n for n in before if "up_table" not in n]
    assert sorted(n for n in after if "stem_table_groups" not in n) == sorted(dense)
    assert all(torch.equal(after[n], before[n]) for n in dense)  # every other tensor as it was
    assert "2 groups of up to 2 layers side by side" in (grouped / "README.md").read_text()
    reference, model = load(layer_major, "memory"), load(grouped)
    assert model.stem_tables == "mmap" and not any("up_table" in n for n in model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
        for length in (VOCAB, 1):  # a prefill read ahead on the pool, a decode step read in the forward's thread
            x = torch.arange(VOCAB).flip(0)[None, :length]
            torch.testing.assert_close(model(x).logits, reference(x).logits, rtol=0, atol=0)
    for layer in (0, 1, 2):
        assert torch.equal(model.stem_table_rows(layer, torch.arange(VOCAB)),
                           reference.stem_table_rows(layer, torch.arange(VOCAB)))
    assert load(grouped, None).stem_tables == "mmap"  # the default placement reads them
    result = run("inspect", grouped)
    assert result.exit_code == 0 and "float32, 2 groups of up to 2 layers side by side" in result.output, result.output
    placements = [line.split()[0] for line in result.output.splitlines() if line.startswith("  ")]
    assert placements == ["memory", "mmap", "host"], result.output  # every placement reads them
    result = run("inspect", grouped, "--tables", "--layer", "1", "--sample", "32")
    assert result.exit_code == 0, result.output


def test_convert_stores_tables_in_groups_by_default_holding_the_rows_of_a_tensor_per_table(dense_dir, tmp_path, ids):
    _, dense = dense_dir("llama")
    out = {}
    for name, args in {"default": [], "per-table": ["--layer-groups", 1], "twos": ["--layer-groups", 2]}.items():
        out[name] = tmp_path / name
        result = run("convert", dense, out[name], "--layers", "all", "--init", "closed-form", "--quiet", *args)
        assert result.exit_code == 0, result.output
    groups = {name: json.loads((path / "config.json").read_text())["stem_table_groups"] for name, path in out.items()}
    assert groups == {"default": [[0, 1, 2]], "per-table": None, "twos": [[0, 1], [2]]}
    # the command as run: the default's groups follow from layers and columns (no --layer-groups N spells them
    # for tables of unequal widths); an explicit count is recorded
    made_with = {name: next(line for line in (path / "README.md").read_text().splitlines() if "made with" in line)
                 for name, path in out.items()}
    assert "--layer-groups" not in made_with["default"] and "--layer-groups 2" in made_with["twos"], made_with
    per_table, grouped = tensors(out["per-table"]), tensors(out["default"])
    assert not any("up_table" in n for n in grouped)
    for layer in (0, 1, 2):
        assert torch.equal(grouped["model.stem_table_groups.0.weight"][:, layer * D_FF : (layer + 1) * D_FF],
                           per_table[f"model.layers.{layer}.mlp.up_table.weight"])
    with torch.no_grad():
        expected = load(out["per-table"], "memory")(ids).logits
        for path in (out["default"], out["twos"]):
            torch.testing.assert_close(load(path)(ids).logits, expected, rtol=0, atol=0)
    # a group larger than a shard is not the default: a tensor per table where one table fills a shard
    result = run("convert", dense, tmp_path / "small", "--layers", "all", "--init", "closed-form", "--max-shard-size",
                 "30KB", "--dry-run")
    assert result.exit_code == 0 and "a tensor per table" in result.output, result.output
    result = run("convert", dense, tmp_path / "bad", "--layer-groups", 2, "--table-dtype", "int8", "--table-block", 16)
    assert result.exit_code == 1 and "give a float --table-dtype" in result.output and not (tmp_path / "bad").exists()


def test_a_forward_reads_and_advises_each_groups_rows_once(layer_major, grouped, monkeypatch):
    from stem_upcycle.modeling import stem_tables

    monkeypatch.setattr(stem_tables, "MIN_ROWS_PER_READ_TASK", 2)  # several read tasks per group
    monkeypatch.setattr(stem_tables, "LOOKAHEAD_LAYERS", 1)  # a group's second layer is started after its first
    calls = {"read": [], "advise": []}
    read_rows, advise_rows = stem_tables.read_rows, stem_tables.advise_rows
    monkeypatch.setattr(stem_tables, "read_rows", lambda fd, where, ids, out: calls["read"].append(
        (where, ids.numel())) or read_rows(fd, where, ids, out))
    monkeypatch.setattr(stem_tables, "advise_rows", lambda fd, where, ids: calls["advise"].append(
        (where, ids.numel())) or advise_rows(fd, where, ids))
    x = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[None, :80]
    read = {}
    for path in (layer_major, grouped):
        model = load(path)
        calls["read"].clear(), calls["advise"].clear()
        with torch.no_grad():
            model(x)
        tables = {t.parts["weight"] for t in model.stem_placement.stored.values()}
        rows = {where: sum(n for w, n in calls["read"] if w == where) for where in tables}
        assert rows == {where: 80 for where in tables}  # each stored tensor's rows of the forward, read once
        advised = [where for where, _ in calls["advise"] if where in tables]
        assert sorted(advised, key=lambda w: w.offset) == sorted(tables, key=lambda w: w.offset)
        read[path] = sum(n * where.row_bytes for where, n in calls["read"])  # every read of the forward
    assert len({t.parts["weight"] for t in load(grouped).stem_placement.stored.values()}) == 2
    # the same bytes, in 2 tensors' reads instead of 3: 80 rows of 3 layers of float32
    assert read[grouped] == read[layer_major] == 80 * 3 * D_FF * 4


def test_whole_tables_read_in_ranges_read_each_groups_bytes_once_with_rows_set_on_the_model(layer_major, grouped,
                                                                                          monkeypatch):
    """What training's shared copy, `compress` and the statistics read: each table by ranges of rows."""
    import os

    read = []
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: read.append(sum(map(len, buffers))) or
                        preadv(fd, buffers, offset))
    new = torch.randn(2, D_FF)
    tables = {}
    for path in (layer_major, grouped):
        placed = load(path).stem_placement
        placed.set_rows(1, torch.tensor([3, 70]), new)  # shadow the files' rows, as a run-time edit does
        read.clear()
        tables[path] = {layer: torch.cat([placed.read_range(layer, a, min(a + 40, VOCAB)) for a in range(0, VOCAB, 40)])
                        for layer in (0, 1, 2)}
        assert sum(read) == 3 * VOCAB * D_FF * 4, path  # every table's rows once, not a group's once per layer
    for layer in (0, 1, 2):
        torch.testing.assert_close(tables[grouped][layer], tables[layer_major][layer], rtol=0, atol=0)
    assert torch.equal(tables[grouped][1][[3, 70]], new)


def test_compress_turns_groups_back_into_a_tensor_per_table_byte_for_byte(layer_major, grouped, tmp_path, ids):
    back = tmp_path / "back"
    result = run("compress", grouped, back, "--layer-groups", 1, "--quiet")
    assert result.exit_code == 0, result.output
    assert "stem_table_groups" not in json.loads((back / "config.json").read_text())
    before, after = tensors(layer_major), tensors(back)
    assert set(after) == set(before)
    for name in before:
        assert torch.equal(after[name], before[name]), name
    assert load(back, "memory").stem_tables == "memory"  # parameters again, which training needs
    # a dtype and a grouping at once; the layout alone keeps the dtype
    bf16 = tmp_path / "bf16"
    assert run("compress", layer_major, bf16, "--table-dtype", "bfloat16", "--layer-groups", 3, "--quiet").exit_code == 0
    stored = tensors(bf16)["model.stem_table_groups.0.weight"]
    assert stored.dtype == torch.bfloat16 and stored.shape == (VOCAB, 3 * D_FF)
    assert torch.equal(stored[:, D_FF : 2 * D_FF], before["model.layers.1.mlp.up_table.weight"].bfloat16())
    assert tensors(grouped)["model.stem_table_groups.1.weight"].dtype == torch.float32


def test_a_run_time_edit_of_grouped_tables_reads_what_a_layer_major_edit_reads(layer_major, grouped):
    tokenizer = AutoTokenizer.from_pretrained(layer_major)
    x = torch.tensor([[1, 5, 2, 5, 7]])
    results = []
    for path in (layer_major, grouped):
        model = load(path)
        plan = editing.plan_edit(tokenizer, model.config, ["w5=w9"])
        with torch.no_grad():
            plain = model(x).logits
            changes = editing.apply_edit(model, plan)
            results.append(model(x).logits)
            editing.revert_edit(model, changes)
            torch.testing.assert_close(model(x).logits, plain, rtol=0, atol=0)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    assert not torch.equal(results[0], plain)


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_memory_holds_grouped_tables_as_the_groups_parameters_and_host_as_host_tables(layer_major, grouped, tmp_path,
                                                                                     ids, host_on_cpu):
    with torch.no_grad():
        expected = load(layer_major, "memory")(ids).logits
        for placement in ("memory", "host"):
            model = load(grouped, placement)
            assert model.stem_tables == placement
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    # memory: the groups' parameters, named as stored, saved as they were read; a row written is the group's
    model = load(grouped, "memory")
    before = tensors(grouped)
    assert {n for n, _ in model.named_parameters() if "table" in n} == {n for n in before if "stem_table_groups" in n}
    model.set_stem_table_rows(1, torch.tensor([5]), torch.ones(1, D_FF))
    assert torch.equal(model.model.stem_table_groups[0].weight[5, D_FF:], torch.ones(D_FF))
    model.set_stem_table_rows(1, torch.tensor([5]), before["model.stem_table_groups.0.weight"][5:6, D_FF:])
    model.save_pretrained(tmp_path / "saved")
    saved = tensors(tmp_path / "saved")
    assert saved.keys() == before.keys() and all(torch.equal(saved[n], before[n]) for n in saved)
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["stem_table_groups"] == [[0, 1], [2]]
    model.resize_token_embeddings(VOCAB + 4, mean_resizing=False)  # a new table per layer: no group is left
    model.save_pretrained(tmp_path / "resized")
    resized = tensors(tmp_path / "resized")
    assert not any("stem_table_groups" in n for n in resized)
    assert torch.equal(resized["model.layers.2.mlp.up_table.weight"][:VOCAB], before["model.stem_table_groups.1.weight"])
    # host: a group's tensor read once; each layer's table a view of its columns, written through by an edit
    host = load(grouped, "host").stem_placement
    assert host.tables[0]["weight"].untyped_storage().data_ptr() == host.tables[1]["weight"].untyped_storage().data_ptr()
    host.set_rows(1, torch.tensor([5]), torch.ones(1, D_FF))
    assert torch.equal(host.read_rows(1, torch.tensor([5, 6]))[0], torch.ones(D_FF))
    assert torch.equal(host.read_rows(0, torch.tensor([5])), before["model.stem_table_groups.0.weight"][5:6, :D_FF])


@pytest.mark.parametrize("device_map", ["auto", "explicit"])
def test_grouped_tables_in_memory_offloaded_to_disk_by_a_device_map_give_the_logits_of_memory(grouped, tmp_path, ids,
                                                                                             device_map):
    """accelerate places a group's parameter as any module's, and brings it in from disk when a layer reads it."""
    if device_map == "auto":  # RAM for a third of the weights: the rest offloaded
        kwargs = {"device_map": "auto", "max_memory": {"cpu": 40_000}}
    else:
        kwargs = {"device_map": {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu",
                                 "model.rotary_emb": "cpu", "lm_head": "cpu", "model.stem_table_groups.0": "disk",
                                 "model.stem_table_groups.1": "cpu"}}
    offloaded = load(grouped, "memory", offload_folder=str(tmp_path / "offload"), **kwargs)
    assert "disk" in offloaded.hf_device_map.values()
    assert offloaded.model.stem_table_groups[0].weight.device.type == "meta"
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, load(grouped, "memory")(ids).logits, rtol=0, atol=0)


def test_a_model_built_from_a_grouped_config_has_the_groups_parameters_and_reads_no_file(grouped, monkeypatch):
    """As any model built from its config (from_config, the class, init_empty_weights for a device map): its tables
    are parameters to fill, train or save, and the checkpoint the config came from is not read."""
    from accelerate import init_empty_weights

    from stem_upcycle.modeling import table_files

    cls = type(load(grouped, "mmap"))
    monkeypatch.setattr(table_files, "read_header", lambda *a: pytest.fail("a model built from its config read a file"))
    config = AutoConfig.from_pretrained(grouped)
    config._name_or_path = "no/such-checkpoint"
    names = {"model.stem_table_groups.0.weight": (VOCAB, 2 * D_FF), "model.stem_table_groups.1.weight": (VOCAB, D_FF)}
    for build in (lambda: AutoModelForCausalLM.from_config(config), lambda: cls(config)):
        model = build()
        assert {n: tuple(p.shape) for n, p in model.named_parameters() if "table" in n} == names
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config)
    assert all(p.device.type == "meta" for n, p in empty.named_parameters() if "table" in n)


def test_a_persistent_edit_of_grouped_tables_writes_the_rows_a_layer_major_edit_writes_and_undoes_exactly(
        layer_major, grouped, tmp_path):
    rows = {}
    for path in (layer_major, grouped):
        out = tmp_path / f"edited-{path.name}"
        result = run("edit", path, "--swap", "w5=w9", "--output", out)
        assert result.exit_code == 0, result.output
        model = load(out)
        rows[path] = [model.stem_table_rows(layer, torch.arange(VOCAB)) for layer in (0, 1, 2)]
        assert not torch.equal(rows[path][1], load(path).stem_table_rows(1, torch.arange(VOCAB)))
        undone = tmp_path / f"undone-{path.name}"
        assert run("edit", out, "--undo", "--output", undone).exit_code == 0
        assert digest(undone) == digest(path)  # byte for byte
    for a, b in zip(rows[layer_major], rows[grouped]):
        assert torch.equal(a, b)


def test_compressing_grouped_tables_stores_a_tensor_per_table_and_bad_groupings_fail_in_one_line(grouped, tmp_path):
    from stem_upcycle.modeling.table_files import StemTablesError

    int8 = tmp_path / "int8"
    result = run("compress", grouped, int8, "--table-dtype", "int8", "--table-block", 16, "--quiet")
    assert result.exit_code == 0 and "2 groups of up to 2 layers side by side -> a tensor per table" in result.output
    config = json.loads((int8 / "config.json").read_text())
    assert not config.get("stem_table_groups") and config["stem_table_format"]["dtype"] == "int8"
    assert {n for n in tensors(int8) if "up_table" in n} == {
        f"model.layers.{i}.mlp.up_table.{p}" for i in (0, 1, 2) for p in ("qweight", "scales")}
    model = load(grouped)
    for call in (lambda: model.save_pretrained(tmp_path / "saved"), lambda: model.model.layers[1].mlp.up_table.weight):
        with pytest.raises(StemTablesError, match="load the model with stem_tables='memory'"):
            call()
    before, out = digest(grouped), tmp_path / "out"
    cases = [
        (["compress", grouped, out, "--layer-groups", 2, "--table-dtype", "int8", "--table-block", 16],
         "give a float --table-dtype"),
        (["compress", grouped, out, "--layer-groups", 2], "already float32, stored as 2 groups"),
        (["compress", grouped, out, "--layer-groups", 0], "0 is not in the range"),
    ]
    for args, message in cases:
        result = run(*args)
        assert result.exit_code != 0 and message in result.output, (args, result.output)
        assert "Traceback" not in result.output and not out.exists()
    assert digest(grouped) == before


def test_grouped_tables_load_through_remote_code_alone(layer_major, grouped, tmp_path, ids):
    with torch.no_grad():
        expected = load(layer_major, "memory")(ids).logits
    torch.save({"ids": ids, "logits": expected}, tmp_path / "data.pt")
    run_without_stem_upcycle("""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        path, data = sys.argv[1], torch.load(sys.argv[2])
        for kwargs in ({}, {"stem_tables": "mmap"}):
            model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kwargs).eval()
            assert type(model).__module__.startswith("transformers_modules") and model.stem_tables == "mmap"
            with torch.no_grad():
                torch.testing.assert_close(model(data["ids"]).logits, data["logits"], rtol=0, atol=0)
        memory = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, stem_tables="memory").eval()
        assert memory.stem_tables == "memory"
        with torch.no_grad():
            torch.testing.assert_close(memory(data["ids"]).logits, data["logits"], rtol=0, atol=0)
        # vLLM builds the model from its config under a meta-device context, then fills its parameters by name from
        # the files: in memory (the default) the groups' parameters, named as stored; with mmap, no table parameter
        import glob
        from safetensors.torch import load_file
        stored = {k: v for f in glob.glob(path + "/*.safetensors") for k, v in load_file(f).items()}
        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        for placement in (None, "memory", "mmap"):
            config.stem_tables = placement
            with torch.device("meta"):
                built = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
            assert built.stem_tables == (placement or "memory"), (placement, built.stem_tables)
            tables = {n for n in built.state_dict() if "table" in n}
            assert tables == (set() if placement == "mmap" else {n for n in stored if "stem_table_groups" in n}), tables
            built.load_state_dict({k: v for k, v in stored.items() if k in built.state_dict()}, strict=False, assign=True)
            assert torch.equal(built.stem_table_rows(1, torch.arange(16)), model.stem_table_rows(1, torch.arange(16)))
    """, grouped, tmp_path / "data.pt")


def test_a_grouping_that_disagrees_with_the_files_is_a_one_line_error_at_load(grouped, tmp_path):
    import shutil

    from stem_upcycle.modeling.table_files import StemTablesError

    cases = {
        "[[0, 1]]": "does not hold each STEM layer ([0, 1, 2]) once",
        "[[0, 1], [2], [1]]": "does not hold each STEM layer",
        "[[0], [1, 2]]": "has shape [96, 96], the config says [96, 48]",
    }
    for groups, message in cases.items():
        broken = tmp_path / "broken"
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(grouped, broken)
        config = json.loads((broken / "config.json").read_text())
        config["stem_table_groups"] = json.loads(groups)
        (broken / "config.json").write_text(json.dumps(config))
        with pytest.raises(StemTablesError, match=re.escape(message)) as err:
            load(broken)
        assert "\n" not in str(err.value)
    # a group's tensor missing from the files
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.stem_table_groups.1.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    config["stem_table_groups"] = [[0, 1], [2]]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(StemTablesError, match=r"has no tensor model.stem_table_groups.1.weight, where .* layers \[2\]"):
        load(broken)
