// Shared device helpers for every kernels_cu/*.cu file.
//
// The NVRTC wheel ships no cuda_bf16.h / cuda_fp16.h, so the 16-bit floats travel as raw 16-bit words and
// are widened/narrowed here (hardware conversions through pk_ptx.cuh). The same text is compiled by the
// host backend against pykern's CUDA emulation header.
#pragma once
#include "pk_ptx.cuh"

// ---------------------------------------------------------------------------------------------------------
// One source per kernel family, three element types.
//
// A family's body is a `template <typename T> __device__` function `<name>_impl`, where T is the I/O element
// type: float, __nv_bfloat16 or __half. Those two are 2-byte structs of raw bits defined here (the names
// CUDA's headers use, so the registry's C types and a reader's expectations match; no cuda_fp16.h exists
// to clash with). They are distinct types, so templates specialize on them and a pointer to one is not a
// pointer to the other: pykern.ctypes_ lets a `__half*` take float16 (or uint16) arrays only and a
// `__nv_bfloat16*` bfloat16 (or uint16) only. Older kernels that spell bf16 as `unsigned short` still work:
// the traits below treat `unsigned short` as bf16 words.
//
// The entry points stay `extern "C"` symbols, because the registry, the host backend, the fake driver,
// precompile and the SASS tools all key on symbol names and typed signatures. One macro call per family
// makes them:
//     PK_IO_KERNELS(rms_norm, (1024), (const T* x, const T* weight, T* out, ...), (x, weight, out, ...))
// defines rms_norm (T = float), rms_norm_bf16 (T = __nv_bfloat16) and rms_norm_f16 (T = __half), each a
// kernel with those parameters that calls rms_norm_impl<T>(x, weight, out, ...); PK_IO16_KERNELS makes only
// the two 16-bit ones. Each kernel sits in its own namespace where T names its element type (an extern "C"
// function keeps its plain symbol name inside a namespace) and a using-declaration brings it back to the
// global scope. pykern/registry.py reads these calls (IO_INSTANTIATIONS there lists the same suffixes and
// types): keep the call on one logical statement starting a line, with the four arguments parenthesized.
// Accumulation is fp32 for every T.
// A family with compile-time variants (a head_dim bucket, a softcap flag) names each variant's impl with
//     PK_IO_VARIANT(attention_fwd_fma_d64_softcap, flash_attention_body, 64, 32, true)
// (attention_fwd_fma_d64_softcap_impl<T>(args...) calls flash_attention_body<T, 64, 32, true>(args...)), then
// instantiates it with PK_IO_KERNELS(attention_fwd_fma_d64_softcap, ...) as above.
// ---------------------------------------------------------------------------------------------------------
struct alignas(2) __nv_bfloat16 {
    unsigned short bits;
};
struct alignas(2) __half {
    unsigned short bits;
};

#define PK_IO_KERNEL_ONE(name, sym, TT, bounds, params, args)                                     \
    namespace pk_io_##sym {                                                                        \
    typedef TT T;                                                                                  \
    typedef TT TKS;                                                                                \
    extern "C" __global__ void __launch_bounds__ bounds sym params { name##_impl<T> args; }        \
    }                                                                                              \
    using pk_io_##sym::sym;
#define PK_IO16_KERNELS(name, bounds, params, args)                                                \
    PK_IO_KERNEL_ONE(name, name##_bf16, __nv_bfloat16, bounds, params, args)                       \
    PK_IO_KERNEL_ONE(name, name##_f16, __half, bounds, params, args)
#define PK_IO_KERNELS(name, bounds, params, args)                                                  \
    PK_IO_KERNEL_ONE(name, name, float, bounds, params, args)                                      \
    PK_IO16_KERNELS(name, bounds, params, args)
// Families over a query/output type T and a separate K/V cache element type TK (kernels_cu/paged.cu): the
// kernel calls name_impl<T, TK>(args...), and its parameters spell the cache pointers with TKS, TK's storage
// type (an FP8 cache travels as bytes; PkE4M3 / PkE5M2 are pk_attn_tile.cuh's tags). In PK_IO_KERNELS /
// PK_IO16_KERNELS families TKS is T, so one parameter list serves both. pykern/registry.py's
// KV_INSTANTIATIONS lists the same suffixes and types.
// FP8 cache elements (one byte; the kernels' parameters are unsigned char, cast to these tags).
struct PkE4M3 { unsigned char b; };
struct PkE5M2 { unsigned char b; };
#define PK_KV_KERNEL_ONE(name, sym, TT, KK, KS, bounds, params, args)                              \
    namespace pk_io_##sym {                                                                        \
    typedef TT T;                                                                                  \
    typedef KK TK;                                                                                 \
    typedef KS TKS;                                                                                \
    extern "C" __global__ void __launch_bounds__ bounds sym params { name##_impl<T, TK> args; }    \
    }                                                                                              \
    using pk_io_##sym::sym;
// f32 queries over a 16-bit cache: name_bf16kv, name_f16kv.
#define PK_KV16_KERNELS(name, bounds, params, args)                                                \
    PK_KV_KERNEL_ONE(name, name##_bf16kv, float, __nv_bfloat16, __nv_bfloat16, bounds, params, args) \
    PK_KV_KERNEL_ONE(name, name##_f16kv, float, __half, __half, bounds, params, args)
// Every query type over an FP8 cache: name{,_bf16,_f16}_{e4m3,e5m2}##tail (tail: kv or nothing).
#define PK_FP8_KERNELS_TAIL(name, tail, bounds, params, args)                                      \
    PK_KV_KERNEL_ONE(name, name##_e4m3##tail, float, PkE4M3, unsigned char, bounds, params, args)   \
    PK_KV_KERNEL_ONE(name, name##_e5m2##tail, float, PkE5M2, unsigned char, bounds, params, args)   \
    PK_KV_KERNEL_ONE(name, name##_bf16_e4m3##tail, __nv_bfloat16, PkE4M3, unsigned char, bounds, params, args) \
    PK_KV_KERNEL_ONE(name, name##_bf16_e5m2##tail, __nv_bfloat16, PkE5M2, unsigned char, bounds, params, args) \
    PK_KV_KERNEL_ONE(name, name##_f16_e4m3##tail, __half, PkE4M3, unsigned char, bounds, params, args) \
    PK_KV_KERNEL_ONE(name, name##_f16_e5m2##tail, __half, PkE5M2, unsigned char, bounds, params, args)
#define PK_FP8KV_KERNELS(name, bounds, params, args) PK_FP8_KERNELS_TAIL(name, kv, bounds, params, args)
// 16-bit queries only over an FP8 cache: name_{bf16,f16}_{e4m3,e5m2}kv (kernels whose tensor cores take the
// query type: the cache is widened to it).
#define PK_FP8KV16_KERNELS(name, bounds, params, args)                                              \
    PK_KV_KERNEL_ONE(name, name##_bf16_e4m3kv, __nv_bfloat16, PkE4M3, unsigned char, bounds, params, args) \
    PK_KV_KERNEL_ONE(name, name##_bf16_e5m2kv, __nv_bfloat16, PkE5M2, unsigned char, bounds, params, args) \
    PK_KV_KERNEL_ONE(name, name##_f16_e4m3kv, __half, PkE4M3, unsigned char, bounds, params, args)         \
    PK_KV_KERNEL_ONE(name, name##_f16_e5m2kv, __half, PkE5M2, unsigned char, bounds, params, args)
#define PK_FP8_KERNELS(name, bounds, params, args) PK_FP8_KERNELS_TAIL(name, , bounds, params, args)
#define PK_IO_VARIANT(name, body, ...)                                                             \
    template <typename T, typename... PkA>                                                         \
    __device__ __forceinline__ void name##_impl(PkA... a) { body<T, __VA_ARGS__>(a...); }

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

// f16 <-> fp32: hardware conversions (cvt.f32.f16 -> HADD2.F32; cvt.rn.f16x2.f32 -> F2FP.F16.F32.PACK_AB
// on sm_80+); the host backend emulates them bit for bit (tests/test_f16_narrow.py).
__device__ __forceinline__ float pk_f16_to_float(unsigned short h) { return pk_cvt_f32_f16(h); }
__device__ __forceinline__ unsigned int pk_float2_to_f16x2(float lo, float hi) { return pk_cvt_f16x2(lo, hi); }
__device__ __forceinline__ unsigned short pk_float_to_f16(float f) {
    return (unsigned short)(pk_cvt_f16x2(f, 0.0f) & 0xffffu);
}

// Raw-word traits of the 16-bit element types: widen one word, widen the two halves of a 32-bit word
// (little endian: the low half is the earlier element), narrow one value, narrow a pair into one word.
template <typename T> struct Pk16;
template <> struct Pk16<unsigned short> {  // bf16 as raw words (the older kernels' spelling)
    static constexpr bool is_f16 = false;
    static __device__ __forceinline__ float widen(unsigned short h) { return pk_bf16_to_float(h); }
    static __device__ __forceinline__ void widen2(unsigned int w, float& lo, float& hi) {
        lo = __int_as_float((int)(w << 16));
        hi = __int_as_float((int)(w & 0xffff0000u));
    }
    static __device__ __forceinline__ unsigned short narrow(float f) { return pk_float_to_bf16(f); }
    static __device__ __forceinline__ unsigned int narrow2(float lo, float hi) { return pk_float2_to_bf16x2(lo, hi); }
};
template <> struct Pk16<__nv_bfloat16> : Pk16<unsigned short> {};
template <> struct Pk16<__half> {
    static constexpr bool is_f16 = true;
    static __device__ __forceinline__ float widen(unsigned short h) { return pk_f16_to_float(h); }
    static __device__ __forceinline__ void widen2(unsigned int w, float& lo, float& hi) {
        lo = pk_f16_to_float((unsigned short)(w & 0xffffu));
        hi = pk_f16_to_float((unsigned short)(w >> 16));
    }
    static __device__ __forceinline__ unsigned short narrow(float f) { return pk_float_to_f16(f); }
    static __device__ __forceinline__ unsigned int narrow2(float lo, float hi) { return pk_float2_to_f16x2(lo, hi); }
};

// mma.sync m16n8k16, fp32 accumulation, on 16-bit elements of type T (__nv_bfloat16, __half, or bf16 as
// unsigned short): pk_mma_m16n8k16_bf16 / _f16 of pk_ptx.cuh, which share one fragment layout, so a
// tensor-core kernel is written once over T. Only a kernel that calls it needs sm_80.
template <typename T>
__device__ __forceinline__ void pk_mma_m16n8k16(float* d, const unsigned int* a, const unsigned int* b,
                                                const float* c) {
    if constexpr (Pk16<T>::is_f16) pk_mma_m16n8k16_f16(d, a, b, c);
    else pk_mma_m16n8k16_bf16(d, a, b, c);
}

// Element load/store widened to fp32, so one templated kernel body serves every element type.
template <typename T> struct PkIO {
    static __device__ __forceinline__ float load(const T* p, long long i) {
        return Pk16<T>::widen(reinterpret_cast<const unsigned short*>(p)[i]);
    }
    static __device__ __forceinline__ void store(T* p, long long i, float v) {
        reinterpret_cast<unsigned short*>(p)[i] = Pk16<T>::narrow(v);
    }
};
template <> struct PkIO<float> {
    static __device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
    static __device__ __forceinline__ void store(float* p, long long i, float v) { p[i] = v; }
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

// Block-wide sum (MAX false) or max (MAX true) for blockDim.x a multiple of 32 (<= 1024), every thread of the
// block must call it. `scratch` holds >= 32 floats of shared memory. The result
// is returned to every thread. The trailing barrier is what makes it safe to
// call again with the same scratch: without it a fast warp could overwrite
// scratch[0] before a slow warp has read it (tests/host_kernels/emu.cu's pk_t_race
// reproduces that race, and the host backend's racecheck reports it).
template <bool MAX>
__device__ __forceinline__ float pk_block_reduce(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    v = MAX ? pk_warp_max(v) : pk_warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < n_warps) ? scratch[lane] : (MAX ? PK_NEG_INF : 0.0f);
    v = MAX ? pk_warp_max(v) : pk_warp_sum(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float pk_block_sum(float v, float* scratch) { return pk_block_reduce<false>(v, scratch); }

// The RMS norm backwards' row statistics from this thread's sums over the row's n elements of h^2 (ss) and
// h * w * grad_y (dot), block-wide: r = rsqrt(mean(h^2) + eps), written to rstd[row] by thread 0, and the
// returned r^3 * mean(h * w * grad_y) (grad_h = r * w * grad_y - h * that). n comes converted by the caller.
__device__ __forceinline__ float pk_rms_bwd_stats(float ss, float dot, float n, float eps, float* scratch,
                                                  float* __restrict__ rstd, long long row, float& r) {
    ss = pk_block_sum(ss, scratch);
    dot = pk_block_sum(dot, scratch);
    r = rsqrtf(ss / n + eps);
    const float coef = r * r * r * dot / n;
    if (threadIdx.x == 0) rstd[row] = r;
    return coef;
}

// Sum over the threads sharing a row: a warp when blockDim.x == 32 (a warp per row, blockDim.y rows a
// block), else the whole block (blockDim.y == 1).
__device__ __forceinline__ float pk_row_sum(float v, float* scratch) {
    return blockDim.x == 32 ? pk_warp_sum(v) : pk_block_sum(v, scratch);
}

__device__ __forceinline__ float pk_block_max(float v, float* scratch) { return pk_block_reduce<true>(v, scratch); }

// ---------------------------------------------------------------------------------------------------------
// GELU, tanh form: gelu(x) = 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3).

// The tanh form without tanhf (~25 issued instructions an element, MUFU.RCP among them, the range selects). It
// needs only 0.5 (1 + t) and 1 - t^2, t = tanh(u), which are the logistic function of 2u and its derivative:
//   s = 0.5 (1 + tanh u) = 1 / (1 + 2^(-2u log2 e)),   0.5 (1 - t^2) = 2 s (1 - s),   1 - s = 2^(-2u log2 e) s,
// one MUFU.EX2 and one MUFU.RCP (__fdividef). t itself is never formed, so nothing cancels near u = 0 (the
// 1 - 2 / (1 + e^2u) form of t would) and gelu = x s keeps its relative accuracy in the x < 0 tail. Large |u|:
// 2^(-2u log2 e) is 0 (s = 1) or +inf (s = 0, gelu(-inf) = -inf * 0 = NaN as torch's); 1 - s = min(E s, 1) is
// 1 there instead of inf * 0. tests/test_norm_act_loss.py::test_gelu_tanh_form_error_against_float64 holds
// the error over a dense sweep. Here because norm_act_loss.cu's gelu and pk_moe_act.cuh's MoE activation (moe.cu,
// grouped_gemm_sm90.cu) both use it.
#define PK_GELU_TANH_K0 -2.3022081981443250f  // -2 sqrt(2/pi) log2(e): 2^(x (K0 + K1 x^2)) = e^(-2u)
#define PK_GELU_TANH_K1 -0.10294323958002350f // K0 * 0.044715
#define PK_GELU_TANH_D0 1.5957691216057308f   // 2 sqrt(2/pi) = d(2u)/dx at x = 0
#define PK_GELU_TANH_D1 0.21406444881780076f  // 2 sqrt(2/pi) * 3 * 0.044715

// s of the tanh form at x; *e (when given) gets 2^(-2u log2 e) and *x2 x^2 clamped to 1e4: past |x| = 100 the
// ex2 argument is beyond +-1e5 either way (s is 0 or 1), and the derivative's 1 + 3 * 0.044715 x^2 stays finite
// (x^2 = inf from |x| > 1.8e19 would make its 0 term inf * 0 = NaN).
__device__ __forceinline__ float pk_gelu_tanh_s(float x, float* e = nullptr, float* x2 = nullptr) {
    const float xx = fminf(x * x, 1e4f);
    const float ex = pk_ex2_approx(x * fmaf(PK_GELU_TANH_K1, xx, PK_GELU_TANH_K0));
    if (e) *e = ex;
    if (x2) *x2 = xx;
    return __fdividef(1.0f, 1.0f + ex);
}

// gelu'(x) of the tanh form from the same s: gelu' = s + x s (1 - s) d(2u)/dx; *value (when given) gets
// gelu(x) = x s.
__device__ __forceinline__ float pk_gelu_tanh_grad(float x, float* value = nullptr) {
    float e, x2;
    const float s = pk_gelu_tanh_s(x, &e, &x2);
    const float xs = x * s;
    if (value) *value = xs;
    return fmaf(xs * fminf(e * s, 1.0f), fmaf(PK_GELU_TANH_D1, x2, PK_GELU_TANH_D0), s);
}

// 2^x on the FMA pipe (no MUFU): a kernel whose exp2s outnumber what the special-function unit issues (16
// results a clock per SM against 128 FMAs) evaluates part of them here instead. x is clamped to [-127, 127]
// first (fminf then fmaxf: NaN becomes 127, so a NaN or +inf input gives 2^127, finite and huge, never a value a
// caller could mistake for a small one; -inf gives +0). Then x = n + f with n = floor(x) from one add rounded
// toward -inf (x + 1.5 * 2^23 keeps n in the low mantissa bits of the sum), f = x - n in [0, 1] exactly, 2^f by a
// polynomial of degree DEG (3 or 4, Horner: DEG FFMAs), and 2^n put in by one integer add of n << 23 to its bits
// (an IMAD / LEA). Relative error against exp2 over x in [-126, 127]: 8.6e-5 at DEG 3, 3.0e-6 at DEG 4
// (tests/test_exp2_fma.py); below -126 the result is subnormal or 0 (absolute error < 2^-126; ex2.approx.ftz
// flushes those to 0). The coefficients minimize the maximum relative error of p(f) / 2^f on [0, 1] with p(0) = 1
// (fitted for this helper; rounded to fp32).
template <int DEG = 3>
__device__ __forceinline__ float pk_exp2_fma(float x) {
    static_assert(DEG == 3 || DEG == 4, "pk_exp2_fma: degree 3 or 4");
    constexpr float RND = 12582912.0f;  // 1.5 * 2^23: x + RND in [2^23, 2^24) for |x| <= 2^22, n in its low bits
    x = fmaxf(fminf(x, 127.0f), -127.0f);
    const float xr = pk_fadd_rm(x, RND);  // RND + floor(x), exactly
    const float f = x - (xr - RND);       // both subtractions exact: f = x - floor(x)
    float p;
    if constexpr (DEG == 3) {
        p = fmaf(fmaf(fmaf(0.07706719636917114f, f, 0.22764481604099274f), f, 0.6951168179512024f), f, 1.0f);
    } else {
        p = fmaf(fmaf(fmaf(fmaf(0.013426701538264751f, f, 0.052242446690797806f), f, 0.2412802129983902f), f,
                      0.6930448412895203f),
                 f, 1.0f);
    }
    // (RND + n)'s bits are 0x4B400000 + n, whose low 9 bits shifted up by 23 are n << 23 (mod 2^32): p * 2^n
    return __uint_as_float(__float_as_uint(p) + (__float_as_uint(xr) << 23));
}
