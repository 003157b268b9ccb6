"""The torch rendezvous told by the cluster who is alive, so that no round waits out a timeout.

torch's dynamic rendezvous learns that a node is gone only when its heartbeats stop for
`keep_alive_interval x keep_alive_max_attempt` (15 s by default), and it completes a round only
at `max_nodes` or after `last_call_timeout`, even when every node that could join has joined.
Under the agents both are known sooner:

* a node's agent registers it in etcd with a lease (`nodes/<id>`). The leader revokes the lease
  of an agent whose liveness connection closed (process death: `agent/dead_nodes.py`), so a dead
  node's record is gone within milliseconds; otherwise it goes when its lease expires;
* each launcher writes a member key `<rdzv root>/members/<node desc>` = its node id, so a
  participant (torch names it `addr_pid_localid`) maps to a node. A node runs one launcher per
  job at a time: a newer member of the same node means the older launcher is gone. A launcher
  writes it only once its warm workers are ready (`launcher.py`), so no round waits for a node
  that is still starting, and deletes it when it stops.

`decide` (pure) turns that into actions on torch's state: participants of a gone
node are expired at once (torch's own sanitizer then removes them; the running nodes then
restart their round at once, `EtcdRendezvousHandler.num_nodes_waiting`), and a round whose
participants are every live node that is in the rendezvous is completed now instead of at
`last_call_timeout`. A participant without a member key (plain torchrun) is never expired by
us, and its presence keeps the last call as torch has it.

`use_membership` also makes a waiting node poll the state every `POLL_S` instead of torch's
fixed 1 s (its op loop sleeps `dynamic_rendezvous._delay(1)` between reads, and its state cache
is 1 s): a round used to take 2-3 s of polling on top of everything else. Both are settings of
this (launcher) process only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping, Protocol

from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _BackendRendezvousStateHolder

from elasticyolo.log import get_logger

log = get_logger("elasticyolo.torch.membership")

LONG_AGO = datetime(1970, 1, 1, tzinfo=timezone.utc)  # a heartbeat torch's sanitizer expires
POLL_S = 0.25  # a node waiting in a rendezvous re-reads the state this often


class PrefixReader(Protocol):
    def get_prefix(self, prefix: str) -> list[tuple[str, bytes, int]]: ...
    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int: ...
    def delete(self, key: str) -> bool: ...


@dataclass(frozen=True)
class Member:
    node: str  # the elasticyolo node id
    revision: int  # when its launcher registered (etcd mod revision)


@dataclass(frozen=True)
class Decision:
    expire: frozenset[str]  # participants' descs (str) whose node is gone
    complete_now: bool  # every live node known to the rendezvous has joined this round


def decide(*, participants: Iterable[str], known: Iterable[str], complete: bool, deadline_set: bool,
           min_nodes: int, members: Mapping[str, Member], live_nodes: set[str], first_round: bool = False
           ) -> Decision:
    """`participants`: this round's; `known`: every desc with a heartbeat in the state (the
    participants, the wait list and last round's nodes that have not left). Expected in a round:
    every live node whose launcher is in the rendezvous (a member key, or a heartbeat), and in
    the job's first round every live node (all of them are starting their launchers)."""
    newest: dict[str, int] = {}
    for m in members.values():
        newest[m.node] = max(newest.get(m.node, 0), m.revision)

    def gone(m: Member) -> bool:
        return m.node not in live_nodes or m.revision < newest[m.node]

    known = set(known)
    expire = frozenset(d for d in known if d in members and gone(members[d]))
    alive = known - expire
    joined = set(participants) - expire
    expected = {m.node for m in members.values() if not gone(m)} | (set(live_nodes) if first_round else set())
    complete_now = (not complete and deadline_set and len(joined) >= min_nodes and bool(joined)
                    and all(d in members for d in alive)
                    and expected <= {members[d].node for d in joined})
    return Decision(expire, complete_now)


class RendezvousView:
    """Reads the member keys and the live node records (two range reads per state sync)."""

    def __init__(self, client: PrefixReader, members_prefix: str, nodes_prefix: str) -> None:
        self.client, self.members_prefix, self.nodes_prefix = client, members_prefix, nodes_prefix

    def register(self, desc: str, node_id: str) -> None:
        self.client.put(self.members_prefix + desc, json.dumps({"node": node_id}))

    def unregister(self, desc: str) -> None:
        """This launcher leaves for good (a round no longer expects it); best effort."""
        try:
            self.client.delete(self.members_prefix + desc)
        except Exception as exc:  # noqa: BLE001 - a newer launcher of the node supersedes it anyway
            log.debug("member key not deleted", error=str(exc))

    def read(self) -> tuple[dict[str, Member], set[str]]:
        members: dict[str, Member] = {}
        for key, value, revision in self.client.get_prefix(self.members_prefix):
            try:
                members[key[len(self.members_prefix):]] = Member(str(json.loads(value)["node"]), revision)
            except (ValueError, KeyError, TypeError):
                continue  # not ours: never expires anyone
        live = {key[len(self.nodes_prefix):] for key, _, _ in self.client.get_prefix(self.nodes_prefix)}
        return members, live


class MembershipStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, plus `decide` applied after every sync (before torch's sanitizer)."""

    view: RendezvousView | None = None
    expired: frozenset[str] = frozenset()  # participants expired because their node is gone

    def _sanitize(self) -> None:
        view, state = self.view, self._state
        if view is not None:
            try:
                members, live = view.read()
            except Exception as exc:  # noqa: BLE001 - etcd hiccup: torch's timeouts still apply
                log.debug("membership unreadable", error=str(exc))
            else:
                self._apply(state, decide(
                    participants=map(str, state.participants), known=map(str, state.last_heartbeats),
                    complete=state.complete, deadline_set=state.deadline is not None,
                    min_nodes=self._settings.min_nodes, members=members, live_nodes=live,
                    first_round=state.round == 0))
        super()._sanitize()

    def _apply(self, state: Any, d: Decision) -> None:
        self.expired = self.expired | d.expire
        for node in list(state.last_heartbeats):
            if str(node) in d.expire:
                log.info("rendezvous participant's node is gone; dropping it now", participant=str(node))
                state.last_heartbeats[node] = LONG_AGO
        if d.complete_now:
            # torch's join op completes a round whose last-call deadline has passed.
            state.deadline = datetime.now(timezone.utc) - timedelta(milliseconds=1)


def _short_delay(seconds: float | tuple[float, float]) -> None:
    """torch's `_delay` with every wait capped at `POLL_S` (its 1 s poll between state reads)."""
    low, high = seconds if isinstance(seconds, tuple) else (seconds, seconds)
    wait = min(POLL_S, low + (high - low) / 2)
    if wait >= 0.01:
        time.sleep(wait)


def use_membership(handler: Any, view: RendezvousView, node_id: str) -> None:
    """Make `handler` (torch's dynamic handler, built by `from_backend`) follow the cluster."""
    view.register(str(handler._this_node), node_id)
    holder = handler._state_holder
    holder.__class__ = MembershipStateHolder  # same fields: only `_sanitize` differs
    holder.view = view
    holder._cache_duration = POLL_S
    dynamic_rendezvous._delay = _short_delay
