#!/usr/bin/env bash
# Make the copy of vLLM's MessageQueue that `executor bench --vllm-path DIR` runs as its
# vLLM baselines: vLLM's own shm_broadcast.py, from its wheel, beside stand-ins for the few
# vllm modules it imports (settings at vLLM's defaults, a logger, address helpers). vLLM is
# not a dependency of the SDK; nothing here installs it.
# Usage: bash scripts/vllm_mq.sh [DIR (default /tmp/vllm-mq)] [VERSION (default 0.33.0)]
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-/tmp/vllm-mq}"
version="${2:-0.33.0}"
shm="vllm/distributed/device_communicators/shm_broadcast.py"
download="$(mktemp -d)"
trap 'rm -rf "$download"' EXIT
# The wheel is large (hundreds of MB); one file of it is used.
.venv/bin/python -m pip download -q --disable-pip-version-check --no-deps \
    "vllm==$version" -d "$download"
(cd "$download" && unzip -q -o vllm-*.whl "$shm")
mkdir -p "$dir/$(dirname "$shm")" "$dir/vllm/utils"
cp "$download/$shm" "$dir/$shm"
for package in vllm vllm/distributed vllm/distributed/device_communicators vllm/utils; do
    : >"$dir/$package/__init__.py"
done
echo "__version__ = \"$version\"" >"$dir/vllm/__init__.py"
cat >"$dir/vllm/envs.py" <<'EOF'
# Stand-in: the two settings shm_broadcast reads, at vLLM's defaults.
VLLM_RINGBUFFER_WARNING_INTERVAL = 60
VLLM_USE_SPINLOOP_EXT = False
EOF
cat >"$dir/vllm/logger.py" <<'EOF'
# Stand-in: vLLM's logger factory is a named standard logger.
import logging


def init_logger(name):
    return logging.getLogger(name)
EOF
cat >"$dir/vllm/platforms.py" <<'EOF'
# Stand-in: only create_from_process_group asks for the device count (the bench never does).
class _Platform:
    @staticmethod
    def device_count():
        import torch

        return max(torch.cuda.device_count(), 1)


current_platform = _Platform()
EOF
cat >"$dir/vllm/distributed/utils.py" <<'EOF'
# Stand-in: the yield its readers call between polls, and a name for a type hint.
import os

sched_yield = os.sched_yield


class StatelessProcessGroup:
    pass
EOF
cat >"$dir/vllm/utils/cpu_resource_utils.py" <<'EOF'
# Stand-in: vLLM checks the cgroup's memory before it allocates a ring; the bench's rings fit.
def check_cgroup_memory_available(required_bytes, allocation_name):
    return None
EOF
cat >"$dir/vllm/utils/network_utils.py" <<'EOF'
# Stand-in: the address helpers, on loopback (the only network here).
import ipaddress
import os
import tempfile
import uuid


def get_ip():
    return os.environ.get("VLLM_HOST_IP", "127.0.0.1")


def get_open_zmq_ipc_path():
    # As vLLM's: under VLLM_RPC_BASE_PATH (the bench gives each side a directory of its own).
    base = os.environ.get("VLLM_RPC_BASE_PATH", tempfile.gettempdir())
    return f"ipc://{base}/{uuid.uuid4()}"


def get_open_zmq_inproc_path():
    return f"inproc://{uuid.uuid4()}"


def is_valid_ipv6_address(address):
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return True
EOF
PYTHONPATH="$dir" .venv/bin/python -c \
    "from vllm.distributed.device_communicators.shm_broadcast import MessageQueue"
echo "vLLM $version's MessageQueue is in $dir: executor bench --vllm-path $dir"
