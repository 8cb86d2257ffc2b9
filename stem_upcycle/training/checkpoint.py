"""Training state on disk: the output directory, checkpoints with exact resume, the JSON-lines log.

A checkpoint holds everything a step changes: the tables and their optimizer state
(safetensors), the model and the dense optimizer (accelerate's `save_state`: sharded under FSDP)
and the step count. Data order is a function of the step (see `data.Batches`),
so the step after a resume reads the same sequences and computes the same loss as it would have
in an uninterrupted run. Checkpoints are written to `step.partial-PID` and renamed to `step-N` when complete.

The tables are not registered with accelerate (`register_for_checkpointing`): it would torch.save
them whole and load them back in every process; one safetensors file, read by each machine's
local main process into its shared copy, holds them.
"""

import json
import shutil
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import UserError
from ..atomic import staging_dir

# Keys that may change between a run and its resume without changing what was computed so far.
RESUMABLE_CHANGES = {("train", "steps"), ("train", "eval_every"), ("train", "checkpoint_every"),
                     ("train", "keep_checkpoints"), ("train", "keep_checkpoints_at_end"), ("train", "log_every"),
                     ("model", "keep_init")}


class ResumeError(UserError):
    pass


def prepare_output(output: Path, recipe, resume: bool, is_main: bool, wait=lambda: None) -> None:
    """Refuse to mix runs in one directory; record the recipe of a new run. Every process checks before
    the main one writes (`wait`: a barrier across processes)."""
    saved = output / "recipe.yaml"
    if resume:
        if not saved.exists():
            raise ResumeError(f"{output} holds no training run (no recipe.yaml) to resume; drop --resume to start one")
        before = yaml.safe_load(saved.read_text())
        now = recipe.to_dict()
        changed = [(s, k) for s in now for k in now[s] if before.get(s, {}).get(k) != now[s][k]]
        if bad := [f"{s}.{k}" for s, k in changed if (s, k) not in RESUMABLE_CHANGES]:
            raise ResumeError(f"--resume with a different recipe ({', '.join(bad)} changed) would not continue the "
                              f"same run; restore them or start a new run in another --output")
        return
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"{output} is not empty; choose a new --output, or pass --resume to continue the run in it")
    wait()
    if is_main:
        output.mkdir(parents=True, exist_ok=True)
        saved.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))


class Log:
    """Appends one JSON object per line; on resume, drops lines past the checkpoint's step."""

    def __init__(self, path: Path, enabled: bool, start_step: int):
        self.path, self.enabled = path, enabled
        if enabled and path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= start_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def save(acc, root: Path, step: int, tables: dict, table_optimizer, tokens_seen: int, keep: int) -> None:
    """Checkpoint `root`/step-STEP. Every process takes part: accelerate's `save_state` writes the models
    and optimizers prepared with `acc` (one file on one process; a shard per process under FSDP), the
    main process the tables {layer: OffloadedTable} and their optimizer's state; `keep` checkpoints stay."""
    from accelerate.utils import broadcast_object_list

    acc.wait_for_everyone()
    partial = [None]
    if acc.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        partial = [str(staging_dir(root, "step"))]
    partial = Path(broadcast_object_list(partial)[0] if acc.num_processes > 1 else partial[0])
    acc.save_state(str(partial / "accelerate"))
    acc.wait_for_everyone()  # save_state returns before the other processes wrote their files (RNG states) in it
    if acc.is_main_process:
        tensors = {f"table.{i}": t.weight for i, t in tables.items()}
        if table_optimizer is not None:
            tensors |= {f"optimizer.{k}": v for k, v in table_optimizer.state_dict().items()}
        save_file(tensors, partial / "tables.safetensors")
        (partial / "state.json").write_text(json.dumps({"step": step, "tokens_seen": tokens_seen}))
        partial.rename(root / f"step-{step}")
        done = _complete(root)
        for old in done[: max(0, len(done) - keep)]:
            shutil.rmtree(old)
    acc.wait_for_everyone()


def _complete(root: Path) -> list[Path]:
    """The finished checkpoints, oldest first."""
    done = [p for p in root.glob("step-*") if p.name.removeprefix("step-").isdigit()] if root.exists() else []
    return sorted(done, key=lambda p: int(p.name.removeprefix("step-")))


class LazyState:
    """The optimizer entries of a checkpoint file, read one by one as the optimizer asks for them."""

    def __init__(self, file, prefix: str):
        self.file, self.prefix = file, prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.file.get_tensor(self.prefix + key)


def load_latest(acc, root: Path, tables: dict, table_optimizer) -> tuple[int, int]:
    """Restore the newest complete checkpoint in `root`; (step, tokens seen), or (0, 0) when there is none."""
    done = _complete(root)
    if not done:
        return 0, 0
    path = done[-1]
    state = json.loads((path / "state.json").read_text())
    if acc.is_local_main_process:  # the machine's one copy of the tables and their state, written once
        with safe_open(path / "tables.safetensors", "pt") as f:  # one table-sized tensor in memory at a time
            for i, table in tables.items():
                table.weight.copy_(f.get_tensor(f"table.{i}"))
            if table_optimizer is not None:
                table_optimizer.load_state_dict(LazyState(f, "optimizer."))
    acc.wait_for_everyone()
    acc.load_state(str(path / "accelerate"))  # the model (trainable weights among them) and the dense optimizer
    return state["step"], state["tokens_seen"]
