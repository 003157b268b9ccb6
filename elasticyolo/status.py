"""`elasticyolo status`: one consistent read of a job's keys, shown as a kubectl-like table or JSON.

Fast by construction: no torch, no pydantic, no structlog; one etcd txn reads every key of the
job at a single revision, then the lease TTLs of the nodes are fetched in parallel.
Renders whatever progress/checkpoint records are there (workers write them; see keys.py).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from elasticyolo import cost
from elasticyolo.cluster.etcd import EtcdClient, b64, prefix_range_end
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.engines.installed import RECORD_FIELD as REFUSED_FIELD
from elasticyolo.worker_runtime.worker_errors import current_errors

_SINGLE_KEYS = ("leader", "spec", "state", "world", "progress", "checkpoint_latest")
# Drain-related events shown by status (the newest EVENTS_SHOWN of the job's event log).
EVENT_KINDS = ("notice", "drain_start", "drain_end", "cost")
EVENTS_SCANNED, EVENTS_SHOWN = 50, 8


def _json(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return {"_invalid": raw[:200].decode("utf-8", "replace")}


# Lease TTLs cost one request per node (etcd has no batch TTL read); beyond this many nodes
# `status` skips them unless asked (`--lease-ttl always`), keeping it fast on big clusters.
AUTO_LEASE_TTL_MAX_NODES = 100


def collect(client: EtcdClient, keys: JobKeys, lease_ttls: bool | None = None) -> dict[str, Any]:
    """The status of one job as a plain dict (this is what `status --json` prints).
    lease_ttls: True/False, or None for "only up to AUTO_LEASE_TTL_MAX_NODES nodes"."""
    single = [getattr(keys, name) for name in _SINGLE_KEYS]
    ranges = [{"request_range": {"key": b64(k)}} for k in single]
    ranges.append({"request_range": {"key": b64(keys.nodes), "range_end": b64(prefix_range_end(keys.nodes))}})
    ranges.append({"request_range": {"key": b64(keys.events), "range_end": b64(prefix_range_end(keys.events)),
                                     "limit": EVENTS_SCANNED, "sort_order": "DESCEND", "sort_target": "KEY"}})
    ranges.append({"request_range": {"key": b64(keys.resume)}})
    ranges.append({"request_range": {"key": b64(keys.billing), "range_end": b64(prefix_range_end(keys.billing))}})
    ranges.append({"request_range": {"key": b64(keys.suspects), "range_end": b64(prefix_range_end(keys.suspects)),
                                     "keys_only": True}})
    ranges.append({"request_range": {"key": b64(keys.errors), "range_end": b64(prefix_range_end(keys.errors))}})
    result = client.txn([], ranges, [])
    responses = result.get("responses") or []
    values: dict[str, tuple[Any, int] | None] = {}
    for name, resp in zip(_SINGLE_KEYS, responses):
        kvs = resp.get("response_range", {}).get("kvs") or []
        values[name] = (_json(_unb64(kvs[0].get("value"))), int(kvs[0]["mod_revision"])) if kvs else None
    node_kvs = (responses[len(_SINGLE_KEYS)].get("response_range", {}).get("kvs") or []) if len(responses) > len(_SINGLE_KEYS) else []

    events: list[dict[str, Any]] = []
    for kv in (responses[len(_SINGLE_KEYS) + 1].get("response_range", {}).get("kvs") or []
               if len(responses) > len(_SINGLE_KEYS) + 1 else []):
        ev = _json(_unb64(kv.get("value")))
        if isinstance(ev, dict) and ev.get("kind") in EVENT_KINDS and len(events) < EVENTS_SHOWN:
            events.append(ev)
    events.reverse()
    resume_kvs = (responses[len(_SINGLE_KEYS) + 2].get("response_range", {}).get("kvs") or []
                  if len(responses) > len(_SINGLE_KEYS) + 2 else [])
    last_resume = _json(_unb64(resume_kvs[0].get("value"))) if resume_kvs else None
    billing = [b for kv in (responses[len(_SINGLE_KEYS) + 3].get("response_range", {}).get("kvs") or []
                            if len(responses) > len(_SINGLE_KEYS) + 3 else [])
               if isinstance(b := _json(_unb64(kv.get("value"))), dict)]
    suspects = {_unb64(kv["key"]).decode()[len(keys.suspects):]
                for kv in (responses[len(_SINGLE_KEYS) + 4].get("response_range", {}).get("kvs") or []
                           if len(responses) > len(_SINGLE_KEYS) + 4 else [])}

    error_recs = [_json(_unb64(kv.get("value"))) for kv in
                  (responses[len(_SINGLE_KEYS) + 5].get("response_range", {}).get("kvs") or []
                   if len(responses) > len(_SINGLE_KEYS) + 5 else [])]

    leader_v = values["leader"]
    leader_id = leader_v[0].get("node_id") if leader_v and isinstance(leader_v[0], dict) else None
    leader_term = leader_v[1] if leader_v else None
    world = _dict(values["world"])
    progress = _dict(values["progress"])
    checkpoint = _dict(values["checkpoint_latest"])
    spec = values["spec"][0] if values["spec"] else None
    generation = values["spec"][1] if values["spec"] else None  # the submission (spec mod revision)
    state_rec = _dict(values["state"])
    job_state = state_rec.get("state") if state_rec else ("submitted" if spec is not None else "none")

    now = time.time()
    world_ranks: dict[str, list[int]] = world.get("ranks") or {} if isinstance(world.get("ranks"), dict) else {}
    nodes: list[dict[str, Any]] = []
    leases: list[int] = []
    for kv in node_kvs:
        rec = _dict((_json(_unb64(kv.get("value"))), 0))
        node_id = str(rec.get("node_id") or _unb64(kv["key"]).decode()[len(keys.nodes):])
        lease = int(kv.get("lease", 0) or 0)
        leases.append(lease)
        started = rec.get("started_at") or 0
        nodes.append({
            "id": node_id,
            "state": rec.get("state", "?"),
            "suspect": node_id in suspects,  # no heartbeat to the leader within the timeout
            "slots": rec.get("slots"),
            "ranks": world_ranks.get(node_id, rec.get("ranks") or []),
            "leader": node_id == leader_id,
            "preemptible": rec.get("preemptible"),
            "lease_ttl_s": None,
            "age_s": round(now - started, 1) if started else None,
            "notice": rec.get("notice"),
            "price_per_hour": rec.get("price_per_hour"),
            "on_demand_per_hour": rec.get("on_demand_per_hour"),
            "price_source": rec.get("price_source"),
            "started_at": started or None,
            "spent_usd": _round(cost.node_spend(rec.get("price_per_hour"), started, now)),
            "host": rec.get("host"),
            "addr": rec.get("addr"),
            "instance_type": rec.get("instance_type"),
            "zone": rec.get("zone"),
            "agent_version": rec.get("agent_version"),
            "data": rec.get("data"),  # s3:// dataset staging (agent/staging.py)
            "refused": rec.get(REFUSED_FIELD),  # why it does not run the job's engine (engines/installed.py)
        })
    if lease_ttls is None:
        lease_ttls = len(leases) <= AUTO_LEASE_TTL_MAX_NODES
    if lease_ttls and leases:
        ttls = _lease_ttls(client, leases)
        for node, lease in zip(nodes, leases):
            node["lease_ttl_s"] = ttls.get(lease)

    world_size = world.get("world_size", progress.get("world_size"))
    job_cost = cost.job_cost(nodes, now, billing)
    steady = progress.get("steady_samples_s_per_worker")
    paid_slots = sum(int(n["slots"] or 0) for n in nodes if n["price_per_hour"] is not None) or \
        sum(int(n["slots"] or 0) for n in nodes)
    epochs_done = _epochs_done(progress)
    job_cost["usd_per_epoch"] = cost.usd_per_epoch(job_cost["spent_usd"], epochs_done)
    return {
        "job": keys.job,
        "state": job_state,
        "reason": state_rec.get("reason"),  # why the job failed or was cancelled
        "generation": generation,
        # Each node's latest worker error in this submission (worker_runtime/worker_errors.py).
        "worker_errors": [{k: e.get(k) for k in ("node", "slot", "code", "reason", "at")}
                          for e in current_errors(error_recs, generation)],
        "world_size": world_size,
        "leader": leader_id,
        "leader_term": leader_term,
        "epoch": progress.get("epoch", world.get("epoch")),
        "step": progress.get("step", world.get("step")),
        "samples_s": progress.get("samples_s"),
        "progress_at": progress.get("at"),
        "epochs_done": epochs_done,
        "cost": job_cost,
        "goodput": {"ratio": cost.goodput(progress.get("samples_s"), steady, paid_slots),
                    "samples_s": progress.get("samples_s"), "steady_samples_s_per_worker": steady,
                    "paid_slots": paid_slots},
        "at": now,
        "last_checkpoint": checkpoint or world.get("last_checkpoint"),
        "spec": spec,
        "revision": int(result["header"]["revision"]),
        "nodes": nodes,
        "events": events,
        "last_resume": last_resume,
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def _epochs_done(progress: dict[str, Any]) -> float | None:
    """Epochs trained, with the current one's fraction (from the progress record)."""
    epoch, consumed, n = progress.get("epoch"), progress.get("consumed"), progress.get("num_samples")
    if not isinstance(epoch, (int, float)):
        return None
    frac = consumed / n if isinstance(consumed, (int, float)) and isinstance(n, (int, float)) and n else 0.0
    return round(epoch + frac, 6)


def _dict(v: tuple[Any, int] | None) -> dict[str, Any]:
    return v[0] if v and isinstance(v[0], dict) else {}


def _unb64(s: str | None) -> bytes:
    import base64

    return base64.b64decode(s) if s else b""


def _lease_ttls(client: EtcdClient, leases: list[int]) -> dict[int, int]:
    unique = sorted({lid for lid in leases if lid})
    if not unique:
        return {}

    def one(lid: int) -> tuple[int, int]:
        try:
            return lid, client.lease_ttl(lid)
        except Exception:  # noqa: BLE001 - a TTL we cannot read is shown as unknown
            return lid, -1

    if len(unique) <= 2:
        return dict(one(lid) for lid in unique)
    with ThreadPoolExecutor(max_workers=min(8, len(unique))) as pool:
        return dict(pool.map(one, unique))


# ---- rendering ------------------------------------------------------------------------------
def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(max(0, seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _fmt(v: Any) -> str:
    if v is None or v == "" or v == []:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, list):
        return ",".join(str(x) for x in v)
    return str(v)


def _checkpoint_text(ck: Any) -> str:
    if not ck:
        return "-"
    if not isinstance(ck, dict):
        return str(ck)
    parts = [str(ck.get("uri") or ck.get("path") or "?")]
    if ck.get("epoch") is not None or ck.get("step") is not None:
        parts.append(f"(epoch {_fmt(ck.get('epoch'))}, step {_fmt(ck.get('step'))}")
        parts[-1] += f", {_ago(time.time() - ck['at'])} ago)" if isinstance(ck.get("at"), (int, float)) else ")"
    return " ".join(parts)


def _notice_text(n: Any) -> str:
    if not n:
        return "-"
    if isinstance(n, dict):
        kind = str(n.get("action") or n.get("kind") or "notice")
        src = f"{n['source']}:" if n.get("source") else ""
        if n.get("at_risk"):
            return f"{src}{kind} (at risk)"
        when = n.get("deadline", n.get("time"))
        if isinstance(when, (int, float)):
            return f"{src}{kind} in {max(0, int(when - time.time()))}s"
        return f"{src}{kind}" + (f"@{when}" if when else "")
    return str(n)


def _event_text(ev: dict[str, Any]) -> str:
    at = time.strftime("%H:%M:%S", time.localtime(ev["at"])) if isinstance(ev.get("at"), (int, float)) else "?"
    kind = ev.get("kind")
    if kind == "notice":
        what = f"{ev.get('provider')} {ev.get('notice_kind')} notice"
        detail = f"drain={'yes' if ev.get('drain') else 'no'}, {ev.get('seconds_left')}s left"
    elif kind == "cost":
        return f"{at}  {ev.get('node')}  job ended: {ev.get('summary')}"
    elif kind == "drain_start":
        what, detail = "drain started", f"{ev.get('reason')}, deadline in {ev.get('deadline_in_s')}s"
    else:
        what = "drained"
        detail = (f"{ev.get('notice_to_drained_s')}s after the notice, lost steps {_fmt(ev.get('lost_steps'))}, "
                  f"mode {_fmt(ev.get('mode'))}, step {_fmt(ev.get('committed_step'))}")
    return f"{at}  {ev.get('node')}  {what}: {detail}"


def worker_error_text(e: dict[str, Any]) -> str:
    """`n2: /data/x.yaml: data.yaml not found  (slot 0, exit 2, 12s ago)`."""
    at = e.get("at")
    ago = f", {_ago(time.time() - at)} ago" if isinstance(at, (int, float)) else ""
    return f"{e.get('node')}: {e.get('reason')}  (slot {_fmt(e.get('slot'))}, exit {_fmt(e.get('code'))}{ago})"


def _usd(v: Any) -> str:
    return "-" if v is None else f"${v:,.2f}" if abs(v) >= 100 else f"${v:.3f}"


def cost_text(view: dict[str, Any]) -> str:
    c, g = view.get("cost") or {}, view.get("goodput") or {}
    if c.get("spent_usd") is None:
        text = "COST - (no node has a price: --price-per-hour or --price-table)"
    else:
        text = (f"COST {_usd(c['spent_usd'])} spent  ON-DEMAND {_usd(c.get('on_demand_usd'))}  "
                f"SAVED {_usd(c.get('savings_usd'))}  BURN {_usd(c.get('burn_usd_per_hour'))}/h  "
                f"PER EPOCH {_usd(c.get('usd_per_epoch'))}")
        if c.get("departed_nodes"):
            text += f"  (incl. {c['departed_nodes']} departed)"
        if c.get("unpriced_nodes"):
            text += f"  ({c['unpriced_nodes']} unpriced)"
    ratio = g.get("ratio")
    return text + f"  GOODPUT {'-' if ratio is None else f'{ratio * 100:.0f}%'}"


def _data_text(d: Any) -> str:
    """A node's dataset staging: `staging 42% 3.1s`, `ready 12.0s`, `cached 0.3s`, `failed: ...`."""
    if not isinstance(d, dict):
        return "-"
    state, secs = d.get("state"), d.get("seconds")
    took = f" {secs:.1f}s" if isinstance(secs, (int, float)) else ""
    if state == "staging":
        total, done = d.get("bytes") or 0, d.get("done_bytes") or 0
        return f"staging {int(100 * done / total)}%{took}" if total else f"staging{took}"
    if state == "ready":
        return ("cached" if d.get("reused") else "ready") + took
    if state == "failed":
        return f"failed: {str(d.get('error') or '?')[:60]}"
    return str(state)


NODE_COLUMNS = ("NODE", "STATE", "SLOTS", "RANKS", "LEADER", "LEASE", "AGE", "NOTICE", "$/H", "SPENT",
                "PREEMPTIBLE")


def refusal_lines(view: dict[str, Any]) -> list[str]:
    """`node n2: engine horovod is not installed here (...)` for each node that refuses the job."""
    return [f"node {n['id']}: {n['refused']}" for n in view["nodes"] if n.get("refused")]


def node_columns(view: dict[str, Any]) -> tuple[str, ...]:
    """The node table's columns: DATA only while some node stages an s3:// dataset."""
    return NODE_COLUMNS + (("DATA",) if any(n.get("data") for n in view["nodes"]) else ())


def node_rows(view: dict[str, Any]) -> list[list[str]]:
    show_data = "DATA" in node_columns(view)
    rows = []
    for n in view["nodes"]:
        ttl = n["lease_ttl_s"]
        rows.append([
            n["id"], _fmt(n["state"]) + (" (no heartbeat)" if n.get("suspect") else ""), _fmt(n["slots"]),
            _fmt(n["ranks"]), "*" if n["leader"] else "",
            "-" if ttl is None else ("expired" if ttl < 0 else f"{ttl}s"), _ago(n["age_s"]),
            _notice_text(n["notice"]), "-" if n["price_per_hour"] is None else f"{n['price_per_hour']:.3f}",
            _usd(n.get("spent_usd")),
            "-" if n["preemptible"] is None else ("yes" if n["preemptible"] else "no"),
        ] + ([_data_text(n.get("data"))] if show_data else []))
    return rows


# rich lays out a table at a few ms per row: beyond this many nodes a plain table of the same
# layout is written (a 1,000-node status stays fast; bench/membership.py).
RICH_MAX_ROWS = 100
_RIGHT = ("SLOTS", "$/H", "SPENT")


def _plain_table(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]

    def line(cells: Any) -> str:
        return "   ".join(v.rjust(w) if c in _RIGHT else v.ljust(w)
                          for c, v, w in zip(columns, cells, widths)).rstrip()

    return [line(columns), "─" * (sum(widths) + 3 * (len(widths) - 1))] + [line(r) for r in rows]


def render_table(view: dict[str, Any], *, color: bool = False, width: int | None = None) -> str:
    """The status as text: a summary, the cost line, the nodes (a `rich` table) and recent events.
    Plain text unless `color`; `width` None = wide enough never to wrap (pipes, files)."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table

    head = [
        ("JOB", view["job"]), ("STATE", view["state"]), ("WORLD", _fmt(view["world_size"])),
        ("EPOCH", _fmt(view["epoch"])), ("STEP", _fmt(view["step"])), ("SAMPLES/S", _fmt(view["samples_s"])),
        ("LEADER", f"{view['leader']} (term {view['leader_term']})" if view["leader"] else "-"),
    ]
    lines = ["  ".join(f"{k} {v}" for k, v in head)]
    if view.get("reason") and view["state"] not in ("running", "submitted"):
        lines.append(f"REASON {view['reason']}")
    lines += [f"CHECKPOINT {_checkpoint_text(view['last_checkpoint'])}", cost_text(view), ""]
    columns = node_columns(view)
    rows = node_rows(view)
    if not rows:
        lines.append("no nodes registered")
    elif len(rows) > RICH_MAX_ROWS and not color:
        lines += _plain_table(columns, rows)
    else:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1),
                      header_style="bold" if color else "")
        for col in columns:
            table.add_column(col, no_wrap=True, justify="right" if col in _RIGHT else "left")
        for r in rows:
            style = "yellow" if color and r[7] != "-" else None
            table.add_row(*r, style=style)
        out = io.StringIO()
        console = Console(file=out, width=width or 1000, color_system="standard" if color else None,
                          force_terminal=color, highlight=False, soft_wrap=False)
        console.print(table)
        lines += [line.rstrip() for line in out.getvalue().rstrip("\n").splitlines()]
    refusals = refusal_lines(view)
    if refusals:
        lines += ["", "NODES REFUSING THE JOB"] + ["  " + line for line in refusals]
    if view.get("worker_errors"):
        lines += ["", "WORKER ERRORS (the latest of each node)"] + \
            ["  " + worker_error_text(e) for e in view["worker_errors"]]
    if view.get("events"):
        lines += ["", "EVENTS"] + ["  " + _event_text(ev) for ev in view["events"]]
    return "\n".join(lines)
