// Attention windows (flash-attn's window_size, FlashInfer's window_left) shared by the attention kernels.
//
// Query i sees key j iff i + s - window_left <= j <= i + s + window_right, s = n_k - n_q (aligned
// bottom-right like the causal mask). The ops pass normalized sides: causal is window_right = 0,
// an unbounded side (-1) is n_k (left) or n_q (right), so 0 <= window_left <= n_k and
// 0 <= window_right <= n_q and every sum below fits in 64 bits. The spans are computed once per
// CTA / lane: a kernel loops over the tiles of [lo, hi] only (skipped tiles are never read), and
// masks only tiles that reach outside [full_lo, full_hi] (the keys every row of the CTA sees).
#pragma once

struct PkAttnSpan {
    int lo, hi;            // the other side's indices some row of [a0, a1] sees (hi < lo: none)
    int full_lo, full_hi;  // the indices every row of [a0, a1] sees (clamped to [-1, n_b])
};

__device__ __forceinline__ int pk_attn_clamp(long long x, int lo, int hi) {
    return x < lo ? lo : (x > hi ? hi : (int)x);
}

// Rows [a0, a1] see b indices [a + off - back, a + off + fwd] of [0, n_b).
__device__ __forceinline__ PkAttnSpan pk_attn_span(int a0, int a1, int n_b, long long off, int back, int fwd) {
    PkAttnSpan s;
    const int lo = pk_attn_clamp(a0 + off - back, 0, n_b);
    const int hi = pk_attn_clamp(a1 + off + fwd, -1, n_b - 1);
    s.lo = lo <= hi ? lo : 0;
    s.hi = lo <= hi ? hi : -1;
    s.full_lo = pk_attn_clamp(a1 + off - back, -1, n_b);
    s.full_hi = pk_attn_clamp(a0 + off + fwd, -1, n_b - 1);
    return s;
}

// Keys a query tile [q0, q_last] sees.
__device__ __forceinline__ PkAttnSpan pk_attn_q_span(int q0, int q_last, int n_q, int n_k, int wl, int wr) {
    return pk_attn_span(q0, q_last, n_k, (long long)n_k - n_q, wl, wr);
}

// Queries that see some key of [k0, k_last] (key j is seen by queries j - s - wr .. j - s + wl).
__device__ __forceinline__ PkAttnSpan pk_attn_k_span(int k0, int k_last, int n_q, int n_k, int wl, int wr) {
    return pk_attn_span(k0, k_last, n_q, (long long)n_q - n_k, wr, wl);
}

// Keys [lo, hi] one query row sees (lo > hi: none; keys past n_k excluded; a row past n_q sees none).
__device__ __forceinline__ void pk_attn_q_row(int row, int n_q, int n_k, int wl, int wr, int& lo, int& hi) {
    const long long c = (long long)row + n_k - n_q;
    lo = pk_attn_clamp(c - wl, 0, n_k);
    hi = row < n_q ? pk_attn_clamp(c + wr, -1, n_k - 1) : -1;
}

// A query-tile CTA's place in a grid of batch * n_heads * ceil(n_q / br) CTAs: batch b, head h, its kv head kvh
// (GQA: n_heads / n_kv_heads heads share one) and query tile qt. Causal (window_right < n_q): the longest tiles
// (the last ones) are launched first, so short tiles fill in at the end.
struct PkAttnQTile {
    int b, h, kvh, qt;
};
__device__ __forceinline__ PkAttnQTile pk_attn_q_tile(int n_q, int br, int n_heads, int n_kv_heads, int window_right) {
    const int n_qt = (n_q + br - 1) / br;
    const int bh = blockIdx.x / n_qt;
    PkAttnQTile c;
    c.qt = window_right < n_q ? n_qt - 1 - (int)(blockIdx.x % n_qt) : (int)(blockIdx.x % n_qt);
    c.b = bh / n_heads, c.h = bh % n_heads;
    c.kvh = c.h / (n_heads / n_kv_heads);
    return c;
}

// Keys [lo[r], hi[r]] that query rows row0 and row0 + 8 (an mma fragment's two rows, r = 0 / 1) see.
__device__ __forceinline__ void pk_attn_q_rows(int row0, int n_q, int n_k, int wl, int wr, int (&lo)[2],
                                               int (&hi)[2]) {
    pk_attn_q_row(row0, n_q, n_k, wl, wr, lo[0], hi[0]);
    pk_attn_q_row(row0 + 8, n_q, n_k, wl, wr, lo[1], hi[1]);
}

// Queries [lo, hi] that see one key (queries past n_q excluded; a key past n_k is seen by none).
__device__ __forceinline__ void pk_attn_k_row(int key, int n_q, int n_k, int wl, int wr, int& lo, int& hi) {
    const long long c = (long long)key + n_q - n_k;
    lo = pk_attn_clamp(c - wr, 0, n_q);
    hi = key < n_k ? pk_attn_clamp(c + wl, -1, n_q - 1) : -1;
}

// The dense attention forwards' parameters (attention_fwd_fma.cu and attention_fwd_tc.cu: one op, one launch
// signature whichever family runs it).
#define PK_ATTN_FWD_PARAMS                                                                                       \
    (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,              \
     float* __restrict__ lse, int batch, int n_q, int n_k, int n_heads, int n_kv_heads, int head_dim,             \
     int head_dim_v, float scale, int window_left, int window_right, float softcap)
#define PK_ATTN_FWD_ARGS                                                                                         \
    (q, k, v, out, lse, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, head_dim_v, scale, window_left,           \
     window_right, softcap)
