#!/usr/bin/env bash
# Set up a virtual environment from the repo's own files and run the benchmark: every
# installed backend against the baselines that can run here (table, JSON and plot).
# Usage: bash scripts/bench.sh [executor bench options...]   (see: .venv/bin/executor bench --help)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -r requirements.txt
.venv/bin/executor bench "$@"
