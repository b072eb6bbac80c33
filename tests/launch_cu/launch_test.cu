// Test-only kernels for the launcher and the nvrtc backend (joined to the registry through
// PYKERN_KERNEL_PATH). The pktest_ prefix keeps them clear of the real kernel names.

#include "pk_ptx.cuh"

// y = a * x + y over n elements; one pointer the kernel writes, one it only reads.
extern "C" __global__ void pktest_axpy(float* __restrict__ y, const float* __restrict__ x, float a,
                                       unsigned int n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

// Every scalar type once, sizes interleaved so each parameter needs its own alignment;
// thread 0 writes each value back as a double so a GPU run shows exactly what arrived.
extern "C" __global__ void pktest_all_types(double* out, char c, unsigned char uc, short s,
                                            unsigned short us, int i, unsigned int ui, long long ll,
                                            unsigned long long ull, float f, double d, bool b,
                                            signed char sc) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    out[0] = (double)c;
    out[1] = (double)uc;
    out[2] = (double)s;
    out[3] = (double)us;
    out[4] = (double)i;
    out[5] = (double)ui;
    out[6] = (double)ll;
    out[7] = (double)ull;
    out[8] = (double)f;
    out[9] = d;
    out[10] = b ? 1.0 : 0.0;
    out[11] = (double)sc;
}

// Reverses each block's tile through dynamic shared memory (so shared_mem must be >= 4*blockDim).
extern "C" __global__ void pktest_smem_reverse(float* __restrict__ out, const float* __restrict__ in,
                                               long long n) {
    extern __shared__ float tile[];
    long long base = (long long)blockIdx.x * blockDim.x;
    long long i = base + threadIdx.x;
    tile[threadIdx.x] = i < n ? in[i] : 0.0f;
    __syncthreads();
    long long j = base + (blockDim.x - 1 - threadIdx.x);
    if (j < n) out[j] = tile[threadIdx.x];
}

// bf16 travels as raw 16-bit words: a plain copy of n words.
extern "C" __global__ void pktest_copy_u16(unsigned short* __restrict__ out,
                                           const unsigned short* __restrict__ in, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i];
}

// pktest_axpy that may be launched with programmatic dependent launch: it waits for the previous grid first.
// pykern: pdl pktest_axpy_pdl
extern "C" __global__ void pktest_axpy_pdl(float* __restrict__ y, const float* __restrict__ x, float a,
                                           unsigned int n) {
    pk_grid_dependency_wait();
    pk_grid_launch_dependents();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
