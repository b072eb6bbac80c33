// FlashAttention forward: O = softmax(scale * Q K^T [+ causal mask]) V
// without materialising the score matrix, plus the per-row log-sum-exp that
// attention_backward consumes.
//
// Layouts (contiguous): q (batch, n_q, n_heads, head_dim), k (batch, n_k,
// n_kv_heads, head_dim), v (batch, n_k, n_kv_heads, head_dim_v), out (batch,
// n_q, n_heads, head_dim_v), lse (batch, n_q, n_heads) fp32. Query head h reads
// kv head h / (n_heads / n_kv_heads) (grouped-query attention).
//
// Causal mask is aligned bottom-right: query i sees key j iff j <= i + n_k - n_q,
// so the last query sees every key. Windows (flash-attn's window_size) likewise:
// query i sees keys i + s - window_left <= j <= i + s + window_right, s = n_k - n_q;
// the op normalizes them (causal is window_right = 0; see pk_attn_window.cuh) and
// a block stages only the key tiles its rows' windows reach. A row that sees no
// key gets out = 0 and lse = -inf.
// Softcap (the _softcap entry points, a template flag): scores become
// c * tanh(scale * q.k / c) before the mask and softmax (Gemma 2, flash-attn).
// lse is the natural-log log-sum-exp of the *scaled* scores over visible keys.
//
// Work split: a block of 256 threads owns ROWS consecutive queries of one
// (batch, head); G = DMAX/16 threads share a query row and each holds 16 of its
// dims (q pre-scaled, and the output accumulator) in registers, as four float4
// chunks strided by G so the G threads of a row read consecutive shared-memory
// words. Keys and values stream through shared memory in tiles of BK rows
// converted to fp32, zero-padded past head_dim / n_k. For every FA_SB keys of a
// tile a thread forms the scores of its row (partial dot + xor-shuffle inside
// the G-lane group), rescales its accumulator once by the new running max, then
// adds p_j * v_j.
// Softmax runs in base 2 (q carries scale * log2(e)), converted back for lse.
// DMAX is a compile-time bucket (64/128/256 for max(head_dim, head_dim_v)) so
// the per-thread register arrays have fixed size: 0 spills on every arch.
// One body over the I/O element type T (float, __nv_bfloat16, __half: PK_IO_KERNELS), fp32 math.
#include "pk_vec.cuh"
#include "pk_attn_window.cuh"

#define FA_THREADS 256
// Scores held in registers per online-softmax step (one accumulator rescale per
// FA_SB keys). 2 blocks of 256 threads per SM caps registers at 128; ptxas for
// sm_100/sm_120 needs ~170 for the same code and spills under that cap, so
// there the bound asks for 1 block (0 spills measured for every arch).
#define FA_SB 8
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define FA_MIN_BLOCKS 1
#else
#define FA_MIN_BLOCKS 2
#endif

// Stage rows [k0, k0 + BK) of one kv head into smem tile[BK][DMAX] as fp32,
// zeros past `dim` and past n_k (so padded lanes contribute exact zeros). With
// dim % 4 == 0 and an aligned base every global row offset is a multiple of 4
// elements, so a chunk of 4 is one vector load; otherwise element by element.
template <typename T, int DMAX, int BK>
__device__ __forceinline__ void fa_stage_tile(float* tile, const T* __restrict__ src, long long row0_off,
                                              long long row_stride, int k0, int n_k, int dim, bool vec) {
    if (vec) {
        for (int e = threadIdx.x; e < BK * DMAX / 4; e += FA_THREADS) {
            const int j = (e * 4) / DMAX, d = (e * 4) % DMAX;
            float4 f;
            f.x = 0.0f; f.y = 0.0f; f.z = 0.0f; f.w = 0.0f;
            if (k0 + j < n_k && d < dim) f = PkVec4<T>::load(src, row0_off + (long long)(k0 + j) * row_stride + d);
            *reinterpret_cast<float4*>(tile + e * 4) = f;
        }
    } else {
        for (int e = threadIdx.x; e < BK * DMAX; e += FA_THREADS) {
            const int j = e / DMAX, d = e % DMAX;
            tile[e] = (k0 + j < n_k && d < dim) ? PkIO<T>::load(src, row0_off + (long long)(k0 + j) * row_stride + d)
                                                : 0.0f;
        }
    }
}

template <typename T>
__device__ __forceinline__ bool fa_vec_ok(const T* p, int dim) {
    const unsigned long long need = sizeof(T) == 4 ? 15ull : 7ull;  // float4 / uint2 loads
    return dim % 4 == 0 && (((unsigned long long)p) & need) == 0ull;
}

template <typename T, int DMAX, int BK, int SB, bool SC>
__device__ __forceinline__ void flash_attention_body(const T* __restrict__ q, const T* __restrict__ k,
                                                     const T* __restrict__ v, T* __restrict__ out,
                                                     float* __restrict__ lse, int batch, int n_q, int n_k,
                                                     int n_heads, int n_kv_heads, int head_dim, int head_dim_v,
                                                     float scale, int window_left, int window_right,
                                                     float softcap) {
    constexpr int G = DMAX / 16;            // threads per query row
    constexpr int ROWS = FA_THREADS / G;    // query rows per block
    __shared__ __align__(16) float ks[BK * DMAX];
    __shared__ __align__(16) float vs[BK * DMAX];

    const int g = threadIdx.x % G;
    const int q_tiles = (n_q + ROWS - 1) / ROWS;
    long long bid = blockIdx.x;  // (batch, head, query tile) folded into x: y/z stay 1
    const int qt = (int)(bid % q_tiles);
    bid /= q_tiles;
    const int h = (int)(bid % n_heads);
    const int b = (int)(bid / n_heads);
    if (b >= batch) return;  // whole block leaves together: no barrier is split
    const int hk = h / (n_heads / n_kv_heads);
    const int row = qt * ROWS + (int)threadIdx.x / G;
    const bool row_ok = row < n_q;

    // q slice, pre-scaled into the base-2 domain (softcap: by scale / c, the tanh's argument)
    const float qscale = SC ? scale / softcap : scale * 1.4426950408889634f;
    const float post = SC ? softcap * 1.4426950408889634f : 1.0f;
    const long long q_off = (((long long)b * n_q + (row_ok ? row : 0)) * n_heads + h) * head_dim;
    float qr[16], acc[16];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = 4 * (g + G * c) + e;
            qr[4 * c + e] = (row_ok && d < head_dim) ? PkIO<T>::load(q, q_off + d) * qscale : 0.0f;
            acc[4 * c + e] = 0.0f;
        }
    }
    float m = PK_NEG_INF, l = 0.0f;

    // The block stages only the key tiles of [span.lo, span.hi]; tiles inside [full_lo, full_hi] need no mask.
    const PkAttnSpan span = pk_attn_q_span(qt * ROWS, min(qt * ROWS + ROWS, n_q) - 1, n_q, n_k, window_left,
                                           window_right);
    const int kv_begin = span.lo - span.lo % BK, kv_end = span.hi + 1;  // kv_end <= kv_begin: no key at all
    // [full_lo, full_hi] and each row's keys [lo, hi] go through shared memory, read after the loop's
    // barrier (only in edge tiles for the rows): held in registers across the loop they would cost the
    // registers this kernel does not have (0 spills at 2 blocks/SM).
    __shared__ int full_span[3];
    __shared__ int row_span[ROWS][2];
    __shared__ long long row_out[ROWS];  // (b * n_q + row) * n_heads + h, for the epilogue (same reason)
    if (threadIdx.x == 0) {
        full_span[0] = span.full_lo;
        full_span[1] = span.full_hi;
        full_span[2] = kv_end;
    }
    if (g == 0) {
        pk_attn_q_row(row, n_q, n_k, window_left, window_right, row_span[threadIdx.x / G][0],
                      row_span[threadIdx.x / G][1]);
        row_out[threadIdx.x / G] = ((long long)b * n_q + row) * n_heads + h;
    }
    const long long k_base = ((long long)b * n_k * n_kv_heads + hk) * head_dim;
    const long long v_base = ((long long)b * n_k * n_kv_heads + hk) * head_dim_v;
    const bool k_vec = fa_vec_ok<T>(k, head_dim), v_vec = fa_vec_ok<T>(v, head_dim_v);

    __syncthreads();
    for (int k0 = kv_begin; k0 < full_span[2]; k0 += BK) {  // kv_end: full_span[2]
        __syncthreads();  // every thread is done with the previous tile
        fa_stage_tile<T, DMAX, BK>(ks, k, k_base, (long long)n_kv_heads * head_dim, k0, n_k, head_dim, k_vec);
        fa_stage_tile<T, DMAX, BK>(vs, v, v_base, (long long)n_kv_heads * head_dim_v, k0, n_k, head_dim_v, v_vec);
        __syncthreads();
        // Edge tile: some key is outside some row's window (or past n_k). The row's bounds are
        // recomputed there rather than kept live in registers across the loop (0 spills at 2 blocks/SM).
        const bool edge = k0 < full_span[0] || k0 + BK - 1 > full_span[1];

        // scores live in registers SB at a time: one rescale per SB keys, SB bounded for 0 spills
#pragma unroll 1
        for (int j0 = 0; j0 < BK; j0 += SB) {
            float s[SB];
#pragma unroll
            for (int j = 0; j < SB; ++j) {
                const float4* kr = reinterpret_cast<const float4*>(ks + (j0 + j) * DMAX);
                float part = 0.0f;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const float4 kk = kr[g + G * c];
                    part = fmaf(qr[4 * c], kk.x, part);
                    part = fmaf(qr[4 * c + 1], kk.y, part);
                    part = fmaf(qr[4 * c + 2], kk.z, part);
                    part = fmaf(qr[4 * c + 3], kk.w, part);
                }
#pragma unroll
                for (int off = G / 2; off > 0; off >>= 1) part += __shfl_xor_sync(PK_FULL_MASK, part, off);
                s[j] = SC ? tanhf(part) * post : part;
            }
            if (edge) {
                const int rlo = row_span[threadIdx.x / G][0], rhi = row_span[threadIdx.x / G][1];  // this row's keys
#pragma unroll
                for (int j = 0; j < SB; ++j) {
                    const int kj = k0 + j0 + j;
                    if (kj < rlo || kj > rhi) s[j] = PK_NEG_INF;
                }
            }
            float tmax = m;
#pragma unroll
            for (int j = 0; j < SB; ++j) tmax = fmaxf(tmax, s[j]);
            if (tmax != PK_NEG_INF) {  // else nothing visible to this row yet: state stays (m=-inf, l=0, acc=0)
                const float alpha = exp2f(m - tmax);  // m = -inf -> 0
                l *= alpha;
#pragma unroll
                for (int i = 0; i < 16; ++i) acc[i] *= alpha;
#pragma unroll
                for (int j = 0; j < SB; ++j) {
                    const float p = exp2f(s[j] - tmax);  // masked: exp2(-inf) = 0
                    l += p;
                    const float4* vr = reinterpret_cast<const float4*>(vs + (j0 + j) * DMAX);
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const float4 vv = vr[g + G * c];
                        acc[4 * c] = fmaf(p, vv.x, acc[4 * c]);
                        acc[4 * c + 1] = fmaf(p, vv.y, acc[4 * c + 1]);
                        acc[4 * c + 2] = fmaf(p, vv.z, acc[4 * c + 2]);
                        acc[4 * c + 3] = fmaf(p, vv.w, acc[4 * c + 3]);
                    }
                }
                m = tmax;
            }
        }
    }

    if (!row_ok) return;  // after the last barrier
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const long long o_row = row_out[threadIdx.x / G];  // written before the loop's barriers
    const long long o_off = o_row * head_dim_v;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = 4 * (g + G * c) + e;
            if (d < head_dim_v) PkIO<T>::store(out, o_off + d, acc[4 * c + e] * inv);
        }
    }
    if (g == 0)  // m is in log2 units: lse = ln(2) * (m + log2(l))
        lse[o_row] = l > 0.0f ? (m + log2f(l)) * 0.6931471805599453f : PK_NEG_INF;
}

// Entry points per head-dim bucket and softcap flag, each in f32, bf16 and f16 (the op picks the
// smallest bucket holding max(head_dim, head_dim_v)). The d256 bucket halves the key tile so K + V tiles
// stay at 32 KB of static shared memory.
PK_IO_VARIANT(attention_fwd_fma_d64, flash_attention_body, 64, 32, FA_SB, false)
PK_IO_VARIANT(attention_fwd_fma_d64_softcap, flash_attention_body, 64, 32, FA_SB, true)
PK_IO_VARIANT(attention_fwd_fma_d128, flash_attention_body, 128, 32, FA_SB, false)
PK_IO_VARIANT(attention_fwd_fma_d128_softcap, flash_attention_body, 128, 32, FA_SB, true)
PK_IO_VARIANT(attention_fwd_fma_d256, flash_attention_body, 256, 16, FA_SB, false)
PK_IO_VARIANT(attention_fwd_fma_d256_softcap, flash_attention_body, 256, 16, FA_SB, true)

PK_IO_KERNELS(attention_fwd_fma_d64, (FA_THREADS, FA_MIN_BLOCKS), PK_ATTN_FWD_PARAMS, PK_ATTN_FWD_ARGS)
PK_IO_KERNELS(attention_fwd_fma_d64_softcap, (FA_THREADS, FA_MIN_BLOCKS), PK_ATTN_FWD_PARAMS, PK_ATTN_FWD_ARGS)
PK_IO_KERNELS(attention_fwd_fma_d128, (FA_THREADS, FA_MIN_BLOCKS), PK_ATTN_FWD_PARAMS, PK_ATTN_FWD_ARGS)
PK_IO_KERNELS(attention_fwd_fma_d128_softcap, (FA_THREADS, FA_MIN_BLOCKS), PK_ATTN_FWD_PARAMS, PK_ATTN_FWD_ARGS)
PK_IO_KERNELS(attention_fwd_fma_d256, (FA_THREADS, FA_MIN_BLOCKS), PK_ATTN_FWD_PARAMS, PK_ATTN_FWD_ARGS)
PK_IO_KERNELS(attention_fwd_fma_d256_softcap, (FA_THREADS, FA_MIN_BLOCKS), PK_ATTN_FWD_PARAMS, PK_ATTN_FWD_ARGS)
