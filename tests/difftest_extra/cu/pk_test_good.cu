// Test-only kernels for the differential harness (tests/difftest_extra/pk_test.py):
// never in kernels_cu/, they join the registry only through PYKERN_KERNEL_PATH.
#include "pk_common.cuh"

template <typename T>
__device__ void pk_test_axpy_body(const T* x, T* y, float a, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) PkIO<T>::store(y, i, a * PkIO<T>::load(x, i) + PkIO<T>::load(y, i));
}

// y = a * x + y, in place: exercises a read-write (non-const) array.
extern "C" __global__ void pk_test_axpy(const float* x, float* y, float a, long long n) {
    pk_test_axpy_body<float>(x, y, a, n);
}

extern "C" __global__ void pk_test_axpy_bf16(const unsigned short* x, unsigned short* y, float a, long long n) {
    pk_test_axpy_body<unsigned short>(x, y, a, n);
}

// out[row] = sum(x[row, :]): one block per row, a block reduction through shared memory.
extern "C" __global__ void pk_test_rowsum(const float* x, float* out, int rows, int cols) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= rows) return;
    float acc = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) acc += x[row * cols + c];
    acc = pk_block_sum(acc, scratch);
    if (threadIdx.x == 0) out[row] = acc;
}
