"""Run the README's first screen as a newcomer would, and fail on the first command that fails, naming it.

The first screen is every code block of README.md above its first `##` heading: each line of an indented or
fenced shell block is a command, each ```python block a program (`python -c CODE`). They run in order, exactly as
written, in one shell (so that `source .venv/bin/activate` holds for the commands after it), in a fresh clone,
with no virtual environment active, an empty stem-upcycle cache, and stdin closed: a command that would prompt
reads end-of-file instead, and fails. Each command's time is printed.

    python3 scripts/check-quickstart.py             # in a new clone of this repository's HEAD, removed after
    python3 scripts/check-quickstart.py /tmp/qs     # in that fresh clone (e.g. one with edits not yet committed)
"""

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Runs one command with stdin closed; on failure names it (a program by its first line) and stops.
STEP = r"""
step() {
    local start=$SECONDS status
    printf '\n$ %s\n' "${1%%$'\n'*}"
    eval "$1" </dev/null || { status=$?; printf 'quick start failed (exit %d): %s\n' $status "${1%%$'\n'*}"; exit 1; }
    printf '(%ds)\n' $((SECONDS - start))
}
"""


def first_screen_commands(readme: str) -> list[str]:
    """The commands of the README's code blocks above its first `##` heading, as the check runs them."""
    commands, fence, code = [], None, []
    for line in readme.split("\n## ", 1)[0].splitlines():
        if fence is None and line.startswith("```"):
            fence, code = line[3:].strip(), []
        elif fence is not None and line.startswith("```"):
            if fence == "python":
                commands.append("python -c " + shlex.quote("\n".join(code)))
            fence = None
        elif fence == "python":
            code.append(line)
        elif (fence is not None or line.startswith("    ")) and line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    return commands


def clean_environment(cache: str) -> dict[str, str]:
    """This process's environment with no virtual environment or Python path of its own, and an empty cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venvs = {os.environ.get("VIRTUAL_ENV"), sys.prefix if sys.prefix != sys.base_prefix else None} - {None}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not any(p == os.path.join(v, "bin") for v in venvs))
    env["STEM_UPCYCLE_CACHE"] = cache
    return env


def run(checkout: Path) -> int:
    """Run the first screen of `checkout`'s README there; the shell's exit status."""
    commands = first_screen_commands((checkout / "README.md").read_text())
    script = STEP + "".join(f"step {shlex.quote(c)}\n" for c in commands) + "echo 'quick start: every command ran'\n"
    with tempfile.TemporaryDirectory(prefix="stem-upcycle-cache-") as cache:
        return subprocess.run(["bash", "-c", script], cwd=checkout, env=clean_environment(cache),
                              stdin=subprocess.DEVNULL).returncode


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        sys.exit(f"usage: {argv[0]} [FRESH_CLONE]  (default: a new clone of {REPO}'s HEAD)")
    if argv and not (Path(argv[0]) / "README.md").is_file():
        sys.exit(f"error: {argv[0]} has no README.md; give a fresh clone of stem-upcycle, or nothing to make one")
    if argv:
        return run(Path(argv[0]).resolve())
    with tempfile.TemporaryDirectory(prefix="stem-upcycle-quickstart-") as tmp:
        subprocess.run(["git", "clone", "--quiet", str(REPO), tmp], check=True)
        return run(Path(tmp))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
