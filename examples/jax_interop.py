"""JAX arrays through cupyflash and back, through DLPack, no copies.

    python examples/jax_interop.py           # needs JAX with CUDA, CuPy and a GPU

JAX stays outside cupyflash. JAX dispatches asynchronously on streams of its own, so the arrays are
made ready (``block_until_ready``) before CuPy reads them; cupyflash's outputs come back as JAX
arrays through ``jax.dlpack.from_dlpack``. The check compares with attention written in jax.numpy, at full float32 matmul precision.
"""

from __future__ import annotations

import cupy
import jax
import jax.numpy as jnp

import cupyflash

HIGHEST = jax.lax.Precision.HIGHEST   # JAX's default float32 matmul on a GPU rounds inputs to TF32


def attention_jnp(q, k, v, causal):
    s = jnp.einsum("...qd,...kd->...qk", q, k, precision=HIGHEST) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    if causal:
        n_q, n_k = s.shape[-2:]
        s = jnp.where(jnp.arange(n_k)[None, :] <= jnp.arange(n_q)[:, None] + (n_k - n_q), s, -jnp.inf)
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(s, axis=-1), v, precision=HIGHEST)


def main() -> int:
    key = jax.random.PRNGKey(0)
    worst = 0.0
    for causal in (False, True):
        q, k, v = (jax.random.normal(sub, (2, 4, 300, 64), jnp.float32) for sub in jax.random.split(key, 3))
        for x in (q, k, v):
            x.block_until_ready()
        o, m, l = cupyflash.flash_attention_forward(*(cupy.from_dlpack(x) for x in (q, k, v)), causal=causal)
        cupy.cuda.get_current_stream().synchronize()   # JAX reads on its own streams
        o = jax.dlpack.from_dlpack(o)
        ref = attention_jnp(q, k, v, causal)
        err = float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))
        worst = max(worst, err)
        print(f"causal={causal!s:5s} o: relative error {err:.1e}")
    print("OK" if worst <= 1e-4 else "FAILED")
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
