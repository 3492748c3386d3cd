"""Rank replacement without an executor: survivors leave their broken process group and
rejoin new ranks at a new rendezvous (``ParallelState.rejoin``, ``WorkerBase.rejoin``), in
real processes on gloo; and ``leave_process_group``'s teardown of a broken group."""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import pytest
import torch
import torch.distributed as dist

from executor_core import WorkerBase, WorkerContext
from executor_core.backend import tcp_init_method
from executor_core.torch import ParallelState, init_distributed, leave_process_group

#: Every process group's timeout: a rank that waits on a dead one fails within it.
GROUP_TIMEOUT_S = 30.0
#: The longest the test waits on a child for anything (a message, an exit).
WAIT_S = 60.0

_spawn = torch.multiprocessing.get_context("spawn")


def _context(rank: int, world: int, init_method: str, tp: int = 1, pp: int = 1) -> WorkerContext:
    return WorkerContext(
        rank=rank,
        local_rank=rank,
        world_size=world,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_init_method=init_method,
        local_world_size=world,
    )


# --- the children ---------------------------------------------------------------------------


def _get(inbox: Connection) -> Any:
    """The next thing the test sends this child (within WAIT_S)."""
    if not inbox.poll(WAIT_S):
        raise TimeoutError(f"the test sent nothing within {WAIT_S} s")
    return inbox.recv()


def _child(body: Callable[..., None], rank: int, outbox: Connection, *args: Any) -> None:
    """Run ``body``; a failure is reported to the test (with its traceback), not only
    printed, so that the test fails at once with it."""
    try:
        body(rank, outbox, *args)
    except BaseException:
        outbox.send(("error", rank, traceback.format_exc()))
        raise


def _sums(state: ParallelState) -> tuple[float, float]:
    """Each rank brings ``rank + 1``: the sum over the world and over this rank's TP (or,
    without TP, PP) group, which here is the world too."""
    world = torch.tensor([float(state.rank + 1)])
    dist.all_reduce(world)
    group_sum = torch.tensor([float(state.rank + 1)])
    group = state.tp_group if state.tp_group is not None else state.pp_group
    if group is not None:
        dist.all_reduce(group_sum, group=group)
    return world.item(), group_sum.item()


def _survivor(rank: int, outbox: Connection, inbox: Connection, context: WorkerContext) -> None:
    """A rank of the first group; rank 1 is killed in it, ranks 0 and 2 rejoin."""
    state = init_distributed(context, timeout_s=GROUP_TIMEOUT_S, cpu_threads=1)
    outbox.send(("summed", rank, (_sums(state), os.getpid())))
    if rank == 0 and state.pp_size > 1:
        # A send to rank 1 that rank 1 never receives: pending when it dies.
        state.send_to_next_stage(torch.ones(1 << 20))
    if rank == 2:
        outbox.send(("receiving", rank, None))
        try:
            dist.recv(torch.zeros(1), src=0)  # rank 0 never sends: it blocks until 0 leaves
        except RuntimeError as error:
            outbox.send(("recv failed", rank, str(error)))
    else:
        outbox.send(("idle", rank, None))
    new_context = _get(inbox)
    new_state = state.rejoin(new_context, timeout_s=GROUP_TIMEOUT_S, cpu_threads=1)
    state.destroy()  # the old state's: it must leave the new group alone
    outbox.send(("rejoined", rank, (_sums(new_state), os.getpid())))
    _get(inbox)  # held until the test ends (it kills every child)


def _newcomer(rank: int, outbox: Connection, inbox: Connection, context: None) -> None:
    """A new process for a dead rank, started early (importing torch takes seconds) and
    given its context once the rank died: it joins the new group as at a first start."""
    state = init_distributed(_get(inbox), timeout_s=GROUP_TIMEOUT_S, cpu_threads=1)
    outbox.send(("rejoined", rank, (_sums(state), os.getpid())))
    _get(inbox)


class _GroupWorker(WorkerBase):
    """A worker whose init_device joins the groups (as most torch workers' does)."""

    def __init__(self, *, context: WorkerContext) -> None:
        super().__init__(context=context)
        self.init_device_calls = 0
        self.load_model_calls = 0

    def init_device(self) -> None:
        self.init_device_calls += 1
        self.state = init_distributed(self.context, timeout_s=GROUP_TIMEOUT_S, cpu_threads=1)

    def load_model(self) -> None:
        self.load_model_calls += 1


def _worker_rank(
    rank: int, outbox: Connection, inbox: Connection, context: WorkerContext | None
) -> None:
    """A _GroupWorker started as the executor starts one: init_device, load_model; on a
    new context, rejoin. Without a context (a new rank's process, started early), it waits
    for its own."""
    worker = _GroupWorker(context=context or _get(inbox))
    worker.init_device()
    worker.load_model()
    outbox.send(("summed", rank, (_sums(worker.state), os.getpid())))
    new_context = _get(inbox)
    worker.rejoin(new_context)
    calls = (worker.init_device_calls, worker.load_model_calls)
    moved = worker.context == new_context
    outbox.send(("rejoined", rank, (_sums(worker.state), os.getpid(), calls, moved)))
    _get(inbox)


# --- the test's side ------------------------------------------------------------------------


class _Child:
    """One child process, the pipe the test writes to it (``inbox``) and the one it writes
    back on. A pipe of its own each way: a child killed while writing to a queue that
    others share (holding its lock) would block their writes."""

    def __init__(self, process: Any, inbox: Connection, reader: Connection) -> None:
        self.process = process
        self.inbox = inbox
        self.reader = reader
        self.killed = False
        self.closed = False


class _Ranks:
    """The children of one test and the messages they send back."""

    def __init__(self) -> None:
        self.children: list[_Child] = []
        self._early: list[tuple[str, int, Any]] = []

    def start(
        self, body: Callable[..., None], rank: int, context: WorkerContext | None = None
    ) -> _Child:
        """Start ``body`` as ``rank`` in ``context`` (or one it waits for in its inbox)."""
        child_inbox, inbox = _spawn.Pipe(duplex=False)
        reader, child_outbox = _spawn.Pipe(duplex=False)
        process = _spawn.Process(
            target=_child, args=(body, rank, child_outbox, child_inbox, context), daemon=True
        )
        process.start()
        child_inbox.close()
        child_outbox.close()  # the child's end: the test sees EOF when the child ends
        child = _Child(process, inbox, reader)
        self.children.append(child)
        return child

    def _next(self, timeout: float) -> tuple[str, int, Any]:
        """The next message from any child; ``queue.Empty`` if none comes in ``timeout``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            open_ = [child for child in self.children if not child.closed]
            ready = wait([child.reader for child in open_], left)
            for child in open_:
                if child.reader not in ready:
                    continue
                try:
                    message: tuple[str, int, Any] = child.reader.recv()
                except EOFError:  # the child ended (or was killed)
                    child.closed = True
                    continue
                if message[0] == "error":
                    pytest.fail(f"rank {message[1]} failed:\n{message[2]}")
                return message
        raise queue.Empty

    def take(self, tag: str, rank: int) -> Any:
        """The payload of ``rank``'s ``tag`` message, waiting for it (within WAIT_S)."""
        for index, (t, r, payload) in enumerate(self._early):
            if (t, r) == (tag, rank):
                del self._early[index]
                return payload
        deadline = time.monotonic() + WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self._next(min(left, 1.0))
            except queue.Empty:
                self._check_alive()
                continue
            if message[:2] == (tag, rank):
                return message[2]
            self._early.append(message)
        pytest.fail(f"rank {rank} sent no {tag!r} within {WAIT_S} s")

    def _check_alive(self) -> None:
        """Fail at once if a child the test did not kill has died (a crash in torch, say)."""
        for child in self.children:
            if not child.killed and child.process.exitcode is not None:
                pytest.fail(f"a child (pid {child.process.pid}) died: {child.process.exitcode}")

    def quiet_for(self, seconds: float) -> list[tuple[str, int, Any]]:
        """Every message sent within ``seconds`` (none, if every rank is blocked)."""
        deadline = time.monotonic() + seconds
        got = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                got.append(self._next(left))
            except queue.Empty:
                break
        self._early.extend(got)
        return got

    @staticmethod
    def kill(child: _Child) -> None:
        child.killed = True
        child.process.kill()
        child.process.join(WAIT_S)
        assert child.process.exitcode is not None, "a SIGKILLed rank still runs"

    def close(self) -> None:
        """Stop every child: killed, as the test has what it needs (and an interpreter's
        exit with torch loaded takes a while)."""
        for child in self.children:
            if child.process.is_alive():
                child.process.kill()
        for child in self.children:
            child.process.join(WAIT_S)
            child.inbox.close()
            child.reader.close()


@pytest.fixture
def ranks() -> Iterator[_Ranks]:
    started = _Ranks()
    try:
        yield started
    finally:
        started.close()


@pytest.mark.parametrize(("tp", "pp"), [(3, 1), (1, 3)], ids=["tp3", "pp3"])
def test_survivors_rejoin_a_replaced_rank_in_their_own_processes(
    ranks: _Ranks, tp: int, pp: int
) -> None:
    # The dead rank's replacement starts first: its torch import overlaps the others'.
    new_rank = ranks.start(_newcomer, 1)
    first = tcp_init_method()
    old = [ranks.start(_survivor, r, _context(r, 3, first, tp, pp)) for r in range(3)]
    pids = {}
    for rank in range(3):
        sums, pids[rank] = ranks.take("summed", rank)
        assert sums == (6.0, 6.0)
    ranks.take("idle", 0)
    ranks.take("idle", 1)
    ranks.take("receiving", 2)

    ranks.kill(old[1])
    if pp == 1:
        # Rank 2 waits on rank 0, which is alive: the death alone does not free it.
        assert ranks.quiet_for(0.5) == []

    second = tcp_init_method()
    assert second != first
    for rank, child in ((0, old[0]), (1, new_rank), (2, old[2])):
        child.inbox.send(_context(rank, 3, second, tp, pp))

    # Rank 0 left the old group, which freed rank 2's receive from it.
    assert "Connection closed by peer" in ranks.take("recv failed", 2)
    for rank in range(3):
        sums, pid = ranks.take("rejoined", rank)
        assert sums == (6.0, 6.0), f"rank {rank}"
        assert pid == (new_rank.process.pid if rank == 1 else pids[rank]), f"rank {rank}"


def test_worker_rejoin_by_default_rebuilds_the_groups_without_loading_again(
    ranks: _Ranks,
) -> None:
    new_rank = ranks.start(_worker_rank, 1)  # waits for its context
    first = tcp_init_method()
    survivor = ranks.start(_worker_rank, 0, _context(0, 2, first))
    dying = ranks.start(_worker_rank, 1, _context(1, 2, first))
    sums, pid = ranks.take("summed", 0)
    assert sums[0] == 3.0
    ranks.take("summed", 1)
    ranks.kill(dying)

    second = tcp_init_method()
    survivor.inbox.send(_context(0, 2, second))
    new_rank.inbox.send(_context(1, 2, second))
    sums_after, pid_after, calls, moved = ranks.take("rejoined", 0)
    assert sums_after[0] == 3.0
    assert ranks.take("summed", 1)[0][0] == 3.0  # the new rank 1's first start
    assert pid_after == pid == survivor.process.pid
    assert calls == (2, 1), "init_device ran again, load_model did not"
    assert moved, "the worker took its new context"


# --- in this process ------------------------------------------------------------------------


def test_leave_process_group_without_a_group_is_a_no_op() -> None:
    assert not dist.is_initialized()
    leave_process_group()
    assert not dist.is_initialized()


def test_worker_rejoin_without_torch_distributed_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from executor_core import WorkerBase, WorkerContext\n"
        "def place(init):\n"
        "    return WorkerContext(rank=0, local_rank=0, world_size=2, tensor_parallel_size=1,\n"
        "                         pipeline_parallel_size=1, distributed_init_method=init)\n"
        "class W(WorkerBase):\n"
        "    def init_device(self):\n"
        "        self.joined = self.context.distributed_init_method\n"
        "worker = W(context=place('tcp://127.0.0.1:1'))\n"
        "worker.rejoin(place('tcp://127.0.0.1:2'))\n"
        "assert worker.joined == 'tcp://127.0.0.1:2', worker.joined\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=WAIT_S)


def _state(rank: int = 0, world: int = 2, *, owns: bool = True) -> ParallelState:
    return ParallelState(
        _context(rank, world, "tcp://127.0.0.1:1"),
        torch.device("cpu"),
        backend="gloo",
        tp_group=None,
        pp_group=None,
        owns_process_group=owns,
    )


@pytest.mark.parametrize(
    "context",
    [
        _context(1, 2, "tcp://127.0.0.1:2"),
        _context(0, 3, "tcp://127.0.0.1:2"),
        _context(0, 2, "tcp://127.0.0.1:2", tp=2),
    ],
    ids=["another-rank", "another-world-size", "another-layout"],
)
def test_rejoin_elsewhere_is_refused(context: WorkerContext) -> None:
    with pytest.raises(ValueError, match=r"rejoin keeps a surviving rank's place.*rank 0 of 2"):
        _state().rejoin(context)


def test_rejoin_with_the_users_process_group_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"needs the executor to own the process group"):
        _state(owns=False).rejoin(_context(0, 2, "tcp://127.0.0.1:2"))


class _FakeWorld:
    """torch.distributed's group state, with teardowns that fail as the test says."""

    def __init__(self, backend: str, *, destroy_fails: bool, abort_fails: bool = False) -> None:
        self.backend = backend
        self.initialised = True
        self.calls: list[str] = []
        self.destroy_fails = destroy_fails
        self.abort_fails = abort_fails

    def destroy(self) -> None:
        self.calls.append("destroy")
        if self.destroy_fails:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1")
        self.initialised = False

    def abort(self) -> None:
        self.calls.append("abort")
        if self.abort_fails:
            raise dist.DistBackendError("NCCL communicator was aborted")
        self.initialised = False


@pytest.fixture
def fake_world(monkeypatch: pytest.MonkeyPatch) -> Callable[..., _FakeWorld]:
    def install(backend: str, **fails: bool) -> _FakeWorld:
        world = _FakeWorld(backend, **fails)
        monkeypatch.setattr(dist, "is_initialized", lambda: world.initialised)
        monkeypatch.setattr(dist, "get_backend", lambda: world.backend)
        monkeypatch.setattr(dist, "destroy_process_group", world.destroy)
        monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", world.abort)
        return world

    return install


def test_leave_aborts_an_nccl_group_rather_than_destroy_it(
    fake_world: Callable[..., _FakeWorld],
) -> None:
    world = fake_world("cpu:gloo,cuda:nccl", destroy_fails=False)
    leave_process_group()
    assert world.calls == ["abort"]
    assert not world.initialised


def test_leave_logs_a_broken_groups_error_and_still_leaves(
    fake_world: Callable[..., _FakeWorld], caplog: pytest.LogCaptureFixture
) -> None:
    world = fake_world("gloo", destroy_fails=True)
    with caplog.at_level(logging.WARNING, logger="executor_core"):
        leave_process_group()
    assert world.calls == ["destroy", "abort"]
    assert not world.initialised
    assert "Connection closed by peer" in caplog.text


def test_leave_says_so_when_no_teardown_let_go_of_the_group(
    fake_world: Callable[..., _FakeWorld],
) -> None:
    fake_world("nccl", destroy_fails=True, abort_fails=True)
    with pytest.raises(RuntimeError, match=r"could not leave the torch.distributed process"):
        leave_process_group()


def test_leave_without_torchs_abort_destroys(
    fake_world: Callable[..., _FakeWorld], monkeypatch: pytest.MonkeyPatch
) -> None:
    world = fake_world("nccl", destroy_fails=False)
    monkeypatch.delattr(dist.distributed_c10d, "_abort_process_group")
    leave_process_group()
    assert world.calls == ["destroy"]
