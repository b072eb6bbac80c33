// Test kernel for pk_common.cuh's pk_exp2_fma (tests/test_exp2_fma.py): 2^x on the FMA pipe at degree 3 and 4,
// beside pk_ex2_approx (the MUFU one it replaces in part of the attention softmax), one launch over every input.
#include "pk_common.cuh"

extern "C" __global__ void pk_t_exp2_fma(const float* x, float* deg3, float* deg4, float* mufu, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    deg3[i] = pk_exp2_fma<3>(x[i]);
    deg4[i] = pk_exp2_fma<4>(x[i]);
    mufu[i] = pk_ex2_approx(x[i]);
}
