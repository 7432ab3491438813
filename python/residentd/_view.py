"""`residentd.fleet.View`: placement from a picture of every node, kept
current by one `WatchNode` stream per agent, confirmed by `Place` on the
best few.

A fan-out (`fleet.place`) asks every agent for every decision. A view asks
once, when it connects, and then listens: each agent streams its node (the
whole node first, then every event, the pools' figures and holds when they
move, the roster when it changes, a heartbeat when quiet), and the view
ranks from what it keeps (`_picture.py`), with the same ranking as
`fleet.rank`. It then asks `Place` of the nodes it ranked best, in order,
until no node it did not ask could rank better than an answer it has, or
it has asked `confirm` of them: the answer is the agents' own wherever it
decides. A start goes to the best confirmed node and down the ranking on a
refusal, which also corrects the picture: the agent has the last word.

The streams run on an event loop in a thread of the view's own; `place`
and `start` are synchronous and make their calls from the caller's thread
on channels of their own (made when a node is first asked).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import threading
import time
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import grpc

from . import _client
from ._client import AgentError, Refused, Tls, Unreachable
from ._picture import Estimate, Picture
from ._proto import node_agent_pb2 as pb
from ._proto import node_agent_pb2_grpc as pb_grpc
from .fleet import Endpoints, FleetRefused, Ranking, Started, _names, rank_key

#: Reconnection after a stream ends: the first wait, doubled to the last.
_BACKOFF = (0.05, 1.0)


@dataclasses.dataclass
class ViewRanking(Ranking):
    """A `Ranking` made by a `View`. `asked`: the endpoints whose `Place`
    was called, in order (their `answers` are the agents' own). `proven`:
    no node left unasked could rank above the first choice, as the
    pictures stand. `estimates`: what each node's picture said
    (`residentd._picture.Estimate`); `answers` of nodes not asked are made
    from them (admitted or refused, the pools, `free_after_bytes` where
    known; never victims)."""

    asked: List[str] = dataclasses.field(default_factory=list)
    proven: bool = False
    estimates: Dict[str, Estimate] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class NodeState:
    """One node as the view holds it now (copies)."""

    endpoint: str
    name: str
    #: Its stream is up and its picture is whole.
    up: bool
    #: Why it is not up (an error, "connecting"); "" when it is.
    why: str
    epoch: int
    #: Every epoch seen, first to last: a restarted agent adds one.
    epochs: Tuple[int, ...]
    #: Whole pictures received: 1, and one more each time its stream
    #: could not resume (a new epoch, a revision no longer kept, a lag).
    wholes: int
    revision: int
    pools: Dict[str, pb.PoolStatus]
    instances: Dict[str, pb.Instance]
    #: Instances under a hold, and the seconds left of it.
    holds: Dict[str, float]
    #: Seconds since its stream last said anything.
    heard_s: float


class _Ranked:
    """One workload's ranking under one policy, kept between decisions:
    each node's estimate and answer, the candidates sorted by key, and the
    nodes changed since (estimated again at the next decision only)."""

    def __init__(self, endpoints):
        self.dirty = set(endpoints)
        self.estimates: Dict[str, Estimate] = {}
        self.answers: Dict[str, object] = {}
        #: (key, exact, endpoint) of every node that may admit, sorted.
        self.order: List[Tuple[tuple, bool, str]] = []
        self.entry: Dict[str, Tuple[tuple, bool, str]] = {}
        #: When a hold an estimate counted on ends: everything again then.
        self.until = float("inf")


class _Node:
    """A node of the view: its picture and its streams' state (under the
    view's lock), and the channel of the caller's calls."""

    def __init__(self, endpoint: str, name: str):
        self.endpoint = endpoint
        self.picture = Picture(name)
        self.up = False
        self.why = "connecting"
        self.answered = False
        self.epochs: List[int] = []
        self.wholes = 0
        self.heard = 0.0
        #: The stream now (in the view's loop), when it was opened, and
        #: whether the silence check cancelled it.
        self.call = None
        self.opened = 0.0
        self.silent = False
        self._stub: Optional[pb_grpc.NodeAgentStub] = None
        self._channel = None

    def stub(self, tls: Optional[Tls]) -> pb_grpc.NodeAgentStub:
        """The stub of the caller's calls; the channel is made (and begins
        to connect) the first time."""
        if self._stub is None:
            self._channel = _client._channel(self.endpoint, tls)
            self._stub = pb_grpc.NodeAgentStub(self._channel)
            # Connects now, not at the first call (nothing waits for it).
            self._ready = grpc.channel_ready_future(self._channel)
        return self._stub

    def close(self) -> None:
        if self._channel is not None:
            self._ready.cancel()
            self._channel.close()
            self._channel, self._stub = None, None


class View:
    """A placement view of many agents (see the module's text).

    `endpoints`: a list, or names to endpoints (Unix socket paths or
    `HOST:PORT`); `tls`: mutual TLS for `HOST:PORT` endpoints. `confirm`:
    at most this many `Place` calls per decision. `deadline_s`: each
    `Place` call's. `figures_every_s`: the least time between two updates
    of figures no event caused (the agent's rate limit). `heartbeat_s`: an
    agent that says nothing for three of these is taken as down and its
    stream opened again. `ready_s`: how long the constructor waits for
    every node's first answer (its picture, or that it is down).

    Use as a context manager, or `close()` it.
    """

    def __init__(self, endpoints: Endpoints, *, tls: Optional[Tls] = None, confirm: int = 3,
                 deadline_s: float = 2.0, figures_every_s: float = 0.25, heartbeat_s: float = 5.0,
                 ready_s: float = 10.0):
        if confirm < 1:
            raise ValueError("confirm must be at least 1: the agents decide")
        if heartbeat_s < 0.2:
            raise ValueError("heartbeat_s must be at least 0.2: a silent agent is told by it")
        self.names = _names(endpoints)
        self.tls = tls
        self.confirm = confirm
        self.deadline_s = deadline_s
        self._every_ms = int(figures_every_s * 1000)
        self._heartbeat_s = heartbeat_s
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._nodes = {e: _Node(e, name) for e, name in self.names.items()}
        self._ranked: Dict[Tuple[str, int], _Ranked] = {}
        self._closing = False
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="residentd-view",
                                        daemon=True)
        self._thread.start()
        started.wait()
        if ready_s:
            self.wait_until(lambda: all(n.answered for n in self._nodes.values()), ready_s)

    # --- lifetime ---------------------------------------------------------

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main(started))
        self._loop.close()

    async def _main(self, started: threading.Event) -> None:
        """Every watcher and the silence check, until `close`; then their
        calls are cancelled and they are given a few seconds to end (a
        read gRPC never completes must not hold the caller's close)."""
        self._stop = asyncio.Event()
        tasks = [asyncio.ensure_future(self._watch(n)) for n in self._nodes.values()]
        tasks.append(asyncio.ensure_future(self._silence()))
        started.set()
        await self._stop.wait()
        for n in self._nodes.values():
            if n.call is not None:
                n.call.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=5.0)

    def close(self) -> None:
        """Ends every stream and closes every channel."""
        if self._closing:
            return
        self._closing = True
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30.0)
        for n in self._nodes.values():
            n.close()

    def __enter__(self) -> "View":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the streams --------------------------------------------------------

    async def _silence(self) -> None:
        """Every heartbeat: a stream that said nothing for three heartbeats
        (an agent that hangs, a network gone quiet, a connection never
        answered) is cancelled; its watcher marks the node down and opens
        it again."""
        limit = 3 * self._heartbeat_s
        while True:
            await asyncio.sleep(self._heartbeat_s)
            now = time.monotonic()
            for n in self._nodes.values():
                if n.call is not None and not n.silent and now - max(n.heard, n.opened) > limit:
                    n.silent = True
                    n.call.cancel()

    async def _watch(self, node: _Node) -> None:
        """Keeps `node`'s picture: one stream at a time, opened again after
        it ends (a new channel each time: gRPC's own reconnection waits
        longer and longer), resuming by revision within the epoch."""
        wait = _BACKOFF[0]
        while True:
            channel = _client._channel(node.endpoint, self.tls, aio=True)
            try:
                with self._lock:
                    known = node.picture.known
                    since = node.picture.revision if known else 0
                    epoch = node.picture.epoch if known else 0
                # Each node's heartbeat a little shorter than the view's, by
                # a share of its own: streams opened together do not beat
                # together, in bursts the view reads at once.
                share = zlib.crc32(node.endpoint.encode()) / 2**32
                beat_ms = int(self._heartbeat_s * (0.75 + 0.25 * share) * 1000)
                req = pb.WatchNodeRequest(since_revision=since, epoch=epoch,
                                          figures_every_ms=self._every_ms, heartbeat_ms=beat_ms)
                node.opened, node.silent = time.monotonic(), False
                node.call = pb_grpc.NodeAgentStub(channel).WatchNode(req)
                async for update in node.call:
                    self._apply(node, update)
                    wait = _BACKOFF[0]
                why = "the agent ended its stream"
            except asyncio.CancelledError:
                if self._closing or not node.silent:
                    node.call = None
                    await channel.close()
                    raise
                why = f"said nothing for {3 * self._heartbeat_s:g} s"
            except grpc.aio.AioRpcError as e:
                why = f"{e.code().name}: {e.details()}"
                if node.silent:
                    why = f"said nothing for {3 * self._heartbeat_s:g} s"
                elif e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    why = "the agent has no WatchNode (it is older than this package)"
                elif e.code() == grpc.StatusCode.UNAVAILABLE:
                    # In words that say what to do, where a look finds out.
                    found = await asyncio.to_thread(_client._why_unreachable, node.endpoint, self.tls, 1.0)
                    why = found or why
            except Exception as e:  # noqa: BLE001 - the watcher must go on
                why = f"the view could not read its stream: {e!r}"
            if node.call is not None:
                node.call.cancel()
                node.call = None
            await channel.close()
            with self._changed:
                node.up, node.why, node.answered = False, why, True
                self._touched(node)
            await asyncio.sleep(wait)
            wait = min(wait * 2, _BACKOFF[1])

    def _apply(self, node: _Node, update: pb.NodeUpdate) -> None:
        with self._changed:
            changed = node.picture.apply(update, time.monotonic())
            if update.HasField("node"):
                node.wholes += 1
                if not node.epochs or node.epochs[-1] != update.epoch:
                    node.epochs.append(update.epoch)
            node.heard = time.monotonic()
            if node.picture.known and not node.up:
                node.up, node.why, node.answered = True, "", True
                changed = True
            if changed:
                self._touched(node)  # a heartbeat changes nothing to rank

    def _touched(self, node: _Node) -> None:
        """`node` changed (under the lock): each kept ranking estimates it
        again, and whoever waits on the view looks again."""
        for ranked in self._ranked.values():
            ranked.dirty.add(node.endpoint)
        self._changed.notify_all()

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Waits, at most `timeout_s`, until `predicate()` holds (looked at
        again after every update a stream brings); whether it held."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout_s)

    def node(self, endpoint: str) -> NodeState:
        """What the view holds of one node now."""
        with self._lock:
            n = self._nodes[endpoint]
            p = n.picture
            now = time.monotonic()
            holds = {i: until - now for i, until in p.holds.items() if until > now}
            return NodeState(endpoint, p.name, n.up, n.why, p.epoch, tuple(n.epochs), n.wholes, p.revision,
                             dict(p.pools), dict(p.instances), holds,
                             now - n.heard if n.heard else float("inf"))

    def nodes(self) -> Dict[str, NodeState]:
        """Every node as `node` says."""
        return {e: self.node(e) for e in self._nodes}

    # --- deciding -----------------------------------------------------------

    def place(self, workload: str, policy=None) -> ViewRanking:
        """Where `workload` should go: the pictures ranked as `fleet.rank`
        ranks answers, confirmed by `Place` on the best nodes (at most
        `confirm` calls). Nodes whose stream is down are `Unreachable` in
        `answers` and left out."""
        pol = _client._policy(policy)
        with self._lock:
            ranked = self._rank(workload, pol, time.monotonic())
            candidates = list(ranked.order)
            answers = dict(ranked.answers)
            estimates = dict(ranked.estimates)
        asked, proven = self._confirm(workload, pol, candidates, answers)
        # The candidates in order, those asked by their answers' keys.
        keys = {}
        for endpoint in asked:
            a = answers[endpoint]
            admitted = isinstance(a, pb.Placement) and a.admitted
            keys[endpoint] = rank_key(self.names[endpoint], a) if admitted else None
        if all(keys[e] == estimates[e].key for e in asked):
            choices = [e for _, _, e in candidates]
        else:
            keyed = [(keys[e] if e in keys else key, e) for key, _, e in candidates]
            choices = [e for _, e in sorted(k for k in keyed if k[0] is not None)]
        self._warm(choices[:self.confirm + 1])
        return ViewRanking(workload, choices, answers, self.names, asked=asked, proven=proven,
                           estimates=estimates)

    def _warm(self, endpoints: List[str]) -> None:
        """The nodes a next decision would ask first get their channels
        now, so that its calls find them connected."""
        for endpoint in endpoints:
            self._nodes[endpoint].stub(self.tls)

    def _rank(self, workload: str, policy: int, now: float) -> _Ranked:
        """The kept ranking of `workload` under `policy`, its changed nodes
        estimated again (under the lock)."""
        ranked = self._ranked.get((workload, policy))
        if ranked is None or now >= ranked.until:
            ranked = self._ranked[(workload, policy)] = _Ranked(self._nodes)
        for endpoint in ranked.dirty:
            n = self._nodes[endpoint]
            old = ranked.entry.pop(endpoint, None)
            if old is not None:
                del ranked.order[bisect.bisect_left(ranked.order, old)]
            if not n.up:
                ranked.answers[endpoint] = Unreachable(grpc.StatusCode.UNAVAILABLE, n.why)
                ranked.estimates.pop(endpoint, None)
                continue
            e = n.picture.estimate(workload, policy, now)
            ranked.estimates[endpoint] = e
            ranked.answers[endpoint] = _answer(e, n.picture)
            ranked.until = min(ranked.until, e.until)
            if e.admits is not False:
                entry = (e.key, e.exact, endpoint)
                bisect.insort(ranked.order, entry)
                ranked.entry[endpoint] = entry
        ranked.dirty.clear()
        return ranked

    def _confirm(self, workload: str, policy: int, candidates, answers) -> Tuple[List[str], bool]:
        req = pb.PlaceRequest(workload=workload, on_full=policy)
        asked, proven, got = confirm(candidates, lambda batch: self._ask(batch, req), self.confirm,
                                     self.names)
        answers.update(got)
        return asked, proven

    def _ask(self, endpoints: List[str], req: pb.PlaceRequest) -> List[object]:
        """`Place` of each endpoint, together; each answer also refreshes
        that node's figures (unless its stream brought newer ones)."""
        calls = []
        for e in endpoints:
            n = self._nodes[e]
            seen = self._seen(n)
            calls.append((n, seen, n.stub(self.tls).Place.future(req, timeout=self.deadline_s)))
        out = []
        for n, seen, call in calls:
            try:
                answer = call.result()
            except grpc.RpcError as e:
                out.append(_error(e))
                continue
            self._truth(n, seen, answer.pools)
            out.append(answer)
        return out

    def _seen(self, n: _Node) -> Tuple[int, frozenset]:
        """Before a call: the figures received so far, and the starts of
        this view that the agent will have counted when it answers."""
        with self._lock:
            return n.picture.figures_seen, frozenset(n.picture.pending)

    def _truth(self, n: _Node, seen: Tuple[int, frozenset], pools) -> None:
        """Figures an agent answered a call with: taken into its picture
        (they count this view's starts made before the call), unless its
        stream brought figures since the call began."""
        with self._changed:
            if n.picture.figures_seen == seen[0] and pools:
                n.picture.figures(pools, time.monotonic(), counted=seen[1])
                self._touched(n)

    def start(self, workload: str, instance_id: Optional[str] = None, *, lease_ms: int = 0,
              policy=None, wait_ready: bool = True, start_timeout_s: float = 600.0,
              ranking: Optional[Ranking] = None) -> Started:
        """Starts `workload` on the best node of `place` (or of `ranking`),
        down the ranking when a start is refused (another scheduler was
        first, `max_instances`) or the node is gone; each refusal's figures
        go into that node's picture. Raises `FleetRefused` when no node
        took it."""
        if ranking is None:
            ranking = self.place(workload, policy=policy)
        attempts: Dict[str, AgentError] = {}
        req = pb.StartRequest(workload=workload, instance_id=instance_id or "",
                              on_full=_client._policy(policy), wait_ready=wait_ready,
                              lease_ms=lease_ms)
        for endpoint in ranking.choices:
            n = self._nodes.get(endpoint)
            if n is None:
                continue
            seen = self._seen(n)
            try:
                response = n.stub(self.tls).Start(req, timeout=start_timeout_s)
            except grpc.RpcError as e:
                error = _client._decode(e)
                attempts[endpoint] = error
                if isinstance(error, Refused):
                    self._truth(n, seen, error.placement.pools)
                    continue
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    continue  # the node is at max_instances
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    continue  # admitted, then failed on that node (as fleet.start)
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    if instance_id:
                        self._stop_quietly(n, instance_id)
                    continue
                raise error from None
            with self._changed:
                n.picture.started(response.instance)
                self._touched(n)
            return Started(endpoint, response, ranking, attempts)
        raise FleetRefused(ranking, attempts)

    def _stop_quietly(self, n: _Node, instance_id: str) -> None:
        try:
            n.stub(self.tls).Stop(pb.StopRequest(instance_id=instance_id), timeout=self.deadline_s)
        except grpc.RpcError:
            pass  # gone with its node, or never admitted


def confirm(candidates: List[Tuple[tuple, bool, str]], ask: Callable[[List[str]], List[object]],
            limit: int, names: Dict[str, str]) -> Tuple[List[str], bool, Dict[str, object]]:
    """Asks `Place` (through `ask`, a batch at a time) of `candidates`
    (key or lower bound, whether exact, endpoint; sorted) in order until
    no candidate left could rank above the best answer, or `limit` were
    asked. Each batch runs to the next candidate whose estimate is exact:
    if the picture holds, none after it can beat its answer. Returns the
    endpoints asked, whether the first choice is proven (no unasked
    candidate could beat it) and the answers."""
    asked: List[str] = []
    got: Dict[str, object] = {}
    best = None
    i = 0
    while i < len(candidates):
        if best is not None and best <= candidates[i][0]:
            return asked, True, got
        room = limit - len(asked)
        if room <= 0:
            return asked, False, got
        batch = []
        while i < len(candidates) and len(batch) < room:
            _, exact, endpoint = candidates[i]
            batch.append(endpoint)
            i += 1
            if exact:
                break
        for endpoint, answer in zip(batch, ask(batch)):
            asked.append(endpoint)
            got[endpoint] = answer
            if isinstance(answer, pb.Placement) and answer.admitted:
                k = rank_key(names[endpoint], answer)
                best = k if best is None else min(best, k)
    return asked, True, got


def _error(e: grpc.RpcError) -> AgentError:
    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unreachable(e.code(), e.details() or "")
    return _client._decode(e)


def _answer(e: Estimate, picture: Picture):
    """A picture's estimate as the answer of a node not asked: an
    `AgentError` where the agent would answer one, else a `Placement`
    (admitted, refusals, pools, free_after_bytes where known). Made once
    per estimate."""
    made = getattr(e, "_answer", None)
    if made is not None:
        return made
    if e.error is not None:
        code, message = e.error
        made = AgentError(grpc.StatusCode[code], message)
    else:
        made = pb.Placement(admitted=e.admits is not False, pools=list(picture.pools.values()))
        if e.admits is False:
            made.refusals.add(message=e.why)
        if e.free_after is not None:
            made.free_after_bytes = e.free_after
    e._answer = made
    return made
