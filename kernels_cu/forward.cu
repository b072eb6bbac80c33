// Forward / prefill kernels: embedding lookup, RoPE, SiLU gate, RMSNorm and the
// causal attention softmax. FlashAttention lives in attention_fwd_fma.cu.
//
// Each family is one template over its I/O element type (float, bf16, f16: see
// pk_common.cuh's PK_IO_KERNELS), fp32 math throughout.
// Elementwise kernels move 16 bytes per access (float4, or 8 x bf16/f16 as uint4)
// when every pointer is 16-byte aligned and the row length allows it; the test
// is uniform across the grid, so the fallback costs no divergence. Every loop is
// grid-stride with 64-bit indices: the op may launch fewer blocks than elements.
#include "pk_vec.cuh"

__device__ __forceinline__ bool fwd_aligned16(const void* p) {
    return (((unsigned long long)p) & 15ull) == 0ull;
}

__device__ __forceinline__ long long fwd_global_tid() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long fwd_grid_stride() {
    return (long long)gridDim.x * blockDim.x;
}

// ---------------------------------------------------------------------------
// embedding: out[t, :] = table[ids[t], :]. A pure copy, so both dtypes move raw
// 16-byte chunks when rows are a multiple of 16 bytes. An id outside [0, vocab)
// (the op rejects those before launch) yields a zero row instead of a wild read.
// ---------------------------------------------------------------------------
// One flat loop over rows of `per_row` items of type V (a 16-byte chunk or one
// element). I is the index type: 32-bit when the whole range fits, because a
// 64-bit division costs several times a 32-bit one and this loop divides once
// per item.
template <typename V, typename I>
__device__ __forceinline__ void embedding_loop(const long long* __restrict__ ids, const V* __restrict__ src,
                                               V* __restrict__ dst, I total, I per_row, long long vocab) {
    const I stride = (I)fwd_grid_stride();
    for (I i = (I)fwd_global_tid(); i < total; i += stride) {
        const I t = i / per_row, c = i - t * per_row;
        const long long id = ids[t];
        V v{};
        if (id >= 0 && id < vocab) v = src[id * (long long)per_row + c];
        dst[i] = v;
    }
}

template <typename V>
__device__ __forceinline__ void embedding_dispatch(const long long* __restrict__ ids, const V* __restrict__ src,
                                                   V* __restrict__ dst, long long n_tokens, long long per_row,
                                                   long long vocab) {
    const long long total = n_tokens * per_row;
    if (total < (1ll << 31))  // + grid stride (< 2^31 by the op's block cap) stays below 2^32
        embedding_loop<V, unsigned int>(ids, src, dst, (unsigned int)total, (unsigned int)per_row, vocab);
    else
        embedding_loop<V, long long>(ids, src, dst, total, per_row, vocab);
}

template <typename T>
__device__ __forceinline__ void embedding_impl(const long long* __restrict__ ids, const T* __restrict__ table,
                                               T* __restrict__ out, long long n_tokens, long long vocab,
                                               unsigned int dim) {
    const long long row_bytes = (long long)dim * (long long)sizeof(T);
    if (row_bytes % 16 == 0 && fwd_aligned16(table) && fwd_aligned16(out))
        embedding_dispatch<uint4>(ids, reinterpret_cast<const uint4*>(table), reinterpret_cast<uint4*>(out), n_tokens,
                                  row_bytes / 16, vocab);
    else
        embedding_dispatch<T>(ids, table, out, n_tokens, (long long)dim, vocab);
}

PK_IO_KERNELS(embedding, (256),
              (const long long* __restrict__ ids, const T* __restrict__ table, T* __restrict__ out,
               long long n_tokens, long long vocab, unsigned int dim),
              (ids, table, out, n_tokens, vocab, dim))

// ---------------------------------------------------------------------------
// rope: rotate pairs of x by the angle of the token's position. `n_rows` counts
// (batch, token, head) rows of head_dim elements; row r belongs to token slot
// tok = (r / n_heads) % n_pos. Its position is positions[tok] when has_pos
// (the op passes n_pos = n_tokens for ids shared by every batch row, or
// batch * n_tokens for per-row ids), else pos_offset + tok (n_pos = n_tokens).
// A position outside [0, max_pos) can only come from a device position array
// (the op checks host arrays before launch); its row is written as zeros
// instead of reading outside the tables.
// style 0 ("interleaved") pairs (2i, 2i+1), style 1 ("half", HF LLaMA) pairs
// (i, i + head_dim/2); both rotate by the angle in cos/sin[pos, i] of a compact
// (max_pos, head_dim/2) table (full_table == 0). full_table == 1 reads HF's
// (max_pos, head_dim) tables, whose pair i angle sits in column i for "half"
// (columns i and i + head_dim/2 are equal) and in column 2i for "interleaved"
// (columns 2i and 2i+1 are equal). inverse != 0 rotates by -angle (sin negated):
// the transpose of the rotation, which is rope's backward. x and out may be the
// same buffer (in-place): each thread reads its pairs before writing them.
// ---------------------------------------------------------------------------
__device__ __forceinline__ void fwd_rotate(float a, float b, float c, float s, float& ra, float& rb) {
    ra = a * c - b * s;
    rb = a * s + b * c;
}

__device__ __forceinline__ float4 fwd_neg4(float4 v) {
    v.x = -v.x; v.y = -v.y; v.z = -v.z; v.w = -v.w;
    return v;
}

// The 4 table entries of pairs i..i+3 starting at p (16-byte aligned): contiguous,
// or every other column of 8 (an HF interleaved table repeats each entry twice).
__device__ __forceinline__ float4 fwd_table4(const float* __restrict__ p, bool every_other) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    if (!every_other) return a;
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    float4 r;
    r.x = a.x; r.y = a.z; r.z = b.x; r.w = b.z;
    return r;
}

// I is the index type (32-bit when n_rows * head_dim / 2 fits; see embedding_loop).
template <typename T, typename I>
__device__ __forceinline__ void rope_loop(const T* x, T* out, const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, const long long* __restrict__ positions,
                                          I n_rows, I n_pos, I n_heads, I head_dim, long long pos_offset,
                                          long long max_pos, bool has_pos, bool full, int style, bool inverse,
                                          bool vec) {
    const I tid = (I)fwd_global_tid(), stride = (I)fwd_grid_stride();
    const I half = head_dim / 2;
    const long long tstride = full ? (long long)head_dim : (long long)half;  // table row length
    const bool every_other = full && style == 0;
    const long long tstep = every_other ? 2 : 1;
    if (vec) {  // one thread rotates 4 pairs
        const I gpr = half / 4;  // groups per row
        for (I u = tid; u < n_rows * gpr; u += stride) {
            const I row = u / gpr;
            const I i = (u - row * gpr) * 4;
            const I tok = (row / n_heads) % n_pos;
            const long long pos = has_pos ? positions[tok] : pos_offset + (long long)tok;
            const bool ok = pos >= 0 && pos < max_pos;
            const long long t = (ok ? pos : 0) * tstride + (long long)i * tstep;
            float4 c = fwd_table4(cos_t + t, every_other);
            float4 s = fwd_table4(sin_t + t, every_other);
            if (inverse) s = fwd_neg4(s);
            if (!ok) {  // zeros out: the rotation of anything by (0, 0)
                c.x = c.y = c.z = c.w = 0.0f;
                s = c;
            }
            const long long base = (long long)row * head_dim;
            float4 a, b, ra, rb;
            if (style == 0) {  // 8 contiguous elements: pairs (a.x,a.y) (a.z,a.w) (b.x,b.y) (b.z,b.w)
                a = PkVec4<T>::load(x + base + 2 * i);
                b = PkVec4<T>::load(x + base + 2 * i + 4);
                fwd_rotate(a.x, a.y, c.x, s.x, ra.x, ra.y);
                fwd_rotate(a.z, a.w, c.y, s.y, ra.z, ra.w);
                fwd_rotate(b.x, b.y, c.z, s.z, rb.x, rb.y);
                fwd_rotate(b.z, b.w, c.w, s.w, rb.z, rb.w);
                PkVec4<T>::store(out + base + 2 * i, ra);
                PkVec4<T>::store(out + base + 2 * i + 4, rb);
            } else {  // 4 elements of the first half against the 4 matching ones of the second
                a = PkVec4<T>::load(x + base + i);
                b = PkVec4<T>::load(x + base + half + i);
                fwd_rotate(a.x, b.x, c.x, s.x, ra.x, rb.x);
                fwd_rotate(a.y, b.y, c.y, s.y, ra.y, rb.y);
                fwd_rotate(a.z, b.z, c.z, s.z, ra.z, rb.z);
                fwd_rotate(a.w, b.w, c.w, s.w, ra.w, rb.w);
                PkVec4<T>::store(out + base + i, ra);
                PkVec4<T>::store(out + base + half + i, rb);
            }
        }
    } else {  // one thread rotates one pair
        for (I u = tid; u < n_rows * half; u += stride) {
            const I row = u / half;
            const I i = u - row * half;
            const I tok = (row / n_heads) % n_pos;
            const long long pos = has_pos ? positions[tok] : pos_offset + (long long)tok;
            const bool ok = pos >= 0 && pos < max_pos;
            const long long t = (ok ? pos : 0) * tstride + (long long)i * tstep;
            float c = ok ? cos_t[t] : 0.0f, s = ok ? sin_t[t] : 0.0f;
            if (inverse) s = -s;
            const long long ia = (long long)row * head_dim + (style == 0 ? 2 * (long long)i : (long long)i);
            const long long ib = ia + (style == 0 ? 1 : (long long)half);
            float ra, rb;
            fwd_rotate(PkIO<T>::load(x, ia), PkIO<T>::load(x, ib), c, s, ra, rb);
            PkIO<T>::store(out, ia, ra);
            PkIO<T>::store(out, ib, rb);
        }
    }
}

template <typename T>
__device__ __forceinline__ void rope_impl(const T* x, T* out, const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, const long long* __restrict__ positions,
                                          long long n_rows, unsigned int n_pos, unsigned int n_heads,
                                          unsigned int head_dim, unsigned int pos_offset, unsigned int max_pos,
                                          int has_pos, int full_table, int style, int inverse) {
    const bool vec = (head_dim / 2) % 4 == 0 && fwd_aligned16(x) && fwd_aligned16(out) && fwd_aligned16(cos_t) &&
                     fwd_aligned16(sin_t);
    if (n_rows * (long long)(head_dim / 2) < (1ll << 31))
        rope_loop<T, unsigned int>(x, out, cos_t, sin_t, positions, (unsigned int)n_rows, n_pos, n_heads, head_dim,
                                   pos_offset, max_pos, has_pos != 0, full_table != 0, style, inverse != 0, vec);
    else
        rope_loop<T, long long>(x, out, cos_t, sin_t, positions, n_rows, n_pos, n_heads, head_dim, pos_offset,
                                max_pos, has_pos != 0, full_table != 0, style, inverse != 0, vec);
}

PK_IO_KERNELS(rope, (256),
              (const T* x, T* out, const float* __restrict__ cos_table, const float* __restrict__ sin_table,
               const long long* __restrict__ positions, long long n_rows, unsigned int n_pos, unsigned int n_heads,
               unsigned int head_dim, unsigned int pos_offset, unsigned int max_pos, int has_pos, int full_table,
               int style, int inverse),
              (x, out, cos_table, sin_table, positions, n_rows, n_pos, n_heads, head_dim, pos_offset, max_pos, has_pos, full_table, style, inverse))

// ---------------------------------------------------------------------------
// silu_gate: out = gate * sigmoid(gate) * up. e^-g overflows to inf for
// g < -88, and g / inf is the correct limit (-0), so no clamp is needed.
// Fast math (MUFU.EX2 + __fdividef's MUFU.RCP): __fdividef returns 0 for a
// divisor in (2^126, 2^128), i.e. g in (-88.7, -87.3), where the exact value
// is below 1e-36: inside every tolerance, and the kernel stops being issue-bound.
// ---------------------------------------------------------------------------
__device__ __forceinline__ float fwd_silu_mul(float g, float u) {
    return __fdividef(g, 1.0f + pk_exp_fast(-g)) * u;
}

template <typename T>
__device__ __forceinline__ void silu_gate_impl(const T* __restrict__ gate, const T* __restrict__ up,
                                               T* __restrict__ out, long long n) {
    constexpr int N = PkVec16<T>::N;
    const long long tid = fwd_global_tid(), stride = fwd_grid_stride();
    long long done = 0;
    if (fwd_aligned16(gate) && fwd_aligned16(up) && fwd_aligned16(out)) {
        const long long n_vec = n / N;
        for (long long i = tid; i < n_vec; i += stride) {
            float g[N], u[N];
            PkVec16<T>::load(gate + i * N, g);
            PkVec16<T>::load(up + i * N, u);
#pragma unroll
            for (int e = 0; e < N; ++e) g[e] = fwd_silu_mul(g[e], u[e]);
            PkVec16<T>::store(out + i * N, g);
        }
        done = n_vec * N;
    }
    for (long long i = done + tid; i < n; i += stride)  // scalar tail (or everything when unaligned)
        PkIO<T>::store(out, i, fwd_silu_mul(PkIO<T>::load(gate, i), PkIO<T>::load(up, i)));
}

PK_IO_KERNELS(silu_gate, (256),
              (const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out, long long n),
              (gate, up, out, n))

// ---------------------------------------------------------------------------
// silu_gate_backward: for out = silu(g) * u with s = sigmoid(g),
//   grad_up   = dy * g * s
//   grad_gate = dy * u * s * (1 + g * (1 - s))      (d silu / dg = s + g s (1 - s))
// For g < -88 expf(-g) is inf and s = 0: both gradients are (-)0, their limits.
// ---------------------------------------------------------------------------
__device__ __forceinline__ void fwd_silu_grad(float g, float u, float dy, float& dg, float& du) {
    const float s = __fdividef(1.0f, 1.0f + pk_exp_fast(-g));  // fast math: see fwd_silu_mul
    du = dy * g * s;
    dg = dy * u * s * fmaf(g, 1.0f - s, 1.0f);
}

template <typename T>
__device__ __forceinline__ void silu_gate_backward_impl(const T* __restrict__ gate, const T* __restrict__ up,
                                                        const T* __restrict__ grad_out, T* __restrict__ grad_gate,
                                                        T* __restrict__ grad_up, long long n) {
    constexpr int N = PkVec16<T>::N;
    const long long tid = fwd_global_tid(), stride = fwd_grid_stride();
    long long done = 0;
    if (fwd_aligned16(gate) && fwd_aligned16(up) && fwd_aligned16(grad_out) && fwd_aligned16(grad_gate) &&
        fwd_aligned16(grad_up)) {
        const long long n_vec = n / N;
        for (long long i = tid; i < n_vec; i += stride) {
            float g[N], u[N], dy[N];
            PkVec16<T>::load(gate + i * N, g);
            PkVec16<T>::load(up + i * N, u);
            PkVec16<T>::load(grad_out + i * N, dy);
#pragma unroll
            for (int e = 0; e < N; ++e) fwd_silu_grad(g[e], u[e], dy[e], g[e], u[e]);
            PkVec16<T>::store(grad_gate + i * N, g);
            PkVec16<T>::store(grad_up + i * N, u);
        }
        done = n_vec * N;
    }
    for (long long i = done + tid; i < n; i += stride) {  // scalar tail (or everything when unaligned)
        float dg, du;
        fwd_silu_grad(PkIO<T>::load(gate, i), PkIO<T>::load(up, i), PkIO<T>::load(grad_out, i), dg, du);
        PkIO<T>::store(grad_gate, i, dg);
        PkIO<T>::store(grad_up, i, du);
    }
}

PK_IO_KERNELS(silu_gate_backward, (256),
              (const T* __restrict__ gate, const T* __restrict__ up, const T* __restrict__ grad_out,
               T* __restrict__ grad_gate, T* __restrict__ grad_up, long long n),
              (gate, up, grad_out, grad_gate, grad_up, n))

// ---------------------------------------------------------------------------
// Row kernels (rms_norm, causal_attn_softmax) run in one of two shapes chosen
// by the op: blockDim.x == 32 gives a warp per row (blockDim.y rows per block,
// for short rows); blockDim.x > 32 (a multiple of 32, blockDim.y == 1) gives a
// block per row. Either way a whole warp shares a row, so the full-mask
// shuffles never see a retired lane. Long rows get 1024 threads a block:
// __launch_bounds__(1024) holds these kernels to the 64 registers a thread that
// such a block can have (unbounded, sm_100/sm_120 came within a few of it).
// ---------------------------------------------------------------------------
__device__ __forceinline__ float fwd_row_max(float v, float* scratch) {
    return blockDim.x == 32 ? pk_warp_max(v) : pk_block_max(v, scratch);
}

// rms_norm: out = x * rsqrt(mean(x^2) + eps) * (offset + weight), statistics in fp32
// (offset 0: LLaMA; 1: Gemma's x * (1 + w), the sum taken in fp32 as Gemma does).
// One read of x when the row fits in registers: on the 16-byte path, a row of
// at most 2 vectors per thread (2 x blockDim.x x 16 bytes: 64 KB at 1024
// threads) is kept in registers between the sum of squares and the output.
// Longer rows are read twice; the second read is served by L1/L2 for rows up
// to hundreds of KB, cheaper than a register cache sized for 64K columns.
#define RMS_CACHE_VECS 2
template <typename T>
__device__ __forceinline__ void rms_norm_impl(const T* __restrict__ x, const T* __restrict__ weight,
                                              T* __restrict__ out, long long n_rows, unsigned int dim, float eps,
                                              float offset) {
    __shared__ float scratch[32];
    constexpr int N = PkVec16<T>::N;
    const bool vec = (dim % N == 0) && fwd_aligned16(x) && fwd_aligned16(weight) && fwd_aligned16(out);
    const bool cache = vec && dim / N <= RMS_CACHE_VECS * blockDim.x;
    const long long row_step = (long long)gridDim.x * blockDim.y;
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y; row < n_rows; row += row_step) {
        const T* xr = x + row * dim;
        T* outr = out + row * dim;
        float ss = 0.0f;
        if (cache) {
            // x's and the weight's chunks as raw words, all issued before the first conversion (no branch
            // between: a chunk past the row loads chunk 0 again, unused): the weight's L1/L2 round trip
            // overlaps x's instead of following the row's reduction.
            float f[RMS_CACHE_VECS][N], wt[RMS_CACHE_VECS][N];
            {
                uint4 rx[RMS_CACHE_VECS], rw[RMS_CACHE_VECS];
#pragma unroll
                for (int sl = 0; sl < RMS_CACHE_VECS; ++sl) {
                    const unsigned int c = threadIdx.x + sl * blockDim.x;
                    const long long j = c < dim / N ? (long long)c * N : 0;
                    rx[sl] = pk_ld16_raw(xr, j);
                    rw[sl] = pk_ld16_raw(weight, j);
                }
#pragma unroll
                for (int sl = 0; sl < RMS_CACHE_VECS; ++sl) pk_widen16<T>(rx[sl], f[sl]), pk_widen16<T>(rw[sl], wt[sl]);
            }
#pragma unroll
            for (int sl = 0; sl < RMS_CACHE_VECS; ++sl) {
                if (threadIdx.x + sl * blockDim.x < dim / N) {
#pragma unroll
                    for (int e = 0; e < N; ++e) ss = fmaf(f[sl][e], f[sl][e], ss);
                }
            }
            ss = pk_row_sum(ss, scratch);
            const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma unroll
            for (int sl = 0; sl < RMS_CACHE_VECS; ++sl) {
                const unsigned int c = threadIdx.x + sl * blockDim.x;
                if (c < dim / N) {
#pragma unroll
                    for (int e = 0; e < N; ++e) f[sl][e] = f[sl][e] * inv * (offset + wt[sl][e]);
                    PkVec16<T>::store(outr + (long long)c * N, f[sl]);
                }
            }
            continue;
        }
        if (vec) {
            for (unsigned int c = threadIdx.x; c < dim / N; c += blockDim.x) {
                float f[N];
                PkVec16<T>::load(xr + (long long)c * N, f);
#pragma unroll
                for (int e = 0; e < N; ++e) ss = fmaf(f[e], f[e], ss);
            }
        } else {
            for (unsigned int c = threadIdx.x; c < dim; c += blockDim.x) {
                const float f = PkIO<T>::load(xr, c);
                ss = fmaf(f, f, ss);
            }
        }
        ss = pk_row_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        if (vec) {
            for (unsigned int c = threadIdx.x; c < dim / N; c += blockDim.x) {
                float f[N], w[N];
                PkVec16<T>::load(xr + (long long)c * N, f);
                PkVec16<T>::load(weight + (long long)c * N, w);
#pragma unroll
                for (int e = 0; e < N; ++e) f[e] = f[e] * inv * (offset + w[e]);
                PkVec16<T>::store(outr + (long long)c * N, f);
            }
        } else {
            for (unsigned int c = threadIdx.x; c < dim; c += blockDim.x)
                PkIO<T>::store(outr, c, PkIO<T>::load(xr, c) * inv * (offset + PkIO<T>::load(weight, c)));
        }
    }
}

PK_IO_KERNELS(rms_norm, (1024),
              (const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ out, long long n_rows,
               unsigned int dim, float eps, float offset),
              (x, weight, out, n_rows, dim, eps, offset))

// causal_attn_softmax: scores (n_q, n_heads, kv_len); row (q, h) keeps keys
// j <= past_len + q and writes 0 to the masked tail. One read pass keeps an
// online (max, sum) per thread; the threads' pairs are merged by rescaling each
// sum to the row max, then a second pass writes exp(s - max) / sum.
// Rows of a multiple of 4 floats on a 16-byte aligned base go 4 at a time
// (float4 loads and stores, 4 chunks of a thread's stride in flight); other
// shapes take the scalar loop. exp is MUFU.EX2 (pk_exp_fast).
// Non-finite scores, as torch's attention softmax (SDPA's _safe_softmax of the masked
// scores): a NaN or a +inf among a row's visible scores makes the whole row NaN, masked
// tail included; a -inf score gets probability 0; a row whose visible scores are all -inf
// is 0. NaN travels in the running sum s (a NaN v lands in the else branch and sticks),
// never in the max, so the row max stays fmaxf; +inf turns the sum NaN through
// exp(inf - inf) in the merge. A NaN sum gives inv = NaN and every output NaN.
__device__ __forceinline__ void fwd_online_add(float& m, float& s, float v) {
    if (v > m) {  // rescale the running sum to the new max; m = -inf gives exp(-inf) = 0
        s = s * pk_exp_fast(m - v) + 1.0f;
        m = v;
    } else if (v != PK_NEG_INF) {  // -inf - -inf would be NaN; a NaN v makes s NaN
        s += pk_exp_fast(v - m);
    }
}

extern "C" __global__ void __launch_bounds__(1024) causal_attn_softmax(const float* __restrict__ scores, float* __restrict__ out,
                                               long long n_rows, unsigned int n_heads, unsigned int kv_len,
                                               unsigned int past_len) {
    __shared__ float scratch[32];
    const bool vec = (kv_len % 4u == 0u) && fwd_aligned16(scores) && fwd_aligned16(out);
    const long long row_step = (long long)gridDim.x * blockDim.y;
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y; row < n_rows; row += row_step) {
        const long long q = row / n_heads;
        const long long lim = (long long)past_len + q + 1;
        const unsigned int visible = (unsigned int)(lim < (long long)kv_len ? lim : (long long)kv_len);
        const float* sr = scores + row * kv_len;
        float* outr = out + row * kv_len;
        float m = PK_NEG_INF, s = 0.0f;
        if (vec) {
            const unsigned int n4 = (visible + 3u) / 4u;  // chunks holding a visible key
#pragma unroll 2
            for (unsigned int c = threadIdx.x; c < n4; c += blockDim.x) {
                const float4 v = *reinterpret_cast<const float4*>(sr + 4ull * c);
                const unsigned int j = 4u * c;
                fwd_online_add(m, s, v.x);
                if (j + 1u < visible) fwd_online_add(m, s, v.y);
                if (j + 2u < visible) fwd_online_add(m, s, v.z);
                if (j + 3u < visible) fwd_online_add(m, s, v.w);
            }
        } else {
            for (unsigned int j = threadIdx.x; j < visible; j += blockDim.x) fwd_online_add(m, s, sr[j]);
        }
        const float row_max = fwd_row_max(m, scratch);
        // a row whose visible scores are all -inf has no finite max: its sum is 0 and it writes 0;
        // a thread whose m is still -inf holds s = 0, or NaN from a NaN score: passed on as is
        const float mm = (row_max == PK_NEG_INF) ? 0.0f : row_max;
        const float row_sum = pk_row_sum(m == PK_NEG_INF ? s : s * pk_exp_fast(m - mm), scratch);
        const float inv = row_sum != 0.0f ? 1.0f / row_sum : 0.0f;  // NaN sum: NaN row
        if (vec) {
            const unsigned int n4 = (visible + 3u) / 4u;
            for (unsigned int c = threadIdx.x; c < kv_len / 4u; c += blockDim.x) {
                const unsigned int j = 4u * c;
                // the fully masked tail is written without reading it
                float4 v;
                if (c < n4) v = *reinterpret_cast<const float4*>(sr + j);
                else v.x = v.y = v.z = v.w = PK_NEG_INF;
                const float e[4] = {v.x, v.y, v.z, v.w};
                float o[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    // masked keys go through ex2(-inf) = +0: no branch splits the 16-byte store
                    o[k] = pk_exp_fast(j + (unsigned int)k < visible ? e[k] - mm : PK_NEG_INF) * inv;
                }
                PkVec16<float>::store(outr + 4ll * c, o);
            }
        } else {
            for (unsigned int j = threadIdx.x; j < kv_len; j += blockDim.x)
                outr[j] = pk_exp_fast(j < visible ? sr[j] - mm : PK_NEG_INF) * inv;  // 0, or NaN as the row
        }
    }
}
