"""How to reach etcd (endpoints, TLS, auth), the environment variables that carry it, and the one
place an `EtcdClient` is built from it.

Every process gets its settings from one of: the agent config (`from_config`), the CLI's flags /
environment / agent config file (`commands/connect.py`), a worker's environment as its agent wrote
it (`worker_runtime/worker_env.py`), or torchrun's `--rdzv-conf` plus the environment
(`engines/torch/rendezvous.py`). All of them build their client with `EtcdSettings.client()`.
Secrets (the password) never travel on a command line (`ps` shows it) nor through etcd; children
get it as a file path (`ELASTICYOLO_ETCD_PASSWORD_FILE`, `cluster/secrets.py`), not as a value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from elasticyolo.cluster.secrets import PASSWORD_ENV, PASSWORD_FILE_ENV, child_password_env, password_from_env

if TYPE_CHECKING:
    from elasticyolo.cluster.etcd import EtcdClient

# The variable names, shared by the agent config (`ELASTICYOLO_<SETTING>`), the CLI and workers.
ENV_ENDPOINTS = "ELASTICYOLO_ETCD"
ENV_CA = "ELASTICYOLO_ETCD_CA"
ENV_CERT = "ELASTICYOLO_ETCD_CERT"
ENV_KEY = "ELASTICYOLO_ETCD_KEY"
ENV_USER = "ELASTICYOLO_ETCD_USER"
ENV_PASSWORD, ENV_PASSWORD_FILE = PASSWORD_ENV, PASSWORD_FILE_ENV
ENV_JOB = "ELASTICYOLO_JOB"  # the job name (`--job`)
_FIELD_ENV = {"ca": ENV_CA, "cert": ENV_CERT, "key": ENV_KEY, "user": ENV_USER}


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: str = ""  # comma-separated host:port (or scheme://host:port)
    ca: str | None = None  # CA bundle (PEM) for TLS
    cert: str | None = None  # client certificate (PEM)
    key: str | None = None  # client key (PEM)
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    # Where the password was read from, handed to children as is (provenance, not identity).
    password_file: str | None = field(default=None, compare=False)

    @classmethod
    def of(cls, endpoints: str | Sequence[str], **fields: Any) -> "EtcdSettings":
        joined = endpoints if isinstance(endpoints, str) else ",".join(endpoints)
        return cls(joined, **{k: (str(v) if v else None) for k, v in fields.items()})

    @classmethod
    def from_config(cls, cfg: Any) -> "EtcdSettings":
        """From an `AgentConfig`."""
        return cls.of(cfg.etcd, ca=cfg.etcd_ca, cert=cfg.etcd_cert, key=cfg.etcd_key, user=cfg.etcd_user,
                      password=cfg.etcd_password, password_file=cfg.etcd_password_file)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "EtcdSettings":
        env = os.environ if environ is None else environ
        return cls(env.get(ENV_ENDPOINTS, ""), **{f: env.get(var) or None for f, var in _FIELD_ENV.items()},
                   password=password_from_env(env), password_file=env.get(ENV_PASSWORD_FILE) or None)

    def to_env(self) -> dict[str, str]:
        """The variables a child process needs to build the same client (empty ones left out);
        the password as a file path only."""
        out = {ENV_ENDPOINTS: self.endpoints} if self.endpoints else {}
        out.update({var: str(getattr(self, f)) for f, var in _FIELD_ENV.items() if getattr(self, f)})
        out.update(child_password_env(self.password, self.password_file))
        return out

    def with_endpoints(self, endpoints: str | Sequence[str]) -> "EtcdSettings":
        return replace(self, endpoints=endpoints if isinstance(endpoints, str) else ",".join(endpoints))

    def client(self, *, timeout: float = 2.0, retry_window: float | None = None) -> "EtcdClient":
        """`timeout` bounds each request; `retry_window` how long a call retries and fails over
        (default: the client's, 2 x timeout + 1)."""
        from elasticyolo.cluster.etcd import EtcdClient

        return EtcdClient(self.endpoints, ca_cert=self.ca, cert_cert=self.cert, cert_key=self.key, user=self.user,
                          password=self.password, timeout=timeout, retry_window=retry_window)
