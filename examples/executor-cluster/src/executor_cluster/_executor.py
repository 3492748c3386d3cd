"""The ``cluster`` backend: ``mp``'s executor with node agents placed by a "scheduler".

The scheduler here is the simplest one: node N is a "machine" at the loopback address
127.0.0.(N+2), and its agent is a process started for it. A real one would submit
``launch.argv`` to the machine it picks (``srun``, a pod, an in-house queue) and give back
the machine's name and address the same way.
"""

from __future__ import annotations

import os
import subprocess

from executor_core import ExecutorConfig, ExecutorError
from executor_plugin_multiproc import MultiprocExecutor, MultiprocOptions
from executor_plugin_multiproc.launcher import AgentLaunch, Placement

__all__ = ["ClusterExecutor", "LoopbackScheduler"]


class LoopbackScheduler(Placement):
    """Starts each node's agent on its own loopback "machine"; the driver runs no ranks."""

    driver_runs_ranks = False

    def __init__(self, config: ExecutorConfig, options: MultiprocOptions) -> None:
        super().__init__(config, options)
        self.jobs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, launch: AgentLaunch) -> None:
        node = launch.node_rank
        where = ["--node-id", f"machine-{node}", "--address", f"127.0.0.{node + 2}"]
        # Its own session, as a scheduler's job would be: a Ctrl-C at the driver's terminal
        # is the driver's, and the driver stops its agents itself.
        self.jobs[node] = subprocess.Popen(
            [*launch.argv, *where], env={**os.environ, **launch.env}, start_new_session=True
        )

    def check(self, launch: AgentLaunch) -> None:
        code = self.jobs[launch.node_rank].poll()
        if code is not None:
            raise ExecutorError(f"the agent of node {launch.node_rank} exited with status {code}")

    def stop(self, launch: AgentLaunch) -> None:
        job = self.jobs.pop(launch.node_rank)
        try:
            job.wait(10)  # told to stop already: it is exiting
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()


class ClusterExecutor(MultiprocExecutor):
    """``mp`` with its agents placed by :class:`LoopbackScheduler` (backend ``"cluster"``)."""

    placement_cls = LoopbackScheduler
