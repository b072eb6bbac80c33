// pykern: arch sm_90a
// Hopper (sm_90a) FP8 FlashAttention forward (FlashAttention-3's FP8 path): q, k, v float8_e4m3fn with fp32
// descales, out bf16 and the natural-log lse f32:
//   O = softmax(scale * qd * kd * Q K^T [+ window mask]) V * vd,
// qd / kd / vd read per (batch, kv head) at (b * n_kv_heads + kvh) * stride, stride 0 for one per-tensor value
// (FA3's q_descale / k_descale / v_descale). Layouts, GQA mapping, bottom-right window / causal mask and the
// empty-row convention are attention_fwd_sm90.cu's (rows that see no key: out = 0, lse = -inf).
//
// Work split as attention_fwd_sm90.cu: a CTA of 3 warpgroups (384 threads) owns BR = 128 queries of one (batch,
// head); warpgroup 0 is the TMA producer (Q once, then K and V tiles of BC = 128 keys, 64 at d256, into a 2-slot
// ring with full / empty mbarriers), warpgroups 1 and 2 the consumers (64 query rows each). What differs for 8-bit
// elements (e4m3 wgmma, QGMMA, is m64nNk32 and takes both operands K-major):
//   S = Q K^T : wgmma m64n<BC>k32 SS e4m3, Q and K rows of head_dim bytes in boxes of 64 bytes (64B swizzle);
//   V^T       : P V needs V K-major, i.e. transposed (keys along the 16-byte units). The two consumer warpgroups
//               transpose each V tile in shared memory into the slot's V^T buffer (fa90f8_transpose_v: 4-byte
//               loads and byte permutes, 16-byte stores) while their S wgmmas run, then meet on named barrier 1
//               (after fence.proxy.async: generic writes, async-proxy reads). No host-side copy.
//   P         : in fp32 (scores scaled once by scale * qd * kd * log2 e, so a descale of any sign is right), P =
//               2^(s - m + 3) (FA90F8_OFF; FA3 uses 8) with m the running max: the exact online softmax on the
//               boundary tiles (causal / window edge, keys past n_k: the mask only there), on the tiles every row
//               sees wholly the row max first with O and l rescaled only where a row of the warp grew
//               (fa90f8_softmax_mf; FA90F8_MF: the lazy one with its redo, fa90f8_softmax_lazy, where MF is 0).
//               Rounded to e4m3 straight from the S accumulators into the A registers of O += P V^T (wgmma
//               m64n<D>k32 RS e4m3). The accumulator gives a thread keys
//               {8j + 2t, 8j + 2t + 1} of a 32-key step, the A fragment wants columns 4t..4t+3 and 16+4t..16+4t+3;
//               rather than moving bytes between lanes (FA3's permute_regs_A_to_C), the transpose writes V^T's
//               key columns in that order (fa90f8_key), which the sum over keys does not see.
//   O         : fp32 accumulators; out = O / l * vd (bf16), lse = ln 2 * (m + log2 l - 3); the epilogue stages a
//               consumer's bf16 rows in its V slot (the spent K / V ring: see fa90f8_forward's epilogue) and
//               stores them with 16-byte stores (pk_attn_tc.cuh, as attention_fwd_sm90.cu's varlen kernels).
// Steady state: each step issues S of the next tile with O += P V^T of the previous one, the V^T of the next tile
// written while they run (d256: with 64-key tiles, which leave the registers for that). S and P V^T are two wgmma
// groups at every head dim (FA90F8_OVL, FA3's intra-warpgroup overlap: the softmax's max, exp2 and l of the next
// tile under this warpgroup's P V^T, the rescale of O after it). At d128 and d256 the two consumer warpgroups
// ping-pong in the steady state (FA90F8_PP: one's softmax under the other's wgmmas), the turn's hand-over doubling
// as the V^T barrier there; d64 meets the other warpgroup on the V^T barrier after its wait for P V^T. The softcap
// kernels at d64 and d128 take a quarter of their steady tiles' exp2s on the FMA pipe (FA90F8_FEX).
// Shared memory (dynamic, 1024-byte aligned): Q [D/64][BR][64], K [2][D/64][BC][64], V [2][D/64][BC][64] (slots
// FA90F8_VSLOT apart; each [rows][64] box one TMA load, 64B swizzle), V^T [VTS][BC/64][D][64] (64B swizzle;
// FA90F8_VTS slots), then the mbarriers.
// Tensor maps (pykern/ops/_attention_sm90.py, try_forward_fp8): q (batch, n_q, n_heads, D), k / v (batch, n_k,
// n_kv_heads, D) as uint8 with boxes (1, BR or BC, 1, 64), swizzle 64B; rows past n_q / n_k load as zeros.
// Kernel names: attention_fwd_sm90_d{64,128,256}[_softcap]_fp8 (head_dim == head_dim_v; _softcap: scores c *
// tanh(scale * qd * kd * q.k / c) before the mask and softmax, tanh.approx as attention_fwd_sm90.cu).
#include "pk_common.cuh"
#include "pk_ptx.cuh"
#include "pk_attn_window.cuh"
#include "pk_attn_tc.cuh"  // pk_attn_epilogue, pk_quad_rescale, fa90_cap

#define FA90F8_BR 128
// BC(D): keys per tile. 64 at d256: S's accumulators (32 a thread, not 64) and P's A registers (8, not 16) leave
// room, next to O's 128, for the next tile's S during this one's P V^T (the steady step's one wgmma group), and a V
// tile's transpose is one unit a thread (no loop); with 128 keys that overlap (and an unrolled transpose) spilled.
// FA3 keeps 128 keys at d256 by transposing V in its producer warpgroup instead.
#define FA90F8_BC(D) ((D) == 256 ? 64 : 128)
#define FA90F8_ST 2
#define FA90F8_THREADS 384
#define FA90F8_BAR_VT 1  // named barrier of the two consumer warpgroups: the slot's V^T is written
// PP(D): the steady-state loop ping-pongs the two consumer warpgroups (fa90f8_scores; attention_fwd_sm90.cu's
// Fa90Cfg PP, FA3's warp scheduler barriers). On at d128, as the bf16 kernel, and at d256 (FA3 too: its scheduler
// barriers are on for FP8 from head dim 128). Its hand-over also publishes the
// warpgroup's half of the tile's V^T (the V^T barrier leaves the hot loop), so V^T takes more slots there
// (FA90F8_VTS): a warpgroup that has its turn for tile n + 2 knows the other issued tile n + 1's P V^T (of tile n),
// not that it completed, so tile n + 2's transpose must not go to tile n's slot. Three would do; four (i % 4, one
// LOP3 as i % 2) keep the d128 loop at its 381 instructions where three took 382 (the compare and select of the
// wrap), at 16 KiB more shared memory (145 KiB; d256: 16 KiB a slot too, 64 keys).
#define FA90F8_PP(D) ((D) >= 128)
// MF(D): the steady tiles take the row max first (fa90f8_softmax_mf: O and l rescaled where a row of the warp grew,
// no redo) instead of the lazy softmax with its exact redo (fa90f8_softmax_lazy). The attention model (--fp8) finds
// it faster at every head dim over random scores, whose rows find a new max in 29-86% of the tiles: the redo's
// second exp2 a score bound the lazy loop on MUFU at d64 / d128. Where rows rarely find one (p near 0) the lazy loop
// issues fewer instructions (d128: 397 against 524 + 71 p with the overlap, FA90F8_OVL, which needs MF), hence a
// switch, not a copy.
#ifndef FA90F8_MF
#define FA90F8_MF(D) 1
#endif
#define FA90F8_VTS(D) (FA90F8_PP(D) ? 4 : FA90F8_ST)
// OVL(D): FA3's intra-warpgroup overlap in the steady steps (fa90f8_scores with OVL): S of the next tile and O +=
// P V^T of the previous one as two wgmma groups, S first; wait<1> waits for S alone, so the softcap, the row max,
// exp2 and l of the next tile (fa90f8_softmax_mf_p) run while P V^T still accumulates into O; then wait<0>, and
// only after it the rescale of O and P's narrowing to e4m3 into the A registers that P V^T read
// (fa90f8_softmax_mf_o). With the ping-pong (d128 / d256) and without it (d64: the V^T barrier then follows the
// caller's wait<0>). Needs MF (the lazy softmax's redo is not split). Defined as 0 (-DFA90F8_OVL(D)=0): one group
// and wait<0> before the softmax, the loops before the overlap.
#ifndef FA90F8_OVL
#define FA90F8_OVL(D) (FA90F8_MF(D))
#endif
// FEX(D, SC): of every 4 n-tiles (8 keys each) of a steady tile, how many take their exp2 on the FMA pipe
// (pk_exp2_fma, pk_attn_exp2) instead of MUFU.EX2. QGMMA runs at twice the bf16 rate, so the MUFU binds sooner than
// in the bf16 kernel. The attention model's FP8 rows (python -m pykern.bench --attention-model --fp8: modelled
// bounds on H100's sm_90a part from this file's SASS, random scores; d64 16384 keys, not causal): d64 is
// issue-bound with every exp2 on MUFU (issue 2384 us, MUFU 2313, tensor 1146; 554 instructions a tile), so an
// exp2 moved to the FMA pipe (about 8 instructions more than its MUFU) only adds to the binding term: 0 there. d64
// softcap (a tanh and an exp2 a score) was MUFU-bound: 4605 us against issue 2958 (682 a tile). One n-tile in four
// (16 of a thread's 128 MUFUs a tile; 811 instructions) leaves MUFU binding at 4032 us, issue 3535; two in four
// (939 instructions) would let the issue term bind near 4110. d128 / d256 without softcap: 0 (the issue term binds
// at d128, shared memory and the tensor pipe at d256). d128 softcap is MUFU-bound too (16384 keys: 2302 us against
// issue 1520): one in four there models 2016 us (723 -> 852 instructions a tile; 955 -> 1091 TFLOP/s), MUFU still
// binding. d256 softcap keeps 0: MUFU 1156 us against the tensor pipe's 1146, a tie an FMA exp2 would only move to
// issue and shared memory.
#ifndef FA90F8_FEX
#define FA90F8_FEX(D, SC) ((D) <= 128 && (SC) ? 1 : 0)
#endif
// Named barrier of consumer c's ping-pong turn: FA90F8_BAR_PP + c = threadIdx.x / 128 + 2 (3, 4); the other's is
// it ^ 7. Barrier 1 stays the V^T barrier of the boundary tiles.
#define FA90F8_BAR_PP 3
// Named barrier of consumer c's epilogue (its 128 threads: the staged rows of O are all written): 5 + c (5, 6).
#define FA90F8_BAR_EPI 5
static_assert(FA90F8_BAR_PP == 3, "fa90f8_pp_bar: FA90F8_BAR_PP + c == threadIdx.x / 128 + 2, the other's id ^ 7");
__device__ __forceinline__ unsigned fa90f8_pp_bar() { return threadIdx.x / 128 + 2; }
// A V slot's bytes: a V tile (BC D), and at least the 128 D bytes a consumer's 64 rows of O in bf16 take, which the
// epilogue stages in V slot c (d256: twice the 64-key tile).
#define FA90F8_VSLOT(D) (FA90F8_BR * (D) > FA90F8_BC(D) * (D) ? FA90F8_BR * (D) : FA90F8_BC(D) * (D))
// Q + K + V + V^T + the mbarriers (pykern/ops/_attention_sm90.py: fp8_shared_bytes): 193 KiB at d256.
#define FA90F8_SMEM_BYTES(D) \
    (FA90F8_BR * (D) + (FA90F8_ST + FA90F8_VTS(D)) * FA90F8_BC(D) * (D) + FA90F8_ST * FA90F8_VSLOT(D) + 1024)

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
    constexpr int BC = FA90F8_BC(D), UNITS = (D / 4) * (BC / 16);  // 128 (d64: half the threads), 256, 256
    // one unit a thread at most (no loop, no loop test; d256's 64-key tiles keep it so)
    static_assert(UNITS <= 256, "one transpose unit a consumer thread");
    const int u = ct;
    if (UNITS < 256 && u >= UNITS) return;  // d64: half the threads
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
        *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// P's offset: P = 2^(s - m + FA90F8_OFF) with m the row max (log2 units), so the largest P of the exact softmax
// is 2^3 = 8 and P keeps e4m3's 3 mantissa bits down to 2^-9 of the row max (below that, subnormals: an absolute
// error of at most 2^-10, 2^-13 of the largest P). l sums the same P, so the factor cancels in O / l; the epilogue
// takes it out of l for the lse. 3, not FA3's 8, dates from a lazy softmax that let the max grow while a thread's
// partial row sums stayed <= 448 (room for 32 P of 8); fa90f8_softmax_lazy now takes no P above 8, so 8 would fit
// too (its only effect: subnormals from 2^-14 of the row max instead of 2^-9).
#define FA90F8_OFF 3

// P of n-tiles j, j + 1 of row r (keys 8j + 2t + {0, 1, 8, 9}) rounded to e4m3 into bytes 0..3 of
// a[2 * ((j / 2) & 1) + r] of k-step j / 4 (see the header); p0..p3 in key order.
template <int NK>
__device__ __forceinline__ void fa90f8_put(unsigned (&pa)[NK][4], int j, int r, float p0, float p1,
                                           float p2, float p3) {
    pa[j / 4][2 * ((j / 2) & 1) + r] = (unsigned)pk_cvt_e4m3x2(p0, p1) | (unsigned)pk_cvt_e4m3x2(p2, p3) << 16;
}

// The exact online softmax of one tile (scores already in log2 units) for this thread's rows g and g + 8: P =
// 2^(s - m + FA90F8_OFF) rounded to e4m3 into the A registers of the P V^T k-steps, l the rows' partial sums (of
// the unrounded P), O rescaled by 2^(m_old - m_new).
template <int D>
__device__ __forceinline__ void fa90f8_softmax(const float (&s)[FA90F8_BC(D) / 2], float (&o)[D / 2], float (&m)[2],
                                               float (&l)[2], unsigned (&pa)[FA90F8_BC(D) / 32][4]) {
    constexpr int BC = FA90F8_BC(D);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float mx = pk_wgmma_row_max<BC>(s, r, m[r]);
        float base;
        const float al = pk_quad_rescale(mx, m[r], 1.0f, base);
        base -= (float)FA90F8_OFF;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < BC / 8; j += 2) {
            const float p0 = pk_ex2_approx(s[4 * j + 2 * r] - base), p1 = pk_ex2_approx(s[4 * j + 2 * r + 1] - base);
            const float p2 = pk_ex2_approx(s[4 * j + 4 + 2 * r] - base);
            const float p3 = pk_ex2_approx(s[4 * j + 5 + 2 * r] - base);
            sum += (p0 + p1) + (p2 + p3);
            fa90f8_put(pa, j, r, p0, p1, p2, p3);
        }
        l[r] = l[r] * al + sum;
#pragma unroll
        for (int j = 0; j < D / 8; j++) o[4 * j + 2 * r] *= al, o[4 * j + 2 * r + 1] *= al;
    }
}

// The lazy softmax of a steady-state tile (as attention_fwd_sm90.cu's): P = 2^(s * sl2 - m + FA90F8_OFF) from the
// base m as it is (no row max, no shuffles, no rescale of O and l: FFMA + ex2 + FADD + half an F2FP a score),
// accepted (l += the sums, true) when every P of the warp's rows rounds to at most 2^FA90F8_OFF = 8 in e4m3: the
// row max grew by less than log2(8.5 / 8), so the tile is the exact online softmax's but for that sliver (a new
// maximum in it rounds to 8, as the exact softmax would give it, the others keep their base). A tile where some
// row's max grew further, m still -inf (P = inf saturates to 448) or a NaN (0x7f) returns false, and the caller
// redoes it exactly from the raw scores s, which this leaves as they are: the new max then gives P = 8 exactly.
// The test is on the e4m3 words: a P > 8 is a byte above 0x50, and every byte is <= 0x7f (P >= 0), so adding
// 0x2f to each byte carries into no other and sets its top bit exactly there: an IADD a word, the words ORed
// (LOP3), half an instruction a score where the FMNMX of a float max took one. An acceptance that let the max
// grow while P stayed finite (every partial sum <= 448) left the new largest P of the row rounded by e4m3: the
// dominant terms of O, about 7% more relative RMS error over random inputs (measured on the host).
template <int D>
__device__ __forceinline__ bool fa90f8_softmax_lazy(const float (&s)[FA90F8_BC(D) / 2], const float (&m)[2],
                                                    float (&l)[2], unsigned (&pa)[FA90F8_BC(D) / 32][4], float sl2) {
    constexpr int BC = FA90F8_BC(D);
    float sum[2];
    unsigned big = 0;  // the top bit of a byte set where that P rounded above 8
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float base = m[r] - (float)FA90F8_OFF;
#pragma unroll
        for (int j = 0; j < BC / 8; j += 2) {
            const float p0 = pk_ex2_approx(fmaf(s[4 * j + 2 * r], sl2, -base));
            const float p1 = pk_ex2_approx(fmaf(s[4 * j + 2 * r + 1], sl2, -base));
            const float p2 = pk_ex2_approx(fmaf(s[4 * j + 4 + 2 * r], sl2, -base));
            const float p3 = pk_ex2_approx(fmaf(s[4 * j + 5 + 2 * r], sl2, -base));
            const float p4 = (p0 + p1) + (p2 + p3);
            sum[r] = j == 0 ? p4 : sum[r] + p4;
            fa90f8_put(pa, j, r, p0, p1, p2, p3);
            big |= pa[j / 4][2 * ((j / 2) & 1) + r] + 0x2f2f2f2fu;
        }
    }
    if (!__all_sync(PK_FULL_MASK, (big & 0x80808080u) == 0)) return false;
    l[0] += sum[0];
    l[1] += sum[1];
    return true;
}

// The scores scaled to log2 units in place (before the max, as a descale may be negative) and each of the
// thread's two rows' max over its quad (fa90f8_softmax_mf and fa90f8_softmax_mf_p).
template <int D>
__device__ __forceinline__ void fa90f8_scaled_row_max(float (&s)[FA90F8_BC(D) / 2], float sl2, float (&mx)[2]) {
    constexpr int BC = FA90F8_BC(D);
#pragma unroll
    for (int x = 0; x < BC / 2; x++) s[x] *= sl2;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float x = pk_wgmma_row_max<BC>(s, r, PK_NEG_INF);
        x = fmaxf(x, __shfl_xor_sync(PK_FULL_MASK, x, 1));
        mx[r] = fmaxf(x, __shfl_xor_sync(PK_FULL_MASK, x, 2));
    }
}
// The rescale where a row of the warp grew: al = 2^(mo - m) from the old max mo to the new m, O and l times al.
template <int D>
__device__ __forceinline__ void fa90f8_rescale_o(float (&o)[D / 2], float (&l)[2], const float (&m)[2],
                                                 const float (&mo)[2]) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float al = pk_ex2_approx(mo[r] - m[r]);
        l[r] *= al;
#pragma unroll
        for (int j = 0; j < D / 8; j++) o[4 * j + 2 * r] *= al, o[4 * j + 2 * r + 1] *= al;
    }
}

// The row-max-first softmax of a steady tile (FA90F8_MF(D)): the scores scaled to log2 units in place (before the
// max, as a descale may be negative), the row max over the quad, O and l rescaled only where a row of the warp grew
// (a warp-uniform branch, taken at the rate the lazy softmax redoes a tile), P = 2^(s - m + FA90F8_OFF) from the
// new max: the exact online softmax's P (the new max gives 8 exactly), never redone, one exp2 a score. m is finite
// here (the first steady tile ran the exact softmax over scores every row sees). Against the lazy softmax it adds
// the max (FMNMX, 4 shuffles) and the vote to every tile, and drops the redo's second exp2 a score.
template <int D, int FEX = 0>
__device__ __forceinline__ void fa90f8_softmax_mf(float (&s)[FA90F8_BC(D) / 2], float (&o)[D / 2], float (&m)[2],
                                                  float (&l)[2], unsigned (&pa)[FA90F8_BC(D) / 32][4], float sl2) {
    constexpr int BC = FA90F8_BC(D);
    float mx[2];
    fa90f8_scaled_row_max<D>(s, sl2, mx);
    if (__any_sync(PK_FULL_MASK, mx[0] > m[0] || mx[1] > m[1])) {  // warp-uniform: the rows that grew (others by 1)
        const float mo[2] = {m[0], m[1]};
        m[0] = fmaxf(m[0], mx[0]), m[1] = fmaxf(m[1], mx[1]);
        fa90f8_rescale_o<D>(o, l, m, mo);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float base = m[r] - (float)FA90F8_OFF;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < BC / 8; j += 2) {
            const float p0 = pk_attn_exp2<FEX>(j, s[4 * j + 2 * r] - base);
            const float p1 = pk_attn_exp2<FEX>(j, s[4 * j + 2 * r + 1] - base);
            const float p2 = pk_attn_exp2<FEX>(j + 1, s[4 * j + 4 + 2 * r] - base);
            const float p3 = pk_attn_exp2<FEX>(j + 1, s[4 * j + 5 + 2 * r] - base);
            sum += (p0 + p1) + (p2 + p3);
            fa90f8_put(pa, j, r, p0, p1, p2, p3);
        }
        l[r] += sum;
    }
}

// fa90f8_softmax_mf in two halves around the wait for P V^T (OVL). _p, while P V^T of the previous tile still
// accumulates into O and reads pa: the scores scaled in place, the row max, the new m (the old one kept in mo), P =
// 2^(s - m + FA90F8_OFF) left in s in fp32 and its row sums in sum (neither o, pa nor l touched). Branch-free: with
// the vote's rescale block before the wait (a branch between the two waits), ptxas hoisted wait<0> to the join,
// above every exp2. Returns whether a row of the warp grew (warp-uniform). _o, after wait<0>: where a row of the
// warp grew (fa90f8_rescale_o), the factor al = 2^(mo - m) (2 MUFU) and O and l rescaled by it; l += sum; P
// narrowed into pa.
template <int D, int FEX = 0>
__device__ __forceinline__ bool fa90f8_softmax_mf_p(float (&s)[FA90F8_BC(D) / 2], float (&m)[2], float (&mo)[2],
                                                    float (&sum)[2], float sl2) {
    constexpr int BC = FA90F8_BC(D);
    float mx[2];
    fa90f8_scaled_row_max<D>(s, sl2, mx);
    const bool grew = mx[0] > m[0] || mx[1] > m[1];
#pragma unroll
    for (int r = 0; r < 2; r++) mo[r] = m[r], m[r] = fmaxf(m[r], mx[r]);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float base = m[r] - (float)FA90F8_OFF;
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < BC / 8; j += 2) {
            float& p0 = s[4 * j + 2 * r];
            float& p1 = s[4 * j + 2 * r + 1];
            float& p2 = s[4 * j + 4 + 2 * r];
            float& p3 = s[4 * j + 5 + 2 * r];
            p0 = pk_attn_exp2<FEX>(j, p0 - base), p1 = pk_attn_exp2<FEX>(j, p1 - base);
            p2 = pk_attn_exp2<FEX>(j + 1, p2 - base), p3 = pk_attn_exp2<FEX>(j + 1, p3 - base);
            acc += (p0 + p1) + (p2 + p3);
        }
        sum[r] = acc;
    }
    return __any_sync(PK_FULL_MASK, grew);
}
// _o's rest (after wait<0>): l += sum, P narrowed into pa (which P V^T no longer reads).
template <int D>
__device__ __forceinline__ void fa90f8_softmax_mf_o(const float (&s)[FA90F8_BC(D) / 2], float (&l)[2],
                                                    unsigned (&pa)[FA90F8_BC(D) / 32][4], const float (&sum)[2]) {
    constexpr int BC = FA90F8_BC(D);
    l[0] += sum[0], l[1] += sum[1];
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int j = 0; j < BC / 8; j += 2)
            fa90f8_put(pa, j, r, s[4 * j + 2 * r], s[4 * j + 2 * r + 1], s[4 * j + 4 + 2 * r], s[4 * j + 5 + 2 * r]);
}

// The exact softmax of a tile from its raw scores (the boundary tiles, and a steady tile whose lazy softmax
// failed): to log2 units, the mask (MASK: keys outside [rlo, rhi] of the row), fa90f8_softmax.
template <int D, bool MASK>
__device__ __forceinline__ void fa90f8_exact(float (&s)[FA90F8_BC(D) / 2], float (&o)[D / 2], float (&m)[2],
                                             float (&l)[2], unsigned (&pa)[FA90F8_BC(D) / 32][4], float sl2, int k0,
                                             const int (&rlo)[2], const int (&rhi)[2], int t) {
#pragma unroll
    for (int x = 0; x < FA90F8_BC(D) / 2; x++) s[x] *= sl2;
    if constexpr (MASK) {
#pragma unroll
        for (int x = 0; x < FA90F8_BC(D) / 2; x++) {
            const int col = k0 + 8 * (x / 4) + 2 * t + (x & 1), r = (x >> 1) & 1;
            if (col < rlo[r] || col > rhi[r]) s[x] = PK_NEG_INF;
        }
    }
    fa90f8_softmax<D>(s, o, m, l, pa);
}

// The S wgmmas of one tile (K-step ks_: box ks_ / 2, 32 bytes further per step inside it); no fence, no commit.
template <int D>
__device__ __forceinline__ void fa90f8_issue_scores(float (&s)[FA90F8_BC(D) / 2], unsigned long long dq,
                                                    unsigned long long dk) {
    constexpr int BC = FA90F8_BC(D);
#pragma unroll
    for (int ks_ = 0; ks_ < D / 32; ks_++)
        pk_wgmma_m64nNk32_e4m3_ss<BC>(s, pk_wgmma_desc_advance(dq, (ks_ / 2) * FA90F8_BR * 64 + (ks_ % 2) * 32),
                                      pk_wgmma_desc_advance(dk, (ks_ / 2) * BC * 64 + (ks_ % 2) * 32), ks_ > 0);
}

// The P V^T wgmmas of one tile (k-step kk: V^T box kk / 2, 32 bytes further per step inside it); no fence, no
// commit.
template <int D>
__device__ __forceinline__ void fa90f8_issue_pv(float (&o)[D / 2], const unsigned (&pa)[FA90F8_BC(D) / 32][4],
                                                unsigned long long dvt) {
#pragma unroll
    for (int kk = 0; kk < FA90F8_BC(D) / 32; kk++)
        pk_wgmma_m64nNk32_e4m3_rs<D>(o, pa[kk], pk_wgmma_desc_advance(dvt, (kk / 2) * D * 64 + (kk % 2) * 32), 1);
}

// The scores of tile n (slot st) and, PV, O += P V^T of tile n - 1 (its V^T through dvt_prev, its P in pa) as one
// wgmma group; while they run, the slot's V^T (fa90f8_transpose_v); then wait<0>, the named barrier of the two
// consumer warpgroups and this thread's arrival on the slot's `empty` mbarrier (its K was read by S, its V by the
// transpose: both done). The barrier comes after the wait: past it, both warpgroups' P V^T of tile n - 1 have
// completed, so the next tile may overwrite the V^T slot that tile n - 2's P V^T read (the two V^T slots alternate;
// a P V^T of tile n - 2 still running in the other warpgroup would otherwise race with it).
// PP (a steady step at d128, FA90F8_PP): no V^T barrier; the group is issued in this warpgroup's ping-pong turn
// (bar.sync on its barrier: the other warpgroup arrived there after issuing its previous step and writing its half
// of that step's V^T, i.e. tile n - 1's, which this group's P V^T reads), and the turn is handed over (bar.arrive on
// the other's barrier) after this warpgroup's half of tile n's V^T is written and fenced, before the wait: the
// other warpgroup issues while these wgmmas still run, and its softmax runs under them. The other warpgroup may
// then still be running tile n's P V^T when this one transposes tile n + 2: V^T has 4 slots (FA90F8_VTS; 3 would
// do: tile n + 3's transpose comes after a turn the other warpgroup handed over after its wait for tile n + 1's group).
// OVL (the steady steps, FA90F8_OVL): S is committed as a group of its own before P V^T, and this waits for S
// alone (wait<1>); the caller waits for P V^T (wait<0>) after its softmax. With PP that is still before its next
// turn, so the slot argument above holds as it is (both groups complete before the warpgroup's next hand-over).
// Without PP (d64) the V^T barrier is not met here but by the caller after its wait<0> (the one-group step's slot
// argument, above: it must follow this warpgroup's P V^T's completion and precede the next step's transpose). K's
// slot is released (empty) after S's wait, as before after the one group's: S read K, this thread's transpose
// read V (generic loads, before the arrival).
template <int D, bool PV, bool PP = false, bool OVL = false>
__device__ __forceinline__ void fa90f8_scores(float (&s)[FA90F8_BC(D) / 2], float (&o)[D / 2],
                                              const unsigned (&pa)[FA90F8_BC(D) / 32][4], unsigned long long dq,
                                              unsigned long long dk, unsigned long long dvt_prev,
                                              const unsigned char* vs_slot, unsigned char* vt_slot,
                                              unsigned long long* full, unsigned long long* empty, unsigned parity,
                                              int ct) {
    pk_mbarrier_wait_parity(full, parity);
    const unsigned pp = fa90f8_pp_bar();
    if constexpr (PP) pk_bar_sync_aligned(pp, 256);  // this warpgroup's turn (warps converged)
    pk_wgmma_fence();
    fa90f8_issue_scores<D>(s, dq, dk);
    if constexpr (OVL) pk_wgmma_commit();  // S its own group, first: wait<1> below waits for it alone
    if constexpr (PV) fa90f8_issue_pv<D>(o, pa, dvt_prev);
    pk_wgmma_commit();
    fa90f8_transpose_v<D>(vs_slot, vt_slot, ct);
    pk_fence_proxy_async_shared();  // the generic-proxy V^T writes before the async-proxy (wgmma) reads
    if constexpr (PP) {
        static_assert(PV, "the ping-pong runs in the steady steps");
        pk_bar_arrive_aligned(pp ^ 7, 256);  // the other's turn (and this half of the V^T), while these run
        if constexpr (OVL) {
            // S has landed (K read); P V^T runs on under the caller's softmax, which waits for it (wait<0>)
            // before it touches O or pa. S pinned after the wait: the front end would otherwise move the
            // softmax's arithmetic on it above the wait (ptxas then serialises the wgmmas).
            pk_wgmma_wait<1>();
#pragma unroll
            for (int x = 0; x < FA90F8_BC(D) / 2; x++) pk_wgmma_fence_operand(s[x]);
        } else {
            pk_wgmma_wait<0>();
        }
    } else if constexpr (OVL) {
        static_assert(PV, "the overlap runs in the steady steps");
        // (d64) S has landed (K read); P V^T runs on under the caller's softmax. No V^T barrier here: the caller
        // waits for P V^T (wait<0>) and only then meets the other warpgroup on it (see fa90f8_forward's loop).
        pk_wgmma_wait<1>();
#pragma unroll
        for (int x = 0; x < FA90F8_BC(D) / 2; x++) pk_wgmma_fence_operand(s[x]);
    } else {
        if constexpr (PV) pk_wgmma_wait<0>();
        pk_bar_sync_aligned(FA90F8_BAR_VT, 256);
        if constexpr (!PV) pk_wgmma_wait<0>();
    }
    pk_mbarrier_arrive(empty);
}

// O += P V^T of one tile, on its own (after a boundary tile, and the last steady one).
template <int D>
__device__ __forceinline__ void fa90f8_pv(float (&o)[D / 2], const unsigned (&pa)[FA90F8_BC(D) / 32][4],
                                          unsigned long long dvt) {
    pk_wgmma_fence();
    fa90f8_issue_pv<D>(o, pa, dvt);
    pk_wgmma_commit();
    pk_wgmma_wait<0>();
}

// SC: softcap (the _softcap kernels; softcap > 0). VARLEN (attention_fwd_varlen_sm90_d*_fp8, flash_attention_varlen):
// sequences packed without padding, as attention_fwd_sm90.cu's VARLEN: the tensor maps have batch extent 1 over
// (1, total rows, heads, D); sequence b is q rows cu_q[b]..cu_q[b+1] against k / v rows cu_k[b]..cu_k[b+1] (a
// negative length counts as 0); grid (n_qt * n_heads, batch): query tile blockIdx.x / n_heads of head
// blockIdx.x % n_heads (tiles past the sequence exit before any barrier); n_q / n_k are each sequence's; the TMA
// row coordinates start at the sequence's first row (a box running past its end loads the next sequence's rows:
// the key tile holding the sequence's last key is a masked tile, and query rows past the end are not stored), out /
// lse rows at cu_q[b]; the descales are read at (b * n_kv_heads + kvh) * stride as in the dense kernel (FA3's
// (batch, num_kv_heads) descales of flash_attn_varlen_func).
template <int D, bool SC, bool VARLEN = false>
__device__ __forceinline__ void fa90f8_forward(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                                               __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
                                               const float* __restrict__ q_descale,
                                               const float* __restrict__ k_descale,
                                               const float* __restrict__ v_descale, int qd_stride, int kd_stride,
                                               int vd_stride, int n_q, int n_k, int n_heads, int n_kv_heads,
                                               float scale, int window_left, int window_right, float softcap,
                                               const int* __restrict__ cu_q = nullptr,
                                               const int* __restrict__ cu_k = nullptr) {
    constexpr int BC = FA90F8_BC(D), ST = FA90F8_ST, NB = D / 64, VTS = FA90F8_VTS(D);
    constexpr bool PP = FA90F8_PP(D), OVL = FA90F8_OVL(D);
    constexpr int FEX = FA90F8_FEX(D, SC);
    // REMAT (d256): Q's descriptor, the thread's query row and the CTA's batch, head and kv head (the epilogue's)
    // are found again where used, from threadIdx / blockIdx made opaque, rather than kept live through the loops
    // next to O's 128 accumulators, the next tile's S (32) and this one's P (8): kept, the descriptor and the
    // epilogue's place spilled 16 bytes in the dense kernel, the row 8 more in the varlen one. d64 / d128 keep them:
    // found again, the first two lengthened the d128 steady loop from 381 to 391 instructions.
    constexpr bool REMAT = D == 256;
    constexpr unsigned Q_BYTES = FA90F8_BR * D, K_BYTES = BC * D, V_BYTES = BC * D;
    constexpr unsigned VS_BYTES = FA90F8_VSLOT(D);  // a V slot (V_BYTES; d256: the epilogue's stage, more)
    extern __shared__ __align__(1024) unsigned char fa90f8_smem[];
    unsigned char* qs = fa90f8_smem;
    unsigned char* ks = qs + Q_BYTES;       // [ST][NB][BC][64 B]
    unsigned char* vs = ks + ST * K_BYTES;  // [ST][NB][BC][64 B], VS_BYTES apart
    unsigned char* vt = vs + ST * VS_BYTES;  // [VTS][BC / 64][D][64 B]
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(vt + VTS * V_BYTES);
    unsigned long long *q_full = bars, *full = bars + 1, *empty = bars + 1 + ST;

    const int tid = threadIdx.x, wg = tid / 128;
    int b, h, kvh, qt, q_row0 = 0, k_row0 = 0;  // q_row0 / k_row0: the sequence's first rows (VARLEN)
    if constexpr (VARLEN) {
        b = blockIdx.y, h = (int)(blockIdx.x % n_heads);
        q_row0 = cu_q[b], n_q = max(cu_q[b + 1] - q_row0, 0);
        k_row0 = cu_k[b], n_k = max(cu_k[b + 1] - k_row0, 0);
        const int n_qt = (n_q + FA90F8_BR - 1) / FA90F8_BR, it = (int)(blockIdx.x / n_heads);
        if (it >= n_qt) return;  // CTA-uniform, before any barrier
        qt = window_right < n_q ? n_qt - 1 - it : it;  // causal: the longest query tiles first
        kvh = h / (n_heads / n_kv_heads);
    } else {
        const PkAttnQTile tile = pk_attn_q_tile(n_q, FA90F8_BR, n_heads, n_kv_heads, window_right);
        b = tile.b, h = tile.h, kvh = tile.kvh, qt = tile.qt;
    }
    const int mb = VARLEN ? 0 : b;  // the tensor maps' batch coordinate
    const int q0 = qt * FA90F8_BR;
    const int q_last = min(q0 + FA90F8_BR, n_q) - 1;
    const PkAttnSpan span = pk_attn_q_span(q0, q_last, n_q, n_k, window_left, window_right);
    const int kt0 = span.lo / BC, kt1 = span.hi < span.lo ? kt0 : span.hi / BC + 1;
    // Tiles [f0, f1) every row sees wholly: the steady state, no mask. Visit order: kt1 - 1 down to kt0.
    int f0 = max((span.full_lo + BC - 1) / BC, kt0), f1 = min((span.full_hi + 1) / BC, kt1);
    if (f0 >= f1) f0 = f1 = kt1;  // no full tile: everything runs masked

    pk_ring_init<ST>(q_full, full, empty, 256);

    if (wg == 0) {  // ---- producer ----
        pk_setmaxnreg_dec<24>();
        if (tid < 32 && pk_elect_one()) {
            pk_mbarrier_arrive_expect_tx(q_full, Q_BYTES);
            for (int nb = 0; nb < NB; nb++)
                pk_tma_load_4d(qs + nb * FA90F8_BR * 64, tq, q_full, nb * 64, h, q_row0 + q0, mb);
            int i = 0;
            for (int j = kt1 - 1; j >= kt0; j--, i++) {
                const int s = i % ST;
                pk_mbarrier_wait_parity(&empty[s], ((i / ST) & 1) ^ 1);
                pk_mbarrier_arrive_expect_tx(&full[s], K_BYTES + V_BYTES);
                for (int nb = 0; nb < NB; nb++) {
                    pk_tma_load_4d(ks + s * K_BYTES + nb * BC * 64, tk, &full[s], nb * 64, kvh, k_row0 + j * BC, mb);
                    pk_tma_load_4d(vs + s * VS_BYTES + nb * BC * 64, tv, &full[s], nb * 64, kvh, k_row0 + j * BC, mb);
                }
            }
        }
        return;
    }

    // ---- consumers ----
    pk_setmaxnreg_inc<240>();
    const int c = wg - 1, lane = tid % 32, wq = (tid / 32) % 4, g = lane / 4, t = lane % 4, ct = tid - 128;
    float o[D / 2];
#pragma unroll
    for (int x = 0; x < D / 2; x++) o[x] = 0.0f;
    float m[2] = {PK_NEG_INF, PK_NEG_INF}, l[2] = {0.0f, 0.0f};  // rows g and g + 8, m in log2 units
    const long long di = (long long)b * n_kv_heads + kvh;
    // Scores to log2 units in one multiply: the descales fold into the softmax scale (SC: into pre, the capped
    // scores times c * log2 e).
    const float sc = scale * q_descale[di * qd_stride] * k_descale[di * kd_stride];
    const float sl2 = (SC ? softcap : sc) * 1.4426950408889634f;
    const float pre = SC ? sc / softcap : 0.0f;
    const int row0_ = q0 + 64 * c + 16 * wq + g;
    // This thread's first query row (rows row0 and row0 + 8); REMAT: from threadIdx.x made opaque, where used.
    const auto q_row = [&]() {
        if constexpr (!REMAT) return row0_;
        const unsigned tx = pk_opaque_u32(threadIdx.x);
        return q0 + (int)(64 * (tx / 128 - 1) + 16 * ((tx / 32) % 4) + (tx % 32) / 4);
    };

    // K-major, 64B swizzle: SBO 512 = one 8-row group of 64-byte rows; a k32 step is 32 bytes of a box.
    // Q's descriptor (this warpgroup's 64 rows). REMAT: found again where used (a boundary tile, once before the
    // steady loop) from threadIdx.x made opaque.
    const unsigned long long dq0 = pk_wgmma_desc(qs + c * 64 * 64, 16, 512, PK_SWIZZLE_64B);
    const auto q_desc = [&]() {
        if constexpr (!REMAT) return dq0;
        return pk_wgmma_desc(qs + (pk_opaque_u32(threadIdx.x) / 128 - 1) * 64 * 64, 16, 512, PK_SWIZZLE_64B);
    };
    const unsigned long long dk0 = pk_wgmma_desc(ks, 16, 512, PK_SWIZZLE_64B);
    const unsigned long long dvt0 = pk_wgmma_desc(vt, 16, 512, PK_SWIZZLE_64B);
    constexpr unsigned KU = K_BYTES / 16, VU = V_BYTES / 16;  // a slot, in descriptor units
    pk_mbarrier_wait_parity(q_full, 0);

    unsigned i = 0;  // tiles visited (slot i % ST, phase (i / ST) & 1)
    int j = kt1 - 1;
    float s[BC / 2];
    unsigned pa[BC / 32][4];
    // A boundary tile: S and V^T (V^T slot i % VTS), the mask and the exact softmax, O += P V^T.
    const auto masked_tile = [&]() {
        const unsigned st = i % ST, vst = i % VTS;
        fa90f8_scores<D, false>(s, o, pa, q_desc(), dk0 + st * KU, 0, vs + st * VS_BYTES, vt + vst * V_BYTES,
                                &full[st], &empty[st], (i / ST) & 1, ct);
        fa90_cap<SC, BC>(s, pre);  // before the mask, as the mma.sync kernels
        int rlo[2], rhi[2];      // the rows' key ranges here, not kept through the steady loop
        pk_attn_q_rows(q_row(), n_q, n_k, window_left, window_right, rlo, rhi);
        fa90f8_exact<D, true>(s, o, m, l, pa, sl2, j * BC, rlo, rhi, t);
        fa90f8_pv<D>(o, pa, dvt0 + vst * VU);
    };
    for (; j >= f1; j--, i++) masked_tile();
    if (j >= f0) {  // the steady state: no mask, the row-max-first (MF) or the lazy softmax
        // The first steady tile alone (S and V^T, the exact softmax: m may still be -inf); then each step
        // issues the scores of the next tile with O += P V^T of the previous one as one wgmma group
        // (fa90f8_scores), and the softmax of the next tile. (Not MF:) a warp whose lazy softmax fails leaves the
        // hot loop for the exact redo and comes back to the same wgmma instructions as the other warps of its
        // warpgroup.
        const unsigned long long dq = q_desc();
        {
            const unsigned st = i % ST;
            fa90f8_scores<D, false>(s, o, pa, dq, dk0 + st * KU, 0, vs + st * VS_BYTES, vt + (i % VTS) * V_BYTES,
                                    &full[st], &empty[st], (i / ST) & 1, ct);
            fa90_cap<SC, BC>(s, pre);
            fa90f8_exact<D, false>(s, o, m, l, pa, sl2, 0, {0, 0}, {0, 0}, t);
            i++, j--;
        }
        // PP: consumer 1 gives consumer 0 the first turn of the ping-pong where steps follow; consumer 0 takes
        // consumer 1's last hand-over after them (which also publishes consumer 1's half of the last V^T), so
        // both barriers are back at zero arrivals. Both warpgroups run the same steps: the turns pair up.
        const bool steps = j >= f0;
        if (PP && c == 1 && steps) pk_bar_arrive_aligned(FA90F8_BAR_PP, 256);
        while (j >= f0) {
            bool ok;
            for (;;) {  // the hot loop
                const unsigned st = i % ST;
                // the V^T slots of the previous tile and of this one (VTS 2: the other slot and st)
                const unsigned vprev = (i - 1) % VTS, vn = i % VTS;
                fa90f8_scores<D, true, PP, OVL>(s, o, pa, dq, dk0 + st * KU, dvt0 + vprev * VU,
                                                vs + st * VS_BYTES, vt + vn * V_BYTES, &full[st], &empty[st],
                                                (i / ST) & 1, ct);
                fa90_cap<SC, BC>(s, pre);
                if constexpr (OVL) {
                    // FA3's order: max, exp2 and l under P V^T of the previous tile; then wait<0>, and the rescale
                    // of O and l and P's narrowing into pa after it. P and its sums pinned before the wait too, so
                    // the front end keeps the exp2s and their sums above it (they feed only what follows it).
                    float mo[2], sum[2];
                    const bool any = fa90f8_softmax_mf_p<D, FEX>(s, m, mo, sum, sl2);
#pragma unroll
                    for (int x = 0; x < BC / 2; x++) pk_wgmma_fence_operand(s[x]);
                    pk_wgmma_fence_operand(sum[0]), pk_wgmma_fence_operand(sum[1]);
                    // wait<0> after the exp2s' block (ptxas's scheduler, block-local, hoisted it to the first
                    // shuffle in theirs): first inside the vote's branch, before O's rescale, then after it (where
                    // the branch was taken it finds nothing left to wait for)
                    if (any) {
                        pk_wgmma_wait<0>();
#pragma unroll
                        for (int x = 0; x < D / 2; x++) pk_wgmma_fence_operand(o[x]);
                        fa90f8_rescale_o<D>(o, l, m, mo);
                    }
                    pk_wgmma_wait<0>();
                    // Not PP (d64): the V^T barrier fa90f8_scores left out, after this warpgroup's wait<0>, so the
                    // slot argument of the one-group step holds: past it both warpgroups' P V^T of tile n - 1 have
                    // completed (the next step's transpose overwrites the slot it read: VTS 2) and both halves of
                    // tile n's V^T are written and fenced (the next step's P V^T reads them).
                    if constexpr (!PP) pk_bar_sync_aligned(FA90F8_BAR_VT, 256);
#pragma unroll
                    for (int x = 0; x < BC / 2; x++) pk_wgmma_fence_operand(s[x]);
                    fa90f8_softmax_mf_o<D>(s, l, pa, sum);
                    ok = true;
                } else if constexpr (FA90F8_MF(D)) {
                    fa90f8_softmax_mf<D, FEX>(s, o, m, l, pa, sl2);
                    ok = true;  // never redone: the redo below is dead code here
                } else {
                    ok = fa90f8_softmax_lazy<D>(s, m, l, pa, sl2);
                }
                i++, j--;
                if (!ok || j < f0) break;
            }
            if (!ok) fa90f8_exact<D, false>(s, o, m, l, pa, sl2, 0, {0, 0}, {0, 0}, t);
        }
        if (PP && c == 0 && steps) pk_bar_sync_aligned(FA90F8_BAR_PP, 256);
        fa90f8_pv<D>(o, pa, dvt0 + ((i - 1) % VTS) * VU);  // the last steady tile's O += P V^T
    }
    for (; j >= kt0; j--, i++) masked_tile();

    // P carried 2^FA90F8_OFF: l / 2^OFF is the true sum, and vd / 2^OFF undoes it in O (powers of two: exact).
    constexpr float UNOFF = 1.0f / (float)(1 << FA90F8_OFF);
    l[0] *= UNOFF, l[1] *= UNOFF;
    // The CTA's batch / sequence, head and kv head; REMAT: found again from its block index made opaque.
    int eb = b, eh = h, ekvh = kvh;
    if constexpr (!REMAT) {
    } else if constexpr (VARLEN) {
        eb = (int)pk_opaque_u32(blockIdx.y), eh = (int)(pk_opaque_u32(blockIdx.x) % n_heads);
        ekvh = eh / (n_heads / n_kv_heads);
    } else {
        // n_q opaque: the tile's arithmetic is done again, not taken from the values of the start
        const PkAttnQTile tile =
            pk_attn_q_tile((int)pk_opaque_u32((unsigned)n_q), FA90F8_BR, n_heads, n_kv_heads, window_right);
        eb = tile.b, eh = tile.h, ekvh = tile.kvh;
    }
    const float vd = v_descale[((long long)eb * n_kv_heads + ekvh) * vd_stride] * UNOFF;
    const long long o_row0 = VARLEN ? (long long)cu_q[eb] : (long long)eb * n_q;  // out / lse's first row
    // The epilogue (attention_fwd_sm90.cu's, FA3's): this consumer's 64 rows of O, normalised and rounded to bf16
    // (2 D bytes a row: 128 D bytes, twice its D-byte rows of the e4m3 Q tile), go through V slot c (128 D bytes:
    // FA90F8_VSLOT, 1024-aligned) in out's box layout ([D / 64][64][128 B], 128B swizzle), then leave with 16-byte
    // stores. The slot is free here without a barrier of the two consumers: a V slot is written only by the
    // producer's TMA loads, every one of which this warpgroup waited for (full), and read only by the consumers'
    // transposes (generic loads, never by a wgmma), each of which the other consumer finished before this one passed
    // its last tile's hand-over: the V^T barrier after the transposes (the boundary tiles, the d64 steady steps), or
    // at the d128 / d256 ping-pong steps consumer 1's turn (consumer 0 arrives after its transpose) and consumer 0's
    // sync on consumer 1's last hand-over after the loop (after consumer 1's last transpose). The other consumer may
    // still read its Q rows, K and V^T (its last S and P V^T): none of them is touched. No tile at all: nothing was
    // loaded there.
    // The warpgroup, its first row (q0 + 64 c: row0 rounded down to 64) and the lane's row and column of the stage
    // from threadIdx.x again, opaque: kept live through the loops, they lengthened the d128 loop by 9 instructions.
    const unsigned tx = pk_opaque_u32(threadIdx.x), wt = tx % 128;
    unsigned char* os = vs + (tx / 128 - 1) * VS_BYTES;
    const unsigned rb0 = (16 * (wt / 32) + (wt % 32) / 4) * 128 + 4 * (tx % 4);  // row 16 wq + g, byte 4 t
    const int row0 = q_row(), srow = row0 & ~63;
    pk_attn_epilogue(  // m is in log2 units already
        l, m, 1.0f, vd, row0, n_q,
        [&](int r, int, float inv) { pk_attn_stage_o_row<__nv_bfloat16, D>(os, 64 * 128, rb0 + 8 * r * 128, o, r, inv); },
        [&](int row) { return lse + (o_row0 + row) * n_heads + eh; });
    pk_bar_sync_aligned(tx / 128 + (FA90F8_BAR_EPI - 1), 128);  // the warpgroup's rows are all staged
    const long long o_stride = (long long)n_heads * D;  // out (batch, n_q or total_q, n_heads, D)
    pk_attn_store_staged_o<__nv_bfloat16, D>(os, 64 * 128, 0, out + (o_row0 + srow) * o_stride + (long long)eh * D,
                                             o_stride, n_q - srow, wt);
}

// flash_attention with float8_e4m3fn q, k, v (bytes here): out (batch, n_q, n_heads, D) bf16, lse (batch, n_q,
// n_heads) f32; descales fp32, element (b * n_kv_heads + kvh) * stride (stride 0: one per-tensor value); the
// window normalized as flash_attention does; grid batch * n_heads * query tiles. The _softcap kernels take the
// softcap (> 0) as one more, last, parameter (the bf16 kernels' pattern: attention_fwd_sm90_d{D}_softcap_fp8).
// The registry reads each kernel's parameter list from its text: the six are spelled out.
#define FA90F8_BODY(D, SC, CAP)                                                                                   \
    (void)batch;                                                                                                  \
    fa90f8_forward<D, SC>(&tq, &tk, &tv, out, lse, q_descale, k_descale, v_descale, qd_stride, kd_stride,         \
                          vd_stride, n_q, n_k, n_heads, n_kv_heads, scale, window_left, window_right, CAP);
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_sm90_d64_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, int batch, int n_q, int n_k, int n_heads, int n_kv_heads,
    float scale, int window_left, int window_right) { FA90F8_BODY(64, false, 0.0f) }
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_sm90_d128_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, int batch, int n_q, int n_k, int n_heads, int n_kv_heads,
    float scale, int window_left, int window_right) { FA90F8_BODY(128, false, 0.0f) }
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_sm90_d256_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, int batch, int n_q, int n_k, int n_heads, int n_kv_heads,
    float scale, int window_left, int window_right) { FA90F8_BODY(256, false, 0.0f) }
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_sm90_d64_softcap_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, int batch, int n_q, int n_k, int n_heads, int n_kv_heads,
    float scale, int window_left, int window_right, float softcap) { FA90F8_BODY(64, true, softcap) }
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_sm90_d128_softcap_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, int batch, int n_q, int n_k, int n_heads, int n_kv_heads,
    float scale, int window_left, int window_right, float softcap) { FA90F8_BODY(128, true, softcap) }
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_sm90_d256_softcap_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, int batch, int n_q, int n_k, int n_heads, int n_kv_heads,
    float scale, int window_left, int window_right, float softcap) { FA90F8_BODY(256, true, softcap) }

// flash_attention_varlen with float8_e4m3fn q, k, v: q (total_q, n_heads, D), k / v (total_k, n_kv_heads, D) as
// bytes, out (total_q, n_heads, D) bf16, lse (total_q, n_heads) f32, cu_q / cu_k int32 (batch + 1); descales as
// the dense kernels' (b the sequence); grid (query tiles of the longest sequence * n_heads, batch) (see
// fa90f8_forward's VARLEN). The _softcap kernels take the softcap (> 0) as one more, last, parameter.
#define FA90F8_VARLEN_BODY(D, SC, CAP)                                                                            \
    fa90f8_forward<D, SC, true>(&tq, &tk, &tv, out, lse, q_descale, k_descale, v_descale, qd_stride, kd_stride,   \
                                vd_stride, 0, 0, n_heads, n_kv_heads, scale, window_left, window_right, CAP, cu_q,  \
                                cu_k);
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_varlen_sm90_d64_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
    int n_heads, int n_kv_heads, float scale, int window_left, int window_right) {
    FA90F8_VARLEN_BODY(64, false, 0.0f)
}
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_varlen_sm90_d64_softcap_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
    int n_heads, int n_kv_heads, float scale, int window_left, int window_right, float softcap) {
    FA90F8_VARLEN_BODY(64, true, softcap)
}
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_varlen_sm90_d128_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
    int n_heads, int n_kv_heads, float scale, int window_left, int window_right) {
    FA90F8_VARLEN_BODY(128, false, 0.0f)
}
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_varlen_sm90_d128_softcap_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
    int n_heads, int n_kv_heads, float scale, int window_left, int window_right, float softcap) {
    FA90F8_VARLEN_BODY(128, true, softcap)
}
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_varlen_sm90_d256_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
    int n_heads, int n_kv_heads, float scale, int window_left, int window_right) {
    FA90F8_VARLEN_BODY(256, false, 0.0f)
}
extern "C" __global__ void __launch_bounds__(FA90F8_THREADS, 1) attention_fwd_varlen_sm90_d256_softcap_fp8(
    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
    const __grid_constant__ CUtensorMap tv, __nv_bfloat16* __restrict__ out, float* __restrict__ lse,
    const float* __restrict__ q_descale, const float* __restrict__ k_descale, const float* __restrict__ v_descale,
    int qd_stride, int kd_stride, int vd_stride, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
    int n_heads, int n_kv_heads, float scale, int window_left, int window_right, float softcap) {
    FA90F8_VARLEN_BODY(256, true, softcap)
}
