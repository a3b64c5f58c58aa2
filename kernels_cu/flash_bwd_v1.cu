// flash_bwd_v1.cu — FlashAttention V1 backward: recompute P from the saved
// statistics instead of storing it.
//
//   flash_bwd_prep_v1   D_i = rowsum(dO_i o O_i), and the statistics the main kernel reads:
//                       m_i, 1/l_i for flash_bwd_v1 (m = +inf, 1/l = 0 for a row that saw
//                       no key: P = 0), lse_i log2 e = (m_i + log l_i) log2 e for flash_bwd_sm90
//   flash_bwd_v1        one CTA per (batch*head, K/V tile j, head-dim chunk):
//                       K_j, V_j stay in SRAM, dK_j, dV_j accumulate in
//                       registers, the CTA walks the Q tiles i:
//                           S_ij^T  = K_j Q_i^T
//                           P_ij^T  = exp(S_ij^T - m_i) / l_i
//                           dV_j   += P_ij^T dO_i
//                           dP_ij^T = V_j dO_i^T
//                           dS_ij^T = P_ij^T o (dP_ij^T - D_i)
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
//   flash_convert       float accumulators -> output dtype.
//
// Shared memory (elem_t unless noted, rows padded by PAD):
//   s_K (B_C, DP), s_V (B_C, DP), s_Q (B_R, DP), s_dO (B_R, DP),
//   s_dS (B_C, B_R)   P^T then dS^T,
//   s_m, s_inv_l, s_D (B_R) acc_t.

#include "flash_common.cuh"

constexpr int DP = FLASH_DP;
constexpr int B_R = FLASH_BR;
constexpr int B_C = FLASH_BC;
constexpr int DC = FLASH_DC;
constexpr int NWARPS = FLASH_WARPS;
constexpr int NTHREADS = NWARPS * WARP_SIZE;
constexpr bool ORDERED = FLASH_ORDERED;
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

// flash_bwd_prep_v1: PREP_LANES threads per row, each reading 16-byte vectors of O_i and dO_i
constexpr int PREP_LANES = 8;
constexpr int PREP_THREADS = 256;

extern "C" __global__ void __launch_bounds__(PREP_THREADS)
flash_bwd_prep_v1(const elem_t* __restrict__ o,    // (batch..., Nq, D) strided
                  const elem_t* __restrict__ dO,   // (batch..., Nq, D) strided
                  const acc_t* __restrict__ m,     // (BH, Nq)
                  const acc_t* __restrict__ l,     // (BH, Nq)
                  acc_t* __restrict__ m_b,         // (BH, Nq) m_i, +inf where l_i = 0        } for flash_bwd_v1
                  acc_t* __restrict__ inv_l,       // (BH, Nq) 1 / l_i, 0 where l_i = 0       }
                  acc_t* __restrict__ lse2,        // (BH, Nq) (m_i + log l_i) log2 e, +inf where l_i = 0: flash_bwd_sm90
                  acc_t* __restrict__ Dsum,        // (BH, Nq)
                  i64 o_s0, i64 o_s1, i64 o_s2, i64 o_sn,
                  i64 do_s0, i64 do_s1, i64 do_s2, i64 do_sn,
                  i64 n1, i64 n2, i64 rows, int Nq, int D, int vec_flag, int lse_flag) {
    const i64 row = ((i64)blockIdx.x * PREP_THREADS + threadIdx.x) / PREP_LANES;   // over BH * Nq
    const int part = threadIdx.x % PREP_LANES;
    const bool valid = row < rows;   // no early return: the row's lanes meet in the shuffles below
    const i64 bh = valid ? row / Nq : 0;
    const int r = valid ? (int)(row % Nq) : 0;
    const BatchIndex bi = split_batch(bh, n1, n2);
    const elem_t* o_r = o + batch_offset(bi, o_s0, o_s1, o_s2) + r * o_sn;
    const elem_t* do_r = dO + batch_offset(bi, do_s0, do_s1, do_s2) + r * do_sn;
    // D_i = rowsum(dO_i o O_i)
    acc_t acc = 0;
    if (valid && vec_flag) {
        for (int d = part * VEC; d < D; d += PREP_LANES * VEC) {
            elem_t a[VEC], b[VEC];
            *reinterpret_cast<uint4*>(a) = *reinterpret_cast<const uint4*>(o_r + d);
            *reinterpret_cast<uint4*>(b) = *reinterpret_cast<const uint4*>(do_r + d);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc += to_acc(a[e]) * to_acc(b[e]);
        }
    } else if (valid) {
        for (int d = part; d < D; d += PREP_LANES) acc += to_acc(o_r[d]) * to_acc(do_r[d]);
    }
#pragma unroll
    for (int s = PREP_LANES / 2; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (valid && part == 0) {
        const bool seen = l[row] != (acc_t)0;   // l = 0: no key; a NaN row's gradients are NaN
        Dsum[row] = acc;
        if (lse_flag) {
            lse2[row] = seen ? m[row] * (acc_t)LOG2E + log2(l[row]) : POS_INF;
        } else {
            m_b[row] = seen ? m[row] : POS_INF;
            inv_l[row] = seen ? (acc_t)1 / l[row] : (acc_t)0;
        }
    }
}

extern "C" __global__ void __launch_bounds__(NTHREADS)
flash_bwd_v1(const elem_t* __restrict__ q,      // (batch..., Nq, D) strided
             const elem_t* __restrict__ k,      // (batch..., Nk, D) strided
             const elem_t* __restrict__ v,      // (batch..., Nk, D) strided
             const elem_t* __restrict__ dO,     // (batch..., Nq, D) strided
             const acc_t* __restrict__ m_b,     // (BH, Nq) from flash_bwd_prep_v1
             const acc_t* __restrict__ inv_l,   // (BH, Nq) from flash_bwd_prep_v1
             const acc_t* __restrict__ Dsum,    // (BH, Nq)
             acc_t* __restrict__ dq_acc,        // q's own shape, contiguous, zeroed
             elem_t* __restrict__ dk,           // k's own shape, contiguous (direct store)
             elem_t* __restrict__ dv,           // v's own shape, contiguous (direct store)
             acc_t* __restrict__ dk_acc,        // k's own shape, zeroed (when kv_atomic)
             acc_t* __restrict__ dv_acc,        // v's own shape, zeroed (when kv_atomic)
             unsigned* __restrict__ dq_turns,   // (BH, T_r, n_chunks) zeroed (ORDERED)
             unsigned* __restrict__ dk_turns,   // (K/V heads of k, T_c, n_chunks) zeroed (kv_atomic, ORDERED)
             unsigned* __restrict__ dv_turns,   // (K/V heads of v, T_c, n_chunks) zeroed (kv_atomic, ORDERED)
             unsigned* __restrict__ dq_flags,   // (BH, T_r) zeroed, when causal: dQ tiles for flash_bwd_repair
             unsigned* __restrict__ kv_flags,   // (BH, T_c) zeroed, when causal: dK, dV tiles
             i64 q_s0, i64 q_s1, i64 q_s2, i64 q_sn,
             i64 k_s0, i64 k_s1, i64 k_s2, i64 k_sn,
             i64 v_s0, i64 v_s1, i64 v_s2, i64 v_sn,
             i64 do_s0, i64 do_s1, i64 do_s2, i64 do_sn,
             i64 dq_s0, i64 dq_s1, i64 dq_s2,
             i64 dk_s0, i64 dk_s1, i64 dk_s2,
             i64 dv_s0, i64 dv_s1, i64 dv_s2,
             i64 n1, i64 n2, int head_group,
             int Nq, int Nk, int D, acc_t scale,
             int causal_flag, int vec_flag, int kv_atomic) {
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* s_K = reinterpret_cast<elem_t*>(smem);   // (B_C, DP)
    elem_t* s_V = s_K + B_C * QKV_PITCH;               // (B_C, DP)
    elem_t* s_Q = s_V + B_C * QKV_PITCH;               // (B_R, DP)
    elem_t* s_dO = s_Q + B_R * QKV_PITCH;              // (B_R, DP)
    elem_t* s_dS = s_dO + B_R * QKV_PITCH;             // (B_C, B_R)
    acc_t* s_m = reinterpret_cast<acc_t*>(s_dS + B_C * DS_PITCH);   // (B_R)
    acc_t* s_inv_l = s_m + B_R;                        // (B_R)
    acc_t* s_D = s_inv_l + B_R;                        // (B_R)

    const bool causal = causal_flag != 0, vec = vec_flag != 0;
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int T_c = (Nk + B_C - 1) / B_C, T_r = (Nq + B_R - 1) / B_R;
    const int n_chunks = (D + DC - 1) / DC;
    const GridTile at = grid_tile(T_c * n_chunks, head_group);
    const i64 bh = at.bh;
    const int j = at.tile / n_chunks;                       // the most Q tiles first when causal
    const int c0 = (at.tile % n_chunks) * DC;               // head-dim chunk of dK, dV, dQ
    const int kv0 = j * B_C;

    const BatchIndex bi = split_batch(bh, n1, n2);
    q += batch_offset(bi, q_s0, q_s1, q_s2);
    k += batch_offset(bi, k_s0, k_s1, k_s2);
    v += batch_offset(bi, v_s0, v_s1, v_s2);
    dO += batch_offset(bi, do_s0, do_s1, do_s2);
    dq_acc += batch_offset(bi, dq_s0, dq_s1, dq_s2);
    m_b += bh * Nq;
    inv_l += bh * Nq;
    Dsum += bh * Nq;

    // load K_j, V_j from HBM into SRAM
    load_tile<B_C, DP>(s_K, k + kv0 * k_sn, k_sn, min(B_C, Nk - kv0), D, vec, tid, NTHREADS);
    load_tile<B_C, DP>(s_V, v + kv0 * v_sn, v_sn, min(B_C, Nk - kv0), D, vec, tid, NTHREADS);

    const int key0 = kv0 + 16 * warp;                  // first key row of this warp
    elem_t* s_dSw = s_dS + 16 * warp * DS_PITCH;       // (16, B_R) this warp's rows of P^T / dS^T
    acc_t dK[DC / 8][4], dV[DC / 8][4];
    zero_frag(dK);
    zero_frag(dV);

    // causal: the first query row that sees key kv0 is kv0 - (Nk - Nq)
    const int i_first = causal ? max(0, kv0 - (Nk - Nq)) / B_R : 0;
    // Where a tile pair with masked pairs has an operand with an inf or NaN, its products may spread it
    // to them (flash_common.cuh): flag dQ_i and dK_j, dV_j for the repair. This thread's share of K_j,
    // V_j at the first step, of Q_i, dO_i, D_i at each.
    auto flag_pair = [&](int i) {
        dq_flags[bh * T_r + i] = 1u;
        kv_flags[bh * T_c + j] = 1u;
    };
    for (int i = i_first; i < T_r; ++i) {
        const int q0 = i * B_R;
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
        __syncthreads();
        if (causal && i == i_first
            && (rows_nonfinite(s_K, B_C, DP, QKV_PITCH, tid, NTHREADS)
                || rows_nonfinite(s_V, B_C, DP, QKV_PITCH, tid, NTHREADS)))
            for (int ii = i_first; ii < T_r && tile_has_masked_pairs(ii * B_R, kv0, B_C, Nq, Nk, causal); ++ii)
                flag_pair(ii);
        if (tile_has_masked_pairs(q0, kv0, B_C, Nq, Nk, causal)
            && (rows_nonfinite(s_Q, B_R, DP, QKV_PITCH, tid, NTHREADS)
                || rows_nonfinite(s_dO, B_R, DP, QKV_PITCH, tid, NTHREADS) || values_nonfinite(s_D, B_R, tid, NTHREADS)))
            flag_pair(i);

        // S_ij^T = K_j Q_i^T                                               (16, B_R)
        acc_t P[B_R / 8][4];
        zero_frag(P);
        warp_mma<B_R / 8, DP, false, false>(P, s_K + 16 * warp * QKV_PITCH, QKV_PITCH, s_Q, QKV_PITCH);

        // P_ij^T = exp(scale S_ij^T - m_i) / l_i, the difference in natural units as in the forward; invisible -> 0
        const bool boundary = kv0 + B_C > Nk || (causal && key0 + 15 > q0 + (Nk - Nq));
#pragma unroll
        for (int n = 0; n < B_R / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qc = n * 8 + 2 * t + e % 2;    // query column inside the tile
                const int kr = key0 + g + (e / 2) * 8;   // key row
                P[n][e] = (boundary && !key_visible(q0 + qc, kr, Nq, Nk, causal))
                              ? (acc_t)0
                              : exp2_acc((P[n][e] * scale - s_m[qc]) * (acc_t)LOG2E) * s_inv_l[qc];
            }
        store_frag_smem(s_dSw, DS_PITCH, P);
        __syncwarp();

        // dV_j += P_ij^T dO_i                                              (16, DC)
        warp_mma<DC / 8, B_R, false, true>(dV, s_dSw, DS_PITCH, s_dO + c0, QKV_PITCH);

        // dP_ij^T = V_j dO_i^T                                             (16, B_R)
        acc_t dP[B_R / 8][4];
        zero_frag(dP);
        warp_mma<B_R / 8, DP, false, false>(dP, s_V + 16 * warp * QKV_PITCH, QKV_PITCH, s_dO, QKV_PITCH);

        // dS_ij^T = P_ij^T o (dP_ij^T - D_i)
#pragma unroll
        for (int n = 0; n < B_R / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) P[n][e] *= dP[n][e] - s_D[n * 8 + 2 * t + e % 2];
        __syncwarp();
        store_frag_smem(s_dSw, DS_PITCH, P);
        __syncwarp();

        // dK_j += dS_ij^T Q_i   (scaled at the end)                        (16, DC)
        warp_mma<DC / 8, B_R, false, true>(dK, s_dSw, DS_PITCH, s_Q + c0, QKV_PITCH);
        // tile j adds the j-th term of dQ_i: every K/V tile before it reaches Q tile i too
        unsigned* dq_turn = ORDERED ? dq_turns + ((bh * T_r + i) * n_chunks + c0 / DC) : nullptr;
        if (ORDERED && tid == 0) wait_turn(dq_turn, j);
        __syncthreads();   // every warp's rows of dS^T are in SRAM

        // dQ_i += scale dS_ij K_j                                          (B_R, DC) over the warps
        {
            const int wm = warp % DQ_WM, wn = warp / DQ_WM;
            const int col0 = c0 + wn * DQ_NT * 8;
            acc_t dQ[DQ_NT][4];
            zero_frag(dQ);
            warp_mma<DQ_NT, B_C, true, true>(dQ, s_dS + wm * 16, DS_PITCH, s_K + col0, QKV_PITCH);
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
        if (ORDERED) {
            __syncthreads();
            if (tid == 0) end_turn(dq_turn);
        }
    }

    // dK_j, dV_j from registers to HBM; sums over the batch entries that share a K/V head in rank order
    unsigned *dk_turn = nullptr, *dv_turn = nullptr;
    if (ORDERED && kv_atomic) {
        const i64 tile = (i64)j * n_chunks + c0 / DC, head_elems = (i64)Nk * D;
        dk_turn = dk_turns + batch_offset(bi, dk_s0, dk_s1, dk_s2) / head_elems * T_c * n_chunks + tile;
        dv_turn = dv_turns + batch_offset(bi, dv_s0, dv_s1, dv_s2) / head_elems * T_c * n_chunks + tile;
        if (tid == 0) {
            wait_turn(dk_turn, broadcast_rank(bi, n1, n2, dk_s0, dk_s1, dk_s2));
            wait_turn(dv_turn, broadcast_rank(bi, n1, n2, dv_s0, dv_s1, dv_s2));
        }
        __syncthreads();
    }
#pragma unroll
    for (int n = 0; n < DC / 8; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = key0 + g + 8 * h, col = c0 + n * 8 + 2 * t;
            if (row >= Nk) continue;
            const acc_t k0 = scale * dK[n][2 * h], k1 = scale * dK[n][2 * h + 1];
            const acc_t v0 = dV[n][2 * h], v1 = dV[n][2 * h + 1];
            if (kv_atomic) {
                acc_t* dk_r = dk_acc + batch_offset(bi, dk_s0, dk_s1, dk_s2) + (i64)row * D;
                acc_t* dv_r = dv_acc + batch_offset(bi, dv_s0, dv_s1, dv_s2) + (i64)row * D;
                if (col < D) { atomicAdd(dk_r + col, k0); atomicAdd(dv_r + col, v0); }
                if (col + 1 < D) { atomicAdd(dk_r + col + 1, k1); atomicAdd(dv_r + col + 1, v1); }
            } else {
                store_row_pair(dk + batch_offset(bi, dk_s0, dk_s1, dk_s2) + (i64)row * D, col, D, k0, k1);
                store_row_pair(dv + batch_offset(bi, dv_s0, dv_s1, dv_s2) + (i64)row * D, col, D, v0, v1);
            }
        }
    if (ORDERED && kv_atomic) {
        __syncthreads();
        if (tid == 0) {
            end_turn(dk_turn);
            end_turn(dv_turn);
        }
    }
}

// flash_convert: four elements per thread and step (float4 in, four elem_t out)
struct alignas(4 * sizeof(elem_t)) elem4 { elem_t x[4]; };

extern "C" __global__ void flash_convert(const acc_t* __restrict__ src, elem_t* __restrict__ dst, i64 n) {
    const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = first; i < n / 4; i += stride) {
        acc_t a[4];
        if constexpr (sizeof(acc_t) == 4) {
            *reinterpret_cast<float4*>(a) = reinterpret_cast<const float4*>(src)[i];
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] = src[4 * i + e];
        }
        elem4 out;
#pragma unroll
        for (int e = 0; e < 4; ++e) out.x[e] = from_acc(a[e]);
        reinterpret_cast<elem4*>(dst)[i] = out;
    }
    if (first < n % 4) dst[n / 4 * 4 + first] = from_acc(src[n / 4 * 4 + first]);
}
