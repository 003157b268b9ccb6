"""The agent's and etcd's priority reaches their sessions where the kernel shares CPU time among
sessions first (autogroup): real processes, read back from /proc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elasticyolo.priority import AGENT_NICE, WORKER_NICE, as_node_daemon, priority_prefix, session_nice, threads_of

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


# A process with threads of its own (as a raylet, or a Ray worker before the actor's code runs).
THREADED = ("import threading, time\n"
            "for _ in range(3):\n"
            "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "print('ready', flush=True)\n")


def _nices(pid: int) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, tid) for tid in threads_of(pid)]


def test_a_node_daemon_is_raised_on_every_thread_and_never_lowered() -> None:
    proc = subprocess.Popen([sys.executable, "-c", THREADED + "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert as_node_daemon(proc.pid)
        assert _nices(proc.pid) == [AGENT_NICE] * 4
        os.setpriority(os.PRIO_PROCESS, threads_of(proc.pid)[1], AGENT_NICE - 2)
        assert as_node_daemon(proc.pid)
        assert sorted(_nices(proc.pid)) == [AGENT_NICE - 2] + [AGENT_NICE] * 3
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_started_by_a_raised_daemon_drops_every_thread_back() -> None:
    code = THREADED + ("import os\nfrom elasticyolo.priority import as_worker, threads_of\nas_worker()\n"
                       "print(sorted({os.getpriority(os.PRIO_PROCESS, t) for t in threads_of(os.getpid())}))")
    out = _run(priority_prefix(AGENT_NICE) + [sys.executable, "-c", code], new_session=False)
    assert out.splitlines()[-1] == f"[{WORKER_NICE}]"
