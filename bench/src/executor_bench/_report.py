"""What a run found, written down: the machine, a markdown table, a JSON document."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from dataclasses import asdict, dataclass
from typing import Any

from ._intervals import CONFIDENCE, count, judged, ratio_estimate
from ._options import NODE_SIDES, NODES_ADDRESS, NODES_SIZE, format_size
from ._overhead import OVERHEAD_LIMITS
from ._result import BenchResult
from ._slurm import SLURM_SIDES
from ._workloads import PAYLOAD_CALLS_MAX, Row, Summary, format_time, markdown_table

__all__ = ["TARGETS", "Target", "describe_machine", "to_json", "to_markdown"]

#: Distributions whose versions describe the software the numbers come from.
_VERSIONED = ("torch", "ray", "numpy", "pyzmq")


@dataclass(frozen=True)
class Target:
    """A goal a backend is held to against a baseline, checked when both are measured."""

    backend: str
    baseline: str
    #: The row's key (``hot``, ``cold``).
    row: str
    #: ``median`` or ``p99``.
    statistic: str
    #: The largest ratio backend / baseline that meets it: met when the ratio's interval
    #: lies within it (see :mod:`executor_bench._intervals`).
    limit: float


#: The SDK's performance goals against vLLM's MessageQueue (the project's issue 15): the
#: cold call after 2 ms idle, and the tail of back-to-back no-op calls; across two nodes
#: (issue 30), near the wire and ahead of vLLM's remote readers, authentication on; on
#: Slurm, within 1.1x of the same topology without it.
TARGETS = (
    Target("mp", "vLLM MQ", "cold", "median", 0.8),
    Target("mp", "vLLM MQ", "hot", "p99", 0.6),
    *(
        Target(NODE_SIDES["mp"], NODE_SIDES[baseline], row, "median", limit)
        for row in ("nodes", f"nodes/bytes/{NODES_SIZE}")
        for baseline, limit in (("zmq", 1.5), ("vllm", 0.8))
    ),
    *(
        Target(SLURM_SIDES[mine], SLURM_SIDES[theirs], row, "median", 1.1)
        for row in ("slurm", f"slurm/bytes/{NODES_SIZE}")
        for mine, theirs in (("near", "mp"), ("far", "cluster"))
    ),
)


def _proc(path: str, key: str) -> str | None:
    """The value of ``key`` in a ``/proc`` file of ``key: value`` lines (None off Linux)."""
    try:
        with open(path, encoding="utf-8") as lines:
            found = [line.split(":", 1)[1].strip() for line in lines if line.startswith(key)]
    except OSError:
        return None
    return found[0] if found else None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_machine() -> dict[str, Any]:
    """The machine and software a run measures on, and the time it starts."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "cpu": _proc("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "memory": f"{int(kib.split()[0]) / (1 << 20):.0f} GiB"
        if (kib := _proc("/proc/meminfo", "MemTotal:")) is not None
        else "unknown",
        "os": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "versions": {name: v for name in _VERSIONED if (v := _version(name)) is not None},
        "load_average_start": list(os.getloadavg()),
    }


def _payload_calls(plan: dict[str, Any]) -> str:
    least, budget = plan["payload_calls"], plan["payload_bytes"]
    if not budget or least >= PAYLOAD_CALLS_MAX:
        return count(least, "call")
    return f"{least} to {PAYLOAD_CALLS_MAX} calls (as many as carry {format_size(budget)})"


def _ratios(
    result: BenchResult, row: Row, side: str, summaries: dict[tuple[str, str], Summary]
) -> dict[str, dict[str, float]]:
    """This side's median and p99 over each baseline's, where the baseline has the row."""
    mine = summaries[row.key, side]
    out: dict[str, dict[str, float]] = {}
    for baseline in result.sides:
        theirs = summaries.get((row.key, baseline.name))
        if baseline.role != "baseline" or baseline.name == side or theirs is None:
            continue
        out[baseline.name] = {
            "median": mine.median_s / theirs.median_s,
            "p99": mine.p99_s / theirs.p99_s,
        }
    return out


def _summaries(result: BenchResult) -> dict[tuple[str, str], Summary]:
    return {
        (row.key, side.name): Summary.of(samples) for row, side, samples in result.summary_rows()
    }


def _targets(result: BenchResult) -> list[dict[str, Any]]:
    out = []
    for target in TARGETS:
        mine = result.rounds(target.row, target.backend)
        theirs = result.rounds(target.row, target.baseline)
        if not any(mine) or not any(theirs):
            continue
        estimate = ratio_estimate(mine, theirs, target.statistic)
        row = Row.from_key(target.row)
        title = f"{target.backend} {row.title(result.plan.idle_s)}"
        if row.workload in ("nodes", "slurm"):  # the side's name says where its ranks are
            title = f"{target.backend}: {row.title(result.plan.idle_s).partition(': ')[2]}"
        out.append(
            {
                **asdict(target),
                "title": f"{title}, {target.statistic}",
                "ratio": estimate.point,
                **judged(estimate, target.limit, "ratio", "per-round ratio"),
            }
        )
    return out


def to_json(result: BenchResult, machine: dict[str, Any], command: str) -> dict[str, Any]:
    """The machine-readable results: every (row, side) summary, with its ratios."""
    summaries = _summaries(result)
    config = result.config
    return {
        "schema": 1,
        "command": command,
        "machine": machine,
        "wall_s": result.wall_s,
        "options": {
            "backends": None if config.backends is None else list(config.backends),
            "baselines": list(config.baselines),
            "sizes": list(config.sizes),
            "kinds": None if config.kinds is None else list(config.kinds),
            "workloads": list(config.workloads),
            "workers": config.workers,
            "quick": config.quick,
            "idle_s": config.idle_s,
            "backend_options": "default",
            "plan": asdict(result.plan),
        },
        "facts": result.facts,
        "sides": [
            {
                "name": side.name,
                "role": side.role,
                "workers": side.workers,
                "note": side.note,
                "version": side.version,
            }
            for side in result.sides
        ],
        "skipped": [asdict(entry) for entry in result.skipped],
        "failed": [asdict(entry) for entry in result.failed],
        "results": [
            {
                "row": row.key,
                "title": row.title(result.plan.idle_s),
                "workload": row.workload,
                "kind": row.kind,
                "size": row.size,
                "side": side.name,
                "role": side.role,
                "workers": side.workers,
                **asdict(summaries[row.key, side.name]),
                "ratios": _ratios(result, row, side.name, summaries),
            }
            for row, side, _ in result.summary_rows()
        ],
        "targets": _targets(result),
        "overhead": _overhead(result),
        "imports": result.imports,
        "tables": [asdict(table) for table in result.tables],
    }


def _overhead(result: BenchResult) -> dict[str, Any] | None:
    overhead = result.overhead
    if overhead is None:
        return None
    over = overhead.over_direct()
    return {
        "calls": overhead.calls,
        "rounds": overhead.rounds,
        "us_per_call": overhead.us_per_call,
        "us_over_direct": over,
        "targets": [
            {
                "way": way,
                "us_over_direct": (estimate := overhead.over_direct_estimate(way)).point,
                "limit_us": limit,
                **judged(estimate, limit, "µs", "per-round difference"),
            }
            for way, limit in OVERHEAD_LIMITS.items()
        ],
    }


def _verdict(target: dict[str, Any]) -> str:
    return {"met": "met", "not met": "NOT MET"}.get(target["verdict"], "undecided (not met)")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(document: dict[str, Any]) -> str:
    """The report, from :func:`to_json`'s document: the setting, then one table."""
    machine = document["machine"]
    options = document["options"]
    plan = options["plan"]
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    load = " → ".join(
        " ".join(f"{x:.2f}" for x in machine[key])
        for key in ("load_average_start", "load_average_end")
        if key in machine
    )
    lines = [
        "# executor bench",
        "",
        f"- Date: {machine['date']}",
        f"- Command: `{document['command']}`",
        f"- Machine: {machine['cores']} cores ({machine['usable_cores']} usable), "
        f"{machine['cpu']}, {machine['memory']} memory, {machine['os']}",
        f"- Software: {machine['python']}" + (f", {versions}" if versions else ""),
        f"- Load average (1, 5, 15 min), start → end: {load}",
    ]
    if document["sides"]:
        lines += [
            "- Default options: every backend runs at its default options (no backend_options); "
            "a tuned option would be named in its side's row.",
            f"- {options['workers']} workers per side (fewer where a backend runs fewer); "
            f"{count(plan['rounds'], 'interleaved round')}, each with "
            f"{count(plan['hot_calls'], 'back-to-back no-op')}, "
            f"{count(plan['cold_calls'], 'no-op')} after {options['idle_s'] * 1e3:g} ms idle and "
            f"{_payload_calls(plan)} per payload size per side; "
            f"{count(plan['startup_samples'], 'start-up')} per side"
            + (" (--quick)" if options["quick"] else ""),
        ]
    if "nodes" in options["workloads"]:
        lines.append(
            f"- Across nodes: 2 ranks a side, rank 1 on a second node behind {NODES_ADDRESS}; "
            f"{count(plan['nodes_calls'], 'call')} per row and round"
        )
    lines += [
        f"- {key.replace('_', ' ').capitalize()}: {v}" for key, v in document["facts"].items()
    ]
    lines.append(f"- Wall time: {document['wall_s']:.0f} s")
    lines += [
        "",
        "## Sides",
        "",
        "| side | role | workers | how it runs | version |",
        "|---|---|---|---|---|",
    ]
    for side in document["sides"]:
        lines.append(
            f"| {side['name']} | {side['role']} | {side['workers']} | {_cell(side['note'])} "
            f"| {_cell(side['version'])} |"
        )
    for heading, entries in (("Skipped", document["skipped"]), ("Failed", document["failed"])):
        if entries:
            lines += ["", f"{heading}:", ""]
            lines += [f"- {e['name']} ({e['role']}): {e['reason']}" for e in entries]
    if document["targets"]:
        lines += [
            "",
            "## Targets",
            "",
            f"| target | ratio | {CONFIDENCE:.0%} interval | limit | verdict | how |",
            "|---|---|---|---|---|---|",
        ]
        for t in document["targets"]:
            low, high = t["interval"]
            interval = f"{low:.2f}-{high:.2f}" if t["units"] > 1 else "-"
            lines.append(
                f"| {t['title']} / {t['baseline']} | {t['ratio']:.2f} | {interval} "
                f"| ≤ {t['limit']:g} | {_verdict(t)} | {t['note']} |"
            )
    if document.get("imports"):
        lines += ["", "## Import time (fresh interpreters, median)", "", "| what | ms |"]
        lines.append("|---|---|")
        lines += [f"| {what} | {ms:.1f} |" for what, ms in document["imports"].items()]
    overhead = document.get("overhead")
    if overhead:
        lines += [
            "",
            "## The core's cost per call (uni, in one process)",
            "",
            "The same worker method called directly and through an `uni` executor, without "
            "and with one plugin observing calls, each counting them: on the worker "
            "(`executor_worker_rpc_finished`; `observed`) or on the driver "
            "(`executor_call_started`/`_finished`; `driver-observed`); the median over "
            f"{overhead['rounds']} interleaved rounds of {overhead['calls']:,} calls (a "
            "`non_block` call: a quarter as many).",
            "",
            "| way | µs per call | µs over direct | target |",
            "|---|---|---|---|",
        ]
        limits = {t["way"]: t for t in overhead["targets"]}
        for way, us in overhead["us_per_call"].items():
            over = overhead["us_over_direct"].get(way)
            target = limits.get(way)
            limit = ""
            if target:
                low, high = target["interval"]
                limit = (
                    f"+{target['us_over_direct']:.2f} µs ({CONFIDENCE:.0%}: {low:+.2f} to "
                    f"{high:+.2f}) ≤ {target['limit_us']:g} µs: {_verdict(target)}"
                )
            lines.append(
                f"| {way} | {us:.2f} | {'' if over is None else f'{over:.2f}'} | {limit} |"
            )
        notes = {t["note"] for t in overhead["targets"]}
        lines += ["", "Targets: " + " / ".join(sorted(notes)) + "."]
    for table in document["tables"]:
        lines += ["", f"## {table['workload']}", "", table["about"], ""]
        lines.append(markdown_table(table["header"], table["rows"]))
        if table["targets"]:
            lines.append("")
        for t in table["targets"]:
            low, high = t["interval"]
            lines.append(
                f"- {t['title']}: {t['ratio']:.2f} ({low:.2f}-{high:.2f}) ≤ {t['limit']:.3g}: "
                f"{_verdict(t)} ({t['note']})"
            )
    baselines = [s["name"] for s in document["sides"] if s["role"] == "baseline"]
    if not document["results"]:
        nothing = [] if document["tables"] else ["", "## Results", "", "Nothing was measured."]
        return "\n".join([*lines, *nothing]) + "\n"
    lines += [
        "",
        "## Results",
        "",
        "Time per call: from the call to every worker's reply (start-up: from creating the "
        "side to its first call returned). `÷ X`: this side's median over X's median, then "
        "p99 over p99; below 1 is faster than X.",
        "",
        "| row | side | median | p99 | n |" + "".join(f" ÷ {b} |" for b in baselines),
        "|---|---|---|---|---|" + "---|" * len(baselines),
    ]
    workers = options["workers"]
    for r in document["results"]:
        side = r["side"]
        if r["workers"] != workers:
            side += f" ({r['workers']} worker{'s' if r['workers'] > 1 else ''})"
        ratios = "".join(
            f" {r['ratios'][b]['median']:.2f} / {r['ratios'][b]['p99']:.2f} |"
            if b in r["ratios"]
            else " - |"
            for b in baselines
        )
        lines.append(
            f"| {r['title']} | {side} | {format_time(r['median_s'])} | {format_time(r['p99_s'])} "
            f"| {r['n']} |{ratios}"
        )
    return "\n".join(lines) + "\n"
