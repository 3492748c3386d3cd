"""The hang watch declares only a rank that holds up the call it watched (``_hangs``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from executor_core._calls import Call, CallTable
from executor_core._errors import ExecutorFailedError
from executor_core._recovery import HangWatch

BOUND_S = 0.2


class _Host:
    """What a watch uses of a host: its call table, its probe lock, ``node_named`` and
    ``worker_died``."""

    def __init__(self) -> None:
        self._table = CallTable()
        self._probe_lock = threading.Lock()
        self.died: list[ExecutorFailedError] = []
        self.declared = threading.Event()

    @property
    def table(self) -> CallTable:
        return self._table

    def _node_named(self, ranks: Sequence[int]) -> str | None:
        return "node-b" if list(ranks) == [1] else None

    def worker_died(self, error: ExecutorFailedError) -> None:
        self.died.append(error)
        self.declared.set()


class _SilentRank:
    """A transport whose rank 1 answers no probe; ``during_probe`` runs inside each probe
    (what the workers do while the watch waits for answers)."""

    def __init__(self, during_probe: Callable[[int], None]) -> None:
        self.during_probe = during_probe
        self.probes = 0
        self.killed: list[int] = []

    def probe(self, ranks: Sequence[int], timeout: float) -> set[int]:
        self.probes += 1
        self.during_probe(self.probes)
        return {1}

    def kill(self, ranks: Sequence[int]) -> None:
        self.killed.extend(ranks)


def _watch(during_probe: Callable[[int], None]) -> tuple[_Host, _SilentRank, Call]:
    host = _Host()
    call = Call(seq=1, method="echo", name="echo", expected=(0, 1))
    host.table.add(call)
    transport = _SilentRank(during_probe)
    # The fakes have the parts of a host and a transport that the watch uses, not their types.
    watch = HangWatch(host, transport, (0, 1), BOUND_S)  # type: ignore[arg-type]
    watch.start()
    return host, transport, call


def _run_for(host: _Host, transport: _SilentRank, probes: int) -> None:
    deadline = time.monotonic() + 10
    while transport.probes < probes and not host.declared.is_set():
        assert time.monotonic() < deadline, "the watch stopped probing"
        time.sleep(0.01)


def test_a_rank_silent_for_the_bound_is_declared_and_killed() -> None:
    host, transport, _ = _watch(lambda probe: None)
    assert host.declared.wait(10)
    assert [getattr(error, "ranks", None) for error in host.died] == [(1,)]
    assert "hung" in str(host.died[0])
    assert getattr(host.died[0], "node", None) == "node-b"  # as the host names rank 1's node
    assert transport.killed == [1]


def test_the_host_names_the_node_of_ranks_where_the_job_spans_several() -> None:
    """Issue 48, item 8: the node the core names in an error of its own (a hang), from the
    contexts the host made: only where the job spans several nodes and the ranks share one."""
    from executor_core import ExecutorConfig
    from executor_core.backend import TransportHost

    config = ExecutorConfig(
        backend="uni", worker_cls="executor_core.testing:ConformanceWorker", tensor_parallel_size=4
    )
    host = TransportHost(config, "test", None)
    host.contexts(["a", "a", "b", "b"], init_method="tcp://127.0.0.1:1")
    assert host._node_named([3]) == "b"
    assert host._node_named([2, 3]) == "b"
    assert host._node_named([1, 2]) is None
    single = TransportHost(config, "test", None)
    single.contexts(["a"] * 4, init_method="tcp://127.0.0.1:1")
    assert single._node_named([3]) is None


def test_a_call_that_completes_during_the_probe_declares_nobody() -> None:
    """Its ranks answered it while the watch waited on the probe: alive, whatever the probe
    said; the next call in flight is watched from its own start."""
    host: _Host
    call: Call

    def complete_late(probe: int) -> None:
        if probe == 3:  # once rank 1 has been silent long enough to be declared
            time.sleep(BOUND_S)
            host.table.deliver(call.seq, 0, True, "a")
            host.table.deliver(call.seq, 1, True, "b")

    host, transport, call = _watch(complete_late)
    _run_for(host, transport, 3)
    time.sleep(4 * BOUND_S)
    assert call.done
    assert call.value == ["a", "b"]
    assert host.died == []
    assert transport.killed == []


def test_a_rank_that_answered_the_call_is_not_declared() -> None:
    """Rank 1 replied; the call waits on rank 0, which answers the probe: nobody is hung,
    however long rank 1 stays silent afterwards."""
    host: _Host
    call: Call

    def rank_1_replied(probe: int) -> None:
        if probe == 1:
            host.table.deliver(call.seq, 1, True, "b")

    host, transport, call = _watch(rank_1_replied)
    _run_for(host, transport, 8)
    assert not call.done
    assert host.died == []
    assert transport.killed == []
