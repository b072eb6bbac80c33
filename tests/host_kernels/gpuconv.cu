// Plain C++ float-to-int conversions and shifts by >= the width: the host backend must give the
// GPU's results (cvt.rzi saturation, clamped shl/shr), not x86's (tests/test_host_gpu_conversions.py).
#include "pk_common.cuh"
#include "gpuconv.cuh"

#define PK_G_TWICE(v) ((v) * 2)

extern "C" __global__ void pk_g_casts(const float* x, const double* xd, int* oi, unsigned* ou, long long* oll,
                                      unsigned long long* oull, int* oimp, int* ostat, int* ofunc, int* ohdr,
                                      long long* odbl, int n) {
    const int i = threadIdx.x;
    if (i >= n) return;
    oi[i] = (int)x[i];
    ou[i] = (unsigned)x[i];
    oll[i] = (long long)x[i];
    oull[i] = static_cast<unsigned long long>(x[i]);
    int j = x[i];  // implicit
    oimp[i] = j;
    ostat[i] = static_cast<int>(PK_G_TWICE(x[i]) / 2.0f);  // contains a whole macro invocation
    ofunc[i] = int(x[i]);
    ohdr[i] = pk_g_header_cast(x[i]);
    odbl[i] = (long long)xd[i];
}

template <typename T> __device__ T pk_g_shl_t(T a, int s) { return a << s; }

extern "C" __global__ void pk_g_shifts(const int* a, const unsigned* u, const long long* al, const int* s,
                                       int* oshl, unsigned* oshru, int* oshrs, long long* oshl64, int* ocomp,
                                       unsigned* ocompu, int* olit, unsigned* olitu, int* olits, int* otmpl,
                                       int* oconst, int n) {
    const int i = threadIdx.x;
    if (i >= n) return;
    oshl[i] = a[i] << s[i];
    oshru[i] = u[i] >> s[i];
    oshrs[i] = a[i] >> s[i];
    oshl64[i] = al[i] << s[i];
    int c = a[i];
    c <<= s[i];
    ocomp[i] = c;
    unsigned cu = u[i];
    cu >>= s[i];
    ocompu[i] = cu;
    olit[i] = a[i] << 32;
    olitu[i] = u[i] >> 40;
    olits[i] = a[i] >> 40;
    otmpl[i] = pk_g_shl_t(a[i], s[i]);
    // Constant expressions in a function body still compile (the helpers are constexpr).
    constexpr unsigned k = 3;
    constexpr unsigned m = 1u << k;
    static_assert((1u << k) == 8u, "constexpr shift");
    int buf[2 << k];  // a non-literal count in an array bound
    for (unsigned t = 0; t < (m << 1); t++) buf[t] = (int)t << 1;
    int v = 0;
    switch (s[i] & 7) {
        case 1 << 1: v = buf[m + 1] << (s[i] + 30); break;  // the label stays, the statement is rewritten
        default: v = buf[3 << 1]; break;
    }
    oconst[i] = v;
}

// A default argument (rewritten) and a cast and shift inside a macro argument (not): valid code either way.
__device__ inline int pk_g_default(int v = 2.5f) { return v; }
#define PK_G_ID(v) (v)
extern "C" __global__ void pk_g_misc(const float* x, int* o, int n) {
    const int i = threadIdx.x;
    if (i >= n) return;
    o[i] = pk_g_default() + PK_G_ID((int)x[i] << n) * 0;  // inside a macro argument: left as written
}

// Explicit casts with dependent types in a template: saturate where they turn out float -> int.
template <typename T, typename I> __device__ I pk_g_cast_t(T v) { return (I)v; }        // both dependent
template <typename I> __device__ I pk_g_cast_to(float f) { return (I)f; }               // dependent target
template <typename T> __device__ int pk_g_cast_from(T v) { return static_cast<int>(v); }  // dependent source
extern "C" __global__ void pk_g_template_casts(const float* x, const int* k, int* o, long long* ol, int* oto,
                                               int* ofrom, int* oi, int n) {
    const int i = threadIdx.x;
    if (i >= n) return;
    o[i] = pk_g_cast_t<float, int>(x[i]);
    ol[i] = pk_g_cast_t<float, long long>(x[i]);
    oto[i] = pk_g_cast_to<int>(x[i]);
    ofrom[i] = pk_g_cast_from(x[i]);
    oi[i] = pk_g_cast_t<int, int>(k[i]) + pk_g_cast_from(k[i]);  // int -> int: unchanged
}
