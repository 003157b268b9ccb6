"""Horovod's part of the collective abort (`worker_runtime/collective_abort.py`).

Two triggers:
* a worker whose collective failed (HorovodInternalError) aborts its own connections before it
  resets (`AlwaysSyncTorchState.restore`);
* the driver, when the liveness signals lose a node of the world (cluster/liveness.py), sends
  every other worker a hosts-updated notification carrying `ABORT` (Horovod's notification
  service, already connected to every worker): a world blocked on a frozen node, which closes
  nothing, resets at the heartbeat timeout instead of Gloo's.

Kept open through an abort: the connections to Horovod's rendezvous server and those of the
worker's notification service.
"""

from __future__ import annotations

import os

from elasticyolo.worker_runtime.collective_abort import CollectiveAborter, abort_collectives

ABORT = 0x40  # a bit beyond Horovod's HostUpdateResult flags (no_update 0, removed 1, added 2)


def notification_ports() -> set[int]:
    """Local port(s) of Horovod's worker notification service in this process."""
    try:
        from horovod.common.elastic import notification_manager

        service = notification_manager._service
        if service is None:
            return set()
        return {port for addrs in service.addresses().values() for _, port in addrs}
    except Exception:  # noqa: BLE001 - best effort: at worst one more socket is shut down
        return set()


def horovod_kept() -> tuple[set[int], set[int]]:
    """(local, remote) ports a Horovod worker keeps through an abort."""
    rdzv = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "")
    return notification_ports(), ({int(rdzv)} if rdzv.isdigit() else set())


def horovod_aborter() -> CollectiveAborter:
    return CollectiveAborter(kept=horovod_kept)


def abort_horovod_collectives() -> int:
    return abort_collectives(kept=horovod_kept)
