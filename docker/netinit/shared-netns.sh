#!/usr/bin/env bash
# Make a network namespace shared by the gateway and a sandbox send all of the sandbox's traffic
# through the gateway's transparent listener (docker/compose.transparent.yaml).
#
#   shared-netns.sh up        # install (or re-install: idempotent) the rules below; the default
#   shared-netns.sh down      # remove them
#   shared-netns.sh status    # print them
#   shared-netns.sh check     # exit 0 only when both chains are in place and jumped to (healthcheck)
#   shared-netns.sh hold      # `up`, then drop every capability and privilege and sleep: the
#                             # process that keeps the namespace alive in Compose
#
# Traffic is told apart by the user id of the socket that sends it (iptables' owner match): the
# gateway runs as $GATEWAY_UID, everything else in the namespace is the sandbox. This is how
# mitmproxy documents transparent proxying of a host's own traffic, and how service-mesh sidecars
# capture their pod's. In the namespace:
#
#   nat    OUTPUT -> EGRESS-GW-NAT   sockets not owned by $GATEWAY_UID:
#            udp+tcp dport 53                 -> REDIRECT :$DNS_PORT   (the gateway's dns@, whatever
#                                                server was asked: Docker's 127.0.0.11 included)
#            tcp dport $REDIRECT_TCP_PORTS to anything but loopback -> REDIRECT :$PROXY_PORT (transparent@)
#   filter OUTPUT -> EGRESS-GW-OUT   sockets not owned by $GATEWAY_UID may send only to 127.0.0.1
#            (the redirected connections land there; the sandbox's own loopback services work) and
#            replies; everything else is rejected at once: other ports, UDP (QUIC), ICMP, Docker's
#            DNS server 127.0.0.11 on its real port, the gateway's metrics address
#   and the same for IPv6 (only ::1), when ip6tables works.
#
# Why it holds against root in the sandbox: the sandbox container runs with no capabilities
# (cap_drop: ALL, no-new-privileges), so it cannot change these rules (NET_ADMIN), open raw
# sockets (NET_RAW) or take the gateway's user id (SETUID); Compose gives the namespace no
# network the sandbox could use without passing these rules. The holder keeps NET_ADMIN only
# until the rules are in: `hold` drops it before it sleeps.
#
# Settings (environment): GATEWAY_UID=10001  PROXY_PORT=8081  DNS_PORT=5353  REDIRECT_TCP_PORTS="80 443"
#   IPTABLES (default: iptables)
set -euo pipefail

GATEWAY_UID=${GATEWAY_UID:-10001}
PROXY_PORT=${PROXY_PORT:-8081}
DNS_PORT=${DNS_PORT:-5353}
REDIRECT_TCP_PORTS=${REDIRECT_TCP_PORTS:-80 443}
IPTABLES=${IPTABLES:-iptables}
IP6TABLES=${IP6TABLES:-ip6tables}
NAT=EGRESS-GW-NAT
OUT=EGRESS-GW-OUT

die() { echo "shared-netns: $*" >&2; exit 1; }

fresh_chain() {  # BINARY TABLE PARENT CHAIN: create or empty CHAIN, jumped to first from PARENT
    local bin=$1 table=$2 parent=$3 chain=$4
    "$bin" -w 10 -t "$table" -N "$chain" 2>/dev/null || "$bin" -w 10 -t "$table" -F "$chain"
    while "$bin" -w 10 -t "$table" -D "$parent" -j "$chain" 2>/dev/null; do :; done
    "$bin" -w 10 -t "$table" -I "$parent" 1 -j "$chain"
}

remove_chain() {
    local bin=$1 table=$2 parent=$3 chain=$4
    while "$bin" -w 10 -t "$table" -D "$parent" -j "$chain" 2>/dev/null; do :; done
    "$bin" -w 10 -t "$table" -F "$chain" 2>/dev/null || true
    "$bin" -w 10 -t "$table" -X "$chain" 2>/dev/null || true
}

check_settings() {
    [[ "$GATEWAY_UID" =~ ^[0-9]+$ ]] && (( GATEWAY_UID > 0 )) || die "GATEWAY_UID=$GATEWAY_UID: a non-root user id is needed"
    local port
    for port in $PROXY_PORT $DNS_PORT $REDIRECT_TCP_PORTS; do
        [[ "$port" =~ ^[0-9]+$ ]] && (( port >= 1 && port <= 65535 )) || die "bad port: $port"
    done
}

up() {
    check_settings
    local ports ipt="$IPTABLES"
    ports=$(tr -s ' ' ',' <<<"$REDIRECT_TCP_PORTS")
    fresh_chain "$ipt" nat OUTPUT "$NAT"
    "$ipt" -w 10 -t nat -A "$NAT" -m owner --uid-owner "$GATEWAY_UID" -j RETURN
    "$ipt" -w 10 -t nat -A "$NAT" -p udp --dport 53 -j REDIRECT --to-ports "$DNS_PORT"
    "$ipt" -w 10 -t nat -A "$NAT" -p tcp --dport 53 -j REDIRECT --to-ports "$DNS_PORT"
    "$ipt" -w 10 -t nat -A "$NAT" -d 127.0.0.0/8 -j RETURN
    "$ipt" -w 10 -t nat -A "$NAT" -p tcp -m multiport --dports "$ports" -j REDIRECT --to-ports "$PROXY_PORT"

    fresh_chain "$ipt" filter OUTPUT "$OUT"
    "$ipt" -w 10 -A "$OUT" -m owner --uid-owner "$GATEWAY_UID" -j RETURN
    "$ipt" -w 10 -A "$OUT" -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN
    # No "-o lo": the OUTPUT hook keeps the interface of the first route (eth0) for a connection that
    # the nat table redirected to 127.0.0.1.
    "$ipt" -w 10 -A "$OUT" -d 127.0.0.1 -j RETURN
    "$ipt" -w 10 -A "$OUT" -p tcp -j REJECT --reject-with tcp-reset
    "$ipt" -w 10 -A "$OUT" -j REJECT --reject-with icmp-admin-prohibited

    if "$IP6TABLES" -w 10 -S >/dev/null 2>&1; then
        fresh_chain "$IP6TABLES" filter OUTPUT "$OUT"
        "$IP6TABLES" -w 10 -A "$OUT" -m owner --uid-owner "$GATEWAY_UID" -j RETURN
        "$IP6TABLES" -w 10 -A "$OUT" -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN
        "$IP6TABLES" -w 10 -A "$OUT" -d ::1 -j RETURN
        "$IP6TABLES" -w 10 -A "$OUT" -j DROP
    else
        echo "shared-netns: ip6tables does not work here; keep IPv6 off in this namespace" \
             "(compose.transparent.yaml sets net.ipv6.conf.all.disable_ipv6=1)" >&2
    fi
    echo "shared-netns: up: uid != $GATEWAY_UID: tcp $ports -> :$PROXY_PORT, dns -> :$DNS_PORT, only 127.0.0.1 otherwise"
}

down() {
    remove_chain "$IPTABLES" nat OUTPUT "$NAT"
    remove_chain "$IPTABLES" filter OUTPUT "$OUT"
    remove_chain "$IP6TABLES" filter OUTPUT "$OUT"
    echo "shared-netns: down"
}

status() {
    "$IPTABLES" -w 10 -t nat -S "$NAT" 2>/dev/null || echo "no chain $NAT"
    "$IPTABLES" -w 10 -t filter -S "$OUT" 2>/dev/null || echo "no chain $OUT"
}

check() {
    "$IPTABLES" -w 10 -t nat -C OUTPUT -j "$NAT" 2>/dev/null \
        && "$IPTABLES" -w 10 -t filter -C OUTPUT -j "$OUT" 2>/dev/null \
        && [[ $("$IPTABLES" -w 10 -t filter -S "$OUT" | grep -c -- '-j REJECT') -ge 2 ]] \
        || die "rules missing"
}

hold() {
    up
    # From here on nothing needs a privilege: sleep as nobody with an empty bounding set, so this
    # container keeps the namespace alive and nothing else. (Compose's init: true reaps and
    # forwards SIGTERM.)
    exec setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --bounding-set=-all \
        --no-new-privs sleep infinity
}

case "${1:-up}" in
    up) up ;;
    down) down ;;
    status) status ;;
    check) check ;;
    hold) hold ;;
    -h|--help|help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
    *) die "usage: $0 up|down|status|check|hold" ;;
esac
