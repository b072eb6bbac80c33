// Test kernel for pk_mma_m16n8k32_e4m3 (tests/test_host_ptx.py): moves raw registers; the lane <-> element
// mapping is checked in Python against the PTX ISA's m16n8k32 tables. Its own file: mma .e4m3 needs sm_89,
// and ptx.cu is compiled for sm_80 by the NVRTC test.
#include "pk_common.cuh"

extern "C" __global__ void pk_t_mma_e4m3(const unsigned int* a, const unsigned int* b, const float* c, float* d) {
    const long long base = (long long)blockIdx.x * blockDim.x + threadIdx.x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
    __trap();
#else
    unsigned int ra[4], rb[2];
    float rc[4], rd[4];
    for (int i = 0; i < 4; i++) ra[i] = a[base * 4 + i], rc[i] = c[base * 4 + i];
    for (int i = 0; i < 2; i++) rb[i] = b[base * 2 + i];
    pk_mma_m16n8k32_e4m3(rd, ra, rb, rc);
    for (int i = 0; i < 4; i++) d[base * 4 + i] = rd[i];
#endif
}
