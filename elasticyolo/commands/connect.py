"""`--etcd`/`--job` and TLS/auth flags shared by status, submit, cancel (and other CLI tools).

Precedence: flags, then env `ELASTICYOLO_*`, then the agent config file (so `elasticyolo status`
on a node with `/etc/elasticyolo/agent.yaml` needs no flags). Kept free of pydantic and yaml at
import time: `elasticyolo status` must start fast.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from elasticyolo.cluster import settings
from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.settings import EtcdSettings
from elasticyolo.errors import UserError

DEFAULT_CONFIG_PATH = "/etc/elasticyolo/agent.yaml"

# flag dest -> (env name, key in agent.yaml)
_SOURCES = {
    "etcd": (settings.ENV_ENDPOINTS, "etcd"),
    "job": (settings.ENV_JOB, "job"),
    "etcd_ca": (settings.ENV_CA, "etcd_ca"),
    "etcd_cert": (settings.ENV_CERT, "etcd_cert"),
    "etcd_key": (settings.ENV_KEY, "etcd_key"),
    "etcd_user": (settings.ENV_USER, "etcd_user"),
    "etcd_password_file": (settings.ENV_PASSWORD_FILE, "etcd_password_file"),
}


def add_etcd_arguments(parser: argparse.ArgumentParser, job_required: bool = True) -> None:
    g = parser.add_argument_group("etcd")
    g.add_argument("--etcd", metavar="HOST:PORT[,...]", help="etcd endpoints (env ELASTICYOLO_ETCD)")
    g.add_argument("--job", help="job name (env ELASTICYOLO_JOB)" + ("" if job_required else "; default: default"))
    g.add_argument("--etcd-ca", metavar="PEM", help="CA bundle for TLS to etcd")
    g.add_argument("--etcd-cert", metavar="PEM", help="client certificate for etcd")
    g.add_argument("--etcd-key", metavar="PEM", help="client key for etcd")
    g.add_argument("--etcd-user", help="etcd user (password from env ELASTICYOLO_ETCD_PASSWORD or --etcd-password-file)")
    g.add_argument("--etcd-password-file", metavar="PATH", help="file holding the etcd password")
    g.add_argument("--etcd-timeout", type=float, default=2.0, metavar="S", help="seconds per etcd request (default 2)")
    g.add_argument("--config", metavar="PATH", help=f"agent config to read etcd settings from (default {DEFAULT_CONFIG_PATH})")


def _from_config_file(path: str | None) -> dict[str, Any]:
    explicit = path is not None or "ELASTICYOLO_CONFIG" in os.environ
    p = Path(path or os.environ.get("ELASTICYOLO_CONFIG") or DEFAULT_CONFIG_PATH)
    if not p.exists():
        if explicit:
            raise UserError(f"config file {p}: not found")
        return {}
    from elasticyolo.config import read_config_file  # pulls yaml only when a file exists

    return read_config_file(p)


def resolve(args: argparse.Namespace, job_required: bool = True) -> dict[str, Any]:
    values: dict[str, Any] = {}
    file_values: dict[str, Any] | None = None
    for dest, (env, file_key) in _SOURCES.items():
        v = getattr(args, dest, None)
        if v in (None, ""):
            v = os.environ.get(env) or None
        if v is None:
            if file_values is None:
                file_values = _from_config_file(getattr(args, "config", None))
            v = file_values.get(file_key)
        values[dest] = v
    values["etcd_password"] = os.environ.get(settings.ENV_PASSWORD) or (file_values or {}).get("etcd_password")
    if values["etcd_password_file"]:
        from elasticyolo.cluster.secrets import read_password_file

        values["etcd_password"] = read_password_file(values["etcd_password_file"])
    if values["etcd_user"] and not values["etcd_password"]:
        from elasticyolo.cluster.secrets import credential_path, read_password_file

        if (cred := credential_path()) is not None:  # systemd LoadCredential=etcd-password:...
            values["etcd_password"] = read_password_file(cred, "etcd password credential")
    if not values["etcd"]:
        raise UserError("no etcd endpoints: pass --etcd HOST:PORT[,...] or set ELASTICYOLO_ETCD")
    if isinstance(values["etcd"], list):
        values["etcd"] = ",".join(values["etcd"])
    if not values["job"]:
        if job_required:
            raise UserError("no job name: pass --job NAME or set ELASTICYOLO_JOB")
        values["job"] = "default"
    for dest in ("etcd_ca", "etcd_cert", "etcd_key"):
        if values[dest] and not Path(values[dest]).is_file():
            raise UserError(f"--{dest.replace('_', '-')} {values[dest]}: no such file")
    return values


def client_from_args(args: argparse.Namespace, job_required: bool = True,
                     retry_window: float | None = None) -> tuple[EtcdClient, JobKeys]:
    """An etcd client and the job's keys from CLI flags/env/config. Raises UserError.
    `retry_window` defaults to the client's, which rides out an etcd leader election (a member
    whose leader died answers only once the survivors elect one): `status` during an etcd
    member failure answers, a few seconds late, instead of failing."""
    v = resolve(args, job_required)
    keys = JobKeys(str(v["job"]))
    timeout = float(getattr(args, "etcd_timeout", 2.0) or 2.0)
    etcd = EtcdSettings.of(v["etcd"], ca=v["etcd_ca"], cert=v["etcd_cert"], key=v["etcd_key"], user=v["etcd_user"],
                           password=v["etcd_password"], password_file=v["etcd_password_file"])
    return etcd.client(timeout=timeout, retry_window=retry_window), keys
