"""A shared-memory segment whose name never outlives its creation.

The segment is created in ``/dev/shm`` under a random 128-bit name with mode 0600, space is
reserved with ``posix_fallocate`` (so a full ``/dev/shm`` fails here with a clear error rather
than with SIGBUS later), and the name is unlinked at once: workers receive the open file
descriptor, not the name. Whatever happens to any process afterwards, even SIGKILL, nothing
is left in ``/dev/shm``; the memory is freed when the last process unmaps it.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets

from executor_core import ExecutorError

__all__ = ["SHM_DIR", "SharedSegment", "check_free_space"]

#: Where POSIX shared memory lives on Linux (its free space bounds a node's rings).
SHM_DIR = "/dev/shm"
_NAME_PREFIX = "executor-mp-"
_MIB = 1 << 20


def check_free_space(nbytes: int, directory: str = SHM_DIR) -> None:
    """Raise :class:`ExecutorError` if ``directory`` has less than ``nbytes`` free."""
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        raise ExecutorError(_too_small(nbytes, free, directory))


def _too_small(needed: int, free: int, directory: str) -> str:
    return (
        f"{directory} has {free / _MIB:.0f} MiB free but the executor needs "
        f"{needed / _MIB:.0f} MiB for its shared-memory rings; lower backend_options "
        "'slots', 'slot_bytes', 'reply_slots' or 'reply_slot_bytes', or give the machine "
        "more shared memory (for Docker: --shm-size)"
    )


class SharedSegment:
    """A mapped shared-memory segment, created by the driver and attached by the workers."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        # MAP_POPULATE maps every page now, so the first calls do not pay page faults.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags=flags)
        self.buf: memoryview = memoryview(self._mmap)

    @classmethod
    def create(cls, size: int, directory: str = SHM_DIR) -> SharedSegment:
        """Create, reserve and map ``size`` bytes; the name is already gone when this returns."""
        check_free_space(size, directory)
        path = os.path.join(directory, _NAME_PREFIX + secrets.token_hex(16))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.unlink(path)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise ExecutorError(_too_small(size, 0, directory)) from exc
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, size: int) -> SharedSegment:
        """Map a segment from a descriptor inherited from the driver."""
        return cls(fd, size)

    def close(self) -> None:
        """Unmap and close the descriptor. Idempotent.

        If another thread still holds a view of the mapping, the unmapping is left to the
        garbage collector; the descriptor is closed either way.
        """
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        try:
            self.buf.release()
            mapping.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        with contextlib.suppress(OSError):
            os.close(self.fd)
