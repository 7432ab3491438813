"""The Python package against an agent served only over mutual TLS on
loopback TCP, beside a plaintext agent on a Unix socket
(crates/residentd/tests/e2e/fleet.rs starts them), with grpcio's default
options: `residentd.Agent` and `residentd.fleet` with `tls=` place and
start on both; without a certificate, with a certificate of another CA,
trusting another CA, or checking another name, the TLS agent is
unreachable (saying why, where a look at it finds out) and the socket
agent still answers. Asserts as it goes; exits
non-zero with the reason on a failure.

Usage: tls_check.py JSON   where JSON is {"tls": "localhost:PORT", "ip": "127.0.0.1:PORT",
                                          "socket": SOCKET, "ca": PATH, "cert": PATH, "key": PATH,
                                          "client_ca": PATH, "foreign_cert": PATH, "foreign_key": PATH}
"""

import asyncio
import json
import sys

import residentd
from residentd import fleet, pb


def unreachable(ranking, endpoint, what):
    answer = ranking.answers[endpoint]
    assert isinstance(answer, fleet.Unreachable), (what, answer)
    assert endpoint not in ranking.choices, (what, ranking.choices)


def main():
    setup = json.loads(sys.argv[1])
    tcp, socket = setup["tls"], setup["socket"]
    tls = residentd.Tls(ca=setup["ca"], cert=setup["cert"], key=setup["key"])
    endpoints = {"tls-node": tcp, "socket-node": socket}

    # One agent over TLS: the typed client, files given as paths.
    with residentd.Agent(tcp, tls=tls) as a:
        assert a.node().node == "tls-node", a.node()
    # The old keywords (PEM bytes) still work.
    with residentd.Agent(tcp, root_certificates=tls.ca, certificate_chain=tls.cert,
                         private_key=tls.key) as a:
        assert [w.name for w in a.workloads()] == ["big", "small"], a.workloads()

    # The fleet: `big` fits only on the TLS agent (8 GB of 10), `small`
    # fits on both and goes where most is left; the socket agent is
    # reached in plaintext, the same `tls` notwithstanding.
    ranking = fleet.place(endpoints, "big", tls=tls)
    assert ranking.choices == [tcp], ranking.why_not()
    assert "unplaceable" in ranking.why_not()[socket], ranking.why_not()
    started = fleet.start(endpoints, "big", instance_id="big-1", tls=tls)
    assert started.endpoint == tcp and started.response.instance.state == pb.READY, started
    started = fleet.start(endpoints, "small", instance_id="small-1", tls=tls)
    assert started.endpoint == socket, (started.endpoint, started.ranking.answers)

    async def kept_channels():
        async with fleet.Fleet(endpoints, tls=tls) as f:
            ranking = await f.place("small")
            assert set(ranking.choices) == {tcp, socket}, ranking.why_not()
            started = await f.start("small", "small-2", ranking=ranking)
            assert started.endpoint == ranking.choices[0], started
            return started.endpoint
    second = asyncio.run(kept_channels())
    with residentd.Agent(tcp, tls=tls) as a:
        ids = sorted(i.instance_id for i in a.list() if i.state == pb.READY)
    want = sorted(["big-1"] + (["small-2"] if second == tcp else []))
    assert ids == want, (ids, want)

    # The fleet view, its streams and its Place calls over mutual TLS too:
    # the fan-out's choices; plaintext to the TLS agent is refused, and
    # says why.
    with fleet.View(endpoints, tls=tls) as view:
        assert view.node(tcp).up and view.node(socket).up, view.nodes()
        for workload in ("big", "small"):  # big fits nowhere now; small on both
            mine, theirs = view.place(workload), fleet.place(endpoints, workload, tls=tls)
            assert mine.choices == theirs.choices, (workload, mine, theirs.why_not())
            assert len(mine.asked) == (workload == "small"), (workload, mine.asked)
    with fleet.View(endpoints) as view:
        down = view.node(tcp)
        assert not down.up and "it speaks TLS, not plaintext" in down.why, down
        unreachable(view.place("small"), tcp, "a view in plaintext")

    # A name to check the certificate against, for an address it lacks:
    # 127.0.0.1 is refused, 127.0.0.1 checked as localhost answers.
    ip = setup["ip"]
    ranking = fleet.place([ip], "small", tls=tls)
    unreachable(ranking, ip, "a certificate for localhost, dialled as 127.0.0.1")
    # ... saying so, with the names it has and the fix.
    said = ranking.why_not()[ip]
    assert "the agent's certificate is not valid for 127.0.0.1" in said, said
    assert "it names localhost. Pass one of those as residentd.Tls(..., name='localhost')" in said, said
    named = residentd.Tls(tls.ca, tls.cert, tls.key, name="localhost")
    assert fleet.place([ip], "small", tls=named).choices == [ip]

    # Refused: plaintext, a client certificate of another CA, a client
    # that trusts another CA. The socket agent answers each time.
    refused = {
        "plaintext": None,
        "another CA's client certificate": residentd.Tls(setup["ca"], setup["foreign_cert"],
                                                         setup["foreign_key"]),
        "trusting another CA": residentd.Tls(setup["client_ca"], setup["cert"], setup["key"]),
    }
    # What a look at the endpoint finds out, where it does.
    words = {
        "plaintext": f"cannot reach residentd at {tcp}: it speaks TLS, not plaintext",
        "trusting another CA": f"cannot reach residentd at {tcp}: the agent's certificate did not "
                               "verify against Tls ca",
    }
    for what, bad in refused.items():
        ranking = fleet.place(endpoints, "small", tls=bad)
        unreachable(ranking, tcp, what)
        assert ranking.choices == [socket], (what, ranking.why_not())
        assert words.get(what, "") in ranking.why_not()[tcp], (what, ranking.why_not())
        try:
            fleet.start([tcp], "small", instance_id="never", tls=bad)
            raise AssertionError(f"{what}: started")
        except fleet.FleetRefused as e:
            assert isinstance(e.ranking.answers[tcp], fleet.Unreachable), (what, e.ranking.answers)
    with residentd.Agent(tcp, tls=tls) as a:
        assert "never" not in [i.instance_id for i in a.list()]
    print("tls fleet checks passed")


if __name__ == "__main__":
    main()
