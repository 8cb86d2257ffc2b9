"""scripts/check-quickstart.py: what it reads from the README's first screen, and how it runs it.

CI runs the check itself in a fresh clone (`.ci/run`); these tests keep the README and the check from drifting
apart and hold the check to its word: the first failing command stops it, named, and nothing may read stdin.
"""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
check = runpy.run_path(str(ROOT / "scripts" / "check-quickstart.py"))


def test_the_check_runs_what_the_first_screen_shows():
    commands = check["first_screen_commands"]((ROOT / "README.md").read_text())
    assert [c.split(" #")[0].strip() for c in commands[:-1]] == [
        "bash scripts/install.sh",
        "source .venv/bin/activate",
        "stem-upcycle convert smollm2-135m out/smollm2-stem",
        'python examples/chat.py out/smollm2-stem "What is the capital of France?"',
    ]
    # The loading snippet, as one Python program that generates from the converted model.
    program = commands[-1]
    assert program.startswith("python -c ") and "model.generate(" in program and '"out/smollm2-stem"' in program


def readme_checkout(tmp_path, first_screen: str) -> Path:
    """A checkout whose README's first screen puts `python` (this interpreter) on PATH, as the real one's
    `source .venv/bin/activate` does (the check's shell has no virtual environment), then runs `first_screen`."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "README.md").write_text(f"# a project\n\n    export PATH=\"$PWD/bin:$PATH\"\n\n{first_screen}\n"
                                        "## Later\n\n    false\n")
    return tmp_path


def run_check(checkout: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check-quickstart.py"), str(checkout)],
                          capture_output=True, text=True)


def test_every_command_runs_in_one_shell_in_order_and_code_below_the_first_screen_does_not(tmp_path):
    checkout = readme_checkout(tmp_path, "Set up:\n\n    export GREETING=hello    # kept for later\n\n"
                                         "```python\nimport os\nopen('ran', 'w').write(os.environ['GREETING'])\n"
                                         "```\n\n    # a comment line\n    test \"$(cat ran)\" = hello\n")
    done = run_check(checkout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("\n$ ") == 4 and "quick start: every command ran" in done.stdout
    assert (checkout / "ran").read_text() == "hello"


@pytest.mark.parametrize("failing", ["false", "read answer", "python -c 'input()'"])
def test_the_first_failing_command_stops_the_check_and_is_named(tmp_path, failing):
    """`read` and `input()` stand for a prompt: with stdin closed they meet end-of-file and fail."""
    checkout = readme_checkout(tmp_path, f"    true\n    {failing}\n    touch after\n")
    done = run_check(checkout)
    assert done.returncode == 1
    assert f"quick start failed (exit 1): {failing}" in done.stdout
    assert not (checkout / "after").exists()


def test_a_folder_without_a_readme_is_one_line_naming_it(tmp_path):
    done = run_check(tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: {tmp_path} has no README.md; give a fresh clone of stem-upcycle, or " \
                                  "nothing to make one"
