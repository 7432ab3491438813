"""Python client of the residentd node agent.

    import residentd
    with residentd.Agent("/run/residentd/residentd.sock") as agent:
        try:
            agent.start("coder", "c1", wait_ready=True)
        except residentd.Refused as e:
            for r in e.reasons:
                print(r.code, r.pool, r.need_bytes, r.free_bytes, r.holders)

Over TCP with mutual TLS: `residentd.Agent("node-7:7443",
tls=residentd.Tls(ca="ca.pem", cert="me.pem", key="me.key"))`.
`residentd.fleet` places a workload across many agents (`tls=` too); `residentd.pb`
holds the generated messages (`residentd.pb.Instance`, ...).
"""

from ._client import Agent, AgentError, Holder, Reason, Refused, Tls, Unreachable
from ._proto import node_agent_pb2 as pb

__all__ = ["Agent", "AgentError", "Holder", "Reason", "Refused", "Tls", "Unreachable", "pb"]
