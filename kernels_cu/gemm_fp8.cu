// FP8 block-scaled GEMMs in DeepSeek-V3's scaling convention (DeepGEMM's operands and scheme).
//
//   gemm_fp8_quantize(_bf16, _f16)  x [M, K] -> e4m3 [M, K] and fp32 scales [M, K / 128]: per 1 x 128 tile,
//                        scale = max(amax, 1e-10) / 448, q = e4m3(x / scale) (round to nearest even,
//                        saturated); vLLM's per_token_group_quant_fp8 (its eps keeps an all-zero tile finite).
//                        One warp per tile, four elements a lane.
//   gemm_fp8             out [M, N] (bf16) = sum over k-blocks kb of (a[:, kb] @ b[:, kb]^T) * a_scale[:, kb]
//                        * b_scale[n / 128, kb]: a [M, K] e4m3, a_scale [M, K / 128], b [N, K] e4m3, b_scale
//                        [ceil(N / 128), K / 128]; K a multiple of 128 (the op checks).
//   gemm_fp8_grouped     the same per group: rows offsets[e]..offsets[e+1] of a against b [E, N, K],
//                        b_scale [E, ceil(N / 128), K / 128]; tiles found on the device (pk_grouped.cuh).
//
// Promotion (DeepGEMM): the tensor cores' partial sum of one 128-wide k-block starts from zero and is
// multiplied by its two scales into an fp32 accumulator held in registers, so the fp8 tensor core's
// limited accumulation precision never spans more than 128 products. The k-tile is exactly that block.
//
// Tiling: CTA 64 x 128 x 128 (one b_scale block of N per CTA), 8 warps of 32 x 32 (2 x 4 mma.m16n8k32 per
// 32-wide k-step, 4 k-steps a tile; warp tiles of 32 x 64 need two 64-float accumulators, which spill on
// sm_90, where ptxas runs each mma .e4m3 as fp8 -> f16 conversions and two f16 HMMAs), 3 cp.async stages of 64 + 128 rows of 128 bytes, padded to 144 so the
// 8 row addresses of an ldmatrix phase fall in distinct banks. The fp8 fragments are byte-for-byte the
// bf16 ones (pk_ptx.cuh), so the ldmatrix addressing is moe.cu's grouped_gemm_tc's in bytes. Rows past M
// (or past a group's end) and B rows past N are clamped for reading and never stored: the main loop has
// no predicates. mma .e4m3 needs sm_89: below it the GEMM kernels trap (the op refuses those GPUs first).
#include "pk_common.cuh"
#include "pk_grouped.cuh"

// ------------------------------------------------------------------------------------------ quantize
#define GF_QBLOCK 128
#define GF_E4M3_MAX 448.0f
#define GF_QEPS 1e-10f

template <typename T>
__device__ __forceinline__ void gemm_fp8_quantize_impl(const T* __restrict__ x, unsigned char* __restrict__ q,
                                                       float* __restrict__ scales, int M, int K) {
    const int lane = threadIdx.x & 31;
    const long long n_tiles = (long long)M * (K / GF_QBLOCK);
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long tile = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); tile < n_tiles;
         tile += warps) {
        const long long base = tile * GF_QBLOCK + 4 * lane;  // tiles are contiguous: row-major, K % 128 == 0
        float v[4];
        float amax = 0.0f;
        bool nan = false;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = PkIO<T>::load(x, base + i);
            amax = fmaxf(amax, fabsf(v[i]));
            nan |= v[i] != v[i];
        }
        // fmaxf drops NaN: a tile holding one has amax NaN by the definition, so its scale and codes are NaN.
        amax = __any_sync(PK_FULL_MASK, nan) ? __int_as_float(0x7fc00000) : fmaxf(pk_warp_max(amax), GF_QEPS);
        const float s = amax / GF_E4M3_MAX;
        const unsigned int lo = pk_cvt_e4m3x2(v[0] / s, v[1] / s), hi = pk_cvt_e4m3x2(v[2] / s, v[3] / s);
        *reinterpret_cast<unsigned int*>(q + base) = lo | (hi << 16);  // the op allocates q (4-byte aligned)
        if (lane == 0) scales[tile] = s;
    }
}
#define GF_Q_PARAMS \
    (const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scales, int M, int K)
PK_IO_KERNELS(gemm_fp8_quantize, (256), GF_Q_PARAMS, (x, q, scales, M, K))

// ------------------------------------------------------------------------------------------ GEMM
#define GF_BM 64
#define GF_BN 128
#define GF_BK 128
#define GF_ST 3
#define GF_THREADS 256
#define GF_SR 144                                   // bytes a shared row: 128 + 16 of padding
#define GF_A_B (GF_BM * GF_SR)                      // A tile bytes in a stage
#define GF_STAGE_B ((GF_BM + GF_BN) * GF_SR)        // 27648
#define GF_SMEM_BYTES (GF_ST * GF_STAGE_B)          // 82944 (pykern/ops/gemm_fp8.py: SMEM)

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
// This thread's cp.async of one k-tile into the stage at byte `st`: A rows r + 32 i (i < 2) and B rows
// r + 32 i (i < 4), 16-byte chunk c of each; kk: the tile's first k.
__device__ __forceinline__ void gf_copy(unsigned char* smem, unsigned int st, const unsigned char* const (&pa)[2],
                                        const unsigned char* const (&pb)[4], long long kk) {
#pragma unroll
    for (int i = 0; i < 2; i++) pk_cp_async_16_at(smem, st + i * 32 * GF_SR, pa[i] + kk);
#pragma unroll
    for (int i = 0; i < 4; i++) pk_cp_async_16_at(smem, st + GF_A_B + i * 32 * GF_SR, pb[i] + kk);
}

template <bool GROUPED>
__device__ __forceinline__ void gemm_fp8_body(const unsigned char* __restrict__ a, const float* __restrict__ a_scale,
                                              const unsigned char* __restrict__ b, const float* __restrict__ b_scale,
                                              const int* __restrict__ offsets, unsigned short* __restrict__ out,
                                              int M, int N, int K, int n_groups) {
    extern __shared__ __align__(16) unsigned char gf_smem[];
    int e = 0, m0 = blockIdx.x * GF_BM, mend = M;
    if (GROUPED) {
        __shared__ int info[3];
        pk_grouped_cta_tile(offsets, n_groups, GF_BM, blockIdx.x, info);
        e = info[0], m0 = info[1], mend = min(info[2], M);
        if (e < 0) return;
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.y * GF_BN;
    const int nkb = K / GF_BK, nbn = (N + GF_BN - 1) / GF_BN;
    const unsigned char* be = b + (long long)e * N * K;

    const int r = tid >> 3, c = (tid & 7) * 16;  // copy row r + 32 i, byte chunk c
    const unsigned char* pa[2];
    const unsigned char* pb[4];
#pragma unroll
    for (int i = 0; i < 2; i++) pa[i] = a + (long long)min(m0 + r + 32 * i, M - 1) * K + c;
#pragma unroll
    for (int i = 0; i < 4; i++) pb[i] = be + (long long)min(n0 + r + 32 * i, N - 1) * K + c;
    const unsigned int st_off = r * GF_SR + c;
    // ldmatrix row addresses (bytes within a stage): matrices 0..3 of A = rows 0-7 / 8-15 x bytes 0-15 / 16-31;
    // of B = n 0-7 x bytes 0-15 / 16-31, then n 8-15 (two n8 tiles an x4).
    const unsigned int a_ld = (wm * 32 + (lane & 7) + 8 * ((lane >> 3) & 1)) * GF_SR + 16 * (lane >> 4);
    const unsigned int b_ld = GF_A_B + (wn * 32 + (lane & 7) + ((lane >> 4) << 3)) * GF_SR + 16 * ((lane >> 3) & 1);
    // This thread's accumulator rows (clamped like the copies) and the CTA's b_scale row.
    const float* psa[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) psa[mt][h] = a_scale + (long long)min(m0 + wm * 32 + mt * 16 + g + 8 * h, M - 1) * nkb;
    const float* psb = b_scale + ((long long)e * nbn + blockIdx.y) * nkb;

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

#pragma unroll
    for (int s = 0; s < GF_ST - 1; s++) {
        if (s < nkb) gf_copy(gf_smem, st_off + s * GF_STAGE_B, pa, pb, (long long)s * GF_BK);
        pk_cp_async_commit();
    }
    unsigned int rd = 0, wr = (GF_ST - 1) * GF_STAGE_B;  // the stages read and refilled this trip
    for (int kt = 0; kt < nkb; kt++) {
        // The k-block's scales, loaded before the MMAs so their latency hides behind them.
        const float sb = psb[kt];
        float sc[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) sc[mt][h] = psa[mt][h][kt];
        pk_cp_async_wait<GF_ST - 2>();
        __syncthreads();  // tile kt visible to all; every warp is done with the stage refilled next (tile kt-1)
        if (kt + GF_ST - 1 < nkb) gf_copy(gf_smem, st_off + wr, pa, pb, (long long)(kt + GF_ST - 1) * GF_BK);
        pk_cp_async_commit();
        float part[2][4][4];
#pragma unroll
        for (int ks = 0; ks < GF_BK / 32; ks++) {
            unsigned int af[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) pk_ldmatrix_x4_at(af[mt], gf_smem, rd + a_ld + mt * 16 * GF_SR + ks * 32);
#pragma unroll
            for (int np = 0; np < 2; np++) {
                unsigned int bfr[4];
                pk_ldmatrix_x4_at(bfr, gf_smem, rd + b_ld + np * 16 * GF_SR + ks * 32);
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        float* p = part[mt][2 * np + j];
                        if (ks == 0) p[0] = p[1] = p[2] = p[3] = 0.0f;
                        pk_mma_m16n8k32_e4m3(p, af[mt], &bfr[2 * j], p);
                    }
            }
        }
        // Promotion: the block's partial times its two scales into the fp32 accumulator.
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float s = sc[mt][h] * sb;
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    acc[mt][nt][2 * h] = fmaf(part[mt][nt][2 * h], s, acc[mt][nt][2 * h]);
                    acc[mt][nt][2 * h + 1] = fmaf(part[mt][nt][2 * h + 1], s, acc[mt][nt][2 * h + 1]);
                }
            }
        rd = rd == (GF_ST - 1) * GF_STAGE_B ? 0u : rd + GF_STAGE_B;
        wr = wr == (GF_ST - 1) * GF_STAGE_B ? 0u : wr + GF_STAGE_B;
    }
    pk_cp_async_wait_all();

    // Epilogue: accumulator (mt, nt, v) is row wm*32 + mt*16 + g + 8*(v>>1), column wn*32 + nt*8 + 2t + (v&1).
    gg_store16<unsigned short>(out, acc, m0 + wm * 32 + g, n0 + wn * 32 + 2 * t, mend, N);
}
#endif  // sm_89+

extern "C" __global__ void __launch_bounds__(GF_THREADS) gemm_fp8(
    const unsigned char* __restrict__ a, const float* __restrict__ a_scale, const unsigned char* __restrict__ b,
    const float* __restrict__ b_scale, unsigned short* __restrict__ out, int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
    __trap();
#else
    gemm_fp8_body<false>(a, a_scale, b, b_scale, nullptr, out, M, N, K, 1);
#endif
}

extern "C" __global__ void __launch_bounds__(GF_THREADS) gemm_fp8_grouped(
    const unsigned char* __restrict__ a, const float* __restrict__ a_scale, const unsigned char* __restrict__ b,
    const float* __restrict__ b_scale, const int* __restrict__ offsets, unsigned short* __restrict__ out, int M,
    int N, int K, int n_groups) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
    __trap();
#else
    gemm_fp8_body<true>(a, a_scale, b, b_scale, offsets, out, M, N, K, n_groups);
#endif
}
