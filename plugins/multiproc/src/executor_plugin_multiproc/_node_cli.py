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
from typing import Any, TypeVar

__all__ = [
    "ADDRESS_ENV",
    "MASTER_ADDR_ENV",
    "MASTER_PORT_ENV",
    "MAX_JOIN_TIMEOUT_S",
    "NODE_ID_ENV",
    "NODE_RANK_ENV",
    "NUM_NODES_ENV",
    "add_node_command",
]

#: Environment variables read by ``executor node`` when its options are not given.
NODE_RANK_ENV = "EXECUTOR_NODE_RANK"
NUM_NODES_ENV = "EXECUTOR_NUM_NODES"
MASTER_ADDR_ENV = "EXECUTOR_MASTER_ADDR"
MASTER_PORT_ENV = "EXECUTOR_MASTER_PORT"
NODE_ID_ENV = "EXECUTOR_NODE_ID"
ADDRESS_ENV = "EXECUTOR_NODE_ADDRESS"

#: The longest ``--join-timeout``, in seconds (about 11.5 days; zmq's send timeouts are
#: 32-bit milliseconds).
MAX_JOIN_TIMEOUT_S = 1_000_000.0

_DEFAULT_ADDR = "127.0.0.1"
_DEFAULT_PORT = 29550
_DEFAULT_JOIN_TIMEOUT_S = 600.0
# One label of a host name (RFC 1123; underscores too, as container names have them).
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")

_T = TypeVar("_T")


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
    parser.add_argument(
        "--node-rank",
        type=_node_rank,
        default=None,
        help=(
            f"this node's rank (env {NODE_RANK_ENV}): 1 .. num_nodes-1, node 0 being the "
            "driver's machine; 0 .. num_nodes-1 for a driver that runs no ranks itself"
        ),
    )
    parser.add_argument(
        "--node-id",
        type=_node_id,
        default=None,
        help=(
            f"this node's name, as WorkerContext.node_id and errors give it (env {NODE_ID_ENV}; "
            "default: this machine's host name)"
        ),
    )
    parser.add_argument(
        "--address",
        type=_master_addr,
        default=None,
        help=(
            f"this node's address as the others reach it (env {ADDRESS_ENV}; default: the "
            "address this machine uses to reach the driver). WorkerContext.node_address gives "
            "it, and node 0 hosts the torch rendezvous there when the driver runs no ranks"
        ),
    )
    parser.add_argument(
        "--num-nodes",
        type=_num_nodes,
        default=None,
        help=(
            f"the driver's num_nodes, if you want it checked (env {NUM_NODES_ENV}): a driver "
            "with another one refuses this agent"
        ),
    )
    parser.add_argument(
        "--master-addr",
        type=_master_addr,
        default=None,
        help=(
            f"the driver's distributed_host: a host name or an IP address (env "
            f"{MASTER_ADDR_ENV}; default {_DEFAULT_ADDR})"
        ),
    )
    parser.add_argument(
        "--master-port",
        type=_port,
        default=None,
        help=(
            f"the driver's backend_options['node_port'], 1 to 65535 (env {MASTER_PORT_ENV}; "
            f"default {_DEFAULT_PORT})"
        ),
    )
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


def _integer(low: int, high: int | None, allowed: str) -> Callable[[str], int]:
    """An argparse ``type=``: an integer from ``low`` to ``high`` (no bound if None), else
    an error saying it ``must be`` ``allowed``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, not {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, not {value}")
        return value

    return parse


#: ``--node-rank``, ``--num-nodes``, ``--master-port``.
_node_rank = _integer(0, None, "an integer >= 0")
_num_nodes = _integer(2, None, "an integer >= 2 (a single node needs no agent)")
_port = _integer(1, 65535, "a TCP port, an integer from 1 to 65535")


def _node_id(text: str) -> str:
    """``--node-id``: a printable name without spaces, at most 255 characters."""
    value = text.strip()
    if not value or len(value) > 255 or not value.isprintable() or " " in value:
        raise argparse.ArgumentTypeError(
            f"must be a printable name without spaces, 1 to 255 characters, not {text!r}"
        )
    return value


def _join_timeout(text: str) -> float:
    """``--join-timeout``: seconds, more than 0 and at most :data:`MAX_JOIN_TIMEOUT_S`."""
    allowed = f"a number of seconds more than 0 and at most {MAX_JOIN_TIMEOUT_S:.0f}"
    try:
        value = float(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {allowed}, not {text!r}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_JOIN_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be {allowed}, not {text.strip()}")
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


# --- the command ---------------------------------------------------------------------------


def _from_env(
    parser: argparse.ArgumentParser,
    given: _T | None,
    name: str,
    check: Callable[[str], _T],
    flag: str,
) -> _T | None:
    """An option's value: as given, else the environment variable ``name``'s, checked like
    the option (a bad one is a usage error naming the variable)."""
    if given is not None:
        return given
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return check(text)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"environment variable {name} (read as {flag}): {exc}")


def _node_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    rank = _from_env(parser, args.node_rank, NODE_RANK_ENV, _node_rank, "--node-rank")
    nodes = _from_env(parser, args.num_nodes, NUM_NODES_ENV, _num_nodes, "--num-nodes")
    addr = _from_env(parser, args.master_addr, MASTER_ADDR_ENV, _master_addr, "--master-addr")
    master_port = _from_env(parser, args.master_port, MASTER_PORT_ENV, _port, "--master-port")
    node_id = _from_env(parser, args.node_id, NODE_ID_ENV, _node_id, "--node-id")
    address = _from_env(parser, args.address, ADDRESS_ENV, _master_addr, "--address")
    if rank is None:
        parser.error(
            f"give --node-rank (or {NODE_RANK_ENV}), an integer >= 1; node 0 is the "
            "driver's machine unless the driver runs no ranks"
        )
    if nodes is not None and rank >= nodes:
        parser.error(
            f"--node-rank {rank} is out of range for --num-nodes {nodes}: node ranks go up "
            f"to {nodes - 1}"
        )
    # The secret, before anything is dialled; executor_channel's top level imports no zmq.
    from executor_channel import SecretError, load_secret

    try:
        secret = load_secret()
    except SecretError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    logging.basicConfig(level=logging.INFO, format="executor node: %(message)s")
    from ._node_agent import run_agent  # zmq and the worker machinery: only when it runs

    return run_agent(
        rank,
        _DEFAULT_ADDR if addr is None else addr,
        _DEFAULT_PORT if master_port is None else master_port,
        args.join_timeout,
        num_nodes=nodes,
        secret=secret,
        node_id=node_id,
        address=address,
    )
