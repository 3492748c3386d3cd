"""The ``executor node`` subcommand: its options, read from the command line or the
environment. Light on purpose: ``executor`` adds it every time it starts, and the agent
itself (:mod:`._agent`) is imported only when the command runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

__all__ = ["MASTER_ADDR_ENV", "MASTER_PORT_ENV", "NODE_RANK_ENV", "add_node_command"]

#: Environment variables read by ``executor node`` when its options are not given.
NODE_RANK_ENV = "EXECUTOR_NODE_RANK"
MASTER_ADDR_ENV = "EXECUTOR_MASTER_ADDR"
MASTER_PORT_ENV = "EXECUTOR_MASTER_PORT"


def add_node_command(commands: argparse._SubParsersAction[Any]) -> None:
    """The ``executor node`` subcommand (registered by the plugin's hook)."""
    parser = commands.add_parser(
        "node",
        help="run this machine's workers of a multi-node 'mp' executor (like torchrun)",
        description=(
            "Join the 'mp' executor whose driver listens at --master-addr:--master-port and "
            "run this node's workers until the driver stops them. Needs the driver's secret "
            "in EXECUTOR_CHANNEL_SECRET or EXECUTOR_CHANNEL_SECRET_FILE."
        ),
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=_env_int(NODE_RANK_ENV),
        help=f"this node's rank, 1 .. num_nodes-1 (env {NODE_RANK_ENV})",
    )
    parser.add_argument(
        "--master-addr",
        default=os.environ.get(MASTER_ADDR_ENV, "127.0.0.1"),
        help=f"the driver's distributed_host (env {MASTER_ADDR_ENV}; default 127.0.0.1)",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=_env_int(MASTER_PORT_ENV, 29550),
        help=f"the driver's backend_options['node_port'] (env {MASTER_PORT_ENV}; default 29550)",
    )
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the driver (default 600)",
    )
    parser.set_defaults(func=_node_main)


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"executor node: {name}={value!r} is not an integer") from None


def _node_main(args: argparse.Namespace) -> int:
    if args.node_rank is None or args.node_rank < 1:
        print(
            f"executor node: give --node-rank (or {NODE_RANK_ENV}), an integer >= 1; "
            "node 0 is the driver's machine",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.INFO, format="executor node: %(message)s")
    from ._agent import run_agent  # zmq and the worker machinery: only when it runs

    return run_agent(args.node_rank, args.master_addr, args.master_port, args.join_timeout)
