"""latency.png: the median time per call against the payload's size, one panel per kind."""

from __future__ import annotations

from typing import Any

from ._options import PAYLOAD_KINDS, format_size

__all__ = ["plot_latency"]


def plot_latency(document: dict[str, Any], path: str) -> None:
    """Draw the payload rows of :func:`~executor_bench._report.to_json`'s document: log-log,
    one line per side (backends solid, baselines dashed), one panel per payload kind."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed, or wanted
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    rows = [r for r in document["results"] if r["workload"] == "payload"]
    kinds = [kind for kind in PAYLOAD_KINDS if any(r["kind"] == kind for r in rows)]
    figure = Figure(figsize=(6.4 * max(1, len(kinds)), 4.8), layout="constrained")
    axes = figure.subplots(1, max(1, len(kinds)), squeeze=False)[0]
    workers = document["options"]["workers"]
    figure.suptitle(f"executor bench: median time per call, {workers} workers")
    if not kinds:
        axes[0].text(0.5, 0.5, "no payload rows were measured", ha="center", va="center")
        axes[0].set_axis_off()
    sizes = sorted({r["size"] for r in rows})
    for axis, kind in zip(axes[: len(kinds)], kinds, strict=True):
        for side in document["sides"]:
            points = sorted(
                (r["size"], r["median_s"] * 1e3)
                for r in rows
                if r["kind"] == kind and r["side"] == side["name"]
            )
            if not points:
                continue
            label = side["name"]
            if side["workers"] != workers:
                label += f" ({side['workers']} worker{'s' if side['workers'] > 1 else ''})"
            axis.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o" if side["role"] == "backend" else "s",
                linestyle="-" if side["role"] == "backend" else "--",
                label=label,
            )
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.xaxis.set_major_locator(FixedLocator(sizes))
        axis.xaxis.set_minor_locator(NullLocator())
        axis.set_xticks(sizes, [format_size(s) for s in sizes])
        axis.set_xlabel(f"{kind} argument size")
        axis.set_ylabel("median time per call (ms)")
        axis.set_title(f"{kind} argument")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    figure.savefig(path, dpi=110)
