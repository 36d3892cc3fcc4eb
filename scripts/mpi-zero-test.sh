#!/usr/bin/env bash
# ZeRO under mpirun: `mpirun -np 4 meshtrain train` with ZeRO-3 at dp=4 and ZeRO-2 at
# dp=2 × tp=2 (reduce-scatters and all-gathers over the MPI backend, started asynchronously
# while compute goes on) must train like the threads backend with the same layout (only the
# order of additions inside the collectives may differ), so the final losses of 10 tiny-GPT
# steps agree to 1e-3. The sharded checkpoint the 4 MPI processes write (each its own shard,
# rank 0 the index) then resumes on one worker of the threads backend, and
# `meshtrain checkpoint consolidate` turns it into one file that resumes the same way.
#
# Needs OpenMPI (see scripts/mpi-common.sh).
source "$(dirname "$0")/mpi-common.sh"
ARGS=(train --config configs/gpt.toml --set model.dim=32 --set model.layers=2
      --set model.heads=4 --set model.seq=16 --set train.batch_size=8 --set train.steps=12
      --set train.max_steps=10 --set train.log_every=5 --set train.eval_every=5
      --set train.eval_batches=2 --set train.threads=1)

for layout in "dp=4,zero=3" "dp=2,tp=2,zero=2"; do
    name=${layout//[=,]/-}
    env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 4 "$BIN" "${ARGS[@]}" \
        --layout "$layout" --set "train.out_dir=\"$OUT/mpi-$name\"" >"$OUT/mpi-$name.log" 2>&1 \
        || { cat "$OUT/mpi-$name.log"; exit 1; }
    "$BIN" "${ARGS[@]}" --layout "$layout" --set "train.out_dir=\"$OUT/threads-$name\"" \
        >"$OUT/threads-$name.log" 2>&1 || { cat "$OUT/threads-$name.log"; exit 1; }
    grep -q "model states per worker" "$OUT/mpi-$name.log" || { cat "$OUT/mpi-$name.log"; exit 1; }
    same_final_loss "mpi-zero-test $layout" "$OUT/mpi-$name.log" "$OUT/threads-$name.log"
done

# The MPI run's sharded checkpoint: 4 shard files and an index.
CKPT="$OUT/mpi-dp-4-zero-3/checkpoint"
"$BIN" checkpoint info "$CKPT" | tee "$OUT/info.log"
grep -q "4 shard file(s)" "$OUT/info.log" || { echo "mpi-zero-test: FAILED: not 4 shards"; exit 1; }
# Resumed on one worker from the shards and from the consolidated file: the same run.
"$BIN" checkpoint consolidate "$CKPT" "$OUT/whole.safetensors"
for from in "$CKPT" "$OUT/whole.safetensors"; do
    name=$(basename "$from")
    "$BIN" "${ARGS[@]}" --set train.max_steps=12 --resume "$from" \
        --set "train.out_dir=\"$OUT/resumed-$name\"" >"$OUT/resumed-$name.log" 2>&1 \
        || { cat "$OUT/resumed-$name.log"; exit 1; }
done
a=$(final_loss "$OUT/resumed-checkpoint.log")
b=$(final_loss "$OUT/resumed-whole.safetensors.log")
echo "mpi-zero-test: resumed from shards $a, from the consolidated file $b"
[ "$a" = "$b" ] || { echo "mpi-zero-test: FAILED: resumed runs differ"; exit 1; }
echo "mpi-zero-test: OK"
