#!/usr/bin/env bash
# Before and after in one sitting: the same benchmark scripts (this tree's) run on the code of
# an earlier revision and on this tree's, alternating, so that the machine's noise hits both.
#
#   bash benchmarks/before_after.sh REV [OUT_DIR]
#
# REV is checked out into a temporary git worktree; its sources are put first on PYTHONPATH
# (the installed entry points name the same modules), after this tree's executor-bench: the
# harness stays this tree's, the code under test is REV's. Results: OUT_DIR/<bench>-{old,new}.md.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: bash benchmarks/before_after.sh REV [OUT_DIR]}
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
for side in old new; do
  run core "$side" -m executor_core bench --no-progress --workloads imports,overhead \
    --output-dir "$out/core-$side"
done
for side in old new; do run mp "$side" benchmarks/bench_multiproc.py --workers 1 2 --startup-repeats 2 --blocks 6; done
for side in new old; do run mp2 "$side" benchmarks/bench_multiproc.py --workers 1 2 --startup-repeats 2 --blocks 6; done
for side in old new; do run ray "$side" benchmarks/bench_ray.py --rounds 10 --calls 20 --phases 6; done
for side in old new; do run ref "$side" benchmarks/bench_reference.py --requests 16; done
for side in new old; do run after-large "$side" benchmarks/bench_small_after_large.py; done
echo "results in $out/" >&2
