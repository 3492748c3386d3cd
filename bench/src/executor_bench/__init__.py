"""executor-bench: the ``executor bench`` command.

Measures every installed backend side by side, in one run, against the baselines that can be
imported here (a ``multiprocessing.Pipe`` round trip, raw Ray actors, vLLM's shared-memory
``MessageQueue``), and writes a markdown table, a JSON file and a plot. See README.md.

This module is the plugin the registry imports in every process that loads plugins: it only
adds the subcommand. The benchmark's code is imported when the command runs, or when a
script in ``benchmarks/`` composes the few public pieces below (a backend as a side, the
worker, a call observer, the scripts' timing loop and summaries), which load on first use.
"""

from __future__ import annotations

from executor_core import hookimpl
from executor_core.backend import lazy_getattr

# Not typing.TYPE_CHECKING (importing typing costs time here); type checkers treat any
# constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from ._overhead import CallObserver, import_ms, per_call_us
    from ._sides import BackendSide
    from ._worker import BenchWorker
    from ._workloads import format_time, interleave, markdown_table, percentile

__all__ = [
    "BackendSide",
    "BenchWorker",
    "CallObserver",
    "__version__",
    "executor_register_commands",
    "format_time",
    "import_ms",
    "interleave",
    "markdown_table",
    "per_call_us",
    "percentile",
]

#: The pieces ``benchmarks/`` composes, imported on first use (see each one's docstring).
_LAZY: dict[str, str] = {
    "BackendSide": "._sides",
    "BenchWorker": "._worker",
    "CallObserver": "._overhead",
    "format_time": "._workloads",
    "import_ms": "._overhead",
    "interleave": "._workloads",
    "markdown_table": "._workloads",
    "per_call_us": "._overhead",
    "percentile": "._workloads",
}

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)


@hookimpl
def executor_register_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add ``executor bench``: every installed backend against the available baselines."""
    from ._cli import add_bench_command

    add_bench_command(commands)


# Hidden from type checkers, which then check every imported name against the table above.
if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(__name__, _LAZY)
