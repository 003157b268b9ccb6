"""`elasticyolo agent`: the per-node daemon (systemd runs it on every VM)."""

from __future__ import annotations

import argparse

from elasticyolo.agent.sd_notify import SystemdNotifier
from elasticyolo.config import DEFAULT_CONFIG_PATH
from elasticyolo.errors import UserError
from elasticyolo.spot.providers import PROVIDERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH",
                        help=f"YAML config (default {DEFAULT_CONFIG_PATH}; env ELASTICYOLO_CONFIG). "
                             "Precedence: file < env ELASTICYOLO_<SETTING> < flags")
    parser.add_argument("--etcd", metavar="HOST:PORT[,...]", help="etcd endpoints (several: failover)")
    parser.add_argument("--job", help="job name (default: default)")
    parser.add_argument("--node-id", help="unique node id (default: hostname)")
    parser.add_argument("--host", help="host name shown in status (default: hostname)")
    parser.add_argument("--addr", help="address other nodes reach this one at (default: hostname)")
    parser.add_argument("--slots", type=int, help="workers on this node (default: GPUs found, else 1)")
    parser.add_argument("--ttl", type=int, help="lease TTL in seconds (default 5)")
    parser.add_argument("--heartbeat-interval-s", type=float, metavar="S",
                        help="seconds between heartbeats to the leader (default 0.25)")
    parser.add_argument("--heartbeat-timeout-s", type=float, metavar="S",
                        help="no heartbeat this long: the node is suspected (default min(2, 0.75*ttl); below ttl)")
    parser.add_argument("--preemptible", action=argparse.BooleanOptionalAction, default=None,
                        help="spot/preemptible VM (default yes); non-preemptible nodes are preferred as leader")
    parser.add_argument("--instance-type")
    parser.add_argument("--zone")
    parser.add_argument("--price-per-hour", type=float, metavar="USD",
                        help="what the node's VM costs per hour (status and /metrics show the job's spend)")
    parser.add_argument("--on-demand-price-per-hour", type=float, metavar="USD",
                        help="the same VM's on-demand price (for savings; default: from --price-table)")
    parser.add_argument("--price-table", metavar="YAML",
                        help="instance_type: {spot: USD, on_demand: USD}; prices a node by its --instance-type")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free port)")
    parser.add_argument("--metrics-addr", help="metrics bind address (default 127.0.0.1)")
    parser.add_argument("--drain-timeout-s", type=float, help="max seconds to drain on SIGTERM (default 60)")
    parser.add_argument("--startup-timeout-s", type=float, help="exit 3 if etcd stays unreachable this long at start (default 60)")
    parser.add_argument("--etcd-ca", metavar="PEM")
    parser.add_argument("--etcd-cert", metavar="PEM")
    parser.add_argument("--etcd-key", metavar="PEM")
    parser.add_argument("--etcd-user")
    parser.add_argument("--etcd-password-file", metavar="PATH", help="(or env ELASTICYOLO_ETCD_PASSWORD)")
    parser.add_argument("--etcd-timeout", type=float, metavar="S", help="seconds per etcd request (default 2)")
    parser.add_argument("--handover", action=argparse.BooleanOptionalAction, default=None,
                        help="a preemptible leader hands over to a non-preemptible node (default yes)")
    parser.add_argument("--work-dir", metavar="DIR",
                        help="node-local files of the jobs (snapshots, worker cwd; default /var/tmp/elasticyolo)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    data = parser.add_argument_group("datasets staged from S3 and S3 options (defaults for jobs)")
    data.add_argument("--data-cache-dir", metavar="DIR", help="dataset cache (default $CACHE_DIRECTORY/datasets)")
    data.add_argument("--data-cache-max-gb", type=float, metavar="GB", help="cache cap; LRU datasets not in use are evicted")
    data.add_argument("--data-max-concurrency", type=int, metavar="N", help="parallel S3 transfers (default 16)")
    data.add_argument("--s3-endpoint-url", metavar="URL", help="S3-compatible endpoint")
    data.add_argument("--s3-region")
    data.add_argument("--s3-profile")
    data.add_argument("--s3-sse", choices=["AES256", "aws:kms", "aws:kms:dsse"], help="server-side encryption")
    data.add_argument("--s3-kms-key-id", metavar="KEY")
    spot = parser.add_argument_group("spot interruption notices")
    spot.add_argument("--spot-provider", choices=PROVIDERS,
                      help="watch this cloud's metadata for interruption notices and drain on one (default none)")
    spot.add_argument("--metadata-url", metavar="URL", help="metadata base URL (default: the provider's own)")
    spot.add_argument("--notice-file", metavar="PATH", help="a file appearing here is a notice (any provider)")
    spot.add_argument("--spot-poll-interval", type=float, metavar="S", help="poll period (default: per provider)")
    spot.add_argument("--drain-on-rebalance", action=argparse.BooleanOptionalAction, default=None,
                      help="drain on a rebalance recommendation (default: only mark the node at risk)")
    spot.add_argument("--drain-margin-s", type=float, metavar="S",
                      help="finish draining this long before the notice deadline (default 5)")


_FLAG_FIELDS = ("etcd", "job", "node_id", "host", "addr", "slots", "ttl", "preemptible", "instance_type", "zone",
                "price_per_hour", "on_demand_price_per_hour", "price_table", "metrics_port", "metrics_addr", "drain_timeout_s", "startup_timeout_s", "etcd_ca",
                "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file", "etcd_timeout", "handover", "log_level",
                "spot_provider", "metadata_url", "notice_file", "spot_poll_interval", "drain_on_rebalance",
                "drain_margin_s", "work_dir", "data_cache_dir", "data_cache_max_gb", "data_max_concurrency",
                "s3_endpoint_url", "s3_region", "s3_profile", "s3_sse", "s3_kms_key_id", "heartbeat_interval_s",
                "heartbeat_timeout_s")


def run(args: argparse.Namespace) -> int:
    from elasticyolo.priority import as_agent

    as_agent()  # before any thread: lease renewals and heartbeats stay ahead of training (priority.py)
    notifier = SystemdNotifier()
    try:
        return _run(args, notifier)
    except UserError as exc:
        # `systemctl status` shows why the agent stopped. Exit 2 (a configuration error) is not
        # restarted (the unit's RestartPreventExitStatus=2); exit 3 (etcd unreachable) is.
        kind = "configuration error" if exc.exit_code == 2 else "error"
        notifier.final_status(f"{kind}: {exc}")
        raise


def _run(args: argparse.Namespace, notifier: SystemdNotifier) -> int:
    from elasticyolo import log
    from elasticyolo.agent.daemon import Agent
    from elasticyolo.agent.drain import SpotDrain
    from elasticyolo.config import load_agent_config
    from elasticyolo.engines.dispatch import EngineDispatch  # torch-free: runs the job's engine

    cfg = load_agent_config(args.config, {name: getattr(args, name) for name in _FLAG_FIELDS})
    log.configure(cfg.log_level)
    import time

    from elasticyolo.agent.log_shipping import LogShipper

    shipper = LogShipper(cfg.node_id, cfg.job, time.time())  # from here on, the log goes to the job's store too
    from elasticyolo.agent.staging import DataStagingHook  # s3:// datasets, before slots are offered

    spot = SpotDrain.from_config(cfg)  # a bad --metadata-url fails here, before anything starts
    itype_source = "config" if cfg.instance_type else None
    if cfg.instance_type is None and (itype := spot.watcher.instance_type()):
        # Prices by the price table need the type; the cloud's metadata states it (cost.py).
        cfg, itype_source = cfg.model_copy(update={"instance_type": itype}), f"metadata:{spot.watcher.provider}"
    # The shipper last: it ships what the others log when the agent stops.
    agent = Agent(cfg, plugins=[spot, DataStagingHook(cfg), EngineDispatch(), shipper], notifier=notifier)
    if itype_source:
        agent.set_record_field("instance_type_source", itype_source)
    agent.signal_sink = spot.watcher.inject_signal
    return agent.run()
