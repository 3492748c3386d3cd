"""The ``nodes`` workload's sides: ranks on a second "node" of this machine, behind a loopback
address, each with the link a rank on another machine has.

* ``mp, 2 nodes`` (:class:`TwoNodeSide`): ``mp`` with ``num_nodes=2``, rank 0 a worker of
  this driver and rank 1 a worker of an ``executor node`` agent this side starts on
  ``127.0.0.2``; the channel's authentication on, as always across nodes.
* ``pyzmq over TCP``: a pyzmq PAIR socket over TCP on ``127.0.0.2`` to each rank, pickle 5, no
  authentication: the wire alone (:class:`~executor_bench._baseline_zmq.ZmqSide`).
* ``vLLM MQ, remote reader``: vLLM's ``MessageQueue`` with rank 0 a local reader and rank 1 a
  remote one, its calls and replies over TCP on ``127.0.0.2``, as vLLM lays out a rank on
  another node (:class:`~executor_bench._baseline_vllm.VllmQueueSide`); only where vLLM's
  ``shm_broadcast`` imports.

The workload always has two ranks, one a node, whatever ``--workers`` says.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
from typing import IO, Any
from unittest import mock

from ._baseline_vllm import VllmQueueSide, describe_vllm, import_vllm
from ._baseline_zmq import ZmqSide
from ._options import NODE_SIDES, NODES_ADDRESS
from ._sides import BackendSide, SideSpec, Skipped, plugins_env

__all__ = ["TwoNodeSide", "select_node_sides"]

#: Seconds the agent gets to exit once the executor has stopped it, before it is killed.
_AGENT_EXIT_S = 10.0


class TwoNodeSide:
    """``mp`` across two nodes of this machine: this driver runs rank 0, an ``executor node``
    agent that this side starts (node rank 1, on :data:`NODES_ADDRESS`) runs rank 1.

    Default options but ``node_port``, a free port this side picks (the default, 29550,
    could be taken by another run). The agent and the driver share a secret made for the
    side; closing the side shuts the executor down, which stops the agent. ``session``: the
    agent runs in a session of its own (as a scheduler's step does).
    """

    def __init__(self, env: dict[str, str] | None = None, session: bool = False) -> None:
        from executor_channel import Secret
        from executor_core.backend import find_free_port

        secret = Secret.generate().to_env()
        port = find_free_port()
        # Read if the agent fails; closed with the side.
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115  (outlives this call)
        # The agent's workers import what this process can (a run from a source tree).
        path = os.pathsep.join(p for p in sys.path if p)
        command = [sys.executable, "-m", "executor_core", "node", "--node-rank", "1"]
        command += ["--address", NODES_ADDRESS, "--master-addr", "127.0.0.1"]
        command += ["--master-port", str(port), "--join-timeout", "60"]
        self._agent = subprocess.Popen(
            command,
            env={**os.environ, **secret, "PYTHONPATH": path},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=session,
        )
        try:
            # The driver reads its node agents' secret from this process's environment when
            # the executor starts; no other side's start should see it.
            with mock.patch.dict(os.environ, secret):
                self._side = BackendSide("mp", 2, env, options={"node_port": port}, num_nodes=2)
            nodes = self._side.executor.collective_rpc(_node_id)
            if nodes[0] == nodes[1]:
                self._side.close()
                raise RuntimeError(f"both ranks run on one node ({nodes[0]}): not two nodes")
        except BaseException as exc:
            # The agent waits for its driver until --join-timeout: it is not coming.
            self._agent.kill()
            self._agent.wait(_AGENT_EXIT_S)
            exc.add_note(f"the node agent's output: {self._agent_output()}")
            self._log.close()
            raise

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """``collective_rpc(method, args=args)`` on both nodes."""
        return self._side.call(method, args)

    def close(self) -> None:
        """Shut the executor down (which stops the agent), then wait for the agent; raise
        if it did not exit cleanly."""
        try:
            self._side.close()
        finally:
            code = self._stop_agent()
            output = self._agent_output()
            self._log.close()
        if code != 0:
            raise RuntimeError(f"the node agent ended with {code}; its output: {output}")

    def _stop_agent(self) -> int:
        """Wait for the agent to exit (killed after :data:`_AGENT_EXIT_S`); its status."""
        try:
            return self._agent.wait(_AGENT_EXIT_S)
        except subprocess.TimeoutExpired:
            self._agent.kill()
            return self._agent.wait(_AGENT_EXIT_S)

    def _agent_output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:].strip() or "(none)"


def select_node_sides(
    backends: list[SideSpec], vllm_path: str | None
) -> tuple[list[SideSpec], list[Skipped]]:
    """The ``nodes`` workload's sides that can run here (``mp, 2 nodes`` if ``mp`` is among
    ``backends``, the two baselines), and those skipped with the reason."""
    sides: list[SideSpec] = []
    skipped: list[Skipped] = []
    only = frozenset({"nodes"})
    mp = next((side for side in backends if side.name == "mp"), None)
    if mp is None:
        skipped.append(Skipped(NODE_SIDES["mp"], "backend", "mp is not measured (see --backends)"))
    else:
        sides.append(
            SideSpec(
                NODE_SIDES["mp"],
                "backend",
                2,
                f"default options but node_port (a free port); rank 1 under an `executor node` "
                f"agent on {NODES_ADDRESS}; authenticated",
                lambda: TwoNodeSide(plugins_env()),
                workloads=only,
                plugin=mp.plugin,
                version=mp.version,
            )
        )
    if importlib.util.find_spec("zmq") is None:
        skipped.append(Skipped(NODE_SIDES["zmq"], "baseline", "pyzmq is not installed"))
    else:
        sides.append(
            SideSpec(
                NODE_SIDES["zmq"],
                "baseline",
                2,
                f"a PAIR socket over TCP on {NODES_ADDRESS} to each worker, pickle protocol 5, "
                "no authentication: the wire",
                functools.partial(ZmqSide, 2, NODES_ADDRESS),
                workloads=only,
                version=f"pyzmq {importlib.metadata.version('pyzmq')}",
            )
        )
    try:
        module = import_vllm(vllm_path)
    except LookupError as exc:
        skipped.append(Skipped(NODE_SIDES["vllm"], "baseline", str(exc)))
    else:
        sides.append(
            SideSpec(
                NODE_SIDES["vllm"],
                "baseline",
                2,
                f"rank 1 a remote reader: calls and replies over TCP on {NODES_ADDRESS}, as "
                "vLLM lays out another node; no authentication; the local reader spins 1 s "
                "after a read",
                functools.partial(
                    VllmQueueSide, 2, own_replies=True, remote_ranks=(1,), remote_ip=NODES_ADDRESS
                ),
                spins=True,
                workloads=only,
                version=describe_vllm(module),
            )
        )
    return sides, skipped


def _node_id(worker: Any) -> str:
    """Where a rank runs (called on each worker)."""
    return str(worker.context.node_id)
