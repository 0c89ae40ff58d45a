"""A tiny decoder-only language model in CuPy alone, trained with flash_forward / flash_backward.

    python examples/train_tiny_lm.py                      # 300 steps, then the same run with dense attention
    python examples/train_tiny_lm.py --steps 100 --out /tmp/lm
    python examples/train_tiny_lm.py --dtype bfloat16     # attention in bfloat16 (tensor-core kernels)
    python examples/train_tiny_lm.py --attention fp8 --steps 1000   # FP8 attention against bf16 (Hopper)

Character-level, on examples/data/tiny_corpus.txt: token + position embeddings, 2 pre-norm blocks
(RMSNorm, causal multi-head attention through cupy_flash, a ReLU MLP), a final RMSNorm and an output
projection; cross-entropy loss; every gradient written by hand; Adam. The run is repeated with the
dense float64 reference attention (cupy_flash.attention_reference and its backward) from the same
initial weights and batches: the two loss curves should lie on each other. With --attention fp8, the
two runs are FP8 attention (q, k, v quantised per (batch, head), the FP8 forward and backward) and
bfloat16 attention, from the same weights and batches. Writes loss_curves.json
and loss_curves.png (with matplotlib, if installed) under --out. Needs an NVIDIA GPU and CuPy.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import cupy
import numpy

import cupy_flash
from cupy_flash._device import require_gpu
from cupy_flash.reference import round_to_dtype

HERE = os.path.dirname(os.path.abspath(__file__))


class FlashAttention:
    """cupy_flash in ``dtype``: float32, or float16 / bfloat16 (the tensor-core kernels; on an H100
    with CUPY_FLASH_KERNELS=experimental, the Hopper backward), cast back to float32 for the model."""

    def __init__(self, dtype="float32"):
        self.dtype = dtype

    def forward(self, q, k, v):
        q, k, v = (to_dtype(x, self.dtype) for x in (q, k, v))
        o, lse = cupy_flash.flash_forward(q, k, v, causal=True)
        return to_float32(o), (q, k, v, o, lse)

    def backward(self, do, saved):
        q, k, v, o, lse = saved
        grads = cupy_flash.flash_backward(to_dtype(do, self.dtype), q, k, v, o, lse, causal=True)
        return [to_float32(g) for g in grads]


class Fp8Attention:
    """cupy_flash on FP8 (Hopper): q, k, v quantised to e4m3 with a descale per (batch, head)
    (quantize_fp8), the FP8 forward, and flash_backward's gradients of attention over the
    dequantised inputs, taken straight through the quantisation to the float32 q, k, v."""

    def forward(self, q, k, v):
        (q8, q_descale), (k8, k_descale), (v8, v_descale) = (cupy_flash.quantize_fp8(x) for x in (q, k, v))
        descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        o, lse = cupy_flash.flash_forward(q8, k8, v8, causal=True, **descales)
        return to_float32(o), (q8, k8, v8, o, lse, descales)

    def backward(self, do, saved):
        q8, k8, v8, o, lse, descales = saved
        grads = cupy_flash.flash_backward(to_dtype(do, "bfloat16"), q8, k8, v8, o, lse, causal=True, **descales)
        return [to_float32(g) for g in grads]


def to_dtype(x, dtype):
    """float32 x rounded to dtype; bfloat16 by its bits (CuPy has no bfloat16 arithmetic)."""
    if dtype != "bfloat16":
        return x.astype(dtype)
    import ml_dtypes

    rounded = round_to_dtype(x, "bfloat16")   # float32 holding bfloat16 values: keep the high half
    return (rounded.view(cupy.uint32) >> 16).astype(cupy.uint16).view(ml_dtypes.bfloat16)


def to_float32(x):
    if x.dtype == cupy.float32:
        return x
    if x.dtype == cupy.float16:
        return x.astype(cupy.float32)
    return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)


class DenseAttention:
    """The float64 dense reference (scores materialised), results back in float32."""

    def forward(self, q, k, v):
        o, _ = cupy_flash.attention_reference(q, k, v, causal=True)
        return o.astype(cupy.float32), (q, k, v)

    def backward(self, do, saved):
        return [g.astype(cupy.float32) for g in cupy_flash.attention_reference_backward(do, *saved, causal=True)]


def init_params(vocab, d_model, layers, context, seed):
    rng = numpy.random.default_rng(seed)

    def normal(*shape, std=0.02):
        return cupy.asarray(rng.standard_normal(shape).astype(numpy.float32) * std)

    params = {"tok": normal(vocab, d_model), "pos": normal(context, d_model), "gain_f": cupy.ones(d_model, cupy.float32),
              "w_out": normal(d_model, vocab)}
    for i in range(layers):
        params.update({f"gain1_{i}": cupy.ones(d_model, cupy.float32), f"w_qkv_{i}": normal(d_model, 3 * d_model),
                       f"w_o_{i}": normal(d_model, d_model, std=0.02 / (2 * layers) ** 0.5),
                       f"gain2_{i}": cupy.ones(d_model, cupy.float32), f"w_1_{i}": normal(d_model, 4 * d_model),
                       f"w_2_{i}": normal(4 * d_model, d_model, std=0.02 / (2 * layers) ** 0.5)})
    return params


def rmsnorm(x, gain, eps=1e-6):
    r = 1.0 / cupy.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return x * r * gain, r


def rmsnorm_backward(dy, x, r, gain):
    dx_hat = dy * gain
    dgain = (dy * x * r).reshape(-1, x.shape[-1]).sum(axis=0)
    dx = r * (dx_hat - x * r * r * (dx_hat * x).mean(axis=-1, keepdims=True))
    return dx, dgain


def loss_and_grads(params, tokens, targets, heads, layers, attention):
    """Cross-entropy of the next character and the gradient of every parameter."""
    batch, context = tokens.shape
    d_model = params["tok"].shape[1]
    head_dim = d_model // heads
    x = params["tok"][tokens] + params["pos"][:context]
    saved = []
    for i in range(layers):
        a, r1 = rmsnorm(x, params[f"gain1_{i}"])
        q, k, v = (a @ params[f"w_qkv_{i}"]).reshape(batch, context, 3, heads, head_dim).transpose(2, 0, 1, 3, 4)
        q, k, v = (cupy.ascontiguousarray(t) for t in (q, k, v))
        o, attn_saved = attention.forward(q, k, v)
        o = o.reshape(batch, context, d_model)
        h = x + o @ params[f"w_o_{i}"]
        m, r2 = rmsnorm(h, params[f"gain2_{i}"])
        u = m @ params[f"w_1_{i}"]
        relu = cupy.maximum(u, 0)
        saved.append((x, a, r1, o, attn_saved, h, m, r2, u, relu))
        x = h + relu @ params[f"w_2_{i}"]
    f, rf = rmsnorm(x, params["gain_f"])
    logits = f @ params["w_out"]
    logits = logits - logits.max(axis=-1, keepdims=True)
    probs = cupy.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    count = batch * context
    picked = probs.reshape(count, -1)[cupy.arange(count), targets.reshape(-1)]
    loss = float(-cupy.log(picked).mean())

    grads = {}
    dlogits = probs.reshape(count, -1)
    dlogits[cupy.arange(count), targets.reshape(-1)] -= 1
    dlogits = (dlogits / count).reshape(probs.shape)
    grads["w_out"] = f.reshape(count, -1).T @ dlogits.reshape(count, -1)
    dx, grads["gain_f"] = rmsnorm_backward(dlogits @ params["w_out"].T, x, rf, params["gain_f"])
    for i in reversed(range(layers)):
        x_in, a, r1, o, attn_saved, h, m, r2, u, relu = saved[i]
        grads[f"w_2_{i}"] = relu.reshape(count, -1).T @ dx.reshape(count, -1)
        du = (dx @ params[f"w_2_{i}"].T) * (u > 0)
        grads[f"w_1_{i}"] = m.reshape(count, -1).T @ du.reshape(count, -1)
        dh_norm, grads[f"gain2_{i}"] = rmsnorm_backward(du @ params[f"w_1_{i}"].T, h, r2, params[f"gain2_{i}"])
        dh = dx + dh_norm
        grads[f"w_o_{i}"] = o.reshape(count, -1).T @ dh.reshape(count, -1)
        do = cupy.ascontiguousarray((dh @ params[f"w_o_{i}"].T).reshape(batch, context, heads, head_dim))
        dq, dk, dv = attention.backward(do, attn_saved)
        dqkv = cupy.stack([dq, dk, dv], axis=2).reshape(batch, context, 3 * d_model)
        grads[f"w_qkv_{i}"] = a.reshape(count, -1).T @ dqkv.reshape(count, -1)
        da_norm, grads[f"gain1_{i}"] = rmsnorm_backward(dqkv @ params[f"w_qkv_{i}"].T, x_in, r1, params[f"gain1_{i}"])
        dx = dh + da_norm
    grads["pos"] = dx.sum(axis=0)
    grads["tok"] = cupy.zeros_like(params["tok"])
    cupy.add.at(grads["tok"], tokens.reshape(-1), dx.reshape(count, -1))
    return loss, grads


def train(text, attention, args):
    chars = sorted(set(text))
    data = numpy.array([chars.index(c) for c in text], numpy.int32)
    params = init_params(len(chars), args.d_model, args.layers, args.context, args.seed)
    moments = {name: (cupy.zeros_like(p), cupy.zeros_like(p)) for name, p in params.items()}
    rng = numpy.random.default_rng(args.seed + 1)   # the same batches for both runs
    losses = []
    beta1, beta2 = 0.9, 0.99
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(data) - args.context - 1, args.batch)
        window = numpy.stack([data[s:s + args.context + 1] for s in starts])
        tokens, targets = cupy.asarray(window[:, :-1]), cupy.asarray(window[:, 1:])
        loss, grads = loss_and_grads(params, tokens, targets, args.heads, args.layers, attention)
        losses.append(loss)
        for name, g in grads.items():
            m, v = moments[name]
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            params[name] -= args.lr * (m / (1 - beta1**step)) / (cupy.sqrt(v / (1 - beta2**step)) + 1e-8)
        if step % 25 == 0 or step == 1:
            print(f"  step {step:4d}  loss {loss:.4f}", flush=True)
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="attention's input dtype (the model stays float32)")
    parser.add_argument("--attention", default="flash", choices=["flash", "fp8"],
                        help="flash: cupy_flash in --dtype against the dense reference; fp8: FP8 against bfloat16")
    parser.add_argument("--out", default=os.path.join(HERE, "out"))
    args = parser.parse_args()
    require_gpu("train_tiny_lm")   # one line and exit status 1 where there is none
    with open(os.path.join(HERE, "data", "tiny_corpus.txt")) as f:
        text = f.read()
    curves = {}
    if args.attention == "fp8":
        runs = (("fp8", Fp8Attention(), "cupy_flash FP8 attention (e4m3 q, k, v)"),
                ("bfloat16", FlashAttention("bfloat16"), "cupy_flash bfloat16 attention"))
    else:
        runs = (("flash", FlashAttention(args.dtype), "cupy_flash attention"),
                ("dense reference", DenseAttention(), "dense float64 reference attention"))
    for name, attention, _ in runs:
        print(f"{name} attention:", flush=True)
        started = time.time()
        curves[name] = train(text, attention, args)
        print(f"  {args.steps} steps in {time.time() - started:.1f} s", flush=True)
    (first, _, first_label), (second, _, second_label) = runs
    ours, baseline = numpy.array(curves[first]), numpy.array(curves[second])
    tail = max(1, args.steps // 10)
    print(f"loss: first {ours[0]:.3f}, last {tail} steps {ours[-tail:].mean():.4f} ({first}) / "
          f"{baseline[-tail:].mean():.4f} ({second}), {ours[-tail:].mean() / baseline[-tail:].mean() - 1:+.2%}; "
          f"max |{first} - {second}| over the run {numpy.abs(ours - baseline).max():.4f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "loss_curves.json"), "w") as f:
        json.dump({"args": vars(args), **curves}, f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: loss_curves.json only")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ours, label=first_label, linewidth=2)
    ax.plot(baseline, label=second_label, linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("tiny character LM, CuPy only, hand-written gradients")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "loss_curves.png"), dpi=120)
    print(f"wrote {os.path.join(args.out, 'loss_curves.png')}")


if __name__ == "__main__":
    main()
