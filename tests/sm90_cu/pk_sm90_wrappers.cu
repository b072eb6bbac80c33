// pykern: arch sm_90a
// Every Hopper wrapper of pk_ptx.cuh in one kernel each, for the NVRTC (sm_90a SASS) and host tests.
#include "pk_ptx.cuh"

// One warpgroup: TMA-load a 64x64 bf16 tile of A (128B swizzle) and a 64x64 tile of B (N x K,
// K-major), D = A * B^T with four m64n64k16 wgmmas (SS), store D (fp32) row-major.
extern "C" __global__ void __launch_bounds__(128) pk_sm90_tma_wgmma_ss(const __grid_constant__ CUtensorMap map_a,
                                                                       const __grid_constant__ CUtensorMap map_b,
                                                                       const __grid_constant__ CUtensorMap map_d,
                                                                       float* d_out) {
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<unsigned long long>(smem) + 1023) & ~1023ull);
    unsigned short* sa = reinterpret_cast<unsigned short*>(base);          // 64 x 64 bf16, 8 KiB
    unsigned short* sb = reinterpret_cast<unsigned short*>(base + 8192);   // 64 x 64 bf16, 8 KiB
    float* sd = reinterpret_cast<float*>(base + 16384);                    // 64 x 64 fp32 staging, 16 KiB
    __shared__ __align__(8) unsigned long long bar;
    unsigned tid = threadIdx.x;
    if (tid == 0) {
        pk_mbarrier_init(&bar, 1);
        pk_fence_mbarrier_init();
        pk_tma_prefetch_desc(&map_a);
    }
    __syncthreads();
    if (pk_elect_one() && tid < 32) {
        pk_mbarrier_arrive_expect_tx(&bar, 2 * 8192);
        pk_tma_load_2d(sa, &map_a, &bar, 0, blockIdx.x * 64);
        pk_tma_load_2d(sb, &map_b, &bar, 0, 0);
    }
    pk_mbarrier_wait_parity(&bar, 0);
    float acc[32];
    for (int i = 0; i < 32; i++) acc[i] = 0.0f;
    pk_wgmma_fence();
    for (int k = 0; k < 4; k++) {
        // K-major 128B swizzle: 8-row groups 1024 bytes apart (SBO), LBO unused; a k-step of 16
        // elements is 32 bytes further inside the swizzle atom.
        unsigned long long da = pk_wgmma_desc_advance(pk_wgmma_desc(sa, 16, 1024, PK_SWIZZLE_128B), 32 * k);
        unsigned long long db = pk_wgmma_desc_advance(pk_wgmma_desc(sb, 16, 1024, PK_SWIZZLE_128B), 32 * k);
        pk_wgmma_m64nNk16_ss<64, PK_WGMMA_BF16>(acc, da, db, 1);
    }
    pk_wgmma_commit();
    pk_wgmma_wait<0>();
    unsigned q = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    for (int j = 0; j < 8; j++)
        for (int v = 0; v < 4; v++) {
            unsigned row = 16 * q + g + 8 * (v >> 1), col = 8 * j + 2 * t + (v & 1);
            sd[row * 64 + col] = acc[4 * j + v];
            d_out[(blockIdx.x * 64 + row) * 64 + col] = acc[4 * j + v];
        }
    pk_fence_proxy_async_shared();
    __syncthreads();
    if (tid == 0) {
        pk_tma_store_2d(&map_d, sd, 0, blockIdx.x * 64);
        pk_tma_store_commit();
        pk_tma_store_wait_read<0>();
        pk_tma_store_wait<0>();
        pk_mbarrier_inval(&bar);
    }
}

// Register-A form and the rest: m64n128k16 f16 with A from registers, B (K x N, MN-major, no
// swizzle) from shared memory; a producer warpgroup (setmaxnreg.dec) and a consumer (inc).
extern "C" __global__ void __launch_bounds__(256, 1) pk_sm90_wgmma_rs(const unsigned* a_frag, const unsigned short* b,
                                                                   float* d_out) {
    __shared__ __align__(1024) unsigned short sb[16 * 128];
    __shared__ __align__(8) unsigned long long full;
    unsigned tid = threadIdx.x;
    if (tid == 0) pk_mbarrier_init(&full, 128);
    __syncthreads();
    if (tid < 128) {
        pk_setmaxnreg_dec<40>();
        for (unsigned i = tid; i < 16 * 128; i += 128) sb[i] = b[i];
        pk_fence_proxy_async_shared();
        pk_mbarrier_arrive(&full);
    } else {
        pk_setmaxnreg_inc<232>();
        unsigned c = tid - 128;
        unsigned a[4];
        for (int i = 0; i < 4; i++) a[i] = a_frag[c * 4 + i];
        float acc[64];
        while (!pk_mbarrier_try_wait_parity(&full, 0)) {
        }
        pk_wgmma_fence();
        // MN-major, no swizzle: core matrices of 8 (N) x 8 (K) elements, 128 bytes each; LBO = the
        // next 8 k (one core matrix further), SBO = the next 8 n (two core matrices further).
        pk_wgmma_m64nNk16_rs<128, PK_WGMMA_F16, 1>(acc, a, pk_wgmma_desc(sb, 128, 256, PK_SWIZZLE_NONE), 0);
        pk_wgmma_commit();
        pk_wgmma_wait<0>();
        for (int i = 0; i < 64; i++) d_out[c * 64 + i] = acc[i];
    }
}

// 3D..5D TMA loads (a box of 8 x 2 x 1 x 1 x 1 floats) and expect_tx + arrive separately.
extern "C" __global__ void pk_sm90_tma_nd(const __grid_constant__ CUtensorMap m3, const __grid_constant__ CUtensorMap m4,
                                          const __grid_constant__ CUtensorMap m5, float* out) {
    __shared__ __align__(128) float s[3][16];
    __shared__ __align__(8) unsigned long long bar;
    if (threadIdx.x == 0) {
        pk_mbarrier_init(&bar, 1);
        pk_fence_mbarrier_init();
        pk_mbarrier_expect_tx(&bar, 3 * 64);
        pk_tma_load_3d(s[0], &m3, &bar, 0, 1, 0);
        pk_tma_load_4d(s[1], &m4, &bar, 0, 1, 0, 0);
        pk_tma_load_5d(s[2], &m5, &bar, 0, 1, 0, 0, 0);
        pk_mbarrier_arrive(&bar);
    }
    __syncthreads();
    pk_mbarrier_wait_parity(&bar, 0);
    if (threadIdx.x < 48) out[threadIdx.x] = s[threadIdx.x / 16][threadIdx.x % 16];
}
