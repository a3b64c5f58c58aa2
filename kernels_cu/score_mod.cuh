// score_mod.cuh — the score modifiers: what happens to a score between the product and the mask.
//
// The API's order (cupyflash.reference: _Scores), for query i and key j, off = Nk - Nq:
//     s = scale q_i . k_j                        natural units
//     softcap c:   s <- c tanh(s / c)            FLASH_SOFTCAP
//     ALiBi slope: s <- s - slope |i + off - j|  FLASH_ALIBI
// then the mask (mask.cuh). m_i, l_i are the statistics of the modified scores. A modifier is
// compiled in only where a call uses it (TileConfig.mods), so a plain call runs the plain kernel and
// pays nothing. The backward's dS is taken with respect to the modified score; the chain back to
// scale q . k multiplies it by ds'/ds = 1 - tanh^2 (softcap; ALiBi adds a constant).
//
// tanh: 16-bit inputs take the hardware's tanh.approx (relative error 2^-11, what rounding a score
// to float16 costs); float32 and float64 take the accurate tanhf / tanh.

#pragma once

#include "layout.cuh"
#include "types.cuh"

#ifndef FLASH_SOFTCAP
#define FLASH_SOFTCAP 0
#endif
#ifndef FLASH_ALIBI
#define FLASH_ALIBI 0
#endif

constexpr bool SOFTCAP = FLASH_SOFTCAP != 0;
constexpr bool ALIBI = FLASH_ALIBI != 0;
constexpr bool SCORE_MODS = SOFTCAP || ALIBI;

__device__ __forceinline__ acc_t tanh_acc(acc_t x) {
#if FLASH_TENSOR_CORES
    float r;
    asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#elif FLASH_DTYPE == 3
    return tanh(x);
#else
    return tanhf(x);
#endif
}

// One batch entry's modifiers (ScoreMods::at)
struct EntryMods {
    acc_t cap, inv_cap;   // softcap c and 1 / c
    acc_t slope;          // ALiBi slope
    int off;              // Nk - Nq

    // s <- c tanh(s / c); t = tanh(s / c), for softcap_grad (untouched without a softcap)
    __device__ __forceinline__ acc_t cap_score(acc_t s, acc_t& t) const {
        if constexpr (SOFTCAP) {
            t = tanh_acc(s * inv_cap);
            return cap * t;
        }
        return s;
    }

    // s <- s - slope |distance|, distance = i + off - j (either sign)
    __device__ __forceinline__ acc_t alibi(acc_t s, acc_t distance) const {
        if constexpr (ALIBI) return s - slope * fabs(distance);
        return s;
    }

    // the modified score of query i, key j from s = scale q_i . k_j; t as in cap_score
    __device__ __forceinline__ acc_t apply(acc_t s, int i, int j, acc_t& t) const {
        return alibi(cap_score(s, t), (acc_t)(i + off - j));
    }
};

// ds'/ds of the softcap at t = tanh(s / c) (1 without one)
__device__ __forceinline__ acc_t softcap_grad(acc_t t) {
    if constexpr (SOFTCAP) return (acc_t)1 - t * t;
    return (acc_t)1;
}

// What a call's modifiers read (params.cuh: FwdParams::mods, BwdParams::mods)
struct ScoreMods {
    const acc_t* alibi;           // slopes, one per batch entry: collapsed batch strides, 0 along a broadcast dim
    i64 alibi_s0, alibi_s1, alibi_s2;
    double softcap;               // c > 0

    __device__ __forceinline__ EntryMods at(BatchIndex bi, int off) const {
        EntryMods e;
        e.cap = (acc_t)softcap;
        e.inv_cap = SOFTCAP ? (acc_t)1 / e.cap : (acc_t)0;
        e.slope = ALIBI ? alibi[batch_offset(bi, alibi_s0, alibi_s1, alibi_s2)] : (acc_t)0;
        e.off = off;
        return e;
    }
};

// The modifiers on a warp's (16, 8*NT) accumulator tile of scores in natural units (mma_sm80.cuh and
// wgmma fragments alike): rows r0 + g, r0 + g + 8, columns c0 + 8n + 2t + {0, 1}. Rows are queries
// and columns keys, or, TRANSPOSED (the backward's S^T), rows keys and columns queries. Without
// DERIV, T is not written; with it T holds tanh(s / c) of each element, for softcap_grad.
template <bool TRANSPOSED, bool DERIV = false, int NT>
__device__ __forceinline__ void modify_scores(acc_t (&S)[NT][4], acc_t (&T)[DERIV ? NT : 1][4], const EntryMods& mods,
                                              int r0, int c0) {
    const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    // |i + off - j| of element (n, e): |base[e / 2] - (8n + e % 2)|, for either orientation
    acc_t base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + g + 8 * h, col = c0 + 2 * t;
        base[h] = (acc_t)(TRANSPOSED ? row - mods.off - col : row + mods.off - col);
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc_t th;
            const acc_t s = mods.cap_score(S[n][e], th);
            if constexpr (DERIV) T[n][e] = th;
            S[n][e] = mods.alibi(s, base[e / 2] - (acc_t)(8 * n + e % 2));
        }
}

// ... the forward's form: no derivative
template <int NT>
__device__ __forceinline__ void modify_scores(acc_t (&S)[NT][4], const EntryMods& mods, int r0, int c0) {
    acc_t unused[1][4];
    modify_scores<false, false>(S, unused, mods, r0, c0);
}
