"""`elasticyolo status`: the job's world (nodes, leader, progress, checkpoint). No torch."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time

from elasticyolo.commands.connect import add_etcd_arguments, client_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S", help="--watch refresh period (default 2)")
    parser.add_argument("--lease-ttl", choices=["auto", "always", "never"], default="auto",
                        help="per-node lease TTL lookups (one request each): auto = up to 100 nodes")


_TTL_MODE = {"auto": None, "always": True, "never": False}


def run(args: argparse.Namespace) -> int:
    from elasticyolo.status import collect, render_table

    client, keys = client_from_args(args)
    tty = sys.stdout.isatty()

    def render(view: dict) -> str:
        if args.json:
            return json.dumps(view, sort_keys=True)
        # On a terminal: colour, and the terminal's width (rich fits the table to it).
        return render_table(view, color=tty, width=shutil.get_terminal_size().columns if tty else None)

    if not args.watch:
        print(render(collect(client, keys, lease_ttls=_TTL_MODE[args.lease_ttl])))
        return 0
    from elasticyolo.errors import UnavailableError

    def frame() -> str:
        try:
            return render(collect(client, keys, lease_ttls=_TTL_MODE[args.lease_ttl]))
        except UnavailableError as exc:
            return f"elasticyolo status: {exc}"

    try:
        if args.json or not tty:
            while True:
                out = frame()
                if args.json:
                    print(out, flush=True)  # one object per line: easy to pipe into jq
                else:
                    sys.stdout.write(f"\n{time.strftime('%H:%M:%S')}  every {args.interval:g}s\n{out}\n")
                    sys.stdout.flush()
                time.sleep(args.interval)
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        # A terminal: redrawn in place (rich's Live on the alternate screen), Ctrl-C to leave, even
        # when started by a parent that ignores SIGINT (an ignored signal is inherited).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with Live(console=Console(), screen=True, auto_refresh=False, transient=True) as live:
            while True:
                head = f"{time.strftime('%H:%M:%S')}  every {args.interval:g}s  (Ctrl-C to quit)\n"
                live.update(Text.from_ansi(head + frame()), refresh=True)
                time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
