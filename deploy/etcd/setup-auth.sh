#!/usr/bin/env bash
# Turn on etcd auth for elasticyolo, idempotently:
#   * `root` exists without a password: only the admin certificate (CN root, make-certs.sh)
#     acts as root, so no root password exists to leak;
#   * role `elasticyolo` may read and write the prefix `/elasticyolo/` and nothing else;
#   * user `elasticyolo` has that role and the password read from PASSWORD_FILE (through
#     stdin: never on a command line, where `ps` would show it);
#   * auth enabled.
#
#   deploy/etcd/setup-auth.sh ENDPOINTS PKI_DIR PASSWORD_FILE [USER]
#
# ENDPOINTS: https://host:2379[,...]; PKI_DIR holds ca.pem and client-root{,-key}.pem.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 ENDPOINTS PKI_DIR PASSWORD_FILE [USER]" >&2; exit 2; }
ENDPOINTS=$1 PKI=$2 PASSWORD_FILE=$3 USER_NAME=${4:-elasticyolo}
ROLE=elasticyolo
PREFIX=/elasticyolo/
[ -s "$PASSWORD_FILE" ] || { echo "$0: $PASSWORD_FILE: missing or empty" >&2; exit 2; }
for f in ca.pem client-root.pem client-root-key.pem; do
  [ -s "$PKI/$f" ] || { echo "$0: $PKI/$f: missing" >&2; exit 2; }
done

ctl() {
  ETCDCTL_API=3 etcdctl --endpoints "$ENDPOINTS" --cacert "$PKI/ca.pem" --cert "$PKI/client-root.pem" \
    --key "$PKI/client-root-key.pem" --dial-timeout 5s --command-timeout 10s "$@"
}

users=$(ctl user list)
roles=$(ctl role list)
has() { grep -qx -- "$2" <<<"$1"; }

has "$users" root || ctl user add root --no-password >/dev/null
has "$roles" root || ctl role add root >/dev/null
ctl user grant-role root root >/dev/null 2>&1 || true
has "$roles" "$ROLE" || ctl role add "$ROLE" >/dev/null
ctl role grant-permission "$ROLE" --prefix=true readwrite "$PREFIX" >/dev/null
# The password goes through stdin (etcdctl reads it there with --interactive=false).
password=$(head -n1 "$PASSWORD_FILE")
if has "$users" "$USER_NAME"; then
  printf '%s\n' "$password" | ctl user passwd "$USER_NAME" --interactive=false >/dev/null
else
  printf '%s\n' "$password" | ctl user add "$USER_NAME" --interactive=false >/dev/null
fi
unset password
ctl user grant-role "$USER_NAME" "$ROLE" >/dev/null 2>&1 || true
ctl auth enable >/dev/null
echo "etcd auth enabled: user $USER_NAME (role $ROLE: readwrite $PREFIX), root by certificate only"
