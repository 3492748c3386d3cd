"""A rendezvous port stays free until torch binds it (``reserve_port``,
``TransportHost.rendezvous``), and is released with the executor."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from executor_core import ExecutorConfig, WorkerBase, _net, create_executor
from executor_core.backend import reserve_port, tcp_init_method


def _plain_bind(port: int) -> bool:
    """Whether a socket without SO_REUSEADDR (what most servers and every outgoing
    connection's port choice respect) can take ``port`` now."""
    with socket.socket() as sock:
        try:
            sock.bind((_net.LOOPBACK, port))
        except OSError:
            return False
        return True


def test_a_reserved_port_is_refused_to_others_and_hosts_the_rendezvous_in_another_process() -> None:
    port = reserve_port()
    init_method = tcp_init_method(_net.LOOPBACK, port)
    assert not _plain_bind(port), "the reservation keeps the port from other binds"
    # A worker process (rank 0) hosts the TCPStore on it while the driver keeps the port.
    code = (
        "import datetime, torch, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method={init_method!r}, rank=0, world_size=1,"
        " timeout=datetime.timedelta(seconds=20))\n"
        "t = torch.ones(1); dist.all_reduce(t); dist.destroy_process_group(); print(int(t))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    _net.release_port(port)
    assert _plain_bind(port), "release_port ends the reservation"


class _Worker(WorkerBase):
    pass


def test_an_executor_keeps_its_rendezvous_port_until_it_shuts_down() -> None:
    executor = create_executor(ExecutorConfig(backend="uni", worker_cls=_Worker))
    with executor:
        [context] = executor.collective_rpc(lambda worker: worker.context)
        port = int(context.distributed_init_method.rsplit(":", 1)[1])
        assert not _plain_bind(port), "the executor keeps its rendezvous port free"
    assert _plain_bind(port), "shutdown releases the reservation (no descriptor is left)"


def test_reservations_are_bounded_oldest_released_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_net, "_KEPT", 3)
    ports = [reserve_port() for _ in range(4)]
    assert _plain_bind(ports[0]), "the oldest reservation beyond the bound is released"
    assert not any(_plain_bind(port) for port in ports[1:])
    for port in ports:
        _net.release_port(port)
    assert all(_plain_bind(port) for port in ports)


def test_a_host_that_is_not_here_is_refused() -> None:
    with pytest.raises(OSError):
        reserve_port("240.0.0.1")  # reserved (class E): no machine has it on an interface
