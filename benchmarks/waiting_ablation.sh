#!/usr/bin/env bash
# The waiting policy's rules, each removed in turn (executor_channel._spin's docstring names
# them): every variant is a copy of this tree's channel/src with one rule taken out, put
# first on PYTHONPATH for the driver and its workers, and measured beside the unchanged copy
# in interleaved rounds, at default options otherwise. Figures: docs/benchmarks.md, "The
# waiting policy".
#
#   bash benchmarks/waiting_ablation.sh [ROUNDS (default 3)] [OUT_DIR (default waiting-ablation)]
#
# Per variant and round: `executor bench --backends mp --workloads hot,cold,payload`; then
# once each, bench_multiproc.py's no-op next to 2 busy processes (the contention rules; that
# script tunes its mp side's slots to 32 MiB) and bench_small_after_large.py twice (the bulk
# rule). Every other option, the waiting ones included, at its default.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
out=${2:-waiting-ablation}
mkdir -p "$out"
variants=$(mktemp -d)
trap 'rm -rf "$variants"' EXIT
.venv/bin/python - "$variants" <<'PY'
import pathlib, shutil, sys

root = pathlib.Path(sys.argv[1])
removed = {  # variant: (file, the rule's line(s), what stands in their place)
    "base": None,
    "noquiet": ("_spin.py", "        if self.bulk:\n            return\n", "        return\n"),
    "nolost": ("_spin.py", "return time.monotonic() - before < LOST_CPU_S", "return True"),
    "nohandoff": ("_spin.py", "        if not self.start():\n            return\n        if not self.pause()", "        return\n        if not self.pause()"),
    "nobulk": ("_spin.py", "        if self.bulk:\n            return\n", ""),
    "noidle": ("options.py", "idle_spin_s: float = option(0.005,", "idle_spin_s: float = option(0.0,"),
    "nospin": ("options.py", "spin_s: float = option(50e-6,", "spin_s: float = option(0.0,"),
}
for name, change in removed.items():
    shutil.copytree("channel/src", root / name, ignore=shutil.ignore_patterns("__pycache__"))
    if change is None:
        continue
    path = root / name / "executor_channel" / change[0]
    text = path.read_text()
    assert change[1] in text, f"{name}: the rule's code moved; update this script"
    path.write_text(text.replace(change[1], change[2], 1))
# Without spinning there is no idle spin either.
options = root / "nospin" / "executor_channel" / "options.py"
options.write_text(options.read_text().replace("idle_spin_s: float = option(0.005,", "idle_spin_s: float = option(0.0,"))
PY
names="noquiet nolost nohandoff nobulk noidle nospin"
for round in $(seq "$rounds"); do
  for v in base $names; do
    echo "== round $round: $v $(date +%T)" >&2
    PYTHONPATH="$variants/$v" .venv/bin/executor bench --backends mp --baselines pipe \
      --workloads hot,cold,payload --sizes 4K,1M,16M --repeats 10 --no-progress \
      --output-dir "$out/$v-$round" >/dev/null
  done
done
for v in base noquiet nolost; do
  PYTHONPATH="$variants/$v" .venv/bin/python benchmarks/bench_multiproc.py --workers 2 \
    --calls 1000 --blocks 2 --startup-repeats 1 --noop-rounds 4 --busy 2 >"$out/busy-$v.md"
done
for round in 1 2; do
  for v in base nobulk noquiet; do
    PYTHONPATH="$variants/$v" .venv/bin/python benchmarks/bench_small_after_large.py \
      >"$out/after-large-$v-$round.md"
  done
done
# Each variant's median and p99 over base's, per row: the median over rounds.
.venv/bin/python - "$out" "$rounds" $names <<'PY'
import json, statistics, sys

out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[4:]
def rows(v, r):
    with open(f"{out}/{v}-{r}/results.json") as f:
        return {x["title"]: x for x in json.load(f)["results"] if x["side"] == "mp"}
runs = [(rows("base", r), {v: rows(v, r) for v in names}) for r in range(1, rounds + 1)]
print("| row | " + " | ".join(f"without {v[2:]}" for v in names) + " |")
print("|---|" + "---|" * len(names))
for title in runs[0][0]:
    cells = []
    for v in names:
        ratio = lambda q: statistics.median(got[v][title][q] / base[title][q] for base, got in runs)
        cells.append(f"{ratio('median_s'):.2f} / {ratio('p99_s'):.2f}")
    print(f"| {title} | " + " | ".join(cells) + " |")
PY
echo "results in $out/" >&2
