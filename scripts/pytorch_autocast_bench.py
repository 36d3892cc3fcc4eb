#!/usr/bin/env python3
"""PyTorch's CPU mixed precision on the same models, batches and threads as
`meshtrain bench precision`: one process, fp32 against `torch.autocast("cpu",
dtype=torch.bfloat16)` training steps (fp32 master weights, optimizer in fp32),
rounds interleaved so that machine drift cancels, medians reported.

The models come from the shared peer baseline (../shared/bench-peer/
pytorch_ddp_bench.py): D2L LeNet, D2L ResNet-18 at 1x28x28 and the pre-LN GPT
(4 layers, d=256, 4 heads, seq 128), synthetic fixed batches (256 / 128 / 32).

    /work/torch-venv/bin/python scripts/pytorch_autocast_bench.py --threads 2
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "shared", "bench-peer"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from pytorch_ddp_bench import make_config  # noqa: E402


def steps_ms(cfg, args, precision, steps):
    torch.manual_seed(0)
    model = cfg["build"]()
    if cfg["opt"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(1)
    b = cfg["batch"]
    if cfg["kind"] == "tokens":
        x = torch.randint(0, args.vocab, (b,) + cfg["shape"], generator=g)
        y = torch.randint(0, args.vocab, (b,) + cfg["shape"], generator=g)
    else:
        x = torch.randn((b,) + cfg["shape"], generator=g)
        y = torch.randint(0, 10, (b,), generator=g)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="lenet,d2l_resnet18,gpt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    # The GPT's shape (pytorch_ddp_bench.make_config reads these).
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--image-size", type=int, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, "
          f"bf16 supported: {torch.backends.mkldnn.is_available()}")
    print(f"{'model':<14} {'fp32 ms':>9} {'bf16 ms':>9} {'bf16 speed-up':>14}")
    for name in args.models.split(","):
        cfg = make_config(name, args)
        runs = {"fp32": [], "bf16": []}
        for _ in range(args.rounds):
            for precision in runs:
                runs[precision].append(steps_ms(cfg, args, precision, args.steps))
        fp32 = statistics.median(runs["fp32"])
        bf16 = statistics.median(runs["bf16"])
        print(f"{name:<14} {fp32:9.1f} {bf16:9.1f} {fp32 / bf16:13.2f}x")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(model=name, threads=args.threads, fp32_ms=fp32,
                                        bf16_ms=bf16, torch=torch.__version__)) + "\n")


if __name__ == "__main__":
    main()
