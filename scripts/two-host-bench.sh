#!/usr/bin/env bash
# Issue 20's measurements on a two-tier network (docs/benchmarks.md, section 13): GPT and
# ResNet-18 on 2 hosts × 2 ranks of scripts/netns-cluster.sh (network namespaces, links shaped
# to RATE) against 1 host × 2 ranks, with flat DDP, hierarchical DDP, bf16 on the wire and (GPT)
# tp inside the host × dp across hosts; the planner's prediction of every run from the measured
# link figures; and `meshtrain plan --diagnose` on the run that crosses from one host to two.
#
# All ranks share this machine's cores, so the global batch is fixed: a 2-host run has as many
# cores as the 1-host run, and "efficiency" is its throughput over the 1-host run's (ideal 1.0).
# The planner's per-worker matrix rate is fitted once, to the 1-host data-parallel run's compute
# time; a 4-rank run gives each rank half of it, half the memory bandwidth and twice the time
# per framework op (4 ranks on 2 cores). The link figures are measured as the runs see them:
# an all-reduce between the 2 ranks of one host, and one over the 2 hosts × 2 ranks (whose bus
# bandwidth is what the planner's group across hosts gets: two ranks sharing one host's link).
#
#   bash scripts/two-host-bench.sh            # needs root, iproute2, Open MPI (mpi-common.sh)
#   RATE=1gbit GPT_STEPS=20 RESNET_STEPS=12 OUT=/tmp/two-host bash scripts/two-host-bench.sh
source "$(dirname "$0")/mpi-common.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
RATE=${RATE:-1gbit}
GPT_STEPS=${GPT_STEPS:-20}
RESNET_STEPS=${RESNET_STEPS:-12}
RESULTS=${OUT_DIR:-/tmp/two-host-bench}
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
CLUSTER=scripts/netns-cluster.sh
if ! ip netns add mt-probe-$$ 2>/dev/null; then
    echo "two-host-bench: network namespaces cannot be created here (needs root); skipped"
    exit 0
fi
ip netns del mt-probe-$$

cluster() { # hosts ranks_per_host args...
    local hosts=$1 per=$2
    shift 2
    timeout -k 5 600 bash "$CLUSTER" run "$hosts" --ranks-per-host "$per" --rate "$RATE" -- "$@"
}

echo "## link figures"
cluster 1 2 "$BIN" bench collectives --backend mpi --sizes 4K,16M --seconds 0.5 \
    >"$RESULTS/link-intra.txt" 2>&1
cluster 2 2 "$BIN" bench collectives --backend mpi --sizes 4K,16M --seconds 0.5 \
    >"$RESULTS/link-inter.txt" 2>&1
grep -E '^mpi +all_reduce' "$RESULTS/link-intra.txt" "$RESULTS/link-inter.txt"

GPT=(train --config configs/gpt.toml --set "train.max_steps=$GPT_STEPS" --set train.log_every=10
     --set train.threads=1 --set train.eval_batches=1)
RESNET=(train --config configs/resnet18.toml --set "train.max_steps=$RESNET_STEPS"
        --set train.log_every=4 --set train.threads=1 --set data.test_limit=256)
run() { # name hosts per_host args...
    local name=$1 hosts=$2 per=$3
    shift 3
    echo "== $name ($(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"
    cluster "$hosts" "$per" "$BIN" "$@" --set "train.out_dir=\"$RESULTS/$name\"" \
        >"$RESULTS/$name.log" 2>&1 || { echo "$name failed:"; tail -5 "$RESULTS/$name.log"; exit 1; }
}
FLAT=(--set 'parallel.grad_reduce="flat"')
HIER=(--set 'parallel.grad_reduce="hierarchical"')
BF16=(--set 'parallel.compression="bf16"')
for model in gpt resnet; do
    if [ $model = gpt ]; then A=("${GPT[@]}"); else A=("${RESNET[@]}"); fi
    run $model-1host-dp2 1 2 "${A[@]}" --dp 2
    run $model-2hosts-flat 2 2 "${A[@]}" --dp 4 "${FLAT[@]}"
    run $model-2hosts-hierarchical 2 2 "${A[@]}" --dp 4 "${HIER[@]}"
    run $model-2hosts-flat-bf16 2 2 "${A[@]}" --dp 4 "${FLAT[@]}" "${BF16[@]}"
    if [ $model = gpt ]; then
        run $model-1host-tp2 1 2 "${A[@]}" --dp 1 --tp 2
        run $model-2hosts-tp2-dp2 2 2 "${A[@]}" --dp 2 --tp 2
    fi
done

echo
echo "## the diagnosis of the run that left its host"
cat >"$RESULTS/diagnose.json" <<EOF
{"run": [$(cat "$RESULTS/gpt-1host-dp2/breakdown.json"), $(cat "$RESULTS/gpt-2hosts-flat/breakdown.json")]}
EOF
"$BIN" plan --diagnose "$RESULTS/diagnose.json" | tee "$RESULTS/diagnose.txt"

echo
echo "## measured vs predicted"
python3 - "$RESULTS" "$BIN" <<'PY'
import json, re, subprocess, sys
results, binary = sys.argv[1], sys.argv[2]

def allreduce(path):
    """(latency per ring step in us, bus bandwidth in GB/s) of Open MPI all-reduces of 4 KiB
    and 16 MiB, from their times (nccl-tests' bus bandwidth: 2(n-1)/n bytes per time)."""
    rows = [l.split() for l in open(path) if re.match(r"^mpi +all_reduce", l)]
    seconds = lambda r: float(r[6]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[r[7]]
    small = next(r for r in rows if r[3] == "4" and r[4] == "KiB")
    large = next(r for r in rows if r[3] == "16" and r[4] == "MiB")
    n = int(small[2])
    latency_us = 1e6 * seconds(small) / (2 * (n - 1))
    busbw = 2 * (n - 1) / n * 16 * 2**20 / seconds(large) / 1e9
    return latency_us, busbw

intra_lat, intra_bw = allreduce(f"{results}/link-intra.txt")
inter_lat, inter_bw = allreduce(f"{results}/link-inter.txt")
print(f"inside a host: {intra_bw:.3f} GB/s, {intra_lat:.1f} us per step; "
      f"between hosts: {inter_bw:.3f} GB/s, {inter_lat:.1f} us per step")

def breakdown(name):
    return json.load(open(f"{results}/{name}/breakdown.json"))

# planner model: [(run, GPUs, layout, grad reduce)]
runs = {
    "gpt": [("gpt-1host-dp2", 2, "dp=2,mb=16", "flat"),
            ("gpt-2hosts-flat", 4, "dp=4,mb=8", "flat"),
            ("gpt-2hosts-hierarchical", 4, "dp=4,mb=8", "hierarchical"),
            ("gpt-2hosts-flat-bf16", 4, "dp=4,mb=8", "flat"),
            ("gpt-1host-tp2", 2, "dp=1,tp=2,mb=32", "flat"),
            ("gpt-2hosts-tp2-dp2", 4, "dp=2,tp=2,mb=16", "flat")],
    "resnet18": [("resnet-1host-dp2", 2, "dp=2,mb=64", "flat"),
                 ("resnet-2hosts-flat", 4, "dp=4,mb=32", "flat"),
                 ("resnet-2hosts-hierarchical", 4, "dp=4,mb=32", "hierarchical"),
                 ("resnet-2hosts-flat-bf16", 4, "dp=4,mb=32", "flat")],
}

def predict(model, gpus, batch, layout, reduce, gflops, per_core=1):
    # A rank's share of the machine: its matrix rate (fitted), memory bandwidth (the
    # preset's 8 GB/s) and time per framework op (the preset's 20 us) scale with the ranks
    # per core.
    measured = {"matmul_gflops": gflops / per_core, "memory_bandwidth_gbps": 8.0 / per_core,
                "kernel_overhead_us": 20.0 * per_core, "allreduce_bus_bandwidth_gbps": intra_bw,
                "allreduce_latency_us": intra_lat, "inter_node_bandwidth_gbps": inter_bw,
                "inter_node_latency_us": inter_lat}
    path = f"{results}/measured-{gpus}.json"
    json.dump(measured, open(path, "w"))
    args = [binary, "plan", "--model", model, "--cluster",
            "crates/plan/presets/examples/cpu-2-hosts.toml", "--gpus", str(gpus),
            "--global-batch", str(batch), "--layout", layout, "--grad-reduce", reduce,
            "--precision", "fp32", "--measured", path, "--json"]
    plan = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
    return plan["plans"][0]["time"]

print()
print("| run | samples/s | efficiency vs 1 host | exposed comm ms | predicted step ms | measured step ms | error |")
print("|---|---|---|---|---|---|---|")
for model, rows in runs.items():
    first = breakdown(rows[0][0])
    batch = int(first["samples_per_step"])
    # Fit the per-worker matrix rate to the 1-host data-parallel run's compute time.
    lo, hi = 1.0, 1000.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        t = predict(model, 2, batch, rows[0][2], "flat", mid)
        if t["compute_s"] + t["recompute_s"] > first["compute_s"]:
            lo = mid
        else:
            hi = mid
    rate = (lo * hi) ** 0.5
    base = {}
    for name, gpus, layout, reduce in rows:
        b = breakdown(name)
        per_core = gpus / 2  # ranks per core on this 2-core machine
        # The MPI backend widens bf16 buckets to f32 on the wire (MPI has no bf16 sum), so
        # the bf16 run is predicted like the flat one.
        t = predict(model, gpus, batch, layout, reduce, rate, per_core)
        throughput = b["samples_per_step"] / b["step_s"]
        key = "tp" if "tp2" in name else "dp"
        base.setdefault(key, throughput)
        err = 100 * (t["step_s"] - b["step_s"]) / b["step_s"]
        print(f"| {name} | {throughput:.1f} | {throughput / base[key]:.2f} | "
              f"{1e3 * b['comm_exposed_s']:.0f} | {1e3 * t['step_s']:.0f} | "
              f"{1e3 * b['step_s']:.0f} | {err:+.1f}% |")
    print(f"({model}: matrix rate fitted to the 1-host run: {rate:.1f} GFLOP/s per worker)")
PY
