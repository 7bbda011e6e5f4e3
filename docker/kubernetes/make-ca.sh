#!/usr/bin/env bash
# Make the gateway's CA and placeholder key, once, for the Kubernetes Secret egress-gateway-ca.
#
#   docker/kubernetes/make-ca.sh [DIR]        # default DIR: docker/kubernetes/ca (git-ignored)
#
# Every replica (and every node's DaemonSet pod) must present certificates from the same CA, and
# swap the same placeholders, so the CA is made here once and mounted into each pod's confdir from
# a Secret, never generated per pod. Writes, in DIR (mode 0700):
#
#   mitmproxy-ca.pem          private key + certificate: the Secret only, never to sandboxes
#   mitmproxy-ca-cert.pem     the certificate sandboxes must trust (also a ConfigMap for them)
#   mitmproxy-dhparam.pem     mitmproxy's DH parameters (read-only confdir: it must exist)
#   egress-placeholder.key    the HMAC key behind `egress-gateway placeholders`
#
# and removes mitmproxy's PKCS#12 copy of the private key. Needs the gateway's Python (PYTHON,
# default: python3, with the project installed) or its image (EGRESS_IMAGE=egress-gateway:0.1.0,
# run with docker). CA_NAME sets the certificate's common name and organisation.
# Then: kubectl kustomize docker/kubernetes | kubectl apply -f -   (see docs/deploy.md)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
dir=${1:-$here/ca}
name=${CA_NAME:-egress-gateway}

if [[ -e "$dir/mitmproxy-ca.pem" ]]; then
    echo "make-ca: $dir/mitmproxy-ca.pem exists; not replacing a CA sandboxes may already trust" >&2
    exit 1
fi
mkdir -p "$dir"
chmod 0700 "$dir"
dir=$(cd "$dir" && pwd)

code='
import sys
from pathlib import Path
from mitmproxy.certs import CertStore
from gateway.credentials import load_placeholder_key
path, name = Path(sys.argv[1]), sys.argv[2]
CertStore.create_store(path, "mitmproxy", 2048, organization=name, cn=name)
load_placeholder_key(path)
'

if [[ -n "${EGRESS_IMAGE:-}" ]]; then
    docker run --rm --network none --user "$(id -u):$(id -g)" -v "$dir:/ca" \
        --entrypoint python "$EGRESS_IMAGE" -c "$code" /ca "$name"
else
    "${PYTHON:-python3}" -c "$code" "$dir" "$name"
fi
rm -f "$dir/mitmproxy-ca.p12"
chmod 0600 "$dir/mitmproxy-ca.pem" "$dir/egress-placeholder.key"
echo "make-ca: CA for sandboxes: $dir/mitmproxy-ca-cert.pem"
