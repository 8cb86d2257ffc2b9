"""Checkpoints named by hub id are downloaded, as `from_pretrained` downloads them: from a Hub served locally
(`hub_server.py`; nothing reaches the internet) into an empty Hugging Face cache, only the files a conversion
reads, then from the cache, offline too; every failure one line, and nothing in OUT unless the model is whole."""

import errno
import json
import os
import subprocess
import sys

import huggingface_hub.constants
import pytest
import torch
from click.testing import CliRunner

from stem_upcycle.cli import main

from .conftest import markov_text, save_tiny_tokenizer, tiny_dense
from .hub_server import COMMIT, LocalHub, commit_of

REPO = "someorg/tiny-llama"
# What a conversion reads of the repository: the rest (other formats, `original/`, the licence) stays on the Hub.
READ = {"config.json", "generation_config.json", "README.md", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja", "model.safetensors.index.json"}


def save_dense(folder, seed=0, **save):
    dense = tiny_dense("llama", seed=seed)
    dense.save_pretrained(folder, **save)
    save_tiny_tokenizer(folder)
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    return dense


@pytest.fixture
def repo(tmp_path):
    """A sharded safetensors checkpoint with what a Hub repository holds besides: a .bin copy, a .gguf, the
    `original/` weights and a licence file."""
    folder = tmp_path / "repo"
    save_dense(folder, max_shard_size="20KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 5000)
    (folder / "tiny.Q4_0.gguf").write_bytes(b"\0" * 5000)
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.00.pth").write_bytes(b"\0" * 5000)
    (folder / "LICENSE.txt").write_text("licence")
    return folder


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A LocalHub (repositories added by the test) that huggingface_hub talks to, an empty cache, no token."""
    server = LocalHub({})
    constants = huggingface_hub.constants
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield server
    server.close()


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def convert(*args):  # the closed-form init: what is tested here is what is fetched, not the rows
    result = run("convert", *args, "--layers", "0,2", "--init", "closed-form", "--quiet")
    assert result.exit_code == 0, result.output
    return result


def fails(result, *fragments):
    """One line of error, with each fragment in it, and no traceback."""
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error: ") and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in line, line
    return line


def same_model(a, b):
    """Two converted folders hold the same weights and tokenizer byte for byte, and the same config but for
    where the parent came from."""
    files = sorted(p.name for p in a.iterdir() if p.suffix == ".safetensors" or p.name.startswith("tokenizer"))
    assert files == sorted(p.name for p in b.iterdir() if p.suffix == ".safetensors" or p.name.startswith("tokenizer"))
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    configs = [json.loads((f / "config.json").read_text()) for f in (a, b)]
    for config in configs:
        config.pop("stem_base_model", None), config.pop("stem_base_revision", None)
    assert configs[0] == configs[1]


def test_a_sharded_model_converts_by_id_as_its_folder_does_then_from_the_cache_then_offline(hub, repo, tmp_path,
                                                                                          monkeypatch):
    hub.repos[REPO] = {"main": repo}
    convert(repo, tmp_path / "from-folder")
    result = convert(REPO, tmp_path / "from-hub")
    assert "Fetching" not in result.output  # --quiet: no download bars (test_the_installed_command... sees them)
    assert f"source     {REPO} at commit {COMMIT[:12]} (llama" in result.output
    same_model(tmp_path / "from-hub", tmp_path / "from-folder")
    shards = {p.name for p in repo.glob("*.safetensors")}
    assert hub.fetched() == READ | shards  # nothing else: not the .bin, the .gguf, original/ or the licence
    config = json.loads((tmp_path / "from-hub" / "config.json").read_text())
    assert (config["stem_base_model"], config["stem_base_revision"]) == (REPO, COMMIT)
    assert f"at commit `{COMMIT}` of [{REPO}]" in (tmp_path / "from-hub" / "README.md").read_text()
    assert "license: apache-2.0" in (tmp_path / "from-hub" / "README.md").read_text()

    hub.requests.clear()
    convert(REPO, tmp_path / "again")
    assert hub.downloads() == []  # the cache answers; only the revision's info is asked
    same_model(tmp_path / "again", tmp_path / "from-folder")

    hub.requests.clear()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    convert(REPO, tmp_path / "offline")
    assert hub.requests == []  # offline: nothing requested at all
    same_model(tmp_path / "offline", tmp_path / "from-folder")


def test_a_revision_other_than_main_is_converted_and_recorded(hub, repo, tmp_path):
    other = tmp_path / "v2"
    save_dense(other, seed=5)
    hub.repos[REPO] = {"main": repo, "v2": other}
    convert(other, tmp_path / "from-folder")
    convert(REPO, tmp_path / "from-hub", "--revision", "v2")
    same_model(tmp_path / "from-hub", tmp_path / "from-folder")
    assert json.loads((tmp_path / "from-hub" / "config.json").read_text())["stem_base_revision"] == commit_of("v2")
    card = (tmp_path / "from-hub" / "README.md").read_text()
    assert "--revision v2" in card and commit_of("v2") in card
    convert(REPO, tmp_path / "by-commit", "--revision", commit_of("v2"))  # a commit pins the same files
    same_model(tmp_path / "by-commit", tmp_path / "from-folder")
    fails(run("convert", REPO, tmp_path / "nope", "--revision", "nope"), f"{REPO} has no revision 'nope'")
    fails(run("convert", repo, tmp_path / "local", "--revision", "v2"), "--revision v2", "drop --revision")
    from stem_upcycle.hub import HubOptions
    from stem_upcycle.source import SourceError, open_source

    with pytest.raises(SourceError, match="model.revision v2 names a revision of a hub id"):
        open_source(str(repo), HubOptions(revision="v2", revision_from="model.revision"))
    assert not (tmp_path / "nope").exists() and not (tmp_path / "local").exists()


def test_a_gated_repository_needs_a_token_with_access(hub, repo, tmp_path, monkeypatch):
    hub.repos[REPO] = {"main": repo}
    hub.gated.add(REPO)
    hub.tokens = {"hf_good"}
    fails(run("convert", REPO, tmp_path / "out"), f"{REPO} is gated", "accept its licence at", "hf auth login")
    fails(run("convert", REPO, tmp_path / "out", "--token", "hf_wrong"), "refused the token (401")
    assert not (tmp_path / "out").exists() and not hub.fetched() & {p.name for p in repo.glob("*.safetensors")}
    convert(REPO, tmp_path / "out", "--token", "hf_good")
    assert {r.headers.get("Authorization") for r in hub.downloads()} == {"Bearer hf_good"}
    monkeypatch.setenv("HF_TOKEN", "hf_good")  # as huggingface_hub resolves it: HF_TOKEN, then the stored login
    hub.requests.clear()
    convert(REPO, tmp_path / "by-env")
    assert all(r.headers.get("Authorization") == "Bearer hf_good" for r in hub.requests)


def test_a_download_cut_mid_file_resumes_and_converts(hub, repo, tmp_path, monkeypatch):
    hub.repos[REPO] = {"main": repo}
    # huggingface_hub keeps what it received in whole chunks (10 MB): chunks of 500 bytes keep the 1000 sent
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 500)
    shard = sorted(p.name for p in repo.glob("*.safetensors"))[0]
    hub.cut_once[shard] = 1000
    convert(REPO, tmp_path / "from-hub")
    gets = [r for r in hub.downloads() if r.path.endswith(shard)]
    assert [r.headers.get("Range") for r in gets] == [None, "bytes=1000-"]  # resumed where it was cut
    convert(repo, tmp_path / "from-folder")
    same_model(tmp_path / "from-hub", tmp_path / "from-folder")


def test_the_disk_check_comes_before_the_weights(hub, repo, tmp_path, monkeypatch):
    """The download (from the repository's file list) and the output (the conversion planned from the config)
    are summed where they share a disk; too little room is one line naming both, and no weight is fetched."""
    import shutil

    from stem_upcycle.convert import OUTPUT_SLACK, plan_conversion
    from stem_upcycle.source import open_source

    hub.repos[REPO] = {"main": repo}
    output = plan_conversion(open_source(str(repo)), layers="0,2", dry_run=True).total_bytes + OUTPUT_SLACK
    real = shutil.disk_usage  # room for the output alone, not for the download too
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=output + 1000))
    line = fails(run("convert", REPO, tmp_path / "out", "--layers", "0,2", "--init", "closed-form"),
                 "not enough disk space: the download 0.00 GB")
    assert "and the output" in line and "HF_HUB_CACHE" in line
    assert hub.fetched() <= READ and not (tmp_path / "out").exists()  # the small files only


def test_a_checkpoint_of_bin_files_only_downloads_them(hub, tmp_path):
    folder = tmp_path / "bin-repo"
    dense = tiny_dense("llama")
    folder.mkdir()
    dense.config.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    torch.save({k: v for k, v in dense.state_dict().items() if k != "lm_head.weight"}, folder / "pytorch_model.bin")
    (folder / "training_args.bin").write_bytes(b"\0" * 100)
    hub.repos[REPO] = {"main": folder}
    convert(REPO, tmp_path / "from-hub")
    assert "pytorch_model.bin" in hub.fetched() and "training_args.bin" not in hub.fetched()
    convert(folder, tmp_path / "from-folder")
    same_model(tmp_path / "from-hub", tmp_path / "from-folder")


@pytest.mark.parametrize("case", ["500", "refused", "400", "disabled", "missing", "offline", "no-weights",
                                  "stale-index", "file-gone", "moved", "disk-full", "read-only-cache", "not-an-id",
                                  "custom-code"])
def test_each_failure_is_one_line_with_its_fix(hub, repo, tmp_path, monkeypatch, case):
    hub.repos[REPO] = {"main": repo}
    out = tmp_path / "out"
    if case == "500":
        hub.failing = 500
        fails(run("convert", REPO, out), "cannot reach the Hub: it answered 500", "try again later")
    elif case == "refused":  # the connection refused (an OSError, as the client raises it on some systems)
        def refused(*args, **kwargs):
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", refused)
        fails(run("convert", REPO, out), "cannot reach the Hub at", "ConnectionRefusedError", "check the network")
    elif case == "400":  # a client error other than 401/403: the request is wrong, so the cache does not stand in
        hub.failing = 400
        fails(run("convert", REPO, out), f"the Hub answered 400 for {REPO}", "check the id and --revision")
    elif case == "disabled":  # the Hub's answer for a repository it disabled
        hub.failing, hub.failing_message = 403, "Access to this resource is disabled."
        fails(run("convert", REPO, out), f"{REPO} is disabled on the Hub", "use another repository")
    elif case == "missing":
        fails(run("convert", "someorg/nothing", out), "someorg/nothing is not a repository on", "check the id")
    elif case == "offline":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        fails(run("convert", REPO, out), "HF_HUB_OFFLINE=1 forbids downloading", "not in the Hugging Face cache")
        assert hub.requests == []
    elif case == "no-weights":
        for p in [*repo.glob("*.safetensors*"), repo / "pytorch_model.bin"]:
            p.unlink()
        fails(run("convert", REPO, out), "has no safetensors or PyTorch .bin weights", "hf download")
    elif case == "stale-index":  # the index names a shard the repository lacks
        index = json.loads((repo / "model.safetensors.index.json").read_text())
        index["weight_map"]["extra.weight"] = "model-99999-of-99999.safetensors"
        (repo / "model.safetensors.index.json").write_text(json.dumps(index))
        fails(run("convert", REPO, out), "weight index names model-99999-of-99999.safetensors", "--revision")
    elif case == "file-gone":  # a shard listed, then deleted before it is fetched
        hub.gone = {sorted(p.name for p in repo.glob("*.safetensors"))[0]}
        fails(run("convert", REPO, out), f"{REPO} no longer holds a file it listed", "pin a commit with --revision")
    elif case == "moved":  # the branch moved on between the file list and the download
        from stem_upcycle import hub as hub_module

        listed = hub_module._repository_files
        monkeypatch.setattr(hub_module, "_repository_files", lambda *a: (listed(*a)[0], commit_of("before")))
        fails(run("convert", REPO, out), f"{REPO} changed while it was being fetched",
              f"commit {commit_of('before')[:12]}, then {COMMIT[:12]}", "pin a commit with --revision")
        assert not hub.fetched() & {p.name for p in repo.glob("*.safetensors")}  # no weights of either commit
    elif case == "not-an-id":  # a mistyped path that is no valid repository id either: no request
        fails(run("convert", "../no-such-model", out), "no such file or directory")
        assert hub.requests == []
    elif case == "disk-full":
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(huggingface_hub.file_download, "http_get", full)
        fails(run("convert", REPO, out), "the disk filled while downloading", "the download resumes")
    elif case == "read-only-cache":
        def denied(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(huggingface_hub.file_download, "http_get", denied)
        fails(run("convert", REPO, out), "cannot write to the Hugging Face cache", "set HF_HOME or HF_HUB_CACHE")
    else:  # a config whose class is the repository's own code
        config = json.loads((repo / "config.json").read_text())
        config.update(model_type="tiny_custom", auto_map={"AutoConfig": "configuration_tiny.TinyConfig"})
        (repo / "config.json").write_text(json.dumps(config))
        (repo / "configuration_tiny.py").write_text(
            "from transformers import LlamaConfig\n\nclass TinyConfig(LlamaConfig):\n    model_type = 'tiny_custom'\n")
        fails(run("convert", REPO, out), "needs its own code to load", "--trust-remote-code")
        assert "configuration_tiny.py" not in hub.fetched()
        # trusted, its code runs (and the family it declares is what stops the conversion)
        fails(run("convert", REPO, out, "--trust-remote-code"), "tiny_custom")
        assert "configuration_tiny.py" in hub.fetched()
    assert not out.exists()


def test_a_dry_run_fetches_no_weights_and_plans_as_the_download_will(hub, repo, tmp_path):
    from stem_upcycle.convert import plan_conversion
    from stem_upcycle.source import open_source

    hub.repos[REPO] = {"main": repo}
    result = run("convert", REPO, tmp_path / "out", "--dry-run", "--layers", "0,2")
    assert result.exit_code == 0, result.output
    shards = {p.name for p in repo.glob("*.safetensors")}
    size = sum((repo / s).stat().st_size for s in shards)
    assert f"download   {size / 1e9:.2f} GB of {REPO}" in result.output
    assert not hub.fetched() & shards and not (tmp_path / "out").exists()
    planned = plan_conversion(open_source(REPO, weights=False), layers="0,2", dry_run=True)
    assert planned.source.pending_download == size
    real = plan_conversion(open_source(str(repo)), layers="0,2", dry_run=True)
    assert planned.total_bytes == real.total_bytes and [s.name for s in planned.specs] == [s.name for s in real.specs]


def test_other_commands_take_a_hub_id(hub, repo, tmp_path):
    """eval --reference fetches a dense parent by id, inspect reads its config alone; compress and edit a STEM
    model (fetched whole)."""
    hub.repos[REPO] = {"main": repo}
    convert(repo, tmp_path / "stem")
    hub.repos["someorg/tiny-stem"] = {"main": tmp_path / "stem"}
    hub.repos["someorg/other"] = {"main": repo}  # not fetched yet
    (tmp_path / "text.txt").write_text(markov_text(300, 0))
    result = run("eval", tmp_path / "stem", "--data", tmp_path / "text.txt", "--reference", REPO, "--json", "--quiet",
                 "--window", "64")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sets"]["text"]["ppl_ratio"] > 0
    hub.requests.clear()
    by_id, by_folder = run("inspect", "someorg/other", "--json"), run("inspect", repo, "--json")
    assert by_id.exit_code == 0, by_id.output
    assert json.loads(by_id.stdout) == json.loads(by_folder.stdout)  # from the config alone: the same summary
    assert not hub.fetched() & {p.name for p in repo.glob("*.safetensors")}  # and no weights downloaded
    hub.requests.clear()
    result = run("compress", "someorg/tiny-stem", tmp_path / "int8", "--table-dtype", "int8", "--table-block", "16", "--quiet")
    assert result.exit_code == 0, result.output
    assert hub.fetched() == {p.name for p in (tmp_path / "stem").iterdir()}  # a STEM model: all of it
    result = run("edit", "someorg/tiny-stem", "--swap", "w1=w2")  # the spans it maps; nothing written
    assert result.exit_code == 0 and "w1" in result.output, result.output
    fails(run("edit", "someorg/tiny-stem", "--undo"), "a download in the Hugging Face cache", "--output DIR")


def test_a_recipe_whose_source_is_a_hub_id_trains(hub, repo, tmp_path):
    hub.repos[REPO] = {"main": repo}
    (tmp_path / "train.txt").write_text(markov_text(3000, 0))
    (tmp_path / "recipe.yaml").write_text(f"""
model: {{source: {REPO}, layers: "0,2", calib_tokens: 1024, calib_seq_len: 32}}
data: {{train: [{tmp_path / 'train.txt'}], seq_len: 32, eval_tokens: 128}}
train: {{batch_size: 4, micro_batch_size: 4, steps: 2, eval_every: 0, warmup_steps: 1}}
""")
    shards = {p.name for p in repo.glob("*.safetensors")}
    result = run("train", tmp_path / "recipe.yaml", "--output", tmp_path / "run", "--quiet", "--plan")
    assert result.exit_code == 0 and f"GB of {REPO} into" in result.output, result.output
    assert not hub.fetched() & shards  # planned from the config: no weights downloaded
    result = run("train", tmp_path / "recipe.yaml", "--output", tmp_path / "run", "--quiet")
    assert result.exit_code == 0, result.output
    assert shards <= hub.fetched()
    out = result.stdout.strip().splitlines()[-1].removeprefix("wrote ")
    assert json.loads((tmp_path / out / "config.json").read_text())["stem_base_model"] == REPO


def test_the_installed_command_downloads_by_environment(repo, tmp_path):
    """`stem-upcycle convert ID OUT` as a user runs it: HF_ENDPOINT and HF_HOME from the environment."""
    server = LocalHub({REPO: repo})
    try:
        env = {**os.environ, "HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "0",
               "HF_HUB_DISABLE_XET": "1"}
        env.pop("HF_TOKEN", None)
        result = subprocess.run([sys.executable, "-m", "stem_upcycle.cli", "convert", REPO, str(tmp_path / "out"),
                                 "--layers", "0,2", "--init", "closed-form"], capture_output=True, text=True, env=env,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / "home" / "hub" / "models--someorg--tiny-llama").is_dir()  # the standard cache
        assert "Fetching" in result.stderr or "Download" in result.stderr  # huggingface_hub's progress bars
    finally:
        server.close()


def test_a_hub_that_does_not_answer_falls_back_to_a_complete_cached_copy(hub, repo, tmp_path):
    hub.repos[REPO] = {"main": repo}
    convert(REPO, tmp_path / "first")
    hub.failing = 503
    result = convert(REPO, tmp_path / "second")
    assert "warning: cannot reach the Hub: it answered 503" in result.output and "using the cached" in result.output
    same_model(tmp_path / "second", tmp_path / "first")
