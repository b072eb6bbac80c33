// Serving attention: paged KV cache (FlashInfer conventions), KV append,
// paged decode/prefill, varlen (flash-attn) prefill, split-KV merge.
//
// Paged cache, kv_layout 0 = "NHD": pages [num_pages, page_size, num_kv_heads, head_dim];
//                 kv_layout 1 = "HND": pages [num_pages, num_kv_heads, page_size, head_dim].
// A batch's pages in CSR form: sequence b owns pages kv_indices[kv_indptr[b] .. kv_indptr[b+1]),
// the last of which holds kv_last_page_len[b] tokens (clamped to [0, page_size] here),
// so its length is (n_pages - 1) * page_size + last_page_len (0 with no pages).
// Dense K/V ("dense_attn", also pykern.ops.decode_attention's kernel): token t of sequence b, kv head h at
//   base + s_b*b + s_tok*(start_b + t) + s_head*h   (64-bit element offsets), with
//   k_mode 0: start_b = cu_k[b], len = cu_k[b+1] - cu_k[b]   (flash-attn varlen)
//   k_mode 1: start_b = 0, len = min(seq_lens[b], max_len)     (padded contiguous caches)
// Queries (and out): q_mode 0: one query per sequence, row b of q [batch, H, D] (decode);
//                    q_mode 1: rows qo_indptr[b] .. qo_indptr[b+1] of q [total_q, H, D].
// Query i of a sequence with qo_len queries and kv_len keys is the key position
// p = kv_len - qo_len + i (bottom-right): it sees keys p - window_left <= j <= p + window_right
// (the op passes causal as window_right = 0 and an unbounded side as 2^30). Only the positions
// some row of a CTA sees are read, so the cost follows the window. softcap > 0: scores become
// softcap * tanh(scale * q.k / softcap) (FlashInfer's logits_soft_cap).
//
// One CTA handles (sequence b, kv head, a chunk of `rows` packed query rows, split s).
// A packed row is qi * G + g (query qi, head g of the GQA group of G = H / KVH heads), so
// every query head of the group, and for prefill several queries, share each K/V tile:
// a tile of `tile` positions is loaded from global memory and converted to fp32 once into
// shared memory, then all rows of the CTA use it (each K/V element is read once per kv
// head and row chunk; decode has one chunk while G * head_dim <= 2048).
// Split s of num_splits covers positions [s*per, (s+1)*per) with per = ceil(len / splits)
// rounded up to the tile (dense_attn: per = chunk when chunk > 0); with num_splits > 1
// the CTA writes a normalized partial output and its log2-domain lse to
// part_o [splits, total_q*H, D] / part_lse [splits, total_q*H],
// and paged_attn_merge combines them. Otherwise it writes out and (write_lse) the natural-log
// lse [total_q, H] directly. Rows that see no key get zeros and lse -inf.
//
// Scores are in the log2 domain (q pre-multiplied by scale * log2 e) so softmax uses exp2f.
#include "pk_attn_tile.cuh"

#define PA_NT 128  // threads per CTA (4 warps); kept in step with pykern/ops/serving.py
// An explicit minimum of 1 block an SM: with the thread bound alone ptxas aimed at a low
// register count on sm_86/89/100 and spilled a few bytes (measured); with it, 0 spills everywhere.
#define PA_MIN_BLOCKS 1

// Entry points, each family written once over the query/output type T and the cache type TK
// (pk_common.cuh's macros; the registry reads the parameter-list macros below). Suffixes: none = f32 q/out
// and f32 K/V; _bf16 / _f16 = that type everywhere; _bf16kv / _f16kv = f32 q/out over a 16-bit cache;
// [_bf16|_f16]_e4m3kv / _e5m2kv = f32 (bf16, f16) q/out over an FP8 cache. K/V element (page, token, head, d)
// is at page * s_page + token * s_tok + head * s_head + d (64-bit element strides: the op passes a
// view's own strides, so FlashInfer's combined (pages, 2, ...) cache is read through cache[:, 0]
// and cache[:, 1] without a copy). K and V count as k_scale * K and v_scale * V (FP8 scales).
// Dynamic shared memory (floats):
// tile*(2*head_dim+1) + rows*head_dim + rows*tile + 3*rows (pykern/ops/serving.py).
#define PA_BOUNDS (PA_NT, PA_MIN_BLOCKS)
#define PA_PAGED_PARAMS                                                                                        \
    (const T* __restrict__ q, const TKS* __restrict__ k_pages, const TKS* __restrict__ v_pages,                \
     T* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_o, float* __restrict__ part_lse,  \
     const int* __restrict__ qo_indptr, const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices, \
     const int* __restrict__ kv_last_page_len, int num_qo_heads, int num_kv_heads, int head_dim, int page_size, \
     long long s_page, long long s_tok, long long s_head, int q_mode, int window_left, int window_right,       \
     int rows, int tile, int num_splits, int total_q, int write_lse, float scale, float softcap, float k_scale, \
     float v_scale)
#define PA_PAGED_ARGS                                                                                          \
    (q, k_pages, v_pages, out, lse, part_o, part_lse, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,      \
     num_qo_heads, num_kv_heads, head_dim, page_size, s_page, s_tok, s_head, q_mode, window_left, window_right, \
     rows, tile, num_splits, total_q, write_lse, scale, softcap, k_scale, v_scale)
template <typename T, typename TK = T, typename TS>
__device__ __forceinline__ void paged_attn_impl(const T* __restrict__ q, const TS* __restrict__ k_pages,
        const TS* __restrict__ v_pages, T* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_o,
        float* __restrict__ part_lse, const int* __restrict__ qo_indptr, const int* __restrict__ kv_indptr,
        const int* __restrict__ kv_indices, const int* __restrict__ kv_last_page_len, int num_qo_heads,
        int num_kv_heads, int head_dim, int page_size, long long s_page, long long s_tok, long long s_head,
        int q_mode, int window_left, int window_right, int rows, int tile, int num_splits, int total_q,
        int write_lse, float scale, float softcap, float k_scale, float v_scale) {
    extern __shared__ __align__(16) float smem[];
    PagedKV kv = pa_paged_kv(kv_indptr, kv_indices, kv_last_page_len, page_size, s_page, s_tok, s_head);
    PaArgs a = {num_qo_heads, num_kv_heads, head_dim, q_mode, window_left, window_right, rows, tile, num_splits,
                total_q, write_lse, scale, softcap, 0, num_splits > 1, k_scale, v_scale};
    pa_body<T, TK, PagedKV>(q, reinterpret_cast<const TK*>(k_pages), reinterpret_cast<const TK*>(v_pages), out, lse,
                            part_o, part_lse, qo_indptr, kv, a, smem);
}
PK_IO_KERNELS(paged_attn, PA_BOUNDS, PA_PAGED_PARAMS, PA_PAGED_ARGS)
PK_KV16_KERNELS(paged_attn, PA_BOUNDS, PA_PAGED_PARAMS, PA_PAGED_ARGS)
PK_FP8KV_KERNELS(paged_attn, PA_BOUNDS, PA_PAGED_PARAMS, PA_PAGED_ARGS)

#define PA_DENSE_PARAMS                                                                                        \
    (const T* __restrict__ q, const TKS* __restrict__ k, const TKS* __restrict__ v, T* __restrict__ out,       \
     float* __restrict__ lse, float* __restrict__ part_o, float* __restrict__ part_lse,                        \
     const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,                               \
     const unsigned int* __restrict__ seq_lens, int num_qo_heads, int num_kv_heads, int head_dim, long long s_b, \
     long long s_tok, long long s_head, int max_len, int q_mode, int k_mode, int window_left, int window_right, \
     int rows, int tile, int num_splits, int chunk, int total_q, int write_lse, float scale, float softcap)
#define PA_DENSE_ARGS                                                                                          \
    (q, k, v, out, lse, part_o, part_lse, cu_seqlens_q, cu_seqlens_k, seq_lens, num_qo_heads, num_kv_heads,    \
     head_dim, s_b, s_tok, s_head, max_len, q_mode, k_mode, window_left, window_right, rows, tile, num_splits, \
     chunk, total_q, write_lse, scale, softcap)
template <typename T, typename TK = T>
__device__ __forceinline__ void dense_attn_impl(const T* __restrict__ q, const TK* __restrict__ k,
        const TK* __restrict__ v, T* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_o,
        float* __restrict__ part_lse, const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
        const unsigned int* __restrict__ seq_lens, int num_qo_heads, int num_kv_heads, int head_dim, long long s_b,
        long long s_tok, long long s_head, int max_len, int q_mode, int k_mode, int window_left, int window_right,
        int rows, int tile, int num_splits, int chunk, int total_q, int write_lse, float scale, float softcap) {
    extern __shared__ __align__(16) float smem[];
    DenseKV kv = pa_dense_kv(cu_seqlens_k, seq_lens, k_mode, max_len, s_b, s_tok, s_head);
    PaArgs a = {num_qo_heads, num_kv_heads, head_dim, q_mode, window_left, window_right, rows, tile, num_splits,
                total_q, write_lse, scale, softcap, chunk, num_splits > 1, 1.0f, 1.0f};
    pa_body<T, TK, DenseKV>(q, k, v, out, lse, part_o, part_lse, cu_seqlens_q, kv, a, smem);
}
PK_IO_KERNELS(dense_attn, PA_BOUNDS, PA_DENSE_PARAMS, PA_DENSE_ARGS)
PK_KV16_KERNELS(dense_attn, PA_BOUNDS, PA_DENSE_PARAMS, PA_DENSE_ARGS)

template <typename T>
__device__ __forceinline__ void paged_attn_merge_impl(const float* __restrict__ part_o,
        const float* __restrict__ part_lse, T* __restrict__ out, float* __restrict__ lse, long long total_rows,
        int head_dim, int num_splits, int write_lse) {
    pa_merge<T>(part_o, part_lse, out, lse, total_rows, head_dim, num_splits, write_lse);
}
PK_IO_KERNELS(paged_attn_merge, (PA_NT), (const float* __restrict__ part_o, const float* __restrict__ part_lse,
              T* __restrict__ out, float* __restrict__ lse, long long total_rows, int head_dim, int num_splits,
              int write_lse), (part_o, part_lse, out, lse, total_rows, head_dim, num_splits, write_lse))

// ---------------------------------------------------------------------------
// KV append: token t of k, v [nnz, num_kv_heads, head_dim] goes to position
// positions[t] of sequence batch_indices[t], i.e. slot positions[t] % page_size of
// page kv_indices[kv_indptr[b] + positions[t] / page_size], at element strides (s_page, s_tok,
// s_head) of the pages (the caller's view: writes go through it). One block per token.
// A token whose sequence or page is out of range is skipped (the op checks host arrays).
// FP8 caches store fp8(x / scale) (round to nearest even, saturated to the finite range; NaN stays
// NaN), two elements a conversion (cvt.rn.satfinite.<fp8>x2.f32 on sm_89+).
// Programmatic dependent launch (the op's enable_pdl): a block waits for the previous kernel of the stream (the
// one that made k, v or the page table) before its first read, then lets the next PDL launch (the decode that
// reads the appended token) start its CTAs, which wait in turn.
// pykern: pdl paged_append_kv*
template <typename TC> struct PaStore {  // same-type caches: a bit copy (scale unused)
    template <typename TI> static __device__ __forceinline__ void pair(TC* p, long long o0, long long o1, const TI* s,
                                                                        long long i, float) {
        p[o0] = s[i];
        p[o1] = s[i + 1];
    }
    template <typename TI> static __device__ __forceinline__ void one(TC* p, long long o0, const TI* s, long long i,
                                                                       float) {
        p[o0] = s[i];
    }
};
template <int EB> struct PaFp8Narrow;
template <> struct PaFp8Narrow<4> {
    static __device__ __forceinline__ unsigned short x2(float lo, float hi) { return pk_cvt_e4m3x2(lo, hi); }
};
template <> struct PaFp8Narrow<5> {
    static __device__ __forceinline__ unsigned short x2(float lo, float hi) { return pk_cvt_e5m2x2(lo, hi); }
};
template <typename TF> struct PaStoreFp8 {
    template <typename TI> static __device__ __forceinline__ void pair(unsigned char* p, long long o0, long long o1,
                                                                        const TI* s, long long i, float scale) {
        const unsigned short w = PaFp8Narrow<PaFp8Bits<TF>::EB>::x2(PkIO<TI>::load(s, i) / scale,
                                                                    PkIO<TI>::load(s, i + 1) / scale);
        p[o0] = (unsigned char)(w & 0xffu);
        p[o1] = (unsigned char)(w >> 8);
    }
    template <typename TI> static __device__ __forceinline__ void one(unsigned char* p, long long o0, const TI* s,
                                                                       long long i, float scale) {
        p[o0] = (unsigned char)(PaFp8Narrow<PaFp8Bits<TF>::EB>::x2(PkIO<TI>::load(s, i) / scale, 0.0f) & 0xffu);
    }
};
template <> struct PaStore<PkE4M3> : PaStoreFp8<PkE4M3> {};
template <> struct PaStore<PkE5M2> : PaStoreFp8<PkE5M2> {};

// TI: the appended values' type; TC: the cache element tag (TP: its pointer type).
template <typename TI, typename TC, typename TP>
__device__ __forceinline__ void pa_append(const TI* __restrict__ k, const TI* __restrict__ v,
                                          const int* __restrict__ batch_indices, const int* __restrict__ positions,
                                          TP* __restrict__ k_pages, TP* __restrict__ v_pages,
                                          const int* __restrict__ kv_indices, const int* __restrict__ kv_indptr,
                                          int batch, int num_kv_heads, int head_dim, int page_size, long long s_page,
                                          long long s_tok, long long s_head, float k_scale, float v_scale) {
    pk_grid_dependency_wait();
    pk_grid_launch_dependents();
    const long long t = blockIdx.x;
    const int b = batch_indices[t];
    const int pos = positions[t];
    if (b < 0 || b >= batch || pos < 0) return;
    const int pi = pos / page_size;
    const long long slot = (long long)kv_indptr[b] + pi;
    if (slot >= kv_indptr[b + 1]) return;
    const long long page = kv_indices[slot];
    const int in_page = pos - pi * page_size;
    const long long n = (long long)num_kv_heads * head_dim;
    const long long base = page * s_page + (long long)in_page * s_tok;
    // 32-bit element index inside a token (num_kv_heads * head_dim < 2**31; 64-bit division
    // would be a subroutine call); offsets stay 64-bit. Pairs (d, d + 1) of one head: one x2 conversion.
    if ((head_dim & 1) == 0) {
        for (int e = 2 * threadIdx.x; e < (int)n; e += 2 * blockDim.x) {
            const int h = e / head_dim, d = e - h * head_dim;
            const long long dst = base + h * s_head + d;
            PaStore<TC>::pair(k_pages, dst, dst + 1, k, t * n + e, k_scale);
            PaStore<TC>::pair(v_pages, dst, dst + 1, v, t * n + e, v_scale);
        }
    } else {
        for (int e = threadIdx.x; e < (int)n; e += blockDim.x) {
            const int h = e / head_dim, d = e - h * head_dim;
            const long long dst = base + h * s_head + d;
            PaStore<TC>::one(k_pages, dst, k, t * n + e, k_scale);
            PaStore<TC>::one(v_pages, dst, v, t * n + e, v_scale);
        }
    }
}

#define PA_APPEND_PARAMS                                                                                       \
    (const T* __restrict__ k, const T* __restrict__ v, const int* __restrict__ batch_indices,                  \
     const int* __restrict__ positions, TKS* __restrict__ k_pages, TKS* __restrict__ v_pages,                  \
     const int* __restrict__ kv_indices, const int* __restrict__ kv_indptr, int batch, int num_kv_heads,       \
     int head_dim, int page_size, long long s_page, long long s_tok, long long s_head, float k_scale,           \
     float v_scale)
#define PA_APPEND_ARGS                                                                                         \
    (k, v, batch_indices, positions, k_pages, v_pages, kv_indices, kv_indptr, batch, num_kv_heads, head_dim,   \
     page_size, s_page, s_tok, s_head, k_scale, v_scale)
template <typename T, typename TK = T, typename TS, typename... A>
__device__ __forceinline__ void paged_append_kv_impl(const T* k, const T* v, const int* batch_indices,
                                                     const int* positions, TS* k_pages, TS* v_pages, A... a) {
    pa_append<T, TK, TS>(k, v, batch_indices, positions, k_pages, v_pages, a...);
}
PK_IO_KERNELS(paged_append_kv, (PA_NT), PA_APPEND_PARAMS, PA_APPEND_ARGS)
PK_FP8_KERNELS(paged_append_kv, (PA_NT), PA_APPEND_PARAMS, PA_APPEND_ARGS)

// get_batch_indices_positions on device index arrays (FlashInfer's helper, without a host sync): token t of
// the ragged append belongs to the sequence b with append_indptr[b] <= t < append_indptr[b + 1] (a binary
// search over the non-decreasing indptr, one thread a token) and lands at position
// seq_lens[b] - (append_indptr[b + 1] - t). Tokens the indptr does not cover (nnz padded past
// append_indptr[batch], e.g. a CUDA graph's fixed size) and tokens whose position would be negative (a
// seq_lens[b] below the tokens appended to b, or negative) get batch index -1 and position -1, which
// paged_append_kv skips: a padding token never lands in a sequence's slot.
extern "C" __global__ void __launch_bounds__(PA_NT) paged_batch_indices_positions(
    const int* __restrict__ append_indptr, const int* __restrict__ seq_lens, int* __restrict__ batch_indices,
    int* __restrict__ positions, int batch, int nnz) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nnz) return;
    int b = -1, pos = -1;
    if (batch > 0 && t >= append_indptr[0] && t < append_indptr[batch]) {
        // the last b with append_indptr[b] <= t (empty sequences share their start with the next one)
        int lo = 0, hi = batch - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (append_indptr[mid] <= t) lo = mid; else hi = mid - 1;
        }
        const int p = seq_lens[lo] - (append_indptr[lo + 1] - t);
        if (p >= 0) b = lo, pos = p;
    }
    batch_indices[t] = b;
    positions[t] = pos;
}
