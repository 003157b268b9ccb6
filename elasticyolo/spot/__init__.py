"""Spot interruption notices: AWS IMDSv2, GCP metadata, Azure Scheduled Events, local file/signal.

The agent builds one watcher with make_watcher(...) and starts it with a callback; see docs/spot.md.
No torch here (the agent imports this).
"""

from elasticyolo.spot.base import MetadataError, NoticeSource
from elasticyolo.spot.factory import PROVIDERS, make_watcher, probe
from elasticyolo.spot.notice import KINDS, Notice
from elasticyolo.spot.watcher import NoticeWatcher

__all__ = ["KINDS", "PROVIDERS", "MetadataError", "Notice", "NoticeSource", "NoticeWatcher", "make_watcher", "probe"]
