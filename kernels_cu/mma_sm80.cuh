// mma_sm80.cuh — warp tile products on the mma.sync fragment layout (sm_80 and later), and the
// float64 (DMMA) and exact float32 FMA tiles on the same layout.
//
// Warp tiles follow the mma.sync m16n8k16 fragment layout for every dtype:
// lane = 4*g + t owns rows (g, g+8) and columns (2t, 2t+1) of each 16x8
// accumulator tile, `acc[n][0..3]` = {(g,2t), (g,2t+1), (g+8,2t), (g+8,2t+1)}.
// float16/bfloat16 multiply on tensor cores (ldmatrix + mma.sync, float32
// accumulate), float64 on the float64 tensor cores (mma.sync m16n8k8 .f64 on
// sm_90, two m8n8k4 per 16x8 tile on sm_80), float32 on the TF32 tensor cores or as exact FMA
// loops: the same tiles, so the softmax, masking and store code is one code for all four dtypes.

#pragma once

#include "types.cuh"

template <int NT>
__device__ __forceinline__ void zero_frag(acc_t (&c)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[n][e] = (acc_t)0;
}

// How 3xTF32 splits the operands of a product (warp_mma's SPLIT; the other products ignore it):
// GUARDED handles every float32 value; an operand marked plain has been checked to be finite and
// below 2^127 in magnitude (nonfinite.cuh: own_copies_plain), where the split needs no guards.
// UNROLL (the TF32 products only) unrolls each K_BLOCK's k-steps: faster where the registers allow
// it (the V2 forward: measured 1.1-1.3x on the H200), spills in the backward.
enum Split : int { GUARDED = 0, A_PLAIN = 1, B_PLAIN = 2, PLAIN = A_PLAIN | B_PLAIN };

// ---------------------------------------------------------------------------
// Warp tile products. A warp computes C (16, 8*NT) += A (16, K) * B (K, 8*NT)
// with A and B in shared memory:
//   A_T = false: A[r][k] = a[r * lda + k]       A_T = true: A[r][k] = a[k * lda + r]
//   B_T = false: B[k][n] = b[n * ldb + k]       B_T = true: B[k][n] = b[k * ldb + n]
// (B_T = false is "K stored row by row", the S = Q K^T case; B_T = true is
// "V stored row by row", the O = P V case.)
// ---------------------------------------------------------------------------
#if FLASH_TENSOR_CORES

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const elem_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const elem_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if FLASH_DTYPE == 0
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

template <int NT, int K, bool A_T, bool B_T, int SPLIT = GUARDED, bool UNROLL = false>
__device__ __forceinline__ void warp_mma(acc_t (&c)[NT][4],
                                         const elem_t* __restrict__ a, int lda,
                                         const elem_t* __restrict__ b, int ldb) {
    static_assert(NT % 2 == 0 && K % 16 == 0, "tensor-core warp tiles are 16 x 16k x 16n");
    const int lane = threadIdx.x % WARP_SIZE;
    const int l8 = lane % 8, hi = (lane / 8) % 2, q = lane / 16;
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 16) {
        unsigned af[4];   // A (16, 16) fragment
        if (A_T) ldmatrix_x4_trans(af, a + (k0 + l8 + q * 8) * lda + hi * 8);
        else     ldmatrix_x4(af, a + (l8 + hi * 8) * lda + k0 + q * 8);
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            unsigned bf[4];   // B (16, 16): columns n*8 .. n*8+15
            if (B_T) ldmatrix_x4_trans(bf, b + (k0 + l8 + hi * 8) * ldb + n * 8 + q * 8);
            else     ldmatrix_x4(bf, b + (n * 8 + l8 + q * 8) * ldb + k0 + hi * 8);
            mma_16816(c[n], af, bf[0], bf[1]);
            mma_16816(c[n + 1], af, bf[2], bf[3]);
        }
    }
}

// An accumulator tile (16, 8*NT) as m16n8k16 A fragments (16, 16) of elem_t:
// two adjacent 16x8 C tiles make one A tile (the P~_ij of the forward stays in registers).
template <int NT>
__device__ __forceinline__ void frag_to_a(unsigned (&a)[NT / 2][4], const acc_t (&c)[NT][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        a[kk][0] = pack2(c[2 * kk][0], c[2 * kk][1]);
        a[kk][1] = pack2(c[2 * kk][2], c[2 * kk][3]);
        a[kk][2] = pack2(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        a[kk][3] = pack2(c[2 * kk + 1][2], c[2 * kk + 1][3]);
    }
}

// A warp's (16, K) row block of a shared tile as m16n8k16 A fragments, for an operand reused across steps.
template <int K>
__device__ __forceinline__ void load_a_frags(unsigned (&a)[K / 16][4], const elem_t* __restrict__ s, int lda) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int l8 = lane % 8, hi = (lane / 8) % 2, q = lane / 16;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) ldmatrix_x4(a[kk], s + (l8 + hi * 8) * lda + kk * 16 + q * 8);
}

// C (16, 8*NT) += A (16, K) * B (K, 8*NT), A already in registers (frag_to_a, load_a_frags).
template <int NT, int K, bool B_T>
__device__ __forceinline__ void warp_mma_ra(acc_t (&c)[NT][4], const unsigned (&a)[K / 16][4],
                                            const elem_t* __restrict__ b, int ldb) {
    static_assert(NT % 2 == 0 && K % 16 == 0, "tensor-core warp tiles are 16 x 16k x 16n");
    const int lane = threadIdx.x % WARP_SIZE;
    const int l8 = lane % 8, hi = (lane / 8) % 2, q = lane / 16;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            unsigned bf[4];
            if (B_T) ldmatrix_x4_trans(bf, b + (kk * 16 + l8 + hi * 8) * ldb + n * 8 + q * 8);
            else     ldmatrix_x4(bf, b + (n * 8 + l8 + q * 8) * ldb + kk * 16 + hi * 8);
            mma_16816(c[n], a[kk], bf[0], bf[1]);
            mma_16816(c[n + 1], a[kk], bf[2], bf[3]);
        }
}

#else  // float32 and float64 on the same fragment layout: DMMA, TF32 or FMA products

// The float32 tiles (TF32 and FMA) sum their products in blocks of K_BLOCK terms, each block's
// partial sum then added to c: a two-level sum whose float32 rounding error grows with
// K_BLOCK + K / K_BLOCK rather than K. (float64 needs none: its DMMA tile adds straight into c.)
constexpr int K_BLOCK = 16;

// c += sum over K of `block(part, k0)`, which adds the products of k0 .. k0 + K_BLOCK - 1 into a
// zeroed part
template <int NT, int K, typename Block>
__device__ __forceinline__ void sum_in_blocks(acc_t (&c)[NT][4], Block block) {
    static_assert(K % K_BLOCK == 0, "float32/float64 warp tiles sum K in blocks of K_BLOCK");
    for (int k0 = 0; k0 < K; k0 += K_BLOCK) {
        acc_t part[NT][4];
        zero_frag(part);
        block(part, k0);
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[n][e] += part[n][e];
    }
}

#if FLASH_DTYPE == 3  // float64 on the float64 tensor cores (DMMA)

#if __CUDA_ARCH__ >= 900
// D (16, 8) += A (16, 8) * B (8, 8) in float64 (sm_90: twice m8n8k4's rate, benchmarks/mma_ceilings.py).
// Lane 4*g + t holds A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4] and B[t][g], B[t+4][g] (PTX ISA,
// mma.m16n8k8 .f64 fragments, as .tf32's); D is this file's accumulator layout.
constexpr int DMMA_K = 8;

__device__ __forceinline__ void dmma(double (&d)[4], const double (&a)[4], const double (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
                 : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
}
#else
// D (8, 8) += A (8, 4) * B (4, 8) in float64, twice: rows 0-7 and 8-15 of a 16x8 tile. Lane
// 4*g + t holds A[g][t], B[t][g] and D[g][2t], D[g][2t+1] (PTX ISA, mma.m8n8k4 .f64 fragments).
constexpr int DMMA_K = 4;

__device__ __forceinline__ void dmma(double (&d)[4], const double (&a)[2], const double (&b)[1]) {
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
                 : "+d"(d[0]), "+d"(d[1]) : "d"(a[0]), "d"(b[0]));
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
                 : "+d"(d[2]), "+d"(d[3]) : "d"(a[1]), "d"(b[0]));
}
#endif

// The products go straight into c, k-step after k-step, as cuBLAS's DGEMM sums them: a float64
// sum of K <= 256 terms needs no two-level sum, and the registers a partial sum would take are
// what keeps O_i (up to (16, 256) float64 per warp) out of local memory.
template <int NT, int K, bool A_T, bool B_T, int SPLIT = GUARDED, bool UNROLL = false>
__device__ __forceinline__ void warp_mma(acc_t (&c)[NT][4],
                                         const elem_t* __restrict__ a, int lda,
                                         const elem_t* __restrict__ b, int ldb) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    auto at = [&](int r, int k) { return A_T ? a[k * lda + r] : a[r * lda + k]; };
    auto bt = [&](int k, int n) { return B_T ? b[k * ldb + n] : b[n * ldb + k]; };
    static_assert(K % DMMA_K == 0, "float64 warp tiles take K in steps of DMMA_K");
#pragma unroll 2
    for (int ks = 0; ks < K; ks += DMMA_K) {
        double af[DMMA_K / 2], bf[DMMA_K / 4];   // this lane's A[g][k], A[g+8][k] and B[k][g], k = ks + t (+ 4)
#pragma unroll
        for (int h = 0; h < DMMA_K / 4; ++h) {
            af[2 * h] = at(g, ks + t + 4 * h);
            af[2 * h + 1] = at(g + 8, ks + t + 4 * h);
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int h = 0; h < DMMA_K / 4; ++h) bf[h] = bt(ks + t + 4 * h, n * 8 + g);
            dmma(c[n], af, bf);
        }
    }
}

#elif FLASH_FP32_MMA  // float32 on the TF32 tensor cores: 3xTF32 (1) or one TF32 product (2)

// D (16, 8) += A (16, 8) * B (8, 8), operands as TF32 bit patterns, float32 accumulate. Lane
// 4*g + t holds A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4] and B[t][g], B[t+4][g] (PTX ISA,
// mma.m16n8k8 .tf32 fragments); D is this file's accumulator layout.
__device__ __forceinline__ void mma_1688_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// x rounded to TF32, to nearest with ties away from zero
__device__ __forceinline__ unsigned tf32_rna(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// the same for a finite x (sm_90 runs cvt.rna.tf32.f32 as integer instructions: these, without its
// test for inf and NaN)
__device__ __forceinline__ unsigned tf32_rna_finite(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// x = hi + lo: hi x rounded to TF32 (11 significant bits; |lo| <= 2^-11 |x|), lo the rest (exact in
// float32) rounded to TF32. Where rounding would carry x past the float32 range, hi is x truncated
// to TF32 instead (|lo| < 2^-10 |x|). For a non-finite x, hi is x (a NaN the canonical one, so that no
// payload reads as inf), lo = 0, and `small`, the hi that meets the other operand's lo, is 0: the two small
// terms then add 0 and the product is that of a float32 FMA (x times a finite y: inf or NaN as
// x * y is). Selects only: a branch per element would serialise the splits against the mma
// instructions they feed.
// The tensor cores take a subnormal TF32 operand as 0 (measured on the H200), so a lo below 2^-126
// is lost: an x under about 2^-103 in magnitude keeps only hi's accuracy, and a subnormal x counts as 0.
struct Tf32Split { unsigned hi, lo, small; };

__device__ __forceinline__ Tf32Split split_tf32(float x) {
    unsigned hi = tf32_rna_finite(x);
    if (fabsf(__uint_as_float(hi)) == POS_INF) hi = __float_as_uint(x) & 0xffffe000u;   // overflowed, or x = inf
    if (isnan(x)) hi = 0x7fffffffu;
    const bool finite = fabsf(x) < POS_INF;
    const unsigned lo = tf32_rna_finite(x - __uint_as_float(hi));
    return {hi, finite ? lo : 0u, finite ? hi : 0u};
}

// The split of an x known finite and below 2^127 (no rounding overflows): hi and lo rounded, small = hi
__device__ __forceinline__ Tf32Split split_tf32_plain(float x) {
    const unsigned hi = tf32_rna_finite(x);
    return {hi, tf32_rna_finite(x - __uint_as_float(hi)), hi};
}

template <bool PLAIN>
__device__ __forceinline__ Tf32Split split_operand(float x) { return PLAIN ? split_tf32_plain(x) : split_tf32(x); }

// Four 8x4 float32 blocks of shared memory, one register each: ldmatrix moves 16-byte rows, and
// lane 4*g + t's word of block b is row g, column t of the block whose row addresses lanes 8b .. 8b+7
// gave (rows 16-byte aligned: every pitch here is a multiple of 4 floats)
__device__ __forceinline__ void ldmatrix_x4_f32(float (&r)[4], const float* p) {
    unsigned u[4];
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(u[0]), "=r"(u[1]), "=r"(u[2]), "=r"(u[3]) : "r"(smem_addr(p)) : "memory");
#pragma unroll
    for (int e = 0; e < 4; ++e) r[e] = __uint_as_float(u[e]);
}

// This lane's A (16, 8) fragment at k-step ks: A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]
template <bool A_T>
__device__ __forceinline__ void load_a_tf32(float (&av)[4], const float* a, int lda, int ks) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    if (A_T) {
        av[0] = a[(ks + t) * lda + g];
        av[1] = a[(ks + t) * lda + g + 8];
        av[2] = a[(ks + t + 4) * lda + g];
        av[3] = a[(ks + t + 4) * lda + g + 8];
    } else {   // blocks (rows 0-7, 8-15) x (columns ks, ks + 4)
        ldmatrix_x4_f32(av, a + (lane % 8 + (lane / 8) % 2 * 8) * lda + ks + lane / 16 * 4);
    }
}

// This lane's B (8, 8) fragments of column tiles n and n + 1 at k-step ks: B[t][g], B[t+4][g] of each
template <bool B_T>
__device__ __forceinline__ void load_b_tf32(float (&bv)[4], const float* b, int ldb, int ks, int n) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    if (B_T) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            bv[2 * h] = b[(ks + t) * ldb + (n + h) * 8 + g];
            bv[2 * h + 1] = b[(ks + t + 4) * ldb + (n + h) * 8 + g];
        }
    } else {   // B[k][n] = b[n * ldb + k]: blocks (tile n, n + 1) x (columns ks, ks + 4)
        ldmatrix_x4_f32(bv, b + (n * 8 + lane % 8 + lane / 16 * 8) * ldb + ks + (lane / 8) % 2 * 4);
    }
}

// 3xTF32 (FLASH_FP32_MMA 1): each product is a_lo b_hi + a_hi b_lo + a_hi b_hi (the small terms
// first), a_lo b_lo (below 2^-22 of it) dropped; one TF32 product (2): a b with both rounded to TF32.
template <int NT, int K, bool A_T, bool B_T, int SPLIT = GUARDED, bool UNROLL = false>
__device__ __forceinline__ void warp_mma(acc_t (&c)[NT][4],
                                         const elem_t* __restrict__ a, int lda,
                                         const elem_t* __restrict__ b, int ldb) {
    static_assert(NT % 2 == 0, "TF32 warp tiles take column tiles in pairs");
    sum_in_blocks<NT, K>(c, [&](acc_t (&part)[NT][4], int k0) {
#pragma unroll(UNROLL ? K_BLOCK / 8 : 1)
        for (int ks = k0; ks < k0 + K_BLOCK; ks += 8) {
            float av[4];
            load_a_tf32<A_T>(av, a, lda, ks);
#if FLASH_FP32_MMA == 1
            unsigned a_hi[4], a_lo[4], a_small[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const Tf32Split x = split_operand<(SPLIT & A_PLAIN) != 0>(av[e]);
                a_hi[e] = x.hi;
                a_lo[e] = x.lo;
                a_small[e] = x.small;
            }
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                float bv[4];
                load_b_tf32<B_T>(bv, b, ldb, ks, n);
                Tf32Split x[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) x[e] = split_operand<(SPLIT & B_PLAIN) != 0>(bv[e]);
                // the two tiles' products alternate, so that no mma waits on the one before it
#pragma unroll
                for (int h = 0; h < 2; ++h) mma_1688_tf32(part[n + h], a_lo, x[2 * h].small, x[2 * h + 1].small);
#pragma unroll
                for (int h = 0; h < 2; ++h) mma_1688_tf32(part[n + h], a_small, x[2 * h].lo, x[2 * h + 1].lo);
#pragma unroll
                for (int h = 0; h < 2; ++h) mma_1688_tf32(part[n + h], a_hi, x[2 * h].hi, x[2 * h + 1].hi);
            }
#else
            unsigned a_tf32[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) a_tf32[e] = tf32_rna(av[e]);
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                float bv[4];
                load_b_tf32<B_T>(bv, b, ldb, ks, n);
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    mma_1688_tf32(part[n + h], a_tf32, tf32_rna(bv[2 * h]), tf32_rna(bv[2 * h + 1]));
            }
#endif
        }
    });
}

#else  // exact float32 FMA

template <int NT, int K, bool A_T, bool B_T, int SPLIT = GUARDED, bool UNROLL = false>
__device__ __forceinline__ void warp_mma(acc_t (&c)[NT][4],
                                         const elem_t* __restrict__ a, int lda,
                                         const elem_t* __restrict__ b, int ldb) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    sum_in_blocks<NT, K>(c, [&](acc_t (&part)[NT][4], int k0) {
#pragma unroll 4
        for (int k = k0; k < k0 + K_BLOCK; ++k) {
            const acc_t a0 = A_T ? a[k * lda + g] : a[g * lda + k];
            const acc_t a1 = A_T ? a[k * lda + g + 8] : a[(g + 8) * lda + k];
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int col = n * 8 + 2 * t;
                const acc_t b0 = B_T ? b[k * ldb + col] : b[col * ldb + k];
                const acc_t b1 = B_T ? b[k * ldb + col + 1] : b[(col + 1) * ldb + k];
                part[n][0] = fma(a0, b0, part[n][0]);
                part[n][1] = fma(a0, b1, part[n][1]);
                part[n][2] = fma(a1, b0, part[n][2]);
                part[n][3] = fma(a1, b1, part[n][3]);
            }
        }
    });
}

#endif
#endif
