// philox.cuh — Philox4x32-10 (Salmon, Moraes, Dror and Shaw, 2011), the counter-based generator of
// dropout's keep set: (counter, key) -> four random words, no state, so any tile of any kernel draws
// the word of any (batch entry, query, key) on its own. cupyflash/_philox.py is the definition (its
// NumPy twin); tests/test_philox_cuh.py compiles this header for the host and checks it bit for bit.
//
// Pair (query i, key j) of flat batch entry b is kept iff word j % 4 of philox4x32 at counter
// (j / 4, i, b mod 2^32, b >> 32) under key (seed mod 2^32, seed >> 32) is at least the threshold
// round(p 2^32).

#pragma once

struct Words4 {
    unsigned w[4];
};

// the (high, low) words of a * b
__host__ __device__ __forceinline__ void mulhilo(unsigned a, unsigned b, unsigned& hi, unsigned& lo) {
#ifdef __CUDA_ARCH__
    hi = __umulhi(a, b);
    lo = a * b;
#else
    const unsigned long long p = (unsigned long long)a * b;
    hi = (unsigned)(p >> 32);
    lo = (unsigned)p;
#endif
}

__host__ __device__ __forceinline__ Words4 philox4x32(unsigned c0, unsigned c1, unsigned c2, unsigned c3, unsigned k0,
                                                      unsigned k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned hi0, lo0, hi1, lo1;
        mulhilo(0xD2511F53u, c0, hi0, lo0);
        mulhilo(0xCD9E8D57u, c2, hi1, lo1);
        const unsigned n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    return {{c0, c1, c2, c3}};
}
