#!/usr/bin/env python3
"""supervisord's side of the benchmark (scripts/bench): the same jobs the
Rust harness runs against residentd, done by supervisord 4.3 over its
XML-RPC on a Unix socket. Prints one JSON object.

    bench_supervisord.py startstop N ROUNDS   start N sleeps to RUNNING, stop all
    bench_supervisord.py crash ROUNDS         kill -9 a child until its event arrives
    bench_supervisord.py idle N SECONDS       CPU and peak RSS with N idle children
    bench_supervisord.py listen SOCKET        (run by supervisord) the event listener

Every wait for a state is pushed, as residentd's are (a Watch stream): an
[eventlistener] of supervisord's own (this script, `listen`) takes its
PROCESS_STATE_RUNNING, _STOPPED and _EXITED events and forwards each, as
one datagram, to the driver's Unix socket, which times the arrival.
Nothing polls, so the driver takes no CPU from supervisord on the shared
cores while it waits.
"""

import json
import os
import signal
import statistics
import subprocess
import shutil
import sys
import tempfile
import time
import xmlrpc.client
import http.client
import socket


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost")
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


class UnixTransport(xmlrpc.client.Transport):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def make_connection(self, host):
        return UnixHTTPConnection(self.path)


# supervisord's event buffer holds 10 events unless told; a start of 100
# makes 100, and a dropped one would hang the wait. The listener takes only
# the states waited for: supervisord hands a listener one event at a time,
# each a turn of its loop and back, so STARTING and STOPPING would double
# what a start or a stop of 100 waits on.
EVENT_BUFFER = 4096
# The bound on every wait for pushed events: far above any figure measured,
# so reaching it means an event was lost, not that supervisord was slow.
PATIENCE_S = 60.0


def start_supervisord(n, autorestart="false", events=None):
    """supervisord with `n` sleeps (not started), and with `events` (an
    `Events`) its event listener too."""
    d = tempfile.mkdtemp(prefix="bench-supervisord-")
    sock = os.path.join(d, "s.sock")
    conf = os.path.join(d, "supervisord.conf")
    listener = ""
    if events is not None:
        listener = f"""[eventlistener:events]
command={sys.executable} {os.path.abspath(__file__)} listen {events.path}
events=PROCESS_STATE_RUNNING,PROCESS_STATE_STOPPED,PROCESS_STATE_EXITED
buffer_size={EVENT_BUFFER}
stderr_logfile={d}/listener.log
"""
    with open(conf, "w") as f:
        f.write(f"""[unix_http_server]
file={sock}
[supervisord]
logfile={d}/supervisord.log
pidfile={d}/supervisord.pid
nodaemon=true
loglevel=warn
[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
[program:s]
command=/bin/sleep 3600
process_name=%(program_name)s_%(process_num)d
numprocs={n}
autostart=false
autorestart={autorestart}
startsecs=0
stopwaitsecs=10
stdout_logfile=NONE
stderr_logfile=NONE
{listener}""")
    exe = os.path.join(os.path.dirname(sys.executable), "supervisord")
    proc = subprocess.Popen([exe, "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Removed with supervisord (`stop_supervisord`).
    proc.bench_dir = d
    rpc = xmlrpc.client.ServerProxy("http://localhost", transport=UnixTransport(sock))
    deadline = time.monotonic() + 30
    while True:
        try:
            rpc.supervisor.getState()
            break
        except (OSError, xmlrpc.client.Fault):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    return proc, rpc


def stop_supervisord(proc, rpc):
    try:
        rpc.supervisor.stopAllProcesses(True)
    except Exception:
        pass
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    shutil.rmtree(proc.bench_dir, ignore_errors=True)


class Events:
    """The driver's end of the event listener: a Unix datagram socket the
    listener sends each event to, as it gets it."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="bench-supervisord-events-")
        self.path = os.path.join(self.dir, "events.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)

    def close(self):
        self.sock.close()
        os.unlink(self.path)
        os.rmdir(self.dir)

    def next(self, deadline):
        """(arrival, state, process name) of the next event of the
        benchmark's program (the listener's own events are skipped)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no supervisord event within {PATIENCE_S} s")
            self.sock.settimeout(left)
            data = self.sock.recv(4096)
            at = time.perf_counter()
            state, group, name = data.decode().split()
            if group == "s":
                return at, state, name

    def until(self, names, state):
        """Blocks until each of `names` has had a `state` event; the
        arrival of the last."""
        waiting = set(names)
        deadline = time.monotonic() + PATIENCE_S
        while waiting:
            at, got, name = self.next(deadline)
            if got == state:
                waiting.discard(name)
        return at


def listen(path):
    """The [eventlistener] (supervisord's protocol: READY, a header line,
    the payload, RESULT): forwards each event as "STATE GROUP NAME" to the
    driver's socket before acknowledging it."""
    from supervisor import childutils

    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    while True:
        headers, payload = childutils.listener.wait(sys.stdin, sys.stdout)
        fields = childutils.get_headers(payload.split("\n", 1)[0])
        state = headers["eventname"].removeprefix("PROCESS_STATE_")
        out.sendto(f"{state} {fields['groupname']} {fields['processname']}".encode(), path)
        childutils.listener.ok(sys.stdout)


def startstop(n, rounds):
    events = Events()
    proc, rpc = start_supervisord(n, events=events)
    names = [f"s_{i}" for i in range(n)]
    starts, stops = [], []
    try:
        # An untimed round first: the listener's own start is not timed.
        rpc.supervisor.startProcessGroup("s", False)
        events.until(names, "RUNNING")
        rpc.supervisor.stopProcessGroup("s", False)
        events.until(names, "STOPPED")
        for _ in range(rounds):
            t0 = time.perf_counter()
            # The program's group, not all: the listener is a process too.
            rpc.supervisor.startProcessGroup("s", False)
            starts.append(events.until(names, "RUNNING") - t0)
            t0 = time.perf_counter()
            rpc.supervisor.stopProcessGroup("s", False)
            stops.append(events.until(names, "STOPPED") - t0)
    finally:
        stop_supervisord(proc, rpc)
        events.close()
    return {"start_s": statistics.median(starts), "stop_s": statistics.median(stops)}


def crash(rounds):
    events = Events()
    proc, rpc = start_supervisord(1, events=events)
    took = []
    try:
        for _ in range(rounds):
            # Untimed; the first also waits out the listener's own start.
            rpc.supervisor.startProcess("s:s_0", False)
            events.until(["s_0"], "RUNNING")
            pid = rpc.supervisor.getProcessInfo("s:s_0")["pid"]
            t0 = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            took.append(events.until(["s_0"], "EXITED") - t0)
    finally:
        stop_supervisord(proc, rpc)
        events.close()
    # Every round too: supervisord's figure has modes (see crash's note in
    # docs/benchmarks.md), which a median alone hides.
    return {"median_s": statistics.median(took), "rounds_s": sorted(took)}


def cpu_ns(pid):
    """CPU time of every live thread of pid, in nanoseconds."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def peak_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def idle(n, seconds):
    proc, rpc = start_supervisord(n)
    try:
        # Waits for every start (no listener here: the window measures
        # supervisord alone).
        rpc.supervisor.startAllProcesses(True)
        # The same window as residentd's: after a pause, peak reset.
        time.sleep(11)
        with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
            f.write("5")
        c0 = cpu_ns(proc.pid)
        time.sleep(seconds)
        c1 = cpu_ns(proc.pid)
        rss = peak_rss(proc.pid)
    finally:
        stop_supervisord(proc, rpc)
    return {"cpu_fraction": (c1 - c0) / (seconds * 1e9), "peak_rss_bytes": rss}


def main():
    job = sys.argv[1]
    if job == "startstop":
        out = startstop(int(sys.argv[2]), int(sys.argv[3]))
    elif job == "crash":
        out = crash(int(sys.argv[2]))
    elif job == "idle":
        out = idle(int(sys.argv[2]), float(sys.argv[3]))
    elif job == "listen":
        return listen(sys.argv[2])
    else:
        sys.exit(f"unknown job {job!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
