// Planted CUDA hazards for tests/test_host_hazards.py: each kernel is either a real bug
// that the host backend must expose, or legal code it must run.
#include "pk_common.cuh"

// ---- inter-block hazards (block schedules) ----------------------------------------
// Bug: block 0 zeroes the accumulator the other blocks add into (no ordering between blocks).
extern "C" __global__ void pk_h_zero_then_add(float* acc, const float* x) {
    if (blockIdx.x == 0 && threadIdx.x == 0) acc[0] = 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(acc, x[blockIdx.x]);
}

// Bug: "the last block" chosen by blockIdx instead of an atomic ticket.
extern "C" __global__ void pk_h_last_block_by_index(float* partial, float* out, const float* x) {
    if (threadIdx.x == 0) partial[blockIdx.x] = x[blockIdx.x] * 2.0f;
    __syncthreads();
    if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) {
        float s = 0.0f;
        for (unsigned b = 0; b < gridDim.x; b++) s += partial[b];
        out[0] = s;
    }
}

// Order-dependent float sum: each block adds one value (different magnitudes).
extern "C" __global__ void pk_h_float_atomic_order(float* acc, const float* x) {
    if (threadIdx.x == 0) atomicAdd(acc, x[blockIdx.x]);
}

// Block 1 spin-waits on a flag block 0 sets: finishes only if block 0 can run meanwhile.
extern "C" __global__ void pk_h_cross_block_spin(int* flag, int* data, int* out) {
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0) {
        data[0] = 42;
        __threadfence();
        atomicExch(flag, 1);
    } else {
        while (atomicAdd(flag, 0) == 0) {
        }
        __threadfence();
        out[0] = data[0];
    }
}

// Legal: the last block by an atomic ticket sums every block's partial (split-KV decode's fixup pattern):
// plain stores, __threadfence, a barrier, the ticket; the last block fences and reads the partials with
// strong loads (pk_ld_relaxed_gpu). relaxed = 0 reads them with plain loads: correct on the host and in
// practice, but racecheck cannot see the fence-atomic ordering of plain accesses and reports it.
template <int RELAXED>
__device__ __forceinline__ void pk_h_ticket_sum(float* partial, unsigned* ticket, float* out, const float* x) {
    if (threadIdx.x == 0) partial[blockIdx.x] = x[blockIdx.x] * 2.0f;
    __threadfence();
    const int last = __syncthreads_or(threadIdx.x == 0 && atomicInc(ticket, gridDim.x - 1) == gridDim.x - 1);
    if (!last || threadIdx.x != 0) return;
    __threadfence();
    float s = 0.0f;
    for (unsigned b = 0; b < gridDim.x; b++) s += RELAXED ? pk_ld_relaxed_gpu(partial + b) : partial[b];
    out[0] = s;
}
extern "C" __global__ void pk_h_ticket_sum_relaxed(float* partial, unsigned* ticket, float* out, const float* x) {
    pk_h_ticket_sum<1>(partial, ticket, out, x);
}
extern "C" __global__ void pk_h_ticket_sum_plain(float* partial, unsigned* ticket, float* out, const float* x) {
    pk_h_ticket_sum<0>(partial, ticket, out, x);
}
// decode_tc.cu's form: every thread stores, a barrier, thread 0's ticket as one acq_rel RMW
// (pk_atom_inc_acq_rel_gpu), no fence; every thread of the last block reads the partials with strong loads.
extern "C" __global__ void pk_h_ticket_sum_acq_rel(float* partial, unsigned* ticket, float* out, const float* x) {
    partial[blockIdx.x * blockDim.x + threadIdx.x] = x[blockIdx.x] * 2.0f + (float)threadIdx.x;
    __syncthreads();
    const int last = __syncthreads_or(threadIdx.x == 0 &&
                                      pk_atom_inc_acq_rel_gpu(ticket, gridDim.x - 1) == gridDim.x - 1);
    if (!last) return;
    float s = 0.0f;
    for (unsigned b = 0; b < gridDim.x; b++) s += pk_ld_relaxed_gpu(partial + b * blockDim.x + threadIdx.x);
    out[threadIdx.x] = s;
}

// Each block keeps its id in static shared memory across a barrier.
extern "C" __global__ void pk_h_static_smem_per_block(int* out) {
    __shared__ int mine[64];
    mine[threadIdx.x] = (int)blockIdx.x * 1000 + (int)threadIdx.x;
    __syncthreads();
    atomicAdd(&out[0], 0);  // a yield point under the interleaved schedule
    __syncthreads();
    out[1 + blockIdx.x * blockDim.x + threadIdx.x] = mine[(threadIdx.x + 1) % blockDim.x];
}

// Bug: a static shared accumulator nobody initialises (0 only by luck of a C++ static).
extern "C" __global__ void pk_h_uninit_static(const float* x, float* out) {
    __shared__ float acc;
    if (threadIdx.x == 0) acc += x[blockIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

// ---- legal code (no false alarms) ---------------------------------------------------
// Warp-aggregated atomic: one atomicAdd per converged group, built on __activemask().
extern "C" __global__ void pk_h_warp_aggregated(const int* pred, int* counter, int* slot, unsigned int* masks) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x & 31;
    slot[t] = -1;
    masks[t] = 0;
    if (pred[t]) {
        const unsigned m = __activemask();
        const int leader = __ffs((int)m) - 1;
        int base = 0;
        if (lane == leader) base = atomicAdd(counter, __popc(m));
        base = __shfl_sync(m, base, leader);
        slot[t] = base + __popc(m & ((1u << lane) - 1u));
        masks[t] = m;
    }
}

// warpSize is a constant, and a local variable may take its name.
extern "C" __global__ void pk_h_warpsize(int* out) {
    const int w = warpSize;
    {
        int warpSize = 7;
        out[1] = warpSize;
    }
    out[0] = w;
}

// ---- never a hang ---------------------------------------------------------------------
extern "C" __global__ void pk_h_spin_forever(const int* flag, int* out) {
    const volatile int* f = flag;
    if (threadIdx.x == 3) {
        while (f[0] == 0) {
        }
    }
    out[threadIdx.x] = 1;
}

// ---- memory errors without a crash --------------------------------------------------------
extern "C" __global__ void pk_h_null_store(float* out, long long addr) {
    float* p = reinterpret_cast<float*>(addr);
    if (blockIdx.x == 1 && threadIdx.x == 7) p[0] = 1.0f;
    out[threadIdx.x] = 2.0f;
}

// n floats of per-thread local memory (a big local array, as a GPU kernel may have).
extern "C" __global__ void pk_h_local_array(const float* x, float* out, int n) {
    float buf[160 * 256];  // 160 KiB
    const int m = n < 160 * 256 ? n : 160 * 256;
    for (int i = 0; i < m; i++) buf[i] = x[i % 64] + (float)i;
    float s = 0.0f;
    for (int i = m - 1; i >= 0; i--) s += buf[i];
    out[threadIdx.x] = s;
}

extern "C" __global__ void pk_h_huge_local_array(const float* x, float* out, int n) {
    float buf[1024 * 1024];  // 4 MiB: more than a fiber stack holds
    for (int i = 0; i < n; i++) buf[(long long)i * 997 % (1024 * 1024)] = x[i % 64];
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += buf[(long long)i * 991 % (1024 * 1024)];
    out[threadIdx.x] = s;
}

// ---- launch limits ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(128) pk_h_bounded(float* out) { out[threadIdx.x] = 1.0f; }

// 40 KiB static + the launch's dynamic bytes.
extern "C" __global__ void pk_h_big_static(float* out) {
    __shared__ float big[10 * 1024];
    big[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = big[threadIdx.x];
}

extern "C" __global__ void pk_h_too_much_static(float* out) {
    __shared__ float huge[13 * 1024];  // 52 KiB > 48 KiB
    huge[threadIdx.x] = 1.0f;
    out[threadIdx.x] = huge[threadIdx.x];
}

// ---- GPU numerics -----------------------------------------------------------------------
// a*b - c*d with a == c, b == d: NVRTC contracts to fma(a, b, -(c*d)), the rounding error of a*b.
extern "C" __global__ void pk_h_fma_contract(const float* a, const float* b, const float* c, const float* d,
                                             float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * b[i] - c[i] * d[i];
}

extern "C" __global__ void pk_h_fast_math(const float* x, const float* y, float* out, int n) {
    const int i = threadIdx.x;
    if (i >= n) return;
    out[i * 6 + 0] = __fdividef(x[i], y[i]);
    out[i * 6 + 1] = __expf(x[i]);
    out[i * 6 + 2] = __logf(x[i]);
    out[i * 6 + 3] = rsqrtf(x[i]);
    out[i * 6 + 4] = __sinf(x[i]);
    out[i * 6 + 5] = (float)__float2int_rz(x[i] * y[i]);
}

// Integer division / remainder by a runtime divisor (0 in the planted case).
extern "C" __global__ void pk_h_int_div(const int* a, const int* b, int* q, int* r, const unsigned int* ua,
                                        const unsigned int* ub, unsigned int* uq, const long long* la,
                                        const long long* lb, long long* lq, int n) {
    const int i = threadIdx.x;
    if (i >= n) return;
    q[i] = a[i] / b[i];
    r[i] = a[i] % b[i];
    uq[i] = ua[i] / ub[i];
    lq[i] = la[i] / lb[i];
}

extern "C" __global__ void pk_h_mul24_sad(const int* a, const int* b, int* m, unsigned int* s, int n) {
    const int i = threadIdx.x;
    if (i >= n) return;
    m[i] = __mul24(a[i], b[i]);
    s[i] = __sad(a[i], b[i], 1u);
}

// ---- memory errors ------------------------------------------------------------------------
// Bug: the last thread writes one element past the end of out (n elements).
extern "C" __global__ void pk_h_oob_write(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i] = 1.0f;
}

// Bug: float4 loads from x + 1 (4-byte aligned, not 16): a misaligned address on a GPU.
extern "C" __global__ void pk_h_misaligned_float4(const float* x, float* out, int shift) {
    const float4* p = reinterpret_cast<const float4*>(x + shift);
    float4 v = p[threadIdx.x];
    reinterpret_cast<float4*>(out)[threadIdx.x] = v;
}

// ---- racecheck ------------------------------------------------------------------------------
// Bug: every thread does counter += 1 (a lost update on a GPU).
extern "C" __global__ void pk_h_lost_update(int* counter) { counter[0] += 1; }

// Bug: the same on shared memory, then thread 0 publishes it.
extern "C" __global__ void pk_h_lost_update_shared(int* out) {
    __shared__ int c;
    if (threadIdx.x == 0) c = 0;
    __syncthreads();
    c += 1;
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = c;
}

// Bug: check-then-act maximum in shared memory.
extern "C" __global__ void pk_h_check_then_act(const float* x, float* out) {
    __shared__ float m;
    if (threadIdx.x == 0) m = -1e30f;
    __syncthreads();
    const float v = x[threadIdx.x];
    if (v > m) m = v;
    __syncthreads();
    if (threadIdx.x == 0) out[0] = m;
}

// sync = 0: a shuffle used as a memory fence (a bug); 1: __syncwarp (correct).
extern "C" __global__ void pk_h_shuffle_fence(float* out, int sync) {
    __shared__ float s[32];
    const int lane = threadIdx.x & 31;
    s[lane] = (float)lane;
    if (sync) __syncwarp();
    else (void)__shfl_sync(0xffffffffu, 0, 0);
    out[lane] = s[(lane + 1) & 31];
}

// sync = 0: lanes store their rows of a shared tile and ldmatrix reads other lanes' rows with nothing between
// (a bug: ldmatrix orders nothing among the warp's lanes); 1: __syncwarp between (correct). Lane l writes row
// l (8 b16, all l + 1) and addresses row (l + 1) % 32.
extern "C" __global__ void pk_h_ldmatrix_fence(unsigned int* out, int sync) {
    __shared__ __align__(16) unsigned short s[32 * 8];
    const int lane = threadIdx.x & 31;
    for (int i = 0; i < 8; i++) s[lane * 8 + i] = (unsigned short)(lane + 1);
    if (sync) __syncwarp();
    unsigned int r[4];
    pk_ldmatrix_x4(r, s + ((lane + 1) & 31) * 8);
    for (int i = 0; i < 4; i++) out[lane * 4 + i] = r[i];
}

// Correct: shared-memory tree reduction with barriers, atomics into global.
extern "C" __global__ void pk_h_clean_reduce(const float* x, float* sum) {
    __shared__ float s[64];
    s[threadIdx.x] = x[blockIdx.x * 64 + threadIdx.x];
    __syncthreads();
    for (int off = 32; off > 0; off >>= 1) {
        if ((int)threadIdx.x < off) s[threadIdx.x] += s[threadIdx.x + off];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(sum, s[0]);
}

// Bug for initcheck: thread t reads s[t + 1], which nobody wrote for the last thread.
extern "C" __global__ void pk_h_uninit_read(float* out) {
    __shared__ float s[64];
    if (threadIdx.x < 63) s[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = s[(threadIdx.x + 1) & 63];
}

// A plain float -> int cast: saturating on a GPU, UB in C++ for 3e9 (the sanitizer reports it).
extern "C" __global__ void pk_h_float_cast(const float* x, int* out, int n) {
    const int i = threadIdx.x;
    if (i < n) out[i] = (int)x[i];
}

// Bug: one global scratch buffer shared by every block.
extern "C" __global__ void pk_h_shared_scratch(const float* x, float* scratch, float* out) {
    const int t = threadIdx.x;
    scratch[t] = x[blockIdx.x * blockDim.x + t] * 2.0f;
    __syncthreads();
    atomicAdd(&out[blockDim.x * gridDim.x], 0.0f);  // a yield point under `interleave`
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = scratch[(t + 1) % blockDim.x];
}

// Bug: in place, each element takes its right neighbour: a block reads what the next block writes.
extern "C" __global__ void pk_h_inplace_shift(float* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = 0.0f;
    if (i + 1 < n) v = x[i + 1];
    __syncthreads();
    if (i < n) x[i] = v;
}

// Legal: a 48-byte struct built on the stack and handed to a function by address (as the wgmma wrappers do with
// their operand record), then copied whole into global memory. The checked build sees such copies as range
// accesses of 48 bytes; they are no vector access (a GPU stores 4-byte words), so no alignment rule applies.
struct pk_h_rec48 { int v[12]; };
__device__ __noinline__ void pk_h_rec48_store(const pk_h_rec48* r, pk_h_rec48* dst) { *dst = *r; }
extern "C" __global__ void pk_h_struct48_copy(const int* x, int* out) {
    const int* s = x + threadIdx.x * 12;
    pk_h_rec48 r{{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11]}};
    pk_h_rec48_store(&r, reinterpret_cast<pk_h_rec48*>(out) + threadIdx.x);
}
