// Vector load/store traits shared by the elementwise and row kernels: 4-wide
// (float4, or one 8-byte word of bf16) and 16-byte (4 floats or 8 bf16) accesses
// widened to fp32, plus the alignment tests that pick them. Callers check
// alignment and a length divisible by the width before taking a vector path.
#pragma once
#include "pk_common.cuh"

// Four bf16 words moved as one 8-byte access.
struct alignas(8) PkBf16x4 {
    unsigned short a, b, c, d;
};

// 4-wide vector access: float4 for fp32, one 8-byte word for bf16. Only used
// when the caller has checked alignment and a row length divisible by 4.
template <typename T> struct PkVec4;
template <> struct PkVec4<float> {
    static __device__ __forceinline__ float4 load(const float* p, long long i) {
        return *reinterpret_cast<const float4*>(p + i);
    }
    static __device__ __forceinline__ void store(float* p, long long i, float4 v) {
        *reinterpret_cast<float4*>(p + i) = v;
    }
};
template <> struct PkVec4<unsigned short> {
    static __device__ __forceinline__ float4 load(const unsigned short* p, long long i) {
        const PkBf16x4 u = *reinterpret_cast<const PkBf16x4*>(p + i);
        float4 v;
        v.x = pk_bf16_to_float(u.a);
        v.y = pk_bf16_to_float(u.b);
        v.z = pk_bf16_to_float(u.c);
        v.w = pk_bf16_to_float(u.d);
        return v;
    }
    static __device__ __forceinline__ void store(unsigned short* p, long long i, float4 v) {
        PkBf16x4 u;
        const unsigned int lo = pk_float2_to_bf16x2(v.x, v.y), hi = pk_float2_to_bf16x2(v.z, v.w);
        u.a = (unsigned short)(lo & 0xffffu);
        u.b = (unsigned short)(lo >> 16);
        u.c = (unsigned short)(hi & 0xffffu);
        u.d = (unsigned short)(hi >> 16);
        *reinterpret_cast<PkBf16x4*>(p + i) = u;
    }
};

// 16-byte vectors widened to fp32: 4 floats or 8 bf16 (one LDG.128 / STG.128 each).
template <typename T> struct PkVec16;
template <> struct PkVec16<float> {
    static constexpr int N = 4;
    static __device__ __forceinline__ void load(const float* p, long long i, float* f) {
        const float4 v = *reinterpret_cast<const float4*>(p + i);
        f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
    }
    static __device__ __forceinline__ void store(float* p, long long i, const float* f) {
        float4 v;
        v.x = f[0]; v.y = f[1]; v.z = f[2]; v.w = f[3];
        *reinterpret_cast<float4*>(p + i) = v;
    }
};
template <> struct PkVec16<unsigned short> {
    static constexpr int N = 8;
    static __device__ __forceinline__ void load(const unsigned short* p, long long i, float* f) {
        const uint4 u = *reinterpret_cast<const uint4*>(p + i);
        const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // little endian: the low half is the earlier element
            f[2 * k] = __int_as_float((int)(w[k] << 16));
            f[2 * k + 1] = __int_as_float((int)(w[k] & 0xffff0000u));
        }
    }
    static __device__ __forceinline__ void store(unsigned short* p, long long i, const float* f) {
        uint4 u;
        u.x = pk_float2_to_bf16x2(f[0], f[1]);
        u.y = pk_float2_to_bf16x2(f[2], f[3]);
        u.z = pk_float2_to_bf16x2(f[4], f[5]);
        u.w = pk_float2_to_bf16x2(f[6], f[7]);
        *reinterpret_cast<uint4*>(p + i) = u;
    }
};

// True when 16-byte vectors starting at p are aligned.
__device__ __forceinline__ bool pk_aligned16(const void* p) { return (((unsigned long long)p) & 15ull) == 0ull; }

// True when 4-element vectors starting at p are naturally aligned.
template <typename T>
__device__ __forceinline__ bool pk_vec_aligned(const T* p) {
    return (((unsigned long long)p) & (unsigned long long)(4 * sizeof(T) - 1)) == 0ull;
}
