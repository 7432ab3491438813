"""A model server that answers slowly on purpose, for the router tests that
need a request to stay in flight for as long as the test says: a streamed
chat completion sends one chunk every 50 ms, `max_tokens` chunks in all.
It prints `client went away after N chunks` when its client hangs up, and
`served N chunks` when a stream ends whole.

Usage: slow_server.py PORT [--slow-load SECONDS]

--slow-load: it loads for that long before it listens (not ready
meanwhile), as a large model does.
"""

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": "slow", "object": "model"}]})
        elif self.path == "/":
            self.reply(200, {"root": "slow"})
        else:
            self.reply(404, {"error": {"message": "no such path", "type": "not_found"}})

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        request = json.loads(self.rfile.read(length) or b"{}")
        n = int(request.get("max_tokens") or 4)
        if not request.get("stream"):
            self.reply(200, {"id": "slow-1", "object": "chat.completion", "created": 0,
                             "model": request.get("model", "slow"),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "ok"}}]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = 0
        try:
            for i in range(n):
                last = i == n - 1
                chunk = {"id": "slow-1", "object": "chat.completion.chunk", "created": 0,
                         "model": "slow",
                         "choices": [{"index": 0, "delta": {"content": f"t{i} "},
                                      "finish_reason": "length" if last else None}]}
                self.chunk(f"data: {json.dumps(chunk)}\n\n".encode())
                sent += 1
                if not last:
                    time.sleep(0.05)
            self.chunk(b"data: [DONE]\n\n")
            self.chunk(b"")
            print(f"served {sent} chunks", flush=True)
        except (BrokenPipeError, ConnectionResetError):
            print(f"client went away after {sent} chunks", flush=True)

    def chunk(self, data):
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


if __name__ == "__main__":
    if "--slow-load" in sys.argv:
        time.sleep(float(sys.argv[sys.argv.index("--slow-load") + 1]))
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
