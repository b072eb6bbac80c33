// pykern: arch sm_90a
// Hopper (sm_90a) FP8 FlashAttention forward (FlashAttention-3's FP8 path): q, k, v float8_e4m3fn with fp32
// descales, out bf16 and the natural-log lse f32:
//   O = softmax(scale * qd * kd * Q K^T [+ window mask]) V * vd,
// qd / kd / vd read per (batch, kv head) at (b * n_kv_heads + kvh) * stride, stride 0 for one per-tensor value
// (FA3's q_descale / k_descale / v_descale). Layouts, GQA mapping, bottom-right window / causal mask and the
// empty-row convention are attention_fwd_sm90.cu's (rows that see no key: out = 0, lse = -inf).
//
// Work split as attention_fwd_sm90.cu: a CTA of 3 warpgroups (384 threads) owns BR = 128 queries of one (batch,
// head); warpgroup 0 is the TMA producer (Q once, then K and V tiles of BC = 128 keys into a 2-slot ring with
// full / empty mbarriers), warpgroups 1 and 2 the consumers (64 query rows each). What differs for 8-bit
// elements (e4m3 wgmma, QGMMA, is m64nNk32 and takes both operands K-major):
//   S = Q K^T : wgmma m64n128k32 SS e4m3, Q and K rows of head_dim bytes in boxes of 64 bytes (64B swizzle);
//   V^T       : P V needs V K-major, i.e. transposed (keys along the 16-byte units). The two consumer warpgroups
//               transpose each V tile in shared memory into the slot's V^T buffer (fa90f8_transpose_v: 4-byte
//               loads and byte permutes, 16-byte stores) while their S wgmmas run, then meet on named barrier 1
//               (after fence.proxy.async: generic writes, async-proxy reads). No host-side copy.
//   P         : the exact online softmax per tile in fp32 (scores scaled once by scale * qd * kd * log2 e, so a
//               descale of any sign is right), P = 2^(s - max + 8) in [0, 256] (FA3's max_offset 8: e4m3 keeps
//               its 3 mantissa bits down to 2^-6 * 2^8 of the row max instead of flushing small P to subnormals;
//               l sums the same P, so the factor cancels), rounded to e4m3 straight from the S accumulators into
//               the A registers of O += P V^T (wgmma m64n<D>k32 RS e4m3). The accumulator gives a thread keys
//               {8j + 2t, 8j + 2t + 1} of a 32-key step, the A fragment wants columns 4t..4t+3 and 16+4t..16+4t+3;
//               rather than moving bytes between lanes (FA3's permute_regs_A_to_C), the transpose writes V^T's
//               key columns in that order (fa90f8_key), which the sum over keys does not see.
//   O         : fp32 accumulators; out = O / l * vd (bf16), lse = ln 2 * (m + log2 l - 8).
// Shared memory (dynamic, 1024-byte aligned): Q [D/64][BR][64], K [2][D/64][BC][64], V [2][D/64][BC][64] (each
// [rows][64] box one TMA load, 64B swizzle), V^T [2][BC/64][D][64] (64B swizzle), then the mbarriers.
// Tensor maps (pykern/ops/_attention_sm90.py, try_forward_fp8): q (batch, n_q, n_heads, D), k / v (batch, n_k,
// n_kv_heads, D) as uint8 with boxes (1, BR or BC, 1, 64), swizzle 64B; rows past n_q / n_k load as zeros.
// Kernel names: attention_fwd_sm90_d{64,128,256}_fp8 (head_dim == head_dim_v).
#include "pk_common.cuh"
#include "pk_ptx.cuh"
#include "pk_attn_window.cuh"
#include "pk_attn_tc.cuh"  // pk_attn_epilogue, pk_quad_rescale

#define FA90F8_BR 128
#define FA90F8_BC 128
#define FA90F8_ST 2
#define FA90F8_THREADS 384
#define FA90F8_BAR_VT 1  // named barrier of the two consumer warpgroups: the slot's V^T is written
// Q + K + V + V^T + the mbarriers (pykern/ops/_attention_sm90.py: fp8_shared_bytes).
#define FA90F8_SMEM_BYTES(D) (FA90F8_BR * (D) + 3 * FA90F8_ST * FA90F8_BC * (D) + 1024)

// The key held at column c (0..31) of a 32-key k-step of P's A fragment: a[r] byte e of lane (g, t) is column
// 4t + e + 16 (r >> 1) and holds the accumulator's key 8 (2 (r >> 1) + (e >> 1)) + 2t + (e & 1) (see the header).
__device__ __forceinline__ int fa90f8_key(int c) {
    return 16 * (c >> 4) + 8 * ((c & 3) >> 1) + 2 * ((c >> 2) & 3) + (c & 1);
}

// V (slot: [D/64][BC][64] bytes, 64B swizzle) -> V^T ([BC/64][D][64], 64B swizzle, key columns in fa90f8_key's
// order), by the 256 consumer threads (ct = 0..255). A unit is 4 head-dim rows by 16 key columns: 16 4-byte loads
// (V[key][d0..d0+3]), a 4x4 byte transpose of each 4 of them (3 byte permutes an output word), 4 16-byte stores.
template <int D>
__device__ __forceinline__ void fa90f8_transpose_v(const unsigned char* vs, unsigned char* vt, int ct) {
    constexpr int BC = FA90F8_BC, UNITS = (D / 4) * (BC / 16);  // 128 (d64: half the threads), 256, 512
    // d64 / d128: one unit a thread at most, no inner loop in the tile loop; d256: two, in a loop (unrolled, the
    // two units' registers on top of O's 128 and S's 64 accumulators spill)
#pragma unroll 1
    for (int u = ct; u < UNITS; u += 256) {
        const int d0 = 4 * (u % (D / 4)), c0 = 16 * (u / (D / 4));
        unsigned w[16];
#pragma unroll
        for (int e = 0; e < 16; e++) {
            const int c = c0 + e, key = (c & ~31) + fa90f8_key(c & 31);
            w[e] = *reinterpret_cast<const unsigned*>(
                vs + (d0 / 64) * BC * 64 + pk_swizzle_offset(key * 64 + d0 % 64, PK_SWIZZLE_64B));
        }
#pragma unroll
        for (int r = 0; r < 4; r++) {
            unsigned o[4];
            const unsigned sel = (unsigned)r | (unsigned)(4 + r) << 4;  // byte r of a, byte r of b
#pragma unroll
            for (int x = 0; x < 4; x++)
                o[x] = pk_prmt(pk_prmt(w[4 * x], w[4 * x + 1], sel), pk_prmt(w[4 * x + 2], w[4 * x + 3], sel), 0x5410);
            unsigned char* dst = vt + (c0 / 64) * D * 64 + pk_swizzle_offset((d0 + r) * 64 + c0 % 64, PK_SWIZZLE_64B);
            if constexpr (D < 256) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
            } else {  // d256: O's 128 accumulators and S's 64 are live here; 4-byte stores need fewer registers
#pragma unroll
                for (int x = 0; x < 4; x++) reinterpret_cast<unsigned*>(dst)[x] = o[x];
            }
        }
        if constexpr (UNITS <= 256) break;  // d64 / d128: a single pass (ptxas then emits no loop)
    }
}

// The exact online softmax of one tile (scores already in log2 units) for this thread's rows g and g + 8: P =
// 2^(s - m + 8) rounded to e4m3 into the A registers of the P V^T k-steps, l the rows' partial sums (of the
// unrounded P), O rescaled by 2^(m_old - m_new).
template <int D>
__device__ __forceinline__ void fa90f8_softmax(const float (&s)[FA90F8_BC / 2], float (&o)[D / 2], float (&m)[2],
                                               float (&l)[2], unsigned (&pa)[FA90F8_BC / 32][4]) {
    constexpr int BC = FA90F8_BC;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float mx = pk_wgmma_row_max<BC>(s, r, m[r]);
        float base;
        const float al = pk_quad_rescale(mx, m[r], 1.0f, base);
        base -= 8.0f;  // P in [0, 256]: the e4m3 range above its subnormals (FA3's max_offset)
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < BC / 8; j += 2) {
            // n-tiles j, j + 1 (keys 8j + 2t + {0, 1, 8, 9}) are bytes 0..3 of a[2 * ((j / 2) & 1) + r] of k-step
            // j / 4.
            const float p0 = pk_ex2_approx(s[4 * j + 2 * r] - base), p1 = pk_ex2_approx(s[4 * j + 2 * r + 1] - base);
            const float p2 = pk_ex2_approx(s[4 * j + 4 + 2 * r] - base);
            const float p3 = pk_ex2_approx(s[4 * j + 5 + 2 * r] - base);
            sum += (p0 + p1) + (p2 + p3);
            pa[j / 4][2 * ((j / 2) & 1) + r] =
                (unsigned)pk_cvt_e4m3x2(p0, p1) | (unsigned)pk_cvt_e4m3x2(p2, p3) << 16;
        }
        l[r] = l[r] * al + sum;
#pragma unroll
        for (int j = 0; j < D / 8; j++) o[4 * j + 2 * r] *= al, o[4 * j + 2 * r + 1] *= al;
    }
}

template <int D>
__device__ __forceinline__ void fa90f8_forward(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                                               __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
                                               const float* __restrict__ q_descale,
                                               const float* __restrict__ k_descale,
                                               const float* __restrict__ v_descale, int qd_stride, int kd_stride,
                                               int vd_stride, int n_q, int n_k, int n_heads, int n_kv_heads,
                                               float scale, int window_left, int window_right) {
    constexpr int BC = FA90F8_BC, ST = FA90F8_ST, NB = D / 64;
    constexpr unsigned Q_BYTES = FA90F8_BR * D, K_BYTES = BC * D, V_BYTES = BC * D;
    extern __shared__ __align__(1024) unsigned char fa90f8_smem[];
    unsigned char* qs = fa90f8_smem;
    unsigned char* ks = qs + Q_BYTES;       // [ST][NB][BC][64 B]
    unsigned char* vs = ks + ST * K_BYTES;  // [ST][NB][BC][64 B]
    unsigned char* vt = vs + ST * V_BYTES;  // [ST][BC / 64][D][64 B]
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(vt + ST * V_BYTES);
    unsigned long long *q_full = bars, *full = bars + 1, *empty = bars + 1 + ST;

    const int tid = threadIdx.x, wg = tid / 128;
    const PkAttnQTile tile = pk_attn_q_tile(n_q, FA90F8_BR, n_heads, n_kv_heads, window_right);
    const int b = tile.b, h = tile.h, kvh = tile.kvh, qt = tile.qt;
    const int q0 = qt * FA90F8_BR;
    const int q_last = min(q0 + FA90F8_BR, n_q) - 1;
    const PkAttnSpan span = pk_attn_q_span(q0, q_last, n_q, n_k, window_left, window_right);
    const int kt0 = span.lo / BC, kt1 = span.hi < span.lo ? kt0 : span.hi / BC + 1;
    // Tiles [f0, f1) every row sees wholly: no mask there.
    const int f0 = max((span.full_lo + BC - 1) / BC, kt0), f1 = min((span.full_hi + 1) / BC, kt1);

    pk_ring_init<ST>(q_full, full, empty, 256);

    if (wg == 0) {  // ---- producer ----
        pk_setmaxnreg_dec<24>();
        if (tid < 32 && pk_elect_one()) {
            pk_mbarrier_arrive_expect_tx(q_full, Q_BYTES);
            for (int nb = 0; nb < NB; nb++) pk_tma_load_4d(qs + nb * FA90F8_BR * 64, tq, q_full, nb * 64, h, q0, b);
            int i = 0;
            for (int j = kt1 - 1; j >= kt0; j--, i++) {
                const int s = i % ST;
                pk_mbarrier_wait_parity(&empty[s], ((i / ST) & 1) ^ 1);
                pk_mbarrier_arrive_expect_tx(&full[s], K_BYTES + V_BYTES);
                for (int nb = 0; nb < NB; nb++) {
                    pk_tma_load_4d(ks + s * K_BYTES + nb * BC * 64, tk, &full[s], nb * 64, kvh, j * BC, b);
                    pk_tma_load_4d(vs + s * V_BYTES + nb * BC * 64, tv, &full[s], nb * 64, kvh, j * BC, b);
                }
            }
        }
        return;
    }

    // ---- consumers ----
    pk_setmaxnreg_inc<240>();
    const int c = wg - 1, lane = tid % 32, wq = (tid / 32) % 4, g = lane / 4, t = lane % 4;
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) o[i] = 0.0f;
    float m[2] = {PK_NEG_INF, PK_NEG_INF}, l[2] = {0.0f, 0.0f};  // rows g and g + 8, m in log2 units
    const long long di = (long long)b * n_kv_heads + kvh;
    // Scores to log2 units in one multiply: the descales fold into the softmax scale.
    const float sl2 = scale * q_descale[di * qd_stride] * k_descale[di * kd_stride] * 1.4426950408889634f;
    const int row0 = q0 + 64 * c + 16 * wq + g;
    int rlo[2], rhi[2];
    pk_attn_q_rows(row0, n_q, n_k, window_left, window_right, rlo, rhi);

    // K-major, 64B swizzle: SBO 512 = one 8-row group of 64-byte rows; a k32 step is 32 bytes of a box.
    const unsigned long long dq = pk_wgmma_desc(qs + c * 64 * 64, 16, 512, PK_SWIZZLE_64B);
    const unsigned long long dk0 = pk_wgmma_desc(ks, 16, 512, PK_SWIZZLE_64B);
    const unsigned long long dvt0 = pk_wgmma_desc(vt, 16, 512, PK_SWIZZLE_64B);
    pk_mbarrier_wait_parity(q_full, 0);

    unsigned i = 0;  // tiles visited (slot i % ST, phase (i / ST) & 1)
    for (int j = kt1 - 1; j >= kt0; j--, i++) {
        const unsigned st = i % ST;
        float s[BC / 2];
        pk_mbarrier_wait_parity(&full[st], (i / ST) & 1);
        pk_wgmma_fence();
#pragma unroll
        for (int ks_ = 0; ks_ < D / 32; ks_++)  // k-step: box ks_ / 2, 32 bytes further per step inside it
            pk_wgmma_m64nNk32_e4m3_ss<BC>(
                s, pk_wgmma_desc_advance(dq, (ks_ / 2) * FA90F8_BR * 64 + (ks_ % 2) * 32),
                pk_wgmma_desc_advance(dk0, st * K_BYTES + (ks_ / 2) * BC * 64 + (ks_ % 2) * 32), ks_ > 0);
        pk_wgmma_commit();
        // While S runs: this slot's V^T (the other slot's is still read by the P V^T of the tile before, which
        // every consumer thread completed before it reached the previous tile's barrier below).
        fa90f8_transpose_v<D>(vs + st * V_BYTES, vt + st * V_BYTES, tid - 128);
        pk_fence_proxy_async_shared();  // the generic-proxy V^T writes before the async-proxy (wgmma) reads
        pk_bar_sync_aligned(FA90F8_BAR_VT, 256);
        pk_wgmma_wait<0>();
#pragma unroll
        for (int x = 0; x < BC / 2; x++) s[x] *= sl2;
        if (j < f0 || j >= f1) {  // a boundary tile: the mask
            const int k0 = j * BC;
#pragma unroll
            for (int x = 0; x < BC / 2; x++) {
                const int col = k0 + 8 * (x / 4) + 2 * t + (x & 1), r = (x >> 1) & 1;
                if (col < rlo[r] || col > rhi[r]) s[x] = PK_NEG_INF;
            }
        }
        unsigned pa[BC / 32][4];
        fa90f8_softmax<D>(s, o, m, l, pa);
        pk_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 32; kk++)  // k-step kk: V^T box kk / 2, 32 bytes further per step inside it
            pk_wgmma_m64nNk32_e4m3_rs<D>(o, pa[kk],
                                         pk_wgmma_desc_advance(dvt0, st * V_BYTES + (kk / 2) * D * 64 + (kk % 2) * 32),
                                         1);
        pk_wgmma_commit();
        pk_wgmma_wait<0>();
        pk_mbarrier_arrive(&empty[st]);  // this thread is done with the slot's K, V and V^T
    }

    // P carried 2^8 (fa90f8_softmax): l / 256 is the true sum and vd / 256 undoes it in O (powers of two: exact).
    l[0] *= 1.0f / 256.0f, l[1] *= 1.0f / 256.0f;
    const float vd = v_descale[di * vd_stride] * (1.0f / 256.0f);
    const long long o_stride = (long long)n_heads * D;
    pk_attn_epilogue(  // m is in log2 units already
        l, m, 1.0f, vd, row0, n_q,
        [&](int r, int row, float inv) {
            __nv_bfloat16* orow = out + ((long long)b * n_q + row) * o_stride + (long long)h * D;
#pragma unroll
            for (int jj = 0; jj < D / 8; jj++)
                *reinterpret_cast<unsigned int*>(orow + 8 * jj + 2 * t) =
                    Pk16<__nv_bfloat16>::narrow2(o[4 * jj + 2 * r] * inv, o[4 * jj + 2 * r + 1] * inv);
        },
        [&](int row) { return lse + ((long long)b * n_q + row) * n_heads + h; });
}

// flash_attention with float8_e4m3fn q, k, v (bytes here): out (batch, n_q, n_heads, D) bf16, lse (batch, n_q,
// n_heads) f32; descales fp32, element (b * n_kv_heads + kvh) * stride (stride 0: one per-tensor value); the
// window normalized as flash_attention does; grid batch * n_heads * query tiles.
// The registry reads each kernel's parameter list from its text: the three are spelled out.
#define FA90F8_BODY(D)                                                                                            \
    (void)batch;                                                                                                  \
    fa90f8_forward<D>(&tq, &tk, &tv, out, lse, q_descale, k_descale, v_descale, qd_stride, kd_stride, vd_stride,  \
                      n_q, n_k, n_heads, n_kv_heads, scale, window_left, window_right);
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_sm90_d64_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, int batch, int n_q, int n_k, int n_heads, int n_kv_heads,
    float scale, int window_left, int window_right) { FA90F8_BODY(64) }
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_sm90_d128_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, int batch, int n_q, int n_k, int n_heads, int n_kv_heads,
    float scale, int window_left, int window_right) { FA90F8_BODY(128) }
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_sm90_d256_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, int batch, int n_q, int n_k, int n_heads, int n_kv_heads,
    float scale, int window_left, int window_right) { FA90F8_BODY(256) }
