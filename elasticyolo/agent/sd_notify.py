"""systemd notifications over the plain NOTIFY_SOCKET datagram protocol (no library needed).

Without systemd (no NOTIFY_SOCKET) every call is a no-op, so the agent runs the same anywhere.
"""

from __future__ import annotations

import os
import select
import socket

# systemd shows STATUS= as one line; a newline would start another KEY=value of the message.
STATUS_MAX_CHARS = 400


class SystemdNotifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        if self.address and self.address.startswith("@"):
            self.address = "\0" + self.address[1:]  # abstract namespace socket
        self.watchdog_s = _watchdog_seconds(env)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send `KEY=value` lines in one datagram. Returns False (never raises) when it cannot.
        A STATUS= value is made one line and capped (STATUS_MAX_CHARS)."""
        if not self.address:
            return False
        lines = tuple(_one_line_status(line) for line in lines)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self.address)
                sock.sendall("\n".join(lines).encode("utf-8"))
            return True
        except OSError:
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def final_status(self, status: str, timeout_s: float = 5.0) -> bool:
        """STATUS= of a process about to exit, then wait until systemd has read it (BARRIER=1):
        otherwise systemd may see the exit first and the reason `systemctl status` should show is
        lost. True when systemd confirmed it."""
        return self.status(status) and self.barrier(timeout_s)

    def barrier(self, timeout_s: float = 5.0) -> bool:
        """sd_notify_barrier(): send BARRIER=1 with the write end of a pipe; systemd closes its copy
        once it has processed every notification sent before it, which ends the wait."""
        if not self.address:
            return False
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self.address)
                socket.send_fds(sock, [b"BARRIER=1"], [write_fd])
            os.close(write_fd)
            write_fd = -1
            poller = select.poll()
            poller.register(read_fd, select.POLLHUP)
            return bool(poller.poll(timeout_s * 1000))
        except OSError:
            return False
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str = "") -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))


def _one_line_status(line: str) -> str:
    if not line.startswith("STATUS="):
        return line
    text = " ".join(line[len("STATUS="):].split())
    if len(text) > STATUS_MAX_CHARS:
        text = text[:STATUS_MAX_CHARS - 3] + "..."
    return f"STATUS={text}"


def _watchdog_seconds(env: dict[str, str] | os._Environ[str]) -> float | None:
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 1e6
    except ValueError:
        return None
