#!/usr/bin/env python3
"""Single-worker throughput, meshtrain vs PyTorch, side by side on this machine.

For each pass and model, runs `meshtrain bench models --models M` and then the PyTorch peer
(`shared/bench-peer/pytorch_ddp_bench.py`, one process, the compute-only `nosync` phase, the
same batch and thread count), interleaved so drift hits both equally, and prints a Markdown
table of medians with the ratio. Needs a PyTorch venv (see shared/bench-peer/README.md).

    python3 scripts/bench_vs_pytorch.py --venv /work/torch-venv --passes 2

`--cpu-time` also reports samples per second of CPU time per thread for both sides (process
CPU time of the timed steps divided by the thread count). On a machine shared with other jobs
wall-clock rates mostly measure the neighbours; CPU time leaves out the time a process spent
descheduled. The PyTorch peer then runs its `nosync` phase twice in one process, once timed by
the wall clock and once by a CPU clock swapped into the peer module (the peer file itself is
left untouched).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

MODELS = {"lenet": "lenet", "resnet18": "d2l_resnet18", "gpt": "gpt"}

# Runs the peer's main() in-process so its clock can be swapped per phase: the first run of a
# phase uses the wall clock, the second CPU time divided by the thread count.
PEER_DRIVER = r"""
import sys, time, types
peer_dir, threads = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, peer_dir)
import pytorch_ddp_bench as peer
cpu_clock = types.SimpleNamespace(perf_counter=lambda: time.process_time() / threads)
run_phase, calls = peer.run_phase, [0]
def alternating(*a, **k):
    peer.time = time if calls[0] % 2 == 0 else cpu_clock
    calls[0] += 1
    try:
        return run_phase(*a, **k)
    finally:
        peer.time = time
peer.run_phase = alternating
sys.argv = ["pytorch_ddp_bench.py"] + sys.argv[3:]
peer.main()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_peer(args, model, out):
    """Returns (wall samples/s, CPU samples/s or None) of the peer's nosync phase."""
    common = ["--model", MODELS[model], "--total-threads", str(args.threads),
              "--phase-seconds", str(args.seconds), "--out", out]
    quiet = dict(check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not args.cpu_time:
        subprocess.run([os.path.join(args.venv, "bin/torchrun"), "--standalone", "--nproc_per_node", "1",
                        "pytorch_ddp_bench.py", "--phases", "nosync"] + common, cwd=args.peer_dir, **quiet)
        t = json.loads(open(out).read().splitlines()[-1])
        return t["phases"]["nosync"]["samples_per_s"], None
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    subprocess.run([os.path.join(args.venv, "bin/python"), "-c", PEER_DRIVER, os.path.abspath(args.peer_dir),
                    str(args.threads), "--phases", "nosync,nosync"] + common, env=env, **quiet)
    runs = json.loads(open(out).read().splitlines()[-1])["phase_runs"]
    return runs[0]["samples_per_s"], runs[1]["samples_per_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", default=os.environ.get("TORCH_VENV", "/work/torch-venv"))
    ap.add_argument("--peer-dir", default=os.path.join(os.path.dirname(__file__), "../../shared/bench-peer"))
    ap.add_argument("--meshtrain", default="target/release/meshtrain")
    ap.add_argument("--models", default="lenet,resnet18,gpt")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--cpu-time", action="store_true",
                    help="also compare samples per CPU-second per thread (for loaded machines)")
    args = ap.parse_args()
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; expected some of {sorted(MODELS)}")
    ours, theirs, ours_cpu, theirs_cpu, rss, gflops = {}, {}, {}, {}, {}, {}
    tmp = tempfile.mkdtemp()
    load_before = os.getloadavg()[0]
    for p in range(args.passes):
        for m in args.models.split(","):
            out = os.path.join(tmp, f"ours-{m}-{p}.jsonl")
            subprocess.run([args.meshtrain, "bench", "models", "--models", m, "--threads", str(args.threads),
                            "--seconds", str(args.seconds), "--json", out], check=True, stdout=subprocess.DEVNULL)
            r = json.loads(open(out).read().splitlines()[-1])
            ours.setdefault(m, []).append(r["samples_per_s"])
            ours_cpu.setdefault(m, []).append(r.get("cpu_samples_per_s") or 0)
            gflops.setdefault(m, []).append(r["gflops"])
            rss.setdefault(m, []).append(r.get("peak_rss_mb") or 0)
            wall, cpu = run_peer(args, m, os.path.join(tmp, f"torch-{m}-{p}.jsonl"))
            theirs.setdefault(m, []).append(wall)
            theirs_cpu.setdefault(m, []).append(cpu)
            line = (f"pass {p} {m}: meshtrain {ours[m][-1]:.1f} samples/s, PyTorch {wall:.1f}"
                    f" ({ours[m][-1] / wall:.2f}x)")
            if args.cpu_time:
                line += f"; per CPU-second/thread: meshtrain {ours_cpu[m][-1]:.1f}, PyTorch {cpu:.1f}"
            print(line, file=sys.stderr)
    med = statistics.median
    print(f"load average (1 min) before {load_before:.1f}, after {os.getloadavg()[0]:.1f}")
    cpu_cols = " CPU-time meshtrain | CPU-time PyTorch | CPU-time ratio |" if args.cpu_time else ""
    # On a shared machine the speed drifts during a sitting and noise only ever slows a
    # run down: the ratio within each pass (the two runs are adjacent in time) and the
    # ratio of the best runs are less exposed to that than the ratio of the medians.
    print(f"| model | threads | meshtrain samples/s | PyTorch samples/s | ratio |{cpu_cols}"
          " median per-pass ratio | best / best | meshtrain GFLOP/s | meshtrain peak RSS MiB | runs |")
    print("|---|---|---|---|---|" + ("---|---|---|" if args.cpu_time else "") + "---|---|---|---|---|")
    for m in ours:
        a, b = med(ours[m]), med(theirs[m])
        cpu = ""
        if args.cpu_time:
            ac, bc = med(ours_cpu[m]), med(theirs_cpu[m])
            cpu = f" {ac:.1f} | {bc:.1f} | {ac / bc:.2f}x |"
        per_pass = med([x / y for x, y in zip(ours[m], theirs[m])])
        best = max(ours[m]) / max(theirs[m])
        print(f"| {m} | {args.threads} | {a:.1f} | {b:.1f} | {a / b:.2f}x |{cpu} {per_pass:.2f}x | {best:.2f}x |"
              f" {med(gflops[m]):.1f} |"
              f" {max(rss[m]):.0f} | {len(ours[m])} |")


if __name__ == "__main__":
    main()
