"""Table placements (`stem_tables=`): every placement gives the logits of `memory`; errors are one line."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from stem_upcycle.modeling.forward_ids import check_ids
from stem_upcycle.modeling.table_files import StemTablesError

from .conftest import VOCAB, tiny_stem

PLACEMENTS = ["mmap", "host"]


@pytest.fixture
def stem_dir(tmp_path):
    model = tiny_stem("llama", layers=(0, 2))
    model.save_pretrained(tmp_path / "m", max_shard_size="40KB")  # several shards
    return tmp_path / "m"


def load(path, placement, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, stem_tables=placement, **kwargs).eval()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_placements_give_the_logits_of_memory(stem_dir, placement, host_on_cpu, ids):
    memory, placed = load(stem_dir, "memory"), load(stem_dir, placement, stem_cache_rows=16)
    assert placed.stem_tables == placement
    assert not any("up_table" in n for n in placed.state_dict())  # no table became a parameter
    with torch.no_grad():
        torch.testing.assert_close(placed(ids).logits, memory(ids).logits, rtol=1e-6, atol=1e-6)
        # left-padded batch, then cached greedy decoding
        batch, mask = ids.clone(), torch.ones_like(ids)
        batch[0, :4], mask[0, :4] = 0, 0
        torch.testing.assert_close(placed(batch, attention_mask=mask).logits,
                                   memory(batch, attention_mask=mask).logits, rtol=1e-6, atol=1e-6)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    a, b = memory.generate(batch, **kwargs), placed.generate(batch, **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(b.scores), torch.stack(a.scores), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mmap_leaves_the_first_tokens_up_projection_in_the_files(stem_dir, ids, dtype):
    """The dense first token's up-projection is read from the checkpoint's mapped files at the moment it
    is used, with the result of the parameter in memory, and its pages are let go after: no memory for it."""
    import ctypes

    from stem_upcycle.modeling.stem_tables import MappedLinear

    memory, mapped = load(stem_dir, "memory", dtype=dtype), load(stem_dir, "mmap", dtype=dtype)
    names = {n for n, _ in mapped.named_parameters()}
    assert "model.layers.1.mlp.up_proj.weight" in names  # a dense layer's own
    assert not any(f"layers.{i}.mlp.up_proj" in n for n in names for i in (0, 2))
    assert all(isinstance(mapped.model.layers[i].mlp.up_proj, MappedLinear) for i in (0, 2))
    with torch.no_grad():
        torch.testing.assert_close(mapped(ids).logits, memory(ids).logits, rtol=1e-6, atol=1e-6)
    mappings = mapped.stem_placement.mappings
    assert mappings  # the first tokens' forward read the projection through its mapping
    starts = {f"{ctypes.addressof(ctypes.c_char.from_buffer(m)):x}-" for m in mappings.values()}
    smaps = open("/proc/self/smaps").read().split("\n")  # Transformers maps the same files too, elsewhere
    resident = [int(line.split()[1]) for i, head in enumerate(smaps) if head.split("-")[0] + "-" in starts
                for line in smaps[i + 1 : i + 8] if line.startswith("Rss:")]
    assert len(resident) == len(mappings) and sum(resident) == 0  # every page of these mappings let go (kB)


def test_mmap_keeps_the_first_tokens_up_projection_on_an_accelerator_after_its_first_prefill(stem_dir, monkeypatch):
    """On a device other than the CPU (here the meta device, which holds no data) the projection is copied there
    once, not at every prefill; on the CPU it stays in the files."""
    from stem_upcycle.modeling.stem_tables import MappedLinear

    projection = load(stem_dir, "mmap").model.layers[0].mlp.up_proj
    reads = []
    mapped = MappedLinear._mapped
    monkeypatch.setattr(MappedLinear, "_mapped", lambda self, t: reads.append(t) or mapped(self, t))
    x = torch.randn(3, projection.stored.shape[1])
    for _ in range(2):
        assert projection(x.to("meta")).shape == (3, projection.stored.shape[0])
    assert len(reads) == 1 and list(projection.on_device) == [(torch.device("meta"), torch.float32)]
    projection(x), projection(x)
    assert len(reads) == 3  # the CPU's: read at each call


def test_host_cache_hits_misses_evictions_and_staging(stem_dir, host_on_cpu):
    memory, host = load(stem_dir, "memory"), load(stem_dir, "host", stem_cache_rows=6)
    cache = host.stem_placement
    torch.manual_seed(3)
    with torch.no_grad():
        for length in (5, 3, 4, 5, 2, 9, 1, 5):  # 9 distinct ids at most > 6 rows: staged, cache untouched
            x = torch.randint(0, VOCAB, (1, length))
            torch.testing.assert_close(host(x).logits, memory(x).logits, rtol=1e-6, atol=1e-6)
        x = torch.tensor([[7, 7, 7]])
        host(x)
        copies, copy = [], cache._copy
        cache._copy = lambda ids, *args: copies.append(ids) or copy(ids, *args)
        host(x)
    assert copies == []  # a forward whose rows are all cached copies nothing
    assert cache.stats["hits"] >= 1 and cache.stats["misses"] >= 6 and cache.stats["staged"] >= 6
    assert int((cache.owner >= 0).sum()) <= 6 and int(cache.leases.sum()) == 0  # every lease released
    cached = cache.owner[cache.owner >= 0]
    assert torch.equal(cache.slot_of[cached], (cache.owner >= 0).nonzero().flatten())  # map and owners agree


def test_host_rows_that_change_are_not_served_stale(stem_dir, host_on_cpu, ids):
    memory, host = load(stem_dir, "memory"), load(stem_dir, "host")
    with torch.no_grad():
        host(ids)  # every row of ids is now cached
        new = torch.randn(3, memory.config.intermediate_size)
        changed = ids[0, :3]
        memory.model.layers[2].mlp.up_table.weight[changed] = new
        host.stem_placement.set_rows(2, changed, new)
        torch.testing.assert_close(host(ids).logits, memory(ids).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_forward_under_inference_mode_then_under_no_grad(stem_dir, placement, host_on_cpu, ids):
    """What the first forward allocates for later ones (host: the device cache) is a normal tensor, which a
    later forward outside inference mode writes into (it was an inference tensor: "Inplace update to inference
    tensor outside InferenceMode")."""
    memory, placed = load(stem_dir, "memory"), load(stem_dir, placement, stem_cache_rows=32)
    with torch.inference_mode():
        torch.testing.assert_close(placed(ids[:1]).logits, memory(ids[:1]).logits, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # rows not cached yet: copied into the cache the first forward made
        torch.testing.assert_close(placed(ids[1:]).logits, memory(ids[1:]).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("placement", ["memory", *PLACEMENTS])
def test_two_threads_in_flight_each_get_their_own_rows(stem_dir, placement, host_on_cpu):
    """Both threads start a forward, then meet before the first STEM layer: a hand-off of ids shared
    by the threads would give one of them the other's rows."""
    model = load(stem_dir, placement, stem_cache_rows=12)
    inputs = [torch.arange(0, 8)[None], torch.arange(40, 48)[None]]  # 8 + 8 distinct ids > 12 cached rows
    with torch.no_grad():
        expected = [model(x).logits for x in inputs]
    meet = threading.Barrier(2, timeout=30)
    def wait_for_the_other(module, args):
        meet.wait()

    hook = model.model.layers[0].register_forward_pre_hook(wait_for_the_other)
    results = [None, None]

    def run(i):
        with torch.no_grad():
            results[i] = model(inputs[i]).logits

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hook.remove()
    for got, want in zip(results, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_mmap_follows_the_compute_dtype_and_never_casts_the_tables(stem_dir, ids):
    memory = load(stem_dir, "memory", dtype=torch.bfloat16)
    mapped = load(stem_dir, "mmap", dtype=torch.bfloat16)
    stored = mapped.stem_placement.stored[0].parts["weight"]
    assert stored.dtype == torch.float32  # as stored; rows are cast as gathered
    with torch.no_grad():
        torch.testing.assert_close(mapped(ids).logits, memory(ids).logits, rtol=0, atol=0)
        mapped.to(torch.float32)
        assert mapped.stem_placement.stored[0].parts["weight"] == stored
    table = load(stem_dir, "memory").model.layers[0].mlp.up_table.weight.detach()
    assert torch.equal(mapped.stem_placement.read_range(0, 5, 17), table[5:17])  # one read, the mapped rows
    assert torch.equal(mapped.stem_placement.read_rows(0, torch.tensor([16, 5])), table[[16, 5]])


def test_device_map_auto_leaves_placed_tables_where_they_are(stem_dir, ids):
    memory, mapped = load(stem_dir, "memory"), load(stem_dir, "mmap", device_map="auto")
    assert mapped.stem_tables == "mmap" and mapped.get_memory_footprint() < memory.get_memory_footprint()
    with torch.no_grad():
        torch.testing.assert_close(mapped(ids).logits, memory(ids).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_layers_offloaded_by_accelerate_read_the_right_rows(stem_dir, tmp_path, placement, host_on_cpu, ids):
    """accelerate keeps an offloaded layer's weights off its module (on the meta device) and brings
    them in for its forward; the rows must follow the execution device, not the parameters."""
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    memory = load(stem_dir, "memory")
    offloaded = load(stem_dir, placement, device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert offloaded.model.layers[2].mlp.gate_proj.weight.device.type == "meta"
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, memory(ids).logits, rtol=1e-6, atol=1e-6)


def test_mmap_model_trains_its_dense_parts_with_checkpointing(stem_dir, ids):
    memory, mapped = load(stem_dir, "memory"), load(stem_dir, "mmap")
    memory.model.layers[0].mlp.up_table.weight.requires_grad_(False)
    memory.model.layers[2].mlp.up_table.weight.requires_grad_(False)
    for m in (memory, mapped):
        m.train()
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()  # renamed in 5.24
        m.config.use_cache = False
        m(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in memory.named_parameters() if p.grad is not None}
    for name, p in mapped.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("threads, lookahead", [(0, 8), (4, 1), (16, 8)])
def test_mmap_reads_ahead_on_threads_and_gives_the_rows_of_memory(tmp_path, monkeypatch, threads, lookahead):
    from stem_upcycle.modeling import stem_tables

    monkeypatch.setattr(stem_tables, "READ_THREADS", threads)  # 0: every read in the forward's thread
    monkeypatch.setattr(stem_tables, "LOOKAHEAD_LAYERS", lookahead)
    monkeypatch.setattr(stem_tables, "MIN_ROWS_PER_READ_TASK", 2)  # several read tasks per layer
    tiny_stem("llama", layers=(0, 1, 2)).save_pretrained(tmp_path / "m", max_shard_size="40KB")
    memory, mapped = load(tmp_path / "m", "memory"), load(tmp_path / "m", "mmap")
    assert (mapped.stem_placement.pool() is None) == (threads == 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for length in (64, 1, 17):
            x = torch.randint(0, VOCAB, (2, length))
            torch.testing.assert_close(mapped(x).logits, memory(x).logits, rtol=1e-6, atol=1e-6)
    assert getattr(mapped.stem_placement._local, "prefetch", None) is None  # nothing in flight between forwards


def test_a_process_forked_after_a_forward_reads_rows_with_threads_of_its_own(stem_dir):
    import multiprocessing

    ids = torch.arange(VOCAB).flip(0)[None]  # more distinct ids than a read in the forward's thread takes
    memory, mapped = load(stem_dir, "memory"), load(stem_dir, "mmap")
    with torch.no_grad():
        expected = memory(ids).logits
        mapped(ids)  # the parent's reading threads exist now: a forked child has none of them
    parent = mapped.stem_placement.pool()

    def child(queue):
        torch.set_num_threads(1)  # as a data loader's worker does
        with torch.no_grad():
            same = torch.allclose(mapped(ids).logits, expected, rtol=1e-6, atol=1e-6)
        queue.put((same, mapped.stem_placement.pool() is not parent))

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue,))
    process.start()
    process.join(60)
    process.kill()
    assert process.exitcode == 0 and queue.get(timeout=5) == (True, True)
    assert mapped.stem_placement.pool() is parent


def test_mmap_reads_a_run_of_consecutive_rows_at_once_and_shadows_rows_set_later(stem_dir, monkeypatch):
    import os

    from stem_upcycle.modeling import table_files

    memory, mapped = load(stem_dir, "memory"), load(stem_dir, "mmap")
    reads, preadv = [], os.preadv
    monkeypatch.setattr(table_files.os, "preadv", lambda *a: reads.append(a) or preadv(*a))
    ids = torch.tensor([3, 4, 5, 9, 10, 2, 40])  # runs 3-5, 9-10, 2, 40
    torch.testing.assert_close(mapped.stem_table_rows(2, ids), memory.stem_table_rows(2, ids))
    assert len(reads) == 4
    mapped.stem_placement.set_rows(2, torch.tensor([9, 2, 9]), torch.arange(3.0)[:, None].expand(3, 48))
    mapped.stem_placement.set_rows(2, torch.tensor([40]), torch.full((1, 48), 7.0))
    rows = mapped.stem_table_rows(2, ids)
    assert rows[:, 0].tolist()[3:] == [2.0, memory.stem_table_rows(2, ids)[4, 0].item(), 1.0, 7.0]  # 9: the later


@pytest.mark.parametrize("count", [5, 65])  # at most ROWS_AT_ONCE (64) lookups, and more
def test_the_per_layer_op_reads_every_layers_rows_at_the_first_layer_of_a_small_lookup(stem_dir, count):
    """The `placed_rows` op called layer by layer (as vLLM's graphs, whose token count is dynamic, call it): a lookup
    of at most ROWS_AT_ONCE ids reads every layer's rows at the first layer, the next layer takes its own from
    them; another lookup, or the next forward's first layer, reads again, so rows set in between are seen."""
    from stem_upcycle.modeling.stem_tables import placed_rows

    memory, mapped = load(stem_dir, "memory"), load(stem_dir, "mmap")
    placement = mapped.stem_placement
    reads, read_all = [], placement.rows_of_layers
    placement.rows_of_layers = lambda *args: reads.append(1) or read_all(*args)

    def op(layer, ids):
        return placed_rows(ids, placement.stem_handle, layer, 48, torch.float32)

    ids = torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(0))
    for layer in (0, 2):  # a forward
        torch.testing.assert_close(op(layer, ids), memory.stem_table_rows(layer, ids), rtol=0, atol=0)
    assert len(reads) == (1 if count <= 64 else 0)
    placement.set_rows(2, ids[:1], torch.full((1, 48), 7.0))  # between forwards of the same ids
    assert op(0, ids).shape == (count, 48) and op(2, ids)[0].eq(7.0).all()
    other = ids.flip(0)  # a layer's lookup of other ids than those read at once
    torch.testing.assert_close(op(2, other)[:-1], memory.stem_table_rows(2, other)[:-1], rtol=0, atol=0)


def test_mmap_asks_the_kernel_for_every_stem_layers_rows_at_forward_start(stem_dir, monkeypatch):
    import os

    from stem_upcycle.modeling import stem_tables, table_files

    monkeypatch.setattr(stem_tables, "MIN_ROWS_PER_READ_TASK", 2)
    monkeypatch.setattr(stem_tables, "LOOKAHEAD_LAYERS", 1)  # the advice runs ahead of the reads
    mapped = load(stem_dir, "mmap")
    advised, fadvise = [], os.posix_fadvise
    monkeypatch.setattr(table_files.os, "posix_fadvise",
                        lambda fd, offset, length, advice: advised.append((offset, length, advice))
                        or fadvise(fd, offset, length, advice))
    ids = torch.tensor([[7, 3, 4, 5, 9, 10, 2, 40, 3]])  # distinct, sorted: runs 2-5, 7, 9-10, 40
    with torch.no_grad():
        mapped(ids)
    expected, placement = set(), mapped.stem_placement
    for layer, table in placement.stored.items():
        where = table.parts["weight"]
        expected |= {(where.offset + first * where.row_bytes, count * where.row_bytes, os.POSIX_FADV_WILLNEED)
                     for first, count in ((2, 4), (7, 1), (9, 2), (40, 1))}
        up = placement.first_token_up[layer][0]  # the first token's up-projection, left in the files: all of it
        expected.add((up.offset, up.nbytes, os.POSIX_FADV_WILLNEED))
    assert len(placement.stored) > 1 and sorted(advised) == sorted(expected)
    advised.clear()
    with torch.no_grad():
        mapped(ids[:, :1])  # a decode step's rows: read in the forward's thread, no advice
    assert advised == []


def test_a_forward_whose_read_fails_leaves_no_read_in_flight(stem_dir, monkeypatch, ids):
    import time

    from stem_upcycle.modeling import stem_tables

    monkeypatch.setattr(stem_tables, "MIN_ROWS_PER_READ_TASK", 2)  # several reads in flight
    memory, mapped = load(stem_dir, "memory"), load(stem_dir, "mmap")
    read_rows, lock, calls, finished = stem_tables.read_rows, threading.Lock(), [], []

    def failing(fd, table, ids_, out):
        with lock:
            calls.append(1)
            first = len(calls) == 1
        if first:
            raise OSError(5, "Input/output error")
        time.sleep(0.1)  # still reading when the forward fails
        read_rows(fd, table, ids_, out)
        finished.append(1)

    monkeypatch.setattr(stem_tables, "read_rows", failing)
    with pytest.raises(OSError, match="Input/output error"), torch.no_grad():
        mapped(ids)
    assert len(calls) > 2 and len(finished) == len(calls) - 1  # every read started had ended when it raised
    time.sleep(0.3)
    assert len(finished) == len(calls) - 1  # and none started after
    monkeypatch.setattr(stem_tables, "read_rows", read_rows)
    with torch.no_grad():  # the next forward of the thread starts clean
        torch.testing.assert_close(mapped(ids).logits, memory(ids).logits, rtol=1e-6, atol=1e-6)


def test_a_row_read_past_the_end_of_its_file_is_a_one_line_error(tmp_path):
    import os

    from stem_upcycle.modeling.table_files import TableFile, read_rows

    path = tmp_path / "cut.safetensors"
    path.write_bytes(bytes(100))  # a file cut short after the model loaded: 5 rows of 20 bytes where 10 were
    table, out = TableFile(str(path), 0, (10, 5), torch.float32), torch.empty(2, 5)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_rows(fd, table, torch.tensor([1, 4]), out)
        with pytest.raises(StemTablesError) as err:
            read_rows(fd, table, torch.tensor([1, 8]), out)
    finally:
        os.close(fd)
    assert "cut.safetensors ended while reading table rows" in one_line(err)


def test_a_read_the_kernel_returns_in_pieces_is_completed(stem_dir, monkeypatch):
    import os

    from stem_upcycle.modeling import table_files

    memory, mapped = load(stem_dir, "memory"), load(stem_dir, "mmap")
    preadv = os.preadv
    monkeypatch.setattr(table_files.os, "preadv", lambda fd, buffers, offset: preadv(fd, [buffers[0][:7]], offset))
    ids = torch.tensor([3, 4, 5, 40])  # as a read past 2 GB returns less than asked
    torch.testing.assert_close(mapped.stem_table_rows(2, ids), memory.stem_table_rows(2, ids))


def test_the_id_check_never_reads_ids_back_from_a_device():
    check_ids(torch.empty(4, dtype=torch.long, device="meta"), VOCAB)  # would raise if it read the values
    with pytest.raises(ValueError, match="must lie in"):
        check_ids(torch.tensor([VOCAB]), VOCAB)


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_placement_errors_are_one_line(stem_dir, tmp_path, ids):
    with pytest.raises(StemTablesError) as err:
        load(stem_dir, "disk")
    assert "use one of memory, mmap, host" in one_line(err)
    with pytest.raises(StemTablesError) as err:
        load(stem_dir, "host")
    assert "has none; use stem_tables='mmap'" in one_line(err)
    mapped = load(stem_dir, "mmap")
    with pytest.raises(StemTablesError) as err:
        mapped.model.layers[0].mlp.up_table.weight.requires_grad_()
    assert "stem_tables='memory'" in one_line(err)
    with pytest.raises(StemTablesError) as err:
        mapped.resize_token_embeddings(VOCAB + 4)
    assert "load the model with stem_tables='memory'" in one_line(err) and mapped.config.vocab_size == VOCAB
    with pytest.raises(StemTablesError) as err:
        mapped.save_pretrained(tmp_path / "copy")
    assert "stem_tables='memory' to save it" in one_line(err)
    assert not (tmp_path / "copy").exists()
    bin_dir = tmp_path / "bin"  # a checkpoint in PyTorch's pickle format: nothing to map
    model = tiny_stem()
    model.config.save_pretrained(bin_dir)
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    with pytest.raises(StemTablesError) as err:
        load(bin_dir, "mmap")
    assert "has none; load it with stem_tables='memory'" in one_line(err)
    assert load(bin_dir, None).stem_tables == "memory"  # the default falls back


def test_missing_or_truncated_table_files_are_one_line_errors(stem_dir):
    import json

    index = json.loads((stem_dir / "model.safetensors.index.json").read_text())
    shard = stem_dir / index["weight_map"]["model.layers.2.mlp.up_table.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(StemTablesError) as err:
        load(stem_dir, "mmap")
    assert "is truncated" in one_line(err) and shard.name in one_line(err)
    shard.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(StemTablesError) as err:
        load(stem_dir, "mmap")
    assert "truncated or not a safetensors file" in one_line(err)
    shard.unlink()
    with pytest.raises(StemTablesError) as err:
        load(stem_dir, "mmap")
    assert "is missing" in one_line(err)


def test_a_first_token_projection_missing_from_the_files_is_a_one_line_error(stem_dir):
    import json

    from safetensors.torch import load_file, save_file

    index = json.loads((stem_dir / "model.safetensors.index.json").read_text())
    name = "model.layers.2.mlp.up_proj.weight"
    shard = stem_dir / index["weight_map"][name]
    tensors = load_file(shard)
    save_file({**tensors, name: tensors[name][:, :-1].contiguous()}, shard, metadata={"format": "pt"})
    with pytest.raises(StemTablesError) as err:
        load(stem_dir, "mmap")
    assert name in one_line(err) and "F32 tensor of shape [48, 31]" in one_line(err) and "[48, 32]" in one_line(err)
    save_file({k: v for k, v in tensors.items() if k != name}, shard, metadata={"format": "pt"})
    with pytest.raises(StemTablesError) as err:
        load(stem_dir, "mmap")
    assert f"does not hold {name}" in one_line(err)
