"""residentd under a real Ray cluster on loopback (crates/residentd/tests/e2e/fleet.rs
starts the three agents): a head and two workers started with `ray start`,
each labelled with its own agent; models placed with residentd.ray.place_model.
Asserts as it goes; exits non-zero with the reason on a failure.

Usage: ray_check.py JSON   where JSON is {"agents": {NAME: SOCKET, ...},
                                          "pids": {NAME: PID}, "tmp": DIR}
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import ray

import residentd
from residentd import fleet, pb
from residentd import ray as rray

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
LEASE_MS = 3000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_start(args, log, env=None):
    """One Ray node, `ray start --block` in the foreground: ending the
    process ends the node (and only ours, unlike `ray stop`). Its workers
    inherit `env`."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_raylet_start_wait_time_s="120", **(env or {}))
    return subprocess.Popen([RAY, "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                             "--disable-usage-stats", *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def answers(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def serves(path):
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def until(check, what, within=60.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {within} s: {what}")


def instance(endpoint, instance_id):
    with residentd.Agent(endpoint) as a:
        return next((i for i in a.list() if i.instance_id == instance_id), None)


@contextlib.contextmanager
def cluster(agents, tmp, env=None):
    """A Ray cluster on loopback, one node per agent (the first the head),
    each labelled with its agent and started with `env`; the driver
    connected. Yields the head's port. On a failure, prints what
    `ray start` said; at the end, ends every node."""
    names = list(agents)
    port = free_port()
    log = open(os.path.join(tmp, "ray.log"), "w")
    nodes_started = [ray_start(["--head", f"--port={port}", "--include-dashboard=false",
                                f"--temp-dir={tmp}", "--labels", rray.labels(agents[names[0]])], log, env)]
    try:
        until(lambda: answers(port), "the Ray head serves")
        ray.init(address=f"127.0.0.1:{port}", logging_level="ERROR")
        until(lambda: len(rray.agents()) == 1, "the head node registered", within=120)
        # One at a time: each registers before the next starts (two raylets
        # registering at once on a loaded 2-core machine can time out).
        for n, name in enumerate(names[1:], start=2):
            nodes_started.append(ray_start([f"--address=127.0.0.1:{port}", "--labels", rray.labels(agents[name])],
                                           log, env))
            until(lambda: len(rray.agents()) == n, f"node {name} registered", within=120)
        yield port
    except BaseException:
        log.flush()
        with open(log.name) as f:
            sys.stderr.write("ray start said:\n" + f.read()[-6000:])
        raise
    finally:
        ray.shutdown()
        for node in reversed(nodes_started):
            node.terminate()
        for node in nodes_started:
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()
            # What the node started and left behind when it ended (its
            # dashboard agent and runtime-env agent outlive a node whose
            # worker held a detached actor, such as the fleet view): each
            # node is its own session, so its process group is all of it.
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main():
    setup = json.loads(sys.argv[1])
    agents, pids = setup["agents"], setup["pids"]
    with cluster(agents, setup["tmp"]):
        check(agents, pids)


def check(agents, pids):
    nodes = rray.agents()
    assert sorted(nodes.values()) == sorted(agents.values()), nodes
    name_of = {endpoint: name for name, endpoint in agents.items()}

    # Five models, each where it fits without eviction.
    actors = {}
    for workload in ["m25", "m15", "m8", "m4", "m3"]:
        actor = rray.place_model(workload, instance_id=workload, lease_ms=LEASE_MS)
        actors[workload] = actor
        node_id = ray.get(actor.node.remote())
        at = name_of[nodes[node_id]]
        i = instance(agents[at], workload)
        assert i is not None and i.state == pb.READY, (workload, at, i)
        url = ray.get(actor.endpoint.remote())
        assert url == f"http://127.0.0.1:{i.port}", (url, i.port)
        actors[workload] = (actor, at)
    landed = {w: at for w, (_, at) in actors.items()}
    # m4 fits n2 and n3 alike (1 GB left on either): ties go by node
    # name, which under Ray is the node id; m3 then fits only the other.
    by_id = sorted(["n2", "n3"], key=lambda n: next(i for i, e in nodes.items() if e == agents[n]))
    expected = {"m25": "n3", "m15": "n2", "m8": "n1", "m4": by_id[0], "m3": by_id[1]}
    assert landed == expected, (landed, expected)
    for name, endpoint in agents.items():
        with residentd.Agent(endpoint) as a:
            ready = sorted(i.instance_id for i in a.list() if i.state == pb.READY)
        assert ready == sorted(w for w, at in landed.items() if at == name), (name, ready)

    # A sixth fits nowhere: refused with every node's reason.
    try:
        rray.place_model("m20", lease_ms=LEASE_MS)
        raise AssertionError("m20 fits nowhere")
    except fleet.FleetRefused as e:
        why = e.ranking.why_not()
        assert set(why) == set(agents.values()), why
        assert all("unplaceable" in w for w in why.values()), why

    # Another scheduler takes the first choice between the ranking and
    # the start: the refused start's actor ends, and the next node of
    # the ranking gets the model.
    ranking = fleet.place(dict(rray.agents()), "m1")
    first, second = ranking.choices[0], ranking.choices[1]
    with residentd.Agent(first) as a:
        a.start("m2", "other-scheduler")
    actor = rray.place_model("m1", instance_id="m1", lease_ms=LEASE_MS, ranking=ranking)
    assert nodes[ray.get(actor.node.remote())] == second, (name_of[first], name_of[second])
    assert instance(first, "m1") is None, "nothing of the refused start is left"
    assert instance(second, "m1").state == pb.READY

    # A killed actor renews nothing: its model is stopped within the lease.
    actor, at = actors["m8"]
    ray.kill(actor)
    killed = time.monotonic()
    gone = until(lambda: (lambda i: i if i and i.state in (pb.EXITED, pb.FAILED) else None)(
        instance(agents[at], "m8")), "m8 stopped after its actor was killed", within=LEASE_MS / 1000 + 10)
    took = time.monotonic() - killed
    assert "LEASE_EXPIRED" in gone.message, gone.message
    assert took < LEASE_MS / 1000 + 3, f"stopped {took:.1f} s after the kill, lease {LEASE_MS} ms"
    # The others were renewed all along.
    assert instance(agents["n3"], "m25").state == pb.READY

    # An actor that ends normally stops its model at once.
    actor, at = actors["m4"]
    ray.get(actor.stop.remote())
    assert instance(agents[at], "m4").state == pb.EXITED

    # One agent stopped: the ranking skips its node and says why.
    os.kill(pids["n1"], signal.SIGTERM)
    until(lambda: not serves(agents["n1"]), "n1 no longer serves")
    ranking = fleet.place({n: e for n, e in rray.agents().items()}, "m1", deadline_s=1.0)
    down = ranking.answers[agents["n1"]]
    assert isinstance(down, fleet.Unreachable), down
    assert agents["n1"] not in ranking.choices and ranking.choices, ranking.choices
    actor = rray.place_model("m1", instance_id="m1-late", lease_ms=LEASE_MS)
    assert name_of[nodes[ray.get(actor.node.remote())]] != "n1"

    # The cluster's fleet view (an actor with one stream per agent): the
    # fan-out's choices from its pictures, n1 left out, a Place call or
    # so; a model placed through it lands on its first choice.
    view = rray.view()
    want = fleet.place(dict(rray.agents()), "m1", deadline_s=1.0).choices
    got = ray.get(view.place.remote("m1"))
    assert got.choices == want, (got.choices, want)
    assert isinstance(got.answers[agents["n1"]], fleet.Unreachable) and len(got.asked) <= 3, got
    actor = rray.place_model("m1", instance_id="m1-view", lease_ms=LEASE_MS, view=view)
    assert nodes[ray.get(actor.node.remote())] == want[0], (want, ray.get(actor.node.remote()))
    assert instance(want[0], "m1-view").state == pb.READY
    print("ray checks passed")


if __name__ == "__main__":
    main()
