"""Checks shared by the attention tests: outputs against a float64 reference within the op's tolerance, lse
against the reference's, and the fixture that makes the host backend play sm_90a."""
from __future__ import annotations

import numpy as np
import pytest

from pykern.tolerance import tolerance


@pytest.fixture
def sm90_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops choose the sm_90a kernels on the host backend, under the default schedule."""
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
    monkeypatch.delenv("PYKERN_HOST_SCHEDULE", raising=False)


def close(name: str, got, ref, op: str, dtype: str) -> None:
    """got within op's (atol, rtol) for dtype of the float64 ref, element-wise (-inf where ref has -inf)."""
    atol, rtol = tolerance(op, dtype)
    got = np.asarray(got).astype(np.float64)
    assert got.shape == ref.shape, name
    both_inf = np.isneginf(got) & np.isneginf(ref)
    err = np.where(both_inf, 0.0, np.abs(got - ref))
    bad = ~(err <= atol + rtol * np.abs(ref))
    assert not bad.any(), f"{name}: {bad.sum()} of {bad.size} off, max err {np.nanmax(err):.3g}"


def check_lse(lse, ref) -> None:
    """-inf exactly where ref's is (empty rows), and within 1e-4 elsewhere (fp32 from fp32 scores)."""
    lse = np.asarray(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    assert np.abs(lse[fin] - ref[fin]).max(initial=0) < 1e-4
