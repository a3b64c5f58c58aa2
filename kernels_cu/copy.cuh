// copy.cuh — global -> shared tile copies (plain loads and cp.async) for the mma.sync kernels.

#pragma once

#include "types.cuh"

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
