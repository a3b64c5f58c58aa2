// tile_map.cuh — mask_mod's tile map (mask.cuh: TileMap), written by two kernels that each main
// kernel's module compiles where a mask_mod is compiled in, so the map's tiles are the kernel's own:
//     flash_tile_map     one CTA per tile (a grid-stride loop): its state, from mask_mod over the pairs
//                        the band leaves visible (tiles outside the band's range are not evaluated)
//     flash_tile_lists   one warp per Q tile row and per K/V tile column: the visited tiles, compacted
// Pairs past a sequence's lengths are never evaluated: mask_mod may read its arrays at q_idx, kv_idx.

#pragma once

#include "mask.cuh"
#include "params.cuh"
#include "score_mod.cuh"

constexpr int TILE_MAP_THREADS = 128;

// map head h's (a work head with by_entry, else a sequence) TileHead and work head (that of batch entry
// 0 for a sequence: mask_mod does not read b then)
template <class Params>
__device__ __forceinline__ TileHead map_head(const Params& p, i64 h) {
    const int n = p.seqs.n;
    return p.tiles.by_entry ? p.tiles.head(h / n, (int)(h % n), n) : p.tiles.head(0, (int)h, n);
}

template <int B_R, int B_C, class Params>
__device__ __forceinline__ void tile_map_states(const Params& p) {
    const TileMap& map = p.tiles;
    const i64 per_head = (i64)map.T_r * map.T_c, heads = map.by_entry ? p.seqs.heads : p.seqs.n;
    for (i64 tile = blockIdx.x; tile < heads * per_head; tile += gridDim.x) {
        const i64 h = tile / per_head;
        const int i = (int)(tile % per_head / map.T_c), j = (int)(tile % map.T_c);
        const Seq sq = seq_of(p, h);   // work head h, or sequence h of batch entry 0
        const Mask& mask = mask_of(p, sq);
        const EntryMods mods = mods_of(p, sq);
        const int q0 = i * B_R, k0 = j * B_C;
        bool seen = false, hidden = false;
        if (q0 < mask.Nq && k0 < mask.Nk && j >= mask.kv_tile_first<B_C>(q0) && j < mask.kv_tile_stop<B_C>(q0, B_R))
            for (int e = threadIdx.x; e < B_R * B_C; e += blockDim.x) {
                const int qi = q0 + e / B_C, kj = k0 + e % B_C;
                if (qi >= mask.Nq || !mask.visible(qi, kj)) continue;
                if (user_visible(mods.b, qi, kj, mods.user)) seen = true;
                else                                         hidden = true;
            }
        seen = __syncthreads_or(seen);
        hidden = __syncthreads_or(hidden);
        if (threadIdx.x == 0) map_head(p, h).state[(i64)i * map.T_c + j] = seen ? (hidden ? 1 : 2) : 0;
    }
}

template <class Params>
__device__ __forceinline__ void tile_map_lists(const Params& p) {
    const TileMap& map = p.tiles;
    const int lane = threadIdx.x % WARP_SIZE, per_cta = blockDim.x / WARP_SIZE;
    const i64 lines = (i64)(map.by_entry ? p.seqs.heads : p.seqs.n) * (map.T_r + map.T_c);
    for (i64 u = (i64)blockIdx.x * per_cta + threadIdx.x / WARP_SIZE; u < lines; u += (i64)gridDim.x * per_cta) {
        const i64 h = u / (map.T_r + map.T_c);
        const int r = (int)(u % (map.T_r + map.T_c));
        const TileHead t = map_head(p, h);
        const bool row = r < map.T_r;                 // Q tile r's K/V tiles, else K/V tile r - T_r's Q tiles
        const int line = row ? r : r - map.T_r, len = row ? map.T_c : map.T_r;
        int* list = row ? t.kv_list + (i64)line * map.T_c : t.q_list + (i64)line * map.T_r;
        int n = 0;
        for (int x0 = 0; x0 < len; x0 += WARP_SIZE) {
            const int x = x0 + lane;
            const unsigned char st = x < len ? t.state[row ? (i64)line * map.T_c + x : (i64)x * map.T_c + line] : 0;
            const unsigned visited = __ballot_sync(0xffffffffu, st != 0);
            if (st) list[n + __popc(visited & ((1u << lane) - 1))] = x | (st == 2 ? TileMap::ALL_BIT : 0);
            n += __popc(visited);
        }
        if (lane == 0) (row ? t.kv_count : t.q_count)[line] = n;
    }
}
