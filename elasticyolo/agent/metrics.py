"""Prometheus metrics of one agent, served on 127.0.0.1 by default (`--metrics-port`)."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from elasticyolo.agent.state import NodeState


class AgentMetrics:
    def __init__(self, node_id: str, job: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"node": node_id, "job": job}
        self._labels = labels
        self.state = Gauge("elasticyolo_node_state", "1 for the node's current state", ["node", "job", "state"],
                           registry=self.registry)
        self.transitions = Counter("elasticyolo_state_transitions_total", "state transitions",
                                   ["node", "job", "from_state", "to_state"], registry=self.registry)
        self.world_size = Gauge("elasticyolo_world_size", "workers in the job's world (from etcd)",
                                ["node", "job"], registry=self.registry).labels(**labels)
        self.nodes = Gauge("elasticyolo_nodes", "registered nodes in the job", ["node", "job"],
                           registry=self.registry).labels(**labels)
        self.leader = Gauge("elasticyolo_is_leader", "1 while this node leads", ["node", "job"],
                            registry=self.registry).labels(**labels)
        self.leader_term = Gauge("elasticyolo_leader_term", "fencing token of our leadership (0: none)",
                                 ["node", "job"], registry=self.registry).labels(**labels)
        self.lease_renew = Histogram("elasticyolo_lease_renew_seconds", "lease keepalive latency",
                                     ["node", "job"], registry=self.registry,
                                     buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
                                     ).labels(**labels)
        self.lease_renew_failures = Counter("elasticyolo_lease_renew_failures_total", "failed keepalives",
                                            ["node", "job"], registry=self.registry).labels(**labels)
        self.lease_lapses = Counter("elasticyolo_lease_lapses_total",
                                    "leases that expired while the node was a member (it re-registered in place)",
                                    ["node", "job"], registry=self.registry).labels(**labels)
        self.notices = Counter("elasticyolo_interruption_notices_total", "interruption notices received",
                               ["node", "job"], registry=self.registry).labels(**labels)
        self.at_risk = Gauge("elasticyolo_node_at_risk", "1 while an at-risk notice (e.g. rebalance) stands",
                             ["node", "job"], registry=self.registry).labels(**labels)
        self.drains = Counter("elasticyolo_drains_total", "drains started", ["node", "job", "reason"],
                              registry=self.registry)
        self.notice_to_drained = Gauge("elasticyolo_notice_to_drained_seconds",
                                       "seconds from the last notice to drained (the node left the world)",
                                       ["node", "job"], registry=self.registry).labels(**labels)
        self.drain_lost_steps = Gauge("elasticyolo_drain_lost_steps",
                                      "committed steps the world lost in the last drain (-1: unknown)",
                                      ["node", "job"], registry=self.registry).labels(**labels)
        self.etcd_errors = Counter("elasticyolo_etcd_errors_total", "etcd calls that failed after retries",
                                   ["node", "job"], registry=self.registry).labels(**labels)
        self.set_state(NodeState.JOINING)

    def set_state(self, state: NodeState) -> None:
        for s in NodeState:
            self.state.labels(state=s.value, **self._labels).set(1 if s is state else 0)

    def transition(self, old: NodeState, new: NodeState) -> None:
        self.transitions.labels(from_state=old.value, to_state=new.value, **self._labels).inc()
        self.set_state(new)

    def observe_renew(self, latency: float | None) -> None:
        if latency is None:
            self.lease_renew_failures.inc()
        else:
            self.lease_renew.observe(latency)

    def add_job_view(self, read_view: Callable[[], dict[str, Any]]) -> None:
        """Serve the job-wide figures (`JobCollector`) from this registry."""
        self.registry.register(JobCollector(self._labels["node"], self._labels["job"], read_view))

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Start the HTTP endpoint in a daemon thread; returns the bound port (port 0: any free one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)


class JobCollector:
    """Job-wide figures on this agent's /metrics, read from etcd at scrape time (one `status`
    read, lease TTLs skipped): spend, on-demand equivalent, savings, burn rate, goodput, training
    progress, and the last checkpoint the workers landed (size, upload and snapshot seconds, age).
    The workers publish those records to etcd; the agent serves them, so one scrape target per
    node covers the worker side too."""

    def __init__(self, node_id: str, job: str, read_view: Callable[[], dict[str, Any]]) -> None:
        self.node_id, self.job = node_id, job
        self.read_view = read_view

    def describe(self) -> list[Any]:
        return []  # computed at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            view = self.read_view()
        except Exception:  # noqa: BLE001 - an unreachable etcd leaves these out of this scrape
            up = GaugeMetricFamily("elasticyolo_job_view_up", "1 if the job's records could be read from etcd",
                                   labels=["node", "job"])
            up.add_metric([self.node_id, self.job], 0)
            yield up
            return
        labels = [self.node_id, self.job]

        def gauge(name: str, doc: str, value: Any) -> Iterator[Any]:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                g = GaugeMetricFamily(name, doc, labels=["node", "job"])
                g.add_metric(labels, float(value))
                yield g

        cost, good = view.get("cost") or {}, view.get("goodput") or {}
        ck = view.get("last_checkpoint") if isinstance(view.get("last_checkpoint"), dict) else {}
        yield from gauge("elasticyolo_job_view_up", "1 if the job's records could be read from etcd", 1)
        yield from gauge("elasticyolo_job_spent_usd", "USD spent so far on the job's registered nodes",
                         cost.get("spent_usd"))
        yield from gauge("elasticyolo_job_on_demand_usd", "the same node-hours at on-demand prices",
                         cost.get("on_demand_usd"))
        yield from gauge("elasticyolo_job_savings_usd", "on-demand equivalent minus spent", cost.get("savings_usd"))
        yield from gauge("elasticyolo_job_burn_usd_per_hour", "USD per hour of the registered nodes",
                         cost.get("burn_usd_per_hour"))
        yield from gauge("elasticyolo_job_usd_per_epoch", "spent / epochs trained", cost.get("usd_per_epoch"))
        yield from gauge("elasticyolo_job_goodput_ratio",
                         "trained samples/s over the paid slots' steady-state samples/s", good.get("ratio"))
        yield from gauge("elasticyolo_job_samples_per_second", "trained samples/s (rank 0's window)",
                         view.get("samples_s"))
        yield from gauge("elasticyolo_job_epochs_done", "epochs trained (with the current one's fraction)",
                         view.get("epochs_done"))
        yield from gauge("elasticyolo_job_step", "optimizer steps trained", view.get("step"))
        yield from gauge("elasticyolo_checkpoint_last_step", "step of the newest landed checkpoint", ck.get("step"))
        yield from gauge("elasticyolo_checkpoint_last_size_bytes", "size of the newest checkpoint", ck.get("size"))
        yield from gauge("elasticyolo_checkpoint_last_upload_seconds", "background upload time of the newest "
                         "checkpoint", ck.get("upload_s"))
        yield from gauge("elasticyolo_checkpoint_last_snapshot_seconds", "training's blocking share of the newest "
                         "checkpoint", ck.get("snapshot_s"))
        if isinstance(ck.get("at"), (int, float)):
            yield from gauge("elasticyolo_checkpoint_last_age_seconds", "seconds since the newest checkpoint landed",
                             max(0.0, float(view.get("at") or time.time()) - ck["at"]))
