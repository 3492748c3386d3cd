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
#: over a named pipe (FIFO) per reader, so that a handle is a list of paths that can travel
#: to another process, as a reader's own reply queue's does (the real one is a shared-memory
#: ring).
FAKE_SHM_BROADCAST = """
import os
import pickle
import shutil
import struct
import tempfile

_LEN = struct.Struct("<Q")


class _Ring:
    name = "executor-bench-test-no-ring"


class _Buffer:
    shared_memory = _Ring()


def _read(fd, n):
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


class MessageQueue:
    def __init__(self, n_reader, n_local_reader, local_reader_ranks=None, connect_ip=None,
                 **options):
        # vLLM's rules for the layout: the local ranks are n_local_reader of them (by
        # default the first), remote readers need an address, and only local ones a ring.
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        assert len(local_reader_ranks) == n_local_reader, (local_reader_ranks, n_local_reader)
        assert n_reader == n_local_reader or connect_ip, "remote readers need connect_ip"
        self.layout = (n_reader, n_local_reader, local_reader_ranks, connect_ip)
        self._local = local_reader_ranks
        self._root = tempfile.mkdtemp(prefix="fake-shm-broadcast-")
        self._paths = [os.path.join(self._root, str(i)) for i in range(n_reader)]
        for path in self._paths:
            os.mkfifo(path)
        # Read-write: opening does not wait for the other end.
        self._fds = [os.open(path, os.O_RDWR) for path in self._paths]
        self._mine = None
        self.buffer = _Buffer() if n_local_reader else None

    @classmethod
    def create_from_handle(cls, handle, rank):
        paths, local = handle
        queue = cls.__new__(cls)
        queue._root, queue._fds = None, []
        queue._mine = os.open(paths[rank], os.O_RDWR)
        queue.buffer = _Buffer() if rank in local else None
        return queue

    def export_handle(self):
        return list(self._paths), list(self._local)

    def wait_until_ready(self):
        pass

    def enqueue(self, obj):
        data = pickle.dumps(obj)
        for fd in self._fds:
            os.write(fd, _LEN.pack(len(data)) + data)

    def dequeue(self, indefinite=False):
        (n,) = _LEN.unpack(_read(self._mine, _LEN.size))
        return pickle.loads(_read(self._mine, n))

    def __del__(self):
        for fd in self._fds + ([self._mine] if self._mine is not None else []):
            os.close(fd)
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
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
