#!/usr/bin/env bash
# Every benchmark behind docs/benchmarks.md, in one sitting, on a quiet machine (nothing else
# running: on 2 cores a compiling neighbour changes timings by 2x). Writes logs, JSON lines,
# charts and calibration files under runs/bench/ (charts also to docs/img/). Needs a release
# build and a PyTorch venv (TORCH_VENV, default /work/torch-venv; see shared/bench-peer).
#   bash scripts/quiet-benchmarks.sh [part ...]   parts: single dp calibrate pipeline
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/bench
mkdir -p "$out"
bin=target/release/meshtrain
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(single dp calibrate pipeline)
for part in "${parts[@]}"; do
    echo "== $part ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
    case "$part" in
    single) # issue 2: one worker, 2 threads, vs PyTorch side by side
        python3 scripts/bench_vs_pytorch.py --passes 3 | tee "$out/single.md" ;;
    dp) # issue 4: 1/2/4 workers, breakdown, chart, DDP vs single-master, vs PyTorch DDP
        rm -f "$out/scaling.jsonl"
        $bin bench scaling --workers 1,2,4 --json "$out/scaling.jsonl" \
            --png docs/img/scaling.png --diagnose-dir "$out/diagnose" | tee "$out/scaling.md"
        $bin bench scaling --workers 2 --dp-mode single-master | tee "$out/single-master.md"
        python3 scripts/bench_dp_vs_pytorch.py --workers 1,2,4 --passes 2 | tee "$out/dp-vs-pytorch.md" ;;
    calibrate) # issue 6 item 6: planner predictions vs our runs
        $bin bench calibrate --out-dir "$out/calibrate" | tee "$out/calibrate.md" ;;
    pipeline) # issue 5: real-GPT bubble and GPT throughput pp=2 vs dp=2 vs 1 worker
        $bin bench pipeline --parts bubble-gpt,throughput --micro-batches 8 | tee "$out/pipeline.md" ;;
    *) echo "unknown part $part (single dp calibrate pipeline)"; exit 2 ;;
    esac
done
