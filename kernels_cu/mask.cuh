// mask.cuh — the mask geometry: the one place that decides which (query, key) pairs are visible.
//
// Every kernel asks a Mask which tiles a tile must visit, which tiles need a per-element mask and
// which pairs are visible; no kernel writes a visibility expression of its own. A query row i sees
// the keys j of a band around its diagonal:
//     lo <= j - i <= hi,   0 <= j < Nk
// The causal mask (bottom-right aligned, off = Nk - Nq) is hi = off; a sliding window (left,
// right) is lo = off - left, hi = off + right; both together take the smaller hi. A side that
// bounds nothing is lo = -Nq, hi = Nk (the host's MaskGeometry.kernel_fields, cupyflash/_mask.py,
// the NumPy mirror with the same names). Both ends of a row's keys grow by one per row, so the keys
// a block of rows sees, and the rows a block of keys is seen by, are intervals with closed forms.
// Ragged ends (rows i >= Nq, keys j >= Nk) are never visible.
//
// Rows are query indices 0 <= i < Nq, keys 0 <= j; a query tile is rows [q0, q0 + rows), a key
// tile keys [k0, k0 + cols). The struct's functions also compile for the host, where
// tests/test_mask.py checks every answer against the pairs it describes.

#pragma once

#include "types.cuh"

struct Mask {
    int Nq, Nk;
    int lo, hi;   // query i sees key j iff lo <= j - i <= hi (and j < Nk); -Nq <= lo <= hi <= Nk

    // some pair inside the ragged ends is masked
    __host__ __device__ __forceinline__ bool banded() const { return lo > 1 - Nq || hi < Nk - 1; }

    // per element: query i sees key j (j >= 0); one unsigned compare for the band
    __host__ __device__ __forceinline__ bool visible(int i, int j) const {
        return j < Nk && (unsigned)(j - i - lo) <= (unsigned)(hi - lo);
    }

    // the keys query row i sees: [key_start(i), key_stop(i)) (empty when key_stop <= key_start)
    __host__ __device__ __forceinline__ int key_start(int i) const { return min(max(i + lo, 0), Nk); }
    __host__ __device__ __forceinline__ int key_stop(int i) const { return min(max(i + hi + 1, 0), Nk); }

    // the first query row that sees any key (every row from it on does); Nq if none does
    __host__ __device__ __forceinline__ int first_row() const { return Nk == 0 ? Nq : min(Nq, max(0, -hi)); }

    // one past the last key that a row of [q0, q1) sees (rows past Nq count as row Nq - 1); 0: none
    __host__ __device__ __forceinline__ int kv_stop(int q0, int q1) const {
        const int last = min(q1, Nq) - 1;
        return last >= max(q0, first_row()) ? key_stop(last) : 0;
    }

    // the first key that a row of [q0, ...) sees (the first row's that sees any)
    __host__ __device__ __forceinline__ int kv_start(int q0) const { return key_start(max(q0, first_row())); }

    // the first query row that sees a key of [k0, Nk); Nq or more: none does
    __host__ __device__ __forceinline__ int q_start(int k0) const { return max(first_row(), k0 - hi); }

    // one past the last query row that sees a key of [0, k1)
    __host__ __device__ __forceinline__ int q_stop(int k1) const { return min(Nq, max(0, k1 - lo)); }

    // The K/V tiles of B_C keys that the rows [q0, q0 + rows) visit: kv_tile_first .. kv_tile_stop - 1,
    // exactly the tiles with a visible pair. At least one: rows that see no key still write o = 0,
    // m = -inf, l = 0 (their tile masks every key); that tile is the one the next rows start at, so
    // it lies inside the range of any block of rows that holds these.
    template <int B_C>
    __host__ __device__ __forceinline__ int kv_tile_first(int q0) const {
        return max(0, min(kv_start(q0), Nk - 1)) / B_C;
    }
    template <int B_C>
    __host__ __device__ __forceinline__ int kv_tile_stop(int q0, int rows) const {
        return max(kv_tile_first<B_C>(q0) + 1, (kv_stop(q0, q0 + rows) + B_C - 1) / B_C);
    }

    // The Q tiles of B_R rows that see a key of the K/V tile [k0, k0 + B_C): q_tile_first .. q_tile_stop - 1
    // (none when q_tile_stop <= q_tile_first)
    template <int B_R>
    __host__ __device__ __forceinline__ int q_tile_first(int k0) const { return q_start(k0) / B_R; }
    template <int B_R, int B_C>
    __host__ __device__ __forceinline__ int q_tile_stop(int k0) const {
        const int start = q_start(k0), stop = q_stop(min(k0 + B_C, Nk));
        return stop > start ? (stop + B_R - 1) / B_R : start / B_R;
    }

    // The K/V tiles of B_C keys in which every pair with the rows [q0, q0 + rows) is visible (`full`):
    // full_tile_first .. full_tile_stop - 1, none when full_tile_stop <= full_tile_first
    template <int B_C>
    __host__ __device__ __forceinline__ int full_tile_first(int q0, int rows) const {
        return max(0, (q0 + rows - 1 + lo + B_C - 1) / B_C);
    }
    template <int B_C>
    __host__ __device__ __forceinline__ int full_tile_stop(int q0) const { return max(0, min(Nk, q0 + hi + 1)) / B_C; }

    // Every pair of rows [q0, q0 + rows) x keys [k0, k0 + cols) is visible, so the tile needs no
    // per-element mask (else some pair may be masked: visible() decides each). Ragged rows count
    // as rows: a tile that holds them is full only where they would see every key too.
    __host__ __device__ __forceinline__ bool full(int q0, int rows, int k0, int cols) const {
        return k0 + cols <= Nk && k0 + cols - 1 - q0 <= hi && k0 - (q0 + rows - 1) >= lo;
    }

    // The tile of rows [q0, q0 + rows) x keys [k0, k0 + cols) has a masked pair that is not past a
    // ragged end (ragged rows and keys load as zeros). Only such tiles can turn an inf or NaN operand
    // into a NaN of a masked pair (nonfinite.cuh).
    __host__ __device__ __forceinline__ bool has_masked_pairs(int q0, int rows, int k0, int cols) const {
        const int last_row = min(q0 + rows, Nq) - 1, last_key = min(k0 + cols, Nk) - 1;
        return last_row >= q0 && last_key >= k0 && (last_key - q0 > hi || k0 - last_row < lo);
    }
};

// mask_mod's tile map (FLASH_USER_MASK; FlexAttention's BlockMask): which tiles of B_R query rows x
// B_C keys a kernel visits, written before it by its own module's flash_tile_map and
// flash_tile_lists (tile_map.cuh) at its own tile sizes. A tile is visited iff some pair of it is
// visible under both the band and mask_mod; ALL_BIT marks those where mask_mod hides no pair the band
// leaves visible (no per-element mask_mod). One map head holds, at these byte offsets:
//     state     (T_r, T_c) bytes, 0: not visited, 1: visited, 2: visited and ALL
//     kv_count  (T_r) int32      the K/V tiles each Q tile visits ...
//     kv_list   (T_r, T_c)       ... ascending, each an index | ALL_BIT
//     q_count   (T_c)            the Q tiles that visit each K/V tile ...
//     q_list    (T_c, T_r)       ... ascending, each an index | ALL_BIT
// A map head per work head where mask_mod reads b (by_entry), else one per sequence (the same for
// every batch entry). cupyflash/_launch.py: tile_map_bytes mirrors the layout.
#ifdef FLASH_USER_MASK
constexpr bool TILE_MAP = true;
#else
constexpr bool TILE_MAP = false;
#endif

struct TileHead {
    unsigned char* state;
    int *kv_count, *kv_list, *q_count, *q_list;
    int T_r, T_c;
};

struct TileMap {
    static constexpr int ALL_BIT = 1 << 30;
    unsigned char* base;   // the map heads, head_bytes apart
    i64 head_bytes;
    int T_r, T_c;          // the kernel's tiles over the grid's lengths
    int by_entry;          // a map head per work head (mask_mod reads b), else per sequence

    __host__ __device__ static i64 state_bytes(int T_r, int T_c) { return ((i64)T_r * T_c + 15) / 16 * 16; }

    // the map head of sequence s of batch entry e (n sequences per entry)
    __device__ __forceinline__ TileHead head(i64 e, int s, int n) const {
        unsigned char* h = base + (by_entry ? e * n + s : (i64)s) * head_bytes;
        int* kv_count = reinterpret_cast<int*>(h + state_bytes(T_r, T_c));
        int* kv_list = kv_count + T_r;
        int* q_count = kv_list + (i64)T_r * T_c;
        return {h, kv_count, kv_list, q_count, q_count + T_c, T_r, T_c};
    }
};

// The tiles a loop visits, in order, by position p in [begin, end): tile p itself without a tile map
// (the band's interval), entry p of the map's list with one (begin 0)
struct Visits {
    const int* list;
    int begin, end;

    __device__ __forceinline__ int count() const { return end - begin; }
    // what tile_of and all_of read of position p: the map's list entry, or p itself without a map (a
    // loop can load it ahead of its waits)
    __device__ __forceinline__ int entry(int p) const { return TILE_MAP ? list[p] : p; }
    __device__ __forceinline__ static int tile_of(int e) { return TILE_MAP ? e & ~TileMap::ALL_BIT : e; }
    // mask_mod hides no pair of the tile that the band leaves visible (always without a map)
    __device__ __forceinline__ static bool all_of(int e) { return !TILE_MAP || (e & TileMap::ALL_BIT) != 0; }
    __device__ __forceinline__ int tile(int p) const { return tile_of(entry(p)); }
    __device__ __forceinline__ bool all(int p) const { return all_of(entry(p)); }
    // one past the position of the last tile below `stop`
    __device__ __forceinline__ int below(int stop) const {
        if constexpr (!TILE_MAP) return max(begin, min(end, stop));
        int p = end;
        while (p > begin && tile(p - 1) >= stop) --p;
        return p;
    }
    // the position of the first tile at or past `start`
    __device__ __forceinline__ int from(int start) const {
        if constexpr (!TILE_MAP) return max(begin, min(end, start));
        int p = begin;
        while (p < end && tile(p) < start) ++p;
        return p;
    }
    // split s of n (split-KV, FwdParams::kv_splits): the s-th of n runs of consecutive visits, their
    // lengths as equal as they come (none for s >= count)
    __device__ __forceinline__ Visits split(int s, int n) const {
        const int count = end - begin;
        return {list, begin + count * s / n, begin + count * (s + 1) / n};   // count * n < 2^31: n <= 256
    }
    // the rank of `tile` (one of the visits) among them: a binary search of the map's list
    __device__ __forceinline__ int rank(int tile_index) const {
        if constexpr (!TILE_MAP) return tile_index - begin;
        int lo = begin, hi = end - 1;
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (tile(mid) < tile_index) lo = mid + 1;
            else                        hi = mid;
        }
        return lo - begin;
    }
};

// The K/V tiles Q tile i (rows i B_R ..) visits: the band's (Mask::kv_tile_first .. kv_tile_stop - 1)
// or the map's
template <int B_R, int B_C>
__device__ __forceinline__ Visits kv_visits(const Mask& mask, const TileHead& tiles, int i) {
    if constexpr (TILE_MAP) return {tiles.kv_list + (i64)i * tiles.T_c, 0, tiles.kv_count[i]};
    return {nullptr, mask.kv_tile_first<B_C>(i * B_R), mask.kv_tile_stop<B_C>(i * B_R, B_R)};
}

// The Q tiles that visit K/V tile j: the band's (Mask::q_tile_first .. q_tile_stop - 1) or the map's
template <int B_R, int B_C>
__device__ __forceinline__ Visits q_visits(const Mask& mask, const TileHead& tiles, int j) {
    if constexpr (TILE_MAP) return {tiles.q_list + (i64)j * tiles.T_r, 0, tiles.q_count[j]};
    const int first = mask.q_tile_first<B_R>(j * B_C);
    return {nullptr, first, max(first, mask.q_tile_stop<B_R, B_C>(j * B_C))};
}

// One band for sequences of different lengths (packed variable-length sequences, params.cuh: Seqs):
// the window's sides, the causal mask's right side 0 (the smaller of both), UNBOUNDED where a side
// bounds nothing. `of` gives a sequence's Mask exactly as MaskGeometry.kernel_fields
// (cupyflash/_mask.py) gives a call's: lo = off - left, hi = off + right with off = Nk - Nq, a side
// that bounds no row at -Nq or Nk.
struct Band {
    static constexpr int UNBOUNDED = 0x7fffffff;
    int left, right;

    __host__ __device__ __forceinline__ Mask of(int Nq, int Nk) const {
        return {Nq, Nk, left < Nk - 1 ? Nk - Nq - left : -Nq, right < Nq - 1 ? Nk - Nq + right : Nk};
    }
};

// Invisible pairs of a warp's (16, 8*NT) score tile -> -inf: first row r0, first key kv0, rows g and
// g + 8 of each lane (mma_sm80.cuh); nothing to do where the tile is `full`.
template <int NT>
__device__ __forceinline__ void mask_scores(acc_t (&S)[NT][4], const Mask& mask, int r0, int kv0) {
    if (mask.full(r0, 16, kv0, 8 * NT)) return;
    const int lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!mask.visible(r0 + g + (e / 2) * 8, kv0 + n * 8 + 2 * t + e % 2)) S[n][e] = NEG_INF;
}
