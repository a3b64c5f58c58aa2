"""A training step in plain JAX: jax.nn.dot_product_attention (cuDNN) against cupyflash.jax.

    python3 benchmarks/train_step_jax.py                 # on a CUDA GPU: cuDNN against cupyflash, ~1 minute
    python3 benchmarks/train_step_jax.py --platform cpu --batch 2 --seq 64 --steps 4   # a smoke run on the CPU

The model is a byte-level transformer: 4 pre-LayerNorm blocks of d_model 256 with 4 heads of 64
(causal self-attention, then an MLP of 1024 with GELU), learned positions, sequences of 512 bytes,
batches of 16, next-byte cross-entropy, Adam (lr 1e-3, betas 0.9/0.95), parameters in float32 and
the matmuls and attention in bfloat16. The bytes are this repository's own documents and sources
(docs/, kernels_cu/, cupyflash/), so no data set is downloaded; batches are drawn with a fixed seed.

Each arm starts from the same parameters and sees the same batches; its step is one ``jax.jit``
function (forward, gradients, Adam) and differs only in the attention call. Printed: the median wall
time of a step (each step waited for), the ratio of the two, and how far apart the two loss curves
are (they part by bfloat16 rounding, not by method: both are exact attention).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy

REPO_ROOT = Path(__file__).resolve().parents[1]
if (REPO_ROOT / "cupyflash" / "__init__.py").is_file():   # run from a checkout
    sys.path.insert(0, str(REPO_ROOT))

VOCAB = 256              # bytes
CORPUS_DIRS = ("docs", "kernels_cu", "cupyflash")
ADAM = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8)
INIT_STD = 0.02


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4, help="heads of d_model / heads each (default 4 of 64)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100, help="steps per arm (default 100)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing (default 5)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="of the matmuls and attention (default bfloat16; cuDNN takes 16-bit only)")
    parser.add_argument("--baseline", default=None, choices=("cudnn", "xla"),
                        help="jax.nn.dot_product_attention's implementation (default cudnn on a GPU, xla on the CPU)")
    parser.add_argument("--platform", default=None, choices=("cuda", "cpu"), help="JAX's platform (default JAX's)")
    return parser.parse_args(argv)


def corpus() -> numpy.ndarray:
    """The bytes of the repository's documents and sources, in a fixed order."""
    files = sorted(p for d in CORPUS_DIRS for p in (REPO_ROOT / d).rglob("*") if p.is_file() and p.suffix in
                   (".md", ".cu", ".cuh", ".py"))
    return numpy.frombuffer(b"".join(p.read_bytes() for p in files), numpy.uint8)


def batches(data: numpy.ndarray, steps: int, batch: int, seq: int, seed: int = 0):
    """``steps`` batches of ``seq + 1`` consecutive bytes from random offsets (fixed seed)."""
    rng = numpy.random.default_rng(seed)
    starts = rng.integers(0, len(data) - seq - 1, size=(steps, batch))
    return [numpy.stack([data[s:s + seq + 1] for s in row]).astype(numpy.int32) for row in starts]


def build(args):
    """``(init, make_step)``: the parameters' initialiser and a step maker taking an attention function
    ``attend(q, k, v)`` over (B, T, H, D) arrays."""
    import jax
    import jax.numpy as jnp

    D = args.d_model // args.heads
    compute = jnp.dtype(args.dtype)

    def init(key):
        keys = iter(jax.random.split(key, 4 + 4 * args.layers))
        normal = (lambda shape, std=INIT_STD: std * jax.random.normal(next(keys), shape, jnp.float32))
        layer = (lambda: dict(ln1=(jnp.ones(args.d_model), jnp.zeros(args.d_model)),
                              qkv=normal((args.d_model, 3 * args.d_model)),
                              out=normal((args.d_model, args.d_model), INIT_STD / (2 * args.layers) ** 0.5),
                              ln2=(jnp.ones(args.d_model), jnp.zeros(args.d_model)),
                              up=normal((args.d_model, 4 * args.d_model)), up_b=jnp.zeros(4 * args.d_model),
                              down=normal((4 * args.d_model, args.d_model), INIT_STD / (2 * args.layers) ** 0.5),
                              down_b=jnp.zeros(args.d_model)))
        return dict(embed=normal((VOCAB, args.d_model)), pos=normal((args.seq, args.d_model), INIT_STD / 2),
                    layers=[layer() for _ in range(args.layers)],
                    ln_f=(jnp.ones(args.d_model), jnp.zeros(args.d_model)), head=normal((args.d_model, VOCAB)))

    def layer_norm(x, scale_bias):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale_bias[0] + scale_bias[1]

    def matmul(x, w):
        return jnp.dot(x.astype(compute), w.astype(compute), preferred_element_type=jnp.float32)

    def loss_fn(params, tokens, attend):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        B, T = inputs.shape
        x = params["embed"][inputs] + params["pos"][:T]
        for p in params["layers"]:
            qkv = matmul(layer_norm(x, p["ln1"]), p["qkv"]).astype(compute).reshape(B, T, 3, args.heads, D)
            o = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
            x = x + matmul(o.reshape(B, T, args.d_model), p["out"])
            h = jax.nn.gelu(matmul(layer_norm(x, p["ln2"]), p["up"]) + p["up_b"])
            x = x + matmul(h, p["down"]) + p["down_b"]
        logits = matmul(layer_norm(x, params["ln_f"]), params["head"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    def make_step(attend):
        def step(params, moments, t, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens, attend)
            t = t + 1
            m = jax.tree.map(lambda m, g: ADAM["b1"] * m + (1 - ADAM["b1"]) * g, moments[0], grads)
            v = jax.tree.map(lambda v, g: ADAM["b2"] * v + (1 - ADAM["b2"]) * g * g, moments[1], grads)
            lr = ADAM["lr"] * jnp.sqrt(1 - ADAM["b2"] ** t) / (1 - ADAM["b1"] ** t)
            params = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + ADAM["eps"]), params, m, v)
            return params, (m, v), t, loss
        return jax.jit(step, donate_argnums=(0, 1))

    return init, make_step


def run_arm(name, make_step, attend, params, data, warmup):
    """The losses and the wall time of each step of one arm (each step waited for)."""
    import jax
    import jax.numpy as jnp

    step = make_step(attend)
    params = jax.tree.map(jnp.copy, params)   # the step donates its parameters
    moments = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params))
    t, losses, times = jnp.zeros((), jnp.float32), [], []
    start = time.perf_counter()
    for i, tokens in enumerate(data):
        begin = time.perf_counter()
        params, moments, t, loss = step(params, moments, t, tokens)
        losses.append(float(loss))   # waits for the step
        times.append(time.perf_counter() - begin)
        if i + 1 == warmup:
            print(f"  {name}: first {warmup} steps (compile included) {time.perf_counter() - start:.1f} s", flush=True)
    return numpy.array(losses), numpy.array(times[warmup:])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.platform is not None:
        os.environ["JAX_PLATFORMS"] = args.platform
    import jax

    import cupyflash.jax as cfj

    device = jax.devices()[0]
    baseline = args.baseline or ("cudnn" if device.platform == "gpu" else "xla")
    print(f"device: {device.device_kind} ({device.platform}); JAX {jax.__version__}; {args.layers} layers, "
          f"d_model {args.d_model}, {args.heads} heads of {args.d_model // args.heads}, seq {args.seq}, "
          f"batch {args.batch}, {args.dtype}; {args.steps} steps per arm", flush=True)
    init, make_step = build(args)
    params = init(jax.random.PRNGKey(0))
    data = [jax.device_put(b) for b in batches(corpus(), args.steps, args.batch, args.seq)]

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=baseline)

    def ours(q, k, v):   # cupyflash takes (..., N, D): heads before the sequence
        o = cfj.flash_attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), causal=True)
        return o.transpose(0, 2, 1, 3)

    results = {}
    for name, attend in ((f"jax.nn ({baseline})", theirs), ("cupyflash.jax", ours)):
        results[name] = run_arm(name, make_step, attend, params, data, min(args.warmup, args.steps - 1))
    (name_a, (loss_a, time_a)), (name_b, (loss_b, time_b)) = results.items()
    for name, (losses, times) in results.items():
        print(f"{name:24s} median step {numpy.median(times) * 1e3:8.2f} ms   loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    ratio = numpy.median(time_b) / numpy.median(time_a)
    gap = numpy.abs(loss_a - loss_b)
    print(f"step time {name_b} / {name_a}: {ratio:.2f}")
    print(f"loss curves: largest |difference| {gap.max():.2e} (step {int(gap.argmax())}), "
          f"last {gap[-1]:.2e}, relative to the last loss {gap[-1] / abs(loss_a[-1]):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
