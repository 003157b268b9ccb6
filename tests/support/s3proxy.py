"""A fault-injecting HTTP proxy in front of the local S3 server (moto), on 127.0.0.1.

Tests point boto3 at `proxy.endpoint_url` and then slow down object reads (to interrupt a staging
half way), corrupt the bytes of chosen objects in flight (a bad disk, NIC or middlebox: the ETag
is right, the body is not), and count requests per object (to prove a resume re-fetched nothing).
Everything else is forwarded unchanged.
"""

from __future__ import annotations

import http.client
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

from elasticyolo.local_cluster.servers import free_port

_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade"}


@dataclass
class S3FaultProxy:
    upstream_port: int
    port: int = field(default_factory=free_port)
    get_delay_s: float = 0.0  # added to every object GET
    corrupt: dict[str, int] = field(default_factory=dict)  # object key -> GETs to corrupt (-1: all)
    gets: Counter = field(default_factory=Counter)  # object key -> GETs served (incl. ranged)
    in_flight: int = 0  # requests being forwarded now (a killed client's last ones included)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "S3FaultProxy":
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                with proxy._lock:
                    proxy.in_flight += 1
                try:
                    self._forward_counted()
                finally:
                    with proxy._lock:
                        proxy.in_flight -= 1

            def _forward_counted(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=120)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                key = _object_key(self.path)
                if self.command == "GET" and key is not None and resp.status in (200, 206):
                    with proxy._lock:
                        proxy.gets[key] += 1
                        left = proxy.corrupt.get(key, 0)
                        if left > 0:
                            proxy.corrupt[key] = left - 1
                    if proxy.get_delay_s:
                        threading.Event().wait(proxy.get_delay_s)
                    if left and data:
                        mid = len(data) // 2
                        data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> "S3FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _object_key(path: str) -> str | None:
    """`/bucket/key?query` (path-style, as boto3 uses for an IP endpoint) -> key."""
    parts = urlsplit(path)
    segments = parts.path.lstrip("/").split("/", 1)
    if len(segments) < 2 or not segments[1]:
        return None
    return unquote(segments[1])
