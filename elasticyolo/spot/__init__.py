"""Spot interruption notices: AWS IMDSv2, GCP metadata, Azure Scheduled Events, local file/signal.

The agent builds one watcher with make_watcher(...) and starts it with a callback; see docs/spot.md.
No torch here (the agent imports this). The names below load on first use, so importing
`elasticyolo.spot.providers` (the provider list, for flags and config) stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from elasticyolo.spot.providers import PROVIDERS

_EXPORTS = {
    "MetadataError": "elasticyolo.spot.base", "NoticeSource": "elasticyolo.spot.base",
    "make_watcher": "elasticyolo.spot.factory", "probe": "elasticyolo.spot.factory",
    "KINDS": "elasticyolo.spot.notice", "Notice": "elasticyolo.spot.notice",
    "NoticeWatcher": "elasticyolo.spot.watcher",
}

__all__ = ["KINDS", "PROVIDERS", "MetadataError", "Notice", "NoticeSource", "NoticeWatcher", "make_watcher", "probe"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elasticyolo.spot' has no attribute {name!r}")
    return getattr(import_module(module), name)
