// layout.cuh — where a CTA's work lies: the collapsed batch, the grid order of (tile, head)
// work, and the ordered sums of the deterministic backward.

#pragma once

#include "types.cuh"

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
