"""What a job costs and how much of the paid capacity became training. Pure functions over the
records `status` reads (node records, the progress record); no I/O but the price table file.

Where a node's price comes from (first that applies; the node record says which, `price_source`):
1. `--price-per-hour` (agent flag, `price_per_hour` in agent.yaml, `ELASTICYOLO_PRICE_PER_HOUR`):
   what the node's VM costs, as the operator knows it (e.g. the spot price it was bought at).
2. The price table (`--price-table FILE`, YAML `instance_type: {spot: USD/h, on_demand: USD/h}`)
   for the node's instance type: the spot price for a preemptible node, else on-demand. The
   instance type is `--instance-type`, else what the cloud's metadata states when a spot provider
   is set (AWS IMDS `instance-type`, GCP `machine-type`, Azure `vmSize`; the record's
   `instance_type_source` says which). The metadata never states a price, only the type; the
   table is how an operator supplies the prices.
The on-demand equivalent (for savings): `--on-demand-price-per-hour`, else the table's on_demand,
else the node's own price when the node is not preemptible.

Arithmetic (what `status --json` shows under "cost" and "goodput", and the agent's /metrics):
- a node's spend = price_per_hour x (now - started_at) / 3600, started_at = when the agent
  registered the node (its lease), billed per second while registered;
- spent = sum over registered nodes, plus every departed node (preempted, killed, left) from its
  billing record (agent/billing.py): price x (last_seen - started_at), last_seen refreshed every
  10 s while it ran, so a vanished node is billed at most 10 s short; on_demand = the same with
  on-demand prices; savings = on_demand - spent;
- burn_per_hour = sum of the registered nodes' prices;
- goodput = samples/s trained (the progress record's windowed rate) / (steady samples/s per
  worker x the slots of the registered nodes); steady = the best per-worker rate rank 0 measured
  in this run (`steady_samples_s_per_worker`). Idle, joining, draining and re-syncing capacity
  all lower it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from elasticyolo.errors import UserError
from elasticyolo.yamlfile import read_yaml_mapping


@dataclass(frozen=True)
class NodePrice:
    per_hour: float | None
    on_demand_per_hour: float | None
    source: str  # "flag", "table:<file>", or "none"


def load_price_table(path: str | Path) -> dict[str, dict[str, float]]:
    """`instance_type: {spot: USD/h, on_demand: USD/h}` (either key may be missing). One-line errors."""
    p = Path(path)
    raw = read_yaml_mapping(p, f"price table {p}", "a mapping of instance_type: {spot: USD, on_demand: USD}")
    table: dict[str, dict[str, float]] = {}
    for itype, prices in raw.items():
        if not isinstance(prices, dict) or not set(prices) <= {"spot", "on_demand"}:
            raise UserError(f"price table {p}: {itype}: expected {{spot: USD, on_demand: USD}}")
        try:
            table[str(itype)] = {k: float(v) for k, v in prices.items() if v is not None}
        except (TypeError, ValueError):
            raise UserError(f"price table {p}: {itype}: prices must be numbers (USD per hour)") from None
        if any(v < 0 for v in table[str(itype)].values()):
            raise UserError(f"price table {p}: {itype}: negative price")
    return table


def resolve_price(*, price_per_hour: float | None, on_demand_per_hour: float | None, instance_type: str | None,
                  preemptible: bool, table: Mapping[str, Mapping[str, float]] | None = None,
                  table_name: str = "table") -> NodePrice:
    row = (table or {}).get(instance_type or "", {})
    if price_per_hour is not None:
        price, source = price_per_hour, "flag"
    elif row.get("spot" if preemptible else "on_demand") is not None:
        price, source = row["spot" if preemptible else "on_demand"], f"table:{table_name}"
    else:
        price, source = None, "none"
    on_demand = on_demand_per_hour if on_demand_per_hour is not None else row.get("on_demand")
    if on_demand is None and not preemptible:
        on_demand = price
    return NodePrice(price, on_demand, source)


def node_spend(price_per_hour: float | None, started_at: float | None, now: float) -> float | None:
    if price_per_hour is None or not started_at:
        return None
    return price_per_hour * max(0.0, now - started_at) / 3600.0


def _run_id(node_id: Any, started_at: Any) -> tuple[str, int]:
    """One agent run: its node and start (ms, as the billing key has it)."""
    return str(node_id), int(float(started_at or 0) * 1000)


def job_cost(nodes: Sequence[Mapping[str, Any]], now: float,
             billing: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """Cost so far (see the module doc): registered nodes up to `now`, departed ones (billing
    records of runs no longer registered) up to their `last_seen`. Registered nodes without a
    price are counted in `unpriced_nodes` and left out of the sums."""
    spent = on_demand = burn = 0.0
    priced = unpriced = departed = 0
    od_complete = True
    registered = {_run_id(n.get("id", n.get("node_id")), n.get("started_at")) for n in nodes}
    bills = [(n, now, True) for n in nodes] + [
        (b, float(b.get("last_seen") or 0), False) for b in billing
        if _run_id(b.get("node_id"), b.get("started_at")) not in registered]
    for n, until, live in bills:
        s = node_spend(n.get("price_per_hour"), n.get("started_at"), until)
        if s is None:
            if live:  # a billing record exists only for a priced node
                unpriced += 1
            continue
        if live:
            priced += 1
            burn += float(n["price_per_hour"])
        else:
            departed += 1
        spent += s
        od = node_spend(n.get("on_demand_per_hour"), n.get("started_at"), until)
        if od is None:
            od_complete = False
        else:
            on_demand += od
    if not priced and not departed:
        return {"spent_usd": None, "on_demand_usd": None, "savings_usd": None, "burn_usd_per_hour": None,
                "priced_nodes": 0, "departed_nodes": 0, "unpriced_nodes": unpriced}
    return {
        "spent_usd": round(spent, 6),
        "on_demand_usd": round(on_demand, 6) if od_complete else None,
        "savings_usd": round(on_demand - spent, 6) if od_complete else None,
        "burn_usd_per_hour": round(burn, 6),
        "priced_nodes": priced, "departed_nodes": departed, "unpriced_nodes": unpriced,
    }


def goodput(samples_s: float | None, steady_per_worker: float | None, paid_slots: int) -> float | None:
    """Trained samples/s over what the paid slots give at steady state (0..1, None: not known yet)."""
    if samples_s is None or not steady_per_worker or paid_slots <= 0:
        return None
    return round(float(samples_s) / (float(steady_per_worker) * paid_slots), 6)


def usd_per_epoch(spent: float | None, epochs_done: float | None) -> float | None:
    if spent is None or not epochs_done:
        return None
    return round(spent / epochs_done, 6)


def summary_line(job: str, cost: Mapping[str, Any], epochs_done: float | None) -> str:
    """The one-line cost summary logged at job end."""
    if cost.get("spent_usd") is None:
        return f"job {job}: no node had a price (--price-per-hour or --price-table); cost unknown"
    parts = [f"job {job}: spent ${cost['spent_usd']:.2f}"]
    if cost.get("on_demand_usd") is not None:
        parts.append(f"on-demand ${cost['on_demand_usd']:.2f}, saved ${cost['savings_usd']:.2f}")
    per_epoch = usd_per_epoch(cost["spent_usd"], epochs_done)
    if per_epoch is not None:
        parts.append(f"${per_epoch:.4f}/epoch over {epochs_done:g} epochs")
    if cost.get("unpriced_nodes"):
        parts.append(f"{cost['unpriced_nodes']} node(s) without a price not counted")
    return ", ".join(parts)
