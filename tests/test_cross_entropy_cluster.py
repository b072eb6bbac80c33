"""The sm_90 cross-entropy (cross_entropy_fwd_bwd_cluster): a thread-block cluster holds each row in shared memory,
so the logits are read once. On the host backend playing Hopper (PYKERN_HOST_ARCH=sm_90a) the op must launch it
(never the two-sweep kernel) and agree with the float64 reference within the op's tolerance rows, on ragged
vocabularies, ignore_index rows, every option, in place, under several schedules and under racecheck."""
from __future__ import annotations

import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases import training as T
from pykern.ops.training import cross_entropy_cluster_plan

from family_helpers import check as _check, need as _need
from launch_spy import record_launches

ALL = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 30.0}


@pytest.fixture(autouse=True)
def _hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    _need("host")
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")


def _run(kind: str, vocab: int, rows: int, opts: dict, monkeypatch: pytest.MonkeyPatch, pad_id: int = -100,
         inplace: bool = False, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    x = T._cast(3.0 * rng.standard_normal((rows, vocab)), kind)
    t = rng.integers(0, vocab, size=rows).astype(np.int64)
    t[1::3] = pad_id  # ignore_index rows between live ones
    if "weight" in opts:
        opts = dict(opts, weight=rng.uniform(0.25, 2.0, vocab).astype(np.float32))
        if opts.get("reduction") == "none":
            opts["grad_output"] = rng.standard_normal(rows).astype(np.float32)
    ref = T.np_cross_entropy(x, t, pad_id, **opts)  # before an in-place run overwrites x
    names = record_launches(monkeypatch)
    out = ops.cross_entropy_fwd_bwd(x, t, ignore_index=pad_id, inplace=inplace, backend="host", **opts)
    got = {"loss": np.asarray(out[0]), "grad": np.asarray(out[1])}
    want = {"loss": ref[0], "grad": ref[1]}
    if len(out) > 2:
        got["z_loss"], want["z_loss"] = np.asarray(out[2]), ref[2]
    _check(got, want, "cross_entropy_fwd_bwd", kind)
    return names


def _sfx(kind: str) -> str:
    return {"f32": "", "bf16": "_bf16", "f16": "_f16"}[kind]


@pytest.mark.parametrize("kind,vocab,opts", [
    ("f32", 1003, {}),                                   # ragged: element copies, slices not 16-byte multiples
    ("bf16", 333, ALL),
    ("f16", 255, {"reduction": "none", "softcap": 5.0}),
    ("bf16", 4096, ALL),                                 # 16-byte cp.async path
    ("f32", 2048, {"reduction": "sum", "z_loss": 1e-2, "return_z_loss": True}),
    ("bf16", 264, {"weight": "rand", "reduction": "none", "label_smoothing": 0.1}),
    ("f32", 257, {"weight": "rand", "label_smoothing": 0.1, "z_loss": 1e-2}),
    ("bf16", 50000, {"label_smoothing": 0.1}),           # 100 KB rows: a cluster of 4
])
def test_cluster_kernel_matches_float64(kind: str, vocab: int, opts: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    names = _run(kind, vocab, 7, opts, monkeypatch)
    assert "cross_entropy_fwd_bwd_cluster" + _sfx(kind) in names
    assert "cross_entropy_fwd_bwd" + _sfx(kind) not in names


@pytest.mark.parametrize("schedule", ["reverse", "random:7", "interleave"])
def test_cluster_kernel_under_other_schedules(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    names = _run("bf16", 1000, 9, ALL, monkeypatch, seed=3)
    assert "cross_entropy_fwd_bwd_cluster_bf16" in names


def test_cluster_kernel_is_racecheck_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    # several rows a cluster (grid-strided): the partials' double buffer and the slice's reuse are checked too
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    monkeypatch.setattr("pykern.ops.training.GRID_X_MAX", 4)
    names = _run("bf16", 520, 6, ALL, monkeypatch, seed=4)
    assert "cross_entropy_fwd_bwd_cluster_bf16" in names


def test_cluster_kernel_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    names = _run("f32", 3000, 5, {"label_smoothing": 0.1}, monkeypatch, inplace=True, seed=5)
    assert "cross_entropy_fwd_bwd_cluster" in names


def test_cluster_kernel_bad_target_rows_are_nan_on_every_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    # a device-side bad target (here: a host array whose check the kernel repeats) gives its whole row NaN
    from pykern.launcher import launch

    x = np.random.default_rng(6).standard_normal((2, 1000)).astype(np.float32)
    grad, loss = np.zeros_like(x), np.zeros(2, np.float32)
    nc, slice_, threads = cross_entropy_cluster_plan(1000, 4)
    one = np.ones(2, np.float32)
    launch("cross_entropy_fwd_bwd_cluster", (2 * nc,), (threads,), x, np.array([5, 1000]), grad, loss, one, one,
           one, one, 2, 1000, slice_, -100, 0.0, 0.0, 0.0, 0, shared_mem=slice_ * 4, cluster=(nc, 1, 1),
           backend="host")
    assert np.isnan(grad[1]).all() and np.isnan(loss[1])
    assert np.isfinite(grad[0]).all() and np.isfinite(loss[0])


def test_cluster_plan_sizes_the_cluster_from_the_vocab() -> None:
    assert cross_entropy_cluster_plan(131072, 2) == (8, 16384, 512)  # 128k bf16: 8 CTAs of 32 KiB (QuACK's)
    assert cross_entropy_cluster_plan(32000, 2) == (2, 16000, 512)
    assert cross_entropy_cluster_plan(131072, 4) == (8, 16384, 512)  # f32: 64 KiB a CTA
    assert cross_entropy_cluster_plan(100, 2) == (2, 56, 32)
    assert cross_entropy_cluster_plan(262144 * 2, 4) is None  # 256 KiB a CTA at 8: the two-sweep kernel


def test_rows_too_wide_for_the_cluster_take_the_two_sweep_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pykern.ops.training.CE_CLUSTER_SMEM_MAX", 1024)  # a small stand-in for 200 KiB
    names = _run("f32", 3000, 3, {}, monkeypatch)
    assert "cross_entropy_fwd_bwd" in names and "cross_entropy_fwd_bwd_cluster" not in names


def test_other_archs_keep_the_two_sweep_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_80")
    names = _run("bf16", 1000, 3, {}, monkeypatch)
    assert "cross_entropy_fwd_bwd_bf16" in names and "cross_entropy_fwd_bwd_cluster_bf16" not in names


def test_cluster_kernel_sass_on_sm90a() -> None:
    """NVRTC's sm_90a SASS (cuobjdump, no GPU): the slice arrives by 16-byte cp.async (LDGSTS.128), the partials
    travel over DSMEM (ld.shared::cluster.v2: generic 8-byte loads, LD.E.64, two a lane), barrier.cluster is the
    hardware cluster barrier (UCGABAR_ARV / UCGABAR_WAIT: once per row, once before exit), the gradient sweep reads
    the slice from shared memory (LDS.128) and stores 16 bytes at a time (STG.E.128, no STG.E.64), no spills."""
    import re
    from collections import Counter
    from pathlib import Path

    from sass_helpers import compile_sass

    mod, text = compile_sass(Path(__file__).resolve().parent.parent / "kernels_cu" / "cross_entropy_sm90.cu", "sm_90a")
    sass: dict[str, Counter] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = sass.setdefault(m.group(1), Counter())
            continue
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)", line)
        if m and cur is not None:
            cur[m.group(1)] += 1
    for k in ("cross_entropy_fwd_bwd_cluster", "cross_entropy_fwd_bwd_cluster_bf16", "cross_entropy_fwd_bwd_cluster_f16"):
        c = sass[k]
        assert c["LDGSTS.E.BYPASS.128"] >= 1, (k, c)
        assert c["LD.E.64"] == 2, (k, c)
        assert c["UCGABAR_ARV"] == 2 and c["UCGABAR_WAIT"] == 2, (k, c)
        assert c["LDS.128"] >= 2, (k, c)
        # the vector gradient sweep's one store a chunk is 16 bytes for every dtype (f32's float4 store was split
        # into two STG.E.64 by NVVM)
        assert c["STG.E.128"] >= 1 and c["STG.E.64"] == 0, (k, c)
        assert not any(op.startswith(("LDL", "STL")) for op in c), (k, c)
        assert mod.resources[k].spill_bytes == 0, (k, mod.resources[k])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_cluster_kernel_non_finite_logits_as_the_two_sweep_kernel(bad: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # a bad logit in one CTA's slice (rank 1 of 2) reaches the row's loss and gradient through the DSMEM combine
    # exactly as through the one-CTA kernel's block reduction; row 2 is -inf only
    x = np.random.default_rng(8).standard_normal((4, 1000)).astype(np.float32)
    x[0, 700] = bad
    x[1, 3] = bad
    x[2, :] = -np.inf
    t = np.array([700, 5, 1, 9])
    names = record_launches(monkeypatch)
    got = [np.asarray(a) for a in ops.cross_entropy_fwd_bwd(x, t, reduction="none", label_smoothing=0.1,
                                                            backend="host")]
    assert "cross_entropy_fwd_bwd_cluster" in names
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_80")
    want = [np.asarray(a) for a in ops.cross_entropy_fwd_bwd(x, t, reduction="none", label_smoothing=0.1,
                                                             backend="host")]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(np.isposinf(g), np.isposinf(w))
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w))
    assert np.isnan(got[0][2]) and not np.isfinite(got[0][0])
