#!/usr/bin/env python3
"""Data-parallel throughput, meshtrain DDP vs PyTorch DDP (gloo), side by side on this machine.

For each pass, model and worker count N: runs `meshtrain bench scaling --models M --workers N`
(threads backend, N workers x threads/N intra-op threads) and then the PyTorch peer
(`torchrun --nproc_per_node N shared/bench-peer/pytorch_ddp_bench.py --phases ddp`, the same
global batch, strong scaling, N processes x threads/N threads), interleaved so that machine
drift hits both equally. Prints a Markdown table of medians: samples/s of both, the ratio,
each one's N-worker/1-worker efficiency (when N=1 is in --workers), and our exposed
communication share of the step. Needs a PyTorch venv (see shared/bench-peer/README.md).

    python3 scripts/bench_dp_vs_pytorch.py --workers 1,2 --passes 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PEER_MODEL = {"lenet": "lenet", "resnet18": "d2l_resnet18", "gpt": "gpt"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", default=os.environ.get("TORCH_VENV", "/work/torch-venv"))
    ap.add_argument("--peer-dir", default=os.path.join(os.path.dirname(__file__), "../../shared/bench-peer"))
    ap.add_argument("--meshtrain", default="target/release/meshtrain")
    ap.add_argument("--models", default="lenet,resnet18,gpt")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0, help="PyTorch phase length")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    ours, theirs, exposed = {}, {}, {}
    for p in range(args.passes):
        for m in args.models.split(","):
            for n in [int(w) for w in args.workers.split(",")]:
                out = os.path.join(tmp, f"ours-{m}-{n}-{p}.jsonl")
                subprocess.run([args.meshtrain, "bench", "scaling", "--models", m, "--workers", str(n),
                                "--threads", str(args.threads), "--json", out],
                               check=True, stdout=subprocess.DEVNULL)
                r = json.loads(open(out).read().splitlines()[-1])
                ours.setdefault((m, n), []).append(r["samples_per_s"])
                exposed.setdefault((m, n), []).append(r["comm_exposed_ms"] / r["step_ms"])
                peer_out = os.path.join(tmp, f"torch-{m}-{n}-{p}.jsonl")
                subprocess.run([os.path.join(args.venv, "bin/torchrun"), "--standalone", "--nproc_per_node", str(n),
                                "pytorch_ddp_bench.py", "--model", PEER_MODEL[m], "--phases", "ddp",
                                "--total-threads", str(args.threads), "--phase-seconds", str(args.seconds),
                                "--out", peer_out], check=True, cwd=args.peer_dir,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                t = json.loads(open(peer_out).read().splitlines()[-1])
                theirs.setdefault((m, n), []).append(t["phases"]["ddp"]["samples_per_s"])
                print(f"pass {p} {m} N={n}: meshtrain {ours[(m, n)][-1]:.1f} samples/s, "
                      f"PyTorch {theirs[(m, n)][-1]:.1f}", file=sys.stderr)
    print("| model | N | meshtrain samples/s | PyTorch samples/s | ratio | meshtrain vs N=1 | PyTorch vs N=1 "
          "| meshtrain exposed comm / step | runs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (m, n) in ours:
        a, b = statistics.median(ours[(m, n)]), statistics.median(theirs[(m, n)])
        eff = lambda d: (f"{statistics.median(d[(m, n)]) / statistics.median(d[(m, 1)]):.2f}"
                         if (m, 1) in d else "-")
        print(f"| {m} | {n} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {eff(ours)} | {eff(theirs)} "
              f"| {100 * statistics.median(exposed[(m, n)]):.1f}% | {len(ours[(m, n)])} |")


if __name__ == "__main__":
    main()
