"""The placement group (one bundle per worker, reserved before any actor starts) and the
ranks: which actor gets which, so that one node's ranks are contiguous."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from executor_core import ExecutorError

from ._options import RayOptions

__all__ = [
    "ActorInfo",
    "PlacementTimeoutError",
    "WorkerPlacement",
    "assign_ranks",
    "bundle_for",
    "reserve_placement_group",
]


class PlacementTimeoutError(ExecutorError, TimeoutError):
    """The cluster could not reserve the workers' resources within ``placement_timeout``."""


def bundle_for(options: RayOptions, device: str) -> dict[str, float]:
    """The resources one worker reserves: CPUs, one GPU on cuda, and custom resources."""
    bundle: dict[str, float] = {}
    if options.num_cpus_per_worker > 0:
        bundle["CPU"] = options.num_cpus_per_worker
    if device == "cuda":
        bundle["GPU"] = 1.0
    bundle.update(options.resources_per_worker)
    if not bundle:
        # Ray rejects empty bundles; a tiny CPU share keeps the bundle valid and schedulable.
        bundle["CPU"] = 0.001
    return bundle


def reserve_placement_group(options: RayOptions, device: str, world_size: int) -> PlacementGroup:
    """Create the placement group and wait until it is ready; :class:`PlacementTimeoutError`
    (the group removed) if it is not within ``placement_timeout``, saying what was asked for
    and what the cluster has."""
    bundles = [bundle_for(options, device) for _ in range(world_size)]
    group: PlacementGroup = placement_group(bundles, strategy=options.placement_strategy)
    try:
        ready = group.wait(timeout_seconds=options.placement_timeout)
    except BaseException:
        remove_placement_group(group)
        raise
    if not ready:
        message = _explain_timeout(options, bundles)
        remove_placement_group(group)
        raise PlacementTimeoutError(message)
    return group


def _explain_timeout(options: RayOptions, bundles: list[dict[str, float]]) -> str:
    total: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    lines = [
        f"the Ray cluster could not place {len(bundles)} worker(s) within "
        f"placement_timeout={options.placement_timeout:g} s.",
        f"Requested: {len(bundles)} bundle(s) of {_fmt(bundles[0])} "
        f"(total {_fmt(total)}), strategy {options.placement_strategy}.",
    ]
    try:  # ray's state functions are unannotated, hence the ignores
        lines.append(f"Cluster total: {_fmt(ray.cluster_resources())}.")  # type: ignore[no-untyped-call]
        lines.append(f"Available now: {_fmt(ray.available_resources())}.")  # type: ignore[no-untyped-call]
        for node in ray.nodes():  # type: ignore[no-untyped-call]
            if node.get("Alive"):
                where = f"{node['NodeID'][:12]} ({node.get('NodeManagerAddress', '?')})"
                lines.append(f"  node {where}: {_fmt(node.get('Resources', {}))}")
    except Exception as exc:  # noqa: BLE001 - the explanation must not hide the timeout itself
        lines.append(f"(could not read the cluster's resources: {exc})")
    lines.append(
        "Free resources, add nodes, lower backend_options['num_cpus_per_worker'] or "
        "'resources_per_worker', pick another 'placement_strategy', or raise "
        "'placement_timeout'."
    )
    return "\n".join(lines)


def _fmt(resources: dict[str, Any]) -> str:
    """Resources without Ray's internal per-node, memory and group entries."""
    shown = [
        f"{name}: {float(amount):g}"
        for name, amount in sorted(resources.items())
        if not name.startswith("node:")
        and name not in ("memory", "object_store_memory")
        and "_group_" not in name
    ]
    return "{" + ", ".join(shown) + "}"


@attrs.frozen
class ActorInfo:
    """Where an actor landed, as it reports it."""

    node_id: str
    node_ip: str
    pid: int
    #: Accelerator ids Ray assigned to the actor (strings, as Ray reports them).
    gpu_ids: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class WorkerPlacement:
    """A worker's rank and place in the cluster (see ``RayExecutor.placements``)."""

    rank: int
    local_rank: int
    local_world_size: int
    node_id: str
    node_ip: str
    pid: int
    #: Index of the actor (and its placement-group bundle) in creation order.
    actor_index: int
    #: ``CUDA_VISIBLE_DEVICES`` for the worker when it uses GPUs: every GPU of its node's
    #: workers, in local-rank order, so that ``cuda:{local_rank}`` is its own.
    visible_devices: str | None = None


def assign_ranks(infos: Sequence[ActorInfo], driver_node_id: str) -> list[WorkerPlacement]:
    """Order actors so that ranks on one node are contiguous, the driver's node first.

    Nodes follow the driver's node, then the order in which their first actor appears
    (placement-group bundle order); inside a node, actors keep bundle order. Nodes are told
    apart by Ray node id, not IP, so several nodes may share an address.
    """
    by_node: dict[str, list[int]] = {}
    for index, info in enumerate(infos):
        by_node.setdefault(info.node_id, []).append(index)
    nodes = sorted(by_node, key=lambda node: (node != driver_node_id, by_node[node][0]))
    placements: list[WorkerPlacement] = []
    for node in nodes:
        members = by_node[node]
        gpus = [gpu for index in members for gpu in infos[index].gpu_ids]
        visible = ",".join(gpus) if gpus else None
        for local_rank, index in enumerate(members):
            info = infos[index]
            placements.append(
                WorkerPlacement(
                    rank=len(placements),
                    local_rank=local_rank,
                    local_world_size=len(members),
                    node_id=info.node_id,
                    node_ip=info.node_ip,
                    pid=info.pid,
                    actor_index=index,
                    visible_devices=visible,
                )
            )
    return placements
