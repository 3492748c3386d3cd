"""Small networking helpers: loopback by default, ports chosen by the OS, rendezvous ports
kept free until torch binds them."""

from __future__ import annotations

import atexit
import socket
import threading
from collections import OrderedDict

__all__ = ["LOOPBACK", "find_free_port", "release_port", "reserve_port", "tcp_init_method"]

LOOPBACK = "127.0.0.1"

#: Reservations this process keeps, newest last. One rendezvous is made per executor
#: incarnation and used soon after; the bound only stops a long-lived driver that restarts
#: many times from holding a descriptor for each.
_KEPT = 64
_reserved: OrderedDict[int, socket.socket] = OrderedDict()
_lock = threading.Lock()


def find_free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def reserve_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that stays free for a torch.distributed rendezvous.

    A port that was only free when it was chosen can be taken before rank 0's ``TCPStore``
    listens on it (an outgoing connection of any process on the machine draws from the same
    ephemeral range); rank 0 then fails at once while its peers wait at the rendezvous until
    their timeout. So this process keeps a socket bound to the port, not listening, with
    ``SO_REUSEADDR``: the kernel hands the port to no other bind and no outgoing connection,
    while ``TCPStore`` (which sets ``SO_REUSEADDR`` too) still binds and listens on it, in
    this process or another. :func:`release_port` ends a reservation; beyond the newest 64
    the oldest end, and all of them at exit. Raises ``OSError`` if ``host`` is no address of
    this machine.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    port: int = sock.getsockname()[1]
    with _lock:
        _reserved[port] = sock
        while len(_reserved) > _KEPT:
            _reserved.popitem(last=False)[1].close()
    return port


def release_port(port: int) -> None:
    """End this process's reservation of ``port`` (:func:`reserve_port`), if it holds one."""
    with _lock:
        sock = _reserved.pop(port, None)
    if sock is not None:
        sock.close()


@atexit.register  # closed at exit, not left to the collector
def _release_all() -> None:
    for port in list(_reserved):
        release_port(port)


def tcp_init_method(host: str = LOOPBACK, port: int | None = None) -> str:
    """A ``tcp://host:port`` rendezvous address for ``torch.distributed.init_process_group``
    (without ``port``, one free now: :meth:`TransportHost.rendezvous` keeps it free too)."""
    return f"tcp://{host}:{port if port is not None else find_free_port(host)}"
