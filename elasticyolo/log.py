"""Structured logging: JSON under systemd or when not on a terminal, readable on a terminal.

One pipeline for everything the process logs: structlog's own loggers and the standard library's
(boto3/botocore, urllib3, Horovod, torch, etcd3gw) both end in the same renderer, so a log is one
JSON object per line with `level`, `logger`, `timestamp` and `event`. When stderr is journald's
stream (systemd sets `$JOURNAL_STREAM` to its device:inode), each line starts with the syslog
priority prefix `<N>` that journald reads as the entry's level (`journalctl -p warning` works).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

import structlog

_configured = False

# syslog priorities (sd-daemon.h SD_ERR ... SD_DEBUG) for journald's level prefix.
SYSLOG_PRIORITY = {"critical": 2, "exception": 3, "error": 3, "warning": 4, "warn": 4, "info": 6, "debug": 7,
                   "notset": 7}
# Chatty libraries stay at WARNING unless the level asked for is debug.
NOISY_LIBRARIES = ("botocore", "boto3", "s3transfer", "urllib3", "werkzeug", "filelock", "matplotlib", "PIL")
_HANDLER_NAME = "elasticyolo"


def _want_json(stream: Any) -> bool:
    forced = os.environ.get("ELASTICYOLO_LOG_FORMAT", "").lower()
    if forced in ("json", "console"):
        return forced == "json"
    under_systemd = bool(os.environ.get("INVOCATION_ID") or os.environ.get("JOURNAL_STREAM"))
    return under_systemd or not (hasattr(stream, "isatty") and stream.isatty())


def on_journal(stream: Any) -> bool:
    """True when `stream` is the journald stream systemd connected (`$JOURNAL_STREAM` = dev:inode)."""
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in want.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def journald_prefixed(renderer: Callable[..., str]) -> Callable[..., str]:
    """Wrap a final renderer so each line starts with journald's `<priority>` prefix."""

    def render(logger: Any, method_name: str, event_dict: dict[str, Any]) -> str:
        level = str(event_dict.get("level") or method_name).lower()
        return f"<{SYSLOG_PRIORITY.get(level, 6)}>{renderer(logger, method_name, event_dict)}"

    return render


def _logger_name(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    record = event_dict.get("_record")
    if record is not None:
        event_dict.setdefault("logger", record.name)
    return event_dict


def configure(level: str | None = None, stream: Any = None) -> None:
    """Configure structlog and the standard library's root logger (idempotent; the last call
    wins). Logs go to stderr by default."""
    global _configured
    stream = stream or sys.stderr
    level_name = (level or os.environ.get("ELASTICYOLO_LOG_LEVEL", "info")).upper()
    level_no = getattr(logging, level_name, logging.INFO)
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if _want_json(stream)
        else structlog.dev.ConsoleRenderer(colors=hasattr(stream, "isatty") and stream.isatty())
    )
    if on_journal(stream):
        renderer = journald_prefixed(renderer)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # Standard-library loggers (boto3, Horovod, torch, ...) through the same renderer.
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, _logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    ))
    root = logging.getLogger()
    for old in list(root.handlers):
        if old.get_name() == _HANDLER_NAME or isinstance(old, logging.StreamHandler) and \
                getattr(old, "stream", None) in (sys.stderr, sys.stdout, stream):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_no)
    for name in NOISY_LIBRARIES:
        logging.getLogger(name).setLevel(level_no if level_no <= logging.DEBUG else max(level_no, logging.WARNING))
    logging.captureWarnings(True)
    _configured = True


def get_logger(name: str, **bound: Any) -> Any:
    if not _configured:
        configure()
    return structlog.get_logger(name).bind(**bound)
