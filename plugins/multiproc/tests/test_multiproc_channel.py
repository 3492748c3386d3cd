"""What crosses the rings, worker environment and processes, security, idle CPU and a soak."""

from __future__ import annotations

import copyreg
import gc
import os
import pickle
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from mp_test_helpers import our_shm_names, shm_unchanged

from executor_channel import Doorbell, encode
from executor_channel._codec import decode
from executor_channel._shm.ring import Ring, RingLayout
from executor_channel._shm.segment import SharedSegment
from executor_core import Executor, WorkerError, create_executor
from executor_core.testing import conformance_config

__all__ = ["shm_unchanged"]  # the fixture, imported for the tests below

CODEC_WORKER = "mp_test_workers:CodecWorker"
SMALL_RING = {"slots": 2, "slot_bytes": 64 << 10, "reply_slots": 2, "shutdown_grace_s": 1.0}


@pytest.fixture(scope="module")
def executor() -> Iterator[Executor]:
    """Two workers with 64 KiB slots, so that megabyte payloads are streamed in chunks."""
    ex = create_executor(
        conformance_config(
            "mp",
            world_size=2,
            worker_cls=CODEC_WORKER,
            backend_options=SMALL_RING,
        )
    )
    try:
        yield ex
    finally:
        ex.shutdown()


def _roundtrip(value: Any) -> Any:
    parts, nbytes = encode(4, True, 0, 7, value)
    frame = memoryview(b"".join(bytes(p) for p in parts))
    assert frame.nbytes == nbytes
    kind, ok, rank, seq, body = decode(frame)
    assert (kind, ok, rank, seq) == (4, True, 0, 7)
    return body


# --- the codec, in process ---------------------------------------------------------------


def test_codec_sends_bulk_out_of_band() -> None:
    big = b"b" * (1 << 20)
    parts, _ = encode(1, True, -1, 1, ("m", (big,), {"k": [big]}))
    # Header, pickle stream, then the two bulk buffers: the pickle stream stays small.
    assert len(parts) == 4
    assert len(parts[1]) < 1024
    assert [memoryview(p).nbytes for p in parts[2:]] == [1 << 20, 1 << 20]


@pytest.mark.parametrize(
    "value",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t(),  # not contiguous, no numpy
        torch.tensor([True, False]),
        torch.zeros(0, 5, dtype=torch.int64),
        torch.tensor(3.5),
        torch.complex(torch.ones(3), torch.ones(3)).conj(),
        torch.complex(torch.ones(3), torch.ones(3)).conj().imag,  # the negative bit
        torch.arange(24, dtype=torch.int8).reshape(2, 3, 4).transpose(0, 2),  # numpy's, strided
        torch.arange(10, dtype=torch.float64)[3:7],  # an offset into its storage
        torch.arange(6, dtype=torch.float16).reshape(1, 2, 3),
        torch.ones(2, 3).expand(4, 2, 3),  # a stride of 0
    ],
    ids=[
        "float32",
        "bfloat16-transposed",
        "bool",
        "empty",
        "scalar",
        "complex-conj",
        "neg-bit",
        "int8-transposed",
        "offset",
        "float16-3d",
        "expanded",
    ],
)
def test_codec_tensors(value: torch.Tensor) -> None:
    back = _roundtrip({"t": value})["t"]
    assert back.dtype == value.dtype
    assert back.shape == value.shape
    assert torch.equal(back, value.resolve_conj().resolve_neg())
    assert back.is_contiguous()


def test_codec_tensors_torch_pickles_itself() -> None:
    # Tensors the codec does not send out of band go through torch's own pickling.
    grad = torch.ones(3, requires_grad=True)
    back = _roundtrip([grad, torch.nn.Parameter(torch.zeros(2))])
    assert back[0].requires_grad
    assert torch.equal(back[0].detach(), torch.ones(3))
    assert type(back[1]) is torch.nn.Parameter
    sparse = torch.eye(3).to_sparse()
    assert torch.equal(_roundtrip(sparse).to_dense(), torch.eye(3))


@pytest.mark.parametrize(
    "value",
    [
        np.arange(20, dtype=np.float64).reshape(4, 5),
        np.asfortranarray(np.arange(20, dtype=np.int16).reshape(4, 5)),
        np.arange(20)[::2],
        np.array(["a", None], dtype=object),
        np.arange(6, dtype=">f8"),  # not the machine's byte order
        np.array(["2026-12-05"], dtype="datetime64[ns]"),
        np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),  # structured
        np.array(7, dtype=np.uint32),  # 0-d
        np.array([True, False]),
        np.array(["ab", "c"]),
    ],
    ids=[
        "c-order",
        "f-order",
        "strided",
        "object",
        "big-endian",
        "datetime",
        "structured",
        "0-d",
        "bool",
        "unicode",
    ],
)
def test_codec_numpy(value: np.ndarray[Any, Any]) -> None:
    back = _roundtrip(value)
    assert back.dtype == value.dtype
    np.testing.assert_array_equal(back, value)
    if back.dtype != object:
        assert back.flags.writeable  # a private copy, not a view of the ring


def test_codec_pickler_is_reused_per_thread_and_safely() -> None:
    # One pickler per thread is reused: nothing of one call leaks into the next, a reducer
    # that encodes gets a pickler of its own, other threads theirs, and a reducer copyreg
    # learns after the first call is used.
    class Nested:
        def __reduce__(self) -> Any:
            inner = _roundtrip(("inner", torch.arange(3)))
            return (tuple, ((inner[0], inner[1].tolist()),))

    class Late:
        pass

    first = _roundtrip(("m", (torch.ones(4), np.arange(3)), {"k": [b"x" * (200 << 10)]}))
    assert torch.equal(first[1][0], torch.ones(4))
    assert first[2]["k"][0] == b"x" * (200 << 10)
    assert _roundtrip(["a", Nested(), torch.zeros(2)])[1] == ("inner", [0, 1, 2])
    copyreg.pickle(Late, lambda obj: (str, ("late",)))
    assert _roundtrip([Late(), torch.ones(1)])[0] == "late"
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(_roundtrip(torch.full((5,), i))))
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(int(t[0]) for t in results) == [0, 1, 2, 3]
    many = [float(i) for i in range(50_000)]  # a pickle of several frames, written in pieces
    parts, _ = encode(4, True, 0, 7, ("m", (many, torch.ones(2)), {}))
    assert len(parts) > 4
    assert _roundtrip(("m", (many, torch.ones(2)), {}))[1][0] == many


def test_codec_received_objects_own_their_memory() -> None:
    parts, _ = encode(4, True, 0, 1, (b"z" * 10_000, torch.ones(1000), np.ones(1000)))
    frame = bytearray(b"".join(bytes(p) for p in parts))
    data, tensor, array = decode(memoryview(frame))[4]
    frame[:] = bytes(len(frame))  # the ring slot is reused
    assert data == b"z" * 10_000
    assert torch.equal(tensor, torch.ones(1000))
    assert (array == 1).all()


def test_codec_uses_owned_memory_in_place() -> None:
    # A message the ring copied out of several slots is the receiver's already: a second copy
    # of each buffer would double the cost of a large payload.
    parts, _ = encode(4, True, 0, 1, (torch.zeros(1000), np.zeros(1000)))
    frame = bytearray(b"".join(bytes(p) for p in parts))
    tensor, array = decode(pickle.PickleBuffer(frame))[4]
    frame[:] = b"\x01" * len(frame)
    assert bool((tensor != 0).all())
    assert bool((array != 0).all())


def _small_rings(slots: int = 2) -> tuple[Ring, Ring]:
    layout = RingLayout(0, 1, slots, 4096)
    segment = SharedSegment.create(layout.nbytes)
    data, space = Doorbell(), Doorbell()
    writer = Ring(segment.buf, layout, reader=None, data_bells=[data], space_bell=space)
    reader = Ring(segment.buf, layout, reader=0, data_bells=[data], space_bell=space)
    return writer, reader


def test_ring_streams_a_message_bigger_than_the_ring() -> None:
    writer, reader = _small_rings()
    payload = os.urandom(5 * 4096 + 17)
    received: list[bytes] = []
    thread = threading.Thread(target=lambda: received.append(reader.read(bytes) or b""))
    thread.start()
    assert writer.write([payload], len(payload), deadline=time.monotonic() + 10)
    thread.join(10)
    assert received == [payload]
    assert not writer.broken
    assert not reader.broken


def test_ring_hands_a_message_of_several_slots_as_owned_memory() -> None:
    writer, reader = _small_rings(slots=4)
    payload = os.urandom(3 * 4096 + 5)  # four chunks: the whole ring, published at once
    assert writer.write([payload], len(payload), deadline=time.monotonic() + 10)
    seen: list[object] = []

    def keep(received: object) -> bytes:
        seen.append(type(received))
        return bytes(received)  # type: ignore[call-overload]  # a buffer either way

    assert reader.read(keep, deadline=time.monotonic() + 10) == payload
    assert seen == [pickle.PickleBuffer]
    small = os.urandom(100)
    assert writer.write([small], len(small), deadline=time.monotonic() + 10)
    assert reader.read(keep, deadline=time.monotonic() + 10) == small
    assert seen[-1] is memoryview  # one slot: a view of it, valid during the call


def test_ring_interrupted_mid_message_withdraws_it_or_breaks_the_reader() -> None:
    writer, reader = _small_rings()
    payload = b"x" * (5 * 4096)

    def interrupt() -> None:
        raise KeyboardInterrupt

    # Two chunks fit, then the writer waits for the reader, and is interrupted: the message
    # is withdrawn (its end mark goes out with the next write), the ring stays usable.
    with pytest.raises(KeyboardInterrupt):
        writer.write([payload], len(payload), None, interrupt)
    assert not writer.broken
    # The reader copies the two chunks it has, then is interrupted waiting for the third:
    # it would read the rest as new messages, so it is broken.
    with pytest.raises(KeyboardInterrupt):
        reader.read(bytes, None, interrupt)
    assert reader.broken


# --- through the executor ----------------------------------------------------------------


def test_payload_larger_than_a_slot(executor: Executor) -> None:
    data = os.urandom(3 << 20)  # 48 slots of 64 KiB through a 2-slot ring
    assert executor.collective_rpc("payload_size", args=(data,)) == [len(data)] * 2
    assert executor.collective_rpc("identity", args=(data,), unique_reply_rank=1) == [data]
    result = executor.collective_rpc("make_bytes", args=(2 << 20,), kwargs={"on_rank": 0})
    assert result == [b"\x00" * (2 << 20), None]


def test_large_tensor_and_array_through_small_slots(executor: Executor) -> None:
    tensor = torch.randn(300, 1000)
    array = np.random.default_rng(0).random((500, 300))
    back_t, back_a = executor.collective_rpc(
        "identity", args=((tensor, array),), unique_reply_rank=0
    )[0]
    assert torch.equal(back_t, tensor)
    np.testing.assert_array_equal(back_a, array)
    assert executor.collective_rpc("describe", args=(tensor,)) == [
        {"type": "Tensor", "rank": 0},
        {"type": "Tensor", "rank": 1},
    ]


def test_arguments_read_in_place_stay_each_ranks_own() -> None:
    # At default options a 256 KiB tensor is read in place, not copied out of its slot.
    ex = create_executor(conformance_config("mp", world_size=2, worker_cls=CODEC_WORKER))
    try:
        n = 64 << 10
        first = torch.full((n,), 1.0)
        ex.collective_rpc("keep", args=(first,))
        for value in range(2, 11):  # the four slots refilled, twice over
            sent = torch.full((n,), float(value))
            # Rank 0 negates its argument in place: rank 1's is its own, and the driver's.
            assert ex.collective_rpc("negate_on", args=(sent, 0)) == [-n * value, n * value]
            assert bool((sent == value).all())
        for kept in ex.collective_rpc("kept"):  # a kept argument never changed under it
            assert len(kept) == 1
            assert torch.equal(kept[0], first)
    finally:
        ex.shutdown()


def test_unpicklable_argument_raises_before_sending(executor: Executor) -> None:
    with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
        executor.collective_rpc("identity", args=(lambda: None,))
    assert executor.collective_rpc("get_rank") == [0, 1]


def test_unpicklable_result_is_a_worker_error(executor: Executor) -> None:
    with pytest.raises(WorkerError) as info:
        executor.collective_rpc(lambda w: lambda: w.rank)
    assert info.value.rank == 0
    assert executor.collective_rpc("get_rank") == [0, 1]


# --- worker processes --------------------------------------------------------------------


def test_worker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with create_executor(
        conformance_config("mp", world_size=2, env={"EXTRA": "x"}, backend_options=SMALL_RING)
    ) as ex:
        env = ex.collective_rpc(
            lambda w: {
                k: os.environ.get(k)
                for k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "EXTRA")
            }
        )
    cores = len(os.sched_getaffinity(0))
    for rank, got in enumerate(env):
        assert got == {
            "CUDA_VISIBLE_DEVICES": "3,1",
            "OMP_NUM_THREADS": str(max(1, cores // 2)),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "EXTRA": "x",
        }


def test_max_concurrent_batches() -> None:
    config = conformance_config(
        "mp", world_size=2, async_scheduling=True, backend_options=SMALL_RING
    )
    with create_executor(config) as ex:
        assert ex.max_concurrent_batches == 2
        futures = [ex.execute_model(i, non_block=True) for i in range(4)]
        assert [f.result(10) for f in futures] == [{"rank": 0, "batch": i} for i in range(4)]


def test_user_omp_num_threads_wins() -> None:
    with create_executor(
        conformance_config(
            "mp", world_size=2, env={"OMP_NUM_THREADS": "7"}, backend_options=SMALL_RING
        )
    ) as ex:
        assert ex.collective_rpc("get_env", args=("OMP_NUM_THREADS",)) == ["7", "7"]


def test_processes_are_named_by_rank(executor: Executor) -> None:
    assert executor.collective_rpc("proc_name") == ["mp-worker-0", "mp-worker-1"]
    pids = executor.collective_rpc("get_pid")
    parents = {psutil.Process(pid).ppid() for pid in pids}
    assert parents == {os.getpid()}


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_other_start_methods(method: str) -> None:
    options = {**SMALL_RING, "start_method": method}
    with create_executor(conformance_config("mp", world_size=2, backend_options=options)) as ex:
        assert ex.collective_rpc("get_rank") == [0, 1]
        assert ex.collective_rpc("payload_size", args=(b"q" * 300_000,)) == [300_000] * 2


def test_idle_workers_use_no_cpu(executor: Executor) -> None:
    procs = [psutil.Process(pid) for pid in executor.collective_rpc("get_pid")]
    for _ in range(50):
        executor.collective_rpc("get_rank")
    time.sleep(0.05)
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(1.0)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before, strict=True)]
    assert max(used) < 0.02, f"idle workers used {used} s of CPU in 1 s"


# --- security ----------------------------------------------------------------------------


def test_no_names_no_sockets_private_memory(executor: Executor) -> None:
    # The segment's name is unlinked as soon as it is created: nothing to guess or leak.
    assert our_shm_names() == set()
    segment_fd = executor.transport.rings.segment.fd  # type: ignore[attr-defined]
    assert stat.S_IMODE(os.fstat(segment_fd).st_mode) == 0o600
    # No listening socket anywhere: not in the driver, not in the workers.
    pids = [os.getpid(), *executor.collective_rpc("get_pid")]
    for pid in pids:
        listening = [c for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN"]
        assert listening == []


# --- soak ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("shm_unchanged")
def test_soak_memory_and_descriptors_stay_flat() -> None:
    me = psutil.Process()
    with create_executor(conformance_config("mp", world_size=2, backend_options=SMALL_RING)) as ex:
        workers = [psutil.Process(pid) for pid in ex.collective_rpc("get_pid")]
        payload = b"p" * 100_000

        def burst(n: int) -> None:
            for i in range(n):
                if i % 4 == 0:
                    ex.collective_rpc("payload_size", args=(payload,))
                elif i % 4 == 1:
                    ex.collective_rpc("get_rank", non_block=True).result(10)
                else:
                    ex.collective_rpc("echo", args=(i,), unique_reply_rank=i % 2)

        burst(500)  # warm up allocators and caches
        gc.collect()
        fds = me.num_fds()
        rss = [me.memory_info().rss] + [w.memory_info().rss for w in workers]
        burst(3000)
        gc.collect()
        assert me.num_fds() == fds
        grown = [
            now - then
            for now, then in zip(
                [me.memory_info().rss] + [w.memory_info().rss for w in workers], rss, strict=True
            )
        ]
        assert max(grown) < 8 << 20, f"RSS grew by {grown} bytes over 3000 calls"


def test_executors_leave_no_descriptors_behind() -> None:
    me = psutil.Process()
    with create_executor(conformance_config("mp", world_size=2)) as ex:
        ex.collective_rpc("get_rank")
    fds = me.num_fds()
    for _ in range(3):
        with create_executor(conformance_config("mp", world_size=2)) as ex:
            ex.collective_rpc("get_rank", non_block=True).result(10)
    assert me.num_fds() == fds
