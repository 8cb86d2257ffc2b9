"""Corrupted checkpoints and bad options: every command ends in one line that names the problem, no traceback."""

import json
import os
import shutil

import click
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
    """The one error line of a command that fails cleanly: exit 1 (or click's 2, a usage error), no traceback."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert isinstance(result.exception, SystemExit) and result.exit_code in (1, 2), (args, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupted_checkpoints_end_in_one_line_everywhere(good, tmp_path, corruption):
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
    # the default --columns (a sixth of every layer) scores neurons on 16 windows kept out of the calibration
    assert "give --calib-tokens more than 16384 (or --columns all)" in one_line_error(
        ["convert", good, tmp_path / "out", "--calib-data", good.parent / "text.txt", "--calib-tokens", 8192])
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in one_line_error(["convert", good, tmp_path / "out", "--device", "cuda"])
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def stem(good):
    folder = good.parent / "stem"
    result = CliRunner().invoke(main, ["convert", str(good), str(folder), "--layers", "0,2", "--init", "closed-form",
                                       "--quiet"])
    assert result.exit_code == 0, result.output
    return folder


HUGE = 10**12
# Every numeric option of every command: how it is given, and per value what the one-line error says (None: the
# command runs, the value being as large as the input allows).
NUMERIC_OPTIONS = {
    ("convert", "--calib-tokens"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--init", "calib", "--layers",
                                                        "0", "--calib-data", t, "--calib-seq-len", 16, "--calib-tokens", v],
                                    {0: "x>=1", -1: "x>=1", HUGE: None}),
    ("convert", "--calib-generate"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--init", "calib",
                                                          "--columns", "all", "--calib-tokens", 64,
                                                          "--calib-generate", v],
                                      {-1: "x>=0", HUGE: "more than --calib-tokens 64"}),
    ("convert", "--calib-seq-len"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--init", "calib",
                                                         "--columns", "all", "--calib-data", t, "--calib-seq-len", v],
                                     {0: "x>=2", 1: "x>=2", HUGE: "fewer than --calib-seq-len"}),
    ("convert", "--refit-down"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--init", "calib", "--layers", "0",
                                                      "--calib-data", t, "--calib-seq-len", 16, "--refit-down", v],
                                  {-1: "x>=0", HUGE: None}),  # a huge ridge keeps the parent's W_down
    ("convert", "--local-epochs"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--init", "calib", "--layers",
                                                        "0", "--calib-data", t, "--local-epochs", v, "--dry-run"],
                                    {-1: "x>=0", HUGE: None}),
    ("convert", "--parent-contexts"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--layers", "0",
                                                           "--calib-data", t, "--parent-contexts", v, "--dry-run"],
                                       {-1: "x>=0", HUGE: None}),
    ("convert", "--parent-reads"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--layers", "0",
                                                        "--calib-data", t, "--parent-reads", v, "--dry-run"],
                                    {0: "x>=1", -1: "x>=1", HUGE: None}),  # more than --parent-contexts: all of them
    ("convert", "--fact-weight"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--layers", "0", "--columns", 32,
                                                       "--calib-data", t, "--fact-weight", v, "--dry-run"],
                                   {-1: "x>=0", HUGE: None}),
    ("convert", "--shrink"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--layers", "0", "--calib-data", t,
                                                  "--calib-seq-len", 16, "--parent-contexts", 2, "--shrink", v],
                              {-1: "x>=0", HUGE: None}),  # a huge k: the parent's rows
    ("convert", "--layers"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--layers", v],
                              {"0/3": "a fraction must lie in (0, 1]", -1: "is not understood", HUGE: "does not exist"}),
    ("convert", "--max-shard-size"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--max-shard-size", v],
                                      {"0GB": "is not a size", "-1GB": "is not a size", f"{HUGE}TB": "does not parse"}),
    ("convert", "--table-block"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--table-dtype", "int4",
                                                       "--table-block", v],
                                   {1: "x>=2", 7: "even number", HUGE: "do not split into blocks"}),
    ("compress", "--table-block"): (lambda d, s, t, v: ["compress", s, t.parent / "out", "--table-dtype", "int8",
                                                        "--table-block", v],
                                    {0: "x>=2", 5: "even number", 20: "do not split into blocks of 20", 16: None}),
    ("compress", "--max-shard-size"): (lambda d, s, t, v: ["compress", s, t.parent / "out", "--table-dtype", "float16",
                                                           "--max-shard-size", v],
                                       {"0GB": "is not a size", "-1GB": "is not a size", f"{HUGE}TB": "does not parse"}),
    ("compress", "--layer-groups"): (lambda d, s, t, v: ["compress", s, t.parent / "out", "--layer-groups", v,
                                                         "--table-dtype", "bfloat16"],
                                     {0: "x>=1", -1: "x>=1", HUGE: None}),
    ("convert", "--layer-groups"): (lambda d, s, t, v: ["convert", d, t.parent / "out", "--layer-groups", v,
                                                        "--init", "closed-form"],
                                    {0: "x>=1", -1: "x>=1", HUGE: None}),
    ("inspect", "--sample"): (lambda d, s, t, v: ["inspect", s, "--tables", "--sample", v],
                              {0: "2<=x<=4096", HUGE: "2<=x<=4096"}),
    ("inspect", "--seed"): (lambda d, s, t, v: ["inspect", s, "--tables", "--seed", v],
                            {-1: "0<=x<=", 2**64: "0<=x<="}),
    ("inspect", "--text-tokens"): (lambda d, s, t, v: ["inspect", s, "--tables", "--text", t, "--text-tokens", v],
                                   {0: "x>=1", HUGE: None}),
    ("inspect", "--layer"): (lambda d, s, t, v: ["inspect", s, "--nearest", "w5", "--layer", v],
                             {-1: "not a STEM layer", HUGE: "not a STEM layer"}),
    ("inspect", "--top"): (lambda d, s, t, v: ["inspect", s, "--nearest", "w5", "--layer", 0, "--top", v],
                           {0: "x>=1", HUGE: None}),
    ("edit", "--max-new-tokens"): (lambda d, s, t, v: ["edit", s, "--swap", "w5=w6", "--prompt", "w1 w5",
                                                       "--max-new-tokens", v],
                                   {0: "x>=1", HUGE: "pass the model's context of 64; give at most 62"}),
    ("edit", "--layers"): (lambda d, s, t, v: ["edit", s, "--swap", "w5=w6", "--layers", v],
                           {-1: "is not understood", HUGE: "does not exist"}),
    ("eval", "--window"): (lambda d, s, t, v: ["eval", s, "--data", t, "--window", v],
                           {0: "x>=2", 1: "x>=2", HUGE: "fewer than one window"}),
    ("eval", "--max-tokens"): (lambda d, s, t, v: ["eval", s, "--data", t, "--window", 32, "--max-tokens", v],
                               {0: "x>=1", -1: "x>=1", HUGE: None}),
}


def _numeric_options() -> set:
    """(command, option) for every option that takes a number, or a size or layer count given as text."""
    found = set()
    for name, command in main.commands.items():
        for param in command.params:
            numeric = isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType))
            if isinstance(param, click.Option) and (numeric or param.opts[0] in ("--layers", "--max-shard-size")):
                found.add((name, param.opts[0]))
    return found


def test_every_numeric_option_is_in_the_table():
    assert _numeric_options() == set(NUMERIC_OPTIONS)


@pytest.mark.parametrize("option", list(NUMERIC_OPTIONS), ids=" ".join)
def test_bad_numbers_of_every_option_end_in_one_line(good, stem, tmp_path, option):
    make, cases = NUMERIC_OPTIONS[option]
    text = tmp_path / "text.txt"
    text.write_text((good.parent / "text.txt").read_text())
    for value, says in cases.items():
        args = [str(a) for a in make(good, stem, text, value)]
        if says is None:
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 0 and result.exception is None, (value, result.output)
        else:
            assert says in one_line_error(args), (value, says)
        shutil.rmtree(tmp_path / "out", ignore_errors=True)


@pytest.mark.parametrize("given, says", [
    ("runs-that-do-not-exist/model", "runs-that-do-not-exist/model is neither a folder here nor a model in the local "
                                     "Hugging Face cache (nothing is downloaded); give a converted model's folder"),
    ("tests/no-such-model", "tests/no-such-model: no such folder; make it first (the README's convert command writes "
                            "one in about 30 seconds), or give a converted model's folder"),
])
def test_the_chat_example_names_a_missing_model_in_one_line_without_reaching_the_hub(given, says):
    """A folder only training makes, asked for before training (a path, or what looks like a hub id): one line,
    never a hub lookup (the test's process has no hub to reach: a lookup would retry for 25 s and print more)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(root / "examples" / "chat.py"), given], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [f"error: {says}"], run.stderr[-2000:]
