"""The typed client of one agent: a method per RPC, and refusals decoded
into `Refused`."""

from __future__ import annotations

import dataclasses
import grp
import os
import pathlib
import pwd
import socket
import ssl
import stat
import time
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

#: Where the packaged agent listens.
_DEFAULT_SOCKET = "/run/residentd/residentd.sock"

#: How long a look at an endpoint that could not be reached may take.
_PROBE_S = 3.0


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


class Unreachable(AgentError):
    """The agent could not be reached (or, in a fleet, did not answer in
    time). Where a look at the endpoint finds out why (no socket there, not
    a socket, a group this user is not in, a host name that does not
    resolve, nothing listening, TLS against plaintext or the reverse, a
    certificate of other names), the message says so and what to do;
    otherwise it is gRPC's own."""


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


def _why_unreachable(endpoint: str, tls: Optional[Tls], within_s: float = _PROBE_S) -> Optional[str]:
    """Why `endpoint`, which a call could not reach, cannot be reached, in
    words that say what to do; None when a look at it within `within_s`
    seconds (a name lookup aside) does not find out."""
    end = time.monotonic() + within_s
    target = _target(endpoint)
    at = f"cannot reach residentd at {endpoint}"
    if target.startswith("unix-abstract:"):
        return None
    if _is_unix(target):
        path = target[len("unix:"):]
        return _why_socket("/" + path.lstrip("/") if path.startswith("//") else path, at, end)
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return None
    return _why_tcp(host.strip("[]"), int(port), tls, at, end)


def _left(end: float) -> float:
    """Seconds until `end` (a `time.monotonic()`), a little at least."""
    return max(end - time.monotonic(), 0.01)


def _why_socket(path: str, at: str, end: float) -> Optional[str]:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return (f"{at}: no such socket: nothing is at that path. Is residentd running? Give the "
                f"path its config's listen = \"unix://PATH\" names (the packaged agent's is "
                f"{_DEFAULT_SOCKET})")
    except PermissionError:
        return _denied(path, at)
    except NotADirectoryError:
        return f"{at}: a part of that path is not a directory"
    if not stat.S_ISSOCK(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode)
                else "some other file")
        return (f"{at}: it is {kind}, not a socket. Give the agent's socket (its config's "
                f"listen = \"unix://PATH\")")
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(_left(end))
        try:
            s.connect(path)
        except PermissionError:
            return _denied(path, at)
        except ConnectionRefusedError:
            return (f"{at}: connection refused: the socket is there but no agent listens on it "
                    f"(residentd stopped and left it behind, or is starting)")
        except OSError:
            return None
    return None


def _denied(path: str, at: str) -> str:
    """Permission denied on the socket, or on a directory on the way to it
    that this user may not pass: whose group to join."""
    dirs = reversed(pathlib.Path(path).parents)
    blocking = next((str(d) for d in dirs if not os.access(d, os.X_OK)), None)
    where, what, bit = ((blocking, f"the directory {blocking}", stat.S_IXGRP) if blocking
                        else (path, "the socket", stat.S_IWGRP))
    try:
        st = os.stat(where)
    except OSError:
        return f"{at}: permission denied"
    mode = stat.S_IMODE(st.st_mode)
    try:
        group = grp.getgrgid(st.st_gid)
    except KeyError:
        group = None
    name = group.gr_name if group else f"gid {st.st_gid}"
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = None
    if not mode & bit:
        return (f"{at}: permission denied: {what} is mode {mode:04o} (group {name}), which lets "
                f"no group in. The agent's socket_group setting gives a group access (mode 0660)")
    if group and user in group.gr_mem:
        return (f"{at}: permission denied: {what} belongs to group {name} (mode {mode:04o}); "
                f"{user} is a member of {name}, but this login session began before joining it. "
                f"Log in again (or run newgrp {name})")
    who = f"user {user}" if user else f"uid {os.getuid()}"
    return (f"{at}: permission denied: {what} belongs to group {name} (mode {mode:04o}) and {who} "
            f"is not in that group. Join it: sudo usermod -aG {name} {user or '$USER'}, then log "
            f"in again (or run newgrp {name})")


def _why_tcp(host: str, port: int, tls: Optional[Tls], at: str, end: float) -> Optional[str]:
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return (f"{at}: the host name {host} did not resolve ({e.strerror}). Check its spelling, "
                f"or give the agent's IP address")
    try:
        raw = socket.create_connection((host, port), timeout=_left(end))
    except ConnectionRefusedError:
        return (f"{at}: connection refused: nothing listens on {host}:{port}. Is residentd "
                f"running there, with tcp://IP:{port} in its listen?")
    except OSError:
        return None
    if tls is None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        try:
            _handshake(context, raw, host)
        except ssl.SSLError as e:
            # An alert is the other side speaking TLS too.
            if "ALERT" not in (e.reason or ""):
                return None
        except OSError:
            return None
        return (f"{at}: it speaks TLS, not plaintext: pass tls=residentd.Tls(ca=..., cert=..., "
                f"key=...)")
    name = tls.name or host
    checked = "Tls name" if tls.name else "the endpoint's host"
    try:
        _handshake(_verifying(tls), raw, name)
        return None
    except ssl.SSLCertVerificationError as e:
        if e.verify_code not in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_MISMATCH
            return (f"{at}: the agent's certificate did not verify against Tls ca "
                    f"({e.verify_message}): give the CA that signed the agent's [node.tls] cert")
    except ssl.SSLError:
        if _speaks_h2c(host, port, end):
            return (f"{at}: it does not speak TLS but plaintext HTTP/2 (an agent with insecure "
                    f"= true): reach it without tls=")
        return None
    except OSError:
        return None
    names = _certificate_names(host, port, tls, end)
    said = f"{at}: the agent's certificate is not valid for {name} ({checked})"
    if names:
        return (f"{said}; it names {', '.join(names)}. Pass one of those as "
                f"residentd.Tls(..., name={names[0]!r})")
    return f"{said}; pass a name it has as residentd.Tls(..., name=...)"


def _verifying(tls: Tls) -> ssl.SSLContext:
    """A context that checks the agent's certificate against `tls.ca` and
    the name."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=tls.ca.decode(errors="replace"))
    return context


def _handshake(context: ssl.SSLContext, raw: socket.socket, name: str) -> None:
    """A TLS handshake on `raw` (closed after), offering HTTP/2 as gRPC
    does; sends nothing after it."""
    context.set_alpn_protocols(["h2"])
    with raw, context.wrap_socket(raw, server_hostname=name):
        pass


def _certificate_names(host: str, port: int, tls: Tls, end: float) -> List[str]:
    """The DNS and IP names (subject alternative names) of the certificate
    `host:port` presents, checked against `tls.ca` but not against a
    name."""
    context = _verifying(tls)
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout=_left(end)) as raw:
            with context.wrap_socket(raw, server_hostname=host) as s:
                cert = s.getpeercert() or {}
    except OSError:
        return []
    return [value.strip() for kind, value in cert.get("subjectAltName", ())
            if kind in ("DNS", "IP Address")]


def _speaks_h2c(host: str, port: int, end: float) -> bool:
    """Whether `host:port` answers HTTP/2's preface in plaintext (with its
    SETTINGS frame)."""
    try:
        with socket.create_connection((host, port), timeout=_left(end)) as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0\0\0\x04\0\0\0\0\0")
            head = b""
            while len(head) < 9:
                more = s.recv(9 - len(head))
                if not more:
                    return False
                head += more
    except OSError:
        return False
    return head[3] == 0x04


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
        self._tls = tls
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
            raise self._error(e) from None

    def _error(self, e: grpc.RpcError) -> AgentError:
        """`e` as the error to raise: `Unreachable`, saying why, when the
        agent could not be reached and a look at its endpoint finds out."""
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            why = _why_unreachable(self.endpoint, self._tls)
            if why:
                return Unreachable(e.code(), why)
        return _decode(e)

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

    def place(self, workload: str, *, on_full=None, instance_id: str = "",
              timeout: Optional[float] = None) -> pb.Placement:
        """What a Start would do, changing nothing; with `instance_id`, what a
        Start naming it would do (admitted at once when it is resident, a
        wake's plan when it is asleep)."""
        req = pb.PlaceRequest(workload=workload, on_full=_policy(on_full), instance_id=instance_id)
        return self._call(self._stub.Place, req, timeout)

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
            raise self._error(e) from None

    def logs(self, instance_id: str, *, tail: int = 100, follow: bool = False) -> Iterator[pb.LogLine]:
        """An instance's last lines, then (with `follow`) new ones until its run ends."""
        try:
            yield from self._stub.Logs(pb.LogsRequest(instance_id=instance_id, tail=tail, follow=follow))
        except grpc.RpcError as e:
            raise self._error(e) from None
