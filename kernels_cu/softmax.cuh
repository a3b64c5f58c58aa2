// softmax.cuh — the online softmax of Algorithm 1 (lines 9-11) on accumulator fragments, and the
// row reductions it needs.

#pragma once

#include "mask.cuh"
#include "score_mod.cuh"
#include "types.cuh"

// The larger of a and b, NaN if either is (fmax drops a NaN): a NaN score makes its row's m NaN,
// as it makes l and O.
__device__ __forceinline__ float nan_max(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ double nan_max(double a, double b) { return a > b || a != a ? a : b; }

// Reductions over one accumulator row: the four lanes of a quad share a row.
__device__ __forceinline__ acc_t quad_max(acc_t x) {
    x = nan_max(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return nan_max(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ acc_t quad_sum(acc_t x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// S_ij = scale Q_i K_j^T, rounded once as a naive attention rounds it
template <int NT>
__device__ __forceinline__ void scale_scores(acc_t (&S)[NT][4], acc_t scale) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[n][e] *= scale;
}

// ... then its modifiers (score_mod.cuh), then invisible pairs -> -inf: the final scores of a warp's
// tile, first row r0, first key kv0
template <int NT>
__device__ __forceinline__ void final_scores(acc_t (&S)[NT][4], acc_t scale, const EntryMods& mods, const Mask& mask,
                                             int r0, int kv0) {
    scale_scores(S, scale);
    if (SCORE_MODS && mods.modifies()) modify_scores(S, mods, r0, kv0);
    mask_scores(S, mask, r0, kv0);
}

// The online softmax step (Algorithm 1, lines 10-11) on a warp's (16, 8*NT) score tile, in place:
//   m_new = max(m_i, rowmax(S_ij));  S_ij <- P~_ij = exp2((S_ij - m_new) c);  alpha = exp2((m_i - m_new) c)
// and rowsum(P~_ij) per accumulator row (g, g+8). The caller rescales l_i and O_i by alpha.
// Scores in natural units take c = log2 e; raw scores Q K^T take c = scale log2 e (scale > 0).
// The difference is taken first, where it is exact near the max, then scaled into the exponent.
template <int NT>
__device__ __forceinline__ void online_softmax(acc_t (&S)[NT][4], const acc_t (&m_i)[2], acc_t (&m_new)[2],
                                               acc_t (&alpha)[2], acc_t (&rowsum)[2], acc_t c) {
    acc_t m_use[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        acc_t mx = NEG_INF;
#pragma unroll
        for (int n = 0; n < NT; ++n) mx = nan_max(mx, nan_max(S[n][2 * h], S[n][2 * h + 1]));
        m_new[h] = nan_max(m_i[h], quad_max(mx));
        // a row with no visible key so far: exponentiate against 0, not -inf (-inf - -inf = NaN)
        m_use[h] = m_new[h] == NEG_INF ? (acc_t)0 : m_new[h];
        alpha[h] = exp2_acc((m_i[h] - m_use[h]) * c);
        rowsum[h] = (acc_t)0;
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            S[n][e] = exp2_acc((S[n][e] - m_use[e / 2]) * c);
            rowsum[e / 2] += S[n][e];
        }
    rowsum[0] = quad_sum(rowsum[0]);
    rowsum[1] = quad_sum(rowsum[1]);
}

// The attention sink (params.cuh: sink_of) folded into a row's final statistics, in natural units:
// one more key of logit `sink` and value zero, so
//   m <- max(m, sink),  l <- e^(m_old - m) l + e^(sink - m)
// (a row that saw no key, m = -inf and l = 0, gets m = sink, l = 1). Returns what the row's O_i,
// normalised by the old l, is multiplied by: e^(m_old - m) l_old / l (0 where l_old = 0).
__device__ __forceinline__ acc_t fold_sink(acc_t& m, acc_t& l, acc_t sink) {
    const acc_t m_new = nan_max(m, sink);
    if (m_new == NEG_INF) return (acc_t)0;   // no key and a sink of -inf: nothing to fold (-inf - -inf = NaN)
    const acc_t beta = m == NEG_INF ? (acc_t)0 : exp2_acc((m - m_new) * (acc_t)LOG2E);
    const acc_t l_new = beta * l + exp2_acc((sink - m_new) * (acc_t)LOG2E);
    const acc_t keep = l == (acc_t)0 ? (acc_t)0 : beta * l / l_new;
    m = m_new;
    l = l_new;
    return keep;
}
