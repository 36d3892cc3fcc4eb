#!/usr/bin/env bash
# Context parallelism under mpirun: `mpirun -np 4 meshtrain train --cp 2 --dp 2` with ring
# attention (key/value blocks sent around the ring between processes) and with Ulysses
# (all-to-alls over the MPI backend), and `--cp 2 --tp 2`, must train like the threads backend
# with the same layout: the final losses of 10 tiny-GPT steps agree to 1e-3.
#
# Needs OpenMPI (see scripts/mpi-common.sh).
source "$(dirname "$0")/mpi-common.sh"
ARGS=(train --config configs/gpt.toml --set model.dim=32 --set model.layers=2
      --set model.heads=4 --set model.seq=32 --set train.batch_size=8 --set train.steps=10
      --set train.log_every=5 --set train.eval_every=5 --set train.eval_batches=2
      --set train.threads=2)

for case in "dp=2,cp=2:ring" "dp=2,cp=2:ulysses" "tp=2,cp=2:ring"; do
    layout=${case%%:*}
    mode=${case##*:}
    name=${layout//[=,]/-}-$mode
    env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 4 "$BIN" "${ARGS[@]}" \
        --layout "$layout" --set "parallel.cp_mode=\"$mode\"" \
        --set "train.out_dir=\"$OUT/mpi-$name\"" >"$OUT/mpi-$name.log" 2>&1 \
        || { cat "$OUT/mpi-$name.log"; exit 1; }
    "$BIN" "${ARGS[@]}" --layout "$layout" --set "parallel.cp_mode=\"$mode\"" \
        --set "train.out_dir=\"$OUT/threads-$name\"" >"$OUT/threads-$name.log" 2>&1 \
        || { cat "$OUT/threads-$name.log"; exit 1; }
    grep -q "cp 2" "$OUT/mpi-$name.log" || { cat "$OUT/mpi-$name.log"; exit 1; }
    same_final_loss "mpi-context-test $layout $mode" "$OUT/mpi-$name.log" "$OUT/threads-$name.log"
done

echo "mpi-context-test: OK"
