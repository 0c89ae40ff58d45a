"""cupy_flash's custom ops inside torch.compile(fullgraph=True): a small transformer block trains
with no graph breaks, its loss curve beside the same block on PyTorch's SDPA.

    python examples/torch_compile.py

Needs an NVIDIA GPU, CuPy and PyTorch with CUDA.
"""

import sys

from cupy_flash._device import install_hint, require_gpu

try:
    import torch
except ImportError as error:
    sys.exit(f"torch_compile needs PyTorch with CUDA: {install_hint('cuda12,torch')} ({error})")
require_gpu("torch_compile")

from cupy_flash.torch_adapter import flash_attn_func  # noqa: E402

HEADS, HEAD_DIM = 8, 64
WIDTH = HEADS * HEAD_DIM


class Block(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.qkv, self.out = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))
        self.attention = attention

    def forward(self, x):
        batch, seqlen, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, seqlen, 3, HEADS, HEAD_DIM).unbind(2)
        x = x + self.out(self.attention(q, k, v).reshape(batch, seqlen, WIDTH))
        return x + self.mlp(x)


def ours(q, k, v):
    return flash_attn_func(q, k, v, causal=True)


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=True).transpose(1, 2)


def train(attention, steps=30):
    torch.manual_seed(0)
    model = Block(attention).cuda()
    compiled = torch.compile(model, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 1024, WIDTH, device="cuda", generator=generator)
    target = torch.roll(x, shifts=1, dims=1)   # learn to copy the previous token's vector
    curve = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(compiled(x).float(), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        curve.append(float(loss))
    return model, x, curve


def main():
    model, x, curve = train(ours)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(model)(x)
    print(f"graphs {explanation.graph_count}, graph breaks {explanation.graph_break_count}")
    _, _, reference = train(sdpa)
    print("step  cupy_flash   SDPA")
    for i in range(0, len(curve), 5):
        print(f"{i:4d}  {curve[i]:.5f}     {reference[i]:.5f}")
    gap = max(abs(a - b) / b for a, b in zip(curve, reference))
    print(f"loss {curve[0]:.4f} -> {curve[-1]:.4f}; largest relative gap to SDPA {gap:.2%}")
    if explanation.graph_break_count or not (curve[-1] < 0.8 * curve[0] and gap < 0.05):
        sys.exit("graph breaks, or the compiled block did not train like the SDPA one")


if __name__ == "__main__":
    main()
