"""2^x on the FMA pipe (kernels_cu/pk_common.cuh pk_exp2_fma), run on the host backend over the whole input
range the attention softmax gives it (scores minus the base, times log2 e: large negatives to the overflow the
lazy check catches), against exp2 in float64: the relative error stated in its comment, the special values
(-inf -> 0, NaN / +inf -> 2^127, the clamp at -127 / 127), and the floor at every integer and just below it."""
from __future__ import annotations

import numpy as np
import pytest

from host_kernel_helpers import _host_kernels, launch  # noqa: F401 (an autouse fixture)

# The stated maximum relative errors (pk_exp2_fma's comment) over x in [-126, 127].
REL_ERR = {3: 8.6e-5, 4: 3.0e-6}


def _run(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.size
    d3, d4, mu = (np.zeros(n, np.float32) for _ in range(3))
    launch("pk_t_exp2_fma", (n + 255) // 256, 256, x, d3, d4, mu, n)
    return d3, d4, mu


def _normal_range() -> np.ndarray:
    """A dense grid over [-126, 127], every integer, the floats on either side of each integer, and of 0."""
    ints = np.arange(-126, 128, dtype=np.float32)
    near = np.concatenate([np.nextafter(ints, np.float32(-np.inf)), ints, np.nextafter(ints, np.float32(np.inf))])
    tiny = np.array([1e-30, -1e-30, 1e-7, -1e-7, 2.0**-24, -(2.0**-24)], np.float32)
    grid = np.linspace(-126, 127, 200_001, dtype=np.float32)
    return np.concatenate([near, tiny, grid])[None].ravel()


@pytest.mark.parametrize("deg", [3, 4])
def test_relative_error_over_the_normal_range(deg: int) -> None:
    x = _normal_range()
    x = x[(x >= -126) & (x <= 127)]
    got = _run(x)[0 if deg == 3 else 1].astype(np.float64)
    ref = np.exp2(x.astype(np.float64))
    rel = np.abs(got / ref - 1.0)
    assert rel.max() <= REL_ERR[deg], (deg, rel.max(), x[rel.argmax()])
    # and not far below it: the figure stated is the polynomial's, not a loose bound
    assert rel.max() >= 0.5 * REL_ERR[deg], (deg, rel.max())


def test_against_the_mufu_exp2_and_exact_powers_of_two() -> None:
    # Integers give 2^n exactly (f = 0, p(0) = 1); the MUFU exp2 (ex2.approx, emulated) agrees within the bound.
    ints = np.arange(-126, 128, dtype=np.float32)
    d3, d4, _ = _run(ints)
    assert np.array_equal(d3, np.exp2(ints.astype(np.float64)).astype(np.float32))
    assert np.array_equal(d4, d3)
    x = np.linspace(-100, 20, 10_001, dtype=np.float32)
    d3, _, mu = _run(x)
    assert np.abs(d3.astype(np.float64) / mu - 1.0).max() <= REL_ERR[3] + 1e-6


def test_special_values_and_the_clamp() -> None:
    # -inf and everything at or below -127 -> +0; below -126 subnormal or 0 (absolute error < 2^-126);
    # NaN, +inf and everything at or above 127 -> 2^127 (finite and huge: the lazy softmax's check fails on it).
    x = np.array([-np.inf, -1e30, -1000.0, -200.0, -127.0, np.nan, np.inf, 1e30, 1000.0, 200.0, 127.0,
                  -126.5, -126.999], np.float32)
    for got in _run(x)[:2]:
        assert np.array_equal(got[:5], np.zeros(5, np.float32)) and not np.signbit(got[:5]).any()
        assert np.array_equal(got[5:11], np.full(6, 2.0**127, np.float32)), got[5:11]
        assert np.all(got[11:] >= 0) and np.all(np.abs(got[11:] - np.exp2(x[11:].astype(np.float64))) < 2.0**-126)
