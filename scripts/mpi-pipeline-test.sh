#!/usr/bin/env bash
# Pipeline × data parallelism under mpirun: `mpirun -np 4 meshtrain train --pp 2` (dp = 4 / 2,
# stages talking over the MPI backend) must train like the threads backend with --dp 2 --pp 2
# (same micro-batches, same schedule; only the order of additions inside the all-reduce may
# differ), so the final losses of 10 tiny-GPT steps agree to 1e-3; it writes the timeline of
# all four processes; and a world that is not dp × pp is a clear error, not a hang.
#
# Needs: apt-get install -y libopenmpi-dev openmpi-bin libclang-dev
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_MCA_btl="self,vader,tcp"
export OMPI_MCA_btl_tcp_if_include="lo"
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
cargo build --release -p meshtrain --features mpi
BIN="$OUT/meshtrain-mpi"
cp target/release/meshtrain "$BIN"
ARGS=(train --config configs/gpt.toml --set model.dim=32 --set model.layers=2
      --set model.heads=2 --set model.seq=16 --set train.batch_size=8 --set train.steps=10
      --set train.log_every=5 --set train.eval_every=5 --set train.eval_batches=2
      --set train.threads=2 --pp 2 --micro-batches 2)

final_loss() { grep -o 'final train loss [0-9.]*' "$1" | awk '{print $4}'; }

env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 4 "$BIN" "${ARGS[@]}" \
    --set "train.out_dir=\"$OUT/mpi\"" --timeline "$OUT/mpi/timeline.json" >"$OUT/mpi.log" 2>&1 \
    || { cat "$OUT/mpi.log"; exit 1; }
"$BIN" "${ARGS[@]}" --dp 2 --set "train.out_dir=\"$OUT/threads\"" >"$OUT/threads.log" 2>&1 \
    || { cat "$OUT/threads.log"; exit 1; }
A=$(final_loss "$OUT/mpi.log")
B=$(final_loss "$OUT/threads.log")
echo "mpi-pipeline-test: final loss MPI $A, threads $B"
grep -q "dp 2 × pp 2" "$OUT/mpi.log" || { cat "$OUT/mpi.log"; exit 1; }
python3 -c "import sys; a, b = float('$A'), float('$B'); sys.exit(0 if abs(a - b) < 1e-3 else 1)" \
    || { echo "mpi-pipeline-test: FAILED: losses differ"; exit 1; }
python3 -c "import json,sys; e=json.load(open('$OUT/mpi/timeline.json'))['traceEvents']; \
sys.exit(0 if {x['pid'] for x in e} == {0,1,2,3} else 1)" \
    || { echo "mpi-pipeline-test: FAILED: timeline lacks a rank"; exit 1; }
test -s "$OUT/mpi/timeline.png"
if env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 3 "$BIN" "${ARGS[@]}" \
    --set "train.out_dir=\"$OUT/bad\"" >"$OUT/bad.log" 2>&1; then
    echo "mpi-pipeline-test: FAILED: --pp 2 under 3 ranks succeeded"; exit 1
fi
grep -q "mpirun started 3 processes, not a multiple of parallel.pp=2" "$OUT/bad.log" \
    || { cat "$OUT/bad.log"; exit 1; }
echo "mpi-pipeline-test: OK"
