// pykern: arch sm_90a
// Host-emulation tests of the Hopper wrappers (tests/test_host_sm90.py).
#include "pk_ptx.cuh"

// TMA-load one box (rows x row_bytes) into 1024-aligned dynamic shared memory, then: raw bytes ->
// raw_out, the tile read back un-swizzled -> tile_out, and a TMA store of the smem box -> map_st.
extern "C" __global__ void pk_sm90_tma_box(const __grid_constant__ CUtensorMap map_ld,
                                           const __grid_constant__ CUtensorMap map_st, unsigned char* raw_out,
                                           unsigned char* tile_out, int rows, int row_bytes, int swizzle) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    unsigned n = rows * row_bytes;
    if (threadIdx.x == 0) {
        pk_mbarrier_init(&bar, 1);
        pk_fence_mbarrier_init();
        pk_mbarrier_arrive_expect_tx(&bar, n);
        pk_tma_load_2d(smem, &map_ld, &bar, 0, 0);
    }
    __syncthreads();
    pk_mbarrier_wait_parity(&bar, 0);
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) {
        raw_out[i] = smem[i];
        tile_out[i] = smem[pk_swizzle_offset(i, swizzle)];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        pk_tma_store_2d(&map_st, smem, 0, 0);
        pk_tma_store_commit();
        pk_tma_store_wait_read<0>();
    }
}

// D[64 x N] = A[64 x K] * B[N x K]^T: A and B TMA-loaded (128B swizzle, K-major; boxes of 64 x 64
// elements), wgmma SS m64nNk16 per 16-wide k step. RS: A's fragments from global memory instead.
template <int N, int DT, bool RS>
__device__ void gemm_tile(const CUtensorMap* ma, const CUtensorMap* mb, const unsigned short* a, float* d, int K) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    unsigned short* sa = reinterpret_cast<unsigned short*>(smem);                 // 64 x 64: 8 KiB per k-block
    unsigned short* sb = reinterpret_cast<unsigned short*>(smem + 8192);          // N x 64
    unsigned tid = threadIdx.x, lane = tid % 32, q = tid / 32, g = lane / 4, t = lane % 4;
    if (tid == 0) pk_mbarrier_init(&bar, 1);
    __syncthreads();
    float acc[N / 2];
    for (int i = 0; i < N / 2; i++) acc[i] = 0.0f;
    for (int kb = 0; kb < K / 64; kb++) {
        if (tid == 0) {
            pk_mbarrier_arrive_expect_tx(&bar, (64 + N) * 128);
            pk_tma_load_2d(sa, ma, &bar, kb * 64, 0);
            for (int nb = 0; nb < N / 64; nb++) pk_tma_load_2d(sb + nb * 64 * 64, mb, &bar, kb * 64, nb * 64);
        }
        pk_mbarrier_wait_parity(&bar, kb & 1);
        pk_wgmma_fence();
        for (int ks = 0; ks < 4; ks++) {
            // 64-row blocks of B are 8 KiB apart: with SBO = 1024 per 8 rows they follow on.
            unsigned long long db = pk_wgmma_desc_advance(pk_wgmma_desc(sb, 16, 1024, PK_SWIZZLE_128B), 32 * ks);
            if constexpr (RS) {
                unsigned af[4];
                for (int v = 0; v < 8; v += 2) {
                    unsigned row = 16 * q + g + 8 * ((v >> 1) & 1), col = kb * 64 + ks * 16 + 2 * t + 8 * (v >> 2);
                    af[v / 2] = a[row * K + col] | ((unsigned)a[row * K + col + 1] << 16);
                }
                pk_wgmma_m64nNk16_rs<N, DT>(acc, af, db, 1);
            } else {
                unsigned long long da = pk_wgmma_desc_advance(pk_wgmma_desc(sa, 16, 1024, PK_SWIZZLE_128B), 32 * ks);
                pk_wgmma_m64nNk16_ss<N, DT>(acc, da, db, 1);
            }
        }
        pk_wgmma_commit();
        pk_wgmma_wait<0>();
        __syncthreads();  // every warp is done with this k-block's tiles before they are reloaded
    }
    for (int j = 0; j < N / 8; j++)
        for (int v = 0; v < 4; v++)
            d[(16 * q + g + 8 * (v >> 1)) * N + 8 * j + 2 * t + (v & 1)] = acc[4 * j + v];
}

extern "C" __global__ void pk_sm90_gemm_ss_n64_bf16(const __grid_constant__ CUtensorMap ma, const __grid_constant__ CUtensorMap mb,
                                                    const unsigned short* a, float* d, int K) {
    gemm_tile<64, PK_WGMMA_BF16, false>(&ma, &mb, a, d, K);
}
extern "C" __global__ void pk_sm90_gemm_ss_n128_f16(const __grid_constant__ CUtensorMap ma, const __grid_constant__ CUtensorMap mb,
                                                    const unsigned short* a, float* d, int K) {
    gemm_tile<128, PK_WGMMA_F16, false>(&ma, &mb, a, d, K);
}
extern "C" __global__ void pk_sm90_gemm_rs_n64_f16(const __grid_constant__ CUtensorMap ma, const __grid_constant__ CUtensorMap mb,
                                                   const unsigned short* a, float* d, int K) {
    gemm_tile<64, PK_WGMMA_F16, true>(&ma, &mb, a, d, K);
}
extern "C" __global__ void pk_sm90_gemm_rs_n128_bf16(const __grid_constant__ CUtensorMap ma, const __grid_constant__ CUtensorMap mb,
                                                     const unsigned short* a, float* d, int K) {
    gemm_tile<128, PK_WGMMA_BF16, true>(&ma, &mb, a, d, K);
}

// A producer warp fills one of two slots, a consumer warp sums it, `rounds` times: full/empty
// mbarrier pairs with phase parities, as a pipelined kernel uses them.
// late: the producer stores after its arrive on `full`, so nothing orders the store before the consumer's read
// (racecheck reports it; the plain build may well get the right sums).
extern "C" __global__ void pk_sm90_pingpong(const float* in, float* out, int rounds, int late) {
    __shared__ float slot[2][32];
    __shared__ __align__(8) unsigned long long full[2], empty[2];
    unsigned tid = threadIdx.x, lane = tid % 32;
    if (tid == 0)
        for (int s = 0; s < 2; s++) pk_mbarrier_init(&full[s], 32), pk_mbarrier_init(&empty[s], 32);
    __syncthreads();
    if (tid < 32) {  // producer
        for (int r = 0; r < rounds; r++) {
            int s = r % 2;
            pk_mbarrier_wait_parity(&empty[s], ((r / 2) & 1) ^ 1);
            if (!late) slot[s][lane] = in[r * 32 + lane];
            pk_mbarrier_arrive(&full[s]);
            if (late) slot[s][lane] = in[r * 32 + lane];
        }
    } else {  // consumer
        float acc = 0.0f;
        for (int r = 0; r < rounds; r++) {
            int s = r % 2;
            pk_mbarrier_wait_parity(&full[s], (r / 2) & 1);
            acc += slot[s][lane] * (float)(r + 1);
            pk_mbarrier_arrive(&empty[s]);
        }
        out[lane] = acc;
    }
}

// Mistakes the host emulation reports. mode 0: wgmma results never waited for; 1: wgmma without a
// fence; 2: a TMA load nobody waits for; 3: expect_tx more bytes than arrive (the wait never ends);
// 4: read the TMA destination without waiting (stale bytes, visible in out).
extern "C" __global__ void pk_sm90_mistakes(const __grid_constant__ CUtensorMap m, float* out, int mode) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    float* s = reinterpret_cast<float*>(smem);
    if (threadIdx.x == 0) pk_mbarrier_init(&bar, 1);
    __syncthreads();
    if (mode <= 1) {
        float acc[4] = {0, 0, 0, 0};
        if (mode == 0) pk_wgmma_fence();
        pk_wgmma_m64nNk16_ss<8, PK_WGMMA_BF16>(acc, pk_wgmma_desc(smem, 128, 256, PK_SWIZZLE_NONE),
                                               pk_wgmma_desc(smem, 128, 256, PK_SWIZZLE_NONE), 0);
        pk_wgmma_commit();
        out[threadIdx.x] = 1.0f;
        return;
    }
    if (threadIdx.x == 0) {
        pk_mbarrier_arrive_expect_tx(&bar, mode == 3 ? 2 * 16 * 4 : 16 * 4);
        pk_tma_load_2d(s, &m, &bar, 0, 0);
    }
    __syncthreads();
    if (mode == 3) pk_mbarrier_wait_parity(&bar, 0);
    if (threadIdx.x < 16) out[threadIdx.x] = s[threadIdx.x];
}

// Bulk reduce-add (pk_bulk_reduce_add_f32): every round the block's threads write in[i] * (round + 1) into shared
// buffer round % 2, fence, meet, and thread 0 adds the n floats into acc with one bulk op, then waits until the op
// before it has read its buffer (wait_group.read 1: the double buffer). mode 1 skips that wait (a buffer rewritten
// before its op read it: the sums show the rewrite); mode 2 has thread 1 rewrite its float after the barrier (a
// write the barrier does not order before the bulk op's read: racecheck reports it).
extern "C" __global__ void pk_sm90_bulk_red(const float* in, float* acc, int n, int rounds, int mode) {
    extern __shared__ __align__(128) float sred[];
    for (int r = 0; r < rounds; r++) {
        float* b = sred + (r & 1) * n;
        for (int i = threadIdx.x; i < n; i += blockDim.x) b[i] = in[i] * (float)(r + 1);
        pk_fence_proxy_async_shared();
        __syncthreads();
        if (mode == 2 && threadIdx.x == 1) b[1] = in[1] * (float)(r + 1);
        if (threadIdx.x == 0) {
            pk_bulk_reduce_add_f32(acc, b, n * 4);
            pk_tma_store_commit();
            if (mode != 1) pk_tma_store_wait_read<1>();
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) pk_tma_store_wait<0>();
}

// Races through the async proxy (racecheck, tests/test_host_sm90.py): a 64 x 64 bf16 tile TMA-loaded (128B swizzle)
// and read by one wgmma m64n8k16 SS of warpgroup 0 (A: rows 0..63, B: rows 0..7, k 0..15). Block of 256 threads.
// mode 0: correct (mbarrier waits, fence, wgmma, wait; warpgroup 1 rewrites the tile after warpgroup 0's wgmma wait,
//         ordered by named barrier 1: warpgroup 0 arrives after its wait, warpgroup 1 syncs).
// mode 1: warpgroup 0 rewrites the tile before its pk_wgmma_wait: the wgmma in flight still reads it.
// mode 2: thread 0 reads the tile right after issuing the TMA load, before any wait (it has not landed).
// mode 3: the wgmma is issued with no wait on the mbarrier (it reads bytes the TMA load has not landed).
// mode 4: warpgroup 0 arrives at named barrier 1 before its pk_wgmma_wait: warpgroup 1's rewrite races with the
//         wgmma's read.
// mode 5: warpgroup 1 reads the tile with no wait on the mbarrier.
extern "C" __global__ void pk_sm90_async_races(const __grid_constant__ CUtensorMap m, float* out, int mode) {
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    const unsigned tid = threadIdx.x, wg = tid / 128;
    unsigned* words = reinterpret_cast<unsigned*>(smem);
    if (tid == 0) pk_mbarrier_init(&bar, 1);
    __syncthreads();
    if (tid == 0) {
        pk_mbarrier_arrive_expect_tx(&bar, 64 * 128);
        pk_tma_load_2d(smem, &m, &bar, 0, 0);
    }
    if (mode == 2 && tid == 0) out[1000] = __uint_as_float(words[7]);
    if (wg == 0) {
        if (mode != 3) pk_mbarrier_wait_parity(&bar, 0);
        float acc[4] = {0, 0, 0, 0};
        const unsigned long long d = pk_wgmma_desc(smem, 16, 1024, PK_SWIZZLE_128B);
        pk_wgmma_fence();
        pk_wgmma_m64nNk16_ss<8, PK_WGMMA_BF16>(acc, d, d, 0);
        pk_wgmma_commit();
        if (mode == 1) words[tid] = 0u;
        if (mode == 4) pk_bar_arrive(1, 256);
        pk_wgmma_wait<0>();
        if (mode == 0) pk_bar_arrive(1, 256);
        if (mode == 3) pk_mbarrier_wait_parity(&bar, 0);  // the load is waited for (after the wgmma read it)
        for (int i = 0; i < 4; i++) out[tid * 4 + i] = acc[i];
    } else {
        if (mode == 0 || mode == 4) {
            pk_mbarrier_wait_parity(&bar, 0);  // the TMA write is ordered before this warpgroup's rewrite
            pk_bar_sync(1, 256);
            words[tid] = 0u;
        }
        if (mode == 5) out[tid * 4] = __uint_as_float(words[tid]);
    }
}
