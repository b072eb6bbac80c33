// Serving attention (issue 13): paged KV cache (FlashInfer conventions), KV append,
// paged decode/prefill, varlen (flash-attn) prefill, split-KV merge.
//
// Paged cache, kv_layout 0 = "NHD": pages [num_pages, page_size, num_kv_heads, head_dim];
//                 kv_layout 1 = "HND": pages [num_pages, num_kv_heads, page_size, head_dim].
// A batch's pages in CSR form: sequence b owns pages kv_indices[kv_indptr[b] .. kv_indptr[b+1]),
// the last of which holds kv_last_page_len[b] tokens (clamped to [0, page_size] here),
// so its length is (n_pages - 1) * page_size + last_page_len (0 with no pages).
// Dense K/V ("dense_attn"): token t of sequence b, kv head h at
//   base + s_b*b + s_tok*(start_b + t) + s_head*h   (64-bit element offsets), with
//   k_mode 0: start_b = cu_k[b], len = cu_k[b+1] - cu_k[b]   (flash-attn varlen)
//   k_mode 1: start_b = 0, len = min(seq_lens[b], max_len)     (padded contiguous caches)
// Queries (and out): q_mode 0: one query per sequence, row b of q [batch, H, D] (decode);
//                    q_mode 1: rows qo_indptr[b] .. qo_indptr[b+1] of q [total_q, H, D].
// Query i of a sequence with qo_len queries and kv_len keys is the key position
// kv_len - qo_len + i: with causal != 0 it sees keys j <= kv_len - qo_len + i (bottom-right).
//
// One CTA handles (sequence b, kv head, a chunk of `rows` packed query rows, split s).
// A packed row is qi * G + g (query qi, head g of the GQA group of G = H / KVH heads), so
// every query head of the group, and for prefill several queries, share each K/V tile:
// a tile of `tile` positions is loaded from global memory and converted to fp32 once into
// shared memory, then all rows of the CTA use it (each K/V element is read once per kv
// head and row chunk; decode has one chunk while G * head_dim <= 2048).
// Split s of num_splits covers positions [s*per, (s+1)*per) with per = ceil(len / splits)
// rounded up to the tile; with num_splits > 1 the CTA writes a normalized partial output
// and its log2-domain lse to part_o [splits, total_q*H, D] / part_lse [splits, total_q*H],
// and paged_attn_merge combines them. Otherwise it writes out and (write_lse) the natural-log
// lse [total_q, H] directly. Rows that see no key get zeros and lse -inf.
//
// Scores are in the log2 domain (q pre-multiplied by scale * log2 e) so softmax uses exp2f.
#include "pk_common.cuh"

#define PA_NT 128          // threads per CTA (4 warps); kept in step with pykern/ops/serving.py
#define PA_MAX_ACC 16      // accumulators a thread: rows * head_dim <= PA_NT * PA_MAX_ACC = 2048
#define PA_LOG2E 1.4426950408889634f
#define PA_LN2 0.6931471805599453f

struct PaArgs {
    int num_qo_heads, num_kv_heads, head_dim, q_mode, causal, rows, tile, num_splits, total_q, write_lse;
    float scale;
};

// Paged addressing: the page of position pos is kv_indices[indptr[b] + pos / page_size].
struct PagedKV {
    const int* indptr; const int* indices; const int* last;
    int page_size;
    long long s_page, s_tok, s_head;
    long long pbeg, hoff;
    int len;
    __device__ __forceinline__ void init(int b, int kvh) {
        pbeg = indptr[b];
        const long long np = (long long)indptr[b + 1] - pbeg;
        int lst = last[b];
        lst = lst < 0 ? 0 : (lst > page_size ? page_size : lst);
        long long l = np > 0 ? (np - 1) * page_size + lst : 0;
        len = l > (1ll << 30) ? (1 << 30) : (int)l;  // the op bounds lengths well below this
        hoff = (long long)kvh * s_head;
    }
    __device__ __forceinline__ long long offset(int pos) const {
        const int pi = pos / page_size;
        const long long page = indices[pbeg + pi];
        return page * s_page + (long long)(pos - pi * page_size) * s_tok + hoff;
    }
};

// Contiguous addressing (varlen via cu_k, or a padded cache per sequence via seq_lens).
struct DenseKV {
    const int* cu; const unsigned int* lens;
    int mode, max_len;
    long long s_b, s_tok, s_head;
    long long base;
    int len;
    __device__ __forceinline__ void init(int b, int kvh) {
        if (mode == 0) {
            const int st = cu[b];
            const int l = cu[b + 1] - st;
            len = l < 0 ? 0 : l;
            base = (long long)st * s_tok;
        } else {
            const unsigned int l = lens[b];
            len = l > (unsigned int)max_len ? max_len : (int)l;
            base = (long long)b * s_b;
        }
        base += (long long)kvh * s_head;
    }
    __device__ __forceinline__ long long offset(int pos) const { return base + (long long)pos * s_tok; }
};

// VEC consecutive elements from p (aligned to VEC elements) widened to fp32.
template <typename T, int VEC> struct PaLoad;
template <> struct PaLoad<float, 1> {
    static __device__ __forceinline__ void run(const float* p, float* o) { o[0] = p[0]; }
};
template <> struct PaLoad<float, 4> {
    static __device__ __forceinline__ void run(const float* p, float* o) {
        const float4 x = *reinterpret_cast<const float4*>(p);
        o[0] = x.x; o[1] = x.y; o[2] = x.z; o[3] = x.w;
    }
};
template <> struct PaLoad<unsigned short, 1> {
    static __device__ __forceinline__ void run(const unsigned short* p, float* o) { o[0] = pk_bf16_to_float(p[0]); }
};
template <> struct PaLoad<unsigned short, 8> {
    static __device__ __forceinline__ void run(const unsigned short* p, float* o) {
        const uint4 x = *reinterpret_cast<const uint4*>(p);
        const unsigned int w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            o[2 * i] = __int_as_float((int)(w[i] << 16));
            o[2 * i + 1] = __int_as_float((int)(w[i] & 0xffff0000u));
        }
    }
};
template <typename T> struct PaVec;
template <> struct PaVec<float> { static constexpr int V = 4; };
template <> struct PaVec<unsigned short> { static constexpr int V = 8; };

// K rows [t0, t0 + T) into Ks (row stride D + 1: the score loop's lanes walk rows
// without bank conflicts), V rows into Vs (stride D); positions >= end become 0.
template <typename TKV, int VEC, typename KV>
__device__ __forceinline__ void pa_load_tile(const TKV* __restrict__ kp, const TKV* __restrict__ vp, const KV& kv,
                                             int t0, int end, int T, int D, float* Ks, float* Vs) {
    const int nvec = D / VEC;
    const int total = T * nvec;
#pragma unroll 4
    for (int i = threadIdx.x; i < total; i += PA_NT) {
        const int t = i / nvec, c = i - t * nvec;
        const int pos = t0 + t;
        float kf[VEC], vf[VEC];
        if (pos < end) {
            const long long o = kv.offset(pos) + (long long)c * VEC;
            PaLoad<TKV, VEC>::run(kp + o, kf);
            PaLoad<TKV, VEC>::run(vp + o, vf);
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) { kf[e] = 0.0f; vf[e] = 0.0f; }
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            Ks[t * (D + 1) + c * VEC + e] = kf[e];
            Vs[t * D + c * VEC + e] = vf[e];
        }
    }
}

template <typename TQ, typename TKV, typename KV>
__device__ __forceinline__ void pa_body(const TQ* __restrict__ q, const TKV* __restrict__ kp,
                                        const TKV* __restrict__ vp, TQ* __restrict__ out, float* __restrict__ lse,
                                        float* __restrict__ part_o, float* __restrict__ part_lse,
                                        const int* __restrict__ qo_indptr, KV& kv, const PaArgs& a, float* smem) {
    const int H = a.num_qo_heads, NKV = a.num_kv_heads, D = a.head_dim, R = a.rows, T = a.tile;
    const int G = H / NKV;
    const int b = blockIdx.x / NKV, kvh = blockIdx.x - b * NKV;
    const int split = blockIdx.z;
    int qo_start = b, qo_len = 1;
    if (a.q_mode == 1) {
        qo_start = qo_indptr[b];
        qo_len = qo_indptr[b + 1] - qo_start;
    }
    const long long packed = (long long)qo_len * G;
    const long long row0 = (long long)blockIdx.y * R;
    if (row0 >= packed) return;  // CTA-uniform: before any barrier
    const int nrows = packed - row0 < R ? (int)(packed - row0) : R;
    kv.init(b, kvh);
    const int L = kv.len;
    int begin = 0, end = L;
    if (a.num_splits > 1) {
        long long per = ((long long)L + a.num_splits - 1) / a.num_splits;
        per = (per + T - 1) / T * T;
        const long long bg = per * split;
        begin = bg < L ? (int)bg : L;
        end = (long long)L - begin > per ? begin + (int)per : L;
    }
    // Causal: the CTA's last row sees positions < L - qo_len + qi_last + 1; skip tiles past it.
    const long long diag = (long long)L - qo_len;  // query qi sees j <= diag + qi
    if (a.causal) {
        const long long vis = diag + (row0 + nrows - 1) / G + 1;
        if (vis < end) end = vis < begin ? begin : (int)vis;
    }

    float* Ks = smem;
    float* Vs = Ks + T * (D + 1);
    float* Qs = Vs + T * D;
    float* Ss = Qs + R * D;
    float* Ms = Ss + R * T;
    float* Ls = Ms + R;
    float* Cs = Ls + R;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float qscale = a.scale * PA_LOG2E;
    for (int i = tid; i < R * D; i += PA_NT) {
        const int r = i / D, d = i - r * D;
        float x = 0.0f;
        if (r < nrows) {
            const long long gr = row0 + r;
            const long long qi = gr / G;
            const int h = kvh * G + (int)(gr - qi * G);
            x = PkIO<TQ>::load(q, ((qo_start + qi) * H + h) * D + d) * qscale;
        }
        Qs[i] = x;
    }
    if (tid < R) {
        Ms[tid] = PK_NEG_INF;
        Ls[tid] = 0.0f;
        Cs[tid] = 1.0f;
    }
    float acc[PA_MAX_ACC];
#pragma unroll
    for (int k = 0; k < PA_MAX_ACC; ++k) acc[k] = 0.0f;
    const int nout = nrows * D;
    constexpr int VEC = PaVec<TKV>::V;
    const bool vec_ok = D % VEC == 0 && (((unsigned long long)kp | (unsigned long long)vp) & 15ull) == 0;
    __syncthreads();

    for (int t0 = begin; t0 < end; t0 += T) {
        if (vec_ok)
            pa_load_tile<TKV, VEC>(kp, vp, kv, t0, end, T, D, Ks, Vs);
        else
            pa_load_tile<TKV, 1>(kp, vp, kv, t0, end, T, D, Ks, Vs);
        __syncthreads();
        // Scores: thread pairs (r, t), consecutive lanes on consecutive positions.
        for (int i = tid; i < R * T; i += PA_NT) {
            const int r = i / T, t = i - r * T;
            const int pos = t0 + t;
            float s = PK_NEG_INF;
            if (r < nrows && pos < end && (!a.causal || pos <= diag + (row0 + r) / G)) {
                const float* qr = Qs + r * D;
                const float* kr = Ks + t * (D + 1);
                float d0 = 0.0f, d1 = 0.0f;
                int d = 0;
                for (; d + 1 < D; d += 2) {
                    d0 = fmaf(qr[d], kr[d], d0);
                    d1 = fmaf(qr[d + 1], kr[d + 1], d1);
                }
                if (d < D) d0 = fmaf(qr[d], kr[d], d0);
                s = d0 + d1;
            }
            Ss[i] = s;
        }
        __syncthreads();
        // Online softmax: one warp per row (loop bounds are warp-uniform).
        for (int r = warp; r < nrows; r += PA_NT / 32) {
            float* sr = Ss + r * T;
            float mt = PK_NEG_INF;
            for (int t = lane; t < T; t += 32) mt = fmaxf(mt, sr[t]);
            mt = pk_warp_max(mt);
            const float mo = Ms[r];
            const float mn = fmaxf(mo, mt);
            float sum = 0.0f, corr = 1.0f;
            if (mn == PK_NEG_INF) {  // nothing visible yet: exp2f(-inf - -inf) would be NaN
                for (int t = lane; t < T; t += 32) sr[t] = 0.0f;
            } else {
                corr = exp2f(mo - mn);
                for (int t = lane; t < T; t += 32) {
                    const float p = exp2f(sr[t] - mn);
                    sr[t] = p;
                    sum += p;
                }
            }
            sum = pk_warp_sum(sum);
            if (lane == 0) {
                Ls[r] = Ls[r] * corr + sum;
                Ms[r] = mn;
                Cs[r] = corr;
            }
        }
        __syncthreads();
        // P V: thread owns outputs (r, d) = tid + k * PA_NT; consecutive lanes, consecutive d.
#pragma unroll
        for (int k = 0; k < PA_MAX_ACC; ++k) {
            const int i = tid + k * PA_NT;
            if (i < nout) {
                const int r = i / D, d = i - r * D;
                const float* pr = Ss + r * T;
                const float* vc = Vs + d;
                float x = acc[k] * Cs[r];
                for (int t = 0; t < T; ++t) x = fmaf(pr[t], vc[t * D], x);
                acc[k] = x;
            }
        }
        __syncthreads();  // the next tile overwrites Ks, Vs and Ss
    }

    const long long rows_total = (long long)a.total_q * H;
#pragma unroll
    for (int k = 0; k < PA_MAX_ACC; ++k) {
        const int i = tid + k * PA_NT;
        if (i < nout) {
            const int r = i / D, d = i - r * D;
            const long long gr = row0 + r;
            const long long qi = gr / G;
            const int h = kvh * G + (int)(gr - qi * G);
            const long long orow = (qo_start + qi) * H + h;
            const float l = Ls[r];
            const float o = l > 0.0f ? acc[k] / l : 0.0f;
            const float lse2 = l > 0.0f ? Ms[r] + __log2f(l) : PK_NEG_INF;
            if (a.num_splits > 1) {
                const long long slot = (long long)split * rows_total + orow;
                part_o[slot * D + d] = o;
                if (d == 0) part_lse[slot] = lse2;
            } else {
                PkIO<TQ>::store(out, orow * D + d, o);
                if (a.write_lse && d == 0) lse[orow] = lse2 == PK_NEG_INF ? lse2 : lse2 * PA_LN2;
            }
        }
    }
}

__device__ __forceinline__ PagedKV pa_paged_kv(const int* indptr, const int* indices, const int* last,
                                               int num_kv_heads, int head_dim, int page_size, int kv_layout) {
    PagedKV kv;
    kv.indptr = indptr;
    kv.indices = indices;
    kv.last = last;
    kv.page_size = page_size;
    const long long hd = head_dim;
    kv.s_page = (long long)page_size * num_kv_heads * hd;
    kv.s_tok = kv_layout == 0 ? num_kv_heads * hd : hd;
    kv.s_head = kv_layout == 0 ? hd : (long long)page_size * hd;
    return kv;
}

__device__ __forceinline__ DenseKV pa_dense_kv(const int* cu, const unsigned int* lens, int mode, int max_len,
                                               long long s_b, long long s_tok, long long s_head) {
    DenseKV kv;
    kv.cu = cu;
    kv.lens = lens;
    kv.mode = mode;
    kv.max_len = max_len;
    kv.s_b = s_b;
    kv.s_tok = s_tok;
    kv.s_head = s_head;
    return kv;
}

// Entry points. Suffixes: none = f32 q/out and f32 K/V; _bf16 = bf16 everywhere;
// _bf16kv = f32 q/out over bf16 K/V. Dynamic shared memory (floats):
// tile*(2*head_dim+1) + rows*head_dim + rows*tile + 3*rows (pykern/ops/serving.py).
extern "C" __global__ void __launch_bounds__(PA_NT) paged_attn(const float* __restrict__ q,
        const float* __restrict__ k_pages, const float* __restrict__ v_pages, float* __restrict__ out,
        float* __restrict__ lse, float* __restrict__ part_o, float* __restrict__ part_lse,
        const int* __restrict__ qo_indptr, const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
        const int* __restrict__ kv_last_page_len, int num_qo_heads, int num_kv_heads, int head_dim, int page_size,
        int kv_layout, int q_mode, int causal, int rows, int tile, int num_splits, int total_q, int write_lse,
        float scale) {
    extern __shared__ float smem[];
    PagedKV kv = pa_paged_kv(kv_indptr, kv_indices, kv_last_page_len, num_kv_heads, head_dim, page_size, kv_layout);
    PaArgs a = {num_qo_heads, num_kv_heads, head_dim, q_mode, causal, rows, tile, num_splits, total_q, write_lse, scale};
    pa_body<float, float, PagedKV>(q, k_pages, v_pages, out, lse, part_o, part_lse, qo_indptr, kv, a, smem);
}

extern "C" __global__ void __launch_bounds__(PA_NT) paged_attn_bf16(const unsigned short* __restrict__ q,
        const unsigned short* __restrict__ k_pages, const unsigned short* __restrict__ v_pages, unsigned short* __restrict__ out,
        float* __restrict__ lse, float* __restrict__ part_o, float* __restrict__ part_lse,
        const int* __restrict__ qo_indptr, const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
        const int* __restrict__ kv_last_page_len, int num_qo_heads, int num_kv_heads, int head_dim, int page_size,
        int kv_layout, int q_mode, int causal, int rows, int tile, int num_splits, int total_q, int write_lse,
        float scale) {
    extern __shared__ float smem[];
    PagedKV kv = pa_paged_kv(kv_indptr, kv_indices, kv_last_page_len, num_kv_heads, head_dim, page_size, kv_layout);
    PaArgs a = {num_qo_heads, num_kv_heads, head_dim, q_mode, causal, rows, tile, num_splits, total_q, write_lse, scale};
    pa_body<unsigned short, unsigned short, PagedKV>(q, k_pages, v_pages, out, lse, part_o, part_lse, qo_indptr, kv, a, smem);
}

extern "C" __global__ void __launch_bounds__(PA_NT) paged_attn_bf16kv(const float* __restrict__ q,
        const unsigned short* __restrict__ k_pages, const unsigned short* __restrict__ v_pages, float* __restrict__ out,
        float* __restrict__ lse, float* __restrict__ part_o, float* __restrict__ part_lse,
        const int* __restrict__ qo_indptr, const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
        const int* __restrict__ kv_last_page_len, int num_qo_heads, int num_kv_heads, int head_dim, int page_size,
        int kv_layout, int q_mode, int causal, int rows, int tile, int num_splits, int total_q, int write_lse,
        float scale) {
    extern __shared__ float smem[];
    PagedKV kv = pa_paged_kv(kv_indptr, kv_indices, kv_last_page_len, num_kv_heads, head_dim, page_size, kv_layout);
    PaArgs a = {num_qo_heads, num_kv_heads, head_dim, q_mode, causal, rows, tile, num_splits, total_q, write_lse, scale};
    pa_body<float, unsigned short, PagedKV>(q, k_pages, v_pages, out, lse, part_o, part_lse, qo_indptr, kv, a, smem);
}

extern "C" __global__ void __launch_bounds__(PA_NT) dense_attn(const float* __restrict__ q,
        const float* __restrict__ k, const float* __restrict__ v, float* __restrict__ out, float* __restrict__ lse,
        float* __restrict__ part_o, float* __restrict__ part_lse, const int* __restrict__ cu_seqlens_q,
        const int* __restrict__ cu_seqlens_k, const unsigned int* __restrict__ seq_lens, int num_qo_heads,
        int num_kv_heads, int head_dim, long long s_b, long long s_tok, long long s_head, int max_len, int q_mode,
        int k_mode, int causal, int rows, int tile, int num_splits, int total_q, int write_lse, float scale) {
    extern __shared__ float smem[];
    DenseKV kv = pa_dense_kv(cu_seqlens_k, seq_lens, k_mode, max_len, s_b, s_tok, s_head);
    PaArgs a = {num_qo_heads, num_kv_heads, head_dim, q_mode, causal, rows, tile, num_splits, total_q, write_lse, scale};
    pa_body<float, float, DenseKV>(q, k, v, out, lse, part_o, part_lse, cu_seqlens_q, kv, a, smem);
}

extern "C" __global__ void __launch_bounds__(PA_NT) dense_attn_bf16(const unsigned short* __restrict__ q,
        const unsigned short* __restrict__ k, const unsigned short* __restrict__ v, unsigned short* __restrict__ out, float* __restrict__ lse,
        float* __restrict__ part_o, float* __restrict__ part_lse, const int* __restrict__ cu_seqlens_q,
        const int* __restrict__ cu_seqlens_k, const unsigned int* __restrict__ seq_lens, int num_qo_heads,
        int num_kv_heads, int head_dim, long long s_b, long long s_tok, long long s_head, int max_len, int q_mode,
        int k_mode, int causal, int rows, int tile, int num_splits, int total_q, int write_lse, float scale) {
    extern __shared__ float smem[];
    DenseKV kv = pa_dense_kv(cu_seqlens_k, seq_lens, k_mode, max_len, s_b, s_tok, s_head);
    PaArgs a = {num_qo_heads, num_kv_heads, head_dim, q_mode, causal, rows, tile, num_splits, total_q, write_lse, scale};
    pa_body<unsigned short, unsigned short, DenseKV>(q, k, v, out, lse, part_o, part_lse, cu_seqlens_q, kv, a, smem);
}

extern "C" __global__ void __launch_bounds__(PA_NT) dense_attn_bf16kv(const float* __restrict__ q,
        const unsigned short* __restrict__ k, const unsigned short* __restrict__ v, float* __restrict__ out, float* __restrict__ lse,
        float* __restrict__ part_o, float* __restrict__ part_lse, const int* __restrict__ cu_seqlens_q,
        const int* __restrict__ cu_seqlens_k, const unsigned int* __restrict__ seq_lens, int num_qo_heads,
        int num_kv_heads, int head_dim, long long s_b, long long s_tok, long long s_head, int max_len, int q_mode,
        int k_mode, int causal, int rows, int tile, int num_splits, int total_q, int write_lse, float scale) {
    extern __shared__ float smem[];
    DenseKV kv = pa_dense_kv(cu_seqlens_k, seq_lens, k_mode, max_len, s_b, s_tok, s_head);
    PaArgs a = {num_qo_heads, num_kv_heads, head_dim, q_mode, causal, rows, tile, num_splits, total_q, write_lse, scale};
    pa_body<float, unsigned short, DenseKV>(q, k, v, out, lse, part_o, part_lse, cu_seqlens_q, kv, a, smem);
}

// ---------------------------------------------------------------------------
// Merge of split-KV partials: one warp per output row (total_rows = total_q * H),
// out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), lse = (M + log2 sum) * ln 2.
// Splits that saw no key (lse -inf) weigh 0; a row no split saw gets zeros, lse -inf.
template <typename TO>
__device__ __forceinline__ void pa_merge(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                         TO* __restrict__ out, float* __restrict__ lse, long long total_rows,
                                         int head_dim, int num_splits, int write_lse) {
    const long long row = (long long)blockIdx.x * (PA_NT / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= total_rows) return;
    float M = PK_NEG_INF;
    for (int s = 0; s < num_splits; ++s) M = fmaxf(M, part_lse[s * total_rows + row]);
    float W = 0.0f;
    if (M != PK_NEG_INF)
        for (int s = 0; s < num_splits; ++s) W += exp2f(part_lse[s * total_rows + row] - M);
    for (int d = lane; d < head_dim; d += 32) {
        float o = 0.0f;
        if (M != PK_NEG_INF) {
            for (int s = 0; s < num_splits; ++s) {
                const float ls = part_lse[s * total_rows + row];
                if (ls != PK_NEG_INF) o = fmaf(exp2f(ls - M), part_o[(s * total_rows + row) * head_dim + d], o);
            }
            o /= W;
        }
        PkIO<TO>::store(out, row * head_dim + d, o);
    }
    if (write_lse && lane == 0) lse[row] = M == PK_NEG_INF ? M : (M + __log2f(W)) * PA_LN2;
}

extern "C" __global__ void __launch_bounds__(PA_NT) paged_attn_merge(const float* __restrict__ part_o,
        const float* __restrict__ part_lse, float* __restrict__ out, float* __restrict__ lse, long long total_rows,
        int head_dim, int num_splits, int write_lse) {
    pa_merge<float>(part_o, part_lse, out, lse, total_rows, head_dim, num_splits, write_lse);
}

extern "C" __global__ void __launch_bounds__(PA_NT) paged_attn_merge_bf16(const float* __restrict__ part_o,
        const float* __restrict__ part_lse, unsigned short* __restrict__ out, float* __restrict__ lse,
        long long total_rows, int head_dim, int num_splits, int write_lse) {
    pa_merge<unsigned short>(part_o, part_lse, out, lse, total_rows, head_dim, num_splits, write_lse);
}

// ---------------------------------------------------------------------------
// KV append: token t of k, v [nnz, num_kv_heads, head_dim] goes to position
// positions[t] of sequence batch_indices[t], i.e. slot positions[t] % page_size of
// page kv_indices[kv_indptr[b] + positions[t] / page_size]. One block per token.
// A token whose sequence or page is out of range is skipped (the op checks host arrays).
template <typename T>
__device__ __forceinline__ void pa_append(const T* __restrict__ k, const T* __restrict__ v,
                                          const int* __restrict__ batch_indices, const int* __restrict__ positions,
                                          T* __restrict__ k_pages, T* __restrict__ v_pages,
                                          const int* __restrict__ kv_indices, const int* __restrict__ kv_indptr,
                                          int batch, int num_kv_heads, int head_dim, int page_size, int kv_layout) {
    const long long t = blockIdx.x;
    const int b = batch_indices[t];
    const int pos = positions[t];
    if (b < 0 || b >= batch || pos < 0) return;
    const int pi = pos / page_size;
    const long long slot = (long long)kv_indptr[b] + pi;
    if (slot >= kv_indptr[b + 1]) return;
    const long long page = kv_indices[slot];
    const int in_page = pos - pi * page_size;
    const long long hd = head_dim;
    const long long n = (long long)num_kv_heads * hd;
    const long long base = page * page_size * n;
    for (long long e = threadIdx.x; e < n; e += blockDim.x) {
        const long long h = e / hd, d = e - h * hd;
        const long long dst = kv_layout == 0 ? base + in_page * n + e : base + (h * page_size + in_page) * hd + d;
        k_pages[dst] = k[t * n + e];
        v_pages[dst] = v[t * n + e];
    }
}

extern "C" __global__ void __launch_bounds__(PA_NT) paged_append_kv(const float* __restrict__ k,
        const float* __restrict__ v, const int* __restrict__ batch_indices, const int* __restrict__ positions,
        float* __restrict__ k_pages, float* __restrict__ v_pages, const int* __restrict__ kv_indices,
        const int* __restrict__ kv_indptr, int batch, int num_kv_heads, int head_dim, int page_size, int kv_layout) {
    pa_append<float>(k, v, batch_indices, positions, k_pages, v_pages, kv_indices, kv_indptr, batch, num_kv_heads,
                     head_dim, page_size, kv_layout);
}

extern "C" __global__ void __launch_bounds__(PA_NT) paged_append_kv_bf16(const unsigned short* __restrict__ k,
        const unsigned short* __restrict__ v, const int* __restrict__ batch_indices, const int* __restrict__ positions,
        unsigned short* __restrict__ k_pages, unsigned short* __restrict__ v_pages, const int* __restrict__ kv_indices,
        const int* __restrict__ kv_indptr, int batch, int num_kv_heads, int head_dim, int page_size, int kv_layout) {
    pa_append<unsigned short>(k, v, batch_indices, positions, k_pages, v_pages, kv_indices, kv_indptr, batch,
                              num_kv_heads, head_dim, page_size, kv_layout);
}
