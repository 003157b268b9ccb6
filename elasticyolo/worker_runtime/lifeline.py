"""Die with the parent: `PR_SET_PDEATHSIG(SIGKILL)` for every process an agent starts (Linux).

Why: SIGKILL of an agent must take its workers down (an orphan keeps training in a world its
peers left; torch elastic's agent does not kill its workers when it is itself killed, and starts
them in their own sessions, so a process-group kill misses them).

How: the parent writes its pid into the child's environment (`ELASTICYOLO_PARENT_PID`, see
`spawn.py` / `worker_env.py`); the child arms the death signal first thing, then compares its
parent with that pid. That also catches a parent that died *before* the child started (the
child was re-parented already, so `getppid()` alone would look fine). Done in the child, not in a
`preexec_fn`, because the agent has threads (preexec_fn is unsafe there).

The signal fires when the parent *thread* that forked the child exits: spawn from a thread that
lives as long as the child (the agent's loop thread, a supervisor thread that waits on it, torch's
agent main thread).

`python -m elasticyolo.worker_runtime.lifeline MODULE [ARGS...]` runs MODULE the same way; without the
variable (e.g. under plain torchrun) the parent is whoever started us. No torch here.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

from elasticyolo.priority import as_worker
from elasticyolo.worker_runtime.worker_env import ENV_PARENT_PID

PR_SET_PDEATHSIG = 1
EXIT_ORPHANED = 137  # as if SIGKILLed together with the parent


def _arm(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` when our parent dies. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when `parent` dies (default: the pid in `ELASTICYOLO_PARENT_PID`, else
    our current parent); exit at once if it is already gone."""
    if parent is None:
        raw = os.environ.get(ENV_PARENT_PID)
        parent = int(raw) if raw and raw.isdigit() else os.getppid()
    _arm()
    if os.getppid() != parent:
        os._exit(EXIT_ORPHANED)


def die_with_agent() -> None:
    """Only when started by an agent (`ELASTICYOLO_PARENT_PID` set): `elasticyolo worker` also runs
    under plain horovodrun, whose per-slot threads must not be mistaken for a lifelong parent."""
    if os.environ.get(ENV_PARENT_PID):
        die_with_parent()
        as_worker()  # the agent runs above its workers (priority.py); they do not


def main() -> None:
    die_with_parent()
    if len(sys.argv) < 2:
        print("usage: python -m elasticyolo.worker_runtime.lifeline MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
