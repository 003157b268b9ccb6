"""Structured logging: JSON under systemd or when not on a terminal, readable on a terminal.

One pipeline for everything the process logs: structlog's own loggers and the standard library's
(boto3/botocore, urllib3, Horovod, torch, etcd3gw) both end in the same renderer, so a log is one
JSON object per line with `level`, `logger`, `timestamp` and `event`. When stderr is journald's
stream (systemd sets `$JOURNAL_STREAM` to its device:inode), each line starts with the syslog
priority prefix `<N>` that journald reads as the entry's level (`journalctl -p warning` works).

Taps (`add_tap`) get every complete line written to the log stream, without that prefix: the
agent ships them to the job's store (`agent/log_shipping.py`). A child's output that the agent
forwards (`forward_line`) goes to the same stream, so the journal and the taps see it too.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from typing import Any, Callable

import structlog

_configured = False

# syslog priorities (sd-daemon.h SD_ERR ... SD_DEBUG) for journald's level prefix.
SYSLOG_PRIORITY = {"critical": 2, "exception": 3, "error": 3, "warning": 4, "warn": 4, "info": 6, "debug": 7,
                   "notset": 7}
# Chatty libraries stay at WARNING unless the level asked for is debug.
NOISY_LIBRARIES = ("botocore", "boto3", "s3transfer", "urllib3", "werkzeug", "filelock", "matplotlib", "PIL")
_HANDLER_NAME = "elasticyolo"
_PRIORITY_PREFIX = re.compile(r"^<[0-7]>")

_taps: list[Callable[[str], None]] = []
_stream: Any = None  # the configured stream (a _TappedStream)
_journal = False  # it is journald's: forwarded lines get a priority prefix


def add_tap(tap: Callable[[str], None]) -> None:
    """Call `tap(line)` for every complete line written to the log stream from now on (no trailing
    newline, no journald prefix). A tap must be quick and must not log."""
    _taps.append(tap)


def remove_tap(tap: Callable[[str], None]) -> None:
    if tap in _taps:
        _taps.remove(tap)


class _TappedStream:
    """The log stream. It passes on whole lines only, each thread's own (structlog prints a record
    and its newline in two writes; a line forwarded from another thread must not land between
    them), and gives each line to the taps."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._partial: dict[int, str] = {}  # thread -> the start of its unfinished line
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        me = threading.get_ident()
        with self._lock:
            *lines, rest = (self._partial.pop(me, "") + text).split("\n")
            if rest:
                self._partial[me] = rest
            for line in lines:
                self._stream.write(line + "\n")
        for line in lines:
            line = _PRIORITY_PREFIX.sub("", line, count=1)
            for tap in list(_taps):
                try:
                    tap(line)
                except Exception:  # noqa: BLE001 - a tap never breaks logging
                    pass
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def forward_line(line: str) -> None:
    """Write one line of a child process's output (its own log record, or anything it printed) to
    this process's log stream, with journald's priority prefix when the stream is the journal and
    the line has none (a JSON record's level, else info)."""
    stream = _stream if _stream is not None else sys.stderr
    line = line.rstrip("\n")
    if _journal and not _PRIORITY_PREFIX.match(line):
        level = "info"
        if line.startswith("{"):
            try:
                level = str(json.loads(line).get("level") or "info").lower()
            except (ValueError, AttributeError):
                pass
        line = f"<{SYSLOG_PRIORITY.get(level, 6)}>{line}"
    stream.write(line + "\n")
    stream.flush()


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
    global _configured, _stream, _journal
    stream = stream or sys.stderr
    level_name = (level or os.environ.get("ELASTICYOLO_LOG_LEVEL", "info")).upper()
    level_no = getattr(logging, level_name, logging.INFO)
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if _want_json(stream)
        else structlog.dev.ConsoleRenderer(colors=hasattr(stream, "isatty") and stream.isatty())
    )
    _journal = on_journal(stream)
    if _journal:
        renderer = journald_prefixed(renderer)
    raw, stream = stream, _TappedStream(stream)
    _stream = stream
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
                getattr(old, "stream", None) in (sys.stderr, sys.stdout, raw):
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
