"""Structured logging: JSON under systemd or when not on a terminal, readable on a terminal."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


def _want_json(stream: Any) -> bool:
    forced = os.environ.get("ELASTICYOLO_LOG_FORMAT", "").lower()
    if forced in ("json", "console"):
        return forced == "json"
    under_systemd = bool(os.environ.get("INVOCATION_ID") or os.environ.get("JOURNAL_STREAM"))
    return under_systemd or not (hasattr(stream, "isatty") and stream.isatty())


def configure(level: str | None = None, stream: Any = None) -> None:
    """Configure structlog once per process (idempotent). Logs go to stderr by default."""
    global _configured
    stream = stream or sys.stderr
    level_name = (level or os.environ.get("ELASTICYOLO_LOG_LEVEL", "info")).upper()
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if _want_json(stream)
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str, **bound: Any) -> Any:
    if not _configured:
        configure()
    return structlog.get_logger(name).bind(**bound)
