"""A real local cloud metadata server on 127.0.0.1 speaking AWS IMDSv2, GCP and Azure IMDS.

Tests point `--metadata-url` / make_watcher(metadata_url=...) at it and drive it:

    with MetadataServer() as md:
        md.announce("aws", action="terminate", in_s=120)
        md.fail_next(3, status=503); md.delay_next(2, seconds=1.0); md.expire_tokens()
        md.request_log, md.acknowledged

As a process (to drive an agent in another process):
    python -m elasticyolo.local_cluster.metadata_server --port 0   # prints "METADATA_SERVER_URL http://127.0.0.1:P"
and control it over HTTP with MetadataServerClient(url) (same methods), or MetadataServerProcess().
Control endpoints: POST /_control/{announce,clear,fail,delay,expire_tokens}, GET /_control/{log,acks,health}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator
from urllib.parse import parse_qs, urlsplit

from elasticyolo.spot.notice import format_iso8601, format_rfc1123

HOST = "127.0.0.1"  # loopback only, always
AWS_ACTIONS = ("terminate", "stop", "hibernate")
AZURE_EVENT_TYPES = ("Preempt", "Terminate", "Reboot", "Redeploy", "Freeze")
PROVIDERS = ("aws", "gcp", "azure")
GCP_MAINTENANCE = ("MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")


@dataclass
class _Fault:
    remaining: int
    path_prefix: str | None
    status: int = 0
    delay_s: float = 0.0

    def matches(self, path: str) -> bool:
        return self.remaining > 0 and (self.path_prefix is None or path.startswith(self.path_prefix))


class _State:
    """Everything the server knows, behind one condition (GCP long-polls wait on it)."""

    def __init__(self, azure_vm_name: str, providers: tuple[str, ...]) -> None:
        self.providers = providers
        self.cond = threading.Condition()
        self.closing = False
        self.azure_vm_name = azure_vm_name
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.aws_action: dict[str, str] | None = None
        self.aws_rebalance: dict[str, str] | None = None
        self.gcp: dict[str, str] = {"preempted": "FALSE", "maintenance-event": "NONE"}
        self.gcp_version: dict[str, int] = {"preempted": 1, "maintenance-event": 1}
        self.azure_events: list[dict[str, Any]] = []
        self.azure_incarnation = 1
        self.acknowledged: list[str] = []
        self.faults: list[_Fault] = []
        self.log: list[dict[str, Any]] = []
        # What each API states as the simulated VM's type (the price table's key).
        self.instance_type = {"aws": "p3.2xlarge", "gcp": "n1-standard-8", "azure": "Standard_NC6s_v3"}

    def gcp_etag(self, key: str) -> str:
        return f"{key}-{self.gcp_version[key]}"

    def set_gcp(self, key: str, value: str) -> None:
        if self.gcp[key] != value:
            self.gcp[key] = value
            self.gcp_version[key] += 1
            self.cond.notify_all()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client killed mid-request (a SIGKILLed agent, as chaos runs do) is not a server error.
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


class MetadataServer:
    """In-process server: http.server in a daemon thread, bound to 127.0.0.1 on a free port."""

    def __init__(self, port: int = 0, azure_vm_name: str = "elasticyolo-test-vm",
                 providers: tuple[str, ...] = PROVIDERS) -> None:
        """providers: which APIs it speaks (others answer 404), e.g. ("gcp",) to test `auto`."""
        self.state = _State(azure_vm_name, providers)
        self._port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> "MetadataServer":
        handler = type("Handler", (_Handler,), {"state": self.state, "server_obj": self})
        self._httpd = _QuietServer((HOST, self._port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="metadata-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.state.cond:
            self.state.closing = True
            self.state.cond.notify_all()  # release long-polls
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "MetadataServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- controls ------------------------------------------------------------------------------
    def announce(self, provider: str, action: str | None = None, in_s: float | None = None,
                 resource: str | None = None) -> dict[str, Any]:
        """Start announcing a notice. aws: action terminate|stop|hibernate (time = now + in_s,
        default 120) or "rebalance". gcp: "preempt" (default) or a maintenance value
        ("maintenance" = TERMINATE_ON_HOST_MAINTENANCE). azure: an EventType (default Preempt),
        NotBefore = now + in_s (default 30), for `resource` (default the simulated VM). Returns what it set."""
        st, now = self.state, time.time()
        with st.cond:
            if provider == "aws":
                action = action or "terminate"
                if action == "rebalance":
                    st.aws_rebalance = {"noticeTime": format_iso8601(now)}
                    return dict(st.aws_rebalance)
                if action not in AWS_ACTIONS:
                    raise ValueError(f"aws action {action!r}: one of {AWS_ACTIONS + ('rebalance',)}")
                st.aws_action = {"action": action, "time": format_iso8601(now + (120.0 if in_s is None else in_s))}
                return dict(st.aws_action)
            if provider == "gcp":
                action = action or "preempt"
                if action == "preempt":
                    st.set_gcp("preempted", "TRUE")
                    return {"preempted": "TRUE"}
                value = "TERMINATE_ON_HOST_MAINTENANCE" if action == "maintenance" else action
                if value not in GCP_MAINTENANCE:
                    raise ValueError(f"gcp action {action!r}: preempt, maintenance or one of {GCP_MAINTENANCE}")
                st.set_gcp("maintenance-event", value)
                return {"maintenance-event": value}
            if provider == "azure":
                action = action or "Preempt"
                if action not in AZURE_EVENT_TYPES:
                    raise ValueError(f"azure event type {action!r}: one of {AZURE_EVENT_TYPES}")
                event = {
                    "EventId": str(uuid.uuid4()).upper(),
                    "EventType": action,
                    "ResourceType": "VirtualMachine",
                    "Resources": [resource or st.azure_vm_name],
                    "EventStatus": "Scheduled",
                    "NotBefore": format_rfc1123(now + (30.0 if in_s is None else in_s)),
                    "Description": f"test {action}",
                    "EventSource": "Platform",
                    "DurationInSeconds": -1 if action in ("Preempt", "Terminate") else 15,
                }
                st.azure_events.append(event)
                st.azure_incarnation += 1
                return dict(event)
        raise ValueError(f"provider {provider!r}: aws, gcp or azure")

    def clear(self, provider: str | None = None) -> None:
        """Withdraw notices (all providers, or one)."""
        st = self.state
        with st.cond:
            if provider in (None, "aws"):
                st.aws_action = st.aws_rebalance = None
            if provider in (None, "gcp"):
                st.set_gcp("preempted", "FALSE")
                st.set_gcp("maintenance-event", "NONE")
            if provider in (None, "azure"):
                if st.azure_events:
                    st.azure_events = []
                    st.azure_incarnation += 1

    def fail_next(self, n: int, status: int = 503, path_prefix: str | None = None) -> None:
        """The next n metadata requests (optionally only under path_prefix) answer `status`."""
        with self.state.cond:
            self.state.faults.append(_Fault(n, path_prefix, status=status))

    def delay_next(self, n: int, seconds: float, path_prefix: str | None = None) -> None:
        """The next n metadata requests wait `seconds` before answering (client timeouts)."""
        with self.state.cond:
            self.state.faults.append(_Fault(n, path_prefix, delay_s=seconds))

    def expire_tokens(self) -> None:
        """Invalidate every IMDSv2 token issued so far (the next GET with one gets 401)."""
        with self.state.cond:
            self.state.tokens.clear()

    @property
    def request_log(self) -> list[dict[str, Any]]:
        """Metadata requests served (not control ones): method, path, status, t (epoch s)."""
        with self.state.cond:
            return [dict(e) for e in self.state.log]

    @property
    def acknowledged(self) -> list[str]:
        """Azure EventIds acknowledged through POST StartRequests."""
        with self.state.cond:
            return list(self.state.acknowledged)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the real services
    state: _State
    server_obj: MetadataServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet under tests
        pass

    # -- plumbing ------------------------------------------------------------------------------
    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n > 0 else b""

    def _send(self, status: int, body: str | bytes | dict[str, Any] | list[Any] = b"",
              ctype: str = "text/plain", headers: dict[str, str] | None = None) -> None:
        if isinstance(body, (dict, list)):
            body, ctype = json.dumps(body), "application/json"
        data = body.encode() if isinstance(body, str) else body
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout test): nothing to do
        if not self.path.startswith("/_control"):
            with self.state.cond:
                self.state.log.append({"t": time.time(), "method": self.command, "path": self.path, "status": status})

    def _fault(self, path: str) -> bool:
        """Apply the oldest matching injected fault (one per request). True when it answered."""
        delay, status = 0.0, 0
        with self.state.cond:
            for f in self.state.faults:
                if f.matches(path):
                    delay, status, f.remaining = f.delay_s, f.status, f.remaining - 1
                    break
            self.state.faults = [f for f in self.state.faults if f.remaining > 0]
        if delay:
            time.sleep(delay)
        if status:
            self._send(status, f"injected {status}\n")
            return True
        return False

    def _route(self) -> None:
        body = self._body()
        split = urlsplit(self.path)
        path, query = split.path, parse_qs(split.query)
        if path.startswith("/_control/"):
            return self._control(path[len("/_control/"):], body)
        if self._fault(path):
            return
        speaks = self.state.providers
        if path.startswith("/latest/") and "aws" in speaks:
            return self._aws(path)
        if path.startswith("/computeMetadata/") and "gcp" in speaks:
            return self._gcp(path, query)
        if path.startswith("/metadata/") and "azure" in speaks:
            return self._azure(path, query, body)
        self._send(404, "not found\n")

    do_GET = do_PUT = do_POST = _route  # noqa: N815

    # -- AWS IMDSv2 ----------------------------------------------------------------------------
    def _aws(self, path: str) -> None:
        st = self.state
        if path == "/latest/api/token":
            if self.command != "PUT":
                return self._send(405, "token needs PUT\n")
            try:
                ttl = int(self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
            except ValueError:
                return self._send(400, "missing or bad X-aws-ec2-metadata-token-ttl-seconds\n")
            if not 1 <= ttl <= 21600:
                return self._send(400, "ttl out of range\n")
            token = secrets.token_urlsafe(32)
            with st.cond:
                st.tokens[token] = time.monotonic() + ttl
            return self._send(200, token, headers={"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})
        token = self.headers.get("X-aws-ec2-metadata-token", "")
        with st.cond:
            expiry = st.tokens.get(token)
            valid = expiry is not None and expiry > time.monotonic()
            action, rebalance = st.aws_action, st.aws_rebalance
        if not valid:  # IMDSv2-required mode: no or bad token is 401
            return self._send(401, "unauthorized\n")
        if path == "/latest/meta-data/spot/instance-action":
            return self._send(200, action) if action else self._send(404, "not found\n")
        if path == "/latest/meta-data/events/recommendations/rebalance":
            return self._send(200, rebalance) if rebalance else self._send(404, "not found\n")
        if path == "/latest/meta-data/instance-id":
            return self._send(200, "i-0123456789abcdef0")
        if path == "/latest/meta-data/instance-type":
            return self._send(200, st.instance_type["aws"])
        self._send(404, "not found\n")

    # -- GCP -----------------------------------------------------------------------------------
    def _gcp(self, path: str, query: dict[str, list[str]]) -> None:
        hdr = {"Metadata-Flavor": "Google"}
        if self.headers.get("Metadata-Flavor") != "Google":
            return self._send(403, "Missing Metadata-Flavor:Google header.\n", headers=hdr)
        key = path.removeprefix("/computeMetadata/v1/instance/")
        if path in ("/computeMetadata/v1/instance/name", "/computeMetadata/v1/instance/id"):
            return self._send(200, "elasticyolo-test-vm" if key == "name" else "1234567890", headers=hdr)
        if key == "machine-type":
            return self._send(200, f"projects/1234567890/machineTypes/{self.state.instance_type['gcp']}", headers=hdr)
        if key not in ("preempted", "maintenance-event"):
            return self._send(404, "not found\n", headers=hdr)
        st = self.state
        with st.cond:
            if query.get("wait_for_change", ["false"])[0].lower() == "true":
                last = query.get("last_etag", [st.gcp_etag(key)])[0]
                timeout = min(float(query.get("timeout_sec", ["60"])[0]), 300.0)
                end = time.monotonic() + timeout
                while st.gcp_etag(key) == last and not st.closing and (left := end - time.monotonic()) > 0:
                    st.cond.wait(left)
            value, etag = st.gcp[key], st.gcp_etag(key)
        self._send(200, value, headers={**hdr, "ETag": etag})

    # -- Azure ---------------------------------------------------------------------------------
    def _azure(self, path: str, query: dict[str, list[str]], body: bytes) -> None:
        if self.headers.get("Metadata", "").lower() != "true":
            return self._send(400, {"error": "Bad request. Required metadata header not specified"})
        if "api-version" not in query:
            return self._send(400, {"error": "Bad request. api-version was not specified"})
        st = self.state
        if path == "/metadata/instance/compute/name":
            return self._send(200, st.azure_vm_name)
        if path == "/metadata/instance/compute/vmSize":
            return self._send(200, st.instance_type["azure"])
        if path == "/metadata/instance":
            return self._send(200, {"compute": {"name": st.azure_vm_name, "vmId": "00000000-0000-0000-0000-000000000000",
                                                "location": "local"}})
        if path != "/metadata/scheduledevents":
            return self._send(404, {"error": "Not found"})
        with st.cond:
            if self.command == "POST":
                try:
                    ids = [r["EventId"] for r in json.loads(body or b"{}").get("StartRequests", [])]
                except (ValueError, KeyError, TypeError, AttributeError):
                    return self._send(400, {"error": "Bad request body"})
                for ev in st.azure_events:
                    if ev["EventId"] in ids:
                        ev["EventStatus"], ev["NotBefore"] = "Started", ""
                st.acknowledged += ids
                st.azure_incarnation += 1
                return self._send(200, b"")
            doc = {"DocumentIncarnation": st.azure_incarnation, "Events": [dict(e) for e in st.azure_events]}
        self._send(200, doc)

    # -- control -------------------------------------------------------------------------------
    def _control(self, op: str, body: bytes) -> None:
        srv = self.server_obj
        try:
            args = json.loads(body) if body else {}
            if op == "health":
                return self._send(200, {"ok": True})
            if op == "log":
                return self._send(200, srv.request_log)
            if op == "acks":
                return self._send(200, srv.acknowledged)
            if self.command != "POST":
                return self._send(405, {"error": "POST required"})
            if op == "announce":
                return self._send(200, srv.announce(**args))
            if op == "clear":
                srv.clear(**args)
            elif op == "fail":
                srv.fail_next(**args)
            elif op == "delay":
                srv.delay_next(**args)
            elif op == "expire_tokens":
                srv.expire_tokens()
            else:
                return self._send(404, {"error": f"unknown control {op!r}"})
            return self._send(200, {"ok": True})
        except (TypeError, ValueError) as exc:
            return self._send(400, {"error": str(exc)})


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Within this block any TCP connect to a non-loopback address raises: a test guard that the
    real metadata addresses (169.254.169.254, metadata.google.internal) are never contacted."""
    original = socket.socket.connect

    def guarded(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            if host not in ("127.0.0.1", "::1", "localhost"):
                raise AssertionError(f"test tried to connect to {address!r}: only 127.0.0.1 is allowed")
        original(sock, address)

    socket.socket.connect = guarded  # type: ignore[method-assign]
    try:
        yield
    finally:
        socket.socket.connect = original  # type: ignore[method-assign]


class MetadataServerClient:
    """Drive a metadata server in another process over its control endpoints."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _call(self, op: str, payload: dict[str, Any] | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(f"{self.url}/_control/{op}", data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
        # No proxies: this is loopback.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    def announce(self, provider: str, action: str | None = None, in_s: float | None = None,
                 resource: str | None = None) -> dict[str, Any]:
        args = {k: v for k, v in {"provider": provider, "action": action, "in_s": in_s, "resource": resource}.items()
                if v is not None}
        return dict(self._call("announce", args))

    def clear(self, provider: str | None = None) -> None:
        self._call("clear", {} if provider is None else {"provider": provider})

    def fail_next(self, n: int, status: int = 503, path_prefix: str | None = None) -> None:
        self._call("fail", {"n": n, "status": status, "path_prefix": path_prefix})

    def delay_next(self, n: int, seconds: float, path_prefix: str | None = None) -> None:
        self._call("delay", {"n": n, "seconds": seconds, "path_prefix": path_prefix})

    def expire_tokens(self) -> None:
        self._call("expire_tokens", {})

    @property
    def request_log(self) -> list[dict[str, Any]]:
        return list(self._call("log"))

    @property
    def acknowledged(self) -> list[str]:
        return list(self._call("acks"))


class MetadataServerProcess(MetadataServerClient):
    """Run the server as a child process (`python -m elasticyolo.local_cluster.metadata_server`)."""

    def __init__(self, port: int = 0, providers: tuple[str, ...] = PROVIDERS) -> None:
        super().__init__("")
        self.port = port
        self.providers = providers
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 15.0) -> "MetadataServerProcess":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elasticyolo.local_cluster.metadata_server", "--port", str(self.port),
             "--providers", ",".join(self.providers)],
            stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = ""
        end = time.monotonic() + timeout
        while not line.startswith("METADATA_SERVER_URL ") and time.monotonic() < end:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"metadata server exited with {self.proc.returncode}")
        if not line.startswith("METADATA_SERVER_URL "):
            self.stop()
            raise TimeoutError("metadata server did not start")
        self.url = line.split()[1]
        self.port = int(self.url.rsplit(":", 1)[1])
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "MetadataServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Local cloud metadata server (AWS/GCP/Azure) on 127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="port (0 = a free one; the URL is printed)")
    ap.add_argument("--azure-vm-name", default="elasticyolo-test-vm")
    ap.add_argument("--providers", default=",".join(PROVIDERS), help="APIs to speak (comma-separated)")
    args = ap.parse_args(argv)
    providers = tuple(p for p in args.providers.split(",") if p)
    if unknown := set(providers) - set(PROVIDERS):
        ap.error(f"unknown providers {sorted(unknown)}")
    server = MetadataServer(args.port, azure_vm_name=args.azure_vm_name, providers=providers).start()
    print(f"METADATA_SERVER_URL {server.url}", flush=True)
    stop = threading.Event()
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
