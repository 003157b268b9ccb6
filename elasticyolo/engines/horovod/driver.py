"""The Horovod Elastic driver, run by the leader's agent: Horovod's own `ElasticDriver` and
rendezvous server (the classes `horovodrun` and Horovod's Ray integration use), with etcd host
discovery and a create-worker function that asks node agents, through etcd, to start workers.

Wiring follows `horovod.runner.gloo_run.launch_gloo_elastic`; only two things differ:
* no SSH: `create_worker` writes `launch/<node>/<local_rank>` (leased by the leader, fenced by
  its term) and blocks until the node's agent reports the exit code under `exit/<request-id>`;
* the rendezvous server listens on the leader's advertised address, not on every interface
  (rendezvous.py; it also re-answers a rank assignment that never reached its worker).

The driver runs in its own thread (`DriverRunner`): the agent loop only starts and stops it.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import horovod.runner.elastic.driver as horovod_driver
from horovod.runner.elastic.driver import ElasticDriver
from horovod.runner.elastic.worker import HostUpdateResult
from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
from horovod.runner.common.util.hosts import SlotInfo

from elasticyolo.agent.state import SERVING_STATES
from elasticyolo.cluster.election import LeaderElection
from elasticyolo.cluster.etcd import EtcdClient, EtcdError
from elasticyolo.cluster.job_state import JobEvent, JobState
from elasticyolo.cluster.jobs import set_job_state
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.liveness import LivenessServer, Verdict
from elasticyolo.engines.horovod.abort import ABORT
from elasticyolo.engines.horovod.discovery import ClusterView, EtcdHostDiscovery, Snapshot
from elasticyolo.engines.horovod.failures import (PEER_GRACE_S, RESET_GRACE_S, SlotFacts, abort_targets,
                                                  excluded_hosts, slot_outcome)
from elasticyolo.engines.horovod.registry import GuardedWorkerRegistry
from elasticyolo.engines.horovod.rendezvous import BoundRendezvousServer, rendezvous_handler
from elasticyolo.engines.horovod.round_policy import is_crash
from elasticyolo.engines.world_health import etcd_answers, lost_nodes, world_stalled
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger
from elasticyolo.spec import TrainSpec
from elasticyolo.worker_runtime.worker_env import WorkerEnv
from elasticyolo.worker_runtime.worker_errors import failure_reason

# How long a stopped worker gets to report its exit before the driver counts it as failed.
STOP_REPORT_S = 5.0
# A host change Horovod has not acted on after this long is announced to the workers again.
RENOTIFY_S = 3.0
# Liveness verdicts that came while etcd did not answer the leader are acted on once it answers
# again, if within this long (a leader cut off steps down well before: its lease).
RECHECK_S = 10.0
# Horovod polls discovery once a second (holding its hosts lock). Ours answers from a cache, so a
# shorter period costs nothing and a lost or joining node is acted on sooner.
horovod_driver.DISCOVER_HOSTS_FREQUENCY_SECS = 0.2


class FencedElasticDriver(ElasticDriver):
    """Horovod's driver, ignoring the exit of a worker whose slot a newer request owns: a late
    report (its agent was frozen, the slot was re-assigned since) must not count against the
    slot's current worker (a late 0 would even read as success and stop the job). A worker counted
    out for its absence from a reset is recorded failed only if it is still absent
    (engines/horovod/registry.py)."""

    def __init__(self, *args: Any, superseded: Callable[[], bool], absent_in: Callable[[], int | None] = lambda: None,
                 on_register: Callable[[], None] = lambda: None, reset_limit: int | None = None,
                 crashed: Callable[[], bool] = lambda: False, **kwargs: Any) -> None:
        super().__init__(*args, reset_limit=reset_limit, **kwargs)
        self._worker_registry = GuardedWorkerRegistry(self, self._host_manager, reset_limit=reset_limit)
        self._superseded = superseded
        self._absent_in = absent_in
        self._on_register = on_register
        self._crashed = crashed
        self.restore_round = 1  # the reset whose workers restore from the newest snapshot (the first world)

    def forget_slots(self, slots: set[tuple[str, int]]) -> None:
        """Take these slots out of the current assignment, so that the next world starts workers
        for them again (Horovod starts workers only for slots new to the assignment). Hosts stay
        listed: the next world must share a host with this one to sync its state."""
        for host, local_rank in slots:
            if host in self._host_assignments:
                self._host_assignments[host] = [s for s in self._host_assignments[host] if s.local_rank != local_rank]

    def restore_next_world(self) -> None:
        """No host of the last world remains: forget it, and let the next world's workers agree on
        the newest snapshot (as a driver's first world does)."""
        self._host_assignments = {}
        self.restore_round = self._worker_registry.last_rendezvous() + 1

    def record_ready(self, host: str, slot: int) -> Any:
        # A worker registers in a reset (the rendezvous handler's thread; blocks in the barrier).
        self._on_register()
        return super().record_ready(host, slot)

    def _handle_worker_exit(self, slot_info: SlotInfo, exit_code: int, timestamp: float) -> None:
        if self._superseded():
            return
        rendezvous_id = self._absent_in()
        if self._crashed() and self.has_rank_assignment(slot_info.hostname, slot_info.local_rank):
            registry: GuardedWorkerRegistry = self._worker_registry  # type: ignore[assignment]
            registry.note_crash(slot_info.hostname, slot_info.local_rank)
        if rendezvous_id is not None:
            if self.has_rank_assignment(slot_info.hostname, slot_info.local_rank):
                registry: GuardedWorkerRegistry = self._worker_registry  # type: ignore[assignment]
                registry.record_failure_if_absent(slot_info.hostname, slot_info.local_rank, rendezvous_id)
            return
        super()._handle_worker_exit(slot_info, exit_code, timestamp)

    def _notify_workers_host_changes(self, current_hosts: Any, update_res: Any) -> None:
        # Horovod's decision, but the send runs on a thread of its own: Horovod calls this holding
        # its hosts lock, and its client has no timeout, so a frozen coordinator (its node vanished)
        # would stall the driver - resets included - until that process died (measured: 2 min).
        next_assignments: Any = {}
        if current_hosts.count_available_slots() >= self._min_num_proc:
            next_assignments, _ = self._get_host_assignments(current_hosts)
        if next_assignments == self.host_assignments:
            return
        coordinator = self.get_coordinator_info()
        client = self.get_worker_client(coordinator) if coordinator else None
        if client is None:
            return
        threading.Thread(target=_notify_quietly, args=(client, int(time.time()), update_res), daemon=True,
                         name="notify-coordinator").start()

    def discover_now(self) -> None:
        """One round of Horovod's host discovery, now (its thread's loop body): a world reset that
        completes before the thread's next round would otherwise still count a lost host in."""
        with self._wait_hosts_cond:
            try:
                update_res = self._host_manager.update_available_hosts()
            except Exception as exc:  # noqa: BLE001 - the discovery thread retries on its own
                get_logger("elasticyolo.driver").debug("discovery failed", error=str(exc))
                return
            if update_res != HostUpdateResult.no_update:
                self._notify_workers_host_changes(self._host_manager.current_hosts, update_res)
                self._wait_hosts_cond.notify_all()


class DriverRunner:
    """One Horovod elastic run of one job under one leadership term."""

    def __init__(self, *, client: EtcdClient, keys: JobKeys, election: LeaderElection, spec: TrainSpec,
                 addr: str, lease: Callable[[], int], node_id: str, liveness: LivenessServer | None = None) -> None:
        self.client, self.keys, self.election, self.spec = client, keys, election, spec
        self.addr, self.lease, self.node_id = addr, lease, node_id
        self.term = election.term  # the term its workers were started under (quiesce requests name it)
        self.lead_term = self.term  # the term it writes under now (a new one after `adopt`)
        self.log = get_logger("elasticyolo.driver", job=keys.job, node=node_id, term=self.term)
        self.view = ClusterView(client, keys)
        self.liveness = liveness  # fast failure signals (cluster/liveness.py); None: the lease only
        self._slot_owner: dict[tuple[str, int], str] = {}  # (host, local rank) -> newest request id
        self._superseded: set[int] = set()  # worker threads whose exit Horovod must ignore
        self._absent: dict[int, int] = {}  # worker thread -> the reset its worker was absent from
        self._crashes: set[int] = set()  # worker threads whose worker crashed (round_policy.is_crash)
        self._reset_seen: tuple[int, float] | None = None  # (rendezvous id, when its first worker registered)
        self._peers_seen: tuple[int, float] | None = None  # (rendezvous id, when every live worker had registered)
        self._excluded: set[str] = set()  # lost nodes discovery leaves out (failures.excluded_hosts)
        self._deferred: dict[str, Verdict] = {}  # verdicts to act on once etcd answers again
        self._acted_on: set[str] = set()  # lost nodes the world was already told about
        self._liveness_lock = threading.Lock()
        self.driver: ElasticDriver | None = None
        self.result: JobState | None = None  # DONE / FAILED once finished
        self.error: str | None = None
        self._stopping = threading.Event()
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._requests: dict[str, str] = {}  # launch key -> the request this driver wrote there (live workers)
        self._world_written: Any = None
        self._mismatch_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"horovod-driver-{self.term}", daemon=True)

    # ---- control (agent loop) -----------------------------------------------------------
    def start(self) -> "DriverRunner":
        self._thread.start()
        return self

    def stop(self, reason: str) -> None:
        """Stop without deciding the job's outcome (lost leadership, cancel, agent exit)."""
        if not self._stopping.is_set():
            self.log.info("stopping driver", reason=reason)
            self._stopping.set()
            if self.driver is not None:
                _stop_driver(self.driver, f"driver stopped: {reason}")
            self.view.stop()
        if self.liveness is not None:
            self.liveness.remove_listener(self._on_liveness)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def adopt(self, term: int) -> None:
        """This node leads again (term `term`) after its lease lapsed: keep the running world.
        The launch requests went with the old lease; they are written again as they were (same
        ids: the launchers keep their workers) under the new lease and term. The workers keep the
        term they were started with (`self.term`: quiesce requests name it, engines/drain.py)."""
        self.log.info("driver kept across a lapsed lease", new_term=term)
        self.lead_term = term
        with self._seq_lock:
            requests = dict(self._requests)
        for key, request in requests.items():
            try:
                if not self.election.fenced_put(key, request, lease=self.lease()):
                    self.log.warning("not leader any more; launch request not renewed", key=key)
                    return
            except (UnavailableError, EtcdError) as exc:
                self.log.warning("could not renew a launch request", key=key, error=str(exc))
        self._world_written = None  # the world record again, under the new term

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    # ---- the run ------------------------------------------------------------------------
    def _run(self) -> None:
        spec = self.spec
        slots = spec.slots
        min_np = spec.min_nodes * slots
        max_np = (spec.max_nodes or 100_000) * slots
        try:
            self.view.start()
            if self.liveness is not None:
                self.liveness.add_listener(self._on_liveness)
            rendezvous = BoundRendezvousServer(self.addr)
            lost = self._lost_nodes if self.liveness is not None else None
            driver = FencedElasticDriver(rendezvous, EtcdHostDiscovery(self.view, slots, exclude=lost), min_np, max_np,
                                         timeout=spec.elastic_timeout_s, reset_limit=spec.reset_limit,
                                         cooldown_range=tuple(spec.cooldown_s),
                                         superseded=self._take_superseded, absent_in=self._take_absent,
                                         on_register=self._on_register, crashed=self._take_crashed)
            self.driver = driver
            if self._stopping.is_set():
                driver.stop()
                return
            port = rendezvous.start(rendezvous_handler(driver))
            self.log.info("driver started", rendezvous=f"{self.addr}:{port}", min_np=min_np, max_np=max_np)
            self._set_state(JobEvent.START)
            current = self._wait_for_start(driver, min_np)
            num_proc = min(max(current.count_available_slots(), min_np), max_np)
            run_env = create_run_env_vars(self.addr, ["lo"], port, elastic=True)
            # The node's launcher picks its own interface for these (nodes differ).
            for k in ("HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME"):
                run_env.pop(k, None)
            run_env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(spec.gloo_timeout_s)
            # Workers act only on this term's quiesce requests (engines/drain.py).
            run_env.update(WorkerEnv(spec_json=spec.to_json(), term=self.term).to_env())
            watcher = threading.Thread(target=self._watch_world, name="world-writer", daemon=True)
            watcher.start()
            driver.start(num_proc, self._create_worker_fn({k: str(v) for k, v in run_env.items()}))
            res = driver.get_results()
            driver.stop()
            if self._stopping.is_set():
                return
            failed = [n for n, (code, _) in res.worker_results.items() if code != 0]
            if res.error_message is None and res.worker_results and not failed:
                self.result = JobState.DONE
            else:
                self.result = JobState.FAILED
                self.error = failure_reason(self.client, self.keys, res.error_message or (
                    f"workers failed: {failed}" if failed else "no worker finished"))
            self.log.info("driver finished", result=self.result.value, error=self.error,
                          workers={k: v[0] for k, v in res.worker_results.items()})
            self._set_state(JobEvent.FINISH if self.result is JobState.DONE else JobEvent.FAIL, self.error)
        except Exception as exc:  # noqa: BLE001 - a driver failure fails the job, never the agent
            if self._stopping.is_set():
                return
            self.result, self.error = JobState.FAILED, f"{type(exc).__name__}: {exc}"
            self.log.error("driver failed", error=self.error)
            self._set_state(JobEvent.FAIL, self.error)
            if self.driver is not None:
                _stop_driver(self.driver, self.error)
        finally:
            self.view.stop()
            if self.liveness is not None:
                self.liveness.remove_listener(self._on_liveness)
            self._clear_launches()

    def _take_superseded(self) -> bool:
        # Called by Horovod on the worker's thread right after create_worker returned.
        ident = threading.get_ident()
        if ident in self._superseded:
            self._superseded.discard(ident)
            return True
        return False

    def _take_crashed(self) -> bool:
        # Called by Horovod on the worker's thread right after create_worker returned.
        ident = threading.get_ident()
        if ident in self._crashes:
            self._crashes.discard(ident)
            return True
        return False

    def _take_absent(self) -> int | None:
        # Called by Horovod on the worker's thread right after create_worker returned.
        return self._absent.pop(threading.get_ident(), None)

    def _on_register(self) -> None:
        # The workers' waiters decide on registrations (failures.slot_outcome): re-check once this
        # one is recorded and when each grace it may start has passed, not only at the next poll.
        for delay in (0.02, PEER_GRACE_S + 0.04, RESET_GRACE_S + 0.04):
            timer = threading.Timer(delay, self.view.poke)
            timer.daemon = True
            timer.start()

    def _on_liveness(self, changes: dict[str, Verdict]) -> None:
        # A lost node: wake the workers' waiters now rather than at the next etcd poll, and make
        # the rest of the world abort a collective that may be blocked on it.
        self.view.poke()
        if not self._etcd_answers():  # we may be the one cut off: not now (failures.py)
            self._defer({n: v for n, v in changes.items() if v in (Verdict.DEAD, Verdict.SUSPECT)})
            return
        driver = self.driver
        lost = {n for n, v in changes.items() if v in (Verdict.DEAD, Verdict.SUSPECT)} & self._lost_nodes()
        self._acted_on |= lost
        if not lost or driver is None or driver.finished():
            return
        try:
            world = set(driver.host_assignments)
            clients = dict(driver._worker_clients)
        except RuntimeError:  # changed size while copying: the next change will do
            return
        targets = abort_targets(lost, world, clients)
        # The lost node out of Horovod's hosts first: the reset the abort causes must not count it
        # (seen: an agent-only freeze, the orphan worker rejoined the next world, then left).
        driver.discover_now()
        if targets:
            self.log.info("aborting the world's collective", lost=sorted(lost), workers=len(targets))
        stamp = int(time.time())
        for host, slot in targets:
            threading.Thread(target=_notify_abort, args=(clients[(host, slot)], stamp, self.log), daemon=True,
                             name=f"abort-{host}-{slot}").start()

    def _act_on_stalled_suspects(self) -> None:
        """A suspect node becomes lost when the world stops stepping after its verdict (the
        liveness listener saw the verdict while the world still stepped): act on it then."""
        if self.liveness is None:
            return
        lost = self._lost_nodes()
        newly = lost - self._acted_on
        self._acted_on &= lost  # one that came back is acted on again when lost again
        if newly:
            self._on_liveness({n: Verdict.SUSPECT for n in newly})

    def _etcd_answers(self) -> bool:
        if self.liveness is None:
            return True
        return etcd_answers(time.monotonic() - self.view.snapshot.at, self.liveness.table.timeout_s)

    def _defer(self, verdicts: dict[str, Verdict]) -> None:
        if not verdicts:
            return
        with self._liveness_lock:
            first = not self._deferred
            self._deferred.update(verdicts)
        self.log.info("liveness verdicts held: etcd does not answer", nodes=sorted(verdicts))
        if first:
            threading.Thread(target=self._act_when_etcd_answers, name="liveness-recheck", daemon=True).start()

    def _act_when_etcd_answers(self) -> None:
        # A slow read, not a partition: the verdicts stand once etcd answers (those that still do).
        since = time.monotonic()
        self.view.wait(lambda s: s.at > since or self._stopping.is_set(), timeout=RECHECK_S)
        with self._liveness_lock:
            verdicts, self._deferred = self._deferred, {}
        if not self._stopping.is_set() and self._etcd_answers():
            self._on_liveness(verdicts)

    def _clear_launches(self) -> None:
        # Fenced: a deposed driver must not delete its successor's requests.
        from elasticyolo.cluster.etcd import b64, prefix_range_end

        prefix = self.keys.launch_prefix
        try:
            if self.election.is_leader and self.election.term == self.lead_term:
                self.client.txn([self.election.fenced_txn_compare()], [{"request_delete_range": {
                    "key": b64(prefix), "range_end": b64(prefix_range_end(prefix))}}], [])
        except (UnavailableError, EtcdError) as exc:
            self.log.warning("could not clear launch requests", error=str(exc))

    def _wait_for_start(self, driver: ElasticDriver, min_np: int, settle_s: float = 10.0) -> Any:
        """Wait for `min_np` slots, then up to `settle_s` more for every registered node to be
        ready (warm workers get ready a second apart; starting with all avoids an early reset)."""
        current = driver.wait_for_available_slots(min_np)
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            nodes = self.view.snapshot.nodes
            serving = [n for n, r in nodes.items() if r.get("state") in SERVING_STATES]
            current = driver.wait_for_available_slots(min_np)
            if all(n in current.available_hosts for n in serving):
                break
            self._stopping.wait(0.2)
        return current

    def _renotify(self, driver: ElasticDriver) -> None:
        """Horovod notifies the rank-0 worker of new hosts once, and drops the notice if that
        worker has not registered yet (a host added during a reset is then never used): while
        the discovered hosts would change the assignment, notify again every few seconds."""
        with driver._wait_hosts_cond:
            current = driver._host_manager.current_hosts
            if current.count_available_slots() < driver._min_num_proc:
                self._mismatch_since = None
                return
            wanted, _ = driver._get_host_assignments(current)
            if wanted == driver.host_assignments:
                self._mismatch_since = None
                return
            now = time.monotonic()
            if self._mismatch_since is None:
                self._mismatch_since = now
            elif now - self._mismatch_since > RENOTIFY_S:
                self.log.info("re-notifying workers of host changes", hosts=sorted(current.available_hosts))
                self._mismatch_since = now
                driver._notify_workers_host_changes(current, HostUpdateResult.added)

    def _set_state(self, event: JobEvent, reason: str | None = None) -> None:
        """Report `event` to the job state, fenced by this node's leadership term."""
        for _ in range(5):
            try:
                if not self.election.is_leader:
                    self.log.warning("not leader any more; job state not written", job_event=event.value)
                elif not set_job_state(self.client, self.keys, event, by=f"driver {self.node_id} term {self.term}",
                                       reason=reason, fence=[self.election.fenced_txn_compare()]):
                    self.log.info("job state unchanged: the job is past this event, or another writer "
                                  "got there first", job_event=event.value)
                return
            except (UnavailableError, EtcdError) as exc:
                self.log.warning("could not write job state; retrying", job_event=event.value, error=str(exc))
                time.sleep(0.5)

    def _watch_world(self) -> None:
        """Publish the host assignment (`world`) whenever Horovod changes it, for `status`."""
        while not self._stopping.is_set() and self.driver is not None and not self.driver.finished():
            try:
                assignments = {h: sorted(s.rank for s in slots) for h, slots in self.driver.host_assignments.items()}
                if assignments and assignments != self._world_written:
                    world = {"world_size": sum(len(r) for r in assignments.values()), "ranks": assignments,
                             "term": self.term, "leader": self.node_id, "at": time.time()}
                    if self.election.fenced_put(self.keys.world, json.dumps(world)):
                        self._world_written = assignments
                self._renotify(self.driver)
                self._act_on_stalled_suspects()
            except (UnavailableError, EtcdError, RuntimeError) as exc:  # RuntimeError: dict changed size
                self.log.debug("world not written", error=str(exc))
            self._stopping.wait(0.25)

    # ---- workers ------------------------------------------------------------------------
    def _next_id(self, slot: SlotInfo) -> str:
        with self._seq_lock:
            self._seq += 1
            return f"{self.term}-{self._seq}-{slot.hostname}-{slot.local_rank}"

    def _create_worker_fn(self, run_env: dict[str, str]) -> Callable[[SlotInfo, list[threading.Event]], tuple[int, float]]:
        def create_worker(slot: SlotInfo, events: list[threading.Event]) -> tuple[int, float]:
            request_id = self._next_id(slot)
            key = self.keys.launch_slot(slot.hostname, slot.local_rank)
            env = {**run_env, **create_slot_env_vars(slot)}
            assert self.driver is not None
            if self.driver._worker_registry.last_rendezvous() == getattr(self.driver, "restore_round", 1):
                # This driver's first world: its workers agree on the newest snapshot
                # (train/snapshots.py). Read before the request is written, so no later reset can
                # have happened yet.
                env.update(WorkerEnv(restore=True).to_env())
            request = {"action": "start", "id": request_id, "term": self.term, "env": env, "at": time.time()}
            log = self.log.bind(slot=f"{slot.hostname}[{slot.local_rank}]", rank=slot.rank, request=request_id)
            try:
                if not self.election.fenced_put(key, json.dumps(request), lease=self.lease()):
                    log.warning("not leader; worker not started")
                    return 1, time.time()
            except (UnavailableError, EtcdError) as exc:
                log.warning("could not write launch request", error=str(exc))
                return 1, time.time()
            log.info("worker requested", size=slot.size)
            owner = (slot.hostname, slot.local_rank)
            self._slot_owner[owner] = request_id
            with self._seq_lock:
                self._requests[key] = json.dumps(request)
            try:
                return self._await_exit(slot, request_id, key, events, log)
            finally:
                with self._seq_lock:
                    if json.loads(self._requests.get(key, "{}")).get("id") == request_id:
                        del self._requests[key]
                self._forget(request_id)
                if self._slot_owner.get(owner) != request_id:
                    log.info("a newer request owns the slot; this exit is not reported to Horovod")
                    self._superseded.add(threading.get_ident())

        return create_worker

    def _await_exit(self, slot: SlotInfo, request_id: str, key: str, events: list[threading.Event],
                    log: Any) -> tuple[int, float]:
        started = time.monotonic()

        def outcome(snap: Snapshot) -> tuple[str, Any] | None:
            report = snap.exits.get(request_id)
            return slot_outcome(self._slot_facts(slot, snap, started,
                                                 None if report is None else int(report.get("code", 1)),
                                                 any(e.is_set() for e in events)))

        while True:
            got = self.view.wait(outcome, timeout=1.0)
            if got is None:
                continue
            what, code = got
            if what == "exit":
                log.info("worker exited", code=code)
                if is_crash(code):
                    self._crashes.add(threading.get_ident())
                return code, time.time()
            if what == "left":
                log.info("node lost; its worker had left the world already",
                         liveness=self._verdict(slot.hostname).value)
                return 1, time.time()
            if what == "node-gone":
                log.warning("node lost; counting its worker as failed",
                            liveness=self._verdict(slot.hostname).value)
                return 1, time.time()
            if what == "absent":
                log.warning("node lost and its worker absent from the reset; counting it failed unless it registers",
                            liveness=self._verdict(slot.hostname).value, reset=code)
                if code is not None:
                    self._absent[threading.get_ident()] = int(code)
                return 1, time.time()
            # Horovod stops this worker (job shutdown or its host was blacklisted): withdraw the
            # request; the node's agent kills the worker and reports its exit.
            self._withdraw(key, request_id)
            got = self.view.wait(lambda s: s.exits.get(request_id) or (slot.hostname not in s.nodes),
                                 timeout=STOP_REPORT_S)
            code = int(got.get("code", 1)) if isinstance(got, dict) else 1
            log.info("worker stopped", code=code)
            return code, time.time()

    def _tokens(self) -> dict[str, str]:
        return {n: str(r.get("liveness_token") or "") for n, r in self.view.snapshot.listed.items()}

    def _lost_nodes(self) -> set[str]:
        # Only verdicts of connections that proved to be the node (its record's token), and none
        # newly while etcd does not answer us (failures.py).
        if self.liveness is None:
            return set()
        tokens = self._tokens()
        silent = self.liveness.lost(tokens)
        snap = self.view.snapshot
        stalled = world_stalled(snap.step_changed_at, snap.step_period_s, time.monotonic())
        lost = lost_nodes({n: self.liveness.verdict(n, tokens.get(n)) for n in silent}, stalled)
        with self._liveness_lock:
            self._excluded = excluded_hosts(lost, self._excluded, self._etcd_answers())
            return set(self._excluded)

    def _verdict(self, node: str) -> Verdict:
        if self.liveness is None or not self._etcd_answers():
            return Verdict.UNKNOWN  # cut off, we cannot tell their silence from ours: the lease decides
        rec = self.view.snapshot.listed.get(node)
        # A node whose record is gone (lease expired) keeps the verdict its last connection earned.
        return self.liveness.verdict(node, None if rec is None else str(rec.get("liveness_token") or ""))

    def _slot_facts(self, slot: SlotInfo, snap: Snapshot, started: float, exit_code: int | None,
                    stopping: bool) -> SlotFacts:
        host, local_rank = slot.hostname, slot.local_rank
        driver = self.driver
        assigned, registered, pending, peers, reset_id = True, False, None, None, None
        if driver is not None:
            assigned = driver.has_rank_assignment(host, local_rank)
            registry = driver._worker_registry
            states = dict(registry._states)  # recorded in the pending reset (cleared when it completes)
            registered = (host, local_rank) in states
            if states:
                reset_id, now = registry.last_rendezvous(), time.monotonic()
                if self._reset_seen is None or self._reset_seen[0] != reset_id:
                    self._reset_seen = (reset_id, now)
                pending = now - self._reset_seen[1]
                if self._live_workers_registered(driver, states):
                    if self._peers_seen is None or self._peers_seen[0] != reset_id:
                        self._peers_seen = (reset_id, now)
                    peers = now - self._peers_seen[1]
        return SlotFacts(exit_code=exit_code, stopping=stopping, liveness=self._verdict(host),
                         record_present=host in snap.listed or snap.at <= started, assigned=assigned,
                         registered=registered, reset_pending_s=pending, peers_registered_s=peers,
                         reset_id=reset_id)

    def _live_workers_registered(self, driver: ElasticDriver, states: dict[Any, Any]) -> bool:
        """Every worker of the world on a node not lost has registered in the pending reset."""
        lost = self._lost_nodes()
        try:
            world = [(h, s.local_rank) for h, slots in driver.host_assignments.items() if h not in lost for s in slots]
        except RuntimeError:  # changed size while iterating (a reset completing): next time
            return False
        return all(slot in states for slot in world)

    def _withdraw(self, key: str, request_id: str) -> None:
        """Tell the node's launcher to stop this request's worker: a stop record in place of the
        request, written only while this driver's term leads and the request is still the one
        there (a deposed driver stops nothing; a newer request is left alone)."""
        from elasticyolo.cluster.etcd import b64

        try:
            got = self.client.get(key)
            if got is None or json.loads(got[0]).get("id") != request_id:
                return
            stop = json.dumps({"action": "stop", "id": request_id, "term": self.term, "at": time.time()})
            put: dict[str, Any] = {"key": b64(key), "value": b64(stop)}
            if self.lease():
                put["lease"] = str(self.lease())
            if self.election.is_leader and self.election.term == self.lead_term:
                self.client.txn([self.election.fenced_txn_compare(),
                                 {"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(got[1])}],
                                [{"request_put": put}], [])
        except (UnavailableError, EtcdError, ValueError) as exc:
            self.log.warning("could not withdraw launch request", key=key, error=str(exc))

    def _forget(self, request_id: str) -> None:
        try:
            self.client.delete(self.keys.exit(request_id))
        except (UnavailableError, EtcdError):
            pass  # leased by the node: goes with it


def _notify_quietly(client: Any, stamp: int, update_res: Any) -> None:
    try:
        client.notify_hosts_updated(stamp, update_res)
    except Exception:  # noqa: BLE001 - as Horovod: a coordinator that is gone is reset anyway
        pass


def _notify_abort(client: Any, stamp: int, log: Any) -> None:
    try:
        client.notify_hosts_updated(stamp, ABORT)
    except Exception as exc:  # noqa: BLE001 - that worker may be gone too; its peers abort it anyway
        log.debug("abort notification failed", error=str(exc))


def _stop_driver(driver: ElasticDriver, error: str | None) -> None:
    try:
        if not driver.finished():
            driver.stop(error_message=error)
    except Exception:  # noqa: BLE001 - stopping twice, or the rendezvous never started
        pass
    # `wait_for_available_slots` only re-checks shutdown when woken: wake it.
    with driver._wait_hosts_cond:
        driver._wait_hosts_cond.notify_all()
