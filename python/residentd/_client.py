"""The typed client of one agent: a method per RPC, and refusals decoded
into `Refused`."""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator, List, Optional, Sequence, Union

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ._proto import node_agent_pb2 as pb
from ._proto import node_agent_pb2_grpc as pb_grpc

#: The error domain of the agent's ErrorInfo details.
ERROR_DOMAIN = "resident.v1"

#: "The client's default deadline" (None means no deadline).
_DEFAULT = object()

#: Policies by name, for `on_full=`.
POLICIES = {"refuse": pb.REFUSE, "evict": pb.EVICT}


@dataclasses.dataclass(frozen=True)
class Holder:
    """A resident holding memory in a pool."""

    instance_id: str
    role: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Reason:
    """One reason a start was refused.

    `code` is OVER_BUDGET, HOST_MEMORY, EXCLUDED or GROUP_CONFLICT; the
    byte figures are set for the memory reasons, `with_`/`rule`/`group` for
    the co-residency ones.
    """

    code: str
    message: str
    temporary: bool
    pool: str = ""
    need_bytes: int = 0
    free_bytes: int = 0
    budget_bytes: int = 0
    available_bytes: int = 0
    holders: Sequence[Holder] = ()
    role: str = ""
    with_: str = ""
    with_instance_id: str = ""
    group: str = ""
    rule: str = ""

    @classmethod
    def from_pb(cls, r: pb.Refusal) -> "Reason":
        kind = r.WhichOneof("reason")
        base = dict(message=r.message, temporary=r.temporary)
        holders = lambda hs: tuple(Holder(h.instance_id, h.role, h.bytes) for h in hs)  # noqa: E731
        if kind == "over_budget":
            o = r.over_budget
            return cls("OVER_BUDGET", pool=o.pool, need_bytes=o.need_bytes, free_bytes=o.free_bytes,
                       budget_bytes=o.budget_bytes, holders=holders(o.holders), role=o.role, **base)
        if kind == "host_memory":
            h = r.host_memory
            return cls("HOST_MEMORY", pool=h.pool, need_bytes=h.need_bytes,
                       available_bytes=h.available_bytes, holders=holders(h.holders), role=h.role, **base)
        if kind == "excluded":
            e = r.excluded
            return cls("EXCLUDED", role=e.role, with_=getattr(e, "with"), with_instance_id=e.with_instance_id,
                       **base)
        if kind == "group_conflict":
            g = r.group_conflict
            return cls("GROUP_CONFLICT", role=g.role, with_=getattr(g, "with"), with_instance_id=g.with_instance_id,
                       group=g.group, rule=g.rule, **base)
        return cls("UNKNOWN", **base)


class AgentError(Exception):
    """A call the agent did not carry out: the gRPC status code and text."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self):
        # Picklable (Ray carries errors between processes).
        return (type(self), (self.code, self.message))


class Refused(AgentError):
    """The agent refused to place a start.

    `.reasons`: every reason that stands (`Reason`, with the bytes per pool
    and the holders); `.placement`: the agent's `Placement`; `.temporary`:
    only residents under a hold stand in the way, so waiting may help;
    `.reason`: the first reason's code.
    """

    def __init__(self, code, message, reason: str, placement: pb.Placement, temporary: bool):
        super().__init__(code, message)
        self.reason = reason
        self.placement = placement
        self.temporary = temporary
        self.reasons: List[Reason] = [Reason.from_pb(r) for r in placement.refusals]

    def __reduce__(self):
        return (Refused, (self.code, self.message, self.reason, self.placement, self.temporary))


def _decode(e: grpc.RpcError) -> AgentError:
    code, message = e.code(), e.details() or ""
    try:
        status = rpc_status.from_call(e)
    except ValueError:  # details that do not match the status: ignore them
        status = None
    info, placement = None, None
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
        elif detail.type_url.endswith("/resident.v1.Placement"):
            placement = pb.Placement.FromString(detail.value)
    if info is not None and info.domain == ERROR_DOMAIN and placement is not None:
        return Refused(code, message, info.reason, placement, info.metadata.get("temporary") == "true")
    return AgentError(code, message)


def _target(endpoint: str) -> str:
    """A gRPC target: a Unix socket path (optionally `unix:`), or HOST:PORT."""
    if endpoint.startswith(("unix:", "unix-abstract:")):
        return endpoint
    if endpoint.startswith("/") or endpoint.startswith("."):
        return "unix:" + endpoint
    return endpoint


#: PEM text or bytes, or the path of a PEM file.
Pem = Union[bytes, str, "os.PathLike[str]"]


def _pem(what: str, value: Pem) -> bytes:
    """`value` as PEM bytes: given as such, or read from its path."""
    if value is None:
        raise ValueError(f"Tls {what}: missing (an agent over TLS takes only clients with a certificate)")
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"Tls {what}: PEM bytes or a path, not {type(value).__name__}")
    path = os.fspath(value)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"Tls {what} {path}: {e.strerror}") from None


@dataclasses.dataclass(frozen=True)
class Tls:
    """Mutual TLS for the agents reached over TCP (`HOST:PORT`), as the
    agent's `[node.tls]` asks of its clients: `ca`, the CA that signed the
    agents' certificates; `cert` and `key`, this client's certificate
    (signed by the agents' `client_ca`) and its private key. Each is PEM
    (bytes or text) or the path of a PEM file, read at once: a `Tls` holds
    bytes, so it can be pickled to another process (a Ray actor).

    Each agent's certificate is checked against the host of its endpoint;
    `name` checks it against that name instead (as residentctl's
    `--tls-name`). Unix socket endpoints stay plaintext: there, the
    socket's permissions and the caller's uid are the agent's check.
    """

    ca: bytes
    cert: bytes
    key: bytes
    name: Optional[str] = None

    def __post_init__(self):
        for field in ("ca", "cert", "key"):
            object.__setattr__(self, field, _pem(field, getattr(self, field)))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def options(self) -> list:
        return [("grpc.ssl_target_name_override", self.name)] if self.name else []


def _is_unix(target: str) -> bool:
    return target.startswith(("unix:", "unix-abstract:"))


def _channel(endpoint: str, tls: Optional[Tls], aio: bool = False):
    """A channel to `endpoint`: TLS over TCP when `tls` is given, plaintext
    otherwise and always over a Unix socket. `aio`: an asyncio channel."""
    target = _target(endpoint)
    module = grpc.aio if aio else grpc
    if tls is None or _is_unix(target):
        return module.insecure_channel(target)
    return module.secure_channel(target, tls.credentials(), options=tls.options())


def _policy(on_full) -> int:
    if on_full is None:
        return pb.POLICY_UNSPECIFIED
    if isinstance(on_full, str):
        try:
            return POLICIES[on_full]
        except KeyError:
            raise ValueError(f"on_full must be 'refuse' or 'evict', not {on_full!r}") from None
    return int(on_full)


class Agent:
    """A client of one residentd agent.

    `endpoint` is the agent's Unix socket path (`/run/residentd/residentd.sock`,
    or `unix:/path`) or `HOST:PORT` for TCP. For TCP with mutual TLS give
    `tls=Tls(ca, cert, key)` (or, as before, `root_certificates`,
    `certificate_chain` and `private_key`, PEM bytes). `timeout` is
    the default deadline of each unary call, in seconds, except Start and
    Stop, which wait as long as the agent takes (a model may load for
    minutes) unless their own `timeout` says otherwise.
    """

    def __init__(self, endpoint: str, *, timeout: Optional[float] = 30.0, tls: Optional[Tls] = None,
                 root_certificates: Optional[bytes] = None, private_key: Optional[bytes] = None,
                 certificate_chain: Optional[bytes] = None):
        self.endpoint = endpoint
        self.timeout = timeout
        if root_certificates is not None:
            if tls is not None:
                raise ValueError("give tls= or root_certificates=, not both")
            tls = Tls(root_certificates, certificate_chain, private_key)
        self._channel = _channel(endpoint, tls)
        self._stub = pb_grpc.NodeAgentStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request, timeout, default=_DEFAULT):
        """One unary call; its deadline is `timeout`, else `default` (the
        client's own unless said otherwise; None: no deadline)."""
        if timeout is None:
            timeout = self.timeout if default is _DEFAULT else default
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as e:
            raise _decode(e) from None

    def start(self, workload: str, instance_id: str = "", *, on_full=None, wait_ready: bool = False,
              lease_ms: int = 0, timeout: Optional[float] = None) -> pb.StartResponse:
        """Starts an instance (or finds it running); raises `Refused`."""
        req = pb.StartRequest(workload=workload, instance_id=instance_id, on_full=_policy(on_full),
                              wait_ready=wait_ready, lease_ms=lease_ms)
        return self._call(self._stub.Start, req, timeout, default=None)

    def stop(self, instance_id: str, *, grace_ms: int = 0, timeout: Optional[float] = None) -> pb.Instance:
        """Stops an instance; answers once its memory is released."""
        return self._call(self._stub.Stop, pb.StopRequest(instance_id=instance_id, grace_ms=grace_ms),
                          timeout, default=None).instance

    def get(self, instance_id: str, *, timeout: Optional[float] = None) -> pb.Instance:
        return self._call(self._stub.Get, pb.GetRequest(instance_id=instance_id), timeout)

    def list(self, *, timeout: Optional[float] = None) -> List[pb.Instance]:
        return list(self._call(self._stub.List, pb.ListRequest(), timeout).instances)

    def place(self, workload: str, *, on_full=None, timeout: Optional[float] = None) -> pb.Placement:
        """What a Start would do, changing nothing."""
        return self._call(self._stub.Place, pb.PlaceRequest(workload=workload, on_full=_policy(on_full)),
                          timeout)

    def touch(self, instance_id: str, *, hold_ms: int = 0, release_hold: bool = False,
              timeout: Optional[float] = None) -> pb.Instance:
        """A use; renews the owner's lease; holds (or releases) against eviction."""
        req = pb.TouchRequest(instance_id=instance_id, hold_ms=hold_ms, release_hold=release_hold)
        return self._call(self._stub.Touch, req, timeout)

    def adopt(self, pid: int, workload: str, instance_id: str, *, manage: bool = False,
              port: int = 0, timeout: Optional[float] = None) -> pb.Instance:
        """Enters a server someone else started (process `pid`) into the
        agent's books without restarting it; the agent never signals it
        unless `manage`. `port`: its readiness port (0: the one it listens
        on). Raises `Refused` when its memory does not fit."""
        req = pb.AdoptRequest(pid=pid, workload=workload, instance_id=instance_id, manage=manage,
                              port=port)
        return self._call(self._stub.Adopt, req, timeout)

    def reload(self, *, timeout: Optional[float] = None) -> pb.ReloadResponse:
        """Re-reads the agent's configuration (needs the admin role)."""
        return self._call(self._stub.Reload, pb.ReloadRequest(), timeout)

    def node(self, *, timeout: Optional[float] = None) -> pb.NodeStatus:
        return self._call(self._stub.Node, pb.NodeRequest(), timeout)

    def workloads(self, *, timeout: Optional[float] = None) -> List[pb.Workload]:
        return list(self._call(self._stub.Workloads, pb.WorkloadsRequest(), timeout).workloads)

    def watch(self, since_revision: int = 0) -> Iterator[pb.Event]:
        """Every event from `since_revision` on (0: a snapshot first)."""
        try:
            yield from self._stub.Watch(pb.WatchRequest(since_revision=since_revision))
        except grpc.RpcError as e:
            raise _decode(e) from None

    def logs(self, instance_id: str, *, tail: int = 100, follow: bool = False) -> Iterator[pb.LogLine]:
        """An instance's last lines, then (with `follow`) new ones until its run ends."""
        try:
            yield from self._stub.Logs(pb.LogsRequest(instance_id=instance_id, tail=tail, follow=follow))
        except grpc.RpcError as e:
            raise _decode(e) from None
