// Decode attention: one new query token per sequence against a KV cache (issue 7).
//
// Layouts (all C-contiguous, batch index = blockIdx.y or blockIdx.z):
//   q, out     [M, num_heads, head_dim]             TQ   (float or bf16 bits)
//   k, v       [M, num_kv_heads, max_seq_len, head_dim]  TKV
//   seq_lens   [M] unsigned int, read on the device and clamped to max_seq_len,
//              so a launch's arguments do not change from one decode step to the
//              next (the launch can be captured in a CUDA graph).
// Grouped-query attention: kv_head = head / (num_heads / num_kv_heads).
// Query heads of one kv head are consecutive, so the warp and split-K kernels put
// several of them in one block (one warp each): their K/V rows are read at the
// same time and served from L1 after the first warp's miss.
//
// Cache slots at or past seq_len are never loaded (not even multiplied by a zero
// probability: NaN * 0 is NaN). seq_len 0 yields an all-zero output.
//
// Scores are kept in the log2 domain: q is pre-multiplied by scale * log2(e) so
// the softmax uses exp2f. Partial states (m, l, acc) are in that domain too.
#include "pk_common.cuh"

#define DEC_MAX_HEAD_DIM 256
#define DEC_LOG2E 1.4426950408889634f
#define DEC_UNROLL 4
// __launch_bounds__ of the entry points, kept in step with pykern/ops/decode.py:
// the warp and split-K kernels run 32 * hpb (hpb <= 8) threads, the split-K reduce
// head_dim rounded up to 32 (<= 256): bound 256. multi_warp runs 32 * num_warps
// threads; its ~128 registers a thread fit 16 warps in the 64K-register file (a
// 1024-thread block of it cannot launch), so num_warps is capped at 16: bound 512.

// Lane layout: a warp splits into R = 32/LPR row groups of LPR lanes; each group
// works on its own cache row, so a step covers R rows (bf16 head_dim 128: two rows
// of 16 lanes x 8 dims, no idle lanes). Lane i of a group owns the VEC-wide dim
// vectors (i + LPR*j), j < NJ. LPR < 32 is only used when LPR*VEC >= head_dim (NJ
// 1); LPR 32 covers up to 256 dims with 8 per lane for every VEC.
template <int VEC, int LPR> struct DecLanes {
    static constexpr int R = 32 / LPR;
    static constexpr int NJ = LPR == 32 ? (DEC_MAX_HEAD_DIM + 32 * VEC - 1) / (32 * VEC) : 1;
};

// Load VEC consecutive cache elements starting at p (p aligned to VEC elements).
template <typename TKV, int VEC> struct DecLoad;
template <> struct DecLoad<float, 1> {
    static __device__ __forceinline__ void run(const float* p, float* o) { o[0] = p[0]; }
};
template <> struct DecLoad<float, 4> {
    static __device__ __forceinline__ void run(const float* p, float* o) {
        const float4 x = *reinterpret_cast<const float4*>(p);
        o[0] = x.x; o[1] = x.y; o[2] = x.z; o[3] = x.w;
    }
};
template <> struct DecLoad<unsigned short, 1> {
    static __device__ __forceinline__ void run(const unsigned short* p, float* o) { o[0] = pk_bf16_to_float(p[0]); }
};
// 8 bf16 per 16-byte load; each 32-bit word holds two bf16 (low half first).
template <> struct DecLoad<unsigned short, 8> {
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

template <typename TKV> struct DecVec;
template <> struct DecVec<float> { static constexpr int V = 4; };
template <> struct DecVec<unsigned short> { static constexpr int V = 8; };

// One warp's online-softmax state. m is the same in every lane; l and acc are
// per row group until dec_warp_attend's final combine, after which every lane
// holds the warp's totals for its dims.
template <int VEC, int LPR> struct DecState {
    float m;  // running max of log2-domain scores (-inf before the first position)
    float l;  // sum of exp2(score - m)
    float acc[DecLanes<VEC, LPR>::NJ][VEC];  // sum of exp2(score - m) * v
};

// First dim of a lane's vector j.
template <int VEC, int LPR>
__device__ __forceinline__ int dec_dim0(int lane, int j) {
    return ((lane & (LPR - 1)) + LPR * j) * VEC;
}

template <typename TQ, int VEC, int LPR>
__device__ __forceinline__ void dec_load_q(const TQ* qh, int head_dim, float qscale, int lane,
                                           float (&qv)[DecLanes<VEC, LPR>::NJ][VEC]) {
#pragma unroll
    for (int j = 0; j < DecLanes<VEC, LPR>::NJ; ++j) {
        const int d0 = dec_dim0<VEC, LPR>(lane, j);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            qv[j][e] = (d0 + e < head_dim) ? PkIO<TQ>::load(qh, d0 + e) * qscale : 0.0f;
    }
}

template <int VEC, int LPR>
__device__ __forceinline__ void dec_init(DecState<VEC, LPR>& st) {
    st.m = PK_NEG_INF;
    st.l = 0.0f;
#pragma unroll
    for (int j = 0; j < DecLanes<VEC, LPR>::NJ; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e) st.acc[j][e] = 0.0f;
}

// The warp walks positions begin, begin+step, ... < end: row group g of unroll
// slot u takes position p + (u*R + g)*step, so one iteration covers DEC_UNROLL*R
// positions and issues 2*DEC_UNROLL row loads per lane before the first dot
// product needs one. begin, end and step are warp-uniform (shuffles use all lanes).
template <typename TKV, int VEC, int LPR>
__device__ __forceinline__ void dec_warp_attend(const float (&qv)[DecLanes<VEC, LPR>::NJ][VEC],
                                                const TKV* __restrict__ kh, const TKV* __restrict__ vh, int head_dim,
                                                int begin, int end, int step, int lane, DecState<VEC, LPR>& st) {
    constexpr int NJ = DecLanes<VEC, LPR>::NJ, R = DecLanes<VEC, LPR>::R;
    const int group = lane / LPR;
    for (int p = begin; p < end; p += DEC_UNROLL * R * step) {
        float kf[DEC_UNROLL][NJ][VEC], vf[DEC_UNROLL][NJ][VEC];
        bool ok[DEC_UNROLL];
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; ++u) {
            const int pos = p + (u * R + group) * step;
            ok[u] = pos < end;
            const long long row = (long long)pos * head_dim;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const int d0 = dec_dim0<VEC, LPR>(lane, j);
                if (ok[u] && d0 < head_dim) {
                    DecLoad<TKV, VEC>::run(kh + row + d0, kf[u][j]);
                    DecLoad<TKV, VEC>::run(vh + row + d0, vf[u][j]);
                } else {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) { kf[u][j][e] = 0.0f; vf[u][j][e] = 0.0f; }
                }
            }
        }
        float s[DEC_UNROLL];
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; ++u) {
            float d = 0.0f;
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int e = 0; e < VEC; ++e) d = fmaf(qv[j][e], kf[u][j][e], d);
            s[u] = d;
        }
        // Dot products: butterflies inside each row group, the DEC_UNROLL
        // reductions interleaved so their latencies overlap.
#pragma unroll
        for (int off = LPR / 2; off > 0; off >>= 1)
#pragma unroll
            for (int u = 0; u < DEC_UNROLL; ++u) s[u] += __shfl_xor_sync(PK_FULL_MASK, s[u], off);
        float mx = st.m;
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; ++u)
            if (ok[u]) mx = fmaxf(mx, s[u]);
        // One max for the whole warp, so the groups' partial sums share a scale.
#pragma unroll
        for (int off = 16; off >= LPR; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(PK_FULL_MASK, mx, off));
        // Group 0's slot 0 is in range (p < end): mx is finite and exp2f(-inf - mx) = 0.
        const float corr = exp2f(st.m - mx);
        st.l *= corr;
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < VEC; ++e) st.acc[j][e] *= corr;
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; ++u) {
            if (!ok[u]) continue;
            const float pr = exp2f(s[u] - mx);
            st.l += pr;
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int e = 0; e < VEC; ++e) st.acc[j][e] = fmaf(pr, vf[u][j][e], st.acc[j][e]);
        }
        st.m = mx;
    }
    // Sum the row groups (same m everywhere): every lane ends with the warp's totals.
#pragma unroll
    for (int off = 16; off >= LPR; off >>= 1) {
        st.l += __shfl_xor_sync(PK_FULL_MASK, st.l, off);
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < VEC; ++e) st.acc[j][e] += __shfl_xor_sync(PK_FULL_MASK, st.acc[j][e], off);
    }
}

struct DecGeom {
    int num_heads, num_kv_heads, head_dim, max_seq_len;
};

__device__ __forceinline__ int dec_seq_len(const unsigned int* seq_lens, int b, int max_seq_len) {
    const unsigned int s = seq_lens[b];
    return s > (unsigned int)max_seq_len ? max_seq_len : (int)s;
}

// Offset of (batch b, kv head of query head h) in the caches.
__device__ __forceinline__ long long dec_kv_offset(const DecGeom& g, int b, int h) {
    const int kvh = h / (g.num_heads / g.num_kv_heads);
    return ((long long)b * g.num_kv_heads + kvh) * g.max_seq_len * g.head_dim;
}

// Picks the lane layout at run time (warp-uniform) and calls f.run<VEC, LPR>().
// Vector loads need 16-byte aligned rows: aligned bases and head_dim a multiple
// of the vector width; otherwise scalar loads with 32 lanes per row.
template <typename TKV, typename F>
__device__ __forceinline__ void dec_dispatch(const TKV* k, const TKV* v, int head_dim, F& f) {
    constexpr int V = DecVec<TKV>::V;
    const bool aligned = head_dim % V == 0 && (((unsigned long long)k | (unsigned long long)v) & 15ull) == 0;
    if (!aligned) {
        f.template run<1, 32>();
        return;
    }
    const int vecs = head_dim / V;
    if (vecs <= 8)
        f.template run<V, 8>();
    else if (vecs <= 16)
        f.template run<V, 16>();
    else
        f.template run<V, 32>();
}

// Stores a lane's finished dims (scaled by inv) through PkIO; group 0 writes.
template <typename TO, int VEC, int LPR>
__device__ __forceinline__ void dec_store(TO* o, const DecState<VEC, LPR>& st, float inv, int head_dim, int lane) {
    if (lane >= LPR) return;
#pragma unroll
    for (int j = 0; j < DecLanes<VEC, LPR>::NJ; ++j) {
        const int d0 = dec_dim0<VEC, LPR>(lane, j);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            if (d0 + e < head_dim) PkIO<TO>::store(o, d0 + e, st.acc[j][e] * inv);
    }
}

// ---------------------------------------------------------------------------
// warp: one warp per query head over the whole cache. grid (num_heads / hpb, M),
// block 32*hpb with hpb a divisor of the GQA group size: the heads of a block
// share one kv head, so the rows one warp pulls in are L1 hits for the others.
template <typename TQ, typename TKV> struct DecWarp {
    const TQ* q; const TKV* k; const TKV* v; TQ* out; const unsigned int* seq_lens; DecGeom g; float scale;
    template <int VEC, int LPR> __device__ __forceinline__ void run() {
        const int lane = threadIdx.x & 31;
        const int h = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
        const int b = blockIdx.y;
        if (h >= g.num_heads) return;
        const int sl = dec_seq_len(seq_lens, b, g.max_seq_len);
        const long long qo = ((long long)b * g.num_heads + h) * g.head_dim;
        const long long kvo = dec_kv_offset(g, b, h);
        float qv[DecLanes<VEC, LPR>::NJ][VEC];
        dec_load_q<TQ, VEC, LPR>(q + qo, g.head_dim, scale * DEC_LOG2E, lane, qv);
        DecState<VEC, LPR> st;
        dec_init(st);
        dec_warp_attend<TKV, VEC, LPR>(qv, k + kvo, v + kvo, g.head_dim, 0, sl, 1, lane, st);
        dec_store<TQ, VEC, LPR>(out + qo, st, st.l > 0.0f ? 1.0f / st.l : 0.0f, g.head_dim, lane);
    }
};

// ---------------------------------------------------------------------------
// multi_warp: W = blockDim.x/32 warps per query head, warp w takes positions
// w, w+W, ...; the W partial states are combined in shared memory.
// grid (num_heads, M); dynamic shared memory W*(head_dim+2) floats.
template <typename TQ, typename TKV> struct DecMulti {
    const TQ* q; const TKV* k; const TKV* v; TQ* out; const unsigned int* seq_lens; DecGeom g; float scale;
    float* smem;
    template <int VEC, int LPR> __device__ __forceinline__ void run() {
        const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
        const int h = blockIdx.x, b = blockIdx.y;
        const int sl = dec_seq_len(seq_lens, b, g.max_seq_len);
        const long long qo = ((long long)b * g.num_heads + h) * g.head_dim;
        const long long kvo = dec_kv_offset(g, b, h);
        float qv[DecLanes<VEC, LPR>::NJ][VEC];
        dec_load_q<TQ, VEC, LPR>(q + qo, g.head_dim, scale * DEC_LOG2E, lane, qv);
        DecState<VEC, LPR> st;
        dec_init(st);
        dec_warp_attend<TKV, VEC, LPR>(qv, k + kvo, v + kvo, g.head_dim, w, sl, nw, lane, st);

        float* sm_ml = smem;          // [nw][2]
        float* sm_o = smem + 2 * nw;  // [nw][head_dim]
        if (lane == 0) {
            sm_ml[2 * w] = st.m;
            sm_ml[2 * w + 1] = st.l;
        }
        dec_store<float, VEC, LPR>(sm_o + w * g.head_dim, st, 1.0f, g.head_dim, lane);
        __syncthreads();
        float M = PK_NEG_INF;
        for (int i = 0; i < nw; ++i) M = fmaxf(M, sm_ml[2 * i]);
        for (int d = threadIdx.x; d < g.head_dim; d += blockDim.x) {
            float L = 0.0f, o = 0.0f;
            for (int i = 0; i < nw; ++i) {
                const float mi = sm_ml[2 * i];
                if (mi == PK_NEG_INF) continue;  // an empty slice; exp2f(-inf - -inf) would be NaN
                const float f = exp2f(mi - M);
                L = fmaf(sm_ml[2 * i + 1], f, L);
                o = fmaf(sm_o[i * g.head_dim + d], f, o);
            }
            PkIO<TQ>::store(out + qo, d, L > 0.0f ? o / L : 0.0f);
        }
    }
};

// ---------------------------------------------------------------------------
// split_k (flash decoding), pass 1: chunk c of every (head, batch) covers
// positions [c*chunk_size, min((c+1)*chunk_size, seq_len)). One warp per query
// head, hpb = blockDim.x/32 heads of one kv group per block (as in the warp
// method). grid (chunks launched, num_heads / hpb, M). Writes the unnormalized state:
//   part_o  [M, num_heads, max_chunks, head_dim]   acc
//   part_ml [M, num_heads, max_chunks, 2]          (m, l)
// A chunk at or past seq_len writes the neutral state (m=-inf, l=0, acc=0).
template <typename TQ, typename TKV> struct DecChunk {
    const TQ* q; const TKV* k; const TKV* v; float* part_o; float* part_ml; const unsigned int* seq_lens;
    DecGeom g; float scale; int chunk_size; int max_chunks;
    template <int VEC, int LPR> __device__ __forceinline__ void run() {
        const int lane = threadIdx.x & 31;
        const int c = blockIdx.x;
        const int h = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
        const int b = blockIdx.z;
        if (h >= g.num_heads || c >= max_chunks) return;
        const int sl = dec_seq_len(seq_lens, b, g.max_seq_len);
        const long long begin_ll = (long long)c * chunk_size;
        const int begin = begin_ll < sl ? (int)begin_ll : sl;
        const int end = (long long)sl - begin > chunk_size ? begin + chunk_size : sl;
        const long long qo = ((long long)b * g.num_heads + h) * g.head_dim;
        const long long kvo = dec_kv_offset(g, b, h);
        float qv[DecLanes<VEC, LPR>::NJ][VEC];
        dec_load_q<TQ, VEC, LPR>(q + qo, g.head_dim, scale * DEC_LOG2E, lane, qv);
        DecState<VEC, LPR> st;
        dec_init(st);
        dec_warp_attend<TKV, VEC, LPR>(qv, k + kvo, v + kvo, g.head_dim, begin, end, 1, lane, st);
        const long long slot = ((long long)b * g.num_heads + h) * max_chunks + c;
        dec_store<float, VEC, LPR>(part_o + slot * g.head_dim, st, 1.0f, g.head_dim, lane);
        if (lane == 0) {
            part_ml[2 * slot] = st.m;
            part_ml[2 * slot + 1] = st.l;
        }
    }
};

// split_k, pass 2: one block per (head, batch), thread d owns output dim d
// (blockDim.x >= head_dim). Only the chunks that cover seq_len are read; empty
// ones (m = -inf) are skipped, and seq_len 0 gives zeros.
template <typename TQ>
__device__ __forceinline__ void dec_reduce(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                           TQ* __restrict__ out, const unsigned int* __restrict__ seq_lens,
                                           int num_heads, int head_dim, int max_seq_len, int chunk_size,
                                           int max_chunks) {
    const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
    if (d >= head_dim) return;
    const int sl = dec_seq_len(seq_lens, b, max_seq_len);
    const long long need = ((long long)sl + chunk_size - 1) / chunk_size;
    const int n = need < max_chunks ? (int)need : max_chunks;
    const long long base = ((long long)b * num_heads + h) * max_chunks;
    float M = PK_NEG_INF;
    for (int c = 0; c < n; ++c) M = fmaxf(M, part_ml[2 * (base + c)]);
    float L = 0.0f, o = 0.0f;
    for (int c = 0; c < n; ++c) {
        const float mc = part_ml[2 * (base + c)];
        if (mc == PK_NEG_INF) continue;
        const float f = exp2f(mc - M);
        L = fmaf(part_ml[2 * (base + c) + 1], f, L);
        o = fmaf(part_o[(base + c) * head_dim + d], f, o);
    }
    PkIO<TQ>::store(out + ((long long)b * num_heads + h) * head_dim, d, L > 0.0f ? o / L : 0.0f);
}

// Entry points. Suffixes: none = f32 q/out and f32 caches; _bf16 = bf16 q/out and
// bf16 caches; _bf16kv = f32 q/out with bf16 caches.
extern "C" __global__ void __launch_bounds__(256) decode_attn_warp(const float* __restrict__ q,
        const float* __restrict__ k_cache, const float* __restrict__ v_cache, float* __restrict__ out,
        const unsigned int* __restrict__ seq_lens, int num_heads, int num_kv_heads, int head_dim, int max_seq_len,
        float scale) {
    DecWarp<float, float> f = {q, k_cache, v_cache, out, seq_lens, {num_heads, num_kv_heads, head_dim, max_seq_len}, scale};
    dec_dispatch(k_cache, v_cache, head_dim, f);
}

extern "C" __global__ void __launch_bounds__(256) decode_attn_warp_bf16(const unsigned short* __restrict__ q,
        const unsigned short* __restrict__ k_cache, const unsigned short* __restrict__ v_cache, unsigned short* __restrict__ out,
        const unsigned int* __restrict__ seq_lens, int num_heads, int num_kv_heads, int head_dim, int max_seq_len,
        float scale) {
    DecWarp<unsigned short, unsigned short> f = {q, k_cache, v_cache, out, seq_lens, {num_heads, num_kv_heads, head_dim, max_seq_len}, scale};
    dec_dispatch(k_cache, v_cache, head_dim, f);
}

extern "C" __global__ void __launch_bounds__(256) decode_attn_warp_bf16kv(const float* __restrict__ q,
        const unsigned short* __restrict__ k_cache, const unsigned short* __restrict__ v_cache, float* __restrict__ out,
        const unsigned int* __restrict__ seq_lens, int num_heads, int num_kv_heads, int head_dim, int max_seq_len,
        float scale) {
    DecWarp<float, unsigned short> f = {q, k_cache, v_cache, out, seq_lens, {num_heads, num_kv_heads, head_dim, max_seq_len}, scale};
    dec_dispatch(k_cache, v_cache, head_dim, f);
}

extern "C" __global__ void __launch_bounds__(512) decode_attn_multi_warp(const float* __restrict__ q,
        const float* __restrict__ k_cache, const float* __restrict__ v_cache, float* __restrict__ out,
        const unsigned int* __restrict__ seq_lens, int num_heads, int num_kv_heads, int head_dim, int max_seq_len,
        float scale) {
    extern __shared__ float smem[];
    DecMulti<float, float> f = {q, k_cache, v_cache, out, seq_lens, {num_heads, num_kv_heads, head_dim, max_seq_len}, scale,
                              smem};
    dec_dispatch(k_cache, v_cache, head_dim, f);
}

extern "C" __global__ void __launch_bounds__(512) decode_attn_multi_warp_bf16(const unsigned short* __restrict__ q,
        const unsigned short* __restrict__ k_cache, const unsigned short* __restrict__ v_cache, unsigned short* __restrict__ out,
        const unsigned int* __restrict__ seq_lens, int num_heads, int num_kv_heads, int head_dim, int max_seq_len,
        float scale) {
    extern __shared__ float smem[];
    DecMulti<unsigned short, unsigned short> f = {q, k_cache, v_cache, out, seq_lens, {num_heads, num_kv_heads, head_dim, max_seq_len}, scale,
                              smem};
    dec_dispatch(k_cache, v_cache, head_dim, f);
}

extern "C" __global__ void __launch_bounds__(512) decode_attn_multi_warp_bf16kv(const float* __restrict__ q,
        const unsigned short* __restrict__ k_cache, const unsigned short* __restrict__ v_cache, float* __restrict__ out,
        const unsigned int* __restrict__ seq_lens, int num_heads, int num_kv_heads, int head_dim, int max_seq_len,
        float scale) {
    extern __shared__ float smem[];
    DecMulti<float, unsigned short> f = {q, k_cache, v_cache, out, seq_lens, {num_heads, num_kv_heads, head_dim, max_seq_len}, scale,
                              smem};
    dec_dispatch(k_cache, v_cache, head_dim, f);
}

extern "C" __global__ void __launch_bounds__(256) decode_attn_split_chunk(const float* __restrict__ q,
        const float* __restrict__ k_cache, const float* __restrict__ v_cache, float* __restrict__ part_o,
        float* __restrict__ part_ml, const unsigned int* __restrict__ seq_lens, int num_heads, int num_kv_heads,
        int head_dim, int max_seq_len, float scale, int chunk_size, int max_chunks) {
    DecChunk<float, float> f = {q, k_cache, v_cache, part_o, part_ml, seq_lens,
                              {num_heads, num_kv_heads, head_dim, max_seq_len}, scale, chunk_size, max_chunks};
    dec_dispatch(k_cache, v_cache, head_dim, f);
}

extern "C" __global__ void __launch_bounds__(256) decode_attn_split_chunk_bf16(const unsigned short* __restrict__ q,
        const unsigned short* __restrict__ k_cache, const unsigned short* __restrict__ v_cache, float* __restrict__ part_o,
        float* __restrict__ part_ml, const unsigned int* __restrict__ seq_lens, int num_heads, int num_kv_heads,
        int head_dim, int max_seq_len, float scale, int chunk_size, int max_chunks) {
    DecChunk<unsigned short, unsigned short> f = {q, k_cache, v_cache, part_o, part_ml, seq_lens,
                              {num_heads, num_kv_heads, head_dim, max_seq_len}, scale, chunk_size, max_chunks};
    dec_dispatch(k_cache, v_cache, head_dim, f);
}

extern "C" __global__ void __launch_bounds__(256) decode_attn_split_chunk_bf16kv(const float* __restrict__ q,
        const unsigned short* __restrict__ k_cache, const unsigned short* __restrict__ v_cache, float* __restrict__ part_o,
        float* __restrict__ part_ml, const unsigned int* __restrict__ seq_lens, int num_heads, int num_kv_heads,
        int head_dim, int max_seq_len, float scale, int chunk_size, int max_chunks) {
    DecChunk<float, unsigned short> f = {q, k_cache, v_cache, part_o, part_ml, seq_lens,
                              {num_heads, num_kv_heads, head_dim, max_seq_len}, scale, chunk_size, max_chunks};
    dec_dispatch(k_cache, v_cache, head_dim, f);
}

extern "C" __global__ void __launch_bounds__(256) decode_attn_split_reduce(const float* __restrict__ part_o,
        const float* __restrict__ part_ml, float* __restrict__ out, const unsigned int* __restrict__ seq_lens,
        int num_heads, int head_dim, int max_seq_len, int chunk_size, int max_chunks) {
    dec_reduce<float>(part_o, part_ml, out, seq_lens, num_heads, head_dim, max_seq_len, chunk_size, max_chunks);
}

extern "C" __global__ void __launch_bounds__(256) decode_attn_split_reduce_bf16(const float* __restrict__ part_o,
        const float* __restrict__ part_ml, unsigned short* __restrict__ out, const unsigned int* __restrict__ seq_lens,
        int num_heads, int head_dim, int max_seq_len, int chunk_size, int max_chunks) {
    dec_reduce<unsigned short>(part_o, part_ml, out, seq_lens, num_heads, head_dim, max_seq_len, chunk_size, max_chunks);
}
