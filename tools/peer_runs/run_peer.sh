#!/usr/bin/env bash
# Single-process (N=1) runs of the PyTorch peer baseline, for side-by-side comparison
# with meshtrain. Records, per model: the bench's JSON line, `/usr/bin/time -v`
# (peak RSS = "Maximum resident set size"), `uptime` before/after, and the CPU time
# that *other* processes used during the run (from /proc/stat minus our own rusage).
#
# Before each launch it waits (up to MAX_WAIT s, default 600) until the machine has been
# less than QUIET busy (default 0.15 = 15 % of all cores) over 3 s, as the peer's run_all.py
# does, because concurrent cargo builds slow these runs 2-10x.
#
# Usage (from the repo root):  tools/peer_runs/run_peer.sh [OUT_DIR] [MODELS...]
# Needs: /work/torch-venv (see tools/README.md) and the peer scripts in
#        /work/shared/bench-peer (override with BENCH_DIR=...).
set -euo pipefail
OUT_DIR=$(realpath -m "${1:-tools/peer_runs}")
shift || true
MODELS=("${@:-lenet d2l_resnet18 gpt}")
MODELS=(${MODELS[@]})
BENCH_DIR=${BENCH_DIR:-/work/shared/bench-peer}
VENV=${VENV:-/work/torch-venv}
mkdir -p "$OUT_DIR"

busy_total() {  # prints "busy_ticks total_ticks" from the first line of /proc/stat
  awk '/^cpu /{idle=$5+$6; tot=0; for(i=2;i<=9;i++) tot+=$i; print tot-idle, tot}' /proc/stat
}

QUIET=${QUIET:-0.15}
MAX_WAIT=${MAX_WAIT:-600}

wait_quiet() {  # prints the busy fraction it last saw
  local deadline=$(( $(date +%s) + MAX_WAIT )) b0 t0 b1 t1 busy
  while :; do
    read -r b0 t0 < <(busy_total); sleep 3; read -r b1 t1 < <(busy_total)
    busy=$(awk -v a="$b0" -v b="$b1" -v c="$t0" -v d="$t1" 'BEGIN{printf "%.3f", (b-a)/(d-c)}')
    if awk -v x="$busy" -v q="$QUIET" 'BEGIN{exit !(x < q)}' || (( $(date +%s) > deadline )); then
      echo "$busy"; return
    fi
  done
}

for model in "${MODELS[@]}"; do
  log="$OUT_DIR/$model.log"
  busy_before=$(wait_quiet)
  {
    echo "# command: cd $BENCH_DIR && $VENV/bin/torchrun --standalone --nproc_per_node 1 pytorch_ddp_bench.py --model $model --out $OUT_DIR/$model.jsonl"
    echo "# date: $(date -u +%FT%TZ)"
    echo "# uptime before: $(uptime)"
    echo "# machine busy fraction over the 3 s before the launch: $busy_before (wanted < $QUIET, waited at most ${MAX_WAIT}s)"
  } > "$log"
  read -r b0 t0 < <(busy_total)
  start=$(date +%s.%N)
  (cd "$BENCH_DIR" && /usr/bin/time -v "$VENV/bin/torchrun" --standalone --nproc_per_node 1 \
      pytorch_ddp_bench.py --model "$model" --out "$OUT_DIR/$model.jsonl") >> "$log" 2>&1
  end=$(date +%s.%N)
  read -r b1 t1 < <(busy_total)
  {
    echo "# uptime after: $(uptime)"
    # CPU-seconds of the whole machine that were busy during the run, and the run's own
    # CPU seconds (user+sys of torchrun and its children, from time -v).
    awk -v b0="$b0" -v b1="$b1" -v s="$start" -v e="$end" -v hz="$(getconf CLK_TCK)" -v n="$(nproc)" \
      -v own="$(awk -F': ' '/User time|System time/{s+=$2} END{print s}' "$log")" \
      'BEGIN{busy=(b1-b0)/hz; wall=e-s; f=(busy-own)/(n*wall); if(f<0)f=0;
             printf "# wall_s %.1f machine_busy_cpu_s %.1f own_cpu_s %.1f foreign_cpu_frac %.3f\n", wall, busy, own, f}'
  } >> "$log"
  grep -E "samples/s|Maximum resident|foreign" "$log"
done
