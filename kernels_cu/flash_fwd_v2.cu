// flash_fwd_v2.cu — FlashAttention-2 schedule of the forward, same (O, m, l) as V1.
//
// Why both: V1 (flash_fwd_v1.cu) is the paper's Algorithm 1, K/V-outer, and
// pays for it by moving Q_i and the running O_i through HBM at every outer
// step. V2 swaps the loops as FlashAttention-2 did: one CTA per (Q tile i,
// batch*head), the loop over K/V tiles j inside, and O_i, m_i, l_i kept in
// registers from the first tile to the last. O_i stays unnormalised
// (O_i = sum_j exp(S_ij - m_i) V_j) and is divided by l_i once at the end.
// K_j, V_j stream through a two-stage cp.async pipeline; for 16-bit inputs
// P~_ij goes from the score accumulators straight into the A operand of
// P~_ij V_j without touching shared memory. Causal CTAs stop at the diagonal
// and start with the heaviest Q tiles.
//
// Shared memory (elem_t, rows padded by PAD):
//   s_Q  (B_R, DP)            Q_i, warp-private row blocks (16-bit, 64 < D <= 128: read once into registers)
//   s_KV (2 stages, 2, B_C, DP)  K_j, V_j double-buffered
//   s_P  (B_R, B_C)           P~_ij, float32/float64 only (their FMA tiles read A from SRAM)

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
constexpr int NTHREADS = FLASH_WARPS * WARP_SIZE;
constexpr int QKV_PITCH = DP + PAD;
constexpr int P_PITCH = B_C + PAD;
constexpr int STAGES = 2;
constexpr int KV_STAGE = 2 * B_C * QKV_PITCH;   // elements of one stage (K_j then V_j)
constexpr int SMEM_BYTES = (B_R * QKV_PITCH + STAGES * KV_STAGE + (FLASH_TENSOR_CORES ? 0 : B_R * P_PITCH))
                           * (int)sizeof(elem_t);

// 16-bit Q_i stays in registers as A fragments for 64 < D <= 128. At D <= 64 the extra registers
// cost the second CTA per SM (measured slower, benchmarks/RESULTS.md); above 128 O_i already takes
// half the registers.
constexpr bool Q_IN_REGISTERS = FLASH_TENSOR_CORES && DP > 64 && DP <= 128;

// the TF32 products' k-steps unrolled (mma_sm80.cuh) where O_i leaves the registers for it
constexpr bool TF32_UNROLL = DP <= 192;

static_assert(B_R == 16 * FLASH_WARPS, "each warp owns 16 query rows of the Q tile");
static_assert(B_C % 16 == 0 && DP % 16 == 0, "tile shapes");
static_assert(SMEM_BYTES == FLASH_SMEM_BYTES, "host and device disagree on the shared-memory layout");

// K_j, V_j (keys kv0 ..) into pipeline stage `stage`: cp.async where the layout allows it, else plain loads
__device__ __forceinline__ void load_kv(elem_t* s_stage, const KeyRows<const elem_t>& k, const KeyRows<const elem_t>& v,
                                        int kv0, int Nk, int D, bool vec) {
    const int rows = min(B_C, Nk - kv0);
    const KeyRows<const elem_t> k_j = k.from(kv0), v_j = v.from(kv0);
    const auto k_row = [&](int r) { return k_j.row(r); };
    const auto v_row = [&](int r) { return v_j.row(r); };
    if (vec) {
        load_rows_async<B_C, DP>(s_stage, k_row, rows, D, threadIdx.x, NTHREADS);
        load_rows_async<B_C, DP>(s_stage + B_C * QKV_PITCH, v_row, rows, D, threadIdx.x, NTHREADS);
    } else {
        load_rows<B_C, DP>(s_stage, k_row, rows, D, threadIdx.x, NTHREADS);
        load_rows<B_C, DP>(s_stage + B_C * QKV_PITCH, v_row, rows, D, threadIdx.x, NTHREADS);
    }
    cp_async_commit();
}

extern "C" __global__ void __launch_bounds__(NTHREADS) flash_fwd_v2(const FwdParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* s_Q = reinterpret_cast<elem_t*>(smem);    // (B_R, DP)
    elem_t* s_KV = s_Q + B_R * QKV_PITCH;               // (STAGES, 2, B_C, DP)

    const bool vec = p.vec != 0;
    const acc_t scale = (acc_t)p.scale;
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int T_r = (p.mask.Nq + B_R - 1) / B_R;       // the grid's Q tiles per head
    const GridTile at = grid_tile_at(blockIdx.x, (unsigned)p.seqs.heads, T_r, p.head_group);
    const i64 w = at.bh;
    const Seq sq = seq_of(p, w);
    const Mask& mask = mask_of(p, sq);
    const int Nq = mask.Nq, Nk = mask.Nk, D = p.D;
    const int i = (Nq + B_R - 1) / B_R - 1 - at.tile;   // heaviest causal tiles first
    if (i < 0) return;                                  // past a shorter (packed) sequence's rows

    const elem_t* q = sq.q_rows(p.q);
    const KeyRows<const elem_t> k = k_rows_of(p, sq);   // (Nk, D), PAGED: paged
    const KeyRows<const elem_t> v = v_rows_of(p, sq);
    const i64 q_sn = p.q.sn;
    const int split = blockIdx.y;                       // split-KV: this CTA's run of the K/V tiles
    EntryMods mods = mods_of(p, sq);

    const int r0 = i * B_R + 16 * warp;                 // first query row of this warp
    // the K/V tiles this CTA visits (the band's, or those of mask_mod's tile map); position t lies in stage t % STAGES
    const Visits visits = kv_visits<B_R, B_C>(mask, tiles_of(p, sq), i).split(split, p.kv_splits);
    // the tiles among them where every pair of Q tile i is visible: no element mask, nothing to repair
    const int j_full_first = mask.full_tile_first<B_C>(i * B_R, B_R), j_full_stop = mask.full_tile_stop<B_C>(i * B_R);

    elem_t* s_Qw = s_Q + 16 * warp * QKV_PITCH;         // (16, DP) this warp's rows of Q_i
    if (visits.count() > 0)
        load_kv(s_KV + (visits.begin % STAGES) * KV_STAGE, k, v, visits.tile(visits.begin) * B_C, Nk, D, vec);
    load_tile<16, DP>(s_Qw, q + r0 * q_sn, q_sn, max(0, min(16, Nq - r0)), D, vec, lane, WARP_SIZE);

#if FLASH_TENSOR_CORES
    unsigned Q_frag[Q_IN_REGISTERS ? DP / 16 : 1][4];   // Q_i as A fragments: S_ij then reads only K_j from SRAM
    if (Q_IN_REGISTERS) {
        __syncwarp();
        load_a_frags<Q_IN_REGISTERS ? DP : 16>(Q_frag, s_Qw, QKV_PITCH);
    }
#endif
    // 3xTF32 splits Q_i, K_j, V_j without guards where all are finite and below 2^127 (Split);
    // each thread checks what it copied, the CTA votes at each tile's barrier
    const bool q_plain = own_copies_plain<16, DP>(s_Qw, vec, lane, WARP_SIZE);
    acc_t O[DP / 8][4];                                 // (16, DP) unnormalised O_i
    zero_frag(O);
    acc_t m_i[2] = {NEG_INF, NEG_INF}, l_i[2] = {(acc_t)0, (acc_t)0};

    for (int t = visits.begin; t < visits.end; ++t) {
        const int j = visits.tile(t), kv0 = j * B_C;
        elem_t* s_K = s_KV + (t % STAGES) * KV_STAGE;   // (B_C, DP)
        elem_t* s_V = s_K + B_C * QKV_PITCH;            // (B_C, DP)
        // prefetch the next visit's K, V into the other stage, then wait for K_j, V_j
        if (t + 1 < visits.end) {
            load_kv(s_KV + ((t + 1) % STAGES) * KV_STAGE, k, v, visits.tile(t + 1) * B_C, Nk, D, vec);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        mods.user_all = visits.all(t);
        const bool edge = j < j_full_first || j >= j_full_stop;   // Q tile i x K_j has masked or ragged pairs
        const bool plain = sync_all_plain(q_plain && own_copies_plain<B_C, DP>(s_K, vec, tid, NTHREADS)
                                          && own_copies_plain<B_C, DP>(s_V, vec, tid, NTHREADS));
        // where Q tile i may have masked pairs in tile j and V_j holds an inf or NaN, P~_ij V_j may spread
        // it to them (nonfinite.cuh): flag the tile for the repair (flags exist where some pair is masked)
        if ((mods.hides() || edge && mask.banded()) && rows_nonfinite(s_V, B_C, DP, QKV_PITCH, tid, NTHREADS))
            p.repair_flags[w * T_r + i] = 1u;

        // S_ij = scale Q_i K_j^T, then its modifiers (score_mod.cuh)        (16, B_C)
        acc_t S[B_C / 8][4];
        zero_frag(S);
#if FLASH_TENSOR_CORES
        if (Q_IN_REGISTERS) warp_mma_ra<B_C / 8, Q_IN_REGISTERS ? DP : 16, false>(S, Q_frag, s_K, QKV_PITCH);
        else                warp_mma<B_C / 8, DP, false, false>(S, s_Qw, QKV_PITCH, s_K, QKV_PITCH);
#else
        if (plain) warp_mma<B_C / 8, DP, false, false, PLAIN, TF32_UNROLL>(S, s_Qw, QKV_PITCH, s_K, QKV_PITCH);
        else       warp_mma<B_C / 8, DP, false, false, GUARDED, TF32_UNROLL>(S, s_Qw, QKV_PITCH, s_K, QKV_PITCH);
#endif
        scale_scores(S, scale);
        if (SCORE_MODS && mods.modifies()) modify_scores(S, mods, r0, kv0);
        if (edge) mask_scores(S, mask, r0, kv0);

        // m_i^new = max(m_i, rowmax(S_ij));  P~_ij = exp(S_ij - m_i^new)
        // l_i <- e^(m_i - m_i^new) l_i + rowsum(P~_ij);  O_i <- e^(m_i - m_i^new) O_i
        acc_t m_new[2], alpha[2], rowsum[2];
        online_softmax(S, m_i, m_new, alpha, rowsum, (acc_t)LOG2E);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            m_i[h] = m_new[h];
            l_i[h] = alpha[h] * l_i[h] + rowsum[h];
#pragma unroll
            for (int n = 0; n < DP / 8; ++n) {
                O[n][2 * h] *= alpha[h];
                O[n][2 * h + 1] *= alpha[h];
            }
        }
        if constexpr (DROPOUT) drop_probs(S, mods, r0, kv0);   // out of P~_ij V_j, not of l_i

        // O_i += P~_ij V_j                                                 (16, DP)
#if FLASH_TENSOR_CORES
        unsigned P[B_C / 16][4];
        frag_to_a(P, S);
        warp_mma_ra<DP / 8, B_C, true>(O, P, s_V, QKV_PITCH);
#else
        elem_t* s_Pw = s_KV + STAGES * KV_STAGE + 16 * warp * P_PITCH;   // (16, B_C) this warp's rows
        store_frag_smem(s_Pw, P_PITCH, S);
        __syncwarp();
        // FMA tiles hold a partial sum per accumulator: take O_i in chunks of PV_NT column tiles
        constexpr int PV_NT = DP / 8 < 8 ? DP / 8 : 8;
        // (P~_ij is not checked: a score past the float32 range makes it NaN)
#pragma unroll
        for (int n0 = 0; n0 < DP / 8; n0 += PV_NT) {
            acc_t (&O_n)[PV_NT][4] = *reinterpret_cast<acc_t(*)[PV_NT][4]>(&O[n0]);
            if (plain) warp_mma<PV_NT, B_C, false, true, B_PLAIN, TF32_UNROLL>(O_n, s_Pw, P_PITCH, s_V + n0 * 8, QKV_PITCH);
            else       warp_mma<PV_NT, B_C, false, true, GUARDED, TF32_UNROLL>(O_n, s_Pw, P_PITCH, s_V + n0 * 8, QKV_PITCH);
        }
        __syncwarp();
#endif
        __syncthreads();   // every warp is done with this stage before it is refilled
    }

    // O_i = diag(l_i)^-1 O_i (the sink folded in where the call has sinks: sink_of); write O_i, m_i, l_i
    // to HBM, or to the split's part
    const bool sinks = SWITCH_ON(SINK, p.uses);
    store_output_rows(p.o_at(split, sq.row0), p.m_at(split, sq.row0), p.l_at(split, sq.row0), O, m_i, l_i, (acc_t)1,
                      r0, Nq, D, sinks, sinks ? sink_of(p, sq, split) : (acc_t)0,
                      DROPOUT ? mods.keep_scale : (acc_t)1);
}

#ifdef FLASH_USER_MASK
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_map(const FwdParams p) { tile_map_states<B_R, B_C>(p); }
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_lists(const FwdParams p) { tile_map_lists(p); }
#endif
