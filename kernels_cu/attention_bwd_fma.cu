// Softmax attention backward: P = softmax(scale * Q K^T) per
// (batch, head), optionally causal.
//
// Layouts (row-major, contiguous): q, out, grad_out, dq: [batch][n_q][n_heads][head_dim];
// k, v, dk, dv: [batch][n_k][n_kv_heads][head_dim]; lse, delta: [batch][n_q][n_heads]
// float32. Query head h reads kv head h / (n_heads / n_kv_heads) (GQA).
// lse is the natural-log logsumexp of the scaled scores; delta = rowsum(dO * O).
// The mask is flash_attention's window, aligned bottom-right: query i sees keys
// i + s - window_left <= j <= i + s + window_right, s = n_k - n_q, with the sides
// normalized by the op (causal is window_right = 0; pk_attn_window.cuh). A query
// that sees no key has P = 0: its dq row is 0 and it adds nothing to dk/dv (its
// lse is -inf and is never read). Every loop runs over the window only.
// Softcap c > 0 (naive: a runtime value; flash: the _softcap entry points): scores
// y = c * tanh(scale * q.k / c), and dS is multiplied by dy/dx = 1 - tanh^2.
//
// Two paths:
//  * naive: one block per (query, head) keeps the whole score row in shared
//    memory (seq <= the op's limit) and scatters dk/dv with fp32 atomics.
//  * flash: tiled over keys with no sequence limit and no atomics. A pre-pass
//    gives lse and delta (attention_bwd_preprocess from `out`, or
//    attention_bwd_lse by a sweep over the keys), then attention_bwd_fma_dkdv
//    (one block per key tile and kv head, looping over its queries and heads)
//    and attention_bwd_fma_dq (one block per query tile and head).
//  * varlen (attention_bwd_varlen_fma_dkdv / _dq, float32 only: flash_attention_varlen_backward's fp32 path;
//    16-bit runs the tensor-core kernels): the flash kernels with a per-sequence prologue (template parameter
//    VL). Packed rows, flash-attn's layout: q, dO, dq (total_q, n_heads, head_dim), k, v, dk, dv (total_k,
//    n_kv_heads, head_dim), lse, delta (total_q, n_heads); sequence b is rows cu_seqlens_q[b] ..
//    cu_seqlens_q[b + 1] against cu_seqlens_k[b] .. cu_seqlens_k[b + 1], read on the device. A 1-D grid of
//    batch * heads * tiles of the longest sequence (max_seqlen_q / _k) as the tensor-core varlen kernels; a CTA
//    past its sequence's end exits before any barrier; everything after the prologue is the dense code, so
//    each output element of a sequence still has one writer.
//
// In the flash kernels a group of G lanes (G = group_lanes, a power of two
// <= 32) owns one key (or query) row; lane g holds dims g, g+G, ... in
// registers (at most PK_ATT_MAXE of them, so head_dim <= 16 * G) and dot
// products are finished with G-wide xor shuffles.
// Every kernel is one body over the I/O element type T (float, __nv_bfloat16, __half: PK_IO_KERNELS in
// pk_common.cuh); lse, delta and the naive path's dk/dv accumulators are fp32 in every dtype.
#include "pk_common.cuh"
#include "pk_attn_window.cuh"

#define PK_ATT_MAXE 16
#define PK_ATT_STAGE 16  // rows of q/dO (dkdv) or k/v (dq, lse) staged in shared memory per step

__device__ __forceinline__ float pk_group_sum(float v, unsigned int group) {
    for (unsigned int off = group >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(PK_FULL_MASK, v, off);
    return v;
}

// ---------------------------------------------------------------------------
// Naive path. Dynamic shared memory: q_s[D], do_s[D], p[n_k], ds[n_k] floats, and with a
// softcap th[n_k] (the tanh of each score). dk_acc / dv_acc are fp32 and must be zero on entry.
template <typename T>
__device__ __forceinline__ void attention_bwd_fma_naive_impl(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
    T* __restrict__ dq, float* __restrict__ dk_acc, float* __restrict__ dv_acc, unsigned int n_q,
    unsigned int n_k, unsigned int n_heads, unsigned int n_kv_heads, unsigned int head_dim, float scale,
    int window_left, int window_right, float softcap) {
    extern __shared__ float smem[];
    __shared__ float scratch[32];
    const unsigned int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const unsigned int kvh = h / (n_heads / n_kv_heads);
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned int n_warps = blockDim.x >> 5;
    const long long D = head_dim;
    float* q_s = smem;
    float* do_s = smem + D;
    float* p = smem + 2 * D;
    float* ds = p + n_k;
    float* th = ds + n_k;  // softcap > 0 only
    const long long q_row = (((long long)b * n_q + i) * n_heads + h) * D;
    int lo_, hi_;
    pk_attn_q_row((int)i, (int)n_q, (int)n_k, window_left, window_right, lo_, hi_);
    const unsigned int j_lo = (unsigned int)lo_;  // keys [j_lo, j_end)
    const unsigned int j_end = hi_ < lo_ ? j_lo : (unsigned int)hi_ + 1u;
    if (j_end == j_lo) {  // no visible key: P = 0, so dq = 0 and no dk/dv term (uniform per block, before any barrier)
        for (long long d = threadIdx.x; d < D; d += blockDim.x) PkIO<T>::store(dq, q_row + d, 0.0f);
        return;
    }
    for (long long d = threadIdx.x; d < D; d += blockDim.x) {
        q_s[d] = PkIO<T>::load(q, q_row + d);
        do_s[d] = PkIO<T>::load(dout, q_row + d);
    }
    __syncthreads();
    // Scores and dP = dO . v_j, one warp per key.
    for (unsigned int j = j_lo + warp; j < j_end; j += n_warps) {
        const long long kv_row = (((long long)b * n_k + j) * n_kv_heads + kvh) * D;
        float s = 0.0f, t = 0.0f;
        for (long long d = lane; d < D; d += 32) {
            s += q_s[d] * PkIO<T>::load(k, kv_row + d);
            t += do_s[d] * PkIO<T>::load(v, kv_row + d);
        }
        s = pk_warp_sum(s);
        t = pk_warp_sum(t);
        if (lane == 0) {
            s *= scale;
            if (softcap > 0.0f) {
                const float x = tanhf(s / softcap);
                th[j] = x;
                s = softcap * x;
            }
            p[j] = s;
            ds[j] = t;
        }
    }
    __syncthreads();
    float m = PK_NEG_INF;
    for (unsigned int j = j_lo + threadIdx.x; j < j_end; j += blockDim.x) m = fmaxf(m, p[j]);
    m = pk_block_max(m, scratch);
    float l = 0.0f;
    for (unsigned int j = j_lo + threadIdx.x; j < j_end; j += blockDim.x) {
        const float e = expf(p[j] - m);
        p[j] = e;
        l += e;
    }
    l = pk_block_sum(l, scratch);
    const float inv_l = 1.0f / l;
    float delta = 0.0f;
    for (unsigned int j = j_lo + threadIdx.x; j < j_end; j += blockDim.x) {
        const float pj = p[j] * inv_l;
        p[j] = pj;
        delta += pj * ds[j];
    }
    delta = pk_block_sum(delta, scratch);
    for (unsigned int j = j_lo + threadIdx.x; j < j_end; j += blockDim.x)
        ds[j] = p[j] * (ds[j] - delta) * (softcap > 0.0f ? 1.0f - th[j] * th[j] : 1.0f);
    __syncthreads();
    // dq[d] = scale * sum_j ds_j k_j[d]: threads over d, so each k row is read coalesced.
    for (long long d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (unsigned int j = j_lo; j < j_end; ++j)
            acc += ds[j] * PkIO<T>::load(k, (((long long)b * n_k + j) * n_kv_heads + kvh) * D + d);
        PkIO<T>::store(dq, q_row + d, acc * scale);
    }
    // dk_j += scale * ds_j q, dv_j += p_j dO: other (query, head) blocks add to the same rows.
    for (unsigned int j = j_lo + warp; j < j_end; j += n_warps) {
        const long long kv_row = (((long long)b * n_k + j) * n_kv_heads + kvh) * D;
        const float dsj = ds[j] * scale, pj = p[j];
        for (long long d = lane; d < D; d += 32) {
            atomicAdd(dk_acc + kv_row + d, dsj * q_s[d]);
            atomicAdd(dv_acc + kv_row + d, pj * do_s[d]);
        }
    }
}

PK_IO_KERNELS(attention_bwd_fma_naive, (128, 1),
              (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const T* __restrict__ grad_out, T* __restrict__ dq, float* __restrict__ dk_acc,
               float* __restrict__ dv_acc, unsigned int n_q, unsigned int n_k, unsigned int n_heads,
               unsigned int n_kv_heads, unsigned int head_dim, float scale, int window_left, int window_right,
               float softcap),
              (q, k, v, grad_out, dq, dk_acc, dv_acc, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, window_left,
               window_right, softcap))

// ---------------------------------------------------------------------------
// delta[r] = dot(dO[r], O[r]) for every (batch, query, head) row; one warp per row.
template <typename T>
__device__ __forceinline__ void attention_bwd_preprocess_impl(const T* __restrict__ dout, const T* __restrict__ out,
                                                          float* __restrict__ delta, long long n_rows,
                                                          unsigned int head_dim) {
    const unsigned int lane = threadIdx.x & 31u;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= n_rows) return;  // whole warps leave together; no barrier follows
    const long long base = row * head_dim;
    float s = 0.0f;
    for (long long d = lane; d < head_dim; d += 32) s += PkIO<T>::load(dout, base + d) * PkIO<T>::load(out, base + d);
    s = pk_warp_sum(s);
    if (lane == 0) delta[row] = s;
}

PK_IO_KERNELS(attention_bwd_preprocess, (256, 1),
              (const T* __restrict__ grad_out, const T* __restrict__ out, float* __restrict__ delta,
               long long n_rows, unsigned int head_dim),
              (grad_out, out, delta, n_rows, head_dim))

// ---------------------------------------------------------------------------
// Shared pieces of the query-tiled kernels (lse pre-pass and dq): a block of
// blockDim.x / G query rows of one head; k/v rows are staged PK_ATT_STAGE at a
// time in dynamic shared memory: ks[STAGE][D], vs[STAGE][D].
template <typename T>
__device__ __forceinline__ void stage_kv(const T* __restrict__ k, const T* __restrict__ v, float* ks,
                                         float* vs, long long k_row0, unsigned int j0, unsigned int n_rows,
                                         unsigned int n_kv_heads, unsigned int kvh, unsigned int head_dim) {
    const unsigned int total = n_rows * head_dim;
    for (unsigned int idx = threadIdx.x; idx < total; idx += blockDim.x) {
        const unsigned int r = idx / head_dim, d = idx - r * head_dim;
        const long long src = ((k_row0 + j0 + r) * n_kv_heads + kvh) * head_dim + d;
        ks[idx] = PkIO<T>::load(k, src);
        vs[idx] = PkIO<T>::load(v, src);
    }
}

// The varlen prologue: the CTA's (sequence, head, tile) from a 1-D grid of batch * n_heads * ceil(max_len / rows)
// CTAs; the sequence's first q / k rows (64-bit) and its lengths replace the maxima, and the window sides (the
// op passes unbounded ones as 2^30, normalize_serving in _window.py) are clamped to them as the dense op's
// normalize does. False: the CTA has no row of its sequence (uniform, before any barrier).
__device__ __forceinline__ bool pk_bwd_varlen_seq(const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                                  unsigned int n_tiles, unsigned int n_heads, unsigned int rows,
                                                  bool by_keys, unsigned int& tile, unsigned int& h,
                                                  long long& q_row0, long long& k_row0, unsigned int& n_q,
                                                  unsigned int& n_k, int& window_left, int& window_right) {
    const unsigned int bh = blockIdx.x / n_tiles;
    const unsigned int b = bh / n_heads;
    tile = blockIdx.x - bh * n_tiles;
    h = bh - b * n_heads;
    q_row0 = cu_q[b];
    k_row0 = cu_k[b];
    const int lq = cu_q[b + 1] - cu_q[b], lk = cu_k[b + 1] - cu_k[b];
    n_q = lq > 0 ? (unsigned int)lq : 0u;
    n_k = lk > 0 ? (unsigned int)lk : 0u;
    window_left = min(window_left, (int)n_k);
    window_right = min(window_right, (int)n_q);
    return (unsigned long long)tile * rows < (by_keys ? n_k : n_q);
}

// mode 0: lse pre-pass (writes lse and delta by an online sweep over keys);
// mode 1: dq (reads lse and delta).
// VL: the varlen dq (cu_q / cu_k read; n_q / n_k are max_seqlen_q / _k); the dense kernels pass null for them.
template <typename T, int MODE, bool SC, bool VL = false>
__device__ __forceinline__ void attention_query_tiled_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
    float* __restrict__ lse, float* __restrict__ delta, T* __restrict__ dq, unsigned int n_q, unsigned int n_k,
    unsigned int n_heads, unsigned int n_kv_heads, unsigned int head_dim, float scale, int window_left,
    int window_right, float softcap, unsigned int group_lanes, const int* __restrict__ cu_q = nullptr,
    const int* __restrict__ cu_k = nullptr) {
    extern __shared__ float smem[];
    const unsigned int G = group_lanes;
    const unsigned int rows_per_block = blockDim.x / G;
    const unsigned int g = threadIdx.x % G;
    unsigned int tile = blockIdx.x, h = blockIdx.y;
    long long q_row0, k_row0;  // the batch's (sequence's) first q / k row
    if (VL) {
        if (!pk_bwd_varlen_seq(cu_q, cu_k, (n_q + rows_per_block - 1) / rows_per_block, n_heads, rows_per_block,
                               false, tile, h, q_row0, k_row0, n_q, n_k, window_left, window_right))
            return;
    } else {
        q_row0 = (long long)blockIdx.z * n_q;
        k_row0 = (long long)blockIdx.z * n_k;
    }
    const unsigned int i0 = tile * rows_per_block;
    const unsigned int i = i0 + threadIdx.x / G;
    const unsigned int kvh = h / (n_heads / n_kv_heads);
    const bool valid = i < n_q;
    const long long D = head_dim;
    const long long row = (q_row0 + (valid ? i : 0)) * n_heads + h;  // lse/delta index
    float qr[PK_ATT_MAXE], dor[PK_ATT_MAXE], acc[PK_ATT_MAXE];
#pragma unroll
    for (int e = 0; e < PK_ATT_MAXE; ++e) {
        const long long d = g + (long long)G * e;
        const bool ok = valid && d < D;
        qr[e] = ok ? PkIO<T>::load(q, row * D + d) : 0.0f;
        dor[e] = ok ? PkIO<T>::load(dout, row * D + d) : 0.0f;
        acc[e] = 0.0f;
    }
    float m = PK_NEG_INF, l = 0.0f, t = 0.0f;  // MODE 0: online max, sum of exp, sum of exp * dP
    float row_lse = 0.0f, row_delta = 0.0f;
    if (MODE == 1 && valid) {
        row_lse = lse[row];
        row_delta = delta[row];
    }
    int rlo, rhi;  // keys [rlo, rhi] this row sees (none for an invalid row)
    pk_attn_q_row((int)i, (int)n_q, (int)n_k, window_left, window_right, rlo, rhi);
    float* ks = smem;
    float* vs = smem + PK_ATT_STAGE * D;
    // only the keys some row of the block sees are staged: [span.lo, last)
    const unsigned int i_last = (i0 + rows_per_block < n_q ? i0 + rows_per_block : n_q) - 1;
    const PkAttnSpan span = pk_attn_q_span((int)i0, (int)i_last, (int)n_q, (int)n_k, window_left, window_right);
    const unsigned int last = (unsigned int)(span.hi + 1);
    for (unsigned int j0 = (unsigned int)span.lo; j0 < last; j0 += PK_ATT_STAGE) {
        const unsigned int n_stage = (last - j0 < PK_ATT_STAGE) ? last - j0 : PK_ATT_STAGE;
        __syncthreads();  // the previous stage is fully consumed
        stage_kv<T>(k, v, ks, vs, k_row0, j0, n_stage, n_kv_heads, kvh, head_dim);
        __syncthreads();
        for (unsigned int c = 0; c < n_stage; ++c) {
            const float* kr = ks + c * D;
            const float* vr = vs + c * D;
            float s = 0.0f, dp = 0.0f;
#pragma unroll
            for (int e = 0; e < PK_ATT_MAXE; ++e) {
                const long long d = g + (long long)G * e;
                if (d < D) {
                    s += qr[e] * kr[d];
                    dp += dor[e] * vr[d];
                }
            }
            s = pk_group_sum(s, G) * scale;
            dp = pk_group_sum(dp, G);
            float th = 0.0f;
            if (SC) {
                th = tanhf(s / softcap);
                s = softcap * th;
            }
            const int jj = (int)(j0 + c);
            const bool live = jj >= rlo && jj <= rhi;
            if (MODE == 0) {
                if (live) {
                    if (s > m) {
                        const float corr = expf(m - s);  // m = -inf: corr = 0
                        l = l * corr + 1.0f;
                        t = t * corr + dp;
                        m = s;
                    } else {
                        const float e = expf(s - m);
                        l += e;
                        t += e * dp;
                    }
                }
            } else {
                // masked keys contribute exactly 0 (row_lse may be -inf for a row that sees nothing)
                float ds = live ? expf(s - row_lse) * (dp - row_delta) : 0.0f;
                if (SC) ds *= 1.0f - th * th;
#pragma unroll
                for (int e = 0; e < PK_ATT_MAXE; ++e) {
                    const long long d = g + (long long)G * e;
                    if (d < D) acc[e] += ds * kr[d];
                }
            }
        }
    }
    if (!valid) return;  // after the last barrier
    if (MODE == 0) {
        if (g == 0) {  // a row that sees no key: lse = -inf (as flash_attention), delta = 0
            lse[row] = l > 0.0f ? m + logf(l) : PK_NEG_INF;
            delta[row] = l > 0.0f ? t / l : 0.0f;
        }
    } else {
#pragma unroll
        for (int e = 0; e < PK_ATT_MAXE; ++e) {
            const long long d = g + (long long)G * e;
            if (d < D) PkIO<T>::store(dq, row * D + d, acc[e] * scale);
        }
    }
}

// Entry points: the lse pre-pass (MODE 0) and dq (MODE 1), each with and without softcap.
PK_IO_VARIANT(attention_bwd_lse, attention_query_tiled_body, 0, false)
PK_IO_VARIANT(attention_bwd_lse_softcap, attention_query_tiled_body, 0, true)
PK_IO_VARIANT(attention_bwd_fma_dq, attention_query_tiled_body, 1, false)
PK_IO_VARIANT(attention_bwd_fma_dq_softcap, attention_query_tiled_body, 1, true)

PK_IO_KERNELS(attention_bwd_lse, (256, 1),
              (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad_out,
               float* __restrict__ lse, float* __restrict__ delta, unsigned int n_q, unsigned int n_k,
               unsigned int n_heads, unsigned int n_kv_heads, unsigned int head_dim, float scale, int window_left,
               int window_right, float softcap, unsigned int group_lanes),
              (q, k, v, grad_out, lse, delta, (T*)0, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, window_left,
               window_right, softcap, group_lanes))

PK_IO_KERNELS(attention_bwd_lse_softcap, (256, 1),
              (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad_out,
               float* __restrict__ lse, float* __restrict__ delta, unsigned int n_q, unsigned int n_k,
               unsigned int n_heads, unsigned int n_kv_heads, unsigned int head_dim, float scale, int window_left,
               int window_right, float softcap, unsigned int group_lanes),
              (q, k, v, grad_out, lse, delta, (T*)0, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, window_left,
               window_right, softcap, group_lanes))

PK_IO_KERNELS(attention_bwd_fma_dq, (256, 1),
              (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad_out,
               const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, unsigned int n_q,
               unsigned int n_k, unsigned int n_heads, unsigned int n_kv_heads, unsigned int head_dim, float scale,
               int window_left, int window_right, float softcap, unsigned int group_lanes),
              (q, k, v, grad_out, const_cast<float*>(lse), const_cast<float*>(delta), dq, n_q, n_k, n_heads,
               n_kv_heads, head_dim, scale, window_left, window_right, softcap, group_lanes))

PK_IO_KERNELS(attention_bwd_fma_dq_softcap, (256, 1),
              (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad_out,
               const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, unsigned int n_q,
               unsigned int n_k, unsigned int n_heads, unsigned int n_kv_heads, unsigned int head_dim, float scale,
               int window_left, int window_right, float softcap, unsigned int group_lanes),
              (q, k, v, grad_out, const_cast<float*>(lse), const_cast<float*>(delta), dq, n_q, n_k, n_heads,
               n_kv_heads, head_dim, scale, window_left, window_right, softcap, group_lanes))

// ---------------------------------------------------------------------------
// dk/dv: a block owns blockDim.x / G keys of one kv head; it walks every query
// head of the group and every query that can see its first key (all queries
// when not causal), staging q/dO rows (and their lse/delta) PK_ATT_STAGE at a
// time. Accumulators stay in registers, so each dk/dv element is written once
// (deterministic, no atomics).
// Dynamic shared memory: qs[STAGE][D], dos[STAGE][D], lse_s[STAGE], delta_s[STAGE].
// VL: the varlen dK / dV (as attention_query_tiled_body's; the grid's heads are the kv heads). A sequence with keys
// but no query still writes its zero dk / dv.
template <typename T, bool SC, bool VL = false>
__device__ __forceinline__ void attention_dkdv_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
    const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
    unsigned int n_q, unsigned int n_k, unsigned int n_heads, unsigned int n_kv_heads, unsigned int head_dim,
    float scale, int window_left, int window_right, float softcap, unsigned int group_lanes,
    const int* __restrict__ cu_q = nullptr, const int* __restrict__ cu_k = nullptr) {
    extern __shared__ float smem[];
    const unsigned int G = group_lanes;
    const unsigned int keys_per_block = blockDim.x / G;
    const unsigned int g = threadIdx.x % G;
    unsigned int tile = blockIdx.x, kvh = blockIdx.y;
    long long q_row0, k_row0;
    if (VL) {
        if (!pk_bwd_varlen_seq(cu_q, cu_k, (n_k + keys_per_block - 1) / keys_per_block, n_kv_heads, keys_per_block,
                               true, tile, kvh, q_row0, k_row0, n_q, n_k, window_left, window_right))
            return;
    } else {
        q_row0 = (long long)blockIdx.z * n_q;
        k_row0 = (long long)blockIdx.z * n_k;
    }
    const unsigned int j_first = tile * keys_per_block;
    const unsigned int j = j_first + threadIdx.x / G;
    const unsigned int rep = n_heads / n_kv_heads;
    const bool valid = j < n_k;
    const long long D = head_dim;
    const long long kv_row = (k_row0 + (valid ? j : 0)) * n_kv_heads + kvh;
    // only the queries that see some key of the block: [span.lo, i_end); this key is seen by [ilo, ihi]
    const unsigned int j_last = (j_first + keys_per_block < n_k ? j_first + keys_per_block : n_k) - 1;
    const PkAttnSpan span = pk_attn_k_span((int)j_first, (int)j_last, (int)n_q, (int)n_k, window_left, window_right);
    const unsigned int i_begin = (unsigned int)span.lo, i_end = (unsigned int)(span.hi + 1);
    int ilo, ihi;
    pk_attn_k_row((int)j, (int)n_q, (int)n_k, window_left, window_right, ilo, ihi);
    float kr[PK_ATT_MAXE], vr[PK_ATT_MAXE], dka[PK_ATT_MAXE], dva[PK_ATT_MAXE];
#pragma unroll
    for (int e = 0; e < PK_ATT_MAXE; ++e) {
        const long long d = g + (long long)G * e;
        const bool ok = valid && d < D;
        kr[e] = ok ? PkIO<T>::load(k, kv_row * D + d) : 0.0f;
        vr[e] = ok ? PkIO<T>::load(v, kv_row * D + d) : 0.0f;
        dka[e] = 0.0f;
        dva[e] = 0.0f;
    }
    float* qs = smem;
    float* dos = smem + PK_ATT_STAGE * D;
    float* lse_s = smem + 2 * PK_ATT_STAGE * D;
    float* delta_s = lse_s + PK_ATT_STAGE;
    for (unsigned int hh = 0; hh < rep; ++hh) {
        const unsigned int h = kvh * rep + hh;
        for (unsigned int i0 = i_begin; i0 < i_end; i0 += PK_ATT_STAGE) {
            const unsigned int n_stage = (i_end - i0 < PK_ATT_STAGE) ? i_end - i0 : PK_ATT_STAGE;
            __syncthreads();  // the previous stage is fully consumed
            const unsigned int total = n_stage * head_dim;
            for (unsigned int idx = threadIdx.x; idx < total; idx += blockDim.x) {
                const unsigned int r = idx / head_dim, d = idx - r * head_dim;
                const long long src = ((q_row0 + i0 + r) * n_heads + h) * D + d;
                qs[idx] = PkIO<T>::load(q, src);
                dos[idx] = PkIO<T>::load(dout, src);
            }
            for (unsigned int r = threadIdx.x; r < n_stage; r += blockDim.x) {
                const long long src = (q_row0 + i0 + r) * n_heads + h;
                lse_s[r] = lse[src];
                delta_s[r] = delta[src];
            }
            __syncthreads();
            for (unsigned int r = 0; r < n_stage; ++r) {
                const float* qrow = qs + r * D;
                const float* dorow = dos + r * D;
                float s = 0.0f, dp = 0.0f;
#pragma unroll
                for (int e = 0; e < PK_ATT_MAXE; ++e) {
                    const long long d = g + (long long)G * e;
                    if (d < D) {
                        s += qrow[d] * kr[e];
                        dp += dorow[d] * vr[e];
                    }
                }
                s = pk_group_sum(s, G) * scale;
                dp = pk_group_sum(dp, G);
                float th = 0.0f;
                if (SC) {
                    th = tanhf(s / softcap);
                    s = softcap * th;
                }
                const int ii = (int)(i0 + r);
                const bool live = ii >= ilo && ii <= ihi;  // none for a key past n_k
                const float p = live ? expf(s - lse_s[r]) : 0.0f;
                float ds = live ? p * (dp - delta_s[r]) : 0.0f;
                if (SC) ds *= 1.0f - th * th;
#pragma unroll
                for (int e = 0; e < PK_ATT_MAXE; ++e) {
                    const long long d = g + (long long)G * e;
                    if (d < D) {
                        dva[e] += p * dorow[d];
                        dka[e] += ds * qrow[d];
                    }
                }
            }
        }
    }
    if (!valid) return;  // after the last barrier
#pragma unroll
    for (int e = 0; e < PK_ATT_MAXE; ++e) {
        const long long d = g + (long long)G * e;
        if (d < D) {
            PkIO<T>::store(dk, kv_row * D + d, dka[e] * scale);
            PkIO<T>::store(dv, kv_row * D + d, dva[e]);
        }
    }
}

PK_IO_VARIANT(attention_bwd_fma_dkdv, attention_dkdv_body, false)
PK_IO_VARIANT(attention_bwd_fma_dkdv_softcap, attention_dkdv_body, true)

PK_IO_KERNELS(attention_bwd_fma_dkdv, (256, 1),
              (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad_out,
               const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
               unsigned int n_q, unsigned int n_k, unsigned int n_heads, unsigned int n_kv_heads,
               unsigned int head_dim, float scale, int window_left, int window_right, float softcap,
               unsigned int group_lanes),
              (q, k, v, grad_out, lse, delta, dk, dv, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, window_left,
               window_right, softcap, group_lanes))

PK_IO_KERNELS(attention_bwd_fma_dkdv_softcap, (256, 1),
              (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad_out,
               const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
               unsigned int n_q, unsigned int n_k, unsigned int n_heads, unsigned int n_kv_heads,
               unsigned int head_dim, float scale, int window_left, int window_right, float softcap,
               unsigned int group_lanes),
              (q, k, v, grad_out, lse, delta, dk, dv, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, window_left,
               window_right, softcap, group_lanes))

// ---------------------------------------------------------------------------
// Varlen entry points (float32; see the top of the file): the dense kernels' parameters with cu_seqlens_q /
// cu_seqlens_k, batch and max_seqlen_q / _k in the tensor-core varlen kernels' order, then group_lanes.
// batch only bounds the grid (the op launches batch * heads * tiles CTAs); the window sides come unbounded
// as 2^30 and are clamped per sequence.
extern "C" __global__ void __launch_bounds__(256, 1) attention_bwd_varlen_fma_dkdv(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ grad_out, const float* __restrict__ lse, const float* __restrict__ delta,
    float* __restrict__ dk, float* __restrict__ dv, const int* __restrict__ cu_seqlens_q,
    const int* __restrict__ cu_seqlens_k, int batch, int max_seqlen_q, int max_seqlen_k, int n_heads,
    int n_kv_heads, int head_dim, float scale, int window_left, int window_right, float softcap,
    unsigned int group_lanes) {
    attention_dkdv_body<float, false, true>(q, k, v, grad_out, lse, delta, dk, dv, max_seqlen_q, max_seqlen_k,
                                            n_heads, n_kv_heads, head_dim, scale, window_left, window_right,
                                            softcap, group_lanes, cu_seqlens_q, cu_seqlens_k);
}

extern "C" __global__ void __launch_bounds__(256, 1) attention_bwd_varlen_fma_dkdv_softcap(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ grad_out, const float* __restrict__ lse, const float* __restrict__ delta,
    float* __restrict__ dk, float* __restrict__ dv, const int* __restrict__ cu_seqlens_q,
    const int* __restrict__ cu_seqlens_k, int batch, int max_seqlen_q, int max_seqlen_k, int n_heads,
    int n_kv_heads, int head_dim, float scale, int window_left, int window_right, float softcap,
    unsigned int group_lanes) {
    attention_dkdv_body<float, true, true>(q, k, v, grad_out, lse, delta, dk, dv, max_seqlen_q, max_seqlen_k,
                                           n_heads, n_kv_heads, head_dim, scale, window_left, window_right,
                                           softcap, group_lanes, cu_seqlens_q, cu_seqlens_k);
}

extern "C" __global__ void __launch_bounds__(256, 1) attention_bwd_varlen_fma_dq(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ grad_out, const float* __restrict__ lse, const float* __restrict__ delta,
    float* __restrict__ dq, const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k, int batch,
    int max_seqlen_q, int max_seqlen_k, int n_heads, int n_kv_heads, int head_dim, float scale, int window_left,
    int window_right, float softcap, unsigned int group_lanes) {
    attention_query_tiled_body<float, 1, false, true>(q, k, v, grad_out, const_cast<float*>(lse),
                                                      const_cast<float*>(delta), dq, max_seqlen_q, max_seqlen_k,
                                                      n_heads, n_kv_heads, head_dim, scale, window_left,
                                                      window_right, softcap, group_lanes, cu_seqlens_q,
                                                      cu_seqlens_k);
}

extern "C" __global__ void __launch_bounds__(256, 1) attention_bwd_varlen_fma_dq_softcap(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ grad_out, const float* __restrict__ lse, const float* __restrict__ delta,
    float* __restrict__ dq, const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k, int batch,
    int max_seqlen_q, int max_seqlen_k, int n_heads, int n_kv_heads, int head_dim, float scale, int window_left,
    int window_right, float softcap, unsigned int group_lanes) {
    attention_query_tiled_body<float, 1, true, true>(q, k, v, grad_out, const_cast<float*>(lse),
                                                     const_cast<float*>(delta), dq, max_seqlen_q, max_seqlen_k,
                                                     n_heads, n_kv_heads, head_dim, scale, window_left,
                                                     window_right, softcap, group_lanes, cu_seqlens_q,
                                                     cu_seqlens_k);
}
