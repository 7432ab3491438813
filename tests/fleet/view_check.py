"""residentd.fleet.View against real agents (crates/residentd/tests/e2e/fleet.rs
starts them and kills and restarts one when asked): its choice against
fleet.place's full fan-out on a fleet of varied free memory, holds and
exclusions; another scheduler's start seen without a poll; a stale
ranking's start falling through on the refusal; a hung agent left out and
resumed; an agent killed, left out, and back with another epoch. Asserts as it goes; exits non-zero with the
reason on a failure.

Usage: view_check.py JSON   where JSON is {"agents": {NAME: SOCKET, ...},
                                           "dead": SOCKET}
The test's driver reads lines "@@ kill NAME", "@@ restart NAME", "@@ stop
NAME" (SIGSTOP) and "@@ cont NAME" (SIGCONT) from this script's output
and answers each with a line once it is done.
"""

import json
import sys

import residentd
from residentd import fleet, pb

GB = 1_000_000_000
PATIENCE = 30.0
#: Place calls of each decision compared with a fan-out.
ASKED = []


def ask(what):
    """Has the driver kill or restart an agent; returns once it has."""
    print(f"@@ {what}", flush=True)
    answer = sys.stdin.readline().strip()
    assert answer == "done", (what, answer)


def wait(view, what, predicate):
    """Waits (bounded) until the view's streams make `predicate` hold."""
    if not view.wait_until(predicate, PATIENCE):
        raise AssertionError(f"not within {PATIENCE} s: {what}; the view holds {view.nodes()}")


def same(view, endpoints, workload, policy=None):
    """The view's choices are the full fan-out's, nothing having changed
    in between; at most three Place calls, and the first choice proven."""
    mine = view.place(workload, policy=policy)
    theirs = fleet.place(endpoints, workload, policy=policy)
    assert mine.choices == theirs.choices, (workload, policy, mine.choices, theirs.choices,
                                            theirs.why_not(), mine.estimates)
    assert len(mine.asked) <= 3, (workload, policy, mine.asked)
    assert mine.proven or not mine.choices, (workload, policy, mine)
    ASKED.append(len(mine.asked))
    return mine


def shows(view, endpoint, instance_id, used=None):
    """The view's picture of `endpoint` holds `instance_id` (resident),
    and, with `used`, its pool's figures count that many bytes."""
    def held():
        n = view.node(endpoint)
        i = n.instances.get(instance_id)
        ok = i is not None and i.state not in (pb.EXITED, pb.FAILED)
        return ok and (used is None or n.pools["ram"].used_bytes == used)
    return held


def main():
    setup = json.loads(sys.argv[1])
    agents, dead = setup["agents"], setup["dead"]
    endpoints = dict(agents, dead=dead)
    others = {name: residentd.Agent(e) for name, e in agents.items()}  # another scheduler
    with fleet.View(endpoints, heartbeat_s=1.0) as view:
        # Every node answered: three pictures, and one unreachable.
        for name, e in agents.items():
            n = view.node(e)
            assert n.up and n.name == name and n.epoch and len(n.epochs) == 1, n
            assert n.pools["ram"].budget_bytes > 0, n
        assert not view.node(dead).up, view.node(dead)

        # Varied free memory, from another scheduler: n1 10 GB with 3
        # held, n2 20 GB with 4, n3 30 GB with 20.
        for name, workload in (("n1", "m3"), ("n2", "m4"), ("n3", "m20")):
            others[name].start(workload, f"o-{workload}", wait_ready=True)
            size = int(workload[1:]) * GB
            wait(view, f"{name} shows o-{workload}", shows(view, agents[name], f"o-{workload}", size))
        # `loner` (2 GB) excludes m4, which n2 runs; under evict it would
        # evict it there.
        for workload in ("m1", "m2", "m4", "m8", "m15", "m20", "m25", "loner"):
            for policy in (None, "evict"):
                same(view, endpoints, workload, policy)
        r = view.place("loner")
        assert agents["n2"] not in r.choices and "excludes" in r.why_not()[agents["n2"]], r.why_not()

        # A hold: m25 fits only by evicting o-m20 on n3; held, it fits
        # nowhere. The hold comes to the view as figures (no event).
        assert view.place("m25", policy="evict").choices == [agents["n3"]]
        others["n3"].touch("o-m20", hold_ms=120_000)
        wait(view, "the hold on o-m20", lambda: view.node(agents["n3"]).holds.get("o-m20", 0) > 60)
        assert same(view, endpoints, "m25", "evict").choices == []
        others["n3"].touch("o-m20", release_hold=True)
        wait(view, "the hold released", lambda: "o-m20" not in view.node(agents["n3"]).holds)
        assert same(view, endpoints, "m25", "evict").choices == [agents["n3"]]

        # Another scheduler starts m8 where the view would: the view's
        # picture shows it from its stream (no call of the view's), and its
        # next choice is the next node.
        before = same(view, endpoints, "m8")
        best = before.choices[0]
        name = next(n for n, e in agents.items() if e == best)
        used = view.node(best).pools["ram"].used_bytes
        others[name].start("m8", "o-m8")
        wait(view, "the other scheduler's m8", shows(view, best, "o-m8", used + 8 * GB))
        after = same(view, endpoints, "m8")
        assert after.choices[0] != best, (before.choices, after.choices)

        # A stale ranking: between it and the start, another scheduler
        # fills its first choice; the start is refused there and lands on
        # the next, and the refusal's figures are in the picture.
        ranking = view.place("m4")
        first, second = ranking.choices[0], ranking.choices[1]
        free = view.node(first).pools["ram"].free_bytes
        filler = next(s for s in (1, 2, 3, 4, 8, 15, 20, 25) if free - s * GB < 4 * GB)
        name = next(n for n, e in agents.items() if e == first)
        used = view.node(first).pools["ram"].used_bytes
        others[name].start(f"m{filler}", "o-filler")
        started = view.start("m4", "v-m4", ranking=ranking)
        assert started.endpoint == second, (started.endpoint, ranking.choices)
        assert isinstance(started.attempts[first], residentd.Refused), started.attempts
        wait(view, "the filler counted", shows(view, first, "o-filler", used + filler * GB))
        same(view, endpoints, "m4")

        # A hung agent (SIGSTOP) says nothing: after three heartbeats it is
        # down and left out; continued, its stream resumes after its last
        # revision (no whole picture again, the same epoch).
        n1 = agents["n1"]
        wholes = view.node(n1).wholes
        ask("stop n1")
        wait(view, "n1 silent", lambda: not view.node(n1).up)
        assert "said nothing for 3 s" in view.node(n1).why, view.node(n1)
        r = view.place("m1")
        assert n1 not in r.choices and isinstance(r.answers[n1], fleet.Unreachable), r.answers[n1]
        ask("cont n1")
        wait(view, "n1 back", lambda: view.node(n1).up)
        n = view.node(n1)
        assert n.wholes == wholes and len(n.epochs) == 1, n
        same(view, endpoints, "m1")

        # An agent killed: its stream is down, it is left out (Unreachable)
        # until it is back, with another epoch (revisions began again).
        n2 = agents["n2"]
        epoch = view.node(n2).epoch
        ask("kill n2")
        wait(view, "n2 down", lambda: not view.node(n2).up)
        r = same(view, endpoints, "m1")
        assert n2 not in r.choices and isinstance(r.answers[n2], fleet.Unreachable), r.answers[n2]
        ask("restart n2")
        wait(view, "n2 back", lambda: view.node(n2).up)
        n = view.node(n2)
        assert n.epochs == (epoch, n.epoch) and n.epoch != epoch, n
        assert "o-m4" in n.instances, "its instances taken over by the new agent"
        r = same(view, endpoints, "m1")
        assert n2 in r.choices, r.choices
    for a in others.values():
        a.close()
    print(f"{len(ASKED)} decisions as the fan-out's, Place calls each: {sorted(set(ASKED))}")
    print("view checks passed")


if __name__ == "__main__":
    main()
