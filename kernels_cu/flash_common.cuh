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
//   FLASH_Q_STAGES, FLASH_CTAS_PER_SM   Q buffers and CTAs per SM of the persistent Hopper forward
//
// Warp tiles follow the mma.sync m16n8k16 fragment layout for every dtype:
// lane = 4*g + t owns rows (g, g+8) and columns (2t, 2t+1) of each 16x8
// accumulator tile, `acc[n][0..3]` = {(g,2t), (g,2t+1), (g+8,2t), (g+8,2t+1)}.
// float16/bfloat16 multiply on tensor cores (ldmatrix + mma.sync, float32
// accumulate); float32 and float64 run the same tiles as exact FMA loops, so
// the softmax, masking and store code is one code for all four dtypes.

#pragma once

#ifndef FLASH_WGMMA
#define FLASH_WGMMA 0   // 1: the sm_90a warpgroup-MMA kernels (16-bit dtypes only)
#endif
#ifndef FLASH_ORDERED
#define FLASH_ORDERED 0   // 1: the backward's sums in grid order (deterministic=True; "Ordered sums" below)
#endif

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
[[maybe_unused]] constexpr int PAD = SMEM_PAD_BYTES / sizeof(elem_t);   // row pad of every shared tile

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

// Grid order of the (tile, batch*head) work: heads in groups of `group` (the host sizes a group to
// fit L2), tile-major inside a group. The CTAs resident at once then share a few heads' tensors in
// L2, and tile 0 (the caller's heaviest when causal) of every head in a group starts first, which
// balances the causal load. One-CTA-per-tile kernels launch count * tiles CTAs (grid_tile); the
// persistent Hopper forward walks the order with fewer (grid_tile_at).
struct GridTile { i64 bh; int tile; };

// Tile `index` of the grid order of `heads` heads of `tiles` tiles each (32-bit: heads * tiles < 2^32)
__device__ __forceinline__ GridTile grid_tile_at(unsigned index, unsigned heads, int tiles, int group) {
    const unsigned per_group = (unsigned)group * tiles;
    const unsigned first = index / per_group * group;   // the group's first head
    const unsigned size = min((unsigned)group, heads - first);
    const unsigned r = index - first * tiles;
    return {(i64)(first + r % size), (int)(r / size)};
}

// This CTA's tile, one CTA per tile
__device__ __forceinline__ GridTile grid_tile(int tiles, int group) {
    return grid_tile_at(blockIdx.x, gridDim.x / tiles, tiles, group);
}

// Ordered sums (the backward's deterministic=True). The CTAs that add into one sum (dQ_i over the
// K/V tiles j; dK_j, dV_j over the batch entries that share a K/V head) take turns in grid order: a
// counter per sum holds how many have added, a CTA waits until it reads its rank, adds, and counts
// itself. Float addition then runs in one order every run. A CTA waits only on CTAs before it in the
// grid, which the hardware starts no later, so the waits cannot close a cycle.

// one thread; the barrier after it orders the rest of the CTA behind the other CTAs' adds
__device__ __forceinline__ void wait_turn(const unsigned* counter, unsigned rank) {
    unsigned seen;
    for (;;) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        if (seen == rank) return;
        __nanosleep(64);
    }
}

// one thread, after a barrier behind all of the CTA's adds
__device__ __forceinline__ void end_turn(unsigned* counter) {
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
}

// The rank of batch entry `bi` among those that share a broadcast input's entry: its index over the
// dims along which the input broadcasts (batch strides s0, s1, s2 zero there)
__device__ __forceinline__ unsigned broadcast_rank(BatchIndex bi, i64 n1, i64 n2, i64 s0, i64 s1, i64 s2) {
    i64 r = s0 == 0 ? bi.b0 : 0;
    if (s1 == 0) r = r * n1 + bi.b1;
    if (s2 == 0) r = r * n2 + bi.b2;
    return (unsigned)r;
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

// ---------------------------------------------------------------------------
// Hopper warpgroup MMA (sm_90a; FLASH_WGMMA kernels only). A warpgroup of four
// consecutive warps computes D (64, N) += A (64, 16) B (16, N): warp w of the
// group owns rows 16w .. 16w+15 of D in exactly the mma.sync accumulator layout
// above (`d[n][e]`), and an A operand in registers is the m16n8k16 A fragment
// per warp (frag_to_a), so the softmax code is the same for both MMAs.
//
// Operands in shared memory use the 128-byte swizzle: a (ROWS, COLS) tile is
// stored as COLS/64 column blocks of (ROWS, 64) elements, one 128-byte line per
// row, and the 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its line.
// Eight rows make a 1024-byte swizzle atom (atoms must be 1024-byte aligned).
// K-major operands (Q, K: the contraction dim contiguous) step 16 columns by
// moving the start address 32 bytes; the N-major V steps 16 keys by 16 lines.
// ---------------------------------------------------------------------------
#if FLASH_WGMMA

#if FLASH_DTYPE == 0
#define WGMMA_AB "f16.f16"
#else
#define WGMMA_AB "bf16.bf16"
#endif

constexpr int SW_COLS = 64;           // elements of one 128-byte swizzled line
constexpr int SW_ATOM_BYTES = 1024;   // eight lines

// element offset of (r, c) in a swizzled (ROWS, *) tile
template <int ROWS>
__device__ __forceinline__ int sw128_offset(int r, int c) {
    return (c / SW_COLS) * ROWS * SW_COLS + r * SW_COLS + ((((c % SW_COLS) / VEC) ^ (r % 8)) * VEC) + c % VEC;
}

// load_tile / load_tile_async into a swizzled tile by THREADS threads: cp.async when `vec`, else plain
// loads. Either way the tensor cores read it through the async proxy (fence_proxy_async first).
// With vec each thread owns one 16-byte column chunk and walks down the rows, so a copy costs
// a few instructions (the copying warps run on few registers, setmaxnreg).
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_tile_sw128(elem_t* __restrict__ s_tile, const elem_t* __restrict__ g,
                                                i64 row_stride, int rows_valid, int d, bool vec, int tid) {
    constexpr int CHUNKS = COLS / VEC, ROWS_PER_PASS = THREADS / CHUNKS;
    static_assert(COLS % SW_COLS == 0 && ROWS % 8 == 0, "swizzled tiles are whole 64-column blocks of 8-row atoms");
    if (vec && THREADS % CHUNKS) {   // rows do not split evenly over the threads (D = 192)
#pragma unroll 1
        for (int c = tid; c < ROWS * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, col = (c % CHUNKS) * VEC;
            const bool valid = r < rows_valid && col < d;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                         :: "r"(smem_addr(s_tile + sw128_offset<ROWS>(r, col))),
                            "l"(valid ? g + r * row_stride + col : g), "r"(valid ? 16 : 0)
                         : "memory");
        }
    } else if (vec) {
        const int r_first = tid / CHUNKS, col = (tid % CHUNKS) * VEC;
        const elem_t* src = g + r_first * row_stride + col;
#pragma unroll 4
        for (int r = r_first; r < ROWS; r += ROWS_PER_PASS, src += ROWS_PER_PASS * row_stride) {
            const bool valid = r < rows_valid && col < d;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                         :: "r"(smem_addr(s_tile + sw128_offset<ROWS>(r, col))), "l"(valid ? src : g),
                            "r"(valid ? 16 : 0)
                         : "memory");   // an invalid chunk reads nothing and is zero-filled
        }
    } else {
#pragma unroll 1
        for (int c = tid; c < ROWS * COLS; c += THREADS) {
            const int r = c / COLS, col = c % COLS;
            elem_t val = (elem_t)0;
            if (r < rows_valid && col < d) val = g[r * row_stride + col];
            s_tile[sw128_offset<ROWS>(r, col)] = val;
        }
    }
}

// shared-memory matrix descriptor, 128-byte swizzle; offsets in bytes
__device__ __forceinline__ unsigned long long sw128_desc(const elem_t* p, unsigned lead_bytes, unsigned stride_bytes) {
    return (unsigned long long)((smem_addr(p) & 0x3FFFF) >> 4)
         | (unsigned long long)(lead_bytes >> 4) << 16
         | (unsigned long long)(stride_bytes >> 4) << 32
         | 1ull << 62;
}

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// the copy engine's completed writes to global memory, ordered before this thread's next generic ones
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(PENDING) : "memory"); }

// mbarriers (shared-memory arrival counters with a phase bit) hand tiles from producer to consumer threads
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}" :: "r"(smem_addr(bar)) : "memory");
}

// arrive once every cp.async this thread issued so far has landed (the barrier's count includes it)
__device__ __forceinline__ void mbar_arrive_cp_async(unsigned long long* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(smem_addr(bar)) : "memory");
}

// A producer thread's arrival on `full` once the tile copies it issued have landed: through
// cp.async (vec), or now, its plain stores fenced for the tensor cores' async proxy.
__device__ __forceinline__ void arrive_when_landed(unsigned long long* full, bool vec) {
    if (vec) {
        mbar_arrive_cp_async(full);
    } else {
        fence_proxy_async();
        mbar_arrive(full);
    }
}

// wait until the phase of parity `parity` has completed
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    } while (!done);
}

// named barrier `id` (1..15; 0 is __syncthreads) over `count` threads: wait for it, or only arrive
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}

// Bulk add of `bytes` (a multiple of 16, both addresses 16-byte aligned) from shared to global memory,
// done by the copy engine; `bulk_wait_read` waits until this thread's bulk operations have read
// their shared-memory sources, `bulk_wait` until they are complete.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst), "r"(smem_addr(src)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// give registers back (producer warpgroups) or take them (consumer warpgroups); all of a warpgroup runs it
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGS)); }

template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGS)); }

// Keep the compiler from touching an accumulator (or an A fragment) across an asynchronous
// wgmma: nothing reads or reuses the registers before the wait that precedes the pin.
template <int NT>
__device__ __forceinline__ void wgmma_pin(acc_t (&d)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[n][e]) :: "memory");
}

template <int KT>
__device__ __forceinline__ void wgmma_pin_a(unsigned (&a)[KT][4]) {
#pragma unroll
    for (int kk = 0; kk < KT; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[kk][e]) :: "memory");
}

// ss: D (+)= A B with A and B in shared memory (`accumulate` = 0 overwrites D); K-major unless
//     TRANS_A / TRANS_B = 1 (M-major A, N-major B).
// rs: D += A B with A in registers, B N-major (the V of P V).
template <int N> struct Wgmma;

template <> struct Wgmma<64> {
    template <int TRANS_A = 0, int TRANS_B = 0>
    static __device__ __forceinline__ void ss(acc_t (&d)[8][4], unsigned long long a_desc, unsigned long long b_desc,
                                              int accumulate) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." WGMMA_AB " "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                     : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
    }
    static __device__ __forceinline__ void rs(acc_t (&d)[8][4], const unsigned (&a)[4], unsigned long long b_desc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." WGMMA_AB " "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));
    }
};

template <> struct Wgmma<128> {
    template <int TRANS_A = 0, int TRANS_B = 0>
    static __device__ __forceinline__ void ss(acc_t (&d)[16][4], unsigned long long a_desc, unsigned long long b_desc,
                                              int accumulate) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." WGMMA_AB " "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                     : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
    }
    static __device__ __forceinline__ void rs(acc_t (&d)[16][4], const unsigned (&a)[4], unsigned long long b_desc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." WGMMA_AB " "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));
    }
};
#endif  // FLASH_WGMMA

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

// The larger of a and b, NaN if either is (fmax drops a NaN): a NaN score makes its row's m NaN,
// as it makes l and O.
__device__ __forceinline__ float nan_max(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ double nan_max(double a, double b) { return a > b || a != a ? a : b; }

// Reductions over one accumulator row: the four lanes of a quad share a row.
__device__ __forceinline__ acc_t quad_max(acc_t x) {
    x = nan_max(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return nan_max(x, __shfl_xor_sync(0xffffffffu, x, 2));
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

// Invisible keys of a warp's (16, 8*NT) score tile -> -inf: first row r0, first key kv0;
// `boundary` says a key of the tile may be invisible (else nothing to do).
template <int NT>
__device__ __forceinline__ void mask_scores(acc_t (&S)[NT][4], bool boundary, int r0, int kv0, int Nq, int Nk,
                                            bool causal) {
    if (!boundary) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!key_visible(r0 + g + (e / 2) * 8, kv0 + n * 8 + 2 * t + e % 2, Nq, Nk, causal)) S[n][e] = NEG_INF;
}

// ---------------------------------------------------------------------------
// Masked pairs and non-finite operands. A tile product forms a term for every
// pair of its tile, a masked pair's as 0 · x, and 0 · inf or 0 · NaN is NaN
// where the reference (a masked pair has no term) has none. So the kernels
// scan the operand tiles of every tile with masked pairs (the causal diagonal
// ones; ragged ends need nothing: rows and keys past them load as zeros), and
// where one holds an inf or NaN they flag the output tiles its products reach.
// flash_repair.cu then recomputes the flagged rows over their visible pairs
// only. The scan reads tiles already in shared memory, the flags are plain
// stores of 1 into a zeroed array, and finite inputs never take the repair.
// ---------------------------------------------------------------------------

// A scan folds each value x into an accumulator as x · 0 + acc: 0 while every x is finite, NaN from
// the first inf or NaN on. One FMA per 32-bit word of 16-bit values (f16x2 / bf16x2), per float,
// per double.
#if FLASH_TENSOR_CORES
typedef unsigned scan_t;   // a pair of elem_t

__device__ __forceinline__ void scan_word(scan_t& acc, unsigned w) {
#if FLASH_DTYPE == 0
    asm("fma.rn.f16x2 %0, %1, %2, %0;" : "+r"(acc) : "r"(w), "r"(0u));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %0;" : "+r"(acc) : "r"(w), "r"(0u));
#endif
}

__device__ __forceinline__ void scan_chunk(scan_t& acc, uint4 x) {
    scan_word(acc, x.x);
    scan_word(acc, x.y);
    scan_word(acc, x.z);
    scan_word(acc, x.w);
}

__device__ __forceinline__ bool scan_nonfinite(scan_t acc) {   // either half NaN
    return (acc & 0x7fffu) > (FLASH_DTYPE == 0 ? 0x7c00u : 0x7f80u)
           || (acc >> 16 & 0x7fffu) > (FLASH_DTYPE == 0 ? 0x7c00u : 0x7f80u);
}
#else
typedef acc_t scan_t;

__device__ __forceinline__ void scan_chunk(scan_t& acc, uint4 x) {
#if FLASH_DTYPE == 2
    acc = fmaf(__uint_as_float(x.x), 0.f, acc);
    acc = fmaf(__uint_as_float(x.y), 0.f, acc);
    acc = fmaf(__uint_as_float(x.z), 0.f, acc);
    acc = fmaf(__uint_as_float(x.w), 0.f, acc);
#else
    acc = fma(__hiloint2double((int)x.y, (int)x.x), 0.0, acc);
    acc = fma(__hiloint2double((int)x.w, (int)x.z), 0.0, acc);
#endif
}

__device__ __forceinline__ bool scan_nonfinite(scan_t acc) { return acc != acc; }
#endif

// This thread's share (of `threads`) of the question whether `rows` rows of `cols` elem_t (a
// multiple of VEC), `pitch` elements apart in shared memory, hold an inf or NaN; the caller acts on
// any thread's yes, with no vote (every thread that finds one raises the flag itself).
__device__ __forceinline__ bool rows_nonfinite(const elem_t* s, int rows, int cols, int pitch, int tid, int threads) {
    const int chunks = cols / VEC;
    scan_t acc = 0;
#pragma unroll 1
    for (int c = tid; c < rows * chunks; c += threads)
        scan_chunk(acc, *reinterpret_cast<const uint4*>(s + (c / chunks) * pitch + c % chunks * VEC));
    return scan_nonfinite(acc);
}

// The same question of `n` acc_t values in shared memory
__device__ __forceinline__ bool values_nonfinite(const acc_t* s, int n, int tid, int threads) {
    acc_t acc = 0;
#pragma unroll 1
    for (int c = tid; c < n; c += threads) acc = fma(s[c], (acc_t)0, acc);
    return acc != acc;
}

// A tile of first query row q0 and keys kv0 .. kv0+rows_k-1 has a masked pair that is not past a
// ragged end: a key after the last one row q0 sees
__device__ __forceinline__ bool tile_has_masked_pairs(int q0, int kv0, int rows_k, int Nq, int Nk, bool causal) {
    return causal && min(kv0 + rows_k, Nk) - 1 > q0 + (Nk - Nq);
}

// S_ij = scale Q_i K_j^T, rounded once as a naive attention rounds it; invisible keys -> -inf.
template <int NT>
__device__ __forceinline__ void scale_and_mask(acc_t (&S)[NT][4], acc_t scale, bool boundary, int r0, int kv0,
                                               int Nq, int Nk, bool causal) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[n][e] *= scale;
    mask_scores(S, boundary, r0, kv0, Nq, Nk, causal);
}

// The online softmax step (Algorithm 1, lines 10-11) on a warp's (16, 8*NT) score tile, in place:
//   m_new = max(m_i, rowmax(S_ij));  S_ij <- P~_ij = exp2((S_ij - m_new) c);  alpha = exp2((m_i - m_new) c)
// and rowsum(P~_ij) per accumulator row (g, g+8). The caller rescales l_i and O_i by alpha.
// Scores in natural units take c = log2 e; raw scores Q K^T take c = scale log2 e (scale > 0).
// The difference is taken first, where it is exact near the max, then scaled into the exponent.
template <int NT>
__device__ __forceinline__ void online_softmax(acc_t (&S)[NT][4], const acc_t (&m_i)[2], acc_t (&m_new)[2],
                                               acc_t (&alpha)[2], acc_t (&rowsum)[2], acc_t c) {
    acc_t m_use[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        acc_t mx = NEG_INF;
#pragma unroll
        for (int n = 0; n < NT; ++n) mx = nan_max(mx, nan_max(S[n][2 * h], S[n][2 * h + 1]));
        m_new[h] = nan_max(m_i[h], quad_max(mx));
        // a row with no visible key so far: exponentiate against 0, not -inf (-inf - -inf = NaN)
        m_use[h] = m_new[h] == NEG_INF ? (acc_t)0 : m_new[h];
        alpha[h] = exp2_acc((m_i[h] - m_use[h]) * c);
        rowsum[h] = (acc_t)0;
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            S[n][e] = exp2_acc((S[n][e] - m_use[e / 2]) * c);
            rowsum[e / 2] += S[n][e];
        }
    rowsum[0] = quad_sum(rowsum[0]);
    rowsum[1] = quad_sum(rowsum[1]);
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

// The epilogue of a warp's (16, 8*NT) O_i accumulator, first row r0, rows g and g+8 of each lane:
// O_i = diag(l_i)^-1 O_i into o (Nq, D), m_i m_scale (m_i of the online softmax in units of
// m_scale; -inf stays -inf) and l_i into m_out, l_out (Nq). A row that saw no key (l_i = 0) gets
// O_i = 0, whatever 0 · NaN met in P~ V where a masked key's value was not finite; NaN stays NaN.
template <int NT>
__device__ __forceinline__ void store_output_rows(elem_t* o, acc_t* m_out, acc_t* l_out, const acc_t (&O)[NT][4],
                                                  const acc_t (&m_i)[2], const acc_t (&l_i)[2], acc_t m_scale,
                                                  int r0, int Nq, int D) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + g + 8 * h;
        if (row >= Nq) continue;
        const bool none = l_i[h] == (acc_t)0;
        const acc_t inv_l = (acc_t)1 / l_i[h];   // inf where none: not used
#pragma unroll
        for (int n = 0; n < NT; ++n)
            store_row_pair(o + (i64)row * D, n * 8 + 2 * t, D, none ? (acc_t)0 : O[n][2 * h] * inv_l,
                           none ? (acc_t)0 : O[n][2 * h + 1] * inv_l);
        if (t == 0) {
            m_out[row] = m_i[h] == NEG_INF ? NEG_INF : m_i[h] * m_scale;
            l_out[row] = l_i[h];
        }
    }
}
