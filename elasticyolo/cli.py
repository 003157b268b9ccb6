"""`elasticyolo` command line. Never imports torch: each subcommand's module is imported only
when that subcommand runs, and only worker-side commands (train, worker) pull in torch."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn, Sequence

from elasticyolo import __version__
from elasticyolo.errors import UserError

# subcommand -> (module under elasticyolo.commands, one-line help). Each module defines
# `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "agent": ("agent", "run the per-node daemon (systemd runs this on every GPU VM)"),
    "status": ("status", "show the job's world: nodes, ranks, leader, progress, checkpoints"),
    "submit": ("submit", "store a training job spec in etcd"),
    "cancel": ("cancel", "stop a job"),
    "logs": ("logs", "show a job's agent and worker logs (shipped to the job's store)"),
    "train": ("train", "train in this process (single node, no etcd)"),
    "data": ("data", "dataset tools (data synth: generate a small detection dataset)"),
    "checkpoints": ("checkpoints", "list, show, download or prune a job's checkpoints; download its run folder"),
    "report": ("report", "draw a job's timeline: world size, samples/s, loss, mAP and events over time"),
    "discover-hosts": ("discover_hosts", "print host:slots lines for Horovod host discovery"),
    "worker": ("worker", "run one training worker (started by horovodrun or an agent)"),
    "demo": ("demo", "run the end-to-end local demo"),
    "ray": ("ray_jobs", "run a job on a Ray cluster (engine=ray): ray submit | status | cancel"),
    "chaos": ("chaos", "chaos tools (chaos replay: replay a real spot trace, goodput vs ideal and checkpoint-restart)"),
}


# Long-running processes whose stderr is a log (journald, the agent's worker logs).
DAEMONS = ("agent", "worker")
# Set to see the traceback of an unexpected error instead of its one-line summary.
DEBUG_ENV = "ELASTICYOLO_DEBUG"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (what, and where to look), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="elasticyolo", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"elasticyolo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _load(module: str):  # type: ignore[no-untyped-def]
    return importlib.import_module(f"elasticyolo.commands.{module}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = build_parser()
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv)  # prints usage / --help / --version, or errors on an unknown command
        return 2
    name, rest = argv[0], argv[1:]
    module_name, help_text = COMMANDS[name]
    try:
        module = _load(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("elasticyolo.commands"):
            print(f"elasticyolo: error: command '{name}' is not available in this build", file=sys.stderr)
            return 2
        print(f"elasticyolo {name}: error: needs the Python package {exc.name!r}, which is not installed "
              f"(worker-side commands need `pip install elasticyolo[train]`)", file=sys.stderr)
        return 2
    parser = OneLineParser(prog=f"elasticyolo {name}", description=help_text)
    module.add_arguments(parser)
    _one_line_subparsers(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - never a traceback for a user; ELASTICYOLO_DEBUG=1 shows it
        message, code, unexpected = error_line(name, exc)
        on_error = getattr(module, "on_error", None)
        if on_error is not None:  # e.g. a worker tells its agent why it failed
            on_error(args, message, code)
        if os.environ.get(DEBUG_ENV) and not isinstance(exc, UserError):
            raise
        hint = f" ({DEBUG_ENV}=1 shows the traceback)" if unexpected else ""
        print(f"elasticyolo {name}: error: {message}{hint}", file=sys.stderr)
        return code


def error_line(name: str, exc: Exception) -> tuple[str, int, bool]:
    """What a command that raised `exc` prints (one line, after `elasticyolo NAME: error: `), its
    exit status, and whether the error is unexpected (a bug or an environment problem rather than
    bad input: its traceback may help)."""
    if isinstance(exc, UserError):
        return str(exc), exc.exit_code, False
    if isinstance(exc, ModuleNotFoundError):  # imported lazily by the command: a missing optional dependency
        return (f"needs the Python package {exc.name!r}, which is not installed "
                f"(worker-side commands need `pip install elasticyolo[train]`)"), 2, False
    if isinstance(exc, OSError):  # a path we cannot create, read or write: what failed and where
        return os_error_text(exc), 1, False
    if name in DAEMONS and not os.environ.get(DEBUG_ENV):
        # Their stderr is a log: the traceback goes in one structured record.
        from elasticyolo.log import get_logger

        get_logger("elasticyolo.cli").exception("crashed", command=name, error=f"{type(exc).__name__}: {exc}")
    return f"{type(exc).__name__}: {_first_line(exc)} (at {_innermost_frame(exc)})", 1, True


def os_error_text(exc: OSError) -> str:
    """`<path>: <reason>` for a filesystem error (the path that failed, not only its errno)."""
    reason = exc.strerror or _first_line(exc) or type(exc).__name__
    if exc.filename is not None:
        target = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
        return f"{target}: {reason}"
    return reason


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _innermost_frame(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "?"
    return f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"


def _one_line_subparsers(parser: argparse.ArgumentParser) -> None:
    """Sub-actions (`data synth`, `checkpoints list`) get one-line errors too."""
    for action in parser._actions:  # argparse has no public accessor for its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.__class__ = OneLineParser
                _one_line_subparsers(sub)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
