"""Run a command as the shipped systemd unit would run it, where systemd is not PID 1 (CI
containers): the unit's environment with its specifiers (%S, %C, %d) mapped into a sandbox
directory, a private mount namespace in which every file system is read-only except the unit's
StateDirectory/CacheDirectory and a private /tmp (ProtectSystem=strict, PrivateTmp=), a
read-only empty HOME, an unprivileged user without capabilities (DynamicUser=,
CapabilityBoundingSet=, NoNewPrivileges=), and the unit's SystemCallFilter= as a seccomp filter.

The service user is uid 65534 when it can run the venv's interpreter; on machines whose Python
lives in a private home (pyenv under a 0700 /root, as on the CI image) it is uid 0 with every
capability dropped, which still cannot write past a read-only mount or read other users' 0600 files.

Tests start a real agent (and through it real workers) inside; whatever they try to write outside
the unit's directories fails with EROFS, so a path the unit does not provide shows up as a failed
job, not as a surprise on a VM. Needs root, `unshare`, `setpriv`, `systemd-analyze` and the
system Python's `seccomp` module (Debian: util-linux, systemd, python3-seccomp).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

NOBODY = 65534
SECCOMP_EXEC = Path(__file__).with_name("seccomp_exec.py")
SYSTEM_PYTHON = "/usr/bin/python3"


@dataclass
class UnitFile:
    path: Path
    settings: list[tuple[str, str]] = field(default_factory=list)  # (key, value) in file order

    @classmethod
    def parse(cls, path: Path) -> "UnitFile":
        unit = cls(Path(path))
        for raw in Path(path).read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";", "[")) or "=" not in line:
                continue
            key, _, value = line.partition("=")
            unit.settings.append((key.strip(), value.strip()))
        return unit

    def values(self, key: str) -> list[str]:
        return [v for k, v in self.settings if k == key]

    def value(self, key: str, default: str | None = None) -> str | None:
        found = self.values(key)
        return found[-1] if found else default

    def environment(self) -> list[tuple[str, str]]:
        out = []
        for v in self.values("Environment"):
            name, _, val = v.partition("=")
            out.append((name, val))
        return out


def _runs_as(uid: int, python: str) -> bool:
    r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/bin/sh", "-c",
                        'exec "$0" -c pass', python], capture_output=True, timeout=60)
    return r.returncode == 0


def expand_syscall_filter(lines: list[str]) -> list[str]:
    """The system calls a set of `SystemCallFilter=` lines allows (allow-lists minus `~` lists),
    expanded with `systemd-analyze syscall-filter`."""
    groups = _syscall_groups()

    def expand(item: str, seen: set[str]) -> set[str]:
        if not item.startswith("@"):
            return {item}
        if item in seen:
            return set()
        seen.add(item)
        out: set[str] = set()
        for member in groups.get(item, []):
            out |= expand(member, seen)
        return out

    allowed: set[str] = set()
    denied: set[str] = set()
    for line in lines:
        deny = line.startswith("~")
        for item in line.lstrip("~").split():
            (denied if deny else allowed).update(expand(item, set()))
    return sorted(allowed - denied)


def _syscall_groups() -> dict[str, list[str]]:
    text = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"], capture_output=True, text=True,
                          check=True, timeout=60).stdout
    groups: dict[str, list[str]] = {}
    current: str | None = None
    for raw in text.splitlines():
        if raw.startswith("@"):
            current = raw.strip()
            groups[current] = []
        elif current and raw.strip() and not raw.strip().startswith("#"):
            groups[current].append(raw.strip())
    return groups


# Inside the new mount namespace, as root: ProtectSystem=strict + StateDirectory/CacheDirectory +
# PrivateTmp + ProtectKernelTunables, then drop to the service user and apply the syscall filter.
# `keep`: paths under /tmp that stay visible through the private /tmp (a checkout, its venv and
# the sandbox root when the repository itself lives in /tmp; on a VM the code is never there).
_SETUP = r"""
set -eu
rw="$1"; keep="$2"; shift 2
for d in $rw; do mount --bind "$d" "$d"; done
mounts=$(awk '{print $5}' /proc/self/mountinfo)
for m in $mounts; do
  m=$(printf '%b' "$m")
  case "$m" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) continue ;; esac
  skip=0; for d in $rw; do [ "$m" = "$d" ] && skip=1; done
  [ $skip = 1 ] || mount -o remount,bind,ro "$m"
done
mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys
[ -z "$keep" ] || mount --rbind /tmp /var/tmp
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
for p in $keep; do
  mkdir -p "$p" && mount --rbind "/var/tmp/${p#/tmp/}" "$p" && mount -o remount,bind,ro "$p"
done
[ -z "$keep" ] || umount -l /var/tmp
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /var/tmp
exec "$@"
"""
REPO_ROOT = Path(__file__).resolve().parents[2]


def kept_under_tmp(paths: list[Path]) -> list[str]:
    """The outermost of `paths` that live under /tmp (the private /tmp would hide them)."""
    under = sorted({str(p.resolve()) for p in paths if p.resolve().is_relative_to("/tmp")})
    return [p for p in under if not any(p != q and p.startswith(q + "/") for q in under)]


class UnitSandbox:
    """The unit's world under `root` (created here): state/, cache/, credentials/, home/."""

    def __init__(self, unit_path: Path, root: Path | None = None, *, uid: int | None = None, gid: int | None = None,
                 seccomp: bool = True, python: str | None = None) -> None:
        if uid is None:
            uid = NOBODY if _runs_as(NOBODY, python or sys.executable) else 0
        gid = uid if gid is None else gid
        self.unit = UnitFile.parse(unit_path)
        base = Path(root) if root else Path(tempfile.mkdtemp(prefix="unit-sandbox-"))
        base.mkdir(parents=True, exist_ok=True)
        self.root = base.resolve()
        os.chmod(self.root, 0o755)  # the service user must reach the directories below
        self.uid, self.gid, self.seccomp = uid, gid, seccomp
        self.state_base, self.cache_base = self.root / "state", self.root / "cache"
        self.credentials = self.root / "credentials"
        self.home = self.root / "home"  # HOME: empty and read-only, like a dynamic user's "/"
        for d in (self.state_base, self.cache_base, self.credentials, self.home):
            d.mkdir(exist_ok=True)
        self.state_dirs = [self.state_base / n for n in self.unit.values("StateDirectory")]
        self.cache_dirs = [self.cache_base / n for n in self.unit.values("CacheDirectory")]
        for d in self.state_dirs + self.cache_dirs:
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, uid, gid)  # systemd hands them to the dynamic user
            os.chmod(d, 0o700)
        os.chmod(self.credentials, 0o500)
        os.chown(self.credentials, uid, gid)

    # ---- the unit's settings ----------------------------------------------------------------
    def expand(self, value: str) -> str:
        """systemd specifiers for this sandbox: %S state, %C cache, %d credentials, %% literal."""
        table = {"S": str(self.state_base), "C": str(self.cache_base), "d": str(self.credentials), "%": "%",
                 "h": str(self.home)}
        value = re.sub(r"%(.)", lambda m: table.get(m.group(1), m.group(0)), value)
        for base, real in ((self.state_base, "/var/lib/"), (self.cache_base, "/var/cache/")):
            value = re.sub(rf"(?<![\w/]){re.escape(real)}", f"{base}/", value)  # literal paths too
        return value

    def add_credential(self, name: str, data: bytes | str) -> Path:
        """As LoadCredential=: a copy only the service user can read."""
        path = self.credentials / name
        os.chmod(self.credentials, 0o700)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        os.chmod(path, 0o400)
        os.chown(path, self.uid, self.gid)
        os.chmod(self.credentials, 0o500)
        return path

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """What systemd gives the service: a plain PATH and locale, the user, the directories'
        variables and the unit's Environment= lines; then `extra` (test plumbing only)."""
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
               "HOME": str(self.home), "USER": "elasticyolo", "LOGNAME": "elasticyolo", "SHELL": "/usr/sbin/nologin",
               "STATE_DIRECTORY": ":".join(map(str, self.state_dirs)),
               "CACHE_DIRECTORY": ":".join(map(str, self.cache_dirs)),
               "CREDENTIALS_DIRECTORY": str(self.credentials)}
        for name, value in self.unit.environment():
            env[name] = self.expand(value)
        env.update(extra or {})
        return env

    @property
    def working_directory(self) -> str:
        return self.expand(self.unit.value("WorkingDirectory", "/") or "/")

    def syscall_allowlist(self) -> Path:
        path = self.root / "syscalls.allow"
        path.write_text("\n".join(expand_syscall_filter(self.unit.values("SystemCallFilter"))) + "\n")
        os.chmod(path, 0o644)
        return path

    def command(self, argv: list[str]) -> list[str]:
        """`argv` wrapped: new mount namespace, read-only system, unprivileged, filtered."""
        writable = " ".join(str(d) for d in self.state_dirs + self.cache_dirs)
        inner = [shutil.which("setpriv") or "setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                 "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
        if self.seccomp and self.unit.values("SystemCallFilter"):
            inner += [SYSTEM_PYTHON, str(SECCOMP_EXEC), str(self.syscall_allowlist()), "--"]
        inner += ["/bin/sh", "-c", 'cd "$0" && exec "$@"', self.working_directory, *argv]
        keep = " ".join(kept_under_tmp([REPO_ROOT, Path(sys.prefix), self.root]))
        return [shutil.which("unshare") or "unshare", "-m", "--propagation", "private", "--",
                "/bin/sh", "-c", _SETUP, "sandbox", writable, keep, *inner]

    @staticmethod
    def available() -> str | None:
        """None when this machine can run sandboxes, else why not."""
        if os.geteuid() != 0:
            return "needs root (mount namespaces)"
        for tool in ("unshare", "setpriv", "systemd-analyze"):
            if shutil.which(tool) is None:
                return f"{tool} not installed"
        r = subprocess.run([SYSTEM_PYTHON, "-c", "import seccomp"], capture_output=True)
        if r.returncode != 0:
            return "python3-seccomp not installed"
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
        if r.returncode != 0:
            return f"unshare -m failed: {r.stderr.decode().strip()}"
        return None
