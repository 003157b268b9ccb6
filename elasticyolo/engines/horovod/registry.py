"""Horovod's worker registry (the barrier a reset's workers meet at), without the double count that
made a healthy worker wait out Gloo's timeout in its context setup.

Horovod's `WorkerStateRegistry` counts one barrier party per registration. Two registrations of one
slot in one reset are counted twice, and the barrier then completes one worker short: that worker
waits in the *next* reset's barrier while its peers wait for it in the new world's Gloo rendezvous
until `HOROVOD_GLOO_TIMEOUT_SECONDS` (seen in `test_failure_detection.py`, a frozen agent's orphan
worker: 30 s). The sequence:

1. the driver counts a suspect node's worker failed (failures.slot_outcome: it had not registered
   within the grace) just as that worker - alive, only its agent was frozen - registers READY;
2. FAILURE overrides READY: Horovod resets the barrier and the READY request's handler raises, so
   the worker's HTTP GET gets no answer (`HTTP response not OK, got 0`) and the worker retries it;
3. the retry is a second READY of a slot already recorded: Horovod logs it and waits at the barrier
   anyway, as a second party.

What happens once a reset's workers are all recorded is our own policy (round_policy.py), not
Horovod's: a host is blacklisted only on evidence that it is broken, and churn never stops the job.

Two more changes, both at the registry's lock:
* `record_failure_if_absent`: a failure decided from the slot's absence in a reset is recorded only
  if the slot still has not registered in that same reset (atomic with registration, so step 1
  cannot happen);
* a repeated registration of a recorded slot does not join the barrier: it waits for the reset to
  complete and then answers like its peers (a late duplicate can no longer make a round complete
  without one of its members).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from horovod.runner.elastic import constants
from horovod.runner.elastic.registration import FAILURE, WorkerStateRegistry

from elasticyolo.engines.horovod.round_policy import CrashHistory, decide_round
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.registry")

# A duplicate registration waits for its reset to complete at most this long (then answers with
# whatever the driver assigns: a reset never lasts this long without a failure of its own).
DUPLICATE_WAIT_S = 120.0


class GuardedWorkerRegistry(WorkerStateRegistry):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._round_changed = threading.Condition()
        self._crashed: set[tuple[str, int]] = set()  # FAILURE slots of this round whose worker crashed
        self._crash_reason: str | None = None
        self.history = CrashHistory()
        self.blacklisted: list[str] = []  # every host this policy blacklisted, in order

    def reset(self, size: int) -> None:
        super().reset(size)
        with self._lock:
            self._crashed = set()
        with self._round_changed:
            self._round_changed.notify_all()

    def note_crash(self, host: str, slot: int, reason: str | None = None) -> None:
        """The slot's worker crashed (called before its FAILURE is recorded)."""
        with self._lock:
            self._crashed.add((host, slot))
            if reason:
                self._crash_reason = reason

    def _on_workers_recorded(self) -> None:
        with self._lock:
            states, crashed = dict(self._states), set(self._crashed)
        decision = decide_round(states, crashed, self.history, self._reset_count, self._reset_limit,
                                crash_reason=self._crash_reason)
        log.info("workers recorded", size=self.size(), action=decision.action, crashed=sorted(crashed),
                 blacklist=sorted(decision.blacklist), reason=decision.reason)
        for host in decision.blacklist:
            self._host_manager.blacklist(host)
            self.blacklisted.append(host)
        if decision.action == "finish":
            self._driver.stop()
            return
        if decision.action == "fail":
            message = decision.reason or "failed"
            if self._reset_limit is not None and self._reset_count >= self._reset_limit:
                message = constants.RESET_LIMIT_EXCEEDED_MESSAGE.format(self._reset_limit)
            self._driver.stop(error_message=message)
            return
        # Horovod starts workers only for slots new to the assignment: a failed worker on a host
        # that stays (not blacklisted) is started again by making its slot new.
        failed = {slot for slot, state in states.items() if state == FAILURE}
        self._driver.forget_slots(failed)
        # The hosts as discovery sees them now: a node found dead may have been counted failed
        # here before the liveness listener's own discovery round ran, and a new world assigned
        # to it would wait for it in Gloo's rendezvous until the timeout.
        self._driver.discover_now()
        try:
            self._reset_count += 1
            self._driver.resume()
        except RuntimeError as exc:
            if "No hosts from previous set remaining" not in str(exc):
                logging.exception("failed to activate new hosts -> stop running")
                self._driver.stop(error_message=f"could not activate a new world: {exc}")
                return
            # Every host of the last world is gone: the next one starts from the newest snapshot
            # (train/snapshots.py, then S3) instead of a broadcast from a survivor.
            log.warning("no host of the last world remains; the next world restores from the newest snapshot")
            self._driver.restore_next_world()
            self._driver.resume()
        except Exception as exc:  # noqa: BLE001 - as Horovod: a world that cannot be activated stops
            logging.exception("failed to activate new hosts -> stop running")
            self._driver.stop(error_message=f"could not activate a new world: {exc}")

    def record_failure_if_absent(self, host: str, slot: int, rendezvous_id: int) -> int | None:
        """Record FAILURE for a slot counted out for not registering in reset `rendezvous_id`,
        unless it has registered since or that reset is over. None: not recorded."""
        return self._record(host, slot, FAILURE, absent_in=rendezvous_id)

    def _record_state(self, host: str, slot: int, state: str) -> Any:
        return self._record(host, slot, state, absent_in=None)

    def _record(self, host: str, slot: int, state: str, absent_in: int | None) -> Any:
        # Horovod's `_record_state`, with the two changes of the module docstring.
        ignored = None if absent_in is not None else self._rendezvous_id
        if self._driver.finished():
            logging.info("driver finished, ignoring registration: %s[%s] = %s", host, slot, state)
            return ignored
        if self._host_manager.is_blacklisted(host):
            logging.warning("host registers state %s but is already blacklisted, ignoring: %s", state, host)
            return ignored
        self._action_event.wait()
        key = (host, slot)
        with self._lock:
            if absent_in is not None and (self._rendezvous_id != absent_in or key in self._states):
                logging.info("%s[%s] registered in reset %s after all (or it is over): not counted failed",
                             host, slot, absent_in)
                return None
            if key in self._states and state != FAILURE:
                logging.info("%s[%s] registered twice in reset %s: waiting for it without counting again",
                             host, slot, self._rendezvous_id)
                rendezvous_id = self._rendezvous_id
                duplicate = True
            else:
                duplicate = False
                if key in self._states:  # FAILURE after READY: the READY registration leaves the barrier
                    logging.info("key exists, reset barrier: %s[%s] = %s -> %s", host, slot, self._states[key], state)
                    self._barrier.reset()
                logging.info("record state: %s[%s] = %s", host, slot, state)
                self._states[key] = state
                self._workers[state].add(key)
                rendezvous_id = self._rendezvous_id
        if duplicate:
            return self._await_round_after(rendezvous_id)
        return self._wait(key, state, rendezvous_id)

    def _await_round_after(self, rendezvous_id: int) -> int:
        # Woken by `reset` (the reset completed: a new world was activated); polled for a driver
        # that stops instead (no reset follows then).
        deadline = time.monotonic() + DUPLICATE_WAIT_S
        with self._round_changed:
            while (self._rendezvous_id == rendezvous_id and not self._driver.finished()
                   and time.monotonic() < deadline):
                self._round_changed.wait(0.5)
        # The reset's action (activating the new world) may still be running: answer after it.
        self._action_event.wait()
        return self._rendezvous_id
