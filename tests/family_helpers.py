"""Helpers shared by the kernel-family tests (test_training, test_forward, test_decode)."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from pykern.backends import get_backend
from pykern.difftest.runner import compare
from pykern.tolerance import tolerance


def need(name: str) -> None:
    """Skip (saying why) when the backend reports itself unusable here; a broken backend still fails."""
    ok, why = get_backend(name).available()
    if not ok:
        pytest.skip(f"{name} backend unavailable: {why}")


def check(got: dict, ref: dict, op: str, dtype: str) -> None:
    """Every reference output matches within the tolerance table's bound for (op, dtype)."""
    atol, rtol = tolerance(op, dtype)
    for name, r in ref.items():
        c = compare(name, got[name], r, atol, rtol)
        assert c.ok, f"{name}: {c.detail}"


def close_elementwise(got: Any, ref: np.ndarray, op: str, kind: str) -> None:
    """got has ref's shape and every element within the tolerance table's atol + rtol * |ref| for (op, kind)."""
    atol, rtol = tolerance(op, kind)
    got = np.asarray(got).astype(np.float64)
    assert got.shape == ref.shape
    err = np.abs(got - ref)
    bad = ~(err <= atol + rtol * np.abs(ref))
    assert not bad.any(), f"{bad.sum()} of {bad.size} off, max err {err.max():.3g}"


def close_attention(out: Any, ref: Any, op: str, dtype: str) -> None:
    """An attention output (or lse) against its float64 reference: -inf (a row with no visible key) in the same
    places, no NaN, every finite element within the tolerance table's bound for (op, dtype)."""
    atol, rtol = tolerance(op, dtype)
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    assert (np.isneginf(out) == np.isneginf(ref)).all(), "-inf (no visible key) placement differs"
    assert not np.isnan(out).any()
    err = np.abs(out[fin] - ref[fin]) - (atol + rtol * np.abs(ref[fin]))
    assert err.size == 0 or err.max() <= 0, f"max excess {err.max():.3g}"


def check_central_differences(loss: Any, inputs: list, grads: Any, indices: Any = None, eps: float = 1e-6,
                              tol: float = 1e-6) -> None:
    """Each gradient in grads (one per array of inputs) matches the central difference of loss(*inputs) at every
    element (indices None) or at indices(array)'s, to tol; a failure names (which input, index)."""
    for which, (arr, grad) in enumerate(zip(inputs, grads)):
        for idx in np.ndindex(arr.shape) if indices is None else indices(arr):
            args = list(inputs)
            plus, minus = arr.copy(), arr.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args[which] = plus
            lp = loss(*args)
            args[which] = minus
            lm = loss(*args)
            assert abs((lp - lm) / (2 * eps) - grad[idx]) < tol, (which, idx)


@functools.lru_cache(maxsize=None)
def difftest_cases() -> tuple:
    """`runner.collect_cases(seed=0)`, built once per process. tests/test_difftest.py and tests/test_host_modes.py
    both parametrize over it and every xdist worker collects every module; building it takes seconds."""
    from pykern.difftest import runner

    return tuple(runner.collect_cases(seed=0))
