#!/usr/bin/env bash
# A cluster of N "hosts" on one machine, for tests and for trying multi-host runs without one:
# each host is a network namespace joined by a veth pair to a bridge in the root namespace,
# its link shaped with `tc` (rate and one-way delay on what the host sends), and `mpirun`
# starts the ranks inside the namespaces (`ip netns exec`, no ssh). Ranks on one host talk
# over shared memory (Open MPI's vader), ranks on different hosts over TCP on the shaped
# veth links: the two tiers of a real cluster.
#
#   scripts/netns-cluster.sh up N [--ranks-per-host R] [--rate 1gbit] [--delay 0.5ms]
#   scripts/netns-cluster.sh run [N] [--ranks-per-host R] [--rate …] [--delay …] -- ARGS…
#   scripts/netns-cluster.sh down
#   scripts/netns-cluster.sh status
#   scripts/netns-cluster.sh options     (the mpirun options `run` uses, for other launchers)
#
# `run` brings up a fresh cluster (2 hosts × 2 ranks unless told otherwise), runs
# `mpirun <cluster options> ARGS…` (ARGS: more mpirun options, then the program; -np defaults
# to N × R, ranks 0..R-1 on host 0 and so on) and removes the cluster when it ends, also on
# failure or Ctrl-C. With no size options and a cluster already `up`, it runs on that cluster
# and leaves it up. Each rank gets MESHTRAIN_HOST (its host's name: the mesh's topology) and
# MESHTRAIN_HOST_ADDR (its host's address: where rank 0's failure monitor is reached), since
# every namespace shares the machine's host name.
#
# `up` removes a stale cluster of the same prefix first, so a crashed test never blocks the
# next. Settings: MESHTRAIN_NETNS_PREFIX (default mt: namespaces mt-host0…, bridge mt-br),
# MESHTRAIN_NETNS_SUBNET (default 10.231.0: hosts .1…, the bridge .254). Needs root, iproute2
# (ip; tc with netem, else tbf: rate without delay) and Open MPI. Exit code 2 when namespaces
# cannot be created.
set -euo pipefail

PREFIX="${MESHTRAIN_NETNS_PREFIX:-mt}"
SUBNET="${MESHTRAIN_NETNS_SUBNET:-10.231.0}"
STATE="/tmp/meshtrain-netns-$PREFIX"
BRIDGE="$PREFIX-br"
SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"

usage() { sed -n '2,/^set /p' "$SCRIPT" | grep '^#' | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "netns-cluster: $*" >&2; exit 1; }

host_name() { echo "$PREFIX-host$1"; }
host_addr() { echo "$SUBNET.$(($1 + 1))"; }

# Stops what still runs inside the cluster's namespaces (ranks and orted daemons left by an
# aborted job), then deletes the namespaces (their veth ends go with them) and the bridge.
down() {
    local ns pids
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-host[0-9]+$" || true); do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [ -n "$pids" ]; then
            # shellcheck disable=SC2086
            kill -9 $pids 2>/dev/null || true
        fi
        ip netns delete "$ns" 2>/dev/null || true
    done
    ip link delete "$BRIDGE" 2>/dev/null || true
    rm -rf "$STATE"
}

# shape NS RATE DELAY: what the host sends leaves at RATE and arrives DELAY later (a NIC and
# its link). netem does both; kernels without it (CONFIG_NET_SCH_NETEM unset, as on our CI
# machine) get the rate from tbf and no added delay, with a warning. tbf's burst is above
# veth's 64 KiB GSO packets (larger ones tbf would have to split).
shape() {
    local ns=$1 rate=$2 delay=$3
    if tc -n "$ns" qdisc add dev eth0 root netem delay "$delay" rate "$rate" limit 100000 2>/dev/null; then
        return
    fi
    tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 100ms
    if [ "$ns" = "$(host_name 0)" ]; then
        echo "netns-cluster: warning: this kernel has no netem qdisc: links are limited to $rate but get no added delay (asked: $delay)" >&2
    fi
    LINK_DELAY="no added delay"
}

# up N R RATE DELAY
up() {
    local hosts=$1 per_host=$2 rate=$3 delay=$4 i ns
    [[ "$hosts" =~ ^[1-9][0-9]*$ ]] && [ "$hosts" -le 250 ] || die "the number of hosts must be 1..250, got '$hosts'"
    [[ "$per_host" =~ ^[1-9][0-9]*$ ]] || die "--ranks-per-host must be a positive integer, got '$per_host'"
    down
    # A probe namespace: where creating one is not allowed (an unprivileged container, CI),
    # say so and exit 2 so that tests can skip.
    if ! ip netns add "$PREFIX-probe" 2>/dev/null; then
        echo "netns-cluster: cannot create network namespaces here (need root and CAP_SYS_ADMIN)" >&2
        exit 2
    fi
    ip netns delete "$PREFIX-probe"
    # Another cluster (another prefix) on the same subnet would take our replies.
    if ip -br addr | grep -q " $SUBNET\.254/"; then
        die "subnet $SUBNET.0/24 is in use by $(ip -br addr | awk -v a="$SUBNET.254/" 'index($0, a) {print $1}'): set MESHTRAIN_NETNS_SUBNET"
    fi
    mkdir -p "$STATE"
    ip link add "$BRIDGE" type bridge
    ip addr add "$SUBNET.254/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    : >"$STATE/hostfile"
    for ((i = 0; i < hosts; i++)); do
        ns=$(host_name "$i")
        ip netns add "$ns"
        ip link add "$PREFIX-v$i" type veth peer name eth0 netns "$ns"
        ip link set "$PREFIX-v$i" master "$BRIDGE" up
        ip -n "$ns" addr add "$(host_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        shape "$ns" "$rate" "$delay"
        echo "$ns slots=$per_host" >>"$STATE/hostfile"
    done
    echo "$hosts $per_host $rate $delay" >"$STATE/size"
    # Open MPI runs `agent HOST command…` like ssh: the command words form one shell line.
    # The hosts share one file system, so each gets its own session and shared-memory
    # directories: vader names its segments by job and local rank, which would collide
    # between hosts (and crash).
    cat >"$STATE/agent" <<EOF
#!/usr/bin/env bash
host=\$1; shift
index=\${host#$PREFIX-host}
mkdir -p "$STATE/\$host"
exec ip netns exec "\$host" env MESHTRAIN_HOST="\$host" MESHTRAIN_HOST_ADDR="$SUBNET.\$((index + 1))" \\
    OMPI_MCA_orte_tmpdir_base="$STATE/\$host" OMPI_MCA_btl_vader_backing_directory="$STATE/\$host" \\
    sh -c "\$*"
EOF
    chmod +x "$STATE/agent"
    # The bridge forwards between the hosts; check a packet really crosses it (nothing
    # listens on port 9: a quick refusal proves the path, a timeout means it is blocked).
    if [ "$hosts" -gt 1 ]; then
        local reached=0
        timeout 3 ip netns exec "$(host_name 1)" bash -c "exec 3<>/dev/tcp/$(host_addr 0)/9" \
            2>/dev/null || reached=$?
        [ "$reached" -ne 124 ] || die "host 1 cannot reach host 0 over $BRIDGE (bridge netfilter or a firewall?)"
    fi
    echo "netns-cluster: $hosts hosts × $per_host ranks ($(host_name 0) $(host_addr 0) …), links $rate, ${LINK_DELAY:-$delay one way}"
}

# The mpirun options that place ranks on the cluster. No binding: every "host" believes it
# has all of the machine's cores, so Open MPI would bind rank 0 of each host to core 0 and
# the hosts' ranks would take turns on one core (8 ms per small all-reduce instead of 0.1).
mpirun_options() {
    read -r hosts per_host _ _ <"$STATE/size"
    # Each host's slots are its ranks, so Open MPI does not see that all hosts share this
    # machine's cores (nor that DDP's communication thread computes beside each rank): tell
    # it to yield while it waits, or its busy polling starves the rank it waits for (84 ms
    # instead of 0.55 ms for a 64 KiB all-reduce on 2 × 2 ranks over 2 cores).
    echo --allow-run-as-root --oversubscribe --hostfile "$STATE/hostfile" \
        --mca mpi_yield_when_idle 1 \
        --mca plm_rsh_agent "$STATE/agent" \
        --mca btl self,vader,tcp --mca btl_vader_single_copy_mechanism none \
        --mca btl_tcp_if_include "$SUBNET.0/24" --mca oob_tcp_if_include "$SUBNET.0/24" \
        --map-by slot --bind-to none
}

cmd=${1:-}
[ -n "$cmd" ] || usage 1
shift
hosts=2 per_host=2 rate=1gbit delay=0.5ms sized=false
while [ $# -gt 0 ]; do
    case $1 in
        --ranks-per-host) per_host=$2; sized=true; shift 2 ;;
        --rate) rate=$2; sized=true; shift 2 ;;
        --delay) delay=$2; sized=true; shift 2 ;;
        --) shift; break ;;
        -h|--help) usage 0 ;;
        [0-9]*) hosts=$1; sized=true; shift ;;
        *) [ "$cmd" = run ] && break; die "unknown option '$1'" ;;
    esac
done

case $cmd in
    up) up "$hosts" "$per_host" "$rate" "$delay" ;;
    down) down ;;
    # The mpirun options `run` uses, for launchers that call mpirun themselves.
    options) [ -f "$STATE/size" ] || die "no cluster is up (prefix $PREFIX)"; mpirun_options ;;
    status)
        if [ -f "$STATE/size" ]; then
            read -r h r ra de <"$STATE/size"
            echo "up: $h hosts × $r ranks, links $ra, $de"; tc -n "$(host_name 0)" qdisc show dev eth0
        else
            echo "down"
        fi ;;
    run)
        [ $# -gt 0 ] || die "run needs -- and the mpirun arguments (program and its arguments)"
        if $sized || [ ! -f "$STATE/size" ]; then
            trap down EXIT INT TERM
            up "$hosts" "$per_host" "$rate" "$delay"
        else
            # Someone else's cluster: leave it up, but no rank of this job may outlive it.
            trap 'for ns in $(ip netns list | awk "{print \$1}" | grep -E "^$PREFIX-host"); do
                      p=$(ip netns pids "$ns"); [ -z "$p" ] || kill -9 $p 2>/dev/null || true; done' EXIT INT TERM
        fi
        read -r hosts per_host _ _ <"$STATE/size"
        # PMIx's shared-memory store trips over several "nodes" on one machine (an error
        # line per job); its hash store does not.
        export PMIX_MCA_gds="${PMIX_MCA_gds:-hash}"
        np=()
        [[ " $* " == *" -np "* || " $* " == *" -n "* ]] || np=(-np $((hosts * per_host)))
        # shellcheck disable=SC2046
        mpirun $(mpirun_options) "${np[@]}" "$@" ;;
    *) usage 1 ;;
esac
