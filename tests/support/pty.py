"""Run a command on a pseudo-terminal, as a person at a terminal does (progress bars, `rich`
tables and `--watch` take their terminal-only paths there, never through pipes)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable


def run_on_pty(argv: list[str], until: Callable[[str], bool] = lambda out: False, timeout: float = 30,
               interrupt: bool = False, cwd: str | Path | None = None) -> tuple[int, str]:
    """Run `argv` on a pty until it exits or `until(output)`; then, with `interrupt`, send Ctrl-C.
    Returns (exit status, everything it drew)."""
    master, slave = os.openpty()
    os.set_blocking(master, False)
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True, cwd=cwd,
                            env={**os.environ, "COLUMNS": "160", "LINES": "40", "TERM": "xterm-256color"})
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    interrupted = False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the pty closed: the process exited
                    break
                if not chunk:
                    break
                out += chunk
            if not interrupted and until(out.decode(errors="replace")):
                if not interrupt:
                    break
                proc.send_signal(signal.SIGINT)
                interrupted = True
            if proc.poll() is not None and not ready:
                break
        return proc.wait(10), out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)
