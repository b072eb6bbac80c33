// Grouped GEMM tile scheduling on the device (moe.cu's and gemm_fp8.cu's grouped kernels): the grid covers an
// upper bound of the row tiles (sum_e ceil(m_e / bm) <= M / bm + E) on blockIdx.x and each CTA finds its group
// by a warp scan of `offsets` (int32 [E + 1], possibly on the device: the host never reads them); CTAs past the last
// tile get e = -1 and exit. Negative group sizes (offsets that decrease) count as empty.
#pragma once
#include "pk_common.cuh"

// The group of row tile `tile` (tiles of `bm` rows, counted group by group): e (or -1 past the last tile),
// the tile's first row and the group's end row. Called by one whole warp; every lane gets the result.
__device__ __forceinline__ void pk_grouped_find_tile(const int* __restrict__ offsets, int n_groups, int bm, int tile,
                                                     int* e_out, int* m0_out, int* mend_out) {
    const int lane = threadIdx.x & 31;
    int rem = tile;
    *e_out = -1;
    *m0_out = 0;
    *mend_out = 0;
    for (int base = 0; base < n_groups; base += 32) {
        const int e = base + lane;
        int start = 0, end = 0, cnt = 0;
        if (e < n_groups) {
            start = offsets[e];
            end = offsets[e + 1];
            cnt = end > start ? (end - start + bm - 1) / bm : 0;
        }
        int inc = cnt;  // inclusive scan of the tile counts over the lanes
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int v = __shfl_up_sync(PK_FULL_MASK, inc, d);
            if (lane >= d) inc += v;
        }
        const unsigned hit = __ballot_sync(PK_FULL_MASK, inc > rem);
        if (hit) {
            const int L = __ffs((int)hit) - 1;
            const int excl = __shfl_sync(PK_FULL_MASK, inc - cnt, L);
            const int st = __shfl_sync(PK_FULL_MASK, start, L), en = __shfl_sync(PK_FULL_MASK, end, L);
            *e_out = base + L;
            *m0_out = st + (rem - excl) * bm;
            *mend_out = en;
            return;
        }
        rem -= __shfl_sync(PK_FULL_MASK, inc, 31);
    }
}

// Warp 0 finds the CTA's tile and shares it through `info` (3 ints of shared memory); a barrier follows.
__device__ __forceinline__ void pk_grouped_cta_tile(const int* __restrict__ offsets, int n_groups, int bm, int tile,
                                                    int* info) {
    if (threadIdx.x < 32) {
        int e, m0, mend;
        pk_grouped_find_tile(offsets, n_groups, bm, tile, &e, &m0, &mend);
        if (threadIdx.x == 0) info[0] = e, info[1] = m0, info[2] = mend;
    }
    __syncthreads();
}

// The fp32-result grouped GEMMs' epilogue (moe.cu's grouped_gemm_tc(_nn)_f32out, grouped_gemm_sm90.cu's _f32out
// kernels). Stores one m16n8 accumulator fragment (v: rows r0 and r0 + 8, columns c0 + 2t, + 1) as fp32 with 16-byte
// stores: lanes t and t ^ 1 swap a row's pair, so an even lane holds columns c0 + 2t .. + 3 of row r0 and an odd
// one columns c0 + 2(t - 1) .. + 3 of row r0 + 8. The shuffle runs in every lane (before the row check). A 16-byte
// store where quad (N % 4 == 0 and out 16-byte aligned) and the four columns lie below N, element stores
// otherwise; rows from rend on are not stored. wgmma's m64nN fragments have the same layout per 8 columns.
__device__ __forceinline__ void gg_store_f32(float* __restrict__ out, const float (&v)[4], int r0, int c0, int rend,
                                             int N, int t, bool quad) {
    const bool odd = t & 1;
    const float r_0 = __shfl_xor_sync(PK_FULL_MASK, odd ? v[0] : v[2], 1);
    const float r_1 = __shfl_xor_sync(PK_FULL_MASK, odd ? v[1] : v[3], 1);
    const int row = r0 + (odd ? 8 : 0), col = c0 + 2 * (t & 2);
    if (row >= rend) return;
    const float4 q = odd ? make_float4(r_0, r_1, v[2], v[3]) : make_float4(v[0], v[1], r_0, r_1);
    float* p = out + (long long)row * N + col;
    if (quad && col + 3 < N) {
        *reinterpret_cast<float4*>(p) = q;
    } else {
        if (col < N) p[0] = q.x;
        if (col + 1 < N) p[1] = q.y;
        if (col + 2 < N) p[2] = q.z;
        if (col + 3 < N) p[3] = q.w;
    }
}

// The 16-bit epilogue of the mma.sync grouped GEMMs (gemm_fp8.cu, moe.cu): a warp's MT x NT m16n8 accumulator
// tiles (acc[mt][nt][2 h + e]: row r0 + 16 mt + 8 h, column c0 + 8 nt + e, where r0 and c0 already hold the lane's
// g and 2 t) narrowed to T into row-major out (N columns): a 4-byte pair store when N is even and out 4-byte
// aligned, else element stores; rows from rend on and columns from N on are not stored. out holds T's raw words.
template <typename T, int MT, int NT>
__device__ __forceinline__ void gg_store16(unsigned short* __restrict__ out, const float (&acc)[MT][NT][4], int r0,
                                           int c0, int rend, int N) {
    const bool pair = (N & 1) == 0 && (reinterpret_cast<unsigned long long>(out) & 3) == 0;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = r0 + mt * 16 + 8 * h;
            if (m >= rend) continue;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const int n = c0 + nt * 8;
                const float x0 = acc[mt][nt][2 * h], x1 = acc[mt][nt][2 * h + 1];
                if (pair && n + 1 < N) {
                    *reinterpret_cast<unsigned int*>(out + (long long)m * N + n) = Pk16<T>::narrow2(x0, x1);
                } else {
                    if (n < N) out[(long long)m * N + n] = Pk16<T>::narrow(x0);
                    if (n + 1 < N) out[(long long)m * N + n + 1] = Pk16<T>::narrow(x1);
                }
            }
        }
}
