#!/usr/bin/env bash
# Node bootstrap, run once by cloud-init on every GPU VM (AWS and GCP):
#   1. fetch the etcd CA, client certificate, client key and etcd password from the cloud's
#      secret store into /etc/elasticyolo (root-only; systemd hands copies to the agent as
#      credentials), without ever printing them;
#   2. describe the VM it runs on to the agent (address, instance type, zone, spot or not) in agent.env;
#   3. install elasticyolo from its wheel into /opt/elasticyolo/.venv (below: no repository, no
#      test tools; the [horovod] extra only when this node's jobs use engine=horovod);
#   4. create the NVIDIA device nodes (the sandboxed unit cannot run the setuid nvidia-modprobe);
#   5. install and start the hardened unit (shipped in the wheel).
#
#   bootstrap.sh aws|gcp          (settings in /etc/elasticyolo/bootstrap.env, from cloud-init)
#   bootstrap.sh install WHEEL    step 3 alone (a baked image, or a machine without cloud-init)
#
# Step 3: WHEEL is a path or an s3://, gs:// or https:// URI of elasticyolo-<version>-*.whl.
# The venv sees the image's Python packages (--system-site-packages): a torch the image already
# has, inside the [train] extra's range, is used as it is; pip installs torch only when it is
# missing or outside the range. Settings (environment; bootstrap.env for cloud-init):
#   ELASTICYOLO_VENV     the venv (/opt/elasticyolo/.venv: the unit's ExecStart)
#   ELASTICYOLO_PYTHON   the image's interpreter the venv is made from (/usr/bin/python3)
#   ELASTICYOLO_EXTRAS   the wheel's extras (train; empty: the agent and the CLI only)
#   ELASTICYOLO_ENGINES  the engines this node's jobs use, comma-separated (torch); horovod adds
#                        the [horovod] extra, its Horovod from HOROVOD_WHEEL (a path or URI of a
#                        wheel built for this image's torch and CUDA) when set, else built here from
#                        the patched PyPI sdist (several minutes, compilers and CMake). Without it
#                        the node trains engine=torch jobs and its agent refuses engine=horovod ones.
# The default engine installs from wheels only (pip --only-binary=:all:): nothing compiles.
set -euo pipefail
MODE=${1:?usage: bootstrap.sh aws|gcp|install WHEEL}
VENV=${ELASTICYOLO_VENV:-/opt/elasticyolo/.venv}
log() { printf 'elasticyolo-bootstrap: %s\n' "$*" >&2; }

# ---- step 3: the install ----------------------------------------------------------------------
fetch() {  # SOURCE DIR: copy a path or URI into DIR under its own name (pip reads a wheel's tags from it)
  local dest=$2/${1##*/}
  case "$1" in
    s3://*)
      if command -v aws >/dev/null; then
        aws s3 cp --only-show-errors "$1" "$dest"
      else  # the image's Python with boto3 (the AWS CLI is not on every image)
        "$PYTHON" - "$1" "$dest" <<'EOF'
import sys, boto3
bucket, _, key = sys.argv[1][len("s3://"):].partition("/")
boto3.client("s3").download_file(bucket, key, sys.argv[2])
EOF
      fi ;;
    gs://*) gcloud storage cp "$1" "$dest" ;;
    http://*|https://*) curl -fsSL --retry 3 -o "$dest" "$1" ;;
    *) cp -- "$1" "$dest" ;;
  esac
  printf '%s\n' "$dest"
}

apt_install() {  # PACKAGE...: what the image lacks, from its distribution
  command -v apt-get >/dev/null || { log "missing $*; install them (no apt-get here)"; exit 1; }
  log "installing $*"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

install_horovod() {  # PY WORKDIR SPEC: the [horovod] extra of SPEC (the wheel and its extras)
  local py=$1 work=$2 spec=$3 wheel
  if [ -n "${HOROVOD_WHEEL:-}" ]; then
    wheel=$(fetch "$HOROVOD_WHEEL" "$work")
  else
    log "building Horovod from the patched PyPI sdist (no HOROVOD_WHEEL; several minutes)"
    local need=()
    command -v c++ >/dev/null || need+=(build-essential)
    command -v cmake >/dev/null || need+=(cmake)
    "$py" -c 'import os, sysconfig as s; raise SystemExit(not os.path.exists(s.get_path("include") + "/Python.h"))' ||
      need+=(python3-dev)
    [ ${#need[@]} -eq 0 ] || apt_install "${need[@]}"
    if command -v nvidia-smi >/dev/null && [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then
      export CUDA_HOME=/usr/local/cuda  # build_horovod.sh builds NCCL operations when it is set
    fi
    PATH="$VENV/bin:$PATH" bash "$VENV/share/elasticyolo/build_horovod.sh" "$py" "$work/horovod"
    wheel=$(ls "$work"/horovod/horovod-*.whl)
  fi
  # The extra pins Horovod's version; pip takes it from this wheel (PyPI has only the sdist).
  "$py" -m pip install --quiet --only-binary=:all: --find-links "${wheel%/*}" "$spec"
  "$VENV/bin/horovodrun" --check-build | grep -q '\[X\] PyTorch' || { log "Horovod was built without PyTorch"; exit 1; }
}

install_node() {  # WHEEL
  local work wheel spec py
  PYTHON=${ELASTICYOLO_PYTHON:-/usr/bin/python3}
  local extras=${ELASTICYOLO_EXTRAS-train} engines=${ELASTICYOLO_ENGINES:-torch}
  work=$(mktemp -d)
  # shellcheck disable=SC2064  # expand now: $work is local
  trap "rm -rf '$work'" EXIT
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv
    "$PYTHON" -m venv --system-site-packages "$VENV"
  fi
  py=$VENV/bin/python
  wheel=$(fetch "$1" "$work")
  spec=$wheel
  [ -z "$extras" ] || spec="${wheel}[$extras]"
  log "installing ${wheel##*/}${extras:+ [$extras]} into $VENV"
  "$py" -m pip install --quiet --only-binary=:all: "$spec"
  case ",$engines," in
    *,horovod,*) install_horovod "$py" "$work" "${wheel}[${extras:+$extras,}horovod]" ;;
  esac
  "$VENV/bin/elasticyolo" --version >&2
  if [ -n "$extras" ]; then
    "$py" -c 'import torch, torchvision, ultralytics; print(f"torch {torch.__version__} ({torch.__file__})")' >&2
  fi
  chmod -R a+rX "$VENV"  # the agent runs as a dynamic user: code readable, not writable
}

if [ "$MODE" = install ]; then
  install_node "${2:?usage: bootstrap.sh install WHEEL}"
  exit 0
fi

CLOUD=$MODE
case "$CLOUD" in aws|gcp) ;; *) log "unknown mode $MODE (aws, gcp or install)"; exit 2 ;; esac
set -a  # exported: AWS_DEFAULT_REGION for the AWS CLI
# shellcheck source=/dev/null
. /etc/elasticyolo/bootstrap.env
set +a
: "${ELASTICYOLO_WHEEL:?}" "${SECRETS_PREFIX:?}"
umask 077
PKI=/etc/elasticyolo/pki
install -d -m 0755 /etc/elasticyolo
install -d -m 0755 "$PKI"

# ---- 1. secrets: written by the secret store's CLI straight to files (never argv, never stdout)
fetch_secret() {  # NAME FILE MODE
  local tmp
  tmp=$(mktemp "$2.XXXXXX")
  case "$CLOUD" in
    aws) aws ssm get-parameter --with-decryption --name "$SECRETS_PREFIX/$1" --query Parameter.Value \
           --output text >"$tmp" ;;
    gcp) gcloud secrets versions access latest --secret "$SECRETS_PREFIX-$1" --out-file "$tmp" ;;
  esac
  [ -s "$tmp" ] || { log "secret $1 is empty"; rm -f "$tmp"; exit 1; }
  chmod "$3" "$tmp"
  mv "$tmp" "$2"
}
fetch_secret etcd-ca.pem "$PKI/ca.pem" 0644
fetch_secret client-agent.pem "$PKI/client-agent.pem" 0644
fetch_secret client-agent-key.pem "$PKI/client-agent-key.pem" 0600
fetch_secret etcd-password /etc/elasticyolo/etcd-password 0600
if [ "$CLOUD" = gcp ]; then  # the S3-compatible (HMAC) credentials for Cloud Storage
  fetch_secret gcs-hmac /etc/elasticyolo/gcs-hmac 0600
fi
log "secrets installed"

# ---- 2. the VM it runs on, from the metadata service
case "$CLOUD" in
  aws)
    token=$(curl -fsS -X PUT http://169.254.169.254/latest/api/token -H "X-aws-ec2-metadata-token-ttl-seconds: 300")
    md() { curl -fsS -H "X-aws-ec2-metadata-token: $token" "http://169.254.169.254/latest/meta-data/$1"; }
    addr=$(md local-ipv4); itype=$(md instance-type); zone=$(md placement/availability-zone)
    lifecycle=$(md instance-life-cycle || echo on-demand)
    preemptible=false; [ "$lifecycle" = spot ] && preemptible=true ;;
  gcp)
    md() { curl -fsS -H "Metadata-Flavor: Google" "http://metadata.google.internal/computeMetadata/v1/instance/$1"; }
    addr=$(md network-interfaces/0/ip); itype=$(md machine-type); itype=${itype##*/}
    zone=$(md zone); zone=${zone##*/}
    model=$(md scheduling/provisioning-model || echo STANDARD)
    preemptible=false; [ "$model" = SPOT ] && preemptible=true ;;
esac
cat >/etc/elasticyolo/agent.env <<ENV
ELASTICYOLO_ADDR=$addr
ELASTICYOLO_INSTANCE_TYPE=$itype
ELASTICYOLO_ZONE=$zone
ELASTICYOLO_PREEMPTIBLE=$preemptible
${EXTRA_AGENT_ENV:-}
ENV
chmod 0644 /etc/elasticyolo/agent.env

# ---- 3. install (a baked image skips this: the venv has the agent)
if [ ! -x "$VENV/bin/elasticyolo" ]; then
  (install_node "$ELASTICYOLO_WHEEL")
fi

# ---- 4. GPU device nodes (nvidia-modprobe is setuid: not allowed inside the unit)
if command -v nvidia-modprobe >/dev/null; then
  nvidia-modprobe -u -c=0 || true
  nvidia-smi -pm 1 >/dev/null 2>&1 || true
fi

# ---- 5. the unit and this cloud's drop-ins, as the installed wheel ships them
share=$VENV/share/elasticyolo
install -m 0644 "$share/systemd/elasticyolo-agent.service" /etc/systemd/system/elasticyolo-agent.service
if [ -d "$share/$CLOUD/elasticyolo-agent.service.d" ]; then
  install -d /etc/systemd/system/elasticyolo-agent.service.d
  install -m 0644 "$share/$CLOUD/elasticyolo-agent.service.d/"*.conf /etc/systemd/system/elasticyolo-agent.service.d/
fi
systemctl daemon-reload
systemctl enable --now elasticyolo-agent
log "elasticyolo-agent started ($itype in $zone, preemptible=$preemptible)"
