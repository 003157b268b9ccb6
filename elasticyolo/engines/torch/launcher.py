"""One node's torch elastic agent: `LocalElasticAgent` (through torch's launcher API) on the etcd3
rendezvous, running `elasticyolo worker` (the torch engine's `worker.py`) in `nproc_per_node` workers,
each round's workers warm before the round (`warm.py`): this node joins the rendezvous only once
its warm workers are ready.

Started by the elasticyolo agent's torch node (`node.py`) as
`python -m elasticyolo.engines.torch.launcher` with its configuration in the worker environment
(`engine_config`: `LaunchSettings` as JSON; `worker_runtime/worker_env.py`). It dies with the agent and
its workers die with it (`worker_runtime/lifeline.py`). It runs on this process's main thread, so
torch's SIGTERM handling works: SIGTERM stops the workers and leaves the rendezvous open for the
other nodes (torch closes it only when the job ends).

Exit codes: 0 the job finished; 3 the rendezvous was already closed (finished elsewhere);
143 stopped by SIGTERM; 1 anything else (the node plug-in retries).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticyolo.log import get_logger
from elasticyolo.worker_runtime import worker_env
from elasticyolo.worker_runtime.lifeline import die_with_agent
from elasticyolo.worker_runtime.prewarm import PrewarmPool, preload_modules, prewarm_enabled
from elasticyolo.worker_runtime.spawn import worker_command
from elasticyolo.worker_runtime.zygote import Zygote, zygote_enabled

if TYPE_CHECKING:
    from elasticyolo.engines.torch.warm import WarmStarts

log = get_logger("elasticyolo.torch.launcher")

EXIT_CLOSED = 3
EXIT_SIGTERM = 143


@dataclass
class LaunchSettings:
    run_id: str
    endpoints: str  # etcd endpoints, comma-separated
    key_prefix: str
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    local_addr: str
    max_restarts: int = 1000
    monitor_interval: float = 0.1
    warm_timeout_s: float = 300.0  # how long warm workers may take to start before plain ones are used
    warm_refill_delay_s: float = 3.0  # a replacement warm worker waits this long before its imports
    rdzv_conf: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "LaunchSettings":
        return cls(**json.loads(text))


def _register_etcd3() -> None:
    # The `torchrun.handlers` entry point registers it when elasticyolo is installed; registering
    # here too makes a source checkout work the same.
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    from elasticyolo.engines.torch.rdzv_plugin import create_handler

    if "etcd3" not in getattr(registry, "_registry", {}):
        try:
            registry.register("etcd3", create_handler())
        except ValueError:
            pass  # already registered


def start_warm_pool(settings: LaunchSettings, env: worker_env.WorkerEnv) -> PrewarmPool | None:
    """One warm worker per slot, started first thing, on the main thread before any other:
    this process imports what a worker needs (torch, which torch elastic needs here too) and
    forks the pool's zygote from itself (`Zygote.fork_here`), so the node imports torch once.
    A spawned zygote would import everything again beside this process (measured on a node
    joining a chaos replay on 2 cores: the two imports side by side took 10.4 s of its 17.5 s
    from start to first step). Where forking fails, the pool spawns its zygote (or plain
    processes)."""
    if not prewarm_enabled() or not env.spec_json or not env.worker_dir:
        return None
    from elasticyolo.engines import registry
    from elasticyolo.spec import TrainSpec

    worker_modules = registry.get(TrainSpec.from_json(env.spec_json, "ELASTICYOLO_SPEC").engine).worker_modules
    zygote = None
    if zygote_enabled():
        try:
            zygote = Zygote.fork_here(preload_modules(worker_modules), node=env.node_id, job=env.job)
        except Exception as exc:  # noqa: BLE001 - a warm pool is an optimization; the pool falls back
            log.warning("could not fork a zygote from the launcher; the pool spawns one", error=str(exc))
    pool = PrewarmPool(env.spec_json, settings.nproc_per_node, Path(env.worker_dir), zygote=zygote,
                       worker_modules=worker_modules, node=env.node_id, job=env.job)
    pool.fill()
    return pool


def warm_starts(pool: PrewarmPool | None, settings: LaunchSettings) -> "WarmStarts | None":
    """The pool, once ready, hands every round's workers: ready before this node joins the
    rendezvous, a joining node costs the running world no process start, nor does any later round."""
    if pool is None:
        return None
    from elasticyolo.engines.torch.warm import WarmStarts

    if not pool.wait_ready(settings.warm_timeout_s):
        # A bad spec or missing data: plain starts make the failure reach the job state.
        log.warning("warm workers did not start; starting plain workers", timeout_s=settings.warm_timeout_s)
        pool.close()
        return None
    starts = WarmStarts(pool, settings.warm_refill_delay_s)
    starts.install()
    return starts


def run(settings: LaunchSettings, pool: PrewarmPool | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from elasticyolo.engines.torch import launcher_signal, stop_overlap

    launcher_signal.install()  # SIGTERM raises SignalException (torch's way), and is never lost
    _register_etcd3()
    stop_overlap.install()  # a round's old workers stop while the next round forms
    env = worker_env.read()
    conf = {"join_timeout": 600, "last_call_timeout": 5, "keep_alive_interval": 5, "keep_alive_max_attempt": 3,
            "key_prefix": settings.key_prefix, **settings.rdzv_conf}
    if env.job and env.node_id:  # rounds follow the cluster's membership (membership.py)
        conf.update(node_id=env.node_id, job=env.job)
    config = LaunchConfig(
        min_nodes=settings.min_nodes, max_nodes=settings.max_nodes, nproc_per_node=settings.nproc_per_node,
        run_id=settings.run_id, rdzv_backend="etcd3", rdzv_endpoint=settings.endpoints, rdzv_configs=conf,
        max_restarts=settings.max_restarts, monitor_interval=settings.monitor_interval,
        local_addr=settings.local_addr, start_method="spawn",
    )
    cmd = worker_command()  # `elasticyolo worker`: the spec (from the environment) says engine=torch
    try:
        warm_starts(pool, settings)  # installs itself in torch's agent: it hands the rounds' workers
        elastic_launch(config, cmd[0])(*cmd[1:])
    except SignalException:
        return EXIT_SIGTERM
    except RendezvousClosedError:
        return EXIT_CLOSED
    except ChildFailedError as exc:
        print(f"elasticyolo torch launcher: workers failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if pool is not None:
            pool.close()
    return 0


def main() -> None:
    die_with_agent()  # first, before torch loads
    import setproctitle  # noqa: F401  (finds argv's memory while the environment is the original: zygote.py)

    from elasticyolo import log

    log.configure()
    env = worker_env.read()
    if not env.engine_config:
        print("elasticyolo torch launcher: no launch settings in the environment (started by an agent?)",
              file=sys.stderr)
        sys.exit(2)
    settings = LaunchSettings.from_json(env.engine_config)
    # Workers (started by torch from this process) must die with this process, not the agent.
    os.environ.update(replace(env, parent_pid=os.getpid()).to_env())
    sys.exit(run(settings, start_warm_pool(settings, env)))


if __name__ == "__main__":
    main()
