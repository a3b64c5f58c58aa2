// flash_fwd_v1.cu — FlashAttention V1 forward, the paper's Algorithm 1 schedule.
//
// Outer loop over K/V tiles j, inner loop over Q tiles i. K_j, V_j are read
// from HBM once per CTA and stay in SRAM while the CTA walks its Q tiles; the
// running O_i (normalised, float32/float64), m_i and l_i go back to HBM after
// every inner step and are read again at the next outer step, exactly the V1
// IO pattern (Q and O are re-read T_c times; V2 removes that).
//
// Parallelism: V1 alone runs one CTA per (batch, head), which leaves most of
// 132 SMs idle at small batch. As FlashAttention 1 itself did, the grid is
// (batch*heads) x n_splits: CTA `split` owns Q tiles split, split+n_splits,
// ... (interleaved, so causal work is balanced). Different CTAs never touch
// the same rows, so the HBM round trip of O_i, m_i, l_i needs no atomics.
//
// Inside a CTA warp w owns query rows 16w..16w+15 of each Q tile, so the inner
// loop needs no block barrier: only the K_j/V_j loads are shared.
//
// Shared memory (elem_t, rows padded by PAD):
//   s_K (B_C, DP)   K_j
//   s_V (B_C, DP)   V_j
//   s_Q (B_R, DP)   Q_i, warp-private row blocks
//   s_P (B_R, B_C)  P~_ij = exp(S_ij - m_i^new), warp-private row blocks

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
constexpr int NTHREADS = FLASH_WARPS * WARP_SIZE;
constexpr int QKV_PITCH = DP + PAD;
constexpr int P_PITCH = B_C + PAD;
constexpr int SMEM_BYTES = ((2 * B_C + B_R) * QKV_PITCH + B_R * P_PITCH) * (int)sizeof(elem_t);

static_assert(B_R == 16 * FLASH_WARPS, "each warp owns 16 query rows of a Q tile");
static_assert(DP % DC == 0 && DC % 16 == 0 && B_C % 16 == 0, "tile shapes");
static_assert(SMEM_BYTES == FLASH_SMEM_BYTES, "host and device disagree on the shared-memory layout");
static_assert(!PAGED, "a paged cache is read by flash_fwd_v2 (and flash_fwd_repair)");

// This lane's fragment of columns c0 .. c0+DC-1 of the running O_i (rows r0 .. r0+15).
__device__ __forceinline__ void load_o_chunk(acc_t (&frag)[DC / 8][4], const acc_t* __restrict__ o_run,
                                             int r0, int c0, int Nq) {
    const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int n = 0; n < DC / 8; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = r0 + g + 8 * h;
            if (row < Nq) load_acc_pair(o_run + (i64)row * DP + c0 + n * 8 + 2 * t, frag[n][2 * h], frag[n][2 * h + 1]);
        }
}

extern "C" __global__ void __launch_bounds__(NTHREADS) flash_fwd_v1(const FwdParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* s_K = reinterpret_cast<elem_t*>(smem);   // (B_C, DP)
    elem_t* s_V = s_K + B_C * QKV_PITCH;               // (B_C, DP)
    elem_t* s_Q = s_V + B_C * QKV_PITCH;               // (B_R, DP)
    elem_t* s_P = s_Q + B_R * QKV_PITCH;               // (B_R, B_C)

    const int n_splits = p.n_splits, D = p.D;
    const bool vec = p.vec != 0;
    const acc_t scale = (acc_t)p.scale;
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const i64 w = blockIdx.x / n_splits;
    const int split = blockIdx.x % n_splits;
    const int T_grid = (p.mask.Nq + B_R - 1) / B_R;   // Q tiles per head of the repair flags

    const Seq sq = seq_of(p, w);
    const Mask& mask = mask_of(p, sq);
    const int Nq = mask.Nq, Nk = mask.Nk;
    const elem_t* q = sq.q_rows(p.q);
    const elem_t* k = sq.k_rows(p.k);
    const elem_t* v = sq.k_rows(p.v);
    const i64 q_sn = p.q.sn, k_sn = p.k.sn, v_sn = p.v.sn;
    elem_t* o = p.o + sq.row0 * D;
    acc_t* o_run = p.o_run + sq.row0 * DP;
    acc_t* m_run = p.m + sq.row0;
    acc_t* l_run = p.l + sq.row0;
    EntryMods mods = mods_of(p, sq);
    const TileHead tiles = tiles_of(p, sq);
    const bool sinks = SWITCH_ON(SINK, p.uses);
    const acc_t sink = sinks ? sink_of(p, sq) : (acc_t)0;

    const int T_r = (Nq + B_R - 1) / B_R;
    if (split >= T_r) return;
    // the K/V tiles this CTA visits: from its first Q tile's first to its last Q tile's last
    const int i_own_last = split + (T_r - 1 - split) / n_splits * n_splits;
    const int j_first = mask.kv_tile_first<B_C>(split * B_R);
    const int j_stop = mask.kv_tile_stop<B_C>(i_own_last * B_R, B_R);

    elem_t* s_Qw = s_Q + 16 * warp * QKV_PITCH;   // (16, DP) this warp's rows of Q_i
    elem_t* s_Pw = s_P + 16 * warp * P_PITCH;     // (16, B_C) this warp's rows of P~_ij

    for (int j = j_first; j < j_stop; ++j) {
        const int kv0 = j * B_C;
        // load K_j, V_j from HBM into SRAM
        __syncthreads();
        load_tile<B_C, DP>(s_K, k + kv0 * k_sn, k_sn, min(B_C, Nk - kv0), D, vec, tid, NTHREADS);
        load_tile<B_C, DP>(s_V, v + kv0 * v_sn, v_sn, min(B_C, Nk - kv0), D, vec, tid, NTHREADS);
        __syncthreads();
        // this thread's share of V_j holds an inf or NaN: P~_ij V_j may spread it to the masked pairs of
        // the Q tiles below that have some (nonfinite.cuh), flagged for the repair
        const bool v_nonfinite = may_hide_any(mask) && rows_nonfinite(s_V, B_C, DP, QKV_PITCH, tid, NTHREADS);

        for (int i = split; i < T_r; i += n_splits) {
            if (v_nonfinite && may_hide(mask, i * B_R, B_R, kv0, B_C) && j >= mask.kv_tile_first<B_C>(i * B_R)
                && j < mask.kv_tile_stop<B_C>(i * B_R, B_R))
                p.repair_flags[w * T_grid + i] = 1u;
            const int r0 = i * B_R + 16 * warp;   // first query row of this warp
            if (r0 >= Nq) break;
            // the K/V tiles this warp's rows see: j_own .. j_last; with mask_mod's tile map, the map's among
            // them or, where it has none, j_own alone (every pair hidden: it writes o = 0, m = -inf, l = 0)
            int j_own = mask.kv_tile_first<B_C>(r0), j_last = mask.kv_tile_stop<B_C>(r0, 16) - 1;
            if constexpr (TILE_MAP) {
                const Visits visits = kv_visits<B_R, B_C>(mask, tiles, i);
                const int first = visits.from(j_own), stop = visits.below(j_last + 1);
                if (first < stop) {
                    j_own = visits.tile(first);
                    j_last = visits.tile(stop - 1);
                } else {
                    j_last = j_own;
                }
                const unsigned char state = tiles.state[(i64)i * tiles.T_c + j];
                if (state == 0 && j != j_own) continue;
                mods.user_all = state == 2;
            }
            if (j < j_own || j > j_last) continue;
            const bool carry = j > j_own;         // O_i, m_i, l_i of earlier steps to read

            // load O_i (first chunk), m_i, l_i and Q_i from HBM; nothing to read at the warp's first step.
            // O_i and the statistics go to registers first, so their latency overlaps the Q_i load and S_ij.
            acc_t O_prev[DC / 8][4];
            if (carry) load_o_chunk(O_prev, o_run, r0, 0, Nq);
            acc_t m_i[2], l_i[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = r0 + g + 8 * h;
                const bool read = carry && row < Nq;
                m_i[h] = read ? m_run[row] : NEG_INF;
                l_i[h] = read ? l_run[row] : (acc_t)0;
            }
            __syncwarp();
            load_tile<16, DP>(s_Qw, q + r0 * q_sn, q_sn, min(16, Nq - r0), D, vec, lane, WARP_SIZE);
            __syncwarp();

            // S_ij = scale Q_i K_j^T, modified, masked                       (16, B_C)
            acc_t S[B_C / 8][4];
            zero_frag(S);
            warp_mma<B_C / 8, DP, false, false>(S, s_Qw, QKV_PITCH, s_K, QKV_PITCH);

            final_scores(S, scale, mods, mask, r0, kv0);

            // m_i^new = max(m_i, rowmax(S_ij));  P~_ij = exp(S_ij - m_i^new);  l_i^new = e^(m_i - m_i^new) l_i + rowsum(P~_ij)
            acc_t m_new[2], alpha[2], rowsum[2], l_new[2];
            online_softmax(S, m_i, m_new, alpha, rowsum, (acc_t)LOG2E);
#pragma unroll
            for (int h = 0; h < 2; ++h) l_new[h] = alpha[h] * l_i[h] + rowsum[h];
            if constexpr (DROPOUT) drop_probs(S, mods, r0, kv0);   // out of P~_ij V_j, not of l_i

            __syncwarp();
            store_frag_smem(s_Pw, P_PITCH, S);
            __syncwarp();

            // O_i^new = diag(l_i^new)^-1 (diag(e^(m_i - m_i^new) l_i) O_i + P~_ij V_j), DC columns at a time
            // At the warp's last step the sink, where the call has sinks, is folded into m_i^new, l_i^new (fold_sink)
            const bool last = j == j_last;
            acc_t inv_l[2], keep[2], pv_scale[2];   // pv_scale: of P~_ij V_j (dropout's 1 / (1 - p) too)
            bool none[2];                                 // no key so far
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                none[h] = l_new[h] == (acc_t)0;
                inv_l[h] = none[h] ? (acc_t)0 : (acc_t)1 / l_new[h];
                keep[h] = alpha[h] * l_i[h] * inv_l[h];
                if (sinks && last) {
                    const acc_t folded = fold_sink(m_new[h], l_new[h], sink);
                    inv_l[h] *= folded;
                    keep[h] *= folded;
                }
                pv_scale[h] = DROPOUT ? inv_l[h] * mods.keep_scale : inv_l[h];
            }
#pragma unroll
            for (int c0 = 0; c0 < DP; c0 += DC) {
                if (c0 >= D) break;
                acc_t PV[DC / 8][4];
                zero_frag(PV);
                warp_mma<DC / 8, B_C, false, true>(PV, s_Pw, P_PITCH, s_V + c0, QKV_PITCH);
#pragma unroll
                for (int n = 0; n < DC / 8; ++n)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = r0 + g + 8 * h, col = c0 + n * 8 + 2 * t;
                        if (row >= Nq) continue;
                        acc_t o0 = PV[n][2 * h] * pv_scale[h], o1 = PV[n][2 * h + 1] * pv_scale[h];
                        if (none[h]) o0 = o1 = (acc_t)0;   // P~ V may hold 0 · NaN of a masked key
                        else if (carry) {
                            o0 += keep[h] * O_prev[n][2 * h];
                            o1 += keep[h] * O_prev[n][2 * h + 1];
                        }
                        if (last) store_row_pair(o + (i64)row * D, col, D, o0, o1);
                        else      store_acc_pair(o_run + (i64)row * DP + col, o0, o1);
                    }
                if (carry && c0 + DC < D) load_o_chunk(O_prev, o_run, r0, c0 + DC, Nq);
            }

            // write m_i^new, l_i^new back to HBM
            if (t == 0)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = r0 + g + 8 * h;
                    if (row >= Nq) continue;
                    m_run[row] = m_new[h];
                    l_run[row] = l_new[h];
                }
        }
    }
}

#ifdef FLASH_USER_MASK
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_map(const FwdParams p) { tile_map_states<B_R, B_C>(p); }
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_lists(const FwdParams p) { tile_map_lists(p); }
#endif
