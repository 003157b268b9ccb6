"""`elasticyolo` command line. Never imports torch: each subcommand's module is imported only
when that subcommand runs, and only worker-side commands (train, worker) pull in torch."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from elasticyolo import __version__
from elasticyolo.errors import UserError

# subcommand -> (module under elasticyolo.commands, one-line help). Each module defines
# `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "agent": ("agent", "run the per-node daemon (systemd runs this on every GPU VM)"),
    "status": ("status", "show the job's world: nodes, ranks, leader, progress, checkpoints"),
    "submit": ("submit", "store a training job spec in etcd"),
    "cancel": ("cancel", "stop a job"),
    "train": ("train", "train in this process (single node, no etcd)"),
    "data": ("data", "dataset tools (data synth: generate a small detection dataset)"),
    "checkpoints": ("checkpoints", "list, show, download or prune a job's checkpoints"),
    "discover-hosts": ("discover_hosts", "print host:slots lines for Horovod host discovery"),
    "worker": ("worker", "run one training worker (started by horovodrun or an agent)"),
    "demo": ("demo", "run the end-to-end local demo"),
    "chaos": ("chaos", "chaos tools (chaos replay: replay a real spot trace, goodput vs ideal and checkpoint-restart)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elasticyolo", description=__doc__.splitlines()[0])
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
        raise
    parser = argparse.ArgumentParser(prog=f"elasticyolo {name}", description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except UserError as exc:
        print(f"elasticyolo {name}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
