#!/usr/bin/env bash
# End-to-end data-parallel training on two "hosts" (network namespaces, scripts/netns-cluster.sh)
# of two ranks each, under mpirun: ranks on a host share memory, hosts talk TCP over a shaped
# link. Flat and hierarchical DDP must reach the threads backend's final loss (4 workers on
# simulated hosts of 2) within 1e-3, the hierarchical run must say it reduced hierarchically,
# and every rank must have reached rank 0's failure monitor across the namespaces.
#
# Skips (exit 0, with a message) where network namespaces cannot be created (CI containers).
# Needs OpenMPI (see scripts/mpi-common.sh) and root.
source "$(dirname "$0")/mpi-common.sh"
# The cluster script names its own interfaces; loopback-only TCP would keep hosts apart.
unset OMPI_MCA_btl_tcp_if_include
CLUSTER=scripts/netns-cluster.sh
# Its own names and subnet, so that a cluster someone left up does not get in the way.
export MESHTRAIN_NETNS_PREFIX=mtt MESHTRAIN_NETNS_SUBNET=10.239.0

status=0
bash "$CLUSTER" up 2 --ranks-per-host 2 --rate 1gbit --delay 0.5ms >"$OUT/up.log" 2>&1 || status=$?
if [ "$status" -eq 2 ]; then
    echo "netns-cluster-test: SKIPPED: $(tail -1 "$OUT/up.log")"
    exit 0
elif [ "$status" -ne 0 ]; then
    cat "$OUT/up.log"; exit 1
fi
trap 'bash "$CLUSTER" down; rm -rf "$OUT"' EXIT

ARGS=(train --dp 4 --set train.max_steps=30 --set train.log_every=10 --set data.train_limit=4096
      --set train.batch_size=64 --set train.threads=1)

for reduce in flat hierarchical; do
    timeout -k 5 100 bash "$CLUSTER" run -- "$BIN" "${ARGS[@]}" \
        --set "parallel.grad_reduce=\"$reduce\"" --set "train.out_dir=\"$OUT/$reduce\"" \
        >"$OUT/$reduce.log" 2>&1 || { cat "$OUT/$reduce.log"; exit 1; }
    grep -q "over 4 data-parallel workers" "$OUT/$reduce.log" || { cat "$OUT/$reduce.log"; exit 1; }
    if grep -q "without its failure monitor" "$OUT/$reduce.log"; then
        cat "$OUT/$reduce.log"; echo "netns-cluster-test: FAILED: a rank could not reach the monitor"; exit 1
    fi
done
grep -q "hierarchical all-reduce" "$OUT/hierarchical.log" || { cat "$OUT/hierarchical.log"; exit 1; }
if grep -q "hierarchical all-reduce" "$OUT/flat.log"; then
    echo "netns-cluster-test: FAILED: grad_reduce=flat reduced hierarchically"; exit 1
fi
"$BIN" "${ARGS[@]}" --set parallel.ranks_per_host=2 --set "train.out_dir=\"$OUT/threads\"" \
    >"$OUT/threads.log" 2>&1 || { cat "$OUT/threads.log"; exit 1; }
same_final_loss netns-flat "$OUT/flat.log" "$OUT/threads.log"
same_final_loss netns-hierarchical "$OUT/hierarchical.log" "$OUT/threads.log"
echo "netns-cluster-test: OK"
