#!/usr/bin/env bash
# Collective benchmarks, side by side in one sitting:
#   1. threads backend, 2 and 4 workers, 4 KiB..64 MiB all-reduce (+ memcpy reference)
#   2. PyTorch gloo all-reduce, 2 and 4 processes (if $TORCH_VENV/bin/torchrun exists)
#   3. MPI backend vs raw MPI_Allreduce, 2 and 4 processes (if mpirun exists)
# Usage (workspace root): crates/comm/scripts/bench-collectives.sh [OUT_DIR]
# Env: TORCH_VENV (default /work/torch-venv), SECONDS_PER_SIZE (default 1),
#      BENCH_PEER (default ../shared/bench-peer relative to the workspace root).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-target/bench-collectives}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TORCH_VENV=${TORCH_VENV:-/work/torch-venv}
SECS=${SECONDS_PER_SIZE:-1}
BENCH_PEER=${BENCH_PEER:-$(cd .. && pwd)/shared/bench-peer}
SIZES_MB="0.00390625,0.015625,0.0625,0.25,1,4,16,64"   # 4 KiB .. 64 MiB

echo "== load before: $(cut -d' ' -f1-3 /proc/loadavg)"
cargo build --release -p meshtrain-comm --example bench_collectives
echo "== threads backend"
target/release/examples/bench_collectives --workers 2,4 --seconds "$SECS" --json "$OUT/threads.jsonl"

if [[ -x "$TORCH_VENV/bin/torchrun" && -f "$BENCH_PEER/gloo_allreduce_bench.py" ]]; then
    for N in 2 4; do
        echo "== PyTorch gloo all_reduce, $N processes"
        (cd "$BENCH_PEER" && "$TORCH_VENV/bin/torchrun" --standalone --nproc_per_node "$N" \
            gloo_allreduce_bench.py --sizes-mb "$SIZES_MB" --seconds "$SECS" --out "$OUT/gloo.jsonl")
    done
else
    echo "== skipping gloo: $TORCH_VENV/bin/torchrun or $BENCH_PEER/gloo_allreduce_bench.py missing"
fi

if command -v mpirun >/dev/null; then
    cargo build --release -p meshtrain-comm --features mpi --example mpi_collectives
    for N in 2 4; do
        echo "== MPI backend vs raw MPI_Allreduce, $N processes"
        mpirun --allow-run-as-root --oversubscribe -np "$N" \
            target/release/examples/mpi_collectives bench --seconds "$SECS" --json "$OUT/mpi.jsonl"
    done
else
    echo "== skipping MPI: mpirun not found"
fi
echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "results: $OUT"
