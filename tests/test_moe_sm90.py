"""The Hopper (sm_90a) grouped GEMM, kernels_cu/grouped_gemm_sm90.cu (TMA + wgmma, warp-specialised, persistent).

On the host backend playing sm_90a (PYKERN_HOST_ARCH=sm_90a: TMA, mbarrier and wgmma emulated) `grouped_gemm`
(layout "nt") and `moe_experts` (both grouped GEMMs, the gate_up one with the activation fused) run it and
match float64 within the bf16 / f16 rows: empty groups, groups smaller than a tile and of one row, many groups,
N and K off the tiles (K a multiple of 8), several tiles a CTA (the host's persistent grid has 3 CTAs). What it
does not take (K % 8 != 0, a base off 16 bytes) keeps the mma.sync kernels, also correct. From the
cubin NVRTC makes for sm_90a (no GPU needed): HGMMA, UTMALDG, SYNCS, setmaxnreg, no spills, and a flat
steady-state loop within the bar.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from pykern import ops
from pykern.arrays import bfloat16
from pykern.difftest.cases.moe import _experts_inputs, np_grouped_gemm, np_moe_experts
from pykern.errors import KernelExecutionError
from pykern.ops import _moe_sm90 as sm90
from launch_spy import record_launches as _record
from attn_checks import sm90_host  # noqa: F401 (a fixture)
from sass_helpers import compile_sass, kernel_ops, report, tanhf_lines
from family_helpers import close_elementwise as _close
from sm90_mutants import launch_mutants

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "kernels_cu" / "grouped_gemm_sm90.cu"
HOST = "host"
pytestmark = pytest.mark.usefixtures("sm90_host")


def _dt(kind: str):
    return bfloat16() if kind == "bf16" else np.float16


def _gemm_inputs(sizes, n: int, k: int, kind: str, seed: int = 0):
    rng = np.random.default_rng(seed + sum(sizes) + n + k)
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    a = rng.standard_normal((int(off[-1]), k)).astype(_dt(kind))
    b = (rng.standard_normal((len(sizes), n, k)) / np.sqrt(k)).astype(_dt(kind))
    return a, b, off


# --------------------------------------------------------------------------- grouped_gemm vs float64
SHAPES = [  # (group sizes, N, K)
    ([130, 0, 5, 200], 136, 72),           # empty group, a group under a tile, N and K off the tiles
    ([1, 0, 0, 300, 1], 520, 200),         # one-row groups, 3 column tiles (the last partial), 4 k-blocks
    ([257], 256, 64),                      # one group of 3 row tiles: every CTA of the host grid works
    ([3, 17, 0, 40, 1, 9, 0, 128, 64, 2, 5, 77, 0, 31], 24, 8),  # many small groups, one k-step block, tiny N
    ([0, 0, 0], 40, 16),                   # no rows at all
]


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s[0])}g{sum(s[0])}x{s[1]}x{s[2]}")
def test_grouped_gemm_sm90_vs_float64(shape, kind, monkeypatch) -> None:
    sizes, n, k = shape
    a, b, off = _gemm_inputs(sizes, n, k, kind)
    names = _record(monkeypatch)
    out = ops.grouped_gemm(a, b, off, backend=HOST)
    assert out.dtype == _dt(kind) and out.shape == (off[-1], n)
    _close(out, np_grouped_gemm(a, b, off), "grouped_gemm", kind)
    assert names == ([f"grouped_gemm_sm90_{kind}"] if off[-1] else [])


@pytest.mark.parametrize("schedule", ["reverse", "random:3"])
def test_grouped_gemm_sm90_under_other_thread_schedules(schedule, monkeypatch) -> None:
    a, b, off = _gemm_inputs([130, 0, 70], 300, 136, "bf16", seed=1)
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    names = _record(monkeypatch)
    _close(ops.grouped_gemm(a, b, off, backend=HOST), np_grouped_gemm(a, b, off), "grouped_gemm", "bf16")
    assert names == ["grouped_gemm_sm90_bf16"]


def test_grouped_gemm_sm90_with_one_cta_walking_every_tile(monkeypatch) -> None:
    # a persistent grid of one CTA: the ring's stages and phases carry across tiles and groups
    monkeypatch.setattr(sm90, "HOST_CTAS", 1)
    a, b, off = _gemm_inputs([60, 0, 200, 7], 260, 264, "f16", seed=2)
    names = _record(monkeypatch)
    _close(ops.grouped_gemm(a, b, off, backend=HOST), np_grouped_gemm(a, b, off), "grouped_gemm", "f16")
    assert names == ["grouped_gemm_sm90_f16"]


def test_grouped_gemm_sm90_writes_only_its_rows_into_out(monkeypatch) -> None:
    # boxes past a group's end load the next group's rows; the epilogue must not store them (nor past M)
    a, b, off = _gemm_inputs([5, 130, 3], 40, 64, "bf16", seed=3)
    out = np.full((int(off[-1]), 40), 7.0).astype(bfloat16())
    ops.grouped_gemm(a, b, off, out=out, backend=HOST)
    _close(out, np_grouped_gemm(a, b, off), "grouped_gemm", "bf16")


# --------------------------------------------------------------------------- where it does not apply
def test_what_tma_cannot_load_keeps_mma_sync(monkeypatch) -> None:
    # K % 8 != 0: a row stride TMA cannot take; a base off 16 bytes; all still right (layout "nn" has its own
    # sm_90a kernel: tests/test_moe_sm90_backward.py)
    a, b, off = _gemm_inputs([30, 0, 40], 24, 20, "bf16", seed=4)
    names = _record(monkeypatch)
    _close(ops.grouped_gemm(a, b, off, backend=HOST), np_grouped_gemm(a, b, off), "grouped_gemm", "bf16")
    assert names == ["grouped_gemm_tc_bf16"]

    rng = np.random.default_rng(5)
    buf = rng.standard_normal(70 * 64 + 1).astype(bfloat16())
    a2 = buf[1:].reshape(70, 64)
    assert a2.ctypes.data % 16
    b2 = (rng.standard_normal((2, 40, 64)) / 8).astype(bfloat16())
    off2 = np.array([0, 30, 70], np.int32)
    names.clear()
    _close(ops.grouped_gemm(a2, b2, off2, backend=HOST), np_grouped_gemm(a2, b2, off2), "grouped_gemm", "bf16")
    assert names == ["grouped_gemm_tc_bf16"]

    bnn = np.ascontiguousarray(b2.transpose(0, 2, 1))
    names.clear()  # the unaligned base with layout "nn" as well
    _close(ops.grouped_gemm(a2, bnn, off2, layout="nn", backend=HOST), np_grouped_gemm(a2, b2, off2),
           "grouped_gemm", "bf16")
    assert names == ["grouped_gemm_tc_nn_bf16"]


def test_other_archs_keep_mma_sync(monkeypatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_89")
    a, b, off = _gemm_inputs([30, 40], 24, 64, "f16", seed=6)
    names = _record(monkeypatch)
    _close(ops.grouped_gemm(a, b, off, backend=HOST), np_grouped_gemm(a, b, off), "grouped_gemm", "f16")
    assert names == ["grouped_gemm_tc_f16"]


# --------------------------------------------------------------------------- moe_experts
@pytest.mark.parametrize("kind,act", [("bf16", "silu"), ("bf16", "gelu_tanh"), ("f16", "silu"),
                                      ("f16", "gelu_tanh")])
def test_experts_sm90_vs_float64(kind, act, monkeypatch) -> None:
    # intermediate 200: the gate box of the last column tile reaches into the up rows (not stored); hidden 72
    rng = np.random.default_rng(8)
    x, gu, dn, ids, w, _ = _experts_inputs(rng, kind, 150, 72, 200, 5, 2)
    names = _record(monkeypatch)
    out = ops.moe_experts(x, gu, dn, ids, w, act, backend=HOST)
    _close(out, np_moe_experts(x, gu, dn, ids, w, act), "moe_experts", kind)
    assert f"moe_gemm_act_sm90_{kind}" in names and f"grouped_gemm_sm90_{kind}" in names
    assert not [n for n in names if "_tc_" in n], names


def test_experts_sm90_many_experts_one_token_each(monkeypatch) -> None:
    rng = np.random.default_rng(9)
    x, gu, dn, ids, w, _ = _experts_inputs(rng, "bf16", 12, 32, 24, 40, 4)
    names = _record(monkeypatch)
    _close(ops.moe_experts(x, gu, dn, ids, w, backend=HOST), np_moe_experts(x, gu, dn, ids, w), "moe_experts",
           "bf16")
    assert "moe_gemm_act_sm90_bf16" in names


def test_torch_experts_take_the_sm90_kernels(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    from pykern.torch import moe_experts

    rng = np.random.default_rng(11)
    x, gu, dn, ids, w, _ = _experts_inputs(rng, "bf16", 20, 32, 40, 4, 2)
    t = lambda a: torch.from_numpy(np.asarray(a).view(np.int16)).view(torch.bfloat16)  # noqa: E731
    names = _record(monkeypatch)
    monkeypatch.setenv("PYKERN_BACKEND", HOST)
    out = moe_experts(t(x), t(gu), t(dn), torch.from_numpy(ids), torch.from_numpy(w))
    got = out.float().numpy()
    _close(got, np_moe_experts(x, gu, dn, ids, w), "moe_experts", "bf16")
    assert "moe_gemm_act_sm90_bf16" in names and "grouped_gemm_sm90_bf16" in names


# --------------------------------------------------------------------------- a broken kernel is caught
def _mutant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    """A copy of the kernel source with `old` replaced (once), its kernels taking the real names' place: the op
    launches the copy (PYKERN_KERNEL_PATH folders are searched, names renamed back by the spy)."""
    launch_mutants(tmp_path, monkeypatch, SRC, old, new, "gg90_mutant.cu", "_sm90", "_mutant90")


def test_the_unmutated_copy_runs(tmp_path, monkeypatch) -> None:
    _mutant(tmp_path, monkeypatch, "#define GG90_RASTER 8", "#define GG90_RASTER 8")
    a, b, off = _gemm_inputs([130, 0, 5, 200], 300, 72, "bf16")
    _close(ops.grouped_gemm(a, b, off, backend=HOST), np_grouped_gemm(a, b, off), "grouped_gemm", "bf16")


@pytest.mark.parametrize("old,new", [
    # the raster walks a band's row tiles with the column tile fixed; a wrong column decode misses tiles
    ("    x.nt = r / rows;", "    x.nt = r % n_tiles;"),
    # the epilogue must stop at the group's end
    ("    const int mend = KGROUP ? M : min(x.mend, M);", "    const int mend = M;"),
    # the act epilogue pairs accumulator j (gate) with j + BN/16 (up)
    ("4 * (j + GG90_BN / 16) + 2 * r;", "4 * j + 2 * r;"),
], ids=["raster", "row-bound", "act-pairing"])
def test_a_broken_kernel_fails_the_checks(old, new, tmp_path, monkeypatch) -> None:
    _mutant(tmp_path, monkeypatch, old, new)
    rng = np.random.default_rng(12)
    x, gu, dn, ids, w, _ = _experts_inputs(rng, "bf16", 150, 72, 200, 5, 2)
    a, b, off = _gemm_inputs([130, 0, 5, 200], 300, 72, "bf16")
    # out starts as NaN: a tile the mutant never writes must not pass on what a freed buffer of an earlier
    # test (the same product, computed right) left in memory that np.empty hands back.
    out = np.full((int(off[-1]), b.shape[1]), np.nan, np.float32).astype(_dt("bf16"))
    with pytest.raises(AssertionError, match="off, max err"):
        _close(ops.grouped_gemm(a, b, off, out=out, backend=HOST), np_grouped_gemm(a, b, off), "grouped_gemm",
               "bf16")
        _close(ops.moe_experts(x, gu, dn, ids, w, backend=HOST), np_moe_experts(x, gu, dn, ids, w),
               "moe_experts", "bf16")


def test_a_consumer_that_skips_the_full_barrier_wait_is_reported(tmp_path, monkeypatch) -> None:
    _mutant(tmp_path, monkeypatch,
            "            if (!pk_mbarrier_try_wait_parity(&full[s], ph)) pk_mbarrier_wait_parity(&full[s], ph);\n", "")
    a, b, off = _gemm_inputs([30, 40], 24, 64, "bf16")
    with pytest.raises(KernelExecutionError):
        ops.grouped_gemm(a, b, off, backend=HOST)


# --------------------------------------------------------------------------- SASS (NVRTC, no GPU)
KERNELS = [f"{n}_sm90_{t}" for n in ("grouped_gemm", "moe_gemm_act") for t in ("bf16", "f16")]
LOOP_BAR = 0.46  # warp-instructions per m16n8k16-equivalent (today 0.445; CUTLASS 3.x's consumer loop: 0.35-0.70)


@lru_cache(maxsize=None)
def _sass():
    mod, text = compile_sass(SRC, "sm_90a")
    return mod, text, report().steady_state_loops(text)


@pytest.mark.parametrize("kernel", KERNELS)
def test_sass_hopper_instructions_and_no_spills(kernel: str) -> None:
    mod, text, _ = _sass()
    ops_ = kernel_ops(text, kernel)
    f16 = kernel.endswith("_f16")
    hg = [op for op in ops_ if op.startswith("HGMMA")]
    assert hg and set(hg) == {"HGMMA.64x256x16.F32" + ("" if f16 else ".BF16")}, set(hg)
    assert sum(op == "UTMALDG.2D" for op in ops_) >= 1 and sum(op == "UTMALDG.3D" for op in ops_) >= 2  # A; B
    assert sum(op.startswith("SYNCS") for op in ops_) >= 4  # mbarrier init / arrive(.expect_tx) / try_wait
    assert "USETMAXREG.DEALLOC.CTAPOOL" in ops_ and "USETMAXREG.TRY_ALLOC.CTAPOOL" in ops_
    assert not [op for op in ops_ if op.startswith(("LDL", "STL"))]
    res = mod.resources[kernel]
    assert res.spill_stores == 0 and res.spill_loads == 0


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k.startswith("moe_gemm_act")])
def test_gate_up_epilogue_calls_no_tanhf(kernel: str) -> None:
    # the fused act(gate) * up epilogue's gelu_tanh is pk_gelu_tanh_s (one ex2, one rcp), not tanhf
    _, text, _ = _sass()
    assert not tanhf_lines(text, kernel), tanhf_lines(text, kernel)[:4]
    assert "MUFU.EX2" in kernel_ops(text, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_steady_state_loop_is_flat_and_within_the_bar(kernel: str) -> None:
    _, _, loops = _sass()
    loop = loops[kernel]  # a loop with HGMMAs and no inner loop exists (the mbarrier retry lies outside it)
    # one k-block a trip: 4 HGMMA m64n256k16 = 4 * 256 / 8 m16n8k16-equivalents a warp
    assert loop["mma"] == 4 * sm90.BN / 8
    assert loop["bar"] == 0 and loop["ldsm"] == 0 and loop["ldgsts"] == 0
    assert loop["per_mma"] <= LOOP_BAR, loop
