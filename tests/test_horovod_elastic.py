"""Real `horovodrun` elastic jobs (Gloo, loopback) training a real YOLO model on generated data.

Scenarios: a worker SIGKILLed mid-epoch (world 2 -> 1) and a host added (world 1 -> 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from elasticyolo.data.synth import SynthSpec, write_dataset
from support.horovod_run import HorovodElasticJob
from elasticyolo.local_cluster.trace import assert_each_epoch_exactly_once
from elasticyolo.train.policy import resize_ramp

N_TRAIN = 48
RAMP = 3  # resize_warmup_steps


def assert_ramp(scales: list[float], old: float, new: float) -> None:
    """The linear policy: after a resize the LR scale goes linearly from the old world's to the
    new world's over RAMP optimizer steps (step i uses the scale reached after i steps)."""
    expected = [resize_ramp(old, new, i, RAMP) for i in range(len(scales))]
    assert scales == pytest.approx(expected), (scales, expected)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), SynthSpec(train=N_TRAIN, val=8, imgsz=64, classes=2))


def worker_args(data: Path, epochs: int = 2) -> list[str]:
    # batch 4, nbs 8 -> accumulate 2 at reference world 1; one commit per step so the rollback
    # point is exact; val off to keep the test short (validation is tested elsewhere).
    # workers=2: batches come from two prefetching loader processes per worker.
    return [f"model=yolov8n.yaml", f"data={data}", f"epochs={epochs}", "imgsz=64", "batch=4", "nbs=8",
            "warmup_epochs=0", "close_mosaic=0", "commit_every=1", "val=false", "policy=linear",
            f"resize_warmup_steps={RAMP}", "workers=2"]


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator:
    jobs: list[HorovodElasticJob] = []

    def make(hosts: list[str], args: list[str], **kw) -> HorovodElasticJob:  # type: ignore[no-untyped-def]
        job = HorovodElasticJob(tmp_path, hosts, args, **kw)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.stop()


def assert_exactly_once(events: list[dict], epochs: int) -> None:
    assert_each_epoch_exactly_once(events, epochs, N_TRAIN)


def assert_prefetch_discarded(events: list[dict], pid: int, after: float, world: int) -> None:
    """Batches come from the loader's processes; when `pid` resumed at `world` after `after`, the
    batches it had prefetched for the old world were discarded unused (the step records hold the
    indices of the batches really trained, which the exactly-once check reads)."""
    loaders = [e for e in events if e["ev"] == "loader"]
    assert loaders and all(e["workers"] == 2 for e in loaders), loaders
    replans = [e for e in events if e["ev"] == "replan" and e["pid"] == pid and e["t"] > after]
    assert replans and replans[0]["new"][2] == world and replans[0]["dropped"] > 0, replans


def test_sigkill_worker_mid_epoch_survivor_continues(dataset: Path, job_factory) -> None:  # type: ignore[no-untyped-def]
    # Two local host names with one slot each: with one host, Horovod blacklists the whole host.
    job = job_factory(["localhost:1", "127.0.0.1:1"], worker_args(dataset), min_np=1, max_np=2).start()
    job.wait_for(lambda: [s for s in job.steps(world=2) if s["epoch"] == 0 and s["step"] >= 2], 180,
                 "two steps at world size 2")
    victim_rank = 1
    job.kill_rank(victim_rank)
    rc = job.wait(300)
    assert rc == 0, job.log_tail()
    events = job.events()
    kill_t = max(e["t"] for e in events if e["ev"] == "step" and e["world"] == 2)
    survivor_resumes = [e for e in events if e["ev"] == "resume" and e["world"] == 1 and e["t"] > kill_t]
    assert survivor_resumes, "survivor never resumed at world size 1"
    resume = survivor_resumes[0]
    # It continued from its last commit before the failure.
    commits = [e for e in events if e["ev"] == "commit" and e["pid"] == resume["pid"] and e["t"] < resume["t"]]
    assert resume["step"] == commits[-1]["step"]
    # The LR follows the linear policy: ramps from 2x to 1x over resize_warmup_steps.
    after = [e for e in events if e["ev"] == "step" and e["world"] == 1 and e["t"] > resume["t"]]
    assert len(after) > RAMP, "too few steps after the resize"
    assert_ramp([e["lr_scale"] for e in after], 2.0, 1.0)
    # The survivor dropped what it had prefetched for world 2, and trained every sample of every
    # epoch exactly once, counting only committed work.
    assert_prefetch_discarded(events, resume["pid"], kill_t, world=1)
    assert_exactly_once(events, epochs=2)
    assert "done: epochs=2" in job.log_tail(200)


def test_added_host_grows_world_and_receives_committed_state(dataset: Path, job_factory) -> None:  # type: ignore[no-untyped-def]
    # Long enough (5 epochs) that the newcomer, which needs several seconds to import torch and
    # Ultralytics on a busy machine, joins well before the end.
    # Plain horovodrun starts the newcomer cold: the running worker waits in Gloo's rendezvous
    # until the newcomer reaches hvd.init(), so the Gloo timeout must outlast that start.
    # channels_last=true: the NHWC layout a GPU trains in (layout.py), through Horovod's gradient
    # all-reduce and the newcomer's state sync.
    job = job_factory(["localhost:1"], worker_args(dataset, epochs=5) + ["channels_last=true"], min_np=1, max_np=2,
                      np=1, gloo_timeout_s=90).start()
    job.wait_for(lambda: len(job.steps(world=1)) >= 2, 180, "two steps at world size 1")
    job.set_hosts(["localhost:1", "127.0.0.1:1"])
    job.wait_for(lambda: job.steps(world=2), 240, "a step at world size 2")
    rc = job.wait(300)
    assert rc == 0, job.log_tail()
    events = job.events()
    first_w2 = min(e["t"] for e in events if e["ev"] == "step" and e["world"] == 2)
    resumes = [e for e in events if e["ev"] == "resume" and e["world"] == 2 and e["t"] < first_w2]
    assert {e["rank"] for e in resumes} == {0, 1}
    # The newcomer received the committed state: same step, same parameters as rank 0.
    assert len({e["step"] for e in resumes}) == 1
    assert resumes[0]["params_digest"] == pytest.approx(resumes[1]["params_digest"], rel=1e-9)
    assert resumes[0]["step"] >= 2
    w2_steps = [e for e in events if e["ev"] == "step" and e["world"] == 2 and e["rank"] == 0]
    assert_ramp([e["lr_scale"] for e in w2_steps], 1.0, 2.0)
    rank0 = next(e for e in resumes if e["rank"] == 0)
    assert_prefetch_discarded(events, rank0["pid"], rank0["t"], world=2)
    assert_exactly_once(events, epochs=5)
