#!/usr/bin/env bash
# Pipeline × data parallelism under mpirun: `mpirun -np 4 meshtrain train --pp 2` (dp = 4 / 2,
# stages talking over the MPI backend) must train like the threads backend with --dp 2 --pp 2
# (same micro-batches, same schedule; only the order of additions inside the all-reduce may
# differ), so the final losses of 10 tiny-GPT steps agree to 1e-3; it writes the timeline of
# all four processes; and a world that is not dp × pp is a clear error, not a hang.
#
# Needs OpenMPI (see scripts/mpi-common.sh).
source "$(dirname "$0")/mpi-common.sh"
ARGS=(train --config configs/gpt.toml --set model.dim=32 --set model.layers=2
      --set model.heads=2 --set model.seq=16 --set train.batch_size=8 --set train.steps=10
      --set train.log_every=5 --set train.eval_every=5 --set train.eval_batches=2
      --set train.threads=2 --pp 2 --micro-batches 2)

env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 4 "$BIN" "${ARGS[@]}" \
    --set "train.out_dir=\"$OUT/mpi\"" --timeline "$OUT/mpi/timeline.json" >"$OUT/mpi.log" 2>&1 \
    || { cat "$OUT/mpi.log"; exit 1; }
"$BIN" "${ARGS[@]}" --dp 2 --set "train.out_dir=\"$OUT/threads\"" >"$OUT/threads.log" 2>&1 \
    || { cat "$OUT/threads.log"; exit 1; }
grep -q "dp 2 × pp 2" "$OUT/mpi.log" || { cat "$OUT/mpi.log"; exit 1; }
same_final_loss mpi-pipeline-test "$OUT/mpi.log" "$OUT/threads.log"
python3 -c "import json,sys; e=json.load(open('$OUT/mpi/timeline.json'))['traceEvents']; \
sys.exit(0 if {x['pid'] for x in e} == {0,1,2,3} else 1)" \
    || { echo "mpi-pipeline-test: FAILED: timeline lacks a rank"; exit 1; }
test -s "$OUT/mpi/timeline.png"
if env -u RUST_BACKTRACE mpirun --allow-run-as-root --oversubscribe -np 3 "$BIN" "${ARGS[@]}" \
    --set "train.out_dir=\"$OUT/bad\"" >"$OUT/bad.log" 2>&1; then
    echo "mpi-pipeline-test: FAILED: --pp 2 under 3 ranks succeeded"; exit 1
fi
grep -q "mpirun started 3 processes, not a multiple of the 2 workers" "$OUT/bad.log" \
    || { cat "$OUT/bad.log"; exit 1; }
echo "mpi-pipeline-test: OK"
