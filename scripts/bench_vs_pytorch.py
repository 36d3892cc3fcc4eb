#!/usr/bin/env python3
"""Single-worker throughput, meshtrain vs PyTorch, side by side on this machine.

For each pass and model, runs `meshtrain bench models --models M` and then the PyTorch peer
(`shared/bench-peer/pytorch_ddp_bench.py`, one process, the compute-only `nosync` phase, the
same batch and thread count), interleaved so drift hits both equally, and prints a Markdown
table of medians with the ratio. Needs a PyTorch venv (see shared/bench-peer/README.md).

    python3 scripts/bench_vs_pytorch.py --venv /work/torch-venv --passes 2
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MODELS = {"lenet": "lenet", "resnet18": "d2l_resnet18", "gpt": "gpt"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", default=os.environ.get("TORCH_VENV", "/work/torch-venv"))
    ap.add_argument("--peer-dir", default=os.path.join(os.path.dirname(__file__), "../../shared/bench-peer"))
    ap.add_argument("--meshtrain", default="target/release/meshtrain")
    ap.add_argument("--models", default="lenet,resnet18,gpt")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    ours, theirs, rss = {}, {}, {}
    tmp = tempfile.mkdtemp()
    for p in range(args.passes):
        for m in args.models.split(","):
            out = os.path.join(tmp, f"ours-{m}-{p}.jsonl")
            subprocess.run([args.meshtrain, "bench", "models", "--models", m, "--threads", str(args.threads),
                            "--seconds", str(args.seconds), "--json", out], check=True, stdout=subprocess.DEVNULL)
            r = json.loads(open(out).read().splitlines()[-1])
            ours.setdefault(m, []).append(r["samples_per_s"])
            rss.setdefault(m, []).append(r.get("peak_rss_mb") or 0)
            peer_out = os.path.join(tmp, f"torch-{m}-{p}.jsonl")
            subprocess.run([os.path.join(args.venv, "bin/torchrun"), "--standalone", "--nproc_per_node", "1",
                            "pytorch_ddp_bench.py", "--model", MODELS[m], "--phases", "nosync",
                            "--total-threads", str(args.threads), "--phase-seconds", str(args.seconds),
                            "--out", peer_out], check=True, cwd=args.peer_dir,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            t = json.loads(open(peer_out).read().splitlines()[-1])
            theirs.setdefault(m, []).append(t["phases"]["nosync"]["samples_per_s"])
            print(f"pass {p} {m}: meshtrain {ours[m][-1]:.1f} samples/s, PyTorch {theirs[m][-1]:.1f}",
                  file=sys.stderr)
    print(f"| model | threads | meshtrain samples/s | PyTorch samples/s | ratio | meshtrain peak RSS MiB | runs |")
    print("|---|---|---|---|---|---|---|")
    for m in ours:
        a, b = statistics.median(ours[m]), statistics.median(theirs[m])
        print(f"| {m} | {args.threads} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {max(rss[m]):.0f} | {len(ours[m])} |")


if __name__ == "__main__":
    main()
