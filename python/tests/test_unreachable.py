"""An agent that cannot be reached: `residentd.Agent` and `residentd.fleet`
raise (or answer) `Unreachable` with words that say why and what to do,
for each cause, against stand-ins on Unix sockets in a temporary
directory and on loopback TCP: no socket there, a regular file or a
directory, a socket left behind, a socket of a group this user is not in
(as uid 65534, when run as root), a host name that does not resolve,
nothing listening, plaintext against TLS, TLS against plaintext HTTP/2 and
a certificate of other names. The real agent's side is
tests/fleet/tls_check.py's."""

import asyncio
import grp
import os
import pickle
import socket
import socketserver
import ssl
import tempfile
import threading
import unittest

import residentd
from residentd import _client, fleet

# A CA and a certificate it signed for localhost and node-7.example, with
# its key: test material only (valid until 2126).
CA = """-----BEGIN CERTIFICATE-----
MIIBnzCCAUWgAwIBAgIUE9Ib3H89W+2UF0BNs2xaJTGtRh4wCgYIKoZIzj0EAwIw
HDEaMBgGA1UEAwwRcmVzaWRlbnRkIHRlc3QgQ0EwIBcNMjYxMjA1MTY1ODI4WhgP
MjEyNjExMTExNjU4MjhaMBwxGjAYBgNVBAMMEXJlc2lkZW50ZCB0ZXN0IENBMFkw
EwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEds/Fs0TlYuv5YEY8fSHZ6D1bd5+bSD6I
gvEd3CdylKloOTI3ybPIic1pAuVbOXRB3rKGn6fXyvtT2Qvhciqy36NjMGEwHQYD
VR0OBBYEFAL3d2qkFtCEeBd0ZVDD4wPZrQZYMB8GA1UdIwQYMBaAFAL3d2qkFtCE
eBd0ZVDD4wPZrQZYMA8GA1UdEwEB/wQFMAMBAf8wDgYDVR0PAQH/BAQDAgIEMAoG
CCqGSM49BAMCA0gAMEUCIQCqVC1T+NW+oIsmr6wm1uxvIrrjo+4z5T4g4HPCMIg9
4wIgZ2JmCHtL07bMQteDsiJEvo/Su5mZX52706K1wrjrzQg=
-----END CERTIFICATE-----
"""
CERT = """-----BEGIN CERTIFICATE-----
MIIByDCCAW+gAwIBAgIUJJcB0f61dYp2fjaiBfqwyMhNEecwCgYIKoZIzj0EAwIw
HDEaMBgGA1UEAwwRcmVzaWRlbnRkIHRlc3QgQ0EwIBcNMjYxMjA1MTY1ODI4WhgP
MjEyNjExMTExNjU4MjhaMBUxEzARBgNVBAMMCnRlc3QgYWdlbnQwWTATBgcqhkjO
PQIBBggqhkjOPQMBBwNCAARLvK5GeOx7NgCRBX85EhRnvfkC7rskJRm4vTWcPp81
X6VMuH1r68r2S7U6Bfpfljw6m2XrZDpOEV5G18RWMA8Eo4GTMIGQMCQGA1UdEQQd
MBuCCWxvY2FsaG9zdIIObm9kZS03LmV4YW1wbGUwCQYDVR0TBAIwADAdBgNVHSUE
FjAUBggrBgEFBQcDAQYIKwYBBQUHAwIwHQYDVR0OBBYEFK1q7ssnlFiqqVVbcsUG
gHMmY0ueMB8GA1UdIwQYMBaAFAL3d2qkFtCEeBd0ZVDD4wPZrQZYMAoGCCqGSM49
BAMCA0cAMEQCICv8sw3lLBJJFaSlxbgI4rL3DYkA+RUS86jggXWrS0zHAiB6e7LF
BXm8IxRl0O8swLpcGBZVhru19hjicdaCE5mYIQ==
-----END CERTIFICATE-----
"""
KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgU9xWumtwok2HA+iV
a07M41q2U7bayAJTCT/mx+FQ9/+hRANCAARLvK5GeOx7NgCRBX85EhRnvfkC7rsk
JRm4vTWcPp81X6VMuH1r68r2S7U6Bfpfljw6m2XrZDpOEV5G18RWMA8E
-----END PRIVATE KEY-----
"""


def unreachable(endpoint, tls=None):
    """The `Unreachable` a call to `endpoint` raises."""
    with residentd.Agent(endpoint, timeout=5, tls=tls) as agent:
        try:
            agent.node()
        except residentd.Unreachable as e:
            return e
    raise AssertionError(f"{endpoint} answered")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server(socketserver.ThreadingTCPServer):
    """A stand-in on loopback TCP: `handle(connection)` for each."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, handle):
        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.settimeout(5)
                try:
                    handle(self.request)
                except OSError:
                    pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def __exit__(self, *exc):
        self.shutdown()
        super().__exit__(*exc)


class UnixTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.path = os.path.join(self.dir.name, "agent.sock")

    def test_no_socket_there(self):
        e = unreachable(self.path)
        self.assertEqual(e.code.name, "UNAVAILABLE")
        self.assertIn(f"cannot reach residentd at {self.path}: no such socket", e.message)
        self.assertIn("Is residentd running?", e.message)
        self.assertIn("/run/residentd/residentd.sock", e.message)
        # Picklable, as every AgentError (Ray carries them).
        self.assertEqual(str(pickle.loads(pickle.dumps(e))), str(e))

    def test_a_regular_file_or_a_directory(self):
        with open(self.path, "w"):
            pass
        e = unreachable(self.path)
        self.assertIn(f"{self.path}: it is a regular file, not a socket", e.message)
        e = unreachable("unix:" + self.dir.name)
        self.assertIn(f"{self.dir.name}: it is a directory, not a socket", e.message)

    def test_a_socket_left_behind(self):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(self.path)
        e = unreachable(self.path)
        self.assertIn(f"{self.path}: connection refused: the socket is there but no agent "
                      "listens on it", e.message)

    def test_a_socket_of_a_group_this_user_is_not_in(self):
        if os.geteuid() != 0:
            self.skipTest("needs root: the caller of another user is made with setuid")
        group = next((g for g in map(_group, ("adm", "disk", "daemon", "sys"))
                      if g and g.gr_gid != 65534 and "nobody" not in g.gr_mem), None)
        if group is None:
            self.skipTest("no group here that nobody is not in")
        os.chmod(self.dir.name, 0o755)
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(self.path)
            listener.listen()
            os.chown(self.path, 0, group.gr_gid)
            os.chmod(self.path, 0o660)
            said = _as_nobody(lambda: _client._why_unreachable(self.path, None))
        name = group.gr_name
        self.assertIn(f"cannot reach residentd at {self.path}: permission denied: the socket "
                      f"belongs to group {name} (mode 0660) and user nobody is not in that group",
                      said)
        self.assertIn(f"Join it: sudo usermod -aG {name} nobody, then log in again", said)

    def test_a_fleet_answers_unreachable_with_the_words(self):
        ranking = fleet.place({"n1": self.path}, "m")
        answer = ranking.answers[self.path]
        self.assertIsInstance(answer, fleet.Unreachable)
        self.assertIn(f"cannot reach residentd at {self.path}: no such socket",
                      ranking.why_not()[self.path])


def _group(name):
    try:
        return grp.getgrnam(name)
    except KeyError:
        return None


def _as_nobody(call):
    """What `call` returns in a child process run as uid and gid 65534
    with no other groups (it must return text)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, str(call()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    return said


class TcpTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.tls = residentd.Tls(CA.encode(), CERT.encode(), KEY.encode())

    def tls_server(self):
        """A TLS stand-in with the certificate for localhost and
        node-7.example: shakes hands, then closes."""
        cert, key = (os.path.join(self.dir.name, n) for n in ("cert.pem", "key.pem"))
        for path, text in ((cert, CERT), (key, KEY)):
            with open(path, "w") as f:
                f.write(text)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        context.set_alpn_protocols(["h2"])

        def handle(connection):
            with context.wrap_socket(connection, server_side=True) as s:
                s.recv(1)

        return Server(handle)

    def test_a_host_name_that_does_not_resolve(self):
        e = unreachable("no-such-host.invalid:7443")
        self.assertIn("cannot reach residentd at no-such-host.invalid:7443: the host name "
                      "no-such-host.invalid did not resolve", e.message)

    def test_nothing_listening(self):
        port = free_port()
        e = unreachable(f"127.0.0.1:{port}")
        self.assertIn(f"connection refused: nothing listens on 127.0.0.1:{port}", e.message)

    def test_plaintext_against_tls(self):
        with self.tls_server() as server:
            e = unreachable(f"127.0.0.1:{server.port}")
        self.assertIn(f"cannot reach residentd at 127.0.0.1:{server.port}: it speaks TLS, not "
                      "plaintext: pass tls=residentd.Tls(", e.message)

    def test_a_certificate_of_other_names(self):
        with self.tls_server() as server:
            e = unreachable(f"127.0.0.1:{server.port}", tls=self.tls)
            named = unreachable(f"127.0.0.1:{server.port}",
                                tls=residentd.Tls(CA, CERT, KEY, name="other.example"))
        self.assertIn("the agent's certificate is not valid for 127.0.0.1 (the endpoint's host); "
                      "it names localhost, node-7.example. Pass one of those as "
                      "residentd.Tls(..., name='localhost')", e.message)
        self.assertIn("not valid for other.example (Tls name)", named.message)

    def test_tls_against_plaintext(self):
        def handle(connection):  # HTTP/2's SETTINGS, whatever came
            connection.recv(1024)
            connection.sendall(b"\0\0\0\x04\0\0\0\0\0")

        with Server(handle) as server:
            e = unreachable(f"127.0.0.1:{server.port}", tls=self.tls)
        self.assertIn(f"cannot reach residentd at 127.0.0.1:{server.port}: it does not speak TLS "
                      "but plaintext HTTP/2 (an agent with insecure = true)", e.message)

    def test_a_fleet_off_the_event_loop(self):
        async def place():
            async with fleet.Fleet([f"127.0.0.1:{port}"], deadline_s=5) as f:
                return await f.place("m")

        port = free_port()
        ranking = asyncio.run(place())
        self.assertIn("connection refused: nothing listens",
                      ranking.why_not()[f"127.0.0.1:{port}"])


if __name__ == "__main__":
    unittest.main()
