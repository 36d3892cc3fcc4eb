#!/usr/bin/env python3
"""Check the reference files written by tools/make_refs.py, independently of PyTorch's maths.

    /work/torch-venv/bin/python tools/check_refs.py   # check, write tools/refs_manifest.txt
    /work/torch-venv/bin/python tools/check_refs.py --self-test   # corruptions must fail

Why: the references are only worth comparing against if they mean what tools/README.md
says they mean. This script re-derives them from the documented conventions alone, with
a separate float64 NumPy implementation of every layer, model, optimizer and the
learning-rate formula (nothing here calls into torch except to load the files back):

* schema: every file has exactly the documented keys, dtypes and shapes (parameter names
  and shapes of the models are spelled out here from the architecture description);
* forward: output / logits / loss equal the NumPy forward on the stored inputs and params;
* gradients: for every input and parameter tensor, the stored gradient's inner product
  with two random directions matches a central finite difference of the NumPy forward
  (L = sum(output * grad_output) for layers, the mean cross-entropy for models);
* BatchNorm running statistics (momentum 0.1, unbiased batch variance), the first SGD
  step of every model (loss_steps[1] = loss at param - 0.1 * grad), SGD-momentum and
  AdamW updates, and the lr schedule formula.

It exits non-zero on the first failed check and prints which one.
"""

import json
import math
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFS = os.path.join(REPO, "crates", "nn", "tests", "refs")
MANIFEST = os.path.join(REPO, "tools", "refs_manifest.txt")

# Stored results are float32 roundings of exact values, so they agree with a float64
# recomputation to ~1e-7 relative; these bounds leave room for that and nothing else.
FORWARD_RTOL = 2e-6
# Gradient checks compare against float64 central differences; the worst observed use of
# each tolerance is printed at the end (FD_STATS); for the committed files it is < 10%.
ELEM_RTOL = 1e-6  # elementwise |fd - g| <= ELEM_RTOL * (|g| + max|g|)
ROW_RTOL = 1e-5  # |fd - <g, d>| <= ROW_RTOL * ||g on the row|| + ROW_ATOL, d a unit vector
ROW_ATOL = 5e-9  # float64 round-off of the finite difference of an O(1) loss, h = 1e-5
RNG = np.random.default_rng(2024)


class CheckFailed(Exception):
    pass


def expect(cond, msg):
    if not cond:
        raise CheckFailed(msg)


def close(got, want, rtol, what):
    """Norm-wise relative comparison (elementwise would be dominated by tiny entries)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    expect(got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}")
    err = np.linalg.norm(got - want)
    scale = np.linalg.norm(want)
    expect(err <= rtol * scale + 1e-12, f"{what}: relative error {err / max(scale, 1e-30):.3e}")
    return err / max(scale, 1e-30)


# --------------------------------------------------------------------------
# NumPy float64 layers (NCHW, PyTorch weight layouts)
# --------------------------------------------------------------------------


def linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def windows(x, k, stride, pad, fill):
    """All k*k strided windows of x [N,C,H,W], stacked on a new leading axis."""
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=fill)
    oh = (x.shape[2] + 2 * pad - k) // stride + 1
    ow = (x.shape[3] + 2 * pad - k) // stride + 1
    return np.stack(
        [
            xp[:, :, i : i + stride * (oh - 1) + 1 : stride, j : j + stride * (ow - 1) + 1 : stride]
            for i in range(k)
            for j in range(k)
        ]
    )


def conv2d(x, w, b, stride=1, pad=0):
    k = w.shape[2]
    patches = windows(x, k, stride, pad, 0.0)  # [k*k, N, C, OH, OW]
    wk = w.reshape(w.shape[0], w.shape[1], k * k)  # [O, C, k*k]
    return np.einsum("pnchw,ocp->nohw", patches, wk) + b[None, :, None, None]


def maxpool(x, k, stride, pad=0):
    return windows(x, k, stride, pad, -np.inf).max(axis=0)


def avgpool(x, k, stride):
    return windows(x, k, stride, 0, 0.0).mean(axis=0)


def bn_train(x, w, b, eps=1e-5):
    """Returns (output, batch mean, biased batch variance)."""
    mean = x.mean(axis=(0, 2, 3))
    var = x.var(axis=(0, 2, 3))
    xhat = (x - mean[None, :, None, None]) / np.sqrt(var + eps)[None, :, None, None]
    return xhat * w[None, :, None, None] + b[None, :, None, None], mean, var


def bn_eval(x, w, b, mean, var, eps=1e-5):
    xhat = (x - mean[None, :, None, None]) / np.sqrt(var + eps)[None, :, None, None]
    return xhat * w[None, :, None, None] + b[None, :, None, None]


def layernorm(x, w, b, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


ERF = np.vectorize(math.erf)


def gelu(x):
    return 0.5 * x * (1.0 + ERF(x / math.sqrt(2.0)))


def relu(x):
    return np.maximum(x, 0.0)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def cross_entropy(logits, targets):
    z = logits.reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    return -log_softmax(z)[np.arange(len(t)), t].mean()


def causal_attention(x, p, prefix, heads):
    """qkv -> q|k|v slices -> per-head contiguous chunks -> causal softmax(qk^T/sqrt(hd)) v
    -> proj, written out head by head."""
    b, t, d = x.shape
    qkv = linear(x, p[prefix + "qkv.weight"], p[prefix + "qkv.bias"])
    q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]
    hd = d // heads
    future = np.triu(np.ones((t, t), dtype=bool), k=1)
    y = np.empty_like(q)
    for h in range(heads):
        c = slice(h * hd, (h + 1) * hd)
        scores = q[..., c] @ k[..., c].transpose(0, 2, 1) / math.sqrt(hd)
        scores[:, future] = -np.inf
        y[..., c] = np.exp(log_softmax(scores)) @ v[..., c]
    return linear(y, p[prefix + "proj.weight"], p[prefix + "proj.bias"])


def gpt_block(x, p, prefix, heads):
    def ln(name, z):
        return layernorm(z, p[prefix + name + ".weight"], p[prefix + name + ".bias"])

    x = x + causal_attention(ln("ln1", x), p, prefix, heads)
    h = gelu(linear(ln("ln2", x), p[prefix + "fc1.weight"], p[prefix + "fc1.bias"]))
    return x + linear(h, p[prefix + "fc2.weight"], p[prefix + "fc2.bias"])


# --------------------------------------------------------------------------
# Models on a flat {meshtrain name: array} dict; BN layers report their batch stats
# --------------------------------------------------------------------------


def lenet(x, p, act, pool):
    def c(name, z, pad=0):
        return conv2d(z, p[name + ".weight"], p[name + ".bias"], 1, pad)

    def f(name, z):
        return linear(z, p[name + ".weight"], p[name + ".bias"])

    y = pool(act(c("conv1", x, pad=2)))
    y = pool(act(c("conv2", y))).reshape(x.shape[0], -1)
    return f("fc3", act(f("fc2", act(f("fc1", y)))))


def lenet_sigmoid(x, p, stats=None):
    return lenet(x, p, sigmoid, lambda z: avgpool(z, 2, 2))


def lenet_relu(x, p, stats=None):
    return lenet(x, p, relu, lambda z: maxpool(z, 2, 2))


def resnet(x, p, stats=None):
    stats = {} if stats is None else stats

    def bn(name, z):
        y, mean, var = bn_train(z, p[name + ".weight"], p[name + ".bias"])
        stats[name] = (mean, var, z.shape[0] * z.shape[2] * z.shape[3])
        return y

    def conv(name, z, stride=1, pad=0):
        return conv2d(z, p[name + ".weight"], p[name + ".bias"], stride, pad)

    y = maxpool(relu(bn("stem.bn", conv("stem.conv", x, 2, 3))), 3, 2, 1)
    for s in range(1, 5):
        for blk in range(2):
            pre = f"stage{s}.{blk}."
            stride = 2 if (s > 1 and blk == 0) else 1
            h = relu(bn(pre + "bn1", conv(pre + "conv1", y, stride, 1)))
            h = bn(pre + "bn2", conv(pre + "conv2", h, 1, 1))
            skip = conv(pre + "conv3", y, stride, 0) if pre + "conv3.weight" in p else y
            y = relu(h + skip)
    return linear(y.mean(axis=(2, 3)), p["fc.weight"], p["fc.bias"])


def gpt(idx, p, stats=None, heads=4, layers=2):
    t = idx.shape[1]
    x = p["tok.weight"][idx] + p["pos.weight"][np.arange(t)][None]
    for i in range(layers):
        x = gpt_block(x, p, f"blocks.{i}.", heads)
    return linear(layernorm(x, p["ln_f.weight"], p["ln_f.bias"]), p["head.weight"])


def conv_params(name, cin, cout, k):
    return {name + ".weight": (cout, cin, k, k), name + ".bias": (cout,)}


def affine(name, n):
    return {name + ".weight": (n,), name + ".bias": (n,)}


def lenet_shapes():
    s = {**conv_params("conv1", 1, 6, 5), **conv_params("conv2", 6, 16, 5)}
    for name, i, o in [("fc1", 400, 120), ("fc2", 120, 84), ("fc3", 84, 10)]:
        s.update({name + ".weight": (o, i), name + ".bias": (o,)})
    return s, {}


def resnet_shapes(widths=(8, 16, 32, 64)):
    params = {**conv_params("stem.conv", 1, widths[0], 7), **affine("stem.bn", widths[0])}
    cin = widths[0]
    for s, w in enumerate(widths, start=1):
        for blk in range(2):
            pre = f"stage{s}.{blk}."
            params.update(conv_params(pre + "conv1", cin, w, 3))
            params.update(affine(pre + "bn1", w))
            params.update(conv_params(pre + "conv2", w, w, 3))
            params.update(affine(pre + "bn2", w))
            if s > 1 and blk == 0:
                params.update(conv_params(pre + "conv3", cin, w, 1))
            cin = w
    params.update({"fc.weight": (10, widths[-1]), "fc.bias": (10,)})
    buffers = {}
    for n, shape in params.items():
        if ".bn" in n and n.endswith(".weight"):
            base = n[: -len(".weight")]
            buffers[base + ".running_mean"] = shape
            buffers[base + ".running_var"] = shape
    return params, buffers


def gpt_shapes(vocab=64, d=32, layers=2, seq=16):
    s = {"tok.weight": (vocab, d), "pos.weight": (seq, d)}
    for i in range(layers):
        pre = f"blocks.{i}."
        s.update(affine(pre + "ln1", d))
        s.update(
            {
                pre + "qkv.weight": (3 * d, d),
                pre + "qkv.bias": (3 * d,),
                pre + "proj.weight": (d, d),
                pre + "proj.bias": (d,),
            }
        )
        s.update(affine(pre + "ln2", d))
        s.update(
            {
                pre + "fc1.weight": (4 * d, d),
                pre + "fc1.bias": (4 * d,),
                pre + "fc2.weight": (d, 4 * d),
                pre + "fc2.bias": (d,),
            }
        )
    s.update(affine("ln_f", d))
    s["head.weight"] = (vocab, d)
    return s, {}


# name -> (forward, (param shapes, buffer shapes), input shape, targets shape, logits shape)
MODELS = {
    "lenet_sigmoid": (lenet_sigmoid, lenet_shapes(), (4, 1, 28, 28), (4,), (4, 10)),
    "lenet_relu": (lenet_relu, lenet_shapes(), (4, 1, 28, 28), (4,), (4, 10)),
    "resnet_w8": (resnet, resnet_shapes(), (4, 1, 28, 28), (4,), (4, 10)),
    "gpt_small": (gpt, gpt_shapes(), (2, 16), (2, 16), (2, 16, 64)),
}


# --------------------------------------------------------------------------
# Layer cases: forward on {"input": ..., "param.x": ...}, and the documented shapes
# --------------------------------------------------------------------------


def conv_case(stride, pad):
    return lambda a: conv2d(a["input"], a["param.weight"], a["param.bias"], stride, pad)


def bn_eval_case(a):
    return bn_eval(
        a["input"],
        a["param.weight"],
        a["param.bias"],
        a["buffer.running_mean"],
        a["buffer.running_var"],
    )


def attention_case(a):
    p = {k[len("param.") :]: v for k, v in a.items() if k.startswith("param.")}
    return causal_attention(a["input"], p, "", 4)


def gpt_block_case(a):
    p = {k[len("param.") :]: v for k, v in a.items() if k.startswith("param.")}
    return gpt_block(a["input"], p, "", 4)


def linear_shapes(i, o):
    return {"weight": (o, i), "bias": (o,)}


def conv_shapes(cin, cout, k):
    return {"weight": (cout, cin, k, k), "bias": (cout,)}


BN_BUFFERS = {"running_mean": (3,), "running_var": (3,)}
NO_PARAMS = {}

# name -> (forward, {input key: shape}, {param: shape}, {buffer: shape}, output shape)
LAYERS = {
    "linear": (
        lambda a: linear(a["input"], a["param.weight"], a["param.bias"]),
        {"input": (4, 5)},
        linear_shapes(5, 3),
        {},
        (4, 3),
    ),
    "linear3d": (
        lambda a: linear(a["input"], a["param.weight"], a["param.bias"]),
        {"input": (2, 3, 5)},
        linear_shapes(5, 6),
        {},
        (2, 3, 6),
    ),
    "conv_k5p2": (conv_case(1, 2), {"input": (2, 3, 8, 8)}, conv_shapes(3, 4, 5), {}, (2, 4, 8, 8)),
    "conv_k3s2p1": (
        conv_case(2, 1),
        {"input": (2, 3, 7, 7)},
        conv_shapes(3, 4, 3),
        {},
        (2, 4, 4, 4),
    ),
    "conv_k1s2": (conv_case(2, 0), {"input": (2, 3, 7, 7)}, conv_shapes(3, 4, 1), {}, (2, 4, 4, 4)),
    "conv_k7s2p3": (
        conv_case(2, 3),
        {"input": (2, 1, 12, 12)},
        conv_shapes(1, 4, 7),
        {},
        (2, 4, 6, 6),
    ),
    "maxpool_k3s2p1": (
        lambda a: maxpool(a["input"], 3, 2, 1),
        {"input": (2, 3, 7, 7)},
        NO_PARAMS,
        {},
        (2, 3, 4, 4),
    ),
    "maxpool_k2s2": (
        lambda a: maxpool(a["input"], 2, 2),
        {"input": (2, 3, 8, 8)},
        NO_PARAMS,
        {},
        (2, 3, 4, 4),
    ),
    "avgpool_k2s2": (
        lambda a: avgpool(a["input"], 2, 2),
        {"input": (2, 3, 8, 8)},
        NO_PARAMS,
        {},
        (2, 3, 4, 4),
    ),
    "global_avgpool": (
        lambda a: a["input"].mean(axis=(2, 3)),
        {"input": (2, 3, 5, 5)},
        NO_PARAMS,
        {},
        (2, 3),
    ),
    "batchnorm_train": (
        lambda a: bn_train(a["input"], a["param.weight"], a["param.bias"])[0],
        {"input": (4, 3, 5, 5)},
        {"weight": (3,), "bias": (3,)},
        BN_BUFFERS,
        (4, 3, 5, 5),
    ),
    "batchnorm_eval": (
        bn_eval_case,
        {"input": (4, 3, 5, 5)},
        {"weight": (3,), "bias": (3,)},
        BN_BUFFERS,
        (4, 3, 5, 5),
    ),
    "layernorm": (
        lambda a: layernorm(a["input"], a["param.weight"], a["param.bias"]),
        {"input": (2, 4, 8)},
        {"weight": (8,), "bias": (8,)},
        {},
        (2, 4, 8),
    ),
    "gelu": (lambda a: gelu(a["input"]), {"input": (3, 7)}, NO_PARAMS, {}, (3, 7)),
    "relu": (lambda a: relu(a["input"]), {"input": (3, 7)}, NO_PARAMS, {}, (3, 7)),
    "sigmoid": (lambda a: sigmoid(a["input"]), {"input": (3, 7)}, NO_PARAMS, {}, (3, 7)),
    "tanh": (lambda a: np.tanh(a["input"]), {"input": (3, 7)}, NO_PARAMS, {}, (3, 7)),
    "softmax_xent": (
        lambda a: cross_entropy(a["input"], a["targets"]),
        {"input": (6, 10), "targets": (6,)},
        NO_PARAMS,
        {},
        (),
    ),
    "embedding": (
        lambda a: a["param.weight"][a["input"]],
        {"input": (2, 5)},
        {"weight": (11, 4)},
        {},
        (2, 5, 4),
    ),
    "attention": (
        attention_case,
        {"input": (2, 6, 16)},
        {"qkv.weight": (48, 16), "qkv.bias": (48,), "proj.weight": (16, 16), "proj.bias": (16,)},
        {},
        (2, 6, 16),
    ),
    "gpt_block": (
        gpt_block_case,
        {"input": (2, 6, 16)},
        {
            "ln1.weight": (16,),
            "ln1.bias": (16,),
            "qkv.weight": (48, 16),
            "qkv.bias": (48,),
            "proj.weight": (16, 16),
            "proj.bias": (16,),
            "ln2.weight": (16,),
            "ln2.bias": (16,),
            "fc1.weight": (64, 16),
            "fc1.bias": (64,),
            "fc2.weight": (16, 64),
            "fc2.bias": (16,),
        },
        {},
        (2, 6, 16),
    ),
}

INT_KEYS = {"targets", "input@embedding", "input@gpt_small"}


def is_int_key(case, key):
    return key == "targets" or f"{key}@{case}" in INT_KEYS


# --------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------


def check_schema(case, t, want):
    """want: {key: shape}; the file must hold exactly these keys, int64 where documented."""
    expect(
        set(t) == set(want),
        f"keys: missing {sorted(set(want) - set(t))}, unexpected {sorted(set(t) - set(want))}",
    )
    for k, shape in want.items():
        expect(tuple(t[k].shape) == tuple(shape), f"{k}: shape {t[k].shape} != {shape}")
        dtype = np.int64 if is_int_key(case, k) else np.float32
        expect(t[k].dtype == dtype, f"{k}: dtype {t[k].dtype} != {np.dtype(dtype)}")


def finite_difference(f, args, key, direction, h):
    plus, minus = dict(args), dict(args)
    plus[key] = args[key] + h * direction
    minus[key] = args[key] - h * direction
    return (f(plus) - f(minus)) / (2 * h)


FD_STATS = {"elementwise": 0.0, "rows": 0.0}  # largest fraction of the tolerance used


def grad_check_elementwise(f, args, key, grad, what, h=1e-5):
    """Full central-difference gradient, element by element (small layer cases)."""
    g = grad.astype(np.float64)
    numeric = np.empty_like(g)
    for idx in np.ndindex(g.shape):
        d = np.zeros_like(g)
        d[idx] = 1.0
        numeric[idx] = finite_difference(f, args, key, d, h)
    tol = ELEM_RTOL * (np.abs(g) + max(np.abs(g).max(), 1e-30))
    err = np.abs(numeric - g)
    FD_STATS["elementwise"] = max(FD_STATS["elementwise"], float((err / tol).max()))
    bad = err > tol
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise CheckFailed(
            f"{what}{list(i)}: finite difference {numeric[i]:.9g} vs stored gradient {g[i]:.9g}"
        )


def grad_check_rows(f, args, key, grad, what, h=1e-5):
    """Directional derivatives along a random unit direction inside each leading row
    (each output unit of a weight), or two over the whole of a 1-D tensor (models, where
    a full elementwise gradient would take too many forward passes). The tolerance is
    relative to the row's gradient norm, so an error in one entry still shows."""
    g = grad.astype(np.float64)
    if g.ndim <= 1:
        supports = [np.ones(g.shape, dtype=bool)] * 2
    else:
        supports = []
        for r in range(g.shape[0]):
            m = np.zeros(g.shape, dtype=bool)
            m[r] = True
            supports.append(m)
    for m in supports:
        d = np.where(m, RNG.standard_normal(g.shape), 0.0)
        d /= np.linalg.norm(d)
        numeric = finite_difference(f, args, key, d, h)
        analytic = float(np.sum(g * d))
        row_norm = np.linalg.norm(g[m])
        err, tol = abs(numeric - analytic), ROW_RTOL * row_norm + ROW_ATOL
        FD_STATS["rows"] = max(FD_STATS["rows"], float(err / tol))
        if err > tol:
            raise CheckFailed(
                f"{what} row {int(np.argwhere(m)[0][0])}: finite "
                f"difference {numeric:.9g} vs stored gradient {analytic:.9g}"
            )


def as64(t):
    return {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in t.items()}


def check_layer(case, t):
    forward, inputs, params, buffers, out_shape = LAYERS[case]
    want = dict(inputs)
    want.update({"param." + n: s for n, s in params.items()})
    want.update({"buffer." + n: s for n, s in buffers.items()})
    want.update({"grad." + n: s for n, s in params.items()})
    want.update({"grad_output": out_shape, "output": out_shape})
    float_inputs = [k for k in inputs if not is_int_key(case, k)]
    want.update({"grad_" + k: inputs[k] for k in float_inputs})
    if case == "batchnorm_train":
        want.update({"running_mean_after": (3,), "running_var_after": (3,)})
    check_schema(case, t, want)

    a = as64(t)
    args = {
        k: a[k]
        for k in list(inputs) + ["param." + n for n in params] + ["buffer." + n for n in buffers]
    }
    close(forward(args), a["output"], FORWARD_RTOL, "output")
    go = a["grad_output"]

    def loss(z):
        return float(np.sum(forward(z) * go))

    for k in float_inputs:
        grad_check_elementwise(loss, args, k, a["grad_" + k], "grad_" + k)
    for n in params:
        grad_check_elementwise(loss, args, "param." + n, a["grad." + n], "grad." + n)

    if case == "batchnorm_train":
        x = a["input"]
        n = x.shape[0] * x.shape[2] * x.shape[3]
        mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
        close(
            a["running_mean_after"],
            0.9 * a["buffer.running_mean"] + 0.1 * mean,
            FORWARD_RTOL,
            "running_mean_after",
        )
        close(
            a["running_var_after"],
            0.9 * a["buffer.running_var"] + 0.1 * var * n / (n - 1),
            FORWARD_RTOL,
            "running_var_after (unbiased batch variance)",
        )
    if case == "relu":
        expect(np.abs(a["input"]).min() > 0.0, "relu input has an exact zero")
    if case == "embedding":
        expect(len(np.unique(t["input"])) < t["input"].size, "want a repeated token id")
    if case == "softmax_xent":
        expect(float(a["grad_output"]) == 1.0, "grad_output must be 1")


def check_model(case, t):
    forward, (params, buffers), in_shape, tgt_shape, logit_shape = MODELS[case]
    want = {
        "input": in_shape,
        "targets": tgt_shape,
        "logits": logit_shape,
        "loss": (),
        "loss_steps": (3,),
    }
    for n, s in params.items():
        want.update({"param." + n: s, "grad." + n: s, "param_after3." + n: s})
    for n, s in buffers.items():
        want.update({"buffer." + n: s, "buffer_after." + n: s, "buffer_after3." + n: s})
    check_schema(case, t, want)

    a = as64(t)
    p = {n: a["param." + n] for n in params}
    x, y = a["input"], a["targets"]
    stats = {}
    logits = forward(x, p, stats)
    close(logits, a["logits"], FORWARD_RTOL * 10, "logits")
    close(cross_entropy(logits, y), a["loss"], FORWARD_RTOL, "loss")
    expect(a["loss_steps"][0] == a["loss"], "loss_steps[0] != loss")

    args = {"param." + n: a["param." + n] for n in params}

    def loss(z):
        return cross_entropy(forward(x, {n: z["param." + n] for n in params}), y)

    for n in params:
        grad_check_rows(loss, args, "param." + n, a["grad." + n], "grad." + n)

    # first SGD step: the loss at param - lr * grad must be the stored second loss
    stepped = {n: p[n] - 0.1 * a["grad." + n] for n in params}
    close(cross_entropy(forward(x, stepped), y), a["loss_steps"][1], 1e-5, "loss_steps[1]")
    moved = sum(np.linalg.norm(a["param_after3." + n] - p[n]) for n in params)
    expect(moved > 0, "param_after3 equals param")

    for name, (mean, var, count) in stats.items():
        close(
            a[f"buffer_after.{name}.running_mean"],
            0.9 * a[f"buffer.{name}.running_mean"] + 0.1 * mean,
            FORWARD_RTOL * 10,
            f"buffer_after.{name}.running_mean",
        )
        close(
            a[f"buffer_after.{name}.running_var"],
            0.9 * a[f"buffer.{name}.running_var"] + 0.1 * var * count / (count - 1),
            FORWARD_RTOL * 10,
            f"buffer_after.{name}.running_var",
        )
    expect(set(stats) == {n.rsplit(".", 1)[0] for n in buffers}, "BN layers != buffers")


def sgd_reference(p, grads, lr=0.1, momentum=0.9, weight_decay=0.01):
    out, buf = [], None
    for g in grads:
        g = g + weight_decay * p
        buf = g if buf is None else momentum * buf + g
        p = p - lr * buf
        out.append(p)
    return np.stack(out)


def adamw_reference(p, grads, lr=0.01, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1):
    out, m, v = [], np.zeros_like(p), np.zeros_like(p)
    for step, g in enumerate(grads, start=1):
        p = p * (1 - lr * weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat, vhat = m / (1 - b1**step), v / (1 - b2**step)
        p = p - lr * mhat / (np.sqrt(vhat) + eps)
        out.append(p)
    return np.stack(out)


def check_optimizer(case, t):
    check_schema(case, t, {"param": (10,), "grads": (3, 10), "param_after_each": (3, 10)})
    a = as64(t)
    ref = sgd_reference if case == "sgd_momentum" else adamw_reference
    close(a["param_after_each"], ref(a["param"], a["grads"]), FORWARD_RTOL, "param_after_each")


def check_lr_schedule(path):
    with open(path) as f:
        s = json.load(f)
    base, warm, total = s["base_lr"], s["warmup_steps"], s["total_steps"]
    expect((base, warm, total, s["min_ratio"]) == (1.0, 5, 20, 0.1), "schedule settings")
    min_lr = s["min_ratio"] * base
    want = []
    for step in range(total + 1):
        if step < warm:
            want.append(base * (step + 1) / warm)
        else:
            prog = (step - warm) / (total - warm)
            want.append(min_lr + (base - min_lr) * 0.5 * (1 + math.cos(math.pi * prog)))
    expect(len(s["lr"]) == total + 1, "schedule length")
    expect(max(abs(u - v) for u, v in zip(s["lr"], want, strict=True)) < 1e-15, "schedule values")
    expect(abs(s["lr"][-1] - min_lr) < 1e-15 and s["lr"][warm] == base, "schedule ends")


OPTIMIZERS = ("sgd_momentum", "adamw")


def manifest_entry(path):
    """Loaded back with safetensors.torch, as the Rust side will see it (dtype, shape)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["meshtrain_ref"])
    lines = [
        f"{os.path.basename(path)}  ({os.path.getsize(path)} bytes, {len(tensors)} "
        f"tensors) -- {meta['description']}"
    ]
    for k in sorted(tensors):
        v = tensors[k]
        dtype = str(v.dtype).replace("torch.", "")
        lines.append(f"    {k:44s} {dtype:8s} {list(v.shape)}")
    return lines


def check_case(case, t):
    if case in LAYERS:
        check_layer(case, t)
    elif case in MODELS:
        check_model(case, t)
    elif case in OPTIMIZERS:
        check_optimizer(case, t)
    else:
        raise CheckFailed("unknown case")


def tanh_gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def swap_q_k(w):
    w = w.copy()
    w[:16], w[16:32] = w[16:32].copy(), w[:16].copy()
    return w


def biased_running_var(t, n):
    x = t["input"].astype(np.float64)
    return (0.9 * t["buffer.running_var"] + 0.1 * x.var(axis=(0, 2, 3))).astype(np.float32)


def scaled(v, index, factor):
    v = v.copy()
    v[index] *= factor
    return v


# (case, what the corruption models, function returning the corrupted tensor dict)
MUTATIONS = [
    (
        "linear",
        "one weight-gradient entry 1% off",
        lambda t: {**t, "grad.weight": scaled(t["grad.weight"], (0, 0), 1.01)},
    ),
    (
        "linear3d",
        "bias gradient not summed over the leading dims",
        lambda t: {**t, "grad.bias": t["grad_output"][0, 0].copy()},
    ),
    (
        "conv_k5p2",
        "kernel flipped (correlation vs convolution)",
        lambda t: {**t, "param.weight": t["param.weight"][:, :, ::-1, ::-1].copy()},
    ),
    (
        "conv_k3s2p1",
        "input gradient 0.1% off in one place",
        lambda t: {**t, "grad_input": scaled(t["grad_input"], (0, 0, 3, 3), 1.001)},
    ),
    (
        "maxpool_k3s2p1",
        "output from 0-padding instead of -inf padding",
        lambda t: {**t, "output": np.maximum(t["output"], 0.0)},
    ),
    (
        "batchnorm_train",
        "running_var updated with the biased variance",
        lambda t: {**t, "running_var_after": biased_running_var(t, 100)},
    ),
    (
        "layernorm",
        "weight and bias gradients swapped",
        lambda t: {**t, "grad.weight": t["grad.bias"], "grad.bias": t["grad.weight"]},
    ),
    (
        "gelu",
        "tanh-approximate GELU",
        lambda t: {**t, "output": tanh_gelu(t["input"].astype(np.float64)).astype(np.float32)},
    ),
    ("softmax_xent", "targets off by one", lambda t: {**t, "targets": (t["targets"] + 1) % 10}),
    (
        "softmax_xent",
        "targets stored as int32",
        lambda t: {**t, "targets": t["targets"].astype(np.int32)},
    ),
    (
        "embedding",
        "a repeated id's gradient overwritten, not accumulated",
        lambda t: {**t, "grad.weight": np.zeros_like(t["grad.weight"])},
    ),
    (
        "attention",
        "q and k swapped in the qkv split",
        lambda t: {**t, "param.qkv.weight": swap_q_k(t["param.qkv.weight"])},
    ),
    ("gpt_block", "a key missing", lambda t: {k: v for k, v in t.items() if k != "grad.fc2.bias"}),
    (
        "resnet_w8",
        "a BN running_var 1% off in one channel",
        lambda t: {
            **t,
            "buffer_after.stage4.1.bn1.running_var": scaled(
                t["buffer_after.stage4.1.bn1.running_var"], 0, 1.01
            ),
        },
    ),
    (
        "gpt_small",
        "second-step loss 1e-4 off",
        lambda t: {**t, "loss_steps": t["loss_steps"] + np.float32([0, 1e-4, 0])},
    ),
    (
        "gpt_small",
        "positional embedding not added",
        lambda t: {**t, "param.pos.weight": np.zeros_like(t["param.pos.weight"])},
    ),
    (
        "resnet_w8",
        "projection conv3 gradient 1% off in one output channel",
        lambda t: {
            **t,
            "grad.stage3.0.conv3.weight": scaled(t["grad.stage3.0.conv3.weight"], 5, 1.01),
        },
    ),
    (
        "lenet_sigmoid",
        "a loss of sum instead of mean over the batch",
        lambda t: {**t, "loss": t["loss"] * 4},
    ),
    (
        "lenet_relu",
        "fc1 gradient 1% off in one row",
        lambda t: {**t, "grad.fc1.weight": scaled(t["grad.fc1.weight"], 3, 1.01)},
    ),
    (
        "adamw",
        "one update 1e-4 off",
        lambda t: {**t, "param_after_each": scaled(t["param_after_each"], (2, 4), 1.0001)},
    ),
    (
        "sgd_momentum",
        "momentum buffer ignored on the last step",
        lambda t: {
            **t,
            "param_after_each": np.concatenate(
                [
                    t["param_after_each"][:2],
                    (
                        t["param_after_each"][1]
                        - 0.1 * (t["grads"][2] + 0.01 * t["param_after_each"][1])
                    )[None],
                ]
            ),
        },
    ),
]


def self_test():
    """Each corruption above must make the checks fail, so they can fail."""
    from safetensors.numpy import load_file

    ok = True
    for case, what, mutate in MUTATIONS:
        t = load_file(os.path.join(REFS, case + ".safetensors"))
        try:
            check_case(case, mutate(t))
            print(f"FAIL self-test {case}: corruption not detected: {what}")
            ok = False
        except CheckFailed as e:
            print(f"ok   self-test {case}: caught '{what}' ({e})")
    return ok


def main():
    from safetensors.numpy import load_file

    if "--self-test" in sys.argv[1:]:
        sys.exit(0 if self_test() else 1)
    files = sorted(f for f in os.listdir(REFS) if f.endswith(".safetensors"))
    expected = set(LAYERS) | set(MODELS) | set(OPTIMIZERS)
    found = {f[: -len(".safetensors")] for f in files}
    failed = False
    if found != expected:
        print(
            f"FAIL file set: missing {sorted(expected - found)}, "
            f"unexpected {sorted(found - expected)}"
        )
        failed = True
    manifest = [
        "# tools/refs_manifest.txt, written by tools/check_refs.py: every reference "
        "file, its keys, dtypes and shapes",
        f"# total size of crates/nn/tests/refs: "
        f"{sum(os.path.getsize(os.path.join(REFS, f)) for f in os.listdir(REFS))} bytes",
        "",
    ]
    for f in files:
        case = f[: -len(".safetensors")]
        path = os.path.join(REFS, f)
        try:
            check_case(case, load_file(path))
            print(f"ok   {case}")
        except CheckFailed as e:
            print(f"FAIL {case}: {e}")
            failed = True
        manifest += manifest_entry(path) + [""]
    try:
        check_lr_schedule(os.path.join(REFS, "lr_schedule.json"))
        print("ok   lr_schedule.json")
    except CheckFailed as e:
        print(f"FAIL lr_schedule.json: {e}")
        failed = True
    manifest.append(
        "lr_schedule.json -- keys formula, base_lr, warmup_steps, total_steps, "
        "min_ratio, min_lr, lr (list, steps 0..total inclusive)"
    )
    with open(MANIFEST, "w") as out:
        out.write("\n".join(manifest) + "\n")
    print(f"wrote {MANIFEST}")
    print(
        "largest fraction of the finite-difference tolerances used: "
        + ", ".join(f"{k} {v:.3f}" for k, v in FD_STATS.items())
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
