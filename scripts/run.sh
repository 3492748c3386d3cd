#!/usr/bin/env bash
# Set up a virtual environment from the repo's own files and run the main job.
# Usage: bash scripts/run.sh [executor run options...]   (see: .venv/bin/executor run --help)
# `executor run` comes from executor-reference (reference/), which requirements.txt installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -r requirements.txt
.venv/bin/executor backends
.venv/bin/executor run "$@"
