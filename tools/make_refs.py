#!/usr/bin/env python3
"""Write the PyTorch reference tensors that meshtrain's Rust tests compare against.

    /work/torch-venv/bin/python tools/make_refs.py            # writes crates/nn/tests/refs/
    /work/torch-venv/bin/python tools/make_refs.py --peer /work/shared/bench-peer

Why this exists: meshtrain's layers follow PyTorch's layouts and semantics exactly, so
PyTorch is the independent oracle for forward values, gradients, BatchNorm running
statistics, optimizer updates and whole-model training steps. The files are committed,
so the Rust test suite needs neither Python nor PyTorch.

How the numbers are made (see tools/README.md for the file formats):
* Every case seeds the global RNG with crc32(case name), so a case does not depend on
  which other cases ran before it, and a rerun gives identical bytes.
* Inputs, parameters and upstream gradients are drawn in float32 and stored as float32.
* The maths is then done in float64 on exact float64 copies of those float32 values, and
  the results are rounded once to float32 when stored. The references are therefore the
  exact answer up to one float32 rounding, and a Rust float32 implementation is measured
  against the truth, not against PyTorch's own float32 rounding noise.
* The same case is also run in float32; the largest float32-vs-float64 deviation of every
  stored result is written to tools/refs_precision.txt, which tells the Rust tests what
  tolerance a correct float32 implementation needs.
* One intra-op thread and torch.use_deterministic_algorithms(True).

--peer PATH imports pytorch_ddp_bench.py from PATH and checks that the models built here
are the peer baseline's models (same parameter names/shapes and, under the same seed,
identical initial weights and forward outputs).
"""

import argparse
import copy
import json
import math
import os
import sys
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "crates", "nn", "tests", "refs")
PRECISION_REPORT = os.path.join(REPO, "tools", "refs_precision.txt")

STORE_DTYPE = torch.float32
COMPUTE_DTYPE = torch.float64


def seed_for(name):
    """Per-case seed, so cases are independent of generation order."""
    torch.manual_seed(zlib.crc32(name.encode()))


# --------------------------------------------------------------------------
# Models (same definitions as /work/shared/bench-peer/pytorch_ddp_bench.py;
# --peer verifies that they agree)
# --------------------------------------------------------------------------


def lenet(activation="sigmoid"):
    """D2L LeNet-5 on 1x28x28. 'sigmoid' = the book's (and the peer's) sigmoid + avg-pool
    variant; 'relu' = the same with ReLU and MaxPool2d(2, 2)."""
    act = nn.Sigmoid if activation == "sigmoid" else nn.ReLU
    pool = nn.AvgPool2d if activation == "sigmoid" else nn.MaxPool2d
    return nn.Sequential(
        nn.Conv2d(1, 6, kernel_size=5, padding=2),
        act(),
        pool(kernel_size=2, stride=2),
        nn.Conv2d(6, 16, kernel_size=5),
        act(),
        pool(kernel_size=2, stride=2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120),
        act(),
        nn.Linear(120, 84),
        act(),
        nn.Linear(84, 10),
    )


LENET_NAMES = {"0": "conv1", "3": "conv2", "7": "fc1", "9": "fc2", "11": "fc3"}


class Residual(nn.Module):
    """D2L residual block: conv3x3-BN-ReLU-conv3x3-BN (+ optional 1x1 projection), ReLU."""

    def __init__(self, in_ch, out_ch, use_1x1conv=False, strides=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1, stride=strides)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.conv3 = nn.Conv2d(in_ch, out_ch, 1, stride=strides) if use_1x1conv else None
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.bn2 = nn.BatchNorm2d(out_ch)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.conv3 is not None:
            x = self.conv3(x)
        return F.relu(y + x)


def d2l_resnet18(in_ch=1, num_classes=10, widths=(64, 128, 256, 512)):
    """D2L ResNet-18 (7x7/2 stem + maxpool, 4 stages x 2 blocks) with configurable widths."""

    def stage(cin, cout, first):
        blocks = []
        for i in range(2):
            if i == 0 and not first:
                blocks.append(Residual(cin, cout, use_1x1conv=True, strides=2))
            else:
                blocks.append(Residual(cout, cout))
        return nn.Sequential(*blocks)

    w1, w2, w3, w4 = widths
    return nn.Sequential(
        nn.Conv2d(in_ch, w1, kernel_size=7, stride=2, padding=3),
        nn.BatchNorm2d(w1),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        stage(w1, w1, first=True),
        stage(w1, w2, first=False),
        stage(w2, w3, first=False),
        stage(w3, w4, first=False),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Linear(w4, num_classes),
    )


RESNET_NAMES = {
    "0": "stem.conv",
    "1": "stem.bn",
    "4": "stage1",
    "5": "stage2",
    "6": "stage3",
    "7": "stage4",
    "10": "fc",
}


class CausalSelfAttention(nn.Module):
    """The attention half of Block below, in isolation (no LayerNorm, no residual)."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return self.proj(attend(self.qkv(x), self.heads))


def attend(qkv, heads):
    """qkv [B,T,3D] -> causal multi-head attention output [B,T,D] (before the projection).
    q, k, v are the three consecutive D-wide slices; head h is the h-th contiguous
    D/heads-wide chunk of each; scores are scaled by 1/sqrt(D/heads)."""
    b, t, d3 = qkv.shape
    d = d3 // 3
    q, k, v = qkv.split(d, dim=2)
    q = q.view(b, t, heads, d // heads).transpose(1, 2)
    k = k.view(b, t, heads, d // heads).transpose(1, 2)
    v = v.view(b, t, heads, d // heads).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).contiguous().view(b, t, d)


class Block(nn.Module):
    """Pre-LN GPT block: x + proj(attn(ln1(x))), then x + fc2(gelu(fc1(ln2(x))))."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.proj(attend(self.qkv(self.ln1(x)), self.heads))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x


class TinyGPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


GPT_SMALL = dict(vocab=64, d=32, layers=2, heads=4, seq=16)


class Lambda(nn.Module):
    """A parameter-free layer given as a function (pools, activations, loss)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def rename(key, first_component_names):
    """Map a PyTorch state_dict key to meshtrain's name by renaming its leading component."""
    head, _, rest = key.partition(".")
    if head not in first_component_names:
        raise KeyError(f"no meshtrain name for state_dict key {key!r}")
    return first_component_names[head] + "." + rest


def randomise_affine(module, scale=0.2):
    """Norm layers start at weight=1, bias=0, which would hide weight/bias mix-ups;
    perturb them so every parameter matters."""
    with torch.no_grad():
        module.weight.copy_(1.0 + scale * torch.randn_like(module.weight))
        module.bias.copy_(scale * torch.randn_like(module.bias))


# --------------------------------------------------------------------------
# Case runners. Each case returns (stored inputs, float64 results, float32 results): the
# caller stores inputs and float64 results, and reports the float32 deviation.
# --------------------------------------------------------------------------


def floating_buffers(module):
    return {n: b for n, b in module.named_buffers() if b.is_floating_point()}


def run_layer(module, inputs, grad_output, dtype, after_buffer_keys):
    m = copy.deepcopy(module).to(dtype)
    args = {
        k: (v.to(dtype).requires_grad_(True) if v.is_floating_point() else v)
        for k, v in inputs.items()
    }
    out = m(*args.values())
    out.backward(grad_output.to(dtype))
    res = {"output": out.detach()}
    for k, v in args.items():
        if v.is_floating_point():
            res["grad_" + k] = v.grad
    for n, p in m.named_parameters():
        res["grad." + n] = p.grad
    bufs = floating_buffers(m)
    for n, key in after_buffer_keys.items():
        res[key] = bufs[n].detach().clone()
    return res


def layer_case(module, inputs, after_buffer_keys=None, grad_output=None, train=True):
    """Stores inputs, param.<n>, buffer.<n>, grad_output and the results of
    L = sum(output * grad_output) differentiated w.r.t. inputs and parameters."""
    module.train(train)
    if grad_output is None:
        with torch.no_grad():
            out_shape = copy.deepcopy(module)(*inputs.values()).shape
        grad_output = torch.randn(out_shape)
    stored = dict(inputs)
    stored.update({"param." + n: p.detach() for n, p in module.named_parameters()})
    stored.update({"buffer." + n: b for n, b in floating_buffers(module).items()})
    stored["grad_output"] = grad_output
    after = after_buffer_keys or {}
    ref = run_layer(module, inputs, grad_output, COMPUTE_DTYPE, after)
    f32 = run_layer(module, inputs, grad_output, torch.float32, after)
    return stored, ref, f32


def run_model(model, x, targets, dtype, steps, lr):
    m = copy.deepcopy(model).to(dtype)
    m.train()
    x = x.to(dtype) if x.is_floating_point() else x
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    res, losses = {}, []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = m(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        if step == 0:
            res["logits"] = logits.detach()
            res["loss"] = loss.detach()
            res.update({"grad." + n: p.grad.clone() for n, p in m.named_parameters()})
            res.update({"buffer_after." + n: b.clone() for n, b in floating_buffers(m).items()})
        losses.append(loss.detach())
        opt.step()
    res["loss_steps"] = torch.stack(losses)
    res.update({"param_after%d." % steps + n: p.detach().clone() for n, p in m.named_parameters()})
    res.update({"buffer_after%d." % steps + n: b.clone() for n, b in floating_buffers(m).items()})
    return res


def model_case(model, x, targets, names, steps=3, lr=0.1):
    """Stores input, targets, param.<n>, buffer.<n> (initial), and the results of one
    train-mode forward/backward of the mean cross-entropy (logits, loss, grad.<n>,
    buffer_after.<n>) plus `steps` plain-SGD steps on the same batch (loss_steps,
    param_after<steps>.<n>, buffer_after<steps>.<n>). Keys use meshtrain's names."""
    stored = {"input": x, "targets": targets}
    stored.update({"param." + n: p.detach() for n, p in model.named_parameters()})
    stored.update({"buffer." + n: b for n, b in floating_buffers(model).items()})
    ref = run_model(model, x, targets, COMPUTE_DTYPE, steps, lr)
    f32 = run_model(model, x, targets, torch.float32, steps, lr)

    def renamed(d):
        """'grad.0.weight' -> 'grad.conv1.weight'; keys without a parameter part stay."""
        if names is None:
            return d
        out = {}
        for k, v in d.items():
            kind, _, pname = k.partition(".")
            out[kind + "." + rename(pname, names) if pname else k] = v
        return out

    return renamed(stored), renamed(ref), renamed(f32)


def run_optimizer(make_opt, param, grads, dtype):
    p = param.to(dtype).clone().requires_grad_(True)
    opt = make_opt([p])
    after = []
    for g in grads:
        p.grad = g.to(dtype).clone()
        opt.step()
        after.append(p.detach().clone())
    return {"param_after_each": torch.stack(after)}


def optimizer_case(make_opt):
    param = torch.randn(10)
    grads = torch.randn(3, 10)
    stored = {"param": param, "grads": grads}
    return (
        stored,
        run_optimizer(make_opt, param, grads, COMPUTE_DTYPE),
        run_optimizer(make_opt, param, grads, torch.float32),
    )


# --------------------------------------------------------------------------
# The case list
# --------------------------------------------------------------------------


def conv_case(cin, cout, k, stride, pad, shape):
    conv = nn.Conv2d(cin, cout, k, stride=stride, padding=pad)
    return layer_case(conv, {"input": torch.randn(shape)})


def away_from_zero(shape, margin=0.05):
    """randn with |x| >= margin, so ReLU/max kinks are not hit (their subgradient at 0 is
    an implementation choice, not something to test against)."""
    x = torch.randn(shape)
    return torch.where(x.abs() < margin, torch.sign(x + 1e-12) * margin + x, x)


def batchnorm(train):
    bn = nn.BatchNorm2d(3, eps=1e-5, momentum=0.1)
    randomise_affine(bn)
    with torch.no_grad():
        bn.running_mean.copy_(0.5 * torch.randn(3))
        bn.running_var.copy_(0.5 + torch.rand(3))
    x = 1.5 * torch.randn(4, 3, 5, 5) + 0.3
    after = {"running_mean": "running_mean_after", "running_var": "running_var_after"}
    return layer_case(bn, {"input": x}, after if train else None, train=train)


def layernorm():
    ln = nn.LayerNorm(8, eps=1e-5)
    randomise_affine(ln)
    return layer_case(ln, {"input": torch.randn(2, 4, 8)})


def softmax_xent():
    logits = 2.0 * torch.randn(6, 10)
    targets = torch.randint(0, 10, (6,), dtype=torch.int64)
    loss = Lambda(lambda z, t: F.cross_entropy(z, t, reduction="mean"))
    return layer_case(loss, {"input": logits, "targets": targets}, grad_output=torch.tensor(1.0))


def embedding():
    emb = nn.Embedding(11, 4)
    ids = torch.randint(0, 11, (2, 5), dtype=torch.int64)
    # a repeated id checks that the weight gradient accumulates rather than overwrites
    assert len(set(ids.flatten().tolist())) < ids.numel(), "want a repeated token id"
    return layer_case(emb, {"input": ids})


def attention():
    att = CausalSelfAttention(16, heads=4)
    return layer_case(att, {"input": torch.randn(2, 6, 16)})


def gpt_block():
    blk = Block(16, heads=4)
    randomise_affine(blk.ln1)
    randomise_affine(blk.ln2)
    return layer_case(blk, {"input": torch.randn(2, 6, 16)})


def image_batch(n=4):
    return torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,), dtype=torch.int64)


def lenet_case(activation):
    model = lenet(activation)
    x, y = image_batch()
    return model_case(model, x, y, LENET_NAMES)


def resnet_w8():
    model = d2l_resnet18(1, 10, widths=(8, 16, 32, 64))
    x, y = image_batch()
    return model_case(model, x, y, RESNET_NAMES)


def gpt_small():
    c = GPT_SMALL
    model = TinyGPT(c["vocab"], c["d"], c["layers"], c["heads"], c["seq"])
    data = torch.randint(0, c["vocab"], (2, c["seq"] + 1), dtype=torch.int64)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    return model_case(model, x, y, None)


SGD_HP = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False)
ADAMW_HP = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False)

# name -> (builder, one-line description stored as metadata)
CASES = {
    "linear": (
        lambda: layer_case(nn.Linear(5, 3), {"input": torch.randn(4, 5)}),
        "Linear(5, 3), x [4,5]",
    ),
    "linear3d": (
        lambda: layer_case(nn.Linear(5, 6), {"input": torch.randn(2, 3, 5)}),
        "Linear(5, 6) over leading dims, x [2,3,5]",
    ),
    "conv_k5p2": (
        lambda: conv_case(3, 4, 5, 1, 2, (2, 3, 8, 8)),
        "Conv2d(3, 4, k=5, stride=1, pad=2), x [2,3,8,8]",
    ),
    "conv_k3s2p1": (
        lambda: conv_case(3, 4, 3, 2, 1, (2, 3, 7, 7)),
        "Conv2d(3, 4, k=3, stride=2, pad=1), x [2,3,7,7]",
    ),
    "conv_k1s2": (
        lambda: conv_case(3, 4, 1, 2, 0, (2, 3, 7, 7)),
        "Conv2d(3, 4, k=1, stride=2, pad=0), x [2,3,7,7]",
    ),
    "conv_k7s2p3": (
        lambda: conv_case(1, 4, 7, 2, 3, (2, 1, 12, 12)),
        "Conv2d(1, 4, k=7, stride=2, pad=3), x [2,1,12,12]",
    ),
    "maxpool_k3s2p1": (
        lambda: layer_case(nn.MaxPool2d(3, 2, 1), {"input": torch.randn(2, 3, 7, 7)}),
        "MaxPool2d(k=3, stride=2, pad=1) (padding is -inf), x [2,3,7,7]",
    ),
    "maxpool_k2s2": (
        lambda: layer_case(nn.MaxPool2d(2, 2), {"input": torch.randn(2, 3, 8, 8)}),
        "MaxPool2d(k=2, stride=2), x [2,3,8,8]",
    ),
    "avgpool_k2s2": (
        lambda: layer_case(nn.AvgPool2d(2, 2), {"input": torch.randn(2, 3, 8, 8)}),
        "AvgPool2d(k=2, stride=2), x [2,3,8,8]",
    ),
    "global_avgpool": (
        lambda: layer_case(
            Lambda(lambda x: x.mean(dim=(2, 3))), {"input": torch.randn(2, 3, 5, 5)}
        ),
        "AdaptiveAvgPool2d(1) + Flatten, x [2,3,5,5] -> [2,3]",
    ),
    "batchnorm_train": (
        lambda: batchnorm(True),
        "BatchNorm2d(3, eps=1e-5, momentum=0.1), train mode: normalise with "
        "biased batch var; running_var updated with unbiased batch var",
    ),
    "batchnorm_eval": (
        lambda: batchnorm(False),
        "BatchNorm2d(3, eps=1e-5), eval mode: normalise with running stats",
    ),
    "layernorm": (layernorm, "LayerNorm(8, eps=1e-5), x [2,4,8]"),
    "gelu": (
        lambda: layer_case(nn.GELU(approximate="none"), {"input": torch.randn(3, 7)}),
        "exact GELU x*Phi(x) = 0.5*x*(1+erf(x/sqrt(2))), x [3,7]",
    ),
    "relu": (
        lambda: layer_case(nn.ReLU(), {"input": away_from_zero((3, 7))}),
        "ReLU, x [3,7] with |x| >= 0.05",
    ),
    "sigmoid": (lambda: layer_case(nn.Sigmoid(), {"input": torch.randn(3, 7)}), "Sigmoid, x [3,7]"),
    "tanh": (lambda: layer_case(nn.Tanh(), {"input": torch.randn(3, 7)}), "Tanh, x [3,7]"),
    "softmax_xent": (
        softmax_xent,
        "mean over rows of -log_softmax(logits)[target]; logits [6,10] stored "
        "as input, targets int64 [6]; output scalar, grad_output = 1",
    ),
    "embedding": (embedding, "Embedding(11, 4), ids int64 [2,5] stored as input"),
    "attention": (
        attention,
        "causal self-attention, x [2,6,16], 4 heads: qkv Linear(16,48), q|k|v "
        "slices, head h = contiguous 4-wide chunk, softmax(q k^T/sqrt(4) + causal "
        "mask) v, proj Linear(16,16)",
    ),
    "gpt_block": (
        gpt_block,
        "pre-LN GPT Block(d=16, heads=4) as in pytorch_ddp_bench.py, exact GELU, x [2,6,16]",
    ),
    "lenet_sigmoid": (
        lambda: lenet_case("sigmoid"),
        "D2L LeNet (sigmoid + AvgPool2d(2,2)), x [4,1,28,28]; mean CE; "
        "3 plain SGD steps lr 0.1 on the same batch",
    ),
    "lenet_relu": (
        lambda: lenet_case("relu"),
        "D2L LeNet with ReLU + MaxPool2d(2,2), x [4,1,28,28]; mean CE; "
        "3 plain SGD steps lr 0.1 on the same batch",
    ),
    "resnet_w8": (
        resnet_w8,
        "D2L ResNet-18, widths (8,16,32,64), conv bias=True, train-mode BN, "
        "x [4,1,28,28]; mean CE; 3 plain SGD steps lr 0.1 on the same batch",
    ),
    "gpt_small": (
        gpt_small,
        "TinyGPT vocab 64, d 32, 2 layers, 4 heads, seq 16, ids [2,16]; mean CE "
        "over all 32 positions; 3 plain SGD steps lr 0.1 on the same batch",
    ),
    "sgd_momentum": (
        lambda: optimizer_case(lambda ps: torch.optim.SGD(ps, **SGD_HP)),
        "torch.optim.SGD("
        + ", ".join(f"{k}={v}" for k, v in SGD_HP.items())
        + "); param_after_each[i] = param after the step with grads[i]",
    ),
    "adamw": (
        lambda: optimizer_case(lambda ps: torch.optim.AdamW(ps, **ADAMW_HP)),
        "torch.optim.AdamW("
        + ", ".join(f"{k}={v}" for k, v in ADAMW_HP.items())
        + "); param_after_each[i] = param after the step with grads[i]",
    ),
}


# --------------------------------------------------------------------------
# Learning-rate schedule (plain formula, not a torch scheduler)
# --------------------------------------------------------------------------

LR_FORMULA = (
    "step s is 0-based. if s < warmup: lr = base * (s + 1) / warmup; "
    "else: p = (s - warmup) / (total - warmup), "
    "lr = min_lr + (base - min_lr) * 0.5 * (1 + cos(pi * p)), with min_lr = "
    "min_ratio * base. Listed for s = 0 .. total inclusive (s = total gives "
    "exactly min_lr); s > total is not covered."
)


def lr_at(s, base, warmup, total, min_lr):
    if s < warmup:
        return base * (s + 1) / warmup
    p = (s - warmup) / (total - warmup)
    return min_lr + (base - min_lr) * 0.5 * (1 + math.cos(math.pi * p))


def lr_schedule():
    base, warmup, total, ratio = 1.0, 5, 20, 0.1
    return {
        "formula": LR_FORMULA,
        "base_lr": base,
        "warmup_steps": warmup,
        "total_steps": total,
        "min_ratio": ratio,
        "min_lr": ratio * base,
        "lr": [lr_at(s, base, warmup, total, ratio * base) for s in range(total + 1)],
    }


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def to_store(t):
    t = t.detach().contiguous()
    return t.to(STORE_DTYPE) if t.is_floating_point() else t.to(torch.int64)


def deviation(ref, f32):
    """float32-vs-float64 difference of one file's results, per key as the norm-wise
    relative error ||f32 - f64|| / ||f64|| (elementwise maxima overstate it for small
    entries). Returns {group: (worst relative error, its max|f32-f64|, key)} where the
    group is the key's kind (output, grad, param_after3, ...), and the keys whose exact
    value is zero with the largest float32 noise found on them. Exact zeros occur for
    real: the bias of a conv feeding a train-mode BatchNorm has zero gradient, because BN
    subtracts the batch mean; float32 leaves rounding noise there."""
    worst, zeros, zero_noise = {}, [], 0.0
    for k, r in ref.items():
        r = r.double()
        d = f32[k].double() - r
        if r.abs().max().item() <= 1e-12:
            zeros.append(k)
            zero_noise = max(zero_noise, d.abs().max().item())
            continue
        rel = (d.norm() / r.norm()).item()
        group = k.split(".")[0]
        if rel >= worst.get(group, (-1.0,))[0]:
            worst[group] = (rel, d.abs().max().item(), k)
    return worst, zeros, zero_noise


def check_peer(peer_dir):
    """Our model builders must build the peer baseline's models."""
    sys.path.insert(0, peer_dir)
    import pytorch_ddp_bench as peer

    c = GPT_SMALL
    pairs = [
        ("lenet", lambda: lenet("sigmoid"), peer.lenet, torch.randn(2, 1, 28, 28)),
        (
            "d2l_resnet18",
            lambda: d2l_resnet18(1, 10),
            lambda: peer.d2l_resnet18(1, 10),
            torch.randn(2, 1, 28, 28),
        ),
        (
            "gpt",
            lambda: TinyGPT(c["vocab"], c["d"], c["layers"], c["heads"], c["seq"]),
            lambda: peer.TinyGPT(c["vocab"], c["d"], c["layers"], c["heads"], c["seq"]),
            torch.randint(0, c["vocab"], (2, c["seq"])),
        ),
    ]
    for name, ours_fn, peer_fn, x in pairs:
        torch.manual_seed(7)
        ours = ours_fn()
        torch.manual_seed(7)
        theirs = peer_fn()
        a, b = ours.state_dict(), theirs.state_dict()
        assert list(a) == list(b), f"{name}: state_dict keys differ"
        for k in a:
            assert torch.equal(a[k], b[k]), f"{name}: {k} differs"
        ours.train()
        theirs.train()
        ya, yb = ours(x), theirs(x)
        assert torch.allclose(ya, yb, rtol=1e-5, atol=1e-6), f"{name}: outputs differ"
        print(f"peer check ok: {name} ({len(a)} state_dict entries, outputs equal)")


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument(
        "--peer",
        default="",
        help="directory of pytorch_ddp_bench.py to check the model definitions against",
    )
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if args.peer:
        check_peer(args.peer)

    os.makedirs(args.out, exist_ok=True)
    names = [n for n in args.only.split(",") if n] or list(CASES)
    report = [
        "# float32 PyTorch vs the stored float64-computed references (written by "
        "tools/make_refs.py, torch %s)" % torch.__version__,
        "# per file and key kind, the worst key: ||f32-f64|| / ||f64||, max|f32-f64|, key",
        "# a correct float32 implementation should land within a small multiple of this",
    ]
    for name in names:
        builder, description = CASES[name]
        seed_for(name)
        stored, ref, f32 = builder()
        clash = set(stored) & set(ref)
        assert not clash, f"{name}: keys both input and result: {clash}"
        tensors = {k: to_store(v) for k, v in {**stored, **ref}.items()}
        # one metadata entry holding sorted JSON: safetensors writes its metadata map in
        # hash order, so several entries would make the file bytes differ run to run
        meta = {
            "meshtrain_ref": json.dumps(
                {
                    "case": name,
                    "description": description,
                    "torch": torch.__version__,
                    "compute_dtype": "float64, results rounded to float32",
                    "generator": "tools/make_refs.py",
                    "seed": zlib.crc32(name.encode()),
                },
                sort_keys=True,
            )
        }
        path = os.path.join(args.out, name + ".safetensors")
        save_file(tensors, path, metadata=meta)
        worst, zeros, zero_noise = deviation(ref, f32)
        for group, (rel, diff, key) in sorted(worst.items()):
            report.append(f"{name:16s} {group:14s} {rel:10.3e} {diff:10.3e}  {key}")
        if zeros:
            report.append(
                f"{name:16s} exactly zero in exact arithmetic (float32 noise up to "
                f"{zero_noise:.1e}; compare with an absolute tolerance): " + ", ".join(zeros)
            )
        print(f"wrote {path} ({os.path.getsize(path)} bytes, {len(tensors)} tensors)")

    if not args.only:
        path = os.path.join(args.out, "lr_schedule.json")
        with open(path, "w") as f:
            json.dump(lr_schedule(), f, indent=1)
            f.write("\n")
        print(f"wrote {path}")
        with open(PRECISION_REPORT, "w") as f:
            f.write("\n".join(report) + "\n")
        print(f"wrote {PRECISION_REPORT}")


if __name__ == "__main__":
    main()
