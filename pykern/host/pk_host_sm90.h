// pykern host backend: declarations for the Hopper (sm_90a) emulation of kernels_cu/pk_ptx.cuh's
// Hopper section (wgmma, TMA, mbarrier). The state machine is pk_host_sm90.cpp.
#pragma once

// The CUDA driver's tensor map is 128 opaque bytes, 64-byte aligned. On the host, pykern.tensormap
// fills them with pkrt_tmap (its own encoding of the same parameters).
typedef struct alignas(64) CUtensorMap_st { unsigned long long opaque[16]; } CUtensorMap;

#define PKRT_TMAP_MAGIC 0x4d544b50u  // "PKTM"
struct pkrt_tmap {
    unsigned magic;
    unsigned char rank;        // 1..5
    unsigned char elem_bytes;  // 1, 2, 4, 8
    unsigned char swizzle;     // swizzle span in 16-byte units: 0 (none), 2 (32B), 4 (64B), 8 (128B)
    unsigned char oob_nan;     // out-of-bounds load elements: 0 zeros, 1 NaN (float types)
    unsigned long long base;   // global address
    unsigned long long dims[5];     // elements per dimension, innermost first
    unsigned long long strides[5];  // bytes between consecutive indices of dimension d (d >= 1; [0] = elem_bytes)
    unsigned box[5];                // box elements per dimension
    unsigned pad[3];
};
static_assert(sizeof(pkrt_tmap) == 128, "pkrt_tmap is the 128 bytes of a CUtensorMap");

struct pkrt_wgmma_op {
    float* d;            // the thread's N/2 accumulators
    const unsigned* a;   // RS form: the thread's 4 A registers; SS form: nullptr
    unsigned long long desc_a, desc_b;
    int n, dt, ta, tb, scale_d, pad;
};

extern "C" {
unsigned pkrt_smem_window(const void* p, const char* file, int line);
void pkrt_wgmma_fence(void);
void pkrt_wgmma_commit(const char* file, int line);
void pkrt_wgmma_wait(int n, const char* file, int line);
void pkrt_wgmma_issue(pkrt_wgmma_op* op, const char* file, int line);
void pkrt_mbar_init(unsigned long long* bar, unsigned count, const char* file, int line);
void pkrt_mbar_inval(unsigned long long* bar, const char* file, int line);
unsigned long long pkrt_mbar_arrive(unsigned long long* bar, unsigned tx_bytes, int arrive, const char* file, int line);
int pkrt_mbar_wait(unsigned long long* bar, unsigned parity, int block, const char* file, int line);
void pkrt_tma_load(void* dst, const CUtensorMap* map, unsigned long long* bar, int rank, const int* c, const char* file,
                   int line);
void pkrt_tma_store(const CUtensorMap* map, const void* src, int rank, const int* c, const char* file, int line);
void pkrt_bulk_reduce_add_f32(float* dst, const void* src, unsigned bytes, const char* file, int line);
void pkrt_tma_store_commit(void);
void pkrt_tma_store_wait(int n);
// Thread-block clusters (pk_host_sm90.cpp): special registers, DSMEM, barrier.cluster.
enum { PKRT_CL_CTARANK = 0, PKRT_CL_NCTARANK = 1, PKRT_CL_ID_X = 2, PKRT_CL_ID_Y = 3, PKRT_CL_ID_Z = 4 };
unsigned pkrt_cluster_reg(int which);
unsigned pkrt_mapa(const void* p, unsigned rank, const char* file, int line);
void pkrt_dsmem(unsigned addr, void* val, int bytes, int write, const char* file, int line, void* pc);
void pkrt_cluster_arrive(const char* file, int line);
void pkrt_cluster_wait(const char* file, int line);
}
