"""Small networking helpers: loopback by default, ports chosen by the OS."""

from __future__ import annotations

import socket

__all__ = ["LOOPBACK", "find_free_port", "tcp_init_method"]

LOOPBACK = "127.0.0.1"


def find_free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def tcp_init_method(host: str = LOOPBACK, port: int | None = None) -> str:
    """A ``tcp://host:port`` rendezvous address for ``torch.distributed.init_process_group``."""
    return f"tcp://{host}:{port if port is not None else find_free_port(host)}"
