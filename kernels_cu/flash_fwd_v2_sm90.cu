// flash_fwd_v2_sm90.cu — the V2 forward (flash_fwd_v2.cu's schedule and outputs) on Hopper's
// warpgroup MMA, for float16/bfloat16 on sm_90a.
//
// Same loop order as flash_fwd_v2.cu: one CTA per (Q tile i, batch*head), O_i, m_i, l_i in
// registers, normalisation deferred to the end. What changes is who does what. The CTA is
// 1 + CONSUMERS warpgroups (four warps each), specialised:
//
//   producer   warpgroup 0 copies Q_i once, then K_j and V_j into a ring of STAGES buffers
//              (cp.async), each buffer guarded by a "full" and an "empty" mbarrier;
//   consumers  warpgroups 1 .. CONSUMERS own 64 query rows each and issue wgmma, which reads
//              Q_i, K_j and V_j straight from swizzled shared memory (S_ij = Q_i K_j^T) and P~_ij
//              from registers (O_i += P~_ij V_j). The producer hands its registers to them
//              (setmaxnreg).
//
// The consumers wait only on tiles and on their turn to issue products (ping-pong: while one
// runs its softmax another's products keep the tensor cores busy). wgmma is asynchronous, so
// one step of a consumer also overlaps S_ij = Q_i K_j^T with P~_{i,j-1} V_{j-1}, and the
// softmax of S_ij with the latter. The softmax takes the row max of raw scores Q K^T and
// scales differences (scale > 0, checked on the host). Consumer step j (0 <= j <= T, T = K/V
// tiles):
//
//   wait K_j full, V_{j-1} full
//   (my turn) issue S_ij = Q_i K_j^T, then O_i += P~_{i,j-1} V_{j-1} (next consumer's turn)
//   wait for S_ij;  K_j empty;  scale, mask, online softmax -> P~_ij, alpha
//   wait for O_i;   V_{j-1} empty;  O_i <- alpha O_i,  l_i <- alpha l_i + rowsum(P~_ij)
//
// A consumer multiplies only the K/V tiles its own 64 rows see (fewer than the CTA's when causal,
// none when the rows are all past Nq); it still takes each turn and releases each tile.
//
// Shared memory (elem_t, 128-byte swizzle, flash_common.cuh), after 1024-byte alignment:
//   s_Q  (B_R, DP)              Q_i
//   s_K  (STAGES, B_C, DP)      K_j ring
//   s_V  (STAGES, B_C, DP)      V_j ring
//   bars (1 + 4 STAGES) u64     Q full; K full, K empty, V full, V empty per stage

#include "flash_common.cuh"

constexpr int DP = FLASH_DP;
constexpr int B_R = FLASH_BR;
constexpr int B_C = FLASH_BC;
constexpr int NTHREADS = FLASH_WARPS * WARP_SIZE;
constexpr int WG_THREADS = 4 * WARP_SIZE;              // one warpgroup
constexpr int CONSUMERS = NTHREADS / WG_THREADS - 1;    // consumer warpgroups, 64 query rows each
constexpr int STAGES = 2;
constexpr int TILE_Q = B_R * DP, TILE_KV = B_C * DP;   // elements
constexpr int PV_N = DP % 128 == 0 ? 128 : 64;         // columns of O_i per P~ V instruction
constexpr int N_BARRIERS = 1 + 4 * STAGES;
constexpr int SMEM_BYTES = (TILE_Q + 2 * STAGES * TILE_KV) * (int)sizeof(elem_t) + N_BARRIERS * 8
                           + SW_ATOM_BYTES;             // + slack for the 1024-byte alignment
// One consumer: two CTAs per SM keep each other's tensor cores busy; more: one CTA, ping-pong.
constexpr int CTAS_PER_SM = CONSUMERS == 1 ? 2 : 1;
// setmaxnreg moves registers between the warpgroups of the CTA's fixed allocation: the fewest
// to the producer, the rest to the consumers (multiples of 8)
constexpr int ENTRY_REGS = 65536 / (NTHREADS * CTAS_PER_SM) / 8 * 8;
constexpr int PRODUCER_REGS = CONSUMERS == 2 ? 40 : 32;
constexpr int CONSUMER_SHARE = ((1 + CONSUMERS) * ENTRY_REGS - PRODUCER_REGS) / CONSUMERS / 8 * 8;
constexpr int CONSUMER_REGS = CONSUMER_SHARE < 256 ? CONSUMER_SHARE : 256;

static_assert(FLASH_WGMMA && FLASH_TENSOR_CORES, "a float16/bfloat16 warpgroup-MMA kernel");
static_assert(B_R == 64 * CONSUMERS && FLASH_WARPS % 4 == 0, "one producer warpgroup, 64 query rows per consumer");
static_assert(DP % SW_COLS == 0 && (B_C == 64 || B_C == 128), "tile shapes");
static_assert(PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= (1 + CONSUMERS) * ENTRY_REGS, "register file");
static_assert(SMEM_BYTES == FLASH_SMEM_BYTES, "host and device disagree on the shared-memory layout");

// Producer: a (ROWS, DP) tile of `rows` rows into a swizzled buffer, then an arrival on `full`
// once it has landed
template <int ROWS>
__device__ __forceinline__ void produce_tile(elem_t* s, const elem_t* g, i64 sn, int rows, int D, bool vec,
                                             unsigned long long* full) {
    load_tile_sw128<ROWS, DP, WG_THREADS>(s, g, sn, rows, D, vec, threadIdx.x % WG_THREADS);
    arrive_when_landed(full, vec);
}

// S (64, B_C) = Q_i K_j^T for this warpgroup's 64 rows of Q_i, issued (not waited for)
__device__ __forceinline__ void issue_scores(acc_t (&S)[B_C / 8][4], const elem_t* s_Qg, const elem_t* s_Kj) {
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk)
        Wgmma<B_C>::ss(S, sw128_desc(s_Qg + sw128_offset<B_R>(0, kk * 16), 16, SW_ATOM_BYTES),
                       sw128_desc(s_Kj + sw128_offset<B_C>(0, kk * 16), 16, SW_ATOM_BYTES), kk > 0);
    wgmma_commit();
}

// O (64, DP) += P~ V_j for this warpgroup, issued (not waited for); V's 64-column blocks lie B_C lines apart
__device__ __forceinline__ void issue_values(acc_t (&O)[DP / 8][4], const unsigned (&P)[B_C / 16][4],
                                             const elem_t* s_Vj) {
    constexpr unsigned V_BLOCK = B_C * SW_COLS * sizeof(elem_t);
#pragma unroll
    for (int kk = 0; kk < B_C / 16; ++kk)
#pragma unroll
        for (int nb = 0; nb < DP / PV_N; ++nb)
            Wgmma<PV_N>::rs(*reinterpret_cast<acc_t(*)[PV_N / 8][4]>(&O[nb * PV_N / 8]), P[kk],
                            sw128_desc(s_Vj + sw128_offset<B_C>(kk * 16, nb * PV_N), V_BLOCK, SW_ATOM_BYTES));
    wgmma_commit();
}

extern "C" __global__ void __launch_bounds__(NTHREADS, CTAS_PER_SM)
flash_fwd_v2_sm90(const elem_t* __restrict__ q,    // (batch..., Nq, D) strided
                  const elem_t* __restrict__ k,    // (batch..., Nk, D) strided
                  const elem_t* __restrict__ v,    // (batch..., Nk, D) strided
                  elem_t* __restrict__ o,          // (BH, Nq, D)
                  acc_t* __restrict__ m_out,       // (BH, Nq)
                  acc_t* __restrict__ l_out,       // (BH, Nq)
                  i64 q_s0, i64 q_s1, i64 q_s2, i64 q_sn,
                  i64 k_s0, i64 k_s1, i64 k_s2, i64 k_sn,
                  i64 v_s0, i64 v_s1, i64 v_s2, i64 v_sn,
                  i64 n1, i64 n2, int head_group,
                  int Nq, int Nk, int D, acc_t scale, int causal_flag, int vec_flag) {
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned misalign = smem_addr(smem) % SW_ATOM_BYTES;
    elem_t* s_Q = reinterpret_cast<elem_t*>(smem + (misalign ? SW_ATOM_BYTES - misalign : 0));   // (B_R, DP)
    elem_t* s_K = s_Q + TILE_Q;                                          // (STAGES, B_C, DP)
    elem_t* s_V = s_K + STAGES * TILE_KV;                                // (STAGES, B_C, DP)
    unsigned long long* q_full = reinterpret_cast<unsigned long long*>(s_V + STAGES * TILE_KV);
    unsigned long long* k_full = q_full + 1;                             // (STAGES) each
    unsigned long long* k_empty = k_full + STAGES;
    unsigned long long* v_full = k_empty + STAGES;
    unsigned long long* v_empty = v_full + STAGES;

    const bool causal = causal_flag != 0, vec = vec_flag != 0;
    const int tid = threadIdx.x;
    const int wg = __shfl_sync(0xffffffffu, tid / WG_THREADS, 0);   // from lane 0: the compiler sees it warp-uniform
    const int T_r = (Nq + B_R - 1) / B_R, T_c = (Nk + B_C - 1) / B_C;
    const GridTile at = grid_tile(T_r, head_group);
    const i64 bh = at.bh;
    const int i = T_r - 1 - at.tile;                   // heaviest causal tiles first

    const BatchIndex bi = split_batch(bh, n1, n2);
    q += batch_offset(bi, q_s0, q_s1, q_s2);
    k += batch_offset(bi, k_s0, k_s1, k_s2);
    v += batch_offset(bi, v_s0, v_s1, v_s2);

    // K/V tiles this CTA needs: up to the last key its last row sees (tile 0 at least)
    const int key_last = causal ? min(i * B_R + B_R - 1, Nq - 1) + (Nk - Nq) : Nk - 1;
    const int j_stop = key_last < 0 ? 1 : min(key_last / B_C, T_c - 1) + 1;

    if (tid == 0) {
        mbar_init(q_full, WG_THREADS);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&k_full[s], WG_THREADS);
            mbar_init(&v_full[s], WG_THREADS);
            mbar_init(&k_empty[s], CONSUMERS * WG_THREADS);
            mbar_init(&v_empty[s], CONSUMERS * WG_THREADS);
        }
    }
    __syncthreads();

    if (wg == 0) {
        // producer: Q_i, then K_j, V_j into stage j % STAGES once its previous tile is released
        setmaxnreg_dec<PRODUCER_REGS>();
        produce_tile<B_R>(s_Q, q + (i64)i * B_R * q_sn, q_sn, min(B_R, Nq - i * B_R), D, vec, q_full);
        for (int j = 0; j < j_stop; ++j) {
            const int s = j % STAGES, use = j / STAGES, rows = min(B_C, Nk - j * B_C);
            if (use > 0) mbar_wait(&k_empty[s], (use - 1) & 1);
            produce_tile<B_C>(s_K + s * TILE_KV, k + (i64)j * B_C * k_sn, k_sn, rows, D, vec, &k_full[s]);
            if (use > 0) mbar_wait(&v_empty[s], (use - 1) & 1);
            produce_tile<B_C>(s_V + s * TILE_KV, v + (i64)j * B_C * v_sn, v_sn, rows, D, vec, &v_full[s]);
        }
        cp_async_wait<0>();   // no copy outlives its thread
    } else {
        // consumers: warpgroup c = wg - 1 owns rows 64c .. 64c+63 of Q_i
        setmaxnreg_inc<CONSUMER_REGS>();
        const int c = wg - 1;
        const int warp = tid / WARP_SIZE - 4, lane = tid % WARP_SIZE;   // warp among the consumers
        const int g = lane / 4, t = lane % 4;
        const int r0 = i * B_R + 16 * warp;                 // first query row of this warp
        const elem_t* s_Qg = s_Q + c * 64 * SW_COLS;
        o += bh * Nq * D;
        m_out += bh * Nq;
        l_out += bh * Nq;

        acc_t O[DP / 8][4];                                 // (16, DP) per warp: unnormalised O_i
        zero_frag(O);
        // m_i in units of raw scores Q K^T (the softmax scales differences: scale > 0, checked on the host)
        acc_t m_i[2] = {NEG_INF, NEG_INF}, l_i[2] = {(acc_t)0, (acc_t)0};
        acc_t S[B_C / 8][4];                                // (16, B_C) per warp: S_ij, then P~_ij
        unsigned P[B_C / 16][4];                            // P~_ij as A fragments
        acc_t m_new[2], alpha[2], rowsum[2];
        const acc_t log2_scale = scale * (acc_t)LOG2E;

        // S_ij -> P~_ij, its statistics into m_new, alpha, rowsum (masked online softmax)
        auto softmax_step = [&](int j) {
            const int kv0 = j * B_C;
            const bool boundary = kv0 + B_C > Nk || (causal && kv0 + B_C - 1 > r0 + (Nk - Nq));
            mask_scores(S, boundary, r0, kv0, Nq, Nk, causal);
            online_softmax(S, m_i, m_new, alpha, rowsum, log2_scale);
        };
        // m_i <- m_new;  l_i <- alpha l_i + rowsum(P~_ij);  O_i <- alpha O_i (skipped while no row
        // max of the warp moved: alpha = 1 exactly);  P~_ij to A fragments
        auto rescale = [&]() {
            const bool moved = __any_sync(0xffffffffu, alpha[0] != (acc_t)1 || alpha[1] != (acc_t)1);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                m_i[h] = m_new[h];
                l_i[h] = alpha[h] * l_i[h] + rowsum[h];
                if (moved)
#pragma unroll
                    for (int n = 0; n < DP / 8; ++n) {
                        O[n][2 * h] *= alpha[h];
                        O[n][2 * h + 1] *= alpha[h];
                    }
            }
            frag_to_a(P, S);
        };
        // the tile's copies happened in the generic proxy; the tensor cores read through the async one
        auto wait_full = [&](unsigned long long* bar, int j) {
            mbar_wait(bar, (j / STAGES) & 1);
            fence_proxy_async();
        };
        // Ping-pong: the consumers take turns issuing their products (named barrier 1 + c is
        // consumer c's turn), so one's softmax runs while another's products keep the tensor cores
        // busy. Consumer 0 goes first; every issue hands the turn on (the very last has no taker).
        constexpr int PAIR = 2 * WG_THREADS;
        auto my_turn = [&]() {
            if (CONSUMERS > 1) named_barrier_sync(1 + c, PAIR);
        };
        auto your_turn = [&](bool last) {
            if (CONSUMERS > 1 && !(last && c == CONSUMERS - 1)) named_barrier_arrive(1 + (c + 1) % CONSUMERS, PAIR);
        };
        if (CONSUMERS > 1 && c == CONSUMERS - 1) named_barrier_arrive(1, PAIR);

        // The K/V tiles this warpgroup's rows need (fewer than the CTA's when causal; none for rows
        // all past Nq). It still takes every turn and releases every tile, computing nothing there.
        const int row_first = i * B_R + 64 * c, row_last = min(row_first + 63, Nq - 1);
        const int my_key_last = causal ? row_last + (Nk - Nq) : Nk - 1;
        const int my_stop = row_first >= Nq ? 0 : my_key_last < 0 ? 1 : min(my_key_last / B_C, T_c - 1) + 1;

        // a turn with nothing to multiply: release K_j and V_{j-1} once they have landed (an arrival
        // before the tile's own must not count towards the previous use of its buffer)
        auto idle_step = [&](int j) {
            if (j < j_stop) wait_full(&k_full[j % STAGES], j);
            if (j >= 1) wait_full(&v_full[(j - 1) % STAGES], j - 1);
            my_turn();
            your_turn(j == j_stop);
            if (j < j_stop) mbar_arrive(&k_empty[j % STAGES]);
            if (j >= 1) mbar_arrive(&v_empty[(j - 1) % STAGES]);
        };

        mbar_wait(q_full, 0);
        if (my_stop > 0) {
            // step 0: S_i0 alone
            wait_full(&k_full[0], 0);
            my_turn();
            wgmma_fence();
            issue_scores(S, s_Qg, s_K);
            your_turn(false);
            wgmma_wait<0>();
            wgmma_pin(S);
            mbar_arrive(&k_empty[0]);
            softmax_step(0);
            rescale();

            // step j: S_ij and P~_{i,j-1} V_{j-1} in flight together, the softmax of S_ij under the latter
            for (int j = 1; j < my_stop; ++j) {
                const int s = j % STAGES, sp = (j - 1) % STAGES;
                wait_full(&k_full[s], j);
                wait_full(&v_full[sp], j - 1);
                my_turn();
                wgmma_fence();
                issue_scores(S, s_Qg, s_K + s * TILE_KV);
                issue_values(O, P, s_V + sp * TILE_KV);
                your_turn(false);
                wgmma_wait<1>();
                wgmma_pin(S);
                mbar_arrive(&k_empty[s]);
                softmax_step(j);
                wgmma_wait<0>();
                wgmma_pin(O);
                wgmma_pin_a(P);
                mbar_arrive(&v_empty[sp]);
                rescale();
            }

            // step my_stop: P~_{i,my_stop-1} V_{my_stop-1}; K_{my_stop}, if the CTA has it, is not mine
            const int j = my_stop, s = j % STAGES, sp = (j - 1) % STAGES;
            if (j < j_stop) wait_full(&k_full[s], j);
            wait_full(&v_full[sp], j - 1);
            my_turn();
            wgmma_fence();
            issue_values(O, P, s_V + sp * TILE_KV);
            your_turn(j == j_stop);
            if (j < j_stop) mbar_arrive(&k_empty[s]);
            wgmma_wait<0>();
            wgmma_pin(O);
            mbar_arrive(&v_empty[sp]);
        }
        for (int j = my_stop > 0 ? my_stop + 1 : 0; j <= j_stop; ++j) idle_step(j);

        // O_i = diag(l_i)^-1 O_i; write O_i, m_i (in natural units), l_i to HBM
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = r0 + g + 8 * h;
            if (row >= Nq) continue;
            const acc_t inv_l = l_i[h] > (acc_t)0 ? (acc_t)1 / l_i[h] : (acc_t)0;
#pragma unroll
            for (int n = 0; n < DP / 8; ++n)
                store_row_pair(o + (i64)row * D, n * 8 + 2 * t, D, O[n][2 * h] * inv_l, O[n][2 * h + 1] * inv_l);
            if (t == 0) {
                m_out[row] = m_i[h] == NEG_INF ? NEG_INF : m_i[h] * scale;
                l_out[row] = l_i[h];
            }
        }
    }
}
