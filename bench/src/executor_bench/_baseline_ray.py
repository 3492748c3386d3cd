"""The ``Ray actors`` baseline: N plain Ray actors, in the Ray session the run holds.

A call is ``ray.get([a.method.remote(...) ...])``, and a payload is ``ray.put`` once, its ref
passed to every actor (the data enters the object store once, as it enters a backend's ring
once). Only if ray imports; ray is imported when the side starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._worker import make, size_of

__all__ = ["RawActor", "RayActorsSide"]


class RawActor:
    """The Ray baseline's actor: the worker's methods, no executor in between."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def noop(self) -> None:
        """Return at once."""
        return None

    def size_of(self, payload: Any) -> int:
        """The payload's size."""
        return size_of(payload)

    def make(self, nbytes: int, on_rank: int) -> bytes | None:
        """``nbytes`` bytes from rank ``on_rank``, None from the others."""
        return make(self.rank, nbytes, on_rank)

    def execute_model(self, batch: Any) -> Any:
        """Return ``batch``."""
        return batch

    def node_id(self) -> str:
        """The Ray node the actor runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())


class RayActorsSide:
    """``workers`` plain Ray actors, in the Ray session this process holds.

    ``put_once``: a payload is ``ray.put`` once per call and its ref passed to every actor;
    otherwise the value is passed to each (Ray puts one over 100 KiB per actor call).
    ``options``: ``ray.remote`` options, for every actor or (a list) one dict per actor.
    """

    def __init__(
        self,
        workers: int,
        put_once: bool = True,
        options: dict[str, Any] | Sequence[dict[str, Any]] = (),
    ) -> None:
        import ray

        self._put_once = put_once
        each = [options] * workers if isinstance(options, dict) else list(options)
        # No CPU reserved by default: the run's Ray instance is sized for the ray backend's
        # workers, which reserve theirs, and both sides' processes are alive at once.
        each = [{"num_cpus": 0, **(each[rank] if each else {})} for rank in range(workers)]
        # Concurrency groups are the class's: ray.remote takes them, .options() does not.
        groups = {k: v for k, v in each[0].items() if k == "concurrency_groups"}
        actor_cls: Any = ray.remote(**groups)(RawActor) if groups else ray.remote(RawActor)
        self.actors = [
            actor_cls.options(**{k: v for k, v in opts.items() if k not in groups}).remote(rank)
            for rank, opts in enumerate(each)
        ]
        ray.get([actor.noop.remote() for actor in self.actors])

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """``ray.get`` of each actor's ``method.remote(*args)``."""
        import ray

        if self._put_once:
            args = tuple(ray.put(arg) for arg in args)
        return list(ray.get([getattr(actor, method).remote(*args) for actor in self.actors]))

    def close(self) -> None:
        """Kill the actors (Ray's own processes stay: the run's Ray session owns them)."""
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors.clear()
