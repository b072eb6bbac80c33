// Shared tile attention core of kernels_cu/paged.cu (decode and serving attention).
// See paged.cu for the conventions. One CTA (blockDim.x threads, a multiple of 32) handles
// (sequence, kv head, chunk of packed query rows, split); the caller picks rows so that
// rows * head_dim <= PA_MAX_ACC * blockDim.x.
#pragma once
#include "pk_common.cuh"
#include "pk_vec.cuh"


#define PA_MAX_ACC 16  // accumulators a thread: rows * head_dim <= PA_MAX_ACC * blockDim.x
#define PA_LOG2E 1.4426950408889634f
#define PA_LN2 0.6931471805599453f

struct PaArgs {
    // window_left / window_right in [0, 2^30] (the op maps unbounded to 2^30 and causal to window_right 0):
    // query qi sees positions diag + qi - window_left .. diag + qi + window_right.
    int num_qo_heads, num_kv_heads, head_dim, q_mode, window_left, window_right, rows, tile, num_splits, total_q,
        write_lse;
    float scale;
    float softcap;  // > 0: scores c * tanh(scale * q.k / c)
    int chunk;    // > 0: split s covers [s*chunk, (s+1)*chunk) instead of an even split
    int partial;  // write normalized partials (part_o, log2 part_lse) instead of out / lse
    // K and V are k_scale * K, v_scale * V (FP8 caches; 1 otherwise): k_scale joins q's scale,
    // v_scale the final normalization, so the dequantization costs nothing per element.
    float k_scale, v_scale;
};

// FP8 cache elements: PkE4M3 / PkE5M2 (pk_common.cuh, beside the instantiation macros that name them).

// Paged addressing: the page of position pos is kv_indices[indptr[b] + pos / page_size].
// Element strides of (page, token, kv head), 64-bit: any view whose head_dim is unit-stride,
// e.g. FlashInfer's combined cache (pages, 2, ...)[:, 0] (page stride twice the page's size).
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
    __device__ __forceinline__ bool aligned(int vec) const { return ((s_page | s_tok | s_head) % vec) == 0; }
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
    __device__ __forceinline__ bool aligned(int vec) const { return ((s_b | s_tok | s_head) % vec) == 0; }
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
// The 16-bit floats (__nv_bfloat16, __half; Pk16<T> in pk_common.cuh): 8 elements a 16-byte load.
template <typename T> struct PaLoad<T, 1> {
    static __device__ __forceinline__ void run(const T* p, float* o) {
        o[0] = Pk16<T>::widen(reinterpret_cast<const unsigned short*>(p)[0]);
    }
};
template <typename T> struct PaLoad<T, 8> {
    static __device__ __forceinline__ void run(const T* p, float* o) {
        const uint4 x = *reinterpret_cast<const uint4*>(p);
        const unsigned int w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) Pk16<T>::widen2(w[i], o[2 * i], o[2 * i + 1]);
    }
};
// FP8: 16 elements a 16-byte load, widened two at a time (cvt.rn.f16x2.<fp8>x2 on sm_89+).
template <int EB> struct PaFp8Cvt;
template <> struct PaFp8Cvt<4> {
    static __device__ __forceinline__ void x2(unsigned short v, float& lo, float& hi) { pk_cvt_f32x2_e4m3x2(v, lo, hi); }
    static __device__ __forceinline__ float x1(unsigned char v) { return pk_fp8_sw_to_f32<4, 3>(v); }
};
template <> struct PaFp8Cvt<5> {
    static __device__ __forceinline__ void x2(unsigned short v, float& lo, float& hi) { pk_cvt_f32x2_e5m2x2(v, lo, hi); }
    static __device__ __forceinline__ float x1(unsigned char v) { return pk_fp8_sw_to_f32<5, 2>(v); }
};
template <typename T> struct PaFp8Bits;
template <> struct PaFp8Bits<PkE4M3> { static constexpr int EB = 4; };
template <> struct PaFp8Bits<PkE5M2> { static constexpr int EB = 5; };
template <typename T> struct PaLoadFp8 {
    static __device__ __forceinline__ void run1(const T* p, float* o) { o[0] = PaFp8Cvt<PaFp8Bits<T>::EB>::x1(p->b); }
    static __device__ __forceinline__ void run16(const T* p, float* o) {
        const uint4 x = *reinterpret_cast<const uint4*>(p);
        const unsigned int w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            PaFp8Cvt<PaFp8Bits<T>::EB>::x2((unsigned short)(w[i] & 0xffffu), o[4 * i], o[4 * i + 1]);
            PaFp8Cvt<PaFp8Bits<T>::EB>::x2((unsigned short)(w[i] >> 16), o[4 * i + 2], o[4 * i + 3]);
        }
    }
};
template <> struct PaLoad<PkE4M3, 1> {
    static __device__ __forceinline__ void run(const PkE4M3* p, float* o) { PaLoadFp8<PkE4M3>::run1(p, o); }
};
template <> struct PaLoad<PkE4M3, 16> {
    static __device__ __forceinline__ void run(const PkE4M3* p, float* o) { PaLoadFp8<PkE4M3>::run16(p, o); }
};
template <> struct PaLoad<PkE5M2, 1> {
    static __device__ __forceinline__ void run(const PkE5M2* p, float* o) { PaLoadFp8<PkE5M2>::run1(p, o); }
};
template <> struct PaLoad<PkE5M2, 16> {
    static __device__ __forceinline__ void run(const PkE5M2* p, float* o) { PaLoadFp8<PkE5M2>::run16(p, o); }
};

template <typename T> struct PaVec { static constexpr int V = 16 / (int)sizeof(T); };  // one 16-byte load

// K/V stay in their cache type in shared memory (bf16 stays bf16, fp8 stays fp8) and are widened
// to fp32 when read into registers. A ring of PA_STAGES slots, each K then V: T rows of PA_RS(D)
// bytes, the row padded by 16 bytes so that the score loop's 16-byte reads (a quarter warp on 8
// consecutive rows) hit 8 disjoint 4-bank groups. The host sizes it (pykern/ops/serving.py _smem_bytes).
#define PA_STAGES 2
__host__ __device__ __forceinline__ int pa_row_bytes(int d, int eb) { return ((d * eb + 15) / 16) * 16 + 16; }

// One element of a shared-memory row, widened.
template <typename T> struct PaElem {  // the 16-bit floats
    static __device__ __forceinline__ float get(const unsigned char* r, int d) {
        return Pk16<T>::widen(reinterpret_cast<const unsigned short*>(r)[d]);
    }
};
template <> struct PaElem<float> {
    static __device__ __forceinline__ float get(const unsigned char* r, int d) { return reinterpret_cast<const float*>(r)[d]; }
};
// FP8: the pair conversion with a zero high byte (one cvt on sm_89+; the software x1 path cost ~20
// instructions an element in the P V loop, measured in the SASS).
template <int EB> struct PaElemFp8 {
    static __device__ __forceinline__ float get(const unsigned char* r, int d) {
        float lo, hi;
        PaFp8Cvt<EB>::x2((unsigned short)r[d], lo, hi);
        return lo;
    }
};
template <> struct PaElem<PkE4M3> : PaElemFp8<4> {};
template <> struct PaElem<PkE5M2> : PaElemFp8<5> {};

// K/V rows [t0, t0 + T) into ring slot (Kst, Vst); positions >= end become 0 (P is 0 there, but
// 0 * NaN garbage would not be). ASYNC: 16-byte cp.async (the caller checked 16-byte aligned rows,
// strides and bases; the data lands at the wait covering the caller's commit). Otherwise an
// element copy (unaligned views, head_dim * element bytes not a multiple of 16).
template <typename TKV, bool ASYNC, typename KV>
__device__ __forceinline__ void pa_fill(const TKV* __restrict__ kp, const TKV* __restrict__ vp, const KV& kv, int t0,
                                        int end, int T, int D, int RS, unsigned char* Kst, unsigned char* Vst) {
    if (ASYNC) {
        const int nch = (D * (int)sizeof(TKV)) >> 4;
        const int total = T * nch;
        for (int i = threadIdx.x; i < total; i += (int)blockDim.x) {
            const int t = i / nch, c = i - t * nch;
            const int pos = t0 + t;
            const unsigned int off = (unsigned int)(t * RS + c * 16);
            if (pos < end) {
                const long long o = kv.offset(pos);
                pk_cp_async_16_at(Kst, off, reinterpret_cast<const char*>(kp + o) + c * 16);
                pk_cp_async_16_at(Vst, off, reinterpret_cast<const char*>(vp + o) + c * 16);
            } else {
                *reinterpret_cast<uint4*>(Kst + off) = make_uint4(0u, 0u, 0u, 0u);
                *reinterpret_cast<uint4*>(Vst + off) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    } else {
        const int total = T * D;
        for (int i = threadIdx.x; i < total; i += (int)blockDim.x) {
            const int t = i / D, d = i - t * D;
            const int pos = t0 + t;
            TKV* kr = reinterpret_cast<TKV*>(Kst + t * RS);
            TKV* vr = reinterpret_cast<TKV*>(Vst + t * RS);
            if (pos < end) {
                const long long o = kv.offset(pos) + d;
                kr[d] = kp[o];
                vr[d] = vp[o];
            } else {
                const TKV z{};
                kr[d] = z;
                vr[d] = z;
            }
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
    // 32-bit row arithmetic (64-bit division is a slow subroutine call): blockIdx.y <= 65535, R <= 64.
    const int row0 = (int)blockIdx.y * R;
    if (row0 >= packed) return;  // CTA-uniform: before any barrier
    const int nrows = packed - row0 < R ? (int)(packed - row0) : R;
    kv.init(b, kvh);
    const int L = kv.len;
    // The window: query qi sees [diag + qi - wl, diag + qi + wr]. The CTA reads only positions some of
    // its rows see, [begin, end): the cost follows the window; splits divide that range.
    const long long diag = (long long)L - qo_len;
    const long long vlo = diag + row0 / G - a.window_left;                    // 32-bit divisions
    const long long vhi = diag + (row0 + nrows - 1) / G + a.window_right + 1;
    int begin = vlo < 0 ? 0 : (vlo > L ? L : (int)vlo);
    int end = vhi < begin ? begin : (vhi > L ? L : (int)vhi);
    if (a.num_splits > 1 || a.chunk > 0) {
        const int span = end - begin;
        int per = a.chunk;
        if (per <= 0) {
            per = span / a.num_splits + (span % a.num_splits != 0);
            per = (per / T + (per % T != 0)) * T;
        }
        const long long bg = (long long)per * split;
        const int b0 = begin;
        begin = bg < span ? b0 + (int)bg : end;
        end = end - begin > per ? begin + per : end;
    }

    const int RS = pa_row_bytes(D, (int)sizeof(TKV));
    unsigned char* ring = reinterpret_cast<unsigned char*>(smem);
    const int slot_bytes = 2 * T * RS;  // K rows then V rows
    float* Qs = reinterpret_cast<float*>(ring + PA_STAGES * slot_bytes);
    float* Ss = Qs + R * D;
    float* Ms = Ss + R * T;
    float* Ls = Ms + R;
    float* Cs = Ls + R;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Base-2 scores: q carries scale * log2 e; with a softcap, scale / c, and the score is tanh(.) * c * log2 e.
    const bool capped = a.softcap > 0.0f;
    const float qscale = (capped ? a.scale / a.softcap : a.scale * PA_LOG2E) * a.k_scale;
    const float post = a.softcap * PA_LOG2E;
    for (int i = tid; i < R * D; i += (int)blockDim.x) {
        const int r = i / D, d = i - r * D;
        float x = 0.0f;
        if (r < nrows) {
            const int gr = row0 + r;
            const int qi = gr / G;
            const int h = kvh * G + (int)(gr - qi * G);
            x = PkIO<TQ>::load(q, ((long long)(qo_start + qi) * H + h) * D + d) * qscale;
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
    const bool dvec = D % VEC == 0;  // rows are whole 16-byte chunks (shared rows are 16-byte aligned)
    const bool vec_ok = dvec && kv.aligned(VEC) && (((unsigned long long)kp | (unsigned long long)vp) & 15ull) == 0;
    __syncthreads();

    // The ring: tile it + 1 streams in (cp.async) while tile it is computed. Every thread commits
    // one group an iteration (empty past the end) so wait<1> always means "tile it has landed".
    if (begin < end) {
        if (vec_ok) pa_fill<TKV, true>(kp, vp, kv, begin, end, T, D, RS, ring, ring + T * RS);
        else pa_fill<TKV, false>(kp, vp, kv, begin, end, T, D, RS, ring, ring + T * RS);
    }
    pk_cp_async_commit();
    int stage = 0;
    for (int t0 = begin; t0 < end; t0 += T) {
        const int nt0 = t0 + T;
        const int nstage = stage + 1 == PA_STAGES ? 0 : stage + 1;
        // Slot nstage was last read in the previous iteration, before its closing barrier.
        if (nt0 < end) {
            unsigned char* nk = ring + nstage * slot_bytes;
            if (vec_ok) pa_fill<TKV, true>(kp, vp, kv, nt0, end, T, D, RS, nk, nk + T * RS);
            else pa_fill<TKV, false>(kp, vp, kv, nt0, end, T, D, RS, nk, nk + T * RS);
        }
        pk_cp_async_commit();
        pk_cp_async_wait<1>();
        __syncthreads();
        const unsigned char* Ks = ring + stage * slot_bytes;
        const unsigned char* Vs = Ks + T * RS;
        stage = nstage;
        // Scores: thread pairs (r, t), consecutive lanes on consecutive positions.
        for (int i = tid; i < R * T; i += (int)blockDim.x) {
            const int r = i / T, t = i - r * T;
            const int pos = t0 + t;
            float s = PK_NEG_INF;
            const long long c = diag + (row0 + r) / G;
            if (r < nrows && pos < end && pos >= c - a.window_left && pos <= c + a.window_right) {
                const float* qr = Qs + r * D;
                const unsigned char* kr = Ks + t * RS;
                float d0 = 0.0f, d1 = 0.0f;
                if (dvec) {  // 16-byte reads of the row, widened in registers
                    for (int d = 0; d < D; d += VEC) {
                        float kf[VEC];
                        PaLoad<TKV, VEC>::run(reinterpret_cast<const TKV*>(kr) + d, kf);
#pragma unroll
                        for (int e = 0; e < VEC; e += 2) {
                            d0 = fmaf(qr[d + e], kf[e], d0);
                            d1 = fmaf(qr[d + e + 1], kf[e + 1], d1);
                        }
                    }
                } else {
                    for (int d = 0; d < D; ++d) d0 = fmaf(qr[d], PaElem<TKV>::get(kr, d), d0);
                }
                s = d0 + d1;
                if (capped) s = tanhf(s) * post;
            }
            Ss[i] = s;
        }
        __syncthreads();
        // Online softmax: one warp per row (loop bounds are warp-uniform).
        for (int r = warp; r < nrows; r += (int)(blockDim.x >> 5)) {
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
        // P V: thread owns outputs (r, d) = tid + k * (int)blockDim.x; consecutive lanes, consecutive d.
#pragma unroll
        for (int k = 0; k < PA_MAX_ACC; ++k) {
            const int i = tid + k * (int)blockDim.x;
            if (i < nout) {
                const int r = i / D, d = i - r * D;
                const float* pr = Ss + r * T;
                float x = acc[k] * Cs[r];
                for (int t = 0; t < T; ++t) x = fmaf(pr[t], PaElem<TKV>::get(Vs + t * RS, d), x);
                acc[k] = x;
            }
        }
        __syncthreads();  // the next iteration refills this slot's neighbour and Ss: all reads of them are done
    }
    pk_cp_async_wait<0>();  // nothing is left in flight (the last groups are empty)

    // One reciprocal a row, with the fast intrinsic (2 ulp): IEEE division is a call to a
    // slow-path subroutine whose call ABI costs spills. Cs is free after the loop's barrier.
    for (int r = tid; r < nrows; r += (int)blockDim.x) Cs[r] = Ls[r] > 0.0f ? __fdividef(a.v_scale, Ls[r]) : 0.0f;
    __syncthreads();
    const long long rows_total = (long long)a.total_q * H;
#pragma unroll
    for (int k = 0; k < PA_MAX_ACC; ++k) {
        const int i = tid + k * (int)blockDim.x;
        if (i < nout) {
            const int r = i / D, d = i - r * D;
            const int gr = row0 + r;
            const int qi = gr / G;
            const int h = kvh * G + (int)(gr - qi * G);
            const long long orow = (long long)(qo_start + qi) * H + h;
            const float l = Ls[r];
            const float o = acc[k] * Cs[r];
            const float lse2 = l > 0.0f ? Ms[r] + __log2f(l) : PK_NEG_INF;
            if (a.partial) {
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

// The members init() fills (pbeg / hoff / base, len) start at zero here and are set per (batch, kv head).
__device__ __forceinline__ PagedKV pa_paged_kv(const int* indptr, const int* indices, const int* last, int page_size,
                                               long long s_page, long long s_tok, long long s_head) {
    return PagedKV{indptr, indices, last, page_size, s_page, s_tok, s_head};
}

__device__ __forceinline__ DenseKV pa_dense_kv(const int* cu, const unsigned int* lens, int mode, int max_len,
                                               long long s_b, long long s_tok, long long s_head) {
    return DenseKV{cu, lens, mode, max_len, s_b, s_tok, s_head};
}

// ---------------------------------------------------------------------------
// Merge of split-KV partials, one output row by one warp (lanes over head_dim; all 32 lanes call it):
// out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), lse = (M + log2 sum) * ln 2.
// Splits that saw no key (lse -inf) weigh 0; a row no split saw gets zeros, lse -inf.
// LD reads the partials: PaLdPlain (paged_attn_merge, a launch after the partials' writer) or
// PaLdRelaxed (decode_tc.cu's last split CTA, the same launch: strong loads after the acquire ticket).
// b128: 16 bytes (8 partial elements of a 16-bit type) in one load.
struct PaLdPlain {
    static __device__ __forceinline__ float f32(const float* p) { return *p; }
    static __device__ __forceinline__ uint4 b128(const void* p) { return *static_cast<const uint4*>(p); }
};
struct PaLdRelaxed {
    static __device__ __forceinline__ float f32(const float* p) { return pk_ld_relaxed_gpu(p); }
    static __device__ __forceinline__ uint4 b128(const void* p) { return pk_ld_relaxed_gpu_b128(p); }
};
// The merge math (one source of truth for pa_merge_row and pa_merge_group_cta): a split's weight against
// the running max M (a split that saw no key, lse -inf, weighs 0; so does a max of -inf against a larger
// one, which rescales earlier sums), and the merged row's natural-log lse from M and the weights' sum W.
__device__ __forceinline__ float pa_merge_weight(float ls, float M) {
    return ls != PK_NEG_INF ? exp2f(ls - M) : 0.0f;
}
__device__ __forceinline__ float pa_merge_lse(float M, float W) {
    return M == PK_NEG_INF ? M : (M + __log2f(W)) * PA_LN2;
}
// pa_merge_row (paged_attn_merge, a launch of its own with a warp a row): the lanes load the splits' lse
// in parallel (lane s: split s of each 32; the first 32 kept in a register) and reduce with shuffles, then
// every lane's head_dim / 32 outputs take each split's weight by shuffle, the partial loads of 4 splits in
// flight a lane (no load waits on a value: a weightless split's slot is loaded and its value dropped after,
// so whatever it holds, e.g. nothing written, never reaches the sum).
// PER_LANE: outputs a lane at most (head_dim <= 32 * PER_LANE): 8 for any head_dim up to 256.
#define PA_MERGE_PER_LANE 8
template <typename TO, typename LD, int PER_LANE = PA_MERGE_PER_LANE>
__device__ __forceinline__ void pa_merge_row(const float* part_o, const float* part_lse, TO* __restrict__ out,
                                             float* __restrict__ lse, long long total_rows, long long row,
                                             int head_dim, int num_splits, int write_lse, int lane) {
    const float ls0 = lane < num_splits ? LD::f32(part_lse + lane * total_rows + row) : PK_NEG_INF;
    float M = ls0;
    for (int s = lane + 32; s < num_splits; s += 32) M = fmaxf(M, LD::f32(part_lse + s * total_rows + row));
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) M = fmaxf(M, __shfl_xor_sync(PK_FULL_MASK, M, x));
    float acc[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) acc[k] = 0.0f;
    float W = 0.0f;  // this lane's splits' weights; the warp's sum below
    if (M != PK_NEG_INF) {
        for (int c = 0; c < num_splits; c += 32) {  // 32 splits at a time, one weight a lane
            const int sl = c + lane;
            const float ls = c == 0 ? ls0 : sl < num_splits ? LD::f32(part_lse + sl * total_rows + row) : PK_NEG_INF;
            const float w = pa_merge_weight(ls, M);
            W += w;
            const int n = num_splits - c < 32 ? num_splits - c : 32;
#pragma unroll 4
            for (int j = 0; j < n; j++) {
                const float wj = __shfl_sync(PK_FULL_MASK, w, j);
                const float* po = part_o + ((c + j) * total_rows + row) * head_dim;
#pragma unroll
                for (int k = 0; k < PER_LANE; k++)
                    if (lane + 32 * k < head_dim) {
                        const float v = LD::f32(po + lane + 32 * k);
                        acc[k] = wj != 0.0f ? fmaf(wj, v, acc[k]) : acc[k];  // a weightless split: value dropped
                    }
            }
        }
    }
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) W += __shfl_xor_sync(PK_FULL_MASK, W, x);
    const float inv_w = M != PK_NEG_INF ? __fdividef(1.0f, W) : 0.0f;
#pragma unroll
    for (int k = 0; k < PER_LANE; k++)
        if (lane + 32 * k < head_dim) PkIO<TO>::store(out, row * head_dim + lane + 32 * k, acc[k] * inv_w);
    if (write_lse && lane == 0) lse[row] = pa_merge_lse(M, W);
}

// pa_merge_group_cta (decode_tc.cu's last split CTA, on the critical path of the launch): a whole CTA of NT
// threads merges a group's G <= 16 rows row0 .. row0 + G - 1 (head_dim the compile-time D) with as few
// dependent global round trips as it can, and no barrier. The partial o is stored in the output type TO (a
// 16-bit type, as FlashInfer's split-KV decode stores it; the lse stays fp32, and so does every sum and
// weight here): the group's G * D outputs are U = G * D / 8 units of 8 elements (one 16-byte strong load a
// unit a split). P threads share a unit, P the largest power of two with P * next_pow2(U) <= NT (1 when
// U >= NT; P <= NT / 8 <= 16 as U >= 8: G >= 1, D >= 64); thread t = p + P u takes unit u and splits p,
// p + P, ...; with P = 1, units t + NT k. So a small group still has the whole CTA loading, and the P
// threads of a unit are P adjacent lanes of one warp. Each thread, unit by unit, loads its splits
// PA_CM_NB at a time, each split's lse and its 16-byte piece of o in the same round (all issued before any
// is used; past its last split a batch reloads that split, no branch, and weighs it 0), and folds them
// (widened to fp32) into a running (max m, weight sum W, o sum) of its own, rescaled as m grows
// (pa_merge_weight, the merge math of pa_merge_row; a weightless split's value is dropped, as there). So a
// batch is one round trip and no round waits for another thread: thread 0's units x ceil(its splits /
// PA_CM_NB) rounds in all. The P states of a unit then meet by butterfly shuffles (log2 P steps: both sides
// rescaled to their max; every lane of the CTA takes part when P > 1), and lane p = 0 scales by 1 / W and
// stores the unit with one 16-byte store (the op gives decode_tc only a 16-byte aligned out); the lane of a
// row's first unit writes its lse. tools/bench_decode.py (tc_tail_round_trips) mirrors this.
// 16-byte loads in flight a thread (and as many lse loads): d128 16, d64 8 (within the registers decode_tc's
// tile loop takes already, 0 spills on every arch).
#define PA_CM_NB(D) ((D) / 8)
template <typename TO, typename LD, int D, int NT>
__device__ __forceinline__ void pa_merge_group_cta(const TO* part_o, const float* part_lse,
                                                   TO* __restrict__ out, float* __restrict__ lse,
                                                   long long total_rows, long long row0, int G, int num_splits,
                                                   int write_lse) {
    constexpr int NB = PA_CM_NB(D);
    static_assert(sizeof(TO) == 2, "partials of a 16-bit type: 8 elements a 16-byte load");
    static_assert(NT % 32 == 0 && (NT & (NT - 1)) == 0 && D % 8 == 0 && D >= 64, "whole warps, 16-byte units, U >= 8");
    const int tid = threadIdx.x;
    const int U = G * (D / 8);
    // log2 P: NT / next_pow2(U) (U >= 8 here, so U - 1 >= 1)
    const int lg = U >= NT ? 0 : (31 - __clz(NT)) - (32 - __clz(U - 1));
    const int P = 1 << lg;
    const int pu = tid & (P - 1);   // this thread's first split
    const int u0 = tid >> lg;       // its first unit
    // its units: with P > 1 every thread runs one (an idle one, u0 >= U, with no splits: the shuffles below
    // need every lane)
    const int nk = P > 1 ? 1 : tid < U ? (U - 1 - tid) / NT + 1 : 0;
    const int nsp = u0 < U && pu < num_splits ? ((num_splits - 1 - pu) >> lg) + 1 : 0;  // its splits
    const long long lstep = (long long)P * total_rows;  // from one of its splits' lse to the next
    const long long ostep = lstep * D;                  // ... and o
    for (int k = 0; k < nk; k++) {
        const int u = u0 + NT * k, r = (8 * u) / D;
        const float* pl = part_lse + (long long)pu * total_rows + row0 + r;
        const TO* po = part_o + ((long long)pu * total_rows + row0) * D + 8 * u;
        float m = PK_NEG_INF, W = 0.0f, run[8];
#pragma unroll
        for (int e = 0; e < 8; e++) run[e] = 0.0f;
        for (int q0 = 0; q0 < nsp; q0 += NB) {
            const int last = nsp - 1 - q0;  // the batch's last split that is the thread's
            float ls[NB];
            uint4 v[NB];
#pragma unroll
            for (int i = 0; i < NB; i++) {
                ls[i] = LD::f32(pl);
                v[i] = LD::b128(po);
                if (i + 1 < NB && i < last) pl += lstep, po += ostep;
            }
            pl += lstep, po += ostep;  // the next batch's first split (used only when this batch was full)
            float mb = m;
#pragma unroll
            for (int i = 0; i < NB; i++) mb = i <= last ? fmaxf(mb, ls[i]) : mb;
            const float a = pa_merge_weight(m, mb);  // the earlier splits' rescale (0 while nothing is seen)
            W *= a;
#pragma unroll
            for (int e = 0; e < 8; e++) run[e] *= a;
#pragma unroll
            for (int i = 0; i < NB; i++) {
                const float w = i <= last ? pa_merge_weight(ls[i], mb) : 0.0f;
                W += w;
                float x[8];
                Pk16<TO>::widen2(v[i].x, x[0], x[1]);
                Pk16<TO>::widen2(v[i].y, x[2], x[3]);
                Pk16<TO>::widen2(v[i].z, x[4], x[5]);
                Pk16<TO>::widen2(v[i].w, x[6], x[7]);
#pragma unroll
                for (int e = 0; e < 8; e++)  // a weightless split: value dropped
                    run[e] = w != 0.0f ? fmaf(w, x[e], run[e]) : run[e];
            }
            m = mb;
        }
        // the P states of the unit (P adjacent lanes), combined against their max
        for (int x = 1; x < P; x <<= 1) {
            const float m2 = __shfl_xor_sync(PK_FULL_MASK, m, x), W2 = __shfl_xor_sync(PK_FULL_MASK, W, x);
            float r2[8];
#pragma unroll
            for (int e = 0; e < 8; e++) r2[e] = __shfl_xor_sync(PK_FULL_MASK, run[e], x);
            const float M = fmaxf(m, m2), f = pa_merge_weight(m, M), f2 = pa_merge_weight(m2, M);
            W = fmaf(f, W, f2 * W2);
#pragma unroll
            for (int e = 0; e < 8; e++) run[e] = fmaf(f, run[e], f2 * r2[e]);
            m = M;
        }
        if (pu == 0 && u < U) {
            const float inv_w = m != PK_NEG_INF ? __fdividef(1.0f, W) : 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e++) run[e] *= inv_w;
            // 16 bytes a unit (out is 16-byte aligned), through the PTX store: a uint4 store here was split in four
            uint4 w;
            w.x = Pk16<TO>::narrow2(run[0], run[1]);
            w.y = Pk16<TO>::narrow2(run[2], run[3]);
            w.z = Pk16<TO>::narrow2(run[4], run[5]);
            w.w = Pk16<TO>::narrow2(run[6], run[7]);
            pk_st_global_b128(out + row0 * D + 8 * u, w);
            if (write_lse && (8 * u) % D == 0) lse[row0 + r] = pa_merge_lse(m, W);
        }
    }
}

// The merge kernel's body: one warp per output row (total_rows = total_q * H).
template <typename TO>
__device__ __forceinline__ void pa_merge(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                         TO* __restrict__ out, float* __restrict__ lse, long long total_rows,
                                         int head_dim, int num_splits, int write_lse) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= total_rows) return;
    pa_merge_row<TO, PaLdPlain>(part_o, part_lse, out, lse, total_rows, row, head_dim, num_splits, write_lse,
                                threadIdx.x & 31);
}

