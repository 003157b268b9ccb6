"""A worker's fatal error, from the worker to where the user looks (`status`, the job's reason).

Worker side (`record`): `elasticyolo worker` that fails writes its one-line error (what the CLI
prints, `cli.py`) to `<worker dir>/worker-errors/<pid>.json`; the worker directory is the node's
directory of the submission (`worker_env.node_work_dir`), the cwd of every worker the agent starts,
whichever engine, launcher, warm pool or zygote started it. A file, not etcd: the worker may fail
before it could reach etcd (or because it cannot), and the agent owns the job's event log.

Agent side (`WorkerErrors.publish_pending`): the agent reads those files and publishes each as
a `worker_error` event and as the node's latest error (`errors/<node-id>`, not leased: it
outlives the node), then deletes the file. Both engines call it every loop iteration; the Horovod
launcher also calls it when a worker exits, before it reports the exit, so a job the driver
fails for that exit finds the reason already in etcd (`failure_reason`).

Readers (`latest_errors`, `failure_reason`): `status` shows the latest error of each node for the
current submission; a job that fails carries them in its state's `reason`. No torch here.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from elasticyolo.cluster.etcd import EtcdClient, EtcdError
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.errors import UnavailableError

ERRORS_DIR = "worker-errors"
MAX_REASON_CHARS = 300  # one worker's reason
MAX_JOB_REASON_CHARS = 600  # a failed job's reason (every node's, deduplicated)
# A node's worker failing again for the same reason (a retried start) is published again only
# after this long: the event log holds what happened, not every retry.
REPEAT_S = 60.0
# Where a worker's local slot comes from: Horovod's and torch elastic's environment.
_SLOT_VARIABLES = ("HOROVOD_LOCAL_RANK", "LOCAL_RANK")
# Which round of its launcher a worker is in (torch elastic's restart count): a record's `round`
# key is the launcher's pid and that count, the same for every slot of one round.
_ROUND_VARIABLE = "TORCHELASTIC_RESTART_COUNT"
_joined = False  # this process has started joining its world (`joined_world`)


def one_line(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """The first non-empty line of `text`, at most `limit` characters."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[:limit - 1] + "…"


# ---- worker side --------------------------------------------------------------------------------
def joined_world() -> None:
    """Called by a worker just before its first contact with a peer (the process group's init):
    an error from then on may be a peer's doing (`joined` in its record; `crash_loop.py`)."""
    global _joined
    _joined = True


def errors_dir(worker_dir: str | os.PathLike[str]) -> Path:
    return Path(worker_dir) / ERRORS_DIR


def record(reason: str, code: int, *, slot: int | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    """Write this process's fatal error for its agent (a no-op outside an agent: no parent pid).
    Never raises: the worker is failing already, and its stderr says the same."""
    from elasticyolo.worker_runtime.worker_env import ENV_PARENT_PID, ENV_WORKER_DIR

    env = os.environ if environ is None else environ
    if not env.get(ENV_PARENT_PID):
        return None  # plain horovodrun / torchrun: nobody reads the file
    if slot is None:
        slot = next((int(env[v]) for v in _SLOT_VARIABLES if str(env.get(v, "")).isdigit()), None)
    restart = str(env.get(_ROUND_VARIABLE, ""))
    rec = {"reason": one_line(reason), "code": int(code), "slot": slot, "pid": os.getpid(), "at": time.time(),
           "joined": _joined, "round": f"{env.get(ENV_PARENT_PID)}:{restart}" if restart.isdigit() else None}
    try:
        directory = errors_dir(env.get(ENV_WORKER_DIR) or os.getcwd())
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.replace(path)  # the agent never reads half a file
        return path
    except OSError:
        return None


# ---- agent side ---------------------------------------------------------------------------------
def read_pending(worker_dir: Path) -> list[dict[str, Any]]:
    """The error files under `worker_dir`, oldest first, each read once (deleted)."""
    directory = errors_dir(worker_dir)
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError:
        return []
    out = []
    for path in paths:
        try:
            rec = json.loads(path.read_text())
            path.unlink()
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("reason"):
            out.append(rec)
    return sorted(out, key=lambda r: float(r.get("at") or 0))


def signal_reason(code: int) -> str | None:
    """The reason of a worker that a signal killed (`Popen.returncode` < 0), None otherwise."""
    import signal

    if code >= 0:
        return None
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"killed by {name}" + (" (out of memory? the kernel's OOM killer sends it)" if -code == signal.SIGKILL else "")


class WorkerErrors:
    """Publishes a node's worker errors (thread-safe: the agent loop and the launcher's waiter
    threads both call it). `observe`: called with every error read, repeats included (the
    published ones leave repeats out), under the lock."""

    def __init__(self, client: EtcdClient, keys: JobKeys, node_id: str, log: Any,
                 observe: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.client, self.keys, self.node_id, self.log = client, keys, node_id, log
        self.observe = observe
        self._lock = threading.Lock()
        self._unsent: list[dict[str, Any]] = []  # read but not yet written (etcd did not answer)
        self._last: tuple[str, int | None, float] | None = None  # (reason, generation, at) last written

    def publish_pending(self, worker_dir: Path | None, generation: int | None,
                        exited: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Publish the errors written under `worker_dir` (the submission `generation`'s); returns
        those written. `exited`: {"pid", "slot", "code"} of a worker that just ended without being asked to; a
        signal death (no file: it could not write one) is published as such."""
        if worker_dir is None:
            return []
        with self._lock:
            pending = read_pending(worker_dir)
            if exited is not None and (reason := signal_reason(int(exited["code"]))) is not None \
                    and not any(r.get("pid") == exited["pid"] for r in pending):
                pending.append({**exited, "reason": reason, "at": time.time()})
            for rec in pending:
                self.log.error("worker failed", slot=rec.get("slot"), code=rec.get("code"), pid=rec.get("pid"),
                               reason=rec["reason"])
                self._unsent.append({"node": self.node_id, "generation": generation, **rec})
                if self.observe is not None:
                    self.observe(self._unsent[-1])
            todo, self._unsent, written = self._unsent, [], []
            for i, rec in enumerate(todo):
                key = (str(rec["reason"]), rec.get("generation"))
                if self._last is not None and self._last[:2] == key and float(rec["at"]) - self._last[2] < REPEAT_S:
                    continue  # the same failure again (a retried start)
                try:
                    self._write(rec)
                except (UnavailableError, EtcdError) as exc:
                    self.log.warning("could not publish a worker error; will retry", error=str(exc))
                    self._unsent = todo[i:]
                    break
                self._last = (*key, float(rec["at"]))
                written.append(rec)
            return written

    def _write(self, rec: dict[str, Any]) -> None:
        from elasticyolo.cluster.etcd import b64

        event = {**rec, "kind": "worker_error", "at": rec.get("at") or time.time()}
        # The worker's pid as the key's sequence number: unique per error, never one of the agent's.
        event_key = self.keys.event(int(event["at"] * 1000), self.node_id, int(rec.get("pid") or 0))
        self.client.txn([], [{"request_put": {"key": b64(event_key), "value": b64(json.dumps(event))}},
                             {"request_put": {"key": b64(self.keys.error(self.node_id)),
                                              "value": b64(json.dumps(rec))}}], [])


# ---- readers ------------------------------------------------------------------------------------
def current_errors(records: Iterable[Any], generation: int | None) -> list[dict[str, Any]]:
    """The nodes' latest errors that belong to submission `generation` (None: all), by node."""
    out = [r for r in records if isinstance(r, dict) and r.get("reason")
           and (generation is None or r.get("generation") in (None, generation))]
    return sorted(out, key=lambda r: str(r.get("node")))


def reason_text(errors: list[dict[str, Any]], limit: int = MAX_JOB_REASON_CHARS) -> str:
    """`n1, n2: <reason>; n3: <other reason>`: one entry per distinct reason, oldest first."""
    by_reason: dict[str, list[str]] = {}
    for e in sorted(errors, key=lambda r: float(r.get("at") or 0)):
        nodes = by_reason.setdefault(str(e["reason"]), [])
        if str(e.get("node")) not in nodes:
            nodes.append(str(e.get("node")))
    text = "; ".join(f"{', '.join(nodes)}: {reason}" for reason, nodes in by_reason.items())
    return one_line(text, limit)


def latest_errors(client: EtcdClient, keys: JobKeys) -> list[dict[str, Any]]:
    """Every node's latest worker error for the current submission (the spec's mod revision)."""
    got = client.get(keys.spec)
    generation = got[1] if got else None
    records = []
    for _key, value, _rev in client.get_prefix(keys.errors):
        try:
            records.append(json.loads(value))
        except ValueError:
            continue
    return current_errors(records, generation)


def failure_reason(client: EtcdClient, keys: JobKeys, base: str) -> str:
    """A failed job's reason: `base` (what failed, from the engine) and why, from the workers'
    errors. Best effort: `base` alone when etcd does not answer."""
    try:
        errors = latest_errors(client, keys)
    except (UnavailableError, EtcdError):
        return base
    return f"{base}: {reason_text(errors)}" if errors else base
