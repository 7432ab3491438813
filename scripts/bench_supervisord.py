#!/usr/bin/env python3
"""supervisord's side of the benchmark (scripts/bench): the same jobs the
Rust harness runs against residentd, done by supervisord 4.3 over its
XML-RPC on a Unix socket. Prints one JSON object.

    bench_supervisord.py startstop N ROUNDS   start N sleeps to RUNNING, stop all
    bench_supervisord.py crash ROUNDS         kill -9 a child, poll until reported
    bench_supervisord.py idle N SECONDS       CPU and peak RSS with N idle children
"""

import json
import os
import signal
import statistics
import subprocess
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


def start_supervisord(n, autorestart="false"):
    d = tempfile.mkdtemp(prefix="bench-supervisord-")
    sock = os.path.join(d, "s.sock")
    conf = os.path.join(d, "supervisord.conf")
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
""")
    exe = os.path.join(os.path.dirname(sys.executable), "supervisord")
    proc = subprocess.Popen([exe, "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def until_all(rpc, state):
    """Polls until every process is in `state`. Polling, not wait=True:
    supervisord answers a waiting call from its main loop's tick, up to a
    second late, which would be unfair to it."""
    while not all(i["statename"] == state for i in rpc.supervisor.getAllProcessInfo()):
        pass


def startstop(n, rounds):
    proc, rpc = start_supervisord(n)
    starts, stops = [], []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            rpc.supervisor.startAllProcesses(False)
            until_all(rpc, "RUNNING")
            starts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            rpc.supervisor.stopAllProcesses(False)
            until_all(rpc, "STOPPED")
            stops.append(time.perf_counter() - t0)
    finally:
        stop_supervisord(proc, rpc)
    return {"start_s": statistics.median(starts), "stop_s": statistics.median(stops)}


def crash(rounds):
    proc, rpc = start_supervisord(1)
    took = []
    try:
        for _ in range(rounds):
            rpc.supervisor.startProcess("s:s_0", True)
            pid = rpc.supervisor.getProcessInfo("s:s_0")["pid"]
            t0 = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            while rpc.supervisor.getProcessInfo("s:s_0")["statename"] == "RUNNING":
                pass
            took.append(time.perf_counter() - t0)
    finally:
        stop_supervisord(proc, rpc)
    return {"median_s": statistics.median(took)}


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
        rpc.supervisor.startAllProcesses(False)
        until_all(rpc, "RUNNING")
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
    else:
        sys.exit(f"unknown job {job!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
