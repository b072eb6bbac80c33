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
#include <mutex>
#include <vector>
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

enum State : int { RUN = 0, BAR = 1, WARP = 2, DONE = 3 };

// One pending cp.async of a thread: performed by the wait that covers its group.
struct CpAsync {
    void* dst;
    const void* src;
    int bytes;
    unsigned group;
};

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
    std::vector<CpAsync> cp;  // cp.async copies not yet performed
    unsigned cp_group;        // index of the group the next cp.async joins (= groups committed)
#ifdef PK_USE_UCONTEXT
    ucontext_t uc;
#endif
};

struct Warp {
    unsigned existing;  // lanes that exist in this block (a partial last warp has fewer)
    unsigned waiting;   // lanes parked in some warp-level operation
};

constexpr int kMaxThreads = 1024;

struct Launch {
    const char* kernel;
    void (*body)(void*);
    void* args;
    int schedule;
    unsigned long long seed, rng;
    unsigned n;  // threads per block
    unsigned n_done, n_bar;
    int bar_kind;
    const char* bar_file;
    int bar_line;
    Thread* bar_mismatch;  // a thread parked at another __syncthreads than bar_file:bar_line
    unsigned bar_pred_count;
    unsigned order[kMaxThreads];
    unsigned pos_of[kMaxThreads];
    uint64_t runnable[kMaxThreads / 64];
    Warp warps[kMaxThreads / 32];
    bool failed;
    char err[2048];
};

std::mutex g_mutex;  // one launch at a time per library: the state below is global
Launch g;
Thread g_threads[kMaxThreads];
size_t g_stack_size = 0;
void* g_main_sp = nullptr;
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
    pkrt_cur = reinterpret_cast<pkrt_thread*>(to);
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
        case PKRT_PTX_LDSM_X4: return "pk_ldmatrix_x4";
        case PKRT_PTX_LDSM_X4_T: return "pk_ldmatrix_x4_trans";
        default: return "__reduce_*_sync";
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

void describe_where(Buf& b, const Thread* t) {
    b.add("kernel %s: block (%u,%u,%u): thread (%u,%u,%u) [warp %u lane %u]", g.kernel, pkrt_block_idx.x,
          pkrt_block_idx.y, pkrt_block_idx.z, t->tid.x, t->tid.y, t->tid.z, t->warp, t->lane);
}

void describe_state(Buf& b, const Thread* t) {
    switch (t->state) {
        case DONE: b.add("has exited"); break;
        case BAR: b.add("waits at %s() at %s:%d", bar_name(t->op), t->file, t->line); break;
        case WARP: b.add("waits in %s(mask 0x%08x) at %s:%d", op_name(t->op), t->mask, t->file, t->line); break;
        default: b.add("is runnable"); break;
    }
}

// Record the error and leave the block: control returns to pkrt_launch.
[[noreturn]] void fail_from_fiber() {
    g.failed = true;
    switch_to(cur(), nullptr, true);
    __builtin_unreachable();
}

[[noreturn]] void fail_simple(const char* what) {
    Buf b{g.err, sizeof g.err};
    describe_where(b, cur());
    b.add(": %s", what);
    fail_from_fiber();
}

// Nobody can run and not everyone has exited: explain who waits for whom.
[[noreturn]] void fail_deadlock() {
    Buf b{g.err, sizeof g.err};
    const Thread* waiter = nullptr;
    for (unsigned i = 0; i < g.n && !waiter; i++)
        if (g_threads[i].state == WARP) waiter = &g_threads[i];
    if (waiter) {
        describe_where(b, waiter);
        b.add(": %s(mask 0x%08x) at %s:%d can never complete: ", op_name(waiter->op), waiter->mask, waiter->file,
              waiter->line);
        const Warp& w = g.warps[waiter->warp];
        unsigned need = waiter->mask & w.existing;
        for (unsigned l = 0; l < 32; l++) {
            if (!(need >> l & 1)) continue;
            const Thread& o = g_threads[waiter->warp * 32 + l];
            if (o.state == WARP && o.op == waiter->op && o.mask == waiter->mask) continue;
            b.add("lane %u (thread (%u,%u,%u)) named in the mask ", l, o.tid.x, o.tid.y, o.tid.z);
            if (o.state == DONE) b.add("exited without reaching it");
            else describe_state(b, &o);
            break;
        }
    } else {
        b.add("kernel %s: block (%u,%u,%u): deadlock: no thread can run", g.kernel, pkrt_block_idx.x,
              pkrt_block_idx.y, pkrt_block_idx.z);
    }
    if (g.n_bar) {
        b.add("; %u of %u threads wait at %s() at %s:%d", g.n_bar, g.n, bar_name(g.bar_kind), g.bar_file,
              g.bar_line);
    }
    fail_from_fiber();
}

// ---- scheduling ------------------------------------------------------------------
inline void set_runnable(const Thread* t) {
    unsigned p = g.pos_of[t->linear];
    g.runnable[p >> 6] |= uint64_t(1) << (p & 63);
}
inline void clear_runnable(const Thread* t) {
    unsigned p = g.pos_of[t->linear];
    g.runnable[p >> 6] &= ~(uint64_t(1) << (p & 63));
}

inline unsigned long long next_rand() {  // splitmix64: small, seedable, good enough to permute
    unsigned long long z = (g.rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void make_order() {
    unsigned n = g.n;
    for (unsigned i = 0; i < n; i++) g.order[i] = (g.schedule == 1) ? n - 1 - i : i;
    if (g.schedule == 2)
        for (unsigned i = n - 1; i > 0; i--) std::swap(g.order[i], g.order[next_rand() % (i + 1)]);
    for (unsigned i = 0; i < n; i++) g.pos_of[g.order[i]] = i;
}

// Called by a fiber that may no longer be runnable: continue the lowest-position
// runnable thread (possibly itself), or leave the block when all are done.
void reschedule(bool finished) {
    Thread* self = cur();
    unsigned words = (g.n + 63) / 64;
    for (unsigned w = 0; w < words; w++) {
        if (g.runnable[w]) {
            unsigned p = w * 64 + static_cast<unsigned>(__builtin_ctzll(g.runnable[w]));
            Thread* next = &g_threads[g.order[p]];
            if (next != self) switch_to(self, next, finished);
            return;
        }
    }
    if (g.n_done == g.n) {
        switch_to(self, nullptr, finished);
        return;
    }
    fail_deadlock();
}

// ---- barriers --------------------------------------------------------------------
void release_barrier() {
    if (g.bar_mismatch) {
        Buf b{g.err, sizeof g.err};
        const Thread* t = g.bar_mismatch;
        b.add("kernel %s: block (%u,%u,%u): %s() at %s:%d reached by only part of the block: thread (%u,%u,%u) ",
              g.kernel, pkrt_block_idx.x, pkrt_block_idx.y, pkrt_block_idx.z, bar_name(g.bar_kind), g.bar_file,
              g.bar_line, t->tid.x, t->tid.y, t->tid.z);
        describe_state(b, t);
        b.add(" instead");
        fail_from_fiber();
    }
    int result;
    switch (g.bar_kind) {
        case PKRT_BAR_COUNT: result = static_cast<int>(g.bar_pred_count); break;
        case PKRT_BAR_AND: result = g.bar_pred_count == g.n_bar; break;
        case PKRT_BAR_OR: result = g.bar_pred_count != 0; break;
        default: result = 0;
    }
    if (g.schedule == 2) make_order();  // a fresh permutation for every phase
    for (unsigned i = 0; i < g.n; i++) {
        Thread& t = g_threads[i];
        if (t.state == BAR) {
            t.state = RUN;
            t.result = static_cast<unsigned long long>(result);
            set_runnable(&t);
        }
    }
    g.n_bar = 0;
    g.bar_pred_count = 0;
    g.bar_mismatch = nullptr;
    g.bar_file = nullptr;
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
[[noreturn]] void fail_lane(const Thread* t, const char* what) {
    Buf b{g.err, sizeof g.err};
    describe_where(b, t);
    b.add(": %s", what);
    fail_from_fiber();
}

inline double bf16_value(unsigned bits) {
    unsigned u = (bits & 0xffffu) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Layouts: see the table at the top of kernels_cu/pk_ptx.cuh (PTX ISA, cross-checked with CuTe).
void complete_ptx(Thread* lanes, int op) {
    if (op == PKRT_PTX_MMA_BF16) {
        double A[16][16], B[16][8], C[16][8];
        for (unsigned l = 0; l < 32; l++) {
            const pkrt_mma_frag* f = reinterpret_cast<const pkrt_mma_frag*>(lanes[l].value);
            unsigned gq = l >> 2, tq = l & 3;
            for (unsigned v = 0; v < 8; v++)
                A[gq + 8 * ((v >> 1) & 1)][2 * tq + (v & 1) + 8 * (v >> 2)] = bf16_value(f->a[v >> 1] >> (16 * (v & 1)));
            for (unsigned v = 0; v < 4; v++) {
                B[2 * tq + (v & 1) + 8 * (v >> 1)][gq] = bf16_value(f->b[v >> 1] >> (16 * (v & 1)));
                C[gq + 8 * (v >> 1)][2 * tq + (v & 1)] = f->c[v];
            }
        }
        // bf16 x bf16 products are exact in double; one rounding to fp32 at the end (the
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
    unsigned short M[4][8][8];
    for (unsigned l = 0; l < 32; l++) {
        const pkrt_ldsm_frag* f = reinterpret_cast<const pkrt_ldsm_frag*>(lanes[l].value);
        if (reinterpret_cast<uintptr_t>(f->row) & 15u) {
            char what[256];
            snprintf(what, sizeof what, "%s at %s:%d: row address %p of matrix %u row %u is not 16-byte aligned",
                     op_name(op), lanes[l].file, lanes[l].line, f->row, l >> 3, l & 7);
            fail_lane(&lanes[l], what);
        }
        std::memcpy(M[l >> 3][l & 7], f->row, 16);
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

void cp_async_perform(Thread* t, bool all, unsigned below_group) {
    size_t keep = 0;
    for (size_t i = 0; i < t->cp.size(); i++) {
        CpAsync& c = t->cp[i];
        if (all || c.group < below_group) std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
        else t->cp[keep++] = c;
    }
    t->cp.resize(keep);
}

// Every lane of `need` is parked in the same op with the same mask: compute results.
void complete_warp_op(unsigned warp, unsigned need, const Thread* proto) {
    Thread* lanes = &g_threads[warp * 32];
    int op = proto->op;
    unsigned long long agg = 0;
    if (op >= PKRT_PTX_MMA_BF16) {
        complete_ptx(lanes, op);
    } else if (op == PKRT_BALLOT || op == PKRT_ANY || op == PKRT_ALL) {
        unsigned ballot = 0;
        for (unsigned l = 0; l < 32; l++)
            if ((need >> l & 1) && lanes[l].value) ballot |= 1u << l;
        agg = op == PKRT_BALLOT ? ballot : op == PKRT_ANY ? (ballot != 0) : (ballot == need);
    } else if (op >= PKRT_REDUCE_ADD) {
        bool sgn = proto->arg != 0;
        bool first = true;
        unsigned acc = 0;
        for (unsigned l = 0; l < 32; l++) {
            if (!(need >> l & 1)) continue;
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
            if ((need >> l & 1) && lanes[l].value != proto->value) same = false;
        agg = same ? (static_cast<unsigned long long>(1) << 32) | need : 0;
    }
    for (unsigned l = 0; l < 32; l++) {
        if (!(need >> l & 1)) continue;
        Thread& t = lanes[l];
        if (op >= PKRT_SHFL_IDX && op <= PKRT_SHFL_XOR) {
            int src = shfl_source(op, l, t.arg, t.width);
            // Reading a lane that does not take part is undefined on a GPU: return
            // all-ones bits (NaN for floats) so such a read is visible in results.
            t.result = (need >> src & 1) ? lanes[src].value : ~0ull;
        } else if (op == PKRT_MATCH_ANY) {
            unsigned m = 0;
            for (unsigned k = 0; k < 32; k++)
                if ((need >> k & 1) && lanes[k].value == t.value) m |= 1u << k;
            t.result = m;
        } else {
            t.result = agg;
        }
        t.state = RUN;
        set_runnable(&t);
    }
    g.warps[warp].waiting &= ~need;
}

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
    cp_async_perform(t, true, 0);  // a GPU completes them even if nobody waits
    t->state = DONE;
    clear_runnable(t);
    g.n_done++;
    // Exited threads count as arrived at a barrier, as on the hardware (sm_70+).
    if (g.n_bar && g.n_bar + g.n_done == g.n) release_barrier();
    reschedule(true);
    __builtin_unreachable();
}

// ---- stacks ----------------------------------------------------------------------
bool ensure_stacks(unsigned n, size_t stack_size, char* err, size_t errlen) {
    if (stack_size != g_stack_size) {
        for (int i = 0; i < kMaxThreads; i++) {
            Thread& t = g_threads[i];
            if (t.stack_lo) munmap(t.stack_lo - getpagesize(), t.stack_size + getpagesize());
            t.stack_lo = nullptr;
        }
        g_stack_size = stack_size;
    }
    size_t page = static_cast<size_t>(getpagesize());
    for (unsigned i = 0; i < n; i++) {
        Thread& t = g_threads[i];
        if (t.stack_lo) continue;
        // One guard page below each stack turns a fiber stack overflow into a crash, not corruption.
        void* m = mmap(nullptr, stack_size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (m == MAP_FAILED) {
            snprintf(err, errlen, "cannot map %zu bytes for fiber stacks: %s", stack_size, strerror(errno));
            return false;
        }
        mprotect(m, page, PROT_NONE);
        t.stack_lo = static_cast<char*>(m) + page;
        t.stack_size = stack_size;
    }
    return true;
}

}  // namespace

// ---- entry points used by the emulation header ----------------------------------------
extern "C" int pkrt_barrier(int kind, int pred, const char* file, int line) {
    Thread* t = cur();
    t->state = BAR;
    t->op = kind;
    t->file = file;
    t->line = line;
    clear_runnable(t);
    if (g.n_bar == 0) {
        g.bar_kind = kind;
        g.bar_file = file;
        g.bar_line = line;
    } else if (!g.bar_mismatch && (kind != g.bar_kind || line != g.bar_line || std::strcmp(file, g.bar_file) != 0)) {
        g.bar_mismatch = t;
    }
    g.n_bar++;
    g.bar_pred_count += pred ? 1u : 0u;
    if (g.n_bar + g.n_done == g.n) release_barrier();
    reschedule(false);
    return static_cast<int>(t->result);
}

extern "C" unsigned long long pkrt_warp_op(int op, unsigned mask, unsigned long long value, int arg, int width,
                                           const char* file, int line) {
    Thread* t = cur();
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
    Warp& w = g.warps[t->warp];
    w.waiting |= 1u << t->lane;
    unsigned need = mask & w.existing;
    if ((w.waiting & need) == need) {
        bool match = true;
        const Thread* lanes = &g_threads[t->warp * 32];
        for (unsigned l = 0; l < 32 && match; l++)
            if ((need >> l & 1) && (lanes[l].op != op || lanes[l].mask != mask)) match = false;
        if (match) complete_warp_op(t->warp, need, t);
    }
    reschedule(false);
    return t->result;
}

extern "C" void pkrt_ptx_warp(int op, void* frag, const char* file, int line) {
    Thread* t = cur();
    if (g.warps[t->warp].existing != 0xffffffffu) {
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
    t->cp.push_back(CpAsync{dst, src, bytes, t->cp_group});
}

extern "C" void pkrt_cp_async_commit(void) { cur()->cp_group++; }

extern "C" void pkrt_cp_async_wait(int n, int all) {
    Thread* t = cur();
    unsigned committed = t->cp_group;
    unsigned below = committed > static_cast<unsigned>(n) ? committed - static_cast<unsigned>(n) : 0;
    cp_async_perform(t, all != 0, below);
}

extern "C" unsigned pkrt_activemask(void) {
    Thread* t = cur();
    unsigned m = 0;
    for (unsigned l = 0; l < 32; l++) {
        unsigned i = t->warp * 32 + l;
        if (i < g.n && g_threads[i].state != DONE) m |= 1u << l;
    }
    return m;
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
    fprintf(stderr, "pykern host backend: the report above happened in kernel %s, block (%u,%u,%u)", g.kernel,
            pkrt_block_idx.x, pkrt_block_idx.y, pkrt_block_idx.z);
    if (t) fprintf(stderr, ", thread (%u,%u,%u)", t->tid.x, t->tid.y, t->tid.z);
    fprintf(stderr, "\n");
}
#endif

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
    size_t stack = cfg->stack_bytes ? cfg->stack_bytes : (256u << 10);
    stack = (stack + 4095) & ~size_t(4095);
    if (!ensure_stacks(n, stack, err, errlen)) return 1;

    // The dynamic buffer is exactly as large as asked, so AddressSanitizer sees overruns;
    // it is filled with 0xff (NaN) per block since a GPU leaves it uninitialized.
    unsigned char* smem = nullptr;
    if (cfg->shared_mem) {
        smem = static_cast<unsigned char*>(aligned_alloc(128, (cfg->shared_mem + 127) & ~127ull));
        if (!smem) {
            snprintf(err, errlen, "kernel %s: cannot allocate %llu bytes of dynamic shared memory", kernel,
                     cfg->shared_mem);
            return 1;
        }
#ifdef PK_ASAN
        // aligned_alloc rounded the size up: poison the tail so the real size is the limit.
        ASAN_POISON_MEMORY_REGION(smem + cfg->shared_mem, ((cfg->shared_mem + 127) & ~127ull) - cfg->shared_mem);
#endif
    }
    pkrt_dyn_smem = smem;

    std::memset(&g, 0, offsetof(Launch, err));
    g.err[0] = 0;
    g.kernel = kernel;
    g.body = body;
    g.args = args;
    g.schedule = cfg->schedule;
    g.n = n;
    pkrt_block_dim = dim3(cfg->block[0], cfg->block[1], cfg->block[2]);
    pkrt_grid_dim = dim3(cfg->grid[0], cfg->grid[1], cfg->grid[2]);
    for (unsigned i = 0; i < n; i++) {
        Thread& t = g_threads[i];
        t.linear = i;
        t.lane = i & 31;
        t.warp = i >> 5;
        t.tid.x = i % cfg->block[0];
        t.tid.y = (i / cfg->block[0]) % cfg->block[1];
        t.tid.z = i / (cfg->block[0] * cfg->block[1]);
    }
    for (unsigned w = 0; w < (n + 31) / 32; w++) {
        unsigned k = std::min(32u, n - w * 32);
        g.warps[w].existing = k == 32 ? 0xffffffffu : ((1u << k) - 1u);
    }

    int rc = 0;
    unsigned long long n_blocks = 1ull * cfg->grid[0] * cfg->grid[1] * cfg->grid[2];
    for (unsigned long long b = 0; b < n_blocks && !g.failed; b++) {
        pkrt_block_idx.x = static_cast<unsigned>(b % cfg->grid[0]);
        pkrt_block_idx.y = static_cast<unsigned>((b / cfg->grid[0]) % cfg->grid[1]);
        pkrt_block_idx.z = static_cast<unsigned>(b / (1ull * cfg->grid[0] * cfg->grid[1]));
        if (smem) std::memset(smem, 0xff, cfg->shared_mem);
        g.rng = cfg->seed * 0x2545f4914f6cdd1dull + b;
        make_order();
        g.n_done = g.n_bar = 0;
        g.bar_pred_count = 0;
        g.bar_mismatch = nullptr;
        std::memset(g.runnable, 0, sizeof g.runnable);
        for (unsigned w = 0; w < (n + 31) / 32; w++) g.warps[w].waiting = 0;
        for (unsigned i = 0; i < n; i++) {
            Thread& t = g_threads[i];
            t.state = RUN;
            t.op = -1;
            t.mask = 0;
            t.cp.clear();
            t.cp_group = 0;
            init_fiber(&t);
            set_runnable(&t);
        }
        switch_to(nullptr, &g_threads[g.order[0]], false);
    }
    if (g.failed) {
        snprintf(err, errlen, "%s", g.err);
        rc = 2;
    }
    pkrt_cur = nullptr;
    pkrt_dyn_smem = nullptr;
    g.kernel = nullptr;
    free(smem);
    return rc;
}

// Buffers for the sanitizer build: malloc'd here so AddressSanitizer puts redzones
// right after the array's last byte.
extern "C" __attribute__((visibility("default"))) void* pkrt_alloc(size_t n) { return malloc(n ? n : 1); }
extern "C" __attribute__((visibility("default"))) void pkrt_free(void* p) { free(p); }
