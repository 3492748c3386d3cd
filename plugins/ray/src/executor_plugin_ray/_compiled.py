"""execute_model through a Ray Compiled Graph: one stage of actors per pipeline rank.

The driver writes each batch once into the graph's input channel (shared memory on one node);
every rank reads it, runs ``execute_model`` and answers on its own output channel. Stage ``p``
holds the tensor-parallel ranks of pipeline rank ``p``, so outputs come back in rank order and
the output rank (first TP rank of the last stage) carries the result; the others answer
``None`` (or a failure). Hidden states between stages travel between the workers themselves
(torch.distributed send/recv), as they do on every backend.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = [
    "CompiledStep",
    "compiled_graphs_available",
    "max_inflight_steps",
    "read_outputs",
    "teardown_quietly",
]

logger = logging.getLogger("executor_plugin_ray")


def compiled_graphs_available() -> bool:
    """True if this Ray provides compiled graphs (``ray.dag`` with ``experimental_compile``)."""
    try:
        from ray.dag import InputNode, MultiOutputNode
    except ImportError:
        return False
    return hasattr(MultiOutputNode, "experimental_compile") and InputNode is not None


def max_inflight_steps() -> int:
    """How many steps may be submitted before their results are read: Ray's own limit
    (``RAY_CGRAPH_max_inflight_executions``, 10 by default). Each step in flight holds a
    shared-memory buffer in every channel of the graph."""
    from ray.dag import DAGContext

    return int(DAGContext.get_current().max_inflight_executions)


class CompiledStep:
    """The compiled graph of one executor. Not thread-safe: the transport serialises use
    (one sender, one reader, and compile and release under a lock while no step is read).

    Ray's graph loops poll their input channels while idle (a spin that yields the CPU), so
    the graph can be released while no steps are wanted (:meth:`release`) and compiled again
    (:meth:`compile`, a fraction of a second once Ray's graph code is imported).
    """

    def __init__(self, actors: Sequence[Any], tensor_parallel_size: int, max_inflight: int) -> None:
        self._actors = list(actors)
        self._tensor_parallel_size = tensor_parallel_size
        self._max_inflight = max_inflight
        self._graph: Any = None
        self._torn_down = False

    @property
    def compiled(self) -> bool:
        """True while a graph is compiled (its loops running on the actors)."""
        return self._graph is not None

    def compile(self) -> None:
        """Compile the graph unless it is compiled; an error after :meth:`teardown`."""
        if self._torn_down:
            raise RuntimeError("the compiled graph was torn down with its executor")
        if self._graph is not None:
            return
        from ray.dag import InputNode, MultiOutputNode

        size = self._tensor_parallel_size
        stages = [self._actors[start : start + size] for start in range(0, len(self._actors), size)]
        with InputNode() as batch:
            outputs = [
                actor.execute_model_compiled.bind(batch) for stage in stages for actor in stage
            ]
            graph = MultiOutputNode(outputs)
        self._graph = graph.experimental_compile(_max_inflight_executions=self._max_inflight)

    def submit(self, batch: Any) -> list[Any]:
        """Start one step; returns one CompiledDAGRef per rank, in rank order."""
        refs: list[Any] = self._graph.execute(batch)
        return refs

    def release(self, *, quiet: bool = False) -> bool:
        """Stop the actors' graph loops and release the channels; True if a graph was
        compiled. :meth:`compile` builds it again.

        ``quiet`` hides Ray's error log about loops it cannot cancel on dead actors: after a
        worker died that is expected, and the executor has already reported the death.
        """
        graph, self._graph = self._graph, None
        if graph is None:
            return False
        with _silenced("ray.dag.compiled_dag_node") if quiet else contextlib.nullcontext():
            graph.teardown()
        return True

    def teardown(self, *, quiet: bool = False) -> None:
        """:meth:`release` for good (the executor is shutting down or failed). Idempotent."""
        self._torn_down = True
        self.release(quiet=quiet)


@contextlib.contextmanager
def _silenced(name: str) -> Iterator[None]:
    log = logging.getLogger(name)
    previous = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = previous


def read_outputs(refs: Sequence[Any], deadline: float | None) -> list[Any]:
    """Every rank's output of one step (``CompiledDAGRef.get``, once per ref), waiting until
    the step completes or ``deadline`` (``time.monotonic()``) passes: then Ray raises
    ``RayChannelTimeoutError``.

    Not in slices: the graph's output is read for every rank at once, and a read that times
    out part-way loses the channels it had read (Ray 2.60), which would pair one rank's
    output with another step's. The first rank's read fetches all; the others' come from
    Ray's buffer.
    """
    timeout = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
    return [ref.get(timeout=timeout) for ref in refs]


def teardown_quietly(step: CompiledStep) -> None:
    """:meth:`CompiledStep.teardown`, logging (not raising) what fails: after a worker died
    the teardown may fail, and the actors are killed anyway."""
    try:
        step.teardown(quiet=True)
    except Exception:  # see the docstring
        logger.debug("compiled graph teardown failed", exc_info=True)
