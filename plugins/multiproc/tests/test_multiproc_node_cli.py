"""``executor node``: its flags and environment are checked before it dials anyone (each bad
value a usage error, status 2, naming the flag and what it accepts), and an agent that finds
no driver, or one that does not answer, says so in one line (status 3), not a traceback."""

from __future__ import annotations

import argparse
import contextlib
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import pytest
from mp_nodes import agent_env

from executor_channel import ChannelTimeoutError, Listener, Secret
from executor_core.backend import find_free_port
from executor_plugin_multiproc._node_cli import _master_addr

SECRET = secrets.token_hex(32)


def node(
    args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 30
) -> tuple[int, str, float]:
    """Run ``executor node ARGS``; its exit status, its stderr and the seconds it took."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "executor_core", "node", *args],
        env=agent_env(SECRET) if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stderr, time.monotonic() - started


def last_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--master-port", "70000"],
            "argument --master-port: must be a TCP port, an integer from 1 to 65535, not 70000",
        ),
        (["--master-port", "0"], "argument --master-port: must be a TCP port"),
        (["--master-port", "http"], "argument --master-port: must be a TCP port"),
        (
            ["--master-addr", "999.1.1.1"],
            "argument --master-addr: '999.1.1.1' is not an IPv4 address: four numbers from 0 "
            "to 255, like 10.0.0.1",
        ),
        (
            ["--master-addr", "10.0.0.1:29550"],
            "argument --master-addr: must be a host name or IP address without a port, not "
            "'10.0.0.1:29550': give the port with --master-port",
        ),
        (["--master-addr", "tcp://10.0.0.1"], "host name or IP address only (no scheme"),
        (["--master-addr", "no such host"], "is neither an IP address nor a host name"),
        (["--master-addr", "[10.0.0.1]"], "brackets are for IPv6 addresses only"),
        (["--master-addr", "fe80::1::2"], "'fe80::1::2' is not an IPv6 address"),
        (
            ["--join-timeout", "-1"],
            "argument --join-timeout: must be a number of seconds more than 0 and at most "
            "1000000, not -1",
        ),
        (["--join-timeout", "0"], "argument --join-timeout: must be a number of seconds"),
        (["--join-timeout", "inf"], "argument --join-timeout: must be a number of seconds"),
        (["--join-timeout", "soon"], "argument --join-timeout: must be a number of seconds"),
        (
            ["--node-rank", "-1"],
            "argument --node-rank: must be an integer >= 0, not -1",
        ),
        (["--node-rank", "one"], "--node-rank: must be an integer >= 0, not 'one'"),
        (["--num-nodes", "1"], "argument --num-nodes: must be an integer >= 2"),
        (["--node-id", "a b"], "argument --node-id: must be a printable name without spaces"),
        (["--address", "999.1.1.1"], "argument --address: '999.1.1.1' is not an IPv4 address"),
        (
            ["--num-nodes", "2", "--node-rank", "2"],
            "--node-rank 2 is out of range for --num-nodes 2: node ranks go up to 1",
        ),
    ],
)
def test_bad_flags_are_usage_errors(args: list[str], message: str) -> None:
    # A long join timeout: an agent that dialled would take that long to give up.
    status, stderr, took = node(["--node-rank", "1", "--join-timeout", "60", *args])
    assert status == 2, stderr
    line = last_line(stderr)
    assert line.startswith("executor node: error: "), stderr
    assert message in line
    assert took < 20
    assert "joining the driver" not in stderr  # it never dialled


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "EXECUTOR_MASTER_PORT",
            "70000",
            "environment variable EXECUTOR_MASTER_PORT (read as --master-port): must be a TCP "
            "port, an integer from 1 to 65535, not 70000",
        ),
        (
            "EXECUTOR_MASTER_ADDR",
            "999.1.1.1",
            "environment variable EXECUTOR_MASTER_ADDR (read as --master-addr): '999.1.1.1' "
            "is not an IPv4 address",
        ),
        (
            "EXECUTOR_NODE_RANK",
            "x",
            "environment variable EXECUTOR_NODE_RANK (read as --node-rank): must be an "
            "integer >= 0, not 'x'",
        ),
        (
            "EXECUTOR_NUM_NODES",
            "1",
            "environment variable EXECUTOR_NUM_NODES (read as --num-nodes): must be an "
            "integer >= 2",
        ),
    ],
)
def test_bad_environment_is_a_usage_error(variable: str, value: str, message: str) -> None:
    args = [] if variable == "EXECUTOR_NODE_RANK" else ["--node-rank", "1"]
    status, stderr, _ = node(args, env={**agent_env(SECRET), variable: value})
    assert status == 2, stderr
    assert message in last_line(stderr)


def test_a_flag_wins_over_its_variable() -> None:
    env = {**agent_env(SECRET), "EXECUTOR_MASTER_PORT": "70000"}
    port = find_free_port()
    status, stderr, _ = node(
        ["--node-rank", "1", "--master-port", str(port), "--join-timeout", "0.5"], env=env
    )
    assert status == 3, stderr  # it dialled the flag's port, and nobody answered there
    assert f"no driver answered at tcp://127.0.0.1:{port} " in last_line(stderr)


def test_no_node_rank() -> None:
    env = agent_env(SECRET)
    env.pop("EXECUTOR_NODE_RANK", None)
    status, stderr, _ = node([], env=env)
    assert status == 2
    assert "give --node-rank (or EXECUTOR_NODE_RANK), an integer >= 1" in last_line(stderr)


def test_a_bad_variable_does_not_break_other_commands() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "executor_core", "backends"],
        env={**agent_env(SECRET), "EXECUTOR_NODE_RANK": "x", "EXECUTOR_MASTER_PORT": "-1"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "no channel secret: set EXECUTOR_CHANNEL_SECRET"),
        ({Secret.ENV: "abcd"}, "decodes to 2 bytes; it must be at least 32 bytes"),
        ({Secret.ENV: SECRET, Secret.ENV_FILE: "/nonexistent"}, "set only one of them"),
    ],
)
def test_the_secret_is_checked_before_dialling(env: dict[str, str], message: str) -> None:
    base = {k: v for k, v in agent_env(SECRET).items() if k not in (Secret.ENV, Secret.ENV_FILE)}
    status, stderr, _ = node(["--node-rank", "1", "--join-timeout", "60"], env={**base, **env})
    assert status == 2, stderr
    line = last_line(stderr)
    assert line.startswith("executor node: error: ")
    assert message in line
    assert "joining the driver" not in stderr


@pytest.mark.parametrize(
    ("text", "host"),
    [
        ("10.0.0.1", "10.0.0.1"),
        (" 127.0.0.1 ", "127.0.0.1"),
        ("::1", "::1"),
        ("[::1]", "::1"),
        ("[FE80:0:0::1]", "fe80::1"),
        ("localhost", "localhost"),
        ("node-1.cluster.local.", "node-1.cluster.local."),
        ("job_worker_1", "job_worker_1"),
    ],
)
def test_accepted_master_addresses(text: str, host: str) -> None:
    assert _master_addr(text) == host


@pytest.mark.parametrize("text", ["", "1.2.3", "01.2.3.4", "-host", "a" * 64, "a..b", "[]"])
def test_refused_master_addresses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _master_addr(text)


def test_no_driver_within_the_join_timeout_is_one_line() -> None:
    port = find_free_port()
    status, stderr, took = node(
        ["--node-rank", "1", "--master-port", str(port), "--join-timeout", "1"]
    )
    assert status == 3, stderr
    line = last_line(stderr)
    assert line.startswith(
        f"executor node: no driver answered at tcp://127.0.0.1:{port} within --join-timeout=1 s."
    )
    assert "the same secret (fingerprint " in line
    assert took < 15


def test_a_driver_that_does_not_answer_the_join_is_one_line() -> None:
    """A listener with the secret completes the handshake but never answers (a driver that
    waits for other nodes, or one that stopped serving its agents)."""
    secret = Secret.from_hex(SECRET)
    stop = threading.Event()
    joins: list[bytes] = []
    with Listener(secret) as listener:

        def serve() -> None:
            while not stop.is_set():
                with contextlib.suppress(ChannelTimeoutError):
                    joins.append(bytes(listener.recv(0.05).parts[0]))

        thread = threading.Thread(target=serve, name="test-silent-driver")
        thread.start()
        try:
            status, stderr, took = node(
                ["--node-rank", "1", "--master-port", str(listener.port), "--join-timeout", "2"]
            )
        finally:
            stop.set()
            thread.join(10)
    assert status == 3, stderr
    line = last_line(stderr)
    assert line.startswith(
        f"executor node: the driver at tcp://127.0.0.1:{listener.port} took this agent's "
        "connection but did not answer its join within --join-timeout=2 s."
    )
    assert "start the other nodes' agents, or give a longer --join-timeout" in line
    assert joins[:1] == [b"J"]
    assert took < 15
