// A deliberately wrong kernel: the differential harness must fail on it and name the case
// (tests/test_difftest.py::test_harness_catches_wrong_kernel). Never add it to kernels_cu/.

// y = a * x, but the bound is off by one: the last element is never written.
extern "C" __global__ void pk_test_scale(const float* x, float* y, float a, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i + 1 < n) y[i] = a * x[i];
}
