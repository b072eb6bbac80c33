// Test-only kernels for the compiler/cache tests: small, every parameter kind the registry accepts.
#include "pkt_header.cuh"

extern "C" __global__ void pkt_scale(const float* __restrict__ x, float* __restrict__ y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = pkt_twice(x[i]);
}

extern "C" __global__ void pkt_mixed(unsigned short* out, const double* d, unsigned int n, unsigned short h,
                                     bool flag, unsigned char c, double scale, int k, float f,
                                     unsigned long long big) {
    __shared__ float buf[64];
    unsigned int t = threadIdx.x;
    buf[t % 64] = f + (float)k;
    __syncthreads();
    if (t < n) out[t] = (unsigned short)(buf[(t + 1) % 64] + h + flag + c + (float)(d[t] * scale) + (float)big);
}
