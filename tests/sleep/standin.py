"""A stand-in for a vLLM server in sleep mode, for the agent's sleep tests.

Follows vLLM's documented sleep API (served with VLLM_SERVER_DEV_MODE=1):
`POST /sleep?level=1|2` gives its model memory back, `POST /wake_up`
takes it again, `GET /is_sleeping` says which, `GET /health` answers 200
awake or asleep. The memory is real: MB megabytes touched page by page at
start and at each wake, freed at each sleep (a large bytearray is its own
mapping, so freeing it returns it to the kernel).

Usage: standin.py PORT MB [--fail-sleep] [--fail-wake] [--hang-wake] [--slow-sleep]
    [--slow-wake] [--slow-load]

--slow-sleep: the sleep call frees the model at once, then takes a second
before it answers (a request meanwhile finds it asleep).
--slow-wake: the wake call takes its memory back, then takes a second
before it answers.
--slow-load: it loads for 3 s before it listens (not ready meanwhile).
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = int(sys.argv[1])
MB = int(sys.argv[2])
FLAGS = set(sys.argv[3:])
PAGE = 4096


def allocate():
    block = bytearray(MB * 1024 * 1024)
    for i in range(0, len(block), PAGE):
        block[i] = 1
    return block


state = {"model": allocate(), "sleeping": False, "level": 0}
if "--slow-load" in FLAGS:
    import time
    time.sleep(3)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, fmt, *args):
        print("standin: " + fmt % args, flush=True)

    def answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.answer(200, {})
        elif self.path == "/is_sleeping":
            self.answer(200, {"is_sleeping": state["sleeping"]})
        else:
            self.answer(404, {"error": "not found"})

    def do_POST(self):
        if self.path.startswith("/sleep"):
            if "--fail-sleep" in FLAGS:
                self.answer(500, {"error": "sleep failed"})
                return
            if state["sleeping"]:
                # As vLLM does: asleep already, the call is done.
                self.answer(200, {})
                return
            state["model"] = None
            state["sleeping"] = True
            state["level"] = 2 if "level=2" in self.path else 1
            if "--slow-sleep" in FLAGS:
                import time
                time.sleep(1)
            print("standin: asleep", flush=True)
            self.answer(200, {})
        elif self.path == "/wake_up":
            if "--fail-wake" in FLAGS:
                self.answer(500, {"error": "wake failed"})
                return
            if "--hang-wake" in FLAGS:
                import time
                time.sleep(3600)
            if not state["sleeping"]:
                # As vLLM does: awake already, the call is done.
                self.answer(200, {})
                return
            state["model"] = allocate()
            state["sleeping"] = False
            if "--slow-wake" in FLAGS:
                import time
                time.sleep(1)
            print("standin: awake", flush=True)
            self.answer(200, {})
        elif self.path in ("/v1/completions", "/v1/chat/completions"):
            length = int(self.headers.get("Content-Length", "0"))
            self.rfile.read(length)
            if state["sleeping"]:
                # vLLM asleep has no weights to run: a request fails.
                self.answer(503, {"error": {"message": "the model is asleep"}})
            else:
                self.answer(200, {"id": "standin-1", "object": "chat.completion", "created": 0,
                                  "model": "standin",
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "awake"}}]})
        else:
            self.answer(404, {"error": "not found"})


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
