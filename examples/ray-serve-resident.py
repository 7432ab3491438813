"""A Ray Serve deployment whose replicas are resident models.

Each replica asks residentd (through residentd.ray.place_model) for a node
where the model fits, gets a ResidentModel actor pinned there (the model
started, READY, under a lease the actor renews), and forwards every
request to the model's own server through that actor, on the model's node.
The ranking comes from the cluster's fleet view (residentd.ray.view(): one
stream per node's agent, kept by one actor for every replica), which asks
Place of the best few nodes only.

- Scaling up: each new replica is placed the same way; a node that refuses
  the start (another scheduler took the memory, or it is at max_instances)
  is passed over for the next one of the ranking.
- Scaling down, or deleting the app: Serve calls the replica's __del__,
  which stops the model at once. A replica that dies without it (killed,
  its node lost) takes its actor along, and the lease ends the model.
- A node's agent dying leaves its model running, unsupervised, until the
  agent is back (instances outlive the agent by default): the replica's
  health check fails while the agent does not answer, Serve replaces the
  replica, and the new one is placed on a node whose agent answers.

Run on a Ray cluster whose nodes each run residentd and carry their
agent's label (docs/fleet.md), from the repository root:

    pip install "./python[ray]" "ray[serve]"
    serve run --address HEAD:6379 --app-dir examples ray-serve-resident:app

then POST OpenAI-style requests to http://127.0.0.1:8000/v1/chat/completions.
The workload "chat" is one of the agents' workloads (see
examples/router-llama.toml for llama.cpp servers).
"""

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from residentd import pb
from residentd import ray as resident_ray


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0}, health_check_period_s=5)
class ResidentChat:
    def __init__(self, workload: str = "chat", lease_ms: int = 30_000):
        # Raises residentd.fleet.FleetRefused, with every node's reason,
        # when no node can take the model: Serve reports the replica failed.
        self.model = resident_ray.place_model(workload, lease_ms=lease_ms, view=resident_ray.view())

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        status, answer = await self.model.post.remote(request.url.path, body)
        return Response(answer, status_code=status, media_type="application/json")

    async def check_health(self):
        # Raises when the agent is gone or the model is no longer READY:
        # Serve then replaces this replica, and the new one is placed anew.
        instance = await self.model.instance.remote()
        if instance.state != pb.READY:
            raise RuntimeError(f"{instance.instance_id} is {pb.State.Name(instance.state)}")

    def __del__(self):
        try:
            ray.get(self.model.stop.remote())
        except Exception:  # the actor is gone already: its lease ends the model
            pass


app = ResidentChat.bind()
