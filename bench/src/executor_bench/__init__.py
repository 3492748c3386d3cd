"""executor-bench: the ``executor bench`` command.

Measures every installed backend side by side, in one run, against the baselines that can be
imported here (a ``multiprocessing.Pipe`` round trip, raw Ray actors, vLLM's shared-memory
``MessageQueue``), and writes a markdown table, a JSON file and a plot. See README.md.

This module is the plugin the registry imports in every process that loads plugins: it only
adds the subcommand; the benchmark's code is imported when the command runs.
"""

from __future__ import annotations

from executor_core import hookimpl

# Not typing.TYPE_CHECKING (importing typing costs time here); type checkers treat any
# constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any

__all__ = ["__version__", "executor_register_commands"]

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)


@hookimpl
def executor_register_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add ``executor bench``: every installed backend against the available baselines."""
    from ._cli import add_bench_command

    add_bench_command(commands)
