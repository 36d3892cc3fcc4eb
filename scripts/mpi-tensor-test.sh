#!/usr/bin/env bash
# Tensor parallelism under mpirun: `mpirun -np 4 meshtrain train --tp 2 --pp 2` (tensor-parallel
# ranks adjacent, pipeline stages across them, every collective over the MPI backend) and
# `mpirun -np 4 ... --tp 2 --dp 2` with sequence parallelism must train like the threads
# backend with the same layout (only the order of additions inside the collectives may
# differ), so the final losses of 10 tiny-GPT steps agree to 1e-3; and a world that tp × pp
# does not divide is a clear error, not a hang.
#
# Needs OpenMPI (see scripts/mpi-common.sh).
source "$(dirname "$0")/mpi-common.sh"
ARGS=(train --config configs/gpt.toml --set model.dim=32 --set model.layers=2
      --set model.heads=4 --set model.seq=16 --set train.batch_size=8 --set train.steps=10
      --set train.log_every=5 --set train.eval_every=5 --set train.eval_batches=2
      --set train.threads=2)

for layout in "tp=2,pp=2,m=2" "dp=2,tp=2,sp=on"; do
    name=${layout//[=,]/-}
    env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 4 "$BIN" "${ARGS[@]}" \
        --layout "$layout" --set "train.out_dir=\"$OUT/mpi-$name\"" >"$OUT/mpi-$name.log" 2>&1 \
        || { cat "$OUT/mpi-$name.log"; exit 1; }
    "$BIN" "${ARGS[@]}" --layout "$layout" --set "train.out_dir=\"$OUT/threads-$name\"" \
        >"$OUT/threads-$name.log" 2>&1 || { cat "$OUT/threads-$name.log"; exit 1; }
    grep -q "tp 2" "$OUT/mpi-$name.log" || { cat "$OUT/mpi-$name.log"; exit 1; }
    same_final_loss "mpi-tensor-test $layout" "$OUT/mpi-$name.log" "$OUT/threads-$name.log"
done
if env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 6 "$BIN" "${ARGS[@]}" \
    --layout "tp=4" --set "train.out_dir=\"$OUT/bad\"" >"$OUT/bad.log" 2>&1; then
    echo "mpi-tensor-test: FAILED: tp=4 under 6 ranks succeeded"; exit 1
fi
grep -q "mpirun started 6 processes, not a multiple of the 4 workers" "$OUT/bad.log" \
    || { cat "$OUT/bad.log"; exit 1; }
echo "mpi-tensor-test: OK"
