"""make_watcher: build the NoticeWatcher for the agent's --spot-provider/--metadata-url/--notice-file."""

from __future__ import annotations

from urllib.parse import urlparse

import requests

from elasticyolo.errors import UserError
from elasticyolo.log import get_logger
from elasticyolo.spot import aws, azure, gcp
from elasticyolo.spot.base import NoticeSource
from elasticyolo.spot.local import DEFAULT_SIGNAL_NOTICE_S, FileSource
from elasticyolo.spot.providers import PROVIDERS, check_provider
from elasticyolo.spot.watcher import NoticeWatcher

__all__ = ["PROVIDERS", "make_watcher", "probe"]
# All three clouds answer on the link-local address, so `auto` needs only one base URL.
AUTO_DEFAULT_URL = "http://169.254.169.254"
DEFAULT_URLS = {"aws": aws.DEFAULT_URL, "gcp": gcp.DEFAULT_URL, "azure": azure.DEFAULT_URL}
DEFAULT_POLL_S = {"aws": 5.0, "gcp": 5.0, "azure": 2.0, "file": 1.0}

log = get_logger("elasticyolo.spot")


def _check_url(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UserError(f"--metadata-url {url!r}: expected http://HOST[:PORT]")
    return url.rstrip("/")


def probe(base_url: str, timeout_s: float = 1.0) -> str:
    """Which provider's metadata API answers at base_url: 'aws', 'gcp', 'azure' or 'none'.

    Bounded: at most three short requests, and it stops at the first connection failure (nothing
    listens there, so the other probes would only wait too)."""
    session = requests.Session()
    session.trust_env = False
    base = base_url.rstrip("/")
    probes = [
        ("aws", "PUT", aws.TOKEN_PATH, {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, None),
        ("gcp", "GET", gcp.PREEMPTED_PATH, gcp.HEADERS, ("Metadata-Flavor", "Google")),
        # Not the scheduled-events path: its first call may block for minutes while Azure enables it.
        ("azure", "GET", "/metadata/instance?api-version=2021-02-01", azure.HEADERS, None),
    ]
    try:
        for name, method, path, headers, want_header in probes:
            try:
                resp = session.request(method, base + path, headers=headers, timeout=(timeout_s, timeout_s))
            except requests.ConnectionError as exc:
                log.info("metadata probe: nothing answers", url=base, error=str(exc)[:200])
                return "none"
            except requests.RequestException:
                continue
            if resp.status_code == 200 and (want_header is None or resp.headers.get(want_header[0]) == want_header[1]):
                return name
        return "none"
    finally:
        session.close()


def make_watcher(
    provider: str = "none",
    metadata_url: str | None = None,
    notice_file: str | None = None,
    poll_interval_s: float | None = None,
    *,
    drain_on_rebalance: bool = False,
    timeout_s: float = 2.0,
    max_backoff_s: float = 5.0,
    token_ttl_s: int = 21600,
    signal_deadline_s: float = DEFAULT_SIGNAL_NOTICE_S,
    azure_instance_name: str | None = None,
    azure_first_call_timeout_s: float = 120.0,
    gcp_long_poll: bool = True,
    probe_timeout_s: float = 1.0,
) -> NoticeWatcher:
    """Build (not start) the watcher. Always returns one, possibly with no sources ('none'), so
    the agent can call inject_signal()/status() whatever the provider.

    metadata_url: the metadata base URL (tests: http://127.0.0.1:PORT). None means the provider's
    real address; `auto` then probes only http://169.254.169.254, else only the given URL.
    poll_interval_s: None for each provider's default (AWS 5 s, GCP 5 s long-poll, Azure 2 s).
    """
    try:
        provider = check_provider(provider)
    except ValueError as exc:
        raise UserError(f"--spot-provider {exc}") from None
    if poll_interval_s is not None and poll_interval_s <= 0:
        raise UserError(f"spot poll interval must be > 0 (got {poll_interval_s})")
    base = _check_url(metadata_url) if metadata_url else None
    if provider == "auto":
        url = base or AUTO_DEFAULT_URL
        provider = probe(url, probe_timeout_s)
        log.info("spot provider detected", provider=provider, url=url)
        base = base or (AUTO_DEFAULT_URL if provider != "none" else None)

    def interval(kind: str) -> float:
        return poll_interval_s if poll_interval_s is not None else DEFAULT_POLL_S[kind]

    sources: list[NoticeSource] = []
    if provider == "aws":
        sources.append(aws.AwsSource(base or aws.DEFAULT_URL, interval("aws"), timeout_s, token_ttl_s, drain_on_rebalance))
    elif provider == "gcp":
        for key in ("preempted", "maintenance-event"):
            sources.append(gcp.GcpSource(key, base or gcp.DEFAULT_URL, interval("gcp"), timeout_s, gcp_long_poll))
    elif provider == "azure":
        sources.append(azure.AzureSource(base or azure.DEFAULT_URL, interval("azure"), timeout_s,
                                         azure_instance_name, azure_first_call_timeout_s))
    if notice_file:
        sources.append(FileSource(notice_file, interval("file")))
    return NoticeWatcher(sources, provider=provider, max_backoff_s=max_backoff_s, signal_deadline_s=signal_deadline_s)
