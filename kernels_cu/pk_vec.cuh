// Vector load/store traits shared by the elementwise and row kernels: 4-wide
// (float4, or one 8-byte word of 16-bit elements) and 16-byte (4 floats or 8
// bf16 / f16) accesses widened to fp32, plus the alignment tests that pick them.
// Callers check alignment and a length divisible by the width before taking a
// vector path. The 16-bit element types (__nv_bfloat16, __half, and bf16 as
// unsigned short) share one implementation through pk_common.cuh's Pk16 traits.
#pragma once
#include "pk_common.cuh"

// 4-wide vector access: float4 for fp32, one 8-byte word for 16-bit elements.
template <typename T> struct PkVec4 {
    static __device__ __forceinline__ float4 load(const T* p, long long i = 0) {
        const uint2 u = *reinterpret_cast<const uint2*>(p + i);
        float4 v;
        Pk16<T>::widen2(u.x, v.x, v.y);
        Pk16<T>::widen2(u.y, v.z, v.w);
        return v;
    }
    static __device__ __forceinline__ void store(T* p, long long i, float4 v) {
        uint2 u;
        u.x = Pk16<T>::narrow2(v.x, v.y);
        u.y = Pk16<T>::narrow2(v.z, v.w);
        *reinterpret_cast<uint2*>(p + i) = u;
    }
    static __device__ __forceinline__ void store(T* p, float4 v) { store(p, 0, v); }
};
template <> struct PkVec4<float> {
    static __device__ __forceinline__ float4 load(const float* p, long long i = 0) {
        return *reinterpret_cast<const float4*>(p + i);
    }
    static __device__ __forceinline__ void store(float* p, long long i, float4 v) {
        *reinterpret_cast<float4*>(p + i) = v;
    }
    static __device__ __forceinline__ void store(float* p, float4 v) { store(p, 0, v); }
};

// 16-byte vectors widened to fp32: 4 floats or 8 16-bit elements (one LDG.128 / STG.128 each).
// `i` is an element offset; the two-argument forms read/write at p itself.
template <typename T> struct PkVec16 {
    static constexpr int N = 8;
    static __device__ __forceinline__ void load(const T* p, long long i, float* f) {
        const uint4 u = *reinterpret_cast<const uint4*>(p + i);
        Pk16<T>::widen2(u.x, f[0], f[1]);
        Pk16<T>::widen2(u.y, f[2], f[3]);
        Pk16<T>::widen2(u.z, f[4], f[5]);
        Pk16<T>::widen2(u.w, f[6], f[7]);
    }
    static __device__ __forceinline__ void store(T* p, long long i, const float* f) {
        uint4 u;
        u.x = Pk16<T>::narrow2(f[0], f[1]);
        u.y = Pk16<T>::narrow2(f[2], f[3]);
        u.z = Pk16<T>::narrow2(f[4], f[5]);
        u.w = Pk16<T>::narrow2(f[6], f[7]);
        *reinterpret_cast<uint4*>(p + i) = u;
    }
    static __device__ __forceinline__ void load(const T* p, float* f) { load(p, 0, f); }
    static __device__ __forceinline__ void store(T* p, const float* f) { store(p, 0, f); }
};
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
    static __device__ __forceinline__ void load(const float* p, float* f) { load(p, 0, f); }
    static __device__ __forceinline__ void store(float* p, const float* f) { store(p, 0, f); }
};

// True when 16-byte vectors starting at p are aligned.
__device__ __forceinline__ bool pk_aligned16(const void* p) { return (((unsigned long long)p) & 15ull) == 0ull; }

// True when 4-element vectors starting at p are naturally aligned.
template <typename T>
__device__ __forceinline__ bool pk_vec_aligned(const T* p) {
    return (((unsigned long long)p) & (unsigned long long)(4 * sizeof(T) - 1)) == 0ull;
}
