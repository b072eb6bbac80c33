"""fp32 <-> f16 conversions (kernels_cu/pk_common.cuh, pk_ptx.cuh): the host backend's emulation of
cvt.rn.f16x2.f32 and cvt.f32.f16 agrees bit for bit with NumPy's float16 on every special value (NaN ->
the canonical 0x7fff, ties to even, subnormals, overflow to inf beyond 65504), and sm_80+ code narrows
with F2FP.F16.F32.PACK_AB and widens with HADD2.F32 (tests/test_sass.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pykern
from pykern.backends.numba import narrow_f16, widen_f16
from tests.gpu import requires_gpu

HOST_KERNELS = Path(__file__).resolve().parent / "host_kernels"


@pytest.fixture(autouse=True)
def _host_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(HOST_KERNELS))


def f16_rne(x: np.ndarray) -> np.ndarray:
    """fp32 -> f16 bits by NumPy (round to nearest even, subnormals, inf past 65504); NaN -> 0x7fff."""
    with np.errstate(over="ignore", invalid="ignore"):
        bits = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    return np.where(np.isnan(x), np.uint32(0x7FFF), bits)


def f32_bits(x: float) -> int:
    return int(np.array([x], np.float32).view(np.uint32)[0])


def inputs() -> tuple[np.ndarray, np.ndarray]:
    bits = [
        0x00000000, 0x80000000, 0x3F800000, 0xBF800000,  # +-0, +-1
        0x7F800000, 0xFF800000,  # +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00001,  # NaNs
        0x3F801000, 0x3F803000, 0xBF801000, 0xBF803000,  # exact ties at 1.0 (ulp 2^-10): to even (down, up)
        0x3F800FFF, 0x3F801001,  # just below / above a tie
        f32_bits(65504.0), f32_bits(-65504.0),  # largest finite
        f32_bits(65519.996), f32_bits(65520.0), f32_bits(-65520.0), f32_bits(1e5), f32_bits(3e38),  # overflow edge
        f32_bits(2.0 ** -14), f32_bits(2.0 ** -14 - 2.0 ** -25), f32_bits(2.0 ** -14 - 2.0 ** -24),  # normal edge
        f32_bits(2.0 ** -24), f32_bits(-(2.0 ** -24)), f32_bits(2.0 ** -25), f32_bits(2.0 ** -25 * 1.0000001),
        f32_bits(3 * 2.0 ** -25), f32_bits(5 * 2.0 ** -25), f32_bits(2.0 ** -26), f32_bits(1e-30),  # subnormals
        f32_bits(1.5 * 2.0 ** -24), f32_bits(2.5 * 2.0 ** -24), f32_bits(1000.5), f32_bits(2049.0),  # subnormal ties
        0x00000001, 0x807FFFFF,  # fp32 subnormals -> +-0
    ]
    rng = np.random.default_rng(16)
    rand = rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
    # values in f16's range with the 13 dropped bits exactly a tie, and random ones near 1 and subnormal
    ties = ((rng.integers(0x33000000, 0x47800000, 800, dtype=np.uint32) & ~np.uint32(0x1FFF)) | np.uint32(0x1000))
    near = rng.uniform(-70000, 70000, 800).astype(np.float32).view(np.uint32)
    tiny = (rng.uniform(-1, 1, 800) * 2.0 ** -14).astype(np.float32).view(np.uint32)
    lo = np.concatenate([np.array(bits, np.uint32), rand, ties, near, tiny])
    hi = np.roll(lo, 11)
    return lo.view(np.float32), hi.view(np.float32)


WORDS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every f16 word


def run(backend: str) -> dict[str, np.ndarray]:
    lo, hi = inputs()
    out = {k: np.zeros(lo.size, np.uint32) for k in ("one", "pair", "cvt")}
    widened = np.zeros(WORDS.size, np.float32)
    n = max(lo.size, WORDS.size)
    pykern.launch("pk_t_narrow_f16", (n + 127) // 128, 128, lo, hi, out["one"], out["pair"], out["cvt"], WORDS,
                  widened, lo.size, WORDS.size, backend=backend)
    out["widened"] = widened
    return out


def check(out: dict[str, np.ndarray]) -> None:
    lo, hi = inputs()
    want = f16_rne(lo) | (f16_rne(hi) << 16)
    for k in ("one", "pair", "cvt"):
        v = out[k]
        bad = np.flatnonzero(v != want)
        assert bad.size == 0, f"{k}: {bad.size} mismatches, first lo={lo.view(np.uint32)[bad[0]]:#010x} " \
                              f"got {v[bad[0]]:#010x} want {want[bad[0]]:#010x}"
    pair = out["pair"] & 0xFFFF
    assert pair[6] == 0x7FFF and pair[11] == 0x7FFF and pair[12] == 0x7FFF  # NaNs: canonical, sign dropped
    assert pair[4] == 0x7C00 and pair[5] == 0xFC00  # +-inf
    assert pair[14] == 0x3C00 and pair[15] == 0x3C02  # ties to even
    assert pair[20] == 0x7BFF and pair[22] == 0x7BFF and pair[23] == 0x7C00 and pair[24] == 0xFC00  # 65520 -> inf
    assert pair[30] == 0x0001 and pair[32] == 0x0000  # 2^-24 smallest subnormal; 2^-25 ties to 0
    # widening: every finite/inf word exactly as NumPy; every NaN word to a NaN
    w = out["widened"]
    ref = WORDS.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(w[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(w[nan]).all()


def test_host_emulation_bit_exact() -> None:
    check(run("host"))


def test_numba_reference_conversions_match() -> None:
    lo, _ = inputs()
    np.testing.assert_array_equal(narrow_f16(lo).astype(np.uint32), f16_rne(lo))
    ref = WORDS.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(widen_f16(WORDS)), np.isnan(ref))


@requires_gpu
def test_hardware_path_bit_exact_gpu() -> None:
    """On the GPU `one`/`pair`/`cvt` are cvt.rn.f16x2.f32 (cvt.rn.f16.f32 on sm_75): all equal NumPy."""
    check(run("nvrtc"))
