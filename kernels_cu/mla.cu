// Multi-head latent attention (MLA, DeepSeek-V2 / V3) paged decode, bf16 and f16 (one template over the element
// type T), sm_80 and newer, in FlashInfer's BatchMLAPagedAttentionWrapper terms. Every query head attends to
// one shared latent KV: a token's key is [ckv (512) | kpe (64)] and its value is its ckv itself:
//
//     s[h, t] = sm_scale * (q_nope[h] . ckv[t] + q_pe[h] . kpe[t]),   out[h] = softmax_t(s[h]) . ckv
//
// with pages ckv_cache (num_pages, page_size, 512) and kpe_cache (num_pages, page_size, 64), a request's pages in
// CSR form (kv_indptr, kv_indices) and its length kv_len[b]. One query a request (decode).
//
// Why tensor cores: the latent KV is shared by all heads, so a CTA reads a key tile once and 16 heads use it
// (heads as the M dimension of mma.sync m16n8k16; num_heads a multiple of 16 fills every row, fewer heads are
// zero-padded rows that are never stored):
//   S = Q K^T, 16 heads x 32 keys a tile, contraction 576 = 36 k-steps split across the 4 warps (9 each): a
//       warp's Q slice (9 A fragments, 36 registers) stays in registers for the whole CTA and it reads only
//       its 144 columns of the K tile (ldmatrix, non-transposed: keys are B's columns), so every K byte of the
//       ring is read from shared memory once. The 4 partial S tiles (fp32, 2 KB a warp) are summed through
//       shared memory, in warp order, by every warp: each warp then holds the same full S, takes the same
//       online-softmax step (fatc_online_softmax, base 2) and needs no exchange of maxima or of P.
//   O += P V, P rounded to T from the S accumulators straight into the A layout (as FA2), V = the ckv columns
//       of the same ring rows through ldmatrix.trans; the 512 output columns are split across the warps (128
//       a warp: 16 n-tiles, 64 fp32 accumulators a lane).
// The K tiles stream through a 2-slot cp.async ring (16-byte LDGSTS; 32 rows of 576 halves padded to 584, so
// the 8 row addresses of an ldmatrix phase fall in distinct banks): tile i + 1 loads while tile i computes.
// A tile costs two barriers: the ring's (tile i landed, everyone is done with the slot refilled next and with
// the S exchange buffer) and the exchange's. Each ring row's page is looked up a tile ahead of its fill, so the
// page-table load's latency hides behind a tile. Keys past the range land as zeros (cp.async's zero fill: a
// garbage V could be NaN, and 0 * NaN is NaN) and are masked to -inf. Offsets into the caches are 64-bit.
//
// Split-KV (num_splits > 1, for small batches): grid z is the split; split z covers keys [z per, (z + 1) per)
// of its request (per = ceil(len / num_splits) rounded up to whole tiles) and writes its partial, out in T
// and the natural-log lse in fp32, to part_o (batch, num_splits, num_heads, 512) / part_lse (batch,
// num_splits, num_heads): the layout of cascade.cu's merge_states, which the op launches next to merge them
// (one source of the merge math). An empty split or request gives 0 and lse -inf, which the merge weighs 0.
// Grid: x = head tile (16 heads; adjacent CTAs share a request's key tiles in L2), y = request, z = split.
#include "pk_attn_tc.cuh"
#include "pk_attn_tile.cuh"

#define MLA_DC 512       // ckv width (the value width too)
#define MLA_DP 64        // kpe width
#define MLA_SD 584       // a ring row in halves: 576 + 8 of padding (1168 bytes: 73 16-byte chunks, odd)
#define MLA_BC 32        // keys a tile
#define MLA_THREADS 128  // 4 warps
#define MLA_KSW 9        // k-steps of Q K^T a warp (36 / 4)
#define MLA_SLOT (MLA_BC * MLA_SD * 2)  // bytes of a ring slot
// Dynamic shared memory: the ring (2 slots), then the S exchange (4 warps x 4 n-tiles x 32 lanes x float4).
// pykern/ops/mla.py MLA_SMEM_BYTES is the same (82,944 bytes: under sm_86 / sm_89's 99 KB a CTA).
#define MLA_SMEM_BYTES (2 * MLA_SLOT + 4 * 4 * 32 * 16)

template <typename T>
__device__ __forceinline__ void mla_decode_body(const T* __restrict__ q_nope, const T* __restrict__ q_pe,
                                                const T* __restrict__ ckv, const T* __restrict__ kpe,
                                                T* __restrict__ out, float* __restrict__ lse,
                                                T* __restrict__ part_o, float* __restrict__ part_lse,
                                                const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
                                                const int* __restrict__ kv_len, int num_heads, int page_size,
                                                long long ckv_sp, long long ckv_st, long long kpe_sp,
                                                long long kpe_st, int num_splits, int write_lse, float sm_scale) {
    extern __shared__ __align__(16) unsigned char mla_smem[];
    float4* const xs = reinterpret_cast<float4*>(mla_smem + 2 * MLA_SLOT);  // [warp][n-tile][lane]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int H = num_heads, h0 = blockIdx.x * 16, b = blockIdx.y, split = blockIdx.z;

    // This CTA's keys [begin, end) of request b (the op checked 0 <= kv_len[b] <= its pages * page_size).
    const int p0 = kv_indptr[b];
    int begin = 0, end = kv_len[b];
    if (num_splits > 1) {
        const unsigned int L = (unsigned int)end, ns = (unsigned int)num_splits;
        const unsigned int per = (L / ns + (L % ns != 0u) + MLA_BC - 1) / MLA_BC * MLA_BC;
        const unsigned int lo = per * (unsigned int)split;
        begin = lo < L ? (int)lo : end;
        end = L - (unsigned int)begin > per ? begin + (int)per : end;
    }

    // This warp's Q slice as A fragments: k-steps 9 warp .. 9 warp + 8 of the 36 (k-steps 0..31 are q_nope's 512
    // columns, 32..35 q_pe's 64); rows h0 + g (a0, a2) and h0 + g + 8 (a1, a3), zero past num_heads.
    unsigned int qa[MLA_KSW][4];
    {
        const int r0 = h0 + g, r1 = h0 + g + 8;
        const bool u0 = r0 < H, u1 = r1 < H;
        const long long row0 = (long long)b * H + (u0 ? r0 : 0), row1 = (long long)b * H + (u1 ? r1 : 0);
        const unsigned int* n0 = reinterpret_cast<const unsigned int*>(q_nope + row0 * MLA_DC);
        const unsigned int* n1 = reinterpret_cast<const unsigned int*>(q_nope + row1 * MLA_DC);
        const unsigned int* e0 = reinterpret_cast<const unsigned int*>(q_pe + row0 * MLA_DP);
        const unsigned int* e1 = reinterpret_cast<const unsigned int*>(q_pe + row1 * MLA_DP);
#pragma unroll
        for (int ks = 0; ks < MLA_KSW; ks++) {
            const int kk = MLA_KSW * warp + ks;  // a word is 2 halves: k-step kk starts at word 8 kk
            const bool pe = kk >= MLA_DC / 16;
            const unsigned int* a = pe ? e0 + 8 * (kk - MLA_DC / 16) : n0 + 8 * kk;
            const unsigned int* c = pe ? e1 + 8 * (kk - MLA_DC / 16) : n1 + 8 * kk;
            qa[ks][0] = u0 ? a[t4] : 0u;
            qa[ks][1] = u1 ? c[t4] : 0u;
            qa[ks][2] = u0 ? a[4 + t4] : 0u;
            qa[ks][3] = u1 ? c[4 + t4] : 0u;
        }
    }

    // The fill: thread tid copies ring row tid / 4 (a key of the tile), its 16-byte chunks tid % 4 + 4 i (16 of
    // ckv, 2 of kpe). Its row's page and offset for the next fill are looked up a tile ahead (locate).
    const int fr = tid >> 2, fq = tid & 3;
    const unsigned short* ckv_w = reinterpret_cast<const unsigned short*>(ckv) + 8 * fq;
    const unsigned short* kpe_w = reinterpret_cast<const unsigned short*>(kpe) + 8 * fq;
    int f_page = 0, f_off = 0;
    auto locate = [&](int t0) {
        const int t = t0 + fr;
        if (t < end) {
            const unsigned int pi = (unsigned int)t / (unsigned int)page_size;
            f_off = t - (int)(pi * (unsigned int)page_size);
            f_page = kv_indices[(long long)p0 + pi];
        }
    };
    auto fill = [&](int t0, int slot) {
        const bool in = t0 + fr < end;  // rows past the range: 16 zero bytes, nothing read
        const unsigned short* cs = ckv_w + (in ? (long long)f_page * ckv_sp + (long long)f_off * ckv_st : 0);
        const unsigned short* ps = kpe_w + (in ? (long long)f_page * kpe_sp + (long long)f_off * kpe_st : 0);
        unsigned char* dst = mla_smem + slot * MLA_SLOT;
        const unsigned int row = (unsigned int)(fr * MLA_SD * 2 + fq * 16);
#pragma unroll
        for (int i = 0; i < MLA_DC / 32; i++) pk_cp_async_16_zfill_at(dst, row + 64 * i, cs + 32 * i, in);
#pragma unroll
        for (int i = 0; i < MLA_DP / 32; i++)
            pk_cp_async_16_zfill_at(dst, row + MLA_DC * 2 + 64 * i, ps + 32 * i, in);
    };

    // ldmatrix lane addresses. K (B of S, one k-step of two n-tiles an x4): matrix j = lane / 8 is keys
    // 8 (j >> 1) .., columns 8 (j & 1) .. of the k-step, so r[0..1] is n-tile 0's b and r[2..3] n-tile 1's.
    // V (B of P V, .trans, one k-step of two output n-tiles): matrix j is keys 8 (j & 1) .., columns 8 (j >> 1).
    const pk_saddr ring = pk_saddr_of(mla_smem);
    const pk_saddr k_lane = ring + (unsigned int)((((lane & 7) + 8 * (lane >> 4)) * MLA_SD + 8 * ((lane >> 3) & 1) +
                                                   16 * MLA_KSW * warp) * 2);
    const pk_saddr v_lane = ring + (unsigned int)((((lane & 7) + 8 * ((lane >> 3) & 1)) * MLA_SD + 8 * (lane >> 4) +
                                                   (MLA_DC / 4) * warp) * 2);

    float o[16][4];  // this warp's 128 output columns: n-tile i is columns 128 warp + 8 i ..
#pragma unroll
    for (int i = 0; i < 16; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m[2] = {PK_NEG_INF, PK_NEG_INF}, l[2] = {0.0f, 0.0f};  // rows g, g + 8
    const float mul = sm_scale * PA_LOG2E;

    if (begin < end) {
        locate(begin);
        fill(begin, 0);
        pk_cp_async_commit();
        locate(begin + MLA_BC);
    }
    int slot = 0;
    for (int t0 = begin; t0 < end; t0 += MLA_BC) {
        pk_cp_async_wait<0>();  // this thread's copies of tile t0 have landed
        __syncthreads();        // everyone's have; everyone is done with the other slot and with xs
        if (t0 + MLA_BC < end) fill(t0 + MLA_BC, slot ^ 1);
        pk_cp_async_commit();
        locate(t0 + 2 * MLA_BC);  // the fill after next: its load lands while this tile computes
        const unsigned int so = (unsigned int)(slot * MLA_SLOT);
        slot ^= 1;

        // S partial over this warp's 144 columns: 4 n-tiles of 8 keys.
        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < MLA_KSW; ks++) {
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                unsigned int kf[4];
                pk_ldmatrix_x4_s(kf, k_lane + so + (unsigned int)((hf * 16 * MLA_SD + 16 * ks) * 2));
                pk_mma_m16n8k16<T>(s[2 * hf], qa[ks], kf, s[2 * hf]);
                pk_mma_m16n8k16<T>(s[2 * hf + 1], qa[ks], kf + 2, s[2 * hf + 1]);
            }
        }
        // Exchange: every warp sums the 4 partials in warp order (the same S, bit for bit, in every warp).
#pragma unroll
        for (int i = 0; i < 4; i++) xs[(warp * 4 + i) * 32 + lane] = make_float4(s[i][0], s[i][1], s[i][2], s[i][3]);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float4 acc = xs[i * 32 + lane];
#pragma unroll
            for (int w = 1; w < 4; w++) {
                const float4 x = xs[(w * 4 + i) * 32 + lane];
                acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
            }
            // keys past the range masked (rows g: e = 0, 1; g + 8: e = 2, 3; key 8 i + 2 t4 + (e & 1))
            const int kb = t0 + 8 * i + 2 * t4;
            s[i][0] = kb < end ? acc.x : PK_NEG_INF;
            s[i][1] = kb + 1 < end ? acc.y : PK_NEG_INF;
            s[i][2] = kb < end ? acc.z : PK_NEG_INF;
            s[i][3] = kb + 1 < end ? acc.w : PK_NEG_INF;
        }
        fatc_online_softmax(s, o, m, l, mul);

        // O += P V: S n-tiles 2 j, 2 j + 1 are the A fragment of k-step j (keys 16 j ..).
#pragma unroll
        for (int j = 0; j < 2; j++) {
            unsigned int pa[4];
            pa[0] = Pk16<T>::narrow2(s[2 * j][0], s[2 * j][1]);
            pa[1] = Pk16<T>::narrow2(s[2 * j][2], s[2 * j][3]);
            pa[2] = Pk16<T>::narrow2(s[2 * j + 1][0], s[2 * j + 1][1]);
            pa[3] = Pk16<T>::narrow2(s[2 * j + 1][2], s[2 * j + 1][3]);
#pragma unroll
            for (int np = 0; np < 8; np++) {
                unsigned int vf[4];
                pk_ldmatrix_x4_trans_s(vf, v_lane + so + (unsigned int)((16 * j * MLA_SD + 16 * np) * 2));
                pk_mma_m16n8k16<T>(o[2 * np], pa, vf, o[2 * np]);
                pk_mma_m16n8k16<T>(o[2 * np + 1], pa, vf + 2, o[2 * np + 1]);
            }
        }
    }
    pk_cp_async_wait<0>();  // nothing left in flight (the last commit group is empty)

    // Epilogue: the quad's row sums, then out (or the split's partial) and the natural-log lse.
    const bool part = num_splits > 1;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float lr = l[r];
        lr += __shfl_xor_sync(PK_FULL_MASK, lr, 1);
        lr += __shfl_xor_sync(PK_FULL_MASK, lr, 2);
        const int h = h0 + g + 8 * r;
        if (h >= H) continue;
        const bool seen = lr > 0.0f;
        const float inv = seen ? __fdividef(1.0f, lr) : 0.0f;  // lr >= 1: the row max weighs exp2(0)
        const long long row = part ? ((long long)b * num_splits + split) * H + h : (long long)b * H + h;
        unsigned int* dst = reinterpret_cast<unsigned int*>((part ? part_o : out) + row * MLA_DC) + 64 * warp + t4;
#pragma unroll
        for (int i = 0; i < 16; i++) dst[4 * i] = Pk16<T>::narrow2(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
        if (warp == 0 && t4 == 0) {
            const float ls = seen ? (m[r] * mul + __log2f(lr)) * PA_LN2 : PK_NEG_INF;
            if (part) part_lse[row] = ls;
            else if (write_lse) lse[row] = ls;
        }
    }
}

// sm_75: a trap (the op refuses that arch before any launch); sm_80+: the body.
PK_ATTN_TC_ENTRY(mla_decode_impl, mla_decode_body)

PK_IO16_KERNELS(mla_decode, (MLA_THREADS, 1), PK_MLA_DECODE_PARAMS, PK_MLA_DECODE_ARGS)
