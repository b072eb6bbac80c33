// The norm / activation / loss family (norm_act_loss) beside training.cu's basic training ops: fused residual-add +
// RMSNorm, LayerNorm, GELU / GeGLU, each forward and backward (the fused linear cross-entropy of its op module
// runs training.cu's cross-entropy kernel).
//
// Every family is one template over its I/O element type (float, __nv_bfloat16, __half: PK_IO_KERNELS in
// pk_common.cuh) and computes in fp32. Offsets are 64-bit; rows and elements are walked with grid-stride
// loops so the ops may clamp grid sizes. Row kernels run one block per row (blockDim.x a multiple of 32,
// <= 512); layer_norm and its backward may also run a warp per row (blockDim.x == 32, blockDim.y rows).
// Rows of a multiple of 16 bytes on 16-byte aligned bases, and elementwise arrays on aligned bases, move
// in 16-byte vectors (4 floats or 8 16-bit elements: LDG.E.128 / STG.E.128), with one loop body for both
// widths (pk_row_chunks / pk_grid_chunks in pk_vec.cuh). Norm weight / bias gradients are
// reduced without float atomics: per-(row chunk, column) partial sums in a fixed order, then a fixed-order
// sum over chunks (training.cu's norm_grad_reduce), so they are identical from run to run.
#include "pk_vec.cuh"

// True when rows of `dim` elements of T on these bases can move in 16-byte vectors.
template <typename T>
__device__ __forceinline__ bool ext_vec_rows(unsigned int dim, const void* a, const void* b = nullptr,
                                             const void* c = nullptr, const void* d = nullptr,
                                             const void* e = nullptr) {
    return dim % (unsigned int)PkVec16<T>::N == 0u && pk_aligned16(a) && pk_aligned16(b) && pk_aligned16(c) &&
           pk_aligned16(d) && pk_aligned16(e);
}

// The fused norm backwards (layer_norm_backward, add_rms_norm_backward with n_part != 0) keep LNB_FUSE_VECS
// 16-byte chunks of a row a thread; lnb_ld / lnb_st move a chunk as one vector (VEC: aligned bases) or element
// by element.
#define LNB_FUSE_VECS 2
// (W elements a move: the whole chunk when VEC, else one)
template <typename T, bool VEC>
__device__ __forceinline__ void lnb_ld(const T* __restrict__ p, long long i, float* f) {
    constexpr int N = PkVec16<T>::N, W = VEC ? N : 1;
#pragma unroll
    for (int k = 0; k < N; k += W) pk_load<T, W>(p, i + k, f + k);
}
template <typename T, bool VEC>
__device__ __forceinline__ void lnb_st(T* __restrict__ p, long long i, const float* f) {
    constexpr int N = PkVec16<T>::N, W = VEC ? N : 1;
#pragma unroll
    for (int k = 0; k < N; k += W) pk_store<T, W>(p, i + k, f + k);
}
// N fp32 partial sums at p + i: 16-byte stores when VEC (pw, pb aligned too), else element stores
template <int N, bool VEC>
__device__ __forceinline__ void lnb_st_f32(float* __restrict__ p, long long i, const float* f) {
#pragma unroll
    for (int k = 0; k < N; k += 4) {
        if constexpr (VEC) pk_store<float, 4>(p, i + k, f + k);
        else for (int j = 0; j < 4; ++j) pk_store<float, 1>(p, i + k + j, f + k + j);
    }
}
// body(sl, i) for each of this thread's LNB_FUSE_VECS chunks c = threadIdx.x + sl blockDim.x that lies in the
// row (c < nch), i = c N its first element (sl a constant once unrolled: the chunk arrays stay in registers).
template <int N, typename F>
__device__ __forceinline__ void lnb_chunks(unsigned int nch, F&& body) {
#pragma unroll
    for (int sl = 0; sl < LNB_FUSE_VECS; ++sl) {
        const unsigned int c = threadIdx.x + sl * blockDim.x;
        if (c < nch) body(sl, (long long)c * N);
    }
}
// A fused backward's row of two tensors (x or h, and grad_y) at base: thread t's LNB_FUSE_VECS chunks of nch
// into a and b. VEC: all 2 S loads are issued before the first conversion, with no branch between them.
template <typename T, bool VEC>
__device__ __forceinline__ void lnb_ld_row2(const T* __restrict__ p, const T* __restrict__ q, long long base,
                                            unsigned int nch, float (&a)[LNB_FUSE_VECS][PkVec16<T>::N],
                                            float (&b)[LNB_FUSE_VECS][PkVec16<T>::N]) {
    constexpr int N = PkVec16<T>::N, S = LNB_FUSE_VECS;
    if constexpr (VEC) {
        uint4 ra[S], rb[S];
#pragma unroll
        for (int sl = 0; sl < S; ++sl) {
            const unsigned int c = threadIdx.x + sl * blockDim.x;
            const long long j = base + (c < nch ? (long long)c * N : 0);  // past the row: chunk 0 (L1), unused
            ra[sl] = pk_ld16_raw(p, j);
            rb[sl] = pk_ld16_raw(q, j);
        }
#pragma unroll
        for (int sl = 0; sl < S; ++sl) pk_widen16<T>(ra[sl], a[sl]), pk_widen16<T>(rb[sl], b[sl]);
    } else {
#pragma unroll
        for (int sl = 0; sl < S; ++sl) {
            const unsigned int c = threadIdx.x + sl * blockDim.x;
            if (c < nch) {
                lnb_ld<T, VEC>(p, base + (long long)c * N, a[sl]);
                lnb_ld<T, VEC>(q, base + (long long)c * N, b[sl]);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// add_rms_norm: h = x + residual (narrowed to T, as the unfused add would store
// it), new_residual = h, y = h * rsqrt(mean(h^2) + eps) * (offset + weight) (offset 1:
// Gemma's (1 + weight), summed in fp32). One block per
// row: pass 1 writes new_residual and sums h^2, pass 2 re-reads new_residual
// (this thread's own writes: L1/L2-hot) and writes y. In place, y may alias x
// and new_residual alias residual (each element is read and written by the
// same thread, reads first, on both paths), so those pointers are not __restrict__.
// A row of at most ARN_CACHE_VECS 16-byte vectors per thread (8192 bf16 / 4096 f32 columns at 512 threads)
// loads x's, residual's and the weight's chunks as raw words, all before the first conversion (no branch
// between: a chunk past the row loads chunk 0 again, unused), and keeps h in registers for pass 2 instead of
// re-reading new_residual; the sums and products are those of the streaming path, in its order: same bits.
#define ARN_CACHE_VECS 2
template <typename T>
__device__ __forceinline__ void add_rms_norm_impl(const T* x, const T* residual, const T* __restrict__ weight,
                                                  T* y, T* new_res, long long n_rows, unsigned int dim, float eps,
                                                  float offset) {
    __shared__ float scratch[32];
    const long long n = dim;
    const bool vec = ext_vec_rows<T>(dim, x, residual, weight, y, new_res);
    constexpr int N = PkVec16<T>::N, S = ARN_CACHE_VECS;
    const bool cache = vec && n <= (long long)N * S * blockDim.x;
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const long long base = row * n;
        float ss = 0.0f;
        if (cache) {
            float h[S][N], wt[S][N];
            {
                uint4 rx[S], rr[S], rw[S];
#pragma unroll
                for (int sl = 0; sl < S; ++sl) {
                    const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
                    const long long j = i < n ? i : 0;
                    rx[sl] = pk_ld16_raw(x, base + j);
                    rr[sl] = pk_ld16_raw(residual, base + j);
                    rw[sl] = pk_ld16_raw(weight, j);
                }
#pragma unroll
                for (int sl = 0; sl < S; ++sl) {
                    float b[N];
                    pk_widen16<T>(rx[sl], h[sl]), pk_widen16<T>(rr[sl], b), pk_widen16<T>(rw[sl], wt[sl]);
#pragma unroll
                    for (int k = 0; k < N; ++k) h[sl][k] += b[k];
                }
            }
#pragma unroll
            for (int sl = 0; sl < S; ++sl) {
                const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
                if (i < n) {
                    pk_store<T, N>(new_res, base + i, h[sl]);
                    pk_load<T, N>(new_res, base + i, h[sl]);  // h as stored (rounded to T)
#pragma unroll
                    for (int k = 0; k < N; ++k) ss += h[sl][k] * h[sl][k];
                }
            }
            const float r = rsqrtf(pk_block_sum(ss, scratch) / (float)n + eps);
#pragma unroll
            for (int sl = 0; sl < S; ++sl) {
                const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
                if (i < n) {
#pragma unroll
                    for (int k = 0; k < N; ++k) h[sl][k] = h[sl][k] * r * (offset + wt[sl][k]);
                    pk_store<T, N>(y, base + i, h[sl]);
                }
            }
            continue;
        }
        pk_row_chunks<T>(vec, n, [&](long long i, auto w) {
            constexpr int W = decltype(w)::value;
            float a[W], b[W];
            pk_load<T, W>(x, base + i, a);
            pk_load<T, W>(residual, base + i, b);
#pragma unroll
            for (int k = 0; k < W; ++k) a[k] += b[k];
            pk_store<T, W>(new_res, base + i, a);
            pk_load<T, W>(new_res, base + i, a);  // h as stored (rounded to T)
#pragma unroll
            for (int k = 0; k < W; ++k) ss += a[k] * a[k];
        });
        const float r = rsqrtf(pk_block_sum(ss, scratch) / (float)n + eps);
        pk_row_chunks<T>(vec, n, [&](long long i, auto w) {
            constexpr int W = decltype(w)::value;
            float h[W], wt[W];
            pk_load<T, W>(new_res, base + i, h);
            pk_load<T, W>(weight, i, wt);
#pragma unroll
            for (int k = 0; k < W; ++k) h[k] = h[k] * r * (offset + wt[k]);
            pk_store<T, W>(y, base + i, h);
        });
    }
}

PK_IO_KERNELS(add_rms_norm, (512, 1),
              (const T* x, const T* residual, const T* __restrict__ weight, T* y, T* new_residual, long long n_rows,
               unsigned int dim, float eps, float offset),
              (x, residual, weight, y, new_residual, n_rows, dim, eps, offset))

// ---------------------------------------------------------------------------
// add_rms_norm_backward: with h = new_residual, r = rsqrt(mean(h^2) + eps), w = offset + weight,
//   grad_h = r * w * gy - h * r^3 * sum(h * w * gy) / dim  (+ grad_new_residual)
// and grad_x = grad_residual = grad_h (one gradient path). rstd[row] = r feeds
// the weight gradient (norm_weight_grad). has_gres = 0: no grad_new_residual
// (gres is then any valid pointer and is not read).
// The fused add_rms_norm_backward (n_part != 0, a block per row, rows blockIdx.x, blockIdx.x + gridDim.x, ...):
// as lnb_fused_rows, thread t keeps h and grad_y of its LNB_FUSE_VECS chunks (N elements at N (t + s
// blockDim.x)) in registers, all loaded before the first sum, sums h * r * grad_y per column over its rows, and
// the block writes one fp32 partial row pw[blockIdx.x] (norm_grad_reduce adds them): h and grad_y are read once.
template <typename T, bool VEC>
__device__ __forceinline__ void arb_fused_rows(const T* __restrict__ h, const T* __restrict__ weight,
                                               const T* __restrict__ gy, const T* __restrict__ gres,
                                               T* __restrict__ gh, float* __restrict__ rstd,
                                               float* __restrict__ pw, long long n_rows, unsigned int dim,
                                               float eps, int has_gres, float offset, float* scratch) {
    constexpr int N = PkVec16<T>::N, S = LNB_FUSE_VECS;
    const unsigned int nch = dim / N;
    const long long n = dim;
    float aw[S][N];
#pragma unroll
    for (int sl = 0; sl < S; ++sl) {
#pragma unroll
        for (int k = 0; k < N; ++k) aw[sl][k] = 0.0f;
    }
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const long long base = row * n;
        float a[S][N], g[S][N];
        lnb_ld_row2<T, VEC>(h, gy, base, nch, a, g);
        float ss = 0.0f, dot = 0.0f;
        lnb_chunks<N>(nch, [&](int sl, long long i) {
            float wt[N];
            lnb_ld<T, VEC>(weight, i, wt);  // L1-hot after the block's first row
#pragma unroll
            for (int k = 0; k < N; ++k) {
                wt[k] += offset;
                ss += a[sl][k] * a[sl][k];
                dot += a[sl][k] * wt[k] * g[sl][k];
            }
        });
        float r;
        const float cf = pk_rms_bwd_stats(ss, dot, (float)n, eps, scratch, rstd, row, r);
        lnb_chunks<N>(nch, [&](int sl, long long i) {
            float wt[N], gr[N];
            lnb_ld<T, VEC>(weight, i, wt);
            if (has_gres) lnb_ld<T, VEC>(gres, base + i, gr);
#pragma unroll
            for (int k = 0; k < N; ++k) {
                wt[k] += offset;
                aw[sl][k] = fmaf(a[sl][k] * r, g[sl][k], aw[sl][k]);
                g[sl][k] = r * wt[k] * g[sl][k] - a[sl][k] * cf;
                if (has_gres) g[sl][k] += gr[k];
            }
            lnb_st<T, VEC>(gh, base + i, g[sl]);
        });
    }
    const long long p = (long long)blockIdx.x * n;
    lnb_chunks<N>(nch, [&](int sl, long long i) { lnb_st_f32<N, VEC>(pw, p + i, aw[sl]); });
}

template <typename T>
__device__ __forceinline__ void add_rms_norm_backward_impl(
    const T* __restrict__ h, const T* __restrict__ weight, const T* __restrict__ gy, const T* __restrict__ gres,
    T* __restrict__ gh, float* __restrict__ rstd, float* __restrict__ pw, long long n_rows, unsigned int dim,
    float eps, int has_gres, float offset, unsigned int n_part) {
    __shared__ float scratch[32];
    const long long n = dim;
    const bool vec = ext_vec_rows<T>(dim, h, weight, gy, gh, has_gres ? gres : h);
    if (n_part != 0u) {  // fused weight gradient (the op checked dim % N == 0, dim <= LNB_FUSE_VECS N blockDim.x)
        if (vec && pk_aligned16(pw))
            arb_fused_rows<T, true>(h, weight, gy, gres, gh, rstd, pw, n_rows, dim, eps, has_gres, offset, scratch);
        else
            arb_fused_rows<T, false>(h, weight, gy, gres, gh, rstd, pw, n_rows, dim, eps, has_gres, offset, scratch);
        return;
    }
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const long long base = row * n;
        float ss = 0.0f, dot = 0.0f;
        pk_row_chunks<T>(vec, n, [&](long long i, auto w) {
            constexpr int W = decltype(w)::value;
            float hv[W], wt[W], g[W];
            pk_load<T, W>(h, base + i, hv);
            pk_load<T, W>(weight, i, wt);
#pragma unroll
            for (int k = 0; k < W; ++k) wt[k] += offset;
            pk_load<T, W>(gy, base + i, g);
#pragma unroll
            for (int k = 0; k < W; ++k) {
                ss += hv[k] * hv[k];
                dot += hv[k] * wt[k] * g[k];
            }
        });
        float r;
        const float c = pk_rms_bwd_stats(ss, dot, (float)n, eps, scratch, rstd, row, r);
        pk_row_chunks<T>(vec, n, [&](long long i, auto w) {
            constexpr int W = decltype(w)::value;
            float hv[W], wt[W], g[W], gr[W];
            pk_load<T, W>(h, base + i, hv);
            pk_load<T, W>(weight, i, wt);
#pragma unroll
            for (int k = 0; k < W; ++k) wt[k] += offset;
            pk_load<T, W>(gy, base + i, g);
            if (has_gres) pk_load<T, W>(gres, base + i, gr);
#pragma unroll
            for (int k = 0; k < W; ++k) {
                g[k] = r * wt[k] * g[k] - hv[k] * c;
                if (has_gres) g[k] += gr[k];
            }
            pk_store<T, W>(gh, base + i, g);
        });
    }
}

PK_IO_KERNELS(add_rms_norm_backward, (512, 1),
              (const T* __restrict__ h, const T* __restrict__ weight, const T* __restrict__ gy,
               const T* __restrict__ gres, T* __restrict__ gh, float* __restrict__ rstd, float* __restrict__ pw,
               long long n_rows, unsigned int dim, float eps, int has_gres, float offset, unsigned int n_part),
              (h, weight, gy, gres, gh, rstd, pw, n_rows, dim, eps, has_gres, offset, n_part))

// ---------------------------------------------------------------------------
// layer_norm: y = (x - mean) * rstd * w + b, rstd = rsqrt(var + eps) with the
// biased variance (torch's). Two-pass statistics (mean, then sum of squared
// deviations) for accuracy on rows with a large mean, taken of d = x - x0 with x0 the
// row's first element: the fp32 sum of a row near 1e4 (and the rounding of its mean)
// would otherwise cost about 1e-3 of each output; x - x0 is exact for values that close,
// and (x - x0) - mean(d) is x - mean to fp32 precision whatever the row's mean.
// has_w / has_b = 0: no
// weight / bias (the pointer is any valid one and is not read).
// Geometry as rms_norm's (pykern/ops/norm_act_loss.py _ln_geometry): blockDim.x == 32 is a warp per row
// (blockDim.y rows a block), otherwise a block per row (blockDim.y == 1); pk_row_sum reduces either way.
// One read of x when the row fits in registers: on the 16-byte path a row of at most LN_CACHE_VECS
// vectors per thread (LN_CACHE_VECS x blockDim.x x 16 bytes: 32 KB at 512 threads) is loaded once
// (all its loads issued before the first sum) and both statistics and the output come from the
// registers. Longer or unaligned rows take the loops over global memory (the re-reads served by
// L1/L2). The backward caches x and g * w the same way.
#define LN_CACHE_VECS 4

// Subtract c from this thread's cached chunks (those below nvec) and return their sum (SQ: of squares).
template <bool SQ, int S, int N>
__device__ __forceinline__ float ln_shift_sum(float (&a)[S][N], unsigned int nvec, float c) {
    float s = 0.0f;
#pragma unroll
    for (int sl = 0; sl < S; ++sl) {
        if (threadIdx.x + sl * blockDim.x < nvec) {
#pragma unroll
            for (int k = 0; k < N; ++k) {
                a[sl][k] -= c;
                s += SQ ? a[sl][k] * a[sl][k] : a[sl][k];
            }
        }
    }
    return s;
}

// The statistics of a register-cached row, for both passes: a[sl] holds x's 16-byte chunk
// threadIdx.x + sl * blockDim.x for the chunks below nvec. a becomes x - mean in place, through the
// shift x0 (the row's first element: the sums of x - x0 keep their accuracy on rows with a large
// mean); returns rstd, and the mean of x - x0 in shifted_mean.
template <int S, int N>
__device__ __forceinline__ float ln_center_cached(float (&a)[S][N], unsigned int nvec, float x0,
                                                  long long n, float eps, float* scratch, float& shifted_mean) {
    const float mean = pk_row_sum(ln_shift_sum<false, S, N>(a, nvec, x0), scratch) / (float)n;
    const float v = ln_shift_sum<true, S, N>(a, nvec, mean);
    shifted_mean = mean;
    return rsqrtf(pk_row_sum(v, scratch) / (float)n + eps);
}

// This thread's sum over the row's chunks of x - x0 (SQ: of ((x - x0) - c)^2), read from global memory.
template <bool SQ, typename T>
__device__ __forceinline__ float ln_streamed_sum(const T* __restrict__ x, long long base, long long n, bool vec,
                                                 float x0, float c) {
    float s = 0.0f;
    pk_row_chunks<T>(vec, n, [&](long long i, auto w) {
        constexpr int W = decltype(w)::value;
        float a[W];
        pk_load<T, W>(x, base + i, a);
#pragma unroll
        for (int k = 0; k < W; ++k) s += SQ ? ((a[k] - x0) - c) * ((a[k] - x0) - c) : a[k] - x0;
    });
    return s;
}

// The same statistics of a row too long for the register cache (or unaligned), read from global memory in two
// passes (the re-read served by L1/L2): returns rstd, and the mean of x - x0 in shifted_mean.
template <typename T>
__device__ __forceinline__ float ln_stats_streamed(const T* __restrict__ x, long long base, long long n, bool vec,
                                                   float x0, float eps, float* scratch, float& shifted_mean) {
    const float mean = pk_row_sum(ln_streamed_sum<false, T>(x, base, n, vec, x0, 0.0f), scratch) / (float)n;
    const float v = ln_streamed_sum<true, T>(x, base, n, vec, x0, mean);
    shifted_mean = mean;
    return rsqrtf(pk_row_sum(v, scratch) / (float)n + eps);
}

template <typename T>
__device__ __forceinline__ void layer_norm_impl(const T* __restrict__ x, const T* __restrict__ wt,
                                                const T* __restrict__ b, T* __restrict__ y, long long n_rows,
                                                unsigned int dim, float eps, int has_w, int has_b) {
    __shared__ float scratch[32];
    constexpr int N = PkVec16<T>::N;
    const long long n = dim;
    const bool vec = ext_vec_rows<T>(dim, x, y, has_w ? wt : x, has_b ? b : x);
    const bool cache = vec && dim / N <= LN_CACHE_VECS * blockDim.x;
    const long long row_step = (long long)gridDim.x * blockDim.y;
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y; row < n_rows; row += row_step) {
        const long long base = row * n;
        float x0;
        pk_load<T, 1>(x, base, &x0);  // the shift (a broadcast load: thread 0's first chunk, L1-hot)
        if (cache) {
            float a[LN_CACHE_VECS][N];
#pragma unroll
            for (int sl = 0; sl < LN_CACHE_VECS; ++sl) {  // every load issued before the sums
                const unsigned int c = threadIdx.x + sl * blockDim.x;
                if (c < dim / N) pk_load<T, N>(x, base + (long long)c * N, a[sl]);
            }
            float mean;  // of d = x - x0
            const float rstd = ln_center_cached(a, dim / N, x0, n, eps, scratch, mean);
#pragma unroll
            for (int sl = 0; sl < LN_CACHE_VECS; ++sl) {
                const unsigned int c = threadIdx.x + sl * blockDim.x;
                if (c < dim / N) {
                    const long long i = (long long)c * N;
                    float ww[N], bb[N];
                    if (has_w) pk_load<T, N>(wt, i, ww);
                    if (has_b) pk_load<T, N>(b, i, bb);
#pragma unroll
                    for (int k = 0; k < N; ++k) {
                        a[sl][k] *= rstd;
                        if (has_w) a[sl][k] *= ww[k];
                        if (has_b) a[sl][k] += bb[k];
                    }
                    pk_store<T, N>(y, base + i, a[sl]);
                }
            }
            continue;
        }
        float mean;  // of d = x - x0
        const float rstd = ln_stats_streamed<T>(x, base, n, vec, x0, eps, scratch, mean);
        pk_row_chunks<T>(vec, n, [&](long long i, auto w) {
            constexpr int W = decltype(w)::value;
            float a[W], ww[W], bb[W];
            pk_load<T, W>(x, base + i, a);
            if (has_w) pk_load<T, W>(wt, i, ww);
            if (has_b) pk_load<T, W>(b, i, bb);
#pragma unroll
            for (int k = 0; k < W; ++k) {
                a[k] = ((a[k] - x0) - mean) * rstd;
                if (has_w) a[k] *= ww[k];
                if (has_b) a[k] += bb[k];
            }
            pk_store<T, W>(y, base + i, a);
        });
    }
}

PK_IO_KERNELS(layer_norm, (512, 1),
              (const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ y,
               long long n_rows, unsigned int dim, float eps, int has_w, int has_b),
              (x, weight, bias, y, n_rows, dim, eps, has_w, has_b))

// layer_norm_backward: the row's mean(g * w) and mean(g * w * xhat) from this thread's sums (an inf or NaN in
// either makes mg NaN: see below), and the row's statistics written for the weight gradient.
__device__ __forceinline__ void lnb_means(float sg, float sgx, long long n, float* scratch, long long row, float x0,
                                          float mean, float rstd, float* __restrict__ mean_out,
                                          float* __restrict__ rstd_out, float& mg, float& mgx) {
    mg = pk_row_sum(sg, scratch) / (float)n;
    mgx = pk_row_sum(sgx, scratch) / (float)n;
    mg += (mg - mg) + (mgx - mgx);
    if (threadIdx.x == 0) {
        mean_out[row] = x0 + mean;
        rstd_out[row] = rstd;
    }
}

// The fused layer_norm_backward (n_part != 0): one read of x and g for grad_x and the weight / bias gradients.
// A block per row (blockDim.y == 1), rows blockIdx.x, blockIdx.x + gridDim.x, ...; thread t owns the S chunks of
// N = PkVec16<T>::N elements starting at N * (t + s * blockDim.x), moved as 16-byte vectors when VEC (aligned
// bases) or element by element otherwise (the op fuses only rows of whole chunks: dim % N == 0, dim <= S N
// blockDim.x). It keeps x and g of its chunks in registers (both issued before the first sum) and sums g * xhat
// and g per column over its rows; at the end the block writes its partial rows pw[blockIdx.x] / pb[blockIdx.x]
// (norm_grad_reduce adds the gridDim.x rows in a fixed order). The weight gradient then costs dim x 4 bytes a
// block instead of a second read of x and g (norm_weight_grad).
template <typename T, bool VEC>
__device__ __forceinline__ void lnb_fused_rows(const T* __restrict__ x, const T* __restrict__ wt,
                                               const T* __restrict__ g, T* __restrict__ gx,
                                               float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                               float* __restrict__ pw, float* __restrict__ pb, long long n_rows,
                                               unsigned int dim, float eps, int has_w, int want_b, float* scratch) {
    constexpr int N = PkVec16<T>::N, S = LNB_FUSE_VECS;
    const unsigned int nch = dim / N;
    const long long n = dim;
    float aw[S][N], ab[S][N];
#pragma unroll
    for (int sl = 0; sl < S; ++sl) {
#pragma unroll
        for (int k = 0; k < N; ++k) aw[sl][k] = 0.0f, ab[sl][k] = 0.0f;
    }
    // g * w for the chunk at i (the weights are L1-hot after the first row: reloaded where needed rather than
    // held, which would cost S x N registers beside the row's and the sums')
    auto gw_at = [&](long long i, const float* gv, float* out) {
        if (has_w) {
            lnb_ld<T, VEC>(wt, i, out);
#pragma unroll
            for (int k = 0; k < N; ++k) out[k] *= gv[k];
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) out[k] = gv[k];
        }
    };
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const long long base = row * n;
        float x0;
        pk_load<T, 1>(x, base, &x0);  // the shift, as layer_norm's
        float a[S][N], gg[S][N];
        lnb_ld_row2<T, VEC>(x, g, base, nch, a, gg);
        float mean;  // of d = x - x0
        const float rstd = ln_center_cached(a, nch, x0, n, eps, scratch, mean);
        float sg = 0.0f, sgx = 0.0f;
        lnb_chunks<N>(nch, [&](int sl, long long i) {
            float gh[N];
            gw_at(i, gg[sl], gh);
#pragma unroll
            for (int k = 0; k < N; ++k) {
                a[sl][k] *= rstd;  // xhat
                sg += gh[k];
                sgx += gh[k] * a[sl][k];
            }
        });
        float mg, mgx;
        lnb_means(sg, sgx, n, scratch, row, x0, mean, rstd, mean_out, rstd_out, mg, mgx);
        lnb_chunks<N>(nch, [&](int sl, long long i) {
            float gh[N];
            gw_at(i, gg[sl], gh);
#pragma unroll
            for (int k = 0; k < N; ++k) {
                aw[sl][k] = fmaf(gg[sl][k], a[sl][k], aw[sl][k]);
                ab[sl][k] += gg[sl][k];
                a[sl][k] = rstd * (gh[k] - mg - a[sl][k] * mgx);
            }
            lnb_st<T, VEC>(gx, base + i, a[sl]);
        });
    }
    const long long p = (long long)blockIdx.x * n;
    lnb_chunks<N>(nch, [&](int sl, long long i) {
        if (has_w) lnb_st_f32<N, VEC>(pw, p + i, aw[sl]);
        if (want_b) lnb_st_f32<N, VEC>(pb, p + i, ab[sl]);
    });
}

// layer_norm_backward row kernel: xhat = (x - mean) * rstd, gxhat = g * w,
//   grad_x = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat)).
// mean[row] and rstd[row] feed the weight / bias gradients (norm_weight_grad).
// Same geometry and register cache as layer_norm (x - mean and g * w are kept).
template <typename T>
__device__ __forceinline__ void layer_norm_backward_impl(
    const T* __restrict__ x, const T* __restrict__ wt, const T* __restrict__ g, T* __restrict__ gx,
    float* __restrict__ mean_out, float* __restrict__ rstd_out, float* __restrict__ pw, float* __restrict__ pb,
    long long n_rows, unsigned int dim, float eps, int has_w, unsigned int n_part, int want_b) {
    __shared__ float scratch[32];
    constexpr int N = PkVec16<T>::N;
    const long long n = dim;
    const bool vec = ext_vec_rows<T>(dim, x, g, gx, has_w ? wt : x);
    if (n_part != 0u) {  // fused weight / bias gradient (the op checked dim % N == 0, dim <= LNB_FUSE_VECS N blockDim.x)
        if (vec && pk_aligned16(has_w ? pw : pb) && pk_aligned16(want_b ? pb : pw))
            lnb_fused_rows<T, true>(x, wt, g, gx, mean_out, rstd_out, pw, pb, n_rows, dim, eps, has_w, want_b, scratch);
        else
            lnb_fused_rows<T, false>(x, wt, g, gx, mean_out, rstd_out, pw, pb, n_rows, dim, eps, has_w, want_b, scratch);
        return;
    }
    const bool cache = vec && dim / N <= LN_CACHE_VECS * blockDim.x;
    const long long row_step = (long long)gridDim.x * blockDim.y;
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y; row < n_rows; row += row_step) {
        const long long base = row * n;
        float x0;
        pk_load<T, 1>(x, base, &x0);  // the shift, as layer_norm's
        // gxhat = g * w (g alone without a weight) for W elements at i
        auto gxhat = [&](long long i, auto w, float* gh) {
            constexpr int W = decltype(w)::value;
            pk_load<T, W>(g, base + i, gh);
            if (has_w) {
                float ww[W];
                pk_load<T, W>(wt, i, ww);
#pragma unroll
                for (int k = 0; k < W; ++k) gh[k] *= ww[k];
            }
        };
        // x and gxhat for W elements at i (the streamed passes)
        auto xg = [&](long long i, auto w, float* a, float* gh) {
            pk_load<T, decltype(w)::value>(x, base + i, a);
            gxhat(i, w, gh);
        };
        // An inf in g * w makes mg and mgx infinite, and then the row's grad_x a data-dependent
        // mix of +-inf and NaN (torch's fused CPU and CUDA kernels give two different mixes).
        // Like torch's autograd of the layer_norm formula, the whole row is NaN instead:
        // (v - v) is 0 for finite v and NaN for +-inf / NaN, two FADDs a row.
        if (cache) {
            float a[LN_CACHE_VECS][N], gh[LN_CACHE_VECS][N];
#pragma unroll
            for (int sl = 0; sl < LN_CACHE_VECS; ++sl) {  // every load issued before the sums
                const unsigned int c = threadIdx.x + sl * blockDim.x;
                if (c < dim / N) {
                    pk_load<T, N>(x, base + (long long)c * N, a[sl]);
                    gxhat((long long)c * N, PkWidth<N>(), gh[sl]);
                }
            }
            float mean;  // of d = x - x0
            const float rstd = ln_center_cached(a, dim / N, x0, n, eps, scratch, mean);
            float sg = 0.0f, sgx = 0.0f;
#pragma unroll
            for (int sl = 0; sl < LN_CACHE_VECS; ++sl) {
                if (threadIdx.x + sl * blockDim.x < dim / N) {
#pragma unroll
                    for (int k = 0; k < N; ++k) {
                        a[sl][k] *= rstd;  // xhat
                        sg += gh[sl][k];
                        sgx += gh[sl][k] * a[sl][k];
                    }
                }
            }
            float mg, mgx;
            lnb_means(sg, sgx, n, scratch, row, x0, mean, rstd, mean_out, rstd_out, mg, mgx);
#pragma unroll
            for (int sl = 0; sl < LN_CACHE_VECS; ++sl) {
                const unsigned int c = threadIdx.x + sl * blockDim.x;
                if (c < dim / N) {
#pragma unroll
                    for (int k = 0; k < N; ++k) a[sl][k] = rstd * (gh[sl][k] - mg - a[sl][k] * mgx);
                    pk_store<T, N>(gx, base + (long long)c * N, a[sl]);
                }
            }
            continue;
        }
        float mean;  // of d = x - x0
        const float rstd = ln_stats_streamed<T>(x, base, n, vec, x0, eps, scratch, mean);
        float sg = 0.0f, sgx = 0.0f;
        pk_row_chunks<T>(vec, n, [&](long long i, auto w) {
            constexpr int W = decltype(w)::value;
            float a[W], gh[W];
            xg(i, w, a, gh);
#pragma unroll
            for (int k = 0; k < W; ++k) {
                sg += gh[k];
                sgx += gh[k] * ((a[k] - x0) - mean) * rstd;
            }
        });
        float mg, mgx;
        lnb_means(sg, sgx, n, scratch, row, x0, mean, rstd, mean_out, rstd_out, mg, mgx);
        pk_row_chunks<T>(vec, n, [&](long long i, auto w) {
            constexpr int W = decltype(w)::value;
            float a[W], gh[W];
            xg(i, w, a, gh);
#pragma unroll
            for (int k = 0; k < W; ++k) a[k] = rstd * (gh[k] - mg - ((a[k] - x0) - mean) * rstd * mgx);
            pk_store<T, W>(gx, base + i, a);
        });
    }
}

PK_IO_KERNELS(layer_norm_backward, (512, 1),
              (const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ grad_out,
               T* __restrict__ grad_x, float* __restrict__ mean, float* __restrict__ rstd, float* __restrict__ pw,
               float* __restrict__ pb, long long n_rows, unsigned int dim, float eps, int has_w,
               unsigned int n_part, int want_bias),
              (x, weight, grad_out, grad_x, mean, rstd, pw, pb, n_rows, dim, eps, has_w, n_part, want_bias))

// ---------------------------------------------------------------------------
// norm_weight_grad: per row chunk k and column c,
//   pw[k][c] = sum over the chunk's rows of (x[r][c] - mean[r]) * rstd[r] * g[r][c]
//   pb[k][c] = sum over the chunk's rows of g[r][c]                  (want_bias)
// mean is subtracted only when has_mean (LayerNorm; RMSNorm passes has_mean = 0).
// Block (32, 8): 32 adjacent columns (coalesced), 8 row lanes summed in a fixed
// order through shared memory. Grid (ceil(dim / 32), n_chunks).
template <typename T>
__device__ __forceinline__ void norm_weight_grad_impl(
    const T* __restrict__ x, const T* __restrict__ g, const float* __restrict__ mean, const float* __restrict__ rstd,
    float* __restrict__ pw, float* __restrict__ pb, long long n_rows, unsigned int dim, long long rows_per_chunk,
    int has_mean, int want_bias) {
    __shared__ float sw[8][33];
    __shared__ float sb[8][33];
    const unsigned int c = blockIdx.x * 32u + threadIdx.x;
    const long long r0 = (long long)blockIdx.y * rows_per_chunk;
    const long long r1 = r0 + rows_per_chunk < n_rows ? r0 + rows_per_chunk : n_rows;
    float aw = 0.0f, ab = 0.0f;
    if (c < dim) {
        for (long long r = r0 + threadIdx.y; r < r1; r += 8) {
            const long long k = r * (long long)dim + c;
            const float gv = PkIO<T>::load(g, k);
            const float xv = PkIO<T>::load(x, k) - (has_mean ? mean[r] : 0.0f);
            aw += xv * rstd[r] * gv;
            ab += gv;
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && c < dim) {
        float tw = 0.0f, tb = 0.0f;
        for (int k = 0; k < 8; ++k) {
            tw += sw[k][threadIdx.x];
            tb += sb[k][threadIdx.x];
        }
        const long long o = (long long)blockIdx.y * dim + c;
        pw[o] = tw;
        if (want_bias) pb[o] = tb;
    }
}

PK_IO_KERNELS(norm_weight_grad, (256, 1),
              (const T* __restrict__ x, const T* __restrict__ grad_out, const float* __restrict__ mean,
               const float* __restrict__ rstd, float* __restrict__ pw, float* __restrict__ pb, long long n_rows,
               unsigned int dim, long long rows_per_chunk, int has_mean, int want_bias),
              (x, grad_out, mean, rstd, pw, pb, n_rows, dim, rows_per_chunk, has_mean, want_bias))

// The sum over chunks is training.cu's norm_grad_reduce (one column sum for every norm).

// ---------------------------------------------------------------------------
// GELU, as torch.nn.functional.gelu:
//   "none" (approx = 0): gelu(x) = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)),
//                        gelu'(x) = Phi(x) + x * exp(-x^2 / 2) / sqrt(2 pi)
//   "tanh" (approx = 1): u = sqrt(2/pi) (x + 0.044715 x^3), t = tanh(u),
//                        gelu(x) = 0.5 x (1 + t),
//                        gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
#define PK_INV_SQRT_2PI 0.39894228040143268f

// The exact ("none") form without erff. libdevice's erff costs ~37 issued instructions an element (two
// polynomials, several MUFU, the selects between them), which made gelu issue-bound (docs/membound.md).
// Here, with a = |x|:
//   e = Phi(-a) = 2^(-a^2 log2(e) / 2 + r(a)),   r(a) = log2(Phi(-a) exp(a^2 / 2)),
//   Phi(x) = x < 0 ? e : 1 - e,
// one MUFU.EX2 (ex2.approx.ftz) for Phi. r is smooth (r(0) = -1, ~ -log2(a sqrt(2 pi)) for large a), so a
// degree-7 polynomial on [0, 6] holds it; |x| is clamped to 6, beyond which e < 1e-9 and falls to 0 with
// the Gaussian factor. The coefficients are a weighted minimax fit (tools/gelu_phi_fit.py) of the error
// in e, weight (e + 1e-3) ln 2: |Phi - Phi_exact| <= 3.0e-7 absolute over the reals (ex2.approx on the GPU
// adds <= 2^-22 relative), and e within 2.3e-4 relative while Phi(-a) >= 1e-8 (where 1 + erff cancels).
// tests/test_norm_act_loss.py::test_gelu_exact_form_error_against_float64 holds both bounds.
// Evaluated as Phi = 1 - e for x >= 0, so the x < 0 tail of gelu keeps its relative accuracy.
#define PK_GELU_A 6.0f
#define PK_GELU_NEG_HALF_LOG2E -0.72134752044448170f

// e = Phi(-|x|); xk = x * PK_GELU_NEG_HALF_LOG2E, which the derivative's exp(-x^2 / 2) shares.
__device__ __forceinline__ float pk_gelu_tail(float x, float xk) {
    const float a = fminf(fabsf(x), PK_GELU_A);
    float r = -3.081901241e-07f;
    r = fmaf(r, a, 3.537595694e-05f);
    r = fmaf(r, a, -7.615997456e-04f);
    r = fmaf(r, a, 7.997907698e-03f);
    r = fmaf(r, a, -5.321645737e-02f);
    r = fmaf(r, a, 2.623964250e-01f);
    r = fmaf(r, a, -1.151138067e+00f);
    r = fmaf(r, a, -9.999993443e-01f);
    return pk_ex2_approx(fmaf(x, xk, r));
}

// Phi(x) of the exact form (x NaN: NaN; +inf: 1; -inf: 0).
__device__ __forceinline__ float pk_gelu_phi(float x, float e) { return x < 0.0f ? e : 1.0f - e; }

// The tanh form's s = 0.5 (1 + tanh u) without tanhf is pk_common.cuh's pk_gelu_tanh_s (the MoE activation
// shares it).

// gelu(x) and gelu'(x) of one element; TANH picks the approximate form at compile time (one loop per form,
// so the vector loop issues one form's instructions only).
template <bool TANH>
__device__ __forceinline__ float pk_gelu(float x) {
    if constexpr (TANH) {
        return x * pk_gelu_tanh_s(x);
    } else {
        return x * pk_gelu_phi(x, pk_gelu_tail(x, x * PK_GELU_NEG_HALF_LOG2E));
    }
}

// gelu'(x) = Phi(x) + x exp(-x^2 / 2) / sqrt(2 pi); *value (when given) gets gelu(x) from the same Phi.
template <bool TANH>
__device__ __forceinline__ float pk_gelu_grad(float x, float* value = nullptr) {
    if constexpr (TANH) {
        return pk_gelu_tanh_grad(x, value);
    } else {
        const float xk = x * PK_GELU_NEG_HALF_LOG2E;
        const float phi = pk_gelu_phi(x, pk_gelu_tail(x, xk));
        if (value) *value = x * phi;
        return fmaf(x * pk_ex2_approx(x * xk), PK_INV_SQRT_2PI, phi);
    }
}

// Elementwise families: 16-byte vectors when every base is aligned, then a scalar tail.
// out[i] = op(a[i], b[i]) for the two-input ones (gelu_backward, gelu_gate).
template <typename T, typename Op>
__device__ __forceinline__ void ext_map2(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                                         long long n, Op op) {
    pk_grid_chunks<T>(pk_aligned16(a) && pk_aligned16(b) && pk_aligned16(out), n, [&](long long i, auto w) {
        constexpr int W = decltype(w)::value;
        float x[W], y[W];
        pk_load<T, W>(a, i, x);
        pk_load<T, W>(b, i, y);
#pragma unroll
        for (int k = 0; k < W; ++k) x[k] = op(x[k], y[k]);
        pk_store<T, W>(out, i, x);
    });
}

// The form (approx) is a launch argument: each impl branches on it once and runs one loop per form.
template <typename T, bool TANH>
__device__ __forceinline__ void gelu_loop(const T* __restrict__ x, T* __restrict__ y, long long n) {
    pk_grid_chunks<T>(pk_aligned16(x) && pk_aligned16(y), n, [&](long long i, auto w) {
        constexpr int W = decltype(w)::value;
        float a[W];
        pk_load<T, W>(x, i, a);
#pragma unroll
        for (int k = 0; k < W; ++k) a[k] = pk_gelu<TANH>(a[k]);
        pk_store<T, W>(y, i, a);
    });
}

template <typename T>
__device__ __forceinline__ void gelu_impl(const T* __restrict__ x, T* __restrict__ y, long long n, int approx) {
    if (approx) gelu_loop<T, true>(x, y, n);
    else gelu_loop<T, false>(x, y, n);
}

PK_IO_KERNELS(gelu, (256, 1), (const T* __restrict__ x, T* __restrict__ y, long long n, int approx),
              (x, y, n, approx))

// grad_x = grad_out * gelu'(x)
template <typename T>
__device__ __forceinline__ void gelu_backward_impl(const T* __restrict__ x, const T* __restrict__ g,
                                                   T* __restrict__ gx, long long n, int approx) {
    if (approx) ext_map2<T>(x, g, gx, n, [](float xv, float gv) { return gv * pk_gelu_grad<true>(xv); });
    else ext_map2<T>(x, g, gx, n, [](float xv, float gv) { return gv * pk_gelu_grad<false>(xv); });
}

PK_IO_KERNELS(gelu_backward, (256, 1),
              (const T* __restrict__ x, const T* __restrict__ grad_out, T* __restrict__ grad_x, long long n,
               int approx),
              (x, grad_out, grad_x, n, approx))

// GeGLU: out = gelu(gate) * up
template <typename T>
__device__ __forceinline__ void gelu_gate_impl(const T* __restrict__ gate, const T* __restrict__ up,
                                               T* __restrict__ out, long long n, int approx) {
    if (approx) ext_map2<T>(gate, up, out, n, [](float gv, float uv) { return pk_gelu<true>(gv) * uv; });
    else ext_map2<T>(gate, up, out, n, [](float gv, float uv) { return pk_gelu<false>(gv) * uv; });
}

PK_IO_KERNELS(gelu_gate, (256, 1),
              (const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out, long long n, int approx),
              (gate, up, out, n, approx))

// grad_gate = grad_out * up * gelu'(gate), grad_up = grad_out * gelu(gate): one Phi for both.
template <typename T, bool TANH>
__device__ __forceinline__ void gelu_gate_backward_loop(const T* __restrict__ gate, const T* __restrict__ up,
                                                        const T* __restrict__ g, T* __restrict__ gg,
                                                        T* __restrict__ gu, long long n) {
    const bool vec = pk_aligned16(gate) && pk_aligned16(up) && pk_aligned16(g) && pk_aligned16(gg) && pk_aligned16(gu);
    pk_grid_chunks<T>(vec, n, [&](long long i, auto w) {
        constexpr int W = decltype(w)::value;
        float a[W], u[W], gv[W];
        pk_load<T, W>(gate, i, a);
        pk_load<T, W>(up, i, u);
        pk_load<T, W>(g, i, gv);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            float value;
            u[k] = gv[k] * u[k] * pk_gelu_grad<TANH>(a[k], &value);
            a[k] = gv[k] * value;
        }
        pk_store<T, W>(gg, i, u);
        pk_store<T, W>(gu, i, a);
    });
}

template <typename T>
__device__ __forceinline__ void gelu_gate_backward_impl(const T* __restrict__ gate, const T* __restrict__ up,
                                                        const T* __restrict__ g, T* __restrict__ gg,
                                                        T* __restrict__ gu, long long n, int approx) {
    if (approx) gelu_gate_backward_loop<T, true>(gate, up, g, gg, gu, n);
    else gelu_gate_backward_loop<T, false>(gate, up, g, gg, gu, n);
}

PK_IO_KERNELS(gelu_gate_backward, (256, 1),
              (const T* __restrict__ gate, const T* __restrict__ up, const T* __restrict__ grad_out,
               T* __restrict__ grad_gate, T* __restrict__ grad_up, long long n, int approx),
              (gate, up, grad_out, grad_gate, grad_up, n, approx))
