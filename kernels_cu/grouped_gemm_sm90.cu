// pykern: arch sm_90a
// Hopper (sm_90a) grouped GEMM, bf16 and f16 with fp32 accumulation: TMA loads, wgmma, a warp-specialised
// persistent CTA. Rows offsets[e]..offsets[e+1] of a [M, K] (sorted by group) times b[e]^T (b [E, N, K]):
//   grouped_gemm_sm90        out [M, N] = a[rows] @ b[e]^T;
//   moe_gemm_act_sm90        the experts' first GEMM with the activation fused (as moe.cu's moe_gemm_act_tc): b is
//                            gate_up [E, 2I, H] (gate rows first), out [M, I] = act(a @ gate^T) * (a @ up^T);
//   grouped_gemm_nn_sm90     out [M, N] = a[rows] @ b[e] with b [E, K, N] (layout "nn", the data gradients): the
//                            same body with B MN-major in shared memory (B_MN), read through the wgmma
//                            descriptor's transpose bit, so no transposed copy of b;
//   grouped_gemm_wgrad_sm90  the K-grouped weight gradient out[e] = a[rows_e]^T @ b[rows_e] ([E, N1, N2], a
//                            [M, N1], b [M, N2]): the contraction runs over the group's rows, A and B both MN-major
//                            (KGROUP); a group with no rows writes zeros;
//   grouped_gemm(_nn)_sm90_f32out  grouped_gemm_sm90 / grouped_gemm_nn_sm90 storing the fp32 accumulators (F32OUT).
//   grouped_gemm_sm90_split_f32out, grouped_gemm_wgrad_sm90_split_a / _ab  the backward's split-precision products
//                            (SPLIT: hi / lo planes of an fp32 operand, two or three wgmma passes into one fp32
//                            accumulator), as moe.cu's grouped_gemm_tc_split_f32out / grouped_gemm_wgrad_tc_split_*.
//   grouped_gemm_fp8_sm90    the FP8 block-scaled grouped GEMM (FP8: e4m3 a and b, fp32 scales per 1 x 128 / 128 x
//                            128 block, bf16 out): QGMMA k-blocks of 128 promoted into fp32 registers (DeepGEMM's
//                            scheme), the ops gemm_fp8 (one group) and grouped_gemm_fp8.
// The mma.sync kernels of moe.cu stay for sm_80 / sm_89 and for what this one does not take (pykern/ops/
// _moe_sm90.py: the TMA's 16-byte row strides and bases).
//
// A CTA is three warpgroups (384 threads):
//   warpgroup 0, the producer (setmaxnreg.dec to 40): one elected thread issues the TMA loads of each k-block
//     (BK = 64 columns: one 128-byte, 128B-swizzled row per tile row) into a ring of GG90_ST stages: the A tile
//     (128 rows, one 2-D box over a [M, K]) and the B tile (BN = 256 rows as two boxes of 128 of a 3-D map over
//     b [E, N, K]). Each stage has a `full` mbarrier (the loads complete their bytes there) and an `empty` one
//     (the 256 consumer threads arrive when their wgmmas have read the stage).
//   warpgroups 1 and 2, the consumers (setmaxnreg.inc to 232): consumer c owns tile rows 64c..64c+63, 128 fp32
//     accumulators a thread (m64n256). Per k-block four wgmma m64n256k16 SS (both operands K-major in shared
//     memory); one k-block's group stays in flight while the next is issued (wait_group 1), and the stage it read
//     is released when it completes.
// Rows of a box past the group's end belong to the next group (or are zeros past M; columns past K and B rows
// past N are zeros: the 3-D map bounds each group's N), so the main loop has no predicates; the epilogue stores
// only the group's rows and columns below N, straight from the accumulators (act: the gate and up columns of a
// (row, column) sit in the same thread, accumulators j and j + 64).
//
// Tile scheduler (persistent, on the device; no host round trip): the grid is at most one CTA per SM. In the
// prologue warp 0 reads `offsets` and writes the prefix over groups of the tile counts ceil(rows_e / 128) *
// n_tiles to shared memory; every CTA then walks linear tile indices blockIdx.x, + gridDim.x, ... below the
// total, the producer and the consumers each decoding the same sequence (a binary search in the prefix). Inside
// a group the tiles go in bands of GG90_RASTER row tiles: a band's row tiles take column tile 0, then 1, ...,
// so CTAs that run together share the weight tile they read (and the band's activation rows) in L2.
// Negative group sizes (offsets that decrease) count as empty; the offsets may live on the device.
//
// B_MN (layout "nn"): b [E, K, N] is N-contiguous, so a B stage is four 3-D boxes of 64 n-columns (one 128-byte
// swizzled row) by 64 k-rows: [4 n-chunks][64 k][128 B], read MN-major (LBO 8 KiB from one 64-column chunk to the
// next, SBO 1 KiB per 8 k-rows, a k-step of 16 is 2 KiB further).
// KGROUP (the weight gradient): the GEMM's M and N are a's and b's columns and its K the group's rows, so both
// tiles are MN-major boxes of 64 columns by 64 rows of 2-D maps over a [M, N1] and b [M, N2] (A: two, B: four),
// starting at the group's first row. Rows of the last k-block past the group's end belong to the next group:
// each consumer zeroes them in its own 64-column A chunk (a generic-proxy write, fenced for the async proxy and
// met by its warpgroup's named barrier before its wgmmas read it), so they add nothing. Every group has the
// same tiles (N1 / 128 x N2 / 256), in a fixed order; one CTA owns an output tile and sums its group's k-blocks in
// order: deterministic, no atomics.
#include "pk_common.cuh"
#include "pk_ptx.cuh"
#include "pk_moe_act.cuh"
#include "pk_grouped.cuh"  // gg_store_f32, the fp32-result epilogue

#define GG90_BM 128
#define GG90_BN 256
#define GG90_BK 64
#define GG90_ST 4
#define GG90_THREADS 384
#define GG90_RASTER 8
#define GG90_A_BYTES (GG90_BM * GG90_BK * 2)
#define GG90_B_BYTES (GG90_BN * GG90_BK * 2)
#define GG90_STAGE_BYTES (GG90_A_BYTES + GG90_B_BYTES)
// Dynamic shared memory: GG90_ST stages, the 2 * GG90_ST mbarriers, then the tile prefix (n_groups + 1 ints).
#define GG90_SMEM_FIXED (GG90_ST * GG90_STAGE_BYTES + 2 * GG90_ST * 8)

template <typename T> struct Gg90Dt;
template <> struct Gg90Dt<__nv_bfloat16> { enum { V = PK_WGMMA_BF16 }; };
template <> struct Gg90Dt<__half> { enum { V = PK_WGMMA_F16 }; };
// FP8 (T = unsigned char, float8_e4m3fn bytes): the result is bf16.
template <typename T, bool FP8> struct Gg90Out { typedef T type; };
template <typename T> struct Gg90Out<T, true> { typedef __nv_bfloat16 type; };

// SPLIT (split precision, moe.cu's gg_tc_body SPLIT on wgmma): an fp32 operand travels as two planes of T, hi =
// round(v) and lo = round((v - hi) * GG90_LO_SCALE) (moe.cu's moe_split16 writes them, the lo plane right after the
// hi one). SPLIT 1: A split, acc = lo·B, then hi·B; SPLIT 2 (KGROUP): both split, acc = lo_a·hi_b + hi_a·lo_b, then
// hi·hi (lo·lo, 2^-16 relative in bf16, is left out). Each product is one pass of wgmmas over the tile's k-blocks
// into the same fp32 accumulators; the lo passes' sum is unscaled (exactly: a power of two) before the hi pass.
// f16 lo parts are scaled by 2^11 (moe.cu's GG_LO_SCALE: as far above f16's subnormal floor as the hi part is);
// bf16 has fp32's exponent range and takes no scale.
template <typename T> constexpr float GG90_LO_SCALE = Pk16<T>::is_f16 ? 2048.0f : 1.0f;
template <int SPLIT> __device__ __forceinline__ bool gg90_a_lo(int pass) {
    return pass < (SPLIT == 1 ? 1 : SPLIT == 2 ? 2 : 0) && (SPLIT == 1 || pass == 0);
}
template <int SPLIT> __device__ __forceinline__ bool gg90_b_lo(int pass) { return SPLIT == 2 && pass == 1; }

// Tile t of the schedule: its group e, first row m0, the group's end row and its column tile nt (KGROUP: m0 is the
// first out row of out[e], k0 / mend the group's first and end rows of a and b).
struct Gg90Tile {
    int e, m0, mend, nt, k0;
};

// KGROUP: every group has m_tiles x n_tiles output tiles; consecutive tiles walk the row tiles of one column tile,
// so the CTAs that run together share b's columns (and the group's rows) in L2.
__device__ __forceinline__ Gg90Tile gg90_decode_kgroup(const int* __restrict__ offsets, int m_tiles, int n_tiles,
                                                      int t) {
    const int per = m_tiles * n_tiles;
    Gg90Tile x;
    x.e = t / per;
    const int local = t - x.e * per;
    x.nt = local / m_tiles;
    x.m0 = (local - x.nt * m_tiles) * GG90_BM;
    x.k0 = offsets[x.e];
    x.mend = max(offsets[x.e + 1], x.k0);  // a decreasing pair: no rows
    return x;
}

__device__ __forceinline__ Gg90Tile gg90_decode(const int* __restrict__ prefix, const int* __restrict__ offsets,
                                               int n_groups, int n_tiles, int t) {
    int lo = 0, hi = n_groups - 1;  // the last group whose prefix is <= t (t < prefix[n_groups]: a non-empty one)
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (prefix[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    const int e = lo, local = t - prefix[e];
    const int mt = (prefix[e + 1] - prefix[e]) / n_tiles;  // row tiles of the group
    const int band = local / (GG90_RASTER * n_tiles);
    const int rows = min(GG90_RASTER, mt - band * GG90_RASTER);  // row tiles in this band
    const int r = local - band * GG90_RASTER * n_tiles;
    Gg90Tile x;
    x.e = e;
    x.nt = r / rows;
    x.m0 = offsets[e] + (band * GG90_RASTER + r % rows) * GG90_BM;
    x.mend = offsets[e + 1];
    x.k0 = 0;
    return x;
}

// KGROUP: zero k-rows valid..63 of one consumer's MN-major A chunk (64 rows of 128 bytes; the 128B swizzle only
// permutes 16-byte pieces inside a row, so a row stays a row) and make the zeros visible to its wgmmas: each of
// the warpgroup's 128 threads writes 16-byte pieces, fences them for the async proxy, and the warpgroup meets at
// named barrier `bar`. valid may be <= 0 (never here: a k-block starts inside its group).
__device__ __forceinline__ void gg90_zero_rows(unsigned char* chunk, int valid, int t, int bar) {
#pragma unroll
    for (int i = 0; i < 64 * 128 / (128 * 16); i++) {
        const int piece = t + 128 * i;  // 16-byte piece: row piece / 8
        if (piece / 8 >= valid) *reinterpret_cast<uint4*>(chunk + piece * 16) = make_uint4(0, 0, 0, 0);
    }
    pk_fence_proxy_async_shared();
    pk_bar_sync(bar, 128);
}

// FP8: where tile row `row` (0..127) keeps its k-block scale in a stage's 128 floats. A consumer thread's two rows
// r and r + 8 (r = 64c + 16w + g) sit side by side, so it reads both with one 8-byte load.
__device__ __forceinline__ int gg90_scale_slot(int row) { return (row >> 4) * 16 + (row & 7) * 2 + ((row >> 3) & 1); }

// FP8 producer (warps 0 and 1 of warpgroup 0; warps 2 and 3 have nothing to do). Every tile starts at stage 0 and
// takes whole rounds of ST k-blocks (DeepGEMM's ring discipline), so the consumers' stage indices are compile-time
// constants and the round's parity is every stage's phase; the k-blocks of the last round past nk are empty
// stages, passed through with a plain arrival. Warp 0's elected lane issues the A and B boxes; warp 1's 32 lanes
// load the k-block's scales, a_scale[row, kb] * b_scale[e, nt, kb] for the tile's 128 rows (rows past M clamped:
// never stored), and store them pre-multiplied into the stage's scale slots; the stage's full barrier waits for
// the TMA's arrival and bytes and the 32 lanes' arrivals (their stores are released by their arrive).
template <int ST, int STAGE_BYTES>
__device__ __forceinline__ void gg90_fp8_producer(unsigned char* as, unsigned char* bs, float* scl,
                                                  unsigned long long* full, unsigned long long* empty,
                                                  const CUtensorMap* ta, const CUtensorMap* tb,
                                                  const float* __restrict__ sa, const float* __restrict__ sb,
                                                  const int* prefix, const int* __restrict__ offsets, int M, int N,
                                                  int K, int n_groups) {
    // (the two roles in two loops, and the sizes from the parameters: the 40 registers hold either loop's state)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp > 1) return;
    const int nk = K / 128, n_tiles = (N + 127) / 128, total = prefix[n_groups];
    unsigned round = 0;
    if (warp == 0) {
        if (!pk_elect_one()) return;
        for (int t = blockIdx.x; t < total; t += gridDim.x) {
            const Gg90Tile x = gg90_decode(prefix, offsets, n_groups, n_tiles, t);
            for (int kb0 = 0; kb0 < nk; kb0 += ST, round++) {
                for (int s = 0; s < ST; s++) {
                    const int kb = kb0 + s;
                    pk_mbarrier_wait_parity(&empty[s], (round & 1) ^ 1);
                    if (kb < nk) {
                        pk_mbarrier_arrive_expect_tx(&full[s], STAGE_BYTES);
                        pk_tma_load_2d(as + s * GG90_A_BYTES, ta, &full[s], kb * 128, x.m0);
                        pk_tma_load_3d(bs + s * (STAGE_BYTES - GG90_A_BYTES), tb, &full[s], kb * 128, x.nt * 128, x.e);
                    } else {
                        pk_mbarrier_arrive(&full[s]);
                    }
                }
            }
        }
        return;
    }
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        const Gg90Tile x = gg90_decode(prefix, offsets, n_groups, n_tiles, t);
        const float* psb = sb + ((long long)x.e * n_tiles + x.nt) * nk;
        for (int kb0 = 0; kb0 < nk; kb0 += ST, round++) {
            for (int s = 0; s < ST; s++) {
                const int kb = kb0 + s;
                pk_mbarrier_wait_parity(&empty[s], (round & 1) ^ 1);
                if (kb < nk) {
                    const float bsc = psb[kb];
#pragma unroll 1
                    for (int i = 0; i < GG90_BM / 32; i++) {
                        const int row = lane + 32 * i;
                        scl[s * GG90_BM + gg90_scale_slot(row)] = sa[(long long)min(x.m0 + row, M - 1) * nk + kb] * bsc;
                    }
                }
                pk_mbarrier_arrive(&full[s]);
            }
        }
    }
}

// ACT: the fused act(gate) * up epilogue (b is gate_up [E, 2I, K], N = 2I; column tile nt covers h columns
// [128 nt, + 128): B rows 128 nt.. (gate) and I + 128 nt.. (up)). Otherwise column tile nt is out columns
// [256 nt, + 256). B_MN: b is [E, K, N] (layout "nn"). KGROUP (implies B_MN): the weight gradient, M = N1 (a's
// columns, out rows), N = N2, K = the rows of a and b (M of the op).
// F32OUT (neither ACT nor KGROUP): out is float [M, N], the fp32 accumulators stored with 16-byte stores
// (gg_store_f32): the backward's products of exact 16-bit operands whose result stays fp32.
// FP8 (docs/gemm_fp8.md; neither ACT, B_MN, KGROUP nor F32OUT): T is the e4m3 byte, a [M, K]
// and b [E, N, K] e4m3 with sa [M, K / 128] and sb [E, N / 128, K / 128] fp32 scales (DeepSeek-V3's), out bf16.
// A k-block is 128 e4m3 columns (the same 128-byte swizzled rows, so the A tile and the TMA boxes keep their
// bytes) and one scale block; the B tile is 128 rows (BN: the wgmma and the promoted accumulators, 64 + 64
// floats a thread, fit where 128 + 128 would not), so a stage is 32 KiB and the ring has 6 stages in the same
// shared memory, plus 128 pre-multiplied scales a stage (gg90_fp8_producer: the ring runs in whole rounds of 6
// from stage 0 each tile). Per k-block four wgmma m64n128k32 e4m3 (QGMMA) restart from zero; once they complete,
// the stage is released and the k-block's partial is promoted: facc += part * (sa[row, kb] * sb[e, nt, kb]) in
// fp32 (DeepGEMM's scheme: the fp8 tensor core's narrower accumulator never sums more than 128 products).
template <typename T, bool ACT, bool B_MN, bool KGROUP, bool F32OUT = false, bool FP8 = false, int SPLIT = 0>
__device__ __forceinline__ void gg90_body(const CUtensorMap* ta, const CUtensorMap* tb, const int* __restrict__ offsets,
                                          void* __restrict__ out_, int M, int N, int K, int n_groups, int act,
                                          const float* __restrict__ sa = nullptr,
                                          const float* __restrict__ sb = nullptr) {
    static_assert(!(ACT && B_MN) && (!KGROUP || B_MN), "gg90_body: ACT is K-major only; KGROUP reads B MN-major");
    static_assert(!F32OUT || (!ACT && !KGROUP), "gg90_body: the fp32 result is the plain product's");
    static_assert(!FP8 || (!ACT && !B_MN && !KGROUP && !F32OUT), "gg90_body: FP8 is the plain K-major product");
    static_assert(SPLIT == 0 || KGROUP || (F32OUT && !B_MN), "gg90_body: a split A is the wgrad's or the f32out nt's");
    static_assert(SPLIT < 2 || KGROUP, "gg90_body: a split B is the weight gradient's");
    // SPLIT: the passes over the k-blocks (the lo plane(s) first, the hi planes last) and the lo planes' rows
    constexpr int NPASS = SPLIT == 0 ? 1 : SPLIT == 1 ? 2 : 3;
    const int lo_rows = KGROUP ? K : M;
    // The tile shape (see FP8 above): elements of a k-block, B rows, ring stages and their bytes.
    constexpr int BK = FP8 ? 128 : GG90_BK, BN = FP8 ? 128 : GG90_BN, ST = FP8 ? 6 : GG90_ST;
    constexpr int B_BYTES = BN * 128, STAGE_BYTES = GG90_A_BYTES + B_BYTES;
    static_assert(ST * STAGE_BYTES == GG90_ST * GG90_STAGE_BYTES, "gg90_body: one shared-memory size for all");
    typedef typename Gg90Out<T, FP8>::type OT;
    OT* __restrict__ out = reinterpret_cast<OT*>(out_);
    extern __shared__ __align__(1024) unsigned char gg90_smem[];
    unsigned char* as = gg90_smem;                                   // [ST][128 rows][128 B]
    unsigned char* bs = gg90_smem + ST * GG90_A_BYTES;               // [ST][BN rows][128 B]
    unsigned long long* full = reinterpret_cast<unsigned long long*>(gg90_smem + ST * STAGE_BYTES);
    unsigned long long* empty = full + ST;
    int* prefix = reinterpret_cast<int*>(empty + ST);  // [n_groups + 1]
    // FP8: the stages' pre-multiplied scales (gg90_fp8_producer), [ST][128] floats between the ring and the mbarriers
    float* scl = reinterpret_cast<float*>(gg90_smem + ST * STAGE_BYTES);
    if constexpr (FP8) {
        full = reinterpret_cast<unsigned long long*>(scl + ST * GG90_BM);
        empty = full + ST;
        prefix = reinterpret_cast<int*>(empty + ST);
    }

    const int tid = threadIdx.x, wg = tid / 128;
    const int cols = ACT ? N / 2 : N;  // out columns
    const int n_tiles = ACT ? (cols + GG90_BN / 2 - 1) / (GG90_BN / 2) : (N + BN - 1) / BN;
    const int nk = (K + BK - 1) / BK;  // (KGROUP: per group, from its rows)
    const int m_tiles = (M + GG90_BM - 1) / GG90_BM;  // KGROUP: out rows

    if (KGROUP) {
        // (no prefix: every group has m_tiles x n_tiles tiles)
    } else if (tid < 32) {  // the tile prefix: a warp scan of the groups' tile counts, 32 groups at a time
        int run = 0;
        if (tid == 0) prefix[0] = 0;
        for (int base = 0; base < n_groups; base += 32) {
            const int e = base + tid;
            int cnt = 0;
            if (e < n_groups) {
                const int rows = offsets[e + 1] - offsets[e];
                cnt = rows > 0 ? (rows + GG90_BM - 1) / GG90_BM * n_tiles : 0;
            }
            int inc = cnt;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int v = __shfl_up_sync(PK_FULL_MASK, inc, d);
                if (tid >= d) inc += v;
            }
            if (e < n_groups) prefix[e + 1] = run + inc;
            run += __shfl_sync(PK_FULL_MASK, inc, 31);
        }
    }
    if (tid == 0) {
        // (FP8: a stage's full barrier also waits for the 32 lanes that store its scales)
        for (int s = 0; s < ST; s++) pk_mbarrier_init(&full[s], FP8 ? 33 : 1), pk_mbarrier_init(&empty[s], 256);
        pk_fence_mbarrier_init();
    }
    __syncthreads();
    const int total = KGROUP ? n_groups * m_tiles * n_tiles : prefix[n_groups];

    if (wg == 0) {  // ---- producer ----
        pk_setmaxnreg_dec<40>();
        if constexpr (FP8) {
            gg90_fp8_producer<ST, STAGE_BYTES>(as, bs, scl, full, empty, ta, tb, sa, sb, prefix, offsets, M, N, K,
                                               n_groups);
            return;
        }
        if (tid < 32 && pk_elect_one()) {
            unsigned it = 0;  // k-blocks issued: stage it % ST, phase (it / ST) & 1
            for (int t = blockIdx.x; t < total; t += gridDim.x) {
                const Gg90Tile x = KGROUP ? gg90_decode_kgroup(offsets, m_tiles, n_tiles, t)
                                          : gg90_decode(prefix, offsets, n_groups, n_tiles, t);
                const int b0 = ACT ? x.nt * (GG90_BN / 2) : x.nt * BN;
                const int b1 = ACT ? cols + b0 : b0 + GG90_BN / 2;
                const int tk = KGROUP ? (x.mend - x.k0 + GG90_BK - 1) / GG90_BK : nk;
                for (int pass = 0; pass < NPASS; pass++) {
                // SPLIT: this pass's planes, as rows of a [2 x rows] map: the lo plane lo_rows rows further
                const int ar = gg90_a_lo<SPLIT>(pass) ? lo_rows : 0, br = gg90_b_lo<SPLIT>(pass) ? lo_rows : 0;
                for (int kb = 0; kb < tk; kb++, it++) {
                    const unsigned s = it % ST;
                    pk_mbarrier_wait_parity(&empty[s], ((it / ST) & 1) ^ 1);
                    pk_mbarrier_arrive_expect_tx(&full[s], STAGE_BYTES);
                    unsigned char* ast = as + s * GG90_A_BYTES;
                    unsigned char* bst = bs + s * B_BYTES;
                    const int kc = x.k0 + kb * BK;
                    if constexpr (KGROUP) {  // A: 2 boxes of 64 a-columns x 64 rows; B: 4 of 64 b-columns
#pragma unroll
                        for (int j = 0; j < GG90_BM / 64; j++)
                            pk_tma_load_2d(ast + j * 64 * 128, ta, &full[s], x.m0 + 64 * j, kc + ar);
#pragma unroll
                        for (int j = 0; j < GG90_BN / 64; j++)
                            pk_tma_load_2d(bst + j * GG90_BK * 128, tb, &full[s], b0 + 64 * j, kc + br);
                    } else if constexpr (B_MN) {  // B: 4 boxes of 64 n-columns x 64 k-rows of b[e]
                        pk_tma_load_2d(ast, ta, &full[s], kc, x.m0);
#pragma unroll
                        for (int j = 0; j < GG90_BN / 64; j++)
                            pk_tma_load_3d(bst + j * GG90_BK * 128, tb, &full[s], b0 + 64 * j, kc, x.e);
                    } else {
                        pk_tma_load_2d(ast, ta, &full[s], kc, x.m0 + ar);
                        pk_tma_load_3d(bst, tb, &full[s], kc, b0, x.e);
                        pk_tma_load_3d(bst + GG90_BN / 2 * 128, tb, &full[s], kc, b1, x.e);
                    }
                }
                }  // pass
            }
        }
        return;
    }

    // ---- consumers ----
    pk_setmaxnreg_inc<232>();
    const int c = wg - 1, lane = tid % 32, w = (tid / 32) % 4, g = lane / 4, tq = lane % 4;
    // K-major 128B-swizzled tiles: SBO 1024 (one 8-row group of 128-byte rows); a k-step is 32 bytes further.
    // MN-major ones ([64-column chunks][64 k-rows][128 B]): LBO 8 KiB (the next 64 columns), SBO 1024 (8 k-rows);
    // a k-step of 16 rows is 2 KiB further. Consumer c's 64 A rows are chunk c (MN-major) or rows 64c.. (K-major).
    constexpr unsigned A_STEP = KGROUP ? 16 * 128 : 32, B_STEP = B_MN ? 16 * 128 : 32;
    const unsigned long long da0 = KGROUP ? pk_wgmma_desc(as + c * 64 * 128, GG90_BK * 128, 1024, PK_SWIZZLE_128B)
                                          : pk_wgmma_desc(as + c * 64 * 128, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long db0 = B_MN ? pk_wgmma_desc(bs, GG90_BK * 128, 1024, PK_SWIZZLE_128B)
                                        : pk_wgmma_desc(bs, 16, 1024, PK_SWIZZLE_128B);
    unsigned it = 0;
    unsigned round = 0;  // FP8: the ring's rounds (gg90_fp8_producer): a round's parity is its stages' phase
    // FP8: the A descriptor differs per consumer warpgroup; its low word passed through a lane-0 shuffle is
    // warp-uniform to ptxas, which then keeps both descriptors (and their constant offsets) in uniform registers.
    const unsigned long long da8 = FP8 ? (da0 & ~0xffffffffull) | __shfl_sync(PK_FULL_MASK, (unsigned)da0, 0) : da0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        const Gg90Tile x = KGROUP ? gg90_decode_kgroup(offsets, m_tiles, n_tiles, t)
                                  : gg90_decode(prefix, offsets, n_groups, n_tiles, t);
        float acc[BN / 2];
        float facc[FP8 ? BN / 2 : 1];  // FP8: the promoted fp32 accumulators
        if constexpr (FP8) {
#pragma unroll
            for (int i = 0; i < BN / 2; i++) facc[i] = 0.f;
        }
        unsigned prev = 0;
        const int tk = KGROUP ? (x.mend - x.k0 + GG90_BK - 1) / GG90_BK : nk;
        if (KGROUP && tk == 0) {  // a group with no rows: a zero gradient (no wgmma sets the accumulators)
#pragma unroll
            for (int i = 0; i < GG90_BN / 2; i++) acc[i] = 0.f;
        }
        // One k-block: wait for its stage, (ZERO: clear this consumer's A rows past the group's end), 4 wgmmas.
        // first: the tile's first k-block (SPLIT: of its first pass), which starts the accumulators and has no
        // earlier stage to release.
        auto kblock = [&](int kb, bool zero, bool first) {
          if constexpr (!FP8) {
            const unsigned s = it % ST;
            // One try first, the retry loop apart: ptxas lays it out of the k-loop, which stays flat.
            const unsigned ph = (it / ST) & 1;
            if (!pk_mbarrier_try_wait_parity(&full[s], ph)) pk_mbarrier_wait_parity(&full[s], ph);
            if (KGROUP && zero)  // rows x.mend - (x.k0 + 64 kb) .. 63 of this k-block lie past the group
                gg90_zero_rows(as + s * GG90_A_BYTES + c * 64 * 128, x.mend - x.k0 - kb * GG90_BK, tid % 128, 1 + c);
            pk_wgmma_fence();
            const unsigned long long da = pk_wgmma_desc_advance(da0, s * GG90_A_BYTES);
            const unsigned long long db = pk_wgmma_desc_advance(db0, s * B_BYTES);
#pragma unroll
            for (int ks = 0; ks < GG90_BK / 16; ks++)
                pk_wgmma_m64nNk16_ss<GG90_BN, Gg90Dt<T>::V, KGROUP ? 1 : 0, B_MN ? 1 : 0>(
                    acc, pk_wgmma_desc_advance(da, ks * A_STEP), pk_wgmma_desc_advance(db, ks * B_STEP),
                    !first || ks > 0);
            pk_wgmma_commit();
            // The previous k-block's group has completed: release its stage (this one's stays in flight).
            pk_wgmma_wait<1>();
            if (!first) pk_mbarrier_arrive(&empty[prev]);
            prev = s;
            it++;
          }
        };
        // FP8, one k-block in stage s (a constant in the steady-state loop) of a round with phase ph: its two
        // pre-multiplied scales (one 8-byte load), four k32 QGMMAs of 32 bytes each (the first restarts the partial
        // from zero); once they complete the stage is released and the partial promoted: accumulator 4j + v is row
        // 16w + g + 8 (v >> 1) of this consumer's 64.
        auto kblock8 = [&](int s, unsigned ph) {
            if (!pk_mbarrier_try_wait_parity(&full[s], ph)) pk_mbarrier_wait_parity(&full[s], ph);  // (as kblock's)
            const float2 sc = *reinterpret_cast<const float2*>(scl + s * GG90_BM + (4 * c + w) * 16 + 2 * g);
            pk_wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < BK / 32; ks++)
                pk_wgmma_m64nNk32_e4m3_ss<BN>(acc, pk_wgmma_desc_advance(da8, s * GG90_A_BYTES + ks * 32),
                                              pk_wgmma_desc_advance(db0, s * B_BYTES + ks * 32), ks > 0);
            pk_wgmma_commit();
            pk_wgmma_wait<0>();  // the partial is read now (and the scales, loaded before): the stage is free
            pk_mbarrier_arrive(&empty[s]);
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                facc[4 * j] = fmaf(acc[4 * j], sc.x, facc[4 * j]);
                facc[4 * j + 1] = fmaf(acc[4 * j + 1], sc.x, facc[4 * j + 1]);
                facc[4 * j + 2] = fmaf(acc[4 * j + 2], sc.y, facc[4 * j + 2]);
                facc[4 * j + 3] = fmaf(acc[4 * j + 3], sc.y, facc[4 * j + 3]);
            }
        };
        if constexpr (FP8) {
            // Whole rounds of ST k-blocks, stages 0..ST-1 unrolled; then the last, partial round (its stages past
            // nk are the producer's empty ones: waited for and released).
            const int rounds = nk / ST, rem = nk - rounds * ST;
            for (int r = 0; r < rounds; r++, round++) {
#pragma unroll
                for (int s = 0; s < ST; s++) kblock8(s, round & 1);
            }
            if (rem) {
                for (int s = 0; s < ST; s++) {
                    if (s < rem) {
                        kblock8(s, round & 1);
                    } else {
                        pk_mbarrier_wait_parity(&full[s], round & 1);
                        pk_mbarrier_arrive(&empty[s]);
                    }
                }
                round++;
            }
        } else {
            // KGROUP: the whole k-blocks in the loop, a partial last one after it (the zeroing and its barrier stay
            // out of the steady-state loop).
            const int full_k = KGROUP ? (x.mend - x.k0) / GG90_BK : nk;
#pragma unroll 1
            for (int pass = 0; pass < NPASS; pass++) {
                const int kfirst = pass == 0 ? 0 : -1;  // (one compare in the loop, as without passes)
                for (int kb = 0; kb < full_k; kb++) kblock(kb, false, kb == kfirst);
                if (KGROUP && full_k < tk) kblock(full_k, true, full_k == kfirst);
                if (SPLIT != 0 && pass == NPASS - 2 && GG90_LO_SCALE<T> != 1.0f) {
                    pk_wgmma_wait<0>();  // the lo products' sum, unscaled before the hi pass adds to it
#pragma unroll
                    for (int i = 0; i < GG90_BN / 2; i++)
                        pk_wgmma_fence_operand(acc[i]), acc[i] *= 1.0f / GG90_LO_SCALE<T>;
                }
            }
            pk_wgmma_wait<0>();
            if (tk > 0) pk_mbarrier_arrive(&empty[prev]);
        }

        // Epilogue: accumulator 4j + 2r + v is tile row 64c + 16w + g + 8r, column 8j + 2tq + v. KGROUP: out[e]
        // [M, N] (rows below M), else out [M, cols] (the group's rows).
        const int mend = KGROUP ? M : min(x.mend, M);
        if constexpr (F32OUT) {
            float* __restrict__ outf = reinterpret_cast<float*>(out_);
            const bool quad = (cols & 3) == 0 && (reinterpret_cast<unsigned long long>(outf) & 15) == 0;
#pragma unroll
            for (int j = 0; j < GG90_BN / 8; j++)
                gg_store_f32(outf, *reinterpret_cast<const float(*)[4]>(acc + 4 * j), x.m0 + 64 * c + 16 * w + g,
                             x.nt * GG90_BN + 8 * j, mend, cols, tq, quad);
            continue;
        }
        OT* const obase = KGROUP ? out + (long long)x.e * M * cols : out;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = x.m0 + 64 * c + 16 * w + g + 8 * r;
            if (row >= mend) continue;
            OT* orow = obase + (long long)row * cols;
            if constexpr (ACT) {
                const int h0 = x.nt * (GG90_BN / 2) + 2 * tq;
                const bool pair = (cols & 1) == 0;
#pragma unroll
                for (int j = 0; j < GG90_BN / 16; j++) {
                    const int n = h0 + 8 * j;
                    const int gi = 4 * j + 2 * r, ui = 4 * (j + GG90_BN / 16) + 2 * r;
                    const float y0 = moe_act_f(acc[gi], act) * acc[ui];
                    const float y1 = moe_act_f(acc[gi + 1], act) * acc[ui + 1];
                    if (pair && n + 1 < cols) {
                        *reinterpret_cast<unsigned int*>(orow + n) = Pk16<OT>::narrow2(y0, y1);
                    } else {
                        if (n < cols) reinterpret_cast<unsigned short*>(orow)[n] = Pk16<OT>::narrow(y0);
                        if (n + 1 < cols) reinterpret_cast<unsigned short*>(orow)[n + 1] = Pk16<OT>::narrow(y1);
                    }
                }
            } else {
                const int n0 = x.nt * BN + 2 * tq;
                const bool pair = (cols & 1) == 0;
                const float* res = FP8 ? facc : acc;
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {
                    const int n = n0 + 8 * j;
                    const float y0 = res[4 * j + 2 * r], y1 = res[4 * j + 2 * r + 1];
                    if (pair && n + 1 < cols) {
                        *reinterpret_cast<unsigned int*>(orow + n) = Pk16<OT>::narrow2(y0, y1);
                    } else {
                        if (n < cols) reinterpret_cast<unsigned short*>(orow)[n] = Pk16<OT>::narrow(y0);
                        if (n + 1 < cols) reinterpret_cast<unsigned short*>(orow)[n + 1] = Pk16<OT>::narrow(y1);
                    }
                }
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void grouped_gemm_sm90_impl(const CUtensorMap& ta, const CUtensorMap& tb,
                                                       const int* offsets, T* out, int M, int N, int K,
                                                       int n_groups) {
    gg90_body<T, false, false, false>(&ta, &tb, offsets, out, M, N, K, n_groups, 0);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_nn_sm90_impl(const CUtensorMap& ta, const CUtensorMap& tb,
                                                          const int* offsets, T* out, int M, int N, int K,
                                                          int n_groups) {
    gg90_body<T, false, true, false>(&ta, &tb, offsets, out, M, N, K, n_groups, 0);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_wgrad_sm90_impl(const CUtensorMap& ta, const CUtensorMap& tb,
                                                             const int* offsets, T* out, int N1, int N2, int M,
                                                             int n_groups) {
    gg90_body<T, false, true, true>(&ta, &tb, offsets, out, N1, N2, M, n_groups, 0);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_sm90_f32out_impl(const CUtensorMap& ta, const CUtensorMap& tb,
                                                              const int* offsets, float* out, int M, int N, int K,
                                                              int n_groups) {
    gg90_body<T, false, false, false, true>(&ta, &tb, offsets, out, M, N, K, n_groups, 0);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_nn_sm90_f32out_impl(const CUtensorMap& ta, const CUtensorMap& tb,
                                                                 const int* offsets, float* out, int M, int N, int K,
                                                                 int n_groups) {
    gg90_body<T, false, true, false, true>(&ta, &tb, offsets, out, M, N, K, n_groups, 0);
}
// The split-precision forms (SPLIT; a and, for _ab, b hold [2, rows, columns]: the hi plane, then the lo one).
template <typename T>
__device__ __forceinline__ void grouped_gemm_sm90_split_f32out_impl(const CUtensorMap& ta, const CUtensorMap& tb,
                                                                    const int* offsets, float* out, int M, int N,
                                                                    int K, int n_groups) {
    gg90_body<T, false, false, false, true, false, 1>(&ta, &tb, offsets, out, M, N, K, n_groups, 0);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_wgrad_sm90_split_a_impl(const CUtensorMap& ta, const CUtensorMap& tb,
                                                                     const int* offsets, T* out, int N1, int N2,
                                                                     int M, int n_groups) {
    gg90_body<T, false, true, true, false, false, 1>(&ta, &tb, offsets, out, N1, N2, M, n_groups, 0);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_wgrad_sm90_split_ab_impl(const CUtensorMap& ta, const CUtensorMap& tb,
                                                                      const int* offsets, T* out, int N1, int N2,
                                                                      int M, int n_groups) {
    gg90_body<T, false, true, true, false, false, 2>(&ta, &tb, offsets, out, N1, N2, M, n_groups, 0);
}
template <typename T>
__device__ __forceinline__ void moe_gemm_act_sm90_impl(const CUtensorMap& ta, const CUtensorMap& tb,
                                                       const int* offsets, T* out, int M, int N, int K,
                                                       int n_groups, int act) {
    gg90_body<T, true, false, false>(&ta, &tb, offsets, out, M, N, K, n_groups, act);
}

// ta: a [M, K] with box (128, 64); tb: b [E, N, K] with box (1, 128, 64); both 128B swizzle. Grid: at most one
// CTA per SM (persistent), 384 threads, GG90_SMEM_FIXED + 4 * (n_groups + 1) bytes of dynamic shared memory.
PK_IO16_KERNELS(grouped_gemm_sm90, (GG90_THREADS, 1),
                (const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                 const int* __restrict__ offsets, T* __restrict__ out, int M, int N, int K, int n_groups),
                (ta, tb, offsets, out, M, N, K, n_groups))
// N = 2I (the rows of gate_up), out [M, I]; act: MOE_ACT_SILU or MOE_ACT_GELU_TANH.
PK_IO16_KERNELS(moe_gemm_act_sm90, (GG90_THREADS, 1),
                (const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                 const int* __restrict__ offsets, T* __restrict__ out, int M, int N, int K, int n_groups, int act),
                (ta, tb, offsets, out, M, N, K, n_groups, act))
// layout "nn": ta as above; tb: b [E, K, N] with box (1, 64, 64), 128B swizzle; out [M, N].
PK_IO16_KERNELS(grouped_gemm_nn_sm90, (GG90_THREADS, 1),
                (const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                 const int* __restrict__ offsets, T* __restrict__ out, int M, int N, int K, int n_groups),
                (ta, tb, offsets, out, M, N, K, n_groups))
// The weight gradient: ta: a [M, N1], tb: b [M, N2], both with box (64, 64) and 128B swizzle; out [E, N1, N2].
// Grid: at most one CTA per SM, GG90_SMEM_FIXED + 4 bytes (no tile prefix).
PK_IO16_KERNELS(grouped_gemm_wgrad_sm90, (GG90_THREADS, 1),
                (const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                 const int* __restrict__ offsets, T* __restrict__ out, int N1, int N2, int M, int n_groups),
                (ta, tb, offsets, out, N1, N2, M, n_groups))
// The fp32-result variants (grouped_gemm_sm90 and grouped_gemm_nn_sm90 with out float [M, N], 16-byte stores): the
// backward's recomputed gate / up (x_perm @ gate_up_proj[e]^T) and dy_perm @ down_proj[e]. Tensor maps as above.
PK_IO16_KERNELS(grouped_gemm_sm90_f32out, (GG90_THREADS, 1),
                (const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                 const int* __restrict__ offsets, float* __restrict__ out, int M, int N, int K, int n_groups),
                (ta, tb, offsets, out, M, N, K, n_groups))
PK_IO16_KERNELS(grouped_gemm_nn_sm90_f32out, (GG90_THREADS, 1),
                (const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                 const int* __restrict__ offsets, float* __restrict__ out, int M, int N, int K, int n_groups),
                (ta, tb, offsets, out, M, N, K, n_groups))
// The split-precision backward products (SPLIT): y = h @ down_proj[e]^T with h split (ta: a [2M, K], the planes
// stacked, box (128, 64); tb as grouped_gemm_sm90's; out float [M, N]); the weight gradients d(gate_up)^T x_perm
// (split_a: ta over a [2M, N1]) and (w * dy)^T h (split_ab: tb over b [2M, N2] too), boxes as
// grouped_gemm_wgrad_sm90's.
PK_IO16_KERNELS(grouped_gemm_sm90_split_f32out, (GG90_THREADS, 1),
                (const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                 const int* __restrict__ offsets, float* __restrict__ out, int M, int N, int K, int n_groups),
                (ta, tb, offsets, out, M, N, K, n_groups))
PK_IO16_KERNELS(grouped_gemm_wgrad_sm90_split_a, (GG90_THREADS, 1),
                (const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                 const int* __restrict__ offsets, T* __restrict__ out, int N1, int N2, int M, int n_groups),
                (ta, tb, offsets, out, N1, N2, M, n_groups))
PK_IO16_KERNELS(grouped_gemm_wgrad_sm90_split_ab, (GG90_THREADS, 1),
                (const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                 const int* __restrict__ offsets, T* __restrict__ out, int N1, int N2, int M, int n_groups),
                (ta, tb, offsets, out, N1, N2, M, n_groups))
// FP8 block-scaled (DeepSeek-V3's scaling; pykern/ops/gemm_fp8.py): ta: a [M, K] e4m3 bytes with box (128, 128);
// tb: b [E, N, K] with box (1, 128, 128); both 128B swizzle. a_scale [M, K / 128], b_scale [E, ceil(N / 128),
// K / 128] fp32; K a multiple of 128; out [M, N] bf16. gemm_fp8 is this with one group (offsets [0, M]). Grid as
// grouped_gemm_sm90's; dynamic shared memory 6 stages of 32 KiB, their 6 x 128 fp32 scales, 12 mbarriers, then the
// tile prefix.
extern "C" __global__ void __launch_bounds__(GG90_THREADS, 1)
    grouped_gemm_fp8_sm90(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
                          const float* __restrict__ a_scale, const float* __restrict__ b_scale,
                          const int* __restrict__ offsets, __nv_bfloat16* __restrict__ out, int M, int N, int K,
                          int n_groups) {
    gg90_body<unsigned char, false, false, false, false, true>(&ta, &tb, offsets, out, M, N, K, n_groups, 0, a_scale,
                                                               b_scale);
}
