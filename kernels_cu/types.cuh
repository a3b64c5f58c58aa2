// types.cuh — element and accumulator types, numeric constants, conversions.
//
// Every kernel is compiled by NVRTC as one translation unit: cupyflash/_compile.py pastes each
// local #include in place, once, so nothing here may #include a system header. Compile-time
// parameters arrive as -D defines made by cupyflash/_tiles.py (TileConfig.defines):
//
//   FLASH_DTYPE   0 = float16, 1 = bfloat16, 2 = float32, 3 = float64 (with FLASH_FP8: of the output)
//   FLASH_FP8     1: q, k, v are float8 e4m3 (in_t below; the Hopper forward's FP8 family), 0 or undefined: elem_t
//   FLASH_DP      head dim padded up to its bucket (multiple of 16)
//   FLASH_BR      B_r, query rows per tile
//   FLASH_BC      B_c, key rows per tile
//   FLASH_WARPS   warps per CTA
//   FLASH_DC      head-dim columns of one output chunk (divides FLASH_DP)
//   FLASH_SMEM_BYTES  the dynamic shared memory the host launches with; each kernel asserts its layout
//   FLASH_<NAME>  a switch of cupyflash/_flags.py's FLAGS: 1 compiled in, FLASH_AT_RUN_TIME where the
//                 family reads it at run time (its code compiled in, each use testing the call's bit of
//                 `uses`: Uses below), undefined (0) off
//   and the kernel's own (FLASH_Q_STAGES, FLASH_PRODUCER_REGS, FLASH_CONSUMER_REGS, FLASH_THREADS).

#pragma once

#define FLASH_AT_RUN_TIME 2   // FLASH_<NAME>: read from the run-time word (cupyflash/_flags.py: AT_RUN_TIME)
#define LOG2E 1.4426950408889634
#define WARP_SIZE 32
#define SMEM_PAD_BYTES 16   // one 16-byte row pad: ldmatrix and FMA reads hit distinct banks

typedef long long i64;

// ---------------------------------------------------------------------------
// Element and accumulator types
// ---------------------------------------------------------------------------
#if FLASH_DTYPE == 0 || FLASH_DTYPE == 1
typedef unsigned short elem_t;   // raw 16-bit storage; arithmetic is in float
typedef float acc_t;
#define FLASH_TENSOR_CORES 1
#elif FLASH_DTYPE == 2
typedef float elem_t;
typedef float acc_t;
#define FLASH_TENSOR_CORES 0
#ifndef FLASH_FP32_MMA
#define FLASH_FP32_MMA 0   // the products of float32: 0 exact FMA, 1 3xTF32, 2 one TF32 product (mma_sm80.cuh)
#endif
#else
typedef double elem_t;
typedef double acc_t;
#define FLASH_TENSOR_CORES 0
#endif

// The operands q, k, v: float8 e4m3 bytes under FLASH_FP8 (o stays elem_t, 16-bit), else elem_t
#ifndef FLASH_FP8
#define FLASH_FP8 0
#endif
constexpr bool FP8 = FLASH_FP8 != 0;
#if FLASH_FP8
static_assert(FLASH_DTYPE == 0 || FLASH_DTYPE == 1, "float8 operands give a 16-bit output");
typedef unsigned char in_t;
#else
typedef elem_t in_t;
#endif

// float32 as 3xTF32: the kernels check their operand tiles to pick how they split (mma_sm80.cuh, Split)
#if FLASH_DTYPE == 2 && FLASH_FP32_MMA == 1
constexpr bool TF32_SPLITS = true;
#else
constexpr bool TF32_SPLITS = false;
#endif

// The run-time word `uses` of FwdParams and BwdParams (params.cuh): a bit per switch the call uses, in the
// order of cupyflash/_flags.py's FLAGS (_params.layout_checks asserts each bit). A family that reads a
// switch without compiling it in (its define FLASH_<NAME>) tests its bit.
enum Uses : unsigned {
    USES_SOFTCAP = 1u << 0,
    USES_ALIBI = 1u << 1,
    USES_SINK = 1u << 2,
    USES_BIAS = 1u << 3,
    USES_BIAS_GRAD = 1u << 4,
    USES_MASK = 1u << 5,
    USES_DROPOUT = 1u << 6,
    USES_VARLEN = 1u << 7,
    USES_PAGED = 1u << 8,
    USES_ORDERED = 1u << 9,
    USES_DEVICE_SEED = 1u << 10,
};

// SWITCH_ON(NAME, uses): switch NAME applies to a call whose run-time word is `uses`: FLASH_<NAME> compiles it
// in (1) or out (0), a constant, or reads bit USES_<NAME> of `uses` (FLASH_AT_RUN_TIME). Every switch's
// device code goes through this, so a row of cupyflash/_flags.py's FLAGS moves a family between the two
// forms with no device edit. A macro, not a function: a compiled switch must be a constant expression that
// the front end folds before `uses` is read. Behind an inlined call it reaches the optimiser as a branch on
// a loaded word, and the kernels come out differently (the mask forward 15% slower, benchmarks/ab.py).
#define SWITCH_ON(NAME, uses) \
    (FLASH_##NAME != 0 && (FLASH_##NAME != FLASH_AT_RUN_TIME || ((uses) & USES_##NAME) != 0))

#define POS_INF ((acc_t)__int_as_float(0x7f800000))
#define NEG_INF (-POS_INF)

[[maybe_unused]] constexpr int VEC = 16 / sizeof(elem_t);               // elements in one 16-byte access
[[maybe_unused]] constexpr int PAD = SMEM_PAD_BYTES / sizeof(elem_t);   // row pad of every shared tile
[[maybe_unused]] constexpr int IN_VEC = 16 / sizeof(in_t);              // operand elements in one 16-byte access

__device__ __forceinline__ float bits_to_float(unsigned short h) {
#if FLASH_DTYPE == 0
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float(((unsigned)h) << 16);
#endif
}

// two floats -> two packed 16-bit values, round to nearest even; `lo` in the low half
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
#if FLASH_DTYPE == 0
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ acc_t to_acc(elem_t x) {
#if FLASH_TENSOR_CORES
    return bits_to_float(x);
#else
    return x;
#endif
}

#if FLASH_FP8
// a float8 e4m3 operand (e4m3fn: no inf, NaN where the seven low bits are all set) as a float, exactly
__device__ __forceinline__ float to_acc(in_t x) {
    unsigned short h2;
    asm("{\n.reg .b32 r;\ncvt.rn.f16x2.e4m3x2 r, %1;\nmov.b32 {%0, _}, r;\n}" : "=h"(h2) : "h"((unsigned short)x));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h2));
    return f;
}

// four floats -> four packed e4m3 values, round to nearest even, saturated to +-448; `a` in the low byte
__device__ __forceinline__ unsigned pack4_e4m3(float a, float b, float c, float d) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return (unsigned)lo | (unsigned)hi << 16;
}
#endif

__device__ __forceinline__ elem_t from_acc(acc_t x) {
#if FLASH_TENSOR_CORES
    return (elem_t)(pack2(x, 0.f) & 0xffffu);
#else
    return x;
#endif
}

__device__ __forceinline__ acc_t exp2_acc(acc_t x) {
#if FLASH_DTYPE == 3
    return exp2(x);
#else
    return exp2f(x);
#endif
}

__device__ __forceinline__ acc_t exp_acc(acc_t x) {
#if FLASH_DTYPE == 3
    return exp(x);
#else
    return expf(x);
#endif
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

template <typename X> struct Pair;
template <> struct Pair<float> { typedef float2 type; };
template <> struct Pair<double> { typedef double2 type; };

__device__ __forceinline__ void load_acc_pair(const acc_t* p, acc_t& a, acc_t& b) {
    const typename Pair<acc_t>::type v = *reinterpret_cast<const typename Pair<acc_t>::type*>(p);
    a = v.x;
    b = v.y;
}

__device__ __forceinline__ void store_acc_pair(acc_t* p, acc_t a, acc_t b) {
    typename Pair<acc_t>::type v;
    v.x = a;
    v.y = b;
    *reinterpret_cast<typename Pair<acc_t>::type*>(p) = v;
}
