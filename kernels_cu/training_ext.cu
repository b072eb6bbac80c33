// Training ops beyond the seeds (issue 15): fused residual-add + RMSNorm, LayerNorm,
// GELU / GeGLU, each forward and backward.
//
// Every body is templated on the I/O type (float or unsigned short = bf16 bits)
// and computes in fp32. Offsets are 64-bit; rows and elements are walked with
// grid-stride loops so the ops may clamp grid sizes. Row kernels run one block
// per row (blockDim.x a multiple of 32, <= 512). Norm weight / bias gradients
// are reduced without float atomics: per-(row chunk, column) partial sums in a
// fixed order, then a fixed-order sum over chunks (norm_grad_reduce), so they
// are identical from run to run.
#include "pk_vec.cuh"

// ---------------------------------------------------------------------------
// add_rms_norm: h = x + residual (narrowed to T, as the unfused add would store
// it), new_residual = h, y = h * rsqrt(mean(h^2) + eps) * weight. One block per
// row: pass 1 writes new_residual and sums h^2, pass 2 re-reads new_residual
// (this thread's own writes: L1/L2-hot) and writes y. In place, y may alias x
// and new_residual alias residual (each element is read and written by the
// same thread, reads first), so those pointers are not __restrict__.
template <typename T>
__device__ __forceinline__ void add_rms_norm_body(const T* x, const T* residual, const T* __restrict__ weight,
                                                  T* y, T* new_res, long long n_rows, unsigned int dim, float eps,
                                                  float* scratch) {
    const long long n = dim;
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const long long base = row * n;
        float ss = 0.0f;
        for (long long i = threadIdx.x; i < n; i += blockDim.x) {
            PkIO<T>::store(new_res, base + i, PkIO<T>::load(x, base + i) + PkIO<T>::load(residual, base + i));
            const float h = PkIO<T>::load(new_res, base + i);
            ss += h * h;
        }
        const float r = rsqrtf(pk_block_sum(ss, scratch) / (float)n + eps);
        for (long long i = threadIdx.x; i < n; i += blockDim.x)
            PkIO<T>::store(y, base + i, PkIO<T>::load(new_res, base + i) * r * PkIO<T>::load(weight, i));
    }
}

extern "C" __global__ void __launch_bounds__(512, 1) add_rms_norm(
    const float* x, const float* residual, const float* __restrict__ weight, float* y, float* new_residual,
    long long n_rows, unsigned int dim, float eps) {
    __shared__ float scratch[32];
    add_rms_norm_body<float>(x, residual, weight, y, new_residual, n_rows, dim, eps, scratch);
}

extern "C" __global__ void __launch_bounds__(512, 1) add_rms_norm_bf16(
    const unsigned short* x, const unsigned short* residual, const unsigned short* __restrict__ weight,
    unsigned short* y, unsigned short* new_residual, long long n_rows, unsigned int dim, float eps) {
    __shared__ float scratch[32];
    add_rms_norm_body<unsigned short>(x, residual, weight, y, new_residual, n_rows, dim, eps, scratch);
}

// ---------------------------------------------------------------------------
// add_rms_norm_backward: with h = new_residual, r = rsqrt(mean(h^2) + eps),
//   grad_h = r * w * gy - h * r^3 * sum(h * w * gy) / dim  (+ grad_new_residual)
// and grad_x = grad_residual = grad_h (one gradient path). rstd[row] = r feeds
// the weight gradient (norm_weight_grad). has_gres = 0: no grad_new_residual
// (gres is then any valid pointer and is not read).
template <typename T>
__device__ __forceinline__ void add_rms_norm_backward_body(
    const T* __restrict__ h, const T* __restrict__ weight, const T* __restrict__ gy, const T* __restrict__ gres,
    T* __restrict__ gh, float* __restrict__ rstd, long long n_rows, unsigned int dim, float eps, int has_gres,
    float* scratch) {
    const long long n = dim;
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const long long base = row * n;
        float ss = 0.0f, dot = 0.0f;
        for (long long i = threadIdx.x; i < n; i += blockDim.x) {
            const float hv = PkIO<T>::load(h, base + i);
            ss += hv * hv;
            dot += hv * PkIO<T>::load(weight, i) * PkIO<T>::load(gy, base + i);
        }
        ss = pk_block_sum(ss, scratch);
        dot = pk_block_sum(dot, scratch);
        const float r = rsqrtf(ss / (float)n + eps);
        const float c = r * r * r * dot / (float)n;
        if (threadIdx.x == 0) rstd[row] = r;
        for (long long i = threadIdx.x; i < n; i += blockDim.x) {
            float g = r * PkIO<T>::load(weight, i) * PkIO<T>::load(gy, base + i) - PkIO<T>::load(h, base + i) * c;
            if (has_gres) g += PkIO<T>::load(gres, base + i);
            PkIO<T>::store(gh, base + i, g);
        }
    }
}

extern "C" __global__ void __launch_bounds__(512, 1) add_rms_norm_backward(
    const float* __restrict__ h, const float* __restrict__ weight, const float* __restrict__ gy,
    const float* __restrict__ gres, float* __restrict__ gh, float* __restrict__ rstd, long long n_rows,
    unsigned int dim, float eps, int has_gres) {
    __shared__ float scratch[32];
    add_rms_norm_backward_body<float>(h, weight, gy, gres, gh, rstd, n_rows, dim, eps, has_gres, scratch);
}

extern "C" __global__ void __launch_bounds__(512, 1) add_rms_norm_backward_bf16(
    const unsigned short* __restrict__ h, const unsigned short* __restrict__ weight,
    const unsigned short* __restrict__ gy, const unsigned short* __restrict__ gres, unsigned short* __restrict__ gh,
    float* __restrict__ rstd, long long n_rows, unsigned int dim, float eps, int has_gres) {
    __shared__ float scratch[32];
    add_rms_norm_backward_body<unsigned short>(h, weight, gy, gres, gh, rstd, n_rows, dim, eps, has_gres, scratch);
}

// ---------------------------------------------------------------------------
// layer_norm: y = (x - mean) * rstd * w + b, rstd = rsqrt(var + eps) with the
// biased variance (torch's). Two-pass statistics (mean, then sum of squared
// deviations) for accuracy on rows with a large mean. has_w / has_b = 0: no
// weight / bias (the pointer is any valid one and is not read).
template <typename T>
__device__ __forceinline__ void layer_norm_body(const T* __restrict__ x, const T* __restrict__ w,
                                                const T* __restrict__ b, T* __restrict__ y, long long n_rows,
                                                unsigned int dim, float eps, int has_w, int has_b, float* scratch) {
    const long long n = dim;
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const long long base = row * n;
        float s = 0.0f;
        for (long long i = threadIdx.x; i < n; i += blockDim.x) s += PkIO<T>::load(x, base + i);
        const float mean = pk_block_sum(s, scratch) / (float)n;
        float v = 0.0f;
        for (long long i = threadIdx.x; i < n; i += blockDim.x) {
            const float d = PkIO<T>::load(x, base + i) - mean;
            v += d * d;
        }
        const float rstd = rsqrtf(pk_block_sum(v, scratch) / (float)n + eps);
        for (long long i = threadIdx.x; i < n; i += blockDim.x) {
            float o = (PkIO<T>::load(x, base + i) - mean) * rstd;
            if (has_w) o *= PkIO<T>::load(w, i);
            if (has_b) o += PkIO<T>::load(b, i);
            PkIO<T>::store(y, base + i, o);
        }
    }
}

extern "C" __global__ void __launch_bounds__(512, 1) layer_norm(
    const float* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ bias,
    float* __restrict__ y, long long n_rows, unsigned int dim, float eps, int has_w, int has_b) {
    __shared__ float scratch[32];
    layer_norm_body<float>(x, weight, bias, y, n_rows, dim, eps, has_w, has_b, scratch);
}

extern "C" __global__ void __launch_bounds__(512, 1) layer_norm_bf16(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ weight,
    const unsigned short* __restrict__ bias, unsigned short* __restrict__ y, long long n_rows, unsigned int dim,
    float eps, int has_w, int has_b) {
    __shared__ float scratch[32];
    layer_norm_body<unsigned short>(x, weight, bias, y, n_rows, dim, eps, has_w, has_b, scratch);
}

// layer_norm_backward row kernel: xhat = (x - mean) * rstd, gxhat = g * w,
//   grad_x = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat)).
// mean[row] and rstd[row] feed the weight / bias gradients (norm_weight_grad).
template <typename T>
__device__ __forceinline__ void layer_norm_backward_body(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ g, T* __restrict__ gx,
    float* __restrict__ mean_out, float* __restrict__ rstd_out, long long n_rows, unsigned int dim, float eps,
    int has_w, float* scratch) {
    const long long n = dim;
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const long long base = row * n;
        float s = 0.0f;
        for (long long i = threadIdx.x; i < n; i += blockDim.x) s += PkIO<T>::load(x, base + i);
        const float mean = pk_block_sum(s, scratch) / (float)n;
        float v = 0.0f;
        for (long long i = threadIdx.x; i < n; i += blockDim.x) {
            const float d = PkIO<T>::load(x, base + i) - mean;
            v += d * d;
        }
        const float rstd = rsqrtf(pk_block_sum(v, scratch) / (float)n + eps);
        float sg = 0.0f, sgx = 0.0f;
        for (long long i = threadIdx.x; i < n; i += blockDim.x) {
            float gh = PkIO<T>::load(g, base + i);
            if (has_w) gh *= PkIO<T>::load(w, i);
            sg += gh;
            sgx += gh * (PkIO<T>::load(x, base + i) - mean) * rstd;
        }
        // An inf in g * w makes mg and mgx infinite, and then the row's grad_x a data-dependent
        // mix of +-inf and NaN (torch's fused CPU and CUDA kernels give two different mixes).
        // Like torch's autograd of the layer_norm formula, the whole row is NaN instead:
        // (v - v) is 0 for finite v and NaN for +-inf / NaN, two FADDs a row.
        float mg = pk_block_sum(sg, scratch) / (float)n;
        const float mgx = pk_block_sum(sgx, scratch) / (float)n;
        mg += (mg - mg) + (mgx - mgx);
        if (threadIdx.x == 0) {
            mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
        for (long long i = threadIdx.x; i < n; i += blockDim.x) {
            float gh = PkIO<T>::load(g, base + i);
            if (has_w) gh *= PkIO<T>::load(w, i);
            const float xh = (PkIO<T>::load(x, base + i) - mean) * rstd;
            PkIO<T>::store(gx, base + i, rstd * (gh - mg - xh * mgx));
        }
    }
}

extern "C" __global__ void __launch_bounds__(512, 1) layer_norm_backward(
    const float* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ grad_out,
    float* __restrict__ grad_x, float* __restrict__ mean, float* __restrict__ rstd, long long n_rows,
    unsigned int dim, float eps, int has_w) {
    __shared__ float scratch[32];
    layer_norm_backward_body<float>(x, weight, grad_out, grad_x, mean, rstd, n_rows, dim, eps, has_w, scratch);
}

extern "C" __global__ void __launch_bounds__(512, 1) layer_norm_backward_bf16(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ weight,
    const unsigned short* __restrict__ grad_out, unsigned short* __restrict__ grad_x, float* __restrict__ mean,
    float* __restrict__ rstd, long long n_rows, unsigned int dim, float eps, int has_w) {
    __shared__ float scratch[32];
    layer_norm_backward_body<unsigned short>(x, weight, grad_out, grad_x, mean, rstd, n_rows, dim, eps, has_w,
                                             scratch);
}

// ---------------------------------------------------------------------------
// norm_weight_grad: per row chunk k and column c,
//   pw[k][c] = sum over the chunk's rows of (x[r][c] - mean[r]) * rstd[r] * g[r][c]
//   pb[k][c] = sum over the chunk's rows of g[r][c]                  (want_bias)
// mean is subtracted only when has_mean (LayerNorm; RMSNorm passes has_mean = 0).
// Block (32, 8): 32 adjacent columns (coalesced), 8 row lanes summed in a fixed
// order through shared memory. Grid (ceil(dim / 32), n_chunks).
template <typename T>
__device__ __forceinline__ void norm_weight_grad_body(
    const T* __restrict__ x, const T* __restrict__ g, const float* __restrict__ mean, const float* __restrict__ rstd,
    float* __restrict__ pw, float* __restrict__ pb, long long n_rows, unsigned int dim, long long rows_per_chunk,
    int has_mean, int want_bias) {
    __shared__ float sw[8][33];
    __shared__ float sb[8][33];
    const unsigned int c = blockIdx.x * 32u + threadIdx.x;
    const long long r0 = (long long)blockIdx.y * rows_per_chunk;
    const long long r1 = r0 + rows_per_chunk < n_rows ? r0 + rows_per_chunk : n_rows;
    float aw = 0.0f, ab = 0.0f;
    if (c < dim) {
        for (long long r = r0 + threadIdx.y; r < r1; r += 8) {
            const long long k = r * (long long)dim + c;
            const float gv = PkIO<T>::load(g, k);
            const float xv = PkIO<T>::load(x, k) - (has_mean ? mean[r] : 0.0f);
            aw += xv * rstd[r] * gv;
            ab += gv;
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && c < dim) {
        float tw = 0.0f, tb = 0.0f;
        for (int k = 0; k < 8; ++k) {
            tw += sw[k][threadIdx.x];
            tb += sb[k][threadIdx.x];
        }
        const long long o = (long long)blockIdx.y * dim + c;
        pw[o] = tw;
        if (want_bias) pb[o] = tb;
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) norm_weight_grad(
    const float* __restrict__ x, const float* __restrict__ grad_out, const float* __restrict__ mean,
    const float* __restrict__ rstd, float* __restrict__ pw, float* __restrict__ pb, long long n_rows,
    unsigned int dim, long long rows_per_chunk, int has_mean, int want_bias) {
    norm_weight_grad_body<float>(x, grad_out, mean, rstd, pw, pb, n_rows, dim, rows_per_chunk, has_mean, want_bias);
}

extern "C" __global__ void __launch_bounds__(256, 1) norm_weight_grad_bf16(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ grad_out,
    const float* __restrict__ mean, const float* __restrict__ rstd, float* __restrict__ pw, float* __restrict__ pb,
    long long n_rows, unsigned int dim, long long rows_per_chunk, int has_mean, int want_bias) {
    norm_weight_grad_body<unsigned short>(x, grad_out, mean, rstd, pw, pb, n_rows, dim, rows_per_chunk, has_mean,
                                          want_bias);
}

// out[c] = sum_k partial[k][c], k ascending: one thread per column.
extern "C" __global__ void __launch_bounds__(256, 1) norm_grad_reduce(
    const float* __restrict__ partial, float* __restrict__ out, long long n_chunks, unsigned int dim) {
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < dim;
         c += (long long)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (long long k = 0; k < n_chunks; ++k) s += partial[k * dim + c];
        out[c] = s;
    }
}

// ---------------------------------------------------------------------------
// GELU, as torch.nn.functional.gelu:
//   "none" (approx = 0): gelu(x) = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)),
//                        gelu'(x) = Phi(x) + x * exp(-x^2 / 2) / sqrt(2 pi)
//   "tanh" (approx = 1): u = sqrt(2/pi) (x + 0.044715 x^3), t = tanh(u),
//                        gelu(x) = 0.5 x (1 + t),
//                        gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
#define PK_SQRT1_2 0.70710678118654752f
#define PK_INV_SQRT_2PI 0.39894228040143268f
#define PK_SQRT_2_OVER_PI 0.79788456080286536f

__device__ __forceinline__ float pk_gelu(float x, int approx) {
    if (approx) {
        const float t = tanhf(PK_SQRT_2_OVER_PI * (x + 0.044715f * x * x * x));
        return 0.5f * x * (1.0f + t);
    }
    return 0.5f * x * (1.0f + erff(x * PK_SQRT1_2));
}

__device__ __forceinline__ float pk_gelu_grad(float x, int approx) {
    if (approx) {
        const float t = tanhf(PK_SQRT_2_OVER_PI * (x + 0.044715f * x * x * x));
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * PK_SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * x * x);
    }
    return 0.5f * (1.0f + erff(x * PK_SQRT1_2)) + x * expf(-0.5f * x * x) * PK_INV_SQRT_2PI;
}

template <typename T>
__device__ __forceinline__ void gelu_body(const T* __restrict__ x, T* __restrict__ y, long long n, int approx) {
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    if (n % 4 == 0 && pk_vec_aligned(x) && pk_vec_aligned(y)) {
        for (long long i = 4 * t0; i < n; i += 4 * step) {
            float4 v = PkVec4<T>::load(x, i);
            v.x = pk_gelu(v.x, approx);
            v.y = pk_gelu(v.y, approx);
            v.z = pk_gelu(v.z, approx);
            v.w = pk_gelu(v.w, approx);
            PkVec4<T>::store(y, i, v);
        }
        return;
    }
    for (long long i = t0; i < n; i += step) PkIO<T>::store(y, i, pk_gelu(PkIO<T>::load(x, i), approx));
}

extern "C" __global__ void __launch_bounds__(256, 1) gelu(const float* __restrict__ x, float* __restrict__ y,
                                                          long long n, int approx) {
    gelu_body<float>(x, y, n, approx);
}

extern "C" __global__ void __launch_bounds__(256, 1) gelu_bf16(const unsigned short* __restrict__ x,
                                                               unsigned short* __restrict__ y, long long n, int approx) {
    gelu_body<unsigned short>(x, y, n, approx);
}

// grad_x = grad_out * gelu'(x)
template <typename T>
__device__ __forceinline__ void gelu_backward_body(const T* __restrict__ x, const T* __restrict__ g,
                                                   T* __restrict__ gx, long long n, int approx) {
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    if (n % 4 == 0 && pk_vec_aligned(x) && pk_vec_aligned(g) && pk_vec_aligned(gx)) {
        for (long long i = 4 * t0; i < n; i += 4 * step) {
            const float4 a = PkVec4<T>::load(x, i), b = PkVec4<T>::load(g, i);
            float4 o;
            o.x = b.x * pk_gelu_grad(a.x, approx);
            o.y = b.y * pk_gelu_grad(a.y, approx);
            o.z = b.z * pk_gelu_grad(a.z, approx);
            o.w = b.w * pk_gelu_grad(a.w, approx);
            PkVec4<T>::store(gx, i, o);
        }
        return;
    }
    for (long long i = t0; i < n; i += step)
        PkIO<T>::store(gx, i, PkIO<T>::load(g, i) * pk_gelu_grad(PkIO<T>::load(x, i), approx));
}

extern "C" __global__ void __launch_bounds__(256, 1) gelu_backward(
    const float* __restrict__ x, const float* __restrict__ grad_out, float* __restrict__ grad_x, long long n,
    int approx) {
    gelu_backward_body<float>(x, grad_out, grad_x, n, approx);
}

extern "C" __global__ void __launch_bounds__(256, 1) gelu_backward_bf16(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ grad_out,
    unsigned short* __restrict__ grad_x, long long n, int approx) {
    gelu_backward_body<unsigned short>(x, grad_out, grad_x, n, approx);
}

// GeGLU: out = gelu(gate) * up
template <typename T>
__device__ __forceinline__ void gelu_gate_body(const T* __restrict__ gate, const T* __restrict__ up,
                                               T* __restrict__ out, long long n, int approx) {
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    if (n % 4 == 0 && pk_vec_aligned(gate) && pk_vec_aligned(up) && pk_vec_aligned(out)) {
        for (long long i = 4 * t0; i < n; i += 4 * step) {
            const float4 a = PkVec4<T>::load(gate, i), u = PkVec4<T>::load(up, i);
            float4 o;
            o.x = pk_gelu(a.x, approx) * u.x;
            o.y = pk_gelu(a.y, approx) * u.y;
            o.z = pk_gelu(a.z, approx) * u.z;
            o.w = pk_gelu(a.w, approx) * u.w;
            PkVec4<T>::store(out, i, o);
        }
        return;
    }
    for (long long i = t0; i < n; i += step)
        PkIO<T>::store(out, i, pk_gelu(PkIO<T>::load(gate, i), approx) * PkIO<T>::load(up, i));
}

extern "C" __global__ void __launch_bounds__(256, 1) gelu_gate(
    const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ out, long long n, int approx) {
    gelu_gate_body<float>(gate, up, out, n, approx);
}

extern "C" __global__ void __launch_bounds__(256, 1) gelu_gate_bf16(
    const unsigned short* __restrict__ gate, const unsigned short* __restrict__ up, unsigned short* __restrict__ out,
    long long n, int approx) {
    gelu_gate_body<unsigned short>(gate, up, out, n, approx);
}

// grad_gate = grad_out * up * gelu'(gate), grad_up = grad_out * gelu(gate)
template <typename T>
__device__ __forceinline__ void gelu_gate_backward_body(const T* __restrict__ gate, const T* __restrict__ up,
                                                        const T* __restrict__ g, T* __restrict__ gg,
                                                        T* __restrict__ gu, long long n, int approx) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float a = PkIO<T>::load(gate, i), gv = PkIO<T>::load(g, i);
        PkIO<T>::store(gg, i, gv * PkIO<T>::load(up, i) * pk_gelu_grad(a, approx));
        PkIO<T>::store(gu, i, gv * pk_gelu(a, approx));
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) gelu_gate_backward(
    const float* __restrict__ gate, const float* __restrict__ up, const float* __restrict__ grad_out,
    float* __restrict__ grad_gate, float* __restrict__ grad_up, long long n, int approx) {
    gelu_gate_backward_body<float>(gate, up, grad_out, grad_gate, grad_up, n, approx);
}

extern "C" __global__ void __launch_bounds__(256, 1) gelu_gate_backward_bf16(
    const unsigned short* __restrict__ gate, const unsigned short* __restrict__ up,
    const unsigned short* __restrict__ grad_out, unsigned short* __restrict__ grad_gate,
    unsigned short* __restrict__ grad_up, long long n, int approx) {
    gelu_gate_backward_body<unsigned short>(gate, up, grad_out, grad_gate, grad_up, n, approx);
}
