#!/usr/bin/env bash
# elasticyolo on GCP, step by step (docs/deploy.md explains each step and its order):
#
#   deploy/gcp/deploy.sh CONFIG wheel      build the elasticyolo wheel, upload it to ELASTICYOLO_WHEEL
#   deploy/gcp/deploy.sh CONFIG pki        certificates for etcd members and clients (openssl)
#   deploy/gcp/deploy.sh CONFIG sa         node service account, custom roles, prefix-scoped bucket IAM
#   deploy/gcp/deploy.sh CONFIG secrets    etcd password, client TLS files, HMAC key -> Secret Manager
#   deploy/gcp/deploy.sh CONFIG template   instance template: Spot VMs, GPU, rendered cloud-init
#   deploy/gcp/deploy.sh CONFIG mig        regional managed instance group with instance flexibility
#   deploy/gcp/deploy.sh CONFIG render DIR only write the rendered files to DIR (review, tests)
#
# The etcd members (3 small standard VMs) are set up with deploy/etcd/install-member.sh and
# deploy/etcd/setup-auth.sh between `pki` and `secrets`. Secrets go through files (--data-file),
# never command lines.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
[ $# -ge 2 ] || { sed -n '2,14p' "$0" >&2; exit 2; }
CONFIG=$1 STEP=$2
# shellcheck source-path=SCRIPTDIR source=cluster.env.example
. "$CONFIG"
PKI=${PKI:-$ROOT/.pki/$CLUSTER}
SA=elasticyolo-$CLUSTER-node@$PROJECT.iam.gserviceaccount.com
VARS=(CLUSTER BUCKET JOB DATA_CACHE_MAX_GB ELASTICYOLO_WHEEL ELASTICYOLO_ENGINES HOROVOD_WHEEL ETCD_ENDPOINTS BOOTSTRAP_SH_B64)
ETCD_ENDPOINTS=$(for m in $ETCD_MEMBERS; do printf 'https://%s:2379,' "${m#*=}"; done)
ETCD_ENDPOINTS=${ETCD_ENDPOINTS%,}
export BOOTSTRAP_SH_B64
BOOTSTRAP_SH_B64=$(gzip -9n <"$ROOT/deploy/common/bootstrap.sh" | base64 -w0)  # small user data
export "${VARS[@]}"

render() {  # TEMPLATE -> stdout, replacing only our ${VARIABLES}
  # shellcheck disable=SC2016  # the literal ${NAME} list is envsubst's argument
  envsubst "$(printf '${%s} ' "${VARS[@]}")" <"$1"
}
# shellcheck source-path=SCRIPTDIR source=../common/build-wheel.sh
. "$ROOT/deploy/common/build-wheel.sh"
gcloud() { command gcloud --project "$PROJECT" --quiet "$@"; }

# An IAM condition scoping a bucket role to one prefix: objects under it, and listings of it.
prefix_condition() {  # PREFIX TITLE
  printf 'expression=resource.name.startsWith("projects/_/buckets/%s/objects/%s/") || api.getAttribute("storage.googleapis.com/objectListPrefix", "").startsWith("%s/"),title=%s' \
    "$BUCKET" "$1" "$1" "$2"
}

case "$STEP" in
  wheel)
    built=$(build_wheel)
    gcloud storage cp "$built" "$ELASTICYOLO_WHEEL"
    ;;
  pki)
    members=()
    for m in $ETCD_MEMBERS; do members+=("${m%%=*}=${m#*=}"); done
    bash "$ROOT/deploy/etcd/make-certs.sh" "$PKI" "${members[@]}"
    [ -s "$PKI/etcd-password" ] || (umask 077; openssl rand -base64 32 | tr -d '\n' >"$PKI/etcd-password")
    ;;
  sa)
    gcloud iam service-accounts create "elasticyolo-$CLUSTER-node" --display-name "elasticyolo $CLUSTER nodes"
    gcloud iam roles create elasticyolo_dataset_reader --file "$HERE/role-dataset-reader.yaml" || true
    gcloud iam roles create elasticyolo_checkpoint_writer --file "$HERE/role-checkpoint-writer.yaml" || true
    gcloud storage buckets add-iam-policy-binding "gs://$BUCKET" --member "serviceAccount:$SA" \
      --role "projects/$PROJECT/roles/elasticyolo_dataset_reader" --condition "$(prefix_condition "$DATASET_PREFIX" datasets)"
    gcloud storage buckets add-iam-policy-binding "gs://$BUCKET" --member "serviceAccount:$SA" \
      --role "projects/$PROJECT/roles/elasticyolo_checkpoint_writer" \
      --condition "$(prefix_condition "$CHECKPOINT_PREFIX" checkpoints)"
    gcloud storage buckets add-iam-policy-binding "gs://$BUCKET" --member "serviceAccount:$SA" \
      --role roles/storage.objectViewer --condition "$(prefix_condition wheels wheels)"
    ;;
  secrets)
    umask 077
    hmac=$(mktemp)
    trap 'rm -f "$hmac"' EXIT
    # The service account's HMAC key for the S3-compatible API, straight into a credentials file.
    gcloud storage hmac create "$SA" --format 'value[separator=" "](metadata.accessId,secret)' |
      awk '{print "[default]\naws_access_key_id = " $1 "\naws_secret_access_key = " $2}' >"$hmac"
    for pair in etcd-ca.pem:"$PKI/ca.pem" client-agent.pem:"$PKI/client-agent.pem" \
                client-agent-key.pem:"$PKI/client-agent-key.pem" etcd-password:"$PKI/etcd-password" gcs-hmac:"$hmac"; do
      name=elasticyolo-$CLUSTER-${pair%%:*}
      gcloud secrets create "$name" --replication-policy automatic 2>/dev/null || true
      gcloud secrets versions add "$name" --data-file "${pair#*:}" >/dev/null
      gcloud secrets add-iam-policy-binding "$name" --member "serviceAccount:$SA" \
        --role roles/secretmanager.secretAccessor >/dev/null
    done
    ;;
  template)
    data=$(mktemp)
    render "$HERE/cloud-init.yaml" >"$data"
    gcloud compute instance-templates create "elasticyolo-$CLUSTER" --region "$REGION" \
      --machine-type "$MACHINE_TYPE" --accelerator "$ACCELERATOR" \
      --provisioning-model SPOT --instance-termination-action DELETE --maintenance-policy TERMINATE \
      --image-project "$IMAGE_PROJECT" --image-family "$IMAGE_FAMILY" --boot-disk-size 300GB --boot-disk-type pd-ssd \
      --service-account "$SA" --scopes cloud-platform --network "$NETWORK" --subnet "$SUBNET" --no-address \
      --shielded-secure-boot --shielded-vtpm --shielded-integrity-monitoring \
      --metadata enable-oslogin=TRUE,block-project-ssh-keys=TRUE --metadata-from-file "user-data=$data" \
      --labels "elasticyolo-cluster=$CLUSTER"
    rm -f "$data"
    ;;
  mig)
    gcloud compute instance-groups managed create "elasticyolo-$CLUSTER" --region "$REGION" \
      --template "elasticyolo-$CLUSTER" --size "$SIZE" --zones "$ZONES" \
      --target-distribution-shape ANY_SINGLE_ZONE --instance-redistribution-type NONE \
      --instance-selection-machine-types "$MACHINE_TYPES"
    ;;
  render)
    out=${3:?render needs an output directory}
    mkdir -p "$out"
    render "$HERE/cloud-init.yaml" >"$out/cloud-init.yaml"
    ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
