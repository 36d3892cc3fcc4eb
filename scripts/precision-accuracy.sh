#!/usr/bin/env bash
# Mixed precision's accuracy check (docs/benchmarks.md §9): LeNet (5 epochs, dp=2), ResNet-18
# (5 epochs) and the GPT (1,000 steps) trained from the same seed in fp32, bf16 and fp16, then
# one PNG per model with the three runs' curves overlaid.
#
#   bash scripts/precision-accuracy.sh            # all three models (~45 min on 2 cores)
#   MODELS="lenet gpt" bash scripts/precision-accuracy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MESHTRAIN:-target/release/meshtrain}
OUT=${OUT:-runs/precision}
MODELS=${MODELS:-"lenet gpt resnet18"}
[ -x "$BIN" ] || cargo build --release -p meshtrain
for model in $MODELS; do
    for precision in fp32 bf16 fp16; do
        dir="$OUT/$model-$precision"
        echo "== $model $precision -> $dir"
        "$BIN" train --config "configs/$model.toml" --precision "$precision" \
            --set "train.out_dir=\"$dir\"" | tail -n 4
    done
    "$BIN" plot --out "$OUT/$model-precision.png" \
        --metrics "$OUT/$model-fp32/metrics.jsonl" \
        --metrics "$OUT/$model-bf16/metrics.jsonl" \
        --metrics "$OUT/$model-fp16/metrics.jsonl" || echo "(plot: needs a meshtrain with overlay support)"
done
