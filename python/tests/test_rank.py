"""The fleet ranking on answers made up here: no agents needed."""

import unittest

import grpc

from residentd import fleet, pb


def admitted(evict=(), free_after=None, victims=()):
    p = pb.Placement(admitted=True, evict=list(evict))
    for instance_id, bytes_, priority in victims:
        p.victims.add(instance_id=instance_id, workload="w", bytes=bytes_, priority=priority)
    if free_after is not None:
        p.free_after_bytes = free_after
    return p


def refused(message):
    p = pb.Placement(admitted=False)
    p.refusals.add(message=message)
    return p


class RankTest(unittest.TestCase):
    def test_the_order_is_the_documented_one(self):
        answers = {
            "evicts-more": admitted(["x", "y"], 50, [("x", 10, 0), ("y", 10, 0)]),
            "evicts-high-priority": admitted(["z"], 90, [("z", 5, 9)]),
            "evicts-low-priority": admitted(["q"], 10, [("q", 5, 1)]),
            "fits-tight": admitted(free_after=1),
            "fits-roomy": admitted(free_after=100),
            "no": refused("unplaceable: too big"),
            "down": fleet.Unreachable(grpc.StatusCode.UNAVAILABLE, "connection refused"),
        }
        r = fleet.rank("w", answers, {e: e for e in answers})
        self.assertEqual(r.choices, ["fits-roomy", "fits-tight", "evicts-low-priority",
                                     "evicts-high-priority", "evicts-more"])
        self.assertEqual(set(r.why_not()), {"no", "down"})
        self.assertIn("too big", r.why_not()["no"])

    def test_ties_go_by_node_name_whatever_the_order_given(self):
        answers = {"b-end": admitted(free_after=5), "a-end": admitted(free_after=5)}
        names = {"b-end": "node-1", "a-end": "node-2"}
        for order in (list(answers), list(reversed(list(answers)))):
            r = fleet.rank("w", {e: answers[e] for e in order}, names)
            self.assertEqual(r.choices, ["b-end", "a-end"])

    def test_unbounded_pools_leave_the_most(self):
        answers = {"bounded": admitted(free_after=10**15), "unbounded": admitted()}
        self.assertEqual(fleet.rank("w", answers, {e: e for e in answers}).choices,
                         ["unbounded", "bounded"])



class PickleTest(unittest.TestCase):
    """Errors cross process boundaries (Ray actors) whole."""

    def test_errors_survive_pickling(self):
        import pickle

        from residentd import AgentError, Refused

        placement = pb.Placement(admitted=False)
        placement.refusals.add(message="unplaceable: too big").over_budget.need_bytes = 7
        e = pickle.loads(pickle.dumps(Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "too big",
                                              "OVER_BUDGET", placement, True)))
        self.assertEqual((e.reason, e.temporary, e.message), ("OVER_BUDGET", True, "too big"))
        self.assertEqual(e.reasons[0].need_bytes, 7)
        a = pickle.loads(pickle.dumps(AgentError(grpc.StatusCode.NOT_FOUND, "no such")))
        self.assertEqual((a.code, a.message), (grpc.StatusCode.NOT_FOUND, "no such"))


if __name__ == "__main__":
    unittest.main()
