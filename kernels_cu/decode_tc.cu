// Tensor-core paged decode for grouped-query attention (bf16 and f16: one template over the element type T),
// sm_80 and newer. Same conventions as paged.cu's paged_attn (FlashInfer's paged cache, CSR page table,
// window_left, split-KV partials merged by pa_merge_row), for the decode case of one query per sequence and
// a GQA group of G <= 16 query heads a kv head. The op (pykern/ops/serving.py) picks it for 1 <= G <= 16,
// head_dim 64 / 128, bf16 or f16 q with K/V of q's type or FP8 (e4m3 / e5m2, see DtcFp8), no softcap,
// 16-byte aligned pages; paged_attn otherwise.
//
// Why: paged_attn's scalar path redoes each K/V element's dot product once per query head (G FMAs an
// element), which leaves GQA decode issue-bound far below HBM bandwidth. Here the G query rows of a
// kv head, zero-padded to 16, are the M dimension of mma.sync m16n8k16, so one HMMA serves every head
// of the group and K/V bytes, not instructions, set the pace:
//   S = Q K^T : Q (16 x D) as A, kept in registers for the whole CTA; K as B through ldmatrix
//               (non-transposed: K rows are B's columns);
//   online softmax on the S accumulators in base 2 (scale * log2 e folded into one multiply);
//   O += P V  : P rounded to T straight from the S accumulator layout into the A layout, V as B through
//               ldmatrix.trans.
// Split-KV in one launch: with num_splits > 1 each split CTA writes its partial (o in T, rounded to nearest,
// as FlashInfer's split-KV decode stores it; log2 lse in fp32) to part_o / part_lse, then takes a ticket
// from counters[sequence * num_kv_heads + kv head] (release: every thread's stores, a barrier, then thread 0's atom.acq_rel.gpu inc); the CTA that draws the last ticket (acquire: that
// same RMW, then the barrier that hands the CTA the ticket, then strong ld.relaxed.gpu loads of the partials)
// merges every split's partial of its group with the merge math of paged_attn_merge (max-lse rescale in fp32;
// pa_merge_group_cta: the whole CTA, each split's lse and o in one round) and writes out (and lse).
// The inc stores 0 on the last ticket (num_splits - 1), so each launch leaves its counters at zero
// for the next one (a CUDA graph replays them as they are). The counters are the plan's: zeroed once when
// allocated; two launches in flight at once must not share them.
// Work split: one CTA of 4 warps per (sequence, kv head, split), the warps splitting the keys;
// a tile of DTC_BC = 64 keys is 16 keys a warp, so each warp keeps its own (m, l, O) over its keys of
// every tile, and the 4 partial softmaxes are merged through shared memory at the end.
// K/V pages stream through a STAGES-slot cp.async ring (16-byte LDGSTS, one barrier a tile):
// iteration i waits for tile i, then refills the slot tile i - 1 used with tile i + STAGES - 1, so
// STAGES - 1 tiles are in flight while one is computed. 16-bit rows padded to D + 8 halves keep the 8
// row addresses of an ldmatrix phase in distinct banks. Keys past the range are zero-filled (V garbage
// could be NaN, and 0 * NaN is NaN) and masked to -inf.
// Requirements the op checks: K/V element strides (page, token, head) of whole 16-byte chunks and 16-byte
// aligned bases (every copy is a 16-byte cp.async), 4 <= G <= 16.
#include "pk_attn_tile.cuh"
#include "pk_attention_tc.cuh"

#define DTC_THREADS 128
#define DTC_BC 64  // keys a tile: 16 a warp
#define DTC_KW 16

// K/V element: the 16-bit T itself, or an FP8 tag (PkE4M3 / PkE5M2 of pk_attn_tile.cuh). FP8 pages stream
// into the ring as bytes (half the bytes of bf16, so twice the keys a byte in flight) and are widened to f16
// in registers (hardware cvt.rn.f16x2.<fp8>x2 on sm_89+; exact: every e4m3 / e5m2 value is an f16 value):
//   K straight from the ring: a non-transposed ldmatrix of FP8 rows hands a lane 4 consecutive bytes of a
//     key, d = 4 t4 .. 4 t4 + 3 of a 16-byte k-step, which widen to the B fragment's two pairs; Q's A
//     fragment is read in the same order (k 2 t4, 2 t4 + 1 -> d 4 t4, 4 t4 + 1; k 2 t4 + 8, 2 t4 + 9 ->
//     d 4 t4 + 2, 4 t4 + 3). Q K^T sums over d, so the order is free, and K's bytes never leave the ring.
//   V through a per-warp 16-bit tile: P V needs V transposed (pairs of keys a lane), which ldmatrix.trans
//     gives 16-bit elements only, so each warp widens its own 16 V rows into its tile, which ldmatrix.trans
//     reads as in the 16-bit case; only __syncwarp orders it (no other warp touches those rows).
// Shared memory traffic a 64-key tile at d128: 16 KB copied in, 8 KB of K read, 8 KB of V read, 16 KB of V
// written and read back: 64 KB (a K tile widened too was 96 KB).
template <typename TKV> struct DtcFp8 { enum { ON = 0, EB = 0 }; };
template <> struct DtcFp8<PkE4M3> { enum { ON = 1, EB = 4 }; };
template <> struct DtcFp8<PkE5M2> { enum { ON = 1, EB = 5 }; };

// The P V operands' type: T, or f16 for FP8 K/V. Every e4m3 / e5m2 value is an f16 value, so V widens with
// the hardware cvt alone (no fp32 round trip and pack as for bf16: a quarter of the instructions), and P
// (in [0, 1]) rounds to f16's 11-bit significand instead of bf16's 8 (subnormal below 2^-14, where a key
// weighs under 2^-14 of the row's largest); the accumulation stays fp32. Q K^T runs in f16 as well: K widens
// with the one cvt a pair, and bf16 q is rescaled by a power of two into f16's range once a CTA (see
// dtc_paged_decode), its scores rescaled back exactly: K through fp32 to bf16 was 4 instructions a pair, 3 of
// them conversions, and the conversion pipe is what binds the FP8 decode (docs/serving.md).
template <typename T, bool FP8> struct DtcPv { typedef T type; };
template <typename T> struct DtcPv<T, true> { typedef __half type; };

// STAGES: ring slots; MINB: CTAs an SM asked of ptxas (shared memory allows 3 at 16-bit d64 / d128).
template <int D, bool FP8> struct DtcCfg;
template <> struct DtcCfg<64, false> { enum { STAGES = 3, MINB = 3 }; };
template <> struct DtcCfg<128, false> { enum { STAGES = 2, MINB = 3 }; };
template <> struct DtcCfg<64, true> { enum { STAGES = 3, MINB = 3 }; };
template <> struct DtcCfg<128, true> { enum { STAGES = 3, MINB = 3 }; };

// A ring row in bytes: the cache type's row, padded by 16 bytes (16-bit: D + 8 halves, which keeps the
// 8 row addresses of an ldmatrix phase in distinct banks).
#define DTC_RB(D, EB) ((D) * (EB) + 16)
// Dynamic shared memory (bytes): the ring (STAGES x (K, V) x BC rows), then Q (16 x (D + 8) halves) or, FP8,
// the per-warp 16-bit V tiles (4 x 16 x (D + 8) halves), which Q shares: Q is read into registers before the
// tile loop, whose first barrier comes before any warp widens into its tile. The end-of-CTA merge reuses the
// ring (4 x 16 x (D + 8) floats + 2 x 4 x 16 floats fit in it). pykern/ops/serving.py dtc_smem_bytes is the same.
#define DTC_SMEM_BYTES(D, EB, STAGES)                                                              \
    ((STAGES) * 2 * DTC_BC * DTC_RB(D, EB) + ((EB) == 1 ? 4 : 1) * 16 * ((D) + 8) * 2)

// Ring fill geometry: a 16-byte chunk of a row is EPC elements, a row CH chunks; thread tid copies chunk
// tid % CH of rows tid / CH + k * KPP, k < NP (KPP rows a pass, NP passes a tile). A warp's 32 lanes cover
// RPW = 32 / CH rows of a pass, so a warp fills 16 rows a tile: warp w's rows of pass k are
// w * RPW + k * KPP + (0 .. RPW - 1).
template <int D, int EB> struct DtcGeom {
    enum { RB = DTC_RB(D, EB), EPC = 16 / EB, CH = D / EPC, KPP = DTC_THREADS / CH, NP = DTC_BC / KPP, RPW = 32 / CH };
};

// Page lookup without division in the tile loop: lane j of a warp (j < 16; lanes 16..31 mirror 0..15) owns
// the warp's row j of every tile (pass j / RPW, row j % RPW of it) and keeps that row's position in the next
// tile to fill as (page index, offset in the page), advanced by one tile (BC = step_p pages + step_o
// positions) a fill; off is its byte offset page * s_page + offset * s_tok, with the page loaded a tile
// ahead of the fill that uses it (the index load's latency hides behind a tile). Rows past the range
// clamp to the sequence's last page (a valid index; their chunks are zero-filled, not read).
struct DtcRows {
    const int* idx;  // the sequence's page list (kv_indices + indptr[b])
    long long sp, st;  // page and token strides, bytes
    int ps, step_p, step_o, last;  // page size; a tile in pages + positions; the last page's index
    int pi, po;  // this lane's row of the next tile to fill: page index, offset in the page
    long long off;
    __device__ __forceinline__ void locate() {
        const long long page = idx[pi < last ? pi : last];
        off = page * sp + (long long)po * st;
    }
    __device__ __forceinline__ void advance() {
        po += step_o;
        pi += step_p;
        if (po >= ps) po -= ps, pi += 1;
        locate();
    }
};

// Rows [t0, t0 + BC) of the range into one ring slot (K rows at ks, V rows at vs, RB bytes apart). kb / vb:
// the K / V bases with this thread's head and chunk offsets applied; rows.off: the lanes' row offsets of
// this tile (each pass reads its rows' from the owning lanes); rem = end - t0 - (this thread's first row):
// rows at or past the end land as zeros (cp.async's zero fill).
template <int D, int EB>
__device__ __forceinline__ void dtc_fill(const unsigned char* kb, const unsigned char* vb, const DtcRows& rows,
                                         int rem, unsigned char* ks, unsigned char* vs) {
    using Gm = DtcGeom<D, EB>;
    const int lane = threadIdx.x & 31, c = threadIdx.x % Gm::CH, r0 = threadIdx.x / Gm::CH;
    const unsigned int soff = (unsigned int)(r0 * Gm::RB + c * 16);
#pragma unroll
    for (int k = 0; k < Gm::NP; k++) {
        const long long o = __shfl_sync(PK_FULL_MASK, rows.off, k * Gm::RPW + lane / Gm::CH);
        const bool in = k * Gm::KPP < rem;
        const unsigned int so = soff + (unsigned int)(k * Gm::KPP * Gm::RB);
        pk_cp_async_16_zfill_at(ks, so, kb + o, in);
        pk_cp_async_16_zfill_at(vs, so, vb + o, in);
    }
}

// Four FP8 elements (a word, element i in byte i) to two T x2 (elements 0, 1 in lo, 2, 3 in hi), exact. f16:
// cvt.rn.f16x2.<fp8>x2 is the MMA operand itself (one instruction a pair on sm_89+, the word's upper half
// selected in the instruction); bf16: through fp32 (the f16 pairs widened, then packed to bf16x2).
template <typename T, int EB> struct DtcWiden;  // four elements (a word) into two T x2
template <> struct DtcWiden<__half, 4> {
    static __device__ __forceinline__ void x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
        pk_cvt_f16x4_e4m3x4(w, lo, hi);
    }
};
template <> struct DtcWiden<__half, 5> {
    static __device__ __forceinline__ void x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
        pk_cvt_f16x4_e5m2x4(w, lo, hi);
    }
};
template <> struct DtcWiden<__nv_bfloat16, 4> {
    static __device__ __forceinline__ void x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
        pk_cvt_bf16x4_e4m3x4(w, lo, hi);
    }
};
template <> struct DtcWiden<__nv_bfloat16, 5> {
    static __device__ __forceinline__ void x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
        pk_cvt_bf16x4_e5m2x4(w, lo, hi);
    }
};

// FP8 -> f16 (DtcPv) for one warp: its 16 V rows of a ring slot (RB bytes a row) into its tile (16 rows of
// D + 8 halves). A lane widens 16 elements a step: one 16-byte read, eight pair conversions, two 16-byte writes.
template <int D, typename TKV>
__device__ __forceinline__ void dtc_widen(const unsigned char* src, unsigned short* tk) {
    constexpr int RB = DTC_RB(D, 1), SD = D + 8, CH = D / 16;  // 16-element chunks a row
    constexpr int RPS = 32 / CH;                               // rows a step (CH lanes a row)
    static_assert(32 % CH == 0 && 16 % RPS == 0, "whole rows a step");
    const int lane = threadIdx.x & 31;
    // this lane's chunk c of row r0 (+ RPS a step): a base each of K, V and the tile, every step an immediate
    const int r0 = lane / CH, c = lane - r0 * CH;
    const unsigned char* sq = src + r0 * RB + c * 16;
    unsigned short* tq = tk + r0 * SD + c * 16;
#pragma unroll
    for (int j = 0; j < 16 / RPS; j++) {
        const int rr = j * RPS;
        const uint4 x = *reinterpret_cast<const uint4*>(sq + rr * RB);
        const unsigned int w[4] = {x.x, x.y, x.z, x.w};
        unsigned int o[8];
        // f16 (DtcPv), one cvt a pair
#pragma unroll
        for (int e = 0; e < 4; e++) DtcWiden<__half, DtcFp8<TKV>::EB>::x4(w[e], o[2 * e], o[2 * e + 1]);
        uint4* dst = reinterpret_cast<uint4*>(tq + rr * SD);
        dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
        dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
    }
}

// The split epilogue (num_splits > 1), after this CTA has stored its partial rows [row0, row0 + G) of split
// blockIdx.z: a ticket from this (sequence, kv head)'s counter; the last of the num_splits CTAs merges the
// group's rows from every split's partial (the whole CTA, pa_merge_group_cta) and writes out / lse. Every
// CTA of the grid runs this (an empty split stores lse -inf and counts like any other), so the count always completes.
template <typename T, int D>
__device__ __forceinline__ void dtc_split_fixup(T* part_o, float* part_lse, T* __restrict__ out,
                                                float* __restrict__ lse, int* __restrict__ counters,
                                                long long rows_total, long long row0, int G, int num_splits,
                                                int write_lse) {
    // Release: every thread's partial stores precede this barrier, and the barrier precedes thread 0's ticket,
    // an atom.acq_rel.gpu (pk_atom_inc_acq_rel_gpu): PTX release patterns are cumulative, so its release part
    // makes the whole CTA's partial stores visible GPU-wide before the new count (one round trip: the stores'
    // acknowledgement), with no fence in the other threads.
    __syncthreads();
    unsigned int* ctr = reinterpret_cast<unsigned int*>(counters) + blockIdx.x;
    // The ticket wraps the last one (num_splits - 1) back to 0, which leaves the counter clean for the next
    // launch. Acquire: on the last ticket, thread 0's RMW reads the count the chain of the other splits'
    // release RMWs wrote, so their partial stores happen before thread 0's later accesses, and the barrier of
    // __syncthreads_or (bar.red, which synchronizes the CTA's threads) carries that to every thread's loads
    // below: no fence after the ticket (the strong loads still read at GPU scope, never a stale L1 line).
    const int last = __syncthreads_or(threadIdx.x == 0 && pk_atom_inc_acq_rel_gpu(ctr, (unsigned int)(num_splits - 1)) ==
                                                              (unsigned int)(num_splits - 1));
    if (!last) return;
    // The whole CTA merges (pa_merge_group_cta: each split's lse and o in the same round; registers and
    // shuffles only, no shared memory).
    pa_merge_group_cta<T, PaLdRelaxed, D, DTC_THREADS>(part_o, part_lse, out, lse, rows_total, row0, G, num_splits,
                                                       write_lse);
}

template <typename T, int D, typename TKV>
__device__ __forceinline__ void dtc_paged_decode(const T* __restrict__ q, const unsigned char* __restrict__ kraw,
                                                 const unsigned char* __restrict__ vraw, T* __restrict__ out,
                                                 float* __restrict__ lse, T* __restrict__ part_o,
                                                 float* __restrict__ part_lse, int* __restrict__ counters,
                                                 const int* __restrict__ kv_indptr,
                                                 const int* __restrict__ kv_indices,
                                                 const int* __restrict__ kv_last_page_len, int num_qo_heads,
                                                 int num_kv_heads, int page_size, long long s_page, long long s_tok,
                                                 long long s_head, int window_left, int num_splits, int batch,
                                                 int write_lse, float scale, float k_scale, float v_scale) {
    constexpr bool FP8 = DtcFp8<TKV>::ON;
    constexpr int EB = (int)sizeof(TKV);
    constexpr int STAGES = DtcCfg<D, FP8>::STAGES;
    constexpr int SD = D + 8;   // padded T row, in halves
    constexpr int RB = DTC_RB(D, EB);  // ring row, in bytes
    constexpr int KS = D / 16;  // k-steps of Q K^T
    constexpr int ON = D / 8;   // O n-tiles
    constexpr int SLOT = 2 * DTC_BC * RB;  // bytes of one ring slot (K rows, then V rows)
    extern __shared__ __align__(16) unsigned char dtc_smem[];
    unsigned short* tiles = reinterpret_cast<unsigned short*>(dtc_smem + STAGES * SLOT);  // FP8: [4][16][SD]
    unsigned short* qs = tiles;  // [16][SD]: FP8 shares it with the warps' tiles (DTC_SMEM_BYTES)

    // Unsigned divisions (no sign fix-ups; the two by NKV share one reciprocal).
    const int H = num_qo_heads, NKV = num_kv_heads, G = (int)((unsigned int)H / (unsigned int)NKV);
    const int b = (int)(blockIdx.x / (unsigned int)NKV), kvh = blockIdx.x - b * NKV;
    const int split = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;

    PagedKV kv = pa_paged_kv(kv_indptr, kv_indices, kv_last_page_len, page_size, s_page, s_tok, s_head);
    kv.init(b, kvh);
    const int L = kv.len;
    using Gm = DtcGeom<D, EB>;
    // The query is position L - 1: it sees [L - 1 - window_left, L - 1] (window_left 2^30 = unbounded).
    const long long vlo = (long long)L - 1 - window_left;
    int begin = vlo < 0 ? 0 : (int)vlo;
    int end = L;
    if (num_splits > 1) {  // as pa_body: an even split of the range, rounded up to whole tiles
        const int span = end - begin;
        const unsigned int pq = (unsigned int)span / (unsigned int)num_splits;
        int per = (int)pq + ((unsigned int)span != pq * (unsigned int)num_splits);
        per = (per + DTC_BC - 1) / DTC_BC * DTC_BC;
        const long long bg = (long long)per * split;
        begin = bg < span ? begin + (int)bg : end;
        end = end - begin > per ? begin + per : end;
    }

    // Q rows kvh * G .. + G of sequence b as 16-byte cp.async chunks (the op checks q's 16-byte alignment;
    // rows are D halves), zero-filled rows G..15, in the first commit group with tile 0: the wait before Q's
    // ldmatrix below covers them.
    const unsigned short* qw = reinterpret_cast<const unsigned short*>(q) + ((long long)b * H + (long long)kvh * G) * D;
#pragma unroll
    for (int j = 0; j < 16 * D / 8 / DTC_THREADS; j++) {
        const int c = tid + DTC_THREADS * j, r = c / (D / 8), cc = c - r * (D / 8);
        pk_cp_async_16_zfill_at(qs, (unsigned int)((r * SD + cc * 8) * 2), qw + (r < G ? r * D + cc * 8 : 0), r < G);
    }

    // Fill addressing (DtcRows): this lane's row of the warp's 16, its position in tile 0 as (page, offset)
    // (the only divisions, once a CTA), and this thread's K / V bases (head and chunk offsets folded in).
    DtcRows rows;
    const int r0 = tid / Gm::CH;  // this thread's first row of a tile
    {
        const int j = lane & 15;
        const int row = warp * Gm::RPW + (j / Gm::RPW) * Gm::KPP + j % Gm::RPW;
        rows.idx = kv_indices + kv.pbeg;
        rows.sp = s_page * EB;
        rows.st = s_tok * EB;
        rows.ps = page_size;
        rows.step_p = (int)((unsigned int)DTC_BC / (unsigned int)page_size);
        rows.step_o = DTC_BC - rows.step_p * page_size;
        const long long np = (long long)kv_indptr[b + 1] - kv.pbeg;
        rows.last = np > 0 ? (int)(np - 1) : 0;
        const int p0 = begin + row;
        rows.pi = (int)((unsigned int)p0 / (unsigned int)page_size);
        rows.po = p0 - rows.pi * page_size;
        rows.off = 0;
        if (begin < end) rows.locate();
    }
    const unsigned char* kb = kraw + kv.hoff * EB + (tid % Gm::CH) * 16;
    const unsigned char* vb = vraw + kv.hoff * EB + (tid % Gm::CH) * 16;

    // Prologue: tiles 0 .. STAGES - 2 of the range, one commit group each (empty past the end; Q in the first).
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        const int t0 = begin + s * DTC_BC;
        if (t0 < end) {
            dtc_fill<D, EB>(kb, vb, rows, end - t0 - r0, dtc_smem + s * SLOT, dtc_smem + s * SLOT + DTC_BC * RB);
            rows.advance();
        }
        pk_cp_async_commit();
    }
    pk_cp_async_wait<STAGES - 2>();  // this thread's Q chunks (group 0) have landed
    __syncthreads();                 // everyone's have

    // ldmatrix row addresses: lane -> (row, col) of the 4 8x8 matrices it addresses.
    const int a_row = (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);   // Q (A)
    const int kb_row = lane & 7, kb_col = 8 * (lane >> 3);                             // K (B)
    const int vb_row = (lane & 7) + 8 * ((lane >> 3) & 1), vb_col = 8 * (lane >> 4);  // V (B, .trans)
    unsigned int qa[KS][4];
    if constexpr (FP8) {  // in FP8 K's order (DtcFp8 above): a0 / a2 = d 4 t4 .. + 1 / + 2 .. + 3 of row g, a1 / a3 of g + 8
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            const uint2 lo = *reinterpret_cast<const uint2*>(qs + g * SD + ks * 16 + 4 * t4);
            const uint2 hi = *reinterpret_cast<const uint2*>(qs + (g + 8) * SD + ks * 16 + 4 * t4);
            qa[ks][0] = lo.x, qa[ks][1] = hi.x, qa[ks][2] = lo.y, qa[ks][3] = hi.y;
        }
    } else {
#pragma unroll
        for (int ks = 0; ks < KS; ks++) pk_ldmatrix_x4_s(qa[ks], pk_saddr_of(qs) + (unsigned int)((a_row * SD + a_col + ks * 16) * 2));
    }
    // FP8 K/V with bf16 q: Q K^T runs in f16 (K widens with one cvt a pair, no fp32 round trip). Q is rescaled
    // by 2^qe into f16's range once: qe puts the group's largest |q| in [2^14, 2^15) (every warp holds all of
    // Q, so each reduces the same maximum); q * 2^qe is exact in f16 for |q| >= max |q| * 2^-32 (f16's
    // subnormals still hold bf16's 8 bits there) and 2^-qe returns to the score scale exactly (a power of 2).
    float qdescale = 1.0f;
    if constexpr (FP8 && !Pk16<T>::is_f16) {
        float qm = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float x0, x1;
                Pk16<T>::widen2(qa[ks][i], x0, x1);
                qm = fmaxf(qm, fmaxf(fabsf(x0), fabsf(x1)));
            }
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) qm = fmaxf(qm, __shfl_xor_sync(PK_FULL_MASK, qm, o));
        // unbiased exponent of qm (0 for 0, NaN or inf: no rescale), clamped so 2^qe and 2^-qe are normal floats
        const int ebits = (int)((__float_as_uint(qm) >> 23) & 0xffu);
        int qe = (ebits == 0 || ebits == 255) ? 0 : 14 - (ebits - 127);
        qe = qe < -126 ? -126 : (qe > 126 ? 126 : qe);
        const float up = __uint_as_float((unsigned int)(127 + qe) << 23);
        qdescale = __uint_as_float((unsigned int)(127 - qe) << 23);
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float x0, x1;
                Pk16<T>::widen2(qa[ks][i], x0, x1);
                qa[ks][i] = Pk16<__half>::narrow2(x0 * up, x1 * up);
            }
    }
    // ldmatrix addresses of the tile loop as shared-window integers (pk_saddr): this lane's row / column
    // offsets folded into one base a warp tile, each k-step / n-tile an immediate (a generic pointer an
    // access cost 64-bit address math). 16-bit K at kt + k_lane + (nt * 8 * SD + kp2 * 32) * 2; FP8 K at
    // kt + k_lane + kp2 * 32 (V's lane -> row, column map over RB-byte rows of bytes: matrix j = lane / 8 is
    // keys 8 (j & 1) .., bytes 16 (j >> 1) ..: both n-tiles of two k-steps); V at vt + v_lane + np * 32.
    const unsigned int k_lane = FP8 ? (unsigned int)(vb_row * RB + vb_col * 2) : (unsigned int)((kb_row * SD + kb_col) * 2);
    const unsigned int v_lane = (unsigned int)((vb_row * SD + vb_col) * 2);
    const pk_saddr kt0 = pk_saddr_of(dtc_smem + warp * DTC_KW * RB);  // this warp's 16 keys of ring slot 0
    const pk_saddr vtile = pk_saddr_of(tiles + warp * 16 * SD);       // FP8: this warp's 16-bit V tile

    using TQK = typename DtcPv<T, FP8>::type;  // the Q K^T operands' type: f16 for FP8 K/V (above), else T
    float o[ON][4];
#pragma unroll
    for (int i = 0; i < ON; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m[2] = {PK_NEG_INF, PK_NEG_INF}, l[2] = {0.0f, 0.0f};  // rows g and g + 8, this warp's keys
    const float sl2 = scale * k_scale * PA_LOG2E * qdescale;

    int stage = 0;
    for (int t0 = begin; t0 < end; t0 += DTC_BC) {
        pk_cp_async_wait<STAGES - 2>();  // this thread's copies of tile t0 have landed
        __syncthreads();                 // everyone's have; and every warp is done with the slot refilled next
        {
            const int nt0 = t0 + (STAGES - 1) * DTC_BC;
            const int ns = stage == 0 ? STAGES - 1 : stage - 1;  // the slot tile t0 - BC used
            if (nt0 < end) {
                dtc_fill<D, EB>(kb, vb, rows, end - nt0 - r0, dtc_smem + ns * SLOT, dtc_smem + ns * SLOT + DTC_BC * RB);
                rows.advance();
            }
            pk_cp_async_commit();
        }
        const pk_saddr kt = kt0 + (unsigned int)(stage * SLOT);  // this warp's K rows in the ring
        pk_saddr vt;                                              // and the V rows P V reads
        if constexpr (FP8) {  // widen this warp's V rows into its own tile now, for P V below (the previous
                              // tile's V reads of it are done: the barrier above)
            dtc_widen<D, TKV>(dtc_smem + stage * SLOT + DTC_BC * RB + warp * DTC_KW * RB, tiles + warp * 16 * SD);
            vt = vtile;
        } else {
            vt = kt + (unsigned int)(DTC_BC * RB);
        }
        stage = stage + 1 == STAGES ? 0 : stage + 1;

        float s[2][4];
#pragma unroll
        for (int i = 0; i < 2; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kp2 = 0; kp2 < D / 32; kp2++) {
            if constexpr (FP8) {
                unsigned int kw[4];  // FP8 words of (n-tile j & 1, k-step 2 kp2 + (j >> 1)), 4 bytes of a key each
                pk_ldmatrix_x4_s(kw, kt + k_lane + (unsigned int)(kp2 * 32));
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    unsigned int kb[2];
                    DtcWiden<__half, DtcFp8<TKV>::EB>::x4(kw[j], kb[0], kb[1]);
                    pk_mma_m16n8k16<TQK>(s[j & 1], qa[2 * kp2 + (j >> 1)], kb, s[j & 1]);
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    unsigned int kb[4];  // b of k-step 2 kp2 in kb[0..1], of 2 kp2 + 1 in kb[2..3]
                    pk_ldmatrix_x4_s(kb, kt + k_lane + (unsigned int)((nt * 8 * SD + kp2 * 32) * 2));
                    pk_mma_m16n8k16<TQK>(s[nt], qa[2 * kp2], kb, s[nt]);
                    pk_mma_m16n8k16<TQK>(s[nt], qa[2 * kp2 + 1], kb + 2, s[nt]);
                }
            }
        }
        // Base 2, keys past the range masked, online softmax over this warp's 16 keys.
        const int kbase = t0 + warp * DTC_KW + 2 * t4;
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[nt][e] = kbase + nt * 8 + (e & 1) < end ? s[nt][e] * sl2 : PK_NEG_INF;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = fmaxf(m[r], fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1])));
            mx = fmaxf(mx, __shfl_xor_sync(PK_FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(PK_FULL_MASK, mx, 2));
            const float base = mx == PK_NEG_INF ? 0.0f : mx;  // nothing visible yet: stay at 0
            const float alpha = pk_ex2_approx(m[r] - base);
            m[r] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                s[nt][2 * r] = pk_ex2_approx(s[nt][2 * r] - base);
                s[nt][2 * r + 1] = pk_ex2_approx(s[nt][2 * r + 1] - base);
                sum += s[nt][2 * r] + s[nt][2 * r + 1];
            }
            l[r] = l[r] * alpha + sum;  // this lane's partial row sum; the quad reduces it at the end
#pragma unroll
            for (int i = 0; i < ON; i++) o[i][2 * r] *= alpha, o[i][2 * r + 1] *= alpha;
        }
        if constexpr (FP8) __syncwarp();  // every lane's V widening (above) is in the tile
        // O += P V: S n-tiles 0, 1 are exactly the A fragment of the one k-step (in TP: DtcPv).
        using TP = typename DtcPv<T, FP8>::type;
        unsigned int pa[4];
        pa[0] = Pk16<TP>::narrow2(s[0][0], s[0][1]);
        pa[1] = Pk16<TP>::narrow2(s[0][2], s[0][3]);
        pa[2] = Pk16<TP>::narrow2(s[1][0], s[1][1]);
        pa[3] = Pk16<TP>::narrow2(s[1][2], s[1][3]);
#pragma unroll
        for (int np = 0; np < D / 16; np++) {
            unsigned int vb[4];  // b of O n-tile 2 np in vb[0..1], of 2 np + 1 in vb[2..3]
            pk_ldmatrix_x4_trans_s(vb, vt + v_lane + (unsigned int)(np * 32));
            pk_mma_m16n8k16<TP>(o[2 * np], pa, vb, o[2 * np]);
            pk_mma_m16n8k16<TP>(o[2 * np + 1], pa, vb + 2, o[2 * np + 1]);
        }
    }
    pk_cp_async_wait<0>();  // nothing is left in flight (the last groups are empty)
    __syncthreads();         // every warp is done with the ring: the merge reuses it

    // Merge the 4 warps' partial softmaxes: Os [4][16][D + 8], Ms / Ls [4][16] (log2 domain) over the ring. A row
    // of D floats would put the 8 rows of a warp's fragment store in the same banks (8 wavefronts a store where 2
    // hold it; measured: ncu counted half the kernel's shared wavefronts as replays at batch 8 x 1k, H200,
    // 2026-11-28, docs/measured/2026-11-28-h200-b.md); 8 floats of padding shift each row by 32 bytes.
    constexpr int DO = D + 8;
    static_assert(4 * 16 * DO * 4 + 2 * 4 * 16 * 4 <= STAGES * SLOT, "the merge's buffers fit in the ring");
    float* Os = reinterpret_cast<float*>(dtc_smem);
    float* Ms = Os + 4 * 16 * DO;
    float* Ls = Ms + 4 * 16;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float lr = l[r];
        lr += __shfl_xor_sync(PK_FULL_MASK, lr, 1);
        lr += __shfl_xor_sync(PK_FULL_MASK, lr, 2);
        const int row = g + 8 * r;
        float* orow = Os + (warp * 16 + row) * DO + 2 * t4;
#pragma unroll
        for (int i = 0; i < ON; i++) *reinterpret_cast<float2*>(orow + i * 8) = make_float2(o[i][2 * r], o[i][2 * r + 1]);
        if (t4 == 0) {
            Ms[warp * 16 + row] = m[r];
            Ls[warp * 16 + row] = lr;
        }
    }
    __syncthreads();
    // A thread a unit of 8 outputs of a row (G * D / 8 units: one pass for G <= 8 at d128): each float of
    // it as before, fmaf over the warps in order. A split's partial o is stored in T (one 16-byte store a
    // unit, rounded to nearest by the hardware conversion; its lse and every merge sum stay fp32).
    const long long rows_total = (long long)batch * H;
    for (int u = tid; u < G * (D / 8); u += DTC_THREADS) {
        const int r = u / (D / 8), d = 8 * (u - r * (D / 8));
        float M = PK_NEG_INF;
#pragma unroll
        for (int w = 0; w < 4; w++) M = fmaxf(M, Ms[w * 16 + r]);
        float W = 0.0f, x[8];
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] = 0.0f;
        if (M != PK_NEG_INF) {
#pragma unroll
            for (int w = 0; w < 4; w++) {
                const float mw = Ms[w * 16 + r];
                const float f = mw == PK_NEG_INF ? 0.0f : pk_ex2_approx(mw - M);
                W = fmaf(f, Ls[w * 16 + r], W);
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    const float4 y = *reinterpret_cast<const float4*>(Os + (w * 16 + r) * DO + d + 4 * c);
                    x[4 * c] = fmaf(f, y.x, x[4 * c]);
                    x[4 * c + 1] = fmaf(f, y.y, x[4 * c + 1]);
                    x[4 * c + 2] = fmaf(f, y.z, x[4 * c + 2]);
                    x[4 * c + 3] = fmaf(f, y.w, x[4 * c + 3]);
                }
            }
        }
        const bool seen = W > 0.0f;
        const float sc = seen ? __fdividef(v_scale, W) : 0.0f;
        const float lse2 = seen ? M + __log2f(W) : PK_NEG_INF;
        const long long orow = (long long)b * H + (long long)kvh * G + r;
        if (num_splits > 1) {
            const long long slot = (long long)split * rows_total + orow;
            *reinterpret_cast<uint4*>(part_o + slot * D + d) =
                make_uint4(Pk16<T>::narrow2(x[0] * sc, x[1] * sc), Pk16<T>::narrow2(x[2] * sc, x[3] * sc),
                           Pk16<T>::narrow2(x[4] * sc, x[5] * sc), Pk16<T>::narrow2(x[6] * sc, x[7] * sc));
            if (d == 0) part_lse[slot] = lse2;
        } else {  // one 16-byte store a unit (the op routes an out not 16-byte aligned to paged_attn)
#pragma unroll
            for (int e = 0; e < 8; e++) x[e] *= sc;
            PkVec16<T>::store(out, orow * D + d, x);
            if (write_lse && d == 0) lse[orow] = seen ? lse2 * PA_LN2 : PK_NEG_INF;
        }
    }
    if (num_splits > 1) dtc_split_fixup<T, D>(part_o, part_lse, out, lse, counters, rows_total,
                                              (long long)b * H + (long long)kvh * G, G, num_splits, write_lse);
}

// Entry points: decode_tc_paged_d{64,128}[_e4m3kv|_e5m2kv]_{bf16,f16}: q / out of T; K/V of T, or FP8.
// K/V pointers are T* (16-bit caches) or unsigned char* (FP8), read as bytes by the body.
template <typename T, int D, int KIND, typename KP>
__device__ __forceinline__ void dtc_paged_kind(const T* q, const KP* kq, const KP* vq, T* out,
                                               float* lse, T* part_o, float* part_lse, int* ctr, const int* ip,
                                               const int* ix, const int* ll, int h, int kvh, int ps, long long sp,
                                               long long st, long long sh, int wl, int ns, int batch, int wlse,
                                               float scale, float ks, float vs) {
    const unsigned char* k = reinterpret_cast<const unsigned char*>(kq);
    const unsigned char* v = reinterpret_cast<const unsigned char*>(vq);
    if constexpr (KIND == 0) {
        dtc_paged_decode<T, D, T>(q, k, v, out, lse, part_o, part_lse, ctr, ip, ix, ll, h, kvh, ps, sp, st, sh, wl, ns,
                                  batch, wlse, scale, ks, vs);
    } else if constexpr (KIND == 4) {
        dtc_paged_decode<T, D, PkE4M3>(q, k, v, out, lse, part_o, part_lse, ctr, ip, ix, ll, h, kvh, ps, sp, st, sh, wl,
                                       ns, batch, wlse, scale, ks, vs);
    } else {
        dtc_paged_decode<T, D, PkE5M2>(q, k, v, out, lse, part_o, part_lse, ctr, ip, ix, ll, h, kvh, ps, sp, st, sh, wl,
                                       ns, batch, wlse, scale, ks, vs);
    }
}

PK_ATTN_TC_ENTRY(dtc_paged_entry, dtc_paged_kind)
PK_IO_VARIANT(decode_tc_paged_d64, dtc_paged_entry, 64, 0)
PK_IO_VARIANT(decode_tc_paged_d64_e4m3kv, dtc_paged_entry, 64, 4)
PK_IO_VARIANT(decode_tc_paged_d64_e5m2kv, dtc_paged_entry, 64, 5)
PK_IO_VARIANT(decode_tc_paged_d128, dtc_paged_entry, 128, 0)
PK_IO_VARIANT(decode_tc_paged_d128_e4m3kv, dtc_paged_entry, 128, 4)
PK_IO_VARIANT(decode_tc_paged_d128_e5m2kv, dtc_paged_entry, 128, 5)

// One parameter list a cache type (16-bit pages of q's type, or FP8 bytes), written once.
#define DTC_PARAMS_16 \
    (const T* __restrict__ q, const T* __restrict__ k_pages, const T* __restrict__ v_pages,                    \
     T* __restrict__ out, float* __restrict__ lse, T* __restrict__ part_o, float* __restrict__ part_lse,      \
     int* __restrict__ counters, const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,                                \
     const int* __restrict__ kv_last_page_len, int num_qo_heads, int num_kv_heads, int page_size,          \
     long long s_page, long long s_tok, long long s_head, int window_left, int num_splits, int batch,       \
     int write_lse, float scale, float k_scale, float v_scale)
#define DTC_PARAMS_FP8 \
    (const T* __restrict__ q, const unsigned char* __restrict__ k_pages,                                    \
     const unsigned char* __restrict__ v_pages,                                                             \
     T* __restrict__ out, float* __restrict__ lse, T* __restrict__ part_o, float* __restrict__ part_lse,      \
     int* __restrict__ counters, const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,                                \
     const int* __restrict__ kv_last_page_len, int num_qo_heads, int num_kv_heads, int page_size,          \
     long long s_page, long long s_tok, long long s_head, int window_left, int num_splits, int batch,       \
     int write_lse, float scale, float k_scale, float v_scale)
#define DTC_ARGS                                                                                           \
    (q, k_pages, v_pages, out, lse, part_o, part_lse, counters, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, \
     num_kv_heads, page_size, s_page, s_tok, s_head, window_left, num_splits, batch, write_lse, scale,       \
     k_scale, v_scale)
PK_IO16_KERNELS(decode_tc_paged_d64, (DTC_THREADS, DtcCfg<64, false>::MINB), DTC_PARAMS_16, DTC_ARGS)
PK_IO16_KERNELS(decode_tc_paged_d64_e4m3kv, (DTC_THREADS, DtcCfg<64, true>::MINB), DTC_PARAMS_FP8, DTC_ARGS)
PK_IO16_KERNELS(decode_tc_paged_d64_e5m2kv, (DTC_THREADS, DtcCfg<64, true>::MINB), DTC_PARAMS_FP8, DTC_ARGS)
PK_IO16_KERNELS(decode_tc_paged_d128, (DTC_THREADS, DtcCfg<128, false>::MINB), DTC_PARAMS_16, DTC_ARGS)
PK_IO16_KERNELS(decode_tc_paged_d128_e4m3kv, (DTC_THREADS, DtcCfg<128, true>::MINB), DTC_PARAMS_FP8, DTC_ARGS)
PK_IO16_KERNELS(decode_tc_paged_d128_e5m2kv, (DTC_THREADS, DtcCfg<128, true>::MINB), DTC_PARAMS_FP8, DTC_ARGS)
