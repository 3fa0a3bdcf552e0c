"""A small HTTP proxy in front of the S3 server that injects what real object stores do:
503 SlowDown throttling on a share of requests, and 403 InvalidAccessKeyId for a bad key; it
also counts the requests that arrive while the server behind it is down, and records every
request's method, path and User-Agent."""

from __future__ import annotations

import http.client
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message></Error>')
BAD_KEY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code>'
           b'<Message>The AWS Access Key Id you provided does not exist in our records.</Message></Error>')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FaultyProxy:
    def __init__(self, upstream_port: int, fail_every: int = 0, bad_key: str | None = None):
        self.upstream_port, self.fail_every, self.bad_key = upstream_port, fail_every, bad_key
        self.requests = self.injected = 0
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request
        self.agents: list[str] = []  # and its User-Agent (which client sent it)
        self.unreachable = 0  # requests that arrived while the upstream server was down
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.1 answers botocore's "Expect: 100-continue" at once; under HTTP/1.0 every request
            # with a body waited out botocore's 1 s expect timeout before sending it
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.lock:
                    proxy.requests += 1
                    proxy.seen.append((self.command, self.path))
                    proxy.agents.append(self.headers.get("User-Agent", ""))
                    n = proxy.requests
                if proxy.bad_key and f"Credential={proxy.bad_key}/" in self.headers.get("Authorization", ""):
                    return self._reply(403, BAD_KEY)
                if proxy.fail_every and n % proxy.fail_every == 0:
                    with proxy.lock:
                        proxy.injected += 1
                    return self._reply(503, SLOW_DOWN)
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "expect")}
                headers["Host"] = f"127.0.0.1:{proxy.upstream_port}"
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                except ConnectionRefusedError:  # the server is down: the client sees its connection dropped
                    with proxy.lock:
                        proxy.unreachable += 1
                    self.close_connection = True
                    return
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _reply(self, status, data):
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
