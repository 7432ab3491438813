"""A server whose output the takeover tests follow: `talker.py PORT`.

GET /health answers 200. GET /say/N prints N numbered lines of about 200
bytes to stdout (`said 000001 xxxx...`, numbered on from the last one) and
one line to stderr, then answers 200 with the last number. Standard
library only, unbuffered output, so every line is written when said.
"""

import http.server
import sys

said = 0


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global said
        if self.path == "/health":
            body = b"ok"
        elif self.path.startswith("/say/"):
            n = int(self.path[len("/say/"):])
            pad = "x" * 180
            for _ in range(n):
                said += 1
                sys.stdout.write(f"said {said:06d} {pad}\n")
            sys.stdout.flush()
            sys.stderr.write(f"told up to {said}\n")
            sys.stderr.flush()
            body = str(said).encode()
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    port = int(sys.argv[1])
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
