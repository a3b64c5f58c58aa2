// params.cuh — everything a kernel reads of a call: one parameter struct per kernel family,
// passed once, by value.
//
//   FwdParams   flash_fwd_v1, flash_fwd_v2, flash_fwd_sm90 and flash_fwd_repair
//   BwdParams   flash_bwd_prep, flash_bwd, flash_bwd_sm90, flash_bwd_repair and flash_convert
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

// Packed variable-length sequences (flash_attention_varlen_*) compiled in
#ifndef FLASH_VARLEN
#define FLASH_VARLEN 0
#endif
constexpr bool VARLEN = FLASH_VARLEN != 0;

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

// The sequences of each batch entry and the work heads the grid walks. With VARLEN a batch entry's rows
// hold n packed sequences: sequence s is the query rows cu_q[s] .. cu_q[s+1] - 1 and the key rows
// cu_k[s] .. cu_k[s+1] - 1, and sees only its own keys, under `band` with its own Nq, Nk (causal
// and windows bottom-right per sequence). Work head w = e n + s is sequence s of batch entry e;
// the grid's tiles are those of the longest sequence (the params' Mask.Nq, Mask.Nk), and a CTA past
// its own sequence's rows or keys has nothing to do. Without VARLEN: one sequence, the params' Mask,
// n = 1.
struct Seqs {
    const int* cu_q;       // (n + 1) int32, VARLEN
    const int* cu_k;
    i64 heads;             // work heads: batch.count * n
    int n;                 // sequences per batch entry
    int rows_q, rows_k;    // a batch entry's rows of q (o, dO, m, l) and of k, v
    Band band;             // VARLEN: the visibility of every sequence
};

// What a CTA of work head w reads: its batch entry and its sequence
struct Seq {
    BatchIndex bi;         // the batch entry
    i64 e;                 // its flat index
    i64 row0;              // the sequence's first query row in the (BH, rows_q) outputs and statistics
    int s;                 // the sequence (0 without VARLEN)
    int q0, k0;            // its first rows in the entry's q (o, dO) and k (v) matrices
    Mask mask;             // its visibility; Nq, Nk its lengths

    // tensor t's matrix of the sequence's query rows, of its key rows
    template <typename T> __device__ __forceinline__ T* q_rows(const Tensor<T>& t) const { return t.at(bi) + q0 * t.sn; }
    template <typename T> __device__ __forceinline__ T* k_rows(const Tensor<T>& t) const { return t.at(bi) + k0 * t.sn; }
};

// the sequence of work head w (FwdParams or BwdParams)
template <class Params>
__device__ __forceinline__ Seq seq_of(const Params& p, i64 w) {
    if constexpr (!VARLEN) {
        return {p.batch.split(w), w, w * p.mask.Nq, 0, 0, 0, p.mask};
    } else {
        const Seqs& sq = p.seqs;
        const i64 e = w / sq.n;
        const int s = (int)(w - e * sq.n), q0 = sq.cu_q[s], k0 = sq.cu_k[s];
        return {p.batch.split(e), e, e * sq.rows_q + q0, s, q0, k0, sq.band.of(sq.cu_q[s + 1] - q0, sq.cu_k[s + 1] - k0)};
    }
}

// sequence sq's Mask: without VARLEN the params' own, which the kernels then read from the constant bank
template <class Params>
__device__ __forceinline__ const Mask& mask_of(const Params& p, const Seq& sq) { return VARLEN ? sq.mask : p.mask; }

// sequence sq's modifiers (score_mod.cuh)
template <class Params>
__device__ __forceinline__ EntryMods mods_of(const Params& p, const Seq& sq) {
    const Mask& mask = mask_of(p, sq);
    return p.mods.at(sq.bi, sq.e, sq.q0, sq.k0, mask.Nq, mask.Nk);
}

// ranges of 4-byte words flash_bwd_prep zeroes (BwdParams::zero)
constexpr int ZERO_RANGES = 5;

// 4-byte words flash_bwd_prep zeroes before the main kernel adds into them
struct ZeroRange {
    unsigned* ptr;             // 4-byte aligned; 16-byte aligned takes vector stores
    i64 words;
};

struct FwdParams {
    Tensor<const elem_t> q;    // (batch..., rows_q, D)
    Tensor<const elem_t> k;    // (batch..., rows_k, D)
    Tensor<const elem_t> v;    // (batch..., rows_k, D)
    elem_t* o;                 // (BH, rows_q, D)
    acc_t* m;                  // (BH, rows_q) row max, natural units
    acc_t* l;                  // (BH, rows_q) row exp-sum
    acc_t* o_run;              // (BH, rows_q, DP) V1: the running O_i between outer steps
    unsigned* tile_counter;    // the persistent Hopper forward: tiles claimed past the first grid, zeroed
    unsigned* repair_flags;    // (heads, T_r) zeroed, causal: Q tiles for flash_fwd_repair
    Batch batch;
    Mask mask;                 // without VARLEN the call's; with, Nq, Nk of the longest sequence
    Seqs seqs;
    ScoreMods mods;            // softcap, ALiBi slopes (score_mod.cuh; read where compiled in)
    int D;
    int vec;                   // 16-byte loads of q, k, v are safe (aligned rows, D % VEC == 0)
    int head_group;            // heads per group of the grid order (layout.cuh: grid_tile)
    int n_splits;              // V1: CTAs per head, each owning every n_splits-th Q tile
    int tile_rows;             // rows of a flagged Q tile (the main kernel's B_r), for the repair
    double scale;              // softmax_scale, as the accumulator type rounds it
};

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
    unsigned* dq_flags;        // (heads, T_r) zeroed, causal: dQ tiles for flash_bwd_repair
    unsigned* kv_flags;        // (heads, T_c) zeroed, causal: dK, dV tiles
    ZeroRange zero[ZERO_RANGES];   // what the comments call zeroed: the workspace's zeroed part, the
                                   // gradients that are the sums themselves (float32, float64), dbias
    i64 convert_elems[3];      // elements of dq, dk, dv that flash_convert converts (0: none)
    Batch batch;
    Mask mask;
    Seqs seqs;
    ScoreMods mods;
    int D;
    int vec;                   // 16-byte loads of q, k, v, dO are safe
    int prep_vec;              // 16-byte loads of o, dO are safe
    int head_group;            // heads per group of the grid order
    int kv_atomic;             // several batch entries share a K/V head: dK, dV are sums
    int lse_stats;             // the main kernel reads lse2 (flash_bwd_sm90), else m_b, inv_l
    int tile_r, tile_c;        // the main kernel's B_r, B_c: the tiles of dq_flags, kv_flags
    double scale;
};
