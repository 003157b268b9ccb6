"""torch elastic rendezvous on etcd v3: a `RendezvousBackend`, a c10d `Store`, and a handler.

Why not torch's own: its `etcd`/`etcd-v2` backends speak the etcd v2 API (gone in etcd 3.6), and
its stock `DynamicRendezvousHandler` hangs when a node joins a running job (it publishes
MASTER_ADDR/PORT for the shared TCPStore only in the first round it sees; see docs/torch-engine.md).

Key layout (one job = one `run_id`)::

    <key_prefix>/<run_id>/rdzv/state        the rendezvous state; mod revision = fencing token
    <key_prefix>/<run_id>/rdzv/store/<key>  the c10d store used by the agents during a round

Everything goes through `elasticyolo.cluster.etcd.EtcdClient` (endpoint failover, TLS/auth,
bounded retries), built from `cluster.settings.EtcdSettings` (TLS/auth from `--rdzv-conf`, else
from the environment: `ELASTICYOLO_ETCD_CA`, `_CERT`, `_KEY`, `_USER`, `_PASSWORD`).
"""

from __future__ import annotations

import base64
import binascii
import os
import pickle
import re
import sys
import threading
import time
import zlib
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Protocol, Sequence

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
)

from elasticyolo.cluster.settings import EtcdSettings
from elasticyolo.engines.torch import launcher_signal
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.rdzv")

BACKEND_NAME = "etcd3"
DEFAULT_KEY_PREFIX = "/elasticyolo"
# A rendezvous op that fails with RendezvousConnectionError kills the torch agent, so ride out an
# etcd leader election (~2 s on loopback, longer on a WAN) before giving up.
DEFAULT_RETRY_WINDOW = 15.0
DEFAULT_TIMEOUT = 5.0

# State envelope: magic, CRC32 of the payload, a per-write nonce, base64 payload. Corruption (a
# truncated or foreign value under our key) is detected here instead of as a pickle error deep in
# torch; the nonce makes every write's bytes unique (see set_state).
_MAGIC = b"eyrdzv1"


class KV(Protocol):
    """The part of `EtcdClient` this module uses (tests may pass a fake)."""

    def get(self, key: str) -> tuple[bytes, int] | None: ...
    def get_many(self, keys: Sequence[str]) -> dict[str, tuple[bytes, int] | None]: ...
    def get_prefix(self, prefix: str) -> list[tuple[str, bytes, int]]: ...
    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int: ...
    def delete(self, key: str) -> bool: ...
    def delete_prefix(self, prefix: str) -> int: ...
    def compare_and_swap(self, key: str, value: bytes | str, expected_mod_revision: int,
                         lease: int | None = None) -> tuple[bool, tuple[bytes, int] | None]: ...


def make_client(endpoints: str | Sequence[str], settings: EtcdSettings | None = None, *,
                timeout: float = DEFAULT_TIMEOUT, retry_window: float = DEFAULT_RETRY_WINDOW) -> KV:
    """An `EtcdClient` for `endpoints` with TLS/auth from `settings` (default: the environment)."""
    base = settings if settings is not None else EtcdSettings.from_env()
    return base.with_endpoints(endpoints).client(timeout=timeout, retry_window=retry_window)  # type: ignore[return-value]


def encode_state(state: bytes) -> bytes:
    return b"%s %08x %s %s" % (_MAGIC, zlib.crc32(state), os.urandom(8).hex().encode(),
                               base64.b64encode(state))


def decode_state(raw: bytes) -> bytes:
    try:
        magic, crc, _nonce, payload = raw.split(b" ", 3)
        if magic != _MAGIC:
            raise ValueError("not an elasticyolo rendezvous state")
        state = base64.b64decode(payload, validate=True)
        if zlib.crc32(state) != int(crc, 16):
            raise ValueError("checksum mismatch")
    except (ValueError, binascii.Error) as exc:
        raise RendezvousStateError(f"The rendezvous state in etcd is corrupt: {exc}") from exc
    return state


def _parse_token(token: Token | None) -> int | None:
    """A valid token is a positive mod revision (int or its decimal text); else None."""
    if isinstance(token, bool):
        return None
    if isinstance(token, int):
        return token if token > 0 else None
    if isinstance(token, (str, bytes)):
        try:
            value = int(token)
        except ValueError:
            return None
        return value if value > 0 else None
    return None


class EtcdRendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd v3 key; its mod revision is the fencing token.

    `set_state` is a single compare-and-swap txn on that revision (create-if-absent when no
    token is given), so concurrent agents never lose an update.
    """

    def __init__(
        self,
        endpoints: str,
        run_id: str,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        client: KV | None = None,
        settings: EtcdSettings | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry_window: float = DEFAULT_RETRY_WINDOW,
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self.run_id = run_id
        self.root = f"{key_prefix.rstrip('/')}/{run_id}/rdzv"
        self.key = f"{self.root}/state"
        self.store_prefix = f"{self.root}/store"
        self.client: KV = client if client is not None else make_client(
            endpoints, settings, timeout=timeout, retry_window=retry_window)

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        found = self._call(self.client.get, self.key)
        if found is None:
            return None
        raw, revision = found
        return decode_state(raw), revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is None:
            expected = 0  # create only if absent
        else:
            parsed = _parse_token(token)
            if parsed is None:
                # An invalid token can never match: report what is there, change nothing.
                current = self.get_state()
                return None if current is None else (*current, False)
            expected = parsed
        raw = encode_state(state)
        ok, current_kv = self._call(self.client.compare_and_swap, self.key, raw, expected)
        if current_kv is None:
            return None
        current_raw, revision = current_kv
        # EtcdClient may retry a txn whose first attempt did commit and then report a failed
        # compare; thanks to the nonce, finding our exact bytes means that attempt won.
        won = ok or current_raw == raw
        return decode_state(current_raw), revision, won

    def clear(self) -> int:
        """Delete this run's state and store keys (before reusing a run id: a closed state
        left by an earlier run would make every new agent exit at once)."""
        return int(self._call(self.client.delete_prefix, self.root + "/"))

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except UnavailableError as exc:
            raise RendezvousConnectionError(f"etcd is unavailable: {exc}") from exc
        except (RendezvousStateError, SignalException):
            raise  # SIGTERM while in a request: torch's launcher stops as on any SIGTERM
        except Exception as exc:  # noqa: BLE001 - torch expects one of its rendezvous errors
            raise RendezvousConnectionError(f"etcd request failed: {exc}") from exc


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


class EtcdStore(dist.Store):
    """A c10d Store on etcd v3: the agents' per-round traffic of torchrun's rendezvous
    (MASTER_ADDR/PORT, rank assignment, barriers) and the torch engine workers' process-group
    store. The state does not live on any one node, so losing any node loses no store.

    A blocking read re-reads the keys until they are there: every `_POLL_MIN`-`_POLL_MAX` s, or,
    with `watch=True`, whenever a key under the prefix changes (one etcd watch per store), with a
    re-read every `_WATCH_POLL_S` in case the watch missed an event. Gloo's connection setup
    is a chain of such reads (each rank's address, then its peers'), so a worker that re-forms its
    process group in place watches: a key is seen within milliseconds of its write, not at the
    next poll."""

    # A round's bootstrap keys are written within a fraction of a second: a wait re-reads at most
    # every 50 ms (200 ms made a key written just after a read cost up to 0.2 s of every restart).
    _POLL_MIN, _POLL_MAX = 0.01, 0.05
    _WATCH_POLL_S = 0.25
    _ABORT_CHECK_S = 0.5

    def __init__(self, client: KV, prefix: str, timeout: timedelta | None = None, *, watch: bool = False) -> None:
        super().__init__()  # required by the pybind trampoline
        self.client = client
        self.prefix = prefix.rstrip("/") + "/"
        # Set by the handler: for a key being waited on, why the wait can never end (a peer of
        # its round is dead or the round is over), else None. Checked every _ABORT_CHECK_S.
        self.abort_check: Callable[[str], str | None] | None = None
        self._changed = threading.Condition()
        self._changes = 0  # events seen under the prefix (a wait sleeps until this moves)
        self._cancel_watch: Callable[[], None] | None = None
        if timeout is not None:
            self.set_timeout(timeout)
        if watch:
            self._watch()

    def _watch(self) -> None:
        events, self._cancel_watch = self.client.watch_prefix(self.prefix)  # type: ignore[attr-defined]

        def pump() -> None:
            try:
                for _ in events:
                    with self._changed:
                        self._changes += 1
                        self._changed.notify_all()
            except Exception as exc:  # noqa: BLE001 - the waits still re-read every _WATCH_POLL_S
                log.debug("store watch ended", prefix=self.prefix, error=str(exc))

        threading.Thread(target=pump, name="etcd-store-watch", daemon=True).start()

    def close(self) -> None:
        if self._cancel_watch is not None:
            self._cancel_watch()

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: Any) -> None:
        EtcdRendezvousBackend._call(self.client.put, self._k(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        found = self._wait_for([key], self.timeout)
        if found is None:
            raise LookupError(f"key {key!r} not found in the etcd store within {self.timeout}")
        return found[key]

    def add(self, key: str, num: int) -> int:
        while True:
            found = EtcdRendezvousBackend._call(self.client.get, self._k(key))
            current, rev = (int(found[0]), found[1]) if found else (0, 0)
            new = current + int(num)
            ok, _ = EtcdRendezvousBackend._call(self.client.compare_and_swap, self._k(key), str(new), rev)
            if ok:
                return new

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        # TCPStore semantics: absent + empty expected -> set; absent otherwise -> return expected.
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            found = EtcdRendezvousBackend._call(self.client.get, self._k(key))
            if found is None and expected:
                return expected
            if found is not None and found[0] != expected:
                return found[0]
            ok, _ = EtcdRendezvousBackend._call(
                self.client.compare_and_swap, self._k(key), desired, found[1] if found else 0)
            if ok:
                return desired

    def delete_key(self, key: str) -> bool:
        return bool(EtcdRendezvousBackend._call(self.client.delete, self._k(key)))

    def num_keys(self) -> int:
        return len(EtcdRendezvousBackend._call(self.client.get_prefix, self.prefix))

    # The C++ trampoline looks these two up by their C++ names (e.g. through PrefixStore).
    deleteKey = delete_key
    getNumKeys = num_keys

    def check(self, keys: list[str]) -> bool:
        return self._wait_for(keys, timedelta(0)) is not None

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if self._wait_for(keys, timeout if timeout is not None else self.timeout) is None:
            raise LookupError(f"timed out waiting for keys {keys} in the etcd store")

    def _wait_for(self, keys: list[str], timeout: timedelta) -> dict[str, bytes] | None:
        deadline = time.monotonic() + timeout.total_seconds()
        next_check = time.monotonic() + self._ABORT_CHECK_S
        delay = self._POLL_MIN
        full = [self._k(k) for k in keys]
        while True:
            seen = self._changes
            found = EtcdRendezvousBackend._call(self.client.get_many, full)
            if all(found.get(k) is not None for k in full):
                return {k: found[fk][0] for k, fk in zip(keys, full)}  # type: ignore[index]
            now = time.monotonic()
            if now >= deadline:
                return None
            if self.abort_check is not None and now >= next_check:
                next_check = now + self._ABORT_CHECK_S
                reason = self.abort_check(keys[0])
                if reason is not None:
                    raise LookupError(f"gave up waiting for {keys} in the etcd store: {reason}")
            left = max(0.0, min(deadline, next_check) - time.monotonic())
            if self._cancel_watch is not None:
                with self._changed:
                    self._changed.wait_for(lambda: self._changes != seen, min(self._WATCH_POLL_S, left))
            else:
                time.sleep(min(delay, left))
                delay = min(delay * 2, self._POLL_MAX)


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous with a fresh bootstrap store every round.

    The stock handler caches MASTER_ADDR/PORT and the rank-0 agent's shared TCPStore from the
    first round; a node joining later (or a new rank 0) then waits forever for keys nobody
    writes in the new round, or reaches dead workers through the old store. Forgetting both
    before each round makes the round's rank 0 start a new TCPStore and publish its address in
    this round's (prefixed) etcd store — the scale-up fix of TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    while keeping the store in the agent (workers never pick a port themselves), and it works the
    same when that variable is set. Old rounds' store keys are deleted as we go.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._etcd_backend: EtcdRendezvousBackend | None = None  # set by create_handler
        self._round_participants: dict[int, frozenset[Any]] = {}

    def next_rendezvous(self) -> RendezvousInfo:
        # Private attrs of torch>=2.4's handler; the workers of the previous round are already
        # stopped when the agent asks for the next one, so dropping the old server is safe.
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        info = super().next_rendezvous()
        round_ = self._state_holder.state.round
        self._joined_round = round_
        # Who formed this round (hopeless_wait: a store wait on one who is gone is abandoned);
        # earlier rounds' keys are no longer waited on.
        self._round_participants = {round_: frozenset(self._state_holder.state.participants)}
        log.info("rendezvous round complete", run_id=self._settings.run_id, round=round_,
                 rank=info.rank, world_size=info.world_size)
        if info.rank == 0 and round_ >= 2:
            self._forget_round(round_ - 2)
        return info

    def shutdown(self) -> bool:
        """torch's launcher calls this in a `finally` on every exit but a signal, and closing the
        rendezvous ends the job on every node (they exit as if it had finished). Only a clean end
        (no exception in flight) closes it; after an error (a store wait on a dead peer given up,
        etcd unreachable) this node just stops its heartbeats and leaves the rendezvous open, and
        the node plug-in restarts its launcher, which joins the next round."""
        exc = sys.exc_info()[1]
        leave = getattr(self, "_membership_leave", None)  # membership.py
        if leave is not None:
            leave()
        if exc is not None:
            log.warning("torch agent failed; leaving the rendezvous open for the other nodes",
                        run_id=self._settings.run_id, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            self._stop_heartbeats()
            return False
        return super().shutdown()

    _ROUND_KEY = re.compile(r"^torch\.rendezvous\.(?P<run_id>.+)\.(?P<round>\d+)/")

    def hopeless_wait(self, key: str) -> str | None:
        """Why a store wait on `key` (a round's key, `torch.rendezvous.<run>.<round>/...`) can
        never end, or None. A peer killed right after the round formed never writes its keys
        (torch's rank assignment waits for every agent's `role_info`); torch would wait out the
        read timeout and then close the rendezvous for everyone. Seen here: the round is over,
        a participant's heartbeat is as old as torch's own expiry, or torch's sanitizer already
        removed a participant of the round."""
        m = self._ROUND_KEY.match(key)
        if m is None or m["run_id"] != self._settings.run_id or self._etcd_backend is None:
            return None
        round_ = int(m["round"])
        try:
            found = self._etcd_backend.get_state()
        except SignalException:
            raise
        except Exception as exc:  # noqa: BLE001 - an etcd hiccup is no reason to give up
            log.debug("rendezvous state unreadable while waiting", error=str(exc))
            return None
        if found is None:
            return "the rendezvous state is gone"
        state = pickle.loads(found[0])
        if state.closed:
            return None  # the job is ending; the agent's own flow handles it
        if state.round != round_:
            return f"round {round_} is over (now round {state.round})"
        participants = frozenset(state.participants)
        first = self._round_participants.setdefault(round_, participants)
        if not first <= participants:
            return f"{len(first - participants)} participant(s) of round {round_} were removed as dead"
        expiry = self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        now = datetime.now(timezone.utc)
        dead = [n for n in participants if now - state.last_heartbeats.get(n, now) > expiry]
        if dead:
            return f"participant {dead[0]} has sent no heartbeat for {expiry.total_seconds():g} s"
        return None

    def num_nodes_waiting(self) -> int:
        """Also > 0 when this node is no longer in the round it joined.

        The stock handler never tells a running agent that it was dropped (its heartbeats were
        late under load, so another node's sanitizer expelled it and maybe started a new round):
        that agent would keep training in a world nobody else is in (split brain, seen with a
        2 s heartbeat expiry on a busy 2-core box). The agent restarts its workers and rejoins
        whenever this is > 0, which heals it.
        """
        launcher_signal.check()  # a stop signal swallowed since the last tick stops the launcher now
        waiting = super().num_nodes_waiting()
        joined = getattr(self, "_joined_round", None)
        state = self._state_holder.state  # just synced by super()
        if joined is not None and not state.closed and (
                state.round != joined or self._this_node not in state.participants):
            log.warning("this node is no longer in its rendezvous round; rejoining",
                        run_id=self._settings.run_id, joined_round=joined, round=state.round)
            self._joined_round = None  # warn once; next_rendezvous sets it again
            return max(waiting, 1)
        # A participant of this round was removed because its node is gone (membership.py: its
        # lease is gone): restart now rather than when a collective on it fails or times out. (One
        # dropped by torch's own heartbeat expiry rejoins by itself, above.)
        expired = getattr(self._state_holder, "expired", frozenset())
        gone = {p for p in self._round_participants.get(joined, frozenset()) - set(state.participants)
                if str(p) in expired} if joined is not None else set()
        if gone and not state.closed:
            log.warning("a participant of this round is gone; restarting the round without it",
                        run_id=self._settings.run_id, round=joined, gone=sorted(map(str, gone)))
            self._joined_round = None
            return max(waiting, 1)
        return waiting

    def _forget_round(self, round_: int) -> None:
        store = self._store
        if not isinstance(store, EtcdStore):
            return
        prefix = f"{store.prefix}torch.rendezvous.{self._settings.run_id}.{round_}/"
        try:
            store.client.delete_prefix(prefix)
        except SignalException:
            raise
        except Exception as exc:  # noqa: BLE001 - garbage collection is best effort
            log.warning("could not delete old rendezvous keys", prefix=prefix, error=str(exc))


def _timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    value = params.get_as_int(f"{key}_timeout")
    return None if value is None else timedelta(seconds=value)


# `--rdzv-conf` keys -> EtcdSettings fields (aliases match torch's etcd-v2 names).
_CONF_FIELDS = {
    "ca_cert": "ca",
    "cert_cert": "cert",
    "ssl_cert": "cert",
    "cert_key": "key",
    "ssl_cert_key": "key",
    "user": "user",
    "password": "password",
}


def client_options(params: RendezvousParameters) -> dict[str, Any]:
    """`EtcdRendezvousBackend` client options from `--rdzv-conf`, TLS/auth falling back to the
    environment (secrets belong there: torchrun's command line is visible in `ps`)."""
    env = EtcdSettings.from_env()
    fields = {f: getattr(env, f) for f in set(_CONF_FIELDS.values())}
    for conf_key, name in _CONF_FIELDS.items():
        value = params.get(conf_key)
        if value:
            fields[name] = value
    opts: dict[str, Any] = {"settings": EtcdSettings(**fields)}
    if params.get("etcd_timeout"):
        opts["timeout"] = float(params.get("etcd_timeout"))
    if params.get("etcd_retry_window"):
        opts["retry_window"] = float(params.get("etcd_retry_window"))
    return opts


def create_backend(params: RendezvousParameters, client: KV | None = None
                   ) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Backend and agent store from torchrun's parameters (`--rdzv-endpoint` may list several
    comma-separated etcd endpoints; `--rdzv-conf key_prefix=...` moves the keys)."""
    endpoints = params.endpoint
    if params.get("protocol", "http").strip().lower() == "https":
        endpoints = ",".join(e if "://" in e else f"https://{e}" for e in endpoints.split(","))
    backend = EtcdRendezvousBackend(
        endpoints, params.run_id, params.get("key_prefix", DEFAULT_KEY_PREFIX),
        client=client, **({} if client is not None else client_options(params)))
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    store = EtcdStore(backend.client, backend.store_prefix, timedelta(seconds=read_timeout))
    return backend, store


def create_handler(params: RendezvousParameters, client: KV | None = None) -> EtcdRendezvousHandler:
    """The torchrun handler for `--rdzv-backend=etcd3` (same `--rdzv-conf` timeouts as c10d:
    join_timeout, last_call_timeout, close_timeout, heartbeat_timeout, keep_alive_interval,
    keep_alive_max_attempt)."""
    backend, store = create_backend(params, client)
    timeout = RendezvousTimeout(_timeout(params, "join"), _timeout(params, "last_call"),
                                _timeout(params, "close"), _timeout(params, "heartbeat"))
    handler = EtcdRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr, timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5) or 5,
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3) or 3,
    )
    handler._etcd_backend = backend
    store.abort_check = handler.hopeless_wait
    node_id, job = params.get("node_id"), params.get("job")
    if node_id and job:  # run by the agents: rounds follow the cluster's membership
        from elasticyolo.cluster.keys import JobKeys
        from elasticyolo.engines.torch.membership import RendezvousView, use_membership

        use_membership(handler, RendezvousView(backend.client, f"{backend.root}/members/", JobKeys(str(job))),
                       str(node_id))
    return handler
