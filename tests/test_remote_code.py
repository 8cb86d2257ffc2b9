"""An exported STEM model used where stem-upcycle is not installed: `trust_remote_code=True` alone.

Each test runs its script in a fresh process in which `stem_upcycle` cannot be imported, so that the
code under test is the modeling code exported next to the weights (Transformers' dynamic modules),
never the package's registered classes: placements, generation, resizing, saving and LoRA.
"""

import textwrap

import pytest
import torch

from .conftest import export_stem, run_without_stem_upcycle, tiny_stem

LOAD = """
import torch
from transformers import AutoModel, AutoModelForCausalLM

path, data = sys.argv[1], torch.load(sys.argv[2])
ids = data["ids"]


def load(cls=AutoModelForCausalLM, **kwargs):
    return cls.from_pretrained(path, trust_remote_code=True, **kwargs).eval()


def one_line_error(call) -> str:
    try:
        call()
    except Exception as err:
        assert type(err).__name__ == "StemTablesError", repr(err)
        assert "\\n" not in str(err), str(err)
        return str(err)
    raise AssertionError("no error")
"""


def with_load(body: str) -> str:
    """A script: LOAD's model path, ids, `load` and `one_line_error`, then `body`."""
    return LOAD + textwrap.dedent(body)


@pytest.fixture
def exported(tmp_path, ids):
    """A tiny exported STEM model (layers 0 and 2) and a file with ids and the package's logits for them."""
    model = tiny_stem("llama", layers=(0, 2))
    with torch.no_grad():
        logits = model(ids).logits
    torch.save({"ids": ids, "logits": logits}, tmp_path / "data.pt")
    return export_stem(model, tmp_path / "m"), tmp_path / "data.pt"


def test_each_placement_asked_for_is_the_placement_got_with_the_logits_of_memory(exported):
    script = with_load("""
    assert load().stem_tables == "mmap"  # the default
    memory = load(stem_tables="memory")
    assert type(memory).__module__.startswith("transformers_modules"), type(memory).__module__
    assert memory.stem_tables == "memory" and any("up_table" in n for n in memory.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(memory(ids).logits, data["logits"], rtol=0, atol=0)
    greedy = memory.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)

    print(one_line_error(lambda: load(stem_tables="host")))  # no accelerator here
    print(one_line_error(lambda: load(stem_tables="disk")))
    torch.accelerator.is_available = lambda: True  # from here, `host` runs with the CPU as its device
    for placement in ("mmap", "host"):
        for kwargs in ({}, {"dtype": torch.float32}):
            model = load(stem_tables=placement, stem_cache_rows=16, **kwargs)
            assert model.stem_tables == placement, (placement, kwargs, model.stem_tables)
            assert not any("up_table" in n for n in model.state_dict())
            if placement == "host":
                assert model.stem_placement.capacity == 16  # stem_cache_rows reached the placement too
            with torch.no_grad():
                torch.testing.assert_close(model(ids).logits, data["logits"], rtol=1e-6, atol=1e-6)
            assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), greedy)
        base = load(AutoModel, stem_tables=placement)
        assert base.stem_tables == placement
    print("OK")
    """)
    out = run_without_stem_upcycle(script, *exported).splitlines()
    assert out[-1] == "OK"
    assert "host" in out[0] and "stem_tables='mmap'" in out[0]  # the fix is in the message
    assert "'disk' is not a placement" in out[1] and "memory" in out[1]


def test_resize_and_save_refuse_placed_tables_and_work_as_their_error_says(exported, tmp_path):
    script = with_load("""
    mapped = load()
    print(one_line_error(lambda: mapped.resize_token_embeddings(100)))
    print(one_line_error(lambda: mapped.save_pretrained(sys.argv[3])))

    model = load(stem_tables="memory", stem_cache_rows=16)  # as the errors say
    model.save_pretrained(sys.argv[3])
    saved = AutoModelForCausalLM.from_pretrained(sys.argv[3], trust_remote_code=True)
    # where the tables were loaded to is the loader's choice, not the saved model's default
    assert saved.stem_tables == "mmap" and saved.config.stem_cache_rows == 2048, saved.config
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, data["logits"], rtol=0, atol=0)
    assert model.config.stem_tables == "memory"  # the loaded model's own config keeps what it was loaded with
    model.resize_token_embeddings(100, mean_resizing=False)
    for layer in model.config.stem_layers:
        assert model.model.layers[layer].mlp.up_table.weight.shape[0] == 100
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :96], data["logits"], rtol=1e-6, atol=1e-6)
        assert model(torch.tensor([[99, 1]])).logits.isfinite().all()
    print("OK")
    """)
    out = run_without_stem_upcycle(script, *exported, tmp_path / "saved").splitlines()
    assert out[-1] == "OK"
    assert all("stem_tables='memory'" in line for line in out[:2]), out


def test_lora_on_a_mapped_model_trains_saves_and_reloads_leaving_the_tables_alone(exported, tmp_path):
    path, _ = exported
    table_bytes = (path / "model.safetensors").read_bytes()
    script = with_load("""
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(load(), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"]))
    model.train()
    pattern = (torch.arange(16) * 5 % 96)[None]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    losses = []
    for _ in range(60):
        loss = model(input_ids=pattern, labels=pattern).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses  # it learns (a random 32-wide model: slowly)
    model.eval().save_pretrained(sys.argv[3])
    reloaded = PeftModel.from_pretrained(load(), sys.argv[3]).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(pattern).logits, model(input_ids=pattern).logits)
    print("OK")
    """)
    assert run_without_stem_upcycle(script, *exported, tmp_path / "adapter").splitlines()[-1] == "OK"
    assert (path / "model.safetensors").read_bytes() == table_bytes


def test_the_tokenizer_loads_without_running_the_models_code(exported):
    """Transformers 5's AutoTokenizer reads config.json through AutoConfig, which asks before running its code:
    trust_remote_code=False skips the question, and the tokenizer (which needs no code) loads."""
    from .conftest import save_tiny_tokenizer

    save_tiny_tokenizer(exported[0])
    out = run_without_stem_upcycle("""
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=False)
        print(tokenizer("w1 w5 w9")["input_ids"])
    """, exported[0])
    assert out.splitlines()[-1] == "[1, 5, 9]" and "Do you wish to run" not in out
