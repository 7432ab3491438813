"""The Python package against real agents (crates/residentd/tests/e2e/fleet.rs
starts them): every RPC of residentd.Agent, a refusal decoded, and
residentd.fleet placing models across three agents and one that is not
there. Asserts as it goes; exits non-zero with the reason on a failure.

Usage: check.py JSON   where JSON is {"agents": {NAME: SOCKET, ...},
                                      "dead": SOCKET, "stop_pid": PID, "stopped": NAME}
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import residentd
from residentd import fleet, pb

GB = 1_000_000_000


def stopped(pid, within_s=10.0):
    """Waits until every thread of `pid` is in the stopped state: kill()
    returns before a SIGSTOP takes hold, and a thread still running may
    answer one more request."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        if states and all(s == "T" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {within_s} s: {states}")


def check_logs(a):
    """Logs of `talker` (fleet.rs gives n1 one), which prints two known
    lines on stdout and two on stderr, then sleeps: every line with its
    stream, numbered from 1 in the order the agent read them (each
    stream's lines in their order; two pipes read side by side keep no
    order across streams); a tail is the last lines; stopped after."""
    assert a.start("talker", "t").created
    want = {("out one", pb.STDOUT), ("err one", pb.STDERR),
            ("out two", pb.STDOUT), ("err two", pb.STDERR)}
    deadline = time.monotonic() + 10
    lines = []
    while len(lines) < len(want):
        assert time.monotonic() < deadline, f"talker's four lines: {lines}"
        time.sleep(0.01)
        lines = list(a.logs("t", tail=10))
    assert {(l.line, l.stream) for l in lines} == want and len(lines) == 4, lines
    assert all(l.instance_id == "t" for l in lines), lines
    assert [l.seq for l in lines] == [1, 2, 3, 4], lines
    seq = {l.line: l.seq for l in lines}
    assert seq["out one"] < seq["out two"] and seq["err one"] < seq["err two"], lines
    last_two = list(a.logs("t", tail=2))
    assert [(l.line, l.stream, l.seq) for l in last_two] == \
        [(l.line, l.stream, l.seq) for l in lines[2:]], last_two
    assert a.stop("t").state == pb.EXITED


def main():
    setup = json.loads(sys.argv[1])
    agents = setup["agents"]
    n1 = agents["n1"]

    # Every RPC of the typed client, on n1 (10 GB).
    with residentd.Agent(n1) as a:
        names = [w.name for w in a.workloads()]
        assert "m8" in names and "m25" in names, names
        assert a.node().node == "n1", a.node()
        p = a.place("m25")
        assert not p.admitted and p.refusals[0].over_budget.need_bytes == 25 * GB, p
        s = a.start("m8", "x8", wait_ready=True)
        assert s.created and s.instance.state == pb.READY, s
        try:
            a.start("m25", "x25")
            raise AssertionError("m25 does not fit in 10 GB")
        except residentd.Refused as e:
            assert e.reason == "OVER_BUDGET" and not e.temporary, e
            r = e.reasons[0]
            assert (r.code, r.pool, r.need_bytes, r.free_bytes) == ("OVER_BUDGET", "ram", 25 * GB, 2 * GB), r
            assert [(h.instance_id, h.bytes) for h in r.holders] == [("x8", 8 * GB)], r.holders
            assert "unplaceable" in str(e), str(e)
        assert a.touch("x8", hold_ms=1000).instance_id == "x8"
        assert a.get("x8").state == pb.READY
        assert [i.instance_id for i in a.list()] == ["x8"]
        first = next(iter(a.watch(0)))
        assert first.kind == pb.SNAPSHOT and first.instance.instance_id == "x8", first
        try:
            a.get("nope")
            raise AssertionError("no such instance")
        except residentd.AgentError as e:
            assert e.code.name == "NOT_FOUND" and not isinstance(e, residentd.Refused), e
        assert a.stop("x8").state == pb.EXITED
        assert a.list()[0].state == pb.EXITED
        check_logs(a)
        # Adopt: a process this script started, entered without a restart,
        # released when it exits.
        outsider = subprocess.Popen(["sleep", "600"])
        try:
            i = a.adopt(outsider.pid, "m1", "hand")
            assert i.adopted and not i.managed and i.pid == outsider.pid, i
            try:
                a.stop("hand")
                raise AssertionError("an unmanaged adoption is never stopped by the agent")
            except residentd.AgentError as e:
                assert e.code.name == "FAILED_PRECONDITION", e
        finally:
            outsider.kill()
            outsider.wait()
        deadline = time.monotonic() + 10
        while a.get("hand").state != pb.EXITED:
            assert time.monotonic() < deadline, a.get("hand")
            time.sleep(0.01)
        assert a.node().pools[0].used_bytes == 0, a.node()
        # The test runs as root, the admin of a socket without [node.access].
        assert a.reload().config.endswith(".toml")

    # The fleet: n1 10 GB, n2 20 GB, n3 30 GB, and an agent that is not there.
    endpoints = dict(agents, dead=setup["dead"])
    landed = {}
    for workload in ["m25", "m15", "m8", "m4", "m3"]:
        ranking = fleet.place(endpoints, workload)
        best = ranking.answers[ranking.choices[0]]
        assert not best.evict, (workload, best)
        assert isinstance(ranking.answers[setup["dead"]], fleet.Unreachable), ranking.answers
        started = fleet.start(endpoints, workload, instance_id=workload)
        landed[workload] = ranking.names[started.endpoint]
        assert started.endpoint == ranking.choices[0], (workload, started.endpoint, ranking.choices)
    # Fits without eviction where it fits, most memory left first, ties by name.
    assert landed == {"m25": "n3", "m15": "n2", "m8": "n1", "m4": "n2", "m3": "n3"}, landed
    for name, endpoint in agents.items():
        with residentd.Agent(endpoint) as a:
            running = sorted(i.instance_id for i in a.list() if i.state == pb.READY)
            assert running == sorted(w for w, n in landed.items() if n == name), (name, running)

    # A sixth that fits nowhere: every node's reason.
    try:
        fleet.start(endpoints, "m20")
        raise AssertionError("m20 fits nowhere")
    except fleet.FleetRefused as e:
        why = e.ranking.why_not()
        assert set(why) == set(endpoints.values()), why
        assert all("unplaceable" in why[agents[n]] for n in agents), why
        # Each node by name and by the endpoint its answers are keyed by.
        assert f"n3 ({agents['n3']}): " in str(e) and "dead (" in str(e), str(e)

    # Another scheduler gets there first: the start falls back down the ranking.
    async def raced():
        async with fleet.Fleet(endpoints) as f:
            ranking = await f.place("m1")
            first, second = ranking.choices[0], ranking.choices[1]
            with residentd.Agent(first) as a:
                a.start("m2", "other-scheduler")  # fills the first choice
            started = await f.start("m1", "m1", ranking=ranking)
            assert started.endpoint == second, (started.endpoint, ranking.choices)
            assert isinstance(started.attempts[first], residentd.Refused), started.attempts
    asyncio.run(raced())

    # A hung agent is skipped at the deadline, not waited for.
    os.kill(setup["stop_pid"], signal.SIGSTOP)
    try:
        stopped(setup["stop_pid"])
        began = time.monotonic()
        ranking = fleet.place(endpoints, "m1", deadline_s=1.0)
        took = time.monotonic() - began
        hung = agents[setup["stopped"]]
        assert isinstance(ranking.answers[hung], fleet.Unreachable), ranking.answers[hung]
        assert hung not in ranking.choices
        assert took < 2.0, f"the fan-out took {took:.2f} s with a 1 s deadline"
    finally:
        os.kill(setup["stop_pid"], signal.SIGCONT)
    print("fleet checks passed")


if __name__ == "__main__":
    main()
