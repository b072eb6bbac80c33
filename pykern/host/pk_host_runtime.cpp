// pykern host backend runtime: runs one kernel launch block after block, each
// block's threads as fibers on the calling OS thread.
//
// Scheduling: every thread has a position in the block's order (forward,
// reverse, or a seeded random permutation redrawn at every __syncthreads). The
// runnable thread with the lowest position always runs next, so with `forward`
// warp 0 races as far ahead as the meeting points allow and with `reverse` the
// last warp does: a missing barrier reads different data under the two.
//
// A meeting point parks the calling fiber; the thread that completes a
// collective computes every participant's result at once (so no participant
// can see a later collective's data) and marks them runnable.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>
#include <csetjmp>
#include <csignal>
#include <pthread.h>
#include <dlfcn.h>
#include <ucontext.h>  // PK_SIGNALS_UCTX: the faulting stack pointer
#include <sys/mman.h>
#include <unistd.h>

#include "pk_cuda_host.h"

#if defined(__SANITIZE_ADDRESS__)
#define PK_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PK_ASAN 1
#endif
#endif
#ifdef PK_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(PK_FIBER_UCONTEXT) || !defined(__ELF__) || !(defined(__x86_64__) || defined(__aarch64__))
#define PK_USE_UCONTEXT 1
#include <ucontext.h>
#endif

namespace {

enum State : int { RUN = 0, BAR = 1, WARP = 2, DONE = 3, PARK = 4, NBAR = 5, CBAR = 6, SEM = 7 };  // PARK: pk_host_sm90.cpp (wgmma, mbarrier)
// SEM: waiting for a global int to reach a value (pkrt_sem_wait; Thread::sem_p / sem_v)
// NBAR: parked at a named barrier (pkrt_named_barrier; Thread::arg is its id, Thread::width its thread count)
// CBAR: parked in barrier.cluster.wait (pkrt_cluster_wait) until every thread of the cluster arrived
enum { PKRT_ACTIVEMASK = 64 };  // a warp meeting point of its own (not a collective)

// One pending cp.async of a thread: performed by the wait that covers its group.
struct CpAsync {
    void* dst;
    const void* src;
    int bytes;
    unsigned group;
};

struct Block;

struct Thread {
    uint3 tid;  // must stay first: threadIdx reads it through pkrt_cur
    unsigned linear, lane, warp;
    int state;
    int op;  // barrier kind or warp op
    const char* file;
    int line;
    unsigned mask;
    int width, arg, pred;
    unsigned long long value, result;
    void* sp;
    char* stack_lo;
    size_t stack_size;
    Block* blk;
    std::vector<CpAsync> cp;  // cp.async copies not yet performed
    unsigned cp_group;        // index of the group the next cp.async joins (= groups committed)
    unsigned cl_arr, cl_wait;  // barrier.cluster arrivals made / waits passed (racecheck's cluster ordering)
    const int* sem_p;         // SEM: the semaphore and the value waited for
    int sem_v;
#ifdef PK_USE_UCONTEXT
    ucontext_t uc;
#endif
};

struct Warp {
    unsigned existing;    // lanes that exist in this block (a partial last warp has fewer)
    unsigned waiting;     // lanes parked in some warp-level collective
    unsigned exited;      // lanes that returned from the kernel
    unsigned am_waiting;  // lanes parked in __activemask()
    unsigned sync_epoch;  // completed __syncwarp()s: racecheck's intra-warp ordering
};

constexpr int kMaxThreads = 1024;
constexpr int kMaxSlots = 8;                      // blocks resident at once (interleaved schedule)
constexpr size_t kStaticSmemMax = 48u << 10;     // static __shared__ per block, as on every GPU
constexpr int kMaxStaticVars = 512;
#ifndef PK_ASAN
// Each slot's dynamic shared memory lies in a mapping of its own between two PROT_NONE guards of this size, its
// 1024-byte rounded end flush against the upper one: a plain load or store up to this far past that end, or below
// the start's page, faults before it touches other memory and is reported (on_fault); the checked build's hooks
// report any access outside the bytes, slack included, before it is made. (The sanitizer build keeps an
// exactly-sized heap allocation: ASan poisons its tail.)
constexpr size_t kDynPad = 1u << 20;
#else
constexpr size_t kDynPad = 0;
#endif

// One resident block: its threads, scheduling order, barrier state and shared memory.
struct Block {
    uint3 idx;
    unsigned long long linear;
    unsigned cl_rank;  // %cluster_ctarank (0 without a cluster)
    bool active, finished;
    unsigned n_done, n_bar;
    int bar_kind;
    const char* bar_file;
    int bar_line;
    Thread* bar_mismatch;  // a thread parked at another __syncthreads than bar_file:bar_line
    unsigned bar_pred_count;
    unsigned bar_epoch;  // released __syncthreads()s: racecheck's intra-block ordering
    // Named barriers 1..15 (bar.sync / barrier.red with a thread count): the phase being filled of each.
    struct Named {
        unsigned count, arrived, pred_count;  // count 0: no phase open
        int kind;
        const char* file;
        int line;
        // bar.arrive (PKRT_BAR_ARRIVE) in this phase: the warps that arrived without waiting (bit per warp) and
        // the nb_seq each arrival opened (that warp's accesses stamped below it come before the arrival).
        unsigned arr_warps;
        const char* arr_file[kMaxThreads / 32];
        int arr_line[kMaxThreads / 32];
        unsigned arr_seq[kMaxThreads / 32];
    } named[16];
    // Racecheck's ordering by named barriers, between participants only: nb_seq counts released named-barrier
    // phases of the block; nb_pair[y][x] is the nb_seq of the last released phase in which warps y and x both
    // took part with every lane (0: none). An access stamped with nb_seq s by a thread of warp x is ordered
    // before any later access by a thread of warp y once nb_pair[y][x] > s.
    unsigned nb_seq;
    unsigned nb_pair[kMaxThreads / 32][kMaxThreads / 32];
    unsigned long long rng;
    Thread* threads;
    unsigned char* dyn_smem;
    unsigned char* static_smem;
    unsigned order[kMaxThreads];
    unsigned pos_of[kMaxThreads];
    uint64_t runnable[kMaxThreads / 64];
    Warp warps[kMaxThreads / 32];
};

struct Launch {
    const char* kernel;
    void (*body)(void*);
    void* args;
    int schedule;
    unsigned slots;  // resident blocks: 1 = one block after another (more while blocks wait on semaphores)
    bool seq;        // one block after another: a block runs until it exits or waits on a semaphore
    unsigned sem_waiting;  // threads in state SEM
    unsigned long long seed;
    unsigned n;  // threads per block
    unsigned long long n_blocks;
    unsigned long long shared_mem, smem_limit;
    // Thread-block cluster: dims, CTAs per cluster (1: none) and the barrier.cluster phase being filled
    // (completed phases, arrivals so far, the first arrival's line).
    unsigned cl[3], cl_n;
    unsigned long long cl_phase;
    unsigned cl_count;
    const char* cl_file;
    int cl_line;
    bool failed;
    char err[2048];
};

std::mutex g_mutex;  // one launch at a time per library: the state below is global
Launch g;
Block g_blocks[kMaxSlots];
#ifndef PK_ASAN
unsigned char* g_dyn_map[kMaxSlots];  // the slot's guarded mapping (kept between launches of the same size)
size_t g_dyn_map_len[kMaxSlots];
#endif
Thread g_threads[kMaxSlots * kMaxThreads];
Block* gb = nullptr;  // the block of the running fiber
size_t g_stack_size = 0;
void* g_main_sp = nullptr;
size_t g_static_used = 0;  // static __shared__ bytes laid out so far in this launch
struct StaticVar {
    size_t off;
    bool set;
};
StaticVar g_static_vars[kMaxStaticVars];
unsigned long long g_progress = 0;  // bumped at every switch: the watchdog's heartbeat
#ifdef PK_USE_UCONTEXT
ucontext_t g_main_uc;
#endif
#ifdef PK_ASAN
bool g_switch_from_main = false;
const void* g_main_stack_bottom = nullptr;
size_t g_main_stack_size = 0;
#endif

}  // namespace

extern "C" {
pkrt_thread* pkrt_cur = nullptr;
uint3 pkrt_block_idx = {0, 0, 0};
dim3 pkrt_block_dim;
dim3 pkrt_grid_dim;
unsigned char* pkrt_dyn_smem = nullptr;
unsigned char* pkrt_static_smem_base = nullptr;
int pkrt_interleave = 0;
}

namespace {

inline Thread* cur() { return reinterpret_cast<Thread*>(pkrt_cur); }

// ---- context switch -----------------------------------------------------------
#ifndef PK_USE_UCONTEXT
extern "C" void pkrt_ctx_switch(void** save_sp, void* new_sp);
#if defined(__x86_64__)
// Saves the callee-saved registers on the old stack, swaps stacks, restores.
asm(R"(
    .text
    .p2align 4
    .type pkrt_ctx_switch,@function
pkrt_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size pkrt_ctx_switch, .-pkrt_ctx_switch
)");
#elif defined(__aarch64__)
asm(R"(
    .text
    .p2align 4
    .type pkrt_ctx_switch,%function
pkrt_ctx_switch:
    sub sp, sp, #176
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #176
    ret
    .size pkrt_ctx_switch, .-pkrt_ctx_switch
)");
#endif
#endif

[[noreturn]] void fiber_entry();

#ifdef PK_USE_UCONTEXT
void fiber_entry_uc() { fiber_entry(); }
#endif

void init_fiber(Thread* t) {
#ifdef PK_ASAN
    // The previous fiber on this stack never returned: its frames' redzones are stale.
    ASAN_UNPOISON_MEMORY_REGION(t->stack_lo, t->stack_size);
#endif
#ifdef PK_USE_UCONTEXT
    getcontext(&t->uc);
    t->uc.uc_stack.ss_sp = t->stack_lo;
    t->uc.uc_stack.ss_size = t->stack_size;
    t->uc.uc_link = nullptr;
    makecontext(&t->uc, fiber_entry_uc, 0);
#else
    // Stagger the stack tops: equally spaced tops would all map to the same cache sets.
    uintptr_t top = reinterpret_cast<uintptr_t>(t->stack_lo) + t->stack_size - (t->linear % 61) * 64;
    top &= ~uintptr_t(15);
    void** sp = reinterpret_cast<void**>(top);
#if defined(__x86_64__)
    *--sp = nullptr;                                        // fake return address of fiber_entry
    *--sp = reinterpret_cast<void*>(&fiber_entry);          // popped by `ret`
    for (int i = 0; i < 6; i++) *--sp = nullptr;            // rbp rbx r12..r15
#else
    sp -= 22;                                               // 176-byte frame, x30 at [sp+88]
    std::memset(sp, 0, 176);
    sp[11] = reinterpret_cast<void*>(&fiber_entry);
#endif
    t->sp = sp;
#endif
}

// Switch from `from` (nullptr: the launching context) to `to` (nullptr: back to it).
inline void switch_to(Thread* from, Thread* to, bool from_finished) {
#ifdef PK_ASAN
    void* fake = nullptr;
    g_switch_from_main = from == nullptr;
    if (to) __sanitizer_start_switch_fiber(from_finished ? nullptr : &fake, to->stack_lo, to->stack_size);
    else __sanitizer_start_switch_fiber(from_finished ? nullptr : &fake, g_main_stack_bottom, g_main_stack_size);
#else
    (void)from_finished;
#endif
    g_progress++;
    pkrt_cur = reinterpret_cast<pkrt_thread*>(to);
    if (to) {
        Block* b = to->blk;
        if (b != gb) {
            gb = b;
            pkrt_block_idx = b->idx;
            pkrt_dyn_smem = b->dyn_smem;
            pkrt_static_smem_base = b->static_smem;
        }
    }
#ifdef PK_USE_UCONTEXT
    swapcontext(from ? &from->uc : &g_main_uc, to ? &to->uc : &g_main_uc);
#else
    pkrt_ctx_switch(from ? &from->sp : &g_main_sp, to ? to->sp : g_main_sp);
#endif
#ifdef PK_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

// ---- error reporting ------------------------------------------------------------
const char* op_name(int op) {
    switch (op) {
        case PKRT_SYNCWARP: return "__syncwarp";
        case PKRT_SHFL_IDX: return "__shfl_sync";
        case PKRT_SHFL_UP: return "__shfl_up_sync";
        case PKRT_SHFL_DOWN: return "__shfl_down_sync";
        case PKRT_SHFL_XOR: return "__shfl_xor_sync";
        case PKRT_BALLOT: return "__ballot_sync";
        case PKRT_ANY: return "__any_sync";
        case PKRT_ALL: return "__all_sync";
        case PKRT_MATCH_ANY: return "__match_any_sync";
        case PKRT_MATCH_ALL: return "__match_all_sync";
        case PKRT_PTX_MMA_BF16: return "pk_mma_m16n8k16_bf16";
        case PKRT_PTX_MMA_F16: return "pk_mma_m16n8k16_f16";
        case PKRT_PTX_MMA_E4M3: return "pk_mma_m16n8k32_e4m3";
        case PKRT_PTX_LDSM_X4: return "pk_ldmatrix_x4";
        case PKRT_PTX_LDSM_X4_T: return "pk_ldmatrix_x4_trans";
        case PKRT_ACTIVEMASK: return "__activemask";
        default: return "__reduce_*_sync";
    }
}
// A named barrier's PTX form (pkrt_named_barrier).
const char* nb_name(int kind) {
    switch (kind) {
        case PKRT_BAR_COUNT: return "barrier.red.popc";
        case PKRT_BAR_AND: return "barrier.red.and";
        case PKRT_BAR_OR: return "barrier.red.or";
        case PKRT_BAR_ARRIVE: return "barrier.arrive";
        default: return "barrier.sync";
    }
}
const char* bar_name(int kind) {
    switch (kind) {
        case PKRT_BAR_COUNT: return "__syncthreads_count";
        case PKRT_BAR_AND: return "__syncthreads_and";
        case PKRT_BAR_OR: return "__syncthreads_or";
        default: return "__syncthreads";
    }
}

struct Buf {
    char* p;
    size_t left;
    void add(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
        if (left <= 1) return;
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(p, left, fmt, ap);
        va_end(ap);
        if (k < 0) return;
        size_t used = std::min(static_cast<size_t>(k), left - 1);
        p += used;
        left -= used;
    }
};

// Hopper emulation hooks (pk_host_sm90.cpp, included below).
void sm90_describe_park(Buf& b, const Thread* t);
void sm90_block_start(Block* k);
void sm90_thread_exit(Thread* t);
void sm90_block_end(Block* k);
void nb_try_arrive(Block* k, unsigned w, int id);  // named barriers' barrier.arrive (below)
// pk_host_sm90.cpp: the shared-memory access of `bytes` bytes at p by the wrapper `what` (ldmatrix rows, cp.async
// destinations, 16-byte shared loads) lies inside the block's static + dynamic shared memory, else an error.
void smem_bounds_check(const Thread* t, const void* p, unsigned bytes, bool write, const char* what, const char* file,
                       int line);

void describe_where(Buf& b, const Thread* t) {
    const Block* k = t->blk;
    b.add("kernel %s: block (%u,%u,%u): thread (%u,%u,%u) [warp %u lane %u]", g.kernel, k->idx.x, k->idx.y, k->idx.z,
          t->tid.x, t->tid.y, t->tid.z, t->warp, t->lane);
}

void describe_state(Buf& b, const Thread* t) {
    switch (t->state) {
        case DONE: b.add("has exited"); break;
        case BAR: b.add("waits at %s() at %s:%d", bar_name(t->op), t->file, t->line); break;
        case WARP: b.add("waits in %s(mask 0x%08x) at %s:%d", op_name(t->op), t->mask, t->file, t->line); break;
        case PARK: sm90_describe_park(b, t); break;
        case CBAR: b.add("waits in barrier.cluster.wait at %s:%d", t->file, t->line); break;
        case NBAR:
            b.add("waits at named barrier %d (%s, %d threads) at %s:%d", t->arg, nb_name(t->op), t->width, t->file,
                  t->line);
            break;
        case SEM:
            b.add("waits for the semaphore at %p to equal %d (it holds %d) at %s:%d", static_cast<const void*>(t->sem_p),
                  t->sem_v, *t->sem_p, t->file, t->line);
            break;
        default: b.add("is runnable"); break;
    }
}

// Record the error and leave the launch: control returns to pkrt_launch.
[[noreturn]] void fail_from_fiber() {
    g.failed = true;
    switch_to(cur(), nullptr, true);
    __builtin_unreachable();
}

[[noreturn]] void fail_lane(const Thread* t, const char* what) {
    Buf b{g.err, sizeof g.err};
    describe_where(b, t);
    b.add(": %s", what);
    fail_from_fiber();
}

[[noreturn]] void fail_simple(const char* what) { fail_lane(cur(), what); }

// Nobody of block `k` can run and not everyone has exited: explain who waits for whom.
[[noreturn]] void fail_deadlock(Block* k) {
    Buf b{g.err, sizeof g.err};
    const Thread* waiter = nullptr;
    for (unsigned i = 0; i < g.n && !waiter; i++)
        if (k->threads[i].state == WARP && k->threads[i].op != PKRT_ACTIVEMASK) waiter = &k->threads[i];
    if (waiter) {
        describe_where(b, waiter);
        b.add(": %s(mask 0x%08x) at %s:%d can never complete: ", op_name(waiter->op), waiter->mask, waiter->file,
              waiter->line);
        const Warp& w = k->warps[waiter->warp];
        unsigned need = waiter->mask & w.existing & ~w.exited;
        for (unsigned l = 0; l < 32; l++) {
            if (!(need >> l & 1)) continue;
            const Thread& o = k->threads[waiter->warp * 32 + l];
            if (o.state == WARP && o.op == waiter->op && o.mask == waiter->mask) continue;
            b.add("lane %u (thread (%u,%u,%u)) named in the mask ", l, o.tid.x, o.tid.y, o.tid.z);
            describe_state(b, &o);
            break;
        }
    } else {
        b.add("kernel %s: block (%u,%u,%u): deadlock: no thread can run", g.kernel, k->idx.x, k->idx.y, k->idx.z);
        for (unsigned i = 0; i < g.n; i++)
            if (k->threads[i].state == PARK || k->threads[i].state == NBAR) {
                b.add(": thread (%u,%u,%u) ", k->threads[i].tid.x, k->threads[i].tid.y, k->threads[i].tid.z);
                describe_state(b, &k->threads[i]);
                break;
            }
    }
    if (k->n_bar) {
        b.add("; %u of %u threads wait at %s() at %s:%d", k->n_bar, g.n, bar_name(k->bar_kind), k->bar_file,
              k->bar_line);
    }
    for (int id = 1; id < 16; id++)
        if (k->named[id].count)
            b.add("; %u of %u threads arrived at named barrier %d (first at %s:%d)", k->named[id].arrived,
                  k->named[id].count, id, k->named[id].file, k->named[id].line);
    fail_from_fiber();
}

// No thread of a cluster can run: explain barrier.cluster's missing arrivals, CTA by CTA (a CTA that never
// arrives, or one whose threads wait elsewhere). Called from a fiber or, after the last runnable fiber of the
// cluster left, from the launching context (from_fiber false).
void cluster_deadlock(bool from_fiber) {
    Buf b{g.err, sizeof g.err};
    const Block* k0 = &g_blocks[0];
    b.add("kernel %s: cluster (%u,%u,%u): deadlock: no thread of the cluster can run", g.kernel, k0->idx.x / g.cl[0],
          k0->idx.y / g.cl[1], k0->idx.z / g.cl[2]);
    if (g.cl_file)
        b.add("; barrier.cluster (first arrival of this phase at %s:%d): %u of %u threads of the cluster arrived",
              g.cl_file, g.cl_line, g.cl_count, g.n * g.cl_n);
    for (unsigned s = 0; s < g.slots; s++) {
        const Block* k = &g_blocks[s];
        unsigned arrived = 0;
        const Thread* other = nullptr;
        for (unsigned i = 0; i < g.n; i++) {
            const Thread& t = k->threads[i];
            if (t.cl_arr > t.cl_wait || t.state == CBAR) arrived++;
            else if (!other) other = &t;
        }
        if (!other) continue;
        b.add("; block (%u,%u,%u) (cluster rank %u): %u of %u threads arrived, thread (%u,%u,%u) ", k->idx.x, k->idx.y,
              k->idx.z, k->cl_rank, arrived, g.n, other->tid.x, other->tid.y, other->tid.z);
        describe_state(b, other);
        if (other->state == DONE) b.add(" without arriving (an exited thread never arrives at barrier.cluster)");
    }
    if (from_fiber) fail_from_fiber();
    g.failed = true;
}

// ---- scheduling ------------------------------------------------------------------
inline void set_runnable(const Thread* t) {
    Block* k = t->blk;
    unsigned p = k->pos_of[t->linear];
    k->runnable[p >> 6] |= uint64_t(1) << (p & 63);
}
inline void clear_runnable(const Thread* t) {
    Block* k = t->blk;
    unsigned p = k->pos_of[t->linear];
    k->runnable[p >> 6] &= ~(uint64_t(1) << (p & 63));
}

inline unsigned long long next_rand(unsigned long long& state) {  // splitmix64: small, seedable
    unsigned long long z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void make_order(Block* k) {
    unsigned n = g.n;
    for (unsigned i = 0; i < n; i++) k->order[i] = (g.schedule == 1) ? n - 1 - i : i;
    if (g.schedule == 2)
        for (unsigned i = n - 1; i > 0; i--) std::swap(k->order[i], k->order[next_rand(k->rng) % (i + 1)]);
    for (unsigned i = 0; i < n; i++) k->pos_of[k->order[i]] = i;
}

inline Thread* pick_in(Block* k) {
    unsigned words = (g.n + 63) / 64;
    for (unsigned w = 0; w < words; w++)
        if (k->runnable[w])
            return &k->threads[k->order[w * 64 + static_cast<unsigned>(__builtin_ctzll(k->runnable[w]))]];
    return nullptr;
}

// Interleaved: the lowest runnable thread of the next resident block after `k` that has one.
Thread* pick_other(Block* k) {
    unsigned s = static_cast<unsigned>(k - g_blocks);
    for (unsigned j = 1; j <= g.slots; j++) {
        Block* c = &g_blocks[(s + j) % g.slots];
        if (!c->active || c->finished) continue;
        if (Thread* t = pick_in(c)) return t;
    }
    return nullptr;
}

bool block_waits_on_sem(const Block* k) {
    if (!g.sem_waiting) return false;
    for (unsigned i = 0; i < g.n; i++)
        if (k->threads[i].state == SEM) return true;
    return false;
}

// Called by a fiber that may no longer be runnable: continue another thread (possibly
// itself), or go back to the launch loop when its block is done.
void reschedule(bool finished) {
    Thread* self = cur();
    Block* k = self->blk;
    if (k->n_done == g.n) {
        k->finished = true;
        switch_to(self, nullptr, finished);
        return;
    }
    if (g.seq) {
        Thread* next = pick_in(k);
        // A block whose runnable threads all wait on semaphores goes back to the launch loop: another block
        // (resident, or started in a new slot) may release them.
        if (!next && block_waits_on_sem(k)) next = nullptr;
        else if (!next) fail_deadlock(k);
        if (next != self) switch_to(self, next, finished);
        return;
    }
    if (g.cl_n > 1) {  // a cluster's CTAs wake each other (barrier.cluster)
        Thread* next = pick_other(k);
        if (!next) next = pick_in(k);
        if (!next) {
            bool barrier_only = true;  // a block-level deadlock is reported as such
            for (unsigned i = 0; i < g.n; i++) {
                int st = k->threads[i].state;
                if (st != DONE && st != CBAR) barrier_only = false;
            }
            if (!barrier_only) fail_deadlock(k);
            cluster_deadlock(true);
        }
        if (next != self) switch_to(self, next, finished);
        return;
    }
    // only its own threads can wake a block (or a semaphore another block releases)
    if (!pick_in(k) && !block_waits_on_sem(k)) fail_deadlock(k);
    Thread* next = pick_other(k);  // interleaved: rotate through the resident blocks
    if (next != self) switch_to(self, next, finished);
}

// ---- __activemask: completes when no lane of the warp can run any more ---------------
void try_activemask(Block* k, unsigned warp) {
    Warp& w = k->warps[warp];
    if (!w.am_waiting) return;
    Thread* lanes = &k->threads[warp * 32];
    for (unsigned l = 0; l < 32; l++)
        if ((w.existing >> l & 1) && lanes[l].state == RUN) return;
    // The lanes converged at one call site: the lowest waiting lane's.
    const Thread* first = &lanes[__builtin_ctz(w.am_waiting)];
    unsigned group = 0;
    for (unsigned l = 0; l < 32; l++)
        if ((w.am_waiting >> l & 1) && lanes[l].line == first->line && std::strcmp(lanes[l].file, first->file) == 0)
            group |= 1u << l;
    for (unsigned l = 0; l < 32; l++) {
        if (!(group >> l & 1)) continue;
        lanes[l].result = group;
        lanes[l].state = RUN;
        set_runnable(&lanes[l]);
    }
    w.am_waiting &= ~group;
}

// ---- barriers --------------------------------------------------------------------
void release_barrier(Block* k) {
    if (k->bar_mismatch) {
        Buf b{g.err, sizeof g.err};
        const Thread* t = k->bar_mismatch;
        b.add("kernel %s: block (%u,%u,%u): %s() at %s:%d reached by only part of the block: thread (%u,%u,%u) ",
              g.kernel, k->idx.x, k->idx.y, k->idx.z, bar_name(k->bar_kind), k->bar_file, k->bar_line, t->tid.x,
              t->tid.y, t->tid.z);
        describe_state(b, t);
        b.add(" instead");
        fail_from_fiber();
    }
    int result;
    switch (k->bar_kind) {
        case PKRT_BAR_COUNT: result = static_cast<int>(k->bar_pred_count); break;
        case PKRT_BAR_AND: result = k->bar_pred_count == k->n_bar; break;
        case PKRT_BAR_OR: result = k->bar_pred_count != 0; break;
        default: result = 0;
    }
    if (g.schedule == 2) make_order(k);  // a fresh permutation for every phase
    for (unsigned i = 0; i < g.n; i++) {
        Thread& t = k->threads[i];
        if (t.state == BAR) {
            t.state = RUN;
            t.result = static_cast<unsigned long long>(result);
        }
    }
    // Rebuild the runnable set: positions changed with the new order.
    std::memset(k->runnable, 0, sizeof k->runnable);
    for (unsigned i = 0; i < g.n; i++)
        if (k->threads[i].state == RUN) set_runnable(&k->threads[i]);
    k->n_bar = 0;
    k->bar_pred_count = 0;
    k->bar_mismatch = nullptr;
    k->bar_file = nullptr;
    k->bar_epoch++;
}

// ---- warp collectives --------------------------------------------------------------
// Source lane of a shuffle, following PTX shfl.sync: c = ((32-width)<<8) | clamp.
int shfl_source(int op, unsigned lane, int arg, int width) {
    unsigned segmask = (32u - static_cast<unsigned>(width)) & 31u;
    unsigned b = static_cast<unsigned>(arg) & 31u;
    unsigned min_lane = lane & segmask;
    unsigned max_lane = (op == PKRT_SHFL_UP) ? min_lane : (min_lane | (31u & ~segmask));
    int j;
    bool ok;
    switch (op) {
        case PKRT_SHFL_UP:
            j = static_cast<int>(lane) - static_cast<int>(b);
            ok = j >= static_cast<int>(max_lane);
            break;
        case PKRT_SHFL_DOWN:
            j = static_cast<int>(lane + b);
            ok = j <= static_cast<int>(max_lane);
            break;
        case PKRT_SHFL_XOR:
            j = static_cast<int>(lane ^ b);
            ok = j <= static_cast<int>(max_lane);
            break;
        default:
            j = static_cast<int>(min_lane | (b & ~segmask));
            ok = j <= static_cast<int>(max_lane);
    }
    return ok ? j : static_cast<int>(lane);
}

// ---- PTX warp instructions (pk_ptx.cuh) -------------------------------------------
inline double bf16_value(unsigned bits) {
    unsigned u = (bits & 0xffffu) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// f16 bits -> value, exact (also the wgmma emulation's, pk_host_sm90.cpp).
inline double f16_value(unsigned h) {
    h &= 0xffffu;
    unsigned e = (h >> 10) & 31u, f = h & 1023u;
    double v = e == 0 ? std::ldexp(static_cast<double>(f), -24)
               : e == 31 ? (f ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity())
                         : std::ldexp(static_cast<double>(f | 1024u), static_cast<int>(e) - 25);
    return (h & 0x8000u) ? -v : v;
}

// float8_e4m3fn bits -> value, exact: no infinities, S.1111.111 is NaN, subnormals m * 2^-9.
inline double e4m3_value(unsigned b) {
    b &= 0xffu;
    const unsigned e = (b >> 3) & 15u, m = b & 7u;
    double v = (e == 15u && m == 7u) ? std::numeric_limits<double>::quiet_NaN()
               : e == 0 ? std::ldexp(static_cast<double>(m), -9)
                        : std::ldexp(static_cast<double>(m | 8u), static_cast<int>(e) - 10);
    return (b & 0x80u) ? -v : v;
}

// Bank model of ldmatrix (pkrt_bank_stats): each 8x8 matrix of an .x4 is one shared-memory phase of 8 rows
// x 16 bytes, which takes as many wavefronts as the most distinct 4-byte words one of the 32 banks (word
// address mod 32) must deliver; a word several lanes read is one broadcast. 1 a phase is conflict-free, 8 is
// every row in the same banks. Totals per library (a .cu file), kept until read with reset.
std::mutex g_bank_mu;
unsigned long long g_bank_phases = 0, g_bank_wavefronts = 0, g_bank_worst = 0;
const char* g_bank_worst_file = nullptr;
int g_bank_worst_line = 0;

void bank_count_ldsm(const Thread* lanes) {
    unsigned long long phases = 0, wavefronts = 0, worst = 0;
    const char* wfile = nullptr;
    int wline = 0;
    for (unsigned i = 0; i < 4; i++) {
        uintptr_t words[32];
        unsigned n = 0;
        for (unsigned r = 0; r < 8; r++) {
            const pkrt_ldsm_frag* f = reinterpret_cast<const pkrt_ldsm_frag*>(lanes[8 * i + r].value);
            for (unsigned w = 0; w < 4; w++) {
                const uintptr_t word = reinterpret_cast<uintptr_t>(f->row) / 4 + w;
                bool seen = false;
                for (unsigned j = 0; j < n; j++) seen = seen || words[j] == word;
                if (!seen) words[n++] = word;
            }
        }
        unsigned per_bank[32] = {0}, wf = 0;
        for (unsigned j = 0; j < n; j++) wf = std::max(wf, ++per_bank[words[j] % 32]);
        phases++;
        wavefronts += wf;
        if (wf > worst) worst = wf, wfile = lanes[8 * i].file, wline = lanes[8 * i].line;
    }
    std::lock_guard<std::mutex> lk(g_bank_mu);
    g_bank_phases += phases;
    g_bank_wavefronts += wavefronts;
    if (worst > g_bank_worst) g_bank_worst = worst, g_bank_worst_file = wfile, g_bank_worst_line = wline;
}

// Bank model of 16-byte shared-memory accesses (pkrt_v4_bank_*; off until enabled, as it costs a map entry an
// access): cp.async of 16 bytes (its shared destination) and pk_ld_shared_v4 reads. A warp's 16-byte access is
// served a quarter-warp at a time: lanes 8q .. 8q + 7 are one phase, which takes as many wavefronts as the most
// distinct 4-byte words one of the 32 banks must deliver (1: conflict-free, 2: two lanes' chunks in the same
// banks, ...). These accesses are no warp meeting point here, so each lane's k-th access at a source line is
// matched with the other lanes' k-th at that line (block, warp, line, k): the warp's instruction as a GPU issues
// it, when the lanes run that line equally often (convergent code, as the fills and merges it is meant for).
// A warp's access is counted once every lane of the warp made it, the rest when the totals are read.
struct V4Key {
    unsigned long long blk;
    unsigned warp;
    const char* file;
    int line;
    unsigned long long k;
    bool operator<(const V4Key& o) const {
        if (blk != o.blk) return blk < o.blk;
        if (warp != o.warp) return warp < o.warp;
        if (file != o.file) return file < o.file;
        if (line != o.line) return line < o.line;
        return k < o.k;
    }
};
struct V4Access {
    uintptr_t addr[32];
    unsigned mask;
};
std::mutex g_v4_mu;
int g_v4_on = 0;
std::map<V4Key, V4Access> g_v4_pending;            // warps' accesses some lanes have not made yet
std::map<std::pair<V4Key, unsigned>, unsigned long long> g_v4_count;  // (site with k = 0, lane) -> accesses so far
unsigned long long g_v4_phases = 0, g_v4_wavefronts = 0, g_v4_worst = 0;
const char* g_v4_worst_file = nullptr;
int g_v4_worst_line = 0;

void v4_count(const V4Key& key, const V4Access& a) {  // g_v4_mu held
    for (unsigned q = 0; q < 4; q++) {
        uintptr_t words[32];
        unsigned n = 0;
        for (unsigned l = 8 * q; l < 8 * q + 8; l++) {
            if (!(a.mask >> l & 1u)) continue;
            for (unsigned w = 0; w < 4; w++) {
                const uintptr_t word = a.addr[l] / 4 + w;
                bool seen = false;
                for (unsigned j = 0; j < n; j++) seen = seen || words[j] == word;
                if (!seen) words[n++] = word;
            }
        }
        if (!n) continue;
        unsigned per_bank[32] = {0}, wf = 0;
        for (unsigned j = 0; j < n; j++) wf = std::max(wf, ++per_bank[words[j] % 32]);
        g_v4_phases++;
        g_v4_wavefronts += wf;
        if (wf > g_v4_worst) g_v4_worst = wf, g_v4_worst_file = key.file, g_v4_worst_line = key.line;
    }
}

void v4_record(const void* p, const char* file, int line) {
    Thread* t = cur();
    std::lock_guard<std::mutex> lk(g_v4_mu);
    V4Key key{t->blk->linear, t->warp, file, line, 0};
    key.k = g_v4_count[{key, t->lane}]++;
    V4Access& a = g_v4_pending[key];
    a.addr[t->lane] = reinterpret_cast<uintptr_t>(p);
    a.mask |= 1u << t->lane;
    if (a.mask == t->blk->warps[t->warp].existing) {
        v4_count(key, a);
        g_v4_pending.erase(key);
    }
}

// Layouts: see the table at the top of kernels_cu/pk_ptx.cuh (PTX ISA, cross-checked with CuTe).
void complete_ptx(Thread* lanes, int op) {
    if (op == PKRT_PTX_MMA_E4M3) {
        // m16n8k32: a_i (register i >> 2, byte i & 3) at row g + 8*((i>>2)&1), col 4t + (i&3) + 16*(i>>3);
        // b_i (register i >> 2, byte i & 3) at k = 4t + (i&3) + 16*(i>>2), n = g.
        double A[16][32], B[32][8], C[16][8];
        for (unsigned l = 0; l < 32; l++) {
            const pkrt_mma_frag* f = reinterpret_cast<const pkrt_mma_frag*>(lanes[l].value);
            unsigned gq = l >> 2, tq = l & 3;
            for (unsigned i = 0; i < 16; i++)
                A[gq + 8 * ((i >> 2) & 1)][4 * tq + (i & 3) + 16 * (i >> 3)] = e4m3_value(f->a[i >> 2] >> (8 * (i & 3)));
            for (unsigned i = 0; i < 8; i++)
                B[4 * tq + (i & 3) + 16 * (i >> 2)][gq] = e4m3_value(f->b[i >> 2] >> (8 * (i & 3)));
            for (unsigned v = 0; v < 4; v++) C[gq + 8 * (v >> 1)][2 * tq + (v & 1)] = f->c[v];
        }
        // e4m3 products are exact in double, and so is their sum here (terms below 2^18, multiples of
        // 2^-18); one rounding to fp32 at the end. The GPU's fp8 tensor core keeps fewer bits of the sum
        // (Hopper's about 22, DeepGEMM's reason to promote each k-block's partial into an fp32 accumulator):
        // the emulation is the exact ideal that scheme approaches.
        for (unsigned l = 0; l < 32; l++) {
            pkrt_mma_frag* f = reinterpret_cast<pkrt_mma_frag*>(lanes[l].value);
            unsigned gq = l >> 2, tq = l & 3;
            for (unsigned v = 0; v < 4; v++) {
                unsigned m = gq + 8 * (v >> 1), n = 2 * tq + (v & 1);
                double s = C[m][n];
                for (unsigned k = 0; k < 32; k++) s += A[m][k] * B[k][n];
                f->d[v] = static_cast<float>(s);
            }
        }
        return;
    }
    if (op == PKRT_PTX_MMA_BF16 || op == PKRT_PTX_MMA_F16) {
        // .bf16 and .f16 share the fragment layout; only the widening of the 16-bit words differs
        double (*value)(unsigned) = op == PKRT_PTX_MMA_F16 ? f16_value : bf16_value;
        double A[16][16], B[16][8], C[16][8];
        for (unsigned l = 0; l < 32; l++) {
            const pkrt_mma_frag* f = reinterpret_cast<const pkrt_mma_frag*>(lanes[l].value);
            unsigned gq = l >> 2, tq = l & 3;
            for (unsigned v = 0; v < 8; v++)
                A[gq + 8 * ((v >> 1) & 1)][2 * tq + (v & 1) + 8 * (v >> 2)] = value(f->a[v >> 1] >> (16 * (v & 1)));
            for (unsigned v = 0; v < 4; v++) {
                B[2 * tq + (v & 1) + 8 * (v >> 1)][gq] = value(f->b[v >> 1] >> (16 * (v & 1)));
                C[gq + 8 * (v >> 1)][2 * tq + (v & 1)] = f->c[v];
            }
        }
        // bf16 x bf16 and f16 x f16 products are exact in double; one rounding to fp32 at the end (the
        // tensor core's internal order and precision are not specified, fp32 or better).
        for (unsigned l = 0; l < 32; l++) {
            pkrt_mma_frag* f = reinterpret_cast<pkrt_mma_frag*>(lanes[l].value);
            unsigned gq = l >> 2, tq = l & 3;
            for (unsigned v = 0; v < 4; v++) {
                unsigned m = gq + 8 * (v >> 1), n = 2 * tq + (v & 1);
                double s = C[m][n];
                for (unsigned k = 0; k < 16; k++) s += A[m][k] * B[k][n];
                f->d[v] = static_cast<float>(s);
            }
        }
        return;
    }
    // ldmatrix .x4: lane 8i+r names row r of matrix i.
    bank_count_ldsm(lanes);
    unsigned short M[4][8][8];
    for (unsigned l = 0; l < 32; l++) {
        const pkrt_ldsm_frag* f = reinterpret_cast<const pkrt_ldsm_frag*>(lanes[l].value);
        if (reinterpret_cast<uintptr_t>(f->row) & 15u) {
            char what[256];
            snprintf(what, sizeof what, "%s at %s:%d: row address %p of matrix %u row %u is not 16-byte aligned",
                     op_name(op), lanes[l].file, lanes[l].line, f->row, l >> 3, l & 7);
            fail_lane(&lanes[l], what);
        }
        smem_bounds_check(&lanes[l], f->row, 16, false, op_name(op), lanes[l].file, lanes[l].line);
        std::memcpy(M[l >> 3][l & 7], f->bytes, 16);  // what the lane read (pkrt_ldsm_row)
    }
    for (unsigned l = 0; l < 32; l++) {
        pkrt_ldsm_frag* f = reinterpret_cast<pkrt_ldsm_frag*>(lanes[l].value);
        unsigned gq = l >> 2, tq = l & 3;
        for (unsigned i = 0; i < 4; i++) {
            if (op == PKRT_PTX_LDSM_X4) f->r[i] = M[i][gq][2 * tq] | (unsigned(M[i][gq][2 * tq + 1]) << 16);
            else f->r[i] = M[i][2 * tq][gq] | (unsigned(M[i][2 * tq + 1][gq]) << 16);
        }
    }
}

// ---- guarded argument memory ------------------------------------------------------------
// The host backend (pykern/backends/host.py, _Staging) runs every array argument in a copy of its
// own, placed in the middle of a large PROT_NONE reservation with the copy's last byte flush
// against the upper guard. An access past the end, or before the start by more than the slack
// bytes of the first page, faults before it touches anything; the fault handler (below) finds
// the argument here and reports it with the byte offset. Arguments that overlap share one copy
// (their union) and one window. pkrt_guard_args is called right before each launch and
// cleared at its end.
struct GuardArg {
    uintptr_t win_lo, win_hi;  // the reservation the argument's copy lies in
    uintptr_t lo, hi;          // the argument's bytes as the kernel sees them
    char name[192];            // "argument 1 (float* out, 256 bytes)"
};
constexpr int kMaxGuardArgs = 256;
GuardArg g_guard[kMaxGuardArgs];
int g_nguard = 0;

// The argument an out-of-window address belongs to: the window's argument ending last for an
// address past the copy, the one starting first for an address before it. nullptr: none.
const GuardArg* guard_find(uintptr_t a) {
    const GuardArg* best = nullptr;
    for (int i = 0; i < g_nguard; i++) {
        const GuardArg& ga = g_guard[i];
        if (a < ga.win_lo || a >= ga.win_hi) continue;
        if (a >= ga.lo && a < ga.hi) return &ga;
        if (!best) best = &ga;
        else if (a >= ga.hi ? ga.hi > best->hi : ga.lo < best->lo) best = &ga;
    }
    return best;
}

// " of argument 1 (float* out, 256 bytes) at byte offset 260 relative to its start (past its end)"
void guard_describe(Buf& b, const GuardArg* ga, uintptr_t a) {
    long long off = static_cast<long long>(a - ga->lo);
    b.add(" of %s at byte offset %lld relative to its start%s", ga->name, off,
          a >= ga->hi ? " (past its end)" : a < ga->lo ? " (before its start)" : "");
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void pkrt_guard_args(int n, const unsigned long long* win,
                                                                     const unsigned long long* data,
                                                                     const char* const* names) {
    g_nguard = 0;
    for (int i = 0; i < n && i < kMaxGuardArgs; i++) {
        GuardArg& ga = g_guard[g_nguard++];
        ga.win_lo = win[2 * i];
        ga.win_hi = win[2 * i + 1];
        ga.lo = data[2 * i];
        ga.hi = data[2 * i] + data[2 * i + 1];
        snprintf(ga.name, sizeof ga.name, "%s", names[i]);
    }
}

namespace {

#ifdef PK_RACECHECK
// ---- racecheck / initcheck: shadow state per 4-byte word -----------------------------
// Every load and store of the kernel (ThreadSanitizer instrumentation, hooks below) that
// falls in shared memory or an argument buffer is checked against the word's last writer
// and last reader: same block, different threads, no __syncthreads (or, in one warp,
// __syncwarp) between them and one a plain write -> a race; a different block and one a
// plain write -> an inter-block race. Atomics are exempt.
enum { RC_REPORT = 1, RC_STRESS = 2, RC_INIT = 4 };
struct Shadow {
    unsigned w_blk, w_tid, w_epoch, w_wepoch;  // w_blk: block linear + 1, 0: no write yet
    unsigned r_blk, r_tid, r_epoch, r_wepoch;
    unsigned w_nbseq, r_nbseq;  // the block's nb_seq at the access (named barriers)
    unsigned w_carr, r_carr;    // the thread's barrier.cluster arrivals before the access (clusters)
    uintptr_t w_pc, r_pc;
    unsigned char w_mask, r_mask, init;  // bytes of the word: last write, last read, ever written
    unsigned char tma;                   // 1: a TMA load into the word was issued and has not landed
};
// The async proxy's TMA loads are recorded as writes by a pseudo-thread of the block's last warp (a block of at
// most kMaxThreads - 32 threads leaves it free): its write is ordered before a thread's access once that
// thread's warp got past the mbarrier phase the load completed (the load's landing stamps the barrier as that
// warp's arrival), or by a __syncthreads() after the landing.
constexpr unsigned kAsyncTid = kMaxThreads - 32;
constexpr unsigned kAsyncWarp = kAsyncTid / 32;
enum { REG_STATIC = 0, REG_DYN = 1, REG_GLOBAL = 2 };
struct Region {
    uintptr_t lo, hi;
    Shadow* sh;
    int kind, slot, arg;
    const char* name;
};
constexpr int kMaxRegions = 2 * kMaxSlots + 64;
Region g_regions[kMaxRegions];
int g_nregions = 0;
int g_rc = 0;
int g_rc_remote = 0;  // set while pkrt_dsmem checks an access to a cluster peer's shared memory
Shadow* g_static_shadow[kMaxSlots];
std::vector<Shadow> g_dyn_shadow[kMaxSlots];
struct PendingBuf {
    uintptr_t p;
    size_t n;
    const char* name;
};
std::vector<PendingBuf> g_pending_bufs;

inline Region* rc_find(uintptr_t a) {
    for (int i = 0; i < g_nregions; i++)
        if (a - g_regions[i].lo < g_regions[i].hi - g_regions[i].lo) return &g_regions[i];
    return nullptr;
}

// The cluster (as a linear index of the cluster grid) of block number `linear`.
inline unsigned long long cluster_of(unsigned long long linear) {
    unsigned long long bx = linear % pkrt_grid_dim.x, by = (linear / pkrt_grid_dim.x) % pkrt_grid_dim.y,
                       bz = linear / (1ull * pkrt_grid_dim.x * pkrt_grid_dim.y);
    unsigned long long ncx = pkrt_grid_dim.x / g.cl[0], ncy = pkrt_grid_dim.y / g.cl[1];
    return bx / g.cl[0] + ncx * (by / g.cl[1] + ncy * (bz / g.cl[2]));
}

// barrier.cluster orders an access made before the accessing thread's arrival number carr + 1 with every access
// of the cluster after a wait that phase released (the waiting thread has passed more than carr waits).
// (Without a cluster launch barrier.cluster spans the one CTA.)
inline bool rc_cluster_ordered(unsigned blk, unsigned carr, const Thread* t, const Block* k) {
    return t->cl_wait > carr &&
           (blk - 1 == k->linear || (g.cl_n > 1 && cluster_of(blk - 1) == cluster_of(k->linear)));
}

// The access by thread t (of block k) is ordered after an earlier one by (blk, tid, epoch, wepoch).
// Named barriers order it only when the two threads' warps both took part (every lane) in a phase released
// after the earlier access (nbseq: the block's nb_seq then); chains through a third warp are not followed;
// barrier.cluster phases as rc_cluster_ordered says (carr: the earlier thread's arrivals then).
inline bool rc_ordered(unsigned blk, unsigned tid, unsigned epoch, unsigned wepoch, unsigned nbseq, unsigned carr,
                       const Thread* t, const Block* k) {
    if (rc_cluster_ordered(blk, carr, t, k)) return true;
    if (blk != static_cast<unsigned>(k->linear) + 1) return false;
    if (tid == t->linear) return true;
    if (epoch != k->bar_epoch) return true;
    if ((tid >> 5) == t->warp && wepoch != k->warps[t->warp].sync_epoch) return true;
    return k->nb_pair[t->warp][tid >> 5] > nbseq;
}

void rc_describe_thread(Buf& b, unsigned blk1, unsigned tid) {
    unsigned long long bl = blk1 - 1;
    unsigned bx = static_cast<unsigned>(bl % pkrt_grid_dim.x), by = static_cast<unsigned>((bl / pkrt_grid_dim.x) % pkrt_grid_dim.y),
             bz = static_cast<unsigned>(bl / (1ull * pkrt_grid_dim.x * pkrt_grid_dim.y));
    unsigned tx = tid % pkrt_block_dim.x, ty = (tid / pkrt_block_dim.x) % pkrt_block_dim.y,
             tz = tid / (pkrt_block_dim.x * pkrt_block_dim.y);
    b.add("block (%u,%u,%u) thread (%u,%u,%u)", bx, by, bz, tx, ty, tz);
}

void rc_pc(Buf& b, uintptr_t pc) {
    Dl_info info;
    if (pc && dladdr(reinterpret_cast<void*>(pc), &info) && info.dli_fbase)
        b.add("@@pc:%lx@@", static_cast<unsigned long>(pc - 1 - reinterpret_cast<uintptr_t>(info.dli_fbase)));
    else
        b.add("an unknown line");
}

[[noreturn]] void rc_report(const Region* r, uintptr_t word, const char* kind, unsigned blk1, unsigned tid,
                            const char* prev_what, uintptr_t prev_pc, const char* cur_what, uintptr_t pc) {
    const Thread* t = cur();
    const Block* k = t->blk;
    const Block* owner = r->kind == REG_GLOBAL ? k : &g_blocks[r->slot];  // DSMEM: another CTA's shared memory
    Buf b{g.err, sizeof g.err};
    b.add("kernel %s: racecheck: %s on ", g.kernel, kind);
    if (r->kind == REG_GLOBAL) b.add("%s", r->name);
    else b.add("%s shared memory of block (%u,%u,%u)", r->kind == REG_STATIC ? "static __shared__" : "dynamic",
               owner->idx.x, owner->idx.y, owner->idx.z);
    b.add(" at byte offset %lu: ", static_cast<unsigned long>(word - r->lo));
    rc_describe_thread(b, blk1, tid);
    b.add(" %s at ", prev_what);
    rc_pc(b, prev_pc);
    b.add(", then ");
    rc_describe_thread(b, static_cast<unsigned>(k->linear) + 1, t->linear);
    b.add(" %s at ", cur_what);
    rc_pc(b, pc);
    if (g.cl_n > 1 && blk1 != static_cast<unsigned>(k->linear) + 1 && cluster_of(blk1 - 1) == cluster_of(k->linear))
        b.add(" with no barrier.cluster arrive / wait between them (two blocks of one cluster)");
    else if (blk1 != static_cast<unsigned>(k->linear) + 1)
        b.add(" (two blocks of one launch: nothing orders them; use atomics or separate launches)");
    else
        b.add(" with no __syncthreads() between them%s%s", (tid >> 5) == t->warp ? " (nor __syncwarp())" : "",
              k->nb_seq ? " (nor a named barrier both warps took part in)" : "");
    fail_from_fiber();
}

[[noreturn]] void rc_report_uninit(const Region* r, uintptr_t word, uintptr_t pc) {
    const Thread* t = cur();
    Buf b{g.err, sizeof g.err};
    describe_where(b, t);
    b.add(": initcheck: read of %s shared memory at byte offset %lu at ",
          r->kind == REG_STATIC ? "static __shared__" : "dynamic", static_cast<unsigned long>(word - r->lo));
    rc_pc(b, pc);
    b.add(" that no thread of the block has written (uninitialized on a GPU)");
    fail_from_fiber();
}

void rc_stress_yield(Thread* self) {
    // Another runnable thread of the block (the next in schedule order) runs first: a
    // read-modify-write that is not atomic loses updates, as on a GPU.
    Block* k = self->blk;
    unsigned n = g.n, p = k->pos_of[self->linear];
    for (unsigned j = 1; j < n; j++) {
        unsigned q = (p + j) % n;
        if (k->runnable[q >> 6] >> (q & 63) & 1) {
            switch_to(self, &k->threads[k->order[q]], false);
            return;
        }
    }
}

// A naturally aligned 8- or 16-byte access (float2, double, float4, uint4, ...) at an address
// that is not a multiple of its size: a misaligned-address fault on a GPU. (Ranges, the compiler's
// hooks for aggregate copies of any size, e.g. a 48-byte struct built on the stack, are no vector
// access: rc_access_range skips this check.)
[[noreturn]] void rc_misaligned(uintptr_t addr, unsigned size, bool write, uintptr_t pc) {
    Buf b{g.err, sizeof g.err};
    describe_where(b, cur());
    b.add(": misaligned %u-byte %s at address %p at ", size, write ? "store" : "load", reinterpret_cast<void*>(addr));
    rc_pc(b, pc);
    b.add(" (a vector access must be %u-byte aligned: a misaligned address error on a GPU)", size);
    fail_from_fiber();
}

void rc_access_range(uintptr_t addr, unsigned size, bool write, uintptr_t pc);
// pk_host_sm90.cpp: a generic write to shared bytes a wgmma in flight still reads (a report), and the report of an
// access racing with a TMA load.
void rc_wgmma_write_check(Block* k, Thread* t, unsigned long long win, unsigned size, uintptr_t pc);
bool g_wg_used[kMaxSlots];  // a wgmma of the slot's block read shared memory (pk_host_sm90.cpp's table)
[[noreturn]] void rc_report_tma(const Region* r, uintptr_t word, const Shadow& s, bool write, uintptr_t pc,
                                const Thread* t);

// A shared-memory access outside the launch's bytes (dynamic: [0, shared_mem) of the window; static: the
// __shared__ variables laid out so far): an out-of-bounds shared access, reported at the access, before it lands
// (compute-sanitizer's memcheck reports it; without it a GPU raises an out-of-range address error or reads and
// writes other data of the block).
[[noreturn]] void rc_smem_oob(const Block* owner, bool dyn, long long off, unsigned size, bool write, uintptr_t pc) {
    Buf b{g.err, sizeof g.err};
    describe_where(b, cur());
    b.add(": out-of-bounds %u-byte %s of ", size, write ? "write" : "read");
    if (dyn) b.add("dynamic shared memory (%llu bytes: the launch's shared_mem)", g.shared_mem);
    else b.add("static __shared__ memory (%zu bytes laid out)", g_static_used);
    if (owner != cur()->blk) b.add(" of block (%u,%u,%u)", owner->idx.x, owner->idx.y, owner->idx.z);
    const long long n = static_cast<long long>(dyn ? g.shared_mem : g_static_used);
    b.add(" at byte offset %lld relative to its start (%s) at ", off,
          off < 0 ? "before its start" : off >= n ? "past its end" : "running past its end");
    rc_pc(b, pc);
    fail_from_fiber();
}

// An address in the padding around a block's dynamic shared memory (kDynPad): out of bounds.
void rc_dyn_pad_check(uintptr_t addr, unsigned size, bool write, uintptr_t pc) {
    if (!kDynPad) return;
    const unsigned long long span = (g.shared_mem + 1023) & ~1023ull;
    for (int i = 0; i < g_nregions; i++) {
        const Region& r = g_regions[i];
        if (r.kind != REG_DYN) continue;
        if (addr + size > r.lo - kDynPad && addr < r.lo + span + kDynPad)
            rc_smem_oob(&g_blocks[r.slot], true, static_cast<long long>(addr - r.lo), size, write, pc);
    }
}

// The checked build sees every access: one that leaves its argument by any distance, the few
// slack bytes next to the guarded copy included (the default build cannot fault there), is
// reported here with its line.
void rc_guard_check(uintptr_t addr, unsigned size, bool write, uintptr_t pc) {
    const GuardArg* ga = guard_find(addr);
    if (!ga) ga = guard_find(addr + size - 1);
    if (!ga || (addr >= ga->lo && addr + size <= ga->hi)) return;
    // Another argument of the same copy (overlapping views) may hold it.
    for (int i = 0; i < g_nguard; i++)
        if (g_guard[i].win_lo == ga->win_lo && addr >= g_guard[i].lo && addr + size <= g_guard[i].hi) return;
    Buf b{g.err, sizeof g.err};
    describe_where(b, cur());
    b.add(": out-of-bounds %u-byte %s", size, write ? "write" : "read");
    guard_describe(b, ga, addr < ga->lo ? addr : (addr >= ga->hi ? addr : ga->hi));
    b.add(" at ");
    rc_pc(b, pc);
    fail_from_fiber();
}

void rc_access(uintptr_t addr, unsigned size, bool write, uintptr_t pc) {
    if (!g_rc || !pkrt_cur) return;
    if (size >= 8 && (addr & (size - 1)) && pc) rc_misaligned(addr, size, write, pc);
    rc_access_range(addr, size, write, pc);
}

// The shadow-memory part of rc_access: races, initcheck and stress yields, no alignment check.
void rc_access_range(uintptr_t addr, unsigned size, bool write, uintptr_t pc) {
    if (!g_rc || !pkrt_cur) return;
    if (pkrt_in_atomic) return;
    Region* r = rc_find(addr);
    if (!r) {
        rc_dyn_pad_check(addr, size, write, pc);
        if (g_nguard) rc_guard_check(addr, size, write, pc);
        return;
    }
    Thread* t = cur();
    Block* k = t->blk;
    const uintptr_t a0 = addr - r->lo, a1 = a0 + size;
    // Past the end of the dynamic bytes (an access that starts inside them) or of the static variables laid out.
    if (r->kind == REG_DYN && a1 > r->hi - r->lo)
        rc_smem_oob(&g_blocks[r->slot], true, static_cast<long long>(a0), size, write, pc);
    if (r->kind == REG_STATIC && a1 > g_static_used)
        rc_smem_oob(&g_blocks[r->slot], false, static_cast<long long>(a0), size, write, pc);
    // Another CTA's shared memory is reached only through the DSMEM wrappers (pkrt_dsmem sets g_rc_remote).
    if (r->kind != REG_GLOBAL && r->slot != static_cast<int>(k - g_blocks) && !g_rc_remote) return;
    if (write && (g_rc & RC_STRESS)) rc_stress_yield(t);
    // A generic write to bytes an issued wgmma has not been retired from reading (the async proxy reads its
    // shared operands any time until the wgmma.wait_group that retires it).
    if (write && (g_rc & RC_REPORT) && r->kind != REG_GLOBAL && !g_rc_remote && g_wg_used[r->slot])
        rc_wgmma_write_check(k, t, r->kind == REG_DYN ? a0 : ((g.shared_mem + 1023) & ~1023ull) + a0, size, pc);
    unsigned me = static_cast<unsigned>(k->linear) + 1;
    unsigned wep = k->warps[t->warp].sync_epoch;
    for (uintptr_t w = a0 & ~uintptr_t(3); w < a1; w += 4) {
        Shadow& s = r->sh[w >> 2];
        // Bytes of this word the access touches: 16-bit halves of one word are separate data.
        const uintptr_t b0 = std::max(a0, w), b1 = std::min(a1, w + 4);
        const unsigned char m = static_cast<unsigned char>(((1u << (b1 - b0)) - 1u) << (b0 - w));
        // A TMA load's bytes: not landed yet, or landed but not observed by this thread (its warp did not get
        // past the mbarrier phase that completed it, and no __syncthreads() since).
        if ((g_rc & RC_REPORT) && s.w_tid == kAsyncTid && s.w_blk && (s.w_mask & m) &&
            (s.tma || !rc_ordered(s.w_blk, s.w_tid, s.w_epoch, s.w_wepoch, s.w_nbseq, s.w_carr, t, k)))
            rc_report_tma(r, r->lo + w, s, write, pc, t);
        if (!write) {
            if ((g_rc & RC_INIT) && r->kind != REG_GLOBAL && (m & ~s.init)) rc_report_uninit(r, r->lo + w, pc);
            if ((g_rc & RC_REPORT) && s.w_blk && (s.w_mask & m) &&
                !rc_ordered(s.w_blk, s.w_tid, s.w_epoch, s.w_wepoch, s.w_nbseq, s.w_carr, t, k))
                rc_report(r, r->lo + w, "read-after-write race", s.w_blk, s.w_tid, "wrote", s.w_pc, "read", pc);
            if (!s.r_blk || s.r_tid == t->linear || !(s.r_mask & m) ||
                rc_ordered(s.r_blk, s.r_tid, s.r_epoch, s.r_wepoch, s.r_nbseq, s.r_carr, t, k)) {
                s.r_mask = m;
                s.r_blk = me;
                s.r_tid = t->linear;
                s.r_epoch = k->bar_epoch;
                s.r_wepoch = wep;
                s.r_nbseq = k->nb_seq;
                s.r_carr = t->cl_arr;
                s.r_pc = pc;
            }
        } else {
            if (g_rc & RC_REPORT) {
                if (s.w_blk && (s.w_mask & m) && !rc_ordered(s.w_blk, s.w_tid, s.w_epoch, s.w_wepoch, s.w_nbseq, s.w_carr, t, k))
                    rc_report(r, r->lo + w, "write-after-write race", s.w_blk, s.w_tid, "wrote", s.w_pc, "wrote", pc);
                if (s.r_blk && (s.r_mask & m) && !rc_ordered(s.r_blk, s.r_tid, s.r_epoch, s.r_wepoch, s.r_nbseq, s.r_carr, t, k))
                    rc_report(r, r->lo + w, "write-after-read race", s.r_blk, s.r_tid, "read", s.r_pc, "wrote", pc);
            }
            s.init |= m;
            s.w_mask = m;
            s.w_blk = me;
            s.w_tid = t->linear;
            s.w_epoch = k->bar_epoch;
            s.w_wepoch = wep;
            s.w_nbseq = k->nb_seq;
            s.w_carr = t->cl_arr;
            s.w_pc = pc;
            s.r_blk = 0;
            s.tma = 0;
        }
    }
}

// Accesses the compiler knows may be unaligned (packed data): no alignment check.
void rc_access_unaligned(uintptr_t addr, unsigned size, bool write, uintptr_t pc) {
    if (size >= 8 && (addr & (size - 1))) {
        // Split into bytes so the word checks still see it.
        for (unsigned i = 0; i < size; i++) rc_access(addr + i, 1, write, pc);
        return;
    }
    rc_access(addr, size, write, pc);
}

void rc_add_slot(const pk_launch_cfg* cfg, unsigned s, unsigned char* dyn) {
    if (!g_rc) return;
    if (!g_static_shadow[s]) g_static_shadow[s] = static_cast<Shadow*>(calloc(kStaticSmemMax / 4, sizeof(Shadow)));
    std::memset(g_static_shadow[s], 0, kStaticSmemMax / 4 * sizeof(Shadow));
    Block* k = &g_blocks[s];
    if (g_nregions < kMaxRegions)
        g_regions[g_nregions++] = Region{reinterpret_cast<uintptr_t>(k->static_smem),
                                         reinterpret_cast<uintptr_t>(k->static_smem) + kStaticSmemMax,
                                         g_static_shadow[s], REG_STATIC, static_cast<int>(s), -1, nullptr};
    if (dyn && g_nregions < kMaxRegions) {
        g_dyn_shadow[s].assign((cfg->shared_mem + 3) / 4, Shadow{});
        g_regions[g_nregions++] = Region{reinterpret_cast<uintptr_t>(dyn), reinterpret_cast<uintptr_t>(dyn) + cfg->shared_mem,
                                         g_dyn_shadow[s].data(), REG_DYN, static_cast<int>(s), -1, nullptr};
    }
}

void rc_setup(const pk_launch_cfg* cfg, unsigned slots, unsigned char* const* dyn) {
    g_rc = static_cast<int>(cfg->flags & 7);
    g_nregions = 0;
    if (!g_rc) {
        g_pending_bufs.clear();
        return;
    }
    for (unsigned s = 0; s < slots; s++) {
        if (!g_static_shadow[s]) g_static_shadow[s] = static_cast<Shadow*>(calloc(kStaticSmemMax / 4, sizeof(Shadow)));
        std::memset(g_static_shadow[s], 0, kStaticSmemMax / 4 * sizeof(Shadow));
        Block* k = &g_blocks[s];
        g_regions[g_nregions++] = Region{reinterpret_cast<uintptr_t>(k->static_smem),
                                         reinterpret_cast<uintptr_t>(k->static_smem) + kStaticSmemMax,
                                         g_static_shadow[s], REG_STATIC, static_cast<int>(s), -1, nullptr};
        if (dyn[s]) {
            g_dyn_shadow[s].assign((cfg->shared_mem + 3) / 4, Shadow{});
            g_regions[g_nregions++] = Region{reinterpret_cast<uintptr_t>(dyn[s]),
                                             reinterpret_cast<uintptr_t>(dyn[s]) + cfg->shared_mem,
                                             g_dyn_shadow[s].data(), REG_DYN, static_cast<int>(s), -1, nullptr};
        }
    }
    static std::vector<std::vector<Shadow>> global_shadow;
    global_shadow.resize(g_pending_bufs.size());
    for (size_t i = 0; i < g_pending_bufs.size() && g_nregions < kMaxRegions; i++) {
        const PendingBuf& pb = g_pending_bufs[i];
        if (!pb.n) continue;
        global_shadow[i].assign((pb.n + 3) / 4, Shadow{});
        g_regions[g_nregions++] = Region{pb.p, pb.p + pb.n, global_shadow[i].data(), REG_GLOBAL, -1,
                                         static_cast<int>(i), pb.name};
    }
    g_pending_bufs.clear();
}

void rc_block_start(Block* k, const pk_launch_cfg* cfg) {
    if (!g_rc) return;
    unsigned s = static_cast<unsigned>(k - g_blocks);
    std::memset(g_static_shadow[s], 0, ((g_static_used + 3) / 4) * sizeof(Shadow));
    if (k->dyn_smem) std::memset(g_dyn_shadow[s].data(), 0, g_dyn_shadow[s].size() * sizeof(Shadow));
    (void)cfg;
}

// cp.async lands through the runtime's memcpy: record it as the issuing thread's write.
void rc_mark_write(Thread* t, void* dst, int bytes) {
    if (!g_rc) return;
    for (int o = 0; o < bytes; o += 4) rc_access(reinterpret_cast<uintptr_t>(dst) + o, 4, true, 0);
    (void)t;
}
#endif

void cp_async_perform(Thread* t, bool all, unsigned below_group) {
    size_t keep = 0;
    for (size_t i = 0; i < t->cp.size(); i++) {
        CpAsync& c = t->cp[i];
#ifdef PK_RACECHECK
        if (all || c.group < below_group) rc_mark_write(t, c.dst, c.bytes);
#endif
        if (all || c.group < below_group) std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
        else t->cp[keep++] = c;
    }
    t->cp.resize(keep);
}

// The live lanes of `need` (named, existing, not exited) are parked in the same op with
// the same mask: compute results. Exited lanes count as arrived (as on sm_70+); reading
// an exited lane's value is the error.
void complete_warp_op(Block* k, unsigned warp, unsigned need, const Thread* proto) {
    Thread* lanes = &k->threads[warp * 32];
    Warp& w = k->warps[warp];
    unsigned live = need & ~w.exited;
    int op = proto->op;
    unsigned long long agg = 0;
    if (op >= PKRT_PTX_MMA_BF16) {
        complete_ptx(lanes, op);
    } else if (op == PKRT_BALLOT || op == PKRT_ANY || op == PKRT_ALL) {
        unsigned ballot = 0;
        for (unsigned l = 0; l < 32; l++)
            if ((live >> l & 1) && lanes[l].value) ballot |= 1u << l;
        agg = op == PKRT_BALLOT ? ballot : op == PKRT_ANY ? (ballot != 0) : (ballot == live);
    } else if (op >= PKRT_REDUCE_ADD) {
        bool sgn = proto->arg != 0;
        bool first = true;
        unsigned acc = 0;
        for (unsigned l = 0; l < 32; l++) {
            if (!(live >> l & 1)) continue;
            unsigned v = static_cast<unsigned>(lanes[l].value);
            if (first) { acc = v; first = false; continue; }
            switch (op) {
                case PKRT_REDUCE_ADD: acc += v; break;
                case PKRT_REDUCE_AND: acc &= v; break;
                case PKRT_REDUCE_OR: acc |= v; break;
                case PKRT_REDUCE_XOR: acc ^= v; break;
                case PKRT_REDUCE_MIN:
                    acc = sgn ? static_cast<unsigned>(std::min<int>(static_cast<int>(acc), static_cast<int>(v)))
                              : std::min(acc, v);
                    break;
                default:
                    acc = sgn ? static_cast<unsigned>(std::max<int>(static_cast<int>(acc), static_cast<int>(v)))
                              : std::max(acc, v);
            }
        }
        agg = acc;
    } else if (op == PKRT_MATCH_ALL) {
        bool same = true;
        for (unsigned l = 0; l < 32; l++)
            if ((live >> l & 1) && lanes[l].value != proto->value) same = false;
        agg = same ? (static_cast<unsigned long long>(1) << 32) | live : 0;
    }
    for (unsigned l = 0; l < 32; l++) {
        if (!(live >> l & 1)) continue;
        Thread& t = lanes[l];
        if (op >= PKRT_SHFL_IDX && op <= PKRT_SHFL_XOR) {
            int src = shfl_source(op, l, t.arg, t.width);
            if ((need >> src & 1) && (w.exited >> src & 1)) {
                char what[320];
                snprintf(what, sizeof what, "%s(mask 0x%08x) at %s:%d reads the value of lane %d, which has exited",
                         op_name(op), t.mask, t.file, t.line, src);
                fail_lane(&t, what);
            }
            // Reading a lane that does not take part is undefined on a GPU: return
            // all-ones bits (NaN for floats) so such a read is visible in results.
            t.result = (need >> src & 1) ? lanes[src].value : ~0ull;
        } else if (op == PKRT_MATCH_ANY) {
            unsigned m = 0;
            for (unsigned q = 0; q < 32; q++)
                if ((live >> q & 1) && lanes[q].value == t.value) m |= 1u << q;
            t.result = m;
        } else {
            t.result = agg;
        }
        t.state = RUN;
        set_runnable(&t);
    }
    w.waiting &= ~live;
    if (op == PKRT_SYNCWARP) w.sync_epoch++;
}

// Complete the collective that lane `l` of `warp` waits in, if every live lane it names is there.
void try_complete(Block* k, unsigned warp, unsigned l) {
    Warp& w = k->warps[warp];
    const Thread* lanes = &k->threads[warp * 32];
    const Thread* t = &lanes[l];
    unsigned need = t->mask & w.existing;
    unsigned live = need & ~w.exited;
    if ((w.waiting & live) != live) return;
    for (unsigned q = 0; q < 32; q++)
        if ((live >> q & 1) && (lanes[q].op != t->op || lanes[q].mask != t->mask)) return;
    complete_warp_op(k, warp, need, t);
}

#include "pk_host_sm90.cpp"  // Hopper: wgmma, TMA, mbarrier (inside this anonymous namespace)

[[noreturn]] void fiber_entry() {
#ifdef PK_ASAN
    // First arrival on this stack: when coming from the launching context, learn its
    // stack for the way back.
    const void* old_bottom = nullptr;
    size_t old_size = 0;
    __sanitizer_finish_switch_fiber(nullptr, &old_bottom, &old_size);
    if (g_switch_from_main) {
        g_main_stack_bottom = old_bottom;
        g_main_stack_size = old_size;
    }
#endif
    g.body(g.args);
    Thread* t = cur();
    Block* k = t->blk;
    cp_async_perform(t, true, 0);  // a GPU completes them even if nobody waits
    sm90_thread_exit(t);
    t->state = DONE;
    clear_runnable(t);
    k->n_done++;
    if (k->n_done == g.n) sm90_block_end(k);
    Warp& w = k->warps[t->warp];
    w.exited |= 1u << t->lane;
    // Collectives that waited only for this lane can complete now.
    for (unsigned l = 0; l < 32 && w.waiting; l++)
        if ((w.waiting >> l & 1) && k->threads[t->warp * 32 + l].state == WARP) try_complete(k, t->warp, l);
    try_activemask(k, t->warp);
    // A barrier.arrive that waited only for this lane's warp mates (nb_try_arrive) can go on now.
    for (unsigned l = 0; l < 32; l++) {
        const Thread& o = k->threads[t->warp * 32 + l];
        if ((w.existing >> l & 1) && o.state == NBAR && o.op == PKRT_BAR_ARRIVE) {
            nb_try_arrive(k, t->warp, o.arg);
            break;
        }
    }
    // Exited threads count as arrived at a barrier, as on the hardware (sm_70+).
    if (k->n_bar && k->n_bar + k->n_done == g.n) release_barrier(k);
    reschedule(true);
    __builtin_unreachable();
}

// ---- stacks ----------------------------------------------------------------------
// A fiber that finishes by switching away never unwinds its frames, so under AddressSanitizer the stack's
// shadow keeps their redzones after the pages go. The address range is reused by later mappings (another
// module's library, its globals); stale redzones there read as stack-buffer-overflows. Clear them first.
void unmap_stack(Thread& t) {
    if (!t.stack_lo) return;
#ifdef PK_ASAN
    __asan_unpoison_memory_region(t.stack_lo, t.stack_size);
#endif
    munmap(t.stack_lo - getpagesize(), t.stack_size + getpagesize());
    t.stack_lo = nullptr;
}

bool ensure_stacks(unsigned count, size_t stack_size, char* err, size_t errlen) {
    if (stack_size != g_stack_size) {
        for (int i = 0; i < kMaxSlots * kMaxThreads; i++) unmap_stack(g_threads[i]);
        g_stack_size = stack_size;
    }
    size_t page = static_cast<size_t>(getpagesize());
    for (unsigned s = 0; s < count; s++) {
        Thread& t = g_threads[s];
        if (t.stack_lo) continue;
        // One guard page below each stack turns a fiber stack overflow into a fault, not corruption.
        void* m = mmap(nullptr, stack_size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (m == MAP_FAILED) {
            snprintf(err, errlen, "cannot map %zu bytes for a fiber stack: %s", stack_size, strerror(errno));
            return false;
        }
        mprotect(m, page, PROT_NONE);
        t.stack_lo = static_cast<char*>(m) + page;
        t.stack_size = stack_size;
    }
    return true;
}

// The fiber stacks back to the system (two mappings each: a stack and its guard page). Each module keeps its
// own; the backend calls this on the module it leaves when another one launches, so a process that runs many
// modules holds one module's stacks, not hundreds of modules' (vm.max_map_count bounds the mappings).
extern "C" __attribute__((visibility("default"))) void pkrt_release_stacks() {
    for (int i = 0; i < kMaxSlots * kMaxThreads; i++) unmap_stack(g_threads[i]);
}

// ---- faults and the watchdog -------------------------------------------------------
// A fault inside a kernel (SIGSEGV, SIGBUS, SIGFPE) or a fiber that runs past
// PYKERN_HOST_WATCHDOG_S without reaching a meeting point leaves the fiber with
// siglongjmp back to pkrt_launch: a KernelExecutionError, and the process lives on.
#ifndef PK_ASAN
#define PK_SIGNALS 1
#endif

#ifdef PK_SIGNALS
sigjmp_buf g_jmp;
volatile sig_atomic_t g_in_kernel = 0;
pthread_t g_launch_thread;
double g_watchdog_s = 60.0;
volatile unsigned long long g_watch_seen = 0;
std::chrono::steady_clock::time_point g_watch_since;
int g_watch_sig = 0;
struct sigaction g_old_watch;
struct sigaction g_old[3];
const int kFaultSigs[3] = {SIGSEGV, SIGBUS, SIGFPE};
stack_t g_old_alt;
char g_alt_stack[64 << 10];
void* g_self_base = nullptr;  // this library's load address (fault_pc)

// A fault below the fiber's stack (the guard page, or a frame so large it jumped past
// it), or with the stack pointer already below it, is a stack overflow.
bool sp_overflowed(const Thread* t, void* uctx);
bool stack_overflowed(const void* addr, const Thread* t, void* uctx) {
    if (!t || !t->stack_lo) return false;
    const char* a = static_cast<const char*>(addr);
    if (a < t->stack_lo && a >= t->stack_lo - (64u << 20)) return true;
    return sp_overflowed(t, uctx);
}

// The stack pointer itself below the fiber's stack: a stack overflow, whatever the address.
bool sp_overflowed(const Thread* t, void* uctx) {
    if (!t || !t->stack_lo) return false;
    uintptr_t sp = 0;
#if defined(__x86_64__)
    sp = static_cast<uintptr_t>(static_cast<ucontext_t*>(uctx)->uc_mcontext.gregs[REG_RSP]);
#elif defined(__aarch64__)
    sp = static_cast<uintptr_t>(static_cast<ucontext_t*>(uctx)->uc_mcontext.sp);
#endif
    return sp && sp < reinterpret_cast<uintptr_t>(t->stack_lo) &&
           sp >= reinterpret_cast<uintptr_t>(t->stack_lo) - (64u << 20);
}

// 1: the faulting access was a write, 0: a read, -1: unknown (the page-fault error code: x86-64 only).
int fault_is_write(void* uctx) {
#if defined(__x86_64__)
    const ucontext_t* uc = static_cast<const ucontext_t*>(uctx);
    if (uc->uc_mcontext.gregs[REG_TRAPNO] == 14) return (uc->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
#else
    (void)uctx;
#endif
    return -1;
}

// " at FILE:LINE" of the faulting instruction when it is kernel code of this library (resolved by the
// backend with addr2line where the build has line tables, else dropped); nothing for code elsewhere
// (libc's memcpy under a cp.async, say).
void fault_pc(Buf& b, void* uctx) {
    uintptr_t pc = 0;
#if defined(__x86_64__)
    pc = static_cast<uintptr_t>(static_cast<ucontext_t*>(uctx)->uc_mcontext.gregs[REG_RIP]);
#elif defined(__aarch64__)
    pc = static_cast<uintptr_t>(static_cast<ucontext_t*>(uctx)->uc_mcontext.pc);
#endif
    Dl_info info;
    // dladdr is not async-signal-safe in general; the fault is in kernel code, which holds no loader lock.
    if (pc && g_self_base && dladdr(reinterpret_cast<void*>(pc), &info) && info.dli_fbase == g_self_base)
        b.add("@@at:%lx@@", static_cast<unsigned long>(pc - reinterpret_cast<uintptr_t>(g_self_base)));
}

#if defined(__x86_64__)
// Integer division by zero does not trap on a GPU (and INT_MIN / -1 wraps): give the
// GPU's results instead of SIGFPE. Decodes the faulting `div`/`idiv` r/m32|r/m64
// (opcode F7 /6, /7), sets quotient = all ones (-1) and remainder = the dividend (for
// x / 0), or quotient = the dividend and remainder 0 (for INT_MIN / -1), and steps over
// the instruction. Anything else stays a SIGFPE error.
bool fix_int_division(ucontext_t* uc) {
    greg_t* r = uc->uc_mcontext.gregs;
    const unsigned char* ip = reinterpret_cast<const unsigned char*>(r[REG_RIP]);
    const unsigned char* p = ip;
    bool wide = false;
    while (*p == 0x2e || *p == 0x3e || *p == 0x26 || *p == 0x64 || *p == 0x65 || *p == 0x36) p++;
    if (*p == 0x66) return false;  // 16-bit forms: not produced for int/long long division
    unsigned rex = 0;
    if ((*p & 0xf0) == 0x40) rex = *p++;
    wide = rex & 8;
    if (*p++ != 0xf7) return false;
    unsigned modrm = *p++;
    unsigned mod = modrm >> 6, reg = (modrm >> 3) & 7, rm = modrm & 7;
    if (reg != 6 && reg != 7) return false;
    static const int kRegs[16] = {REG_RAX, REG_RCX, REG_RDX, REG_RBX, REG_RSP, REG_RBP, REG_RSI, REG_RDI,
                                  REG_R8,  REG_R9,  REG_R10, REG_R11, REG_R12, REG_R13, REG_R14, REG_R15};
    long long divisor;
    if (mod == 3) {
        divisor = r[kRegs[rm | ((rex & 1) << 3)]];
    } else {
        long long addr = 0;
        if (rm == 4) {  // SIB
            unsigned sib = *p++;
            unsigned scale = sib >> 6, index = ((sib >> 3) & 7) | ((rex & 2) << 2), base = (sib & 7) | ((rex & 1) << 3);
            if (index != 4) addr += r[kRegs[index]] << scale;
            if ((sib & 7) == 5 && mod == 0) {
                int32_t d;
                std::memcpy(&d, p, 4);
                p += 4;
                addr += d;
            } else {
                addr += r[kRegs[base]];
            }
        } else if (rm == 5 && mod == 0) {  // RIP-relative: from the instruction's end (no immediate follows)
            int32_t d;
            std::memcpy(&d, p, 4);
            p += 4;
            addr = reinterpret_cast<long long>(p) + d;
        } else {
            addr = r[kRegs[rm | ((rex & 1) << 3)]];
        }
        if (mod == 1) {
            addr += static_cast<signed char>(*p);
            p += 1;
        } else if (mod == 2) {
            int32_t d;
            std::memcpy(&d, p, 4);
            p += 4;
            addr += d;
        }
        if (wide) {
            std::memcpy(&divisor, reinterpret_cast<const void*>(addr), 8);
        } else {
            int32_t d;
            std::memcpy(&d, reinterpret_cast<const void*>(addr), 4);
            divisor = static_cast<uint32_t>(d);
        }
    }
    if (!wide) divisor = static_cast<uint32_t>(divisor);
    unsigned long long lo = static_cast<unsigned long long>(r[REG_RAX]);
    unsigned long long q, rem;
    if (divisor == 0) {
        q = ~0ull;
        rem = wide ? lo : (lo & 0xffffffffull);
    } else if (reg == 7 && (wide ? divisor == -1 : static_cast<uint32_t>(divisor) == 0xffffffffu)) {
        q = wide ? lo : (lo & 0xffffffffull);  // INT_MIN / -1 wraps to INT_MIN
        rem = 0;
    } else {
        return false;
    }
    if (!wide) {
        q &= 0xffffffffull;
        rem &= 0xffffffffull;
    }
    r[REG_RAX] = static_cast<greg_t>(q);
    r[REG_RDX] = static_cast<greg_t>(rem);
    r[REG_RIP] = reinterpret_cast<greg_t>(p);
    return true;
}
#endif

// The resident block whose dynamic shared memory's guarded mapping holds address a, or nullptr.
const Block* dyn_guard_find(uintptr_t a) {
#ifndef PK_ASAN
    for (unsigned s = 0; s < g.slots && s < static_cast<unsigned>(kMaxSlots); s++)
        if (g_blocks[s].dyn_smem && g_dyn_map[s] && a - reinterpret_cast<uintptr_t>(g_dyn_map[s]) < g_dyn_map_len[s])
            return &g_blocks[s];
#else
    (void)a;
#endif
    return nullptr;
}

// Only async-signal-safe work here: format into g.err, then jump.
void on_fault(int sig, siginfo_t* info, void* uctx) {
    Thread* t = cur();
    if (!g_in_kernel || !t) {
        // Not ours: hand it to whoever was installed before (for faults, after restoring).
        for (int i = 0; i < 3; i++) {
            if (kFaultSigs[i] != sig) continue;
            struct sigaction& o = g_old[i];
            if (o.sa_flags & SA_SIGINFO) {
                if (o.sa_sigaction) { o.sa_sigaction(sig, info, uctx); return; }
            } else if (o.sa_handler != SIG_DFL && o.sa_handler != SIG_IGN) {
                o.sa_handler(sig);
                return;
            }
            sigaction(sig, &o, nullptr);
            return;  // the faulting instruction runs again and gets the default action
        }
        return;
    }
#if defined(__x86_64__)
    if (sig == SIGFPE && (info->si_code == FPE_INTDIV || info->si_code == FPE_INTOVF) &&
        fix_int_division(static_cast<ucontext_t*>(uctx)))
        return;
#endif
    Buf b{g.err, sizeof g.err};
    describe_where(b, t);
    const GuardArg* ga = (sig == SIGSEGV || sig == SIGBUS) && !sp_overflowed(t, uctx)
                             ? guard_find(reinterpret_cast<uintptr_t>(info->si_addr)) : nullptr;
    if (ga) {
        int w = fault_is_write(uctx);
        b.add(": out-of-bounds %s", w < 0 ? "access" : w ? "write" : "read");
        guard_describe(b, ga, reinterpret_cast<uintptr_t>(info->si_addr));
        fault_pc(b, uctx);
        b.add(": stopped at the guard before it touched other memory (a GPU reports an illegal address or "
              "silently corrupts other data)");
    } else if (const Block* ob = (sig == SIGSEGV || sig == SIGBUS) ? dyn_guard_find(reinterpret_cast<uintptr_t>(info->si_addr))
                                                                    : nullptr) {
        int w = fault_is_write(uctx);
        const long long off = static_cast<long long>(reinterpret_cast<uintptr_t>(info->si_addr) -
                                                     reinterpret_cast<uintptr_t>(ob->dyn_smem));
        b.add(": out-of-bounds %s of dynamic shared memory (%llu bytes: the launch's shared_mem)", w < 0 ? "access" : w ? "write" : "read",
              g.shared_mem);
        if (ob != t->blk) b.add(" of block (%u,%u,%u)", ob->idx.x, ob->idx.y, ob->idx.z);
        b.add(" at byte offset %lld relative to its start (%s)", off, off < 0 ? "before its start" : "past its end");
        fault_pc(b, uctx);
        b.add(": stopped at the guard before it touched other memory (a GPU reports an out-of-range shared address "
              "or reads and writes other data of the block)");
    } else if (sig == SIGSEGV && stack_overflowed(info->si_addr, t, uctx)) {
        b.add(": stack overflow: the thread's local memory (its C++ stack) outgrew %zu KiB; set "
              "PYKERN_HOST_STACK_KB higher (a GPU allows up to 512 KiB of local memory per thread)",
              t->stack_size >> 10);
    } else if (sig == SIGSEGV && info->si_code == SI_KERNEL) {
        b.add(": general protection fault: most likely a misaligned vector access (float4/uint4 need 16-byte, "
              "float2/double 8-byte alignment; a misaligned address error on a GPU) or a non-canonical pointer");
    } else if (sig == SIGSEGV || sig == SIGBUS) {
        b.add(": %s at address %p", sig == SIGSEGV ? "segmentation fault" : "bus error", info->si_addr);
        fault_pc(b, uctx);
        b.add(": an out-of-bounds access not within any array argument's guard window (an invalid, "
              "unmapped or misaligned address: a GPU reports an illegal or misaligned address)");
    } else {
        b.add(": arithmetic exception (SIGFPE, code %d)", info->si_code);
    }
    g.failed = true;
    siglongjmp(g_jmp, 1);
}

void on_watchdog(int sig, siginfo_t* info, void* uctx) {
    Thread* t = cur();
    if (!g_in_kernel || !t) {
        if ((g_old_watch.sa_flags & SA_SIGINFO) && g_old_watch.sa_sigaction) g_old_watch.sa_sigaction(sig, info, uctx);
        return;
    }
    Buf b{g.err, sizeof g.err};
    describe_where(b, t);
    b.add(": ran for more than %g s (PYKERN_HOST_WATCHDOG_S) without reaching a meeting point "
          "(__syncthreads, a warp collective, an atomic in the interleaved schedule): an endless loop, or a "
          "spin-wait on another thread or block that cannot make progress here",
          g_watchdog_s);
    g.failed = true;
    siglongjmp(g_jmp, 1);
}

void watchdog_loop() {
    for (;;) {
        double limit = g_watchdog_s;
        double step = std::min(0.25, std::max(0.01, limit / 8));
        std::this_thread::sleep_for(std::chrono::duration<double>(step));
        if (!g_in_kernel) continue;
        unsigned long long p = g_progress;
        auto now = std::chrono::steady_clock::now();
        if (p != g_watch_seen) {
            g_watch_seen = p;
            g_watch_since = now;
            continue;
        }
        if (std::chrono::duration<double>(now - g_watch_since).count() > limit) {
            g_watch_since = now;
            pthread_kill(g_launch_thread, g_watch_sig);
        }
    }
}

void arm_signals(double watchdog_s) {
    static bool watch_started = false;
    g_watchdog_s = watchdog_s;
    if (!watch_started && watchdog_s > 0) {
        g_watch_sig = SIGRTMIN + 6;
        struct sigaction sa;
        std::memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_watchdog;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(g_watch_sig, &sa, &g_old_watch);  // stays installed: a late signal must not kill us
        std::thread(watchdog_loop).detach();
        watch_started = true;
    }
    if (!g_self_base) {
        Dl_info info;
        if (dladdr(reinterpret_cast<void*>(&arm_signals), &info)) g_self_base = info.dli_fbase;
    }
    stack_t ss;
    ss.ss_sp = g_alt_stack;
    ss.ss_size = sizeof g_alt_stack;
    ss.ss_flags = 0;
    sigaltstack(&ss, &g_old_alt);
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 3; i++) sigaction(kFaultSigs[i], &sa, &g_old[i]);
    g_launch_thread = pthread_self();
    g_watch_seen = g_progress;
    g_watch_since = std::chrono::steady_clock::now();
}

void disarm_signals() {
    for (int i = 0; i < 3; i++) sigaction(kFaultSigs[i], &g_old[i], nullptr);
    if (!(g_old_alt.ss_flags & SS_ONSTACK)) sigaltstack(&g_old_alt, nullptr);
}
#endif

}  // namespace

// ---- entry points used by the emulation header ----------------------------------------
extern "C" int pkrt_barrier(int kind, int pred, const char* file, int line) {
    Thread* t = cur();
    Block* k = t->blk;
    t->state = BAR;
    t->op = kind;
    t->file = file;
    t->line = line;
    clear_runnable(t);
    if (k->n_bar == 0) {
        k->bar_kind = kind;
        k->bar_file = file;
        k->bar_line = line;
    } else if (!k->bar_mismatch &&
               (kind != k->bar_kind || line != k->bar_line || std::strcmp(file, k->bar_file) != 0)) {
        k->bar_mismatch = t;
    }
    k->n_bar++;
    k->bar_pred_count += pred ? 1u : 0u;
    if (k->n_bar + k->n_done == g.n) release_barrier(k);
    else try_activemask(k, t->warp);
    reschedule(false);
    return static_cast<int>(t->result);
}

// A named barrier (PTX barrier.sync / barrier.red / barrier.arrive with a thread count): barrier `id` (1..15; 0
// is __syncthreads') completes once `count` threads (a multiple of 32, at most the block) have arrived, whichever
// instructions they arrived at (the non-.aligned form); the rest of the block runs on, and may never arrive.
// Every arrival of one phase must give the same count and the same reduction (barrier.sync and barrier.arrive
// mix: FA3's ping-pong of two warpgroups); a wrong count would hang or release early on the GPU. The result of
// red.and / red.or / red.popc over the arrivals.
// barrier.arrive does not wait for the phase: the warp's live lanes meet (the warp's arrival is one event, as
// the GPU counts it) and run on. A warp that arrives twice in one phase is an error (the GPU would count both
// arrivals and release the phase early), as is a thread count that disagrees with the phase's.
namespace {
void nb_fail_mismatch(const Block::Named& nb, int id, unsigned count, int kind, const char* file, int line) {
    char what[512];
    snprintf(what, sizeof what,
             "%s of named barrier %d with %u threads at %s:%d, but this phase's first arrival was %s with %u "
             "threads at %s:%d",
             nb_name(kind), id, count, file, line, nb_name(nb.kind), nb.count, nb.file, nb.line);
    fail_simple(what);
}
// barrier.sync and barrier.arrive are one kind of phase (no reduction); the reductions each their own.
inline int nb_class(int kind) { return kind == PKRT_BAR_ARRIVE ? PKRT_BAR_PLAIN : kind; }

// Open barrier id's phase with this arrival, or check the arrival against the open phase.
void nb_join(Block* k, int id, unsigned count, int kind, const char* file, int line) {
    Block::Named& nb = k->named[id];
    if (nb.count == 0) {
        nb.count = count;
        nb.kind = kind;
        nb.file = file;
        nb.line = line;
        nb.arrived = nb.pred_count = 0;
        nb.arr_warps = 0;
    } else if (count != nb.count || nb_class(kind) != nb_class(nb.kind)) {
        nb_fail_mismatch(nb, id, count, kind, file, line);
    }
}

// The phase of barrier id has all its arrivals: release the threads waiting in it, with `result`. For racecheck,
// the waiting warps every (existing, not exited) lane of which arrived are ordered with each other, and after the
// accesses that each warp which arrived by barrier.arrive made before its arrival.
void nb_release(Block* k, int id) {
    Block::Named& nb = k->named[id];
    int result;
    switch (nb.kind) {
        case PKRT_BAR_COUNT: result = static_cast<int>(nb.pred_count); break;
        case PKRT_BAR_AND: result = nb.pred_count == nb.count; break;
        case PKRT_BAR_OR: result = nb.pred_count != 0; break;
        default: result = 0;
    }
    const unsigned nw = (g.n + 31) / 32;
    unsigned in[kMaxThreads / 32];
    unsigned full[kMaxThreads / 32], nfull = 0;
    for (unsigned w = 0; w < nw; w++) in[w] = 0;
    for (unsigned i = 0; i < g.n; i++) {
        Thread& o = k->threads[i];
        if (o.state == NBAR && o.arg == id && o.op != PKRT_BAR_ARRIVE) {
            o.state = RUN;
            o.result = static_cast<unsigned long long>(result);
            in[o.warp] |= 1u << o.lane;
        }
    }
    k->nb_seq++;
    for (unsigned w = 0; w < nw; w++)
        if (in[w] && in[w] == (k->warps[w].existing & ~k->warps[w].exited)) full[nfull++] = w;
    for (unsigned a = 0; a < nfull; a++) {
        for (unsigned b2 = 0; b2 < nfull; b2++) k->nb_pair[full[a]][full[b2]] = k->nb_seq;
        for (unsigned x = 0; x < nw; x++)
            if (nb.arr_warps >> x & 1)
                k->nb_pair[full[a]][x] = std::max(k->nb_pair[full[a]][x], nb.arr_seq[x]);
    }
    nb.count = 0;
    nb.arr_warps = 0;
    if (g.schedule == 2) make_order(k);  // a fresh permutation for every phase
    std::memset(k->runnable, 0, sizeof k->runnable);
    for (unsigned i = 0; i < g.n; i++)
        if (k->threads[i].state == RUN) set_runnable(&k->threads[i]);
}

// Lanes of warp w wait in barrier.arrive on id: once every live lane has come, the warp arrives (once) and runs on.
void nb_try_arrive(Block* k, unsigned w, int id) {
    const Warp& wp = k->warps[w];
    const unsigned live = wp.existing & ~wp.exited;
    Thread* lanes = &k->threads[w * 32];
    unsigned here = 0;
    for (unsigned l = 0; l < 32; l++)
        if ((live >> l & 1) && lanes[l].state == NBAR && lanes[l].op == PKRT_BAR_ARRIVE && lanes[l].arg == id)
            here |= 1u << l;
    if (here != live) return;
    const Thread* first = &lanes[__builtin_ctz(here)];
    nb_join(k, id, static_cast<unsigned>(first->width), PKRT_BAR_ARRIVE, first->file, first->line);
    Block::Named& nb = k->named[id];
    if (nb.arr_warps >> w & 1) {
        char what[512];
        snprintf(what, sizeof what,
                 "barrier.arrive of named barrier %d at %s:%d: warp %u arrives a second time in one phase (it "
                 "arrived at %s:%d; %u of %u threads have arrived): a GPU counts both arrivals and releases the "
                 "phase early",
                 id, first->file, first->line, w, nb.arr_file[w], nb.arr_line[w], nb.arrived, nb.count);
        fail_simple(what);
    }
    for (unsigned l = 0; l < 32; l++)
        if (here >> l & 1) {
            lanes[l].state = RUN;
            lanes[l].result = 0;
            set_runnable(&lanes[l]);
        }
    // A fresh sequence point: this warp's accesses before it are stamped below arr_seq, those after at or above.
    nb.arr_warps |= 1u << w;
    nb.arr_file[w] = first->file;
    nb.arr_line[w] = first->line;
    nb.arr_seq[w] = ++k->nb_seq;
    nb.arrived += static_cast<unsigned>(__builtin_popcount(here));
    if (nb.arrived > nb.count) {
        char what[512];
        snprintf(what, sizeof what,
                 "barrier.arrive of named barrier %d at %s:%d: %u threads arrived in a phase of %u threads", id,
                 first->file, first->line, nb.arrived, nb.count);
        fail_simple(what);
    }
    if (nb.arrived == nb.count) nb_release(k, id);
}
}  // namespace

extern "C" int pkrt_named_barrier(int id, unsigned count, int kind, int pred, const char* file, int line) {
    Thread* t = cur();
    Block* k = t->blk;
    char what[512];
    if (id < 1 || id > 15) {
        snprintf(what, sizeof what, "named barrier %d at %s:%d: the id must be 1..15 (0 is __syncthreads')", id, file,
                 line);
        fail_simple(what);
    }
    if (count == 0 || count % 32 || count > (g.n + 31) / 32 * 32) {
        snprintf(what, sizeof what,
                 "named barrier %d at %s:%d: thread count %u must be a nonzero multiple of 32 and at most the "
                 "block's %u threads",
                 id, file, line, count, g.n);
        fail_simple(what);
    }
    t->state = NBAR;
    t->op = kind;
    t->arg = id;
    t->width = static_cast<int>(count);
    t->file = file;
    t->line = line;
    clear_runnable(t);
    if (kind == PKRT_BAR_ARRIVE) {
        // The phase is joined when the whole warp has come (nb_try_arrive); a phase open now must agree already.
        if (k->named[id].count && (count != k->named[id].count || nb_class(kind) != nb_class(k->named[id].kind)))
            nb_fail_mismatch(k->named[id], id, count, kind, file, line);
        nb_try_arrive(k, t->warp, id);
        if (t->state != RUN) try_activemask(k, t->warp);
        reschedule(false);
        return 0;
    }
    nb_join(k, id, count, kind, file, line);
    // A warp may wait on a phase it arrived at (FA3's first warpgroup opens its own barrier so: arrive, then sync).
    Block::Named& nb = k->named[id];
    nb.arrived++;
    nb.pred_count += pred ? 1u : 0u;
    if (nb.arrived == nb.count) nb_release(k, id);
    else try_activemask(k, t->warp);
    reschedule(false);
    return static_cast<int>(t->result);
}

extern "C" unsigned long long pkrt_warp_op(int op, unsigned mask, unsigned long long value, int arg, int width,
                                           const char* file, int line) {
    Thread* t = cur();
    Block* k = t->blk;
    if (!(mask >> t->lane & 1)) {
        char what[256];
        snprintf(what, sizeof what, "%s(mask 0x%08x) at %s:%d: the mask does not name the calling lane %u",
                 op_name(op), mask, file, line, t->lane);
        fail_simple(what);
    }
    if (width < 1 || width > 32 || (width & (width - 1))) {
        char what[256];
        snprintf(what, sizeof what, "%s at %s:%d: width must be a power of 2 in 1..32, got %d", op_name(op), file,
                 line, width);
        fail_simple(what);
    }
    t->state = WARP;
    t->op = op;
    t->mask = mask;
    t->value = value;
    t->arg = arg;
    t->width = width;
    t->file = file;
    t->line = line;
    clear_runnable(t);
    k->warps[t->warp].waiting |= 1u << t->lane;
    try_complete(k, t->warp, t->lane);
    if (t->state != RUN) try_activemask(k, t->warp);
    reschedule(false);
    return t->result;
}

extern "C" unsigned pkrt_activemask_at(const char* file, int line) {
    Thread* t = cur();
    Block* k = t->blk;
    t->state = WARP;
    t->op = PKRT_ACTIVEMASK;
    t->mask = 0;
    t->file = file;
    t->line = line;
    clear_runnable(t);
    k->warps[t->warp].am_waiting |= 1u << t->lane;
    try_activemask(k, t->warp);
    reschedule(false);
    return static_cast<unsigned>(t->result);
}

// Interleaved schedule: atomics and fences let other blocks run, so a spin-wait on a flag
// another block sets can finish.
extern "C" void pkrt_yield(void) {
    if (g.seq) return;
    Thread* self = cur();
    Thread* next = pick_other(self->blk);
    if (next && next != self) switch_to(self, next, false);
}

// Semaphores (pk_sem_wait_eq / pk_sem_add in pk_ptx.cuh): a thread waiting for *p == v leaves the runnable set
// until an add makes it so. When no resident block can run and some wait, the launch loop starts the next block
// of the schedule in a new slot (up to kMaxSlots), so a block waiting for later blocks of the order (the
// reverse and random schedules) does not deadlock; a wait nobody can release is an error naming it.
extern "C" void pkrt_sem_wait(const int* p, int v, const char* file, int line) {
    if (!g.seq) pkrt_yield();
    Thread* t = cur();
    while (*p != v) {
        t->state = SEM;
        t->sem_p = p;
        t->sem_v = v;
        t->file = file;
        t->line = line;
        clear_runnable(t);
        g.sem_waiting++;
        reschedule(false);
    }
}

extern "C" void pkrt_sem_add(int* p, int v) {
    if (!g.seq) pkrt_yield();
    *p += v;
    if (!g.sem_waiting) return;
    for (unsigned s = 0; s < g.slots; s++) {
        Block* k = &g_blocks[s];
        if (!k->active || k->finished) continue;
        for (unsigned i = 0; i < g.n; i++) {
            Thread& o = k->threads[i];
            if (o.state == SEM && o.sem_p == p && *p == o.sem_v) {
                o.state = RUN;
                g.sem_waiting--;
                set_runnable(&o);
            }
        }
    }
}

extern "C" void* pkrt_static_smem(int id, size_t size, size_t align) {
    StaticVar& v = g_static_vars[id];
    if (!v.set) {
        size_t off = (g_static_used + align - 1) & ~(align - 1);
        if (off + size > kStaticSmemMax) {
            char what[256];
            snprintf(what, sizeof what,
                     "static __shared__ memory exceeds %zu bytes (48 KiB, the limit on every GPU): %zu bytes needed",
                     kStaticSmemMax, off + size);
            fail_simple(what);
        }
        if (off + size + g.shared_mem > g.smem_limit) {
            char what[320];
            snprintf(what, sizeof what,
                     "static (%zu bytes) + dynamic (%llu bytes) shared memory exceed the %llu bytes a block may use "
                     "(PYKERN_HOST_ARCH)",
                     off + size, g.shared_mem, g.smem_limit);
            fail_simple(what);
        }
        v.off = off;
        v.set = true;
        g_static_used = off + size;
    }
    return pkrt_static_smem_base + v.off;
}

extern "C" void pkrt_ptx_warp(int op, void* frag, const char* file, int line) {
    Thread* t = cur();
    if (t->blk->warps[t->warp].existing != 0xffffffffu) {
        char what[256];
        snprintf(what, sizeof what, "%s at %s:%d needs a full warp of 32 threads (the block has %u)", op_name(op),
                 file, line, g.n);
        fail_simple(what);
    }
    pkrt_warp_op(op, 0xffffffffu, reinterpret_cast<uintptr_t>(frag), 0, 32, file, line);
}

extern "C" void pkrt_cp_async(void* dst, const void* src, int bytes, const char* file, int line) {
    Thread* t = cur();
    if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & static_cast<uintptr_t>(bytes - 1)) {
        char what[256];
        snprintf(what, sizeof what, "pk_cp_async_16 at %s:%d: addresses %p <- %p are not %d-byte aligned", file, line,
                 dst, src, bytes);
        fail_simple(what);
    }
    smem_bounds_check(t, dst, static_cast<unsigned>(bytes), true, "pk_cp_async_16 (its shared destination)", file, line);
    t->cp.push_back(CpAsync{dst, src, bytes, t->cp_group});
    if (bytes == 16 && g_v4_on) v4_record(dst, file, line);
}

// A 16-byte shared-memory read (pk_ld_shared_v4): the bank model's record of it (when enabled).
extern "C" void pkrt_ld_shared_v4(const void* p, const char* file, int line) {
    smem_bounds_check(cur(), p, 16, false, "ld.shared.v4 (pk_ld_shared_v4 / pk_ld_shared_b128)", file, line);
    if (g_v4_on) v4_record(p, file, line);
}

extern "C" void pkrt_cp_async_commit(void) { cur()->cp_group++; }

extern "C" void pkrt_cp_async_wait(int n, int all) {
    Thread* t = cur();
    unsigned committed = t->cp_group;
    unsigned below = committed > static_cast<unsigned>(n) ? committed - static_cast<unsigned>(n) : 0;
    cp_async_perform(t, all != 0, below);
}

#ifdef PK_RACECHECK
extern "C" {
int pkrt_in_atomic = 0;
__attribute__((noinline)) void pkrt_atomic_begin(void) { pkrt_in_atomic++; }
__attribute__((noinline)) void pkrt_atomic_end(void) { pkrt_in_atomic--; }
// Argument buffers for the next launch (the host backend calls this right before it).
__attribute__((visibility("default"))) void pkrt_race_buffers(int n, const unsigned long long* ptrs,
                                                              const unsigned long long* sizes,
                                                              const char* const* names) {
    g_pending_bufs.clear();
    for (int i = 0; i < n; i++) g_pending_bufs.push_back(PendingBuf{ptrs[i], sizes[i], names[i]});
}
void __tsan_init(void) {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit(void) {}
#define PK_TSAN_HOOKS(N)                                                                                        \
    void __tsan_read##N(void* a) { rc_access(reinterpret_cast<uintptr_t>(a), N, false, reinterpret_cast<uintptr_t>(__builtin_return_address(0))); } \
    void __tsan_write##N(void* a) { rc_access(reinterpret_cast<uintptr_t>(a), N, true, reinterpret_cast<uintptr_t>(__builtin_return_address(0))); } \
    void __tsan_unaligned_read##N(void* a) { rc_access_unaligned(reinterpret_cast<uintptr_t>(a), N, false, reinterpret_cast<uintptr_t>(__builtin_return_address(0))); } \
    void __tsan_unaligned_write##N(void* a) { rc_access_unaligned(reinterpret_cast<uintptr_t>(a), N, true, reinterpret_cast<uintptr_t>(__builtin_return_address(0))); }
PK_TSAN_HOOKS(1)
PK_TSAN_HOOKS(2)
PK_TSAN_HOOKS(4)
PK_TSAN_HOOKS(8)
PK_TSAN_HOOKS(16)
#undef PK_TSAN_HOOKS
void __tsan_read_range(void* a, unsigned long n) {
    rc_access_range(reinterpret_cast<uintptr_t>(a), static_cast<unsigned>(n), false, reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
}
void __tsan_write_range(void* a, unsigned long n) {
    rc_access_range(reinterpret_cast<uintptr_t>(a), static_cast<unsigned>(n), true, reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
}
#else
// Every build exports it, so the backend may call it unconditionally.
extern "C" __attribute__((visibility("default"))) void pkrt_race_buffers(int, const unsigned long long*,
                                                                         const unsigned long long*,
                                                                         const char* const*) {}
#endif

// The ldmatrix bank model's totals since the last reset (bank_count_ldsm): out[0] phases, out[1] wavefronts,
// out[2] the most wavefronts of one phase, out[3] its source line, *file its source file (or null).
extern "C" __attribute__((visibility("default"))) void pkrt_bank_stats(unsigned long long* out, const char** file,
                                                                       int reset) {
    std::lock_guard<std::mutex> lk(g_bank_mu);
    out[0] = g_bank_phases, out[1] = g_bank_wavefronts, out[2] = g_bank_worst;
    out[3] = (unsigned long long)g_bank_worst_line;
    *file = g_bank_worst_file;
    if (reset) g_bank_phases = g_bank_wavefronts = g_bank_worst = 0, g_bank_worst_file = nullptr, g_bank_worst_line = 0;
}

// The 16-byte access bank model (v4_record): on / off (the counts since the last reset are kept either way).
extern "C" __attribute__((visibility("default"))) void pkrt_v4_bank_enable(int on) {
    std::lock_guard<std::mutex> lk(g_v4_mu);
    g_v4_on = on;
}

// Its totals as pkrt_bank_stats' (out[0] phases, out[1] wavefronts, out[2] worst, out[3] its line, *file), the
// warps' accesses that some lanes never made counted first with the lanes that did.
extern "C" __attribute__((visibility("default"))) void pkrt_v4_bank_stats(unsigned long long* out, const char** file,
                                                                          int reset) {
    std::lock_guard<std::mutex> lk(g_v4_mu);
    for (const auto& e : g_v4_pending) v4_count(e.first, e.second);
    g_v4_pending.clear();
    out[0] = g_v4_phases, out[1] = g_v4_wavefronts, out[2] = g_v4_worst;
    out[3] = (unsigned long long)g_v4_worst_line;
    *file = g_v4_worst_file;
    if (reset) {
        g_v4_phases = g_v4_wavefronts = g_v4_worst = 0, g_v4_worst_file = nullptr, g_v4_worst_line = 0;
        g_v4_count.clear();
    }
}

extern "C" void pkrt_trap(const char* file, int line) {
    char what[256];
    snprintf(what, sizeof what, "__trap() at %s:%d", file, line);
    fail_simple(what);
}

extern "C" void pkrt_assert_fail(const char* expr, const char* file, int line) {
    char what[512];
    snprintf(what, sizeof what, "assertion `%s` failed at %s:%d", expr, file, line);
    fail_simple(what);
}

extern "C" long long pkrt_clock64(void) {
    return std::chrono::steady_clock::now().time_since_epoch().count();
}

#ifdef PK_ASAN
// An ASan/UBSan report names the .cu line; this names the launch, block and thread.
static void report_context() {
    const Thread* t = cur();
    if (!g.kernel) return;
    if (t) {
        fprintf(stderr, "pykern host backend: the report above happened in kernel %s, block (%u,%u,%u), thread (%u,%u,%u)\n",
                g.kernel, t->blk->idx.x, t->blk->idx.y, t->blk->idx.z, t->tid.x, t->tid.y, t->tid.z);
    } else {
        fprintf(stderr, "pykern host backend: the report above happened in kernel %s\n", g.kernel);
    }
}
#endif

namespace {

// Put block number `linear` (in grid order) into slot `k` with fresh fibers.
void start_block(Block* k, unsigned long long linear, const pk_launch_cfg* cfg) {
    k->linear = linear;
    k->idx.x = static_cast<unsigned>(linear % cfg->grid[0]);
    k->idx.y = static_cast<unsigned>((linear / cfg->grid[0]) % cfg->grid[1]);
    k->idx.z = static_cast<unsigned>(linear / (1ull * cfg->grid[0] * cfg->grid[1]));
    k->active = true;
    k->finished = false;
    // A GPU leaves shared memory uninitialized: 0xff bytes (NaN floats, -1 integers) make
    // a read before the first write visible in results.
    if (k->dyn_smem) std::memset(k->dyn_smem, 0xff, cfg->shared_mem);
    std::memset(k->static_smem, 0xff, g_static_used);
    k->rng = cfg->seed * 0x2545f4914f6cdd1dull + linear;
    make_order(k);
    k->n_done = k->n_bar = 0;
    k->bar_epoch = 0;
    k->bar_pred_count = 0;
    k->bar_mismatch = nullptr;
    std::memset(k->named, 0, sizeof k->named);
    k->nb_seq = 0;
    std::memset(k->nb_pair, 0, sizeof k->nb_pair);
    std::memset(k->runnable, 0, sizeof k->runnable);
    for (unsigned w = 0; w < (g.n + 31) / 32; w++)
        k->warps[w].waiting = k->warps[w].exited = k->warps[w].am_waiting = k->warps[w].sync_epoch = 0;
#ifdef PK_RACECHECK
    rc_block_start(k, cfg);
#endif
    sm90_block_start(k);
    for (unsigned i = 0; i < g.n; i++) {
        Thread& t = k->threads[i];
        t.state = RUN;
        t.op = -1;
        t.mask = 0;
        t.cp.clear();
        t.cp_group = 0;
        t.cl_arr = t.cl_wait = 0;
        init_fiber(&t);
        set_runnable(&t);
    }
}

// Per-slot state of the launch: dynamic shared memory (exactly as large as asked, so ASan sees overruns), the
// static __shared__ arena, the threads' fixed fields. Slot `s` of `g`; false (g.err set) when out of memory.
unsigned char* g_dyn[kMaxSlots];
unsigned char* g_static_arena[kMaxSlots];
void free_dyn(unsigned s) {
#ifdef PK_ASAN
    free(g_dyn[s]);
#endif
    g_dyn[s] = nullptr;
}

// The dynamic shared memory of `shared_mem` bytes for slot s (1024-byte aligned), or nullptr.
unsigned char* alloc_dyn(unsigned s, unsigned long long shared_mem) {
    const size_t span = (shared_mem + 1023) & ~1023ull;
#ifdef PK_ASAN
    (void)s;
    return static_cast<unsigned char*>(aligned_alloc(1024, span));
#else
    const size_t rw = (span + 4095) & ~size_t(4095), len = rw + 2 * kDynPad;
    if (g_dyn_map_len[s] != len) {
        if (g_dyn_map[s]) munmap(g_dyn_map[s], g_dyn_map_len[s]);
        g_dyn_map_len[s] = 0;
        void* m = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        g_dyn_map[s] = m == MAP_FAILED ? nullptr : static_cast<unsigned char*>(m);
        if (!g_dyn_map[s]) return nullptr;
        if (mprotect(g_dyn_map[s] + kDynPad, rw, PROT_READ | PROT_WRITE) != 0) {
            munmap(g_dyn_map[s], len);
            g_dyn_map[s] = nullptr;
            return nullptr;
        }
        g_dyn_map_len[s] = len;
    }
    return g_dyn_map[s] + kDynPad + rw - span;
#endif
}
bool setup_slot(unsigned s, const pk_launch_cfg* cfg) {
    if (!g_static_arena[s]) g_static_arena[s] = static_cast<unsigned char*>(aligned_alloc(1024, kStaticSmemMax));
    g_dyn[s] = nullptr;
    if (cfg->shared_mem) g_dyn[s] = alloc_dyn(s, cfg->shared_mem);
    if (!g_static_arena[s] || (cfg->shared_mem && !g_dyn[s])) {
        snprintf(g.err, sizeof g.err, "kernel %s: cannot allocate shared memory", g.kernel);
        return false;
    }
#ifdef PK_ASAN
    if (g_dyn[s]) ASAN_POISON_MEMORY_REGION(g_dyn[s] + cfg->shared_mem, ((cfg->shared_mem + 1023) & ~1023ull) - cfg->shared_mem);
#endif
    const unsigned n = g.n;
    Block* k = &g_blocks[s];
    k->threads = &g_threads[s * n];
    k->dyn_smem = g_dyn[s];
    k->static_smem = g_static_arena[s];
    k->active = false;
    k->cl_rank = 0;
    std::memset(k->static_smem, 0xff, kStaticSmemMax);
    for (unsigned i = 0; i < n; i++) {
        Thread& t = k->threads[i];
        t.linear = i;
        t.lane = i & 31;
        t.warp = i >> 5;
        t.blk = k;
        t.tid.x = i % cfg->block[0];
        t.tid.y = (i / cfg->block[0]) % cfg->block[1];
        t.tid.z = i / (cfg->block[0] * cfg->block[1]);
    }
    for (unsigned w = 0; w < (n + 31) / 32; w++) {
        unsigned c = std::min(32u, n - w * 32);
        k->warps[w].existing = c == 32 ? 0xffffffffu : ((1u << c) - 1u);
    }
    return true;
}

// One more resident slot, from the launch loop (every resident block waits on a semaphore).
bool add_slot(const pk_launch_cfg* cfg) {
    const unsigned s = g.slots;
    size_t stack = cfg->stack_bytes ? cfg->stack_bytes : (512u << 10);
    stack = (stack + 4095) & ~size_t(4095);
    if (!ensure_stacks((s + 1) * g.n, stack, g.err, sizeof g.err) || !setup_slot(s, cfg)) {
        g.failed = true;
        return false;
    }
    g.slots = s + 1;
#ifdef PK_RACECHECK
    rc_add_slot(cfg, s, g_dyn[s]);
#endif
    return true;
}

// Every resident block waits on a semaphore and no block can join them: name the first waiter.
void fail_sem_deadlock(bool blocks_left) {
    Buf b{g.err, sizeof g.err};
    for (unsigned s = 0; s < g.slots; s++) {
        const Block* k = &g_blocks[s];
        if (!k->active || k->finished) continue;
        for (unsigned i = 0; i < g.n; i++) {
            const Thread* t = &k->threads[i];
            if (t->state != SEM) continue;
            describe_where(b, t);
            b.add(": deadlock: ");
            describe_state(b, t);
            b.add(blocks_left ? "; %u blocks are resident, the most the host runs at once (the blocks that would "
                                "release it have not started)"
                              : "; every block has started: no block left can release it",
                  g.slots);
            g.failed = true;
            return;
        }
    }
    g.failed = true;
}

// Block number `i` of the launch order (forward, reverse or a seeded permutation).
struct BlockOrder {
    int mode;
    unsigned long long n;
    std::vector<unsigned long long> perm;
    BlockOrder(int schedule, unsigned long long n_blocks, unsigned long long seed) : mode(schedule), n(n_blocks) {
        if (mode == 2) {
            perm.resize(n);
            for (unsigned long long i = 0; i < n; i++) perm[i] = i;
            unsigned long long st = seed ^ 0x6a09e667f3bcc909ull;
            for (unsigned long long i = n - 1; i > 0 && n > 1; i--) std::swap(perm[i], perm[next_rand(st) % (i + 1)]);
        }
    }
    unsigned long long operator[](unsigned long long i) const {
        return mode == 1 ? n - 1 - i : mode == 2 ? perm[i] : i;
    }
};

// Cluster `c` (in cluster-grid order) into the slots, all its CTAs resident at once, as a GPU co-schedules them:
// slot s holds cluster rank s (rank n-1-s under `reverse`, so its last CTA runs first).
void start_cluster(unsigned long long c, const pk_launch_cfg* cfg) {
    const unsigned ncx = cfg->grid[0] / g.cl[0], ncy = cfg->grid[1] / g.cl[1];
    const unsigned cx = static_cast<unsigned>(c % ncx), cy = static_cast<unsigned>((c / ncx) % ncy),
                   cz = static_cast<unsigned>(c / (1ull * ncx * ncy));
    g.cl_phase = 0;
    g.cl_count = 0;
    g.cl_file = nullptr;
    for (unsigned s = 0; s < g.slots; s++) {
        unsigned r = g.schedule == 1 ? g.cl_n - 1 - s : s;
        unsigned rx = r % g.cl[0], ry = (r / g.cl[0]) % g.cl[1], rz = r / (g.cl[0] * g.cl[1]);
        unsigned long long bx = 1ull * cx * g.cl[0] + rx, by = 1ull * cy * g.cl[1] + ry, bz = 1ull * cz * g.cl[2] + rz;
        g_blocks[s].cl_rank = r;
        start_block(&g_blocks[s], bx + cfg->grid[0] * (by + 1ull * cfg->grid[1] * bz), cfg);
    }
}

void run_clusters(const pk_launch_cfg* cfg) {
    unsigned long long n_clusters = g.n_blocks / g.cl_n;
    BlockOrder order(g.schedule, n_clusters, g.seed);
    for (unsigned long long c = 0; c < n_clusters && !g.failed; c++) {
        start_cluster(order[c], cfg);
        while (!g.failed) {
            Thread* t = nullptr;
            for (unsigned s = 0; s < g.slots && !t; s++)
                if (!g_blocks[s].finished) t = pick_in(&g_blocks[s]);
            if (!t) {
                bool open = false;
                for (unsigned s = 0; s < g.slots; s++) open = open || !g_blocks[s].finished;
                if (open) cluster_deadlock(false);
                break;
            }
            gb = nullptr;
            switch_to(nullptr, t, false);
        }
        for (unsigned s = 0; s < g.slots; s++) g_blocks[s].active = false;
    }
}

void run_blocks(const pk_launch_cfg* cfg) {
    if (g.cl_n > 1) {
        run_clusters(cfg);
        return;
    }
    BlockOrder order(g.schedule, g.n_blocks, g.seed);
    unsigned long long next = 0;
    for (unsigned s = 0; s < g.slots; s++) {
        g_blocks[s].active = false;
        if (next < g.n_blocks) start_block(&g_blocks[s], order[next++], cfg);
    }
    while (!g.failed) {
        Thread* t = nullptr;
        for (unsigned s = 0; s < g.slots && !t; s++)
            if (g_blocks[s].active && !g_blocks[s].finished) t = pick_in(&g_blocks[s]);
        if (!t && g.sem_waiting) {  // every resident block waits on a semaphore: the next block joins them
            if (next < g.n_blocks && g.slots < kMaxSlots && add_slot(cfg)) {
                start_block(&g_blocks[g.slots - 1], order[next++], cfg);
                continue;
            }
            if (!g.failed) fail_sem_deadlock(next < g.n_blocks);
            break;
        }
        if (!t) break;
        gb = nullptr;
        switch_to(nullptr, t, false);
        for (unsigned s = 0; s < g.slots && !g.failed; s++) {
            Block* k = &g_blocks[s];
            if (!k->active || !k->finished) continue;
            k->active = false;
            if (next < g.n_blocks) start_block(k, order[next++], cfg);
        }
    }
}

}  // namespace

extern "C" int pkrt_launch(const pk_launch_cfg* cfg, const char* kernel, void (*body)(void*), void* args, char* err,
                           size_t errlen) {
    std::lock_guard<std::mutex> lock(g_mutex);
#ifdef PK_ASAN
    __sanitizer_set_death_callback(report_context);
#endif
    unsigned n = cfg->block[0] * cfg->block[1] * cfg->block[2];
    if (n == 0 || n > kMaxThreads) {
        snprintf(err, errlen, "kernel %s: block (%u,%u,%u) has %u threads, expected 1..%d", kernel, cfg->block[0],
                 cfg->block[1], cfg->block[2], n, kMaxThreads);
        return 1;
    }
    unsigned long long n_blocks = 1ull * cfg->grid[0] * cfg->grid[1] * cfg->grid[2];
    unsigned slots = cfg->interleave > 1 ? static_cast<unsigned>(std::min<int>(cfg->interleave, kMaxSlots)) : 1u;
    if (slots > n_blocks) slots = static_cast<unsigned>(n_blocks);
    unsigned cl[3];
    for (int d = 0; d < 3; d++) cl[d] = cfg->cluster[d] ? cfg->cluster[d] : 1u;
    const unsigned cl_n = cl[0] * cl[1] * cl[2];
    if (cl_n > 1) {
        // The launcher checked these for every backend; a direct caller of the runtime gets the same refusal.
        if (cl_n > static_cast<unsigned>(kMaxSlots) || cfg->grid[0] % cl[0] || cfg->grid[1] % cl[1] ||
            cfg->grid[2] % cl[2]) {
            snprintf(err, errlen, "kernel %s: cluster (%u,%u,%u) must divide the grid (%u,%u,%u) and hold at most %d "
                     "blocks", kernel, cl[0], cl[1], cl[2], cfg->grid[0], cfg->grid[1], cfg->grid[2], kMaxSlots);
            return 1;
        }
        slots = cl_n;  // a cluster's CTAs are resident together
    }
    size_t stack = cfg->stack_bytes ? cfg->stack_bytes : (512u << 10);
    stack = (stack + 4095) & ~size_t(4095);
    if (!ensure_stacks(slots * n, stack, err, errlen)) return 1;

    std::memset(&g, 0, offsetof(Launch, err));
    g.err[0] = 0;
    g.kernel = kernel;
    g.body = body;
    g.args = args;
    g.schedule = cfg->schedule;
    g.slots = slots;
    g.seed = cfg->seed;
    g.n = n;
    g.n_blocks = n_blocks;
    g.shared_mem = cfg->shared_mem;
    g.smem_limit = cfg->smem_limit ? cfg->smem_limit : (227ull << 10);
    for (int d = 0; d < 3; d++) g.cl[d] = cl[d];
    g.cl_n = cl_n;
    g.seq = slots <= 1;
    pkrt_interleave = slots > 1;
    g_static_used = 0;
    for (int i = 0; i < kMaxStaticVars; i++) g_static_vars[i].set = false;
    pkrt_block_dim = dim3(cfg->block[0], cfg->block[1], cfg->block[2]);
    pkrt_grid_dim = dim3(cfg->grid[0], cfg->grid[1], cfg->grid[2]);
    for (unsigned s = 0; s < slots; s++)
        if (!setup_slot(s, cfg)) {
            snprintf(err, errlen, "%s", g.err);
            for (unsigned q = 0; q <= s; q++) free_dyn(q);
            return 1;
        }
    gb = nullptr;
#ifdef PK_RACECHECK
    rc_setup(cfg, slots, g_dyn);
#endif

#ifdef PK_SIGNALS
    arm_signals(cfg->watchdog_ms / 1000.0);
    if (sigsetjmp(g_jmp, 1) == 0) {
        g_in_kernel = 1;
        run_blocks(cfg);
    }
    g_in_kernel = 0;
    disarm_signals();
#else
    run_blocks(cfg);
#endif
    g_nguard = 0;  // the next launch registers its own
    int rc = 0;
    if (g.failed) {
        snprintf(err, errlen, "%s", g.err);
        rc = 2;
    }
    pkrt_cur = nullptr;
    pkrt_dyn_smem = nullptr;
    pkrt_static_smem_base = nullptr;
    pkrt_interleave = 0;
    gb = nullptr;
    g.kernel = nullptr;
    for (unsigned s = 0; s < g.slots; s++) free_dyn(s);
    return rc;
}

// Buffers for the sanitizer build: malloc'd here so AddressSanitizer puts redzones
// right after the array's last byte.
extern "C" __attribute__((visibility("default"))) void* pkrt_alloc(size_t n) { return malloc(n ? n : 1); }
extern "C" __attribute__((visibility("default"))) void pkrt_free(void* p) { free(p); }

// ---- guarded staging windows (the host backend's _Staging keeps a process-wide pool of them) ----
// A window is `2 * half` bytes of PROT_NONE address space (MAP_NORESERVE: no memory, no commit
// charge); an argument's copy occupies the read-write pages just below its middle, `boundary`.
extern "C" __attribute__((visibility("default"))) unsigned long long pkrt_guard_reserve(unsigned long long half) {
    void* m = mmap(nullptr, 2 * half, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return m == MAP_FAILED ? 0 : reinterpret_cast<unsigned long long>(m);
}

// Make [boundary - rw_new, boundary) read-write, returning the pages of [boundary - rw_old,
// boundary - rw_new) (when shrinking) to PROT_NONE and to the system. 0 on success, else errno.
extern "C" __attribute__((visibility("default"))) int pkrt_guard_resize(unsigned long long boundary,
                                                                      unsigned long long rw_old,
                                                                      unsigned long long rw_new) {
    char* b = reinterpret_cast<char*>(boundary);
    if (rw_new > rw_old) {
        if (mprotect(b - rw_new, rw_new - rw_old, PROT_READ | PROT_WRITE) != 0) return errno;
    } else if (rw_new < rw_old) {
        void* m = mmap(b - rw_old, rw_old - rw_new, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                       -1, 0);
        if (m == MAP_FAILED) return errno;
    }
    return 0;
}

extern "C" __attribute__((visibility("default"))) void pkrt_guard_release(unsigned long long lo, unsigned long long size) {
    munmap(reinterpret_cast<void*>(lo), size);
}
