"""The ``executor node`` subcommand: its options, read from the command line or the
environment and checked before the agent dials anyone. Light on purpose: ``executor`` adds
it every time it starts, and the agent itself (:mod:`._node_agent`) is imported only when the
command runs.

Every bad value is a usage error (exit status 2) that names the option (or the environment
variable it came from) and what it accepts.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import logging
import math
import os
import re
from collections.abc import Callable
from typing import Any

#: The longest ``--join-timeout``, in seconds (about 11.5 days; zmq's send timeouts are
#: 32-bit milliseconds).
MAX_JOIN_TIMEOUT_S = 1_000_000.0
_DEFAULT_JOIN_TIMEOUT_S = 600.0
# One label of a host name (RFC 1123; underscores too, as container names have them).
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def add_node_command(commands: argparse._SubParsersAction[Any]) -> None:
    """The ``executor node`` subcommand (registered by the plugin's hook)."""
    parser = commands.add_parser(
        "node",
        help="run this machine's workers of a multi-node 'mp' executor (like torchrun)",
        description=(
            "Join the 'mp' executor whose driver listens at --master-addr:--master-port and "
            "run this node's workers until the driver stops them. Needs the driver's secret "
            "in EXECUTOR_CHANNEL_SECRET or EXECUTOR_CHANNEL_SECRET_FILE. An agent the driver "
            "cannot admit (its node rank taken or out of range, no node rank awaited, another "
            "num_nodes or version) is refused at once and exits with status 2, as a usage "
            "error does; one that finds no driver within --join-timeout exits with status 3."
        ),
    )
    for flag, (check, variable, text) in _OPTIONS.items():
        parser.add_argument(flag, type=check, help=text.format(f"env {variable}"))
    parser.add_argument(
        "--join-timeout",
        type=_join_timeout,
        default=_DEFAULT_JOIN_TIMEOUT_S,
        help=(
            "seconds to wait for the driver to answer, more than 0 and at most "
            f"{MAX_JOIN_TIMEOUT_S:.0f} (default {_DEFAULT_JOIN_TIMEOUT_S:.0f})"
        ),
    )
    parser.set_defaults(func=functools.partial(_node_main, parser))


# --- the checks (argparse ``type=`` functions) ------------------------------------------------


def _bounded(kind: type[Any], low: float, high: float, allowed: str) -> Callable[[str], Any]:
    """An argparse ``type=``: a ``kind`` from ``low`` to ``high``, else an error saying it
    ``must be`` ``allowed``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, not {text!r}") from None
        if not low <= value <= high:  # NaN too
            raise argparse.ArgumentTypeError(f"must be {allowed}, not {text.strip()}")
        return value

    return parse


_node_rank = _bounded(int, 0, math.inf, "an integer >= 0")
_num_nodes = _bounded(int, 2, math.inf, "an integer >= 2 (a single node needs no agent)")
_port = _bounded(int, 1, 65535, "a TCP port, an integer from 1 to 65535")
_join_timeout = _bounded(  # from the least float above 0
    float,
    math.ulp(0.0),
    MAX_JOIN_TIMEOUT_S,
    f"a number of seconds more than 0 and at most {MAX_JOIN_TIMEOUT_S:.0f}",
)


def _node_id(text: str) -> str:
    """``--node-id``: a printable name without spaces, at most 255 characters."""
    value = text.strip()
    if not value or len(value) > 255 or not value.isprintable() or " " in value:
        raise argparse.ArgumentTypeError(
            f"must be a printable name without spaces, 1 to 255 characters, not {text!r}"
        )
    return value


def _master_addr(text: str) -> str:
    """``--master-addr``: a host name, an IPv4 address or an IPv6 address (brackets
    optional); returned without brackets. Nothing is resolved: the driver's name may be
    published only once its machine is up."""
    value = text.strip()
    if not value:
        raise argparse.ArgumentTypeError("must be the driver's host name or IP address, not empty")
    if "/" in value:
        raise argparse.ArgumentTypeError(
            f"must be a host name or IP address only (no scheme, no path), not {value!r}"
        )
    bracketed = value.startswith("[") and value.endswith("]")
    bare = value[1:-1] if bracketed else value
    if ":" in bare:
        try:
            return str(ipaddress.IPv6Address(bare))
        except ValueError:
            pass
        if not bracketed and bare.count(":") == 1:
            raise argparse.ArgumentTypeError(
                f"must be a host name or IP address without a port, not {value!r}: give the "
                "port with --master-port"
            ) from None
        raise argparse.ArgumentTypeError(f"{value!r} is not an IPv6 address") from None
    if bracketed:
        raise argparse.ArgumentTypeError(
            f"brackets are for IPv6 addresses only, and {bare!r} is not one"
        )
    if all(part.isdigit() for part in value.split(".")):
        # Only digits and dots: an IPv4 address, never a host name.
        try:
            return str(ipaddress.IPv4Address(value))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not an IPv4 address: four numbers from 0 to 255, like 10.0.0.1"
            ) from None
    name = value[:-1] if value.endswith(".") else value
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither an IP address nor a host name (letters, digits, '-' and "
            "'_' in dot-separated labels of at most 63 characters, not starting or ending "
            "with '-')"
        )
    return value


#: Each option but --join-timeout: its check, the environment variable read when it is not
#: given, and its help ("{}" names the variable).
_OPTIONS: dict[str, tuple[Callable[[str], Any], str, str]] = {
    "--node-rank": (
        _node_rank,
        "EXECUTOR_NODE_RANK",
        "this node's rank ({}): 1 .. num_nodes-1, node 0 being the driver's machine; "
        "0 .. num_nodes-1 for a driver that runs no ranks itself",
    ),
    "--node-id": (
        _node_id,
        "EXECUTOR_NODE_ID",
        "this node's name, as WorkerContext.node_id and errors give it ({}; default: this "
        "machine's host name)",
    ),
    "--address": (
        _master_addr,
        "EXECUTOR_NODE_ADDRESS",
        "this node's address as the others reach it ({}; default: the address this machine "
        "uses to reach the driver). WorkerContext.node_address gives it, and node 0 hosts the "
        "torch rendezvous there when the driver runs no ranks",
    ),
    "--num-nodes": (
        _num_nodes,
        "EXECUTOR_NUM_NODES",
        "the driver's num_nodes, if you want it checked ({}): a driver with another one "
        "refuses this agent",
    ),
    "--master-addr": (
        _master_addr,
        "EXECUTOR_MASTER_ADDR",
        "the driver's distributed_host: a host name or an IP address ({}; default 127.0.0.1)",
    ),
    "--master-port": (
        _port,
        "EXECUTOR_MASTER_PORT",
        "the driver's backend_options['node_port'], 1 to 65535 ({}; default 29550)",
    ),
}


# --- the command ---------------------------------------------------------------------------


def _node_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    values: dict[str, Any] = {}
    for flag, (check, variable, _) in _OPTIONS.items():
        # As given, else the variable's, checked like the option.
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None and (text := os.environ.get(variable)) is not None:
            try:
                value = check(text)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"environment variable {variable} (read as {flag}): {exc}")
        values[flag] = value
    rank, nodes = values["--node-rank"], values["--num-nodes"]
    if rank is None:
        parser.error(
            "give --node-rank (or EXECUTOR_NODE_RANK), an integer >= 1; node 0 is the "
            "driver's machine unless the driver runs no ranks"
        )
    if nodes is not None and rank >= nodes:
        parser.error(
            f"--node-rank {rank} is out of range for --num-nodes {nodes}: node ranks go up "
            f"to {nodes - 1}"
        )
    # The secret, before anything is dialled; executor_channel's top level imports no zmq.
    from executor_channel import Secret, SecretError

    try:
        secret = Secret.load()
    except SecretError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    logging.basicConfig(level=logging.INFO, format="executor node: %(message)s")
    from ._node_agent import run_agent  # zmq and the worker machinery: only when it runs

    return run_agent(
        rank,
        values["--master-addr"] or "127.0.0.1",
        values["--master-port"] or 29550,
        args.join_timeout,
        secret,
        nodes,
        values["--node-id"],
        values["--address"],
    )
