"""Compressed tables (int8, float8, int4 with per-block scales): the codec, `convert --table-dtype`,
`compress`, every placement, edits and undo, inspection, and the errors."""

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from stem_upcycle import editing
from stem_upcycle.cli import main
from stem_upcycle.modeling.table_format import COMPRESSED, TableFormat, TableFormatError

from .conftest import VOCAB, export_stem, run_without_stem_upcycle, save_tiny_tokenizer, tiny_stem

BLOCK = 16  # the tiny models' rows have 48 elements
# Relative L2 error of a row of normal values, at most (measured: int8 0.6-0.85%, float8 ~2.4%, int4 8-12%).
ROW_ERROR = {"int8": 0.012, "float8": 0.035, "int4": 0.14}


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result


def load(path, placement="memory", **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, stem_tables=placement, **kwargs).eval()


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def float_dir(tmp_path):
    """A tiny float32 STEM model (layers 0 and 2, first tokens read rows) in several shards, with a tokenizer."""
    path = export_stem(tiny_stem("llama", layers=(0, 2), dense_first_token=False), tmp_path / "float")
    save_tiny_tokenizer(path)
    return path


@pytest.fixture
def compressed(float_dir, tmp_path):
    """Factory: float_dir's tables compressed to `dtype` by the CLI; the new folder."""

    def make(dtype):
        out = tmp_path / dtype
        result = run("compress", float_dir, out, "--table-dtype", dtype, "--table-block", BLOCK, "--quiet",
                     "--max-shard-size", "40KB")
        assert result.exit_code == 0, result.output
        return out

    return make


# --- the codec -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", COMPRESSED)
def test_codec_rows_decode_within_their_bound_and_zero_rows_stay_zero(dtype):
    torch.manual_seed(0)
    rows = torch.randn(64, 256) * torch.rand(64, 1) * 5
    rows[7] = 0
    table_format = TableFormat.of(dtype, d_ff=256)
    parts = table_format.encode(rows)
    assert {k: (v.shape, v.dtype) for k, v in parts.items()} == {
        k: ((64, n), dtype) for k, (n, dtype) in table_format.parts(256).items()}
    decoded = table_format.decode(parts, torch.float32)
    errors = (decoded - rows).norm(dim=1) / rows.norm(dim=1).clamp(min=1e-12)
    assert float(errors.max()) < ROW_ERROR[dtype] and float(errors[torch.arange(64) != 7].min()) > 0
    assert torch.equal(decoded[7], torch.zeros(256))
    # one row decodes alone from its own bytes, as the placements read rows
    single = table_format.decode({k: v[3:4] for k, v in parts.items()}, torch.float32)
    assert torch.equal(single[0], decoded[3])


def test_codec_bytes_per_row_meet_the_targets_against_bfloat16():
    d_ff = 8192  # Llama-3.2-1B's rows
    bf16 = TableFormat.of("bfloat16").row_bytes(d_ff)
    ratios = {dtype: TableFormat.of(dtype, d_ff=d_ff).row_bytes(d_ff) / bf16 for dtype in COMPRESSED}
    assert ratios == {"int8": (8192 + 2 * 64) / 16384, "float8": (8192 + 2 * 64) / 16384,
                      "int4": (4096 + 2 * 128) / 16384}
    assert ratios["int8"] <= 0.51 and ratios["float8"] <= 0.51 and ratios["int4"] <= 0.28


def test_int4_packs_two_signed_values_a_byte_even_element_low():
    table_format = TableFormat.of("int4", 4)
    rows = torch.tensor([[-7.0, 7.0, 0.0, -1.0]])  # one block, largest magnitude 7: scale 1 unclipped
    parts = table_format.encode(rows)
    assert parts["scales"].tolist() == [[1.0]]
    assert parts["qweight"].tolist() == [[0x79, 0xF0]]  # (-7 & 0xF) | 7 << 4, 0 | (-1 & 0xF) << 4
    assert table_format.decode(parts, torch.float32).tolist() == rows.tolist()


def test_codec_errors_name_the_problem():
    with pytest.raises(TableFormatError, match="unknown; choose one of"):
        TableFormat.of("int3")
    with pytest.raises(TableFormatError, match="do not split into blocks of 128; give a block size that divides 48"):
        TableFormat.of("int8", d_ff=48)
    with pytest.raises(TableFormatError, match="even number"):
        TableFormat.of("int4", 7)
    with pytest.raises(TableFormatError, match="beyond float16 scales"):
        TableFormat.of("int8", 2).encode(torch.tensor([[1e9, 0.0]]))


# --- convert and compress --------------------------------------------------------------------------


# host: ids fit its device cache (read from the cache; every decode step) or do not (rows staged for the forward)
PLACEMENTS = {"memory": {}, "mmap": {}, "host, staged": {"stem_cache_rows": 8}, "host, cached": {"stem_cache_rows": VOCAB}}


@pytest.mark.parametrize("dtype", ["float32", *COMPRESSED])
def test_every_placement_with_every_table_format_gives_the_logits_of_memory(float_dir, compressed, dtype, ids,
                                                                           host_on_cpu):
    """Each placement and path, twice (the second time from the host cache where it holds the rows), then a
    decode step of one token per sequence, which the cache always holds."""
    folder = float_dir if dtype == "float32" else compressed(dtype)
    step = ids[:, -1:]
    with torch.no_grad():
        memory = load(folder)
        expected = memory(ids).logits, memory(step).logits
        for placement, kwargs in PLACEMENTS.items():
            model = load(folder, placement.split(",")[0], **kwargs)
            for _ in range(2):
                torch.testing.assert_close(model(ids).logits, expected[0], rtol=0, atol=1e-6, msg=placement)
            torch.testing.assert_close(model(step).logits, expected[1], rtol=0, atol=1e-6, msg=placement)
            if placement.startswith("host"):
                cached = model.stem_placement.stats["hits"] > 0
                assert cached == (placement == "host, cached"), model.stem_placement.stats


@pytest.mark.parametrize("dtype", COMPRESSED)
def test_compressed_tables_decode_within_their_bound_of_the_float_rows(float_dir, compressed, dtype, ids):
    out = compressed(dtype)
    config = json.loads((out / "config.json").read_text())
    assert config["stem_table_format"] == {"dtype": dtype, "block_size": BLOCK}
    reference = load(float_dir)
    with torch.no_grad():
        expected = reference(ids).logits
        got = {"memory": load(out)(ids).logits}
    # rows decoded from the files are the float rows within the codec's bound, and so are the logits
    table_format = TableFormat.of(dtype, BLOCK)
    float_rows = reference.model.layers[0].mlp.up_table.weight.detach()
    model = load(out, "mmap")
    rows = model.stem_table_rows(0, torch.arange(VOCAB))
    assert torch.equal(rows, table_format.decode(table_format.encode(float_rows), torch.float32))
    assert float((got["memory"] - expected).abs().max()) < {"int8": 2e-3, "float8": 1e-2, "int4": 5e-2}[dtype]
    assert not any("up_table" in name for name in model.state_dict())  # no table became a parameter


def test_convert_writes_compressed_tables_and_compress_can_decompress_them(dense_dir, tmp_path, ids):
    _, dense = dense_dir("llama")
    stored = tmp_path / "int8"
    result = run("convert", dense, stored, "--layers", "0,2", "--table-dtype", "int8", "--table-block", BLOCK,
                 "--init", "closed-form", "--quiet")
    assert result.exit_code == 0, result.output
    assert "int8 with a float16 scale per 16 elements" in result.output
    plain = tmp_path / "plain"
    assert run("convert", dense, plain, "--layers", "0,2", "--init", "closed-form", "--quiet").exit_code == 0
    index = json.loads((stored / "model.safetensors.index.json").read_text())["weight_map"]
    names = {n for n in index if "up_table" in n}
    assert names == {f"model.layers.{i}.mlp.up_table.{p}" for i in (0, 2) for p in ("qweight", "scales")}
    with safe_open(stored / index["model.layers.0.mlp.up_table.qweight"], "pt") as f:
        assert f.get_slice("model.layers.0.mlp.up_table.qweight").get_dtype() == "I8"
    assert "int8 with a float16 scale per 16 elements" in (stored / "README.md").read_text()
    # converting to int8 stores what compressing the float conversion stores
    again = tmp_path / "again"
    assert run("compress", plain, again, "--table-dtype", "int8", "--table-block", BLOCK, "--quiet").exit_code == 0
    with torch.no_grad():
        torch.testing.assert_close(load(stored, "mmap")(ids).logits, load(again, "mmap")(ids).logits, rtol=0, atol=0)
    # decompressed: float tables again (parameters in memory), holding the decoded rows exactly
    back = tmp_path / "back"
    result = run("compress", stored, back, "--table-dtype", "float32", "--quiet")
    assert result.exit_code == 0, result.output
    assert "stem_table_format" not in json.loads((back / "config.json").read_text())
    model = load(back)
    assert model.stem_tables == "memory" and any("up_table.weight" in n for n in model.state_dict())
    assert torch.equal(model.stem_table_rows(2, torch.arange(VOCAB)), load(stored, "mmap").stem_table_rows(2, torch.arange(VOCAB)))


def test_compress_dry_run_prints_the_bytes_of_the_default_int4_and_writes_nothing(float_dir, tmp_path):
    out = tmp_path / "dry"
    result = run("compress", float_dir, out, "--table-block", BLOCK, "--dry-run")  # int4: the default
    assert result.exit_code == 0, result.output
    assert "float32 -> int4 with a float16 scale per 16 elements" in result.output
    table_bytes = 2 * VOCAB * 48 * 4
    int4_bytes = 2 * VOCAB * (24 + 2 * 3)
    assert f"{table_bytes / 1e6:.3f} MB -> {int4_bytes / 1e6:.3f} MB ({int4_bytes / table_bytes:.3f}x)" in result.output
    assert "dry run: nothing written" in result.output and not out.exists()


def test_compress_is_atomic_and_its_errors_are_one_line(float_dir, dense_dir, tmp_path, monkeypatch, compressed):
    _, dense = dense_dir("llama")
    int8 = compressed("int8")
    out = tmp_path / "out"
    cases = [
        (["compress", dense, out, "--table-dtype", "int8"], "is not a STEM model; convert it first"),
        (["compress", float_dir, out, "--table-dtype", "int8"], "do not split into blocks of 128; give a block size"),
        (["compress", int8, out, "--table-dtype", "int8", "--table-block", BLOCK], "already int8"),
        (["compress", float_dir, float_dir, "--table-dtype", "int8", "--table-block", BLOCK], "not empty"),
        (["compress", float_dir, out, "--table-dtype", "int3"], "'int3' is not one of"),
    ]
    for args, message in cases:
        result = run(*args)
        assert result.exit_code != 0 and message in result.output, (args, result.output)
        assert "Traceback" not in result.output and not out.exists()
    # an edited model: its undo records hold rows in the current format
    edited = tmp_path / "edited"
    assert run("edit", float_dir, "--swap", "w5=w9", "--output", edited).exit_code == 0
    result = run("compress", edited, out, "--table-dtype", "int8", "--table-block", BLOCK)
    assert result.exit_code == 1 and "undo them first" in result.output and not out.exists()
    # a failure while writing leaves nothing at OUT, and the source as it was
    before = digest(float_dir)
    from stem_upcycle.modeling import table_format

    monkeypatch.setattr(table_format.TableFormat, "encode", lambda self, rows: (_ for _ in ()).throw(OSError("disk")))
    result = run("compress", float_dir, out, "--table-dtype", "int8", "--table-block", BLOCK, "--quiet")
    assert result.exit_code != 0 and not out.exists() and digest(float_dir) == before
    assert not list(tmp_path.glob(".out.partial-*"))


# --- edits, inspection, training -------------------------------------------------------------------


def test_a_persistent_edit_moves_compressed_rows_with_their_scales_and_undo_restores_every_byte(compressed, tmp_path):
    out = compressed("int4")
    before = digest(out)
    edited = tmp_path / "edited"
    result = run("edit", out, "--swap", "w5=w9", "--output", edited)
    assert result.exit_code == 0, result.output
    source, target = load(out, "mmap"), load(edited, "mmap")
    for layer in (0, 2):
        moved = target.stem_table_parts(layer, torch.tensor([5]))
        original = source.stem_table_parts(layer, torch.tensor([9]))
        assert set(moved) == {"qweight", "scales"}
        assert all(torch.equal(moved[p], original[p]) for p in moved)  # the row and its scales, bit for bit
    # the live edit of a loaded compressed model (every placement) reads what the written model holds
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([[1, 5, 2, 5]])
    with torch.no_grad():
        expected = target(ids).logits
        for placement in ("memory", "mmap"):
            model = load(out, placement)
            plan = editing.plan_edit(tokenizer, model.config, ["w5=w9"])
            changes = editing.apply_edit(model, plan)
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
            editing.revert_edit(model, changes)
            torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=0, atol=0)
    # an average of rows is stored as the table stores rows: re-encoded
    result = run("edit", edited, "--swap", "w7=w8 w9", "--mode", "average", "--output", tmp_path / "twice")
    assert result.exit_code == 0, result.output
    assert run("edit", tmp_path / "twice", "--undo").exit_code == 0
    assert digest(tmp_path / "twice") == before


def test_inspect_reads_compressed_tables(compressed):
    out = compressed("int8")
    result = run("inspect", out)
    assert result.exit_code == 0 and "tables           int8 with a float16 scale per 16 elements" in result.output
    result = run("inspect", out, "--tables", "--sample", "32")
    assert result.exit_code == 0, result.output
    result = run("inspect", out, "--nearest", "w5", "--layer", "0")
    assert result.exit_code == 0 and "w5" in result.output, result.output


def test_training_and_resizing_refuse_compressed_tables_with_how_to_decompress(compressed, tmp_path):
    out = compressed("int8")
    model = load(out, "memory")
    assert model.stem_tables == "memory"
    for call in (lambda: model.resize_token_embeddings(VOCAB + 4), lambda: model.save_pretrained(tmp_path / "s"),
                 lambda: model.model.layers[0].mlp.up_table.weight):
        with pytest.raises(Exception, match="stored as int8: decompress them") as err:
            call()
        assert "\n" not in str(err.value)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  source: {out}\n  init_from: {out}\ndata:\n  train: [{out / 'config.json'}]\n")
    result = run("train", recipe, "--output", tmp_path / "t")
    assert result.exit_code == 1 and "--table-dtype float32`), train OUT" in result.output, result.output


def test_compressed_model_loads_through_remote_code_alone(compressed, tmp_path, ids):
    out = compressed("float8")
    with torch.no_grad():
        expected = load(out, "memory")(ids).logits
    torch.save({"ids": ids, "logits": expected}, tmp_path / "data.pt")
    run_without_stem_upcycle("""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        path, data = sys.argv[1], torch.load(sys.argv[2])
        for placement in (None, "memory", "mmap"):
            kwargs = {} if placement is None else {"stem_tables": placement}
            model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kwargs).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            assert model.stem_tables == (placement or "mmap")
            with torch.no_grad():
                torch.testing.assert_close(model(data["ids"]).logits, data["logits"], rtol=0, atol=1e-6)
        out = model.generate(data["ids"][:1], max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert out.shape == (1, data["ids"].shape[1] + 5)
        # vLLM builds the model from its config under a meta-device context; the rows still come from the files
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, trust_remote_code=True),
                                                     trust_remote_code=True)
        assert torch.equal(built.stem_table_rows(0, torch.arange(16)), model.stem_table_rows(0, torch.arange(16)))
    """, out, tmp_path / "data.pt")
