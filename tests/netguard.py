"""Run a Python entry point with an audit hook that records every non-loopback network attempt.

Usage: python tests/netguard.py LOGFILE module:function [args...]
Every `socket.connect`/`socket.getaddrinfo`/`socket.sendto` to something other than loopback (or
a Unix socket) is appended to LOGFILE; the test asserts it stays empty.
"""

from __future__ import annotations

import importlib
import ipaddress
import sys

LOG = sys.argv[1]
LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "", None}


def _is_loopback(host: object) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


def _hook(event: str, args: tuple) -> None:  # type: ignore[type-arg]
    target = None
    if event in ("socket.connect", "socket.sendto") and len(args) >= 2:
        addr = args[1]
        if isinstance(addr, tuple) and addr:
            target = addr[0]
        else:
            return  # AF_UNIX path
    elif event == "socket.getaddrinfo" and args:
        target = args[0]
    else:
        return
    if not _is_loopback(target):
        with open(LOG, "a") as fh:
            fh.write(f"{event} {target!r}\n")


sys.addaudithook(_hook)
module_name, _, func = sys.argv[2].partition(":")
sys.argv = [sys.argv[2], *sys.argv[3:]]
sys.exit(getattr(importlib.import_module(module_name), func)())
