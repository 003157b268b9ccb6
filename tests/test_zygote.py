"""The warm pool's zygote (worker_runtime/zygote.py): children forked from a real zygote process behave as
the fresh processes they replace (stdin, stdout, exit codes, signals, session, environment,
working directory, lifeline), and the zygote outlives a close only as long as its children; the
same for a zygote forked from its owner (the torch launcher's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.processes import running
from elasticyolo.worker_runtime.spawn import child_env
from elasticyolo.worker_runtime.worker_env import ENV_PARENT_PID, WorkerEnv
from elasticyolo.worker_runtime.zygote import Zygote, ZygoteError

PROBE = """
import gc, json, os, sys
line = sys.stdin.readline()
print(json.dumps({"line": line.strip(), "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
                  "parent": os.environ.get("%s"), "ppid": os.getppid(), "sid": os.getsid(0), "pid": os.getpid(),
                  "argv": sys.argv[1:], "frozen": gc.get_freeze_count(),
                  "cmdline": open("/proc/self/cmdline").read().replace("\\0", " ").strip()}), flush=True)
if line.strip() == "wait":
    sys.stdin.readline()
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
""" % ENV_PARENT_PID


@pytest.fixture(params=["spawned", "forked"])
def zygote(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Both kinds: spawned by the pool (a fresh interpreter) and forked from its owner
    (`Zygote.fork_here`, as the torch launcher does), which finds modules on the owner's path."""
    (tmp_path / "zprobe.py").write_text(textwrap.dedent(PROBE))
    if request.param == "spawned":
        z = Zygote(["json"], _path_env(tmp_path), WorkerEnv(), cwd=tmp_path)
    else:
        monkeypatch.syspath_prepend(str(tmp_path))
        z = Zygote.fork_here(["json"])
        assert z.proc.pid != os.getpid()
        wait_for(lambda: os.getsid(z.proc.pid) == z.proc.pid, 10, "the forked zygote in a session of its own")
    yield z
    z.kill()
    wait_for(lambda: z.proc.poll() is not None, 30, "the killed zygote reaped")


def _path_env(tmp_path: Path) -> dict[str, str]:
    """This environment with `tmp_path` (the probe modules) first on the zygote's path: the zygote
    imports elasticyolo from wherever this process does."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def _fork(z: Zygote, tmp_path: Path, **env: str):  # type: ignore[no-untyped-def]
    return z.fork("zprobe", ["a", "b"], child_env({**os.environ, **env}), tmp_path / "cwd", timeout_s=60)


def test_a_forked_child_is_a_fresh_process_with_the_pools_environment(zygote: Zygote, tmp_path: Path) -> None:
    (tmp_path / "cwd").mkdir()
    child = _fork(zygote, tmp_path, PROBE_VALUE="from-the-pool", PROBE_EXIT="3")
    child.stdin.write(b"hello\n")
    child.stdin.close()
    seen = json.loads(child.stdout.readline())
    assert child.wait(30) == 3 and child.poll() == 3
    assert seen["line"] == "hello" and seen["argv"] == ["a", "b"]
    assert seen["env"] == "from-the-pool" and seen["cwd"] == str(tmp_path / "cwd")
    assert seen["pid"] == child.pid and seen["sid"] == child.pid  # its own session: killpg takes its tree
    assert seen["frozen"] > 1000  # its collector leaves what it inherited alone (gc.freeze)
    if zygote.proc.stdout is not None:  # spawned: ps shows what it runs, not the zygote
        # (a forked zygote's children can retitle themselves only where the owner imported
        # setproctitle before changing its environment, as the torch launcher does first thing;
        # under pytest, other tests have changed it by then)
        assert seen["cmdline"].endswith("-m zprobe a b")
    # Its lifeline parent is the zygote (it dies with it), not the pool that asked for it.
    assert seen["parent"] == str(zygote.proc.pid) == str(seen["ppid"])


def test_signals_reach_the_child_and_its_code_says_so(zygote: Zygote, tmp_path: Path) -> None:
    (tmp_path / "cwd").mkdir()
    child = _fork(zygote, tmp_path)
    child.stdin.write(b"wait\n")
    child.stdin.flush()
    assert json.loads(child.stdout.readline())["line"] == "wait"
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)  # still running
    os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM


def test_a_closed_zygote_waits_for_its_children_and_a_killed_one_takes_them(zygote: Zygote, tmp_path: Path) -> None:
    (tmp_path / "cwd").mkdir()
    child = _fork(zygote, tmp_path)
    child.stdin.write(b"wait\n")
    child.stdin.flush()
    child.stdout.readline()
    zygote.close()
    with pytest.raises(ZygoteError):
        _fork(zygote, tmp_path)  # no more forks
    assert zygote.alive  # a worker it handed over keeps training
    child.stdin.write(b"done\n")
    child.stdin.flush()
    assert child.wait(30) == 0
    wait_for(lambda: not zygote.alive, 30, "the zygote exits after its last child")

    # A killed zygote takes its children down (their lifeline) and says so.
    z2 = Zygote(["json"], _path_env(tmp_path), WorkerEnv(), cwd=tmp_path)
    try:
        orphan = _fork(z2, tmp_path)
        orphan.stdin.write(b"wait\n")
        orphan.stdin.flush()
        orphan.stdout.readline()
        z2.kill()
        assert orphan.wait(30) == -signal.SIGKILL
        wait_for(lambda: not running(orphan.pid), 30, "the orphaned child is gone")
    finally:
        z2.kill()


OWNER = """
import os, sys
from elasticyolo.exit_hooks import at_exit
from elasticyolo.worker_runtime.spawn import child_env
from elasticyolo.worker_runtime.zygote import Zygote

marks = sys.argv[1]

def mark(what):
    with open(marks, "a") as fh:
        fh.write(f"{what} {os.getpid()}\\n")

at_exit(mark, "owner-hook")  # registered before the zygote is forked: inherited by every child
z = Zygote.fork_here(["calendar"])
child = z.fork("calendar", ["2026", "12"], child_env(dict(os.environ)), None, timeout_s=60)
child.stdin.close()
out = child.stdout.read()
mark(f"child-exit-{child.wait(60)}-{int(b'December' in out)}")
z.kill()
"""


def test_a_forked_child_runs_its_own_exit_hooks_not_its_owners(tmp_path: Path) -> None:
    """An owner's exit hook (a loader pool's close, a rendezvous leave) acts on the owner's objects:
    a worker forked from the owner's zygote that ran it failed at exit (a segfault under pytest)
    or would leave the owner's rendezvous. It runs in the owner only, once."""
    (tmp_path / "owner.py").write_text(textwrap.dedent(OWNER))
    marks = tmp_path / "marks"
    proc = subprocess.run([sys.executable, str(tmp_path / "owner.py"), str(marks)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    marked = [line.split() for line in marks.read_text().splitlines()]
    assert [what for what, _ in marked] == ["child-exit-0-1", "owner-hook"], marked
    assert marked[0][1] == marked[1][1]  # the owner's


HELPER_TARGET = """
import os, sys

def report(q):
    q.put({"pid": os.getpid(), "ppid": os.getppid(), "torch": "torch" in sys.modules})
"""

HELPER_USER = """
import json
from multiprocessing import forkserver
from elasticyolo.mp import helper_context, start_fork_server
from zhelper_target import report

if __name__ == "__main__":  # the helper imports this module again
    start_fork_server()  # as a TrainCore does first (a no-op here: the zygote's is running)
    ctx = helper_context()
    q = ctx.SimpleQueue()
    p = ctx.Process(target=report, args=(q,))
    p.start()
    seen = q.get()
    p.join(30)
    print(json.dumps({**seen, "server": forkserver._forkserver._forkserver_pid, "code": p.exitcode}), flush=True)
"""


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_torch_zygotes_workers_share_its_helper_fork_server(tmp_path: Path) -> None:
    """The zygote forks the helpers' fork server from itself (no new interpreter, no new torch
    import) and every worker it forks starts its helpers there: a torch elastic round's new rank 0
    starts its uploader without importing torch again (mp.fork_shared_fork_server)."""
    (tmp_path / "zhelper_target.py").write_text(textwrap.dedent(HELPER_TARGET))
    (tmp_path / "zhelper_user.py").write_text(textwrap.dedent(HELPER_USER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    z = Zygote(["torch", "elasticyolo.mp"], env, WorkerEnv(), cwd=tmp_path)
    try:
        servers = set()
        for _ in range(2):  # two workers, one after the other (two rounds)
            child = z.fork("zhelper_user", [], child_env(env), tmp_path, timeout_s=120)
            child.stdin.close()
            seen = json.loads(child.stdout.readline())
            assert child.wait(60) == 0 and seen["code"] == 0
            assert seen["ppid"] == seen["server"] and seen["torch"]  # forked from the shared server
            assert _ppid(seen["server"]) == z.proc.pid  # which the zygote forked, not the worker
            servers.add(seen["server"])
        assert len(servers) == 1
        server = servers.pop()
        z.close()  # the server holds no child or socket of the zygote's: the zygote still ends
        wait_for(lambda: not z.alive, 30, "the zygote exits after its last child")
        wait_for(lambda: not running(server), 30, "the helpers' fork server gone with it")
    finally:
        z.kill()
