"""Training state on disk: the output directory, checkpoints with exact resume, the JSON-lines log.

A checkpoint holds everything a step changes: the tables, the trainable dense weights, both
optimizers' states and the step count. Data order is a function of the step (see `data.Batches`),
so the step after a resume reads the same sequences and computes the same loss as it would have
in an uninterrupted run. Checkpoints are written to `step.partial-PID` and renamed to `step-N` when complete.

Not accelerate's save_state/load_state: registered objects are pickled whole with torch.save,
multi-GB tables included; here tables and their state go to safetensors (sharded FSDP
checkpoints are therefore not supported yet).
"""

import json
import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from ..errors import UserError
from ..shards import staging_dir

# Keys that may change between a run and its resume without changing what was computed so far.
RESUMABLE_CHANGES = {("train", "steps"), ("train", "eval_every"), ("train", "checkpoint_every"),
                     ("train", "keep_checkpoints"), ("train", "keep_checkpoints_at_end"), ("train", "log_every"),
                     ("model", "keep_init")}


class ResumeError(UserError):
    pass


def prepare_output(output: Path, recipe, resume: bool, is_main: bool) -> None:
    """Refuse to mix runs in one directory; record the recipe of a new run."""
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


def _trainable_named(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in trainer.trainable.named_parameters() if p.requires_grad}


def save(trainer, step: int) -> None:
    acc = trainer.accelerator
    acc.wait_for_everyone()
    if acc.is_main_process:
        root = trainer.output / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        final, partial = root / f"step-{step}", staging_dir(root, "step")
        tables = {f"table.{i}": t.weight for i, t in trainer.tables.items()}
        if trainer.table_optimizer is not None:
            tables |= {f"optimizer.{k}": v for k, v in trainer.table_optimizer.state_dict().items()}
        save_file(tables, partial / "tables.safetensors")
        save_file({n: p.contiguous().cpu() for n, p in _trainable_named(trainer).items()}, partial / "trainable.safetensors")
        if trainer.dense_optimizer is not None:
            torch.save(trainer.dense_optimizer.state_dict(), partial / "dense_optimizer.pt")
        (partial / "state.json").write_text(json.dumps({"step": step, "tokens_seen": trainer.tokens_seen}))
        partial.rename(final)
        done = _complete(root)
        for old in done[: max(0, len(done) - trainer.recipe.train.keep_checkpoints)]:
            shutil.rmtree(old)
    acc.wait_for_everyone()


def _complete(root: Path) -> list[Path]:
    """The finished checkpoints, oldest first."""
    done = [p for p in root.glob("step-*") if p.name.removeprefix("step-").isdigit()] if root.exists() else []
    return sorted(done, key=lambda p: int(p.name.removeprefix("step-")))


def load_latest(trainer) -> tuple[int, int]:
    """Restore the newest complete checkpoint; (step, tokens seen), or (0, 0) when there is none."""
    root = trainer.output / "checkpoints"
    done = _complete(root)
    if not done:
        return 0, 0
    path = done[-1]
    state = json.loads((path / "state.json").read_text())
    acc = trainer.accelerator
    if acc.is_local_main_process:  # the machine's one copy of the tables and their state, written once
        tables = load_file(path / "tables.safetensors")
        for i, table in trainer.tables.items():
            table.weight.copy_(tables[f"table.{i}"])
        if trainer.table_optimizer is not None:
            trainer.table_optimizer.load_state_dict({k.removeprefix("optimizer."): v for k, v in tables.items()
                                                     if k.startswith("optimizer.")})
    acc.wait_for_everyone()
    weights = load_file(path / "trainable.safetensors")
    params = _trainable_named(trainer)
    if set(weights) != set(params):
        raise ResumeError(f"{path} holds other trainable weights than this recipe trains; start a new run")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    if trainer.dense_optimizer is not None:
        trainer.dense_optimizer.load_state_dict(torch.load(path / "dense_optimizer.pt", weights_only=True))
    if trainer.recipe.handoff.steps and state["step"] >= trainer.recipe.handoff.steps:
        from .student import set_handoff

        set_handoff(trainer.causal_lm, None)
    return state["step"], state["tokens_seen"]
