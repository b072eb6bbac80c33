// pykern: arch sm_90a
// Hopper (sm_90a) grouped GEMM, bf16 and f16 with fp32 accumulation: TMA loads, wgmma, a warp-specialised
// persistent CTA. Rows offsets[e]..offsets[e+1] of a [M, K] (sorted by group) times b[e]^T (b [E, N, K]):
//   grouped_gemm_sm90      out [M, N] = a[rows] @ b[e]^T;
//   moe_gemm_act_sm90      the experts' first GEMM with the activation fused (as moe.cu's moe_gemm_act_tc): b is
//                          gate_up [E, 2I, H] (gate rows first), out [M, I] = act(a @ gate^T) * (a @ up^T).
// The mma.sync kernels of moe.cu stay for sm_80 / sm_89 and for what this one does not take (pykern/ops/
// _moe_sm90.py: K a multiple of 8 and 16-byte aligned bases, the TMA's row-stride rule; layout "nt").
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
#include "pk_common.cuh"
#include "pk_ptx.cuh"
#include "pk_moe_act.cuh"

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

// Tile t of the schedule: its group e, first row m0, the group's end row and its column tile nt.
struct Gg90Tile {
    int e, m0, mend, nt;
};

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
    return x;
}

// ACT: the fused act(gate) * up epilogue (b is gate_up [E, 2I, K], N = 2I; column tile nt covers h columns
// [128 nt, + 128): B rows 128 nt.. (gate) and I + 128 nt.. (up)). Otherwise column tile nt is out columns
// [256 nt, + 256).
template <typename T, bool ACT>
__device__ __forceinline__ void gg90_body(const CUtensorMap* ta, const CUtensorMap* tb, const int* __restrict__ offsets,
                                          T* __restrict__ out, int M, int N, int K, int n_groups, int act) {
    extern __shared__ __align__(1024) unsigned char gg90_smem[];
    unsigned char* as = gg90_smem;                                   // [ST][128 rows][128 B]
    unsigned char* bs = gg90_smem + GG90_ST * GG90_A_BYTES;          // [ST][256 rows][128 B]
    unsigned long long* full = reinterpret_cast<unsigned long long*>(gg90_smem + GG90_ST * GG90_STAGE_BYTES);
    unsigned long long* empty = full + GG90_ST;
    int* prefix = reinterpret_cast<int*>(empty + GG90_ST);  // [n_groups + 1]

    const int tid = threadIdx.x, wg = tid / 128;
    const int cols = ACT ? N / 2 : N;  // out columns
    const int n_tiles = ACT ? (cols + GG90_BN / 2 - 1) / (GG90_BN / 2) : (N + GG90_BN - 1) / GG90_BN;
    const int nk = (K + GG90_BK - 1) / GG90_BK;

    if (tid < 32) {  // the tile prefix: a warp scan of the groups' tile counts, 32 groups at a time
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
        for (int s = 0; s < GG90_ST; s++) pk_mbarrier_init(&full[s], 1), pk_mbarrier_init(&empty[s], 256);
        pk_fence_mbarrier_init();
    }
    __syncthreads();
    const int total = prefix[n_groups];

    if (wg == 0) {  // ---- producer ----
        pk_setmaxnreg_dec<40>();
        if (tid < 32 && pk_elect_one()) {
            unsigned it = 0;  // k-blocks issued: stage it % ST, phase (it / ST) & 1
            for (int t = blockIdx.x; t < total; t += gridDim.x) {
                const Gg90Tile x = gg90_decode(prefix, offsets, n_groups, n_tiles, t);
                const int b0 = ACT ? x.nt * (GG90_BN / 2) : x.nt * GG90_BN;
                const int b1 = ACT ? cols + b0 : b0 + GG90_BN / 2;
                for (int kb = 0; kb < nk; kb++, it++) {
                    const unsigned s = it % GG90_ST;
                    pk_mbarrier_wait_parity(&empty[s], ((it / GG90_ST) & 1) ^ 1);
                    pk_mbarrier_arrive_expect_tx(&full[s], GG90_STAGE_BYTES);
                    unsigned char* bst = bs + s * GG90_B_BYTES;
                    pk_tma_load_2d(as + s * GG90_A_BYTES, ta, &full[s], kb * GG90_BK, x.m0);
                    pk_tma_load_3d(bst, tb, &full[s], kb * GG90_BK, b0, x.e);
                    pk_tma_load_3d(bst + GG90_BN / 2 * 128, tb, &full[s], kb * GG90_BK, b1, x.e);
                }
            }
        }
        return;
    }

    // ---- consumers ----
    pk_setmaxnreg_inc<232>();
    const int c = wg - 1, lane = tid % 32, w = (tid / 32) % 4, g = lane / 4, tq = lane % 4;
    // K-major 128B-swizzled tiles: SBO 1024 (one 8-row group of 128-byte rows); a k-step is 32 bytes further.
    const unsigned long long da0 = pk_wgmma_desc(as + c * 64 * 128, 16, 1024, PK_SWIZZLE_128B);
    const unsigned long long db0 = pk_wgmma_desc(bs, 16, 1024, PK_SWIZZLE_128B);
    unsigned it = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        const Gg90Tile x = gg90_decode(prefix, offsets, n_groups, n_tiles, t);
        float acc[GG90_BN / 2];
        unsigned prev = 0;
        for (int kb = 0; kb < nk; kb++, it++) {
            const unsigned s = it % GG90_ST;
            // One try first, the retry loop apart: ptxas lays it out of the k-loop, which stays flat.
            const unsigned ph = (it / GG90_ST) & 1;
            if (!pk_mbarrier_try_wait_parity(&full[s], ph)) pk_mbarrier_wait_parity(&full[s], ph);
            pk_wgmma_fence();
            const unsigned long long da = pk_wgmma_desc_advance(da0, s * GG90_A_BYTES);
            const unsigned long long db = pk_wgmma_desc_advance(db0, s * GG90_B_BYTES);
#pragma unroll
            for (int ks = 0; ks < GG90_BK / 16; ks++)
                pk_wgmma_m64nNk16_ss<GG90_BN, Gg90Dt<T>::V>(acc, pk_wgmma_desc_advance(da, ks * 32),
                                                            pk_wgmma_desc_advance(db, ks * 32), kb > 0 || ks > 0);
            pk_wgmma_commit();
            // The previous k-block's group has completed: release its stage (this one's stays in flight).
            pk_wgmma_wait<1>();
            if (kb > 0) pk_mbarrier_arrive(&empty[prev]);
            prev = s;
        }
        pk_wgmma_wait<0>();
        pk_mbarrier_arrive(&empty[prev]);

        // Epilogue: accumulator 4j + 2r + v is tile row 64c + 16w + g + 8r, column 8j + 2tq + v.
        const int mend = min(x.mend, M);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = x.m0 + 64 * c + 16 * w + g + 8 * r;
            if (row >= mend) continue;
            T* orow = out + (long long)row * cols;
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
                        *reinterpret_cast<unsigned int*>(orow + n) = Pk16<T>::narrow2(y0, y1);
                    } else {
                        if (n < cols) reinterpret_cast<unsigned short*>(orow)[n] = Pk16<T>::narrow(y0);
                        if (n + 1 < cols) reinterpret_cast<unsigned short*>(orow)[n + 1] = Pk16<T>::narrow(y1);
                    }
                }
            } else {
                const int n0 = x.nt * GG90_BN + 2 * tq;
                const bool pair = (cols & 1) == 0;
#pragma unroll
                for (int j = 0; j < GG90_BN / 8; j++) {
                    const int n = n0 + 8 * j;
                    const float y0 = acc[4 * j + 2 * r], y1 = acc[4 * j + 2 * r + 1];
                    if (pair && n + 1 < cols) {
                        *reinterpret_cast<unsigned int*>(orow + n) = Pk16<T>::narrow2(y0, y1);
                    } else {
                        if (n < cols) reinterpret_cast<unsigned short*>(orow)[n] = Pk16<T>::narrow(y0);
                        if (n + 1 < cols) reinterpret_cast<unsigned short*>(orow)[n + 1] = Pk16<T>::narrow(y1);
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
    gg90_body<T, false>(&ta, &tb, offsets, out, M, N, K, n_groups, 0);
}
template <typename T>
__device__ __forceinline__ void moe_gemm_act_sm90_impl(const CUtensorMap& ta, const CUtensorMap& tb,
                                                       const int* offsets, T* out, int M, int N, int K,
                                                       int n_groups, int act) {
    gg90_body<T, true>(&ta, &tb, offsets, out, M, N, K, n_groups, act);
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
