"""The benchmark's parts on their own: sizes, statistics, the plan, finding vLLM."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench_helpers import make_fake_vllm

from executor_bench._baseline_vllm import describe_vllm, import_vllm
from executor_bench._options import DEFAULT_WORKLOADS, MIB, WORKLOADS, format_size, parse_size
from executor_bench._workloads import PAYLOAD_CALLS_MAX, Plan, Row, Summary, percentile


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4K", 4096),
        ("64k", 65536),
        ("1M", MIB),
        ("16MiB", 16 * MIB),
        ("1G", 1 << 30),
        ("4096", 4096),
        ("1.5M", 3 * MIB // 2),
        (" 8 KB ", 8192),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "K", "4X", "-4K", "0", "6", "1.3K", "4 K B"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text).replace("\\", "\\\\")):
        parse_size(text)


def test_format_size() -> None:
    assert [format_size(s) for s in (100, 4096, 3 * MIB // 2, 64 * MIB)] == [
        "100 B",
        "4 KiB",
        "1.5 MiB",
        "64 MiB",
    ]


def test_percentile_is_an_observed_nearest_rank_value() -> None:
    samples = [float(i) for i in range(1, 101)]  # 1 .. 100
    assert percentile(samples, 0.99) == 99.0
    assert percentile(samples, 0.5) == 50.0
    assert percentile(samples[:10], 0.99) == 10.0
    assert percentile([3.0], 0.99) == 3.0
    summary = Summary.of([4.0, 1.0, 3.0, 2.0])
    assert (summary.n, summary.median_s, summary.min_s, summary.max_s) == (4, 2.5, 1.0, 4.0)
    assert summary.p99_s == 4.0


def test_plan() -> None:
    default = Plan.create(quick=False, repeats=None, idle_s=0.002)
    quick = Plan.create(quick=True, repeats=None, idle_s=0.002)
    assert quick.rounds < default.rounds
    assert quick.hot_calls < default.hot_calls
    assert Plan.create(quick=True, repeats=7, idle_s=0.002).rounds == 7
    assert default.startup_samples <= default.rounds
    # Warm-up: enough calls to touch every chunk of vLLM's ring (10) for small and ring-sized
    # payloads, a few for larger ones.
    assert default.warmup_calls(Row("hot")) == 12
    assert default.warmup_calls(Row("payload", "bytes", 16 * MIB)) == 12
    assert default.warmup_calls(Row("payload", "bytes", 64 * MIB)) == 4
    assert quick.warmup_calls(Row("payload", "bytes", 64 * MIB)) == 2
    assert Row("payload", "tensor", MIB).key == "payload/tensor/1048576"
    assert Row("cold").title(0.002) == "no-op after 2 ms idle"
    assert default.calls(Row("nodes")) == default.nodes_calls > quick.nodes_calls
    # Payload rows: small payloads get more calls (a median of three 64 KiB calls is noise),
    # as many as carry payload_bytes, between payload_calls and PAYLOAD_CALLS_MAX.
    assert default.calls(Row("payload", "tensor", 4096)) == PAYLOAD_CALLS_MAX
    assert default.calls(Row("payload", "bytes", 64 * 1024)) == PAYLOAD_CALLS_MAX
    assert default.calls(Row("payload", "tensor", MIB)) == default.payload_bytes // MIB
    assert default.calls(Row("payload", "bytes", 64 * MIB)) == default.payload_calls == 2
    assert quick.calls(Row("payload", "bytes", 4096)) == quick.payload_calls == 1
    assert default.calls(Row("nodes", "bytes", MIB)) == default.nodes_calls


@pytest.mark.parametrize(
    "row",
    [Row("hot"), Row("payload", "tensor", MIB), Row("nodes"), Row("nodes", "bytes", MIB)],
)
def test_a_row_is_found_again_from_its_key(row: Row) -> None:
    assert Row.from_key(row.key) == row
    assert row.method == ("noop" if row.size is None else "size_of")


def test_the_nodes_workload_is_asked_for_not_default() -> None:
    """It starts a node agent and sides of its own: only a run that names it has it."""
    assert "nodes" in WORKLOADS
    assert "nodes" not in DEFAULT_WORKLOADS
    assert Row("nodes", "bytes", MIB).title(0.002) == "2 nodes: bytes 1 MiB"


@pytest.fixture
def clean_vllm_import(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Whatever vllm modules and sys.path entries a test imports are gone after it."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name == "vllm" or name.startswith("vllm."):
            del sys.modules[name]


@pytest.mark.usefixtures("clean_vllm_import")
def test_import_vllm_from_a_path(tmp_path: Path) -> None:
    root = make_fake_vllm(tmp_path)
    module = import_vllm(str(root))
    assert module.__name__ == "vllm.distributed.device_communicators.shm_broadcast"
    assert sys.path[0] == str(root)  # spawned readers inherit it
    assert describe_vllm(module) == f"vllm 0.0.test ({root})"


@pytest.mark.usefixtures("clean_vllm_import")
def test_import_vllm_says_why_not(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(LookupError, match="vllm is not installed and no --vllm-path"):
            import_vllm(None)
    with pytest.raises(LookupError, match="holds no vllm/distributed/device_communicators"):
        import_vllm(str(tmp_path))
    broken = make_fake_vllm(tmp_path / "broken", "import vllm.platforms.nowhere\n")
    with pytest.raises(LookupError, match=r"cannot import .* from .*broken: ModuleNotFound"):
        import_vllm(str(broken))


@pytest.mark.parametrize("tcp_host", [None, "127.0.0.1"])
def test_the_zmq_baseline_answers_over_ipc_and_tcp(tcp_host: str | None) -> None:
    from executor_bench._baseline_zmq import ZmqSide

    side = ZmqSide(2, tcp_host=tcp_host)
    try:
        assert side.call("size_of", (b"x" * 5000,)) == [5000, 5000]
        assert side.call("noop", ()) == [None, None]
    finally:
        side.close()
    assert all(not proc.is_alive() for proc in side._procs)
