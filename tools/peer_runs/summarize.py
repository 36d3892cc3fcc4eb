#!/usr/bin/env python3
"""Markdown table of the peer runs made by run_peer.sh.

    python3 tools/peer_runs/summarize.py tools/peer_runs/pass1 tools/peer_runs/pass2 ...

Per (directory, model): the CPU share other processes took during the launch (foreign),
the 1-min load average before it, peak RSS, and the best run of each phase (a phase
runs twice per launch, and the best is the least disturbed), plus the spread of all
phase runs, which shows how noisy the launch was.
"""

import json
import os
import re
import sys


def parse_log(path):
    text = open(path).read()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    foreign = re.search(r"foreign_cpu_frac ([\d.]+)", text)
    load = re.search(r"uptime before:.*load average: ([\d.]+)", text)
    return (
        int(rss.group(1)) / 1024 if rss else float("nan"),
        float(foreign.group(1)) if foreign else float("nan"),
        float(load.group(1)) if load else float("nan"),
    )


def cell(phase):
    return f"{phase['samples_per_s']:.1f} ({phase['step_ms']:.1f})"


def main():
    print(
        "| run | model | foreign CPU | load before | peak RSS MiB | ddp samples/s (step ms) "
        "| nosync samples/s (step ms) | all phase runs samples/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for d in sys.argv[1:]:
        for model in ("lenet", "d2l_resnet18", "gpt"):
            jl = os.path.join(d, model + ".jsonl")
            if not os.path.exists(jl):
                continue
            rec = json.loads(open(jl).read().splitlines()[-1])
            rss, foreign, load = parse_log(os.path.join(d, model + ".log"))
            ph = rec["phases"]
            runs = [r["samples_per_s"] for r in rec["phase_runs"]]
            print(
                f"| {os.path.basename(d.rstrip('/'))} | {model} | {foreign:.0%} | {load:.2f} "
                f"| {rss:.0f} | {cell(ph['ddp'])} | {cell(ph['nosync'])} "
                f"| {min(runs):.1f} - {max(runs):.1f} |"
            )


if __name__ == "__main__":
    main()
