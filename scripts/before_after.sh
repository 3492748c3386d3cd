#!/usr/bin/env bash
# Before and after in one sitting: `executor bench` (this tree's harness) run on the code of
# an earlier revision and on this tree's, alternating, so that the machine's noise hits both.
#
#   bash scripts/before_after.sh REV [OUT_DIR]
#   WORKLOADS=nodes VLLM_MQ_PATH=DIR bash scripts/before_after.sh REV   # other workloads only
#
# REV is checked out into a temporary git worktree; its sources are put first on PYTHONPATH
# (the installed entry points name the same modules), after this tree's executor-bench: the
# harness stays this tree's, the code under test is REV's. Results: OUT_DIR/<bench>-{old,new}.md.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: bash scripts/before_after.sh REV [OUT_DIR]}
out=${2:-bench-before-after}
mkdir -p "$out"
base=$(mktemp -d)
trap 'git worktree remove --force "$base" >/dev/null 2>&1 || rm -rf "$base"' EXIT
git worktree add --detach "$base" "$rev" >/dev/null
# Every distribution's sources in REV (core, channel, the plugins, ...), so that no module of
# this tree's stands in for one of REV's.
old_path=$(find "$base" -mindepth 2 -maxdepth 4 -type d -name src -not -path "*/tests/*" \
  -not -path "$base/bench/*" | paste -sd:)
old_path="$PWD/bench/src:$old_path"
py=.venv/bin/python
run() { # name side args...
  local name=$1 side=$2
  shift 2
  echo "== $name ($side) $(date +%T)" >&2
  if [ "$side" = old ]; then
    PYTHONPATH="$old_path" "$py" "$@" >"$out/$name-$side.md"
  else
    "$py" "$@" >"$out/$name-$side.md"
  fi
}
# `executor bench`'s call rows on mp and uni, twice (each order once), then the reference model.
workloads=${WORKLOADS:-imports,overhead,hot,cold,payload}
for order in "old new" "new old"; do
  for side in $order; do
    run "bench-${order%% *}-first" "$side" -m executor_core bench --no-progress --backends mp,uni \
      --workloads "$workloads" --output-dir "$out/bench-${order%% *}-first-$side"
  done
done
if [ -z "${WORKLOADS:-}" ]; then # the reference model with the default rows only
  for side in old new; do
    run ref "$side" -m executor_core bench --no-progress --backends uni,mp --workloads reference \
      --output-dir "$out/ref-$side"
  done
fi
echo "results in $out/" >&2
