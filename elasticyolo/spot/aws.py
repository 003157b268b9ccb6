"""AWS EC2 spot notices through IMDSv2 (token, then instance-action and rebalance)."""

from __future__ import annotations

import json
import time

from elasticyolo.spot.base import HttpSource, MetadataError
from elasticyolo.spot.notice import AWS_NOTICE_S, Notice, parse_iso8601

DEFAULT_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
INSTANCE_TYPE_PATH = "/latest/meta-data/instance-type"
_ACTIONS = {"terminate", "stop", "hibernate"}


class AwsSource(HttpSource):
    name = "aws"

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        poll_interval_s: float = 5.0,  # what AWS suggests
        timeout_s: float = 2.0,
        token_ttl_s: int = 21600,
        drain_on_rebalance: bool = False,
    ) -> None:
        super().__init__(base_url, poll_interval_s, timeout_s)
        if not 1 <= token_ttl_s <= 21600:
            raise ValueError("token_ttl_s must be within 1..21600 (IMDSv2 limits)")
        self.token_ttl_s = token_ttl_s
        self.drain_on_rebalance = drain_on_rebalance
        self._token: str | None = None
        self._token_renew_at = 0.0  # monotonic

    # -- token ---------------------------------------------------------------------------------
    def _renew_token(self) -> str:
        t0 = time.monotonic()
        resp = self.request("PUT", TOKEN_PATH, headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)})
        if resp.status_code != 200 or not resp.text:
            raise self.fail(resp, "IMDSv2 token")
        self._token = resp.text.strip()
        # Renew well before expiry (20% of the TTL, at most a minute early) so a poll never races it.
        self._token_renew_at = t0 + self.token_ttl_s - min(60.0, 0.2 * self.token_ttl_s)
        self.log.debug("imds token renewed", ttl_s=self.token_ttl_s)
        return self._token

    def _token_now(self) -> str:
        if self._token is None or time.monotonic() >= self._token_renew_at:
            return self._renew_token()
        return self._token

    def _get(self, path: str) -> tuple[int, str]:
        """GET with the token; on 401 (expired/revoked token) renew once and retry."""
        for attempt in (1, 2):
            resp = self.request("GET", path, headers={"X-aws-ec2-metadata-token": self._token_now()})
            if resp.status_code == 401 and attempt == 1:
                self.log.info("imds token rejected, renewing", path=path)
                self._token = None
                continue
            if resp.status_code in (200, 404):
                return resp.status_code, resp.text
            raise self.fail(resp, f"GET {path}")
        raise MetadataError(f"GET {path}: token rejected twice")

    def instance_type(self) -> str | None:
        status, body = self._get(INSTANCE_TYPE_PATH)
        return (body.strip() or None) if status == 200 else None

    # -- checks --------------------------------------------------------------------------------
    def _check(self) -> list[Notice]:
        now = time.time()
        notices: list[Notice] = []
        status, body = self._get(ACTION_PATH)
        if status == 200:
            notices.append(self._action_notice(body, now))
        status, body = self._get(REBALANCE_PATH)
        if status == 200:
            notices.append(self._rebalance_notice(body, now))
        return notices

    def _action_notice(self, body: str, now: float) -> Notice:
        try:
            raw = json.loads(body)
        except ValueError:
            raw = {"body": body}
        action = str(raw.get("action", "terminate")).lower() if isinstance(raw, dict) else "terminate"
        when = parse_iso8601(str(raw.get("time", ""))) if isinstance(raw, dict) else None
        if when is None:
            self.log.warning("instance-action without a parseable time, assuming 2 min", body=body[:200])
        kind = action if action in _ACTIONS else "terminate"
        return Notice(
            provider="aws", kind=kind, deadline=when if when is not None else now + AWS_NOTICE_S,
            key=f"aws:instance-action:{action}:{raw.get('time') if isinstance(raw, dict) else body}",
            raw=raw, received_at=now,
        )

    def _rebalance_notice(self, body: str, now: float) -> Notice:
        try:
            raw = json.loads(body)
        except ValueError:
            raw = {"body": body}
        notice_time = raw.get("noticeTime", "") if isinstance(raw, dict) else ""
        # No deadline comes with a rebalance; a 2-minute notice can follow at any moment.
        return Notice(
            provider="aws", kind="rebalance", deadline=now + AWS_NOTICE_S, key=f"aws:rebalance:{notice_time}",
            drain=self.drain_on_rebalance, raw=raw, received_at=now,
        )
