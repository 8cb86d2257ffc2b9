"""Building blocks of `stem-upcycle train`: head loss, table optimizers, hand-off, recipe, data."""

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stem_upcycle.convert import plan_conversion, run_conversion
from stem_upcycle.source import open_source
from stem_upcycle.training.data import Batches
from stem_upcycle.training.losses import IGNORE, HeadLoss, head_loss
from stem_upcycle.training.recipe import RANGES, Recipe, RecipeError, load_recipe
from stem_upcycle.training.student import attach_tables, base_model, set_blend, set_handoff
from stem_upcycle.training.tables import LazyAdam, OffloadedTable, RowwiseAdagrad, SharedTables, distinct_ids


def _reference_loss(spec, hidden, weight, targets, teacher_hidden, teacher_weight, normalizer, ce_mask):
    def logits(h, w):
        z = h @ w.T * spec.scale
        return z if spec.softcap is None else spec.softcap * torch.tanh(z / spec.softcap)

    z, zt = logits(hidden, weight), logits(teacher_hidden, teacher_weight)
    valid = targets != IGNORE
    ce = F.cross_entropy(z[valid & ce_mask], targets[valid & ce_mask], reduction="sum")
    T = spec.temperature
    kl = F.kl_div(F.log_softmax(z / T, -1), F.log_softmax(zt / T, -1), log_target=True, reduction="none").sum(-1)
    return (spec.ce_weight * ce + spec.kd_weight * T * T * kl[valid].sum()) / normalizer


@pytest.mark.parametrize("softcap,scale,temperature", [(None, 1.0, 1.0), (3.0, 0.5, 2.0)])
def test_chunked_head_loss_equals_full_logits(softcap, scale, temperature):
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(37, 16, dtype=torch.float64), torch.randn(50, 16, dtype=torch.float64)
    targets = torch.randint(0, 50, (37,))
    targets[[3, 20]] = IGNORE
    ce_mask = torch.ones(37, dtype=torch.bool)
    ce_mask[10:30] = False  # e.g. generated text: KL only
    spec = HeadLoss(ce_weight=0.7, kd_weight=1.3, temperature=temperature, scale=scale, softcap=softcap, chunk_tokens=8)
    loss, sums = head_loss(spec, hidden, weight, targets, teacher_hidden, teacher_weight, normalizer=35, ce_mask=ce_mask)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref = _reference_loss(spec, hidden, weight, targets, teacher_hidden, teacher_weight, 35, ce_mask)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-8)
    assert sums[3] == 35 and sums[4] == 35 - 19  # targets; cross-entropy positions (20 masked, one ignored)


def test_rowwise_adagrad_updates_only_the_rows_of_the_step():
    torch.manual_seed(0)
    weight = torch.randn(20, 6)
    before = weight.clone()
    table = OffloadedTable(weight, torch.device("cpu"))
    optimizer = RowwiseAdagrad([table])
    table.gather(distinct_ids(torch.tensor([[3, 7, 3], [11, 7, 7]])))
    (table.lookup(torch.tensor([[3, 7, 11]])).sum() * 2).backward()
    optimizer.step(lr=0.1)
    touched = torch.tensor([3, 7, 11])
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[touched] = False
    assert torch.equal(weight[untouched], before[untouched])
    assert (weight[touched] != before[touched]).all()
    # Adagrad's first step moves every element by lr * g / sqrt(mean g^2) = lr for a constant gradient.
    torch.testing.assert_close(weight[touched], before[touched] - 0.1, rtol=0, atol=1e-6)
    assert optimizer.state[0].shape == (20,)  # one scalar per row


def test_lazy_adam_equals_adam_when_every_row_is_touched():
    torch.manual_seed(0)
    weight = torch.randn(5, 4)
    reference = torch.nn.Parameter(weight.clone())
    torch_adam = torch.optim.AdamW([reference], lr=0.01, weight_decay=0.1)
    table = OffloadedTable(weight, torch.device("cpu"))
    lazy = LazyAdam([table], weight_decay=0.1)
    for step in range(3):
        target = torch.randn(5, 4)
        table.gather(torch.arange(5))
        ((table.lookup(torch.arange(5)) - target) ** 2).sum().backward()
        lazy.step(lr=0.01)
        torch_adam.zero_grad()
        ((reference - target) ** 2).sum().backward()
        torch_adam.step()
    torch.testing.assert_close(weight, reference.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", [RowwiseAdagrad, LazyAdam])
def test_shared_tables_are_one_copy_whose_rows_each_process_updates_once(tmp_path, optimizer):
    """Two processes of a machine (simulated in turn): one mapped copy of the table and its state; each writes
    the rows it owns (id % 2), and together they make exactly the update of one process with a private copy."""
    torch.manual_seed(0)
    start = torch.randn(30, 6)
    ids = torch.tensor([[3, 7, 3, 12], [11, 7, 8, 29]])
    grad_of = torch.randn(30, 6)  # the gradient of each row, the same in every process (after all-reduce)

    def one_step(table, opt):
        table.gather(distinct_ids(ids))
        (table.lookup(table.ids) * grad_of[table.ids]).sum().backward()
        opt.step(lr=0.1)

    private = OffloadedTable(start.clone(), torch.device("cpu"))
    reference = optimizer([private])
    processes = []
    for rank in range(2):  # rank 0 creates and fills the files, rank 1 maps them
        shared = SharedTables(tmp_path / "host", rank, 2)
        weight = shared.tensor("table.0", (30, 6), fill=lambda a, b: start[a:b])
        table = OffloadedTable(weight, torch.device("cpu"), owner=(rank, 2))
        processes.append((table, optimizer([table], zeros=shared.zeros("optimizer"))))
    for _ in range(2):
        one_step(private, reference)
        for table, opt in processes:  # each writes its own rows into the one copy
            one_step(table, opt)
    a, b = processes[0][0].weight, processes[1][0].weight
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)  # two mappings, one copy
    torch.testing.assert_close(a, private.weight, rtol=0, atol=1e-6)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(processes[1][1].state_dict()[name], value, rtol=0, atol=1e-6)
    assert (tmp_path / "host" / "table.0.bin").stat().st_size == 30 * 6 * 4


def test_a_full_disk_for_the_host_copy_is_one_line_not_a_bus_error(tmp_path, monkeypatch):
    """The host copy's blocks are reserved before the file is mapped: where the disk is full, filling a sparse
    mapped file would kill the process with SIGBUS; reserving them fails with ENOSPC, reported in one line."""
    import errno

    from stem_upcycle.errors import UserError

    shared = SharedTables(tmp_path / "host", 0, 1)
    weight = shared.tensor("table.0", (30, 6), fill=lambda a, b: torch.ones(b - a, 6))
    assert torch.equal(weight, torch.ones(30, 6))
    state = shared.tensor("state.0", (3000, 6))  # zeros, never written: still blocks behind every page
    assert os.stat(tmp_path / "host" / "state.0.bin").st_blocks * 512 >= 3000 * 6 * 4 and not state.any()
    assert shared.tensor("empty", (0, 6)).shape == (0, 6)  # nothing to reserve (fallocate of 0 bytes is EINVAL)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(UserError, match=r"^no space for the tables' host copy in .*host: table\.1\.bin needs "
                                        r"0\.00 GiB; free space there or set tables\.host_dir"):
        shared.tensor("table.1", (30, 6), fill=lambda a, b: torch.ones(b - a, 6))
    assert (tmp_path / "host" / "table.1.bin").stat().st_size == 0  # nothing that looks filled


@pytest.mark.parametrize("model_type, first_token, columns", [
    ("llama", "table", "all"), ("granite", "table", "all"), ("phi3", "table", "all"), ("gemma2", "table", "all"),
    ("llama", "dense", "all"), ("phi3", "dense", "all"), ("llama", "table", "1/3"), ("phi3", "dense", "1/3")])
def test_handoff_at_blend_zero_is_the_dense_model_exactly(dense_dir, tmp_path, ids, model_type, first_token, columns):
    """At a = 0 every STEM layer reads the teacher's up-projection: the dense model; with a share of each layer's
    neurons as table columns, the teacher's rows of those neurons, found by the layer's `neuron_order`."""
    from transformers import AutoModelForCausalLM

    from stem_upcycle.table_init import InitOptions

    from .conftest import markov_text, save_tiny_tokenizer

    dense, path = dense_dir(model_type)
    save_tiny_tokenizer(path)
    (tmp_path / "calib.txt").write_text(markov_text(4000, 0))
    source = open_source(str(path))
    init = "closed-form" if columns == "all" else "calib"  # neurons are chosen with calibrated rows
    plan = plan_conversion(source, layers="all", first_token=first_token, columns=columns, init=init,
                           init_options=InitOptions(calib_data=[str(tmp_path / "calib.txt")], calib_seq_len=32))
    run_conversion(plan, tmp_path / "stem", progress=False)
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "stem", dtype=torch.float32, stem_tables="memory").eval()
    tables = attach_tables(student, torch.device("cpu"))
    set_handoff(student, dense)  # borrows the teacher's up-projections
    stem_mlp = base_model(student).layers[0].mlp
    dense_storage = {p.untyped_storage().data_ptr() for p in dense.parameters()}
    shared = stem_mlp.dense_up[0].untyped_storage().data_ptr() in dense_storage
    assert shared == (columns == "all")  # whole layers: shared, not copied; a share: a copy of its rows alone
    assert stem_mlp.dense_up[0].shape[0] == base_model(student).config.table_columns(0)
    kept = [name for name in student.state_dict() if "up_proj" in name]  # no parameter of the student's either,
    assert len(kept) == (3 if first_token == "dense" else 0)  # but the first token's own up-projection
    for table in tables.values():
        table.gather(distinct_ids(ids))
    with torch.no_grad():
        if model_type == "phi3" or columns != "all":
            # Phi-3's dense MLP runs one fused gate_up matmul, the hand-off two split ones; a share of the neurons
            # reorders them, so the down-projection sums them in another order: the same sums, blocked
            # differently by the CPU's kernels (AVX-512 rounds them apart), so a tolerance.
            torch.testing.assert_close(student(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-6)
        else:  # the same operations in the same order: bit-identical on any CPU
            assert torch.equal(student(ids).logits, dense(ids).logits)
        set_blend(student, 1.0)  # a = 1: the STEM model as converted
        stem = AutoModelForCausalLM.from_pretrained(tmp_path / "stem", dtype=torch.float32).eval()
        torch.testing.assert_close(student(ids).logits, stem(ids).logits, rtol=0, atol=0)


def test_recipe_overrides_and_errors(tmp_path):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("model: {source: smollm2-135m}\ndata: {train: [a.txt]}\ntrain: {lr: 3e-4, steps: 5}\n")
    recipe = load_recipe(recipe_file, ["train.steps=7", "tables.optimizer=adam", "train.trainable=[tables, lora]"])
    assert (recipe.train.steps, recipe.train.lr, recipe.tables.optimizer) == (7, 3e-4, "adam")
    assert recipe.train.trainable == ["tables", "lora"]
    assert load_recipe(recipe_file, ["data.eval=[x.txt, y.txt]"]).data.eval == {"heldout": ["x.txt", "y.txt"]}
    named = load_recipe(recipe_file, ["data.eval={plays: x.txt, docs: [y.txt, z.txt]}"]).data.eval
    assert named == {"plays": ["x.txt"], "docs": ["y.txt", "z.txt"]}
    for overrides, message in [
        (["train.stepz=3"], "train.'stepz' is unknown"),
        (["train.steps=many"], "must be a number"),
        (["train.trainable=[heads]"], "'heads' is unknown"),
        (["train.batch_size=6", "train.micro_batch_size=4"], "not a multiple"),
        (["tables.optimizer=sgd"], "sgd"),
        (["steps=3"], "section.key=value"),
        (["generated.train_share=1.5"], r"generated.train_share must be in \[0, 1\], got 1.5"),
        (["generated.tokens=100"], "makes no training sequence"),
        (["generated.tokens=5000", "generated.first_tokens=300"], "must be below generated.length"),
        (["data.train=[]"], "data.train is empty"),
        (["data.train=[]", "generated.tokens=5000", "generated.train_share=1"], "name held-out sets in data.eval"),
        (["data.eval={a: []}"], "set 'a' names no file"),
    ]:
        with pytest.raises(RecipeError, match=message):
            load_recipe(recipe_file, overrides)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")


def test_every_numeric_recipe_key_has_a_range_and_a_value_outside_it_is_one_line(tmp_path):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("model: {source: smollm2-135m}\ndata: {train: [a.txt]}\n")
    types = {f"{section.name}.{f.name}": f.type for section in dataclasses.fields(Recipe)
             for f in dataclasses.fields(section.type)}
    assert {key for key, kind in types.items() if kind in (int, float, "int", "float")} == set(RANGES)
    for key, bounds in RANGES.items():
        if bounds.startswith(">"):
            op, limit = bounds.split()
            outside = [float(limit) if op == ">" else float(limit) - 1]
        else:
            low, high = (float(x) for x in bounds[1:-1].split(","))
            outside = [low - 1, high if bounds.endswith(")") else high * 2]
        for value in outside:
            value = int(value) if types[key] in (int, "int") else value
            with pytest.raises(RecipeError, match=rf"^recipe key {key} must be .*, got ") as err:
                load_recipe(recipe_file, [f"{key}={value}"])
            assert "\n" not in str(err.value)


def test_batches_are_deterministic_and_an_epoch_reads_every_sequence_once():
    many = torch.arange(100).view(20, 5)
    a, b = Batches(many, 4, seed=3), Batches(many, 4, seed=3)
    assert torch.equal(a.step(7), b.step(7)) and not torch.equal(a.step(0), a.step(1))
    seen = torch.cat([a.step(s) for s in range(5)])[:, 0].sort().values
    assert torch.equal(seen, many[:, 0])


def test_chunked_head_loss_never_waits_for_the_device():
    """No boolean index, nonzero() or item() in the loss (each a host sync per chunk on a GPU): it runs on meta
    tensors, which have no values, so any operation that must read one raises."""
    spec = HeadLoss(chunk_tokens=8)
    hidden, weight = torch.randn(37, 16, device="meta", requires_grad=True), torch.randn(50, 16, device="meta")
    targets = torch.randint(0, 50, (37,), device="meta")
    ce_mask = torch.ones(37, dtype=torch.bool, device="meta")
    loss, sums = head_loss(spec, hidden, weight, targets, torch.randn(37, 16, device="meta"), weight, 35.0, ce_mask)
    loss.backward()
    assert loss.device.type == sums.device.type == hidden.grad.device.type == "meta"


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads_as_written(path):
    """A recipe the README runs must pass the checks `train` makes before it starts (a typo or a stage the
    conversion cannot run would end a user's first run)."""
    recipe = load_recipe(path)
    assert recipe.model.source and recipe.train.steps > 0
