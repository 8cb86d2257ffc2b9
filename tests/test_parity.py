"""The closed-form init is exact where the math says it must be.

With layer 0's attention output zeroed (o_proj = 0), layer 0's MLP input is exactly
norm_0(scale * E[v]), so converting layer 0 alone must reproduce the dense logits, in every family.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import stem_upcycle  # noqa: F401  (registers the STEM classes)
from stem_upcycle.convert import plan_conversion, run_conversion
from stem_upcycle.source import open_source

from .conftest import FAMILY_CONFIGS


def _convert(path, out, layers, **kwargs):
    plan = plan_conversion(open_source(str(path)), layers=layers, **kwargs)
    run_conversion(plan, out, progress=False)
    return AutoModelForCausalLM.from_pretrained(out, dtype="auto", stem_tables="memory").eval()


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_layer0_closed_form_reproduces_dense_logits(model_type, dense_dir, tmp_path, ids):
    dense, path = dense_dir(model_type)
    with torch.no_grad():
        dense.model.layers[0].self_attn.o_proj.weight.zero_()
        if dense.model.layers[0].self_attn.o_proj.bias is not None:
            dense.model.layers[0].self_attn.o_proj.bias.zero_()
    dense.save_pretrained(path)
    stem = _convert(path, tmp_path / "stem", "0", dtype="float32")
    assert type(stem).__name__ == "Stem" + type(dense).__name__
    assert stem.config.stem_layers == [0]
    with torch.no_grad():
        torch.testing.assert_close(stem(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("first_token", ["dense", "table"])
def test_other_layers_stay_dense_and_converted_layers_change_output(dense_dir, tmp_path, ids, first_token):
    dense, path = dense_dir("llama")
    stem = _convert(path, tmp_path / "stem", "1", dtype="float32", first_token=first_token)
    dense_sd, stem_sd = dense.state_dict(), stem.state_dict()
    for name, tensor in stem_sd.items():
        if "up_table" not in name:
            torch.testing.assert_close(tensor, dense_sd[name], rtol=0, atol=0)
    assert ("model.layers.1.mlp.up_proj.weight" in stem_sd) == (first_token == "dense")
    assert "model.layers.0.mlp.up_proj.weight" in stem_sd
    with torch.no_grad():  # layer 1 sees attention output, so the closed form is not exact there
        assert not torch.allclose(stem(ids).logits, dense(ids).logits, atol=1e-3)


def test_bf16_tables_match_fp32_tables_to_bf16_precision(dense_dir, tmp_path):
    _, path = dense_dir("llama")
    fp32 = _convert(path, tmp_path / "fp32", "all", dtype="float32")
    bf16 = _convert(path, tmp_path / "bf16", "all", dtype="bfloat16")
    for i in range(3):
        table16 = bf16.model.layers[i].mlp.up_table.weight
        assert table16.dtype == torch.bfloat16
        torch.testing.assert_close(table16.float(), fp32.model.layers[i].mlp.up_table.weight, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_a_dense_first_token_computes_the_first_position_as_the_dense_model(model_type, dense_dir, tmp_path, ids):
    """A sequence's first token attends to itself alone: with its up-projection kept in every STEM layer
    (`first_token="dense"`), its whole computation is the dense model's whatever the rows, at position 0
    or after a left padding; with its row there (`"table"`) it is not."""
    dense, path = dense_dir(model_type)
    stem = _convert(path, tmp_path / "stem", "all", dtype="float32")
    table = _convert(path, tmp_path / "table", "all", dtype="float32", first_token="table")
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0 left-padded: its first token is at position 3
    with torch.no_grad():
        expected = dense(ids, attention_mask=mask).logits
        got = stem(ids, attention_mask=mask).logits
        torch.testing.assert_close(got[0, 3], expected[0, 3], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1, 0], expected[1, 0], rtol=1e-5, atol=1e-5)
        off_first = (got[1, 0] - expected[1, 0]).abs().max()
        assert (got[1, 1:] - expected[1, 1:]).abs().max() > 10 * off_first  # later tokens read their rows
        assert (table(ids, attention_mask=mask).logits[1, 0] - expected[1, 0]).abs().max() > 10 * off_first
