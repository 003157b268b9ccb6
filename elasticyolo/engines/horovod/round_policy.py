"""What the driver does once every worker of a reset has recorded its state (pure; stepped in
tests/test_round_policy.py). It replaces Horovod's own rule (`WorkerStateRegistry.
_on_workers_recorded`), which blacklists every host with a FAILURE and stops the job when every
recorded host is blacklisted or every worker failed: under churn that ends healthy jobs (a node
lost, a worker stopped while its agent re-registered, a peer's collective failure all record
FAILURE on hosts that are fine).

Here a FAILURE is evidence against a host only when its worker *crashed* (its agent reported a
non-zero exit that no one asked for: not SIGTERM/SIGKILL from a launcher, not a world that could
not be set up, not a lost node) while
another host's worker in the same round did not. A host is blacklisted after
`HOST_CRASH_LIMIT` such rounds in a row; Horovod's host manager forgives it after the spec's
cool-down (`cooldown_s`, as `horovodrun --blacklist-cooldown-range`). The job fails only when
every worker crashed in `ALL_CRASH_LIMIT` rounds in a row (the same error everywhere: bad data, a
bad model; the limit is the engines' shared one, `engines/crash_loop.py`), or when the spec's `reset_limit` is reached. Membership churn alone never ends a job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elasticyolo.engines.crash_loop import ALL_CRASH_LIMIT

READY, SUCCESS, FAILURE = "READY", "SUCCESS", "FAILURE"  # horovod.runner.elastic.registration's states
HOST_CRASH_LIMIT = 2
# Exit codes that are no crash: a worker stopped from outside (a launcher's SIGTERM, then SIGKILL;
# as a shell reports them), or one whose world could not be set up (worker.EXIT_WORLD_NOT_FORMED:
# a peer was late or lost).
NOT_CRASH_CODES = frozenset({-15, -9, 143, 137, 75})


def is_crash(exit_code: int) -> bool:
    """A worker's own failure (not a success, not a stop someone asked for)."""
    return exit_code != 0 and exit_code not in NOT_CRASH_CODES


@dataclass
class CrashHistory:
    """What the policy carries from round to round."""

    host_streak: dict[str, int] = field(default_factory=dict)  # rounds in a row the host alone crashed
    all_crashed_rounds: int = 0  # rounds in a row in which every recorded worker crashed


@dataclass(frozen=True)
class RoundDecision:
    action: str  # "finish" (a worker succeeded), "fail", or "resume"
    blacklist: frozenset[str] = frozenset()
    reason: str | None = None


def decide_round(states: dict[tuple[str, int], str], crashed: set[tuple[str, int]], history: CrashHistory,
                 reset_count: int, reset_limit: int | None, *, host_crash_limit: int = HOST_CRASH_LIMIT,
                 all_crash_limit: int = ALL_CRASH_LIMIT, crash_reason: str | None = None) -> RoundDecision:
    """`states`: each recorded slot's state in this round; `crashed`: the FAILURE slots whose
    worker crashed. Updates `history`."""
    if any(s == SUCCESS for s in states.values()):
        return RoundDecision("finish")
    crashed = {slot for slot in crashed if states.get(slot) == FAILURE}
    crashed_hosts = {h for h, _ in crashed}
    healthy_hosts = {host for host, _slot in states} - crashed_hosts
    every_worker_crashed = bool(states) and len(crashed) == len(states)
    history.all_crashed_rounds = history.all_crashed_rounds + 1 if every_worker_crashed else 0
    if history.all_crashed_rounds >= all_crash_limit:
        what = crash_reason or "workers exited with an error"
        return RoundDecision("fail", reason=f"every worker crashed in {history.all_crashed_rounds} resets in a row: "
                                            f"{what}")
    blacklist: set[str] = set()
    for host in {h for h, _ in states}:
        if host in crashed_hosts and healthy_hosts:
            history.host_streak[host] = history.host_streak.get(host, 0) + 1
            if history.host_streak[host] >= host_crash_limit:
                blacklist.add(host)
                history.host_streak[host] = 0
        elif host not in crashed_hosts:
            history.host_streak.pop(host, None)
    if reset_limit is not None and reset_count >= reset_limit:
        return RoundDecision("fail", frozenset(blacklist),
                             reason=f"the world reset {reset_count} times, the spec's reset_limit")
    return RoundDecision("resume", frozenset(blacklist))
