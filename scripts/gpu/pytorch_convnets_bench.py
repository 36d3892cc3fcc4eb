#!/usr/bin/env python3
"""PyTorch's step time for the conv nets of `meshtrain bench gpu --parts convnets`, on the same
card in the same call: D2L's LeNet (sigmoid, average pooling; batch 256) and D2L's ResNet-18
for 1x28x28 images (convolutions with biases, batch norm; batch 128), SGD with momentum 0.9,
eager, `cudnn.benchmark` on (what PyTorch users set for conv nets).

Precisions, matching meshtrain's RESULT lines:
  fp32  true f32 everywhere (cuDNN's and cuBLAS's TF32 off; meshtrain's train.tf32=false)
  tf32  TF32 tensor cores for convolutions and matrix products (PyTorch's default for
        convolutions; meshtrain's train.tf32=true)
  bf16  autocast to bf16

Input batches are fixed tensors on the GPU (no data loading in the timed step). One line per
model and precision: RESULT torch-<model> <precision> batch=B step_ms=... samples_s=...
(median of the timed steps, CUDA events around each step).

    python3 scripts/gpu/pytorch_convnets_bench.py --steps 50 [--compile]
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def lenet():
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.Sigmoid(), nn.AvgPool2d(2, 2),
        nn.Conv2d(6, 16, 5), nn.Sigmoid(), nn.AvgPool2d(2, 2),
        nn.Flatten(),
        nn.Linear(400, 120), nn.Sigmoid(),
        nn.Linear(120, 84), nn.Sigmoid(),
        nn.Linear(84, 10),
    )


class Block(nn.Module):
    """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut), a strided 1x1 projection when the
    shape changes (D2L 8.6)."""

    def __init__(self, inputs, outputs, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.project = (nn.Conv2d(inputs, outputs, 1, stride=stride)
                        if stride != 1 or inputs != outputs else None)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (self.project(x) if self.project is not None else x))


def resnet18(width=64):
    layers = [nn.Conv2d(1, width, 7, stride=2, padding=3), nn.BatchNorm2d(width), nn.ReLU(),
              nn.MaxPool2d(3, stride=2, padding=1)]
    channels = width
    for stage in range(4):
        out = width * 2 ** stage
        layers += [Block(channels, out, 1 if stage == 0 else 2), Block(out, out, 1)]
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


MODELS = {"lenet": (lenet, 256), "resnet18": (resnet18, 128)}


def measure(name, precision, steps, compile_model):
    build, batch = MODELS[name]
    tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.manual_seed(0)
    model = build().cuda()
    if compile_model:
        model = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(batch, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    ms = times[len(times) // 2]
    mode = "compile" if compile_model else "eager"
    print(f"RESULT torch-{name} {precision} batch={batch} step_ms={ms:.3f} "
          f"samples_s={batch / ms * 1e3:.0f} mode={mode}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--compile", action="store_true", help="torch.compile the model as well")
    a = p.parse_args()
    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    torch.backends.cudnn.benchmark = True
    for name in MODELS:
        for precision in ("fp32", "tf32", "bf16"):
            for compiled in ([False, True] if a.compile else [False]):
                try:
                    measure(name, precision, a.steps, compiled)
                except Exception as e:  # one failure must not hide the other lines
                    print(f"FAIL torch-{name} {precision}: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
