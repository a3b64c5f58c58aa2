// params.cuh — everything a kernel reads of a call: one parameter struct per kernel family,
// passed once, by value.
//
//   FwdParams    flash_fwd_v1, flash_fwd_v2, flash_fwd_sm90 and flash_fwd_repair
//   BwdParams    flash_bwd_prep, flash_bwd, flash_bwd_sm90, flash_bwd_repair and flash_convert
//   MergeParams  flash_merge
//   AppendParams flash_append
//
// Every pointer and stride has a name here. cupyflash/_params.py mirrors each struct once as a
// NumPy structured dtype; a plan fills one per call shape and a call writes only its pointers.
// _compile.py appends static_asserts of the mirror's size and field offsets to every source, so
// host and device cannot disagree on the layout without the compile failing.

#pragma once

#include "layout.cuh"
#include "mask.cuh"
#include "score_mod.cuh"
#include "types.cuh"

// Packed variable-length sequences (flash_attention_varlen_*, a K/V cache's lengths): compiled in by the
// Hopper kernels, whose producer warpgroup finds each tile's sequence on a few registers; read at run time,
// uses & USES_VARLEN once per CTA (SWITCH_ON(VARLEN, p.uses)), by the others (types.cuh: FLASH_<NAME>)
#ifndef FLASH_VARLEN
#define FLASH_VARLEN 0
#endif
constexpr bool VARLEN = FLASH_VARLEN != 0;   // its code compiled in

// Keys in a paged K/V cache (flash_attention_with_kvcache with a block table; its lengths are packed
// sequences' Seqs::len_k): compiled in by the forwards that read a cache (flash_fwd_sm90, flash_fwd_v2)
// and flash_append, whose loops find every row through the table; read at run time by the repair (a
// table given: paged; KeyRows::paged)
#ifndef FLASH_PAGED
#define FLASH_PAGED 0
#endif
constexpr bool PAGED = FLASH_PAGED != 0;   // its code compiled in
constexpr bool PAGED_AT_RUN_TIME = FLASH_PAGED == FLASH_AT_RUN_TIME;

// A tensor of the call as the kernels read it: base pointer, element strides along the three
// collapsed batch dims (0 along a broadcast one) and of a row. The head dim is contiguous.
template <typename T>
struct Tensor {
    T* ptr;
    i64 s0, s1, s2;   // batch strides
    i64 sn;           // row stride

    // the (N, D) matrix of batch entry bi
    __device__ __forceinline__ T* at(BatchIndex bi) const { return ptr + batch_offset(bi, s0, s1, s2); }
};

// The flattened broadcast batch: `count` entries (batch x heads) over collapsed dims (n0, n1, n2)
struct Batch {
    i64 n1, n2;
    i64 count;

    __device__ __forceinline__ BatchIndex split(i64 bh) const { return split_batch(bh, n1, n2); }
};

// The sequences of each batch entry and the work heads the grid walks. Packed (SWITCH_ON(VARLEN, p.uses)),
// a batch entry's rows hold n packed sequences: sequence s is the query rows cu_q[s] .. cu_q[s+1] - 1 and
// the key rows cu_k[s] .. cu_k[s+1] - 1, and sees only its own keys, under `band` with its own Nq, Nk (causal
// and windows bottom-right per sequence). Null offsets make the entry's rows one sequence (n = 1:
// rows_q queries, rows_k keys), and `len_k`, where given, cuts each batch entry's keys to its first
// len_k[entry] + len_add (a K/V cache's valid lengths, the new keys appended; clamped to [0, rows_k]).
// Work head w = e n + s is sequence s of batch entry e; the grid's tiles are those of the longest
// sequence (the params' Mask.Nq, Mask.Nk), and a CTA past its own sequence's rows or keys has nothing
// to do. Not packed: one sequence, the params' Mask, n = 1.
struct Seqs {
    const int* cu_q;       // (n + 1) int32, packed, or null
    const int* cu_k;
    const int* len_k;      // packed: int32 per batch entry (broadcast over the batch dims), or null
    i64 len_s0, len_s1, len_s2;   // its collapsed batch strides
    i64 heads;             // work heads: batch.count * n
    int n;                 // sequences per batch entry
    int rows_q, rows_k;    // a batch entry's rows of q (o, dO, m, l) and of k, v (a paged cache's: its capacity)
    int len_add;           // added to len_k
    Band band;             // packed: the visibility of every sequence

    // the keys of batch entry bi's one sequence under len_k (packed, len_k given)
    __device__ __forceinline__ int keys_of(BatchIndex bi) const {
        return min(max(len_k[batch_offset(bi, len_s0, len_s1, len_s2)] + len_add, 0), rows_k);
    }
};

// The key rows of one sequence in k or v: row j at base + j sn, or (PAGED) key first + j in page
// table[(first + j) / size] at row (first + j) % size, base then the sequence's head in page 0. Page
// numbers are clamped to [0, count) on the device: a bad table reads (or flash_append writes) a wrong
// page, never outside the cache.
template <typename T>
struct KeyRows {
    T* base;
    i64 sn;
    const int* table;      // PAGED: the batch entry's row of the page table
    i64 page;              // PAGED: elements between pages
    int size, count;       // PAGED: rows per page, pages in the cache
    int first;             // PAGED: the key of row 0

    // the rows are a paged cache's (read at run time: a table given)
    __host__ __device__ __forceinline__ bool paged() const { return PAGED && (!PAGED_AT_RUN_TIME || table != nullptr); }

    __host__ __device__ __forceinline__ T* row(int j) const {
        if (paged()) {
            const At at = walk(j);
            return page_rows(at.page) + (i64)at.row * sn;
        }
        return base + (i64)j * sn;
    }

    // Paged: row j as (the table's entry `page`, row `row` of that page), for a walk down the rows that
    // looks each page up once (sm90.cuh: load_pages_sw128; host code too: tests/test_params_cuh.py)
    struct At { int page, row; };
    __host__ __device__ __forceinline__ At walk(int j) const {
        j += first;
        return {j / size, j % size};
    }
    __host__ __device__ __forceinline__ void step(At& at, int rows) const {
        at.row += rows;
        if (at.row >= size) {
            at.page += at.row / size;
            at.row %= size;
        }
    }
    // the first row of the table's entry n (its page number clamped to the cache)
    __host__ __device__ __forceinline__ T* page_rows(int n) const {
        return base + (i64)min((unsigned)table[n], (unsigned)(count - 1)) * page;
    }

    // the rows from key `k0` on (a tile's): row r of the result is row k0 + r of these
    __device__ __forceinline__ KeyRows from(int k0) const {
        KeyRows r = *this;
        if (paged()) r.first += k0;
        else         r.base += (i64)k0 * sn;
        return r;
    }
};

// A paged K/V cache (PAGED): the k, v Tensors' batch strides place an entry's head in page 0, the
// table maps each entry's run of `size` rows to a page
struct Pages {
    const int* table;      // (B, per_entry) int32 page numbers
    i64 s0, s1, s2;        // the table's collapsed batch strides (of its rows)
    i64 page_k, page_v;    // elements between pages of k, of v
    int size;              // rows per page
    int count;             // pages in the cache

    // the cache is paged (read at run time: a table given)
    __device__ __forceinline__ bool paged() const { return PAGED && (!PAGED_AT_RUN_TIME || table != nullptr); }

    // batch entry bi's rows of tensor t (k or v; `page` its elements between pages), from key row k0
    template <typename T>
    __device__ __forceinline__ KeyRows<T> rows(const Tensor<T>& t, i64 page, BatchIndex bi, int k0) const {
        if (paged()) return {t.at(bi), t.sn, table + batch_offset(bi, s0, s1, s2), page, size, count, k0};
        return {t.at(bi) + (i64)k0 * t.sn, t.sn, nullptr, 0, 0, 0, 0};
    }
};

// What a CTA of work head w reads: its batch entry and its sequence
struct Seq {
    BatchIndex bi;         // the batch entry
    i64 e;                 // its flat index
    i64 row0;              // the sequence's first query row in the (BH, rows_q) outputs and statistics
    int s;                 // the sequence (0 when not packed)
    int q0, k0;            // its first rows in the entry's q (o, dO) and k (v) matrices
    Mask mask;             // its visibility; Nq, Nk its lengths

    // tensor t's matrix of the sequence's query rows, of its key rows
    template <typename T> __device__ __forceinline__ T* q_rows(const Tensor<T>& t) const { return t.at(bi) + q0 * t.sn; }
    template <typename T> __device__ __forceinline__ T* k_rows(const Tensor<T>& t) const { return t.at(bi) + k0 * t.sn; }
};

// the sequence of work head w (FwdParams or BwdParams)
template <class Params>
__device__ __forceinline__ Seq seq_of(const Params& p, i64 w) {
    if (!SWITCH_ON(VARLEN, p.uses)) {
        return {p.batch.split(w), w, w * p.mask.Nq, 0, 0, 0, p.mask};
    } else {
        const Seqs& sq = p.seqs;
        const i64 e = w / sq.n;
        const int s = (int)(w - e * sq.n);
        const BatchIndex bi = p.batch.split(e);
        const int q0 = sq.cu_q ? sq.cu_q[s] : 0, k0 = sq.cu_k ? sq.cu_k[s] : 0;
        const int nq = sq.cu_q ? sq.cu_q[s + 1] - q0 : sq.rows_q;
        const int nk = sq.len_k ? sq.keys_of(bi) : sq.cu_k ? sq.cu_k[s + 1] - k0 : sq.rows_k;
        return {bi, e, e * sq.rows_q + q0, s, q0, k0, sq.band.of(nq, nk)};
    }
}

// sequence sq's Mask: the params' own where the rows are not packed, which a kernel compiled without packed
// sequences reads from the constant bank
template <class Params>
__device__ __forceinline__ const Mask& mask_of(const Params& p, const Seq& sq) {
    if constexpr (VARLEN) return sq.mask;
    else return p.mask;
}

// sequence sq's modifiers (score_mod.cuh)
template <class Params>
__device__ __forceinline__ EntryMods mods_of(const Params& p, const Seq& sq) {
    const Mask& mask = mask_of(p, sq);
    return p.mods.at(sq.bi, sq.e, sq.q0, sq.k0, mask.Nq, mask.Nk, p.uses);
}

// The attention sink: one more key per batch entry, of logit `sink` and value zero, folded into the
// forward's final m_i, l_i (softmax.cuh: fold_sink; the backward's P = exp(S - lse) needs nothing more).
// Only the forwards' epilogues read it, once per row, after the loop: a run-time word there
// (FLASH_SINK=FLASH_AT_RUN_TIME: SWITCH_ON(SINK, p.uses))
#ifndef FLASH_SINK
#define FLASH_SINK 0
#endif

// the sink's logit of sequence sq's batch entry (natural units) for split `split` of its keys: split 0's,
// the sink is one key (the others fold -inf, nothing)
template <class Params>
__device__ __forceinline__ acc_t sink_of(const Params& p, const Seq& sq, int split = 0) {
    return split == 0 ? p.mods.sink.at(sq.bi) : NEG_INF;
}

// sequence sq's map head of mask_mod's tile map (without FLASH_USER_MASK: none, not read)
template <class Params>
__device__ __forceinline__ TileHead tiles_of(const Params& p, const Seq& sq) {
    if constexpr (TILE_MAP) return p.tiles.head(sq.e, sq.s, p.seqs.n);
    return {};
}

// ranges of 4-byte words flash_bwd_prep zeroes (BwdParams::zero)
constexpr int ZERO_RANGES = 5;

// 4-byte words flash_bwd_prep zeroes before the main kernel adds into them
struct ZeroRange {
    unsigned* ptr;             // 4-byte aligned; 16-byte aligned takes vector stores
    i64 words;
};

// FP8: descales per batch entry (FlashAttention-3's per-head ones), each a float32 array over the batch dims
// (EntryArray: collapsed batch strides, 0 along a broadcast dim), or null where the call gave one number,
// which the host folds into FwdParams::scale (q's, k's) or v_scale (v's)
struct Descales {
    EntryArray<const float> q, k, v;

    // batch entry bi's factor of the scores (q's descale times k's), and of o (v's)
    __device__ __forceinline__ float qk(BatchIndex bi) const {
        return (q.ptr != nullptr ? q.at(bi) : 1.0f) * (k.ptr != nullptr ? k.at(bi) : 1.0f);
    }
    __device__ __forceinline__ float of_v(BatchIndex bi) const { return v.ptr != nullptr ? v.at(bi) : 1.0f; }
};

struct FwdParams {
    Tensor<const in_t> q;      // (batch..., rows_q, D)
    Tensor<const in_t> k;      // (batch..., rows_k, D)
    Tensor<const in_t> v;      // (batch..., rows_k, D)
    elem_t* o;                 // (BH, rows_q, D)
    acc_t* m;                  // (BH, rows_q) row max, natural units
    acc_t* l;                  // (BH, rows_q) row exp-sum
    acc_t* o_run;              // (BH, rows_q, DP) V1: the running O_i between outer steps
    unsigned* tile_counter;    // the persistent Hopper forward: [0] tiles claimed past the first grid, [1] CTAs
                               // done claiming; zero before the call, and after it (its last CTA resets both)
    unsigned* repair_flags;    // (heads, T_r) causal: Q tiles for flash_fwd_repair; zero before the call, and
                               // after it (flash_fwd_repair clears what it reads)
    elem_t* o_parts;           // (kv_splits, BH, rows_q, D) split-KV: each split's o, m, l, for flash_merge
    acc_t* m_parts;            // (kv_splits, BH, rows_q)
    acc_t* l_parts;            // (kv_splits, BH, rows_q)
    Batch batch;
    Mask mask;                 // the call's; packed, Nq, Nk of the longest sequence
    Seqs seqs;
    TileMap tiles;             // FLASH_USER_MASK: mask_mod's tile map at the main kernel's tiles (mask.cuh)
    ScoreMods mods;            // softcap, ALiBi slopes (score_mod.cuh; read where compiled in)
    Pages pages;               // PAGED: k, v are a paged cache
    int D;
    int vec;                   // 16-byte loads of q, k, v are safe (aligned rows, D % VEC == 0)
    int head_group;            // heads per group of the grid order (layout.cuh: grid_tile)
    int n_splits;              // V1: CTAs per head, each owning every n_splits-th Q tile
    int kv_splits;             // V2, Hopper: CTAs per Q tile, each over its run of the K/V tiles (Visits::split)
                               // into o_parts, m_parts, l_parts; 1: one CTA, into o, m, l
    int tile_rows;             // rows of a flagged Q tile (the main kernel's B_r), for the repair
    unsigned uses;             // the switches the call uses (types.cuh: Uses)
    double scale;              // softmax_scale (FP8: times q's and k's descale), as the accumulator type rounds it
    double v_scale;            // FP8: v's descale, a factor of o (1 otherwise)
    Tensor<const in_t> vt;     // FP8: V^T, (v's batch..., DK, keys) keys permuted (flash_fp8_values), sn its row stride
    Descales descales;         // FP8: per batch entry, beside scale and v_scale

    // where split `split` of a forward writes the rows from `row0` on: o, m, l, or its parts
    __device__ __forceinline__ elem_t* o_at(int split, i64 row0) const {
        return kv_splits == 1 ? o + row0 * D : o_parts + (split * batch.count * seqs.rows_q + row0) * D;
    }
    __device__ __forceinline__ acc_t* m_at(int split, i64 row0) const {
        return kv_splits == 1 ? m + row0 : m_parts + split * batch.count * seqs.rows_q + row0;
    }
    __device__ __forceinline__ acc_t* l_at(int split, i64 row0) const {
        return kv_splits == 1 ? l + row0 : l_parts + split * batch.count * seqs.rows_q + row0;
    }
};

// the key rows of sequence sq in k or v of a forward (PAGED: in the paged cache)
__device__ __forceinline__ KeyRows<const in_t> k_rows_of(const FwdParams& p, const Seq& sq) {
    return p.pages.rows(p.k, p.pages.page_k, sq.bi, sq.k0);
}
__device__ __forceinline__ KeyRows<const in_t> v_rows_of(const FwdParams& p, const Seq& sq) {
    return p.pages.rows(p.v, p.pages.page_v, sq.bi, sq.k0);
}

struct BwdParams {
    Tensor<const elem_t> q;    // (batch..., rows_q, D)
    Tensor<const elem_t> k;    // (batch..., rows_k, D)
    Tensor<const elem_t> v;    // (batch..., rows_k, D)
    Tensor<const elem_t> o;    // (batch..., rows_q, D)
    Tensor<const elem_t> dO;   // (batch..., rows_q, D)
    Tensor<acc_t> dq_acc;      // q's own shape, contiguous: the dQ sums, zeroed
    Tensor<elem_t> dk;         // k's own shape, contiguous: stored directly unless kv_atomic
    Tensor<elem_t> dv;         // v's own shape, contiguous
    acc_t* dk_acc;             // dk's layout: the dK sums when kv_atomic, zeroed
    acc_t* dv_acc;             // dv's layout: the dV sums when kv_atomic, zeroed
    elem_t* dq;                // dq_acc's layout: dq in the input dtype (flash_convert)
    const acc_t* m;            // (BH, rows_q) the forward's statistics
    const acc_t* l;            // (BH, rows_q)
    acc_t* m_b;                // (BH, rows_q) flash_bwd_prep -> flash_bwd: m_i, +inf where l_i = 0
    acc_t* inv_l;              // (BH, rows_q)                              1 / l_i, 0 where l_i = 0
    acc_t* lse2;               // (BH, rows_q) flash_bwd_prep -> flash_bwd_sm90: (m_i + log l_i) log2 e
    acc_t* Dsum;               // (BH, rows_q) D_i = rowsum(dO_i o O_i)
    unsigned* dq_turns;        // (heads, T_r, n_chunks) zeroed, deterministic: turns of the adds into dQ_i
    unsigned* dk_turns;        // (K/V heads of k, n, T_c, n_chunks) zeroed, deterministic and kv_atomic
    unsigned* dv_turns;        // (K/V heads of v, n, T_c, n_chunks)
    i64 dk_heads[3], dv_heads[3];   // deterministic and kv_atomic: the collapsed batch strides of dk, dv counted in
                                    // heads (rows_k x D elements), the turns' head of a batch entry
    unsigned* dq_flags;        // (heads, T_r) zeroed, causal: dQ tiles for flash_bwd_repair
    unsigned* kv_flags;        // (heads, T_c) zeroed, causal: dK, dV tiles
    ZeroRange zero[ZERO_RANGES];   // what the comments call zeroed: the workspace's zeroed part, the
                                   // gradients that are the sums themselves (float32, float64), dbias
    i64 convert_elems[3];      // elements of dq, dk, dv that flash_convert converts (0: none)
    Batch batch;
    Mask mask;
    Seqs seqs;
    TileMap tiles;
    ScoreMods mods;
    int D;
    int vec;                   // 16-byte loads of q, k, v, dO are safe
    int prep_vec;              // 16-byte loads of o, dO are safe
    int head_group;            // heads per group of the grid order
    int kv_atomic;             // several batch entries share a K/V head: dK, dV are sums
    int lse_stats;             // the main kernel reads lse2 (flash_bwd_sm90), else m_b, inv_l
    int tile_r, tile_c;        // the main kernel's B_r, B_c: the tiles of dq_flags, kv_flags
    unsigned uses;             // the switches the call uses (types.cuh: Uses)
    double scale;
};

// The backward's sums over CTAs in grid order (deterministic=True; layout.cuh, "Ordered sums"): a uniform
// branch around each tile's adds; compiled in (FLASH_ORDERED=1) or a run-time word (FLASH_AT_RUN_TIME,
// uses & USES_ORDERED) as _flags.py's table says, family by family: SWITCH_ON(ORDERED, p.uses)
#ifndef FLASH_ORDERED
#define FLASH_ORDERED 0
#endif

// the most parts a MergeParams names one by one; more arrive stacked (PartSet::stride)
constexpr int MERGE_POINTERS = 16;

// The parts of a merge, each a C-contiguous array of the same shape: named one by one (stride 0), or
// stacked, part p at ptr[0] + p * stride
template <typename T>
struct PartSet {
    T* ptr[MERGE_POINTERS];
    i64 stride;

    __device__ __forceinline__ T* at(int part) const { return stride ? ptr[0] + part * stride : ptr[part]; }
};

struct MergeParams {
    PartSet<const elem_t> o;   // each (rows, D)
    PartSet<const acc_t> m;    // each (rows,)
    PartSet<const acc_t> l;
    elem_t* o_out;             // (rows, D)
    acc_t* m_out;              // (rows,)
    acc_t* l_out;
    i64 rows;
    int D;
    int parts;
    int lanes;                 // threads per row
    int vec;                   // 16-byte accesses of o are safe (aligned parts, D % VEC == 0)
};

// New keys and values appended to a K/V cache at each batch entry's length (flash_attention_with_kvcache)
struct AppendParams {
    Tensor<elem_t> k, v;                 // the cache, (entries..., rows_k, D); paged: page 0's
    Tensor<const elem_t> k_new, v_new;   // (entries..., n_new, D)
    Batch batch;                         // the cache's batch entries
    Seqs seqs;                           // len_k: where each entry's new rows go; rows_k the capacity
    Pages pages;                         // table null: a contiguous cache
    int n_new;
    int D;
    int vec;                             // 16-byte accesses are safe
};
