// flash_merge.cu — attention over a key set split into disjoint parts, from the parts' outputs and
// statistics (FlashAttention V1's m, l): row by row,
//
//   m = max_p m_p,   w_p = l_p e^(m_p - m),   l = sum_p w_p,   o = sum_p (w_p / l) o_p
//
// over the parts that saw a key (l_p != 0); a row that no part saw is o = 0, m = -inf, l = 0, and a
// NaN anywhere in a seen part's statistics makes the row NaN. Parts are added in order p = 0, 1, ...
// (one order: the result does not depend on the launch). `lanes` threads per row, each owning VEC
// columns at a time (16-byte accesses where MergeParams::vec); every lane reads the row's statistics
// itself, so the lanes of a row never meet. Where a lane's columns are one 16-byte block of each of at
// most AHEAD parts of 16-bit values (split-KV's merges, D <= 256), it loads all of them before it reads
// the statistics: every load of the row in flight at once, none waiting on the weights.

#include "params.cuh"
#include "types.cuh"

constexpr int NTHREADS = FLASH_WARPS * WARP_SIZE;

// products and sums rounded one at a time, never fused into an FMA (which rounds a + b c once and so
// would make a merge depend on its parts' order): two parts merge the same in either order
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

struct alignas(16) Vec { elem_t x[VEC]; };

// the most parts whose blocks a lane holds in registers at once: 4 takes 48 registers a thread where 8 took 60,
// more rows in flight per SM (H100, fp16, D 128: 2 parts 1.16-1.22x, 4 parts 1.09-1.12x; 8 parts, now the
// other path, 0.93-1.01x; RESULTS.md, twenty-first session)
constexpr int AHEAD = 4;

// acc += w_p o_p over the parts in order, where `adds` (a seen part: an empty one adds nothing, not 0 · NaN)
__device__ __forceinline__ void add_part(acc_t (&acc)[VEC], acc_t w, bool adds, const Vec& v) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = add_rn(acc[e], adds ? mul_rn(w, to_acc(v.x[e])) : (acc_t)0);
}

// a part's weight in the merged row: l_p e^(m_p - m) / l (one seen part: 1 exactly)
__device__ __forceinline__ acc_t part_weight(const MergeParams& p, int part, i64 row, acc_t m, acc_t l) {
    return mul_rn(p.l.at(part)[row], exp_acc(p.m.at(part)[row] - m)) / l;
}

// the merged statistics of `row`: m (-inf for a row no part saw, NaN if a seen part's is) and l
__device__ __forceinline__ void merged_stats(const MergeParams& p, i64 row, acc_t& m, acc_t& l) {
    m = NEG_INF;
    for (int part = 0; part < p.parts; ++part) {
        const acc_t l_p = p.l.at(part)[row], m_p = p.m.at(part)[row];
        if (l_p != (acc_t)0 && (m_p > m || m_p != m_p)) m = m_p;   // a NaN wins, and stays
    }
    l = 0;
    if (m == NEG_INF) return;
    for (int part = 0; part < p.parts; ++part) {
        const acc_t l_p = p.l.at(part)[row];
        if (l_p != (acc_t)0) l = add_rn(l, mul_rn(l_p, exp_acc(p.m.at(part)[row] - m)));
    }
}

extern "C" __global__ void __launch_bounds__(NTHREADS) flash_merge(const MergeParams p) {
    const i64 thread = (i64)blockIdx.x * NTHREADS + threadIdx.x;
    const i64 row = thread / p.lanes;
    const int lane = (int)(thread - row * p.lanes);
    if (row >= p.rows) return;
    const int step = p.vec ? VEC : 1, d0 = lane * step;
    // (16-bit: the decoding merges; at 32 and 64 bits ptxas spilled around the divisions' slow path)
    if (sizeof(elem_t) == 2 && p.vec && p.parts <= AHEAD && d0 < p.D && d0 + p.lanes * step >= p.D) {
        Vec o_ahead[AHEAD];
#pragma unroll
        for (int part = 0; part < AHEAD; ++part)
            if (part < p.parts) o_ahead[part] = *reinterpret_cast<const Vec*>(p.o.at(part) + row * p.D + d0);
        acc_t m, l, acc[VEC];
        merged_stats(p, row, m, l);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = 0;
        if (m != NEG_INF)   // a row no part saw stays 0
#pragma unroll
            for (int part = 0; part < AHEAD; ++part)
                if (part < p.parts) add_part(acc, part_weight(p, part, row, m, l), p.l.at(part)[row] != (acc_t)0,
                                             o_ahead[part]);
        Vec v;
#pragma unroll
        for (int e = 0; e < VEC; ++e) v.x[e] = from_acc(acc[e]);
        *reinterpret_cast<Vec*>(p.o_out + row * p.D + d0) = v;
        if (lane == 0) {
            p.m_out[row] = m;
            p.l_out[row] = l;
        }
        return;
    }
    // the lane's first columns of every part on their way to L2 while the statistics are read
    if (d0 < p.D)
        for (int part = 0; part < p.parts; ++part)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p.o.at(part) + row * p.D + d0));
    acc_t m, l;
    merged_stats(p, row, m, l);
    const bool seen = m != NEG_INF;   // a row no part saw stays 0
    for (int d = d0; d < p.D; d += p.lanes * step) {
        acc_t acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = 0;
        // no branch on a part's statistics before its loads: several parts' loads in flight at once
#pragma unroll 4
        for (int part = 0; seen && part < p.parts; ++part) {
            const acc_t w = part_weight(p, part, row, m, l);
            const bool adds = p.l.at(part)[row] != (acc_t)0;
            const elem_t* o_p = p.o.at(part) + row * p.D + d;
            if (p.vec) add_part(acc, w, adds, *reinterpret_cast<const Vec*>(o_p));
            else       acc[0] = add_rn(acc[0], adds ? mul_rn(w, to_acc(*o_p)) : (acc_t)0);
        }
        elem_t* out = p.o_out + row * p.D + d;
        if (p.vec) {
            Vec v;
#pragma unroll
            for (int e = 0; e < VEC; ++e) v.x[e] = from_acc(acc[e]);
            *reinterpret_cast<Vec*>(out) = v;
        } else {
            *out = from_acc(acc[0]);
        }
    }
    if (lane == 0) {
        p.m_out[row] = m;
        p.l_out[row] = l;
    }
}
