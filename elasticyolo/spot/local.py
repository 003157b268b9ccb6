"""Local notice sources: a file that appears at a path, and signals the agent forwards."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from elasticyolo.spot.base import NoticeSource
from elasticyolo.spot.notice import Notice

DEFAULT_FILE_NOTICE_S = 30.0
DEFAULT_SIGNAL_NOTICE_S = 30.0


class FileSource(NoticeSource):
    """A notice is a file at `path` (written by a cloud hook, an operator or chaos tooling).

    Optional JSON content: {"deadline": <epoch s>} or {"in_s": <seconds>}, plus "reason".
    Write it atomically (write elsewhere, then rename) so a half-written file is never parsed.
    """

    name = "file"

    def __init__(self, path: str | os.PathLike[str], poll_interval_s: float = 1.0,
                 default_notice_s: float = DEFAULT_FILE_NOTICE_S) -> None:
        super().__init__(poll_interval_s)
        self.path = Path(path)
        self.default_notice_s = default_notice_s
        self.log = self.log.bind(path=str(self.path))

    def _check(self) -> list[Notice]:
        try:
            st = self.path.stat()
            text = self.path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        now = time.time()
        raw: object = text
        deadline = now + self.default_notice_s
        if text.strip():
            try:
                raw = json.loads(text)
            except ValueError:
                if now - st.st_mtime < 1.0:
                    return []  # probably still being written; look again next poll
                self.log.warning("notice file is not JSON, using the default deadline")
            if isinstance(raw, dict):
                if isinstance(raw.get("deadline"), (int, float)):
                    deadline = float(raw["deadline"])
                elif isinstance(raw.get("in_s"), (int, float)):
                    deadline = now + float(raw["in_s"])
        # Identity = this file instance: the same file is one notice, a new one is another.
        key = f"file:{self.path}:{st.st_ino}:{st.st_mtime_ns}"
        return [Notice(provider="local", kind="file", deadline=deadline, key=key, raw=raw, received_at=now)]


def signal_notice(signum: int, deadline_in_s: float = DEFAULT_SIGNAL_NOTICE_S) -> Notice:
    """The notice for a signal the agent received (SIGTERM from systemd or a cloud shutdown)."""
    now = time.time()
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = str(signum)
    return Notice(provider="local", kind="signal", deadline=now + deadline_in_s, key=f"signal:{name}",
                  raw={"signal": name}, received_at=now)
