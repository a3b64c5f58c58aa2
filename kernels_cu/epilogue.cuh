// epilogue.cuh — accumulator fragments out of registers: into shared memory, the forward's output
// rows (O_i normalised, m_i, l_i) and the backward's dK_j, dV_j rows into HBM.

#pragma once

#include "layout.cuh"
#include "params.cuh"
#include "softmax.cuh"
#include "types.cuh"

// Write a warp's (16, 8*NT) accumulator tile into shared memory as elem_t
// (row pitch ld), e.g. P_ij before it multiplies V_j.
template <int NT>
__device__ __forceinline__ void store_frag_smem(elem_t* __restrict__ s, int ld, const acc_t (&c)[NT][4]) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int col = n * 8 + 2 * t;
#if FLASH_TENSOR_CORES
        *reinterpret_cast<unsigned*>(s + g * ld + col) = pack2(c[n][0], c[n][1]);
        *reinterpret_cast<unsigned*>(s + (g + 8) * ld + col) = pack2(c[n][2], c[n][3]);
#else
        s[g * ld + col] = c[n][0];
        s[g * ld + col + 1] = c[n][1];
        s[(g + 8) * ld + col] = c[n][2];
        s[(g + 8) * ld + col + 1] = c[n][3];
#endif
    }
}

// Columns col, col+1 of a row of `d` elem_t values (col even); ragged and odd d handled.
__device__ __forceinline__ void store_row_pair(elem_t* row, int col, int d, acc_t a, acc_t b) {
    if (col + 1 < d && d % 2 == 0) {
#if FLASH_TENSOR_CORES
        *reinterpret_cast<unsigned*>(row + col) = pack2(a, b);
#else
        typename Pair<acc_t>::type v;
        v.x = a;
        v.y = b;
        *reinterpret_cast<typename Pair<acc_t>::type*>(row + col) = v;
#endif
    } else {
        if (col < d) row[col] = from_acc(a);
        if (col + 1 < d) row[col + 1] = from_acc(b);
    }
}

// The epilogue of a warp's (16, 8*NT) O_i accumulator, first row r0, rows g and g+8 of each lane:
// O_i = diag(l_i)^-1 O_i into o (Nq, D), m_i m_scale (m_i of the online softmax in units of
// m_scale; -inf stays -inf) and l_i into m_out, l_out (Nq), with the attention sink folded in where
// the call has sinks (`sinks`; `sink` its logit, natural units; fold_sink), o scaled by o_scale
// (dropout's 1 / (1 - p)).
// A row that saw no key (l_i = 0) gets O_i = 0, whatever 0 · NaN met in P~ V where a masked key's
// value was not finite; NaN stays NaN.
template <int NT>
__device__ __forceinline__ void store_output_rows(elem_t* o, acc_t* m_out, acc_t* l_out, const acc_t (&O)[NT][4],
                                                  const acc_t (&m_i)[2], const acc_t (&l_i)[2], acc_t m_scale,
                                                  int r0, int Nq, int D, bool sinks = false,
                                                  acc_t sink = (acc_t)0, acc_t o_scale = (acc_t)1) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + g + 8 * h;
        if (row >= Nq) continue;
        const bool none = l_i[h] == (acc_t)0;
        acc_t m = m_i[h] == NEG_INF ? NEG_INF : m_i[h] * m_scale, l = l_i[h];
        acc_t inv_l = o_scale / l;   // inf where none: not used
        if (sinks) inv_l *= fold_sink(m, l, sink);
#pragma unroll
        for (int n = 0; n < NT; ++n)
            store_row_pair(o + (i64)row * D, n * 8 + 2 * t, D, none ? (acc_t)0 : O[n][2 * h] * inv_l,
                           none ? (acc_t)0 : O[n][2 * h + 1] * inv_l);
        if (t == 0) {
            m_out[row] = m;
            l_out[row] = l;
        }
    }
}

// The turn counters of the dK_j, dV_j sums that sequence sq adds into (deterministic with
// kv_atomic; layout.cuh, "Ordered sums"): tile `tile` of the `tiles` per K/V head and sequence, and
// the rank of sq's batch entry among the entries that share each head.
struct KvTurns {
    unsigned *dk, *dv;
    unsigned dk_rank, dv_rank;
};

__device__ __forceinline__ KvTurns kv_turns(const BwdParams& p, const Seq& sq, i64 tile, i64 tiles) {
    const BatchIndex bi = sq.bi;
    const i64 n = p.seqs.n;   // the heads from strides in heads: no 64-bit division beside dK_j, dV_j
    return {p.dk_turns + ((batch_offset(bi, p.dk_heads[0], p.dk_heads[1], p.dk_heads[2]) * n + sq.s) * tiles + tile),
            p.dv_turns + ((batch_offset(bi, p.dv_heads[0], p.dv_heads[1], p.dv_heads[2]) * n + sq.s) * tiles + tile),
            broadcast_rank(bi, p.batch.n1, p.batch.n2, p.dk.s0, p.dk.s1, p.dk.s2),
            broadcast_rank(bi, p.batch.n1, p.batch.n2, p.dv.s0, p.dv.s1, p.dv.s2)};
}

// One thread's part of an ordered store of dK_j and dV_j (kv_turns): wait for both turns before the
// CTA's barrier, hand both on after the next. The counters are found again for the hand-on rather than
// kept: where the ordered sums are a run-time word (SWITCH_ON(ORDERED, p.uses)), nothing of them should
// stay live beside dK_j and dV_j in the kernels that do not order.
__device__ __forceinline__ void wait_kv_turns(const BwdParams& p, const Seq& sq, i64 tile, i64 tiles) {
    const KvTurns turns = kv_turns(p, sq, tile, tiles);
    wait_turn(turns.dk, turns.dk_rank);
    wait_turn(turns.dv, turns.dv_rank);
}

__device__ __forceinline__ void end_kv_turns(const BwdParams& p, const Seq& sq, i64 tile, i64 tiles) {
    const KvTurns turns = kv_turns(p, sq, tile, tiles);
    end_turn(turns.dk);
    end_turn(turns.dv);
}

// scale x a warp's (16, 8*NT) accumulator tile G of dK_j or dV_j (`grad`: p.dk or p.dv; `sums`:
// p.dk_acc or p.dv_acc), key rows key0 .. key0+15 of sequence sq and head-dim columns c0 .., into
// HBM: stored into grad, or added into the sums (kv_atomic)
template <int NT>
__device__ __forceinline__ void store_kv_grad_rows(const BwdParams& p, const Tensor<elem_t>& grad, acc_t* sums,
                                                   const Seq& sq, const acc_t (&G)[NT][4], int key0, acc_t scale,
                                                   int c0 = 0) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4, D = p.D;
    const i64 at = batch_offset(sq.bi, grad.s0, grad.s1, grad.s2) + (i64)sq.k0 * D;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = key0 + g + 8 * h, col = c0 + n * 8 + 2 * t;
            if (row >= sq.mask.Nk) continue;
            const acc_t x0 = scale * G[n][2 * h], x1 = scale * G[n][2 * h + 1];
            if (p.kv_atomic) {
                acc_t* r = sums + at + (i64)row * D;
                if (col < D) atomicAdd(r + col, x0);
                if (col + 1 < D) atomicAdd(r + col + 1, x1);
            } else {
                store_row_pair(grad.ptr + at + (i64)row * D, col, D, x0, x1);
            }
        }
}

// scale dK_j and dV_j of a warp (store_kv_grad_rows)
template <int NT>
__device__ __forceinline__ void store_dkv_rows(const BwdParams& p, const Seq& sq, const acc_t (&dK)[NT][4],
                                               const acc_t (&dV)[NT][4], int key0, int c0, acc_t scale) {
    store_kv_grad_rows(p, p.dk, p.dk_acc, sq, dK, key0, scale, c0);
    store_kv_grad_rows(p, p.dv, p.dv_acc, sq, dV, key0, (acc_t)1, c0);
}
