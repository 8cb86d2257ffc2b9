"""The STEM model in Transformers: generation, padding, errors, training, save/load, auto classes."""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from stem_upcycle import StemConfig

from .conftest import VOCAB, tiny_stem


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi3"])
def test_cached_greedy_generation_agrees_with_one_uncached_forward(model_type, ids):
    model = tiny_stem(model_type)
    prompt = ids[:1, :5]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                         pad_token_id=0)
    with torch.no_grad():
        greedy = model(out, use_cache=False).logits[0, prompt.shape[1] - 1 : -1].argmax(-1)
    assert torch.equal(greedy, out[0, prompt.shape[1] :])


def test_left_padded_batch_matches_unpadded_sequences(ids):
    model = tiny_stem()
    short, long = ids[0, :6], ids[1, :9]
    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0, 3:], batch[1] = short, long
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
        torch.testing.assert_close(padded[0, 3:], model(short[None]).logits[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(padded[1], model(long[None]).logits[0], rtol=1e-4, atol=1e-5)
    generated = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    alone = model.generate(short[None], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(generated[0, 9:], alone[0, 6:])


def test_a_first_token_in_a_later_forward_of_a_chunked_prefill_keeps_its_dense_up_projection(ids):
    """A row padded past the first chunk of a prefill has its first token in a later forward (past > 0): it is
    found there (on the CPU, where the mask is), so the chunked prefill equals one forward."""
    from transformers import DynamicCache

    model = tiny_stem()
    batch = ids[:, :9].clone()
    mask = torch.ones_like(batch)
    mask[0, :5] = 0  # row 0's first token is at position 5, in the second chunk
    with torch.no_grad():
        whole = model(batch, attention_mask=mask).logits
        cache = DynamicCache()
        first = model(batch[:, :4], attention_mask=mask[:, :4], past_key_values=cache, use_cache=True).logits
        second = model(batch[:, 4:], attention_mask=mask, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat([first, second], 1)[mask.bool()], whole[mask.bool()], rtol=1e-4, atol=1e-5)


def test_inputs_embeds_without_ids_is_a_clear_error(ids):
    model = tiny_stem()
    with pytest.raises(ValueError, match="pass input_ids"):
        model(inputs_embeds=model.get_input_embeddings()(ids))


@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_ids_outside_the_table_are_a_clear_error(bad, ids):
    model = tiny_stem()
    ids = ids.clone()
    ids[0, 3] = bad
    with pytest.raises(ValueError, match=rf"input_ids must lie in \[0, {VOCAB - 1}\]"):
        model(ids)


def test_backward_reaches_only_the_table_rows_of_seen_tokens(ids):
    model = tiny_stem().train()
    model(ids, labels=ids).loss.backward()
    grad = model.model.layers[0].mlp.up_table.weight.grad
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    # The last position predicts nothing that has a label; the first reads the dense up-projection, no row.
    seen[ids[:, 1:-1].unique()] = True
    assert grad[seen].abs().sum(-1).gt(0).all()
    assert grad[~seen].eq(0).all()
    assert model.model.layers[0].mlp.gate_proj.weight.grad.abs().sum() > 0
    assert model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(ids):
    plain, checkpointed = tiny_stem().train(), tiny_stem().train()
    # Transformers 5.24 renamed the method; the old name still works, with a warning.
    enable = getattr(checkpointed, "activation_checkpointing_enable", None) or checkpointed.gradient_checkpointing_enable
    enable()
    assert checkpointed.model.layers[0].gradient_checkpointing
    for m in (plain, checkpointed):
        m.config.use_cache = False
        m(ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_save_then_load_is_exact(tmp_path, ids):
    model = tiny_stem("qwen3")
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", stem_tables="memory").eval()
    assert type(loaded) is type(model)
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2
        assert torch.equal(a, b), k
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_auto_model_gives_the_stem_base_model(tmp_path, ids):
    model = tiny_stem()
    model.save_pretrained(tmp_path / "m")
    base = AutoModel.from_pretrained(tmp_path / "m").eval()
    assert type(base).__name__ == "StemLlamaModel"
    assert base.layers[2].mlp.__class__.__name__ == "StemMLP"
    with torch.no_grad():
        torch.testing.assert_close(
            base(ids).last_hidden_state, model(ids, output_hidden_states=True).hidden_states[-1]
        )


def test_config_round_trips_and_keeps_dense_fields(tmp_path):
    model = tiny_stem("gemma2")
    model.config.save_pretrained(tmp_path)
    config = StemConfig.from_pretrained(tmp_path)
    assert config.model_type == "stem" and config.dense_model_type == "gemma2"
    assert config.stem_layers == [0, 2] and config.stem_activation == "gelu_pytorch_tanh"
    assert config.layer_types == model.config.layer_types


def test_resizing_the_vocabulary_grows_the_tables_with_fitted_rows(tmp_path, ids):
    """New tokens get rows from the ridge fit of rows on embeddings: exact where the table is linear in E."""
    model = tiny_stem()
    d_ff = model.config.intermediate_size
    embedding = model.get_input_embeddings().weight.detach()
    torch.manual_seed(5)
    a, b = 50 * torch.randn(embedding.shape[1], d_ff), torch.randn(d_ff)  # E is ~N(0, 0.02): make E @ a count
    with torch.no_grad():
        for i in model.config.stem_layers:
            model.model.layers[i].mlp.up_table.weight.copy_(embedding @ a + b)
        before = model(ids).logits
    model.resize_token_embeddings(VOCAB + 4, mean_resizing=False)
    assert model.config.vocab_size == VOCAB + 4
    new_embedding = model.get_input_embeddings().weight.detach()
    for i in model.config.stem_layers:
        table = model.model.layers[i].mlp.up_table.weight
        assert table.shape == (VOCAB + 4, d_ff)
        truth = new_embedding[VOCAB:] @ a + b
        error = (table[VOCAB:] - truth).norm() / truth.norm()  # the ridge shrinks the fit a little
        assert error < 0.05 and error < 0.1 * (table[:VOCAB].mean(0) - truth).norm() / truth.norm()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :VOCAB], before)  # old tokens: unchanged
        assert model(torch.tensor([[VOCAB + 3, 1]])).logits.isfinite().all()  # new ids look up rows
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_first_tokens_of_a_packed_row_are_where_the_positions_restart():
    """vLLM packs a batch's sequences into one row [1, tokens], each numbered from 0, with no mask."""
    from stem_upcycle.modeling.forward_ids import first_tokens

    ids = torch.arange(6)[None]
    rows, starts = first_tokens(ids, {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}, past=0)
    assert rows.tolist() == [0, 0, 0] and starts.tolist() == [0, 3, 5]
    assert first_tokens(ids, {"position_ids": torch.tensor([[7, 8, 9, 10, 11, 12]])}, past=0) is None  # decode steps
    rows, starts = first_tokens(ids, {}, past=0)  # no positions: position 0
    assert rows.tolist() == [0] and starts.tolist() == [0]


def test_the_base_model_works_when_its_forward_is_called_directly(tmp_path, ids):
    """As vLLM calls it: `forward`, not `__call__`, so no forward hook runs. Its rows are those of its own ids, not
    of the forward before: compared with the causal LM, whose base model is handed its ids by hooks."""
    model = tiny_stem()
    model.save_pretrained(tmp_path / "m")
    base = AutoModel.from_pretrained(tmp_path / "m").eval()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        base.forward(input_ids=ids.flip(1), position_ids=positions, use_cache=False)  # other ids, just before
        torch.testing.assert_close(base.forward(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state,
                                   model(ids, output_hidden_states=True).hidden_states[-1], rtol=0, atol=0)


def test_a_model_built_from_its_config_reads_the_tables_the_config_asks_for(tmp_path, ids, monkeypatch):
    """vLLM builds models with from_config; `hf_overrides={"stem_tables": "mmap"}` keeps the tables in their files."""
    import huggingface_hub.constants
    from transformers import AutoConfig

    from stem_upcycle.modeling.table_files import StemTablesError

    model = tiny_stem()
    model.save_pretrained(tmp_path / "m")
    built = AutoModel.from_config(AutoConfig.from_pretrained(tmp_path / "m", stem_tables="mmap"))
    assert built.stem_tables == "mmap" and not any("up_table" in n for n in built.state_dict())
    for layer in model.config.stem_layers:
        assert torch.equal(built.stem_table_rows(layer, ids[0]), model.stem_table_rows(layer, ids[0]))
    assert AutoModel.from_config(AutoConfig.from_pretrained(tmp_path / "m")).stem_tables == "memory"  # as asked
    config = AutoConfig.from_pretrained(tmp_path / "m", stem_tables="mmap")
    config._name_or_path = "someone/stem-model"  # neither cached nor reachable: offline
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(StemTablesError, match="neither a local folder nor a hub id whose files can be fetched"):
        AutoModel.from_config(config)


def test_the_base_model_compiles_whole_with_the_eager_hidden_states(tmp_path, ids):
    """vLLM compiles the base model whole unless told `enforce_eager`, calling its `forward` with packed position
    ids: the STEM layers' reads and the first-token rule are traced (before, the forward refused to be)."""
    tiny_stem().save_pretrained(tmp_path / "m")
    base = AutoModel.from_pretrained(tmp_path / "m").eval()
    positions = torch.cat([torch.arange(4), torch.arange(7)])[None]  # two sequences packed in one row, as vLLM does
    packed = ids[:1, :11]
    with torch.no_grad():
        eager = base.forward(input_ids=packed, position_ids=positions).last_hidden_state
        compiled = torch.compile(base.forward, backend="eager", fullgraph=True)(input_ids=packed, position_ids=positions)
    torch.testing.assert_close(compiled.last_hidden_state, eager, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
