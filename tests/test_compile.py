"""A STEM model under torch.compile: traced whole (fullgraph), in a process where stem_upcycle cannot be
imported, with the logits and the generated tokens of the eager model, for every placement a graph can serve."""

import sys

import pytest

from stem_upcycle.compress import plan_compression, run_compression
from stem_upcycle.convert import plan_conversion, run_conversion
from stem_upcycle.source import open_source

from stem_upcycle.table_init import InitOptions

from .conftest import markov_text, run_without_stem_upcycle, save_tiny_tokenizer, tiny_dense

COMPILED = """
import sys

import torch
from transformers import AutoModelForCausalLM, DynamicCache

path, placements = sys.argv[1], sys.argv[2].split(",")
torch._dynamo.config.recompile_limit = 64  # decode_by_hand's growing mask recompiles, as the dense model's would
torch.manual_seed(0)
ids = torch.randint(0, 96, (2, 9))
mask = torch.ones_like(ids)
mask[1, :3] = 0  # left padding: row 1's first token is at position 3
real = mask.bool()


def load(placement):
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, stem_tables=placement).eval()


# logits [2, 9, vocab] of a prompt's first 5 tokens, then one token per forward with a KV cache and no position
# ids (the first-token rule then reads the mask over the cached tokens)
def decode_by_hand(model):
    out = model(input_ids=ids[:, :5], attention_mask=mask[:, :5], past_key_values=DynamicCache(config=model.config))
    logits = [out.logits]
    for t in range(5, 9):
        out = model(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=out.past_key_values)
        logits.append(out.logits)
    return torch.cat(logits, 1)


# each placement that reads rows by an op, twice: a forward of few lookups (all of this test's) reads every
# layer's rows in one op at its start (ROWS_AT_ONCE), one of more in an op per layer
runs = [(placement, reads) for placement in placements for reads in ("at once", "per layer")]
for placement, reads in runs:
    model = load(placement)
    if model.stem_placement is None and reads == "per layer":
        continue  # float tables in memory are gathered inside the graph: no op either way
    # the bound, in the modeling code (a compiled forward's choice of op) and the tables' (the per-layer op's own)
    modeling = type(model).__module__
    codes = [sys.modules[modeling], sys.modules[modeling.replace("modeling_stem", "stem_tables")]]
    default = codes[0].ROWS_AT_ONCE
    for code in codes:
        code.ROWS_AT_ONCE = 0 if reads == "per layer" else default
    calls = []
    if model.stem_placement is not None:  # count the one-op reads, from the op's side
        read_all = model.stem_placement.rows_of_layers
        model.stem_placement.rows_of_layers = lambda *args: calls.append(1) or read_all(*args)
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                cache_implementation="static")
        by_hand = decode_by_hand(model)
        forward = model.forward
        model.forward = torch.compile(forward, fullgraph=True)
        # a prompt's forward (every row holds its first token) and the decode steps of generate() (none does)
        compiled = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(compiled[real], eager[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(decode_by_hand(model)[real], by_hand[real], rtol=1e-5, atol=1e-5)
        again = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                               cache_implementation="static")
        assert torch.equal(again, tokens), (placement, again, tokens)
    for code in codes:
        code.ROWS_AT_ONCE = default
    print(placement, model.stem_tables, "ok", reads if model.stem_placement is not None else "in the graph",
          "with" if calls else "without", "rows_of_layers")

# the first-token rule reaches the compiled graph: with the first token's row instead of W_up the logits move
model = load("memory")
for layer in model.config.stem_layers:
    model.model.layers[layer].mlp.up_proj = None
model.forward = torch.compile(model.forward, fullgraph=True)
with torch.no_grad():
    assert not torch.allclose(model(input_ids=ids, attention_mask=mask).logits[real], eager[real], atol=1e-3)

# a run-time edit is refused in one line when the graph is traced, not served wrong
model = load("memory")
RowEdit = sys.modules[type(model).__module__].RowEdit
model.set_stem_row_edit(RowEdit(prompt_ids=ids, rows=torch.tensor([0]), positions=torch.tensor([4]),
                                target_ids=torch.tensor([[5]]), weights=torch.tensor([[1.0]])))
model.forward = torch.compile(model.forward, fullgraph=True)
try:
    model(input_ids=ids, attention_mask=mask)
except Exception as err:
    assert "applies to eager forwards only" in str(err), str(err)
else:
    raise AssertionError("a compiled model ran with a run-time edit")
print(model.config.stem_table_groups)
"""


def _converted(tmp_path, layer_groups: int, columns: str = "all"):
    """Layers 0 and 2 of a tiny llama converted; with `columns`, a share of their neurons (calibrated rows)."""
    tiny_dense("llama").save_pretrained(tmp_path / "dense")
    save_tiny_tokenizer(tmp_path / "dense")
    options = None
    if columns != "all":  # the neurons are chosen by their error with calibrated rows
        (tmp_path / "calib.txt").write_text(markov_text(4000, 0))
        options = InitOptions(calib_data=[str(tmp_path / "calib.txt")], calib_seq_len=32)
    plan = plan_conversion(open_source(str(tmp_path / "dense")), layers="0,2",
                           init="closed-form" if options is None else "calib", layer_groups=layer_groups,
                           columns=columns, init_options=options)
    run_conversion(plan, tmp_path / "stem", progress=False)
    return tmp_path / "stem"


@pytest.mark.parametrize("layer_groups,columns", [(1, "all"), (2, "all"), (2, "1/3")])
def test_a_compiled_model_gives_the_logits_and_tokens_of_the_eager_one(tmp_path, layer_groups, columns):
    """Tables in memory (a parameter each, or side by side in a group: gathered inside the graph) and left in
    the checkpoint's files (mmap: read by an op of the graph); the first tokens' dense up-projection is an op
    of the graph too, which runs it only on forwards that hold one. With a third of each layer's neurons as table
    columns, the others' dense up-projection (up_rest) joins the rows in the graph."""
    out = run_without_stem_upcycle(COMPILED, _converted(tmp_path, layer_groups, columns), "memory,mmap")
    groups = "[[0, 2]]" if layer_groups == 2 else "None"
    assert out.splitlines() == ["memory memory ok in the graph without rows_of_layers",
                                "mmap mmap ok at once with rows_of_layers",
                                "mmap mmap ok per layer without rows_of_layers", groups]


def test_compressed_tables_compile_and_host_is_refused(tmp_path, host_on_cpu):
    """int8 tables held as read (memory) and read from the files (mmap) are read by the op; the exported code
    compiles beside the package's in one process; `host`, whose rows are staged around each forward, is refused
    when traced (dynamo wraps the error: its text names the fix)."""
    import torch
    from transformers import AutoModelForCausalLM

    stem = _converted(tmp_path, 1)
    run_compression(plan_compression(open_source(str(stem)), "int8", block_size=16), tmp_path / "int8", progress=False)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    for placement in ("memory", "mmap"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "int8", stem_tables=placement).eval()
        with torch.no_grad():
            eager = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
            model.forward = torch.compile(model.forward, fullgraph=True)
            compiled = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
        assert torch.equal(compiled, eager), placement
    # the exported modeling code, loaded as remote code in this process, which imported the package's copy: each
    # copy calls ops of its own (their registries hold their own objects)
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    exported = get_class_from_dynamic_module("modeling_stem.StemForCausalLM", str(stem))
    remote = exported.from_pretrained(stem, stem_tables="mmap").eval()
    assert not type(remote).__module__.startswith("stem_upcycle")
    with torch.no_grad():
        eager = remote.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
        remote.forward = torch.compile(remote.forward, fullgraph=True)
        assert torch.equal(remote.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static"), eager)
    model = AutoModelForCausalLM.from_pretrained(stem, stem_tables="host").eval()
    model.forward = torch.compile(model.forward, fullgraph=True)
    with pytest.raises(Exception, match="stem_tables='host' stages rows around each forward: load with "
                                        "stem_tables='memory' or 'mmap' to compile"):
        model(ids)
    assert "stem_upcycle" in sys.modules  # in-process: the package's own classes (the remote ones are above)


HANDLES = """
import sys

from transformers import AutoModelForCausalLM

def handles(model):
    mlps = [model.model.layers[i].mlp for i in model.config.stem_layers]
    return [mlp.stem_handle for mlp in mlps] + [mlps[0].up_table.placement.stem_handle]

first, second = (AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, stem_tables="mmap")
                 for _ in range(2))
print(handles(first), handles(second))
"""


def test_the_numbers_a_graph_names_its_objects_by_are_the_same_in_every_process(tmp_path):
    """A compiled graph holds, as constants, the numbers by which its ops find the model's objects (an MLP's dense
    first-token projection, a placement's files); vLLM caches compiled graphs on disk and runs them in later
    processes, so a process that builds the same model must give them the same numbers (not ids, which differ),
    and two models in one process different ones."""
    stem = _converted(tmp_path, 1)
    runs = [run_without_stem_upcycle(HANDLES, stem) for _ in range(2)]
    assert runs[0] == runs[1]
    first, second = runs[0].strip().split("] [")
    assert first != second and len(set(first.split(", "))) == 3, runs[0]


def test_first_tokens_up_projections_kept_per_id_follow_the_weights(tmp_path):
    """A small compiled forward gives each sequence's first token the dense up-projections of a one-token forward of
    its id, kept per id (they depend on the id alone); weights changed since, in a STEM layer's up-projection or in an
    earlier layer's attention, are seen: the compiled logits stay the eager ones."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_converted(tmp_path, 1), stem_tables="memory").eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        assert sorted(token for token, _ in model.model.stem_first_token_ups) == sorted(ids[:, 0].tolist())
        model.model.layers[2].mlp.up_proj.weight.mul_(1.5)
        model.model.layers[1].self_attn.v_proj.weight.mul_(0.5)
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
