"""Helpers shared by the kernel-family tests (test_training, test_forward, test_decode)."""
from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=None)
def difftest_cases() -> tuple:
    """`runner.collect_cases(seed=0)`, built once per process. tests/test_difftest.py and tests/test_host_modes.py
    both parametrize over it and every xdist worker collects every module; building it takes seconds."""
    from pykern.difftest import runner

    return tuple(runner.collect_cases(seed=0))
