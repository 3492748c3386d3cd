"""Node agents for the multi-node tests: ``executor node`` processes on this machine."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest

from executor_channel import Secret


def agent_env(secret_hex: str) -> dict[str, str]:
    """The environment of an agent: the test's import path and the shared secret."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        Secret.ENV: secret_hex,
    }


class Agents:
    """Starts agents and makes sure none outlives the test that started it."""

    def __init__(self, secret_hex: str) -> None:
        self.secret_hex = secret_hex
        self.started: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        port: int,
        node_rank: int = 1,
        *,
        master_addr: str = "127.0.0.1",
        join_timeout: float = 60.0,
        stderr: int | None = None,
        extra: Sequence[str] = (),
    ) -> subprocess.Popen[bytes]:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "executor_core",
                "node",
                "--node-rank",
                str(node_rank),
                "--master-addr",
                master_addr,
                "--master-port",
                str(port),
                "--join-timeout",
                str(join_timeout),
                *extra,
            ],
            env=agent_env(self.secret_hex),
            stderr=stderr,
        )
        self.started.append(agent)
        return agent

    def stop_all(self) -> None:
        """End the agents still running (one that awaits a driver that will not come, say):
        SIGTERM, which stops an agent's workers as Ctrl-C does, then SIGKILL after 5 s."""
        for agent in self.started:
            if agent.poll() is None:
                agent.terminate()
                try:
                    agent.wait(5)
                except subprocess.TimeoutExpired:
                    agent.kill()
                    agent.wait(10)
            for pipe in (agent.stdout, agent.stderr):
                if pipe is not None:
                    pipe.close()


@pytest.fixture(scope="class")
def node_secret() -> Iterator[str]:
    """A fresh secret in this process's environment (the driver reads it from there)."""
    secret_hex = secrets.token_hex(32)
    saved = os.environ.get(Secret.ENV)
    os.environ[Secret.ENV] = secret_hex
    try:
        yield secret_hex
    finally:
        if saved is None:
            os.environ.pop(Secret.ENV, None)
        else:
            os.environ[Secret.ENV] = saved


@pytest.fixture(scope="class")
def agents(node_secret: str) -> Iterator[Agents]:
    made = Agents(node_secret)
    try:
        yield made
    finally:
        made.stop_all()
