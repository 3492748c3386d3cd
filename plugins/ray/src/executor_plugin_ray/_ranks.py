"""Rank assignment: which actor gets which rank, so that one node's ranks are contiguous."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["ActorInfo", "WorkerPlacement", "assign_ranks"]


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
