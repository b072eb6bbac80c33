// Shared device helpers for every kernels_cu/*.cu file.
//
// The NVRTC wheel ships no cuda_bf16.h, so bf16 travels as raw 16-bit words
// (unsigned short) and is widened/narrowed here. The same text is compiled by
// the host backend against pykern's CUDA emulation header.
#pragma once
#include "pk_ptx.cuh"

#define PK_FULL_MASK 0xffffffffu
#define PK_NEG_INF (__int_as_float(0xff800000))

// bf16 -> fp32 is exact: the bf16 word is the top half of the fp32 word.
__device__ __forceinline__ float pk_bf16_to_float(unsigned short h) {
    return __int_as_float(((int)h) << 16);
}

// fp32 -> bf16 with round-to-nearest-even; any NaN becomes the canonical NaN 0x7fff.
// On sm_80+ this is the hardware conversion (cvt.rn.bf16x2.f32, one F2FP per two
// elements) through pk_ptx.cuh; sm_75 and the host backend run the same rounding in
// integer code, bit for bit (tests/test_bf16_narrow.py checks every special value).
// The canonical NaN is what the hardware produces, so the software path follows it.
__device__ __forceinline__ unsigned short pk_float_to_bf16_sw(float f) {
    unsigned int u = (unsigned int)__float_as_int(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fffu;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Two elements packed: `lo` in bits 0..15, `hi` in bits 16..31. Prefer this in hot
// loops: one instruction narrows both.
__device__ __forceinline__ unsigned int pk_float2_to_bf16x2(float lo, float hi) {
#if !defined(PYKERN_HOST) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return pk_cvt_bf16x2(lo, hi);
#else
    return (unsigned int)pk_float_to_bf16_sw(lo) | ((unsigned int)pk_float_to_bf16_sw(hi) << 16);
#endif
}

__device__ __forceinline__ unsigned short pk_float_to_bf16(float f) {
#if !defined(PYKERN_HOST) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return (unsigned short)(pk_cvt_bf16x2(f, 0.0f) & 0xffffu);
#else
    return pk_float_to_bf16_sw(f);
#endif
}

// e^x as one MUFU.EX2: ex2.approx.ftz(x * log2 e) (what __expf is on the GPU), with the
// hardware's flush of subnormal results emulated on the host. Relative error about
// 2^-22 + |x| 2^-24 (the product's rounding): far inside the f32 table (rtol 1e-4) for
// the |x| <= 88 that keeps e^x finite. -inf -> +0, +inf -> +inf, NaN -> NaN.
// On the GPU it is spelled __expf, which libdevice lowers to exactly that (FMUL by
// log2 e, MUFU.EX2 .ftz) but as an intrinsic the optimizer can see through: an
// `asm` ex2 between the four scalar parts of a float4 store kept LLVM from merging
// them into one 128-bit STG (causal_attn_softmax showed 4 x STG.E).
__device__ __forceinline__ float pk_exp_fast(float x) {
#if defined(PYKERN_HOST)
    return pk_ex2_approx(x * 1.4426950408889634f);
#else
    return __expf(x);
#endif
}

// Load/store traits so one templated kernel body serves f32 and bf16 I/O.
template <typename T> struct PkIO;
template <> struct PkIO<float> {
    static __device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
    static __device__ __forceinline__ void store(float* p, long long i, float v) { p[i] = v; }
};
template <> struct PkIO<unsigned short> {
    static __device__ __forceinline__ float load(const unsigned short* p, long long i) { return pk_bf16_to_float(p[i]); }
    static __device__ __forceinline__ void store(unsigned short* p, long long i, float v) { p[i] = pk_float_to_bf16(v); }
};

__device__ __forceinline__ float pk_warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(PK_FULL_MASK, v, off);
    return v;
}

__device__ __forceinline__ float pk_warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(PK_FULL_MASK, v, off));
    return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024), every thread of the
// block must call it. `scratch` holds >= 32 floats of shared memory. The result
// is returned to every thread. The trailing barrier is what makes it safe to
// call again with the same scratch: without it a fast warp could overwrite
// scratch[0] before a slow warp has read it (seed defect 1 in DESIGN.md).
__device__ __forceinline__ float pk_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    v = pk_warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < n_warps) ? scratch[lane] : 0.0f;
    v = pk_warp_sum(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float pk_block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    v = pk_warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < n_warps) ? scratch[lane] : PK_NEG_INF;
    v = pk_warp_max(v);
    __syncthreads();
    return v;
}
