"""Who a Hub admits: each member that cannot be admitted is answered Op.REFUSED at once with
the reason, decided by the admission state (the job's node ranks, those awaited now, who
holds the others), while the hub waits for its members and once its pump runs."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from channel_helpers import WAIT

from executor_channel import ChannelTimeoutError, Connection, Hub, Listener, Op, Refusal, Secret
from executor_channel._shm.doorbell import Doorbell
from executor_core import ExecutorFailedError

VERSION = "9.9.9"
TERMS = {"num_nodes": 3}


class Agents:
    """Connections that join a hub as members, all closed at the end."""

    def __init__(self, address: str, secret: Secret) -> None:
        self.address = address
        self.secret = secret
        self.links: list[Connection] = []
        self.last: dict[str, Any] = {}

    def join(self, rank: Any, **fields: Any) -> Connection:
        link = Connection(self.address, self.secret, timeout=WAIT)
        self.links.append(link)
        request = {"node_rank": rank, "hostname": "host-x", "pid": 100 + len(self.links)}
        request.update({"version": VERSION, **fields})
        link.send(Op.frame(Op.JOIN, request), timeout=WAIT)
        return link

    def refusal(self, rank: Any, **fields: Any) -> tuple[str, str, float]:
        """Join as ``rank``; the hub's refusal, its reason and how long the answer took."""
        started = time.monotonic()
        link = self.join(rank, **fields)
        message = link.recv(WAIT)
        took = time.monotonic() - started
        assert bytes(message.parts[0]) == Op.REFUSED
        info = Op.read(message.parts)
        self.last = info
        return info["refusal"], info["reason"], took

    def close(self) -> None:
        for link in self.links:
            link.close()


@contextlib.contextmanager
def hub_and_agents() -> Iterator[tuple[Hub, Agents, list[ExecutorFailedError]]]:
    secret = Secret.generate()
    failures: list[ExecutorFailedError] = []
    with Listener(secret) as listener:
        bell = Doorbell()
        hub = Hub(listener, 30.0, bell, failures.append)
        agents = Agents(listener.address, secret)
        try:
            yield hub, agents, failures
        finally:
            hub.stop(False, 0)
            agents.close()
            bell.close()


def joining(hub: Hub, timeout: float = WAIT) -> tuple[threading.Thread, dict[str, Any]]:
    """``hub.join([1, 2], ...)`` in a thread (it owns the listener until it returns)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            hub.join([1, 2], VERSION, timeout, "start them", terms=TERMS)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            box["error"] = exc

    thread = threading.Thread(target=run, name="test-hub-join")
    thread.start()
    return thread, box


def test_refusals_while_the_hub_waits_for_its_members() -> None:
    with hub_and_agents() as (hub, agents, _):
        thread, box = joining(hub)
        try:
            agents.join(1)
            deadline = time.monotonic() + WAIT
            while hub.awaited != {2} and time.monotonic() < deadline:
                time.sleep(0.01)
            assert hub.awaited == {2}
            refusal, reason, took = agents.refusal(1)
            assert refusal == Refusal.TAKEN
            assert reason == (
                "node rank 1 has joined already (member pid 101 on host-x); the executor "
                "still awaits node rank(s) 2"
            )
            assert took < 2.0
            assert agents.last["awaited"] == [2]  # for the member to say what it could do
            refusal, reason, _ = agents.refusal(7)
            assert refusal == Refusal.OUT_OF_RANGE
            assert reason == (
                "node rank 7 is out of range: this executor's members have node rank(s) 1 to 2 "
                "(num_nodes=3)"
            )
            refusal, reason, _ = agents.refusal(2, version="0.0.1")
            assert refusal == Refusal.VERSION
            assert "runs version 0.0.1, the driver 9.9.9" in reason
            refusal, reason, _ = agents.refusal(2, expects={"num_nodes": 4})
            assert refusal == Refusal.MISMATCH
            assert reason == (
                "node rank 2 was started for num_nodes=4, and this executor has num_nodes=3"
            )
            refusal, reason, _ = agents.refusal(True)
            assert refusal == Refusal.MALFORMED
            refusal, _, _ = agents.refusal(2, pid="x")
            assert refusal == Refusal.MALFORMED
            # Expectations the hub has no terms for are not checked; node rank 2 is admitted.
            agents.join(2, expects={"num_nodes": 3, "colour": "blue"})
        finally:
            thread.join(WAIT)
        assert "error" not in box
        assert hub.awaited == frozenset()
        assert [(n.node_rank, n.pid) for n in hub.nodes] == [(1, 101), (2, 108)]


def test_refusals_once_every_member_has_joined() -> None:
    with hub_and_agents() as (hub, agents, _):
        thread, box = joining(hub)
        try:
            agents.join(1)
            agents.join(2)
        finally:
            thread.join(WAIT)
        assert "error" not in box
        hub.start()  # the pump answers from now on
        late = agents.join(2)
        message = late.recv(WAIT)
        assert bytes(message.parts[0]) == Op.REFUSED
        assert Op.read(message.parts) == {
            "refusal": "taken",
            "reason": "node rank 2 has joined already (member pid 102 on host-x); the executor "
            "is starting its workers and awaits no member",
            "awaited": [],
        }
        hub.ready = True
        hub.wake()
        refusal, reason, took = agents.refusal(1)
        assert refusal == Refusal.TAKEN
        assert reason.endswith("the executor is running and awaits no member")
        assert took < 2.0
        refusal, _, _ = agents.refusal(0)
        assert refusal == Refusal.OUT_OF_RANGE
        # A node lost after the start is awaited again: a member joining for it is admitted
        # and sent nothing until the recovery sends it the node's spec, in the lost one's place.
        hub.lose(hub.nodes[0], "gone")
        assert hub.awaited == frozenset({1})
        again = agents.join(1)
        member = hub.rejoined(1, WAIT)
        assert member is not None
        assert member.pid == 100 + len(agents.links)
        assert hub.awaited == frozenset()
        refusal, reason, _ = agents.refusal(1)
        assert refusal == Refusal.TAKEN
        assert f"member pid {member.pid}" in reason
        assert hub.rejoined(2, 0.2) is None  # not lost: nobody joins for it
        with pytest.raises(ChannelTimeoutError):
            again.recv(0.3)  # no ping, call or READY before its spec
        hub.send_spec(member, "node-1", [1], b"its spec")
        message = again.recv(WAIT)
        assert [bytes(part) for part in message.parts] == [Op.SPEC, b"its spec"]
        assert hub.nodes[0] is member
        hub.nodes[1].done = True
        refusal, reason, _ = agents.refusal(2)
        assert refusal == Refusal.NOT_AWAITED
        assert "the executor is shutting down" in reason
