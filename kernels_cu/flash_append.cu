// flash_append.cu — new keys and values written into a K/V cache (flash_attention_with_kvcache):
//
//   k[e][len_k[e] + t] = k_new[e][t],  v[e][len_k[e] + t] = v_new[e][t],  t < n_new
//
// for every batch entry e of the cache (batch x K/V heads), in place, before the attention reads
// them. Rows lie where the attention reads them (params.cuh: Pages, KeyRows; compiled with FLASH_PAGED
// for a paged cache); rows at or past the capacity (rows_k) are not written. One thread per VEC
// columns (16-byte accesses where AppendParams::vec) of a row.

#include "params.cuh"
#include "types.cuh"

constexpr int NTHREADS = FLASH_WARPS * WARP_SIZE;

extern "C" __global__ void __launch_bounds__(NTHREADS) flash_append(const AppendParams p) {
    const int step = p.vec ? VEC : 1, chunks = (p.D + step - 1) / step;
    const i64 total = p.batch.count * p.n_new * chunks;
    for (i64 c = (i64)blockIdx.x * NTHREADS + threadIdx.x; c < total; c += (i64)gridDim.x * NTHREADS) {
        const i64 row = c / chunks;
        const int col = (int)(c - row * chunks) * step;
        const i64 e = row / p.n_new;
        const int t = (int)(row - e * p.n_new);
        const BatchIndex bi = p.batch.split(e);
        const int r = p.seqs.len_k[batch_offset(bi, p.seqs.len_s0, p.seqs.len_s1, p.seqs.len_s2)] + t;
        if (r < 0 || r >= p.seqs.rows_k) continue;
        const elem_t* kn = p.k_new.at(bi) + (i64)t * p.k_new.sn + col;
        const elem_t* vn = p.v_new.at(bi) + (i64)t * p.v_new.sn + col;
        elem_t* kc = p.pages.rows(p.k, p.pages.page_k, bi, 0).row(r) + col;
        elem_t* vc = p.pages.rows(p.v, p.pages.page_v, bi, 0).row(r) + col;
        if (p.vec) {
            *reinterpret_cast<uint4*>(kc) = *reinterpret_cast<const uint4*>(kn);
            *reinterpret_cast<uint4*>(vc) = *reinterpret_cast<const uint4*>(vn);
        } else {
            *kc = *kn;
            *vc = *vn;
        }
    }
}
