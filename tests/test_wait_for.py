"""`wait_for`, the one wait helper: what a failure's message says."""

from __future__ import annotations

import pytest

from elasticyolo.local_cluster.wait import wait_for


def test_a_met_condition_returns_its_value() -> None:
    assert wait_for(lambda: 7, 1.0, "seven") == 7


def test_a_timeout_names_what_was_awaited_the_last_error_and_the_context() -> None:
    def condition() -> bool:
        raise KeyError("no such key")

    with pytest.raises(AssertionError) as err:
        wait_for(condition, 0.05, "the key", interval=0.01, context=lambda: "agent log: lease lost")
    assert str(err.value) == ("timed out after 0.1s waiting for the key (last error: 'no such key')\n"
                              "agent log: lease lost")


def test_an_abort_fails_at_once_with_its_reason_and_the_context() -> None:
    with pytest.raises(AssertionError) as err:
        wait_for(lambda: False, 60.0, "step 5", abort=lambda: "the job failed", context=lambda: "status: failed")
    assert str(err.value) == "the job failed while waiting for step 5\nstatus: failed"
