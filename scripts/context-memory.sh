#!/usr/bin/env bash
# Peak memory per worker under context parallelism, one process per worker: `mpirun -np C
# meshtrain train --cp C` on the GPT of configs/gpt.toml (256 × 4) at seq 8192, batch 1, flash
# attention, for C = 1, 2, 4, printing each run's activations at the peak of a step (rank 0),
# its model states and the peak RSS of the largest process; then train.memory_limit_mb=400
# refuses the one-worker run after its first step (naming the cp that fits) and lets cp=4
# train.
#
# Usage: bash scripts/context-memory.sh     (needs OpenMPI, see scripts/mpi-common.sh)
source "$(dirname "$0")/mpi-common.sh"
ARGS=(train --config configs/gpt.toml --set model.seq=8192 --set train.batch_size=1
      --set train.eval_batches=1 --set train.max_steps=2 --set train.threads=1)
run() { env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np "$1" "$BIN" "${ARGS[@]}" --cp "$@"; }

echo "| cp | activations per worker | model states per worker | peak RSS, largest process | step |"
echo "|---|---|---|---|---|"
for cp in 1 2 4; do
    log="$OUT/cp$cp.log"
    run "$cp" --set "train.out_dir=\"$OUT/cp$cp\"" >"$log" 2>&1 || { cat "$log"; exit 1; }
    act=$(grep -o 'activations [0-9.]* MiB at the peak' "$log" | awk '{print $2}')
    states=$(grep -o 'model states per worker [0-9.]* MiB' "$log" | awk '{print $5}')
    rss=$(grep -o 'peak memory [0-9]* MiB' "$log" | awk '{print $3}')
    step=$(grep -o 'per step ([^)]*): [0-9.]* ms' "$log" | grep -o '[0-9.]* ms$')
    echo "| $cp | $act MiB | $states MiB | $rss MiB | $step |"
done

echo
if run 1 --set train.memory_limit_mb=400 --set "train.out_dir=\"$OUT/limit1\"" \
    >"$OUT/limit1.log" 2>&1; then
    echo "context-memory: FAILED: one worker over the limit ran"; exit 1
fi
grep -o "the first step held .*" "$OUT/limit1.log" | head -1
run 4 --set train.memory_limit_mb=400 --set "train.out_dir=\"$OUT/limit4\"" \
    >"$OUT/limit4.log" 2>&1 || { cat "$OUT/limit4.log"; exit 1; }
grep -E "^done|activations .* at the peak|peak memory" "$OUT/limit4.log"
