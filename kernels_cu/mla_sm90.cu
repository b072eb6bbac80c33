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
//     each tile's 64 latent rows (512 ckv + 64 kpe halves a row) with 16-byte cp.async (zero fill past the
//     range: a garbage V could be NaN) into a 2-slot ring, in the 128B-swizzled [box of 64 columns][64 rows]
//     [128 B] layout that wgmma reads, looking each row's page up in kv_indices. Tile i's copies complete
//     (cp.async.wait_group, fence.proxy.async: the generic-proxy writes before the async proxy's wgmma reads)
//     while tile i + 1's are in flight, then all 128 arrive on the slot's `full` mbarrier. Before refilling a
//     slot they wait on its `empty` mbarrier (every consumer thread arrives when its wgmmas on it are done).
//   warpgroups 1 and 2, the consumers (setmaxnreg.inc to 232): the 512-wide output accumulator does not fit
//     one warpgroup at 64 rows (256 fp32 a thread), so consumer c owns output columns 256c .. 256c + 255
//     (128 accumulators a thread). Consumer 0 computes S = Q K^T (wgmma m64n64k16 SS over the 36 k-steps, Q
//     and the K tile from shared memory, K-major), takes the online-softmax step and rounds P to T; it hands
//     P (64 x 64, 8 KiB, the same swizzled layout) and each row's rescale factor to consumer 1 through shared
//     memory (two named-barrier rendezvous a tile: ready, consumed), then runs its O += P V as wgmma
//     m64n256k16 RS (P from its S accumulators). Consumer 1 rescales its O, then runs O += P V as wgmma
//     m64n256k16 SS (P from shared memory). V is the same ring slot's ckv boxes 4c .. 4c + 3, read MN-major (no
//     second load, no transpose).
//     Why one S: S over 64 keys reads Q (72 KiB) from shared memory once a tile whoever computes it; splitting
//     its contraction across the consumers would add an fp32 exchange of 16 KiB a consumer and, within the
//     shared memory a CTA has, force 32-key tiles (Q read twice as often). The tensor cores are the SM's, so
//     the uneven split of the wgmmas between the warpgroups costs nothing by itself.
// Shared memory (dynamic, 1024-byte aligned): Q [9 boxes][64 rows][128 B] (72 KiB), the ring [2][9][64][128 B]
// (144 KiB), P [64 rows][128 B] (8 KiB), the rows' rescale factors and final m / l, the mbarriers.
// pykern/ops/mla.py MLA90_SMEM_BYTES is the same.
#include "pk_common.cuh"
#include "pk_ptx.cuh"
#include "pk_attn_tc.cuh"  // pk_wgmma_online_softmax

#define MLA90_DC 512       // ckv width (the value width too)
#define MLA90_DP 64        // kpe width
#define MLA90_BOXES 9      // 64-column boxes of a 576-wide row
#define MLA90_HEADS 64     // heads a CTA: wgmma's M
#define MLA90_BC 64        // keys a tile
#define MLA90_ST 2         // ring slots
#define MLA90_THREADS 384  // producer + 2 consumer warpgroups
#define MLA90_Q_BYTES (MLA90_BOXES * MLA90_HEADS * 128)
#define MLA90_BOX (MLA90_BC * 128)
#define MLA90_SLOT (MLA90_BOXES * MLA90_BOX)
#define MLA90_P_BYTES (MLA90_HEADS * 128)
// Q, the ring, P, then 64 rescale factors, 64 final m and 64 final l (fp32), then the 2 x 2 ring mbarriers (64
// bytes kept).
#define MLA90_ROWS_OFF (MLA90_Q_BYTES + MLA90_ST * MLA90_SLOT + MLA90_P_BYTES)
#define MLA90_SMEM_BYTES (MLA90_ROWS_OFF + 3 * 64 * 4 + 64)
// Named barriers (0 is __syncthreads'): consumer 0's Q fill (its 128 threads); the P hand-over between the two
// consumers (256 threads): READY once P and the factors of a tile are written (and at the end, m and l),
// FREE once consumer 1's wgmmas have read them. Rendezvous rather than mbarriers so that the host's racecheck,
// which follows named barriers, sees the factors' generic stores and loads ordered.
#define MLA90_BAR_Q 1
#define MLA90_BAR_P_READY 2
#define MLA90_BAR_P_FREE 3

template <typename T> struct Mla90Dt;
template <> struct Mla90Dt<__nv_bfloat16> { enum { V = PK_WGMMA_BF16 }; };
template <> struct Mla90Dt<__half> { enum { V = PK_WGMMA_F16 }; };

// O (this consumer's 256 columns: o[4 j + 2 r + e]) times the rows' factors, only when some row of the warp
// changed (once a row's max has settled, typically after its first tiles, alpha is exactly 1: 128 FMULs saved a
// tile). The vote keeps the branch warp-uniform.
__device__ __forceinline__ void mla90_rescale(float (&o)[128], const float (&al)[2]) {
    if (__any_sync(PK_FULL_MASK, al[0] != 1.0f || al[1] != 1.0f)) {
#pragma unroll
        for (int j = 0; j < 32; j++)
            o[4 * j] *= al[0], o[4 * j + 1] *= al[0], o[4 * j + 2] *= al[1], o[4 * j + 3] *= al[1];
    }
}

// threadIdx.x through a volatile mov (pk_opaque_u64): the epilogue's lane indices are recomputed after the
// tile loop instead of being kept live through it, where the 128 output accumulators leave no room for them.
__device__ __forceinline__ int mla90_tid_again() { return (int)pk_opaque_u64(threadIdx.x); }

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
    unsigned char* const ps = ring + MLA90_ST * MLA90_SLOT;
    float* const al_s = reinterpret_cast<float*>(mla90_smem + MLA90_ROWS_OFF);  // [64] rescale factors
    float* const m_s = al_s + 64;                                                 // [64] final m
    float* const l_s = m_s + 64;                                                  // [64] final l
    unsigned long long* const full = reinterpret_cast<unsigned long long*>(l_s + 64);
    unsigned long long* const empty = full + MLA90_ST;

    const int tid = threadIdx.x, wg = tid / 128;
    const int H = num_heads, h0 = blockIdx.x * MLA90_HEADS, b = blockIdx.y, split = blockIdx.z;

    // This CTA's keys [begin, end) of request b: mla.cu's split (per rounded up to whole 32-key tiles, so that
    // both kernels split at the same keys); this kernel's 64-key tiles start at begin.
    const int p0 = kv_indptr[b];
    int begin = 0, end = kv_len[b];
    if (num_splits > 1) {
        const unsigned int L = (unsigned int)end, ns = (unsigned int)num_splits;
        const unsigned int per = (L / ns + (L % ns != 0u) + 31u) / 32u * 32u;
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
        // Thread tid copies ring row fr = tid / 2 (a key of the tile), its 16-byte chunks q = tid % 2 + 2 k
        // (k < 36; q < 64: ckv columns 8q.., else kpe columns 8 (q - 64)..). Chunk q lands in box q / 8 at the
        // 128B swizzle's unit (q % 8) ^ (fr % 8).
        const int fr = tid >> 1, fq = tid & 1;
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
#pragma unroll 4
            for (int k = 0; k < 36; k++) {
                const int q = fq + 2 * k;
                const T* src = q < 64 ? ckv + co + 8 * q : kpe + po + 8 * (q - 64);
                pk_cp_async_16_zfill_at(dst, (unsigned)((q >> 3) * MLA90_BOX) + row_off +
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
    float o[128];  // output columns 256 c + 8 j + 2 t + e: o[4 j + 2 r + e], rows 16 (wt / 32) + g + 8 r
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.0f;
    float m[2] = {PK_NEG_INF, PK_NEG_INF}, l[2] = {0.0f, 0.0f};
    const float sl2 = sm_scale * 1.4426950408889634f;
    // consumer c's V boxes (MN-major: LBO = one box, the next 64 output columns; SBO 1024 = the next 8 keys)
    const unsigned long long dv0 = pk_wgmma_desc(ring + 4 * c * MLA90_BOX, MLA90_BOX, 1024, PK_SWIZZLE_128B);

    // c == 0 as a warp vote: ptxas then knows the branch is warp-uniform and keeps the descriptors in uniform
    // registers (a plain c == 0 puts every descriptor add in vector registers with an R2UR pair a wgmma).
    const bool first = __all_sync(PK_FULL_MASK, c == 0);
    if (n_tiles > 0 && first) {
        // Q rows h0 .. h0 + 63 into the swizzled boxes (zero rows past num_heads): 64 rows x 72 chunks, 36 a
        // thread; then fence.proxy.async (generic writes read by wgmma) and the warpgroup's barrier.
        for (int k = 0; k < 36; k++) {
            const int idx = ct + 128 * k, r = idx / 72, q = idx % 72, h = h0 + r;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (h < H) {
                const long long row = (long long)b * H + h;
                v = q < 64 ? *reinterpret_cast<const uint4*>(q_nope + row * MLA90_DC + 8 * q)
                           : *reinterpret_cast<const uint4*>(q_pe + row * MLA90_DP + 8 * (q - 64));
            }
            *reinterpret_cast<uint4*>(qs + (q >> 3) * (MLA90_HEADS * 128) + r * 128 + (((q & 7) ^ (r & 7)) << 4)) = v;
        }
        pk_fence_proxy_async_shared();
        pk_bar_sync(MLA90_BAR_Q, 128);

        // Q and K descriptors: K-major, 128B swizzle, SBO 1024 = one 8-row group; k-step ks in box ks / 4, 32
        // bytes a k-step inside it.
        const unsigned long long dq = pk_wgmma_desc(qs, 16, 1024, PK_SWIZZLE_128B);
        const unsigned long long dk0 = pk_wgmma_desc(ring, 16, 1024, PK_SWIZZLE_128B);
        const int lane = tid % 32, prow = 16 * (wt / 32) + lane / 4;  // this thread's P rows prow, prow + 8
        for (int i = 0; i < n_tiles; i++) {
            const int s = i % MLA90_ST;
            const unsigned ph = (i / MLA90_ST) & 1;
            pk_mbarrier_wait_parity(&full[s], ph);
            // the slot's K and V descriptors once a tile (then every k-step's offset is a constant)
            const unsigned long long dk = pk_wgmma_desc_advance(dk0, s * MLA90_SLOT);
            const unsigned long long dv = pk_wgmma_desc_advance(dv0, s * MLA90_SLOT);
            float sc[MLA90_BC / 2];
            pk_wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < 36; ks++)
                pk_wgmma_m64nNk16_ss<MLA90_BC, Mla90Dt<T>::V>(
                    sc, pk_wgmma_desc_advance(dq, (ks / 4) * (MLA90_HEADS * 128) + (ks % 4) * 32),
                    pk_wgmma_desc_advance(dk, (ks / 4) * MLA90_BOX + (ks % 4) * 32), ks > 0);
            pk_wgmma_commit();
            pk_wgmma_wait<0>();
            const int lim = end - (begin + i * MLA90_BC) - 2 * t;  // this thread's keys 8 j + e of the tile below it
#pragma unroll
            for (int e = 0; e < MLA90_BC / 2; e++)
                if (!(8 * (e / 4) + (e & 1) < lim)) sc[e] = PK_NEG_INF;  // keys past the range
            unsigned pa[MLA90_BC / 16][4];
            float al[2];
            pk_wgmma_online_softmax<T, MLA90_BC>(sc, m, l, pa, al, sl2);
            // Hand P and the factors to consumer 1 once it is done with the previous tile's.
            if (i > 0) pk_bar_sync(MLA90_BAR_P_FREE, 256);
#pragma unroll
            for (int kk = 0; kk < MLA90_BC / 16; kk++)
#pragma unroll
                for (int v = 0; v < 4; v++) {
                    // pa[kk][v]: row prow + 8 (v & 1), keys 16 kk + 8 (v >> 1) + 2 t (+1): byte 2 key of the row,
                    // the 16-byte unit XORed by the row % 8
                    const int row = prow + 8 * (v & 1), unit = 2 * kk + (v >> 1);
                    *reinterpret_cast<unsigned*>(ps + row * 128 + ((unit ^ (row & 7)) << 4) + 4 * t) = pa[kk][v];
                }
            if (t == 0) al_s[prow] = al[0], al_s[prow + 8] = al[1];
            pk_fence_proxy_async_shared();
            pk_bar_sync(MLA90_BAR_P_READY, 256);
            mla90_rescale(o, al);
            pk_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < MLA90_BC / 16; kk++)  // 16 keys = two 8-row groups of 1024 bytes
                pk_wgmma_m64nNk16_rs<256, Mla90Dt<T>::V, 1>(o, pa[kk], pk_wgmma_desc_advance(dv, kk * 2048), 1);
            pk_wgmma_commit();
            pk_wgmma_wait<0>();
            pk_mbarrier_arrive(&empty[s]);  // this thread's wgmmas on the slot have completed
        }
    } else if (n_tiles > 0) {
        const unsigned long long dp = pk_wgmma_desc(ps, 16, 1024, PK_SWIZZLE_128B);
        const int prow = 16 * (wt / 32) + (tid % 32) / 4;
        for (int i = 0; i < n_tiles; i++) {
            const int s = i % MLA90_ST;
            pk_mbarrier_wait_parity(&full[s], (i / MLA90_ST) & 1);
            pk_bar_sync(MLA90_BAR_P_READY, 256);
            const unsigned long long dv = pk_wgmma_desc_advance(dv0, s * MLA90_SLOT);
            const float al[2] = {al_s[prow], al_s[prow + 8]};
            mla90_rescale(o, al);
            pk_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < MLA90_BC / 16; kk++)
                pk_wgmma_m64nNk16_ss<256, Mla90Dt<T>::V, 0, 1>(
                    o, pk_wgmma_desc_advance(dp, kk * 32), pk_wgmma_desc_advance(dv, kk * 2048), 1);
            pk_wgmma_commit();
            pk_wgmma_wait<0>();
            pk_mbarrier_arrive(&empty[s]);  // the slot may be refilled
            if (i + 1 < n_tiles) pk_bar_sync(MLA90_BAR_P_FREE, 256);  // P and the factors may be overwritten
        }
    }

    // Epilogue: consumer 0 publishes the rows' m and quad-summed l; then out (or the split's partial) and the
    // natural-log lse.
    const int et = mla90_tid_again() % 128, e_wq = et / 32, e_g = (et % 32) / 4, e_t = et % 4;
    float lr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lr[r] = l[r];
        lr[r] += __shfl_xor_sync(PK_FULL_MASK, lr[r], 1);
        lr[r] += __shfl_xor_sync(PK_FULL_MASK, lr[r], 2);
    }
    const int erow = 16 * e_wq + e_g;
    if (c == 0 && e_t == 0) m_s[erow] = m[0], m_s[erow + 8] = m[1], l_s[erow] = lr[0], l_s[erow + 8] = lr[1];
    pk_bar_sync(MLA90_BAR_P_READY, 256);
    const bool part = num_splits > 1;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int h = h0 + erow + 8 * r;
        if (h >= H) continue;
        const float lv = l_s[erow + 8 * r];
        const bool seen = lv > 0.0f;
        const float inv = seen ? __fdividef(1.0f, lv) : 0.0f;  // lv >= 1: the row max weighs exp2(0)
        const long long row = part ? ((long long)b * num_splits + split) * H + h : (long long)b * H + h;
        unsigned int* dst = reinterpret_cast<unsigned int*>((part ? part_o : out) + row * MLA90_DC + 256 * c) + e_t;
#pragma unroll
        for (int j = 0; j < 32; j++) dst[4 * j] = Pk16<T>::narrow2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        if (c == 0 && e_t == 0) {
            const float ls = seen ? (m_s[erow + 8 * r] * sl2 + __log2f(lv)) * 0.6931471805599453f : PK_NEG_INF;
            if (part) part_lse[row] = ls;
            else if (write_lse) lse[row] = ls;
        }
    }
}

template <typename T, typename... A>
__device__ __forceinline__ void mla_decode_sm90_impl(A... a) {
    mla90_body<T>(a...);
}

PK_IO16_KERNELS(mla_decode_sm90, (MLA90_THREADS, 1), PK_MLA_DECODE_PARAMS, PK_MLA_DECODE_ARGS)
