"""Recovery text named by Hugging Face dataset id (`hf:ORG/NAME[/GLOB][@REVISION]`): from a Hub served locally
(`hub_server.py`; nothing reaches the internet), only the files a run's tokens need, then from the cache with no
request, offline too; every failure one line with nothing half-written; mixtures drawn by weight, exactly on resume."""

import gzip
import os
import json
import shutil

import huggingface_hub.constants
import pytest
import torch

from stem_upcycle.documents import DataError
from stem_upcycle.training.data import Batches, Mixture, MixedBatches, fetch_datasets, resolve_datasets, text_needs
from stem_upcycle.training.recipe import RecipeError, load_recipe

from .conftest import crashing_at, markov_text, run_without_stem_upcycle
from .test_hub_download import fails, hub, run, save_dense  # noqa: F401 (hub: a fixture)

DATASET = "someorg/web-text"
SHARDS = [f"sample/10BT/00{i}_00000.parquet" for i in range(4)]
WORDS_PER_DOC, DOCS_PER_SHARD = 60, 40  # 2,440 tokens a shard (a word a token, and an EOS after each document)


@pytest.fixture(autouse=True)
def _private_records(tmp_path, monkeypatch):
    """Each test's own stem-upcycle cache: its Hub serves other files under the same commit as another test's."""
    monkeypatch.setenv("STEM_UPCYCLE_CACHE", str(tmp_path / "cache"))


def _parquet(path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), path, row_group_size=10)


@pytest.fixture
def dataset(tmp_path):
    """A dataset repository as FineWeb-Edu lays one out: a config's parquet shards under sample/10BT/, another
    config, a card; and a JSON-lines one (.jsonl.gz)."""
    folder = tmp_path / "dataset"
    for i, name in enumerate(SHARDS):
        _parquet(folder / name, [markov_text(WORDS_PER_DOC, 100 * i + d) for d in range(DOCS_PER_SHARD)])
    _parquet(folder / "data/CC-MAIN-2024-10/000.parquet", [markov_text(50, 7)])
    (folder / "README.md").write_text("---\nlicense: odc-by\n---\n# web text\n")
    return folder


def _recipe(tmp_path, train, steps=4, extra=""):
    (tmp_path / "heldout.txt").write_text(markov_text(400, 99))
    path = tmp_path / "recipe.yaml"
    path.write_text(f"""
model: {{source: {tmp_path / 'dense'}, layers: "0,2", init: closed-form}}
data: {{train: {json.dumps(train)}, eval: {{held: [{tmp_path / 'heldout.txt'}]}}, seq_len: 32, eval_tokens: 64}}
train: {{batch_size: 4, micro_batch_size: 4, steps: {steps}, eval_every: 0, warmup_steps: 1}}
{extra}""")
    return path


@pytest.fixture
def dense(tmp_path):
    save_dense(tmp_path / "dense")
    return tmp_path / "dense"


def _tokenizer(dense):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(dense)


def full_downloads(hub):
    """Files fetched whole (not the range requests of a sample)."""
    return {r.path.split("/resolve/", 1)[1].split("/", 1)[1] for r in hub.downloads()
            if "-" not in r.headers.get("Range", "-").removeprefix("bytes=").rstrip("-")}


def test_a_recipe_naming_a_dataset_fetches_only_the_shards_its_tokens_need_then_asks_nothing(hub, dataset, dense,
                                                                                            tmp_path, monkeypatch):
    hub.repos[f"datasets/{DATASET}"] = {"main": dataset}
    spec = f"hf:{DATASET}/sample/10BT/*.parquet"
    # 30 steps x 4 x 32 tokens, x 1.25: more than the first shard's estimate (3,743 tokens), less than two
    recipe_file = _recipe(tmp_path, [spec], steps=30)
    assert text_needs(load_recipe(recipe_file))[spec] == 30 * 4 * 32 + 1
    plan = run("train", recipe_file, "--output", tmp_path / "run", "--plan", "--quiet")
    assert plan.exit_code == 0, plan.output
    assert f"{spec}: {DATASET} at commit " in plan.output and "2 of 4 files" in plan.output, plan.output
    assert f"{SHARDS[0]}, {SHARDS[1]}" in plan.output and "token cache" in plan.output
    assert full_downloads(hub) == set()  # the plan fetched a sample of the first shard, by range requests

    result = run("train", recipe_file, "--output", tmp_path / "run", "--quiet")
    assert result.exit_code == 0, result.output
    assert full_downloads(hub) == set(SHARDS[:2])  # as the plan said; not the other config, not the card
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["stem_training_data"][0]["dataset"] == DATASET
    assert [name for name, _ in config["stem_training_data"][0]["files"]] == SHARDS[:2]
    card = (tmp_path / "run" / "README.md").read_text()
    assert f"[{DATASET}]" in card and "at commit `" + "0" * 40 + "` (2 of its 4 files matching" in card
    assert f"datasets:\n- {DATASET}" in card
    # the model, its config naming the dataset, loads and runs where stem-upcycle is not installed, as users load it
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 2, 3, 4]])
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "run", trust_remote_code=True)(ids).logits
    torch.save({"ids": ids, "logits": expected}, tmp_path / "expected.pt")
    run_without_stem_upcycle("""
        import torch
        from transformers import AutoModelForCausalLM
        expected = torch.load(sys.argv[1] + "/expected.pt")
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1] + "/run", trust_remote_code=True)
        assert model.config.stem_training_data[0]["dataset"] == "someorg/web-text"
        with torch.no_grad():
            torch.testing.assert_close(model(expected["ids"]).logits, expected["logits"], rtol=0, atol=1e-6)
    """, tmp_path)

    hub.requests.clear()  # a second run: the records and the cache answer
    assert run("train", recipe_file, "--output", tmp_path / "again", "--quiet").exit_code == 0
    assert hub.requests == []
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert run("train", recipe_file, "--output", tmp_path / "offline", "--quiet").exit_code == 0
    assert hub.requests == []


def test_jsonl_gz_files_are_read_as_json_lines_and_a_missing_field_names_those_there(hub, dense, tmp_path):
    folder = tmp_path / "jsonl-dataset"
    (folder / "data").mkdir(parents=True)
    for i in range(2):
        with gzip.open(folder / "data" / f"part-{i}.json.gz", "wt") as f:
            for d in range(30):
                f.write(json.dumps({"content": markov_text(50, 10 * i + d), "url": "x"}) + "\n")
    hub.repos["datasets/someorg/jsonl-text"] = {"main": folder}
    spec = "hf:someorg/jsonl-text"
    tokenizer = _tokenizer(dense)
    with pytest.raises(DataError, match=r"has no string field 'text' \(its fields: content, url\); set data.text_field"):
        resolve_datasets(load_recipe(_recipe(tmp_path, [spec])), tokenizer)
    recipe = load_recipe(_recipe(tmp_path, [spec]), ["data.text_field=content"])
    datasets = fetch_datasets(recipe, tokenizer, progress=False)
    assert [p.name for p in datasets[spec].paths] == ["part-0.json.gz"]
    folder = resolve_datasets(load_recipe(_recipe(tmp_path, [spec + "/data"]), ["data.text_field=content"]), tokenizer)
    assert [name for name, _ in folder[spec + "/data"].files] == ["data/part-0.json.gz"]  # a folder named, no wildcard
    from stem_upcycle.training.data import load_data

    train, _ = load_data(recipe, tokenizer, datasets=datasets)
    first = train.stream.read(0, 51).tolist()
    assert first == tokenizer(markov_text(50, 0), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    # the calibration reads the records' field too
    calibrated = ["--set", "data.text_field=content", "--set", "model.init=calib", "--set", "model.calib_tokens=1024",
                  "--set", "model.calib_seq_len=32", "--set", "model.parent_contexts=1"]
    result = run("train", _recipe(tmp_path, [spec]), "--output", tmp_path / "calibrated", "--quiet", *calibrated)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("case", ["gated", "no-match", "no-match-in-folder", "missing-repo", "missing-revision", "offline-empty", "disk",
                                  "unreachable"])
def test_each_dataset_failure_is_one_line_and_writes_nothing(hub, dataset, dense, tmp_path, monkeypatch, case):
    hub.repos[f"datasets/{DATASET}"] = {"main": dataset}
    spec, fragments = f"hf:{DATASET}/sample/10BT/*.parquet", []
    if case == "gated":
        hub.gated.add(f"datasets/{DATASET}")
        fragments = [f"{DATASET} is gated: accept its licence at {hub.url}/datasets/{DATASET}", "HF_TOKEN"]
    elif case == "no-match":
        spec = f"hf:{DATASET}/sample/350BT/*.parquet"
        fragments = ["matches no .parquet", "it has no folder sample/350BT", "fix the glob"]
    elif case == "no-match-in-folder":
        spec = f"hf:{DATASET}/sample/10BT/*.jsonl"
        fragments = ["matches no .parquet", f"its data files are e.g. {SHARDS[0]}", "fix the glob"]
    elif case == "missing-repo":
        spec, fragments = "hf:someorg/absent", ["someorg/absent is not a dataset repository on"]
    elif case == "missing-revision":
        spec, fragments = f"hf:{DATASET}@v9", [f"{DATASET} has no revision 'v9' (the @REVISION of hf:{DATASET}@v9)"]
    elif case == "offline-empty":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        fragments = ["HF_HUB_OFFLINE=1 forbids downloading", "run once online"]
    elif case == "disk":
        real = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
        fragments = ["not enough disk space: the download 0.00 GB", "and the token cache"]
    elif case == "unreachable":
        hub.failing = 500
        fragments = ["cannot reach the Hub: it answered 500 for someorg/web-text", "try again later"]
    line = fails(run("train", _recipe(tmp_path, [spec]), "--output", tmp_path / "run", "--quiet"), *fragments)
    assert "Traceback" not in line
    assert full_downloads(hub) == set() and not (tmp_path / "run").exists()


def test_a_download_cut_mid_file_resumes(hub, dataset, dense, tmp_path, monkeypatch):
    hub.repos[f"datasets/{DATASET}"] = {"main": dataset}
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 500)
    hub.cut_once[SHARDS[0]] = 1000
    recipe = load_recipe(_recipe(tmp_path, [f"hf:{DATASET}/sample/10BT/*.parquet"]))
    datasets = fetch_datasets(recipe, _tokenizer(dense), progress=False)
    gets = [r for r in hub.downloads() if r.path.endswith(SHARDS[0]) and r.headers.get("Range", "").endswith("-")
            or r.path.endswith(SHARDS[0]) and "Range" not in r.headers]
    assert [r.headers.get("Range") for r in gets] == [None, "bytes=1000-"]  # resumed where it was cut
    path = datasets[f"hf:{DATASET}/sample/10BT/*.parquet"].paths[0]
    assert path.read_bytes() == (dataset / SHARDS[0]).read_bytes()


def test_a_mixture_draws_each_source_by_weight_and_reads_the_same_sequences_after_a_resume():
    web, domain = torch.arange(4000).view(1000, 4), -torch.arange(1, 401).view(100, 4)
    mixture = Mixture([web, domain], [0.8, 0.2], count=10, seed=5)
    steps = [mixture.step(s) for s in range(300)]
    share = torch.cat(steps)[:, 0].lt(0).float().mean().item()
    assert abs(share - 0.2) < 0.02, share
    resumed = Mixture([web, domain], [0.8, 0.2], count=10, seed=5)
    assert all(torch.equal(resumed.step(s), steps[s]) for s in (299, 150, 151))  # a resume at any step
    seen = torch.cat(steps)[:, 0]
    domain_seen = seen[seen < 0]
    # each source reads its own order onward: no sequence of an epoch twice before all are read
    assert domain_seen[:100].unique().numel() == 100
    # a plain corpus reads what it read before this issue (one batch of Batches.step per step)
    plain = Batches(web, 8, seed=3)
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(3))
    assert torch.equal(plain.step(2), web[order[16:24]])
    assert MixedBatches([web, domain], None, 10, 0.0, 5, [0.8, 0.2]).step(299)[0].shape == (10, 4)


def test_weighted_entries_are_checked_when_the_recipe_is_read(tmp_path):
    (tmp_path / "dense").mkdir()
    cases = {
        "[{source: a.txt, weight: 0.8}, b.txt]": "mixes weighted and plain entries",
        "[{source: a.txt, weight: 0}]": "weight must be a number > 0",
        "[{source: a.txt, share: 1}]": "must have the keys source and weight",
        "[hf:nothing]": "data.train: 'hf:nothing' must look like hf:ORG/NAME",
    }
    for train, message in cases.items():
        path = tmp_path / "r.yaml"
        path.write_text(f"model: {{source: x}}\ndata: {{train: {train}, eval: [h.txt]}}\n")
        with pytest.raises(RecipeError, match=message):
            load_recipe(path)
    path.write_text("model: {source: x}\ndata: {train: [{source: a.txt, weight: 1}]}\n")
    with pytest.raises(RecipeError, match="name held-out sets in data.eval"):
        load_recipe(path)
    path.write_text("model: {source: x, calib_data: [{source: hf:o/n, weight: 1}]}\ndata: {train: [a.txt]}\n")
    with pytest.raises(RecipeError, match="model.calib_data entry .*weights belong to data.train entries"):
        load_recipe(path)


def test_a_mixture_of_a_dataset_and_local_text_trains_and_resumes_as_an_uninterrupted_run(hub, dataset, dense,
                                                                                          tmp_path, monkeypatch):
    from stem_upcycle.training.trainer import Trainer

    hub.repos[f"datasets/{DATASET}"] = {"main": dataset}
    (tmp_path / "domain.txt").write_text(markov_text(3000, 5))
    spec = f"hf:{DATASET}/sample/10BT/*.parquet"
    train = [{"source": spec, "weight": 0.75}, {"source": str(tmp_path / "domain.txt"), "weight": 0.25}]
    recipe_file = _recipe(tmp_path, train, steps=5)
    plan = run("train", recipe_file, "--output", tmp_path / "a", "--plan", "--quiet")
    assert f" 75.0%  {spec}: 481 tokens read" in plan.output and " 25.0%" in plan.output, plan.output
    recipe = load_recipe(recipe_file, ["train.checkpoint_every=2"])
    Trainer(recipe, tmp_path / "a", progress=False).run()
    uninterrupted = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]

    with crashing_at(monkeypatch, 3):
        Trainer(recipe, tmp_path / "b", progress=False).run()
    hub.requests.clear()
    hub.failing = 500  # the resume reads OUTPUT/datasets.json and the cache: it needs no Hub
    Trainer(recipe, tmp_path / "b", resume=True, progress=False).run()
    resumed = [json.loads(line) for line in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert [r.get("loss") for r in resumed] == [r.get("loss") for r in uninterrupted] and len(resumed) == 6
    assert hub.requests == []


# The Llama recipes' sizes scaled to tiny stand-ins: everything else is the recipe's own
TINY = ["model.calib_tokens=4096", "model.calib_seq_len=32", "data.seq_len=32", "data.eval_tokens=64",
        "generated.tokens=1024", "generated.length=32", "generated.batch_size=16", "train.steps=2",
        "train.batch_size=8", "train.micro_batch_size=2", "train.eval_every=0", "train.checkpoint_every=0",
        "local.batch_tokens=256"]


def test_the_llama_recipe_runs_its_first_steps_on_cpu_processes_with_its_datasets_fetched_once(hub, tmp_path):
    """recipes/llama-3.2-1b.yaml as written (its sources, datasets, columns, layer fit, sampled text), the model and
    the datasets tiny stand-ins served under their real names: planned, then run as two processes, whose first
    downloads each file once while the other waits."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    save_dense(tmp_path / "llama")
    hub.repos["meta-llama/Llama-3.2-1B"] = {"main": tmp_path / "llama"}
    web = tmp_path / "fineweb-edu"
    for i in range(3):
        _parquet(web / f"sample/10BT/00{i}_00000.parquet", [markov_text(60, 10 * i + d) for d in range(40)])
    hub.repos["datasets/HuggingFaceFW/fineweb-edu"] = {"main": web}
    (tmp_path / "c4" / "en").mkdir(parents=True)
    with gzip.open(tmp_path / "c4" / "en" / "c4-validation.00000-of-00008.json.gz", "wt") as f:
        f.writelines(json.dumps({"text": markov_text(40, 500 + d), "url": "u"}) + "\n" for d in range(20))
    hub.repos["datasets/allenai/c4"] = {"main": tmp_path / "c4"}
    _parquet(tmp_path / "wikitext" / "wikitext-103-raw-v1" / "test-00000-of-00001.parquet",
             [markov_text(40, 600 + d) for d in range(20)])
    hub.repos["datasets/Salesforce/wikitext"] = {"main": tmp_path / "wikitext"}
    recipe = root / "recipes" / "llama-3.2-1b.yaml"
    sets = [w for o in TINY for w in ("--set", o)]

    plan = run("train", recipe, "--output", tmp_path / "run", "--plan", "--quiet", *sets)
    assert plan.exit_code == 0, plan.output
    assert "hf:HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet: HuggingFaceFW/fineweb-edu at commit" in plan.output
    data = ["sample/10BT/000_00000.parquet", "en/c4-validation.00000-of-00008.json.gz",
            "wikitext-103-raw-v1/test-00000-of-00001.parquet"]
    assert "1 of 3 files" in plan.output and not full_downloads(hub) & set(data)  # samples only, by range requests
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "HF_ENDPOINT": hub.url,
           "HF_HUB_CACHE": huggingface_hub.constants.HF_HUB_CACHE, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "stem_upcycle.cli",
               "train", str(recipe), "--output", str(tmp_path / "run"), "--quiet", *sets]
    hub.requests.clear()
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    downloads = [r.path.rsplit("/resolve/", 1)[1].split("/", 1)[1] for r in hub.downloads() if "Range" not in r.headers]
    assert sorted(d for d in downloads if d in data) == sorted(data)  # each once: the second process read the cache
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert [d["dataset"] for d in config["stem_training_data"]] == ["HuggingFaceFW/fineweb-edu"]
    assert [d["dataset"] for d in config["stem_eval_data"]] == ["allenai/c4", "Salesforce/wikitext"]  # scored only
    assert config["stem_table_columns"]  # a share of every layer's neurons, as the recipe says


def test_convert_calibrates_on_a_dataset_fetched_as_far_as_its_share(hub, dataset, dense, tmp_path):
    hub.repos[f"datasets/{DATASET}"] = {"main": dataset}
    spec = f"hf:{DATASET}/sample/10BT/*.parquet"
    common = ["--layers", "0,2", "--columns", "all", "--calib-tokens", "2048", "--calib-seq-len", "32",
              "--parent-contexts", "1", "--quiet"]
    dry = run("convert", dense, tmp_path / "out", "--calib-data", spec, "--dry-run", *common)
    assert dry.exit_code == 0 and f"{spec}: {DATASET} at commit" in dry.output and "1 of 4 files" in dry.output, dry.output
    assert not full_downloads(hub) & set(SHARDS)
    result = run("convert", dense, tmp_path / "out", "--calib-data", spec, *common)
    assert result.exit_code == 0, result.output
    assert full_downloads(hub) == {SHARDS[0]}
    assert f"--calib-data '{spec}'" in (tmp_path / "out" / "README.md").read_text()  # the command as run
    refused = run("convert", dense, tmp_path / "other", "--calib-data", "hf:nothing", *common)
    assert refused.exit_code == 2 and "Invalid value for '--calib-data': 'hf:nothing' must look like hf:ORG/NAME" \
        in refused.output and not (tmp_path / "other").exists()


def test_a_gz_sample_counts_the_compressed_bytes_it_used_and_reads_a_long_first_record_whole(tmp_path):
    import io
    import random

    from stem_upcycle.hub_datasets import SAMPLE_BYTES, sample_documents

    rng = random.Random(0)
    lines = [json.dumps({"text": "x" * (SAMPLE_BYTES + 10)})]  # longer than the sample
    lines += [json.dumps({"text": " ".join(rng.choice(["w1", "w22", "w333"]) for _ in range(200))}) for _ in range(3000)]
    raw = ("\n".join(lines) + "\n").encode()
    packed = gzip.compress(raw)
    documents, disk = sample_documents(io.BytesIO(packed), "part.json.gz", "text", "part")
    assert documents[0] == "x" * (SAMPLE_BYTES + 10) and len(documents) > 1
    kept = sum(len(json.dumps({"text": d})) + 1 for d in documents)
    assert abs(disk / len(gzip.compress(raw[:kept])) - 1) < 0.05  # what those lines take compressed
    with pytest.raises(DataError, match="part is not a readable gzip file"):
        sample_documents(io.BytesIO(packed[:20] + b"\xff" * 200), "part.json.gz", "text", "part")
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(packed[:20] + b"\xff" * 200)
    from stem_upcycle.documents import plan_pieces

    with pytest.raises(DataError, match="bad.jsonl.gz is not a readable gzip file"):
        plan_pieces([bad])


def test_two_machines_caches_of_one_file_share_its_tokens_and_a_small_dataset_is_named_in_the_plan(
        hub, dataset, dense, tmp_path, monkeypatch):
    from stem_upcycle.training.tokens import tokenize_corpus

    hub.repos[f"datasets/{DATASET}"] = {"main": dataset}
    tokenizer = _tokenizer(dense)
    recipe = load_recipe(_recipe(tmp_path, [f"hf:{DATASET}/sample/10BT/*.parquet"], steps=200))  # more than it holds
    plan = run("train", _recipe(tmp_path, [f"hf:{DATASET}/sample/10BT/*.parquet"], steps=200), "--output",
               tmp_path / "run", "--plan", "--quiet")
    assert "4 of 4 files" in plan.output and "warning: " in plan.output and "read its sequences more than once" in plan.output, \
        plan.output[-1500:]
    first = fetch_datasets(recipe, tokenizer, progress=False)[f"hf:{DATASET}/sample/10BT/*.parquet"].paths
    folders = tokenize_corpus(first, tokenizer, "text", tmp_path / "tokens").folders
    other = tmp_path / "other-machine-cache"  # its own download, at another time
    shutil.copytree(huggingface_hub.constants.HF_HUB_CACHE, other, symlinks=True)
    for blob in other.rglob("blobs/*"):
        os.utime(blob, (1, 1))
    copies = [other / p.relative_to(huggingface_hub.constants.HF_HUB_CACHE) for p in first]
    assert tokenize_corpus(copies, tokenizer, "text", tmp_path / "tokens").folders == folders


def test_eval_scores_a_dataset_fetched_as_far_as_its_tokens(hub, dataset, dense, tmp_path):
    hub.repos[f"datasets/{DATASET}"] = {"main": dataset}
    spec = f"hf:{DATASET}/sample/10BT/*.parquet"
    result = run("eval", dense, "--data", f"web={spec}", "--data", spec, "--max-tokens", "256", "--window", "32",
                 "--json", "--quiet")
    assert result.exit_code == 0, result.output
    scored = json.loads(result.stdout.strip().splitlines()[-1])["sets"]
    assert set(scored) == {"web", "web-text"} and scored["web"] == scored["web-text"]  # named, or after the repository
    assert scored["web"]["tokens"] == 8 * 31 and full_downloads(hub) == {SHARDS[0]}
    fails(run("eval", dense, "--data", "hf:nothing", "--quiet"), "must look like hf:ORG/NAME")
