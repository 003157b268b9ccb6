"""Die with the parent: `python -m elasticyolo.engines.lifeline MODULE [ARGS...]`.

torch elastic's agent does not kill its workers when the agent itself is SIGKILLed, and it starts
them in their own sessions, so killing a process group does not reach them either. Asking the
kernel for SIGKILL on parent death (PR_SET_PDEATHSIG) before anything slow is imported closes the
window; the `getppid()` check covers a parent that died before the prctl took effect.

PDEATHSIG fires when the parent *thread* that forked us exits: whoever starts us must fork from a
thread that lives as long as we do (the agent hook's supervisor thread, torch's agent main thread).
No torch here.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def main() -> None:
    die_with_parent()
    if len(sys.argv) < 2:
        print("usage: python -m elasticyolo.engines.lifeline MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
