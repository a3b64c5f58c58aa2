"""Decoding with a paged K/V cache, split-KV, and attention over a key set split in two, merged.

    python examples/decoding.py          # CuPy on a GPU; NumPy on the CPU where there is none

Three things a decoder does with cupyflash, each checked against attention over all keys at once
(``cupyflash.reference``, float64):

1. **A decoding loop over a paged cache.** A prompt is written into the cache, then each step appends
   one token's keys and values and attends from that token's query (``flash_attention_with_kvcache``
   with ``k=``, ``v=``): the pages of each sequence are scattered over a shared pool through its row of
   ``block_table``, grouped-query attention reads each K/V head once for its query heads, and the
   caller advances ``cache_seqlens`` after each step. Sequences of different lengths decode together.
2. **Split-KV.** ``num_splits`` cuts each row's keys into parts attended side by side and merged in a
   fixed order: the same result as one part, to rounding, and as fast as the GPU allows at one query
   row per sequence (``None`` picks the count from the problem and the GPU).
3. **Merging parts** (``merge_attention``): the ``(o, m, l)`` of attention over disjoint key sets —
   here a shared prefix and each sequence's own suffix, as a cascade/shared-prefix decoder computes
   them — merge into the attention over their union: ``m = max m_i``, ``l = Σ l_i e^(m_i - m)``,
   ``o = Σ l_i e^(m_i - m) o_i / l``.

Prints each check's largest error and ends with ``OK``.
"""

from __future__ import annotations

import numpy

import cupyflash
from cupyflash import reference

try:
    import cupy

    xp = cupy if cupy.cuda.runtime.getDeviceCount() > 0 else numpy
except Exception:   # noqa: BLE001 - no CuPy, no driver, no GPU: the CPU path
    xp = numpy

B, HQ, HKV, D = 3, 8, 2, 64          # 3 sequences, 8 query heads over 2 K/V heads (GQA), head dim 64
PAGE, PAGES_EACH = 16, 8             # 16 keys a page, room for 128 keys per sequence
DTYPE = numpy.float32
TOL = 2e-5                           # float32 arithmetic on either path, relative to the largest value


def host(x):
    return x.get() if hasattr(x, "get") else numpy.asarray(x)


def largest_error(got, want) -> float:
    got, want = host(got).astype(numpy.float64), numpy.asarray(want, numpy.float64)
    return float(numpy.abs(got - want).max() / max(numpy.abs(want).max(), 1e-30))


def decoding_loop(rng) -> None:
    """Prompts of 20, 37 and 5 tokens, then 12 decoded tokens each; every step against the reference."""
    prompt = [20, 37, 5]
    steps = 12
    total = [n + steps for n in prompt]
    keys = [rng.standard_normal((HKV, n, D)).astype(DTYPE) for n in total]     # each sequence's keys, all steps
    values = [rng.standard_normal((HKV, n, D)).astype(DTYPE) for n in total]
    queries = [rng.standard_normal((HQ, n, D)).astype(DTYPE) for n in total]

    pool = B * PAGES_EACH + 4                                                   # shared pages, a few spare
    k_cache = xp.zeros((pool, HKV, PAGE, D), DTYPE)
    v_cache = xp.zeros((pool, HKV, PAGE, D), DTYPE)
    table = rng.permutation(pool)[:B * PAGES_EACH].reshape(B, PAGES_EACH).astype(numpy.int32)
    block_table = xp.asarray(table)                                             # scattered pages per sequence

    # the prompts: written page by page (a prefill would attend too; here only the cache is filled)
    for b, n in enumerate(prompt):
        for j in range(n):
            page, row = table[b, j // PAGE], j % PAGE
            k_cache[page, :, row] = xp.asarray(keys[b][:, j])
            v_cache[page, :, row] = xp.asarray(values[b][:, j])
    lengths = numpy.array(prompt, numpy.int32)

    worst = 0.0
    for step in range(steps):
        at = lengths.copy()                                                     # each sequence's new position
        q = xp.asarray(numpy.stack([queries[b][:, at[b]:at[b] + 1] for b in range(B)]))     # (B, HQ, 1, D)
        k = xp.asarray(numpy.stack([keys[b][:, at[b]:at[b] + 1] for b in range(B)]))        # (B, HKV, 1, D)
        v = xp.asarray(numpy.stack([values[b][:, at[b]:at[b] + 1] for b in range(B)]))
        o, m, l = cupyflash.flash_attention_with_kvcache(q, k_cache, v_cache, xp.asarray(lengths), k=k, v=v,
                                                         block_table=block_table)
        lengths += 1                                                            # the caller advances the lengths
        for b in range(B):
            n = lengths[b]
            group = HQ // HKV                                                   # query head h reads K/V head h // group
            k_b = numpy.repeat(keys[b][:, :n], group, axis=0)
            v_b = numpy.repeat(values[b][:, :n], group, axis=0)
            o_ref, m_ref, l_ref = reference.attention_forward(queries[b][:, n - 1:n], k_b, v_b, causal=True)
            worst = max(worst, largest_error(o[b], o_ref), largest_error(l[b], l_ref))
    assert worst < TOL, worst
    pages, rows = table[:, numpy.arange(max(total)) // PAGE], numpy.arange(max(total)) % PAGE
    for b in range(B):                                                          # the appends landed in place
        cached = host(k_cache[pages[b, :total[b]], :, rows[:total[b]]])        # (n, HKV, D)
        assert numpy.array_equal(cached.transpose(1, 0, 2), keys[b]), b
    print(f"decoding loop: {steps} steps of {B} sequences (prompts {prompt}), paged cache, GQA {HQ}/{HKV}: "
          f"largest error {worst:.1e}")


def split_kv(rng) -> None:
    """One query row against 4096 keys: 1, 4 and 16 splits give the same result to rounding."""
    q = xp.asarray(rng.standard_normal((2, HQ, 1, D)).astype(DTYPE))
    k = xp.asarray(rng.standard_normal((2, HQ, 4096, D)).astype(DTYPE))
    v = xp.asarray(rng.standard_normal((2, HQ, 4096, D)).astype(DTYPE))
    whole = cupyflash.flash_attention_forward(q, k, v, num_splits=1)
    worst = 0.0
    for splits in (4, 16, None):
        parts = cupyflash.flash_attention_forward(q, k, v, num_splits=splits)
        worst = max(worst, *(largest_error(a, host(b)) for a, b in zip(parts, whole)))
    assert worst < TOL, worst
    print(f"split-KV: 4, 16 and automatic splits against one: largest difference {worst:.1e}")


def merge_of_parts(rng) -> None:
    """A shared prefix of 300 keys and each sequence's own 50: attention over each, merged, equals
    attention over the 350 keys."""
    prefix_k = rng.standard_normal((1, HQ, 300, D)).astype(DTYPE)
    prefix_v = rng.standard_normal((1, HQ, 300, D)).astype(DTYPE)
    own_k = rng.standard_normal((B, HQ, 50, D)).astype(DTYPE)
    own_v = rng.standard_normal((B, HQ, 50, D)).astype(DTYPE)
    q = rng.standard_normal((B, HQ, 4, D)).astype(DTYPE)
    shared = cupyflash.flash_attention_forward(xp.asarray(q), xp.asarray(prefix_k), xp.asarray(prefix_v))
    own = cupyflash.flash_attention_forward(xp.asarray(q), xp.asarray(own_k), xp.asarray(own_v))
    o, m, l = cupyflash.merge_attention([tuple(shared), tuple(own)])
    keys = numpy.concatenate([numpy.broadcast_to(prefix_k, own_k.shape[:2] + prefix_k.shape[2:]), own_k], axis=2)
    values = numpy.concatenate([numpy.broadcast_to(prefix_v, own_v.shape[:2] + prefix_v.shape[2:]), own_v], axis=2)
    o_ref, m_ref, l_ref = reference.attention_forward(q, keys, values)
    worst = max(largest_error(o, o_ref), largest_error(m, m_ref), largest_error(l, l_ref))
    assert worst < TOL, worst
    print(f"merge: shared prefix (300 keys) + own suffixes (50) against all 350 at once: largest error {worst:.1e}")


def main() -> None:
    rng = numpy.random.default_rng(0)
    print(f"on {'the GPU (CuPy)' if xp is not numpy else 'the CPU (NumPy)'}")
    decoding_loop(rng)
    split_kv(rng)
    merge_of_parts(rng)
    print("OK")


if __name__ == "__main__":
    main()
