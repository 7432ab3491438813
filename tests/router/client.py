"""The caller of the router tests: the `openai` client from PyPI, with its
default options, as an application would use it. Each subcommand prints one
JSON object on stdout for the Rust test to judge.

Usage:
  client.py chat BASE MODEL [--stream] [--max-tokens N]
  client.py storm BASE A B [--n 8]
  client.py disconnect BASE MODEL
  client.py models BASE
"""

import argparse
import json
import sys
import threading
import time
import urllib.request

import openai


def client(base):
    # No key is needed by the router; the client insists on one.
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)


def failure(e):
    if isinstance(e, openai.APIStatusError):
        return {"ok": False, "status": e.status_code, "body": e.body,
                "retry_after": e.response.headers.get("retry-after")}
    return {"ok": False, "status": None, "error": f"{type(e).__name__}: {e}"}


def chat(base, model, stream, max_tokens):
    """One chat completion; streamed ones are read chunk by chunk."""
    c = client(base)
    messages = [{"role": "user", "content": "hello"}]
    began = time.monotonic()
    try:
        if not stream:
            r = c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
            return {"ok": True, "text": r.choices[0].message.content,
                    "finish_reason": r.choices[0].finish_reason, "chunks": 1,
                    "began": began, "ended": time.monotonic()}
        chunks, text, finish = 0, "", None
        first = None
        for chunk in c.chat.completions.create(model=model, messages=messages,
                                               max_tokens=max_tokens, stream=True):
            if first is None:
                first = time.monotonic()
            chunks += 1
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return {"ok": True, "text": text, "finish_reason": finish, "chunks": chunks,
                "began": began, "first": first, "ended": time.monotonic()}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return failure(e)


def in_flight(base, model):
    """The router's count of requests in flight holding `model`."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("residentd_router_in_flight{") and f'model="{model}"' in line:
                return int(float(line.rsplit(" ", 1)[1]))
    return 0


def storm(base, a, b, n):
    """n streamed requests to a; once the router holds all n, one to b."""
    results = [None] * n

    def stream(i):
        results[i] = chat(base, a, True, 200)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    held = 0
    while time.monotonic() < deadline:
        held = in_flight(base, a)
        if held == n or all(r is not None for r in results):
            break
        time.sleep(0.005)
    b_result = chat(base, b, False, 8)
    for t in threads:
        t.join()
    return {"held_when_b_was_sent": held, "streams": results, "b": b_result}


def disconnect(base, model):
    """Reads one chunk of a long stream, then hangs up."""
    c = client(base)
    s = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                  max_tokens=100000, stream=True)
    first = next(iter(s))
    s.close()
    return {"ok": True, "first_id": first.id, "closed": time.monotonic()}


def models(base):
    c = client(base)
    listed = c.models.list()
    return {"ok": True, "models": [m.model_dump() for m in listed.data]}


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    ch = sub.add_parser("chat")
    ch.add_argument("base")
    ch.add_argument("model")
    ch.add_argument("--stream", action="store_true")
    ch.add_argument("--max-tokens", type=int, default=8)
    st = sub.add_parser("storm")
    st.add_argument("base")
    st.add_argument("a")
    st.add_argument("b")
    st.add_argument("--n", type=int, default=8)
    dc = sub.add_parser("disconnect")
    dc.add_argument("base")
    dc.add_argument("model")
    ml = sub.add_parser("models")
    ml.add_argument("base")
    args = p.parse_args()
    if args.cmd == "chat":
        out = chat(args.base, args.model, args.stream, args.max_tokens)
    elif args.cmd == "storm":
        out = storm(args.base, args.a, args.b, args.n)
    elif args.cmd == "disconnect":
        out = disconnect(args.base, args.model)
    else:
        out = models(args.base)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
