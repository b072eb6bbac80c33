// pykern: arch sm_90a
// Hopper (sm_90a) attention backward on wgmma, bf16 and f16 (template over T), head_dim 64 and 128, no
// softcap: the same gradients, window / causal mask, GQA mapping and conventions as attention_bwd_tc.cu,
// given lse (natural log, per (batch, query, head)) and delta = rowsum(dO * O) from the op's pre-pass.
// Deterministic: every output element has one writer and a fixed summation order (no atomics).
//
// Two kernels, each a CTA of 3 warpgroups in the FlashAttention-3 manner: warpgroup 0 is the producer (one
// elected thread issues TMA loads into a 2-stage ring guarded by full / empty mbarriers, setmaxnreg.dec),
// warpgroups 1 and 2 consume (setmaxnreg.inc), each owning 64 rows of the CTA's 128.
//   dkdv: the CTA owns 128 keys of one (batch, kv head) (K, V loaded once), and walks every query head of
//     the GQA group and every C-query tile (C = 64, 32 at d128) that sees its keys (Q, dO streamed). Per
//     tile, consumer c:
//       S^T = K Q^T, dP^T = V dO^T (wgmma SS, m64nCk16), P^T = exp2(S^T * scale * log2 e - lse * log2 e),
//       dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q (wgmma RS: P^T / dS^T from registers, dO / Q
//       MN-major from shared memory); dK is scaled once at the end.
//   dq: the CTA owns 128 queries of one (batch, head) and walks the 64-key tiles they see (K, V streamed):
//       S = Q K^T, dP = dO V^T (SS), P, dS as above, dQ += dS K (RS, K MN-major); dQ scaled at the end.
// Layouts as attention_fwd_sm90.cu: tiles of [rows][64] boxes of 128-byte rows, 128B swizzle.
#include "pk_common.cuh"
#include "pk_ptx.cuh"
#include "pk_attn_window.cuh"
#include "pk_attn_tc.cuh"  // pk_attn_key_rows

#define AB90_ROWS 128   // keys (dkdv) / queries (dq) per CTA
#define AB90_STEP 64    // keys per streamed tile (dq)
// queries per streamed tile (dkdv): 32 at d128, where dK and dV take 128 accumulator registers a thread
#define AB90_DKDV_STEP(D) ((D) >= 128 ? 32 : 64)
#define AB90_STAGES 2
#define AB90_THREADS 384
// dynamic shared bytes with C rows per streamed tile: the resident pair, the ring of pairs, the mbarriers
#define AB90_SMEM_BYTES(D, C) (2 * AB90_ROWS * (D) * 2 + 2 * AB90_STAGES * (C) * (D) * 2 + 1024)

template <typename T> struct Ab90Dt;
template <> struct Ab90Dt<__nv_bfloat16> { enum { V = PK_WGMMA_BF16 }; };
template <> struct Ab90Dt<__half> { enum { V = PK_WGMMA_F16 }; };

// X = A1 B1^T and Y = A2 B2^T for one consumer warpgroup: 64 rows x STEP columns each, K = D. A from the
// resident tiles (AROWS rows per box), B from a streamed tile (STEP rows per box).
template <int DT, int D, int AROWS, int C>
__device__ __forceinline__ void ab90_two_products(float (&x)[C / 2], float (&y)[C / 2],
                                                  unsigned long long a1, unsigned long long b1,
                                                  unsigned long long a2, unsigned long long b2) {
    pk_wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        const unsigned ao = (ks / 4) * AROWS * 128 + (ks % 4) * 32, bo = (ks / 4) * C * 128 + (ks % 4) * 32;
        pk_wgmma_m64nNk16_ss<C, DT>(x, pk_wgmma_desc_advance(a1, ao), pk_wgmma_desc_advance(b1, bo), ks > 0);
    }
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        const unsigned ao = (ks / 4) * AROWS * 128 + (ks % 4) * 32, bo = (ks / 4) * C * 128 + (ks % 4) * 32;
        pk_wgmma_m64nNk16_ss<C, DT>(y, pk_wgmma_desc_advance(a2, ao), pk_wgmma_desc_advance(b2, bo), ks > 0);
    }
    pk_wgmma_commit();
    pk_wgmma_wait<0>();
}

// ------------------------------------------------------------------------------------------------ dK, dV
template <typename T, int D>
__device__ __forceinline__ void ab90_dkdv(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                                          const CUtensorMap* tdo, const float* __restrict__ lse,
                                          const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                                          int batch, int n_q, int n_k, int n_heads, int n_kv_heads, float scale,
                                          int window_left, int window_right) {
    constexpr int DT = Ab90Dt<T>::V, NB = D / 64, R = AB90_ROWS, C = AB90_DKDV_STEP(D), ST = AB90_STAGES;
    constexpr unsigned KV_BYTES = R * D * 2, STEP_BYTES = C * D * 2;
    extern __shared__ __align__(1024) unsigned char ab90_smem[];
    unsigned char* ks = ab90_smem;
    unsigned char* vs = ks + KV_BYTES;
    unsigned char* qs = vs + KV_BYTES;               // [ST][NB][C][128 B]
    unsigned char* dos = qs + ST * STEP_BYTES;       // [ST][NB][C][128 B]
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(dos + ST * STEP_BYTES);
    unsigned long long *kv_full = bars, *full = bars + 1, *empty = bars + 1 + ST;

    const int tid = threadIdx.x, wg = tid / 128;
    const int n_kt = (n_k + R - 1) / R;
    const int bkv = blockIdx.x / n_kt, kt = blockIdx.x % n_kt;
    const int b = bkv / n_kv_heads, kvh = bkv % n_kv_heads, group = n_heads / n_kv_heads;
    const int k0 = kt * R, k_last = min(k0 + R, n_k) - 1;
    const PkAttnSpan span = pk_attn_k_span(k0, k_last, n_q, n_k, window_left, window_right);
    const int qt0 = span.lo / C, qt1 = span.hi < span.lo ? qt0 : span.hi / C + 1;
    const int steps = (qt1 - qt0) * group;

    if (tid == 0) {
        pk_mbarrier_init(kv_full, 1);
        for (int s = 0; s < ST; s++) pk_mbarrier_init(&full[s], 1), pk_mbarrier_init(&empty[s], 256);
        pk_fence_mbarrier_init();
    }
    __syncthreads();

    if (wg == 0) {  // ---- producer ----
        pk_setmaxnreg_dec<24>();
        if (tid < 32 && pk_elect_one()) {
            pk_mbarrier_arrive_expect_tx(kv_full, 2 * KV_BYTES);
            for (int nb = 0; nb < NB; nb++) {
                pk_tma_load_4d(ks + nb * R * 128, tk, kv_full, nb * 64, kvh, k0, b);
                pk_tma_load_4d(vs + nb * R * 128, tv, kv_full, nb * 64, kvh, k0, b);
            }
            for (int i = 0; i < steps; i++) {
                const int s = i % ST, h = kvh * group + i / (qt1 - qt0), q0 = (qt0 + i % (qt1 - qt0)) * C;
                pk_mbarrier_wait_parity(&empty[s], ((i / ST) & 1) ^ 1);
                pk_mbarrier_arrive_expect_tx(&full[s], 2 * STEP_BYTES);
                for (int nb = 0; nb < NB; nb++) {
                    pk_tma_load_4d(qs + s * STEP_BYTES + nb * C * 128, tq, &full[s], nb * 64, h, q0, b);
                    pk_tma_load_4d(dos + s * STEP_BYTES + nb * C * 128, tdo, &full[s], nb * 64, h, q0, b);
                }
            }
        }
        return;
    }

    // ---- consumers: rows = keys k0 + 64c + 16 wq + g (+ 8) ----
    pk_setmaxnreg_inc<240>();
    const int c = wg - 1, lane = tid % 32, wq = (tid / 32) % 4, g = lane / 4, t = lane % 4;
    float dka[D / 2], dva[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) dka[i] = dva[i] = 0.0f;
    const float sl2 = scale * 1.4426950408889634f;
    const int key0 = k0 + 64 * c + 16 * wq + g;
    int qlo[2], qhi[2];  // queries that see this thread's two keys
    pk_attn_k_row(key0, n_q, n_k, window_left, window_right, qlo[0], qhi[0]);
    pk_attn_k_row(key0 + 8, n_q, n_k, window_left, window_right, qlo[1], qhi[1]);
    const unsigned long long dk_a = pk_wgmma_desc(ks + c * 64 * 128, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long dv_a = pk_wgmma_desc(vs + c * 64 * 128, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long dq_b = pk_wgmma_desc(qs, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long ddo_b = pk_wgmma_desc(dos, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long dq_t = pk_wgmma_desc(qs, C * 128, 1024, PK_SWIZZLE_128B);    // MN-major
    const unsigned long long ddo_t = pk_wgmma_desc(dos, C * 128, 1024, PK_SWIZZLE_128B);  // MN-major
    pk_mbarrier_wait_parity(kv_full, 0);

    for (int i = 0; i < steps; i++) {
        const int s = i % ST, h = kvh * group + i / (qt1 - qt0), q0 = (qt0 + i % (qt1 - qt0)) * C;
        const bool need_mask = q0 < span.full_lo || q0 + C - 1 > span.full_hi;
        // lse * log2 e and delta of this thread's query columns q0 + 8j + 2t + e (+inf / 0 past n_q)
        float l2[C / 8][2], dl[C / 8][2];
#pragma unroll
        for (int j = 0; j < C / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int qq = q0 + 8 * j + 2 * t + e;
                const long long r = ((long long)b * n_q + qq) * n_heads + h;
                const float lv = qq < n_q ? lse[r] : PK_NEG_INF;
                l2[j][e] = lv == PK_NEG_INF ? -PK_NEG_INF : lv * 1.4426950408889634f;
                dl[j][e] = qq < n_q ? delta[r] : 0.0f;
            }
        float st_[C / 2], dpt[C / 2];
        pk_mbarrier_wait_parity(&full[s], (i / ST) & 1);
        ab90_two_products<DT, D, R, C>(st_, dpt, dk_a, pk_wgmma_desc_advance(dq_b, s * STEP_BYTES), dv_a,
                                    pk_wgmma_desc_advance(ddo_b, s * STEP_BYTES));
        unsigned pa[C / 16][4], da[C / 16][4];
#pragma unroll
        for (int j = 0; j < C / 8; j++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float p[2], ds[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int i4 = 4 * j + 2 * r + e;
                    p[e] = pk_ex2_approx(fmaf(st_[i4], sl2, -l2[j][e]));
                    if (need_mask) {
                        const int qq = q0 + 8 * j + 2 * t + e;
                        if (qq < qlo[r] || qq > qhi[r]) p[e] = 0.0f;
                    }
                    ds[e] = p[e] * (dpt[i4] - dl[j][e]);
                }
                pa[j / 2][2 * (j & 1) + r] = Pk16<T>::narrow2(p[0], p[1]);
                da[j / 2][2 * (j & 1) + r] = Pk16<T>::narrow2(ds[0], ds[1]);
            }
        pk_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++)
            pk_wgmma_m64nNk16_rs<D, DT, 1>(dva, pa[kk], pk_wgmma_desc_advance(ddo_t, s * STEP_BYTES + kk * 2048), 1);
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++)
            pk_wgmma_m64nNk16_rs<D, DT, 1>(dka, da[kk], pk_wgmma_desc_advance(dq_t, s * STEP_BYTES + kk * 2048), 1);
        pk_wgmma_commit();
        pk_wgmma_wait<0>();
        pk_mbarrier_arrive(&empty[s]);
    }

    pk_attn_key_rows(key0, n_k, (long long)b * n_k, (long long)n_kv_heads * D, (long long)kvh * D,
                     [&](int r, long long base) {
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            *reinterpret_cast<unsigned int*>(dk + base + 8 * j + 2 * t) =
                Pk16<T>::narrow2(dka[4 * j + 2 * r] * scale, dka[4 * j + 2 * r + 1] * scale);
            *reinterpret_cast<unsigned int*>(dv + base + 8 * j + 2 * t) =
                Pk16<T>::narrow2(dva[4 * j + 2 * r], dva[4 * j + 2 * r + 1]);
        }
    });
}

// ------------------------------------------------------------------------------------------------ dQ
template <typename T, int D>
__device__ __forceinline__ void ab90_dq(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                                        const CUtensorMap* tdo, const float* __restrict__ lse,
                                        const float* __restrict__ delta, T* __restrict__ dq, int batch, int n_q,
                                        int n_k, int n_heads, int n_kv_heads, float scale, int window_left,
                                        int window_right) {
    constexpr int DT = Ab90Dt<T>::V, NB = D / 64, R = AB90_ROWS, C = AB90_STEP, ST = AB90_STAGES;
    constexpr unsigned Q_BYTES = R * D * 2, STEP_BYTES = C * D * 2;
    extern __shared__ __align__(1024) unsigned char ab90_smem[];
    unsigned char* qs = ab90_smem;
    unsigned char* dos = qs + Q_BYTES;
    unsigned char* ks = dos + Q_BYTES;               // [ST][NB][C][128 B]
    unsigned char* vs = ks + ST * STEP_BYTES;        // [ST][NB][C][128 B]
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(vs + ST * STEP_BYTES);
    unsigned long long *q_full = bars, *full = bars + 1, *empty = bars + 1 + ST;

    const int tid = threadIdx.x, wg = tid / 128;
    const int n_qt = (n_q + R - 1) / R;
    const int bh = blockIdx.x / n_qt, qt = blockIdx.x % n_qt;
    const int b = bh / n_heads, h = bh % n_heads, kvh = h / (n_heads / n_kv_heads);
    const int q0 = qt * R, q_last = min(q0 + R, n_q) - 1;
    const PkAttnSpan span = pk_attn_q_span(q0, q_last, n_q, n_k, window_left, window_right);
    const int kt0 = span.lo / C, kt1 = span.hi < span.lo ? kt0 : span.hi / C + 1;

    if (tid == 0) {
        pk_mbarrier_init(q_full, 1);
        for (int s = 0; s < ST; s++) pk_mbarrier_init(&full[s], 1), pk_mbarrier_init(&empty[s], 256);
        pk_fence_mbarrier_init();
    }
    __syncthreads();

    if (wg == 0) {  // ---- producer ----
        pk_setmaxnreg_dec<24>();
        if (tid < 32 && pk_elect_one()) {
            pk_mbarrier_arrive_expect_tx(q_full, 2 * Q_BYTES);
            for (int nb = 0; nb < NB; nb++) {
                pk_tma_load_4d(qs + nb * R * 128, tq, q_full, nb * 64, h, q0, b);
                pk_tma_load_4d(dos + nb * R * 128, tdo, q_full, nb * 64, h, q0, b);
            }
            for (int i = 0, j = kt0; j < kt1; j++, i++) {
                const int s = i % ST;
                pk_mbarrier_wait_parity(&empty[s], ((i / ST) & 1) ^ 1);
                pk_mbarrier_arrive_expect_tx(&full[s], 2 * STEP_BYTES);
                for (int nb = 0; nb < NB; nb++) {
                    pk_tma_load_4d(ks + s * STEP_BYTES + nb * C * 128, tk, &full[s], nb * 64, kvh, j * C, b);
                    pk_tma_load_4d(vs + s * STEP_BYTES + nb * C * 128, tv, &full[s], nb * 64, kvh, j * C, b);
                }
            }
        }
        return;
    }

    // ---- consumers: rows = queries q0 + 64c + 16 wq + g (+ 8) ----
    pk_setmaxnreg_inc<240>();
    const int c = wg - 1, lane = tid % 32, wq = (tid / 32) % 4, g = lane / 4, t = lane % 4;
    float dqa[D / 2] = {};
    const float sl2 = scale * 1.4426950408889634f;
    const int row0 = q0 + 64 * c + 16 * wq + g;
    int rlo[2], rhi[2];
    float l2[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        pk_attn_q_row(row, n_q, n_k, window_left, window_right, rlo[r], rhi[r]);
        const long long idx = ((long long)b * n_q + row) * n_heads + h;
        const float lv = row < n_q ? lse[idx] : PK_NEG_INF;
        l2[r] = lv == PK_NEG_INF ? -PK_NEG_INF : lv * 1.4426950408889634f;
        dl[r] = row < n_q ? delta[idx] : 0.0f;
    }
    const unsigned long long dq_a = pk_wgmma_desc(qs + c * 64 * 128, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long ddo_a = pk_wgmma_desc(dos + c * 64 * 128, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long dk_b = pk_wgmma_desc(ks, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long dv_b = pk_wgmma_desc(vs, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long dk_t = pk_wgmma_desc(ks, C * 128, 1024, PK_SWIZZLE_128B);  // MN-major
    pk_mbarrier_wait_parity(q_full, 0);

    for (int i = 0, j = kt0; j < kt1; j++, i++) {
        const int s = i % ST, k0 = j * C;
        const bool need_mask = k0 < span.full_lo || k0 + C - 1 > span.full_hi;
        float sc[C / 2], dp[C / 2];
        pk_mbarrier_wait_parity(&full[s], (i / ST) & 1);
        ab90_two_products<DT, D, R, C>(sc, dp, dq_a, pk_wgmma_desc_advance(dk_b, s * STEP_BYTES), ddo_a,
                                    pk_wgmma_desc_advance(dv_b, s * STEP_BYTES));
        unsigned da[C / 16][4];
#pragma unroll
        for (int jj = 0; jj < C / 8; jj++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float ds[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int i4 = 4 * jj + 2 * r + e;
                    float p = pk_ex2_approx(fmaf(sc[i4], sl2, -l2[r]));
                    if (need_mask) {
                        const int col = k0 + 8 * jj + 2 * t + e;
                        if (col < rlo[r] || col > rhi[r]) p = 0.0f;
                    }
                    ds[e] = p * (dp[i4] - dl[r]);
                }
                da[jj / 2][2 * (jj & 1) + r] = Pk16<T>::narrow2(ds[0], ds[1]);
            }
        pk_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++)
            pk_wgmma_m64nNk16_rs<D, DT, 1>(dqa, da[kk], pk_wgmma_desc_advance(dk_t, s * STEP_BYTES + kk * 2048), 1);
        pk_wgmma_commit();
        pk_wgmma_wait<0>();
        pk_mbarrier_arrive(&empty[s]);
    }

    const long long row_stride = (long long)n_heads * D;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        if (row >= n_q) continue;
        T* o = dq + ((long long)b * n_q + row) * row_stride + (long long)h * D;
#pragma unroll
        for (int jj = 0; jj < D / 8; jj++)
            *reinterpret_cast<unsigned int*>(o + 8 * jj + 2 * t) =
                Pk16<T>::narrow2(dqa[4 * jj + 2 * r] * scale, dqa[4 * jj + 2 * r + 1] * scale);
    }
}

#define AB90_ENTRY(name, body, D)                                                                                   \
    template <typename T, typename... A>                                                                            \
    __device__ __forceinline__ void name##_impl(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, \
                                                const CUtensorMap& tdo, A... a) {                                   \
        body<T, D>(&tq, &tk, &tv, &tdo, a...);                                                                      \
    }
AB90_ENTRY(attention_bwd_sm90_dkdv_d64, ab90_dkdv, 64)
AB90_ENTRY(attention_bwd_sm90_dkdv_d128, ab90_dkdv, 128)
AB90_ENTRY(attention_bwd_sm90_dq_d64, ab90_dq, 64)
AB90_ENTRY(attention_bwd_sm90_dq_d128, ab90_dq, 128)

PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d64, (AB90_THREADS, 1),
                (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                 const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tdo,
                 const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk,
                 T* __restrict__ dv, int batch, int n_q, int n_k, int n_heads, int n_kv_heads, float scale,
                 int window_left, int window_right),
                (tq, tk, tv, tdo, lse, delta, dk, dv, batch, n_q, n_k, n_heads, n_kv_heads, scale, window_left,
                 window_right))

PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d128, (AB90_THREADS, 1),
                (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                 const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tdo,
                 const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk,
                 T* __restrict__ dv, int batch, int n_q, int n_k, int n_heads, int n_kv_heads, float scale,
                 int window_left, int window_right),
                (tq, tk, tv, tdo, lse, delta, dk, dv, batch, n_q, n_k, n_heads, n_kv_heads, scale, window_left,
                 window_right))

PK_IO16_KERNELS(attention_bwd_sm90_dq_d64, (AB90_THREADS, 1),
                (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                 const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tdo,
                 const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, int batch,
                 int n_q, int n_k, int n_heads, int n_kv_heads, float scale, int window_left, int window_right),
                (tq, tk, tv, tdo, lse, delta, dq, batch, n_q, n_k, n_heads, n_kv_heads, scale, window_left,
                 window_right))

PK_IO16_KERNELS(attention_bwd_sm90_dq_d128, (AB90_THREADS, 1),
                (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                 const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tdo,
                 const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, int batch,
                 int n_q, int n_k, int n_heads, int n_kv_heads, float scale, int window_left, int window_right),
                (tq, tk, tv, tdo, lse, delta, dq, batch, n_q, n_k, n_heads, n_kv_heads, scale, window_left,
                 window_right))
