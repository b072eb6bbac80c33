// Test kernels for the PTX wrappers of kernels_cu/pk_ptx.cuh (tests/test_host_ptx.py).
// Every kernel moves raw registers: the lane <-> matrix-element mapping is checked in
// Python against the PTX ISA tables, not re-derived here.
#include "pk_common.cuh"  // pk_ptx.cuh, and pk_mma_m16n8k16<T> over the element type

// out[i] = pk_cvt_bf16x2(lo[i], hi[i])
extern "C" __global__ void pk_t_cvt_bf16x2(const float* lo, const float* hi, unsigned int* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = pk_cvt_bf16x2(lo[i], hi[i]);
}

extern "C" __global__ void pk_t_ex2(const float* x, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = pk_ex2_approx(x[i]);
}

// One mma per warp: a[lane*4+i], b[lane*2+i], c[lane*4+i] are the lane's registers.
extern "C" __global__ void pk_t_mma(const unsigned int* a, const unsigned int* b, const float* c, float* d) {
    const long long base = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int ra[4], rb[2];
    float rc[4], rd[4];
    for (int i = 0; i < 4; i++) ra[i] = a[base * 4 + i], rc[i] = c[base * 4 + i];
    for (int i = 0; i < 2; i++) rb[i] = b[base * 2 + i];
    pk_mma_m16n8k16_bf16(rd, ra, rb, rc);
    for (int i = 0; i < 4; i++) d[base * 4 + i] = rd[i];
}

// The same through the element-type template: f16 != 0 runs pk_mma_m16n8k16<__half> (mma .f16), else
// pk_mma_m16n8k16<__nv_bfloat16> (the branch is warp-uniform).
extern "C" __global__ void pk_t_mma_t(const unsigned int* a, const unsigned int* b, const float* c, float* d, int f16) {
    const long long base = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int ra[4], rb[2];
    float rc[4], rd[4];
    for (int i = 0; i < 4; i++) ra[i] = a[base * 4 + i], rc[i] = c[base * 4 + i];
    for (int i = 0; i < 2; i++) rb[i] = b[base * 2 + i];
    if (f16) pk_mma_m16n8k16<__half>(rd, ra, rb, rc);
    else pk_mma_m16n8k16<__nv_bfloat16>(rd, ra, rb, rc);
    for (int i = 0; i < 4; i++) d[base * 4 + i] = rd[i];
}

// tile: 32 rows x 8 bf16 (four 8x8 matrices, 16 bytes a row) copied to shared memory;
// lane l passes the address of shared row rowsel[l]; out[lane*4+i] is register i.
extern "C" __global__ void pk_t_ldmatrix(const unsigned short* tile, const int* rowsel, unsigned int* out,
                                         int trans, int misalign) {
    __shared__ __align__(16) unsigned short sm[32 * 8 + 8];
    const int lane = threadIdx.x;
    for (int i = lane; i < 32 * 8; i += 32) sm[i] = tile[i];
    __syncthreads();
    const unsigned short* row = sm + rowsel[lane] * 8 + ((misalign && lane == 5) ? 1 : 0);
    unsigned int r[4];
    if (trans) pk_ldmatrix_x4_trans(r, row);
    else pk_ldmatrix_x4(r, row);
    for (int i = 0; i < 4; i++) out[lane * 4 + i] = r[i];
}

// Two cp.async groups of 16 bytes per thread into dynamic shared memory; snapshots of
// the destination after wait<1> (group 0 must have landed; `early` reads group 1, which
// may not have: a race on a GPU, the old bytes on the host) and after wait_all.
extern "C" __global__ void pk_t_cp_async(const float* src_f, float* after_wait1, float* early, float* after_all) {
    const float4* src = reinterpret_cast<const float4*>(src_f);
    extern __shared__ __align__(16) float4 dst[];
    const int t = threadIdx.x, n = blockDim.x;
    pk_cp_async_16(&dst[t], &src[t]);
    pk_cp_async_commit();
    pk_cp_async_16(&dst[n + t], &src[n + t]);
    pk_cp_async_commit();
    pk_cp_async_wait<1>();
    const float* f = reinterpret_cast<const float*>(&dst[t]);
    const float* e = reinterpret_cast<const float*>(&dst[n + t]);
    for (int i = 0; i < 4; i++) after_wait1[t * 4 + i] = f[i], early[t * 4 + i] = e[i];
    pk_cp_async_wait_all();
    for (int k = 0; k < 2; k++) {
        const float* g = reinterpret_cast<const float*>(&dst[k * n + t]);
        for (int i = 0; i < 4; i++) after_all[(k * n + t) * 4 + i] = g[i];
    }
}

// The base + byte-offset forms: the tile reaches shared memory through pk_cp_async_16_at and is read
// back with pk_ldmatrix_x4[_trans]_at; the result must equal pk_t_ldmatrix's.
extern "C" __global__ void pk_t_ldmatrix_at(const unsigned short* tile, const int* rowsel, unsigned int* out,
                                            int trans) {
    __shared__ __align__(16) unsigned short sm[32 * 8];
    const int lane = threadIdx.x;
    pk_cp_async_16_at(sm, lane * 16, tile + lane * 8);
    pk_cp_async_commit();
    pk_cp_async_wait_all();
    __syncthreads();
    unsigned int r[4];
    if (trans) pk_ldmatrix_x4_trans_at(r, sm, rowsel[lane] * 16);
    else pk_ldmatrix_x4_at(r, sm, rowsel[lane] * 16);
    for (int i = 0; i < 4; i++) out[lane * 4 + i] = r[i];
}

// The zero-fill form: lanes with full == 0 get 16 zero bytes (the source is not read: it is a null
// pointer there), the others their 16 bytes; the shared slots start poisoned by the host.
extern "C" __global__ void pk_t_cp_async_zfill(const unsigned int* src, const int* full, unsigned int* out) {
    __shared__ __align__(16) unsigned int sm[32 * 4];
    const int lane = threadIdx.x;
    pk_cp_async_16_zfill_at(sm, lane * 16, full[lane] ? src + lane * 4 : nullptr, full[lane] != 0);
    pk_cp_async_commit();
    pk_cp_async_wait_all();
    __syncthreads();
    for (int i = 0; i < 4; i++) out[lane * 4 + i] = sm[lane * 4 + i];
}

// Four FP8 elements a word to two f16x2 / bf16x2 words (kind 4: e4m3, 5: e5m2).
// pk_prmt: out[i] = prmt(a[i], b[i], sel[i]) (byte i of the result: byte (sel >> 4 i) & 7 of {b, a}).
extern "C" __global__ void pk_t_prmt(const unsigned int* a, const unsigned int* b, const unsigned int* sel,
                                     unsigned int* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = pk_prmt(a[i], b[i], sel[i]);
}

extern "C" __global__ void pk_t_fp8x4(const unsigned int* w, unsigned int* f16, unsigned int* bf16, int n,
                                      int kind) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (kind == 4) {
        pk_cvt_f16x4_e4m3x4(w[i], f16[2 * i], f16[2 * i + 1]);
        pk_cvt_bf16x4_e4m3x4(w[i], bf16[2 * i], bf16[2 * i + 1]);
    } else {
        pk_cvt_f16x4_e5m2x4(w[i], f16[2 * i], f16[2 * i + 1]);
        pk_cvt_bf16x4_e5m2x4(w[i], bf16[2 * i], bf16[2 * i + 1]);
    }
}

// pk_ld_relaxed_gpu_b128: thread t loads the 16 bytes at src + 8 t (8 16-bit elements) in one strong load
// and writes its 4 words to out[4 t ..].
extern "C" __global__ void pk_t_ld_relaxed_b128(const unsigned short* src, unsigned int* out) {
    const uint4 w = pk_ld_relaxed_gpu_b128(src + 8 * threadIdx.x);
    out[4 * threadIdx.x] = w.x;
    out[4 * threadIdx.x + 1] = w.y;
    out[4 * threadIdx.x + 2] = w.z;
    out[4 * threadIdx.x + 3] = w.w;
}

// decode_tc.cu's split tail with 16-bit partials: every thread of every block stores 8 bf16 (one 16-byte
// store), a barrier, thread 0's acq_rel ticket; every thread of the last block sums, in fp32, its 8 elements
// of every block's partial read with pk_ld_relaxed_gpu_b128.
extern "C" __global__ void pk_t_ticket_b128(unsigned short* partial, unsigned* ticket, float* out, const float* x) {
    const int t = threadIdx.x;
    unsigned int w[4];
    for (int i = 0; i < 4; i++)
        w[i] = pk_cvt_bf16x2(x[blockIdx.x] + (float)(8 * t + 2 * i), x[blockIdx.x] + (float)(8 * t + 2 * i + 1));
    *reinterpret_cast<uint4*>(partial + 8 * (blockIdx.x * blockDim.x + t)) = make_uint4(w[0], w[1], w[2], w[3]);
    __syncthreads();
    const int last = __syncthreads_or(t == 0 && pk_atom_inc_acq_rel_gpu(ticket, gridDim.x - 1) == gridDim.x - 1);
    if (!last) return;
    float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (unsigned b = 0; b < gridDim.x; b++) {
        const uint4 v = pk_ld_relaxed_gpu_b128(partial + 8 * (b * blockDim.x + t));
        const unsigned int u[4] = {v.x, v.y, v.z, v.w};
        for (int i = 0; i < 4; i++) {
            float lo, hi;
            Pk16<__nv_bfloat16>::widen2(u[i], lo, hi);
            s[2 * i] += lo;
            s[2 * i + 1] += hi;
        }
    }
    for (int e = 0; e < 8; e++) out[8 * t + e] = s[e];
}

// Named barriers (pk_bar_red_and / pk_bar_red_or / pk_bar_sync). Block of 4 warpgroups (512 threads): warpgroup
// 0 never arrives (it exits at once, like a warp-specialized producer); warpgroups 1..3 reduce over their own
// 128 threads on barrier 1 + index, `rounds` times, pred[] per thread and round. and_out / or_out: the result
// each thread saw, per round. Warpgroup 3's warps arrive at two different call sites (warps 0, 1 at one, 2, 3
// at the other: legal for the non-.aligned barrier).
extern "C" __global__ void pk_t_bar_red(const int* pred, int* and_out, int* or_out, int rounds) {
    const int tid = threadIdx.x, wg = tid / 128;
    if (wg == 0) return;
    for (int r = 0; r < rounds; r++) {
        const bool p = pred[r * blockDim.x + tid] != 0;
        int a;
        if (wg == 3 && (tid / 32) % 4 >= 2) a = pk_bar_red_and(wg, 128, p);
        else a = pk_bar_red_and(wg, 128, p);
        and_out[r * blockDim.x + tid] = a;
        or_out[r * blockDim.x + tid] = pk_bar_red_or(wg, 128, p);
    }
}

// Shared-memory handoff through a named barrier among warpgroups 1 and 2 (256 threads, barrier 3), warpgroup 0
// away: each thread writes its slot, the barrier, then it reads its mirror's slot (the other warpgroup's).
// mode 0: pk_bar_sync between (clean); 1: no barrier (a race); 2: only warpgroup 1 writes (both halves' slots
// written by thread me) and passes a barrier of its own (barrier 4, 128 threads) before warpgroup 2 reads
// them: that barrier orders nothing for warpgroup 2 (a race, which a block-wide ordering would miss); 3:
// warpgroup 2 arrives with a wrong thread count (reported); 4: as 0, with warpgroup 0's warps 0 and 1 on their
// own named barrier 5 (64 threads) meanwhile; 5: only warpgroup 1 arrives at barrier 3 (256 threads).
extern "C" __global__ void pk_t_bar_handoff(float* out, int mode) {
    __shared__ float slot[256];
    const int tid = threadIdx.x, wg = tid / 128;
    if (wg == 0) {
        if (mode == 4 && tid < 64) pk_bar_sync(5, 64);
        return;
    }
    const int me = tid - 128;
    if (mode == 2) {
        if (wg == 1) {
            slot[me] = (float)(me + 1);
            slot[255 - me] = (float)(256 - me);
            pk_bar_sync(4, 128);
        }
        out[me] = slot[255 - me];
        return;
    }
    slot[me] = (float)(me + 1);
    if (mode == 0 || mode == 4) pk_bar_sync(3, 256);
    else if (mode == 3) pk_bar_sync(3, wg == 1 ? 256 : 224);
    else if (mode == 5 && wg == 1) pk_bar_sync(3, 256);  // warpgroup 2 never comes: a deadlock
    out[me] = slot[255 - me];
}

// FA3's ping-pong of two warpgroups through named barriers 1 and 2 (bar.sync id, 256 / bar.arrive id, 256):
// warpgroup 1 + w (w = 0, 1) waits on barrier 1 + w for its turn, reads what the other warpgroup wrote in its last
// turn (slot 1 - w), writes its own slot w, then passes the turn on (arrives at the other warpgroup's barrier,
// 2 - w). Warpgroup 2 opens the game with an arrival at barrier 1. Warpgroup 0 (a producer) never arrives.
// out[r][256 threads]: the value each thread read in round r.
// mode 0: clean; 1: warpgroup 1 writes its slot once more after its arrival (a race with warpgroup 2's read);
// 2: warpgroup 2 waits with a wrong thread count (224); 3: warpgroup 2 never opens the game (warpgroup 1 waits
// forever); 4: warpgroup 2 opens the game twice (on a GPU the second arrival would count towards the next phase);
// 5: clean, warpgroup 1 opening its own barrier (FA3's way: its arrival and its wait make up the first phase).
extern "C" __global__ void pk_t_bar_pingpong(float* out, int rounds, int mode) {
    __shared__ float slot[2][128];
    const int tid = threadIdx.x, wg = tid / 128, me = tid % 128;
    if (wg == 0) return;
    const int w = wg - 1;
    if (mode == 5 ? w == 0 : w == 1 && mode != 3) pk_bar_arrive(1, 256);
    if (w == 1 && mode == 4) pk_bar_arrive(1, 256);
    for (int r = 0; r < rounds; r++) {
        pk_bar_sync(1 + w, w == 1 && mode == 2 ? 224 : 256);
        const float seen = r == 0 && w == 0 ? 0.0f : slot[1 - w][127 - me];
        slot[w][me] = (float)(1000 * w + 10 * r + 1 + me);
        pk_bar_arrive(2 - w, 256);
        if (w == 0 && mode == 1) slot[0][me] = -1.0f;  // a store after the arrival: nothing orders it
        out[r * 256 + w * 128 + me] = seen;
    }
}

// The 16-byte bank model: lane l copies 16 bytes into shared chunk sel[l] (pk_cp_async_16_zfill_at) and, after
// the barrier, reads chunk sel[l] back (pk_ld_shared_v4) into out[4 l .. 4 l + 3]. 32 chunks of 16 bytes.
extern "C" __global__ void pk_t_v4_bank(const float* src, const int* sel, float* out) {
    __shared__ __align__(128) float sm[32 * 4];
    const int lane = threadIdx.x;
    pk_cp_async_16_zfill_at(sm, (unsigned int)(sel[lane] * 16), src + 4 * lane, true);
    pk_cp_async_commit();
    pk_cp_async_wait_all();
    __syncthreads();
    const float4 v = pk_ld_shared_v4(sm + 4 * sel[lane]);
    out[4 * lane] = v.x, out[4 * lane + 1] = v.y, out[4 * lane + 2] = v.z, out[4 * lane + 3] = v.w;
}

// Thread-block clusters (pk_cluster_*, pk_mapa_shared, ld/st.shared::cluster): each CTA fills slot[] with
// rank * 1000 + tid, then reads its right neighbour's slot (rank + 1 mod n) through DSMEM into out, and stores
// its rank into the left neighbour's inbox[] (st.shared::cluster), read back after the next barrier.
// regs[block]: %cluster_ctarank, %cluster_nctarank, %clusterid.x, %clusterid.y.
// mode 1: no barrier.cluster between the fill and the peer's read (a DSMEM race); mode 2: rank 1 returns before
// its first arrival (its cluster deadlocks); mode 3: the fill is stored after the arrive (a race with the peer's
// read after its wait).
extern "C" __global__ void pk_t_cluster(float* out, float* inbox_out, unsigned* regs, int mode) {
#if defined(PYKERN_HOST) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
    __shared__ float slot[256];
    __shared__ float inbox[8];
    const unsigned rank = pk_cluster_ctarank(), n = pk_cluster_nctarank();
    const unsigned long long blk = blockIdx.x + (unsigned long long)gridDim.x * blockIdx.y;
    if (threadIdx.x == 0) {
        const uint3 cid = pk_clusterid();
        regs[4 * blk] = rank;
        regs[4 * blk + 1] = n;
        regs[4 * blk + 2] = cid.x;
        regs[4 * blk + 3] = cid.y;
    }
    if (mode == 2 && rank == 1) return;
    if (mode != 3) slot[threadIdx.x] = (float)(rank * 1000u + threadIdx.x);
    if (mode != 1) pk_cluster_arrive();
    if (mode == 3) slot[threadIdx.x] = (float)(rank * 1000u + threadIdx.x);
    if (mode != 1) pk_cluster_wait();
    const unsigned right = (rank + 1u) % n, left = (rank + n - 1u) % n;
    out[blk * blockDim.x + threadIdx.x] = pk_ld_shared_cluster_f32(pk_mapa_shared(&slot[threadIdx.x], right));
    if (threadIdx.x == 0) pk_st_shared_cluster_f32(pk_mapa_shared(&inbox[0], left), (float)rank);
    pk_cluster_sync();  // the inbox stores land before it is read, and no CTA leaves while a peer reads its slot
    if (threadIdx.x == 0) inbox_out[blk] = inbox[0];
#else
    __trap();  // clusters need sm_90
#endif
}

// Semaphore-ordered float sums (the attention backward's deterministic dQ): block b of `chains` chains adds its
// values into chain c = b % chains in the order of k = b / chains: thread 0 waits until sem[c] == k (or k + skew,
// which nothing ever releases: a deadlock), a barrier, every thread adds its value with pk_red_add_f32, a
// barrier, thread 0 releases. Floats with very different exponents make the sum's bits depend on the order.
extern "C" __global__ void pk_t_sem_chain(const float* x, float* acc, int* sem, int chains, int skew) {
    const int c = blockIdx.x % chains, k = blockIdx.x / chains;
    if (threadIdx.x == 0) pk_sem_wait_eq(sem + c, k + skew);
    __syncthreads();
    pk_red_add_f32(acc + c * blockDim.x + threadIdx.x, x[blockIdx.x * blockDim.x + threadIdx.x]);
    __syncthreads();
    if (threadIdx.x == 0) pk_sem_add_release(sem + c, 1);
}

// red.add without ordering: acc[i % n] += x[i] for every thread.
extern "C" __global__ void pk_t_red_add(const float* x, float* acc, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    pk_red_add_f32(acc + i % n, x[i]);
}
