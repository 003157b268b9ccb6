#!/usr/bin/env bash
# Node bootstrap, run once by cloud-init on every GPU VM (AWS and GCP):
#   1. fetch the etcd CA, client certificate, client key and etcd password from the cloud's
#      secret store into /etc/elasticyolo (root-only; systemd hands copies to the agent as
#      credentials), without ever printing them;
#   2. describe this VM to the agent (address, instance type, zone, spot or not) in agent.env;
#   3. install elasticyolo into /opt/elasticyolo (scripts/setup.sh: venv, torch, Ultralytics,
#      Horovod built with NCCL on GPU VMs; the Horovod wheel is shared through the bucket);
#   4. create the NVIDIA device nodes (the sandboxed unit cannot run the setuid nvidia-modprobe);
#   5. install and start the hardened unit.
#
#   bootstrap.sh aws|gcp          (settings in /etc/elasticyolo/bootstrap.env, from cloud-init)
set -euo pipefail
CLOUD=${1:?usage: bootstrap.sh aws|gcp}
# shellcheck source=/dev/null
. /etc/elasticyolo/bootstrap.env
: "${ELASTICYOLO_REPO:?}" "${ELASTICYOLO_REF:?}" "${SECRETS_PREFIX:?}" "${WHEEL_CACHE_URI:?}"
umask 077
PKI=/etc/elasticyolo/pki
install -d -m 0755 /etc/elasticyolo
install -d -m 0755 "$PKI"
log() { printf 'elasticyolo-bootstrap: %s\n' "$*" >&2; }

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

# ---- 2. this VM, from the metadata service
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

# ---- 3. install (a baked image skips this: /opt/elasticyolo/.venv exists)
if [ ! -x /opt/elasticyolo/.venv/bin/elasticyolo ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends git python3-venv python3-dev build-essential cmake curl >/dev/null
  if [ ! -d /opt/elasticyolo/.git ]; then
    git clone --quiet --depth 1 --branch "$ELASTICYOLO_REF" "$ELASTICYOLO_REPO" /opt/elasticyolo
  fi
  wheels=/var/cache/elasticyolo-wheels
  mkdir -p "$wheels"
  case "$CLOUD" in  # a Horovod wheel built once (by the first VM, or the operator) is reused
    aws) aws s3 sync --quiet "$WHEEL_CACHE_URI" "$wheels" || true ;;
    gcp) gcloud storage rsync --quiet "$WHEEL_CACHE_URI" "$wheels" || true ;;
  esac
  if command -v nvidia-smi >/dev/null && [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then
    export CUDA_HOME=/usr/local/cuda
  fi
  (cd /opt/elasticyolo && ELASTICYOLO_WHEEL_CACHE=$wheels bash scripts/setup.sh)
  chmod -R a+rX /opt/elasticyolo  # the agent runs as a dynamic user: code readable, not writable
fi

# ---- 4. GPU device nodes (nvidia-modprobe is setuid: not allowed inside the unit)
if command -v nvidia-modprobe >/dev/null; then
  nvidia-modprobe -u -c=0 || true
  nvidia-smi -pm 1 >/dev/null 2>&1 || true
fi

# ---- 5. the unit
install -m 0644 /opt/elasticyolo/systemd/elasticyolo-agent.service /etc/systemd/system/elasticyolo-agent.service
if [ -d "/opt/elasticyolo/deploy/$CLOUD/elasticyolo-agent.service.d" ]; then
  install -d /etc/systemd/system/elasticyolo-agent.service.d
  install -m 0644 "/opt/elasticyolo/deploy/$CLOUD/elasticyolo-agent.service.d/"*.conf \
    /etc/systemd/system/elasticyolo-agent.service.d/
fi
systemctl daemon-reload
systemctl enable --now elasticyolo-agent
log "elasticyolo-agent started ($itype in $zone, preemptible=$preemptible)"
