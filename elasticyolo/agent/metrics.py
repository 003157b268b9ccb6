"""Prometheus metrics of one agent, served on 127.0.0.1 by default (`--metrics-port`)."""

from __future__ import annotations

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

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Start the HTTP endpoint in a daemon thread; returns the bound port (port 0: any free one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)
