// flash_bwd_prep.cu — the steps around the backward's main kernel (flash_bwd.cu, flash_bwd_sm90.cu).
//
//   flash_bwd_prep   before it: zeroes the sums (BwdParams.zero; no memset on the host's side), and
//                    D_i = rowsum(dO_i o O_i) and the statistics the main kernel reads:
//                    m_i, 1/l_i for flash_bwd (m = +inf, 1/l = 0 for a row that saw no key: P = 0),
//                    lse_i log2 e = (m_i + log l_i) log2 e for flash_bwd_sm90 (+inf for such a row).
//                    B_R rows per CTA, NTHREADS / B_R lanes per row, each reading 16-byte vectors
//                    of O_i and dO_i where it can.
//   flash_convert    after it: the float32 (float64) sums dq_acc, dk_acc, dv_acc -> dq, dk, dv in the
//                    input dtype; blockIdx.y picks the sum, four elements per thread and step.

#include "layout.cuh"
#include "params.cuh"
#include "types.cuh"

constexpr int NTHREADS = FLASH_WARPS * WARP_SIZE;
constexpr int ROWS = FLASH_BR;                 // rows per CTA
constexpr int LANES = NTHREADS / ROWS;         // threads per row

static_assert(ROWS * LANES == NTHREADS && LANES <= WARP_SIZE && (LANES & (LANES - 1)) == 0, "a row's lanes in one warp");

// zero z's words with the grid's threads, from thread `first` in steps of `stride`
__device__ __forceinline__ void zero_words(const ZeroRange z, i64 first, i64 stride) {
    i64 done = 0;
    if ((reinterpret_cast<unsigned long long>(z.ptr) & 15) == 0) {
        uint4* vec = reinterpret_cast<uint4*>(z.ptr);
        for (i64 i = first; i < z.words / 4; i += stride) vec[i] = make_uint4(0u, 0u, 0u, 0u);
        done = z.words / 4 * 4;
    }
    for (i64 i = done + first; i < z.words; i += stride) z.ptr[i] = 0u;
}

extern "C" __global__ void __launch_bounds__(NTHREADS) flash_bwd_prep(const BwdParams p) {
#pragma unroll
    for (int z = 0; z < ZERO_RANGES; ++z)
        zero_words(p.zero[z], (i64)blockIdx.x * NTHREADS + threadIdx.x, (i64)gridDim.x * NTHREADS);
    const int Nq = p.seqs.rows_q, D = p.D;   // every row of every sequence
    const i64 rows = p.batch.count * Nq;
    const i64 row = ((i64)blockIdx.x * NTHREADS + threadIdx.x) / LANES;   // over (BH, rows_q)
    const int part = threadIdx.x % LANES;
    const bool valid = row < rows;   // no early return: the row's lanes meet in the shuffles below
    const i64 bh = valid ? row / Nq : 0;
    const int r = valid ? (int)(row % Nq) : 0;
    const BatchIndex bi = p.batch.split(bh);
    const elem_t* o_r = p.o.at(bi) + r * p.o.sn;
    const elem_t* do_r = p.dO.at(bi) + r * p.dO.sn;
    // D_i = rowsum(dO_i o O_i)
    acc_t acc = 0;
    if (valid && p.prep_vec) {
        for (int d = part * VEC; d < D; d += LANES * VEC) {
            elem_t a[VEC], b[VEC];
            *reinterpret_cast<uint4*>(a) = *reinterpret_cast<const uint4*>(o_r + d);
            *reinterpret_cast<uint4*>(b) = *reinterpret_cast<const uint4*>(do_r + d);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc += to_acc(a[e]) * to_acc(b[e]);
        }
    } else if (valid) {
        for (int d = part; d < D; d += LANES) acc += to_acc(o_r[d]) * to_acc(do_r[d]);
    }
#pragma unroll
    for (int s = LANES / 2; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (valid && part == 0) {
        const acc_t m = p.m[row], l = p.l[row];
        const bool seen = l != (acc_t)0;   // l = 0: no key; a NaN row's gradients are NaN
        p.Dsum[row] = acc;
        if (p.lse_stats) {
            p.lse2[row] = seen ? m * (acc_t)LOG2E + log2(l) : POS_INF;
        } else {
            p.m_b[row] = seen ? m : POS_INF;
            p.inv_l[row] = seen ? (acc_t)1 / l : (acc_t)0;
        }
    }
}

struct alignas(4 * sizeof(elem_t)) elem4 { elem_t x[4]; };

extern "C" __global__ void __launch_bounds__(NTHREADS) flash_convert(const BwdParams p) {
    const int part = blockIdx.y;   // 0: dq, 1: dk, 2: dv
    const i64 n = p.convert_elems[part];
    const acc_t* src = part == 0 ? p.dq_acc.ptr : part == 1 ? p.dk_acc : p.dv_acc;
    elem_t* dst = part == 0 ? p.dq : part == 1 ? p.dk.ptr : p.dv.ptr;
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
