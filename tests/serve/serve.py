"""A multi-model trace, replayed side by side against the systems a user
would run (issue #44): (a) residentd + residentd-router, (b) llama.cpp's own
router mode (`llama-server --models-dir --models-max K`), (c) residentd
with one model at a time (a swap group, what llama-swap does by default),
and (d) residentd + residentd-router without `--max-busy` (what the limit
is worth). residentd's router runs with `--max-busy 1` (`--max-busy N`):
every server computes on the same 2 cores, and two at once slow each
other down. The same real llama-server build, the same models, the same
memory.

The trace is seeded: conversations of several turns, their prompts of
1,000 to 2,000 tokens coming back after other models ran, Zipf popularity
over the models, bursts. The replayer sends it with the `openai` client,
streaming, at the trace's times, and records per request the time to the
first token, whether it failed, and the prompt tokens the server computed
(`timings.prompt_n`). Beside it a sampler reads every 50 ms the resident
memory of the system's model servers (their processes' RSS, summed) and
the servers it saw start (a load each).

Usage: serve.py --llama-bin DIR --residentd BIN --router BIN --work DIR
    [--small | --light] [--seed N] [--systems a,b,c,d] [--max-busy N]
    [--json OUT]

`--light`: the same models under a load 2 cores can serve (16
conversations, turns 20 to 45 s apart), where latency, not throughput
under overload, is what the table ranks.

Prints a table per system and, with --json, writes the figures. Exits 1
when a hard rule broke in any system that must keep it (a failed request;
residentd's measured peak over its budget).
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORDS = "the a of and to in is it you that he was for on are with as his they be at one have this from".split()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def make_models(work, python, small):
    """Four test models of growing size, with a context of 4096."""
    sizes = [("m1", 256, 4), ("m2", 512, 6), ("m3", 768, 8), ("m4", 1024, 8)]
    if small:
        sizes = [("m1", 128, 2), ("m2", 256, 2), ("m3", 256, 4), ("m4", 384, 4)]
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    out = []
    for name, embd, layers in sizes:
        path = models / f"{name}.gguf"
        if not path.exists():
            subprocess.run(
                [python, str(HERE.parent / "llama" / "make_model.py"), str(path),
                 "--embd", str(embd), "--layers", str(layers), "--ctx", "4096"],
                check=True, stdout=subprocess.DEVNULL)
        out.append((name, path))
    return out


def trace(seed, models, small, light=False):
    """The requests, each (at, conversation, turn, model, messages-so-far
    length in words): conversations arrive in bursts, pick a model by Zipf
    popularity, and come back after other models ran."""
    rng = random.Random(seed)
    names = [m for m, _ in models]
    popular = names[:]
    rng.shuffle(popular)
    weights = [1.0 / (k + 1) ** 1.1 for k in range(len(popular))]
    conversations = 6 if small else 16 if light else 48
    turns = (2, 3) if small else (2, 4)
    gap = (3.0, 8.0) if small else (20.0, 45.0) if light else (8.0, 30.0)
    out = []
    t = 0.0
    for c in range(conversations):
        # Bursts: a few conversations arrive together, then a pause.
        t += 0.2 if rng.random() < 0.5 else rng.uniform(1.0, 4.0)
        model = rng.choices(popular, weights)[0]
        first = rng.randint(430, 870)  # about 1,000 to 2,000 tokens
        at = t
        for turn in range(rng.randint(*turns)):
            words = first + 40 * turn
            out.append({"at": round(at, 3), "conversation": c, "turn": turn,
                        "model": model, "words": words, "seed": c})
            at += rng.uniform(*gap)
    out.sort(key=lambda r: r["at"])
    return out


def prompt_of(request):
    """The conversation's text up to this turn: the same prefix at every
    turn, a little more each time."""
    seed = request["seed"]
    return " ".join(WORDS[(i * 7 + seed * 11) % len(WORDS)] for i in range(request["words"]))


class Sampler(threading.Thread):
    """Every 50 ms: the model servers of a system (the processes under
    `root` whose command is llama-server), their summed RSS, and each new
    pid (a load)."""

    def __init__(self, root_pids):
        super().__init__(daemon=True)
        self.root_pids = root_pids
        self.peak = 0
        self.pids = set()
        self.stop_flag = False

    def servers(self):
        children = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
        seen, todo = [], list(self.root_pids())
        while todo:
            p = todo.pop()
            for c in children.get(p, []):
                todo.append(c)
                seen.append(c)
        out = []
        for p in seen:
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")[0]
                if cmd.endswith(b"llama-server"):
                    with open(f"/proc/{p}/statm") as f:
                        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                    out.append((p, rss))
            except OSError:
                continue
        return out

    def run(self):
        while not self.stop_flag:
            found = self.servers()
            # A router-mode parent is a llama-server too: only its children
            # hold models.
            total = sum(rss for _, rss in found)
            self.peak = max(self.peak, total)
            self.pids.update(p for p, _ in found)
            time.sleep(0.05)


def replay(base, requests, timeout):
    """Sends `requests` at their times, streaming, with the openai client;
    returns one record per request."""
    import openai
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=timeout)
    records = []
    lock = threading.Lock()
    start = time.monotonic()

    def one(r):
        wait = r["at"] - (time.monotonic() - start)
        if wait > 0:
            time.sleep(wait)
        sent = time.monotonic()
        rec = {"conversation": r["conversation"], "turn": r["turn"], "model": r["model"],
               "at": r["at"], "sent": round(sent - start, 3),
               "ttft": None, "done": None, "failed": None, "prompt_n": None}
        try:
            stream = client.chat.completions.create(
                model=r["model"], stream=True, max_tokens=4,
                messages=[{"role": "user", "content": prompt_of(r)}])
            for chunk in stream:
                # Answered by the model it asked for (router mode names
                # the model's file, residentd its workload).
                said = getattr(chunk, "model", None) or ""
                if said and r["model"] not in said:
                    rec["failed"] = f"answered by {said!r}, not {r['model']!r}"
                # The first token: the first chunk with a choice (a random
                # test model may generate a byte token that is no text yet).
                choices = getattr(chunk, "choices", None) or []
                if rec["ttft"] is None and choices:
                    rec["ttft"] = time.monotonic() - sent
                extra = getattr(chunk, "model_extra", None) or {}
                if "timings" in extra and extra["timings"]:
                    rec["prompt_n"] = extra["timings"].get("prompt_n")
            rec["done"] = time.monotonic() - sent
            if rec["ttft"] is None and not rec["failed"]:
                rec["failed"] = "the stream ended without a chunk"
        except Exception as e:  # a failed request, whatever the cause
            rec["failed"] = f"{type(e).__name__}: {e}"[:300]
        with lock:
            records.append(rec)

    threads = [threading.Thread(target=one, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.monotonic() - start


def wait_http(url, within=60):
    import urllib.request
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.1)
    return False


def residentd_config(work, models, llama_bin, budget, cache_mib, swap):
    sock = work / "agent" / "residentd.sock"
    text = (f'[node]\nname = "serve"\nlisten = "unix://{sock}"\nstate_dir = "{work}/agent/state"\n'
            f'on_full = "evict"\nsample_every = "200ms"\n\n'
            f'[[pool]]\nname = "ram"\nbudget = "{budget}"\n\n'
            f'[[pool]]\nname = "kv"\nbudget = "2GB"\npath = "{work}/kv"\n\n')
    if swap:
        members = ", ".join(f'"{m}"' for m, _ in models)
        text += f'[[group]]\nname = "one"\nmembers = [{members}]\nswap = true\n\n'
    for name, path in models:
        text += (f'[[workload]]\nname = "{name}"\nflavor = "llama-server"\n'
                 f'program = "{llama_bin}/llama-server"\nmodel = "{path}"\nctx = 4096\nparallel = 1\n'
                 f'keep_kv = "kv"\nargs = ["--cache-ram", "{cache_mib}"]\n\n')
    return text, sock


def reservations(residentd, config):
    """What residentd reserves for each workload, from --check-config."""
    out = subprocess.run([residentd, "--check-config", str(config)], capture_output=True, text=True)
    found = {}
    name = None
    for line in out.stdout.splitlines():
        s = line.strip()
        if line.startswith("  ") and not line.startswith("    ") and ":" in s:
            name = s.split(":", 1)[0]
        if s.startswith("memory ram: reserves") and name:
            found[name] = float(s.split("reserves", 1)[1].split("MB", 1)[0]) * 1e6
    if not found:
        raise SystemExit(f"no reservations in --check-config's answer: {out.stdout}{out.stderr}")
    return found


def run_residentd(args, work, models, budget_bytes, swap, requests, max_busy):
    work.mkdir(parents=True, exist_ok=True)
    (work / "agent").mkdir(mode=0o700, exist_ok=True)
    text, sock = residentd_config(work, models, args.llama_bin, budget_bytes, args.cache_mib, swap)
    config = work / "residentd.toml"
    config.write_text(text)
    agent = subprocess.Popen([args.residentd, "--config", str(config)],
                             stdout=subprocess.DEVNULL, stderr=open(work / "agent.log", "w"))
    port = free_port()
    router = subprocess.Popen(
        [args.router, "--agent", str(sock), "--listen", f"127.0.0.1:{port}", "--queue-timeout", "600s",
         "--max-busy", str(max_busy)],
        stdout=subprocess.DEVNULL, stderr=open(work / "router.log", "w"))
    return measured("residentd-router", port, agent, [router, agent], requests)


def run_router_mode(args, work, models, max_models, requests):
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = subprocess.Popen(
        [f"{args.llama_bin}/llama-server", "--models-dir", str(models[0][1].parent),
         "--models-max", str(max_models), "--host", "127.0.0.1", "--port", str(port),
         "-c", "4096", "-np", "1", "--cache-ram", str(args.cache_mib), "--no-repack"],
        stdout=subprocess.DEVNULL, stderr=open(work / "router-mode.log", "w"))
    return measured("llama-server router mode", port, server, [server], requests)


def measured(what, port, root, processes, requests):
    """Replays `requests` against the OpenAI API on `port` once it answers,
    sampling the model servers under `root`; then stops `processes` (in
    order, each with SIGTERM, waited for). Returns the records, the total
    time and the sampler."""
    try:
        if not wait_http(f"http://127.0.0.1:{port}/health"):
            raise SystemExit(f"{what} did not answer")
        sampler = Sampler(lambda: [root.pid])
        sampler.start()
        records, total = replay(f"http://127.0.0.1:{port}/v1", requests, 600)
        sampler.stop_flag = True
        sampler.join()
        return records, total, sampler
    finally:
        for p in processes:
            p.send_signal(signal.SIGTERM)
        for p in processes:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def quantile(values, q):
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


def summary(name, records, total, sampler, budget):
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]
    computed = [r["prompt_n"] for r in records if r["prompt_n"] is not None]
    return {
        "system": name,
        "requests": len(records),
        "failed": sum(1 for r in records if r["failed"]),
        "failures": [r["failed"] for r in records if r["failed"]][:5],
        "ttft_p50": quantile(ttft, 0.5),
        "ttft_p95": quantile(ttft, 0.95),
        "ttft_p99": quantile(ttft, 0.99),
        "total_s": total,
        "loads": len(sampler.pids),
        "prompt_tokens_computed": sum(computed) if computed else None,
        "peak_rss": sampler.peak,
        "budget": budget,
        "records": sorted(records, key=lambda r: r["at"]),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--llama-bin", required=True)
    p.add_argument("--residentd", required=True)
    p.add_argument("--router", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--small", action="store_true")
    # The full-size models under a load 2 cores can serve: 16
    # conversations, turns 20 to 45 s apart.
    p.add_argument("--light", action="store_true")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--systems", default="a,b,c,d")
    p.add_argument("--cache-mib", type=int, default=64)
    # The router's --max-busy: requests forwarded at once, all models
    # together. Every server here computes on the same 2 cores with as many
    # threads as there are cores, so two at once slow each other down.
    p.add_argument("--max-busy", type=int, default=1)
    p.add_argument("--json")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    models = make_models(work, args.python, args.small)
    requests = trace(args.seed, models, args.small, args.light)
    # The budget holds about half the models: the two largest reservations
    # and a little.
    probe = work / "probe"
    probe.mkdir(exist_ok=True)
    (probe / "agent").mkdir(mode=0o700, exist_ok=True)
    text, _ = residentd_config(probe, models, args.llama_bin, 10**12, args.cache_mib, False)
    (probe / "c.toml").write_text(text)
    reserved = reservations(args.residentd, probe / "c.toml")
    sizes = sorted(reserved.values(), reverse=True)
    budget = int(sizes[0] + sizes[1] + sizes[-1] / 2)
    fit = 2
    print(f"trace: {len(requests)} requests, {len(set(r['conversation'] for r in requests))} conversations, "
          f"models {', '.join(f'{m} {reserved[m] / 1e6:.0f} MB' for m, _ in models)}; budget {budget / 1e6:.0f} MB "
          f"(holds {fit}: router mode --models-max {fit})", flush=True)
    results = []
    wanted = args.systems.split(",")
    if "a" in wanted:
        recs, total, s = run_residentd(args, work / "a", models, budget, False, requests, args.max_busy)
        results.append(summary("residentd + router", recs, total, s, budget))
    if "b" in wanted:
        recs, total, s = run_router_mode(args, work / "b", models, fit, requests)
        results.append(summary("llama-server router mode", recs, total, s, budget))
    if "c" in wanted:
        recs, total, s = run_residentd(args, work / "c", models, budget, True, requests, args.max_busy)
        results.append(summary("residentd, one at a time", recs, total, s, budget))
    if "d" in wanted:
        # (a) without --max-busy: what the limit is worth.
        recs, total, s = run_residentd(args, work / "d", models, budget, False, requests, 0)
        results.append(summary("residentd + router, no max-busy", recs, total, s, budget))
    fmt = "{:<32} {:>8} {:>8} {:>8} {:>8} {:>7} {:>6} {:>9} {:>14}"
    print(fmt.format("system", "ttft p50", "p95", "p99", "total s", "failed", "loads", "computed", "peak / budget"))
    for r in results:
        def f(x):
            return "-" if x is None else f"{x:.2f}"
        print(fmt.format(r["system"], f(r["ttft_p50"]), f(r["ttft_p95"]), f(r["ttft_p99"]), f(r["total_s"]),
                         r["failed"], r["loads"], r["prompt_tokens_computed"] or "-",
                         f"{r['peak_rss'] / 1e6:.0f}/{r['budget'] / 1e6:.0f} MB"))
        for why in r["failures"]:
            print(f"  failed: {why}")
    if args.json:
        Path(args.json).write_text(json.dumps({"requests": len(requests), "budget": budget, "results": results}, indent=1))
    broken = [r for r in results if r["failed"] or (r["system"].startswith("residentd") and r["peak_rss"] > r["budget"])]
    if any(r["system"].startswith("residentd") for r in broken):
        sys.exit(1)


if __name__ == "__main__":
    main()
