"""A zygote: one process per warm pool that imports what a worker needs once (torch,
Ultralytics, boto3, the engine's worker module) and forks every warm worker from itself.

Why: a fresh warm worker spends most of its CPU importing (2-core x86-64 VM: `import torch`
2.0 CPU-s, the engine's modules 0.5; model, datasets and warm-up pass 0.3; and 1.7 more for
`torch._dynamo`, which building or stepping an optimizer imports unless the worker's optimizers are
compile-free, `train/eager_step.py`). torch elastic replaces every node's worker at every change and
every node then rebuilds its standby beside training: 28-38 s on a 0.44-CPU replay node. A child
forked from the zygote starts with the imports done and is warm after ~0.5 CPU-s. A node's first
warm worker costs the full imports (the zygote does them first); every later one is cheap.

Fork safety: the zygote runs no torch operation and starts no thread before forking (`import
torch` leaves one idle native thread of its BLAS pool, which handles fork: torch's own DataLoader
workers are forked the same way). The child starts a new session, takes its stdin and stdout from
the pool (descriptors passed over a Unix socket), the pool's environment (its lifeline parent is
the zygote) and runs `python -m MODULE ARGS` as a fresh interpreter would (runpy).

The torch launcher imports torch itself (torch elastic): its zygote is forked from it once it
has imported the worker's modules too (`Zygote.fork_here`), so a node imports torch once. On a
joining replay node, the launcher's and a spawned zygote's imports side by side would take 10.4 s
of the 17.5 s from the node's start to its first step. The agent never imports torch: its
pool (Horovod) spawns the zygote.

Lifetime: the zygote dies with the pool's owner (the agent or the torch launcher:
`worker_runtime/lifeline.py`) and its children die with it. When the pool closes, the zygote forks no
more and exits once its last child has (a worker it handed over keeps training).

Protocol (SOCK_SEQPACKET, one JSON message each): pool -> zygote {"id", "module", "args", "env",
"cwd"} with two descriptors (stdin's read end, stdout's write end); zygote -> pool {"id", "pid"} or
{"id", "error"}, and {"exit": pid, "code": c} when a child ends (c as `Popen.returncode`). No torch
at import: the agent imports the pool side.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import IO, Any, Mapping, Sequence

from elasticyolo.log import get_logger
from elasticyolo.processes import fork_child
from elasticyolo.worker_runtime.spawn import pump_output, spawn
from elasticyolo.worker_runtime.worker_env import ENV_PARENT_PID, WorkerEnv

ENV_ZYGOTE = "ELASTICYOLO_ZYGOTE"  # "0": warm workers start as fresh processes
# What every worker imports, engine-neutral; the engine adds its `worker_modules`.
PRELOAD = ("elasticyolo.train.core", "boto3", "elasticyolo.commands.worker")
_MAX_MESSAGE = 1 << 20


def zygote_enabled() -> bool:
    return os.environ.get(ENV_ZYGOTE, "1") != "0"


class ZygoteError(RuntimeError):
    """The zygote could not fork (it is gone, or the fork failed)."""


# ---- pool side ----------------------------------------------------------------------------
class ForkedProcess:
    """The part of `subprocess.Popen` the pool, the launchers and torch elastic use, for a child
    of the zygote (its exit code comes from the zygote, which reaps it)."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes], args: Sequence[str]) -> None:
        self.pid, self.stdin, self.stdout, self.stderr = pid, stdin, stdout, None
        self.args = list(args)
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _ForkedZygoteProcess:
    """The part of `subprocess.Popen` a `Zygote` uses, for a zygote forked from this process."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode, self.stdout = pid, None, None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: its code is unknown
                    self.returncode = -signal.SIGKILL
                else:
                    if pid:
                        self.returncode = _exit_code(status)
            return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """Start from a thread that outlives it (as every spawn: see worker_runtime/lifeline.py); `fork()`
    may be called from any thread and blocks until the zygote has imported and forked."""

    def __init__(self, modules: Sequence[str], env: Mapping[str, str], worker_env: WorkerEnv,
                 cwd: str | os.PathLike[str] | None = None, **log_fields: Any) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = spawn([sys.executable, "-m", "elasticyolo.worker_runtime.zygote", str(theirs.fileno()), *modules],
                         env, worker_env, cwd=cwd, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self._attach(proc, ours, len(modules), log_fields)

    @classmethod
    def fork_here(cls, modules: Sequence[str], **log_fields: Any) -> "Zygote":
        """A zygote forked from this process once it has imported `modules` itself, for an owner
        that imports torch anyway (the torch launcher): the node then imports torch once, not in
        two processes side by side. Call on the main thread before this process starts a thread
        (the zygote forks its children, so it must hold none); it dies with this process."""
        _preload(modules)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        owner = os.getpid()

        def become_zygote() -> None:
            from elasticyolo.worker_runtime.lifeline import die_with_parent

            ours.close()
            die_with_parent(owner)
            os.setsid()  # a group of its own, as a spawned zygote: `kill` takes it down whole
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            from setproctitle import setproctitle

            setproctitle(f"{sys.executable} -m elasticyolo.worker_runtime.zygote (forked from {owner})")
            serve(theirs)

        pid = fork_child(become_zygote)  # ends in os._exit: not the owner's exit hooks
        theirs.close()
        zygote = cls.__new__(cls)
        zygote._attach(_ForkedZygoteProcess(pid), ours, len(modules), {**log_fields, "forked_from": owner})
        return zygote

    def _attach(self, proc: Any, sock: socket.socket, modules: int, log_fields: dict[str, Any]) -> None:
        self.log = get_logger("elasticyolo.zygote", **log_fields)
        self.proc = proc
        self.sock = sock
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}  # exits read before fork() registered the child
        self._gone = False
        self.log.info("zygote started", pid=self.proc.pid, modules=modules)
        if self.proc.stdout is not None:  # a forked one writes where its owner does
            threading.Thread(target=pump_output, args=(self.log.bind(pid=self.proc.pid), self.proc.stdout),
                             name="zygote-log", daemon=True).start()
        threading.Thread(target=self._read, name="zygote-read", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def fork(self, module: str, args: Sequence[str], env: Mapping[str, str],
             cwd: str | os.PathLike[str] | None, timeout_s: float = 300.0) -> ForkedProcess:
        """`python -m module args` as a child of the zygote, with `env` (plus its lifeline)."""
        request_id = next(self._ids)
        done: tuple[threading.Event, list[dict[str, Any]]] = (threading.Event(), [])
        with self._lock:  # the reader wakes every waiter registered before it marks the zygote gone
            if self._gone:
                raise ZygoteError("zygote could not fork: zygote exited")
            self._waiting[request_id] = done
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        request = {"id": request_id, "module": module, "args": list(args), "env": dict(env),
                   "cwd": str(cwd) if cwd is not None else None}
        try:
            with self._send_lock:
                socket.send_fds(self.sock, [json.dumps(request).encode()], [stdin_r, stdout_w])
        except OSError as exc:
            with self._lock:
                self._waiting.pop(request_id, None)
            for fd in (stdin_r, stdin_w, stdout_r, stdout_w):
                os.close(fd)
            raise ZygoteError(f"zygote unreachable: {exc}") from exc
        os.close(stdin_r)
        os.close(stdout_w)
        if not done[0].wait(timeout_s) or not done[1] or "pid" not in done[1][0]:
            with self._lock:
                self._waiting.pop(request_id, None)
            os.close(stdin_w)
            os.close(stdout_r)
            reason = done[1][0].get("error") if done[1] else ("zygote exited" if self._gone else "no reply")
            raise ZygoteError(f"zygote could not fork: {reason}")
        pid = int(done[1][0]["pid"])
        child = ForkedProcess(pid, os.fdopen(stdin_w, "wb"), os.fdopen(stdout_r, "rb"),
                              [sys.executable, "-m", module, *args])
        with self._lock:
            self._children[pid] = child
            early = self._early_exits.pop(pid, None)
            gone = self._gone
        if early is not None:
            child._exited(early)
        elif gone:
            child._exited(-signal.SIGKILL)  # its lifeline parent is gone
        return child

    def close(self) -> None:
        """No more forks; the zygote exits once its children have."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def kill(self) -> None:
        """The zygote and with it every child it still has (their lifeline)."""
        self.close()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            with self._lock:
                if "exit" in msg:
                    pid, code = int(msg["exit"]), int(msg["code"])
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._early_exits[pid] = code
                elif "id" in msg:
                    child = None
                    waiter = self._waiting.pop(int(msg["id"]), None)
                    if waiter is not None:
                        waiter[1].append(msg)
                        waiter[0].set()
                    continue
                else:
                    continue
            if child is not None:
                child._exited(code)
        # The zygote is gone, and its children with it (their lifeline parent).
        self.proc.wait()
        with self._lock:
            self._gone = True
            children, self._children = list(self._children.values()), {}
            waiting, self._waiting = list(self._waiting.values()), {}
        for child in children:
            child._exited(-signal.SIGKILL)
        for event, _ in waiting:
            event.set()
        self.log.info("zygote exited", code=self.proc.returncode)


# ---- zygote side --------------------------------------------------------------------------
def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict[str, Any], fds: list[int], close: Sequence[int], zygote_pid: int) -> None:
    """In the forked child: become a fresh worker process, run the module, never return."""
    code = 1
    try:
        from elasticyolo.worker_runtime.lifeline import die_with_parent

        die_with_parent(zygote_pid)  # the zygote dies with the pool's owner; its children with it
        from setproctitle import setproctitle

        # ps shows what it runs, not the zygote (before the environment changes: it moves argv there)
        setproctitle(" ".join([sys.executable, "-m", request["module"], *request["args"]]))
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # A fresh interpreter's hooks, not an owner's (pytest's, for one, under the tests).
        sys.excepthook, sys.unraisablehook = sys.__excepthook__, sys.__unraisablehook__
        for fd in close:
            os.close(fd)
        os.setsid()
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        # Standard streams of its own on those descriptors, as a fresh interpreter has (an owner
        # that forked the zygote may have replaced its own: pytest's capture, for one).
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        if request.get("cwd"):
            os.chdir(request["cwd"])
        env = {**request["env"], ENV_PARENT_PID: str(os.getppid())}  # the zygote is the lifeline parent
        os.environ.clear()
        os.environ.update(env)
        import random

        random.seed()  # not the zygote's state, shared by every child
        sys.argv = [request["module"], *request["args"]]
        import runpy


        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child must end here, never in the zygote's loop
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # the worker's own and its imports' (elasticyolo's own skip a fork: exit_hooks.py)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _start_helper_server(sock: socket.socket) -> None:
    """A worker zygote (it has imported torch) forks the fork server its workers' helpers (loader
    processes, the checkpoint uploader) come from: one per node for all its workers (mp.py)."""
    if "torch" not in sys.modules:
        return
    from elasticyolo.mp import fork_shared_fork_server

    zygote = os.getpid()

    def in_server() -> None:
        from elasticyolo.worker_runtime.lifeline import die_with_parent

        die_with_parent(zygote)
        from setproctitle import setproctitle

        setproctitle(f"{sys.executable} -m multiprocessing.forkserver (elasticyolo helpers of zygote {zygote})")

    fork_shared_fork_server(close=(sock.fileno(),), in_server=in_server)


def serve(sock: socket.socket) -> None:
    """Fork a child per request until the pool closes, then wait for the children to end."""
    _start_helper_server(sock)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select (set_wakeup_fd)
    signal.set_wakeup_fd(wake_w)
    children: set[int] = set()
    closing = False

    def reply(msg: dict[str, Any]) -> None:
        try:
            sock.send(json.dumps(msg).encode())
        except OSError:
            pass  # the pool is gone: its children die with it anyway

    while not (closing and not children):
        readable, _, _ = select.select([wake_r] if closing else [sock, wake_r], [], [], 1.0)
        if wake_r in readable:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid not in children:
                continue  # the helpers' fork server (_start_helper_server)
            children.discard(pid)
            reply({"exit": pid, "code": _exit_code(status)})
        if sock not in readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
        except OSError:
            data, fds = b"", []
        if not data:
            closing = True
            continue
        request = json.loads(data)
        try:
            if len(fds) != 2:
                raise OSError(f"expected 2 descriptors, got {len(fds)}")
            sys.stdout.flush()
            sys.stderr.flush()
            # The child's collector never walks what it inherits (the imports, and a forked
            # zygote's owner's objects, some unsafe to finalize after a fork), the recipe of
            # `gc.freeze`'s documentation; its pages then stay shared with the zygote too.
            gc.freeze()
            me = os.getpid()
            pid = os.fork()
            if pid == 0:
                _child(request, fds, (sock.fileno(), wake_r, wake_w), me)
            children.add(pid)
            reply({"id": request["id"], "pid": pid})
        except OSError as exc:
            reply({"id": request["id"], "error": str(exc)})
        finally:
            for fd in fds:
                os.close(fd)


def _preload(modules: Sequence[str]) -> None:
    """What a zygote holds before it forks: setproctitle (first: it finds argv's memory only while
    the environment is the original; the children retitle themselves with it) and `modules`."""
    import setproctitle  # noqa: F401

    for module in modules:
        importlib.import_module(module)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    from elasticyolo.worker_runtime.lifeline import die_with_agent

    die_with_agent()  # the pool's owner; the children's lifeline is this process
    sock = socket.socket(fileno=int(args[0]))
    _preload(args[1:])
    serve(sock)


if __name__ == "__main__":
    main()
