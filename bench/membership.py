"""Membership benchmark: a join storm of simulated nodes, `status` render time, `status` startup.

    .venv/bin/python bench/membership.py [--nodes 1000] [--threads 32] [--repeat 7]

Starts its own etcd on 127.0.0.1. Each simulated node does what an agent's registration does:
grant a lease, create-only txn of its node record under that lease (2 etcd round trips). A
thread pool of `--threads` clients plays the nodes; one keepalive thread renews every lease
while the figures are taken. Prints one line per figure and a JSON summary at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.registry import NodeRecord
from elasticyolo.local_cluster.servers import EtcdCluster
from elasticyolo.status import collect, render_table

ELASTICYOLO = str(Path(sys.executable).with_name("elasticyolo"))


def join_storm(endpoints: str, keys: JobKeys, n: int, threads: int, ttl: int) -> tuple[float, list[int]]:
    local = threading.local()

    def client() -> EtcdClient:
        if not hasattr(local, "c"):
            local.c = EtcdClient(endpoints)
        return local.c  # type: ignore[no-any-return]

    def join(i: int) -> int:
        c = client()
        rec = NodeRecord(node_id=f"sim-{i:05d}", host=f"sim-{i}", addr=f"10.0.{i // 250}.{i % 250}", slots=1,
                         state="IDLE", preemptible=i % 10 != 0, price_per_hour=0.4, started_at=time.time())
        lease = c.lease_grant(ttl)
        ok, _ = c.compare_and_swap(keys.node(rec.node_id), rec.to_json(), 0, lease=lease)
        assert ok
        return lease

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        leases = list(pool.map(join, range(n)))
    return time.perf_counter() - t0, leases


def keepalive(endpoints: str, leases: list[int], ttl: int, stop: threading.Event) -> None:
    c = EtcdClient(endpoints)
    while not stop.wait(ttl / 3):
        for lid in leases:
            if stop.is_set():
                return
            c.lease_refresh(lid)


def timed(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--ttl", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    out: dict[str, float | int] = {"nodes": args.nodes, "threads": args.threads, "cpus": os.cpu_count() or 0}
    with EtcdCluster(size=1) as etcd:
        ep = etcd.endpoints
        big, small = JobKeys("bench-big"), JobKeys("bench-small")
        secs, leases = join_storm(ep, big, args.nodes, args.threads, args.ttl)
        out["join_storm_s"] = round(secs, 3)
        out["joins_per_s"] = round(args.nodes / secs, 1)
        print(f"join storm: {args.nodes} nodes registered in {secs:.2f}s ({args.nodes / secs:.0f}/s, "
              f"{args.threads} threads, 2 round trips each)")
        _, small_leases = join_storm(ep, small, 3, 3, args.ttl)
        stop = threading.Event()
        ka = threading.Thread(target=keepalive, args=(ep, leases + small_leases, args.ttl, stop), daemon=True)
        ka.start()

        c = EtcdClient(ep)
        for label, ttls in (("with lease TTLs", True), ("without lease TTLs", False)):
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                view = collect(c, big, lease_ttls=ttls)
                text = render_table(view)
                times.append(time.perf_counter() - t0)
            assert len(view["nodes"]) == args.nodes and text.count("\n") >= args.nodes
            key = "status_render_%d_nodes_s" % args.nodes + ("" if ttls else "_no_ttl")
            out[key] = round(statistics.median(times), 4)
            print(f"status collect+render, {args.nodes} nodes, {label}: {statistics.median(times) * 1000:.0f} ms (median)")

        for mode in ("auto", "always"):
            cli_big = timed([ELASTICYOLO, "status", "--etcd", ep, "--job", big.job, "--json", "--lease-ttl", mode],
                            max(3, args.repeat // 2))
            out[f"status_cli_{args.nodes}_nodes_lease_ttl_{mode}_s"] = round(cli_big, 3)
            print(f"`elasticyolo status --json --lease-ttl {mode}`, {args.nodes} nodes: {cli_big * 1000:.0f} ms")

        py = timed([sys.executable, "-c", "pass"], args.repeat)
        st = timed([ELASTICYOLO, "status", "--etcd", ep, "--job", small.job], args.repeat)
        imp = timed([sys.executable, "-c", "import elasticyolo.cli, elasticyolo.commands.status, elasticyolo.status"],
                    args.repeat)
        out.update(python_pass_s=round(py, 4), status_3_nodes_s=round(st, 4), status_import_s=round(imp, 4),
                   status_vs_python_ratio=round(st / py, 1))
        print(f"`python -c pass`: {py * 1000:.0f} ms; `elasticyolo status` (3 nodes): {st * 1000:.0f} ms "
              f"-> ratio {st / py:.1f}x; imports alone: {imp * 1000:.0f} ms")
        stop.set()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
