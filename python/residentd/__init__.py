"""Python client of the residentd node agent.

    import residentd
    with residentd.Agent("/run/residentd/residentd.sock") as agent:
        try:
            agent.start("coder", "c1", wait_ready=True)
        except residentd.Refused as e:
            for r in e.reasons:
                print(r.code, r.pool, r.need_bytes, r.free_bytes, r.holders)

`residentd.fleet` places a workload across many agents; `residentd.pb`
holds the generated messages (`residentd.pb.Instance`, ...).
"""

from ._client import Agent, AgentError, Holder, Reason, Refused
from ._proto import node_agent_pb2 as pb

__all__ = ["Agent", "AgentError", "Holder", "Reason", "Refused", "pb"]
