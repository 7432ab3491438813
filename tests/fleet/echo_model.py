"""A stand-in model server for tests/fleet/serve_check.py: answers every
POST with the node it runs on, its port and what it was asked, so a check
can tell which node's agent holds the model a request reached.
`GET /health` is its readiness probe.

Usage: echo_model.py PORT NODE
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, NODE = int(sys.argv[1]), sys.argv[2]


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
        if self.path == "/health":
            self.reply(200, {"status": "ok"})
        else:
            self.reply(404, {"error": "no such path"})

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        asked = json.loads(self.rfile.read(length) or b"{}")
        self.reply(200, {"node": NODE, "port": PORT, "path": self.path, "asked": asked})


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
