#!/usr/bin/env bash
# One process per GPU over NCCL, end to end, on the emulated CUDA device with two GPUs
# (crates/tensor/tests/cuda_emu/device: EMU_DEVICE_COUNT=2, asynchronous streams, its emulated
# NCCL meets the ranks of the two processes through a shared file), a small GPT trained by
# `meshtrain launch --gpus 2`
# (rank r on cuda:r, gradients over NCCL) against one GPU on the same global batch:
#   1. fp32 DDP: final parameters and optimizer state within 1e-5 relative L2 of one GPU's;
#   2. ZeRO-1, 2 and 3 over NCCL: bit-identical to DDP over NCCL (ZeRO-3's sharded
#      checkpoint joined first), as on the CPU; the single master (nn.DataParallel) within
#      1e-5 of one GPU's;
#   3. pp = 2 (1F1B: sends that cross; interleaved: around from the last stage to the first)
#      and cp = 2 ring attention, sending over NCCL (a communicator per pair that sends):
#      within 1e-5 of one GPU's, as DDP (GPipe, whose sends never cross, passed by hand);
#   3b. tp = 2 with sequence parallelism and cp = 2 Ulysses over NCCL: within 1e-5 of one
#      GPU's;
#   4. bf16 DDP: the final loss within 0.1% of one GPU's in bf16;
#   5. SIGTERM to the launcher at step 3 (graceful stop): exit 143, every rank's checkpoint at
#      the same step, and the printed resume command ends bit-identical to DDP over NCCL;
#   6. kill -9 of rank 1 at step 4, under DDP and under pp = 2 1F1B: rank 0 fails within the
#      timeout + 2 s (in practice at once: the failure monitor reports the death and the NCCL
#      watchdog's position board fails the operation waiting for it; the kill lands mid-step,
#      so that operation may begin after the rest of the step's work, up to a second on the
#      emulated device), naming the NCCL operation and its sequence number (a pipeline's: the
#      receive on the pair's lane), and the rank it waited for; launch restarts from the
#      step-3 checkpoint, and the final state is bit-identical to the uninterrupted NCCL run's.
# With EMU_NCCL_GPUS=4 (not in CI: 4 processes on 2 cores, about 4 minutes, timeout 20 s):
# 4 GPUs as 2 hosts of 2 (`parallel.ranks_per_host`), DDP's hierarchical all-reduce over NCCL
# sub-communicators against one GPU, `auto` there (flat: NCCL follows the hosts itself), and
# a kill -9 under the hierarchical all-reduce and under the flat one (a communicator of four:
# the missing rank named from the failure monitor's position board), restarted bit-identical.
# What no emulation shows: speed, overlap (every call completes when issued), NCCL itself.
#
# Needs OpenMPI (see scripts/mpi-common.sh), g++ and CUDA's headers (the device's build.sh;
# without them this is skipped, or fails under MESHTRAIN_REQUIRE_EMU_DEVICE=1).
source "$(dirname "$0")/mpi-common.sh"
set +e
device=$(bash crates/tensor/tests/cuda_emu/device/build.sh)
status=$?
set -e
if [ $status = 2 ]; then
    [ "${MESHTRAIN_REQUIRE_EMU_DEVICE:-}" = 1 ] && { echo "emu-nccl-test: FAILED: no emulated device"; exit 1; }
    echo "emu-nccl-test: skipped, the emulated CUDA device cannot be built here"; exit 0
fi
[ $status = 0 ] || exit 1
export LD_LIBRARY_PATH="$device" CUDA_INCLUDE_DIRS="$device/include" MESHTRAIN_KERNEL_CACHE=off
# Each stream on a thread of its own, with random delays: NCCL's calls return before their
# work is done, as on a card, and a missing wait between streams reads stale data.
export EMU_DEVICE_STREAMS=${EMU_DEVICE_STREAMS:-async} EMU_DEVICE_STREAM_DELAY_US=${EMU_DEVICE_STREAM_DELAY_US:-50}
GPUS=${EMU_NCCL_GPUS:-2}
# More processes than cores start their communicators slowly: a longer timeout beyond two.
TIMEOUT_S=$([ "$GPUS" = 2 ] && echo 3 || echo 20)
export EMU_DEVICE_COUNT=$GPUS OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MESHTRAIN_TIMEOUT_S=$TIMEOUT_S OMPI_MCA_orte_abort_on_non_zero_status=0
JOB=(--config configs/gpt.toml --set model.dim=64 --set model.layers=2 --set model.heads=2
     --set model.seq=32 --set train.batch_size=8 --set train.steps=40 --set train.max_steps=8
     --set train.tf32=false --set train.eval_every=1000 --set train.log_every=1
     --set train.threads=1 --set checkpoint.every_steps=3
     --set train.checkpoint_background=false)
fail() { echo "emu-nccl-test: FAILED: $*"; exit 1; }

# run NAME [launch options] -- [job options]: `meshtrain launch` (or, with --one, the job on
# one GPU), its output timestamped into $OUT/NAME.log.
run() {
    local name=$1; shift
    local launch=() job=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do launch+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    job=("$@")
    local cmd
    if [ "${launch[0]:-}" = --one ]; then
        cmd=("$BIN" train --device cuda "${JOB[@]}" "${job[@]}")
    else
        cmd=("$BIN" launch --gpus "$GPUS" --mpirun-arg=--oversubscribe "${launch[@]}" -- "${JOB[@]}" "${job[@]}")
    fi
    local status=0
    # Bounded: a job that never ends fails here (exit 124 or 143) rather than holding CI.
    timeout -k 10 300 "${cmd[@]}" --set "train.out_dir=\"$OUT/$name\"" 2>&1 \
        | python3 -u -c 'import sys, time
for line in sys.stdin: print(f"{time.time():.3f} {line}", end="", flush=True)' \
        >"$OUT/$name.log" || status=$?
    [ $status = 0 ] || { cat "$OUT/$name.log"; fail "$name exited $status"; }
}

checkpoint_of() {  # NAME: its final checkpoint as one file
    if [ -d "$OUT/$1/checkpoint" ]; then whole_checkpoint "$OUT/$1/checkpoint"
    else echo "$OUT/$1/checkpoint.safetensors"; fi
}

rank_pid() {  # NAME RANK
    local pid
    for pid in $(pgrep -f "$OUT/$1\\\""); do
        tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" \
            && { echo "$pid"; return; }
    done
    fail "no rank $2 of $1"
}

# killed NAME REFERENCE [job options]: kill -9 of rank 1 at step 4 of NAME (run with the job
# options); rank 0 must fail within the timeout + 2 s naming the operation that waited for
# rank 1, and launch's restart from the step-3 checkpoint must end bit-identical to
# REFERENCE, the same job uninterrupted.
killed() {
    local name=$1 reference=$2; shift 2
    echo "== kill -9 of rank 1 at step 4 ($name)"
    run "$name" --max-restarts 1 -- "$@" &
    local runner=$! i at line
    for ((i = 0; i < 1200; i++)); do
        grep -q '"step":4,' "$OUT/$name/metrics.jsonl" 2>/dev/null && break
        sleep 0.1
    done
    at=$(date +%s.%N)
    kill -KILL "$(rank_pid "$name" 1)"
    wait $runner
    # A collective with its sequence number, or a pipeline's send or receive with its number
    # among the messages to or from its peer (`recv #17 from rank 1 on group …`), whichever
    # rank 0 was waiting in when rank 1 died.
    line=$(grep -m1 -E "error: rank 0: .*[a-z_]+ #[0-9]+ ((from|to) rank [0-9]+ )?on group .*(timed out|cannot complete)" "$OUT/$name.log") \
        || { cat "$OUT/$name.log"; fail "rank 0 did not name the operation"; }
    python3 -c "import sys; sys.exit(0 if ${line%% *} - $at <= $TIMEOUT_S + 2 else 1)" \
        || fail "rank 0 reported later than the timeout + 2 s: $line"
    echo "  rank 0, $(python3 -c "print(f'{${line%% *} - $at:.2f}')") s after the kill: ${line#* error: }" | cut -c1-300
    grep -q "launch: the job finished on attempt 2" "$OUT/$name.log" || { cat "$OUT/$name.log"; fail "no restart"; }
    same_checkpoint "$(checkpoint_of "$name")" "$(checkpoint_of "$reference")" || fail "the restarted $name differs"
}
if [ "$GPUS" != 2 ]; then
    echo "== $GPUS GPUs as 2 hosts: DDP's hierarchical all-reduce over NCCL against one GPU"
    HOSTS=(--set "parallel.ranks_per_host=$((GPUS / 2))")
    run one --one
    run hier -- "${HOSTS[@]}" --set 'parallel.grad_reduce="hierarchical"'
    grep -q "(ddp, hierarchical all-reduce).*gradients reduced over NCCL" "$OUT/hier.log" \
        || { cat "$OUT/hier.log"; fail "not hierarchical over NCCL"; }
    same_checkpoint "$(checkpoint_of hier)" "$(checkpoint_of one)" 1e-5 \
        || fail "the hierarchical all-reduce over NCCL differs from one GPU"
    echo "== auto over NCCL on the same hosts: flat (NCCL follows the hosts itself)"
    run auto -- "${HOSTS[@]}"
    grep -q "(ddp), .*gradients reduced over NCCL" "$OUT/auto.log" \
        || { cat "$OUT/auto.log"; fail "auto over NCCL was not flat"; }
    same_checkpoint "$(checkpoint_of auto)" "$(checkpoint_of one)" 1e-5 || fail "auto differs from one GPU"
    killed hier-killed hier "${HOSTS[@]}" --set 'parallel.grad_reduce="hierarchical"'
    # A communicator of four: NCCL cannot say who is missing, the failure monitor's
    # position board (what each rank issued, and that rank 1 died) names it.
    killed flat-killed auto "${HOSTS[@]}"
    grep -qE "error: rank 0: .*rank\(s\) \[1\] \(global\) (did not arrive|stopped).*rank 1 died" "$OUT/flat-killed.log" \
        || { grep "error: rank 0" "$OUT/flat-killed.log"; fail "rank 0 did not name rank 1 in a group of four"; }
    echo "emu-nccl-test: OK ($GPUS GPUs)"
    exit 0
fi

echo "== one GPU, and DDP over NCCL on two (emulated) GPUs, fp32"
run one --one
run ddp
grep -q "gradients reduced over NCCL" "$OUT/ddp.log" || { cat "$OUT/ddp.log"; fail "ddp did not use NCCL"; }
same_checkpoint "$(checkpoint_of ddp)" "$(checkpoint_of one)" 1e-5 || fail "DDP over NCCL differs from one GPU"

for zero in 1 2 3; do
    echo "== ZeRO-$zero over NCCL against DDP over NCCL"
    run "zero$zero" -- --set "parallel.zero=$zero"
    grep -q "zero-$zero.*gradients reduced over NCCL" "$OUT/zero$zero.log" \
        || { cat "$OUT/zero$zero.log"; fail "zero$zero did not run ZeRO-$zero over NCCL"; }
    same_checkpoint "$(checkpoint_of "zero$zero")" "$(checkpoint_of ddp)" || fail "ZeRO-$zero differs from DDP"
done

echo "== the single master (nn.DataParallel) over NCCL against one GPU"
# Rank 1 sends its gradients to rank 0's device, which adds them there, updates alone and
# broadcasts its parameters.
run single-master -- --set 'parallel.dp_mode="single-master"'
grep -q "(single-master).*gradients reduced over NCCL" "$OUT/single-master.log" \
    || { cat "$OUT/single-master.log"; fail "single-master did not run over NCCL"; }
same_checkpoint "$(checkpoint_of single-master)" "$(checkpoint_of one)" 1e-5 \
    || fail "the single master over NCCL differs from one GPU"

# layout_against_one NAME SAYS SETTING...: NAME trained over NCCL with the settings, its log
# says SAYS, and it ends within 1e-5 of one GPU.
layout_against_one() {
    local name=$1 says=$2 sets=()
    shift 2
    echo "== $name over NCCL against one GPU"
    for s in "$@"; do sets+=(--set "$s"); done
    run "$name" -- "${sets[@]}"
    grep -q "$says" "$OUT/$name.log" || { cat "$OUT/$name.log"; fail "$name: no '$says'"; }
    same_checkpoint "$(checkpoint_of "$name")" "$(checkpoint_of one)" 1e-5 \
        || fail "$name over NCCL differs from one GPU"
}

# Layouts that send point to point, over NCCL with a communicator per pair that sends:
# a pipeline's activations and its neighbour's gradients cross (1F1B), interleaved chunks
# go around from the last stage to the first, ring attention sends around the cp group.
sends="sends between stages and ring neighbours over NCCL"
layout_against_one pp-1f1b "$sends" parallel.pp=2 'parallel.schedule="1f1b"' parallel.micro_batches=4
layout_against_one pp-interleaved "$sends" parallel.pp=2 'parallel.schedule="interleaved"' \
    parallel.micro_batches=4
layout_against_one cp-ring "$sends" parallel.cp=2
# Layouts whose collectives split the model, not the batch: tensor parallelism with sequence
# parallelism (the input gradients' reduce-scatters, the activations' all-gathers; a
# checkpoint every 3 steps gathers the shards) and Ulysses (all-to-all to whole sequences of
# a share of the heads).
layout_against_one tp-sp "gradients reduced over NCCL" parallel.tp=2 parallel.sequence_parallel=true
layout_against_one cp-ulysses "gradients reduced over NCCL.*ulysses attention" parallel.cp=2 'parallel.cp_mode="ulysses"'

echo "== bf16: DDP over NCCL against one GPU"
run one-bf16 --one -- --precision bf16
run ddp-bf16 -- --precision bf16
python3 - "$(final_loss "$OUT/one-bf16.log")" "$(final_loss "$OUT/ddp-bf16.log")" <<'EOF' || fail "bf16 losses differ"
import sys
a, b = float(sys.argv[1]), float(sys.argv[2])
print(f"  final loss: one GPU {a}, two over NCCL {b} ({abs(a - b) / a:.2e} apart, at most 1e-3)")
sys.exit(0 if abs(a - b) <= 1e-3 * a else 1)
EOF

echo "== SIGTERM to launch --gpus 2 at step 3, then its resume command"
# What a scheduler sends: the launcher forwards the stop to every rank, which save the same
# step over NCCL and end; exit 143, no restart, and the printed command resumes to the end,
# bit-identical to DDP over NCCL uninterrupted.
"$BIN" launch --gpus "$GPUS" --mpirun-arg=--oversubscribe -- "${JOB[@]}" \
    --set "train.out_dir=\"$OUT/stopped\"" >"$OUT/stopped.log" 2>&1 &
launcher=$!
(sleep 300; kill -KILL $launcher 2>/dev/null) &  # bounded, as run()
watchdog=$!
for ((i = 0; i < 1200; i++)); do
    grep -q '"step":3,' "$OUT/stopped/metrics.jsonl" 2>/dev/null && break
    sleep 0.1
done
kill -TERM $launcher
status=0; wait $launcher || status=$?
kill $watchdog 2>/dev/null || true
[ "$status" = 143 ] || { cat "$OUT/stopped.log"; fail "launch exited $status, not 143"; }
grep -q "launch: attempt 2" "$OUT/stopped.log" && { cat "$OUT/stopped.log"; fail "launch restarted a stopped job"; }
saved=$(grep -o "launch: stopped by SIGTERM on attempt 1: the job saved its checkpoint at step [0-9]*" \
    "$OUT/stopped.log") || { cat "$OUT/stopped.log"; fail "no stop message"; }
resume=$(grep -o 'launch: resume with: .*' "$OUT/stopped.log" | cut -d' ' -f4-)
[[ "$resume" == *" launch "*"--resume $OUT/stopped/checkpoint.safetensors" ]] || fail "resume command: $resume"
echo "  exit 143, ${saved#launch: stopped by SIGTERM on attempt 1: }"
eval "timeout -k 10 300 $resume" >"$OUT/stopped-resumed.log" 2>&1 \
    || { cat "$OUT/stopped-resumed.log"; fail "resuming"; }
same_checkpoint "$(checkpoint_of stopped)" "$(checkpoint_of ddp)" \
    || fail "the stopped and resumed run differs from DDP over NCCL uninterrupted"
echo "  resumed to step 8: bit-identical to the uninterrupted run"

killed killed ddp
killed pp-killed pp-1f1b --set parallel.pp=2 --set 'parallel.schedule="1f1b"' --set parallel.micro_batches=4
echo "emu-nccl-test: OK"
