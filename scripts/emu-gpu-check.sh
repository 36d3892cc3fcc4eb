#!/usr/bin/env bash
# The GPU check on the emulated CUDA device (crates/tensor/tests/cuda_emu/device/README.md):
# the unchanged meshtrain binary's CUDA path, run on the CPU, for the host code a card would
# otherwise be the first to run (launch shapes, arguments, buffer sizes, the allocator, the
# check's own comparisons). Slow (the kernels run on the emulator): minutes per part.
#
#   bash scripts/emu-gpu-check.sh [PARTS]     PARTS: `meshtrain bench gpu --parts` (default
#                                             check,multi,layouts,convnets)
#
# The training runs use smaller models than on a card (`bench gpu --set` overrides: for check,
# multi and layouts a GPT and Llama of width 64, 2 heads, 2 or 4 layers, 32 positions, 8
# sequences a batch; for convnets batches of 8), or each part would take hours; EMU_CHECK_SET
# replaces them (space-separated KEY=VALUE).
#
# Environment: MESHTRAIN_BIN (default: cargo build --release, target/release/meshtrain),
# EMU_DEVICE_OUT (the device's folder, default target/cuda-emu-device), EMU_CHECK_LOGS (one
# PART.log each, default target/emu-gpu-check), EMU_CHECK_TIMEOUT (seconds per part, 3600).
# Exits non-zero if a part failed.
set -uo pipefail
cd "$(dirname "$0")/.."

parts=${1:-check,multi,layouts,convnets}
device=$(bash crates/tensor/tests/cuda_emu/device/build.sh "${EMU_DEVICE_OUT:-target/cuda-emu-device}") \
    || { echo "emu-gpu-check: building the emulated device failed" >&2; exit 2; }
device=$(cd "$device" && pwd)
bin=${MESHTRAIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p meshtrain >&2 || exit 2
    bin=target/release/meshtrain
fi
logs=${EMU_CHECK_LOGS:-target/emu-gpu-check}
mkdir -p "$logs"

export LD_LIBRARY_PATH="$device" CUDA_INCLUDE_DIRS="$device/include" MESHTRAIN_KERNEL_CACHE=off
status=0
for part in ${parts//,/ }; do
    echo "=== emulated device: meshtrain bench gpu --parts $part"
    start=$(date +%s)
    small="model.dim=64 model.heads=2 model.seq=32 train.batch_size=8"
    case $part in
    check | multi) defaults="$small model.layers=2" ;;
    layouts) defaults="$small model.layers=4" ;; # interleaved pp=2 wants 2 blocks a stage
    convnets) defaults="train.batch_size=8" ;;
    *) defaults="" ;;
    esac
    sets=()
    for o in ${EMU_CHECK_SET:-$defaults}; do sets+=(--set "$o"); done
    timeout "${EMU_CHECK_TIMEOUT:-3600}" "$bin" bench gpu --parts "$part" --root . "${sets[@]}" 2>&1 \
        | tee "$logs/$part.log"
    rc=${PIPESTATUS[0]}
    echo "=== $part: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$logs/$part.log"
    [ "$rc" = 0 ] || status=1
done
exit $status
