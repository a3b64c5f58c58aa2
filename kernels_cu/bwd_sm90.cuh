// bwd_sm90.cuh — what the two Hopper backward kernels (flash_bwd_sm90.cu, D <= 128, and
// flash_bwd_sm90_wide.cu, 128 < D <= 256) share: the producer warpgroup and its ring of Q tiles.
//
// A CTA owns the K/V tile j of B_C keys and walks the Q tiles that visit it (mask.cuh: q_visits). The
// producer copies K_j, V_j once, then Q_i, dO_i and the row statistics (lse_i log2 e and D_i from
// flash_bwd_prep) of each step into a ring of STAGES buffers (cp.async), each guarded by a "full"
// and an "empty" mbarrier. When causal it scans the operands of the tile pairs with masked pairs
// for inf and NaN (nonfinite.cuh) while it waits to refill their buffers.

#pragma once

#include "copy.cuh"
#include "mask.cuh"
#include "nonfinite.cuh"
#include "params.cuh"
#include "sm90.cuh"

constexpr int BWD_WG_THREADS = 4 * WARP_SIZE;   // one warpgroup
constexpr int BWD_PRODUCER_BARRIER = 15;        // named barrier of the producer's threads alone

// The shared tiles and barriers of the ring: K_j, V_j (B_C, DP); STAGES of Q_i, dO_i (B_R, DP),
// all swizzled; STAGES of (lse_i log2 e, D_i) (2, B_R); one K/V "full" barrier, then STAGES "full"
// and STAGES "empty" barriers of the Q ring
struct BwdRing {
    elem_t *K, *V, *Q, *dO;
    acc_t* stat;
    unsigned long long *kv_full, *q_full, *q_empty;
};

// Thread 0 sets up the ring's mbarriers (the consumers' `consumer_threads` arrive on q_empty); every
// thread of the CTA waits for it
template <int STAGES>
__device__ __forceinline__ void init_ring(const BwdRing& r, unsigned consumer_threads) {
    if (threadIdx.x == 0) {
        mbar_init(r.kv_full, BWD_WG_THREADS);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&r.q_full[s], BWD_WG_THREADS);
            mbar_init(&r.q_empty[s], consumer_threads);
        }
    }
    __syncthreads();
}

// Producer: one 4-byte cp.async per statistic of the rows q0 .. q0+B_R-1. Past Nq they are zero:
// those rows of Q_i and dO_i are zero too, so their P_ij^T = 1 meets dO = 0 and dP - D = 0.
template <int B_R>
__device__ __forceinline__ void produce_stats(acc_t* s_stat, const acc_t* lse2, const acc_t* Dsum,
                                              int q0, int Nq, bool vec, int ptid) {
    for (int c = ptid; c < 2 * B_R; c += BWD_WG_THREADS) {
        const int r = c % B_R;
        const acc_t* src = (c < B_R ? lse2 : Dsum) + q0 + r;
        const bool valid = q0 + r < Nq;
        if (vec) {
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                         :: "r"(smem_addr(s_stat + c)), "l"(valid ? src : lse2), "r"(valid ? 4 : 0) : "memory");
        } else {
            s_stat[c] = valid ? *src : (acc_t)0;
        }
    }
}

// The producer warpgroup's whole part (thread ptid of BWD_WG_THREADS) for the CTA of K/V tile j of
// work head w (sequence sq), whose Q tiles are `visits` (step n: position visits.begin + n); the consumers arrive on
// q_empty[s], all CONSUMER_THREADS of them, once they are done with stage s.
template <int B_R, int B_C, int DP, int STAGES>
__device__ __forceinline__ void produce_bwd(const BwdParams& p, const BwdRing& r, i64 w, const Seq& sq, int j,
                                            const Visits& visits, int ptid) {
    constexpr int TILE_KV = B_C * DP, TILE_Q = B_R * DP;
    const Mask& mask = mask_of(p, sq);
    const int Nq = mask.Nq, Nk = mask.Nk, D = p.D, kv0 = j * B_C;
    const int T_r = (p.mask.Nq + B_R - 1) / B_R, T_c = (p.mask.Nk + B_C - 1) / B_C;   // the grid's, of the flags
    const bool vec = p.vec != 0;
    const elem_t* q = sq.q_rows(p.q);
    const elem_t* dO = sq.q_rows(p.dO);
    const acc_t* lse2 = p.lse2 + sq.row0;
    const acc_t* Dsum = p.Dsum + sq.row0;
    const int steps = visits.count();

    const int kv_rows = min(B_C, Nk - kv0);
    load_tile_sw128<B_C, DP, BWD_WG_THREADS>(r.K, sq.k_rows(p.k) + (i64)kv0 * p.k.sn, p.k.sn, kv_rows, D, vec, ptid);
    load_tile_sw128<B_C, DP, BWD_WG_THREADS>(r.V, sq.k_rows(p.v) + (i64)kv0 * p.v.sn, p.v.sn, kv_rows, D, vec, ptid);
    arrive_when_landed(r.kv_full, vec);

    // Where a tile pair with masked pairs has an operand with an inf or NaN, its products may spread
    // it to them (nonfinite.cuh): flag dQ_i and dK_j, dV_j for the repair. The producer scans
    // while it waits anyway: a step's tiles just before it waits to refill their buffers, K_j and
    // V_j before the first such wait, the rest as the CTA ends.
    auto masked = [&](int n) {
        const int visit = visits.entry(visits.begin + n);
        return may_hide(mask, Visits::tile_of(visit) * B_R, B_R, kv0, B_C, Visits::all_of(visit));
    };
    auto flag_pair = [&](int n) {
        p.dq_flags[w * T_r + visits.tile(visits.begin + n)] = 1u;
        p.kv_flags[w * T_c + j] = 1u;
    };
    auto scan_step = [&](int n) {
        const int s = n % STAGES;
        mbar_wait(&r.q_full[s], (n / STAGES) & 1);
        if (rows_nonfinite(r.Q + s * TILE_Q, TILE_Q / SW_COLS, SW_COLS, SW_COLS, ptid, BWD_WG_THREADS)
            || rows_nonfinite(r.dO + s * TILE_Q, TILE_Q / SW_COLS, SW_COLS, SW_COLS, ptid, BWD_WG_THREADS)
            || values_nonfinite(r.stat + s * 2 * B_R + B_R, B_R, ptid, BWD_WG_THREADS))
            flag_pair(n);
    };
    auto scan_kv = [&]() {
        mbar_wait(r.kv_full, 0);
        if (rows_nonfinite(r.K, TILE_KV / SW_COLS, SW_COLS, SW_COLS, ptid, BWD_WG_THREADS)
            || rows_nonfinite(r.V, TILE_KV / SW_COLS, SW_COLS, SW_COLS, ptid, BWD_WG_THREADS))
            for (int n = 0; n < steps; ++n)
                if (masked(n)) flag_pair(n);
    };
    for (int n = 0; n < steps; ++n) {
        const int s = n % STAGES, use = n / STAGES, q0 = visits.tile(visits.begin + n) * B_R, rows = min(B_R, Nq - q0);
        if (use > 0) {
            if (may_hide_any(mask) && n == STAGES) scan_kv();
            if (masked(n - STAGES)) {
                scan_step(n - STAGES);
                named_barrier_sync(BWD_PRODUCER_BARRIER, BWD_WG_THREADS);   // no thread refills what another still scans
            }
            mbar_wait(&r.q_empty[s], (use - 1) & 1);
        }
        load_tile_sw128<B_R, DP, BWD_WG_THREADS>(r.Q + s * TILE_Q, q + (i64)q0 * p.q.sn, p.q.sn, rows, D, vec, ptid);
        load_tile_sw128<B_R, DP, BWD_WG_THREADS>(r.dO + s * TILE_Q, dO + (i64)q0 * p.dO.sn, p.dO.sn, rows, D, vec,
                                                 ptid);
        produce_stats<B_R>(r.stat + s * 2 * B_R, lse2, Dsum, q0, Nq, vec, ptid);
        arrive_when_landed(&r.q_full[s], vec);
    }
    if (may_hide_any(mask) && steps <= STAGES) scan_kv();
    for (int n = max(0, steps - STAGES); n < steps; ++n)
        if (masked(n)) scan_step(n);
    cp_async_wait<0>();   // no copy outlives its thread
}
