// mask.cuh — the mask geometry: the one place that decides which (query, key) pairs are visible.
//
// Every kernel asks a Mask which tiles a tile must visit, which tiles need a per-element mask and
// which pairs are visible; no kernel writes a visibility expression of its own. Today it knows
// ragged ends (keys j >= Nk) and the causal mask, bottom-right aligned: query i sees key j iff
// j <= i + (Nk - Nq), the lower triangle when Nq == Nk. A window, a block mask or variable
// lengths are changes to this struct and to its NumPy mirror (cupyflash/_mask.py).
//
// Rows are query indices 0 <= i < Nq, keys 0 <= j; a query tile is rows [q0, q0 + rows), a key
// tile keys [k0, k0 + cols).

#pragma once

#include "types.cuh"

struct Mask {
    int Nq, Nk;
    int causal;

    // causal: query i sees the keys j <= i + offset()
    __device__ __forceinline__ int offset() const { return Nk - Nq; }

    // the keys query row i sees: [0, key_stop(i))
    __device__ __forceinline__ int key_stop(int i) const { return causal ? max(0, min(i + offset() + 1, Nk)) : Nk; }

    // per element: query i sees key j (a tile of query rows can hoist key_stop per row)
    __device__ __forceinline__ bool visible(int i, int j) const { return j < key_stop(i); }

    // one past the last key that a row of [q0, q1) sees (rows past Nq count as row Nq - 1); 0: none
    __device__ __forceinline__ int kv_stop(int q0, int q1) const {
        if (!causal) return Nk;
        return max(0, min(min(q1, Nq) + offset(), Nk));
    }

    // the first query row that sees key k0; Nq or more: none does
    __device__ __forceinline__ int q_start(int k0) const { return causal ? max(0, k0 - offset()) : 0; }

    // The K/V tiles of B_C keys that the rows [q0, q0 + rows) visit: 0 .. kv_tiles - 1. At least
    // one: a row that sees no key still writes o = 0, m = -inf, l = 0 (its tile masks every key).
    template <int B_C>
    __device__ __forceinline__ int kv_tiles(int q0, int rows) const {
        return max(1, (kv_stop(q0, q0 + rows) + B_C - 1) / B_C);
    }

    // The Q tiles of B_R rows that see the K/V tile of first key k0: q_tile_first .. T_r - 1
    template <int B_R>
    __device__ __forceinline__ int q_tile_first(int k0) const { return q_start(k0) / B_R; }

    // Every pair of rows [q0, ...) x keys [k0, k0 + cols) is visible, so the tile needs no
    // per-element mask (else some pair may be masked: visible() decides each)
    __device__ __forceinline__ bool full(int q0, int k0, int cols) const {
        return k0 + cols <= Nk && (!causal || k0 + cols - 1 <= q0 + offset());
    }

    // The tile of rows [q0, ...) x keys [k0, k0 + cols) has a masked pair that is not past a ragged
    // end (ragged rows and keys load as zeros): a key of the tile after the last one row q0 sees.
    // Only such tiles can turn an inf or NaN operand into a NaN of a masked pair (nonfinite.cuh).
    __device__ __forceinline__ bool has_masked_pairs(int q0, int k0, int cols) const {
        return causal && min(k0 + cols, Nk) - 1 > q0 + offset();
    }
};

// Invisible pairs of a warp's (16, 8*NT) score tile -> -inf: first row r0, first key kv0, rows g and
// g + 8 of each lane (mma_sm80.cuh); nothing to do where the tile is `full`.
template <int NT>
__device__ __forceinline__ void mask_scores(acc_t (&S)[NT][4], const Mask& mask, int r0, int kv0) {
    if (mask.full(r0, kv0, 8 * NT)) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!mask.visible(r0 + g + (e / 2) * 8, kv0 + n * 8 + 2 * t + e % 2)) S[n][e] = NEG_INF;
}
