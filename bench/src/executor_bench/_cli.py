"""The ``executor bench`` subcommand: its options, and the handler that runs the benchmark.

Light on purpose: ``executor`` adds the subcommand every time it starts; the benchmark's code
(and torch, Ray, matplotlib) is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._options import (
    BASELINES,
    DEFAULT_BASELINES,
    DEFAULT_SIZES,
    DEFAULT_WORKLOADS,
    KIB,
    MIB,
    PAYLOAD_KINDS,
    WORKLOADS,
    parse_size,
)

__all__ = ["add_bench_command"]

_DESCRIPTION = """\
Measure every installed backend side by side, in one run, against the baselines that can
run here, and report each row's median and p99 with the ratio to each baseline.

Rows: import times in fresh interpreters ("imports"), the core's cost per call on uni
("overhead"), a no-op collective_rpc back to back ("hot"), the same after --idle-ms of idle
("cold"), one argument of each --sizes and --kinds ("payload"), and start-up (create to
first call returned) and shutdown ("startup"); when named, the workloads after those in
--workloads' list (their rounds: --repeats, else each one's own; --quick: 1). Baselines:
a multiprocessing.Pipe round trip to N processes ("pipe"), raw Ray actors with ray.put once
+ refs ("ray", if ray imports), vLLM's shared-memory MessageQueue ("vllm", if vllm imports
or --vllm-path points at it; readers reply through a Pipe), the same with a MessageQueue
back from each reader, as vLLM's executor has it ("vllm-own"), or with its executor's 16 MiB
chunk ("vllm-16m"), and a pyzmq PAIR socket to each of N processes ("zmq"; the last two
only when asked for).
Writes results.md, results.json and latency.png to --output-dir and prints the table.
"""


def _csv(choices: Sequence[str] | None) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of ``choices`` when given."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names:
            raise argparse.ArgumentTypeError("give at least one name, comma-separated")
        if choices is not None:
            wrong = [name for name in names if name not in choices]
            if wrong:
                raise argparse.ArgumentTypeError(
                    f"{', '.join(map(repr, wrong))}: accepted are {', '.join(choices)}"
                )
        return list(dict.fromkeys(names))

    return parse


def _sizes(text: str) -> list[int]:
    """An argparse type: comma-separated sizes (``4K,1M,16M``)."""
    try:
        sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc}; accepted: comma-separated sizes in bytes with K, M or G, e.g. 4K,1M,16M"
        ) from None
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one size, e.g. 4K,1M")
    return sorted(set(sizes))


def _short(size: int) -> str:
    """1048576 -> ``1M``: a size as the option takes it."""
    return (
        f"{size // MIB}M"
        if size % MIB == 0
        else f"{size // KIB}K"
        if size % KIB == 0
        else str(size)
    )


def _positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if value <= 0:
            what = "integer" if kind is int else "number"
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive {what}")
        return value

    return parse


def add_bench_command(commands: argparse._SubParsersAction[Any]) -> None:
    """The ``executor bench`` subcommand (registered by the plugin's hook)."""
    parser = commands.add_parser(
        "bench",
        help="measure every installed backend against IPC, Ray and vLLM baselines",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backends",
        type=_csv(None),
        metavar="NAMES",
        help="backends to measure, comma-separated (default: every installed one that can "
        "run here; `executor backends` lists them)",
    )
    parser.add_argument(
        "--baselines",
        type=_csv(tuple(BASELINES)),
        default=list(DEFAULT_BASELINES),
        metavar="NAMES",
        help=f"baselines, comma-separated, of {','.join(BASELINES)} (default: "
        f"{','.join(DEFAULT_BASELINES)}, each that can run here; the others are reported as "
        "skipped)",
    )
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=list(DEFAULT_SIZES),
        metavar="SIZES",
        help="payload sizes, comma-separated, K/M/G = KiB/MiB/GiB (default: "
        f"{','.join(_short(size) for size in DEFAULT_SIZES)})",
    )
    parser.add_argument(
        "--kinds",
        type=_csv(PAYLOAD_KINDS),
        metavar="KINDS",
        help="payload kinds, comma-separated, of bytes,tensor (default: both; tensor only "
        "where torch is installed)",
    )
    parser.add_argument(
        "--workloads",
        type=_csv(WORKLOADS),
        default=list(DEFAULT_WORKLOADS),
        metavar="NAMES",
        help=f"workloads, comma-separated, of {','.join(WORKLOADS)} (default: "
        f"{','.join(DEFAULT_WORKLOADS)}; the others only when named: nodes, mp across two "
        "nodes against raw pyzmq over TCP and vLLM's remote readers; slurm, slurm across two "
        "Slurm nodes against the same topology without Slurm (root, Slurm); recovery, back "
        "after a SIGKILL against a new executor; reference, the reference model's tokens/s "
        "per layout; engine, vLLM's engine on the adapter against its own executors; otel, "
        "the otel plugin's cost per call; each skipped, with the reason, where it cannot run)",
    )
    parser.add_argument(
        "--repeats",
        type=_positive(int),
        metavar="N",
        help="interleaved rounds: each measures every side on every row (default 10, "
        "--quick 2); start-up is sampled min(N, 3) times (--quick: once); recovery, "
        "reference, engine and otel default to 5, 2, 5 and 7 rounds (--quick: 1)",
    )
    parser.add_argument(
        "--workers",
        type=_positive(int),
        default=2,
        metavar="N",
        help="workers per side (default 2; a backend that runs fewer, like uni, runs its most)",
    )
    parser.add_argument(
        "--idle-ms",
        type=_positive(float),
        default=2.0,
        metavar="MS",
        help="idle time before each cold call, in milliseconds (default 2)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer calls per row and round: a first look in seconds, not a record",
    )
    parser.add_argument(
        "--output-dir",
        metavar="DIR",
        help="where results.md, results.json and latency.png go "
        "(default: ./executor-bench-YYYYmmdd-HHMMSS)",
    )
    parser.add_argument(
        "--vllm-path",
        default=os.environ.get("VLLM_MQ_PATH") or None,
        metavar="DIR",
        help="a directory holding vllm/distributed/device_communicators/shm_broadcast.py, "
        "for the vLLM baseline when vllm is not installed (default: $VLLM_MQ_PATH)",
    )
    parser.add_argument(
        "--all-plugins",
        action="store_true",
        help="load every installed plugin (default: only the measured backends' plugins, "
        "so that no other plugin's hooks are timed; EXECUTOR_PLUGINS, if set, is kept)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=_bench_main, bench_parser=parser)


def _output_dir(parser: argparse.ArgumentParser, given: str | None) -> str:
    path = given or f"executor-bench-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        parser.error(f"argument --output-dir: cannot create {path!r}: {exc.strerror or exc}")
    return path


def _command_line() -> str:
    """The command as run: ``executor bench ...`` (``python -m executor_core`` shows as the
    ``executor`` command it is)."""
    program = sys.argv[0]
    if os.path.basename(program) == "__main__.py":
        program = "executor"
    return shlex.join([program, *sys.argv[1:]])


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _bench_main(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.bench_parser
    if args.kinds is not None and "payload" not in args.workloads:
        parser.error("argument --kinds: the payload workload is not selected (--workloads)")

    from ._config import BenchConfig
    from ._plot import plot_latency
    from ._report import describe_machine, to_json, to_markdown
    from ._run import Bench
    from ._sides import BenchUsageError

    config = BenchConfig(
        backends=args.backends,
        baselines=args.baselines,
        sizes=args.sizes,
        kinds=args.kinds,
        workloads=args.workloads,
        repeats=args.repeats,
        workers=args.workers,
        quick=args.quick,
        idle_s=args.idle_ms / 1e3,
        vllm_path=args.vllm_path,
        all_plugins=args.all_plugins,
        progress=not args.no_progress,
    )
    try:
        bench = Bench(config)
    except BenchUsageError as exc:
        parser.error(str(exc))
    output_dir = _output_dir(parser, args.output_dir)
    machine = describe_machine()
    # SIGTERM (a scheduler's, a `kill`) stops the run like Ctrl-C: every side started so far
    # is closed, and its processes, rings and sockets go with it.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = bench.measure()
    finally:
        signal.signal(signal.SIGTERM, previous)
    machine["load_average_end"] = list(os.getloadavg())
    document = to_json(result, machine, _command_line())
    markdown = to_markdown(document)

    paths = {name: os.path.join(output_dir, name) for name in ("results.md", "results.json")}
    with open(paths["results.md"], "w", encoding="utf-8") as out:
        out.write(markdown)
    with open(paths["results.json"], "w", encoding="utf-8") as out:
        json.dump(document, out, indent=2)
        out.write("\n")
    plot = os.path.join(output_dir, "latency.png")
    plot_latency(document, plot)
    print(markdown)
    print(f"Written: {paths['results.md']}, {paths['results.json']}, {plot}")
    if result.failed:
        names = ", ".join(entry.name for entry in result.failed)
        print(f"executor bench: failed while measured: {names} (see above)", file=sys.stderr)
        return 1
    if not (result.sides or result.tables or result.imports or result.overhead):
        print("executor bench: nothing was measured: everything was skipped", file=sys.stderr)
        return 1
    return 0
