"""Hopper (sm_90a) wrappers of kernels_cu/pk_ptx.cuh: the PTX ISA's tables written out in Python, and the
host emulation of TMA, mbarrier and wgmma against them and NumPy.

Cross-checked (read, not copied) against CUTLASS/CuTe at NVIDIA/cutlass 7107b05: cute/arch/mma_sm90_desc.hpp
(GmmaDescriptor bit fields: start 0-13, LBO 16-29, SBO 32-45, base offset 49-51, layout 62-63 with
INTERLEAVE=0, B128=1, B64=2, B32=3), cute/atom/mma_traits_sm90_gmma.hpp (CLayout_64xN, ALayout_64x16,
make_gmma_desc's canonical K- and MN-major layouts) and cute/swizzle.hpp (Swizzle<B,M=4,S=3>: bits
[4, 4+B) ^= bits [7, 7+B)); see the comment in pk_ptx.cuh's Hopper section.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import pykern
from pykern.errors import ArgumentError, KernelExecutionError
from pykern.tensormap import make_tensor_map

ROOT = Path(__file__).resolve().parent.parent
SM90_DIR = ROOT / "tests" / "sm90_cu"


@pytest.fixture(autouse=True)
def _sm90_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(SM90_DIR))
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
    monkeypatch.delenv("PYKERN_HOST_SCHEDULE", raising=False)


def launch(name: str, grid: int, block: int, *args: object, shared_mem: int = 0) -> None:
    pykern.launch(name, grid, block, *args, shared_mem=shared_mem, backend="host")


# ---- the PTX ISA's tables, in Python ----------------------------------------------------------------
def wgmma_d_layout(n: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(thread of the warpgroup, accumulator index) -> (row, col) of D (64 x n), PTX ISA wgmma D fragment."""
    out = {}
    for tid in range(128):
        q, lane = divmod(tid, 32)
        g, t = divmod(lane, 4)
        for i in range(n // 2):
            j, v = divmod(i, 4)
            out[tid, i] = (16 * q + g + 8 * (v >> 1), 8 * j + 2 * t + (v & 1))
    return out


def cute_layout(shape: tuple, stride: tuple, coord: tuple) -> int:
    """A CuTe layout (nested shape/stride tuples) at a nested coordinate: the dot product."""
    if isinstance(shape, tuple):
        return sum(cute_layout(s, d, c) for s, d, c in zip(shape, stride, coord))
    return coord * stride


def idx2crd(i: int, shape: tuple) -> tuple:
    """A flat (colexicographic) index -> nested coordinate, as CuTe does."""
    if isinstance(shape, tuple):
        out = []
        for s in shape:
            n = int(np.prod(flat(s)))
            out.append(idx2crd(i % n, s))
            i //= n
        return tuple(out)
    return i


def flat(s: object) -> list:
    return [x for e in s for x in flat(e)] if isinstance(s, tuple) else [s]


def test_wgmma_accumulator_layout_matches_cute_clayout_64xN() -> None:
    for n in (8, 64, 128, 256):
        # cute/atom/mma_traits_sm90_gmma.hpp CLayout_64xN: ((4,8,4),(2,2,N/8)):((128,1,16),(64,8,512)),
        # (thread, value) -> column-major index m + 64 n.
        shape = ((4, 8, 4), (2, 2, n // 8))
        stride = ((128, 1, 16), (64, 8, 512))
        ours = wgmma_d_layout(n)
        for tid in range(128):
            for i in range(n // 2):
                idx = cute_layout(shape, stride, (idx2crd(tid, shape[0]), idx2crd(i, shape[1])))
                assert ours[tid, i] == (idx % 64, idx // 64), (n, tid, i)
        assert sorted(ours.values()) == [(r, c) for r in range(64) for c in range(n)]  # each element once


def test_wgmma_register_a_layout_matches_cute_alayout_64x16() -> None:
    shape, stride = ((4, 8, 4), (2, 2, 2)), ((128, 1, 16), (64, 8, 512))
    for tid in range(128):
        q, lane = divmod(tid, 32)
        g, t = divmod(lane, 4)
        for v in range(8):
            row, col = 16 * q + g + 8 * ((v >> 1) & 1), 2 * t + (v & 1) + 8 * (v >> 2)
            idx = cute_layout(shape, stride, (idx2crd(tid, shape[0]), idx2crd(v, shape[1])))
            assert (row, col) == (idx % 64, idx // 64)


def test_wgmma_e4m3_register_a_layout_matches_cute_alayout_64x32() -> None:
    # pk_wgmma_m64nNk32_e4m3_rs (pk_ptx.cuh, emulated in pk_host_sm90.cpp): a[r] byte e of thread (q, g, t) is row
    # 16q + g + 8 (r & 1), column 4t + e + 16 (r >> 1). CuTe's ALayout_64x32 for 8-bit types
    # (cute/atom/mma_traits_sm90_gmma.hpp): ((4,8,4),(4,2,2)):((256,1,16),(64,8,1024)), value v = 4 r + e.
    shape, stride = ((4, 8, 4), (4, 2, 2)), ((256, 1, 16), (64, 8, 1024))
    seen = set()
    for tid in range(128):
        q, lane = divmod(tid, 32)
        g, t = divmod(lane, 4)
        for r in range(4):
            for e in range(4):
                row, col = 16 * q + g + 8 * (r & 1), 4 * t + e + 16 * (r >> 1)
                idx = cute_layout(shape, stride, (idx2crd(tid, shape[0]), idx2crd(4 * r + e, shape[1])))
                assert (row, col) == (idx % 64, idx // 64), (tid, r, e)
                seen.add((row, col))
    assert len(seen) == 64 * 32  # each element of the 64 x 32 tile once

def desc_fields(desc: int) -> dict[str, int]:
    """The PTX ISA's wgmma matrix-descriptor format (and CuTe's GmmaDescriptor bitfield)."""
    return {"start": (desc & 0x3FFF) << 4, "lbo": ((desc >> 16) & 0x3FFF) << 4, "sbo": ((desc >> 32) & 0x3FFF) << 4,
            "base_offset": (desc >> 49) & 7, "layout": desc >> 62}


def swizzle(off: int, span: int) -> int:
    """cute/swizzle.hpp Swizzle<B,4,3> on a byte offset, B = log2(span / 16)."""
    b = {0: 0, 32: 1, 64: 2, 128: 3}[span]
    return off ^ (((off >> 7) & ((1 << b) - 1)) << 4)


def test_swizzle_tables() -> None:
    # 128B: the 16-byte chunk c of row r (128-byte rows) lands at chunk c ^ (r % 8).
    for r in range(16):
        for c in range(8):
            assert swizzle(r * 128 + c * 16, 128) == r * 128 + ((c ^ (r % 8)) * 16)
    # 64B: rows of 64 bytes, chunk c of row r at c ^ ((r // 2) % 4); 32B: rows of 32 bytes, c ^ ((r // 4) % 2).
    for r in range(16):
        for c in range(4):
            assert swizzle(r * 64 + c * 16, 64) == r * 64 + ((c ^ ((r // 2) % 4)) * 16)
        for c in range(2):
            assert swizzle(r * 32 + c * 16, 32) == r * 32 + ((c ^ ((r // 4) % 2)) * 16)


# A kernel evaluating the device-side helpers (pk_wgmma_desc_encode, pk_swizzle_offset) on the host.
_HELPERS = r'''
#include "pk_ptx.cuh"
extern "C" __global__ void pk_t_sm90_helpers(const unsigned* in, unsigned long long* desc, unsigned* swz, int n) {
    int i = threadIdx.x;
    if (i < n) {
        desc[i] = pk_wgmma_desc_encode(in[5 * i], in[5 * i + 1], in[5 * i + 2], (int)in[5 * i + 3], in[5 * i + 4]);
        desc[n + i] = pk_wgmma_desc_advance(desc[i], 32);
        desc[2 * n + i] = pk_opaque_u64(desc[i] ^ 0x8000000000000001ull);  // the value itself
        desc[3 * n + i] = pk_opaque_u32((unsigned)desc[i] ^ 0x80000001u);  // likewise, 32 bits
        for (int s = 0; s < 4; s++) swz[4 * i + s] = pk_swizzle_offset(in[5 * i], s);
    }
}
'''


def test_descriptor_and_swizzle_helpers_match_the_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "helpers.cu").write_text(_HELPERS)
    monkeypatch.setenv("PYKERN_KERNEL_PATH", f"{SM90_DIR}{os.pathsep}{tmp_path}")
    rng = np.random.default_rng(0)
    n = 32
    rows = np.stack([rng.integers(0, 1 << 18, n) & ~15, rng.integers(0, 1 << 18, n) & ~15,
                     rng.integers(0, 1 << 18, n) & ~15, rng.integers(0, 4, n), rng.integers(0, 8, n)], 1)
    desc = np.zeros(4 * n, np.uint64)
    swz = np.zeros(4 * n, np.uint32)
    launch("pk_t_sm90_helpers", 1, 32, rows.astype(np.uint32).ravel(), desc, swz, n)
    for i, (start, lbo, sbo, lay, base) in enumerate(rows.tolist()):
        f = desc_fields(int(desc[i]))
        assert f == {"start": start, "lbo": lbo, "sbo": sbo, "base_offset": base, "layout": lay}
        assert desc_fields(int(desc[n + i]))["start"] == start + 32
        assert int(desc[2 * n + i]) == int(desc[i]) ^ 0x8000000000000001
        assert int(desc[3 * n + i]) == (int(desc[i]) & 0xFFFFFFFF) ^ 0x80000001
        # pk_ptx's PK_SWIZZLE_* codes are the descriptor's layout codes: 1 = 128B, 2 = 64B, 3 = 32B.
        for code, span in ((0, 0), (1, 128), (2, 64), (3, 32)):
            assert swz[4 * i + code] == swizzle(start, span)


# ---- TMA -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("span", [0, 32, 64, 128])
def test_tma_load_lands_swizzled_and_reads_back(span: int) -> None:
    rows, row_bytes = 16, (span or 64)
    cols = row_bytes // 2
    src = np.arange(40 * 72, dtype=np.uint16).reshape(40, 72)  # box (16 x cols) at the origin
    ld = make_tensor_map(src, (rows, cols), {0: None, 32: "32B", 64: "64B", 128: "128B"}[span], backend="host")
    dst = np.zeros_like(src)
    st = make_tensor_map(dst, (rows, cols), ld.swizzle or None, backend="host")
    raw = np.zeros(rows * row_bytes, np.uint8)
    tile = np.zeros(rows * row_bytes, np.uint8)
    launch("pk_sm90_tma_box", 1, 64, ld, st, raw, tile, rows, row_bytes, {0: 0, 32: 3, 64: 2, 128: 1}[span],
           shared_mem=rows * row_bytes)
    box = src[:rows, :cols].copy()
    np.testing.assert_array_equal(tile.view(np.uint16).reshape(rows, cols), box)
    want = np.zeros(rows * row_bytes, np.uint8)
    flat_box = box.view(np.uint8).ravel()
    for off in range(0, rows * row_bytes, 16):
        want[swizzle(off, span):swizzle(off, span) + 16] = flat_box[off:off + 16]
    np.testing.assert_array_equal(raw, want)
    exp = np.zeros_like(src)
    exp[:rows, :cols] = box
    np.testing.assert_array_equal(dst, exp)  # the TMA store un-swizzles on the way back


@pytest.mark.parametrize("span", [64, 128])
def test_tma_box_past_the_innermost_dim_loads_zeros_and_stores_only_in_bounds(span: int) -> None:
    # A box wider than the map's innermost dim (the sm_90a forward at a head dim below its kernel's: 80 columns
    # under d96's boxes): the load fills the columns past it with zeros and counts the whole box's bytes on the
    # mbarrier (the GPU's complete_tx), the store writes only the in-bounds columns: the row's bytes after them (the
    # next head's columns in a (.., heads, head_dim) array) keep their values.
    rows, row_bytes = 16, span
    cols, inb = row_bytes // 2, row_bytes // 2 - 8  # 24 / 56 columns in bounds (rows of 48 / 112 bytes)
    src = np.arange(40 * inb, dtype=np.uint16).reshape(40, inb)
    ld = make_tensor_map(src, (rows, cols), f"{span}B", backend="host")
    wide = np.full((40, inb + 8), 0xBEEF, np.uint16)  # the store's map covers the first inb columns of each row
    st = make_tensor_map(wide[:, :inb], (rows, cols), f"{span}B", backend="host")
    raw = np.zeros(rows * row_bytes, np.uint8)
    tile = np.zeros(rows * row_bytes, np.uint8)
    launch("pk_sm90_tma_box", 1, 64, ld, st, raw, tile, rows, row_bytes, {64: 2, 128: 1}[span],
           shared_mem=rows * row_bytes)
    want = np.zeros((rows, cols), np.uint16)
    want[:, :inb] = src[:rows]
    np.testing.assert_array_equal(tile.view(np.uint16).reshape(rows, cols), want)
    exp = np.full_like(wide, 0xBEEF)
    exp[:rows, :inb] = src[:rows]
    np.testing.assert_array_equal(wide, exp)


def test_tensor_map_checks_arguments_as_the_driver_does() -> None:
    a = np.zeros((64, 64), ml_dtypes.bfloat16)
    with pytest.raises(ArgumentError, match="box: with a 64B swizzle .* at most 64 bytes"):
        make_tensor_map(a, (8, 64), "64B", backend="host")
    with pytest.raises(ArgumentError, match="box: sizes must be 1..256"):
        make_tensor_map(np.zeros((512, 8), np.float32), (300, 8), backend="host")
    with pytest.raises(ArgumentError, match="strides must be multiples of 16 bytes.*got 24"):
        make_tensor_map(np.zeros((4, 6), np.float32), (2, 4), backend="host")  # row stride 24 bytes
    with pytest.raises(ArgumentError, match="16-byte aligned"):
        make_tensor_map(np.zeros(100, np.float32)[1:65], (16,), backend="host")
    with pytest.raises(ArgumentError, match="1 to 5 dimensions"):
        make_tensor_map(np.zeros((2,) * 6, np.float32), (2,) * 6, backend="host")


# ---- wgmma GEMM tiles ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel,n,dt", [("pk_sm90_gemm_ss_n64_bf16", 64, "bf16"), ("pk_sm90_gemm_ss_n128_f16", 128, "f16"),
                                         ("pk_sm90_gemm_rs_n64_f16", 64, "f16"), ("pk_sm90_gemm_rs_n128_bf16", 128, "bf16")])
def test_wgmma_gemm_tile_equals_numpy(kernel: str, n: int, dt: str) -> None:
    rng = np.random.default_rng(n)
    K = 128
    dtype = ml_dtypes.bfloat16 if dt == "bf16" else np.float16
    a = rng.standard_normal((64, K)).astype(dtype)
    b = rng.standard_normal((n, K)).astype(dtype)
    ma = make_tensor_map(a, (64, 64), "128B", backend="host")
    mb = make_tensor_map(b, (64, 64), "128B", backend="host")
    d = np.full((64, n), np.nan, np.float32)
    launch(kernel, 1, 128, ma, mb, a.view(np.uint16), d, K, shared_mem=8192 + n * 128)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    np.testing.assert_allclose(d, ref, rtol=1e-5, atol=1e-5)


# ---- mbarrier ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["forward", "reverse", "random:7", "random:12345"])
def test_mbarrier_ping_pong_under_every_schedule(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    rounds = 9
    x = np.random.default_rng(1).standard_normal((rounds, 32)).astype(np.float32)
    out = np.zeros(32, np.float32)
    launch("pk_sm90_pingpong", 1, 64, x, out, rounds, 0)
    np.testing.assert_allclose(out, (x * np.arange(1, rounds + 1)[:, None]).sum(0), rtol=1e-6)


def test_racecheck_orders_accesses_through_mbarriers(monkeypatch: pytest.MonkeyPatch) -> None:
    # An arrive releases the warp's earlier shared-memory accesses and a wait past the completed phase acquires
    # them: the ping-pong's slots are reused with no __syncthreads() and no race. A store after the arrive is one.
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    rounds = 9
    x = np.random.default_rng(1).standard_normal((rounds, 32)).astype(np.float32)
    out = np.zeros(32, np.float32)
    launch("pk_sm90_pingpong", 1, 64, x, out, rounds, 0)
    np.testing.assert_allclose(out, (x * np.arange(1, rounds + 1)[:, None]).sum(0), rtol=1e-6)
    with pytest.raises(KernelExecutionError, match=r"pk_sm90_pingpong: racecheck: .*race on static __shared__"):
        launch("pk_sm90_pingpong", 1, 64, x, out, rounds, 1)


# ---- mistakes are reported -------------------------------------------------------------------------------
def _mistake(mode: int) -> np.ndarray:
    src = np.arange(64, dtype=np.float32).reshape(4, 16)
    m = make_tensor_map(src, (1, 16), backend="host")
    out = np.zeros(128, np.float32)
    launch("pk_sm90_mistakes", 1, 128, m, out, mode, shared_mem=4096)
    return out


def test_missing_wgmma_wait_is_reported() -> None:
    with pytest.raises(KernelExecutionError, match=r"wgmma at .*pk_sm90_host\.cu:\d+ never waited for"):
        _mistake(0)


def test_missing_wgmma_fence_is_reported() -> None:
    with pytest.raises(KernelExecutionError, match=r"wgmma.mma_async at .* without pk_wgmma_fence"):
        _mistake(1)


def test_tma_load_never_waited_for_is_reported() -> None:
    with pytest.raises(KernelExecutionError, match=r"TMA load it issued at .*pk_sm90_host\.cu:\d+ was never waited"):
        _mistake(2)


def test_mbarrier_wait_that_cannot_complete_is_a_deadlock_naming_the_bytes() -> None:
    with pytest.raises(KernelExecutionError, match=r"deadlock.*mbarrier .* 0 of 1 arrivals and 64 transaction bytes missing"):
        _mistake(3)


def test_host_arch_refuses_an_sm90a_kernel_on_another_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_80")
    with pytest.raises(ArgumentError, match=r"built only for sm_90a"):
        _mistake(2)


def test_generated_wgmma_header_is_up_to_date() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_wgmma.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


# ---- bulk reduce-add -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["forward", "reverse", "random:7"])
def test_bulk_reduce_add_sums_every_blocks_rounds(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 blocks x 4 rounds of in * (round + 1) into one accumulator: 3 * 10 * in, exact (small integers)
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    n = 96
    x = np.random.default_rng(3).integers(-8, 8, n).astype(np.float32)
    acc = np.full(n, 0.5, np.float32)
    launch("pk_sm90_bulk_red", 3, 64, x, acc, n, 4, 0, shared_mem=2 * n * 4)
    np.testing.assert_array_equal(acc, 0.5 + 30 * x)


def test_bulk_reduce_add_reads_its_source_late_without_the_read_wait() -> None:
    # Without wait_group.read the ops read their buffers at the final wait (the latest a GPU may): ops 0 and 2
    # both add round 2's contents (3 x), ops 1 and 3 round 3's (4 x)
    n = 32
    x = np.arange(1, n + 1, dtype=np.float32)
    acc = np.zeros(n, np.float32)
    launch("pk_sm90_bulk_red", 1, 32, x, acc, n, 4, 1, shared_mem=2 * n * 4)
    np.testing.assert_array_equal(acc, 14 * x)


def test_racecheck_sees_the_bulk_reduce_add_read_of_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    n = 32
    x = np.arange(1, n + 1, dtype=np.float32)
    acc = np.zeros(n, np.float32)
    launch("pk_sm90_bulk_red", 1, 32, x, acc, n, 4, 0, shared_mem=2 * n * 4)
    np.testing.assert_array_equal(acc, 10 * x)
    with pytest.raises(KernelExecutionError, match=r"pk_sm90_bulk_red: racecheck: .*race"):
        launch("pk_sm90_bulk_red", 1, 32, x, acc, n, 4, 2, shared_mem=2 * n * 4)
    with pytest.raises(KernelExecutionError, match=r"16-byte aligned"):
        launch("pk_sm90_bulk_red", 1, 32, x, acc[1:], n - 4, 1, 0, shared_mem=2 * n * 4)


# ---- racecheck through the async proxy -------------------------------------------------------------------------
def _async_races(mode: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.random.default_rng(4).standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    m = make_tensor_map(a, (64, 64), "128B", backend="host")
    out = np.zeros(1024, np.float32)
    launch("pk_sm90_async_races", 1, 256, m, out, mode, shared_mem=8192)
    return a, out


ASYNC_RACES = {
    1: r"thread \(\d+,0,0\) \[warp [0-3] .*write-after-read race through the async proxy on shared memory at window byte "
       r"\d+ \(dynamic\): the wgmma at .*pk_sm90_host\.cu:\d+ \(warpgroup 0\) reads it as an SS operand until a "
       r"pk_wgmma_wait retires it; this thread writes it at .*pk_sm90_host\.cu:\d+",
    2: r"thread \(0,0,0\) .*read-after-write race through the async proxy on dynamic shared memory at byte offset 28: "
       r"the TMA load issued at .*pk_sm90_host\.cu:\d+ has not landed .* when this thread reads it at "
       r".*pk_sm90_host\.cu:\d+",
    3: r"read-after-write race through the async proxy on dynamic shared memory at byte offset \d+: the wgmma at "
       r".*pk_sm90_host\.cu:\d+ \(warpgroup 0\) reads it as an SS operand, but the TMA load issued at "
       r".*pk_sm90_host\.cu:\d+ that writes it has not landed",
    4: r"thread \(1\d\d,0,0\) \[warp [4-7] .*write-after-read race through the async proxy .* the wgmma at "
       r".*pk_sm90_host\.cu:\d+ \(warpgroup 0\)",
    5: r"thread \(128,0,0\) .*read-after-write race through the async proxy on dynamic shared memory at byte offset 512: "
       r"the TMA load issued at .*pk_sm90_host\.cu:\d+ landed, but this thread's warp did not get past the mbarrier "
       r"phase it completed",
}


def test_racecheck_through_the_async_proxy_passes_the_ordered_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # TMA load -> mbarrier waits -> wgmma -> wgmma wait -> a named barrier -> the other warpgroup rewrites the tile
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    a, out = _async_races(0)
    ref = a[:, :16].astype(np.float64) @ a[:8, :16].astype(np.float64).T
    got = np.full((64, 8), np.nan)
    for (tid, i), (r, c) in wgmma_d_layout(8).items():
        got[r, c] = out[tid * 4 + i]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", sorted(ASYNC_RACES))
def test_racecheck_reports_races_through_the_async_proxy(mode: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The plain build runs them (the host's wgmma reads at its wait and the TMA lands at the first wait, so most
    # give the right numbers here); racecheck names the async access and the generic one.
    _async_races(mode)
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    with pytest.raises(KernelExecutionError, match=rf"kernel pk_sm90_async_races: block \(0,0,0\): .*{ASYNC_RACES[mode]}"):
        _async_races(mode)
