"""The sm_90 rms_norm_backward for wide rows (kernels_cu/norm_sm90.cu, rms_norm_backward_cluster): a thread-block
cluster splits each row, the row sums combined through distributed shared memory, so x and grad_y are read once
past the 8192 columns one CTA holds. On the host backend playing Hopper (PYKERN_HOST_ARCH=sm_90a) the op must launch
it for such rows (never the two-read kernels) and agree with the float64 reference within the op's tolerance rows:
ragged widths (element path, a last CTA's short slice), 16-byte rows, clusters of 2, 4 and 8 CTAs, Gemma's offset,
one and many partial rows, under several schedules; and NVRTC's sm_90a SASS keeps the row in registers."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases.training import _cast, np_rms_norm_backward
from pykern.ops import training as tr
from pykern.ops.training import rms_backward_cluster_plan
from pykern.tolerance import tolerance

from family_helpers import check as _check, need as _need
from launch_spy import record_launches

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    _need("host")
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")


def _sfx(kind: str) -> str:
    return {"f32": "", "bf16": "_bf16", "f16": "_f16"}[kind]


def _run(kind: str, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch, offset: float = 0.0,
         seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    x = _cast(rng.standard_normal(shape), kind)
    w = _cast(1.0 + 0.5 * rng.standard_normal(shape[-1]), kind)
    g = _cast(rng.standard_normal(shape), kind)
    names = record_launches(monkeypatch)
    gx, gw = ops.rms_norm_backward(x, w, g, 1e-6, offset=offset, backend="host")
    rx, rw = np_rms_norm_backward(x, w, g, 1e-6, offset=offset)
    _check({"grad_x": np.asarray(gx), "grad_weight": np.asarray(gw)}, {"grad_x": rx, "grad_weight": rw},
           "rms_norm_backward", kind)
    return names


@pytest.mark.parametrize("kind,shape,cols,offset", [
    ("f32", (5, 1003), 256, 0.0),    # ragged: element path, 4 CTAs, the last one's slice short
    ("bf16", (7, 1000), 256, 1.0),   # dim % 8 == 0 but the slice (256) holds it: 16-byte path, Gemma's offset
    ("f16", (3, 2050), 512, 0.0),    # 8 CTAs of 272 columns (2050 / 8 rounded up to 16-byte chunks)
    ("f32", (6, 640), 512, 0.0),     # 2 CTAs, 16-byte f32 path
])
def test_cluster_kernel_matches_float64(kind: str, shape: tuple[int, ...], cols: int, offset: float,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # a smaller CTA capacity (the plan's _RMS_CLUSTER_COLS) makes short rows take the cluster kernel, so every
    # path runs at host-test sizes; the kernel itself sizes nothing from it
    monkeypatch.setattr(tr, "_RMS_CLUSTER_COLS", cols)
    names = _run(kind, shape, monkeypatch, offset)
    assert names[0] == "rms_norm_backward_cluster" + _sfx(kind), names
    assert not [n for n in names if n.startswith("rms_norm_backward_weight")], names


@pytest.mark.parametrize("kind,shape", [("bf16", (3, 16384)), ("f32", (2, 65536)), ("f16", (2, 20000))])
def test_wide_rows_take_the_cluster_kernel(kind: str, shape: tuple[int, ...],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # hidden 16k-64k: rows past one CTA's 8192 columns, read once (2, 8 and 4 CTAs a cluster)
    names = _run(kind, shape, monkeypatch)
    assert names == ["rms_norm_backward_cluster" + _sfx(kind)] + ["norm_grad_reduce"] * (shape[0] > 1), names


@pytest.mark.parametrize("schedule", ["reverse", "random:3"])
def test_cluster_kernel_under_other_schedules(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    monkeypatch.setattr(tr, "_RMS_CLUSTER_COLS", 256)
    assert "rms_norm_backward_cluster_bf16" in _run("bf16", (9, 1016), monkeypatch, seed=4)


def test_cluster_kernel_is_identical_run_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # every CTA combines the cluster's pairs in the same order, and the weight gradient's partial rows are added
    # in order: the same bits on every run and under every schedule
    monkeypatch.setattr(tr, "_RMS_CLUSTER_COLS", 256)
    rng = np.random.default_rng(1)
    x, g = (rng.standard_normal((11, 1000)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(1000).astype(np.float32)
    a = [np.asarray(t) for t in ops.rms_norm_backward(x, w, g, backend="host")]
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "reverse")
    b = [np.asarray(t) for t in ops.rms_norm_backward(x, w, g, backend="host")]
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_values_as_the_one_cta_kernels(bad: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # a bad x in one CTA's slice (rank 2 of 4) reaches every CTA's row statistics through the DSMEM combine: the
    # row's grad_x and the weight gradient are NaN / inf exactly where the one-CTA kernels' are
    monkeypatch.setattr(tr, "_RMS_CLUSTER_COLS", 256)
    rng = np.random.default_rng(5)
    x, g = (rng.standard_normal((4, 1000)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(1000).astype(np.float32)
    x[1, 600] = bad
    names = record_launches(monkeypatch)
    got = [np.asarray(t) for t in ops.rms_norm_backward(x, w, g, backend="host")]
    assert names[0] == "rms_norm_backward_cluster", names
    monkeypatch.setattr(tr, "_cluster_usable", lambda *a: False)
    want = [np.asarray(t) for t in ops.rms_norm_backward(x, w, g, backend="host")]
    assert names[-2:] != ["rms_norm_backward_cluster", "norm_grad_reduce"] and "rms_norm_backward" in names
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
        ok = np.isfinite(b)
        atol, rtol = tolerance("rms_norm_backward", "f32")
        np.testing.assert_allclose(a[ok], b[ok], rtol=rtol, atol=atol)
    assert np.isnan(got[0][1]).all() and np.isfinite(got[0][[0, 2, 3]]).all()


def test_cluster_plan_sizes_the_cluster_from_the_width() -> None:
    assert rms_backward_cluster_plan(100, 8192) is None  # one CTA holds it: the fused kernel
    assert rms_backward_cluster_plan(100, 8200) == (100, 2, 4112, 288)  # 117 clusters would fill the wave
    assert rms_backward_cluster_plan(4096, 16384) == (66, 2, 8192, 512)
    assert rms_backward_cluster_plan(4096, 32768) == (33, 4, 8192, 512)
    assert rms_backward_cluster_plan(4096, 65536) == (16, 8, 8192, 512)
    assert rms_backward_cluster_plan(3, 65536)[0] == 3  # no more clusters than rows
    assert rms_backward_cluster_plan(100, 65537) is None  # past 8 CTAs: the two-read kernels


def test_other_archs_keep_the_one_cta_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYKERN_HOST_ARCH")
    names = _run("bf16", (2, 16384), monkeypatch)
    assert names[:2] == ["rms_norm_backward_bf16", "rms_norm_backward_weight_bf16"], names


def test_cluster_kernel_sass_on_sm90a() -> None:
    """NVRTC's sm_90a SASS (cuobjdump, no GPU): the row's pairs travel over DSMEM (ld.shared::cluster.v2: one
    8-byte generic load, LD.E.64), barrier.cluster is the hardware cluster barrier (UCGABAR_ARV / UCGABAR_WAIT: once
    per row, once before exit), x, grad_y and the weight come in 16-byte loads and grad_x leaves in 16-byte stores
    (f32 too: no STG.E.64), no spills."""
    from collections import Counter

    from sass_helpers import compile_sass, kernel_ops

    mod, text = compile_sass(ROOT / "kernels_cu" / "norm_sm90.cu", "sm_90a")
    for k in ("rms_norm_backward_cluster", "rms_norm_backward_cluster_bf16", "rms_norm_backward_cluster_f16"):
        c = Counter(kernel_ops(text, k))
        assert c["LD.E.64"] == 1, (k, c)
        assert c["UCGABAR_ARV"] == 2 and c["UCGABAR_WAIT"] == 2, (k, c)
        assert c["LDG.E.128.CONSTANT"] >= 8, (k, c)  # x and grad_y: 2 a chunk, all the thread's chunks
        assert c["STG.E.128"] >= 2 and c["STG.E.64"] == 0, (k, c)
        assert not any(op.startswith(("LDL", "STL")) for op in c), (k, c)
        assert mod.resources[k].spill_bytes == 0, (k, mod.resources[k])
