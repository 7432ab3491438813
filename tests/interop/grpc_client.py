"""A client residentd did not write: Python grpcio from PyPI, with its
default options (grpc-core sends the socket path as :authority) and no
copy of our proto file. It finds the service through server reflection,
builds its messages from the descriptors the server sends, checks health,
follows Watch, decodes a refused Start's rich error details, and sends
oversized input.

Usage: grpc_client.py SOCKET
Exits non-zero on the first failed check; prints one line per check.
"""

import sys

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

SERVICE = "resident.v1.NodeAgent"


def check(cond, what):
    if not cond:
        print(f"FAIL {what}")
        sys.exit(1)
    print(f"ok   {what}")


def reflect(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    listed = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = [s.name for s in listed.list_services_response.service]
    check(SERVICE in names, f"reflection lists {SERVICE} (among {names})")
    found = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)])))
    pool = descriptor_pool.DescriptorPool()
    for raw in found.file_descriptor_response.file_descriptor_proto:
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
    return pool


def main(socket):
    channel = grpc.insecure_channel(f"unix://{socket}")
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        check(reply.status == health_pb2.HealthCheckResponse.SERVING, f"health of {name!r} is SERVING")

    pool = reflect(channel)
    msg = lambda name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"resident.v1.{name}"))
    StartRequest, StartResponse, Placement = msg("StartRequest"), msg("StartResponse"), msg("Placement")
    WatchRequest, Event = msg("WatchRequest"), msg("Event")
    watch = channel.unary_stream(
        f"/{SERVICE}/Watch",
        request_serializer=WatchRequest.SerializeToString,
        response_deserializer=Event.FromString,
    )
    events = watch(WatchRequest(since_revision=0), timeout=30)
    start = channel.unary_unary(
        f"/{SERVICE}/Start",
        request_serializer=StartRequest.SerializeToString,
        response_deserializer=StartResponse.FromString,
    )

    first = start(StartRequest(workload="coder-daily", instance_id="py-a"), timeout=30)
    check(first.created and first.instance.instance_id == "py-a", "Start admits coder-daily")
    start(StartRequest(workload="coder-small", instance_id="py-b"), timeout=30)
    try:
        start(StartRequest(workload="planner", instance_id="py-c"), timeout=30)
        check(False, "the third Start is refused")
    except grpc.RpcError as err:
        check(err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"refused with RESOURCE_EXHAUSTED ({err.code()})")
        check("'planner' needs 55.0 GB but only 32.0 GB of the 96.0 GB" in err.details(), "the message is the refusal text")
        status = rpc_status.from_call(err)
        check(status is not None, "google.rpc.Status is in the trailers")
        info, placement = None, None
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
            elif detail.type_url.endswith("/resident.v1.Placement"):
                placement = Placement.FromString(detail.value)
        check(info is not None and info.reason == "OVER_BUDGET" and info.domain == "resident.v1", "ErrorInfo OVER_BUDGET")
        check(info.metadata["need_bytes"] == "55000000000", "ErrorInfo carries the byte figures")
        check(placement is not None and not placement.admitted, "the Placement decodes")
        holders = [(h.instance_id, h.bytes) for h in placement.refusals[0].over_budget.holders]
        check(holders == [("py-a", 55_000_000_000), ("py-b", 9_000_000_000)], f"the holders are named: {holders}")

    seen = set()
    for event in events:
        if event.HasField("instance"):
            seen.add(event.instance.instance_id)
        if {"py-a", "py-b"} <= seen:
            break
    events.cancel()
    check({"py-a", "py-b"} <= seen, f"Watch streams the starts ({sorted(seen)})")

    # Oversized input is refused by the agent, not by the client's own
    # metadata limit: INVALID_ARGUMENT with a short message.
    try:
        start(StartRequest(workload="w" * (1 << 20), instance_id="i" * 10_000), timeout=30)
        check(False, "the oversized Start is refused")
    except grpc.RpcError as err:
        check(err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"oversized input: INVALID_ARGUMENT ({err.code()})")
        check(len(err.details()) < 400, f"a short message ({len(err.details())} chars): {err.details()}")
        status = rpc_status.from_call(err)
        violations = []
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                violations = [(v.field, v.description) for v in bad.field_violations]
        check(sorted(f for f, _ in violations) == ["instance_id", "workload"], f"both fields named: {violations}")
        check(all(len(d) < 200 for _, d in violations), "each violation is short")
        check("(10000 bytes)" in err.details(), "the id's length is said")
    print("interop ok")


if __name__ == "__main__":
    main(sys.argv[1])
