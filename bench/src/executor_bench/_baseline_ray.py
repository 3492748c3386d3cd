"""The ``Ray actors`` baseline: N plain Ray actors, in the Ray session the run holds.

A call is ``ray.get([a.method.remote(...) ...])``, and a payload is ``ray.put`` once, its ref
passed to every actor (the data enters the object store once, as it enters a backend's ring
once). Only if ray imports; ray is imported when the side starts.
"""

from __future__ import annotations

from typing import Any

from ._worker import size_of

__all__ = ["RawActor", "RayActorsSide"]


class RawActor:
    """The Ray baseline's actor: the worker's methods, no executor in between."""

    def noop(self) -> None:
        """Return at once."""
        return None

    def size_of(self, payload: Any) -> int:
        """The payload's size."""
        return size_of(payload)

    def execute_model(self, batch: Any) -> Any:
        """Return ``batch``."""
        return batch


class RayActorsSide:
    """``workers`` plain Ray actors, in the Ray session this process holds; a payload is
    ``ray.put`` once per call and its ref passed to every actor."""

    def __init__(self, workers: int) -> None:
        import ray

        # No CPU reserved: the run's Ray instance is sized for the ray backend's workers,
        # which reserve theirs, and both sides' processes are alive at once.
        actor_cls: Any = ray.remote(RawActor)
        self.actors = [actor_cls.options(num_cpus=0).remote() for _ in range(workers)]
        ray.get([actor.noop.remote() for actor in self.actors])

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """``ray.get`` of each actor's ``method.remote(*args)``."""
        import ray

        args = tuple(ray.put(arg) for arg in args)
        return list(ray.get([getattr(actor, method).remote(*args) for actor in self.actors]))

    def close(self) -> None:
        """Kill the actors (Ray's own processes stay: the run's Ray session owns them)."""
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors.clear()
