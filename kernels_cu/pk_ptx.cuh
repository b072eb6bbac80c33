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
//   A (16x16, row-major), 4 x .b32 = 8 bf16 (or f16) a0..a7, a[2i] in the low half of reg i:
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
// .f16 inputs (pk_mma_m16n8k16_f16) use the same fragments: the PTX ISA gives one table for .f16 and
// .bf16 in "Matrix Fragments for mma.m16n8k16 with floating point type" (.f16x2 or .b32 registers of two
// elements each), and CuTe's SM80_16x8x16_F32F16F16F32_TN and SM80_16x8x16_F32BF16BF16F32_TN both take
// their layouts from MMA_Traits<SM80_16x8x16_F16F16F16F16_TN> (tests/test_host_ptx.py checks both).
//
// FP8 (pk_mma_m16n8k32_e4m3, mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32, sm_89+): the PTX ISA's
// "Matrix Fragments for mma.m16n8k32" with .e4m3 (.b32 registers of four 8-bit elements, element i in byte
// i & 3 of its register, the lowest-indexed in the lowest byte):
//   A (16x32, row-major), 4 x .b32 = a0..a15 (a_i in register i >> 2):
//     a_i: row = g + 8*((i>>2)&1), col = 4*t + (i&3) + 16*(i>>3)
//   B (32x8, K x N, "col"), 2 x .b32 = b0..b7:  b_i: k = 4*t + (i&3) + 16*(i>>2), n = g
//   C/D: the m16n8k16 table above.
// In bytes these are the .bf16 fragments (a k16 step of 2-byte elements is a k32 step of 1-byte ones), so
// the same ldmatrix .x4 row addresses over a row-major [rows, K] byte tile load A and B. Cross-checked
// against CuTe's cute/atom/mma_traits_sm89.hpp (SM89_16x8x32_F32E4M3E4M3F32_TN: ALayout
// ((4,8),(4,2,2)):((64,1),(16,8,256)), BLayout ((4,8),(4,2)):((32,1),(8,128)), CLayout SM80_16x8_Row; the
// layouts of SM80_16x8x32_S32S8S8S32_TN), which decode to the same tables (tests/test_host_ptx.py).
// Architectures: ldmatrix, ex2.approx and cvt .f16 exist from sm_75; mma .bf16, cvt .bf16x2, cvt .f16x2
// and cp.async need sm_80. On sm_75 cvt and cp.async fall back to plain code (cp.async
// becomes a synchronous 16-byte copy) and pk_mma_m16n8k16_bf16 / _f16 are compile errors (sm_75 has
// mma.m16n8k8 .f16 only; the kernels keep one m16n8k16 shape and use fp32-FMA kernels there).
// mma .e4m3 needs sm_89: pk_mma_m16n8k32_e4m3 is a compile error naming sm_89 below it (a kernel that
// calls it guards its body with __CUDA_ARCH__ >= 890 and traps below; its op refuses those GPUs first).
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

// The same with f16 inputs (widened exactly, fp32 accumulation).
__device__ __forceinline__ void pk_mma_m16n8k16_f16(float* d, const unsigned int* a, const unsigned int* b,
                                                    const float* c) {
    pkrt_mma_frag f;
    for (int i = 0; i < 4; i++) f.a[i] = a[i], f.c[i] = c[i];
    f.b[0] = b[0];
    f.b[1] = b[1];
    pkrt_ptx_warp(PKRT_PTX_MMA_F16, &f, __FILE__, __LINE__);
    for (int i = 0; i < 4; i++) d[i] = f.d[i];
}

// D = A * B + C with e4m3 (float8_e4m3fn) inputs, m16n8k32 (fragments above; a warp meeting point).
__device__ __forceinline__ void pk_mma_m16n8k32_e4m3(float* d, const unsigned int* a, const unsigned int* b,
                                                     const float* c) {
    pkrt_mma_frag f;
    for (int i = 0; i < 4; i++) f.a[i] = a[i], f.c[i] = c[i];
    f.b[0] = b[0];
    f.b[1] = b[1];
    pkrt_ptx_warp(PKRT_PTX_MMA_E4M3, &f, __FILE__, __LINE__);
    for (int i = 0; i < 4; i++) d[i] = f.d[i];
}

// The lane's row is read here, by the lane (a checked build instruments these loads: racecheck orders them
// against other threads' stores like any load); the runtime reports a misaligned row instead of reading it.
__device__ __forceinline__ void pkrt_ldsm_row(pkrt_ldsm_frag& f, const void* smem_row) {
    f.row = smem_row;
    if ((reinterpret_cast<unsigned long long>(smem_row) & 15u) == 0)
        for (int i = 0; i < 4; i++) f.bytes[i] = static_cast<const unsigned int*>(smem_row)[i];
}

__device__ __forceinline__ void pk_ldmatrix_x4(unsigned int* r, const void* smem_row) {
    pkrt_ldsm_frag f;
    pkrt_ldsm_row(f, smem_row);
    pkrt_ptx_warp(PKRT_PTX_LDSM_X4, &f, __FILE__, __LINE__);
    for (int i = 0; i < 4; i++) r[i] = f.r[i];
}

__device__ __forceinline__ void pk_ldmatrix_x4_trans(unsigned int* r, const void* smem_row) {
    pkrt_ldsm_frag f;
    pkrt_ldsm_row(f, smem_row);
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
// The zero-fill form: full copies the 16 bytes, otherwise 16 zero bytes land (gmem_src is not read).
// (file / line: the caller's, for the messages and the 16-byte bank model, which matches the lanes' copies of
// one source line: pykern.backends.host.shared_v4_bank_stats)
__device__ __forceinline__ void pk_cp_async_16_zfill_at(void* smem_base, unsigned int byte_off, const void* gmem_src,
                                                        bool full, const char* file = __builtin_FILE(),
                                                        int line = __builtin_LINE()) {
    alignas(16) static const unsigned char zeros[16] = {};
    pkrt_cp_async(static_cast<char*>(smem_base) + byte_off, full ? gmem_src : zeros, 16, file, line);
}
// ld.shared.v4.f32 (p 16-byte aligned): a plain 16-byte read, recorded by the 16-byte bank model at the caller's
// line (pykern.backends.host.shared_v4_bank_stats).
__device__ __forceinline__ float4 pk_ld_shared_v4(const float* p, const char* file = __builtin_FILE(),
                                                  int line = __builtin_LINE()) {
    pkrt_ld_shared_v4(p, file, line);
    return *reinterpret_cast<const float4*>(p);
}
// The same read of 16 raw bytes (e.g. 8 bf16 / f16 elements staged for a 16-byte global store), into integer
// registers so that no value passes through a float.
__device__ __forceinline__ uint4 pk_ld_shared_b128(const void* p, const char* file = __builtin_FILE(),
                                                   int line = __builtin_LINE()) {
    pkrt_ld_shared_v4(p, file, line);
    return *static_cast<const uint4*>(p);
}

// 2^x with ex2.approx.ftz.f32's special cases: subnormal inputs count as 0 (result 1),
// subnormal results flush to +0, -inf -> +0, +inf -> +inf, NaN -> NaN.
__device__ __forceinline__ float pk_ex2_approx(float x) {
    if (x != 0.0f && fabsf(x) < FLT_MIN) x = 0.0f;
    float r = exp2f(x);
    if (r < FLT_MIN) r = 0.0f;
    return r;
}

// add.rm.f32: a + b rounded toward -inf (ex2 on the FMA pipe takes floor(x) from it: pk_exp2_fma). The sum rounded
// to nearest, then one step down where the exact sum lies below it (TwoSum's exact error term, negative).
__device__ __forceinline__ float pk_fadd_rm(float a, float b) {
    const float r = a + b;
    if (!std::isfinite(r)) return r;
    const float bp = r - a, ap = r - bp, e = (a - ap) + (b - bp);  // a + b == r + e exactly
    return e < 0.0f ? std::nextafter(r, -INFINITY) : r;
}

// ld.relaxed.gpu.global.f32: a strong (atomic, GPU-scope) load. Blocks share one OS thread here, so a plain
// read is that load; it is an atomic access to racecheck (exempt, as atomicAdd & co are), which is what the
// PTX memory model makes it: no data race with a store ordered before it by fence + atomic (see the
// release / acquire pattern of decode_tc.cu's split epilogue).
__device__ __forceinline__ float pk_ld_relaxed_gpu(const float* p) {
    PKRT_ATOMIC_SCOPE;
    return *p;
}
// ld.relaxed.gpu.global.v4.b32 (p 16-byte aligned): 16 bytes (e.g. 8 bf16 / f16 elements) in one strong load,
// as pk_ld_relaxed_gpu: each 32-bit word a relaxed access.
__device__ __forceinline__ uint4 pk_ld_relaxed_gpu_b128(const void* p) {
    PKRT_ATOMIC_SCOPE;
    const unsigned int* w = static_cast<const unsigned int*>(p);
    return make_uint4(w[0], w[1], w[2], w[3]);
}
// st.global.v4.b32 (p 16-byte aligned): 16 bytes in one store; here a plain 16-byte store.
__device__ __forceinline__ void pk_st_global_b128(void* p, uint4 v) { *static_cast<uint4*>(p) = v; }
// prefetch.global.L1: a hint; nothing to do here.
__device__ __forceinline__ void pk_prefetch_l1(const void*) {}
// griddepcontrol.wait / .launch_dependents: launches here run one after another, whole; nothing to wait for.
__device__ __forceinline__ void pk_grid_dependency_wait() {}
__device__ __forceinline__ void pk_grid_launch_dependents() {}
// atom.acq_rel.gpu.global.inc.u32: atomicInc (wraps to 0 past `limit`) with release and acquire semantics at
// GPU scope. One OS thread runs every block here, so it is atomicInc itself (a yield point of the interleaved
// schedule, exempt from racecheck); the ordering it gives on a GPU is what decode_tc.cu's split ticket relies on.
__device__ __forceinline__ unsigned int pk_atom_inc_acq_rel_gpu(unsigned int* p, unsigned int limit) {
    return atomicInc(p, limit);
}
// red.global.add.f32: a float add to global memory that returns nothing (SASS RED.E.ADD.F32). Here atomicAdd itself
// (a yield point of the interleaved schedule, exempt from racecheck): the sum's order follows the block order.
__device__ __forceinline__ void pk_red_add_f32(float* p, float v) { atomicAdd(p, v); }
// Semaphores (a global int per unit of ordered work, e.g. the attention backward's deterministic dQ):
// pk_sem_wait_eq spins with ld.acquire.gpu until *p == v; pk_sem_add_release is red.release.gpu.add. Here the
// wait takes the thread out of the schedule until an add makes *p == v (no spinning); when every resident block
// waits, the launch starts the next block of the schedule in a new slot (up to 8 at once), so the reverse and
// random block orders finish too, and a wait nothing can release is an error naming it.
__device__ __forceinline__ void pk_sem_wait_eq(const int* p, int v, const char* file = __builtin_FILE(),
                                               int line = __builtin_LINE()) {
    PKRT_ATOMIC_SCOPE;
    pkrt_sem_wait(p, v, file, line);
}
__device__ __forceinline__ void pk_sem_add_release(int* p, int v) {
    PKRT_ATOMIC_SCOPE;
    pkrt_sem_add(p, v);
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
// The same through the compiler's intrinsic: it knows a pointer into a __shared__ array as a shared-window
// address, so address arithmetic stays 32-bit (the mbarrier wrappers use it).
__device__ __forceinline__ unsigned int pk_smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

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
__device__ __forceinline__ void pk_mma_m16n8k16_f16(float* d, const unsigned int* a, const unsigned int* b,
                                                    const float* c) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}
#else
// Templates so that only a kernel that calls one fails to compile for sm_75.
template <typename PkArchT = void>
__device__ __forceinline__ void pk_mma_m16n8k16_bf16(float*, const unsigned int*, const unsigned int*, const float*) {
    static_assert(sizeof(PkArchT) == 0, "pk_mma_m16n8k16_bf16 (mma .bf16) needs sm_80 or newer");
}
template <typename PkArchT = void>
__device__ __forceinline__ void pk_mma_m16n8k16_f16(float*, const unsigned int*, const unsigned int*, const float*) {
    static_assert(sizeof(PkArchT) == 0, "pk_mma_m16n8k16_f16 (mma.m16n8k16 .f16) needs sm_80 or newer");
}
#endif

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
__device__ __forceinline__ void pk_mma_m16n8k32_e4m3(float* d, const unsigned int* a, const unsigned int* b,
                                                     const float* c) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}
#else
// A template so that only a kernel that calls it fails to compile below sm_89.
template <typename PkArchT = void>
__device__ __forceinline__ void pk_mma_m16n8k32_e4m3(float*, const unsigned int*, const unsigned int*, const float*) {
    static_assert(sizeof(PkArchT) == 0, "pk_mma_m16n8k32_e4m3 (mma .e4m3) needs sm_89 or newer");
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
// cp.async's ignore-src operand (PTX ISA 7.5): !full writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void pk_cp_async_16_zfill_at(void* smem_base, unsigned int byte_off, const void* gmem_src,
                                                        bool full) {
    unsigned long long g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(gmem_src));
    asm volatile("{ .reg .pred p; setp.eq.u32 p, %2, 0; cp.async.cg.shared.global [%0], [%1], 16, p; }"
                 ::"r"(pk_cvta_shared(smem_base) + byte_off), "l"(g), "r"((unsigned int)full)
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
__device__ __forceinline__ void pk_cp_async_16_zfill_at(void* smem_base, unsigned int byte_off, const void* gmem_src,
                                                        bool full) {
    *reinterpret_cast<uint4*>(static_cast<char*>(smem_base) + byte_off) =
        full ? *reinterpret_cast<const uint4*>(gmem_src) : make_uint4(0u, 0u, 0u, 0u);
}
__device__ __forceinline__ void pk_cp_async_commit() {}
template <int N> __device__ __forceinline__ void pk_cp_async_wait() {}
__device__ __forceinline__ void pk_cp_async_wait_all() {}
#endif
// A 16-byte shared-memory read (LDS.128): a plain one here (the host backend's bank model records it).
__device__ __forceinline__ float4 pk_ld_shared_v4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ uint4 pk_ld_shared_b128(const void* p) { return *static_cast<const uint4*>(p); }

__device__ __forceinline__ float pk_ex2_approx(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float pk_fadd_rm(float a, float b) {
    float r;
    asm("add.rm.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// A strong (relaxed, GPU-scope) load: served from L2, the point of coherence, never from a stale L1 line;
// ordered after an acquire that observed the writers' release (an acq_rel atomic, or __threadfence() after
// a plain one), it reads what they stored (sm_70+). Volatile + "memory": not hoisted above that acquire.
__device__ __forceinline__ float pk_ld_relaxed_gpu(const float* p) {
    float r;
    asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(r) : "l"(p) : "memory");
    return r;
}
// 16 bytes (p 16-byte aligned; e.g. 8 bf16 / f16 elements) in one strong load, each 32-bit word a relaxed access.
__device__ __forceinline__ uint4 pk_ld_relaxed_gpu_b128(const void* p) {
    uint4 r;
    asm volatile("ld.relaxed.gpu.global.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p)
                 : "memory");
    return r;
}
// st.global.v4.b32 (p 16-byte aligned): 16 bytes in one store, whatever the compiler's vectorizer makes of a
// uint4 store (NVVM split the one of decode_tc's split merge into four 4-byte stores inside its work-item loop).
__device__ __forceinline__ void pk_st_global_b128(void* p, uint4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
// prefetch.global.L1: brings the line holding p into L1 (and L2) ahead of a load, with no register held for it.
__device__ __forceinline__ void pk_prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
// Programmatic dependent launch (sm_90+). A kernel launched with it (pykern.launch(..., pdl=True)) may start
// while the previous kernel of its stream still runs: griddepcontrol.wait blocks until that grid has completed
// and its memory is visible, so it must come before the first read of anything the previous kernel may write
// (and before any write). griddepcontrol.launch_dependents lets the next PDL launch start its CTAs once every
// CTA of this grid has issued it (or exited). Without a PDL launch, or before sm_90, both do nothing.
// The "memory" clobber orders ordinary loads and stores; a load NVVM knows invariant (const __restrict__,
// ld.global.nc) could still be scheduled above it, so tests/test_pdl.py checks in the SASS of every kernel a
// `// pykern: pdl` line names that no global access comes before the wait (ACQBULK).
__device__ __forceinline__ void pk_grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pk_grid_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// atomicInc (old >= limit ? 0 : old + 1, returns old) as one release + acquire RMW at GPU scope (sm_70+):
// release: the stores ordered before it (the caller's own, and other threads' through a barrier: PTX release
// patterns are cumulative) are visible GPU-wide before the new count; acquire: once it reads the count that
// an earlier release RMW of the chain wrote, every store ordered before that release is visible to the loads
// ordered after this one (in this thread, and through a barrier in the CTA's other threads). No separate
// fence on either side.
__device__ __forceinline__ unsigned int pk_atom_inc_acq_rel_gpu(unsigned int* p, unsigned int limit) {
    unsigned int r;
    asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(r) : "l"(p), "r"(limit) : "memory");
    return r;
}
// red.global.add.f32 (relaxed, GPU scope): no result register, so no round trip; SASS RED.E.ADD.F32.
__device__ __forceinline__ void pk_red_add_f32(float* p, float v) {
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
// Spin until *p == v with ld.acquire.gpu: the loads after it see every store ordered before the release (an
// add of pk_sem_add_release, after the writer's barrier) that made *p == v; through a barrier the CTA's other
// threads see them too. The writers must be resident or already done (the CTAs before this one in launch order).
__device__ __forceinline__ void pk_sem_wait_eq(const int* p, int v) {
    int x;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(x) : "l"(p) : "memory");
    } while (x != v);
}
// red.release.gpu.global.add.s32: publishes the stores ordered before it (cumulative over a barrier), then adds.
__device__ __forceinline__ void pk_sem_add_release(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
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

// Byte permute (prmt.b32, CUDA's __byte_perm): byte i of the result is byte (sel >> 4 i) & 7 of the 8 bytes
// {b, a} (a's bytes 0..3, b's 4..7). One integer instruction (PRMT); e.g. sel 0x3120 interleaves a's bytes as
// 0, 2, 1, 3 (decode_tc's FP8 V: two keys' byte pairs into per-column key pairs).
#if defined(PYKERN_HOST)
__device__ __forceinline__ unsigned int pk_prmt(unsigned int a, unsigned int b, unsigned int sel) {
    const unsigned long long x = ((unsigned long long)b << 32) | a;
    unsigned int r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned int)((x >> (8 * ((sel >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
#else
__device__ __forceinline__ unsigned int pk_prmt(unsigned int a, unsigned int b, unsigned int sel) {
    return __byte_perm(a, b, sel);
}
#endif

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
// Four fp8 (a word, element i in byte i) -> two f16x2 / bf16x2 (elements 0, 1 in lo, 2, 3 in hi), exact:
// the widening to fp32, then the (exact) rounding to the 16-bit type.
__device__ __forceinline__ void pk_cvt_f16x4_e4m3x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
    lo = pk_cvt_f16x2(pk_fp8_sw_to_f32<4, 3>(w & 0xffu), pk_fp8_sw_to_f32<4, 3>((w >> 8) & 0xffu));
    hi = pk_cvt_f16x2(pk_fp8_sw_to_f32<4, 3>((w >> 16) & 0xffu), pk_fp8_sw_to_f32<4, 3>(w >> 24));
}
__device__ __forceinline__ void pk_cvt_f16x4_e5m2x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
    lo = pk_cvt_f16x2(pk_fp8_sw_to_f32<5, 2>(w & 0xffu), pk_fp8_sw_to_f32<5, 2>((w >> 8) & 0xffu));
    hi = pk_cvt_f16x2(pk_fp8_sw_to_f32<5, 2>((w >> 16) & 0xffu), pk_fp8_sw_to_f32<5, 2>(w >> 24));
}
__device__ __forceinline__ void pk_cvt_bf16x4_e4m3x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
    lo = pk_cvt_bf16x2(pk_fp8_sw_to_f32<4, 3>(w & 0xffu), pk_fp8_sw_to_f32<4, 3>((w >> 8) & 0xffu));
    hi = pk_cvt_bf16x2(pk_fp8_sw_to_f32<4, 3>((w >> 16) & 0xffu), pk_fp8_sw_to_f32<4, 3>(w >> 24));
}
__device__ __forceinline__ void pk_cvt_bf16x4_e5m2x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
    lo = pk_cvt_bf16x2(pk_fp8_sw_to_f32<5, 2>(w & 0xffu), pk_fp8_sw_to_f32<5, 2>((w >> 8) & 0xffu));
    hi = pk_cvt_bf16x2(pk_fp8_sw_to_f32<5, 2>((w >> 16) & 0xffu), pk_fp8_sw_to_f32<5, 2>(w >> 24));
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
// Four fp8 (a 32-bit word) -> two f16x2: lo from bits 0..15, hi from bits 16..31 (one cvt a pair, the upper
// byte to the upper half; ptxas selects the word's upper half in the instruction).
__device__ __forceinline__ void pk_cvt_f16x4_e4m3x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
    asm("{ .reg .b16 l, u; mov.b32 {l, u}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, u; }"
        : "=r"(lo), "=r"(hi) : "r"(w));
}
__device__ __forceinline__ void pk_cvt_f16x4_e5m2x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
    asm("{ .reg .b16 l, u; mov.b32 {l, u}, %2; cvt.rn.f16x2.e5m2x2 %0, l; cvt.rn.f16x2.e5m2x2 %1, u; }"
        : "=r"(lo), "=r"(hi) : "r"(w));
}
// Four fp8 -> two bf16x2 (exact): each pair through f16x2, the halves widened to fp32, then the two fp32 words'
// upper halves taken by a byte permute (prmt, an integer op): every fp8 value is a bf16 value, so its fp32 form
// has a zero lower half and its upper half is the bf16 (NaN and inf included). A cvt.rn.bf16x2.f32 pack there
// (F2FP) would cost a conversion a pair. (decode_tc now runs Q K^T in f16 for FP8 caches and no longer uses these.)
__device__ __forceinline__ void pk_cvt_bf16x4_e4m3x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
    asm("{ .reg .b16 l, u, a, b, c, d; .reg .b32 x, y, ia, ib, ic, id; .reg .f32 fa, fb, fc, fd;\n\t"
        "mov.b32 {l, u}, %2; cvt.rn.f16x2.e4m3x2 x, l; cvt.rn.f16x2.e4m3x2 y, u;\n\t"
        "mov.b32 {a, b}, x; mov.b32 {c, d}, y;\n\t"
        "cvt.f32.f16 fa, a; cvt.f32.f16 fb, b; cvt.f32.f16 fc, c; cvt.f32.f16 fd, d;\n\t"
        "mov.b32 ia, fa; mov.b32 ib, fb; mov.b32 ic, fc; mov.b32 id, fd;\n\t"
        "prmt.b32 %0, ia, ib, 0x7632; prmt.b32 %1, ic, id, 0x7632; }"
        : "=r"(lo), "=r"(hi) : "r"(w));
}
__device__ __forceinline__ void pk_cvt_bf16x4_e5m2x4(unsigned int w, unsigned int& lo, unsigned int& hi) {
    asm("{ .reg .b16 l, u, a, b, c, d; .reg .b32 x, y, ia, ib, ic, id; .reg .f32 fa, fb, fc, fd;\n\t"
        "mov.b32 {l, u}, %2; cvt.rn.f16x2.e5m2x2 x, l; cvt.rn.f16x2.e5m2x2 y, u;\n\t"
        "mov.b32 {a, b}, x; mov.b32 {c, d}, y;\n\t"
        "cvt.f32.f16 fa, a; cvt.f32.f16 fb, b; cvt.f32.f16 fc, c; cvt.f32.f16 fd, d;\n\t"
        "mov.b32 ia, fa; mov.b32 ib, fb; mov.b32 ic, fc; mov.b32 id, fd;\n\t"
        "prmt.b32 %0, ia, ib, 0x7632; prmt.b32 %1, ic, id, 0x7632; }"
        : "=r"(lo), "=r"(hi) : "r"(w));
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

// =================================================================================
// Hopper (sm_90a): wgmma, TMA, mbarrier and friends.
//
// Availability: mbarrier (with expect_tx), cp.async.bulk.tensor (TMA), fence.proxy.async and
// elect.sync exist from sm_90; wgmma.* and setmaxnreg only on the arch-specific sm_90a target
// (__CUDA_ARCH_FEAT_SM90_ALL). On other targets the wrappers are templates that fail with a
// static_assert only in a kernel that calls them. A kernel source that uses wgmma opts in to
// its target with a `// pykern: arch sm_90a` line (pykern.registry / pykern.precompile).
//
// wgmma m64nNk16 (a warpgroup = 4 consecutive warps, 128 threads, warpgroup w = threads
// 128w..128w+127; warp q = (thread / 32) % 4 of the group owns rows 16q..16q+15),
// lane = thread % 32, g = lane / 4, t = lane % 4 (PTX ISA "Register Fragments and Shared
// Memory Matrix Layouts" for wgmma):
//   D (64xN fp32), N/2 floats d[0..N/2): d[4j + v]: row = 16q + g + 8*(v>>1), col = 8j + 2t + (v&1)
//   A from registers (RS, 64x16 bf16/f16), 4 x .b32: a_v (v = 0..7, a[v/2] low half first):
//     row = 16q + g + 8*((v>>1)&1), col = 2t + (v&1) + 8*(v>>2)   (mma.m16n8k16's A per warp)
//   A (64x16) / B (Nx16, i.e. K x N "col") from shared memory through a 64-bit descriptor:
//     bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4,
//     49-51 base offset, 62-63 layout: 0 none (interleave), 1 128B, 2 64B, 3 32B swizzle.
//   Canonical layouts in 16-byte units (T = "transposed" = MN-major, else K-major), W = 1/2/4/8 for
//   none/32B/64B/128B; the swizzle XORs byte-address bits [4, 4+log2 W) with bits [7, 7+log2 W):
//     K-major  none: ((8,n),2):((1,SBO),LBO)     swizzled: ((8,n),2):((W,SBO),1)
//     MN-major none: ((1,n),(8,k)):((-,SBO),(1,LBO))  swizzled: ((W,n),(8,k)):((1,LBO),(W,SBO))
// Cross-checked (read, not copied) against CUTLASS/CuTe: cute/arch/mma_sm90_desc.hpp (GmmaDescriptor
// bit fields and LayoutType codes), cute/atom/mma_traits_sm90_gmma.hpp (make_gmma_desc's canonical
// K/MN layouts above; CLayout_64xN = ((4,8,4),(2,2,N/8)):((128,1,16),(64,8,512)) and ALayout_64x16
// = ((4,8,4),(2,2,2)):((128,1,16),(64,8,512)), which decode to the D and A tables above), and
// cute/swizzle.hpp Swizzle<B,4,3> (B = 3/2/1 for 128B/64B/32B).
//
// TMA: a CUtensorMap (128 bytes, 64-byte aligned; pykern.tensormap.make_tensor_map) passed to the
// kernel as `const __grid_constant__ CUtensorMap name` and used by address. Coordinates are element
// indices, innermost dimension first; out-of-bounds elements of a load are zeros. A load completes
// its bytes on an mbarrier (expect them with pk_mbarrier_arrive_expect_tx); a store is a bulk group
// (pk_tma_store_commit, then pk_tma_store_wait_read<N> before the shared source is reused).
//
// Host backend: see pykern/host/pk_host_sm90.cpp: the copy lands when a thread waits on the
// mbarrier (the latest a GPU may land it), wgmma is a warpgroup meeting point whose results reach
// the accumulators at the wgmma wait that covers them (NaN until then), mbarrier phases count
// arrivals and transaction bytes as on the GPU.

enum { PK_SWIZZLE_NONE = 0, PK_SWIZZLE_128B = 1, PK_SWIZZLE_64B = 2, PK_SWIZZLE_32B = 3 };
enum { PK_WGMMA_BF16 = 0, PK_WGMMA_F16 = 1, PK_WGMMA_E4M3 = 2 };
// wgmma m64nNk32 with e4m3 (float8_e4m3fn) A and B, fp32 accumulators (QGMMA): pk_wgmma_m64nNk32_e4m3_ss. Both
// operands come from shared memory K-major (PTX has no transpose for 8-bit types); a 16-byte unit holds 16
// k-elements, so the canonical K-major layouts above hold with bytes for elements: a k32 step is 32 bytes, as a
// 16-bit k16 step. The D fragment is the 16-bit forms' (d[4j + v] above). pk_wgmma_m64nNk32_e4m3_rs takes A
// (64x32 e4m3) from registers, 4 x .b32 of four elements each (byte e of a[r] first-lowest), mma.m16n8k32's A per
// warp: a[r] byte e: row = 16q + g + 8*(r&1), col = 4t + e + 16*(r>>1) (PTX ISA "Register Fragments" for wgmma
// .e4m3 A; CuTe's ALayout_64x32 for 8-bit types, ((4,8,4),(4,2,2)):((256,1,16),(64,8,1024)), decodes to it).

// Byte offset -> swizzled byte offset inside a 1024-byte-aligned region (the hardware XORs
// address bits [4, 4+b) with bits [7, 7+b), b = 3/2/1 for 128B/64B/32B).
__device__ __forceinline__ unsigned pk_swizzle_offset(unsigned off, int swizzle) {
    unsigned mask = swizzle == PK_SWIZZLE_128B ? 7u : swizzle == PK_SWIZZLE_64B ? 3u : swizzle == PK_SWIZZLE_32B ? 1u : 0u;
    return off ^ (((off >> 7) & mask) << 4);
}

// The descriptor from a shared-window byte address (pk_wgmma_desc computes it from a pointer).
__device__ __forceinline__ unsigned long long pk_wgmma_desc_encode(unsigned smem_addr, unsigned lbo_bytes,
                                                                   unsigned sbo_bytes, int swizzle,
                                                                   unsigned base_offset) {
    return (unsigned long long)((smem_addr & 0x3ffffu) >> 4) |
           ((unsigned long long)((lbo_bytes >> 4) & 0x3fffu) << 16) |
           ((unsigned long long)((sbo_bytes >> 4) & 0x3fffu) << 32) |
           ((unsigned long long)(base_offset & 7u) << 49) | ((unsigned long long)(swizzle & 3) << 62);
}
// The same descriptor `bytes` further on (a k-step inside a swizzle atom): the start address field.
__device__ __forceinline__ unsigned long long pk_wgmma_desc_advance(unsigned long long desc, unsigned bytes) {
    return desc + (unsigned long long)(bytes >> 4);
}
// x, as a value the compiler front end cannot see through (a volatile mov): a loop-invariant value passed through
// it inside a loop is used there rather than hoisted (with everything computed from it) out of the loop.
__device__ __forceinline__ unsigned long long pk_opaque_u64(unsigned long long x) {
#if defined(PYKERN_HOST)
    return x;
#else
    unsigned long long r;
    asm volatile("mov.b64 %0, %1;" : "=l"(r) : "l"(x));
    return r;
#endif
}

// The same for a 32-bit value.
__device__ __forceinline__ unsigned pk_opaque_u32(unsigned x) {
#if defined(PYKERN_HOST)
    return x;
#else
    unsigned r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
    return r;
#endif
}

// r pinned at this point of the program: an empty asm that reads and writes it (CUTLASS's warpgroup_fence_operand),
// so the front end cannot move arithmetic on a wgmma accumulator above the wgmma wait before it (ptxas would then
// serialise every wgmma of the kernel). Nothing on the CPU.
__device__ __forceinline__ void pk_wgmma_fence_operand(float& r) {
#if defined(PYKERN_HOST)
    (void)r;
#else
    asm volatile("" : "+f"(r)::"memory");
#endif
}

#if defined(PYKERN_HOST)
// ---- host emulation (state machine in pykern/host/pk_host_sm90.cpp) -------------------------
__device__ __forceinline__ unsigned long long pk_wgmma_desc(const void* smem, unsigned lbo_bytes, unsigned sbo_bytes,
                                                            int swizzle, unsigned base_offset = 0, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return pk_wgmma_desc_encode(pkrt_smem_window(smem, file, line), lbo_bytes, sbo_bytes, swizzle, base_offset);
}
__device__ __forceinline__ void pk_wgmma_fence() { pkrt_wgmma_fence(); }
__device__ __forceinline__ void pk_wgmma_commit(const char* file = __builtin_FILE(), int line = __builtin_LINE()) { pkrt_wgmma_commit(file, line); }
template <int N> __device__ __forceinline__ void pk_wgmma_wait(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    static_assert(N >= 0 && N <= 7, "pk_wgmma_wait<N>: N is 0..7");
    pkrt_wgmma_wait(N, file, line);
}
template <int N, int DT, int TA = 0, int TB = 0>
__device__ __forceinline__ void pk_wgmma_m64nNk16_ss(float* d, unsigned long long desc_a, unsigned long long desc_b,
                                                    int scale_d, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk16: N is 8..256 in steps of 8");
    static_assert(DT == PK_WGMMA_BF16 || DT == PK_WGMMA_F16, "wgmma: DT is PK_WGMMA_BF16 or PK_WGMMA_F16");
    pkrt_wgmma_op op{d, nullptr, desc_a, desc_b, N, DT, TA, TB, scale_d, 0};
    pkrt_wgmma_issue(&op, file, line);
}
template <int N, int DT, int TB = 0>
__device__ __forceinline__ void pk_wgmma_m64nNk16_rs(float* d, const unsigned* a, unsigned long long desc_b,
                                                    int scale_d, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk16: N is 8..256 in steps of 8");
    static_assert(DT == PK_WGMMA_BF16 || DT == PK_WGMMA_F16, "wgmma: DT is PK_WGMMA_BF16 or PK_WGMMA_F16");
    pkrt_wgmma_op op{d, a, 0, desc_b, N, DT, 0, TB, scale_d, 0};
    pkrt_wgmma_issue(&op, file, line);
}
template <int N>
__device__ __forceinline__ void pk_wgmma_m64nNk32_e4m3_ss(float* d, unsigned long long desc_a, unsigned long long desc_b,
                                                         int scale_d, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk32 e4m3: N is 8..256 in steps of 8");
    pkrt_wgmma_op op{d, nullptr, desc_a, desc_b, N, PK_WGMMA_E4M3, 0, 0, scale_d, 0};
    pkrt_wgmma_issue(&op, file, line);
}
template <int N>
__device__ __forceinline__ void pk_wgmma_m64nNk32_e4m3_rs(float* d, const unsigned* a, unsigned long long desc_b,
                                                         int scale_d, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk32 e4m3: N is 8..256 in steps of 8");
    pkrt_wgmma_op op{d, a, 0, desc_b, N, PK_WGMMA_E4M3, 0, 0, scale_d, 0};
    pkrt_wgmma_issue(&op, file, line);
}
template <int R> __device__ __forceinline__ void pk_setmaxnreg_inc() {
    static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg: 24..256 in steps of 8");
}
template <int R> __device__ __forceinline__ void pk_setmaxnreg_dec() {
    static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg: 24..256 in steps of 8");
}
__device__ __forceinline__ bool pk_elect_one(unsigned mask = 0xffffffffu) {
    unsigned b = __ballot_sync(mask, 1);
    return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32 == (unsigned)(__ffs((int)b) - 1);
}
// Orders this thread's generic-proxy shared-memory writes before later async-proxy (TMA, wgmma)
// reads: nothing to do on the CPU (no proxies), kept so the kernel text is the GPU's.
__device__ __forceinline__ void pk_fence_proxy_async_shared() {}
__device__ __forceinline__ void pk_fence_mbarrier_init() {}

__device__ __forceinline__ void pk_mbarrier_init(unsigned long long* bar, unsigned count, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    pkrt_mbar_init(bar, count, file, line);
}
__device__ __forceinline__ void pk_mbarrier_inval(unsigned long long* bar, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { pkrt_mbar_inval(bar, file, line); }
__device__ __forceinline__ unsigned long long pk_mbarrier_arrive(unsigned long long* bar, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return pkrt_mbar_arrive(bar, 0, 1, file, line);
}
__device__ __forceinline__ unsigned long long pk_mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return pkrt_mbar_arrive(bar, bytes, 1, file, line);
}
__device__ __forceinline__ void pk_mbarrier_expect_tx(unsigned long long* bar, unsigned bytes, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    (void)pkrt_mbar_arrive(bar, bytes, 0, file, line);
}
__device__ __forceinline__ bool pk_mbarrier_try_wait_parity(unsigned long long* bar, unsigned parity, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return pkrt_mbar_wait(bar, parity, 0, file, line) != 0;
}
__device__ __forceinline__ void pk_mbarrier_wait_parity(unsigned long long* bar, unsigned parity, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    (void)pkrt_mbar_wait(bar, parity, 1, file, line);
}

#define PK_TMA_LOAD_HOST(R, ...)                                                                         \
    int c[5] = {__VA_ARGS__};                                                                            \
    pkrt_tma_load(dst, map, bar, R, c, file, line)
__device__ __forceinline__ void pk_tma_load_2d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0, int c1, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { PK_TMA_LOAD_HOST(2, c0, c1); }
__device__ __forceinline__ void pk_tma_load_3d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0, int c1, int c2, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { PK_TMA_LOAD_HOST(3, c0, c1, c2); }
__device__ __forceinline__ void pk_tma_load_4d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0, int c1, int c2, int c3, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { PK_TMA_LOAD_HOST(4, c0, c1, c2, c3); }
__device__ __forceinline__ void pk_tma_load_5d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0, int c1, int c2, int c3, int c4, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { PK_TMA_LOAD_HOST(5, c0, c1, c2, c3, c4); }
#undef PK_TMA_LOAD_HOST
#define PK_TMA_STORE_HOST(R, ...)                                                                        \
    int c[5] = {__VA_ARGS__};                                                                            \
    pkrt_tma_store(map, src, R, c, file, line)
__device__ __forceinline__ void pk_tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { PK_TMA_STORE_HOST(2, c0, c1); }
__device__ __forceinline__ void pk_tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { PK_TMA_STORE_HOST(3, c0, c1, c2); }
__device__ __forceinline__ void pk_tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { PK_TMA_STORE_HOST(4, c0, c1, c2, c3); }
__device__ __forceinline__ void pk_tma_store_5d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3, int c4, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { PK_TMA_STORE_HOST(5, c0, c1, c2, c3, c4); }
#undef PK_TMA_STORE_HOST
__device__ __forceinline__ void pk_bulk_reduce_add_f32(float* dst, const void* src, unsigned bytes, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    pkrt_bulk_reduce_add_f32(dst, src, bytes, file, line);
}
__device__ __forceinline__ void pk_tma_store_commit() { pkrt_tma_store_commit(); }
template <int N> __device__ __forceinline__ void pk_tma_store_wait_read() { pkrt_tma_store_wait(N); }
template <int N> __device__ __forceinline__ void pk_tma_store_wait() { pkrt_tma_store_wait(N); }
__device__ __forceinline__ void pk_tma_prefetch_desc(const CUtensorMap*) {}

// Thread-block clusters (the runtime keeps a cluster's CTAs resident together; see pk_host_sm90.cpp).
__device__ __forceinline__ unsigned pk_cluster_ctarank() { return pkrt_cluster_reg(PKRT_CL_CTARANK); }
__device__ __forceinline__ unsigned pk_cluster_nctarank() { return pkrt_cluster_reg(PKRT_CL_NCTARANK); }
__device__ __forceinline__ uint3 pk_clusterid() {
    return make_uint3(pkrt_cluster_reg(PKRT_CL_ID_X), pkrt_cluster_reg(PKRT_CL_ID_Y), pkrt_cluster_reg(PKRT_CL_ID_Z));
}
__device__ __forceinline__ unsigned pk_mapa_shared(const void* p, unsigned rank, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return pkrt_mapa(p, rank, file, line);
}
__device__ __forceinline__ float pk_ld_shared_cluster_f32(unsigned addr, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    float v;
    pkrt_dsmem(addr, &v, 4, 0, file, line, nullptr);
    return v;
}
__device__ __forceinline__ float2 pk_ld_shared_cluster_f32x2(unsigned addr, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    float v[2];
    pkrt_dsmem(addr, v, 8, 0, file, line, nullptr);
    return make_float2(v[0], v[1]);
}
__device__ __forceinline__ void pk_st_shared_cluster_f32(unsigned addr, float v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    pkrt_dsmem(addr, &v, 4, 1, file, line, nullptr);
}
__device__ __forceinline__ void pk_cluster_arrive(const char* file = __builtin_FILE(), int line = __builtin_LINE()) { pkrt_cluster_arrive(file, line); }
__device__ __forceinline__ void pk_cluster_wait(const char* file = __builtin_FILE(), int line = __builtin_LINE()) { pkrt_cluster_wait(file, line); }
__device__ __forceinline__ void pk_cluster_sync(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    pkrt_cluster_arrive(file, line);
    pkrt_cluster_wait(file, line);
}

#else
// ---- NVRTC ---------------------------------------------------------------------------------
#ifndef PK_CUTENSORMAP_DEFINED
#define PK_CUTENSORMAP_DEFINED
#if !defined(CU_TENSOR_MAP_NUM_QWORDS)  // cuda.h's definition when it is included, else ours (same ABI)
typedef struct alignas(64) CUtensorMap_st { unsigned long long opaque[16]; } CUtensorMap;
#endif
#endif

__device__ __forceinline__ unsigned long long pk_wgmma_desc(const void* smem, unsigned lbo_bytes, unsigned sbo_bytes,
                                                            int swizzle, unsigned base_offset = 0) {
    return pk_wgmma_desc_encode(pk_cvta_shared(smem), lbo_bytes, sbo_bytes, swizzle, base_offset);
}

template <int N, int DT, int TA, int TB> struct pk_wgmma_ss_impl;
template <int N, int DT, int TB> struct pk_wgmma_rs_impl;
template <int N> struct pk_wgmma_ss_e4m3_impl;
template <int N> struct pk_wgmma_rs_e4m3_impl;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "pk_wgmma.cuh"
__device__ __forceinline__ void pk_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void pk_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void pk_wgmma_wait() {
    static_assert(N >= 0 && N <= 7, "pk_wgmma_wait<N>: N is 0..7");
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
template <int N, int DT, int TA = 0, int TB = 0>
__device__ __forceinline__ void pk_wgmma_m64nNk16_ss(float* d, unsigned long long desc_a, unsigned long long desc_b,
                                                    int scale_d) {
    static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk16: N is 8..256 in steps of 8");
    pk_wgmma_ss_impl<N, DT, TA, TB>::run(d, desc_a, desc_b, scale_d);
}
template <int N, int DT, int TB = 0>
__device__ __forceinline__ void pk_wgmma_m64nNk16_rs(float* d, const unsigned* a, unsigned long long desc_b,
                                                    int scale_d) {
    static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk16: N is 8..256 in steps of 8");
    pk_wgmma_rs_impl<N, DT, TB>::run(d, a, desc_b, scale_d);
}
template <int N>
__device__ __forceinline__ void pk_wgmma_m64nNk32_e4m3_ss(float* d, unsigned long long desc_a, unsigned long long desc_b,
                                                         int scale_d) {
    static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk32 e4m3: N is 8..256 in steps of 8");
    pk_wgmma_ss_e4m3_impl<N>::run(d, desc_a, desc_b, scale_d);
}
template <int N>
__device__ __forceinline__ void pk_wgmma_m64nNk32_e4m3_rs(float* d, const unsigned* a, unsigned long long desc_b,
                                                         int scale_d) {
    static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk32 e4m3: N is 8..256 in steps of 8");
    pk_wgmma_rs_e4m3_impl<N>::run(d, a, desc_b, scale_d);
}
template <int R> __device__ __forceinline__ void pk_setmaxnreg_inc() {
    static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg: 24..256 in steps of 8");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R> __device__ __forceinline__ void pk_setmaxnreg_dec() {
    static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg: 24..256 in steps of 8");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}
#else
// Not an sm_90a compile: a kernel that calls these fails here, with the reason.
template <typename...> struct pk_sm90a_only { static constexpr bool value = false; };
template <auto...> struct pk_sm90a_only_v { static constexpr bool value = false; };
#define PK_NEEDS_SM90A_MSG "wgmma / setmaxnreg need the sm_90a target: add the line '// pykern: arch sm_90a' to the kernel source and compile it for sm_90a"
template <typename PkArchT = void> __device__ __forceinline__ void pk_wgmma_fence() { static_assert(pk_sm90a_only<PkArchT>::value, PK_NEEDS_SM90A_MSG); }
template <typename PkArchT = void> __device__ __forceinline__ void pk_wgmma_commit() { static_assert(pk_sm90a_only<PkArchT>::value, PK_NEEDS_SM90A_MSG); }
template <int N> __device__ __forceinline__ void pk_wgmma_wait() { static_assert(pk_sm90a_only_v<N>::value, PK_NEEDS_SM90A_MSG); }
template <int N, int DT, int TA = 0, int TB = 0>
__device__ __forceinline__ void pk_wgmma_m64nNk16_ss(float*, unsigned long long, unsigned long long, int) {
    static_assert(pk_sm90a_only_v<N, DT, TA, TB>::value, PK_NEEDS_SM90A_MSG);
}
template <int N, int DT, int TB = 0>
__device__ __forceinline__ void pk_wgmma_m64nNk16_rs(float*, const unsigned*, unsigned long long, int) {
    static_assert(pk_sm90a_only_v<N, DT, TB>::value, PK_NEEDS_SM90A_MSG);
}
template <int N>
__device__ __forceinline__ void pk_wgmma_m64nNk32_e4m3_ss(float*, unsigned long long, unsigned long long, int) {
    static_assert(pk_sm90a_only_v<N>::value, PK_NEEDS_SM90A_MSG);
}
template <int N>
__device__ __forceinline__ void pk_wgmma_m64nNk32_e4m3_rs(float*, const unsigned*, unsigned long long, int) {
    static_assert(pk_sm90a_only_v<N>::value, PK_NEEDS_SM90A_MSG);
}
template <int R> __device__ __forceinline__ void pk_setmaxnreg_inc() { static_assert(pk_sm90a_only_v<R>::value, PK_NEEDS_SM90A_MSG); }
template <int R> __device__ __forceinline__ void pk_setmaxnreg_dec() { static_assert(pk_sm90a_only_v<R>::value, PK_NEEDS_SM90A_MSG); }
#undef PK_NEEDS_SM90A_MSG
#endif

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ bool pk_elect_one(unsigned mask = 0xffffffffu) {
    unsigned p;
    asm volatile("{ .reg .b32 r; .reg .pred q; elect.sync r|q, %1; selp.u32 %0, 1, 0, q; }" : "=r"(p) : "r"(mask));
    return p != 0;
}
__device__ __forceinline__ void pk_fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void pk_fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void pk_mbarrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(pk_smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void pk_mbarrier_inval(unsigned long long* bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(pk_smem_u32(bar)) : "memory");
}
__device__ __forceinline__ unsigned long long pk_mbarrier_arrive(unsigned long long* bar) {
    unsigned long long s;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];" : "=l"(s) : "r"(pk_smem_u32(bar)) : "memory");
    return s;
}
__device__ __forceinline__ unsigned long long pk_mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    unsigned long long s;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;" : "=l"(s) : "r"(pk_smem_u32(bar)), "r"(bytes) : "memory");
    return s;
}
__device__ __forceinline__ void pk_mbarrier_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(pk_smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool pk_mbarrier_try_wait_parity(unsigned long long* bar, unsigned parity) {
    unsigned ok;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(pk_smem_u32(bar)), "r"(parity) : "memory");
    return ok != 0;
}
__device__ __forceinline__ void pk_mbarrier_wait_parity(unsigned long long* bar, unsigned parity) {
    while (!pk_mbarrier_try_wait_parity(bar, parity)) {
    }
}

__device__ __forceinline__ void pk_tma_load_2d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(pk_cvta_shared(dst)), "l"(map), "r"(c0), "r"(c1), "r"(pk_cvta_shared(bar)) : "memory");
}
__device__ __forceinline__ void pk_tma_load_3d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 ::"r"(pk_cvta_shared(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(pk_cvta_shared(bar)) : "memory");
}
__device__ __forceinline__ void pk_tma_load_4d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 ::"r"(pk_cvta_shared(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(pk_cvta_shared(bar)) : "memory");
}
__device__ __forceinline__ void pk_tma_load_5d(void* dst, const CUtensorMap* map, unsigned long long* bar, int c0, int c1, int c2, int c3, int c4) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
                 ::"r"(pk_cvta_shared(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(pk_cvta_shared(bar)) : "memory");
}
__device__ __forceinline__ void pk_tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"(map), "r"(pk_cvta_shared(src)), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void pk_tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
                 ::"l"(map), "r"(pk_cvta_shared(src)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void pk_tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 ::"l"(map), "r"(pk_cvta_shared(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void pk_tma_store_5d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3, int c4) {
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];"
                 ::"l"(map), "r"(pk_cvta_shared(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4) : "memory");
}
// Bulk reduce-add (cp.reduce.async.bulk .add.f32): `bytes` (a multiple of 16) of fp32 in shared memory added
// element-wise into global memory (both addresses 16-byte aligned) by the async proxy, one instruction for the run
// (SASS UBLKRED); a bulk group member as a TMA store is (pk_tma_store_commit, pk_tma_store_wait_read<N> before the
// shared source is rewritten, pk_tma_store_wait<N> before the sums are relied on). Its writers fence
// (pk_fence_proxy_async_shared) and meet the issuing thread at a barrier first.
__device__ __forceinline__ void pk_bulk_reduce_add_f32(float* dst, const void* src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 ::"l"(dst), "r"(pk_cvta_shared(src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void pk_tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void pk_tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void pk_tma_store_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void pk_tma_prefetch_desc(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// Thread-block clusters (sm_90): special registers, distributed shared memory and the cluster barrier.
// pk_mapa_shared: the shared::cluster address of `p` (this CTA's shared memory) in CTA `rank` of the cluster;
// pk_ld/st_shared_cluster_*: ld/st.shared::cluster on such an address (DSMEM; SASS LD/ST with the peer's
// window). pk_cluster_arrive / _wait: barrier.cluster.arrive.release / wait.acquire (.aligned: every lane of a
// warp at the same instruction); every thread of every CTA arrives once per phase, then waits.
__device__ __forceinline__ unsigned pk_cluster_ctarank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned pk_cluster_nctarank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ uint3 pk_clusterid() {
    uint3 r;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r.x));
    asm volatile("mov.u32 %0, %%clusterid.y;" : "=r"(r.y));
    asm volatile("mov.u32 %0, %%clusterid.z;" : "=r"(r.z));
    return r;
}
__device__ __forceinline__ unsigned pk_mapa_shared(const void* p, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(pk_smem_u32(p)), "r"(rank));
    return r;
}
__device__ __forceinline__ float pk_ld_shared_cluster_f32(unsigned addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ float2 pk_ld_shared_cluster_f32x2(unsigned addr) {
    float2 v;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void pk_st_shared_cluster_f32(unsigned addr, float v) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ void pk_cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void pk_cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void pk_cluster_sync() {
    pk_cluster_arrive();
    pk_cluster_wait();
}
#endif  // sm_90+

#endif  // PYKERN_HOST / NVRTC

// The mbarriers of a warp-specialized TMA ring, set up by thread 0 while the rest wait at __syncthreads: `once`
// (the operands loaded once, one expect_tx arrival), full[s] (the producer's one expect_tx arrival per fill) and
// empty[s] (`consumers` arrivals: every consumer thread releases the slot) for the ST slots.
template <int ST>
__device__ __forceinline__ void pk_ring_init(unsigned long long* once, unsigned long long* full,
                                             unsigned long long* empty, unsigned consumers) {
    if (threadIdx.x == 0) {
        pk_mbarrier_init(once, 1);
        for (int s = 0; s < ST; s++) pk_mbarrier_init(&full[s], 1), pk_mbarrier_init(&empty[s], consumers);
        pk_fence_mbarrier_init();
    }
    __syncthreads();
}
// ================================= end of the Hopper section =====================================

// ================================= FlashAttention-2 forward core (pk_attn_core.cuh) ==============
// Shared-memory addresses as plain integers (pk_saddr): the core keeps one address register per lane
// and buffer and steps it with an add, so every ldmatrix / cp.async in its unrolled loops is
// [register + immediate] (with a pointer + offset the compiler rebuilt each address with a 3-input add).
// NVRTC: the 32-bit shared-window address; host backend: the pointer's value (same arithmetic).
#if defined(PYKERN_HOST)
typedef unsigned long long pk_saddr;
__device__ __forceinline__ pk_saddr pk_saddr_of(const void* p) { return (pk_saddr)(p); }
__device__ __forceinline__ void pk_ldmatrix_x4_s(unsigned int* r, pk_saddr a) { pk_ldmatrix_x4(r, (const void*)a); }
__device__ __forceinline__ void pk_ldmatrix_x4_trans_s(unsigned int* r, pk_saddr a) {
    pk_ldmatrix_x4_trans(r, (const void*)a);
}
__device__ __forceinline__ void pk_cp_async_16_s(pk_saddr dst, const void* gmem_src) {
    pk_cp_async_16((void*)dst, gmem_src);
}
#else
typedef unsigned int pk_saddr;
__device__ __forceinline__ pk_saddr pk_saddr_of(const void* p) { return pk_cvta_shared(p); }
__device__ __forceinline__ void pk_ldmatrix_x4_s(unsigned int* r, pk_saddr a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}
__device__ __forceinline__ void pk_ldmatrix_x4_trans_s(unsigned int* r, pk_saddr a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__device__ __forceinline__ void pk_cp_async_16_s(pk_saddr dst, const void* gmem_src) {
    unsigned long long g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(gmem_src));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(g) : "memory");
}
#else
__device__ __forceinline__ void pk_cp_async_16_s(pk_saddr dst, const void* gmem_src) {
    const uint4 x = *reinterpret_cast<const uint4*>(gmem_src);
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(dst), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w)
                 : "memory");
}
#endif
#endif
// ================================= end of the FlashAttention-2 forward core section ===============

// ================================= named barriers ==================================================
// barrier.cta.red.{and,or}.pred / barrier.cta.sync on named barrier `id` (1..15; 0 is __syncthreads') among
// `threads` threads (a multiple of 32): a subset of the block, e.g. one warpgroup (128) of a warp-specialized
// kernel whose other warps never arrive. Each arrival marks its warp's arrival (every non-exited lane of the
// warp must execute it); the non-.aligned form, so the warps may arrive from different instructions. The
// reductions return the AND / OR of p over the `threads` arrivals, the same value in every one; like
// __syncthreads, the barrier orders the participants' shared-memory accesses before it with theirs after it.
// pk_bar_arrive (barrier.cta.arrive): the warp's arrival without waiting for the phase; it counts towards the
// `threads` as a sync does, and orders the arriving warp's accesses before it with the waiting warps' after the
// release (FA3's ping-pong: one warpgroup arrives at the barrier the other waits on). A warp must not arrive
// twice in one phase (the GPU would count it twice).
// pk_bar_sync_aligned / pk_bar_arrive_aligned (bar.sync / bar.arrive, i.e. barrier.cta.{sync,arrive}.aligned):
// the same, for code where every lane of the warp runs the same barrier instruction (converged), which lets
// ptxas keep the code after it warp-uniform (uniform registers, no WARPSYNC): FA3's warp scheduler barriers.
// The non-.aligned forms there cost the sm_90a forward's loop 82 instructions a tile (descriptors left the
// uniform datapath, a convergence region around the loop).
// Host backend: pkrt_named_barrier (the caller's file and line name it in the errors), with a wrong thread
// count reported as a mismatch and racecheck ordering between the participants' warps only.
#if defined(PYKERN_HOST)
__device__ __forceinline__ bool pk_bar_red_and(unsigned id, unsigned threads, bool p,
                                               const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return pkrt_named_barrier((int)id, threads, PKRT_BAR_AND, p ? 1 : 0, file, line) != 0;
}
__device__ __forceinline__ bool pk_bar_red_or(unsigned id, unsigned threads, bool p,
                                              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return pkrt_named_barrier((int)id, threads, PKRT_BAR_OR, p ? 1 : 0, file, line) != 0;
}
__device__ __forceinline__ void pk_bar_sync(unsigned id, unsigned threads, const char* file = __builtin_FILE(),
                                            int line = __builtin_LINE()) {
    (void)pkrt_named_barrier((int)id, threads, PKRT_BAR_PLAIN, 1, file, line);
}
__device__ __forceinline__ void pk_bar_arrive(unsigned id, unsigned threads, const char* file = __builtin_FILE(),
                                              int line = __builtin_LINE()) {
    (void)pkrt_named_barrier((int)id, threads, PKRT_BAR_ARRIVE, 1, file, line);
}
__device__ __forceinline__ void pk_bar_sync_aligned(unsigned id, unsigned threads,
                                                    const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    (void)pkrt_named_barrier((int)id, threads, PKRT_BAR_PLAIN, 1, file, line);
}
__device__ __forceinline__ void pk_bar_arrive_aligned(unsigned id, unsigned threads,
                                                      const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    (void)pkrt_named_barrier((int)id, threads, PKRT_BAR_ARRIVE, 1, file, line);
}
#else
__device__ __forceinline__ bool pk_bar_red_and(unsigned id, unsigned threads, bool p) {
    unsigned r;
    asm volatile(
        "{\n\t.reg .pred q, d;\n\tsetp.ne.u32 q, %1, 0;\n\tbarrier.cta.red.and.pred d, %2, %3, q;\n\t"
        "selp.u32 %0, 1, 0, d;\n\t}"
        : "=r"(r)
        : "r"((unsigned)p), "r"(id), "r"(threads)
        : "memory");
    return r != 0;
}
__device__ __forceinline__ bool pk_bar_red_or(unsigned id, unsigned threads, bool p) {
    unsigned r;
    asm volatile(
        "{\n\t.reg .pred q, d;\n\tsetp.ne.u32 q, %1, 0;\n\tbarrier.cta.red.or.pred d, %2, %3, q;\n\t"
        "selp.u32 %0, 1, 0, d;\n\t}"
        : "=r"(r)
        : "r"((unsigned)p), "r"(id), "r"(threads)
        : "memory");
    return r != 0;
}
__device__ __forceinline__ void pk_bar_sync(unsigned id, unsigned threads) {
    asm volatile("barrier.cta.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void pk_bar_arrive(unsigned id, unsigned threads) {
    asm volatile("barrier.cta.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void pk_bar_sync_aligned(unsigned id, unsigned threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void pk_bar_arrive_aligned(unsigned id, unsigned threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
#endif
// ================================= end of the named barriers section ===============================
