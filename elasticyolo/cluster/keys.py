"""The etcd key layout of one job. Every key elasticyolo writes lives under `/elasticyolo/<job>/`.

| key                               | writer            | lease      | value (JSON unless noted)            |
|-----------------------------------|-------------------|------------|--------------------------------------|
| `nodes/<node-id>`                 | that node's agent | node lease | NodeRecord (registry.py)             |
| `leader`                          | elected agent     | node lease | LeaderRecord (election.py); its mod revision is the fencing token |
| `suspects/<node-id>`              | leader (fenced)   | leader's   | {"node","by","at"}: no heartbeat within the timeout (agent/dead_nodes.py) |
| `spec`                            | `submit`, agent config | none  | TrainSpec JSON (elasticyolo.spec)   |
| `state`                           | `submit`/`cancel`/leader/engine (cluster/jobs.py) | none | {"state", "at", "by", "reason"}; "state" is a JobState (cluster/job_state.py) |
| `world`                           | leader (driver)   | none       | World: {"world_size","ranks":{node:[rank..]},"term","leader","at"} |
| `launch/<node-id>/<local-rank>`   | leader (Horovod driver) | leader's | launch request: {"action": "start", "id", "env", "term", "at"}, or {"action": "stop", "id"} to withdraw it (a request that is merely gone stops nothing) |
| `exit/<request-id>`               | the node's agent  | node lease | worker exit report: {"code","node","slot","at"} |
| `events/<ms>-<node-id>-<seq>`     | any agent         | none       | {"at","node","kind","from","to","reason"} (leader trims old ones) |
| `errors/<node-id>`                | that node's agent | none       | its workers' latest fatal error: {"node","slot","code","pid","reason","generation","at","joined","round"} (worker_runtime/worker_errors.py) |
| `progress`                        | rank 0 worker     | none       | Progress: {"epoch","step","samples_s","world_size","loss","node","at"} |
| `checkpoint/latest`               | rank 0 worker     | none       | the newest landed checkpoint: {"uri","epoch","step","at","size",...} |
| `resume`                          | rank 0 worker     | none       | one per (re)start of training: {"step","world","lost_steps","reason","term","at"} |
| `quiesce`                         | a draining agent  | none       | quiesce request: {"id","term","checkpoint","hold","timeout_s","by","at"} |
| `quiesce_ack`                     | rank 0 worker     | none       | {"id","step","epoch","checkpoint","at"} |
| `rdzv/...`                        | torchrun's etcd3 rendezvous | -  | torch rendezvous state (engines/torch/rendezvous.py) |
| `torch/<gen>/members/<node>.<slot>` | the worker; its node's launcher deletes it | none | MemberRecord (engines/torch/world_plan.py) |
| `torch/<gen>/store/...`           | torch engine workers | none    | the process groups' store: reconfiguration keys, incarnation counter |

Job names and node ids follow one rule (`_NAME_RE`): 1-128 of `A-Z a-z 0-9 . _ -`, starting
with a letter or digit, so a name never needs escaping in a key, an object-store path or a
directory, and the same name works for `agent`, `submit`, `status`, `train` and `checkpoints`.
"""

from __future__ import annotations

import re

from elasticyolo.errors import UserError

ROOT = "/elasticyolo/"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NAME_RULE = "use 1-128 of A-Z a-z 0-9 . _ - (starting with a letter or digit)"


def check_job_name(job: str) -> str:
    if not _NAME_RE.match(job or ""):
        raise UserError(f"job name {job!r} is invalid: {_NAME_RULE}")
    return job


def check_node_id(node_id: str) -> str:
    if not _NAME_RE.match(node_id or ""):
        raise UserError(f"node id {node_id!r} is invalid: {_NAME_RULE}")
    return node_id


class JobKeys:
    """Key names for one job: `JobKeys("coco").node("gpu-1")` -> `/elasticyolo/coco/nodes/gpu-1`."""

    def __init__(self, job: str) -> None:
        self.job = check_job_name(job)
        self.prefix = f"{ROOT}{job}/"
        self.nodes = self.prefix + "nodes/"
        self.suspects = self.prefix + "suspects/"
        self.leader = self.prefix + "leader"
        self.spec = self.prefix + "spec"
        self.state = self.prefix + "state"
        self.world = self.prefix + "world"
        self.launch_prefix = self.prefix + "launch/"
        self.exits = self.prefix + "exit/"
        self.events = self.prefix + "events/"
        self.errors = self.prefix + "errors/"
        self.progress = self.prefix + "progress"
        self.checkpoint_latest = self.prefix + "checkpoint/latest"
        self.resume = self.prefix + "resume"
        self.quiesce = self.prefix + "quiesce"
        self.quiesce_ack = self.prefix + "quiesce_ack"
        self.rdzv = self.prefix + "rdzv/"
        self.torch = self.prefix + "torch/"
        self.billing = self.prefix + "billing/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def suspect(self, node_id: str) -> str:
        return self.suspects + node_id

    def launch(self, node_id: str) -> str:
        """The prefix of one node's launch requests (`launch/<node-id>/`)."""
        return f"{self.launch_prefix}{node_id}/"

    def launch_slot(self, node_id: str, local_rank: int) -> str:
        return f"{self.launch(node_id)}{local_rank}"

    def torch_members(self, generation: int) -> str:
        """The torch engine's member records of one submission (`torch/<gen>/members/`)."""
        return f"{self.torch}{generation}/members/"

    def torch_member(self, generation: int, node_id: str, slot: int) -> str:
        return f"{self.torch_members(generation)}{node_id}.{slot}"

    def torch_store(self, generation: int) -> str:
        """The torch engine's process-group store of one submission (`torch/<gen>/store/`)."""
        return f"{self.torch}{generation}/store/"

    def error(self, node_id: str) -> str:
        return self.errors + node_id

    def exit(self, request_id: str) -> str:
        return self.exits + request_id

    def billing_entry(self, node_id: str, started_at: float) -> str:
        """One agent run's billing record (`billing/<node-id>-<started ms>`); not leased: it
        outlives the node, so a preempted node's spend stays counted."""
        return f"{self.billing}{node_id}-{int(started_at * 1000)}"

    def event(self, at_ms: int, node_id: str, seq: int = 0) -> str:
        # Zero-padded milliseconds keep events in time order under a prefix range read.
        return f"{self.events}{at_ms:015d}-{node_id}-{seq}"

    def node_id_of(self, key: str) -> str:
        """`.../nodes/<id>` -> `<id>`."""
        return key[len(self.nodes):]

