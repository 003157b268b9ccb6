"""A worker's fatal error: the line it writes for its agent, what the agent publishes (real etcd),
the failed job's reason, and how `status` shows them."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.worker_runtime.worker_errors import (MAX_REASON_CHARS, WorkerErrors, failure_reason, one_line, read_pending,
                                               reason_text, record, signal_reason)
from elasticyolo.errors import UnavailableError
from elasticyolo.local_cluster.agents import ELASTICYOLO
from elasticyolo.local_cluster.servers import EtcdCluster
from elasticyolo.log import get_logger
from elasticyolo.status import collect, render_table


def test_reasons_are_one_capped_line_and_shared_ones_are_named_once() -> None:
    assert one_line("\n  first line  \nsecond") == "first line"
    long = one_line("x" * 1000)
    assert len(long) == MAX_REASON_CHARS and long.endswith("…")
    errors = [{"node": "n2", "reason": "data.yaml not found", "at": 2.0},
              {"node": "n1", "reason": "data.yaml not found", "at": 1.0},
              {"node": "n3", "reason": "CUDA out of memory", "at": 3.0}]
    assert reason_text(errors) == "n1, n2: data.yaml not found; n3: CUDA out of memory"
    assert signal_reason(-9) == "killed by SIGKILL (out of memory? the kernel's OOM killer sends it)"
    assert signal_reason(-11) == "killed by SIGSEGV" and signal_reason(1) is None and signal_reason(0) is None


def test_a_failing_worker_leaves_its_reason_for_its_agent(tmp_path: Path) -> None:
    env = {**os.environ, "ELASTICYOLO_PARENT_PID": str(os.getpid()), "ELASTICYOLO_WORKER_DIR": str(tmp_path),
           "HOROVOD_LOCAL_RANK": "1"}
    r = subprocess.run([ELASTICYOLO, "worker", "data=/nowhere/data.yaml"], capture_output=True, text=True,
                       timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == "elasticyolo worker: error: /nowhere/data.yaml: data.yaml not found\n"
    (rec,) = read_pending(tmp_path)
    assert (rec["reason"], rec["code"], rec["slot"]) == ("/nowhere/data.yaml: data.yaml not found", 2, 1)
    assert read_pending(tmp_path) == []  # read once
    # Outside an agent (plain horovodrun / torchrun) nobody reads it: nothing is written.
    assert record("boom", 1, environ={"ELASTICYOLO_WORKER_DIR": str(tmp_path)}) is None


def test_the_agent_publishes_errors_and_the_failed_job_carries_them(etcd_server: EtcdCluster, job_name: str,
                                                                  tmp_path: Path) -> None:
    client, keys = EtcdClient(etcd_server.endpoints), JobKeys(job_name)
    generation = client.put(keys.spec, json.dumps({"data": "/data/x.yaml"}))
    client.put(keys.state, json.dumps({"state": "running", "at": time.time()}))
    # A previous submission's error is not this one's.
    client.put(keys.error("n3"), json.dumps({"node": "n3", "reason": "old", "generation": generation - 1, "at": 1.0}))
    env = {"ELASTICYOLO_PARENT_PID": "1", "ELASTICYOLO_WORKER_DIR": str(tmp_path / "n2")}
    published = WorkerErrors(client, keys, "n2", get_logger("test"))
    record("/data/x.yaml: data.yaml not found", 2, slot=0, environ=env)
    (sent,) = published.publish_pending(tmp_path / "n2", generation)
    assert sent["node"] == "n2" and sent["generation"] == generation
    record("/data/x.yaml: data.yaml not found", 2, slot=0, environ=env)  # a retried start: not again
    assert published.publish_pending(tmp_path / "n2", generation) == []
    events = [json.loads(v) for _k, v, _r in client.get_prefix(keys.events)]
    assert [e["kind"] for e in events] == ["worker_error"] and events[0]["reason"].endswith("data.yaml not found")
    # A worker killed by a signal (no file: it could not write one), reported by its launcher.
    WorkerErrors(client, keys, "n1", get_logger("test")).publish_pending(
        tmp_path / "n1", generation, {"pid": 4242, "slot": 0, "code": -9})

    reason = failure_reason(client, keys, "workers failed: ['n1[0]', 'n2[0]']")
    assert reason == ("workers failed: ['n1[0]', 'n2[0]']: n2: /data/x.yaml: data.yaml not found; "
                      "n1: killed by SIGKILL (out of memory? the kernel's OOM killer sends it)")
    client.put(keys.state, json.dumps({"state": "failed", "at": time.time(), "reason": reason}))
    view = collect(client, keys)
    assert view["reason"] == reason and view["generation"] == generation
    assert [(e["node"], e["code"]) for e in view["worker_errors"]] == [("n1", -9), ("n2", 2)]
    table = render_table(view).splitlines()
    assert table[1] == f"REASON {reason}"
    at = table.index("WORKER ERRORS (the latest of each node)")
    assert table[at + 2].startswith("  n2: /data/x.yaml: data.yaml not found  (slot 0, exit 2, ")


def test_a_torch_workers_record_names_its_round_and_whether_it_reached_a_peer(tmp_path: Path,
                                                                           monkeypatch: Any) -> None:
    from elasticyolo.worker_runtime import worker_errors

    env = {"ELASTICYOLO_PARENT_PID": "900", "ELASTICYOLO_WORKER_DIR": str(tmp_path), "TORCHELASTIC_RESTART_COUNT": "2"}
    warm = {k: v for k, v in env.items() if k != "TORCHELASTIC_RESTART_COUNT"}  # a warm worker before its round

    def written(reason: str, environ: dict[str, str]) -> dict[str, Any]:
        record(reason, 2, slot=0, environ=environ)
        (rec,) = read_pending(tmp_path)  # one file per process: read each before the next
        return rec

    monkeypatch.setattr(worker_errors, "_joined", False)
    assert (written("setup failed", env)["round"], written("setup failed", env)["joined"]) == ("900:2", False)
    assert written("warm worker failed", warm)["round"] is None
    worker_errors.joined_world()
    assert written("collective failed", env)["joined"] is True
    seen: list[dict[str, Any]] = []

    # The agent's observer sees every record, repeats included (the event log leaves repeats out).
    class Offline:
        def txn(self, *_: Any) -> None:
            raise UnavailableError("etcd down")

    errors = WorkerErrors(Offline(), JobKeys("j"), "n1", get_logger("test"), observe=seen.append)  # type: ignore[arg-type]
    for _ in range(2):
        record("same again", 2, slot=0, environ=env)
        errors.publish_pending(tmp_path, 5)
    assert [r["reason"] for r in seen] == ["same again", "same again"] and seen[0]["generation"] == 5
