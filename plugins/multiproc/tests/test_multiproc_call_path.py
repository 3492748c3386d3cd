"""The driver's side of one no-op ``collective_rpc`` on ``mp`` stays short: the functions it
passes through are listed in docs/architecture.md ("One call, hop by hop"); a new layer on
the path fails this test, naming every function."""

from __future__ import annotations

import gc
import sys
from types import FrameType
from typing import Any

from executor_core import create_executor
from executor_core.backend import Registry
from executor_core.testing import conformance_config

#: Distinct functions of the SDK's packages one no-op call enters on the driver, the
#: waiting mechanics aside (see _MECHANICS): the core's and the channel's, with the wait on
#: the reply doorbell included. Lower it when a change shortens the path.
LIMIT = 30

#: Modules whose functions are how a hop waits or signals, not hops (a fence, a doorbell, the
#: spinner, the receive buffer cache's trim): which of them run depends on timing.
_MECHANICS = (
    "executor_channel._shm.fence",
    "executor_channel._shm.doorbell",
    "executor_channel._shm.spin",
    "executor_channel._memory.buffer_cache",
)
_PACKAGES = ("executor_core", "executor_channel", "executor_plugin_multiproc")
#: Comprehensions are functions of their own before Python 3.12 only.
_INLINED = ("<listcomp>", "<dictcomp>", "<setcomp>")


def test_one_noop_call_enters_at_most_limit_functions_on_the_driver() -> None:
    found: dict[str, None] = {}

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        name = frame.f_code.co_qualname
        if (
            module.startswith(_PACKAGES)
            and not module.startswith(_MECHANICS)
            and not name.endswith(_INLINED)
        ):
            found.setdefault(f"{module}.{name}")

    # No spin (each wait sleeps on its doorbell, whatever the load), no plugin's observers.
    config = conformance_config("mp", world_size=2, backend_options={"spin_s": 0.0})
    with create_executor(config, Registry.from_entry_points(allow=["multiproc"])) as executor:
        executor.collective_rpc("get_rank")  # warm: the first call caches its frame
        gc.disable()  # no finalizer of another object runs inside the trace
        try:
            # More calls than the ring has slots: the writer's look at its readers is on it.
            for _ in range(10):
                sys.setprofile(profile)
                try:
                    executor.collective_rpc("get_rank")
                finally:
                    sys.setprofile(None)
        finally:
            gc.enable()
    listed = "\n  ".join(found)
    assert len(found) <= LIMIT, (
        f"one no-op collective_rpc on mp enters {len(found)} functions on the driver (at most "
        f"{LIMIT}; update docs/architecture.md, 'One call, hop by hop', if the path really "
        f"grew):\n  {listed}"
    )
