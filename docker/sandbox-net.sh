#!/usr/bin/env bash
# Build (or tear down) a sandbox network whose only way out is the egress gateway.
#
#   docker/sandbox-net.sh up      # create the sandbox namespace and the redirect/drop rules
#   docker/sandbox-net.sh down    # remove them again
#   docker/sandbox-net.sh status  # show what is in place
#
# Topology:
#
#   [sandbox netns $SANDBOX_NS]                 [gateway side: the host, or netns $GATEWAY_NS]
#     $SANDBOX_IF  $SANDBOX_ADDR  ── veth ──     $HOST_IF  $GATEWAY_ADDR
#     default route via $GATEWAY_ADDR              nat PREROUTING (from $HOST_IF only):
#     resolv.conf: nameserver $GATEWAY_ADDR          tcp dport $REDIRECT_TCP_PORTS -> $PROXY_PORT
#     IPv6 off                                       udp+tcp dport 53              -> $DNS_PORT
#                                                  filter FORWARD from $HOST_IF: DROP (no routing around)
#                                                  filter INPUT  from $HOST_IF: only the two gateway
#                                                    ports, only from $SANDBOX_ADDR (no spoofing); else DROP
#
# Run the gateway on the gateway side with both listeners, e.g.
#   egress-gateway run --policy P --mode transparent@0.0.0.0:$PROXY_PORT --mode dns@0.0.0.0:$DNS_PORT
# and give the sandbox the gateway's CA ($CONFDIR/mitmproxy-ca-cert.pem).
#
# Everything else the sandbox sends (other TCP ports, all UDP including QUIC on 443, IPv6, ICMP to
# the outside) is dropped on the gateway side, where root inside the sandbox cannot change it.
# Every setting is an environment variable (defaults below); `up` is idempotent only after `down`.
set -euo pipefail

SANDBOX_NS=${SANDBOX_NS:-egress-sandbox}
GATEWAY_NS=${GATEWAY_NS:-}                 # empty: the gateway runs in the host's namespace
SANDBOX_IF=${SANDBOX_IF:-eth0}
HOST_IF=${HOST_IF:-veth-${SANDBOX_NS:0:10}}
SANDBOX_ADDR=${SANDBOX_ADDR:-10.203.0.2/24}
GATEWAY_ADDR=${GATEWAY_ADDR:-10.203.0.1/24}
PROXY_PORT=${PROXY_PORT:-8081}
DNS_PORT=${DNS_PORT:-5353}
REDIRECT_TCP_PORTS=${REDIRECT_TCP_PORTS:-80 443}
IPTABLES=${IPTABLES:-}

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

gw() {  # run a command on the gateway side
    if [[ -n "$GATEWAY_NS" ]]; then ip netns exec "$GATEWAY_NS" "$@"; else "$@"; fi
}

pick_iptables() {
    if [[ -n "$IPTABLES" ]]; then return; fi
    for candidate in iptables iptables-legacy; do
        if command -v "$candidate" >/dev/null && gw "$candidate" -t nat -L -n >/dev/null 2>&1; then
            IPTABLES=$candidate
            return
        fi
    done
    echo "sandbox-net: no working iptables (install the iptables package)" >&2
    exit 1
}

# Each rule: table|chain|spec. The same list is used to add (-A/-I) and delete (-D).
rules() {
    local sandbox_ip=${SANDBOX_ADDR%/*} ports
    ports=$(tr ' ' ',' <<<"$REDIRECT_TCP_PORTS")
    echo "nat|PREROUTING|-i $HOST_IF -p tcp -m multiport --dports $ports -j REDIRECT --to-ports $PROXY_PORT"
    echo "nat|PREROUTING|-i $HOST_IF -p udp --dport 53 -j REDIRECT --to-ports $DNS_PORT"
    echo "nat|PREROUTING|-i $HOST_IF -p tcp --dport 53 -j REDIRECT --to-ports $DNS_PORT"
    echo "filter|FORWARD|-i $HOST_IF -j DROP"
    echo "filter|FORWARD|-o $HOST_IF -j DROP"
    echo "filter|INPUT|-i $HOST_IF ! -s $sandbox_ip -j DROP"
    echo "filter|INPUT|-i $HOST_IF -p tcp --dport $PROXY_PORT -j ACCEPT"
    echo "filter|INPUT|-i $HOST_IF -p udp --dport $DNS_PORT -j ACCEPT"
    echo "filter|INPUT|-i $HOST_IF -p tcp --dport $DNS_PORT -j ACCEPT"
    echo "filter|INPUT|-i $HOST_IF -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"
    echo "filter|INPUT|-i $HOST_IF -j DROP"
}

apply_rules() {  # $1 = A (append, in order) or D (delete)
    local action=$1 table chain spec
    while IFS='|' read -r table chain spec; do
        # shellcheck disable=SC2086
        if [[ $action == D ]]; then
            gw "$IPTABLES" -t "$table" -D "$chain" $spec 2>/dev/null || true
        else
            gw "$IPTABLES" -t "$table" -A "$chain" $spec
        fi
    done < <(rules)
}

up() {
    pick_iptables
    local gateway_ip=${GATEWAY_ADDR%/*}
    ip netns add "$SANDBOX_NS"
    ip link add "$HOST_IF" type veth peer name "egsb$$"
    ip link set "egsb$$" netns "$SANDBOX_NS"
    ip -n "$SANDBOX_NS" link set "egsb$$" name "$SANDBOX_IF"
    if [[ -n "$GATEWAY_NS" ]]; then ip link set "$HOST_IF" netns "$GATEWAY_NS"; fi
    gw ip addr add "$GATEWAY_ADDR" dev "$HOST_IF"
    gw ip link set "$HOST_IF" up
    ip -n "$SANDBOX_NS" link set lo up
    ip -n "$SANDBOX_NS" addr add "$SANDBOX_ADDR" dev "$SANDBOX_IF"
    ip -n "$SANDBOX_NS" link set "$SANDBOX_IF" up
    ip -n "$SANDBOX_NS" route add default via "$gateway_ip"
    # No IPv6 in the sandbox: nothing on the gateway side would redirect it. The FORWARD/INPUT
    # drops on the gateway side hold even if root inside the sandbox turns it back on.
    ip netns exec "$SANDBOX_NS" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 2>/dev/null || true
    if command -v ip6tables >/dev/null && gw ip6tables -A FORWARD -i "$HOST_IF" -j DROP 2>/dev/null \
            && gw ip6tables -A INPUT -i "$HOST_IF" -j DROP 2>/dev/null; then
        :
    else
        echo "sandbox-net: WARNING: no ip6tables rules: IPv6 from the sandbox is only off by sysctl," \
             "which root in the sandbox can undo (install ip6tables)" >&2
    fi
    mkdir -p "/etc/netns/$SANDBOX_NS"
    echo "nameserver $gateway_ip" >"/etc/netns/$SANDBOX_NS/resolv.conf"
    apply_rules A
    echo "sandbox-net: $SANDBOX_NS up: $SANDBOX_ADDR -> gateway $gateway_ip (tcp ${REDIRECT_TCP_PORTS// /,} -> :$PROXY_PORT, dns -> :$DNS_PORT, $IPTABLES)"
}

down() {
    pick_iptables || true
    apply_rules D
    if command -v ip6tables >/dev/null; then
        gw ip6tables -D FORWARD -i "$HOST_IF" -j DROP 2>/dev/null || true
        gw ip6tables -D INPUT -i "$HOST_IF" -j DROP 2>/dev/null || true
    fi
    gw ip link del "$HOST_IF" 2>/dev/null || true
    ip netns del "$SANDBOX_NS" 2>/dev/null || true
    rm -rf "/etc/netns/$SANDBOX_NS"
    echo "sandbox-net: $SANDBOX_NS down"
}

status() {
    pick_iptables
    ip netns list | grep -w "$SANDBOX_NS" || echo "no namespace $SANDBOX_NS"
    gw "$IPTABLES" -t nat -S PREROUTING | grep -- "-i $HOST_IF" || true
    gw "$IPTABLES" -t filter -S | grep -- "$HOST_IF" || true
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    -h|--help|help) usage 0 ;;
    *) usage ;;
esac
