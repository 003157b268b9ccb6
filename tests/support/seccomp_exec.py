"""`/usr/bin/python3 seccomp_exec.py ALLOWLIST -- CMD ...`: exec CMD under a seccomp filter that
allows only the system calls listed in ALLOWLIST (one name per line) and fails every other with
EPERM, as systemd's `SystemCallFilter=` + `SystemCallErrorNumber=EPERM` do. Children inherit it.

Run by the system Python (Debian's python3-seccomp bindings), not the project's venv.
"""

import errno
import os
import sys


def main() -> None:
    import seccomp

    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit("usage: seccomp_exec.py ALLOWLIST -- CMD ...")
    with open(sys.argv[1]) as fh:
        names = [line.strip() for line in fh if line.strip()]
    filt = seccomp.SyscallFilter(defaction=seccomp.ERRNO(errno.EPERM))
    for name in names:
        try:
            filt.add_rule(seccomp.ALLOW, name)
        except (ValueError, RuntimeError, OSError):
            pass  # not a system call of this architecture or kernel
    filt.load()  # sets no_new_privs first, as systemd does
    argv = sys.argv[3:]
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
