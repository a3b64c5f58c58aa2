"""A training step with cupyflash's attention against the same step with torch SDPA's.

    python benchmarks/train_step.py              # the client's model: B 16, H 4, N 512, D 64 (about 30 s)
    python benchmarks/train_step.py --large      # B 8, H 16, N 2048, D 128
    python benchmarks/train_step.py --help       # works without a GPU

A byte-level transformer (4 pre-LN layers, d_model = H·D, causal self-attention, an MLP of 4·d_model,
AdamW) is trained twice from the same weights on the same random byte batches: once with
``torch.nn.functional.scaled_dot_product_attention``, once with ``cupyflash.torch.flash_attention``
(``layout="bnhd"``, reading the projection's output in place). Everything runs under bfloat16
autocast, so attention sees bfloat16 q, k, v. Reported: each arm's step time (median of CUDA-event
times per step, after warm-up steps that also compile the kernels), their ratio, and how far the two
loss curves drift apart (cupyflash's backward adds with float atomics, as torch's does: the curves
agree to rounding, not bitwise).

Then one attention call's forward and backward at (16, 4, 512, 64), bfloat16, causal, queued back
to back: through ``cupyflash.torch``, through the DLPack glue of the old ``examples/torch_autograd.py``
(``cupy.from_dlpack``/``torch.from_dlpack``, a ``Stream.from_external`` per call), cupyflash called
directly on CuPy arrays, and torch SDPA through autograd. "host" is the Python loop's time per call
(the time to queue it), "GPU" the CUDA-event time per call; the larger of the two bounds a model's
throughput.

Prints Markdown tables. The JAX twin is ``benchmarks/train_step_jax.py`` (``cupyflash.jax`` against
``jax.nn.dot_product_attention``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if (REPO_ROOT / "cupyflash" / "__init__.py").is_file():   # run from a checkout
    sys.path.insert(0, str(REPO_ROOT))

VOCAB = 256   # bytes


@dataclass(frozen=True)
class Config:
    batch: int
    heads: int
    seq: int
    head_dim: int
    layers: int = 4

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim


SMALL = Config(batch=16, heads=4, seq=512, head_dim=64)     # the client's model
LARGE = Config(batch=8, heads=16, seq=2048, head_dim=128)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--large", action="store_true", help="B 8, H 16, N 2048, D 128 instead of B 16, H 4, N 512, D 64")
    parser.add_argument("--steps", type=int, default=40, help="timed training steps per arm (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first, which compile (default 5)")
    parser.add_argument("--calls", type=int, default=200, help="calls per figure of the per-call table (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# The model, its training and one call

def torch_model(cfg: Config, attend):
    """The byte-level transformer, its attention ``attend(q, k, v)`` on (B, N, H, D) tensors."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
            self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
            self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
            self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                     nn.Linear(4 * cfg.d_model, cfg.d_model))

        def forward(self, x):                                               # (B, N, d_model)
            B, N, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, cfg.heads, cfg.head_dim).unbind(2)   # (B, N, H, D)
            x = x + self.proj(attend(q, k, v).reshape(B, N, cfg.d_model))
            return x + self.mlp(self.ln2(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, cfg.d_model)
            self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.d_model))
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.ln = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return Model()


def torch_attentions():
    """The two attentions the arms compare, on (B, N, H, D) tensors, returning (B, N, H, D)."""
    import torch.nn.functional as F

    from cupyflash.torch import flash_attention

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    def cupyflash(q, k, v):
        return flash_attention(q, k, v, causal=True, layout="bnhd")

    return {"torch SDPA": sdpa, "cupyflash.torch": cupyflash}


def torch_train(cfg: Config, args, attend, state, batches):
    """Train a model from ``state`` on ``batches``: (step times in ms, losses)."""
    import torch
    import torch.nn.functional as F

    model = torch_model(cfg, attend).cuda()
    model.load_state_dict(state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    events = []
    losses = []
    for step, tokens in enumerate(batches):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stop.record()
        losses.append(loss.detach())
        if step >= args.warmup:
            events.append((start, stop))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in events], torch.stack(losses).cpu().tolist()


def torch_per_call(args):
    """Per-call rows: (name, host us, GPU us) of one causal bfloat16 forward and backward at (16, 4, 512, 64)."""
    import cupy
    import torch
    import torch.nn.functional as F

    import cupyflash
    from cupyflash.torch import flash_attention

    shape = (16, 4, 512, 64)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def through(attention):
        def call():
            torch.autograd.grad(attention(*leaves), leaves, do)
        return call

    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))

    def direct():
        with stream:
            o, m, l = cupyflash.flash_attention_forward(cq, ck, cv, causal=True)
            cupyflash.flash_attention_backward(cdo, cq, ck, cv, o, m, l, causal=True)

    calls = {
        "cupyflash.torch": through(lambda q, k, v: flash_attention(q, k, v, causal=True)),
        "DLPack glue (the old example)": through(lambda q, k, v: _DLPackGlue.apply(q, k, v)),
        "cupyflash on CuPy arrays": direct,
        "torch SDPA": through(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }
    from torch_profile import per_call   # benchmarks/torch_profile.py, beside this script

    return [(name, *per_call(call, args.calls)) for name, call in calls.items()]


def _dlpack_glue():
    """The autograd Function of the old examples/torch_autograd.py: DLPack both ways, a stream per call."""
    import cupy
    import torch

    import cupyflash

    class Glue(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            with cupy.cuda.Stream.from_external(torch.cuda.current_stream(q.device)):
                o, m, l = cupyflash.flash_attention_forward(*(cupy.from_dlpack(x.detach()) for x in (q, k, v)),
                                                            causal=True)
            o, m, l = (torch.from_dlpack(x) for x in (o, m, l))
            ctx.save_for_backward(q, k, v, o, m, l)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, m, l = ctx.saved_tensors
            with cupy.cuda.Stream.from_external(torch.cuda.current_stream(q.device)):
                arrays = [cupy.from_dlpack(x.detach()) for x in (do.contiguous(), q, k, v, o, m, l)]
                grads = cupyflash.flash_attention_backward(*arrays, causal=True)
            return tuple(torch.from_dlpack(g) for g in grads)

    return Glue


class _LazyGlue:
    """``_DLPackGlue.apply``, the Function made at first use (so --help imports neither torch nor CuPy)."""

    _glue = None

    def apply(self, *args):
        if self._glue is None:
            type(self)._glue = _dlpack_glue()
        return self._glue.apply(*args)


_DLPackGlue = _LazyGlue()


def run(cfg: Config, args) -> None:
    import cupy
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("torch.cuda is not available: this benchmark needs a CUDA GPU")
    torch.manual_seed(args.seed)
    state = copy.deepcopy(torch_model(cfg, None).cuda().state_dict())
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    batches = [torch.randint(0, VOCAB, (cfg.batch, cfg.seq + 1), device="cuda", generator=gen)
               for _ in range(args.warmup + args.steps)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CuPy {cupy.__version__}; "
          f"B {cfg.batch}, H {cfg.heads}, N {cfg.seq}, D {cfg.head_dim}, {cfg.layers} layers, bfloat16 autocast, "
          f"{args.steps} timed steps after {args.warmup}\n")
    results = {}
    for name, attend in torch_attentions().items():
        begin = time.perf_counter()
        times, losses = torch_train(cfg, args, attend, state, batches)
        results[name] = (times, losses, (time.perf_counter() - begin) * 1e3 / len(batches))
    (t_ref, l_ref, wall_ref), (t_ours, l_ours, wall_ours) = results.values()
    print("| attention | step, ms (median) | step, ms (wall, all steps) | first loss | last loss |")
    print("|---|---:|---:|---:|---:|")
    for name, (times, losses, wall) in results.items():
        print(f"| {name} | {statistics.median(times):.2f} | {wall:.2f} | {losses[0]:.4f} | {losses[-1]:.4f} |")
    ratio = statistics.median(t_ours) / statistics.median(t_ref)
    drift = max(abs(a - b) for a, b in zip(l_ours, l_ref))
    print(f"\ncupyflash.torch / torch SDPA step time: {ratio:.3f}; largest difference of the loss curves: "
          f"{drift:.2e} (over {len(l_ref)} steps)\n")
    print("One call, forward and backward, (16, 4, 512, 64), bfloat16, causal, back to back:\n")
    print("| call | host, us per call | GPU, us per call |")
    print("|---|---:|---:|")
    for name, host, gpu in torch_per_call(args):
        print(f"| {name} | {host:.1f} | {gpu:.1f} |")


def main(argv=None) -> None:
    args = parse_args(argv)
    run(LARGE if args.large else SMALL, args)


if __name__ == "__main__":
    main()
