// Signatures the registry must type (test-only kernels; never launched).
extern "C" __global__ void pk_reg_plain(const float* __restrict__ x, float* y, const unsigned int n, float eps) {}
/* a commented-out kernel must not register:
extern "C" __global__ void pk_reg_commented(float* x) {}
*/
extern "C" __global__ void __launch_bounds__(256) pk_reg_bounds(
    const unsigned short* __restrict__ x,   // bf16 bits
    unsigned long long n,
    long long m, int k, unsigned char flag, double d, bool b, unsigned u, size_t s) {}
extern "C" __global__ void pk_reg_empty() {}
