"""What a node agent's relay costs a call: two ranks on two other "nodes", each behind an
``executor node`` agent, against the same two ranks served by members of their own.

    .venv/bin/python benchmarks/relay_cost.py [--calls 1500] [--rounds 4]

Both sides keep the driver off the nodes and put each rank on a loopback "machine" of its own.
The agents' side is the ``cluster`` example (``examples/executor-cluster``: ``mp``'s executor
with its agents placed on 127.0.0.2 and 127.0.0.3; the dev install has it) at its default
options; a call there is a ``collective_rpc("noop")``, and each agent writes it into its
node's ring for its worker. The members' side is :mod:`member_round_trip`'s: a hub in this
process and two ``MemberServer`` processes that dial it from 127.0.0.2 (a member reads the
link itself). The two take turns in rounds. The gap is the agents' hop (and the core's
bookkeeping of a call, a few microseconds): what remote ranks on links of their own would
save. Figures: docs/benchmarks.md, "A member reads its own calls".
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
from collections.abc import Callable

from member_round_trip import HubSide, time_calls  # this folder: the script's own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1500, help="no-op calls a round and side")
    parser.add_argument("--rounds", type=int, default=4)
    options = parser.parse_args()
    # The agents' executor loads only what it needs (the cluster backend is mp's).
    os.environ["EXECUTOR_PLUGINS"] = "multiproc,cluster"
    from executor_bench import BackendSide

    agents = BackendSide("cluster", 2, num_nodes=2)
    try:
        members = HubSide(multiprocessing.get_context("spawn"), members=2)
    except BaseException:
        agents.close()
        raise
    sides: dict[str, Callable[[], object]] = {
        "2 node agents, a rank each": lambda: agents.call("noop", ()),
        "2 members": lambda: members.call(()),
    }
    results: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for round_ in range(options.rounds):
            order = list(sides.items())
            if round_ % 2:
                order.reverse()
            for name, call in order:
                results[name].extend(time_calls(call, options.calls))
    finally:
        agents.close()
        members.close()
    members_median = statistics.median(results["2 members"])
    print("| side | median µs | p99 µs | ratio to the members |")
    print("|---|---|---|---|")
    for name, times in results.items():
        times.sort()
        median = statistics.median(times)
        p99 = times[int(len(times) * 0.99)]
        print(
            f"| {name} | {median * 1e6:,.0f} | {p99 * 1e6:,.0f} | {median / members_median:.2f}x |"
        )


if __name__ == "__main__":
    main()
