"""A real systemd to run a unit under where the machine's init is not systemd (CI containers):
systemd as PID 1 of its own PID and mount namespaces, as a container manager starts it.

Tests use it for what only systemd itself can show: what it does when the service exits (restart
or not, `Restart=`/`RestartPreventExitStatus=`) and what `systemctl status` reports (the
`STATUS=` text the service sent). The unit file is used as shipped; what the container lacks
(a journal, the node's credential files, an interpreter under a private home) is changed in a
drop-in the test writes, so the difference is explicit.

Inside the namespaces, before systemd starts: /run, /var/lib and /var/cache are empty tmpfs (the
unit's StateDirectory/CacheDirectory land there, not on the machine), only the `name=systemd`
and cgroup2 hierarchies stay mounted (systemd then leaves the v1 resource controllers, and so
the memory limits of the machine's own cgroup, alone), and systemd's cgroup is a fresh one
below the caller's, removed on stop. The unit path is only the given directory: no unit of the
machine (sysinit, journald, udev) starts. Needs root, `unshare`, `nsenter` and systemd.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil

from elasticyolo.local_cluster.wait import wait_for

SYSTEMD = "/lib/systemd/systemd"
CGROUP_ROOT = Path("/sys/fs/cgroup")

# The targets a unit with default dependencies orders itself against, empty: nothing else starts.
_TARGETS = ("sysinit.target", "basic.target", "shutdown.target", "network-online.target", "multi-user.target",
            "elasticyolo-test.target")

# PID 1 of the new namespaces: private tmpfs for /run, /var/lib, /var/cache; its own cgroup; v1
# controller hierarchies unmounted; then systemd.
_SETUP = r"""
set -eu
cgroups="$1"; shift
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
mount -t tmpfs -o mode=0755 tmpfs /var/lib
mount -t tmpfs -o mode=0755 tmpfs /var/cache
for cg in $cgroups; do echo $$ >"$cg/cgroup.procs"; done
for m in /sys/fs/cgroup/*; do
  case "$m" in /sys/fs/cgroup/systemd|/sys/fs/cgroup/unified) ;; *) umount "$m" 2>/dev/null || true ;; esac
done
exec "$@"
"""


class SystemdContainer:
    """systemd running the units in `unit_dir` (plus empty stand-ins of the standard targets)."""

    def __init__(self, unit_dir: Path, log_path: Path) -> None:
        self.unit_dir = Path(unit_dir)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.init_pid: int | None = None  # systemd, as this machine sees it
        self.cgroups: list[Path] = []

    @staticmethod
    def available() -> str | None:
        """None when systemd can run here in its own namespaces, else why not."""
        if os.geteuid() != 0:
            return "needs root"
        for tool in ("unshare", "nsenter", "systemctl"):
            if shutil.which(tool) is None:
                return f"{tool} not installed"
        if not os.access(SYSTEMD, os.X_OK):
            return f"{SYSTEMD} not installed"
        if not _cgroup_hierarchies():
            return "no writable systemd cgroup hierarchy"
        r = subprocess.run(["unshare", "--pid", "--mount", "--fork", "true"], capture_output=True, timeout=30)
        if r.returncode != 0:
            return f"unshare failed: {r.stderr.decode().strip()}"
        return None

    def start(self, timeout: float = 30) -> "SystemdContainer":
        for name in _TARGETS:
            path = self.unit_dir / name
            if not path.exists():
                path.write_text("[Unit]\nDefaultDependencies=no\nAllowIsolate=yes\n")
        name = f"elasticyolo-systemd-{os.getpid()}-{time.monotonic_ns()}"
        for hierarchy, own in _cgroup_hierarchies():
            path = hierarchy / own.lstrip("/") / name
            path.mkdir()
            self.cgroups.append(path)
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "container": "elasticyolo-test",
               "SYSTEMD_UNIT_PATH": str(self.unit_dir), "LANG": "C.UTF-8"}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--mount", "--fork", "--mount-proc", "--propagation", "private", "--",
             "/bin/sh", "-c", _SETUP, "setup", " ".join(map(str, self.cgroups)),
             SYSTEMD, "--system", "--unit=elasticyolo-test.target", "--log-target=console", "--log-level=info",
             "--show-status=no"],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.init_pid = wait_for(self._init_pid, timeout, "systemd to start in its namespaces")
        wait_for(lambda: self.systemctl("is-system-running").stdout.strip() in ("running", "degraded"), timeout,
                 "systemd to finish starting", abort=self._exited)
        return self

    def systemctl(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        assert self.init_pid is not None, "systemd is not running"
        return subprocess.run(["nsenter", "-t", str(self.init_pid), "-m", "-p", "systemctl", "--no-pager", *args],
                              capture_output=True, text=True, timeout=timeout)

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in properties)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def stop(self) -> None:
        if self.init_pid is not None:
            try:
                os.kill(self.init_pid, 9)  # the PID namespace ends with its init: every unit's process too
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        for cgroup in self.cgroups:
            wait_for(lambda: _remove_tree(cgroup), 30, f"cgroup {cgroup} to be removed")
        self.cgroups = []

    def __enter__(self) -> "SystemdContainer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _init_pid(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"unshare exited: {self.log_path.read_text()[-2000:]}")
        children = psutil.Process(self.proc.pid).children()
        for child in children:
            try:
                if child.exe() == os.path.realpath(SYSTEMD):
                    return child.pid
            except psutil.Error:
                continue
        return None

    def _exited(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"systemd exited ({self.log_path.read_text()[-2000:]})"
        return None


def _cgroup_hierarchies() -> list[tuple[Path, str]]:
    """(mount point, this process's cgroup in it) of the hierarchies systemd keeps: `name=systemd`
    (hybrid and legacy layouts) and cgroup2 (/sys/fs/cgroup/unified in a hybrid layout, else
    /sys/fs/cgroup itself)."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        own["cgroup2" if hid == "0" else controllers] = path
    found = []
    legacy = CGROUP_ROOT / "systemd"
    if "name=systemd" in own and (legacy / "cgroup.procs").exists():
        found.append((legacy, own["name=systemd"]))
    for mount in (CGROUP_ROOT / "unified", CGROUP_ROOT):
        if "cgroup2" in own and (mount / "cgroup.procs").exists():
            found.append((mount, own["cgroup2"]))
            break
    return [(mount, path) for mount, path in found if os.access(mount / path.lstrip("/"), os.W_OK)]


def _remove_tree(path: Path) -> bool:
    """rmdir a cgroup and its children, deepest first; False while one is still busy."""
    if not path.exists():
        return True
    for sub in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            sub.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            return False
    try:
        path.rmdir()
    except OSError:
        return False
    return True
