"""Placement across a fleet of residentd agents.

`View` keeps a picture of every agent from one stream each and ranks from
it, asking `Place` of the best few only (`_view.py`): for callers that
place often, or across many agents. `place` asks every agent's `Place` at
once (asyncio gRPC, one deadline per call) and ranks the answers; `start` starts on the best choice and falls
back down the ranking when that start is refused because another scheduler
got there first. An agent that is down or slow is skipped and reported in
the answers, never waited for past the deadline.

The ranking, best first, among the agents that would admit the workload:

1. those that fit it without evicting anything;
2. then fewest evicted bytes;
3. then the lowest-priority victims (the highest priority among them);
4. then the most memory left free after the start;
5. ties by node name (the endpoint, unless names are given), so the same
   answers always give the same choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from . import _client
from ._client import AgentError, Refused, Tls, Unreachable
from ._proto import node_agent_pb2 as pb
from ._proto import node_agent_pb2_grpc as pb_grpc

Endpoints = Union[Sequence[str], Mapping[str, str]]
Answer = Union[pb.Placement, AgentError]


@dataclasses.dataclass
class Ranking:
    """A fleet's answers for one workload.

    `choices`: the endpoints that would admit it, best first. `answers`:
    every endpoint's `Placement`, or the `AgentError` it answered (an
    `Unreachable` when it did not answer in time). `names`: endpoint to
    node name.
    """

    workload: str
    choices: List[str]
    answers: Dict[str, Answer]
    names: Dict[str, str]

    def why_not(self) -> Dict[str, str]:
        """Each endpoint that would not admit it, and why, in words."""
        out = {}
        for endpoint, answer in self.answers.items():
            if isinstance(answer, AgentError):
                out[endpoint] = str(answer)
            elif not answer.admitted:
                out[endpoint] = "; ".join(r.message for r in answer.refusals) or "refused"
        return out


class FleetRefused(Exception):
    """No agent of the fleet placed the workload. `.ranking` holds every
    node's answer; `.attempts` the starts tried, endpoint to error. Its
    text names each node and, where it was given a name, the endpoint that
    `.ranking.answers`, `.ranking.why_not()` and `.attempts` are keyed by:
    `n3 (unix:///run/n3.sock): unplaceable: ...`."""

    def __init__(self, ranking: Ranking, attempts: Dict[str, AgentError]):
        self.ranking = ranking
        self.attempts = attempts

        def node(e: str) -> str:
            name = ranking.names.get(e, e)
            return e if name == e else f"{name} ({e})"

        lines = [f"{node(e)}: {why}" for e, why in sorted(ranking.why_not().items())]
        lines += [f"{node(e)}: start refused: {err}" for e, err in attempts.items()]
        super().__init__(f"no node placed '{ranking.workload}':\n  " + "\n  ".join(lines))


@dataclasses.dataclass
class Started:
    """Where a fleet start landed: the endpoint, the agent's answer, the
    ranking it followed and the starts refused before it."""

    endpoint: str
    response: pb.StartResponse
    ranking: Ranking
    attempts: Dict[str, AgentError]


def _names(endpoints: Endpoints) -> Dict[str, str]:
    if isinstance(endpoints, Mapping):
        return {endpoint: name for name, endpoint in endpoints.items()}
    return {e: e for e in endpoints}


def rank_key(name: str, placement: pb.Placement) -> Tuple:
    """The sort key of an admitting answer (smaller is better)."""
    evicts = bool(placement.evict) or bool(placement.wait_for)
    evicted = sum(v.bytes for v in placement.victims)
    worst_victim = max((v.priority for v in placement.victims), default=float("-inf"))
    if placement.HasField("free_after_bytes"):
        left = -placement.free_after_bytes
    else:
        left = float("-inf")  # unbounded pools leave the most
    return (evicts, evicted, worst_victim, left, name)


def rank(workload: str, answers: Dict[str, Answer], names: Dict[str, str]) -> Ranking:
    admitting = [(e, a) for e, a in answers.items() if isinstance(a, pb.Placement) and a.admitted]
    admitting.sort(key=lambda ea: rank_key(names.get(ea[0], ea[0]), ea[1]))
    return Ranking(workload, [e for e, _ in admitting], answers, names)


class Fleet:
    """Agents asked together; keeps one channel per agent for reuse.

    Use from asyncio (`await fleet.place(...)`), in one event loop. `tls`
    (a `residentd.Tls`: the agents' CA, this client's certificate and key)
    is used for every `HOST:PORT` endpoint; Unix socket endpoints stay
    plaintext.
    """

    def __init__(self, endpoints: Endpoints, *, deadline_s: float = 2.0, tls: Optional[Tls] = None):
        self.names = _names(endpoints)
        self.deadline_s = deadline_s
        self.tls = tls
        self._channels: Dict[str, grpc.aio.Channel] = {}
        # A stub makes a callable per RPC: made once per agent, not per call.
        self._stubs: Dict[str, pb_grpc.NodeAgentStub] = {}

    def _stub(self, endpoint: str) -> pb_grpc.NodeAgentStub:
        stub = self._stubs.get(endpoint)
        if stub is None:
            channel = _client._channel(endpoint, self.tls, aio=True)
            self._channels[endpoint] = channel
            stub = self._stubs[endpoint] = pb_grpc.NodeAgentStub(channel)
        return stub

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, {}, {}
        await asyncio.gather(*(c.close() for c in channels.values()))

    async def __aenter__(self) -> "Fleet":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _place_one(self, endpoint: str, req: pb.PlaceRequest) -> Answer:
        began = time.monotonic()
        try:
            return await self._stub(endpoint).Place(req, timeout=self.deadline_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                # Why, where a look at the endpoint within what is left of
                # the deadline says (off the event loop).
                left = self.deadline_s - (time.monotonic() - began)
                why = None
                if left > 0.05:
                    why = await asyncio.to_thread(_client._why_unreachable, endpoint, self.tls, left)
                return Unreachable(e.code(), why or e.details() or "")
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return Unreachable(e.code(), e.details() or "")
            return AgentError(e.code(), e.details() or "")

    async def place(self, workload: str, *, policy=None) -> Ranking:
        """Every agent's answer for `workload`, ranked."""
        req = pb.PlaceRequest(workload=workload, on_full=_client._policy(policy))
        endpoints = list(self.names)
        answers = await asyncio.gather(*(self._place_one(e, req) for e in endpoints))
        return rank(workload, dict(zip(endpoints, answers)), self.names)

    async def start(self, workload: str, instance_id: Optional[str] = None, *, lease_ms: int = 0,
                    policy=None, wait_ready: bool = True, start_timeout_s: float = 600.0,
                    ranking: Optional[Ranking] = None) -> Started:
        """Starts `workload` on the best node; the next one when refused, or
        when the start failed there (its program could not be spawned, or
        it never became ready: FAILED_PRECONDITION without a placement).
        With `ranking` (from an earlier `place`), follows it instead of
        asking again."""
        if ranking is None:
            ranking = await self.place(workload, policy=policy)
        attempts: Dict[str, AgentError] = {}
        req = pb.StartRequest(workload=workload, instance_id=instance_id or "",
                              on_full=_client._policy(policy), wait_ready=wait_ready, lease_ms=lease_ms)
        for endpoint in ranking.choices:
            try:
                response = await self._stub(endpoint).Start(req, timeout=start_timeout_s)
                return Started(endpoint, response, ranking, attempts)
            except grpc.aio.AioRpcError as e:
                error = _client._decode(e)
                attempts[endpoint] = error
                if isinstance(error, Refused) or e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    continue  # someone got there first, or the node is at max_instances
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # Admitted there, then failed on that node (its program
                    # could not be spawned, or it never became ready): its
                    # memory is given back there, and the next node may run it.
                    continue
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    # The node went away or is slow: the start may still
                    # be under way there; stop it, if it can be named.
                    if instance_id:
                        await self._stop_quietly(endpoint, instance_id)
                    continue
                raise error from None
        raise FleetRefused(ranking, attempts)

    async def _stop_quietly(self, endpoint: str, instance_id: str) -> None:
        try:
            await self._stub(endpoint).Stop(pb.StopRequest(instance_id=instance_id),
                                            timeout=self.deadline_s)
        except grpc.aio.AioRpcError:
            pass  # gone with its node, or never admitted


def _run(coro):
    """Runs `coro` to its end from synchronous code, also where this thread
    already runs an event loop (then in a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: list = []

    def target():
        try:
            result.append((True, asyncio.run(coro)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result.append((False, e))

    t = threading.Thread(target=target)
    t.start()
    t.join()
    ok, value = result[0]
    if ok:
        return value
    raise value


async def _with_fleet(endpoints: Endpoints, deadline_s: float, tls: Optional[Tls], call):
    async with Fleet(endpoints, deadline_s=deadline_s, tls=tls) as fleet:
        return await call(fleet)


def place(endpoints: Endpoints, workload: str, policy=None, deadline_s: float = 2.0,
          tls: Optional[Tls] = None) -> Ranking:
    """Asks every agent of `endpoints` (a list, or names to endpoints) where
    `workload` would go; the ranking, with every agent's answer. `tls`:
    mutual TLS for the `HOST:PORT` endpoints (`residentd.Tls`)."""
    return _run(_with_fleet(endpoints, deadline_s, tls, lambda f: f.place(workload, policy=policy)))


def start(endpoints: Endpoints, workload: str, instance_id: Optional[str] = None, lease_ms: int = 0,
          policy=None, deadline_s: float = 2.0, wait_ready: bool = True,
          tls: Optional[Tls] = None) -> Started:
    """Starts `workload` on the best agent, falling back down the ranking
    when a start is refused; raises `FleetRefused` when none placed it."""
    return _run(_with_fleet(endpoints, deadline_s, tls, lambda f: f.start(
        workload, instance_id, lease_ms=lease_ms, policy=policy, wait_ready=wait_ready)))


# The view ranks with the above; imported last, as it imports this module.
from ._view import NodeState, View, ViewRanking  # noqa: E402,F401
