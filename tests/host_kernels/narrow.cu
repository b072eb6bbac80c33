// Test kernel for pk_common.cuh's fp32 -> bf16 narrowing (tests/test_bf16_narrow.py): the software
// path, the single and packed entry points every bf16 kernel uses (hardware cvt on sm_80+), and
// pk_ptx.cuh's cvt wrapper side by side, so one launch compares all of them bit for bit.
#include "pk_common.cuh"

extern "C" __global__ void pk_t_narrow(const float* lo, const float* hi, unsigned int* sw, unsigned int* one,
                                       unsigned int* pair, unsigned int* cvt, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    sw[i] = (unsigned int)pk_float_to_bf16_sw(lo[i]) | ((unsigned int)pk_float_to_bf16_sw(hi[i]) << 16);
    one[i] = (unsigned int)pk_float_to_bf16(lo[i]) | ((unsigned int)pk_float_to_bf16(hi[i]) << 16);
    pair[i] = pk_float2_to_bf16x2(lo[i], hi[i]);
    cvt[i] = pk_cvt_bf16x2(lo[i], hi[i]);
}

// The f16 twins (tests/test_f16_narrow.py): fp32 -> f16 through the single and packed entry points and the
// cvt wrapper, and every f16 word widened back to fp32 (cvt.f32.f16).
extern "C" __global__ void pk_t_narrow_f16(const float* lo, const float* hi, unsigned int* one, unsigned int* pair,
                                           unsigned int* cvt, const unsigned short* words, float* widened, int n,
                                           int n_words) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        one[i] = (unsigned int)pk_float_to_f16(lo[i]) | ((unsigned int)pk_float_to_f16(hi[i]) << 16);
        pair[i] = pk_float2_to_f16x2(lo[i], hi[i]);
        cvt[i] = pk_cvt_f16x2(lo[i], hi[i]);
    }
    if (i < n_words) widened[i] = pk_f16_to_float(words[i]);
}
