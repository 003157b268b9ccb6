#!/usr/bin/env bash
# Install one etcd member of the elasticyolo control plane on a Debian/Ubuntu VM (run as root):
#
#   deploy/etcd/install-member.sh NAME IP INITIAL_CLUSTER PKI_DIR
#
# NAME/IP: this member (as given to make-certs.sh); INITIAL_CLUSTER: every member,
# "etcd-a=https://10.0.1.11:2380,etcd-b=https://10.0.2.11:2380,etcd-c=https://10.0.3.11:2380";
# PKI_DIR: make-certs.sh's output (only ca.pem, NAME{,-key}.pem and jwt-*.pem are copied here).
# Then, once all three run: deploy/etcd/setup-auth.sh https://IP:2379,... PKI_DIR PASSWORD_FILE
set -euo pipefail
[ $# -eq 4 ] || { sed -n '2,10p' "$0" >&2; exit 2; }
NAME=$1 IP=$2 INITIAL=$3 SRC=$4
HERE=$(cd "$(dirname "$0")" && pwd)
export DEBIAN_FRONTEND=noninteractive
command -v etcd >/dev/null || { apt-get update -qq && apt-get install -y -qq etcd-server etcd-client >/dev/null; }
command -v envsubst >/dev/null || apt-get install -y -qq gettext-base >/dev/null
systemctl disable --now etcd.service 2>/dev/null || true   # Debian's own single-member unit
id etcd >/dev/null 2>&1 || useradd --system --home-dir /var/lib/etcd --shell /usr/sbin/nologin etcd

install -d -m 0750 -o root -g etcd /etc/etcd /etc/etcd/pki
install -m 0644 "$SRC/ca.pem" "$SRC/$NAME.pem" "$SRC/jwt-pub.pem" /etc/etcd/pki/
install -m 0640 -g etcd "$SRC/$NAME-key.pem" "$SRC/jwt-key.pem" /etc/etcd/pki/

export ETCD_NAME=$NAME ETCD_IP=$IP ETCD_INITIAL_CLUSTER=$INITIAL ETCD_PKI=/etc/etcd/pki \
  ETCD_DATA_DIR=/var/lib/etcd/$NAME ETCD_CLIENT_PORT=2379 ETCD_PEER_PORT=2380 \
  ETCD_CLUSTER_TOKEN=elasticyolo-${CLUSTER:-prod} ETCD_HEARTBEAT_MS=${ETCD_HEARTBEAT_MS:-100} \
  ETCD_ELECTION_MS=${ETCD_ELECTION_MS:-1000}
# shellcheck disable=SC2016  # the literal ${NAME} list is envsubst's argument
envsubst '${ETCD_NAME} ${ETCD_IP} ${ETCD_INITIAL_CLUSTER} ${ETCD_PKI} ${ETCD_DATA_DIR} ${ETCD_CLIENT_PORT}
  ${ETCD_PEER_PORT} ${ETCD_CLUSTER_TOKEN} ${ETCD_HEARTBEAT_MS} ${ETCD_ELECTION_MS}' \
  <"$HERE/etcd.conf.yml.template" >/etc/etcd/etcd.conf.yml
chmod 0640 /etc/etcd/etcd.conf.yml
chgrp etcd /etc/etcd/etcd.conf.yml
install -m 0644 "$HERE/etcd-member.service" /etc/systemd/system/etcd-member.service
systemctl daemon-reload
systemctl enable --now etcd-member.service
echo "etcd member $NAME on https://$IP:2379 (peers :2380)"
