// pykern: arch sm_90a
// Hopper (sm_90a) FlashAttention forward in the FlashAttention-3 design, bf16 and f16 (one template over
// the element type T): O = softmax(scale * Q K^T [+ window mask]) V and the natural-log lse per row, with
// the layouts, GQA mapping, bottom-right window / causal mask, softcap and empty-row convention of
// attention_fwd_tc.cu (rows that see no key: out = 0, lse = -inf). Template parameters: DQK, the head_dim of q and
// k (64 / 96 / 128 / 256, or 192), DV, that of v and out (DQK, or 128 with DQK 192: DeepSeek-V3's prefill shape); SC,
// softcap (the _softcap entry points): scores become c * tanh(scale * q.k / c) before the mask and softmax
// (fa90_cap: tanh.approx, one MUFU op a score), as the mma.sync kernels do; the kernels without it carry no tanh.
//
// Work split: a CTA of 3 warpgroups (384 threads) owns BR = 128 consecutive queries of one (batch, head) at a time
// (a work tile); the dense kernel at PERSIST head dims walks several (fa90_dense_tile: longest first; the producer
// publishes each to the consumers through shared memory with its Q, the ring carrying on across them).
//   warpgroup 0, the producer: one elected thread issues the TMA loads: Q once, then K and V tiles of BC
//     keys into a STAGES-deep ring in shared memory. Each slot has a `full` mbarrier (the loads complete
//     their bytes on it) and an `empty` one (every consumer thread arrives when done with the slot); the
//     producer waits on `empty` before refilling. It gives registers back (setmaxnreg.dec to 24).
//   warpgroups 1 and 2, the consumers (setmaxnreg.inc to 240): consumer c owns query rows 64c..64c+63.
//     S = Q K_j^T : wgmma m64n<BC>k16 SS, both operands from shared memory (K-major, 128B swizzle; d96 64B); at d64
//                  RS, the consumer's Q rows in registers (QREG: read once from the Q tile);
//     online softmax on the accumulators in registers (base 2, exp2 via ex2.approx); the row max is taken
//                  on the raw scores (the op sends only scale > 0 here), so one FFMA scales and shifts
//                  (exact at the boundary tiles, lazy in the steady state: below);
//     O += P V_j  : wgmma m64n<D>k16 RS: P rounded to T in registers straight from the S accumulator
//                  layout (it is the A-fragment layout), V from shared memory MN-major (no transpose).
// Tile order: key tiles are visited from the last to the first. Tiles that some row sees only partly
// (the causal / window boundary, keys past n_k) run the masked body in their own loops before and after
// the steady-state loop over tiles every row sees wholly, which carries no mask code at all.
// Lazy softmax in the steady state: the base m (the exp2 shift, in raw score units) stays as it is while a
// tile's P = 2^(s * sl2 - m * sl2) keep every thread's partial row sums <= 2^15 (so every P <= 2^15, finite
// in f16): no row max, no shuffles, no rescale of O and l, i.e. FFMA + ex2 + FADD + half an F2FP a score.
// A warp whose check fails (the running max grew by 15 - log2(BC / 4) log2 units or more, or m is -inf) redoes
// the tile's softmax exactly from the kept scores; that redo lies outside the hot loop (each step issues
// O += P V of the previous tile and S of the next as one wgmma group, so every warp meets the same wgmmas). m and l are always
// consistent (lse = ln 2 * (m * sl2 + log2 l)); the boundary tiles keep the exact softmax.
// With softcap the capped scores lie in [-c, c], so no tile can move the max by more than 2c log2 e log2 units: a
// bound below 15 - log2(BC / 4) would make the check pass always once m is finite, but that is c < 3.3 to 3.8 (Gemma's
// c is 30 / 50), so the check stays as it is; it still catches m = -inf (P = inf), and a NaN score (tanh keeps it).
// Shared memory (dynamic, 1024-byte aligned): Q [DQK/X][BR][X], K [STAGES][DQK/X][BC][X], V [STAGES][DV/X][BC][X]
// (each [rows][X] box is what one TMA load writes; X = 64 columns, 128-byte rows, 128B swizzle, or at d96 X = 32,
// 64-byte rows, 64B swizzle: PkAttnBox, the backward's layout), then the mbarriers.
// Tensor maps (pykern/ops/_attention_sm90.py makes them): q (batch, n_q, n_heads, DQK) with box (1, BR, 1, X), k
// and v (batch, n_k, n_kv_heads, DQK / DV) with box (1, BC, 1, X), the box's swizzle; rows past n_q / n_k load as
// zeros. The dense kernels store O through one more, to over out (batch, n_q, n_heads, DV) with box (1, 64, 1, X)
// (a consumer warpgroup's rows; the epilogue stages them in the Q tile), whose stores clip rows past n_q.
// attention_fwd_varlen_sm90_d*: the same kernel over packed sequences (VARLEN, see fa90_forward).
// Kernel names: attention_fwd[_varlen]_sm90_d{D}[_softcap]_{bf16,f16} (D 64 / 96 / 128 / 256), d192_dv128 for DQK
// 192 / DV 128.
// paged_prefill_sm90_d{64,96,128,256}[_softcap]_{bf16,f16}[_{e4m3,e5m2}kv] and paged_prefill_sm90_d192_dv128[_softcap]_...
// (V pages of 128 columns beside K pages of 192, V's strides its own): the varlen kernel's queries against a paged
// cache (paged_prefill_attention), the K / V tiles gathered through the page table by fa90_producer_paged (KV).
#include "pk_common.cuh"
#include "pk_ptx.cuh"
#include "pk_attn_window.cuh"
#include "pk_attn_tc.cuh"  // pk_attn_epilogue

#define FA90_BR 128
#define FA90_THREADS 384

// BC: keys per tile; STAGES: slots of the K/V ring. Shared bytes: Q + STAGES * BC * (DQK + DV) * 2 + barriers.
template <int DQK, int DV = DQK> struct Fa90Cfg;
// QREG: the consumer keeps its Q rows in registers (the A fragments of S = Q K^T, wgmma RS; D / 4 registers),
// so S needs no Q descriptors (d64; d128 / d256 have no registers to spare and keep Q in shared memory).
// PAIR: the steady-state loop runs two key tiles an iteration (see fa90_forward).
// PP: the steady-state loop ping-pongs the two consumer warpgroups (fa90_step). On at
// d128 and d64, as FA3 has its warp scheduler barriers for 16-bit inputs at head dims up to 128. d128: its 2 BAR
// instructions a tile and their set-up cost 10 a tile (302, 1.180 per m16n8k16-equivalent against 292, 1.141).
// d64: the 4 BAR instructions a pair and nothing else, their ids kept in registers, the descriptors in the uniform
// ones (762 -> 766 a pair, 1.995; varlen 759 -> 763; softcap 1545 -> 1540, varlen 1538 -> 1542; 0 spills). Its
// first trial, before the pair loop's literal mbarrier slots, took the dense kernel's descriptors out of the
// uniform registers (897 a pair, 2.336, and 96 bytes of spills; varlen 4 bytes). Off at d256 (0.787 with it, 399 ->
// 403) and 192 / 128 (0.994, 310 -> 318).
// OVL: the steady-state step overlaps the softmax of the next tile with O += P V of the previous one (FA3's
// intra-warpgroup overlap, fa90_step); Fa90Ovl / Fa90OvlEdge below refine it at d64. Its wait<1> costs 2
// instructions a tile; at d64 the room came from the K descriptors kept across the loop (Fa90KHoist: 767 -> 759 a
// pair), and the FMA exp2 (Fa90Fex) would not have made it (8 more instructions an exp2 moved off the MUFU).
// PERSIST: the dense kernel walks several work tiles a CTA (fa90_forward's tile loop, the launcher's persistent grid
// for causal / windowed calls); without it one CTA a tile. At d128 the loop is 302 (1.180), at d64 762 a pair (1.984;
// 759 without the tile loop, whose state took the registers that kept the steps' mbarrier addresses until those
// became literal slots, 764 -> 762), at d256 404 a pair (0.789; 399 without it: the pair loop's counter and parity
// move to uniform registers and its barrier id is computed again each pair), softcap 532 (1.039; 527). The d256
// producer now fits its 24 registers (0 spills; its first trial, before the later changes to the tile loop and
// the epilogue, spilled 3 words).
template <> struct Fa90Cfg<64> { enum { BC = 192, STAGES = 2, QREG = 1, PAIR = 1, PP = 1, OVL = 1, PERSIST = 1 }; };
template <> struct Fa90Cfg<128> { enum { BC = 128, STAGES = 2, QREG = 0, PAIR = 0, PP = 1, OVL = 1, PERSIST = 1 }; };
template <> struct Fa90Cfg<256> { enum { BC = 64, STAGES = 2, QREG = 0, PAIR = 1, PP = 0, OVL = 1, PERSIST = 1 }; };
// d96 (Phi-3-mini's head dim): the d128 tiling over 32-column boxes with the 64B swizzle (PkAttnBox<96>: three boxes
// a tile, the backward's layout). 128 keys a tile: o (48) + s (64) + P (32) take fewer registers than d128's, and
// shared memory is Q 24 KiB + 2 x (K 24 KiB + V 24 KiB) = 120 KiB + barriers. One step an iteration, ping-pong and
// the intra-warpgroup overlap on (FA3 runs head dims up to 128 with both); the MUFU (0.67 an MMA, 1.33 with
// softcap) stays under or near the tensor pipe, so no FMA exp2.
template <> struct Fa90Cfg<96> { enum { BC = 128, STAGES = 2, QREG = 0, PAIR = 0, PP = 1, OVL = 1, PERSIST = 1 }; };
// head_dim_qk 192, head_dim_v 128 (DeepSeek-V3's prefill): the d128 tiling (o and s as at d128; S takes 12 k-steps
// instead of 8). Shared: Q 48 KiB + 2 x (K 48 KiB + V 32 KiB) = 208 KiB + barriers.
template <> struct Fa90Cfg<192, 128> { enum { BC = 128, STAGES = 2, QREG = 0, PAIR = 0, PP = 0, OVL = 1, PERSIST = 1 }; };
// Fa90Ovl: OVL of the hot loop's steps, by softcap as well (the same everywhere today). At d64 with softcap the MUFU
// binds (the tanh and the exp2s), which the overlap does not relieve; its first trial there (one exp2 n-tile in four
// on the FMA pipe) spilled 552 bytes in the loop. With two in four it fits, 0 spills (1922 -> 1921 a pair; varlen
// 1940 -> 1918, paged 1942 -> 1918): the A step's tanh and exp2s all run under P V, the B step's first few.
template <int DQK, int DV, bool SC> struct Fa90Ovl { enum { V = Fa90Cfg<DQK, DV>::OVL }; };
// Fa90OvlEdge: OVL of the pair loop's edge steps (the odd step before the pairs, the odd tile left after them), which
// run once a work tile. Off at d64: the overlapped step there spilled 260 bytes (straight-line code, scheduled
// wider than the loop's), and a single step gains nothing from it; the edge and hot steps hand over the same
// state (pa: the previous tile's P), so the two kinds mix.
template <int DQK, int DV, bool SC> struct Fa90OvlEdge { enum { V = Fa90Ovl<DQK, DV, SC>::V }; };
template <bool SC> struct Fa90OvlEdge<64, 64, SC> { enum { V = 0 }; };
// Fa90OvlOut: OVL of the pair loop's out-of-line B step (after a failed A). Off at d64 with softcap: overlapped, it
// spilled 12 bytes (varlen); like an edge step it hands over pa and so mixes with the hot steps.
template <int DQK, int DV, bool SC> struct Fa90OvlOut { enum { V = Fa90Ovl<DQK, DV, SC>::V }; };
template <> struct Fa90OvlOut<64, 64, true> { enum { V = 0 }; };
// Fa90KHoist: the steady step's K descriptors (one a k-step and ring slot) are loop invariants the compiler may keep
// (fa90_step); elsewhere they are made in each step, out of registers the loop does not have.
template <int DQK, int DV> struct Fa90KHoist { enum { V = 0 }; };
template <> struct Fa90KHoist<64, 64> { enum { V = 1 }; };

// FEX: of every 4 n-tiles (8 keys each) of a steady-state tile, the number whose exp2s run on the FMA pipe
// (pk_exp2_fma: 9 FMA / ALU instructions an exp2, 8 more than one MUFU.EX2) instead of the MUFU (16 results a clock
// per SM, 2 clocks a warp-instruction). Only in the lazy softmax of the steady state (fa90_softmax_lazy,
// fa90_softmax_lazy_ip); the boundary tiles keep MUFU. d64 (BC / 2 exp2s a thread for BC m16n8k16-equivalents a
// tile): the MUFU alone took as long as the tensor pipe (1.0 clock an MMA each, issue 0.5); with one n-tile in
// four, MUFU 0.75 and issue 0.76 (192 -> 144 MUFU.EX2 a pair, 765 -> 1161 instructions), the tensor pipe the one
// bound, but no faster: the MUFU only tied with it, so the d64 kernel without softcap keeps every exp2 on the MUFU
// (and its loop at 765, 1.992, under the 2.0 bar). With softcap (a tanh.approx a score on the MUFU as well: 2.0 an
// MMA, the MUFU alone binds) two in four: MUFU 1.5, issue 1.25 (1151 -> 1922 a pair, 5.005; varlen 1940, paged
// 1947 -> 1942 with its ping-pong; 1921 / 1918 / 1918 with the overlap), the bound a seventh lower than at one in four (MUFU 1.75, issue 1.0, 1540 a
// pair). Three in four would leave the MUFU at 1.25 and make issue (about 1.5) the bound: no gain.
// d128 / d256 / 192: the MUFU is under the tensor pipe already (0.5, 0.25, 0.4 an MMA; with softcap 1.0, 0.5, 0.8),
// so they keep it all.
template <int DQK, int DV, bool SC> struct Fa90Fex { enum { V = 0 }; };
template <> struct Fa90Fex<64, 64, true> { enum { V = 2 }; };
// Fa90FexEdge: FEX of the steps outside the hot pair loop (its edge steps, the B step after a failed A), which run
// once a work tile: at most one in four. They are straight-line code ptxas schedules wider than the loop, and at
// two in four they spilled (varlen 248 bytes, paged 364), for no gain in a step that runs once.
template <int DQK, int DV, bool SC> struct Fa90FexEdge {
    enum { V = Fa90Fex<DQK, DV, SC>::V < 1 ? Fa90Fex<DQK, DV, SC>::V : 1 };
};

#define FA90_SMEM_BYTES(DQK, DV, BC, ST) (FA90_BR * (DQK) * 2 + (ST) * (BC) * ((DQK) + (DV)) * 2 + 1024)
// The FP8 paged kernels that stage the cache's bytes (fa90_gather_rows_staged, d256) take this many more after it
// (pykern/ops/_attention_sm90.py's paged_shared_bytes).
#define FA90_PAGED_FP8_STAGE(DQK, DV, BC) ((BC) * ((DQK) + (DV)))

template <typename T> struct Fa90Dt;
template <> struct Fa90Dt<__nv_bfloat16> { enum { V = PK_WGMMA_BF16 }; };
template <> struct Fa90Dt<__half> { enum { V = PK_WGMMA_F16 }; };

// The exact online softmax of one tile for this thread's rows g and g + 8 (pk_wgmma_online_softmax: P into the
// A fragments of O += P V, the rows' partial sums l), then O's rows rescaled by alpha = 2^((m_old - m_new) * sl2).
template <typename T, int D, int BC>  // D: head_dim_v (the O accumulators)
__device__ __forceinline__ void fa90_softmax_exact(const float (&s)[BC / 2], float (&o)[D / 2], float (&m)[2],
                                                   float (&l)[2], unsigned (&pa)[BC / 16][4], float sl2) {
    float al[2];
    pk_wgmma_online_softmax<T, BC>(s, m, l, pa, al, sl2);
#pragma unroll
    for (int j = 0; j < D / 8; j++)
        o[4 * j] *= al[0], o[4 * j + 1] *= al[0], o[4 * j + 2] *= al[1], o[4 * j + 3] *= al[1];
}

// The wgmmas of S = Q K^T for one key tile (no fence, no commit): Q from registers (qa, QREG) or from shared
// memory (dq), K through dk. D: head_dim_qk (the k-steps).
template <typename T, int D, int BC, bool QREG>
__device__ __forceinline__ void fa90_issue_scores(float (&s)[BC / 2], const unsigned (&qa)[D / 16][4],
                                                  unsigned long long dq, unsigned long long dk) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        // k-step ks: box ks / KB (BR or BC rows of RW bytes: PkAttnBox), 32 bytes further per k-step inside it.
        constexpr unsigned KB = PkAttnBox<D>::KSTEPS, RW = PkAttnBox<D>::ROW;
        const unsigned qo = (ks / KB) * FA90_BR * RW + (ks % KB) * 32, ko = (ks / KB) * BC * RW + (ks % KB) * 32;
        if constexpr (QREG)
            pk_wgmma_m64nNk16_rs<BC, Fa90Dt<T>::V, 0>(s, qa[ks], pk_wgmma_desc_advance(dk, ko), ks > 0);
        else
            pk_wgmma_m64nNk16_ss<BC, Fa90Dt<T>::V>(s, pk_wgmma_desc_advance(dq, qo), pk_wgmma_desc_advance(dk, ko),
                                                  ks > 0);
    }
}

// The wgmmas of O += P V for one key tile (no fence, no commit). D: head_dim_v.
template <typename T, int D, int BC>
__device__ __forceinline__ void fa90_issue_pv(float (&o)[D / 2], const unsigned (&pa)[BC / 16][4],
                                              unsigned long long dv) {
#pragma unroll
    for (int kk = 0; kk < BC / 16; kk++)  // 16 keys = two 8-row groups of 8 box rows (1024 or 512 bytes)
        pk_wgmma_m64nNk16_rs<D, Fa90Dt<T>::V, 1>(o, pa[kk], pk_wgmma_desc_advance(dv, kk * 16 * PkAttnBox<D>::ROW), 1);
}

// S = Q K^T for one key tile, once the slot's K and V have landed. D: head_dim_qk.
template <typename T, int D, int BC, bool QREG>
__device__ __forceinline__ void fa90_scores(float (&s)[BC / 2], const unsigned (&qa)[D / 16][4], unsigned long long dq,
                                            unsigned long long dk, unsigned long long* full, unsigned parity) {
    pk_mbarrier_wait_parity(full, parity);
    pk_wgmma_fence();
    fa90_issue_scores<T, D, BC, QREG>(s, qa, dq, dk);
    pk_wgmma_commit();
    pk_wgmma_wait<0>();
}

// The lazy softmax of a steady-state tile: P = 2^(s * sl2 - m * sl2) from the base m as it is (no row max, no
// rescale of O and l) and this thread's partial row sums, accepted (l += them, true returned) when every
// thread of the warp has both partial sums <= 2^FA90_LAZY_LOG2, hence every P <= 2^15 (finite in f16, whose
// largest value is 65504). Otherwise (the running max grew by 15 - log2(BC / 4) or more, or m is still -inf,
// which makes P = inf; NaN fails too) false, and the caller redoes the tile's softmax exactly from s.
// WG: the decision is the consumer warpgroup's (all 128 threads' sums, named barrier `bar` = 1 + its index,
// one barrier.red.and), not the warp's (__all_sync): where a failed warp runs the next wgmmas from other
// instructions than the rest (the pair loop's out-of-line B step), all four warps of the warpgroup must take
// that path together, wgmma being .sync.aligned over the warpgroup. The exact redo is right for any warp.
#define FA90_LAZY_LOG2 15
// The sums and the vote of both lazy softmaxes: pair(j, r, base) computes n-tile j's two P of row g + 8 r (base
// = m[r] * sl2), stores them where its caller keeps P and returns their sum.
template <int BC, bool WG, typename Pair>
__device__ __forceinline__ bool fa90_lazy_sum_vote(const float (&m)[2], float (&l)[2], float sl2, unsigned bar,
                                                   Pair&& pair) {
    float sum[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float base = m[r] * sl2;
#pragma unroll
        for (int j = 0; j < BC / 8; j++) {
            const float p2 = pair(j, r, base);
            sum[r] = j == 0 ? p2 : sum[r] + p2;  // no 0 + x (an FADD: x may be -0)
        }
    }
    constexpr float lim = (float)(1 << FA90_LAZY_LOG2);
    const bool ok = sum[0] <= lim && sum[1] <= lim;
    if (!__all_sync(PK_FULL_MASK, WG ? pk_bar_red_and(bar, 128, ok) : ok)) return false;
    l[0] += sum[0];
    l[1] += sum[1];
    return true;
}

template <typename T, int D, int BC, bool WG = false, int FEX = 0>
__device__ __forceinline__ bool fa90_softmax_lazy(const float (&s)[BC / 2], const float (&m)[2], float (&l)[2],
                                                  unsigned (&pa)[BC / 16][4], float sl2, unsigned bar = 0) {
    return fa90_lazy_sum_vote<BC, WG>(m, l, sl2, bar, [&](int j, int r, float base) {
        const float p0 = pk_attn_exp2<FEX>(j, fmaf(s[4 * j + 2 * r], sl2, -base));
        const float p1 = pk_attn_exp2<FEX>(j, fmaf(s[4 * j + 2 * r + 1], sl2, -base));
        pa[j / 2][2 * (j & 1) + r] = Pk16<T>::narrow2(p0, p1);
        return p0 + p1;
    });
}

// O += P V for one key tile, then release the slot.
template <typename T, int D, int BC>
__device__ __forceinline__ void fa90_pv(float (&o)[D / 2], const unsigned (&pa)[BC / 16][4], unsigned long long dv,
                                        unsigned long long* empty) {
    pk_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BC / 16; kk++)  // 16 keys = two 8-row groups of 8 box rows (1024 or 512 bytes)
        pk_wgmma_m64nNk16_rs<D, Fa90Dt<T>::V, 1>(o, pa[kk], pk_wgmma_desc_advance(dv, kk * 16 * PkAttnBox<D>::ROW), 1);
    pk_wgmma_commit();
    pk_wgmma_wait<0>();
    pk_mbarrier_arrive(empty);  // this thread is done with the slot (its wgmmas have completed)
}

// Ping-pong of the two consumer warpgroups in the steady state (FA3's warp scheduler barriers; PP): consumer c issues
// a step's wgmmas only in its turn, waiting on named barrier FA90_BAR_PP + c (256 threads: its own 128 and the
// other warpgroup's arrival), and once they are issued hands the turn over by arriving at the other's barrier
// (FA90_BAR_PP + 1 - c) without waiting. So the tensor pipe takes the two warpgroups' wgmma groups in
// alternation, and one warpgroup's softmax runs while the other's GEMMs execute (the exp2s and the wgmmas of one
// warpgroup would otherwise queue behind each other). Consumer 1 opens the game with one arrival at consumer
// 0's barrier; consumer 0 takes the last hand-over after the loop's last step (one more sync on its barrier; the
// pair loop's after its edge steps too), so a CTA that walks several work tiles starts each with both barriers at
// zero arrivals. Both warpgroups run the same steps (the tile split is the CTA's), so the turns pair up. Barriers 1
// and 2 are fa90_softmax_lazy's (WG) reductions.
#define FA90_BAR_PP 3
// This consumer warpgroup's ping-pong barrier, FA90_BAR_PP + c = threadIdx.x / 128 + 2 (one shift and add where
// the loop has no register to keep it in); the other's is it ^ 7 (3 <-> 4).
static_assert(FA90_BAR_PP == 3, "fa90_pp_bar: FA90_BAR_PP + c == threadIdx.x / 128 + 2, the other's id ^ 7");
__device__ __forceinline__ unsigned fa90_pp_bar() { return threadIdx.x / 128 + 2; }

// The lazy softmax of a steady-state tile in place, while O += P V of the previous tile still runs on the tensor
// pipe (FA3's intra-warpgroup overlap): s becomes P = 2^(s * sl2 - m * sl2) in fp32 (the P registers pa are that
// wgmma's A operand until it completes: fa90_pack narrows s into them after the wait), with fa90_softmax_lazy's
// check (the same sums, vote, WG and bar); l += the sums only when accepted. On a failure s holds the lazy P, not
// the scores: fa90_redo rebases them (or, when that cannot be exact, scores the tile again).
template <int BC, bool WG = false, int FEX = 0>
__device__ __forceinline__ bool fa90_softmax_lazy_ip(float (&s)[BC / 2], const float (&m)[2], float (&l)[2],
                                                     float sl2, unsigned bar = 0) {
    return fa90_lazy_sum_vote<BC, WG>(m, l, sl2, bar, [&](int j, int r, float base) {
        s[4 * j + 2 * r] = pk_attn_exp2<FEX>(j, fmaf(s[4 * j + 2 * r], sl2, -base));
        s[4 * j + 2 * r + 1] = pk_attn_exp2<FEX>(j, fmaf(s[4 * j + 2 * r + 1], sl2, -base));
        return s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
    });
}

// P (fp32, in the S accumulator layout) rounded to T into the A fragments of O += P V.
template <typename T, int BC>
__device__ __forceinline__ void fa90_pack(const float (&s)[BC / 2], unsigned (&pa)[BC / 16][4]) {
#pragma unroll
    for (int j = 0; j < BC / 8; j++)
#pragma unroll
        for (int r = 0; r < 2; r++)
            pa[j / 2][2 * (j & 1) + r] = Pk16<T>::narrow2(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]);
}

// One step of the steady state, FA3's intra-warpgroup overlap: S = Q K^T of the next tile (K through dk, once its
// slot's `full` mbarrier fb has completed) and O += P V of the previous one (its slot's V through dv) as two wgmma
// groups, S first, issued in this warpgroup's ping-pong turn; wait<1> waits for S only, so the softcap and the
// lazy softmax of the next tile run while P V still executes; then wait<0>, the arrival on the previous slot's
// `empty` mbarrier (2 mbarriers past fb, ST == 2) and the P of the next tile narrowed into pa (free now). False when
// the lazy softmax failed (for the warp, or with WG for the whole warpgroup: see fa90_softmax_lazy); s then holds
// the lazy P for fa90_redo. o is left alone from the P V wgmmas to wait<0>.
template <typename T, int DQK, int DV, int BC, bool QREG, bool SC, bool PP, bool WG = false,
          bool OV = (bool)Fa90Ovl<DQK, DV, SC>::V, int FX = Fa90Fex<DQK, DV, SC>::V>
__device__ __forceinline__ bool fa90_step(float (&o)[DV / 2], unsigned (&pa)[BC / 16][4], float (&s)[BC / 2],
                                          const unsigned (&qa)[DQK / 16][4], const float (&m)[2], float (&l)[2],
                                          unsigned long long dq, unsigned long long dk, unsigned long long dv,
                                          unsigned long long* fb, unsigned parity, float sl2, float pre,
                                          unsigned bar = 0) {
    // pk_opaque_u64: the descriptors are loop invariants of the hot loop; computed here, not hoisted out of it
    // (its 28 advanced descriptors would take registers the loop does not have).
    // Fa90KHoist (d64): K's k-step descriptors are left to the compiler, which keeps them in uniform registers
    // across the loop (the d64 loop has the room: 759 instructions a pair against 767 with them made here).
    if constexpr (!Fa90KHoist<DQK, DV>::V) dk = pk_opaque_u64(dk);
    dv = pk_opaque_u64(dv);
    const unsigned pp = fa90_pp_bar();
    pk_mbarrier_wait_parity(fb, parity);
    if constexpr (PP) pk_bar_sync_aligned(pp, 256);  // this warpgroup's turn (warps converged)
    pk_wgmma_fence();
    if constexpr (!OV) {  // one wgmma group (P V, then S), the softmax after both (d64 edge steps; Fa90OvlOut)
        fa90_issue_pv<T, DV, BC>(o, pa, dv);
        fa90_issue_scores<T, DQK, BC, QREG>(s, qa, dq, dk);
        pk_wgmma_commit();
        if constexpr (PP) pk_bar_arrive_aligned(pp ^ 7, 256);
        pk_wgmma_wait<0>();
        pk_mbarrier_arrive(fb + 2);
        fa90_cap<SC, BC>(s, pre);
        return fa90_softmax_lazy<T, DV, BC, WG, FX>(s, m, l, pa, sl2, bar);  // s keeps the scores
    }
    fa90_issue_scores<T, DQK, BC, QREG>(s, qa, dq, dk);
    pk_wgmma_commit();
    fa90_issue_pv<T, DV, BC>(o, pa, dv);
    pk_wgmma_commit();
    if constexpr (PP) pk_bar_arrive_aligned(pp ^ 7, 256);  // the other's turn, while these run
    pk_wgmma_wait<1>();  // S has landed; O += P V runs on under the softmax
    fa90_cap<SC, BC>(s, pre);
    const bool ok = fa90_softmax_lazy_ip<BC, WG, FX>(s, m, l, sl2, bar);
    pk_wgmma_wait<0>();
    pk_mbarrier_arrive(fb + 2);
    // P pinned after the wait: otherwise the compiler narrows part of it early, into the P registers P V still
    // reads, and ptxas then moves the wait up into the softmax (the overlap lost)
#pragma unroll
    for (int i = 0; i < BC / 2; i++) pk_wgmma_fence_operand(s[i]);
    fa90_pack<T, BC>(s, pa);
    return ok;
}

// The raw scores of this thread's S entries for one key tile, again, from shared memory (Q rows 64c + 16wq + g and
// + 8 of the Q tile; keys of the K slot at kslot), one thread at a time in fp32: no wgmma (a warp redoes alone,
// not its warpgroup). Only where the lazy P cannot be rebased (fa90_redo), far outside the hot loop.
template <typename T, int DQK, int BC>
__device__ __forceinline__ void fa90_rescore(float (&s)[BC / 2], const unsigned char* qs,
                                             const unsigned char* kslot) {
    // Swizzled byte offsets (pk_swizzle_offset, whose pattern repeats every 8 box rows): entry i's key is
    // 8 (i / 4) + 2t + (i & 1), so its offset is that of key 2t + (i & 1) plus 8 RW (i / 4), an immediate; the
    // thread's two Q rows are 8 apart too. Two K and two Q addresses a pass, not 96.
    constexpr unsigned RW = PkAttnBox<DQK>::ROW, COLS = PkAttnBox<DQK>::COLS, SW = PkAttnBox<DQK>::SWIZZLE;
    const unsigned tid = threadIdx.x, t = tid % 4, qrow = 16 * (tid / 32 - 4) + (tid % 32) / 4;
#pragma unroll
    for (int i = 0; i < BC / 2; i++) s[i] = 0.0f;
#pragma unroll 1
    for (int d = 0; d < DQK; d += 2) {  // 2 head-dim columns (one 32-bit word) a pass
        const unsigned box = d / COLS, unit = (d % COLS) / 8, in = (d % 8) * 2;
        const unsigned char* q0 = qs + box * FA90_BR * RW + pk_swizzle_offset(qrow * RW + unit * 16, SW) + in;
        const unsigned char* k0 = kslot + box * BC * RW + pk_swizzle_offset(2 * t * RW + unit * 16, SW) + in;
        const unsigned char* k1 = kslot + box * BC * RW + pk_swizzle_offset((2 * t + 1) * RW + unit * 16, SW) + in;
        float q[2][2];
#pragma unroll
        for (int r = 0; r < 2; r++)
            Pk16<T>::widen2(*reinterpret_cast<const unsigned*>(q0 + r * 8 * RW), q[r][0], q[r][1]);
#pragma unroll
        for (int i = 0; i < BC / 2; i++) {
            float kl, kh;
            Pk16<T>::widen2(*reinterpret_cast<const unsigned*>((i & 1 ? k1 : k0) + (i / 4) * 8 * RW), kl, kh);
            const int r = (i >> 1) & 1;
            s[i] = fmaf(q[r][1], kh, fmaf(q[r][0], kl, s[i]));
        }
    }
}

// The redo of a steady tile whose lazy softmax failed (the running max grew), after fa90_step: s holds the lazy
// P = 2^(x - base), x = s * sl2, base = m * sl2. Where every P of the warp is finite and at most 2^100 (the
// running max grew by less than 100 log2 units; nothing was NaN), the tile is rebased exactly: per row the
// quad's largest P, mp > 1, becomes the new base (m += log2(mp) / sl2, f = 1 / mp: P, l and O times f, so that P
// <= 1), rows with mp <= 1 keep theirs; l += the rows' sums. Otherwise (an overflowed P, m = -inf, NaN) the raw
// scores are gone: fa90_rescore computes them again from the tile's K slot (still held: its `empty` arrival
// comes one step later) and the exact softmax runs on them, as the masked tiles do. P into pa either way.
template <typename T, int DQK, int DV, int BC, bool SC, bool OV = (bool)Fa90Ovl<DQK, DV, SC>::V>
__device__ __forceinline__ void fa90_redo(float (&s)[BC / 2], float (&o)[DV / 2], float (&m)[2], float (&l)[2],
                                          unsigned (&pa)[BC / 16][4], float sl2, float pre, const unsigned char* qs,
                                          const unsigned char* kslot) {
    if constexpr (!OV) {  // s holds the scores: the exact softmax of the tile
        fa90_softmax_exact<T, DV, BC>(s, o, m, l, pa, sl2);
        return;
    }
    bool bad = false;
#pragma unroll
    for (int i = 0; i < BC / 2; i++) bad |= !(s[i] <= 0x1p100f);  // inf, NaN, or too large for 1 / mp
    if (__any_sync(PK_FULL_MASK, bad)) {
        fa90_rescore<T, DQK, BC>(s, qs, kslot);
        fa90_cap<SC, BC>(s, pre);
        fa90_softmax_exact<T, DV, BC>(s, o, m, l, pa, sl2);
        return;
    }
    float f[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mp = 0.0f;
#pragma unroll
        for (int j = 0; j < BC / 8; j++) mp = fmaxf(mp, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        mp = fmaxf(mp, __shfl_xor_sync(PK_FULL_MASK, mp, 1));
        mp = fmaxf(mp, __shfl_xor_sync(PK_FULL_MASK, mp, 2));
        f[r] = 1.0f;
        if (mp > 1.0f) m[r] += __log2f(mp) / sl2, f[r] = __frcp_rn(mp);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < BC / 8; j++) {
            s[4 * j + 2 * r] *= f[r], s[4 * j + 2 * r + 1] *= f[r];
            sum += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
        }
        l[r] = l[r] * f[r] + sum;
    }
#pragma unroll
    for (int j = 0; j < DV / 8; j++)
        o[4 * j] *= f[0], o[4 * j + 1] *= f[0], o[4 * j + 2] *= f[1], o[4 * j + 3] *= f[1];
    fa90_pack<T, BC>(s, pa);
}

// One boundary key tile for one consumer warpgroup: S = Q K^T, mask, exact online softmax, O += P V.
template <typename T, int DQK, int DV, int BC, bool QREG, bool SC>
__device__ __forceinline__ void fa90_tile_masked(float (&o)[DV / 2], float (&m)[2], float (&l)[2],
                                                 const unsigned (&qa)[DQK / 16][4], unsigned long long dq,
                                                 unsigned long long dk, unsigned long long dv,
                                                 unsigned long long* full, unsigned long long* empty, unsigned parity,
                                                 float sl2, float pre, int k0, const int (&rlo)[2],
                                                 const int (&rhi)[2], int t) {
    float s[BC / 2];
    fa90_scores<T, DQK, BC, QREG>(s, qa, dq, dk, full, parity);
    fa90_cap<SC, BC>(s, pre);  // before the mask, as the mma.sync kernels
#pragma unroll
    for (int i = 0; i < BC / 2; i++) {
        const int col = k0 + 8 * (i / 4) + 2 * t + (i & 1), r = (i >> 1) & 1;
        if (col < rlo[r] || col > rhi[r]) s[i] = PK_NEG_INF;
    }
    unsigned pa[BC / 16][4];
    fa90_softmax_exact<T, DV, BC>(s, o, m, l, pa, sl2);
    fa90_pv<T, DV, BC>(o, pa, dv, empty);
}

// ---- the paged producer (paged_prefill_sm90_*: KV = the cache element type, T or an FP8 tag) ----
// The K/V source of paged_prefill_attention: a FlashInfer page table (kv_indptr / kv_indices / kv_last_page_len)
// over a cache of any page size, element (page, token, head, d) at page * s_page + token * s_tok + head * s_head + d.
struct Fa90Paged {
    const void* kp;  // K pages (elements of KV)
    const void* vp;  // V pages
    const int* indptr;
    const int* indices;
    const int* last;
    int page_size;
    long long s_page, s_tok, s_head;  // element strides of K (and of V where the head dims agree)
    long long v_page, v_tok, v_head;  // element strides of V (the _dv kernels: V pages at their own head dim)
};

// Keys of sequence b: (pages - 1) * page_size + last (its last page's length clamped to the page), 0 without
// pages; clamped to 2^30 (the op bounds lengths well below it), as fafa_paged.
__device__ __forceinline__ int fa90_paged_len(const Fa90Paged& pg, int b) {
    const long long np = (long long)pg.indptr[b + 1] - pg.indptr[b];
    const int lst = min(max(pg.last[b], 0), pg.page_size);
    const long long len = np > 0 ? (np - 1) * pg.page_size + lst : 0;
    return len > (1ll << 30) ? (1 << 30) : (int)len;
}

// Registers of the paged producer warpgroup and of the consumers (setmaxnreg): fa90_gather_rows's addressing does
// not fit the TMA producer's 24, so the consumers give 8 back (128 * 40 + 256 * 232 = the 168 * 384 the CTA starts
// with). d256: its consumers spilled at 232 (8 to 16 bytes; the dense d256 ones take 240), so the producer gathers
// with fa90_gather_rows_lean (LEAN) in the TMA producer's 24, and the consumers keep the dense kernel's 240.
template <int DQK> struct Fa90PagedRegs { enum { PRODUCER = 40, CONSUMER = 232, LEAN = 0 }; };
template <> struct Fa90PagedRegs<256> { enum { PRODUCER = 24, CONSUMER = 240, LEAN = 1 }; };

template <typename A, typename B> struct Fa90Same { enum { V = 0 }; };
template <typename A> struct Fa90Same<A, A> { enum { V = 1 }; };
// The _softcap entry points' last parameter, 0 for the others (fa90_forward's softcap).
__device__ __forceinline__ float fa90_cap_arg() { return 0.0f; }
__device__ __forceinline__ float fa90_cap_arg(float c) { return c; }

// 16 bytes of the T tile from 16 (KV == T: cp.async, zero-filled past n_k) or 8 (FP8: a plain 8-byte load widened
// to T exactly; every e4m3 / e5m2 value is a bf16 and an f16 value) bytes of the cache.
// 4 FP8 values (KV, a word) widened to 4 of T (two words), exactly: every e4m3 / e5m2 value is a bf16 and an f16
// value.
template <typename T, typename KV>
__device__ __forceinline__ void fa90_widen4(unsigned w, unsigned& lo, unsigned& hi) {
    constexpr bool E4 = Fa90Same<KV, PkE4M3>::V;
    if constexpr (Fa90Same<T, __half>::V) {
        if constexpr (E4) pk_cvt_f16x4_e4m3x4(w, lo, hi);
        else pk_cvt_f16x4_e5m2x4(w, lo, hi);
    } else {
        if constexpr (E4) pk_cvt_bf16x4_e4m3x4(w, lo, hi);
        else pk_cvt_bf16x4_e5m2x4(w, lo, hi);
    }
}

template <typename T, typename KV>
__device__ __forceinline__ void fa90_gather_16(unsigned char* dst_base, unsigned off, const KV* src, bool in) {
    if constexpr (sizeof(KV) == 2) {
        pk_cp_async_16_zfill_at(dst_base, off, src, in);
    } else {
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (in) {
            const uint2 b8 = *reinterpret_cast<const uint2*>(src);
            fa90_widen4<T, KV>(b8.x, w.x, w.y), fa90_widen4<T, KV>(b8.y, w.z, w.w);
        }
        *reinterpret_cast<uint4*>(dst_base + off) = w;
    }
}

// One pass of the paged producer over a key tile's BC rows (keys k0..) into boxes of BX (PkAttnBox: BX::COLS columns,
// BX::ROW-byte rows, BX::SWIZZLE): thread tid takes the 16-byte column piece tid % PC (PC = BX::ROW / 16 pieces a box
// row: 8, or 4 in d96's 32-column boxes) of rows tid / PC, tid / PC + 128 / PC, ..., one page lookup a row (offset
// page * sp + token * st elements), and gathers NB1 boxes of s1 into d1 and NB2 of s2 into d2 from that offset
// ([box][BC][BX::ROW B], the layout a TMA load of that box writes). s1 / s2 already hold the thread's column
// piece (the producer's hoff).
template <typename T, typename KV, typename BX, int NB1, int NB2, int BC>
__device__ __forceinline__ void fa90_gather_rows(unsigned char* d1, const KV* s1, unsigned char* d2, const KV* s2,
                                                 const int* idx, int ps, long long sp, long long st, int k0, int n_k,
                                                 int tid) {
    constexpr int PC = BX::ROW / 16, RS = 128 / PC;  // pieces a box row, rows a pass
    // Not unrolled: ptxas unrolled it 4x, and the unrolled rows' addresses spilled out of the 40 registers.
#pragma unroll 1
    for (int r = tid / PC; r < BC; r += RS) {
        const int key = k0 + r;
        const bool in = key < n_k;
        long long off = 0;
        if (in) {
            const int pi = key / ps;
            off = (long long)idx[pi] * sp + (long long)(key - pi * ps) * st;
        }
        const unsigned so = pk_swizzle_offset(r * BX::ROW + (tid % PC) * 16, BX::SWIZZLE);
#pragma unroll
        for (int nb = 0; nb < NB1; nb++)
            fa90_gather_16<T, KV>(d1 + nb * BC * BX::ROW, so, s1 + off + nb * BX::COLS, in);
#pragma unroll
        for (int nb = 0; nb < NB2; nb++)
            fa90_gather_16<T, KV>(d2 + nb * BC * BX::ROW, so, s2 + off + nb * BX::COLS, in);
    }
}

// The lean form of fa90_gather_rows (Fa90PagedRegs::LEAN: K and V at the same strides, one slot's K and V tiles
// dv_off bytes apart): a row's offset comes again from the page table's parameters, the kv head and threadIdx.x
// (opaque, so that nothing tid-derived stays live), and every shared destination from one base and an offset, so
// that the loop holds the row, the tile's first key, n_k and that base. The d256 producer runs in the TMA producer's
// 24 registers so (fa90_gather_rows there kept the 8 boxes' destinations as 64-bit addresses: 20 to 32 bytes spilled).
template <typename T, typename KV, int NB, int BC>
__device__ __forceinline__ void fa90_gather_rows_lean(unsigned char* dk, unsigned dv_off, const Fa90Paged& pg,
                                                      int ib, int kvh, int k0, int n_k) {
#pragma unroll 1
    for (int r = (int)(pk_opaque_u32(threadIdx.x) % 128) / 8; r < BC; r += 16) {
        const int key = k0 + r;
        const bool in = key < n_k;
        const unsigned col = pk_opaque_u32(threadIdx.x) % 8;  // the 16-byte column piece of a 64-wide box
        long long off = 0;
        if (in) {
            const int pi = key / pg.page_size;
            off = (long long)pg.indices[ib + pi] * pg.s_page + (long long)(key - pi * pg.page_size) * pg.s_tok +
                  (long long)kvh * pg.s_head + col * 8;
        }
        const unsigned so = pk_swizzle_offset(r * 128 + col * 16, PK_SWIZZLE_128B);
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
            fa90_gather_16<T, KV>(dk, so + nb * BC * 128, static_cast<const KV*>(pg.kp) + off + nb * 64, in);
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
            fa90_gather_16<T, KV>(dk, dv_off + so + nb * BC * 128, static_cast<const KV*>(pg.vp) + off + nb * 64, in);
    }
}

// fa90_gather_rows_staged's copies of K's (HALF 0) or V's (HALF 1) bytes of the tile's rows to the staging buffer.
template <typename KV, int HALF, int NB, int BC>
__device__ __forceinline__ void fa90_stage_half(unsigned char* stg, const Fa90Paged& pg, int ib, int kvh, int k0,
                                                int n_k) {
    constexpr unsigned ROW = 2 * NB * 64;  // staging bytes a row
#pragma unroll 1
    for (int r = (int)(pk_opaque_u32(threadIdx.x) % 128) / 4; r < BC; r += 32) {
        const int key = k0 + r;
        const bool in = key < n_k;
        const unsigned qt = pk_opaque_u32(threadIdx.x) % 4;  // the quarter of a 64-byte box row
        long long off = 0;
        if (in) {
            const int pi = key / pg.page_size;
            off = (long long)(unsigned)pg.indices[ib + pi] * pg.s_page +
                  (long long)(unsigned)(key - pi * pg.page_size) * pg.s_tok + (long long)(unsigned)kvh * pg.s_head +
                  qt * 16;
        }
        const KV* src = static_cast<const KV*>(HALF ? pg.vp : pg.kp) + off;
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
            pk_cp_async_16_zfill_at(stg, r * ROW + qt * 16 + (HALF * NB + nb) * 64, src + nb * 64, in);
    }
    pk_cp_async_commit();
}

// fa90_gather_rows_staged's widening of K's (HALF 0) or V's (HALF 1) staged bytes into the tile.
template <typename T, typename KV, int HALF, int NB, int BC>
__device__ __forceinline__ void fa90_widen_half(unsigned char* dk, unsigned dv_off, const unsigned char* stg) {
    constexpr unsigned ROW = 2 * NB * 64;
    // (row r, box c, half h): staging bytes r ROW + 16 (p % 4) + 64 (HALF NB + c) + 8 h, tile piece 2 (p % 4) + h
    // of row r (its swizzled offset p0 ^ 16 h: the XOR flips the piece's low bit) in box c of K or V
#pragma unroll 1
    for (int r = (int)(pk_opaque_u32(threadIdx.x) % 128) / 4; r < BC; r += 32) {
        const unsigned qt = pk_opaque_u32(threadIdx.x) % 4;
        const unsigned so = r * ROW + qt * 16 + HALF * NB * 64;
        const unsigned p0 = pk_swizzle_offset(r * 128 + qt * 32, PK_SWIZZLE_128B) + (HALF ? dv_off : 0u);
#pragma unroll 1
        for (int c = 0; c < NB; c++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint2 b = *reinterpret_cast<const uint2*>(stg + so + c * 64 + h * 8);
                uint4 w;
                fa90_widen4<T, KV>(b.x, w.x, w.y), fa90_widen4<T, KV>(b.y, w.z, w.w);
                *reinterpret_cast<uint4*>(dk + c * BC * 128 + (p0 ^ (h * 16))) = w;
            }
        }
    }
}

// The lean gather of an FP8 cache (Fa90PagedRegs::LEAN). 8-byte loads widened in registers (fa90_gather_16) did
// not fit the 24 registers (40 to 68 bytes spilled: ptxas held the 8 boxes' loads in flight), so the bytes go first
// to a staging buffer stg ([BC][NB * 64 K bytes, then NB * 64 V bytes], after the barriers) by 16-byte cp.async
// (zero-filled past n_k; nothing in flight in registers), K's and V's in two commit groups, so that K's bytes are
// widened while V's still land: thread p copies the 16-byte quarter p % 4 of every 64-byte box row of rows p / 4,
// p / 4 + 32, ...; after its own cp.async wait it widens those quarters (no other thread's bytes read, so no
// barrier), 8 bytes at a time (one 16-byte piece of the T tile: 2 (p % 4) or 2 (p % 4) + 1 of the row, swizzled as
// fa90_gather_rows_lean's), a box a pass (not unrolled). Read 16 bytes at a time, or with the boxes unrolled, ptxas
// held them and their 32 widened bytes (f16: 28 to 44 bytes spilled); a word at a time fit but took 25
// instructions a word. The offsets' parts are unsigned (all non-negative: a page, a token of it, a kv head): their
// sign extensions took a register each, and the tile loop's counter spilled (8 bytes, f16). Needs the cache's
// strides in whole 16 bytes (the op checks).
template <typename T, typename KV, int NB, int BC>
__device__ __forceinline__ void fa90_gather_rows_staged(unsigned char* dk, unsigned dv_off, unsigned char* stg,
                                                        const Fa90Paged& pg, int ib, int kvh, int k0, int n_k) {
    fa90_stage_half<KV, 0, NB, BC>(stg, pg, ib, kvh, k0, n_k);
    fa90_stage_half<KV, 1, NB, BC>(stg, pg, ib, kvh, k0, n_k);
    pk_cp_async_wait<1>();  // K's bytes: widened while V's land
    fa90_widen_half<T, KV, 0, NB, BC>(dk, dv_off, stg);
    pk_cp_async_wait<0>();
    fa90_widen_half<T, KV, 1, NB, BC>(dk, dv_off, stg);
}

// The paged producer warpgroup: one elected thread loads Q by TMA (as the dense producer), then all 128 threads
// gather each key tile's K and V rows through the page table into the same swizzled [box][BC][box row] layout a TMA
// load writes (PkAttnBox; 16-byte pieces: thread p takes column piece p % 8 of rows p / 8, p / 8 + 16, ..., at d96
// piece p % 4 of rows p / 4, p / 4 + 32, ...; one page lookup a row), rows past n_k as zeros (the masked tile holding key n_k - 1 reads them with P = 0, as the TMA's zero
// rows). Any page size: a row's piece never crosses a page. A slot's `full` mbarrier counts the 128 threads' arrivals,
// each after its own copies completed and were ordered before the consumers' wgmma reads (fence.proxy.async).
template <typename T, typename KV, int DQK, int DV, int BC, int ST>
__device__ __forceinline__ void fa90_producer_paged(const CUtensorMap* tq, unsigned char* qs, unsigned char* ks,
                                                 unsigned char* vs, unsigned long long* q_full,
                                                 unsigned long long* full, unsigned long long* empty,
                                                 const Fa90Paged& pg, int b, int h, int kvh, int q_row0, int q0,
                                                 int n_k, int kt0, int kt1) {
    // K's and V's boxes (PkAttnBox: 64 columns, 128B swizzle; d96 32 columns, 64B swizzle): one box width for both,
    // since a thread's column piece (hoff) serves K and V
    using BX = PkAttnBox<DQK>;
    static_assert(BX::COLS == PkAttnBox<DV>::COLS, "the paged gather takes K and V in boxes of one width");
    constexpr int NBK = BX::BOXES, NBV = PkAttnBox<DV>::BOXES, PC = BX::ROW / 16;  // PC: 16-byte pieces a box row
    constexpr unsigned Q_BYTES = FA90_BR * DQK * 2, K_BYTES = BC * DQK * 2, V_BYTES = BC * DV * 2;
    const int tid = threadIdx.x;  // 0..127
    if (tid < 32 && pk_elect_one()) {
        pk_mbarrier_arrive_expect_tx(q_full, Q_BYTES);
        for (int nb = 0; nb < NBK; nb++)
            pk_tma_load_4d(qs + nb * FA90_BR * BX::ROW, tq, q_full, nb * BX::COLS, h, q_row0 + q0, 0);
    }
    const int* idx = pg.indices + pg.indptr[b];
    const long long hoff = (long long)kvh * pg.s_head + (tid % PC) * 8;  // this thread's 8 columns of a box row
    // DV != DQK (192 / 128): V pages hold DV columns a row, so their strides are V's own (an offset of its own a row)
    constexpr bool VOWN = DQK != DV;
    const KV* kb = static_cast<const KV*>(pg.kp) + hoff;
    const KV* vb = static_cast<const KV*>(pg.vp) + (VOWN ? (long long)kvh * pg.v_head + (tid % PC) * 8 : hoff);
    const int ps = pg.page_size;
    int i = 0;
    for (int j = kt1 - 1; j >= kt0; j--, i++) {
        const int s = i % ST;
        pk_mbarrier_wait_parity(empty - s, ((i / ST) & 1) ^ 1);
        if constexpr (Fa90PagedRegs<DQK>::LEAN) {  // K's and V's boxes of a row from one offset, one base
            static_assert(!VOWN && K_BYTES == V_BYTES, "the lean gather finds slot s's V tile ST K tiles on");
            static_assert(BX::COLS == 64, "the lean and staged gathers write 64-column boxes");
            if constexpr (sizeof(KV) == 2)
                fa90_gather_rows_lean<T, KV, NBK, BC>(ks + s * K_BYTES, ST * K_BYTES, pg, pg.indptr[b], kvh, j * BC,
                                                      n_k);
            else  // the staging buffer after the barriers' 1024 bytes (FA90_PAGED_FP8_STAGE bytes)
                fa90_gather_rows_staged<T, KV, NBK, BC>(ks + s * K_BYTES, ST * K_BYTES, vs + ST * V_BYTES + 1024, pg,
                                                        pg.indptr[b], kvh, j * BC, n_k);
        } else if constexpr (!VOWN) {  // K's and V's boxes of a row from one offset
            fa90_gather_rows<T, KV, BX, NBK, NBV, BC>(ks + s * K_BYTES, kb, vs + s * V_BYTES, vb, idx, ps,
                                                      pg.s_page, pg.s_tok, j * BC, n_k, tid);
        } else {  // a pass for K, then one for V at its own strides: a row holds one offset at a time
            fa90_gather_rows<T, KV, BX, NBK, 0, BC>(ks + s * K_BYTES, kb, nullptr, nullptr, idx, ps, pg.s_page,
                                                    pg.s_tok, j * BC, n_k, tid);
            fa90_gather_rows<T, KV, BX, NBV, 0, BC>(vs + s * V_BYTES, vb, nullptr, nullptr, idx, ps, pg.v_page,
                                                    pg.v_tok, j * BC, n_k, tid);
        }
        if constexpr (sizeof(KV) == 2) pk_cp_async_wait_all();  // (the staged FP8 gather waited for its own)
        pk_fence_proxy_async_shared();  // these generic-proxy writes before the consumers' wgmma (async proxy) reads
        pk_mbarrier_arrive(&full[s]);
    }
}

// The dense forward's work tile `tile` of n_bh * n_qt (n_bh = batch * n_heads): returns its (batch, head) index bh
// and sets its query tile qt. Without a window every tile has the same key tiles: bh-major, so that consecutive
// CTAs share a head's K / V in L2. With one (causal, sliding) tiles differ in work, and the order is longest first
// (FA3's SingleTileLPTScheduler): query-tile-major, the last query tiles first where the window ends at the
// diagonal (window_right < n_q: causal, whose last tiles see the most keys), the first ones first where only the
// left side is bounded. The launcher's persistent grid then walks them round by round, gridDim.x tiles a round in
// snake order (fa90_forward's producer): each CTA takes its long tiles first, and the short ones fill the tail.
__device__ __forceinline__ int fa90_dense_tile(int tile, int n_bh, int n_q, int n_k, int window_left, int window_right,
                                               int& qt) {
    const int n_qt = (n_q + FA90_BR - 1) / FA90_BR;
    if (window_left >= n_k && window_right >= n_q) {
        qt = tile % n_qt;
        return tile / n_qt;
    }
    const int qi = tile / n_bh;
    qt = window_right < n_q ? n_qt - 1 - qi : qi;
    return tile % n_bh;
}

// VARLEN: sequences packed without padding (flash_attention_varlen); the tensor maps have batch extent 1 over
// (1, total rows, heads, D), sequence b is q rows cu_q[b]..cu_q[b+1] against k / v rows cu_k[b]..cu_k[b+1] (a
// negative length counts as 0), grid (n_qt * n_heads, batch) as attention_fwd_varlen_tc (query tile
// blockIdx.x / n_heads of head blockIdx.x % n_heads; tiles past the sequence exit before any barrier), n_q / n_k
// are each sequence's. Only the coordinates differ from the dense kernel: the TMA row coordinates start at the
// sequence's first row (boxes that run past its end load the next sequence's rows: the key tile holding the
// sequence's last key is a masked tile, as the tile holding key n_k - 1 is in the dense kernel, and query rows
// past the end are not stored), and out / lse rows start at cu_q[b].
// DQK: head_dim of q and k (the S k-steps, Q and K boxes); DV: head_dim of v and out (V boxes, O accumulators);
// SC: softcap (fa90_cap; softcap > 0 then, and the scale's sign is free: the row max is taken on the capped scores).
// KV (void: the K / V tiles come by TMA through tk / tv): paged_prefill_attention, VARLEN's queries against the
// paged cache pg of element type KV (T, or an FP8 tag widened to T), gathered by fa90_producer_paged; n_k per
// sequence from the page table; v_scale (FP8's; scale holds k_scale) multiplies the output.
// to: the dense form's tensor map over out (its TMA-store epilogue; out unused there); VARLEN stores through out.
template <typename T, int DQK, int DV, bool SC, bool VARLEN, typename KV = void>
__device__ __forceinline__ void fa90_forward(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                                             const CUtensorMap* to, T* __restrict__ out, float* __restrict__ lse,
                                             const int* __restrict__ cu_q, const int* __restrict__ cu_k, int batch,
                                             int n_q, int n_k, int n_heads, int n_kv_heads, float scale,
                                             int window_left, int window_right, float softcap = 0.0f,
                                             const Fa90Paged* pg = nullptr, float v_scale = 1.0f) {
    using Cfg = Fa90Cfg<DQK, DV>;
    constexpr bool PAGED = !Fa90Same<KV, void>::V;
    static_assert(!PAGED || VARLEN, "the paged forward reads packed queries (qo_indptr)");
    // Boxes of Q / K (QB) and of V / O (VB): PkAttnBox (64 columns, 128B swizzle; d96: 32 columns, 64B swizzle).
    using QB = PkAttnBox<DQK>;
    using VB = PkAttnBox<DV>;
    constexpr int BC = Cfg::BC, ST = Cfg::STAGES, NBK = QB::BOXES, NBV = VB::BOXES;
    constexpr bool QREG = Cfg::QREG;
    static_assert(!QREG || QB::COLS == 64, "QREG reads Q's 128B-swizzled boxes");
    constexpr bool PP = Cfg::PP;
    constexpr unsigned Q_BYTES = FA90_BR * DQK * 2, K_BYTES = BC * DQK * 2, V_BYTES = BC * DV * 2;
    extern __shared__ __align__(1024) unsigned char fa90_smem[];
    unsigned char* qs = fa90_smem;
    unsigned char* ks = qs + Q_BYTES;                // [ST][NBK][BC][QB::ROW B]
    unsigned char* vs = ks + ST * K_BYTES;           // [ST][NBV][BC][VB::ROW B]
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(vs + ST * V_BYTES);
    // q_full, full[0..ST), then the empty mbarriers in reverse slot order (slot s at empty - s), so that the steady
    // loop finds the previous slot's empty mbarrier at a fixed distance from the next slot's full one.
    unsigned long long *q_full = bars, *full = bars + 1, *empty = bars + 2 * ST;
    // q_empty: the consumers (256 arrivals) are done with the work tile's Q (after its epilogue): the producer may
    // load the next work tile's Q there.
    unsigned long long* q_empty = bars + 2 * ST + 1;
    // The dense producer publishes each work tile's index and turn here with its Q (then an index past the last
    // tile: no more work),
    // ordered by q_full; the consumers read them at the tile's start and again for its epilogue, so that no
    // per-tile value stays live through their loops (kept live, they took the uniform registers the hot loop's
    // descriptors live in: 373 instructions a d128 tile instead of 306).
    volatile int* tile_info = reinterpret_cast<volatile int*>(bars + 2 * ST + 2);

    const int tid = threadIdx.x, wg = tid / 128;
    // (sequence, head, query tile) of the work tile; q_row0 / k_row0: the sequence's first row in the tensor maps
    // (map batch coordinate mb). VARLEN: this CTA's one tile. Dense: the CTA walks work tiles blockIdx.x, then one
    // a round of gridDim.x in snake order, of n_tiles (fa90_dense_tile: longest first where the mask makes tiles
    // unequal), so a grid of one CTA a tile runs each once and a persistent grid (about one CTA a SM) walks several.
    int b, h, qt, q_row0, k_row0, mb;
    if constexpr (VARLEN) {
        b = blockIdx.y, h = (int)(blockIdx.x % n_heads);
        q_row0 = cu_q[b], mb = 0;
        n_q = max(cu_q[b + 1] - q_row0, 0);
        if constexpr (PAGED) {
            k_row0 = 0, n_k = fa90_paged_len(*pg, b);
        } else {
            k_row0 = cu_k[b], n_k = max(cu_k[b + 1] - k_row0, 0);
        }
        const int n_qt = (n_q + FA90_BR - 1) / FA90_BR, it = (int)(blockIdx.x / n_heads);
        if (it >= n_qt) return;  // CTA-uniform, before any barrier
        qt = window_right < n_q ? n_qt - 1 - it : it;  // causal: the longest query tiles first
    } else {
        q_row0 = k_row0 = 0;
    }
    // The dense work tiles (VARLEN: this CTA's one), computed where used: kept from here, the producer's 24
    // registers spilled them.
    const auto n_tiles = [&]() { return VARLEN ? 1 : batch * n_heads * ((n_q + FA90_BR - 1) / FA90_BR); };
    // The dense work tile `tile`'s coordinates (VARLEN: this CTA's, set above).
    const auto place = [&](int tile) {
        if constexpr (!VARLEN) {
            const int bh = fa90_dense_tile(tile, batch * n_heads, n_q, n_k, window_left, window_right, qt);
            b = bh / n_heads, h = bh % n_heads, mb = b;
        }
    };
    // The work tile's kv head, first query and key tiles: [kt0, kt1) visited from kt1 - 1 down; [f0, f1) seen
    // wholly by every row (the steady state).
    int kvh, q0, kt0, kt1, f0, f1;
    const auto span_of = [&]() {
        kvh = h / (n_heads / n_kv_heads);
        q0 = qt * FA90_BR;
        const int q_last = min(q0 + FA90_BR, n_q) - 1;
        const PkAttnSpan span = pk_attn_q_span(q0, q_last, n_q, n_k, window_left, window_right);
        kt0 = span.lo / BC, kt1 = span.hi < span.lo ? kt0 : span.hi / BC + 1;
        f0 = (span.full_lo + BC - 1) / BC, f1 = (span.full_hi + 1) / BC;
        f0 = max(f0, kt0), f1 = min(f1, kt1);
        if (f0 >= f1) f0 = f1 = kt1;  // no full tile: everything runs masked
    };

    if (tid == 0) {
        pk_mbarrier_init(q_full, 1);
        // full: the TMA producer's one arrival with the bytes, or the paged producer's 128 threads' arrivals.
        for (int s = 0; s < ST; s++) pk_mbarrier_init(&full[s], PAGED ? 128 : 1), pk_mbarrier_init(empty - s, 256);
        pk_mbarrier_init(q_empty, 256);
        pk_fence_mbarrier_init();
    }
    __syncthreads();

    if constexpr (PAGED) {
        if (wg == 0) {  // ---- the paged producer ----
            pk_setmaxnreg_dec<Fa90PagedRegs<DQK>::PRODUCER>();
            span_of();  // VARLEN: one work tile
            fa90_producer_paged<T, KV, DQK, DV, BC, ST>(tq, qs, ks, vs, q_full, full, empty, *pg, b, h, kvh, q_row0, q0,
                                                        n_k, kt0, kt1);
            return;
        }
    }
    if (wg == 0) {  // ---- producer ----
        pk_setmaxnreg_dec<24>();
        // Warp 0 runs the loop (its values warp-uniform, in uniform registers: the 24 registers left to the
        // producer did not hold the tile loop's), one elected lane issues. The ring position i carries from one
        // work tile to the next (slot i % ST, phase (i / ST) & 1), as the consumers' does; Q waits for the
        // consumers to release the previous tile's (q_empty, phase n & 1).
        if (__shfl_sync(PK_FULL_MASK, tid / 32, 0) == 0) {
            const bool leader = pk_elect_one();
            int i = 0;
            for (int tile = blockIdx.x, n = 0;;) {
                place(tile);
                span_of();
                // Q goes after the tile's first K / V load (or alone where it has none): that load waits only for
                // the previous tile's consumption of its slot, and it is under way while Q waits for q_empty.
                int q_todo = 1;
                const auto load_q = [&]() {
                    // the leader waits and the warp follows it: a lane that reached the wait only after the
                    // consumers had also released this Q would wait for a phase that never completes
                    if (leader) pk_mbarrier_wait_parity(q_empty, (n & 1) ^ 1);
                    __syncwarp();
                    if (leader) {
                        tile_info[0] = tile, tile_info[1] = n;
                        pk_mbarrier_arrive_expect_tx(q_full, Q_BYTES);
                        for (int nb = 0; nb < NBK; nb++)
                            pk_tma_load_4d(qs + nb * FA90_BR * QB::ROW, tq, q_full, nb * QB::COLS, h, q_row0 + q0,
                                           mb);
                    }
                    q_todo = 0;
                };
                for (int j = kt1 - 1; j >= kt0; j--, i++) {
                    const int s = i % ST;
                    if (leader) pk_mbarrier_wait_parity(empty - s, ((i / ST) & 1) ^ 1);  // as load_q's
                    __syncwarp();
                    if (leader) {
                        pk_mbarrier_arrive_expect_tx(&full[s], K_BYTES + V_BYTES);
                        constexpr int KR = BC * QB::ROW, VR = BC * VB::ROW;  // bytes a K / V box
                        if constexpr (NBK == NBV) {
                            for (int nb = 0; nb < NBK; nb++) {
                                pk_tma_load_4d(ks + s * K_BYTES + nb * KR, tk, &full[s], nb * QB::COLS, kvh, k_row0 + j * BC, mb);
                                pk_tma_load_4d(vs + s * V_BYTES + nb * VR, tv, &full[s], nb * VB::COLS, kvh, k_row0 + j * BC, mb);
                            }
                        } else {
                            for (int nb = 0; nb < NBK; nb++)
                                pk_tma_load_4d(ks + s * K_BYTES + nb * KR, tk, &full[s], nb * QB::COLS, kvh, k_row0 + j * BC, mb);
                            for (int nb = 0; nb < NBV; nb++)
                                pk_tma_load_4d(vs + s * V_BYTES + nb * VR, tv, &full[s], nb * VB::COLS, kvh, k_row0 + j * BC, mb);
                        }
                    }
                    if (q_todo) load_q();
                }
                if (q_todo) load_q();
                if (VARLEN || !Cfg::PERSIST) break;
                // Turn n + 1 takes tile (n + 1) * gridDim.x + blockIdx.x, or gridDim.x - 1 - blockIdx.x on odd turns
                // (a snake over the longest-first order: the CTA that took the shortest tile of a round takes the
                // longest of the next, which evens out the CTAs' sums as the block scheduler's greedy choice would).
                n++;
                tile = n * (int)gridDim.x + (n & 1 ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x);
                if (tile >= n_tiles()) {  // the consumers' turn n tells them there is no more work
                    if (leader) {
                        pk_mbarrier_wait_parity(q_empty, (n & 1) ^ 1);
                        tile_info[0] = tile, pk_mbarrier_arrive(q_full);
                    }
                    break;
                }
            }
        }
        return;
    }

    // ---- consumers ----
    pk_setmaxnreg_inc<PAGED ? (int)Fa90PagedRegs<DQK>::CONSUMER : 240>();
    const int c = wg - 1, lane = tid % 32, wq = (tid / 32) % 4, g = lane / 4, t = lane % 4;
    // Base 2: s * sl2 (SC: the capped scores tanh(scale * q.k / c) times c * log2 e; pre = scale / c).
    const float sl2 = (SC ? softcap : scale) * 1.4426950408889634f;
    const float pre = SC ? scale / softcap : 0.0f;
    // Descriptors: K-major, the boxes' swizzle (SBO = one 8-row group: 1024 bytes, d96 512) for Q and K; V MN-major
    // (LBO = one box, the next 64 (d96: 32) head-dim columns; SBO = the next 8 keys).
    const unsigned long long dq = pk_wgmma_desc(qs + c * 64 * QB::ROW, 16, 8 * QB::ROW, QB::SWIZZLE);
    const unsigned long long dk0 = pk_wgmma_desc(ks, 16, 8 * QB::ROW, QB::SWIZZLE);
    const unsigned long long dv0 = pk_wgmma_desc(vs, BC * VB::ROW, 8 * VB::ROW, VB::SWIZZLE);
    unsigned i = 0;  // key tiles visited, over all work tiles (slot i % ST, phase (i / ST) & 1): the producer's count
    // The work tiles of this CTA, as the producer publishes them (tile_info); n: the Q tile's phase. The body of
    // this loop keeps the indentation it had as the CTA's one tile.
    for (int n = 0;; n++) {
    pk_mbarrier_wait_parity(q_full, n & 1);
    if constexpr (!VARLEN) {
        const int tile = tile_info[0];
        if (tile >= n_tiles()) break;
        place(tile);
    }
    span_of();
    i = (__all_sync(PK_FULL_MASK, i & 1) ? 1u : 0u) | (__all_sync(PK_FULL_MASK, i & 2) ? 2u : 0u);
    float o[DV / 2];
#pragma unroll
    for (int i = 0; i < DV / 2; i++) o[i] = 0.0f;
    float m[2] = {PK_NEG_INF, PK_NEG_INF}, l[2] = {0.0f, 0.0f};  // rows g and g + 8 of the warp
    const int row0 = q0 + 64 * c + 16 * wq + g;
    int rlo[2], rhi[2];
    pk_attn_q_rows(row0, n_q, n_k, window_left, window_right, rlo, rhi);
    // QREG: this warp's 16 Q rows as the A fragments of the S k-steps (rows g, g + 8; columns 2t and 2t + 8 of
    // each 16), read once from the swizzled Q boxes: byte (row, col) of a [BR][64] box is row * 128 + 2 col with
    // the 16-byte unit XORed by row % 8.
    unsigned qa[DQK / 16][4];
    if constexpr (QREG) {
#pragma unroll
        for (int ks = 0; ks < DQK / 16; ks++)
#pragma unroll
            for (int v = 0; v < 4; v++) {
                const unsigned row = 64 * c + 16 * wq + g + 8 * (v & 1), col = (ks % 4) * 16 + 8 * (v >> 1) + 2 * t;
                qa[ks][v] = *reinterpret_cast<const unsigned*>(
                    qs + (ks / 4) * FA90_BR * 128 + pk_swizzle_offset(row * 128 + col * 2, PK_SWIZZLE_128B));
            }
    }

    int j = kt1 - 1;
    for (; j >= f1; j--, i++) {
        const unsigned st = i % ST;
        fa90_tile_masked<T, DQK, DV, BC, QREG, SC>(o, m, l, qa, dq, pk_wgmma_desc_advance(dk0, st * K_BYTES),
                                                   pk_wgmma_desc_advance(dv0, st * V_BYTES), &full[st], empty - st,
                                                   (i / ST) & 1, sl2, pre, j * BC, rlo, rhi, t);
    }
    if (j >= f0) {  // the steady state: no mask, the lazy softmax
        // Each step issues O += P V of the previous tile and S of the next one as one wgmma group, then the lazy
        // softmax of the next tile (fa90_step). The first steady tile is peeled off. A warp whose lazy softmax
        // fails leaves the hot loop for the exact redo (fa90_redo) and comes back to the same wgmma instructions
        // as the other warps of its warpgroup. PAIR (d64, d256): the hot loop runs two steps an iteration, A into
        // slot 0 and B into slot 1 (a next tile of odd index runs one step alone first), so each step's K / V
        // descriptors and mbarriers are loop invariants, A and B share the parity (flipped once an iteration), and
        // the counter, its compare and the loop branch are paid once per two tiles; after a failed A the pair's
        // B step runs out of line, and an odd tile left over runs one A step after the loop. Since wgmma is
        // .sync.aligned over the warpgroup, the A check is the warpgroup's (fa90_softmax_lazy's WG: a failure in
        // any warp sends all four to the redo and the out-of-line B together); B's check and the others stay the
        // warp's (a failed warp redoes alone and comes back to the loop's own wgmmas). Otherwise (d128,
        // where the pair's extra invariants push the Q descriptors out of the uniform registers) one step an
        // iteration, the slots alternating.
        static_assert(ST == 2, "the steady-state loop alternates the two ring slots");
        float s[BC / 2];
        unsigned pa[BC / 16][4];
        const unsigned sa = i % ST;
        fa90_scores<T, DQK, BC, QREG>(s, qa, dq, pk_wgmma_desc_advance(dk0, sa * K_BYTES), &full[sa], (i / ST) & 1);
        fa90_cap<SC, BC>(s, pre);
        // The paged d64 softcap kernel (232 consumer registers) takes this tile's exact softmax at once: its lazy
        // try keeps the scores beside P for the redo, and with the ping-pong that spilled a score (4 bytes). Once a
        // work tile; the first steady tile's lazy try mostly fails anyway when no masked tile set m before it.
        if ((PAGED && SC && QREG) || !fa90_softmax_lazy<T, DV, BC>(s, m, l, pa, sl2))
            fa90_softmax_exact<T, DV, BC>(s, o, m, l, pa, sl2);
        i++;
        const unsigned i_end = i + (unsigned)(j - f0);  // one past the last tile
        // Consumer 1 gives consumer 0 the first turn of the ping-pong (fa90_step), where steps follow.
        if (PP && c == 1 && i != i_end) pk_bar_arrive_aligned(FA90_BAR_PP, 256);
        if constexpr (!Cfg::PAIR) {
            // One step an iteration: the two ring slots alternate; the step's K and V descriptors come from the
            // next slot nb by one wide multiply-add each (K at dk0 + nb * KU, V at dv1 - nb * VU), the full
            // mbarrier is full + nb and the previous slot's empty one two further (empty - (nb ^ 1) = full + nb +
            // 2); ph: the next tile's parity.
            constexpr int KU = K_BYTES / 16, VU = V_BYTES / 16;
            const unsigned long long dv1 = pk_wgmma_desc_advance(dv0, V_BYTES);
            unsigned nb = sa ^ 1;
            unsigned ph = (i / ST) & 1;
            if (i != i_end) {
                bool ok, last;
                for (;;) {
                    for (;;) {  // the hot loop
                        ok = fa90_step<T, DQK, DV, BC, QREG, SC, PP>(o, pa, s, qa, m, l, dq,
                                                                     dk0 + (unsigned long long)nb * KU,
                                                                     dv1 + (long long)(int)nb * -VU, full + nb, ph,
                                                                     sl2, pre);
                        i++;
                        ph ^= ~i & 1;
                        nb ^= 1;
                        last = i == i_end;
                        if (!ok || last) break;
                    }
                    if (!ok) fa90_redo<T, DQK, DV, BC, SC>(s, o, m, l, pa, sl2, pre, qs, ks + (nb ^ 1) * K_BYTES);
                    if (last) break;
                }
                // Consumer 0 takes consumer 1's last hand-over (its opening arrival left one more than consumer 0
                // waits for), so both named barriers are back at zero arrivals for the next work tile.
                if (PP && c == 0) pk_bar_sync_aligned(FA90_BAR_PP, 256);
            }
            // The last tile's O += P V (its slot is nb ^ 1 now).
            fa90_pv<T, DV, BC>(o, pa, dv1 + (long long)(int)nb * -VU, full + nb + 2);
        } else {
            // Pairs start at an even tile (the same parity for both steps of a pair): an odd next tile runs one step
            // first (into slot 1). OVE: whether these edge steps overlap (Fa90OvlEdge).
            constexpr bool OVE = Fa90OvlEdge<DQK, DV, SC>::V;
            constexpr int FXE = Fa90FexEdge<DQK, DV, SC>::V;
            const bool stepped = i != i_end;  // steps follow (PP: consumer 1 opened the game above)
            if ((i & 1) && i != i_end) {
                if (!fa90_step<T, DQK, DV, BC, QREG, SC, PP, false, OVE, FXE>(o, pa, s, qa, m, l, dq,
                                                                         pk_wgmma_desc_advance(dk0, K_BYTES), dv0,
                                                                         full + 1, (i / ST) & 1, sl2, pre))
                    fa90_redo<T, DQK, DV, BC, SC, OVE>(s, o, m, l, pa, sl2, pre, qs, ks + K_BYTES);
                i++;
            }
            // Step A into slot a = i % 2 (0 whenever a step follows: i is odd here only when i == i_end): K of slot
            // a, V of the previous tile in slot a ^ 1, full[a] and the previous slot's empty mbarrier two further
            // (empty - (a ^ 1) = full + a + 2); step B the other way round. The parity of tiles i and i + 1 (i even):
            // (i / 2) & 1. The steps' mbarriers are full[0] and full[1] as literal slots (addresses an immediate
            // off the shared base: with full + a, the persistent tile loop's d64 steps computed them again each
            // pair); the descriptors keep the slot a value the compiler does not know (see the tried-and-dropped
            // note: with literal slots ptxas split each descriptor add in three).
            const unsigned a = i & 1;
            constexpr unsigned KU = K_BYTES / 16, VU = V_BYTES / 16;  // a slot, in descriptor units
            const unsigned long long dka = dk0 + (unsigned long long)a * KU, dkb = dk0 + (unsigned long long)(a ^ 1) * KU;
            const unsigned long long dva = dv0 + (unsigned long long)(a ^ 1) * VU, dvb = dv0 + (unsigned long long)a * VU;
            unsigned long long *fba = full, *fbb = full + 1;
            unsigned ph = (i / ST) & 1;
            unsigned rem = i_end - i;  // tiles left
            // This consumer warpgroup's named barrier (fa90_softmax_lazy's WG): 1 + c = wg, from threadIdx.x by one
            // shift where the loop has no register to keep it in (d256).
            const unsigned bar = threadIdx.x / 128;
            for (;;) {
                if (rem < 2) break;
                for (;;) {  // the hot loop: two tiles
                    if (!fa90_step<T, DQK, DV, BC, QREG, SC, PP, true>(o, pa, s, qa, m, l, dq, dka, dva, fba, ph, sl2,
                                                                       pre, bar))
                        goto redo_a;
                    const bool okb = fa90_step<T, DQK, DV, BC, QREG, SC, PP>(o, pa, s, qa, m, l, dq, dkb, dvb, fbb, ph,
                                                                             sl2, pre);
                    rem -= 2;
                    ph ^= 1;
                    if (!okb) goto redo_b;
                    if (rem < 2) goto hot_done;
                }
            redo_a:  // A failed: its redo, then the pair's B step out of line
                fa90_redo<T, DQK, DV, BC, SC>(s, o, m, l, pa, sl2, pre, qs, ks + a * K_BYTES);
                {
                    constexpr bool OVO = Fa90OvlOut<DQK, DV, SC>::V;
                    const bool okb = fa90_step<T, DQK, DV, BC, QREG, SC, PP, false, OVO, FXE>(
                        o, pa, s, qa, m, l, dq, dkb, dvb, fbb, ph, sl2, pre);
                    rem -= 2;
                    ph ^= 1;
                    if (okb) continue;
                    if constexpr (OVO != (bool)Fa90Ovl<DQK, DV, SC>::V) {  // its redo from s as OVO left it
                        fa90_redo<T, DQK, DV, BC, SC, OVO>(s, o, m, l, pa, sl2, pre, qs, ks + (a ^ 1) * K_BYTES);
                        continue;
                    }
                }
            redo_b:
                fa90_redo<T, DQK, DV, BC, SC>(s, o, m, l, pa, sl2, pre, qs, ks + (a ^ 1) * K_BYTES);
            }
        hot_done:
            // An odd tile left over: one A step (slot a).
            if (rem) {
                if (!fa90_step<T, DQK, DV, BC, QREG, SC, PP, false, OVE, FXE>(o, pa, s, qa, m, l, dq, dka, dva, fba, ph,
                                                                         sl2, pre))
                    fa90_redo<T, DQK, DV, BC, SC, OVE>(s, o, m, l, pa, sl2, pre, qs, ks + a * K_BYTES);
            }
            // Consumer 0 takes consumer 1's last hand-over, as in the one-step loop above.
            if (PP && c == 0 && stepped) pk_bar_sync_aligned(FA90_BAR_PP, 256);
            // The last tile's O += P V: after the odd tile left over (slot a) or a B step (slot a ^ 1; or the first
            // steady tile, in slot a ^ 1 too when nothing followed).
            if (rem) {
                fa90_pv<T, DV, BC>(o, pa, dvb, empty - a);
            } else {
                fa90_pv<T, DV, BC>(o, pa, dva, empty - (a ^ 1));
            }
            i = i_end;  // the trailing masked tiles go on from here
        }
        j = f0 - 1;
    }
    // The trailing masked tiles' lane column t: the d64 softcap varlen / paged kernels compute it again (opaque, as
    // row_e below), kept live through the loops it spilled a word (paged).
    const int t_e = SC && VARLEN && QREG ? (int)(pk_opaque_u32(threadIdx.x) % 4) : t;
    for (; j >= kt0; j--, i++) {
        const unsigned st = i % ST;
        fa90_tile_masked<T, DQK, DV, BC, QREG, SC>(o, m, l, qa, dq, pk_wgmma_desc_advance(dk0, st * K_BYTES),
                                                   pk_wgmma_desc_advance(dv0, st * V_BYTES), &full[st], empty - st,
                                                   (i / ST) & 1, sl2, pre, j * BC, rlo, rhi, t_e);
    }

    if constexpr (!VARLEN) {  // the tile's coordinates again (tile_info holds them until q_empty completes)
        place(tile_info[0]);
        n = tile_info[1];
        q0 = qt * FA90_BR;
    }
    // The sequence's first row of out / lse (read again here rather than kept live through the loops).
    const long long o_row0 = VARLEN ? (long long)cu_q[blockIdx.y] : (long long)b * n_q;
    // SC, VARLEN and QREG (d64: Q in registers): pre holds one more register through the loops, and this kernel
    // then spilled row0; the first row of this lane is computed again here instead (from threadIdx.x, opaque so that
    // the compiler does not keep row0 live through the loops anyway). Not elsewhere: the dense d256 softcap kernel
    // spilled with it, and the varlen d256 one's loop grew by 2 instructions. The lane's g as well (tx_e % 32 / 4):
    // kept live, it and row0's parts spilled 8 bytes (varlen) with two exp2 n-tiles in four on the FMA pipe.
    const unsigned tx_e = pk_opaque_u32(threadIdx.x);
    const int row_e = SC && VARLEN && QREG ? q0 + 16 * ((int)(tx_e / 32) - 4) + (int)(tx_e % 32) / 4 : row0;
    const auto lse_at = [&](int row) { return lse + (o_row0 + row) * n_heads + h; };
    // The epilogue (FA3's): this consumer's 64 rows of O, normalised and rounded to T, go into its own 64 rows of
    // the Q tile (free: its S wgmmas have all completed, and the other consumer's rows are not touched), in the
    // q / out tensor maps' box layout ([DV / 64][rows][128 B], 128B swizzle: the 16-byte unit XORed by row % 8 = g, so
    // the 8 rows x 4 lanes of one 4-byte store land in 32 distinct banks). out's column 8 jj + 2 t of a row is byte
    // 16 (jj % 8) + 4 t of box jj / 8. Rows past n_q are not written. The lane's row of the Q tile (16 (warp - 4) +
    // g; 64 c + its row in the consumer's 64) and its warpgroup from threadIdx.x again, opaque: kept live through the
    // loops instead, the d64 and d256 softcap kernels had no register for them there (4 to 8 bytes spilled, the d64
    // softcap loop 14 instructions longer).
    const unsigned tx = pk_opaque_u32(threadIdx.x), qrow = 16 * (tx / 32 - 4) + (tx % 32) / 4;
    pk_attn_epilogue(  // m is in raw score units: sl2 = scale * log2 e brings it into log2 units
        l, m, sl2, v_scale, row_e, n_q,
        [&](int r, int, float inv) {
            pk_attn_stage_o_row<T, DV, VB::COLS>(qs, FA90_BR * VB::ROW, (qrow + 8 * r) * VB::ROW + 4 * (tx % 4), o, r,
                                                 inv);
        },
        lse_at);
    // Dense: the TMA (async proxy) reads these generic-proxy writes.
    if constexpr (!VARLEN) pk_fence_proxy_async_shared();
    pk_bar_sync_aligned(tx / 128, 128);  // the warpgroup's rows are all written (barrier 1 + c: the WG vote's)
    const int r0 = 64 * (int)(tx / 128 - 1);  // the consumer's first row of the tile
    if constexpr (VARLEN) {
        // A TMA store box would run past the sequence's end into the next sequence's rows of out (the map's rows
        // end at the packed total, not at n_q), so the warpgroup's 128 threads store the rows with 16-byte stores
        // instead (FA3 keeps its TMA store to the fixed-length case too), rows past n_q skipped.
        const long long o_stride = (long long)n_heads * DV;  // out (total_q, n_heads, DV), 64-bit offsets
        pk_attn_store_staged_o<T, DV, VB::COLS>(qs, FA90_BR * VB::ROW, r0,
                                                out + (o_row0 + q0 + r0) * o_stride + (long long)h * DV, o_stride,
                                                n_q - (q0 + r0), tx % 128);
    } else {
        // The TMA-store epilogue: one thread stores the DV / 64 boxes (1, 64, 1, 64) of out; rows past n_q are left
        // as they are in shared memory: the TMA clips them (the map's rows end at n_q).
        if (tx % 128 == 0) {
#pragma unroll
            for (int nb = 0; nb < NBV; nb++)
                pk_tma_store_4d(to, qs + nb * FA90_BR * VB::ROW + r0 * VB::ROW, nb * VB::COLS, h, q0 + r0, mb);
            pk_tma_store_commit();
            // The TMA has read the rows before this thread's q_empty arrival below, after which the producer may
            // load the next work tile's Q into the same bytes.
            pk_tma_store_wait_read<0>();
        }
    }
    pk_mbarrier_arrive(q_empty);  // done with this work tile's Q: the producer may load the next one's
    if (VARLEN || !Cfg::PERSIST) break;
    }
}

// Entry points: attention_fwd_sm90_d<shape>[_softcap] and attention_fwd_varlen_sm90_d<shape>[_softcap], <shape> 64 /
// 96 / 128 / 256 (head_dim == head_dim_v) or 192_dv128 (head_dim 192, head_dim_v 128: DeepSeek-V3's prefill shape,
// dense and varlen), in bf16 and f16. The _softcap kernels take the softcap as one more, last, parameter.
#define FA90_ENTRY(NAME, DQK, DV, SC)                                                                                \
    template <typename T, typename... A>                                                                             \
    __device__ __forceinline__ void attention_fwd_sm90_d##NAME##_impl(const CUtensorMap& tq, const CUtensorMap& tk,  \
                                                                     const CUtensorMap& tv, const CUtensorMap& to,   \
                                                                     float* lse, A... a) {                           \
        fa90_forward<T, DQK, DV, SC, false>(&tq, &tk, &tv, &to, nullptr, lse, nullptr, nullptr, a...);               \
    }
#define FA90_VARLEN_ENTRY(NAME, DQK, DV, SC)                                                                       \
    template <typename T, typename... A>                                                                             \
    __device__ __forceinline__ void attention_fwd_varlen_sm90_d##NAME##_impl(                                        \
        const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, T* out, float* lse, const int* cu_q,    \
        const int* cu_k, int n_heads, int n_kv_heads, float scale, int window_left, int window_right, A... cap) {    \
        fa90_forward<T, DQK, DV, SC, true>(&tq, &tk, &tv, nullptr, out, lse, cu_q, cu_k, 0, 0, 0, n_heads,           \
                                           n_kv_heads, scale, window_left, window_right, cap...);                    \
    }
// The head dims, which both forms offer (X(NAME, DQK, DV, SC) each).
#define FA90_DIMS(X)                                                                                              \
    X(64, 64, 64, false) X(128, 128, 128, false) X(256, 256, 256, false) X(64_softcap, 64, 64, true)               \
    X(128_softcap, 128, 128, true) X(256_softcap, 256, 256, true) X(192_dv128, 192, 128, false)                    \
    X(192_dv128_softcap, 192, 128, true) X(96, 96, 96, false) X(96_softcap, 96, 96, true)
FA90_DIMS(FA90_ENTRY)
FA90_DIMS(FA90_VARLEN_ENTRY)

// flash_attention (bf16 / f16): tensor maps over q (batch, n_q, n_heads, DQK) with box (1, BR, 1, X), k / v
// (batch, n_k, n_kv_heads, DQK / DV) with box (1, BC, 1, X) and out (batch, n_q, n_heads, DV) with box (1, 64, 1,
// X) (the epilogue's TMA stores; X: PkAttnBox's columns, 64 or at d96 32), lse (batch, n_q, n_heads); the window normalized as flash_attention does; grid
// batch * n_heads * query tiles.
#define FA90_DENSE_PARAMS                                                                                           \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,                                \
     const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap to, float* __restrict__ lse,       \
     int batch, int n_q, int n_k, int n_heads, int n_kv_heads, float scale, int window_left, int window_right)
#define FA90_DENSE_ARGS (tq, tk, tv, to, lse, batch, n_q, n_k, n_heads, n_kv_heads, scale, window_left, window_right)
#define FA90_DENSE_SC_PARAMS                                                                                        \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,                                \
     const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap to, float* __restrict__ lse,       \
     int batch, int n_q, int n_k, int n_heads, int n_kv_heads, float scale, int window_left, int window_right,       \
     float softcap)
#define FA90_DENSE_SC_ARGS \
    (tq, tk, tv, to, lse, batch, n_q, n_k, n_heads, n_kv_heads, scale, window_left, window_right, softcap)
PK_IO16_KERNELS(attention_fwd_sm90_d64, (FA90_THREADS, 1), FA90_DENSE_PARAMS, FA90_DENSE_ARGS)
PK_IO16_KERNELS(attention_fwd_sm90_d128, (FA90_THREADS, 1), FA90_DENSE_PARAMS, FA90_DENSE_ARGS)
PK_IO16_KERNELS(attention_fwd_sm90_d256, (FA90_THREADS, 1), FA90_DENSE_PARAMS, FA90_DENSE_ARGS)
PK_IO16_KERNELS(attention_fwd_sm90_d192_dv128, (FA90_THREADS, 1), FA90_DENSE_PARAMS, FA90_DENSE_ARGS)
PK_IO16_KERNELS(attention_fwd_sm90_d64_softcap, (FA90_THREADS, 1), FA90_DENSE_SC_PARAMS, FA90_DENSE_SC_ARGS)
PK_IO16_KERNELS(attention_fwd_sm90_d128_softcap, (FA90_THREADS, 1), FA90_DENSE_SC_PARAMS, FA90_DENSE_SC_ARGS)
PK_IO16_KERNELS(attention_fwd_sm90_d256_softcap, (FA90_THREADS, 1), FA90_DENSE_SC_PARAMS, FA90_DENSE_SC_ARGS)
PK_IO16_KERNELS(attention_fwd_sm90_d192_dv128_softcap, (FA90_THREADS, 1), FA90_DENSE_SC_PARAMS, FA90_DENSE_SC_ARGS)
PK_IO16_KERNELS(attention_fwd_sm90_d96, (FA90_THREADS, 1), FA90_DENSE_PARAMS, FA90_DENSE_ARGS)
PK_IO16_KERNELS(attention_fwd_sm90_d96_softcap, (FA90_THREADS, 1), FA90_DENSE_SC_PARAMS, FA90_DENSE_SC_ARGS)

// flash_attention_varlen (bf16 / f16): tensor maps over the packed q / k (1, total_q / total_k, heads, DQK) and v
// (1, total_k, n_kv_heads, DV) with the dense boxes, out (total_q, n_heads, DV), lse (total_q, n_heads), the window
// normalized per sequence as the serving ops do (unbounded = 2^30, causal: window_right = 0); grid
// (n_qt * n_heads, batch), n_qt the query tiles of the longest sequence.
#define FA90_VARLEN_PARAMS                                                                                          \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,                                \
     const __grid_constant__ CUtensorMap tv, T* __restrict__ out, float* __restrict__ lse,                          \
     const int* __restrict__ cu_q, const int* __restrict__ cu_k, int n_heads, int n_kv_heads, float scale,          \
     int window_left, int window_right)
#define FA90_VARLEN_ARGS (tq, tk, tv, out, lse, cu_q, cu_k, n_heads, n_kv_heads, scale, window_left, window_right)
#define FA90_VARLEN_SC_PARAMS                                                                                       \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,                                \
     const __grid_constant__ CUtensorMap tv, T* __restrict__ out, float* __restrict__ lse,                          \
     const int* __restrict__ cu_q, const int* __restrict__ cu_k, int n_heads, int n_kv_heads, float scale,          \
     int window_left, int window_right, float softcap)
#define FA90_VARLEN_SC_ARGS \
    (tq, tk, tv, out, lse, cu_q, cu_k, n_heads, n_kv_heads, scale, window_left, window_right, softcap)
PK_IO16_KERNELS(attention_fwd_varlen_sm90_d64, (FA90_THREADS, 1), FA90_VARLEN_PARAMS, FA90_VARLEN_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_sm90_d128, (FA90_THREADS, 1), FA90_VARLEN_PARAMS, FA90_VARLEN_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_sm90_d256, (FA90_THREADS, 1), FA90_VARLEN_PARAMS, FA90_VARLEN_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_sm90_d64_softcap, (FA90_THREADS, 1), FA90_VARLEN_SC_PARAMS, FA90_VARLEN_SC_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_sm90_d128_softcap, (FA90_THREADS, 1), FA90_VARLEN_SC_PARAMS, FA90_VARLEN_SC_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_sm90_d256_softcap, (FA90_THREADS, 1), FA90_VARLEN_SC_PARAMS, FA90_VARLEN_SC_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_sm90_d192_dv128, (FA90_THREADS, 1), FA90_VARLEN_PARAMS, FA90_VARLEN_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_sm90_d192_dv128_softcap, (FA90_THREADS, 1), FA90_VARLEN_SC_PARAMS,
                FA90_VARLEN_SC_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_sm90_d96, (FA90_THREADS, 1), FA90_VARLEN_PARAMS, FA90_VARLEN_ARGS)
PK_IO16_KERNELS(attention_fwd_varlen_sm90_d96_softcap, (FA90_THREADS, 1), FA90_VARLEN_SC_PARAMS, FA90_VARLEN_SC_ARGS)

// paged_prefill_attention (bf16 / f16 queries): paged_prefill_sm90_d{64,96,128,256}[_softcap]_{bf16,f16} and
// paged_prefill_sm90_d192_dv128[_softcap]_{bf16,f16} over a cache of the query type, ..._{bf16,f16}_{e4m3,e5m2}kv over
// an FP8 cache (widened to the query type by the producer). tq: a tensor map over the packed q (1, total_q, n_heads,
// DQK) with the dense box; out (total_q, n_heads, DV), lse (total_q, n_heads); the page table as paged_prefill_tc
// (element strides s_page / s_tok / s_head, any page_size); the d192_dv128 kernels take V's own strides v_page /
// v_tok / v_head after them (V pages of 128 columns beside K pages of 192); scale holds k_scale, v_scale multiplies
// the output; the window normalized per sequence as the serving ops do. Grid (n_qt * n_heads, batch) as the varlen
// kernel.
#define FA90_PAGED_ENTRY(NAME, DQK, DV, SC)                                                                        \
    template <typename T, typename KV = T, typename KS, typename... A>                                             \
    __device__ __forceinline__ void paged_prefill_sm90_d##NAME##_impl(                                             \
        const CUtensorMap& tq, const KS* kp, const KS* vp, T* out, float* lse, const int* qo_indptr,               \
        const int* kv_indptr, const int* kv_indices, const int* kv_last, int n_heads, int n_kv_heads, int page_size, \
        long long s_page, long long s_tok, long long s_head, float scale, int window_left, int window_right,       \
        float v_scale, A... cap) {                                                                                 \
        const Fa90Paged pg{kp, vp, kv_indptr, kv_indices, kv_last, page_size, s_page, s_tok, s_head,              \
                           s_page, s_tok, s_head};                                                                 \
        fa90_forward<T, DQK, DV, SC, true, KV>(&tq, nullptr, nullptr, nullptr, out, lse, qo_indptr, nullptr, 0, 0,  \
                                               0, n_heads, n_kv_heads, scale, window_left, window_right,           \
                                               fa90_cap_arg(cap...), &pg, v_scale);                                \
    }
// The same with V's strides of its own (head_dim_v != head_dim: 192 / 128).
#define FA90_PAGED_DV_ENTRY(NAME, DQK, DV, SC)                                                                     \
    template <typename T, typename KV = T, typename KS, typename... A>                                             \
    __device__ __forceinline__ void paged_prefill_sm90_d##NAME##_impl(                                             \
        const CUtensorMap& tq, const KS* kp, const KS* vp, T* out, float* lse, const int* qo_indptr,               \
        const int* kv_indptr, const int* kv_indices, const int* kv_last, int n_heads, int n_kv_heads, int page_size, \
        long long s_page, long long s_tok, long long s_head, long long v_page, long long v_tok, long long v_head,  \
        float scale, int window_left, int window_right, float v_scale, A... cap) {                                 \
        const Fa90Paged pg{kp, vp, kv_indptr, kv_indices, kv_last, page_size, s_page, s_tok, s_head,              \
                           v_page, v_tok, v_head};                                                                 \
        fa90_forward<T, DQK, DV, SC, true, KV>(&tq, nullptr, nullptr, nullptr, out, lse, qo_indptr, nullptr, 0, 0,  \
                                               0, n_heads, n_kv_heads, scale, window_left, window_right,           \
                                               fa90_cap_arg(cap...), &pg, v_scale);                                \
    }
FA90_PAGED_ENTRY(64, 64, 64, false)
FA90_PAGED_ENTRY(128, 128, 128, false)
FA90_PAGED_ENTRY(64_softcap, 64, 64, true)
FA90_PAGED_ENTRY(128_softcap, 128, 128, true)
FA90_PAGED_ENTRY(256, 256, 256, false)
FA90_PAGED_ENTRY(256_softcap, 256, 256, true)
FA90_PAGED_ENTRY(96, 96, 96, false)
FA90_PAGED_ENTRY(96_softcap, 96, 96, true)
FA90_PAGED_DV_ENTRY(192_dv128, 192, 128, false)
FA90_PAGED_DV_ENTRY(192_dv128_softcap, 192, 128, true)
#define FA90_PAGED_PARAMS                                                                                           \
    (const __grid_constant__ CUtensorMap tq, const TKS* __restrict__ kp, const TKS* __restrict__ vp,                 \
     T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ qo_indptr,                               \
     const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices, const int* __restrict__ kv_last,        \
     int n_heads, int n_kv_heads, int page_size, long long s_page, long long s_tok, long long s_head, float scale,  \
     int window_left, int window_right, float v_scale)
#define FA90_PAGED_ARGS                                                                                             \
    (tq, kp, vp, out, lse, qo_indptr, kv_indptr, kv_indices, kv_last, n_heads, n_kv_heads, page_size, s_page, s_tok, \
     s_head, scale, window_left, window_right, v_scale)
#define FA90_PAGED_SC_PARAMS                                                                                        \
    (const __grid_constant__ CUtensorMap tq, const TKS* __restrict__ kp, const TKS* __restrict__ vp,                 \
     T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ qo_indptr,                               \
     const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices, const int* __restrict__ kv_last,        \
     int n_heads, int n_kv_heads, int page_size, long long s_page, long long s_tok, long long s_head, float scale,  \
     int window_left, int window_right, float v_scale, float softcap)
#define FA90_PAGED_SC_ARGS                                                                                          \
    (tq, kp, vp, out, lse, qo_indptr, kv_indptr, kv_indices, kv_last, n_heads, n_kv_heads, page_size, s_page, s_tok, \
     s_head, scale, window_left, window_right, v_scale, softcap)
#define FA90_PAGED_DV_PARAMS                                                                                        \
    (const __grid_constant__ CUtensorMap tq, const TKS* __restrict__ kp, const TKS* __restrict__ vp,                 \
     T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ qo_indptr,                               \
     const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices, const int* __restrict__ kv_last,        \
     int n_heads, int n_kv_heads, int page_size, long long s_page, long long s_tok, long long s_head,               \
     long long v_page, long long v_tok, long long v_head, float scale, int window_left, int window_right,           \
     float v_scale)
#define FA90_PAGED_DV_ARGS                                                                                          \
    (tq, kp, vp, out, lse, qo_indptr, kv_indptr, kv_indices, kv_last, n_heads, n_kv_heads, page_size, s_page, s_tok, \
     s_head, v_page, v_tok, v_head, scale, window_left, window_right, v_scale)
#define FA90_PAGED_DV_SC_PARAMS                                                                                     \
    (const __grid_constant__ CUtensorMap tq, const TKS* __restrict__ kp, const TKS* __restrict__ vp,                 \
     T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ qo_indptr,                               \
     const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices, const int* __restrict__ kv_last,        \
     int n_heads, int n_kv_heads, int page_size, long long s_page, long long s_tok, long long s_head,               \
     long long v_page, long long v_tok, long long v_head, float scale, int window_left, int window_right,           \
     float v_scale, float softcap)
#define FA90_PAGED_DV_SC_ARGS                                                                                       \
    (tq, kp, vp, out, lse, qo_indptr, kv_indptr, kv_indices, kv_last, n_heads, n_kv_heads, page_size, s_page, s_tok, \
     s_head, v_page, v_tok, v_head, scale, window_left, window_right, v_scale, softcap)
PK_IO16_KERNELS(paged_prefill_sm90_d64, (FA90_THREADS, 1), FA90_PAGED_PARAMS, FA90_PAGED_ARGS)
PK_IO16_KERNELS(paged_prefill_sm90_d128, (FA90_THREADS, 1), FA90_PAGED_PARAMS, FA90_PAGED_ARGS)
PK_IO16_KERNELS(paged_prefill_sm90_d64_softcap, (FA90_THREADS, 1), FA90_PAGED_SC_PARAMS, FA90_PAGED_SC_ARGS)
PK_IO16_KERNELS(paged_prefill_sm90_d128_softcap, (FA90_THREADS, 1), FA90_PAGED_SC_PARAMS, FA90_PAGED_SC_ARGS)
PK_IO16_KERNELS(paged_prefill_sm90_d256, (FA90_THREADS, 1), FA90_PAGED_PARAMS, FA90_PAGED_ARGS)
PK_IO16_KERNELS(paged_prefill_sm90_d256_softcap, (FA90_THREADS, 1), FA90_PAGED_SC_PARAMS, FA90_PAGED_SC_ARGS)
PK_IO16_KERNELS(paged_prefill_sm90_d192_dv128, (FA90_THREADS, 1), FA90_PAGED_DV_PARAMS, FA90_PAGED_DV_ARGS)
PK_IO16_KERNELS(paged_prefill_sm90_d192_dv128_softcap, (FA90_THREADS, 1), FA90_PAGED_DV_SC_PARAMS, FA90_PAGED_DV_SC_ARGS)
// d96: 32-column boxes, 64B swizzle (the gather writes PkAttnBox<96>'s layout)
PK_IO16_KERNELS(paged_prefill_sm90_d96, (FA90_THREADS, 1), FA90_PAGED_PARAMS, FA90_PAGED_ARGS)
PK_IO16_KERNELS(paged_prefill_sm90_d96_softcap, (FA90_THREADS, 1), FA90_PAGED_SC_PARAMS, FA90_PAGED_SC_ARGS)
PK_FP8KV16_KERNELS(paged_prefill_sm90_d64, (FA90_THREADS, 1), FA90_PAGED_PARAMS, FA90_PAGED_ARGS)
PK_FP8KV16_KERNELS(paged_prefill_sm90_d128, (FA90_THREADS, 1), FA90_PAGED_PARAMS, FA90_PAGED_ARGS)
PK_FP8KV16_KERNELS(paged_prefill_sm90_d64_softcap, (FA90_THREADS, 1), FA90_PAGED_SC_PARAMS, FA90_PAGED_SC_ARGS)
PK_FP8KV16_KERNELS(paged_prefill_sm90_d128_softcap, (FA90_THREADS, 1), FA90_PAGED_SC_PARAMS, FA90_PAGED_SC_ARGS)
PK_FP8KV16_KERNELS(paged_prefill_sm90_d256, (FA90_THREADS, 1), FA90_PAGED_PARAMS, FA90_PAGED_ARGS)
PK_FP8KV16_KERNELS(paged_prefill_sm90_d256_softcap, (FA90_THREADS, 1), FA90_PAGED_SC_PARAMS, FA90_PAGED_SC_ARGS)
PK_FP8KV16_KERNELS(paged_prefill_sm90_d192_dv128, (FA90_THREADS, 1), FA90_PAGED_DV_PARAMS, FA90_PAGED_DV_ARGS)
PK_FP8KV16_KERNELS(paged_prefill_sm90_d192_dv128_softcap, (FA90_THREADS, 1), FA90_PAGED_DV_SC_PARAMS, FA90_PAGED_DV_SC_ARGS)
PK_FP8KV16_KERNELS(paged_prefill_sm90_d96, (FA90_THREADS, 1), FA90_PAGED_PARAMS, FA90_PAGED_ARGS)
PK_FP8KV16_KERNELS(paged_prefill_sm90_d96_softcap, (FA90_THREADS, 1), FA90_PAGED_SC_PARAMS, FA90_PAGED_SC_ARGS)
