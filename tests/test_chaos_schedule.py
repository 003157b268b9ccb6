"""Spot-trace parsing, window checks, schedule mapping, measurement and projection: pure logic."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticyolo.chaos.measure import committed_records, coverage_faults, executions, ideal_samples, measure, pool
from elasticyolo.chaos.projection import EventCost, elastic_goodput, project, restart_goodput
from elasticyolo.chaos.schedule import plan_checkpoint_restart, plan_elastic, scale_count, timeline
from elasticyolo.chaos.sweep import sweep_windows
from elasticyolo.chaos.trace import TraceError, check_window, load_trace, parse_trace
from trace_data import REAL_TRACE

REAL = REAL_TRACE
SMALL = "0,1\n0,2\n0,3\n0,4\n600000,3\n1200000,2\n1200000,1\n1800000,2\n2400000,3\n3600000,4\n"


# ---- parsing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("0,1\n1000\n", "line 2: expected 2 columns"),
    ("0,1\n1000,2,3\n", "line 2: expected 2 columns"),
    ("0,1\n1000,-2\n", "line 2: node_count -2 is negative"),
    ("0,1\n2000,2\n1000,3\n", "line 3: time 1000 ms is before the previous row"),
    ("time_ms,node_count\n0,1\n", "line 1: time_ms 'time_ms' is not a number"),
    ("0,1\n1000,two\n", "line 2: node_count 'two' is not an integer"),
    ("", "no rows"),
    ("0,0\n5,0\n", "every node_count is 0"),
])
def test_malformed_trace_is_one_line_error(text: str, message: str) -> None:
    with pytest.raises(TraceError) as err:
        parse_trace(text, "t.csv")
    assert message in str(err.value) and "t.csv" in str(err.value) and "\n" not in str(err.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.csv")


def test_window_outside_trace() -> None:
    tr = parse_trace(SMALL, "s.csv")
    assert tr.duration_s == 3600 and tr.max_count == 4
    check_window(tr, 0.5, 0.5)
    for start, hours in ((0.5, 1.0), (-0.1, 0.5), (0.0, 0.0), (2.0, 1.0)):
        with pytest.raises(TraceError) as err:
            check_window(tr, start, hours)
        assert "\n" not in str(err.value)


# ---- schedule ---------------------------------------------------------------------------------
def test_scale_rounds_half_up() -> None:
    assert [scale_count(c, 4, 32) for c in (10, 12, 20, 28, 32)] == [1, 2, 3, 4, 4]


def test_timeline_collapses_bursts_and_compresses() -> None:
    tr = parse_trace(SMALL, "s.csv")
    tl = timeline(tr, check_window(tr, 0.0, 1.0), nodes=4, compress=60)
    assert tl.initial == 4 and tl.duration_s == 60
    # the burst at 1200 s (3 -> 2 -> 1) is one change; the row at 3600 s is outside [0, 1 h)
    assert [(c.t, c.before, c.after) for c in tl.changes] == [(10, 4, 3), (20, 3, 1), (30, 1, 2), (40, 2, 3)]
    assert [(s.t0, s.t1, s.nodes) for s in tl.segments()] == [(0, 10, 4), (10, 20, 3), (20, 30, 1), (30, 40, 2),
                                                              (40, 60, 3)]
    assert ideal_samples(tl, {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}) == 40 + 30 + 10 + 20 + 60
    # Where 4 nodes trained slower than 3, the ideal with 4 available is 3's rate.
    assert ideal_samples(tl, {1: 1.0, 2: 2.0, 3: 3.0, 4: 2.5}) == ideal_samples(tl, {1: 1.0, 2: 2.0, 3: 3.0, 4: 3.0})


def test_scaling_to_zero_is_refused() -> None:
    tr = parse_trace(SMALL, "s.csv")
    with pytest.raises(TraceError, match="0 nodes"):
        timeline(tr, check_window(tr, 0.0, 1.0), nodes=1, compress=60)


def test_elastic_plan_is_seeded_and_consistent() -> None:
    tr = parse_trace(SMALL, "s.csv")
    tl = timeline(tr, check_window(tr, 0.0, 1.0), nodes=4, compress=60)
    plan = plan_elastic(tl, notice_s=2.0, notice_fraction=0.5, seed=7)
    assert plan == plan_elastic(tl, notice_s=2.0, notice_fraction=0.5, seed=7)
    assert plan.initial_nodes == ["n1", "n2", "n3", "n4"]
    live = set(plan.initial_nodes)
    for a in plan.actions:  # applying the plan in order never kills a dead node or starts a live one
        if a.kind == "start":
            assert not live & set(a.nodes)
            live |= set(a.nodes)
        elif a.kind == "kill":
            assert set(a.nodes) <= live
            live -= set(a.nodes)
    assert len(live) == 3
    kills = [a for a in plan.actions if a.kind == "kill"]
    assert sum(len(a.nodes) for a in kills) == 1 + 2
    for a in plan.actions:  # a notice comes notice_s before its kill
        if a.kind == "notice":
            assert any(k.nodes == a.nodes and k.t == a.t + 2.0 for k in kills)
    all_notice = plan_elastic(tl, notice_s=2.0, notice_fraction=1.0, seed=1)
    assert all(v[2] for v in all_notice.victims())
    assert not any(v[2] for v in plan_elastic(tl, notice_s=2.0, notice_fraction=0.0, seed=1).victims())


def test_checkpoint_restart_plan_restarts_a_fresh_world_per_change() -> None:
    tr = parse_trace(SMALL, "s.csv")
    tl = timeline(tr, check_window(tr, 0.0, 1.0), nodes=4, compress=60)
    plan = plan_checkpoint_restart(tl)
    assert plan.initial_nodes == ["g0n1", "g0n2", "g0n3", "g0n4"]
    assert [(a.t, a.kind, len(a.nodes)) for a in plan.actions] == [(10, "restart", 3), (20, "restart", 1),
                                                                   (30, "restart", 2), (40, "restart", 3)]
    names = [n for a in plan.actions for n in a.nodes]
    assert len(names) == len(set(names))


def test_a_repeat_plays_the_same_changes_and_victims_on_the_nodes_now_live() -> None:
    from elasticyolo.chaos.runner import _repeat_plan

    tr = parse_trace(SMALL, "s.csv")
    tl = timeline(tr, check_window(tr, 0.0, 1.0), nodes=4, compress=60)
    plan = plan_elastic(tl, notice_s=2.0, notice_fraction=0.5, seed=7)
    assert _repeat_plan(plan, ["n1", "n2", "n3", "n4"], 0) is plan
    again = _repeat_plan(plan, ["n1", "n3", "n5", "n6"], 1)
    assert again.initial_nodes == ["n1", "n3", "n5", "n6"]
    # the same times, kinds and notices; the victims at the same places; joiners get new names
    assert [(a.t, a.kind, a.notice_s, a.change) for a in again.actions] == [
        (a.t, a.kind, a.notice_s, a.change) for a in plan.actions]
    where = dict(zip(plan.initial_nodes, again.initial_nodes))
    for a, b in zip(plan.actions, again.actions):
        assert b.nodes == tuple(where.get(n, f"{n}r1") for n in a.nodes)
    started = [n for a in again.actions if a.kind == "start" for n in a.nodes]
    assert started and not set(started) & set(again.initial_nodes) and all(n.endswith("r1") for n in started)


@pytest.mark.skipif(not REAL.exists(), reason="the real trace is missing")
def test_real_trace_windows() -> None:
    tr = load_trace(REAL)
    assert tr.max_count == 32 and round(tr.duration_s / 3600, 1) == 11.4
    assert timeline(tr, check_window(tr, 5.0, 0.5), 4, 60).changes == ()  # the quiet half hour
    assert len(timeline(tr, check_window(tr, 4.0, 1.0), 4, 60).changes) >= 4



@pytest.mark.skipif(not REAL.exists(), reason="the real trace is missing")
def test_a_sweep_takes_every_whole_hour_window_with_enough_changes() -> None:
    tr = load_trace(REAL)
    starts = sweep_windows(tr, 4, 60, 1.0, 3)
    assert starts == [h for h in range(11) if len(timeline(tr, check_window(tr, h, 1.0), 4, 60).changes) >= 3]
    assert len(starts) >= 6 and all(float(h).is_integer() for h in starts)
    assert sweep_windows(tr, 4, 60, 1.0, 0) == list(range(11))  # the trace's last 0.4 h makes no whole window
    with pytest.raises(TraceError, match="--hours 0"):
        sweep_windows(tr, 4, 60, 0.0, 3)


# ---- measurement ------------------------------------------------------------------------------
def _step(t: float, step: int, rank: int, world: int, indices: list[int], epoch: int = 0, start: int = 0) -> dict:
    return {"ev": "step", "t": t, "step": step, "rank": rank, "world": world, "epoch": epoch, "start": start,
            "indices": indices, "pid": 100 + rank}


def test_measure_counts_rollbacks_pauses_and_coverage() -> None:
    tr = parse_trace("0,2\n10000,1\n20000,1\n", "m.csv")
    tl = timeline(tr, check_window(tr, 0.0, 20 / 3600), nodes=2, compress=1)
    ev = []
    # world 2, steps 1..4 (t 0.5..3.5); step 4 is rolled back at the kill at t=10
    for s in range(1, 5):
        ev += [_step(s - 0.5, s, 0, 2, [2 * (s - 1)], start=2 * (s - 1)), _step(s - 0.5, s, 1, 2, [2 * s - 1], start=2 * (s - 1))]
    # world 1 resumes at step 4 at t=12 (2 s pause after the change at 10 + typical gaps of 1 s)
    ev += [{"ev": "resume", "t": 11.9, "step": 3, "rank": 0, "world": 1, "pid": 1}]
    ev += [_step(12.0 + i, 4 + i, 0, 1, [6 + i], start=6 + i) for i in range(2)]  # finishes epoch 0 (8 samples)
    ev += [_step(14.0 + i, 6 + i, 0, 1, [i], epoch=1, start=i) for i in range(5)]
    fig = measure(ev, t_start=0.0, tl=tl, rates={1: 1.0, 2: 2.0}, num_samples=8,
                  change_kinds=["kill_no_notice"], change_delays=[0.0])
    assert fig.committed_samples == 6 + 2 + 5 and fig.lost_samples == 2
    assert fig.ideal_samples == 10 * 2 + 10 * 1
    assert (fig.duplicates, fig.skipped, fig.completed_epochs) == (0, 0, 1)
    # only what follows the change is its pause: 10 -> 12 (the idle 3.5 -> 10 came before it)
    assert len(fig.pause_s) == 1 and fig.pause_s[0] == pytest.approx(12.0 - 10.0)
    assert fig.changes[0].lost_samples == 2 and fig.changes[0].first_step_s == pytest.approx(2.0)


def test_the_runners_shutdown_after_the_last_change_is_not_its_pause() -> None:
    """The last change's pause may run past the window, up to when the runner began stopping the
    cluster (`until`): the stop's own drains and restarts (a gap of 8 s here) are nobody's pause."""
    tr = parse_trace("0,2\n10000,1\n20000,1\n", "m.csv")
    tl = timeline(tr, check_window(tr, 0.0, 20 / 3600), nodes=2, compress=1)
    ev = [_step(0.5 + i, 1 + i, 0, 2, [2 * i], start=2 * i) for i in range(20)]  # one step a second
    ev += [_step(20.5, 21, 0, 2, [0], epoch=1), _step(21.5, 22, 0, 2, [1], epoch=1, start=1),
           _step(29.0, 23, 0, 2, [2], epoch=1, start=2)]  # the runner began stopping at 22
    fig = measure(ev, t_start=0.0, tl=tl, rates={1: 1.0, 2: 2.0}, num_samples=40,
                  change_kinds=["kill_no_notice"], change_delays=[0.0], until=22.0)
    assert fig.pause_s == [pytest.approx(0.0)]
    unbounded = measure(ev, t_start=0.0, tl=tl, rates={1: 1.0, 2: 2.0}, num_samples=40,
                        change_kinds=["kill_no_notice"], change_delays=[0.0])
    assert unbounded.pause_s == [pytest.approx(6.5)]


def test_repeats_pool_into_means_per_replay_and_keep_every_change() -> None:
    tr = parse_trace("0,2\n10000,1\n20000,1\n", "m.csv")
    tl = timeline(tr, check_window(tr, 0.0, 20 / 3600), nodes=2, compress=1)
    figs = []
    for t_start, stall in ((0.0, 2.0), (100.0, 4.0)):  # the second replay pauses longer at its change
        ev = [_step(t_start + 0.5 + i, 1 + i, 0, 2, [2 * i], start=2 * i) for i in range(10)]
        ev += [_step(t_start + 10 + stall + i, 11 + i, 0, 1, [20 + i], start=20 + i) for i in range(int(10 - stall))]
        figs.append(measure(ev, t_start=t_start, tl=tl, rates={1: 1.0, 2: 2.0}, num_samples=100,
                            change_kinds=["kill_no_notice"], change_delays=[0.0]))
    assert pool(figs[:1]) is figs[0]
    both = pool(figs)
    assert [f.committed_samples for f in figs] == [18, 16]
    assert both.committed_samples == 17 and both.ideal_samples == 30
    assert both.goodput_vs_ideal == pytest.approx(34 / 60)
    assert both.pause_s == [pytest.approx(1.5), pytest.approx(3.5)] and len(both.changes) == 2
    assert [r["goodput_vs_ideal"] for r in both.repeats] == [pytest.approx(0.6, abs=1e-4), pytest.approx(16 / 30, abs=1e-4)]
    js = both.to_json()
    assert js["repeats"] == both.repeats and js["committed_samples"] == 17
    assert "repeats" not in figs[0].to_json()


def test_a_later_world_that_restores_the_same_step_at_the_same_size_is_another_round() -> None:
    """A world of 2 resumed at step 4, trained steps 5-6 and checkpointed neither; the next world
    of 2 (new processes) restored the same step 4: the first world's steps 5-6 are rolled back."""
    def world(t: float, pid0: int) -> list[dict]:
        ev = [{"ev": "resume", "t": t, "step": 4, "rank": r, "world": 2, "pid": pid0 + r} for r in range(2)]
        for s in (5, 6):
            ev += [{**_step(t + s - 4, s, r, 2, [2 * s + r], start=2 * s), "pid": pid0 + r} for r in range(2)]
        return ev

    ev = world(0.0, 100) + world(30.0, 200)
    kept = committed_records(ev)
    assert sorted((e["pid"], e["step"]) for e in kept) == [(200, 5), (200, 6), (201, 5), (201, 6)]
    # After one step only (no record of step 6 tells the worlds apart), rank 0 resuming again does.
    one = [e for e in world(0.0, 100) if e.get("step") != 6] + world(30.0, 200)
    assert sorted((e["pid"], e["step"]) for e in committed_records(one)) == [(200, 5), (200, 6), (201, 5), (201, 6)]
    # One round whose second rank resumed 8 s late (starved), after its fast peer recorded step 5:
    # time apart does not split a round, so nothing of it is lost.
    late = world(0.0, 300)
    late[1] = {**late[1], "t": 8.0}
    for e in late[2:]:
        e["t"] += 8.0 if e["step"] == 6 or e["rank"] == 1 else 0.0
    assert len(committed_records(late)) == 4
    assert coverage_faults(ev + [{**_step(40.0, 7, 0, 2, list(range(14)) + list(range(16, 20)), epoch=0),
                                  "pid": 200}], 20)[:2] == (0, 0)


def test_a_restore_discards_later_steps_even_if_never_redone() -> None:
    # A restart restored step 2 (a checkpoint) at t=10; steps 3..5 done before it are lost even
    # though the new world never got as far as re-executing them.
    ev = [_step(i, i, 0, 1, [i]) for i in range(1, 6)]
    ev += [{"ev": "resume", "t": 10.0, "step": 2, "rank": 0, "world": 1, "pid": 2}, _step(11, 3, 0, 1, [3])]
    assert [(e["t"], e["step"]) for e in committed_records(ev)] == [(1, 1), (2, 2), (11, 3)]
    assert [e["step"] for e in committed_records(ev, until=9.0)] == [1, 2, 3, 4, 5, 3]


def test_coverage_faults_find_duplicates_and_gaps() -> None:
    ev = [_step(1, 1, 0, 1, [0, 1, 1]), _step(2, 2, 0, 1, [3], start=3), _step(3, 3, 0, 1, [0], epoch=1)]
    assert coverage_faults(ev, 4) == (1, 1, 1)
    # Steps recorded after the runner began stopping the cluster (`until`) are not counted: a step
    # two ranks recorded but never completed as the stop began, redone by a world formed during
    # the stop after a resume that, being after `until`, discards nothing.
    stop = [_step(1, 1, 0, 1, [0, 1]), _step(5.5, 2, 1, 2, [2]), _step(5.6, 2, 2, 2, [3]),
            {"ev": "resume", "t": 8.0, "step": 1, "rank": 0, "world": 1, "pid": 9}, _step(9, 2, 0, 1, [2, 3])]
    assert coverage_faults(stop, 4, until=5.0) == (0, 0, 0)  # epoch 0 unfinished at the stop
    assert coverage_faults(stop, 4) == (0, 0, 1)  # without a stop: the resume discards the step
    assert len(executions([_step(1, 1, 0, 2, [0]), _step(1.1, 1, 1, 2, [1]), _step(9, 1, 0, 2, [0])])) == 2


# ---- projection -------------------------------------------------------------------------------
def test_projection_model() -> None:
    tr = parse_trace("0,1\n0,2\n1000000,1\n2000000,2\n3000000,2\n", "p.csv")  # 2 nodes, 1 leaves, 1 joins
    zero = EventCost(0.0, 0.0, "test")
    free = {"join": zero, "kill_notice": zero, "kill_no_notice": zero}
    assert elastic_goodput(tr, free, 1.0) == 1.0
    # ideal = 1000*2 + 1000*1 + 1000*2 = 5000 node-s; a 10 s pause per change at the new size + 1 s lost work
    costs = {"join": EventCost(10, 0, "t"), "kill_notice": EventCost(10, 1, "t"), "kill_no_notice": EventCost(50, 5, "t")}
    assert elastic_goodput(tr, costs, 1.0) == pytest.approx((5000 - 10 * 1 - 1 * 2 - 10 * 2) / 5000)
    assert elastic_goodput(tr, costs, 0.0) == pytest.approx((5000 - 50 * 1 - 5 * 2 - 10 * 2) / 5000)
    # restart: 100 s to restart; checkpoints every 300 s -> 1000 s into the run 100 s are lost (x2 nodes),
    # then resume at 1100, next change at 2000: 900 s later, 0 s since the checkpoint at 2000 (x1 node)
    got = restart_goodput(tr, EventCost(100, 0, "t"), 300)
    assert got == pytest.approx((5000 - 100 * 2 - 0 * 1 - 100 * 1 - 100 * 2) / 5000)
    p = project(tr, costs, EventCost(100, 0, "t"), checkpoint_interval_s=300, notice_fraction=1.0).to_json()
    assert p["changes"] == 2 and set(p["systems"]) == {"elasticyolo", "checkpoint-restart"}
    assert p["systems"]["checkpoint-restart"]["ratio_vs_baseline"] == 1.0
    assert "elasticyolo.join" in p["costs_used"]


def test_projection_charges_a_joiners_start_up() -> None:
    tr = parse_trace("0,1\n0,2\n1000000,1\n2000000,2\n3000000,2\n", "p.csv")
    zero = EventCost(0.0, 0.0, "t")
    slow_join = {"join": EventCost(0.0, 0.0, "t", ready_s=30.0), "kill_notice": zero, "kill_no_notice": zero}
    assert elastic_goodput(tr, slow_join, 1.0) == pytest.approx((5000 - 30 * 1) / 5000)


def test_replay_side_imports_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, elasticyolo.commands.chaos, elasticyolo.chaos.replay, elasticyolo.chaos.runner, "
            "elasticyolo.chaos.plot\nsys.exit(1 if 'torch' in sys.modules or 'ultralytics' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_stretch_rates_skip_the_steps_after_a_change() -> None:
    from elasticyolo.chaos.measure import stretch_rates

    ev = [_step(float(i), i, 0, 1, [i]) for i in range(1, 9)]  # world 1: one sample per second
    ev += [_step(9.0 + 0.5 * i, 9 + i, r, 2, [20 + 2 * i + r]) for i in range(8) for r in (0, 1)]  # 4 samples/s
    got = stretch_rates(ev, 0.0, 100.0)
    assert got[1] == pytest.approx(1.0) and got[2] == pytest.approx(4.0)


def test_a_fast_ranks_first_step_is_not_rolled_back_by_a_slow_peers_resume() -> None:
    # World 3 resumes at step 37; rank 0 records step 38 (before the all-reduce) ahead of rank 2's
    # resume of the same round. A later failure that restores step 38 at world 2 keeps step 38.
    resume = lambda t, step, world, pid, rank=0: {"ev": "resume", "t": t, "step": step, "rank": rank,  # noqa: E731
                                                  "world": world, "pid": pid}
    s = lambda t, step, world, pid: {**_step(t, step, 0, world, [step]), "pid": pid}  # noqa: E731
    ev = [s(1.0, 37, 2, 10), resume(2.0, 37, 3, 10), s(2.1, 38, 3, 10), resume(2.2, 37, 3, 30, rank=2),
          s(2.3, 38, 3, 30), s(3.0, 39, 3, 10), resume(4.0, 38, 2, 10), s(4.5, 39, 2, 10)]
    kept = [(e["t"], e["step"]) for e in committed_records(ev)]
    assert kept == [(1.0, 37), (2.1, 38), (2.3, 38), (4.5, 39)]  # 39 at world 3 was rolled back


def test_calibration_spans_hold_whole_checkpoint_intervals() -> None:
    from elasticyolo.chaos.replay import calibration_span_s

    assert calibration_span_s(8.0, 5.0) == 10.0  # one checkpoint or two per 8 s span moved its rate
    assert calibration_span_s(10.0, 5.0) == 10.0 and calibration_span_s(2.0, 3.0) == 3.0
    assert calibration_span_s(8.0, 0.0) == 8.0  # no checkpoints: as asked


def test_a_record_written_after_a_newer_round_began_is_stale() -> None:
    # World 2 (pids 10, 20) resumed at step 3. Pid 20 froze mid-step 4; pid 10's world-1 round
    # resumed at step 3 and redid step 4. Pid 20, thawed, recorded its step 4 after that: stale.
    resume = lambda t, step, world, pid, rank=0: {"ev": "resume", "t": t, "step": step, "rank": rank,  # noqa: E731
                                                  "world": world, "pid": pid}
    s = lambda t, step, world, pid: {**_step(t, step, 0, world, [step]), "pid": pid}  # noqa: E731
    ev = [resume(1.0, 3, 2, 10), resume(1.1, 3, 2, 20, rank=1), s(2.0, 4, 2, 10),
          resume(8.0, 3, 1, 11), s(9.0, 4, 1, 11), s(9.2, 4, 2, 20), s(10.0, 5, 1, 11)]
    kept = [(e["t"], e["step"], e["world"]) for e in committed_records(ev)]
    assert kept == [(9.0, 4, 1), (10.0, 5, 1)]  # pid 10's step 4 was rolled back, pid 20's is stale
