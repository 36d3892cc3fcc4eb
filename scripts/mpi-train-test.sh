#!/usr/bin/env bash
# End-to-end data-parallel training under mpirun: `mpirun -np 2 meshtrain train` (DDP over the
# MPI backend) must train like the threads backend with --dp 2 (same global batches, same
# averaging; only the order of floating-point additions inside the all-reduce may differ),
# so the final losses of 30 LeNet steps agree to 1e-3.
#
# Needs: apt-get install -y libopenmpi-dev openmpi-bin libclang-dev
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_MCA_btl="self,vader,tcp"
export OMPI_MCA_btl_tcp_if_include="lo"
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
# Same target dir as the tests (only the crates behind the feature rebuild); keep a copy of
# the binary since a later plain build replaces it.
cargo build --release -p meshtrain --features mpi
BIN="$OUT/meshtrain-mpi"
cp target/release/meshtrain "$BIN"
ARGS=(train --set train.max_steps=30 --set train.log_every=10 --set data.train_limit=4096
      --set train.batch_size=64 --set train.threads=2)

final_loss() { grep -o 'final train loss [0-9.]*' "$1" | awk '{print $4}'; }

env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 2 "$BIN" "${ARGS[@]}" \
    --set "train.out_dir=\"$OUT/mpi\"" >"$OUT/mpi.log" 2>&1 || { cat "$OUT/mpi.log"; exit 1; }
"$BIN" "${ARGS[@]}" --dp 2 --set "train.out_dir=\"$OUT/threads\"" >"$OUT/threads.log" 2>&1 \
    || { cat "$OUT/threads.log"; exit 1; }
A=$(final_loss "$OUT/mpi.log")
B=$(final_loss "$OUT/threads.log")
echo "mpi-train-test: final loss MPI $A, threads $B"
grep -q "over 2 data-parallel workers" "$OUT/mpi.log" || { cat "$OUT/mpi.log"; exit 1; }
python3 -c "import sys; a, b = float('$A'), float('$B'); sys.exit(0 if abs(a - b) < 1e-3 else 1)" \
    || { echo "mpi-train-test: FAILED: losses differ"; exit 1; }
# A dp that contradicts the MPI world size is a clear error, not a hang.
if env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 2 "$BIN" "${ARGS[@]}" --dp 4 \
    >"$OUT/bad.log" 2>&1; then
    echo "mpi-train-test: FAILED: --dp 4 under 2 ranks succeeded"; exit 1
fi
grep -q "mpirun started 2 processes" "$OUT/bad.log" || { cat "$OUT/bad.log"; exit 1; }
echo "mpi-train-test: OK"
