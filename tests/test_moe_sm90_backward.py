"""The Hopper (sm_90a) backward GEMMs, kernels_cu/grouped_gemm_sm90.cu's grouped_gemm_nn_sm90 (layout "nn": B read
MN-major through the wgmma descriptor's transpose bit) and grouped_gemm_wgrad_sm90 (the K-grouped weight gradient,
A and B both MN-major, the contraction over each group's rows).

On the host backend playing sm_90a they run from `grouped_gemm(layout="nn")`, `grouped_gemm_wgrad_tc` and
`moe_experts_backward` (d(x_perm)) and match float64 within the bf16 / f16 rows: empty groups (a zero weight
gradient), one-row groups, groups under, at and over a k-block of 64 rows (the weight gradient's last k-block
reaches into the next group's rows, which the kernel must zero), N and K off the tiles, several tiles a CTA and
one CTA walking them all. What TMA cannot load (a row of N or N2 not a multiple of 8 elements) keeps the mma.sync
kernels. Mutants of the kernel source must fail; the cubin NVRTC makes for sm_90a has HGMMA with the transpose
bits, UTMALDG, SYNCS, no spills and a flat steady-state loop.
"""
from __future__ import annotations

import numpy as np
import pytest

from pykern import ops
from pykern.arrays import bfloat16
from pykern.errors import KernelExecutionError
from pykern.difftest.cases.moe import _experts_inputs, np_grouped_gemm, np_moe_experts_backward
from pykern.ops import _moe_sm90 as sm90
from launch_spy import record_launches as _record
from attn_checks import sm90_host  # noqa: F401 (a fixture)
from test_moe_sm90 import LOOP_BAR, _close, _dt, _mutant, _sass
from sass_helpers import kernel_ops as _ops

HOST = "host"
pytestmark = pytest.mark.usefixtures("sm90_host")


def _offsets(sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)


def _nn_inputs(sizes, n: int, k: int, kind: str, seed: int = 0):
    rng = np.random.default_rng(seed + sum(sizes) + n + k)
    off = _offsets(sizes)
    a = rng.standard_normal((int(off[-1]), k)).astype(_dt(kind))
    b = (rng.standard_normal((len(sizes), k, n)) / np.sqrt(k)).astype(_dt(kind))
    return a, b, off


def _np_nn(a, b, off) -> np.ndarray:
    # a @ b[e] with b [E, K, N] is the "nt" product against b transposed
    return np_grouped_gemm(a, np.swapaxes(np.asarray(b), 1, 2), off)


def _wgrad_inputs(sizes, n1: int, n2: int, kind: str, seed: int = 0):
    rng = np.random.default_rng(seed + sum(sizes) + n1 + n2)
    off = _offsets(sizes)
    a = rng.standard_normal((int(off[-1]), n1)).astype(_dt(kind))
    b = rng.standard_normal((int(off[-1]), n2)).astype(_dt(kind))
    return a, b, off


def _np_wgrad(a, b, off) -> np.ndarray:
    a, b = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    return np.stack([a[off[e]:off[e + 1]].T @ b[off[e]:off[e + 1]] for e in range(len(off) - 1)])


# --------------------------------------------------------------------------- layout "nn" vs float64
NN_SHAPES = [  # (group sizes, N, K)
    ([130, 0, 5, 200], 136, 72),           # empty group, a group under a tile, N and K off the tiles
    ([1, 0, 0, 300, 1], 520, 200),         # one-row groups, 3 column tiles (the last partial: 2 of 4 boxes empty)
    ([3, 17, 0, 40, 1, 9, 0, 128], 24, 8),  # many small groups, one k-step, N under one 64-column box
]


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("shape", NN_SHAPES, ids=lambda s: f"{len(s[0])}g{sum(s[0])}x{s[1]}x{s[2]}")
def test_grouped_gemm_nn_sm90_vs_float64(shape, kind, monkeypatch) -> None:
    sizes, n, k = shape
    a, b, off = _nn_inputs(sizes, n, k, kind)
    names = _record(monkeypatch)
    out = ops.grouped_gemm(a, b, off, layout="nn", backend=HOST)
    assert out.dtype == _dt(kind) and out.shape == (off[-1], n)
    _close(out, _np_nn(a, b, off), "grouped_gemm", kind)
    assert names == [f"grouped_gemm_nn_sm90_{kind}"]


@pytest.mark.parametrize("schedule", ["reverse", "random:3"])
def test_grouped_gemm_nn_sm90_under_other_schedules_and_one_cta(schedule, monkeypatch) -> None:
    monkeypatch.setattr(sm90, "HOST_CTAS", 1)  # one CTA: the ring's phases carry across tiles and groups
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    a, b, off = _nn_inputs([60, 0, 200, 7], 264, 136, "f16", seed=2)
    names = _record(monkeypatch)
    _close(ops.grouped_gemm(a, b, off, layout="nn", backend=HOST), _np_nn(a, b, off), "grouped_gemm", "f16")
    assert names == ["grouped_gemm_nn_sm90_f16"]


def test_nn_rows_tma_cannot_load_keep_mma_sync(monkeypatch) -> None:
    # N = 20: b's rows (20 halves) are no multiple of 16 bytes, so no tensor map; still right on grouped_gemm_tc_nn
    a, b, off = _nn_inputs([30, 0, 40], 20, 64, "bf16", seed=4)
    names = _record(monkeypatch)
    _close(ops.grouped_gemm(a, b, off, layout="nn", backend=HOST), _np_nn(a, b, off), "grouped_gemm", "bf16")
    assert names == ["grouped_gemm_tc_nn_bf16"]


# --------------------------------------------------------------------------- the weight gradient vs float64
WGRAD_SHAPES = [  # (group sizes, N1, N2)
    ([130, 0, 5, 64, 1], 136, 264),        # partial k-blocks followed by other groups' rows, exactly one k-block
    ([0, 0, 0, 200], 64, 8),               # leading empty groups, 4 k-blocks (the last partial), tiny N2
    ([3, 17, 0, 40, 1, 9, 0, 128, 2], 24, 40),  # many small groups: every tile's only k-block is partial
]


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("shape", WGRAD_SHAPES, ids=lambda s: f"{len(s[0])}g{sum(s[0])}x{s[1]}x{s[2]}")
def test_grouped_gemm_wgrad_sm90_vs_float64(shape, kind, monkeypatch) -> None:
    sizes, n1, n2 = shape
    a, b, off = _wgrad_inputs(sizes, n1, n2, kind)
    names = _record(monkeypatch)
    out = ops.grouped_gemm_wgrad_tc(a, b, off, backend=HOST)
    assert out.dtype == _dt(kind) and out.shape == (len(sizes), n1, n2)
    ref = _np_wgrad(a, b, off)
    _close(out, ref, "grouped_gemm", kind)
    assert names == [f"grouped_gemm_wgrad_sm90_{kind}"]
    for e, s in enumerate(sizes):
        if s == 0:
            assert not np.asarray(out[e]).astype(np.float64).any()  # an empty group: exact zeros


@pytest.mark.parametrize("schedule", ["reverse", "random:5"])
def test_grouped_gemm_wgrad_sm90_schedules_one_cta_and_a_full_out(schedule, monkeypatch) -> None:
    # the kernel writes every element of out (zeros for the empty group), from one CTA walking all tiles
    monkeypatch.setattr(sm90, "HOST_CTAS", 1)
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    a, b, off = _wgrad_inputs([70, 0, 3, 130], 200, 72, "bf16", seed=7)
    out = np.full((4, 200, 72), 7.0).astype(bfloat16())
    assert sm90.try_launch_wgrad(a, b, off, out, int(off[-1]), 200, 72, 4, "bf16", None, HOST)
    _close(out, _np_wgrad(a, b, off), "grouped_gemm", "bf16")


def test_wgrad_rows_tma_cannot_load_keep_mma_sync(monkeypatch) -> None:
    a, b, off = _wgrad_inputs([30, 0, 40], 20, 24, "f16", seed=8)  # N1 = 20: rows of 40 bytes
    names = _record(monkeypatch)
    _close(ops.grouped_gemm_wgrad_tc(a, b, off, backend=HOST), _np_wgrad(a, b, off), "grouped_gemm", "f16")
    assert names == ["grouped_gemm_wgrad_tc_f16"]


# --------------------------------------------------------------------------- moe_experts_backward
@pytest.mark.parametrize("kind,act", [("bf16", "silu"), ("f16", "gelu_tanh")])
def test_experts_backward_sm90_vs_float64(kind, act, monkeypatch) -> None:
    # d(x_perm) = d(gate_up) @ gate_up_proj[e] (layout "nn") runs on the sm_90a kernel
    rng = np.random.default_rng(8)
    x, gu, dn, ids, w, dy = _experts_inputs(rng, kind, 40, 32, 24, 4, 2)
    names = _record(monkeypatch)
    got = ops.moe_experts_backward(dy, x, gu, dn, ids, w, act, backend=HOST)
    # the split-precision products (y, the weight gradients) run their wgmma forms: no mma.sync kernel is left
    assert f"grouped_gemm_nn_sm90_{kind}" in names and [n for n in names if "split" in n and "sm90" in n] == [
        f"grouped_gemm_sm90_split_f32out_{kind}", f"grouped_gemm_wgrad_sm90_split_ab_{kind}",
        f"grouped_gemm_wgrad_sm90_split_a_{kind}"], names
    assert not [n for n in names if "_tc_" in n], names
    for g, r in zip(got, np_moe_experts_backward(dy, x, gu, dn, ids, w, act)):
        _close(g, r, "moe_experts_backward", kind)


# --------------------------------------------------------------------------- a broken kernel is caught
@pytest.mark.parametrize("old,new", [
    # B of layout "nn" is MN-major: without the transpose bit wgmma reads it K-major
    ("Gg90Dt<T>::V, KGROUP ? 1 : 0, B_MN ? 1 : 0>(", "Gg90Dt<T>::V, KGROUP ? 1 : 0, 0>("),
    # a k-step of an MN-major tile is 16 rows of 128 bytes further, not 32 bytes
    ("B_STEP = B_MN ? 16 * 128 : 32;", "B_STEP = 32;"),
], ids=["transpose-bit", "k-step"])
def test_a_broken_nn_kernel_fails(old, new, tmp_path, monkeypatch) -> None:
    _mutant(tmp_path, monkeypatch, old, new)
    a, b, off = _nn_inputs([130, 0, 5, 200], 136, 72, "bf16")
    # (a wrong layout reads wrong elements, or past the block's shared memory: the host reports that)
    with pytest.raises((AssertionError, KernelExecutionError), match="off, max err|outside the block's shared"):
        _close(ops.grouped_gemm(a, b, off, layout="nn", backend=HOST), _np_nn(a, b, off), "grouped_gemm", "bf16")


@pytest.mark.parametrize("old,new", [
    # the last k-block's rows past the group's end belong to the next group: they must be zeroed
    ("        if (piece / 8 >= valid)", "        if (piece / 8 >= 64)"),
    # the partial last k-block must run at all
    ("                if (KGROUP && full_k < tk) kblock(full_k, true, full_k == kfirst);", ""),
    # an empty group's accumulators must be zeros, not whatever the previous tile left
    ("            for (int i = 0; i < GG90_BN / 2; i++) acc[i] = 0.f;", ""),
], ids=["zero-rows", "tail-block", "empty-group"])
def test_a_broken_wgrad_kernel_fails(old, new, tmp_path, monkeypatch) -> None:
    _mutant(tmp_path, monkeypatch, old, new)
    monkeypatch.setattr(sm90, "HOST_CTAS", 1)  # (one CTA: an empty group's tile follows a computed one)
    a, b, off = _wgrad_inputs([130, 0, 5, 64, 1], 136, 264, "bf16")
    # (a consumer that skips a k-block the producer loaded leaves the ring's phases behind: a reported deadlock)
    with pytest.raises((AssertionError, KernelExecutionError), match="off, max err|deadlock"):
        _close(ops.grouped_gemm_wgrad_tc(a, b, off, backend=HOST), _np_wgrad(a, b, off), "grouped_gemm", "bf16")


# --------------------------------------------------------------------------- SASS (NVRTC, no GPU)
KERNELS = [f"grouped_gemm_{n}_sm90_{t}" for n in ("nn", "wgrad") for t in ("bf16", "f16")]


def _hgmma_lines(text: str, kernel: str) -> list[str]:
    body = text.split(f"Function : {kernel}\n", 1)[1].split("Function :", 1)[0]
    return [line for line in body.splitlines() if "HGMMA." in line]


@pytest.mark.parametrize("kernel", KERNELS)
def test_sass_hopper_instructions_and_no_spills(kernel: str) -> None:
    mod, text, _ = _sass()
    ops_ = _ops(text, kernel)
    f16 = kernel.endswith("_f16")
    hg = [op for op in ops_ if op.startswith("HGMMA")]
    assert hg and set(hg) == {"HGMMA.64x256x16.F32" + ("" if f16 else ".BF16")}, set(hg)
    # the operand majorness sits in the descriptor's transpose bits: B always, A for the weight gradient
    want = ".tnspA.tnspB" if "wgrad" in kernel else ".tnspB"
    assert all(want in line for line in _hgmma_lines(text, kernel))
    if "wgrad" in kernel:
        assert sum(op == "UTMALDG.2D" for op in ops_) >= 6  # A: 2 boxes, B: 4
    else:
        assert sum(op == "UTMALDG.2D" for op in ops_) >= 1 and sum(op == "UTMALDG.3D" for op in ops_) >= 4
    assert sum(op.startswith("SYNCS") for op in ops_) >= 4
    assert "USETMAXREG.DEALLOC.CTAPOOL" in ops_ and "USETMAXREG.TRY_ALLOC.CTAPOOL" in ops_
    assert not [op for op in ops_ if op.startswith(("LDL", "STL"))]
    res = mod.resources[kernel]
    assert res.spill_stores == 0 and res.spill_loads == 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_steady_state_loop_is_flat_and_within_the_bar(kernel: str) -> None:
    _, _, loops = _sass()
    loop = loops[kernel]
    # one k-block a trip: 4 HGMMA m64n256k16; the weight gradient's zeroing (and its barrier) stays out of it
    assert loop["mma"] == 4 * sm90.BN / 8
    assert loop["bar"] == 0 and loop["ldsm"] == 0 and loop["ldgsts"] == 0
    assert loop["per_mma"] <= LOOP_BAR, loop
