#!/usr/bin/env python3
"""Check the SDK on a real GPU in one short run: ``python scripts/gpu_check.py``.

It checks what only a GPU shows (``--list`` names the checks; docs/gpu.md has the details and
the criteria): the same tokens on ``cuda`` as on ``cpu``, ``sleep`` freeing device memory,
the worker's step timing, each rank's calls on its own GPU, and the configurations CUDA
cannot run refused before a worker starts.

Each check runs in a process of its own with its own time limit, and the whole run ends
within its budget (``--budget``), the stop of a check that overran included; a check that
overruns is stopped, with its workers, and fails. Without a GPU (or with ``--dry-run``) the
checks that can run on the CPU do, and the CUDA-only ones are listed as SKIP. Exit status: 0
when no check failed, 1 otherwise, 2 on bad usage.

This file is the command line: its options, the budget, a process per check, the printout
and the ``--json`` report. Beside it in scripts/: _gpu_checks.py (the table of checks),
_gpu_tokens.py, _gpu_worker.py and _gpu_devices.py (the checks), _gpu_probe.py (the
environment probe), _gpu_common.py (what the checks share) and _gpu_procs.py (the process
supervisor); run as a script, this file's folder is first on the path, so it finds them.

Run it with the project's environment (``bash scripts/run.sh`` creates ``.venv``)::

    .venv/bin/python scripts/gpu_check.py --require-gpu --json gpu_check.json
    .venv/bin/python scripts/gpu_check.py --dry-run         # on a machine without a GPU

or, on a machine that reaches no package registry, from the offline bundle that
``scripts/gpu_bundle.py`` builds (it prints the command; docs/gpu.md has it too).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from _gpu_checks import BY_NAME, CHECKS, PROBE, Check, run_here
from _gpu_common import FAIL, PASS, SKIP, Context
from _gpu_probe import choose_mode
from _gpu_procs import become_subreaper, clean_strays, run_limited, tail

#: Seconds the whole run may take by default: well inside the ten minutes a person with a
#: GPU (or a rented machine) gives it, with room for the stop-and-kill of a hung check.
DEFAULT_BUDGET_S = 420.0
#: A check is not started with less than this left of the budget (it could not finish).
MIN_CHECK_S = 15.0
#: Seconds a check that overran gets to shut its workers down after SIGTERM before the kill.
TERM_GRACE_S = 10.0
#: Seconds processes a finished check left behind get to exit by themselves (Ray's reaper
#: lets its processes linger a few seconds) before they are killed.
STRAY_GRACE_S = 8.0
#: Seconds of the budget kept back from every check's limit for stopping it if it overruns
#: (SIGTERM, the grace, the kill, then its strays): the whole run ends within the budget.
STOP_RESERVE_S = TERM_GRACE_S + STRAY_GRACE_S + 2.0


@dataclasses.dataclass
class Result:
    """One check's row in the report."""

    name: str
    status: str
    summary: str
    figures: dict[str, Any]
    seconds: float = 0.0
    limit_s: float | None = None
    log_tail: list[str] = dataclasses.field(default_factory=list)


def _run_child(check: Check, gpu: bool, workdir: Path, limit_s: float, reaping: bool) -> Result:
    """Run ``check`` in a process of its own for at most ``limit_s``, then stop what it left."""
    result_path, log_path = workdir / f"{check.name}.json", workdir / f"{check.name}.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", check.name]
    command += ["--mode", "gpu" if gpu else "cpu", "--workdir", str(workdir)]
    command += ["--result", str(result_path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    finished = run_limited(
        command, log_path=log_path, env=env, limit_s=limit_s, term_grace_s=TERM_GRACE_S
    )
    killed = clean_strays(STRAY_GRACE_S) if reaping else 0
    figures: dict[str, Any] = {}
    if finished.timed_out:
        status = FAIL
        summary = f"did not finish within its {limit_s:g} s limit; stopped with its workers"
    else:
        try:
            data = json.loads(result_path.read_text())
            status, summary, figures = data["status"], data["summary"], data["figures"]
        except (OSError, ValueError, KeyError):
            status = FAIL
            summary = f"its process exited with status {finished.returncode} and no result"
    if killed:
        figures["stray_processes_killed"] = killed
        summary += f" [{killed} process(es) left behind were killed]"
    log = tail(log_path) if status == FAIL else []
    return Result(check.name, status, summary, figures, finished.seconds, limit_s, log)


def _print_result(result: Result) -> None:
    took = f"{result.seconds:6.1f} s" if result.status != SKIP or result.seconds else "       -"
    print(f"{result.status}  {result.name:<22} {took}  {result.summary}", flush=True)
    for line in result.log_tail:
        print(f"      | {line}", flush=True)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Check the SDK on a GPU (or, with --dry-run or without one, on the CPU).",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run only what the CPU can run; CUDA checks are SKIP (the default without a GPU)",
    )
    parser.add_argument(
        "--require-gpu",
        action="store_true",
        help="fail at once when no GPU is visible instead of falling back to the dry run",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the results to this file")
    parser.add_argument(
        "--only", metavar="NAME", action="append", help="run only this check (repeatable)"
    )
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds the whole run may take (default {DEFAULT_BUDGET_S:.0f})",
    )
    parser.add_argument(
        "--workdir", help="directory for checkpoints and logs (default: a temporary one)"
    )
    # Internal: how the parent starts one check in a child process.
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("gpu", "cpu"), default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None and (
        args.child not in BY_NAME or args.result is None or args.workdir is None
    ):
        parser.error("--child needs a check name, --workdir and --result")
    unknown = [n for n in args.only or () if n not in {c.name for c in CHECKS}]
    if unknown:
        parser.error(f"unknown check(s) {unknown}; see --list")
    if args.budget <= 0:
        parser.error("--budget must be > 0")
    return args


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        yield Path(tmp)


def _counts(results: Sequence[Result]) -> dict[str, int]:
    return {status: sum(r.status == status for r in results) for status in (PASS, FAIL, SKIP)}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.child is not None:
        ctx = Context(gpu=args.mode == "gpu", workdir=Path(args.workdir))
        return run_here(BY_NAME[args.child], ctx, Path(args.result))
    if args.list:
        for check in CHECKS:
            print(f"{check.name:<22} {check.limit_s:4.0f} s  {check.title}")
        return 0
    started = time.monotonic()
    deadline = started + args.budget
    reaping = become_subreaper()
    results: list[Result] = []

    def run(check: Check, gpu: bool, floor_s: float) -> Result:
        """``check`` with its limit cut to what the budget has left once the time to stop it
        is kept back; not run (a FAIL) when that leaves less than ``floor_s``."""
        limit = min(check.limit_s, deadline - time.monotonic() - STOP_RESERVE_S)
        if limit >= floor_s:
            return _run_child(check, gpu, workdir, limit, reaping)
        return Result(
            check.name,
            FAIL,
            f"not run: the {args.budget:g} s budget leaves no time for it ({max(0.0, limit):.0f}"
            f" s once {STOP_RESERVE_S:g} s are kept for stopping it, less than {floor_s:g} s)",
            {},
        )

    def report(exit_status: int | None) -> None:
        """Write the ``--json`` report. Written again after every check, so that a run cut
        short from outside (a machine taken back) leaves what it had found; ``complete`` is
        true only in the last one, with the summary and the exit status."""
        if not args.json:
            return
        data = {
            "script": "scripts/gpu_check.py",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "mode": "gpu" if env.gpu else "dry-run",
            "dry_run_reason": dry_reason,
            "budget_s": args.budget,
            "wall_s": time.monotonic() - started,
            "environment": probed.figures,
            "checks": [dataclasses.asdict(r) for r in results],
            "summary": _counts(results),
            "exit_status": exit_status,
            "complete": exit_status is not None,
        }
        Path(args.json).write_text(json.dumps(data, indent=2, default=str) + "\n")

    with _workdir(args.workdir) as workdir:
        probed = run(PROBE, False, 1.0)
        env, dry_reason = choose_mode(probed.status == PASS, probed.figures, args.dry_run)
        mode = "GPU run" if env.gpu else f"dry run on the CPU ({dry_reason})"
        print(f"gpu_check: {mode}, budget {args.budget:g} s", flush=True)
        _print_result(probed)
        not_run: str | None = None
        if probed.status != PASS:
            results.append(probed)
            not_run = "not run: the probe failed"
        elif args.require_gpu and not env.gpu:
            results.append(Result("require_gpu", FAIL, f"--require-gpu, but {dry_reason}", {}))
            _print_result(results[-1])
            not_run = "not run: no GPU (--require-gpu)"
        for check in CHECKS:
            if args.only and check.name not in args.only:
                continue
            report(None)
            reason = not_run or check.skip(env)
            if reason is not None:
                results.append(Result(check.name, SKIP, reason, {}))
            else:
                results.append(run(check, env.gpu, MIN_CHECK_S))
            _print_result(results[-1])
    counts = _counts(results)
    exit_status = 1 if counts[FAIL] or probed.status != PASS else 0
    print(
        f"summary: {counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP "
        f"({'GPU run' if env.gpu else 'dry run'}) in {time.monotonic() - started:.1f} s; "
        f"exit status {exit_status}",
        flush=True,
    )
    report(exit_status)
    return exit_status


if __name__ == "__main__":
    if importlib.util.find_spec("executor_core") is None:  # a Python that lacks the SDK
        sys.exit(
            "gpu_check: cannot import executor_core; run it with the project's environment: "
            ".venv/bin/python scripts/gpu_check.py (bash scripts/run.sh creates it), or with "
            "PYTHONPATH naming the folder the offline bundle was installed into "
            "(scripts/gpu_bundle.py prints the command)"
        )
    sys.exit(main())
