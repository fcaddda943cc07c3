"""A reward server that misbehaves on cue, for tests/test_served_reward.py: it serves `brightness` (each image's mean
pixel) at any path, and answers its n-th request (counted from 1) as the n-th entry of a script says, then "ok":

    python tests/fault_server.py PORT ok,ok,slow,drop,503,short,nan,500,text,exit

  ok      {"scores": [...]}             slow   the same, after 3 s          drop   closes the connection unanswered
  503     HTTP 503, then nothing        500    HTTP 500 {"error": ...}      short  one score fewer than images
  nan     a NaN among the scores        text   an HTML page, status 200     exit   the process dies unanswered
  trickle its headers, then the scores a byte a second                     302    a redirect to /elsewhere
  html500 HTTP 500 with a framework's HTML error page
A GET of /elsewhere answers {"scores": [...]} of 0.5s (what a redirect followed as a GET would train on); any other GET
answers {"rewards": ["/brightness"]} (tools/reward_server.py's readiness answer).

PORT 0 takes a free one. The first line printed is "serving PORT". Nothing but the standard library, numpy and Pillow.
"""
import base64
import io
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image


def brightness(data_urls: list[str]) -> list[float]:
    """Each image's mean value in [0, 1], from its 8-bit PNG (numpy, float64)."""
    return [float(np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"),
                             dtype=np.float64).mean() / 255) for url in data_urls]


def main() -> None:
    port, script = int(sys.argv[1]), sys.argv[2].split(",") if len(sys.argv) > 2 else []
    count, lock = [0], threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def send(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            with lock:
                count[0] += 1
                cue = script[count[0] - 1] if count[0] <= len(script) else "ok"
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            scores = brightness(request["images"])
            if cue == "exit":
                os._exit(1)
            if cue == "drop":
                self.close_connection = True
                self.connection.close()
                return
            if cue == "slow":
                time.sleep(3)
            if cue in ("503", "500"):
                return self.send(int(cue), json.dumps({"error": f"cue {cue}"}).encode())
            if cue == "text":
                return self.send(200, b"<html>not scores</html>", "text/html")
            if cue == "302":
                self.send_response(302)
                self.send_header("Location", "/elsewhere")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if cue == "html500":
                page = (b"<!doctype html>\n<html><head><title>500 Internal Server Error</title></head><body>"
                        b"<h1>Internal Server Error</h1><p>The server encountered an internal error.</p></body></html>")
                return self.send(500, page, "text/html")
            if cue == "trickle":
                body = json.dumps({"scores": scores}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for byte in body:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(1)
                return
            scores = scores[:-1] if cue == "short" else [float("nan"), *scores[1:]] if cue == "nan" else scores
            self.send(200, json.dumps({"scores": scores}).encode())

        def do_GET(self):
            if self.path == "/elsewhere":
                return self.send(200, json.dumps({"scores": [0.5] * 64}).encode())
            self.send(200, json.dumps({"rewards": ["/brightness"]}).encode())

        def log_message(self, format, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"serving {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
