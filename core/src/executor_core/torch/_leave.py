"""Leaving a process group that dead peers may have broken (a survivor's part in rank
replacement)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["leave_process_group"]

_log = logging.getLogger("executor_core")


def leave_process_group() -> None:
    """Leave torch.distributed's process group (and every sub-group), if this process is in
    one; a no-op otherwise.

    For a rank whose peers may have died: unlike ``torch.distributed.destroy_process_group``
    it logs, not raises, the error of a group a dead peer broke. On NCCL the communicators
    are aborted, as a communicator in error can hang a destroy. On gloo, a rank still blocked
    on the group in a call with this one sees its call fail at once: survivors that leave
    free each other. Raises ``RuntimeError`` only if the process is still in a process group
    afterwards, as joining a new one would then fail.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    backend = str(dist.get_backend())
    # Private (and newer than torch 2.4, so looked up): torch's only teardown of NCCL
    # communicators without a collective handshake, which one in error may never complete.
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if "nccl" in backend and abort is not None:
        _leave_with("aborting", abort)
    if dist.is_initialized():
        _leave_with("destroying", dist.destroy_process_group)  # also every sub-group
    if dist.is_initialized() and abort is not None:
        # destroy_process_group raised before it let go of the group: abort clears it.
        _leave_with("aborting", abort)
    if dist.is_initialized():
        raise RuntimeError(
            f"could not leave the torch.distributed process group ({backend}): its teardown "
            "failed (logged); this process cannot join a new one"
        )


def _leave_with(what: str, teardown: Callable[[], None]) -> None:
    """Run ``teardown`` on the process group, logging (not raising) what a broken group
    raises: torch.distributed's errors (``DistError``) and the backends' ``RuntimeError``
    (gloo's "Connection closed by peer"), of which ``DistError`` is a kind."""
    try:
        teardown()
    except RuntimeError as error:
        _log.warning(
            "%s the torch.distributed process group failed, as a broken group's may: %s: %s",
            what,
            type(error).__name__,
            error,
        )
