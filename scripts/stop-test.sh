#!/usr/bin/env bash
# Graceful stop under mpirun and `meshtrain launch` (~1 min): a small GPT on 2 ranks,
#   1. `mpirun -np 2 meshtrain train` (ZeRO-1: every rank writes its shard of the checkpoint)
#      and SIGINT to both ranks mid-run, as a terminal's Ctrl-C or `srun` delivers it: mpirun
#      exits 130, every rank's shard and the index are at the step rank 0 names, and resuming
#      to 3 steps later is bit-identical to a run that was never stopped;
#   2. `meshtrain launch --np 2` and SIGTERM to the launcher (what a scheduler sends): it
#      forwards the stop to every rank (SIGUSR1 through mpirun), does not restart, exits 143
#      and prints the command that resumes; that command, run to 3 steps later, is
#      bit-identical to an uninterrupted run;
#   3. SIGTERM twice to the launcher: it ends the job at once (no rank left running), 143.
# (The threads backend: crates/meshtrain/tests/graceful_stop.rs.)
#
# Needs OpenMPI (see scripts/mpi-common.sh).
source "$(dirname "$0")/mpi-common.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 MESHTRAIN_TIMEOUT_S=30
JOB=(--config configs/gpt.toml --set model.dim=64 --set model.layers=2 --set model.heads=4
     --set model.seq=32 --set train.batch_size=8 --set train.steps=100000
     --set train.eval_every=100000 --set train.log_every=1 --set train.threads=1)
fail() { echo "stop-test: FAILED: $*"; exit 1; }

wait_for_step() {  # DIR STEP
    local i
    for ((i = 0; i < 600; i++)); do
        grep -q "\"step\":$2," "$1/metrics.jsonl" 2>/dev/null && return
        sleep 0.1
    done
    fail "$1 never reached step $2"
}

rank_pids() {  # DIR: the rank processes of the run writing into DIR
    local pid
    for pid in $(pgrep -f "$1\\\""); do
        tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -q "^OMPI_COMM_WORLD_RANK=" && echo "$pid"
    done
}

step_of() {  # CHECKPOINT (whole file or sharded directory)
    [ -d "$1" ] && { "$BIN" checkpoint info "$1" | grep -o -m1 'step [0-9]*' | head -1 | awk '{print $2}'; return; }
    python3 - "$1" <<'EOF'
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    print(json.loads(f.read(n))["__metadata__"]["step"])
EOF
}

same_state() {  # A B (whole files or sharded directories): every tensor bit-identical
    same_checkpoint "$(whole_checkpoint "$1")" "$(whole_checkpoint "$2")"
}

echo "1. mpirun -np 2, ZeRO-1 (sharded checkpoint), SIGINT to every rank"
RUN="$OUT/mpi"
mpirun --oversubscribe -np 2 "$BIN" train "${JOB[@]}" --set parallel.zero=1 \
    --set "train.out_dir=\"$RUN\"" >"$OUT/mpi.log" 2>&1 &
MPIRUN=$!
wait_for_step "$RUN" 3
kill -INT $(rank_pids "$RUN")
status=0; wait $MPIRUN || status=$?
[ "$status" = 130 ] || { cat "$OUT/mpi.log"; fail "mpirun exited $status, not 130"; }
STEP=$(step_of "$RUN/checkpoint")
grep -q "stopped by SIGINT after step $STEP: checkpoint saved to $RUN/checkpoint" "$OUT/mpi.log" \
    || { cat "$OUT/mpi.log"; fail "no stop message at step $STEP"; }
python3 - "$RUN/checkpoint" "$STEP" <<'EOF' || fail "the shards are not all at the stop step"
import json, os, sys
index = json.load(open(os.path.join(sys.argv[1], "index.json")))
files = [f["path"] for f in index["files"]]
ranks = sorted({f["rank"] for f in index["files"]})
print(f"  index at step {index['step']}; shard files {', '.join(files)} written by ranks {ranks}")
assert ranks == [0, 1]
assert index["step"] == int(sys.argv[2])
assert all(os.path.exists(os.path.join(sys.argv[1], f)) for f in files)
EOF
RESUME=$(grep -o 'resume with: .*' "$OUT/mpi.log" | head -1 | cut -d' ' -f3-)
echo "  exit 130 after step $STEP; printed: ${RESUME:0:60}… --resume $RUN/checkpoint"
[[ "$RESUME" == "mpirun -np 2 "*"--resume $RUN/checkpoint" ]] || fail "resume command: $RESUME"
UNTIL=$((STEP + 3))
eval "${RESUME/mpirun/mpirun --oversubscribe}" --set train.max_steps=$UNTIL >"$OUT/mpi-resumed.log" 2>&1 \
    || { cat "$OUT/mpi-resumed.log"; fail "resuming"; }
mpirun --oversubscribe -np 2 "$BIN" train "${JOB[@]}" --set parallel.zero=1 \
    --set "train.out_dir=\"$OUT/mpi-straight\"" --set train.max_steps=$UNTIL >"$OUT/mpi-straight.log" 2>&1 \
    || { cat "$OUT/mpi-straight.log"; fail "the uninterrupted run"; }
same_state "$RUN/checkpoint" "$OUT/mpi-straight/checkpoint" || fail "the resumed run differs"

echo "2. meshtrain launch --np 2, SIGTERM to the launcher"
RUN="$OUT/launch"
"$BIN" launch --np 2 --mpirun-arg=--oversubscribe -- "${JOB[@]}" --set "train.out_dir=\"$RUN\"" \
    >"$OUT/launch.log" 2>&1 &
LAUNCH=$!
wait_for_step "$RUN" 3
kill -TERM $LAUNCH
status=0; wait $LAUNCH || status=$?
[ "$status" = 143 ] || { cat "$OUT/launch.log"; fail "launch exited $status, not 143"; }
grep -q "launch: attempt 2" "$OUT/launch.log" && { cat "$OUT/launch.log"; fail "launch restarted a stopped job"; }
STEP=$(step_of "$RUN/checkpoint.safetensors")
grep -q "launch: stopped by SIGTERM on attempt 1: the job saved its checkpoint at step $STEP" "$OUT/launch.log" \
    || { cat "$OUT/launch.log"; fail "no stop message"; }
RESUME=$(grep -o 'launch: resume with: .*' "$OUT/launch.log" | cut -d' ' -f4-)
echo "  exit 143 after step $STEP, no restart; printed: ${RESUME:0:40}… --resume $RUN/checkpoint.safetensors"
[[ "$RESUME" == *" launch "*"--resume $RUN/checkpoint.safetensors" ]] || fail "resume command: $RESUME"
UNTIL=$((STEP + 3))
eval "$RESUME" --set train.max_steps=$UNTIL >"$OUT/launch-resumed.log" 2>&1 \
    || { cat "$OUT/launch-resumed.log"; fail "resuming"; }
"$BIN" launch --np 2 --mpirun-arg=--oversubscribe -- "${JOB[@]}" \
    --set "train.out_dir=\"$OUT/launch-straight\"" --set train.max_steps=$UNTIL \
    >"$OUT/launch-straight.log" 2>&1 || { cat "$OUT/launch-straight.log"; fail "the uninterrupted run"; }
same_state "$RUN/checkpoint.safetensors" "$OUT/launch-straight/checkpoint.safetensors" \
    || fail "the resumed run differs"
echo "3. meshtrain launch, SIGTERM twice: the job ends at once, no rank left behind"
RUN="$OUT/twice"
"$BIN" launch --np 2 --mpirun-arg=--oversubscribe -- "${JOB[@]}" --set "train.out_dir=\"$RUN\"" \
    >"$OUT/twice.log" 2>&1 &
LAUNCH=$!
wait_for_step "$RUN" 3
kill -TERM $LAUNCH; sleep 0.05; kill -TERM $LAUNCH
status=0; wait $LAUNCH || status=$?
[ "$status" = 143 ] || { cat "$OUT/twice.log"; fail "launch exited $status, not 143"; }
sleep 2
[ -z "$(rank_pids "$RUN")" ] || fail "ranks still running after the launcher exited"
echo "  exit 143, no rank left running"
echo "stop-test: passed"
