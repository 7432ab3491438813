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

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import fleet
from ._client import Agent, AgentError, Refused

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
    actor renews); a refused start fails the creation with `Refused`."""

    def __init__(self, endpoint: str, workload: str, instance_id: str, lease_ms: int,
                 policy=None, start_timeout_s: float = 600.0):
        self._agent = Agent(endpoint, timeout=start_timeout_s)
        self._id = instance_id
        self._lease_ms = lease_ms
        started = self._agent.start(workload, instance_id, on_full=policy, wait_ready=True,
                                    lease_ms=lease_ms)
        self._instance = started.instance
        self._done = threading.Event()
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

    def ready(self) -> str:
        """The instance id, once the model is READY (always, once created)."""
        return self._id

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
            self._agent.stop(self._id)
        except AgentError:
            pass  # already gone, or the agent is down: the lease ends it


def place_model(workload: str, *, instance_id: Optional[str] = None, lease_ms: int = 30_000,
                policy=None, deadline_s: float = 2.0, name: Optional[str] = None):
    """A `ResidentModel` actor for `workload` on the Ray node where it fits
    best; raises `residentd.fleet.FleetRefused` (every node's answer) when
    no node takes it."""
    nodes = agents()
    by_endpoint = {endpoint: node_id for node_id, endpoint in nodes.items()}
    if len(by_endpoint) != len(nodes):
        raise ValueError("two Ray nodes carry the same residentd.io/agent label")
    ranking = fleet.place({node_id: endpoint for node_id, endpoint in nodes.items()}, workload,
                          policy=policy, deadline_s=deadline_s)
    attempts: Dict[str, AgentError] = {}
    instance_id = instance_id or f"{workload}-{uuid.uuid4().hex[:12]}"
    for endpoint in ranking.choices:
        strategy = NodeAffinitySchedulingStrategy(node_id=by_endpoint[endpoint], soft=False)
        options = {"scheduling_strategy": strategy}
        if name is not None:
            options["name"] = name
        actor = ResidentModel.options(**options).remote(endpoint, workload, instance_id, lease_ms, policy)
        try:
            ray.get(actor.ready.remote())
            return actor
        except ray.exceptions.RayActorError as e:
            cause = e.__cause__ if isinstance(e.__cause__, AgentError) else _cause(e)
            if cause is None:
                raise
            attempts[endpoint] = cause
            if not isinstance(cause, Refused):
                raise cause from e
    raise fleet.FleetRefused(ranking, attempts)


def _cause(e: Exception) -> Optional[AgentError]:
    """The AgentError a failed actor creation carried, if any."""
    seen = e
    while seen is not None:
        if isinstance(seen, AgentError):
            return seen
        inner = getattr(seen, "cause", None) or getattr(seen, "error", None) or seen.__cause__
        seen = inner if inner is not seen else None
    return None


def _main(argv) -> int:
    if len(argv) == 2 and argv[0] == "labels":
        print(labels(argv[1]))
        return 0
    print("usage: python -m residentd.ray labels ENDPOINT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
