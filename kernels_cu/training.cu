// Training kernels: transpose, softmax / RMSNorm / embedding backward,
// fused cross-entropy forward+backward, and two small helpers the ops need.
// Attention backward lives in attention_bwd_fma.cu.
//
// Every family is one template over its I/O element type (float, __nv_bfloat16,
// __half: see PK_IO_KERNELS in pk_common.cuh) and accumulates in fp32. Offsets are 64-bit. Rows are walked with grid-stride
// loops so the ops may clamp grid sizes without losing rows.
#include "pk_common.cuh"
#include "pk_vec.cuh"
#include "pk_ce.cuh"

// ---------------------------------------------------------------------------
// transpose_2d: out[z][c][r] = in[z][r][c] through a padded 64 x 64 shared tile.
// Block is 256 threads (the op launches (32, 8)); grid x walks 64-column tiles,
// y and z loop so rows/batches may exceed the 65535 grid limit.
// When rows and cols are multiples of V = 16 / sizeof(T) elements and both bases
// are 16-byte aligned, global memory moves in 16-byte vectors on both sides: a
// tile is 64 x (64 / V) vectors, i.e. 4 (f32) or 2 (bf16, f16) independent 16-byte
// loads per thread, all issued before the first shared store. Otherwise the same
// tile moves element by element (coalesced 4- / 2-byte accesses).
// Row pitch P = 64 + 1 (f32) / 64 + 2 (16-bit): an odd number of 32-bit words, so
// a warp gathering a column from consecutive rows spreads over the banks.
#define TR_TILE 64
// A pure copy: 16-bit elements move as their raw words (R = unsigned short), so one
// instantiation of the body serves bf16 and f16.
template <typename T> struct TrElem {
    typedef unsigned short R;
    typedef uint4 V;
    static constexpr int N = 8, P = TR_TILE + 2;
    static __device__ __forceinline__ void unpack(const V& v, R* e) {
        const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) e[2 * i] = (R)(w[i] & 0xffffu), e[2 * i + 1] = (R)(w[i] >> 16);
    }
    static __device__ __forceinline__ V pack(const R* e) {
        V v;
        v.x = (unsigned int)e[0] | ((unsigned int)e[1] << 16);
        v.y = (unsigned int)e[2] | ((unsigned int)e[3] << 16);
        v.z = (unsigned int)e[4] | ((unsigned int)e[5] << 16);
        v.w = (unsigned int)e[6] | ((unsigned int)e[7] << 16);
        return v;
    }
};
template <> struct TrElem<float> {
    typedef float R;
    typedef float4 V;
    static constexpr int N = 4, P = TR_TILE + 1;
    static __device__ __forceinline__ void unpack(const V& v, float* e) { e[0] = v.x; e[1] = v.y; e[2] = v.z; e[3] = v.w; }
    static __device__ __forceinline__ V pack(const float* e) { V v; v.x = e[0]; v.y = e[1]; v.z = e[2]; v.w = e[3]; return v; }
};

template <typename T, int P>
__device__ __forceinline__ void transpose_body(const T* __restrict__ in, T* __restrict__ out,
                                               unsigned int rows, unsigned int cols,
                                               unsigned int batch, T (*tile)[P]) {
    typedef typename TrElem<T>::V V;
    constexpr int N = TrElem<T>::N;            // elements per 16-byte vector
    constexpr int VPR = TR_TILE / N;           // vectors per tile row
    constexpr int PER = TR_TILE * VPR / 256;   // vectors per thread per tile (4 f32, 2 bf16 / f16)
    const long long plane = (long long)rows * cols;
    const unsigned int row_tiles = (rows + TR_TILE - 1u) / TR_TILE;
    const unsigned int c0 = blockIdx.x * TR_TILE;
    const unsigned int t = threadIdx.y * blockDim.x + threadIdx.x;
    const bool vec = rows % N == 0u && cols % N == 0u &&
                     ((((unsigned long long)in) | ((unsigned long long)out)) & 15ull) == 0ull;
    for (unsigned int z = blockIdx.z; z < batch; z += gridDim.z) {
        const T* src = in + (long long)z * plane;
        T* dst = out + (long long)z * plane;
        for (unsigned int rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
            const unsigned int r0 = rt * TR_TILE;
            if (vec) {
                V v[PER];
#pragma unroll
                for (int k = 0; k < PER; ++k) {  // all loads first: PER 16-byte loads in flight
                    const unsigned int i = t + 256u * k, r = r0 + i / VPR, c = c0 + (i % VPR) * N;
                    if (r < rows && c < cols) v[k] = *reinterpret_cast<const V*>(src + (long long)r * cols + c);
                }
#pragma unroll
                for (int k = 0; k < PER; ++k) {
                    const unsigned int i = t + 256u * k;
                    T e[N];
                    TrElem<T>::unpack(v[k], e);
#pragma unroll
                    for (int j = 0; j < N; ++j) tile[i / VPR][(i % VPR) * N + j] = e[j];
                }
                __syncthreads();
#pragma unroll
                for (int k = 0; k < PER; ++k) {  // output row c (a tile column), N consecutive r
                    const unsigned int i = t + 256u * k, cc = i / VPR, rr = (i % VPR) * N;
                    const unsigned int c = c0 + cc, r = r0 + rr;
                    if (r < rows && c < cols) {
                        T e[N];
#pragma unroll
                        for (int j = 0; j < N; ++j) e[j] = tile[rr + j][cc];
                        *reinterpret_cast<V*>(dst + (long long)c * rows + r) = TrElem<T>::pack(e);
                    }
                }
            } else {
                for (unsigned int i = t; i < TR_TILE * TR_TILE; i += 256u) {
                    const unsigned int r = r0 + i / TR_TILE, c = c0 + i % TR_TILE;
                    if (r < rows && c < cols) tile[i / TR_TILE][i % TR_TILE] = src[(long long)r * cols + c];
                }
                __syncthreads();
                for (unsigned int i = t; i < TR_TILE * TR_TILE; i += 256u) {
                    const unsigned int c = c0 + i / TR_TILE, r = r0 + i % TR_TILE;
                    if (r < rows && c < cols) dst[(long long)c * rows + r] = tile[i % TR_TILE][i / TR_TILE];
                }
            }
            // The next tile overwrites `tile`; every thread must be done reading it.
            __syncthreads();
        }
    }
}

template <typename T>
__device__ __forceinline__ void transpose_2d_impl(const T* __restrict__ input, T* __restrict__ output,
                                                  unsigned int rows, unsigned int cols, unsigned int batch) {
    typedef typename TrElem<T>::R R;
    __shared__ R tile[TR_TILE][TrElem<T>::P];
    transpose_body<R, TrElem<T>::P>(reinterpret_cast<const R*>(input), reinterpret_cast<R*>(output), rows, cols,
                                    batch, tile);
}

PK_IO_KERNELS(transpose_2d, (256, 1),
              (const T* __restrict__ input, T* __restrict__ output, unsigned int rows, unsigned int cols,
               unsigned int batch),
              (input, output, rows, cols, batch))

// ---------------------------------------------------------------------------
// softmax_backward: grad_in = p * (g - sum(p * g)) per row. One block per row.
// A row of at most SMB_CACHE_VECS 16-byte vectors per thread (8192 bf16 / 4096 f32 columns at 512 threads) is
// read once: the thread's p and g chunks are loaded as raw words, all 2 x SMB_CACHE_VECS before the first
// conversion (no branch between them: a chunk past the row loads chunk 0 again, unused), and kept in
// registers for the output. The sums run in the order of the streaming path below, so both give the same bits.
#define SMB_CACHE_VECS 2
// The row cache's chunk sl of a row of n elements at base (softmax_backward, rms_norm_backward): a chunk past
// the row reads chunk 0 again (L1-hot, unused) so that its load needs no branch.
template <int N>
__device__ __forceinline__ long long smb_chunk_off(int sl, long long base, long long n) {
    const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
    return base + (i < n ? i : 0);
}
template <typename T>
__device__ __forceinline__ void softmax_backward_impl(const T* __restrict__ probs,
                                                      const T* __restrict__ grad_out,
                                                      T* __restrict__ grad_in, long long n_rows,
                                                      unsigned int row_len) {
    __shared__ float scratch[32];
    // 16-byte vectors (4 f32 / 8 bf16 / f16) on aligned rows of a multiple of that width,
    // two iterations unrolled: 4 independent 16-byte loads in flight per thread.
    constexpr int N = PkVec16<T>::N;
    const bool vec = (row_len % (unsigned int)N == 0u) && pk_aligned16(probs) && pk_aligned16(grad_out) &&
                     pk_aligned16(grad_in);
    const long long n = row_len;
    const bool cache = vec && n <= (long long)N * SMB_CACHE_VECS * blockDim.x;
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const long long base = row * n;
        float dot = 0.0f;
        if (cache) {
            constexpr int S = SMB_CACHE_VECS;
            float p[S][N], g[S][N];
            pk_ld2_widen16<T, S>(probs, grad_out, [&](int sl) { return smb_chunk_off<N>(sl, base, n); }, p, g);
#pragma unroll
            for (int sl = 0; sl < S; ++sl) {
                if ((long long)N * (threadIdx.x + (long long)sl * blockDim.x) < n) {
#pragma unroll
                    for (int k = 0; k < N; ++k) dot = fmaf(p[sl][k], g[sl][k], dot);
                }
            }
            dot = pk_block_sum(dot, scratch);
#pragma unroll
            for (int sl = 0; sl < S; ++sl) {
                const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
                if (i < n) {
#pragma unroll
                    for (int k = 0; k < N; ++k) p[sl][k] = p[sl][k] * (g[sl][k] - dot);
                    PkVec16<T>::store(grad_in, base + i, p[sl]);
                }
            }
            continue;
        }
        if (vec) {
#pragma unroll 2
            for (long long i = (long long)N * threadIdx.x; i < n; i += (long long)N * blockDim.x) {
                float p[N], g[N];
                PkVec16<T>::load(probs, base + i, p);
                PkVec16<T>::load(grad_out, base + i, g);
#pragma unroll
                for (int k = 0; k < N; ++k) dot = fmaf(p[k], g[k], dot);
            }
        } else {
            for (long long i = threadIdx.x; i < n; i += blockDim.x)
                dot += PkIO<T>::load(probs, base + i) * PkIO<T>::load(grad_out, base + i);
        }
        dot = pk_block_sum(dot, scratch);
        if (vec) {  // (not unrolled: LLVM split the unrolled copy's 16-byte store into 4)
            for (long long i = (long long)N * threadIdx.x; i < n; i += (long long)N * blockDim.x) {
                float p[N], g[N];
                PkVec16<T>::load(probs, base + i, p);
                PkVec16<T>::load(grad_out, base + i, g);
#pragma unroll
                for (int k = 0; k < N; ++k) p[k] = p[k] * (g[k] - dot);
                PkVec16<T>::store(grad_in, base + i, p);
            }
        } else {
            for (long long i = threadIdx.x; i < n; i += blockDim.x) {
                const float p = PkIO<T>::load(probs, base + i);
                PkIO<T>::store(grad_in, base + i, p * (PkIO<T>::load(grad_out, base + i) - dot));
            }
        }
    }
}

PK_IO_KERNELS(softmax_backward, (512, 1),
              (const T* __restrict__ probs, const T* __restrict__ grad_out, T* __restrict__ grad_in,
               long long n_rows, unsigned int row_len),
              (probs, grad_out, grad_in, n_rows, row_len))

// ---------------------------------------------------------------------------
// rms_norm_backward, y = x * r * w with r = rsqrt(mean(x^2) + eps) and w = offset + weight
// (offset 1: Gemma's (1 + weight); the weight gradient is sum(x * r * g) either way):
//   grad_x = r * w * g - x * r^3 * sum(x * w * g) / dim
// Blocks walk rows (grid-stride) and write grad_x and r (inv_rms[row]).
// Fused weight gradient (n_part != 0, gridDim.x == n_part, dim <= 16 *
// blockDim.x): each thread owns at most 16 fixed columns and sums x * r * g
// over its block's rows in registers during the output pass, then writes them
// to partial[blockIdx.x][col]; norm_grad_reduce adds the n_part
// rows in ascending order: identical run to run (no float atomics). On the 16-byte
// path the thread's chunks of x and g (16 / N of them, N = PkVec16<T>::N) are loaded
// into registers, all before the first sum, and the output comes from them: one read
// of x and g, 3N bytes in all. The element path re-reads them (L1/L2 hits).
// Unfused (n_part == 0, longer rows): rms_norm_backward_weight re-reads x, g.
#define RMSB_ACC 16

// One 16-byte chunk of a row at column i: x, offset + w and g (the three operands of every rms_norm_backward pass).
template <typename T, int N>
__device__ __forceinline__ void rmsb_load(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ g,
                                          long long base, long long i, float offset, float (&a)[N], float (&b)[N],
                                          float (&c)[N]) {
    PkVec16<T>::load(x, base + i, a);
    PkVec16<T>::load(w, i, b);
    for (int k = 0; k < N; ++k) b[k] += offset;
    PkVec16<T>::load(g, base + i, c);
}

template <typename T>
__device__ __forceinline__ void rms_norm_backward_impl(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ g, T* __restrict__ gx,
    float* __restrict__ inv_rms, float* __restrict__ partial, long long n_rows, unsigned int dim, float eps,
    unsigned int n_part, float offset) {
    __shared__ float scratch[32];
    // 16-byte vectors (4 f32 / 8 bf16 / f16) on aligned rows of a multiple of that width.
    constexpr int N = PkVec16<T>::N;
    const bool vec = (dim % (unsigned int)N == 0u) && pk_aligned16(x) && pk_aligned16(w) && pk_aligned16(g) &&
                     pk_aligned16(gx);
    const bool fuse = n_part != 0u;
    const long long n = dim;
    float acc[RMSB_ACC];  // fused: this thread's column sums over the block's rows
#pragma unroll
    for (int k = 0; k < RMSB_ACC; ++k) acc[k] = 0.0f;
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const long long base = row * n;
        float ss = 0.0f, xwg = 0.0f;
        if (fuse && vec) {  // x and g of this thread's chunks held in registers: one read of each
            constexpr int S = RMSB_ACC / N;
            float a[S][N], c[S][N];
            pk_ld2_widen16<T, S>(x, g, [&](int sl) { return smb_chunk_off<N>(sl, base, n); }, a, c);
#pragma unroll
            for (int sl = 0; sl < S; ++sl) {
                const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
                if (i < n) {
                    float b[N];
                    PkVec16<T>::load(w, i, b);  // the weights: L1-hot after the block's first row
#pragma unroll
                    for (int k = 0; k < N; ++k) {
                        ss = fmaf(a[sl][k], a[sl][k], ss);
                        xwg = fmaf(a[sl][k] * (b[k] + offset), c[sl][k], xwg);
                    }
                }
            }
            float r;
            const float coef = pk_rms_bwd_stats(ss, xwg, (float)dim, eps, scratch, inv_rms, row, r);
#pragma unroll
            for (int sl = 0; sl < S; ++sl) {
                const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
                if (i < n) {
                    float b[N];
                    PkVec16<T>::load(w, i, b);
#pragma unroll
                    for (int k = 0; k < N; ++k) {
                        acc[sl * N + k] = fmaf(a[sl][k] * r, c[sl][k], acc[sl * N + k]);
                        a[sl][k] = r * (b[k] + offset) * c[sl][k] - a[sl][k] * coef;
                    }
                    PkVec16<T>::store(gx, base + i, a[sl]);
                }
            }
            continue;
        }
        if (vec) {
            for (long long i = (long long)N * threadIdx.x; i < n; i += (long long)N * blockDim.x) {
                float a[N], b[N], c[N];
                rmsb_load<T, N>(x, w, g, base, i, offset, a, b, c);
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    ss = fmaf(a[k], a[k], ss);
                    xwg = fmaf(a[k] * b[k], c[k], xwg);
                }
            }
        } else {
            for (long long i = threadIdx.x; i < n; i += blockDim.x) {
                const float a = PkIO<T>::load(x, base + i);
                ss += a * a;
                xwg += a * (offset + PkIO<T>::load(w, i)) * PkIO<T>::load(g, base + i);
            }
        }
        float r;
        const float coef = pk_rms_bwd_stats(ss, xwg, (float)dim, eps, scratch, inv_rms, row, r);
        if (fuse) {  // slot s: column threadIdx.x + s * blockDim.x
#pragma unroll
            for (int sl = 0; sl < RMSB_ACC; ++sl) {
                const long long i = threadIdx.x + (long long)sl * blockDim.x;
                if (i < n) {
                    const float a = PkIO<T>::load(x, base + i), c = PkIO<T>::load(g, base + i);
                    acc[sl] = fmaf(a * r, c, acc[sl]);
                    PkIO<T>::store(gx, base + i, r * (offset + PkIO<T>::load(w, i)) * c - a * coef);
                }
            }
        } else if (vec) {
            for (long long i = (long long)N * threadIdx.x; i < n; i += (long long)N * blockDim.x) {
                float a[N], b[N], c[N];
                rmsb_load<T, N>(x, w, g, base, i, offset, a, b, c);
#pragma unroll
                for (int k = 0; k < N; ++k) a[k] = r * b[k] * c[k] - a[k] * coef;
                PkVec16<T>::store(gx, base + i, a);
            }
        } else {
            for (long long i = threadIdx.x; i < n; i += blockDim.x) {
                const float a = PkIO<T>::load(x, base + i);
                PkIO<T>::store(gx, base + i,
                               r * (offset + PkIO<T>::load(w, i)) * PkIO<T>::load(g, base + i) - a * coef);
            }
        }
    }
    if (fuse) {
        float* p = partial + (long long)blockIdx.x * n;
        if (vec) {
#pragma unroll
            for (int sl = 0; sl < RMSB_ACC / N; ++sl) {
                const long long i = (long long)N * (threadIdx.x + (long long)sl * blockDim.x);
                if (i < n) {
#pragma unroll
                    for (int k = 0; k < N; ++k) p[i + k] = acc[sl * N + k];
                }
            }
        } else {
#pragma unroll
            for (int sl = 0; sl < RMSB_ACC; ++sl) {
                const long long i = threadIdx.x + (long long)sl * blockDim.x;
                if (i < n) p[i] = acc[sl];
            }
        }
    }
}

PK_IO_KERNELS(rms_norm_backward, (512, 1),
              (const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ grad_out,
               T* __restrict__ grad_x, float* __restrict__ inv_rms, float* __restrict__ partial, long long n_rows,
               unsigned int dim, float eps, unsigned int n_part, float offset),
              (x, weight, grad_out, grad_x, inv_rms, partial, n_rows, dim, eps, n_part, offset))

// partial[chunk][c] = sum over rows of chunk of x[r][c] * inv_rms[r] * g[r][c].
// Block (32, 8): 32 adjacent columns (coalesced), 8 row lanes summed in a fixed
// order through shared memory. Grid (ceil(dim/32), n_chunks).
template <typename T>
__device__ __forceinline__ void rms_norm_backward_weight_impl(
    const T* __restrict__ x, const T* __restrict__ g, const float* __restrict__ inv_rms,
    float* __restrict__ partial, long long n_rows, unsigned int dim, long long rows_per_chunk) {
    __shared__ float red[8][33];
    const unsigned int tx = threadIdx.x, ty = threadIdx.y;
    const unsigned int col = blockIdx.x * 32u + tx;
    const long long r0 = (long long)blockIdx.y * rows_per_chunk;
    long long r1 = r0 + rows_per_chunk;
    if (r1 > n_rows) r1 = n_rows;
    float acc = 0.0f;
    if (col < dim) {
        for (long long r = r0 + ty; r < r1; r += blockDim.y) {
            const long long i = r * dim + col;
            acc += PkIO<T>::load(x, i) * inv_rms[r] * PkIO<T>::load(g, i);
        }
    }
    red[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && col < dim) {
        float s = 0.0f;
        for (unsigned int k = 0; k < blockDim.y; ++k) s += red[k][tx];
        partial[(long long)blockIdx.y * dim + col] = s;
    }
}

PK_IO_KERNELS(rms_norm_backward_weight, (256, 1),
              (const T* __restrict__ x, const T* __restrict__ grad_out, const float* __restrict__ inv_rms,
               float* __restrict__ partial, long long n_rows, unsigned int dim, long long rows_per_chunk),
              (x, grad_out, inv_rms, partial, n_rows, dim, rows_per_chunk))

// out[c] = sum_k partial[k][c]: the column sum of every norm's weight (and bias) gradient (rms_norm_backward's here,
// add_rms_norm's and layer_norm's in norm_act_loss.cu). Block (NGR_COLS / 4, NGR_LANES) = (8, 32): threadIdx.x owns
// 4 adjacent columns (one 16-byte load a partial row when dim % 4 == 0 and both bases are aligned, else 4 scalar
// loads), threadIdx.y the chunk lane k = y, y + 32, ... Each lane sums its chunks in ascending k, 4 rows' loads
// issued before their adds (4 x 16 bytes in flight a thread), then thread y = 0 adds the 32 lane sums in lane
// order. The order depends on (n_chunks, dim) only, the same on both paths: identical run to run. Grid x walks
// column tiles of NGR_COLS (grid-stride), so ceil(dim / 32) blocks: 128 at dim 4096, about one an SM of an H100
// (one thread a column, as before, left 16 blocks to pull the partials through a GPU of 132 SMs).
#define NGR_COLS 32
#define NGR_LANES 32
extern "C" __global__ void __launch_bounds__(256, 1) norm_grad_reduce(
    const float* __restrict__ partial, float* __restrict__ out, long long n_chunks, unsigned int dim) {
    __shared__ float4 red[NGR_LANES][NGR_COLS / 4];
    const bool vec = dim % 4u == 0u && pk_aligned16(partial) && pk_aligned16(out);
    const long long n = dim;
    for (long long c0 = (long long)blockIdx.x * NGR_COLS; c0 < n; c0 += (long long)gridDim.x * NGR_COLS) {
        const long long c = c0 + 4ll * threadIdx.x;
        float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (c < n) {
            long long k = threadIdx.y;
            if (vec) {
                for (; k + 3 * NGR_LANES < n_chunks; k += 4 * NGR_LANES) {
                    float4 v[4];
#pragma unroll
                    for (int u = 0; u < 4; ++u) v[u] = *reinterpret_cast<const float4*>(partial + (k + u * NGR_LANES) * n + c);
#pragma unroll
                    for (int u = 0; u < 4; ++u) s.x += v[u].x, s.y += v[u].y, s.z += v[u].z, s.w += v[u].w;
                }
                for (; k < n_chunks; k += NGR_LANES) {
                    const float4 v = *reinterpret_cast<const float4*>(partial + k * n + c);
                    s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
                }
            } else {
                for (; k < n_chunks; k += NGR_LANES) {
                    const float* p = partial + k * n + c;
                    s.x += p[0];
                    if (c + 1 < n) s.y += p[1];
                    if (c + 2 < n) s.z += p[2];
                    if (c + 3 < n) s.w += p[3];
                }
            }
        }
        red[threadIdx.y][threadIdx.x] = s;
        __syncthreads();
        if (threadIdx.y == 0 && c < n) {
            float4 t = red[0][threadIdx.x];
            for (int l = 1; l < NGR_LANES; ++l) {
                const float4 v = red[l][threadIdx.x];
                t.x += v.x, t.y += v.y, t.z += v.z, t.w += v.w;
            }
            if (vec) {
                *reinterpret_cast<float4*>(out + c) = t;
            } else {
                out[c] = t.x;
                if (c + 1 < n) out[c + 1] = t.y;
                if (c + 2 < n) out[c + 2] = t.z;
                if (c + 3 < n) out[c + 3] = t.w;
            }
        }
        __syncthreads();  // red is rewritten by the next column tile
    }
}

// ---------------------------------------------------------------------------
// embedding_backward_bucket: the stable counting sort of token positions by id,
// on the device (no host round trip, so a torch CUDA step never synchronizes,
// and no float atomics). Block b owns the vocab rows [b*R, b*R + R), R =
// PK_EMB_ROWS, and scans all ids twice in position order:
//   pass 1 counts its rows' tokens (integer shared atomics: order-free) and the
//          tokens with a smaller id (where its part of `order` starts); an
//          exclusive scan of its R counts gives offsets[v] for its rows;
//   pass 2 walks tiles of PK_EMB_TILE ids; a token of its range goes to
//          offsets[id] + (tokens of that id in earlier tiles) + (tokens of that
//          id earlier in this tile), so each id's positions are in increasing
//          order: the same `order` as a host stable argsort, every run.
// Why this shape: one launch, stable, deterministic and atomic-free on floats.
// Each block reads the n ids twice: ceil(vocab / R) * 2n 8-byte reads, for
// LLaMA-3 (vocab 128256 -> 63 blocks) and 16K tokens about 16 MB from L2, small
// next to the gather below, which writes the whole vocab x dim fp32 gradient
// (2 GB at dim 4096). A global radix sort would read less but needs several
// launches and a multi-block scan. Ids outside [0, vocab) belong to no block:
// they are skipped (host ids are validated before launch).
#define PK_EMB_ROWS 2048
#define PK_EMB_TILE 256
extern "C" __global__ void __launch_bounds__(256, 1) embedding_backward_bucket(  // 256 = PK_EMB_TILE
    const long long* __restrict__ ids, int* __restrict__ order, int* __restrict__ offsets,
    long long n_tok, unsigned int vocab_size) {
    __shared__ int next[PK_EMB_ROWS];       // per owned row: count, then next free slot
    __shared__ long long tile[PK_EMB_TILE];  // one tile of ids (pass 2)
    __shared__ long long part[PK_EMB_TILE];  // per-thread sums for the scans
    const unsigned int t = threadIdx.x;
    const long long v0 = (long long)blockIdx.x * PK_EMB_ROWS;
    const long long v1 = v0 + PK_EMB_ROWS < (long long)vocab_size ? v0 + PK_EMB_ROWS : (long long)vocab_size;
    const int rows = (int)(v1 - v0);
    for (int r = t; r < PK_EMB_ROWS; r += PK_EMB_TILE) next[r] = 0;
    __syncthreads();
    long long below = 0;  // tokens of this thread with a valid id < v0
    for (long long i = t; i < n_tok; i += PK_EMB_TILE) {
        const long long id = ids[i];
        if (id >= v0 && id < v1) atomicAdd(&next[(int)(id - v0)], 1);
        else if (id >= 0 && id < v0) ++below;
    }
    part[t] = below;
    __syncthreads();
    // Exclusive scan of the row counts: thread t owns R / TILE consecutive rows.
    const int per = PK_EMB_ROWS / PK_EMB_TILE;
    long long own = 0;
    for (int r = t * per; r < t * per + per; ++r) own += next[r];
    __syncthreads();  // everyone read `part` (the below counts) only after this point in thread 0
    if (t == 0) {
        long long base = 0;
        for (int k = 0; k < PK_EMB_TILE; ++k) base += part[k];
        part[0] = base;  // tokens below v0: where this block's part of `order` starts
    }
    __syncthreads();
    const long long start = part[0];
    __syncthreads();  // all read part[0] before it is reused for the row-count prefix
    part[t] = own;
    __syncthreads();
    if (t == 0) {
        long long run = start;
        for (int k = 0; k < PK_EMB_TILE; ++k) {
            const long long c = part[k];
            part[k] = run;
            run += c;
        }
    }
    __syncthreads();
    long long run = part[t];
    for (int r = t * per; r < t * per + per; ++r) {
        const int c = next[r];
        if (r < rows) offsets[v0 + r] = (int)run;
        next[r] = (int)run;
        run += c;
    }
    if (v1 == (long long)vocab_size && t == PK_EMB_TILE - 1) offsets[vocab_size] = (int)run;
    __syncthreads();
    for (long long i0 = 0; i0 < n_tok; i0 += PK_EMB_TILE) {
        const long long i = i0 + t;
        const long long id = i < n_tok ? ids[i] : -1;
        tile[t] = id;
        __syncthreads();
        const bool mine = id >= v0 && id < v1;
        int rank = 0;
        bool last = true;
        if (mine) {
            for (int j = 0; j < PK_EMB_TILE; ++j) {
                if (tile[j] == id) {
                    if (j < (int)t) ++rank;
                    else if (j > (int)t) last = false;
                }
            }
            order[next[(int)(id - v0)] + rank] = (int)i;
        }
        __syncthreads();  // every slot was read before the last of each id advances it
        if (mine && last) next[(int)(id - v0)] += rank + 1;
        __syncthreads();  // before the next tile overwrites `tile` and reads `next`
    }
}

// ---------------------------------------------------------------------------
// embedding_backward without atomics: embedding_backward_bucket sorts token
// positions by id (stable), `offsets[v]..offsets[v+1]` are the positions of id v in
// `order`. One block per vocab row sums its tokens in position order and writes
// the row (zeros for unused ids), so the result is deterministic and the
// output needs no separate zero fill.
// grad_out rows move in 16-byte vectors (4 f32 or 8 bf16 / f16 per LDG.128; their fp32 sums leave in 1 or 2
// STG.128) when dim is a multiple of the vector and both bases are 16-byte aligned; 16-bit rows that are only
// 8-byte aligned take 4-element (8-byte) vectors; anything else elements. Every path adds a column's tokens
// in the same order (position order), so the paths give identical sums.
template <typename T>
__device__ __forceinline__ void embedding_backward_impl(
    const T* __restrict__ grad_out, const int* __restrict__ order, const int* __restrict__ offsets,
    float* __restrict__ grad_weight, unsigned int vocab_size, unsigned int dim) {
    constexpr int N = PkVec16<T>::N;
    const bool vec16 = (dim % (unsigned int)N == 0u) && pk_aligned16(grad_out) && pk_aligned16(grad_weight);
    const bool vec = (dim % 4u == 0u) && pk_vec_aligned(grad_out) && pk_vec_aligned(grad_weight);
    const long long n = dim;
    for (long long v = blockIdx.x; v < vocab_size; v += gridDim.x) {
        const int beg = offsets[v], end = offsets[v + 1];
        float* dst = grad_weight + v * n;
        if (vec16) {
            for (long long d = (long long)N * threadIdx.x; d < n; d += (long long)N * blockDim.x) {
                float acc[N];
#pragma unroll
                for (int j = 0; j < N; ++j) acc[j] = 0.0f;
                for (int k = beg; k < end; ++k) {
                    float a[N];
                    PkVec16<T>::load(grad_out, (long long)order[k] * n + d, a);
#pragma unroll
                    for (int j = 0; j < N; ++j) acc[j] += a[j];
                }
#pragma unroll
                for (int j = 0; j < N; j += 4) PkVec16<float>::store(dst, d + j, acc + j);
            }
        } else if (N == 8 && vec) {  // f32: the same test as vec16
            for (long long d = 4ll * threadIdx.x; d < n; d += 4ll * blockDim.x) {
                float4 acc;
                acc.x = acc.y = acc.z = acc.w = 0.0f;
                for (int k = beg; k < end; ++k) {
                    const float4 a = PkVec4<T>::load(grad_out, (long long)order[k] * n + d);
                    acc.x += a.x;
                    acc.y += a.y;
                    acc.z += a.z;
                    acc.w += a.w;
                }
                PkVec4<float>::store(dst, d, acc);
            }
        } else {
            for (long long d = threadIdx.x; d < n; d += blockDim.x) {
                float acc = 0.0f;
                for (int k = beg; k < end; ++k) acc += PkIO<T>::load(grad_out, (long long)order[k] * n + d);
                dst[d] = acc;
            }
        }
    }
}

PK_IO_KERNELS(embedding_backward, (512, 1),
              (const T* __restrict__ grad_out, const int* __restrict__ order, const int* __restrict__ offsets,
               float* __restrict__ grad_weight, unsigned int vocab_size, unsigned int dim),
              (grad_out, order, offsets, grad_weight, vocab_size, dim))

// ---------------------------------------------------------------------------
// cross_entropy_fwd_bwd: one block per row, two reads of the row (options, formulas and helpers: pk_ce.cuh,
// shared with the sm_90a cluster kernel of cross_entropy_sm90.cu, which reads the row once).
// scale lives in device memory (written by cross_entropy_count), so nothing
// about the targets travels to the host. A target that is neither pad_id nor in
// [0, vocab) is reported in the data: its row's loss and gradient are NaN (so the
// mean loss is NaN), as no error can be raised from the device without a sync.
// class_weight (vocab floats) and grad_rows / z_row (n_rows floats) are read or
// written only under their CE_OPT_ bit (otherwise any valid pointer).
template <typename T>
__device__ __forceinline__ void cross_entropy_fwd_bwd_impl(
    const T* logits, const long long* __restrict__ targets, T* grad, float* __restrict__ row_loss,
    float* __restrict__ z_row, const float* __restrict__ scale_p, const float* __restrict__ class_weight,
    const float* __restrict__ grad_rows, long long n_rows, unsigned int vocab, int pad_id, float smoothing,
    float z_loss, float softcap, int opts) {
    __shared__ float scratch[32];
    // 16-byte accesses (4 floats or 8 bf16 / f16: LDG.128 / STG.128) when every row starts aligned.
    constexpr int V = PkVec16<T>::N;
    const bool vec = (vocab % (unsigned int)V == 0u) && pk_aligned16(logits) && pk_aligned16(grad);
    const bool has_w = (opts & CE_OPT_WEIGHT) != 0;
    const long long n = vocab;
    const float s_ce = scale_p[0], s_z = scale_p[1];
    const float cap = softcap > 0.0f ? softcap : 0.0f;
    const float inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const long long base = row * n;
        const long long target = targets[row];
        if (target != pad_id && (target < 0 || target >= n)) {  // uniform across the block
            const float bad = __int_as_float(0x7fc00000);
            for (long long i = threadIdx.x; i < n; i += blockDim.x) PkIO<T>::store(grad, base + i, bad);
            if (threadIdx.x == 0) {
                row_loss[row] = bad;
                if (opts & CE_OPT_Z_ROW) z_row[row] = bad;
            }
            continue;
        }
        if (target == pad_id) {  // uniform across the block: no barrier is skipped by part of it
            if (vec) {
                float z[V];
#pragma unroll
                for (int k = 0; k < V; ++k) z[k] = 0.0f;
                for (long long i = (long long)V * threadIdx.x; i < n; i += (long long)V * blockDim.x) PkVec16<T>::store(grad, base + i, z);
            } else {
                for (long long i = threadIdx.x; i < n; i += blockDim.x) PkIO<T>::store(grad, base + i, 0.0f);
            }
            if (threadIdx.x == 0) {
                row_loss[row] = 0.0f;
                if (opts & CE_OPT_Z_ROW) z_row[row] = 0.0f;
            }
            continue;
        }
        // z[target] is read before the barriers of the block reductions below, so an
        // in-place gradient sweep can never have overwritten it yet.
        const float zt = threadIdx.x == 0 ? ce_cap(PkIO<T>::load(logits, base + target), cap, inv_cap) : 0.0f;
        float m = PK_NEG_INF, s = 0.0f, sz = 0.0f, sw = 0.0f;
        if (vec) {
            // CE_BATCH 16-byte loads issued before the first is used (raw words, widened afterwards: the online
            // max / sum is a dependent chain, and one load at a time left a thread one 16-byte load in flight);
            // each thread still takes its elements in ascending order, so the sums are those of the plain loop
            auto acc16 = [&](long long i, const uint4& raw) {
                float a[V];
                pk_widen16<T>(raw, a);
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    const float c = has_w ? class_weight[i + k] : 1.0f;
                    sw += c;
                    ce_acc(a[k], c, cap, inv_cap, m, s, sz);
                }
            };
            ce_row16(logits, base, n, acc16);
        } else {
            for (long long i = threadIdx.x; i < n; i += blockDim.x) {
                const float c = has_w ? class_weight[i] : 1.0f;
                sw += c;
                ce_acc(PkIO<T>::load(logits, base + i), c, cap, inv_cap, m, s, sz);
            }
        }
        const float mx = pk_block_max(m, scratch);
        // m = -inf: s is 0, or NaN from a NaN logit (see ce_online); either way pass it on
        const float sum = pk_block_sum(m == PK_NEG_INF ? s : s * pk_exp_fast(m - mx), scratch);
        const float zsum = smoothing != 0.0f ? pk_block_sum(sz, scratch) : 0.0f;  // uniform branch
        const float wsum = (smoothing != 0.0f && has_w) ? pk_block_sum(sw, scratch) : (float)n;
        const PkCeRow r = ce_row_finish(mx, sum, zsum, wsum, zt, target, row, n, threadIdx.x == 0, has_w, class_weight,
                                        grad_rows, row_loss, z_row, s_ce, s_z, smoothing, z_loss, cap, inv_cap, opts);
        if (vec) {
            // the same batches: CE_BATCH loads, then their gradients stored (grad may alias logits: each thread
            // reads its elements before it writes them, so loading ahead of its own stores stays correct)
            auto grad16 = [&](long long i, const uint4& raw) {
                float a[V];
                pk_widen16<T>(raw, a);
#pragma unroll
                for (int k = 0; k < V; ++k) a[k] = ce_grad(a[k], i + k, has_w ? class_weight[i + k] : 1.0f, r);
                PkVec16<T>::store(grad, base + i, a);
            };
            ce_row16(logits, base, n, grad16);
        } else {
            for (long long i = threadIdx.x; i < n; i += blockDim.x) {
                PkIO<T>::store(grad, base + i,
                               ce_grad(PkIO<T>::load(logits, base + i), i, has_w ? class_weight[i] : 1.0f, r));
            }
        }
    }
}

PK_IO_KERNELS(cross_entropy_fwd_bwd, (512, 1),
              (const T* logits, const long long* __restrict__ targets, T* grad, float* __restrict__ row_loss,
               float* __restrict__ z_row, const float* __restrict__ scale, const float* __restrict__ class_weight,
               const float* __restrict__ grad_rows, long long n_rows, unsigned int vocab, int pad_id,
               float label_smoothing, float z_loss, float softcap, int opts),
              (logits, targets, grad, row_loss, z_row, scale, class_weight, grad_rows, n_rows, vocab, pad_id,
               label_smoothing, z_loss, softcap, opts))

// scale[0] = 1 / (sum of class_weight[t] over rows whose target is not pad_id, or their
// count without weights), scale[1] = 1 / (their count), each 0 when it is 0, when `mean`;
// else (1, 1). One block: integer counts (exact, whatever the order) and a fixed-order
// float sum of the weights (thread-strided partials, then the block tree): nothing
// travels to the host and the result is the same every run. The reciprocals are taken
// in double and rounded once. A target outside [0, vocab) adds no weight (its row is NaN).
extern "C" __global__ void __launch_bounds__(512, 1) cross_entropy_count(
    const long long* __restrict__ targets, const float* __restrict__ class_weight, float* __restrict__ scale,
    long long n_rows, unsigned int vocab, int pad_id, int mean, int has_weight) {
    __shared__ unsigned long long total;
    __shared__ float scratch[32];
    if (threadIdx.x == 0) total = 0ull;
    __syncthreads();
    unsigned long long c = 0ull;
    float w = 0.0f;
    for (long long i = threadIdx.x; i < n_rows; i += blockDim.x) {
        const long long t = targets[i];
        if (t != pad_id) {
            c += 1ull;
            if (has_weight && t >= 0 && t < (long long)vocab) w += class_weight[t];
        }
    }
    atomicAdd(&total, c);  // integer: the sum does not depend on the order
    w = has_weight ? pk_block_sum(w, scratch) : 0.0f;  // also the barrier before total is read
    if (!has_weight) __syncthreads();
    if (threadIdx.x == 0) {
        const float inv_n = total ? (float)(1.0 / (double)total) : 0.0f;
        const float inv_w = has_weight ? (w != 0.0f ? (float)(1.0 / (double)w) : 0.0f) : inv_n;
        scale[0] = mean ? inv_w : 1.0f;
        scale[1] = mean ? inv_n : 1.0f;
    }
}

// out[b] = sum(in[b * per_block .. (b + 1) * per_block)) (* scale[0] when
// apply_scale): each block sums its own slice with a fixed thread assignment and
// tree, so the result is the same every run. The op calls it once (one block) for
// few rows, else twice: many blocks to partial sums, then one block over those.
extern "C" __global__ void __launch_bounds__(512, 1) cross_entropy_loss_reduce(
    const float* __restrict__ in, float* __restrict__ out, const float* __restrict__ scale, long long n,
    long long per_block, int apply_scale) {
    __shared__ float scratch[32];
    const long long lo = (long long)blockIdx.x * per_block;
    const long long hi = lo + per_block < n ? lo + per_block : n;
    float s = 0.0f;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) s += in[i];
    s = pk_block_sum(s, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = apply_scale ? s * scale[0] : s;
}

// ---------------------------------------------------------------------------
// Helpers for ops that accumulate in an fp32 scratch buffer (naive attention
// backward): zero it on the device, narrow it to bf16 / f16 afterwards.
extern "C" __global__ void __launch_bounds__(256, 1) training_zero_f32(float* __restrict__ buf, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        buf[i] = 0.0f;
}

// fp32 -> bf16 / f16 (training_f32_to_bf16, training_f32_to_f16).
template <typename T>
__device__ __forceinline__ void training_f32_to_impl(const float* __restrict__ src, T* __restrict__ dst,
                                                     long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        PkIO<T>::store(dst, i, src[i]);
}

PK_IO16_KERNELS(training_f32_to, (256, 1), (const float* __restrict__ src, T* __restrict__ dst, long long n),
                (src, dst, n))
