// Shared pieces of the tensor-core attention kernels (attention_fwd_tc.cu, attention_bwd_tc.cu,
// decode_tc.cu):
// CTAs of 4 warps, 16-bit tiles (bf16 or f16: the kernels are templates over the element type T) in shared
// memory as raw words, rows padded to D + 8 halves (16 bytes) so the 8 row addresses of one ldmatrix phase
// fall in distinct banks.
#pragma once
#include "pk_common.cuh"
#include "pk_ptx.cuh"
#include "pk_attn_window.cuh"

#define FATC_THREADS 128

// The A fragment (m16 x k16, 16-bit) of k-step kk from the fp32 accumulators of n-tiles 2kk and 2kk + 1: an
// m16n8 accumulator pair has exactly an A fragment's layout, which is how P (or dS) feeds the next mma.
template <typename T, int NT>
__device__ __forceinline__ void pk_acc_to_a(unsigned int (&a)[4], const float (&s)[NT][4], int kk) {
    a[0] = Pk16<T>::narrow2(s[2 * kk][0], s[2 * kk][1]);
    a[1] = Pk16<T>::narrow2(s[2 * kk][2], s[2 * kk][3]);
    a[2] = Pk16<T>::narrow2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = Pk16<T>::narrow2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// An accumulator fragment's two adjacent outputs (columns col and col + 1 of the row at p[0]; col < dim) narrowed
// to T: one 4-byte store when vec (dim even and the array 4-byte aligned), else one element at a time, the
// second only when col + 1 < dim.
template <typename T>
__device__ __forceinline__ void pk_store_pair(T* __restrict__ p, long long off, int col, int dim, bool vec, float x0,
                                              float x1) {
    if (vec) {
        *reinterpret_cast<unsigned int*>(p + off + col) = Pk16<T>::narrow2(x0, x1);
    } else {
        PkIO<T>::store(p, off + col, x0);
        if (col + 1 < dim) PkIO<T>::store(p, off + col + 1, x1);
    }
}

// The output epilogue of every mma.sync / wgmma attention forward, for the two rows a lane holds of an m16
// accumulator fragment (row0 and row0 + 8; a row's partial sums l are spread over its quad of 4 lanes, so
// every lane calls this, before any row check). For each row below n_q: out_row(r, row, inv) writes the row's
// outputs times inv = v_scale / l (0 for a row that saw no key: its outputs are 0), and the quad's lane 0
// writes the natural-log lse, ln 2 * (m * m_mul + log2 l) (m_mul brings the row max m into log2 units;
// -inf for a row that saw no key), to *lse_at(row).
template <typename OutRow, typename LseAt>
__device__ __forceinline__ void pk_attn_epilogue(const float (&l)[2], const float (&m)[2], float m_mul, float v_scale,
                                                 int row0, int n_q, OutRow out_row, LseAt lse_at) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float lr = l[r];
        lr += __shfl_xor_sync(PK_FULL_MASK, lr, 1);
        lr += __shfl_xor_sync(PK_FULL_MASK, lr, 2);
        const int row = row0 + 8 * r;
        if (row >= n_q) continue;
        out_row(r, row, lr > 0.0f ? v_scale / lr : 0.0f);
        if ((threadIdx.x & 3) == 0)
            *lse_at(row) = lr > 0.0f ? (m[r] * m_mul + log2f(lr)) * 0.6931471805599453f : PK_NEG_INF;
    }
}

// The TMA box / wgmma swizzle atom of a head dim D in the sm_90a attention kernels: COLS head-dim columns a box,
// 64 (128-byte rows, 128B swizzle) where D is a multiple of 64, else 32 (64-byte rows, 64B swizzle): head_dim 96 is
// three boxes, as FA3 lays it out (the largest swizzle whose row divides the head dim's bytes), so one tensor map per
// array serves every box. ROW: bytes a box row; KSTEPS: wgmma k-steps (16 columns, 32 bytes) a box row; SWIZZLE:
// the descriptors' and pk_swizzle_offset's mode. Both swizzles repeat every 8 rows (1024 or 512 bytes).
template <int D> struct PkAttnBox {
    enum { COLS = D % 64 ? 32 : 64, ROW = 2 * COLS, KSTEPS = COLS / 16, BOXES = D / COLS,
           SWIZZLE = D % 64 ? PK_SWIZZLE_64B : PK_SWIZZLE_128B };
    static_assert(D % 32 == 0, "PkAttnBox: a head dim of whole 32-column boxes");
};

// 2^x of a score in n-tile j (8 keys) of a steady-state tile, the sm_90a forwards' MUFU / FMA split
// (attention_fwd_sm90.cu's Fa90Fex, attention_fwd_fp8_sm90.cu's FA90F8_FEX): n-tiles with j % 4 < FEX take
// pk_exp2_fma, the others MUFU.EX2 (j is a constant once the loops unroll). pk_exp2_fma gives 2^127 for x >= 127
// or NaN: the bf16 lazy softmax's check fails there as it does on inf / NaN; the FP8 row-max-first softmax has
// x <= FA90F8_OFF.
template <int FEX>
__device__ __forceinline__ float pk_attn_exp2(int j, float x) {
    return j % 4 < FEX ? pk_exp2_fma(x) : pk_ex2_approx(x);
}

// The staged O epilogue of the sm_90a forwards (FA3's; attention_fwd_sm90.cu, attention_fwd_fp8_sm90.cu): a
// consumer warpgroup's 64 rows of O go through shared memory, in the layout of a TMA box of BX 16-bit columns
// ([DV / BX][box rows][2 BX bytes], box_bytes a box; BX 64: 128B swizzle, the 16-byte unit XORed by row % 8; BX 32
// (DV 96): 64B swizzle, XORed by (row / 2) % 4), so that the rows leave with 16-byte stores (or one TMA store a
// box). The stage must be 1024-byte aligned (the swizzle's pattern).
// pk_attn_stage_o_row: row r (0, 1: the lane's rows g and g + 8) of a lane's m64nDV wgmma accumulators o, times
// inv and rounded to T, at byte rb = (the row's index in the stage) * 2 BX + 4 t: out's column 8 jj + 2 t is byte
// 16 (jj % (BX / 8)) + 4 t of box jj / (BX / 8), and the 8 rows x 4 lanes of one 4-byte store land in 32 distinct
// banks (BX 32: rows 2i and 2i + 1 are 64 bytes apart, and the four row pairs' units differ by the XOR).
template <typename T, int DV, int BX = 64>
__device__ __forceinline__ void pk_attn_stage_o_row(unsigned char* stage, unsigned box_bytes, unsigned rb,
                                                    const float (&o)[DV / 2], int r, float inv) {
    constexpr int UB = BX / 8, SW = BX == 64 ? PK_SWIZZLE_128B : PK_SWIZZLE_64B;  // 16-byte units a box row
    static_assert((BX == 64 || BX == 32) && DV % BX == 0, "pk_attn_stage_o_row: boxes of 64 or 32 columns");
#pragma unroll
    for (int jj = 0; jj < DV / 8; jj++)
        *reinterpret_cast<unsigned int*>(stage + (jj / UB) * box_bytes + pk_swizzle_offset(rb + 16 * (jj % UB), SW)) =
            Pk16<T>::narrow2(o[4 * jj + 2 * r] * inv, o[4 * jj + 2 * r + 1] * inv);
}

// The staged rows' 16-byte stores, by a warpgroup's 128 threads (wt = 0..127), after a barrier of the warpgroup
// (its rows all staged): the stage's rows srow0..srow0 + 63 to out rows ob0, ob0 + o_stride, ... (ob0: the first
// row's first element; 64-bit offsets), rows nr and past skipped (the sequence's end: a TMA box would run into the
// next sequence's rows of a packed out, or past a dense out's batch). DV / 8 pieces a row, consecutive threads on
// consecutive pieces of a row (a warp writes 512 contiguous bytes at DV 256, 2 rows of 256 at 128, 4 of 128 at 64),
// 128 / (DV / 8) rows a pass (rounded down: at DV 96, 10 rows of 12 pieces, threads 120.. idle, 7 passes): DV / 16
// STG.128 a thread. Each 8 lanes (a 16-byte access's phase) read 8 pieces of one row, whose 16-byte units the
// swizzle permutes: no bank conflict at BX 64; at BX 32 a phase's pieces span two boxes (and rows), whose units can
// share banks (up to 2-way conflicts, once a work tile).
template <typename T, int DV, int BX = 64>
__device__ __forceinline__ void pk_attn_store_staged_o(const unsigned char* stage, unsigned box_bytes, int srow0,
                                                       T* ob0, long long o_stride, int nr, unsigned wt) {
    constexpr int PR = DV / 8, RP = 128 / PR, PASSES = (64 + RP - 1) / RP;  // pieces a row, rows a pass
    constexpr int UB = BX / 8, SW = BX == 64 ? PK_SWIZZLE_128B : PK_SWIZZLE_64B;
    static_assert((BX == 64 || BX == 32) && DV % BX == 0, "pk_attn_store_staged_o: boxes of 64 or 32 columns");
    const int pc = (int)(wt % PR), rr0 = (int)(wt / PR);
    if (PR * RP != 128 && rr0 >= RP) return;  // the threads past the last whole row of a pass (DV 96)
    T* ob = ob0 + (long long)rr0 * o_stride + 8 * pc;
    const unsigned char* sb = stage + (pc / UB) * box_bytes;
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        const int rr = rr0 + p * RP;
        if (rr < nr && (64 % RP == 0 || rr < 64))
            pk_st_global_b128(ob + (long long)(p * RP) * o_stride,
                              pk_ld_shared_b128(sb + pk_swizzle_offset((srow0 + rr) * 2 * BX + (pc % UB) * 16, SW)));
    }
}

// The dK / dV epilogue's row walk of every attention backward, for the two key rows a lane holds of an m16
// accumulator fragment (key0 and key0 + 8): for each key below n_k, store_row(r, off) writes the row's outputs,
// off = (batch_row0 + key) * row_stride + head_off being the element offset of the row's first column.
template <typename StoreRow>
__device__ __forceinline__ void pk_attn_key_rows(int key0, int n_k, long long batch_row0, long long row_stride,
                                                 long long head_off, StoreRow store_row) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = key0 + 8 * r;
        if (key >= n_k) continue;
        store_row(r, (batch_row0 + key) * row_stride + head_off);
    }
}

// One row's step of the online softmax, shared by the mma.sync and wgmma kernels: mx (this lane's max of the
// row's new scores and the old max m) becomes the quad's (the 4 lanes holding the row), base = mx * mul (0 for a
// row with nothing visible yet: P = 0, no NaN from -inf - -inf), m the new max; returns the rescale factor
// alpha = 2^(m_old * mul - base) of the row's O and l.
__device__ __forceinline__ float pk_quad_rescale(float mx, float& m, float mul, float& base) {
    mx = fmaxf(mx, __shfl_xor_sync(PK_FULL_MASK, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(PK_FULL_MASK, mx, 2));
    base = mx == PK_NEG_INF ? 0.0f : mx * mul;
    const float alpha = pk_ex2_approx(m * mul - base);
    m = mx;
    return alpha;
}

// One online-softmax step of a warp's S accumulators (NT n-tiles of m16n8, masked to -inf), rows g and g + 8
// (r = 0, 1): the row max over the quad, s becomes P = 2^(mul * (s - max)), l[r] this lane's partial row sum
// (the quad reduces it at the end) and o[ON][4] is rescaled by 2^(mul * (old max - new max)). m holds the
// unscaled max. mul folds the score scale (in base 2) into the exponent's FMA; scores already scaled pass 1
// (the FMA by 1 is folded away). A row with nothing visible yet stays at base 0 (P = 0, no NaN from
// -inf - -inf).
template <int NT, int ON>
__device__ __forceinline__ void fatc_online_softmax(float (&s)[NT][4], float (&o)[ON][4], float (&m)[2],
                                                    float (&l)[2], float mul = 1.0f) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = m[r];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        float base;
        const float alpha = pk_quad_rescale(mx, m[r], mul, base);
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            s[nt][2 * r] = pk_ex2_approx(fmaf(s[nt][2 * r], mul, -base));
            s[nt][2 * r + 1] = pk_ex2_approx(fmaf(s[nt][2 * r + 1], mul, -base));
            sum += s[nt][2 * r] + s[nt][2 * r + 1];
        }
        l[r] = l[r] * alpha + sum;
#pragma unroll
        for (int i = 0; i < ON; i++) o[i][2 * r] *= alpha, o[i][2 * r + 1] *= alpha;
    }
}

// SC (softcap c): the scores become tanh(s * pre), pre = scale / c, via tanh.approx (one MUFU op a score) as the
// mma.sync kernels do; sl2 = c * log2 e then takes them to base 2 (c * tanh(scale * q.k / c) * log2 e), so the
// softmax code and m's units (a multiple of sl2) are those of the plain kernel. Without SC nothing is emitted.
// Shared by the sm_90a forwards (attention_fwd_sm90.cu; attention_fwd_fp8_sm90.cu with pre = scale * q_descale *
// k_descale / c) over a wgmma m64nBC accumulator.
template <bool SC, int BC>
__device__ __forceinline__ void fa90_cap(float (&s)[BC / 2], float pre) {
    if constexpr (SC) {
#pragma unroll
        for (int i = 0; i < BC / 2; i++) s[i] = __tanhf(s[i] * pre);
    }
}

// The max of row g + 8 r of a wgmma m64nBC accumulator (the layout below) over this lane's columns and m (the
// row's max so far).
template <int BC>
__device__ __forceinline__ float pk_wgmma_row_max(const float (&s)[BC / 2], int r, float m) {
#pragma unroll
    for (int j = 0; j < BC / 8; j++) m = fmaxf(m, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    return m;
}

// The same step for a wgmma m64nBC accumulator (s[4 j + 2 r + e]: n-tile j, row g + 8 r, column 8 j + 2 t + e;
// O lives in the caller's accumulators): P = 2^(s * sl2 - base) rounded to T straight into the A fragments of
// O += P V (n-tiles 2 kk, 2 kk + 1 are exactly k-step kk's A fragment: a[0] / a[2] row g, a[1] / a[3] g + 8), l[r]
// this lane's partial row sum (the quad sums it at the end), al[r] the factor the caller rescales O's rows by.
template <typename T, int BC>
__device__ __forceinline__ void pk_wgmma_online_softmax(const float (&s)[BC / 2], float (&m)[2], float (&l)[2],
                                                        unsigned (&pa)[BC / 16][4], float (&al)[2], float sl2) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float mx = pk_wgmma_row_max<BC>(s, r, m[r]);
        float base;
        al[r] = pk_quad_rescale(mx, m[r], sl2, base);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < BC / 8; j++) {
            const float p0 = pk_ex2_approx(fmaf(s[4 * j + 2 * r], sl2, -base));
            const float p1 = pk_ex2_approx(fmaf(s[4 * j + 2 * r + 1], sl2, -base));
            sum += p0 + p1;
            pa[j / 2][2 * (j & 1) + r] = Pk16<T>::narrow2(p0, p1);
        }
        l[r] = l[r] * al[r] + sum;
    }
}

// Rows [r0, r0 + ROWS) of a strided matrix of 16-bit T into s[ROWS][D + 8] (raw words): 16-byte cp.async
// chunks when `vec`, else element by element; zeros past `dim` and past n_rows.
template <int D, int ROWS, typename T>
__device__ __forceinline__ void fatc_load_tile(unsigned short* s, const T* __restrict__ gt, long long base,
                                               long long row_stride, int r0, int n_rows, int dim, bool vec) {
    static_assert(sizeof(T) == 2, "fatc_load_tile: 16-bit elements");
    const unsigned short* __restrict__ g = reinterpret_cast<const unsigned short*>(gt);
    constexpr int CH = D / 8;  // 16-byte chunks per row
    for (int c = threadIdx.x; c < ROWS * CH; c += FATC_THREADS) {
        const int r = c / CH, d = (c % CH) * 8;
        unsigned short* dst = s + r * (D + 8) + d;
        const int row = r0 + r;
        const long long off = base + (long long)row * row_stride + d;
        if (vec && row < n_rows && d < dim) {  // vec implies dim % 8 == 0: the chunk is whole
            pk_cp_async_16(dst, g + off);
        } else {
            unsigned int w[4] = {0u, 0u, 0u, 0u};  // fully unrolled: constant indices keep w in registers
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (row < n_rows && d + e < dim) w[e >> 1] |= (unsigned int)g[off + e] << (16 * (e & 1));
            *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// PK_ATTN_TC_ENTRY(entry, body) defines entry<T, P...>(args...) as body<T, P...>(args...) on sm_80+ and as
// a trap on sm_75 (mma.m16n8k16 needs sm_80; the ops never launch these there, and body is never
// instantiated): PK_IO_VARIANT(name, entry, P...) then names a variant.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define PK_ATTN_TC_ENTRY(entry, body)                                                              \
    template <typename T, auto... P, typename... A>                                                \
    __device__ __forceinline__ void entry(A...) { __trap(); }
#else
#define PK_ATTN_TC_ENTRY(entry, body)                                                              \
    template <typename T, auto... P, typename... A>                                                \
    __device__ __forceinline__ void entry(A... a) { body<T, P...>(a...); }
#endif

// The MLA decode kernels' parameters (mla_decode of mla.cu and mla_decode_sm90 of mla_sm90.cu: one op, one
// launch signature, chosen by arch).
#define PK_MLA_DECODE_PARAMS                                                                                      \
    (const T* __restrict__ q_nope, const T* __restrict__ q_pe, const T* __restrict__ ckv, const T* __restrict__ kpe, \
     T* __restrict__ out, float* __restrict__ lse, T* __restrict__ part_o, float* __restrict__ part_lse,          \
     const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices, const int* __restrict__ kv_len,       \
     int num_heads, int page_size, long long ckv_sp, long long ckv_st, long long kpe_sp, long long kpe_st,        \
     int num_splits, int write_lse, float sm_scale)
#define PK_MLA_DECODE_ARGS                                                                                        \
    (q_nope, q_pe, ckv, kpe, out, lse, part_o, part_lse, kv_indptr, kv_indices, kv_len, num_heads, page_size,      \
     ckv_sp, ckv_st, kpe_sp, kpe_st, num_splits, write_lse, sm_scale)
