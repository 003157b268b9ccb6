"""Rescaling policy math."""

from __future__ import annotations

import pytest

from elasticyolo.train.policy import nominal_accumulate, resize_ramp, scaling_for


def test_nominal_accumulate_matches_ultralytics() -> None:
    assert nominal_accumulate(64, 16, 1) == 4
    assert nominal_accumulate(64, 8, 2) == 4
    assert nominal_accumulate(64, 64, 2) == 1  # never below one


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_linear_lr_proportional_to_world(world: int) -> None:
    s = scaling_for("linear", world, batch=8, nbs=64, ref_world=1)
    assert s.lr_scale == pytest.approx(world)
    assert s.accumulate == 8  # fixed: the reference world's nominal accumulation
    assert s.global_batch == 8 * world * 8


def test_linear_with_reference_world() -> None:
    s = scaling_for("linear", 2, batch=8, nbs=64, ref_world=4)
    assert s.lr_scale == pytest.approx(0.5)


@pytest.mark.parametrize("world,acc", [(1, 8), (2, 4), (4, 2), (8, 1), (3, 3)])
def test_constant_global_batch(world: int, acc: int) -> None:
    s = scaling_for("constant_global_batch", world, batch=8, nbs=64, ref_world=1)
    assert s.lr_scale == 1.0
    assert s.accumulate == acc
    if 64 % (8 * world) == 0:
        assert s.global_batch == 64


def test_resize_ramp_goes_linearly_to_new_scale() -> None:
    assert resize_ramp(3.0, 2.0, 0, 10) == pytest.approx(3.0)
    assert resize_ramp(3.0, 2.0, 5, 10) == pytest.approx(2.5)
    assert resize_ramp(3.0, 2.0, 10, 10) == pytest.approx(2.0)
    assert resize_ramp(3.0, 2.0, 0, 0) == pytest.approx(2.0)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        scaling_for("linear", 0, batch=8, nbs=64)
    with pytest.raises(ValueError):
        scaling_for("bogus", 1, batch=8, nbs=64)
