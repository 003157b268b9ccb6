"""`elasticyolo chaos replay` end to end: a few minutes of the real spot trace (K=3, F=20) against
real etcd, a real S3 API server, per-node metadata servers and agents training YOLO (or, for
engine=ray, the nodes of a local Ray cluster), for elasticyolo and the checkpoint-restart baseline;
the JSON's invariants, the PNG, and one-line input errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trace_data import REAL_TRACE

from elasticyolo.local_cluster.netns import unavailable as netns_unavailable

ELASTICYOLO = str(Path(sys.executable).with_name("elasticyolo"))
TRACE = REAL_TRACE
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} not found")


@needs_trace
@pytest.mark.slow  # ~4.5 min on 2 idle cores (~9 with accuracy, two replays): `make test-slow`
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("engine, accuracy", [("torch", False), ("torch", True), ("ray", False)])
def test_short_replay_end_to_end(tmp_path: Path, engine: str, accuracy: bool) -> None:
    if engine == "ray":
        pytest.importorskip("ray")
        if (why := netns_unavailable()) is not None:
            pytest.skip(f"the Ray replay runs in a network namespace: {why}")
    out, png = tmp_path / "replay.json", tmp_path / "replay.png"
    # Hours 1.43-1.53 at K=3, F=20: 3 nodes, one gets a 6 s notice at 9.6 s, one joins at 12.6 s.
    cmd = [ELASTICYOLO, "chaos", "replay", "--trace", str(TRACE), "--nodes", "3", "--compress", "20",
           "--start-hour", "1.43", "--hours", "0.1", "--calibrate-s", "2", "--train-images", "128",
           "--checkpoint-s", "60",
           # Shared CPUs: a CPU quota per node (the default where cgroups are writable) takes this
           # replay from ~4 to ~9 minutes; tests/test_cpu_slices.py runs agents in their slices.
           "--cpus-per-node", "0", "--engine", engine,
           "--json", str(out), "--plot", str(png), "--workdir", str(tmp_path / "work"),
           # The accuracy check (an uninterrupted run to the elastic job's last epoch, both
           # validated) adds ~2.5 min, a second replay of the window per system ~1.5:
           # `make test-slow` runs them.
           *(["--repeats", "2"] if accuracy else ["--no-accuracy"])]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1140)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "victim (seed 0): n2" in r.stdout and "goodput/ideal" in r.stdout
    fig = json.loads(out.read_text())
    assert png.stat().st_size > 10_000
    assert len(fig["changes"]) == 2 and fig["window"]["name"] == "hours 1.43-1.53"
    assert fig["cpus_per_node"] is None and "nodes share the CPUs" in r.stdout
    assert set(fig["ideal_samples_per_s"]) == {"1", "2", "3"}
    assert all(v > 0 for v in fig["ideal_samples_per_s"].values())
    spans = fig["calibration_spans_samples_per_s"]  # before and after the replay; their medians' mean is the ideal
    assert set(spans) == {"before", "after"}
    assert all(set(v) == {"1", "2", "3"} and all(len(r) == 3 for r in v.values()) for v in spans.values())
    systems = fig["systems"]
    assert set(systems) == {"elasticyolo", "checkpoint-restart"}
    for name, s in systems.items():
        assert s["ideal_samples"] > 0, name
        assert s["committed_samples"] >= 0 and s["lost_samples"] >= 0, name
        assert s["goodput_vs_ideal"] == pytest.approx(s["committed_samples"] / s["ideal_samples"], rel=1e-2)
        repeats = 2 if accuracy else 1
        # one per change of each replay
        assert len(s["pause_s"]) == 2 * repeats and all(p >= 0 for p in s["pause_s"]), name
        if accuracy:  # each replay's own figures beside their pooled ones
            assert len(s["repeats"]) == 2 and all(len(x["pause_s"]) == 2 for x in s["repeats"]), name
            assert s["committed_samples"] == pytest.approx(
                sum(x["committed_samples"] for x in s["repeats"]) / 2, abs=0.1), name
            assert "replay 2 of 2 starts" in r.stdout
        assert (s["duplicates"], s["skipped"]) == (0, 0), name
    assert systems["elasticyolo"]["committed_samples"] > 0
    if systems["checkpoint-restart"]["committed_samples"]:  # a restart can lose the whole window
        assert systems["checkpoint-restart"]["ratio_vs_baseline"] == 1.0
        assert systems["elasticyolo"]["ratio_vs_baseline"] > 0
    assert [c["kind"] for c in systems["elasticyolo"]["changes"]] == ["kill_notice", "join"] * repeats
    assert [a["kind"] for a in systems["elasticyolo"]["actions"]] == ["notice", "start", "kill"]
    assert all(len(s["windows"]) == repeats and s["windows"][0]["t_start"] < s["windows"][0]["t_stop"]
               for s in systems.values())
    assert [c["kind"] for c in systems["checkpoint-restart"]["changes"]] == ["restart", "restart"] * repeats
    proj = fig["projection"]
    assert proj["changes"] > 100 and set(proj["systems"]) == {"elasticyolo", "checkpoint-restart"}
    assert 0 < proj["systems"]["elasticyolo"]["goodput_vs_ideal"] <= 1
    assert {"elasticyolo.join", "elasticyolo.kill_notice", "checkpoint-restart.restart"} <= set(proj["costs_used"])
    assert "work dir kept" not in r.stdout  # nothing left behind: every agent and worker of both systems is gone
    if not accuracy:
        assert "accuracy" not in fig
        return
    # The accuracy check ran: both checkpoints of the same epoch validated (the tolerance is a
    # target for long replays; a few epochs of 64 px training say little about it).
    acc = fig["accuracy"]
    assert acc["epoch"] >= 0 and acc["uninterrupted"]["epoch"] == acc["elasticyolo"]["epoch"] == acc["epoch"]
    assert 0 <= acc["elasticyolo"]["mAP50-95"] <= 1 and 0 <= acc["uninterrupted"]["mAP50-95"] <= 1
    assert acc["map50_95_difference"] == pytest.approx(
        abs(acc["elasticyolo"]["mAP50-95"] - acc["uninterrupted"]["mAP50-95"]), abs=1e-3)
    assert "accuracy at the end of epoch" in r.stdout
    assert acc["uninterrupted"]["world"] == 1  # the elastic job's first world (the calibration's)


@needs_trace
@pytest.mark.parametrize("args, message", [
    (["--start-hour", "11", "--hours", "1"], "outside trace"),
    (["--start-hour", "1", "--hours", "1", "--notice-fraction", "1.5"], "--notice-fraction 1.5"),
    (["--start-hour", "1", "--hours", "1", "--cpus-per-node", "-1"], "--cpus-per-node -1"),
    (["--start-hour", "1", "--hours", "1", "--repeats", "0"], "--repeats 0"),
])
def test_bad_window_is_one_line_error(tmp_path: Path, args: list[str], message: str) -> None:
    r = subprocess.run([ELASTICYOLO, "chaos", "replay", "--trace", str(TRACE), "--nodes", "3", "--compress", "10",
                        *args, "--json", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x.json").exists()


def test_malformed_trace_is_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("0,1\n0,2\n60000,3\n30000,2\n")
    r = subprocess.run([ELASTICYOLO, "chaos", "replay", "--trace", str(bad), "--nodes", "2", "--compress", "10",
                        "--start-hour", "0", "--hours", "0.01", "--json", str(tmp_path / "x.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"trace {bad} line 4: time 30000 ms is before the previous row" in r.stderr


@needs_trace
def test_a_replay_whose_job_dies_reports_it(tmp_path: Path) -> None:
    """A job that fails for good (here: every worker crashes on a model that does not exist) ends
    the replay at once: exit 1 with the reason, and a JSON that says failed with goodput 0."""
    out = tmp_path / "dead.json"
    r = subprocess.run([ELASTICYOLO, "chaos", "replay", "--trace", str(TRACE), "--nodes", "2", "--compress", "20",
                        "--start-hour", "1.43", "--hours", "0.1", "--calibrate-s", "2", "--train-images", "32",
                        "--checkpoint-s", "60", "--cpus-per-node", "0", "--no-accuracy", "--baseline", "none",
                        "--set", "model=nosuch.yaml", "--json", str(out), "--workdir", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "the job failed" in r.stderr and "nosuch.yaml" in r.stderr, r.stderr
    got = json.loads(out.read_text())
    assert got["failed"] is True and "nosuch.yaml" in got["reason"]
    assert got["systems"]["elasticyolo"]["goodput_vs_ideal"] == 0.0


@needs_trace
def test_a_sweep_without_enough_changes_is_one_line_error(tmp_path: Path) -> None:
    r = subprocess.run([ELASTICYOLO, "chaos", "sweep", "--trace", str(TRACE), "--nodes", "4", "--compress", "60",
                        "--min-changes", "50", "--json", str(tmp_path / "x.json")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--min-changes 50: no 1 h window" in r.stderr and not (tmp_path / "x.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_sweep_replays_every_window_with_enough_changes(tmp_path: Path) -> None:
    """Two windows of a small trace (a kill in the first, a join in the second, a quiet third the
    rule leaves out), on one cluster: goodput per window, the worst and the median, no sample
    trained twice or skipped."""
    trace = tmp_path / "trace.csv"
    trace.write_text("0,2\n90000,1\n180000,1\n270000,2\n360000,2\n540000,2\n")
    out = tmp_path / "sweep.json"
    r = subprocess.run([ELASTICYOLO, "chaos", "sweep", "--trace", str(trace), "--nodes", "2", "--compress", "10",
                        "--hours", "0.05", "--min-changes", "1", "--calibrate-s", "2", "--train-images", "32",
                        "--checkpoint-s", "60", "--cpus-per-node", "0", "--engine", "torch", "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert [w["start_hour"] for w in got["windows"]] == [0.0, 0.05]
    assert [w["changes"] for w in got["windows"]] == [1, 1]
    assert all(0 < w["goodput_vs_ideal"] for w in got["windows"]), got["windows"]
    assert got["worst_goodput_vs_ideal"] == min(w["goodput_vs_ideal"] for w in got["windows"])
    assert got["duplicates"] == 0 and got["skipped"] == 0
    assert "worst" in r.stdout and "median" in r.stdout
