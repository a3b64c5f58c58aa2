// nonfinite.cuh — scans of shared tiles for inf and NaN (exact masked pairs).

#pragma once

#include "types.cuh"

// Masked pairs and non-finite operands. A tile product forms a term for every
// pair of its tile, a masked pair's as 0 · x, and 0 · inf or 0 · NaN is NaN
// where the reference (a masked pair has no term) has none. So the kernels
// scan the operand tiles of every tile with masked pairs (the causal diagonal
// ones; ragged ends need nothing: rows and keys past them load as zeros), and
// where one holds an inf or NaN they flag the output tiles its products reach.
// flash_repair.cu then recomputes the flagged rows over their visible pairs
// only. The scan reads tiles already in shared memory, the flags are plain
// stores of 1 into a zeroed array, and finite inputs never take the repair.
// Which tiles have masked pairs is the mask's answer (mask.cuh: Mask::has_masked_pairs).

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

#if FLASH_FP8
// The same question of `rows` rows of `cols` float8 e4m3 operands (a multiple of IN_VEC), `pitch` apart:
// e4m3fn has no inf, and a NaN is a byte whose seven low bits are all set (a byte of w & 0x7f7f7f7f
// equal to 0x7f: one of w' = ~(w | 0x80808080)'s bytes zero)
__device__ __forceinline__ bool rows_nan_e4m3(const in_t* s, int rows, int cols, int pitch, int tid, int threads) {
    const int chunks = cols / IN_VEC;
    unsigned found = 0u;
    auto zero_byte = [](unsigned w) { return (w - 0x01010101u) & ~w & 0x80808080u; };
#pragma unroll 1
    for (int c = tid; c < rows * chunks; c += threads) {
        const uint4 x = *reinterpret_cast<const uint4*>(s + (c / chunks) * pitch + c % chunks * IN_VEC);
        found |= zero_byte(~(x.x | 0x80808080u)) | zero_byte(~(x.y | 0x80808080u))
               | zero_byte(~(x.z | 0x80808080u)) | zero_byte(~(x.w | 0x80808080u));
    }
    return found != 0u;
}
#endif

// The same question of `n` acc_t values in shared memory
__device__ __forceinline__ bool values_nonfinite(const acc_t* s, int n, int tid, int threads) {
    acc_t acc = 0;
#pragma unroll 1
    for (int c = tid; c < n; c += threads) acc = fma(s[c], (acc_t)0, acc);
    return acc != acc;
}

// Whether every value this thread copied into a (ROWS, COLS) tile (its chunks or elements in
// copy.cuh's load_tile / load_tile_async order, so visible to it without a barrier) is finite and
// below 2^127 in magnitude: the operands 3xTF32 may split without guards (mma_sm80.cuh, Split).
// One compare per value, of its magnitude bits against those of 2^127; false but for 3xTF32.
template <int ROWS, int COLS>
__device__ __forceinline__ bool own_copies_plain(const elem_t* s_tile, bool vec, int tid, int nthreads) {
    if constexpr (!TF32_SPLITS) {
        return false;
    } else {
        constexpr int PITCH = COLS + PAD;
        const unsigned* s = reinterpret_cast<const unsigned*>(s_tile);
        unsigned most = 0;   // the largest magnitude's bits (a NaN's exceed inf's)
        if (vec) {
            constexpr int CHUNKS = COLS / VEC;
#pragma unroll 1
            for (int c = tid; c < ROWS * CHUNKS; c += nthreads) {
                const uint4 x = *reinterpret_cast<const uint4*>(s + (c / CHUNKS) * PITCH + (c % CHUNKS) * VEC);
                most = max(most, max(max(x.x & 0x7fffffffu, x.y & 0x7fffffffu), max(x.z & 0x7fffffffu, x.w & 0x7fffffffu)));
            }
        } else {
#pragma unroll 1
            for (int c = tid; c < ROWS * COLS; c += nthreads) most = max(most, s[(c / COLS) * PITCH + c % COLS] & 0x7fffffffu);
        }
        return most < 0x7f000000u;
    }
}

// __syncthreads(), and for 3xTF32 whether `mine` (own_copies_plain answers) holds in every thread
__device__ __forceinline__ bool sync_all_plain(bool mine) {
    if constexpr (TF32_SPLITS) return __syncthreads_and(mine);
    __syncthreads();
    return false;
}
