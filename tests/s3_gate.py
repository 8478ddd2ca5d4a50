"""An HTTP proxy on the loopback address in front of an S3-protocol server that can hold a
request whose path matches, so a test can kill a process at a known phase of a save."""
from __future__ import annotations

import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class S3Gate:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.arrived = threading.Event()  # a held request came in
        self._open = threading.Event()
        self._open.set()
        self._pattern: re.Pattern | None = None
        self._methods: tuple[str, ...] = ()
        self.held: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="s3-gate", daemon=True).start()

    def hold(self, pattern: str, methods: tuple[str, ...] = ("PUT", "POST")) -> None:
        """Hold the requests (of `methods`: writes) whose path matches `pattern` until `release`."""
        self.arrived.clear()
        self._methods = methods
        self._pattern = re.compile(pattern)
        self._open.clear()

    def release(self) -> None:
        self._pattern = None
        self._open.set()

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        gate = self

        class Forward(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                body = self._body()
                pattern = gate._pattern
                if pattern is not None and self.command in gate._methods and pattern.search(self.path):
                    gate.held.append(f"{self.command} {self.path}")
                    gate.arrived.set()
                    gate._open.wait(120)
                upstream = http.client.HTTPConnection("127.0.0.1", gate.upstream_port, timeout=120)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                    if body is not None:
                        headers["Content-Length"] = str(len(body))
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    reply = upstream.getresponse()
                    data = reply.read()
                finally:
                    upstream.close()
                self.send_response(reply.status, reply.reason)
                head = self.command == "HEAD"  # its Content-Length is the object's size
                for key, value in reply.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection") and (head or key.lower() != "content-length"):
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def _body(self) -> bytes | None:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                        if size == 0:
                            return b"".join(parts)
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else None

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Forward
