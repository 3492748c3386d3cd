"""torch support: distributed set-up, devices, memory measurement and weight offloading.

Importing this subpackage imports torch (the core's optional extra, ``executor-core[torch]``);
``import executor_core`` does not. A worker calls :func:`init_distributed` from its
``init_device`` and :meth:`ParallelState.destroy` from its ``shutdown``; a surviving rank
whose dead peers were replaced calls :meth:`ParallelState.rejoin` (or
:func:`leave_process_group`) from its ``rejoin``.
"""

from ._devices import check_gpu_per_local_rank, select_device
from ._distributed import ParallelState, init_distributed
from ._leave import leave_process_group
from ._memory import (
    DeviceMemory,
    device_memory,
    host_memory_bytes,
    mapped_zeros,
    pinned_host_bytes,
    release_pinned_host_memory,
    trim_host_memory,
)
from ._offload import TensorOffloader

__all__ = [
    "DeviceMemory",
    "ParallelState",
    "TensorOffloader",
    "check_gpu_per_local_rank",
    "device_memory",
    "host_memory_bytes",
    "init_distributed",
    "leave_process_group",
    "mapped_zeros",
    "pinned_host_bytes",
    "release_pinned_host_memory",
    "select_device",
    "trim_host_memory",
]
