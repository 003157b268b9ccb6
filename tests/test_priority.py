"""The agent's and etcd's priority reaches their sessions where the kernel shares CPU time among
sessions first (autogroup): real processes, read back from /proc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elasticyolo.priority import AGENT_NICE, SESSION_NICE_FILE, priority_prefix

pytestmark = pytest.mark.skipif(not SESSION_NICE_FILE.exists() or os.geteuid() != 0,
                                reason="needs a kernel with autogroup, and root to raise a priority")

READ_BACK = "import os; from elasticyolo.priority import as_agent; as_agent(); " \
            "print(open('/proc/self/autogroup').read().split()[-1], os.getpriority(os.PRIO_PROCESS, 0))"


def _run(cmd: list[str], new_session: bool) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60,
                          start_new_session=new_session).stdout.strip()


def test_an_agent_that_leads_its_session_raises_the_session() -> None:
    assert _run([sys.executable, "-c", READ_BACK], new_session=True) == f"{AGENT_NICE} {AGENT_NICE}"


def test_an_agent_inside_another_session_leaves_that_session_alone() -> None:
    session_nice = SESSION_NICE_FILE.read_text().split()[-1]
    assert _run([sys.executable, "-c", READ_BACK], new_session=False) == f"{session_nice} {AGENT_NICE}"


def test_the_priority_prefix_sets_the_program_and_its_session() -> None:
    out = _run(priority_prefix(-3) + ["sh", "-c", "cat /proc/self/autogroup; nice"], new_session=True)
    assert out.split()[-3:] == ["nice", "-3", "-3"]  # the session's nice, then the program's
