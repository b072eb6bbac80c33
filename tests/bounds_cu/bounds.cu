// Test-only kernels for the host backend's bounds checks (tests/test_host_bounds.py, joined to the
// registry through PYKERN_KERNEL_PATH). Offsets are in bytes and may be negative or far out of range.

// Thread 0 of block 0 stores one byte at byte offset `off` of x (x stays a float*, as in a real kernel).
extern "C" __global__ void pkbounds_write_byte(float* x, long long off) {
    if (blockIdx.x == 0 && threadIdx.x == 0) reinterpret_cast<unsigned char*>(x)[off] = 0x5a;
}

// Thread 0 of block 0 copies the byte at byte offset `off` of x into out[0]; x is read-only.
extern "C" __global__ void pkbounds_read_byte(const float* x, unsigned char* out, long long off) {
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = reinterpret_cast<const unsigned char*>(x)[off];
}

// y[i] = 2 * x[i] for i < n: a well-behaved launch after a failed one.
extern "C" __global__ void pkbounds_twice(float* y, const float* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}

// Thread 0 loads a float from the raw address `addr` (no argument's memory) into out[0].
extern "C" __global__ void pkbounds_read_address(float* out, unsigned long long addr) {
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = *reinterpret_cast<const float*>(addr);
}

#include "pk_ptx.cuh"

// Shared memory out of bounds (the launch's dynamic bytes; `st`: the static ones): byte offset `off` of the dynamic
// shared memory (of st for mode 5). mode 0: thread 1 stores a float there; 1: thread 1 loads one into out[0];
// 2: thread 1 reads 16 bytes with pk_ld_shared_b128; 3: thread 1 copies 16 bytes of src there with cp.async;
// 4: warp 0's ldmatrix .x4 with lane l's row at off + 16 l; 5: thread 1 stores the float at byte off of st[4].
extern "C" __global__ void pkbounds_smem(const float* src, float* out, long long off, int mode) {
    extern __shared__ __align__(16) unsigned char dsm[];
    __shared__ __align__(16) float st[4];
    unsigned char* p = dsm + off;
    const unsigned t = threadIdx.x;
    if (t < 4) st[t] = 0.0f;
    __syncthreads();
    if (mode == 0 && t == 1) *reinterpret_cast<float*>(p) = 1.0f;
    if (mode == 1 && t == 1) out[0] = *reinterpret_cast<const float*>(p);
    if (mode == 2 && t == 1) out[0] = __uint_as_float(pk_ld_shared_b128(p).x);
    if (mode == 3 && t == 1) {
        pk_cp_async_16(p, src);
        pk_cp_async_commit();
        pk_cp_async_wait_all();
    }
    if (mode == 4 && t < 32) {
        unsigned r[4];
        pk_ldmatrix_x4(r, p + 16 * t);
        out[t] = __uint_as_float(r[0]);
    }
    if (mode == 5 && t == 1) *reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(st) + off) = 1.0f;
}
