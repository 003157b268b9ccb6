"""The etcd client of a worker process, from the environment its agent set.

Agents pass `ELASTICYOLO_ETCD`, `ELASTICYOLO_JOB` and TLS/auth (`ELASTICYOLO_ETCD_CA`, `_CERT`,
`_KEY`, `_USER`, and the password as a file: `_PASSWORD_FILE`, see secrets.py) through the
environment, never the command line (visible in `ps`).
"""

from __future__ import annotations

import os

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.secrets import password_from_env


def client_from_env(timeout: float) -> tuple[EtcdClient, JobKeys] | None:
    """(client, keys) for this worker's job, or None when not started by an agent. `timeout`
    bounds each request and its retries: workers must never stall a step on etcd."""
    endpoints, job = os.environ.get("ELASTICYOLO_ETCD"), os.environ.get("ELASTICYOLO_JOB")
    if not endpoints or not job:
        return None
    env = os.environ.get
    client = EtcdClient(endpoints, ca_cert=env("ELASTICYOLO_ETCD_CA"), cert_cert=env("ELASTICYOLO_ETCD_CERT"),
                        cert_key=env("ELASTICYOLO_ETCD_KEY"), user=env("ELASTICYOLO_ETCD_USER"),
                        password=password_from_env(), timeout=timeout, retry_window=timeout)
    return client, JobKeys(job)
