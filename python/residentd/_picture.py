"""What a fleet view keeps of one node, and what it estimates from it.

`Picture` is one agent's node as its `WatchNode` stream tells it: the pools'
figures, the instances (priority, state, what each holds), the holds, the
roster (demands, priorities, exclusions, groups) and the node's default
policy, with the epoch and revision to resume from. `estimate` answers, from
a picture alone, what the agent's `Place` would, as far as the picture can
know: exactly where a workload fits without moving anything (and where it
is refused by a rule or by memory under the refuse policy); otherwise a
lower bound on the key `fleet.rank_key` would give the agent's answer, so
that the view knows which nodes could still beat an answer it has.

Nothing here calls an agent: the view (`_view.py`) feeds pictures from
streams and confirms estimates with `Place`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional, Tuple

from ._proto import node_agent_pb2 as pb

NEG = float("-inf")

#: States of an instance that holds nothing any more.
ENDED = (pb.EXITED, pb.FAILED)

Key = Tuple


@dataclasses.dataclass
class Estimate:
    """What a node's picture says of a Place.

    `admits`: True when the agent would admit it, False when it would not
    (`why` says why), None when the picture cannot tell. `key`: the
    ranking key of the agent's answer (`fleet.rank_key`) when `exact`,
    else a lower bound on it (no answer the agent could give ranks better).
    `free_after`: what the start leaves free in its tightest bounded pool,
    when known. `error`: the agent would answer an error, not a Placement
    (an unknown workload or pool)."""

    admits: Optional[bool]
    key: Key
    exact: bool
    why: str = ""
    free_after: Optional[int] = None
    error: Optional[Tuple[str, str]] = None
    #: Until when (time.monotonic()) the estimate stands without a change
    #: to the picture: the end of the first hold it counted on.
    until: float = float("inf")


@dataclasses.dataclass
class Picture:
    """One node as its stream told it (see the module's text)."""

    name: str
    epoch: int = 0
    revision: int = 0
    on_full: int = pb.REFUSE
    pools: Dict[str, pb.PoolStatus] = dataclasses.field(default_factory=dict)
    instances: Dict[str, pb.Instance] = dataclasses.field(default_factory=dict)
    #: Instance id to the end of its hold (the caller's clock).
    holds: Dict[str, float] = dataclasses.field(default_factory=dict)
    roster: Dict[str, pb.Workload] = dataclasses.field(default_factory=dict)
    aliases: Dict[str, str] = dataclasses.field(default_factory=dict)
    #: Starts this view made whose admission the figures may not show
    #: yet: instance id to [bytes per pool, whether its event was seen].
    pending: Dict[str, list] = dataclasses.field(default_factory=dict)
    #: Whether a whole node was received (a picture to estimate from).
    known: bool = False
    #: Bumped on every change; estimates are kept per version.
    version: int = 0
    #: Counts figures received (a refusal's figures are taken only when
    #: none came meanwhile).
    figures_seen: int = 0
    _memo: Dict[tuple, Tuple[int, Estimate]] = dataclasses.field(default_factory=dict, repr=False)
    _rules: Optional[Tuple[int, frozenset, bool]] = dataclasses.field(default=None, repr=False)

    # --- what the stream says -------------------------------------------------

    def apply(self, update: pb.NodeUpdate, now: float) -> bool:
        """Takes one update of the node's stream; whether it changed the
        picture (a heartbeat does not)."""
        changed = False
        if update.HasField("node"):
            self._whole(update.node, now)
            changed = True
        if update.HasField("event"):
            self._event(update.event)
            changed = True
        if update.HasField("figures"):
            self.figures(update.figures.pools, now, update.figures.holds)
            changed = True
        if update.HasField("roster"):
            self._roster(update.roster.workloads)
            changed = True
        self.epoch = update.epoch
        self.revision = update.revision
        if changed:
            self.version += 1
        return changed

    def _whole(self, node: pb.NodeStatus, now: float) -> None:
        self.instances = {i.instance_id: i for i in node.instances}
        self.pools = {p.name: p for p in node.pools}
        self.holds = {i.instance_id: now + i.hold_left_ms / 1000.0
                      for i in node.instances if i.hold_left_ms > 0}
        self.on_full = node.on_full or pb.REFUSE
        for id_ in [i for i in self.pending if i in self.instances]:
            del self.pending[id_]
        self.known = True

    def _event(self, e: pb.Event) -> None:
        if not e.HasField("instance"):
            return  # REFUSED, POOL: the figures that follow say the rest
        i = e.instance
        if e.kind == pb.FORGOTTEN:
            self.instances.pop(i.instance_id, None)
        else:
            self.instances[i.instance_id] = i
        if i.instance_id in self.pending:
            self.pending[i.instance_id][1] = True

    def figures(self, pools, now: float, holds=None, counted=frozenset()) -> None:
        """The pools' figures as they are: from the stream, with the
        holds; from an answer to a call, with the pending starts it
        `counted` (those made before the call)."""
        self.pools = {p.name: p for p in pools}
        if holds is not None:
            self.holds = {h.instance_id: now + h.hold_left_ms / 1000.0 for h in holds}
            # Figures sent after a pending start's event show its bytes.
            counted = {i for i, (_, seen) in self.pending.items() if seen}
        for id_ in counted:
            self.pending.pop(id_, None)
        self.figures_seen += 1
        self.version += 1

    def _roster(self, workloads) -> None:
        self.roster = {w.name: w for w in workloads}
        self.aliases = {a: w.name for w in workloads for a in w.aliases}

    def started(self, instance: pb.Instance) -> None:
        """A start this view made: counted until the stream shows it."""
        if instance.instance_id in self.instances:
            return  # the stream was first: its figures count it already
        self.instances[instance.instance_id] = instance
        held = {d.pool: d.reserved_bytes for d in instance.demand}
        self.pending[instance.instance_id] = [held, False]
        self.version += 1

    # --- what it estimates ----------------------------------------------------

    def workload(self, name: str) -> Optional[pb.Workload]:
        w = self.roster.get(name)
        if w is None and name in self.aliases:
            w = self.roster.get(self.aliases[name])
        return w

    def estimate(self, workload: str, policy: Optional[int], now: float) -> Estimate:
        """`estimate(self, ...)`, kept until the picture changes or a hold
        it counted on ends."""
        memo_key = (workload, policy)
        kept = self._memo.get(memo_key)
        if kept is not None and kept[0] == self.version and now < kept[1].until:
            return kept[1]
        e = estimate(self, workload, policy, now)
        self._memo[memo_key] = (self.version, e)
        return e

    def rules(self) -> Tuple[frozenset, bool]:
        """The roles some resident's workload excludes, and whether any
        resident is in a group: without either, no co-residency rule of a
        resident can stand in the way of a target without rules of its
        own."""
        if self._rules is None or self._rules[0] != self.version:
            roles, grouped = set(), False
            for i in self.instances.values():
                if i.state in ENDED:
                    continue
                w = self.roster.get(i.workload)
                if w is not None:
                    roles.update(_role(x) for x in w.excludes)
                    grouped = grouped or w.HasField("group")
            self._rules = (self.version, frozenset(roles), grouped)
        return self._rules[1], self._rules[2]


def _role(exclude: str) -> str:
    return exclude[len("role:"):] if exclude.startswith("role:") else exclude


def _conflict(p: Picture, target: pb.Workload, r: pb.Instance) -> Optional[str]:
    """The co-residency rule that keeps `target` from sitting beside `r`,
    in words, as the agent's planner decides it."""
    if r.role in (_role(x) for x in target.excludes):
        return f"'{target.role}' cannot be resident beside '{r.role}' ('{target.role}' excludes it)"
    rw = p.roster.get(r.workload)
    if rw is not None and target.role in (_role(x) for x in rw.excludes):
        return f"'{target.role}' cannot be resident beside '{r.role}' ('{r.role}' excludes it)"
    if not target.HasField("group") or rw is None or not rw.HasField("group"):
        return None
    tg, rg = target.group, rw.group
    if tg.name == rg.name:
        return f"'{target.role}' and '{r.role}' swap in group '{tg.name}'" if tg.swap else None
    if tg.exclusive and not rg.persistent:
        return f"group '{tg.name}' is exclusive: '{target.role}' cannot be beside '{r.role}'"
    if rg.exclusive and not tg.persistent:
        return f"group '{rg.name}' is exclusive: '{target.role}' cannot be beside '{r.role}'"
    return None


def _counted(i: pb.Instance) -> Dict[str, int]:
    """What an awake instance is counted as holding, per pool."""
    return {d.pool: d.reserved_bytes + d.overrun_bytes for d in i.demand}


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def estimate(p: Picture, workload: str, policy: Optional[int], now: float) -> Estimate:
    """What `Place(workload, policy)` would answer on the node of picture
    `p`, as far as the picture tells (see `Estimate`). `policy` None: the
    node's own."""
    name = p.name
    w = p.workload(workload)
    if w is None:
        return Estimate(False, (), True, why=f"no workload '{workload}' in its roster",
                        error=("NOT_FOUND", f"no workload '{workload}'"))
    policy = policy or p.on_full
    base = {d.pool: d.reserved_bytes for d in w.demand}
    if not w.any_of:
        return _concrete(p, w, base, policy, now)
    # Any-of demands: every concrete choice of pools. The agent picks one
    # of the admitting choices by its own rule (fewest moves, then its
    # gpu_choice): the best key among them bounds the answer from below.
    per = [[(a, c) for c in itertools.combinations(a.candidates, a.count)] for a in w.any_of]
    out: List[Estimate] = []
    for choice in itertools.product(*per):
        demand = dict(base)
        for a, pools in choice:
            for pool in pools:
                demand[pool] = demand.get(pool, 0) + a.reserved_bytes
        out.append(_concrete(p, w, demand, policy, now))
    could = [e for e in out if e.admits is not False]
    if not could:
        return Estimate(False, (), True, why=out[0].why if out else "no choice of pools",
                        error=next((e.error for e in out if e.error), None))
    best = min(could, key=lambda e: e.key)
    exact = len(could) == 1 and best.exact
    admits = True if any(e.admits for e in could) else None
    return Estimate(admits, best.key, exact, free_after=best.free_after if exact else None,
                    until=min(e.until for e in out))


def _concrete(p: Picture, w: pb.Workload, demand: Dict[str, int], policy: int,
              now: float) -> Estimate:
    """The estimate for a demand of whole pools (`demand`: pool to bytes)."""
    name = p.name
    for pool in demand:
        if pool not in p.pools:
            return Estimate(False, (), True, why=f"it has no pool '{pool}'",
                            error=("INVALID_ARGUMENT", f"no pool '{pool}'"))
    pending: Dict[str, int] = {}
    for held, _ in p.pending.values():
        for pool, n in held.items():
            pending[pool] = pending.get(pool, 0) + n

    def used(pool: str) -> int:
        return p.pools[pool].used_bytes + pending.get(pool, 0)

    def effective(pool: str) -> Optional[int]:
        s = p.pools[pool]
        return s.effective_budget_bytes if s.HasField("effective_budget_bytes") else None

    # Co-residency: conflicts to evict, and leaving ones to wait for.
    conflicts: List[Tuple[pb.Instance, str]] = []
    wait_for: List[pb.Instance] = []
    excluded_roles, grouped = p.rules()
    if w.excludes or w.HasField("group") or grouped or w.role in excluded_roles:
        for r in p.instances.values():
            if r.state in ENDED:
                continue
            why = _conflict(p, w, r)
            if why is None:
                continue
            (wait_for.append(r) if r.state == pb.STOPPING else conflicts.append((r, why)))
    # Pools the target needs, how far each is over with it.
    excess: Dict[str, int] = {}
    for pool, need in demand.items():
        e = effective(pool)
        if need > 0 and e is not None:
            excess[pool] = used(pool) + need - e

    def free_after(freed: Dict[str, int]) -> Optional[int]:
        lefts = []
        for pool, need in demand.items():
            e = effective(pool)
            if e is not None:
                lefts.append(max(max(e - (used(pool) - freed.get(pool, 0)), 0) - need, 0))
        return min(lefts) if lefts else None

    def key(evicts: bool, evicted: int, worst, left: Optional[int]) -> Key:
        return (evicts, evicted, worst, -left if left is not None else NEG, name)

    short = {pool: e for pool, e in excess.items() if e > 0}
    if not conflicts and not short:
        left = free_after({})
        return Estimate(True, key(bool(wait_for), 0, NEG, left), True, free_after=left)
    why = [c for _, c in conflicts] + [
        f"'{w.role}' needs {_gb(demand[pool])} but only "
        f"{_gb(max(effective(pool) - used(pool), 0))} of the {_gb(effective(pool))} '{pool}' pool is free"
        for pool in short]
    refused = "unplaceable (the view's picture): " + "; ".join(why)
    if policy != pb.EVICT:
        return Estimate(False, (), True, why=refused)
    return _evicting(p, w, demand, conflicts, wait_for, excess, free_after, key, refused, now)


def _evicting(p, w, demand, conflicts, wait_for, excess, free_after, key, refused, now) -> Estimate:
    """Under the evict policy, where the target does not fit as things are:
    the conflicts evicted first, then least-recently-used permitted
    residents. Which of those the agent takes depends on their last use,
    which the picture does not know: exact only where they are alike."""
    until = float("inf")

    def permitted(r: pb.Instance) -> bool:
        nonlocal until
        rw = p.roster.get(r.workload)
        hold = p.holds.get(r.instance_id, 0.0)
        if hold > now:
            until = min(until, hold)
            return False
        return (not (r.adopted and not r.managed) and r.state != pb.STOPPING
                and r.priority <= w.priority
                and not (rw is not None and rw.HasField("group") and rw.group.persistent))

    if not all(permitted(r) for r, _ in conflicts):
        return Estimate(False, (), True, why=refused, until=until)
    unsure = any(r.state == pb.SLEEPING for r, _ in conflicts)
    freed: Dict[str, int] = {}
    for r, _ in conflicts:
        for pool, n in _counted(r).items():
            freed[pool] = freed.get(pool, 0) + n
    left = {pool: e - freed.get(pool, 0) for pool, e in excess.items()}
    conflict_bytes = sum(r.reserved_bytes for r, _ in conflicts)
    conflict_worst = max((r.priority for r, _ in conflicts), default=NEG)
    if all(e <= 0 for e in left.values()):
        after = free_after(freed)
        return Estimate(True, key(True, conflict_bytes, conflict_worst, after), not unsure,
                        free_after=after, until=until)
    chosen = {r.instance_id for r, _ in conflicts}
    short = {pool for pool, e in left.items() if e > 0}
    candidates = [r for r in p.instances.values()
                  if r.state not in ENDED and r.instance_id not in chosen and permitted(r)
                  and any(_counted(r).get(pool, 0) > 0 for pool in short)]
    # Even every permitted eviction would not make room: refused.
    for pool in short:
        if sum(_counted(r).get(pool, 0) for r in candidates) < left[pool]:
            return Estimate(False, (), True, why=refused, until=until)
    evicts = bool(conflicts) or bool(wait_for)
    # Any awake instance of a workload that can sleep (ready or not: the
    # planner looks at what it holds, not at its readiness).
    sleepers = [r for r in candidates
                if r.state != pb.SLEEPING and getattr(p.roster.get(r.workload), "can_sleep", False)]
    if sleepers or unsure or any(r.state == pb.SLEEPING for r in candidates):
        # The agent may put some to sleep first, which evicts nothing.
        return Estimate(None, key(evicts, conflict_bytes, NEG, None), False, until=until)
    alike = len({(tuple(sorted(_counted(r).items())), r.reserved_bytes, r.priority)
                 for r in candidates}) == 1
    if alike:
        # Whichever it takes first, it takes as many.
        one = candidates[0]
        each = _counted(one)
        n = 0
        while any(e > 0 for e in left.values()):
            n += 1
            left = {pool: e - each.get(pool, 0) for pool, e in left.items()}
            for pool, b in each.items():
                freed[pool] = freed.get(pool, 0) + b
        worst = max(conflict_worst, one.priority)
        after = free_after(freed)
        return Estimate(True, key(True, conflict_bytes + n * one.reserved_bytes, worst, after), True,
                        free_after=after, until=until)
    # At least one more victim, each holding at least the smallest's bytes,
    # together at least what the shortest pool lacks.
    least = max(max(left[pool] for pool in short), min(r.reserved_bytes for r in candidates))
    return Estimate(True, key(True, conflict_bytes + least, NEG, None), False, until=until)
