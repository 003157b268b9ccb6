"""A simulated node's CPUs (local_cluster/cpu_slices.py): a process started through a node's prefix
lands in the node's host cgroup and its children follow; one that enters the node's accelerator
(train/sim_accelerator.py) is held to its quota on its own core; nodes are spread over the cores;
a training worker trains on its accelerator while the agent, the zygote and the checkpoint
uploader stay on the host; closing removes every cgroup (killing what is left)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.cpu_slices import CpuSlices, cgroup_root, default_cpus_per_node, host_cpus
from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.train.sim_accelerator import HOROVOD_THREAD, INTERCONNECT_THREADS

needs_cgroups = pytest.mark.skipif(cgroup_root() is None, reason="no writable cgroup CPU controller")
BURN = ("import json, time\nfrom elasticyolo.train import sim_accelerator\nsim_accelerator.enter(helpers=False)\n"
        "t = time.process_time()\nend = time.time() + 2\nwhile time.time() < end: pass\n"
        "print(json.dumps([time.process_time() - t, open('/proc/self/cgroup').read()]))")


def test_default_share_fits_the_busiest_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("elasticyolo.local_cluster.cpu_slices.host_cpus", lambda: [0, 1])
    assert default_cpus_per_node(4) == pytest.approx(0.375)  # (2 - 0.5) / 4; two nodes per core
    assert default_cpus_per_node(3) == pytest.approx(0.375)  # two of the three share a core
    assert default_cpus_per_node(1) == pytest.approx(0.75)  # one core less the reserve's share
    monkeypatch.setattr("elasticyolo.local_cluster.cpu_slices.host_cpus", lambda: list(range(16)))
    assert default_cpus_per_node(4) == pytest.approx(1 - 0.5 / 16)


@needs_cgroups
def test_a_process_on_a_node_accelerator_is_held_to_its_quota_and_pinned() -> None:
    with CpuSlices(0.25) as slices:
        procs = [subprocess.Popen([*slices.prefix(n), sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
                 for n in ("a", "b")]
        try:
            burned, cgroups = zip(*(json.loads(p.communicate(timeout=30)[0]) for p in procs))
        finally:
            for p in procs:
                p.kill()
        for node, cg in zip(("a", "b"), cgroups):
            assert f"/{slices.parent.name}/{node}\n" in cg
        # 2 s of wall time at a quarter of a CPU (the quota's granularity leaves some slack).
        assert all(0.2 < b < 0.9 for b in burned), burned
        if slices.pin_root is not None and len(host_cpus()) > 1:
            assert slices.core_of("a") != slices.core_of("b")  # spread over the cores
        assert all(t > 0 for t in slices.throttled_s().values())
    assert not slices.parent.exists()


THREADS = """
import hashlib, json, threading, time
from elasticyolo.train import sim_accelerator

def burn(out):  # hashing a large buffer releases the GIL: the threads burn side by side
    t, data, h = time.thread_time(), bytes(1 << 20), hashlib.sha256()
    end = time.time() + 2
    while time.time() < end:
        h.update(data)
    out.append((time.thread_time() - t, open("/proc/thread-self/cgroup").read()))

go, before, after = threading.Event(), [], []
started_before = threading.Thread(target=lambda: (go.wait(), burn(before)))
started_before.start()
sim_accelerator.enter(helpers=False)
started_after = threading.Thread(target=lambda: (go.wait(), burn(after)))  # inherits the accelerator...
started_after.start()
sim_accelerator.enter(helpers=False)  # ...until the next enter (Horovod: each reset trains anew)
go.set()
main = []
burn(main)
started_before.join()
started_after.join()
print(json.dumps([main[0], before[0], after[0]]))
"""


@needs_cgroups
@pytest.mark.skipif(cgroup_root() is not None and cgroup_root()[1] != 1, reason="per-thread cgroups: v1 only")
def test_only_the_training_thread_counts_against_the_quota() -> None:
    """Horovod's background thread and the process group's threads run on a GPU node's host
    cores: started before or after the worker entered its accelerator, they are not held to it."""
    with CpuSlices(0.25) as slices:
        out = subprocess.run([*slices.prefix("a"), sys.executable, "-c", THREADS], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        (main_s, main_cg), *others = json.loads(out.stdout.splitlines()[-1])
        assert f"/{slices.parent.name}/a\n" in main_cg and 0.2 < main_s < 0.9, (main_s, main_cg)
        for burned, cg in others:
            assert f"/{slices.host_parent.name}/a\n" in cg and f"/{slices.parent.name}/" not in cg, cg
            assert burned > 0.8, others  # of 2 s; held to the quota, the three would share 0.5 s


# Appended to a script run in a slice: every thread's cgroups, by thread name.
THREAD_CGROUPS = """
out = {}
for tid in os.listdir("/proc/self/task"):
    name = open(f"/proc/self/task/{tid}/comm").read().strip()
    out.setdefault(name, []).append(open(f"/proc/self/task/{tid}/cgroup").read())
print(json.dumps(out))
"""


def thread_cgroups(slices: CpuSlices, script: str) -> dict[str, list[str]]:
    """Run `script` as node "a" of `slices`; its threads' cgroups by name."""
    out = subprocess.run([*slices.prefix("a"), sys.executable, "-c", script + THREAD_CGROUPS], capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


GLOO = """
import json, os, socket
import torch, torch.distributed as dist
from elasticyolo.train import sim_accelerator

torch.set_num_threads(1)  # as the replay's workers: the training thread alone computes
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
sim_accelerator.enter(helpers=False)
x = torch.ones(1 << 16); dist.all_reduce(x)
"""


@needs_cgroups
@pytest.mark.timeout(120)
@pytest.mark.skipif(cgroup_root() is not None and cgroup_root()[1] != 1, reason="per-thread cgroups: v1 only")
def test_the_process_groups_threads_run_on_the_interconnect() -> None:
    """A GPU world all-reduces over NCCL and the network, which no node's host work slows: torch's
    gloo threads go to the cluster's interconnect (no quota, the accelerators' weight), the
    training thread to its accelerator, the rest (the TCPStore's loop) to the host."""
    with CpuSlices(0.5) as slices:
        threads = thread_cgroups(slices, GLOO)
        interconnect = f"/{slices.interconnect.name}\n"
        gloo = [cg for name in INTERCONNECT_THREADS for cg in threads.get(name, [])]
        assert gloo and all(interconnect in cg for cg in gloo), threads
        assert all(f"/{slices.host_parent.name}/a\n" in cg for cg in threads["pt_tcpstore_uv"]), threads
        assert any(f"/{slices.parent.name}/a\n" in cg for cg in threads["python"]), threads
        assert (slices.interconnect / "cpu.cfs_quota_us").read_text().strip() == "-1"
    assert not slices.interconnect.exists()


HOROVOD = """
import json, os
import torch
import horovod.torch as hvd
from elasticyolo.engines.horovod.worker import init_horovod
from elasticyolo.train import sim_accelerator

torch.set_num_threads(1)
init_horovod()
sim_accelerator.enter(helpers=False)
hvd.allreduce(torch.ones(1 << 16), name="x")
"""


@needs_cgroups
@pytest.mark.timeout(120)
@pytest.mark.skipif(cgroup_root() is not None and cgroup_root()[1] != 1, reason="per-thread cgroups: v1 only")
def test_horovods_threads_run_on_the_interconnect() -> None:
    """Horovod's background loop runs every collective (and its gloo transport sends them): the
    threads `hvd.init()` starts are named `HOROVOD_THREAD` and go to the interconnect too."""
    with CpuSlices(0.5) as slices:
        threads = thread_cgroups(slices, HOROVOD)
        assert HOROVOD_THREAD in INTERCONNECT_THREADS
        assert threads.get(HOROVOD_THREAD) and all(f"/{slices.interconnect.name}\n" in cg
                                                   for cg in threads[HOROVOD_THREAD]), threads
        assert any(f"/{slices.parent.name}/a\n" in cg for cg in threads["python"]), threads


LATE_HELPER = ("import json, os\nfrom multiprocessing import forkserver\nfrom elasticyolo.train import sim_accelerator\n"
               "from elasticyolo.mp import start_fork_server\nsim_accelerator.enter(helpers=False)\n"
               "start_fork_server()\npid = forkserver._forkserver._forkserver_pid\n"
               "print(json.dumps([open('/proc/self/cgroup').read(), open(f'/proc/{pid}/cgroup').read(), "
               "sorted(os.sched_getaffinity(pid))]))")


@needs_cgroups
@pytest.mark.timeout(120)
def test_a_helper_server_started_after_entering_the_accelerator_runs_on_the_host() -> None:
    """A Horovod worker that becomes rank 0 starts the uploader's fork server while training:
    that server (and the uploader forked from it) goes to the node's host, unpinned."""
    with CpuSlices(0.5) as slices:
        out = subprocess.run([*slices.prefix("a"), sys.executable, "-c", LATE_HELPER], capture_output=True,
                             text=True, timeout=100)
        assert out.returncode == 0, out.stderr[-2000:]
        worker_cg, server_cg, server_cpus = json.loads(out.stdout.splitlines()[-1])
        assert f"/{slices.parent.name}/a\n" in worker_cg
        assert f"/{slices.host_parent.name}/a\n" in server_cg and f"/{slices.parent.name}/" not in server_cg
        assert server_cpus == host_cpus()


@needs_cgroups
def test_close_kills_what_is_left_and_removes_the_cgroups() -> None:
    slices = CpuSlices(0.5)
    p = subprocess.Popen([*slices.prefix("n1"), sys.executable, "-c",
                          "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    child = wait_for(lambda: psutil.Process(p.pid).children()[0], 20, "the node's child process")
    assert f"/{slices.host_parent.name}/n1\n" in open(f"/proc/{child.pid}/cgroup").read()  # children follow
    slices.release("n1")
    slices.prefix("n2")
    assert slices.core_of("n2") == slices.core_of("n1")  # a released node's core takes the next one
    slices.close()
    assert p.wait(timeout=10) == -9
    psutil.wait_procs([child], timeout=10)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert not slices.parent.exists() and not slices.host_parent.exists()
    assert slices.pin_root is None or not slices.pin_root.exists()


@needs_cgroups
@pytest.mark.timeout(300)
def test_a_node_trains_on_its_accelerator_and_runs_everything_else_on_its_host(
        cluster: AgentCluster, tmp_path: Path) -> None:
    """How `chaos replay` starts a node: a real agent through its prefix, then a real job. Only
    the training worker counts against the node's quota; the agent, its zygote and the checkpoint
    uploader (forked from the worker's fork server) run beside it, as on a GPU node's host cores."""
    data = write_dataset(tmp_path / "data", SynthSpec(train=16, val=4, imgsz=64, classes=2))
    with CpuSlices(0.4) as slices:
        cluster.start("n1", prefix=slices.prefix("n1"))
        cluster.wait(lambda: set(cluster.nodes()) == {"n1"}, 60, "the agent registered")
        agent = cluster.agents["n1"].proc
        assert agent is not None
        assert f"/{slices.host_parent.name}/n1\n" in open(f"/proc/{agent.pid}/cgroup").read()
        assert psutil.Process(agent.pid).cpu_affinity() == host_cpus()  # a host is not pinned
        cluster.submit("engine=horovod", "model=yolov8n.yaml", f"data={data}", "epochs=1000", "imgsz=64", "batch=4", "val=false",
                       "amp=false", "workers=0", "warmup_epochs=0", "save_period_steps=2",
                       f"checkpoint=file://{tmp_path / 'ckpt'}")
        cluster.wait(lambda: cluster.client.get(cluster.keys.checkpoint_latest), 240, "a checkpoint")

        def procs(group: Path) -> list[psutil.Process]:
            return [psutil.Process(int(p)) for p in (group / "cgroup.procs").read_text().split()]

        on_accel = procs(slices.parent / "n1")
        assert [" ".join(p.cmdline()) for p in on_accel if "worker" not in " ".join(p.cmdline())] == []
        assert len(on_accel) == 1, [p.cmdline() for p in on_accel]  # the one training process
        if slices.pin_root is not None:
            assert on_accel[0].cpu_affinity() == [slices.core_of("n1")]
        host = " ".join(" ".join(p.cmdline()) for p in procs(slices.host_parent / "n1"))
        assert "agent" in host and "forkserver" in host  # the uploader's fork server
        cluster.stop()


@needs_cgroups
def test_the_servers_run_weighed_above_the_hosts_and_this_process_leaves_their_group_on_close() -> None:
    """`chaos replay` starts etcd, the S3 server and the metadata servers after `serve_here`: they
    inherit its cgroup, weighed above the hosts, which weigh one process per node."""
    slices = CpuSlices(0.5, nodes=4)
    shares = "cpu.shares" if slices.version == 1 else "cpu.weight"

    def weight(group: Path) -> int:
        return int((group / shares).read_text())

    try:
        assert weight(slices.host_parent) == 4 * CpuSlices.PROCESS_WEIGHT[slices.version]
        assert weight(slices.servers) > weight(slices.host_parent)
        slices.serve_here()
        server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert f"/{slices.servers.name}\n" in open(f"/proc/{server.pid}/cgroup").read()
        finally:
            server.kill()
            server.wait()
    finally:
        slices.close()
    assert f"/{slices.servers.name}\n" not in open("/proc/self/cgroup").read()
    assert not slices.servers.exists()
