"""Errors a user can act on. The CLI prints them as one line and exits non-zero."""

from __future__ import annotations


class UserError(Exception):
    """Bad input or an unreachable dependency, explained in one line (what and where)."""

    exit_code = 2


class UnavailableError(UserError):
    """A service the command needs (etcd, S3) cannot be reached."""

    exit_code = 3
