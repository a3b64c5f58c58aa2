"""Dropout against FlashAttention-2 (torch SDPA's flash backend), one process, the same inputs.

    PYTHONPATH=$PWD python3 benchmarks/dropout_fa2.py

fp16, B 4, H 16, N 4096, D 128, ``dropout_p=0.1``, causal and not. Queued TFLOP/s (20 calls between two
CUDA events after one warm-up). torch's backward is timed as forward + backward (autograd) minus the
forward, ours as ``flash_attention_backward`` alone. The keep sets differ (each library's own
generator); the work is the same. ``benchmarks/variants.py --sweep mods`` measures dropout against
our own plain call.
"""

import cupy
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupyflash

B, H, N, D, P = 4, 16, 4096, 128, 0.1


def seconds(f, n=20) -> float:
    f()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        f()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / n / 1e3


def main() -> None:
    for causal in (False, True):
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, requires_grad=True)
                   for _ in range(3))
        flops = 4 * B * H * N * N * D / (2 if causal else 1)

        def fa2():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=causal)

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fa_fwd = seconds(fa2)
            do = torch.randn_like(fa2())
            fa_bwd = seconds(lambda: torch.autograd.grad(fa2(), (q, k, v), do)) - fa_fwd
        cq, ck, cv, cdo = (cupy.from_dlpack(x.detach()) for x in (q, k, v, do))
        kw = dict(causal=causal, dropout_p=P, seed=1)
        ours_fwd = seconds(lambda: cupyflash.flash_attention_forward(cq, ck, cv, **kw))
        out = cupyflash.flash_attention_forward(cq, ck, cv, **kw)
        ours_bwd = seconds(lambda: cupyflash.flash_attention_backward(cdo, cq, ck, cv, *out, **kw))
        print(f"causal={causal} fwd: cupyflash {flops / ours_fwd / 1e12:.1f} FA2 {flops / fa_fwd / 1e12:.1f} TFLOP/s, "
              f"ratio {fa_fwd / ours_fwd:.2f}; bwd: cupyflash {2.5 * flops / ours_bwd / 1e12:.1f} "
              f"FA2 {2.5 * flops / fa_bwd / 1e12:.1f}, ratio {fa_bwd / ours_bwd:.2f}")


if __name__ == "__main__":
    main()
