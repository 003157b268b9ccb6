"""When the driver counts a slot's worker as failed (pure; stepped in tests/test_liveness.py).

Horovod blacklists every host whose worker the driver reports failed in a reset, and stops the job
when every recorded host is blacklisted (horovod/runner/elastic/registration.py). So a failure
must be reported only for a worker that really is gone:

* its exit was reported by its node's agent;
* the agent's liveness connection closed without `bye` (cluster/liveness.py: DEAD): the agent
  process is gone, and its workers with it (they die with their agent, worker_runtime/lifeline.py) -
  reported at once, so the world does not wait for the lease;
* the node is SUSPECT (no heartbeat) or its lease is gone, but that alone proves nothing about
  its worker: only the *agent* may be frozen (or starved of CPU) while the worker trains on. A
  suspect node is treated as lost only once the world has stopped stepping (`engines/world_health.py`: a
  frozen VM's worker blocks every collective, a frozen agent's does not): then it is taken out
  of discovery and the world's collective is aborted. While the world steps on, the suspect
  stays, and its agent comes back with its next heartbeat. A lost node's worker is counted
  failed only when the world resets and that worker does not register for `grace_s` while the
  others have (it is frozen or cut off too), or when it is no longer part of the world anyway
  (the result is then ignored).

A leader acts on those signals only while etcd answers it (`world_health.etcd_answers`): cut off from the
others and etcd, it would see every node fall silent at once. The silence is then its own, and
dropping them (aborting its world, leaving them out) would form a world of its own in the
minority, which the majority does not know of. Its lease decides instead: it steps down (the
agent, cluster/election.py) and the majority elects a new leader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from elasticyolo.cluster.liveness import Verdict

RESET_GRACE_S = 0.5  # after the reset's first registration: a live worker has registered by then
# After every worker of the world on a node not lost registered. A live worker on a suspect node
# (only its agent frozen) had its collective aborted with theirs and registers with them; a frozen
# one never does.
# With RESET_GRACE_S alone, a whole frozen node would cost the world 0.5 s more (bench/recovery.py).
PEER_GRACE_S = 0.15


def excluded_hosts(lost: set[str], excluded_before: set[str], answers: bool) -> set[str]:
    """The nodes discovery leaves out: every lost node while etcd answers; while it does not, no
    new one (the leader may be the one cut off), only those left out already and still lost (a
    slow read must not put a lost node back into the world)."""
    return set(lost) if answers else excluded_before & lost


@dataclass(frozen=True)
class SlotFacts:
    exit_code: int | None  # reported by the node's agent
    stopping: bool  # Horovod stops the slot (job shutdown, or its host was blacklisted)
    liveness: Verdict  # the node's agent, as the leader's liveness server sees it
    record_present: bool  # the node's record (its lease) is in etcd
    assigned: bool  # the slot is in Horovod's current host assignment
    registered: bool  # the slot's worker registered in the reset now pending
    reset_pending_s: float | None  # how long the pending reset has been waiting (None: no reset)
    peers_registered_s: float | None = None  # since every assigned worker on a node not lost registered (None: not all)
    reset_id: int | None = None  # Horovod's rendezvous id of the pending reset


def slot_outcome(f: SlotFacts, grace_s: float = RESET_GRACE_S, peer_grace_s: float = PEER_GRACE_S,
                 ) -> tuple[str, int | None] | None:
    """("exit", code) | ("stop", None) | ("node-gone", None): count it failed | ("absent", reset id):
    count it failed unless it registers in that reset after all (engines/horovod/registry.py
    decides that atomically with its registration) | ("left", None): the worker is out of the
    world already (Horovod ignores what is returned) | None: keep waiting."""
    if f.exit_code is not None:
        return "exit", f.exit_code
    if f.stopping:
        return "stop", None
    if f.liveness is Verdict.DEAD:
        return "node-gone", None
    if f.liveness is Verdict.SUSPECT or not f.record_present:
        if not f.assigned:
            return "left", None
        if f.registered or f.reset_pending_s is None:
            return None
        if f.reset_pending_s >= grace_s or (f.peers_registered_s is not None and f.peers_registered_s >= peer_grace_s):
            return "absent", f.reset_id
    return None


def abort_targets(lost: set[str], world_hosts: set[str], workers: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """The workers to tell to abort their collective (engines/horovod/abort.py) when `lost` nodes
    are lost: every worker of the current world on another host, if a lost node is in that world
    (a world blocked on it would otherwise wait out Gloo's timeout)."""
    if not lost & world_hosts:
        return []
    return sorted((h, s) for h, s in set(workers) if h in world_hosts and h not in lost)
