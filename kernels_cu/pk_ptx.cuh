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
// Architectures: ldmatrix and ex2.approx exist from sm_75; mma .bf16, cvt .bf16x2 and
// cp.async need sm_80. On sm_75 cvt and cp.async fall back to plain code (cp.async
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

// Shared-memory addressing as a base plus a 32-bit byte offset (see the NVRTC versions below).
__device__ __forceinline__ void pk_ldmatrix_x4_at(unsigned int* r, const void* smem_base, unsigned int byte_off) {
    pk_ldmatrix_x4(r, static_cast<const char*>(smem_base) + byte_off);
}
__device__ __forceinline__ void pk_ldmatrix_x4_trans_at(unsigned int* r, const void* smem_base, unsigned int byte_off) {
    pk_ldmatrix_x4_trans(r, static_cast<const char*>(smem_base) + byte_off);
}
__device__ __forceinline__ void pk_cp_async_16_at(void* smem_base, unsigned int byte_off, const void* gmem_src) {
    pk_cp_async_16(static_cast<char*>(smem_base) + byte_off, gmem_src);
}

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

// Base + 32-bit byte offset: the base's cvta is loop-invariant (the asm is not volatile, so it is
// hoisted and shared), and the offsets stay 32-bit shared-window arithmetic that folds into the
// instructions' immediates; a generic pointer per access costs 64-bit address math in hot loops.
__device__ __forceinline__ void pk_ldmatrix_x4_at(unsigned int* r, const void* smem_base, unsigned int byte_off) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pk_cvta_shared(smem_base) + byte_off)
                 : "memory");
}
__device__ __forceinline__ void pk_ldmatrix_x4_trans_at(unsigned int* r, const void* smem_base, unsigned int byte_off) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pk_cvta_shared(smem_base) + byte_off)
                 : "memory");
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__device__ __forceinline__ void pk_cp_async_16(void* smem_dst, const void* gmem_src) {
    unsigned long long g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(gmem_src));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(pk_cvta_shared(smem_dst)), "l"(g) : "memory");
}
__device__ __forceinline__ void pk_cp_async_16_at(void* smem_base, unsigned int byte_off, const void* gmem_src) {
    unsigned long long g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(gmem_src));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(pk_cvta_shared(smem_base) + byte_off), "l"(g)
                 : "memory");
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
__device__ __forceinline__ void pk_cp_async_16_at(void* smem_base, unsigned int byte_off, const void* gmem_src) {
    pk_cp_async_16(static_cast<char*>(smem_base) + byte_off, gmem_src);
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

// ---------------------------------------------------------------------------------
// FP8 (float8_e4m3fn, float8_e5m2) conversions, the KV-cache formats (vLLM's semantics).
//
// Narrowing: round to nearest even and saturate to the finite range (e4m3fn max 448, e5m2
// max 57344; inf saturates too); NaN stays NaN (e4m3fn 0x7f, e5m2 0x7e | the top 2 mantissa
// bits, with its sign), as cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 and CUDA's cuda_fp8.hpp do,
// and as ml_dtypes does on an input already clipped to the finite range.
// Widening is exact (every fp8 value is an fp16 and an fp32 value).
// Hardware: cvt.rn.satfinite.<f8x2>.f32 (a -> upper byte, b -> lower byte) and
// cvt.rn.f16x2.<f8x2> exist from sm_89 (PTX ISA 7.8). Below that, and on the host, the
// integer code here (pk_fp8_sw_*) is the conversion: the host runs the same text the sm_80
// cubin runs. EB/MB: exponent / mantissa bits (4/3 = e4m3fn, 5/2 = e5m2).
template <int EB, int MB>
__device__ __forceinline__ unsigned int pk_fp8_sw_from_f32(float x) {
    const unsigned int u = __float_as_uint(x);
    const unsigned int sign = (u >> 24) & 0x80u;
    const unsigned int a = u & 0x7fffffffu;
    constexpr int BIAS = (1 << (EB - 1)) - 1;
    if (a > 0x7f800000u) return sign | (EB == 4 ? 0x7fu : (0x7eu | ((u >> 21) & 3u)));
    // Saturation: e4m3fn above 448 + half an ulp (464; 464 itself rounds to even 448),
    // e5m2 from 57344 + half an ulp (61440: the tie would round to odd-free 2^16 = inf).
    if (EB == 4 ? a > 0x43e80000u : a >= 0x47700000u) return sign | (EB == 4 ? 0x7eu : 0x7bu);
    const int e = (int)(a >> 23) - 127 + BIAS;  // the target's biased exponent
    unsigned int m = a & 0x7fffffu;
    int shift = 23 - MB;
    unsigned int r;
    if (e >= 1) {
        r = ((unsigned int)e << MB) | (m >> shift);
    } else {  // subnormal target (and zero): the implicit bit joins the shifted-out part
        if ((a >> 23) == 0) return sign;  // fp32 zero / subnormal: far below half the smallest fp8
        m |= 0x800000u;
        shift += 1 - e;
        if (shift > 24) return sign;  // below half the smallest subnormal
        r = m >> shift;
    }
    const unsigned int rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;  // a carry into the exponent is right
    return sign | r;
}

template <int EB, int MB>
__device__ __forceinline__ float pk_fp8_sw_to_f32(unsigned int b) {
    constexpr int BIAS = (1 << (EB - 1)) - 1;
    const unsigned int s = (b & 0x80u) << 24, m = b & 0x7fu;
    unsigned int u;
    if (EB == 4 && m == 0x7fu) {
        u = s | 0x7fc00000u;  // the e4m3fn NaN
    } else if (EB == 5 && m >= 0x7cu) {
        u = s | (m == 0x7cu ? 0x7f800000u : 0x7fc00000u);  // e5m2 inf / NaN
    } else if (m >= (1u << MB)) {  // normal: rebias the exponent
        u = s | ((m << (23 - MB)) + ((unsigned int)(127 - BIAS) << 23));
    } else {  // subnormal: m * 2^(1 - BIAS - MB), exact in fp32
        u = s | __float_as_uint((float)m * (EB == 4 ? 0.001953125f : 1.52587890625e-05f));
    }
    return __uint_as_float(u);
}

#if defined(PYKERN_HOST) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890)
// Two values packed as cvt packs them: lo in bits 0..7, hi in bits 8..15.
__device__ __forceinline__ unsigned short pk_cvt_e4m3x2(float lo, float hi) {
    return (unsigned short)(pk_fp8_sw_from_f32<4, 3>(lo) | (pk_fp8_sw_from_f32<4, 3>(hi) << 8));
}
__device__ __forceinline__ unsigned short pk_cvt_e5m2x2(float lo, float hi) {
    return (unsigned short)(pk_fp8_sw_from_f32<5, 2>(lo) | (pk_fp8_sw_from_f32<5, 2>(hi) << 8));
}
__device__ __forceinline__ void pk_cvt_f32x2_e4m3x2(unsigned short v, float& lo, float& hi) {
    lo = pk_fp8_sw_to_f32<4, 3>(v & 0xffu);
    hi = pk_fp8_sw_to_f32<4, 3>(v >> 8);
}
__device__ __forceinline__ void pk_cvt_f32x2_e5m2x2(unsigned short v, float& lo, float& hi) {
    lo = pk_fp8_sw_to_f32<5, 2>(v & 0xffu);
    hi = pk_fp8_sw_to_f32<5, 2>(v >> 8);
}
#else
__device__ __forceinline__ unsigned short pk_cvt_e4m3x2(float lo, float hi) {
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ unsigned short pk_cvt_e5m2x2(float lo, float hi) {
    unsigned short d;
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}
// fp8x2 -> f16x2 (one instruction), then each half to fp32 (exact).
__device__ __forceinline__ void pk_cvt_f32x2_e4m3x2(unsigned short v, float& lo, float& hi) {
    asm("{ .reg .b32 h; .reg .b16 l, u; cvt.rn.f16x2.e4m3x2 h, %2; mov.b32 {l, u}, h; "
        "cvt.f32.f16 %0, l; cvt.f32.f16 %1, u; }" : "=f"(lo), "=f"(hi) : "h"(v));
}
__device__ __forceinline__ void pk_cvt_f32x2_e5m2x2(unsigned short v, float& lo, float& hi) {
    asm("{ .reg .b32 h; .reg .b16 l, u; cvt.rn.f16x2.e5m2x2 h, %2; mov.b32 {l, u}, h; "
        "cvt.f32.f16 %0, l; cvt.f32.f16 %1, u; }" : "=f"(lo), "=f"(hi) : "h"(v));
}
#endif
