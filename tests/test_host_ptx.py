"""PTX wrappers (kernels_cu/pk_ptx.cuh): host emulation against the PTX ISA's lane tables, NVRTC + SASS."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pykern
from pykern.errors import CompileError, KernelExecutionError
from host_kernel_helpers import HOST_KERNELS, _host_kernels, launch  # noqa: F401 (an autouse fixture)


# ---- the PTX ISA's fragment tables, written out per register (g = lane // 4, t = lane % 4) ----
def isa_a(lane: int) -> list[tuple[int, int]]:
    """mma.m16n8k16 .bf16 A fragment: (row, col) of a0..a7."""
    g, t = divmod(lane, 4)
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
            (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]


def isa_b(lane: int) -> list[tuple[int, int]]:
    """B fragment: (k, n) of b0..b3."""
    g, t = divmod(lane, 4)
    return [(2 * t, g), (2 * t + 1, g), (2 * t + 8, g), (2 * t + 9, g)]


def isa_c(lane: int) -> list[tuple[int, int]]:
    """C/D fragment: (row, col) of c0..c3."""
    g, t = divmod(lane, 4)
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def cute_layout(shape: list[int], stride: list[int], thr: int, val: int, n_thr_modes: int = 2) -> int:
    """Evaluate a flat CuTe layout ((thr modes), (val modes)) -> linear index (colexicographic)."""
    idx, coords = 0, []
    for x, sizes in ((thr, shape[:n_thr_modes]), (val, shape[n_thr_modes:])):
        for s in sizes:
            coords.append(x % s)
            x //= s
    for c, d in zip(coords, stride):
        idx += c * d
    return idx


def test_isa_tables_agree_with_cute_sm80_traits() -> None:
    # CuTe SM80_16x8x16_F32BF16BF16F32_TN (mma_traits_sm80.hpp): (T32,V) -> column-major (M,K)/(N,K)/(M,N).
    for lane in range(32):
        for v in range(8):
            i = cute_layout([4, 8, 2, 2, 2], [32, 1, 16, 8, 128], lane, v)
            assert isa_a(lane)[v] == (i % 16, i // 16)
        for v in range(4):
            i = cute_layout([4, 8, 2, 2], [16, 1, 8, 64], lane, v)
            k, n = isa_b(lane)[v]
            assert (n, k) == (i % 8, i // 8)
            i = cute_layout([4, 8, 2, 2], [32, 1, 16, 8], lane, v)
            assert isa_c(lane)[v] == (i % 16, i // 16)


def test_ldmatrix_table_agrees_with_cute_sm75_traits() -> None:
    # SM75_U32x4_LDSM_N DstLayout (32,(32,4)):(32,(1,1024)) and SM75_U16x8_LDSM_T
    # ((4,8),(16,2,4)):((256,16),(1,128,1024)), both over the bits of four 8x8 b16 matrices.
    for lane in range(32):
        g, t = divmod(lane, 4)
        for reg in range(4):
            for half in range(2):
                bit = cute_layout([32, 32, 4], [32, 1, 1024], lane, 16 * half + 32 * reg, n_thr_modes=1)
                m, r, c = bit // 1024, (bit % 1024) // 128, (bit % 128) // 16
                assert (m, r, c) == (reg, g, 2 * t + half)
                bit = cute_layout([4, 8, 16, 2, 4], [256, 16, 1, 128, 1024], lane, 16 * half + 32 * reg)
                m, r, c = bit // 1024, (bit % 1024) // 128, (bit % 128) // 16
                assert (m, r, c) == (reg, 2 * t + half, g)  # .trans: the stored matrix's transpose


# ---- cvt.rn.bf16x2.f32 -----------------------------------------------------------------------
def bf16_rne(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, round to nearest even, NaN -> canonical 0x7fff (PTX cvt)."""
    out = []
    for u in x.view(np.uint32).tolist():
        if (u & 0x7FFFFFFF) > 0x7F800000:
            out.append(0x7FFF)
            continue
        hi, lo = u >> 16, u & 0xFFFF
        if lo > 0x8000 or (lo == 0x8000 and hi & 1):
            hi += 1
        out.append(hi & 0xFFFF)
    return np.array(out, np.uint32)


def test_cvt_bf16x2_bit_exact() -> None:
    rng = np.random.default_rng(1)
    specials = np.array(
        [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, -1e-45, 1.17549435e-38],
        np.float32,
    )
    ties = (np.array([0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0x7F7F8000, 0xFF7FFFFF, 0x7FC00001,
                      0xFFFFFFFF, 0x7F800001, 0x00008000, 0x00018000], np.uint32)).view(np.float32)
    lo = np.concatenate([specials, ties, rng.standard_normal(200).astype(np.float32) * 100])
    hi = np.roll(lo, 7)
    out = np.zeros(lo.size, np.uint32)
    launch("pk_t_cvt_bf16x2", 2, 128, lo, hi, out, lo.size)
    np.testing.assert_array_equal(out & 0xFFFF, bf16_rne(lo))
    np.testing.assert_array_equal(out >> 16, bf16_rne(hi))
    assert (out[6] & 0xFFFF) == 0x7FFF  # NaN -> canonical NaN in the low half


# ---- ld.relaxed.gpu.global.v4.b32 (16-bit partials of decode_tc's split tail) --------------------------------
def test_ld_relaxed_b128_reads_16_bytes_in_element_order() -> None:
    # Thread t's 8 16-bit elements at src + 8 t: word i holds elements 2 i (low half) and 2 i + 1 (high).
    src = np.arange(0x1000, 0x1000 + 8 * 32, dtype=np.uint16)
    out = np.zeros(4 * 32, np.uint32)
    launch("pk_t_ld_relaxed_b128", 1, 32, src, out)
    np.testing.assert_array_equal(out, src.view(np.uint32))
    assert out[0] == 0x10011000


@pytest.mark.parametrize("sched", ["forward", "reverse", "interleave", "interleave:4"])
def test_ld_relaxed_b128_acq_rel_ticket_racecheck_clean(sched: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # decode_tc.cu's tail with bf16 partials: 16-byte stores, a barrier, thread 0's acq_rel ticket; the last
    # block's 16-byte strong loads (each word a relaxed access) of every block. Right under every schedule,
    # racecheck-clean, the ticket back at 0 for the next launch.
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", sched)
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    nb, nt = 5, 16
    x = np.arange(1, nb + 1, dtype=np.float32)  # elements x + 0 .. 127: integers below 256, exact in bf16
    ticket = np.zeros(1, np.uint32)
    e = np.arange(8 * nt, dtype=np.float64)
    want = (x.astype(np.float64)[:, None] + e[None, :]).sum(axis=0)  # every value exact in bf16 and in the sum
    for _ in range(2):
        out = np.zeros(8 * nt, np.float32)
        launch("pk_t_ticket_b128", nb, nt, np.zeros(8 * nb * nt, np.uint16), ticket, out, x)
        np.testing.assert_array_equal(out, want.astype(np.float32))
        assert ticket[0] == 0, sched


# ---- ex2.approx.ftz.f32 ------------------------------------------------------------------------
def test_ex2_approx_special_cases_and_accuracy() -> None:
    x = np.concatenate([
        np.array([0.0, -0.0, 1e-40, -1e-40, np.inf, -np.inf, np.nan, 128.0, -126.0, -127.5, -149.0, -200.0],
                 np.float32),
        np.linspace(-20, 20, 101, dtype=np.float32),
    ])
    out = np.zeros_like(x)
    launch("pk_t_ex2", 1, 128, x, out, x.size)
    assert out[0] == 1 and out[1] == 1
    assert out[2] == 1 and out[3] == 1  # subnormal inputs count as zero (.ftz)
    assert out[4] == np.inf and out[5] == 0 and np.isnan(out[6])
    assert out[7] == np.inf
    assert out[8] == np.float32(2.0**-126)
    assert out[9] == 0 and out[10] == 0 and out[11] == 0  # subnormal results flush to +0
    ref = np.exp2(x[12:].astype(np.float64))
    np.testing.assert_allclose(out[12:], ref, rtol=2.0**-22)


# ---- mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 ---------------------------------------
def bf16_bits(m: np.ndarray) -> np.ndarray:
    return (m.astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)  # exact: inputs are bf16 values


def pack_mma(A: np.ndarray, B: np.ndarray, C: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a, b, c = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.float32)
    Ab, Bb = bf16_bits(A), bf16_bits(B)
    for lane in range(32):
        for v, (r, col) in enumerate(isa_a(lane)):
            a[lane, v // 2] |= Ab[r, col] << (16 * (v % 2))  # lower index in the lower half
        for v, (k, n) in enumerate(isa_b(lane)):
            b[lane, v // 2] |= Bb[k, n] << (16 * (v % 2))
        for v, (r, col) in enumerate(isa_c(lane)):
            c[lane, v] = C[r, col]
    return a, b, c


def unpack_d(d: np.ndarray) -> np.ndarray:
    D = np.full((16, 8), np.nan, np.float32)
    for lane in range(32):
        for v, (r, col) in enumerate(isa_c(lane)):
            D[r, col] = d[lane, v]
    return D


def bf16_round(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return (bf16_rne(x.ravel()) << 16).astype(np.uint32).view(np.float32).reshape(x.shape)


def test_mma_m16n8k16_bf16_layout_and_values() -> None:
    rng = np.random.default_rng(5)
    warps = 2
    As = [bf16_round(rng.standard_normal((16, 16))).reshape(16, 16) for _ in range(warps)]
    Bs = [bf16_round(rng.standard_normal((16, 8))).reshape(16, 8) for _ in range(warps)]
    Cs = [rng.standard_normal((16, 8)).astype(np.float32) for _ in range(warps)]
    # Warp 1 gets a structured A so a wrong row/column mapping cannot cancel out.
    As[1] = bf16_round(np.arange(256, dtype=np.float64).reshape(16, 16) / 8 - 7)
    packed = [pack_mma(A, B, C) for A, B, C in zip(As, Bs, Cs)]
    a = np.concatenate([p[0] for p in packed]).ravel()
    b = np.concatenate([p[1] for p in packed]).ravel()
    c = np.concatenate([p[2] for p in packed]).ravel()
    d = np.zeros(warps * 32 * 4, np.float32)
    launch("pk_t_mma", 1, 32 * warps, a, b, c, d)
    for w in range(warps):
        D = unpack_d(d.reshape(warps, 32, 4)[w])
        ref = As[w].astype(np.float64) @ Bs[w].astype(np.float64) + Cs[w]
        np.testing.assert_allclose(D, ref, rtol=1e-6, atol=1e-6)


def pack_mma_f16(A: np.ndarray, B: np.ndarray, C: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The PTX ISA's m16n8k16 fragments with .f16 elements: the same lane tables as .bf16 (isa_a / isa_b /
    isa_c), each .f16x2 register holding the lower-indexed element in its low half."""
    a, b, c = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.float32)
    Ah, Bh = (m.astype(np.float16).view(np.uint16).astype(np.uint32) for m in (A, B))
    for lane in range(32):
        for v, (r, col) in enumerate(isa_a(lane)):
            a[lane, v // 2] |= Ah[r, col] << (16 * (v % 2))
        for v, (k, n) in enumerate(isa_b(lane)):
            b[lane, v // 2] |= Bh[k, n] << (16 * (v % 2))
        for v, (r, col) in enumerate(isa_c(lane)):
            c[lane, v] = C[r, col]
    return a, b, c


def test_f16_fragments_are_the_bf16_tables_in_cute_too() -> None:
    # CuTe mma_traits_sm80.hpp: MMA_Traits<SM80_16x8x16_F32F16F16F32_TN> and <..._F32BF16BF16F32_TN> both
    # derive from MMA_Traits<SM80_16x8x16_F16F16F16F16_TN> (ALayout ((4,8),(2,2,2)):((32,1),(16,8,128)),
    # BLayout ((4,8),(2,2)):((16,1),(8,64)), CLayout SM80_16x8_Row): the layouts checked above serve .f16.
    # Here the .f16 packing itself: f16 bits of a known matrix land where isa_a / isa_b say.
    A = np.arange(256, dtype=np.float64).reshape(16, 16) / 4 - 30
    a, _, _ = pack_mma_f16(A, np.zeros((16, 8)), np.zeros((16, 8)))
    for lane in range(32):
        for v, (r, col) in enumerate(isa_a(lane)):
            half = (int(a[lane, v // 2]) >> (16 * (v % 2))) & 0xFFFF
            assert np.uint16(half).view(np.float16) == A[r, col]


@pytest.mark.parametrize("warps", [1, 2])
def test_mma_m16n8k16_f16_layout_and_values(warps: int) -> None:
    rng = np.random.default_rng(7)
    As = [rng.standard_normal((16, 16)).astype(np.float16).astype(np.float64) for _ in range(warps)]
    Bs = [rng.standard_normal((16, 8)).astype(np.float16).astype(np.float64) for _ in range(warps)]
    Cs = [rng.standard_normal((16, 8)).astype(np.float32) for _ in range(warps)]
    # Warp 0: a structured A (a wrong row/column mapping cannot cancel out), f16 values that bf16 cannot
    # hold (11 significant bits: read as bf16 words they would be different numbers), a subnormal and
    # 65504 (f16's largest finite value) times a small B entry.
    As[0] = (np.arange(256, dtype=np.float64).reshape(16, 16) / 8 - 7) * (1 + 2.0**-10)
    As[0][3, 5], As[0][12, 9] = 2.0**-24 * 3, 65504.0
    Bs[0][9, 2] = 2.0**-10
    As[0] = As[0].astype(np.float16).astype(np.float64)
    packed = [pack_mma_f16(A, B, C) for A, B, C in zip(As, Bs, Cs)]
    a = np.concatenate([p[0] for p in packed]).ravel()
    b = np.concatenate([p[1] for p in packed]).ravel()
    c = np.concatenate([p[2] for p in packed]).ravel()
    d = np.zeros(warps * 32 * 4, np.float32)
    launch("pk_t_mma_t", 1, 32 * warps, a, b, c, d, 1)
    for w in range(warps):
        D = unpack_d(d.reshape(warps, 32, 4)[w])
        ref = As[w] @ Bs[w] + Cs[w]  # f16 products are exact in float64; one fp32 rounding
        np.testing.assert_allclose(D, ref.astype(np.float32), rtol=1e-6, atol=1e-6)
    # the template's bf16 branch is the bf16 instruction: the same words read as bf16 differ
    d_bf = np.zeros_like(d)
    launch("pk_t_mma_t", 1, 32 * warps, a, b, c, d_bf, 0)
    assert not np.allclose(d_bf, d)


def test_mma_needs_a_full_warp() -> None:
    z4, z2 = np.zeros(48 * 4, np.uint32), np.zeros(48 * 2, np.uint32)
    with pytest.raises(KernelExecutionError, match="pk_mma_m16n8k16_bf16.*full warp"):
        launch("pk_t_mma", 1, 48, z4, z2, np.zeros(48 * 4, np.float32), np.zeros(48 * 4, np.float32))


# ---- mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 (sm_89+) ------------------------------------
def isa_a_k32(lane: int) -> list[tuple[int, int]]:
    """mma.m16n8k32 .e4m3 A fragment (PTX ISA, "Matrix Fragments for mma.m16n8k32"): (row, col) of a0..a15,
    a_i in byte i % 4 of register i // 4."""
    g, t = divmod(lane, 4)
    return [(g + 8 * ((i >> 2) & 1), 4 * t + (i & 3) + 16 * (i >> 3)) for i in range(16)]


def isa_b_k32(lane: int) -> list[tuple[int, int]]:
    """m16n8k32 .e4m3 B fragment: (k, n) of b0..b7, b_i in byte i % 4 of register i // 4."""
    g, t = divmod(lane, 4)
    return [(4 * t + (i & 3) + 16 * (i >> 2), g) for i in range(8)]


def test_k32_tables_agree_with_cute_sm89_traits() -> None:
    # CuTe cute/atom/mma_traits_sm89.hpp, SM89_16x8x32_F32E4M3E4M3F32_TN (its layouts are those of
    # SM80_16x8x32_S32S8S8S32_TN): ALayout ((4,8),(4,2,2)):((64,1),(16,8,256)) over column-major (M=16, K=32),
    # BLayout ((4,8),(4,2)):((32,1),(8,128)) over (N=8, K=32), CLayout SM80_16x8_Row (isa_c, checked above).
    for lane in range(32):
        for v in range(16):
            i = cute_layout([4, 8, 4, 2, 2], [64, 1, 16, 8, 256], lane, v)
            assert isa_a_k32(lane)[v] == (i % 16, i // 16)
        for v in range(8):
            i = cute_layout([4, 8, 4, 2], [32, 1, 8, 128], lane, v)
            k, n = isa_b_k32(lane)[v]
            assert (n, k) == (i % 8, i // 8)
    # In bytes the k32 fragments are the bf16 k16 ones: register r of a lane covers the bytes that register r
    # of the m16n8k16 fragment does (element 2j of a bf16 pair = bytes 4t+2j.., one k32 column per byte).
    for lane in range(32):
        for r in range(4):
            rows16 = {isa_a(lane)[2 * r][0]}
            bytes16 = {2 * isa_a(lane)[2 * r][1] + x for x in range(4)}
            assert {isa_a_k32(lane)[4 * r + x][0] for x in range(4)} == rows16
            assert {isa_a_k32(lane)[4 * r + x][1] for x in range(4)} == bytes16


def pack_mma_e4m3(A: np.ndarray, B: np.ndarray, C: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import ml_dtypes

    a, b, c = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.float32)
    Ab = A.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.uint32)
    Bb = B.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.uint32)
    for lane in range(32):
        for v, (r, col) in enumerate(isa_a_k32(lane)):
            a[lane, v // 4] |= Ab[r, col] << (8 * (v % 4))  # lowest index in the lowest byte
        for v, (k, n) in enumerate(isa_b_k32(lane)):
            b[lane, v // 4] |= Bb[k, n] << (8 * (v % 4))
        for v, (r, col) in enumerate(isa_c(lane)):
            c[lane, v] = C[r, col]
    return a, b, c


@pytest.mark.parametrize("warps", [1, 2])
def test_mma_m16n8k32_e4m3_layout_and_values(warps: int) -> None:
    import ml_dtypes

    rng = np.random.default_rng(11)
    e4m3 = ml_dtypes.float8_e4m3fn
    As = [(rng.standard_normal((16, 32)) * 4).astype(e4m3).astype(np.float64) for _ in range(warps)]
    Bs = [(rng.standard_normal((32, 8)) * 4).astype(e4m3).astype(np.float64) for _ in range(warps)]
    Cs = [rng.standard_normal((16, 8)).astype(np.float32) for _ in range(warps)]
    # Warp 0: a structured A (every (row, col) distinct, so a wrong mapping cannot cancel out) with e4m3's
    # largest finite value (448) and smallest subnormal (2^-9), and a B with one non-zero per column.
    As[0] = (np.arange(512, dtype=np.float64).reshape(16, 32) / 16 - 12).astype(e4m3).astype(np.float64)
    As[0][2, 30], As[0][13, 17] = 448.0, 2.0**-9
    Bs[0] = np.zeros((32, 8))
    for n in range(8):
        Bs[0][(5 * n + 3) % 32, n] = float(n + 1) / 2
    Bs[0][17, 6] = 256.0  # with A[13, 17] = 2^-9: the subnormal's product
    packed = [pack_mma_e4m3(A, B, C) for A, B, C in zip(As, Bs, Cs)]
    a = np.concatenate([p[0] for p in packed]).ravel()
    b = np.concatenate([p[1] for p in packed]).ravel()
    c = np.concatenate([p[2] for p in packed]).ravel()
    d = np.zeros(warps * 32 * 4, np.float32)
    launch("pk_t_mma_e4m3", 1, 32 * warps, a, b, c, d)
    for w in range(warps):
        D = unpack_d(d.reshape(warps, 32, 4)[w])
        ref = As[w] @ Bs[w] + Cs[w]  # e4m3 products and their sums are exact in float64; one fp32 rounding
        np.testing.assert_array_equal(D, ref.astype(np.float32))


# ---- ldmatrix -----------------------------------------------------------------------------------
@pytest.mark.parametrize("trans", [0, 1])
def test_ldmatrix_x4_lane_mapping(trans: int) -> None:
    tile = (np.arange(32 * 8, dtype=np.uint32) * 37 + 11).astype(np.uint16)  # shared rows 0..31, 8 b16 each
    rowsel = np.random.default_rng(trans).permutation(32).astype(np.int32)  # lane l addresses shared row rowsel[l]
    out = np.zeros(32 * 4, np.uint32)
    launch("pk_t_ldmatrix", 1, 32, tile, rowsel, out, trans, 0)
    rows = tile.reshape(32, 8)
    # ISA: threads 8i..8i+7 give the addresses of rows 0..7 of matrix i.
    mats = np.stack([np.stack([rows[rowsel[8 * i + r]] for r in range(8)]) for i in range(4)])
    got = out.reshape(32, 4)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(4):
            m = mats[i].T if trans else mats[i]
            expect = int(m[g, 2 * t]) | (int(m[g, 2 * t + 1]) << 16)
            assert got[lane, i] == expect, (lane, i)


@pytest.mark.parametrize("pattern, per_phase", [("rows", 1), ("stride64", 4), ("stride128", 4), ("broadcast", 1)])
def test_ldmatrix_bank_model_counts_wavefronts(pattern: str, per_phase: int) -> None:
    # The host's bank model of ldmatrix: a matrix (8 lanes' 16-byte rows) is one phase; its wavefronts are the
    # most distinct 4-byte words one bank (word mod 32) delivers. Shared rows here are 16 bytes: 8 consecutive
    # rows are 128 bytes (every bank once); rows 4 apart (64 bytes) put rows 0, 2, 4, 6 of a matrix in the same
    # banks (4 words a bank); rows 8 apart (128 bytes; 4 distinct rows of the 32, each read by 2 lanes) the same;
    # one row for all 8 lanes is one broadcast.
    from pykern.backends.host import ldmatrix_bank_stats

    lanes = np.arange(32)
    rowsel = {"rows": lanes, "stride64": (lanes % 8) * 4 + lanes // 8, "stride128": (lanes % 4) * 8 + lanes // 8,
              "broadcast": lanes // 8}[pattern].astype(np.int32)
    tile = np.arange(32 * 8, dtype=np.uint16)
    out = np.zeros(32 * 4, np.uint32)
    launch("pk_t_ldmatrix", 1, 32, tile, rowsel, out, 0, 0)
    ldmatrix_bank_stats(reset=True)
    launch("pk_t_ldmatrix", 1, 32, tile, rowsel, out, 0, 0)
    st = ldmatrix_bank_stats()["ptx"]
    assert (st["phases"], st["wavefronts"], st["worst"]) == (4, 4 * per_phase, per_phase), st
    assert st["worst_at"] is not None and "pk_ptx.cuh" in st["worst_at"], st  # the wrapper's line
    assert ldmatrix_bank_stats()["ptx"]["phases"] == 0  # read with reset: a new count


@pytest.mark.parametrize("pattern, per_phase", [("chunks", 1), ("stride32", 2), ("rows80", 2), ("rows80_q4", 1),
                                                ("stride128", 4), ("broadcast", 1)])
def test_shared_v4_bank_model_counts_wavefronts(pattern: str, per_phase: int) -> None:
    # The host's 16-byte bank model: a quarter-warp (8 lanes' 16-byte chunks) is one phase; its wavefronts are
    # the most distinct 4-byte words one bank delivers. Chunk c is bytes 16 c .. 16 c + 15 of a 512-byte buffer:
    # 8 consecutive chunks are every bank once; chunks 2 apart (a float4 every 32 bytes, the old decode merge)
    # put 2 in each bank group; rows of 80 bytes, 4 chunks a row and two rows a phase (the old FP8 d64 ring fill,
    # here as chunk 5 r + c mod 32) meet in one group, and rows q and q + 4 do not; chunks 8 apart are all in one
    # group (4 distinct chunks of the 32, each for 2 lanes: 4 wavefronts); one chunk for all 8 lanes is one
    # broadcast. Both the cp.async writes and the reads.
    from pykern.backends.host import shared_v4_bank_model, shared_v4_bank_stats

    lanes = np.arange(32)
    q, j = lanes // 8, lanes % 8
    rows80 = lambda r, c: (5 * r + c) % 32  # noqa: E731  (the chunk of row r, chunk c, rows of 80 bytes)
    sel = {"chunks": lanes, "stride32": (2 * j + q) % 32, "rows80": rows80(2 * q + j // 4, j % 4),
           "rows80_q4": rows80(q + 4 * (j // 4), j % 4), "stride128": (8 * j + q) % 32,
           "broadcast": q}[pattern].astype(np.int32)
    src = np.arange(32 * 4, dtype=np.float32)
    out = np.zeros(32 * 4, np.float32)
    launch("pk_t_v4_bank", 1, 32, src, sel, out)  # loads the library
    shared_v4_bank_model(True)
    try:
        shared_v4_bank_stats(reset=True)
        launch("pk_t_v4_bank", 1, 32, src, sel, out)
        st = shared_v4_bank_stats()["ptx"]
    finally:
        shared_v4_bank_model(False)
    last = {int(c): lane for lane, c in enumerate(sel)}  # the lane whose copy landed last in each chunk
    want = np.stack([src.reshape(32, 4)[last[int(c)]] for c in sel]).reshape(-1)
    np.testing.assert_array_equal(out, want)
    assert (st["phases"], st["wavefronts"], st["worst"]) == (8, 8 * per_phase, per_phase), st  # 4 writes, 4 reads
    assert st["worst_at"] is not None and "ptx.cu" in st["worst_at"], st  # the kernel's line, not the wrapper's
    launch("pk_t_v4_bank", 1, 32, src, sel, out)  # the model off: nothing counted
    assert shared_v4_bank_stats()["ptx"]["phases"] == 0


@pytest.mark.parametrize("trans", [0, 1])
def test_ldmatrix_and_cp_async_at_byte_offsets_match_the_pointer_forms(trans: int) -> None:
    tile = (np.arange(32 * 8, dtype=np.uint32) * 53 + 7).astype(np.uint16)
    rowsel = np.random.default_rng(10 + trans).permutation(32).astype(np.int32)
    want, got = np.zeros(32 * 4, np.uint32), np.zeros(32 * 4, np.uint32)
    launch("pk_t_ldmatrix", 1, 32, tile, rowsel, want, trans, 0)
    launch("pk_t_ldmatrix_at", 1, 32, tile, rowsel, got, trans)
    assert want.any()
    np.testing.assert_array_equal(got, want)


def test_ldmatrix_misaligned_row_is_an_error() -> None:
    tile = np.zeros(32 * 8, np.uint16)
    with pytest.raises(KernelExecutionError, match=r"thread \(5,0,0\).*pk_ldmatrix_x4.*16-byte aligned"):
        launch("pk_t_ldmatrix", 1, 32, tile, np.arange(32, dtype=np.int32), np.zeros(128, np.uint32), 0, 1)


# ---- cp.async ---------------------------------------------------------------------------------
def test_cp_async_groups_complete_at_their_wait() -> None:
    n = 64
    src = np.arange(2 * n * 4, dtype=np.float32) + 0.5
    w1, early, full = np.zeros(n * 4, np.float32), np.zeros(n * 4, np.float32), np.zeros(2 * n * 4, np.float32)
    launch("pk_t_cp_async", 1, n, src, w1, early, full, shared_mem=2 * n * 16)
    np.testing.assert_array_equal(w1, src[: n * 4])  # wait_group 1: the older group has landed
    np.testing.assert_array_equal(full, src)
    # The host completes a copy no earlier than the wait that covers it: group 1 still
    # shows the poisoned (NaN) bytes of fresh shared memory, so a missing wait is visible.
    assert np.isnan(early).all()


def test_cp_async_zfill_writes_zeros_and_reads_nothing() -> None:
    src = (np.arange(32 * 4, dtype=np.uint64) * 2654435761 % (2**32)).astype(np.uint32) | 1  # no zero words
    full = (np.arange(32) % 3 != 0).astype(np.int32)
    out = np.zeros(32 * 4, np.uint32)
    launch("pk_t_cp_async_zfill", 1, 32, src, full, out)
    want = np.where(np.repeat(full, 4) != 0, src, 0).astype(np.uint32)
    np.testing.assert_array_equal(out, want)


def _fp8_value(b: int, eb: int) -> float:
    """The value of FP8 byte b (eb = 4: e4m3fn, 5: e5m2), from the format's definition."""
    mb = 7 - eb
    bias = (1 << (eb - 1)) - 1
    s = -1.0 if b & 0x80 else 1.0
    e, m = (b >> mb) & ((1 << eb) - 1), b & ((1 << mb) - 1)
    if eb == 4 and e == 15 and m == 7:
        return float("nan")
    if eb == 5 and e == 31:
        return s * float("inf") if m == 0 else float("nan")
    if e == 0:
        return s * m * 2.0 ** (1 - bias - mb)
    return s * (1 + m / (1 << mb)) * 2.0 ** (e - bias)


@pytest.mark.parametrize("kind", [4, 5])
def test_fp8x4_widening_to_f16x2_and_bf16x2_is_exact(kind: int) -> None:
    # every byte value in every byte position of the word
    b = np.arange(256, dtype=np.uint32)
    words = np.concatenate([b, b << 8, b << 16, b << 24, b | ((255 - b) << 8) | (b << 16) | ((b ^ 0x5A) << 24)])
    words = words.astype(np.uint32)
    n = words.size
    f16, bf16 = np.zeros(2 * n, np.uint32), np.zeros(2 * n, np.uint32)
    launch("pk_t_fp8x4", (n + 127) // 128, 128, words, f16, bf16, n, kind)
    vals = np.array([[_fp8_value((int(w) >> (8 * j)) & 0xFF, kind) for j in range(4)] for w in words])
    got_f16 = np.stack([(f16 >> 0) & 0xFFFF, f16 >> 16], 1).reshape(n, 4).astype(np.uint16).view(np.float16)
    got_bf16 = (np.stack([(bf16 << 16), bf16 & 0xFFFF0000], 1).reshape(n, 4).astype(np.uint32)).view(np.float32)
    for got in (got_f16.astype(np.float64), got_bf16.astype(np.float64)):
        nan = np.isnan(vals)
        assert (np.isnan(got) == nan).all()
        np.testing.assert_array_equal(got[~nan], vals[~nan])
        np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(vals[~nan]))  # -0 stays -0


def test_prmt_selects_bytes_as_the_ptx_isa_says() -> None:
    # prmt.b32 d, a, b, c (default mode): byte i of d is byte c[4i+2 : 4i] of the 8-byte value {b, a}, a in
    # bytes 0..3 (PTX ISA, "prmt"; CUDA's __byte_perm). The selector's bit 3 of each nibble is the sign mode
    # of the other modes, ignored here. decode_tc's FP8 V uses 0x3120 (bytes 0, 2, 1, 3 of a).
    rng = np.random.default_rng(3)
    n = 512
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    sel = rng.integers(0, 2**16, n, dtype=np.uint64).astype(np.uint32)
    sel[:4] = [0x3120, 0x3210, 0x7654, 0x5140]
    out = np.zeros(n, np.uint32)
    launch("pk_t_prmt", (n + 127) // 128, 128, a, b, sel, out, n)
    for i in range(n):
        x = (int(b[i]) << 32) | int(a[i])
        want = sum(((x >> (8 * ((int(sel[i]) >> (4 * j)) & 7))) & 0xFF) << (8 * j) for j in range(4))
        assert int(out[i]) == want, (i, hex(a[i]), hex(b[i]), hex(sel[i]), hex(int(out[i])), hex(want))
    w = int(a[0])
    assert int(out[0]) == (w & 0xFF) | ((w >> 16) & 0xFF) << 8 | ((w >> 8) & 0xFF) << 16 | (w >> 24) << 24


# ---- raw asm on the host ------------------------------------------------------------------------
def test_raw_asm_is_a_host_build_error_naming_the_wrappers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rawasm.cu").write_text(
        'extern "C" __global__ void pk_t_rawasm(float* x) {\n'
        '    float r;\n'
        '    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x[0]));\n'
        "    x[0] = r;\n}\n"
    )
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(tmp_path))
    with pytest.raises(CompileError, match=r"rawasm.cu:3.*pk_ptx.cuh.*pk_mma_m16n8k16_bf16") as err:
        launch("pk_t_rawasm", 1, 1, np.zeros(1, np.float32))
    # the list is read from the header: the FP8 and Hopper wrappers are named too, host-only helpers are not
    named = set(re.findall(r"\bpk_\w+", str(err.value)))
    for w in ("pk_cvt_e4m3x2", "pk_cvt_f32x2_e5m2x2", "pk_wgmma_m64nNk16_ss", "pk_wgmma_m64nNk16_rs", "pk_wgmma_fence",
              "pk_tma_load_4d", "pk_mbarrier_wait_parity", "pk_setmaxnreg_inc", "pk_elect_one", "pk_cp_async_wait",
              "pk_bar_red_and", "pk_bar_sync", "pk_bar_arrive", "pk_bar_arrive_aligned"):
        assert w in named, w
    assert not any(n.startswith("pk_host_") for n in named)


# ---- NVRTC: every wrapper compiles for sm_80 / sm_90 to the expected SASS ------------------------
def _cuobjdump() -> str | None:
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    for base in map(Path, sys.path):
        for cand in (base / "nvidia" / "cu13" / "bin" / "cuobjdump", base / "nvidia" / "cuda_cuobjdump" / "bin" / "cuobjdump"):
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return None


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_every_wrapper_to_tensor_core_sass(arch: str, tmp_path: Path) -> None:
    from pykern import compiler

    try:
        compiler.nvrtc_version()
    except Exception as e:  # noqa: BLE001 - no NVRTC here is a skip, not a failure
        pytest.skip(f"NVRTC unavailable: {e}")
    mod = compiler.compile(HOST_KERNELS / "ptx.cu", arch)
    for kernel, res in mod.resources.items():
        assert res.spill_bytes == 0, (kernel, res)
    ptx = mod.ptx
    for instr in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                  "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                  "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "cp.async.cg.shared.global",
                  "cp.async.commit_group", "cp.async.wait_group 1", "cp.async.wait_all", "cvt.rn.bf16x2.f32",
                  "ex2.approx.ftz.f32", "ld.relaxed.gpu.global.v4.b32", "barrier.cta.red.and.pred",
                  "barrier.cta.red.or.pred", "barrier.cta.sync", "barrier.cta.arrive", "prmt.b32"):
        assert instr in ptx, instr
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed (pip package nvidia-cuda-cuobjdump): SASS not checked")
    cubin = tmp_path / f"ptx_{arch}.cubin"
    cubin.write_bytes(mod.image)
    bindir = str(Path(tool).parent)
    if not (Path(bindir) / "nvdisasm").exists() and shutil.which("nvdisasm") is None:
        pytest.skip("nvdisasm not installed (pip package nvidia-cuda-nvdisasm): cuobjdump -sass needs it")
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True, env=env).stdout
    for op in ("HMMA.16816.F32.BF16", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS", "F2FP.BF16", "MUFU.EX2",
               "BAR.RED.AND", "BAR.RED.OR", "BAR.SYNC", "BAR.ARV", "PRMT"):
        assert op in sass, f"{op} missing from the {arch} SASS"
    if arch == "sm_90":  # pk_t_fp8x4: the FP8 pair conversion is one instruction (sm_89+)
        assert "F2FP.F16.E4M3.UNPACK_B" in sass and "F2FP.F16.E5M2.UNPACK_B" in sass
    # mma .f16 (pk_t_mma_t): HMMA.16816.F32 with no .BF16 suffix
    assert re.search(r"HMMA\.16816\.F32 ", sass), f"HMMA.16816.F32 (f16) missing from the {arch} SASS"


def test_nvrtc_sm75_refuses_mma_clearly() -> None:
    from pykern import compiler

    try:
        compiler.nvrtc_version()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC unavailable: {e}")
    with pytest.raises(CompileError, match="needs sm_80"):
        compiler.compile(HOST_KERNELS / "ptx.cu", "sm_75")


# ---- named barriers (pk_bar_red_and / pk_bar_red_or / pk_bar_sync) ----------------------------------
@pytest.mark.parametrize("schedule", ["forward", "reverse", "random:3"])
def test_named_barrier_reductions_over_a_warpgroup_subset(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 512 threads: warpgroup 0 never arrives, warpgroups 1..3 each reduce over their own 128 threads (barrier 1 +
    # index), warpgroup 3 from two call sites; per round one warpgroup has a single false lane, one all true,
    # one mixed at random.
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    rounds, n = 6, 512
    rng = np.random.default_rng(5)
    pred = np.ones((rounds, n), np.int32)
    for r in range(rounds):
        one = 1 + r % 3                     # a single false thread in warpgroup `one`
        pred[r, 128 * one + int(rng.integers(128))] = 0
        mixed = 1 + (r + 1) % 3             # a random half in another
        pred[r, 128 * mixed:128 * (mixed + 1)] = rng.integers(0, 2, 128)
    pred[rounds - 1, 256:384] = 0           # all false: OR false too
    and_out = np.full((rounds, n), -1, np.int32)
    or_out = np.full((rounds, n), -1, np.int32)
    launch("pk_t_bar_red", 1, n, pred, and_out, or_out, rounds)
    for r in range(rounds):
        for wg in (1, 2, 3):
            p = pred[r, 128 * wg:128 * (wg + 1)]
            np.testing.assert_array_equal(and_out[r, 128 * wg:128 * (wg + 1)], int(p.all()))
            np.testing.assert_array_equal(or_out[r, 128 * wg:128 * (wg + 1)], int(p.any()))
        assert (and_out[r, :128] == -1).all() and (or_out[r, :128] == -1).all()  # warpgroup 0 never arrived
    assert (and_out[:, 128:] == 0).any() and (and_out[:, 128:] == 1).any() and (or_out[:, 128:] == 0).any()


@pytest.mark.parametrize("mode", [0, 4])
def test_named_barrier_orders_its_participants_for_racecheck(mode: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    for schedule in ("forward", "reverse", "random:9"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
        out = np.zeros(256, np.float32)
        launch("pk_t_bar_handoff", 1, 384, out, mode)
        np.testing.assert_array_equal(out, 256 - np.arange(256, dtype=np.float32))


@pytest.mark.parametrize("mode", [1, 2])
def test_named_barrier_of_other_threads_orders_nothing(mode: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # 1: no barrier; 2: warpgroup 1 writes every slot and passes a barrier of its own (128 threads) before
    # warpgroup 2 reads (forward schedule: after that barrier's release): warpgroup 2 took no part, so nothing
    # orders its reads after the writes (a block-wide ordering, as __syncthreads' epoch, would miss this race).
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "forward" if mode == 2 else "reverse")
    race = "read-after-write" if mode == 2 else "(read-after-write|write-after-read)"
    with pytest.raises(KernelExecutionError, match=(
            rf"kernel pk_t_bar_handoff: racecheck: {race} race on static __shared__ .*block \(0,0,0\) thread "
            rf"\(\d+,0,0\) \w+ at .*ptx\.cu:\d+, then block \(0,0,0\) thread \((\d+),0,0\)")) as e:
        launch("pk_t_bar_handoff", 1, 384, np.zeros(256, np.float32), mode)
    if mode == 2:
        assert re.search(r"wrote at .*, then block \(0,0,0\) thread \((2[5-9]\d|3[0-7]\d|38[0-3]),0,0\) read", str(e.value))


def test_named_barrier_with_a_wrong_thread_count_is_reported() -> None:
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pk_t_bar_handoff: .*barrier.sync of named barrier 3 with 224 threads at .*ptx\.cu:\d+, but "
            r"this phase's first arrival was barrier.sync with 256 threads at .*ptx\.cu:\d+")):
        launch("pk_t_bar_handoff", 1, 384, np.zeros(256, np.float32), 3)


def test_named_barrier_that_cannot_complete_is_a_deadlock() -> None:
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pk_t_bar_handoff: block \(0,0,0\): deadlock: .*waits at named barrier 3 \(barrier.sync, 256 "
            r"threads\) at .*ptx\.cu:\d+; 128 of 256 threads arrived at named barrier 3")):
        launch("pk_t_bar_handoff", 1, 384, np.zeros(256, np.float32), 5)


# ---- named barriers: FA3's ping-pong (pk_bar_sync / pk_bar_arrive between two warpgroups) -------------------
def _pingpong_expected(rounds: int) -> np.ndarray:
    me = np.arange(128)
    exp = np.zeros((rounds, 256), np.float32)
    for r in range(rounds):
        # warpgroup 1 sees warpgroup 2's previous turn (nothing in round 0), warpgroup 2 warpgroup 1's this turn
        exp[r, :128] = 0 if r == 0 else 1000 + 10 * (r - 1) + 1 + (127 - me)
        exp[r, 128:] = 10 * r + 1 + (127 - me)
    return exp.reshape(-1)


@pytest.mark.parametrize("mode", [0, 5])
@pytest.mark.parametrize("schedule", ["forward", "reverse", "random:4"])
def test_named_barrier_ping_pong_alternates_two_warpgroups(schedule: str, mode: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Every value read is the other warpgroup's latest turn: the arrivals hand the turn over in order, and racecheck
    # finds every slot's writes ordered with the other warpgroup's reads through the arrive -> sync pairs. mode 5:
    # warpgroup 1 opens its own barrier (an arrival and a wait of the same warps in one phase, legal).
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    rounds = 5
    out = np.full(rounds * 256, -7.0, np.float32)
    launch("pk_t_bar_pingpong", 1, 384, out, rounds, mode)
    np.testing.assert_array_equal(out, _pingpong_expected(rounds))


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_named_barrier_store_after_the_arrive_is_a_race(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The arrival releases only the accesses before it: warpgroup 1's store after it races with warpgroup 2's read.
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pk_t_bar_pingpong: racecheck: (read-after-write|write-after-read) race on static __shared__ "
            r".*thread \((\d+),0,0\) (wrote|read) at .*ptx\.cu:(\d+).*, then .*thread \((\d+),0,0\) (wrote|read) at "
            r".*ptx\.cu:(\d+)")) as e:
        launch("pk_t_bar_pingpong", 1, 384, np.zeros(3 * 256, np.float32), 3, 1)
    m = re.search(r"thread \((\d+),0,0\) (wrote|read) at .*?ptx\.cu:(\d+).*, then .*thread \((\d+),0,0\) (wrote|read) "
                  r"at .*?ptx\.cu:(\d+)", str(e.value))
    accesses = {m[2]: (int(m[1]), int(m[3])), m[5]: (int(m[4]), int(m[6]))}
    src = (HOST_KERNELS / "ptx.cu").read_text().splitlines()
    # the write is warpgroup 1's store after its arrival, the read warpgroup 2's
    assert 128 <= accesses["wrote"][0] < 256 and "after the arrival" in src[accesses["wrote"][1] - 1]
    assert 256 <= accesses["read"][0] < 384 and "slot[1 - w][127 - me]" in src[accesses["read"][1] - 1]


def test_named_barrier_arrive_with_a_wrong_thread_count_is_reported() -> None:
    # Warpgroup 2 waits on barrier 2 with 224 threads while warpgroup 1 arrives there with 256: the GPU would release
    # the phase early or hang; the host names both arrivals, whichever came first.
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pk_t_bar_pingpong: .*named barrier 2 with (224|256) threads at .*ptx\.cu:\d+, but this phase's "
            r"first arrival was barrier\.(sync|arrive) with (256|224) threads at .*ptx\.cu:\d+")):
        launch("pk_t_bar_pingpong", 1, 384, np.zeros(2 * 256, np.float32), 2, 2)


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_named_barrier_whose_warpgroup_never_arrives_is_a_deadlock(schedule: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Warpgroup 2 never opens the game: warpgroup 1 waits on barrier 1 forever, and warpgroup 2 on barrier 2.
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pk_t_bar_pingpong: block \(0,0,0\): deadlock: .*waits at named barrier [12] \(barrier\.sync, 256 "
            r"threads\) at .*ptx\.cu:\d+; 128 of 256 threads arrived at named barrier 1 .*; 128 of 256 threads "
            r"arrived at named barrier 2")):
        launch("pk_t_bar_pingpong", 1, 384, np.zeros(2 * 256, np.float32), 2, 3)


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_named_barrier_arrive_twice_in_one_phase_is_reported(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pk_t_bar_pingpong: .*barrier\.arrive of named barrier 1 at .*ptx\.cu:\d+: warp (8|9|10|11) "
            r"arrives a second time in one phase \(it arrived at .*ptx\.cu:\d+; \d+ of 256 threads have arrived\)")):
        launch("pk_t_bar_pingpong", 1, 384, np.zeros(2 * 256, np.float32), 2, 4)


# ---- NVRTC: mma .e4m3 (sm_89+) -----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_120"])
def test_nvrtc_mma_e4m3_sass(arch: str, tmp_path: Path) -> None:
    # sm_89 / sm_120 run it on the FP8 tensor core (QMMA.16832.F32.E4M3.E4M3); sm_90 has no FP8 mma.sync (its
    # FP8 path is wgmma): ptxas lowers each one to fp8 -> f16 conversions and two HMMA.16816.F32.
    from pykern import compiler

    try:
        compiler.nvrtc_version()
    except Exception as e:  # noqa: BLE001 - no NVRTC here is a skip, not a failure
        pytest.skip(f"NVRTC unavailable: {e}")
    mod = compiler.compile(HOST_KERNELS / "ptx_fp8.cu", arch)
    assert "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" in mod.ptx
    tool = _cuobjdump()
    if tool is None or not (Path(tool).parent / "nvdisasm").exists() and shutil.which("nvdisasm") is None:
        pytest.skip("cuobjdump / nvdisasm not installed: SASS not checked")
    cubin = tmp_path / f"ptx_fp8_{arch}.cubin"
    cubin.write_bytes(mod.image)
    env = dict(os.environ, PATH=str(Path(tool).parent) + os.pathsep + os.environ.get("PATH", ""))
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True, env=env).stdout
    if arch == "sm_90":
        assert len(re.findall(r"HMMA\.16816\.F32 ", sass)) == 2 and "QMMA" not in sass
    else:
        assert len(re.findall(r"QMMA\.16832\.F32\.E4M3\.E4M3", sass)) == 1


def test_nvrtc_mma_e4m3_below_sm89_is_a_clear_compile_error(tmp_path: Path) -> None:
    from pykern import compiler

    try:
        compiler.nvrtc_version()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC unavailable: {e}")
    src = tmp_path / "fp8_sm80.cu"
    src.write_text('#include "pk_common.cuh"\nextern "C" __global__ void k(const unsigned* a, float* d) {\n'
                   "    float c[4] = {0, 0, 0, 0};\n    pk_mma_m16n8k32_e4m3(d, a, a + 4, c);\n}\n")
    with pytest.raises(CompileError, match="pk_mma_m16n8k32_e4m3.*needs sm_89"):
        compiler.compile(src, "sm_86")


# ---- thread-block clusters (pk_cluster_*, pk_mapa_shared, ld/st.shared::cluster) ---------------------------
def _cluster_launch(grid: tuple[int, int], cluster: tuple[int, int], mode: int, threads: int = 128) -> tuple:
    blocks = grid[0] * grid[1]
    out = np.full(blocks * threads, -1.0, np.float32)
    inbox = np.full(blocks, -1.0, np.float32)
    regs = np.zeros(4 * blocks, np.uint32)
    pykern.launch("pk_t_cluster", grid, threads, out, inbox, regs, mode, cluster=cluster, backend="host")
    return out.reshape(blocks, threads), inbox, regs.reshape(blocks, 4)


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random:4"])
@pytest.mark.parametrize("grid,cluster", [((8, 1), (4, 1)), ((6, 2), (2, 1)), ((4, 4), (2, 2)), ((8, 1), (8, 1))])
def test_cluster_dsmem_reads_the_peer_ctas_shared_memory(schedule: str, grid: tuple[int, int],
                                                         cluster: tuple[int, int],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    out, inbox, regs = _cluster_launch(grid, cluster, 0)
    n = cluster[0] * cluster[1]
    for by in range(grid[1]):
        for bx in range(grid[0]):
            blk = bx + grid[0] * by
            # %cluster_ctarank: x fastest within the cluster; %clusterid: the cluster's index in the cluster grid
            rank = bx % cluster[0] + cluster[0] * (by % cluster[1])
            assert tuple(regs[blk]) == (rank, n, bx // cluster[0], by // cluster[1])
            right = (rank + 1) % n
            np.testing.assert_array_equal(out[blk], right * 1000 + np.arange(out.shape[1]))
            assert inbox[blk] == right  # the right neighbour stored its rank into our inbox


def test_cluster_dsmem_without_a_cluster_barrier_is_a_race(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    with pytest.raises(KernelExecutionError, match=r"kernel pk_t_cluster: racecheck: (read-after-write|write-after-"
                       r"read) race on static __shared__ shared memory of block \(\d,0,0\) .*ptx\.cu:\d+.*with no "
                       r"barrier\.cluster arrive / wait between them"):
        _cluster_launch((4, 1), (2, 1), 1)


def test_cluster_store_after_the_arrive_is_a_race(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    for schedule in ("forward", "reverse"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
        with pytest.raises(KernelExecutionError, match=r"racecheck: .* race on static __shared__ .*barrier\.cluster"):
            _cluster_launch((4, 1), (2, 1), 3)


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_cluster_whose_cta_never_arrives_is_a_deadlock(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    with pytest.raises(KernelExecutionError, match=r"kernel pk_t_cluster: cluster \(0,0,0\): deadlock: no thread of "
                       r"the cluster can run; barrier\.cluster \(first arrival of this phase at .*ptx\.cu:\d+\): 256 of "
                       r"384 threads of the cluster arrived; block \(1,0,0\) \(cluster rank 1\): 0 of 128 threads "
                       r"arrived, thread \(0,0,0\) has exited without arriving"):
        _cluster_launch((3, 1), (3, 1), 2)


def test_cluster_dims_are_checked_before_launch() -> None:
    out = np.zeros(8 * 128, np.float32)
    args = (out, np.zeros(8, np.float32), np.zeros(32, np.uint32), 0)
    with pytest.raises(pykern.ArgumentError, match=r"cluster\[0\]: expected a divisor of grid\[0\] = 8, got 3"):
        pykern.launch("pk_t_cluster", 8, 128, *args, cluster=3, backend="host")
    with pytest.raises(pykern.ArgumentError, match=r"cluster: expected at most 8 blocks, got \(4, 4, 1\) = 16"):
        pykern.launch("pk_t_cluster", (8, 4), 128, *args, cluster=(4, 4), backend="host")


# ---- red.global.add.f32 and semaphores (pk_red_add_f32, pk_sem_wait_eq, pk_sem_add_release) ----------------
def _sem_chain_inputs(n_blocks: int, nt: int) -> np.ndarray:
    rng = np.random.default_rng(3)
    # magnitudes 2^-20 .. 2^20: the fp32 sum's bits depend on the order of the adds
    return (rng.standard_normal(n_blocks * nt) * 2.0 ** rng.integers(-20, 21, n_blocks * nt)).astype(np.float32)


@pytest.mark.parametrize("sched", ["forward", "reverse", "random:7", "random:11", "interleave", "interleave:3"])
def test_semaphore_orders_the_adds_under_every_schedule(sched: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 chains of 4 blocks: under reverse, block 7 (chain 1's last) waits first; the host starts further
    # blocks beside the waiting ones (8 at most), so the launch finishes and each chain adds in k order: the
    # sequential fp32 sum in that order, bit for bit, whatever the block schedule.
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", sched)
    chains, per, nt = 2, 4, 32
    x = _sem_chain_inputs(chains * per, nt)
    acc = np.zeros(chains * nt, np.float32)
    sem = np.zeros(chains, np.int32)
    launch("pk_t_sem_chain", chains * per, nt, x, acc, sem, chains, 0)
    want = np.zeros((chains, nt), np.float32)
    for k in range(per):
        for c in range(chains):
            want[c] += x.reshape(chains * per, nt)[k * chains + c]  # fp32 adds in k order
    np.testing.assert_array_equal(acc.reshape(chains, nt), want)
    np.testing.assert_array_equal(sem, [per, per])


def test_semaphore_order_differs_from_another_order() -> None:
    # The check above can fail: the same values summed in reversed k order give other bits.
    chains, per, nt = 2, 4, 32
    x = _sem_chain_inputs(chains * per, nt).reshape(chains * per, nt)
    fwd, rev = np.zeros((chains, nt), np.float32), np.zeros((chains, nt), np.float32)
    for k in range(per):
        for c in range(chains):
            fwd[c] += x[k * chains + c]
            rev[c] += x[(per - 1 - k) * chains + c]
    assert (fwd != rev).any()


@pytest.mark.parametrize("sched", ["forward", "reverse"])
def test_semaphore_wait_nothing_releases_is_a_deadlock_error(sched: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", sched)
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pk_t_sem_chain: block \(\d+,0,0\).*deadlock: waits for the semaphore at 0x[0-9a-f]+ to equal "
            r"\d+ \(it holds \d+\) at .*ptx\.cu:\d+")):
        launch("pk_t_sem_chain", 3, 32, np.zeros(96, np.float32), np.zeros(32, np.float32), np.zeros(1, np.int32),
               1, 1)


def test_semaphore_chain_longer_than_the_resident_slots_is_an_error_not_a_hang(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # reverse: blocks 11 .. 4 all wait for block 0's chain; 8 resident blocks is the host's most
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "reverse")
    with pytest.raises(KernelExecutionError, match=r"deadlock: waits for the semaphore .* 8 blocks are resident"):
        launch("pk_t_sem_chain", 12, 32, np.zeros(12 * 32, np.float32), np.zeros(32, np.float32),
               np.zeros(1, np.int32), 1, 0)


def test_red_add_f32_sums() -> None:
    x = np.arange(256, dtype=np.float32)
    acc = np.zeros(8, np.float32)
    launch("pk_t_red_add", 4, 64, x, acc, 8)
    np.testing.assert_array_equal(acc, x.reshape(32, 8).sum(axis=0))
