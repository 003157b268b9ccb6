#!/usr/bin/env bash
# Certificates for a TLS etcd cluster and its clients, with openssl only.
#
#   deploy/etcd/make-certs.sh OUT_DIR MEMBER=ADDR[,ADDR...] [MEMBER=ADDR[,ADDR...] ...]
#
# MEMBER is the etcd member name (also the certificate's CN); ADDR is an IP address or a DNS
# name the member is reached at (peers and clients), several separated by commas. Writes:
#
#   ca.pem, ca-key.pem                 the cluster CA (kept if present: re-run to add members)
#   MEMBER.pem, MEMBER-key.pem         one per member, for both its client and peer listeners
#   client-agent.pem, ...-key.pem      clients: elasticyolo agents, CLI and workers. No Common
#                                      Name: with client-cert-auth and auth on, etcd's HTTP gateway
#                                      (which elasticyolo uses) refuses certificates that carry
#                                      one. The certificate alone grants nothing: the etcd user's
#                                      password is still needed.
#   client-root.pem, ...-key.pem       the admin client: CN root, so etcdctl is etcd's `root`
#                                      user by certificate (setup-auth.sh), no root password
#   jwt-key.pem, jwt-pub.pem           RS256 key pair for `--auth-token jwt`: tokens valid on
#                                      every member (etcd's default "simple" tokens are not)
#
# Private keys are mode 0600. Env: CERT_DAYS (default 825), CA_DAYS (3650), KEY_BITS (2048).
set -euo pipefail

usage() { echo "usage: $0 OUT_DIR MEMBER=ADDR[,ADDR...] [MEMBER=ADDR...]" >&2; exit 2; }
[ $# -ge 2 ] || usage
OUT=$1; shift
CERT_DAYS=${CERT_DAYS:-825}
CA_DAYS=${CA_DAYS:-3650}
KEY_BITS=${KEY_BITS:-2048}
mkdir -p "$OUT"
umask 077

is_ip() { [[ $1 =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || $1 == *:* ]]; }

san_list() {  # "a,b" -> "IP:a,DNS:b"
  local out="" item
  IFS=',' read -r -a items <<<"$1"
  for item in "${items[@]}"; do
    [ -n "$item" ] || continue
    if is_ip "$item"; then out+="${out:+,}IP:$item"; else out+="${out:+,}DNS:$item"; fi
  done
  printf '%s' "$out"
}

# sign NAME SUBJECT USAGE [SAN]: a key and a certificate signed by the CA.
sign() {
  local name=$1 subject=$2 usage=$3 san=${4:-} ext="$OUT/.$1.ext"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [ -z "$san" ] || echo "subjectAltName=$san"
  } >"$ext"
  openssl req -new -newkey "rsa:$KEY_BITS" -nodes -keyout "$OUT/$name-key.pem" -out "$OUT/.$name.csr" \
    -subj "$subject" 2>/dev/null
  openssl x509 -req -in "$OUT/.$name.csr" -CA "$OUT/ca.pem" -CAkey "$OUT/ca-key.pem" -CAcreateserial \
    -out "$OUT/$name.pem" -days "$CERT_DAYS" -sha256 -extfile "$ext" 2>/dev/null
  rm -f "$OUT/.$name.csr" "$ext"
  chmod 600 "$OUT/$name-key.pem"
  chmod 644 "$OUT/$name.pem"
}

if [ ! -s "$OUT/ca.pem" ] || [ ! -s "$OUT/ca-key.pem" ]; then
  openssl req -x509 -new -newkey "rsa:$KEY_BITS" -nodes -keyout "$OUT/ca-key.pem" -out "$OUT/ca.pem" \
    -days "$CA_DAYS" -sha256 -subj "/CN=elasticyolo-etcd-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  chmod 600 "$OUT/ca-key.pem"
  chmod 644 "$OUT/ca.pem"
fi

for member in "$@"; do
  name=${member%%=*}
  addrs=${member#*=}
  [[ $member == *=* && -n $name && -n $addrs ]] || usage
  [[ $name =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || { echo "$0: bad member name '$name'" >&2; exit 2; }
  [[ $name != root && $name != elasticyolo ]] || {
    echo "$0: member name '$name' is an etcd user or client name: pick another" >&2; exit 2; }
  # serverAuth for its listeners, clientAuth because members dial each other with this cert.
  sign "$name" "/CN=$name" "serverAuth,clientAuth" "$(san_list "$addrs")"
done

sign client-agent "/O=elasticyolo/OU=agent" clientAuth
sign client-root "/CN=root" clientAuth

if [ ! -s "$OUT/jwt-key.pem" ]; then
  openssl genpkey -algorithm RSA -pkeyopt "rsa_keygen_bits:$KEY_BITS" -out "$OUT/jwt-key.pem" 2>/dev/null
  openssl pkey -in "$OUT/jwt-key.pem" -pubout -out "$OUT/jwt-pub.pem" 2>/dev/null
  chmod 600 "$OUT/jwt-key.pem"
  chmod 644 "$OUT/jwt-pub.pem"
fi
rm -f "$OUT/ca.srl"
echo "certificates in $OUT: ca.pem, $(printf '%s.pem ' "${@%%=*}")client-agent.pem, client-root.pem, jwt-*.pem"
