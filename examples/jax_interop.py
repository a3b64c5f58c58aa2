"""cupyflash inside a jitted JAX function and under jax.grad, through XLA's FFI.

    python examples/jax_interop.py           # JAX with CUDA, CuPy and a GPU: the CUDA kernels
                                             # JAX on the CPU: the same calls run cupyflash's NumPy path

``cupyflash.jax.flash_attention`` is a ``jax.custom_vjp`` function whose forward and backward are each
one XLA custom call: XLA hands cupyflash its stream and buffers, the kernels write straight into XLA's
outputs, and nothing synchronises. The check compares the loss and its gradients with attention written
in jax.numpy at full float32 matmul precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import cupyflash.jax as cfj

HIGHEST = jax.lax.Precision.HIGHEST   # JAX's default float32 matmul on a GPU rounds inputs to TF32
TOLERANCE = 1e-4                      # relative error of o and of each gradient, in float32


def attention_jnp(q, k, v, causal):
    s = jnp.einsum("...qd,...kd->...qk", q, k, precision=HIGHEST) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    if causal:
        n_q, n_k = s.shape[-2:]
        s = jnp.where(jnp.arange(n_k)[None, :] <= jnp.arange(n_q)[:, None] + (n_k - n_q), s, -jnp.inf)
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(s, axis=-1), v, precision=HIGHEST)


def loss_of(attention):
    """A toy loss of one attention layer: its output against a target, with gradients by q, k, v."""
    def loss(q, k, v, target):
        return jnp.mean((attention(q, k, v) - target) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def relative_error(x, ref) -> float:
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def main() -> int:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, target = (jax.random.normal(key, (2, 4, 300, 64), jnp.float32) for key in keys)
    worst = 0.0
    for causal in (False, True):
        ours = loss_of(lambda q, k, v: cfj.flash_attention(q, k, v, causal=causal))(q, k, v, target)
        ref = loss_of(lambda q, k, v: attention_jnp(q, k, v, causal))(q, k, v, target)
        errors = [relative_error(ours[0], ref[0])] + [relative_error(g, r) for g, r in zip(ours[1], ref[1])]
        worst = max(worst, *errors)
        print(f"causal={causal!s:5s} relative error: loss {errors[0]:.1e}, dq {errors[1]:.1e}, "
              f"dk {errors[2]:.1e}, dv {errors[3]:.1e}")
    print("OK" if worst <= TOLERANCE else "FAILED")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    raise SystemExit(main())
