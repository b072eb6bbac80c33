// pykern host backend: the CUDA-C subset our kernels (and most CUDA authors) use,
// emulated in plain C++17 so the same .cu text compiles with g++/clang++.
//
// Threads of a block are fibers driven by pk_host_runtime.cpp. Every
// synchronizing intrinsic (__syncthreads*, __syncwarp, shuffles, votes) is a
// meeting point: the calling fiber parks there and the runtime decides who runs
// next, in the order PYKERN_HOST_SCHEDULE asks for.
#pragma once

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>

#define PYKERN_HOST 1

// ---- qualifiers ------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
// Function-scope `__shared__ T x[N];` is rewritten by pykern.host.build into a per-block
// slot (pkrt_static_smem); what is left (namespace scope) is one instance per library.
#define __shared__ static
#define __restrict__ __restrict
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __grid_constant__
#define PK_HOST_AI static inline __attribute__((always_inline))

// ---- vector types ----------------------------------------------------------
#define PK_VEC2(T, N, A) \
    struct __attribute__((aligned(A))) N##2 { T x, y; }; \
    PK_HOST_AI N##2 make_##N##2(T x, T y) { N##2 r; r.x = x; r.y = y; return r; }
#define PK_VEC3(T, N) \
    struct N##3 { T x, y, z; }; \
    PK_HOST_AI N##3 make_##N##3(T x, T y, T z) { N##3 r; r.x = x; r.y = y; r.z = z; return r; }
#define PK_VEC4(T, N, A) \
    struct __attribute__((aligned(A))) N##4 { T x, y, z, w; }; \
    PK_HOST_AI N##4 make_##N##4(T x, T y, T z, T w) { N##4 r; r.x = x; r.y = y; r.z = z; r.w = w; return r; }
#define PK_VEC(T, N, A2, A4) PK_VEC2(T, N, A2) PK_VEC3(T, N) PK_VEC4(T, N, A4)

PK_VEC(float, float, 8, 16)
PK_VEC(double, double, 16, 16)
PK_VEC(int, int, 8, 16)
PK_VEC(unsigned int, uint, 8, 16)
PK_VEC(short, short, 4, 8)
PK_VEC(unsigned short, ushort, 4, 8)
PK_VEC(signed char, char, 2, 4)
PK_VEC(unsigned char, uchar, 2, 4)
PK_VEC(long long, longlong, 16, 16)
PK_VEC(unsigned long long, ulonglong, 16, 16)
#undef PK_VEC
#undef PK_VEC2
#undef PK_VEC3
#undef PK_VEC4

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ---- runtime interface (pk_host_runtime.cpp) ---------------------------------
struct pkrt_thread;  // first member is the thread's uint3 index
extern "C" {
extern pkrt_thread* pkrt_cur;
extern uint3 pkrt_block_idx;
extern dim3 pkrt_block_dim;
extern dim3 pkrt_grid_dim;
extern unsigned char* pkrt_dyn_smem;
extern unsigned char* pkrt_static_smem_base;
extern int pkrt_interleave;
void pkrt_yield(void);
void pkrt_sem_wait(const int* p, int v, const char* file, int line);
void pkrt_sem_add(int* p, int v);
void* pkrt_static_smem(int id, size_t size, size_t align);
unsigned pkrt_activemask_at(const char* file, int line);
int pkrt_barrier(int kind, int pred, const char* file, int line);
int pkrt_named_barrier(int id, unsigned count, int kind, int pred, const char* file, int line);
unsigned long long pkrt_warp_op(int op, unsigned mask, unsigned long long value, int arg, int width,
                                const char* file, int line);
void pkrt_trap(const char* file, int line);
void pkrt_assert_fail(const char* expr, const char* file, int line);
long long pkrt_clock64(void);
}
#define clock64() pkrt_clock64()

// PTX wrappers (kernels_cu/pk_ptx.cuh): warp-wide instructions are meeting points that
// hand the runtime a pointer to each lane's fragment; cp.async is queued per thread.
enum { PKRT_PTX_MMA_BF16 = 32, PKRT_PTX_LDSM_X4 = 33, PKRT_PTX_LDSM_X4_T = 34, PKRT_PTX_MMA_F16 = 35,
       PKRT_PTX_MMA_E4M3 = 36 };
struct pkrt_mma_frag { unsigned a[4]; unsigned b[2]; float c[4]; float d[4]; };
// ldmatrix: each lane reads its own 16-byte row (row: where, bytes: what it read) before the collective,
// so racecheck sees every lane's read of shared memory where the kernel issues it, as it sees a plain load.
struct pkrt_ldsm_frag { const void* row; unsigned r[4]; unsigned bytes[4]; };
extern "C" {
void pkrt_ptx_warp(int op, void* frag, const char* file, int line);
void pkrt_cp_async(void* dst, const void* src, int bytes, const char* file, int line);
void pkrt_ld_shared_v4(const void* p, const char* file, int line);
void pkrt_cp_async_commit(void);
void pkrt_cp_async_wait(int n, int all);
}

#define threadIdx (*reinterpret_cast<const uint3*>(pkrt_cur))
#define blockIdx (static_cast<const uint3&>(pkrt_block_idx))
#define blockDim (static_cast<const dim3&>(pkrt_block_dim))
#define gridDim (static_cast<const dim3&>(pkrt_grid_dim))
// A constant, not a macro: a local variable may be called warpSize, as under NVCC.
static constexpr int warpSize = 32;
// In the interleaved schedule atomics and fences are where other blocks get to run.
#define PKRT_YIELD() (pkrt_interleave ? pkrt_yield() : (void)0)
#ifdef PK_RACECHECK
// Racecheck sees every load and store; the ones inside an atomic are exempt.
// Opaque calls: the optimizer must not drop or move them around the accesses.
extern "C" int pkrt_in_atomic;
extern "C" void pkrt_atomic_begin(void);
extern "C" void pkrt_atomic_end(void);
struct pkrt_atomic_scope {
    pkrt_atomic_scope() { pkrt_atomic_begin(); }
    ~pkrt_atomic_scope() { pkrt_atomic_end(); }
};
#define PKRT_ATOMIC_SCOPE pkrt_atomic_scope pkrt_atomic_scope_
#else
#define PKRT_ATOMIC_SCOPE (void)0
#endif

// The one place a kernel's `extern __shared__ T name[];` points to (the source text
// is rewritten to `T* const name = (T*)pk_dynamic_smem();` before compiling).
PK_HOST_AI void* pk_dynamic_smem() { return pkrt_dyn_smem; }
// Namespace-scope `extern __shared__ T name[];` becomes one of these: it must read the
// buffer pointer at each use, not once when the library loads.
template <typename T> struct pk_dynamic_smem_ref {
    operator T*() const { return reinterpret_cast<T*>(pkrt_dyn_smem); }
    T& operator[](long long i) const { return reinterpret_cast<T*>(pkrt_dyn_smem)[i]; }
};

// ---- barriers --------------------------------------------------------------
enum { PKRT_BAR_PLAIN = 0, PKRT_BAR_COUNT = 1, PKRT_BAR_AND = 2, PKRT_BAR_OR = 3, PKRT_BAR_ARRIVE = 4 };
#define __syncthreads() ((void)pkrt_barrier(PKRT_BAR_PLAIN, 1, __FILE__, __LINE__))
#define __syncthreads_count(p) pkrt_barrier(PKRT_BAR_COUNT, (p) ? 1 : 0, __FILE__, __LINE__)
#define __syncthreads_and(p) pkrt_barrier(PKRT_BAR_AND, (p) ? 1 : 0, __FILE__, __LINE__)
#define __syncthreads_or(p) pkrt_barrier(PKRT_BAR_OR, (p) ? 1 : 0, __FILE__, __LINE__)
#define __threadfence() PKRT_YIELD()
#define __threadfence_block() ((void)0)
#define __threadfence_system() PKRT_YIELD()
#define __trap() pkrt_trap(__FILE__, __LINE__)
#define __nanosleep(ns) ((void)(ns), PKRT_YIELD())
// Device-side assert: a failed one is a KernelExecutionError naming the thread, not an abort().
#undef assert
#define assert(e) ((e) ? (void)0 : pkrt_assert_fail(#e, __FILE__, __LINE__))

// ---- warp-level operations ---------------------------------------------------
enum {
    PKRT_SYNCWARP = 0, PKRT_SHFL_IDX, PKRT_SHFL_UP, PKRT_SHFL_DOWN, PKRT_SHFL_XOR,
    PKRT_BALLOT, PKRT_ANY, PKRT_ALL, PKRT_MATCH_ANY, PKRT_MATCH_ALL,
    PKRT_REDUCE_ADD, PKRT_REDUCE_MIN, PKRT_REDUCE_MAX, PKRT_REDUCE_AND, PKRT_REDUCE_OR, PKRT_REDUCE_XOR,
};

template <typename T>
PK_HOST_AI T pkrt_shfl(int op, const char* file, int line, unsigned mask, T var, int arg, int width) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type wider than 8 bytes");
    unsigned long long bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    bits = pkrt_warp_op(op, mask, bits, arg, width, file, line);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
template <typename T>
PK_HOST_AI T pkrt_shfl_idx(const char* f, int l, unsigned m, T v, int src, int width = 32) {
    return pkrt_shfl(PKRT_SHFL_IDX, f, l, m, v, src, width);
}
template <typename T>
PK_HOST_AI T pkrt_shfl_up(const char* f, int l, unsigned m, T v, unsigned d, int width = 32) {
    return pkrt_shfl(PKRT_SHFL_UP, f, l, m, v, (int)d, width);
}
template <typename T>
PK_HOST_AI T pkrt_shfl_down(const char* f, int l, unsigned m, T v, unsigned d, int width = 32) {
    return pkrt_shfl(PKRT_SHFL_DOWN, f, l, m, v, (int)d, width);
}
template <typename T>
PK_HOST_AI T pkrt_shfl_xor(const char* f, int l, unsigned m, T v, int lm, int width = 32) {
    return pkrt_shfl(PKRT_SHFL_XOR, f, l, m, v, lm, width);
}
template <typename T>
PK_HOST_AI unsigned pkrt_match(int op, const char* f, int l, unsigned m, T v, int* pred) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "__match_*_sync takes 32- or 64-bit values");
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    unsigned long long r = pkrt_warp_op(op, m, bits, 0, 32, f, l);
    if (pred) *pred = (int)(r >> 32);
    return (unsigned)r;
}
PK_HOST_AI unsigned pkrt_reduce(int op, const char* f, int l, unsigned m, unsigned v, int is_signed) {
    return (unsigned)pkrt_warp_op(op, m, v, is_signed, 32, f, l);
}
PK_HOST_AI int pkrt_reduce(int op, const char* f, int l, unsigned m, int v, int) {
    return (int)(unsigned)pkrt_warp_op(op, m, (unsigned)v, 1, 32, f, l);
}

#define __syncwarp(...) ((void)pkrt_warp_op(PKRT_SYNCWARP, pkrt_mask_or_full(__VA_ARGS__), 0, 0, 32, __FILE__, __LINE__))
PK_HOST_AI unsigned pkrt_mask_or_full() { return 0xffffffffu; }
PK_HOST_AI unsigned pkrt_mask_or_full(unsigned m) { return m; }
#define __shfl_sync(...) pkrt_shfl_idx(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) pkrt_shfl_up(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) pkrt_shfl_down(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) pkrt_shfl_xor(__FILE__, __LINE__, __VA_ARGS__)
#define __ballot_sync(m, p) ((unsigned)pkrt_warp_op(PKRT_BALLOT, (m), (p) ? 1 : 0, 0, 32, __FILE__, __LINE__))
#define __any_sync(m, p) ((int)pkrt_warp_op(PKRT_ANY, (m), (p) ? 1 : 0, 0, 32, __FILE__, __LINE__))
#define __all_sync(m, p) ((int)pkrt_warp_op(PKRT_ALL, (m), (p) ? 1 : 0, 0, 32, __FILE__, __LINE__))
#define __match_any_sync(m, v) pkrt_match(PKRT_MATCH_ANY, __FILE__, __LINE__, (m), (v), nullptr)
#define __match_all_sync(m, v, pred) pkrt_match(PKRT_MATCH_ALL, __FILE__, __LINE__, (m), (v), (pred))
#define __reduce_add_sync(m, v) pkrt_reduce(PKRT_REDUCE_ADD, __FILE__, __LINE__, (m), (v), 0)
#define __reduce_min_sync(m, v) pkrt_reduce(PKRT_REDUCE_MIN, __FILE__, __LINE__, (m), (v), 0)
#define __reduce_max_sync(m, v) pkrt_reduce(PKRT_REDUCE_MAX, __FILE__, __LINE__, (m), (v), 0)
#define __reduce_and_sync(m, v) pkrt_reduce(PKRT_REDUCE_AND, __FILE__, __LINE__, (m), (v), 0)
#define __reduce_or_sync(m, v) pkrt_reduce(PKRT_REDUCE_OR, __FILE__, __LINE__, (m), (v), 0)
#define __reduce_xor_sync(m, v) pkrt_reduce(PKRT_REDUCE_XOR, __FILE__, __LINE__, (m), (v), 0)
#define __activemask() pkrt_activemask_at(__FILE__, __LINE__)

// ---- atomics -----------------------------------------------------------------
// All fibers run on one OS thread and only switch at meeting points (in the interleaved
// schedule also here, before the access), so a plain read-modify-write is atomic.
template <typename T> PK_HOST_AI T atomicAdd(T* p, T v) { PKRT_YIELD(); PKRT_ATOMIC_SCOPE; T o = *p; *p = o + v; return o; }
template <typename T> PK_HOST_AI T atomicSub(T* p, T v) { PKRT_YIELD(); PKRT_ATOMIC_SCOPE; T o = *p; *p = o - v; return o; }
template <typename T> PK_HOST_AI T atomicExch(T* p, T v) { PKRT_YIELD(); PKRT_ATOMIC_SCOPE; T o = *p; *p = v; return o; }
template <typename T> PK_HOST_AI T atomicMax(T* p, T v) {
    PKRT_YIELD();
    PKRT_ATOMIC_SCOPE;
    T o = *p;
    if constexpr (std::is_floating_point<T>::value) *p = std::fmax(o, v); else *p = o < v ? v : o;
    return o;
}
template <typename T> PK_HOST_AI T atomicMin(T* p, T v) {
    PKRT_YIELD();
    PKRT_ATOMIC_SCOPE;
    T o = *p;
    if constexpr (std::is_floating_point<T>::value) *p = std::fmin(o, v); else *p = v < o ? v : o;
    return o;
}
template <typename T> PK_HOST_AI T atomicCAS(T* p, T cmp, T v) {
    PKRT_YIELD();
    PKRT_ATOMIC_SCOPE;
    T o = *p;
    if (std::memcmp(&o, &cmp, sizeof(T)) == 0) *p = v;  // bitwise, as the hardware compares
    return o;
}
template <typename T> PK_HOST_AI T atomicAnd(T* p, T v) { PKRT_YIELD(); PKRT_ATOMIC_SCOPE; T o = *p; *p = o & v; return o; }
template <typename T> PK_HOST_AI T atomicOr(T* p, T v) { PKRT_YIELD(); PKRT_ATOMIC_SCOPE; T o = *p; *p = o | v; return o; }
template <typename T> PK_HOST_AI T atomicXor(T* p, T v) { PKRT_YIELD(); PKRT_ATOMIC_SCOPE; T o = *p; *p = o ^ v; return o; }
PK_HOST_AI unsigned atomicInc(unsigned* p, unsigned v) { PKRT_YIELD(); PKRT_ATOMIC_SCOPE; unsigned o = *p; *p = (o >= v) ? 0u : o + 1u; return o; }
PK_HOST_AI unsigned atomicDec(unsigned* p, unsigned v) { PKRT_YIELD(); PKRT_ATOMIC_SCOPE; unsigned o = *p; *p = (o == 0u || o > v) ? v : o - 1u; return o; }
#define PK_SCOPED_ATOMIC(name) \
    template <typename... A> PK_HOST_AI auto name##_block(A... a) { return name(a...); } \
    template <typename... A> PK_HOST_AI auto name##_system(A... a) { return name(a...); }
PK_SCOPED_ATOMIC(atomicAdd) PK_SCOPED_ATOMIC(atomicSub) PK_SCOPED_ATOMIC(atomicExch)
PK_SCOPED_ATOMIC(atomicMax) PK_SCOPED_ATOMIC(atomicMin) PK_SCOPED_ATOMIC(atomicCAS)
PK_SCOPED_ATOMIC(atomicAnd) PK_SCOPED_ATOMIC(atomicOr) PK_SCOPED_ATOMIC(atomicXor)
#undef PK_SCOPED_ATOMIC

// ---- loads/stores with cache hints ---------------------------------------------
// GPU results for C++ float-to-int conversions and shifts: pykern/host/gpu_conv.py rewrites
// them in kernel sources into these calls (default and checked builds; not the sanitizer build,
// which reports them as C++ UB). cvt.rzi: truncate, saturate to the destination range, NaN -> 0.
// Other types (a template's cast whose types were dependent when rewritten): the C cast as written.
template <typename To, typename From> constexpr __attribute__((always_inline)) To __pk_f2i(From&& x) {
    if constexpr (std::is_floating_point<std::remove_cv_t<std::remove_reference_t<From>>>::value &&
                  std::is_integral<To>::value && !std::is_same<To, bool>::value) {
        using F = std::remove_cv_t<std::remove_reference_t<From>>;
        if (x != x) return To(0);
        // hi = max + 1 (a power of two, exact in F); the signed minimum is -hi.
        constexpr F hi = F(2) * F(std::numeric_limits<To>::max() / 2 + 1);
        if (x >= hi) return std::numeric_limits<To>::max();
        if (std::is_signed<To>::value ? x < -hi : x <= F(-1))
            return std::numeric_limits<To>::min();
        return static_cast<To>(x);
    } else {
        return (To)static_cast<From&&>(x);
    }
}
// shl / shr with the count taken as a 32-bit unsigned register and clamped: >= width gives 0
// (sign fill for a signed >>), where x86 masks the count. Other operand types: the plain operator.
template <typename A, typename B> constexpr __attribute__((always_inline)) auto __pk_shl(A a, B b) -> decltype(a << b) {
    if constexpr (std::is_integral<A>::value && std::is_integral<B>::value) {
        using R = decltype(a << b);
        if (static_cast<unsigned>(b) >= sizeof(R) * 8u) return R(0);
        return a << static_cast<unsigned>(b);
    } else {
        return a << b;
    }
}
template <typename A, typename B> constexpr __attribute__((always_inline)) auto __pk_shr(A a, B b) -> decltype(a >> b) {
    if constexpr (std::is_integral<A>::value && std::is_integral<B>::value) {
        using R = decltype(a >> b);
        if (static_cast<unsigned>(b) >= sizeof(R) * 8u) return R(std::is_signed<R>::value && R(a) < R(0) ? R(-1) : R(0));
        return a >> static_cast<unsigned>(b);
    } else {
        return a >> b;
    }
}
template <typename A, typename B> constexpr __attribute__((always_inline)) A& __pk_shl_eq(A& a, B b) {
    a = static_cast<A>(__pk_shl(+a, b));
    return a;
}
template <typename A, typename B> constexpr __attribute__((always_inline)) A& __pk_shr_eq(A& a, B b) {
    a = static_cast<A>(__pk_shr(+a, b));
    return a;
}

template <typename T> PK_HOST_AI T __ldg(const T* p) { return *p; }
template <typename T> PK_HOST_AI T __ldcg(const T* p) { return *p; }
template <typename T> PK_HOST_AI T __ldca(const T* p) { return *p; }
template <typename T> PK_HOST_AI T __ldcs(const T* p) { return *p; }
template <typename T> PK_HOST_AI T __ldlu(const T* p) { return *p; }
template <typename T> PK_HOST_AI T __ldcv(const T* p) { return *p; }
template <typename T> PK_HOST_AI void __stcg(T* p, T v) { *p = v; }
template <typename T> PK_HOST_AI void __stcs(T* p, T v) { *p = v; }
template <typename T> PK_HOST_AI void __stwb(T* p, T v) { *p = v; }
template <typename T> PK_HOST_AI void __stwt(T* p, T v) { *p = v; }

// ---- bit casts and conversions ---------------------------------------------------
template <typename To, typename From> PK_HOST_AI To pkrt_bitcast(From f) {
    static_assert(sizeof(To) == sizeof(From), "bit cast between sizes");
    To t; std::memcpy(&t, &f, sizeof(To)); return t;
}
PK_HOST_AI float __int_as_float(int v) { return pkrt_bitcast<float>(v); }
PK_HOST_AI float __uint_as_float(unsigned v) { return pkrt_bitcast<float>(v); }
PK_HOST_AI int __float_as_int(float v) { return pkrt_bitcast<int>(v); }
PK_HOST_AI unsigned __float_as_uint(float v) { return pkrt_bitcast<unsigned>(v); }
PK_HOST_AI double __longlong_as_double(long long v) { return pkrt_bitcast<double>(v); }
PK_HOST_AI long long __double_as_longlong(double v) { return pkrt_bitcast<long long>(v); }
PK_HOST_AI int __double2hiint(double v) { return (int)(pkrt_bitcast<unsigned long long>(v) >> 32); }
PK_HOST_AI int __double2loint(double v) { return (int)pkrt_bitcast<unsigned long long>(v); }
PK_HOST_AI double __hiloint2double(int hi, int lo) {
    return pkrt_bitcast<double>(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo);
}

// Float -> integer conversions saturate and map NaN to 0, as the hardware's cvt does.
template <typename I, typename F> PK_HOST_AI I pkrt_f2i(F r) {
    if (r != r) return 0;
    if (r <= (F)std::numeric_limits<I>::min()) return std::numeric_limits<I>::min();
    if (r >= (F)std::numeric_limits<I>::max()) return std::numeric_limits<I>::max();
    return (I)r;
}
#define PK_F2I(suffix, I, F, ROUND) PK_HOST_AI I __##suffix(F x) { return pkrt_f2i<I, F>(ROUND(x)); }
PK_F2I(float2int_rn, int, float, std::nearbyint) PK_F2I(float2int_rz, int, float, std::trunc)
PK_F2I(float2int_rd, int, float, std::floor) PK_F2I(float2int_ru, int, float, std::ceil)
PK_F2I(float2uint_rn, unsigned, float, std::nearbyint) PK_F2I(float2uint_rz, unsigned, float, std::trunc)
PK_F2I(float2uint_rd, unsigned, float, std::floor) PK_F2I(float2uint_ru, unsigned, float, std::ceil)
PK_F2I(float2ll_rn, long long, float, std::nearbyint) PK_F2I(float2ll_rz, long long, float, std::trunc)
PK_F2I(float2ull_rn, unsigned long long, float, std::nearbyint) PK_F2I(float2ull_rz, unsigned long long, float, std::trunc)
PK_F2I(double2int_rn, int, double, std::nearbyint) PK_F2I(double2int_rz, int, double, std::trunc)
PK_F2I(double2ll_rn, long long, double, std::nearbyint) PK_F2I(double2ll_rz, long long, double, std::trunc)
#undef PK_F2I
PK_HOST_AI float __int2float_rn(int v) { return (float)v; }
PK_HOST_AI float __uint2float_rn(unsigned v) { return (float)v; }
PK_HOST_AI float __ll2float_rn(long long v) { return (float)v; }
PK_HOST_AI float __ull2float_rn(unsigned long long v) { return (float)v; }
PK_HOST_AI float __double2float_rn(double v) { return (float)v; }

// ---- float intrinsics (IEEE versions: results stay close to the GPU's) -----------
// The approximate intrinsics are .ftz on the GPU: subnormal inputs count as zero and
// subnormal results flush to zero; values stay the accurate ones (within the documented
// ulp bounds), special cases are the hardware's.
PK_HOST_AI float pk_ftz(float x) { return (x != 0.0f && std::fabs(x) < FLT_MIN) ? std::copysign(0.0f, x) : x; }
PK_HOST_AI float pk_irsqrtf(float x) { return pk_ftz(1.0f / std::sqrt(pk_ftz(x))); }
PK_HOST_AI double pk_irsqrt(double x) { return 1.0 / std::sqrt(x); }
PK_HOST_AI float pk_ircbrtf(float x) { return 1.0f / std::cbrt(x); }
PK_HOST_AI float pk_i__expf(float x) { return pk_ftz(std::exp(pk_ftz(x))); }
PK_HOST_AI float pk_i__exp10f(float x) { return pk_ftz(std::pow(10.0f, pk_ftz(x))); }
PK_HOST_AI float pk_i__logf(float x) { return std::log(pk_ftz(x)); }
PK_HOST_AI float pk_i__log2f(float x) { return std::log2(pk_ftz(x)); }
PK_HOST_AI float pk_i__log10f(float x) { return std::log10(pk_ftz(x)); }
// ex2(y * lg2(x)), as the GPU computes it: __powf(0, 0) and __powf(1, inf) are NaN.
PK_HOST_AI float pk_i__powf(float x, float y) {
    return pk_ftz(std::exp2(pk_ftz(y) * std::log2(pk_ftz(x))));
}
PK_HOST_AI float pk_i__sinf(float x) { return pk_ftz(std::sin(pk_ftz(x))); }
PK_HOST_AI float pk_i__cosf(float x) { return pk_ftz(std::cos(pk_ftz(x))); }
PK_HOST_AI float pk_i__tanf(float x) { return pk_ftz(std::sin(pk_ftz(x))) / pk_ftz(std::cos(pk_ftz(x))); }
PK_HOST_AI void pk_i__sincosf(float x, float* s, float* c) { *s = pk_i__sinf(x); *c = pk_i__cosf(x); }
PK_HOST_AI float pk_i__tanhf(float x) { return pk_ftz(std::tanh(pk_ftz(x))); }
// x * rcp.approx.ftz(y): for 2^126 < |y| < 2^128 the reciprocal is subnormal and flushes to
// zero, so the quotient is 0 (NaN when x is infinite), as CUDA documents.
PK_HOST_AI float pk_i__fdividef(float a, float b) { return pk_ftz(a) * pk_ftz(1.0f / pk_ftz(b)); }
PK_HOST_AI float pk_i__frcp_rn(float x) { return 1.0f / x; }
PK_HOST_AI float pk_i__fsqrt_rn(float x) { return std::sqrt(x); }
PK_HOST_AI float pk_i__frsqrt_rn(float x) { return 1.0f / std::sqrt(x); }
PK_HOST_AI float pk_i__fadd_rn(float a, float b) { return a + b; }
PK_HOST_AI float pk_i__fsub_rn(float a, float b) { return a - b; }
PK_HOST_AI float pk_i__fmul_rn(float a, float b) { return a * b; }
PK_HOST_AI float pk_i__fdiv_rn(float a, float b) { return a / b; }
PK_HOST_AI float pk_i__fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
PK_HOST_AI double pk_i__dadd_rn(double a, double b) { return a + b; }
PK_HOST_AI double pk_i__dmul_rn(double a, double b) { return a * b; }
PK_HOST_AI double pk_i__fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
PK_HOST_AI float pk_i__saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
PK_HOST_AI float pk_i__fmax(float a, float b) { return std::fmax(a, b); }
#define rsqrtf pk_irsqrtf
#define rsqrt pk_irsqrt
#define rcbrtf pk_ircbrtf
#define __expf pk_i__expf
#define __exp10f pk_i__exp10f
#define __logf pk_i__logf
#define __log2f pk_i__log2f
#define __log10f pk_i__log10f
#define __powf pk_i__powf
#define __sinf pk_i__sinf
#define __cosf pk_i__cosf
#define __tanf pk_i__tanf
#define __sincosf pk_i__sincosf
#define __tanhf pk_i__tanhf
#define __fdividef pk_i__fdividef
#define __frcp_rn pk_i__frcp_rn
#define __fsqrt_rn pk_i__fsqrt_rn
#define __frsqrt_rn pk_i__frsqrt_rn
#define __fadd_rn pk_i__fadd_rn
#define __fsub_rn pk_i__fsub_rn
#define __fmul_rn pk_i__fmul_rn
#define __fdiv_rn pk_i__fdiv_rn
#define __fmaf_rn pk_i__fmaf_rn
#define __dadd_rn pk_i__dadd_rn
#define __dmul_rn pk_i__dmul_rn
#define __fma_rn pk_i__fma_rn
#define __saturatef pk_i__saturatef
#define __fmax pk_i__fmax
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

// ---- integer intrinsics ---------------------------------------------------------
PK_HOST_AI int __popc(unsigned x) { return __builtin_popcount(x); }
PK_HOST_AI int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
PK_HOST_AI int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
PK_HOST_AI int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
PK_HOST_AI int __ffs(int x) { return __builtin_ffs(x); }
PK_HOST_AI int __ffsll(long long x) { return __builtin_ffsll(x); }
PK_HOST_AI unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
// Low 24 bits, sign-extended, multiplied: no signed overflow or negative shift on any input.
PK_HOST_AI int pkrt_sext24(int a) { unsigned u = (unsigned)a & 0xffffffu; return (int)(u ^ 0x800000u) - 0x800000; }
PK_HOST_AI int __mul24(int a, int b) { return (int)(unsigned)((long long)pkrt_sext24(a) * pkrt_sext24(b)); }
PK_HOST_AI unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }
PK_HOST_AI int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
PK_HOST_AI unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
PK_HOST_AI long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
PK_HOST_AI unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
// |a - b| computed in 64 bits: a - b can overflow int (UB) for valid inputs.
PK_HOST_AI unsigned __sad(int a, int b, unsigned c) {
    long long d = (long long)a - (long long)b;
    return c + (unsigned)(d < 0 ? -d : d);
}
PK_HOST_AI unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
    unsigned long long v = ((unsigned long long)hi << 32) | lo;
    return (unsigned)((v << (s & 31)) >> 32);
}
PK_HOST_AI unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    unsigned long long v = ((unsigned long long)hi << 32) | lo;
    return (unsigned)(v >> (s & 31));
}

// CUDA's global min/max: one overload set for every arithmetic pair, with C's usual
// conversions (min(int, unsigned) is unsigned, as CUDA's umin overloads make it).
template <typename A, typename B,
          typename std::enable_if<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value, int>::type = 0>
PK_HOST_AI typename std::common_type<A, B>::type min(A a, B b) {
    using C = typename std::common_type<A, B>::type;
    if constexpr (std::is_floating_point<C>::value) return std::fmin((C)a, (C)b);
    else return (C)b < (C)a ? (C)b : (C)a;
}
template <typename A, typename B,
          typename std::enable_if<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value, int>::type = 0>
PK_HOST_AI typename std::common_type<A, B>::type max(A a, B b) {
    using C = typename std::common_type<A, B>::type;
    if constexpr (std::is_floating_point<C>::value) return std::fmax((C)a, (C)b);
    else return (C)a < (C)b ? (C)b : (C)a;
}

// ---- launch stubs ----------------------------------------------------------------
// Filled by pykern.backends.host (ctypes) and read by the runtime.
struct pk_launch_cfg {
    unsigned grid[3];
    unsigned block[3];
    unsigned long long shared_mem;
    int schedule;    // 0 forward, 1 reverse, 2 random: blocks and threads
    int interleave;  // blocks resident at once; 0/1: one block after another
    unsigned long long seed;
    unsigned long long stack_bytes;
    unsigned long long watchdog_ms;  // 0: no watchdog
    unsigned long long flags;        // reserved
    unsigned long long smem_limit;   // static + dynamic shared memory a block may use (0: 227 KiB)
    unsigned cluster[3];             // thread-block cluster dims (0 or 1,1,1: no cluster)
};
extern "C" int pkrt_launch(const pk_launch_cfg* cfg, const char* kernel, void (*body)(void*), void* args,
                           char* err, size_t errlen);
#define PK_EXPORT extern "C" __attribute__((visibility("default")))
#include "pk_host_sm90.h"  // Hopper (sm_90a): wgmma, TMA, mbarrier
