"""The plugin declares the 'ray' backend cheaply; options are validated before Ray starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from executor_core import ConfigError, Executor, create_executor
from executor_core.backend import Registry
from executor_core.testing import conformance_config
from executor_plugin_ray import _cluster
from executor_plugin_ray._options import RayOptions
from executor_plugin_ray._placement import ActorInfo, assign_ranks


def test_backend_is_registered_with_its_capabilities() -> None:
    registry = Registry.from_entry_points()
    spec = registry.get("ray")
    assert spec.executor == "executor_plugin_ray._executor:RayExecutor"
    assert spec.distribution == "executor-plugin-ray"
    assert spec.requires == ("ray",)
    caps = spec.capabilities
    assert (caps.pipeline_parallel, caps.multi_node, caps.devices) == (True, True, ("cpu", "cuda"))
    # Dead ranks on the driver's node get new actors; the survivors keep theirs.
    assert (caps.recovery, caps.liveness_probe) == ("replace", True)
    cls = Executor.get_class(conformance_config("ray"), registry)
    assert cls.__name__ == "RayExecutor"


def test_plugin_module_does_not_import_ray() -> None:
    code = (
        "import sys, executor_plugin_ray; executor_plugin_ray.executor_register_backends(); "
        "print(sorted(m for m in ('ray', 'torch', 'psutil') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def test_defaults() -> None:
    options = RayOptions.from_backend_options({})
    assert options.placement_strategy == "PACK"
    assert options.num_cpus_per_worker == 1.0
    assert options.address is None
    assert options.node_timeout_s == 1.0
    assert options.ring_sizes.slot_bytes == (16 << 20) + (64 << 10)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"no_such_key": 1}, "unknown key"),
        ({"placement_strategy": "DIAGONAL"}, "PACK"),
        ({"placement_timeout": 0}, "placement_timeout"),
        ({"num_cpus_per_worker": -1}, "num_cpus_per_worker"),
        ({"resources_per_worker": {"GPU": 1}}, "device"),
        ({"resources_per_worker": {"accel": "one"}}, "number"),
        ({"log_to_driver": "yes"}, "True or False"),
        ({"slot_bytes": 100}, "integer >= 4096"),
        ({"address": ""}, "non-empty"),
    ],
)
def test_bad_options_are_rejected_before_ray_starts(options: dict[str, object], match: str) -> None:
    config = conformance_config("ray", world_size=2, backend_options=options)
    with pytest.raises(ConfigError, match=match) as info:
        create_executor(config)
    assert info.value.field == "backend_options"


def test_local_instance_fits_the_workers_even_on_a_small_machine() -> None:
    machine = len(os.sched_getaffinity(0))
    assert _cluster.local_num_cpus(RayOptions(), world_size=1) == machine
    big = RayOptions(num_cpus_per_worker=2)
    assert _cluster.local_num_cpus(big, world_size=machine) == 2 * machine
    assert _cluster.local_num_cpus(RayOptions(local_num_cpus=3), world_size=64) == 3


def test_strategy_is_case_insensitive() -> None:
    options = RayOptions.from_backend_options({"placement_strategy": "spread"})
    assert options.placement_strategy == "SPREAD"


def test_ranks_are_contiguous_per_node_driver_node_first() -> None:
    infos = [
        ActorInfo("node-b", "10.0.0.2", 11, ("0",)),
        ActorInfo("node-a", "10.0.0.1", 12, ("1",)),
        ActorInfo("node-b", "10.0.0.2", 13, ("1",)),
        ActorInfo("node-a", "10.0.0.1", 14, ("0",)),
    ]
    placements = assign_ranks(infos, driver_node_id="node-a")
    assert [p.actor_index for p in placements] == [1, 3, 0, 2]
    assert [p.rank for p in placements] == [0, 1, 2, 3]
    assert [p.node_id for p in placements] == ["node-a", "node-a", "node-b", "node-b"]
    assert [p.local_rank for p in placements] == [0, 1, 0, 1]
    assert {p.local_world_size for p in placements} == {2}
    # cuda:{local_rank} is the worker's own GPU once the node's GPUs are all visible.
    for p in placements:
        own = infos[p.actor_index].gpu_ids[0]
        assert p.visible_devices is not None
        assert p.visible_devices.split(",")[p.local_rank] == own


def test_nodes_sharing_an_ip_are_still_told_apart() -> None:
    infos = [ActorInfo("n1", "127.0.0.1", 1), ActorInfo("n2", "127.0.0.1", 2)]
    placements = assign_ranks(infos, driver_node_id="head")
    assert [(p.node_id, p.local_rank, p.local_world_size) for p in placements] == [
        ("n1", 0, 1),
        ("n2", 0, 1),
    ]
    assert all(p.visible_devices is None for p in placements)
