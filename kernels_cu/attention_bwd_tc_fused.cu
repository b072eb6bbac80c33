// Fused tensor-core attention backward (FlashAttention-2's design) and the passes around it, bf16 and f16:
//   attention_bwd_tc_fused_d{64,128}[_softcap][_det]: the mma.sync fused dK / dV / dQ kernel, head_dim 64 / 128
//     (the op launches it for head_dim exactly 64 / 128), on sm_80 ... sm_90: built for every arch, a trap on
//     sm_100 / sm_120, where ptxas spills it and the op keeps attention_bwd_tc.cu's dK/dV + dQ pair (abf_entry).
//     Same inputs, mask (bottom-right window, causal = window_right 0), GQA mapping, scale and softcap as
//     attention_bwd_tc.cu.
//   attention_bwd_tc_prep: the pre-pass (delta, the lse / delta runs, with zero_ws the fp32 dQ accumulator
//     zeroed) of this kernel and of the sm_90a fused kernels (attention_bwd_sm90.cu).
//   attention_bwd_tc_dq_reduce_d{64,128,96}: the dQ narrowing (the _det partials summed in key-tile order, times
//     scale, to T). d64 / d128 serve this kernel and narrow the sm_90a fused kernels' accumulators (d256's read as
//     d128 runs, a head dim's halves); d96 narrows the sm_90a fused d96 kernel's only (there is no mma.sync d96
//     fused kernel).
//
// attention_bwd_tc_fused_d{D}[_softcap][_det]_{bf16,f16}: a CTA per (key tile of BC = 64 keys, kv head,
// batch). K and V stay in shared memory, dK and dV in fp32 registers (warp w owns keys 16w..16w+15 and works
// in the transposed domain, its keys being the MMA rows). The CTA walks every query tile (BR queries) of
// every query head of its GQA group that sees one of its keys, Q / dO / lse / delta streamed through two
// shared buffers with cp.async (tile n + 1 copies while tile n computes). Five matmuls a tile:
//     S^T  = K Q^T            P^T = exp2(S^T * scale * log2e - lse * log2e)
//     dP^T = V dO^T           dS^T = P^T (dP^T - delta)       (softcap: times 1 - tanh^2)
//     dV  += P^T dO           dK  += dS^T Q                   (P^T, dS^T rounded to T in registers)
//     dQ   = dS K             (dS^T through shared memory; warp w takes head_dim columns w*D/4 ..)
// dQ is added in fp32 to a workspace: RED.E.ADD.F32 atomics (default), or with _det a plain store of this
// key tile's partial into workspace slice [kt - kt_begin] that attention_bwd_tc_dq_reduce sums over the
// key tiles in a fixed order (bit-identical run to run).
// Query tiles whose every query sees every key of the CTA (and lie inside n_q, the key tile inside n_k,
// the inputs 16-byte aligned) run the flat loop: no mask, no bounds checks, the next tile's copy unchecked.
// The others (window edges, ragged tails) run the general step with masks and checked copies.
// Operands come through ldmatrix (.trans for dO, Q and K as the k-major B operands and for dS as A), shared
// rows padded by 16 bytes (row r starts at bank 4r mod 32: the 8 rows of an ldmatrix phase and the cp.async
// 16-byte chunks land in distinct banks without an XOR swizzle, and every offset stays a compile-time
// immediate on one base register).
// lse and delta come from attention_bwd_tc_prep, (batch, head, n_q rounded up to the query tile) fp32, lse
// already times log2e, padded rows zero: a query tile's BR values are one contiguous 16-byte-aligned run.
#include "pk_attn_tc.cuh"

#define ABF_BC 64
#define ABF_LOG2E 1.4426950408889634f

// BR: queries per streamed tile; MINB: CTAs per SM asked of ptxas.
template <int D> struct AbfCfg;
template <> struct AbfCfg<64> { enum { BR = 32, MINB = 2 }; };
template <> struct AbfCfg<128> { enum { BR = 16, MINB = 1 }; };

// Shared-memory bytes (the op passes the same figure): K, V, two Q and two dO tiles, dS^T, two lse and
// two delta runs.
#define ABF_SMEM(D, BR) ((2 * ABF_BC + 4 * (BR)) * ((D) + 8) * 2 + ABF_BC * ((BR) + 8) * 2 + 4 * (BR) * 4)

// acc (this warp's 16 rows of the key tile x NT n-tiles of the query tile) += A B^T over head_dim: A's rows
// (K or V) ldmatrix'd from a_at, B's (Q or dO) from b_at, both byte offsets into sm with the lane's row offset
// folded in (compile-time immediates on one base register once inlined).
template <typename T, int D, int NT, int SD>
__device__ __forceinline__ void abf_kd_pass(float (&acc)[NT][4], const unsigned char* sm, unsigned a_at,
                                            unsigned b_at) {
#pragma unroll
    for (int kd = 0; kd < D / 16; kd++) {
        unsigned int a[4];
        pk_ldmatrix_x4_at(a, sm, a_at + kd * 32);
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            unsigned int b[4];
            pk_ldmatrix_x4_at(b, sm, b_at + np * 16 * SD * 2 + kd * 32);
            pk_mma_m16n8k16<T>(acc[2 * np], a, b, acc[2 * np]);
            pk_mma_m16n8k16<T>(acc[2 * np + 1], a, b + 2, acc[2 * np + 1]);
        }
    }
}

template <bool B> struct AbfTag { static constexpr bool value = B; };

template <typename T, int D, bool SC, bool DET>
__device__ __forceinline__ void abf_body(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                         const T* __restrict__ grad_out, const float* __restrict__ lse2,
                                         const float* __restrict__ dlt, float* __restrict__ dq_ws,
                                         T* __restrict__ dk, T* __restrict__ dv, int n_q, int n_k, int n_heads,
                                         int n_kv_heads, int nq_pad, int kt_begin, long long ws_stride, float scale,
                                         int window_left, int window_right, float softcap) {
    constexpr int BC = ABF_BC, BR = AbfCfg<D>::BR, SD = D + 8, SDS = BR + 8;
    constexpr int NT = BR / 8, ON = D / 8, CH = D / 8;
    constexpr int RPP = FATC_THREADS / CH;        // tile rows per cp.async pass
    constexpr int PASSES = BR / RPP;              // cp.async passes per Q (and per dO) tile
    constexpr int DW = D / 4;                     // dQ columns per warp
    constexpr int MB = BR / 16, QN = DW / 8;      // dQ m-tiles and n-tiles per warp
    // byte offsets in shared memory
    constexpr unsigned K_OFF = 0, V_OFF = BC * SD * 2, Q_OFF = 2 * BC * SD * 2;
    constexpr unsigned QBUF = BR * SD * 2;        // one Q (or dO) buffer
    constexpr unsigned DO_OFF = Q_OFF + 2 * QBUF;
    constexpr unsigned DS_OFF = DO_OFF + 2 * QBUF;
    constexpr unsigned L_OFF = DS_OFF + BC * SDS * 2;  // lse[2][BR], then delta[2][BR]
    extern __shared__ __align__(16) unsigned short abf_smem[];
    unsigned char* sm = reinterpret_cast<unsigned char*>(abf_smem);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kt = kt_begin + blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
    const int group = n_heads / n_kv_heads;
    const int k0 = kt * BC;
    const long long kv_stride = (long long)n_kv_heads * D, q_stride = (long long)n_heads * D;
    const long long k_base = (long long)b * n_k * kv_stride + (long long)kh * D;
    const bool vec = ((reinterpret_cast<unsigned long long>(q) | reinterpret_cast<unsigned long long>(k) |
                       reinterpret_cast<unsigned long long>(v) | reinterpret_cast<unsigned long long>(grad_out)) &
                      15) == 0;

    fatc_load_tile<D, BC>(abf_smem + K_OFF / 2, k, k_base, kv_stride, k0, n_k, D, vec);
    fatc_load_tile<D, BC>(abf_smem + V_OFF / 2, v, k_base, kv_stride, k0, n_k, D, vec);
    pk_cp_async_commit();

    // ldmatrix row addresses of this lane (bytes): A of the warp's 16 keys; B (16 n x 16 k, k contiguous);
    // B through .trans (16 k x 16 n stored k-major); dS as A through .trans (stored [key][query]).
    const unsigned a_off = ((warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * SD + 8 * (lane >> 4)) * 2;
    const unsigned b_off = (((lane & 7) + 8 * (lane >> 4)) * SD + 8 * ((lane >> 3) & 1)) * 2;
    const unsigned t_off = (((lane & 7) + 8 * ((lane >> 3) & 1)) * SD + 8 * (lane >> 4)) * 2;
    const unsigned s_off = (((lane & 7) + 8 * (lane >> 4)) * SDS + 8 * ((lane >> 3) & 1)) * 2;
    const unsigned dsw_off = DS_OFF + ((warp * 16 + g) * SDS + 2 * t) * 2;  // this lane's dS^T words
    // This thread's cp.async chunk of a Q / dO tile: row tid / CH (+ RPP per pass), 8 halves at column.
    const int c_row = tid / CH, c_col = (tid % CH) * 8;
    // (recomputed where used: a value kept live across the general steps costs the flat loop a register)
    auto c_soff = [&]() { return (unsigned)(((threadIdx.x / CH) * SD + (threadIdx.x % CH) * 8) * 2); };

    float acc_dv[ON][4], acc_dk[ON][4];
#pragma unroll
    for (int i = 0; i < ON; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc_dv[i][e] = acc_dk[i][e] = 0.0f;
    const float sl2 = SC ? softcap * ABF_LOG2E : scale * ABF_LOG2E;
    const float pre = SC ? scale / softcap : 0.0f;
    const int key0 = k0 + warp * 16 + g;

    const PkAttnSpan span = pk_attn_k_span(k0, min(k0 + BC, n_k) - 1, n_q, n_k, window_left, window_right);
    const int i_start = span.lo / BR, i_end = span.hi < span.lo ? i_start : span.hi / BR + 1;
    const int dlo = n_k - n_q - window_left, dhi = n_k - n_q + window_right;
    // Full query tiles [f_lo, f_hi): every query of the tile sees every key of ours, all inside n_q / n_k:
    //   k0 + BC - 1 - q0 <= dhi, k0 - (q0 + BR - 1) >= dlo, q0 + BR <= n_q.
    int f_lo = i_end, f_hi = i_end;
    if (vec && k0 + BC <= n_k) {
        const long long lo_q = (long long)k0 + BC - 1 - dhi;          // q0 >= lo_q
        const long long hi_q = min((long long)k0 - BR + 1 - dlo, (long long)n_q - BR);  // q0 <= hi_q
        const long long a = lo_q <= 0 ? 0 : (lo_q + BR - 1) / BR;
        const long long z = hi_q < 0 ? -1 : hi_q / BR;
        const long long flo = a > i_start ? a : i_start, fhi = z + 1 < i_end ? z + 1 : i_end;
        if (flo < fhi) { f_lo = (int)flo; f_hi = (int)fhi; }
        else f_lo = f_hi = i_end;
    }

    // Copy query tile `it` of head h into buffer `buf` (checked: rows past n_q zero; lse / delta runs are
    // padded, never checked).
    auto load_checked = [&](int h, int it, int buf) {
        const long long q_base = (long long)b * n_q * q_stride + (long long)h * D;
        fatc_load_tile<D, BR>(abf_smem + (Q_OFF + buf * QBUF) / 2, q, q_base, q_stride, it * BR, n_q, D, vec);
        fatc_load_tile<D, BR>(abf_smem + (DO_OFF + buf * QBUF) / 2, grad_out, q_base, q_stride, it * BR, n_q, D, vec);
        if (tid < BR / 2) {  // BR / 4 chunks of lse, then BR / 4 of delta
            const long long r = ((long long)b * n_heads + h) * nq_pad + it * BR + (tid % (BR / 4)) * 4;
            const float* src = tid < BR / 4 ? lse2 : dlt;
            pk_cp_async_16_at(sm, L_OFF + ((tid < BR / 4 ? 0 : 2) + buf) * BR * 4 + (tid % (BR / 4)) * 16, src + r);
        }
        pk_cp_async_commit();
    };
    // The same for a full tile: no checks; qt / gt already point at this thread's first chunk, lt at its
    // lse or delta chunk.
    const bool l_thread = tid < BR / 2;
    const unsigned l_soff = L_OFF + ((tid < BR / 4 ? 0 : 2) * BR + (tid % (BR / 4)) * 4) * 4;
    auto load_full = [&](const T* qt, const T* gt, const float* lt, int buf) {
#pragma unroll
        for (int i = 0; i < PASSES; i++) {
            pk_cp_async_16_at(sm, Q_OFF + buf * QBUF + c_soff() + i * RPP * SD * 2, qt + i * RPP * q_stride);
            pk_cp_async_16_at(sm, DO_OFF + buf * QBUF + c_soff() + i * RPP * SD * 2, gt + i * RPP * q_stride);
        }
        if (l_thread) pk_cp_async_16_at(sm, l_soff + buf * BR * 4, lt);
        pk_cp_async_commit();
    };

    // One query tile from buffer `buf`: the five matmuls; MASK = the general step (mask, ragged rows).
    auto compute = [&](auto mask_tag, int h, int q0, int buf) {
        constexpr bool MASK = decltype(mask_tag)::value;
        const unsigned qo = Q_OFF + buf * QBUF, go = DO_OFF + buf * QBUF;
        float s[NT][4], dp[NT][4];
#pragma unroll
        for (int i = 0; i < NT; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[i][e] = dp[i][e] = 0.0f;
        // S^T = K Q^T, then dP^T = V dO^T, k over head_dim (two passes: fewer fragments live at once)
        abf_kd_pass<T, D, NT, SD>(s, sm, K_OFF + a_off, qo + b_off);
        abf_kd_pass<T, D, NT, SD>(dp, sm, V_OFF + a_off, go + b_off);
        // P^T and dS^T on the accumulator fragments (keys g, g + 8 of the warp; queries nt*8 + 2t, +1)
        const float* ls = reinterpret_cast<const float*>(sm + L_OFF + buf * BR * 4);
        const float* ds_ = reinterpret_cast<const float*>(sm + L_OFF + (2 + buf) * BR * 4);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float2 l2 = *reinterpret_cast<const float2*>(ls + nt * 8 + 2 * t);
            const float2 d2 = *reinterpret_cast<const float2*>(ds_ + nt * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = s[nt][e], th = 0.0f;
                if (SC) {
                    th = __tanhf(x * pre);
                    x = th;
                }
                float p = pk_ex2_approx(x * sl2 - ((e & 1) ? l2.y : l2.x));
                if (MASK) {
                    const int col = q0 + nt * 8 + 2 * t + (e & 1), key = key0 + 8 * (e >> 1), dd = key - col;
                    p = (col < n_q && key < n_k && dd >= dlo && dd <= dhi) ? p : 0.0f;
                }
                float d = p * (dp[nt][e] - ((e & 1) ? d2.y : d2.x));
                if (SC) d *= 1.0f - th * th;
                s[nt][e] = p;
                dp[nt][e] = d;
            }
        }
        // dV += P^T dO, dK += dS^T Q (A from registers, B = dO / Q through ldmatrix.trans)
#pragma unroll
        for (int kk = 0; kk < BR / 16; kk++) {
            unsigned int pa[4], da[4];
            pk_acc_to_a<T>(pa, s, kk);
            pk_acc_to_a<T>(da, dp, kk);
            // dS^T to shared memory for dQ, as [key][query] words (the A operand of dQ through .trans)
            *reinterpret_cast<unsigned int*>(sm + dsw_off + kk * 32) = da[0];
            *reinterpret_cast<unsigned int*>(sm + dsw_off + 8 * SDS * 2 + kk * 32) = da[1];
            *reinterpret_cast<unsigned int*>(sm + dsw_off + kk * 32 + 16) = da[2];
            *reinterpret_cast<unsigned int*>(sm + dsw_off + 8 * SDS * 2 + kk * 32 + 16) = da[3];
#pragma unroll
            for (int np = 0; np < D / 16; np++) {
                unsigned int ob[4], qb[4];
                pk_ldmatrix_x4_trans_at(ob, sm, go + t_off + kk * 16 * SD * 2 + np * 32);
                pk_ldmatrix_x4_trans_at(qb, sm, qo + t_off + kk * 16 * SD * 2 + np * 32);
                pk_mma_m16n8k16<T>(acc_dv[2 * np], pa, ob, acc_dv[2 * np]);
                pk_mma_m16n8k16<T>(acc_dv[2 * np + 1], pa, ob + 2, acc_dv[2 * np + 1]);
                pk_mma_m16n8k16<T>(acc_dk[2 * np], da, qb, acc_dk[2 * np]);
                pk_mma_m16n8k16<T>(acc_dk[2 * np + 1], da, qb + 2, acc_dk[2 * np + 1]);
            }
        }
        __syncthreads();  // dS^T complete; every warp done with this Q / dO buffer
        // dQ[BR x DW] = dS K for this warp's columns, k over the CTA's 64 keys, one 16-row m-tile at a time
        // (its 16 * DW / 32 floats added before the next: the dK / dV accumulators leave few registers).
        // Rows q0 + m*16 + g (+8), columns warp*DW + n*8 + 2t (+1); unscaled (the convert multiplies by scale).
        float* dqt = dq_ws + (((long long)b * n_heads + h) * nq_pad + q0 + g) * D + warp * DW + 2 * t;
#pragma unroll
        for (int m = 0; m < MB; m++) {
            float aq[QN][4];
#pragma unroll
            for (int n = 0; n < QN; n++) aq[n][0] = aq[n][1] = aq[n][2] = aq[n][3] = 0.0f;
#pragma unroll
            for (int kb = 0; kb < BC / 16; kb++) {
                unsigned int sa[4];
                pk_ldmatrix_x4_trans_at(sa, sm, DS_OFF + s_off + kb * 16 * SDS * 2 + m * 32);
#pragma unroll
                for (int p = 0; p < QN / 2; p++) {
                    unsigned int kbf[4];
                    pk_ldmatrix_x4_trans_at(kbf, sm, K_OFF + t_off + kb * 16 * SD * 2 + (warp * DW + p * 16) * 2);
                    pk_mma_m16n8k16<T>(aq[2 * p], sa, kbf, aq[2 * p]);
                    pk_mma_m16n8k16<T>(aq[2 * p + 1], sa, kbf + 2, aq[2 * p + 1]);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float* row = dqt + (m * 16 + 8 * r) * D;  // rows past n_q: padding, never read
#pragma unroll
                for (int n = 0; n < QN; n++) {
                    if (DET) {
                        *reinterpret_cast<float2*>(row + n * 8) = make_float2(aq[n][2 * r], aq[n][2 * r + 1]);
                    } else {
                        atomicAdd(row + n * 8, aq[n][2 * r]);
                        atomicAdd(row + n * 8 + 1, aq[n][2 * r + 1]);
                    }
                }
            }
        }
    };
    if (DET) dq_ws += (long long)blockIdx.x * ws_stride;

    int buf = 0;
    if (i_start < i_end) load_checked(kh * group, i_start, 0);
    for (int hh = 0; hh < group; hh++) {
        const int h = kh * group + hh;
        int it = i_start;
        // The general step: wait for tile `it`, copy the next tile of the walk (checked), compute masked.
        auto general = [&]() {
            pk_cp_async_wait<0>();
            __syncthreads();
            if (it + 1 < i_end) load_checked(h, it + 1, buf ^ 1);
            else if (hh + 1 < group) load_checked(h + 1, i_start, buf ^ 1);
            compute(AbfTag<true>{}, h, it * BR, buf);
            buf ^= 1;
        };
        for (; it < f_lo; it++) general();
        if (it + 1 < f_hi) {
            // Flat loop: tile it + 1 is full too; the copy pointers advance by one tile a step.
            const long long tile_stride = (long long)BR * q_stride;
            // (the thread's row folded into the tile's: a per-thread offset computed here, not kept live
            // across the general steps)
            const long long off = (long long)b * n_q * q_stride + (h * D + c_col) +
                                  (long long)((it + 1) * BR + c_row) * q_stride;
            const T* qt = q + off;
            const T* gt = grad_out + off;
            const float* lt = (tid < BR / 4 ? lse2 : dlt) + ((long long)b * n_heads + h) * nq_pad + (it + 1) * BR +
                              (tid % (BR / 4)) * 4;
            for (; it + 1 < f_hi; it++) {
                pk_cp_async_wait<0>();
                __syncthreads();
                load_full(qt, gt, lt, buf ^ 1);
                compute(AbfTag<false>{}, h, it * BR, buf);
                buf ^= 1;
                qt += tile_stride;
                gt += tile_stride;
                lt += BR;
            }
        }
        for (; it < i_end; it++) general();
    }
    pk_cp_async_wait_all();  // the K / V copies when no query tile ran

    pk_attn_key_rows(key0, n_k, (long long)b * n_k, kv_stride, (long long)kh * D, [&](int r, long long ob) {
#pragma unroll
        for (int i = 0; i < ON; i++) {
            const int col = i * 8 + 2 * t;
            *reinterpret_cast<unsigned int*>(dv + ob + col) = Pk16<T>::narrow2(acc_dv[i][2 * r], acc_dv[i][2 * r + 1]);
            *reinterpret_cast<unsigned int*>(dk + ob + col) =
                Pk16<T>::narrow2(acc_dk[i][2 * r] * scale, acc_dk[i][2 * r + 1] * scale);
        }
    });
}

// lse (natural log, (batch, n_q, n_heads)) -> lse * log2e and delta -> (batch, n_heads, nq_pad) runs (the
// padded rows were zeroed by the op); delta = rowsum(grad_out * out) in fp32 when have_out, else taken
// from delta_in (the fp32 pre-pass's); with zero_ws the dQ workspace row is zeroed too. A warp per row.
template <typename T>
__device__ __forceinline__ void attention_bwd_tc_prep_impl(const T* __restrict__ grad_out, const T* __restrict__ out,
                                         const float* __restrict__ lse, const float* __restrict__ delta_in,
                                         float* __restrict__ lse2, float* __restrict__ dlt,
                                         float* __restrict__ dq_ws, int n_rows, int n_q, int n_heads, int nq_pad,
                                         int head_dim, int have_out, int zero_ws) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    const long long base = row * head_dim;
    float acc = 0.0f;
    if (have_out) {
        for (int d = lane; d < head_dim; d += 32) acc += PkIO<T>::load(grad_out, base + d) * PkIO<T>::load(out, base + d);
        acc = pk_warp_sum(acc);
    } else {
        acc = delta_in[row];
    }
    const long long bq = row / n_heads, h = row % n_heads, b = bq / n_q, i = bq % n_q;
    const long long o = (b * n_heads + h) * nq_pad + i;
    if (zero_ws)
        for (int d = lane; d < head_dim; d += 32) dq_ws[o * head_dim + d] = 0.0f;
    if (lane == 0) {
        lse2[o] = lse[row] * ABF_LOG2E;
        dlt[o] = acc;
    }
}

// The query tile of the partials' key-tile runs (kt_count > 0): the fused kernel's BR. d96 is the sm_90a fused
// kernel's accumulator only (attention_bwd_sm90.cu), always narrowed in the atomic mode (kt_count = 0), where no
// run is read: its BR is never used.
template <int D> struct AbfReduceBr { enum { BR = AbfCfg<D>::BR }; };
template <> struct AbfReduceBr<96> { enum { BR = 1 }; };

// dq = T(scale * sum over the key tiles [kt_begin, kt_begin + kt_count) that the row's query tile meets of
// the partials, added in key-tile order to acc (first: from 0; last: narrowed to dq instead of stored)).
// The atomic mode passes kt_count = 0, first = 0: acc is the finished sum. A thread per element.
template <typename T, int D>
__device__ __forceinline__ void abf_dq_reduce(const float* __restrict__ part, float* __restrict__ acc,
                                              T* __restrict__ dq, long long n, int n_q, int n_k, int n_heads,
                                              int nq_pad, int kt_begin, int kt_count, long long ws_stride,
                                              float scale, int window_left, int window_right, int first, int last) {
    constexpr int BR = AbfReduceBr<D>::BR;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long rest = i / D, bq = rest / n_heads;
        const int qi = (int)(bq % n_q), q0 = qi / BR * BR;
        const long long w = (((bq / n_q) * n_heads + rest % n_heads) * nq_pad + qi) * D + i % D;  // workspace index
        float x = first ? 0.0f : acc[w];
        {
            const PkAttnSpan sp = pk_attn_q_span(q0, min(q0 + BR, n_q) - 1, n_q, n_k, window_left, window_right);
            if (sp.hi >= sp.lo) {
                const int a = max(sp.lo / ABF_BC, kt_begin), z = min(sp.hi / ABF_BC, kt_begin + kt_count - 1);
                for (int kt = a; kt <= z; kt++) x += part[(long long)(kt - kt_begin) * ws_stride + w];
            }
        }
        if (last) PkIO<T>::store(dq, i, x * scale);
        else acc[w] = x;
    }
}

// sm_80 ... sm_90 (sm_75: no mma.m16n8k16; sm_100 / sm_120: ptxas there takes more registers for the same code
// and spills, so the op keeps the dK/dV + dQ pair of attention_bwd_tc.cu on those): a trap elsewhere.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 800 || __CUDA_ARCH__ >= 1000)
template <typename T, auto... P, typename... A>
__device__ __forceinline__ void abf_entry(A...) { __trap(); }
#else
template <typename T, auto... P, typename... A>
__device__ __forceinline__ void abf_entry(A... a) { abf_body<T, P...>(a...); }
#endif
PK_IO_VARIANT(attention_bwd_tc_fused_d64, abf_entry, 64, false, false)
PK_IO_VARIANT(attention_bwd_tc_fused_d128, abf_entry, 128, false, false)
PK_IO_VARIANT(attention_bwd_tc_fused_d64_softcap, abf_entry, 64, true, false)
PK_IO_VARIANT(attention_bwd_tc_fused_d128_softcap, abf_entry, 128, true, false)
PK_IO_VARIANT(attention_bwd_tc_fused_d64_det, abf_entry, 64, false, true)
PK_IO_VARIANT(attention_bwd_tc_fused_d128_det, abf_entry, 128, false, true)
PK_IO_VARIANT(attention_bwd_tc_fused_d64_softcap_det, abf_entry, 64, true, true)
PK_IO_VARIANT(attention_bwd_tc_fused_d128_softcap_det, abf_entry, 128, true, true)
PK_IO_VARIANT(attention_bwd_tc_dq_reduce_d64, abf_dq_reduce, 64)
PK_IO_VARIANT(attention_bwd_tc_dq_reduce_d128, abf_dq_reduce, 128)
PK_IO_VARIANT(attention_bwd_tc_dq_reduce_d96, abf_dq_reduce, 96)  // the sm_90a fused kernel's d96 accumulator

#define ABF_FUSED_PARAMS                                                                                             \
    (const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ grad_out,      \
     const float* __restrict__ lse2, const float* __restrict__ dlt, float* __restrict__ dq_ws, T* __restrict__ dk,   \
     T* __restrict__ dv, int n_q, int n_k, int n_heads, int n_kv_heads, int nq_pad, int kt_begin,                    \
     long long ws_stride, float scale, int window_left, int window_right, float softcap)
#define ABF_FUSED_ARGS                                                                                               \
    (q, k, v, grad_out, lse2, dlt, dq_ws, dk, dv, n_q, n_k, n_heads, n_kv_heads, nq_pad, kt_begin, ws_stride,        \
     scale, window_left, window_right, softcap)
PK_IO16_KERNELS(attention_bwd_tc_fused_d64, (FATC_THREADS, 2), ABF_FUSED_PARAMS, ABF_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_fused_d64_det, (FATC_THREADS, 2), ABF_FUSED_PARAMS, ABF_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_fused_d64_softcap, (FATC_THREADS, 2), ABF_FUSED_PARAMS, ABF_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_fused_d64_softcap_det, (FATC_THREADS, 2), ABF_FUSED_PARAMS, ABF_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_fused_d128, (FATC_THREADS, 1), ABF_FUSED_PARAMS, ABF_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_fused_d128_det, (FATC_THREADS, 1), ABF_FUSED_PARAMS, ABF_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_fused_d128_softcap, (FATC_THREADS, 1), ABF_FUSED_PARAMS, ABF_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_fused_d128_softcap_det, (FATC_THREADS, 1), ABF_FUSED_PARAMS, ABF_FUSED_ARGS)

PK_IO16_KERNELS(attention_bwd_tc_prep, (256, 1),
                (const T* __restrict__ grad_out, const T* __restrict__ out, const float* __restrict__ lse,
                 const float* __restrict__ delta_in, float* __restrict__ lse2, float* __restrict__ dlt,
                 float* __restrict__ dq_ws, int n_rows, int n_q, int n_heads, int nq_pad, int head_dim, int have_out,
                 int zero_ws),
                (grad_out, out, lse, delta_in, lse2, dlt, dq_ws, n_rows, n_q, n_heads, nq_pad, head_dim, have_out,
                 zero_ws))

#define ABF_DQ_REDUCE_PARAMS                                                                                         \
    (const float* __restrict__ part, float* __restrict__ acc, T* __restrict__ dq, long long n, int n_q, int n_k,     \
     int n_heads, int nq_pad, int kt_begin, int kt_count, long long ws_stride, float scale, int window_left,         \
     int window_right, int first, int last)
#define ABF_DQ_REDUCE_ARGS                                                                                           \
    (part, acc, dq, n, n_q, n_k, n_heads, nq_pad, kt_begin, kt_count, ws_stride, scale, window_left, window_right,   \
     first, last)
PK_IO16_KERNELS(attention_bwd_tc_dq_reduce_d64, (256, 1), ABF_DQ_REDUCE_PARAMS, ABF_DQ_REDUCE_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dq_reduce_d128, (256, 1), ABF_DQ_REDUCE_PARAMS, ABF_DQ_REDUCE_ARGS)
PK_IO16_KERNELS(attention_bwd_tc_dq_reduce_d96, (256, 1), ABF_DQ_REDUCE_PARAMS, ABF_DQ_REDUCE_ARGS)
