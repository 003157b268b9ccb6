"""One CPU share per simulated node (testing/cpu_slices.py): a process started through a node's
prefix lands in that node's cgroup, its children follow, the quota binds, nodes are spread over
the cores, and closing removes every cgroup (killing what is left)."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from elasticyolo.testing.agent_cluster import AgentCluster
from elasticyolo.testing.cpu_slices import CpuSlices, cgroup_root, default_cpus_per_node, host_cpus
from elasticyolo.testing.wait import wait_for

needs_cgroups = pytest.mark.skipif(cgroup_root() is None, reason="no writable cgroup CPU controller")
BURN = ("import json, time\nt = time.process_time()\nend = time.time() + 2\nwhile time.time() < end: pass\n"
        "print(json.dumps([time.process_time() - t, open('/proc/self/cgroup').read()]))")


def test_default_share_fits_the_busiest_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("elasticyolo.testing.cpu_slices.host_cpus", lambda: [0, 1])
    assert default_cpus_per_node(4) == pytest.approx(0.4375)  # (2 - 0.25) / 4; two nodes per core
    assert default_cpus_per_node(3) == pytest.approx(0.4375)  # two of the three share a core
    assert default_cpus_per_node(1) == pytest.approx(0.875)  # one core less the reserve's share
    monkeypatch.setattr("elasticyolo.testing.cpu_slices.host_cpus", lambda: list(range(16)))
    assert default_cpus_per_node(4) == pytest.approx(1 - 0.25 / 16)


@needs_cgroups
def test_a_node_process_is_held_to_its_quota_and_pinned() -> None:
    with CpuSlices(0.25) as slices:
        procs = [subprocess.Popen([*slices.prefix(n), sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
                 for n in ("a", "b")]
        try:
            burned, cgroups = zip(*(json.loads(p.communicate(timeout=30)[0]) for p in procs))
        finally:
            for p in procs:
                p.kill()
        for node, cg in zip(("a", "b"), cgroups):
            assert f"/{slices.parent.name}/{node}" in cg
        # 2 s of wall time at a quarter of a CPU (the quota's granularity leaves some slack).
        assert all(0.2 < b < 0.9 for b in burned), burned
        if slices.pin_root is not None and len(host_cpus()) > 1:
            assert slices.core_of("a") != slices.core_of("b")  # spread over the cores
        assert all(t > 0 for t in slices.throttled_s().values())
    assert not slices.parent.exists()


@needs_cgroups
def test_close_kills_what_is_left_and_removes_the_cgroups() -> None:
    slices = CpuSlices(0.5)
    p = subprocess.Popen([*slices.prefix("n1"), sys.executable, "-c",
                          "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    child = wait_for(lambda: psutil.Process(p.pid).children()[0], 20, "the node's child process")
    assert f"/{slices.parent.name}/n1" in open(f"/proc/{child.pid}/cgroup").read()  # children follow
    slices.release("n1")
    slices.prefix("n2")
    assert slices.core_of("n2") == slices.core_of("n1")  # a released node's core takes the next one
    slices.close()
    assert p.wait(timeout=10) == -9
    psutil.wait_procs([child], timeout=10)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert not slices.parent.exists() and (slices.pin_root is None or not slices.pin_root.exists())


@needs_cgroups
def test_agents_run_in_their_nodes_slices(cluster: AgentCluster) -> None:
    """How `chaos replay` starts a node: a real agent, through its slice's prefix."""
    with CpuSlices(0.4) as slices:
        for node in ("n1", "n2"):
            cluster.start(node, prefix=slices.prefix(node))
        cluster.wait(lambda: set(cluster.nodes()) == {"n1", "n2"}, 60, "both agents registered")
        for node in ("n1", "n2"):
            proc = cluster.agents[node].proc
            assert proc is not None
            assert f"/{slices.parent.name}/{node}" in open(f"/proc/{proc.pid}/cgroup").read()
            if slices.pin_root is not None:
                assert psutil.Process(proc.pid).cpu_affinity() == [slices.core_of(node)]
        cluster.stop()
