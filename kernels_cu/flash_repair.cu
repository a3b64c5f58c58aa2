// flash_repair.cu — the exact rows where a masked pair met an inf or NaN (flash_common.cuh,
// "Masked pairs and non-finite operands").
//
// The main kernels flag each output tile that a product over a tile with masked pairs may have
// reached with an inf or NaN operand; these kernels recompute the flagged rows as the reference
// does, summing over the visible pairs only:
//
//   flash_fwd_repair   o_i  = sum_j exp(S_ij - m_i) v_j / l_i, from the forward's own m_i, l_i (the
//                      masked scores never reach them: the kernels set those to -inf first)
//   flash_bwd_repair   dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i,  dv_j = sum_i P_ij dO_i
//                      with P_ij = exp(S_ij - m_i) / l_i, dS_ij = P_ij (dO_i . v_j - D_i), each summed
//                      over every batch entry that shares the gradient's head (a broadcast q, k or v):
//                      the first flagged entry among them redoes the rows. It writes the sums the
//                      conversion reads (dq_acc; dk_acc, dv_acc when kv_atomic), or dk, dv themselves
//
// S_ij = scale q_i . k_j. A row that saw no key (l_i = 0) adds nothing, as in the main kernels. One
// warp per row, the head dim over its lanes (RPL elements each), one visible pair at a time: slow,
// and only inputs with inf or NaN reach it. Each CTA reads its share of the flags in one load per
// thread and returns when none is set, so a call with finite inputs costs one small launch.

#include "flash_common.cuh"

constexpr int DP = FLASH_DP;
constexpr int NWARPS = FLASH_WARPS;
constexpr int NTHREADS = NWARPS * WARP_SIZE;
constexpr int RPL = (DP + WARP_SIZE - 1) / WARP_SIZE;   // head-dim elements per lane: d = lane + 32 e

// This lane's elements of a row of D values (zero past D)
__device__ __forceinline__ void load_row(acc_t (&x)[RPL], const elem_t* row, int D) {
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

// work(t) for every t < n with flags[t] set, this CTA's share of them (a contiguous range), read
// NTHREADS flags at a time; CTA-uniform
template <class Work>
__device__ __forceinline__ void for_each_flagged(const unsigned* flags, i64 n, Work work) {
    __shared__ unsigned s_set[NTHREADS];
    const i64 share = (n + gridDim.x - 1) / gridDim.x;
    const i64 first = blockIdx.x * share, stop = min(n, first + share);
    for (i64 base = first; base < stop; base += NTHREADS) {
        const i64 t = base + threadIdx.x;
        const unsigned set = t < stop ? flags[t] : 0u;
        s_set[threadIdx.x] = set;
        if (!__syncthreads_or(set)) continue;
        for (int e = 0; e < NTHREADS && base + e < stop; ++e)
            if (s_set[e]) work(base + e);
        __syncthreads();   // before s_set is rewritten
    }
}

// The batch entries whose gradient rows add into the same head as entry bh's, for a gradient with
// collapsed batch strides s0, s1, s2 (0 along a dim where its input broadcasts): bh's coordinate
// along the others, any along those. Entry `index` of `count` runs over the broadcast dims, the
// last fastest; `first_flagged` says whether bh is the first of them with its flag set.
struct Sharers {
    i64 n[3], b[3];
    bool free_dim[3];
    i64 count;

    __device__ __forceinline__ i64 bh(i64 index) const {
        i64 c[3];
#pragma unroll
        for (int a = 2; a >= 0; --a) {
            c[a] = free_dim[a] ? index % n[a] : b[a];
            if (free_dim[a]) index /= n[a];
        }
        return (c[0] * n[1] + c[1]) * n[2] + c[2];
    }

    // flags (BH, tiles): of the entries that share bh's head, bh is the first with tile `tile` flagged
    __device__ __forceinline__ bool first_flagged(i64 bh, const unsigned* flags, int tiles, int tile) const {
        for (i64 x = 0; x < count; ++x) {
            const i64 other = this->bh(x);
            if (other >= bh) return true;   // in increasing order
            if (flags[other * tiles + tile]) return false;
        }
        return true;
    }
};

__device__ __forceinline__ Sharers sharers_of(i64 bh, i64 BH, i64 n1, i64 n2, i64 s0, i64 s1, i64 s2) {
    Sharers r;
    const BatchIndex bi = split_batch(bh, n1, n2);
    const i64 n[3] = {BH / (n1 * n2), n1, n2}, s[3] = {s0, s1, s2}, b[3] = {bi.b0, bi.b1, bi.b2};
    r.count = 1;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
        r.n[a] = n[a];
        r.free_dim[a] = s[a] == 0;
        r.b[a] = b[a];
        if (s[a] == 0) r.count *= n[a];
    }
    return r;
}

extern "C" __global__ void __launch_bounds__(NTHREADS)
flash_fwd_repair(const elem_t* __restrict__ q,    // (batch..., Nq, D) strided
                 const elem_t* __restrict__ k,    // (batch..., Nk, D) strided
                 const elem_t* __restrict__ v,    // (batch..., Nk, D) strided
                 elem_t* __restrict__ o,          // (BH, Nq, D)
                 const acc_t* __restrict__ m,     // (BH, Nq) the forward's, natural units
                 const acc_t* __restrict__ l,     // (BH, Nq)
                 const unsigned* __restrict__ flags,   // (BH, T_r): Q tiles of tile_rows rows to recompute
                 i64 q_s0, i64 q_s1, i64 q_s2, i64 q_sn,
                 i64 k_s0, i64 k_s1, i64 k_s2, i64 k_sn,
                 i64 v_s0, i64 v_s1, i64 v_s2, i64 v_sn,
                 i64 n1, i64 n2, i64 BH, int Nq, int Nk, int D, acc_t scale, int tile_rows, int causal_flag) {
    const bool causal = causal_flag != 0;
    const int warp = threadIdx.x / WARP_SIZE;
    const int T_r = (Nq + tile_rows - 1) / tile_rows;
    for_each_flagged(flags, BH * T_r, [&](i64 tile) {
        const i64 bh = tile / T_r;
        const int r0 = (int)(tile % T_r) * tile_rows;
        const BatchIndex bi = split_batch(bh, n1, n2);
        const elem_t* q_h = q + batch_offset(bi, q_s0, q_s1, q_s2);
        const elem_t* k_h = k + batch_offset(bi, k_s0, k_s1, k_s2);
        const elem_t* v_h = v + batch_offset(bi, v_s0, v_s1, v_s2);
        for (int r = r0 + warp; r < min(r0 + tile_rows, Nq); r += NWARPS) {
            const acc_t m_i = m[bh * Nq + r], l_i = l[bh * Nq + r];
            acc_t q_i[RPL], o_i[RPL] = {};
            if (l_i != (acc_t)0) {
                load_row(q_i, q_h + r * q_sn, D);
                const int key_stop = causal ? min(r + (Nk - Nq) + 1, Nk) : Nk;
                for (int j = 0; j < key_stop; ++j) {
                    acc_t k_j[RPL], v_j[RPL];
                    load_row(k_j, k_h + j * k_sn, D);
                    load_row(v_j, v_h + j * v_sn, D);
                    const acc_t p = exp2_acc((dot(q_i, k_j) * scale - m_i) * (acc_t)LOG2E);
#pragma unroll
                    for (int e = 0; e < RPL; ++e) o_i[e] += p * v_j[e];
                }
            }
            store_row(o + (bh * Nq + r) * D, o_i, l_i == (acc_t)0 ? (acc_t)0 : (acc_t)1 / l_i, D);
        }
    });
}

extern "C" __global__ void __launch_bounds__(NTHREADS)
flash_bwd_repair(const elem_t* __restrict__ q,      // (batch..., Nq, D) strided
                 const elem_t* __restrict__ k,      // (batch..., Nk, D) strided
                 const elem_t* __restrict__ v,      // (batch..., Nk, D) strided
                 const elem_t* __restrict__ dO,     // (batch..., Nq, D) strided
                 const acc_t* __restrict__ m,       // (BH, Nq) the forward's, natural units
                 const acc_t* __restrict__ l,       // (BH, Nq)
                 const acc_t* __restrict__ Dsum,    // (BH, Nq) from flash_bwd_prep_v1
                 acc_t* __restrict__ dq_acc,        // q's own shape, contiguous
                 elem_t* __restrict__ dk,           // k's own shape, contiguous (unless kv_atomic)
                 elem_t* __restrict__ dv,           // v's own shape, contiguous (unless kv_atomic)
                 acc_t* __restrict__ dk_acc,        // k's own shape (when kv_atomic)
                 acc_t* __restrict__ dv_acc,        // v's own shape (when kv_atomic)
                 const unsigned* __restrict__ dq_flags,   // (BH, T_r): dQ tiles of tile_r rows to recompute
                 const unsigned* __restrict__ kv_flags,   // (BH, T_c): dK, dV tiles of tile_c rows
                 i64 q_s0, i64 q_s1, i64 q_s2, i64 q_sn,
                 i64 k_s0, i64 k_s1, i64 k_s2, i64 k_sn,
                 i64 v_s0, i64 v_s1, i64 v_s2, i64 v_sn,
                 i64 do_s0, i64 do_s1, i64 do_s2, i64 do_sn,
                 i64 dq_s0, i64 dq_s1, i64 dq_s2,
                 i64 dk_s0, i64 dk_s1, i64 dk_s2,
                 i64 dv_s0, i64 dv_s1, i64 dv_s2,
                 i64 n1, i64 n2, i64 BH, int Nq, int Nk, int D, acc_t scale, int tile_r, int tile_c,
                 int causal_flag, int kv_atomic) {
    const bool causal = causal_flag != 0;
    const int warp = threadIdx.x / WARP_SIZE;
    const int T_r = (Nq + tile_r - 1) / tile_r, T_c = (Nk + tile_c - 1) / tile_c;
    const i64 dq_tiles = BH * T_r, kv_tiles = BH * T_c;

    // P_ij and dS_ij of entry bh's rows i, j (q_i, dO_i, k_j, v_j this lane's elements); false where
    // row i saw no key
    auto pair_terms = [&](i64 bh, int i, const acc_t (&q_i)[RPL], const acc_t (&do_i)[RPL], const acc_t (&k_j)[RPL],
                          const acc_t (&v_j)[RPL], acc_t& p, acc_t& ds) {
        acc_t s, dp;
        dot2(q_i, k_j, do_i, v_j, s, dp);
        const acc_t l_i = l[bh * Nq + i];
        p = l_i == (acc_t)0 ? (acc_t)0 : exp2_acc((s * scale - m[bh * Nq + i]) * (acc_t)LOG2E) / l_i;
        ds = p * (dp - Dsum[bh * Nq + i]);
        return l_i != (acc_t)0;
    };

    // dq_i of entry bh's q head, rows tile_r * tile .., summed over the entries that share it
    auto redo_dq = [&](i64 bh, int tile) {
        const Sharers sh = sharers_of(bh, BH, n1, n2, dq_s0, dq_s1, dq_s2);
        if (!sh.first_flagged(bh, dq_flags, T_r, tile)) return;
        acc_t* dq_h = dq_acc + batch_offset(split_batch(bh, n1, n2), dq_s0, dq_s1, dq_s2);
        const int r0 = tile * tile_r;
        for (int i = r0 + warp; i < min(r0 + tile_r, Nq); i += NWARPS) {
            acc_t dq_i[RPL] = {};
            for (i64 x = 0; x < sh.count; ++x) {
                const i64 e_bh = sh.bh(x);
                const BatchIndex bi = split_batch(e_bh, n1, n2);
                if (l[e_bh * Nq + i] == (acc_t)0) continue;
                acc_t q_i[RPL], do_i[RPL];
                load_row(q_i, q + batch_offset(bi, q_s0, q_s1, q_s2) + i * q_sn, D);
                load_row(do_i, dO + batch_offset(bi, do_s0, do_s1, do_s2) + i * do_sn, D);
                const int key_stop = causal ? min(i + (Nk - Nq) + 1, Nk) : Nk;
                for (int j = 0; j < key_stop; ++j) {
                    acc_t k_j[RPL], v_j[RPL], p, ds;
                    load_row(k_j, k + batch_offset(bi, k_s0, k_s1, k_s2) + j * k_sn, D);
                    load_row(v_j, v + batch_offset(bi, v_s0, v_s1, v_s2) + j * v_sn, D);
                    pair_terms(e_bh, i, q_i, do_i, k_j, v_j, p, ds);
#pragma unroll
                    for (int e = 0; e < RPL; ++e) dq_i[e] += ds * k_j[e];
                }
            }
            store_row(dq_h + (i64)i * D, dq_i, scale, D);
        }
    };
    // dk_j (grad_k) or dv_j of entry bh's k or v head, rows tile_c * tile .., summed over the entries
    // that share it
    auto redo_dkv = [&](i64 bh, int tile, bool grad_k) {
        const Sharers sh = grad_k ? sharers_of(bh, BH, n1, n2, dk_s0, dk_s1, dk_s2)
                                  : sharers_of(bh, BH, n1, n2, dv_s0, dv_s1, dv_s2);
        if (!sh.first_flagged(bh, kv_flags, T_c, tile)) return;
        const BatchIndex own = split_batch(bh, n1, n2);
        const i64 at = grad_k ? batch_offset(own, dk_s0, dk_s1, dk_s2) : batch_offset(own, dv_s0, dv_s1, dv_s2);
        const int r0 = tile * tile_c;
        for (int j = r0 + warp; j < min(r0 + tile_c, Nk); j += NWARPS) {
            acc_t g_j[RPL] = {};
            for (i64 x = 0; x < sh.count; ++x) {
                const i64 e_bh = sh.bh(x);
                const BatchIndex bi = split_batch(e_bh, n1, n2);
                acc_t k_j[RPL], v_j[RPL];
                load_row(k_j, k + batch_offset(bi, k_s0, k_s1, k_s2) + j * k_sn, D);
                load_row(v_j, v + batch_offset(bi, v_s0, v_s1, v_s2) + j * v_sn, D);
                for (int i = causal ? max(0, j - (Nk - Nq)) : 0; i < Nq; ++i) {
                    acc_t q_i[RPL], do_i[RPL], p, ds;
                    load_row(q_i, q + batch_offset(bi, q_s0, q_s1, q_s2) + i * q_sn, D);
                    load_row(do_i, dO + batch_offset(bi, do_s0, do_s1, do_s2) + i * do_sn, D);
                    if (!pair_terms(e_bh, i, q_i, do_i, k_j, v_j, p, ds)) continue;
#pragma unroll
                    for (int e = 0; e < RPL; ++e) g_j[e] += grad_k ? ds * q_i[e] : p * do_i[e];
                }
            }
            const i64 row = at + (i64)j * D;
            if (kv_atomic) store_row((grad_k ? dk_acc : dv_acc) + row, g_j, grad_k ? scale : (acc_t)1, D);
            else           store_row((grad_k ? dk : dv) + row, g_j, grad_k ? scale : (acc_t)1, D);
        }
    };

    for_each_flagged(dq_flags, dq_tiles, [&](i64 t) { redo_dq(t / T_r, (int)(t % T_r)); });
    for_each_flagged(kv_flags, kv_tiles, [&](i64 t) {
        redo_dkv(t / T_c, (int)(t % T_c), true);
        redo_dkv(t / T_c, (int)(t % T_c), false);
    });
}
