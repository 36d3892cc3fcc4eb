#!/usr/bin/env bash
# End-to-end data-parallel training under mpirun: `mpirun -np 2 meshtrain train` (DDP over the
# MPI backend) must train like the threads backend with --dp 2 (same global batches, same
# averaging; only the order of floating-point additions inside the all-reduce may differ),
# so the final losses of 30 LeNet steps agree to 1e-3; fp16 and the single-master mode too.
#
# Needs OpenMPI (see scripts/mpi-common.sh).
source "$(dirname "$0")/mpi-common.sh"
ARGS=(train --set train.max_steps=30 --set train.log_every=10 --set data.train_limit=4096
      --set train.batch_size=64 --set train.threads=2)

env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 2 "$BIN" "${ARGS[@]}" \
    --set "train.out_dir=\"$OUT/mpi\"" >"$OUT/mpi.log" 2>&1 || { cat "$OUT/mpi.log"; exit 1; }
"$BIN" "${ARGS[@]}" --dp 2 --set "train.out_dir=\"$OUT/threads\"" >"$OUT/threads.log" 2>&1 \
    || { cat "$OUT/threads.log"; exit 1; }
grep -q "over 2 data-parallel workers" "$OUT/mpi.log" || { cat "$OUT/mpi.log"; exit 1; }
same_final_loss mpi-train-test "$OUT/mpi.log" "$OUT/threads.log"
# Mixed precision over MPI: fp16's overflow check is a max all-reduce over the MPI world.
env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 2 "$BIN" "${ARGS[@]}" \
    --precision fp16 --set "train.out_dir=\"$OUT/mpi-fp16\"" >"$OUT/mpi-fp16.log" 2>&1 \
    || { cat "$OUT/mpi-fp16.log"; exit 1; }
"$BIN" "${ARGS[@]}" --dp 2 --precision fp16 --set "train.out_dir=\"$OUT/threads-fp16\"" \
    >"$OUT/threads-fp16.log" 2>&1 || { cat "$OUT/threads-fp16.log"; exit 1; }
same_final_loss mpi-train-test-fp16 "$OUT/mpi-fp16.log" "$OUT/threads-fp16.log"
# The single master (nn.DataParallel) over MPI: the batch scattered and the gradients sent to
# rank 0 point to point (tags within MPI's guaranteed 32767).
env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 2 "$BIN" "${ARGS[@]}" \
    --dp-mode single-master --set "train.out_dir=\"$OUT/mpi-master\"" >"$OUT/mpi-master.log" 2>&1 \
    || { cat "$OUT/mpi-master.log"; exit 1; }
"$BIN" "${ARGS[@]}" --dp 2 --dp-mode single-master --set "train.out_dir=\"$OUT/threads-master\"" \
    >"$OUT/threads-master.log" 2>&1 || { cat "$OUT/threads-master.log"; exit 1; }
grep -q "(single-master)" "$OUT/mpi-master.log" || { cat "$OUT/mpi-master.log"; exit 1; }
same_final_loss mpi-train-test-single-master "$OUT/mpi-master.log" "$OUT/threads-master.log"
# A dp that contradicts the MPI world size is a clear error, not a hang.
if env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 2 "$BIN" "${ARGS[@]}" --dp 4 \
    >"$OUT/bad.log" 2>&1; then
    echo "mpi-train-test: FAILED: --dp 4 under 2 ranks succeeded"; exit 1
fi
grep -q "mpirun started 2 processes" "$OUT/bad.log" || { cat "$OUT/bad.log"; exit 1; }
echo "mpi-train-test: OK"
