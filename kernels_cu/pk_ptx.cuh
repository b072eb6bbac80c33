// The only door from a kernels_cu/*.cu file to inline PTX.
//
// Each wrapper is a few lines of `asm` under NVRTC and an emulation under the host
// backend (pykern/host/pk_cuda_host.h + pk_host_runtime.cpp), so the same kernel text
// runs on both. The host backend refuses raw `asm` in kernels: add a wrapper here.
//
// Warp-wide instructions (mma.sync, ldmatrix) are warp meeting points on the host:
// every lane deposits its fragment registers / row address, the last lane to arrive
// computes the whole warp's result, and each lane picks up its own registers.
//
// Fragment layouts (lane = threadIdx.x % 32, g = lane / 4, t = lane % 4), from the
// PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type" and
// "Warp-level matrix load instruction: ldmatrix"):
//   A (16x16, row-major), 4 x .b32 = 8 bf16 a0..a7, a[2i] in the low half of reg i:
//     a_v: row = g + 8*((v>>1)&1), col = 2*t + (v&1) + 8*(v>>2)
//   B (16x8, K x N, "col"), 2 x .b32 = 4 bf16 b0..b3:
//     b_v: k = 2*t + (v&1) + 8*(v>>1), n = g
//   C/D (16x8 fp32), 4 floats c0..c3:
//     c_v: row = g + 8*(v>>1), col = 2*t + (v&1)
//   ldmatrix .x4 (four 8x8 b16 matrices): lanes 8i..8i+7 give the row addresses of
//     matrix i (lane 8i+r -> row r, 16 contiguous bytes, 16-byte aligned); every lane
//     receives in reg i the elements (row g, cols 2t, 2t+1) of matrix i, low half first.
//     .trans: reg i holds (rows 2t, 2t+1 ; col g) of matrix i as stored (its transpose).
// Cross-checked against CUTLASS/CuTe (read, not copied): cute/atom/mma_traits_sm80.hpp,
// SM80_16x8x16_F32BF16BF16F32_TN (inherits the F16 16x8x16 ALayout/BLayout and
// SM80_16x8_Row CLayout), and cute/atom/copy_traits_sm75.hpp SM75_U32x4_LDSM_N /
// SM75_U16x8_LDSM_T. Decoding their (thread, value) -> column-major index layouts gives
// exactly the tables above: the PTX ISA and CuTe agree.
//
// Architectures: ldmatrix, ex2.approx and cvt .f16 exist from sm_75; mma .bf16, cvt .bf16x2, cvt .f16x2
// and cp.async need sm_80. On sm_75 cvt and cp.async fall back to plain code (cp.async
// becomes a synchronous 16-byte copy) and pk_mma_m16n8k16_bf16 is a compile error.
#pragma once

#if defined(PYKERN_HOST)
// ---------------------------------------------------------------------------------
// Host backend: emulations (the meeting points live in pk_host_runtime.cpp).

// fp32 -> bf16, round to nearest even; any NaN becomes the canonical NaN 0x7fff, as
// cvt.rn.bf16x2.f32 produces (and as CUDA's own host emulation of it does).
__device__ __forceinline__ unsigned short pk_host_cvt_bf16_rn(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// {hi, lo} packed: `lo` in bits 0..15, `hi` in bits 16..31 (cvt's operand a is hi).
__device__ __forceinline__ unsigned int pk_cvt_bf16x2(float lo, float hi) {
    return (unsigned int)pk_host_cvt_bf16_rn(lo) | ((unsigned int)pk_host_cvt_bf16_rn(hi) << 16);
}

// fp32 -> f16, round to nearest even, as cvt.rn.f16x2.f32 / cvt.rn.f16.f32: beyond 65504 (from 65520,
// the tie above the largest finite value) to +-inf, subnormals kept (no .ftz), any NaN -> the canonical
// NaN 0x7fff (what the hardware and CUDA's own host emulation in cuda_fp16.hpp produce).
__device__ __forceinline__ unsigned short pk_host_cvt_f16_rn(float f) {
    unsigned int x;
    memcpy(&x, &f, 4);
    const unsigned int sign = (x >> 16) & 0x8000u, u = x & 0x7fffffffu;
    if (u > 0x7f800000u) return 0x7fffu;
    if (u >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 (and inf): inf
    if (u >= 0x38800000u) {  // normal f16: rebias the exponent, round away 13 mantissa bits
        const unsigned int v = u - 0x38000000u;
        return (unsigned short)(sign | ((v + 0xfffu + ((v >> 13) & 1u)) >> 13));
    }
    if (u <= 0x33000000u) return (unsigned short)sign;  // <= 2^-25 (a tie with 0): +-0
    // subnormal f16: the value in units of 2^-24, rounded to nearest even
    const unsigned int shift = 126u - (u >> 23), m = (u & 0x7fffffu) | 0x800000u;
    unsigned int r = m >> shift;
    const unsigned int rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;  // may carry into the smallest normal: right
    return (unsigned short)(sign | r);
}

// {hi, lo} packed: `lo` in bits 0..15, `hi` in bits 16..31 (cvt's operand a is hi).
__device__ __forceinline__ unsigned int pk_cvt_f16x2(float lo, float hi) {
    return (unsigned int)pk_host_cvt_f16_rn(lo) | ((unsigned int)pk_host_cvt_f16_rn(hi) << 16);
}

// f16 -> fp32, exact (cvt.f32.f16); a NaN widens to the canonical 0x7fffffff, as cuda_fp16.hpp's host
// emulation does (no output depends on a NaN's payload: every narrowing makes it 0x7fff again).
__device__ __forceinline__ float pk_cvt_f32_f16(unsigned short h) {
    const unsigned int sign = ((unsigned int)h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    unsigned int x;
    if (e == 31u) x = m ? 0x7fffffffu : (sign | 0x7f800000u);
    else if (e != 0u) x = sign | ((e + 112u) << 23) | (m << 13);
    else {  // zero or subnormal: m * 2^-24 is exact in fp32
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&x, &f, 4);
        x |= sign;
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}

// D = A * B + C for one warp (every lane of the warp must call it, as on the GPU).
__device__ __forceinline__ void pk_mma_m16n8k16_bf16(float* d, const unsigned int* a, const unsigned int* b,
                                                     const float* c) {
    pkrt_mma_frag f;
    for (int i = 0; i < 4; i++) f.a[i] = a[i], f.c[i] = c[i];
    f.b[0] = b[0];
    f.b[1] = b[1];
    pkrt_ptx_warp(PKRT_PTX_MMA_BF16, &f, __FILE__, __LINE__);
    for (int i = 0; i < 4; i++) d[i] = f.d[i];
}

__device__ __forceinline__ void pk_ldmatrix_x4(unsigned int* r, const void* smem_row) {
    pkrt_ldsm_frag f;
    f.row = smem_row;
    pkrt_ptx_warp(PKRT_PTX_LDSM_X4, &f, __FILE__, __LINE__);
    for (int i = 0; i < 4; i++) r[i] = f.r[i];
}

__device__ __forceinline__ void pk_ldmatrix_x4_trans(unsigned int* r, const void* smem_row) {
    pkrt_ldsm_frag f;
    f.row = smem_row;
    pkrt_ptx_warp(PKRT_PTX_LDSM_X4_T, &f, __FILE__, __LINE__);
    for (int i = 0; i < 4; i++) r[i] = f.r[i];
}

// The copy is deferred to the cp.async wait that covers it (or the thread's exit), the
// latest a GPU may complete it: reading the destination early shows the old bytes.
__device__ __forceinline__ void pk_cp_async_16(void* smem_dst, const void* gmem_src) {
    pkrt_cp_async(smem_dst, gmem_src, 16, __FILE__, __LINE__);
}
__device__ __forceinline__ void pk_cp_async_commit() { pkrt_cp_async_commit(); }
template <int N> __device__ __forceinline__ void pk_cp_async_wait() {
    static_assert(N >= 0 && N <= 7, "pk_cp_async_wait<N>: N is 0..7");
    pkrt_cp_async_wait(N, 0);
}
__device__ __forceinline__ void pk_cp_async_wait_all() { pkrt_cp_async_wait(0, 1); }

// 2^x with ex2.approx.ftz.f32's special cases: subnormal inputs count as 0 (result 1),
// subnormal results flush to +0, -inf -> +0, +inf -> +inf, NaN -> NaN.
__device__ __forceinline__ float pk_ex2_approx(float x) {
    if (x != 0.0f && fabsf(x) < FLT_MIN) x = 0.0f;
    float r = exp2f(x);
    if (r < FLT_MIN) r = 0.0f;
    return r;
}

#else
// ---------------------------------------------------------------------------------
// NVRTC: inline PTX.

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
#error "pk_ptx.cuh needs sm_75 or newer"
#endif

__device__ __forceinline__ unsigned int pk_cvta_shared(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ unsigned int pk_cvt_bf16x2(float lo, float hi) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    unsigned int d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
#else
    // sm_75 has no bf16 conversion instruction: the same rounding in integer code.
    unsigned int ul = __float_as_uint(lo), uh = __float_as_uint(hi);
    ul = ((ul & 0x7fffffffu) > 0x7f800000u) ? 0x7fffu : ((ul + 0x7fffu + ((ul >> 16) & 1u)) >> 16);
    uh = ((uh & 0x7fffffffu) > 0x7f800000u) ? 0x7fffu : ((uh + 0x7fffu + ((uh >> 16) & 1u)) >> 16);
    return ul | (uh << 16);
#endif
}

// fp32 pair -> two f16 in one word (round to nearest even, inf beyond 65504, subnormals kept, NaN ->
// 0x7fff): one cvt.rn.f16x2.f32 (F2FP.F16.F32.PACK_AB) on sm_80+, two cvt.rn.f16.f32 on sm_75.
__device__ __forceinline__ unsigned int pk_cvt_f16x2(float lo, float hi) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    unsigned int d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
#else
    unsigned short l, h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(l) : "f"(lo));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(hi));
    return (unsigned int)l | ((unsigned int)h << 16);
#endif
}

// f16 -> fp32, exact: cvt.f32.f16 (HADD2.F32 on sm_80+).
__device__ __forceinline__ float pk_cvt_f32_f16(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__device__ __forceinline__ void pk_mma_m16n8k16_bf16(float* d, const unsigned int* a, const unsigned int* b,
                                                     const float* c) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}
#else
// A template so that only a kernel that calls it fails to compile for sm_75.
template <typename PkArchT = void>
__device__ __forceinline__ void pk_mma_m16n8k16_bf16(float*, const unsigned int*, const unsigned int*, const float*) {
    static_assert(sizeof(PkArchT) == 0, "pk_mma_m16n8k16_bf16 (mma .bf16) needs sm_80 or newer");
}
#endif

__device__ __forceinline__ void pk_ldmatrix_x4(unsigned int* r, const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pk_cvta_shared(smem_row))
                 : "memory");
}

__device__ __forceinline__ void pk_ldmatrix_x4_trans(unsigned int* r, const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pk_cvta_shared(smem_row))
                 : "memory");
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__device__ __forceinline__ void pk_cp_async_16(void* smem_dst, const void* gmem_src) {
    unsigned long long g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(gmem_src));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(pk_cvta_shared(smem_dst)), "l"(g) : "memory");
}
__device__ __forceinline__ void pk_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void pk_cp_async_wait() {
    static_assert(N >= 0 && N <= 7, "pk_cp_async_wait<N>: N is 0..7");
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void pk_cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
#else
// sm_75: no cp.async; a synchronous copy is a legal (if slower) completion of it.
__device__ __forceinline__ void pk_cp_async_16(void* smem_dst, const void* gmem_src) {
    *reinterpret_cast<uint4*>(smem_dst) = *reinterpret_cast<const uint4*>(gmem_src);
}
__device__ __forceinline__ void pk_cp_async_commit() {}
template <int N> __device__ __forceinline__ void pk_cp_async_wait() {}
__device__ __forceinline__ void pk_cp_async_wait_all() {}
#endif

__device__ __forceinline__ float pk_ex2_approx(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

#endif
