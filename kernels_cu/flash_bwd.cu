// flash_bwd.cu — the recomputation backward: P is recomputed from the saved statistics instead of
// stored (FlashAttention's backward, Algorithm 4 of the V1 paper), in FlashAttention-2's loop order
// (Algorithm 2 of the V2 paper: K/V tiles outer, dK_j and dV_j on chip, dQ_i added into HBM).
// flash_bwd_prep.cu runs before it (D_i and the statistics it reads) and flash_convert after it.
//
//   flash_bwd           one CTA per (batch*head, K/V tile j, head-dim chunk):
//                       K_j, V_j stay in SRAM, dK_j, dV_j accumulate in
//                       registers, the CTA walks the Q tiles i:
//                           S_ij^T  = K_j Q_i^T   (scaled, modified: score_mod.cuh)
//                           P_ij^T  = exp(S_ij^T - m_i) / l_i
//                           dV_j   += P_ij^T dO_i
//                           dP_ij^T = V_j dO_i^T
//                           dS_ij^T = P_ij^T o (dP_ij^T - D_i)   (o ds'/ds, softcap)
//                           dK_j   += scale dS_ij^T Q_i
//                           dQ_i   += scale dS_ij K_j   (float atomics into a workspace;
//                                                        in grid order when deterministic)
//                       Keys sit on the accumulator rows (each warp owns 16 keys),
//                       so P^T and dS^T come out of the products in the layout
//                       their next product reads. A head-dim chunk (DC columns of
//                       dK, dV, dQ) per CTA bounds registers for large head dims;
//                       S and dP are recomputed per chunk. Causal, the operands of
//                       diagonal tile pairs are scanned for inf and NaN, and the
//                       dQ, dK, dV tiles they may reach flagged for flash_repair.cu.
//
// Shared memory (elem_t unless noted, rows padded by PAD):
//   s_K (B_C, DP), s_V (B_C, DP), s_Q (B_R, DP), s_dO (B_R, DP),
//   s_dS (B_C, B_R)   P^T then dS^T,
//   s_m, s_inv_l, s_D (B_R) acc_t.

#include "copy.cuh"
#include "epilogue.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"
#include "nonfinite.cuh"
#include "params.cuh"
#include "score_mod.cuh"
#include "softmax.cuh"
#include "tile_map.cuh"

constexpr int DP = FLASH_DP;
constexpr int B_R = FLASH_BR;
constexpr int B_C = FLASH_BC;
constexpr int DC = FLASH_DC;
constexpr int NWARPS = FLASH_WARPS;
constexpr int NTHREADS = NWARPS * WARP_SIZE;
constexpr int QKV_PITCH = DP + PAD;
constexpr int DS_PITCH = B_R + PAD;
constexpr int SMEM_BYTES = ((2 * B_C + 2 * B_R) * QKV_PITCH + B_C * DS_PITCH) * (int)sizeof(elem_t)
                           + 3 * B_R * (int)sizeof(acc_t);

// the dQ_i (B_R, DC) product is split over the warps: DQ_WM along rows, DQ_WN along columns
constexpr int DQ_WM = B_R / 16;
constexpr int DQ_WN = NWARPS / DQ_WM;
constexpr int DQ_NT = DC / 8 / DQ_WN;

static_assert(B_C == 16 * NWARPS, "each warp owns 16 key rows of a K/V tile");
static_assert(NWARPS % DQ_WM == 0 && DQ_NT * 8 * DQ_WN == DC && DQ_NT % 2 == 0, "dQ warp split");
static_assert(DP % DC == 0 && B_R % 16 == 0, "tile shapes");
static_assert(SMEM_BYTES == FLASH_SMEM_BYTES, "host and device disagree on the shared-memory layout");

// P_ij^T = exp(S_ij^T - m_i) / l_i in place of a warp's (16, B_R) raw Q_i K_j^T products (key rows key0 ..,
// query columns q0 ..): S = scale Q K^T, modified where modifiers apply (G: each element's ds'/ds, the
// softcap's), the difference in natural units as in the forward; MASKED: invisible pairs -> 0
template <bool MASKED>
__device__ __forceinline__ void probabilities(acc_t (&P)[B_R / 8][4], acc_t (&G)[CHAIN ? B_R / 8 : 1][4],
                                              const EntryMods& mods, const Mask& mask, int q0, int key0,
                                              const acc_t* s_m, const acc_t* s_inv_l, acc_t scale) {
    const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const bool modify = SCORE_MODS && mods.modifies();
    if (modify) {
        scale_scores(P, scale);
        modify_scores<true, CHAIN>(P, G, mods, key0, q0);
    }
#pragma unroll
    for (int n = 0; n < B_R / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int qc = n * 8 + 2 * t + e % 2;    // query column inside the tile
            const acc_t S_e = modify ? P[n][e] : P[n][e] * scale;
            P[n][e] = (MASKED && !mask.visible(q0 + qc, key0 + g + (e / 2) * 8))
                          ? (acc_t)0
                          : exp2_acc((S_e - s_m[qc]) * (acc_t)LOG2E) * s_inv_l[qc];
        }
}

// CTAs per SM whose registers ptxas must leave room for (cupyflash/_tiles.py: TileConfig.min_ctas), where set
#ifdef FLASH_MIN_CTAS
#define BWD_LAUNCH_BOUNDS __launch_bounds__(NTHREADS, FLASH_MIN_CTAS)
#else
#define BWD_LAUNCH_BOUNDS __launch_bounds__(NTHREADS)
#endif

extern "C" __global__ void BWD_LAUNCH_BOUNDS flash_bwd(const BwdParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* s_K = reinterpret_cast<elem_t*>(smem);   // (B_C, DP)
    elem_t* s_V = s_K + B_C * QKV_PITCH;               // (B_C, DP)
    elem_t* s_Q = s_V + B_C * QKV_PITCH;               // (B_R, DP)
    elem_t* s_dO = s_Q + B_R * QKV_PITCH;              // (B_R, DP)
    elem_t* s_dS = s_dO + B_R * QKV_PITCH;             // (B_C, B_R)
    acc_t* s_m = reinterpret_cast<acc_t*>(s_dS + B_C * DS_PITCH);   // (B_R)
    acc_t* s_inv_l = s_m + B_R;                        // (B_R)
    acc_t* s_D = s_inv_l + B_R;                        // (B_R)

    const int D = p.D;
    const bool vec = p.vec != 0, kv_atomic = p.kv_atomic != 0;
    const bool ordered = SWITCH_ON(ORDERED, p.uses);   // deterministic: the sums in grid order
    const acc_t scale = (acc_t)p.scale;
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int T_c = (p.mask.Nk + B_C - 1) / B_C, T_r = (p.mask.Nq + B_R - 1) / B_R;   // the grid's tiles per head
    const int n_chunks = (D + DC - 1) / DC;
    const GridTile at = grid_tile(T_c * n_chunks, p.head_group);
    const i64 w = at.bh;
    const int j = at.tile / n_chunks;                       // the most Q tiles first when causal
    const int c0 = (at.tile % n_chunks) * DC;               // head-dim chunk of dK, dV, dQ
    const int kv0 = j * B_C;

    const Seq sq = seq_of(p, w);
    const Mask& mask = mask_of(p, sq);
    const int Nq = mask.Nq, Nk = mask.Nk;
    if (kv0 >= Nk) return;                                  // past a shorter sequence's keys
    const elem_t* q = sq.q_rows(p.q);
    const elem_t* k = sq.k_rows(p.k);
    const elem_t* v = sq.k_rows(p.v);
    const elem_t* dO = sq.q_rows(p.dO);
    const i64 q_sn = p.q.sn, k_sn = p.k.sn, v_sn = p.v.sn, do_sn = p.dO.sn;
    acc_t* dq_acc = sq.q_rows(p.dq_acc);
    const acc_t* m_b = p.m_b + sq.row0;
    const acc_t* inv_l = p.inv_l + sq.row0;
    const acc_t* Dsum = p.Dsum + sq.row0;
    EntryMods mods = mods_of(p, sq);
    const TileHead tiles = tiles_of(p, sq);

    // load K_j, V_j from HBM into SRAM
    load_tile<B_C, DP>(s_K, k + kv0 * k_sn, k_sn, min(B_C, Nk - kv0), D, vec, tid, NTHREADS);
    load_tile<B_C, DP>(s_V, v + kv0 * v_sn, v_sn, min(B_C, Nk - kv0), D, vec, tid, NTHREADS);
    // 3xTF32 splits K_j, V_j, Q_i, dO_i without guards where all are finite and below 2^127 (Split;
    // P and dS are not checked); each thread checks what it copied, the CTA votes at each step's barrier
    const bool kv_plain = own_copies_plain<B_C, DP>(s_K, vec, tid, NTHREADS) && own_copies_plain<B_C, DP>(s_V, vec, tid, NTHREADS);

    const int key0 = kv0 + 16 * warp;                  // first key row of this warp
    elem_t* s_dSw = s_dS + 16 * warp * DS_PITCH;       // (16, B_R) this warp's rows of P^T / dS^T
    acc_t dK[DC / 8][4], dV[DC / 8][4];
    zero_frag(dK);
    zero_frag(dV);

    const Visits visits = q_visits<B_R, B_C>(mask, tiles, j);   // the Q tiles that visit K_j (the band's or the tile map's)
    // Where a tile pair with masked pairs has an operand with an inf or NaN, its products may spread it
    // to them (nonfinite.cuh): flag dQ_i and dK_j, dV_j for the repair. This thread's share of K_j,
    // V_j at the first step, of Q_i, dO_i, D_i at each.
    auto flag_pair = [&](int i) {
        p.dq_flags[w * T_r + i] = 1u;
        p.kv_flags[w * T_c + j] = 1u;
    };
    for (int pos = visits.begin; pos < visits.end; ++pos) {
        const int i = visits.tile(pos), q0 = i * B_R;
        mods.user_all = visits.all(pos);
        // load Q_i, dO_i, m_i, l_i, D_i from HBM into SRAM
        __syncthreads();
        load_tile<B_R, DP>(s_Q, q + q0 * q_sn, q_sn, min(B_R, Nq - q0), D, vec, tid, NTHREADS);
        load_tile<B_R, DP>(s_dO, dO + q0 * do_sn, do_sn, min(B_R, Nq - q0), D, vec, tid, NTHREADS);
        for (int r = tid; r < B_R; r += NTHREADS) {
            const bool in = q0 + r < Nq;
            s_m[r] = in ? m_b[q0 + r] : POS_INF;       // a ragged row gets P = 0
            s_inv_l[r] = in ? inv_l[q0 + r] : (acc_t)0;
            s_D[r] = in ? Dsum[q0 + r] : (acc_t)0;
        }
        const bool plain = sync_all_plain(kv_plain && own_copies_plain<B_R, DP>(s_Q, vec, tid, NTHREADS)
                                          && own_copies_plain<B_R, DP>(s_dO, vec, tid, NTHREADS));
        if (may_hide_any(mask) && pos == visits.begin
            && (rows_nonfinite(s_K, B_C, DP, QKV_PITCH, tid, NTHREADS)
                || rows_nonfinite(s_V, B_C, DP, QKV_PITCH, tid, NTHREADS)))
            for (int u = visits.begin; u < visits.end; ++u)
                if (may_hide(mask, visits.tile(u) * B_R, B_R, kv0, B_C, visits.all(u))) flag_pair(visits.tile(u));
        if (may_hide(mask, q0, B_R, kv0, B_C, mods.user_all)
            && (rows_nonfinite(s_Q, B_R, DP, QKV_PITCH, tid, NTHREADS)
                || rows_nonfinite(s_dO, B_R, DP, QKV_PITCH, tid, NTHREADS) || values_nonfinite(s_D, B_R, tid, NTHREADS)))
            flag_pair(i);

        // S_ij^T = K_j Q_i^T                                               (16, B_R)
        acc_t P[B_R / 8][4];
        zero_frag(P);
        if (plain) warp_mma<B_R / 8, DP, false, false, PLAIN>(P, s_K + 16 * warp * QKV_PITCH, QKV_PITCH, s_Q, QKV_PITCH);
        else       warp_mma<B_R / 8, DP, false, false>(P, s_K + 16 * warp * QKV_PITCH, QKV_PITCH, s_Q, QKV_PITCH);

        // P_ij^T = exp(S_ij^T - m_i) / l_i; a tile whose pairs are all visible (most of them) takes
        // the path without the mask
        acc_t G[CHAIN ? B_R / 8 : 1][4];                  // ds'/ds: the softcap's, score_mod's
        if (mask.full(q0, B_R, key0, 16)) probabilities<false>(P, G, mods, mask, q0, key0, s_m, s_inv_l, scale);
        else                         probabilities<true>(P, G, mods, mask, q0, key0, s_m, s_inv_l, scale);
        unsigned keep[DROPOUT ? B_R / 8 : 1] = {};        // dropout's keep bits (keep_bits)
        if constexpr (DROPOUT) {
            acc_t Pz[B_R / 8][4];                         // Z o P_ij^T, what dV_j takes
#pragma unroll
            for (int n = 0; n < B_R / 8; ++n) {
                keep[n] = keep_bits<true>(mods, key0, q0, n);
#pragma unroll
                for (int e = 0; e < 4; ++e) Pz[n][e] = P[n][e] * keep_factor(mods, keep[n], e);
            }
            store_frag_smem(s_dSw, DS_PITCH, Pz);
        } else {
            store_frag_smem(s_dSw, DS_PITCH, P);
        }
        __syncwarp();

        // dV_j += (Z o P_ij)^T dO_i                                        (16, DC)
        if (plain) warp_mma<DC / 8, B_R, false, true, B_PLAIN>(dV, s_dSw, DS_PITCH, s_dO + c0, QKV_PITCH);
        else       warp_mma<DC / 8, B_R, false, true>(dV, s_dSw, DS_PITCH, s_dO + c0, QKV_PITCH);

        // dP_ij^T = V_j dO_i^T                                             (16, B_R)
        acc_t dP[B_R / 8][4];
        zero_frag(dP);
        if (plain) warp_mma<B_R / 8, DP, false, false, PLAIN>(dP, s_V + 16 * warp * QKV_PITCH, QKV_PITCH, s_dO, QKV_PITCH);
        else       warp_mma<B_R / 8, DP, false, false>(dP, s_V + 16 * warp * QKV_PITCH, QKV_PITCH, s_dO, QKV_PITCH);

        // dS_ij^T = P_ij^T o (Z o dP_ij^T - D_i) (into dbias from the first head-dim chunk), by scale Q K^T:
        // o ds'/ds where a softcap applies
#pragma unroll
        for (int n = 0; n < B_R / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                P[n][e] *= keep_factor(mods, keep[DROPOUT ? n : 0], e) * dP[n][e] - s_D[n * 8 + 2 * t + e % 2];
            if (c0 == 0) add_dbias_quad<true>(P[n], mods, mask, key0, q0, n);
            if constexpr (CHAIN)
#pragma unroll
                for (int e = 0; e < 4; ++e) P[n][e] *= G[n][e];
        }
        __syncwarp();
        store_frag_smem(s_dSw, DS_PITCH, P);
        __syncwarp();

        // dK_j += dS_ij^T Q_i   (scaled at the end)                        (16, DC)
        if (plain) warp_mma<DC / 8, B_R, false, true, B_PLAIN>(dK, s_dSw, DS_PITCH, s_Q + c0, QKV_PITCH);
        else       warp_mma<DC / 8, B_R, false, true>(dK, s_dSw, DS_PITCH, s_Q + c0, QKV_PITCH);
        // tile j adds the term of dQ_i of its rank among the K/V tiles Q tile i visits: every one before it
        // reaches it too (the counter dq_turn(i), found where it is used)
        auto dq_turn = [&](int i) { return p.dq_turns + ((w * T_r + i) * n_chunks + c0 / DC); };
        if (ordered && tid == 0) wait_turn(dq_turn(i), kv_visits<B_R, B_C>(mask, tiles, i).rank(j));
        __syncthreads();   // every warp's rows of dS^T are in SRAM

        // dQ_i += scale dS_ij K_j                                          (B_R, DC) over the warps
        {
            const int wm = warp % DQ_WM, wn = warp / DQ_WM;
            const int col0 = c0 + wn * DQ_NT * 8;
            acc_t dQ[DQ_NT][4];
            zero_frag(dQ);
            if (plain) warp_mma<DQ_NT, B_C, true, true, B_PLAIN>(dQ, s_dS + wm * 16, DS_PITCH, s_K + col0, QKV_PITCH);
            else       warp_mma<DQ_NT, B_C, true, true>(dQ, s_dS + wm * 16, DS_PITCH, s_K + col0, QKV_PITCH);
#pragma unroll
            for (int n = 0; n < DQ_NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = q0 + wm * 16 + g + (e / 2) * 8, col = col0 + n * 8 + 2 * t + e % 2;
                    // a row that saw no key (1/l = 0; m = +inf may also be a seen row's) adds nothing,
                    // not even 0 · NaN of a masked key
                    if (row < Nq && col < D && s_inv_l[row - q0] != (acc_t)0)
                        atomicAdd(dq_acc + (i64)row * D + col, scale * dQ[n][e]);
                }
        }
        if (ordered) {
            __syncthreads();
            if (tid == 0) end_turn(dq_turn(i));
        }
    }

    // dK_j, dV_j from registers to HBM; sums over the batch entries that share a K/V head in rank order
    const i64 kv_tile = (i64)j * n_chunks + c0 / DC, kv_tiles = (i64)T_c * n_chunks;
    if (ordered && kv_atomic) {
        if (tid == 0) wait_kv_turns(p, sq, kv_tile, kv_tiles);
        __syncthreads();
    }
    store_dkv_rows(p, sq, dK, dV, key0, c0, scale);
    if (ordered && kv_atomic) {
        __syncthreads();
        if (tid == 0) end_kv_turns(p, sq, kv_tile, kv_tiles);
    }
}

#ifdef FLASH_USER_MASK
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_map(const BwdParams p) { tile_map_states<B_R, B_C>(p); }
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_lists(const BwdParams p) { tile_map_lists(p); }
#endif
