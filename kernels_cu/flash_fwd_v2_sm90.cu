// flash_fwd_v2_sm90.cu — the V2 forward (flash_fwd_v2.cu's schedule and outputs) on Hopper's
// warpgroup MMA, for float16/bfloat16 on sm_90a.
//
// Same loop order as flash_fwd_v2.cu: one CTA per (Q tile i, batch*head), O_i, m_i, l_i in
// registers, normalisation deferred to the end. What changes is who multiplies: each warpgroup
// (four warps) owns 64 query rows and issues wgmma, which reads Q_i, K_j and V_j straight from
// swizzled shared memory (S_ij = Q_i K_j^T) and P~_ij from registers (O_i += P~_ij V_j).
//
// wgmma is asynchronous, so one step of the loop overlaps three things: the cp.async loads of
// K_{j+1} and V_j, the product S_ij = Q_i K_j^T, and the product O_i += P~_{i,j-1} V_{j-1} of
// the previous step, while the softmax of S_ij runs under the latter. Step j (0 <= j <= T):
//
//   wait for K_j, V_{j-1};  barrier           (everyone is done with K_{j-1} and V_{j-2})
//   load K_{j+1} over K_{j-1}, V_j over V_{j-2}
//   issue S_ij = Q_i K_j^T, then O_i += P~_{i,j-1} V_{j-1}
//   wait for S_ij;  scale, mask, online softmax -> P~_ij, alpha
//   wait for O_i;   O_i <- alpha O_i,  l_i <- alpha l_i + rowsum(P~_ij)
//
// Shared memory (elem_t, 128-byte swizzle, flash_common.cuh), after 1024-byte alignment:
//   s_Q  (B_R, DP)            Q_i
//   s_K  (2, B_C, DP)         K_j double-buffered
//   s_V  (2, B_C, DP)         V_j double-buffered

#include "flash_common.cuh"

constexpr int DP = FLASH_DP;
constexpr int B_R = FLASH_BR;
constexpr int B_C = FLASH_BC;
constexpr int NTHREADS = FLASH_WARPS * WARP_SIZE;
constexpr int TILE_Q = B_R * DP, TILE_KV = B_C * DP;   // elements
constexpr int PV_N = DP % 128 == 0 ? 128 : 64;         // columns of O_i per P~ V instruction
constexpr int SMEM_BYTES = (TILE_Q + 4 * TILE_KV) * (int)sizeof(elem_t) + SW_ATOM_BYTES;   // + alignment slack

static_assert(FLASH_WGMMA && FLASH_TENSOR_CORES, "a float16/bfloat16 warpgroup-MMA kernel");
static_assert(B_R == 16 * FLASH_WARPS && FLASH_WARPS % 4 == 0, "each warpgroup owns 64 query rows");
static_assert(DP % SW_COLS == 0 && (B_C == 64 || B_C == 128), "tile shapes");
static_assert(SMEM_BYTES == FLASH_SMEM_BYTES, "host and device disagree on the shared-memory layout");

// a (B_C, DP) K or V tile starting at key kv0 into a swizzled buffer (cp.async when vec)
__device__ __forceinline__ void load_kv_tile(elem_t* s, const elem_t* g, i64 sn, int kv0, int Nk, int D, bool vec) {
    load_tile_sw128<B_C, DP>(s, g + kv0 * sn, sn, min(B_C, Nk - kv0), D, vec, threadIdx.x, NTHREADS);
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
__device__ __forceinline__ void issue_values(acc_t (&O)[DP / 8][4], const unsigned (&P)[B_C / 16][4], const elem_t* s_Vj) {
    constexpr unsigned V_BLOCK = B_C * SW_COLS * sizeof(elem_t);
#pragma unroll
    for (int kk = 0; kk < B_C / 16; ++kk)
#pragma unroll
        for (int nb = 0; nb < DP / PV_N; ++nb)
            Wgmma<PV_N>::rs(*reinterpret_cast<acc_t(*)[PV_N / 8][4]>(&O[nb * PV_N / 8]), P[kk],
                            sw128_desc(s_Vj + sw128_offset<B_C>(kk * 16, nb * PV_N), V_BLOCK, SW_ATOM_BYTES));
    wgmma_commit();
}

// wait for this thread's cp.async copies, make them visible to the tensor cores, then a block barrier
__device__ __forceinline__ void tiles_ready() {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
flash_fwd_v2_sm90(const elem_t* __restrict__ q,    // (batch..., Nq, D) strided
                  const elem_t* __restrict__ k,    // (batch..., Nk, D) strided
                  const elem_t* __restrict__ v,    // (batch..., Nk, D) strided
                  elem_t* __restrict__ o,          // (BH, Nq, D)
                  acc_t* __restrict__ m_out,       // (BH, Nq)
                  acc_t* __restrict__ l_out,       // (BH, Nq)
                  i64 q_s0, i64 q_s1, i64 q_s2, i64 q_sn,
                  i64 k_s0, i64 k_s1, i64 k_s2, i64 k_sn,
                  i64 v_s0, i64 v_s1, i64 v_s2, i64 v_sn,
                  i64 n1, i64 n2,
                  int Nq, int Nk, int D, acc_t scale, int causal_flag, int vec_flag) {
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned misalign = smem_addr(smem) % SW_ATOM_BYTES;
    elem_t* s_Q = reinterpret_cast<elem_t*>(smem + (misalign ? SW_ATOM_BYTES - misalign : 0));   // (B_R, DP)
    elem_t* s_K = s_Q + TILE_Q;                                                                   // (2, B_C, DP)
    elem_t* s_V = s_K + 2 * TILE_KV;                                                              // (2, B_C, DP)

    const bool causal = causal_flag != 0, vec = vec_flag != 0;
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int T_r = (Nq + B_R - 1) / B_R, T_c = (Nk + B_C - 1) / B_C;
    const i64 bh = blockIdx.x / T_r;
    const int i = T_r - 1 - (int)(blockIdx.x % T_r);   // heaviest causal tiles first

    const BatchIndex bi = split_batch(bh, n1, n2);
    q += batch_offset(bi, q_s0, q_s1, q_s2);
    k += batch_offset(bi, k_s0, k_s1, k_s2);
    v += batch_offset(bi, v_s0, v_s1, v_s2);
    o += bh * Nq * D;
    m_out += bh * Nq;
    l_out += bh * Nq;

    const int r0 = i * B_R + 16 * warp;                 // first query row of this warp
    // K/V tiles this CTA needs: up to the last key its last row sees (tile 0 at least)
    const int key_last = causal ? min(i * B_R + B_R - 1, Nq - 1) + (Nk - Nq) : Nk - 1;
    const int j_stop = key_last < 0 ? 1 : min(key_last / B_C, T_c - 1) + 1;

    load_tile_sw128<B_R, DP>(s_Q, q + (i64)i * B_R * q_sn, q_sn, min(B_R, Nq - i * B_R), D, vec, tid, NTHREADS);
    load_kv_tile(s_K, k, k_sn, 0, Nk, D, vec);
    cp_async_commit();

    const elem_t* s_Qg = s_Q + (warp / 4) * 64 * SW_COLS;   // this warpgroup's 64 rows of Q_i

    acc_t O[DP / 8][4];                                 // (16, DP) per warp: unnormalised O_i
    zero_frag(O);
    acc_t m_i[2] = {NEG_INF, NEG_INF}, l_i[2] = {(acc_t)0, (acc_t)0};
    acc_t S[B_C / 8][4];                                // (16, B_C) per warp: S_ij, then P~_ij
    unsigned P[B_C / 16][4];                            // P~_ij as A fragments
    acc_t m_new[2], alpha[2], rowsum[2];

    // S_ij -> P~_ij, its statistics into m_new, alpha, rowsum (scaled, masked, online softmax)
    auto softmax_step = [&](int j) {
        const int kv0 = j * B_C;
        const bool boundary = kv0 + B_C > Nk || (causal && kv0 + B_C - 1 > r0 + (Nk - Nq));
        scale_and_mask(S, scale, boundary, r0, kv0, Nq, Nk, causal);
        online_softmax(S, m_i, m_new, alpha, rowsum);
    };
    // m_i <- m_new;  l_i <- alpha l_i + rowsum(P~_ij);  O_i <- alpha O_i;  P~_ij to A fragments
    auto rescale = [&]() {
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
        frag_to_a(P, S);
    };
    // K_{j+1} over K_{j-1} and V_j over V_{j-2}: every warpgroup is past both (tiles_ready)
    auto prefetch = [&](int j) {
        if (j + 1 < j_stop) load_kv_tile(s_K + ((j + 1) % 2) * TILE_KV, k, k_sn, (j + 1) * B_C, Nk, D, vec);
        load_kv_tile(s_V + (j % 2) * TILE_KV, v, v_sn, j * B_C, Nk, D, vec);
        cp_async_commit();
    };

    // step 0: S_i0 alone
    tiles_ready();
    wgmma_fence();
    issue_scores(S, s_Qg, s_K);
    prefetch(0);
    wgmma_wait<0>();
    wgmma_pin(S);
    softmax_step(0);
    rescale();

    // step j: S_ij and P~_{i,j-1} V_{j-1} in flight together, the softmax of S_ij under the latter
    for (int j = 1; j < j_stop; ++j) {
        tiles_ready();
        wgmma_fence();
        issue_scores(S, s_Qg, s_K + (j % 2) * TILE_KV);
        issue_values(O, P, s_V + ((j - 1) % 2) * TILE_KV);
        prefetch(j);
        wgmma_wait<1>();
        wgmma_pin(S);
        softmax_step(j);
        wgmma_wait<0>();
        wgmma_pin(O);
        wgmma_pin_a(P);
        rescale();
    }

    // last step: P~_{i,T-1} V_{T-1}
    tiles_ready();
    wgmma_fence();
    issue_values(O, P, s_V + ((j_stop - 1) % 2) * TILE_KV);
    wgmma_wait<0>();
    wgmma_pin(O);

    // O_i = diag(l_i)^-1 O_i; write O_i, m_i, l_i to HBM
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + g + 8 * h;
        if (row >= Nq) continue;
        const acc_t inv_l = l_i[h] > (acc_t)0 ? (acc_t)1 / l_i[h] : (acc_t)0;
#pragma unroll
        for (int n = 0; n < DP / 8; ++n)
            store_row_pair(o + (i64)row * D, n * 8 + 2 * t, D, O[n][2 * h] * inv_l, O[n][2 * h + 1] * inv_l);
        if (t == 0) {
            m_out[row] = m_i[h];
            l_out[row] = l_i[h];
        }
    }
}
