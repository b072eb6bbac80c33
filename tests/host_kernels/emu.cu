// Test-only kernels for the host backend's emulator (tests/test_host_*.py).
// Loaded through PYKERN_KERNEL_PATH=tests/host_kernels.
#include "pk_common.cuh"

// op: 0 idx, 1 up, 2 down, 3 xor. Lanes outside `mask` skip the call and write -7.
extern "C" __global__ void pk_t_shfl(const int* in, int* out, int op, int arg, int width, unsigned int mask) {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int v = in[tid];
    int r = -7;
    if ((mask >> lane) & 1u) {
        switch (op) {
            case 0: r = __shfl_sync(mask, v, arg, width); break;
            case 1: r = __shfl_up_sync(mask, v, (unsigned)arg, width); break;
            case 2: r = __shfl_down_sync(mask, v, (unsigned)arg, width); break;
            default: r = __shfl_xor_sync(mask, v, arg, width); break;
        }
    }
    out[tid] = r;
}

// 64-bit and float payloads travel whole through a shuffle.
extern "C" __global__ void pk_t_shfl_wide(const double* in, double* out, const float* fin, float* fout) {
    const int tid = threadIdx.x;
    out[tid] = __shfl_down_sync(0xffffffffu, in[tid], 1);
    fout[tid] = __shfl_xor_sync(0xffffffffu, fin[tid], 5);
}

extern "C" __global__ void pk_t_vote(const int* pred, unsigned int* ballot, int* any, int* all, unsigned int mask) {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    if ((mask >> lane) & 1u) {
        const int p = pred[tid];
        ballot[tid] = __ballot_sync(mask, p);
        any[tid] = __any_sync(mask, p);
        all[tid] = __all_sync(mask, p);
        __syncwarp(mask);
    }
}

extern "C" __global__ void pk_t_sync_count(const int* pred, int* count, int* all, int* any) {
    const int tid = threadIdx.x;
    const int p = pred[tid];
    count[tid] = __syncthreads_count(p);
    all[tid] = __syncthreads_and(p);
    any[tid] = __syncthreads_or(p);
}

// Threads at or past n_active return before the barrier; the rest must still pass it.
extern "C" __global__ void pk_t_early_exit(const float* x, float* out, int n_active) {
    __shared__ float s[1024];
    const int tid = threadIdx.x;
    if (tid >= n_active) return;
    s[tid] = x[blockIdx.x * blockDim.x + tid];
    __syncthreads();
    out[blockIdx.x * blockDim.x + tid] = s[n_active - 1 - tid];
    __syncthreads();
    s[tid] = 0.0f;
}

extern "C" __global__ void pk_t_atomics(int* ic, unsigned int* uc, float* fc, double* dc) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(&ic[0], 1);
    atomicMax(&ic[1], g);
    atomicMin(&ic[2], -g);
    atomicSub(&ic[3], 2);
    int old = ic[4], assumed;
    do {  // CAS loop increment: the classic pattern must terminate and count exactly
        assumed = old;
        old = atomicCAS(&ic[4], assumed, assumed + 3);
    } while (old != assumed);
    if (g == 77) ic[5] = atomicExch(&ic[6], 1234) + 1000;
    atomicAdd(&uc[0], 2u);
    atomicMax(&uc[1], (unsigned)g * 3u);
    atomicMin(&uc[2], (unsigned)g + 5u);
    atomicCAS(&uc[3], (unsigned)g, 0xdeadu);  // only the thread whose g matches the current value swaps
    if (g == 10) atomicExch(&uc[4], 99u);
    atomicAnd(&uc[5], ~(1u << (g & 31)));
    atomicOr(&uc[6], 1u << (g & 31));
    atomicAdd(&fc[0], 0.5f);
    atomicMax(&fc[1], (float)g * 0.25f);
    atomicMin(&fc[2], -(float)g * 0.5f);
    if (g == 3) fc[3] = atomicExch(&fc[4], 2.5f);
    atomicAdd(&dc[0], 0.125);
    if (atomicCAS(&fc[5], 0.0f, (float)(g + 1)) == 0.0f) atomicAdd(&fc[6], 1.0f);  // exactly one winner
}

// Dynamic shared memory: per-block buffer of the launch's size, reversed through it.
extern "C" __global__ void pk_t_dyn_smem(const float* x, float* out, int n) {
    extern __shared__ float smem[];
    const int tid = threadIdx.x;
    const long long base = (long long)blockIdx.x * n;
    for (int i = tid; i < n; i += blockDim.x) smem[i] = x[base + i];
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) out[base + i] = smem[n - 1 - i] + (float)blockIdx.x;
}

// A second spelling, aligned bytes reinterpreted as float4.
extern "C" __global__ void pk_t_dyn_smem_vec(const float* x, float* out) {
    extern __shared__ __align__(16) unsigned char raw[];
    float4* v = reinterpret_cast<float4*>(raw);
    const int tid = threadIdx.x;
    v[tid] = reinterpret_cast<const float4*>(x)[tid];
    __syncthreads();
    const float4 w = v[blockDim.x - 1 - tid];
    reinterpret_cast<float4*>(out)[tid] = make_float4(w.w, w.z, w.y, w.x);
}

// pk_common.cuh: block sum/max of each row, bf16 round trip.
extern "C" __global__ void pk_t_common(const float* x, float* sums, float* maxes, unsigned short* bf, int n) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    float s = 0.0f, m = PK_NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = x[row * n + i];
        s += v;
        m = fmaxf(m, v);
        bf[row * n + i] = pk_float_to_bf16(v);
    }
    s = pk_block_sum(s, scratch);
    m = pk_block_max(m, scratch);
    if (threadIdx.x == 0) {
        sums[row] = s;
        maxes[row] = m;
    }
}

// The shared-scratch race: a block sum whose scratch is reused without a barrier after
// the result is read. With fix == 0 a fast warp overwrites scratch before a slow one reads.
extern "C" __global__ void pk_t_race(const float* x, float* out_a, float* out_b, int fix) {
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    const float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    float a = pk_warp_sum(v);
    if (lane == 0) scratch[warp] = a;
    __syncthreads();
    a = pk_warp_sum(lane < nw ? scratch[lane] : 0.0f);
    if (fix) __syncthreads();
    float b = pk_warp_sum(v * v);
    if (lane == 0) scratch[warp] = b;
    __syncthreads();
    b = pk_warp_sum(lane < nw ? scratch[lane] : 0.0f);
    out_a[blockIdx.x * blockDim.x + threadIdx.x] = a;
    out_b[blockIdx.x * blockDim.x + threadIdx.x] = b;
}

// Float intrinsics, elementwise; out has 20 values per input.
extern "C" __global__ void pk_t_math(const float* x, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = x[i];
    const float a = fabsf(v) + 0.5f;
    float* o = out + (long long)i * 20;
    o[0] = expf(v);
    o[1] = __expf(v);
    o[2] = exp2f(v);
    o[3] = logf(a);
    o[4] = __logf(a);
    o[5] = rsqrtf(a);
    o[6] = sqrtf(a);
    o[7] = fmaxf(v, 0.25f);
    o[8] = fminf(v, 0.25f);
    o[9] = __fdividef(v, a);
    o[10] = tanhf(v);
    o[11] = fmaf(v, a, 1.0f);
    o[12] = __int_as_float(__float_as_int(v) ^ 0x80000000);
    o[13] = (float)__float2uint_rn(a * 3.0f);
    o[14] = (float)min(-3, (int)(v * 4.0f));
    o[15] = (float)max(2, (int)(v * 4.0f));
    o[16] = (float)min(7u, (unsigned)(a * 4.0f));
    o[17] = log2f(a) + __powf(a, 1.5f);
    o[18] = __saturatef(v);
    o[19] = (float)__popc((unsigned)i) + (float)__clz(i + 1);
}

// Vector types and make_*.
extern "C" __global__ void pk_t_vec(const float* x, float* out, const unsigned int* u, unsigned int* uo) {
    const int t = threadIdx.x;
    const float4 a = reinterpret_cast<const float4*>(x)[t];
    const float2 b = make_float2(a.x + a.y, a.z * a.w);
    reinterpret_cast<float2*>(out)[t] = b;
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(u) + t);
    const uint2 r = make_uint2(q.x ^ q.y, q.z + q.w);
    reinterpret_cast<uint2*>(uo)[t] = r;
}

// ---- each runtime error -------------------------------------------------------------
// Lane 0 waits at the block barrier while lanes 1..31 wait in __syncwarp for it.
extern "C" __global__ void pk_t_err_deadlock(float* out) {
    if ((threadIdx.x & 31) == 0) __syncthreads();
    else __syncwarp();
    out[threadIdx.x] = 1.0f;
}

// Lanes 16..31 return; lanes 0..15 shuffle with a mask that still names them.
// Legal since sm_70: exited lanes count as arrived; lanes 0..15 only read lanes 0..15.
extern "C" __global__ void pk_t_err_mask(float* out) {
    float v = (float)threadIdx.x;
    if ((threadIdx.x & 31) >= 16) return;
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}

// The error: lanes 0..15 read lanes 16..31 (xor 16), which have exited.
extern "C" __global__ void pk_t_err_exited_read(float* out) {
    float v = (float)threadIdx.x;
    if ((threadIdx.x & 31) >= 16) return;
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    out[threadIdx.x] = v;
}

// The two halves of the block meet at different __syncthreads.
extern "C" __global__ void pk_t_err_partial(float* out) {
    if (threadIdx.x < 64) {
        __syncthreads();
        out[threadIdx.x] = 1.0f;
    } else {
        out[threadIdx.x] = 2.0f;
        __syncthreads();
    }
}

extern "C" __global__ void pk_t_err_self(float* out) {
    out[threadIdx.x] = __shfl_sync(0x1u, 1.0f, 0);  // lane 1 is not in its own mask
}

extern "C" __global__ void pk_t_err_width(float* out) {
    out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1.0f, 1, 3);
}

extern "C" __global__ void pk_t_err_trap(float* out) {
    if (blockIdx.x == 1 && threadIdx.x == 5) __trap();
    out[threadIdx.x] = 1.0f;
}

// ---- sanitizer -------------------------------------------------------------------
// Writes one element past the end of `out` (n elements) from the last thread.
extern "C" __global__ void pk_t_oob(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i] = 1.0f;
}

// The same kernel with the bound right: must run clean under the sanitizer.
extern "C" __global__ void pk_t_inb(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 1.0f;
}

// Reads one float past the dynamic shared buffer.
extern "C" __global__ void pk_t_oob_smem(float* out) {
    extern __shared__ float smem[];
    smem[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = smem[threadIdx.x + 1];
}

// Undefined behaviour UBSan must report: a shift by more than the width.
extern "C" __global__ void pk_t_ub_shift(int* out, int s) {
    out[threadIdx.x] = 1 << (s + (int)threadIdx.x);
}

extern "C" __global__ void pk_t_err_assert(float* out) {
    assert(threadIdx.x != 9);
    out[threadIdx.x] = 1.0f;
}

// In-place use: y and x may be the same array; the second statement must see the first.
extern "C" __global__ void pk_t_alias(const float* x, float* y) {
    y[threadIdx.x] = 5.0f;
    y[threadIdx.x] += x[threadIdx.x];
}

// 3-D geometry: every thread records its indices, dims and lane (warps follow the linear id).
extern "C" __global__ void pk_t_dims(int* out) {
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int nt = blockDim.x * blockDim.y * blockDim.z;
    int* o = out + ((long long)b * nt + t) * 10;
    o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
    o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z;
    o[6] = blockDim.x * 10000 + blockDim.y * 100 + blockDim.z;
    o[7] = gridDim.x * 10000 + gridDim.y * 100 + gridDim.z;
    o[8] = __shfl_sync(0xffffffffu, t, 0);  // lane 0 of this thread's warp
    o[9] = warpSize;
}

// sm_70/80 warp intrinsics: match and reduce.
extern "C" __global__ void pk_t_match_reduce(const int* v, unsigned int* match_any, unsigned int* match_all,
                                             int* pred, unsigned int* sum, int* smin, unsigned int* uor) {
    const int t = threadIdx.x;
    int p = 0;
    match_any[t] = __match_any_sync(0xffffffffu, v[t]);
    match_all[t] = __match_all_sync(0x0000ffffu | (0xffffu << 16), v[t] & 1, &p);
    pred[t] = p;
    sum[t] = __reduce_add_sync(0xffffffffu, (unsigned)v[t]);
    smin[t] = __reduce_min_sync(0xffffffffu, v[t] - 5);
    uor[t] = __reduce_or_sync(0xffffffffu, 1u << (v[t] & 31));
}
