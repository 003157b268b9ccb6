#!/usr/bin/env bash
# elasticyolo on AWS, step by step (docs/deploy.md explains each step and its order):
#
#   deploy/aws/deploy.sh CONFIG wheel        build the elasticyolo wheel, upload it to ELASTICYOLO_WHEEL
#   deploy/aws/deploy.sh CONFIG pki          certificates for etcd members and clients (openssl)
#   deploy/aws/deploy.sh CONFIG secrets      the etcd password and client TLS files -> SSM (SecureString)
#   deploy/aws/deploy.sh CONFIG bucket       encryption by default, no public access, abort stale uploads
#   deploy/aws/deploy.sh CONFIG iam          node role + instance profile with deploy/aws/iam-policy.json
#   deploy/aws/deploy.sh CONFIG template     launch template with the rendered cloud-init user data
#   deploy/aws/deploy.sh CONFIG asg          Auto Scaling group: mixed GPU types, spot capacity-optimized
#   deploy/aws/deploy.sh CONFIG render DIR   only write the rendered files to DIR (review, tests)
#
# The etcd members themselves (3 small on-demand VMs) are set up with deploy/etcd/install-member.sh
# and deploy/etcd/setup-auth.sh between `pki` and `secrets`. Secrets never appear on a command line:
# the AWS CLI reads them from files (file://).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
[ $# -ge 2 ] || { sed -n '2,15p' "$0" >&2; exit 2; }
CONFIG=$1 STEP=$2
# shellcheck source-path=SCRIPTDIR source=cluster.env.example
. "$CONFIG"
PKI=${PKI:-$ROOT/.pki/$CLUSTER}
VARS=(CLUSTER REGION ACCOUNT_ID BUCKET DATASET_PREFIX CHECKPOINT_PREFIX KMS_KEY_ARN JOB DATA_CACHE_MAX_GB AMI_ID
      NODE_SECURITY_GROUP ELASTICYOLO_WHEEL ELASTICYOLO_ENGINES HOROVOD_WHEEL ETCD_ENDPOINTS BOOTSTRAP_SH_B64 USER_DATA_B64 SUBNET_IDS)
ETCD_ENDPOINTS=$(for m in $ETCD_MEMBERS; do printf 'https://%s:2379,' "${m#*=}"; done)
ETCD_ENDPOINTS=${ETCD_ENDPOINTS%,}
export BOOTSTRAP_SH_B64
BOOTSTRAP_SH_B64=$(gzip -9n <"$ROOT/deploy/common/bootstrap.sh" | base64 -w0)  # user data: AWS takes 16 KB
export "${VARS[@]}"

render() {  # TEMPLATE -> stdout, replacing only our ${VARIABLES} (never "$Latest" and friends)
  # shellcheck disable=SC2016  # the literal ${NAME} list is envsubst's argument
  envsubst "$(printf '${%s} ' "${VARS[@]}")" <"$1"
}

USER_DATA_B64=$(render "$HERE/cloud-init.yaml" | base64 -w0)
export USER_DATA_B64
# shellcheck source-path=SCRIPTDIR source=../common/build-wheel.sh
. "$ROOT/deploy/common/build-wheel.sh"
aws() { command aws --region "$REGION" "$@"; }

case "$STEP" in
  wheel)
    built=$(build_wheel)
    aws s3 cp --only-show-errors "$built" "$ELASTICYOLO_WHEEL"
    ;;
  pki)
    members=()
    for m in $ETCD_MEMBERS; do members+=("${m%%=*}=${m#*=}"); done
    bash "$ROOT/deploy/etcd/make-certs.sh" "$PKI" "${members[@]}"
    [ -s "$PKI/etcd-password" ] || (umask 077; openssl rand -base64 32 | tr -d '\n' >"$PKI/etcd-password")
    echo "next: install the members (deploy/etcd/install-member.sh), then deploy/etcd/setup-auth.sh with $PKI/etcd-password"
    ;;
  secrets)
    for name in etcd-ca.pem:ca.pem client-agent.pem:client-agent.pem client-agent-key.pem:client-agent-key.pem \
                etcd-password:etcd-password; do
      aws ssm put-parameter --overwrite --type SecureString --key-id "$KMS_KEY_ARN" \
        --name "/elasticyolo/$CLUSTER/${name%%:*}" --value "file://$PKI/${name#*:}" >/dev/null
    done
    echo "secrets stored under /elasticyolo/$CLUSTER/ (SecureString, $KMS_KEY_ARN)"
    ;;
  bucket)
    aws s3api put-public-access-block --bucket "$BUCKET" --public-access-block-configuration \
      BlockPublicAcls=true,IgnorePublicAcls=true,BlockPublicPolicy=true,RestrictPublicBuckets=true
    aws s3api put-bucket-encryption --bucket "$BUCKET" --server-side-encryption-configuration \
      "{\"Rules\":[{\"ApplyServerSideEncryptionByDefault\":{\"SSEAlgorithm\":\"aws:kms\",\"KMSMasterKeyID\":\"$KMS_KEY_ARN\"},\"BucketKeyEnabled\":true}]}"
    aws s3api put-bucket-lifecycle-configuration --bucket "$BUCKET" \
      --lifecycle-configuration "$(render "$HERE/s3-lifecycle.json")"
    ;;
  iam)
    role=elasticyolo-$CLUSTER-node
    aws iam create-role --role-name "$role" --assume-role-policy-document "file://$HERE/trust-policy.json" >/dev/null
    aws iam put-role-policy --role-name "$role" --policy-name elasticyolo --policy-document "$(render "$HERE/iam-policy.json")"
    aws iam create-instance-profile --instance-profile-name "$role" >/dev/null
    aws iam add-role-to-instance-profile --instance-profile-name "$role" --role-name "$role"
    ;;
  template)
    aws ec2 create-launch-template --cli-input-json "$(render "$HERE/launch-template.json")"
    ;;
  asg)
    aws autoscaling create-auto-scaling-group --cli-input-json "$(render "$HERE/asg.json")" \
      --max-size "$MAX_NODES" --desired-capacity "$DESIRED_NODES"
    ;;
  render)
    out=${3:?render needs an output directory}
    mkdir -p "$out"
    for f in cloud-init.yaml iam-policy.json s3-lifecycle.json launch-template.json asg.json; do
      render "$HERE/$f" >"$out/$f"
    done
    ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
