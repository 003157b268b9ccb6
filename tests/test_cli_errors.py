"""Every CLI path ends in one line (what and where) with a non-zero exit, never a traceback;
logs from the standard library go through structlog (JSON, journald priority prefixes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ELASTICYOLO = str(Path(sys.executable).with_name("elasticyolo"))


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ELASTICYOLO, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args, needle", [
    (["data", "synth", "--out", "/proc/x", "--train", "2"], "--out /proc/x: cannot write the dataset"),
    (["data", "synth", "--out", "/dev/null/x", "--train", "2"], "Not a directory"),
    (["data", "synth", "--train", "2"], "required: --out"),
    (["data", "synth", "--out", "x", "--train", "two"], "invalid int value"),
    (["data", "bogus"], "invalid choice"),
    (["status", "--bogus"], "unrecognized arguments: --bogus"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["checkpoints", "list", "--job", "j", "--store", "bogus://x"], "unsupported scheme"),
    (["checkpoints", "list"], "required"),
    (["train", "--progress-jsonl", "/proc/x/y", "data=x"], "/proc/x/y"),
    (["train", "data=/proc/x/data.yaml"], "data.yaml not found"),
])
def test_bad_input_is_one_line(args: list[str], needle: str) -> None:
    r = run(*args)
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert needle in r.stderr and r.stderr.startswith("elasticyolo"), r.stderr


def test_unexpected_error_is_one_line_and_debug_shows_traceback(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    from elasticyolo import cli

    def broken(args: object) -> int:
        raise RuntimeError("something inside broke\nsecond line")

    monkeypatch.setattr(cli, "_load", lambda name: SimpleNamespace(add_arguments=lambda p: None, run=broken))
    monkeypatch.delenv("ELASTICYOLO_DEBUG", raising=False)
    assert cli.main(["status"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError: something inside broke (at test_cli_errors.py:" in err, err
    monkeypatch.setenv("ELASTICYOLO_DEBUG", "1")
    with pytest.raises(RuntimeError):
        cli.main(["status"])


SCRIPT = """
import logging
from elasticyolo import log
log.configure("info")
logging.getLogger("horovod.runner").warning("driver %s", "up")
logging.getLogger("botocore.credentials").info("chatty, hidden at info")
log.get_logger("elasticyolo.x").info("ours", n=1)
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("torch.distributed").exception("failed")
"""


def test_stdlib_loggers_go_through_structlog_with_journald_priorities(tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    with open(err, "w") as fh:
        st = os.fstat(fh.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}", "ELASTICYOLO_LOG_FORMAT": ""}
        subprocess.run([sys.executable, "-c", SCRIPT], stderr=fh, check=True, timeout=60, env=env)
    lines = err.read_text().splitlines()
    assert [line[:3] for line in lines] == ["<4>", "<6>", "<3>"], lines
    recs = [json.loads(line[3:]) for line in lines]
    assert recs[0] == {**recs[0], "event": "driver up", "level": "warning", "logger": "horovod.runner"}
    assert recs[1]["event"] == "ours" and recs[1]["n"] == 1
    assert recs[2]["logger"] == "torch.distributed" and "ZeroDivisionError" in recs[2]["exception"]
    # Not journald's stream: plain JSON lines, no prefix.
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "JOURNAL_STREAM": "1:2"})
    assert all(line.startswith("{") for line in r.stderr.splitlines()), r.stderr


def test_missing_dependency_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from elasticyolo import cli

    def load(name: str) -> None:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(cli, "_load", load)
    assert cli.main(["train", "data=x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the Python package 'torch'" in err and "elasticyolo[train]" in err
