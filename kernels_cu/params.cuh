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

// 4-byte words flash_bwd_prep zeroes before the main kernel adds into them
struct ZeroRange {
    unsigned* ptr;             // 4-byte aligned; 16-byte aligned takes vector stores
    i64 words;
};

struct FwdParams {
    Tensor<const elem_t> q;    // (batch..., Nq, D)
    Tensor<const elem_t> k;    // (batch..., Nk, D)
    Tensor<const elem_t> v;    // (batch..., Nk, D)
    elem_t* o;                 // (BH, Nq, D)
    acc_t* m;                  // (BH, Nq) row max, natural units
    acc_t* l;                  // (BH, Nq) row exp-sum
    acc_t* o_run;              // (BH, Nq, DP) V1: the running O_i between outer steps
    unsigned* tile_counter;    // the persistent Hopper forward: tiles claimed past the first grid, zeroed
    unsigned* repair_flags;    // (BH, T_r) zeroed, causal: Q tiles for flash_fwd_repair
    Batch batch;
    Mask mask;
    ScoreMods mods;            // softcap, ALiBi slopes (score_mod.cuh; read where compiled in)
    int D;
    int vec;                   // 16-byte loads of q, k, v are safe (aligned rows, D % VEC == 0)
    int head_group;            // heads per group of the grid order (layout.cuh: grid_tile)
    int n_splits;              // V1: CTAs per head, each owning every n_splits-th Q tile
    int tile_rows;             // rows of a flagged Q tile (the main kernel's B_r), for the repair
    double scale;              // softmax_scale, as the accumulator type rounds it
};

struct BwdParams {
    Tensor<const elem_t> q;    // (batch..., Nq, D)
    Tensor<const elem_t> k;    // (batch..., Nk, D)
    Tensor<const elem_t> v;    // (batch..., Nk, D)
    Tensor<const elem_t> o;    // (batch..., Nq, D)
    Tensor<const elem_t> dO;   // (batch..., Nq, D)
    Tensor<acc_t> dq_acc;      // q's own shape, contiguous: the dQ sums, zeroed
    Tensor<elem_t> dk;         // k's own shape, contiguous: stored directly unless kv_atomic
    Tensor<elem_t> dv;         // v's own shape, contiguous
    acc_t* dk_acc;             // dk's layout: the dK sums when kv_atomic, zeroed
    acc_t* dv_acc;             // dv's layout: the dV sums when kv_atomic, zeroed
    elem_t* dq;                // dq_acc's layout: dq in the input dtype (flash_convert)
    const acc_t* m;            // (BH, Nq) the forward's statistics
    const acc_t* l;            // (BH, Nq)
    acc_t* m_b;                // (BH, Nq) flash_bwd_prep -> flash_bwd: m_i, +inf where l_i = 0
    acc_t* inv_l;              // (BH, Nq)                              1 / l_i, 0 where l_i = 0
    acc_t* lse2;               // (BH, Nq) flash_bwd_prep -> flash_bwd_sm90: (m_i + log l_i) log2 e
    acc_t* Dsum;               // (BH, Nq) D_i = rowsum(dO_i o O_i)
    unsigned* dq_turns;        // (BH, T_r, n_chunks) zeroed, deterministic: turns of the adds into dQ_i
    unsigned* dk_turns;        // (K/V heads of k, T_c, n_chunks) zeroed, deterministic and kv_atomic
    unsigned* dv_turns;        // (K/V heads of v, T_c, n_chunks)
    unsigned* dq_flags;        // (BH, T_r) zeroed, causal: dQ tiles for flash_bwd_repair
    unsigned* kv_flags;        // (BH, T_c) zeroed, causal: dK, dV tiles
    ZeroRange zero[4];         // what the comments call zeroed: the workspace's zeroed part, and the
                               // gradients that are the sums themselves (float32, float64)
    i64 convert_elems[3];      // elements of dq, dk, dv that flash_convert converts (0: none)
    Batch batch;
    Mask mask;
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
