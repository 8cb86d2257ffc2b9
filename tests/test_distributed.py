"""`stem-upcycle train` launched as several processes the way GPU runs are (`accelerate launch`), with CPU
processes standing in for GPUs: DDP, FSDP2, two nodes, two jobs on one host, a process killed mid-run.

Each launched run is compared with one process training on the whole batch (`single`): the same losses
and the same exported weights show that every process read the same rows and that each row update was
applied once."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from stem_upcycle.training.recipe import load_recipe
from stem_upcycle.training.trainer import Trainer

from .conftest import train_log, train_overrides

REPO = Path(__file__).resolve().parent.parent
DDP = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
# the shipped FSDP2 config, on 2 processes in fp32 (accelerate runs FSDP on GPUs only: see tests/fsdp_on_cpu.py)
FSDP = ["--config_file", str(REPO / "recipes" / "accelerate" / "fsdp.yaml"), "--num_processes", "2"]
# dense weights and tables train; Adam's per-row state for the tables (two shared tensors per table)
TRAIN = ["train.trainable=[tables, mlp, norms, attention]", "train.lr=1e-3", "tables.optimizer=adam"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(ws: Path, output: Path, launcher: list[str], sets: list[str], *extra: str, fsdp: bool = False) -> list[str]:
    """`accelerate launch LAUNCHER -m stem_upcycle.cli train` with the workspace's data and SETS."""
    recipe = ws / "r.yaml"
    recipe.write_text("{}\n")
    module = ["tests.fsdp_on_cpu", "stem_upcycle.cli"] if fsdp else ["stem_upcycle.cli"]
    return [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--mixed_precision", "no",
            "--dynamo_backend", "no", "-m", *module, "train", str(recipe), "--output", str(output), "--quiet",
            *[w for o in train_overrides(ws, *sets) for w in ("--set", o)], *extra]


def _env() -> dict:
    """torchrun's launcher with accelerate told to use the CPU (`accelerate launch --cpu` would start one
    process); read when a test runs, after the fixtures set the caches."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}


def _launch(*args, **kwargs) -> subprocess.CompletedProcess:
    run = subprocess.run(_command(*args, **kwargs), env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, _failure(run.stderr)
    return run


def _failure(stderr: str) -> str:
    """What a launched run's processes said, progress bars left out, up to the launcher's report: the root cause
    may be any rank's, a Python traceback or a C++ abort (`terminate called ... what(): ...`)."""
    said = [line for line in stderr.splitlines() if "it/s]" not in line and "s/it]" not in line]
    return "\n".join(said)[-10000:]


def _single(ws: Path, name: str, sets: list[str]) -> Path:
    """One process on the whole batch (micro-batches of 4, where the launched runs' processes take 2 or 1)."""
    Trainer(load_recipe(None, train_overrides(ws, *sets)), ws / name, progress=False).run()
    return ws / name


def _assert_same_run(a: Path, b: Path, *, rtol: float = 1e-5) -> None:
    """The same losses step by step, the same held-out perplexity and exported weights: summed in another order
    by other processes, up to float rounding (on an AVX-512 CPU, 6e-6 at most after 4 steps)."""
    one, two = train_log(a), train_log(b)
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for x, y in zip(one[1:], two[1:]):
        assert x["loss"] == pytest.approx(y["loss"], rel=rtol), (x, y)
    assert one[-1]["eval"]["heldout"]["ppl"] == pytest.approx(two[-1]["eval"]["heldout"]["ppl"], rel=10 * rtol)
    x, y = (load_file(next(run.glob("model-*.safetensors"))) for run in (a, b))
    assert x.keys() == y.keys()
    for name in x:
        torch.testing.assert_close(x[name], y[name], rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_two_processes_give_the_loss_curve_of_one_and_share_one_copy_of_the_tables(workspace):
    """2 CPU processes (gloo) with half the batch each = 1 process with the whole batch; the tables and their
    Adam state are one copy on the machine, mapped by both processes (its pages counted once in their PSS);
    both resume from a checkpoint."""
    extra = ["train.steps=4", "train.trainable=[tables, gate_down]", "train.lr=1e-3", "tables.optimizer=adam",
             f"tables.host_dir={workspace / 'shared'}", "train.keep_checkpoints_at_end=true", "train.checkpoint_every=1"]
    single = _single(workspace, "one", extra)
    two = workspace / "two"
    command = _command(workspace, two, DDP, [*extra, "train.micro_batch_size=2"])
    run = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, _failure(run.stderr)
    assert run.stdout.splitlines() == [f"wrote {two}"]  # by the main process alone
    _assert_same_run(single, two)
    memory = train_log(two)[-1]["host_memory_gb"]  # summed over the two processes
    assert memory["processes"] == 2 and memory["shared_files"] > 0
    assert memory["shared_rss"] > 1.5 * memory["shared_pss"]  # both processes map the same pages ...
    rounding = 8 * 4096 / 2**30  # 8 files (2 tables, Adam's m, v and step count of each), each ending in a partial page
    assert memory["shared_pss"] <= memory["shared_files"] + rounding  # ... which count once: one copy
    for step in (2, 3):
        a, b = (safe_open(run / "checkpoints" / f"step-{step}" / "tables.safetensors", "pt") for run in (single, two))
        # Every row updated once, by its owner: the same tables and Adam state as one process, up to the order in
        # which the halves' gradients are summed (on an AVX-512 CPU, one value in 4608 moved by 2e-5 after 2 steps
        # of a table step size of 0.05).
        for name in a.keys():
            torch.testing.assert_close(a.get_tensor(name), b.get_tensor(name), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert list((workspace / "shared").iterdir()) == []  # the machine's copy went with the export, the folder stays
    # Resumed by both processes from the step-3 checkpoint (accelerate's state, tables into the shared copy):
    # step 4 again, with the same loss.
    again = subprocess.run(command + ["--resume"], env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, _failure(again.stderr)
    resumed = train_log(two)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4] and resumed[-1]["loss"] == pytest.approx(train_log(single)[-1]["loss"], rel=1e-5)


def test_two_processes_split_the_calibration_of_the_conversion(workspace):
    """A run that converts its starting point calibrates and fits its layers (local: sequential, refit_down) in
    both processes (each half the windows, sums all-reduced; the first process reads the parent rows the means are
    shrunk toward and hands them to the other): the converted tables and the refit down-projections equal those of
    one process."""
    common = [f"model.source={workspace / 'dense'}", "model.init_from=", "model.layers=0,2", "model.calib_tokens=1024",
              "local.sequential=true", "local.refit_down=1e-3", "model.calib_seq_len=32", "model.keep_init=true",
              "data.eval_tokens=64", "train.steps=1", "train.batch_size=4", "train.warmup_steps=1"]
    Trainer(load_recipe(None, train_overrides(workspace, *common)), workspace / "one", progress=False).run()
    run = _launch(workspace, workspace / "two", DDP, [*common, "train.micro_batch_size=2"])
    assert "read by 2 processes" in run.stderr
    a, b = (safe_open(str(next((workspace / r / "init").glob("*.safetensors"))), "pt") for r in ("one", "two"))
    for name in ("model.stem_table_groups.0.weight", "model.layers.2.mlp.down_proj.weight"):  # tables side by side
        torch.testing.assert_close(a.get_tensor(name), b.get_tensor(name), rtol=1e-4, atol=1e-5)
    config = json.loads((workspace / "two" / "init" / "config.json").read_text())
    assert config["stem_fit"]["refit_down"] == 1e-3


def test_two_processes_choose_the_neurons_and_rows_of_one(workspace):
    """A run that converts a share of every layer's neurons, with the same seed, on one process or two: the same
    neurons as table columns, the same parent rows and shrunk means in the tables, the same fitted layers."""
    common = [f"model.source={workspace / 'dense'}", "model.init_from=", "model.layers=all", "model.columns=1/3",
              "model.calib_tokens=2048", "model.calib_seq_len=32", "model.parent_contexts=4", "model.keep_init=true",
              "local.sequential=true", "local.refit_down=1e-3", "local.epochs=1",
              "data.eval_tokens=64", "train.steps=1", "train.batch_size=4", "train.warmup_steps=1"]
    Trainer(load_recipe(None, train_overrides(workspace, *common)), workspace / "one", progress=False).run()
    _launch(workspace, workspace / "two", DDP, [*common, "train.micro_batch_size=2"])
    a, b = (safe_open(str(next((workspace / r / "init").glob("*.safetensors"))), "pt") for r in ("one", "two"))
    assert sorted(a.keys()) == sorted(b.keys())
    for layer in range(3):
        assert torch.equal(a.get_tensor(f"model.layers.{layer}.mlp.neuron_order"),
                           b.get_tensor(f"model.layers.{layer}.mlp.neuron_order"))
    for name in a.keys():
        torch.testing.assert_close(a.get_tensor(name), b.get_tensor(name), rtol=1e-4, atol=1e-5)
    config = json.loads((workspace / "two" / "init" / "config.json").read_text())
    assert config["stem_table_columns"] == {"0": 16, "1": 16, "2": 16}


def test_fsdp_shards_the_dense_weights_and_trains_as_one_process(workspace):
    """recipes/accelerate/fsdp.yaml (FSDP2, a unit per decoder layer, sharded checkpoints) on 2 CPU processes,
    with the FSDP recipe's gradient checkpointing and trainable parts: the losses and exported model of one process, a checkpoint shard per process (the dense weights and their
    Adam state sharded), the tables one unsharded copy in host memory, and an exact resume."""
    sets = ["train.steps=4", *TRAIN, "train.gradient_checkpointing=true", "train.checkpoint_every=2",
            "train.keep_checkpoints_at_end=true"]
    single = _single(workspace, "one", sets)
    fsdp = workspace / "fsdp"
    _launch(workspace, fsdp, FSDP, [*sets, "train.micro_batch_size=2"], fsdp=True)
    _assert_same_run(single, fsdp)
    saved = fsdp / "checkpoints" / "step-2" / "accelerate"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # one shard per process, written by each
        assert sorted(p.name for p in (saved / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], part
    a, b = (safe_open(run / "checkpoints" / "step-2" / "tables.safetensors", "pt") for run in (single, fsdp))
    assert a.keys() == b.keys()  # whole tables and their whole Adam state: FSDP never saw them
    for name in a.keys():
        torch.testing.assert_close(a.get_tensor(name), b.get_tensor(name), rtol=1e-4, atol=1e-4)
    memory = train_log(fsdp)[-1]["host_memory_gb"]
    rounding = 8 * 4096 / 2**30
    assert memory["shared_rss"] > 1.5 * memory["shared_pss"] and memory["shared_pss"] <= memory["shared_files"] + rounding
    # --resume loads the sharded model and optimizer into the sharded model and goes on exactly
    first = {p.name: p.read_bytes() for p in fsdp.glob("*.safetensors")}
    _launch(workspace, fsdp, FSDP, [*sets, "train.micro_batch_size=2"], "--resume", fsdp=True)
    assert [r["step"] for r in train_log(fsdp)] == [0, 1, 2, 3, 4]
    assert {p.name: p.read_bytes() for p in fsdp.glob("*.safetensors")} == first


def test_fsdp_that_accelerate_would_run_as_ddp_is_refused(workspace):
    """accelerate runs FSDP on GPUs only; on CPU processes it wraps the model in DDP without a word."""
    command = _command(workspace, workspace / "cpu", FSDP, ["train.steps=1"])
    run = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    errors = {line for line in run.stderr.splitlines() if line.startswith("Error:")}
    assert run.returncode != 0 and len(errors) == 1 and "FSDP was asked for" in errors.pop(), _failure(run.stderr)
    assert not (workspace / "cpu").exists()


def test_two_nodes_keep_a_copy_of_the_tables_each_and_train_as_one_process(workspace):
    """Two machines (`--num_machines 2`, ranks 0 and 1, rendezvous on localhost) of 2 processes each, sharing
    OUTPUT's file system, as two nodes on one host do: each node's local main process fills a copy of the tables
    of its own, each row is updated once per copy, every process reads the same rows; the export is written once,
    by the main process."""
    sets = ["train.steps=4", *TRAIN, "train.micro_batch_size=2", "train.eval_every=2"]
    single = _single(workspace, "one", sets)
    nodes = workspace / "nodes"
    port = str(_free_port())
    commands = [_command(workspace, nodes, ["--multi_gpu", "--num_processes", "4", "--num_machines", "2",
                                            "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                                            "--main_process_port", port], [*sets, "train.micro_batch_size=2"])
                for rank in (0, 1)]
    running = [subprocess.Popen(c, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for c in commands]
    outputs = [p.communicate(timeout=600) for p in running]
    for p, (_, err) in zip(running, outputs):
        assert p.returncode == 0, _failure(err)
    assert [out.splitlines() for out, _ in outputs] == [[f"wrote {nodes}"], []]
    _assert_same_run(single, nodes)
    memory = train_log(nodes)[-1]["host_memory_gb"]  # 4 processes, 2 copies: each mapped by its node's 2 processes
    assert memory["processes"] == 4
    assert memory["shared_pss"] == pytest.approx(2 * memory["shared_files"], abs=16 * 4096 / 2**30)
    assert not (nodes / "host-tables").exists()


def test_two_jobs_on_one_host_never_share_their_temporaries(workspace):
    """Two 2-process trainings at once, into two outputs, sharing a tables.host_dir and a token cache that
    neither has filled yet: each trains as it would alone; the cache ends with one complete copy of each
    corpus and no run's parts; the host_dir ends as it started."""
    sets = ["train.steps=4", *TRAIN, "train.micro_batch_size=2", f"tables.host_dir={workspace / 'shm'}",
            f"data.cache_dir={workspace / 'tokens'}"]
    (workspace / "shm").mkdir()
    single = _single(workspace, "one", [*sets[:-2], f"data.cache_dir={workspace / 'own-tokens'}"])
    jobs = [workspace / "a", workspace / "b"]
    running = [subprocess.Popen(_command(workspace, job, [*DDP, "--main_process_port", str(_free_port())], sets),
                                env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for job in jobs]
    outputs = [p.communicate(timeout=600) for p in running]
    for p, (_, err) in zip(running, outputs):
        assert p.returncode == 0, _failure(err)
    for job in jobs:
        _assert_same_run(single, job)
    assert list((workspace / "shm").iterdir()) == []
    cached = sorted((workspace / "tokens").iterdir())
    assert len(cached) == 2  # the training text, the held-out text
    for folder in cached:
        assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "tokens.bin"]
    assert [(f / "tokens.bin").read_bytes() for f in cached] == [
        (f / "tokens.bin").read_bytes() for f in sorted((workspace / "own-tokens").iterdir())]


def _children(pid: int) -> list[int]:
    """The processes `pid` started, from /proc (Linux)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_a_process_killed_mid_run_ends_the_job_and_resume_continues_from_its_last_checkpoint(workspace):
    """SIGKILL to one of two processes, after some checkpoints: the job ends (the launcher stops the other
    process, no hang) with an error that names the signal; no half-written checkpoint or model looks complete;
    --resume continues from the newest complete checkpoint with the losses of a run never interrupted."""
    # a constant learning rate after the warmup, so that runs of any length take the same steps (train.steps
    # changes on resume, and the reference run below stops there too)
    sets = [*TRAIN, "train.micro_batch_size=2", "train.checkpoint_every=3", "train.keep_checkpoints=2",
            "train.min_lr_ratio=1.0"]
    out = workspace / "killed"
    launcher = subprocess.Popen(_command(workspace, out, DDP, [*sets, "train.steps=400"]), env=_env(), cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "step-6").exists():  # two checkpoints written, training goes on
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-2000:]
        time.sleep(0.01)
    workers = _children(launcher.pid)  # accelerate launch runs torchrun's agent in its own process
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGKILL)
    started = time.monotonic()
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode != 0 and time.monotonic() - started < 60
    assert "SIGKILL" in err or "exitcode: -9" in err, err[-2000:]
    logged = train_log(out)
    assert not (out / "config.json").exists()  # no model: the run never exported
    complete = sorted(int(p.name.removeprefix("step-")) for p in (out / "checkpoints").glob("step-*"))
    assert complete and all((out / "checkpoints" / f"step-{s}" / "state.json").exists() for s in complete)
    last = complete[-1]
    _launch(workspace, out, DDP, [*sets, f"train.steps={last + 2}"], "--resume")
    reference = train_log(_single(workspace, "reference", [*sets, f"train.steps={last + 2}"]))
    resumed = train_log(out)
    assert [r["step"] for r in resumed] == [r["step"] for r in reference] == list(range(last + 3))
    assert resumed[: last + 1] == logged[: last + 1]  # the log up to the checkpoint, kept as written
    for r, ref in zip(resumed[1:], reference[1:]):  # 2 processes against 1: sums in another order, ~10 steps
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-4), r["step"]
    assert (out / "config.json").exists()
