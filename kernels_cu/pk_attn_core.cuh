// The FlashAttention-2 forward tile core (tensor cores, bf16 / f16), shared by the dense forward
// (attention_fwd_tc.cu) and its varlen entry points. See docs/attention_tc.md "Forward core".
//
// One CTA = PKFA_WARPS warps = PKFA_BR (128) consecutive query rows of one (sequence, head); warp w owns
// rows 16w..16w+15 (the online softmax of a row stays in its warp: the 4 lanes of a quad share a row).
//   * Q: one cp.async of the tile into shared memory, then ldmatrix.x4 once into registers (D/16 A
//     fragments), kept for the whole CTA.
//   * K/V: tiles of PKFA_BC (64) keys, double-buffered with 16-byte cp.async; a "loader" policy owns the
//     per-thread global pointers (dense / varlen: a base and a row stride) and moves them one tile back
//     with a pointer decrement: the steady-state loop does no address arithmetic beyond that.
//   * S = Q K^T: ldmatrix.x4 of K (two k-steps of one 8-key n-tile), mma.m16n8k16 -> f32.
//   * online softmax on the accumulators (base 2, ex2.approx, one FFMA per score), one O rescale a tile.
//   * O += P V: the S accumulators of n-tiles 2kk, 2kk+1 are packed to T in registers (cvt.rn.*x2) and
//     are the A fragment of k-step kk (no shared round trip); V through ldmatrix.x4.trans.
// Shared tiles are unpadded, rows of D halves, with the 16-byte chunk c of row r stored at chunk
// c ^ (r & 7): the 8 row addresses of every ldmatrix phase and of every cp.async quarter-warp fall in 8
// distinct 16-byte bank groups (no bank conflicts). The per-lane swizzled offsets are computed once; in
// the unrolled loops every shared address is a lane register plus an immediate.
// Key tiles are visited from the last to the first: the last one (the causal diagonal, the ragged end of
// n_k) is loaded with bounds and masked; then the tiles every row of the CTA sees whole run in a loop with
// no mask, no bounds and no division (the steady state); then the first tiles a window cuts, masked.
// Every key tile after the first loaded one lies wholly below n_k, so only the first load checks bounds.
#pragma once
#include "pk_attn_tc.cuh"

#define PKFA_WARPS 8
#define PKFA_THREADS 256
#define PKFA_BR 128
#define PKFA_BC 64

// CTAs per SM asked of ptxas: d64 fits 128 registers (2 CTAs = 16 warps), d128 takes up to 255.
template <int D> struct PkFaCfg;
template <> struct PkFaCfg<64> { enum { MINB = 1 }; };
template <> struct PkFaCfg<128> { enum { MINB = 1 }; };

// Dynamic shared memory of one CTA: K/V [2 buffers][K, V][BC][D] then Q [BR][D], 16-bit elements.
#define PKFA_SMEM_BYTES(D) ((4 * PKFA_BC + PKFA_BR) * (D) * 2)

// Byte offset of 16-byte chunk c of row r in a swizzled tile of D halves a row.
template <int D> __device__ __forceinline__ unsigned pkfa_swz(int r, int c) {
    return (unsigned)(r * D * 2 + ((c ^ (r & 7)) << 4));
}

// Dense / varlen K and V: row i of the sequence at k + i * k_stride (elements). Thread tid copies the
// chunks (r0 + RSTEP * i, c) of a tile; kp / vp point at row r0 of the tile it will load next.
template <typename T, int D> struct PkFaDenseKV {
    static constexpr int CPR = D / 8;                   // 16-byte chunks a row
    static constexpr int RSTEP = PKFA_THREADS / CPR;    // rows between a thread's chunks
    static constexpr int NI = PKFA_BC / RSTEP;          // chunks a thread per tile and matrix
    const char* kp;
    const char* vp;
    long long ks, vs;  // bytes between rows
    unsigned soff;     // swizzled shared offset of (r0, c) in a tile
    int r0;

    // k / v: row 0 of this (sequence, kv head); tile: the first tile the CTA loads.
    __device__ __forceinline__ void init(const T* k, const T* v, long long k_stride, long long v_stride, int tile) {
        const int tid = threadIdx.x, c = tid % CPR;
        r0 = tid / CPR;
        ks = k_stride * 2;
        vs = v_stride * 2;
        soff = pkfa_swz<D>(r0, c);
        kp = reinterpret_cast<const char*>(k) + (long long)(tile * PKFA_BC + r0) * ks + c * 16;
        vp = reinterpret_cast<const char*>(v) + (long long)(tile * PKFA_BC + r0) * vs + c * 16;
    }
    // A whole tile (every row < n_k) into the K buffer at shared address kb (V at kb + BC * D * 2);
    // then one tile back.
    __device__ __forceinline__ void full(pk_saddr kb) {
        const pk_saddr d = kb + soff;
#pragma unroll
        for (int i = 0; i < NI; i++) {
            pk_cp_async_16_s(d + i * RSTEP * D * 2, kp + i * RSTEP * ks);
            pk_cp_async_16_s(d + PKFA_BC * D * 2 + i * RSTEP * D * 2, vp + i * RSTEP * vs);
        }
        kp -= PKFA_BC * ks;
        vp -= PKFA_BC * vs;
    }
    // The first tile (keys k0..): rows at or past n_k are zero-filled; then one tile back.
    // smem: the same K buffer as a pointer (for the zero stores).
    __device__ __forceinline__ void bounded(unsigned char* smem, pk_saddr kb, int k0, int n_k) {
#pragma unroll
        for (int i = 0; i < NI; i++) {
            const unsigned o = soff + i * RSTEP * D * 2;
            if (k0 + r0 + i * RSTEP < n_k) {
                pk_cp_async_16_s(kb + o, kp + i * RSTEP * ks);
                pk_cp_async_16_s(kb + PKFA_BC * D * 2 + o, vp + i * RSTEP * vs);
            } else {
                *reinterpret_cast<uint4*>(smem + o) = make_uint4(0u, 0u, 0u, 0u);
                *reinterpret_cast<uint4*>(smem + PKFA_BC * D * 2 + o) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        kp -= PKFA_BC * ks;
        vp -= PKFA_BC * vs;
    }
};

// Paged K/V (FlashInfer's page table; see docs/serving.md): position pos of the sequence is token
// pos & (page_size - 1) of page indices[pbeg + (pos >> ps_log2)] (page sizes are powers of two: shifts, no
// division), at element page * s_page + token * s_tok + hoff. Each thread gathers its rows of a tile with
// 16-byte cp.async through the table; t0 is the first position of the tile it loads next.
template <typename T, int D> struct PkFaPagedKV {
    static constexpr int CPR = D / 8, RSTEP = PKFA_THREADS / CPR, NI = PKFA_BC / RSTEP;
    const int* __restrict__ indices;  // kv_indices + indptr[b]
    const char* kbase;                // k_pages + hoff + chunk (bytes)
    const char* vbase;
    long long s_page, s_tok;          // bytes
    int ps_log2, t0, r0;
    unsigned soff;

    // Set by the caller before pkfa_forward: the table of this sequence, strides in elements.
    __device__ __forceinline__ void setup(const int* idx, int log2_page, long long sp, long long st) {
        indices = idx;
        ps_log2 = log2_page;
        s_page = sp * 2;
        s_tok = st * 2;
    }
    // k / v: the pages' element 0 of this kv head (hoff added); k_stride / v_stride unused (paged).
    __device__ __forceinline__ void init(const T* k, const T* v, long long, long long, int tile) {
        const int tid = threadIdx.x, c = tid % CPR;
        r0 = tid / CPR;
        soff = pkfa_swz<D>(r0, c);
        kbase = reinterpret_cast<const char*>(k) + c * 16;
        vbase = reinterpret_cast<const char*>(v) + c * 16;
        t0 = tile * PKFA_BC;
    }
    __device__ __forceinline__ long long offset(int pos) const {
        const long long page = indices[pos >> ps_log2];
        return page * s_page + (long long)(pos & ((1 << ps_log2) - 1)) * s_tok;
    }
    __device__ __forceinline__ void full(pk_saddr kb) {
        const pk_saddr d = kb + soff;
        long long o[NI];
#pragma unroll
        for (int i = 0; i < NI; i++) o[i] = offset(t0 + r0 + i * RSTEP);  // the table reads first, together
#pragma unroll
        for (int i = 0; i < NI; i++) {
            pk_cp_async_16_s(d + i * RSTEP * D * 2, kbase + o[i]);
            pk_cp_async_16_s(d + PKFA_BC * D * 2 + i * RSTEP * D * 2, vbase + o[i]);
        }
        t0 -= PKFA_BC;
    }
    __device__ __forceinline__ void bounded(unsigned char* smem, pk_saddr kb, int k0, int n_k) {
#pragma unroll
        for (int i = 0; i < NI; i++) {
            const unsigned so = soff + i * RSTEP * D * 2;
            const int pos = t0 + r0 + i * RSTEP;
            if (pos < n_k) {
                const long long o = offset(pos);
                pk_cp_async_16_s(kb + so, kbase + o);
                pk_cp_async_16_s(kb + PKFA_BC * D * 2 + so, vbase + o);
            } else {
                *reinterpret_cast<uint4*>(smem + so) = make_uint4(0u, 0u, 0u, 0u);
                *reinterpret_cast<uint4*>(smem + PKFA_BC * D * 2 + so) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        t0 -= PKFA_BC;
        (void)k0;
    }
};

// The per-warp state of the forward: Q fragments, O accumulators, row max / sum of the lane's two rows.
template <typename T, int D, bool SC> struct PkFaCore {
    static constexpr int KS = D / 16;          // k-steps of Q K^T
    static constexpr int NT = PKFA_BC / 8;     // S n-tiles
    static constexpr int ON = D / 8;           // O n-tiles
    static constexpr unsigned TILE = PKFA_BC * D * 2;  // bytes of one K or V tile
    unsigned qa[KS][4];
    float o[ON][4];
    float m[2], l[2];  // m in score units (after the softcap transform); l: this lane's partial sums
    pk_saddr ka[2], va[4];  // this lane's swizzled ldmatrix addresses in the K / V buffer in use
    float mul, pre, post;       // p = ex2(x * mul - m * mul); x = SC ? tanh(s * pre) * post : s

    // kb: shared address of the first K buffer (its V buffer at kb + TILE).
    __device__ __forceinline__ void init(pk_saddr kb, float scale, float softcap) {
        const int lane = threadIdx.x & 31, y = lane & 7;
        // K (B of Q K^T, x4 = chunks 4h + 0..3 of rows 0..7 of an n-tile): chunk 8G + 4h + x of row r sits at
        // 8G + ((4h + x) ^ (r & 7)), so two lane offsets (h = 0, 1) serve every (G, n-tile) with an immediate.
#pragma unroll
        for (int h = 0; h < 2; h++) ka[h] = kb + (unsigned)(y * D * 2 + (((4 * h + (lane >> 3)) ^ y) << 4));
        // V (B of P V, x4.trans = rows 0..15, chunks 2np + 0..1): four lane offsets (np & 3).
        const int vrow = y + 8 * ((lane >> 3) & 1);
#pragma unroll
        for (int h = 0; h < 4; h++) va[h] = kb + TILE + (unsigned)(vrow * D * 2 + (((2 * h + (lane >> 4)) ^ y) << 4));
#pragma unroll
        for (int i = 0; i < ON; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
        m[0] = m[1] = PK_NEG_INF;
        l[0] = l[1] = 0.0f;
        // Base-2 scores: s * scale * log2 e, or with softcap c: tanh(s * scale / c) * c * log2 e.
        mul = SC ? 1.0f : scale * 1.4426950408889634f;
        pre = SC ? scale / softcap : 0.0f;
        post = SC ? softcap * 1.4426950408889634f : 0.0f;
    }

    // Q rows of this warp from the swizzled Q tile at shared address qb (ldmatrix.x4, once).
    __device__ __forceinline__ void load_q(pk_saddr qb) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        const int row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
        for (int ks = 0; ks < KS; ks++) pk_ldmatrix_x4_s(qa[ks], qb + pkfa_swz<D>(row, 2 * ks + (lane >> 4)));
    }

    // The lane's ldmatrix addresses move to the other buffer (dlt = +-2 TILE).
    __device__ __forceinline__ void flip(int dlt) {
#pragma unroll
        for (int h = 0; h < 2; h++) ka[h] += dlt;
#pragma unroll
        for (int h = 0; h < 4; h++) va[h] += dlt;
    }

    // One key tile from the buffer in use (ka / va). MASK: keys outside [rlo[r], rhi[r]] of the lane's
    // rows r get -inf (k0 = the tile's first key); without it no index is computed at all.
    template <bool MASK>
    __device__ __forceinline__ void tile(int k0, const int* rlo, const int* rhi) {
        float s[NT][4];
#pragma unroll
        for (int i = 0; i < NT; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kp = 0; kp < D / 32; kp++) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                unsigned kf[4];  // b of k-step 2kp in kf[0..1], of 2kp + 1 in kf[2..3]
                pk_ldmatrix_x4_s(kf, ka[kp & 1] + nt * 8 * D * 2 + (kp >> 1) * 128);
                pk_mma_m16n8k16<T>(s[nt], qa[2 * kp], kf, s[nt]);
                pk_mma_m16n8k16<T>(s[nt], qa[2 * kp + 1], kf + 2, s[nt]);
            }
        }
        if (SC) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = __tanhf(s[nt][e] * pre) * post;
        }
        if (MASK) {
            const int t = threadIdx.x & 3;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int col = k0 + nt * 8 + 2 * t + (e & 1);
                    if (col < rlo[e >> 1] || col > rhi[e >> 1]) s[nt][e] = PK_NEG_INF;
                }
        }
        fatc_online_softmax(s, o, m, l, mul);
#pragma unroll
        for (int kk = 0; kk < PKFA_BC / 16; kk++) {
            unsigned pa[4];
            pk_acc_to_a<T>(pa, s, kk);
#pragma unroll
            for (int np = 0; np < D / 16; np++) {
                unsigned vf[4];  // b of O n-tile 2np in vf[0..1], of 2np + 1 in vf[2..3]
                pk_ldmatrix_x4_trans_s(vf, va[np & 3] + kk * 16 * D * 2 + (np >> 2) * 128);
                pk_mma_m16n8k16<T>(o[2 * np], pa, vf, o[2 * np]);
                pk_mma_m16n8k16<T>(o[2 * np + 1], pa, vf + 2, o[2 * np + 1]);
            }
        }
    }

    // out rows row0, row0 + 8 of this lane (o_row: element offset of row 0 of the sequence/head,
    // o_stride: elements between rows; lse_row / lse_stride likewise), rows at or past n_q skipped.
    __device__ __forceinline__ void store(T* __restrict__ out, long long o_row, long long o_stride,
                                          float* __restrict__ lse, long long lse_row, long long lse_stride, int row0,
                                          int n_q, float v_scale) {
        const int t = threadIdx.x & 3;
        pk_attn_epilogue(
            l, m, mul, v_scale, row0, n_q,
            [&](int r, int row, float inv) {
                T* orow = out + o_row + (long long)row * o_stride;
#pragma unroll
                for (int i = 0; i < ON; i++)
                    *reinterpret_cast<unsigned*>(orow + i * 8 + 2 * t) =
                        Pk16<T>::narrow2(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
            },
            [&](int row) { return lse + lse_row + (long long)row * lse_stride; });
    }
};

// Q tile (rows q0.. of a matrix at q with q_stride elements between rows; rows >= n_q zero) into the
// swizzled Q buffer at byte offset qb: 16-byte cp.async (the caller commits).
template <typename T, int D>
__device__ __forceinline__ void pkfa_load_q(unsigned char* smem, unsigned qb, const T* q, long long q_stride, int q0,
                                            int n_q) {
    constexpr int CPR = D / 8;
#pragma unroll
    for (int i = 0; i < PKFA_BR * CPR / PKFA_THREADS; i++) {
        const int ch = threadIdx.x + i * PKFA_THREADS, r = ch / CPR, c = ch % CPR;
        const unsigned o = qb + pkfa_swz<D>(r, c);
        if (q0 + r < n_q) pk_cp_async_16_at(smem, o, q + (long long)(q0 + r) * q_stride + c * 8);
        else *reinterpret_cast<uint4*>(smem + o) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// The whole forward of one CTA (smem: the dynamic shared memory, PKFA_SMEM_BYTES(D), 16-byte aligned): query rows [q0, q0 + BR) of n_q, keys [0, n_k) through the loader
// (initialised by this function at the first tile), window (wl, wr) as in pk_attn_window.cuh.
// q: row 0 of this (sequence, head), q_stride elements between rows; k / v likewise for the kv head;
// the output row r of this head at out + o_row + r * o_stride, lse at lse + lse_row + r * lse_stride;
// v_scale multiplies the output (an FP8-style V scale; 1 otherwise).
template <typename T, int D, bool SC, typename KV>
__device__ __forceinline__ void pkfa_forward(unsigned char* smem, KV& kv, const T* __restrict__ q, long long q_stride,
                                             const T* __restrict__ k, const T* __restrict__ v, long long k_stride,
                                             long long v_stride, T* __restrict__ out, long long o_row,
                                             long long o_stride, float* __restrict__ lse, long long lse_row,
                                             long long lse_stride, int q0, int n_q, int n_k, float scale, int wl,
                                             int wr, float softcap, float v_scale = 1.0f) {
    using Core = PkFaCore<T, D, SC>;
    constexpr unsigned TILE = Core::TILE, QB = 4 * TILE;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q_last = min(q0 + PKFA_BR, n_q) - 1;
    const PkAttnSpan span = pk_attn_q_span(q0, q_last, n_q, n_k, wl, wr);
    const int kt0 = span.lo / PKFA_BC, kt1 = span.hi < span.lo ? kt0 : span.hi / PKFA_BC + 1;
    // Tiles [f0, f1) are seen whole by every row of the CTA (and lie below n_k): no mask.
    const int f0 = span.full_lo <= 0 ? 0 : (span.full_lo + PKFA_BC - 1) / PKFA_BC;
    const int f1 = (span.full_hi + 1) / PKFA_BC;
    const int f1c = min(max(f1, kt0), kt1), f0c = min(max(f0, kt0), f1c);

    Core c;
    const pk_saddr sb = pk_saddr_of(smem);
    c.init(sb, scale, softcap);
    pkfa_load_q<T, D>(smem, QB, q, q_stride, q0, n_q);
    int j = kt1 - 1;
    if (kt1 > kt0) {
        kv.init(k, v, k_stride, v_stride, j);
        kv.bounded(smem, sb, j * PKFA_BC, n_k);
    }
    pk_cp_async_commit();
    pk_cp_async_wait<0>();
    __syncthreads();
    c.load_q(sb + QB);

    const int row0 = q0 + warp * 16 + (lane >> 2);  // this lane's rows: row0, row0 + 8
    int rlo[2], rhi[2];
    pk_attn_q_rows(row0, n_q, n_k, wl, wr, rlo, rhi);

    // The buffer in use is where c's addresses point; nxt is the other one, dlt the step between them.
    pk_saddr nxt = sb + 2 * TILE;
    int dlt = 2 * (int)TILE;
#define PKFA_STEP(MASK)                                                                                    \
    pk_cp_async_wait<0>();                                                                                 \
    __syncthreads(); /* tile j landed; every warp is done with the other buffer */                         \
    if (j > kt0) kv.full(nxt);                                                                             \
    pk_cp_async_commit();                                                                                  \
    c.template tile<MASK>(j * PKFA_BC, rlo, rhi);                                                          \
    c.flip(dlt);                                                                                           \
    nxt -= dlt;                                                                                            \
    dlt = -dlt;
    // Boundary tiles at the end (causal diagonal, ragged n_k), masked.
    for (; j >= f1c; --j) { PKFA_STEP(true) }
    // The steady state: whole tiles, no mask.
    for (; j >= f0c; --j) { PKFA_STEP(false) }
    // Tiles at the start that a window cuts, masked.
    for (; j >= kt0; --j) { PKFA_STEP(true) }
#undef PKFA_STEP
    pk_cp_async_wait<0>();
    c.store(out, o_row, o_stride, lse, lse_row, lse_stride, row0, n_q, v_scale);
}
