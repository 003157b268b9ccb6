"""Agent configuration: `/etc/elasticyolo/agent.yaml` (path overridable), then env
`ELASTICYOLO_<FIELD>`, then CLI flags — later sources win. Validated with pydantic; every
problem is reported in one line naming the field and where its value came from.
"""

from __future__ import annotations

import glob
import os
import socket
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from elasticyolo.cluster.etcd import parse_endpoints
from elasticyolo.cluster.keys import check_job_name, check_node_id
from elasticyolo.errors import UserError
from elasticyolo.s3options import S3Settings
from elasticyolo.spec import TrainSpec
from elasticyolo.spot.providers import PROVIDERS, check_provider
from elasticyolo.worker_runtime.worker_env import DEFAULT_WORK_ROOT

DEFAULT_CONFIG_PATH = "/etc/elasticyolo/agent.yaml"


def detect_slots() -> int:
    """GPUs on the node's VM without importing torch (/dev/nvidiaN), else 1 (CPU: set `slots`)."""
    return max(1, len([p for p in glob.glob("/dev/nvidia[0-9]*") if p[len("/dev/nvidia"):].isdigit()]))


class AgentConfig(S3Settings):
    """`s3_*` (from S3Settings): this node's S3 defaults for checkpoints and datasets; a job's own
    values win."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # etcd
    etcd: list[str] = Field(..., description="etcd endpoints host:port (several: failover)")
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    etcd_user: str | None = None
    etcd_password: str | None = Field(None, repr=False)
    etcd_password_file: str | None = None
    etcd_timeout: float = Field(2.0, gt=0, le=60, description="seconds per etcd request")

    # identity
    job: str = "default"
    node_id: str = Field(default_factory=socket.gethostname)
    host: str = Field(default_factory=socket.gethostname)
    addr: str = Field(default_factory=socket.gethostname, description="address other nodes use for this one")
    slots: int = Field(default_factory=detect_slots, ge=1, le=1024)
    preemptible: bool = True
    instance_type: str | None = None
    zone: str | None = None
    price_per_hour: float | None = Field(None, ge=0, description="USD per hour the node's VM costs (see elasticyolo/cost.py)")
    on_demand_price_per_hour: float | None = Field(None, ge=0, description="USD per hour of the same VM on demand")
    price_table: str | None = Field(None, description="YAML instance_type: {spot: USD, on_demand: USD}")

    # behaviour
    ttl: int = Field(5, ge=1, le=300, description="lease TTL in seconds")
    # Fast failure signals (cluster/liveness.py): a heartbeat to the leader every interval; none for
    # the timeout makes the node a suspect. Default timeout: min(2, 0.75 * ttl).
    heartbeat_interval_s: float = Field(0.25, gt=0, le=60, description="seconds between heartbeats to the leader")
    heartbeat_timeout_s: float | None = Field(None, gt=0, description="no heartbeat this long: node suspected")
    handover: bool = Field(True, description="a preemptible leader hands over to a non-preemptible node")
    drain_timeout_s: float = Field(60.0, ge=0)
    startup_timeout_s: float = Field(60.0, ge=0, description="give up (exit 3) if etcd is unreachable this long at start")
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_addr: str = "127.0.0.1"
    log_level: str = "info"
    work_dir: str = Field(DEFAULT_WORK_ROOT, description="node-local files of the jobs: snapshots, worker cwd")

    # spot interruption notices (elasticyolo/spot, agent/drain.py)
    spot_provider: str = Field("none", description=" | ".join(PROVIDERS))
    metadata_url: str | None = Field(None, description="metadata base URL (tests: http://127.0.0.1:PORT)")
    notice_file: str | None = Field(None, description="a file whose appearance is a notice")
    spot_poll_interval: float | None = Field(None, gt=0, le=60)
    drain_on_rebalance: bool = Field(False, description="drain on a rebalance recommendation, not only mark at risk")
    drain_margin_s: float = Field(5.0, ge=0, le=120, description="finish draining this long before a notice deadline")

    # datasets staged from S3 (data=s3://bucket/prefix/data.yaml): elasticyolo/staging/stager.py
    data_cache_dir: str | None = Field(None, description="default: $CACHE_DIRECTORY/datasets, else "
                                                          "$XDG_CACHE_HOME/elasticyolo/datasets")
    data_cache_max_gb: float | None = Field(None, gt=0, description="size cap; least recently used datasets "
                                                                    "are evicted (default: no cap but free space)")
    data_max_concurrency: int = Field(16, ge=1, le=256, description="parallel S3 transfers while staging")

    # a job spec for VMs that boot straight into one job (submitted if etcd has none)
    spec: dict[str, Any] | None = None

    @field_validator("etcd", mode="before")
    @classmethod
    def _split_endpoints(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("etcd")
    @classmethod
    def _endpoints_ok(cls, v: list[str]) -> list[str]:
        try:
            parse_endpoints(v, tls=False)
        except UserError as exc:
            raise ValueError(str(exc)) from None
        return v

    @field_validator("job")
    @classmethod
    def _job_ok(cls, v: str) -> str:
        try:
            return check_job_name(v)
        except UserError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("node_id")
    @classmethod
    def _node_ok(cls, v: str) -> str:
        try:
            return check_node_id(v)
        except UserError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("etcd_ca", "etcd_cert", "etcd_key", "etcd_password_file", mode="before")
    @classmethod
    def _credential_copy(cls, v: Any) -> Any:
        from elasticyolo.cluster.secrets import via_credential

        return via_credential(v) if isinstance(v, str) and v else v

    @field_validator("etcd_ca", "etcd_cert", "etcd_key", "etcd_password_file")
    @classmethod
    def _file_exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"{v}: no such file")
        return v

    @field_validator("log_level")
    @classmethod
    def _level_ok(cls, v: str) -> str:
        if v.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError("expected debug, info, warning or error")
        return v.lower()

    @field_validator("heartbeat_timeout_s")
    @classmethod
    def _heartbeat_below_ttl(cls, v: float | None, info: ValidationInfo) -> float | None:
        ttl = info.data.get("ttl")
        if v is not None and ttl is not None and v >= ttl:
            raise ValueError(f"{v:g} s is not below the lease ttl ({ttl} s); the lease would decide first")
        interval = info.data.get("heartbeat_interval_s")
        if v is not None and interval is not None and interval >= v:
            raise ValueError(f"{v:g} s is not above heartbeat_interval_s ({interval:g} s)")
        return v

    @property
    def heartbeat_timeout(self) -> float:
        """The effective heartbeat timeout (the setting, or min(2, 0.75 * ttl))."""
        return self.heartbeat_timeout_s if self.heartbeat_timeout_s is not None else min(2.0, 0.75 * self.ttl)

    @field_validator("spot_provider")
    @classmethod
    def _provider_ok(cls, v: str) -> str:
        return check_provider(v)

    @field_validator("metrics_addr")
    @classmethod
    def _metrics_addr_ok(cls, v: str) -> str:
        try:
            socket.inet_aton(v)
        except OSError:
            raise ValueError(f"{v!r} is not an IPv4 address") from None
        return v

    @model_validator(mode="after")
    def _pairs(self) -> "AgentConfig":
        if self.heartbeat_interval_s >= self.heartbeat_timeout:
            raise ValueError(f"heartbeat_interval_s: {self.heartbeat_interval_s:g} s is not below the heartbeat "
                             f"timeout ({self.heartbeat_timeout:g} s)")
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise ValueError("etcd_cert and etcd_key go together")
        if self.etcd_password is None:
            from elasticyolo.cluster.secrets import credential_path, read_password_file

            if self.etcd_password_file:
                self.etcd_password = read_password_file(self.etcd_password_file)
            elif self.etcd_user and (cred := credential_path()) is not None:
                # systemd LoadCredential=etcd-password:...: the unit names the file, not this config
                self.etcd_password = read_password_file(cred, "etcd password credential")
                self.etcd_password_file = str(cred)
        return self

    def train_spec(self, where: str = "agent config") -> TrainSpec | None:
        return None if self.spec is None else TrainSpec.validated(self.spec, f"{where}: spec")

    def tls(self) -> bool:
        return bool(self.etcd_ca or self.etcd_cert)


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a YAML mapping; UserError (one line, with the line number) when it is not one."""
    import yaml

    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"config file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise UserError(f"config file {path}:{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def load_agent_config(config_path: str | None, flags: Mapping[str, Any],
                      environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Merge file < env < flags (flags with value None are "not given") and validate."""
    env = os.environ if environ is None else environ
    explicit = config_path or env.get("ELASTICYOLO_CONFIG")
    path = Path(explicit or DEFAULT_CONFIG_PATH)
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if path.exists():
        for k, v in read_config_file(path).items():
            values[str(k)] = v
            origin[str(k)] = f"config file {path}"
    elif explicit:
        raise UserError(f"config file {path}: not found")
    for name in AgentConfig.model_fields:
        env_name = "ELASTICYOLO_" + name.upper()
        if env.get(env_name) not in (None, ""):
            raw: Any = env[env_name]
            if name == "spec":
                import json

                try:
                    raw = json.loads(raw)
                except ValueError:
                    raise UserError(f"env {env_name}: expected a JSON object") from None
            values[name] = raw
            origin[name] = f"env {env_name}"
    for name, v in flags.items():
        if v is not None:
            values[name] = v
            origin[name] = f"--{name.replace('_', '-')}"
    if not values.get("etcd"):
        raise UserError("no etcd endpoints: pass --etcd HOST:PORT[,...], set ELASTICYOLO_ETCD, or put etcd: in "
                        f"{path}")
    try:
        cfg = AgentConfig.model_validate(values)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            msg = err["msg"].removeprefix("Value error, ")
            src = origin.get(field, "")
            if err["type"] == "extra_forbidden":
                msg = "unknown setting"
            # A check across settings names its settings itself.
            parts.append((f"{field}: {msg}" if field else msg) + (f" (from {src})" if src else ""))
        raise UserError("invalid agent config: " + "; ".join(parts)) from None
    cfg.train_spec(where=origin.get("spec", "agent config"))  # a bad spec fails now, before any write
    return cfg
