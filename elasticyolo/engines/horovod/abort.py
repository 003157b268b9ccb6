"""Abort a worker's in-flight Gloo collective, so nobody waits out Gloo's timeout on a dead peer.

Horovod 0.28 has no abort: a rank blocked in a receive from a peer that stopped participating
waits `HOROVOD_GLOO_TIMEOUT_SECONDS` (measured: SIGKILL of 1 of 3 nodes, the rank next to the dead
one failed at once, but another rank then waited 5 s on a survivor that had left the collective
and kept its sockets open while its own reset blocked in the rendezvous). A `shutdown()` of a
process's Gloo connections makes every peer blocked on it fail at once instead ("connection
closed by peer"); each of them does the same, so the whole world is in its reset within
milliseconds. Two triggers:

* a worker whose collective failed (HorovodInternalError) aborts its own connections before it
  resets (`AlwaysSyncTorchState.restore`);
* the driver, when the liveness signals lose a node of the world (cluster/liveness.py), sends
  every other worker a hosts-updated notification carrying `ABORT` (Horovod's notification
  service, already connected to every worker): a world blocked on a frozen node, which closes
  nothing, resets at the heartbeat timeout instead of Gloo's.

Which sockets: the process's established TCP connections except those to etcd, to the Horovod
rendezvous server and of the worker's notification service. Shutting down (not closing) leaves
the file descriptors to their owner (Gloo closes them when Horovod re-initialises).
"""

from __future__ import annotations

import os
import socket
from typing import Iterable

ABORT = 0x40  # a bit beyond Horovod's HostUpdateResult flags (no_update 0, removed 1, added 2)
_OPEN = ("ESTABLISHED", "CLOSE_WAIT")  # psutil.CONN_* values


def _etcd_ports() -> set[int]:
    ports = set()
    for ep in (os.environ.get("ELASTICYOLO_ETCD") or "").split(","):
        tail = ep.strip().rsplit(":", 1)[-1].rstrip("/")
        if tail.isdigit():
            ports.add(int(tail))
    return ports


def collective_connections(keep_local_ports: Iterable[int] = ()) -> list[int]:
    """File descriptors of this process's collective (Gloo) TCP connections."""
    import psutil

    keep_remote = _etcd_ports()
    rdzv = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "")
    if rdzv.isdigit():
        keep_remote.add(int(rdzv))
    keep_local = set(keep_local_ports)
    fds = []
    for c in psutil.Process().net_connections(kind="tcp"):
        # CLOSE_WAIT too: the dead peer's own connections (its FIN arrived, Gloo has not acted on
        # it). Seen: a survivor that shut only its ESTABLISHED ones still waited out Gloo's timeout.
        if c.status not in _OPEN or c.fd is None or c.fd < 0 or not c.raddr:
            continue
        if c.raddr.port in keep_remote or c.laddr.port in keep_local:
            continue
        fds.append(c.fd)
    return fds


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


def abort_collectives() -> int:
    """Shut down this process's collective connections; returns how many."""
    n = 0
    for fd in collective_connections(notification_ports()):
        try:
            dup = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)  # a dup: gloo keeps its own fd
        except OSError:
            continue
        try:
            dup.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            dup.close()
    return n
