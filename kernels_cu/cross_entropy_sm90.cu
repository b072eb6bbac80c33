// pykern: arch sm_90a
// Hopper cross-entropy forward + backward with the logits read once: a thread-block cluster of 2..8 CTAs keeps each
// row resident in its shared memory and reduces the row's max and sum of exp across the cluster through distributed
// shared memory (QuACK's cross_entropy). Options, formulas and helpers: pk_ce.cuh, shared with the one-CTA kernel of
// every arch (training.cu's cross_entropy_fwd_bwd). The op (pykern/ops/training.py) chooses the cluster size from
// the vocabulary and keeps the one-CTA kernel for other archs and for rows wider than 8 CTAs' shared memory.
#include "pk_common.cuh"
#include "pk_vec.cuh"
#include "pk_ptx.cuh"
#include "pk_ce.cuh"

// cross_entropy_fwd_bwd_cluster: the logits read once from HBM (QuACK's cross_entropy, read, not copied).
// A thread-block cluster of nc CTAs (2..8, chosen by the op from the vocab: cross_entropy_cluster_plan) holds one
// row in shared memory: CTA `rank` copies columns [rank * slice, rank * slice + slice) (16-byte cp.async, every
// chunk of the thread in flight before the one wait; element copies when the rows are not 16-byte aligned), takes
// its slice's max / sum of exp / sums for label smoothing and class weights, and leaves them in its shared memory;
// after barrier.cluster every CTA reads all nc partials through DSMEM (ld.shared::cluster, in rank order, so every
// CTA computes the same row statistics bit for bit), and then the loss (rank 0) and the gradient of its slice come
// from the resident slice. Rows are walked cluster-strided. The partials are double-buffered by row parity: a CTA
// rewrites a buffer only after the next row's barrier.cluster, which every peer reaches after its reads of it.
// Pad and bad-target rows are uniform across the cluster (every CTA reads the same target) and take no barrier.
// The formulas, the options and the non-finite behaviour are cross_entropy_fwd_bwd's (ce_row_finish, ce_grad).
template <typename T>
__device__ __forceinline__ void cross_entropy_fwd_bwd_cluster_impl(
    const T* logits, const long long* __restrict__ targets, T* grad, float* __restrict__ row_loss,
    float* __restrict__ z_row, const float* __restrict__ scale_p, const float* __restrict__ class_weight,
    const float* __restrict__ grad_rows, long long n_rows, unsigned int vocab, unsigned int slice, int pad_id,
    float smoothing, float z_loss, float softcap, int opts) {
    extern __shared__ float4 ce_cluster_smem[];  // the slice, 16-byte aligned
    T* srow = reinterpret_cast<T*>(ce_cluster_smem);
    __shared__ float scratch[32];
    __shared__ float part[2][4];  // this CTA's (max, sum of exp(z - max), sum c * z, sum c) of a row, by parity
    __shared__ float tot[4];      // the row's, combined over the cluster
    constexpr int V = PkVec16<T>::N;
    const bool vec = (vocab % (unsigned int)V == 0u) && (slice % (unsigned int)V == 0u) && pk_aligned16(logits) &&
                     pk_aligned16(grad);
    const bool has_w = (opts & CE_OPT_WEIGHT) != 0;
    const long long n = vocab;
    const unsigned int rank = pk_cluster_ctarank(), nc = pk_cluster_nctarank();
    const long long lo = (long long)rank * slice < n ? (long long)rank * slice : n;
    const long long len = (lo + (long long)slice < n ? lo + (long long)slice : n) - lo;
    const float s_ce = scale_p[0], s_z = scale_p[1];
    const float cap = softcap > 0.0f ? softcap : 0.0f;
    const float inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
    const bool writer = rank == 0u && threadIdx.x == 0;
    const long long n_clusters = gridDim.x / nc;
    unsigned int parity = 0;
    for (long long row = blockIdx.x / nc; row < n_rows; row += n_clusters) {
        const long long base = row * n;
        const long long target = targets[row];
        if (target == pad_id || target < 0 || target >= n) {  // uniform across the cluster
            const float v = target == pad_id ? 0.0f : __int_as_float(0x7fc00000);
            for (long long i = threadIdx.x; i < len; i += blockDim.x) PkIO<T>::store(grad, base + lo + i, v);
            if (writer) {
                row_loss[row] = v;
                if (opts & CE_OPT_Z_ROW) z_row[row] = v;
            }
            continue;
        }
        // z[target] before the barrier.cluster below: no CTA writes an (in-place) gradient before it
        const float zt = writer ? ce_cap(PkIO<T>::load(logits, base + target), cap, inv_cap) : 0.0f;
        __syncthreads();  // the previous row's gradient sweep has read the slice
        if (vec) {
            for (long long i = (long long)V * threadIdx.x; i < len; i += (long long)V * blockDim.x)
                pk_cp_async_16(srow + i, logits + base + lo + i);
            pk_cp_async_commit();
            pk_cp_async_wait_all();
        } else {
            for (long long i = threadIdx.x; i < len; i += blockDim.x)
                srow[i] = logits[base + lo + i];  // raw element copies (no conversion)
        }
        __syncthreads();
        float m = PK_NEG_INF, s = 0.0f, sz = 0.0f, sw = 0.0f;
        if (vec) {
            for (long long i = (long long)V * threadIdx.x; i < len; i += (long long)V * blockDim.x) {
                float a[V];
                pk_widen16<T>(*reinterpret_cast<const uint4*>(srow + i), a);
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    const float c = has_w ? class_weight[lo + i + k] : 1.0f;
                    sw += c;
                    ce_acc(a[k], c, cap, inv_cap, m, s, sz);
                }
            }
        } else {
            for (long long i = threadIdx.x; i < len; i += blockDim.x) {
                const float c = has_w ? class_weight[lo + i] : 1.0f;
                sw += c;
                ce_acc(PkIO<T>::load(srow, i), c, cap, inv_cap, m, s, sz);
            }
        }
        const float cmx = pk_block_max(m, scratch);
        const float csum = pk_block_sum(m == PK_NEG_INF ? s : s * pk_exp_fast(m - cmx), scratch);
        const float czs = smoothing != 0.0f ? pk_block_sum(sz, scratch) : 0.0f;  // uniform branch
        const float cws = (smoothing != 0.0f && has_w) ? pk_block_sum(sw, scratch) : 0.0f;
        if (threadIdx.x == 0) {
            part[parity][0] = cmx;
            part[parity][1] = csum;
            part[parity][2] = czs;
            part[parity][3] = cws;
        }
        pk_cluster_sync();  // every CTA's partials written (release / acquire across the cluster)
        if (threadIdx.x < 32) {
            // lane r < nc reads CTA r's partials (DSMEM); a fixed shuffle tree: the same result in every CTA
            const unsigned int lane = threadIdx.x;
            float pm = PK_NEG_INF, ps = 0.0f, pz = 0.0f, pw = 0.0f;
            if (lane < nc) {
                const unsigned int a = pk_mapa_shared(&part[parity][0], lane);
                const float2 ms = pk_ld_shared_cluster_f32x2(a);
                const float2 zw = pk_ld_shared_cluster_f32x2(a + 8u);
                pm = ms.x;
                ps = ms.y;
                pz = zw.x;
                pw = zw.y;
            }
            const float mx = pk_warp_max(pm);
            // a CTA whose max is -inf holds 0, or NaN from a NaN logit (ce_online): passed on as is
            const float sum = pk_warp_sum(pm == PK_NEG_INF ? ps : ps * pk_exp_fast(pm - mx));
            const float zsum = pk_warp_sum(pz), wsum = pk_warp_sum(pw);
            if (lane == 0) {
                tot[0] = mx;
                tot[1] = sum;
                tot[2] = zsum;
                tot[3] = (smoothing != 0.0f && has_w) ? wsum : (float)n;
            }
        }
        __syncthreads();
        const PkCeRow r = ce_row_finish(tot[0], tot[1], tot[2], tot[3], zt, target, row, n, writer, has_w, class_weight,
                                        grad_rows, row_loss, z_row, s_ce, s_z, smoothing, z_loss, cap, inv_cap, opts);
        // the gradient of the slice from shared memory: the logits are not read again
        if (vec) {
            for (long long i = (long long)V * threadIdx.x; i < len; i += (long long)V * blockDim.x) {
                float a[V];
                pk_widen16<T>(*reinterpret_cast<const uint4*>(srow + i), a);
#pragma unroll
                for (int k = 0; k < V; ++k)
                    a[k] = ce_grad(a[k], lo + i + k, has_w ? class_weight[lo + i + k] : 1.0f, r);
                if constexpr (V == 4) {
                    // f32: NVVM split the float4 store into two 8-byte STG.E.64; the PTX store keeps one 16-byte
                    // STG.E.128 (grad + base + lo + i is 16-byte aligned on this path: vec)
                    pk_st_global_b128(grad + base + lo + i, make_uint4(__float_as_uint(a[0]), __float_as_uint(a[1]),
                                                                       __float_as_uint(a[2]), __float_as_uint(a[3])));
                } else {
                    PkVec16<T>::store(grad, base + lo + i, a);
                }
            }
        } else {
            for (long long i = threadIdx.x; i < len; i += blockDim.x)
                PkIO<T>::store(grad, base + lo + i,
                               ce_grad(PkIO<T>::load(srow, i), lo + i, has_w ? class_weight[lo + i] : 1.0f, r));
        }
        parity ^= 1u;
    }
    pk_cluster_sync();  // no CTA leaves while a peer may still read its partials
}

PK_IO_KERNELS(cross_entropy_fwd_bwd_cluster, (512, 1),
              (const T* logits, const long long* __restrict__ targets, T* grad, float* __restrict__ row_loss,
               float* __restrict__ z_row, const float* __restrict__ scale, const float* __restrict__ class_weight,
               const float* __restrict__ grad_rows, long long n_rows, unsigned int vocab, unsigned int slice,
               int pad_id, float label_smoothing, float z_loss, float softcap, int opts),
              (logits, targets, grad, row_loss, z_row, scale, class_weight, grad_rows, n_rows, vocab, slice, pad_id,
               label_smoothing, z_loss, softcap, opts))
