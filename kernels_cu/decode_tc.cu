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
// from counters[sequence * num_kv_heads + kv head] (release: every thread's stores, a barrier, then thread 0's
// atom.acq_rel.gpu inc); the CTA that draws the last ticket (acquire: that same RMW, then the barrier that
// hands the CTA the ticket, then strong ld.relaxed.gpu loads of the partials) merges every split's partial
// of its group with the merge math of paged_attn_merge (max-lse rescale in fp32; pa_merge_group_cta: the
// whole CTA, each split's lse and o in one round) and writes out (and lse). No CTA waits for another, so a
// persistent CTA's items may be any splits.
// The inc stores 0 on the last ticket (num_splits - 1), so each launch leaves its counters at zero
// for the next one (a CUDA graph replays them as they are). The counters are the plan's: zeroed once when
// allocated; two launches in flight at once must not share them.
// Work split: a work item is a (sequence, kv head, split), 4 warps a CTA, the warps splitting the keys;
// a tile of DTC_BC = 64 keys is 16 keys a warp, so each warp keeps its own (m, l, O) over its keys of
// every tile, and the 4 partial softmaxes are merged through shared memory at the item's end.
// A CTA takes items_per_cta consecutive items (item w = split * batch * num_kv_heads + sequence *
// num_kv_heads + kv head). With one an item the grid is one CTA an item, as many waves as that takes; a
// persistent grid (the plan's choice when the items exceed one wave: tools/bench_decode.py models both)
// gives each CTA several and streams them through one ring: the fill runs on into the next item, so its
// first tiles load while the current item's last tile computes and its merge runs in the slot just freed,
// and the fixed cost of a wave (the ring's first fill behind the dependent page-table loads, the last
// tile, the merge's stores) is paid once a CTA instead of once a wave.
// K/V pages stream through a STAGES-slot cp.async ring (16-byte LDGSTS, one barrier a tile):
// iteration i waits for tile i, then refills the slot tile i - 1 used with tile i + STAGES - 1 (of this item
// or the next ones), so STAGES - 1 tiles are in flight while one is computed. 16-bit rows padded to D + 8
// halves keep the 8 row addresses of an ldmatrix phase in distinct banks. Keys past the range are
// zero-filled (V garbage could be NaN, and 0 * NaN is NaN) and masked to -inf.
// Programmatic dependent launch: the kernels wait for the previous grid before their first access
// (pk_grid_dependency_wait), so the op may launch them with the attribute (enable_pdl=True).
// pykern: pdl decode_tc_paged_*
// Requirements the op checks: K/V element strides (page, token, head) of whole 16-byte chunks and 16-byte
// aligned bases (every copy is a 16-byte cp.async), 4 <= G <= 16.
#include "pk_attn_tile.cuh"
#include "pk_attn_tc.cuh"

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
//   V straight from the ring too: P V's B fragment wants a lane's two keys 2 t4, 2 t4 + 1 of one column.
//     ldmatrix.trans over the FP8 rows, its 16-bit elements being byte pairs (two columns), hands lane (g, t4)
//     of a matrix (8 keys x 16 bytes) one word: keys 2 t4 and 2 t4 + 1, columns 2 g and 2 g + 1, bytes
//     {k0 c0, k0 c1, k1 c0, k1 c1}. One byte permute (pk_prmt 0x3120) makes it {k0 c0, k1 c0, k0 c1, k1 c1},
//     which the cvt widens to the key pairs of column 2 g (lo) and of 2 g + 1 (hi): so the n-tiles of O take
//     the even and the odd columns of a 16-byte group (n = g <-> d = 2 g or 2 g + 1), and the merge reads
//     its rows back in that order (below). No V tile, no __syncwarp.
// Shared memory traffic a 64-key tile at d128: 16 KB copied in, 8 KB of K read, 8 KB of V read: 32 KB (the
// per-warp 16-bit V tile, written and read back, made it 64 KB; a K tile widened too, 96 KB).
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

// STAGES: ring slots; MINB: CTAs an SM asked of ptxas (sm_90's 228 KB of shared memory hold 3). sm_86 and
// sm_89 have 100 KB an SM, which holds one FP8 d128 CTA (71 KB): asking for 3 there would only cap its
// registers (and spill), never add a CTA.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 890)
#define DTC_MINB_FP8_D128 1
#else
#define DTC_MINB_FP8_D128 3
#endif
template <int D, bool FP8> struct DtcCfg;
template <> struct DtcCfg<64, false> { enum { STAGES = 3, MINB = 3 }; };
template <> struct DtcCfg<128, false> { enum { STAGES = 2, MINB = 3 }; };
template <> struct DtcCfg<64, true> { enum { STAGES = 3, MINB = 3 }; };
template <> struct DtcCfg<128, true> { enum { STAGES = 3, MINB = DTC_MINB_FP8_D128 }; };

// A ring row in bytes: the cache type's row, padded by 16 bytes (16-bit: D + 8 halves, which keeps the
// 8 row addresses of an ldmatrix phase in distinct banks).
#define DTC_RB(D, EB) ((D) * (EB) + 16)
// Dynamic shared memory (bytes): the ring (STAGES x (K, V) x BC rows), then Q (16 x (D + 8) halves, 16-bit
// K/V: read by ldmatrix every tile, which keeps its 32 registers free for the tile loop) or, FP8, the merge
// rows of warps 2 and 3 (2 x 16 x (D + 8) floats, the bytes of 4 x 16 x (D + 8) halves; FP8 keeps Q in
// registers, loaded from global memory, and a free ring slot holds only 2 warps' merge rows of fp32). An
// item's merge reuses a free ring slot (and FP8, that area). pykern/ops/serving.py dtc_smem_bytes is the same.
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
// positions) a fill; off() is its byte offset page * s_page + offset * s_tok, computed by the fill from the
// page loaded a tile ahead (the index load's latency hides behind a tile: nothing uses the value before). Rows
// past the range clamp to the sequence's last page (a valid index; their chunks are zero-filled, not read).
struct DtcRows {
    int pbeg;        // the sequence's page list: kv_indices + pbeg (indptr[b])
    int step_p, step_o, last;  // a tile in pages + positions; the last page's index
    int pi, po;  // this lane's row of the next tile to fill: page index, offset in the page
    int pg;      // its page, loaded here and first used by the fill a tile later
    __device__ __forceinline__ void locate(const int* __restrict__ kv_indices) {
        pg = kv_indices[(long long)pbeg + (pi < last ? pi : last)];
    }
    // sp / st: page and token strides in bytes (kernel parameters: no registers held for them)
    __device__ __forceinline__ long long off(long long sp, long long st) const {
        return (long long)pg * sp + (long long)po * st;
    }
    __device__ __forceinline__ void advance(int ps, const int* __restrict__ kv_indices) {
        po += step_o;
        pi += step_p;
        if (po >= ps) po -= ps, pi += 1;
        locate(kv_indices);
    }
};

// Rows [t0, t0 + BC) of the range into one ring slot (K rows at ks, V rows at vs, RB bytes apart). kb / vb:
// K / V bases (with this thread's chunk offset applied, or with CHUNK, applied here), hoff an offset of the
// item's head (bytes, the same for every thread: added before the lanes exchange their row offsets);
// rows.off(): the lanes' row offsets of this tile (each pass reads its rows' from the owning lanes); rem = end - t0, the keys left from the tile's
// first row: rows at or past the end land as zeros (cp.async's zero fill).
template <int D, int EB, bool CHUNK>
__device__ __forceinline__ void dtc_fill(const unsigned char* kb, const unsigned char* vb, long long hoff,
                                         const DtcRows& rows, long long sp, long long st, int rem, unsigned char* ks,
                                         unsigned char* vs) {
    using Gm = DtcGeom<D, EB>;
    // The lane's row of the warp's RPW a pass (rw) and its chunk c = tid % CH. A 16-byte copy is served a
    // quarter-warp (8 lanes, 128 bytes) at a time: rows of 4 chunks (FP8 d64, rows of RB = 80 bytes) would put
    // two consecutive rows in one phase, whose chunks (16-byte bank groups 5 r .. 5 r + 3 mod 8) meet in one group
    // (2 wavefronts); the phase takes rows q and q + 4 instead (groups 5 q .. 5 q + 3 and 5 q + 4 .. 5 q + 7:
    // conflict-free). The ring's layout (what ldmatrix reads) is the same. Rows of 8 or 16 chunks fill a phase
    // with one row's contiguous 128 bytes.
    const int lane = threadIdx.x & 31, c = threadIdx.x % Gm::CH;
    const int rw = Gm::CH == 4 ? (lane >> 3) + 4 * ((lane >> 2) & 1) : lane / Gm::CH;
    const int r0 = (int)(threadIdx.x >> 5) * Gm::RPW + rw;
    const unsigned int soff = (unsigned int)(r0 * Gm::RB + c * 16);
    const long long mine = rows.off(sp, st) + hoff;
    if constexpr (CHUNK) kb += c * 16, vb += c * 16;
#pragma unroll
    for (int k = 0; k < Gm::NP; k++) {
        const long long o = __shfl_sync(PK_FULL_MASK, mine, k * Gm::RPW + rw);
        const bool in = r0 + k * Gm::KPP < rem;
        const unsigned int so = soff + (unsigned int)(k * Gm::KPP * Gm::RB);
        pk_cp_async_16_zfill_at(ks, so, kb + o, in);
        pk_cp_async_16_zfill_at(vs, so, vb + o, in);
    }
}

// Four FP8 elements (a word, element i in byte i) to two T x2 (elements 0, 1 in lo, 2, 3 in hi), exact. f16:
// cvt.rn.f16x2.<fp8>x2 is the MMA operand itself (one instruction a pair on sm_89+, the word's upper half
// selected in the instruction); bf16: through fp32 (the f16 pairs widened, then packed to bf16x2).
template <typename T, int EB> struct DtcWiden {  // four elements (a word) into two T x2
    static __device__ __forceinline__ void x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
        static_assert(EB == 4 || EB == 5, "DtcWiden: e4m3 (EB 4) or e5m2 (EB 5)");
        constexpr bool F16 = Pk16<T>::is_f16;
        if constexpr (F16 && EB == 4) pk_cvt_f16x4_e4m3x4(w, lo, hi);
        else if constexpr (F16) pk_cvt_f16x4_e5m2x4(w, lo, hi);
        else if constexpr (EB == 4) pk_cvt_bf16x4_e4m3x4(w, lo, hi);
        else pk_cvt_bf16x4_e5m2x4(w, lo, hi);
    }
};

// The split epilogue (num_splits > 1), after this CTA has stored its partial rows [row0, row0 + G) of one
// split: a ticket from this (sequence, kv head)'s counter `ctr`; the last of the num_splits CTAs merges the
// group's rows from every split's partial (the whole CTA, pa_merge_group_cta) and writes out / lse. Every
// CTA of the grid runs this (an empty split stores lse -inf and counts like any other), so the count always completes.
template <typename T, int D>
__device__ __forceinline__ void dtc_split_fixup(T* part_o, float* part_lse, T* __restrict__ out,
                                                float* __restrict__ lse, int* __restrict__ counter,
                                                long long rows_total, long long row0, int G, int num_splits,
                                                int write_lse) {
    // Release: every thread's partial stores precede this barrier, and the barrier precedes thread 0's ticket,
    // an atom.acq_rel.gpu (pk_atom_inc_acq_rel_gpu): PTX release patterns are cumulative, so its release part
    // makes the whole CTA's partial stores visible GPU-wide before the new count (one round trip: the stores'
    // acknowledgement), with no fence in the other threads.
    __syncthreads();
    unsigned int* ctr = reinterpret_cast<unsigned int*>(counter);
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

// A work item: w = split * (batch * NKV) + b * NKV + kvh (the kv heads of a sequence adjacent: they share
// its page list, so the next item's page-table entries are mostly in cache already), and its sequence's
// page-table entries.
struct DtcItem {
    int split, b, kvh;
    __device__ __forceinline__ DtcItem(int w, unsigned int nkv, unsigned int bn) {
        split = (int)((unsigned int)w / bn);
        const int r = w - split * (int)bn;
        b = (int)((unsigned int)r / nkv);
        kvh = r - b * (int)nkv;
    }
};
struct DtcSeq {
    int p0, p1, lst;
    __device__ __forceinline__ void load(int b, const int* __restrict__ indptr, const int* __restrict__ last_len) {
        p0 = indptr[b];
        p1 = indptr[b + 1];
        lst = last_len[b];
    }
    // The item's keys [begin, end): the query is position L - 1 and sees [L - 1 - window_left, L - 1]
    // (window_left 2^30 = unbounded); with num_splits > 1, split's even share of that range rounded up to whole
    // tiles (as pa_body). Empty (begin >= end) for an empty sequence or a split past the range.
    __device__ __forceinline__ void range(int page_size, int window_left, int num_splits, int split, int& begin,
                                          int& end) const {
        const long long np = (long long)p1 - p0;
        const int lt = lst < 0 ? 0 : (lst > page_size ? page_size : lst);
        const long long l = np > 0 ? (np - 1) * page_size + lt : 0;
        const int L = l > (1ll << 30) ? (1 << 30) : (int)l;  // the op bounds lengths well below this
        const long long vlo = (long long)L - 1 - window_left;
        begin = vlo < 0 ? 0 : (int)vlo;
        end = L;
        if (num_splits > 1) {
            const int span = end - begin;
            const unsigned int pq = (unsigned int)span / (unsigned int)num_splits;
            int per = (int)pq + ((unsigned int)span != pq * (unsigned int)num_splits);
            per = (per + DTC_BC - 1) / DTC_BC * DTC_BC;
            const long long bg = (long long)per * split;
            begin = bg < span ? begin + (int)bg : end;
            end = end - begin > per ? begin + per : end;
        }
    }
};

// Q's A fragments of m16n8k16 for the G query rows of a group (row0: its first row of q), rows G..15 zero,
// straight from global memory (no shared memory: a persistent CTA loads the next item's Q while it merges the
// current one). 16-bit K: the standard order (a0 / a2: row g, d 2 t4 .. + 1 / + 8 of a k-step; a1 / a3 row
// g + 8); FP8 K: K's order (DtcFp8 above: a0 / a2 = d 4 t4 .. + 1 / + 2 .. + 3 of row g, a1 / a3 of g + 8).
template <typename T, int D, bool FP8>
__device__ __forceinline__ void dtc_load_q(const T* __restrict__ q, long long row0, int G, int g, int t4,
                                           unsigned int (&qa)[D / 16][4]) {
    const unsigned int* lo = reinterpret_cast<const unsigned int*>(q + row0 * D) + g * (D / 2);  // row g, words
    const unsigned int* hi = lo + 8 * (D / 2);                                                   // row g + 8
    const bool ul = g < G, uh = g + 8 < G;
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        if constexpr (FP8) {  // word loads straight into the fragment's order (no shuffle of wider loads)
            qa[ks][0] = ul ? lo[8 * ks + 2 * t4] : 0u;
            qa[ks][1] = uh ? hi[8 * ks + 2 * t4] : 0u;
            qa[ks][2] = ul ? lo[8 * ks + 2 * t4 + 1] : 0u;
            qa[ks][3] = uh ? hi[8 * ks + 2 * t4 + 1] : 0u;
        } else {
            qa[ks][0] = ul ? lo[8 * ks + t4] : 0u;
            qa[ks][1] = uh ? hi[8 * ks + t4] : 0u;
            qa[ks][2] = ul ? lo[8 * ks + 4 + t4] : 0u;
            qa[ks][3] = uh ? hi[8 * ks + 4 + t4] : 0u;
        }
    }
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
                                                 int write_lse, float scale, float k_scale, float v_scale,
                                                 int items_per_cta) {
    constexpr bool FP8 = DtcFp8<TKV>::ON;
    constexpr int EB = (int)sizeof(TKV);
    constexpr int STAGES = DtcCfg<D, FP8>::STAGES;
    constexpr int SD = D + 8;   // padded T row, in halves
    constexpr int RB = DTC_RB(D, EB);  // ring row, in bytes
    constexpr int KS = D / 16;  // k-steps of Q K^T
    constexpr int ON = D / 8;   // O n-tiles
    constexpr int SLOT = 2 * DTC_BC * RB;  // bytes of one ring slot (K rows, then V rows)
    constexpr int DO = D + 8;   // a row of the merge's fp32 o (see the merge below)
    extern __shared__ __align__(16) unsigned char dtc_smem[];
    unsigned short* tiles = reinterpret_cast<unsigned short*>(dtc_smem + STAGES * SLOT);  // past the ring
    unsigned short* qs = tiles;  // 16-bit: Q, [16][SD]
    // The merge's rows of warp w: in the ring slot no tile occupies between one tile and the next fill (16-bit:
    // the 4 warps' 16 rows of DO floats are exactly a slot), FP8: warps 0, 1 there and 2, 3 past the ring.
    static_assert(FP8 ? (2 * 16 * DO * 4 <= SLOT && 2 * 16 * DO * 4 <= 4 * 16 * SD * 2) : 4 * 16 * DO * 4 <= SLOT,
                  "the merge's rows fit a free ring slot (and FP8, the area past the ring)");

    // Launched with programmatic dependent launch (the op's enable_pdl), this CTA may be resident before the
    // previous kernel of the stream has finished: its launch and start overlap that kernel's tail. Nothing is
    // read (q, the page table, the pages the append just wrote) or written (the counters) before the wait.
    // The next PDL launch may start its CTAs as soon as all of these have started: it waits in turn.
    pk_grid_dependency_wait();
    pk_grid_launch_dependents();
    // Unsigned divisions (no sign fix-ups).
    const int H = num_qo_heads, NKV = num_kv_heads, G = (int)((unsigned int)H / (unsigned int)NKV);
    const unsigned int bn = (unsigned int)batch * (unsigned int)NKV;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    // This CTA's items [w0, wend), in order: one item a CTA, or (a persistent grid of at most one wave) several,
    // streamed through one ring: the next item's first tiles load while this one merges, and a wave's fixed
    // cost is paid once, not once an item.
    const long long wtot = (long long)bn * num_splits;
    const long long w0l = (long long)blockIdx.x * items_per_cta;
    const int w0 = (int)w0l, wend = (int)(w0l + items_per_cta < wtot ? w0l + items_per_cta : wtot);
    using Gm = DtcGeom<D, EB>;

    // The fill: the next tile of item f_w, f_rem of its keys from that tile on (<= 0: nothing left to fill).
    // DtcRows as before. 16-bit: kb / vb, the item's K / V bases (its head's and this thread's chunk offsets
    // applied: the fewest instructions a fill); FP8 keeps Q in registers and sits at the register cap, so it
    // keeps the item's kv head alone (f_kvh) and recomputes the offsets each fill. The tile loop fills its own
    // item's tiles only; the next item with keys is set up (feed_next) and its first STAGES - 1 tiles issued
    // after an item's last tile, while it merges: the item switch's registers never meet the tile loop's.
    DtcRows rows;
    rows.step_p = (int)((unsigned int)DTC_BC / (unsigned int)page_size);
    rows.step_o = DTC_BC - rows.step_p * page_size;
    int f_w = w0 - 1, f_rem = 0, f_kvh = 0;
    const unsigned char *kb = kraw, *vb = vraw;
    // Moves the fill to the next item with keys (the only divisions a fill sees, once an item), or past the last.
    auto feed_next = [&]() {
        for (;;) {
            if (++f_w >= wend) {
                f_rem = 0;
                return;
            }
            const DtcItem it(f_w, (unsigned int)NKV, bn);
            DtcSeq s;
            s.load(it.b, kv_indptr, kv_last_page_len);
            int bg, en;
            s.range(page_size, window_left, num_splits, it.split, bg, en);
            if (bg >= en) continue;
            f_rem = en - bg;
            rows.pbeg = s.p0;
            rows.last = s.p1 - s.p0 > 0 ? s.p1 - s.p0 - 1 : 0;
            // the row of each tile this lane's DtcRows tracks (lanes 16..31 mirror 0..15)
            const int frow = warp * Gm::RPW + ((lane & 15) / Gm::RPW) * Gm::KPP + (lane & 15) % Gm::RPW;
            const int p = bg + frow;
            rows.pi = (int)((unsigned int)p / (unsigned int)page_size);
            rows.po = p - rows.pi * page_size;
            rows.locate(kv_indices);
            if constexpr (FP8) {
                f_kvh = it.kvh;
            } else {
                const long long hoff = (long long)it.kvh * s_head * EB + (tid % Gm::CH) * 16;
                kb = kraw + hoff;
                vb = vraw + hoff;
            }
            return;
        }
    };
    // One ring slot's fill (one commit group, empty when nothing is left).
    auto feed = [&](int slot) {
        if (f_rem > 0) {
            if constexpr (FP8)
                dtc_fill<D, EB, true>(kraw, vraw, (long long)f_kvh * s_head * EB, rows, s_page * EB, s_tok * EB, f_rem,
                                      dtc_smem + slot * SLOT, dtc_smem + slot * SLOT + DTC_BC * RB);
            else
                dtc_fill<D, EB, false>(kb, vb, 0, rows, s_page * EB, s_tok * EB, f_rem, dtc_smem + slot * SLOT,
                                       dtc_smem + slot * SLOT + DTC_BC * RB);
            f_rem -= DTC_BC;
            if (f_rem > 0) rows.advance(page_size, kv_indices);
        }
        pk_cp_async_commit();
    };

    // 16-bit: the Q rows of the fill's item (rows G..15 zero-filled) into qs as 16-byte cp.async chunks (the op
    // checks q's 16-byte alignment; rows are D halves), in the commit group of that item's first tile: the
    // tile loop's first wait covers them. Called after feed_next, before the item's first feed.
    auto feed_q = [&]() {
        if constexpr (!FP8) {
            if (f_rem <= 0) return;
            const DtcItem it(f_w, (unsigned int)NKV, bn);
            const unsigned short* qw = reinterpret_cast<const unsigned short*>(q) +
                                       ((long long)it.b * H + (long long)it.kvh * G) * D;
#pragma unroll
            for (int j = 0; j < 16 * D / 8 / DTC_THREADS; j++) {
                const int c = tid + DTC_THREADS * j, r = c / (D / 8), cc = c - r * (D / 8);
                pk_cp_async_16_zfill_at(qs, (unsigned int)((r * SD + cc * 8) * 2), qw + (r < G ? r * D + cc * 8 : 0),
                                        r < G);
            }
        }
    };
    // The prologue. The first tile's copies wait on two dependent page-table round trips (the sequence's
    // entries, then its first pages' indices: feed_next), so those loads go first, right after the item
    // decode; everything else is issued while they are in flight: 16-bit Q's copies (feed_q) and FP8's Q loads
    // into registers (32 LDG a lane at d128, which issued ahead of the page table when they came first), then
    // the fills of slots 0 .. STAGES - 2 (the first one waits for the page indices).
    feed_next();
    feed_q();
    unsigned int qa[FP8 ? KS : 1][4];
    if constexpr (FP8) {
        if (w0 < wend) {
            const DtcItem it(w0, (unsigned int)NKV, bn);
            dtc_load_q<T, D, FP8>(q, (long long)it.b * H + (long long)it.kvh * G, G, g, t4, qa);
        }
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) feed(s);

    // ldmatrix addresses of the tile loop as shared-window integers (pk_saddr): this lane's row / column
    // offsets folded into one base a warp tile, each k-step / n-tile an immediate (a generic pointer an
    // access cost 64-bit address math). 16-bit K at kt + (nt * 8 * SD + kp2 * 32) * 2; FP8 K at kt + kp2 * 32
    // (V's lane -> row, column map over RB-byte rows of bytes: matrix j = lane / 8 is keys 8 (j & 1) .., bytes
    // 16 (j >> 1) ..: both n-tiles of two k-steps); 16-bit V at vt + np * 32 (16 columns), FP8 V at vt + np * 32
    // (32 columns: the same lane map as FP8 K, read transposed). kt / vt: a slot's base with the lane's offsets
    // folded in (kq0 / vq0: slot 0's).
    const int kb_row = lane & 7, kb_col = 8 * (lane >> 3);                             // K (B)
    const int vb_row = (lane & 7) + 8 * ((lane >> 3) & 1), vb_col = 8 * (lane >> 4);  // V (B, .trans)
    const unsigned int k_lane =
        FP8 ? (unsigned int)(vb_row * RB + vb_col * 2) : (unsigned int)((kb_row * SD + kb_col) * 2);
    const unsigned int v_lane = FP8 ? k_lane : (unsigned int)((vb_row * SD + vb_col) * 2);
    const pk_saddr kq0 = pk_saddr_of(dtc_smem + warp * DTC_KW * RB) + k_lane;  // this warp's 16 keys of slot 0
    // 16-bit Q (A) at q_lane + ks * 32: lane -> (row, col) of the 4 8x8 matrices it addresses
    const pk_saddr q_lane =
        pk_saddr_of(qs) + (unsigned int)((((lane & 7) + 8 * ((lane >> 3) & 1)) * SD + 8 * (lane >> 4)) * 2);
    const pk_saddr vq0 = pk_saddr_of(dtc_smem + warp * DTC_KW * RB + DTC_BC * RB) + v_lane;  // its 16 V rows
    using TQK = typename DtcPv<T, FP8>::type;  // the Q K^T operands' type: f16 for FP8 K/V (above), else T
    const long long rows_total = (long long)batch * H;

    int stage = 0;
    for (int w = w0; w < wend; w++) {
        if constexpr (FP8) {  // its Q (the first item's is in flight already; the next ones' prefetched into L1)
            if (w > w0) {
                const DtcItem nx(w, (unsigned int)NKV, bn);
                dtc_load_q<T, D, FP8>(q, (long long)nx.b * H + (long long)nx.kvh * G, G, g, t4, qa);
            }
        }
        // The item's range (its entries are cached: the fill loaded them up to a tile ago).
        int begin, end;
        {
            const DtcItem it(w, (unsigned int)NKV, bn);
            DtcSeq sq;
            sq.load(it.b, kv_indptr, kv_last_page_len);
            sq.range(page_size, window_left, num_splits, it.split, begin, end);
        }

        // FP8 K/V with bf16 q: Q K^T runs in f16 (K widens with one cvt a pair, no fp32 round trip). Q is
        // rescaled by 2^qe into f16's range once an item: qe puts the group's largest |q| in [2^14, 2^15) (every
        // warp holds all of Q, so each reduces the same maximum); q * 2^qe is exact in f16 for
        // |q| >= max |q| * 2^-32 (f16's subnormals still hold bf16's 8 bits there) and 2^-qe returns to the
        // score scale exactly (a power of 2).
        float qdescale = 1.0f;
        if constexpr (FP8 && !Pk16<T>::is_f16) {
            // f(x0, x1) for each pair of Q elements this lane holds, widened; the pair becomes what f leaves there
            auto each_q_pair = [&](auto&& f) {
#pragma unroll
                for (int ks = 0; ks < KS; ks++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        float x0, x1;
                        Pk16<T>::widen2(qa[ks][i], x0, x1);
                        f(x0, x1, qa[ks][i]);
                    }
            };
            float qm = 0.0f;
            each_q_pair([&](float x0, float x1, unsigned int&) { qm = fmaxf(qm, fmaxf(fabsf(x0), fabsf(x1))); });
#pragma unroll
            for (int o = 16; o >= 1; o >>= 1) qm = fmaxf(qm, __shfl_xor_sync(PK_FULL_MASK, qm, o));
            // unbiased exponent of qm (0 for 0, NaN or inf: no rescale), clamped so 2^qe and 2^-qe are normal
            const int ebits = (int)((__float_as_uint(qm) >> 23) & 0xffu);
            int qe = (ebits == 0 || ebits == 255) ? 0 : 14 - (ebits - 127);
            qe = qe < -126 ? -126 : (qe > 126 ? 126 : qe);
            const float up = __uint_as_float((unsigned int)(127 + qe) << 23);
            qdescale = __uint_as_float((unsigned int)(127 - qe) << 23);
            each_q_pair([&](float x0, float x1, unsigned int& w) { w = Pk16<__half>::narrow2(x0 * up, x1 * up); });
        }
        float o[ON][4];
#pragma unroll
        for (int i = 0; i < ON; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
        float m[2] = {PK_NEG_INF, PK_NEG_INF}, l[2] = {0.0f, 0.0f};  // rows g and g + 8, this warp's keys
        const float sl2 = scale * k_scale * PA_LOG2E * qdescale;

        for (int t0 = begin; t0 < end; t0 += DTC_BC) {
            pk_cp_async_wait<STAGES - 2>();  // this thread's copies of tile t0 have landed
            __syncthreads();                 // everyone's have; and every warp is done with the slot refilled next
            feed(stage == 0 ? STAGES - 1 : stage - 1);  // the slot the previous tile (or the merge) used
            const pk_saddr kt = kq0 + (unsigned int)(stage * SLOT);  // this warp's K rows in the ring
            const pk_saddr vt = vq0 + (unsigned int)(stage * SLOT);  // and its V rows
            stage = stage + 1 == STAGES ? 0 : stage + 1;

            float s[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
            for (int kp2 = 0; kp2 < D / 32; kp2++) {
                if constexpr (FP8) {
                    unsigned int kw[4];  // FP8 words of (n-tile j & 1, k-step 2 kp2 + (j >> 1)), 4 bytes of a key each
                    pk_ldmatrix_x4_s(kw, kt + (unsigned int)(kp2 * 32));
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        unsigned int kf[2];
                        DtcWiden<__half, DtcFp8<TKV>::EB>::x4(kw[j], kf[0], kf[1]);
                        pk_mma_m16n8k16<TQK>(s[j & 1], qa[2 * kp2 + (j >> 1)], kf, s[j & 1]);
                    }
                } else {
                    unsigned int qf[2][4];  // Q's A fragments of k-steps 2 kp2, 2 kp2 + 1
                    pk_ldmatrix_x4_s(qf[0], q_lane + (unsigned int)(kp2 * 64));
                    pk_ldmatrix_x4_s(qf[1], q_lane + (unsigned int)(kp2 * 64 + 32));
#pragma unroll
                    for (int nt = 0; nt < 2; nt++) {
                        unsigned int kf[4];  // b of k-step 2 kp2 in kf[0..1], of 2 kp2 + 1 in kf[2..3]
                        pk_ldmatrix_x4_s(kf, kt + (unsigned int)((nt * 8 * SD + kp2 * 32) * 2));
                        pk_mma_m16n8k16<TQK>(s[nt], qf[0], kf, s[nt]);
                        pk_mma_m16n8k16<TQK>(s[nt], qf[1], kf + 2, s[nt]);
                    }
                }
            }
            // Base 2, keys past the range masked, online softmax over this warp's 16 keys.
            const int kbase = t0 + warp * DTC_KW + 2 * t4;
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = kbase + nt * 8 + (e & 1) < end ? s[nt][e] * sl2 : PK_NEG_INF;
            fatc_online_softmax(s, o, m, l);
            // O += P V: S n-tiles 0, 1 are exactly the A fragment of the one k-step (in TP: DtcPv).
            using TP = typename DtcPv<T, FP8>::type;
            unsigned int pa[4];
            pa[0] = Pk16<TP>::narrow2(s[0][0], s[0][1]);
            pa[1] = Pk16<TP>::narrow2(s[0][2], s[0][3]);
            pa[2] = Pk16<TP>::narrow2(s[1][0], s[1][1]);
            pa[3] = Pk16<TP>::narrow2(s[1][2], s[1][3]);
            if constexpr (FP8) {
#pragma unroll
                for (int np = 0; np < D / 32; np++) {
                    // vw[2 h] / vw[2 h + 1]: keys 0..7 / 8..15 of columns 32 np + 16 h + 2 g, + 1 (DtcFp8 above)
                    unsigned int vw[4];
                    pk_ldmatrix_x4_trans_s(vw, vt + (unsigned int)(np * 32));
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        unsigned int ev[2], od[2];  // b of the even-column n-tile, of the odd-column one
                        DtcWiden<__half, DtcFp8<TKV>::EB>::x4(pk_prmt(vw[2 * h], 0u, 0x3120u), ev[0], od[0]);
                        DtcWiden<__half, DtcFp8<TKV>::EB>::x4(pk_prmt(vw[2 * h + 1], 0u, 0x3120u), ev[1], od[1]);
                        pk_mma_m16n8k16<TP>(o[4 * np + 2 * h], pa, ev, o[4 * np + 2 * h]);
                        pk_mma_m16n8k16<TP>(o[4 * np + 2 * h + 1], pa, od, o[4 * np + 2 * h + 1]);
                    }
                }
            } else {
#pragma unroll
                for (int np = 0; np < D / 16; np++) {
                    unsigned int vf[4];  // b of O n-tile 2 np in vf[0..1], of 2 np + 1 in vf[2..3]
                    pk_ldmatrix_x4_trans_s(vf, vt + (unsigned int)(np * 32));
                    pk_mma_m16n8k16<TP>(o[2 * np], pa, vf, o[2 * np]);
                    pk_mma_m16n8k16<TP>(o[2 * np + 1], pa, vf + 2, o[2 * np + 1]);
                }
            }
        }
        __syncthreads();  // every warp is done with the ring's slots: the merge's rows

        // Merge the 4 warps' partial softmaxes: warp w's 16 rows of DO floats, the row's m and l (log2 domain)
        // in its padding at D and D + 1. A row of D floats would put the 8 rows of a warp's fragment store in
        // the same banks (8 wavefronts a store where 2 hold it; measured: ncu counted half the kernel's shared
        // wavefronts as replays at batch 8 x 1k, H200, 2026-11-28, docs/measured/2026-11-28-h200-b.md); 8 floats
        // of padding shift each row by 32 bytes.
        const DtcItem cs(w, (unsigned int)NKV, bn);  // (recomputed here: fewer registers across the tile loop)
        const long long grow0 = (long long)cs.b * H + (long long)cs.kvh * G;  // the group's first row of q / out
        float* const slotf = reinterpret_cast<float*>(dtc_smem + (stage == 0 ? STAGES - 1 : stage - 1) * SLOT);
        auto orows = [&](int wp) -> float* {
            return FP8 && wp >= 2 ? reinterpret_cast<float*>(tiles) + (wp - 2) * 16 * DO : slotf + wp * 16 * DO;
        };
        {
            float* const ow = orows(warp);
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float lr = l[r];
                lr += __shfl_xor_sync(PK_FULL_MASK, lr, 1);
                lr += __shfl_xor_sync(PK_FULL_MASK, lr, 2);
                float* orow = ow + (g + 8 * r) * DO;
#pragma unroll
                for (int i = 0; i < ON; i++)
                    *reinterpret_cast<float2*>(orow + 2 * t4 + i * 8) = make_float2(o[i][2 * r], o[i][2 * r + 1]);
                if (t4 == 0) *reinterpret_cast<float2*>(orow + D) = make_float2(m[r], lr);
            }
        }
        if constexpr (FP8) {  // the next item's Q rows this lane loads at its start, into L1 meanwhile
            if (w + 1 < wend) {
                const DtcItem nx(w + 1, (unsigned int)NKV, bn);
                const T* qr = q + ((long long)nx.b * H + (long long)nx.kvh * G + g) * D;
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int c = 0; c < D * 2 / 128; c++)
                        if (g + 8 * r < G) pk_prefetch_l1(qr + r * 8 * D + c * 64);
            }
        }
        // The next item's first tiles, into the slots after this one's last (every slot but the merge's is
        // done: the barrier above; the tile loop's refills past the item's end were empty groups), and, 16-bit,
        // its Q (this one's reads are done): their loads fly while this item merges.
        if (begin < end) {
            feed_next();
            feed_q();
#pragma unroll
            for (int s = 0; s < STAGES - 1; s++) feed(stage + s < STAGES ? stage + s : stage + s - STAGES);
        }
        __syncthreads();
        // A thread a unit of 8 outputs of a row (G * D / 8 units: one pass for G <= 8 at d128): each float of
        // it as before, fmaf over the warps in order. A split's partial o is stored in T (one 16-byte store a
        // unit, rounded to nearest by the hardware conversion; its lse and every merge sum stay fp32).
        // The rows hold O's n-tiles in order, 8 floats each. 16-bit: n-tile i is columns 8 i .. 8 i + 7, so
        // outputs d .. d + 7 are floats d .. d + 3 (pe) and d + 4 .. d + 7 (po). FP8: in a 16-column group, the
        // n-tiles are its even and its odd columns (2 n, 2 n + 1: P V above), so outputs d .. d + 7 are
        // the even ones from pe = (d & ~15) + (d & 8) / 2 and the odd ones from po = pe + 8, interleaved.
        for (int u = tid; u < G * (D / 8); u += DTC_THREADS) {
            const int r = u / (D / 8), d = 8 * (u - r * (D / 8));
            const int pe = FP8 ? (d & ~15) + ((d & 8) >> 1) : d, po = FP8 ? pe + 8 : d + 4;
            float2 ml[4];
#pragma unroll
            for (int wp = 0; wp < 4; wp++) ml[wp] = *reinterpret_cast<const float2*>(orows(wp) + r * DO + D);
            float M = PK_NEG_INF;
#pragma unroll
            for (int wp = 0; wp < 4; wp++) M = fmaxf(M, ml[wp].x);
            // Bank groups: a quarter-warp's 8 units read 16 bytes every 32 (16-bit: pe = d; FP8 pe, po the same 2 of
            // every 4 groups), 2 wavefronts a read; units 4 .. 7 of each 8 (sw) read po first, so each read's 8
            // lanes cover the 8 groups once. x then holds the two halves (16-bit: d .. d + 3 and d + 4 .. d + 7)
            // or the even and odd outputs (FP8) swapped, put back after the sum: each output's fmaf chain and
            // order are as before, so the bits too.
            const bool sw = (u >> 2) & 1;
            const int pa = sw ? po : pe, pb = sw ? pe : po;
            float W = 0.0f, x[8];
#pragma unroll
            for (int e = 0; e < 8; e++) x[e] = 0.0f;
            if (M != PK_NEG_INF) {
#pragma unroll
                for (int wp = 0; wp < 4; wp++) {
                    const float mw = ml[wp].x;
                    const float f = mw == PK_NEG_INF ? 0.0f : pk_ex2_approx(mw - M);
                    W = fmaf(f, ml[wp].y, W);
                    const float4 ya = pk_ld_shared_v4(orows(wp) + r * DO + pa);
                    const float4 yb = pk_ld_shared_v4(orows(wp) + r * DO + pb);
                    // x[j] is output d + j (d + (j ^ SX) when sw): 16-bit ye then yo; FP8 ye, yo interleaved
                    // (even, odd columns)
                    const float y[8] = {ya.x, ya.y, ya.z, ya.w, yb.x, yb.y, yb.z, yb.w};
#pragma unroll
                    for (int j = 0; j < 8; j++) x[j] = fmaf(f, y[FP8 ? (j >> 1) + 4 * (j & 1) : j], x[j]);
                }
            }
            constexpr int SX = FP8 ? 1 : 4;  // the swapped outputs: j and j ^ SX
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (!(j & SX)) {
                    const float a = x[j], b = x[j + SX];
                    x[j] = sw ? b : a;
                    x[j + SX] = sw ? a : b;
                }
            const bool seen = W > 0.0f;
            const float sc = seen ? __fdividef(v_scale, W) : 0.0f;
            const float lse2 = seen ? M + __log2f(W) : PK_NEG_INF;
            const long long orow = grow0 + r;
            if (num_splits > 1) {
                const long long slot = (long long)cs.split * rows_total + orow;
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
        // (The merge's reads of its rows come before the next fill of that slot, or the next merge's writes:
        // both follow a barrier, the fixup's or the tile loop's or the one above.)
        if (num_splits > 1)
            dtc_split_fixup<T, D>(part_o, part_lse, out, lse, counters + (cs.b * NKV + cs.kvh), rows_total, grow0,
                                  G, num_splits, write_lse);
    }
    pk_cp_async_wait<0>();  // nothing is left in flight (the groups past the last item are empty)
}

// Entry points: decode_tc_paged_d{64,128}[_e4m3kv|_e5m2kv]_{bf16,f16}: q / out of T; K/V of T, or FP8.
// K/V pointers are T* (16-bit caches) or unsigned char* (FP8), read as bytes by the body.
template <typename T, int D, int KIND, typename KP>
__device__ __forceinline__ void dtc_paged_kind(const T* q, const KP* kq, const KP* vq, T* out,
                                               float* lse, T* part_o, float* part_lse, int* ctr, const int* ip,
                                               const int* ix, const int* ll, int h, int kvh, int ps, long long sp,
                                               long long st, long long sh, int wl, int ns, int batch, int wlse,
                                               float scale, float ks, float vs, int ipc) {
    const unsigned char* k = reinterpret_cast<const unsigned char*>(kq);
    const unsigned char* v = reinterpret_cast<const unsigned char*>(vq);
    if constexpr (KIND == 0) {
        dtc_paged_decode<T, D, T>(q, k, v, out, lse, part_o, part_lse, ctr, ip, ix, ll, h, kvh, ps, sp, st, sh, wl, ns,
                                  batch, wlse, scale, ks, vs, ipc);
    } else if constexpr (KIND == 4) {
        dtc_paged_decode<T, D, PkE4M3>(q, k, v, out, lse, part_o, part_lse, ctr, ip, ix, ll, h, kvh, ps, sp, st, sh, wl,
                                       ns, batch, wlse, scale, ks, vs, ipc);
    } else {
        dtc_paged_decode<T, D, PkE5M2>(q, k, v, out, lse, part_o, part_lse, ctr, ip, ix, ll, h, kvh, ps, sp, st, sh, wl,
                                       ns, batch, wlse, scale, ks, vs, ipc);
    }
}

PK_ATTN_TC_ENTRY(dtc_paged_entry, dtc_paged_kind)
PK_IO_VARIANT(decode_tc_paged_d64, dtc_paged_entry, 64, 0)
PK_IO_VARIANT(decode_tc_paged_d64_e4m3kv, dtc_paged_entry, 64, 4)
PK_IO_VARIANT(decode_tc_paged_d64_e5m2kv, dtc_paged_entry, 64, 5)
PK_IO_VARIANT(decode_tc_paged_d128, dtc_paged_entry, 128, 0)
PK_IO_VARIANT(decode_tc_paged_d128_e4m3kv, dtc_paged_entry, 128, 4)
PK_IO_VARIANT(decode_tc_paged_d128_e5m2kv, dtc_paged_entry, 128, 5)

// One parameter list for both cache types (KV: 16-bit pages of q's type, or FP8 bytes), written once.
#define DTC_PARAMS(KV)                                                                                      \
    (const T* __restrict__ q, const KV* __restrict__ k_pages, const KV* __restrict__ v_pages,                \
     T* __restrict__ out, float* __restrict__ lse, T* __restrict__ part_o, float* __restrict__ part_lse,      \
     int* __restrict__ counters, const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,       \
     const int* __restrict__ kv_last_page_len, int num_qo_heads, int num_kv_heads, int page_size,          \
     long long s_page, long long s_tok, long long s_head, int window_left, int num_splits, int batch,       \
     int write_lse, float scale, float k_scale, float v_scale, int items_per_cta)
#define DTC_PARAMS_16 DTC_PARAMS(T)
#define DTC_PARAMS_FP8 DTC_PARAMS(unsigned char)
#define DTC_ARGS                                                                                           \
    (q, k_pages, v_pages, out, lse, part_o, part_lse, counters, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, \
     num_kv_heads, page_size, s_page, s_tok, s_head, window_left, num_splits, batch, write_lse, scale,       \
     k_scale, v_scale, items_per_cta)
PK_IO16_KERNELS(decode_tc_paged_d64, (DTC_THREADS, DtcCfg<64, false>::MINB), DTC_PARAMS_16, DTC_ARGS)
PK_IO16_KERNELS(decode_tc_paged_d64_e4m3kv, (DTC_THREADS, DtcCfg<64, true>::MINB), DTC_PARAMS_FP8, DTC_ARGS)
PK_IO16_KERNELS(decode_tc_paged_d64_e5m2kv, (DTC_THREADS, DtcCfg<64, true>::MINB), DTC_PARAMS_FP8, DTC_ARGS)
PK_IO16_KERNELS(decode_tc_paged_d128, (DTC_THREADS, DtcCfg<128, false>::MINB), DTC_PARAMS_16, DTC_ARGS)
PK_IO16_KERNELS(decode_tc_paged_d128_e4m3kv, (DTC_THREADS, DtcCfg<128, true>::MINB), DTC_PARAMS_FP8, DTC_ARGS)
PK_IO16_KERNELS(decode_tc_paged_d128_e5m2kv, (DTC_THREADS, DtcCfg<128, true>::MINB), DTC_PARAMS_FP8, DTC_ARGS)
