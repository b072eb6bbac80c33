// Attention-state merges for cascade (shared-prefix) and split attention, in FlashInfer's terms: a state is an
// attention output v over one segment of keys and the natural-log log-sum-exp s of its scaled scores (the lse
// that flash_attention, the paged decode and the paged prefill return). The merge of states is the output over
// the union of their segments:
//
//     m = max_i s_i,  w_i = exp(s_i - m),  v = sum_i w_i v_i / sum_i w_i,  s = m + log(sum_i w_i)
//
// in fp32, the states taken in index order, so results are bit-identical run to run and under any schedule.
// A state with s = -inf (an empty segment) weighs nothing; when every state is empty the merge is v = 0 and
// s = -inf, the same convention as a query that sees no key. A NaN or +inf lse gives NaN, never a silent drop.
//
//   merge_state   two states, (seq_len, num_heads, head_dim) each; v_out / s_out may be v_a /
//                 s_a (the in-place merge: each element is read before it is written, by the same thread), and
//                 a per-token mask (has_mask) then leaves the rows of masked-off tokens as they are.
//   merge_states  num_states states of a token held together: v (seq_len, num_states, num_heads, head_dim),
//                 s (seq_len, num_states, num_heads).
//
// One warp per (token, head) row, lanes over head_dim in 16-byte vectors when head_dim fills them and every
// base is 16-byte aligned (LDG.E.128 / STG.E.128), else element by element. The head is blockIdx.y (the op
// keeps num_heads <= 65535), so no row index is ever divided: a 64-bit division is a called subroutine whose
// calling convention spilled registers. Tokens are walked grid-stride so the op may clamp grid x; offsets are
// 64-bit.
#include "pk_vec.cuh"

// The weights of the states, in index order: m, then 1 / sum(w) (0 when every state is empty) and the lse.
struct CascadeNorm {
    float m, inv, lse;
};

__device__ __forceinline__ CascadeNorm cascade_norm(float m, float sum) {
    CascadeNorm n;
    n.m = m;
    // Every state -inf: nothing to weigh. A NaN or +inf lse makes sum NaN, which the output then carries.
    const bool empty = sum == 0.0f;
    // sum >= 1 (the largest state weighs exp(0) = 1), so the fast reciprocal (within 2 ulp) meets no denormal;
    // an IEEE 1.0f / sum calls a slow-path subroutine, and registers live across that call spilled.
    n.inv = empty ? 0.0f : __fdividef(1.0f, sum);
    n.lse = empty ? PK_NEG_INF : m + logf(sum);
    return n;
}

__device__ __forceinline__ float cascade_weight(float s, float m) {
    return s == PK_NEG_INF ? 0.0f : expf(s - m);  // exp(-inf - m) is 0 too, but NaN when m is -inf itself
}

// W elements at i: v_out = (wa v_a + wb v_b) * inv (v_out may be v_a: each element is read before written).
template <typename T, int W>
__device__ __forceinline__ void merge2_chunk(const T* v_a, const T* v_b, T* v_out, long long i, float wa, float wb,
                                             float inv) {
    float a[W], b[W];
    pk_load<T, W>(v_a, i, a);
    pk_load<T, W>(v_b, i, b);
    // A state of weight 0 (lse -inf: an empty segment) contributes nothing, whatever its v holds (0 * NaN
    // would be NaN); a weighed state's NaN still shows.
#pragma unroll
    for (int j = 0; j < W; j++) a[j] = ((wa != 0.0f ? wa * a[j] : 0.0f) + (wb != 0.0f ? wb * b[j] : 0.0f)) * inv;
    pk_store<T, W>(v_out, i, a);
}

// W elements at i of the merge of num_states rows vt[k * row_stride + i] with weights w(st[k * num_heads], m).
template <typename T, int W>
__device__ __forceinline__ void merge_n_chunk(const T* vt, const float* st, T* v_out, long long i, long long o,
                                              int num_states, long long row_stride, int num_heads, float m,
                                              float inv) {
    float acc[W], x[W];
#pragma unroll
    for (int j = 0; j < W; j++) acc[j] = 0.0f;
#pragma unroll 2  // two 16-byte loads in flight a lane; deeper unrolling ran out of registers on sm_75
    for (int k = 0; k < num_states; k++) {
        const float wk = cascade_weight(st[(long long)k * num_heads], m);
        pk_load<T, W>(vt, k * row_stride + i, x);
        const bool live = wk != 0.0f;  // an empty state contributes nothing, whatever its v holds (see merge2_chunk)
#pragma unroll
        for (int j = 0; j < W; j++) acc[j] += live ? wk * x[j] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < W; j++) acc[j] *= inv;
    pk_store<T, W>(v_out, o + i, acc);
}

template <typename T>
__device__ __forceinline__ void merge_state_impl(const T* v_a, const float* s_a, const T* v_b, const float* s_b,
                                                 const unsigned char* mask, T* v_out, float* s_out, long long seq_len,
                                                 int num_heads, int head_dim, int has_mask) {
    constexpr int N = PkVec16<T>::N;
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const bool vec = head_dim % N == 0 && pk_aligned16(v_a) && pk_aligned16(v_b) && pk_aligned16(v_out);
    for (long long t = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); t < seq_len; t += warps) {
        if (has_mask && !mask[t]) continue;  // a masked-off token keeps its state
        const long long r = t * num_heads + blockIdx.y;
        const float sa = s_a[r], sb = s_b[r];
        const float m = fmaxf(sa, sb);
        const float wa = cascade_weight(sa, m), wb = cascade_weight(sb, m);
        const CascadeNorm n = cascade_norm(m, wa + wb);
        const long long base = r * head_dim;
        // A row is a few chunks a lane (head_dim <= 256: at most 2): unrolling only adds live registers.
        if (vec) {
#pragma unroll 1
            for (int i = N * lane; i < head_dim; i += 32 * N) merge2_chunk<T, N>(v_a, v_b, v_out, base + i, wa, wb, n.inv);
        } else {
#pragma unroll 1
            for (int i = lane; i < head_dim; i += 32) merge2_chunk<T, 1>(v_a, v_b, v_out, base + i, wa, wb, n.inv);
        }
        __syncwarp();  // every lane has read s_a[r] before lane 0 may overwrite it (in place)
        if (lane == 0) s_out[r] = n.lse;
    }
}

PK_IO_KERNELS(merge_state, (256), (const T* v_a, const float* s_a, const T* v_b, const float* s_b,
              const unsigned char* mask, T* v_out, float* s_out, long long seq_len, int num_heads, int head_dim,
              int has_mask),
              (v_a, s_a, v_b, s_b, mask, v_out, s_out, seq_len, num_heads, head_dim, has_mask))

template <typename T>
__device__ __forceinline__ void merge_states_impl(const T* __restrict__ v, const float* __restrict__ s,
                                                  T* __restrict__ v_out, float* __restrict__ s_out, long long seq_len,
                                                  int num_states, int num_heads, int head_dim) {
    constexpr int N = PkVec16<T>::N;
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const bool vec = head_dim % N == 0 && pk_aligned16(v) && pk_aligned16(v_out);
    const int h = blockIdx.y;
    for (long long t = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); t < seq_len; t += warps) {
        const long long r = t * num_heads + h;
        const float* st = s + t * num_states * num_heads + h;  // state i's lse at st[i * num_heads]
        // Every lane walks all the lse values itself (broadcast loads): no warp shuffle, whose fallback for a
        // warp the compiler cannot prove converged is a called subroutine (it spilled on sm_86).
        float m = PK_NEG_INF;
        for (int i = 0; i < num_states; i++) m = fmaxf(m, st[(long long)i * num_heads]);
        float sum = 0.0f;  // in index order, the same in every lane
        for (int i = 0; i < num_states; i++) sum += cascade_weight(st[(long long)i * num_heads], m);
        const CascadeNorm n = cascade_norm(m, sum);
        const T* vt = v + (t * num_states * num_heads + h) * head_dim;  // state i's row at vt[i * row_stride]
        const long long row_stride = (long long)num_heads * head_dim;
        const long long o = r * head_dim;
        if (vec) {
#pragma unroll 1
            for (int i = N * lane; i < head_dim; i += 32 * N)
                merge_n_chunk<T, N>(vt, st, v_out, i, o, num_states, row_stride, num_heads, m, n.inv);
        } else {
#pragma unroll 1
            for (int i = lane; i < head_dim; i += 32)
                merge_n_chunk<T, 1>(vt, st, v_out, i, o, num_states, row_stride, num_heads, m, n.inv);
        }
        if (lane == 0) s_out[r] = n.lse;
    }
}

PK_IO_KERNELS(merge_states, (256), (const T* __restrict__ v, const float* __restrict__ s, T* __restrict__ v_out,
              float* __restrict__ s_out, long long seq_len, int num_states, int num_heads, int head_dim),
              (v, s, v_out, s_out, seq_len, num_states, num_heads, head_dim))
