"""The reference worker survives a rank replacement: with tp=2, rank 1 is killed and
replaced; rank 0 rejoins (``WorkerSetup.rejoin``) with the same weights, in the same
memory, without reading the checkpoint again, and the next step gives the same tokens.
Driven directly, without an executor, in spawned processes on gloo."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from executor_core import WorkerContext
from executor_core.backend import tcp_init_method
from executor_reference import MODEL_SIZES, ReferenceWorker, StepInput, ensure_checkpoint

#: Every process group's timeout: a rank that waits on a dead one fails within it.
GROUP_TIMEOUT_S = 30.0
#: The longest the test waits on a child for anything.
WAIT_S = 60.0
#: One prefill step: at start_pos 0 it overwrites the KV cache it uses, so it gives the
#: same tokens on a rank that kept its cache and on a new one.
STEP = StepInput(batch_id=0, slots=(0, 1), token_ids=((1, 2, 3, 4), (9, 8, 7, 6)), start_pos=0)

_spawn = torch.multiprocessing.get_context("spawn")


def _context(rank: int, init_method: str) -> WorkerContext:
    return WorkerContext(
        rank=rank,
        local_rank=rank,
        world_size=2,
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        distributed_init_method=init_method,
        local_world_size=2,
    )


class _CountingWorker(ReferenceWorker):
    """A ReferenceWorker that counts its loads and its checkpoint reads."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loads = self.shard_reads = 0

    def load_model(self) -> None:
        self.loads += 1
        super().load_model()

    def _read_shard(self) -> dict[str, torch.Tensor]:
        self.shard_reads += 1
        return super()._read_shard()


def _tokens(worker: ReferenceWorker) -> tuple[int, ...] | None:
    output = worker.execute_model(STEP)
    return None if output is None else output.next_tokens


def _get(inbox: Connection) -> Any:
    """The next thing the test sends this child (within WAIT_S)."""
    if not inbox.poll(WAIT_S):
        raise TimeoutError(f"the test sent nothing within {WAIT_S} s")
    return inbox.recv()


def _rank(
    rank: int,
    outbox: Connection,
    inbox: Connection,
    context: WorkerContext | None,
    checkpoint: str,
    asleep: bool,
) -> None:
    """Start as the executor starts a rank (init_device, load_model), run the step; then, on
    a new context, rejoin (``asleep``: at sleep level 1, woken after) and run it again.
    Without a context (a new rank's process, started early: importing torch takes seconds)
    it waits for its own."""
    try:
        worker = _CountingWorker(
            context=context or _get(inbox),
            checkpoint=checkpoint,
            kv_slots=2,
            distributed_timeout_s=GROUP_TIMEOUT_S,
            cpu_threads=1,
        )
        worker.init_device()
        worker.load_model()
        outbox.send(("stepped", rank, _tokens(worker)))
        new_context = _get(inbox)
        weight = next(iter(worker._weights().values()))
        # Asleep, the weights' memory is the offloader's until wake_up gives new tensors.
        before = (0 if asleep else weight.data_ptr(), worker.loaded_bytes, worker.offloader)
        if asleep:
            worker.sleep(1)
        worker.rejoin(new_context)
        if asleep:
            worker.wake_up()
        tokens = _tokens(worker)
        after = (0 if asleep else weight.data_ptr(), worker.loaded_bytes, worker.offloader)
        kept = next(iter(worker._weights().values())) is weight and after == before
        assert worker.state is not None
        moved = worker.context == new_context == worker.state.context
        calls = (worker.loads, worker.shard_reads)
        outbox.send(("rejoined", rank, (tokens, kept, moved, calls, os.getpid())))
        _get(inbox)  # held until the test ends (it kills every child)
    except BaseException:
        outbox.send(("error", rank, traceback.format_exc()))
        raise


class _Child:
    """One child process, the pipe the test writes to it (``inbox``) and the one it writes
    back on. A pipe of its own each way: a child killed while writing to a queue that
    others share (holding its lock) would block their writes."""

    def __init__(self, process: Any, inbox: Connection, reader: Connection) -> None:
        self.process = process
        self.inbox = inbox
        self.reader = reader

    def take(self, tag: str) -> Any:
        """The payload of this child's next message, which must be ``tag`` (within WAIT_S)."""
        deadline = time.monotonic() + WAIT_S
        while not self.reader.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                pytest.fail(f"no {tag!r} within {WAIT_S} s")
        try:
            got, rank, payload = self.reader.recv()
        except EOFError:  # it died unasked (a crash in torch, say)
            self.process.join(WAIT_S)
            pytest.fail(f"a child died (exit code {self.process.exitcode}) before {tag!r}")
        if got == "error":
            pytest.fail(f"rank {rank} failed:\n{payload}")
        assert got == tag, f"rank {rank} sent {got!r}, not {tag!r}"
        return payload


class _Ranks:
    """The test's children."""

    def __init__(self, checkpoint: Path, asleep: bool) -> None:
        self.checkpoint = str(checkpoint)
        self.asleep = asleep
        self.children: list[_Child] = []

    def start(self, rank: int, context: WorkerContext | None = None) -> _Child:
        """Start ``rank`` in ``context`` (or one it waits for in its inbox)."""
        child_inbox, inbox = _spawn.Pipe(duplex=False)
        reader, child_outbox = _spawn.Pipe(duplex=False)
        process = _spawn.Process(
            target=_rank,
            args=(rank, child_outbox, child_inbox, context, self.checkpoint, self.asleep),
            daemon=True,
        )
        process.start()
        child_inbox.close()
        child_outbox.close()  # the child's end: the test sees EOF when the child ends
        child = _Child(process, inbox, reader)
        self.children.append(child)
        return child

    def close(self) -> None:
        """Stop every child: killed, as the test has what it needs."""
        for child in self.children:
            if child.process.is_alive():
                child.process.kill()
        for child in self.children:
            child.process.join(WAIT_S)
            child.inbox.close()
            child.reader.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_checkpoint(MODEL_SIZES["tiny"], tmp_path_factory.mktemp("reference"))


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.slow)], ids=["awake", "asleep"])
def ranks(checkpoint: Path, request: pytest.FixtureRequest) -> Iterator[_Ranks]:
    """The children of one test; rank 0 rejoins awake, or asleep (sleep level 1)."""
    started = _Ranks(checkpoint, asleep=request.param)
    try:
        yield started
    finally:
        started.close()


def test_a_surviving_rank_rejoins_with_its_weights_and_gives_the_same_tokens(
    ranks: _Ranks,
) -> None:
    new_rank = ranks.start(1)  # the replacement, waiting for its context
    first = tcp_init_method()
    survivor = ranks.start(0, _context(0, first))
    dying = ranks.start(1, _context(1, first))
    tokens = survivor.take("stepped")
    assert tokens is not None, "rank 0 is the output rank"
    assert len(tokens) == len(STEP.slots)
    assert dying.take("stepped") is None

    dying.process.kill()
    dying.process.join(WAIT_S)
    assert dying.process.exitcode is not None
    second = tcp_init_method()
    survivor.inbox.send(_context(0, second))
    new_rank.inbox.send(_context(1, second))

    assert new_rank.take("stepped") is None  # the new rank 1 loaded and ran its step
    tokens_after, kept, moved, calls, pid = survivor.take("rejoined")
    assert tokens_after == tokens
    assert kept, "rank 0 kept its weights (their memory, when awake) and its offloader"
    assert moved, "rank 0 took its new context"
    assert calls == (1, 1), "load_model ran once and the checkpoint was read once"
    # (asleep at level 1, the weights came back from the offloader, not the checkpoint)
    assert pid == survivor.process.pid
    assert new_rank.process.is_alive()
