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
// rope: rotary position embedding of q and k in one launch, optionally after an RMS norm over head_dim of
// every head (Qwen3 / Gemma 3's q_norm / k_norm: x * rsqrt(mean(x^2) + eps) * (w_offset + w), fp32 math).
// q is (n_tok, hq, head_dim) rows and k (n_tok, hk, head_dim) (hk = 0: q alone); token tt of n_tok
// (batch * tokens) reads its position from positions[tt % n_pos] when has_pos (the op passes n_pos = n_tokens
// for ids shared by every batch row, batch * n_tokens for per-row ids), else pos_offset + tt % n_pos. A
// position outside [0, max_pos) can only come from a device position array (the op checks host arrays
// before launch); its rows are written as zeros instead of reading outside the tables.
// style 0 ("interleaved") pairs (2i, 2i+1), style 1 ("half", HF LLaMA) pairs (i, i + head_dim/2); both rotate
// by the angle in cos/sin[pos, i] of a compact (max_pos, head_dim/2) table (full_table == 0). full_table == 1
// reads HF's (max_pos, head_dim) tables, whose pair i angle sits in column i for "half" and in column 2i for
// "interleaved". inverse != 0 rotates by -angle (sin negated): the transpose of the rotation, which is
// rope's backward. q and q_out (k and k_out) may be the same buffer: each thread reads its elements before
// writing them.
//
// Geometry (why it reaches the copy roofline): a thread owns W pairs of a head, W = 16 bytes of x (8 bf16 /
// f16, 4 f32) from each rotated half ("half": elements i..i+W and i+d/2..i+d/2+W, "interleaved": 2i..2i+2W),
// so every access of x is one 16-byte load or store (LDG.E.128 / STG.E.128). The CP = nextpow2(half / W)
// lanes of a head are an aligned group of a warp, HPW = 32 / CP heads side by side; a warp owns a unit of
// `heads_per_unit` consecutive heads of one token, q's heads then k's, so its lanes read their cos / sin
// (and norm weight) entries once per unit and keep them in registers across the heads. Each lane loads its
// RU heads' chunks before converting any (RU x 2 loads in flight). W = 1 (scalar, any even head_dim) when
// half is not a multiple of 16 bytes' elements or a pointer is not 16-byte aligned; half / W > 32 (bf16
// head_dim > 512, scalar half > 32) is walked in chunks of 32 lanes (the norm needs half / W <= 32: the op
// checks). The unit loop is warp-uniform, so the norm's shuffles always see the whole warp.
// ---------------------------------------------------------------------------
#define ROPE_WARPS 8
#define ROPE_RU 2  // heads a lane loads before it converts the first

__device__ __forceinline__ void fwd_rotate(float a, float b, float c, float s, float& ra, float& rb) {
    ra = a * c - b * s;
    rb = a * s + b * c;
}

// W table entries of pairs i.. from p (the row's start of pair i): contiguous, or every other column (an HF
// interleaved table repeats each entry twice). VEC: 16-byte aligned float4 loads.
template <int W, bool VEC>
__device__ __forceinline__ void rope_table(const float* __restrict__ p, bool every_other, float* v) {
    if constexpr (VEC) {
#pragma unroll
        for (int q = 0; q < W / 4; q++) {
            if (!every_other) {
                const float4 a = *reinterpret_cast<const float4*>(p + 4 * q);
                v[4 * q] = a.x; v[4 * q + 1] = a.y; v[4 * q + 2] = a.z; v[4 * q + 3] = a.w;
            } else {
                const float4 a = *reinterpret_cast<const float4*>(p + 8 * q);
                const float4 b = *reinterpret_cast<const float4*>(p + 8 * q + 4);
                v[4 * q] = a.x; v[4 * q + 1] = a.z; v[4 * q + 2] = b.x; v[4 * q + 3] = b.z;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < W; j++) v[j] = p[every_other ? 2 * j : j];
    }
}

// W elements of x from p + off, widened to fp32 in f (VEC: one 16-byte access).
template <typename T, int W, bool VEC>
__device__ __forceinline__ void rope_ld(const T* p, long long off, uint4& raw, float* f) {
    if constexpr (VEC) raw = pk_ld16_raw(p, off);
    else {
#pragma unroll
        for (int j = 0; j < W; j++) f[j] = PkIO<T>::load(p, off + j);
    }
}
template <typename T, int W, bool VEC>
__device__ __forceinline__ void rope_widen(const uint4& raw, float* f) {
    if constexpr (VEC) pk_widen16<T>(raw, f);
}
template <typename T, int W, bool VEC>
__device__ __forceinline__ void rope_st(T* p, long long off, const float* f) {
    if constexpr (VEC) PkVec16<T>::store(p, off, f);
    else {
#pragma unroll
        for (int j = 0; j < W; j++) PkIO<T>::store(p, off + j, f[j]);
    }
}

// a or b by value, a component at a time (a conditional of the two arrays' elements would take their address
// and put them in local memory)
__device__ __forceinline__ uint4 rope_sel(bool first, uint4 a, uint4 b) {
    return make_uint4(first ? a.x : b.x, first ? a.y : b.y, first ? a.z : b.z, first ? a.w : b.w);
}

// Sum over the CP lanes of this lane's head (an aligned group of the warp; every lane calls it).
__device__ __forceinline__ float rope_group_sum(float v, unsigned cp) {
    for (unsigned off = cp >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(PK_FULL_MASK, v, off);
    return v;
}

// Element offsets of this lane's two W-element chunks in a head (pair i = chunk * W).
template <int STYLE, int W>
__device__ __forceinline__ void rope_offsets(long long i, long long half, long long& oa, long long& ob) {
    oa = STYLE == 1 ? i : 2 * i;
    ob = STYLE == 1 ? half + i : 2 * i + W;
}

// Element e of the lane's 2W values (a chunk then b chunk) is pair j's first (STYLE 1: e = j, STYLE 0: 2j) or
// second (STYLE 1: W + j, STYLE 0: 2j + 1) element.
template <int STYLE, int W>
__device__ __forceinline__ void rope_rotate_all(float* e, const float* c, const float* s) {
#pragma unroll
    for (int j = 0; j < W; j++) {
        const int a = STYLE == 1 ? j : 2 * j, b = STYLE == 1 ? W + j : 2 * j + 1;
        float ra, rb;
        fwd_rotate(e[a], e[b], c[j], s[j], ra, rb);
        e[a] = ra;
        e[b] = rb;
    }
}

struct RopeGeom {
    long long n_tok, n_units, heads_per_unit;
    unsigned hq, hk, head_dim, n_pos, pos_offset, max_pos;
    bool has_pos, full, inverse, norm;
    float eps, w_offset;
};

// The W cos / sin entries at table offset t, zeros for an idle lane or a position outside the table (live
// false): the forward and the backward read the same entries, so they share this one copy.
template <int W, bool VEC>
__device__ __forceinline__ void rope_angles(const float* __restrict__ cos_t, const float* __restrict__ sin_t, bool live,
                                            long long t, bool every_other, float (&cs)[W], float (&sn)[W]) {
#pragma unroll
    for (int j = 0; j < W; j++) cs[j] = sn[j] = 0.0f;
    if (live) {
        rope_table<W, VEC>(cos_t + t, every_other, cs);
        rope_table<W, VEC>(sin_t + t, every_other, sn);
    }
}

// Work unit u of the forward (rope_run) and the backward: token tt, heads [h_lo, h_hi), the token's position and
// whether it lies inside the cos/sin table (ok). One copy so that both passes walk the same units.
struct RopeUnit {
    long long tt, h_lo, h_hi, pos;
    bool ok;
};
__device__ __forceinline__ RopeUnit rope_unit(const RopeGeom& g, const long long* __restrict__ positions, long long u,
                                              long long groups, unsigned H) {
    RopeUnit r;
    r.tt = u / groups;
    r.h_lo = (u - r.tt * groups) * g.heads_per_unit;
    r.h_hi = min(r.h_lo + g.heads_per_unit, (long long)H);
    const long long slot = r.tt % g.n_pos;
    r.pos = g.has_pos ? positions[slot] : (long long)g.pos_offset + slot;
    r.ok = r.pos >= 0 && r.pos < (long long)g.max_pos;
    return r;
}

template <typename T, int W, bool VEC, int STYLE>
__device__ __forceinline__ void rope_run(const T* q, T* q_out, const T* k, T* k_out, const T* q_w, const T* k_w,
                                         const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                         const long long* __restrict__ positions, const RopeGeom& g) {
    const long long half = g.head_dim / 2, d = g.head_dim;
    const unsigned nc = (unsigned)(half / W);  // chunks per head
    unsigned cp = 1;
    while (cp < nc && cp < 32) cp <<= 1;
    const unsigned hpw = 32 / cp, lane = threadIdx.x & 31, c = lane % cp, hs = lane / cp;
    const long long tstride = g.full ? d : half;
    const bool every_other = g.full && STYLE == 0;
    const long long tstep = every_other ? 2 : 1;
    const unsigned H = g.hq + g.hk;
    const long long groups = (H + g.heads_per_unit - 1) / g.heads_per_unit;
    const long long warps = blockDim.x / 32;  // the op launches ROPE_WARPS; any multiple of 32 threads works
    const long long warp0 = (long long)blockIdx.x * warps + threadIdx.x / 32, wstride = (long long)gridDim.x * warps;
    for (long long u = warp0; u < g.n_units; u += wstride) {  // warp-uniform
        const RopeUnit ru = rope_unit(g, positions, u, groups, H);
        const long long tt = ru.tt, h_lo = ru.h_lo, h_hi = ru.h_hi, pos = ru.pos;
        const bool ok = ru.ok;
        for (unsigned cb = 0; cb < nc; cb += cp) {
            const unsigned ch = cb + c;
            const bool act = ch < nc;
            const long long i = (long long)ch * W;
            // the norm weights (q's, k's): raw 16-byte words on the vector path (half the registers of fp32:
            // the bf16 / f16 kernels stay within 128 registers without spills), fp32 on the scalar one
            float cs[W], sn[W], wq[2 * W], wk[2 * W];
            uint4 wqr[2], wkr[2];
            rope_angles<W, VEC>(cos_t, sin_t, act && ok, pos * tstride + i * tstep, every_other, cs, sn);
            if (g.inverse) {
#pragma unroll
                for (int j = 0; j < W; j++) sn[j] = -sn[j];
            }
            long long oa, ob;
            rope_offsets<STYLE, W>(i, half, oa, ob);
            if (g.norm) {
#pragma unroll
                for (int e = 0; e < 2 * W; e++) wq[e] = wk[e] = 0.0f;
                wqr[0] = wqr[1] = wkr[0] = wkr[1] = make_uint4(0u, 0u, 0u, 0u);
                if (act) {
                    rope_ld<T, W, VEC>(q_w, oa, wqr[0], wq);
                    rope_ld<T, W, VEC>(q_w, ob, wqr[1], wq + W);
                    if (g.hk) {
                        rope_ld<T, W, VEC>(k_w, oa, wkr[0], wk);
                        rope_ld<T, W, VEC>(k_w, ob, wkr[1], wk + W);
                    }
                }
            }
            for (long long h0 = h_lo; h0 < h_hi; h0 += (long long)hpw * ROPE_RU) {
                float e[ROPE_RU][2 * W];
                uint4 ra[ROPE_RU], rb[ROPE_RU];
                bool live[ROPE_RU], isq[ROPE_RU];
                long long base[ROPE_RU];
#pragma unroll
                for (int r = 0; r < ROPE_RU; r++) {  // every load first: ROPE_RU x 2 in flight
                    const long long h = h0 + hs + (long long)r * hpw;
                    live[r] = act && h < h_hi;
                    isq[r] = h < (long long)g.hq;
                    base[r] = isq[r] ? (tt * g.hq + h) * d : (tt * g.hk + (h - g.hq)) * d;
                    if (live[r]) {
                        const T* src = isq[r] ? q : k;
                        rope_ld<T, W, VEC>(src, base[r] + oa, ra[r], e[r]);
                        rope_ld<T, W, VEC>(src, base[r] + ob, rb[r], e[r] + W);
                    }
                }
#pragma unroll
                for (int r = 0; r < ROPE_RU; r++) {
                    if (live[r]) {
                        rope_widen<T, W, VEC>(ra[r], e[r]);
                        rope_widen<T, W, VEC>(rb[r], e[r] + W);
                    } else {
#pragma unroll
                        for (int x = 0; x < 2 * W; x++) e[r][x] = 0.0f;
                    }
                    if (g.norm) {  // every lane of the warp takes part in the shuffles
                        float ss = 0.0f;
#pragma unroll
                        for (int x = 0; x < 2 * W; x++) ss += e[r][x] * e[r][x];
                        ss = rope_group_sum(ss, cp);
                        const float rs = rsqrtf(ss / (float)d + g.eps);
                        float w[2 * W];
                        if constexpr (VEC) {
                            rope_widen<T, W, VEC>(rope_sel(isq[r], wqr[0], wkr[0]), w);
                            rope_widen<T, W, VEC>(rope_sel(isq[r], wqr[1], wkr[1]), w + W);
                        } else {
#pragma unroll
                            for (int x = 0; x < 2 * W; x++) w[x] = isq[r] ? wq[x] : wk[x];
                        }
#pragma unroll
                        for (int x = 0; x < 2 * W; x++) e[r][x] = e[r][x] * rs * (w[x] + g.w_offset);
                    }
                    rope_rotate_all<STYLE, W>(e[r], cs, sn);
                    if (live[r]) {
                        T* dst = isq[r] ? q_out : k_out;
                        rope_st<T, W, VEC>(dst, base[r] + oa, e[r]);
                        rope_st<T, W, VEC>(dst, base[r] + ob, e[r] + W);
                    }
                }
            }
        }
    }
}

// rope_norm_backward: the gradients of rope with the norm (norm != 0 above). With n = x * r * wo (r =
// rsqrt(mean(x^2) + eps), wo = w_offset + w) and y the rotation of n: gn = the inverse rotation of gy, and
//   gx = r * (wo * gn - x * r^2 * sum(gn * wo * x) / d),  gw += gn * x * r  (summed over every head of q / k).
// The weight gradients stay deterministic: each lane sums its elements over the heads it visits, the lanes
// of one element in a warp add up through fixed xor shuffles, the block's 8 warps in warp order through
// shared memory, and each block writes one fp32 partial row per weight (pw_q / pw_k: gridDim.x rows of
// head_dim, every row written); norm_grad_reduce adds the rows in a fixed order. Needs half / W <= 32.
#define ROPE_BWD_MAX_D 512

// The block's partial row of one weight's gradient: the warp's HPW head slots of one element (lanes c, c + cp,
// ...) through xor shuffles, then the 8 warps in warp order through shared memory.
template <int W>
__device__ __forceinline__ void rope_block_partial(float (&acc)[2 * W], float* __restrict__ pw, float* red,
                                                   unsigned cp, unsigned hs, bool act, long long oa, long long ob,
                                                   long long d, unsigned warp) {
#pragma unroll
    for (int e = 0; e < 2 * W; e++) {
        for (unsigned off = cp; off < 32; off <<= 1) acc[e] += __shfl_xor_sync(PK_FULL_MASK, acc[e], off);
    }
    if (hs == 0 && act) {
#pragma unroll
        for (int e = 0; e < W; e++) {
            red[warp * d + oa + e] = acc[e];
            red[warp * d + ob + e] = acc[W + e];
        }
    }
    __syncthreads();
    for (long long col = threadIdx.x; col < d; col += blockDim.x) {
        float s = 0.0f;
        for (unsigned w = 0; w < blockDim.x / 32; w++) s += red[w * d + col];
        pw[(long long)blockIdx.x * d + col] = s;
    }
    __syncthreads();  // red is rewritten by the next weight
}

template <typename T, int W, bool VEC, int STYLE>
__device__ __forceinline__ void rope_norm_backward_run(const T* q, const T* k, const T* gq_out, const T* gk_out,
                                                       T* gq, T* gk, const T* q_w, const T* k_w,
                                                       const float* __restrict__ cos_t,
                                                       const float* __restrict__ sin_t,
                                                       const long long* __restrict__ positions,
                                                       float* __restrict__ pw_q, float* __restrict__ pw_k,
                                                       float* red, const RopeGeom& g) {
    const long long half = g.head_dim / 2, d = g.head_dim;
    const unsigned nc = (unsigned)(half / W);
    unsigned cp = 1;
    while (cp < nc && cp < 32) cp <<= 1;
    const unsigned hpw = 32 / cp, lane = threadIdx.x & 31, c = lane % cp, hs = lane / cp, warp = threadIdx.x / 32;
    const bool act = c < nc;
    const long long tstride = g.full ? d : half;
    const bool every_other = g.full && STYLE == 0;
    const long long tstep = every_other ? 2 : 1;
    const unsigned H = g.hq + g.hk;
    const long long groups = (H + g.heads_per_unit - 1) / g.heads_per_unit;
    const long long i = (long long)c * W;
    long long oa, ob;
    rope_offsets<STYLE, W>(i, half, oa, ob);
    // this lane's weight entries (fixed: its chunk never changes) and its weight-gradient sums
    float wq[2 * W], wk[2 * W], aq[2 * W], ak[2 * W];
#pragma unroll
    for (int e = 0; e < 2 * W; e++) wq[e] = wk[e] = aq[e] = ak[e] = 0.0f;
    if (act) {
        uint4 r0, r1;
        rope_ld<T, W, VEC>(q_w, oa, r0, wq);
        rope_ld<T, W, VEC>(q_w, ob, r1, wq + W);
        rope_widen<T, W, VEC>(r0, wq);
        rope_widen<T, W, VEC>(r1, wq + W);
        if (g.hk) {
            rope_ld<T, W, VEC>(k_w, oa, r0, wk);
            rope_ld<T, W, VEC>(k_w, ob, r1, wk + W);
            rope_widen<T, W, VEC>(r0, wk);
            rope_widen<T, W, VEC>(r1, wk + W);
        }
    }
#pragma unroll
    for (int e = 0; e < 2 * W; e++) {
        wq[e] += g.w_offset;
        wk[e] += g.w_offset;
    }
    const long long warps = blockDim.x / 32;  // at most ROPE_WARPS (launch bounds 256)
    const long long warp0 = (long long)blockIdx.x * warps + warp, wstride = (long long)gridDim.x * warps;
    for (long long u = warp0; u < g.n_units; u += wstride) {  // warp-uniform
        const RopeUnit ru = rope_unit(g, positions, u, groups, H);
        const long long tt = ru.tt, h_lo = ru.h_lo, h_hi = ru.h_hi, pos = ru.pos;
        const bool ok = ru.ok;
        float cs[W], sn[W];
        rope_angles<W, VEC>(cos_t, sin_t, act && ok, pos * tstride + i * tstep, every_other, cs, sn);
#pragma unroll
        for (int j = 0; j < W; j++) sn[j] = -sn[j];  // the transpose of the forward's rotation
        for (long long h0 = h_lo; h0 < h_hi; h0 += hpw) {
            const long long h = h0 + hs;
            const bool live = act && h < h_hi, isq = h < (long long)g.hq;
            const long long base = isq ? (tt * g.hq + h) * d : (tt * g.hk + (h - g.hq)) * d;
            float x[2 * W], gn[2 * W];
            uint4 r0, r1, r2, r3;
            if (live) {  // four loads in flight before any conversion
                rope_ld<T, W, VEC>(isq ? q : k, base + oa, r0, x);
                rope_ld<T, W, VEC>(isq ? q : k, base + ob, r1, x + W);
                rope_ld<T, W, VEC>(isq ? gq_out : gk_out, base + oa, r2, gn);
                rope_ld<T, W, VEC>(isq ? gq_out : gk_out, base + ob, r3, gn + W);
                rope_widen<T, W, VEC>(r0, x);
                rope_widen<T, W, VEC>(r1, x + W);
                rope_widen<T, W, VEC>(r2, gn);
                rope_widen<T, W, VEC>(r3, gn + W);
            } else {
#pragma unroll
                for (int e = 0; e < 2 * W; e++) x[e] = gn[e] = 0.0f;
            }
            rope_rotate_all<STYLE, W>(gn, cs, sn);
            float ss = 0.0f, dot = 0.0f;
#pragma unroll
            for (int e = 0; e < 2 * W; e++) {
                ss += x[e] * x[e];
                dot += gn[e] * (isq ? wq[e] : wk[e]) * x[e];
            }
            ss = rope_group_sum(ss, cp);
            dot = rope_group_sum(dot, cp);
            const float rs = rsqrtf(ss / (float)d + g.eps);
            const float corr = rs * rs * dot / (float)d;
            float gx[2 * W];
#pragma unroll
            for (int e = 0; e < 2 * W; e++) {
                const float wo = isq ? wq[e] : wk[e];
                gx[e] = rs * (wo * gn[e] - x[e] * corr);
                const float gw = live ? gn[e] * x[e] * rs : 0.0f;
                if (isq) aq[e] += gw;
                else ak[e] += gw;
            }
            if (live) {
                rope_st<T, W, VEC>(isq ? gq : gk, base + oa, gx);
                rope_st<T, W, VEC>(isq ? gq : gk, base + ob, gx + W);
            }
        }
    }
    rope_block_partial<W>(aq, pw_q, red, cp, hs, act, oa, ob, d, warp);
    rope_block_partial<W>(ak, pw_k, red, cp, hs, act, oa, ob, d, warp);
}

template <typename T, typename F>
__device__ __forceinline__ void rope_dispatch(int style, bool vec, long long half, F&& f) {
    constexpr int V = PkVec16<T>::N;
    if (vec && half % V == 0) {
        if (style == 1) f(PkWidth<V>(), PkWidth<1>(), PkWidth<1>());
        else f(PkWidth<V>(), PkWidth<0>(), PkWidth<1>());
    } else {
        if (style == 1) f(PkWidth<1>(), PkWidth<1>(), PkWidth<0>());
        else f(PkWidth<1>(), PkWidth<0>(), PkWidth<0>());
    }
}

template <typename T>
__device__ __forceinline__ void rope_impl(const T* q, T* q_out, const T* k, T* k_out, const T* q_w, const T* k_w,
                                          const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                          const long long* __restrict__ positions, long long n_tok,
                                          long long n_units, unsigned int heads_per_unit, unsigned int n_pos,
                                          unsigned int hq, unsigned int hk, unsigned int head_dim,
                                          unsigned int pos_offset, unsigned int max_pos, int has_pos,
                                          int full_table, int style, int inverse, int norm, float eps,
                                          float w_offset) {
    const RopeGeom g{n_tok, n_units, (long long)heads_per_unit, hq, hk, head_dim, n_pos, pos_offset, max_pos,
                     has_pos != 0, full_table != 0, inverse != 0, norm != 0, eps, w_offset};
    const bool vec = pk_aligned16(q) && pk_aligned16(q_out) && pk_aligned16(k) && pk_aligned16(k_out) &&
                     pk_aligned16(cos_t) && pk_aligned16(sin_t) && (!norm || (pk_aligned16(q_w) && pk_aligned16(k_w)));
    rope_dispatch<T>(style, vec, head_dim / 2, [&](auto w, auto st, auto v) {
        rope_run<T, decltype(w)::value, (decltype(v)::value != 0), decltype(st)::value>(q, q_out, k, k_out, q_w, k_w, cos_t,
                                                                                 sin_t, positions, g);
    });
}

PK_IO_KERNELS(rope, (256),
              (const T* q, T* q_out, const T* k, T* k_out, const T* q_w, const T* k_w,
               const float* __restrict__ cos_table, const float* __restrict__ sin_table,
               const long long* __restrict__ positions, long long n_tok, long long n_units,
               unsigned int heads_per_unit, unsigned int n_pos, unsigned int hq, unsigned int hk,
               unsigned int head_dim, unsigned int pos_offset, unsigned int max_pos, int has_pos, int full_table,
               int style, int inverse, int norm, float eps, float w_offset),
              (q, q_out, k, k_out, q_w, k_w, cos_table, sin_table, positions, n_tok, n_units, heads_per_unit, n_pos,
               hq, hk, head_dim, pos_offset, max_pos, has_pos, full_table, style, inverse, norm, eps, w_offset))

template <typename T>
__device__ __forceinline__ void rope_norm_backward_impl(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ gq_out, const T* __restrict__ gk_out,
    T* __restrict__ gq, T* __restrict__ gk, const T* __restrict__ q_w, const T* __restrict__ k_w,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, const long long* __restrict__ positions,
    float* __restrict__ pw_q, float* __restrict__ pw_k, long long n_tok, long long n_units,
    unsigned int heads_per_unit, unsigned int n_pos, unsigned int hq, unsigned int hk, unsigned int head_dim,
    unsigned int pos_offset, unsigned int max_pos, int has_pos, int full_table, int style, float eps,
    float w_offset) {
    const RopeGeom g{n_tok, n_units, (long long)heads_per_unit, hq, hk, head_dim, n_pos, pos_offset, max_pos,
                     has_pos != 0, full_table != 0, true, true, eps, w_offset};
    const bool vec = pk_aligned16(q) && pk_aligned16(k) && pk_aligned16(gq_out) && pk_aligned16(gk_out) &&
                     pk_aligned16(gq) && pk_aligned16(gk) && pk_aligned16(q_w) && pk_aligned16(k_w) &&
                     pk_aligned16(cos_t) && pk_aligned16(sin_t);
    __shared__ float red[ROPE_WARPS * ROPE_BWD_MAX_D];  // one buffer for every variant (static shared adds up)
    rope_dispatch<T>(style, vec, head_dim / 2, [&](auto w, auto st, auto v) {
        rope_norm_backward_run<T, decltype(w)::value, (decltype(v)::value != 0), decltype(st)::value>(
            q, k, gq_out, gk_out, gq, gk, q_w, k_w, cos_t, sin_t, positions, pw_q, pw_k, red, g);
    });
}

PK_IO_KERNELS(rope_norm_backward, (256),
              (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ grad_q_out,
               const T* __restrict__ grad_k_out, T* __restrict__ grad_q, T* __restrict__ grad_k,
               const T* __restrict__ q_w, const T* __restrict__ k_w, const float* __restrict__ cos_table,
               const float* __restrict__ sin_table, const long long* __restrict__ positions,
               float* __restrict__ partial_q_w, float* __restrict__ partial_k_w, long long n_tok, long long n_units,
               unsigned int heads_per_unit, unsigned int n_pos, unsigned int hq, unsigned int hk,
               unsigned int head_dim, unsigned int pos_offset, unsigned int max_pos, int has_pos, int full_table,
               int style, float eps, float w_offset),
              (q, k, grad_q_out, grad_k_out, grad_q, grad_k, q_w, k_w, cos_table, sin_table, positions, partial_q_w,
               partial_k_w, n_tok, n_units, heads_per_unit, n_pos, hq, hk, head_dim, pos_offset, max_pos, has_pos,
               full_table, style, eps, w_offset))

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
            pk_ld2_widen16<T, RMS_CACHE_VECS>(xr, weight, [&](int sl) {
                const unsigned int c = threadIdx.x + sl * blockDim.x;
                return c < dim / N ? (long long)c * N : 0LL;
            }, f, wt);
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
