"""Node install: seconds and bytes from an empty venv to a node that can train.

Both cases run deploy/common/bootstrap.sh's install step (what cloud-init runs on a VM) with the
wheel of this tree and its [train] extra, engine torch:
  * image: the image's Python already has torch (a GPU image). Stood in for by a Python
    installation made here from this interpreter (binary copied, standard library linked, its
    own site-packages) into which torch/torchvision are installed first, outside the timing;
    the node venv is made from it with --system-site-packages.
  * download: the system's Python without torch (a base GPU image): pip downloads torch,
    torchvision and Ultralytics.
Then, in each node venv: import elasticyolo, torch and ultralytics, and train one epoch of
yolov8n on a generated dataset with the venv's `elasticyolo train` (the node can train).

pip runs as on a cloud VM: the package index only (this machine's pip settings, such as a local
mirror, are left out), without a cache. Printed per case: install seconds, the venv's bytes and
what pip downloaded, where torch came from, whether anything compiled (pip's output; bootstrap
installs with --only-binary=:all:, so a package without a wheel fails instead of compiling), and
the test packages installed (none is the target). For comparison, the developer's venv this runs
from (`make setup`: pinned torch, the test tools, Horovod built from source).

    .venv/bin/python bench/node_install.py [--case image|download|both] [--work DIR] [--keep]
                                           [--image-torch 'torch==2.13.0 torchvision==0.28.0']

Seconds depend on the network (download) and on the machine's load; bytes do not.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.wheel import (BOOTSTRAP, TEST_PACKAGES, build_wheel, clean_env,  # noqa: E402
                                       installed_packages, system_python)

SIZE = re.compile(r"Downloading \S+ \(([\d.]+) (kB|MB|GB)\)")
UNIT = {"kB": 1e3, "MB": 1e6, "GB": 1e9}
COMPILE = re.compile(r"Building wheels? for|Running setup\.py|Getting requirements to build wheel|"
                     r"Preparing metadata \(")


@dataclass
class Result:
    case: str
    install_s: float = 0.0
    venv_bytes: int = 0
    downloaded_bytes: int = 0
    torch: str = ""
    compiled: list[str] = field(default_factory=list)
    test_packages: list[str] = field(default_factory=list)
    train_s: float = 0.0
    trained: bool = False
    note: str = ""


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                total += os.lstat(p).st_size
    return total


def index_only_env(**extra: str) -> dict[str, str]:
    """pip as on a cloud VM: the package index only, none of this machine's pip settings (local
    mirrors, find-links, constraints), so what is fetched is what a node downloads."""
    env = {k: v for k, v in clean_env(**extra).items() if k not in ("PIP_FIND_LINKS", "PIP_INDEX_URL",
                                                                      "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT")}
    return {**env, "PIP_CONFIG_FILE": os.devnull}


def image_python(prefix: Path, packages: list[str]) -> Path:
    """A stand-in for a GPU image's system Python with torch: a Python installation at `prefix`
    (this interpreter's binary, its standard library linked, an own site-packages) with
    `packages` installed into that site-packages."""
    base_exe = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    stdlib = Path(sysconfig.get_path("stdlib"))  # the base installation's, also from a venv
    lib = prefix / "lib" / stdlib.name
    (prefix / "bin").mkdir(parents=True)
    (lib / "site-packages").mkdir(parents=True)
    shutil.copy2(base_exe, prefix / "bin" / base_exe.name)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "dist-packages"):
            (lib / entry.name).symlink_to(entry)
    python = prefix / "bin" / base_exe.name
    env = index_only_env()
    subprocess.run([str(python), "-m", "ensurepip", "--default-pip"], env=env, check=True, capture_output=True,
                   timeout=600)
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], env=env, check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()
    if not site.startswith(str(prefix)):
        raise SystemExit(f"the stand-in image's site-packages is {site}, not under {prefix}: this interpreter "
                         f"({base_exe}) cannot be relocated so")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--only-binary=:all:", *packages], env=env,
                   check=True, timeout=3600)
    return python


def install_node(case: str, wheel: Path, python: str, venv: Path, extra_env: dict[str, str]) -> Result:
    res = Result(case)
    env = index_only_env(ELASTICYOLO_VENV=str(venv), ELASTICYOLO_PYTHON=python, ELASTICYOLO_ENGINES="torch",
                         PIP_VERBOSE="1", **extra_env)  # -v against bootstrap's -q: pip's normal output, to read
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(BOOTSTRAP), "install", str(wheel)], env=env, capture_output=True, text=True,
                       timeout=3600)
    res.install_s = time.monotonic() - t0
    out = r.stdout + r.stderr
    if r.returncode != 0:
        raise SystemExit(f"{case}: bootstrap.sh install failed:\n{out[-4000:]}")
    res.venv_bytes = tree_bytes(venv)
    res.downloaded_bytes = int(sum(float(n) * UNIT[u] for n, u in SIZE.findall(out)))
    res.compiled = sorted({m.group(0) for m in COMPILE.finditer(out)})
    installed = installed_packages(venv / "bin" / "python", clean_env())
    res.test_packages = sorted(installed & TEST_PACKAGES)
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import elasticyolo, torch, ultralytics; print(torch.__version__, torch.__file__)"],
                           env=clean_env(), capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        raise SystemExit(f"{case}: the node venv cannot import its training stack:\n{probe.stderr[-3000:]}")
    version, where = probe.stdout.split()
    res.torch = f"{version} ({'image' if not where.startswith(str(venv)) else 'venv'})"
    return res


def train_one_epoch(res: Result, venv: Path, work: Path) -> None:
    """The venv's own `elasticyolo train`: one epoch of yolov8n on a small generated dataset."""
    env = clean_env(YOLO_CONFIG_DIR=str(work / "ultralytics"), YOLO_OFFLINE="1", MPLCONFIGDIR=str(work / "mpl"),
                    OMP_NUM_THREADS="2")
    cli = str(venv / "bin" / "elasticyolo")
    subprocess.run([cli, "data", "synth", "--out", str(work / "shapes"), "--train", "16", "--val", "4",
                    "--imgsz", "64"], env=env, check=True, capture_output=True, timeout=300, cwd=work)
    t0 = time.monotonic()
    r = subprocess.run([cli, "train", "model=yolov8n.yaml", f"data={work}/shapes/data.yaml", "epochs=1", "imgsz=64",
                        "batch=8", "workers=0"], env=env, capture_output=True, text=True,
                       timeout=1800, cwd=work)
    res.train_s = time.monotonic() - t0
    res.trained = r.returncode == 0
    if not res.trained:
        res.note = (r.stderr.strip().splitlines() or ["?"])[-1]


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=["image", "download", "both"], default="both")
    ap.add_argument("--image-torch", default="torch==2.13.0 torchvision==0.28.0",
                    help="what the stand-in image has (inside the [train] range)")
    ap.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="node-install-"))
    work.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    try:
        wheel = build_wheel(work / "dist", work / "build")
        print(f"wheel: {wheel.name} ({wheel.stat().st_size / 1e3:.0f} kB)", flush=True)
        if args.case in ("image", "both"):
            t0 = time.monotonic()
            python = image_python(work / "image", args.image_torch.split())
            print(f"stand-in image: {work / 'image'} with {args.image_torch} "
                  f"({gb(tree_bytes(work / 'image'))}, made in {time.monotonic() - t0:.0f} s, not counted)", flush=True)
            res = install_node("image", wheel, str(python), work / "node-image", {"PIP_NO_CACHE_DIR": "1"})
            train_one_epoch(res, work / "node-image", _mkdir(work / "train-image"))
            results.append(res)
        if args.case in ("download", "both"):
            res = install_node("download", wheel, system_python(), work / "node-download", {"PIP_NO_CACHE_DIR": "1"})
            train_one_epoch(res, work / "node-download", _mkdir(work / "train-download"))
            results.append(res)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"{'case':<10} {'install':>9} {'venv':>9} {'downloaded':>11}  {'torch':<22} {'compiled':<9} "
          f"{'test pkgs':<10} train 1 epoch")
    for r in results:
        print(f"{r.case:<10} {r.install_s:>8.0f}s {gb(r.venv_bytes):>9} {gb(r.downloaded_bytes):>11}  {r.torch:<22} "
              f"{('yes: ' + ', '.join(r.compiled)) if r.compiled else 'no':<9} "
              f"{', '.join(r.test_packages) or 'none':<10} "
              f"{'ok' if r.trained else 'FAILED: ' + r.note} ({r.train_s:.0f} s)")
    dev = Path(sys.prefix)
    if dev != Path(sys.base_prefix):
        installed = installed_packages(Path(sys.executable), clean_env())
        print(f"\nfor comparison, the developer's venv this ran from ({dev}, `make setup`): "
              f"{gb(tree_bytes(dev))}, test packages: {', '.join(sorted(installed & TEST_PACKAGES)) or 'none'}"
              f"{', horovod (built from source)' if 'horovod' in installed else ''}")
    for r in results:
        if r.compiled or r.test_packages or not r.trained:
            sys.exit(1)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


if __name__ == "__main__":
    main()
