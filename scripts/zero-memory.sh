#!/usr/bin/env bash
# Peak memory per worker under ZeRO, one process per worker: `mpirun -np N meshtrain train`
# on a GPT of 25M parameters (512 × 8, batch 8 of 64 tokens) at dp=2 and dp=4 for stages 0–3,
# printing
# each run's measured model states (rank 0), the formula's, and the peak RSS of the largest
# process; then train.memory_limit_mb=300 refuses DDP (whose states need 389 MiB per worker)
# before the first step and lets ZeRO-3 train.
#
# Usage: bash scripts/zero-memory.sh        (needs OpenMPI, see scripts/mpi-common.sh)
source "$(dirname "$0")/mpi-common.sh"
ARGS=(train --config configs/gpt.toml --set model.dim=512 --set model.layers=8
      --set model.heads=8 --set model.seq=64 --set train.batch_size=8 --set train.eval_batches=1
      --set train.max_steps=4 --set train.threads=1)
run() { env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np "${NP:-4}" "$BIN" "${ARGS[@]}" "$@"; }

echo "| dp | zero | model states per worker (measured) | formula | transient peak | peak RSS, largest process |"
echo "|---|---|---|---|---|---|"
for dp in 2 4; do
    for z in 0 1 2 3; do
        log="$OUT/dp$dp-z$z.log"
        NP=$dp run --set parallel.zero=$z --set "train.out_dir=\"$OUT/dp$dp-z$z\"" >"$log" 2>&1 \
            || { cat "$log"; exit 1; }
        states=$(grep -o 'model states per worker [0-9.]* MiB' "$log" | awk '{print $5}')
        formula=$(grep -o 'the formula predicts [0-9.]*' "$log" | awk '{print $4}')
        transient=$(grep -o 'transient peak [0-9.]* MiB' "$log" | awk '{print $3}')
        rss=$(grep -o 'peak memory [0-9]* MiB' "$log" | awk '{print $3}')
        echo "| $dp | $z | $states MiB | $formula MiB | $transient MiB | $rss MiB |"
    done
done

echo
if run --set parallel.zero=0 --set train.memory_limit_mb=300 --set "train.out_dir=\"$OUT/limit0\"" \
    >"$OUT/limit0.log" 2>&1; then
    echo "zero-memory: FAILED: DDP over the limit ran"; exit 1
fi
grep -o "rank 0: training failed: .*at dp=4 these fit: [^;]*" "$OUT/limit0.log" | head -1
run --set parallel.zero=3 --set train.memory_limit_mb=300 --set "train.out_dir=\"$OUT/limit3\"" \
    >"$OUT/limit3.log" 2>&1 || { cat "$OUT/limit3.log"; exit 1; }
grep -E "^done|model states|peak memory" "$OUT/limit3.log"
