// flash_common.cuh — device building blocks shared by every cupyflash kernel.
//
// The kernels are compiled by NVRTC with this header pasted in front of them
// (cupyflash/_compile.py), so nothing here may #include a system header.
// Compile-time parameters arrive as -D defines made by cupyflash/_tiles.py:
//
//   FLASH_DTYPE   0 = float16, 1 = bfloat16, 2 = float32, 3 = float64
//   FLASH_DP      head dim padded up to its bucket (multiple of 16)
//   FLASH_BR      B_r, query rows per tile
//   FLASH_BC      B_c, key rows per tile
//   FLASH_WARPS   warps per CTA
//   FLASH_DC      head-dim columns of one output chunk (divides FLASH_DP)
//
// Warp tiles follow the mma.sync m16n8k16 fragment layout for every dtype:
// lane = 4*g + t owns rows (g, g+8) and columns (2t, 2t+1) of each 16x8
// accumulator tile, `acc[n][0..3]` = {(g,2t), (g,2t+1), (g+8,2t), (g+8,2t+1)}.
// float16/bfloat16 multiply on tensor cores (ldmatrix + mma.sync, float32
// accumulate); float32 and float64 run the same tiles as exact FMA loops, so
// the softmax, masking and store code is one code for all four dtypes.

#pragma once

#define LOG2E 1.4426950408889634
#define WARP_SIZE 32
#define SMEM_PAD_BYTES 16   // one 16-byte row pad: ldmatrix and FMA reads hit distinct banks

typedef long long i64;

// ---------------------------------------------------------------------------
// Element and accumulator types
// ---------------------------------------------------------------------------
#if FLASH_DTYPE == 0 || FLASH_DTYPE == 1
typedef unsigned short elem_t;   // raw 16-bit storage; arithmetic is in float
typedef float acc_t;
#define FLASH_TENSOR_CORES 1
#elif FLASH_DTYPE == 2
typedef float elem_t;
typedef float acc_t;
#define FLASH_TENSOR_CORES 0
#else
typedef double elem_t;
typedef double acc_t;
#define FLASH_TENSOR_CORES 0
#endif

#define POS_INF ((acc_t)__int_as_float(0x7f800000))
#define NEG_INF (-POS_INF)

constexpr int VEC = 16 / sizeof(elem_t);               // elements in one 16-byte access
constexpr int PAD = SMEM_PAD_BYTES / sizeof(elem_t);   // row pad of every shared tile

__device__ __forceinline__ float bits_to_float(unsigned short h) {
#if FLASH_DTYPE == 0
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float(((unsigned)h) << 16);
#endif
}

// two floats -> two packed 16-bit values, round to nearest even; `lo` in the low half
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
#if FLASH_DTYPE == 0
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ acc_t to_acc(elem_t x) {
#if FLASH_TENSOR_CORES
    return bits_to_float(x);
#else
    return x;
#endif
}

__device__ __forceinline__ elem_t from_acc(acc_t x) {
#if FLASH_TENSOR_CORES
    return (elem_t)(pack2(x, 0.f) & 0xffffu);
#else
    return x;
#endif
}

__device__ __forceinline__ acc_t exp2_acc(acc_t x) {
#if FLASH_DTYPE == 3
    return exp2(x);
#else
    return exp2f(x);
#endif
}

// ---------------------------------------------------------------------------
// Batch layout: the flat broadcast batch index b is split over up to three
// collapsed batch dims (n0, n1, n2); each tensor has its own element strides
// for them (0 along a broadcast dim) and a row stride. Head-dim stride is 1.
// ---------------------------------------------------------------------------
struct BatchIndex { i64 b0, b1, b2; };

__device__ __forceinline__ BatchIndex split_batch(i64 b, i64 n1, i64 n2) {
    BatchIndex r;
    r.b2 = b % n2;
    r.b1 = (b / n2) % n1;
    r.b0 = b / (n1 * n2);
    return r;
}

__device__ __forceinline__ i64 batch_offset(BatchIndex bi, i64 s0, i64 s1, i64 s2) {
    return bi.b0 * s0 + bi.b1 * s1 + bi.b2 * s2;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// ---------------------------------------------------------------------------
// Global -> shared tile loads. `rows_valid` rows of `d` columns are copied into
// a (ROWS, COLS) shared tile with row pitch COLS + PAD; everything else,
// ragged rows and the head-dim padding alike, is written as zero (a NaN left
// in padding would survive 0 * NaN in the next product). `vec` says the
// global rows are 16-byte aligned and d % VEC == 0 (checked in Python).
// ---------------------------------------------------------------------------
template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile(elem_t* __restrict__ s_tile,          // (ROWS, COLS + PAD)
                                          const elem_t* __restrict__ g,        // (rows_valid, d), row stride
                                          i64 row_stride, int rows_valid, int d, bool vec,
                                          int tid, int nthreads) {
    constexpr int PITCH = COLS + PAD;
    if (vec) {
        constexpr int CHUNKS = COLS / VEC;
        for (int c = tid; c < ROWS * CHUNKS; c += nthreads) {
            const int r = c / CHUNKS, col = (c % CHUNKS) * VEC;
            uint4 val = make_uint4(0u, 0u, 0u, 0u);
            if (r < rows_valid && col < d)
                val = *reinterpret_cast<const uint4*>(g + r * row_stride + col);
            *reinterpret_cast<uint4*>(s_tile + r * PITCH + col) = val;
        }
    } else {
        for (int c = tid; c < ROWS * COLS; c += nthreads) {
            const int r = c / COLS, col = c % COLS;
            elem_t val = (elem_t)0;
            if (r < rows_valid && col < d) val = g[r * row_stride + col];
            s_tile[r * PITCH + col] = val;
        }
    }
}

// The same tile through cp.async (16-byte copies that bypass registers; out-of-range
// chunks are zero-filled by the copy itself). Only for `vec` layouts; completes at
// cp_async_wait, as a group with everything issued since the last cp_async_commit.
template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile_async(elem_t* __restrict__ s_tile,      // (ROWS, COLS + PAD)
                                                const elem_t* __restrict__ g,    // (rows_valid, d), row stride
                                                i64 row_stride, int rows_valid, int d, int tid, int nthreads) {
    constexpr int PITCH = COLS + PAD, CHUNKS = COLS / VEC;
    for (int c = tid; c < ROWS * CHUNKS; c += nthreads) {
        const int r = c / CHUNKS, col = (c % CHUNKS) * VEC;
        const bool valid = r < rows_valid && col < d;
        const elem_t* src = valid ? g + r * row_stride + col : g;   // not read when invalid
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(smem_addr(s_tile + r * PITCH + col)), "l"(src), "r"(valid ? 16 : 0) : "memory");
    }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory"); }

template <int NT>
__device__ __forceinline__ void zero_frag(acc_t (&c)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[n][e] = (acc_t)0;
}

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

template <int NT, int K, bool A_T, bool B_T>
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

#else  // exact float32 / float64 FMA on the same fragment layout

// Products are summed in blocks of K_BLOCK terms, each block's partial sum
// then added to c: a two-level sum whose rounding error grows with
// K_BLOCK + K / K_BLOCK rather than K, as a tensor core's k-steps do.
constexpr int K_BLOCK = 16;

template <int NT, int K, bool A_T, bool B_T>
__device__ __forceinline__ void warp_mma(acc_t (&c)[NT][4],
                                         const elem_t* __restrict__ a, int lda,
                                         const elem_t* __restrict__ b, int ldb) {
    static_assert(K % K_BLOCK == 0, "FMA warp tiles sum K in blocks of K_BLOCK");
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    for (int k0 = 0; k0 < K; k0 += K_BLOCK) {
        acc_t part[NT][4];
        zero_frag(part);
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
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[n][e] += part[n][e];
    }
}

#endif

// Write a warp's (16, 8*NT) accumulator tile into shared memory as elem_t
// (row pitch ld), e.g. P_ij before it multiplies V_j.
template <int NT>
__device__ __forceinline__ void store_frag_smem(elem_t* __restrict__ s, int ld, const acc_t (&c)[NT][4]) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int col = n * 8 + 2 * t;
#if FLASH_TENSOR_CORES
        *reinterpret_cast<unsigned*>(s + g * ld + col) = pack2(c[n][0], c[n][1]);
        *reinterpret_cast<unsigned*>(s + (g + 8) * ld + col) = pack2(c[n][2], c[n][3]);
#else
        s[g * ld + col] = c[n][0];
        s[g * ld + col + 1] = c[n][1];
        s[(g + 8) * ld + col] = c[n][2];
        s[(g + 8) * ld + col + 1] = c[n][3];
#endif
    }
}

// Reductions over one accumulator row: the four lanes of a quad share a row.
__device__ __forceinline__ acc_t quad_max(acc_t x) {
    x = max(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return max(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ acc_t quad_sum(acc_t x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------------------------------------
// The one place that decides which scores are visible. Every mask or score
// modifier (causal today; windows, ALiBi, softcap later) belongs here.
// Causal is bottom-right aligned: query i sees key j iff j <= i + (Nk - Nq).
// ---------------------------------------------------------------------------
__device__ __forceinline__ bool key_visible(int q_row, int k_col, int Nq, int Nk, bool causal) {
    return k_col < Nk && (!causal || k_col <= q_row + (Nk - Nq));
}

// Pairs of adjacent columns (2t, 2t+1), as one accumulator fragment holds them.
template <typename X> struct Pair;
template <> struct Pair<float> { typedef float2 type; };
template <> struct Pair<double> { typedef double2 type; };

__device__ __forceinline__ void load_acc_pair(const acc_t* p, acc_t& a, acc_t& b) {
    const typename Pair<acc_t>::type v = *reinterpret_cast<const typename Pair<acc_t>::type*>(p);
    a = v.x;
    b = v.y;
}

__device__ __forceinline__ void store_acc_pair(acc_t* p, acc_t a, acc_t b) {
    typename Pair<acc_t>::type v;
    v.x = a;
    v.y = b;
    *reinterpret_cast<typename Pair<acc_t>::type*>(p) = v;
}

// Columns col, col+1 of a row of `d` elem_t values (col even); ragged and odd d handled.
__device__ __forceinline__ void store_row_pair(elem_t* row, int col, int d, acc_t a, acc_t b) {
    if (col + 1 < d && d % 2 == 0) {
#if FLASH_TENSOR_CORES
        *reinterpret_cast<unsigned*>(row + col) = pack2(a, b);
#else
        typename Pair<acc_t>::type v;
        v.x = a;
        v.y = b;
        *reinterpret_cast<typename Pair<acc_t>::type*>(row + col) = v;
#endif
    } else {
        if (col < d) row[col] = from_acc(a);
        if (col + 1 < d) row[col + 1] = from_acc(b);
    }
}
