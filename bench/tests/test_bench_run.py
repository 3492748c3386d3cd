"""``executor bench`` end to end, with small options: what it writes, and what it skips."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from bench_helpers import make_fake_vllm, run_executor

pytestmark = pytest.mark.slow

BACKENDS = ("uni", "mp")
SIZES = (4096, 1 << 20)
ROUNDS = 3
#: --quick's calls per round: hot no-ops, cold no-ops, calls per payload size.
QUICK_CALLS = {"hot": 40, "cold": 10, "payload": 1}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One small run: uni and mp against the Pipe baseline; the vLLM baseline is asked for
    with a --vllm-path that holds no vLLM."""
    base = tmp_path_factory.mktemp("bench")
    empty = base / "no-vllm-here"
    empty.mkdir()
    out = base / "out"
    result = run_executor(
        "bench",
        "--backends",
        ",".join(BACKENDS),
        "--sizes",
        "4K,1M",
        "--repeats",
        str(ROUNDS),
        "--quick",
        "--baselines",
        "pipe,vllm",
        "--vllm-path",
        str(empty),
        "--output-dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        "out": out,
        "empty": empty,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "json": json.loads((out / "results.json").read_text()),
    }


def _rows(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["row"], r["side"]): r for r in document["results"]}


def test_json_has_a_row_per_side_workload_and_size(small_run: dict[str, Any]) -> None:
    rows = _rows(small_run["json"])
    keys = ["hot", "cold", "startup", "shutdown"]
    keys += [f"payload/{kind}/{size}" for kind in ("bytes", "tensor") for size in SIZES]
    for side in (*BACKENDS, "Pipe"):
        for key in keys:
            row = rows.get((key, side))
            assert row is not None, f"no {key} row for {side}"
            assert 0 < row["min_s"] <= row["median_s"] <= row["p99_s"] <= row["max_s"], row
    assert len(rows) == len(keys) * 3
    # Every round runs every call row once per side: the sample counts say so.
    for side in (*BACKENDS, "Pipe"):
        assert rows["hot", side]["n"] == ROUNDS * QUICK_CALLS["hot"]
        assert rows["cold", side]["n"] == ROUNDS * QUICK_CALLS["cold"]
        assert rows[f"payload/bytes/{SIZES[1]}", side]["n"] == ROUNDS * QUICK_CALLS["payload"]
        assert rows["startup", side]["n"] == 1


def test_backends_have_ratios_against_the_pipe_baseline(small_run: dict[str, Any]) -> None:
    rows = _rows(small_run["json"])
    for (key, side), row in rows.items():
        if side == "Pipe":
            assert row["ratios"] == {}
            continue
        pipe = rows[key, "Pipe"]
        ratio = row["ratios"]["Pipe"]
        assert ratio["median"] == pytest.approx(row["median_s"] / pipe["median_s"])
        assert ratio["p99"] == pytest.approx(row["p99_s"] / pipe["p99_s"])


def test_sides_are_described(small_run: dict[str, Any]) -> None:
    document = small_run["json"]
    sides = {side["name"]: side for side in document["sides"]}
    assert list(sides) == ["uni", "mp", "Pipe"]
    assert sides["uni"]["workers"] == 1  # uni runs one worker: it says so
    assert "1 worker" in sides["uni"]["note"]
    assert sides["mp"]["workers"] == sides["Pipe"]["workers"] == 2
    assert sides["mp"]["version"].startswith("executor-plugin-multiproc ")
    assert document["options"]["backend_options"] == "default"
    assert document["facts"]["plugins"] == "only the measured backends' (multiproc, uniproc)"
    assert document["failed"] == []
    machine = document["machine"]
    assert machine["cores"] >= 1
    assert machine["python"].split()[-1].count(".") == 2
    assert "bench --backends uni,mp" in document["command"]


def test_an_unavailable_baseline_is_skipped_with_the_reason(small_run: dict[str, Any]) -> None:
    skipped = small_run["json"]["skipped"]
    assert [(s["name"], s["role"]) for s in skipped] == [("vLLM MQ", "baseline")]
    reason = skipped[0]["reason"]
    assert str(small_run["empty"]) in reason
    assert "shm_broadcast.py" in reason
    markdown = (small_run["out"] / "results.md").read_text()
    assert f"- vLLM MQ (baseline): {reason}" in markdown


def test_markdown_table_is_printed_and_written(small_run: dict[str, Any]) -> None:
    markdown = (small_run["out"] / "results.md").read_text()
    assert markdown in small_run["stdout"]
    lines = markdown.splitlines()
    header = lines.index("| row | side | median | p99 | n | ÷ Pipe |")
    table = []
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        table.append(line)
    assert len(table) == len(small_run["json"]["results"])
    assert all(line.count("|") == 7 for line in table)
    assert any(line.startswith("| no-op after 2 ms idle | mp |") for line in table)
    assert "Default options: every backend runs at its default options" in markdown
    assert "## Targets" not in markdown  # no vLLM measured: no target to check


def test_plot_is_a_png(small_run: dict[str, Any]) -> None:
    data = (small_run["out"] / "latency.png").read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    assert width > height > 100  # two panels side by side


def test_progress_bar_reaches_the_end_on_stderr(small_run: dict[str, Any]) -> None:
    assert "100%" in small_run["stderr"]
    assert "100%" not in small_run["stdout"]


def test_vllm_baseline_gives_the_targets_rows(tmp_path: Path) -> None:
    """The vLLM baselines (here over a stand-in queue), with Pipe replies and with each
    reader's own reply queue, measure the no-op rows, hot and cold, and the targets against
    the first are checked."""
    fake = make_fake_vllm(tmp_path / "fake")
    out = tmp_path / "out"
    result = run_executor(
        "bench",
        "--backends",
        "mp",
        "--baselines",
        "vllm,vllm-own",
        "--vllm-path",
        str(fake),
        "--workloads",
        "hot,cold",
        "--quick",
        "--repeats",
        "1",
        "--no-progress",
        "--output-dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((out / "results.json").read_text())
    assert document["skipped"] == []
    baselines = [side for side in document["sides"] if side["role"] == "baseline"]
    assert [side["name"] for side in baselines] == ["vLLM MQ", "vLLM MQ, own replies"]
    assert all(side["version"] == f"vllm 0.0.test ({fake})" for side in baselines)
    assert "Pipe" in baselines[0]["note"]
    assert "MessageQueue each" in baselines[1]["note"]
    vllms = ("vLLM MQ", "vLLM MQ, own replies")
    rows = _rows(document)
    assert set(rows) == {(key, side) for key in ("hot", "cold") for side in ("mp", *vllms)}
    for key in ("hot", "cold"):
        for vllm in vllms:
            assert rows[key, vllm]["p99_s"] >= rows[key, vllm]["median_s"] > 0
        assert set(rows[key, "mp"]["ratios"]) == set(vllms)
    targets = {(t["row"], t["statistic"]): t for t in document["targets"]}
    assert set(targets) == {("cold", "median"), ("hot", "p99")}
    cold = targets["cold", "median"]
    assert cold["ratio"] == pytest.approx(
        rows["cold", "mp"]["median_s"] / rows["cold", "vLLM MQ"]["median_s"]
    )
    # One round: the ratio is that round's, too few rounds for a verdict.
    assert cold["interval"] == [cold["ratio"], cold["ratio"]]
    assert (cold["verdict"], cold["met"], cold["units"]) == ("undecided", False, 1)
    assert "too few for a verdict" in cold["note"]
    assert "block bootstrap" in targets["hot", "p99"]["note"]
    assert "## Targets" in (out / "results.md").read_text()
    assert not result.stderr.strip(), result.stderr  # no progress bar, no warnings


def test_the_core_cost_per_call_is_measured_against_a_direct_call(
    small_run: dict[str, Any],
) -> None:
    overhead = small_run["json"]["overhead"]
    ways = overhead["us_per_call"]
    assert set(ways) == {
        "direct",
        "collective_rpc",
        "callable collective_rpc",
        "execute_model",
        "non_block collective_rpc + result()",
        "observed collective_rpc",
        "observed execute_model",
        "driver-observed collective_rpc",
    }
    assert all(us > 0 for us in ways.values())
    # Through the executor costs more than the method alone, and the figures add up.
    for way, over in overhead["us_over_direct"].items():
        assert over > 0
        assert abs(ways[way] - ways["direct"] - over) < 1e-9
    targets = {t["way"]: t for t in overhead["targets"]}
    assert set(targets) == {"observed collective_rpc", "observed execute_model"}
    for t in targets.values():
        low, high = t["interval"]
        assert low <= t["us_over_direct"] <= high
        assert t["verdict"] in ("met", "not met", "undecided")
        assert t["met"] == (t["verdict"] == "met")
        assert t["verdict"] != "met" or high <= t["limit_us"]
        assert t["verdict"] != "not met" or low > t["limit_us"]
    markdown = (small_run["out"] / "results.md").read_text()
    assert "## The core's cost per call (uni, in one process)" in markdown


def test_import_times_are_measured_in_fresh_interpreters(small_run: dict[str, Any]) -> None:
    imports = small_run["json"]["imports"]
    assert set(imports) == {
        "import executor_core",
        "the users' API (Executor, ExecutorConfig, hookimpl, create_executor)",
        "baseline: import attrs",
        "baseline: import pluggy",
    }
    assert all(ms > 0 for ms in imports.values())
    assert "## Import time" in (small_run["out"] / "results.md").read_text()


def test_a_sigterm_stops_a_run_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """A scheduler's SIGTERM mid-run: the run stops like Ctrl-C, every side it started is
    closed (no process of its left, no shared memory of the channel's)."""
    shm_before = set(os.listdir("/dev/shm"))
    env = {k: v for k, v in os.environ.items() if k != "EXECUTOR_PLUGINS"}
    command = [sys.executable, "-m", "executor_core", "bench", "--backends", "mp"]
    command += ["--baselines", "pipe", "--workloads", "hot", "--repeats", "400"]
    command += ["--no-progress", "--output-dir", str(tmp_path)]
    bench = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        process = psutil.Process(bench.pid)
        deadline = time.monotonic() + 60
        # Both sides running: mp's 2 workers and the Pipe baseline's 2 readers at least.
        while len(process.children(recursive=True)) < 4:
            assert bench.poll() is None, bench.communicate()
            assert time.monotonic() < deadline, "the bench never started its sides"
            time.sleep(0.2)
        time.sleep(1.0)  # into the timed calls
        children = process.children(recursive=True)
        bench.send_signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode != 0
    assert "KeyboardInterrupt" in stderr
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running: {alive}"
    assert set(os.listdir("/dev/shm")) - shm_before == set()


def test_the_nodes_workload_measures_mp_across_two_nodes_against_the_wire(tmp_path: Path) -> None:
    """``--workloads nodes``: mp with rank 1 under a node agent on 127.0.0.2, the raw pyzmq
    wire and vLLM's remote reader (here a stand-in), each on a no-op and a 1 MiB argument;
    the four targets are judged; the sides of other workloads are not started, and the
    agent is gone after the run."""
    fake = make_fake_vllm(tmp_path / "fake")
    out = tmp_path / "out"
    began = time.time()
    result = run_executor(
        "bench",
        "--backends",
        "mp",
        "--baselines",
        "vllm",
        "--vllm-path",
        str(fake),
        "--workloads",
        "nodes",
        "--quick",
        "--no-progress",
        "--output-dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((out / "results.json").read_text())
    assert document["skipped"] == document["failed"] == []
    sides = ["mp, 2 nodes", "pyzmq over TCP", "vLLM MQ, remote reader"]
    assert [side["name"] for side in document["sides"]] == sides
    assert "agent on 127.0.0.2" in document["sides"][0]["note"]
    rows = _rows(document)
    keys = ("nodes", f"nodes/bytes/{1 << 20}")
    assert set(rows) == {(key, side) for key in keys for side in sides}
    for key in keys:
        assert all(rows[key, side]["n"] == 2 * 5 for side in sides)  # --quick: 2 rounds of 5
        assert set(rows[key, "mp, 2 nodes"]["ratios"]) == set(sides[1:])
    targets = {(t["row"], t["baseline"]): t for t in document["targets"]}
    assert set(targets) == {(key, side) for key in keys for side in sides[1:]}
    wire = targets["nodes", "pyzmq over TCP"]
    assert (wire["limit"], wire["title"]) == (1.5, "mp, 2 nodes: no-op, median")
    assert targets[keys[1], "vLLM MQ, remote reader"]["limit"] == 0.8
    assert all(t["verdict"] in ("met", "not met", "undecided") for t in targets.values())
    agents = [
        p
        for p in psutil.process_iter(["cmdline", "create_time"])
        if p.info["create_time"] >= began - 1
        and "node" in (p.info["cmdline"] or [])
        and "127.0.0.2" in (p.info["cmdline"] or [])
    ]
    assert agents == [], "a node agent outlived the run"


def test_the_vllm_baseline_lays_out_a_remote_reader_as_vllm_does(tmp_path: Path) -> None:
    """``remote_ranks``: those readers are remote (an address, no ring), and so are their
    reply queues' reader (the driver); the calls still reach every rank."""
    fake = make_fake_vllm(tmp_path)
    script = (
        "from executor_bench import _baseline_vllm as b\n"
        f"b.import_vllm({str(fake)!r})\n"
        "s = b.VllmQueueSide(2, own_replies=True, remote_ranks=(1,), remote_ip='127.0.0.2')\n"
        "print(s.call('size_of', (b'x' * 5000,)), s._queue.layout,"
        " [r.buffer is None for r in s._replies])\n"
        "s.close()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[5000, 5000] (2, 1, [0], '127.0.0.2') [False, True]"
