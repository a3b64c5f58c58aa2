// repair.cuh — the exact rows of a flagged tile (nonfinite.cuh says which), one warp per row, one
// visible pair at a time: what flash_repair.cu's kernels run, and the Hopper forward on the tiles it
// flagged itself (flash_fwd_sm90.cu).
//
//   o_i = sum_j exp(S_ij - m_i) v_j / l_i over the visible pairs only, from the forward's own m_i, l_i
//   (the masked scores never reach them: the kernels set those to -inf first)
//
// S_ij = scale q_i . k_j, modified where modifiers apply (score_mod.cuh); the modifiers take whatever
// form the including kernel compiles them in (flash_repair.cu: at run time). A row that saw no key
// (l_i = 0) adds nothing, as in the main kernels. Float8 operands (FP8) are read exactly and P is not
// rounded to float8 here; o takes v's descale.

#pragma once

#include "mask.cuh"
#include "params.cuh"
#include "score_mod.cuh"
#include "types.cuh"

constexpr int RPL = (FLASH_DP + WARP_SIZE - 1) / WARP_SIZE;   // head-dim elements per lane: d = lane + 32 e

// This lane's elements of a row of D values (zero past D)
__device__ __forceinline__ void load_row(acc_t (&x)[RPL], const in_t* row, int D) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int e = 0; e < RPL; ++e) {
        const int d = lane + WARP_SIZE * e;
        x[e] = d < D ? to_acc(row[d]) : (acc_t)0;
    }
}

// scale x into a row of D values of the output dtype or of the accumulator dtype
template <class T>
__device__ __forceinline__ void store_row(T* row, const acc_t (&x)[RPL], acc_t scale, int D) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int e = 0; e < RPL; ++e) {
        const int d = lane + WARP_SIZE * e;
        if (d >= D) continue;
        if constexpr (sizeof(T) == sizeof(acc_t)) row[d] = scale * x[e];
        else row[d] = from_acc(scale * x[e]);
    }
}

// a . b over the warp's lanes
__device__ __forceinline__ acc_t dot(const acc_t (&a)[RPL], const acc_t (&b)[RPL]) {
    acc_t ab = (acc_t)0;
#pragma unroll
    for (int e = 0; e < RPL; ++e) ab += a[e] * b[e];
#pragma unroll
    for (int s = WARP_SIZE / 2; s > 0; s /= 2) ab += __shfl_xor_sync(0xffffffffu, ab, s);
    return ab;
}

// a . b and c . d over the warp's lanes, reduced together
__device__ __forceinline__ void dot2(const acc_t (&a)[RPL], const acc_t (&b)[RPL], const acc_t (&c)[RPL],
                                     const acc_t (&d)[RPL], acc_t& ab, acc_t& cd) {
    ab = cd = (acc_t)0;
#pragma unroll
    for (int e = 0; e < RPL; ++e) {
        ab += a[e] * b[e];
        cd += c[e] * d[e];
    }
#pragma unroll
    for (int s = WARP_SIZE / 2; s > 0; s /= 2) {
        ab += __shfl_xor_sync(0xffffffffu, ab, s);
        cd += __shfl_xor_sync(0xffffffffu, cd, s);
    }
}

// Rows warp, warp + warps, ... of flagged Q tile `tile` (of the flags' (heads, T_r) order, tiles of
// p.tile_rows rows) recomputed into o
__device__ __forceinline__ void repair_forward_tile(const FwdParams& p, i64 tile, int T_r, int warp, int warps) {
    const int D = p.D, tile_rows = p.tile_rows;
    const acc_t call_scale = (acc_t)p.scale;
    const Seq sq = seq_of(p, tile / T_r);
    const acc_t scale = FP8 ? call_scale * (acc_t)p.descales.qk(sq.bi) : call_scale;   // FP8: per entry
    const Mask& mask = mask_of(p, sq);
    const int Nq = mask.Nq;
    const int r0 = (int)(tile % T_r) * tile_rows;
    const in_t* q_h = sq.q_rows(p.q);
    const KeyRows<const in_t> k_h = k_rows_of(p, sq);
    const KeyRows<const in_t> v_h = v_rows_of(p, sq);
    const EntryMods mods = mods_of(p, sq);
    for (int r = r0 + warp; r < min(r0 + tile_rows, Nq); r += warps) {
        const acc_t m_i = p.m[sq.row0 + r], l_i = p.l[sq.row0 + r];
        acc_t q_i[RPL], o_i[RPL] = {};
        if (l_i != (acc_t)0) {
            load_row(q_i, q_h + r * p.q.sn, D);
            for (int j = mask.key_start(r); j < mask.key_stop(r); ++j) {
                if (mods.hidden(r, j)) continue;   // no term (a dropped pair keeps its 0 · v_j)
                acc_t k_j[RPL], v_j[RPL];
                load_row(k_j, k_h.row(j), D);
                load_row(v_j, v_h.row(j), D);
                acc_t unused;
                acc_t pr = exp2_acc((mods.apply(dot(q_i, k_j) * scale, r, j, unused) - m_i) * (acc_t)LOG2E);
                if (mods.drops()) pr *= mods.kept(r, j) ? (acc_t)1 : (acc_t)0;   // Z P (its 1 / (1 - p) below)
#pragma unroll
                for (int e = 0; e < RPL; ++e) o_i[e] += pr * v_j[e];
            }
        }
        store_row(p.o + (sq.row0 + r) * D, o_i,
                  l_i == (acc_t)0 ? (acc_t)0
                                  : (FP8 ? (acc_t)p.v_scale * (acc_t)p.descales.of_v(sq.bi)
                                         : mods.drops() ? mods.keep_scale : (acc_t)1) / l_i, D);
    }
}
