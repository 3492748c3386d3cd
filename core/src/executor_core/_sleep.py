"""The sleep state machine: which of :data:`SLEEP_TAGS` are asleep, as the workers left them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ._errors import SleepStateError
from ._observe import notify_sleep
from ._worker import SLEEP_TAGS

if TYPE_CHECKING:
    import pluggy

    from ._host import TransportHost

__all__ = ["SleepState"]

#: ``collective_rpc`` as sleep and wake-up use it: a blocking call of a worker method.
Rpc = Callable[..., Any]


class SleepState:
    """One executor's sleep state. It holds the host and the hooks, never the executor: the
    calls to the workers go through the ``rpc`` each transition is given."""

    def __init__(self, host: TransportHost, hooks: pluggy.HookRelay) -> None:
        self._host = host
        self._hooks = hooks
        #: The tags asleep now.
        self.tags: set[str] = set()

    def sleep(self, level: int, rpc: Rpc) -> None:
        """:meth:`Executor.sleep`: every tag goes to sleep, unless one already is."""
        if level not in (1, 2):
            raise SleepStateError(f"sleep level must be 1 or 2, not {level!r}")
        self._host.check_open()
        if self.tags:
            return
        rpc("sleep", kwargs={"level": level})
        self.tags = set(SLEEP_TAGS)
        self._changed()

    def wake_up(self, tags: Iterable[str] | None, rpc: Rpc) -> None:
        """:meth:`Executor.wake_up`: wake ``tags`` (every tag asleep, for None); a tag that is
        unknown or awake already is refused."""
        self._host.check_open()
        if tags is None:
            wanted = sorted(self.tags)
        else:
            if isinstance(tags, str):
                raise SleepStateError(f"tags must be a list of tags, not the string {tags!r}")
            wanted = list(dict.fromkeys(tags))
            unknown = [t for t in wanted if t not in SLEEP_TAGS]
            if unknown:
                raise SleepStateError(f"unknown sleep tags {unknown}; known: {list(SLEEP_TAGS)}")
            awake = [t for t in wanted if t not in self.tags]
            if awake:
                raise SleepStateError(
                    f"cannot wake {awake}: not asleep "
                    f"(asleep now: {sorted(self.tags) or 'nothing'})"
                )
        if not wanted:
            return
        rpc("wake_up", kwargs={"tags": wanted})
        self.tags.difference_update(wanted)
        self._changed()

    def _changed(self) -> None:
        notify_sleep(self._hooks, self._host.name, frozenset(self.tags))
