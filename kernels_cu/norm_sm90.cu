// pykern: arch sm_90a
// Hopper rms_norm_backward for rows wider than one CTA holds (docs/membound.md): a thread-block cluster of 2..8
// CTAs splits each row, every CTA keeps its slice of x and grad_y in registers, and the row's two sums (x^2 and
// x * w * grad_y) are combined across the cluster through distributed shared memory, as cross_entropy_sm90.cu's
// cluster cross-entropy combines its max and sum of exp. The one-CTA kernel (training.cu's rms_norm_backward)
// holds RMSB_ACC = 16 columns a thread, 8192 at 512 threads; past that it re-reads x and grad_y for the weight
// gradient (rms_norm_backward_weight). Here the row is read once at any width up to 8 x 8192 columns, and the weight
// gradient is summed in registers as in the fused one-CTA kernel: 3N bytes. The op (pykern/ops/training.py,
// rms_backward_cluster_plan) chooses the cluster and keeps the one-CTA kernels for other archs.
#include "pk_common.cuh"
#include "pk_vec.cuh"
#include "pk_ptx.cuh"

#define RMSC_ACC 16  // columns a thread holds (training.cu's RMSB_ACC)

// 16 bytes of out (16-byte aligned) from N floats: f32 through the PTX store, since NVVM split the float4 store of
// this loop into two STG.E.64 (as it did cross_entropy_sm90.cu's); the 16-bit types' uint4 store stays whole.
template <typename T>
__device__ __forceinline__ void rmsc_store16(T* p, const float* f) {
    if constexpr (PkVec16<T>::N == 4) {
        pk_st_global_b128(p, make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                                        __float_as_uint(f[3])));
    } else {
        PkVec16<T>::store(p, f);
    }
}

// rms_norm_backward_cluster: y = x * r * w, r = rsqrt(mean(x^2) + eps), w = offset + weight;
//   grad_x = r * w * g - x * r^3 * sum(x * w * g) / dim,   grad_weight = sum over rows of x * r * g.
// A cluster of nc CTAs (blockIdx.x / nc is the cluster, gridDim.x / nc clusters walk the rows cluster-strided);
// CTA `rank` owns columns [rank * slice, rank * slice + slice) of every row, at most RMSC_ACC * blockDim.x of
// them. On the 16-byte path the thread's chunks of x and g are loaded (all before the first sum) and kept in
// registers for the output; the element path re-reads them (L1/L2 hits). Each CTA block-reduces its slice's two
// sums into its shared memory; after barrier.cluster lane q < nc of warp 0 reads CTA q's pair through DSMEM and a
// fixed shuffle tree adds them, so every CTA derives the same r and coefficient bit for bit. The pairs are
// double-buffered by row parity: a CTA rewrites a buffer only after the next row's barrier.cluster, which every
// peer reaches after its reads of it. grad_weight: each thread sums x * r * g of its columns over the cluster's
// rows in registers, and partial[cluster][col] gets them; norm_grad_reduce adds the partial rows in order
// (deterministic, no float atomics). inv_rms[row] = r (rank 0 writes it).
template <typename T>
__device__ __forceinline__ void rms_norm_backward_cluster_impl(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ g, T* __restrict__ gx,
    float* __restrict__ inv_rms, float* __restrict__ partial, long long n_rows, unsigned int dim, unsigned int slice,
    float eps, float offset) {
    __shared__ float scratch[32];
    __shared__ float part[2][2];  // this CTA's (sum x^2, sum x * w * g) over its slice of a row, by row parity
    __shared__ float tot[2];      // the row's, combined over the cluster
    constexpr int N = PkVec16<T>::N;
    constexpr int S = RMSC_ACC / N;
    const bool vec = (dim % (unsigned int)N == 0u) && (slice % (unsigned int)N == 0u) && pk_aligned16(x) &&
                     pk_aligned16(w) && pk_aligned16(g) && pk_aligned16(gx);
    const unsigned int rank = pk_cluster_ctarank(), nc = pk_cluster_nctarank();
    const long long n = dim;
    const long long lo = (long long)rank * slice < n ? (long long)rank * slice : n;
    const long long len = (lo + (long long)slice < n ? lo + (long long)slice : n) - lo;
    const long long n_clusters = gridDim.x / nc, cluster = blockIdx.x / nc;
    float acc[RMSC_ACC];  // this thread's column sums of x * r * g over the cluster's rows
#pragma unroll
    for (int k = 0; k < RMSC_ACC; ++k) acc[k] = 0.0f;
    unsigned int parity = 0;
    for (long long row = cluster; row < n_rows; row += n_clusters) {
        const long long base = row * n + lo;  // this CTA's slice of the row
        float ss = 0.0f, xwg = 0.0f;
        float a[S][N], c[S][N];
        if (vec) {
            // a chunk past the slice loads the slice's chunk 0 again (unused), so the loads need no branch
            pk_ld2_widen16<T, S>(x, g, [&](int sl) {
                const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
                return base + (i < len ? i : 0);
            }, a, c);
#pragma unroll
            for (int sl = 0; sl < S; ++sl) {
                const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
                if (i < len) {
                    float b[N];
                    PkVec16<T>::load(w, lo + i, b);  // the weights: L1-hot after the CTA's first row
#pragma unroll
                    for (int k = 0; k < N; ++k) {
                        ss = fmaf(a[sl][k], a[sl][k], ss);
                        xwg = fmaf(a[sl][k] * (b[k] + offset), c[sl][k], xwg);
                    }
                }
            }
        } else {
#pragma unroll
            for (int sl = 0; sl < RMSC_ACC; ++sl) {
                const long long i = threadIdx.x + (long long)sl * blockDim.x;
                if (i < len) {
                    const float xa = PkIO<T>::load(x, base + i);
                    ss = fmaf(xa, xa, ss);
                    xwg = fmaf(xa * (offset + PkIO<T>::load(w, lo + i)), PkIO<T>::load(g, base + i), xwg);
                }
            }
        }
        ss = pk_block_sum(ss, scratch);
        xwg = pk_block_sum(xwg, scratch);
        if (threadIdx.x == 0) {
            part[parity][0] = ss;
            part[parity][1] = xwg;
        }
        pk_cluster_sync();  // every CTA's pair written (release / acquire across the cluster)
        if (threadIdx.x < 32) {
            const unsigned int lane = threadIdx.x;
            float ps = 0.0f, pd = 0.0f;
            if (lane < nc) {
                const float2 v = pk_ld_shared_cluster_f32x2(pk_mapa_shared(&part[parity][0], lane));
                ps = v.x;
                pd = v.y;
            }
            ps = pk_warp_sum(ps);  // the same tree in every CTA: the same bits
            pd = pk_warp_sum(pd);
            if (lane == 0) {
                tot[0] = ps;
                tot[1] = pd;
            }
        }
        __syncthreads();
        const float r = rsqrtf(tot[0] / (float)dim + eps);
        const float coef = r * r * r * tot[1] / (float)dim;
        if (rank == 0u && threadIdx.x == 0) inv_rms[row] = r;
        if (vec) {
#pragma unroll
            for (int sl = 0; sl < S; ++sl) {
                const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
                if (i < len) {
                    float b[N];
                    PkVec16<T>::load(w, lo + i, b);
#pragma unroll
                    for (int k = 0; k < N; ++k) {
                        acc[sl * N + k] = fmaf(a[sl][k] * r, c[sl][k], acc[sl * N + k]);
                        a[sl][k] = r * (b[k] + offset) * c[sl][k] - a[sl][k] * coef;
                    }
                    rmsc_store16<T>(gx + base + i, a[sl]);
                }
            }
        } else {
#pragma unroll
            for (int sl = 0; sl < RMSC_ACC; ++sl) {
                const long long i = threadIdx.x + (long long)sl * blockDim.x;
                if (i < len) {
                    const float xa = PkIO<T>::load(x, base + i), ca = PkIO<T>::load(g, base + i);
                    acc[sl] = fmaf(xa * r, ca, acc[sl]);
                    PkIO<T>::store(gx, base + i, r * (offset + PkIO<T>::load(w, lo + i)) * ca - xa * coef);
                }
            }
        }
        parity ^= 1u;
    }
    pk_cluster_sync();  // no CTA leaves while a peer may still read its pairs
    float* p = partial + cluster * n + lo;
    if (vec) {  // N floats a chunk: 4 (f32) or 8 (bf16 / f16), 16-byte stores where partial is aligned
        const bool p16 = pk_aligned16(partial);
#pragma unroll
        for (int sl = 0; sl < S; ++sl) {
            const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
            if (i < len) {
#pragma unroll
                for (int k = 0; k < N; k += 4) {
                    if (p16) {
                        rmsc_store16<float>(p + i + k, &acc[sl * N + k]);
                    } else {
#pragma unroll
                        for (int e = 0; e < 4; ++e) p[i + k + e] = acc[sl * N + k + e];
                    }
                }
            }
        }
    } else {
#pragma unroll
        for (int sl = 0; sl < RMSC_ACC; ++sl) {
            const long long i = threadIdx.x + (long long)sl * blockDim.x;
            if (i < len) p[i] = acc[sl];
        }
    }
}

PK_IO_KERNELS(rms_norm_backward_cluster, (512, 1),
              (const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ grad_out,
               T* __restrict__ grad_x, float* __restrict__ inv_rms, float* __restrict__ partial, long long n_rows,
               unsigned int dim, unsigned int slice, float eps, float offset),
              (x, weight, grad_out, grad_x, inv_rms, partial, n_rows, dim, slice, eps, offset))
