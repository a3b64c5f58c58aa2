// sm90.cuh — Hopper building blocks: warpgroup MMA, the 128-byte swizzle, mbarriers, named
// barriers, bulk reductions and register reallocation (sm_90a only).
//
// Hopper warpgroup MMA (sm_90a, 16-bit operands, or float8 e4m3 ones: in_t). A warpgroup of four
// consecutive warps computes D (64, N) += A (64, 16) B (16, N) (float8: A (64, 32) B (32, N)): warp w
// of the group owns rows 16w .. 16w+15 of D in exactly the mma.sync accumulator layout
// of mma_sm80.cuh (`d[n][e]`), and an A operand in registers is the m16n8k16 A fragment
// per warp (frag_to_a; float8: frag_to_a_e4m3), so the softmax code is the same for both MMAs.
//
// Operands in shared memory use the 128-byte swizzle: a (ROWS, COLS) tile is
// stored as COLS/SW_COLS column blocks of (ROWS, SW_COLS) elements (64 16-bit ones, 128 float8),
// one 128-byte line per row, and the 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its line.
// Eight rows make a 1024-byte swizzle atom (atoms must be 1024-byte aligned).
// K-major operands (Q, K: the contraction dim contiguous) step one k-step (16 16-bit columns,
// 32 float8) by moving the start address 32 bytes; the N-major V steps 16 keys by 16 lines.
// float8 operands must be K-major, V too: the FP8 forward multiplies by V^T (flash_fwd_sm90.cu).

#pragma once

#include "types.cuh"

static_assert(FLASH_TENSOR_CORES, "the warpgroup-MMA kernels take float16 and bfloat16");

#if FLASH_DTYPE == 0
#define WGMMA_AB "f16.f16"
#else
#define WGMMA_AB "bf16.bf16"
#endif

constexpr int SW_COLS = 128 / sizeof(in_t);   // operand elements of one 128-byte swizzled line
constexpr int SW_ATOM_BYTES = 1024;   // eight lines

// element offset of (r, c) in a swizzled (ROWS, *) tile
template <int ROWS>
__device__ __forceinline__ int sw128_offset(int r, int c) {
    return (c / SW_COLS) * ROWS * SW_COLS + r * SW_COLS + ((((c % SW_COLS) / IN_VEC) ^ (r % 8)) * IN_VEC) + c % IN_VEC;
}

// load_tile / load_tile_async into a swizzled tile by THREADS threads: cp.async when `vec`, else plain
// loads. Either way the tensor cores read it through the async proxy (fence_proxy_async first).
// With vec each thread owns one 16-byte column chunk and walks down the rows, so a copy costs
// a few instructions (the copying warps run on few registers, setmaxnreg).
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_tile_sw128(in_t* __restrict__ s_tile, const in_t* __restrict__ g,
                                                i64 row_stride, int rows_valid, int d, bool vec, int tid) {
    constexpr int CHUNKS = COLS / IN_VEC, ROWS_PER_PASS = THREADS / CHUNKS;
    static_assert(COLS % SW_COLS == 0 && ROWS % 8 == 0, "swizzled tiles are whole 64-column blocks of 8-row atoms");
    if (vec && THREADS % CHUNKS) {   // rows do not split evenly over the threads (DP = 192): a column block at a time
#pragma unroll
        for (int cb = 0; cb < COLS / SW_COLS; ++cb)
            load_tile_sw128<ROWS, SW_COLS, THREADS>(s_tile + cb * ROWS * SW_COLS, g + cb * SW_COLS, row_stride,
                                                    rows_valid, d - cb * SW_COLS, vec, tid);
    } else if (vec) {
        const int r_first = tid / CHUNKS, col = (tid % CHUNKS) * IN_VEC;
        const in_t* src = g + r_first * row_stride + col;
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
            in_t val = (in_t)0;
            if (r < rows_valid && col < d) val = g[r * row_stride + col];
            s_tile[sw128_offset<ROWS>(r, col)] = val;
        }
    }
}

// load_tile_sw128 from key rows found through a paged cache's table (params.cuh: KeyRows, paged; any page
// size): `g`'s rows 0 .. rows_valid - 1, columns col0 .. col0 + d - 1. With vec each thread walks down its
// rows a pass at a time and looks a page up only where its rows cross into the next one.
template <int ROWS, int COLS, int THREADS, class Rows>
__device__ __forceinline__ void load_pages_sw128(in_t* __restrict__ s_tile, const Rows& g, int rows_valid, int d,
                                                 bool vec, int tid, int col0 = 0) {
    constexpr int CHUNKS = COLS / IN_VEC, ROWS_PER_PASS = THREADS / CHUNKS;
    static_assert(COLS % SW_COLS == 0 && ROWS % 8 == 0, "swizzled tiles are whole 64-column blocks of 8-row atoms");
    if (vec && THREADS % CHUNKS) {   // rows do not split evenly over the threads (DP = 192): a column block at a time
#pragma unroll
        for (int cb = 0; cb < COLS / SW_COLS; ++cb)
            load_pages_sw128<ROWS, SW_COLS, THREADS>(s_tile + cb * ROWS * SW_COLS, g, rows_valid, d - cb * SW_COLS,
                                                     vec, tid, col0 + cb * SW_COLS);
    } else if (vec) {
        const int r_first = tid / CHUNKS, col = (tid % CHUNKS) * IN_VEC;
        auto at = g.walk(r_first);
        int looked = -1;                 // the table entry `page` holds
        const in_t* page = g.base;
#pragma unroll 4
        for (int r = r_first; r < ROWS; r += ROWS_PER_PASS) {
            const bool valid = r < rows_valid && col < d;   // falls once along the walk: no entry past it is read
            if (valid && at.page != looked) {
                page = g.page_rows(at.page);
                looked = at.page;
            }
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                         :: "r"(smem_addr(s_tile + sw128_offset<ROWS>(r, col))),
                            "l"(valid ? page + at.row * g.sn + col0 + col : g.base), "r"(valid ? 16 : 0)
                         : "memory");   // an invalid chunk reads nothing and is zero-filled
            g.step(at, ROWS_PER_PASS);
        }
    } else {
#pragma unroll 1
        for (int c = tid; c < ROWS * COLS; c += THREADS) {
            const int r = c / COLS, col = c % COLS;
            in_t val = (in_t)0;
            if (r < rows_valid && col < d) val = g.row(r)[col0 + col];
            s_tile[sw128_offset<ROWS>(r, col)] = val;
        }
    }
}

// shared-memory matrix descriptor, 128-byte swizzle; offsets in bytes
__device__ __forceinline__ unsigned long long sw128_desc(const in_t* p, unsigned lead_bytes, unsigned stride_bytes) {
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

template <> struct Wgmma<96> {   // the scores of a 96-key tile (flash_fwd_sm90.cu at D = 192)
    template <int TRANS_A = 0, int TRANS_B = 0>
    static __device__ __forceinline__ void ss(acc_t (&d)[12][4], unsigned long long a_desc, unsigned long long b_desc,
                                              int accumulate) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n96k16.f32." WGMMA_AB " "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1, %51, %52;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3])
                     : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
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

// D (64, COLS) += A (64, 16 KT) B (16 KT, COLS) of a warpgroup, issued (the caller fences before and
// commits after): A as KT fragments in registers, B N-major in a swizzled (16 KT, COLS) tile, in
// instructions of 128 columns where COLS allows, else 64
template <int COLS, int KT>
__device__ __forceinline__ void wgmma_rs_tile(acc_t (&d)[COLS / 8][4], const unsigned (&a)[KT][4], const in_t* s_b) {
    constexpr int N = COLS % 128 == 0 ? 128 : 64;
    constexpr unsigned BLOCK = 16 * KT * SW_COLS * sizeof(in_t);   // bytes from one 64-column block to the next
#pragma unroll
    for (int kk = 0; kk < KT; ++kk)
#pragma unroll
        for (int nb = 0; nb < COLS / N; ++nb)
            Wgmma<N>::rs(*reinterpret_cast<acc_t(*)[N / 8][4]>(&d[nb * N / 8]), a[kk],
                         sw128_desc(s_b + sw128_offset<16 * KT>(kk * 16, nb * N), BLOCK, SW_ATOM_BYTES));
}

// The float8 P~ V product without shuffles. The A fragment of a k32 float8 wgmma holds, per thread, rows
// g and g + 8 (g = lane / 4) at columns 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3 (t = lane % 4); the
// accumulator of S_ij holds the same rows at columns 2t, 2t + 1 of every 8. So a thread's eight scores of
// keys 32kk + {2t, 2t+1, 8+2t, 9+2t, 16+2t, 17+2t, 24+2t, 25+2t} are packed, in that order, into the
// fragment's columns 32kk + {4t .. 4t+3, 16+4t .. 16+4t+3}, and V^T's column k of each 32 holds key
// e4m3_key_of(k) (flash_fp8_values): the product sums the same pairs.
__host__ __device__ constexpr int e4m3_key_of(int k) {   // k in [0, 32): the key V^T's column k holds
    return 16 * (k / 16) + 8 * (k % 4 / 2) + 2 * (k % 16 / 4) + k % 2;
}

#if FLASH_FP8
template <int NT>
__device__ __forceinline__ void frag_to_a_e4m3(unsigned (&a)[NT / 4][4], const acc_t (&c)[NT][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 4; ++kk) {
        const int n = 4 * kk;
        a[kk][0] = pack4_e4m3(c[n][0], c[n][1], c[n + 1][0], c[n + 1][1]);
        a[kk][1] = pack4_e4m3(c[n][2], c[n][3], c[n + 1][2], c[n + 1][3]);
        a[kk][2] = pack4_e4m3(c[n + 2][0], c[n + 2][1], c[n + 3][0], c[n + 3][1]);
        a[kk][3] = pack4_e4m3(c[n + 2][2], c[n + 2][3], c[n + 3][2], c[n + 3][3]);
    }
}
#endif

// float8 e4m3 operands, k = 32 per instruction, both K-major (no transposes): S_ij = Q_i K_j^T from shared
// memory (ss) and O_i += P~_ij V_j with P~ in registers (frag_to_a_e4m3) and V_j^T in shared memory (rs)
template <int N> struct WgmmaE4m3;

template <> struct WgmmaE4m3<64> {   // the PV product at D <= 64
    static __device__ __forceinline__ void rs(acc_t (&d)[8][4], const unsigned (&a)[4], unsigned long long b_desc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));
    }
};

template <> struct WgmmaE4m3<128> {
    static __device__ __forceinline__ void ss(acc_t (&d)[16][4], unsigned long long a_desc, unsigned long long b_desc,
                                              int accumulate) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                     : "l"(a_desc), "l"(b_desc), "r"(accumulate));
    }
    static __device__ __forceinline__ void rs(acc_t (&d)[16][4], const unsigned (&a)[4], unsigned long long b_desc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));
    }
};

// D (64, COLS) += A (64, 32 KT) B (32 KT, COLS) of a warpgroup in float8, issued: A as KT fragments in
// registers, B K-major: B^T a swizzled (COLS, 32 KT) tile (rows of COLS, the K contiguous)
template <int COLS, int KT>
__device__ __forceinline__ void wgmma_rs_tile_e4m3(acc_t (&d)[COLS / 8][4], const unsigned (&a)[KT][4], const in_t* s_bt) {
    static_assert((COLS == 64 || COLS == 128) && 32 * KT <= SW_COLS, "one instruction over one swizzle column block");
#pragma unroll
    for (int kk = 0; kk < KT; ++kk)
        WgmmaE4m3<COLS>::rs(d, a[kk], sw128_desc(s_bt + sw128_offset<COLS>(0, kk * 32), 16, SW_ATOM_BYTES));
}
