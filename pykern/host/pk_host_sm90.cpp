// pykern host backend: the Hopper (sm_90a) async proxy, emulated. Included by pk_host_runtime.cpp
// inside its anonymous namespace (it uses the fiber runtime's Thread / Block / reschedule).
//
// - mbarrier: arrival count, transaction bytes and a phase counter per barrier (a side table keyed
//   by its shared-memory address, reset at each block start). A phase completes when its pending
//   arrivals and transaction bytes both reach zero; waiters of that parity are woken. A wait
//   (try_wait too: the CPU never times out) parks the thread until then; one that can never end is
//   a deadlock error naming the barrier, its pending arrivals and bytes.
// - TMA loads are queued on their mbarrier and land (box written with the swizzle applied, bytes
//   completed on the barrier) when a thread waits on that barrier (or at issue, when a thread is
//   already parked on it): the latest a GPU may land them, so a read before the wait sees the old
//   bytes. One never waited for is an error at block end.
// - TMA stores and bulk reduce-adds read shared memory and write (add into) global memory at the bulk
//   wait that covers them (or the thread's exit): a shared source reused before
//   pk_tma_store_wait_read shows in the output.
//   Racecheck counts the box's bytes as read by the thread that starts the store, when it starts, so
//   their writers must be ordered before that (a barrier), and their next writers after it.
// - wgmma: a warpgroup (128 threads) meeting point. Descriptors, A registers and C are captured
//   there; the product is computed from shared memory at the first wgmma wait that covers it, and
//   each thread's accumulators get their values at its own covering wait (NaN until then). An
//   mma_async without pk_wgmma_fence() since the thread's start or last wait, or a thread that
//   exits with wgmma results it never waited for, is an error.
// Layouts and encodings: kernels_cu/pk_ptx.cuh (Hopper section), cross-checked against CuTe.

constexpr int kSm90Park = PARK;
constexpr int kWgmmaBf16 = 0;  // PK_WGMMA_BF16 of pk_ptx.cuh
constexpr int kWgmmaE4m3 = 2;  // PK_WGMMA_E4M3: m64nNk32, 1-byte elements, K-major only
enum { PARK_WGMMA = 1, PARK_MBAR = 2 };

struct WgPending {
    unsigned op, group;
    float* d;
};
struct BulkStore {
    pkrt_tmap map;
    unsigned src;  // shared window address
    int c[5];
    unsigned group;
    float* red;      // a bulk reduce-add (pk_bulk_reduce_add_f32): its global destination, else nullptr
    unsigned bytes;  // and its length
};
struct Sm90Thread {
    bool fenced;
    unsigned wg_group;
    std::vector<WgPending> wg;
    unsigned bulk_group;
    std::vector<BulkStore> stores;
    int park;  // PARK_* while parked
    pkrt_wgmma_op* op;
    unsigned long long* bar;
    unsigned parity;
    const char* file;
    int line;
};
// Racecheck: the first thread of a warp of the issuing warpgroup to pass a wait that retires a wgmma, with its
// ordering stamps (as a shadow word's access): writes ordered after it by a barrier may reuse the operands' bytes.
struct WgRetire {
    bool valid;
    unsigned tid, epoch, wepoch, nbseq, carr;
};
struct WgOp {
    WgRetire ret[4];
    int n, dt, ta, tb, scale_d;
    bool rs, done;
    unsigned long long da, db;
    unsigned first;  // linear index of the warpgroup's thread 0
    std::vector<float> c, result;  // [128][n/2]
    std::vector<int> c_from;       // [128]: the op whose result is this thread's C, or -1
    std::vector<unsigned> a;       // [128][4] (RS)
    const char* file;
    int line;
};
struct MBar {
    unsigned expected, pending;
    long long tx;
    unsigned long long phase;
    const char* file;
    int line;
    // Racecheck's ordering through the mbarrier (an arrive releases, a wait that sees the phase complete
    // acquires): arr[x] is the block's nb_seq stamped by warp x's last arrive in the current phase, done[x] the
    // same for the last completed phase. A thread of warp y that gets past a completed phase has every access
    // warp x made before its arrive ordered before its own (nb_pair[y][x] >= done[x]).
    unsigned arr[kMaxThreads / 32], done[kMaxThreads / 32];
};
struct TmaLoad {
    unsigned long long* bar;
    unsigned dst;  // shared window address
    pkrt_tmap map;
    int c[5];
    unsigned long long bytes;
    const char* file;
    int line;
    unsigned thread;
};
struct Sm90Block {
    unsigned wg_arrived[kMaxThreads / 128];
    std::vector<WgOp> ops;
    std::vector<std::pair<uintptr_t, MBar>> bars;
    std::vector<TmaLoad> loads;
};
Sm90Thread g_sm90_threads[kMaxSlots * kMaxThreads];
Sm90Block g_sm90_blocks[kMaxSlots];

inline Sm90Thread& st_of(const Thread* t) { return g_sm90_threads[t - g_threads]; }
inline Sm90Block& sb_of(const Block* k) { return g_sm90_blocks[k - g_blocks]; }

[[noreturn]] void sm90_fail(const Thread* t, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
[[noreturn]] void sm90_fail(const Thread* t, const char* fmt, ...) {
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    fail_lane(t, what);
}

// ---- the shared window: dynamic at [0, shared_mem), static from the next 1024-byte boundary ----
inline unsigned long long static_window_base() { return (g.shared_mem + 1023) & ~1023ull; }

bool window_of(const Block* k, const void* p, unsigned* out) {
    uintptr_t a = reinterpret_cast<uintptr_t>(p);
    uintptr_t d = reinterpret_cast<uintptr_t>(k->dyn_smem), s = reinterpret_cast<uintptr_t>(k->static_smem);
    if (k->dyn_smem && a - d < g.shared_mem) {
        *out = static_cast<unsigned>(a - d);
        return true;
    }
    if (a - s < kStaticSmemMax) {
        *out = static_cast<unsigned>(static_window_base() + (a - s));
        return true;
    }
    return false;
}

// Host pointer of `bytes` bytes at window address `w`, or nullptr when not inside one region.
unsigned char* window_ptr(const Block* k, unsigned long long w, unsigned long long bytes) {
    if (w + bytes <= g.shared_mem) return k->dyn_smem + w;
    unsigned long long sb = static_window_base();
    if (w >= sb && w - sb + bytes <= g_static_used) return k->static_smem + (w - sb);
    return nullptr;
}

// The wrappers' shared accesses (ldmatrix rows, cp.async destinations, 16-byte shared loads) in every build: an
// address outside the block's static + dynamic shared memory is reported before the access lands (the generic
// loads and stores of the kernel code: the checked build's hooks, rc_access_range).
void smem_bounds_check(const Thread* t, const void* p, unsigned bytes, bool write, const char* what, const char* file,
                       int line) {
    unsigned w = 0;
    if (window_of(t->blk, p, &w) && window_ptr(t->blk, w, bytes)) return;
    Buf b{g.err, sizeof g.err};
    describe_where(b, t);
    b.add(": out-of-bounds %u-byte shared-memory %s by %s at %s:%d: address %p is not inside the block's shared "
          "memory (dynamic: %llu bytes", bytes, write ? "write" : "read", what, file, line, p, g.shared_mem);
    if (t->blk->dyn_smem)
        b.add(", the access at byte offset %lld relative to its start",
              static_cast<long long>(reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(t->blk->dyn_smem)));
    b.add("; static __shared__: %zu bytes)", g_static_used);
    fail_from_fiber();
}

inline unsigned long long swz(unsigned long long addr, unsigned units) {
    return units ? addr ^ (((addr >> 7) & (units - 1)) << 4) : addr;
}

MBar* find_bar(Block* k, unsigned long long* bar) {
    for (auto& e : sb_of(k).bars)
        if (e.first == reinterpret_cast<uintptr_t>(bar)) return &e.second;
    return nullptr;
}

MBar* need_bar(Thread* t, unsigned long long* bar, const char* what, const char* file, int line) {
    MBar* m = find_bar(t->blk, bar);
    if (!m) {
        unsigned w = 0;
        if (!window_of(t->blk, bar, &w))
            sm90_fail(t, "%s at %s:%d: mbarrier address %p is not in the block's shared memory", what, file, line,
                      static_cast<void*>(bar));
        sm90_fail(t, "%s at %s:%d: the mbarrier at shared byte %u was not initialized (pk_mbarrier_init) or was "
                  "invalidated", what, file, line, w);
    }
    return m;
}

// A thread of warp y got past m's last completed phase: the arrivals of that phase are ordered before it.
void bar_acquire(Block* k, unsigned y, const MBar* m) {
    for (unsigned x = 0; x < kMaxThreads / 32; x++)
        if (k->nb_pair[y][x] < m->done[x]) k->nb_pair[y][x] = m->done[x];
}

// Phase completed: wake the threads parked on it for the parity that just completed.
void bar_complete(Block* k, unsigned long long* bar, MBar* m) {
    unsigned done = static_cast<unsigned>(m->phase & 1);
    m->phase++;
    m->pending = m->expected;
    m->tx = 0;
    std::memcpy(m->done, m->arr, sizeof m->arr);
    std::memset(m->arr, 0, sizeof m->arr);
    for (unsigned i = 0; i < g.n; i++) {
        Thread& o = k->threads[i];
        Sm90Thread& s = st_of(&o);
        if (o.state == kSm90Park && s.park == PARK_MBAR && s.bar == bar && s.parity == done) {
            bar_acquire(k, o.warp, m);
            s.park = 0;
            o.state = RUN;
            set_runnable(&o);
        }
    }
}

void bar_check(Block* k, unsigned long long* bar, MBar* m) {
    if (m->pending == 0 && m->tx == 0) bar_complete(k, bar, m);
}

unsigned long long tmap_bytes(const pkrt_tmap& m) {
    unsigned long long n = m.elem_bytes;
    for (int d = 0; d < m.rank; d++) n *= m.box[d];
    return n;
}

// Every element of the box: global element address (or null when out of bounds) and its shared offset.
template <typename F> void for_box(const pkrt_tmap& m, const int* c, F f) {
    unsigned b[5] = {1, 1, 1, 1, 1};
    for (int d = 0; d < m.rank; d++) b[d] = m.box[d];
    unsigned long long lin = 0;
    for (unsigned i4 = 0; i4 < b[4]; i4++)
        for (unsigned i3 = 0; i3 < b[3]; i3++)
            for (unsigned i2 = 0; i2 < b[2]; i2++)
                for (unsigned i1 = 0; i1 < b[1]; i1++)
                    for (unsigned i0 = 0; i0 < b[0]; i0++, lin += m.elem_bytes) {
                        unsigned idx[5] = {i0, i1, i2, i3, i4};
                        bool in = true;
                        unsigned long long addr = m.base;
                        for (int d = 0; d < m.rank; d++) {
                            long long x = static_cast<long long>(c[d]) + idx[d];
                            if (x < 0 || static_cast<unsigned long long>(x) >= m.dims[d]) in = false;
                            else addr += static_cast<unsigned long long>(x) * (d ? m.strides[d] : m.elem_bytes);
                        }
                        f(in ? reinterpret_cast<unsigned char*>(addr) : nullptr, lin);
                    }
}

#ifdef PK_RACECHECK
// ---- racecheck through the async proxy ------------------------------------------------------------------
// TMA loads write shared memory and wgmma reads its SS operands there outside the threads' program order. A TMA
// load's box is recorded, per shadow word, as written by the pseudo-thread kAsyncTid: pending from its issue
// until it lands (any access then is reported), afterwards ordered before a thread's access only through the
// mbarrier phase it completed (land_loads_of stamps it as warp kAsyncWarp's arrival) or a __syncthreads(). A
// wgmma's operand bytes are recorded per 16-byte unit of the block's shared window and per warpgroup (the last
// wgmma of that warpgroup reading it); a generic write there is reported unless the writer passed a wgmma wait
// that retired it or a barrier orders such a wait (WgRetire) before the write.
inline bool rc_async_on() { return (g_rc & RC_REPORT) && g.n <= kAsyncTid; }

std::vector<unsigned> g_wg_rd[kMaxSlots];  // [unit][warpgroup]: the last wgmma (id + 1) reading the unit
inline unsigned rc_nwg() { return (g.n + 127) / 128; }
inline unsigned long long rc_window_bytes() { return static_window_base() + kStaticSmemMax; }

Shadow* rc_word(unsigned char* p, Region** out = nullptr) {
    Region* r = rc_find(reinterpret_cast<uintptr_t>(p));
    if (!r || r->kind == REG_GLOBAL) return nullptr;
    if (out) *out = r;
    return &r->sh[(reinterpret_cast<uintptr_t>(p) - r->lo) >> 2];
}

// The source lines of the launch's TMA loads: a shadow word written by kAsyncTid keeps its load's index + 1 in
// w_pc (the wrappers pass the kernel's file and line; a return address would name the wrapper's line).
std::vector<std::pair<const char*, int>> g_tma_sites;
uintptr_t rc_tma_site(const char* file, int line) {
    for (size_t i = 0; i < g_tma_sites.size(); i++)
        if (g_tma_sites[i].first == file && g_tma_sites[i].second == line) return i + 1;
    g_tma_sites.emplace_back(file, line);
    return g_tma_sites.size();
}
void rc_tma_where(Buf& b, uintptr_t site) {
    if (site && site <= g_tma_sites.size()) b.add("%s:%d", g_tma_sites[site - 1].first, g_tma_sites[site - 1].second);
    else b.add("an unknown line");
}

const char* rc_region_name(const Region* r) { return r->kind == REG_STATIC ? "static __shared__" : "dynamic"; }

[[noreturn]] void rc_report_tma(const Region* r, uintptr_t word, const Shadow& s, bool write, uintptr_t pc,
                                const Thread* t) {
    Buf b{g.err, sizeof g.err};
    describe_where(b, t);
    b.add(": racecheck: %s race through the async proxy on %s shared memory at byte offset %lu: ",
          write ? "write-after-write" : "read-after-write", rc_region_name(r), static_cast<unsigned long>(word - r->lo));
    b.add("the TMA load issued at ");
    rc_tma_where(b, s.w_pc);
    if (s.tma) b.add(" has not landed (no wait on its mbarrier has completed it)");
    else b.add(" landed, but this thread's warp did not get past the mbarrier phase it completed (nor a __syncthreads() since)");
    b.add(" when this thread %s it at ", write ? "writes" : "reads");
    rc_pc(b, pc);
    b.add(" (wait on the load's mbarrier, pk_mbarrier_wait_parity, before touching its bytes)");
    fail_from_fiber();
}

// Is thread t's access ordered after wgmma `id`'s reads: t passed a wait retiring it, or a barrier orders such a
// wait (by any warp of the issuing warpgroup) before it?
bool rc_wg_retired_for(Block* k, unsigned id, const Thread* t) {
    const WgOp& op = sb_of(k).ops[id];
    if (t->linear / 128 == op.first / 128) {
        bool pending = false;
        for (const WgPending& p : st_of(t).wg) pending |= p.op == id;
        if (!pending) return true;
    }
    for (const WgRetire& r : op.ret)
        if (r.valid && rc_ordered(static_cast<unsigned>(k->linear) + 1, r.tid, r.epoch, r.wepoch, r.nbseq, r.carr, t, k))
            return true;
    return false;
}

[[noreturn]] void rc_report_wgmma_war(Block* k, const Thread* t, unsigned id, unsigned long long win, uintptr_t pc,
                                      const char* what) {
    const WgOp& op = sb_of(k).ops[id];
    Buf b{g.err, sizeof g.err};
    describe_where(b, t);
    b.add(": racecheck: write-after-read race through the async proxy on shared memory at window byte %llu "
          "(%s): the wgmma at %s:%d (warpgroup %u) reads it as an SS operand until a pk_wgmma_wait retires it; "
          "this thread %s at ", win, win < g.shared_mem ? "dynamic" : "static __shared__", op.file, op.line,
          op.first / 128, what);
    rc_pc(b, pc);
    b.add(" with no pk_wgmma_wait of its own retiring that wgmma, nor a barrier after such a wait");
    fail_from_fiber();
}

void rc_wgmma_write_check(Block* k, Thread* t, unsigned long long win, unsigned size, uintptr_t pc) {
    const std::vector<unsigned>& tab = g_wg_rd[k - g_blocks];
    const unsigned nwg = rc_nwg();
    for (unsigned long long u = win >> 4; u <= (win + size - 1) >> 4; u++) {
        if ((u + 1) * nwg > tab.size()) return;
        for (unsigned w = 0; w < nwg; w++)
            if (unsigned id1 = tab[u * nwg + w])
                if (!rc_wg_retired_for(k, id1 - 1, t)) rc_report_wgmma_war(k, t, id1 - 1, u * 16, pc, "writes it");
    }
}

// A TMA load into the window bytes [w, w + bytes) is issued by thread t: it writes them (the async proxy), so
// generic accesses and wgmma reads of them must be ordered before this call; from now until it lands they are
// pending.
void rc_tma_issue(Thread* t, unsigned w, unsigned long long bytes, uintptr_t pc, const char* file, int line) {
    if (!rc_async_on()) return;
    Block* k = t->blk;
    unsigned char* p = window_ptr(k, w, bytes);
    if (!p) return;
    for (unsigned long long o = 0; o < bytes; o += 4) {
        Region* r = nullptr;
        Shadow* sh = rc_word(p + o, &r);
        if (!sh || sh->w_tid != kAsyncTid || !sh->w_blk) continue;
        if (sh->tma) {
            Buf b{g.err, sizeof g.err};
            describe_where(b, t);
            b.add(": racecheck: write-after-write race through the async proxy on %s shared memory at byte offset "
                  "%lu: the TMA load issued at %s:%d writes bytes the TMA load issued at ", rc_region_name(r),
                  static_cast<unsigned long>(reinterpret_cast<uintptr_t>(p + o) - r->lo), file, line);
            rc_tma_where(b, sh->w_pc);
            b.add(" has not landed yet (no wait on its mbarrier completed it)");
            fail_from_fiber();
        }
        sh->w_blk = 0;  // a landed load's bytes are ordered through the readers that waited for it (below)
    }
    // The generic readers and writers of the bytes before this issue (and wgmma reads still in flight): ordered
    // before it as for a write by this thread.
    if (g_rc & RC_REPORT) rc_access_range(reinterpret_cast<uintptr_t>(p), static_cast<unsigned>(bytes), true, pc);
    const unsigned me = static_cast<unsigned>(k->linear) + 1;
    const uintptr_t site = rc_tma_site(file, line);
    for (unsigned long long o = 0; o < bytes; o += 4) {
        Shadow* sh = rc_word(p + o);
        if (!sh) continue;
        sh->tma = 1;
        sh->w_blk = me;
        sh->w_tid = kAsyncTid;
        sh->w_mask = 0xf;
        sh->w_pc = site;
        sh->w_carr = ~0u;
        sh->r_blk = 0;
    }
}

// Bytes a TMA load wrote have landed: written (initcheck), by the pseudo-thread kAsyncTid, stamped now (the
// caller then stamps the mbarrier with the arrival of warp kAsyncWarp).
void rc_async_written(Block* k, unsigned w, unsigned long long bytes) {
    if (!g_rc) return;
    unsigned char* p = window_ptr(k, w, bytes);
    if (!p) return;
    const bool track = rc_async_on();
    for (unsigned long long o = 0; o < bytes; o += 4) {
        Shadow* sh = rc_word(p + o);
        if (!sh) continue;
        sh->init = 0xf;
        sh->tma = 0;
        sh->r_blk = 0;
        if (!track) { sh->w_blk = 0; continue; }
        sh->w_blk = static_cast<unsigned>(k->linear) + 1;
        sh->w_tid = kAsyncTid;
        sh->w_mask = 0xf;
        sh->w_epoch = k->bar_epoch;
        sh->w_wepoch = 0;
        sh->w_nbseq = k->nb_seq;
        sh->w_carr = ~0u;
    }
}

// wgmma `id` (warpgroup wg) is issued: its SS operand bytes are read from now until a wait retires it. Every
// byte must be written before: a TMA load's landed and observed by a warp of the warpgroup (it got past the load's
// mbarrier phase), a generic write by the warpgroup itself or ordered by a barrier before one of its warps
// (after pk_fence_proxy_async_shared, which the CPU cannot see).
void rc_wgmma_issue(Block* k, unsigned wg, unsigned id);
#endif

void land_load(Block* k, const TmaLoad& L) {
    for_box(L.map, L.c, [&](unsigned char* src, unsigned long long off) {
        unsigned char* dst = window_ptr(k, swz(L.dst + off, L.map.swizzle), L.map.elem_bytes);
        if (src) std::memcpy(dst, src, L.map.elem_bytes);
        else if (L.map.oob_nan && L.map.elem_bytes == 4) { unsigned v = 0x7fffffffu; std::memcpy(dst, &v, 4); }
        else if (L.map.oob_nan && L.map.elem_bytes == 2) { unsigned short v = 0x7fff; std::memcpy(dst, &v, 2); }
        else std::memset(dst, 0, L.map.elem_bytes);
    });
#ifdef PK_RACECHECK
    // The async proxy wrote these bytes: no thread is their writer (the mbarrier orders them).
    rc_async_written(k, L.dst, tmap_bytes(L.map));
#endif
}

// Land every queued load of `bar` (in issue order) and complete their bytes on it.
void land_loads_of(Block* k, unsigned long long* bar) {
    Sm90Block& sb = sb_of(k);
    std::vector<TmaLoad> keep;
    std::vector<TmaLoad> now;
    for (auto& L : sb.loads) (L.bar == bar ? now : keep).push_back(L);
    sb.loads.swap(keep);
    for (auto& L : now) {
        land_load(k, L);
        MBar* m = find_bar(k, bar);
        if (!m) continue;
#ifdef PK_RACECHECK
        // The landed bytes (stamped below this) are ordered before the warps that get past this phase.
        if (rc_async_on()) m->arr[kAsyncWarp] = ++k->nb_seq;
#endif
        m->tx -= static_cast<long long>(L.bytes);
        bar_check(k, bar, m);
    }
}

void perform_store(Block* k, const BulkStore& S) {
    if (S.red) {  // the bulk reduce-add: element-wise fp32 adds of the shared run into global memory
        const unsigned char* src = window_ptr(k, S.src, S.bytes);
        for (unsigned o = 0; o < S.bytes; o += 4) {
            float v;
            std::memcpy(&v, src + o, 4);
            S.red[o / 4] += v;
        }
        return;
    }
    for_box(S.map, S.c, [&](unsigned char* dst, unsigned long long off) {
        if (!dst) return;  // out-of-bounds elements are not written
        const unsigned char* src = window_ptr(k, swz(S.src + off, S.map.swizzle), S.map.elem_bytes);
        std::memcpy(dst, src, S.map.elem_bytes);
    });
}

void stores_perform(Thread* t, bool all, unsigned below) {
    Sm90Thread& s = st_of(t);
    size_t keep = 0;
    for (size_t i = 0; i < s.stores.size(); i++) {
        if (all || s.stores[i].group < below) perform_store(t->blk, s.stores[i]);
        else s.stores[keep++] = s.stores[i];
    }
    s.stores.resize(keep);
}

const pkrt_tmap& check_map(Thread* t, const CUtensorMap* map, int rank, const char* what, const char* file, int line) {
    const pkrt_tmap* m = reinterpret_cast<const pkrt_tmap*>(map);
    if (m->magic != PKRT_TMAP_MAGIC)
        sm90_fail(t, "%s at %s:%d: the CUtensorMap was not made for the host backend "
                  "(pykern.tensormap.make_tensor_map(..., backend='host'))", what, file, line);
    if (m->rank != rank)
        sm90_fail(t, "%s at %s:%d: a %dD copy with a tensor map of rank %d", what, file, line, rank, m->rank);
    return *m;
}

unsigned check_smem(Thread* t, const void* p, unsigned long long bytes, unsigned align, const char* what,
                    const char* file, int line) {
    unsigned w = 0;
    if (!window_of(t->blk, p, &w) || !window_ptr(t->blk, w, bytes))
        sm90_fail(t, "%s at %s:%d: %llu bytes at %p are not inside the block's shared memory", what, file, line, bytes, p);
    if (w % align)
        sm90_fail(t, "%s at %s:%d: the shared-memory address (byte %u) is not %u-byte aligned", what, file, line, w,
                  align);
    return w;
}

// ---- wgmma --------------------------------------------------------------------------------------
// Shared window byte address of element (mn, k) of a 16-bit operand (PTX ISA canonical layouts,
// as CuTe's make_gmma_desc reads them); es = 1: an 8-bit (e4m3) one, K-major (16 k-elements a 16-byte unit).
unsigned long long desc_addr(unsigned long long desc, unsigned mn, unsigned k, bool mn_major, unsigned es = 2) {
    unsigned long long start = (desc & 0x3fffull) << 4, lbo = ((desc >> 16) & 0x3fffull) << 4,
                       sbo = ((desc >> 32) & 0x3fffull) << 4;
    unsigned layout = static_cast<unsigned>(desc >> 62);
    unsigned W = layout == 1 ? 8 : layout == 2 ? 4 : layout == 3 ? 2 : 1;  // 16-byte units
    unsigned long long off;
    if (!mn_major) {
        const unsigned per = 16 / es;  // k-elements a 16-byte unit
        unsigned m0 = mn % 8, m1 = mn / 8, kc = k / per, e = k % per;
        off = layout == 0 ? m0 * 16ull + m1 * sbo + kc * lbo + e * es : m0 * W * 16ull + m1 * sbo + kc * 16ull + e * es;
    } else {
        unsigned c = mn / 8, e = mn % 8, k0 = k % 8, k1 = k / 8;
        off = layout == 0 ? c * sbo + k0 * 16ull + k1 * lbo + e * 2
                          : (c % W) * 16ull + (c / W) * lbo + k0 * W * 16ull + k1 * sbo + e * 2;
    }
    return swz(start + off, layout ? W : 0);
}

void wg_compute(Block* k, unsigned id);

double operand(Block* k, const WgOp& op, unsigned long long desc, unsigned mn, unsigned kk, bool mn_major) {
    const bool f8 = op.dt == kWgmmaE4m3;
    unsigned long long w = desc_addr(desc, mn, kk, mn_major, f8 ? 1u : 2u);
    const unsigned char* p = window_ptr(k, w, f8 ? 1 : 2);
    if (!p) {
        Buf b{g.err, sizeof g.err};
        b.add("kernel %s: block (%u,%u,%u): wgmma at %s:%d: its descriptor 0x%016llx addresses shared byte %llu "
              "(element %u, k %u), outside the block's shared memory", g.kernel, k->idx.x, k->idx.y, k->idx.z,
              op.file, op.line, desc, w, mn, kk);
        fail_from_fiber();
    }
    if (f8) return e4m3_value(*p);
    unsigned short h;
    std::memcpy(&h, p, 2);
    return op.dt == kWgmmaBf16 ? bf16_value(h) : f16_value(h);
}

void wg_compute(Block* k, unsigned id) {
    WgOp& op = sb_of(k).ops[id];
    if (op.done) return;
    for (unsigned i = 0; i < 128; i++)
        if (op.c_from[i] >= 0) wg_compute(k, static_cast<unsigned>(op.c_from[i]));
    const unsigned n = static_cast<unsigned>(op.n), h = n / 2;
    for (unsigned long long d : {op.da, op.db})
        if (((d >> 49) & 7) != 0 && !(op.rs && d == op.da)) {
            Buf b{g.err, sizeof g.err};
            b.add("kernel %s: wgmma at %s:%d: descriptor base offset %llu is not emulated (keep swizzled tiles "
                  "aligned to their pattern: 1024/512/256 bytes)", g.kernel, op.file, op.line, (d >> 49) & 7);
            fail_from_fiber();
        }
    // KD: the k extent (k16 for 16-bit types, k32 for e4m3, whose operands are K-major: checked at issue).
    const unsigned KD = op.dt == kWgmmaE4m3 ? 32 : 16;
    std::vector<double> A(64 * KD), B(static_cast<size_t>(n) * KD);
    if (op.rs && KD == 32) {
        // e4m3 A from registers (pk_ptx.cuh's table): a[r] byte e is row 16q + g + 8 (r & 1), column 4t + e +
        // 16 (r >> 1), mma.m16n8k32's A fragment per warp.
        for (unsigned i = 0; i < 128; i++) {
            unsigned q = i / 32, lane = i % 32, gq = lane >> 2, tq = lane & 3;
            for (unsigned r = 0; r < 4; r++)
                for (unsigned e = 0; e < 4; e++)
                    A[(16 * q + gq + 8 * (r & 1)) * 32 + 4 * tq + e + 16 * (r >> 1)] =
                        e4m3_value(static_cast<unsigned char>(op.a[i * 4 + r] >> (8 * e)));
        }
    } else if (op.rs) {
        for (unsigned i = 0; i < 128; i++) {
            unsigned q = i / 32, lane = i % 32, gq = lane >> 2, tq = lane & 3;
            for (unsigned v = 0; v < 8; v++) {
                unsigned bits = op.a[i * 4 + v / 2] >> (16 * (v & 1));
                A[(16 * q + gq + 8 * ((v >> 1) & 1)) * 16 + 2 * tq + (v & 1) + 8 * (v >> 2)] =
                    op.dt == kWgmmaBf16 ? bf16_value(bits) : f16_value(bits);
            }
        }
    } else {
        for (unsigned m = 0; m < 64; m++)
            for (unsigned kk = 0; kk < KD; kk++) A[m * KD + kk] = operand(k, op, op.da, m, kk, op.ta != 0);
    }
    for (unsigned nn = 0; nn < n; nn++)
        for (unsigned kk = 0; kk < KD; kk++) B[nn * KD + kk] = operand(k, op, op.db, nn, kk, op.tb != 0);
    op.result.assign(static_cast<size_t>(128) * h, 0.0f);
    for (unsigned i = 0; i < 128; i++) {
        unsigned q = i / 32, lane = i % 32, gq = lane >> 2, tq = lane & 3;
        const float* c = op.c_from[i] >= 0 ? &sb_of(k).ops[static_cast<size_t>(op.c_from[i])].result[i * h] : &op.c[i * h];
        for (unsigned r = 0; r < h; r++) {
            unsigned j = r / 4, v = r % 4;
            unsigned m = 16 * q + gq + 8 * (v >> 1), nn = 8 * j + 2 * tq + (v & 1);
            // Exact products in double, one rounding to fp32 (the tensor core's order is unspecified).
            double s = op.scale_d ? c[r] : 0.0;
            for (unsigned kk = 0; kk < KD; kk++) s += A[m * KD + kk] * B[nn * KD + kk];
            op.result[i * h + r] = static_cast<float>(s);
        }
    }
    op.done = true;
}

#ifdef PK_RACECHECK
void rc_wgmma_issue(Block* k, unsigned wg, unsigned id) {
    if (!rc_async_on()) return;
    const unsigned s = static_cast<unsigned>(k - g_blocks), nwg = rc_nwg();
    std::vector<unsigned>& tab = g_wg_rd[s];
    if (!g_wg_used[s]) {
        tab.assign((rc_window_bytes() / 16) * nwg, 0u);
        g_wg_used[s] = true;
    }
    const WgOp& op = sb_of(k).ops[id];
    const bool f8 = op.dt == kWgmmaE4m3;
    const unsigned KD = f8 ? 32 : 16;
    std::vector<unsigned long long> units;
    auto mark = [&](unsigned long long desc, unsigned rows, bool mn_major) {
        for (unsigned mn = 0; mn < rows; mn++)
            for (unsigned kk = 0; kk < KD; kk++) {
                unsigned long long u = desc_addr(desc, mn, kk, mn_major, f8 ? 1u : 2u) >> 4;
                if ((u + 1) * nwg > tab.size()) continue;  // outside: wg_compute reports it at the wait
                unsigned& e = tab[u * nwg + wg];
                if (e == id + 1) continue;
                e = id + 1;
                units.push_back(u);
            }
    };
    if (!op.rs) mark(op.da, 64, op.ta != 0);
    mark(op.db, static_cast<unsigned>(op.n), op.tb != 0);
    // The op starts once all four warps of the warpgroup issued it (their A registers, RS, and accumulators go in
    // together): a write by a thread of the warpgroup precedes its own issue, so it is ordered before the reads; a
    // write by another thread (or a TMA load) must be ordered before at least one of the four warps issued it.
    const unsigned me = static_cast<unsigned>(k->linear) + 1;
    for (unsigned long long u : units) {
        unsigned char* p = window_ptr(k, u * 16, 16);
        if (!p) continue;
        for (unsigned o = 0; o < 16; o += 4) {
            Region* r = nullptr;
            Shadow* sh = rc_word(p + o, &r);
            if (!sh || !sh->w_blk || !(g_rc & RC_REPORT)) continue;
            const bool tma = sh->w_tid == kAsyncTid;
            if (!tma && sh->w_blk == me && sh->w_tid / 128 == wg) continue;  // the issuing warpgroup's own write
            bool ordered = false;
            for (unsigned w = 0; w < 4 && !ordered && !(tma && sh->tma); w++)
                ordered = rc_ordered(sh->w_blk, sh->w_tid, sh->w_epoch, sh->w_wepoch, sh->w_nbseq, sh->w_carr,
                                     &k->threads[wg * 128 + w * 32], k);
            if (ordered) continue;
            Buf b{g.err, sizeof g.err};
            b.add("kernel %s: block (%u,%u,%u): racecheck: read-after-write race through the async proxy on %s "
                  "shared memory at byte offset %lu: the wgmma at %s:%d (warpgroup %u) reads it as an SS operand, but ",
                  g.kernel, k->idx.x, k->idx.y, k->idx.z, rc_region_name(r),
                  static_cast<unsigned long>(reinterpret_cast<uintptr_t>(p + o) - r->lo), op.file, op.line, wg);
            if (tma) {
                b.add("the TMA load issued at ");
                rc_tma_where(b, sh->w_pc);
                b.add(sh->tma ? " that writes it has not landed (no wait on its mbarrier completed it)"
                              : " that wrote it is observed by none of the warpgroup's warps (none got past the "
                                "mbarrier phase the load completed, nor a __syncthreads() since)");
            } else {
                rc_describe_thread(b, sh->w_blk, sh->w_tid);
                b.add(" wrote it at ");
                rc_pc(b, sh->w_pc);
                b.add(" with no barrier ordering that write before any of the warpgroup's warps issued the wgmma (a "
                      "generic write read by wgmma needs pk_fence_proxy_async_shared() and then a barrier of the "
                      "writer and the issuing warps)");
            }
            fail_from_fiber();
        }
    }
}
#endif

void wg_complete(Block* k, unsigned wg) {
    Sm90Block& sb = sb_of(k);
    Thread* ts = &k->threads[wg * 128];
    const pkrt_wgmma_op* p0 = st_of(&ts[0]).op;
    for (unsigned i = 1; i < 128; i++) {
        const pkrt_wgmma_op* p = st_of(&ts[i]).op;
        if (p->n != p0->n || p->dt != p0->dt || p->ta != p0->ta || p->tb != p0->tb || (p->a == nullptr) != (p0->a == nullptr) ||
            p->desc_b != p0->desc_b || (!p0->a && p->desc_a != p0->desc_a) || (p->scale_d != 0) != (p0->scale_d != 0) ||
            st_of(&ts[i]).line != st_of(&ts[0]).line)
            sm90_fail(&ts[i], "wgmma at %s:%d: the warpgroup's threads disagree (shape, type, descriptors or scale-d "
                      "differ from thread %u's at %s:%d): one wgmma.mma_async is issued by all 128 threads alike",
                      st_of(&ts[i]).file, st_of(&ts[i]).line, ts[0].linear, st_of(&ts[0]).file, st_of(&ts[0]).line);
    }
    WgOp op;
    std::memset(op.ret, 0, sizeof op.ret);
    op.n = p0->n, op.dt = p0->dt, op.ta = p0->ta, op.tb = p0->tb, op.scale_d = p0->scale_d != 0;
    op.rs = p0->a != nullptr, op.done = false, op.da = p0->desc_a, op.db = p0->desc_b, op.first = wg * 128;
    op.file = st_of(&ts[0]).file, op.line = st_of(&ts[0]).line;
    unsigned h = static_cast<unsigned>(op.n) / 2;
    op.c.assign(static_cast<size_t>(128) * h, 0.0f);
    op.c_from.assign(128, -1);
    if (op.rs) op.a.assign(128 * 4, 0);
    unsigned id = static_cast<unsigned>(sb.ops.size());
    for (unsigned i = 0; i < 128; i++) {
        Sm90Thread& s = st_of(&ts[i]);
        const pkrt_wgmma_op* p = s.op;
        for (auto it = s.wg.rbegin(); it != s.wg.rend(); ++it)
            if (it->d == p->d) {
                op.c_from[i] = static_cast<int>(it->op);  // chained on the same accumulators
                break;
            }
        if (op.c_from[i] < 0) std::memcpy(&op.c[i * h], p->d, h * sizeof(float));
        if (op.rs) std::memcpy(&op.a[i * 4], p->a, 4 * sizeof(unsigned));
    }
    sb.ops.push_back(std::move(op));
#ifdef PK_RACECHECK
    rc_wgmma_issue(k, wg, id);
#endif
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (unsigned i = 0; i < 128; i++) {
        Sm90Thread& s = st_of(&ts[i]);
        s.wg.push_back(WgPending{id, s.wg_group, s.op->d});
        for (unsigned r = 0; r < h; r++) s.op->d[r] = nan;  // undefined until the wgmma wait
        s.park = 0;
        s.op = nullptr;
        ts[i].state = RUN;
        set_runnable(&ts[i]);
    }
    sb.wg_arrived[wg] = 0;
}

}  // namespace

// ---- entry points (pk_ptx.cuh's host part) --------------------------------------------------------
extern "C" unsigned pkrt_smem_window(const void* p, const char* file, int line) {
    unsigned w = 0;
    if (!window_of(cur()->blk, p, &w))
        sm90_fail(cur(), "pk_wgmma_desc at %s:%d: %p is not in the block's shared memory", file, line, p);
    return w;
}

extern "C" void pkrt_wgmma_fence(void) { st_of(cur()).fenced = true; }

extern "C" void pkrt_wgmma_commit(const char*, int) { st_of(cur()).wg_group++; }

extern "C" void pkrt_wgmma_wait(int n, const char*, int) {
    Thread* t = cur();
    Sm90Thread& s = st_of(t);
    unsigned below = s.wg_group > static_cast<unsigned>(n) ? s.wg_group - static_cast<unsigned>(n) : 0;
    size_t keep = 0;
    for (size_t i = 0; i < s.wg.size(); i++) {
        WgPending p = s.wg[i];
        if (p.group < below) {
#ifdef PK_RACECHECK
            // The first thread of its warp to retire this wgmma: a barrier after here orders its reads before others.
            WgRetire& r = sb_of(t->blk).ops[p.op].ret[t->warp % 4];
            if (!r.valid)
                r = WgRetire{true, t->linear, t->blk->bar_epoch, t->blk->warps[t->warp].sync_epoch, t->blk->nb_seq,
                             t->cl_arr};
#endif
            wg_compute(t->blk, p.op);
            const WgOp& op = sb_of(t->blk).ops[p.op];
            unsigned h = static_cast<unsigned>(op.n) / 2;
            std::memcpy(p.d, &op.result[(t->linear - op.first) * h], h * sizeof(float));
        } else {
            s.wg[keep++] = p;
        }
    }
    s.wg.resize(keep);
    s.fenced = false;  // the accumulators may be touched now: the next mma_async needs a fence
}

extern "C" void pkrt_wgmma_issue(pkrt_wgmma_op* op, const char* file, int line) {
    Thread* t = cur();
    Block* k = t->blk;
    Sm90Thread& s = st_of(t);
    unsigned wg = t->linear / 128;
    if ((wg + 1) * 128 > g.n)
        sm90_fail(t, "wgmma at %s:%d needs a whole warpgroup (128 threads; the block has %u)", file, line, g.n);
    if (!s.fenced)
        sm90_fail(t, "wgmma.mma_async at %s:%d without pk_wgmma_fence() since the thread's start or its last "
                  "pk_wgmma_wait: the accumulators (and A registers) must be fenced before the async proxy reads them",
                  file, line);
    s.op = op;
    s.file = file;
    s.line = line;
    s.park = PARK_WGMMA;
    t->state = kSm90Park;
    t->file = file;
    t->line = line;
    clear_runnable(t);
    Sm90Block& sb = sb_of(k);
    if (++sb.wg_arrived[wg] == 128) wg_complete(k, wg);
    reschedule(false);
}

extern "C" void pkrt_mbar_init(unsigned long long* bar, unsigned count, const char* file, int line) {
    Thread* t = cur();
    check_smem(t, bar, 8, 8, "pk_mbarrier_init", file, line);
    if (count < 1 || count > (1u << 20) - 1)
        sm90_fail(t, "pk_mbarrier_init at %s:%d: expected an arrival count of 1..%u, got %u", file, line,
                  (1u << 20) - 1, count);
    MBar m{count, count, 0, 0, file, line};
    if (MBar* old = find_bar(t->blk, bar)) *old = m;
    else sb_of(t->blk).bars.emplace_back(reinterpret_cast<uintptr_t>(bar), m);
    *bar = 0;  // the word is the barrier's: keep it initialized for initcheck-like readers
}

extern "C" void pkrt_mbar_inval(unsigned long long* bar, const char* file, int line) {
    Thread* t = cur();
    need_bar(t, bar, "pk_mbarrier_inval", file, line);
    auto& v = sb_of(t->blk).bars;
    for (size_t i = 0; i < v.size(); i++)
        if (v[i].first == reinterpret_cast<uintptr_t>(bar)) {
            v.erase(v.begin() + static_cast<long>(i));
            break;
        }
}

extern "C" unsigned long long pkrt_mbar_arrive(unsigned long long* bar, unsigned tx, int arrive, const char* file,
                                               int line) {
    Thread* t = cur();
    MBar* m = need_bar(t, bar, arrive ? "pk_mbarrier_arrive" : "pk_mbarrier_expect_tx", file, line);
    unsigned long long token = m->phase;
    m->tx += tx;
    if (arrive) {
        if (m->pending == 0)
            sm90_fail(t, "pk_mbarrier_arrive at %s:%d: more arrivals than the %u the mbarrier (initialized at %s:%d) "
                      "expects in this phase", file, line, m->expected, m->file, m->line);
        m->pending--;
        m->arr[t->warp] = ++t->blk->nb_seq;  // this warp's accesses so far are stamped below it
        bar_check(t->blk, bar, m);
    }
    PKRT_YIELD();
    return token;
}

extern "C" int pkrt_mbar_wait(unsigned long long* bar, unsigned parity, int, const char* file, int line) {
    Thread* t = cur();
    Block* k = t->blk;
    MBar* m = need_bar(t, bar, "pk_mbarrier_wait_parity", file, line);
    parity &= 1;
    if ((m->phase & 1) != parity) return bar_acquire(k, t->warp, m), 1;
    land_loads_of(k, bar);  // the async copies it waits for land now, completing their bytes
    m = find_bar(k, bar);
    if (!m) return 1;
    if ((m->phase & 1) != parity) return bar_acquire(k, t->warp, m), 1;  // completed while its copies landed

    Sm90Thread& s = st_of(t);
    s.park = PARK_MBAR;
    s.bar = bar;
    s.parity = parity;
    s.file = file;
    s.line = line;
    t->state = kSm90Park;
    t->file = file;
    t->line = line;
    clear_runnable(t);
    reschedule(false);
    return 1;
}

extern "C" void pkrt_tma_load(void* dst, const CUtensorMap* map, unsigned long long* bar, int rank, const int* c,
                              const char* file, int line) {
    Thread* t = cur();
    const pkrt_tmap& m = check_map(t, map, rank, "pk_tma_load", file, line);
    unsigned w = check_smem(t, dst, tmap_bytes(m), m.swizzle ? 16u * m.swizzle * 8u : 128u, "pk_tma_load", file, line);
    need_bar(t, bar, "pk_tma_load", file, line);
#ifdef PK_RACECHECK
    rc_tma_issue(t, w, tmap_bytes(m), reinterpret_cast<uintptr_t>(__builtin_return_address(0)), file, line);
#endif
    TmaLoad L{bar, w, m, {0, 0, 0, 0, 0}, tmap_bytes(m), file, line, t->linear};
    for (int d = 0; d < rank; d++) L.c[d] = c[d];
    sb_of(t->blk).loads.push_back(L);
    // A thread already parked on this mbarrier waited before the copy was issued (a consumer that runs
    // ahead of its producer): no later wait would land it, so it lands now, as the GPU's copy would.
    Block* k = t->blk;
    for (unsigned i = 0; i < g.n; i++) {
        const Thread& o = k->threads[i];
        const Sm90Thread& s = st_of(&o);
        if (o.state == kSm90Park && s.park == PARK_MBAR && s.bar == bar) {
            land_loads_of(k, bar);
            break;
        }
    }
}

extern "C" void pkrt_tma_store(const CUtensorMap* map, const void* src, int rank, const int* c, const char* file,
                               int line) {
    Thread* t = cur();
    const pkrt_tmap& m = check_map(t, map, rank, "pk_tma_store", file, line);
    unsigned w = check_smem(t, src, tmap_bytes(m), m.swizzle ? 16u * m.swizzle * 8u : 128u, "pk_tma_store", file, line);
    Sm90Thread& s = st_of(t);
    BulkStore S{m, w, {0, 0, 0, 0, 0}, s.bulk_group, nullptr, 0};
    for (int d = 0; d < rank; d++) S.c[d] = c[d];
    s.stores.push_back(S);
#ifdef PK_RACECHECK
    // The async proxy reads the box's bytes for this thread from here on: a write by another thread that no
    // barrier orders before this call (rows a warp wrote without the warpgroup's barrier between) is a
    // read-after-write race, and one after it that nothing orders after this thread's bulk wait a
    // write-after-read race.
    if (unsigned char* p = window_ptr(t->blk, w, tmap_bytes(m)))
        rc_access_range(reinterpret_cast<uintptr_t>(p), static_cast<unsigned>(tmap_bytes(m)), false,
                        reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
#endif
}

// cp.reduce.async.bulk .add.f32, a member of the thread's open bulk group as a TMA store: performed (the shared
// run read, its floats added into global memory) at the bulk wait that covers it or the thread's exit, so a source
// rewritten before pk_tma_store_wait_read shows in the sums; racecheck counts the run as read by this thread when
// it starts, as for a TMA store.
extern "C" void pkrt_bulk_reduce_add_f32(float* dst, const void* src, unsigned bytes, const char* file, int line) {
    Thread* t = cur();
    if (bytes == 0 || bytes % 16)
        sm90_fail(t, "pk_bulk_reduce_add_f32 at %s:%d: the size (%u bytes) must be a positive multiple of 16", file,
                  line, bytes);
    if (reinterpret_cast<uintptr_t>(dst) % 16)
        sm90_fail(t, "pk_bulk_reduce_add_f32 at %s:%d: the global address %p is not 16-byte aligned", file, line,
                  static_cast<void*>(dst));
    unsigned w = check_smem(t, src, bytes, 16u, "pk_bulk_reduce_add_f32", file, line);
    Sm90Thread& s = st_of(t);
    BulkStore S{};
    S.src = w;
    S.group = s.bulk_group;
    S.red = dst;
    S.bytes = bytes;
    s.stores.push_back(S);
#ifdef PK_RACECHECK
    if (unsigned char* p = window_ptr(t->blk, w, bytes))
        rc_access_range(reinterpret_cast<uintptr_t>(p), bytes, false,
                        reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
#endif
}

extern "C" void pkrt_tma_store_commit(void) { st_of(cur()).bulk_group++; }

extern "C" void pkrt_tma_store_wait(int n) {
    Thread* t = cur();
    Sm90Thread& s = st_of(t);
    unsigned below = s.bulk_group > static_cast<unsigned>(n) ? s.bulk_group - static_cast<unsigned>(n) : 0;
    stores_perform(t, false, below);
}

// ---- thread-block clusters: special registers, DSMEM (mapa + ld/st.shared::cluster), barrier.cluster ----------
// A cluster's CTAs are resident together (pk_host_runtime.cpp's run_clusters: one slot per rank). A shared::cluster
// address is (rank << 24) | the rank's shared-memory window address (pkrt_smem_window's numbering), so adding a byte
// offset to a mapped address stays inside that CTA's window, as on the GPU.
extern "C" unsigned pkrt_cluster_reg(int which) {
    const Block* k = cur()->blk;
    switch (which) {
        case PKRT_CL_CTARANK: return k->cl_rank;
        case PKRT_CL_NCTARANK: return g.cl_n;
        case PKRT_CL_ID_X: return k->idx.x / g.cl[0];
        case PKRT_CL_ID_Y: return k->idx.y / g.cl[1];
        default: return k->idx.z / g.cl[2];
    }
}

extern "C" unsigned pkrt_mapa(const void* p, unsigned rank, const char* file, int line) {
    unsigned w = 0;
    if (!window_of(cur()->blk, p, &w))
        sm90_fail(cur(), "pk_mapa_shared at %s:%d: %p is not in the block's shared memory", file, line, p);
    if (rank >= g.cl_n)
        sm90_fail(cur(), "pk_mapa_shared at %s:%d: cluster rank %u, but the cluster has %u CTAs (%%cluster_nctarank)",
                  file, line, rank, g.cl_n);
    return (rank << 24) | w;
}

extern "C" void pkrt_dsmem(unsigned addr, void* val, int bytes, int write, const char* file, int line, void* pc) {
    Thread* t = cur();
    const unsigned rank = addr >> 24, w = addr & 0xffffffu;
    const char* what = write ? "st.shared::cluster" : "ld.shared::cluster";
    if (rank >= g.cl_n)
        sm90_fail(t, "%s at %s:%d: address 0x%08x names cluster rank %u, but the cluster has %u CTAs (an address not "
                  "made by pk_mapa_shared?)", what, file, line, addr, rank, g.cl_n);
    if (w % static_cast<unsigned>(bytes))
        sm90_fail(t, "%s at %s:%d: misaligned %d-byte access at shared::cluster address 0x%08x", what, file, line,
                  bytes, addr);
    Block* peer = nullptr;
    for (unsigned s = 0; s < g.slots; s++)
        if (g_blocks[s].cl_rank == rank) peer = &g_blocks[s];
    if (peer->n_done == g.n)
        sm90_fail(t, "%s at %s:%d: cluster rank %u (block (%u,%u,%u)) has exited: its shared memory is gone (keep it "
                  "alive with a barrier.cluster arrive / wait before it exits)", what, file, line, rank, peer->idx.x,
                  peer->idx.y, peer->idx.z);
    unsigned char* p = window_ptr(peer, w, static_cast<unsigned long long>(bytes));
    if (!p)
        sm90_fail(t, "%s at %s:%d: shared::cluster address 0x%08x (rank %u, byte %u) is outside that CTA's shared "
                  "memory", what, file, line, addr, rank, w);
#ifdef PK_RACECHECK
    g_rc_remote = 1;
    // pc: the wrapper's call site in the kernel (the wrappers are inlined), resolved to its .cu line
    rc_access_range(reinterpret_cast<uintptr_t>(p), static_cast<unsigned>(bytes), write != 0,
                    reinterpret_cast<uintptr_t>(pc ? pc : __builtin_return_address(0)));
    g_rc_remote = 0;
#else
    (void)pc;
#endif
    if (write) std::memcpy(p, val, static_cast<size_t>(bytes));
    else std::memcpy(val, p, static_cast<size_t>(bytes));
}

// barrier.cluster: every thread of every CTA of the cluster arrives once per phase, then waits (arrive and wait
// alternate per thread, as the PTX ISA requires). An exited thread never arrives: a CTA that leaves early leaves
// its cluster in the deadlock error, which names the barrier and each CTA's missing arrivals.
extern "C" void pkrt_cluster_arrive(const char* file, int line) {
    Thread* t = cur();
    if (t->cl_arr > t->cl_wait)
        sm90_fail(t, "barrier.cluster.arrive at %s:%d: arrives a second time with no barrier.cluster.wait since its "
                  "last arrival", file, line);
    t->cl_arr++;
    if (g.cl_count == 0) {
        g.cl_file = file;
        g.cl_line = line;
    }
    if (++g.cl_count < g.n * g.cl_n) return;
    g.cl_phase++;  // the phase completes: wake every CTA's waiters
    g.cl_count = 0;
    g.cl_file = nullptr;
    for (unsigned s = 0; s < g.slots; s++) {
        Block* k = &g_blocks[s];
        for (unsigned i = 0; i < g.n; i++)
            if (k->threads[i].state == CBAR) {
                k->threads[i].state = RUN;
                set_runnable(&k->threads[i]);
            }
    }
}

extern "C" void pkrt_cluster_wait(const char* file, int line) {
    Thread* t = cur();
    if (t->cl_arr == t->cl_wait)
        sm90_fail(t, "barrier.cluster.wait at %s:%d: no barrier.cluster.arrive of this thread precedes it", file,
                  line);
    if (g.cl_phase < t->cl_arr) {  // its phase is still open: park until the last arrival
        t->state = CBAR;
        t->file = file;
        t->line = line;
        clear_runnable(t);
        try_activemask(t->blk, t->warp);
        reschedule(false);
    }
    t->cl_wait++;
}

namespace {

// ---- hooks called by the fiber runtime ------------------------------------------------------------
void sm90_describe_park(Buf& b, const Thread* t) {
    const Sm90Thread& s = st_of(t);
    if (s.park == PARK_WGMMA) {
        b.add("waits in a wgmma at %s:%d for the rest of its warpgroup (threads %u..%u)", s.file, s.line,
              t->linear / 128 * 128, t->linear / 128 * 128 + 127);
    } else if (s.park == PARK_MBAR) {
        const MBar* m = find_bar(t->blk, s.bar);
        unsigned w = 0;
        window_of(t->blk, s.bar, &w);
        if (m)
            b.add("waits at %s:%d on the mbarrier at shared byte %u (parity %u) whose phase never completes: %u of "
                  "%u arrivals and %lld transaction bytes missing", s.file, s.line, w, s.parity, m->pending, m->expected,
                  m->tx);
        else
            b.add("waits at %s:%d on the invalidated mbarrier at shared byte %u", s.file, s.line, w);
    } else {
        b.add("is parked");
    }
}

void sm90_block_start(Block* k) {
    Sm90Block& sb = sb_of(k);
    std::memset(sb.wg_arrived, 0, sizeof sb.wg_arrived);
    sb.ops.clear();
    sb.bars.clear();
    sb.loads.clear();
#ifdef PK_RACECHECK
    g_wg_used[k - g_blocks] = false;  // the block's wgmma table is cleared at its first wgmma
#endif
    for (unsigned i = 0; i < g.n; i++) {
        Sm90Thread& s = st_of(&k->threads[i]);
        s.fenced = false;
        s.wg_group = s.bulk_group = 0;
        s.wg.clear();
        s.stores.clear();
        s.park = 0;
        s.op = nullptr;
    }
}

void sm90_thread_exit(Thread* t) {
    Sm90Thread& s = st_of(t);
    if (!s.wg.empty()) {
        const WgOp& op = sb_of(t->blk).ops[s.wg.front().op];
        sm90_fail(t, "exits with the results of the wgmma at %s:%d never waited for (pk_wgmma_commit, then "
                  "pk_wgmma_wait<N>): its accumulators are undefined on a GPU", op.file, op.line);
    }
    stores_perform(t, true, 0);  // a GPU completes bulk stores even if nobody waits
}

void sm90_block_end(Block* k) {
    Sm90Block& sb = sb_of(k);
    if (!sb.loads.empty()) {
        const TmaLoad& L = sb.loads.front();
        Thread* t = &k->threads[L.thread];
        Buf b{g.err, sizeof g.err};
        describe_where(b, t);
        b.add(": the TMA load it issued at %s:%d was never waited for (no pk_mbarrier_wait_parity on its "
              "mbarrier): its data is not ordered before any read", L.file, L.line);
        fail_from_fiber();
    }
}
