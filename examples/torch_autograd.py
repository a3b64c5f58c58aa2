"""cupyflash as a PyTorch autograd function: tensors in and out through DLPack, no copies.

    python examples/torch_autograd.py        # needs PyTorch with CUDA, CuPy and a GPU

PyTorch stays outside cupyflash: this file is the whole bridge. Each call runs on PyTorch's current
stream (``cupy.cuda.Stream.from_external``), so the kernels queue in order with PyTorch's own
work and nothing synchronises. The check at the end compares values and gradients with
``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import cupy
import torch

import cupyflash


def as_cupy(t: torch.Tensor) -> cupy.ndarray:
    """A CuPy view of ``t`` (same memory)."""
    return cupy.from_dlpack(t.detach())


class FlashAttention(torch.autograd.Function):
    """``o = softmax(scale q kᵀ) v`` with cupyflash's forward and backward; q, k, v of shape (..., N, D)."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, softmax_scale=None):
        with cupy.cuda.Stream.from_external(torch.cuda.current_stream(q.device)):
            o, m, l = cupyflash.flash_attention_forward(as_cupy(q), as_cupy(k), as_cupy(v), causal=causal,
                                                        softmax_scale=softmax_scale)
        o, m, l = (torch.from_dlpack(x) for x in (o, m, l))
        ctx.save_for_backward(q, k, v, o, m, l)
        ctx.causal, ctx.softmax_scale = causal, softmax_scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, m, l = ctx.saved_tensors
        with cupy.cuda.Stream.from_external(torch.cuda.current_stream(q.device)):
            arrays = (as_cupy(x) for x in (do.contiguous(), q, k, v, o, m, l))
            grads = cupyflash.flash_attention_backward(*arrays, causal=ctx.causal, softmax_scale=ctx.softmax_scale)
        return (*(torch.from_dlpack(g) for g in grads), None, None)


def flash_attention(q, k, v, causal=False, softmax_scale=None):
    return FlashAttention.apply(q, k, v, causal, softmax_scale)


def main() -> int:
    torch.manual_seed(0)
    worst = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for causal in (False, True):
            q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
            do = torch.randn(2, 4, 300, 64, device="cuda", dtype=dtype)
            ours = flash_attention(q, k, v, causal)
            ours_grads = torch.autograd.grad(ours, (q, k, v), do)
            ref = torch.nn.functional.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), is_causal=causal)
            ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
            for name, got, want in zip(("o", "dq", "dk", "dv"), (ours, *ours_grads), (ref, *ref_grads)):
                err = float((got.double() - want.double()).norm() / want.double().norm())
                worst[dtype] = max(worst.get(dtype, 0.0), err)
                print(f"{str(dtype):15s} causal={causal!s:5s} {name}: relative error {err:.1e}")
    limits = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}
    ok = all(worst[d] <= limits[d] for d in worst)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
