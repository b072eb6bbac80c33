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

// A 16-byte load kept raw (uint4) and its widening done apart: a thread issues all its loads of a row, then
// converts, so the compiler cannot tie each conversion to its own load and leave one load in flight.
template <typename T>
__device__ __forceinline__ uint4 pk_ld16_raw(const T* p, long long i) {
    return *reinterpret_cast<const uint4*>(p + i);
}
template <typename T>
__device__ __forceinline__ void pk_widen16(const uint4& u, float* f) {
    if constexpr (PkVec16<T>::N == 4) {
        f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y); f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
    } else {
        Pk16<T>::widen2(u.x, f[0], f[1]);
        Pk16<T>::widen2(u.y, f[2], f[3]);
        Pk16<T>::widen2(u.z, f[4], f[5]);
        Pk16<T>::widen2(u.w, f[6], f[7]);
    }
}
// Two tensors' rows read as S 16-byte chunks per thread into a and b: all 2 S loads issued before the first
// conversion, with no branch between them (see pk_ld16_raw). off(sl) is chunk sl's element offset, which the
// caller keeps in bounds (a chunk past the row loads chunk 0 again, unused). One copy for the row kernels
// that cache two tensors (rms_norm's x and weight, the backward's x and grad, softmax_backward's probs and grad).
template <typename T, int S, typename Off>
__device__ __forceinline__ void pk_ld2_widen16(const T* p, const T* q, Off off, float (&a)[S][PkVec16<T>::N],
                                               float (&b)[S][PkVec16<T>::N]) {
    uint4 ra[S], rb[S];
#pragma unroll
    for (int sl = 0; sl < S; ++sl) {
        const long long j = off(sl);
        ra[sl] = pk_ld16_raw(p, j);
        rb[sl] = pk_ld16_raw(q, j);
    }
#pragma unroll
    for (int sl = 0; sl < S; ++sl) pk_widen16<T>(ra[sl], a[sl]), pk_widen16<T>(rb[sl], b[sl]);
}

// True when 16-byte vectors starting at p are aligned.
__device__ __forceinline__ bool pk_aligned16(const void* p) { return (((unsigned long long)p) & 15ull) == 0ull; }

// True when 4-element vectors starting at p are naturally aligned.
template <typename T>
__device__ __forceinline__ bool pk_vec_aligned(const T* p) {
    return (((unsigned long long)p) & (unsigned long long)(4 * sizeof(T) - 1)) == 0ull;
}

// ---------------------------------------------------------------------------------------------------------
// Chunked loops whose body is written once for the 16-byte path and the element path. The body is a generic
// lambda `[&](long long i, auto w)` with W = decltype(w)::value elements starting at i: W = PkVec16<T>::N
// (one LDG.128 / STG.128 per array) on the vector path, 1 on the element path. pk_load / pk_store move W
// elements of T widened to / narrowed from fp32.
template <int W> struct PkWidth {
    static constexpr int value = W;
};

template <typename T, int W>
__device__ __forceinline__ void pk_load(const T* p, long long i, float* f) {
    if constexpr (W == 1) f[0] = PkIO<T>::load(p, i);
    else PkVec16<T>::load(p, i, f);
}

template <typename T, int W>
__device__ __forceinline__ void pk_store(T* p, long long i, const float* f) {
    if constexpr (W == 1) PkIO<T>::store(p, i, f[0]);
    else PkVec16<T>::store(p, i, f);
}

// This thread's chunks of a row [0, n) shared by the block's blockDim.x threads: 16-byte chunks when `vec`
// (n a multiple of PkVec16<T>::N and every row base 16-byte aligned: the caller checks), else elements.
template <typename T, typename F>
__device__ __forceinline__ void pk_row_chunks(bool vec, long long n, F&& body) {
    constexpr int N = PkVec16<T>::N;
    if (vec) {
        for (long long i = (long long)N * threadIdx.x; i < n; i += (long long)N * blockDim.x) body(i, PkWidth<N>());
    } else {
        for (long long i = threadIdx.x; i < n; i += blockDim.x) body(i, PkWidth<1>());
    }
}

// One call of f for the 16-byte path or the element path, chosen at run time: f(PkWidth<PkVec16<T>::N>()) when
// `vec` (the caller checks length and alignment), else f(PkWidth<1>()). A row kernel names its row function and
// arguments once, in a generic lambda, instead of once per width.
template <typename T, typename F>
__device__ __forceinline__ void pk_vec_or_elem(bool vec, F&& f) {
    if (vec) f(PkWidth<PkVec16<T>::N>());
    else f(PkWidth<1>());
}

// Grid-stride elementwise loop over [0, n): 16-byte chunks when `vec` (every base 16-byte aligned), then
// the scalar tail past the last whole chunk (everything when not `vec`).
template <typename T, typename F>
__device__ __forceinline__ void pk_grid_chunks(bool vec, long long n, F&& body) {
    constexpr int N = PkVec16<T>::N;
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (vec) {
        const long long n_vec = n / N;
        for (long long v = t0; v < n_vec; v += step) body(v * N, PkWidth<N>());
        done = n_vec * N;
    }
    for (long long i = done + t0; i < n; i += step) body(i, PkWidth<1>());
}
