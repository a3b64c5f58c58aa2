"""cupyflash in a PyTorch model: ``cupyflash.torch.flash_attention``, checked against torch SDPA.

    python examples/torch_autograd.py        # needs PyTorch with CUDA, CuPy and a GPU

``cupyflash.torch.flash_attention`` is an autograd function on torch tensors: the kernels read and
write the tensors' own memory (no DLPack, no copies), its outputs come from torch's allocator, and both
passes run on torch's current stream without synchronising. It takes torch SDPA's (B, H, N, D) layout
or, with ``layout="bnhd"``, FlashAttention's (B, N, H, D), and GQA (fewer K/V heads). The check compares
values and gradients with ``torch.nn.functional.scaled_dot_product_attention`` in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cupyflash.torch import flash_attention


class SelfAttention(torch.nn.Module):
    """Multi-head self-attention with grouped K/V heads, its attention by cupyflash."""

    def __init__(self, d_model: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.qkv = torch.nn.Linear(d_model, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = torch.nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):                                            # x (B, N, d_model)
        B, N, _ = x.shape
        qkv = self.qkv(x).view(B, N, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)   # (B, N, H, D) views
        o = flash_attention(q, k, v, causal=True, layout="bnhd")      # (B, N, H, D), read and written in place
        return self.out(o.reshape(B, N, -1))


def relative_errors(dtype, causal, layout, kv_heads):
    """Relative errors of o, dq, dk, dv against SDPA in float64."""
    shape = lambda h: (2, h, 300, 64) if layout == "bhnd" else (2, 300, h, 64)
    q = torch.randn(shape(4), device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(shape(kv_heads), device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    do = torch.randn(shape(4), device="cuda", dtype=dtype)
    ours = flash_attention(q, k, v, causal=causal, layout=layout)
    ours_grads = torch.autograd.grad(ours, (q, k, v), do)
    to_bhnd = (lambda x: x) if layout == "bhnd" else (lambda x: x.transpose(1, 2))
    ref = F.scaled_dot_product_attention(*(to_bhnd(x).double() for x in (q, k, v)), is_causal=causal,
                                         enable_gqa=kv_heads != 4)
    ref_grads = torch.autograd.grad(ref, (q, k, v), to_bhnd(do).double())
    got = (to_bhnd(ours).detach(), *ours_grads)
    want = (ref.detach(), *ref_grads)
    return {name: float((g.double() - w).norm() / w.norm()) for name, g, w in zip(("o", "dq", "dk", "dv"), got, want)}


def main() -> int:
    torch.manual_seed(0)
    limits = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}
    ok = True
    for dtype, limit in limits.items():
        for causal in (False, True):
            for layout, kv_heads in (("bhnd", 4), ("bnhd", 2)):
                errors = relative_errors(dtype, causal, layout, kv_heads)
                ok &= max(errors.values()) <= limit
                print(f"{str(dtype):15s} causal={causal!s:5s} {layout} H_kv={kv_heads}: "
                      + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    # a training step of a small model, its attention in bfloat16 under autocast
    model = SelfAttention(256, heads=4, kv_heads=2).cuda()
    x = torch.randn(8, 512, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    loss.backward()
    finite = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    print(f"model step: loss {loss.item():.4f}, gradients finite: {finite}")
    ok &= finite
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
