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
