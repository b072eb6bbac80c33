// Sampling (FlashInfer's names and semantics): sampling from probabilities with top-k, top-p
// (nucleus), top-k + top-p and min-p filters, top-k / top-p renormalization, top-k logit
// masking and chain speculative sampling (at the end of the file). One CTA per row (per request for
// the speculative kernel), except the draws, whose rows may be split over gridDim.y CTAs (sp_split_last; top-k then
// top-p keeps one); top-k / top-p draw by rejection rounds with two pivots (sp_reject), the renorm / mask ops and
// top-k-first's top-k by radix selects; pykern/ops/sampling.py documents the user-facing contract.
//
// Everything that decides WHICH token comes out is integer arithmetic, so the result is a
// deterministic function of (the row, the parameters, one Philox draw): the same on every
// backend, every block size and every reduction order, and the numba reference
// (pykern/reference/sampling.py) reproduces it bit for bit with a one-thread loop.
//
// - Keys: the fp32 bits of a value order like the value: probs are sanitized first (NaN,
//   negative and inf count as 0), so their bits order as unsigned ints; logits use the usual
//   sign-flip mapping (NaN lowest, -0 == +0).
// - Bad rows: a probability row holding a NaN, an inf or a negative value is no distribution. The pass that
//   finds the row maximum also ORs "some entry is not in [0, inf)" over the block (SpRow::bad); such a row
//   samples no token (token 0, valid 0, as a row without mass) and renormalizes to NaN, never to a
//   plausible distribution over its other entries.
// - Mass: a probability p becomes the integer floor(p * 2^(SP_F - e)), where 2^(e-1) <= max < 2^e
//   is the row maximum's binade: at most 2^SP_F per entry, sums of up to 2^22 entries fit in
//   64 bits, no overflow and no rounding; sums are associative, so any reduction order agrees.
// - From logits (sampling_from_logits, SPM_LOGITS): the same kernel with logit keys (softmax keeps the order, so
//   top-k's select is unchanged) and, as mass, the softmax in the same fixed point without writing it:
//   2^SP_F * 2^f, f = (x - max) * c, c = log2(e) / T, by three IEEE float operations (the f, its floor's remainder
//   and a power-of-two scaling) and an integer polynomial (sp_exp_mass): the maximum gets 2^SP_F exactly and every
//   backend the same integers. A NaN or +inf logit (or a row of -inf) makes no distribution: no token.
// - Thresholds: every filter keeps the entries with key >= T (ties at the boundary all kept, as
//   FlashInfer's pivot search does). T comes from a radix select over the 32-bit keys
//   (passes of 11, 11 and 10 bits, a 2048-bin histogram in shared memory, each pass's bin from a
//   block-wide suffix scan; bf16 / f16 keys have their low 16 / 13 bits 0, so two passes, 11 and
//   5 / 8 bits, decide them): by count for top-k (T = the k-th largest value), by mass for top-p
//   (T = the largest value whose "mass at or above" reaches top_p * total); min-p's T is the key
//   of min_p * max. No sort of the vocabulary.
// - Row reads: what needs no result of another pass shares its read. The row maximum rides along
//   with top-k's first pass, top-p's total is the sum of its first histogram, and a select's last
//   pass also sums the kept mass S (mass of the keys >= the final floor). Full reads of a row, f32 /
//   bf16 and f16 (a select reads it 3 / 2 times; the draw's read stops at the window that holds it):
//     sampling, no filter or min-p: max, S with the draw's sums          2 / 2 (rows over one window: 3)
//       split over C CTAs: each the max, its range's S; the last one range  1 + 1/C (the last 1 + 2/C)
//     top-k, top-p, top-k + top-p joint (+ min-p): the rejection rounds (sp_reject): max, S with the segment
//       sums, a count read a rejected round (each draw one segment)    2 + the count reads (top-p + min-p: 1 more)
//       split over C CTAs: max, 1/C of S; the last one its range, then the count reads   1 + 2/C + the count reads
//     top-k then top-p: max with the top-k select, then the rounds in the top-k set     3 / 2 + count reads + draws
//     top_k_renorm_probs: max with the select, write                     4 / 3 (k disabled: the copy, 1)
//     top_p_renorm_probs: max, select, write                             5 / 4 (top_p >= 1: max, S, write, 3)
//     top_k_mask_logits: select, write                                   4 / 3
//     sampling_from_logits: as sampling (max, S with the draw)           2 / 2
//     top_k_top_p_sampling_from_logits: as top-k + top-p
//     softmax (its own kernel, float math): max with sum, write          2 / 2 (and one write)
// - The draw: r = word 0 of Philox4x32-10(key = seed, counter = (offset, row, 0)); the sample
//   is the first kept index whose inclusive prefix mass exceeds floor(r * S / 2^32), S the kept
//   mass: per-warp sums of the row in vocabulary order, one block scan a window of them, then one warp's
//   walk of the 32 * VEC entries that hold it (sp_find_draw). Top-k / top-p: round j's draw takes the word at
//   counter (offset, row, j) over the entries with key >= the round's floor (sp_reject; round 0's is the plain draw).
//
// Each family is written once over the element type (f32, bf16, f16: PK_IO_KERNELS). Rows are read in
// 16-byte vectors (4 f32 or 8 bf16 / f16) when the row length is a multiple of the
// vector and the pointers are aligned, else one element per thread; offsets are 64-bit.
//
// Programmatic dependent launch (the ops' enable_pdl): the draws and the softmax wait for the previous kernel of the
// stream (the decode or the projection that wrote the row, the previous draw that wrapped a split row's tickets back
// to 0) before their first global access (pk_grid_dependency_wait), then let the next PDL launch (the next step's
// append) start its CTAs, which wait in turn.
// pykern: pdl sampling_from_probs*, sampling_from_logits*, sampling_softmax*
#include "pk_vec.cuh"
#include "pk_ptx.cuh"  // the split rows' ticket (release / acquire) and strong loads; the PDL wait

#define SP_NT 512            // threads per CTA; kept in step with pykern/ops/sampling.py
#define SP_NW (SP_NT / 32)
#define SP_F 40              // fixed-point bits of mass below the row maximum's binade
#define SP_POS_INF (__int_as_float(0x7f800000))

// flags of sampling_from_probs
#define SPF_INDICES 1
#define SPF_TOP_K 2
#define SPF_TOP_P 4
#define SPF_MIN_P 8
#define SPF_TOP_K_FIRST 16
#define SPF_K_ARR 32
#define SPF_P_ARR 64
#define SPF_MINP_ARR 128
#define SPF_SEED_ARR 256
#define SPF_OFFSET_ARR 512
// flags of sampling_renorm_probs / top_k_mask_logits
#define SRF_TOP_K 1
#define SRF_K_ARR 2
#define SRF_P_ARR 4

// flags of sampling_from_logits (with the SPF_* above)
#define SPF_T_ARR 1024       // per-row temperature array (else the scale c_val)

// What a row holds (the row templates' MODE): probabilities (keys of the sanitized values, mass sp_mass); logits
// whose keys alone matter (top_k_mask_logits: sign-flipped keys, no mass); logits sampled through their softmax
// (sign-flipped keys, mass sp_exp_mass).
#define SPM_PROBS 0
#define SPM_MASK 1
#define SPM_LOGITS 2

#define SP_BINS 2048         // radix histogram: digits of 11, 11 and 10 bits (SP_NT * 4 bins)

struct SpShared {
    // 16 KiB. A count select counts in 32 bits (cnt: a native shared-memory add, where a 64-bit add compiles to a
    // compare-and-swap loop), in the bottom half; its last pass keeps its mass in the top half of hist. Masses go
    // into hist by sp_hist_add, as 32-bit adds on its words (little-endian: hist[i] is cnt[2i], cnt[2i + 1]).
    union {
        unsigned long long hist[SP_BINS];
        unsigned int cnt[2 * SP_BINS];
    };
    unsigned long long red[SP_NW];
    unsigned long long sel_above;
    unsigned int sel_bin;
    int found;
};

// ------------------------------------------------------------------------------ Philox4x32-10
__device__ __forceinline__ void sp_philox(unsigned int c[4], unsigned int k0, unsigned int k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const unsigned int lo0 = 0xD2511F53u * c[0], hi0 = __umulhi(0xD2511F53u, c[0]);
        const unsigned int lo1 = 0xCD9E8D57u * c[2], hi1 = __umulhi(0xCD9E8D57u, c[2]);
        const unsigned int n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    }
}

// Word 0 of Philox4x32-10 with key (seed_lo, seed_hi) at counter (offset_lo, offset_hi, row, 0).
extern "C" __global__ void __launch_bounds__(256) sampling_philox(unsigned int* out, int n, unsigned int seed_lo,
        unsigned int seed_hi, unsigned int offset_lo, unsigned int offset_hi) {
    // The generator alone, for the known-answer tests: out[4*i .. 4*i+3] is the block at row i.
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned int c[4] = {offset_lo, offset_hi, (unsigned int)i, 0u};
    sp_philox(c, seed_lo, seed_hi);
    for (int j = 0; j < 4; ++j) out[4 * (long long)i + j] = c[j];
}

// ------------------------------------------------------------------------------ keys and mass
__device__ __forceinline__ unsigned int sp_prob_key(float p) {
    // NaN fails the first test, inf the second: both count as 0, as negative values do.
    return (p > 0.0f && p < SP_POS_INF) ? __float_as_uint(p) : 0u;
}

// Not a probability: NaN (fails both tests), negative or +inf (-0 passes).
__device__ __forceinline__ bool sp_prob_bad(float p) { return !(p >= 0.0f && p < SP_POS_INF); }

__device__ __forceinline__ unsigned int sp_logit_key(float x) {
    if (x != x) return 0u;          // NaN: below every number
    if (x == 0.0f) return 0x80000000u;  // -0 == +0
    const unsigned int b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// floor(p * 2^sh) of the sanitized probability with bits `key`, exactly. p * 2^sh is a power-of-two scaling of
// a float: exact wherever it is >= 1 (it stays a normal float, < 2^41), and whatever it rounds to below 1
// floors to 0, so the hardware's truncating conversion gives the floor (FMUL, FMUL, F2I.U64.TRUNC where the
// mantissa shifts took ~20 instructions and a divergent branch: the row walks are issue-bound at one CTA a row,
// docs/measured/2026-11-28-h200-b.md). sh lies in [-88, 189] (sp_shift of a
// finite maximum), so 2^sh goes as two float factors, 2^min(sh, 127) and the rest.
__device__ __forceinline__ unsigned long long sp_mass(unsigned int key, int sh) {
    const int a = min(sh, 127);
    const float x = __uint_as_float(key) * __int_as_float((127 + a) << 23) * __int_as_float((127 + sh - a) << 23);
    return __float2ull_rz(x);
}

// sp_mass of each value (sanitized as a probability) at one shift, for its exactness tests: every positive value
// must be below 2^(41 - sh), as a row's entries are below its maximum's binade.
extern "C" __global__ void __launch_bounds__(256) sampling_mass(const float* __restrict__ p,
                                                                 unsigned long long* __restrict__ out, int n, int sh) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = sp_mass(sp_prob_key(p[i]), sh);
}

// SP_F - e for the row maximum's key (2^(e-1) <= max < 2^e); mkey > 0.
__device__ __forceinline__ int sp_shift(unsigned int mkey) {
    const unsigned int e = mkey >> 23;
    const int ex = e ? (int)e - 126 : (32 - __clz((int)mkey)) - 149;
    return SP_F - ex;
}

// floor(a * b / 2^32) for a < 2^62, b < 2^32 (no 128-bit type needed).
__device__ __forceinline__ unsigned long long sp_mul_frac(unsigned long long a, unsigned int b) {
    return (a >> 32) * b + __umul64hi((a & 0xffffffffull) << 32, (unsigned long long)b);
}

// log2(e) rounded to float (0x3FB8AA3B): c = log2(e) / T is one IEEE division of floats on every backend.
#define SP_LOG2E 1.44269502162933349609375f

// 2^32 * 2^r for r = R / 2^32 in [0, 1): 2^r's polynomial of degree 6 (relative error < 3e-9 with the fixed point's
// truncations; 1 + r * q(r), q fitted on the relative error) by Horner in 32-bit fixed point: P(0) = 2^32 exactly,
// P increases with R and stays < 2^33. Integer only: every backend gets the same bits.
__device__ __forceinline__ unsigned long long sp_exp2_fix(unsigned int R) {
    unsigned long long acc = 928268ull;
    acc = 5354899ull + sp_mul_frac(acc, R);
    acc = 41555748ull + sp_mul_frac(acc, R);
    acc = 238307466ull + sp_mul_frac(acc, R);
    acc = 1031777011ull + sp_mul_frac(acc, R);
    acc = 2977043887ull + sp_mul_frac(acc, R);
    return 4294967296ull + sp_mul_frac(acc, R);
}

// The mass of logit x in a row of maximum mx at scale c = log2(e) / T: 2^SP_F * 2^f, f = (x - mx) * c <= 0, that is
// the softmax of x / T times 2^SP_F / its maximum's. f is one IEEE subtraction and one IEEE multiplication (the _rn
// intrinsics are never contracted into an FMA), n = floor(f), r = f - n (IEEE; it may round up to 1, clamped below),
// and 2^r in fixed point (sp_exp2_fix) shifted by n + SP_F - 32: after the three float operations all integer,
// identical on every backend. The maximum gets 2^SP_F exactly; f < -SP_F (below the fixed point's last bit), -inf
// and NaN (x = -inf with c = 0) get 0. Relative accuracy: the float roundings of f (|f| * 2^-23 * ln 2, ~3e-6 at the
// far end), of r (<= 2^-25 * ln 2) and the polynomial's 3e-9, then the truncation to the fixed point's 2^-SP_F of
// the maximum.
__device__ __forceinline__ unsigned long long sp_exp_mass(float x, float mx, float c) {
    const float f = __fmul_rn(__fsub_rn(x, mx), c);
    if (!(f >= -(float)SP_F)) return 0ull;
    const float fl = floorf(f);
    const int n = (int)fl;  // in [-SP_F, 0]
    const float r = __fsub_rn(f, fl);  // in [0, 1]
    const unsigned long long R = min(__float2ull_rz(__fmul_rn(r, 4294967296.0f)), 0xffffffffull);
    const unsigned long long P = sp_exp2_fix((unsigned int)R);
    const int sh = n + SP_F - 32;  // in [-32, 8]: P >> 33 would be 0 already
    return sh >= 0 ? P << sh : P >> -sh;
}

// sp_exp_mass at one row maximum and scale, for its exactness tests (one value a thread).
extern "C" __global__ void __launch_bounds__(256) sampling_exp_mass(const float* __restrict__ x,
        unsigned long long* __restrict__ out, int n, float mx, float c) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = sp_exp_mass(x[i], mx, c);
}

// ------------------------------------------------------------------------------ block primitives
__device__ __forceinline__ unsigned long long sp_warp_sum(unsigned long long v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(PK_FULL_MASK, v, off);
    return v;
}

__device__ __forceinline__ unsigned long long sp_block_sum(unsigned long long v, SpShared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = sp_warp_sum(v);
    if (lane == 0) s.red[warp] = v;
    __syncthreads();
    v = lane < SP_NW ? s.red[lane] : 0ull;
    v = sp_warp_sum(v);
    __syncthreads();  // the scratch may be reused right away
    return v;
}

__device__ __forceinline__ unsigned int sp_block_max(unsigned int v, SpShared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(PK_FULL_MASK, v, off));
    if (lane == 0) s.red[warp] = v;
    __syncthreads();
    v = lane < SP_NW ? (unsigned int)s.red[lane] : 0u;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(PK_FULL_MASK, v, off));
    __syncthreads();
    return v;
}

// s.hist[i] += w with native 32-bit shared-memory adds on its two words (a 64-bit add compiles to a
// compare-and-swap loop, which retries under contention: the mass histograms' bins are shared by every entry of
// similar size). The add that wraps the low word sees it in the old value and carries into the high word once,
// so the sum is exact and the same in any order. hist[i]'s words are cnt[2i] (low) and cnt[2i + 1] (high).
__device__ __forceinline__ void sp_hist_add(SpShared& s, int i, unsigned long long w) {
    const unsigned int lo = (unsigned int)w;
    const unsigned int old = atomicAdd(&s.cnt[2 * i], lo);
    const unsigned int hi = (unsigned int)(w >> 32) + (old + lo < old ? 1u : 0u);
    if (hi) atomicAdd(&s.cnt[2 * i + 1], hi);
}

// Exclusive prefix of v over the block's threads; *total gets the block's sum.
__device__ __forceinline__ unsigned long long sp_block_exclusive(unsigned long long v, unsigned long long* total,
                                                                 SpShared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long inc = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const unsigned long long o = __shfl_up_sync(PK_FULL_MASK, inc, off);
        if (lane >= off) inc += o;
    }
    if (lane == 31) s.red[warp] = inc;
    __syncthreads();
    unsigned long long before = 0ull, all = 0ull;
    for (int w = 0; w < SP_NW; ++w) {
        const unsigned long long t = s.red[w];
        before += w < warp ? t : 0ull;
        all += t;
    }
    __syncthreads();
    *total = all;
    return before + inc - v;
}

// ------------------------------------------------------------------------------ row access
// A row read in chunks of VEC elements per thread: chunk c's group of thread t starts at
// (c * SP_NT + t) * VEC. VEC > 1 only when the row length is a multiple of VEC.
// One CTA reads a whole row, so a read's time is its chunks times the load latency over the chunks in
// flight: with one 16-byte load in flight a thread a 128k-entry f32 row took ~0.5 us a chunk (H200,
// batch 1). sp_for_row issues AH chunks' loads before it widens and hands any of them to the body: SP_AHEAD
// in sampling_from_probs, SP_AHEAD_2CTA in the kernels held to 64 registers for two CTAs an SM.
#define SP_AHEAD 4
#define SP_AHEAD_2CTA 3

template <typename T, int VEC>
__device__ __forceinline__ long long sp_chunks(long long n) {
    return (n + (long long)SP_NT * VEC - 1) / ((long long)SP_NT * VEC);
}

// The raw 16 bytes of a thread's group at i (zeros past the end; VEC == 1: the element widened, in .x).
template <typename T, int VEC>
__device__ __forceinline__ uint4 sp_raw(const T* row, long long n, long long i) {
    uint4 u = make_uint4(0u, 0u, 0u, 0u);
    if constexpr (VEC > 1) {
        if (i < n) u = *reinterpret_cast<const uint4*>(row + i);
    } else {
        if (i < n) u.x = __float_as_uint(PkIO<T>::load(row, i));
    }
    return u;
}

template <typename T, int VEC>
__device__ __forceinline__ void sp_widen(const uint4& u, float* f) {
    if constexpr (VEC == 1) {
        f[0] = __uint_as_float(u.x);
    } else if constexpr (VEC == 4) {  // f32
        f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
        f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
    } else {  // 8 bf16 / f16
        Pk16<T>::widen2(u.x, f[0], f[1]);
        Pk16<T>::widen2(u.y, f[2], f[3]);
        Pk16<T>::widen2(u.z, f[4], f[5]);
        Pk16<T>::widen2(u.w, f[6], f[7]);
    }
}

// body(c, i, f) for the chunks c0 <= c < c1 (c1 <= the row's chunks) in order, f the VEC values at i (0 past
// the end of the row: the body sees i >= n there). A body returning true stops the walk; it must be
// block-uniform where the body synchronises.
template <typename T, int VEC, int AH, typename Body>
__device__ __forceinline__ void sp_for_chunks(const T* row, long long n, long long c0, long long c1, Body&& body) {
    const long long lim = min(n, c1 * SP_NT * VEC);  // past c1 loads nothing, with sp_raw's one bound test
    for (long long c = c0; c < c1; c += AH) {
        uint4 u[AH];
#pragma unroll
        for (int a = 0; a < AH; ++a) u[a] = sp_raw<T, VEC>(row, lim, ((c + a) * SP_NT + threadIdx.x) * VEC);
#pragma unroll
        for (int a = 0; a < AH; ++a) {
            if (c + a >= c1) return;  // block-uniform
            float f[VEC];
            sp_widen<T, VEC>(u[a], f);
            if (body(c + a, ((c + a) * SP_NT + threadIdx.x) * VEC, f)) return;
        }
    }
}

// body(i, f) for every chunk of the row in order (sp_for_chunks over all of them).
template <typename T, int VEC, int AH, typename Body>
__device__ __forceinline__ void sp_for_row(const T* row, long long n, Body&& body) {
    sp_for_chunks<T, VEC, AH>(row, n, 0, sp_chunks<T, VEC>(n), [&](long long, long long i, float* f) {
        return body(i, f);
    });
}

// What the filters know of a row: its maximum, the keep floor and the kept mass.
struct SpRow {
    unsigned int mkey;        // key of the row maximum (0: no mass)
    int sh;                   // probabilities: sp_shift(mkey)
    unsigned int lo;          // keep the entries with key >= lo
    unsigned long long kept;  // mass of the entries with key >= lo (set by a select)
    float mp;                 // min-p factor, < 0 without min-p: lo >= key(max * mp) once the max is known
    bool bad;                 // some entry is no number of the row's kind (then mkey = 0): set with the maximum
    float mx, c;              // logits: the row maximum and the scale log2(e) / T (sp_exp_mass)
};

template <int MODE>
__device__ __forceinline__ unsigned int sp_key(float x) {
    if constexpr (MODE != SPM_PROBS) return sp_logit_key(x);
    else return sp_prob_key(x);
}

// An entry that makes the row no distribution: a probability that is NaN, inf or negative; a logit that is NaN or
// +inf (softmax has no value there). Logits for top_k_mask_logits are never bad (NaN has the lowest key).
template <int MODE>
__device__ __forceinline__ bool sp_bad(float x) {
    if constexpr (MODE == SPM_PROBS) return sp_prob_bad(x);
    else if constexpr (MODE == SPM_LOGITS) return !(x < SP_POS_INF);
    else return false;
}

// The fixed-point mass of the entry x with key `key` (probabilities: key of the sanitized x; logits: its
// softmax at the row's scale). Never called for SPM_MASK.
template <int MODE>
__device__ __forceinline__ unsigned long long sp_wmass(float x, unsigned int key, const SpRow& r) {
    if constexpr (MODE == SPM_LOGITS) return sp_exp_mass(x, r.mx, r.c);
    else return sp_mass(key, r.sh);
}

// Largest key over the row (0 for an empty or all-zero probability row). `bad` (block-uniform) is whether some
// entry makes the row no distribution (sp_bad), and the key is then 0 (the row has no usable mass).
template <typename T, int VEC, int AH, int MODE>
__device__ unsigned int sp_row_max_key(const T* row, long long n, SpShared& s, bool& bad) {
    unsigned int m = 0u;
    bool own_bad = false;
    sp_for_row<T, VEC, AH>(row, n, [&](long long i, const float* f) {
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            // past the end the loads are 0: probability key 0, not bad (no index test a value); a logit 0 has a key
            if (MODE == SPM_PROBS || i + j < n) {
                m = max(m, sp_key<MODE>(f[j]));
                own_bad |= sp_bad<MODE>(f[j]);
            }
        return false;
    });
    const unsigned int mkey = sp_block_max(m, s);
    bad = MODE != SPM_MASK && __syncthreads_or(own_bad);
    return bad ? 0u : mkey;
}

// The kept mass (key >= lo) of this lane's VEC values at i. Past the end of the row they load 0: probability key
// 0 < lo, but a logit 0 has a key, so logits test the index.
template <int VEC, int MODE>
__device__ __forceinline__ unsigned long long sp_lane_mass(const float* f, long long i, long long n, unsigned int lo,
                                                           const SpRow& r) {
    unsigned long long own = 0ull;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        const unsigned int key = sp_key<MODE>(f[j]);
        if (key >= lo && (MODE == SPM_PROBS || i + j < n)) own += sp_wmass<MODE>(f[j], key, r);
    }
    return own;
}

// Mass of the entries with key >= lo in the chunks c0 <= c < c1 (the whole row: 0, sp_chunks(n)).
template <typename T, int VEC, int AH, int MODE>
__device__ unsigned long long sp_row_mass(const T* row, long long n, long long c0, long long c1, unsigned int lo,
                                          const SpRow& r, SpShared& s) {
    unsigned long long acc = 0ull;
    sp_for_chunks<T, VEC, AH>(row, n, c0, c1, [&](long long, long long i, const float* f) {
        acc += sp_lane_mass<VEC, MODE>(f, i, n, lo, r);
        return false;
    });
    return sp_block_sum(acc, s);
}

// ceil(top_p * S): top_p as P / 2^32 (P < 2^32, >= 1).
__device__ __forceinline__ unsigned long long sp_target(unsigned long long S, unsigned int P) {
    const unsigned long long lo = sp_mul_frac(S, P);
    // exact remainder test: (S * P) mod 2^32 != 0
    const unsigned long long rem = ((S & 0xffffffffull) * (unsigned long long)P) & 0xffffffffull;
    return lo + (rem != 0ull);
}

// Key bits below the element type's precision: a bf16 or f16 value widened to fp32 has its low 16 or
// 13 mantissa bits 0 (f16 subnormals included), so its probability key has them 0, and its logit key
// all 0 (>= +0) or all 1 (< -0): the bits above them tell the keys apart, and the radix select ends
// once they are known (two passes; the returned prefix keeps the same entries as the key itself).
template <typename T> struct SpLowBits { static constexpr int bits = Pk16<T>::is_f16 ? 13 : 16; };
template <> struct SpLowBits<float> { static constexpr int bits = 0; };

// The logit with key `key` (> 0; a zero of either sign comes back as +0, which subtracts the same).
__device__ __forceinline__ float sp_logit_value(unsigned int key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

template <int MODE>
__device__ __forceinline__ void sp_set_max(SpRow& r, unsigned int mkey) {
    r.mkey = mkey;
    if constexpr (MODE == SPM_LOGITS) {
        // a row of -inf has no softmax, nor has a scale that is no number >= 0 (a device temperature <= 0 or NaN)
        if (mkey) r.mx = sp_logit_value(mkey);
        if (!(r.mx > -SP_POS_INF && r.c >= 0.0f && r.c < SP_POS_INF)) r.mkey = 0u;
    } else if (mkey) {
        r.sh = sp_shift(mkey);
        r.lo = max(r.lo, sp_prob_key(__uint_as_float(mkey) * r.mp));  // key 0 for mp < 0
    }
}

// Radix select over the keys >= base. by_mass = false: the `need`-th largest key (counting
// ties; need <= the number of such entries). by_mass = true: the largest key v whose mass at or
// above v reaches ceil(top_p * M), top_p = need / 2^32 and M the mass of the keys >= base (M is
// the sum of the first pass's histogram). Passes of 11, 11 and 10 bits (bf16 / f16: 11 and 5 / 8,
// SpLowBits), most significant first; each pass's bin comes from a block-wide suffix scan (thread
// t owns 4, 2 or 1 bins from the top). Rows with mass (MODE != SPM_MASK) also get, in the last pass, r.kept =
// the mass of the keys >= r.lo = max(r.lo, v): keys above the pass's range add their mass per
// thread, keys in it go to a mass histogram (the top half of hist for a count select). MAX: the
// first pass also finds the row maximum (sp_set_max; an all-zero row stops there with r.mkey = 0).
// Returns v with its bits below SpLowBits cleared (v itself but for a negative bf16 / f16 logit).
template <typename T, int VEC, int AH, int MODE, bool MAX>
__device__ unsigned int sp_radix_select(const T* row, long long n, unsigned int base, bool by_mass,
                                        unsigned long long need, SpRow& r, SpShared& s) {
    unsigned int prefix = 0u, pmask = 0u;
    unsigned long long above = 0ull;  // count / mass strictly above the current prefix range
    constexpr int LOW = SpLowBits<T>::bits, NPASS = LOW ? 2 : 3;
    for (int pass = 0; pass < NPASS; ++pass) {
        const bool last = pass == NPASS - 1;
        const int shift = pass == 0 ? 21 : (last ? LOW : 10);
        const int nb = 1 << ((pass == 0 ? 32 : (pass == 1 ? 21 : 10)) - shift);  // 2048, 1024, 256 or 32
        const unsigned int lo_pre = r.lo;  // the keep floor before this filter (final by the last pass)
        for (int b = threadIdx.x; b < SP_BINS; b += SP_NT) s.hist[b] = 0ull;
        __syncthreads();
        unsigned int m = 0u;
        bool own_bad = false;           // MAX: an entry that makes the row no distribution (sp_bad)
        unsigned long long acc = 0ull;  // last pass: mass of the keys >= lo_pre above the range
        sp_for_row<T, VEC, AH>(row, n, [&](long long i, const float* f) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const unsigned int key = sp_key<MODE>(f[j]);
                if (MAX && pass == 0 && (MODE == SPM_PROBS || i + j < n)) {
                    m = max(m, key);  // out-of-range lanes load 0: probability key 0, but a logit 0 has a key
                    own_bad |= sp_bad<MODE>(f[j]);
                }
                if (i + j < n && key >= base) {
                    const unsigned int hi = key & pmask;
                    if (hi == prefix) {
                        const unsigned int d = (key >> shift) & (unsigned int)(nb - 1);
                        if (by_mass) {
                            const unsigned long long w = sp_wmass<MODE>(f[j], key, r);
                            if (w) sp_hist_add(s, d, w);
                        } else {
                            atomicAdd(&s.cnt[d], 1u);  // < 2^22 entries a row
                            if (MODE != SPM_MASK && last) {
                                const unsigned long long w = sp_wmass<MODE>(f[j], key, r);
                                if (w) sp_hist_add(s, 1024 + d, w);
                            }
                        }
                    } else if (MODE != SPM_MASK && last && hi > prefix && key >= lo_pre) {
                        acc += sp_wmass<MODE>(f[j], key, r);
                    }
                }
            }
            return false;
        });
        __syncthreads();
        if constexpr (MAX) {
            if (pass == 0) {
                const unsigned int mkey = sp_block_max(m, s);
                r.bad = MODE != SPM_MASK && __syncthreads_or(own_bad);
                sp_set_max<MODE>(r, r.bad ? 0u : mkey);
                if (r.mkey == 0u) return 0u;  // block-uniform
            }
        }
        // bin pick: thread t < owners owns bins top .. top - bpt + 1; an exclusive scan in thread
        // order is a suffix scan over the bins
        const int bpt = nb > SP_NT ? nb / SP_NT : 1, owners = nb / bpt;
        const int top = nb - 1 - bpt * (int)threadIdx.x;  // < 0: no bin
        unsigned long long own = 0ull;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (j < bpt && top - j >= 0) own += by_mass ? s.hist[top - j] : s.cnt[top - j];
        unsigned long long total;
        const unsigned long long before = above + sp_block_exclusive(own, &total, s);
        if (by_mass && pass == 0) need = sp_target(total, (unsigned int)need);
        if ((before < need && before + own >= need) || ((int)threadIdx.x == owners - 1 && before + own < need)) {
            unsigned long long a = before;
            unsigned int bin = (unsigned int)(top - bpt + 1);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (j < bpt) {
                    const unsigned long long h = by_mass ? s.hist[top - j] : s.cnt[top - j];
                    if (a + h >= need) { bin = (unsigned int)(top - j); break; }
                    a += h;
                }
            }
            s.sel_bin = bin;
            s.sel_above = a;
        }
        __syncthreads();
        const unsigned int range = prefix;  // the keys of this pass's range: range | d << shift
        prefix |= s.sel_bin << shift;
        pmask |= (unsigned int)(nb - 1) << shift;
        above = s.sel_above;
        if (MODE != SPM_MASK && last) {  // bin d holds the key range | d << LOW alone
            r.lo = max(lo_pre, prefix);
            const unsigned long long* mh = by_mass ? s.hist : s.hist + 1024;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < bpt && top - j >= 0 && (range | ((unsigned int)(top - j) << LOW)) >= r.lo) acc += mh[top - j];
            r.kept = sp_block_sum(acc, s);
        }
        __syncthreads();  // everyone has read sel_* and hist before the next pass resets them
    }
    return prefix;
}

// top_p as the integer P = floor(top_p * 2^32); 0 means "keep all" (top_p >= 1), never 0 otherwise.
__device__ __forceinline__ unsigned int sp_top_p_int(float p) {
    if (!(p < 1.0f)) return 0u;  // also NaN: no filter
    const float s = p * 4294967296.0f;  // exact: a power of two
    const unsigned int v = s >= 1.0f ? (unsigned int)s : 1u;
    return v;
}

// ------------------------------------------------------------------------------ the draw
// The first kept entry (key >= lo, lo >= 1) whose inclusive prefix mass, in vocabulary order, exceeds t (t < the
// kept mass), or -1. A segment is one warp's 32 * VEC entries of one chunk, contiguous in the row. The row goes
// by windows of SP_WIN chunks: each warp sums its segments with shuffles alone into s.hist (in row order), one
// block scan over the window's SP_BINS sums finds the segment that holds the draw, and one warp walks that
// segment. One block scan a window, where a scan a chunk put two barriers in every chunk's read (measured:
// 8 of sampling_from_probs' 95 us at batch 1, H200, 2026-11-28).
#define SP_WIN (SP_BINS / SP_NW)

// The kept mass of a warp's segment of a chunk (f: this lane's VEC values), in every lane.
template <int VEC, int MODE>
__device__ __forceinline__ unsigned long long sp_segment_mass(const float* f, long long i, long long n,
                                                              unsigned int lo, const SpRow& r) {
    return sp_warp_sum(sp_lane_mass<VEC, MODE>(f, i, n, lo, r));
}

// summed: the row is one window and its segment sums are in s.hist already (sp_row_mass_segments), so the draw
// reads only the segment that holds it.
// The walk covers the chunks cb <= c < ce, run0 the kept mass of the chunks before cb (a split row's last CTA walks
// the one CTA range that holds the draw: sp_split_last).
template <typename T, int VEC, int AH, int MODE>
__device__ int sp_find_draw(const T* row, long long n, unsigned int lo, const SpRow& r, unsigned long long t,
                            bool summed, SpShared& s, long long cb, long long ce, unsigned long long run0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) s.found = -1;
    unsigned long long run = run0;  // mass of the windows before
    for (long long c0 = cb; c0 < ce; c0 += SP_WIN) {
        const long long c1 = min(ce, c0 + SP_WIN);
        if (!summed)
            sp_for_chunks<T, VEC, AH>(row, n, c0, c1, [&](long long c, long long i, const float* f) {
                const unsigned long long own = sp_segment_mass<VEC, MODE>(f, i, n, lo, r);
                if (lane == 0) s.hist[(c - c0) * SP_NW + warp] = own;
                return false;
            });
        __syncthreads();
        // thread t owns the window's segments 4t .. 4t + 3 (row order): an exclusive scan in thread order
        const int ne = (int)(c1 - c0) * SP_NW;
        unsigned long long own = 0ull;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (4 * (int)threadIdx.x + j < ne) own += s.hist[4 * threadIdx.x + j];
        unsigned long long total;
        const unsigned long long before = run + sp_block_exclusive(own, &total, s);
        if (run + total <= t) {  // block-uniform: not in this window (the scan's barriers end the hist reads)
            run += total;
            continue;
        }
        if (before <= t && t < before + own) {
            unsigned long long a = before;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned long long h = 4 * (int)threadIdx.x + j < ne ? s.hist[4 * threadIdx.x + j] : 0ull;
                if (a + h > t) { s.sel_bin = 4 * threadIdx.x + j; s.sel_above = a; break; }
                a += h;
            }
        }
        __syncthreads();
        if (warp == 0) {  // the segment's walk: one 16-byte read a lane and a warp scan
            const unsigned int seg = s.sel_bin;
            const long long i = ((c0 + seg / SP_NW) * SP_NT + (seg % SP_NW) * 32 + lane) * VEC;
            float f[VEC];
            sp_widen<T, VEC>(sp_raw<T, VEC>(row, n, i), f);
            unsigned long long w[VEC], mine = 0ull;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const unsigned int key = sp_key<MODE>(f[j]);
                w[j] = key >= lo && (MODE == SPM_PROBS || i + j < n) ? sp_wmass<MODE>(f[j], key, r) : 0ull;
                mine += w[j];
            }
            unsigned long long inc = mine;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const unsigned long long o = __shfl_up_sync(PK_FULL_MASK, inc, off);
                if (lane >= off) inc += o;
            }
            unsigned long long a = s.sel_above + inc - mine;
            if (a <= t && t < a + mine) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    a += w[j];
                    if (a > t) { s.found = (int)(i + j); break; }
                }
            }
        }
        break;
    }
    __syncthreads();
    return s.found;
}

// The kept mass S of a row of one window (at most SP_WIN chunks), leaving its segment sums in s.hist as
// sp_find_draw makes them: the draw then reads only its segment (a plain or min-p draw reads the row twice, not 3
// times).
template <typename T, int VEC, int AH, int MODE>
__device__ unsigned long long sp_row_mass_segments(const T* row, long long n, unsigned int lo, const SpRow& r,
                                                   SpShared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long acc = 0ull;  // the warp's kept mass, in every lane
    sp_for_chunks<T, VEC, AH>(row, n, 0, sp_chunks<T, VEC>(n), [&](long long c, long long i, const float* f) {
        const unsigned long long own = sp_segment_mass<VEC, MODE>(f, i, n, lo, r);
        if (lane == 0) s.hist[c * SP_NW + warp] = own;
        acc += own;
        return false;
    });
    return sp_block_sum(lane == 0 ? acc : 0ull, s);
}

// ------------------------------------------------------------------------------ sampling
struct SpArgs {
    int flags, top_k_val;
    float top_p_val, min_p_val;
    unsigned int seed_lo, seed_hi, offset_lo, offset_hi;
    float c_val;                       // logits: log2(e) / T, or the row's from temp_arr (SPF_T_ARR)
    const float* __restrict__ temp_arr;
};

// Word 0 of Philox4x32-10 at counter (offset, row b, round) under the row's seed: the uniform of a draw (round 0
// the first; the rejection rounds of top-k / top-p, sp_reject, take one word each).
__device__ __forceinline__ unsigned int sp_row_word(int b, const unsigned int* __restrict__ seed_arr,
                                                    const unsigned int* __restrict__ offset_arr, const SpArgs& a,
                                                    unsigned int round = 0u) {
    unsigned int c[4];
    c[0] = (a.flags & SPF_OFFSET_ARR) ? offset_arr[2 * b] : a.offset_lo;
    c[1] = (a.flags & SPF_OFFSET_ARR) ? offset_arr[2 * b + 1] : a.offset_hi;
    c[2] = (unsigned int)b;
    c[3] = round;
    sp_philox(c, (a.flags & SPF_SEED_ARR) ? seed_arr[2 * b] : a.seed_lo,
              (a.flags & SPF_SEED_ARR) ? seed_arr[2 * b + 1] : a.seed_hi);
    return c[0];
}

// ------------------------------------------------------------------------------ rejection with two pivots
// What one read of a row tells about two pivot keys k0 < k1: the count and the mass of the entries with key > k0
// and of those with key > k1. seg (block-uniform; the row is one window, as sp_row_mass_segments'): the read also
// leaves each warp's segment sums of both masses, above k0 in s.hist and above k1 in hist2, in sp_find_draw's
// layout, so the next draw (over either set) reads only its segment.
struct SpPivots { unsigned long long c0, m0, c1, m1; };

template <typename T, int VEC, int AH, int MODE>
__device__ SpPivots sp_count_pivots(const T* row, long long n, unsigned int k0, unsigned int k1, const SpRow& r,
                                    bool seg, unsigned long long* __restrict__ hist2, SpShared& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // counts above k0 in the low word, above k1 in the high one: a row has < 2^31 entries, no carry between them
    unsigned long long cc = 0ull, m0 = 0ull, m1 = 0ull;
    sp_for_chunks<T, VEC, AH>(row, n, 0, sp_chunks<T, VEC>(n), [&](long long c, long long i, const float* f) {
        unsigned long long w0 = 0ull, w1 = 0ull;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const unsigned int key = sp_key<MODE>(f[j]);
            // past the end the loads are 0: probability key 0 <= k0, but a logit 0 has a key
            if (key > k0 && (MODE == SPM_PROBS || i + j < n)) {
                const unsigned long long w = sp_wmass<MODE>(f[j], key, r);
                const bool above1 = key > k1;
                cc += above1 ? 0x100000001ull : 1ull;
                w0 += w;
                w1 += above1 ? w : 0ull;
            }
        }
        m0 += w0;
        m1 += w1;
        if (seg) {
            w0 = sp_warp_sum(w0);
            w1 = sp_warp_sum(w1);
            if (lane == 0) { s.hist[c * SP_NW + warp] = w0; hist2[c * SP_NW + warp] = w1; }
        }
        return false;
    });
    SpPivots p;
    cc = sp_block_sum(cc, s);
    p.c0 = cc & 0xffffffffull;
    p.c1 = cc >> 32;
    p.m0 = sp_block_sum(m0, s);
    p.m1 = sp_block_sum(m1, s);
    return p;
}

// FlashInfer's rejection sampling with two pivots (its top-k / top-p sampling kernels), over keys and the exact
// fixed-point mass. The kept set is {key >= T} for an unknown T: K(v) = "count(key > v) < kc and mass(key > v) <
// target" holds exactly for v >= T (kc = top-k's k, target = ceil(top_p * M) as sp_target; ~0 for a filter that is
// off; ties at the boundary are all kept, as the radix selects keep them). Invariant: lo <= T <= hi, hi the row
// maximum's key at first. A round draws x from the entries with key >= lo (S their mass) by the inverse CDF over
// its own Philox word (counter (offset, row, round)), key0 = key(x):
// - key0 >= hi: x is kept, no read;
// - else one read counts and sums the entries above key0 and above key1, the middle of [key0 + 1, hi]: K(key0)
//   keeps x; else T > key0, and K(key1) tells on which side of key1 T lies: the next round draws from
//   [key0 + 1, key1] (S = the mass above key0) or [key1 + 1, hi] (S = the mass above key1).
// A draw from {key >= lo}, a superset of the kept set, that lands in the kept set follows the kept set's
// renormalized mass whatever came before: the token follows the filtered distribution (in the fixed point) exactly.
// Bounded: every rejected round leaves at most about half of [key0 + 1, hi] (34 draws at most over 32-bit keys);
// once lo = hi = T every draw is kept. Reads a round: the draw (one warp segment when summed, else the row up to
// the draw) and at most one full read. Round 0 draws t (the caller's, from the word of round 0) over the chunks
// cb <= c < ce after their kept mass run0 (a split row's last CTA: the one range that holds it; else the whole row);
// without filters (kc = target = ~0) that draw is the token. Every draw of sp_sample_row is made here: one inlined
// copy of the draw's and the count's row walks a kernel instance, where a call site each took four and two.
template <typename T, int VEC, int AH, int MODE>
__device__ int sp_reject(const T* row, long long n, int b, const SpRow& r, unsigned int lo, unsigned long long S,
                         unsigned long long kc, unsigned long long target, bool summed, unsigned long long t,
                         long long cb, long long ce, unsigned long long run0,
                         unsigned long long* __restrict__ hist2, const unsigned int* __restrict__ seed_arr,
                         const unsigned int* __restrict__ offset_arr, const SpArgs& a, SpShared& s) {
    const long long nc = sp_chunks<T, VEC>(n);
    const bool seg = nc <= SP_WIN;
    unsigned int hi = r.mkey;
    for (unsigned int round = 0u;; ++round) {
        if (round) t = sp_mul_frac(S, sp_row_word(b, seed_arr, offset_arr, a, round));  // < S
        const int x = sp_find_draw<T, VEC, AH, MODE>(row, n, lo, r, t, summed, s, cb, ce, run0);
        // x < 0 never: S > 0 is the mass of a superset of the kept set
        if (x < 0 || (kc == ~0ull && target == ~0ull)) return x;
        cb = 0;
        ce = nc;
        run0 = 0ull;
        const unsigned int key0 = sp_key<MODE>(PkIO<T>::load(row, x));  // every thread the same entry
        if (key0 >= hi) return x;
        unsigned int key1 = key0 + 1u + ((hi - key0 - 1u) >> 1);
        // no logit has the key 0x7fffffff (-0 takes +0's): the next key up keeps "key > key1" a value comparison
        if (MODE != SPM_PROBS && key1 == 0x7fffffffu) key1 = 0x80000000u;
        const SpPivots p = sp_count_pivots<T, VEC, AH, MODE>(row, n, key0, key1, r, seg, hist2, s);
        if (p.c0 < kc && p.m0 < target) return x;
        if (p.c1 < kc && p.m1 < target) {
            lo = key0 + 1u;
            hi = key1;
            S = p.m0;
        } else {
            lo = key1 + 1u;
            S = p.m1;
            // the segment sums above key1 become the draw's (sp_find_draw's barrier precedes its reads); only the
            // row's nc windows' worth were written
            if (seg) for (int i = threadIdx.x; i < (int)nc * SP_NW; i += SP_NT) s.hist[i] = hist2[i];
        }
        summed = seg;
    }
}

// The rejection's filters for row b: kc (top-k's k, ~0 off), P (top-p as sp_top_p_int, 0 off).
__device__ __forceinline__ void sp_filters(int b, long long n, const int* __restrict__ top_k_arr,
                                           const float* __restrict__ top_p_arr, const SpArgs& a,
                                           unsigned long long& kc, unsigned int& P) {
    const int k = (a.flags & SPF_TOP_K) ? ((a.flags & SPF_K_ARR) ? top_k_arr[b] : a.top_k_val) : 0;
    kc = k > 0 && (long long)k < n ? (unsigned long long)k : ~0ull;
    P = (a.flags & SPF_TOP_P) ? sp_top_p_int((a.flags & SPF_P_ARR) ? top_p_arr[b] : a.top_p_val) : 0u;
}

// A row split over C = gridDim.y CTAs (rows without top-k / top-p: plain and min-p sampling, from probs or logits),
// so that a small batch fills the GPU. CTA j = blockIdx.y owns the chunks [nc * j / C, nc * (j + 1) / C) of the row's
// nc. Every CTA finds the row maximum over the whole row (one read from HBM, the other CTAs' from L2; the same key in
// each, so each knows the fixed point and the min-p floor without waiting for another), then the kept mass S_j of its
// own chunks: the same integers a one-CTA row sums. S_j goes to ws[b * C + j]; the CTA that takes the row's last
// ticket (tickets[b], an acq_rel inc as decode_tc.cu's split epilogue, which wraps the last one back to 0, so the
// counters stay zeroed from launch to launch whatever C and the batch are) adds them up in range
// order, draws t = floor(r * S / 2^32) as a one-CTA row does, and walks only the range whose prefix holds t
// (sp_reject's round 0, from the mass before it). The token is the first kept index whose inclusive prefix exceeds t: a
// function of (the row, the parameters, the Philox word) alone, the same for every C and whichever CTA finishes last.
// Reads: the row twice (max, whole in every CTA but from L2 after the first; the masses, split) and the drawn range
// (about n / C entries) once more.
// sp_split_last: a split CTA's part after its S_j (own) is summed; false for every CTA but the row's last, which gets
// S, t and the draw's chunk range [cb, ce) with the mass run0 before it.
template <typename T, int VEC>
__device__ bool sp_split_last(long long n, int b, unsigned long long own, const unsigned int* __restrict__ seed_arr,
                              const unsigned int* __restrict__ offset_arr, const SpArgs& a,
                              unsigned long long* __restrict__ ws, unsigned int* __restrict__ tickets,
                              unsigned long long& S, unsigned long long& t, long long& cb, long long& ce,
                              unsigned long long& run0) {
    const int C = (int)gridDim.y, j = (int)blockIdx.y;
    const long long nc = sp_chunks<T, VEC>(n);
    unsigned long long* part = ws + (long long)b * C;
    // Release: thread 0 stores the partial, then takes the ticket with an atom.acq_rel.gpu inc (its release part
    // publishes the store before the new count). Acquire: the last ticket's RMW read the count the other CTAs' release RMWs wrote, so their
    // partials are visible to thread 0, and the barrier of __syncthreads_or carries that to every thread's strong
    // loads below (GPU scope: never a stale L1 line).
    if (threadIdx.x == 0) part[j] = own;
    const int last = __syncthreads_or(threadIdx.x == 0 &&
        pk_atom_inc_acq_rel_gpu(tickets + b, (unsigned int)(C - 1)) ==
            (unsigned int)(C - 1));
    if (!last) return false;
    // every thread sums the C partials in range order (exact integers) and finds the range that holds the draw
    auto partial = [&](int q) {  // two strong 32-bit loads (little-endian words)
        const float* w = reinterpret_cast<const float*>(part + q);
        return (unsigned long long)__float_as_uint(pk_ld_relaxed_gpu(w)) |
               ((unsigned long long)__float_as_uint(pk_ld_relaxed_gpu(w + 1)) << 32);
    };
    S = 0ull;
    for (int q = 0; q < C; ++q) S += partial(q);
    t = sp_mul_frac(S, sp_row_word(b, seed_arr, offset_arr, a));  // < S: S >= max's mass
    unsigned long long before = 0ull;
    int q = 0;
    for (; q < C - 1; ++q) {
        const unsigned long long h = partial(q);
        if (before + h > t) break;
        before += h;
    }
    cb = nc * q / C;
    ce = nc * (q + 1) / C;
    run0 = before;
    return true;
}

// MODE: SPM_PROBS (sampling_from_probs) or SPM_LOGITS (sampling_from_logits: the same filters and draw over the
// softmax's fixed-point mass, sp_exp_mass, which no pass writes out).
template <typename T, int VEC, int AH, int MODE>
__device__ void sp_sample_row(const T* __restrict__ row, long long n, int b, int* __restrict__ out,
                              unsigned char* __restrict__ valid, const int* __restrict__ top_k_arr,
                              const float* __restrict__ top_p_arr, const float* __restrict__ min_p_arr,
                              const unsigned int* __restrict__ seed_arr, const unsigned int* __restrict__ offset_arr,
                              const SpArgs& a, unsigned long long* __restrict__ ws,
                              unsigned int* __restrict__ tickets, unsigned long long* __restrict__ hist2,
                              SpShared& s) {
    SpRow r = {0u, 0, 1u, 0ull, -1.0f};  // keep entries with key >= r.lo (key 0: no mass, or a NaN logit)
    if constexpr (MODE == SPM_LOGITS)  // one IEEE division for a per-row temperature, as the host's for a scalar
        r.c = (a.flags & SPF_T_ARR) ? __fdiv_rn(SP_LOG2E, a.temp_arr[b]) : a.c_val;
    if (a.flags & SPF_MIN_P) {
        const float mp = (a.flags & SPF_MINP_ARR) ? min_p_arr[b] : a.min_p_val;
        r.mp = mp < 1.0f ? mp : 1.0f;  // NaN or > 1: as 1 (only the maximum survives)
    }
    unsigned long long kc;
    unsigned int P;
    sp_filters(b, n, top_k_arr, top_p_arr, a, kc, P);
    // top-k first, then top-p over the top-k set: the top-k radix select first (one CTA)
    const bool kfirst = kc != ~0ull && P && (a.flags & SPF_TOP_K_FIRST);
    // a split row (sp_split_last; the host splits no top-k-first row: should one come, its CTA 0 takes it)
    const int C = (int)gridDim.y, j = (int)blockIdx.y;
    if (C > 1 && kfirst && j) return;
    const long long nc = sp_chunks<T, VEC>(n);
    unsigned long long S = 0ull, M;
    // Probabilities: a split row's maximum pass has its own call site, and `split` is set after it, so no flag of the
    // path is live across either copy of the pass: with one call site and the flag live, ptxas saved predicates to
    // registers (P2R) inside it, 300 instructions a 32-entry bf16 step on sm_80 (285 sm_90) against 267 (250) now.
    // Logits: their pass (836) loses nothing to the flag, so they keep one call site.
    bool split = MODE != SPM_PROBS && C > 1 && !kfirst;
    if (kfirst) {  // the row maximum rides along with the select's first pass; r.kept: the top-k set's mass
        sp_radix_select<T, VEC, AH, MODE, true>(row, n, 0u, false, kc, r, s);
        S = M = r.kept;
        kc = ~0ull;  // the draws stay in the top-k set (lo = its floor)
    } else if (MODE == SPM_PROBS && C > 1) {  // every CTA of a split row finds the maximum over the whole row
        sp_set_max<MODE>(r, sp_row_max_key<T, VEC, AH, MODE>(row, n, s, r.bad));
        split = true;
    } else {
        sp_set_max<MODE>(r, sp_row_max_key<T, VEC, AH, MODE>(row, n, s, r.bad));
    }
    if (r.mkey == 0u) {  // no mass at all, or an entry that is no number of the row's kind (r.bad): no token
        // every CTA of a split row knows it: none takes a ticket
        if (j == 0 && threadIdx.x == 0) { out[b] = 0; valid[b] = 0; }
        return;
    }
    const unsigned int lo = r.lo;
    unsigned long long t = 0ull, run0 = 0ull;  // the draw's t, and the kept mass of the chunks before cb
    long long cb = 0, ce = nc;                   // the chunks that hold the draw
    bool summed = false;
    if (!kfirst) {  // S >= the maximum's mass > 0; a row of one window keeps its segment sums for the draw
        summed = !split && nc <= SP_WIN;
        if (summed) {
            S = sp_row_mass_segments<T, VEC, AH, MODE>(row, n, lo, r, s);
        } else {  // a split CTA: the kept mass of its own chunks
            S = sp_row_mass<T, VEC, AH, MODE>(row, n, split ? nc * j / C : 0, split ? nc * (j + 1) / C : nc, lo, r,
                                              s);
            if (split && !sp_split_last<T, VEC>(n, b, S, seed_arr, offset_arr, a, ws, tickets, S, t, cb, ce, run0))
                return;
        }
        // top-p's M: the mass over the whole row (top-k-first without an active k: over the min-p floor's set).
        // Only min-p raises lo here, and logits have no min-p (lo = 1): their kernels keep no copy of this read.
        M = (MODE == SPM_PROBS && P && lo != 1u && !(a.flags & SPF_TOP_K_FIRST))
                ? sp_row_mass<T, VEC, AH, MODE>(row, n, 0, nc, 1u, r, s)
                : S;
    }
    if (!split) t = sp_mul_frac(S, sp_row_word(b, seed_arr, offset_arr, a));  // in [0, S)
    // top-k / top-p: the rejection rounds after this draw; none: the draw is the token
    const int found = sp_reject<T, VEC, AH, MODE>(row, n, b, r, lo, S, kc, P ? sp_target(M, P) : ~0ull, summed, t,
                                                  cb, ce, run0, hist2, seed_arr, offset_arr, a, s);
    if (threadIdx.x == 0) { out[b] = found >= 0 ? found : 0; valid[b] = found >= 0; }
}

// flags: SPF_* above. Per-row parameter arrays are indexed by the output row; seed_arr and
// offset_arr hold (lo, hi) 32-bit word pairs per row. Absent arrays are 1-element dummies.
template <typename T, int MODE>
__device__ void sp_sample_impl(const T* __restrict__ x, int* __restrict__ out, unsigned char* __restrict__ valid,
                               const int* __restrict__ indices, const int* __restrict__ top_k_arr,
                               const float* __restrict__ top_p_arr, const float* __restrict__ min_p_arr,
                               const unsigned int* __restrict__ seed_arr, const unsigned int* __restrict__ offset_arr,
                               int vocab, const SpArgs& a, unsigned long long* __restrict__ ws,
        unsigned int* __restrict__ tickets) {
    __shared__ SpShared s;
    __shared__ unsigned long long hist2[SP_BINS];  // sp_count_pivots' second segment sums (16 KiB)
    // Launched with PDL this CTA may start while the kernel that wrote the row still runs: nothing (indices, the
    // parameter arrays, the row, a split row's ticket) is read or written before the wait.
    pk_grid_dependency_wait();
    pk_grid_launch_dependents();
    const int b = blockIdx.x;
    const long long r = (a.flags & SPF_INDICES) ? indices[b] : b;
    const T* row = x + r * (long long)vocab;
    pk_vec_or_elem<T>(vocab % PkVec16<T>::N == 0 && pk_aligned16(x), [&](auto w) {
        sp_sample_row<T, decltype(w)::value, SP_AHEAD, MODE>(row, vocab, b, out, valid, top_k_arr, top_p_arr,
                                                             min_p_arr, seed_arr, offset_arr, a, ws, tickets, hist2, s);
    });
}

// The parameter and argument lists of sampling_from_probs and sampling_from_logits, written once: they differ
// only in the row input X (probs, logits), the third per-row array A3 (min_p_arr, temp_arr) and the third scalar
// V3 (min_p_val, c_val). Each kernel's lists are object-like macros over these (the registry reads a kernel's
// parameter list from a parenthesized list or an object-like macro), and its _impl takes the same list.
#define SP_SAMPLE_PARAMS(X, A3, V3)                                                                              \
    (const T* __restrict__ X, int* __restrict__ out, unsigned char* __restrict__ valid,                          \
     const int* __restrict__ indices, const int* __restrict__ top_k_arr, const float* __restrict__ top_p_arr,     \
     const float* __restrict__ A3, const unsigned int* __restrict__ seed_arr,                                     \
     const unsigned int* __restrict__ offset_arr, int vocab, int flags, int top_k_val, float top_p_val, float V3, \
     unsigned int seed_lo, unsigned int seed_hi, unsigned int offset_lo, unsigned int offset_hi,                  \
     unsigned long long* __restrict__ ws, unsigned int* __restrict__ tickets)
#define SP_SAMPLE_ARGS(X, A3, V3)                                                                                \
    (X, out, valid, indices, top_k_arr, top_p_arr, A3, seed_arr, offset_arr, vocab, flags, top_k_val, top_p_val,  \
     V3, seed_lo, seed_hi, offset_lo, offset_hi, ws, tickets)
#define SP_PROBS_PARAMS SP_SAMPLE_PARAMS(probs, min_p_arr, min_p_val)
#define SP_PROBS_ARGS SP_SAMPLE_ARGS(probs, min_p_arr, min_p_val)
#define SP_LOGITS_PARAMS SP_SAMPLE_PARAMS(logits, temp_arr, c_val)
#define SP_LOGITS_ARGS SP_SAMPLE_ARGS(logits, temp_arr, c_val)

template <typename T>
__device__ void sampling_from_probs_impl SP_PROBS_PARAMS {
    const SpArgs a = {flags, top_k_val, top_p_val, min_p_val, seed_lo, seed_hi, offset_lo, offset_hi, 0.0f, nullptr};
    sp_sample_impl<T, SPM_PROBS>(probs, out, valid, indices, top_k_arr, top_p_arr, min_p_arr, seed_arr, offset_arr,
                                 vocab, a, ws, tickets);
}
PK_IO_KERNELS(sampling_from_probs, (SP_NT, 1), SP_PROBS_PARAMS, SP_PROBS_ARGS)

// sampling_from_probs over softmax(logits / T) (SPM_LOGITS), the probabilities never written: c_val = log2(e) / T
// computed on the host in float, or SPF_T_ARR and the row's T in temp_arr (indexed by the output row).
template <typename T>
__device__ void sampling_from_logits_impl SP_LOGITS_PARAMS {
    const SpArgs a = {flags & ~SPF_MIN_P, top_k_val, top_p_val, 0.0f, seed_lo, seed_hi, offset_lo, offset_hi, c_val,
                      temp_arr};
    sp_sample_impl<T, SPM_LOGITS>(logits, out, valid, indices, top_k_arr, top_p_arr, temp_arr, seed_arr, offset_arr,
                                  vocab, a, ws, tickets);
}
PK_IO_KERNELS(sampling_from_logits, (SP_NT, 1), SP_LOGITS_PARAMS, SP_LOGITS_ARGS)

// ------------------------------------------------------------------------------ softmax
// FlashInfer's softmax(logits / T) as fp32 probabilities: one CTA a row, an online (max, sum) pass over the row in
// base 2 (m the max logit, d the sum of 2^((x - m) * c), c = log2(e) / T: (x - m) * c <= 0 never overflows where
// x * c could; each thread its own running pair, merged over the block), then a pass that writes
// 2^((x - m) * c) / d. Reads the row twice and writes it once. Float math (a tolerance applies, not bit-exactness).
// A row holding a NaN or +inf becomes NaN (no distribution, as the sampling ops say with valid = False); -inf
// entries become 0 (a row of -inf: NaN). temp_arr (SMF_T_ARR) holds a T per row, else c_val is log2(e) / T.
#define SMF_T_ARR 1

// (m, d) <- the pair of the union: m the larger max, d the sums rescaled to it (a pair without entries has d = 0).
__device__ __forceinline__ void sp_sm_merge(float& m, float& d, float m2, float d2, float c) {
    const float M = fmaxf(m, m2);
    d = (d > 0.0f ? d * exp2f((m - M) * c) : 0.0f) + (d2 > 0.0f ? d2 * exp2f((m2 - M) * c) : 0.0f);
    m = M;
}

template <typename T, int VEC, int AH>
__device__ void sp_softmax_row(const T* __restrict__ row, float* __restrict__ orow, long long n, float c,
                               SpShared& s) {
    float m = -SP_POS_INF, d = 0.0f;  // running max logit and sum of 2^((x - m) * c) over the entries > -inf
    bool nan = false;
    sp_for_row<T, VEC, AH>(row, n, [&](long long i, const float* f) {
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            if (i + j < n) {
                const float x = f[j];
                nan |= !(x < SP_POS_INF);
                if (x > m) { d = (d > 0.0f ? d * exp2f((m - x) * c) : 0.0f) + 1.0f; m = x; }
                else if (x > -SP_POS_INF) d += exp2f((x - m) * c);
            }
        return false;
    });
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        sp_sm_merge(m, d, __shfl_xor_sync(PK_FULL_MASK, m, off), __shfl_xor_sync(PK_FULL_MASK, d, off), c);
    float* sm = reinterpret_cast<float*>(s.hist);  // free here
    if (lane == 0) { sm[2 * warp] = m; sm[2 * warp + 1] = d; }
    nan = __syncthreads_or(nan);  // (also the barrier before the pairs are read)
    m = -SP_POS_INF;
    d = 0.0f;
    for (int w = 0; w < SP_NW; ++w) sp_sm_merge(m, d, sm[2 * w], sm[2 * w + 1], c);
    const float inv = nan ? __int_as_float(0x7fffffff) : 1.0f / d;  // a row of -inf: d = 0, 0 * inf = NaN below
    sp_for_row<T, VEC, AH>(row, n, [&](long long i, const float* f) {
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            if (i + j < n) orow[i + j] = exp2f((f[j] - m) * c) * inv;
        return false;
    });
}

template <typename T>
__device__ void sampling_softmax_impl(const T* __restrict__ logits, float* __restrict__ out,
                                      const float* __restrict__ temp_arr, int vocab, int flags, float c_val) {
    __shared__ SpShared s;
    pk_grid_dependency_wait();  // PDL: the logits (and temp_arr) may come from the kernel just before
    pk_grid_launch_dependents();
    const int b = blockIdx.x;
    const long long off = (long long)b * vocab;
    const float c = (flags & SMF_T_ARR) ? __fdiv_rn(SP_LOG2E, temp_arr[b]) : c_val;
    pk_vec_or_elem<T>(vocab % PkVec16<T>::N == 0 && pk_aligned16(logits), [&](auto w) {
        sp_softmax_row<T, decltype(w)::value, SP_AHEAD_2CTA>(logits + off, out + off, vocab, c, s);
    });
}
PK_IO_KERNELS(sampling_softmax, (SP_NT, 2), (const T* __restrict__ logits, float* __restrict__ out,
              const float* __restrict__ temp_arr, int vocab, int flags, float c_val),
              (logits, out, temp_arr, vocab, flags, c_val))

// ------------------------------------------------------------------------------ renorm / mask
template <typename T, int VEC>
__device__ void sp_write(T* __restrict__ orow, long long i, long long n, const float* f) {
    if constexpr (VEC > 1) {
        if (i < n) PkVec16<T>::store(orow, i, f);
    } else {
        if (i < n) PkIO<T>::store(orow, i, f[0]);
    }
}

template <typename T, int VEC, int AH>
__device__ void sp_renorm_row(const T* __restrict__ row, T* __restrict__ orow, long long n, int b,
                              const int* __restrict__ top_k_arr, const float* __restrict__ top_p_arr, int flags,
                              int top_k_val, float top_p_val, SpShared& s) {
    unsigned int lo = 0u;  // 0: copy the row unchanged (top-k disabled, as FlashInfer for k >= vocab)
    float scale = 1.0f;
    SpRow r = {0u, 0, 1u, 0ull, -1.0f};
    if (flags & SRF_TOP_K) {
        const int k = (flags & SRF_K_ARR) ? top_k_arr[b] : top_k_val;
        if (k > 0 && (long long)k < n) {  // the row maximum rides along with the first pass
            sp_radix_select<T, VEC, AH, SPM_PROBS, true>(row, n, 0u, false, k, r, s);
            if (r.mkey) lo = r.lo;  // a row without mass is copied (a bad one becomes NaN below)
        }
    } else {
        lo = 1u;  // top-p of a row without mass: all zeros
        sp_set_max<SPM_PROBS>(r, sp_row_max_key<T, VEC, AH, SPM_PROBS>(row, n, s, r.bad));
        if (r.mkey) {
            const unsigned int P = sp_top_p_int((flags & SRF_P_ARR) ? top_p_arr[b] : top_p_val);
            if (P) {
                sp_radix_select<T, VEC, AH, SPM_PROBS, false>(row, n, 1u, true, P, r, s);
                lo = r.lo;
            } else {
                r.kept = sp_row_mass<T, VEC, AH, SPM_PROBS>(row, n, 0, sp_chunks<T, VEC>(n), 1u, r, s);
            }
        }
    }
    if (lo) {
        const unsigned long long S = r.kept;  // 0 for a row without mass
        // S * 2^-sh as a float; 1/S scales the kept entries (a row without mass stays 0)
        scale = S ? 1.0f / ldexpf((float)S, -r.sh) : 0.0f;
    }
    const bool bad = r.bad;  // a NaN / inf / negative entry under an active filter: a NaN row, no distribution
    sp_for_row<T, VEC, AH>(row, n, [&](long long i, float* f) {
        if (bad) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) f[j] = __int_as_float(0x7fffffff);
        } else if (lo) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const unsigned int key = sp_prob_key(f[j]);
                f[j] = key >= lo ? __uint_as_float(key) * scale : 0.0f;
            }
        }
        sp_write<T, VEC>(orow, i, n, f);
        return false;
    });
}

template <typename T, int VEC, int AH>
__device__ void sp_mask_row(const T* __restrict__ row, T* __restrict__ orow, long long n, int k, SpShared& s) {
    const bool filter = k > 0 && (long long)k < n;
    SpRow r = {0u, 0, 0u, 0ull, -1.0f};  // no mass for logits
    const unsigned int lo = filter ? sp_radix_select<T, VEC, AH, SPM_MASK, false>(row, n, 0u, false, k, r, s) : 0u;
    sp_for_row<T, VEC, AH>(row, n, [&](long long i, float* f) {
        if (filter) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) f[j] = sp_logit_key(f[j]) >= lo ? f[j] : PK_NEG_INF;
        }
        sp_write<T, VEC>(orow, i, n, f);
        return false;
    });
}

// flags: SRF_TOP_K (else top-p), SRF_K_ARR, SRF_P_ARR. Renorm and mask run two CTAs of SP_NT threads per SM
// (__launch_bounds__(SP_NT, 2): <= 64 registers, no spills on any arch); sampling_from_probs needs more.
template <typename T>
__device__ void sampling_renorm_probs_impl(const T* __restrict__ probs, T* __restrict__ out,
                                           const int* __restrict__ top_k_arr, const float* __restrict__ top_p_arr,
                                           int vocab, int flags, int top_k_val, float top_p_val) {
    __shared__ SpShared s;
    const int b = blockIdx.x;
    const long long off = (long long)b * vocab;
    pk_vec_or_elem<T>(vocab % PkVec16<T>::N == 0 && pk_aligned16(probs) && pk_aligned16(out), [&](auto w) {
        sp_renorm_row<T, decltype(w)::value, SP_AHEAD_2CTA>(probs + off, out + off, vocab, b, top_k_arr, top_p_arr,
                                                            flags, top_k_val, top_p_val, s);
    });
}
PK_IO_KERNELS(sampling_renorm_probs, (SP_NT, 2), (const T* __restrict__ probs, T* __restrict__ out,
              const int* __restrict__ top_k_arr, const float* __restrict__ top_p_arr, int vocab, int flags,
              int top_k_val, float top_p_val), (probs, out, top_k_arr, top_p_arr, vocab, flags, top_k_val, top_p_val))

// flags: SRF_K_ARR. Keeps the entries >= the k-th largest logit, the rest become -inf.
template <typename T>
__device__ void sampling_top_k_mask_logits_impl(const T* __restrict__ logits, T* __restrict__ out,
                                                const int* __restrict__ top_k_arr, int vocab, int flags,
                                                int top_k_val) {
    __shared__ SpShared s;
    const int b = blockIdx.x;
    const long long off = (long long)b * vocab;
    const int k = (flags & SRF_K_ARR) ? top_k_arr[b] : top_k_val;
    pk_vec_or_elem<T>(vocab % PkVec16<T>::N == 0 && pk_aligned16(logits) && pk_aligned16(out), [&](auto w) {
        sp_mask_row<T, decltype(w)::value, SP_AHEAD_2CTA>(logits + off, out + off, vocab, k, s);
    });
}
PK_IO_KERNELS(sampling_top_k_mask_logits, (SP_NT, 2), (const T* __restrict__ logits, T* __restrict__ out,
              const int* __restrict__ top_k_arr, int vocab, int flags, int top_k_val),
              (logits, out, top_k_arr, vocab, flags, top_k_val))

// ------------------------------------------------------------------------------ chain speculative sampling
// FlashInfer's chain_speculative_sampling (standard rejection sampling, Leviathan et al. / Chen et al.): request b
// drafted n tokens x_i with draft distributions q_i; the target model gave p_0 .. p_n. Draft token i is accepted
// with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection, position i, the emitted token is drawn from
// max(0, p_i - q_i) renormalized, and if all n are accepted a bonus token is drawn from p_n. The emitted tokens
// then follow the target model exactly. Every decision is integer arithmetic, as in sampling_from_probs:
// - decision i (< n) uses word 0 of Philox4x32-10 at counter (offset, b, i): r, and accepts iff r * q < p * 2^32,
//   decided exactly on the floats' integer mantissas (sp_accept); the draws after the first rejection are still
//   made, for FlashInfer's accepted count (each draft token judged on its own);
// - the final draw uses the word at counter (offset, b, n): the residual max(0, mass(p) - mass(q)) in the exact
//   fixed point of sp_mass, at the binade of the larger of both rows' maxima, and the inverse-CDF rule of
//   sp_find_draw (first index whose inclusive prefix exceeds floor(r * S / 2^32)). A residual without mass (the
//   two rows agree at the fixed point's resolution) draws from p itself; a p without mass emits token 0.
// Reads: the target and draft rows at the emitting position 3 times each (max, S, the walk until the draw), one
// element a thread (speculation rows are few a request; the walk stops at the chunk that holds the draw).
#define SSF_SEED_ARR 1
#define SSF_OFFSET_ARR 2

// The float's integer significand and exponent: f = m * 2^e (key > 0, finite; subnormals included).
__device__ __forceinline__ void sp_decode(unsigned int key, unsigned long long& m, int& e) {
    const unsigned int ex = key >> 23, frac = key & 0x7fffffu;
    m = ex ? (frac | 0x800000u) : frac;
    e = ex ? (int)ex - 150 : -149;
}

// r / 2^32 * q < p, exactly (p, q sanitized as probabilities: NaN, inf and negative values count as 0).
__device__ __forceinline__ bool sp_accept(unsigned int r, float p, float q) {
    const unsigned int kp = sp_prob_key(p), kq = sp_prob_key(q);
    if (kp == 0u) return false;
    if (kq == 0u) return true;
    unsigned long long mp, mq;
    int ep, eq;
    sp_decode(kp, mp, ep);
    sp_decode(kq, mq, eq);
    const unsigned long long A = (unsigned long long)r * mq;  // < 2^56
    const int d = ep + 32 - eq;  // accept iff A < mp * 2^d
    if (d >= 0) return d >= 64 ? true : (A >> d) < mp;  // mp * 2^d is a multiple of 2^d
    const int s = -d;  // A * 2^s < mp  <=>  A < ceil(mp / 2^s)
    if (s >= 25) return A == 0ull;  // mp < 2^24: ceil(mp / 2^s) = 1
    return A < ((mp + (1ull << s) - 1ull) >> s);
}

template <typename T>
__device__ __forceinline__ unsigned long long sp_residual(const T* tp, const T* dp, long long i, int sh, bool diff) {
    const unsigned long long a = sp_mass(sp_prob_key(PkIO<T>::load(tp, i)), sh);
    const unsigned long long b = diff ? sp_mass(sp_prob_key(PkIO<T>::load(dp, i)), sh) : 0ull;
    return a > b ? a - b : 0ull;
}

template <typename T>
__device__ void sampling_chain_speculative_impl(const T* __restrict__ draft_probs, const int* __restrict__ draft_ids,
        const T* __restrict__ target_probs, int* __restrict__ out_ids, int* __restrict__ accepted_num,
        int* __restrict__ emitted_num, const unsigned int* __restrict__ seed_arr,
        const unsigned int* __restrict__ offset_arr, int n, int vocab, int flags, unsigned int seed_lo,
        unsigned int seed_hi, unsigned int offset_lo, unsigned int offset_hi) {
    __shared__ SpShared s;
    __shared__ int s_pos;
    const int b = blockIdx.x;
    const long long V = vocab;
    const unsigned int k0 = (flags & SSF_SEED_ARR) ? seed_arr[2 * b] : seed_lo;
    const unsigned int k1 = (flags & SSF_SEED_ARR) ? seed_arr[2 * b + 1] : seed_hi;
    const unsigned int c0 = (flags & SSF_OFFSET_ARR) ? offset_arr[2 * b] : offset_lo;
    const unsigned int c1 = (flags & SSF_OFFSET_ARR) ? offset_arr[2 * b + 1] : offset_hi;
    const long long out0 = (long long)b * (n + 1);
    if (threadIdx.x == 0) {  // the n decisions: one thread, two loads each
        int pos = n, accepted = 0;
        for (int i = 0; i < n; ++i) {
            const int id = draft_ids[(long long)b * n + i];
            bool ok = false;
            if (id >= 0 && id < vocab) {  // a token outside the vocabulary is rejected
                unsigned int c[4] = {c0, c1, (unsigned int)b, (unsigned int)i};
                sp_philox(c, k0, k1);
                ok = sp_accept(c[0], PkIO<T>::load(target_probs, (out0 + i) * V + id),
                               PkIO<T>::load(draft_probs, ((long long)b * n + i) * V + id));
            }
            if (!ok && pos == n) pos = i;
            if (ok) ++accepted;
            if (pos == n) out_ids[out0 + i] = id;
        }
        accepted_num[b] += accepted;
        emitted_num[b] += pos;
        s_pos = pos;
    }
    __syncthreads();
    const int pos = s_pos;
    const T* tp = target_probs + (out0 + pos) * V;
    const bool diff = pos < n;  // the bonus token (pos == n) has no draft row
    const T* dp = draft_probs + ((long long)b * n + (diff ? pos : 0)) * V;
    unsigned int m = 0u;
    for (long long i = threadIdx.x; i < V; i += SP_NT) {
        m = max(m, sp_prob_key(PkIO<T>::load(tp, i)));
        if (diff) m = max(m, sp_prob_key(PkIO<T>::load(dp, i)));
    }
    const unsigned int mkey = sp_block_max(m, s);
    int token = 0;
    if (mkey) {
        const int sh = sp_shift(mkey);
        unsigned long long acc = 0ull;
        for (long long i = threadIdx.x; i < V; i += SP_NT) acc += sp_residual<T>(tp, dp, i, sh, diff);
        unsigned long long S = sp_block_sum(acc, s);
        bool use_diff = diff;
        if (S == 0ull && diff) {  // p <= q everywhere at this resolution: draw from p
            use_diff = false;
            acc = 0ull;
            for (long long i = threadIdx.x; i < V; i += SP_NT) acc += sp_residual<T>(tp, dp, i, sh, false);
            S = sp_block_sum(acc, s);
        }
        if (S) {
            unsigned int c[4] = {c0, c1, (unsigned int)b, (unsigned int)n};
            sp_philox(c, k0, k1);
            const unsigned long long t = sp_mul_frac(S, c[0]);  // in [0, S)
            if (threadIdx.x == 0) s.found = -1;
            unsigned long long run = 0ull;  // mass of the chunks before
            for (long long base = 0; base < V; base += SP_NT) {
                const long long i = base + threadIdx.x;
                const unsigned long long w = i < V ? sp_residual<T>(tp, dp, i, sh, use_diff) : 0ull;
                unsigned long long total;
                const unsigned long long before = run + sp_block_exclusive(w, &total, s);
                if (before <= t && t < before + w) s.found = (int)i;
                run += total;
                if (run > t) break;  // block-uniform
            }
            __syncthreads();
            token = s.found >= 0 ? s.found : 0;
        }
    }
    if (threadIdx.x == 0) {
        out_ids[out0 + pos] = token;
        for (int i = pos + 1; i <= n; ++i) out_ids[out0 + i] = -1;
    }
}
PK_IO_KERNELS(sampling_chain_speculative, (SP_NT, 2), (const T* __restrict__ draft_probs,
              const int* __restrict__ draft_ids, const T* __restrict__ target_probs, int* __restrict__ out_ids,
              int* __restrict__ accepted_num, int* __restrict__ emitted_num, const unsigned int* __restrict__ seed_arr,
              const unsigned int* __restrict__ offset_arr, int n, int vocab, int flags, unsigned int seed_lo,
              unsigned int seed_hi, unsigned int offset_lo, unsigned int offset_hi),
              (draft_probs, draft_ids, target_probs, out_ids, accepted_num, emitted_num, seed_arr, offset_arr, n, vocab,
               flags, seed_lo, seed_hi, offset_lo, offset_hi))
