// flash_bwd_sm90_wide.cu — the Hopper backward for the wide heads, 128 < D <= 256 (float16,
// bfloat16, sm_90a): flash_bwd_sm90.cu's products and loop order with the work of a K/V tile split
// between the consumers by matrix instead of by keys.
//
// flash_bwd_sm90.cu gives each consumer warpgroup 64 keys of its own and keeps both dK_j and dV_j
// of them in registers, D floats a thread: past the register file above D = 128. Here the two
// consumers share one tile of B_C = 64 keys and each holds one (64, DP) accumulator, DP/2 floats a
// thread, as FlashAttention-3 (Shah et al., 2024) splits its D = 256 backward over two warpgroups:
//
//   producer    warpgroup 0: K_j, V_j once, then Q_i, dO_i and the row statistics into a ring of
//               STAGES buffers (two at DP = 192, one at DP = 256, where two do not fit), and the
//               non-finite scans of the causal diagonal (bwd_sm90.cuh);
//   consumer 0  S_ij^T  = K_j Q_i^T,  P_ij^T = exp2(S_ij^T scale log2 e - lse_i log2 e) -> s_P (float32),
//               dV_j += P_ij^T dO_i      (P^T from registers, dO_i N-major)
//   consumer 1  dP_ij^T = V_j dO_i^T, dS_ij^T = P_ij^T o (dP_ij^T - D_i) (P^T from s_P; with a softcap
//               s_P holds P^T o ds'/ds) -> s_dS,
//               dK_j += dS_ij^T Q_i      (dS^T from registers, Q_i N-major; scale at the end)
//   both        dQ_i = scale dS_ij K_j in (64, 64) blocks, taking turns, staged in float32 in s_dQ and
//               added a row at a time into the float32 workspace by the copy engine
//               (cp.reduce.async.bulk); in grid order when deterministic (layout.cuh).
//
// Both consumers have keys on the accumulator rows, warp w of each the keys 16w .. 16w+15 and the
// same queries per lane, so thread t of consumer 1 reads from s_P exactly the P^T values thread t
// of consumer 0 wrote (in float32: dS is formed from the unrounded P, as in flash_bwd_sm90.cu).
// A consumer is done with stage s once its dV_j (dK_j) products have landed, before the dQ blocks:
// the producer refills the stage under them.
//
// Shared memory (128-byte swizzle, sm90.cuh), after 1024-byte alignment:
//   s_K, s_V  (B_C, DP)               K_j, V_j
//   s_Q, s_dO (STAGES, B_R, DP)       Q_i, dO_i ring
//   s_dS      (B_C, B_R)              dS^T, rows = keys: the A operand (M-major) of dQ_i += dS_ij K_j
//   s_P       (B_R / 8, 128) float4   P^T in consumer 0's accumulator layout, one float4 per (n-tile, thread)
//   s_dQ      (B_R, DP + 4) float     scale dS_ij K_j, for the bulk add
//   s_stat    (STAGES, 2, B_R) acc_t  lse_i log2 e, D_i
//   bars      (1 + 2 STAGES) u64      K/V full; Q full, Q empty per stage
//
// Per step the consumers meet three times (named barriers over both): P^T is in s_P (consumer 0
// arrives, consumer 1 waits); dS^T is in s_dS and the previous bulk adds have read s_dQ; s_dQ holds
// dQ_i. Ordered (deterministic) adds meet a fourth time, once the bulk adds have landed.

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
constexpr int CONSUMER_THREADS = CONSUMERS * WG_THREADS;
constexpr int STAGES = FLASH_Q_STAGES;
constexpr int TILE_KV = B_C * DP, TILE_Q = B_R * DP, TILE_DS = B_C * B_R;   // elements
constexpr int DQ_PITCH = DP + 4;                   // floats: rows 16 bytes apart in banks
constexpr int N_BARRIERS = 1 + 2 * STAGES;
constexpr int SMEM_BYTES = (2 * TILE_KV + 2 * STAGES * TILE_Q + TILE_DS) * (int)sizeof(elem_t)
                           + TILE_DS * (int)sizeof(float) + B_R * DQ_PITCH * (int)sizeof(float)
                           + STAGES * 2 * B_R * (int)sizeof(acc_t) + N_BARRIERS * 8 + SW_ATOM_BYTES;
// setmaxnreg: the fewest registers to the producer, the rest to the consumers (cupyflash/_tiles.py:
// TileConfig.registers, the one place)
constexpr int PRODUCER_REGS = FLASH_PRODUCER_REGS;
constexpr int CONSUMER_REGS = FLASH_CONSUMER_REGS;

// Named barriers (0 is __syncthreads): over both consumers P^T written, dS^T written, s_dQ written,
// bulk adds landed; over one consumer (GRAD_TURN + c) its dK_j or dV_j turn; 15 is the producer's (bwd_sm90.cuh)
enum Barrier : int { P_WRITTEN = 1, DS_WRITTEN = 2, DQ_WRITTEN = 3, ADDS_LANDED = 4, GRAD_TURN = 5 };

static_assert(CONSUMERS == 2 && B_C == 64 && B_R == 64, "one producer warpgroup, two consumers sharing 64 keys");
static_assert(DP % SW_COLS == 0 && DP > 128 && DP <= 256 && (STAGES == 1 || STAGES == 2), "tile shapes");
// consumer 1 has dS = P o (dP - D) only as Pg o (dP - D) under a softcap or a score_mod: no dbias then (the
// host runs flash_bwd for dbias under a chain: _flags.FLAGS, bias_grad's excludes)
constexpr bool WRITES_DBIAS = BIAS && !CHAIN;
static_assert(PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= (1 + CONSUMERS) * (65536 / NTHREADS / 8 * 8), "register file");
static_assert(SMEM_BYTES == FLASH_SMEM_BYTES, "host and device disagree on the shared-memory layout");

// P_ij^T = exp2(S_ij^T scale log2 e - lse_i log2 e) in place of a warp's (16, B_R) S_ij^T (key rows
// key0 .., query columns q0 ..); `st` holds the tile's lse_i log2 e. MASKED: invisible pairs -> P = 0
// (a row that saw no key has lse = inf: P = 0 too)
// With modifiers (score_mod.cuh) the exponent takes the modified score in the modifiers' units
// (RawMods); Pg gets
// P_ij^T o ds'/ds of the softcap, the factor dS_ij^T = Pg o (dP_ij^T - D_i) needs. A bias's and a boolean
// mask's pairs come from `pairs`, loaded under K_j Q_i^T (score_mod.cuh: PairsOfTile).
template <bool MASKED, typename Ahead>
__device__ __forceinline__ void probabilities(acc_t (&S)[B_R / 8][4], acc_t (&Pg)[CHAIN ? B_R / 8 : 1][4],
                                              const acc_t* st, const Mask& mask, const EntryMods& mods,
                                              const Ahead& pairs, int q0, int key0, acc_t scale) {
    const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const RawMods raw(mods, scale);
    const acc_t unit_log2 = (SCORE_MODS ? raw.unit : scale) * (acc_t)LOG2E;
    acc_t base[2];
    raw_base<true>(base, raw.entry.off, key0, q0);
#pragma unroll
    for (int nn = 0; nn < B_R / 8; ++nn) {
        const int qc = nn * 8 + 2 * t;   // query columns qc, qc + 1 of the tile
        const float2 lse = *reinterpret_cast<const float2*>(st + qc);
        const acc_t neg_lse[2] = {-lse.x, -lse.y};
        acc_t grad[4];
        if (SCORE_MODS && mods.modifies()) modify_raw_quad<true, true>(S[nn], grad, raw, base, key0, q0, nn, pairs);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            S[nn][e] = (MASKED && !mask.visible(q0 + qc + e % 2, key0 + g + (e / 2) * 8))
                           ? (acc_t)0
                           : exp2_acc(fmaf(S[nn][e], unit_log2, neg_lse[e % 2]));
            if constexpr (CHAIN) Pg[nn][e] = S[nn][e] * grad[e];
        }
    }
}

// G (64, DP) += A (64, B_R) B_i (B_R, DP) of a consumer, issued (not waited for): A = P^T or dS^T as
// A fragments, 16 queries at a time, B_i = dO_i or Q_i (N-major)
__device__ __forceinline__ void issue_grad(acc_t (&G)[DP / 8][4], const unsigned (&A)[B_R / 16][4],
                                           const elem_t* s_B) {
    wgmma_fence();
    wgmma_rs_tile<DP, B_R / 16>(G, A, s_B);
    wgmma_commit();
}

// S (64, B_R) = A_j B_i^T of a consumer, waited for: K_j Q_i^T or V_j dO_i^T (both K-major); `under()` runs
// while the product is in flight
template <typename Under>
__device__ __forceinline__ void scores(acc_t (&S)[B_R / 8][4], const elem_t* s_A, const elem_t* s_B, Under under) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk)
        Wgmma<B_R>::ss(S, sw128_desc(s_A + sw128_offset<B_C>(0, kk * 16), 16, SW_ATOM_BYTES),
                       sw128_desc(s_B + sw128_offset<B_R>(0, kk * 16), 16, SW_ATOM_BYTES), kk > 0);
    wgmma_commit();
    under();
    wgmma_wait<0>();
    wgmma_pin(S);
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) flash_bwd_sm90_wide(const BwdParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned misalign = smem_addr(smem) % SW_ATOM_BYTES;
    elem_t* s_K = reinterpret_cast<elem_t*>(smem + (misalign ? SW_ATOM_BYTES - misalign : 0));   // (B_C, DP)
    elem_t* s_V = s_K + TILE_KV;                                          // (B_C, DP)
    elem_t* s_Q = s_V + TILE_KV;                                          // (STAGES, B_R, DP)
    elem_t* s_dO = s_Q + STAGES * TILE_Q;                                 // (STAGES, B_R, DP)
    elem_t* s_dS = s_dO + STAGES * TILE_Q;                                // (B_C, B_R)
    float4* s_P = reinterpret_cast<float4*>(s_dS + TILE_DS);              // (B_R / 8, WG_THREADS)
    float* s_dQ = reinterpret_cast<float*>(s_P + TILE_DS / 4);            // (B_R, DQ_PITCH)
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
    init_ring<STAGES>(ring, CONSUMER_THREADS);

    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        produce_bwd<B_R, B_C, DP, STAGES>(p, ring, w, sq, j, visits, tid);
        return;
    }

    // consumers: c = 0 forms P^T and dV_j, c = 1 dS^T and dK_j
    setmaxnreg_inc<CONSUMER_REGS>();
    const int c = wg - 1;
    const int ctid = tid - WG_THREADS, wtid = ctid % WG_THREADS;   // thread among the consumers, in its warpgroup
    const int warp = wtid / WARP_SIZE, lane = tid % WARP_SIZE;     // warp in its warpgroup
    const int g = lane / 4, t = lane % 4;
    const int key0 = kv0 + 16 * warp;                  // first key row of this warp
    acc_t* dq_acc = sq.q_rows(p.dq_acc);
    constexpr unsigned K_BLOCK = B_C * SW_COLS * sizeof(elem_t);
    const acc_t scale = (acc_t)p.scale;
    EntryMods mods = mods_of(p, sq);
    acc_t G[DP / 8][4];                                // dV_j (c = 0) or dK_j (c = 1), (16, DP) per warp
    zero_frag(G);

    mbar_wait(kv_full, 0);
    fence_proxy_async();
    for (int n = 0; n < steps; ++n) {
        const int s = n % STAGES, i = visits.tile(visits.begin + n), q0 = i * B_R;
        mods.user_all = visits.all(visits.begin + n);
        const elem_t* s_Qs = s_Q + s * TILE_Q;
        const elem_t* s_dOs = s_dO + s * TILE_Q;
        const acc_t* st = s_stat + s * 2 * B_R;      // lse_i log2 e, D_i of the tile's rows
        mbar_wait(&q_full[s], (n / STAGES) & 1);
        fence_proxy_async();

        acc_t X[B_R / 8][4];                           // S_ij^T -> P_ij^T (c = 0), dP_ij^T -> dS_ij^T (c = 1)
        unsigned A[B_R / 16][4];                       // P^T or dS^T as A fragments
        if (c == 0) {
            PairsOfTile<B_R / 8, true> pairs;           // a bias's and a mask's pairs of S_ij^T
            scores(X, s_K, s_Qs, [&] { pairs.load(mods, key0, q0); });
            // A tile whose pairs are all visible (most of them) takes the path without the mask
            acc_t Pg[CHAIN ? B_R / 8 : 1][4];           // P^T o ds'/ds of the softcap and score_mod
            if (mask.full(q0, B_R, key0, 16)) probabilities<false>(X, Pg, st, mask, mods, pairs, q0, key0, scale);
            else                         probabilities<true>(X, Pg, st, mask, mods, pairs, q0, key0, scale);
            // dropout: a dropped pair's W goes to consumer 1 negated (W >= 0; its sign bit is the keep
            // bit), and dV_j takes Z o P^T
#pragma unroll
            for (int nn = 0; nn < B_R / 8; ++nn) {
                const acc_t (&W)[4] = CHAIN ? Pg[CHAIN ? nn : 0] : X[nn];   // what dS_ij^T multiplies
                const unsigned keep = DROPOUT ? keep_bits<true>(mods, key0, q0, nn) : 15u;
                auto sent = [&](int e) { return (keep >> e & 1) ? W[e] : -W[e]; };
                s_P[nn * WG_THREADS + wtid] = make_float4(sent(0), sent(1), sent(2), sent(3));
#pragma unroll
                for (int e = 0; e < 4; ++e) X[nn][e] *= keep_factor(mods, keep, e);
            }
            named_barrier_arrive(P_WRITTEN, CONSUMER_THREADS);
            frag_to_a(A, X);
            issue_grad(G, A, s_dOs);                   // dV_j += (Z o P_ij)^T dO_i
        } else {
            scores(X, s_V, s_dOs, [] {});
            named_barrier_sync(P_WRITTEN, CONSUMER_THREADS);
            // dS^T = W o (Z o dP^T - D_i), Z = 1 / (1 - p) or 0 from W's sign under dropout, else 1
            auto ds = [&](acc_t W, acc_t dp, acc_t D_i) {
                if constexpr (DROPOUT) return fabsf(W) * ((signbit(W) ? (acc_t)0 : mods.keep_scale) * dp - D_i);
                return W * (dp - D_i);
            };
#pragma unroll
            for (int nn = 0; nn < B_R / 8; ++nn) {
                const float4 P = s_P[nn * WG_THREADS + wtid];
                const float2 Dv = *reinterpret_cast<const float2*>(st + B_R + nn * 8 + 2 * t);
                X[nn][0] = ds(P.x, X[nn][0], Dv.x);
                X[nn][1] = ds(P.y, X[nn][1], Dv.y);
                X[nn][2] = ds(P.z, X[nn][2], Dv.x);
                X[nn][3] = ds(P.w, X[nn][3], Dv.y);
                if constexpr (WRITES_DBIAS)   // dS^T is d loss / d final score here
                    add_dbias_quad<true>(X[nn], mods, mask, key0, q0, nn);
            }
            frag_to_a(A, X);
            issue_grad(G, A, s_Qs);                    // dK_j += dS_ij^T Q_i (scaled at the end)
            // dS^T into shared memory under the products
#pragma unroll
            for (int kk = 0; kk < B_R / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r)   // A fragment register r: row g + 8 (r % 2), columns 16kk + 8 (r / 2) + 2t
                    *reinterpret_cast<unsigned*>(s_dS + sw128_offset<B_C>(16 * warp + g + 8 * (r % 2),
                                                                          kk * 16 + 8 * (r / 2) + 2 * t)) = A[kk][r];
            fence_proxy_async();
        }
        // a row that saw no key (lse = +inf) adds nothing to dQ, not even 0 · NaN of a masked key:
        // read before the stage is handed back
        const int row = ctid % B_R;
        const bool row_adds = q0 + row < Nq && st[row] != POS_INF;
        wgmma_wait<0>();
        wgmma_pin(G);
        wgmma_pin_a(A);
        mbar_arrive(&q_empty[s]);                      // this consumer is done with Q_i, dO_i, the statistics
        if (ctid < B_R) bulk_wait_read();              // the last bulk adds are done with s_dQ
        named_barrier_sync(DS_WRITTEN, CONSUMER_THREADS);   // all of dS^T is written, s_dQ is free

        // dQ_i = scale dS_ij K_j, one (64, 64) block per turn, into s_dQ
#pragma unroll
        for (int cb = 0; cb < DP / 64; ++cb) {
            if ((cb + n) % CONSUMERS != c) continue;
            acc_t dQ[8][4];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < B_C / 16; ++kk)
                Wgmma<64>::ss<1, 1>(dQ, sw128_desc(s_dS + sw128_offset<B_C>(kk * 16, 0), TILE_DS * 2, SW_ATOM_BYTES),
                                    sw128_desc(s_K + sw128_offset<B_C>(kk * 16, cb * 64), K_BLOCK, SW_ATOM_BYTES),
                                    kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_pin(dQ);
            // rows of dQ_i are queries here: warp w holds rows 16w + g (+8) of the block
#pragma unroll
            for (int nn = 0; nn < 8; ++nn)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    *reinterpret_cast<float2*>(s_dQ + (16 * warp + g + 8 * h) * DQ_PITCH + cb * 64 + nn * 8 + 2 * t) =
                        make_float2(scale * dQ[nn][2 * h], scale * dQ[nn][2 * h + 1]);
        }
        fence_proxy_async();
        // tile j adds the term of dQ_i of its rank among the K/V tiles Q tile i visits: every one before it
        // reaches it too (the counter p.dq_turns[w T_r + i], found where it is used)
        if (ordered && ctid == 0) wait_turn(p.dq_turns + (w * T_r + i), kv_visits<B_R, B_C>(mask, tiles, i).rank(j));
        named_barrier_sync(DQ_WRITTEN, CONSUMER_THREADS);   // s_dQ holds dQ_i

        // dQ_i into the workspace: a bulk add per row (rows of 16-byte multiples), else float atomics
        if (D % 4 == 0) {
            if (ctid < B_R && row_adds) bulk_reduce_add_f32(dq_acc + (i64)(q0 + row) * D, s_dQ + row * DQ_PITCH, D * 4);
        } else if (row_adds) {
            for (int col = ctid / B_R; col < D; col += CONSUMER_THREADS / B_R)
                atomicAdd(dq_acc + (i64)(q0 + row) * D + col, s_dQ[row * DQ_PITCH + col]);
        }   // s_dQ is rewritten only after the next step's second barrier
        if (ordered) {
            if (D % 4 == 0 && ctid < B_R && row_adds) {
                bulk_wait();
                fence_proxy_async_global();
            }
            named_barrier_sync(ADDS_LANDED, CONSUMER_THREADS);   // every add of dQ_i has landed
            if (ctid == 0) end_turn(p.dq_turns + (w * T_r + i));
        }
    }
    if (ctid < B_R) bulk_wait();                       // every bulk add of this thread has landed

    // dV_j (c = 0), dK_j (c = 1) from registers to HBM; sums over the batch entries that share a K/V
    // head in rank order (the counter found again to hand the turn on, not kept beside G)
    if (ordered && kv_atomic) {
        if (wtid == 0) {
            const KvTurns turns = kv_turns(p, sq, j, T_c);
            wait_turn(c == 0 ? turns.dv : turns.dk, c == 0 ? turns.dv_rank : turns.dk_rank);
        }
        named_barrier_sync(GRAD_TURN + c, WG_THREADS);
    }
    if (c == 0) store_kv_grad_rows(p, p.dv, p.dv_acc, sq, G, key0, (acc_t)1);
    else        store_kv_grad_rows(p, p.dk, p.dk_acc, sq, G, key0, scale);
    if (ordered && kv_atomic) {
        named_barrier_sync(GRAD_TURN + c, WG_THREADS);
        if (wtid == 0) end_turn(c == 0 ? kv_turns(p, sq, j, T_c).dv : kv_turns(p, sq, j, T_c).dk);
    }
}

#ifdef FLASH_USER_MASK
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_map(const BwdParams p) { tile_map_states<B_R, B_C>(p); }
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_lists(const BwdParams p) { tile_map_lists(p); }
#endif
