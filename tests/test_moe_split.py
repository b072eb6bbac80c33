"""The split-precision tensor-core products of the experts backward (kernels_cu/moe.cu: moe_split16,
grouped_gemm_tc_split_f32out, grouped_gemm_wgrad_tc_split_a / _ab; kernels_cu/grouped_gemm_sm90.cu: their wgmma
forms grouped_gemm_sm90_split_f32out, grouped_gemm_wgrad_sm90_split_a / _ab).

y = h @ down_proj[e]^T and the two weight gradients take fp32 intermediates (h, w * dy, d(gate_up)) as hi + lo 16-bit
planes. Held here, on the host backend (sm_80, and playing sm_90a, where the wgmma forms run): the planes are what
moe_split16 says (hi the rounding, lo the scaled remainder; the f16 lo parts scaled by 2^11 so that small values keep
their bits), the split is necessary (the same kernels with the lo planes zeroed, i.e. one 16-bit rounding, miss the
float64 rows), mutants of the sm_90a kernels (a lo pass dropped or reading a hi plane, the f16 lo sum left scaled)
miss the rows, and the SASS runs HMMA (sm_80) / HGMMA and no HMMA (sm_90a) without spills. tests/test_moe_f32out.py
holds the backward's accuracy and its ordered kernel list.
"""
from __future__ import annotations

import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases.moe import _experts_inputs, np_moe_experts_backward
from pykern.ops import moe as moe_mod
from pykern.tolerance import tolerance

from test_moe_f32out import ARCHS, HOST, _arch, _dt

NAMES = ("grad_x", "grad_gate_up_proj", "grad_down_proj", "grad_topk_weights")


def _worst(got, ref, kind: str) -> list[float]:
    atol, rtol = tolerance("moe_experts_backward", kind)
    return [float((np.abs(np.asarray(g).astype(np.float64) - r) / (atol + rtol * np.abs(r))).max())
            for g, r in zip(got, ref)]


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_split16_planes(kind: str, monkeypatch) -> None:
    _arch(monkeypatch, "sm_80")
    dt = _dt(kind)
    # magnitudes from 1e-7 to 1e3: f16's lo part of a small value would be subnormal without the 2^11 scale
    v = (np.random.default_rng(1).standard_normal(300) * 10.0 ** np.linspace(-7, 3, 300)).astype(np.float32)
    planes = np.asarray(moe_mod._split16(v, v.size, kind, stream=None, backend=HOST))
    hi = planes[:v.size].astype(np.float64)
    lo = planes[v.size:].astype(np.float64) / (2048.0 if kind == "f16" else 1.0)
    np.testing.assert_array_equal(hi, v.astype(dt).astype(np.float64))
    v64 = v.astype(np.float64)
    err = np.abs(hi + lo - v64)
    if kind == "bf16":
        assert (err <= 2.0 ** -16 * np.abs(v64)).all()  # 16 bits of the 24
    else:
        big = np.abs(v64) >= 2.0 ** -14  # f16 normals: 22 bits of the 24; below, the hi part's absolute 2^-24
        assert (err[big] <= 2.0 ** -21 * np.abs(v64[big])).all()
        assert (err[~big] <= 2.0 ** -35).all()
        # unscaled, the lo part would lose those bits: its f16 floor is 2^-24
        lo_raw = (v64 - hi).astype(np.float16).astype(np.float64)
        assert np.abs(hi + lo_raw - v64)[big].max() > 2.0 ** -21 * 1e-3


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_one_16_bit_rounding_instead_of_the_split_misses_the_rows(kind: str, arch: str, monkeypatch) -> None:
    # The same kernels with every lo plane zeroed take h, w * dy and d(gate_up) rounded to 16 bits once: a
    # weight gradient misses the float64 row. With the lo planes, every gradient is within it.
    _arch(monkeypatch, arch)
    x, gu, dn, ids, w, dy = _experts_inputs(np.random.default_rng(8), kind, 40, 32, 24, 4, 2)
    ref = np_moe_experts_backward(dy, x, gu, dn, ids, w, "silu")
    split = _worst(ops.moe_experts_backward(dy, x, gu, dn, ids, w, "silu", backend=HOST), ref, kind)
    assert max(split) <= 1.0, split
    real = moe_mod._split16

    def hi_only(v, n, kind, **kw):
        planes = real(v, n, kind, **kw)
        planes[n:] = 0  # lo parts dropped: the products see round(v) alone
        return planes

    monkeypatch.setattr(moe_mod, "_split16", hi_only)
    rounded = _worst(ops.moe_experts_backward(dy, x, gu, dn, ids, w, "silu", backend=HOST), ref, kind)
    assert max(rounded) > 1.0, rounded
    worst = NAMES[int(np.argmax(rounded))]
    assert worst in ("grad_gate_up_proj", "grad_down_proj"), (worst, rounded)


SPLIT_SM80 = [f"grouped_gemm_{n}_{t}" for n in ("wgrad_tc_split_a", "wgrad_tc_split_ab", "tc_split_f32out")
              for t in ("bf16", "f16")]


def test_sass_sm80_split_kernels_run_hmma_without_spills() -> None:
    from test_moe_f32out import _moe_sm80_sass
    from sass_helpers import kernel_ops as _ops

    mod, text, loops = _moe_sm80_sass()
    for k in SPLIT_SM80:
        ops_ = _ops(text, k)
        assert "HMMA.16816.F32" + (".BF16" if k.endswith("bf16") else "") in ops_, k
        assert not [op for op in ops_ if op.startswith(("LDL", "STL"))], k
        assert mod.resources[k].spill_stores == 0 and mod.resources[k].spill_loads == 0, k
        # one k-loop serves every pass: the same steady-state loop as the unsplit kernels (2.6 is their bar)
        assert loops[k]["per_mma"] <= 2.6, (k, loops[k])


# --------------------------------------------------------------------------- sm_90a: the wgmma forms
SPLIT_SM90 = [f"grouped_gemm_{n}_{t}" for n in ("wgrad_sm90_split_a", "wgrad_sm90_split_ab", "sm90_split_f32out")
              for t in ("bf16", "f16")]
# Warp-instructions per m16n8k16-equivalent of their steady-state loop (today 0.461-0.469: the unsplit kernels'
# 0.445 and the pass's first-k-block compare; a serialised wgmma, a wait after each, would be 0.508)
SPLIT_SM90_LOOP_BAR = 0.47


def test_sass_sm90_split_kernels_run_hgmma_without_spills() -> None:
    from sass_helpers import kernel_ops as _ops
    from test_moe_sm90 import _sass

    mod, text, loops = _sass()
    for k in SPLIT_SM90:
        ops_ = _ops(text, k)
        hgmma = "HGMMA.64x256x16.F32" + (".BF16" if k.endswith("bf16") else "")
        assert {op for op in ops_ if "MMA" in op} == {hgmma}, k  # wgmma only: no HMMA left
        assert not [op for op in ops_ if op.startswith(("LDL", "STL"))], k
        assert mod.resources[k].spill_stores == 0 and mod.resources[k].spill_loads == 0, k
        # one k-loop serves every pass, one wgmma group in flight as in the unsplit kernels
        assert loops[k]["mma"] == 4 * 256 / 8 and loops[k]["per_mma"] <= SPLIT_SM90_LOOP_BAR, (k, loops[k])


@pytest.mark.parametrize("kind,old,new", [
    # every pass restarts the accumulators: the lo products are dropped (one 16-bit rounding of h, w * dy, d(gate_up))
    ("bf16", "acc, pk_wgmma_desc_advance(da, ks * A_STEP), pk_wgmma_desc_advance(db, ks * B_STEP),\n"
             "                    !first || ks > 0);",
     "acc, pk_wgmma_desc_advance(da, ks * A_STEP), pk_wgmma_desc_advance(db, ks * B_STEP),\n"
     "                    kb > 0 || ks > 0);"),
    # the lo pass reads the hi plane of A
    ("bf16", "const int ar = gg90_a_lo<SPLIT>(pass) ? lo_rows : 0,", "const int ar = 0,"),
    # the lo pass of B (hi_a·lo_b) reads the hi plane of B
    ("bf16", "br = gg90_b_lo<SPLIT>(pass) ? lo_rows : 0;", "br = 0;"),
    # the f16 lo products' sum left scaled by 2^11
    ("f16", "pk_wgmma_fence_operand(acc[i]), acc[i] *= 1.0f / GG90_LO_SCALE<T>;",
     "pk_wgmma_fence_operand(acc[i]), acc[i] *= 1.0f;"),
], ids=["lo-dropped", "a-lo-plane", "b-lo-plane", "no-unscale"])
def test_a_broken_sm90_split_kernel_misses_the_rows(kind, old, new, tmp_path, monkeypatch) -> None:
    from test_moe_sm90 import _mutant

    _arch(monkeypatch, "sm_90a")
    x, gu, dn, ids, w, dy = _experts_inputs(np.random.default_rng(8), kind, 40, 32, 24, 4, 2)
    ref = np_moe_experts_backward(dy, x, gu, dn, ids, w, "silu")
    _mutant(tmp_path, monkeypatch, old, new)
    from launch_spy import record_launches

    names = record_launches(monkeypatch)
    worst = _worst(ops.moe_experts_backward(dy, x, gu, dn, ids, w, "silu", backend=HOST), ref, kind)
    assert f"grouped_gemm_wgrad_sm90_split_ab_{kind}" in names  # (the spy sees the real names)
    assert max(worst) > 1.0, worst
