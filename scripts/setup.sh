#!/usr/bin/env bash
# Install everything elasticyolo needs on a fresh Debian machine. Idempotent: re-running only
# does what is missing. Called by `make setup` (and by `make test`/`make demo` when stale).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
HOROVOD_VERSION=0.28.1
WHEEL_CACHE=${ELASTICYOLO_WHEEL_CACHE:-$HOME/.cache/elasticyolo/wheels}
log() { printf '[setup] %s\n' "$*" >&2; }

# 1. Debian packages: etcd (server + etcdctl; the package starts no service in a container: tests
#    start their own server on 127.0.0.1) and stress-ng (a CPU hog beside the chaos tests must not
#    cause false evictions: run `stress-ng --cpu 2` next to `make test-slow`).
if ! command -v etcd >/dev/null 2>&1 || ! command -v etcdctl >/dev/null 2>&1 || ! command -v stress-ng >/dev/null 2>&1; then
  log "installing etcd-server etcd-client stress-ng"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server etcd-client stress-ng >/dev/null
fi

# 1b. Tools the deployment tests use: systemd-analyze (unit verify/security), python3-seccomp
#     (the unit's syscall filter, applied without systemd), shellcheck and cloud-init (deploy/
#     scripts and user-data), strace (bench/unit_trace.py).
missing=()
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
/usr/bin/python3 -c "import seccomp" 2>/dev/null || missing+=(python3-seccomp)
command -v shellcheck >/dev/null 2>&1 || missing+=(shellcheck)
command -v cloud-init >/dev/null 2>&1 || missing+=(cloud-init)
command -v strace >/dev/null 2>&1 || missing+=(strace)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. The venv with torch first (Horovod's build needs it).
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$PY" -c "import torch, torchvision, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  log "installing torch $TORCH_VERSION torchvision $TORCHVISION_VERSION"
  "$PY" -m pip install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi
log "installing elasticyolo and its dependencies"
"$PY" -m pip install -q -e ".[train,test,ray]"

# 3. Horovod (the [horovod] extra; the tests run both engines): build once per (horovod, torch,
#    cpu|gpu), cache the wheel, reuse it. pip takes the extra's Horovod from that wheel, never from
#    PyPI's sdist (it does not build against torch 2.14 unpatched).
flavor=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ -n "${CUDA_HOME:-}" ]; then flavor=nccl; fi
# The build number counts our patches (scripts/build_horovod.sh): a new one rebuilds and reinstalls.
HOROVOD_BUILD=4
key="horovod-$HOROVOD_VERSION-b$HOROVOD_BUILD-torch-$TORCH_VERSION-$flavor"
if ! "$PY" -c "import horovod.torch" 2>/dev/null || [ ! -e "$VENV/.$key" ]; then
  if ! ls "$WHEEL_CACHE/$key"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION ($flavor) from the PyPI sdist; cached in $WHEEL_CACHE/$key (several minutes, once)"
    "$PY" -m pip install -q cloudpickle psutil pyyaml cffi packaging
    # Horovod's bundled gloo needs CMake < 4 (cmake_minimum_required 2.8); Debian 12 ships 3.25.
    command -v cmake >/dev/null 2>&1 || "$PY" -m pip install -q 'cmake>=3.18,<4'
    PATH="$VENV/bin:$PATH" bash scripts/build_horovod.sh "$PY" "$WHEEL_CACHE/$key.tmp"
    rm -rf "${WHEEL_CACHE:?}/$key"; mv "$WHEEL_CACHE/$key.tmp" "$WHEEL_CACHE/$key"
  fi
  log "installing Horovod from $WHEEL_CACHE/$key"
  "$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL_CACHE/$key"/horovod-*.whl
  "$PY" -m pip install -q --only-binary=horovod --find-links "$WHEEL_CACHE/$key" -e ".[train,test,ray,horovod]"
  touch "$VENV/.$key"
fi
build_info=$("$VENV/bin/horovodrun" --check-build)
grep -q '\[X\] PyTorch' <<<"$build_info" || { log "horovodrun --check-build lacks PyTorch"; exit 1; }
grep -q '\[X\] Gloo' <<<"$build_info" || { log "horovodrun --check-build lacks Gloo"; exit 1; }

# 4. Stamp: Makefile compares it with the inputs of this script to decide staleness.
cat pyproject.toml scripts/setup.sh scripts/build_horovod.sh | sha256sum | cut -d' ' -f1 > "$VENV/.elasticyolo-setup"
log "done"
