"""Corrupted checkpoints and bad options: every command ends in one line that names the problem, no traceback."""

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from stem_upcycle.cli import main

from .conftest import save_tiny_tokenizer, tiny_dense

UP, GATE = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"


def _rewrite(folder, name, change):
    """Apply `change` to the tensors of the shard holding `name`, and keep the index in step."""
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k != name or name in tensors}
    index_file.write_text(json.dumps(index))


def _shard_of(folder, name):
    return folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]


CORRUPTIONS = {  # name -> (what to do to a good checkpoint, what the error must say)
    "config not JSON": (lambda f: (f / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    "truncated shard": (lambda f: _shard_of(f, UP).write_bytes(_shard_of(f, UP).read_bytes()[:-200]), "is truncated"),
    "garbage header": (lambda f: _shard_of(f, UP).write_bytes(b"\x10" + bytes(7) + b"garbage!" + bytes(64)),
                       "corrupt safetensors header"),
    "missing shard": (lambda f: os.remove(_shard_of(f, UP)), "the download is incomplete"),
    "bad index": (lambda f: (f / "model.safetensors.index.json").write_text("[]"), "is not a valid index"),
    "missing tensor": (lambda f: _rewrite(f, UP, lambda t: t.pop(UP)), f"lacks {UP}"),
    "misshapen gate": (lambda f: _rewrite(f, GATE, lambda t: t.__setitem__(GATE, torch.zeros(40, 32))),
                       {"convert": "has shape [40, 32], its config says [48, 32]", "eval": "shaped unlike"}),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good") / "dense"
    tiny_dense("llama").save_pretrained(folder, max_shard_size="40KB")
    save_tiny_tokenizer(folder)
    (folder.parent / "text.txt").write_text(" ".join(f"w{i % 90}" for i in range(400)))
    return folder


def one_line_error(args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, (args, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupted_checkpoints_end_in_one_line_everywhere(good, tmp_path, corruption):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(good, folder)
    corrupt, says = CORRUPTIONS[corruption]
    corrupt(folder)
    commands = {"convert": ["convert", folder, tmp_path / "out", "--quiet"],
                "inspect": ["inspect", folder],
                "eval": ["eval", folder, "--data", good.parent / "text.txt", "--window", 32, "--quiet"]}
    if corruption in ("missing tensor", "misshapen gate"):
        del commands["inspect"]  # inspect reports what a checkpoint holds, complete or not
    for command, args in commands.items():
        expected = says[command] if isinstance(says, dict) else says
        assert expected in one_line_error(args), command
    assert not (tmp_path / "out").exists()


def test_bad_option_values_end_in_one_line(good, tmp_path):
    assert "--max-shard-size 'lots' does not parse" in one_line_error(
        ["convert", good, tmp_path / "out", "--max-shard-size", "lots"])
    assert not (tmp_path / "out").exists()
    assert "cannot write to /proc" in one_line_error(["convert", good, "/proc/stem-out"])  # not "no disk space"
    assert "--device 'warp9' is not a device" in one_line_error(
        ["convert", good, tmp_path / "out", "--device", "warp9"])
    assert "--device 'warp9' is not a device" in one_line_error(["eval", good, "--facts", "--device", "warp9"])
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in one_line_error(["convert", good, tmp_path / "out", "--device", "cuda"])
    assert not (tmp_path / "out").exists()
