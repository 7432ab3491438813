"""A returning conversation after its model was swapped out (issue #44.2):
the time to its first token with the saved conversation restored
(`keep_kv`) against without, on the real llama-server, through residentd.

For each of the two configurations (the serve trace's m4 model, context
4096, one slot; with `keep_kv = "kv"` and without): start the model,
send a conversation's first turn (about 2,000 tokens of prompt, its answer
computed and cached), stop it (with keep_kv its slot is saved), start it
again (with keep_kv the slot is restored before READY), and send the
conversation's next turn (the same prefix and 40 words more), timing its
first token from the request, READY already. Each round is a new
conversation; the two configurations take turns. Also reported: the
prompt tokens the server computed for the returning turn
(`timings.prompt_n`), and the start's own time.

Usage: restore.py --llama-bin DIR --residentd BIN --work DIR [--rounds N]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402  (the trace's models and prompts)

import residentd  # noqa: E402


def config(work, llama_bin, model):
    """Two workloads of `model`: `kept` (keep_kv) and `cold` (nothing kept)."""
    sock = work / "agent" / "residentd.sock"
    text = (f'[node]\nname = "restore"\nlisten = "unix://{sock}"\nstate_dir = "{work}/agent/state"\n\n'
            f'[[pool]]\nname = "ram"\nbudget = "4GB"\n\n'
            f'[[pool]]\nname = "kv"\nbudget = "2GB"\npath = "{work}/kv"\n\n')
    for name, kept in (("kept", True), ("cold", False)):
        text += (f'[[workload]]\nname = "{name}"\nflavor = "llama-server"\n'
                 f'program = "{llama_bin}/llama-server"\nmodel = "{model}"\nctx = 4096\nparallel = 1\n'
                 f'args = ["--cache-ram", "0"]\n' + ('keep_kv = "kv"\n' if kept else '') + '\n')
    return text, sock


def first_token(port, words, seed):
    """Streams one chat completion; (seconds to the first token, prompt_n)."""
    body = json.dumps({"messages": [{"role": "user", "content": serve.prompt_of({"seed": seed, "words": words})}],
                       "max_tokens": 4, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    sent = time.monotonic()
    ttft, prompt_n = None, None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.monotonic() - sent
            if chunk.get("timings"):
                prompt_n = chunk["timings"].get("prompt_n")
    return ttft, prompt_n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--llama-bin", required=True)
    p.add_argument("--residentd", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "agent").mkdir(mode=0o700, exist_ok=True)
    models = dict(serve.make_models(work, args.python, False))
    text, sock = config(work, args.llama_bin, models["m4"])
    (work / "residentd.toml").write_text(text)
    agent = subprocess.Popen([args.residentd, "--config", str(work / "residentd.toml")],
                             stdout=subprocess.DEVNULL, stderr=open(work / "agent.log", "w"))
    got = {"kept": [], "cold": []}
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with residentd.Agent(str(sock)) as a:
            for n in range(args.rounds):
                for name in ("kept", "cold"):
                    seed = 1000 + n
                    words = 860  # about 2,000 tokens
                    i = a.start(name, name, wait_ready=True).instance
                    first, _ = first_token(i.port, words, seed)
                    a.stop(name)
                    began = time.monotonic()
                    i = a.start(name, name, wait_ready=True).instance
                    started = time.monotonic() - began
                    ttft, prompt_n = first_token(i.port, words + 40, seed)
                    a.stop(name)
                    got[name].append({"first_turn": first, "start": started, "ttft": ttft, "prompt_n": prompt_n})
    finally:
        agent.terminate()
        agent.wait(timeout=60)
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("first_turn", "start", "ttft", "prompt_n")}
           for k, v in got.items()}
    print(f"returning 2,000-token conversation after a stop and a start, median of {args.rounds} (model m4):")
    for k, label in (("kept", "restored (keep_kv)"), ("cold", "not kept")):
        m = med[k]
        print(f"  {label:<20} first token {m['ttft'] * 1000:7.0f} ms, prompt tokens computed {m['prompt_n']:5.0f}, "
              f"the start {m['start'] * 1000:5.0f} ms, the first turn {m['first_turn'] * 1000:5.0f} ms")
    ratio = med["kept"]["ttft"] / med["cold"]["ttft"]
    with_start = (med["kept"]["ttft"] + med["kept"]["start"]) / (med["cold"]["ttft"] + med["cold"]["start"])
    print(f"  restored vs not: {ratio:.2f}x (target <= 0.2x); with the start counted: {with_start:.2f}x")
    print(json.dumps({"median": med, "rounds": got}))


if __name__ == "__main__":
    main()
