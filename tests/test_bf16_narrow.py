"""fp32 -> bf16 narrowing (kernels_cu/pk_common.cuh): the software path (sm_75, host backend) and the hardware
cvt.rn.bf16x2.f32 path (sm_80+) agree bit for bit on every special value, and sm_80/sm_90 code uses F2FP."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pykern
from pykern.backends.numba import narrow_bf16
from tests.gpu import requires_gpu

HOST_KERNELS = Path(__file__).resolve().parent / "host_kernels"


@pytest.fixture(autouse=True)
def _host_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(HOST_KERNELS))


def bf16_rne(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits by the definition: round to nearest, ties to even; any NaN -> canonical 0x7fff."""
    u = x.view(np.uint32).astype(np.uint64)
    hi, lo = u >> 16, u & 0xFFFF
    up = (lo > 0x8000) | ((lo == 0x8000) & ((hi & 1) == 1))
    r = (hi + up) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, 0x7FFF, r).astype(np.uint32)


def inputs() -> tuple[np.ndarray, np.ndarray]:
    bits = [
        0x00000000, 0x80000000, 0x3F800000, 0xBF800000,  # +-0, +-1
        0x7F800000, 0xFF800000,  # +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00001,  # NaNs
        0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  # exact ties: to even (down, up)
        0x3F807FFF, 0x3F808001, 0x3F80C000,  # just below / above a tie
        0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x0000FFFF, 0x007FFFFF, 0x807FFFFF,  # subnormals
        0x00800000, 0x00807FFF, 0x007F8000,  # smallest normal, subnormal rounding into it
        0x7F7F8000, 0xFF7F8000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF,  # overflow to +-inf / largest finite
    ]
    rng = np.random.default_rng(14)
    lo = np.concatenate([np.array(bits, np.uint32), rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32),
                         (rng.integers(0, 2**16, 500, dtype=np.uint32) << 16) | 0x8000])  # random ties
    hi = np.roll(lo, 11)
    return lo.view(np.float32), hi.view(np.float32)


def run(backend: str) -> dict[str, np.ndarray]:
    lo, hi = inputs()
    out = {k: np.zeros(lo.size, np.uint32) for k in ("sw", "one", "pair", "cvt")}
    pykern.launch("pk_t_narrow", (lo.size + 127) // 128, 128, lo, hi, out["sw"], out["one"], out["pair"],
                  out["cvt"], lo.size, backend=backend)
    return out


def check(out: dict[str, np.ndarray]) -> None:
    lo, hi = inputs()
    want = bf16_rne(lo) | (bf16_rne(hi) << 16)
    for k, v in out.items():
        bad = np.flatnonzero(v != want)
        assert bad.size == 0, f"{k}: {bad.size} mismatches, first lo={lo.view(np.uint32)[bad[0]]:#010x} " \
                              f"got {v[bad[0]]:#010x} want {want[bad[0]]:#010x}"
    assert (out["pair"][6] & 0xFFFF) == 0x7FFF and (out["pair"][0] & 0xFFFF) == 0x0000
    assert (out["pair"][4] & 0xFFFF) == 0x7F80 and (out["pair"][31] & 0xFFFF) == 0x7F80  # inf; 0x7F7F8000 ties up to inf


def test_software_path_bit_exact_host() -> None:
    check(run("host"))


def test_numba_reference_narrowing_matches() -> None:
    lo, _ = inputs()
    np.testing.assert_array_equal(narrow_bf16(lo).astype(np.uint32), bf16_rne(lo))


@requires_gpu
def test_hardware_path_bit_exact_gpu() -> None:
    """On sm_80+ `one`/`pair`/`cvt` are cvt.rn.bf16x2.f32 and `sw` the integer path: all equal the definition."""
    check(run("nvrtc"))
