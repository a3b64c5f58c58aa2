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

// rows_valid rows of d columns, row r at `row(r)` (row r of a strided matrix, or of a paged cache), into a
// (ROWS, COLS) shared tile, zero elsewhere, with plain element loads (any layout)
template <int ROWS, int COLS, class RowAt>
__device__ __forceinline__ void load_rows(elem_t* __restrict__ s_tile, const RowAt& row, int rows_valid, int d,
                                          int tid, int nthreads) {
    constexpr int PITCH = COLS + PAD;
    for (int c = tid; c < ROWS * COLS; c += nthreads) {
        const int r = c / COLS, col = c % COLS;
        elem_t val = (elem_t)0;
        if (r < rows_valid && col < d) val = row(r)[col];
        s_tile[r * PITCH + col] = val;
    }
}

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
        load_rows<ROWS, COLS>(s_tile, [&](int r) { return g + r * row_stride; }, rows_valid, d, tid, nthreads);
    }
}

// The same tile through cp.async (16-byte copies that bypass registers; out-of-range
// chunks are zero-filled by the copy itself). Only for `vec` layouts; completes at
// cp_async_wait, as a group with everything issued since the last cp_async_commit.
// `row(r)` is the address of global row r (row r of a strided matrix, or of a paged cache).
template <int ROWS, int COLS, class RowAt>
__device__ __forceinline__ void load_rows_async(elem_t* __restrict__ s_tile,      // (ROWS, COLS + PAD)
                                                const RowAt& row, int rows_valid, int d, int tid, int nthreads) {
    constexpr int PITCH = COLS + PAD, CHUNKS = COLS / VEC;
    for (int c = tid; c < ROWS * CHUNKS; c += nthreads) {
        const int r = c / CHUNKS, col = (c % CHUNKS) * VEC;
        const bool valid = r < rows_valid && col < d;
        const elem_t* src = valid ? row(r) + col : row(0);   // a 0-byte copy names row 0, never reads it
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(smem_addr(s_tile + r * PITCH + col)), "l"(src), "r"(valid ? 16 : 0) : "memory");
    }
}

template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile_async(elem_t* __restrict__ s_tile,      // (ROWS, COLS + PAD)
                                                const elem_t* __restrict__ g,    // (rows_valid, d), row stride
                                                i64 row_stride, int rows_valid, int d, int tid, int nthreads) {
    load_rows_async<ROWS, COLS>(s_tile, [&](int r) { return g + r * row_stride; }, rows_valid, d, tid, nthreads);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory"); }
