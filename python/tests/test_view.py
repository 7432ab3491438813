"""The fleet view's picture, estimates and confirmation, on nodes made up
here: no agents needed (tests/fleet/view_check.py runs it against real
ones)."""

import threading
import unittest

from residentd import fleet, pb
from residentd._picture import NEG, Picture, estimate
from residentd._view import View, _Node, confirm

GB = 1_000_000_000


def workload(name, gb, pool="ram", priority=0, excludes=(), group=None, can_sleep=False, aliases=()):
    w = pb.Workload(name=name, role=name, priority=priority, excludes=list(excludes),
                    can_sleep=can_sleep, aliases=list(aliases))
    w.demand.add(pool=pool, reserved_bytes=gb * GB)
    if group is not None:
        w.group.CopyFrom(pb.WorkloadGroup(**group))
    return w


def instance(id_, w, state=pb.READY, priority=0, adopted=False, managed=False):
    i = pb.Instance(instance_id=id_, workload=w.name, role=w.role, state=state, priority=priority,
                    adopted=adopted, managed=managed)
    for d in w.demand:
        i.demand.add(pool=d.pool, reserved_bytes=d.reserved_bytes)
    i.reserved_bytes = sum(d.reserved_bytes for d in w.demand)
    return i


def node(name, budget_gb, roster, running=(), holds=(), on_full=pb.REFUSE, epoch=7, revision=3):
    """A picture as a stream's first update makes it: `running` are
    (id, workload name[, state[, priority]]) resident, `holds` (id, ms)."""
    by_name = {w.name: w for w in roster}
    instances = [instance(r[0], by_name[r[1]], *r[2:]) for r in running]
    used = sum(i.reserved_bytes for i in instances)
    status = pb.NodeStatus(node=name, epoch=epoch, revision=revision, on_full=on_full,
                           instances=instances)
    status.pools.add(name="ram", budget_bytes=budget_gb * GB, effective_budget_bytes=budget_gb * GB,
                     used_bytes=used, free_bytes=max(budget_gb * GB - used, 0))
    figures = pb.NodeFigures(pools=status.pools)
    for id_, ms in holds:
        figures.holds.add(instance_id=id_, hold_left_ms=ms)
    p = Picture(name)
    p.apply(pb.NodeUpdate(epoch=epoch, revision=revision, node=status, figures=figures,
                          roster=pb.WorkloadsResponse(workloads=roster)), now=0.0)
    return p


def placement(admitted, free_after=None, victims=(), wait_for=()):
    """The agent's answer, as the test says it would be."""
    p = pb.Placement(admitted=admitted, wait_for=list(wait_for))
    for id_, bytes_, priority in victims:
        p.evict.append(id_)
        p.victims.add(instance_id=id_, workload="w", bytes=bytes_, priority=priority)
    if free_after is not None:
        p.free_after_bytes = free_after
    return p


class PictureTest(unittest.TestCase):
    def test_a_stream_builds_and_keeps_the_picture(self):
        m4 = workload("m4", 4)
        p = node("n1", 10, [m4], running=[("a", "m4")])
        self.assertTrue(p.known)
        self.assertEqual((p.epoch, p.revision, p.pools["ram"].used_bytes), (7, 3, 4 * GB))
        version = p.version
        # A heartbeat changes nothing but the revision it carries.
        self.assertFalse(p.apply(pb.NodeUpdate(epoch=7, revision=3), now=1.0))
        self.assertEqual(p.version, version)
        # An event, then the figures after it.
        b = instance("b", m4, state=pb.STARTING)
        figures = pb.NodeFigures()
        figures.pools.add(name="ram", effective_budget_bytes=10 * GB, used_bytes=8 * GB)
        figures.holds.add(instance_id="b", hold_left_ms=2000)
        event = pb.Event(revision=4, kind=pb.TRANSITION, instance=b)
        self.assertTrue(p.apply(pb.NodeUpdate(epoch=7, revision=4, event=event, figures=figures), now=1.0))
        self.assertEqual(sorted(p.instances), ["a", "b"])
        self.assertEqual(p.pools["ram"].used_bytes, 8 * GB)
        self.assertEqual(p.holds, {"b": 3.0})
        self.assertEqual(p.revision, 4)
        # Forgotten: gone from the picture.
        gone = pb.Event(revision=5, kind=pb.FORGOTTEN, instance=instance("a", m4, state=pb.EXITED))
        p.apply(pb.NodeUpdate(epoch=7, revision=5, event=gone), now=1.0)
        self.assertEqual(sorted(p.instances), ["b"])

    def test_a_start_of_this_view_counts_until_the_stream_shows_it(self):
        m4 = workload("m4", 4)
        p = node("n1", 10, [m4])
        p.started(instance("mine", m4, state=pb.STARTING))
        self.assertEqual(estimate(p, "m4", None, 0.0).free_after, 2 * GB)
        # Figures that came before its event: still counted once.
        stale = pb.NodeFigures()
        stale.pools.add(name="ram", effective_budget_bytes=10 * GB, used_bytes=0)
        p.apply(pb.NodeUpdate(epoch=7, revision=3, figures=stale), now=0.0)
        self.assertEqual(estimate(p, "m4", None, 0.0).free_after, 2 * GB)
        # Its event, and the figures after it: counted by the agent now.
        shown = pb.NodeFigures()
        shown.pools.add(name="ram", effective_budget_bytes=10 * GB, used_bytes=4 * GB)
        event = pb.Event(revision=4, kind=pb.TRANSITION, instance=instance("mine", m4))
        p.apply(pb.NodeUpdate(epoch=7, revision=4, event=event, figures=shown), now=0.0)
        self.assertEqual(p.pending, {})
        self.assertEqual(estimate(p, "m4", None, 0.0).free_after, 2 * GB)

    def test_an_estimate_is_kept_until_the_picture_changes(self):
        p = node("n1", 10, [workload("m4", 4)])
        first = p.estimate("m4", None, 0.0)
        self.assertIs(p.estimate("m4", None, 1.0), first)
        p.figures(p.pools.values(), 1.0)
        self.assertIsNot(p.estimate("m4", None, 1.0), first)


class EstimateTest(unittest.TestCase):
    """Each estimate against the answer the agent would give (worked out
    by hand here, as the planner decides), through `fleet.rank_key`."""

    def check(self, p, name, want, policy=None, now=0.0):
        e = estimate(p, name, policy, now)
        if want is None:
            self.assertIs(e.admits, False, e)
            return e
        self.assertIsNot(e.admits, False, e)
        key = fleet.rank_key(p.name, want)
        if e.exact:
            self.assertEqual(e.key, key)
        else:
            self.assertLessEqual(e.key, key)
        return e

    def test_free_memory_decides_where_it_fits(self):
        roster = [workload("m4", 4), workload("m8", 8)]
        p = node("n1", 20, roster, running=[("a", "m8")])
        e = self.check(p, "m4", placement(True, free_after=8 * GB))
        self.assertTrue(e.exact and e.admits)
        self.check(p, "m8", placement(True, free_after=4 * GB))
        # 8 + 8 + 8 > 20 under refuse: refused, with the pool's words.
        p2 = node("n2", 20, roster, running=[("a", "m8"), ("b", "m8")])
        e = self.check(p2, "m8", None)
        self.assertIn("only 4.0 GB of the 20.0 GB 'ram' pool is free", e.why)

    def test_an_alias_and_an_unknown_workload(self):
        p = node("n1", 10, [workload("m4", 4, aliases=["four"])])
        self.check(p, "four", placement(True, free_after=6 * GB))
        e = estimate(p, "nope", None, 0.0)
        self.assertEqual((e.admits, e.error[0]), (False, "NOT_FOUND"))

    def test_exclusions_both_ways_and_group_rules(self):
        a = workload("a", 1, excludes=["role:b"])
        b = workload("b", 1)
        c = workload("c", 1, excludes=["a"])
        s1 = workload("s1", 1, group=dict(name="g", swap=True))
        s2 = workload("s2", 1, group=dict(name="g", swap=True))
        x = workload("x", 1, group=dict(name="solo", exclusive=True))
        keep = workload("keep", 1, group=dict(name="always", persistent=True))
        roster = [a, b, c, s1, s2, x, keep]
        self.check(node("n", 10, roster, running=[("b1", "b")]), "a", None)  # a excludes b
        self.check(node("n", 10, roster, running=[("a1", "a")]), "b", None)  # a excludes b
        self.check(node("n", 10, roster, running=[("c1", "c")]), "a", None)  # c excludes a
        self.check(node("n", 10, roster, running=[("s", "s1")]), "s2", None)  # swap
        self.check(node("n", 10, roster, running=[("x1", "x")]), "s1", None)  # exclusive
        self.check(node("n", 10, roster, running=[("s", "s1")]), "x", None)  # exclusive, other way
        # A persistent group is exempt from another's exclusive rule.
        self.check(node("n", 10, roster, running=[("k", "keep")]), "x", placement(True, free_after=8 * GB))
        # Under evict, a conflict is evicted first.
        p = node("n", 10, roster, running=[("b1", "b")], on_full=pb.EVICT)
        self.check(p, "a", placement(True, free_after=9 * GB, victims=[("b1", GB, 0)]))
        # A leaving conflict is waited for (and ranks as a move).
        p = node("n", 10, roster, running=[("b1", "b", pb.STOPPING)])
        self.check(p, "a", placement(True, free_after=8 * GB, wait_for=["b1"]))

    def test_under_evict_alike_victims_are_exact_holds_and_priority_are_not_evicted(self):
        m2, m5 = workload("m2", 2), workload("m5", 5)
        big = workload("big", 9, priority=1)
        roster = [m2, m5, big]
        running = [("a", "m2"), ("b", "m2"), ("c", "m2"), ("d", "m2")]
        p = node("n", 10, roster, running=running, on_full=pb.EVICT)
        # 8 of 10 used; 5 more needs 3 freed: two of the 2 GB residents.
        self.check(p, "m5", placement(True, free_after=GB, victims=[("a", 2 * GB, 0), ("b", 2 * GB, 0)]))
        # Three held: only one 2 GB resident may go, not enough.
        held = node("n", 10, roster, running=running, holds=[("a", 5000), ("b", 5000), ("c", 5000)],
                    on_full=pb.EVICT)
        e = self.check(held, "m5", None, now=0.0)
        self.assertEqual(e.until, 5.0)  # until the first hold ends
        self.check(held, "m5", placement(True, free_after=GB, victims=[("a", 2 * GB, 0), ("b", 2 * GB, 0)]),
                   now=6.0)
        # A resident of higher priority is no victim for a lower one.
        p = node("n", 10, roster, running=[("b9", "big", pb.READY, 1)], on_full=pb.EVICT)
        self.check(p, "m2", None)
        # An adopted process the agent may not signal is no victim either.
        p = node("n", 10, roster, running=[("h", "m5", pb.READY, 0, True, False)], on_full=pb.EVICT)
        self.check(p, "big", None)

    def test_under_evict_unlike_victims_give_a_lower_bound(self):
        m1, m3, m6 = workload("m1", 1), workload("m3", 3), workload("m6", 6)
        p = node("n", 10, [m1, m3, m6], running=[("x", "m3"), ("y", "m1"), ("z", "m3")],
                 on_full=pb.EVICT)
        # 7 used, 6 more: 3 to free; the agent takes x or z (least
        # recently used), or y then one of them: 3 or 4 GB.
        e = self.check(p, "m6", placement(True, free_after=0, victims=[("x", 3 * GB, 0)]))
        self.assertFalse(e.exact)
        self.check(p, "m6", placement(True, free_after=0, victims=[("y", GB, 0), ("x", 3 * GB, 0)]))

    def test_a_sleeper_makes_it_unsure(self):
        s = workload("s", 4, can_sleep=True)
        p = node("n", 6, [s, workload("m4", 4)], running=[("s1", "s")], on_full=pb.EVICT)
        e = estimate(p, "m4", None, 0.0)
        self.assertIsNone(e.admits)
        self.assertEqual(e.key[:2], (False, 0))

    def test_any_of_is_bounded_by_its_best_choice(self):
        w = pb.Workload(name="g", role="g")
        w.any_of.add(label="gpu", candidates=["gpu0", "gpu1"], count=1, reserved_bytes=4 * GB)
        status = pb.NodeStatus(node="n", epoch=1)
        for name, used in (("gpu0", 2 * GB), ("gpu1", 5 * GB)):
            status.pools.add(name=name, effective_budget_bytes=10 * GB, used_bytes=used)
        p = Picture("n")
        p.apply(pb.NodeUpdate(epoch=1, node=status, roster=pb.WorkloadsResponse(workloads=[w])), 0.0)
        e = estimate(p, "g", None, 0.0)
        self.assertTrue(e.admits)
        self.assertEqual(e.key, (False, 0, NEG, -4 * GB, "n"))  # gpu0 leaves 4 GB free
        self.assertFalse(e.exact)  # the agent's gpu_choice may take gpu1 (1 GB left)


class RankTest(unittest.TestCase):
    def test_the_pictures_rank_as_the_answers_do(self):
        """Nodes of varied free memory, holds and exclusions: sorted by
        their estimates, they come in the order `fleet.rank` gives the
        answers the agents would give."""
        m2, m4 = workload("m2", 2), workload("m4", 4, excludes=["role:m1"])
        m1 = workload("m1", 1)
        roster = [m1, m2, m4]
        nodes = {
            "roomy": (node("roomy", 20, roster, running=[("a", "m2")]), placement(True, free_after=14 * GB)),
            "tight": (node("tight", 10, roster, running=[("a", "m2")]), placement(True, free_after=4 * GB)),
            "tie-b": (node("tie-b", 12, roster, running=[("a", "m2")]), placement(True, free_after=6 * GB)),
            "tie-a": (node("tie-a", 12, roster, running=[("a", "m2")]), placement(True, free_after=6 * GB)),
            "excluded": (node("excluded", 40, roster, running=[("o", "m1")]), None),
            "full": (node("full", 4, roster, running=[("a", "m2")]), None),
            "held": (node("held", 6, roster, running=[("a", "m2"), ("b", "m2")], holds=[("a", 9000)],
                          on_full=pb.EVICT), placement(True, free_after=0, victims=[("b", 2 * GB, 0)])),
        }
        answers = {e: want for e, (_, want) in nodes.items() if want is not None}
        want = fleet.rank("m4", answers, {e: e for e in nodes}).choices
        estimates = {e: estimate(p, "m4", None, 0.0) for e, (p, _) in nodes.items()}
        got = sorted((e.key, n) for n, e in estimates.items() if e.admits is not False)
        self.assertEqual([n for _, n in got], want)
        self.assertEqual(want, ["roomy", "tie-a", "tie-b", "tight", "held"])
        self.assertTrue(all(e.exact for e in estimates.values()))


class ConfirmTest(unittest.TestCase):
    """How many `Place` calls a decision makes, and when it is proven."""

    def run_it(self, candidates, answers, limit=3):
        calls = []

        def ask(batch):
            calls.append(list(batch))
            return [answers[e] for e in batch]

        names = {e: e for _, _, e in candidates}
        asked, proven, got = confirm(candidates, ask, limit, names)
        return calls, asked, proven

    def test_an_exact_best_takes_one_call(self):
        a = placement(True, free_after=9)
        cands = [(fleet.rank_key("a", a), True, "a"), ((False, 0, NEG, -5, "b"), True, "b")]
        calls, asked, proven = self.run_it(cands, {"a": a, "b": placement(True, free_after=5)})
        self.assertEqual((calls, proven), ([["a"]], True))

    def test_a_stale_best_goes_on_to_the_next(self):
        a_was = (False, 0, NEG, -9, "a")  # the picture: 9 free
        b = placement(True, free_after=5)
        cands = [(a_was, True, "a"), (fleet.rank_key("b", b), True, "b"), ((False, 0, NEG, -1, "c"), True, "c")]
        # a was taken meanwhile: its Place refuses; b's answer is proven.
        calls, asked, proven = self.run_it(cands, {"a": placement(False), "b": b, "c": placement(True)})
        self.assertEqual((calls, proven), ([["a"], ["b"]], True))

    def test_bounds_are_asked_together_up_to_an_exact_one_within_the_limit(self):
        x = placement(True, free_after=0, victims=[("v", 4, 0)])
        y = placement(True, free_after=0, victims=[("v", 4, 0)])
        z = placement(True, free_after=0, victims=[("v", 3, 0)])
        cands = [((True, 3, NEG, NEG, "x"), False, "x"), ((True, 3, NEG, NEG, "y"), False, "y"),
                 (fleet.rank_key("z", z), True, "z"), ((True, 9, NEG, NEG, "w"), False, "w")]
        calls, asked, proven = self.run_it(cands, {"x": x, "y": y, "z": z})
        self.assertEqual((calls, proven), ([["x", "y", "z"]], True))
        # With a limit of 2, the third could still have been better.
        calls, asked, proven = self.run_it(cands, {"x": x, "y": y, "z": z}, limit=2)
        self.assertEqual((asked, proven), (["x", "y"], False))


def fake_view(pictures):
    """A View over `pictures` (name to Picture) with no streams, whose
    Place answers what each picture says (the agents agree with it)."""
    v = View.__new__(View)
    v.names = {name: name for name in pictures}
    v._lock = threading.RLock()
    v._changed = threading.Condition(v._lock)
    v._ranked = {}
    v.confirm = 3
    v._nodes = {}
    for name, p in pictures.items():
        n = _Node(name, name)
        n.picture, n.up = p, True
        v._nodes[name] = n
    v.calls = []
    v._warm = lambda endpoints: None  # no channels to made-up nodes

    def ask(batch, req):
        v.calls.append(list(batch))
        out = []
        for e in batch:
            free = v._nodes[e].picture.pools["ram"].free_bytes
            out.append(placement(True, free_after=free - GB) if free >= GB else placement(False))
        return out
    v._ask = ask
    return v


class KeptRankingTest(unittest.TestCase):
    """A view keeps each workload's ranking between decisions and
    estimates again only the nodes whose pictures changed."""

    def test_a_changed_node_moves_in_the_kept_ranking(self):
        m = workload("m", 1)
        v = fake_view({f"n{i}": node(f"n{i}", 10 + i, [m]) for i in range(5)})
        r = v.place("m")
        self.assertEqual((r.choices, r.asked, r.proven), (["n4", "n3", "n2", "n1", "n0"], ["n4"], True))
        kept = v._ranked[("m", pb.POLICY_UNSPECIFIED)].estimates["n0"]
        # n0 grows to 30 GB (its stream's figures): first now; the others'
        # estimates are the ones kept.
        grown = pb.NodeFigures()
        grown.pools.add(name="ram", budget_bytes=30 * GB, effective_budget_bytes=30 * GB, used_bytes=0,
                        free_bytes=30 * GB)
        v._apply(v._nodes["n0"], pb.NodeUpdate(epoch=7, revision=4, figures=grown))
        r = v.place("m")
        self.assertEqual((r.choices, r.asked), (["n0", "n4", "n3", "n2", "n1"], ["n0"]))
        self.assertIsNot(r.estimates["n0"], kept)
        self.assertIs(r.estimates["n1"], v._ranked[("m", pb.POLICY_UNSPECIFIED)].estimates["n1"])
        # Its stream down: out of the ranking, Unreachable.
        with v._changed:
            v._nodes["n0"].up, v._nodes["n0"].why = False, "UNAVAILABLE: gone"
            v._touched(v._nodes["n0"])
        r = v.place("m")
        self.assertEqual(r.choices[0], "n4")
        self.assertIsInstance(r.answers["n0"], fleet.Unreachable)

    def test_a_stale_first_choice_drops_down_the_choices(self):
        m = workload("m", 1)
        v = fake_view({f"n{i}": node(f"n{i}", 10 + i, [m]) for i in range(3)})
        v.place("m")
        # n2 filled meanwhile, and its stream has not said so yet: its
        # Place refuses, n1 is asked next, and n2 is no choice.
        v._nodes["n2"].picture.pools["ram"].free_bytes = 0
        r = v.place("m")
        self.assertEqual((r.asked, r.choices, r.proven), (["n2", "n1"], ["n1", "n0"], True))


if __name__ == "__main__":
    unittest.main()
