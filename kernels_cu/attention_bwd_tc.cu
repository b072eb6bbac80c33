// Tensor-core attention backward for bf16 and f16 (one template over the element type T),
// FlashAttention-2 style, sm_80 ... sm_120.
// Inputs as attention_bwd_fma.cu: q, grad_out (batch, n_q, n_heads, head_dim), k, v (batch, n_k,
// n_kv_heads, head_dim), lse (batch, n_q, n_heads) natural-log of the scaled scores (the forward's),
// delta = rowsum(grad_out * out) (attention_bwd_preprocess_bf16 / _f16). Same mask (bottom-right window,
// normalized by the op as in attention_fwd_tc.cu: causal is window_right = 0), GQA mapping and
// scale; P is recomputed as exp(scale * q.k - lse), never stored. The _softcap entry points use
// scores c * tanh(scale * q.k / c) and multiply dS by the tanh's derivative 1 - tanh^2.
// Each CTA walks only the tiles its window reaches (pk_attn_window.cuh).
//
// attention_bwd_tc_dkdv_d{D}_{bf16,f16}: a CTA per (batch, kv head, BC = 64 keys); warp w owns keys
//   16w..16w+15 and works in the transposed domain, so its keys are the MMA's M rows and the
//   reductions over queries are the MMA's K dimension:
//     S^T = K Q^T, P^T = exp2(S^T * scale * log2e - lse * log2e)
//     dV += P^T dO                  (P^T rounded to T in registers, dO through ldmatrix.trans)
//     dP^T = V dO^T, dS^T = P^T (dP^T - delta)
//     dK += dS^T Q                  (dS^T rounded to T, Q through ldmatrix.trans)
//   walking the query tiles (BR = 16) of every query head of the GQA group in a fixed order: the
//   group's sum is accumulated in fp32 registers by one CTA, deterministic, no atomics.
//   For D = 256 the two accumulators (2 x 128 floats a lane) do not fit: the _dv and _dk kernels
//   run the same loop for one of them each (S is recomputed; dP only in the dK pass).
// attention_bwd_tc_dq_d{D}_{bf16,f16}: a CTA per (batch, head, 64 queries), 4 warps of 16 rows,
//   walking the key tiles (32 keys, 16 for D = 256): S = Q K^T, P, dP = dO V^T, dS, dQ += dS K (K through ldmatrix.trans).
//   One writer per dQ element: deterministic.
// dK and dQ carry the factor `scale` (d(scale q.k)/dq = scale k). Keys past n_k, queries past n_q
// and masked pairs get P = 0, hence dS = 0: rows/keys that see nothing get zero gradients.
// attention_bwd_varlen_tc_*: the same kernels for packed sequences (template parameter VL): the prologue
//   reads sequence b's row offsets and lengths from cu_seqlens_q / cu_seqlens_k (flash-attn's layout), and a
//   CTA past its sequence's end exits; everything after the prologue is the dense code.
// Tiles are single-buffered (cp.async, then wait): the forward is the double-buffered kernel.
// The query/key steps are small (16 / 32) so that ptxas for sm_100 / sm_120, which takes far more
// registers for the same code than for sm_80 / sm_90, fits 255 registers with 0 spills: one tile
// shape for every arch, the one the host backend tests.
#include "pk_attn_tc.cuh"

#define ABTC_BC 64  // keys per dK/dV CTA (4 warps x 16)
#define ABTC_BR 16  // queries per step of the dK/dV loop
#define ABTC_QR 64  // queries per dQ CTA (4 warps x 16)
#define ABTC_LOG2E 1.4426950408889634f
// The head_dim loops of the S / dP products index no register array, so they may stay rolled. ptxas
// for sm_100 / sm_120 hoists the loads of a fully unrolled one far ahead and runs out of registers
// (spills); rolled there, each step's ldmatrix feeds its own mma.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define ABTC_KP_UNROLL _Pragma("unroll 1")
#else
#define ABTC_KP_UNROLL _Pragma("unroll")
#endif

// Shared memory (bytes) of the two kernels at compiled head_dim D; the op passes the same figures.
#define ABTC_DKDV_SMEM(D) ((2 * ABTC_BC + 2 * ABTC_BR) * ((D) + 8) * 2 + 2 * ABTC_BR * 4)
#define ABTC_DQ_BC(D) ((D) <= 128 ? 32 : 16)
#define ABTC_DQ_SMEM(D) ((2 * ABTC_QR + 2 * ABTC_DQ_BC(D)) * ((D) + 8) * 2)

// MODE: 1 = dV only, 2 = dK only, 3 = both.
template <typename T, int D, int MODE, bool SC, bool VL>
__device__ __forceinline__ void abtc_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                          const T* __restrict__ grad_out, const float* __restrict__ lse,
                                          const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                                          const int* __restrict__ cu_q, const int* __restrict__ cu_k, int batch, int n_q, int n_k, int n_heads, int n_kv_heads, int head_dim,
                                          float scale, int window_left, int window_right, float softcap) {
    constexpr int BC = ABTC_BC, BR = ABTC_BR, SD = D + 8, NT = BR / 8, ON = D / 8;
    constexpr bool DO_DV = (MODE & 1) != 0, DO_DK = (MODE & 2) != 0;
    extern __shared__ __align__(16) unsigned short abtc_smem[];
    unsigned short* ks = abtc_smem;     // [BC][SD]
    unsigned short* vs = ks + BC * SD;  // [BC][SD]
    unsigned short* qs = vs + BC * SD;  // [BR][SD]
    unsigned short* dos = qs + BR * SD; // [BR][SD]
    float* lse_s = reinterpret_cast<float*>(dos + BR * SD);  // [BR], in log2 units
    float* del_s = lse_s + BR;                                // [BR]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n_kt = (n_k + BC - 1) / BC;
    const int bh = blockIdx.x / n_kt, kt = blockIdx.x % n_kt;
    const int b = bh / n_kv_heads, kh = bh % n_kv_heads;
    const int group = n_heads / n_kv_heads;
    const int k0 = kt * BC;
    // Varlen: the grid spans the longest sequence (n_q / n_k are the maxima); sequence b's rows start at
    // cu_q[b] / cu_k[b], and its own lengths and per-sequence window sides (normalize() in _window.py) replace
    // the maxima. A CTA past the sequence's last key exits (CTA-uniform, before any barrier); one that has keys
    // but no query (an empty query sequence) still writes its zero dK / dV.
    long long q_row0 = 0, k_row0 = 0;  // varlen only: the dense kernels keep b * n_q / b * n_k inline
    if (VL) {
        q_row0 = cu_q[b];
        k_row0 = cu_k[b];
        n_q = max(cu_q[b + 1] - cu_q[b], 0);
        n_k = max(cu_k[b + 1] - cu_k[b], 0);
        if (k0 >= n_k) return;
        window_left = min(window_left, n_k);
        window_right = min(window_right, n_q);
    }
    const long long kv_stride = (long long)n_kv_heads * head_dim, q_stride = (long long)n_heads * head_dim;
    const long long k_base = (VL ? k_row0 : (long long)b * n_k) * kv_stride + (long long)kh * head_dim;
    const bool vq = (head_dim & 7) == 0 && (reinterpret_cast<unsigned long long>(q) & 15) == 0;
    const bool vk = (head_dim & 7) == 0 && (reinterpret_cast<unsigned long long>(k) & 15) == 0;
    const bool vv = (head_dim & 7) == 0 && (reinterpret_cast<unsigned long long>(v) & 15) == 0;
    const bool vg = (head_dim & 7) == 0 && (reinterpret_cast<unsigned long long>(grad_out) & 15) == 0;

    fatc_load_tile<D, BC>(ks, k, k_base, kv_stride, k0, n_k, head_dim, vk);
    if (DO_DK) fatc_load_tile<D, BC>(vs, v, k_base, kv_stride, k0, n_k, head_dim, vv);
    pk_cp_async_commit();  // waited for with the first query tile

    // ldmatrix addressing (see attention_fwd_tc.cu): A rows of this warp, B rows, B rows for .trans.
    const int a_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);
    const int b_row = lane & 7, b_col = 8 * (lane >> 3);
    const int t_row = (lane & 7) + 8 * ((lane >> 3) & 1), t_col = 8 * (lane >> 4);

    float acc_dv[DO_DV ? ON : 1][4], acc_dk[DO_DK ? ON : 1][4];
#pragma unroll
    for (int i = 0; i < (DO_DV ? ON : 1); i++) acc_dv[i][0] = acc_dv[i][1] = acc_dv[i][2] = acc_dv[i][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < (DO_DK ? ON : 1); i++) acc_dk[i][0] = acc_dk[i][1] = acc_dk[i][2] = acc_dk[i][3] = 0.0f;
    const float sl2 = SC ? softcap * ABTC_LOG2E : scale * ABTC_LOG2E;  // softcap: applied to tanh(s * pre)
    const float pre = SC ? scale / softcap : 0.0f;
    const int key0 = k0 + warp * 16 + g;  // this lane's keys: key0, key0 + 8
    // Only the query tiles that see a key of ours (the window); the queries each of this lane's keys sees.
    const PkAttnSpan span = pk_attn_k_span(k0, min(k0 + BC, n_k) - 1, n_q, n_k, window_left, window_right);
    const int i_start = span.lo / BR, i_end = span.hi < span.lo ? i_start : span.hi / BR + 1;
    // query col sees key iff dlo <= key - col <= dhi: two CTA-uniform bounds rather than per-lane query
    // ranges (registers: the d256 dK kernel has none to spare on sm_103 / sm_110).
    const int dlo = n_k - n_q - window_left, dhi = n_k - n_q + window_right;

    for (int hh = 0; hh < group; hh++) {
        const int h = kh * group + hh;
        const long long q_base = (VL ? q_row0 : (long long)b * n_q) * q_stride + (long long)h * head_dim;
        for (int it = i_start; it < i_end; it++) {
            const int q0 = it * BR;
            fatc_load_tile<D, BR>(qs, q, q_base, q_stride, q0, n_q, head_dim, vq);
            fatc_load_tile<D, BR>(dos, grad_out, q_base, q_stride, q0, n_q, head_dim, vg);
            for (int r = threadIdx.x; r < BR; r += FATC_THREADS) {
                const int row = q0 + r;
                const long long li = ((VL ? q_row0 : (long long)b * n_q) + row) * n_heads + h;
                lse_s[r] = row < n_q ? lse[li] * ABTC_LOG2E : 0.0f;
                del_s[r] = row < n_q ? delta[li] : 0.0f;
            }
            pk_cp_async_commit();
            pk_cp_async_wait<0>();
            __syncthreads();

            // S^T = K Q^T (16 keys x BR queries per warp), then P^T in place.
            float s[NT][4];
#pragma unroll
            for (int i = 0; i < NT; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
ABTC_KP_UNROLL
            for (int kp = 0; kp < D / 32; kp++) {
                unsigned int a0[4], a1[4];
                pk_ldmatrix_x4(a0, ks + a_row * SD + kp * 32 + a_col);
                pk_ldmatrix_x4(a1, ks + a_row * SD + kp * 32 + 16 + a_col);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    unsigned int qb[4];
                    pk_ldmatrix_x4(qb, qs + (nt * 8 + b_row) * SD + kp * 32 + b_col);
                    pk_mma_m16n8k16<T>(s[nt], a0, qb, s[nt]);
                    pk_mma_m16n8k16<T>(s[nt], a1, qb + 2, s[nt]);
                }
            }
            float th[SC ? NT : 1][4];  // softcap: tanh(s * pre), for dS's factor 1 - tanh^2
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = nt * 8 + 2 * t + (e & 1), col = q0 + c, key = key0 + 8 * (e >> 1);
                    const int dk_ = key - col;
                    const bool ok = col < n_q && key < n_k && dk_ >= dlo && dk_ <= dhi;
                    float x = s[nt][e];
                    if (SC) {
                        x = __tanhf(x * pre);
                        th[SC ? nt : 0][e] = x;
                    }
                    s[nt][e] = ok ? pk_ex2_approx(x * sl2 - lse_s[c]) : 0.0f;
                }
            }
            if (DO_DV) {  // dV += P^T dO
#pragma unroll
                for (int kk = 0; kk < BR / 16; kk++) {
                    unsigned int pa[4];
                    pk_acc_to_a<T>(pa, s, kk);
#pragma unroll
                    for (int np = 0; np < D / 16; np++) {
                        unsigned int ob[4];
                        pk_ldmatrix_x4_trans(ob, dos + (kk * 16 + t_row) * SD + np * 16 + t_col);
                        pk_mma_m16n8k16<T>(acc_dv[DO_DV ? 2 * np : 0], pa, ob, acc_dv[DO_DV ? 2 * np : 0]);
                        pk_mma_m16n8k16<T>(acc_dv[DO_DV ? 2 * np + 1 : 0], pa, ob + 2, acc_dv[DO_DV ? 2 * np + 1 : 0]);
                    }
                }
            }
            if (DO_DK) {  // dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q
                float dp[NT][4];
#pragma unroll
                for (int i = 0; i < NT; i++) dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
ABTC_KP_UNROLL
                for (int kp = 0; kp < D / 32; kp++) {
                    unsigned int a0[4], a1[4];
                    pk_ldmatrix_x4(a0, vs + a_row * SD + kp * 32 + a_col);
                    pk_ldmatrix_x4(a1, vs + a_row * SD + kp * 32 + 16 + a_col);
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        unsigned int ob[4];
                        pk_ldmatrix_x4(ob, dos + (nt * 8 + b_row) * SD + kp * 32 + b_col);
                        pk_mma_m16n8k16<T>(dp[nt], a0, ob, dp[nt]);
                        pk_mma_m16n8k16<T>(dp[nt], a1, ob + 2, dp[nt]);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float d = s[nt][e] * (dp[nt][e] - del_s[nt * 8 + 2 * t + (e & 1)]);
                        if (SC) d *= 1.0f - th[SC ? nt : 0][e] * th[SC ? nt : 0][e];
                        dp[nt][e] = d;
                    }
                }
#pragma unroll
                for (int kk = 0; kk < BR / 16; kk++) {
                    unsigned int da[4];
                    pk_acc_to_a<T>(da, dp, kk);
#pragma unroll
                    for (int np = 0; np < D / 16; np++) {
                        unsigned int qb[4];
                        pk_ldmatrix_x4_trans(qb, qs + (kk * 16 + t_row) * SD + np * 16 + t_col);
                        pk_mma_m16n8k16<T>(acc_dk[DO_DK ? 2 * np : 0], da, qb, acc_dk[DO_DK ? 2 * np : 0]);
                        pk_mma_m16n8k16<T>(acc_dk[DO_DK ? 2 * np + 1 : 0], da, qb + 2, acc_dk[DO_DK ? 2 * np + 1 : 0]);
                    }
                }
            }
            __syncthreads();  // every warp is done with qs / dos / lse_s / del_s before the next tile
        }
    }
    pk_cp_async_wait_all();  // the K/V copies when no query tile ran

    const bool vo = (head_dim & 1) == 0 && (reinterpret_cast<unsigned long long>(DO_DK ? dk : dv) & 3) == 0;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = key0 + 8 * r;
        if (key >= n_k) continue;
        const long long ob = ((VL ? k_row0 : (long long)b * n_k) + key) * kv_stride + (long long)kh * head_dim;
#pragma unroll
        for (int i = 0; i < ON; i++) {
            const int col = i * 8 + 2 * t;
            if (col >= head_dim) continue;
            if (DO_DV) {
                const float x0 = acc_dv[DO_DV ? i : 0][2 * r], x1 = acc_dv[DO_DV ? i : 0][2 * r + 1];
                pk_store_pair<T>(dv, ob, col, head_dim, vo, x0, x1);
            }
            if (DO_DK) {
                const float x0 = acc_dk[DO_DK ? i : 0][2 * r] * scale, x1 = acc_dk[DO_DK ? i : 0][2 * r + 1] * scale;
                pk_store_pair<T>(dk, ob, col, head_dim, vo, x0, x1);
            }
        }
    }
}

template <typename T, int D, bool SC, bool VL>
__device__ __forceinline__ void abtc_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                        const T* __restrict__ grad_out, const float* __restrict__ lse,
                                        const float* __restrict__ delta, T* __restrict__ dq,
                                        const int* __restrict__ cu_q, const int* __restrict__ cu_k, int batch, int n_q,
                                        int n_k, int n_heads, int n_kv_heads, int head_dim, float scale,
                                        int window_left, int window_right, float softcap) {
    constexpr int BR = ABTC_QR, BC = ABTC_DQ_BC(D), SD = D + 8, NT = BC / 8, ON = D / 8;
    extern __shared__ __align__(16) unsigned short abtc_smem[];
    unsigned short* qs = abtc_smem;      // [BR][SD]
    unsigned short* dos = qs + BR * SD;  // [BR][SD]
    unsigned short* ks = dos + BR * SD;  // [BC][SD]
    unsigned short* vs = ks + BC * SD;   // [BC][SD]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const PkAttnQTile tile = pk_attn_q_tile(n_q, BR, n_heads, n_kv_heads, window_right);
    const int b = tile.b, h = tile.h, kh = tile.kvh, qt = tile.qt;
    const int q0 = qt * BR;
    // Varlen: as the dK/dV kernel (the maxima span the grid; a CTA past its sequence's last query exits).
    long long q_row0 = 0, k_row0 = 0;  // varlen only: the dense kernels keep b * n_q / b * n_k inline
    if (VL) {
        q_row0 = cu_q[b];
        k_row0 = cu_k[b];
        n_q = max(cu_q[b + 1] - cu_q[b], 0);
        n_k = max(cu_k[b + 1] - cu_k[b], 0);
        if (q0 >= n_q) return;
        window_left = min(window_left, n_k);
        window_right = min(window_right, n_q);
    }
    // Only the key tiles the window of some row of ours reaches.
    const PkAttnSpan span = pk_attn_q_span(q0, min(q0 + BR, n_q) - 1, n_q, n_k, window_left, window_right);
    const int kt0 = span.lo / BC, kt1 = span.hi < span.lo ? kt0 : span.hi / BC + 1;
    const long long q_stride = (long long)n_heads * head_dim, kv_stride = (long long)n_kv_heads * head_dim;
    const long long q_base = (VL ? q_row0 : (long long)b * n_q) * q_stride + (long long)h * head_dim;
    const long long k_base = (VL ? k_row0 : (long long)b * n_k) * kv_stride + (long long)kh * head_dim;
    const bool vq = (head_dim & 7) == 0 && (reinterpret_cast<unsigned long long>(q) & 15) == 0;
    const bool vk = (head_dim & 7) == 0 && (reinterpret_cast<unsigned long long>(k) & 15) == 0;
    const bool vv = (head_dim & 7) == 0 && (reinterpret_cast<unsigned long long>(v) & 15) == 0;
    const bool vg = (head_dim & 7) == 0 && (reinterpret_cast<unsigned long long>(grad_out) & 15) == 0;

    fatc_load_tile<D, BR>(qs, q, q_base, q_stride, q0, n_q, head_dim, vq);
    fatc_load_tile<D, BR>(dos, grad_out, q_base, q_stride, q0, n_q, head_dim, vg);
    pk_cp_async_commit();

    const int a_row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);
    const int b_row = lane & 7, b_col = 8 * (lane >> 3);
    const int t_row = (lane & 7) + 8 * ((lane >> 3) & 1), t_col = 8 * (lane >> 4);
    const int row0 = q0 + warp * 16 + g;  // this lane's rows: row0, row0 + 8
    float lse2[2], del[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        const long long li = ((VL ? q_row0 : (long long)b * n_q) + row) * n_heads + h;
        lse2[r] = row < n_q ? lse[li] * ABTC_LOG2E : 0.0f;
        del[r] = row < n_q ? delta[li] : 0.0f;
    }
    float acc[ON][4];
#pragma unroll
    for (int i = 0; i < ON; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    const float sl2 = SC ? softcap * ABTC_LOG2E : scale * ABTC_LOG2E;  // softcap: applied to tanh(s * pre)
    const float pre = SC ? scale / softcap : 0.0f;
    // key col is seen by query row iff dlo <= col - row <= dhi (CTA-uniform bounds, as in the dK/dV kernel)
    const int dlo = n_k - n_q - window_left, dhi = n_k - n_q + window_right;

    for (int j = kt0; j < kt1; j++) {
        const int k0 = j * BC;
        fatc_load_tile<D, BC>(ks, k, k_base, kv_stride, k0, n_k, head_dim, vk);
        fatc_load_tile<D, BC>(vs, v, k_base, kv_stride, k0, n_k, head_dim, vv);
        pk_cp_async_commit();
        pk_cp_async_wait<0>();
        __syncthreads();

        float s[NT][4], dp[NT][4];
#pragma unroll
        for (int i = 0; i < NT; i++) {
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
            dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
        }
ABTC_KP_UNROLL
        for (int kp = 0; kp < D / 32; kp++) {
            unsigned int a0[4], a1[4], o0[4], o1[4];
            pk_ldmatrix_x4(a0, qs + a_row * SD + kp * 32 + a_col);
            pk_ldmatrix_x4(a1, qs + a_row * SD + kp * 32 + 16 + a_col);
            pk_ldmatrix_x4(o0, dos + a_row * SD + kp * 32 + a_col);
            pk_ldmatrix_x4(o1, dos + a_row * SD + kp * 32 + 16 + a_col);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                unsigned int kb[4], vb[4];
                pk_ldmatrix_x4(kb, ks + (nt * 8 + b_row) * SD + kp * 32 + b_col);
                pk_mma_m16n8k16<T>(s[nt], a0, kb, s[nt]);
                pk_mma_m16n8k16<T>(s[nt], a1, kb + 2, s[nt]);
                pk_ldmatrix_x4(vb, vs + (nt * 8 + b_row) * SD + kp * 32 + b_col);
                pk_mma_m16n8k16<T>(dp[nt], o0, vb, dp[nt]);
                pk_mma_m16n8k16<T>(dp[nt], o1, vb + 2, dp[nt]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = k0 + nt * 8 + 2 * t + (e & 1), row = row0 + 8 * (e >> 1);
                const int d_ = col - row;
                const bool ok = row < n_q && col < n_k && d_ >= dlo && d_ <= dhi;
                const float x = SC ? __tanhf(s[nt][e] * pre) : s[nt][e];
                const float p = ok ? pk_ex2_approx(x * sl2 - lse2[e >> 1]) : 0.0f;
                float d = p * (dp[nt][e] - del[e >> 1]);
                if (SC) d *= 1.0f - x * x;
                dp[nt][e] = d;
            }
        }
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {  // dQ += dS K
            unsigned int da[4];
            pk_acc_to_a<T>(da, dp, kk);
#pragma unroll
            for (int np = 0; np < D / 16; np++) {
                unsigned int kb[4];
                pk_ldmatrix_x4_trans(kb, ks + (kk * 16 + t_row) * SD + np * 16 + t_col);
                pk_mma_m16n8k16<T>(acc[2 * np], da, kb, acc[2 * np]);
                pk_mma_m16n8k16<T>(acc[2 * np + 1], da, kb + 2, acc[2 * np + 1]);
            }
        }
        __syncthreads();  // every warp is done with ks / vs before the next tile
    }
    pk_cp_async_wait_all();  // the Q / dO copies when no key tile ran

    const bool vo = (head_dim & 1) == 0 && (reinterpret_cast<unsigned long long>(dq) & 3) == 0;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        if (row >= n_q) continue;
        const long long ob = ((VL ? q_row0 : (long long)b * n_q) + row) * q_stride + (long long)h * head_dim;
#pragma unroll
        for (int i = 0; i < ON; i++) {
            const int col = i * 8 + 2 * t;
            if (col >= head_dim) continue;
            const float x0 = acc[i][2 * r] * scale, x1 = acc[i][2 * r + 1] * scale;
            pk_store_pair<T>(dq, ob, col, head_dim, vo, x0, x1);
        }
    }
}

// Entry points, one per compiled head_dim and softcap flag, in bf16 and f16 (the sm_75 build traps: never
// launched there). MODE of the dK/dV kernels: 3 both, 1 dV only, 2 dK only (D = 256).
PK_ATTN_TC_ENTRY(abtc_dkdv_entry, abtc_dkdv)
PK_ATTN_TC_ENTRY(abtc_dq_entry, abtc_dq)
PK_IO_VARIANT(attention_bwd_tc_dkdv_d64, abtc_dkdv_entry, 64, 3, false, false)
PK_IO_VARIANT(attention_bwd_tc_dkdv_d96, abtc_dkdv_entry, 96, 3, false, false)
PK_IO_VARIANT(attention_bwd_tc_dkdv_d128, abtc_dkdv_entry, 128, 3, false, false)
PK_IO_VARIANT(attention_bwd_tc_dv_d256, abtc_dkdv_entry, 256, 1, false, false)
PK_IO_VARIANT(attention_bwd_tc_dk_d256, abtc_dkdv_entry, 256, 2, false, false)
PK_IO_VARIANT(attention_bwd_tc_dkdv_d64_softcap, abtc_dkdv_entry, 64, 3, true, false)
PK_IO_VARIANT(attention_bwd_tc_dkdv_d96_softcap, abtc_dkdv_entry, 96, 3, true, false)
PK_IO_VARIANT(attention_bwd_tc_dkdv_d128_softcap, abtc_dkdv_entry, 128, 3, true, false)
PK_IO_VARIANT(attention_bwd_tc_dv_d256_softcap, abtc_dkdv_entry, 256, 1, true, false)
PK_IO_VARIANT(attention_bwd_tc_dk_d256_softcap, abtc_dkdv_entry, 256, 2, true, false)
PK_IO_VARIANT(attention_bwd_tc_dq_d64, abtc_dq_entry, 64, false, false)
PK_IO_VARIANT(attention_bwd_tc_dq_d96, abtc_dq_entry, 96, false, false)
PK_IO_VARIANT(attention_bwd_tc_dq_d128, abtc_dq_entry, 128, false, false)
PK_IO_VARIANT(attention_bwd_tc_dq_d256, abtc_dq_entry, 256, false, false)
PK_IO_VARIANT(attention_bwd_tc_dq_d64_softcap, abtc_dq_entry, 64, true, false)
PK_IO_VARIANT(attention_bwd_tc_dq_d96_softcap, abtc_dq_entry, 96, true, false)
PK_IO_VARIANT(attention_bwd_tc_dq_d128_softcap, abtc_dq_entry, 128, true, false)
PK_IO_VARIANT(attention_bwd_tc_dq_d256_softcap, abtc_dq_entry, 256, true, false)

#define ABTC_DKDV_PARAMS                                                                                             \
    (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad_out,      \
     const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,         \
     int batch, int n_q, int n_k, int n_heads, int n_kv_heads, int head_dim, float scale, int window_left,           \
     int window_right, float softcap)
#define ABTC_DKDV_ARGS                                                                                               \
    (q, k, v, grad_out, lse, delta, dk, dv, nullptr, nullptr, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, \
     window_left, window_right, softcap)
PK_IO16_KERNELS(attention_bwd_tc_dkdv_d64, (FATC_THREADS, 2), ABTC_DKDV_PARAMS, ABTC_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dkdv_d96, (FATC_THREADS, 1), ABTC_DKDV_PARAMS, ABTC_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dkdv_d128, (FATC_THREADS, 1), ABTC_DKDV_PARAMS, ABTC_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dv_d256, (FATC_THREADS, 1), ABTC_DKDV_PARAMS, ABTC_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dk_d256, (FATC_THREADS, 1), ABTC_DKDV_PARAMS, ABTC_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dkdv_d64_softcap, (FATC_THREADS, 2), ABTC_DKDV_PARAMS, ABTC_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dkdv_d96_softcap, (FATC_THREADS, 1), ABTC_DKDV_PARAMS, ABTC_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dkdv_d128_softcap, (FATC_THREADS, 1), ABTC_DKDV_PARAMS, ABTC_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dv_d256_softcap, (FATC_THREADS, 1), ABTC_DKDV_PARAMS, ABTC_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dk_d256_softcap, (FATC_THREADS, 1), ABTC_DKDV_PARAMS, ABTC_DKDV_ARGS)

#define ABTC_DQ_PARAMS                                                                                               \
    (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad_out,      \
     const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, int batch, int n_q,         \
     int n_k, int n_heads, int n_kv_heads, int head_dim, float scale, int window_left, int window_right,             \
     float softcap)
#define ABTC_DQ_ARGS                                                                                                 \
    (q, k, v, grad_out, lse, delta, dq, nullptr, nullptr, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, scale,     \
     window_left, window_right, softcap)
PK_IO16_KERNELS(attention_bwd_tc_dq_d64, (FATC_THREADS, 2), ABTC_DQ_PARAMS, ABTC_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dq_d96, (FATC_THREADS, 2), ABTC_DQ_PARAMS, ABTC_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dq_d128, (FATC_THREADS, 2), ABTC_DQ_PARAMS, ABTC_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dq_d256, (FATC_THREADS, 1), ABTC_DQ_PARAMS, ABTC_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dq_d64_softcap, (FATC_THREADS, 2), ABTC_DQ_PARAMS, ABTC_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dq_d96_softcap, (FATC_THREADS, 2), ABTC_DQ_PARAMS, ABTC_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dq_d128_softcap, (FATC_THREADS, 2), ABTC_DQ_PARAMS, ABTC_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dq_d256_softcap, (FATC_THREADS, 1), ABTC_DQ_PARAMS, ABTC_DQ_ARGS)

// Varlen entry points (flash_attention_varlen_backward): q / grad_out (total_q, n_heads, head_dim), k / v
// (total_k, n_kv_heads, head_dim), lse / delta (total_q, n_heads); sequence b is rows cu_seqlens_q[b] ..
// cu_seqlens_q[b + 1] against cu_seqlens_k[b] .. cu_seqlens_k[b + 1]. The grid is the dense one at the longest
// lengths (max_seqlen_q / _k); the window sides come unbounded as 2^30 and are clamped per sequence.
PK_IO_VARIANT(attention_bwd_varlen_tc_dkdv_d64, abtc_dkdv_entry, 64, 3, false, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dkdv_d96, abtc_dkdv_entry, 96, 3, false, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dkdv_d128, abtc_dkdv_entry, 128, 3, false, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dv_d256, abtc_dkdv_entry, 256, 1, false, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dk_d256, abtc_dkdv_entry, 256, 2, false, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dkdv_d64_softcap, abtc_dkdv_entry, 64, 3, true, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dkdv_d96_softcap, abtc_dkdv_entry, 96, 3, true, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dkdv_d128_softcap, abtc_dkdv_entry, 128, 3, true, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dv_d256_softcap, abtc_dkdv_entry, 256, 1, true, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dk_d256_softcap, abtc_dkdv_entry, 256, 2, true, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dq_d64, abtc_dq_entry, 64, false, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dq_d96, abtc_dq_entry, 96, false, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dq_d128, abtc_dq_entry, 128, false, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dq_d256, abtc_dq_entry, 256, false, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dq_d64_softcap, abtc_dq_entry, 64, true, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dq_d96_softcap, abtc_dq_entry, 96, true, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dq_d128_softcap, abtc_dq_entry, 128, true, true)
PK_IO_VARIANT(attention_bwd_varlen_tc_dq_d256_softcap, abtc_dq_entry, 256, true, true)

#define ABTC_VL_DKDV_PARAMS                                                                                          \
    (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad_out,      \
     const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,         \
     const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k, int batch, int max_seqlen_q,       \
     int max_seqlen_k, int n_heads, int n_kv_heads, int head_dim, float scale, int window_left, int window_right,    \
     float softcap)
#define ABTC_VL_DKDV_ARGS                                                                                            \
    (q, k, v, grad_out, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q, max_seqlen_k, n_heads,  \
     n_kv_heads, head_dim, scale, window_left, window_right, softcap)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dkdv_d64, (FATC_THREADS, 2), ABTC_VL_DKDV_PARAMS, ABTC_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dkdv_d96, (FATC_THREADS, 1), ABTC_VL_DKDV_PARAMS, ABTC_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dkdv_d128, (FATC_THREADS, 1), ABTC_VL_DKDV_PARAMS, ABTC_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dv_d256, (FATC_THREADS, 1), ABTC_VL_DKDV_PARAMS, ABTC_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dk_d256, (FATC_THREADS, 1), ABTC_VL_DKDV_PARAMS, ABTC_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dkdv_d64_softcap, (FATC_THREADS, 2), ABTC_VL_DKDV_PARAMS, ABTC_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dkdv_d96_softcap, (FATC_THREADS, 1), ABTC_VL_DKDV_PARAMS, ABTC_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dkdv_d128_softcap, (FATC_THREADS, 1), ABTC_VL_DKDV_PARAMS, ABTC_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dv_d256_softcap, (FATC_THREADS, 1), ABTC_VL_DKDV_PARAMS, ABTC_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dk_d256_softcap, (FATC_THREADS, 1), ABTC_VL_DKDV_PARAMS, ABTC_VL_DKDV_ARGS)

#define ABTC_VL_DQ_PARAMS                                                                                            \
    (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad_out,      \
     const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq,                             \
     const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k, int batch, int max_seqlen_q,       \
     int max_seqlen_k, int n_heads, int n_kv_heads, int head_dim, float scale, int window_left, int window_right,    \
     float softcap)
#define ABTC_VL_DQ_ARGS                                                                                              \
    (q, k, v, grad_out, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q, max_seqlen_k, n_heads,      \
     n_kv_heads, head_dim, scale, window_left, window_right, softcap)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dq_d64, (FATC_THREADS, 2), ABTC_VL_DQ_PARAMS, ABTC_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dq_d96, (FATC_THREADS, 2), ABTC_VL_DQ_PARAMS, ABTC_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dq_d128, (FATC_THREADS, 2), ABTC_VL_DQ_PARAMS, ABTC_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dq_d256, (FATC_THREADS, 1), ABTC_VL_DQ_PARAMS, ABTC_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dq_d64_softcap, (FATC_THREADS, 2), ABTC_VL_DQ_PARAMS, ABTC_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dq_d96_softcap, (FATC_THREADS, 2), ABTC_VL_DQ_PARAMS, ABTC_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dq_d128_softcap, (FATC_THREADS, 2), ABTC_VL_DQ_PARAMS, ABTC_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_tc_dq_d256_softcap, (FATC_THREADS, 1), ABTC_VL_DQ_PARAMS, ABTC_VL_DQ_ARGS)
