"""The agent's and etcd's priority reaches their sessions where the kernel shares CPU time among
sessions first (autogroup): real processes, read back from /proc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elasticyolo.priority import AGENT_NICE, priority_prefix, session_nice

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/autogroup") or os.geteuid() != 0,
                                reason="needs a kernel with autogroup, and root to raise a priority")

READ_BACK = "import os; from elasticyolo.priority import as_agent, session_nice; as_agent(); " \
            "print(session_nice(), os.getpriority(os.PRIO_PROCESS, 0))"


def _run(cmd: list[str], new_session: bool) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60,
                          start_new_session=new_session).stdout.strip()


def test_an_agent_that_leads_its_session_raises_the_session() -> None:
    assert _run([sys.executable, "-c", READ_BACK], new_session=True) == f"{AGENT_NICE} {AGENT_NICE}"


def test_an_agent_inside_another_session_leaves_that_session_alone() -> None:
    # This session may be in no autogroup (a container's cgroup): then both read None.
    assert _run([sys.executable, "-c", READ_BACK], new_session=False) == f"{session_nice()} {AGENT_NICE}"


def test_an_agent_never_lowers_its_session() -> None:
    cmd = priority_prefix(AGENT_NICE - 2) + [sys.executable, "-c", READ_BACK]
    assert _run(cmd, new_session=True) == f"{AGENT_NICE - 2} {AGENT_NICE - 2}"


def test_the_priority_prefix_sets_the_program_and_its_session() -> None:
    out = _run(priority_prefix(-3) + ["sh", "-c", "cat /proc/self/autogroup; nice"], new_session=True)
    assert out.split()[-3:] == ["nice", "-3", "-3"]  # the session's nice, then the program's


def test_the_priority_prefix_leaves_a_session_it_does_not_lead() -> None:
    out = _run(priority_prefix(-3) + [sys.executable, "-c", "from elasticyolo.priority import session_nice; "
                                      "import os; print(session_nice(), os.getpriority(os.PRIO_PROCESS, 0))"],
               new_session=False)
    assert out == f"{session_nice()} -3"
