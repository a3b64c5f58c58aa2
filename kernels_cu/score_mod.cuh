// score_mod.cuh — the score modifiers: what happens to a score between the product and the mask.
//
// The API's order (cupyflash.reference: _Scores), for query i and key j, off = Nk - Nq:
//     s = scale q_i . k_j                        natural units
//     softcap c:   s <- c tanh(s / c)            FLASH_SOFTCAP
//     score_mod:   s <- score_mod(s, b, i, j)    FLASH_USER_SCORE (its text; FLASH_USER_GRAD its derivative)
//     ALiBi slope: s <- s - slope |i + off - j|  FLASH_ALIBI
//     bias:        s <- s + bias_ij              FLASH_BIAS (FLASH_BIAS_GRAD: the backward adds dS_ij to dbias_ij)
//     mask:        s <- -inf where mask_ij false FLASH_MASK (the pair is hidden, as the band hides it)
//     mask_mod:    s <- -inf where it is 0       FLASH_USER_MASK (its text)
// then the band (mask.cuh). m_i, l_i are the statistics of the modified scores. Dropout (FLASH_DROPOUT)
// then zeroes the pairs of P~ its keep set drops (philox.cuh) and scales the rest by 1 / (1 - p): the
// forward drops them from P~ V (not from l_i) and scales O_i at the end; the backward takes
// Z = keep / (1 - p) into dV = (Z o P)^T dO and dS = P o (Z o dP - D). A modifier is
// compiled in only where a call uses it (FLASH_<NAME>=1; cupyflash/_flags.py: FLAGS), so a plain call runs
// the plain kernel and pays nothing. The repair, a slow path, reads them at run time instead
// (FLASH_<NAME>=FLASH_AT_RUN_TIME: the code compiled in, each use testing the call's bit, types.cuh: SWITCH_ON).
// The backward's dS is taken with respect to the modified score; the chain back to scale q . k
// multiplies it by ds'/ds: score_mod_grad, times 1 - tanh^2 (softcap; ALiBi adds a constant).
//
// User expressions (cupyflash/_expr.py renders them, in acc_t's arithmetic) read s, b (the flat batch
// index), q_idx, kv_idx (positions in the sequence, long long) and the names FLASH_USER_ARGS declares
// from UserArgs' slots (mod_args: an array's address or a number's bits each).
//
// tanh: the forward of 16-bit inputs takes the hardware's tanh.approx (relative error 2^-11, what
// rounding a score to float16 costs); float32 and float64 take the accurate tanhf / tanh. The
// backward's 16-bit ds'/ds = 1 - tanh^2 is computed from exp(-2|x|) (tanh_and_grad), accurate
// relative to itself where tanh saturates, which 1 - tanh.approx^2 is not.

#pragma once

#include "layout.cuh"
#include "mask.cuh"
#include "philox.cuh"
#include "types.cuh"

#ifndef FLASH_SOFTCAP
#define FLASH_SOFTCAP 0
#endif
#ifndef FLASH_ALIBI
#define FLASH_ALIBI 0
#endif
#ifndef FLASH_BIAS
#define FLASH_BIAS 0
#endif
#ifndef FLASH_MASK
#define FLASH_MASK 0
#endif
#ifndef FLASH_DROPOUT
#define FLASH_DROPOUT 0
#endif
#ifndef FLASH_DEVICE_SEED
#define FLASH_DEVICE_SEED 0   // dropout's key read from ScoreMods::seed_at as the kernel runs
#endif
#ifndef FLASH_BIAS_GRAD
#define FLASH_BIAS_GRAD 0   // dbias (add_dbias_quad)
#endif

#ifdef FLASH_USER_SCORE
constexpr bool USER_SCORE = true;
#else
constexpr bool USER_SCORE = false;
#endif
#ifdef FLASH_USER_MASK
constexpr bool USER_MASK = true;
#else
constexpr bool USER_MASK = false;
#endif
#ifndef FLASH_USER_ARGS
#define FLASH_USER_ARGS
#endif

// each modifier's code compiled in (on, or read at run time: SWITCH_ON)
constexpr bool SOFTCAP = FLASH_SOFTCAP != 0;
constexpr bool ALIBI = FLASH_ALIBI != 0;
constexpr bool BIAS = FLASH_BIAS != 0;
constexpr bool BOOL_MASK = FLASH_MASK != 0;
constexpr bool HIDES = BOOL_MASK || USER_MASK;             // pairs hidden one by one, beyond the band
constexpr bool CHAIN = SOFTCAP || USER_SCORE;              // the backward multiplies dS by ds'/ds
constexpr bool SCORE_MODS = SOFTCAP || ALIBI || BIAS || BOOL_MASK || USER_SCORE || USER_MASK;
constexpr bool MODS_BUT_USER_MASK = SOFTCAP || ALIBI || BIAS || BOOL_MASK || USER_SCORE;
constexpr bool DROPOUT = FLASH_DROPOUT != 0;

__device__ __forceinline__ acc_t tanh_acc(acc_t x) {
#if FLASH_TENSOR_CORES
    float r;
    asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#elif FLASH_DTYPE == 3
    return tanh(x);
#else
    return tanhf(x);
#endif
}

// tanh(x) and its derivative 1 - tanh(x)^2, both to a few ulps: with e = exp(-2|x|),
// tanh = sign(x) (1 - e) / (1 + e) and 1 - tanh^2 = 4 e / (1 + e)^2 (16-bit inputs), else from tanh
__device__ __forceinline__ void tanh_and_grad(acc_t x, acc_t& t, acc_t& grad) {
#if FLASH_TENSOR_CORES
    const float e = exp2f(-2.f * (float)LOG2E * fabsf(x));
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
    t = copysignf((1.f - e) * r, x);
    grad = 4.f * e * r * r;
#else
    t = tanh_acc(x);
    grad = (acc_t)1 - t * t;
#endif
}

// mod_args as the kernels read them: each slot an array's address or a number's bits (an int's as
// long long, a float's as double)
struct UserArgs {
    unsigned long long slot[8];
};

// score_mod, score_mod_grad and mask_mod of one pair (identity, 1 and visible where not compiled in)
__device__ __forceinline__ acc_t user_score(acc_t s, long long b, long long q_idx, long long kv_idx,
                                            const UserArgs& args) {
#ifdef FLASH_USER_SCORE
    FLASH_USER_ARGS
    return (acc_t)(FLASH_USER_SCORE);
#else
    return s;
#endif
}

__device__ __forceinline__ acc_t user_score_grad(acc_t s, long long b, long long q_idx, long long kv_idx,
                                                 const UserArgs& args) {
#ifdef FLASH_USER_GRAD
    FLASH_USER_ARGS
    return (acc_t)(FLASH_USER_GRAD);
#else
    return (acc_t)1;
#endif
}

__device__ __forceinline__ bool user_visible(long long b, long long q_idx, long long kv_idx, const UserArgs& args) {
#ifdef FLASH_USER_MASK
    FLASH_USER_ARGS
    return (FLASH_USER_MASK) != 0;
#else
    return true;
#endif
}

// A per-entry array of the call (ALiBi slopes, sink logits): one value per batch entry, element strides
// along the three collapsed batch dims, 0 along a broadcast dim
template <typename T>
struct EntryArray {
    T* ptr;
    i64 s0, s1, s2;

    // batch entry bi's value
    __device__ __forceinline__ T at(BatchIndex bi) const { return ptr[batch_offset(bi, s0, s1, s2)]; }
};

// A per-pair array of the call (bias, mask, dbias), broadcastable to (batch..., Nq, Nk): element strides
// along the three collapsed batch dims, the queries and the keys, 0 along a broadcast dim. Over packed
// sequences its rows and keys are the packed ones (total_q, total_k).
template <typename T>
struct PairArray {
    T* ptr;
    i64 s0, s1, s2, si, sj;

    // batch entry bi's pair (i0, j0)
    __device__ __forceinline__ T* at(BatchIndex bi, int i0, int j0) const {
        return ptr + batch_offset(bi, s0, s1, s2) + i0 * si + j0 * sj;
    }
};

// One sequence's pairs of a PairArray: pair (i, j) of the sequence, i < Nq, j < Nk (the query and key
// strides below 2^31 elements, checked on the host; their products 64-bit)
template <typename T>
struct Pairs {
    T* ptr;   // the sequence's pair (0, 0)
    int si, sj;

    __device__ __forceinline__ T& operator()(int i, int j) const { return ptr[(i64)i * si + (i64)j * sj]; }
};

// One batch entry's modifiers (ScoreMods::at)
struct EntryMods {
    acc_t cap, inv_cap;   // softcap c and 1 / c
    acc_t slope;          // ALiBi slope
    int off;              // Nk - Nq
    int Nq, Nk;           // the sequence's lengths: pairs past them have no bias and are hidden
    Pairs<const elem_t> bias;
    Pairs<const unsigned char> keep;   // the boolean mask, 1 = visible
    Pairs<acc_t> dbias;   // BIAS: where the call asks for dbias (uses & USES_BIAS_GRAD), else null
    bool dbias_add;       // several CTAs or lanes add into one dbias element (atomics), else one stores it
    // dropout: the batch entry's flat index b (two words), the sequence's first packed row, the Philox
    // key (the seed's two words), the threshold round(p 2^32) and 1 / (1 - p)
    unsigned b_lo, b_hi, pq0, seed_lo, seed_hi, threshold;
    acc_t keep_scale;
    long long b;          // user expressions: the flat batch index
    UserArgs user;        // ... and mod_args
    bool user_all = false;   // the tile map's ALL for the tile at hand: mask_mod hides none of its pairs

    unsigned uses;        // the call's switches (types.cuh: Uses), for the modifiers read at run time

    // dropout applies to this call
    __device__ __forceinline__ bool drops() const { return DROPOUT && SWITCH_ON(DROPOUT, uses); }

    // the tile at hand needs the modifiers: some modifier but mask_mod, or a mask_mod that may hide a pair
    // (the main kernels, which compile their modifiers in)
    __device__ __forceinline__ bool modifies() const { return MODS_BUT_USER_MASK || (USER_MASK && !user_all); }

    // the boolean mask or mask_mod may hide a pair of the tile at hand
    __device__ __forceinline__ bool hides() const { return BOOL_MASK || (USER_MASK && !user_all); }

    // word `w` (0-3) of a Philox result
    __device__ __forceinline__ static unsigned word(const Words4& r, unsigned w) {
        return (w & 2) ? ((w & 1) ? r.w[3] : r.w[2]) : ((w & 1) ? r.w[1] : r.w[0]);
    }

    // dropout keeps pair (i, j) of the sequence: word j % 4 of Philox at counter (j / 4, q0 + i, b), q0
    // the sequence's first packed row, is at least the threshold (cupyflash/_philox.py: dropout_keep).
    // Keys count from the sequence's first, so a group of four keys never straddles two sequences.
    __device__ __forceinline__ bool kept(int i, int j) const {
        return word(philox4x32((unsigned)j >> 2, pq0 + (unsigned)i, b_lo, b_hi, seed_lo, seed_hi), (unsigned)j & 3) >=
               threshold;
    }

    // ... of the pairs (i, j) and (i, j + 1), j even: one Philox result holds both words
    __device__ __forceinline__ void kept2(int i, int j, bool& first, bool& second) const {
        const Words4 r = philox4x32((unsigned)j >> 2, pq0 + (unsigned)i, b_lo, b_hi, seed_lo, seed_hi);
        first = word(r, (unsigned)j & 3) >= threshold;
        second = word(r, ((unsigned)j & 3) + 1) >= threshold;
    }

    // The pair at which a user expression is evaluated for pair (i, j): (i, j) itself inside the lengths,
    // else the nearest pair inside (its result is then not used). An expression may read its arrays at
    // q_idx and kv_idx, so it never sees a pair past the lengths; and as the evaluation is not behind a
    // branch, the compiler loads an array element that a tile's row or key column shares once, not once
    // per pair (a document mask doc[q_idx] == doc[kv_idx]: 2 + B_C / 4 loads per thread and tile, not 2 per
    // pair). Only tiles of a sequence with queries and keys reach here (Nq, Nk >= 1).
    __device__ __forceinline__ long long user_q(int i) const { return min(i, Nq - 1); }
    __device__ __forceinline__ long long user_kv(int j) const { return min(j, Nk - 1); }

    // the boolean mask or mask_mod hides pair (i, j) (always false without either); pairs past the
    // lengths are hidden
    __device__ __forceinline__ bool hidden(int i, int j) const {
        if constexpr (HIDES) {
            if constexpr (USER_MASK)   // first: not behind the bounds' branch (user_q, user_kv)
                if (!user_all && !user_visible(b, user_q(i), user_kv(j), user)) return true;
            if (i >= Nq || j >= Nk) return true;
            if constexpr (BOOL_MASK)
                if (SWITCH_ON(MASK, uses) && !keep(i, j)) return true;
        }
        return false;
    }

    // score_mod of pair (i, j) at s (natural units, after the softcap); DERIV: grad *= score_mod_grad at s.
    // A pair past the lengths (a tile's ragged end) gets score_mod at the nearest pair inside (user_q,
    // user_kv) where the band hides it afterwards (the forwards: no branch per pair, so a divisor's
    // reciprocal is taken once); the backward keeps its s and a derivative of 1 there (dS must stay 0).
    template <bool DERIV = false>
    __device__ __forceinline__ acc_t user_mod(acc_t s, int i, int j, acc_t& grad) const {
        if constexpr (USER_SCORE) {
            const long long q_idx = user_q(i), kv_idx = user_kv(j);
            if constexpr (DERIV) {
                const bool inside = i < Nq && j < Nk;
                const acc_t d = user_score_grad(s, b, q_idx, kv_idx, user), t = user_score(s, b, q_idx, kv_idx, user);
                grad *= inside ? d : (acc_t)1;
                return inside ? t : s;
            }
            return user_score(s, b, q_idx, kv_idx, user);
        }
        return s;
    }

    // s of pair (i, j) with the bias added and -inf where the mask hides it
    __device__ __forceinline__ acc_t pair_score(acc_t s, int i, int j) const {
        if constexpr (BIAS)
            if (SWITCH_ON(BIAS, uses) && i < Nq && j < Nk) s += to_acc(bias(i, j));
        if constexpr (HIDES)
            if (hidden(i, j)) s = NEG_INF;
        return s;
    }

    // dbias_ij gets dS_ij (d loss / d final score) of a pair the band leaves visible: the mask's hidden
    // pairs and pairs past the lengths add nothing (dbias is zeroed first); the call asks for dbias
    __device__ __forceinline__ void add_dbias(int i, int j, acc_t ds) const {
        if constexpr (BIAS) {
            if (i >= Nq || j >= Nk || hidden(i, j)) return;
            if (dbias_add) atomicAdd(&dbias(i, j), ds);
            else           dbias(i, j) = ds;
        }
    }

    // s <- c tanh(s / c); DERIV: grad = ds'/ds (untouched without a softcap)
    template <bool DERIV = false>
    __device__ __forceinline__ acc_t cap_score(acc_t s, acc_t& grad) const {
        if constexpr (SOFTCAP)
            if (SWITCH_ON(SOFTCAP, uses)) {
                acc_t t;
                if constexpr (DERIV) tanh_and_grad(s * inv_cap, t, grad);
                else                 t = tanh_acc(s * inv_cap);
                return cap * t;
            }
        return s;
    }

    // s <- s - slope |distance|, distance = i + off - j (either sign); a slope of 0 where ALiBi is read at
    // run time and the call has none leaves s as it is
    __device__ __forceinline__ acc_t alibi(acc_t s, acc_t distance) const {
        if constexpr (ALIBI) return s - slope * fabs(distance);
        return s;
    }

    // the modified score of query i, key j from s = scale q_i . k_j; DERIV: grad (1 on entry) gets ds'/ds
    template <bool DERIV = false>
    __device__ __forceinline__ acc_t apply(acc_t s, int i, int j, acc_t& grad) const {
        return pair_score(alibi(user_mod<DERIV>(cap_score<DERIV>(s, grad), i, j, grad), (acc_t)(i + off - j)), i, j);
    }
};

// What a call's modifiers read (params.cuh: FwdParams::mods, BwdParams::mods): the members of each row
// of cupyflash/_flags.py's FLAGS in table order (its `fields`; _params.py mirrors them from there), then
// the batch offset and mod_args
struct ScoreMods {
    double softcap;                         // FLASH_SOFTCAP: c > 0
    EntryArray<const acc_t> alibi;          // FLASH_ALIBI: slopes, one per batch entry
    EntryArray<const acc_t> sink;           // uses & USES_SINK: sink logits, one per batch entry (params.cuh: sink_of)
    PairArray<const elem_t> bias;           // FLASH_BIAS, in the inputs' dtype
    PairArray<acc_t> dbias;                 // uses & USES_BIAS_GRAD: bias's shape (or the full one), zeroed
    int dbias_add;                          // EntryMods::dbias_add
    PairArray<const unsigned char> keep;    // FLASH_MASK: bool, 1 = visible
    unsigned threshold;                     // FLASH_DROPOUT: round(p 2^32), a word below it drops its pair
    double keep_scale;                      // FLASH_DROPOUT: 1 / (1 - p)
    unsigned long long seed;                // FLASH_DROPOUT: the Philox key (written per call) ...
    const unsigned long long* seed_at;      // ... or, FLASH_DEVICE_SEED, where the kernels read it
    i64 batch0;                             // the flat batch index of the call's entry 0 (of a peeled piece)
    UserArgs user;                          // FLASH_USER_*: mod_args

    // the modifiers of batch entry bi (flat index `entry`) for its sequence of Nq queries and Nk keys, the
    // first pair at (q0, k0) of the entry's (packed) rows and keys, of a call that uses `uses` (types.cuh)
    __device__ __forceinline__ EntryMods at(BatchIndex bi, i64 entry, int q0, int k0, int Nq, int Nk,
                                            unsigned uses) const {
        EntryMods e;
        e.uses = uses;
        e.cap = (acc_t)softcap;
        e.inv_cap = SOFTCAP && SWITCH_ON(SOFTCAP, e.uses) ? (acc_t)1 / e.cap : (acc_t)0;
        e.slope = ALIBI && SWITCH_ON(ALIBI, e.uses) ? alibi.at(bi) : (acc_t)0;
        e.off = Nk - Nq;
        e.Nq = Nq;
        e.Nk = Nk;
        if constexpr (BIAS)
            e.bias = {SWITCH_ON(BIAS, e.uses) ? bias.at(bi, q0, k0) : nullptr, (int)bias.si, (int)bias.sj};
        if constexpr (BOOL_MASK)
            e.keep = {SWITCH_ON(MASK, e.uses) ? keep.at(bi, q0, k0) : nullptr, (int)keep.si, (int)keep.sj};
        if constexpr (BIAS)
            e.dbias = {SWITCH_ON(BIAS_GRAD, e.uses) ? dbias.at(bi, q0, k0) : nullptr, (int)dbias.si,
                       (int)dbias.sj};
        e.dbias_add = dbias_add != 0;
        if constexpr (USER_SCORE || USER_MASK) {
            e.b = (long long)(batch0 + entry);
            e.user = user;
        }
        if constexpr (DROPOUT) {
            const unsigned long long b = (unsigned long long)(batch0 + entry);
            e.b_lo = (unsigned)b;
            e.b_hi = (unsigned)(b >> 32);
            e.pq0 = (unsigned)q0;
            const unsigned long long key = SWITCH_ON(DEVICE_SEED, e.uses) ? *seed_at : seed;
            e.seed_lo = (unsigned)key;
            e.seed_hi = (unsigned)(key >> 32);
            e.threshold = threshold;
            e.keep_scale = (acc_t)keep_scale;
        }
        return e;
    }
};

// The query i and key j of element (n, e) of a warp's accumulator tile: rows r0 + g + 8 (e / 2),
// columns c0 + 8n + 2t + e % 2 are queries and keys, or (TRANSPOSED) keys and queries
template <bool TRANSPOSED>
__device__ __forceinline__ void pair_at(int r0, int c0, int n, int e, int& i, int& j) {
    const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int row = r0 + g + 8 * (e / 2), col = c0 + 8 * n + 2 * t + e % 2;
    i = TRANSPOSED ? col : row;
    j = TRANSPOSED ? row : col;
}

// Some pair inside the ragged ends may be hidden: the band's answer, and any under a boolean mask or a
// mask_mod
__device__ __forceinline__ bool may_hide_any(const Mask& mask) { return HIDES || mask.banded(); }

// The tile of rows [q0, q0 + rows) x keys [k0, k0 + cols) may hold a hidden pair that is not past a
// ragged end (nonfinite.cuh): the band's answer, and under a boolean mask any tile, under a mask_mod
// any tile but one its tile map marks ALL (`all`: Visits::all_of of the tile's visit; a caller that
// leaves it false counts every tile under a mask_mod)
__device__ __forceinline__ bool may_hide(const Mask& mask, int q0, int rows, int k0, int cols, bool all = false) {
    return BOOL_MASK || (USER_MASK && !all) || mask.has_masked_pairs(q0, rows, k0, cols);
}

// Dropout's keep bits of the four elements of n-tile n of a warp's tile (rows r0 .., columns c0 .. as
// in pair_at): bit e set where element e's pair is kept.
//
// TRANSPOSED (rows keys, the backward's S^T): a lane's four elements are four Philox results, one word
// of each (keys g and g + 8, queries c and c + 1). The warp's first key starts a group of four in the
// keep set (it is a multiple of 16), so the four lanes g = 4m .. 4m+3 of one t need the same four
// results, word g % 4 of each: lane r = g % 4 draws result r (element r), and four shuffles hand each
// lane its word of each: one draw per lane instead of four.
template <bool TRANSPOSED>
__device__ __forceinline__ unsigned keep_bits(const EntryMods& mods, int r0, int c0, int n) {
    if constexpr (TRANSPOSED) {
        if ((r0 & 3) == 0) {
            const int lane = threadIdx.x % WARP_SIZE, r = lane / 4 & 3;
            int i, j;
            pair_at<true>(r0, c0, n, r, i, j);   // element r: key g + 8 (r / 2), query c + r % 2
            const Words4 mine =
                philox4x32((unsigned)j >> 2, mods.pq0 + (unsigned)i, mods.b_lo, mods.b_hi, mods.seed_lo, mods.seed_hi);
            unsigned bits = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) {   // round k: receive word r of the result of lane r - k (its element)
                const int from = (r - k) & 3;
                const unsigned word = __shfl_sync(0xffffffffu, EntryMods::word(mine, (unsigned)(r + k) & 3),
                                                  (lane & ~12) | from << 2);
                bits |= (unsigned)(word >= mods.threshold) << from;
            }
            return bits;
        }
    }
    unsigned bits = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int i, j;
        pair_at<TRANSPOSED>(r0, c0, n, 2 * h, i, j);
        bool first, second;
        if constexpr (TRANSPOSED) {   // elements 2h, 2h + 1: one key, two queries
            first = mods.kept(i, j);
            second = mods.kept(i + 1, j);
        } else {                      // one query, two keys
            mods.kept2(i, j, first, second);
        }
        bits |= (unsigned)first << (2 * h) | (unsigned)second << (2 * h + 1);
    }
    return bits;
}

// Dropout on a warp's (16, 8 NT) tile of P~ (rows queries): the dropped elements -> 0; the kept keep
// their value (the 1 / (1 - p) is applied to O_i at the end)
template <int NT>
__device__ __forceinline__ void drop_probs(acc_t (&P)[NT][4], const EntryMods& mods, int r0, int c0) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const unsigned bits = keep_bits<false>(mods, r0, c0, n);
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!(bits >> e & 1)) P[n][e] = (acc_t)0;
    }
}

// Z = keep / (1 - p) of element e under keep bits `bits` (1 without dropout)
__device__ __forceinline__ acc_t keep_factor(const EntryMods& mods, unsigned bits, int e) {
    if constexpr (DROPOUT) return (bits >> e & 1) ? mods.keep_scale : (acc_t)0;
    return (acc_t)1;
}

// dbias of the four elements ds of n-tile n of a warp's (16, 8 NT) tile of dS (rows r0 .., columns
// c0 .. as in pair_at), d loss / d final score, where the call asks for it; pairs the band hides add nothing
template <bool TRANSPOSED>
__device__ __forceinline__ void add_dbias_quad(const acc_t (&ds)[4], const EntryMods& mods, const Mask& mask, int r0,
                                               int c0, int n) {
    if (BIAS && SWITCH_ON(BIAS_GRAD, mods.uses))   // a bias compiled in and dbias asked for
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int i, j;
            pair_at<TRANSPOSED>(r0, c0, n, e, i, j);
            if (mask.visible(i, j)) mods.add_dbias(i, j, ds[e]);
        }
}

// The modifiers on a warp's (16, 8*NT) accumulator tile of scores in natural units (mma_sm80.cuh and
// wgmma fragments alike): rows r0 + g, r0 + g + 8, columns c0 + 8n + 2t + {0, 1}. Rows are queries
// and columns keys, or, TRANSPOSED (the backward's S^T), rows keys and columns queries. Without
// DERIV, G is not written; with it G holds each element's ds'/ds (the softcap's and score_mod's).
template <bool TRANSPOSED, bool DERIV = false, int NT>
__device__ __forceinline__ void modify_scores(acc_t (&S)[NT][4], acc_t (&G)[DERIV ? NT : 1][4], const EntryMods& mods,
                                              int r0, int c0) {
    const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    // |i + off - j| of element (n, e): |base[e / 2] - (8n + e % 2)|, for either orientation
    acc_t base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + g + 8 * h, col = c0 + 2 * t;
        base[h] = (acc_t)(TRANSPOSED ? row - mods.off - col : row + mods.off - col);
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc_t grad = (acc_t)1;
            int i = 0, j = 0;
            if constexpr (BIAS || HIDES || USER_SCORE) pair_at<TRANSPOSED>(r0, c0, n, e, i, j);
            const acc_t s = mods.user_mod<DERIV>(mods.cap_score<DERIV>(S[n][e], grad), i, j, grad);
            if constexpr (DERIV) G[n][e] = grad;
            S[n][e] = mods.alibi(s, base[e / 2] - (acc_t)(8 * n + e % 2));
            if constexpr (BIAS || HIDES) S[n][e] = mods.pair_score(S[n][e], i, j);
        }
}

// The modifiers in units of `unit`, for a kernel whose online softmax scales differences of raw scores
// x = q . k into its exponent (the Hopper forward): the natural score is unit * S with
//     softcap:  S = tanh(x scale / c),  unit = c        else  S = x,  unit = scale (> 0)
//     score_mod: S = score_mod(unit S) / unit
//     ALiBi:    S -= (slope / unit) |i + off - j|
//     bias:     S += bias_ij / unit;  mask: S = -inf where hidden
// so no element pays a multiplication into natural units but the bias's.
struct RawMods {
    acc_t in_scale;   // scale / c: x -> the tanh's argument
    acc_t unit;       // natural units per unit of S: m_i's scale, and the exponent's (times log2 e)
    acc_t slope;      // ALiBi slope / unit
    acc_t inv_unit;   // 1 / unit: the bias's and score_mod's factor
    const EntryMods& entry;   // the offset Nk - Nq, the bias and the mask

    __device__ __forceinline__ RawMods(const EntryMods& mods, acc_t scale)
        : in_scale(SOFTCAP ? scale * mods.inv_cap : (acc_t)0), unit(SOFTCAP ? mods.cap : scale),
          slope(ALIBI ? mods.slope / unit : (acc_t)0), inv_unit(BIAS || USER_SCORE ? (acc_t)1 / unit : (acc_t)0),
          entry(mods) {}
};

// |i + off - j| of a warp's tile element (n, e) is |base[e / 2] - (8n + e % 2)| (raw_base): rows r0 + g,
// r0 + g + 8 and columns c0 + 8n + 2t + {0, 1} are queries and keys, or keys and queries (TRANSPOSED)
template <bool TRANSPOSED>
__device__ __forceinline__ void raw_base(acc_t (&base)[2], int off, int r0, int c0) {
    const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + g + 8 * h, col = c0 + 2 * t;
        base[h] = (acc_t)(TRANSPOSED ? row - off - col : row + off - col);
    }
}

// RawMods on the four accumulator values x of n-tile n of a warp's tile of raw scores (base from
// raw_base, rows r0 .., columns c0 .. as there); DERIV: grad gets each one's ds'/ds (the softcap's
// and score_mod's; untouched without either). PAIRS: the bias and the masks too (else the caller's:
// modify_raw_scores with a PairTile)
template <bool TRANSPOSED, bool DERIV = false, bool PAIRS = true>
__device__ __forceinline__ void modify_raw_quad(acc_t (&x)[4], acc_t (&grad)[4], const RawMods& mods,
                                                const acc_t (&base)[2], int r0, int c0, int n) {
    if constexpr (SOFTCAP)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if constexpr (DERIV) tanh_and_grad(x[e] * mods.in_scale, x[e], grad[e]);
            else                 x[e] = tanh_acc(x[e] * mods.in_scale);
        }
    if constexpr (USER_SCORE)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int i, j;
            pair_at<TRANSPOSED>(r0, c0, n, e, i, j);
            if constexpr (DERIV && !SOFTCAP) grad[e] = (acc_t)1;
            x[e] = mods.entry.user_mod<DERIV>(x[e] * mods.unit, i, j, grad[e]) * mods.inv_unit;
        }
    if constexpr (ALIBI)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] -= mods.slope * fabs(base[e / 2] - (acc_t)(8 * n + e % 2));
    if constexpr (PAIRS && (BIAS || HIDES))
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int i, j;
            pair_at<TRANSPOSED>(r0, c0, n, e, i, j);
            if constexpr (BIAS)
                if (i < mods.entry.Nq && j < mods.entry.Nk) x[e] += to_acc(mods.entry.bias(i, j)) * mods.inv_unit;
            if constexpr (HIDES)
                if (mods.entry.hidden(i, j)) x[e] = NEG_INF;
        }
}

// RawMods on a warp's (16, 8*NT) tile of raw scores Q_i K_j^T (rows r0 + g, r0 + g + 8 queries,
// columns c0 + 8n + 2t + {0, 1} keys)
template <int NT>
__device__ __forceinline__ void modify_raw_scores(acc_t (&S)[NT][4], const RawMods& mods, int r0, int c0) {
    acc_t base[2], unused[4];
    raw_base<false>(base, mods.entry.off, r0, c0);
#pragma unroll
    for (int n = 0; n < NT; ++n) modify_raw_quad<false>(S[n], unused, mods, base, r0, c0, n);
}

// the unsigned type of two values of `BYTES` bytes each
template <int BYTES> struct TwoValues;
template <> struct TwoValues<1> { using type = unsigned short; };
template <> struct TwoValues<2> { using type = unsigned; };

// The values of per-pair arrays over a warp's (16, 8 NT) tile of pairs in the accumulator layout (rows
// r0 + g, r0 + g + 8; columns c0 + 8n + 2t + {0, 1}: queries and keys, or keys and queries TRANSPOSED),
// loaded ahead of the tile's scores: the Hopper kernels issue the loads under the tile's products (the
// forward's Q_i K_j^T, the backward's K_j Q_i^T and V_j dO_i^T), so their latency is not the softmax's,
// and one load brings two pairs where the array's rows allow (pair_words; not TRANSPOSED, where a word's
// two pairs are two queries). Word [n][h] holds accumulator row r0 + g + 8h's two values, the even
// column's in the low bits; 0 past the lengths (a hidden pair for the mask).
template <int NT, bool TRANSPOSED = false>
struct PairTile {
    unsigned bias[NT][2];   // BIAS: two 16-bit values a word
    unsigned keep[NT][2];   // BOOL_MASK: two bytes a word

    __device__ __forceinline__ void load(const EntryMods& m, int r0, int c0) {
        const int lane = threadIdx.x % WARP_SIZE;
        if constexpr (BIAS) words_of(bias, m.bias, m.Nq, m.Nk, r0, c0, lane);
        if constexpr (BOOL_MASK)
            if (SWITCH_ON(MASK, m.uses)) words_of(keep, m.keep, m.Nq, m.Nk, r0, c0, lane);
    }

    // the words of array `a` (indexed (query, key), Nq by Nk) that lane `lane` holds: rows r0 .. of the
    // accumulator tile are queries, or keys TRANSPOSED (host code too: tests/test_score_mod_cuh.py)
    template <typename T>
    __host__ __device__ __forceinline__ static void words_of(unsigned (&w)[NT][2], const Pairs<const T>& a, int Nq,
                                                             int Nk, int r0, int c0, int lane) {
        if (TRANSPOSED) pair_words(w, Pairs<const T>{a.ptr, a.sj, a.si}, Nk, Nq, r0, c0, lane);
        else            pair_words(w, a, Nq, Nk, r0, c0, lane);
    }

    // pair (n, e) of the accumulator tile (e: row e / 2, column e % 2 of the n-tile's quad)
    __device__ __forceinline__ acc_t bias_at(int n, int e) const {
        return to_acc((elem_t)(bias[n][e / 2] >> (16 * (e % 2))));
    }
    __device__ __forceinline__ bool kept(int n, int e) const { return (keep[n][e / 2] >> (8 * (e % 2))) & 0xffu; }

    // ... of array `a` (16-bit or bytes) indexed (accumulator row, column), Nq rows by Nk columns: where
    // the warp's pairs lie inside the lengths, one load per word if the array's rows keep two pairs aligned
    // (a column stride of 1), else (TRANSPOSED) two without bounds tests, or one per row if a column stride
    // of 0 makes the row one value; elsewhere one per value, tested against the lengths
    template <typename T>
    __host__ __device__ __forceinline__ static void pair_words(unsigned (&w)[NT][2], const Pairs<const T>& a, int Nq,
                                                               int Nk, int r0, int c0, int lane) {
        static_assert(sizeof(T) <= 2, "two values a word");
        using Two = typename TwoValues<sizeof(T)>::type;
        const int g = lane / 4, t = lane % 4;
        const bool aligned = a.sj == 1 && a.si % 2 == 0 && reinterpret_cast<unsigned long long>(a.ptr) % sizeof(Two) == 0;
        if (aligned && r0 + 16 <= Nq && c0 + 8 * NT <= Nk) {
            if (a.si == 0) {   // one row for all (a key-padding mask): the lane's two rows load once
                const T* row = a.ptr + c0 + 2 * t;
#pragma unroll
                for (int n = 0; n < NT; ++n) w[n][0] = w[n][1] = *reinterpret_cast<const Two*>(row + 8 * n);
            } else {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const T* row = a.ptr + (i64)(r0 + g + 8 * h) * a.si + c0 + 2 * t;
#pragma unroll
                    for (int n = 0; n < NT; ++n) w[n][h] = *reinterpret_cast<const Two*>(row + 8 * n);
                }
            }
        } else if (TRANSPOSED && r0 + 16 <= Nq && c0 + 8 * NT <= Nk) {
            // rows of keys, inside the lengths: a word's two pairs are two queries a.sj apart, no bounds to
            // test; a column stride of 0 (a key-padding mask, the same for every query) one load a row
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const T* row = a.ptr + (i64)(r0 + g + 8 * h) * a.si + (i64)(c0 + 2 * t) * a.sj;
                if (a.sj == 0) {
                    const unsigned value = row[0];
#pragma unroll
                    for (int n = 0; n < NT; ++n) w[n][h] = value | value << (8 * sizeof(T));
                } else {
#pragma unroll
                    for (int n = 0; n < NT; ++n)
                        w[n][h] = (unsigned)row[(i64)(8 * n) * a.sj] | (unsigned)row[(i64)(8 * n + 1) * a.sj] << (8 * sizeof(T));
                }
            }
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = r0 + g + 8 * h;
                const T* row = a.ptr + (i64)min(i, Nq - 1) * a.si;   // a tile has rows of the sequence: Nq >= 1
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int j = c0 + 8 * n + 2 * t;
                    const unsigned lo = i < Nq && j < Nk ? (unsigned)row[(i64)j * a.sj] : 0u;
                    const unsigned hi = i < Nq && j + 1 < Nk ? (unsigned)row[(i64)(j + 1) * a.sj] : 0u;
                    w[n][h] = lo | hi << (8 * sizeof(T));
                }
            }
        }
    }
};

// No pairs loaded ahead: a kernel whose modifiers read their pairs themselves, or read none
struct NoPairTile {
    __device__ __forceinline__ void load(const EntryMods&, int, int) {}
};

// PairTile<NT, TRANSPOSED> where `AHEAD`, else NoPairTile
template <bool AHEAD, int NT, bool TRANSPOSED> struct PairsAhead { using type = NoPairTile; };
template <int NT, bool TRANSPOSED> struct PairsAhead<true, NT, TRANSPOSED> { using type = PairTile<NT, TRANSPOSED>; };
// What a kernel that loads its pairs ahead holds: a bias's and a boolean mask's, unless a mask_mod reads
// pairs too
template <int NT, bool TRANSPOSED = false>
using PairsOfTile = typename PairsAhead<(BIAS || BOOL_MASK) && !USER_MASK, NT, TRANSPOSED>::type;

// modify_raw_quad with the bias and boolean mask of n-tile n from `pairs` (loaded ahead), not read pair by
// pair: the same scores (a pair past the lengths adds 0 and is hidden, as a hidden or masked one)
template <bool TRANSPOSED, bool DERIV = false, int NT>
__device__ __forceinline__ void modify_raw_quad(acc_t (&x)[4], acc_t (&grad)[4], const RawMods& mods,
                                                const acc_t (&base)[2], int r0, int c0, int n,
                                                const PairTile<NT, TRANSPOSED>& pairs) {
    static_assert(!USER_MASK, "mask_mod reads its pairs itself");
    modify_raw_quad<TRANSPOSED, DERIV, false>(x, grad, mods, base, r0, c0, n);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if constexpr (BIAS) x[e] += pairs.bias_at(n, e) * mods.inv_unit;
        if constexpr (BOOL_MASK)
            if (SWITCH_ON(MASK, mods.entry.uses) && !pairs.kept(n, e)) x[e] = NEG_INF;
    }
}

// ... and with none loaded ahead: every modifier reads its own
template <bool TRANSPOSED, bool DERIV = false>
__device__ __forceinline__ void modify_raw_quad(acc_t (&x)[4], acc_t (&grad)[4], const RawMods& mods,
                                                const acc_t (&base)[2], int r0, int c0, int n, const NoPairTile&) {
    modify_raw_quad<TRANSPOSED, DERIV>(x, grad, mods, base, r0, c0, n);
}

// RawMods on a warp's tile with its bias and boolean mask from `pairs` (loaded ahead)
template <int NT>
__device__ __forceinline__ void modify_raw_scores(acc_t (&S)[NT][4], const RawMods& mods, int r0, int c0,
                                                  const PairTile<NT>& pairs) {
    acc_t base[2], unused[4];
    raw_base<false>(base, mods.entry.off, r0, c0);
#pragma unroll
    for (int n = 0; n < NT; ++n) modify_raw_quad<false>(S[n], unused, mods, base, r0, c0, n, pairs);
}

// ... and with none loaded ahead: every modifier reads its own
template <int NT>
__device__ __forceinline__ void modify_raw_scores(acc_t (&S)[NT][4], const RawMods& mods, int r0, int c0,
                                                  const NoPairTile&) {
    modify_raw_scores(S, mods, r0, c0);
}

// ... the forward's form: no derivative
template <int NT>
__device__ __forceinline__ void modify_scores(acc_t (&S)[NT][4], const EntryMods& mods, int r0, int c0) {
    acc_t unused[1][4];
    modify_scores<false, false>(S, unused, mods, r0, c0);
}
