// flash_bwd_sm90.cu — the backward (flash_bwd.cu's loop order and arithmetic) on Hopper's
// warpgroup MMA, for float16/bfloat16 on sm_90a, D <= 128.
//
// It follows FlashAttention-3 (Shah et al., 2024) in its warp specialisation: a producer
// warpgroup that copies and consumer warpgroups that multiply, with the registers reallocated
// between them (section 3.1). Unlike FlashAttention-3's backward it copies with cp.async (not TMA)
// and sums dQ_i on chip over the CTA's keys before one bulk add per row.
//
// One CTA per (K/V tile j of B_C keys, batch*head), walking the Q tiles i of B_R rows (128 at
// D = 64, where the products are small, but 64 under per-pair values, which take registers too; 64 at
// D = 128, where registers are). Three warpgroups:
//
//   producer   warpgroup 0 copies K_j, V_j once, then Q_i, dO_i and the row statistics into a
//              ring of STAGES buffers and scans the causal diagonal for inf and NaN (bwd_sm90.cuh);
//   consumers  warpgroups 1, 2 own 64 keys each; dK_j, dV_j of their keys stay in registers.
//
// Keys sit on the accumulator rows, so every product of a consumer is one wgmma shape:
//
//   S_ij^T  = K_j Q_i^T                    A = K_j, B = Q_i     (shared memory, K-major)
//   dP_ij^T = V_j dO_i^T                   A = V_j, B = dO_i    (shared memory, K-major)
//   P_ij^T  = exp(scale S_ij^T - lse_i),  dS_ij^T = P_ij^T o (dP_ij^T - D_i)
//                                          (lse_i = m_i + log l_i; the exponent is one FFMA)
//   dV_j   += P_ij^T dO_i                  A = P^T (registers), B = dO_i (N-major)
//   dK_j   += dS_ij^T Q_i  (scale at end)  A = dS^T (registers), B = Q_i (N-major)
//   dQ_i   += scale dS_ij K_j              A = dS^T (shared memory, M-major), B = K_j (N-major),
//                                          over all B_C keys: the consumers take turns with its
//                                          (64, 64) blocks, stage them in float32 and the copy
//                                          engine adds whole rows into the float32 workspace
//                                          (cp.reduce.async.bulk), half the traffic of atomics;
//                                          in grid order when deterministic (layout.cuh).
//
// Shared memory (128-byte swizzle, sm90.cuh), after 1024-byte alignment:
//   s_K, s_V  (B_C, DP)               K_j, V_j
//   s_Q, s_dO (STAGES, B_R, DP)       Q_i, dO_i ring
//   s_dS      (2, B_C, B_R)           dS^T by step parity, rows = keys (consumer c: rows 64c..)
//   s_dQ      (B_R, DP + 4) float     scale dS_ij K_j, for the bulk add
//   s_stat    (STAGES, 2, B_R) acc_t  lse_i log2 e, D_i
//   bars      (1 + 2 STAGES) u64      K/V full; Q full, Q empty per stage
//
// Per step the consumers meet twice (named barriers over both): once both halves of dS^T are
// written (and the previous bulk add has read s_dQ), once s_dQ is; ordered (deterministic) adds
// meet a third time, once the bulk adds have landed.

#include "bwd_sm90.cuh"
#include "copy.cuh"
#include "epilogue.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"
#include "params.cuh"
#include "score_mod.cuh"
#include "sm90.cuh"
#include "tile_map.cuh"

constexpr int DP = FLASH_DP;
constexpr int B_R = FLASH_BR;
constexpr int B_C = FLASH_BC;
constexpr int NTHREADS = FLASH_WARPS * WARP_SIZE;
constexpr int WG_THREADS = BWD_WG_THREADS;
constexpr int CONSUMERS = NTHREADS / WG_THREADS - 1;
constexpr int STAGES = 2;
constexpr int TILE_KV = B_C * DP, TILE_Q = B_R * DP, TILE_DS = B_C * B_R;   // elements
constexpr int DQ_PITCH = DP + 4;                   // floats: rows 16 bytes apart in banks
constexpr int N_BARRIERS = 1 + 2 * STAGES;
constexpr int SMEM_BYTES = (2 * TILE_KV + 2 * STAGES * TILE_Q + 2 * TILE_DS) * (int)sizeof(elem_t)
                           + B_R * DQ_PITCH * (int)sizeof(float) + STAGES * 2 * B_R * (int)sizeof(acc_t)
                           + N_BARRIERS * 8 + SW_ATOM_BYTES;
// setmaxnreg: the fewest registers to the producer, the rest to the consumers (cupyflash/_tiles.py:
// TileConfig.registers, the one place)
constexpr int PRODUCER_REGS = FLASH_PRODUCER_REGS;
constexpr int CONSUMER_REGS = FLASH_CONSUMER_REGS;

// Named barriers (0 is __syncthreads) over both consumers: dS^T written, s_dQ written, bulk adds landed
enum Barrier : int { DS_WRITTEN = 1, DQ_WRITTEN = 2, ADDS_LANDED = 3 };   // 15: the producer's (bwd_sm90.cuh)

static_assert(CONSUMERS == 2 && B_C == 64 * CONSUMERS, "one producer warpgroup, 64 keys per consumer");
static_assert((B_R == 64 || B_R == 128) && DP % SW_COLS == 0 && DP <= 128, "tile shapes");
static_assert(PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= (1 + CONSUMERS) * (65536 / NTHREADS / 8 * 8), "register file");
static_assert(SMEM_BYTES == FLASH_SMEM_BYTES, "host and device disagree on the shared-memory layout");

// P_ij^T = exp2(S_ij^T scale log2 e - lse_i log2 e) (one FFMA into the exponent; 16-bit inputs round P
// far coarser) and dS_ij^T = P_ij^T o (dP_ij^T - D_i) of a warp's (16, B_R) S_ij^T, dP_ij^T (key rows
// key0 .., query columns q0 ..), as A fragments 16 queries at a time; `st` holds the tile's lse_i log2 e
// then D_i. MASKED: invisible pairs -> P = 0 (a row that saw no key has lse = inf: P = 0 too)
// With modifiers (score_mod.cuh) the exponent takes the modified score in the modifiers' units
// (RawMods), and dS_ij^T is by scale S_ij^T (o ds'/ds of the softcap). Dropout: Pf holds Z o P^T and
// dS^T = P^T o (Z o dP^T - D_i). A bias's and a boolean mask's pairs come from `pairs`, loaded under the
// tile's products (score_mod.cuh: PairsOfTile).
template <bool MASKED, typename Ahead>
__device__ __forceinline__ void probabilities(unsigned (&Pf)[B_R / 16][4], unsigned (&dSf)[B_R / 16][4],
                                              const acc_t (&S)[B_R / 8][4], const acc_t (&dP)[B_R / 8][4],
                                              const acc_t* st, const Mask& mask, const EntryMods& mods,
                                              const Ahead& pairs, int q0, int key0, acc_t scale) {
    const RawMods raw(mods, scale);
    const acc_t unit_log2 = (SCORE_MODS ? raw.unit : scale) * (acc_t)LOG2E;
    acc_t base[2];
    raw_base<true>(base, raw.entry.off, key0, q0);
    const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int kk = 0; kk < B_R / 16; ++kk) {
        acc_t pt[2][4], pz[2][4], ds[2][4];   // P^T, Z o P^T (dropout), dS^T
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int nn = 2 * kk + half, qc = nn * 8 + 2 * t;   // query columns qc, qc + 1 of the tile
            const float2 lse = *reinterpret_cast<const float2*>(st + qc);
            const float2 Dv = *reinterpret_cast<const float2*>(st + B_R + qc);
            const acc_t neg_lse[2] = {-lse.x, -lse.y}, Dq[2] = {Dv.x, Dv.y};
            acc_t x[4] = {S[nn][0], S[nn][1], S[nn][2], S[nn][3]}, grad[4];
            if (SCORE_MODS && mods.modifies()) modify_raw_quad<true, true>(x, grad, raw, base, key0, q0, nn, pairs);
            const unsigned keep = DROPOUT ? keep_bits<true>(mods, key0, q0, nn) : 0u;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                pt[half][e] = (MASKED && !mask.visible(q0 + qc + e % 2, key0 + g + (e / 2) * 8))
                                  ? (acc_t)0
                                  : exp2_acc(fmaf(x[e], unit_log2, neg_lse[e % 2]));
                const acc_t z = keep_factor(mods, keep, e);
                pz[half][e] = pt[half][e] * z;
                ds[half][e] = pt[half][e] * (z * dP[nn][e] - Dq[e % 2]);
            }
            add_dbias_quad<true>(ds[half], mods, mask, key0, q0, nn);
            if constexpr (CHAIN)
#pragma unroll
                for (int e = 0; e < 4; ++e) ds[half][e] *= grad[e];
        }
        // the A fragment of columns 16kk .. 16kk+15: rows g, g+8 of the left, then the right 8
        Pf[kk][0] = pack2(pz[0][0], pz[0][1]);
        Pf[kk][1] = pack2(pz[0][2], pz[0][3]);
        Pf[kk][2] = pack2(pz[1][0], pz[1][1]);
        Pf[kk][3] = pack2(pz[1][2], pz[1][3]);
        dSf[kk][0] = pack2(ds[0][0], ds[0][1]);
        dSf[kk][1] = pack2(ds[0][2], ds[0][3]);
        dSf[kk][2] = pack2(ds[1][0], ds[1][1]);
        dSf[kk][3] = pack2(ds[1][2], ds[1][3]);
    }
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) flash_bwd_sm90(const BwdParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned misalign = smem_addr(smem) % SW_ATOM_BYTES;
    elem_t* s_K = reinterpret_cast<elem_t*>(smem + (misalign ? SW_ATOM_BYTES - misalign : 0));   // (B_C, DP)
    elem_t* s_V = s_K + TILE_KV;                                          // (B_C, DP)
    elem_t* s_Q = s_V + TILE_KV;                                          // (STAGES, B_R, DP)
    elem_t* s_dO = s_Q + STAGES * TILE_Q;                                 // (STAGES, B_R, DP)
    elem_t* s_dS = s_dO + STAGES * TILE_Q;                                // (2, B_C, B_R)
    float* s_dQ = reinterpret_cast<float*>(s_dS + 2 * TILE_DS);           // (B_R, DQ_PITCH)
    acc_t* s_stat = reinterpret_cast<acc_t*>(s_dQ + B_R * DQ_PITCH);      // (STAGES, 2, B_R)
    unsigned long long* kv_full = reinterpret_cast<unsigned long long*>(s_stat + STAGES * 2 * B_R);
    unsigned long long* q_full = kv_full + 1;                             // (STAGES)
    unsigned long long* q_empty = q_full + STAGES;                        // (STAGES)

    const int D = p.D;
    const bool kv_atomic = p.kv_atomic != 0;
    const bool ordered = SWITCH_ON(ORDERED, p.uses);   // deterministic: the sums in grid order
    const int tid = threadIdx.x;
    const int wg = __shfl_sync(0xffffffffu, tid / WG_THREADS, 0);   // from lane 0: the compiler sees it warp-uniform
    const int T_r = (p.mask.Nq + B_R - 1) / B_R, T_c = (p.mask.Nk + B_C - 1) / B_C;   // the grid's tiles per head
    const GridTile at = grid_tile(T_c, p.head_group);
    const i64 w = at.bh;
    const int j = at.tile;                             // the most Q tiles first when causal
    const int kv0 = j * B_C;
    const Seq sq = seq_of(p, w);
    const Mask& mask = mask_of(p, sq);
    const int Nq = mask.Nq, Nk = mask.Nk;
    if (kv0 >= Nk) return;                             // past a shorter sequence's keys
    const TileHead tiles = tiles_of(p, sq);
    const Visits visits = q_visits<B_R, B_C>(mask, tiles, j);   // the Q tiles that visit K_j (the band's or the tile map's)
    const int steps = visits.count();
    const BwdRing ring{s_K, s_V, s_Q, s_dO, s_stat, kv_full, q_full, q_empty};
    init_ring<STAGES>(ring, CONSUMERS * WG_THREADS);

    if (wg == 0) {
        // producer: K_j, V_j; then Q_i, dO_i, statistics into stage n % STAGES once it is released
        setmaxnreg_dec<PRODUCER_REGS>();
        produce_bwd<B_R, B_C, DP, STAGES>(p, ring, w, sq, j, visits, tid);
    } else {
        // consumers: warpgroup c owns keys kv0 + 64c .. kv0 + 64c + 63
        setmaxnreg_inc<CONSUMER_REGS>();
        const int c = wg - 1;
        const int warp = tid / WARP_SIZE - 4, lane = tid % WARP_SIZE;   // warp among the consumers
        const int g = lane / 4, t = lane % 4;
        const int key0 = kv0 + 16 * warp;                 // first key row of this warp
        const elem_t* s_Kc = s_K + c * 64 * SW_COLS;      // this warpgroup's 64 rows of K_j, V_j
        const elem_t* s_Vc = s_V + c * 64 * SW_COLS;
        const int ctid = tid - WG_THREADS;                // thread among the consumers
        acc_t* dq_acc = sq.q_rows(p.dq_acc);
        constexpr unsigned ATOM = SW_ATOM_BYTES;
        constexpr unsigned K_BLOCK = B_C * SW_COLS * sizeof(elem_t);

        const acc_t scale = (acc_t)p.scale;
        EntryMods mods = mods_of(p, sq);
        PairsOfTile<B_R / 8, true> pairs;                 // a bias's and a mask's pairs of S_ij^T
        acc_t dK[DP / 8][4], dV[DP / 8][4];               // (16, DP) per warp
        zero_frag(dK);
        zero_frag(dV);

        mbar_wait(kv_full, 0);
        fence_proxy_async();
        for (int n = 0; n < steps; ++n) {
            const int s = n % STAGES, i = visits.tile(visits.begin + n), q0 = i * B_R;
            mods.user_all = visits.all(visits.begin + n);
            const elem_t* s_Qs = s_Q + s * TILE_Q;
            const elem_t* s_dOs = s_dO + s * TILE_Q;
            const acc_t* st = s_stat + s * 2 * B_R;     // lse_i log2 e, D_i of the tile's rows
            mbar_wait(&q_full[s], (n / STAGES) & 1);
            fence_proxy_async();

            // S_ij^T = K_j Q_i^T and dP_ij^T = V_j dO_i^T                   (64, B_R) per warpgroup
            acc_t S[B_R / 8][4], dP[B_R / 8][4];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk)
                Wgmma<B_R>::ss(S, sw128_desc(s_Kc + sw128_offset<B_C>(0, kk * 16), 16, ATOM),
                               sw128_desc(s_Qs + sw128_offset<B_R>(0, kk * 16), 16, ATOM), kk > 0);
            wgmma_commit();
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk)
                Wgmma<B_R>::ss(dP, sw128_desc(s_Vc + sw128_offset<B_C>(0, kk * 16), 16, ATOM),
                               sw128_desc(s_dOs + sw128_offset<B_R>(0, kk * 16), 16, ATOM), kk > 0);
            wgmma_commit();
            pairs.load(mods, key0, q0);                    // under the products

            // P_ij^T = exp(scale S_ij^T - lse_i), dS_ij^T = P_ij^T o (dP_ij^T - D_i)
            wgmma_wait<0>();
            wgmma_pin(S);
            wgmma_pin(dP);
            unsigned Pf[B_R / 16][4], dSf[B_R / 16][4];  // P^T, dS^T as A fragments, 16 queries at a time
            // A tile whose pairs are all visible (most of them) takes the path without the mask
            if (mask.full(q0, B_R, key0, 16)) probabilities<false>(Pf, dSf, S, dP, st, mask, mods, pairs, q0, key0, scale);
            else                         probabilities<true>(Pf, dSf, S, dP, st, mask, mods, pairs, q0, key0, scale);

            // dV_j += P_ij^T dO_i,  dK_j += dS_ij^T Q_i (scaled at the end)            (64, DP)
            wgmma_fence();
            wgmma_rs_tile<DP, B_R / 16>(dV, Pf, s_dOs);
            wgmma_rs_tile<DP, B_R / 16>(dK, dSf, s_Qs);
            wgmma_commit();

            // dS_ij^T into shared memory (this step's parity): the A operand (M-major) of dQ_i += dS_ij K_j
            elem_t* s_dSn = s_dS + (n % 2) * TILE_DS;
#pragma unroll
            for (int kk = 0; kk < B_R / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r)   // A fragment register r: row g + 8 (r % 2), columns 16kk + 8 (r / 2) + 2t
                    *reinterpret_cast<unsigned*>(s_dSn + sw128_offset<B_C>(16 * warp + g + 8 * (r % 2),
                                                                           kk * 16 + 8 * (r / 2) + 2 * t)) = dSf[kk][r];
            fence_proxy_async();
            if (ctid < B_R) bulk_wait_read();              // the last bulk add is done with s_dQ
            named_barrier_sync(DS_WRITTEN, CONSUMERS * WG_THREADS);   // all of dS^T is written, s_dQ is free

            // dQ_i = scale dS_ij K_j over all B_C keys, one (64, 64) block per turn, into s_dQ
#pragma unroll
            for (int b = 0; b < (B_R / 64) * (DP / 64); ++b) {
                const int rb = b / (DP / 64), cb = b % (DP / 64);   // query rows 64 rb.., columns 64 cb..
                if ((b + n) % CONSUMERS != c) continue;
                acc_t dQ[8][4];
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < B_C / 16; ++kk)
                    Wgmma<64>::ss<1, 1>(dQ, sw128_desc(s_dSn + sw128_offset<B_C>(kk * 16, rb * 64), TILE_DS * 2, ATOM),
                                        sw128_desc(s_K + sw128_offset<B_C>(kk * 16, cb * 64), K_BLOCK, ATOM), kk > 0);
                wgmma_commit();
                wgmma_wait<0>();
                wgmma_pin(dQ);
                // rows of dQ_i are queries here: warp w of the group holds rows 16w + g (+8) of the block
#pragma unroll
                for (int nn = 0; nn < 8; ++nn)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        *reinterpret_cast<float2*>(s_dQ + (rb * 64 + 16 * (warp % 4) + g + 8 * h) * DQ_PITCH + cb * 64
                                                   + nn * 8 + 2 * t) =
                            make_float2(scale * dQ[nn][2 * h], scale * dQ[nn][2 * h + 1]);
            }
            wgmma_wait<0>();                               // dV_j, dK_j are done with P^T, dS^T too
            wgmma_pin(dV);
            wgmma_pin(dK);
            wgmma_pin_a(Pf);
            wgmma_pin_a(dSf);
            fence_proxy_async();
            // tile j adds the term of dQ_i of its rank among the K/V tiles Q tile i visits: every one before
            // it reaches it too (the counter p.dq_turns[w T_r + i], found where it is used)
            if (ordered && ctid == 0)
                wait_turn(p.dq_turns + (w * T_r + i), kv_visits<B_R, B_C>(mask, tiles, i).rank(j));
            named_barrier_sync(DQ_WRITTEN, CONSUMERS * WG_THREADS);   // s_dQ holds dQ_i

            // dQ_i into the workspace: a bulk add per row (rows of 16-byte multiples), else float atomics;
            // a row that saw no key (lse = +inf) adds nothing, not even 0 · NaN of a masked key
            const int rows = min(B_R, Nq - q0);
            if (D % 4 == 0) {
                if (ctid < rows && st[ctid] != POS_INF)
                    bulk_reduce_add_f32(dq_acc + (i64)(q0 + ctid) * D, s_dQ + ctid * DQ_PITCH, D * 4);
            } else {
                for (int e = ctid; e < rows * D; e += CONSUMERS * WG_THREADS)
                    if (st[e / D] != POS_INF)
                        atomicAdd(dq_acc + (i64)(q0 + e / D) * D + e % D, s_dQ[(e / D) * DQ_PITCH + e % D]);
            }   // s_dQ is rewritten only after the next step's first barrier
            if (ordered) {
                if (D % 4 == 0 && ctid < rows) {
                    bulk_wait();
                    fence_proxy_async_global();
                }
                named_barrier_sync(ADDS_LANDED, CONSUMERS * WG_THREADS);   // every add of dQ_i has landed
                if (ctid == 0) end_turn(p.dq_turns + (w * T_r + i));
            }
            mbar_arrive(&q_empty[s]);                     // Q_i, dO_i, statistics and dS^T are free
        }

        if (ctid < B_R) bulk_wait();                       // every bulk add of this thread has landed

        // dK_j, dV_j from registers to HBM; sums over the batch entries that share a K/V head in rank order
        if (ordered && kv_atomic) {
            if (ctid == 0) wait_kv_turns(p, sq, j, T_c);
            named_barrier_sync(ADDS_LANDED, CONSUMERS * WG_THREADS);
        }
        store_dkv_rows(p, sq, dK, dV, key0, 0, scale);
        if (ordered && kv_atomic) {
            named_barrier_sync(ADDS_LANDED, CONSUMERS * WG_THREADS);
            if (ctid == 0) end_kv_turns(p, sq, j, T_c);
        }
    }
}

#ifdef FLASH_USER_MASK
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_map(const BwdParams p) { tile_map_states<B_R, B_C>(p); }
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_lists(const BwdParams p) { tile_map_lists(p); }
#endif
