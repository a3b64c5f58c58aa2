// flash_fwd_sm90.cu — the V2 forward (flash_fwd_v2.cu's schedule and outputs) on Hopper's
// warpgroup MMA, for float16/bfloat16 on sm_90a.
//
// It follows FlashAttention-3 (Shah et al., 2024): warp specialisation with a producer warpgroup
// and register reallocation (section 3.1), ping-pong scheduling of the consumer warpgroups (3.1)
// and the intra-warpgroup overlap of one step's softmax with the previous step's P~ V (3.2). It
// differs in its copies (cp.async from the producer, not TMA).
//
// FP8 (the fwd_fp8 family, FLASH_FP8): q, k, v are float8 e4m3 (in_t), o is 16-bit, both products run
// on float8 operands (FA3 section 3.3, without its incoherent processing) at twice the 16-bit rate. A
// float8 operand from shared memory must be K-major, so the PV product reads V^T, which
// flash_fp8_values (below) writes before the main kernel: (DK, keys) per batch entry of v, zero past
// D and Nk, the keys of each 32 permuted so that P~_ij's accumulator registers are the A fragments
// as they stand (frag_to_a_e4m3: no shuffles). P~_ij is rounded to float8 before P~_ij V_j; l_i sums it
// unrounded. S_ij and O_i take the descales of q and k (in the scale, times the batch entry's where the call
// gave them per entry: Descales) and of v (the epilogue's, likewise).
//
// Same loop order as flash_fwd_v2.cu: per (Q tile i, batch*head), O_i, m_i, l_i in registers,
// normalisation deferred to the end. What changes is who does what, and that the CTAs are
// persistent: the host launches one per SM slot and each claims tile after tile of the grid order
// (grid_tile_at) from a counter, so one tile's first loads run under the last steps of the one
// before, and the causal load balances itself. The CTA is 1 + CONSUMERS warpgroups (four warps each), specialised:
//
//   producer   warpgroup 0 copies each Q_i into a ring of Q_STAGES buffers, then its K_j and V_j
//              (a paged cache's rows through its table) into a ring of STAGES buffers (cp.async),
//              each buffer guarded by a "full" and an
//              "empty" mbarrier; the K/V ring runs on from tile to tile; it scans each V_j of a
//              tile with masked pairs for inf and NaN (nonfinite.cuh) while it waits to refill
//              the buffer;
//   consumers  warpgroups 1 .. CONSUMERS own 64 query rows each and issue wgmma, which reads
//              Q_i, K_j and V_j straight from swizzled shared memory (S_ij = Q_i K_j^T) and P~_ij
//              from registers (O_i += P~_ij V_j). The producer hands its registers to them
//              (setmaxnreg).
//
// As the CTA ends, its consumers recompute the rows of the Q tiles its producer flagged (repair.cuh),
// where flash_fwd_repair would after the kernel: a call with finite inputs pays one barrier for it. Not
// in the packed-sequence kernels (SELF_REPAIR): with that code after their loop ptxas moved the loop's
// warp-uniform work (the sequence's and tile's indices) off the uniform datapath, and the packed forward
// ran 5-12% slower (RESULTS.md, twenty-first session); flash_fwd_repair follows them.
//
// The consumers wait only on tiles and on their turn to issue products (ping-pong: while one
// runs its softmax another's products keep the tensor cores busy). wgmma is asynchronous, so
// one step of a consumer also overlaps S_ij = Q_i K_j^T with P~_{i,j-1} V_{j-1}, and the
// softmax of S_ij with the latter. The softmax takes the row max of raw scores Q K^T and
// scales differences (scale > 0, checked on the host). Consumer step j (0 <= j <= T, T = K/V
// tiles of Q tile i, counted from the first that Q tile i sees):
//
//   wait K_j full, V_{j-1} full
//   (my turn) issue S_ij = Q_i K_j^T, then O_i += P~_{i,j-1} V_{j-1} (next consumer's turn)
//   wait for S_ij;  K_j empty (and Q_i empty after the last S_ij);  scale, mask, online softmax
//   wait for O_i;   V_{j-1} empty;  O_i <- alpha O_i,  l_i <- alpha l_i + rowsum(P~_ij)
//
// A consumer multiplies only the K/V tiles its own 64 rows see (fewer than the CTA's when causal,
// none when the rows are all past Nq); it still takes each turn and releases each tile.
//
// Shared memory (elem_t, 128-byte swizzle, sm90.cuh), after 1024-byte alignment:
//   s_Q  (Q_STAGES, B_R, DP)    Q_i ring
//   s_K  (STAGES, B_C, DP)      K_j ring
//   s_V  (STAGES, B_C, DP)      V_j ring
//   bars (2 Q_STAGES + 4 STAGES) u64   Q full, Q empty per Q stage; K full, K empty, V full, V empty per stage
//   s_index (Q_STAGES) u32, 8 bytes apart    the tile index of each Q_i
//   s_claim u32, s_flagged u32               producer thread 0's next tile (in a register it would spill);
//                                            whether the CTA flagged a tile for the repair

#include "copy.cuh"
#include "epilogue.cuh"
#include "layout.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"
#include "nonfinite.cuh"
#include "params.cuh"
#include "repair.cuh"
#include "score_mod.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "tile_map.cuh"

constexpr int DP = FLASH_DP;
constexpr int B_R = FLASH_BR;
constexpr int B_C = FLASH_BC;
constexpr int NTHREADS = FLASH_WARPS * WARP_SIZE;
constexpr int WG_THREADS = 4 * WARP_SIZE;              // one warpgroup
constexpr int CONSUMERS = NTHREADS / WG_THREADS - 1;    // consumer warpgroups, 64 query rows each
constexpr int STAGES = 2;
constexpr int Q_STAGES = FLASH_Q_STAGES;               // two where they fit (the host's choice)
constexpr int TILE_Q = B_R * DP, TILE_KV = B_C * DP;   // operand elements (in_t); FP8's V^T tiles (DP, B_C)
constexpr int K_STEP = 32 / sizeof(in_t);              // the contraction of one wgmma: 16 16-bit, 32 float8
// head-dim columns the products cover: DP, but FP8 at D <= 64 (FLASH_DC = 64), whose tiles keep 128-byte lines
// (half of each line zero) and whose products skip the empty half
constexpr int DK = FP8 ? FLASH_DC : DP;
constexpr int P_FRAGS = B_C / K_STEP;                  // A fragments of P~_ij per thread
constexpr int N_BARRIERS = 2 * Q_STAGES + 4 * STAGES;
constexpr int SMEM_BYTES = (Q_STAGES * TILE_Q + 2 * STAGES * TILE_KV) * (int)sizeof(in_t) + N_BARRIERS * 8
                           + (Q_STAGES + 1) * 8        // s_index, s_claim (8 bytes apart)
                           + SW_ATOM_BYTES;             // + slack for the 1024-byte alignment
// setmaxnreg moves registers between the warpgroups of the CTA's fixed allocation: the fewest to
// the producer, the rest to the consumers (cupyflash/_tiles.py: TileConfig.registers, the one place)
constexpr int PRODUCER_REGS = FLASH_PRODUCER_REGS;
constexpr int CONSUMER_REGS = FLASH_CONSUMER_REGS;

// Named barriers (0 is __syncthreads): consumer c's turn to issue its products (CONSUMER_TURN + c,
// c < CONSUMERS), the consumers' repair, every thread's work done, the producer's own
enum Barrier : int { CONSUMER_TURN = 1, REPAIR = 13, ALL_DONE = 14, PRODUCER = 15 };
// the consumers recompute the CTA's flagged Q tiles as it ends (the host launches flash_fwd_repair where not)
constexpr bool SELF_REPAIR = !VARLEN;

static_assert(B_R == 64 * CONSUMERS && FLASH_WARPS % 4 == 0, "one producer warpgroup, 64 query rows per consumer");
static_assert(CONSUMERS >= 2 && CONSUMER_TURN + CONSUMERS <= REPAIR, "ping-pong consumers and their barriers");
static_assert(Q_STAGES == 1 || Q_STAGES == 2, "one or two Q buffers");
static_assert(DP % SW_COLS == 0 && (B_C == 64 || B_C == 96 || B_C == 128), "tile shapes");
static_assert(PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= (1 + CONSUMERS) * (65536 / NTHREADS / 8 * 8), "register file");
static_assert(SMEM_BYTES == FLASH_SMEM_BYTES, "host and device disagree on the shared-memory layout");
static_assert(!FP8 || (DP == 128 && B_C == 128 && (DK == 64 || DK == 128)),
              "FP8: V^T tiles of one 128-byte column block, one PV instruction");

// The value of this CTA's repair flags, blockIdx.x + 1, read where it is written (volatile: the
// compiler would hold it in one of the producer's few registers through the tile loop)
__device__ __forceinline__ unsigned cta_mark() {
    unsigned x;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
    return x + 1u;
}

// Producer thread `ptid` of WG_THREADS: its share of a (ROWS, DP) tile of `rows` rows into a
// swizzled buffer, then its arrival on `full` once that has landed (the `%` tells the compiler
// the range of ptid, from which it counts each thread's passes)
template <int ROWS>
__device__ __forceinline__ void produce_tile(in_t* s, const in_t* g, i64 sn, int rows, int D, bool vec,
                                             unsigned long long* full, unsigned ptid) {
    load_tile_sw128<ROWS, DP, WG_THREADS>(s, g, sn, rows, D, vec, ptid % WG_THREADS);
    arrive_when_landed(full, vec);
}

// Producer thread `ptid`: K/V tile j, key rows j B_C .. j B_C + rows - 1 of `g` (a paged cache's through
// its table), into a swizzled (B_C, DP) buffer, then its arrival on `full` once that has landed
__device__ __forceinline__ void produce_keys(in_t* s, const KeyRows<const in_t>& g, int j, int rows, int D,
                                             bool vec, unsigned long long* full, unsigned ptid) {
    if (g.paged())
        load_pages_sw128<B_C, DP, WG_THREADS>(s, g.from(j * B_C), rows, D, vec, ptid % WG_THREADS);
    else
        load_tile_sw128<B_C, DP, WG_THREADS>(s, g.base + (i64)j * B_C * g.sn, g.sn, rows, D, vec, ptid % WG_THREADS);
    arrive_when_landed(full, vec);
}

// S (64, B_C) = Q_i K_j^T for this warpgroup's 64 rows of Q_i, issued (not waited for)
__device__ __forceinline__ void issue_scores(acc_t (&S)[B_C / 8][4], const in_t* s_Qg, const in_t* s_Kj) {
#pragma unroll
    for (int kk = 0; kk < DK / K_STEP; ++kk) {
        const unsigned long long a = sw128_desc(s_Qg + sw128_offset<B_R>(0, kk * K_STEP), 16, SW_ATOM_BYTES);
        const unsigned long long b = sw128_desc(s_Kj + sw128_offset<B_C>(0, kk * K_STEP), 16, SW_ATOM_BYTES);
#if FLASH_FP8
        WgmmaE4m3<B_C>::ss(S, a, b, kk > 0);
#else
        Wgmma<B_C>::ss(S, a, b, kk > 0);
#endif
    }
    wgmma_commit();
}

// O (64, DK) += P~ V_j for this warpgroup, issued (not waited for); FP8: s_Vj holds V_j^T
__device__ __forceinline__ void issue_values(acc_t (&O)[DK / 8][4], const unsigned (&P)[P_FRAGS][4],
                                             const in_t* s_Vj) {
#if FLASH_FP8
    wgmma_rs_tile_e4m3<DK, P_FRAGS>(O, P, s_Vj);
#else
    wgmma_rs_tile<DP, P_FRAGS>(O, P, s_Vj);
#endif
    wgmma_commit();
}

// The consumers' repair as the CTA ends: every Q tile of the n flags' (heads, T_r) order whose flag
// holds this CTA's mark recomputed (repair.cuh), a warp per row (`warp` of the consumers' 4 CONSUMERS
// warps), all of them walking the flags together; then those flags set back to 0 (a plan keeps them
// from call to call). Out of line: its registers are none of the tile loop's concern.
__device__ __noinline__ void repair_own_tiles(const FwdParams& p, i64 n, int T_r, int warp) {
    const unsigned mark = cta_mark();
    const int lane = threadIdx.x % WARP_SIZE;
    for (i64 base = 0; base < n; base += WARP_SIZE) {
        const unsigned hits = __ballot_sync(0xffffffffu, base + lane < n && p.repair_flags[base + lane] == mark);
        for (unsigned h = hits; h; h &= h - 1) repair_forward_tile(p, base + __ffs(h) - 1, T_r, warp, 4 * CONSUMERS);
    }
    named_barrier_sync(REPAIR, CONSUMERS * WG_THREADS);   // every warp has read every flag
    for (i64 t = threadIdx.x - WG_THREADS; t < n; t += CONSUMERS * WG_THREADS)
        if (p.repair_flags[t] == mark) p.repair_flags[t] = 0u;
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) flash_fwd_sm90(const __grid_constant__ FwdParams p) {
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned misalign = smem_addr(smem) % SW_ATOM_BYTES;
    in_t* s_Q = reinterpret_cast<in_t*>(smem + (misalign ? SW_ATOM_BYTES - misalign : 0));   // (Q_STAGES, B_R, DP)
    in_t* s_K = s_Q + Q_STAGES * TILE_Q;                                 // (STAGES, B_C, DP)
    in_t* s_V = s_K + STAGES * TILE_KV;                                  // (STAGES, B_C, DP); FP8: V^T (STAGES, DP, B_C)
    unsigned long long* q_full = reinterpret_cast<unsigned long long*>(s_V + STAGES * TILE_KV);   // (Q_STAGES) each
    unsigned long long* q_empty = q_full + Q_STAGES;
    unsigned long long* k_full = q_empty + Q_STAGES;                     // (STAGES) each
    unsigned long long* k_empty = k_full + STAGES;
    unsigned long long* v_full = k_empty + STAGES;
    unsigned long long* v_empty = v_full + STAGES;
    unsigned* s_index = reinterpret_cast<unsigned*>(v_empty + STAGES);   // (Q_STAGES, 2) the tile of each Q_i
    unsigned* s_claim = s_index + 2 * Q_STAGES;                          // producer thread 0's next tile
    unsigned* s_flagged = s_claim + 1;                                   // the CTA flagged a tile: 1

    const int D = p.D;
    const bool vec = p.vec != 0;
    const int tid = threadIdx.x;
    const int wg = __shfl_sync(0xffffffffu, tid / WG_THREADS, 0);   // from lane 0: the compiler sees it warp-uniform
    const int T_r = (p.mask.Nq + B_R - 1) / B_R;                    // the grid's Q tiles per head
    const unsigned heads = (unsigned)p.seqs.heads, splits = (unsigned)p.kv_splits, n_tiles = heads * T_r * splits;

    // Tile `index` of the grid order: its work head w, the sequence's mask, Q tile i (heaviest causal
    // first; i < 0: past a shorter sequence's rows, skipped), its split (split-KV: the splits of a Q
    // tile side by side in the order) and the K/V tiles it visits (the band's or mask_mod's tile map's,
    // the split's run of them; visit n at ring position kv + n)
    struct Work { i64 w; Mask mask; int i; int split; Visits visits; };
    auto work_at = [&](unsigned index) {
        int split = 0;   // without split-KV (splits == 1) no division in the per-tile path
        if (splits > 1) { split = (int)(index % splits); index /= splits; }
        const GridTile at = grid_tile_at(index, heads, T_r, p.head_group);
        const Seq sq = seq_of(p, at.bh);
        const Mask mask = mask_of(p, sq);
        const int i = (mask.Nq + B_R - 1) / B_R - 1 - at.tile;
        Visits visits = i < 0 ? Visits{nullptr, 0, 0} : kv_visits<B_R, B_C>(mask, tiles_of(p, sq), i);
        if (splits > 1) visits = visits.split(split, (int)splits);
        return Work{at.bh, mask, i, split, visits};
    };
    // the first tile from `index` on that is not past its sequence's rows (claiming more past those)
    auto first_work = [&](unsigned index) {
        if (SWITCH_ON(VARLEN, p.uses))
            while (index < n_tiles && work_at(index).i < 0) index = gridDim.x + atomicAdd(p.tile_counter, 1u);
        return index;
    };

    if (tid == 0) {
        *s_flagged = 0u;
        for (int s = 0; s < Q_STAGES; ++s) {
            mbar_init(&q_full[s], WG_THREADS + 1);   // + producer thread 0's, which publishes s_index
            mbar_init(&q_empty[s], CONSUMERS * WG_THREADS);
        }
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&k_full[s], WG_THREADS);
            mbar_init(&v_full[s], WG_THREADS);
            mbar_init(&k_empty[s], CONSUMERS * WG_THREADS);
            mbar_init(&v_empty[s], CONSUMERS * WG_THREADS);
        }
    }
    __syncthreads();

    // Tiles are claimed, not dealt: a CTA takes tile blockIdx.x first, then gridDim.x + the next
    // value of tile_counter, until that passes the last tile. The grid order puts heavy causal tiles
    // first, so claiming in order balances the load. `n` counts the CTA's tiles, `kv` the K/V tiles
    // of its ring so far (ring position kv + j: stage % STAGES, use / STAGES).
    if (wg == 0) {
        // producer: Q_i into buffer n % Q_STAGES once its previous tile is released, then K_j, V_j.
        // Thread 0 claims each next tile once the current one's Q_i is on its way, and publishes it
        // in s_index with the next Q_i; a tile past the last one ends the CTA.
        setmaxnreg_dec<PRODUCER_REGS>();
        if (tid == 0) *s_claim = blockIdx.x;
        // Where a Q tile has masked pairs in tile j and V_j holds an inf or NaN, P~_ij V_j may spread it
        // to them (nonfinite.cuh): flag the Q tile for the repair, with this CTA's mark. The producer scans
        // each such V_j while it waits anyway: just before it waits to refill V_j's buffer, and as the
        // CTA ends.
        // pending0, pending1: the flag of the V_j in stage 0, 1 still to scan (NONE: none).
        constexpr unsigned NONE = ~0u;
        unsigned pending0 = NONE, pending1 = NONE;
        auto scan_values = [&](int pos) {   // ring position pos, if its V_j is pending
            const int s = pos % STAGES;
            const unsigned flag = s == 0 ? pending0 : pending1;
            if (pos < 0 || flag == NONE) return;
            mbar_wait(&v_full[s], (pos / STAGES) & 1);
#if FLASH_FP8
            if (rows_nan_e4m3(s_V + s * TILE_KV, DK, SW_COLS, SW_COLS, tid % WG_THREADS, WG_THREADS)) {   // DK rows of V^T
#else
            if (rows_nonfinite(s_V + s * TILE_KV, TILE_KV / SW_COLS, SW_COLS, SW_COLS, tid % WG_THREADS, WG_THREADS)) {
#endif
                p.repair_flags[flag] = cta_mark();
                *s_flagged = 1u;
            }
            named_barrier_sync(PRODUCER, WG_THREADS);   // no thread refills what another still scans
        };
        static_assert(STAGES == 2, "a pending flag per stage");
        int kv = 0;
        for (unsigned n = 0;; ++n) {
            const int qs = n % Q_STAGES, q_use = n / Q_STAGES;
            if (q_use > 0) mbar_wait(&q_empty[qs], (q_use - 1) & 1);
            if (tid == 0) s_index[2 * qs] = first_work(*s_claim);
            named_barrier_sync(PRODUCER, WG_THREADS);
            const unsigned index = s_index[2 * qs];
            if (index >= n_tiles) {
                mbar_arrive(&q_full[qs]);
                if (tid == 0) {
                    mbar_arrive(&q_full[qs]);
                    // this CTA claims no more: the last CTA to get here leaves the counters as the call
                    // found them, zero (a plan keeps them from call to call on its stream)
                    __threadfence();
                    if (atomicAdd(p.tile_counter + 1, 1u) == gridDim.x - 1) {
                        p.tile_counter[0] = 0u;
                        p.tile_counter[1] = 0u;
                    }
                }
                scan_values(kv - 2);
                scan_values(kv - 1);
                break;
            }
            const Work w = work_at(index);
            // the thread's index, opaque to the compiler: its row offsets, hoisted out of the tile
            // loop, would not fit the producer's registers
            unsigned ptid = tid;
            asm volatile("" : "+r"(ptid));
            const Seq sq = seq_of(p, w.w);
            const Mask& mask = w.mask;
            const int Nq = mask.Nq, Nk = mask.Nk;
            const in_t* q_h = sq.q_rows(p.q);
            const KeyRows<const in_t> k_h = k_rows_of(p, sq), v_h = v_rows_of(p, sq);   // PAGED: paged
            const in_t* vt_h = FP8 ? p.vt.at(sq.bi) : nullptr;                         // FP8: (DK, keys) V^T
            const i64 q_sn = p.q.sn;
            produce_tile<B_R>(s_Q + qs * TILE_Q, q_h + (i64)w.i * B_R * q_sn, q_sn, min(B_R, Nq - w.i * B_R), D, vec,
                              &q_full[qs], ptid);
            if (tid == 0) {
                mbar_arrive(&q_full[qs]);
                *s_claim = gridDim.x + atomicAdd(p.tile_counter, 1u);   // under the wait for K_0's buffer
            }
            for (int t = w.visits.begin; t < w.visits.end; ++t) {
                const int visit = w.visits.entry(t), j = Visits::tile_of(visit);
                const int pos = kv + t - w.visits.begin, s = pos % STAGES, use = pos / STAGES;
                const int rows = min(B_C, Nk - j * B_C);
                if (use > 0) mbar_wait(&k_empty[s], (use - 1) & 1);
                produce_keys(s_K + s * TILE_KV, k_h, j, rows, D, vec, &k_full[s], ptid);
                if (use > 0) {
                    scan_values(pos - STAGES);
                    mbar_wait(&v_empty[s], (use - 1) & 1);
                }
                if constexpr (FP8)   // V_j^T: DK rows of B_C keys, every one written (zero past D and Nk)
                    produce_tile<DK>(s_V + s * TILE_KV, vt_h + (i64)j * B_C, p.vt.sn, DK, B_C, true, &v_full[s], ptid);
                else
                    produce_keys(s_V + s * TILE_KV, v_h, j, rows, D, vec, &v_full[s], ptid);
                const unsigned flag = may_hide(mask, w.i * B_R, B_R, j * B_C, B_C, Visits::all_of(visit))
                                          ? (unsigned)(w.w * T_r + w.i) : NONE;
                if (s == 0) pending0 = flag;
                else        pending1 = flag;
            }
            kv += w.visits.count();
        }
        cp_async_wait<0>();   // no copy outlives its thread
        if constexpr (SELF_REPAIR) named_barrier_arrive(ALL_DONE, NTHREADS);   // every flag is set
    } else {
        // consumers: warpgroup c = wg - 1 owns rows 64c .. 64c+63 of each Q_i
        setmaxnreg_inc<CONSUMER_REGS>();
        const int c = wg - 1;
        const int warp = tid / WARP_SIZE - 4;   // warp among the consumers
        const acc_t scale = (acc_t)p.scale;

        // the tile's copies happened in the generic proxy; the tensor cores read through the async one
        auto wait_full = [&](unsigned long long* bars, int pos) {
            mbar_wait(&bars[pos % STAGES], (pos / STAGES) & 1);
            fence_proxy_async();
        };
        // Ping-pong: the consumers take turns issuing their products (named barrier CONSUMER_TURN + c
        // is consumer c's turn), so one's softmax runs while another's products keep the tensor cores
        // busy. Consumer 0 goes first; every issue hands the turn on, from tile to tile, and
        // consumer 0 takes the last hand-off as the CTA ends.
        constexpr int PAIR = 2 * WG_THREADS;
        auto my_turn = [&]() { named_barrier_sync(CONSUMER_TURN + c, PAIR); };
        auto your_turn = [&]() { named_barrier_arrive(CONSUMER_TURN + (c + 1) % CONSUMERS, PAIR); };
        if (c == CONSUMERS - 1) named_barrier_arrive(CONSUMER_TURN, PAIR);

        int kv = 0;
        for (unsigned n = 0;; ++n) {
            const int qs = n % Q_STAGES;
            mbar_wait(&q_full[qs], (n / Q_STAGES) & 1);
            const unsigned index = s_index[2 * qs];
            if (index >= n_tiles) break;
            const Work w = work_at(index);
            const Mask& mask = w.mask;
            const int Nq = mask.Nq, Nk = mask.Nk;
            // j counts the tile's visits from 0 here: K/V tile w.visits.tile(w.visits.begin + j), ring position kv + j
            const int i = w.i, j_stop = w.visits.count();
            const int r0 = i * B_R + 16 * warp;             // first query row of this warp
            const in_t* s_Qg = s_Q + qs * TILE_Q + c * 64 * SW_COLS;

            acc_t O[DK / 8][4];                             // (16, DK) per warp: unnormalised O_i
            zero_frag(O);
            // m_i in units of raw scores Q K^T (the softmax scales differences: scale > 0, checked on the
            // host), or of the modifiers' S (RawMods: unit > 0)
            const Seq seq = seq_of(p, w.w);
            EntryMods entry = mods_of(p, seq);
            const acc_t entry_scale = FP8 ? scale * (acc_t)p.descales.qk(seq.bi) : scale;   // FP8: per entry
            // The sink's logit (where the call has sinks) is read here, with the modifiers, when a bias or a
            // mask reads the batch index too, else after the loop. Read here by the other kernels, it held a
            // register through the loop (the plain forward 3% slower at N 512, softcap's 2%); read after the
            // loop by a bias kernel, the batch index did (8% slower at D 64; RESULTS.md, thirteenth session)
            constexpr bool SINK_WITH_MODS = BIAS || BOOL_MASK;
            const bool sinks = SWITCH_ON(SINK, p.uses);
            const acc_t sink_here = SINK_WITH_MODS && sinks ? sink_of(p, seq, w.split) : (acc_t)0;
            const RawMods mods(entry, entry_scale);
            const acc_t unit = SCORE_MODS ? mods.unit : entry_scale, log2_unit = unit * (acc_t)LOG2E;
            acc_t m_i[2] = {NEG_INF, NEG_INF}, l_i[2] = {(acc_t)0, (acc_t)0};
            acc_t S[B_C / 8][4];                            // (16, B_C) per warp: S_ij, then P~_ij
            unsigned P[P_FRAGS][4];                         // P~_ij as A fragments (FP8: rounded to float8)
            acc_t m_new[2], alpha[2], rowsum[2];
            PairsOfTile<B_C / 8> pairs;   // a bias's and a mask's pairs of S_ij, loaded under Q_i K_j^T

            // S_ij -> P~_ij, its statistics into m_new, alpha, rowsum (masked online softmax); modified
            // scores (score_mod.cuh) in the modifiers' units. `visit`: Visits::entry of step j, loaded
            // before the step's waits (a tile map's list is in global memory)
            auto softmax_step = [&](int visit) {
                const int kv0 = Visits::tile_of(visit) * B_C;
                entry.user_all = Visits::all_of(visit);
                if (SCORE_MODS && entry.modifies()) modify_raw_scores(S, mods, r0, kv0, pairs);
                mask_scores(S, mask, r0, kv0);
                online_softmax(S, m_i, m_new, alpha, rowsum, log2_unit);
                if constexpr (DROPOUT) drop_probs(S, entry, r0, kv0);   // out of P~_ij V_j, not of l_i
            };
            // m_i <- m_new;  l_i <- alpha l_i + rowsum(P~_ij);  O_i <- alpha O_i (skipped while no row
            // max of the warp moved: alpha = 1 exactly);  P~_ij to A fragments
            auto rescale = [&]() {
                const bool moved = __any_sync(0xffffffffu, alpha[0] != (acc_t)1 || alpha[1] != (acc_t)1);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    m_i[h] = m_new[h];
                    l_i[h] = alpha[h] * l_i[h] + rowsum[h];
                    if (moved)
#pragma unroll
                        for (int nn = 0; nn < DK / 8; ++nn) {
                            O[nn][2 * h] *= alpha[h];
                            O[nn][2 * h + 1] *= alpha[h];
                        }
                }
#if FLASH_FP8
                frag_to_a_e4m3(P, S);
#else
                frag_to_a(P, S);
#endif
            };

            // The K/V tiles this warpgroup's rows need: the CTA's first to my_stop - 1 (fewer than the
            // CTA's when causal; none for rows all past Nq). It still takes every turn and releases every
            // tile, computing nothing there.
            const int row_first = i * B_R + 64 * c;
            const int my_stop = row_first >= Nq ? 0 : w.visits.below(mask.kv_tile_stop<B_C>(row_first, 64)) - w.visits.begin;

            // a turn with nothing to multiply: release K_j and V_{j-1} once they have landed (an arrival
            // before the tile's own must not count towards the previous use of its buffer)
            auto idle_step = [&](int j) {
                if (j < j_stop) wait_full(k_full, kv + j);
                if (j >= 1) wait_full(v_full, kv + j - 1);
                my_turn();
                your_turn();
                if (j < j_stop) mbar_arrive(&k_empty[(kv + j) % STAGES]);
                if (j >= 1) mbar_arrive(&v_empty[(kv + j - 1) % STAGES]);
            };
            // Q_i is released once this warpgroup's last S_ij has completed; the producer loads the
            // CTA's next Q tile (in the other buffer, if there are two) under the rest of this one
            auto release_q = [&]() { mbar_arrive(&q_empty[qs]); };

            if (my_stop > 0) {
                // step 0: S_i0 alone
                const int visit0 = w.visits.entry(w.visits.begin);
                wait_full(k_full, kv);
                my_turn();
                wgmma_fence();
                issue_scores(S, s_Qg, s_K + (kv % STAGES) * TILE_KV);
                your_turn();
                pairs.load(entry, r0, Visits::tile_of(visit0) * B_C);
                wgmma_wait<0>();
                wgmma_pin(S);
                if (my_stop == 1) release_q();
                mbar_arrive(&k_empty[kv % STAGES]);
                softmax_step(visit0);
                rescale();

                // step j: S_ij and P~_{i,j-1} V_{j-1} in flight together, the softmax of S_ij under the latter
                for (int j = 1; j < my_stop; ++j) {
                    const int s = (kv + j) % STAGES, sp = (kv + j - 1) % STAGES;
                    const int visit = w.visits.entry(w.visits.begin + j);
                    wait_full(k_full, kv + j);
                    wait_full(v_full, kv + j - 1);
                    my_turn();
                    wgmma_fence();
                    issue_scores(S, s_Qg, s_K + s * TILE_KV);
                    issue_values(O, P, s_V + sp * TILE_KV);
                    your_turn();
                    pairs.load(entry, r0, Visits::tile_of(visit) * B_C);
                    wgmma_wait<1>();
                    wgmma_pin(S);
                    if (j == my_stop - 1) release_q();
                    mbar_arrive(&k_empty[s]);
                    softmax_step(visit);
                    wgmma_wait<0>();
                    wgmma_pin(O);
                    wgmma_pin_a(P);
                    mbar_arrive(&v_empty[sp]);
                    rescale();
                }

                // step my_stop: P~_{i,my_stop-1} V_{my_stop-1}; K_{my_stop}, if the CTA has it, is not mine
                const int j = my_stop, s = (kv + j) % STAGES, sp = (kv + j - 1) % STAGES;
                if (j < j_stop) wait_full(k_full, kv + j);
                wait_full(v_full, kv + j - 1);
                my_turn();
                wgmma_fence();
                issue_values(O, P, s_V + sp * TILE_KV);
                your_turn();
                if (j < j_stop) mbar_arrive(&k_empty[s]);
                wgmma_wait<0>();
                wgmma_pin(O);
                mbar_arrive(&v_empty[sp]);
            } else {
                release_q();
            }
            for (int j = my_stop > 0 ? my_stop + 1 : 0; j <= j_stop; ++j) idle_step(j);

            // O_i = diag(l_i)^-1 O_i (the sink folded in where the call has sinks: sink_of); write O_i, m_i
            // (in natural units), l_i to HBM, or to the split's part
            const i64 row0 = seq_of(p, w.w).row0;
            const acc_t sink = SINK_WITH_MODS ? sink_here : sinks ? sink_of(p, seq_of(p, w.w), w.split) : (acc_t)0;
            store_output_rows(p.o_at(w.split, row0), p.m_at(w.split, row0), p.l_at(w.split, row0), O, m_i,
                              l_i, unit, r0, Nq, D, sinks, sink,
                              FP8 ? (acc_t)p.v_scale * (acc_t)p.descales.of_v(seq_of(p, w.w).bi)
                                  : DROPOUT ? entry.keep_scale : (acc_t)1);
            kv += j_stop;
        }
        if (c == 0) my_turn();   // the hand-off of the last issue

        // The Q tiles this CTA flagged, recomputed here rather than by flash_fwd_repair after the kernel
        // (a launch fewer a call), once the producer has scanned its last V_j and every consumer has
        // written its rows. Under split-KV the rows are the merge's, after this kernel: flash_fwd_repair's.
        if constexpr (SELF_REPAIR) {
            named_barrier_sync(ALL_DONE, NTHREADS);
            if (splits == 1 && *s_flagged) repair_own_tiles(p, (i64)heads * T_r, T_r, warp);
        }
    }
}

#ifdef FLASH_USER_MASK
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_map(const FwdParams p) { tile_map_states<B_R, B_C>(p); }
extern "C" __global__ void __launch_bounds__(TILE_MAP_THREADS) flash_tile_lists(const FwdParams p) { tile_map_lists(p); }
#endif

#if FLASH_FP8
// V^T for the FP8 forward: for each batch entry of v (those of the call that share one, through a stride
// 0, write it once: broadcast_rank 0) and each run of B_C keys, the (DK, B_C) block of p.vt, key column
// k of each 32 holding key e4m3_key_of(k) (sm90.cuh), zero past D and Nk. A CTA per (entry, run): the
// keys' rows into shared memory as they lie in v (16-byte loads where p.vec), then each thread gathers
// 16 columns of one row of V^T from them. NaNs are copied: the main kernel's scan finds them.
constexpr int VALUES_THREADS = 256;
constexpr int VALUES_PITCH = DK + 16;   // bytes of a shared key row: rows 16 bytes apart in the banks

extern "C" __global__ void __launch_bounds__(VALUES_THREADS) flash_fp8_values(const __grid_constant__ FwdParams p) {
    __shared__ __align__(16) in_t s_v[B_C * VALUES_PITCH];   // (B_C, DK) keys of this run, padded rows
    const int runs = (p.mask.Nk + B_C - 1) / B_C;
    const i64 e = blockIdx.x / runs;
    const int run = (int)(blockIdx.x - e * runs), k0 = run * B_C, D = p.D, Nk = p.mask.Nk;
    const BatchIndex bi = p.batch.split(e);
    if (broadcast_rank(bi, p.batch.n1, p.batch.n2, p.v.s0, p.v.s1, p.v.s2) != 0) return;   // another CTA's entry
    const in_t* v = p.v.at(bi) + (i64)k0 * p.v.sn;
    constexpr int CHUNKS = DK / IN_VEC;   // 16-byte chunks of a row
    for (int c = threadIdx.x; c < B_C * CHUNKS; c += VALUES_THREADS) {
        const int r = c / CHUNKS, d0 = c % CHUNKS * IN_VEC;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (k0 + r < Nk && d0 < D) {
            if (p.vec) {
                x = *reinterpret_cast<const uint4*>(v + (i64)r * p.v.sn + d0);
            } else {
                alignas(16) in_t b[IN_VEC];
#pragma unroll
                for (int i = 0; i < IN_VEC; ++i) b[i] = d0 + i < D ? v[(i64)r * p.v.sn + d0 + i] : (in_t)0;
                x = *reinterpret_cast<const uint4*>(b);
            }
        }
        *reinterpret_cast<uint4*>(s_v + r * VALUES_PITCH + d0) = x;
    }
    __syncthreads();
    in_t* vt = const_cast<in_t*>(p.vt.at(bi)) + k0;
    constexpr int COL_CHUNKS = B_C / IN_VEC;   // 16-byte chunks of a V^T row
    for (int c = threadIdx.x; c < DK * COL_CHUNKS; c += VALUES_THREADS) {
        const int d = c / COL_CHUNKS, k_first = c % COL_CHUNKS * IN_VEC;
        alignas(16) in_t b[IN_VEC];
#pragma unroll
        for (int i = 0; i < IN_VEC; ++i) {
            const int k = k_first + i;
            b[i] = s_v[(k / 32 * 32 + e4m3_key_of(k % 32)) * VALUES_PITCH + d];
        }
        *reinterpret_cast<uint4*>(vt + (i64)d * p.vt.sn + k_first) = *reinterpret_cast<const uint4*>(b);
    }
}
#endif
