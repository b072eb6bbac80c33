// pykern: arch sm_90a
// Hopper (sm_90a) attention backward on wgmma, bf16 and f16 (template over T), head_dim 64, 96, 128, 192 / 128
// and 256 (dQ: 32-key streamed tiles; dK / dV: 64-key CTAs, the head dim split across the consumers,
// AB90_DKDV_SPLIT): the same
// gradients, window / causal mask, GQA mapping and conventions as attention_bwd_tc.cu, given lse (natural log,
// per (batch, query, head)) and delta = rowsum(dO * O) from the op's pre-pass.
// Deterministic: every output element has one writer and a fixed summation order (no atomics).
// Template parameters beside T and D:
//   SC (the _softcap kernels, softcap c their last parameter): the scores are c * tanh(scale * s / c), so
//     P = exp2(t * c * log2 e - lse * log2 e) with t = tanh(s * scale / c) recomputed from the S accumulator
//     (tanh.approx, never stored), and dS gains the tanh's derivative: dS = P (dP - delta) (1 - t^2) (the scale
//     is applied once at the end, as without softcap), as attention_bwd_tc.cu's _softcap kernels.
//   VL (attention_bwd_varlen_sm90_*, flash_attention_varlen_backward): packed sequences, flash-attn's layout.
//     The grid is the dense one at the longest lengths (n_q / n_k are max_seqlen_q / _k); a prologue reads
//     sequence b's first rows and lengths from cu_seqlens_q / cu_seqlens_k and clamps the window sides to them
//     (as attention_bwd_tc.cu's VL); a CTA past its sequence's last key (dkdv) / query (dq) exits before any
//     barrier; a sequence with keys but no queries gets its zero dK / dV written. The tensor maps cover the
//     packed rows as one batch (1, total rows, heads, D): the TMA row coordinate starts at the sequence's first
//     row, so a box that runs past the sequence's end loads the next sequence's rows (zeros past the last
//     row). Such rows contribute nothing: keys past n_k are masked in the dq kernel (the tile holding key
//     n_k - 1 is a masked tile, as in the dense kernel) and have rows of their own, never stored, in the dkdv
//     kernel; queries past n_q read lse = +inf (P = 0, hence dS = 0) and are not stored.
//
// Two kernels, each a CTA of 3 warpgroups in the FlashAttention-3 manner: warpgroup 0 is the producer (one
// elected thread issues TMA loads into a 2-stage ring guarded by full / empty mbarriers, setmaxnreg.dec),
// warpgroups 1 and 2 consume (setmaxnreg.inc), each owning 64 rows of the CTA's 128 (the d256 dkdv kernel: both own
// the CTA's 64 keys, each half of the head dim, AB90_DKDV_SPLIT).
//   dkdv: the CTA owns 128 keys of one (batch, kv head) (K, V loaded once), and walks every query head of
//     the GQA group and every C-query tile (C = 64, 32 at d128) that sees its keys (Q, dO streamed). Per
//     tile, consumer c:
//       S^T = K Q^T, dP^T = V dO^T (wgmma SS, m64nCk16), P^T = exp2(S^T * scale * log2 e - lse * log2 e),
//       dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q (wgmma RS: P^T / dS^T from registers, dO / Q
//       MN-major from shared memory); dK is scaled once at the end.
//   dq: the CTA owns 128 queries of one (batch, head) and walks the 64-key tiles (32 at d256) they see (K, V streamed):
//       S = Q K^T, dP = dO V^T (SS), P, dS as above, dQ += dS K (RS, K MN-major); dQ scaled at the end.
// Layouts as attention_fwd_sm90.cu: tiles of [rows][64] boxes of 128-byte rows, 128B swizzle.
#include "pk_common.cuh"
#include "pk_ptx.cuh"
#include "pk_attn_window.cuh"
#include "pk_attn_tc.cuh"  // pk_attn_key_rows

#define AB90_ROWS 128   // keys (dkdv) / queries (dq) per CTA
// keys per streamed tile (dq): 32 at d256, where the resident Q and dO take 128 KiB of shared memory and dQ 128
// accumulator registers a thread
#define AB90_DQ_STEP(D) ((D) >= 256 ? 32 : 64)
// queries per streamed tile (dkdv): 32 where dK and dV take 96 accumulator registers a thread or more (d96, d128:
// 96, 128) and at d256 (AB90_DKDV_SPLIT: 128, and neither consumer holds both S^T and dP^T); 16 at 192 / 128,
// where they take 160 (with 32 queries a tile ptxas spills 32 bytes there: the S^T / dP^T accumulators, P^T / dS^T
// fragments and the tile's lse / delta take 64 registers at 32 queries, 32 at 16)
#define AB90_DKDV_STEP(D, DV) ((D) + (DV) >= 512 ? 32 : (D) + (DV) >= 320 ? 16 : (D) + (DV) >= 192 ? 32 : 64)
// d256 (dkdv): the head dim split across the consumers. dK and dV for 64 keys x 256 dims would take 256 accumulator
// registers a thread, so the CTA owns 64 keys (AB90_DKDV_ROWS), consumer 0 computes S^T and turns it into P^T,
// consumer 1 computes dP^T and turns it into dP^T - delta (64 keys x C queries each, the full head dim's k-steps),
// they swap the two through shared memory (AB90_XCH_BYTES), and consumer c accumulates dK and dV's head-dim columns
// 128c.. (64 + 64 registers), so no product is computed twice and neither consumer holds both products (nor the
// tile's lse and delta both): tiles of 32 queries (AB90_DKDV_STEP). (When each consumer formed P^T and dS^T from
// both raw products, 32 queries spilled 16 bytes and the tile was 16.)
#define AB90_DKDV_SPLIT(D, DV) ((D) + (DV) >= 512)
#define AB90_DKDV_ROWS(D, DV) (AB90_DKDV_SPLIT(D, DV) ? 64 : AB90_ROWS)
// the fused kernel's dQ leaves a tile at a time (FlashAttention-3's path): the consumers store their dQ^T
// fragments as the accumulator's rows into a shared fp32 tile (C queries x D, the accumulator's contiguous run of
// those queries; at d256 two runs, one a head-dim half) and one thread adds it with one bulk reduce-add
// (pk_bulk_reduce_add_f32) a run. Two tiles (double-buffered) below d256; one at d256 (the split), where a second
// 32 KiB tile would take the shared memory past 227 KiB (217 KiB with one)
#define AB90_DQ_BUFS(D, DV) (AB90_DKDV_SPLIT(D, DV) ? 1 : 2)
// the swap buffers: 2 (tile parity) x 3 slots (P^T, dP^T - delta, and with softcap P^T (1 - t^2); one size for
// both) x C / 2 floats x 128 threads
#define AB90_XCH_BYTES(C) (2 * 3 * ((C) / 2) * 128 * 4)
// Head-dim columns per TMA box and wgmma swizzle atom row: PkAttnBox (pk_attn_tc.cuh, the forward's too): 64
// (128-byte rows, 128B swizzle) where D is a multiple of 64, else 32 (64-byte rows, 64B swizzle): d96 is three
// 32-column boxes, as FA3 lays out head_dim 96 (the largest swizzle whose row divides the head dim's bytes), so one
// tensor map per array serves every box.
#define AB90_STAGES 2
#define AB90_THREADS 384
// Dynamic shared bytes, head dims D (q, k) and DV (v, dO); each kernel static_asserts its carve-up against its
// macro, and the op's shared_mem mirrors them (pykern/ops/_attention_sm90.py: bwd_shared_bytes,
// bwd_dkdv_shared_bytes, bwd_fused_shared_bytes; tests/test_attention_sm90.py compares them).
// dq (AB90_ROWS queries resident, C keys a streamed tile): the resident pair, the ring of pairs, the mbarriers
#define AB90_SMEM_BYTES(D, DV, C) (AB90_ROWS * ((D) + (DV)) * 2 + AB90_STAGES * (C) * ((D) + (DV)) * 2 + 1024)
// dK/dV, DQA 0 (dkdv) or > 0 (fused, D == DV): R = AB90_DKDV_ROWS keys resident, C = AB90_DKDV_STEP queries a
// streamed tile: the resident pair, the ring of pairs, the fused kernels' two dS buffers of R keys x C queries and
// their AB90_DQ_BUFS fp32 dQ tiles of C queries x D (the bulk reduce-adds' sources), the split's swap buffers
// (AB90_XCH_BYTES), the mbarriers. The fused kernels: d64 (R 128, C 64) 132096 bytes, d96 (128, 32) 115712, d128
// (128, 32) 148480, d256 (the split: 64, 32, one dQ tile) 222208.
#define AB90_DKDV_SMEM_BYTES(D, DV, DQA)                                                                             \
    (AB90_DKDV_ROWS(D, DV) * ((D) + (DV)) * 2 + AB90_STAGES * AB90_DKDV_STEP(D, DV) * ((D) + (DV)) * 2 +            \
     ((DQA) ? 2 * AB90_DKDV_ROWS(D, DV) * AB90_DKDV_STEP(D, DV) * 2 : 0) +                                          \
     ((DQA) ? AB90_DQ_BUFS(D, DV) * AB90_DKDV_STEP(D, DV) * (D) * 4 : 0) +                                          \
     (AB90_DKDV_SPLIT(D, DV) ? AB90_XCH_BYTES(AB90_DKDV_STEP(D, DV)) : 0) + 1024)

template <typename T> struct Ab90Dt;
template <> struct Ab90Dt<__nv_bfloat16> { enum { V = PK_WGMMA_BF16 }; };
template <> struct Ab90Dt<__half> { enum { V = PK_WGMMA_F16 }; };
template <bool B> struct Ab90Bool { static constexpr bool value = B; };  // a compile-time flag for a generic lambda

// X = A1 B1^T (K = D1) and Y = A2 B2^T (K = D2) for one consumer warpgroup: 64 rows x STEP columns each. A from
// the resident tiles (AROWS rows per box), B from a streamed tile (STEP rows per box); boxes of
// PkAttnBox<D>::COLS columns (rows of PkAttnBox<D>::ROW bytes), a k-step 32 bytes further inside a box row.
template <int DT, int D1, int D2, int AROWS, int C>
__device__ __forceinline__ void ab90_two_products(float (&x)[C / 2], float (&y)[C / 2],
                                                  unsigned long long a1, unsigned long long b1,
                                                  unsigned long long a2, unsigned long long b2) {
    constexpr int KB1 = PkAttnBox<D1>::KSTEPS, RB1 = PkAttnBox<D1>::ROW, KB2 = PkAttnBox<D2>::KSTEPS,
                  RB2 = PkAttnBox<D2>::ROW;
    pk_wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D1 / 16; ks++) {
        const unsigned ao = (ks / KB1) * AROWS * RB1 + (ks % KB1) * 32, bo = (ks / KB1) * C * RB1 + (ks % KB1) * 32;
        pk_wgmma_m64nNk16_ss<C, DT>(x, pk_wgmma_desc_advance(a1, ao), pk_wgmma_desc_advance(b1, bo), ks > 0);
    }
#pragma unroll
    for (int ks = 0; ks < D2 / 16; ks++) {
        const unsigned ao = (ks / KB2) * AROWS * RB2 + (ks % KB2) * 32, bo = (ks / KB2) * C * RB2 + (ks % KB2) * 32;
        pk_wgmma_m64nNk16_ss<C, DT>(y, pk_wgmma_desc_advance(a2, ao), pk_wgmma_desc_advance(b2, bo), ks > 0);
    }
    pk_wgmma_commit();
    pk_wgmma_wait<0>();
}

// ------------------------------------------------------------------------------------------------ dK, dV
// DQA (dense and VL, with or without SC): 0 no dQ (the dq kernel computes it); 1 the fused kernel, which also
// adds dQ's partial dS K of every query tile it visits into dq_acc (fp32 (batch, head, nq_pad, D), zeroed by the
// op's pre-pass; VL: (head, nq_pad, D) over the packed rows, a token's row at its packed index, nq_pad >= total_q
// + C; a sequence's rows past its end take zero adds)
// a tile at a time, as bulk reduce-adds from a shared fp32 tile (AB90_DQ_BUFS) that the producer warpgroup's warp 1
// issues; 2 the same in a fixed order: a query tile's partials are added in key-tile order,
// key tile kt waiting until the tile's semaphore (dq_sem, int (batch, head, query tile of C)) counts the key
// tiles before it that see the tile, then adding one (the producer warpgroup's warp 1 does both, between named
// barriers 1 and 2 with the consumers, so its polling overlaps their S / dP / dS work). With DQA > 0, lse (already
// times log2 e) and delta come from the pre-pass as (batch, head, nq_pad) runs (attention_bwd_tc_prep's layout;
// VL: the packed rows as one batch, read a query at a time, +inf past the sequence's n_q). VL semaphores: per
// (sequence, head, query tile of max_seqlen_q).
//   Per tile, after dS^T: each consumer stores its 64 keys of dS (as [query][key] rows, the B operand's
//   K-major 128B-swizzled layout; two buffers, so one barrier per tile orders the writes and the other
//   consumer's reads of the tile before), then computes dQ^T (64 head-dim rows x 32 queries) = K^T dS^T over
//   the CTA's 128 keys (wgmma SS, K MN-major as A): consumer c takes head-dim rows 64c.. at d128 (C = 32) and
//   queries 32c.. at d64 (C = 64).
// A backward CTA's key tile and the query tiles it walks (ab90_dkdv, ab90_fused_kt). DQA 2 with a bounded right
// side (causal, windows): key tile kt first meets query tiles that the key tiles above it met earlier in their
// walks, so a query tile's adds go in descending key-tile order (desc), and the CTAs of a (batch, kv head) launch
// in that order too (a CTA only ever waits for CTAs launched before it). sem_tiles: query tiles per (batch or
// sequence, head) in the semaphore array, at the grid's n_q (VL: max_seqlen_q). q_row0 / k_row0 / mb: the TMA
// coordinates' row origin and batch of the sequence (VL: the packed rows as one batch; n_q, n_k and the window
// then clamped to the sequence). False where the key tile lies past the sequence's end: CTA-uniform, so the
// caller returns before any barrier.
struct Ab90KeyTile {
    bool desc;
    int kt, b, kvh, group, k0, sem_tiles, q_row0, k_row0, mb, qt0, qt1, steps;
    PkAttnSpan span;
};
template <int R, int C, int DQA, bool VL>
__device__ __forceinline__ bool ab90_key_tile(Ab90KeyTile& t, int& n_q, int& n_k, int& window_left,
                                              int& window_right, int n_heads, int n_kv_heads,
                                              const int* __restrict__ cu_q, const int* __restrict__ cu_k) {
    const int n_kt = (n_k + R - 1) / R;
    t.desc = DQA == 2 && window_right < n_q;
    const int bkv = blockIdx.x / n_kt;
    t.kt = t.desc ? n_kt - 1 - (int)(blockIdx.x % n_kt) : blockIdx.x % n_kt;
    t.b = bkv / n_kv_heads, t.kvh = bkv % n_kv_heads, t.group = n_heads / n_kv_heads;
    t.k0 = t.kt * R;
    t.sem_tiles = (n_q + C - 1) / C;
    t.q_row0 = 0, t.k_row0 = 0, t.mb = t.b;
    if constexpr (VL) {
        t.q_row0 = cu_q[t.b], t.k_row0 = cu_k[t.b], t.mb = 0;
        n_q = max(cu_q[t.b + 1] - t.q_row0, 0), n_k = max(cu_k[t.b + 1] - t.k_row0, 0);
        if (t.k0 >= n_k) return false;
        window_left = min(window_left, n_k), window_right = min(window_right, n_q);
    }
    const int k_last = min(t.k0 + R, n_k) - 1;
    t.span = pk_attn_k_span(t.k0, k_last, n_q, n_k, window_left, window_right);
    t.qt0 = t.span.lo / C, t.qt1 = t.span.hi < t.span.lo ? t.qt0 : t.span.hi / C + 1;
    t.steps = (t.qt1 - t.qt0) * t.group;
    return true;
}

template <typename T, int D, int DV, bool SC, bool VL, int DQA = 0>
__device__ __forceinline__ void ab90_dkdv(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                                          const CUtensorMap* tdo, const float* __restrict__ lse,
                                          const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                                          const int* __restrict__ cu_q, const int* __restrict__ cu_k, int batch,
                                          int n_q, int n_k, int n_heads, int n_kv_heads, float scale,
                                          int window_left, int window_right, float softcap = 0.0f,
                                          float* __restrict__ dq_acc = nullptr, int* __restrict__ dq_sem = nullptr,
                                          int nq_pad = 0) {
    // D: head_dim of q and k (S^T's k-steps, dK); DV: of v and dO (dP^T's k-steps, dV). Boxes of BQ / BV columns,
    // rows of RQ / RV bytes (PkAttnBox); NB / NBV boxes a tile.
    constexpr int DT = Ab90Dt<T>::V, BQ = PkAttnBox<D>::COLS, BV = PkAttnBox<DV>::COLS, NB = D / BQ, NBV = DV / BV;
    constexpr int RQ = 2 * BQ, RV = 2 * BV, R = AB90_DKDV_ROWS(D, DV), C = AB90_DKDV_STEP(D, DV), ST = AB90_STAGES;
    // SPL (AB90_DKDV_SPLIT): both consumers own the CTA's 64 keys, consumer c dK / dV's head-dim columns c * DKN.. /
    // c * DVN..; else consumer c owns keys 64c.. and every column
    constexpr bool SPL = AB90_DKDV_SPLIT(D, DV);
    constexpr int DKN = SPL ? D / 2 : D, DVN = SPL ? DV / 2 : DV;
    static_assert(!SPL || (D == DV && NB % 2 == 0), "the split: D == DV, whole boxes a half");
    constexpr unsigned K_BYTES = R * D * 2, V_BYTES = R * DV * 2, STEP_BYTES = C * D * 2, DO_STEP_BYTES = C * DV * 2;
    static_assert(DQA == 0 || (D == DV && ((BQ == 64 && (SPL ? R == 64 && NB == 4 : NB * C == 64)) ||
                                           (BQ == 32 && NB == 3 && C == 32))),
                  "the fused dQ: D == DV, two consumers x 32 queries or 64 dims (d96: 64 dims from 32-column boxes), "
                  "or (the split) 128 dims");
    constexpr unsigned DS_BYTES = R * C * 2;  // one dS buffer: [R / 64 boxes of 64 keys][C queries][128 B]
    extern __shared__ __align__(1024) unsigned char ab90_smem[];
    unsigned char* ks = ab90_smem;
    unsigned char* vs = ks + K_BYTES;
    unsigned char* qs = vs + V_BYTES;                // [ST][NB][C][RQ]
    unsigned char* dos = qs + ST * STEP_BYTES;       // [ST][NBV][C][RV]
    unsigned char* dss = dos + ST * DO_STEP_BYTES;   // DQA: [2][R / 64 boxes][C][128 B]
    // DQA: the dQ tiles (fp32 [NDQ][C][D], the accumulator's rows; SPL: [1][2 halves][C][128]), the bulk
    // reduce-adds' sources; DW: the accumulator's row (SPL: a half's), HALVES: its runs a head
    constexpr bool BULK = DQA > 0;
    constexpr int NDQ = AB90_DQ_BUFS(D, DV), DW = SPL ? D / 2 : D, HALVES = SPL ? 2 : 1;
    constexpr unsigned DQ_TILE = C * D;  // floats
    float* dqb = reinterpret_cast<float*>(dss + (DQA ? 2 * DS_BYTES : 0));
    float* xch = dqb + (BULK ? NDQ * DQ_TILE : 0);  // SPL: [2][3][C / 2][128]
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(reinterpret_cast<unsigned char*>(xch) +
                                                                     (SPL ? AB90_XCH_BYTES(C) : 0));
    unsigned long long *kv_full = bars, *full = bars + 1, *empty = bars + 1 + ST;
    static_assert(K_BYTES + V_BYTES + ST * (STEP_BYTES + DO_STEP_BYTES) + (DQA ? 2 * DS_BYTES : 0) +
                          (BULK ? NDQ * DQ_TILE * 4 : 0) + (SPL ? AB90_XCH_BYTES(C) : 0) + 1024 ==
                              AB90_DKDV_SMEM_BYTES(D, DV, DQA) &&
                      (1 + 2 * ST) * 8 <= 1024,
                  "the carve-up above is the op's shared_mem (AB90_DKDV_SMEM_BYTES)");

    const int tid = threadIdx.x, wg = tid / 128;
    Ab90KeyTile ktile;
    if (!ab90_key_tile<R, C, DQA, VL>(ktile, n_q, n_k, window_left, window_right, n_heads, n_kv_heads, cu_q, cu_k))
        return;
    (void)batch;
    const bool desc = ktile.desc;
    const int kt = ktile.kt, b = ktile.b, kvh = ktile.kvh, group = ktile.group, k0 = ktile.k0;
    const int sem_tiles = ktile.sem_tiles, q_row0 = ktile.q_row0, k_row0 = ktile.k_row0, mb = ktile.mb;
    const int qt0 = ktile.qt0, qt1 = ktile.qt1, steps = ktile.steps;
    const PkAttnSpan span = ktile.span;

    pk_ring_init<ST>(kv_full, full, empty, 256);

    if (wg == 0) {  // ---- producer ----
        pk_setmaxnreg_dec<24>();
        if (tid < 32 && pk_elect_one()) {
            pk_mbarrier_arrive_expect_tx(kv_full, K_BYTES + V_BYTES);
            for (int nb = 0; nb < NB; nb++) pk_tma_load_4d(ks + nb * R * RQ, tk, kv_full, nb * BQ, kvh, k_row0 + k0, mb);
            for (int nb = 0; nb < NBV; nb++) pk_tma_load_4d(vs + nb * R * RV, tv, kv_full, nb * BV, kvh, k_row0 + k0, mb);
            for (int i = 0; i < steps; i++) {
                const int s = i % ST, h = kvh * group + i / (qt1 - qt0), q0 = (qt0 + i % (qt1 - qt0)) * C;
                pk_mbarrier_wait_parity(&empty[s], ((i / ST) & 1) ^ 1);
                pk_mbarrier_arrive_expect_tx(&full[s], STEP_BYTES + DO_STEP_BYTES);
                for (int nb = 0; nb < NB; nb++)
                    pk_tma_load_4d(qs + s * STEP_BYTES + nb * C * RQ, tq, &full[s], nb * BQ, h, q_row0 + q0, mb);
                for (int nb = 0; nb < NBV; nb++)
                    pk_tma_load_4d(dos + s * DO_STEP_BYTES + nb * C * RV, tdo, &full[s], nb * BV, h, q_row0 + q0, mb);
            }
        }
        if constexpr (DQA > 0) {
            // warp 1: dQ's bulk reduce-adds (and, DQA 2, the semaphores). Per tile it arrives on named barrier 1,
            // where the consumers wait before their dQ wgmma, and waits on barrier 2, where they arrive after
            // storing (and fencing) the tile's dQ into shared tile i % NDQ; then lane 0 adds that tile into the
            // accumulator's run(s) with one bulk reduce-add a run. Before its arrival on barrier 1, lane 0 waits
            // until the op that last read the buffer the consumers are about to rewrite has read it
            // (wait_group.read NDQ - 1: two tiles back, double-buffered; at d256, one buffer, the previous tile's
            // op), which a tile of S / dP / dS work after its issue rarely costs a wait. So the consumers spend no
            // instruction on issuing it but a barrier arrival.
            // DQA 2: before its arrival on barrier 1 lane 0 also waits (ld.acquire) until the query tile's count
            // reaches this key tile's order (it polls while the consumers compute S, dP and dS, so a predecessor
            // that is done costs no wait), and after the bulk op it waits for the op's completion (wait_group 0,
            // not .read: the sums, not only the source read) and releases the count (red.release, cumulative), so
            // the next key tile's adds land on these.
            // The tiles' (head, query tile) walk goes by counters, not a division a tile: this warp runs on the
            // producer's 24 registers, and at d256 the division's temporaries made ptxas spill one.
            if (tid / 32 == 1) {
                // head kvh * group's semaphores and accumulator run(s)
                int* sem_h = DQA == 2 ? dq_sem + ((long long)b * n_heads + kvh * group) * sem_tiles : nullptr;
                float* acc_h = dq_acc + (((long long)(VL ? 0 : b) * n_heads + kvh * group) * HALVES * nq_pad + q_row0) * DW;
                for (int i = 0, qt = qt0; i < steps; i++) {
                    const int q0 = qt * C;
                    int* sem = sem_h + qt;
                    float* acc = acc_h + q0 * DW;
                    if (++qt == qt1) qt = qt0, sem_h += sem_tiles, acc_h += (long long)HALVES * nq_pad * DW;  // next head
                    if (tid == 32) {
                        pk_tma_store_wait_read<NDQ - 1>();
                        if constexpr (DQA == 2) {
                            // the key tiles that see this query tile are a run (band masks): those before kt in
                            // the order (ascending, or descending with desc) go first
                            const PkAttnSpan qsp = pk_attn_q_span(q0, min(q0 + C, n_q) - 1, n_q, n_k, window_left,
                                                                  window_right);
                            pk_sem_wait_eq(sem, desc ? qsp.hi / R - kt : kt - qsp.lo / R);
                        }
                    }
                    __syncwarp();
                    pk_bar_arrive(1, 288);
                    pk_bar_sync(2, 288);
                    if (tid == 32) {
#pragma unroll
                        for (int hf = 0; hf < HALVES; hf++)
                            pk_bulk_reduce_add_f32(acc + (long long)hf * nq_pad * DW,
                                                   dqb + (i % NDQ) * DQ_TILE + hf * C * DW, C * DW * 4);
                        pk_tma_store_commit();
                        if constexpr (DQA == 2) {
                            pk_tma_store_wait<0>();
                            pk_sem_add_release(sem, 1);
                        }
                    }
                }
                if (tid == 32) pk_tma_store_wait<0>();  // the shared tiles outlive their reads
            }
        }
        return;
    }

    // ---- consumers: rows = keys k0 + 64c + 16 wq + g (+ 8) (SPL: k0 + 16 wq + g (+ 8) in both) ----
    pk_setmaxnreg_inc<240>();
    // c through a lane-0 shuffle (as in ab90_dq): ptxas then knows it warp-uniform and keeps the K / V descriptors
    // (and the fused dQ^T's K^T one) and their k-step advances in uniform registers, not an R2UR pair and a 64-bit
    // add an HGMMA
    const int c = __shfl_sync(PK_FULL_MASK, wg, 0) - 1, lane = tid % 32, wq = (tid / 32) % 4, g = lane / 4,
              t = lane % 4;
    float dka[DKN / 2], dva[DVN / 2];
#pragma unroll
    for (int i = 0; i < DKN / 2; i++) dka[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < DVN / 2; i++) dva[i] = 0.0f;
    // base 2: P = 2^(x * sl2 - lse * log2 e), x the score (SC: t = tanh(s * pre), and sl2 carries c)
    const float sl2 = (SC ? softcap : scale) * 1.4426950408889634f;
    const float pre = SC ? scale / softcap : 0.0f;
    const long long q_base = q_row0;  // VL: the lse / delta row of the sequence's query 0 (dense: b * n_q inline)
    const int key0 = k0 + (SPL ? 0 : 64 * c) + 16 * wq + g;
    int qlo[2], qhi[2];  // queries that see this thread's two keys
    pk_attn_k_row(key0, n_q, n_k, window_left, window_right, qlo[0], qhi[0]);
    pk_attn_k_row(key0 + 8, n_q, n_k, window_left, window_right, qlo[1], qhi[1]);
    // K-major: 8-row groups SBO = 8 rows apart; MN-major: LBO = one box (C rows) to the next head-dim columns,
    // SBO = 8 rows (k) apart (pk_ptx.cuh's canonical layouts)
    constexpr int SWQ = PkAttnBox<D>::SWIZZLE, SWV = PkAttnBox<DV>::SWIZZLE;
    const unsigned long long dk_a = pk_wgmma_desc(ks + (SPL ? 0 : c * 64 * RQ), 16, 8 * RQ, SWQ);
    const unsigned long long dv_a = pk_wgmma_desc(vs + (SPL ? 0 : c * 64 * RV), 16, 8 * RV, SWV);
    // SPL: this consumer's dK / dV columns start at box c * NB / 2 / c * NBV / 2 of the streamed Q / dO tile
    const unsigned hq = SPL ? c * (NB / 2) * C * RQ : 0, hv = SPL ? c * (NBV / 2) * C * RV : 0;
    const unsigned long long dq_b = pk_wgmma_desc(qs, 16, 8 * RQ, SWQ);
    const unsigned long long ddo_b = pk_wgmma_desc(dos, 16, 8 * RV, SWV);
    const unsigned long long dq_t = pk_wgmma_desc(qs, C * RQ, 8 * RQ, SWQ);    // MN-major
    const unsigned long long ddo_t = pk_wgmma_desc(dos, C * RV, 8 * RV, SWV);  // MN-major
    const bool tail_keys = VL && DQA > 0 && k0 + R > n_k;
    // DQA: this thread's dS store offsets in a box (queries 2t + e, keys 16 wq + g + 8r), the 128B swizzle applied
    // once here: the swizzle of row 8j + 2t + e depends on the row mod 8 only, so the loop adds 1024 j
    unsigned ds_off[2][2];
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int e = 0; e < 2; e++)
            ds_off[r][e] = pk_swizzle_offset((2 * t + e) * 128 + (16 * wq + g + 8 * r) * 2, PK_SWIZZLE_128B);
    pk_mbarrier_wait_parity(kv_full, 0);

    // One streamed tile: ring slot s = i % ST, query head h, queries q0..; masked: some query of the tile does not
    // see some key of the CTA (the causal diagonal, a window edge, queries past n_q; VL with DQA: every tile of a
    // key tile that runs past n_k, whose rows hold the next sequence's keys (K rows that are not zeros), so their
    // P and dS must be 0 for dQ = dS K). The tiles every query of which sees every key of the CTA run without
    // the per-element test, in a loop of their own (below), which is the steady state.
    auto tile = [&](auto masked, const int i, const int h, const int q0) {
        constexpr bool need_mask = decltype(masked)::value;
        const int s = i % ST;
        // lse * log2 e and delta of this thread's query columns q0 + 8j + 2t + e (+inf / 0 past n_q). An unmasked
        // tile holds no query past n_q (full_hi < n_q) and none that sees no key (each sees the CTA's k0, so its
        // lse is finite): it skips both checks.
        float l2[C / 8][2], dl[C / 8][2];
        if constexpr (DQA > 0 && !VL) {
            // the pre-pass's runs (lse already times log2 e), padded to nq_pad: a thread's two queries are one
            // 8-byte load each. Padded rows read 0 for both: their Q and dO rows are TMA zeros (S = 0, P = 1,
            // dP = 0, so dS = 0 and P dO = 0), and they lie past full_hi, so the mask zeroes P there anyway.
            const float* lrun = lse + ((long long)b * n_heads + h) * nq_pad + q0 + 2 * t;
            const float* drun = delta + ((long long)b * n_heads + h) * nq_pad + q0 + 2 * t;
#pragma unroll
            for (int j = 0; j < C / 8; j++) {
                const float2 lv = *reinterpret_cast<const float2*>(lrun + 8 * j);
                const float2 dv2 = *reinterpret_cast<const float2*>(drun + 8 * j);
                l2[j][0] = need_mask && lv.x == PK_NEG_INF ? -PK_NEG_INF : lv.x;  // a row that sees no key: P = 0
                l2[j][1] = need_mask && lv.y == PK_NEG_INF ? -PK_NEG_INF : lv.y;
                dl[j][0] = dv2.x, dl[j][1] = dv2.y;
            }
        } else {
#pragma unroll
        for (int j = 0; j < C / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int qq = q0 + 8 * j + 2 * t + e;
                {
                    // DQA (VL): the pre-pass's runs over the packed rows as one batch, (head, nq_pad), lse
                    // already times log2 e; a query past n_q is the next sequence's: lse +inf (P = 0, dS = 0)
                    const long long r = DQA ? (long long)h * nq_pad + q_base + qq
                                            : ((VL ? q_base : (long long)b * n_q) + qq) * n_heads + h;
                    const bool in = !need_mask || qq < n_q;
                    const float lv = in ? lse[r] : PK_NEG_INF;
                    l2[j][e] = need_mask && lv == PK_NEG_INF ? -PK_NEG_INF : DQA ? lv : lv * 1.4426950408889634f;
                    dl[j][e] = in ? delta[r] : 0.0f;
                }
            }
        }
        float st_[C / 2], dpt[C / 2];
        unsigned pa[C / 16][4], da[C / 16][4];
        pk_mbarrier_wait_parity(&full[s], (i / ST) & 1);
        if constexpr (SPL) {
            // consumer 0: S^T = K Q^T, consumer 1: dP^T = V dO^T (D == DV: one code path, the descriptors chosen
            // by c). Consumer 0 turns S^T into P^T (the mask, lse; with softcap also P^T (1 - t^2), the tanh's
            // derivative folded in), consumer 1 dP^T into dP^T - delta; each stores its slots as [element][thread]
            // (conflict-free) in buffer i % 2, and after named barrier 3 both read them back element by element
            // into the P^T / dS^T fragments (x dies at its store: neither consumer holds both products). A buffer
            // is rewritten two tiles later, after both consumers passed the next tile's barrier, hence after both
            // read it. Named barrier 3: 1 and 2 are the fused kernel's (the _det kernel's semaphore warp arrives
            // on 1 early, with another count).
            float x[C / 2], unused[C / 2];
            ab90_two_products<DT, D, 0, R, C>(
                x, unused, c ? dv_a : dk_a,
                c ? pk_wgmma_desc_advance(ddo_b, s * DO_STEP_BYTES) : pk_wgmma_desc_advance(dq_b, s * STEP_BYTES),
                dv_a, ddo_b);
            float* buf = xch + (i & 1) * 3 * (C / 2) * 128 + tid % 128;  // slots: P^T, dP^T - delta, P^T (1 - t^2)
            if (c == 0) {
#pragma unroll
                for (int j = 0; j < C / 8; j++)
#pragma unroll
                    for (int r = 0; r < 2; r++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const int i4 = 4 * j + 2 * r + e;
                            const float xx = SC ? __tanhf(x[i4] * pre) : x[i4];
                            float p = pk_ex2_approx(fmaf(xx, sl2, -l2[j][e]));
                            if (need_mask) {
                                const int qq = q0 + 8 * j + 2 * t + e;
                                if (qq < qlo[r] || qq > qhi[r]) p = 0.0f;
                            }
                            buf[i4 * 128] = p;
                            if (SC) buf[(C + i4) * 128] = p * (1.0f - xx * xx);  // d tanh: the softcap's derivative
                        }
            } else {
#pragma unroll
                for (int j = 0; j < C / 8; j++)
#pragma unroll
                    for (int r = 0; r < 2; r++)
#pragma unroll
                        for (int e = 0; e < 2; e++)
                            buf[(C / 2 + 4 * j + 2 * r + e) * 128] = x[4 * j + 2 * r + e] - dl[j][e];
            }
            pk_bar_sync(3, 256);
#pragma unroll
            for (int j = 0; j < C / 8; j++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float p[2], ds[2];
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int i4 = 4 * j + 2 * r + e;
                        p[e] = buf[i4 * 128];
                        ds[e] = (SC ? buf[(C + i4) * 128] : p[e]) * buf[(C / 2 + i4) * 128];
                    }
                    pa[j / 2][2 * (j & 1) + r] = Pk16<T>::narrow2(p[0], p[1]);
                    da[j / 2][2 * (j & 1) + r] = Pk16<T>::narrow2(ds[0], ds[1]);
                }
        } else {
            ab90_two_products<DT, D, DV, R, C>(st_, dpt, dk_a, pk_wgmma_desc_advance(dq_b, s * STEP_BYTES), dv_a,
                                               pk_wgmma_desc_advance(ddo_b, s * DO_STEP_BYTES));
        }
        // braces around every if constexpr body here: a `#pragma unroll` between the condition and an unbraced
        // loop made NVRTC drop the SPL kernels' dS stores and their named barrier from the generic lambda's SASS
        // (g++ ignores the pragma, so the host backend did not see it; the SASS test of the barriers did)
        if constexpr (!SPL) {  // SPL formed P^T and dS^T above
#pragma unroll
            for (int j = 0; j < C / 8; j++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float p[2], ds[2];
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int i4 = 4 * j + 2 * r + e;
                        const float x = SC ? __tanhf(st_[i4] * pre) : st_[i4];
                        p[e] = pk_ex2_approx(fmaf(x, sl2, -l2[j][e]));
                        if (need_mask) {
                            const int qq = q0 + 8 * j + 2 * t + e;
                            if (qq < qlo[r] || qq > qhi[r]) p[e] = 0.0f;
                        }
                        ds[e] = p[e] * (dpt[i4] - dl[j][e]);
                        if (SC) ds[e] *= 1.0f - x * x;  // d tanh: the softcap's derivative
                    }
                    pa[j / 2][2 * (j & 1) + r] = Pk16<T>::narrow2(p[0], p[1]);
                    da[j / 2][2 * (j & 1) + r] = Pk16<T>::narrow2(ds[0], ds[1]);
                }
        }
        if constexpr (DQA > 0) {
            // dS[q][key] into buffer i % 2, box c (this consumer's 64 keys): row q, 2-byte column key % 64; row
            // 8j + 2t + e lies 1024 j bytes past row 2t + e with the same swizzle, so the offsets are ds_off's.
            // SPL: both consumers hold the same dS of the CTA's 64 keys (one box); consumer c stores queries
            // C / 2 * c.. (j / (C / 16) == c)
            unsigned char* box = dss + (i & 1) * DS_BYTES + (SPL ? 0 : c * C * 128);
#pragma unroll
            for (int j = 0; j < C / 8; j++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    if (SPL && j / (C / 16) != c) continue;
                    const unsigned w = da[j / 2][2 * (j & 1) + r];
                    *reinterpret_cast<unsigned short*>(box + ds_off[r][0] + 1024 * j) = (unsigned short)(w & 0xffffu);
                    *reinterpret_cast<unsigned short*>(box + ds_off[r][1] + 1024 * j) = (unsigned short)(w >> 16);
                }
            pk_fence_proxy_async_shared();  // the generic-proxy stores before the wgmma's (async proxy) reads
            // both consumers' dS, and warp 1's arrival (the dQ buffer this tile rewrites has been read; DQA 2: the
            // semaphore's acquire), before the wgmma
            pk_bar_sync(1, 288);
        }
        pk_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++)  // 16 queries = two 8-row groups
            pk_wgmma_m64nNk16_rs<DVN, DT, 1>(dva, pa[kk],
                                             pk_wgmma_desc_advance(ddo_t, s * DO_STEP_BYTES + hv + kk * 16 * RV), 1);
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++)
            pk_wgmma_m64nNk16_rs<DKN, DT, 1>(dka, da[kk],
                                             pk_wgmma_desc_advance(dq_t, s * STEP_BYTES + hq + kk * 16 * RQ), 1);
        if constexpr (DQA > 0 && SPL) {
            // dQ^T (head-dim rows 128c.., two m64 tiles: boxes 2c, 2c + 1 of K, read MN-major as A) = K^T dS^T over
            // the CTA's 64 keys (B = dS, K-major, the tile's C = 32 queries), both tiles in flight
            float dqt[2][C / 2];
            const unsigned long long sb = pk_wgmma_desc(dss + (i & 1) * DS_BYTES, 16, 1024, PK_SWIZZLE_128B);
#pragma unroll
            for (int m = 0; m < 2; m++) {
                const unsigned long long ka = pk_wgmma_desc(ks + (2 * c + m) * R * 128, R * 128, 1024, PK_SWIZZLE_128B);
#pragma unroll
                for (int kk = 0; kk < R / 16; kk++)
                    pk_wgmma_m64nNk16_ss<C, DT, 1, 0>(dqt[m], pk_wgmma_desc_advance(ka, kk * 2048),
                                                      pk_wgmma_desc_advance(sb, kk * 32), kk > 0);
            }
            pk_wgmma_commit();
            pk_wgmma_wait<0>();
            pk_mbarrier_arrive(&empty[s]);
            // the accumulator at d256 is (batch, head, half, nq_pad, 128): consumer c's half is a run of its own
            // (the layout of a d128 accumulator with twice the heads, which the d128 convert pass reads as dQ's
            // (batch, query, 2 heads, 128)), so the tile's half c ([C][128] at dqb + c C 128) leaves as a bulk
            // reduce-add of its own; rows 64m + 16 wq + g (+ 8), queries 8j + 2t + e (rows past n_q: zero adds,
            // as below)
            float* dst = dqb + c * C * DW + 2 * t * DW + 16 * wq + g;
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int j = 0; j < C / 8; j++)
#pragma unroll
                    for (int r = 0; r < 2; r++)
#pragma unroll
                        for (int e = 0; e < 2; e++)
                            dst[(8 * j + e) * DW + 64 * m + 8 * r] = dqt[m][4 * j + 2 * r + e];
            pk_fence_proxy_async_shared();  // the stores before the bulk op's (async proxy) read
            pk_bar_arrive(2, 288);  // the tile is stored: warp 1 adds it
        } else if constexpr (DQA > 0) {
            // dQ^T rows dlo.., columns (queries) qlo..: A = K^T (MN-major from head-dim box dlo / BQ, LBO one box,
            // SBO 8 key rows), B = dS (K-major). d96 (three 32-column boxes): an m64 tile spans two boxes and two
            // tiles cannot split three, so consumer 0 takes rows 0.. (boxes 0, 1) and consumer 1 rows 32.. (boxes
            // 1, 2), of which only rows 64.. (its warps 2 and 3) are added: box 1's rows there are computed twice
            constexpr int NQ = 32;
            const int dlo = NB == 2 ? 64 * c : NB == 3 ? 32 * c : 0, qlo = NB == 1 ? 32 * c : 0;
            float dqt[NQ / 2];
            const unsigned long long ka = pk_wgmma_desc(ks + (dlo / BQ) * R * RQ, R * RQ, 8 * RQ, SWQ);
            const unsigned long long sb =
                pk_wgmma_desc(dss + (i & 1) * DS_BYTES + qlo * 128, 16, 1024, PK_SWIZZLE_128B);
#pragma unroll
            for (int kk = 0; kk < R / 16; kk++)
                pk_wgmma_m64nNk16_ss<NQ, DT, 1, 0>(dqt, pk_wgmma_desc_advance(ka, kk * 16 * RQ),
                                                   pk_wgmma_desc_advance(sb, (kk / 4) * C * 128 + (kk % 4) * 32),
                                                   kk > 0);
            pk_wgmma_commit();
            pk_wgmma_wait<0>();
            pk_mbarrier_arrive(&empty[s]);
            // this thread's 16 values into dQ tile i % 2 ([query][D], the accumulator's rows q0..): head-dim rows
            // dlo + 16 wq + g (+ 8), queries qlo + 8j + 2t + e. The tile's C x D floats are the accumulator's
            // contiguous run at (batch, head, q0) and leave as one bulk reduce-add (rows past n_q hold zeros: their
            // dS is 0; dense: nq_pad covers every query tile. VL: the accumulator is (head, nq_pad) runs over the
            // packed rows, per-token rows from q_row0; a row past n_q is the next sequence's, or past total_q
            // inside nq_pad >= total_q + C: its add is of a zero, which leaves an accumulator that started at +0
            // bit-identical whenever it lands, so no check is spent on it). A warp's stores (fixed j, r, e) hit 8
            // consecutive floats (g) at 4 rows 2D floats apart (t): 4-way bank conflicts, 16 stores a thread, kept
            // plain so that the tile is the accumulator's run for a single bulk op
            float* dst = dqb + (i % NDQ) * DQ_TILE + (qlo + 2 * t) * D + dlo + 16 * wq + g;
            if (NB != 3 || c == 0 || wq >= 2) {  // d96: consumer 1's warps 0, 1 hold box 1's rows again
#pragma unroll
                for (int j = 0; j < NQ / 8; j++)
#pragma unroll
                    for (int r = 0; r < 2; r++)
#pragma unroll
                        for (int e = 0; e < 2; e++)
                            dst[(8 * j + e) * D + 8 * r] = dqt[4 * j + 2 * r + e];
            }
            pk_fence_proxy_async_shared();  // the stores before the bulk op's (async proxy) read
            pk_bar_arrive(2, 288);  // the tile is stored: warp 1 adds it
        } else {
            pk_wgmma_commit();
            pk_wgmma_wait<0>();
            pk_mbarrier_arrive(&empty[s]);
        }
    };
    // query tiles [u0, u1) need no mask (span.full_lo .. span.full_hi); none with tail_keys
    const int u0 = tail_keys ? qt1 : min(max((span.full_lo + C - 1) / C, qt0), qt1);
    const int u1 = min(max((span.full_hi + 1) / C, u0), qt1);
    // in the producer's order (head-major, then query tiles): a running tile index and head instead of a
    // division of the step index; per head the masked tiles below u0, the unmasked ones, the masked above u1
    for (int i = 0, h = kvh * group; h < (kvh + 1) * group; h++) {
        for (int qt = qt0; qt < qt1;) {
            const int stop = qt < u0 ? u0 : qt < u1 ? qt : qt1;
            for (; qt < stop; qt++, i++) tile(Ab90Bool<true>(), i, h, qt * C);
            for (; qt < u1; qt++, i++) tile(Ab90Bool<false>(), i, h, qt * C);
        }
    }

    // base: the (key row, kv head) index; dK rows hold D elements, dV rows DV
    pk_attn_key_rows(key0, n_k, VL ? (long long)k_row0 : (long long)b * n_k, (long long)n_kv_heads, (long long)kvh,
                     [&](int r, long long base) {
#pragma unroll
        for (int j = 0; j < DKN / 8; j++)
            *reinterpret_cast<unsigned int*>(dk + base * D + (SPL ? c * DKN : 0) + 8 * j + 2 * t) =
                Pk16<T>::narrow2(dka[4 * j + 2 * r] * scale, dka[4 * j + 2 * r + 1] * scale);
#pragma unroll
        for (int j = 0; j < DVN / 8; j++)
            *reinterpret_cast<unsigned int*>(dv + base * DV + (SPL ? c * DVN : 0) + 8 * j + 2 * t) =
                Pk16<T>::narrow2(dva[4 * j + 2 * r], dva[4 * j + 2 * r + 1]);
    });
}

// ------------------------------------------------------------------------------------------------ fused, 192 / 128
// The fused dK / dV / dQ kernel at head_dim 192 / head_dim_v 128 on FlashAttention-3's tiling (DQA 1 atomic, 2
// _det, as ab90_dkdv's): the CTA owns AB90_KT_ROWS = 96 keys of one (batch, kv head) (K, V resident) and streams
// AB90_KT_STEP = 64-query tiles (Q, dO) of every query head of the GQA group. Per tile, consumer c (keys 48c..):
//   S = Q K^T, dP = dO V^T (m64n48, SS; rows are queries, so lse / delta are two values a thread), P and
//   dS = P (dP - delta) stored as P^T / dS^T ([key][query], 128-byte rows, 128B swizzle), then
//   dV^T += dO^T P (2 m64 tiles of head_dim_v), dK^T += Q^T dS (3 m64 tiles of head_dim), all SS over the
//   tile's queries, and dQ's columns 96c.. = dS K (m64n96 over the CTA's 96 keys, SS: dS MN-major from dS^T, K
//   MN-major). dK^T and dV^T (72 + 48 accumulator registers a thread) stay in registers over the walk.
// Every product reads both operands from shared memory: 69 shared bytes a (query, key) pair by the attention
// model's byte rules, against the 16-query dK/dV tile's 102 (docs/attention_sm90.md). dQ's m64n96 halves read K
// MN-major, and a 128B-swizzled MN-major operand spans whole 64-column atoms, so Q and K come in 32-column boxes
// (64B swizzle, three atoms a half; `bwd_fused_kt_box`); V and dO in 64-column ones.
// dQ leaves as ab90_dkdv's does (the producer warpgroup's warp 1, named barriers 1 and 2): the tile's C x D
// fp32 partial, stored as three [C][64] runs (the accumulator (batch, head, 3, nq_pad, 64) that the d64 convert
// pass reads as dQ with three times the heads), three bulk reduce-adds a tile; one shared tile (a second would
// take the shared memory past 227 KiB), so the consumers' stores wait for the previous tile's reads.
#define AB90_KT_ROWS 96
// setmaxnreg: 128 x 40 + 256 x 232 = 64512 of the SM's 65536. At 24 / 240 the _det kernels spilled (36 / 24 bytes
// dense / varlen: the values the producer warpgroup's semaphore warp carries past its setmaxnreg.dec, with its
// divisions by the 96-key tile); the consumers compile without spills at 232
#define AB90_KT_PRODUCER_REGS 40
#define AB90_KT_CONSUMER_REGS 232
#define AB90_KT_STEP 64
// K + V resident, the 2-stage ring of (Q, dO), P^T and dS^T (one buffer each: named barrier 3 orders a tile's
// stores after both consumers' reads of the tile before), the fp32 dQ tile, the mbarriers: 218112 bytes
#define AB90_KT_SMEM_BYTES(D, DV)                                                                                     \
    (AB90_KT_ROWS * ((D) + (DV)) * 2 + AB90_STAGES * AB90_KT_STEP * ((D) + (DV)) * 2 +                              \
     2 * AB90_KT_ROWS * AB90_KT_STEP * 2 + AB90_KT_STEP * (D) * 4 + 1024)
template <typename T, int D, int DV, bool SC, bool VL, int DQA>
__device__ __forceinline__ void ab90_fused_kt(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                                              const CUtensorMap* tdo, const float* __restrict__ lse,
                                              const float* __restrict__ delta, T* __restrict__ dk,
                                              T* __restrict__ dv, float* __restrict__ dq_acc,
                                              int* __restrict__ dq_sem, const int* __restrict__ cu_q,
                                              const int* __restrict__ cu_k, int batch, int n_q, int n_k, int n_heads,
                                              int n_kv_heads, int nq_pad, float scale, int window_left,
                                              int window_right, float softcap) {
    static_assert(D == 192 && DV == 128 && DQA > 0, "the FA3 tiling: 192 / 128, fused");
    constexpr int DT = Ab90Dt<T>::V, R = AB90_KT_ROWS, C = AB90_KT_STEP, ST = AB90_STAGES;
    constexpr int NB = D / 32, NBV = DV / 64, RUNS = D / 64;  // 32-column q / k boxes, 64-column v / dO boxes
    constexpr unsigned K_BYTES = R * D * 2, V_BYTES = R * DV * 2, STEP_BYTES = C * D * 2, DO_STEP_BYTES = C * DV * 2;
    constexpr unsigned PT_BYTES = R * C * 2;  // P^T / dS^T: [R keys][C queries] 2-byte elements, 128-byte rows
    extern __shared__ __align__(1024) unsigned char ab90_smem[];
    unsigned char* ks = ab90_smem;                   // [NB][R][64 B]
    unsigned char* vs = ks + K_BYTES;                // [NBV][R][128 B]
    unsigned char* qs = vs + V_BYTES;                // [ST][NB][C][64 B]
    unsigned char* dos = qs + ST * STEP_BYTES;       // [ST][NBV][C][128 B]
    unsigned char* pts = dos + ST * DO_STEP_BYTES;   // P^T
    unsigned char* dst = pts + PT_BYTES;             // dS^T
    float* dqb = reinterpret_cast<float*>(dst + PT_BYTES);  // [RUNS][C][64]
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(dqb + C * D);
    unsigned long long *kv_full = bars, *full = bars + 1, *empty = bars + 1 + ST;
    static_assert(K_BYTES + V_BYTES + ST * (STEP_BYTES + DO_STEP_BYTES) + 2 * PT_BYTES + C * D * 4 + 1024 ==
                      AB90_KT_SMEM_BYTES(D, DV), "the carve-up above is the op's shared_mem (AB90_KT_SMEM_BYTES)");

    const int tid = threadIdx.x, wg = tid / 128;
    Ab90KeyTile ktile;
    if (!ab90_key_tile<R, C, DQA, VL>(ktile, n_q, n_k, window_left, window_right, n_heads, n_kv_heads, cu_q, cu_k))
        return;
    (void)batch;
    const bool desc = ktile.desc;
    const int kt = ktile.kt, b = ktile.b, kvh = ktile.kvh, group = ktile.group, k0 = ktile.k0;
    const int sem_tiles = ktile.sem_tiles, q_row0 = ktile.q_row0, k_row0 = ktile.k_row0, mb = ktile.mb;
    const int qt0 = ktile.qt0, qt1 = ktile.qt1, steps = ktile.steps;
    const PkAttnSpan span = ktile.span;

    pk_ring_init<ST>(kv_full, full, empty, 256);

    if (wg == 0) {  // ---- producer ----
        pk_setmaxnreg_dec<AB90_KT_PRODUCER_REGS>();
        if (tid < 32 && pk_elect_one()) {
            pk_mbarrier_arrive_expect_tx(kv_full, K_BYTES + V_BYTES);
            for (int nb = 0; nb < NB; nb++) pk_tma_load_4d(ks + nb * R * 64, tk, kv_full, nb * 32, kvh, k_row0 + k0, mb);
            for (int nb = 0; nb < NBV; nb++) pk_tma_load_4d(vs + nb * R * 128, tv, kv_full, nb * 64, kvh, k_row0 + k0, mb);
            for (int i = 0; i < steps; i++) {
                const int s = i % ST, h = kvh * group + i / (qt1 - qt0), q0 = (qt0 + i % (qt1 - qt0)) * C;
                pk_mbarrier_wait_parity(&empty[s], ((i / ST) & 1) ^ 1);
                pk_mbarrier_arrive_expect_tx(&full[s], STEP_BYTES + DO_STEP_BYTES);
                for (int nb = 0; nb < NB; nb++)
                    pk_tma_load_4d(qs + s * STEP_BYTES + nb * C * 64, tq, &full[s], nb * 32, h, q_row0 + q0, mb);
                for (int nb = 0; nb < NBV; nb++)
                    pk_tma_load_4d(dos + s * DO_STEP_BYTES + nb * C * 128, tdo, &full[s], nb * 64, h, q_row0 + q0, mb);
            }
        }
        // warp 1: dQ's bulk reduce-adds (and, DQA 2, the semaphores), as ab90_dkdv's, one shared tile
        if (tid / 32 == 1) {
            int* sem_h = DQA == 2 ? dq_sem + ((long long)b * n_heads + kvh * group) * sem_tiles : nullptr;
            float* acc_h = dq_acc + (((long long)(VL ? 0 : b) * n_heads + kvh * group) * RUNS * nq_pad + q_row0) * 64;
            const long long run_stride = (long long)nq_pad * 64;
            for (int i = 0, qt = qt0; i < steps; i++) {
                const int q0 = qt * C;
                int* sem = sem_h + qt;
                float* acc = acc_h + q0 * 64;
                if (++qt == qt1) qt = qt0, sem_h += sem_tiles, acc_h += RUNS * run_stride;  // next head
                if (tid == 32) {
                    pk_tma_store_wait_read<0>();
                    if constexpr (DQA == 2) {
                        const PkAttnSpan qsp = pk_attn_q_span(q0, min(q0 + C, n_q) - 1, n_q, n_k, window_left,
                                                              window_right);
                        pk_sem_wait_eq(sem, desc ? qsp.hi / R - kt : kt - qsp.lo / R);
                    }
                }
                __syncwarp();
                pk_bar_arrive(1, 288);
                pk_bar_sync(2, 288);
                if (tid == 32) {
                    // a pointer stepped a run at a time (this warp runs on the producer's registers)
                    float* a = acc;
#pragma unroll 1
                    for (int run = 0; run < RUNS; run++, a += run_stride)
                        pk_bulk_reduce_add_f32(a, dqb + run * C * 64, C * 64 * 4);
                    pk_tma_store_commit();
                    if constexpr (DQA == 2) {
                        pk_tma_store_wait<0>();
                        pk_sem_add_release(sem, 1);
                    }
                }
            }
            if (tid == 32) pk_tma_store_wait<0>();
        }
        return;
    }

    // ---- consumers: S / dP rows = queries q0 + 16 wq + g (+ 8), columns = keys k0 + 48c + 8j + 2t + e ----
    pk_setmaxnreg_inc<AB90_KT_CONSUMER_REGS>();
    const int c = __shfl_sync(PK_FULL_MASK, wg, 0) - 1, lane = tid % 32, wq = (tid / 32) % 4, g = lane / 4,
              t = lane % 4;
    float dka[D / 64][24], dva[DV / 64][24];  // dK^T / dV^T: rows 64m + 16 wq + g (+ 8) of the head dim, keys 48c..
#pragma unroll
    for (int m = 0; m < D / 64; m++)
#pragma unroll
        for (int i = 0; i < 24; i++) dka[m][i] = 0.0f;
#pragma unroll
    for (int m = 0; m < DV / 64; m++)
#pragma unroll
        for (int i = 0; i < 24; i++) dva[m][i] = 0.0f;
    const float sl2 = (SC ? softcap : scale) * 1.4426950408889634f;
    const float pre = SC ? scale / softcap : 0.0f;
    // K-major A / B: SBO 8 rows (512 bytes at 64-byte rows, 1024 at 128); MN-major: LBO one box, SBO 8 k-rows
    const unsigned long long qa = pk_wgmma_desc(qs, 16, 512, PK_SWIZZLE_64B);
    const unsigned long long kb = pk_wgmma_desc(ks + c * 48 * 64, 16, 512, PK_SWIZZLE_64B);
    const unsigned long long oa = pk_wgmma_desc(dos, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long vb = pk_wgmma_desc(vs + c * 48 * 128, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long ot = pk_wgmma_desc(dos, C * 128, 1024, PK_SWIZZLE_128B);   // dO^T (MN-major A)
    const unsigned long long qtd = pk_wgmma_desc(qs, C * 64, 512, PK_SWIZZLE_64B);      // Q^T (MN-major A)
    const unsigned long long pb = pk_wgmma_desc(pts + c * 48 * 128, 16, 1024, PK_SWIZZLE_128B);  // P^T (K-major B)
    const unsigned long long db = pk_wgmma_desc(dst + c * 48 * 128, 16, 1024, PK_SWIZZLE_128B);  // dS^T
    const unsigned long long sa = pk_wgmma_desc(dst, C * 128, 1024, PK_SWIZZLE_128B);   // dS (MN-major A)
    const unsigned long long kn = pk_wgmma_desc(ks + c * 3 * R * 64, R * 64, 512, PK_SWIZZLE_64B);  // K (MN-major B)
    // this thread's P^T / dS^T store offsets (keys 48c + 8j + 2t + e, queries 16 wq + g + 8r): key row 8j + x
    // lies 1024 j bytes past row x with the same swizzle (48c is a multiple of 8), so the loop adds 1024 j. The
    // 128B swizzle XORs the 16-byte unit 2 wq + r of key row 48c + 2t + e by the row % 8, 2t + e: the offset is
    // st0 + 128 e + 16 (r ^ e), one register and immediates, which the softcap kernels take (with four registers
    // they spilled); the plain ones keep a register an (r, e), where the compiler's 16-bit moves leave their loop
    // 10 instructions shorter (620 against 630 a tile)
    const unsigned st0 = (48 * c + 2 * t) * 128 + 32 * (wq ^ t) + 2 * g;
    unsigned st_off[2][2];
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int e = 0; e < 2; e++)
            st_off[r][e] = SC ? st0 + 128 * e + 16 * (r ^ e)
                              : pk_swizzle_offset((48 * c + 2 * t + e) * 128 + (16 * wq + g + 8 * r) * 2, PK_SWIZZLE_128B);
    const int key0 = k0 + 48 * c + 2 * t;  // + 8j + e: this thread's keys
    pk_mbarrier_wait_parity(kv_full, 0);

    auto tile = [&](auto masked, const int i, const int h, const int q0) {
        constexpr bool need_mask = decltype(masked)::value;
        const int s = i % ST;
        float l2[2], dl[2];
        int klo[2], khi[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int qq = q0 + 16 * wq + g + 8 * r;
            // the pre-pass's runs (lse already times log2 e): dense (batch, head, nq_pad), padded rows 0 (their Q
            // and dO are TMA zeros: dS = 0, P dO = 0; masked anyway); VL (head, nq_pad) over the packed rows, a
            // query past n_q the next sequence's: +inf (P = 0)
            const long long idx = VL ? (long long)h * nq_pad + q_row0 + qq : ((long long)b * n_heads + h) * nq_pad + qq;
            const bool in = !need_mask || qq < n_q;
            const float lv = in ? lse[idx] : PK_NEG_INF;
            l2[r] = need_mask && lv == PK_NEG_INF ? -PK_NEG_INF : lv;
            dl[r] = in ? delta[idx] : 0.0f;
            if (need_mask) pk_attn_q_row(qq, n_q, n_k, window_left, window_right, klo[r], khi[r]);
        }
        float sc[24], dp[24];
        pk_mbarrier_wait_parity(&full[s], (i / ST) & 1);
        pk_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)  // 32-column boxes: two k-steps a box
            pk_wgmma_m64nNk16_ss<48, DT>(sc, pk_wgmma_desc_advance(qa, s * STEP_BYTES + (kk / 2) * C * 64 + (kk % 2) * 32),
                                         pk_wgmma_desc_advance(kb, (kk / 2) * R * 64 + (kk % 2) * 32), kk > 0);
#pragma unroll
        for (int kk = 0; kk < DV / 16; kk++)  // 64-column boxes: four k-steps a box
            pk_wgmma_m64nNk16_ss<48, DT>(dp, pk_wgmma_desc_advance(oa, s * DO_STEP_BYTES + (kk / 4) * C * 128 + (kk % 4) * 32),
                                         pk_wgmma_desc_advance(vb, (kk / 4) * R * 128 + (kk % 4) * 32), kk > 0);
        pk_wgmma_commit();
        pk_wgmma_wait<0>();
        // both consumers are past the previous tile's dQ wgmma (its reads of dS^T) before either rewrites it
        pk_bar_sync(3, 256);
#pragma unroll
        for (int j = 0; j < 6; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) {
                const int r = v >> 1, e = v & 1, i4 = 4 * j + v;
                const float x = SC ? __tanhf(sc[i4] * pre) : sc[i4];
                float p = pk_ex2_approx(fmaf(x, sl2, -l2[r]));
                if (need_mask) {
                    const int kk = key0 + 8 * j + e;
                    if (kk < klo[r] || kk > khi[r]) p = 0.0f;
                }
                float ds = p * (dp[i4] - dl[r]);
                if (SC) ds *= 1.0f - x * x;  // d tanh: the softcap's derivative
                *reinterpret_cast<unsigned short*>(pts + st_off[r][e] + 1024 * j) = Pk16<T>::narrow(p);
                *reinterpret_cast<unsigned short*>(dst + st_off[r][e] + 1024 * j) = Pk16<T>::narrow(ds);
            }
        pk_fence_proxy_async_shared();  // the generic-proxy stores before the wgmma's (async proxy) reads
        // both consumers' P^T / dS^T, and warp 1's arrival (the dQ tile has been read; DQA 2: the semaphore)
        pk_bar_sync(1, 288);
        float dqa[48];
        pk_wgmma_fence();
#pragma unroll
        for (int m = 0; m < DV / 64; m++)
#pragma unroll
            for (int kk = 0; kk < C / 16; kk++)
                pk_wgmma_m64nNk16_ss<48, DT, 1, 0>(dva[m], pk_wgmma_desc_advance(ot, s * DO_STEP_BYTES + m * C * 128 + kk * 2048),
                                                   pk_wgmma_desc_advance(pb, kk * 32), 1);
#pragma unroll
        for (int m = 0; m < D / 64; m++)
#pragma unroll
            for (int kk = 0; kk < C / 16; kk++)
                pk_wgmma_m64nNk16_ss<48, DT, 1, 0>(dka[m], pk_wgmma_desc_advance(qtd, s * STEP_BYTES + 2 * m * C * 64 + kk * 1024),
                                                   pk_wgmma_desc_advance(db, kk * 32), 1);
#pragma unroll
        for (int kk = 0; kk < R / 16; kk++)
            pk_wgmma_m64nNk16_ss<96, DT, 1, 1>(dqa, pk_wgmma_desc_advance(sa, kk * 2048),
                                               pk_wgmma_desc_advance(kn, kk * 1024), kk > 0);
        pk_wgmma_commit();
        pk_wgmma_wait<0>();
        pk_mbarrier_arrive(&empty[s]);
        // dQ columns 96c + 8j + 2t (+1), queries 16 wq + g (+ 8): run (column / 64), [query][column % 64]
#pragma unroll
        for (int j = 0; j < 12; j++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int col = 96 * c + 8 * j + 2 * t;
                *reinterpret_cast<float2*>(dqb + (col / 64) * C * 64 + (16 * wq + g + 8 * r) * 64 + col % 64) =
                    make_float2(dqa[4 * j + 2 * r], dqa[4 * j + 2 * r + 1]);
            }
        pk_fence_proxy_async_shared();  // the stores before the bulk op's (async proxy) read
        pk_bar_arrive(2, 288);  // the tile is stored: warp 1 adds it
    };
    const bool tail_keys = VL && k0 + R > n_k;
    const int u0 = tail_keys ? qt1 : min(max((span.full_lo + C - 1) / C, qt0), qt1);
    const int u1 = min(max((span.full_hi + 1) / C, u0), qt1);
    for (int i = 0, h = kvh * group; h < (kvh + 1) * group; h++) {
        for (int qt = qt0; qt < qt1;) {
            const int stop = qt < u0 ? u0 : qt < u1 ? qt : qt1;
            for (; qt < stop; qt++, i++) tile(Ab90Bool<true>(), i, h, qt * C);
            for (; qt < u1; qt++, i++) tile(Ab90Bool<false>(), i, h, qt * C);
        }
    }
    // dK (times scale) / dV rows = keys: element (head-dim row 64m + 16 wq + g + 8r, key 48c + 8j + 2t + e)
    const long long kbase = VL ? (long long)k_row0 : (long long)b * n_k;
#pragma unroll
    for (int j = 0; j < 6; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int key = key0 + 8 * j + e;
            if (key >= n_k) continue;
            const long long row = (kbase + key) * n_kv_heads + kvh;
#pragma unroll
            for (int r = 0; r < 2; r++) {
#pragma unroll
                for (int m = 0; m < D / 64; m++)
                    reinterpret_cast<unsigned short*>(dk)[row * D + 64 * m + 16 * wq + g + 8 * r] =
                        Pk16<T>::narrow(dka[m][4 * j + 2 * r + e] * scale);
#pragma unroll
                for (int m = 0; m < DV / 64; m++)
                    reinterpret_cast<unsigned short*>(dv)[row * DV + 64 * m + 16 * wq + g + 8 * r] =
                        Pk16<T>::narrow(dva[m][4 * j + 2 * r + e]);
            }
        }
}
#define AB90_FUSED_KT_ENTRY(name, SC, DQA, VL)                                                                       \
    template <typename T, typename... A>                                                                            \
    __device__ __forceinline__ void name##_impl(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, \
                                                const CUtensorMap& tdo, const float* lse, const float* delta, T* dk,  \
                                                T* dv, float* dq_acc, int* dq_sem, A... a) {                        \
        if constexpr (VL) {                                                                                         \
            ab90_fused_kt<T, 192, 128, SC, VL, DQA>(&tq, &tk, &tv, &tdo, lse, delta, dk, dv, dq_acc, dq_sem, a...); \
        } else {                                                                                                    \
            ab90_fused_kt<T, 192, 128, SC, VL, DQA>(&tq, &tk, &tv, &tdo, lse, delta, dk, dv, dq_acc, dq_sem,         \
                                                    nullptr, nullptr, a...);                                        \
        }                                                                                                           \
    }
AB90_FUSED_KT_ENTRY(attention_bwd_sm90_fused_d192_dv128, false, 1, false)
AB90_FUSED_KT_ENTRY(attention_bwd_sm90_fused_det_d192_dv128, false, 2, false)
AB90_FUSED_KT_ENTRY(attention_bwd_varlen_sm90_fused_d192_dv128, false, 1, true)
AB90_FUSED_KT_ENTRY(attention_bwd_varlen_sm90_fused_det_d192_dv128, false, 2, true)
AB90_FUSED_KT_ENTRY(attention_bwd_sm90_fused_d192_dv128_softcap, true, 1, false)
AB90_FUSED_KT_ENTRY(attention_bwd_sm90_fused_det_d192_dv128_softcap, true, 2, false)
AB90_FUSED_KT_ENTRY(attention_bwd_varlen_sm90_fused_d192_dv128_softcap, true, 1, true)
AB90_FUSED_KT_ENTRY(attention_bwd_varlen_sm90_fused_det_d192_dv128_softcap, true, 2, true)

// ------------------------------------------------------------------------------------------------ dQ

template <typename T, int D, int DV, bool SC, bool VL>
__device__ __forceinline__ void ab90_dq(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                                        const CUtensorMap* tdo, const float* __restrict__ lse,
                                        const float* __restrict__ delta, T* __restrict__ dq,
                                        const int* __restrict__ cu_q, const int* __restrict__ cu_k, int batch,
                                        int n_q, int n_k, int n_heads, int n_kv_heads, float scale,
                                        int window_left, int window_right, float softcap = 0.0f) {
    // D: head_dim of q and k (S's k-steps, dQ); DV: of v and dO (dP's k-steps); boxes as in ab90_dkdv
    constexpr int DT = Ab90Dt<T>::V, BQ = PkAttnBox<D>::COLS, BV = PkAttnBox<DV>::COLS, NB = D / BQ, NBV = DV / BV;
    constexpr int RQ = 2 * BQ, RV = 2 * BV, R = AB90_ROWS, C = AB90_DQ_STEP(D), ST = AB90_STAGES;
    constexpr unsigned Q_BYTES = R * D * 2, DO_BYTES = R * DV * 2, STEP_BYTES = C * D * 2, V_STEP_BYTES = C * DV * 2;
    extern __shared__ __align__(1024) unsigned char ab90_smem[];
    unsigned char* qs = ab90_smem;
    unsigned char* dos = qs + Q_BYTES;
    unsigned char* ks = dos + DO_BYTES;              // [ST][NB][C][RQ]
    unsigned char* vs = ks + ST * STEP_BYTES;        // [ST][NBV][C][RV]
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(vs + ST * V_STEP_BYTES);
    unsigned long long *q_full = bars, *full = bars + 1, *empty = bars + 1 + ST;
    static_assert(Q_BYTES + DO_BYTES + ST * (STEP_BYTES + V_STEP_BYTES) + 1024 == AB90_SMEM_BYTES(D, DV, C),
                  "the carve-up above is the op's shared_mem (AB90_SMEM_BYTES)");

    const int tid = threadIdx.x, wg = tid / 128;
    const int n_qt = (n_q + R - 1) / R;
    const int bh = blockIdx.x / n_qt, qt = blockIdx.x % n_qt;
    const int b = bh / n_heads, h = bh % n_heads, kvh = h / (n_heads / n_kv_heads);
    const int q0 = qt * R;
    int q_row0 = 0, k_row0 = 0, mb = b;  // as in ab90_dkdv
    if constexpr (VL) {
        q_row0 = cu_q[b], k_row0 = cu_k[b], mb = 0;
        n_q = max(cu_q[b + 1] - q_row0, 0), n_k = max(cu_k[b + 1] - k_row0, 0);
        if (q0 >= n_q) return;  // CTA-uniform, before any barrier
        window_left = min(window_left, n_k), window_right = min(window_right, n_q);
    }
    (void)batch;
    const int q_last = min(q0 + R, n_q) - 1;
    const PkAttnSpan span = pk_attn_q_span(q0, q_last, n_q, n_k, window_left, window_right);
    const int kt0 = span.lo / C, kt1 = span.hi < span.lo ? kt0 : span.hi / C + 1;

    pk_ring_init<ST>(q_full, full, empty, 256);

    if (wg == 0) {  // ---- producer ----
        pk_setmaxnreg_dec<24>();
        if (tid < 32 && pk_elect_one()) {
            pk_mbarrier_arrive_expect_tx(q_full, Q_BYTES + DO_BYTES);
            for (int nb = 0; nb < NB; nb++) pk_tma_load_4d(qs + nb * R * RQ, tq, q_full, nb * BQ, h, q_row0 + q0, mb);
            for (int nb = 0; nb < NBV; nb++) pk_tma_load_4d(dos + nb * R * RV, tdo, q_full, nb * BV, h, q_row0 + q0, mb);
            for (int i = 0, j = kt0; j < kt1; j++, i++) {
                const int s = i % ST;
                pk_mbarrier_wait_parity(&empty[s], ((i / ST) & 1) ^ 1);
                pk_mbarrier_arrive_expect_tx(&full[s], STEP_BYTES + V_STEP_BYTES);
                for (int nb = 0; nb < NB; nb++)
                    pk_tma_load_4d(ks + s * STEP_BYTES + nb * C * RQ, tk, &full[s], nb * BQ, kvh, k_row0 + j * C, mb);
                for (int nb = 0; nb < NBV; nb++)
                    pk_tma_load_4d(vs + s * V_STEP_BYTES + nb * C * RV, tv, &full[s], nb * BV, kvh, k_row0 + j * C,
                                   mb);
            }
        }
        return;
    }

    // ---- consumers: rows = queries q0 + 64c + 16 wq + g (+ 8) ----
    pk_setmaxnreg_inc<240>();
    // c through a lane-0 shuffle (CUTLASS's canonical_warp_group_idx): ptxas then knows it warp-uniform and keeps
    // the Q / dO descriptors and their k-step advances in uniform registers (no R2UR pair and 64-bit add an HGMMA)
    const int c = __shfl_sync(PK_FULL_MASK, wg, 0) - 1, lane = tid % 32, wq = (tid / 32) % 4, g = lane / 4,
              t = lane % 4;
    float dqa[D / 2] = {};
    const float sl2 = (SC ? softcap : scale) * 1.4426950408889634f;  // as in ab90_dkdv
    const float pre = SC ? scale / softcap : 0.0f;
    const long long q_base = VL ? (long long)q_row0 : (long long)b * n_q;  // lse / delta / dQ row of query 0
    const int row0 = q0 + 64 * c + 16 * wq + g;
    int rlo[2], rhi[2];
    float l2[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        pk_attn_q_row(row, n_q, n_k, window_left, window_right, rlo[r], rhi[r]);
        const long long idx = (q_base + row) * n_heads + h;
        const float lv = row < n_q ? lse[idx] : PK_NEG_INF;
        l2[r] = lv == PK_NEG_INF ? -PK_NEG_INF : lv * 1.4426950408889634f;
        dl[r] = row < n_q ? delta[idx] : 0.0f;
    }
    constexpr int SWQ = PkAttnBox<D>::SWIZZLE, SWV = PkAttnBox<DV>::SWIZZLE;  // descriptors as in ab90_dkdv
    const unsigned long long dq_a = pk_wgmma_desc(qs + c * 64 * RQ, 16, 8 * RQ, SWQ);
    const unsigned long long ddo_a = pk_wgmma_desc(dos + c * 64 * RV, 16, 8 * RV, SWV);
    const unsigned long long dk_b = pk_wgmma_desc(ks, 16, 8 * RQ, SWQ);
    const unsigned long long dv_b = pk_wgmma_desc(vs, 16, 8 * RV, SWV);
    const unsigned long long dk_t = pk_wgmma_desc(ks, C * RQ, 8 * RQ, SWQ);  // MN-major
    pk_mbarrier_wait_parity(q_full, 0);

    // One key tile (ring slot (j - kt0) % ST); masked: the tile holds a key some row of the CTA does not see (the
    // causal diagonal, a window edge, keys past n_k). The interior tiles run without the per-element column test,
    // in a loop of their own (below), which is the steady state.
    auto tile = [&](auto masked, int j) {
        constexpr bool need_mask = decltype(masked)::value;
        const int i = j - kt0, s = i % ST, k0 = j * C;
        float sc[C / 2], dp[C / 2];
        pk_mbarrier_wait_parity(&full[s], (i / ST) & 1);
        ab90_two_products<DT, D, DV, R, C>(sc, dp, dq_a, pk_wgmma_desc_advance(dk_b, s * STEP_BYTES), ddo_a,
                                           pk_wgmma_desc_advance(dv_b, s * V_STEP_BYTES));
        unsigned da[C / 16][4];
#pragma unroll
        for (int jj = 0; jj < C / 8; jj++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float ds[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int i4 = 4 * jj + 2 * r + e;
                    const float x = SC ? __tanhf(sc[i4] * pre) : sc[i4];
                    float p = pk_ex2_approx(fmaf(x, sl2, -l2[r]));
                    if (need_mask) {
                        const int col = k0 + 8 * jj + 2 * t + e;
                        if (col < rlo[r] || col > rhi[r]) p = 0.0f;
                    }
                    ds[e] = p * (dp[i4] - dl[r]);
                    if (SC) ds[e] *= 1.0f - x * x;  // d tanh: the softcap's derivative
                }
                da[jj / 2][2 * (jj & 1) + r] = Pk16<T>::narrow2(ds[0], ds[1]);
            }
        pk_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++)
            pk_wgmma_m64nNk16_rs<D, DT, 1>(dqa, da[kk], pk_wgmma_desc_advance(dk_t, s * STEP_BYTES + kk * 16 * RQ), 1);
        pk_wgmma_commit();
        pk_wgmma_wait<0>();
        pk_mbarrier_arrive(&empty[s]);
    };
    // tiles [u0, u1) need no mask: every row of the CTA sees every key of them (span.full_lo .. span.full_hi)
    const int u0 = min(max((span.full_lo + C - 1) / C, kt0), kt1);
    const int u1 = min(max((span.full_hi + 1) / C, u0), kt1);
    for (int j = kt0; j < kt1;) {  // in the producer's order: masked tiles below u0, unmasked ones, masked above u1
        const int stop = j < u0 ? u0 : j < u1 ? j : kt1;
        for (; j < stop; j++) tile(Ab90Bool<true>(), j);
        for (; j < u1; j++) tile(Ab90Bool<false>(), j);
    }

    const long long row_stride = (long long)n_heads * D;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        if (row >= n_q) continue;
        T* o = dq + (q_base + row) * row_stride + (long long)h * D;
#pragma unroll
        for (int jj = 0; jj < D / 8; jj++)
            *reinterpret_cast<unsigned int*>(o + 8 * jj + 2 * t) =
                Pk16<T>::narrow2(dqa[4 * jj + 2 * r] * scale, dqa[4 * jj + 2 * r + 1] * scale);
    }
}

// Entry points: attention_bwd[_varlen]_sm90_{dkdv,dq}_d{64,128}[_softcap]_{bf16,f16}. The dense kernels pass no
// cu_seqlens (nullptr); the _softcap kernels take the softcap as one more, last, parameter.
#define AB90_ENTRY(name, body, D, DV, SC, VL)                                                                        \
    template <typename T, typename... A>                                                                            \
    __device__ __forceinline__ void name##_impl(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, \
                                                const CUtensorMap& tdo, A... a) {                                   \
        body<T, D, DV, SC, VL>(&tq, &tk, &tv, &tdo, a...);                                                          \
    }
AB90_ENTRY(attention_bwd_sm90_dkdv_d64, ab90_dkdv, 64, 64, false, false)
AB90_ENTRY(attention_bwd_sm90_dkdv_d128, ab90_dkdv, 128, 128, false, false)
AB90_ENTRY(attention_bwd_sm90_dq_d64, ab90_dq, 64, 64, false, false)
AB90_ENTRY(attention_bwd_sm90_dq_d128, ab90_dq, 128, 128, false, false)
AB90_ENTRY(attention_bwd_sm90_dq_d256, ab90_dq, 256, 256, false, false)
AB90_ENTRY(attention_bwd_sm90_dq_d256_softcap, ab90_dq, 256, 256, true, false)
AB90_ENTRY(attention_bwd_sm90_dkdv_d64_softcap, ab90_dkdv, 64, 64, true, false)
AB90_ENTRY(attention_bwd_sm90_dkdv_d128_softcap, ab90_dkdv, 128, 128, true, false)
AB90_ENTRY(attention_bwd_sm90_dq_d64_softcap, ab90_dq, 64, 64, true, false)
AB90_ENTRY(attention_bwd_sm90_dq_d128_softcap, ab90_dq, 128, 128, true, false)
AB90_ENTRY(attention_bwd_varlen_sm90_dkdv_d64, ab90_dkdv, 64, 64, false, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dkdv_d128, ab90_dkdv, 128, 128, false, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dq_d64, ab90_dq, 64, 64, false, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dq_d128, ab90_dq, 128, 128, false, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dkdv_d64_softcap, ab90_dkdv, 64, 64, true, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dkdv_d128_softcap, ab90_dkdv, 128, 128, true, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dq_d64_softcap, ab90_dq, 64, 64, true, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dq_d128_softcap, ab90_dq, 128, 128, true, true)
// head_dim 96 (boxes of 32 columns, 64B swizzle) and head_dim_qk 192 / head_dim_v 128 (DeepSeek-V3's prefill)
AB90_ENTRY(attention_bwd_sm90_dkdv_d96, ab90_dkdv, 96, 96, false, false)
AB90_ENTRY(attention_bwd_sm90_dkdv_d192_dv128, ab90_dkdv, 192, 128, false, false)
AB90_ENTRY(attention_bwd_sm90_dkdv_d96_softcap, ab90_dkdv, 96, 96, true, false)
AB90_ENTRY(attention_bwd_sm90_dkdv_d192_dv128_softcap, ab90_dkdv, 192, 128, true, false)
AB90_ENTRY(attention_bwd_sm90_dq_d96, ab90_dq, 96, 96, false, false)
AB90_ENTRY(attention_bwd_sm90_dq_d192_dv128, ab90_dq, 192, 128, false, false)
AB90_ENTRY(attention_bwd_sm90_dq_d96_softcap, ab90_dq, 96, 96, true, false)
AB90_ENTRY(attention_bwd_sm90_dq_d192_dv128_softcap, ab90_dq, 192, 128, true, false)
AB90_ENTRY(attention_bwd_varlen_sm90_dkdv_d96, ab90_dkdv, 96, 96, false, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dkdv_d192_dv128, ab90_dkdv, 192, 128, false, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dkdv_d96_softcap, ab90_dkdv, 96, 96, true, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dkdv_d192_dv128_softcap, ab90_dkdv, 192, 128, true, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dq_d96, ab90_dq, 96, 96, false, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dq_d192_dv128, ab90_dq, 192, 128, false, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dq_d96_softcap, ab90_dq, 96, 96, true, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dq_d192_dv128_softcap, ab90_dq, 192, 128, true, true)
// head_dim 256: dK / dV with the head dim split across the consumers (AB90_DKDV_SPLIT), dQ on 32-key tiles
AB90_ENTRY(attention_bwd_sm90_dkdv_d256, ab90_dkdv, 256, 256, false, false)
AB90_ENTRY(attention_bwd_sm90_dkdv_d256_softcap, ab90_dkdv, 256, 256, true, false)
AB90_ENTRY(attention_bwd_varlen_sm90_dkdv_d256, ab90_dkdv, 256, 256, false, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dkdv_d256_softcap, ab90_dkdv, 256, 256, true, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dq_d256, ab90_dq, 256, 256, false, true)
AB90_ENTRY(attention_bwd_varlen_sm90_dq_d256_softcap, ab90_dq, 256, 256, true, true)
// the fused dK / dV / dQ kernels (dense, _softcap, varlen): DQA 1 (atomic dQ) and 2 (_det: semaphore-ordered dQ).
// The kernels' parameters after dq_sem (VL: cu_q, cu_k first; the dense kernels pass none) in ab90_dkdv's order; VL:
// the pre-pass's runs and the accumulator over the packed rows as one batch, (heads, nq_pad[, D]).
template <typename T, int D, bool SC, bool VL, int DQA, typename... Cap>
__device__ __forceinline__ void ab90_fused(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                                           const CUtensorMap* tdo, const float* lse, const float* delta, T* dk, T* dv,
                                           float* dq_acc, int* dq_sem, const int* cu_q, const int* cu_k, int batch,
                                           int n_q, int n_k, int n_heads, int n_kv_heads, int nq_pad, float scale,
                                           int wl, int wr, Cap... cap) {
    ab90_dkdv<T, D, D, SC, VL, DQA>(tq, tk, tv, tdo, lse, delta, dk, dv, cu_q, cu_k, batch, n_q, n_k, n_heads,
                                    n_kv_heads, scale, wl, wr, cap..., dq_acc, dq_sem, nq_pad);
}
#define AB90_FUSED_ENTRY(name, D, SC, DQA, VL)                                                                       \
    template <typename T, typename... A>                                                                            \
    __device__ __forceinline__ void name##_impl(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, \
                                                const CUtensorMap& tdo, const float* lse, const float* delta, T* dk,  \
                                                T* dv, float* dq_acc, int* dq_sem, A... a) {                        \
        if constexpr (VL) {                                                                                         \
            ab90_fused<T, D, SC, VL, DQA>(&tq, &tk, &tv, &tdo, lse, delta, dk, dv, dq_acc, dq_sem, a...);          \
        } else {                                                                                                    \
            ab90_fused<T, D, SC, VL, DQA>(&tq, &tk, &tv, &tdo, lse, delta, dk, dv, dq_acc, dq_sem, nullptr, nullptr, \
                                          a...);                                                                    \
        }                                                                                                           \
    }
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_d64, 64, false, 1, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_d128, 128, false, 1, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_det_d64, 64, false, 2, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_det_d128, 128, false, 2, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_d64_softcap, 64, true, 1, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_d128_softcap, 128, true, 1, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_det_d64_softcap, 64, true, 2, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_det_d128_softcap, 128, true, 2, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_d256, 256, false, 1, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_det_d256, 256, false, 2, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_d256_softcap, 256, true, 1, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_det_d256_softcap, 256, true, 2, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_d96, 96, false, 1, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_det_d96, 96, false, 2, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_d96_softcap, 96, true, 1, false)
AB90_FUSED_ENTRY(attention_bwd_sm90_fused_det_d96_softcap, 96, true, 2, false)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_d64, 64, false, 1, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_d128, 128, false, 1, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_det_d64, 64, false, 2, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_det_d128, 128, false, 2, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_d64_softcap, 64, true, 1, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_d128_softcap, 128, true, 1, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_det_d64_softcap, 64, true, 2, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_det_d128_softcap, 128, true, 2, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_d256, 256, false, 1, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_det_d256, 256, false, 2, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_d256_softcap, 256, true, 1, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_det_d256_softcap, 256, true, 2, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_d96, 96, false, 1, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_det_d96, 96, false, 2, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_d96_softcap, 96, true, 1, true)
AB90_FUSED_ENTRY(attention_bwd_varlen_sm90_fused_det_d96_softcap, 96, true, 2, true)

// Dense (attention_backward): tensor maps over q / dO (batch, n_q, n_heads, D), k / v (batch, n_k, n_kv_heads, D),
// lse / delta (batch, n_q, n_heads); grid batch * kv heads * key tiles (dkdv) / batch * heads * query tiles (dq).
// Varlen (flash_attention_varlen_backward): tensor maps over the packed q / dO (1, total_q, n_heads, D) and k / v
// (1, total_k, n_kv_heads, D), lse / delta (total_q, n_heads), dk / dv (total_k, n_kv_heads, D), dq (total_q,
// n_heads, D); cu_seqlens int32 (batch + 1,); the grid the dense one at max_seqlen_q / max_seqlen_k; window sides
// normalized as the serving ops do (unbounded = 2^30, causal: window_right = 0), clamped per sequence.
// (The registry reads each parameter list from one object-like macro.)
#define AB90_DKDV_PARAMS                                                                                             \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv, int batch, int n_q, int n_k, int n_heads, int        \
    n_kv_heads, float scale, int window_left, int window_right)
#define AB90_DKDV_ARGS                                                                                               \
    (tq, tk, tv, tdo, lse, delta, dk, dv, nullptr, nullptr, batch, n_q, n_k, n_heads, n_kv_heads, scale,             \
    window_left, window_right)
#define AB90_DKDV_SC_PARAMS                                                                                          \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv, int batch, int n_q, int n_k, int n_heads, int        \
    n_kv_heads, float scale, int window_left, int window_right, float softcap)
#define AB90_DKDV_SC_ARGS                                                                                            \
    (tq, tk, tv, tdo, lse, delta, dk, dv, nullptr, nullptr, batch, n_q, n_k, n_heads, n_kv_heads, scale,             \
    window_left, window_right, softcap)
#define AB90_DQ_PARAMS                                                                                               \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dq, int batch, int n_q, int n_k, int n_heads, int n_kv_heads, float          \
    scale, int window_left, int window_right)
#define AB90_DQ_ARGS                                                                                                 \
    (tq, tk, tv, tdo, lse, delta, dq, nullptr, nullptr, batch, n_q, n_k, n_heads, n_kv_heads, scale,                 \
    window_left, window_right)
#define AB90_DQ_SC_PARAMS                                                                                            \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dq, int batch, int n_q, int n_k, int n_heads, int n_kv_heads, float          \
    scale, int window_left, int window_right, float softcap)
#define AB90_DQ_SC_ARGS                                                                                              \
    (tq, tk, tv, tdo, lse, delta, dq, nullptr, nullptr, batch, n_q, n_k, n_heads, n_kv_heads, scale,                 \
    window_left, window_right, softcap)
#define AB90_VL_DKDV_PARAMS                                                                                          \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv, const int* __restrict__ cu_seqlens_q, const          \
    int* __restrict__ cu_seqlens_k, int batch, int max_seqlen_q, int max_seqlen_k, int n_heads, int n_kv_heads,      \
    float scale, int window_left, int window_right)
#define AB90_VL_DKDV_ARGS                                                                                            \
    (tq, tk, tv, tdo, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q, max_seqlen_k,             \
    n_heads, n_kv_heads, scale, window_left, window_right)
#define AB90_VL_DKDV_SC_PARAMS                                                                                       \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv, const int* __restrict__ cu_seqlens_q, const          \
    int* __restrict__ cu_seqlens_k, int batch, int max_seqlen_q, int max_seqlen_k, int n_heads, int n_kv_heads,      \
    float scale, int window_left, int window_right, float softcap)
#define AB90_VL_DKDV_SC_ARGS                                                                                         \
    (tq, tk, tv, tdo, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q, max_seqlen_k,             \
    n_heads, n_kv_heads, scale, window_left, window_right, softcap)
#define AB90_VL_DQ_PARAMS                                                                                            \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dq, const int* __restrict__ cu_seqlens_q, const int* __restrict__            \
    cu_seqlens_k, int batch, int max_seqlen_q, int max_seqlen_k, int n_heads, int n_kv_heads, float scale, int       \
    window_left, int window_right)
#define AB90_VL_DQ_ARGS                                                                                              \
    (tq, tk, tv, tdo, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q, max_seqlen_k, n_heads,        \
    n_kv_heads, scale, window_left, window_right)
#define AB90_VL_DQ_SC_PARAMS                                                                                         \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dq, const int* __restrict__ cu_seqlens_q, const int* __restrict__            \
    cu_seqlens_k, int batch, int max_seqlen_q, int max_seqlen_k, int n_heads, int n_kv_heads, float scale, int       \
    window_left, int window_right, float softcap)
#define AB90_VL_DQ_SC_ARGS                                                                                           \
    (tq, tk, tv, tdo, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q, max_seqlen_k, n_heads,        \
    n_kv_heads, scale, window_left, window_right, softcap)
// The fused kernels: lse / delta the pre-pass's (batch, n_heads, nq_pad) runs (lse times log2 e), dq_acc fp32
// (batch, n_heads, nq_pad, D) zeroed, dq_sem (the _det kernels) int32 (batch, n_heads, query tiles of
// AB90_DKDV_STEP(D, D)) zeroed; nq_pad a multiple of 64 >= n_q; grid batch * kv heads * key tiles.
#define AB90_FUSED_PARAMS                                                                                            \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_acc, int* __restrict__        \
    dq_sem, int batch, int n_q, int n_k, int n_heads, int n_kv_heads, int nq_pad, float scale, int window_left, int  \
    window_right)
#define AB90_FUSED_ARGS                                                                                              \
    (tq, tk, tv, tdo, lse, delta, dk, dv, dq_acc, dq_sem, batch, n_q, n_k, n_heads, n_kv_heads, nq_pad, scale,        \
    window_left, window_right, 0.0f)
#define AB90_FUSED_SC_PARAMS                                                                                         \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_acc, int* __restrict__        \
    dq_sem, int batch, int n_q, int n_k, int n_heads, int n_kv_heads, int nq_pad, float scale, int window_left, int  \
    window_right, float softcap)
#define AB90_FUSED_SC_ARGS                                                                                           \
    (tq, tk, tv, tdo, lse, delta, dk, dv, dq_acc, dq_sem, batch, n_q, n_k, n_heads, n_kv_heads, nq_pad, scale,        \
    window_left, window_right, softcap)
// The varlen fused kernels: the varlen tensor maps and cu_seqlens; lse / delta the pre-pass's runs over the packed
// rows as one batch, (n_heads, nq_pad) (lse times log2 e), dq_acc fp32 (n_heads, nq_pad, D) zeroed (a token's
// row at its packed index), dq_sem (the _det kernels) int32 (batch, n_heads, query tiles of max_seqlen_q) zeroed;
// nq_pad a multiple of 64 >= total_q + 64 (a query tile's zero adds past a sequence's end stay inside the head's
// run); grid batch * kv heads * key tiles of max_seqlen_k.
#define AB90_VL_FUSED_PARAMS                                                                                         \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_acc, int* __restrict__        \
    dq_sem, const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k, int batch, int max_seqlen_q, \
    int max_seqlen_k, int n_heads, int n_kv_heads, int nq_pad, float scale, int window_left, int window_right)
#define AB90_VL_FUSED_ARGS                                                                                           \
    (tq, tk, tv, tdo, lse, delta, dk, dv, dq_acc, dq_sem, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q,           \
    max_seqlen_k, n_heads, n_kv_heads, nq_pad, scale, window_left, window_right, 0.0f)
#define AB90_VL_FUSED_SC_PARAMS                                                                                      \
    (const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk, const __grid_constant__         \
    CUtensorMap tv, const __grid_constant__ CUtensorMap tdo, const float* __restrict__ lse, const float*             \
    __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_acc, int* __restrict__        \
    dq_sem, const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k, int batch, int max_seqlen_q, \
    int max_seqlen_k, int n_heads, int n_kv_heads, int nq_pad, float scale, int window_left, int window_right,       \
    float softcap)
#define AB90_VL_FUSED_SC_ARGS                                                                                        \
    (tq, tk, tv, tdo, lse, delta, dk, dv, dq_acc, dq_sem, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q,           \
    max_seqlen_k, n_heads, n_kv_heads, nq_pad, scale, window_left, window_right, softcap)
PK_IO16_KERNELS(attention_bwd_sm90_fused_d64, (AB90_THREADS, 1), AB90_FUSED_PARAMS, AB90_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_d128, (AB90_THREADS, 1), AB90_FUSED_PARAMS, AB90_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_det_d64, (AB90_THREADS, 1), AB90_FUSED_PARAMS, AB90_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_det_d128, (AB90_THREADS, 1), AB90_FUSED_PARAMS, AB90_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_d64_softcap, (AB90_THREADS, 1), AB90_FUSED_SC_PARAMS, AB90_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_d128_softcap, (AB90_THREADS, 1), AB90_FUSED_SC_PARAMS, AB90_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_det_d64_softcap, (AB90_THREADS, 1), AB90_FUSED_SC_PARAMS, AB90_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_det_d128_softcap, (AB90_THREADS, 1), AB90_FUSED_SC_PARAMS, AB90_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_d64, (AB90_THREADS, 1), AB90_VL_FUSED_PARAMS, AB90_VL_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_d128, (AB90_THREADS, 1), AB90_VL_FUSED_PARAMS, AB90_VL_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_det_d64, (AB90_THREADS, 1), AB90_VL_FUSED_PARAMS, AB90_VL_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_det_d128, (AB90_THREADS, 1), AB90_VL_FUSED_PARAMS, AB90_VL_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_d64_softcap, (AB90_THREADS, 1), AB90_VL_FUSED_SC_PARAMS, AB90_VL_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_d128_softcap, (AB90_THREADS, 1), AB90_VL_FUSED_SC_PARAMS, AB90_VL_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_det_d64_softcap, (AB90_THREADS, 1), AB90_VL_FUSED_SC_PARAMS, AB90_VL_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_det_d128_softcap, (AB90_THREADS, 1), AB90_VL_FUSED_SC_PARAMS, AB90_VL_FUSED_SC_ARGS)
// head_dim 256: the split dK / dV kernel (64-key CTAs, AB90_DKDV_SPLIT) with dQ fused, its accumulator (batch,
// head, half, nq_pad, 128) (VL: (head, half, nq_pad, 128))
PK_IO16_KERNELS(attention_bwd_sm90_fused_d256, (AB90_THREADS, 1), AB90_FUSED_PARAMS, AB90_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_det_d256, (AB90_THREADS, 1), AB90_FUSED_PARAMS, AB90_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_d256_softcap, (AB90_THREADS, 1), AB90_FUSED_SC_PARAMS, AB90_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_det_d256_softcap, (AB90_THREADS, 1), AB90_FUSED_SC_PARAMS, AB90_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_d256, (AB90_THREADS, 1), AB90_VL_FUSED_PARAMS, AB90_VL_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_det_d256, (AB90_THREADS, 1), AB90_VL_FUSED_PARAMS, AB90_VL_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_d256_softcap, (AB90_THREADS, 1), AB90_VL_FUSED_SC_PARAMS, AB90_VL_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_det_d256_softcap, (AB90_THREADS, 1), AB90_VL_FUSED_SC_PARAMS, AB90_VL_FUSED_SC_ARGS)
// head_dim 96: the fused kernel on 32-column boxes (64B swizzle), as the pair's
PK_IO16_KERNELS(attention_bwd_sm90_fused_d96, (AB90_THREADS, 1), AB90_FUSED_PARAMS, AB90_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_det_d96, (AB90_THREADS, 1), AB90_FUSED_PARAMS, AB90_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_d96_softcap, (AB90_THREADS, 1), AB90_FUSED_SC_PARAMS, AB90_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_det_d96_softcap, (AB90_THREADS, 1), AB90_FUSED_SC_PARAMS, AB90_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_d96, (AB90_THREADS, 1), AB90_VL_FUSED_PARAMS, AB90_VL_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_det_d96, (AB90_THREADS, 1), AB90_VL_FUSED_PARAMS, AB90_VL_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_d96_softcap, (AB90_THREADS, 1), AB90_VL_FUSED_SC_PARAMS, AB90_VL_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_det_d96_softcap, (AB90_THREADS, 1), AB90_VL_FUSED_SC_PARAMS, AB90_VL_FUSED_SC_ARGS)
// 192 / 128: FlashAttention-3's tiling (ab90_fused_kt: 96-key CTAs, 64-query tiles), with and without softcap
PK_IO16_KERNELS(attention_bwd_sm90_fused_d192_dv128, (AB90_THREADS, 1), AB90_FUSED_PARAMS, AB90_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_det_d192_dv128, (AB90_THREADS, 1), AB90_FUSED_PARAMS, AB90_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_d192_dv128, (AB90_THREADS, 1), AB90_VL_FUSED_PARAMS, AB90_VL_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_det_d192_dv128, (AB90_THREADS, 1), AB90_VL_FUSED_PARAMS, AB90_VL_FUSED_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_d192_dv128_softcap, (AB90_THREADS, 1), AB90_FUSED_SC_PARAMS, AB90_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_fused_det_d192_dv128_softcap, (AB90_THREADS, 1), AB90_FUSED_SC_PARAMS, AB90_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_d192_dv128_softcap, (AB90_THREADS, 1), AB90_VL_FUSED_SC_PARAMS, AB90_VL_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_fused_det_d192_dv128_softcap, (AB90_THREADS, 1), AB90_VL_FUSED_SC_PARAMS, AB90_VL_FUSED_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d64, (AB90_THREADS, 1), AB90_DKDV_PARAMS, AB90_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d128, (AB90_THREADS, 1), AB90_DKDV_PARAMS, AB90_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d64_softcap, (AB90_THREADS, 1), AB90_DKDV_SC_PARAMS, AB90_DKDV_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d128_softcap, (AB90_THREADS, 1), AB90_DKDV_SC_PARAMS, AB90_DKDV_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dq_d64, (AB90_THREADS, 1), AB90_DQ_PARAMS, AB90_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dq_d128, (AB90_THREADS, 1), AB90_DQ_PARAMS, AB90_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dq_d64_softcap, (AB90_THREADS, 1), AB90_DQ_SC_PARAMS, AB90_DQ_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dq_d128_softcap, (AB90_THREADS, 1), AB90_DQ_SC_PARAMS, AB90_DQ_SC_ARGS)
// head_dim 256: both kernels, dense and varlen, with and without softcap (dK / dV: 64-key CTAs, AB90_DKDV_SPLIT)
PK_IO16_KERNELS(attention_bwd_sm90_dq_d256, (AB90_THREADS, 1), AB90_DQ_PARAMS, AB90_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dq_d256_softcap, (AB90_THREADS, 1), AB90_DQ_SC_PARAMS, AB90_DQ_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d256, (AB90_THREADS, 1), AB90_DKDV_PARAMS, AB90_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d256_softcap, (AB90_THREADS, 1), AB90_DKDV_SC_PARAMS, AB90_DKDV_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dkdv_d256, (AB90_THREADS, 1), AB90_VL_DKDV_PARAMS, AB90_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dkdv_d256_softcap, (AB90_THREADS, 1), AB90_VL_DKDV_SC_PARAMS, AB90_VL_DKDV_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dq_d256, (AB90_THREADS, 1), AB90_VL_DQ_PARAMS, AB90_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dq_d256_softcap, (AB90_THREADS, 1), AB90_VL_DQ_SC_PARAMS, AB90_VL_DQ_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dkdv_d64, (AB90_THREADS, 1), AB90_VL_DKDV_PARAMS, AB90_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dkdv_d128, (AB90_THREADS, 1), AB90_VL_DKDV_PARAMS, AB90_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dkdv_d64_softcap, (AB90_THREADS, 1), AB90_VL_DKDV_SC_PARAMS, AB90_VL_DKDV_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dkdv_d128_softcap, (AB90_THREADS, 1), AB90_VL_DKDV_SC_PARAMS, AB90_VL_DKDV_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dq_d64, (AB90_THREADS, 1), AB90_VL_DQ_PARAMS, AB90_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dq_d128, (AB90_THREADS, 1), AB90_VL_DQ_PARAMS, AB90_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dq_d64_softcap, (AB90_THREADS, 1), AB90_VL_DQ_SC_PARAMS, AB90_VL_DQ_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dq_d128_softcap, (AB90_THREADS, 1), AB90_VL_DQ_SC_PARAMS, AB90_VL_DQ_SC_ARGS)
// head_dim 96 and 192 / 128: both kernels, dense and varlen, with and without softcap
PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d96, (AB90_THREADS, 1), AB90_DKDV_PARAMS, AB90_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d192_dv128, (AB90_THREADS, 1), AB90_DKDV_PARAMS, AB90_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d96_softcap, (AB90_THREADS, 1), AB90_DKDV_SC_PARAMS, AB90_DKDV_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dkdv_d192_dv128_softcap, (AB90_THREADS, 1), AB90_DKDV_SC_PARAMS, AB90_DKDV_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dq_d96, (AB90_THREADS, 1), AB90_DQ_PARAMS, AB90_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dq_d192_dv128, (AB90_THREADS, 1), AB90_DQ_PARAMS, AB90_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dq_d96_softcap, (AB90_THREADS, 1), AB90_DQ_SC_PARAMS, AB90_DQ_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_sm90_dq_d192_dv128_softcap, (AB90_THREADS, 1), AB90_DQ_SC_PARAMS, AB90_DQ_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dkdv_d96, (AB90_THREADS, 1), AB90_VL_DKDV_PARAMS, AB90_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dkdv_d192_dv128, (AB90_THREADS, 1), AB90_VL_DKDV_PARAMS, AB90_VL_DKDV_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dkdv_d96_softcap, (AB90_THREADS, 1), AB90_VL_DKDV_SC_PARAMS, AB90_VL_DKDV_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dkdv_d192_dv128_softcap, (AB90_THREADS, 1), AB90_VL_DKDV_SC_PARAMS, AB90_VL_DKDV_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dq_d96, (AB90_THREADS, 1), AB90_VL_DQ_PARAMS, AB90_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dq_d192_dv128, (AB90_THREADS, 1), AB90_VL_DQ_PARAMS, AB90_VL_DQ_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dq_d96_softcap, (AB90_THREADS, 1), AB90_VL_DQ_SC_PARAMS, AB90_VL_DQ_SC_ARGS)
PK_IO16_KERNELS(attention_bwd_varlen_sm90_dq_d192_dv128_softcap, (AB90_THREADS, 1), AB90_VL_DQ_SC_PARAMS, AB90_VL_DQ_SC_ARGS)
