// flash_repair.cu — the exact rows where a masked pair met an inf or NaN (nonfinite.cuh).
//
// The main kernels flag each output tile that a product over a tile with masked pairs may have
// reached with an inf or NaN operand; these kernels recompute the flagged rows as the reference
// does, summing over the visible pairs only:
//
//   flash_fwd_repair   o_i  = sum_j exp(S_ij - m_i) v_j / l_i, from the forward's own m_i, l_i
//                      (repair.cuh); after the portable forwards, and after the Hopper forward's
//                      split-KV merge (without splits that kernel repairs the tiles it flagged itself)
//   flash_bwd_repair   dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i,  dv_j = sum_i P_ij dO_i
//                      with P_ij = exp(S_ij - m_i) / l_i, dS_ij = P_ij (dO_i . v_j - D_i), each summed
//                      over every batch entry that shares the gradient's head (a broadcast q, k or v):
//                      the first flagged entry among them redoes the rows. It writes the sums the
//                      conversion reads (dq_acc; dk_acc, dv_acc when kv_atomic), or dk, dv themselves.
//
// S_ij = scale q_i . k_j, modified where modifiers apply (score_mod.cuh; dS_ij is then by scale
// q_i . k_j, o ds'/ds of the softcap). The modifiers, packed sequences and a paged cache are read at run
// time here (FLASH_<NAME>=FLASH_AT_RUN_TIME, cupyflash/_flags.py: FLAGS), user expressions aside: one
// specialisation per dtype and head-dim bucket serves every call. A row that saw no key (l_i = 0) adds
// nothing, as in the main kernels. One warp per row, the head dim over its lanes (RPL elements each),
// one visible pair at a time: slow, and only inputs with inf or NaN reach it. Each CTA reads its share
// of the flags in one load per thread and returns when none is set, so a call with finite inputs costs
// one small launch.

#include "layout.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "repair.cuh"
#include "score_mod.cuh"
#include "types.cuh"

constexpr int NWARPS = FLASH_WARPS;
constexpr int NTHREADS = NWARPS * WARP_SIZE;

// work(t) for every t < n with flags[t] set, this CTA's share of them (a contiguous range), read
// NTHREADS flags at a time; CTA-uniform. CLEAR: each flag read is set back to 0 (every flag is read by
// one thread only), so the array is zero again for the next call that uses it (a plan's kept scratch)
template <bool CLEAR = false, class Work>
__device__ __forceinline__ void for_each_flagged(unsigned* flags, i64 n, Work work) {
    __shared__ unsigned s_set[NTHREADS];
    const i64 share = (n + gridDim.x - 1) / gridDim.x;
    const i64 first = blockIdx.x * share, stop = min(n, first + share);
    for (i64 base = first; base < stop; base += NTHREADS) {
        const i64 t = base + threadIdx.x;
        const unsigned set = t < stop ? flags[t] : 0u;
        if (CLEAR && set) flags[t] = 0u;
        s_set[threadIdx.x] = set;
        if (!__syncthreads_or(set)) continue;
        for (int e = 0; e < NTHREADS && base + e < stop; ++e)
            if (s_set[e]) work(base + e);
        __syncthreads();   // before s_set is rewritten
    }
}

// The work heads whose gradient rows add into the same head as work head w's: the same sequence of
// the batch entries that share w's entry's head of a gradient with collapsed batch strides s0, s1, s2
// (0 along a dim where its input broadcasts): w's entry's coordinate along the others, any along
// those. Sharer `index` of `count` runs over the broadcast dims, the last fastest;
// `first_flagged` says whether w is the first of them with its flag set.
struct Sharers {
    i64 n[3], b[3];
    bool free_dim[3];
    i64 count;
    i64 seqs, s;   // sequences per entry, w's sequence

    __device__ __forceinline__ i64 w(i64 index) const {
        i64 c[3];
#pragma unroll
        for (int a = 2; a >= 0; --a) {
            c[a] = free_dim[a] ? index % n[a] : b[a];
            if (free_dim[a]) index /= n[a];
        }
        return ((c[0] * n[1] + c[1]) * n[2] + c[2]) * seqs + s;
    }

    // flags (heads, tiles): of the work heads that share w's head, w is the first with tile `tile` flagged
    __device__ __forceinline__ bool first_flagged(i64 w, const unsigned* flags, int tiles, int tile) const {
        for (i64 x = 0; x < count; ++x) {
            const i64 other = this->w(x);
            if (other >= w) return true;   // in increasing order
            if (flags[other * tiles + tile]) return false;
        }
        return true;
    }
};

// the sharers of work head w's head of gradient `grad` (a tensor of collapsed batch strides s0, s1, s2)
template <typename T>
__device__ __forceinline__ Sharers sharers_of(i64 w, const Batch& batch, const Seqs& seqs, const Tensor<T>& grad) {
    Sharers r;
    r.seqs = seqs.n;
    r.s = w % seqs.n;
    const BatchIndex bi = batch.split(w / seqs.n);
    const i64 n[3] = {batch.count / (batch.n1 * batch.n2), batch.n1, batch.n2}, s[3] = {grad.s0, grad.s1, grad.s2};
    const i64 b[3] = {bi.b0, bi.b1, bi.b2};
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

extern "C" __global__ void __launch_bounds__(NTHREADS) flash_fwd_repair(const FwdParams p) {
    const int T_r = (p.mask.Nq + p.tile_rows - 1) / p.tile_rows;   // the main kernel's grid's
    for_each_flagged<true>(p.repair_flags, p.seqs.heads * T_r,
                           [&](i64 tile) { repair_forward_tile(p, tile, T_r, threadIdx.x / WARP_SIZE, NWARPS); });
}

// The rows of sequence sq that its gradient rows are made of
struct EntryRows {
    const elem_t *q, *k, *v, *dO;
};

__device__ __forceinline__ EntryRows entry_rows(const BwdParams& p, const Seq& sq) {
    return {sq.q_rows(p.q), sq.k_rows(p.k), sq.k_rows(p.v), sq.q_rows(p.dO)};
}

extern "C" __global__ void __launch_bounds__(NTHREADS) flash_bwd_repair(const BwdParams p) {
    const int D = p.D, tile_r = p.tile_r, tile_c = p.tile_c;
    const acc_t scale = (acc_t)p.scale;
    const i64 heads = p.seqs.heads;
    const int warp = threadIdx.x / WARP_SIZE;
    const int T_r = (p.mask.Nq + tile_r - 1) / tile_r, T_c = (p.mask.Nk + tile_c - 1) / tile_c;   // the grid's

    // Z P_ij (dropout's Z = keep / (1 - p), else 1) and dS_ij = P_ij (Z dP_ij - D_i) of sequence sq's rows
    // i, j (q_i, dO_i, k_j, v_j this lane's elements); false where row i saw no key or the boolean mask
    // hides the pair (neither adds a term)
    auto pair_terms = [&](const Seq& sq, int i, int j, const acc_t (&q_i)[RPL], const acc_t (&do_i)[RPL],
                          const acc_t (&k_j)[RPL], const acc_t (&v_j)[RPL], acc_t& P_ij, acc_t& dS_ij) {
        acc_t s, dp, grad = (acc_t)1;
        dot2(q_i, k_j, do_i, v_j, s, dp);
        const acc_t l_i = p.l[sq.row0 + i];
        const EntryMods mods = mods_of(p, sq);
        s = mods.apply<true>(s * scale, i, j, grad);
        P_ij = l_i == (acc_t)0 ? (acc_t)0 : exp2_acc((s - p.m[sq.row0 + i]) * (acc_t)LOG2E) / l_i;
        const acc_t z = mods.drops() ? (mods.kept(i, j) ? mods.keep_scale : (acc_t)0) : (acc_t)1;
        dS_ij = P_ij * (z * dp - p.Dsum[sq.row0 + i]) * grad;
        P_ij *= z;
        return l_i != (acc_t)0 && !mods.hidden(i, j);
    };

    // dq_i of work head w's q head, rows tile_r * tile .., summed over the work heads that share it
    auto redo_dq = [&](i64 w, int tile) {
        const Sharers sh = sharers_of(w, p.batch, p.seqs, p.dq_acc);
        if (!sh.first_flagged(w, p.dq_flags, T_r, tile)) return;
        const Seq own = seq_of(p, w);
        const Mask& mask = own.mask;
        acc_t* dq_h = own.q_rows(p.dq_acc);
        const int r0 = tile * tile_r;
        for (int i = r0 + warp; i < min(r0 + tile_r, mask.Nq); i += NWARPS) {
            acc_t dq_i[RPL] = {};
            for (i64 x = 0; x < sh.count; ++x) {
                const Seq e = seq_of(p, sh.w(x));
                if (p.l[e.row0 + i] == (acc_t)0) continue;
                const EntryRows rows = entry_rows(p, e);
                acc_t q_i[RPL], do_i[RPL];
                load_row(q_i, rows.q + i * p.q.sn, D);
                load_row(do_i, rows.dO + i * p.dO.sn, D);
                for (int j = mask.key_start(i); j < mask.key_stop(i); ++j) {
                    acc_t k_j[RPL], v_j[RPL], P_ij, dS_ij;
                    load_row(k_j, rows.k + j * p.k.sn, D);
                    load_row(v_j, rows.v + j * p.v.sn, D);
                    if (!pair_terms(e, i, j, q_i, do_i, k_j, v_j, P_ij, dS_ij)) continue;
#pragma unroll
                    for (int e = 0; e < RPL; ++e) dq_i[e] += dS_ij * k_j[e];
                }
            }
            store_row(dq_h + (i64)i * D, dq_i, scale, D);
        }
    };
    // dk_j (grad_k) or dv_j of work head w's k or v head, rows tile_c * tile .., summed over the work
    // heads that share it
    auto redo_dkv = [&](i64 w, int tile, bool grad_k) {
        const Sharers sh = grad_k ? sharers_of(w, p.batch, p.seqs, p.dk) : sharers_of(w, p.batch, p.seqs, p.dv);
        if (!sh.first_flagged(w, p.kv_flags, T_c, tile)) return;
        const Seq own = seq_of(p, w);
        const Mask& mask = own.mask;
        const i64 at = (grad_k ? batch_offset(own.bi, p.dk.s0, p.dk.s1, p.dk.s2) : batch_offset(own.bi, p.dv.s0, p.dv.s1, p.dv.s2))
                       + (i64)own.k0 * D;
        const int r0 = tile * tile_c;
        for (int j = r0 + warp; j < min(r0 + tile_c, mask.Nk); j += NWARPS) {
            acc_t g_j[RPL] = {};
            for (i64 x = 0; x < sh.count; ++x) {
                const Seq e = seq_of(p, sh.w(x));
                const EntryRows rows = entry_rows(p, e);
                acc_t k_j[RPL], v_j[RPL];
                load_row(k_j, rows.k + j * p.k.sn, D);
                load_row(v_j, rows.v + j * p.v.sn, D);
                for (int i = mask.q_start(j); i < mask.q_stop(j + 1); ++i) {   // the rows that see key j
                    acc_t q_i[RPL], do_i[RPL], P_ij, dS_ij;
                    load_row(q_i, rows.q + i * p.q.sn, D);
                    load_row(do_i, rows.dO + i * p.dO.sn, D);
                    if (!pair_terms(e, i, j, q_i, do_i, k_j, v_j, P_ij, dS_ij)) continue;
#pragma unroll
                    for (int e = 0; e < RPL; ++e) g_j[e] += grad_k ? dS_ij * q_i[e] : P_ij * do_i[e];
                }
            }
            const i64 row = at + (i64)j * D;
            const acc_t g_scale = grad_k ? scale : (acc_t)1;
            if (p.kv_atomic) store_row((grad_k ? p.dk_acc : p.dv_acc) + row, g_j, g_scale, D);
            else             store_row((grad_k ? p.dk.ptr : p.dv.ptr) + row, g_j, g_scale, D);
        }
    };

    for_each_flagged(p.dq_flags, heads * T_r, [&](i64 t) { redo_dq(t / T_r, (int)(t % T_r)); });
    for_each_flagged(p.kv_flags, heads * T_c, [&](i64 t) {
        redo_dkv(t / T_c, (int)(t % T_c), true);
        redo_dkv(t / T_c, (int)(t % T_c), false);
    });
}
