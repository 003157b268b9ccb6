"""Die with the agent: `PR_SET_PDEATHSIG` for worker processes (Linux).

The agent starts workers in their own session (so it can kill the whole tree) with
`ELASTICYOLO_PARENT_PID` set; the worker arms the death signal first thing, then checks that
its parent is still that pid, which closes the race of an agent dying between fork and prctl.
Done in the child rather than in a `preexec_fn` because the agent has threads (preexec_fn is
unsafe there). Note the signal fires when the *thread* that forked the child exits: the agent
spawns workers from its main loop thread, which lives as long as the agent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
ENV = "ELASTICYOLO_PARENT_PID"


def arm(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` when our parent dies. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def arm_from_env() -> None:
    """If started by an agent, die with it (and exit at once if it is already gone)."""
    parent = os.environ.get(ENV)
    if not parent:
        return
    arm()
    if os.getppid() != int(parent):
        os._exit(137)
