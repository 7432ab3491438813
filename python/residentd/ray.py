"""residentd as the memory authority under Ray.

Each Ray node runs its own residentd and carries its agent's endpoint as
the node label `residentd.io/agent`, set when the node starts. Ray label
values allow only letters, digits, `-`, `_` and `.` (63 at most), so the
endpoint is written base32-encoded; this module prints the flag:

    ray start ... --labels "$(python -m residentd.ray labels /run/residentd/residentd.sock)"

`place_model(workload)` ranks the alive nodes that carry the label with
`residentd.fleet` (each agent's `Place`: would it fit, and whom would it
evict?) and creates a `ResidentModel` actor pinned to the best node. The
actor's constructor starts the model on its node's agent, waits for READY
and holds an owner's lease that it renews; a refusal raises, so the next
node in the ranking is tried. `endpoint()` is the model server's address.
When the actor ends, it stops the model; when it dies (`ray.kill`, a lost
node), the lease runs out and the agent stops the model itself.

`view()` is the cluster's one `residentd.fleet.View` (a named actor,
`ResidentView`, holding one stream per labelled node's agent):
`place_model(workload, view=view())` ranks from its pictures and asks
`Place` of the best few nodes only, instead of every node.
"""

from __future__ import annotations

import atexit
import base64
import sys
import threading
import urllib.error
import urllib.request
import uuid
from typing import Dict, Optional

import grpc
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import fleet
from ._client import Agent, AgentError, Refused, Tls

#: The node label that carries a node's agent endpoint.
LABEL = "residentd.io/agent"


def label_value(endpoint: str) -> str:
    """`endpoint` as a Ray label value (lowercase base32, no padding)."""
    value = base64.b32encode(endpoint.encode()).decode().rstrip("=").lower()
    if len(value) > 63:
        raise ValueError(f"{endpoint!r} is too long for a Ray label (39 bytes at most once encoded);"
                         " use a shorter socket path or HOST:PORT")
    return value


def endpoint_of(value: str) -> str:
    """The endpoint a `label_value` stands for."""
    padded = value.upper() + "=" * (-len(value) % 8)
    return base64.b32decode(padded).decode()


def labels(endpoint: str) -> str:
    """The `ray start --labels` argument for a node whose agent is `endpoint`."""
    return f"{LABEL}={label_value(endpoint)}"


def agents() -> Dict[str, str]:
    """Alive Ray nodes that carry an agent: node id to agent endpoint."""
    out = {}
    for node in ray.nodes():
        value = (node.get("Labels") or {}).get(LABEL)
        if node.get("Alive") and value:
            out[node["NodeID"]] = endpoint_of(value)
    return out


@ray.remote(num_cpus=0, max_restarts=0)
class ResidentModel:
    """A model resident on this actor's node, for as long as the actor
    lives. Creating it starts the model (READY, under an owner's lease the
    actor renews). A start the agent refuses leaves the actor without a
    model: `ready()` then returns the `AgentError` (a `Refused` for a
    refusal), and `place_model` ends the actor and tries the next node."""

    def __init__(self, endpoint: str, workload: str, instance_id: str, lease_ms: int,
                 policy=None, start_timeout_s: float = 600.0, tls: Optional[Tls] = None):
        if lease_ms <= 0:
            raise ValueError("a ResidentModel needs a lease (lease_ms > 0): it bounds how long "
                             "a model outlives an actor that died")
        self._agent = Agent(endpoint, tls=tls)
        self._id = instance_id
        self._lease_ms = lease_ms
        self._done = threading.Event()
        self._error: Optional[AgentError] = None
        self._instance = None
        try:
            started = self._agent.start(workload, instance_id, on_full=policy, wait_ready=True,
                                        lease_ms=lease_ms, timeout=start_timeout_s)
        except AgentError as e:
            # Returned by ready(), not raised here: Ray hands a failed
            # constructor's exception to the caller only as text.
            self._error = e
            self._done.set()
            return
        self._instance = started.instance
        self._renewer = threading.Thread(target=self._renew, daemon=True)
        self._renewer.start()
        atexit.register(self.stop)

    def _renew(self) -> None:
        # A third of the lease, so two renewals may fail before it lapses.
        while not self._done.wait(self._lease_ms / 3000.0):
            try:
                self._agent.touch(self._id, timeout=self._lease_ms / 3000.0)
            except AgentError:
                pass  # the next renewal tries again; the lease bounds the loss

    def ready(self) -> Optional[AgentError]:
        """None once the model is READY; the agent's error when its start
        failed (the actor then holds no model)."""
        return self._error

    def node(self) -> str:
        """The Ray node id this actor (and its model) runs on."""
        return ray.get_runtime_context().get_node_id()

    def endpoint(self) -> str:
        """The model server's address on this node."""
        return f"http://127.0.0.1:{self._instance.port}"

    def post(self, path: str, body: bytes, content_type: str = "application/json",
             timeout_s: float = 600.0):
        """POSTs `body` to the model's server at `path`, on this node (the
        server listens on loopback); returns (status, response body). Each
        call counts as a use of the model."""
        self._agent.touch(self._id)
        req = urllib.request.Request(self.endpoint() + path, data=body, method="POST",
                                     headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def instance(self):
        """The agent's current view of the instance."""
        return self._agent.get(self._id)

    def stop(self) -> None:
        """Stops the model (also when the actor exits normally)."""
        if self._done.is_set():
            return
        self._done.set()
        try:
            self._agent.stop(self._id, timeout=60.0)
        except AgentError:
            pass  # already gone, or the agent is down: the lease ends it


#: The name (in namespace `residentd`) of the cluster's `ResidentView`.
VIEW = "residentd-view"


@ray.remote(num_cpus=0, max_restarts=-1)
class ResidentView:
    """The cluster's fleet view: one `residentd.fleet.View` over the agents
    of the alive labelled nodes (`agents()`, keyed by node id), made again
    when that set changes. `place` answers its `ViewRanking`."""

    def __init__(self, tls: Optional[Tls] = None, confirm: int = 3):
        self._tls = tls
        self._confirm = confirm
        self._nodes: Dict[str, str] = {}
        self._view: Optional[fleet.View] = None

    def _current(self) -> "fleet.View":
        nodes = agents()
        if self._view is None or nodes != self._nodes:
            if self._view is not None:
                self._view.close()
            self._view = fleet.View(dict(nodes), tls=self._tls, confirm=self._confirm)
            self._nodes = nodes
        return self._view

    def place(self, workload: str, policy=None) -> "fleet.ViewRanking":
        return self._current().place(workload, policy=policy)

    def nodes(self) -> Dict[str, "fleet.NodeState"]:
        """Each agent's endpoint to what the view holds of its node."""
        return self._current().nodes()


def view(tls: Optional[Tls] = None, confirm: int = 3):
    """The cluster's `ResidentView` actor (made by the first caller, found
    by the others; it outlives them). `tls` and `confirm` are the first
    caller's."""
    return ResidentView.options(name=VIEW, namespace="residentd", get_if_exists=True,
                                lifetime="detached").remote(tls, confirm)


def place_model(workload: str, *, instance_id: Optional[str] = None, lease_ms: int = 30_000,
                policy=None, deadline_s: float = 2.0, name: Optional[str] = None,
                ranking: Optional[fleet.Ranking] = None, tls: Optional[Tls] = None, view=None):
    """A `ResidentModel` actor for `workload` on the Ray node where it fits
    best, trying the next node of the ranking when a start is refused;
    raises `residentd.fleet.FleetRefused` (every node's answer, every
    refused start) when no node takes it. With `ranking` (from
    `residentd.fleet.place` over `agents()`, keyed by node id), follows it
    instead of asking again; with `view` (`view()`, or a
    `residentd.fleet.View` keyed by node id), ranks from its pictures
    instead of asking every agent. `tls` (a `residentd.Tls`) reaches agents
    whose label is `HOST:PORT` over mutual TLS; the actor gets it too."""
    nodes = agents()
    by_endpoint = {endpoint: node_id for node_id, endpoint in nodes.items()}
    if len(by_endpoint) != len(nodes):
        raise ValueError("two Ray nodes carry the same residentd.io/agent label")
    if ranking is None and view is not None:
        if isinstance(view, fleet.View):
            ranking = view.place(workload, policy=policy)
        else:
            ranking = ray.get(view.place.remote(workload, policy))
    if ranking is None:
        ranking = fleet.place(dict(nodes), workload, policy=policy, deadline_s=deadline_s, tls=tls)
    attempts: Dict[str, AgentError] = {}
    instance_id = instance_id or f"{workload}-{uuid.uuid4().hex[:12]}"
    for endpoint in ranking.choices:
        if endpoint not in by_endpoint:
            continue  # its node left the cluster since the ranking
        strategy = NodeAffinitySchedulingStrategy(node_id=by_endpoint[endpoint], soft=False)
        options = {"scheduling_strategy": strategy}
        if name is not None:
            options["name"] = name
        actor = ResidentModel.options(**options).remote(endpoint, workload, instance_id, lease_ms, policy,
                                                        tls=tls)
        error = ray.get(actor.ready.remote())
        if error is None:
            return actor
        ray.kill(actor)
        attempts[endpoint] = error
        if not isinstance(error, Refused) and error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise error
    raise fleet.FleetRefused(ranking, attempts)


def _main(argv) -> int:
    if len(argv) == 2 and argv[0] == "labels":
        print(labels(argv[1]))
        return 0
    print("usage: python -m residentd.ray labels ENDPOINT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
