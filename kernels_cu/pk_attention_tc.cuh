// Shared pieces of the tensor-core attention kernels (flash_attention_tc.cu, attention_backward_tc.cu):
// CTAs of 4 warps, bf16 tiles in shared memory with rows padded to D + 8 halves (16 bytes) so the 8
// row addresses of one ldmatrix phase fall in distinct banks.
#pragma once
#include "pk_common.cuh"
#include "pk_ptx.cuh"
#include "pk_attn_window.cuh"

#define FATC_THREADS 128

// Rows [r0, r0 + ROWS) of a strided bf16 matrix into s[ROWS][D + 8]: 16-byte cp.async
// chunks when `vec`, else element by element; zeros past `dim` and past n_rows.
template <int D, int ROWS>
__device__ __forceinline__ void fatc_load_tile(unsigned short* s, const unsigned short* __restrict__ g,
                                               long long base, long long row_stride, int r0, int n_rows, int dim,
                                               bool vec) {
    constexpr int CH = D / 8;  // 16-byte chunks per row
    for (int c = threadIdx.x; c < ROWS * CH; c += FATC_THREADS) {
        const int r = c / CH, d = (c % CH) * 8;
        unsigned short* dst = s + r * (D + 8) + d;
        const int row = r0 + r;
        const long long off = base + (long long)row * row_stride + d;
        if (vec && row < n_rows && d < dim) {  // vec implies dim % 8 == 0: the chunk is whole
            pk_cp_async_16(dst, g + off);
        } else {
            unsigned int w[4] = {0u, 0u, 0u, 0u};  // fully unrolled: constant indices keep w in registers
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (row < n_rows && d + e < dim) w[e >> 1] |= (unsigned int)g[off + e] << (16 * (e & 1));
            *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

