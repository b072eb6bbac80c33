// Mixture of experts: routing, grouped GEMMs and the permute / combine around them.
//
//   moe_route            softmax (fp32) or sigmoid (+bias for choosing, either way) over experts, top-k (ties to the
//                        lower index), optional renormalisation; one warp per token.
//   moe_count/_scan/_place  vLLM's moe_align_block_size as three deterministic launches: per-chunk
//                        expert histograms, a scan to padded group offsets, then each slot's position
//                        (stable: slots of one expert keep their token order). No float atomics anywhere.
//   moe_gather           permuted rows x_perm[pos] = x[slot / k] (* w[slot]); padding rows are zero.
//   grouped_gemm_tc_bf16 tensor-core grouped GEMM (mma.sync m16n8k16, ldmatrix, 4-stage cp.async):
//                        rows offsets[e]..offsets[e+1] of out = a[rows] @ b[e]^T; moe_gemm_act_tc_bf16 is
//                        the same main loop with act(gate) * up fused into the epilogue.
//   grouped_gemm_simt    fp32 FMA grouped GEMM with a strided B (NT and NN), the f32 path and the sm_75 /
//                        backward path; grouped_gemm_wgrad: per-expert a_e^T b_e (dW, ragged K), one CTA
//                        per output tile, so no atomics.
//   moe_combine          out[t] = sum_j w[t, j] * y[pos(t, j)] in a fixed order (deterministic).
//   moe_act(_backward), moe_weight_grad: the elementwise pieces of the backward, in fp32: 16-bit intermediates
//   lose too much to cancellation. grouped_gemm_tc(_nn)_f32out: the tensor-core GEMMs with an fp32 result, for
//   the backward's products of exact 16-bit operands (the recomputed gate / up, dy_perm @ down_proj[e]).
//
// Grouped-GEMM tile scheduling happens on the device: the grid covers an upper bound of the row tiles
// (sum_e ceil(m_e / BM) <= M / BM + E) on blockIdx.x (column tiles on blockIdx.y) and each CTA finds
// its group by a warp scan of `offsets`;
// CTAs past the last tile exit. The offsets may live on the device: the host never reads them.
// Ids outside [0, E) (-1: a dropped token) contribute nothing.
#include "pk_common.cuh"
#include "pk_grouped.cuh"  // the device-side tile scheduler of the grouped GEMMs
#include "pk_moe_act.cuh"  // moe_act_f (shared with grouped_gemm_sm90.cu) and moe_act_grad

// ------------------------------------------------------------------------------------------ routing

// One warp per token; `s` holds the warp's E choice scores in shared memory.
template <typename T>
__device__ __forceinline__ void moe_route_impl(const T* __restrict__ logits, const float* __restrict__ bias,
                                               float* __restrict__ w_out, int* __restrict__ id_out,
                                               long long n_tok, int n_exp, int top_k, int renorm, int sigm,
                                               int has_bias) {
    extern __shared__ float moe_route_smem[];
    float* smem = moe_route_smem;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float* s = smem + (long long)warp * n_exp;
    for (long long t = (long long)blockIdx.x * nw + warp; t < n_tok; t += (long long)gridDim.x * nw) {
        const long long row = t * n_exp;
        // s holds the unbiased scores; a correction bias is added where the experts are chosen, so the
        // weight of a chosen expert is its score as stored, bit for bit.
        if (!sigm) {
            float mx = PK_NEG_INF;
            for (int e = lane; e < n_exp; e += 32) mx = fmaxf(mx, PkIO<T>::load(logits, row + e));
            mx = pk_warp_max(mx);
            float sum = 0.0f;
            for (int e = lane; e < n_exp; e += 32) {
                const float x = expf(PkIO<T>::load(logits, row + e) - mx);
                s[e] = x;
                sum += x;
            }
            sum = pk_warp_sum(sum);
            for (int e = lane; e < n_exp; e += 32) s[e] = s[e] / sum;  // the probabilities (this lane's own)
        } else {
            for (int e = lane; e < n_exp; e += 32) s[e] = 1.0f / (1.0f + expf(-PkIO<T>::load(logits, row + e)));
        }
        __syncwarp();
        float my_w = 0.0f;
        int my_id = -1;
        for (int j = 0; j < top_k; j++) {
            float best = PK_NEG_INF;
            int bi = 0x7fffffff;
            for (int e = lane; e < n_exp; e += 32) {
                const float v = has_bias ? s[e] + bias[e] : s[e];  // a taken expert stays -inf
                if (v > best || (v == best && e < bi)) best = v, bi = e;
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                const float ov = __shfl_xor_sync(PK_FULL_MASK, best, off);
                const int oi = __shfl_xor_sync(PK_FULL_MASK, bi, off);
                if (ov > best || (ov == best && oi < bi)) best = ov, bi = oi;
            }
            if (bi >= n_exp) bi = 0;  // every score -inf: fall back to expert 0 (never for finite logits)
            const float wv = s[bi];  // the unbiased score: the bias only chooses
            __syncwarp();  // every lane has read s[bi] before its owner marks it
            if (lane == (bi & 31)) s[bi] = PK_NEG_INF;  // the lane that reads s[bi] marks it taken
            __syncwarp();
            if (lane == j) my_w = wv, my_id = bi;
        }
        if (renorm) {
            const float tot = pk_warp_sum(lane < top_k ? my_w : 0.0f);
            my_w = sigm ? my_w / (tot + 1e-20f) : my_w / tot;
        }
        if (lane < top_k) {
            w_out[t * top_k + lane] = my_w;
            id_out[t * top_k + lane] = my_id;
        }
        __syncwarp();  // every lane is done with s before the next token overwrites it
    }
}

PK_IO_KERNELS(moe_route, (128), (const T* __restrict__ logits, const float* __restrict__ bias,
              float* __restrict__ topk_weights, int* __restrict__ topk_ids, long long n_tok, int n_exp, int top_k,
              int renorm, int sigm, int has_bias),
              (logits, bias, topk_weights, topk_ids, n_tok, n_exp, top_k, renorm, sigm, has_bias))

// ------------------------------------------------------------------------------------------ align
// moe_align_block_size in three launches over chunks of MOE_CHUNK slots (slot = t * k + j):
//   moe_count: chunk_counts[c][e] = slots of chunk c routed to e (block-local int histogram, stored
//              without atomics); also fills sorted_slot with -1 (padding rows).
//   moe_scan:  one CTA: chunk_counts becomes each chunk's exclusive start within its expert; counts[e];
//              offsets[e + 1] = offsets[e] + counts[e] rounded up to `block` (the GEMM's row tile).
//   moe_place: each slot's position = offsets[e] + its chunk's start + its rank among the earlier
//              slots of the chunk with the same expert: stable, hence deterministic.
#define MOE_CHUNK 256

extern "C" __global__ void __launch_bounds__(MOE_CHUNK) moe_count(
    const int* __restrict__ topk_ids, int* __restrict__ chunk_counts, int* __restrict__ sorted_slot,
    long long n_slots, int n_exp, long long max_rows) {
    extern __shared__ int moe_hist[];
    for (int e = threadIdx.x; e < n_exp; e += blockDim.x) moe_hist[e] = 0;
    __syncthreads();
    const long long s = (long long)blockIdx.x * MOE_CHUNK + threadIdx.x;
    if (s < n_slots) {
        const int id = topk_ids[s];
        if (id >= 0 && id < n_exp) atomicAdd(&moe_hist[id], 1);  // integer: the result is exact
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_exp; e += blockDim.x)
        chunk_counts[(long long)blockIdx.x * n_exp + e] = moe_hist[e];
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < max_rows;
         r += (long long)gridDim.x * blockDim.x)
        sorted_slot[r] = -1;
}

extern "C" __global__ void __launch_bounds__(256) moe_scan(int* __restrict__ chunk_counts,
                                                            int* __restrict__ counts, int* __restrict__ offsets,
                                                            int n_chunks, int n_exp, int block) {
    for (int e = threadIdx.x; e < n_exp; e += blockDim.x) {
        int run = 0;
        for (int c = 0; c < n_chunks; c++) {
            const long long i = (long long)c * n_exp + e;
            const int v = chunk_counts[i];
            chunk_counts[i] = run;
            run += v;
        }
        counts[e] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        offsets[0] = 0;
        for (int e = 0; e < n_exp; e++) {
            acc += (counts[e] + block - 1) / block * block;
            offsets[e + 1] = acc;
        }
    }
}

extern "C" __global__ void __launch_bounds__(MOE_CHUNK) moe_place(
    const int* __restrict__ topk_ids, const int* __restrict__ chunk_counts, const int* __restrict__ offsets,
    int* __restrict__ sorted_slot, int* __restrict__ slot_pos, long long n_slots, int n_exp) {
    __shared__ int ids[MOE_CHUNK];
    const long long s = (long long)blockIdx.x * MOE_CHUNK + threadIdx.x;
    int id = s < n_slots ? topk_ids[s] : -1;
    if (id >= n_exp || id < 0) id = -1;
    ids[threadIdx.x] = id;
    __syncthreads();
    if (s >= n_slots) return;
    if (id < 0) {
        slot_pos[s] = -1;
        return;
    }
    int rank = 0;
    for (int j = 0; j < (int)threadIdx.x; j++) rank += ids[j] == id;
    const int pos = offsets[id] + chunk_counts[(long long)blockIdx.x * n_exp + id] + rank;
    sorted_slot[pos] = (int)s;
    slot_pos[s] = pos;
}

// ------------------------------------------------------------------------------------------ gather / combine

// dst[r] = src[sorted_slot[r] / k] (* w[sorted_slot[r]] when has_w); zero for padding rows. Rows past
// offsets[n_exp] (the used part of the buffer) are left alone. One CTA per row, grid-stride.
template <typename T>
__device__ __forceinline__ void moe_gather_impl(const T* __restrict__ src, const int* __restrict__ sorted_slot,
                                                const float* __restrict__ w, const int* __restrict__ offsets,
                                                T* __restrict__ dst, long long max_rows, int dim, int top_k,
                                                int n_exp, int has_w) {
    const long long rows = min((long long)offsets[n_exp], max_rows);
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const int slot = sorted_slot[r];
        const float sc = slot < 0 ? 0.0f : (has_w ? w[slot] : 1.0f);
        const long long sb = slot < 0 ? 0 : (long long)(slot / top_k) * dim;
        for (int c = threadIdx.x; c < dim; c += blockDim.x) {
            const float v = slot < 0 ? 0.0f : PkIO<T>::load(src, sb + c) * sc;
            PkIO<T>::store(dst, r * dim + c, v);
        }
    }
}

PK_IO_KERNELS(moe_gather, (256), (const T* __restrict__ src, const int* __restrict__ sorted_slot,
              const float* __restrict__ w, const int* __restrict__ offsets, T* __restrict__ dst, long long max_rows,
              int dim, int top_k, int n_exp, int has_w),
              (src, sorted_slot, w, offsets, dst, max_rows, dim, top_k, n_exp, has_w))

// out[t] = sum_j (w[t, j] or 1) * y[slot_pos[t * k + j]], j in order (dropped slots add nothing): the
// deterministic unpermute. One CTA per token, grid-stride.
template <typename T>
__device__ __forceinline__ void moe_combine_impl(const T* __restrict__ y, const int* __restrict__ slot_pos,
                                                 const float* __restrict__ w, T* __restrict__ out, long long n_tok,
                                                 int dim, int top_k, int has_w) {
    for (long long t = blockIdx.x; t < n_tok; t += gridDim.x) {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < top_k; j++) {
                const int pos = slot_pos[t * top_k + j];
                if (pos >= 0) acc += (has_w ? w[t * top_k + j] : 1.0f) * PkIO<T>::load(y, (long long)pos * dim + c);
            }
            PkIO<T>::store(out, t * dim + c, acc);
        }
    }
}

PK_IO_KERNELS(moe_combine, (256), (const T* __restrict__ y, const int* __restrict__ slot_pos,
              const float* __restrict__ w, T* __restrict__ out, long long n_tok, int dim, int top_k, int has_w),
              (y, slot_pos, w, out, n_tok, dim, top_k, has_w))

// dw[t, j] = <dy[t], y[slot_pos[t, j]]> (0 for a dropped slot). One warp per slot.
template <typename T>
__device__ __forceinline__ void moe_weight_grad_body(const T* __restrict__ dy, const T* __restrict__ y,
                                                     const int* __restrict__ slot_pos, float* __restrict__ dw,
                                                     long long n_slots, int dim, int top_k) {
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (long long s = (long long)blockIdx.x * nw + (threadIdx.x >> 5); s < n_slots; s += (long long)gridDim.x * nw) {
        const int pos = slot_pos[s];
        float acc = 0.0f;
        if (pos >= 0) {
            const long long tb = (s / top_k) * dim, yb = (long long)pos * dim;
            for (int c = lane; c < dim; c += 32) acc += PkIO<T>::load(dy, tb + c) * PkIO<T>::load(y, yb + c);
        }
        acc = pk_warp_sum(acc);
        if (lane == 0) dw[s] = acc;
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_weight_grad(
    const float* __restrict__ dy, const float* __restrict__ y, const int* __restrict__ slot_pos,
    float* __restrict__ dw, long long n_slots, int dim, int top_k) {
    moe_weight_grad_body<float>(dy, y, slot_pos, dw, n_slots, dim, top_k);
}

// ------------------------------------------------------------------------------------------ activation
// gu [rows, 2I] (gate columns first, then up) -> h [rows, I] = act(gate) * up; the backward gives
// dgu = [dh * up * act'(gate), dh * act(gate)]. Rows past offsets[n_exp] are skipped.
template <typename T>
__device__ __forceinline__ void moe_act_impl(const T* __restrict__ gu, T* __restrict__ h,
                                             const int* __restrict__ offsets, long long max_rows, int inter,
                                             int n_exp, int act) {
    const long long n = min((long long)offsets[n_exp], max_rows) * inter;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / inter, c = i % inter;
        const float g = PkIO<T>::load(gu, r * 2 * inter + c), u = PkIO<T>::load(gu, r * 2 * inter + inter + c);
        PkIO<T>::store(h, i, moe_act_f(g, act) * u);
    }
}

PK_IO_KERNELS(moe_act, (256), (const T* __restrict__ gu, T* __restrict__ h, const int* __restrict__ offsets,
              long long max_rows, int inter, int n_exp, int act), (gu, h, offsets, max_rows, inter, n_exp, act))

// has_w: dh is dy_perm @ down_proj[e] (the tensor-core product of the unweighted 16-bit rows) and the row's routing
// weight w[sorted_slot[r]] (0 for a padding row) scales it here, in fp32.
template <typename T>
__device__ __forceinline__ void moe_act_backward_body(const T* __restrict__ gu, const T* __restrict__ dh,
                                                      T* __restrict__ dgu, const int* __restrict__ sorted_slot,
                                                      const float* __restrict__ w, const int* __restrict__ offsets,
                                                      long long max_rows, int inter, int n_exp, int act, int has_w) {
    const long long n = min((long long)offsets[n_exp], max_rows) * inter;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / inter, c = i % inter;
        const long long gi = r * 2 * inter + c;
        float d = PkIO<T>::load(dh, i);
        if (has_w) {
            const int slot = sorted_slot[r];
            d = slot < 0 ? 0.0f : w[slot] * d;
        }
        const float g = PkIO<T>::load(gu, gi), u = PkIO<T>::load(gu, gi + inter);
        PkIO<T>::store(dgu, gi, d * u * moe_act_grad(g, act));
        PkIO<T>::store(dgu, gi + inter, d * moe_act_f(g, act));
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_act_backward(
    const float* __restrict__ gu, const float* __restrict__ dh, float* __restrict__ dgu,
    const int* __restrict__ sorted_slot, const float* __restrict__ w, const int* __restrict__ offsets,
    long long max_rows, int inter, int n_exp, int act, int has_w) {
    moe_act_backward_body<float>(gu, dh, dgu, sorted_slot, w, offsets, max_rows, inter, n_exp, act, has_w);
}

// ------------------------------------------------------------------------------------------ SIMT grouped GEMM
// out[m, n] = sum_k a[m, k] * b[e][n * sbn + k * sbk] for the rows m of group e: sbn = K, sbk = 1 is
// a @ b[e]^T with b [E, N, K]; sbn = 1, sbk = N is a @ b[e] with b [E, K, N]. 32 x 32 tiles, 256
// threads with 4 outputs each, fp32 accumulation. The f32 path, the sm_75 bf16 path and the backward.
#define GGS_T 32

template <typename T>
__device__ __forceinline__ void grouped_gemm_simt_impl(const T* __restrict__ a, const T* __restrict__ b,
                                             const int* __restrict__ offsets, T* __restrict__ out, int M, int N,
                                             int K, int n_groups, long long sbn, long long sbk) {
    __shared__ float sa[GGS_T][GGS_T + 1];
    __shared__ float sb[GGS_T][GGS_T + 1];
    __shared__ int info[3];
    pk_grouped_cta_tile(offsets, n_groups, GGS_T, blockIdx.x, info);
    const int e = info[0], m0 = info[1], mend = min(info[2], M);
    if (e < 0) return;
    const int n0 = blockIdx.y * GGS_T, tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const long long sbe = (long long)N * K;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < K; k0 += GGS_T) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = ty + 8 * i, k = k0 + tx;
            const int m = m0 + r, n = n0 + r;
            sa[r][tx] = (m < mend && k < K) ? PkIO<T>::load(a, (long long)m * K + k) : 0.0f;
            sb[r][tx] = (n < N && k < K) ? PkIO<T>::load(b, e * sbe + n * sbn + k * sbk) : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < GGS_T; kk++) {
            const float bv = sb[tx][kk];
#pragma unroll
            for (int i = 0; i < 4; i++) acc[i] += sa[ty + 8 * i][kk] * bv;
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int m = m0 + ty + 8 * i, n = n0 + tx;
        if (m < mend && n < N) PkIO<T>::store(out, (long long)m * N + n, acc[i]);
    }
}

PK_IO_KERNELS(grouped_gemm_simt, (256), (const T* __restrict__ a, const T* __restrict__ b,
              const int* __restrict__ offsets, T* __restrict__ out, int M, int N, int K, int n_groups, long long sbn,
              long long sbk), (a, b, offsets, out, M, N, K, n_groups, sbn, sbk))

// dW: out[e][i, j] = sum over the rows m of group e of a[m, i] * b[m, j] (a [M, N1], b [M, N2], out
// [E, N1, N2]). Grid (N2 tiles, N1 tiles, E): each output tile is one CTA's, written once, so the
// weight gradient needs no atomics; an empty group writes zeros.
template <typename T>
__device__ __forceinline__ void gg_wgrad_body(const T* __restrict__ a, const T* __restrict__ b,
                                              const int* __restrict__ offsets, T* __restrict__ out, int M, int N1,
                                              int N2) {
    __shared__ float sa[GGS_T][GGS_T + 1];
    __shared__ float sb[GGS_T][GGS_T + 1];
    const int e = blockIdx.z;
    const int ms = max(0, offsets[e]), me = min(offsets[e + 1], M);
    const int i0 = blockIdx.y * GGS_T, j0 = blockIdx.x * GGS_T, tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = ms; k0 < me; k0 += GGS_T) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int kk = ty + 8 * i, m = k0 + kk;  // row of the group; tx walks the (contiguous) columns
            sa[tx][kk] = (m < me && i0 + tx < N1) ? PkIO<T>::load(a, (long long)m * N1 + i0 + tx) : 0.0f;
            sb[tx][kk] = (m < me && j0 + tx < N2) ? PkIO<T>::load(b, (long long)m * N2 + j0 + tx) : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < GGS_T; kk++) {
            const float bv = sb[tx][kk];
#pragma unroll
            for (int i = 0; i < 4; i++) acc[i] += sa[ty + 8 * i][kk] * bv;
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = i0 + ty + 8 * i, c = j0 + tx;
        if (r < N1 && c < N2) PkIO<T>::store(out, ((long long)e * N1 + r) * N2 + c, acc[i]);
    }
}

extern "C" __global__ void __launch_bounds__(256) grouped_gemm_wgrad(
    const float* __restrict__ a, const float* __restrict__ b, const int* __restrict__ offsets,
    float* __restrict__ out, int M, int N1, int N2) {
    gg_wgrad_body<float>(a, b, offsets, out, M, N1, N2);
}

// ------------------------------------------------------------------------------------------ tensor-core grouped GEMM
// CUTLASS's sm_80 shape: CTA tile 128 x 128 x 32, 4 warps of 64 x 64, 4 cp.async stages; per warp and
// k-tile 64 mma.m16n8k16, 16 ldmatrix.x4 and (per thread) 8 cp.async of 16 bytes. Shared rows are
// padded to 40 halves (80 bytes), so the 8 row addresses of an ldmatrix phase hit distinct banks.
//
// Rows past a group's end inside the last tile of a group are read (they belong to the next group, or
// are clamped to row M - 1) and their results are not stored; B rows past N are clamped likewise. So
// the steady-state loop runs full k-tiles with no predicates at all; only a K remainder (K % 32), or
// K % 8 != 0 / unaligned bases (no 16-byte copies), go through the element-wise zero-filling path.
//
// EPI: 0 stores out = a @ b^T ([M, N], bf16). 1 is the experts' first GEMM with the activation fused:
// b is gate_up [E, 2I, H], the CTA's 128 B rows are gate rows c..c+31 then up rows c..c+31 for each
// warp column, so one lane holds gate and up of the same (row, column) and stores
// h = act(gate) * up ([M, I], bf16) straight from the accumulators.
#define GG_BM 128
#define GG_BK 32
#define GG_ST 4
#define GG_THREADS 128
#define GG_SR 40
#define GG_TILE (GG_BM * GG_SR)
#define GG_STAGE (2 * GG_TILE)
#define GG_SMEM_BYTES (GG_ST * GG_STAGE * 2)

// The split-precision lo parts' scale (gg_tc_body's SPLIT; moe_split16 writes them): f16 lo parts are scaled by 2^11, the
// hi part's relative precision, so a lo part is as far above f16's 2^-24 subnormal floor as its hi part is (bf16
// has fp32's exponent range: no scale).
template <typename T> constexpr float GG_LO_SCALE = Pk16<T>::is_f16 ? 2048.0f : 1.0f;

// The tensor-core code exists for sm_80+ only (sm_75 has no mma .bf16: its entry points trap).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define GG_STAGE_B (GG_STAGE * 2)
#define GG_TILE_B (GG_TILE * 2)
#define GG_ROW32_B (32 * GG_SR * 2)

#define GG_SRT 136  // k-major tiles: 32 k rows of 128 + 8 halves (272 bytes: 8 rows hit distinct banks)
#define GG_ROW8T_B (8 * GG_SRT * 2)

// v, through an instruction the compiler cannot see into (so it is not hoisted out of a loop).
__device__ __forceinline__ int gg_opaque(int v) {  // v >= 0
    return (int)pk_opaque_u64((unsigned long long)v);
}

// One k-tile from shared memory: 2 k-steps of 4 A (ldmatrix.x4) and 4 B fragments (ldmatrix.x4, two
// n8 tiles each) feeding 32 MMAs. Addresses are the shared base plus 32-bit byte offsets: a_off /
// b_off per lane, the rest immediates. AKM / BKM: the operand's tile is k-major ([k][m] / [k][n], rows
// of GG_SRT halves) and its fragments come through ldmatrix .trans; otherwise [m][k] / [n][k] rows of
// GG_SR halves, plain ldmatrix.
template <typename T, bool AKM, bool BKM>
__device__ __forceinline__ void gg_tc_ktile(const unsigned short* smem, unsigned int a_off, unsigned int b_off,
                                            float (&acc)[4][8][4]) {
#pragma unroll
    for (int ks = 0; ks < 2; ks++) {
        unsigned int af[4][4], bfr[4][4];
#pragma unroll
        for (int mt = 0; mt < 4; mt++) {
            if (AKM) pk_ldmatrix_x4_trans_at(af[mt], smem, a_off + (ks * 16 * GG_SRT + mt * 16) * 2);
            else pk_ldmatrix_x4_at(af[mt], smem, a_off + (mt * 16 * GG_SR + ks * 16) * 2);
        }
#pragma unroll
        for (int np = 0; np < 4; np++) {
            if (BKM) pk_ldmatrix_x4_trans_at(bfr[np], smem, b_off + (ks * 16 * GG_SRT + np * 16) * 2);
            else pk_ldmatrix_x4_at(bfr[np], smem, b_off + (np * 16 * GG_SR + ks * 16) * 2);
        }
#pragma unroll
        for (int mt = 0; mt < 4; mt++)
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
                pk_mma_m16n8k16<T>(acc[mt][nt], af[mt], &bfr[nt >> 1][(nt & 1) * 2], acc[mt][nt]);
    }
}

// This thread's 8 cp.async of one k-tile into a stage (a_st / b_st: the thread's byte offsets there).
// [m][k] operands: chunk i is row + 32 i at k offset rel * GG_BK of the tile the pointers stand at (an
// immediate). k-major operands: chunk i is k row + 8 i; the pointers stand at the tile to copy and step
// one k-tile (32 rows of the operand, a runtime stride) after it.
template <bool AKM, bool BKM>
__device__ __forceinline__ void gg_tc_copy(unsigned short* smem, unsigned int a_st, unsigned int b_st,
                                           const unsigned short* (&pa)[4], const unsigned short* (&pb)[4], int rel,
                                           long long a_step, long long b_step) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (AKM) {
            pk_cp_async_16_at(smem, a_st + i * GG_ROW8T_B, pa[i]);
            pa[i] += a_step;
        } else {
            pk_cp_async_16_at(smem, a_st + i * GG_ROW32_B, pa[i] + rel * GG_BK);
        }
        if (BKM) {
            pk_cp_async_16_at(smem, b_st + i * GG_ROW8T_B, pb[i]);
            pb[i] += b_step;
        } else {
            pk_cp_async_16_at(smem, b_st + i * GG_ROW32_B, pb[i] + rel * GG_BK);
        }
    }
}

// Four k-tiles kt..kt+3 (kt a multiple of 4, so tile kt+u sits in stage u and its refill, tile kt+u+3,
// goes to stage (u+3)%4): every shared address is an immediate. GUARD: refills past the last full tile
// are skipped (the drain); without it the loop body has no branch but its own.
template <typename T, bool AKM, bool BKM, bool GUARD>
__device__ __forceinline__ void gg_tc_4tiles(unsigned short* smem, unsigned int a_st, unsigned int b_st,
                                             unsigned int a_ld, unsigned int b_ld, const unsigned short* (&pa)[4],
                                             const unsigned short* (&pb)[4], long long a_step, long long b_step,
                                             int kt, int nk_full, float (&acc)[4][8][4]) {
#pragma unroll
    for (int u = 0; u < 4; u++) {
        pk_cp_async_wait<GG_ST - 2>();
        __syncthreads();  // tile kt+u visible to all; every warp is done with stage (u+3)%4 (tile kt+u-1)
        if (!GUARD || kt + u + GG_ST - 1 < nk_full) {
            const unsigned int so = ((u + GG_ST - 1) & (GG_ST - 1)) * GG_STAGE_B;
            gg_tc_copy<AKM, BKM>(smem, a_st + so, b_st + so, pa, pb, u + GG_ST - 1, a_step, b_step);
        }
        pk_cp_async_commit();
        gg_tc_ktile<T, AKM, BKM>(smem, a_ld + u * GG_STAGE_B, b_ld + u * GG_STAGE_B, acc);
    }
}

// T (__nv_bfloat16 or __half) picks the mma and the epilogue's narrowing; the copies move raw 16-bit words.
//
// EPI 0: out = a @ b^T (BKM false: b [E, N, K]) or a @ b (BKM true: b [E, K, N], the data gradients).
// EPI 1: the experts' first GEMM with act(gate) * up fused (see above).
// EPI 2: the weight gradient, a K-grouped GEMM: out[e] = a[rows_e]^T @ b[rows_e] with a [K, M], b [K, N]
//        (K: all rows), out [E, M, N]; grid (M tiles, N tiles, E); the contraction runs over the
//        expert's rows offsets[e]..offsets[e+1] (none: a zero tile), so each output tile is one CTA's.
// F32OUT (EPI 0 only): out is float, the fp32 accumulators stored as they are (the backward's products whose
//        operands are exact 16-bit values, whose result must not be rounded to 16 bits): see gg_store_f32.
// SPLIT (split precision, for an fp32 operand v that 16 bits alone cannot carry): v travels as two planes of T,
//        hi = round(v) and lo = round((v - hi) * GG_LO_SCALE), the lo plane M * K elements after the hi one (the
//        same bytes as one fp32 array; split16 below writes them). SPLIT 1: A split (a [2, M, K], or [2, K, M] in
//        EPI 2), acc = lo·B, then hi·B (two passes of the k-loop). SPLIT 2 (EPI 2): both split (b [2, K, N] too),
//        acc = lo_a·hi_b + hi_a·lo_b, then hi·hi (three passes; lo·lo, 2^-16 relative in bf16, is left out). The lo
//        passes run first and their sum is unscaled (exactly, by a power of two) before the hi pass.
template <typename T, int EPI, bool BKM, bool F32OUT = false, int SPLIT = 0>
__device__ __forceinline__ void gg_tc_body(const T* __restrict__ a_, const T* __restrict__ b_,
                                           const int* __restrict__ offsets, void* __restrict__ out_,
                                           int M, int N, int K, int n_groups, int act) {
    static_assert(!F32OUT || EPI == 0, "gg_tc_body: the fp32 result is the plain product's");
    static_assert(SPLIT == 0 || EPI != 1, "gg_tc_body: no split operand in the fused-activation GEMM");
    static_assert(SPLIT < 2 || EPI == 2, "gg_tc_body: a split B is the weight gradient's");
    constexpr bool AKM = EPI == 2;
    const unsigned short* __restrict__ b = reinterpret_cast<const unsigned short*>(b_);
    unsigned short* __restrict__ out = reinterpret_cast<unsigned short*>(out_);
    extern __shared__ __align__(16) unsigned short gg_smem[];
    int e, m0, mend, kbeg, kend;
    if (EPI == 2) {
        e = blockIdx.z;
        kbeg = max(0, offsets[e]);
        kend = max(kbeg, min(offsets[e + 1], K));
        m0 = blockIdx.x * GG_BM;
        mend = M;
    } else {
        __shared__ int info[3];
        pk_grouped_cta_tile(offsets, n_groups, GG_BM, blockIdx.x, info);
        e = info[0], m0 = info[1], mend = min(info[2], M);
        if (e < 0) return;
        kbeg = 0;
        kend = K;
    }

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    // EPI 1: N is 2I; this CTA covers h columns [64 * blockIdx.y, + 64).
    const int inter = N >> 1;
    const int n0 = EPI == 1 ? blockIdx.y * 64 : blockIdx.y * 128;
    const unsigned short* be0 = EPI == 2 ? b : b + (long long)e * N * K;

    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    constexpr int NPASS = SPLIT == 0 ? 1 : SPLIT == 1 ? 2 : 3;
    // Not unrolled: one copy of the k-loop serves every pass (an unrolled copy per pass spills).
#pragma unroll 1
    for (int pass = 0; pass < NPASS; pass++) {
    // This pass's operand planes (see SPLIT): the lo plane(s) first, the hi planes last.
    const bool a_lo = pass < NPASS - 1 && (SPLIT == 1 || pass == 0);
    const bool b_lo = SPLIT == 2 && pass == 1;
    const unsigned short* __restrict__ a = a_lo ? reinterpret_cast<const unsigned short*>(a_) + (long long)M * K
                                                : reinterpret_cast<const unsigned short*>(a_);
    const unsigned short* be = b_lo ? be0 + (long long)K * N : be0;
    // With passes, values the compiler could hoist out of the pass loop (the copy pointers' offsets) would stay
    // live across the k-loop and spill: an opaque copy per pass makes them recomputed instead.
    const int kbeg_p = SPLIT ? gg_opaque(kbeg) : kbeg, m0_p = SPLIT ? gg_opaque(m0) : m0;
    const int n0_p = SPLIT ? gg_opaque(n0) : n0;
    // Unscale the lo products' sum (a power of two: exact) before the hi pass adds to it. ptxas keeps both forms
    // free of spills only per arch: the branch around the 128 multiplies spills 40 bytes on sm_100 and later, a
    // multiply in every pass (by 1 but before the hi pass) spills on sm_80.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
    if (SPLIT != 0 && GG_LO_SCALE<T> != 1.0f) {
        const float unscale = pass == NPASS - 1 ? 1.0f / GG_LO_SCALE<T> : 1.0f;
#else
    if (SPLIT != 0 && pass == NPASS - 1) {
        constexpr float unscale = 1.0f / GG_LO_SCALE<T>;
#endif
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int v = 0; v < 4; v++) acc[i][j][v] *= unscale;
    }

    // Copy assignments. [rows][k] tiles: rows (tid >> 2) + 32 i, 16-byte chunk (tid & 3) of the 32-wide
    // k-tile. k-major tiles: k rows (tid >> 4) + 8 i, 16-byte chunk (tid & 15) of the 128 columns;
    // chunks past the last column (M, N multiples of 8 there) are clamped reads that are never stored.
    const int lr = tid >> 2, lc = (tid & 3) * 8;
    const int kr = tid >> 4, kc = (tid & 15) * 8;
    const unsigned short* pa[4];
    const unsigned short* pb[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = lr + 32 * i;
        if (AKM) pa[i] = a + (long long)(kbeg_p + kr + 8 * i) * M + min(m0_p + kc, M - 8);
        else pa[i] = a + (long long)min(m0_p + r, M - 1) * K + lc;
        if (BKM) {
            pb[i] = be + (long long)(kbeg_p + kr + 8 * i) * N + min(n0_p + kc, N - 8);
        } else {
            int brow;
            if (EPI == 1) {  // tile row r: warp column r >> 6, gate (bit 5 clear) or up, h column c
                const int c = min(n0 + ((r >> 6) << 5) + (r & 31), inter - 1);
                brow = (r & 32) ? inter + c : c;
            } else {
                brow = min(n0 + r, N - 1);
            }
            pb[i] = be + (long long)brow * K + lc;
        }
    }
    const long long a_step = (long long)GG_BK * M, b_step = (long long)GG_BK * N;  // k-major tiles only
    const unsigned int a_st = (AKM ? kr * GG_SRT + kc : lr * GG_SR + lc) * 2;
    const unsigned int b_st = GG_TILE_B + (BKM ? kr * GG_SRT + kc : lr * GG_SR + lc) * 2;

    // ldmatrix row addresses within a stage (see pk_ptx.cuh). [rows][k]: A as in attention_fwd_tc; B's
    // x4 holds two n8 tiles (matrices 0, 1: n 0-7, k 0-7 / 8-15; matrices 2, 3: n 8-15). k-major (.trans):
    // the same matrices, each addressed by its 8 k rows.
    const int a_ld = AKM ? ((lane & 7) + 8 * (lane >> 4)) * GG_SRT + wm * 64 + 8 * ((lane >> 3) & 1)
                         : (wm * 64 + (lane & 7) + 8 * ((lane >> 3) & 1)) * GG_SR + 8 * (lane >> 4);
    const int b_ld = GG_TILE + (BKM ? ((lane & 7) + 8 * ((lane >> 3) & 1)) * GG_SRT + wn * 64 + 8 * (lane >> 4)
                                    : (wn * 64 + (lane & 7) + ((lane >> 4) << 3)) * GG_SR + 8 * ((lane >> 3) & 1));

    const bool vec = (AKM ? (M & 7) == 0 && M >= 8 : (K & 7) == 0) && (BKM ? (N & 7) == 0 && N >= 8 : (K & 7) == 0) &&
                     (reinterpret_cast<unsigned long long>(a) & 15) == 0 &&
                     (reinterpret_cast<unsigned long long>(b) & 15) == 0;
    const int nk_full = vec ? (kend - kbeg_p) / GG_BK : 0;
    if (nk_full > 0) {
#pragma unroll
        for (int s = 0; s < GG_ST - 1; s++) {
            if (s < nk_full)
                gg_tc_copy<AKM, BKM>(gg_smem, a_st + s * GG_STAGE_B, b_st + s * GG_STAGE_B, pa, pb, s, a_step, b_step);
            pk_cp_async_commit();
        }
        int kt = 0;
        // The steady-state loop: four k-tiles per trip, no refill guard (tile kt + 6 exists).
        for (; kt + 4 + GG_ST - 1 <= nk_full; kt += 4) {
            gg_tc_4tiles<T, AKM, BKM, false>(gg_smem, a_st, b_st, a_ld * 2, b_ld * 2, pa, pb, a_step, b_step, kt,
                                             nk_full, acc);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (!AKM) pa[i] += 4 * GG_BK;
                if (!BKM) pb[i] += 4 * GG_BK;
            }
        }
        // Drain: whole groups of four with the guard, then single tiles (no refills remain).
        for (; kt + 4 <= nk_full; kt += 4) {
            gg_tc_4tiles<T, AKM, BKM, true>(gg_smem, a_st, b_st, a_ld * 2, b_ld * 2, pa, pb, a_step, b_step, kt,
                                            nk_full, acc);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (!AKM) pa[i] += 4 * GG_BK;
                if (!BKM) pb[i] += 4 * GG_BK;
            }
        }
        for (; kt < nk_full; kt++) {
            pk_cp_async_wait<GG_ST - 2>();
            __syncthreads();
            pk_cp_async_commit();
            const unsigned int so = (kt & (GG_ST - 1)) * GG_STAGE_B;
            gg_tc_ktile<T, AKM, BKM>(gg_smem, a_ld * 2 + so, b_ld * 2 + so, acc);
        }
        pk_cp_async_wait_all();
        __syncthreads();  // stage 0 is free for the remainder
    }
    const unsigned int a_ldb = a_ld * 2, b_ldb = b_ld * 2;
    // Remainder k-tiles (a partial last tile, or everything without 16-byte copies): element-wise, zero
    // past kend (in EPI 2 those rows belong to the next expert: they must not be contracted).
    for (int k0 = kbeg_p + nk_full * GG_BK; k0 < kend; k0 += GG_BK) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            unsigned int wa[4] = {0u, 0u, 0u, 0u}, wb[4] = {0u, 0u, 0u, 0u};
            if (AKM) {
                const int k = k0 + kr + 8 * i;
#pragma unroll
                for (int x = 0; x < 8; x++) {
                    const int c = m0_p + kc + x;
                    if (k < kend && c < M) wa[x >> 1] |= (unsigned int)a[(long long)k * M + c] << (16 * (x & 1));
                }
            } else {
                const long long ra = (long long)min(m0_p + lr + 32 * i, M - 1) * K;
#pragma unroll
                for (int x = 0; x < 8; x++) {
                    const int k = k0 + lc + x;
                    if (k < kend) wa[x >> 1] |= (unsigned int)a[ra + k] << (16 * (x & 1));
                }
            }
            if (BKM) {
                const int k = k0 + kr + 8 * i;
#pragma unroll
                for (int x = 0; x < 8; x++) {
                    const int c = n0_p + kc + x;
                    if (k < kend && c < N) wb[x >> 1] |= (unsigned int)be[(long long)k * N + c] << (16 * (x & 1));
                }
            } else {
                const int r = lr + 32 * i;
                int brow;
                if (EPI == 1) {
                    const int c = min(n0 + ((r >> 6) << 5) + (r & 31), inter - 1);
                    brow = (r & 32) ? inter + c : c;
                } else {
                    brow = min(n0 + r, N - 1);
                }
                const long long rb = (long long)brow * K;
#pragma unroll
                for (int x = 0; x < 8; x++) {
                    const int k = k0 + lc + x;
                    if (k < kend) wb[x >> 1] |= (unsigned int)be[rb + k] << (16 * (x & 1));
                }
            }
            *reinterpret_cast<uint4*>(gg_smem + a_st / 2 + i * (AKM ? 8 * GG_SRT : 32 * GG_SR)) =
                make_uint4(wa[0], wa[1], wa[2], wa[3]);
            *reinterpret_cast<uint4*>(gg_smem + b_st / 2 + i * (BKM ? 8 * GG_SRT : 32 * GG_SR)) =
                make_uint4(wb[0], wb[1], wb[2], wb[3]);
        }
        __syncthreads();
        gg_tc_ktile<T, AKM, BKM>(gg_smem, a_ldb, b_ldb, acc);
        __syncthreads();
    }
    }  // pass

    // Epilogue: accumulator (mt, nt, v) is tile row wm*64 + mt*16 + g + 8*(v>>1), column nt*8 + 2t + (v&1)
    // of the warp's 64 columns.
    const int g = lane >> 2, t = lane & 3;
    if constexpr (F32OUT) {
        float* __restrict__ outf = reinterpret_cast<float*>(out_);
        const bool quad = (N & 3) == 0 && (reinterpret_cast<unsigned long long>(outf) & 15) == 0;
#pragma unroll
        for (int mt = 0; mt < 4; mt++)
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
                gg_store_f32(outf, acc[mt][nt], m0 + wm * 64 + mt * 16 + g, n0 + wn * 64 + nt * 8, mend, N, t, quad);
    } else if (EPI == 0 || EPI == 2) {
        if (EPI == 2) out += (long long)e * M * N;
        gg_store16<T>(out, acc, m0 + wm * 64 + g, n0 + wn * 64 + 2 * t, mend, N);
    } else {
        const bool pair = (inter & 1) == 0 && (reinterpret_cast<unsigned long long>(out) & 3) == 0;
#pragma unroll
        for (int mt = 0; mt < 4; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int m = m0 + wm * 64 + mt * 16 + g + 8 * h;
                if (m >= mend) continue;
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    const int n = n0 + wn * 32 + nt * 8 + 2 * t;
                    const float x0 = moe_act_f(acc[mt][nt][2 * h], act) * acc[mt][nt + 4][2 * h];
                    const float x1 = moe_act_f(acc[mt][nt][2 * h + 1], act) * acc[mt][nt + 4][2 * h + 1];
                    if (pair && n + 1 < inter) {
                        *reinterpret_cast<unsigned int*>(out + (long long)m * inter + n) = Pk16<T>::narrow2(x0, x1);
                    } else {
                        if (n < inter) out[(long long)m * inter + n] = Pk16<T>::narrow(x0);
                        if (n + 1 < inter) out[(long long)m * inter + n + 1] = Pk16<T>::narrow(x1);
                    }
                }
            }
    }
}

#endif  // sm_80+

// mma .bf16 / .f16 need sm_80: the sm_75 build has entry points that trap (the ops use grouped_gemm_simt_*).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define GG_TC_CALL(EPI, BKM) __trap()
#else
#define GG_TC_CALL(EPI, BKM) gg_tc_body<T, EPI, BKM>(a, b, offsets, out, M, N, K, n_groups, act)
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define GG_TC_CALL_SPLIT(EPI, F32OUT, SPLIT) __trap()
#else
#define GG_TC_CALL_SPLIT(EPI, F32OUT, SPLIT) \
    gg_tc_body<T, EPI, EPI == 2, F32OUT, SPLIT>(a, b, offsets, out, M, N, K, n_groups, 0)
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define GG_TC_CALL_F32(BKM) __trap()
#else
#define GG_TC_CALL_F32(BKM) gg_tc_body<T, 0, BKM, true>(a, b, offsets, out, M, N, K, n_groups, 0)
#endif
template <typename T>
__device__ __forceinline__ void grouped_gemm_tc_f32out_impl(const T* __restrict__ a, const T* __restrict__ b,
                                                            const int* __restrict__ offsets, float* __restrict__ out,
                                                            int M, int N, int K, int n_groups) {
    GG_TC_CALL_F32(false);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_tc_nn_f32out_impl(const T* __restrict__ a, const T* __restrict__ b,
                                                               const int* __restrict__ offsets,
                                                               float* __restrict__ out, int M, int N, int K,
                                                               int n_groups) {
    GG_TC_CALL_F32(true);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_tc_impl(const T* __restrict__ a, const T* __restrict__ b,
                                                     const int* __restrict__ offsets, T* __restrict__ out, int M,
                                                     int N, int K, int n_groups, int act) {
    GG_TC_CALL(0, false);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_tc_nn_impl(const T* __restrict__ a, const T* __restrict__ b,
                                                        const int* __restrict__ offsets, T* __restrict__ out, int M,
                                                        int N, int K, int n_groups, int act) {
    GG_TC_CALL(0, true);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_wgrad_tc_impl(const T* __restrict__ a, const T* __restrict__ b,
                                                           const int* __restrict__ offsets, T* __restrict__ out,
                                                           int M, int N, int K, int n_groups, int act) {
    GG_TC_CALL(2, true);
}
template <typename T>
__device__ __forceinline__ void moe_gemm_act_tc_impl(const T* __restrict__ a, const T* __restrict__ b,
                                                     const int* __restrict__ offsets, T* __restrict__ out, int M,
                                                     int N, int K, int n_groups, int act) {
    GG_TC_CALL(1, false);
}
#define GG_TC_PARAMS                                                                                           \
    (const T* __restrict__ a, const T* __restrict__ b, const int* __restrict__ offsets, T* __restrict__ out,   \
     int M, int N, int K, int n_groups)
PK_IO16_KERNELS(grouped_gemm_tc, (GG_THREADS, 1), GG_TC_PARAMS, (a, b, offsets, out, M, N, K, n_groups, 0))
// out = a @ b[e] with b [E, K, N]: the data gradients (the same kernel, B tiles k-major through ldmatrix .trans)
PK_IO16_KERNELS(grouped_gemm_tc_nn, (GG_THREADS, 1), GG_TC_PARAMS, (a, b, offsets, out, M, N, K, n_groups, 0))
// out [E, M, N]: out[e] = a[rows_e]^T @ b[rows_e], a [K, M], b [K, N], rows_e = offsets[e]..offsets[e+1]
PK_IO16_KERNELS(grouped_gemm_wgrad_tc, (GG_THREADS, 1), GG_TC_PARAMS, (a, b, offsets, out, M, N, K, n_groups, 0))
#define GG_TC_ACT_PARAMS                                                                                       \
    (const T* __restrict__ a, const T* __restrict__ b, const int* __restrict__ offsets, T* __restrict__ out,   \
     int M, int N, int K, int n_groups, int act)
PK_IO16_KERNELS(moe_gemm_act_tc, (GG_THREADS, 1), GG_TC_ACT_PARAMS, (a, b, offsets, out, M, N, K, n_groups, act))
// The fp32-result variants (16-bit operands, the fp32 accumulators stored): out [M, N] float = a @ b[e]^T (b
// [E, N, K]), and _nn: a @ b[e] (b [E, K, N]). The backward's recomputed gate / up and dy_perm @ down_proj[e].
#define GG_TC_F32_PARAMS                                                                                       \
    (const T* __restrict__ a, const T* __restrict__ b, const int* __restrict__ offsets,                        \
     float* __restrict__ out, int M, int N, int K, int n_groups)
PK_IO16_KERNELS(grouped_gemm_tc_f32out, (GG_THREADS, 1), GG_TC_F32_PARAMS, (a, b, offsets, out, M, N, K, n_groups))
PK_IO16_KERNELS(grouped_gemm_tc_nn_f32out, (GG_THREADS, 1), GG_TC_F32_PARAMS, (a, b, offsets, out, M, N, K, n_groups))

// ------------------------------------------------------------------------------------------ split precision
// The backward's fp32 intermediates (h, w * dy, d(gate_up)) enter tensor-core products as hi / lo planes of T:
// dst[i] = hi = round(src[i]), dst[n + i] = round((src[i] - hi) * GG_LO_SCALE) (src - hi is exact in fp32). The hi
// plane alone is src rounded to T (what d(x_perm) takes). The split GEMMs accumulate hi·B + lo·B in fp32.
template <typename T>
__device__ __forceinline__ void moe_split16_impl(const float* __restrict__ src, T* __restrict__ dst, long long n) {
    unsigned short* __restrict__ d = reinterpret_cast<unsigned short*>(dst);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float v = src[i];
        const unsigned short hi = Pk16<T>::narrow(v);
        d[i] = hi;
        d[n + i] = Pk16<T>::narrow((v - Pk16<T>::widen(hi)) * GG_LO_SCALE<T>);
    }
}
PK_IO16_KERNELS(moe_split16, (256), (const float* __restrict__ src, T* __restrict__ dst, long long n), (src, dst, n))

template <typename T>
__device__ __forceinline__ void grouped_gemm_wgrad_tc_split_a_impl(const T* __restrict__ a, const T* __restrict__ b,
                                                                   const int* __restrict__ offsets,
                                                                   T* __restrict__ out, int M, int N, int K,
                                                                   int n_groups) {
    GG_TC_CALL_SPLIT(2, false, 1);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_wgrad_tc_split_ab_impl(const T* __restrict__ a, const T* __restrict__ b,
                                                                    const int* __restrict__ offsets,
                                                                    T* __restrict__ out, int M, int N, int K,
                                                                    int n_groups) {
    GG_TC_CALL_SPLIT(2, false, 2);
}
template <typename T>
__device__ __forceinline__ void grouped_gemm_tc_split_f32out_impl(const T* __restrict__ a, const T* __restrict__ b,
                                                                  const int* __restrict__ offsets,
                                                                  float* __restrict__ out, int M, int N, int K,
                                                                  int n_groups) {
    GG_TC_CALL_SPLIT(0, true, 1);
}
// The weight gradients with a split A (a [2, K, M]: d(gate_up)^T x_perm) or split A and B (b [2, K, N] too:
// (w * dy)^T h), out [E, M, N] in T; and y = a @ b[e]^T with a split A (a [2, M, K]: h @ down_proj[e]^T), fp32 out.
PK_IO16_KERNELS(grouped_gemm_wgrad_tc_split_a, (GG_THREADS, 1), GG_TC_PARAMS, (a, b, offsets, out, M, N, K, n_groups))
PK_IO16_KERNELS(grouped_gemm_wgrad_tc_split_ab, (GG_THREADS, 1), GG_TC_PARAMS, (a, b, offsets, out, M, N, K, n_groups))
PK_IO16_KERNELS(grouped_gemm_tc_split_f32out, (GG_THREADS, 1), GG_TC_F32_PARAMS,
                (a, b, offsets, out, M, N, K, n_groups))
