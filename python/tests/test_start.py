"""fleet.start down the ranking, against stand-in agents on Unix sockets
(grpc.aio servers of the NodeAgent service): a node where the start was
admitted and then failed (FAILED_PRECONDITION without a placement: its
program could not be spawned, or it never became ready) is recorded and
the next node is tried; an error that says nothing about the node (an
invalid request) still ends the start at once."""

import asyncio
import os
import tempfile
import unittest

import grpc

from residentd import _client, fleet, pb
from residentd._proto import node_agent_pb2_grpc as pb_grpc


class StandIn(pb_grpc.NodeAgentServicer):
    """Answers Start with `fail` (a status code and words) or starts."""

    def __init__(self, name, fail=None):
        self.name, self.fail, self.starts = name, fail, 0

    async def Start(self, request, context):
        self.starts += 1
        if self.fail:
            await context.abort(*self.fail)
        return pb.StartResponse(instance=pb.Instance(instance_id=request.instance_id or "i",
                                                     workload=request.workload, state=pb.READY))


async def serve(servicer, path):
    server = grpc.aio.server()
    pb_grpc.add_NodeAgentServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    return server


class StartTest(unittest.TestCase):
    def run_start(self, first_fails):
        async def go():
            with tempfile.TemporaryDirectory() as d:
                a = StandIn("a", fail=first_fails)
                b = StandIn("b")
                servers = [await serve(a, os.path.join(d, "a.sock")), await serve(b, os.path.join(d, "b.sock"))]
                endpoints = {"a": os.path.join(d, "a.sock"), "b": os.path.join(d, "b.sock")}
                try:
                    f = fleet.Fleet(endpoints, deadline_s=5.0)
                    ranking = fleet.Ranking("m", [endpoints["a"], endpoints["b"]], {}, {})
                    try:
                        return await f.start("m", "m-1", ranking=ranking), a, b
                    finally:
                        await f.close()
                finally:
                    for s in servers:
                        await s.stop(None)
        return asyncio.run(go())

    def test_a_start_that_failed_on_a_node_goes_on_to_the_next(self):
        failed = (grpc.StatusCode.FAILED_PRECONDITION, "'m-1' did not become ready: its program could not be spawned")
        started, a, b = self.run_start(failed)
        self.assertTrue(started.endpoint.endswith("b.sock"), started.endpoint)
        self.assertEqual((a.starts, b.starts), (1, 1))
        [(where, error)] = started.attempts.items()
        self.assertTrue(where.endswith("a.sock"))
        self.assertIn("could not be spawned", str(error))

    def test_an_invalid_request_ends_the_start_at_once(self):
        with self.assertRaises(_client.AgentError) as e:
            self.run_start((grpc.StatusCode.INVALID_ARGUMENT, "instance_id: too long"))
        self.assertIn("too long", str(e.exception))


if __name__ == "__main__":
    unittest.main()
