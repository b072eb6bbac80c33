// Cross-entropy forward + backward over rows of logits, the parts shared by the one-CTA kernel of every arch
// (training.cu's cross_entropy_fwd_bwd, two sweeps over a row) and the sm_90a cluster kernel (cross_entropy_sm90.cu's
// cross_entropy_fwd_bwd_cluster, the row resident in the cluster's shared memory: one read): the options, the online
// reduction, the loss and the gradient formulas. (The kernel bodies, which declare __shared__ arrays, stay in their
// .cu files.)
#pragma once
#include "pk_common.cuh"
#include "pk_vec.cuh"

// ---------------------------------------------------------------------------
// cross_entropy_fwd_bwd: one block per row, two reads of the row.
// Read 1 keeps an online (max, sum of exp) per thread plus the (class-weighted) sum
// of the (soft-capped) logits for label smoothing, merged across the block: max, lse
// and the loss come out of one pass. Read 2 writes the gradient, possibly over the
// logits themselves (grad may alias logits: the in-place option, so neither
// pointer is __restrict__). With z = softcap * tanh(x / softcap) (z = x when
// softcap <= 0), p = softmax(z), lse = logsumexp(z), eps = label_smoothing, class
// weights c (all 1 without CE_OPT_WEIGHT), w = c[t], W = sum(c), as torch's
// F.cross_entropy(weight=, label_smoothing=) defines them:
//   ce     = w * (1 - eps) * (lse - z[t]) + eps / V * (W * lse - sum(c * z))
//   zl     = z_loss * lse^2                  (Liger's z-loss: never class-weighted)
//   row_loss = ce * scale[0] + zl * scale[1]
//   dL/dz_i = (p_i * (scale[0] * (w (1 - eps) + eps W / V) + scale[1] * 2 z_loss lse)
//              - scale[0] * ((1 - eps) w [i == t] + eps / V * c_i)) * gr
//   dL/dx_i = dL/dz_i * (1 - tanh^2)
// scale = (1 / sum of w over live rows, 1 / live rows) for "mean" (torch divides the
// weighted loss by the sum of the targets' weights, Liger the z-loss by the count),
// (1, 1) otherwise; gr = grad_rows[row] with CE_OPT_GRAD_ROWS (per-row upstream
// gradients, reduction "none"), else 1. CE_OPT_Z_ROW also writes zl * scale[1] to
// z_row[row]. Without weights ce is lse - (1 - eps) z[t] - eps / V * sum(z), as before.
// row_loss is 0 for pad rows; cross_entropy_loss_reduce sums it in parallel in a
// fixed order (deterministic). Every exp has an argument <= 0 (z - running max), so
// pk_exp_fast (one MUFU.EX2, ~2^-22 relative) stays far inside the f32 table.
//
// Non-finite logits, as torch: a NaN or a +inf in a live row makes its loss and its
// whole gradient row NaN; a -inf logit has probability 0 (loss +inf when it is the
// target, or with label smoothing); a row of -inf only is NaN. NaN travels in the running
// sum s, never in the max: x = NaN fails `x > m` and lands in the else branch, where
// exp(NaN - m) = NaN sticks in s for good (s * 0 + 1 and s + e keep a NaN s). So the
// max reductions may stay fmaxf (FMNMX, which drops NaN), and a thread whose m is still
// -inf holds s = 0, or NaN if it saw one: the merge passes its s through as is. A +inf
// reaches NaN through exp(inf - inf) in that merge (or in s, for a second +inf).
#define CE_OPT_WEIGHT 1
#define CE_OPT_GRAD_ROWS 2
#define CE_OPT_Z_ROW 4
#define CE_BATCH 4  // 16-byte loads of a row a thread issues before it uses the first (both sweeps)
// Both sweeps' 16-byte pass over a row [0, n) of p at base: body(i, raw) for each of this thread's chunks, in
// ascending order, CE_BATCH raw loads issued before the first of them is used.
template <typename T, typename F>
__device__ __forceinline__ void ce_row16(const T* p, long long base, long long n, F&& body) {
    const long long step = (long long)PkVec16<T>::N * blockDim.x;
    long long i = (long long)PkVec16<T>::N * threadIdx.x;
    for (; i + (CE_BATCH - 1) * step < n; i += CE_BATCH * step) {
        uint4 raw[CE_BATCH];
#pragma unroll
        for (int u = 0; u < CE_BATCH; ++u) raw[u] = pk_ld16_raw(p, base + i + u * step);
#pragma unroll
        for (int u = 0; u < CE_BATCH; ++u) body(i + u * step, raw[u]);
    }
    for (; i < n; i += step) body(i, pk_ld16_raw(p, base + i));
}
__device__ __forceinline__ void ce_online(float x, float& m, float& s) {
    if (x > m) {
        s = s * pk_exp_fast(m - x) + 1.0f;  // m = -inf gives s * 0 + 1
        m = x;
    } else if (x != PK_NEG_INF) {
        s += pk_exp_fast(x - m);  // x = -inf adds 0 (and -inf - -inf would be NaN); NaN x: NaN
    }
}

// Per-row constants of the gradient sweep.
struct PkCeRow {
    float mx, a, hit, eps_v, cap, inv_cap;
    long long t;
};

__device__ __forceinline__ float ce_cap(float x, float cap, float inv_cap) {
    return cap > 0.0f ? cap * tanhf(x * inv_cap) : x;
}

// c: the class weight of column i (1 without weights); eps_v already holds the row's scales.
__device__ __forceinline__ float ce_grad(float x, long long i, float c, const PkCeRow& r) {
    float z = x, d = 1.0f;
    if (r.cap > 0.0f) {
        const float th = tanhf(x * r.inv_cap);
        z = r.cap * th;
        d = 1.0f - th * th;
    }
    const float g = pk_exp_fast(z - r.mx) * r.a - (i == r.t ? r.hit : 0.0f) - r.eps_v * c;
    return g * d;
}

__device__ __forceinline__ void ce_acc(float x, float c, const float cap, const float inv_cap, float& m, float& s,
                                       float& sz) {
    const float z = ce_cap(x, cap, inv_cap);
    ce_online(z, m, s);
    sz += c * z;
}

// The loss of one row (stored by the thread with `write`) and the constants of its gradient sweep, from the row's
// reductions: max mx, sum of exp(z - mx), sum of c * z (zsum), sum of the class weights (wsum), and the target's
// (capped) logit zt. Shared by the one-CTA kernel and the cluster kernel (cross_entropy_fwd_bwd_cluster).
__device__ __forceinline__ PkCeRow ce_row_finish(float mx, float sum, float zsum, float wsum, float zt, long long target,
                                                 long long row, long long n, bool write, bool has_w,
                                                 const float* __restrict__ class_weight,
                                                 const float* __restrict__ grad_rows, float* __restrict__ row_loss,
                                                 float* __restrict__ z_row, float s_ce, float s_z, float smoothing,
                                                 float z_loss, float cap, float inv_cap, int opts) {
    const float lse = mx + logf(sum);
    const float eps_v = smoothing / (float)n;
    const float wt = has_w ? class_weight[target] : 1.0f;
    const float gr = (opts & CE_OPT_GRAD_ROWS) ? grad_rows[row] : 1.0f;
    const float zl = z_loss * lse * lse;
    if (write) {
        float ce;
        if (has_w) {
            ce = wt * (1.0f - smoothing) * (lse - zt);
            // 0 * (a sum holding -inf) would be NaN where torch's loss is finite
            if (smoothing != 0.0f) ce += eps_v * (wsum * lse - zsum);
        } else {
            ce = lse - (1.0f - smoothing) * zt - eps_v * zsum;
        }
        row_loss[row] = ce * s_ce + zl * s_z;
        if (opts & CE_OPT_Z_ROW) z_row[row] = zl * s_z;
    }
    const float main = has_w ? wt * (1.0f - smoothing) + eps_v * wsum : 1.0f;
    PkCeRow r;
    r.mx = mx;
    r.a = (s_ce * main + s_z * 2.0f * z_loss * lse) * gr / sum;
    r.hit = s_ce * wt * (1.0f - smoothing) * gr;
    r.eps_v = s_ce * eps_v * gr;
    r.cap = cap;
    r.inv_cap = inv_cap;
    r.t = target;
    return r;
}
