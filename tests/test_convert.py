"""`stem-upcycle convert` and `inspect`: sources, output layout, nothing lost on bad input."""

import json
import os
import shutil
from collections import namedtuple

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, MixtralConfig

import stem_upcycle  # noqa: F401
import stem_upcycle.convert as convert_module
from stem_upcycle.cli import main
from stem_upcycle.shards import INDEX_NAME

from .conftest import COMMON, VOCAB, save_tiny_tokenizer


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def convert(source, out, *args):
    """`convert` with the closed-form init unless args name one: what is tested here is the output, not the rows."""
    init = () if "--init" in args else ("--init", "closed-form")
    result = run_cli("convert", source, out, "--quiet", *init, *args)
    assert result.exit_code == 0, result.output
    return result


def state_dict_of(path):
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_output_layout_shards_and_index(dense_dir, tmp_path):
    _, src = dense_dir("llama")
    out = tmp_path / "out"
    convert(src, out, "--layers", "0,2", "--max-shard-size", "30KB", "--first-token", "table")
    index = json.loads((out / INDEX_NAME).read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and {p.name for p in shards} == set(index["weight_map"].values())
    total = 0
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
            assert all(index["weight_map"][k] == shard.name for k in f.keys())
        assert sum(sizes) <= 30_000 or len(sizes) == 1  # size-bounded; a larger tensor stands alone
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    names = set(index["weight_map"])
    assert {"model.layers.0.mlp.up_table.weight", "model.layers.2.mlp.up_table.weight"} <= names
    assert "model.layers.0.mlp.up_proj.weight" not in names and "model.layers.1.mlp.up_proj.weight" in names
    assert "lm_head.weight" not in names  # tied: stored once
    for name in ("config.json", "generation_config.json", "configuration_stem.py", "modeling_stem.py", "README.md"):
        assert (out / name).exists(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "stem" and config["stem_layers"] == [0, 2] and config["stem_init"] == "closed-form"
    assert config["stem_dense_first_token"] is False
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_stem.StemForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert not list(tmp_path.glob(".out.*")), "staging directory left behind"


def test_untied_head_is_kept(dense_dir, tmp_path):
    dense, src = dense_dir("phi3")
    convert(src, tmp_path / "out", "--layers", "1")
    names = json.loads((tmp_path / "out" / INDEX_NAME).read_text())["weight_map"]
    assert "lm_head.weight" in names and "model.layers.1.mlp.gate_up_proj.weight" not in names
    sd = state_dict_of(tmp_path / "out")
    torch.testing.assert_close(sd["model.layers.1.mlp.gate_proj.weight"], dense.model.layers[1].mlp.gate_up_proj.weight[:48])


def test_sharded_safetensors_bin_and_hub_cache_sources_give_identical_models(dense_dir, tmp_path, monkeypatch):
    dense, src = dense_dir("llama")
    convert(src, tmp_path / "from_single", "--layers", "1")
    reference = state_dict_of(tmp_path / "from_single")

    sharded = tmp_path / "sharded"
    dense.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    convert(sharded, tmp_path / "from_sharded", "--layers", "1")
    assert_same_weights(state_dict_of(tmp_path / "from_sharded"), reference)

    binary = tmp_path / "binary"
    binary.mkdir()
    dense.config.save_pretrained(binary)
    torch.save({k: v for k, v in dense.state_dict().items() if k != "lm_head.weight"}, binary / "pytorch_model.bin")
    convert(binary, tmp_path / "from_bin", "--layers", "1")
    assert_same_weights(state_dict_of(tmp_path / "from_bin"), reference)

    cache = tmp_path / "hub"
    snapshot = cache / "models--someorg--tiny-llama" / "snapshots" / ("a" * 40)
    snapshot.parent.mkdir(parents=True)
    (cache / "models--someorg--tiny-llama" / "refs").mkdir()
    (cache / "models--someorg--tiny-llama" / "refs" / "main").write_text("a" * 40)
    dense.save_pretrained(snapshot)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the cache only (downloads: test_hub_download)
    convert("someorg/tiny-llama", tmp_path / "from_hub", "--layers", "1")
    assert_same_weights(state_dict_of(tmp_path / "from_hub"), reference)


def test_tokenizer_chat_template_generation_config_and_card_are_carried(dense_dir, tmp_path):
    _, src = dense_dir("llama")
    tokenizer = save_tiny_tokenizer(src)
    (src / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")

    convert(src, tmp_path / "out", "--layers", "all")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded("w5 w7 w9")["input_ids"] == tokenizer("w5 w7 w9")["input_ids"]
    assert loaded.chat_template == tokenizer.chat_template
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == COMMON.get("eos_token_id", 2)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "license: mit" in card and "[0, 1, 2]" in card and "closed-form" in card
    assert "stem-upcycle convert" in card and "Converted, not trained." in card


def test_dry_run_prints_the_plan_and_writes_nothing(dense_dir, tmp_path):
    _, src = dense_dir("llama")
    result = convert(src, tmp_path / "out", "--dry-run", "--layers", "1/3")
    assert "1 of 3 layers: [0]" in result.output and "[96, 48]" in result.output and "peak RAM" in result.output
    assert not (tmp_path / "out").exists()


def test_non_empty_out_is_refused_then_replaced_with_overwrite(dense_dir, tmp_path):
    _, src = dense_dir("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("user data")
    result = run_cli("convert", src, out, "--quiet")
    assert result.exit_code == 1 and "not empty" in result.output and "--overwrite" in result.output
    assert (out / "precious.txt").read_text() == "user data"
    convert(src, out, "--overwrite")
    assert not (out / "precious.txt").exists() and (out / INDEX_NAME).exists()


def test_crash_mid_conversion_leaves_no_output_and_keeps_the_old_one(dense_dir, tmp_path, monkeypatch):
    _, src = dense_dir("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("user data")
    monkeypatch.setattr(convert_module, "CHUNK_BYTES", 16 * 48 * 4)  # 16 rows a chunk
    real = convert_module.INITIALISERS["closed-form"].table_rows
    calls = []

    def failing_table_rows(self, layer):
        fill = real(self, layer)

        def fill_then_fail(start, stop, out_):
            calls.append(start)
            if len(calls) == 3:
                raise RuntimeError("simulated crash")
            fill(start, stop, out_)

        return fill_then_fail

    monkeypatch.setattr(convert_module.INITIALISERS["closed-form"], "table_rows", failing_table_rows)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_cli("convert", src, out, "--overwrite", "--quiet", "--init", "closed-form")
    assert (out / "precious.txt").read_text() == "user data" and len(list(out.iterdir())) == 1
    calls.clear()
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_cli("convert", src, tmp_path / "fresh", "--quiet", "--init", "closed-form")
    assert not (tmp_path / "fresh").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging directory left behind"


def test_staging_left_by_a_killed_run_is_removed_and_a_running_ones_kept(dense_dir, tmp_path):
    _, src = dense_dir("llama")
    killed, running = tmp_path / ".out.partial-999999999", tmp_path / f".out.partial-{os.getppid()}"
    for staging in (killed, running):
        staging.mkdir()
        (staging / "model-00001-of-00002.safetensors").write_bytes(b"half written")
    other = tmp_path / ".other.partial-999999999"  # another output's: not this conversion's to touch
    other.mkdir()
    convert(src, tmp_path / "out")
    assert not killed.exists() and running.exists() and other.exists()
    assert (tmp_path / "out" / "config.json").exists()


def test_too_little_disk_space_fails_with_the_numbers(dense_dir, tmp_path, monkeypatch):
    _, src = dense_dir("llama")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(convert_module.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 1
    assert "not enough disk space" in result.output and "0.00 GB are free" in result.output and "needs" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layers, message", [
    ("3", "layer 3 does not exist; valid layers are 0-2"),
    ("5/3", "a fraction must lie in (0, 1]"),
    ("one", "is not understood"),
])
def test_bad_layers_name_the_valid_range(dense_dir, tmp_path, layers, message):
    _, src = dense_dir("llama")
    result = run_cli("convert", src, tmp_path / "out", "--layers", layers)
    assert result.exit_code == 1 and message in result.output
    assert len(result.output.strip().splitlines()) == 1  # one line, no traceback


def test_unsupported_architectures_name_the_supported_families(tmp_path):
    small = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB)
    GPT2LMHeadModel(GPT2Config(**small)).save_pretrained(tmp_path / "gpt2")
    result = run_cli("convert", tmp_path / "gpt2", tmp_path / "out")
    assert result.exit_code == 1 and "'gpt2' is not supported" in result.output and "llama" in result.output
    mixtral = MixtralConfig(**{**COMMON, "num_local_experts": 2})
    AutoModelForCausalLM.from_config(mixtral).save_pretrained(tmp_path / "mixtral")
    result = run_cli("convert", tmp_path / "mixtral", tmp_path / "out")
    assert result.exit_code == 1 and "'mixtral' is not supported" in result.output and "no experts" in result.output
    assert not (tmp_path / "out").exists()


def test_converting_a_stem_model_again_is_refused(dense_dir, tmp_path):
    _, src = dense_dir("llama")
    convert(src, tmp_path / "stem")
    result = run_cli("convert", tmp_path / "stem", tmp_path / "again")
    assert result.exit_code == 1 and "already a STEM model" in result.output


def test_source_as_output_is_refused(dense_dir):
    _, src = dense_dir("llama")
    result = run_cli("convert", src, src, "--overwrite")
    assert result.exit_code == 1 and "is the source checkpoint" in result.output
    assert (src / "model.safetensors").exists()


@pytest.mark.parametrize("first_token", ["table", "dense"])
def test_inspect_reports_parameters_and_ffn_flops(dense_dir, tmp_path, first_token):
    _, src = dense_dir("llama")
    convert(src, tmp_path / "stem", "--layers", "0,2", "--first-token", first_token)
    dense = json.loads(run_cli("inspect", src, "--json").output)
    stem = json.loads(run_cli("inspect", tmp_path / "stem", "--json").output)
    V, d, f, L = VOCAB, 32, 48, 3
    kept = 2 * d * f if first_token == "dense" else 0  # W_up of the STEM layers, read for a first token only
    assert dense["is_stem"] is False and stem["is_stem"] is True and stem["stem_layers"] == [0, 2]
    assert stem["params_total"] == dense["params_total"] - 2 * d * f + kept + 2 * V * f
    assert stem["params_active_per_token"] == stem["params_total"] - 2 * (V - 1) * f - (V - 1) * d + V * d - kept
    assert dense["ffn_flops_per_token"] == 6 * d * f * L
    assert stem["ffn_flops_per_token"] == 6 * d * f * L - 2 * 2 * d * f
    assert stem["bytes_on_disk"] == sum(p.stat().st_size for p in (tmp_path / "stem").glob("*.safetensors"))
    text = run_cli("inspect", tmp_path / "stem").output
    assert "STEM (2 of 3 layers)" in text and "0.78x" in text
    tables, dense_bytes = 2 * V * f * 4, (stem["params_total"] - 2 * V * f) * 4  # fp32
    assert stem["placements"]["memory"] == {"device": dense_bytes + tables, "host": 0}
    assert stem["placements"]["mmap"] == {"device": dense_bytes, "host": 0}
    assert stem["placements"]["host"] == {"device": dense_bytes + 2048 * 2 * f * 4, "host": tables}
    assert "memory by placement" in text and "mmap" in text and dense["placements"] == {}


def test_quantized_checkpoints_are_refused_not_cast(dense_dir, tmp_path):
    """Casting FP8 weights and dropping their scales would write a silently wrong model."""
    from safetensors.torch import load_file, save_file

    _, src = dense_dir("llama")
    weights = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    cases = {
        "config": ({**config, "quantization_config": {"quant_method": "awq", "bits": 4}},  # packed: 8 per int32
                   {**weights, "model.layers.0.mlp.up_proj.weight": torch.zeros(48, 4, dtype=torch.float32)},
                   "quantization_config awq"),
        "scales": (config, {**weights, "model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(1)},
                   "tensor model.layers.0.mlp.up_proj.weight_scale_inv"),
        "float8": (config, {**weights, "model.layers.0.mlp.up_proj.weight":
                            weights["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)},
                   "model.layers.0.mlp.up_proj.weight in torch.float8_e4m3fn"),
    }
    for name, (cfg, tensors, found) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
        save_file(tensors, folder / "model.safetensors")
        result = run_cli("convert", folder, tmp_path / f"out-{name}")
        assert result.exit_code == 1 and f"is a quantized checkpoint ({found}" in result.output, result.output
        assert "give the bf16/fp16/fp32 original" in result.output and "Traceback" not in result.output
        assert not (tmp_path / f"out-{name}").exists()


def test_a_quantization_label_over_plain_float_weights_converts_them(dense_dir, tmp_path):
    """Transformers dequantises a GGUF file on load; saved again, its folder keeps the gguf label."""
    dense, src = dense_dir("llama")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"dequantize": False, "gguf_file": "model.Q4_1.gguf", "quant_method": "gguf"}
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("convert", src, tmp_path / "out", "--layers", "0", "--init", "closed-form")
    assert result.exit_code == 0, result.output
    assert "quantization_config gguf, and its weights are plain torch.float32" in result.output
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in out and out["stem_layers"] == [0]
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out", stem_tables="memory")
    assert torch.equal(converted.model.layers[1].mlp.up_proj.weight, dense.model.layers[1].mlp.up_proj.weight)


def test_model_card_names_a_hub_base_model_never_a_path(dense_dir, tmp_path):
    from huggingface_hub import ModelCard

    _, src = dense_dir("llama")
    convert(src, tmp_path / "local", "--layers", "1")
    card = ModelCard.load(tmp_path / "local" / "README.md")
    assert card.data.base_model is None and card.data.library_name == "transformers"
    assert "stem" in card.data.tags and str(src) in card.text  # the path is named in the text, not the metadata
    snapshot = tmp_path / "hub" / "models--some-org--tiny.llama" / "snapshots" / "0123abc"
    shutil.copytree(src, snapshot)  # a model in the Hugging Face cache's layout
    convert(snapshot, tmp_path / "cached", "--layers", "1")
    assert ModelCard.load(tmp_path / "cached" / "README.md").data.base_model == "some-org/tiny.llama"
