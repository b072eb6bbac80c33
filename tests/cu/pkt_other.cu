// Test-only: a second file with no includes.
extern "C" __global__ void pkt_fill(float* out, float value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
