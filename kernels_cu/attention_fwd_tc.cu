// Tensor-core FlashAttention forward for bf16 and f16 (one template over the element type T), one code
// path for sm_80 ... sm_120:
// O = softmax(scale * Q K^T [+ window mask]) V and the natural-log lse per row, with the same
// layouts, GQA mapping, bottom-right window / causal mask, softcap and empty-row convention as
// attention_fwd_fma.cu (rows that see no key: out = 0, lse = -inf).
//
// Window: query i sees keys j with i + s - window_left <= j <= i + s + window_right, s = n_k - n_q
// (the op normalizes: causal is window_right = 0, unbounded sides are n_k / n_q). The CTA loops
// only over the key tiles its rows can see, so the cost follows the window; the mask is applied
// only in tiles that some row sees partly (a runtime test per tile, as the causal mask was).
// Softcap (the _softcap entry points, a template flag so the others carry no tanh): scores
// become softcap * tanh(scale * q.k / softcap), via tanh.approx (one MUFU op a score).
//
// Work split (FlashAttention-2): a CTA of 4 warps owns BR = 64 consecutive queries of one
// (batch, head); warp w owns query rows 16w..16w+15 of the tile, so the whole online
// softmax of a row stays inside one warp (the 4 lanes of a quad share a row). Keys/values
// stream in tiles of BC rows through shared memory, double-buffered with cp.async: the
// copy of tile j+1 is issued before tile j is used and waited for after it.
//   S = Q K_j^T : mma.m16n8k16 bf16 / f16 -> f32; Q as A (ldmatrix; kept in registers for
//                 D <= 128), K as B (ldmatrix, non-transposed: K rows are B's columns).
//   online softmax on the S accumulator fragments, in base 2: s * (scale * log2 e), one
//                 rescale of O per tile, exp2 via ex2.approx.
//   O += P V_j  : P rounded to T in registers (cvt.rn.bf16x2 / .f16x2) straight from the S
//                 accumulator layout into the A layout (no shared-memory round trip),
//                 V as B through ldmatrix.trans.
// Shared rows are padded to D + 8 halves (16 bytes) so the 8 row addresses of an ldmatrix
// phase fall in distinct banks. head_dim is a compile-time D (64/96/128/256); the op pads
// other head_dims up, and tiles are zero-filled past head_dim / head_dim_v / n_q / n_k so
// padded lanes add exact zeros (keys past n_k are also masked to -inf).
// Global -> shared copies use 16-byte cp.async when head_dim % 8 == 0 and the base is
// 16-byte aligned, else element-wise loads (correct for any head_dim, slower).
#include "pk_attn_tc.cuh"
#include "pk_attn_core.cuh"

#define FATC_BR 64

// BC: keys per tile; QREG: Q fragments live in registers for the whole CTA (D <= 128; for
// D = 256 the 128-float O accumulator leaves no room, so Q is re-read with ldmatrix);
// MINB: CTAs per SM asked of ptxas (caps registers at 65536 / (128 * MINB)).
template <int D> struct FatcCfg;
template <> struct FatcCfg<64> { enum { BC = 64, QREG = 1, MINB = 3 }; };
template <> struct FatcCfg<96> { enum { BC = 64, QREG = 1, MINB = 2 }; };
template <> struct FatcCfg<128> { enum { BC = 64, QREG = 1, MINB = 2 }; };
template <> struct FatcCfg<256> { enum { BC = 32, QREG = 0, MINB = 1 }; };

// Shared-memory bytes of one CTA (the op passes the same figure as dynamic shared memory).
// With QREG the Q tile is staged in the second K buffer, which is free until tile 1 arrives.
#define FATC_SMEM_BYTES(D, BC, QREG) ((((QREG) ? 0 : FATC_BR) + 4 * (BC)) * ((D) + 8) * 2)

template <typename T, int D, bool SC>
__device__ __forceinline__ void fatc_forward(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                             T* __restrict__ out, float* __restrict__ lse, int batch, int n_q,
                                             int n_k, int n_heads, int n_kv_heads, int head_dim, int head_dim_v,
                                             float scale, int window_left, int window_right, float softcap) {
    constexpr int BC = FatcCfg<D>::BC, QREG = FatcCfg<D>::QREG;
    constexpr int SD = D + 8;    // padded shared row, in halves
    constexpr int NT = BC / 8;   // S n-tiles per warp
    constexpr int KS = D / 16;   // k-steps of Q K^T
    constexpr int ON = D / 8;    // O n-tiles
    extern __shared__ __align__(16) unsigned short fatc_smem[];
    unsigned short* kbuf = fatc_smem;               // [2][BC][SD]
    unsigned short* vbuf = fatc_smem + 2 * BC * SD;  // [2][BC][SD]
    unsigned short* qs = QREG ? kbuf + BC * SD : fatc_smem + 4 * BC * SD;  // [BR][SD]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const PkAttnQTile tile = pk_attn_q_tile(n_q, FATC_BR, n_heads, n_kv_heads, window_right);
    const int b = tile.b, h = tile.h, kvh = tile.kvh, qt = tile.qt;
    const int q0 = qt * FATC_BR;
    const int q_last = min(q0 + FATC_BR, n_q) - 1;
    // Key tiles [kt0, kt1) hold every key some row of the tile sees; keys in [full_lo, full_hi]
    // are seen by every row (tiles inside need no mask).
    const PkAttnSpan span = pk_attn_q_span(q0, q_last, n_q, n_k, window_left, window_right);
    const int kt0 = span.lo / BC, kt1 = span.hi < span.lo ? kt0 : span.hi / BC + 1;
    const long long q_stride = (long long)n_heads * head_dim, kv_stride = (long long)n_kv_heads * head_dim;
    const long long v_stride = (long long)n_kv_heads * head_dim_v;
    const long long q_base = (long long)b * n_q * q_stride + (long long)h * head_dim;
    const long long k_base = (long long)b * n_k * kv_stride + (long long)kvh * head_dim;
    const long long v_base = (long long)b * n_k * v_stride + (long long)kvh * head_dim_v;
    const bool vq = (head_dim & 7) == 0 && (reinterpret_cast<unsigned long long>(q) & 15) == 0;
    const bool vk = (head_dim & 7) == 0 && (reinterpret_cast<unsigned long long>(k) & 15) == 0;
    const bool vv = (head_dim_v & 7) == 0 && (reinterpret_cast<unsigned long long>(v) & 15) == 0;

    fatc_load_tile<D, FATC_BR>(qs, q, q_base, q_stride, q0, n_q, head_dim, vq);
    if (kt1 > kt0) {
        fatc_load_tile<D, BC>(kbuf, k, k_base, kv_stride, kt0 * BC, n_k, head_dim, vk);
        fatc_load_tile<D, BC>(vbuf, v, v_base, v_stride, kt0 * BC, n_k, head_dim_v, vv);
    }
    pk_cp_async_commit();
    pk_cp_async_wait<0>();
    __syncthreads();

    // ldmatrix row addresses: lane -> (row, col) of the 4 8x8 matrices it addresses.
    const int a_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);  // Q (A)
    const int kb_row = lane & 7, kb_col = 8 * (lane >> 3);                                     // K (B)
    const int vb_row = (lane & 7) + 8 * ((lane >> 3) & 1), vb_col = 8 * (lane >> 4);            // V (B, .trans)

    unsigned int qa[QREG ? KS : 1][4];
    if (QREG) {
#pragma unroll
        for (int ks = 0; ks < (QREG ? KS : 1); ks++) pk_ldmatrix_x4(qa[ks], qs + a_row * SD + ks * 16 + a_col);
        __syncthreads();  // qs is the second K buffer: every warp has its Q before tile 1 lands there
    }

    float o[ON][4];
#pragma unroll
    for (int i = 0; i < ON; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m[2] = {PK_NEG_INF, PK_NEG_INF}, l[2] = {0.0f, 0.0f};  // rows g and g + 8 of the warp
    // Base-2 scores: s * scale * log2 e, or with softcap c: tanh(s * scale / c) * c * log2 e.
    const float sl2 = SC ? softcap * 1.4426950408889634f : scale * 1.4426950408889634f;
    const float pre = SC ? scale / softcap : 0.0f;
    const int row0 = q0 + warp * 16 + g;  // this lane's rows: row0, row0 + 8
    int rlo[2], rhi[2];  // keys [rlo, rhi] visible to this lane's rows
    pk_attn_q_rows(row0, n_q, n_k, window_left, window_right, rlo, rhi);

    for (int j = kt0; j < kt1; j++) {
        const int k0 = j * BC;
        if (j + 1 < kt1) {  // prefetch tile j + 1 into the other buffer (freed by last iteration's barrier)
            const int nb = (j + 1 - kt0) & 1;
            fatc_load_tile<D, BC>(kbuf + nb * BC * SD, k, k_base, kv_stride, k0 + BC, n_k, head_dim, vk);
            fatc_load_tile<D, BC>(vbuf + nb * BC * SD, v, v_base, v_stride, k0 + BC, n_k, head_dim_v, vv);
        }
        pk_cp_async_commit();
        const unsigned short* ks_ = kbuf + ((j - kt0) & 1) * BC * SD;
        const unsigned short* vs_ = vbuf + ((j - kt0) & 1) * BC * SD;

        float s[NT][4];
#pragma unroll
        for (int i = 0; i < NT; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kp = 0; kp < D / 32; kp++) {
            unsigned int a0[4], a1[4];
            if (QREG) {
#pragma unroll
                for (int i = 0; i < 4; i++) a0[i] = qa[QREG ? 2 * kp : 0][i], a1[i] = qa[QREG ? 2 * kp + 1 : 0][i];
            } else {
                pk_ldmatrix_x4(a0, qs + a_row * SD + kp * 32 + a_col);
                pk_ldmatrix_x4(a1, qs + a_row * SD + kp * 32 + 16 + a_col);
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                unsigned int kb[4];  // b of k-step 2kp in kb[0..1], of 2kp + 1 in kb[2..3]
                pk_ldmatrix_x4(kb, ks_ + (nt * 8 + kb_row) * SD + kp * 32 + kb_col);
                pk_mma_m16n8k16<T>(s[nt], a0, kb, s[nt]);
                pk_mma_m16n8k16<T>(s[nt], a1, kb + 2, s[nt]);
            }
        }

        // Scale to base 2 (through the softcap), mask (keys past n_k; the window), and the online softmax per row.
        const bool need_mask = k0 < span.full_lo || k0 + BC - 1 > span.full_hi;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = SC ? __tanhf(s[nt][e] * pre) * sl2 : s[nt][e] * sl2;
                if (need_mask) {
                    const int col = k0 + nt * 8 + 2 * t + (e & 1);
                    if (col < rlo[e >> 1] || col > rhi[e >> 1]) x = PK_NEG_INF;
                }
                s[nt][e] = x;
            }
        }
        fatc_online_softmax(s, o, m, l);

        // O += P V: the S accumulators of n-tiles 2kk, 2kk + 1 are exactly the A fragment of k-step kk.
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            unsigned int pa[4];
            pk_acc_to_a<T>(pa, s, kk);
#pragma unroll
            for (int np = 0; np < D / 16; np++) {
                unsigned int vb[4];  // b of O n-tile 2np in vb[0..1], of 2np + 1 in vb[2..3]
                pk_ldmatrix_x4_trans(vb, vs_ + (kk * 16 + vb_row) * SD + np * 16 + vb_col);
                pk_mma_m16n8k16<T>(o[2 * np], pa, vb, o[2 * np]);
                pk_mma_m16n8k16<T>(o[2 * np + 1], pa, vb + 2, o[2 * np + 1]);
            }
        }
        pk_cp_async_wait<0>();
        __syncthreads();  // tile j + 1 is in; every warp is done with buffer j & 1 before it is refilled
    }

    const bool vo = (head_dim_v & 1) == 0 && (reinterpret_cast<unsigned long long>(out) & 3) == 0;
    const long long o_stride = (long long)n_heads * head_dim_v;
    pk_attn_epilogue(  // m is in log2 units already
        l, m, 1.0f, 1.0f, row0, n_q,
        [&](int r, int row, float inv) {
            const long long ob = ((long long)b * n_q + row) * o_stride + (long long)h * head_dim_v;
#pragma unroll
            for (int i = 0; i < ON; i++) {
                const int col = i * 8 + 2 * t;
                if (col >= head_dim_v) continue;
                const float x0 = o[i][2 * r] * inv, x1 = o[i][2 * r + 1] * inv;
                pk_store_pair<T>(out, ob, col, head_dim_v, vo, x0, x1);
            }
        },
        [&](int row) { return lse + ((long long)b * n_q + row) * n_heads + h; });
}

// Entry points per compiled head_dim and softcap flag, in bf16 and f16 (the sm_75 build traps: the op
// uses attention_fwd_fma_d*_bf16 / _f16 there).
PK_ATTN_TC_ENTRY(fatc_entry, fatc_forward)
PK_IO_VARIANT(attention_fwd_tc_pad_d64, fatc_entry, 64, false)
PK_IO_VARIANT(attention_fwd_tc_pad_d64_softcap, fatc_entry, 64, true)
PK_IO_VARIANT(attention_fwd_tc_d96, fatc_entry, 96, false)
PK_IO_VARIANT(attention_fwd_tc_d96_softcap, fatc_entry, 96, true)
PK_IO_VARIANT(attention_fwd_tc_pad_d128, fatc_entry, 128, false)
PK_IO_VARIANT(attention_fwd_tc_pad_d128_softcap, fatc_entry, 128, true)
PK_IO_VARIANT(attention_fwd_tc_d256, fatc_entry, 256, false)
PK_IO_VARIANT(attention_fwd_tc_d256_softcap, fatc_entry, 256, true)

#define FATC_FWD_PARAMS PK_ATTN_FWD_PARAMS  // (pk_attn_window.cuh: attention_fwd_fma.cu's too)
#define FATC_FWD_ARGS PK_ATTN_FWD_ARGS
PK_IO16_KERNELS(attention_fwd_tc_pad_d64, (FATC_THREADS, FatcCfg<64>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)
PK_IO16_KERNELS(attention_fwd_tc_pad_d64_softcap, (FATC_THREADS, FatcCfg<64>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)
PK_IO16_KERNELS(attention_fwd_tc_d96, (FATC_THREADS, FatcCfg<96>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)
PK_IO16_KERNELS(attention_fwd_tc_d96_softcap, (FATC_THREADS, FatcCfg<96>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)
PK_IO16_KERNELS(attention_fwd_tc_pad_d128, (FATC_THREADS, FatcCfg<128>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)
PK_IO16_KERNELS(attention_fwd_tc_pad_d128_softcap, (FATC_THREADS, FatcCfg<128>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)
PK_IO16_KERNELS(attention_fwd_tc_d256, (FATC_THREADS, FatcCfg<256>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)
PK_IO16_KERNELS(attention_fwd_tc_d256_softcap, (FATC_THREADS, FatcCfg<256>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)

// ---------------------------------------------------------------------------------------------------------
// The FlashAttention-2 core (pk_attn_core.cuh): 128 queries a CTA of 8 warps, for head_dim == head_dim_v ==
// D in {64, 128} with 16-byte aligned q / k / v / out (the op checks; other shapes take the _pad_ kernels
// above). Same parameters, grid order and results as the kernels above.
template <typename T, int D, bool SC>
__device__ __forceinline__ void fafa_dense(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                           T* __restrict__ out, float* __restrict__ lse, int batch, int n_q, int n_k,
                                           int n_heads, int n_kv_heads, int head_dim, int head_dim_v, float scale,
                                           int window_left, int window_right, float softcap) {
    const PkAttnQTile tile = pk_attn_q_tile(n_q, PKFA_BR, n_heads, n_kv_heads, window_right);
    const int b = tile.b, h = tile.h, kvh = tile.kvh, qt = tile.qt;
    const long long qs = (long long)n_heads * D, kvs = (long long)n_kv_heads * D;
    const long long qo = (long long)b * n_q * qs + (long long)h * D;
    const long long ko = (long long)b * n_k * kvs + (long long)kvh * D;
    extern __shared__ __align__(16) unsigned char fafa_smem[];
    PkFaDenseKV<T, D> kv;
    pkfa_forward<T, D, SC>(fafa_smem, kv, q + qo, qs, k + ko, v + ko, kvs, kvs, out, qo, qs, lse, (long long)b * n_q * n_heads + h,
                           n_heads, qt * PKFA_BR, n_q, n_k, scale, window_left, window_right, softcap);
}

PK_ATTN_TC_ENTRY(fafa_dense_entry, fafa_dense)
PK_IO_VARIANT(attention_fwd_tc_d64, fafa_dense_entry, 64, false)
PK_IO_VARIANT(attention_fwd_tc_d64_softcap, fafa_dense_entry, 64, true)
PK_IO_VARIANT(attention_fwd_tc_d128, fafa_dense_entry, 128, false)
PK_IO_VARIANT(attention_fwd_tc_d128_softcap, fafa_dense_entry, 128, true)

PK_IO16_KERNELS(attention_fwd_tc_d64, (PKFA_THREADS, PkFaCfg<64>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)
PK_IO16_KERNELS(attention_fwd_tc_d64_softcap, (PKFA_THREADS, PkFaCfg<64>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)
PK_IO16_KERNELS(attention_fwd_tc_d128, (PKFA_THREADS, PkFaCfg<128>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)
PK_IO16_KERNELS(attention_fwd_tc_d128_softcap, (PKFA_THREADS, PkFaCfg<128>::MINB), FATC_FWD_PARAMS, FATC_FWD_ARGS)

// ---------------------------------------------------------------------------------------------------------
// flash_attention_varlen on the same core (bf16 and f16): sequences packed without
// padding, q / out (total_q, n_heads, D),
// k / v (total_k, n_kv_heads, D), lse (total_q, n_heads); sequence b is q rows cu_q[b]..cu_q[b+1] against k/v
// rows cu_k[b]..cu_k[b+1] (a negative length counts as 0). Grid (n_qt * n_heads, batch): query tile
// blockIdx.x / n_heads of head blockIdx.x % n_heads (tiles past the sequence exit at once). The window
// (wl, wr) is per sequence, normalized as the serving ops do (unbounded = 2^30, causal: wr = 0).
template <typename T, int D, bool SC>
__device__ __forceinline__ void fafa_varlen(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                            T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ cu_q,
                                            const int* __restrict__ cu_k, int n_heads, int n_kv_heads, int n_qt,
                                            float scale, int window_left, int window_right, float softcap) {
    const int b = blockIdx.y, h = (int)(blockIdx.x % n_heads);
    const int q_beg = cu_q[b], k_beg = cu_k[b];
    const int n_q = max(cu_q[b + 1] - q_beg, 0), n_k = max(cu_k[b + 1] - k_beg, 0);
    const int n_tiles = (n_q + PKFA_BR - 1) / PKFA_BR;
    const int i = (int)(blockIdx.x / n_heads);
    if (i >= n_tiles) return;  // CTA-uniform, before any barrier
    // Causal / right-bounded windows: the longest query tiles (the last ones) first.
    const int qt = window_right < n_q ? n_tiles - 1 - i : i;
    const int kvh = h / (n_heads / n_kv_heads);
    const long long qs = (long long)n_heads * D, kvs = (long long)n_kv_heads * D;
    const long long qo = (long long)q_beg * qs + (long long)h * D;
    const long long ko = (long long)k_beg * kvs + (long long)kvh * D;
    extern __shared__ __align__(16) unsigned char fafa_vsmem[];
    PkFaDenseKV<T, D> kv;
    pkfa_forward<T, D, SC>(fafa_vsmem, kv, q + qo, qs, k + ko, v + ko, kvs, kvs, out, qo, qs, lse,
                           (long long)q_beg * n_heads + h, n_heads, qt * PKFA_BR, n_q, n_k, scale, window_left,
                           window_right, softcap);
    (void)n_qt;
}

PK_ATTN_TC_ENTRY(fafa_varlen_entry, fafa_varlen)
PK_IO_VARIANT(attention_fwd_varlen_tc_d64, fafa_varlen_entry, 64, false)
PK_IO_VARIANT(attention_fwd_varlen_tc_d64_softcap, fafa_varlen_entry, 64, true)
PK_IO_VARIANT(attention_fwd_varlen_tc_d128, fafa_varlen_entry, 128, false)
PK_IO_VARIANT(attention_fwd_varlen_tc_d128_softcap, fafa_varlen_entry, 128, true)

#define FAFA_VARLEN_PARAMS                                                                                           \
    (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,                 \
     float* __restrict__ lse, const int* __restrict__ cu_q, const int* __restrict__ cu_k, int n_heads,               \
     int n_kv_heads, int n_qt, float scale, int window_left, int window_right, float softcap)
#define FAFA_VARLEN_ARGS                                                                                             \
    (q, k, v, out, lse, cu_q, cu_k, n_heads, n_kv_heads, n_qt, scale, window_left, window_right, softcap)
PK_IO16_KERNELS(attention_fwd_varlen_tc_d64, (PKFA_THREADS, PkFaCfg<64>::MINB), FAFA_VARLEN_PARAMS, FAFA_VARLEN_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_tc_d64_softcap, (PKFA_THREADS, PkFaCfg<64>::MINB),
                FAFA_VARLEN_PARAMS, FAFA_VARLEN_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_tc_d128, (PKFA_THREADS, PkFaCfg<128>::MINB),
                FAFA_VARLEN_PARAMS, FAFA_VARLEN_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_tc_d128_softcap, (PKFA_THREADS, PkFaCfg<128>::MINB),
                FAFA_VARLEN_PARAMS, FAFA_VARLEN_ARGS)

// ---------------------------------------------------------------------------------------------------------
// paged_prefill_attention on the same core, 16-bit caches of the query type (FP8 caches keep
// paged.cu's paged_attn): q / out
// (total_q, n_heads, D), lse (total_q, n_heads); sequence b is q rows qo_indptr[b]..qo_indptr[b+1] against
// kv positions 0..len of its pages (kv_indptr / kv_indices / kv_last_page_len, page_size = 1 << ps_log2,
// element strides s_page / s_tok / s_head). The queries are the sequence's last qo_len positions (bottom-right
// window, normalized as the serving ops do). scale already holds k_scale; v_scale scales the output.
// Grid (n_qt * n_heads, batch) as the varlen kernel.
template <typename T, int D, bool SC>
__device__ __forceinline__ void fafa_paged(const T* __restrict__ q, const T* __restrict__ kp, const T* __restrict__ vp,
                                           T* __restrict__ out, float* __restrict__ lse,
                                           const int* __restrict__ qo_indptr, const int* __restrict__ kv_indptr,
                                           const int* __restrict__ kv_indices, const int* __restrict__ kv_last,
                                           int n_heads, int n_kv_heads, int ps_log2, long long s_page, long long s_tok,
                                           long long s_head, float scale, int window_left, int window_right,
                                           float softcap, float v_scale) {
    const int b = blockIdx.y, h = (int)(blockIdx.x % n_heads);
    const int q_beg = qo_indptr[b];
    const int n_q = max(qo_indptr[b + 1] - q_beg, 0);
    const int n_tiles = (n_q + PKFA_BR - 1) / PKFA_BR;
    const int i = (int)(blockIdx.x / n_heads);
    if (i >= n_tiles) return;  // CTA-uniform, before any barrier
    const int page_size = 1 << ps_log2;
    const int pbeg = kv_indptr[b];
    const long long np = (long long)kv_indptr[b + 1] - pbeg;
    const int lst = min(max(kv_last[b], 0), page_size);
    const long long len = np > 0 ? (np - 1) * page_size + lst : 0;
    const int n_k = len > (1ll << 30) ? (1 << 30) : (int)len;  // the op bounds lengths well below this
    const int qt = window_right < n_q ? n_tiles - 1 - i : i;
    const int kvh = h / (n_heads / n_kv_heads);
    const long long qs = (long long)n_heads * D;
    const long long qo = (long long)q_beg * qs + (long long)h * D;
    extern __shared__ __align__(16) unsigned char fafa_psmem[];
    PkFaPagedKV<T, D> kv;
    kv.setup(kv_indices + pbeg, ps_log2, s_page, s_tok);
    const long long hoff = (long long)kvh * s_head;
    pkfa_forward<T, D, SC>(fafa_psmem, kv, q + qo, qs, kp + hoff, vp + hoff, 0, 0, out, qo, qs, lse,
                           (long long)q_beg * n_heads + h, n_heads, qt * PKFA_BR, n_q, n_k, scale, window_left,
                           window_right, softcap, v_scale);
}

PK_ATTN_TC_ENTRY(fafa_paged_entry, fafa_paged)
PK_IO_VARIANT(paged_prefill_tc_d64, fafa_paged_entry, 64, false)
PK_IO_VARIANT(paged_prefill_tc_d64_softcap, fafa_paged_entry, 64, true)
PK_IO_VARIANT(paged_prefill_tc_d128, fafa_paged_entry, 128, false)
PK_IO_VARIANT(paged_prefill_tc_d128_softcap, fafa_paged_entry, 128, true)

#define FAFA_PAGED_PARAMS                                                                                            \
    (const T* __restrict__ q, const T* __restrict__ kp, const T* __restrict__ vp, T* __restrict__ out,               \
     float* __restrict__ lse, const int* __restrict__ qo_indptr, const int* __restrict__ kv_indptr,                  \
     const int* __restrict__ kv_indices, const int* __restrict__ kv_last, int n_heads, int n_kv_heads,               \
     int ps_log2, long long s_page, long long s_tok, long long s_head, float scale, int window_left,                 \
     int window_right, float softcap, float v_scale)
#define FAFA_PAGED_ARGS                                                                                              \
    (q, kp, vp, out, lse, qo_indptr, kv_indptr, kv_indices, kv_last, n_heads, n_kv_heads, ps_log2, s_page, s_tok,    \
     s_head, scale, window_left, window_right, softcap, v_scale)
PK_IO16_KERNELS(paged_prefill_tc_d64, (PKFA_THREADS, PkFaCfg<64>::MINB), FAFA_PAGED_PARAMS, FAFA_PAGED_ARGS)
PK_IO16_KERNELS(paged_prefill_tc_d64_softcap, (PKFA_THREADS, PkFaCfg<64>::MINB), FAFA_PAGED_PARAMS, FAFA_PAGED_ARGS)
PK_IO16_KERNELS(paged_prefill_tc_d128, (PKFA_THREADS, PkFaCfg<128>::MINB), FAFA_PAGED_PARAMS, FAFA_PAGED_ARGS)
PK_IO16_KERNELS(paged_prefill_tc_d128_softcap, (PKFA_THREADS, PkFaCfg<128>::MINB), FAFA_PAGED_PARAMS, FAFA_PAGED_ARGS)
