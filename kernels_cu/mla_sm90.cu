// pykern: arch sm_90a
// MLA (DeepSeek-V2 / V3) paged decode on Hopper (sm_90a) with warpgroup MMA (wgmma), bf16 and f16 (one template
// over the element type T). Same arguments, layouts, key split and outputs as mla.cu's mla_decode (see there and
// pykern/ops/mla.py):
//
//     s[h, t] = sm_scale * (q_nope[h] . ckv[t] + q_pe[h] . kpe[t]),   out[h] = softmax_t(s[h]) . ckv
//
// Why wgmma: at 128 heads the mma.sync kernel is bound by shared-memory reads (every warp ldmatrix-es its K and V
// fragments into registers; tools/mla_model.py). wgmma reads its B operand, the latent KV tile, straight from
// shared memory once per warpgroup, and the heads form its M dimension (64 rows).
//
// Work split: a CTA of 3 warpgroups (384 threads) owns 64 heads (grid x; heads past num_heads are zero rows of
// Q that are never stored) of one request (grid y) and one kv split (grid z, as mla.cu).
//   warpgroup 0, the producer (setmaxnreg.dec to 40): the pages are not one tensor, so its 128 threads gather
//     each tile's 32 latent rows (512 ckv + 64 kpe halves a row) with 16-byte cp.async (zero fill past the
//     range: a garbage V could be NaN) into a 3-slot ring, in the 128B-swizzled [box of 64 columns][32 rows]
//     [128 B] layout that wgmma reads, looking each row's page up in kv_indices. Tile i's copies complete
//     (cp.async.wait_group, fence.proxy.async: the generic-proxy writes before the async proxy's wgmma reads)
//     while tile i + 1's are in flight, then all 128 arrive on the slot's `full` mbarrier. Before refilling a
//     slot they wait on its `empty` mbarrier (every consumer thread arrives when its wgmmas on it are done).
//   warpgroups 1 and 2, the consumers (setmaxnreg.inc to 232): the 512-wide output accumulator does not fit
//     one warpgroup at 64 rows (256 fp32 a thread), so consumer c owns output columns 256c .. 256c + 255
//     (128 accumulators a thread). Both need the whole S, so they split its contraction instead of both
//     computing it: consumer c computes S over the k-steps 2k + c of the 36 (wgmma m64n32k16 SS, Q and
//     the K tile from shared memory, K-major), writes its fp32 partial to shared memory, and after one named
//     barrier over the 256 consumer threads adds the other's (a + b == b + a in IEEE arithmetic, so both
//     hold the same S bit for bit, take the same online-softmax step and agree on m and l). The exchange
//     buffers alternate between tiles, so one barrier a tile suffices. Then O += P V with wgmma m64n256k16 RS:
//     P rounded to T from the S accumulators (the A-fragment layout), V = the same ring slot's ckv boxes
//     4c .. 4c + 3 read MN-major (no second load, no transpose).
// Shared memory (dynamic, 1024-byte aligned): Q [9 boxes][64 rows][128 B] (72 KiB), the ring [3][9][32][128 B]
// (108 KiB), the S exchange [2 buffers][2 consumers][16][128 threads] fp32 (32 KiB), the mbarriers.
// pykern/ops/mla.py MLA90_SMEM_BYTES is the same.
#include "pk_common.cuh"
#include "pk_ptx.cuh"

#define MLA90_DC 512       // ckv width (the value width too)
#define MLA90_DP 64        // kpe width
#define MLA90_BOXES 9      // 64-column boxes of a 576-wide row
#define MLA90_HEADS 64     // heads a CTA: wgmma's M
#define MLA90_BC 32        // keys a tile (mla.cu's MLA_BC: the same split boundaries)
#define MLA90_ST 3         // ring slots
#define MLA90_THREADS 384  // producer + 2 consumer warpgroups
#define MLA90_Q_BYTES (MLA90_BOXES * MLA90_HEADS * 128)
#define MLA90_SLOT (MLA90_BOXES * MLA90_BC * 128)
#define MLA90_X_BYTES (2 * 2 * (MLA90_BC / 2) * 128 * 4)
#define MLA90_SMEM_BYTES (MLA90_Q_BYTES + MLA90_ST * MLA90_SLOT + MLA90_X_BYTES + 64)

template <typename T> struct Mla90Dt;
template <> struct Mla90Dt<__nv_bfloat16> { enum { V = PK_WGMMA_BF16 }; };
template <> struct Mla90Dt<__half> { enum { V = PK_WGMMA_F16 }; };

// The exact online softmax of one tile for this thread's rows g and g + 8 (r = 0, 1) of the m64n32 S
// accumulators (s[4 j + 2 r + e]: row 16 warp + g + 8 r, key 8 j + 2 t + e): the row max over the quad, P rounded
// to T into the A fragments of O += P V (n-tiles 2 kk, 2 kk + 1 are k-step kk), O and this thread's partial row
// sums rescaled (the quad sums l at the end). m is in raw score units; a row with nothing visible yet stays at
// base 0 (P = 0, no NaN from -inf - -inf).
template <typename T>
__device__ __forceinline__ void mla90_softmax(const float (&s)[MLA90_BC / 2], float (&o)[128], float (&m)[2],
                                              float (&l)[2], unsigned (&pa)[MLA90_BC / 16][4], float sl2) {
    float al[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = m[r];
#pragma unroll
        for (int j = 0; j < MLA90_BC / 8; j++) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(PK_FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(PK_FULL_MASK, mx, 2));
        const float base = mx == PK_NEG_INF ? 0.0f : mx * sl2;
        const float alpha = pk_ex2_approx(m[r] * sl2 - base);
        m[r] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < MLA90_BC / 8; j++) {
            const float p0 = pk_ex2_approx(fmaf(s[4 * j + 2 * r], sl2, -base));
            const float p1 = pk_ex2_approx(fmaf(s[4 * j + 2 * r + 1], sl2, -base));
            sum += p0 + p1;
            pa[j / 2][2 * (j & 1) + r] = Pk16<T>::narrow2(p0, p1);
        }
        l[r] = l[r] * alpha + sum;
        al[r] = alpha;
    }
    // O rescaled only when some row of the warp raised its max (128 FMULs a tile otherwise; once a row's max has
    // settled, typically after its first tiles, alpha is exactly 1). The vote keeps the branch warp-uniform.
    if (__any_sync(PK_FULL_MASK, al[0] != 1.0f || al[1] != 1.0f)) {
#pragma unroll
        for (int j = 0; j < 32; j++)
            o[4 * j] *= al[0], o[4 * j + 1] *= al[0], o[4 * j + 2] *= al[1], o[4 * j + 3] *= al[1];
    }
}

// threadIdx.x through a volatile mov (pk_opaque_u64): the epilogue's lane indices are recomputed after the
// tile loop instead of being kept live through it, where the 128 output accumulators leave no room for them.
__device__ __forceinline__ int mla90_tid_again() { return (int)pk_opaque_u64(threadIdx.x); }

// The wgmmas of consumer C's S partial (no fence, no commit): the k-steps 2 k + C (k < 18) of the 36, k-step 2 k + C
// in box k / 2 at 32 (2 (k % 2) + C) bytes inside it. C is a template parameter so that every offset is a constant
// on the uniform descriptors dq / dk (a consumer index known only at run time puts every descriptor add in vector
// registers and an R2UR pair before each wgmma).
template <typename T, int C>
__device__ __forceinline__ void mla90_issue_scores(float (&sp)[MLA90_BC / 2], unsigned long long dq,
                                                   unsigned long long dk) {
#pragma unroll
    for (int k = 0; k < 18; k++) {
        const unsigned qo = (k / 2) * (MLA90_HEADS * 128) + (2 * (k % 2) + C) * 32;
        const unsigned ko = (k / 2) * (MLA90_BC * 128) + (2 * (k % 2) + C) * 32;
        pk_wgmma_m64nNk16_ss<MLA90_BC, Mla90Dt<T>::V>(sp, pk_wgmma_desc_advance(dq, qo),
                                                      pk_wgmma_desc_advance(dk, ko), k > 0);
    }
}

template <typename T>
__device__ __forceinline__ void mla90_body(const T* __restrict__ q_nope, const T* __restrict__ q_pe,
                                           const T* __restrict__ ckv, const T* __restrict__ kpe, T* __restrict__ out,
                                           float* __restrict__ lse, T* __restrict__ part_o,
                                           float* __restrict__ part_lse, const int* __restrict__ kv_indptr,
                                           const int* __restrict__ kv_indices, const int* __restrict__ kv_len,
                                           int num_heads, int page_size, long long ckv_sp, long long ckv_st,
                                           long long kpe_sp, long long kpe_st, int num_splits, int write_lse,
                                           float sm_scale) {
    extern __shared__ __align__(1024) unsigned char mla90_smem[];
    unsigned char* const qs = mla90_smem;
    unsigned char* const ring = qs + MLA90_Q_BYTES;
    float* const xs = reinterpret_cast<float*>(ring + MLA90_ST * MLA90_SLOT);
    unsigned long long* const full = reinterpret_cast<unsigned long long*>(ring + MLA90_ST * MLA90_SLOT + MLA90_X_BYTES);
    unsigned long long* const empty = full + MLA90_ST;

    const int tid = threadIdx.x, wg = tid / 128;
    const int H = num_heads, h0 = blockIdx.x * MLA90_HEADS, b = blockIdx.y, split = blockIdx.z;

    // This CTA's keys [begin, end) of request b: mla.cu's split (per rounded up to whole 32-key tiles).
    const int p0 = kv_indptr[b];
    int begin = 0, end = kv_len[b];
    if (num_splits > 1) {
        const unsigned int L = (unsigned int)end, ns = (unsigned int)num_splits;
        const unsigned int per = (L / ns + (L % ns != 0u) + MLA90_BC - 1) / MLA90_BC * MLA90_BC;
        const unsigned int lo = per * (unsigned int)split;
        begin = lo < L ? (int)lo : end;
        end = L - (unsigned int)begin > per ? begin + (int)per : end;
    }
    const int n_tiles = (end - begin + MLA90_BC - 1) / MLA90_BC;

    if (tid == 0) {
        for (int s = 0; s < MLA90_ST; s++) pk_mbarrier_init(&full[s], 128), pk_mbarrier_init(&empty[s], 256);
        pk_fence_mbarrier_init();
    }
    __syncthreads();

    if (wg == 0) {  // ---- producer ----
        pk_setmaxnreg_dec<40>();
        // Thread tid copies ring row fr = tid / 4 (a key of the tile), its 16-byte chunks q = tid % 4 + 4 i
        // (i < 18; q < 64: ckv columns 8q.., else kpe columns 8 (q - 64)..). Chunk q lands in box q / 8 at the
        // 128B swizzle's unit (q % 8) ^ (fr % 8).
        const int fr = tid >> 2, fq = tid & 3;
        const unsigned row_off = (unsigned)(fr * 128);
        for (int i = 0; i < n_tiles; i++) {
            const int s = i % MLA90_ST;
            pk_mbarrier_wait_parity(&empty[s], ((i / MLA90_ST) & 1) ^ 1);
            const int t = begin + i * MLA90_BC + fr;
            const bool in = t < end;
            long long co = 0, po = 0;
            if (in) {
                const unsigned pi = (unsigned)t / (unsigned)page_size;
                const long long page = kv_indices[(long long)p0 + pi];
                const long long off = t - (long long)pi * page_size;
                co = page * ckv_sp + off * ckv_st, po = page * kpe_sp + off * kpe_st;
            }
            unsigned char* dst = ring + s * MLA90_SLOT;
#pragma unroll 2
            for (int k = 0; k < 18; k++) {
                const int q = fq + 4 * k;
                const T* src = q < 64 ? ckv + co + 8 * q : kpe + po + 8 * (q - 64);
                pk_cp_async_16_zfill_at(dst, (unsigned)((q >> 3) * (MLA90_BC * 128)) + row_off +
                                                 (unsigned)((((q & 7) ^ (fr & 7))) << 4),
                                        src, in);
            }
            pk_cp_async_commit();
            if (i > 0) {  // the previous tile has landed: publish it
                pk_cp_async_wait<1>();
                pk_fence_proxy_async_shared();
                pk_mbarrier_arrive(&full[(i - 1) % MLA90_ST]);
            }
        }
        if (n_tiles > 0) {
            pk_cp_async_wait<0>();
            pk_fence_proxy_async_shared();
            pk_mbarrier_arrive(&full[(n_tiles - 1) % MLA90_ST]);
        }
        return;
    }

    // ---- consumers ----
    pk_setmaxnreg_inc<232>();
    const int c = wg - 1, ct = tid - 128, wt = tid % 128, t = tid % 4;
    float o[128];  // output columns 256 c + 8 j + 2 t + e: o[4 j + 2 r + e], rows 16 wq + g + 8 r
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.0f;
    float m[2] = {PK_NEG_INF, PK_NEG_INF}, l[2] = {0.0f, 0.0f};
    const float sl2 = sm_scale * 1.4426950408889634f;

    if (n_tiles > 0) {
        // Q rows h0 .. h0 + 63 into the swizzled boxes (zero rows past num_heads): 64 rows x 72 chunks, 18 a
        // consumer thread; then fence.proxy.async (generic writes read by wgmma) and the consumers' barrier.
        for (int k = 0; k < 18; k++) {
            const int idx = ct + 256 * k, r = idx / 72, q = idx % 72, h = h0 + r;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (h < H) {
                const long long row = (long long)b * H + h;
                v = q < 64 ? *reinterpret_cast<const uint4*>(q_nope + row * MLA90_DC + 8 * q)
                           : *reinterpret_cast<const uint4*>(q_pe + row * MLA90_DP + 8 * (q - 64));
            }
            *reinterpret_cast<uint4*>(qs + (q >> 3) * (MLA90_HEADS * 128) + r * 128 + (((q & 7) ^ (r & 7)) << 4)) = v;
        }
        pk_fence_proxy_async_shared();
        pk_bar_sync(1, 256);

        // Descriptors (K-major, 128B swizzle, SBO 1024 = one 8-row group): Q and K; V MN-major (LBO = one box,
        // the next 64 output columns; SBO 1024 = the next 8 keys), this consumer's boxes 4c...
        const unsigned long long dq = pk_wgmma_desc(qs, 16, 1024, PK_SWIZZLE_128B);
        const unsigned long long dk0 = pk_wgmma_desc(ring, 16, 1024, PK_SWIZZLE_128B);
        const unsigned long long dv0 =
            pk_wgmma_desc(ring + 4 * c * MLA90_BC * 128, MLA90_BC * 128, 1024, PK_SWIZZLE_128B);
        for (int i = 0; i < n_tiles; i++) {
            const int s = i % MLA90_ST;
            pk_mbarrier_wait_parity(&full[s], (i / MLA90_ST) & 1);
            // S partial over this consumer's 18 k-steps. The branch is the warpgroup's (wgmma is .sync.aligned
            // over it); the warp vote tells ptxas it is warp-uniform, without which it serializes every wgmma
            // ("compiler-inserted WG.AR in divergent path").
            float sp[MLA90_BC / 2];
            const unsigned long long dk = pk_wgmma_desc_advance(dk0, s * MLA90_SLOT);
            pk_wgmma_fence();
            if (__all_sync(PK_FULL_MASK, c == 0)) mla90_issue_scores<T, 0>(sp, dq, dk);
            else mla90_issue_scores<T, 1>(sp, dq, dk);
            pk_wgmma_commit();
            pk_wgmma_wait<0>();
            // Exchange: buffer i % 2 (the other consumer read this one's last use before the previous barrier).
            float* xw = xs + ((i & 1) * 2 + c) * (MLA90_BC / 2) * 128;
            const float* xr = xs + ((i & 1) * 2 + (c ^ 1)) * (MLA90_BC / 2) * 128;
#pragma unroll
            for (int e = 0; e < MLA90_BC / 2; e++) xw[e * 128 + wt] = sp[e];
            pk_bar_sync(1, 256);
            const int lim = end - (begin + i * MLA90_BC) - 2 * t;  // this thread's keys 8 j + e of the tile below it
            float sc[MLA90_BC / 2];
#pragma unroll
            for (int e = 0; e < MLA90_BC / 2; e++) {
                const float v = sp[e] + xr[e * 128 + wt];
                sc[e] = 8 * (e / 4) + (e & 1) < lim ? v : PK_NEG_INF;  // keys past the range
            }
            unsigned pa[MLA90_BC / 16][4];
            mla90_softmax<T>(sc, o, m, l, pa, sl2);
            pk_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < MLA90_BC / 16; kk++)  // 16 keys = two 8-row groups of 1024 bytes
                pk_wgmma_m64nNk16_rs<256, Mla90Dt<T>::V, 1>(
                    o, pa[kk], pk_wgmma_desc_advance(dv0, s * MLA90_SLOT + kk * 2048), 1);
            pk_wgmma_commit();
            pk_wgmma_wait<0>();
            pk_mbarrier_arrive(&empty[s]);  // this thread's wgmmas on the slot have completed
        }
    }

    // Epilogue: the quad's row sums, then out (or the split's partial) and the natural-log lse.
    const bool part = num_splits > 1;
    const int et = mla90_tid_again() % 128, e_wq = et / 32, e_g = (et % 32) / 4, e_t = et % 4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float lr = l[r];
        lr += __shfl_xor_sync(PK_FULL_MASK, lr, 1);
        lr += __shfl_xor_sync(PK_FULL_MASK, lr, 2);
        const int h = h0 + 16 * e_wq + e_g + 8 * r;
        if (h >= H) continue;
        const bool seen = lr > 0.0f;
        const float inv = seen ? __fdividef(1.0f, lr) : 0.0f;  // lr >= 1: the row max weighs exp2(0)
        const long long row = part ? ((long long)b * num_splits + split) * H + h : (long long)b * H + h;
        unsigned int* dst = reinterpret_cast<unsigned int*>((part ? part_o : out) + row * MLA90_DC + 256 * c) + e_t;
#pragma unroll
        for (int j = 0; j < 32; j++) dst[4 * j] = Pk16<T>::narrow2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        if (c == 0 && e_t == 0) {
            const float ls = seen ? (m[r] * sl2 + __log2f(lr)) * 0.6931471805599453f : PK_NEG_INF;
            if (part) part_lse[row] = ls;
            else if (write_lse) lse[row] = ls;
        }
    }
}

template <typename T, typename... A>
__device__ __forceinline__ void mla_decode_sm90_impl(A... a) {
    mla90_body<T>(a...);
}

PK_IO16_KERNELS(mla_decode_sm90, (MLA90_THREADS, 1), (const T* __restrict__ q_nope, const T* __restrict__ q_pe,
                const T* __restrict__ ckv, const T* __restrict__ kpe, T* __restrict__ out, float* __restrict__ lse,
                T* __restrict__ part_o, float* __restrict__ part_lse, const int* __restrict__ kv_indptr,
                const int* __restrict__ kv_indices, const int* __restrict__ kv_len, int num_heads, int page_size,
                long long ckv_sp, long long ckv_st, long long kpe_sp, long long kpe_st, int num_splits,
                int write_lse, float sm_scale),
                (q_nope, q_pe, ckv, kpe, out, lse, part_o, part_lse, kv_indptr, kv_indices, kv_len, num_heads,
                 page_size, ckv_sp, ckv_st, kpe_sp, kpe_st, num_splits, write_lse, sm_scale))
