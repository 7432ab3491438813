"""examples/ray-serve-resident.py under real Ray Serve, on a real Ray cluster
on loopback (crates/residentd/tests/e2e/fleet.rs starts the three agents:
n1 10 GB, n2 20 GB, n3 30 GB at max_instances = 1, each with the workload
`chat`, 8 GB, tests/fleet/echo_model.py, which answers with its node).
Asserts as it goes; exits non-zero with the reason on a failure.

- The documented command (`serve run --app-dir examples
  ray-serve-resident:app`, two replicas) places both models by Place (n3
  first, and n2 when n3 refuses the second), requests reach both, and its
  Ctrl-C stops both models at once.
- The same deployment under the Python API: one replica on the node Place
  ranks first, reached over HTTP; scaled up, the next replica falls back
  from the refusing n3 to n2; scaled down, one model is stopped at once;
  a killed replica's model ends with its lease and the replica is
  replaced; a node's agent dying moves the replica to a node whose agent
  answers; deleting the app stops the model.

Usage: serve_check.py JSON   where JSON is {"agents": {NAME: SOCKET, ...},
                                            "pids": {NAME: PID}, "tmp": DIR}
"""

import glob
import importlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import ray
from ray import serve
from ray.serve._private.common import DeploymentID
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

import residentd
from residentd import fleet, pb
from residentd import ray as rray
from ray_check import cluster, free_port, serves, until

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES = os.path.join(REPO, "examples")
SERVE = os.path.join(os.path.dirname(sys.executable), "serve")
APP, DEPLOYMENT = "chat", "ResidentChat"
LEASE_MS = 3000

# The driver imports the example as `serve run --app-dir examples` does;
# Ray hands the driver's sys.path to the workers of this loopback cluster.
sys.path.insert(0, EXAMPLES)
example = importlib.import_module("ray-serve-resident")


def chats(agents, state=pb.READY):
    """Per node whose agent answers: its `chat` instances in `state`, by id."""
    out = {}
    for name, endpoint in agents.items():
        if not serves(endpoint):
            continue
        with residentd.Agent(endpoint) as a:
            out[name] = {i.instance_id: i for i in a.list() if i.workload == "chat" and i.state == state}
    return out


def counts(agents):
    """How many READY `chat` models each node's agent holds (zeros left out)."""
    return {name: len(held) for name, held in chats(agents).items() if held}


def post(http, body):
    """POSTs `body` to the Serve proxy; (status, JSON answer), or (None, why)."""
    req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/chat/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError as e:
        return None, str(e)


def reaches(agents, http, nodes, within=60):
    """Posts through Serve until answers came from the models on each of
    `nodes` (each answer checked against what that node's agent holds);
    fails on an answer from anywhere else."""
    seen = set()

    def one():
        status, answer = post(http, {"messages": [{"role": "user", "content": "hi"}]})
        if status != 200:
            return False
        held = chats(agents).get(answer["node"], {})
        assert answer["node"] in nodes, (answer, nodes)
        assert answer["port"] in {i.port for i in held.values()}, (answer, held)
        assert answer["path"] == "/v1/chat/completions" and answer["asked"]["messages"], answer
        seen.add(answer["node"])
        return seen == set(nodes)

    until(one, f"requests through Serve reach the models on {sorted(nodes)}", within)


def ranked_first(name_of):
    """The nodes that would take a `chat` model, Place's best first."""
    ranking = fleet.place(dict(rray.agents()), "chat")
    return [name_of[e] for e in ranking.choices]


def ended(agents, ids, within):
    """Waits until each of `ids` (instance id to node) is EXITED; their instances."""
    def all_ended():
        out = {}
        for instance_id, at in ids.items():
            with residentd.Agent(agents[at]) as a:
                i = a.get(instance_id)
            if i.state != pb.EXITED:
                return None
            out[instance_id] = i
        return out
    return until(all_ended, f"{sorted(ids)} stopped", within)


def flat(held):
    """{node: {id: instance}} as {id: node}."""
    return {i: at for at, ids in held.items() for i in ids}


def scale(n):
    """Sets the deployment's target replicas, as Serve's REST API does
    (POST /api/v1/applications/APP/deployments/DEPLOYMENT/scale, served by
    the dashboard, which this cluster runs without): through the controller."""
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name=DEPLOYMENT, app_name=APP), n))


def start_serve(http):
    """Serve with its proxy on the head only (the nodes share one host, so
    one port each would clash), on loopback port `http`."""
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http})


def the_documented_command(agents, name_of, port, http, tmp):
    assert ranked_first(name_of)[:2] == ["n3", "n2"], ranked_first(name_of)
    log = open(os.path.join(tmp, "serve-run.log"), "w")
    # Serve started first from another process: `serve run` uses it, and
    # its Ctrl-C shuts it down, leaving no stale client in this driver.
    subprocess.run([sys.executable, "-c", "import ray, serve_check as c; "
                    f"ray.init(address='127.0.0.1:{port}', logging_level='ERROR'); c.start_serve({http})"],
                   cwd=os.path.dirname(os.path.abspath(__file__)), check=True, stdout=log, stderr=subprocess.STDOUT)
    cli = subprocess.Popen([SERVE, "run", "--address", f"127.0.0.1:{port}", "--app-dir", "examples",
                            "ray-serve-resident:app"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        # Two replicas at once: both rank n3 first; n3 (max_instances = 1)
        # refuses one of them, which falls back to n2.
        until(lambda: counts(agents) == {"n2": 1, "n3": 1}, "the example's two models on n3 and n2", within=120)
        reaches(agents, http, {"n2", "n3"})
        held = flat(chats(agents))
        cli.send_signal(signal.SIGINT)  # Ctrl-C: serve run deletes the app
        cli.wait(timeout=120)
        # Stopped by the replicas' __del__, well before their 30 s leases.
        for i in ended(agents, held, within=20).values():
            assert "LEASE_EXPIRED" not in i.message, i.message
    except BaseException:
        log.flush()
        with open(log.name) as f:
            sys.stderr.write("serve run said:\n" + f.read()[-6000:])
        raise
    finally:
        if cli.poll() is None:
            cli.kill()


def replicas():
    """The Serve replica actors of the app (named SERVE_REPLICA::APP#...)."""
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#")]


def resident_model_of(replica):
    """The pid of the one live ResidentModel actor the replica (an actor
    handle) owns, from the GCS's actor table (every node of this cluster
    runs on this host)."""
    table = ray._private.state.actors(actor_state_name="ALIVE")
    owner = table[replica._actor_id.hex()]["Address"]
    [pid] = [a["Pid"] for a in table.values()
             if a["ActorClassName"] == "ResidentModel"
             and (a["OwnerAddress"]["IPAddress"], a["OwnerAddress"]["Port"]) == (owner["IPAddress"], owner["Port"])]
    return pid


def the_python_api(agents, pids, name_of, http):
    start_serve(http)
    deployment = example.ResidentChat.options(num_replicas=1, health_check_period_s=1, health_check_timeout_s=5)

    # One replica: its model on the node Place ranks first, reached over HTTP.
    first = ranked_first(name_of)[0]
    serve.run(deployment.bind(lease_ms=LEASE_MS), name=APP, route_prefix="/", external_scaler_enabled=True)
    assert counts(agents) == {first: 1}, (counts(agents), first)
    reaches(agents, http, {first})

    # Scaled up: Place ranks n3 first again, n3 refuses (max_instances), and
    # the next node of the ranking, n2, takes the second model.
    assert ranked_first(name_of)[:2] == ["n3", "n2"], ranked_first(name_of)
    scale(2)
    until(lambda: counts(agents) == {"n2": 1, "n3": 1}, "the second model on n2")
    reaches(agents, http, {"n2", "n3"})

    # Scaled down: Serve ends one replica, whose __del__ stops its model.
    before = flat(chats(agents))
    scale(1)
    until(lambda: sum(counts(agents).values()) == 1, "one model left")
    gone = {i: at for i, at in before.items() if i not in flat(chats(agents))}
    assert len(gone) == 1, (before, gone)
    for i in ended(agents, gone, within=10).values():
        assert "LEASE_EXPIRED" not in i.message, i.message
    reaches(agents, http, set(counts(agents)))

    # A replica killed outright runs no __del__, and its ResidentModel
    # actor, killed outright with it (as the OOM killer or a lost host
    # would), renews nothing: the lease lapses and the agent stops the
    # model. The actor is frozen before the replica goes, since Ray ends
    # an actor whose owner died either at once or gracefully (as it goes
    # out of scope), and a graceful exit runs its atexit stop first: that
    # once stopped the model cleanly here, and left the lease untested.
    # Serve starts another replica, placed anew.
    [replica] = until(lambda: (lambda r: r if len(r) == 1 else None)(replicas()), "the scaled-down replica gone")
    before = flat(chats(agents))
    handle = ray.get_actor(replica["name"], namespace=replica["namespace"])
    model_pid = resident_model_of(handle)
    os.kill(model_pid, signal.SIGSTOP)
    ray.kill(handle, no_restart=True)
    try:
        os.kill(model_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # Ray killed the frozen orphan first: it ran nothing either way
    for i in ended(agents, before, within=LEASE_MS / 1000 + 15).values():
        assert "LEASE_EXPIRED" in i.message, i.message
    until(lambda: len(flat(chats(agents)).keys() - before.keys()) == 1, "a replacement model", within=60)
    reaches(agents, http, set(counts(agents)))

    # The agent of the model's node dies (its model with it): the replica's
    # health check fails, and Serve's new replica is placed where an agent
    # answers.
    [(dead, _)] = counts(agents).items()
    os.kill(pids[dead], signal.SIGKILL)
    until(lambda: not serves(agents[dead]), f"{dead}'s agent is gone")
    moved = until(lambda: (lambda c: c if len(c) == 1 else None)(counts(agents)), "the model moved", within=90)
    assert dead not in moved, moved
    reaches(agents, http, set(moved))

    # Deleting the app stops its model.
    held = flat(chats(agents))
    serve.delete(APP)
    for i in ended(agents, held, within=20).values():
        assert "LEASE_EXPIRED" not in i.message, i.message
    assert counts(agents) == {}, counts(agents)


def main():
    setup = json.loads(sys.argv[1])
    agents, pids, tmp = setup["agents"], setup["pids"], setup["tmp"]
    # Serve's proxy (on the head) sends every request to replicas on its
    # own node when it has any; off, so that each replica is reached.
    with cluster(agents, tmp, env={"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}) as port:
        try:
            nodes = rray.agents()
            assert sorted(nodes.values()) == sorted(agents.values()), nodes
            name_of = {endpoint: name for name, endpoint in agents.items()}
            http = free_port()
            the_documented_command(agents, name_of, port, http, tmp)
            the_python_api(agents, pids, name_of, http)
            print("serve checks passed")
        except BaseException:
            for path in sorted(glob.glob(os.path.join(tmp, "session_latest", "logs", "serve", "replica_*.log"))):
                with open(path) as f:
                    sys.stderr.write(f"{os.path.basename(path)}:\n" + f.read()[-3000:])
            raise
        finally:
            serve.shutdown()


if __name__ == "__main__":
    main()
