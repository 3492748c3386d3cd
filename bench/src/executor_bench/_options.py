"""The names and values ``executor bench``'s options accept, and how a size is written.

Light on purpose: ``executor`` builds the subcommand's parser every time it starts.
"""

from __future__ import annotations

import re

__all__ = [
    "APART",
    "BASELINES",
    "DEFAULT_BASELINES",
    "DEFAULT_SIZES",
    "DEFAULT_WORKLOADS",
    "NODES_ADDRESS",
    "NODES_SIZE",
    "NODE_SIDES",
    "PAYLOAD_KINDS",
    "WORKLOADS",
    "format_size",
    "parse_size",
]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

#: The workloads measured apart from the sides, each reported as a table of its own, by name:
#: the module that measures it (only when asked for).
APART = {
    "recovery": "._recovery",
    "reference": "._reference",
    "engine": "._engine",
    "otel": "._otel",
}
#: The workloads, in the order they are reported (``imports``: import times in fresh
#: interpreters; ``overhead``: the core's own cost per call, in one process, on ``uni``;
#: ``nodes``: calls to ranks on a second node of this machine, against the wire, ``_nodes``;
#: ``slurm``: ``slurm`` across two Slurm nodes of this machine, ``_slurm``; then :data:`APART`).
WORKLOADS = ("imports", "overhead", "hot", "cold", "payload", "startup", "nodes", "slurm", *APART)
#: The workloads of a run that names none: the others start agents, clusters, models or
#: engines of their own, and run only when asked for.
DEFAULT_WORKLOADS = WORKLOADS[:6]
#: The ``nodes`` workload's argument sizes: a no-op, and one ``bytes`` argument of this size.
NODES_SIZE = MIB
#: The ``nodes`` workload's second node: another loopback address, so that its traffic
#: crosses TCP as another machine's would.
NODES_ADDRESS = "127.0.0.2"
#: The ``nodes`` workload's sides, by what they run, with their label in the results.
NODE_SIDES = {
    "mp": "mp, 2 nodes",
    "zmq": "pyzmq over TCP",
    "vllm": "vLLM MQ, remote reader",
}
#: What a payload argument is: ``bytes``, or a CPU float32 tensor (needs torch).
PAYLOAD_KINDS = ("bytes", "tensor")
#: Payload sizes of the default run: from a small message to several ring slots.
DEFAULT_SIZES = (4 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB)
#: The baselines, by the name ``--baselines`` takes, with their label in the results.
BASELINES = {
    "pipe": "Pipe",
    "ray": "Ray actors",
    "vllm": "vLLM MQ",
    "vllm-own": "vLLM MQ, own replies",
    "vllm-16m": "vLLM MQ, 16 MiB chunk",
    "zmq": "zmq",
}
#: The baselines of a run that names none (the others only when asked for).
DEFAULT_BASELINES = ("pipe", "ray", "vllm", "vllm-own")

_UNITS = {"": 1, "B": 1, "K": KIB, "KB": KIB, "KIB": KIB, "M": MIB, "MB": MIB, "MIB": MIB}
_UNITS |= {"G": GIB, "GB": GIB, "GIB": GIB}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """``"4K"``, ``"1M"``, ``"64MiB"``, ``"4096"`` -> bytes (K, M, G are powers of 1024).

    Raises ValueError for anything else, and for sizes that are not a positive multiple of
    4 bytes (a float32 tensor's element).
    """
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (a number with K, M or G, e.g. 4K or 16M)")
    size = float(match.group(1)) * _UNITS[unit]
    if size != int(size) or size < 4 or int(size) % 4:
        raise ValueError(f"{text!r} is not a positive multiple of 4 bytes")
    return int(size)


def format_size(size: int) -> str:
    """4096 -> ``"4 KiB"``, 1572864 -> ``"1.5 MiB"``."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"
