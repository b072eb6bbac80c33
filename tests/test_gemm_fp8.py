"""FP8 block-scaled GEMMs (kernels_cu/gemm_fp8.cu): the host backend against float64 on the dequantized inputs,
the quantization bit-exact against its definition, bad input named before any launch, SASS and spills."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

from pykern import ops  # noqa: E402
from pykern.difftest.cases.gemm_fp8 import (  # noqa: E402
    fp8_weight, np_fp8_quantize, np_gemm_fp8, np_grouped_gemm_fp8)
from pykern.errors import ArgumentError, ArgumentTypeError  # noqa: E402
from pykern.tolerance import tolerance  # noqa: E402
from sass_helpers import report as _sass_report

ROOT = Path(__file__).resolve().parents[1]


def _close(out: np.ndarray, ref: np.ndarray, op: str) -> None:
    atol, rtol = tolerance(op, "bf16")
    got = out.astype(np.float64)
    assert np.all(np.abs(got - ref) <= atol + rtol * np.abs(ref)), np.abs(got - ref).max()


@pytest.mark.parametrize("kind", ["f32", "bf16", "f16"])
def test_quantize_bit_exact(kind: str) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 384)).astype(np.float32) * 5
    x[0, 128:256] = 0.0   # all-zero tile: scale 1e-10 / 448, codes 0
    x[3, 3] = -3e4        # saturating neighbours: the others round small
    dt = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}[kind]
    xk = x.astype(dt)
    q, s = ops.fp8_quantize(xk, backend="host")
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.float32 and s.shape == (4, 3)
    qr, sr = np_fp8_quantize(xk)
    np.testing.assert_array_equal(q.astype(np.float64), qr)
    np.testing.assert_array_equal(s.astype(np.float64), sr)
    assert s[0, 1] == np.float32(np.float32(1e-10) / np.float32(448.0)) and not q[0, 128:256].astype(np.float32).any()
    assert np.abs(q.astype(np.float32)).max() == 448.0


@pytest.mark.parametrize("be", ["host", "numba"])
def test_quantize_a_nan_makes_its_tile_nan(be: str) -> None:
    # amax of a tile holding a NaN is NaN by the definition (fmaxf alone would drop it and give the others a
    # finite scale): the scale and every code of that tile are NaN, the other tiles untouched
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    x[1, 130] = np.nan
    q, s = ops.fp8_quantize(x, backend=be)
    qf = q.astype(np.float32)
    assert np.isnan(s[1, 1]) and np.isnan(qf[1, 128:]).all()
    assert np.isfinite(s[[0, 0, 1], [0, 1, 0]]).all() and np.isfinite(qf[0]).all() and np.isfinite(qf[1, :128]).all()
    qr, sr = np_fp8_quantize(x)
    np.testing.assert_array_equal(np.isnan(qf), np.isnan(qr))
    np.testing.assert_array_equal(np.isnan(s), np.isnan(sr))


def _act(rng: np.random.Generator, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10.0, (m, 1))).astype(np.float32)
    return ops.fp8_quantize(x, backend="host")


@pytest.mark.parametrize("m,n,k", [(1, 8, 128), (70, 136, 256), (64, 256, 128)])
def test_gemm_fp8_matches_float64(m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(m + n + k)
    a, sa = _act(rng, m, k)
    b, sb = fp8_weight(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    out = ops.gemm_fp8(a, sa, b, sb, backend="host")
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == (m, n)
    _close(out, np_gemm_fp8(a, sa, b, sb), "gemm_fp8")


def test_gemm_fp8_applies_each_k_blocks_scales() -> None:
    # Two k-blocks with scales 2^10 apart: a kernel that applied one scale to the whole row would be off by
    # orders of magnitude, not by rounding.
    rng = np.random.default_rng(3)
    a, sa = _act(rng, 16, 256)
    sa[:, 1] *= 1024.0
    b, sb = fp8_weight(rng.standard_normal((8, 256)).astype(np.float32))
    sb[0, 0] *= 2.0**-6
    _close(ops.gemm_fp8(a, sa, b, sb, backend="host"), np_gemm_fp8(a, sa, b, sb), "gemm_fp8")


def test_an_infinite_scale_multiplies_the_blocks_partial_sum() -> None:
    # The documented sum over k-blocks of (a_kb @ b_kb^T) * a_scale * b_scale: an inf scale gives +-inf where
    # the block's partial is not 0 (the kernel's promotion), not the NaN of dequantizing 0 * inf first
    # (the reference did that; found by the bad-input fuzzer)
    rng = np.random.default_rng(5)
    a, sa = _act(rng, 3, 256)
    b, sb = fp8_weight(rng.standard_normal((130, 256)).astype(np.float32) * 0.05)
    a[1, :128] = 0.0
    a[1, 0] = 1.0          # row 1, k-block 0: one nonzero code, so the partial is b's column (nonzero)
    sa[1, 0] = np.inf
    sb[1, 1] = -np.inf     # columns 128, 129 in k-block 1
    with np.errstate(invalid="ignore"):
        ref = np_gemm_fp8(a, sa, b, sb)
    # (row 1, columns 128-129 meet both: inf + -inf, NaN)
    assert np.isinf(ref[1, :128]).sum() >= 120 and np.isinf(ref[[0, 2], 128:]).all() and np.isnan(ref[1, 128:]).all()
    out = ops.gemm_fp8(a, sa, b, sb, backend="host").astype(np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(out[np.isinf(ref)], ref[np.isinf(ref)])
    fin = np.isfinite(ref)
    _close(out[fin], ref[fin], "gemm_fp8")


def test_grouped_gemm_fp8_ragged_empty_and_one_row_groups() -> None:
    rng = np.random.default_rng(4)
    sizes, n, k = (0, 3, 1, 0, 66), 136, 256
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    a, sa = _act(rng, int(offsets[-1]), k)
    ws = [fp8_weight(rng.standard_normal((n, k)).astype(np.float32) * (e + 1) * 0.03) for e in range(len(sizes))]
    b, sb = np.stack([w[0] for w in ws]), np.stack([w[1] for w in ws])
    out = ops.grouped_gemm_fp8(a, sa, b, sb, offsets, backend="host")
    _close(out, np_grouped_gemm_fp8(a, sa, b, sb, offsets), "grouped_gemm_fp8")


def _misaligned(x: np.ndarray, offset: int) -> np.ndarray:
    """x's values in a view `offset` bytes into a bigger e4m3 buffer (so its base is off 16 bytes)."""
    buf = np.zeros(x.size + 32, ml_dtypes.float8_e4m3fn)
    start = (-buf.ctypes.data) % 16 + offset
    view = buf[start:start + x.size].reshape(x.shape)
    view[...] = x
    assert view.ctypes.data % 16 == offset
    return view


@pytest.mark.parametrize("offset", [1, 8, 15])
def test_a_misaligned_view_gives_the_aligned_result(offset: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both kernels load 16-byte chunks (cp.async); the checked host build reports any misaligned one (a misaligned
    # address fault on a GPU). The op copies such an operand to an aligned buffer: bit-identical results.
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    rng = np.random.default_rng(offset)
    m, n, k = 24, 136, 256
    a, sa = _act(rng, m, k)
    b, sb = fp8_weight(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    ref = ops.gemm_fp8(a, sa, b, sb, backend="host")
    _close(ref, np_gemm_fp8(a, sa, b, sb), "gemm_fp8")
    av, bv = _misaligned(a, offset), _misaligned(b, 16 - offset)
    for args in ((av, sa, b, sb), (a, sa, bv, sb), (av, sa, bv, sb)):
        np.testing.assert_array_equal(ops.gemm_fp8(*args, backend="host").view(np.uint16), ref.view(np.uint16))
    np.testing.assert_array_equal(av.view(np.uint8), a.view(np.uint8))  # read, never written
    # grouped: two experts, b [2, n, k]
    offsets = np.array([0, 10, m], np.int32)
    b2 = np.stack([b, b[::-1]])
    sb2 = np.stack([sb, sb[::-1]])
    gref = ops.grouped_gemm_fp8(a, sa, b2, sb2, offsets, backend="host")
    _close(gref, np_grouped_gemm_fp8(a, sa, b2, sb2, offsets), "grouped_gemm_fp8")
    got = ops.grouped_gemm_fp8(av, sa, _misaligned(b2, offset), sb2, offsets, backend="host")
    np.testing.assert_array_equal(got.view(np.uint16), gref.view(np.uint16))


def _args(m: int = 4, n: int = 8, k: int = 128) -> tuple[np.ndarray, ...]:
    a = np.zeros((m, k), ml_dtypes.float8_e4m3fn)
    b = np.zeros((n, k), ml_dtypes.float8_e4m3fn)
    return a, np.ones((m, k // 128), np.float32), b, np.ones((-(-n // 128), k // 128), np.float32)


def test_bad_input_is_named_before_any_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import pykern.launcher

    def no_launch(*_a: object, **_k: object) -> None:
        raise AssertionError("launched")

    monkeypatch.setattr(pykern.launcher, "launch", no_launch)
    a, sa, b, sb = _args()
    with pytest.raises(ArgumentError, match=r"a_scale: expected shape \(4, 1\)"):
        ops.gemm_fp8(a, sa[:2], b, sb, backend="host")
    with pytest.raises(ArgumentError, match=r"b_scale: expected shape \(1, 1\)"):
        ops.gemm_fp8(a, sa, b, np.ones((2, 1), np.float32), backend="host")
    with pytest.raises(ArgumentError, match=r"a.shape\[1\] \(K\): expected a multiple of 128 .*got 100"):
        ops.gemm_fp8(np.zeros((4, 100), ml_dtypes.float8_e4m3fn), np.ones((4, 0), np.float32),
                     np.zeros((8, 100), ml_dtypes.float8_e4m3fn), sb, backend="host")
    with pytest.raises(ArgumentError, match=r"x.shape\[1\] \(K\): expected a multiple of 128.*got 130"):
        ops.fp8_quantize(np.zeros((2, 130), np.float32), backend="host")
    with pytest.raises(ArgumentTypeError, match="a: expected dtype float8_e4m3fn.*got float8_e5m2"):
        ops.gemm_fp8(a.astype(ml_dtypes.float8_e5m2), sa, b, sb, backend="host")
    with pytest.raises(ArgumentTypeError, match="b: expected dtype float8_e4m3fn.*got uint8"):
        ops.gemm_fp8(a, sa, b.view(np.uint8), sb, backend="host")
    with pytest.raises(ArgumentTypeError, match="a_scale: expected dtype float32, got float64"):
        ops.gemm_fp8(a, sa.astype(np.float64), b, sb, backend="host")
    bg, sbg = b[None].repeat(2, 0), sb[None].repeat(2, 0)
    with pytest.raises(ArgumentError, match=r"offsets: expected offsets\[0\] == 0 and offsets\[-1\] == 4"):
        ops.grouped_gemm_fp8(a, sa, bg, sbg, np.array([0, 1, 3], np.int32), backend="host")
    b3, sb3 = b[None].repeat(3, 0), sb[None].repeat(3, 0)
    with pytest.raises(ArgumentError, match=r"offsets: expected non-decreasing"):
        ops.grouped_gemm_fp8(a, sa, b3, sb3, np.array([0, 3, 2, 4], np.int32), backend="host")
    with pytest.raises(ArgumentError, match=r"b_scale: expected shape \(2, 1, 1\)"):
        ops.grouped_gemm_fp8(a, sa, bg, sb, np.array([0, 1, 4], np.int32), backend="host")
    with pytest.raises(ArgumentTypeError, match="offsets: expected dtype int32, got int64"):
        ops.grouped_gemm_fp8(a, sa, bg, sbg, np.array([0, 1, 4]), backend="host")


def test_older_gpus_are_refused_naming_the_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    from pykern.ops import gemm_fp8 as op
    import pykern.ops.gemm_fp8  # noqa: F401 - the module, through sys.modules
    import sys

    mod = sys.modules["pykern.ops.gemm_fp8"]
    assert op is mod.gemm_fp8  # the package attribute is the op, not the module named like it
    monkeypatch.setattr(mod, "fp8_mma_available", lambda backend=None: (False, "sm_86"))
    a, sa, b, sb = _args()
    with pytest.raises(ArgumentError, match="needs sm_89 or newer.*sm_86"):
        ops.gemm_fp8(a, sa, b, sb, backend="host")


@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
def test_sass_fp8_mma_in_a_flat_loop_without_spills(arch: str) -> None:
    from pykern import compiler

    try:
        compiler.nvrtc_version()
    except Exception as e:  # noqa: BLE001 - no NVRTC here is a skip, not a failure
        pytest.skip(f"NVRTC unavailable: {e}")
    sr = _sass_report()
    try:
        sr.find_cuobjdump()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"cuobjdump unavailable: {e}")
    from sass_helpers import nvrtc_module

    # through the run's cache: loop_metrics below reads the same entry instead of compiling it again
    mod = nvrtc_module(ROOT / "kernels_cu" / "gemm_fp8.cu", arch)
    for name, res in mod.resources.items():
        assert res.spill_bytes == 0, (name, arch, res)
    loops = sr.loop_metrics(["gemm_fp8", "gemm_fp8_grouped"], [arch])
    for name in ("gemm_fp8", "gemm_fp8_grouped"):
        row = loops[name][arch]
        # per k-tile and warp: 4 k-steps x 2 x 4 mma.m16n8k32 = 32, each two m16n8k16-equivalents
        assert row["mma"] == 64, row
        assert row["ldsm"] == 16 and row["ldgsts"] == 6, row
    text = sr.disassemble(mod.image)
    if arch == "sm_89":
        assert "QMMA.16832.F32.E4M3.E4M3" in text
    else:  # Hopper has no FP8 mma.sync: ptxas converts to f16 and issues two HMMA.16816.F32 per instruction
        assert "QMMA" not in text and "HMMA.16816.F32 " in text
