#!/usr/bin/env python3
"""Record PyTorch GradScaler's scale and growth tracker through a sequence of clean and
overflowed steps, for meshtrain's LossScaler test (crates/parallel/tests/grad_scaler.rs).

    /work/torch-venv/bin/python tools/gradscaler_refs.py   # writes crates/parallel/tests/refs/gradscaler.json

Each case drives `torch.amp.GradScaler("cpu")` with its settings: per step, one parameter's
gradient is finite or inf (the overflow), then `scaler.step(opt)` and `scaler.update()`; we
record whether the optimizer stepped (the parameter moved), the scale and the growth tracker.
"""
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "crates", "parallel", "tests", "refs", "gradscaler.json")


def run(init_scale, growth_factor, backoff_factor, growth_interval, overflows):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                  backoff_factor=backoff_factor, growth_interval=growth_interval)
    steps = []
    for overflow in overflows:
        loss = (p * torch.tensor([1.0, 2.0, 3.0])).sum()
        scaler.scale(loss).backward()
        if overflow:
            p.grad[1] = float("inf")
        before = p.detach().clone()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        steps.append(dict(overflow=overflow, stepped=not torch.equal(before, p.detach()),
                          scale=scaler.get_scale(),
                          growth_tracker=int(scaler._get_growth_tracker())))
    return dict(init_scale=init_scale, growth_factor=growth_factor,
                backoff_factor=backoff_factor, growth_interval=growth_interval, steps=steps)


def main():
    pattern = [False] * 5 + [True] + [False] * 2 + [True, True] + [False] * 7 + [True] + [False] * 4
    cases = [
        run(65536.0, 2.0, 0.5, 3, pattern),
        run(1024.0, 4.0, 0.25, 2, pattern),
        run(65536.0, 2.0, 0.5, 2000, [False] * 10 + [True] * 3 + [False] * 5),
    ]
    with open(OUT, "w") as f:
        json.dump(dict(torch=torch.__version__, cases=cases), f, indent=1)
    print(f"wrote {OUT} ({sum(len(c['steps']) for c in cases)} steps, torch {torch.__version__})")


if __name__ == "__main__":
    main()
