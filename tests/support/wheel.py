"""The elasticyolo wheel of this checkout and what a node install must not contain, for the wheel
tests and bench/node_install.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BOOTSTRAP = REPO / "deploy" / "common" / "bootstrap.sh"
# The [test] extra and the developer's tools: never on a node.
TEST_PACKAGES = frozenset({"pytest", "pytest-timeout", "moto", "hypothesis", "coverage", "pytest-cov", "flask",
                           "werkzeug", "docker", "cfn-lint", "responses"})


def system_python() -> str:
    """The interpreter a node's venv is made from: the system's (as on a GPU image), else ours."""
    system = "/usr/bin/python3"
    if os.access(system, os.X_OK) and subprocess.run([system, "-c", "import ensurepip, venv"],
                                                     capture_output=True, timeout=60).returncode == 0:
        return system
    return getattr(sys, "_base_executable", sys.executable)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would make a venv import this checkout instead of its own
    installed package."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, **extra}


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def build_wheel(out: Path, work: Path) -> Path:
    """`pip wheel --no-deps` of this tree: the files git knows of (committed or not, not ignored),
    copied to `work` first so no stale build/ directory leaks into the wheel. Built with this
    environment's setuptools (no isolated build environment to fetch: offline, seconds);
    deploy/common/build-wheel.sh builds with isolation, and tests/test_deploy.py runs that."""
    src = work / "src"
    if (REPO / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                                capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
        for name in filter(None, listed):
            if (REPO / name).is_file():
                (src / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, src / name)
    else:
        shutil.copytree(REPO, src, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".venv", ".work", "build", "*.egg-info", "runs"))
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"pip wheel failed: {r.stderr.strip()[-2000:]}")
    (built,) = out.glob("elasticyolo-*.whl")
    return built


def installed_packages(python: Path, env: dict[str, str]) -> set[str]:
    """What pip installed into the environment of `python` itself (not what it sees from the
    image's site-packages)."""
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env=env,
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json", "--path", site], env=env,
                            capture_output=True, text=True, check=True, timeout=120).stdout
    return {canonical(p["name"]) for p in json.loads(listed)}
