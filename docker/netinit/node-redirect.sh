#!/usr/bin/env bash
# Steer the sandbox pods of one Kubernetes node into the node's transparent egress gateway.
#
#   node-redirect.sh up       # install (or re-install: idempotent) the rules below; the default
#   node-redirect.sh down     # remove them (sandbox pods on the node then follow NetworkPolicy alone)
#   node-redirect.sh status   # print them
#
# Runs in the init container of docker/kubernetes/daemonset.yaml: in the node's network namespace
# (hostNetwork: true), as root with NET_ADMIN and NET_RAW only, sharing /run/xtables.lock with
# kube-proxy. Everything it adds lives in three chains of its own, jumped to first:
#
#   nat    PREROUTING -> EGRESS-GW-PRE   from a sandbox interface ($SANDBOX_INTERFACES):
#            tcp dport $REDIRECT_TCP_PORTS  -> DNAT $NODE_IP:$PROXY_PORT  (the gateway's transparent@)
#            udp+tcp dport 53               -> DNAT $NODE_IP:$DNS_PORT    (the gateway's dns@)
#   filter FORWARD    -> EGRESS-GW-FWD   from a sandbox interface: replies to connections made to
#            the pod pass, everything else is dropped (no routing around the gateway)
#   filter INPUT      -> EGRESS-GW-IN    from a sandbox interface: replies pass; new connections only
#            to $NODE_IP:$PROXY_PORT and :$DNS_PORT; everything else to the node is dropped (kubelet,
#            node ports, the gateway's metrics port, ...)
#   and, when ip6tables works, every IPv6 packet from a sandbox interface is dropped.
#
# DNAT to the node's address rather than REDIRECT: REDIRECT sends a packet to the primary address of
# the interface it came in on, and routed CNIs (Calico's cali*, Cilium's lxc*) give the host side
# of a pod's veth no address at all, so REDIRECT would drop it. The gateway reads the original
# destination from conntrack (SO_ORIGINAL_DST) either way. (kube2iam redirects the metadata
# endpoint the same way, for the same reason.)
#
# Settings (environment):
#   NODE_IP              required: the node's address the gateway listens on (downward API status.hostIP)
#   SANDBOX_INTERFACES   required: iptables interface names of sandbox pods' host-side interfaces,
#                        space-separated, '+' is a wildcard: cali+ (Calico), cni0 (flannel, bridge
#                        plugin), veth+ (kindnet), eni+ (AWS VPC CNI), gke+ (GKE dataplane v1)
#   PROXY_PORT=8081  DNS_PORT=5353  REDIRECT_TCP_PORTS="80 443"
#   IPTABLES             iptables or iptables-legacy; default: the one kube-proxy uses (more rules)
#
# Limits, which docs/deploy.md repeats: every non-hostNetwork pod whose interface matches is treated as
# a sandbox, so run these on a dedicated sandbox node pool; a CNI that forwards pod traffic in eBPF
# without the host's netfilter (Cilium with eBPF host routing, Calico's eBPF data plane) bypasses
# these rules (the NetworkPolicy in networkpolicy-sandbox.yaml still holds: fail closed); a CNI or
# agent that flushes the filter/nat tables removes them until this container runs again.
set -euo pipefail

PROXY_PORT=${PROXY_PORT:-8081}
DNS_PORT=${DNS_PORT:-5353}
REDIRECT_TCP_PORTS=${REDIRECT_TCP_PORTS:-80 443}
IPTABLES=${IPTABLES:-}
PRE=EGRESS-GW-PRE
FWD=EGRESS-GW-FWD
IN=EGRESS-GW-IN

die() { echo "node-redirect: $*" >&2; exit 1; }

pick_iptables() {
    # The backend kube-proxy and the CNI use holds their rules; ours must go in the same one, or the
    # kernel evaluates both and the order between them is undefined.
    [[ -n "$IPTABLES" ]] && return
    local legacy=0 nft=0
    if command -v iptables-legacy-save >/dev/null; then legacy=$(iptables-legacy-save 2>/dev/null | grep -c '^-' || true); fi
    if command -v iptables-nft-save >/dev/null; then nft=$(iptables-nft-save 2>/dev/null | grep -c '^-' || true); fi
    if (( legacy > nft )); then IPTABLES=iptables-legacy; IP6TABLES=ip6tables-legacy
    elif command -v iptables-nft >/dev/null; then IPTABLES=iptables-nft; IP6TABLES=ip6tables-nft
    else IPTABLES=iptables; IP6TABLES=ip6tables
    fi
}

ipt() { "$IPTABLES" -w 10 "$@"; }

# Create CHAIN in TABLE (or empty it) and make PARENT jump to it first, exactly once.
fresh_chain() {
    local table=$1 parent=$2 chain=$3
    ipt -t "$table" -N "$chain" 2>/dev/null || ipt -t "$table" -F "$chain"
    while ipt -t "$table" -D "$parent" -j "$chain" 2>/dev/null; do :; done
    ipt -t "$table" -I "$parent" 1 -j "$chain"
}

remove_chain() {
    local table=$1 parent=$2 chain=$3
    while ipt -t "$table" -D "$parent" -j "$chain" 2>/dev/null; do :; done
    ipt -t "$table" -F "$chain" 2>/dev/null || true
    ipt -t "$table" -X "$chain" 2>/dev/null || true
}

check_settings() {
    [[ -n "${NODE_IP:-}" ]] || die "NODE_IP is not set (downward API: status.hostIP)"
    [[ "$NODE_IP" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "NODE_IP=$NODE_IP: an IPv4 address is needed"
    [[ -n "${SANDBOX_INTERFACES:-}" ]] || die "SANDBOX_INTERFACES is not set (e.g. cali+)"
    local port
    for port in $PROXY_PORT $DNS_PORT $REDIRECT_TCP_PORTS; do
        [[ "$port" =~ ^[0-9]+$ ]] && (( port >= 1 && port <= 65535 )) || die "bad port: $port"
    done
}

up() {
    check_settings
    pick_iptables
    local ports iface
    ports=$(tr -s ' ' ',' <<<"$REDIRECT_TCP_PORTS")
    fresh_chain nat PREROUTING "$PRE"
    fresh_chain filter FORWARD "$FWD"
    fresh_chain filter INPUT "$IN"
    for iface in $SANDBOX_INTERFACES; do
        ipt -t nat -A "$PRE" -i "$iface" -p tcp -m multiport --dports "$ports" \
            -j DNAT --to-destination "$NODE_IP:$PROXY_PORT"
        ipt -t nat -A "$PRE" -i "$iface" -p udp --dport 53 -j DNAT --to-destination "$NODE_IP:$DNS_PORT"
        ipt -t nat -A "$PRE" -i "$iface" -p tcp --dport 53 -j DNAT --to-destination "$NODE_IP:$DNS_PORT"

        ipt -A "$FWD" -i "$iface" -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN
        ipt -A "$FWD" -i "$iface" -j DROP

        ipt -A "$IN" -i "$iface" -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN
        ipt -A "$IN" -i "$iface" -d "$NODE_IP" -p tcp --dport "$PROXY_PORT" -j ACCEPT
        ipt -A "$IN" -i "$iface" -d "$NODE_IP" -p udp --dport "$DNS_PORT" -j ACCEPT
        ipt -A "$IN" -i "$iface" -d "$NODE_IP" -p tcp --dport "$DNS_PORT" -j ACCEPT
        ipt -A "$IN" -i "$iface" -j DROP
    done
    if "${IP6TABLES:-ip6tables}" -w 10 -t filter -S >/dev/null 2>&1; then
        local ip6="${IP6TABLES:-ip6tables}"
        for chain in "$FWD:FORWARD" "$IN:INPUT"; do
            "$ip6" -w 10 -N "${chain%%:*}" 2>/dev/null || "$ip6" -w 10 -F "${chain%%:*}"
            while "$ip6" -w 10 -D "${chain##*:}" -j "${chain%%:*}" 2>/dev/null; do :; done
            "$ip6" -w 10 -I "${chain##*:}" 1 -j "${chain%%:*}"
            for iface in $SANDBOX_INTERFACES; do
                "$ip6" -w 10 -A "${chain%%:*}" -i "$iface" -j DROP
            done
        done
    else
        echo "node-redirect: WARNING: ip6tables does not work here: IPv6 from sandbox pods is not dropped" \
             "by this node (a single-stack IPv4 cluster has none to drop)" >&2
    fi
    echo "node-redirect: up ($IPTABLES): from $SANDBOX_INTERFACES: tcp $ports -> $NODE_IP:$PROXY_PORT," \
         "dns -> $NODE_IP:$DNS_PORT, everything else dropped"
}

down() {
    pick_iptables
    remove_chain nat PREROUTING "$PRE"
    remove_chain filter FORWARD "$FWD"
    remove_chain filter INPUT "$IN"
    local ip6="${IP6TABLES:-ip6tables}"
    for chain in "$FWD:FORWARD" "$IN:INPUT"; do
        while "$ip6" -w 10 -D "${chain##*:}" -j "${chain%%:*}" 2>/dev/null; do :; done
        "$ip6" -w 10 -F "${chain%%:*}" 2>/dev/null || true
        "$ip6" -w 10 -X "${chain%%:*}" 2>/dev/null || true
    done
    echo "node-redirect: down ($IPTABLES)"
}

status() {
    pick_iptables
    ipt -t nat -S "$PRE" 2>/dev/null || echo "no chain $PRE"
    ipt -t filter -S "$FWD" 2>/dev/null || echo "no chain $FWD"
    ipt -t filter -S "$IN" 2>/dev/null || echo "no chain $IN"
}

case "${1:-up}" in
    up) up ;;
    down) down ;;
    status) status ;;
    -h|--help|help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
    *) die "usage: $0 up|down|status" ;;
esac
