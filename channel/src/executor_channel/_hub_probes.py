"""The hub's liveness probes of remote ranks (the hang bound's ``Transport.probe``).

A caller asks the members that hold some ranks (``PROBE``, through the pump, which owns the
listener) and waits for their ``PROBED`` answers; :class:`Probes` matches the answers to the
question by token. A member that does not answer in time counts all the ranks it was asked
about as silent: a member too busy to answer is no better, for the bound, than its workers.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from . import _hub_protocol as wire
from ._hub_member import Member

__all__ = ["Probes"]

#: What an answer may take beyond the members' own wait (the link, the member's loop).
_ANSWER_SLACK_S = 0.5


class Probes:
    """Questions in flight, by token, and their answers."""

    def __init__(self) -> None:
        self._tokens = itertools.count(1)
        self._cond = threading.Condition()
        #: token -> {node rank: silent ranks}, filled by :meth:`answer`.
        self._answers: dict[int, dict[int, list[int]]] = {}

    def ask(
        self, nodes: Iterable[Member], ranks: Sequence[int], timeout: float
    ) -> tuple[int, list[tuple[Member, list[bytes]]]]:
        """A token and the ``PROBE`` message for each member holding some of ``ranks``."""
        token = next(self._tokens)
        with self._cond:
            self._answers[token] = {}
        messages = []
        for node in nodes:
            asked = [rank for rank in ranks if rank in node.ranks]
            if asked:
                payload = {"token": token, "ranks": asked, "timeout_s": timeout}
                messages.append((node, wire.control(wire.PROBE, payload)))
        return token, messages

    def answer(self, node: Member, info: dict[str, Any]) -> None:
        """The pump: ``node``'s ``PROBED``."""
        token, silent = info.get("token"), info.get("silent")
        if not isinstance(token, int) or not isinstance(silent, list):
            return
        with self._cond:
            answers = self._answers.get(token)
            if answers is not None:
                answers[node.node_rank] = [r for r in silent if r in node.ranks]
                self._cond.notify_all()

    def wait(
        self, token: int, asked: Sequence[Member], ranks: Sequence[int], timeout: float
    ) -> set[int]:
        """The ranks among ``ranks`` that ``asked`` reported silent, or that a member which
        did not answer within ``timeout`` (plus slack) holds."""
        deadline = time.monotonic() + timeout + _ANSWER_SLACK_S
        with self._cond:
            answers = self._answers[token]
            while len(answers) < len(asked):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            del self._answers[token]
        silent = {rank for reported in answers.values() for rank in reported}
        for node in asked:
            if node.node_rank not in answers:
                silent.update(rank for rank in ranks if rank in node.ranks)
        return silent
