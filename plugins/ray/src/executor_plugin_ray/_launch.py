"""Starting the workers: actors in the placement group, and what they report back at start.

Every wait here is bounded by ``startup_timeout`` (one deadline for the whole start) and
ends early when the executor fails or closes meanwhile (``check``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from executor_core import ExecutorConfig, ExecutorError, WorkerDiedError, WorkerError

from ._actor import Failed, RayWorkerActor
from ._lifeline import HOLD_S, DriverLifelines
from ._monitor import death_detail
from ._options import RayOptions
from ._placement import bundle_for
from ._ranks import WorkerPlacement

__all__ = [
    "Startup",
    "create_actor",
    "create_actors",
    "hold_lifelines",
    "kill_actors",
    "raise_failures",
    "remove_group",
]

logger = logging.getLogger("executor_plugin_ray")

#: Longest uninterrupted wait on Ray at start; between slices ``check`` runs.
_SLICE_S = 0.5


def create_actors(group: PlacementGroup, options: RayOptions, config: ExecutorConfig) -> list[Any]:
    """One actor per bundle of ``group``, in bundle order."""
    return [create_actor(group, options, config, index) for index in range(config.world_size)]


def create_actor(
    group: PlacementGroup, options: RayOptions, config: ExecutorConfig, index: int
) -> Any:
    """An actor in bundle ``index`` of ``group`` (at start, and for a rank replacement: the
    bundle stays on its node, so the new actor lands where the dead one ran)."""
    bundle = bundle_for(options, config.device)
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    actor_options: dict[str, Any] = {
        "num_cpus": options.num_cpus_per_worker,
        "num_gpus": bundle.get("GPU", 0),
        "max_restarts": 0,
        "max_task_retries": 0,
    }
    if custom:
        actor_options["resources"] = custom
    if config.env:
        actor_options["runtime_env"] = {"env_vars": dict(config.env)}
    return RayWorkerActor.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group,
            placement_group_bundle_index=index,
            placement_group_capture_child_tasks=True,
        ),
        **actor_options,
    ).remote()


class Startup:
    """Waits for what the actors report at start, within ``startup_timeout``."""

    def __init__(self, options: RayOptions, check: Callable[[], None]) -> None:
        self._timeout = options.startup_timeout
        self._check = check
        #: Each actor's place once ranks are assigned (names the node of a dead one).
        self.placements: list[WorkerPlacement] = []

    def deadline(self) -> float:
        """A deadline ``startup_timeout`` seconds from now."""
        return time.monotonic() + self._timeout

    def gather(
        self,
        refs: Sequence[Any],
        what: str,
        deadline: float,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        """One reply per ref (the i-th from rank ``ranks[i]``; by default from rank or actor
        ``i``). Raises :class:`WorkerDiedError` if an actor died, :class:`WorkerError` if its
        call failed in Ray, :class:`ExecutorError` after the deadline (naming the late
        ranks)."""
        refs = list(refs)
        named = list(range(len(refs)) if ranks is None else ranks)
        while True:
            remaining = deadline - time.monotonic()
            try:
                replies: list[Any] = ray.get(refs, timeout=max(0.0, min(_SLICE_S, remaining)))
                return replies
            except GetTimeoutError:
                pass
            except RayError as exc:
                raise self._diagnose(refs, named, what, exc) from None
            self._check()
            if remaining <= _SLICE_S:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                done = set(ready)
                late = [rank for rank, ref in zip(named, refs, strict=True) if ref not in done]
                raise ExecutorError(
                    f"Ray workers {late} did not finish {what!r} within "
                    f"startup_timeout={self._timeout:g} s; raise "
                    "backend_options['startup_timeout'] if loading the model takes longer"
                )

    def _diagnose(
        self, refs: Sequence[Any], ranks: Sequence[int], what: str, exc: RayError
    ) -> ExecutorError:
        for rank, ref in zip(ranks, refs, strict=True):
            try:
                ray.get(ref, timeout=0)
            except GetTimeoutError:
                continue
            except RayActorError as err:
                return WorkerDiedError(rank, detail=death_detail(self._placement(rank), err))
            except RayTaskError as err:
                return WorkerError(rank, what, type(err.cause).__name__, str(err.cause), str(err))
            except RayError as err:
                return WorkerError(rank, what, type(err).__name__, str(err), str(err))
        return ExecutorError(f"Ray failed during {what!r}: {exc}")

    def _placement(self, rank: int) -> WorkerPlacement | None:
        return self.placements[rank] if 0 <= rank < len(self.placements) else None


def raise_failures(replies: Sequence[Any]) -> None:
    """Raise the error of the lowest rank whose reply is a :class:`Failed`."""
    for reply in replies:
        if isinstance(reply, Failed):
            raise reply.failure.to_error()


def hold_lifelines(
    lifelines: DriverLifelines,
    actors: Sequence[Any],
    placements: Sequence[WorkerPlacement],
    driver_node: str,
    startup: Startup,
    deadline: float,
) -> None:
    """Give each actor a lifeline to this process (see ``_lifeline``): on an abstract Unix
    socket when every actor is on the driver's node, else on TCP at the driver's node IP.
    Actors that cannot connect are logged and go on without one."""
    if ray.util.client.ray.is_connected():  # type: ignore[no-untyped-call]  # unannotated in ray
        # Ray Client: this process is not the job's driver (Ray's client server is), and
        # the actors may not reach it; the client server ends the job when it is gone.
        return
    one_node = all(p.node_id == driver_node for p in placements)
    host = None if one_node else ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # unannotated in ray
    try:
        address = lifelines.listen(host)
    except OSError as exc:
        logger.warning("no lifeline for the Ray workers: %s: %s", type(exc).__name__, exc)
        return
    timeout_s = min(HOLD_S, max(1.0, deadline - time.monotonic()))
    try:
        replies = startup.gather(
            [actor.hold_lifeline.remote(address, lifelines.key, timeout_s) for actor in actors],
            "hold_lifeline",
            deadline,
        )
    finally:
        lifelines.stop_listening()
    failed = {rank: reply for rank, reply in enumerate(replies) if reply is not None}
    if failed:
        logger.warning(
            "Ray workers %s hold no lifeline to the driver at %r (%s): if this process is "
            "killed, they live on until Ray ends the job",
            sorted(failed),
            address,
            "; ".join(sorted(set(failed.values()))),
        )


def kill_actors(actors: Sequence[Any]) -> None:
    """Kill the actors (a cleanup: whatever is already gone is skipped)."""
    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead or Ray gone: nothing left to kill
            logger.debug("ray.kill failed", exc_info=True)


def remove_group(group: PlacementGroup) -> None:
    """Remove the placement group (a cleanup)."""
    if not ray.is_initialized():
        return
    try:
        remove_placement_group(group)
    except Exception:  # already removed or Ray gone
        logger.debug("remove_placement_group failed", exc_info=True)
