"""The ``slurm`` workload's sides: ``slurm`` across two Slurm nodes of this machine beside the
same topology without Slurm, two ranks each, one a node, default options.

The run starts the tests' Slurm cluster (``plugins/slurm/tests/slurm_cluster.py``: munged,
slurmctld, two slurmd ``n1`` and ``n2``; root only) and takes a job of both nodes (as a salloc
shell is), for the sides' phase (:func:`slurm_job`). Two topologies, each beside its own:

* ``slurm, driver on n1`` (as in a batch script: ``SLURMD_NODENAME=n1``; rank 1 an agent
  started by srun on n2) beside ``mp, 2 nodes, a session each`` (``mp`` with ``num_nodes=2``
  and a node agent it starts, in a session of its own as slurmstepd's tasks are: on one
  machine the kernel shares the CPUs between sessions, which moves a round trip);
* ``slurm, driver off the nodes`` (a salloc shell or a login node; two agents) beside
  ``cluster, 2 agents`` (the cluster example, whose two agents are local processes).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

from ._nodes import TwoNodeSide
from ._sides import BackendSide, Role, Side, SideSpec, Skipped, plugins_env

__all__ = ["SLURM_SIDES", "select_slurm_sides", "slurm_job"]

#: The workload's sides, by what they run, with their label in the results.
SLURM_SIDES = {
    "near": "slurm, driver on n1",
    "far": "slurm, driver off the nodes",
    "mp": "mp, 2 nodes, a session each",
    "cluster": "cluster, 2 agents",
}
#: Where the tests' Slurm cluster is, in a source checkout.
_TESTS = Path(__file__).resolve().parents[3] / "plugins" / "slurm" / "tests"


def _cannot_run(backends: list[SideSpec]) -> str:
    absent = {"slurm", "mp", "cluster"} - {side.name for side in backends}
    if absent:
        return f"needs the backends {', '.join(sorted(absent))} (installed, in --backends)"
    if not (_TESTS / "slurm_cluster.py").exists():
        return f"needs the tests' Slurm cluster ({_TESTS}/slurm_cluster.py: a source checkout)"
    sys.path.insert(0, str(_TESTS))
    from slurm_cluster import cannot_run  # type: ignore[import-not-found]  # from _TESTS

    reason: str | None = cannot_run()
    return reason or ""


def select_slurm_sides(backends: list[SideSpec]) -> tuple[list[SideSpec], list[Skipped]]:
    """The workload's sides, or the workload skipped with the reason."""
    reason = _cannot_run(backends)
    if reason:
        return [], [Skipped("slurm", "workload", reason)]
    version = {side.name: side.version for side in backends}
    only = frozenset({"slurm", "startup"})

    def side(key: str, role: Role, note: str, start: Callable[[], Side], backend: str) -> SideSpec:
        plugin = {"mp": "multiproc"}.get(backend, backend)
        return SideSpec(
            SLURM_SIDES[key],
            role,
            2,
            note,
            start,
            workloads=only,
            plugin=plugin,
            version=version[backend],
        )

    return [
        side(
            "near",
            "backend",
            "SLURMD_NODENAME=n1; rank 1 an srun step on n2",
            _starter("slurm", "n1"),
            "slurm",
        ),
        side(
            "far",
            "backend",
            "inside the job, on neither node; two srun steps",
            _starter("slurm"),
            "slurm",
        ),
        side(
            "mp",
            "baseline",
            "default options but node_port; its agent in a session of its own",
            lambda: TwoNodeSide(plugins_env(), session=True),
            "mp",
        ),
        side("cluster", "baseline", "two local agent processes", _starter("cluster"), "cluster"),
    ], []


def _starter(backend: str, node: str | None = None) -> Callable[[], Side]:
    def start() -> Side:
        with mock.patch.dict(os.environ, {"SLURMD_NODENAME": node} if node else {}):
            return BackendSide(backend, 2, plugins_env(), num_nodes=2)

    return start


@contextlib.contextmanager
def slurm_job() -> Iterator[None]:
    """The tests' Slurm cluster, started, and a job of its two nodes in this process's
    environment (``SLURM_CONF``, ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``) until the end."""
    from slurm_cluster import SlurmCluster  # on sys.path: _cannot_run put it there

    cluster = SlurmCluster()
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        cluster.start()
        stack.enter_context(mock.patch.dict(os.environ, {"SLURM_CONF": str(cluster.conf)}))
        out = subprocess.run(
            ["salloc", "--no-shell", "--nodes=2", "--job-name=bench"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        job = out.stderr.split("Granted job allocation")[1].split()[0]
        stack.callback(subprocess.run, ["scancel", job], check=True, timeout=60)
        job_env = {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "n[1-2]"}
        stack.enter_context(mock.patch.dict(os.environ, job_env))
        yield
