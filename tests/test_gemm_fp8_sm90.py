"""The FP8 block-scaled GEMMs on Hopper: grouped_gemm_fp8_sm90 (kernels_cu/grouped_gemm_sm90.cu, FP8: TMA, QGMMA
wgmma m64n128k32 e4m3, each 128-wide k-block's partial promoted into fp32 registers times its pre-multiplied scales).

On the host backend playing sm_90a (PYKERN_HOST_ARCH=sm_90a: TMA, mbarrier and the e4m3 wgmma emulated) gemm_fp8
and grouped_gemm_fp8 launch it and match float64 on the dequantized inputs within the bf16 output rounding (the
existing FP8 tests' criterion): ragged, empty and one-row groups, N off the 128-column tile, several tiles a CTA,
k-blocks whose scales differ by 2^12 (a missing or misplaced promotion is off by orders of magnitude). Other archs
keep mma.sync e4m3. From the cubin NVRTC makes for sm_90a (no GPU needed): QGMMA, UTMALDG, SYNCS, no spills, and
the consumer loop's instructions per m16n8k16-equivalent (an m64nNk32 QGMMA counts 2 N / 8 a warp).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

from pykern import ops  # noqa: E402
from pykern.difftest.cases.gemm_fp8 import fp8_weight, np_gemm_fp8, np_grouped_gemm_fp8  # noqa: E402
from pykern.tolerance import tolerance  # noqa: E402
from launch_spy import record_launches as _record  # noqa: E402
from attn_checks import sm90_host  # noqa: E402,F401 (a fixture)
from sass_helpers import compile_sass, kernel_ops, report
from sm90_mutants import launch_mutants

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "kernels_cu" / "grouped_gemm_sm90.cu"
HOST = "host"
KERNEL = "grouped_gemm_fp8_sm90"
pytestmark = pytest.mark.usefixtures("sm90_host")


def _close(got, ref: np.ndarray, op: str) -> None:
    atol, rtol = tolerance(op, "bf16")
    got = np.asarray(got).astype(np.float64)
    assert got.shape == ref.shape
    err = np.abs(got - ref)
    bad = ~(err <= atol + rtol * np.abs(ref))
    assert not bad.any(), f"{bad.sum()} of {bad.size} off, max err {err.max():.3g}"


def _act(rng: np.random.Generator, m: int, k: int, spread: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 activations and their 1 x 128 scales; spread: odd k-blocks' scales 2^12 above the even ones', so a
    kernel applying one k-block's scales to another's partial (or none) is off by far more than rounding."""
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10.0, (m, 1))).astype(np.float32)
    q, s = ops.fp8_quantize(x, backend=HOST)
    if spread:
        s = s * np.float32(2.0) ** (12 * (np.arange(k // 128, dtype=np.float32) % 2))
    return q, np.ascontiguousarray(s, np.float32)


def _weights(rng: np.random.Generator, e: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    ws = [fp8_weight(rng.standard_normal((n, k)).astype(np.float32) * 0.05 * (i + 1)) for i in range(e)]
    b, sb = np.stack([w[0] for w in ws]), np.stack([w[1] for w in ws])
    sb[..., 1::2] *= np.float32(2.0) ** -5  # b's k-blocks differ too (the product of the two scales is applied)
    return b, sb


# --------------------------------------------------------------------------- vs float64
GROUPED = [  # (group sizes, N, K)
    ((0, 5, 1, 0, 130), 136, 384),       # empty groups, a one-row group, a group over a tile; N off the tile
    ((1,), 8, 128),                      # one row, one k-block
    ((300,), 264, 256),                  # 3 row tiles x 3 column tiles: every host CTA walks several tiles
    ((0, 0), 40, 128),                   # no rows at all: nothing launched
    ((7, 0, 129, 64, 2), 128, 512),      # a group of 129 rows (a 1-row second tile), 4 k-blocks
    ((3, 40), 136, 768),                 # 6 k-blocks: one whole round of the 6-stage ring, no partial round
    ((0, 20, 1), 8, 1792),               # 14 k-blocks: two whole rounds, then a partial one of 2
]


@pytest.mark.parametrize("shape", GROUPED, ids=lambda s: f"{len(s[0])}g{sum(s[0])}x{s[1]}x{s[2]}")
def test_grouped_gemm_fp8_sm90_vs_float64(shape, monkeypatch) -> None:
    sizes, n, k = shape
    rng = np.random.default_rng(sum(sizes) + n + k)
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    a, sa = _act(rng, int(off[-1]), k)
    b, sb = _weights(rng, len(sizes), n, k)
    names = _record(monkeypatch)
    out = ops.grouped_gemm_fp8(a, sa, b, sb, off, backend=HOST)
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == (off[-1], n)
    _close(out, np_grouped_gemm_fp8(a, sa, b, sb, off), "grouped_gemm_fp8")
    assert names == ([KERNEL] if off[-1] else [])


@pytest.mark.parametrize("m,n,k", [(1, 8, 128), (70, 136, 256), (200, 300, 384), (20, 136, 1664)])
def test_gemm_fp8_sm90_vs_float64(m, n, k, monkeypatch) -> None:
    rng = np.random.default_rng(m + n + k)
    a, sa = _act(rng, m, k)
    b, sb = _weights(rng, 1, n, k)
    names = _record(monkeypatch)
    out = ops.gemm_fp8(a, sa, b[0], sb[0], backend=HOST)
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == (m, n)
    _close(out, np_gemm_fp8(a, sa, b[0], sb[0]), "gemm_fp8")
    assert names == [KERNEL]


def test_the_spread_scales_would_catch_a_single_scale() -> None:
    # The test data's point: applying k-block 0's scales to the whole row misses the reference by orders of
    # magnitude more than the bf16 rounding
    rng = np.random.default_rng(3)
    a, sa = _act(rng, 16, 256)
    b, sb = _weights(rng, 1, 8, 256)
    one = np.repeat(sa[:, :1], 2, axis=1), np.repeat(sb[0][:, :1], 2, axis=1)
    with pytest.raises(AssertionError, match="off, max err"):
        _close(np_gemm_fp8(a, one[0], b[0], one[1]), np_gemm_fp8(a, sa, b[0], sb[0]), "gemm_fp8")


def test_with_one_cta_walking_every_tile(monkeypatch) -> None:
    # a persistent grid of one CTA: the 6-stage ring's stage and phase counters carry across tiles and groups
    from pykern.ops import _moe_sm90 as sm90

    monkeypatch.setattr(sm90, "HOST_CTAS", 1)
    rng = np.random.default_rng(4)
    off = np.array([0, 60, 60, 250, 257], np.int32)
    a, sa = _act(rng, 257, 384)
    b, sb = _weights(rng, 4, 260, 384)
    names = _record(monkeypatch)
    _close(ops.grouped_gemm_fp8(a, sa, b, sb, off, backend=HOST), np_grouped_gemm_fp8(a, sa, b, sb, off),
           "grouped_gemm_fp8")
    assert names == [KERNEL]


def test_other_archs_keep_mma_sync(monkeypatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_89")
    rng = np.random.default_rng(6)
    off = np.array([0, 30, 70], np.int32)
    a, sa = _act(rng, 70, 256)
    b, sb = _weights(rng, 2, 24, 256)
    names = _record(monkeypatch)
    _close(ops.grouped_gemm_fp8(a, sa, b, sb, off, backend=HOST), np_grouped_gemm_fp8(a, sa, b, sb, off),
           "grouped_gemm_fp8")
    _close(ops.gemm_fp8(a, sa, b[0], sb[0], backend=HOST), np_gemm_fp8(a, sa, b[0], sb[0]), "gemm_fp8")
    assert names == ["gemm_fp8_grouped", "gemm_fp8"]


# --------------------------------------------------------------------------- a broken kernel is caught
def _mutant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    """A copy of the kernel source with `old` replaced (once), its kernels taking the real names' place."""
    launch_mutants(tmp_path, monkeypatch, SRC, old, new, "gg90_fp8_mutant.cu", "_sm90", "_mutant90")


def _mutant_inputs():
    rng = np.random.default_rng(12)
    off = np.array([0, 5, 5, 140], np.int32)
    a, sa = _act(rng, 140, 1024)  # 8 k-blocks: a whole round of the 6-stage ring and a partial one
    b, sb = _weights(rng, 3, 136, 1024)
    return a, sa, b, sb, off


def test_the_unmutated_copy_runs(tmp_path, monkeypatch) -> None:
    _mutant(tmp_path, monkeypatch, "#define GG90_RASTER 8", "#define GG90_RASTER 8")
    a, sa, b, sb, off = _mutant_inputs()
    _close(ops.grouped_gemm_fp8(a, sa, b, sb, off, backend=HOST), np_grouped_gemm_fp8(a, sa, b, sb, off),
           "grouped_gemm_fp8")


@pytest.mark.parametrize("old,new", [
    # the promotion without the k-block's scales
    ("                facc[4 * j] = fmaf(acc[4 * j], sc.x, facc[4 * j]);",
     "                facc[4 * j] = acc[4 * j] + facc[4 * j];"),
    # every k-block promoted with k-block 0's scales (the producer's pre-multiplied scales)
    ("sa[(long long)min(x.m0 + row, M - 1) * nk + kb] * bsc;", "sa[(long long)min(x.m0 + row, M - 1) * nk] * psb[0];"),
    # the scales without b's (a_scale alone stored for the stage)
    ("sa[(long long)min(x.m0 + row, M - 1) * nk + kb] * bsc;", "sa[(long long)min(x.m0 + row, M - 1) * nk + kb];"),
    # a row's scale in another row's slot (the slot of row r + 8 for row r)
    ("__device__ __forceinline__ int gg90_scale_slot(int row) { return (row >> 4) * 16 + (row & 7) * 2 + ((row >> 3) & 1); }",
     "__device__ __forceinline__ int gg90_scale_slot(int row) { return (row >> 4) * 16 + (row & 7) * 2; }"),
    # no restart: the wgmma accumulators run on across k-blocks, each promotion adding the earlier partials again
    ("pk_wgmma_desc_advance(db0, s * B_BYTES + ks * 32), ks > 0);",
     "pk_wgmma_desc_advance(db0, s * B_BYTES + ks * 32), 1);"),
    # the second row of a thread's accumulators promoted with the first row's scale
    ("                facc[4 * j + 2] = fmaf(acc[4 * j + 2], sc.y, facc[4 * j + 2]);",
     "                facc[4 * j + 2] = fmaf(acc[4 * j + 2], sc.x, facc[4 * j + 2]);"),
    # the last, partial round's k-blocks skipped (only whole rounds of the 6-stage ring multiplied)
    ("                    if (s < rem) {", "                    if (s < 0) {"),
], ids=["no-scale", "first-kblock-scale", "no-b-scale", "slot", "no-restart", "row-scale", "no-tail"])
def test_a_broken_promotion_fails_the_checks(old, new, tmp_path, monkeypatch) -> None:
    _mutant(tmp_path, monkeypatch, old, new)
    a, sa, b, sb, off = _mutant_inputs()
    with pytest.raises(AssertionError, match="off, max err"):
        _close(ops.grouped_gemm_fp8(a, sa, b, sb, off, backend=HOST), np_grouped_gemm_fp8(a, sa, b, sb, off),
               "grouped_gemm_fp8")


# --------------------------------------------------------------------------- SASS (NVRTC, no GPU)
# Warp-instructions of the consumer's steady-state loop per m16n8k16-equivalent (an m64nNk32 QGMMA counts 2 N / 8
# a warp): one round of the 6-stage ring a trip, 24 QGMMA m64n128k32 = 24 * 2 * 128 / 8 = 768 equivalents. Today
# 0.672 (516 instructions; 0.832 before the scales were pre-multiplied into shared memory by the producer and the
# stages unrolled to constants): the promotion is 64 FFMA a k-block (0.5, the floor of promoting every 128-wide
# k-block in fp32), the rest ~22 a k-block: 4 QGMMA, 8 descriptor adds, the full wait and its retry branch, one
# 8-byte scale load, the wgmma fence and wait and the stage's release. CUTLASS 3.x's consumer loop: 0.35-0.70.
LOOP_BAR = 0.68


@lru_cache(maxsize=None)
def _sass():
    mod, text = compile_sass(SRC, "sm_90a")
    return mod, text, report().steady_state_loops(text)


def test_sass_qgmma_tma_mbarriers_and_no_spills() -> None:
    mod, text, _ = _sass()
    ops_ = kernel_ops(text, KERNEL)
    mma = [op for op in ops_ if "GMMA" in op or op.startswith(("HMMA", "QMMA"))]
    assert mma and set(mma) == {"QGMMA.64x128x32.F32.E4M3.E4M3"}, set(mma)  # e4m3 wgmma, no f16 detour
    assert "UTMALDG.2D" in ops_ and "UTMALDG.3D" in ops_  # A; B
    assert sum(op.startswith("SYNCS") for op in ops_) >= 4  # mbarrier init / arrive(.expect_tx) / try_wait
    assert "USETMAXREG.DEALLOC.CTAPOOL" in ops_ and "USETMAXREG.TRY_ALLOC.CTAPOOL" in ops_
    assert not [op for op in ops_ if op.startswith(("LDL", "STL"))]
    res = mod.resources[KERNEL]
    assert res.spill_stores == 0 and res.spill_loads == 0


def test_steady_state_loop_is_flat_and_within_the_bar() -> None:
    _, _, loops = _sass()
    loop = loops[KERNEL]  # a loop with QGMMAs and no inner loop (the mbarrier retry lies outside it)
    assert loop["mma"] == 6 * 4 * 2 * 128 / 8
    assert loop["bar"] == 0 and loop["ldsm"] == 0 and loop["ldgsts"] == 0
    assert loop["per_mma"] <= LOOP_BAR, loop
