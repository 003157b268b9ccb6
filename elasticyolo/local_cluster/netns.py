"""Network namespaces that tests and benchmarks make on this machine (root and iproute2).

`LoopbackNamespace` is a namespace with only `lo` up and no route: whatever runs in it can reach
127.0.0.1 of that namespace and nothing else. A scenario whose servers pick their own address
(Ray's nodes advertise the address of the interface with the default route) runs in one, so the
address they find is 127.0.0.1. `entered()` moves the calling thread into it: the processes and
threads it starts from then on start inside (a network namespace is per thread, and a child
inherits its parent thread's).

Names carry a random tag, so a crashed run's leftovers never collide with the next; closing kills
what still runs in the namespace (all of it started by the test) and deletes it.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

NETNS_RUN = Path("/run/netns")  # where `ip netns add` mounts a namespace
NETNS_ETC = Path("/etc/netns")  # per-namespace files `ip netns exec` mounts over /etc
CLONE_NEWNET = 0x40000000


def unavailable() -> str | None:
    """Why namespaces cannot be made here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"eyprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"ip netns unavailable: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def add_namespace(name: str) -> None:
    """A new namespace with its loopback up (and nothing else)."""
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
    ip(name, "link", "set", "lo", "up")


def namespace_pids(name: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def delete_namespaces(names: list[str]) -> None:
    """Kill every process still in the namespaces, then delete them (and their /etc files), in
    the order given."""
    for name in names:
        for pid in namespace_pids(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def ip(ns: str, *args: str) -> None:
    r = subprocess.run(["ip", "-n", ns, *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip -n {ns} {' '.join(args)}: {r.stderr.strip()}")


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class LoopbackNamespace:
    """A namespace with only `lo` up and no route (context manager: made on enter, deleted on
    exit)."""

    def __init__(self) -> None:
        self.name = "eylo" + secrets.token_hex(3)
        self._made = False

    def start(self) -> "LoopbackNamespace":
        add_namespace(self.name)
        self._made = True
        return self

    def prefix(self) -> list[str]:
        """The command prefix that runs a process inside it."""
        return ["ip", "netns", "exec", self.name]

    def run(self, cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.prefix(), *cmd], capture_output=True, text=True, timeout=timeout)

    @contextmanager
    def entered(self) -> Iterator["LoopbackNamespace"]:
        """The calling thread in the namespace for the block, back in its own after it."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(NETNS_RUN / self.name, os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield self
            finally:
                _setns(own)
        finally:
            os.close(target)
            os.close(own)

    def pids(self) -> list[int]:
        return namespace_pids(self.name)

    def close(self) -> None:
        if self._made:
            delete_namespaces([self.name])
            self._made = False

    def __enter__(self) -> "LoopbackNamespace":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
