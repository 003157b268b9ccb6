"""The torch rendezvous told by the cluster who is alive, so that no round waits out a timeout.

torch's dynamic rendezvous learns that a node is gone only when its heartbeats stop for
`keep_alive_interval x keep_alive_max_attempt` (15 s by default), and it completes a round only
at `max_nodes` or after `last_call_timeout`, even when every node that could join has joined.
Under the agents both are known sooner:

* a node's agent registers it in etcd with a lease (`nodes/<id>`). The leader revokes the lease
  of an agent whose liveness connection closed (process death: `agent/dead_nodes.py`), so a dead
  node's record is gone within milliseconds; a node that stopped its heartbeats (frozen, cut off)
  is published as a suspect (`suspects/<id>`) at the heartbeat timeout, and counts as gone while
  it is one; otherwise a node goes when its lease expires;
* each launcher writes a member key `<rdzv root>/members/<node desc>` = its node id, so a
  participant (torch names it `addr_pid_localid`) maps to a node. A node runs one launcher per
  job at a time: a newer member of the same node means the older launcher is gone. A launcher
  writes it only once its warm workers are ready (`launcher.py`), so no round waits for a node
  that is still starting, and marks it left when it stops (on any exit but SIGKILL): its
  participant is expired at once. Deleting the key instead would make a stopped launcher's
  participant an unknown one, kept until torch's heartbeat expiry (a node drained on a spot notice
  while its launcher was in an etcd call would stop the survivors' next round for 14.5 s).

`decide` (pure) turns that into actions on torch's state: participants of a gone
node are expired at once (torch's own sanitizer then removes them; the running nodes then
restart their round at once, `EtcdRendezvousHandler.num_nodes_waiting`), a complete round that
lost a participant is replaced by the next one at once (not after each survivor has left it in
turn), and a round whose
participants are every live node that is in the rendezvous is completed now instead of at
`last_call_timeout`. A participant without a member key (plain torchrun) is never expired by
us, and its presence keeps the last call as torch has it.

`use_membership` also makes the launcher see a change at once instead of polling for it: an etcd
watch on the keys a round depends on (the rendezvous state, the node records, the suspects, the
member keys) invalidates torch's cached state, so the next read (the agent's monitor every
0.1 s, a waiting node every `POLL_S` instead of torch's fixed 1 s) fetches it, while an
unchanged state is served from the cache for up to `CACHE_S` (a missed event costs that much).
Polling instead would add 2-3 s to every round. Both are settings of this (launcher) process
only.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _BackendRendezvousStateHolder

from elasticyolo.cluster.keys import JobKeys
from elasticyolo.exit_hooks import at_exit
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.torch.membership")

LONG_AGO = datetime(1970, 1, 1, tzinfo=timezone.utc)  # a heartbeat torch's sanitizer expires
POLL_S = 0.05  # a node waiting in a rendezvous checks the (watched) state this often
CACHE_S = 1.0  # an unchanged state is re-read from etcd this often (the watch may miss an event)


class PrefixReader(Protocol):
    def get_prefix(self, prefix: str) -> list[tuple[str, bytes, int]]: ...
    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int: ...
    def delete(self, key: str) -> bool: ...
    def watch_prefix(self, prefix: str) -> tuple[Iterator[Any], Callable[[], None]]: ...


@dataclass(frozen=True)
class Member:
    node: str  # the elasticyolo node id
    revision: int  # when its launcher registered (etcd mod revision)
    left: bool = False  # its launcher has stopped


@dataclass(frozen=True)
class Decision:
    expire: frozenset[str]  # participants' descs (str) whose node is gone
    complete_now: bool  # every live node known to the rendezvous has joined this round
    next_round: bool = False  # a complete round lost a participant: start the next one now


def decide(*, participants: Iterable[str], known: Iterable[str], complete: bool, deadline_set: bool,
           min_nodes: int, members: Mapping[str, Member], live_nodes: set[str], first_round: bool = False
           ) -> Decision:
    """`participants`: this round's; `known`: every desc with a heartbeat in the state (the
    participants, the wait list and last round's nodes that have not left). Expected in a round:
    every live node whose launcher is in the rendezvous (a member key, or a heartbeat), and in
    the job's first round every live node (all of them are starting their launchers)."""
    newest: dict[str, int] = {}
    for m in members.values():
        if not m.left:  # a stopped launcher's marker, written late, does not supersede its successor
            newest[m.node] = max(newest.get(m.node, 0), m.revision)

    def gone(m: Member) -> bool:
        return m.left or m.node not in live_nodes or m.revision < newest[m.node]

    known, participants = set(known), set(participants)  # the state holder passes iterators
    expire = frozenset(d for d in known if d in members and gone(members[d]))
    alive = known - expire
    joined = participants - expire
    expected = {m.node for m in members.values() if not gone(m)} | (set(live_nodes) if first_round else set())
    complete_now = (not complete and deadline_set and len(joined) >= min_nodes and bool(joined)
                    and all(d in members for d in alive)
                    and expected <= {members[d].node for d in joined})
    return Decision(expire, complete_now, next_round=complete and bool(expire & participants))


class RendezvousView:
    """Reads the member keys, the node records and the suspects (three range reads per state
    sync). A node is live while its record is there and the leader does not suspect it."""

    def __init__(self, client: PrefixReader, members_prefix: str, keys: JobKeys) -> None:
        self.client, self.members_prefix, self.keys = client, members_prefix, keys

    def register(self, desc: str, node_id: str) -> None:
        self.client.put(self.members_prefix + desc, json.dumps({"node": node_id}))

    def leave(self, desc: str, node_id: str) -> None:
        """This launcher leaves for good: no round expects it, and its participant is expired at
        once; best effort (a newer launcher of the node, or the node's lease, supersedes it)."""
        try:
            self.client.put(self.members_prefix + desc, json.dumps({"node": node_id, "left": True}))
        except Exception as exc:  # noqa: BLE001
            log.debug("member key not marked left", error=str(exc))

    def read(self) -> tuple[dict[str, Member], set[str]]:
        members: dict[str, Member] = {}
        for key, value, revision in self.client.get_prefix(self.members_prefix):
            try:
                record = json.loads(value)
                members[key[len(self.members_prefix):]] = Member(str(record["node"]), revision,
                                                                 bool(record.get("left", False)))
            except (ValueError, KeyError, TypeError):
                continue  # not ours: never expires anyone
        live = {key[len(self.keys.nodes):] for key, _, _ in self.client.get_prefix(self.keys.nodes)}
        suspects = {key[len(self.keys.suspects):] for key, _, _ in self.client.get_prefix(self.keys.suspects)}
        return members, live - suspects


class MembershipStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, plus `decide` applied after every sync (before torch's sanitizer)."""

    view: RendezvousView | None = None
    expired: frozenset[str] = frozenset()  # participants expired because their node is gone
    changed = False  # set by the watch: the cached state is stale

    def sync(self) -> bool | None:
        if self.changed:
            self.changed = False  # cleared before the read: an event after it sets it again
            self._last_sync_time = -1.0  # torch serves its cache while this is recent
        return super().sync()

    def _sanitize(self) -> None:
        view, state = self.view, self._state
        if view is not None:
            try:
                members, live = view.read()
            except SignalException:
                raise  # the launcher's stop (launcher_signal.py), not an etcd hiccup
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
        if d.next_round:  # decided for this state's complete round
            # torch advances a complete round only when its last participant has left it: every
            # survivor's exit op, one etcd write each in turn, before anyone can join the next
            # (0.2-0.8 s on 2 busy cores). Advanced here instead, in this node's state, the
            # survivors' exit ops have nothing to do and the first join writes the new round.
            # The survivors still running see that they are no longer in their round and restart.
            state.round += 1
            state.complete = False
            state.deadline = None
            state.participants.clear()


def _short_delay(seconds: float | tuple[float, float]) -> None:
    """torch's `_delay` with every wait capped at `POLL_S` (its 1 s poll between state reads)."""
    low, high = seconds if isinstance(seconds, tuple) else (seconds, seconds)
    wait = min(POLL_S, low + (high - low) / 2)
    if wait >= 0.01:
        time.sleep(wait)


def watch_changes(view: RendezvousView, state_key: str, holder: MembershipStateHolder) -> Callable[[], None]:
    """Mark `holder` stale whenever a key a round depends on changes; returns the cancel."""
    relevant = (state_key, view.keys.nodes, view.keys.suspects, view.members_prefix)
    events, cancel = view.client.watch_prefix(view.keys.prefix)

    def pump() -> None:
        for ev in events:
            if ev.key.startswith(relevant):
                holder.changed = True

    threading.Thread(target=pump, name="rendezvous-watch", daemon=True).start()
    return cancel


def use_membership(handler: Any, view: RendezvousView, node_id: str) -> None:
    """Make `handler` (torch's dynamic handler, built by `from_backend`) follow the cluster.
    The launcher's member key is marked left when it exits, whichever way (torch calls the
    handler's `shutdown` on some exits only: not on SIGTERM)."""
    desc = str(handler._this_node)
    view.register(desc, node_id)
    left = threading.Event()

    def leave() -> None:  # once: `shutdown` and then the exit hook on a clean end
        if not left.is_set():
            left.set()
            view.leave(desc, node_id)

    handler._membership_leave = leave
    at_exit(leave)
    holder = handler._state_holder
    holder.__class__ = MembershipStateHolder  # same fields: only `sync` and `_sanitize` differ
    holder.view = view
    holder._cache_duration = CACHE_S
    holder.changed = True
    watch_changes(view, holder._backend.key, holder)
    dynamic_rendezvous._delay = _short_delay
