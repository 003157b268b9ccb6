"""Cost and goodput: where prices come from, the arithmetic, and the live figures in
`status --json`, the status table and the agent's /metrics, with real agents on a real etcd."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from elasticyolo import cost
from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.errors import UserError
from elasticyolo.local_cluster.agents import ELASTICYOLO, AgentProcess, nodes_in_etcd
from elasticyolo.local_cluster.metadata_server import MetadataServer
from elasticyolo.local_cluster.servers import EtcdCluster, free_port
from elasticyolo.local_cluster.wait import wait_for


def test_price_sources(tmp_path: Path) -> None:
    table = tmp_path / "prices.yaml"
    table.write_text("g5.xlarge: {spot: 0.4, on_demand: 1.006}\np4d.24xlarge: {on_demand: 32.77}\n")
    t = cost.load_price_table(table)
    flag = cost.resolve_price(price_per_hour=0.5, on_demand_per_hour=None, instance_type="g5.xlarge",
                              preemptible=True, table=t, table_name="prices.yaml")
    assert flag == cost.NodePrice(0.5, 1.006, "flag")  # the flag wins; on-demand from the table
    spot = cost.resolve_price(price_per_hour=None, on_demand_per_hour=None, instance_type="g5.xlarge",
                              preemptible=True, table=t, table_name="prices.yaml")
    assert spot == cost.NodePrice(0.4, 1.006, "table:prices.yaml")
    od = cost.resolve_price(price_per_hour=None, on_demand_per_hour=None, instance_type="p4d.24xlarge",
                            preemptible=False, table=t, table_name="prices.yaml")
    assert od == cost.NodePrice(32.77, 32.77, "table:prices.yaml")
    assert cost.resolve_price(price_per_hour=None, on_demand_per_hour=None, instance_type="x", preemptible=True,
                              table=t) == cost.NodePrice(None, None, "none")
    table.write_text("g5.xlarge: {spot: cheap}\n")
    with pytest.raises(UserError, match="g5.xlarge: prices must be numbers"):
        cost.load_price_table(table)
    with pytest.raises(UserError, match="file not found"):
        cost.load_price_table(tmp_path / "nope.yaml")


def test_cost_arithmetic() -> None:
    now = 10_000.0
    nodes = [{"price_per_hour": 0.36, "on_demand_per_hour": 1.2, "started_at": now - 3600, "slots": 1},
             {"price_per_hour": 0.72, "on_demand_per_hour": 2.4, "started_at": now - 1800, "slots": 2},
             {"price_per_hour": None, "started_at": now - 60, "slots": 1}]
    c = cost.job_cost(nodes, now)
    assert c == {"spent_usd": 0.72, "on_demand_usd": 2.4, "savings_usd": 1.68, "burn_usd_per_hour": 1.08,
                 "priced_nodes": 2, "departed_nodes": 0, "unpriced_nodes": 1}
    # Departed nodes stay billed from their billing records, up to when they were last seen; a
    # registered node's own record (same node and start) is not counted twice.
    billing = [{"node_id": "gone", "started_at": now - 7200, "last_seen": now - 3600, "price_per_hour": 0.5,
                "on_demand_per_hour": 1.5},
               {"node_id": "a", "started_at": now - 3600, "last_seen": now - 10, "price_per_hour": 0.36,
                "on_demand_per_hour": 1.2}]
    nodes[0]["id"] = "a"
    with_departed = cost.job_cost(nodes, now, billing)
    assert with_departed == {"spent_usd": 1.22, "on_demand_usd": 3.9, "savings_usd": 2.68, "burn_usd_per_hour": 1.08,
                             "priced_nodes": 2, "departed_nodes": 1, "unpriced_nodes": 1}
    assert cost.job_cost([], now, billing[:1])["spent_usd"] == 0.5  # every node gone: still billed
    assert cost.goodput(90.0, 40.0, 3) == 0.75 and cost.goodput(None, 40.0, 3) is None
    assert cost.usd_per_epoch(0.72, 2.5) == 0.288
    line = cost.summary_line("j", c, 2.5)
    assert line.startswith("job j: spent $0.72, on-demand $2.40, saved $1.68, $0.2880/epoch over 2.5 epochs")


def test_live_cost_and_goodput_in_status_and_metrics(etcd_server: EtcdCluster, job_name: str, tmp_path: Path,
                                                      agents: list[AgentProcess]) -> None:
    ep = etcd_server.endpoints
    e = EtcdClient(ep)
    keys = JobKeys(job_name)
    table = tmp_path / "prices.yaml"
    table.write_text("g5.xlarge: {spot: 0.4, on_demand: 1.006}\n")
    port = free_port()
    agents.append(AgentProcess(ep, job_name, "p1", log_dir=tmp_path, extra=[
        "--price-per-hour", "0.36", "--on-demand-price-per-hour", "1.2", "--metrics-port", str(port)]).start())
    agents.append(AgentProcess(ep, job_name, "p2", log_dir=tmp_path, extra=[
        "--instance-type", "g5.xlarge", "--price-table", str(table)]).start())
    recs = wait_for(lambda: (lambda n: n if {"p1", "p2"} <= set(n) else None)(nodes_in_etcd(e, job_name)), 20,
                    "both agents registered")
    assert (recs["p1"]["price_source"], recs["p2"]["price_source"]) == ("flag", "table:prices.yaml")
    assert (recs["p2"]["price_per_hour"], recs["p2"]["on_demand_per_hour"]) == (0.4, 1.006)
    # What rank 0's progress sink and the checkpointer publish while a job trains.
    e.put(keys.progress, json.dumps({"epoch": 1, "consumed": 32, "num_samples": 64, "step": 12, "world_size": 2,
                                     "samples_s": 30.0, "steady_samples_s_per_worker": 20.0, "at": time.time()}))
    e.put(keys.checkpoint_latest, json.dumps({"uri": "file:///x/step-10", "epoch": 1, "step": 10, "size": 6_400_000,
                                              "upload_s": 0.4, "snapshot_s": 0.01, "at": time.time() - 5}))

    r = subprocess.run([ELASTICYOLO, "status", "--etcd", ep, "--job", job_name, "--json"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    nodes = {n["id"]: n for n in view["nodes"]}
    now = view["at"]
    # Each node is billed from its registration (the agent's started_at) to the moment of the read.
    hours = {i: (now - recs[i]["started_at"]) / 3600 for i in ("p1", "p2")}
    assert nodes["p1"]["spent_usd"] == pytest.approx(0.36 * hours["p1"], abs=1e-6)
    assert nodes["p2"]["spent_usd"] == pytest.approx(0.4 * hours["p2"], abs=1e-6)
    c = view["cost"]
    assert c["spent_usd"] == pytest.approx(0.36 * hours["p1"] + 0.4 * hours["p2"], abs=1e-6)
    assert c["on_demand_usd"] == pytest.approx(1.2 * hours["p1"] + 1.006 * hours["p2"], abs=1e-6)
    assert c["savings_usd"] == pytest.approx(c["on_demand_usd"] - c["spent_usd"], abs=2e-6)
    assert c["burn_usd_per_hour"] == pytest.approx(0.76)
    assert view["epochs_done"] == 1.5 and c["usd_per_epoch"] == pytest.approx(c["spent_usd"] / 1.5, abs=1e-6)
    assert view["goodput"] == {"ratio": 0.75, "samples_s": 30.0, "steady_samples_s_per_worker": 20.0,
                               "paid_slots": 2}

    table_out = subprocess.run([ELASTICYOLO, "status", "--etcd", ep, "--job", job_name], capture_output=True,
                               text=True, timeout=30).stdout
    cost_line = next(line for line in table_out.splitlines() if line.startswith("COST "))
    assert "BURN $0.760/h" in cost_line and "GOODPUT 75%" in cost_line, table_out
    header = next(line for line in table_out.splitlines() if line.startswith("NODE"))
    assert header.split()[-3:] == ["$/H", "SPENT", "PREEMPTIBLE"]

    # The agent's /metrics serves the same figures and the workers' checkpoint record.
    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("elasticyolo_job_") or line.startswith("elasticyolo_checkpoint_")}

    m = wait_for(scrape, 10, "metrics endpoint")
    assert m["elasticyolo_job_view_up"] == 1 and m["elasticyolo_job_goodput_ratio"] == 0.75
    assert m["elasticyolo_job_spent_usd"] >= c["spent_usd"] and m["elasticyolo_job_burn_usd_per_hour"] == 0.76
    assert m["elasticyolo_checkpoint_last_step"] == 10 and m["elasticyolo_checkpoint_last_size_bytes"] == 6.4e6
    assert m["elasticyolo_checkpoint_last_upload_seconds"] == 0.4 and m["elasticyolo_checkpoint_last_age_seconds"] >= 5

    # The job's end: the leader logs one cost line and records it in the event log (status shows it).
    e.put(keys.state, json.dumps({"state": "done", "at": time.time()}))

    def cost_event() -> dict | None:
        for _k, value, _r in e.get_prefix(keys.events):
            ev = json.loads(value)
            if ev.get("kind") == "cost":
                return ev
        return None

    ev = wait_for(cost_event, 15, "the leader's cost summary")
    assert ev["summary"].startswith(f"job {job_name}: spent $") and "on-demand $" in ev["summary"]
    assert ev["spent_usd"] >= c["spent_usd"] and "/epoch over 1.5 epochs" in ev["summary"]
    leader = next(a for a in agents if a.node_id == ev["node"])
    assert any(r.get("event") == "job cost" and r.get("summary") == ev["summary"] for r in leader.log_records())
    out = subprocess.run([ELASTICYOLO, "status", "--etcd", ep, "--job", job_name], capture_output=True, text=True,
                         timeout=30).stdout
    assert f"job ended: {ev['summary']}" in out, out


def test_departed_node_stays_billed_and_type_from_metadata(etcd_server: EtcdCluster, job_name: str, tmp_path: Path,
                                                           agents: list[AgentProcess]) -> None:
    """A preempted node's spend does not vanish with its lease; a node with no --instance-type is
    priced by the type the cloud's metadata states (AWS IMDSv2 here, on loopback)."""
    ep = etcd_server.endpoints
    e = EtcdClient(ep)
    table = tmp_path / "prices.yaml"
    table.write_text("p3.2xlarge: {spot: 0.918, on_demand: 3.06}\n")
    with MetadataServer() as imds:
        agents.append(AgentProcess(ep, job_name, "stay", log_dir=tmp_path, extra=["--price-per-hour", "0.36"]).start())
        agents.append(AgentProcess(ep, job_name, "spot", log_dir=tmp_path, extra=[
            "--price-table", str(table), "--spot-provider", "aws", "--metadata-url", imds.url]).start())
        recs = wait_for(lambda: (lambda n: n if {"stay", "spot"} <= set(n) else None)(nodes_in_etcd(e, job_name)),
                        20, "both agents registered")
        spot = recs["spot"]
        assert (spot["instance_type"], spot["instance_type_source"]) == ("p3.2xlarge", "metadata:aws")
        assert (spot["price_per_hour"], spot["on_demand_per_hour"], spot["price_source"]) == \
            (0.918, 3.06, "table:prices.yaml")
        billing_key = JobKeys(job_name).billing_entry("spot", spot["started_at"])
        wait_for(lambda: e.get(billing_key), 20, "the spot node's billing record")
        agents[1].kill()  # preempted: no clean exit
        wait_for(lambda: "spot" not in nodes_in_etcd(e, job_name), 30, "the killed node's lease expired")

    r = subprocess.run([ELASTICYOLO, "status", "--etcd", ep, "--job", job_name, "--json"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    bill = json.loads(e.get(billing_key)[0])
    assert bill["ended"] is False and bill["last_seen"] > spot["started_at"]
    stay = {n["id"]: n for n in view["nodes"]}["stay"]
    departed = 0.918 * (bill["last_seen"] - spot["started_at"]) / 3600
    c = view["cost"]
    assert (c["priced_nodes"], c["departed_nodes"]) == (1, 1)
    assert c["spent_usd"] == pytest.approx(stay["spent_usd"] + departed, abs=2e-6)
    assert c["burn_usd_per_hour"] == pytest.approx(0.36)  # only the live node burns
    text = subprocess.run([ELASTICYOLO, "status", "--etcd", ep, "--job", job_name], capture_output=True,
                          text=True, timeout=30).stdout
    assert "(incl. 1 departed)" in text, text
