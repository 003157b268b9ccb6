"""Starting and stopping the processes an agent runs for an engine: the one spawn helper.

Every child runs in its own session (so `killpg` takes its whole tree), is told the agent's pid
(`ELASTICYOLO_PARENT_PID`: it dies with the agent, see `lifeline.py`) and runs unbuffered.
Spawn from a thread that lives as long as the child (the death signal follows the forking thread).
Output is piped: `pump_output` re-logs it in the agent's log with the worker's structured fields,
`forward_output` copies it to the agent's log stream line by line as it is (so the journal and
the shipped logs, `agent/log_shipping.py`, see it; a child that writes its own log records, such
as the torch launcher); or it is inherited.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from elasticyolo.worker_runtime.worker_env import WorkerEnv

# A stopped child gets this long between SIGTERM and SIGKILL.
KILL_GRACE_S = 3.0


def worker_command(*args: str) -> list[str]:
    """`elasticyolo worker ARGS` with this interpreter (it dispatches on the spec's engine)."""
    return [sys.executable, "-m", "elasticyolo.cli", "worker", *args]


def child_env(env: Mapping[str, str], worker_env: WorkerEnv | None = None) -> dict[str, str]:
    """`env` plus `worker_env`, this process as the lifeline parent, unbuffered output."""
    mine = replace(worker_env or WorkerEnv(), parent_pid=os.getpid()).to_env()
    return {**env, **mine, "PYTHONUNBUFFERED": "1"}


def spawn(cmd: Sequence[str], env: Mapping[str, str], worker_env: WorkerEnv | None = None, *,
          cwd: str | os.PathLike[str] | None = None, stdin: int | None = subprocess.DEVNULL,
          capture_output: bool = True, pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    """Start `cmd` with `child_env(env, worker_env)`."""
    if cwd is not None:
        Path(cwd).mkdir(parents=True, exist_ok=True)
    out = subprocess.PIPE if capture_output else None
    return subprocess.Popen(list(cmd), env=child_env(env, worker_env), cwd=cwd, stdin=stdin, stdout=out,
                            stderr=subprocess.STDOUT if capture_output else None, start_new_session=True,
                            pass_fds=tuple(pass_fds))


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Send `sig` to the child's whole process group (its session); quiet if it is gone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_now(proc: subprocess.Popen[Any], wait_s: float = 10.0) -> None:
    signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        pass


class SupervisedProcess:
    """A child forked and reaped by its own supervisor thread, which lives exactly as long as the
    child (so the death signal cannot fire early) and calls `on_exit()` when it ends."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], worker_env: WorkerEnv | None = None, *,
                 name: str, on_exit: Callable[[], None] = lambda: None, cwd: str | os.PathLike[str] | None = None,
                 start_timeout_s: float = 30.0, forward: bool = False) -> None:
        """`forward`: the child's output goes through `forward_output` (else it is inherited)."""
        self.forward = forward
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.stop_requested_at: float | None = None  # monotonic, when SIGTERM was sent
        self._started = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._supervise, args=(cmd, env, worker_env, cwd, on_exit),
                                        name=name, daemon=True)
        self._thread.start()
        self._started.wait(start_timeout_s)
        if self._error is not None:
            raise self._error

    def _supervise(self, cmd: Sequence[str], env: Mapping[str, str], worker_env: WorkerEnv | None,
                   cwd: str | os.PathLike[str] | None, on_exit: Callable[[], None]) -> None:
        try:
            self.proc = spawn(cmd, env, worker_env, cwd=cwd, capture_output=self.forward)
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error = exc
            self._started.set()
            return
        self._started.set()
        if self.forward:
            threading.Thread(target=forward_output, args=(self.proc.stdout,), name=f"{threading.current_thread().name}-out",
                             daemon=True).start()
        self.returncode = self.proc.wait()
        self._done.set()
        on_exit()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and not self._done.is_set()

    def terminate(self) -> None:
        """SIGTERM to the child itself (once); it stops its own children."""
        if self.running and self.proc is not None and self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the child's whole session."""
        if self.running and self.proc is not None:
            signal_group(self.proc, signal.SIGKILL)

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)


def forward_output(stream: IO[bytes] | None) -> None:
    """Copy a child's output to this process's log stream, line by line, as it is."""
    from elasticyolo.log import forward_line

    if stream is None:
        return
    for raw in iter(stream.readline, b""):
        forward_line(raw.decode("utf-8", "replace"))
    stream.close()


def pump_output(wlog: Any, stream: IO[bytes] | None, on_line: Callable[[str], bool] | None = None) -> None:
    """Re-log a child's output line by line: its structlog JSON records keep their fields.
    `on_line(line)` may consume a line (return True) before it is logged."""
    if stream is None:
        return
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip()
        if not line or (on_line is not None and on_line(line)):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and "event" in rec:
            level = str(rec.pop("level", "info"))
            event = rec.pop("event")
            rec.pop("timestamp", None)
            fields = {k: v for k, v in rec.items() if k not in ("node", "job", "slot", "pid")}
            getattr(wlog, level if level in ("debug", "info", "warning", "error") else "info")(
                f"worker: {event}", **fields)
        else:
            wlog.info("worker output", line=line[:2000])
    stream.close()
