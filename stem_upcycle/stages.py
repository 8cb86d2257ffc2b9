"""What a conversion spends its time on: each stage's estimate before the run, timed on a slice of its own work on
this machine, and each stage's line as it ends, --quiet or not.

A stage is named once (STAGES) and both the estimate and the run report it under that name, so that a user reads
the one against the other. The estimate times one unit of each stage's work (a decode step of the sampling batch, a
window's forward, a forward of the parent's rows, a layer's sums over a slice of positions) with the model the run
computes with, in the dtype it computes in, and multiplies by the units the plan holds.
"""

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

STAGES = {
    "sample": "text sampled from the parent (calibration text when none is given)",
    "read text": "the calibration windows read by the parent, each layer's MLP inputs kept",
    "score neurons": "each neuron's cost as a table column, on windows kept out of its rows",
    "parent rows": "every vocabulary token read by the parent after its contexts",
    "rows": "the tokens' calibrated means for the table columns",
    "fit": "each converted layer fitted to its parent (--sequential, --refit-down, --local-epochs)",
    "write": "the converted model's files",
}
HOUR = 3600.0

finished: list[tuple[str, float]] = []  # (stage, seconds) of this process, in order: what a benchmark reads


@dataclass(frozen=True)
class Estimate:
    """A stage's work (`work`, in words) and its estimated seconds on this machine."""

    stage: str
    work: str
    seconds: float


@contextmanager
def stage(name: str, work: str, report: bool = True):
    """Time the block as stage `name` (one of STAGES) doing `work`; print "name: work in N s" when it ends. The
    block may say more of its work when it knows it (`note["work"] = ...`)."""
    assert name in STAGES, name
    note = {"work": work}
    started = time.perf_counter()
    yield note
    seconds = time.perf_counter() - started
    finished.append((name, seconds))
    if report:
        print(f"{name}: {note['work']} in {describe_seconds(seconds)}", file=sys.stderr, flush=True)


def describe_seconds(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / HOUR:.1f} h"


def describe_estimates(estimates: list[Estimate], machine: str) -> str:
    """The plan's lines: the total and each stage's estimate, and what would make a long one shorter."""
    total = sum(e.seconds for e in estimates)
    lines = [f"time       ~{describe_seconds(total)} on this machine ({machine}; each stage timed on a slice of its "
             f"work): " + ", ".join(f"{e.stage} {describe_seconds(e.seconds)} ({e.work})" for e in estimates)]
    if total > HOUR:
        lines.append("           over an hour: a GPU (--device cuda) runs every stage on it; fewer --parent-reads or "
                     "--parent-contexts cut the parent's reads, a smaller --columns share the tables, fewer "
                     "--calib-generate tokens the sampling")
    return "\n".join(lines)
