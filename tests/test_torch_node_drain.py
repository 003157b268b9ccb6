"""The torch node plug-in's drain kills a launcher that is still running near the node's deadline
(agent side, a real child process; no torch, no etcd)."""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

from elasticyolo.engines import registry
from elasticyolo.engines.torch.node import LauncherProcess, TorchNode
from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.worker_runtime.worker_env import WorkerEnv

# A launcher that swallowed its SIGTERM (seen in CI: it trained on 17 s, to the drain deadline).
DEAF = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"]


def ignores_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(line.split()[1] for line in f if line.startswith("SigIgn:"))
    return bool(int(mask, 16) & (1 << (15 - 1)))


def test_a_drains_launcher_is_killed_before_the_nodes_deadline_not_after_its_grace(tmp_path) -> None:
    drain = SimpleNamespace(deadline=0.0)
    agent = SimpleNamespace(cfg=SimpleNamespace(), drain=drain, wake=lambda: None)
    node = TorchNode(engine=registry.get("torch"), agent=agent, stop_grace_s=60.0)
    node.drain = SimpleNamespace(kill_lead_s=1.0)  # type: ignore[assignment]
    node._proc = LauncherProcess(1, DEAF, dict(os.environ), WorkerEnv(worker_dir=str(tmp_path)), on_exit=lambda: None)
    wait_for(lambda: ignores_sigterm(node._proc.pid), 10, "the launcher up")  # type: ignore[union-attr, arg-type]
    t0 = time.monotonic()
    drain.deadline = t0 + 3.0
    node.stop_workers("draining")
    assert node.running_workers() == 1  # SIGTERM sent, ignored; the deadline is 3 s away
    wait_for(lambda: (node.stop_workers("draining"), node.running_workers() == 0)[1], 10,
             "the launcher killed", interval=0.1)
    took = time.monotonic() - t0
    assert 1.5 < took < 3.0, took  # at the deadline minus the kill lead, not 60 s after SIGTERM
