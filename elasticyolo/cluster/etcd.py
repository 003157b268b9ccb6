"""The one etcd v3 client elasticyolo uses: a thin wrapper over `etcd3gw` (etcd's HTTP/JSON gateway).

Why a wrapper: etcd3gw talks to one endpoint, base64-encodes keys and values, sends int64 as
strings, omits `succeeded` when a txn fails, and has no auth. This module hides all of that and
adds what a spot cluster needs:

* several endpoints with failover (a dead member is skipped; the working one stays sticky),
* tenacity retries on transient errors (connection refused/reset, timeouts, 5xx such as
  "leader changed" during an etcd election) within a bounded retry window,
* TLS (CA, client cert/key) and user/password auth (token refreshed when etcd expires it),
* one-line `UnavailableError` naming the endpoints when none answers.

Requires etcd >= 3.4 (the `/v3/` gateway path; fixed here to skip a discovery round trip).
Traffic goes only to the endpoints given.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import requests
from etcd3gw.client import _EXCEPTIONS_BY_CODE, Etcd3Client
from etcd3gw import exceptions as gw_exc
from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from elasticyolo.cluster.tls import may_hide_a_refusal, probe_refusal, tls_refusal
from elasticyolo.errors import UnavailableError, UserError

API_PATH = "/v3/"


class EtcdError(UserError):
    """etcd answered, but refused the request (permission denied, bad request, ...). A UserError:
    the CLI prints it as one line; the agent logs it and retries."""


class LeaseNotFoundError(EtcdError):
    """The lease expired or was revoked."""


class _Transient(Exception):
    """Internal: this endpoint failed in a way that another endpoint or a retry may fix."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int  # 0: none


@dataclass(frozen=True)
class WatchEvent:
    type: str  # "PUT" or "DELETE"
    key: str
    value: bytes  # b"" for DELETE
    mod_revision: int
    lease: int = 0


def _b64(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode("utf-8")
    return base64.b64encode(data).decode("ascii")


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def prefix_range_end(prefix: str | bytes) -> bytes:
    """The etcd range end that covers every key starting with `prefix`."""
    raw = bytearray(prefix.encode("utf-8") if isinstance(prefix, str) else prefix)
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"  # whole keyspace
    raw[-1] += 1
    return bytes(raw)


def parse_endpoints(endpoints: str | Sequence[str], tls: bool) -> list[tuple[str, str, int]]:
    """`host:port,host:port` or URLs -> [(protocol, host, port)]. Raises UserError when malformed."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out: list[tuple[str, str, int]] = []
    for raw in (i.strip() for i in items):
        if not raw:
            continue
        protocol = "https" if tls else "http"
        rest = raw
        if "://" in raw:
            protocol, _, rest = raw.partition("://")
            if protocol not in ("http", "https"):
                raise UserError(f"etcd endpoint {raw!r}: scheme must be http or https")
        rest = rest.rstrip("/")
        host, sep, port_s = rest.rpartition(":")
        if not sep:
            host, port_s = rest, "2379"
        host = host.strip("[]")
        try:
            port = int(port_s)
        except ValueError:
            raise UserError(f"etcd endpoint {raw!r}: port {port_s!r} is not a number") from None
        if not host or not 0 < port < 65536:
            raise UserError(f"etcd endpoint {raw!r}: expected host:port")
        out.append((protocol, host, port))
    if not out:
        raise UserError("no etcd endpoints given (use --etcd host:port[,host:port...])")
    return out


class EtcdClient:
    """etcd v3 over several endpoints. Thread-safe; one instance per process is plenty."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        ca_cert: str | None = None,
        cert_cert: str | None = None,
        cert_key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout: float = 5.0,
        retry_window: float | None = None,
    ) -> None:
        """`timeout`: seconds per HTTP request. `retry_window`: how long one call keeps retrying
        transient failures over all endpoints (default 2*timeout+1, enough to ride out an etcd
        leader election) before it raises UnavailableError."""
        self._tls = bool(ca_cert or cert_cert)
        self._targets = parse_endpoints(endpoints, self._tls)
        self.endpoints = [f"{p}://{h}:{port}" for p, h, port in self._targets]
        self.timeout = timeout
        self.retry_window = 2 * timeout + 1 if retry_window is None else retry_window
        self._tls_args = {"ca_cert": ca_cert, "cert_cert": cert_cert, "cert_key": cert_key}
        self._user, self._password = user, password
        self._clients = [self._make_client(t) for t in self._targets]
        self._current = 0
        self._lock = threading.Lock()
        self._token: str | None = None
        self._closed = False

    # ---- plumbing -----------------------------------------------------------------------
    def _make_client(self, target: tuple[str, str, int]) -> Etcd3Client:
        protocol, host, port = target
        return Etcd3Client(host=host, port=port, protocol=protocol, timeout=self.timeout,
                           api_path=API_PATH, **self._tls_args)  # type: ignore[arg-type]

    def tls_request_args(self) -> dict[str, Any]:
        # Passed on every request: requests lets REQUESTS_CA_BUNDLE override a session's `verify`,
        # which would reject etcd's private CA.
        if not self._tls:
            return {}
        ca, cert, key = self._tls_args["ca_cert"], self._tls_args["cert_cert"], self._tls_args["cert_key"]
        return {"verify": ca or True, "cert": (cert, key) if cert and key else None}

    def _authenticate(self, client: Etcd3Client) -> None:
        if self._user is None:
            return
        try:
            result = self._post(client, "/auth/authenticate",
                                {"name": self._user, "password": self._password or ""}, None)
        except gw_exc.Etcd3Exception as exc:
            if isinstance(exc, (gw_exc.ConnectionFailedError, gw_exc.ConnectionTimeoutError,
                                gw_exc.InternalServerError)):
                raise _Transient(str(exc)) from exc
            raise UserError(f"etcd: authentication as {self._user!r} failed: {_detail(exc)}") from None
        self._token = result["token"]
        for c in self._clients:
            c.session.headers["Authorization"] = self._token

    def _post(self, client: Etcd3Client, path: str, payload: dict[str, Any], timeout: float | None) -> Any:
        # etcd3gw's Etcd3Client.post with a per-call timeout (keepalives must not hang a TTL long).
        try:
            resp = client.session.post(client.get_url(path), json=payload, timeout=timeout or self.timeout,
                                       **self.tls_request_args())
        except requests.exceptions.Timeout as ex:
            raise gw_exc.ConnectionTimeoutError(str(ex)) from ex
        except requests.exceptions.SSLError as ex:
            ca, cert, key = self._tls_args["ca_cert"], self._tls_args["cert_cert"], self._tls_args["cert_key"]
            where = f"etcd {client.get_url('').rstrip('/').removesuffix(API_PATH.rstrip('/'))}"
            refusal = tls_refusal(ex, where, has_cert=bool(cert))
            if refusal is None and may_hide_a_refusal(ex):
                verdict = probe_refusal(client.host, int(client.port), ca, cert, key, timeout=min(self.timeout, 3.0))
                refusal = tls_refusal(verdict, where, has_cert=bool(cert)) if verdict is not None else None
            if refusal is not None:
                raise refusal from None  # a certificate problem: no retry or failover fixes it
            raise gw_exc.ConnectionFailedError(str(ex)) from ex
        except requests.exceptions.ConnectionError as ex:
            raise gw_exc.ConnectionFailedError(str(ex)) from ex
        if resp.status_code in _EXCEPTIONS_BY_CODE:
            raise _EXCEPTIONS_BY_CODE[resp.status_code](resp.text, resp.reason)
        if resp.status_code != requests.codes["ok"]:
            raise gw_exc.Etcd3Exception(resp.text, resp.reason)
        return resp.json()

    def _call_once(self, path: str, payload: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        with self._lock:
            index = self._current
        client = self._clients[index]
        try:
            if self._user is not None and self._token is None:
                self._authenticate(client)
            try:
                return self._post(client, path, payload, timeout)  # type: ignore[no-any-return]
            except gw_exc.Etcd3Exception as exc:
                if self._user is not None and _is_auth_expired(exc):
                    self._authenticate(client)  # tokens expire (--auth-token-ttl); get a new one
                    return self._post(client, path, payload, timeout)  # type: ignore[no-any-return]
                raise
        except (gw_exc.ConnectionFailedError, gw_exc.ConnectionTimeoutError,
                gw_exc.InternalServerError, requests.RequestException, _Transient) as exc:
            self._rotate(index, exc)
            raise _Transient(f"{self.endpoints[index]}: {_detail(exc)}") from exc
        except gw_exc.Etcd3Exception as exc:
            text = _detail(exc)
            if _is_transient_text(text):
                self._rotate(index, exc)
                raise _Transient(f"{self.endpoints[index]}: {text}") from exc
            if "lease not found" in text:
                raise LeaseNotFoundError(text) from None
            if "user name is empty" in text:
                raise EtcdError("etcd: authentication is on and no user is configured: set etcd_user and its "
                                "password (etcd_password_file, or the etcd-password credential)") from None
            if "permission denied" in text:
                raise EtcdError(f"etcd {path}: permission denied for user {self._user!r}: its role must allow "
                                "readwrite on /elasticyolo/ (deploy/etcd/setup-auth.sh)") from None
            raise EtcdError(f"etcd {path}: {text}") from None

    def _rotate(self, failed_index: int, exc: BaseException) -> None:
        # Move past the endpoint that failed (unless another thread already did).
        with self._lock:
            if self._current == failed_index and len(self._clients) > 1:
                self._current = (failed_index + 1) % len(self._clients)
                _log().debug("etcd endpoint failed; trying next", failed=self.endpoints[failed_index],
                          next=self.endpoints[self._current], error=_detail(exc))

    def call(self, path: str, payload: dict[str, Any], retry_window: float | None = None,
             timeout: float | None = None) -> dict[str, Any]:
        """POST one gateway request (path like "/kv/range"), with failover and retries.
        `timeout` (per HTTP request) and `retry_window` override the client's defaults."""
        if self._closed:
            raise EtcdError("etcd client is closed")
        window = self.retry_window if retry_window is None else retry_window
        retrying = Retrying(
            retry=retry_if_exception_type(_Transient),
            stop=stop_after_delay(window),
            wait=wait_exponential(multiplier=0.05, max=0.5),
            reraise=False,
        )
        try:
            for attempt in retrying:
                with attempt:
                    return self._call_once(path, payload, timeout)
        except RetryError as err:
            last = err.last_attempt.exception()
            raise UnavailableError(
                f"etcd unreachable at {','.join(self.endpoints)} ({last})"
            ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    # ---- key/value ----------------------------------------------------------------------
    def get(self, key: str) -> tuple[bytes, int] | None:
        """(value, mod_revision), or None when the key is absent."""
        kvs = self.call("/kv/range", {"key": _b64(key)}).get("kvs") or []
        if not kvs:
            return None
        return _unb64(kvs[0].get("value")), int(kvs[0]["mod_revision"])

    def get_json(self, key: str) -> dict[str, Any] | None:
        """The JSON object stored at `key`; None when absent or not a JSON object."""
        got = self.get(key)
        if got is None:
            return None
        try:
            value = json.loads(got[0])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def get_prefix(self, prefix: str) -> list[tuple[str, bytes, int]]:
        """[(key, value, mod_revision)] sorted by key."""
        return self.get_prefix_with_revision(prefix)[0]

    def get_prefix_with_revision(self, prefix: str) -> tuple[list[tuple[str, bytes, int]], int]:
        """Like get_prefix, plus the store revision of the read (to start a watch right after)."""
        result = self.call("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix)),
                                         "sort_order": "ASCEND", "sort_target": "KEY"})
        rows = [(_unb64(kv["key"]).decode("utf-8"), _unb64(kv.get("value")), int(kv["mod_revision"]))
                for kv in result.get("kvs") or []]
        return rows, int(result["header"]["revision"])

    def get_prefix_kvs(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under prefix with its metadata (lease, revisions), plus the read revision."""
        result = self.call("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix)),
                                         "sort_order": "ASCEND", "sort_target": "KEY"})
        return [_kv(kv) for kv in result.get("kvs") or []], int(result["header"]["revision"])

    def get_many(self, keys: Sequence[str]) -> dict[str, tuple[bytes, int] | None]:
        """Several keys in one round trip (a read-only txn: one consistent snapshot)."""
        if not keys:
            return {}
        result = self.txn([], [{"request_range": {"key": _b64(k)}} for k in keys], [])
        out: dict[str, tuple[bytes, int] | None] = {}
        for key, resp in zip(keys, result.get("responses") or []):
            kvs = resp.get("response_range", {}).get("kvs") or []
            out[key] = (_unb64(kvs[0].get("value")), int(kvs[0]["mod_revision"])) if kvs else None
        return out

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        """Store `value`; returns the new store revision (= the key's mod_revision)."""
        payload: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            payload["lease"] = str(lease)
        return int(self.call("/kv/put", payload)["header"]["revision"])

    def delete(self, key: str) -> bool:
        """True when the key existed."""
        return int(self.call("/kv/deleterange", {"key": _b64(key)}).get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under prefix; returns how many."""
        result = self.call("/kv/deleterange", {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix))})
        return int(result.get("deleted", 0))

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]]) -> dict[str, Any]:
        """A raw gateway txn (keys/values already base64). `succeeded` is always present."""
        result = self.call("/kv/txn", {"compare": compare, "success": success, "failure": failure})
        result["succeeded"] = bool(result.get("succeeded", False))
        return result

    def compare_and_swap(self, key: str, value: bytes | str, expected_mod_revision: int,
                         lease: int | None = None) -> tuple[bool, tuple[bytes, int] | None]:
        """Put `value` only if the key's mod_revision is `expected_mod_revision` (0: only if absent).

        Returns (succeeded, (value, mod_revision) now stored or None). A retry after an ambiguous
        failure can report False although our own earlier attempt won; callers compare the
        returned value with theirs when that matters.
        """
        bkey = _b64(key)
        if expected_mod_revision == 0:
            cmp = {"key": bkey, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        else:
            cmp = {"key": bkey, "result": "EQUAL", "target": "MOD", "mod_revision": str(expected_mod_revision)}
        put: dict[str, Any] = {"key": bkey, "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        result = self.txn([cmp], [{"request_put": put}], [{"request_range": {"key": bkey}}])
        if result["succeeded"]:
            raw = value.encode("utf-8") if isinstance(value, str) else value
            return True, (raw, int(result["header"]["revision"]))
        kvs = (result.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        if not kvs:
            return False, None
        return False, (_unb64(kvs[0].get("value")), int(kvs[0]["mod_revision"]))

    def delete_if_mod_revision(self, key: str, mod_revision: int) -> bool:
        """Delete the key only if nobody wrote it since `mod_revision` (fenced delete)."""
        bkey = _b64(key)
        cmp = {"key": bkey, "result": "EQUAL", "target": "MOD", "mod_revision": str(mod_revision)}
        return self.txn([cmp], [{"request_delete_range": {"key": bkey}}], [])["succeeded"]

    def revision(self) -> int:
        """The current store revision (read under /elasticyolo/: an etcd role may allow only that)."""
        return int(self.call("/kv/range", {"key": _b64("/elasticyolo/"), "count_only": True})["header"]["revision"])

    # ---- leases -------------------------------------------------------------------------
    def lease_grant(self, ttl: int) -> int:
        result = self.call("/lease/grant", {"TTL": str(int(ttl)), "ID": "0"})
        if result.get("error"):
            raise EtcdError(f"lease grant: {result['error']}")
        return int(result["ID"])

    def lease_refresh(self, lease_id: int, timeout: float | None = None,
                      retry_window: float | None = None) -> int:
        """Keep the lease alive; returns the remaining TTL. Raises LeaseNotFoundError when gone.
        Keepalive loops pass a timeout/retry window well under the TTL."""
        result = self.call("/lease/keepalive", {"ID": str(lease_id)}, retry_window=retry_window, timeout=timeout)
        ttl = int((result.get("result") or {}).get("TTL", 0) or 0)
        if ttl <= 0:
            raise LeaseNotFoundError(f"lease {lease_id:x} expired")
        return ttl

    def lease_revoke(self, lease_id: int) -> bool:
        """Revoke (deletes every key attached). False when it was already gone."""
        try:
            self.call("/kv/lease/revoke", {"ID": str(lease_id)})
            return True
        except LeaseNotFoundError:
            return False

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds left, or -1 when the lease is gone."""
        result = self.call("/kv/lease/timetolive", {"ID": str(lease_id)})
        return int(result.get("TTL", -1))

    def lease_ttls(self, lease_ids: Sequence[int]) -> dict[int, int]:
        """Seconds left for several leases (one request each; status calls it for its rows)."""
        return {lid: self.lease_ttl(lid) for lid in lease_ids}

    def lease_of(self, key: str) -> int:
        """The lease id attached to a key (0: none, or the key is absent)."""
        kvs = self.call("/kv/range", {"key": _b64(key)}).get("kvs") or []
        return int(kvs[0].get("lease", 0)) if kvs else 0

    def get_prefix_leases(self, prefix: str) -> dict[str, int]:
        """key -> lease id for every key under prefix."""
        result = self.call("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix)),
                                         "keys_only": True})
        return {_unb64(kv["key"]).decode("utf-8"): int(kv.get("lease", 0)) for kv in result.get("kvs") or []}

    # ---- watch --------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, start_revision: int | None = None
                     ) -> tuple[Iterator[WatchEvent], Callable[[], None]]:
        """Events for keys under prefix, from `start_revision` (default: now) on.

        The iterator reconnects (next endpoint, from the revision after the last event seen)
        when a stream breaks, so a member dying does not end the watch. It ends after cancel().
        If the start revision was compacted, it resumes at the oldest revision kept: callers
        that must not miss anything re-read the prefix when they see `resynced` events... in
        practice elasticyolo's watchers re-read state on every wake-up, so gaps are harmless.
        """
        stream = _WatchStream(self, prefix, start_revision)
        return stream.events(), stream.cancel

    def watch_session(self, index: int) -> tuple[requests.Session, str]:
        """A fresh session (own connection; streaming must not share the pool) and the watch URL."""
        client = self._clients[index]
        session = requests.Session()
        session.verify = client.session.verify
        session.cert = client.session.cert
        session.headers.update(client.session.headers)
        return session, client.get_url("/watch")

    def current_index(self) -> int:
        with self._lock:
            return self._current

    def close(self) -> None:
        self._closed = True
        for c in self._clients:
            c.session.close()

    def __enter__(self) -> "EtcdClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _WatchStream:
    """One logical watch that survives broken streams by reconnecting from the next revision."""

    def __init__(self, client: EtcdClient, prefix: str, start_revision: int | None) -> None:
        self._client = client
        self._prefix = prefix
        self._next_revision = start_revision
        self._cancelled = threading.Event()
        self._response: requests.Response | None = None
        self._session: requests.Session | None = None
        self._lock = threading.Lock()

    def cancel(self) -> None:
        self._cancelled.set()
        with self._lock:
            resp, session = self._response, self._session
        if resp is not None:
            try:
                resp.raw._fp.fp.raw._sock.shutdown(2)  # unblock a reader stuck in recv()
            except Exception:  # noqa: BLE001 - best effort, the close below also works eventually
                pass
            try:
                resp.close()
            except Exception:  # noqa: BLE001
                pass
        if session is not None:
            session.close()

    def _open(self) -> requests.Response:
        index = self._client.current_index()
        session, url = self._client.watch_session(index)
        create: dict[str, Any] = {"key": _b64(self._prefix), "range_end": _b64(prefix_range_end(self._prefix))}
        if self._next_revision is not None:
            create["start_revision"] = str(self._next_revision)
        try:
            resp = session.post(url, json={"create_request": create}, stream=True,
                                timeout=(self._client.timeout, None), **self._client.tls_request_args())
            resp.raise_for_status()
        except requests.RequestException as exc:
            session.close()
            self._client._rotate(index, exc)
            raise
        with self._lock:
            self._response, self._session = resp, session
        if self._cancelled.is_set():
            self.cancel()
        return resp

    def events(self) -> Iterator[WatchEvent]:
        backoff = 0.05
        while not self._cancelled.is_set():
            try:
                resp = self._open()
                backoff = 0.05
                for line in resp.iter_lines(chunk_size=None):
                    if self._cancelled.is_set():
                        return
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result") or {}
                    if result.get("compact_revision") and result.get("canceled"):
                        # Our start revision was compacted away: resume at the oldest one kept.
                        self._next_revision = int(result["compact_revision"])
                        break
                    for ev in result.get("events") or []:
                        kv = ev.get("kv") or {}
                        rev = int(kv.get("mod_revision", 0))
                        self._next_revision = rev + 1
                        yield WatchEvent(type=ev.get("type", "PUT"),
                                         key=_unb64(kv.get("key")).decode("utf-8"),
                                         value=_unb64(kv.get("value")), mod_revision=rev,
                                         lease=int(kv.get("lease", 0) or 0))
                    if result.get("header", {}).get("revision") and self._next_revision is None:
                        # Pin the resume point at creation so a reconnect misses nothing.
                        self._next_revision = int(result["header"]["revision"]) + 1
            except (requests.RequestException, ValueError, AttributeError, OSError) as exc:
                if self._cancelled.is_set():
                    return
                _log().debug("etcd watch stream broke; reconnecting", prefix=self._prefix, error=str(exc))
            finally:
                with self._lock:
                    resp_, sess = self._response, self._session
                    self._response = self._session = None
                if resp_ is not None:
                    resp_.close()
                if sess is not None:
                    sess.close()
            if self._cancelled.wait(backoff):
                return
            backoff = min(backoff * 2, 1.0)


def _kv(kv: dict[str, Any]) -> KeyValue:
    return KeyValue(key=_unb64(kv["key"]).decode("utf-8"), value=_unb64(kv.get("value")),
                    mod_revision=int(kv.get("mod_revision", 0)), create_revision=int(kv.get("create_revision", 0)),
                    lease=int(kv.get("lease", 0) or 0))


def b64(data: bytes | str) -> str:
    """Base64 as the gateway wants it, for callers that build raw txn() requests."""
    return _b64(data)


def _log() -> Any:
    # Imported lazily: structlog (+rich) costs ~50 ms, and `elasticyolo status` must start fast.
    from elasticyolo.log import get_logger

    return get_logger("elasticyolo.etcd")


def _detail(exc: BaseException) -> str:
    if isinstance(exc, (requests.ConnectionError, gw_exc.ConnectionFailedError)):
        m = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(exc) + str(getattr(exc, "detail_text", "")))
        return m.group(1).strip().lower() if m else "connection failed"
    if isinstance(exc, (requests.Timeout, gw_exc.ConnectionTimeoutError)):
        return "timed out"
    text = getattr(exc, "detail_text", None) or str(exc) or type(exc).__name__
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict) and parsed.get("error"):
            text = str(parsed["error"])
        elif isinstance(parsed, dict) and parsed.get("message"):
            text = str(parsed["message"])
    except (ValueError, TypeError):
        pass
    return " ".join(str(text).split())[:300]


_TRANSIENT_MARKERS = ("leader changed", "no leader", "timed out", "timeout", "unavailable",
                     "too many requests", "connection", "not capable", "stopped")


def _is_transient_text(text: str) -> bool:
    low = text.lower()
    return any(m in low for m in _TRANSIENT_MARKERS)


def _is_auth_expired(exc: BaseException) -> bool:
    low = _detail(exc).lower()
    return "invalid auth token" in low or "token" in low and "invalid" in low
