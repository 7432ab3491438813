"""The fleet part of scripts/bench, over the agents whose sockets are listed
in a file (each with one pool `ram` of its own budget and one 1 GB workload
`m`): the full fan-out (residentd.fleet.Fleet.place: every agent's Place,
ranked) against the view (residentd.fleet.View.place: one WatchNode stream
per agent, ranked from the pictures, Place on the best few), timed one
decision at a time, in one process, one after the other.

- Fan-out: a first decision (it also connects), then ROUNDS timed.
- View: its start (every node's picture in), the client's resident memory
  it added per node, a first decision (it estimates every node once),
  then ROUNDS decisions with nothing changing and
  ROUNDS more with a start between decisions (another scheduler, a plain
  Agent, starts `m` where the view chose, and the view's stream shows it
  before the next decision). After each view decision, untimed, a full
  fan-out: its first choice must be the view's (nothing changed between
  them).

Prints one JSON object. Usage: bench_fleet.py SOCKETS_FILE ROUNDS
"""

import asyncio
import ctypes
import faulthandler
import json
import os
import sys
import time

import residentd
from residentd import fleet


def rss():
    """This process's resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def summary(times, cpu):
    times, cpu = sorted(times), sorted(cpu)
    return {
        "median_s": times[len(times) // 2],
        "p99_s": times[min(len(times) - 1, int(len(times) * 0.99))],
        "max_s": times[-1],
        # The client's own CPU per decision (median), all its threads:
        # how much of the wall time is the caller, not the agents.
        "client_cpu_s": cpu[len(cpu) // 2],
    }


def fan_out(run, f, rounds):
    """The fan-out's decisions (`f`, a `fleet.Fleet`, on the loop `run`
    drives): the first, which also connects, then `rounds` timed."""
    began = time.perf_counter()
    first = run(f.place("m"))
    connect = time.perf_counter() - began
    assert len(first.choices) == len(f.names), first.why_not()
    times, cpu = [], []
    for _ in range(rounds):
        began, began_cpu = time.perf_counter(), time.process_time()
        ranking = run(f.place("m"))
        times.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
        assert len(ranking.choices) == len(f.names), ranking.why_not()
    return dict(summary(times, cpu), first_s=connect)


def view_rounds(view, full, rounds, others=None):
    """`rounds` decisions of `view`; each compared with a full fan-out
    (`full()`) made right after it. With `others` (endpoint to Agent),
    another scheduler starts `m` on the view's choice after each, and the
    view is waited for (bounded, untimed) until its picture shows it."""
    times, cpu, calls, agree = [], [], [], 0
    # The first decision of a workload estimates every node once (later
    # ones only the nodes that changed): timed apart, as the fan-out's
    # first (which connects) is.
    began = time.perf_counter()
    view.place("m")
    first = time.perf_counter() - began
    for n in range(rounds):
        began, began_cpu = time.perf_counter(), time.process_time()
        ranking = view.place("m")
        times.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
        calls.append(len(ranking.asked))
        best = ranking.choices[0]
        agree += best == full().choices[0]
        if others is not None:
            others[best].start("m", f"bench-{n}")
            shown = view.wait_until(lambda: f"bench-{n}" in view.node(best).instances, 30.0)
            assert shown, f"the view never showed bench-{n} on {best}"
    out = summary(times, cpu)
    out.update(place_calls_mean=sum(calls) / len(calls), place_calls_max=max(calls),
               agree=agree, decisions=rounds, first_s=first)
    return out


def main(path, rounds):
    # A run that hangs ends with every thread's stack, not never.
    faulthandler.dump_traceback_later(1800, exit=True)
    with open(path) as f:
        endpoints = {f"node-{i:05d}": line.strip() for i, line in enumerate(f) if line.strip()}
    out = {"agents": len(endpoints), "rounds": rounds}
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    f = fleet.Fleet(endpoints, deadline_s=10.0)
    out["fan_out"] = fan_out(run, f, rounds)
    # What the fan-out left in the allocator goes back to the system
    # first, so that the view's growth is its own.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = rss()
    began = time.perf_counter()
    with fleet.View(endpoints, ready_s=600.0) as view:
        ready = time.perf_counter() - began
        down = [e for e, n in view.nodes().items() if not n.up]
        assert not down, f"{len(down)} nodes without a picture, e.g. {view.node(down[0])}"
        grown = rss() - before
        full = lambda: run(f.place("m"))  # noqa: E731
        v = view_rounds(view, full, rounds)
        v.update(ready_s=ready, rss_per_node_bytes=grown / len(endpoints))
        out["view"] = v
        others = {e: residentd.Agent(e) for e in endpoints.values()}
        try:
            out["view_changing"] = view_rounds(view, full, rounds, others)
        finally:
            for a in others.values():
                a.close()
    run(f.close())
    loop.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
