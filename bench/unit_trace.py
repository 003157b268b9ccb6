"""What a real training run needs from the systemd unit: system calls, written paths, devices.

Starts etcd and the local S3 server, uploads a generated dataset, and runs one agent as the shipped
unit would (UnitSandbox: the unit's environment, read-only system and HOME, no capabilities; the
seccomp filter is left off here so that every call is seen) under `strace -f`. The agent stages the
s3:// dataset and trains one Horovod job (2 slots: two Gloo workers, 2 data-loader processes each,
checkpoints to S3) and one torch-elastic job. Two traced runs: a syscall summary (`strace -c`) and
the file-changing calls with their paths. Printed: system calls used that the unit's
SystemCallFilter does not allow, paths written outside StateDirectory/CacheDirectory/private tmp,
devices opened.

    .venv/bin/python bench/unit_trace.py [--json OUT]

On a machine without a GPU, CUDA/NCCL calls and /dev/nvidia* are not exercised.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elasticyolo.data.synth import SynthSpec, write_dataset  # noqa: E402
from elasticyolo.local_cluster.servers import EtcdCluster, S3Server  # noqa: E402
from elasticyolo.staging.upload import upload_dataset  # noqa: E402
from tests.support.unit_jobs import SandboxedAgent  # noqa: E402
from tests.support.unit_sandbox import UnitSandbox, expand_syscall_filter  # noqa: E402

UNIT = REPO / "systemd" / "elasticyolo-agent.service"
FILE_CALLS = ("open", "openat", "openat2", "creat", "mkdir", "mkdirat", "rename", "renameat", "renameat2", "unlink",
              "unlinkat", "rmdir", "link", "linkat", "symlink", "symlinkat", "truncate", "chmod", "fchmodat",
              "utimensat", "mknod", "mknodat")
WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND")
_LINE = re.compile(r'^(?:\[pid\s+)?(\d+)\]?\s*(\w+)\((.*)\)\s+=\s+(-?\d+|\?)(?:\s+(\w+))?')


def run_traced(sandbox: UnitSandbox, etcd: EtcdCluster, s3: S3Server, bucket: str, strace_args: list[str],
               job: str, log: Path) -> None:
    agent = SandboxedAgent(sandbox, etcd.endpoints, job, log, slots=2, env=s3.env(),
                           wrap=[shutil.which("strace") or "strace", "-f", "-qq", *strace_args])
    try:
        agent.start()
        for engine in ("horovod", "torch"):
            t0 = time.monotonic()
            state = agent.run_job(f"data=s3://{bucket}/shapes/data.yaml", "model=yolov8n.yaml", "epochs=2",
                                  "imgsz=64", "batch=4", "workers=2", f"engine={engine}", "min_nodes=1", "slots=2",
                                  f"checkpoint=s3://{bucket}/ckpt-{job}-{engine}", "save_period_steps=4",
                                  "s3_sse=AES256", timeout=600)
            print(f"  {engine} job: {state} in {time.monotonic() - t0:.1f}s", flush=True)
            if state != "done":
                raise SystemExit(f"job failed under strace; see {log}")
    finally:
        agent.stop()


def summary_calls(path: Path) -> dict[str, tuple[int, int]]:
    """`strace -c -U name,calls,errors` table -> {syscall: (calls, errors)}."""
    out: dict[str, tuple[int, int]] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) in (2, 3) and parts[1].isdigit() and parts[0] not in ("total", "syscall"):
            out[parts[0]] = (int(parts[1]), int(parts[2]) if len(parts) == 3 else 0)
    return out


def file_changes(path: Path) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """-> (written paths by area, failed write attempts 'path errno', devices opened)."""
    written: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    devices: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        call, args, ret, err = m.group(2), m.group(3), m.group(4), m.group(5)
        paths = re.findall(r'"((?:[^"\\]|\\.)*)"', args)
        if not paths:
            continue
        target = paths[-1] if call.startswith(("rename", "link", "symlink")) else paths[0]
        is_open = call.startswith("open") or call == "creat"
        if is_open and target.startswith("/dev/") and not target.startswith("/dev/shm"):
            devices[target] += 1
        if is_open and not any(f in args for f in WRITE_FLAGS) and call != "creat":
            continue
        if ret == "-1":
            if err not in ("ENOENT", "EEXIST"):
                failed[f"{target} {err}"] += 1
            continue
        written[target] += 1
    return written, failed, devices


def area(path: str, sandbox: UnitSandbox) -> str:
    if not path.startswith("/"):  # relative to the unit's WorkingDirectory
        path = os.path.join(sandbox.working_directory, path)
    for d in sandbox.state_dirs:
        if path.startswith(str(d)):
            return "StateDirectory " + path[len(str(d)):].split("/")[1:2][0] if path != str(d) else "StateDirectory"
    for d in sandbox.cache_dirs:
        if path.startswith(str(d)):
            rest = path[len(str(d)):].split("/")
            return "CacheDirectory " + (rest[1] if len(rest) > 1 else "")
    for prefix in ("/tmp/", "/var/tmp/", "/dev/shm/", "/dev/null", "/proc/self/", "/proc/thread-self/"):
        if path.startswith(prefix):
            return prefix.rstrip("/")
    if re.match(r"^/proc/\d+/", path):
        return "/proc/<pid>"
    return "OTHER " + path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the findings here")
    args = ap.parse_args()
    why = UnitSandbox.available()
    if why is not None or shutil.which("strace") is None:
        raise SystemExit(f"cannot run: {why or 'strace not installed'}")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    work = Path(tempfile.mkdtemp(prefix="unit-trace-", dir=REPO / ".work" if (REPO / ".work").exists() else None))
    allowed = set(expand_syscall_filter([v for k, v in _unit_settings() if k == "SystemCallFilter"]))
    with EtcdCluster(size=1) as etcd, S3Server() as s3:
        os.environ.update(s3.env())
        import boto3

        boto3.client("s3").create_bucket(Bucket="unit-trace")
        ds = write_dataset(work / "shapes", SynthSpec(train=32, val=8, imgsz=64)).parent
        upload_dataset(ds, "s3://unit-trace/shapes", {})
        results = {}
        for name, strace_args in (("summary", ["-c", "-U", "name,calls,errors"]),
                                  ("files", ["-e", "trace=" + ",".join(FILE_CALLS), "-e", "signal=none"])):
            sandbox = UnitSandbox(UNIT, work / f"sandbox-{name}", seccomp=False)
            out = sandbox.cache_dirs[0] / f"strace-{name}.txt"
            print(f"traced run ({name}), service uid {sandbox.uid}:", flush=True)
            run_traced(sandbox, etcd, s3, "unit-trace", [*strace_args, "-o", str(out)], f"trace-{name}",
                       work / f"agent-{name}.log")
            results[name] = (sandbox, out)
    sandbox, summary = results["summary"]
    calls = summary_calls(summary)
    outside = {c: v for c, v in calls.items() if c not in allowed}
    fsandbox, files = results["files"]
    written, failed, devices = file_changes(files)
    areas = Counter()
    for p, n in written.items():
        areas[area(p, fsandbox)] += n
    print(f"\nsystem calls used: {len(calls)} distinct, {sum(c for c, _ in calls.values())} calls")
    print(f"allowed by the unit's SystemCallFilter: {len(allowed)}")
    print("used but not allowed (calls, errors):", ", ".join(f"{c} ({n}, {e})" for c, (n, e) in sorted(outside.items()))
          or "none")
    print("\npaths written, by area (count of file-changing calls):")
    for a, n in sorted(areas.items()):
        print(f"  {n:7d}  {a}")
    print("\nwrite attempts that failed (other than ENOENT/EEXIST):", ", ".join(sorted(failed)) or "none")
    print("devices opened:", ", ".join(sorted(devices)) or "none")
    if args.json:
        args.json.write_text(json.dumps({"syscalls": {c: list(v) for c, v in sorted(calls.items())},
                                         "not_allowed": sorted(outside), "allowed_count": len(allowed),
                                         "written_areas": dict(areas), "failed_writes": dict(failed),
                                         "devices": dict(devices)}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


def _unit_settings() -> list[tuple[str, str]]:
    from tests.support.unit_sandbox import UnitFile

    return UnitFile.parse(UNIT).settings


if __name__ == "__main__":
    main()
