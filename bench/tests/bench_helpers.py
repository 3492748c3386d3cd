"""Running ``executor bench`` as a user does, in a subprocess, and a stand-in for vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

#: Seconds any one ``executor`` command of the tests may take.
TIMEOUT_S = 180


def run_executor(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``executor ARGS...`` (as ``python -m executor_core``), with every plugin installed
    but no allow-list inherited from the caller."""
    env = {k: v for k, v in os.environ.items() if k not in ("EXECUTOR_PLUGINS", "VLLM_MQ_PATH")}
    return subprocess.run(
        [sys.executable, "-m", "executor_core", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


#: A stand-in for vLLM's shm_broadcast: the same MessageQueue interface the baseline uses,
#: over one multiprocessing queue per reader (the real one is a shared-memory ring).
FAKE_SHM_BROADCAST = """
import multiprocessing


class _Ring:
    name = "executor-bench-test-no-ring"


class _Buffer:
    shared_memory = _Ring()


class MessageQueue:
    def __init__(self, n_reader, n_local_reader, **options):
        ctx = multiprocessing.get_context("spawn")
        self._queues = [ctx.Queue() for _ in range(n_reader)]
        self._mine = None
        self.buffer = _Buffer()

    @classmethod
    def create_from_handle(cls, handle, rank):
        queue = cls.__new__(cls)
        queue._queues, queue._mine = None, handle[rank]
        return queue

    def export_handle(self):
        return self._queues

    def wait_until_ready(self):
        pass

    def enqueue(self, obj):
        for queue in self._queues:
            queue.put(obj)

    def dequeue(self, indefinite=False):
        return self._mine.get()
"""


def make_fake_vllm(root: Path, shm_broadcast: str = FAKE_SHM_BROADCAST) -> Path:
    """A directory ``--vllm-path`` accepts, whose shm_broadcast.py is ``shm_broadcast``."""
    package = root / "vllm" / "distributed" / "device_communicators"
    package.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text('__version__ = "0.0.test"\n')
    (root / "vllm" / "distributed" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "shm_broadcast.py").write_text(textwrap.dedent(shm_broadcast))
    return root
