"""The PyTorch adapter against SDPA's cuDNN backend, eager and under torch.compile(fullgraph=True),
forward and forward + backward, on FlashAttention's standard shapes (batch * seqlen = 16k tokens,
heads = 2048 / head_dim), in one run.

    python -m bench.torch_adapter                              # bf16, d 64 / 128 / 256, 512-16k, both masks
    python -m bench.torch_adapter --head-dims 128 --seqlens 1024 4096 --compiled 0
    python -m bench.torch_adapter --compiled 1 --mode reduce-overhead     # compiled calls as CUDA graphs

Timed as bench/attention.py times a call: CUDA events around one call with the GPU idle before it
(so the host time before the launch counts, as it does for a short call in a real step), warm-up
excluded, the median of many calls, 3 input sets rotated; ours and the peer alternate their order
round by round (--rounds). The forward + backward call is ``f(q, k, v).backward(do)``. TFLOP/s by
FlashAttention's count; ratios are ours / cuDNN in the same run.
"""

from __future__ import annotations

# ruff: noqa: E402 - the imports follow the help guard, which must run first
from bench import help_first, peer_or_exit

help_first("torch_adapter", __doc__)
peer_or_exit("torch_adapter", "torch")

import argparse
import statistics
import sys

import torch

from cupy_flash.torch_adapter import flash_attn_func

from .attention import flops, time_calls


def calls(causal: bool, compiled: bool, mode: str = "default"):
    """{name: (forward, forward + backward)} of ours and cuDNN's, each taking one input set;
    ``mode``: torch.compile's (reduce-overhead: the compiled calls replay as CUDA graphs)."""

    def ours(q, k, v):
        return flash_attn_func(q, k, v, causal=causal)

    def cudnn(q, k, v):   # SDPA's layout is (batch, heads, seqlen, head_dim): views, no copies
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)

    result = {}
    for name, fn in (("ours", ours), ("cudnn", cudnn)):
        if compiled:
            fn = torch.compile(fn, fullgraph=True, mode=mode)

        # Under reduce-overhead, each call is a new step (a training loop marks them so): the last
        # replay's outputs may be overwritten.
        step = torch.compiler.cudagraph_mark_step_begin if compiled and mode == "reduce-overhead" else (lambda: None)

        def forward(s, fn=fn):
            step()
            with torch.no_grad():
                fn(s[0], s[1], s[2])

        def both(s, fn=fn):
            step()
            if compiled and mode == "reduce-overhead":   # .grad of a replay is the graph's memory: not added into
                for x in s[4:7]:
                    x.grad = None
            fn(s[4], s[5], s[6]).backward(s[3])
        result[name] = (forward, both)
    return result

def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.torch_adapter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    parser.add_argument("--compiled", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    parser.add_argument("--mode", default="default", choices=["default", "reduce-overhead"],
                        help="torch.compile's mode for the compiled route (both libraries)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--features", type=int, default=2048)
    args = parser.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 256   # a compiled function per shape: no fallback to eager
    # SDPA on cuDNN alone, eager and compiled (a context manager inside a compiled function is
    # read at trace time at best): the other backends off for the process.
    for backend in ("flash", "mem_efficient", "math"):
        getattr(torch.backends.cuda, f"enable_{backend}_sdp")(False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__} (cuDNN {torch.backends.cudnn.version()}), bf16",
          file=sys.stderr)
    print("| d | N | causal | route | fwd ours | fwd cuDNN | fwd ratio | fwd+bwd ours | fwd+bwd cuDNN | fwd+bwd ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for compiled in args.compiled:
        for causal in args.causal:
            # One compiled function per mask for every shape: from the second shape on, dynamo
            # traces it with dynamic sizes, so the table costs a few compiles, not one per shape.
            routes = calls(bool(causal), bool(compiled), args.mode)
            for d in args.head_dims:
                for seqlen in args.seqlens:
                    batch, heads = max(1, args.tokens // seqlen), args.features // d
                    sets = []
                    for _ in range(3):
                        q, k, v, do = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
                                       for _ in range(4))
                        sets.append((q, k, v, do) + tuple(x.detach().clone().requires_grad_() for x in (q, k, v)))
                    rates = {}
                    for index, mode in enumerate(("fwd", "fwd_bwd")):
                        work = flops(batch, heads, seqlen, d, bool(causal), mode)
                        samples = {name: [] for name in routes}
                        for r in range(args.rounds):
                            order = list(routes) if r % 2 == 0 else list(routes)[::-1]
                            for name in order:
                                samples[name].append(work / time_calls(routes[name][index], sets) / 1e9)
                        rates.update({(name, mode): statistics.median(values) for name, values in samples.items()})
                    cells = []
                    for mode in ("fwd", "fwd_bwd"):
                        ours, peer = rates[("ours", mode)], rates[("cudnn", mode)]
                        cells += [f"{ours:.0f}", f"{peer:.0f}", f"{ours / peer:.2f}"]
                    route = ("compiled" + ("" if args.mode == "default" else f" {args.mode}")) if compiled else "eager"
                    print(f"| {d} | {seqlen} | {causal} | {route} | " + " | ".join(cells) + " |",
                          flush=True)
                    del sets
                    torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
