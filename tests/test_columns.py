"""Tables for some of a layer's neurons (`convert --columns`): the mechanism is exact before any quality figure.

The neurons' order alone gives the parent; table columns that hold the parent's up-projection for an input give
the parent on it; whole-layer checkpoints written before this change load with their logits; every placement,
table format and layout serves a share strictly between 0 and 1 where stem-upcycle cannot be imported.
"""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from stem_upcycle.cli import main
from stem_upcycle.modeling.modeling_stem import StemMLP
from stem_upcycle.neurons import ColumnSpecError, NeuronSplit, choose_columns, parse_columns, split_projections
from stem_upcycle.source import open_source

from .conftest import (VOCAB, export_stem, markov_text, run_without_stem_upcycle, save_tiny_tokenizer, tiny_dense,
                       tiny_stem)

D_FF = 48  # the tiny models' intermediate size


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def load(path, placement="memory", **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, stem_tables=placement, **kwargs).eval()


@pytest.fixture
def calib_dense(dense_dir, tmp_path):
    """A tiny dense llama with a tokenizer, and calibration text for it."""
    model, path = dense_dir("llama")
    save_tiny_tokenizer(path)
    (tmp_path / "calib.txt").write_text(markov_text(6000, 0))
    return model, path, tmp_path / "calib.txt"


def convert(src, calib, out, *extra):
    result = run("convert", src, out, "--layers", "all", "--init", "calib", "--calib-data", calib,
                 "--calib-seq-len", 32, "--quiet", *extra)
    assert result.exit_code == 0, result.output
    return out


# --- choosing columns ------------------------------------------------------------------------------------------


def test_columns_parse_and_each_form_gives_its_counts():
    assert parse_columns("all").whole and parse_columns("1/1").whole
    assert parse_columns("1/3").share == pytest.approx(1 / 3) and not parse_columns("1/3").spread
    assert parse_columns("auto:1/2").spread and parse_columns("512").count == 512
    for bad in ("0/3", "4/3", "third", "auto:2/0", "0"):
        with pytest.raises(ColumnSpecError, match="--columns"):
            parse_columns(bad)
    costs = {0: torch.arange(48.0), 1: torch.arange(48.0).flip(0), 2: torch.full((48,), 100.0)}
    share = choose_columns(parse_columns("1/3"), costs, step=8)
    assert {layer: s.columns for layer, s in share.items()} == {0: 16, 1: 16, 2: 16}
    assert share[0].table.tolist() == list(range(16)) and share[1].table.tolist() == list(range(32, 48))
    assert share[0].rest.tolist() == list(range(16, 48))  # each part in the parent's order
    assert {s.columns for s in choose_columns(parse_columns("24"), costs, step=8).values()} == {24}
    # over all layers: the cheapest 48 of 144 lie in layers 0 and 1; layer 2 gets none and stays dense
    spread = choose_columns(parse_columns("auto:1/3"), costs, step=8)
    assert sorted(spread) == [0, 1] and sum(s.columns for s in spread.values()) == 48
    assert all(s.columns % 8 == 0 for s in spread.values())
    with pytest.raises(ColumnSpecError, match="at most"):
        choose_columns(parse_columns("64"), costs, step=8)


def test_narrow_tables_lie_in_groups_of_as_many_columns_as_whole_ones():
    """convert's default groups: the columns of 5 whole tables a group, so that a token's rows of a third of every
    layer's neurons are read in as many reads as those of a third of the layers whole."""
    from stem_upcycle.convert import groups_of_columns

    thirds = groups_of_columns(list(range(30)), {layer: 512 for layer in range(30)}, 5 * 1536)
    assert thirds == [list(range(15)), list(range(15, 30))]
    whole = groups_of_columns(list(range(0, 30, 3)), {layer: 1536 for layer in range(0, 30, 3)}, 5 * 1536)
    assert whole == [[0, 3, 6, 9, 12], [15, 18, 21, 24, 27]]
    mixed = groups_of_columns([0, 1, 2, 3], {0: 1024, 1: 512, 2: 2048, 3: 256}, 2048)
    assert mixed == [[0, 1], [2], [3]]  # a table as wide as the budget alone is a group of its own
    assert groups_of_columns([0, 1], {0: 1536, 1: 1536}, 1536) is None  # a tensor per table


def test_a_split_orders_gate_up_and_down_alike_and_leaves_the_mlp_unchanged():
    torch.manual_seed(0)
    weights = {"gate": torch.randn(D_FF, 8), "gate_bias": torch.randn(D_FF), "up": torch.randn(D_FF, 8),
               "up_bias": torch.randn(D_FF), "down": torch.randn(8, D_FF)}
    split = NeuronSplit.cheapest(torch.randn(D_FF), 16)
    w = split_projections(weights, split)
    x = torch.randn(5, 8)

    def mlp(gate, gate_bias, up, up_bias, down):
        return torch.nn.functional.linear(torch.nn.functional.silu(x @ gate.T + gate_bias) * (x @ up.T + up_bias), down)

    up = torch.cat([w["up"], w["up_rest"]])
    up_bias = torch.cat([w["up_bias"], w["up_rest_bias"]])
    torch.testing.assert_close(mlp(w["gate"], w["gate_bias"], up, up_bias, w["down"]), mlp(**weights))
    assert sorted(split.order.tolist()) == list(range(D_FF))


# --- converted models are exact where they should be ---------------------------------------------------------------


def test_convert_writes_the_split_and_the_neurons_order_alone_gives_the_parents_logits(calib_dense, tmp_path, ids,
                                                                                       monkeypatch):
    """Every layer with a third of its neurons as table columns: tensors reordered, shapes of the split; with the
    table columns given their dense up-projection (the first token's `up_proj`) the model is its parent."""
    dense, src, calib = calib_dense
    out = convert(src, calib, tmp_path / "stem", "--columns", "1/3")
    config = json.loads((out / "config.json").read_text())
    assert config["stem_layers"] == [0, 1, 2] and config["stem_table_columns"] == {"0": 16, "1": 16, "2": 16}
    assert config["stem_table_groups"] == [[0, 1, 2]]  # as many columns as whole tables of 5 layers hold, at most
    stem, parent = open_source(str(out)).tensors, dense.state_dict()
    for layer in range(3):
        order = stem.get(f"model.layers.{layer}.mlp.neuron_order")
        assert sorted(order.tolist()) == list(range(D_FF))
        prefix, up = f"model.layers.{layer}.mlp.", parent[f"model.layers.{layer}.mlp.up_proj.weight"]
        assert torch.equal(stem.get(prefix + "gate_proj.weight"), parent[prefix + "gate_proj.weight"][order])
        assert torch.equal(stem.get(prefix + "down_proj.weight"), parent[prefix + "down_proj.weight"][:, order])
        assert torch.equal(stem.get(prefix + "up_proj.weight"), up[order[:16]])  # the first token's, table columns
        assert torch.equal(stem.get(prefix + "up_rest.weight"), up[order[16:]])
    assert any(stem.shape(n) == (VOCAB, 48) for n in stem.names() if "stem_table_groups" in n)  # 3 layers x 16
    monkeypatch.setattr(StemMLP, "table_up", lambda self, x: self.up_proj(x))  # every token: dense table columns
    with torch.no_grad():
        for placement in ("memory", "mmap"):
            torch.testing.assert_close(load(out, placement)(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placement", ["memory", "mmap"])
def test_table_columns_holding_the_parents_up_projection_for_an_input_give_the_parent_on_it(calib_dense, tmp_path,
                                                                                           placement):
    """Rows set to the parent's up-projection of the table columns at each token of an input whose ids are
    distinct reproduce the parent's logits on that input, in every layer at once."""
    dense, src, calib = calib_dense
    out = convert(src, calib, tmp_path / "stem", "--columns", "1/3", "--first-token", "table")
    ids = torch.randperm(VOCAB)[None, :20]
    ups = {}
    hooks = [dense.model.layers[i].mlp.up_proj.register_forward_hook(
        lambda module, args, output, i=i: ups.__setitem__(i, output[0])) for i in range(3)]
    with torch.no_grad():
        expected = dense(ids).logits
    for hook in hooks:
        hook.remove()
    model = load(out, placement)
    for layer in range(3):
        table = model.model.layers[layer].mlp.neuron_order[:16]
        model.set_stem_table_rows(layer, ids[0], ups[layer][:, table])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_whole_layer_checkpoints_written_before_columns_load_with_their_logits(tmp_path):
    """A conversion written by stem-upcycle before per-neuron tables (tests/data, made at 1e5b8a9: no
    stem_table_columns, no up_rest) loads with the logits it gave then, through the package and remote code alone."""
    import shutil
    from pathlib import Path

    from stem_upcycle.convert import MODELING_DIR, MODELING_FILES

    folder = tmp_path / "before"
    shutil.copytree(Path(__file__).parent / "data" / "whole_layers_before_columns", folder)
    expected = load_file(folder / "expected.safetensors")
    assert "stem_table_columns" not in json.loads((folder / "config.json").read_text())
    with torch.no_grad():
        for placement in ("memory", "mmap"):
            torch.testing.assert_close(load(folder, placement)(expected["ids"]).logits, expected["logits"],
                                       rtol=0, atol=1e-6)
    for name in MODELING_FILES:  # the current modeling files, as a model exported before is told to take them
        shutil.copyfile(MODELING_DIR / name, folder / name)
    run_without_stem_upcycle("""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
        expected = load_file(sys.argv[1] + "/expected.safetensors")
        for placement in ("memory", "mmap"):
            model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, stem_tables=placement)
            assert type(model).__module__.startswith("transformers_modules")
            assert model.model.layers[0].mlp.up_rest is None
            with torch.no_grad():
                torch.testing.assert_close(model(expected["ids"]).logits, expected["logits"], rtol=0, atol=1e-6)
    """, folder)


def test_table_bytes_equal_whole_layers_at_the_same_share(calib_dense):
    """A third of every layer's neurons are as many numbers as one whole layer of three: the same table bytes, and
    a dry run plans them without measuring (the counts a real run gives, in no particular neurons)."""
    from stem_upcycle.convert import plan_conversion
    from stem_upcycle.table_init import InitOptions

    _, src, calib = calib_dense
    source = open_source(str(src))
    options = InitOptions(calib_data=[str(calib)], calib_seq_len=32)
    split = plan_conversion(source, layers="all", columns="1/3", init="calib", init_options=options, dry_run=True,
                            layer_groups=1)
    whole = plan_conversion(source, layers="1", layer_groups=1)
    assert split.table_bytes == whole.table_bytes == VOCAB * D_FF * 4
    assert split.config.stem_table_columns == {"0": 16, "1": 16, "2": 16} and not split.choice.measured
    assert "which neurons, the real run chooses" in split.describe()


def test_each_neurons_cost_is_its_output_error_on_windows_the_rows_never_saw(calib_dense, tmp_path, monkeypatch):
    """The cost that chooses the table columns: ||W_down[:, j]||^2 x the mean over the scoring windows' positions
    of (act(gate_j x) (up_j x - row_j[token]))^2, on calibration windows kept out of the rows, with rows as the
    conversion makes them, built here by hand: each token's gate-weighted mean over the other windows, shrunk (k 8)
    toward its parent row by brute force (a forward per context and token); the parent's completions of the
    ranking facts weigh `fact_weight` beside; the cheapest neurons of each layer become its table columns."""
    import stem_upcycle.table_init.mlp_inputs as mlp_inputs
    import stem_upcycle.table_init.row_choice as row_choice
    from stem_upcycle.convert import stem_config
    from stem_upcycle.families import family_for
    from stem_upcycle.table_init import InitOptions
    from stem_upcycle.table_init.calibrated import calibration_windows
    from stem_upcycle.table_init.layer_choice import fact_completions
    from stem_upcycle.table_init.parent_rows import ParentRowOptions, cut_contexts
    from stem_upcycle.table_init.row_choice import COLUMN_SCORING_WINDOWS, choose_rows, neuron_costs

    from .test_parent_rows import reference_rows

    dense, src, calib = calib_dense
    facts_file = tmp_path / "facts.jsonl"  # in the tiny tokenizer's words, of different lengths
    facts_file.write_text("\n".join(json.dumps({"prompt": " ".join(f"w{(7 * i + j) % 90}" for j in range(2 + i % 4)),
                                               "answers": [" ".join(f"w{(5 * i + j) % 90}" for j in range(1 + i % 3))]})
                                   for i in range(6)))
    monkeypatch.setattr(row_choice, "RANKING_FACTS", facts_file)
    source, family = open_source(str(src)), family_for("llama")
    config = stem_config(source.config, family, [0], "calib", torch.float32, False, True)
    parent = ParentRowOptions(contexts=2, reads=2)  # every token after both contexts: brute force is quick
    options = InitOptions(calib_data=[str(calib)], calib_seq_len=32, dense_model=dense, parent=parent, fact_weight=0)
    _, _, costs = neuron_costs(source, family, config, [0, 1, 2], "calib", options)
    _, _, with_facts = neuron_costs(source, family, config, [0, 1, 2], "calib",
                                    InitOptions(**{**options.__dict__, "fact_weight": 0.5}))
    windows = calibration_windows(source, options)
    scoring = torch.linspace(0, len(windows) - 1, COLUMN_SCORING_WINDOWS).round().long()
    rest = windows[[w for w in range(len(windows)) if w not in scoring.tolist()]]
    mlp = dense.model.layers[1].mlp

    def inputs_at(ids):  # layer 1's MLP inputs in the dense model
        got = []
        hook = mlp.register_forward_pre_hook(lambda m, args: got.append(args[0]))
        with torch.no_grad():
            dense(ids)
        hook.remove()
        return got[0]

    def cost(x, ids, rows):
        with torch.no_grad():
            error = torch.nn.functional.silu(mlp.gate_proj(x)) * (mlp.up_proj(x) - rows[ids])
        return mlp.down_proj.weight.square().sum(0) * error.square().mean(0)

    facts = fact_completions(AutoTokenizer.from_pretrained(src), facts_file)
    real = [(i, p) for i in range(len(facts.ids)) for p in range(1, int(facts.scored[i].nonzero().max()) + 2)]
    scored_ids = torch.cat([windows[scoring, 1:].flatten(), torch.tensor([int(facts.ids[i, p]) for i, p in real])])
    unique = scored_ids.unique()
    x, ids = inputs_at(rest)[:, 1:].flatten(0, 1), rest[:, 1:].flatten()  # the first position keeps W_up
    with torch.no_grad():
        w = torch.nn.functional.silu(mlp.gate_proj(x)).square()
        num = torch.zeros(VOCAB, D_FF).index_add_(0, ids, w * mlp.up_proj(x))
        den = torch.zeros(VOCAB, D_FF).index_add_(0, ids, w)
    n = torch.bincount(ids, minlength=VOCAB).float()[:, None]
    prior = torch.zeros(VOCAB, D_FF)
    prior[unique] = reference_rows(dense, family, [1], cut_contexts(rest, parent), unique)[1]  # the rows' contexts
    rows = (n * num / den.clamp_min(1e-12) + 8 * prior) / (n + 8)
    x = inputs_at(windows[scoring])[:, 1:].flatten(0, 1)
    expected = cost(x, windows[scoring, 1:].flatten(), rows)
    torch.testing.assert_close(costs[1], expected, rtol=1e-4, atol=1e-9)
    fact_inputs = inputs_at(facts.ids)
    fact_x = torch.stack([fact_inputs[i, p] for i, p in real])
    fact_cost = cost(fact_x, torch.tensor([int(facts.ids[i, p]) for i, p in real]), rows)
    torch.testing.assert_close(with_facts[1], costs[1] + 0.5 * fact_cost, rtol=1e-4, atol=1e-9)
    choice = choose_rows(source, family, config, "all", "1/3", "calib", options, step=8)
    for layer, split in choice.columns.items():  # the cheapest chosen
        assert set(split.table.tolist()) == set(costs[layer].topk(16, largest=False).indices.tolist())
    # inputs past the budget of one file: a group of layers a forward, the same costs, none kept for the rows
    monkeypatch.setattr(mlp_inputs, "MLP_INPUTS_BYTES", 1)
    kept, _, grouped = neuron_costs(source, family, config, [0, 1, 2], "calib", options)
    assert kept is None
    for layer in (0, 1, 2):
        torch.testing.assert_close(grouped[layer], costs[layer], rtol=1e-5, atol=1e-12)


# --- every path serves a share of the neurons -----------------------------------------------------------------

BLOCK = 16  # compressed tables' block: divides both layers' table columns (16 and 32)
PATHS = {  # placement, keywords, what runs: host's cache holding every row or too few (rows staged per forward)
    "memory": ("memory", {}), "mmap": ("mmap", {}), "host, staged": ("host", {"stem_cache_rows": 8}),
    "host, cached": ("host", {"stem_cache_rows": VOCAB}),
}


@pytest.fixture
def formats(tmp_path):
    """A tiny model whose layers 0 and 2 hold 16 and 32 of their 48 neurons as table columns, exported with float
    tables a tensor per table, then (`compress`) grouped side by side and compressed to int8, float8 and int4."""
    model = tiny_stem("llama", layers=(0, 2), columns={0: 16, 2: 32})
    folders = {"float32": export_stem(model, tmp_path / "float32")}
    for name, args in {"grouped": ["--layer-groups", 2, "--table-dtype", "float32"],
                       **{dtype: ["--table-dtype", dtype, "--table-block", BLOCK] for dtype in ("int8", "float8", "int4")}
                       }.items():
        result = run("compress", folders["float32"], tmp_path / name, *args, "--quiet", "--max-shard-size", "40KB")
        assert result.exit_code == 0, result.output
        folders[name] = tmp_path / name
    assert json.loads((folders["grouped"] / "config.json").read_text())["stem_table_groups"] == [[0, 2]]
    return model, folders


def test_every_placement_format_and_layout_serves_a_share_of_the_neurons_where_stem_upcycle_is_absent(formats,
                                                                                                     tmp_path):
    """Per layout and format, every placement and path (mmap's reads on the pool for a forward of 72 distinct ids
    and in the forward's thread for a decode step; host's rows staged or cached) gives the logits of `memory`, and
    greedy decoding its tokens, in a process where stem_upcycle cannot be imported; float tables give the logits
    of the package's model, and compressed ones come within their error of them."""
    model, folders = formats
    wide = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:72].view(2, 36)  # 72 distinct ids
    with torch.no_grad():
        expected = model(wide).logits
    torch.save({"ids": wide, "logits": expected}, tmp_path / "data.pt")
    out = run_without_stem_upcycle("""
        import json, sys
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        paths, data = json.loads(sys.argv[1]), torch.load(sys.argv[2])
        ids, step = data["ids"], data["ids"][:, -1:]
        torch.accelerator.is_available = lambda: True  # `host` runs with the CPU as its device
        for name, path in paths.items():
            def load(placement, **kwargs):
                return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, stem_tables=placement,
                                                            **kwargs).eval()
            memory = load("memory")
            assert [memory.model.layers[i].mlp.up_rest.out_features for i in (0, 2)] == [32, 16]
            with torch.no_grad():
                reference = memory(ids).logits, memory(step).logits
                greedy = memory.generate(ids[:1, :8], max_new_tokens=6, do_sample=False, pad_token_id=0)
                error = (reference[0] - data["logits"]).abs().max().item()
                assert error < (1e-6 if name in ("float32", "grouped") else 0.2), (name, error)
                for path_name, (placement, kwargs) in json.loads(sys.argv[3]).items():
                    placed = load(placement, **kwargs)
                    for _ in range(2):  # the second time from the host's cache where it holds the rows
                        torch.testing.assert_close(placed(ids).logits, reference[0], rtol=0, atol=1e-6)
                    torch.testing.assert_close(placed(step).logits, reference[1], rtol=0, atol=1e-6)
                    assert torch.equal(placed.generate(ids[:1, :8], max_new_tokens=6, do_sample=False,
                                                       pad_token_id=0), greedy), (name, path_name)
                    if placement == "host":
                        stats = placed.stem_placement.stats
                        assert (stats["staged"] > 0) == (path_name == "host, staged"), (path_name, stats)
            print(name, "ok")
    """, json.dumps({name: str(path) for name, path in folders.items()}), tmp_path / "data.pt", json.dumps(PATHS))
    assert out.splitlines() == [f"{name} ok" for name in folders]


def test_edit_inspect_and_train_plan_read_the_table_columns(formats, tmp_path):
    """A persistent edit swaps k-wide rows and its undo restores every byte; inspect names the table columns and
    counts the FLOPs of the up-projection that remain; train --plan sizes the tables by their columns."""
    import hashlib

    model, folders = formats
    save_tiny_tokenizer(folders["float32"])
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folders["float32"].iterdir() if p.is_file()}
    result = run("edit", folders["float32"], "--swap", "w5=w9", "--output", tmp_path / "edited")
    assert result.exit_code == 0, result.output
    edited = load(tmp_path / "edited")
    for layer, k in ((0, 16), (2, 32)):
        rows = edited.stem_table_rows(layer, torch.tensor([5, 9]))
        assert rows.shape == (2, k) and torch.equal(rows[0], model.stem_table_rows(layer, torch.tensor([9]))[0])
    assert run("edit", tmp_path / "edited", "--undo").exit_code == 0
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "edited").iterdir()
            if p.is_file() and p.name in digest} == digest
    inspect = run("inspect", folders["float32"], "--json")
    summary = json.loads(inspect.output)
    assert summary["table_columns"] == {"0": 16, "2": 32}
    d, d_ff, layers = 32, 48, 3
    assert summary["ffn_flops_per_token"] == 2 * 3 * d * d_ff * layers - 2 * d * (16 + 32)
    assert "16-32 of 48 neurons a layer" in run("inspect", folders["float32"]).output
    (tmp_path / "text.txt").write_text(markov_text(600, 2))
    tiny_dense("llama").save_pretrained(tmp_path / "dense")  # the random parent tiny_stem's model came from
    spread = run("inspect", folders["float32"], "--tables", "--reference", tmp_path / "dense", "--text",
                 tmp_path / "text.txt", "--sample", 64, "--json")
    assert spread.exit_code == 0, spread.output
    assert sorted(json.loads(spread.stdout)["dense_up"]["layers"]) == ["0", "2"]
    from stem_upcycle.table_stats import table_neurons  # whose W_up outputs the dense spread is taken of

    assert {layer: n.tolist() for layer, n in table_neurons(open_source(str(folders["float32"])), [0, 2]).items()} \
        == {0: list(range(16)), 2: list(range(32))}  # tiny_stem's neuron_order: the parent's order
    nearest = run("inspect", folders["float32"], "--nearest", "w5", "--layer", 2, "--top", 3)
    assert nearest.exit_code == 0 and "w5" in nearest.output, nearest.output
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: {tmp_path / 'dense'}, init_from: {folders['float32']}}}\n"
                      f"data: {{train: [{recipe}]}}\n")
    plan = run("train", recipe, "--output", tmp_path / "t", "--plan")
    assert plan.exit_code == 0, plan.output
    assert "2 x [96, k], 48 columns in all" in plan.output
    # converting model.source: the tables of a third of every layer's neurons, planned without measuring them
    recipe.write_text(f"model: {{source: {tmp_path / 'dense'}, layers: all, columns: 1/3}}\n"
                      f"data: {{train: [{recipe}]}}\n")
    plan = run("train", recipe, "--output", tmp_path / "t", "--plan")
    assert plan.exit_code == 0, plan.output
    assert "tables [96, k: 48 columns in all]" in plan.output and "3 x [96, k], 48 columns in all" in plan.output


def test_a_recipe_names_its_columns_and_a_bad_one_is_one_line(tmp_path):
    from stem_upcycle.training.recipe import RecipeError, load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {source: smollm2-135m, layers: all, columns: 1/3}\ndata: {train: [a.txt]}\n")
    assert load_recipe(recipe).model.columns == "1/3"
    with pytest.raises(RecipeError, match="model.columns: --columns 'third' is not understood"):
        load_recipe(recipe, ["model.columns=third"])
    with pytest.raises(RecipeError, match="set model.init: calib"):
        load_recipe(recipe, ["model.init=closed-form"])


def test_bad_columns_are_one_line_before_anything_is_computed(calib_dense, tmp_path, monkeypatch):
    """Refused before the dense model loads (the loader refuses to run here) and nothing is written."""
    import stem_upcycle.loading

    _, src, calib = calib_dense
    monkeypatch.setattr(stem_upcycle.loading, "model_from_source", lambda *a, **k: pytest.fail("the model loaded"))
    out = tmp_path / "out"
    cases = {("--columns", "third", "--init", "calib", "--calib-data", calib): "--columns 'third' is not understood",
             ("--columns", "1/3", "--init", "closed-form"): "use --init calib (or calib-mean)",
             ("--columns", "1/3", "--init", "closed-form", "--dry-run"): "use --init calib (or calib-mean)",
             ("--columns", "64", "--init", "calib", "--calib-data", calib): "a layer has 48 intermediate neurons",
             ("--columns", "auto:1/1000", "--init", "calib", "--calib-data", calib): "gives no layer a table column"}
    for args, message in cases.items():
        result = run("convert", src, out, "--layers", "all", *args)
        assert result.exit_code == 1 and message in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1 and not out.exists()
