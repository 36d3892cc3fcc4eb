#!/bin/bash
# Interleaved A/B of foreground checkpoint writes between two meshtrain binaries:
#   bash scripts/ab_checkpoints.sh OLD NEW [PAIRS]
# GPT (configs/gpt.toml), 20 steps, a checkpoint every 2 steps written synchronously, for a
# whole file at dp 1, a sharded ZeRO-1 checkpoint at dp 2, and whole files of ZeRO-1 and
# ZeRO-3 at dp 2; prints each run's "checkpoints ... s in total (N saved".
set -u
old=$1 new=$2 pairs=${3:-3}
layouts=(
  "--dp 1"
  "--dp 2 --set parallel.zero=1"
  "--dp 2 --set parallel.zero=1 --set train.checkpoint_format=\"whole\""
  "--dp 2 --set parallel.zero=3 --set train.checkpoint_format=\"whole\""
)
for layout in "${layouts[@]}"; do
  for pair in $(seq 1 "$pairs"); do
    for which in old new; do
      binary=$old
      [ "$which" = new ] && binary=$new
      out=$(mktemp -d /tmp/meshtrain-ab-ckpt-XXXX)
      # shellcheck disable=SC2086 # the layout is several arguments
      if "$binary" train --config configs/gpt.toml $layout --set train.max_steps=20 \
          --set checkpoint.every_steps=2 --set train.checkpoint_background=false \
          --set data.data_dir=\"data/fashion-mnist-subset\" --set train.threads=2 \
          --set train.out_dir=\""$out"\" > "$out.log" 2>&1; then
        echo "[$layout] $which $pair: $(grep -o 'checkpoints [0-9.]* s in total ([0-9]* saved' "$out.log")"
      else
        echo "[$layout] $which $pair: failed"; tail -3 "$out.log"
      fi
      rm -rf "$out" "$out.log"
    done
  done
done
