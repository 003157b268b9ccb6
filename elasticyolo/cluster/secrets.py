"""How the etcd password reaches each process: read from a file or a systemd credential
(`LoadCredential=etcd-password:...`), handed to child processes as a file path, never as a value.

Never on a command line (`ps` shows it), never in etcd, logs or checkpoints, and not in the
environment of workers either (`ps e` shows environments): a worker gets
`ELASTICYOLO_ETCD_PASSWORD_FILE`. `ELASTICYOLO_ETCD_PASSWORD` (a systemd `EnvironmentFile=`) is
still accepted for the agent itself; the agent then drops it from the environment it passes on
and writes the value once to a private file (mode 0600) for its children.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, MutableMapping

from elasticyolo.errors import UserError
from elasticyolo.exit_hooks import at_exit

PASSWORD_ENV = "ELASTICYOLO_ETCD_PASSWORD"  # the agent's own (EnvironmentFile=); never passed on
PASSWORD_FILE_ENV = "ELASTICYOLO_ETCD_PASSWORD_FILE"  # what children get
CREDENTIAL_NAME = "etcd-password"  # LoadCredential=etcd-password:/etc/elasticyolo/etcd-password


def credential_path(name: str = CREDENTIAL_NAME, environ: Mapping[str, str] | None = None) -> Path | None:
    """`$CREDENTIALS_DIRECTORY/<name>` when systemd passed that credential to this service."""
    env = os.environ if environ is None else environ
    directory = env.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return None
    path = Path(directory) / name
    return path if path.is_file() else None


def via_credential(path: str, environ: Mapping[str, str] | None = None) -> str:
    """A file setting as this process can read it: under systemd, a credential with the file's
    name (`LoadCredential=client-agent-key.pem:/etc/elasticyolo/pki/client-agent-key.pem`) is
    the service's readable copy of a root-only file; elsewhere the path itself."""
    cred = credential_path(Path(path).name, environ)
    return str(cred) if cred is not None else path


def read_password_file(path: str | Path, what: str = "etcd password file") -> str:
    """The first line of `path` (a trailing newline is not part of the password)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"{what} {path}: {exc.strerror or exc}") from None
    password = text.splitlines()[0] if text else ""
    if not password:
        raise UserError(f"{what} {path}: empty")
    return password


def password_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The password a child process was given: a file path (preferred), a value, or a
    systemd credential."""
    env = os.environ if environ is None else environ
    if env.get(PASSWORD_FILE_ENV):
        return read_password_file(env[PASSWORD_FILE_ENV])
    if env.get(PASSWORD_ENV):
        return env[PASSWORD_ENV]
    cred = credential_path(environ=env)
    return read_password_file(cred, "etcd password credential") if cred else None


_private_copies: dict[str, Path] = {}  # password -> its private file (one per value this process holds)


def child_password_env(password: str | None, password_file: str | None,
                       environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Environment for child processes: `ELASTICYOLO_ETCD_PASSWORD_FILE` (nothing without a
    password). Removes `ELASTICYOLO_ETCD_PASSWORD` from `environ` (default os.environ) so
    children do not inherit the value."""
    env = os.environ if environ is None else environ
    env.pop(PASSWORD_ENV, None)
    if not password:
        return {}
    if password_file:
        return {PASSWORD_FILE_ENV: str(Path(password_file).resolve())}
    path = _private_copies.get(password)
    if path is None or not path.is_file():
        # $RUNTIME_DIRECTORY: systemd's RuntimeDirectory= (tmpfs, private to the service).
        base = env.get("RUNTIME_DIRECTORY") or None
        directory = Path(tempfile.mkdtemp(prefix="elasticyolo-secret-", dir=base))
        at_exit(shutil.rmtree, directory, True)
        path = directory / CREDENTIAL_NAME
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(password + "\n")
        _private_copies[password] = path
    return {PASSWORD_FILE_ENV: str(path)}
