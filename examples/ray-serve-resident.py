"""A Ray Serve deployment whose replicas are resident models.

Each replica asks residentd (through residentd.ray.place_model) for a node
where the model fits, gets a ResidentModel actor pinned there (the model
started, READY, under a lease the actor renews), and forwards every
request to the model's own server through that actor, on the model's node.
A replica that goes away ends its actor, and the model is stopped.

Run on a Ray cluster whose nodes each run residentd and carry their
agent's label (docs/fleet.md):

    pip install "./python[ray]" "ray[serve]"
    serve run examples/ray-serve-resident:app   # from the repository root

then POST OpenAI-style requests to http://127.0.0.1:8000/v1/chat/completions.
The workload "chat" is one of the agents' workloads (see
examples/router-llama.toml for llama.cpp servers).
"""

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from residentd import ray as resident_ray

WORKLOAD = "chat"


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0})
class ResidentChat:
    def __init__(self):
        # Raises residentd.fleet.FleetRefused, with every node's reason,
        # when no node can take the model: Serve reports the replica failed.
        self.model = resident_ray.place_model(WORKLOAD, lease_ms=30_000)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        status, answer = await self.model.post.remote(request.url.path, body)
        return Response(answer, status_code=status, media_type="application/json")

    def __del__(self):
        try:
            ray.get(self.model.stop.remote())
        except Exception:  # the actor is gone already: its lease ends the model
            pass


app = ResidentChat.bind()
