"""The fp32-result grouped GEMMs (kernels_cu/moe.cu's grouped_gemm_tc_f32out / grouped_gemm_tc_nn_f32out, mma.sync;
kernels_cu/grouped_gemm_sm90.cu's grouped_gemm_sm90_f32out / grouped_gemm_nn_sm90_f32out, wgmma) and the tensor-core
moe_experts_backward that runs its exact-operand products on them.

On the host backend, as sm_80 (the default) and playing sm_90a: `grouped_gemm(out_dtype="float32")` on 16-bit inputs
matches float64 within the f32 row (a result rounded to 16 bits would miss it by orders of magnitude), through the
16-byte stores and the element stores at an N that is no multiple of 4 or an out that is not 16-byte aligned; empty
and one-row groups. The backward matches float64 within the bf16 / f16 rows for silu and gelu_tanh over empty
experts, one-token experts and sizes off every tile, launches exactly the kernels docs/moe.md names (so a product
that falls back to fp32 FMA fails here by name), and is bit-identical from run to run.
"""
from __future__ import annotations

import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases.moe import _experts_inputs, np_grouped_gemm, np_moe_experts_backward
from pykern.errors import ArgumentError, ArgumentTypeError
from pykern.ops import _moe_sm90 as sm90
from pykern.tolerance import tolerance
from launch_spy import record_launches
from sass_helpers import ROOT, compile_sass, kernel_ops, report

HOST = "host"
ARCHS = ["sm_80", "sm_90a"]


def _arch(monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    monkeypatch.delenv("PYKERN_HOST_SCHEDULE", raising=False)
    if arch == "sm_90a":
        monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
    else:
        monkeypatch.delenv("PYKERN_HOST_ARCH", raising=False)


def _dt(kind: str):
    from pykern.arrays import bfloat16

    return bfloat16() if kind == "bf16" else np.float16


def _close(got, ref, op: str, kind: str) -> float:
    """Asserts got is within op's row for kind; returns the worst |err| / (atol + rtol |ref|)."""
    atol, rtol = tolerance(op, kind)
    got = np.asarray(got).astype(np.float64)
    assert got.shape == ref.shape
    ratio = np.abs(got - ref) / (atol + rtol * np.abs(ref))
    assert not (ratio > 1).any(), f"{(ratio > 1).sum()} of {ratio.size} off, worst {ratio.max():.3g}"
    return float(ratio.max()) if ratio.size else 0.0


def _offsets(sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)


# --------------------------------------------------------------------------- grouped_gemm(out_dtype="float32")
SHAPES = [  # (group sizes, N, K)
    ([130, 0, 5, 200], 136, 72),   # an empty group, a group under a tile, N and K off the tiles
    ([1, 0, 0, 300, 1], 264, 200),  # one-row groups, several column tiles
    ([3, 17, 0, 40], 12, 24),      # N a multiple of 4 but under a column tile
    ([30, 0, 40], 22, 40),         # N % 4 == 2: element stores at every row's end (and no TMA for "nn")
]


def _inputs(sizes, n: int, k: int, kind: str, nn: bool):
    rng = np.random.default_rng(sum(sizes) + n + k)
    off = _offsets(sizes)
    a = rng.standard_normal((int(off[-1]), k)).astype(_dt(kind))
    b = (rng.standard_normal((len(sizes), k, n) if nn else (len(sizes), n, k)) / np.sqrt(k)).astype(_dt(kind))
    ref = np_grouped_gemm(a, np.swapaxes(np.asarray(b), 1, 2) if nn else b, off)
    return a, b, off, ref


def _expected(arch: str, nn: bool, n: int, kind: str) -> str:
    # sm_90a takes what TMA can load (layout "nn": rows of b are N long, a multiple of 8 elements)
    if arch == "sm_90a" and not (nn and n % 8):
        return ("grouped_gemm_nn_sm90_f32out_" if nn else "grouped_gemm_sm90_f32out_") + kind
    return ("grouped_gemm_tc_nn_f32out_" if nn else "grouped_gemm_tc_f32out_") + kind


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["nt", "nn"])
@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s[0])}g{sum(s[0])}x{s[1]}x{s[2]}")
def test_f32out_grouped_gemm_vs_float64(shape, kind, layout, arch, monkeypatch) -> None:
    _arch(monkeypatch, arch)
    sizes, n, k = shape
    nn = layout == "nn"
    a, b, off, ref = _inputs(sizes, n, k, kind, nn)
    names = record_launches(monkeypatch)
    out = ops.grouped_gemm(a, b, off, layout=layout, out_dtype="float32", backend=HOST)
    assert out.dtype == np.float32 and out.shape == (off[-1], n)
    assert names == [_expected(arch, nn, n, kind)]
    # the f32 row: the fp32 accumulators, not rounded to 16 bits (bf16 rounding alone is ~1e2 times the row)
    _close(out, ref, "grouped_gemm", "f32")
    rounded = np.asarray(out).astype(_dt(kind)).astype(np.float64)
    with pytest.raises(AssertionError, match="off, worst"):
        _close(rounded, ref, "grouped_gemm", "f32")


@pytest.mark.parametrize("arch", ARCHS)
def test_f32out_into_an_unaligned_out_takes_the_element_stores(arch, monkeypatch) -> None:
    # out 4 bytes past a 16-byte boundary: no 16-byte store may be used (the host reports a misaligned one)
    _arch(monkeypatch, arch)
    a, b, off, ref = _inputs([130, 0, 5, 200], 136, 72, "bf16", False)
    buf = np.full(off[-1] * 136 + 1, np.nan, np.float32)
    out = buf[1:].reshape(off[-1], 136)
    assert out.ctypes.data % 16 != 0
    names = record_launches(monkeypatch)
    ops.grouped_gemm(a, b, off, out=out, out_dtype="float32", backend=HOST)
    assert names == [_expected(arch, False, 136, "bf16")]
    _close(out, ref, "grouped_gemm", "f32")
    assert np.isnan(buf[0])  # nothing stored before out


def test_f32out_without_tensor_cores_and_bad_arguments(monkeypatch) -> None:
    _arch(monkeypatch, "sm_80")
    a, b, off, ref = _inputs([30, 0, 40], 24, 40, "f16", False)
    names = record_launches(monkeypatch)
    out = ops.grouped_gemm(a, b, off, out_dtype="float32", tensor_cores=False, backend=HOST)
    assert names == ["grouped_gemm_simt"] and out.dtype == np.float32  # widened exact operands, fp32 FMA
    _close(out, ref, "grouped_gemm", "f32")
    with pytest.raises(ArgumentError, match=r"out_dtype: expected None \(a's dtype\) or 'float32', got 'float16'"):
        ops.grouped_gemm(a, b, off, out_dtype="float16", backend=HOST)
    with pytest.raises(ArgumentTypeError, match="out: expected dtype float32, got float16"):
        ops.grouped_gemm(a, b, off, out=np.zeros((70, 24), np.float16), out_dtype="float32", backend=HOST)


# --------------------------------------------------------------------------- moe_experts_backward
EXPERT_SHAPES = [  # (tokens, hidden, intermediate, experts, top_k, what)
    (40, 32, 24, 4, 2, "tiles"),      # the docs' model shape; the last expert is never chosen (empty)
    (3, 16, 8, 6, 1, "one-token"),    # one-token experts, most experts empty
    (37, 20, 12, 5, 2, "unaligned"),  # hidden 20: x_perm rows of 40 bytes (no TMA: mma.sync on sm_90a too)
]


def _tc_names(arch: str, kind: str, hid: int, inter: int) -> list[str]:
    """The tensor-core GEMMs of the backward in launch order (docs/moe.md's table)."""
    hopper = arch == "sm_90a" and hid % 8 == 0  # TMA: K of every product a multiple of 8 elements
    hopper_dh = hopper and inter % 8 == 0  # dy_perm @ down_proj[e], layout "nn": rows of down_proj are I long
    hopper_dx = hopper and hid % 8 == 0
    # the split-precision products: y = h @ down_proj[e]^T (K = I), (w * dy)^T h (rows H and I long) and
    # d(gate_up)^T x_perm (rows 2I and H long)
    sm90 = arch == "sm_90a"
    hopper_y, hopper_wd = sm90 and inter % 8 == 0, sm90 and hid % 8 == 0 and inter % 8 == 0
    hopper_wg = sm90 and (2 * inter) % 8 == 0 and hid % 8 == 0
    return [("grouped_gemm_sm90_f32out_" if hopper else "grouped_gemm_tc_f32out_") + kind,
            ("grouped_gemm_nn_sm90_f32out_" if hopper_dh else "grouped_gemm_tc_nn_f32out_") + kind,
            ("grouped_gemm_nn_sm90_" if hopper_dx else "grouped_gemm_tc_nn_") + kind,
            ("grouped_gemm_sm90_split_f32out_" if hopper_y else "grouped_gemm_tc_split_f32out_") + kind,
            ("grouped_gemm_wgrad_sm90_split_ab_" if hopper_wd else "grouped_gemm_wgrad_tc_split_ab_") + kind,
            ("grouped_gemm_wgrad_sm90_split_a_" if hopper_wg else "grouped_gemm_wgrad_tc_split_a_") + kind]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("shape", EXPERT_SHAPES, ids=lambda s: s[-1])
def test_backward_tensor_cores_vs_float64(shape, kind, act, arch, monkeypatch) -> None:
    _arch(monkeypatch, arch)
    t, hid, inter, e, k, _ = shape
    x, gu, dn, ids, w, dy = _experts_inputs(np.random.default_rng(8), kind, t, hid, inter, e, k)
    names = record_launches(monkeypatch)
    got = ops.moe_experts_backward(dy, x, gu, dn, ids, w, act, backend=HOST)
    # Every product in its place: the exact-operand ones on the fp32-result kernels, d(x_perm) on a 16-bit one;
    # y and the two weight gradients (fp32 intermediates h, w * dy, d(gate_up)) split hi + lo: no fp32 FMA product.
    tc = _tc_names(arch, kind, hid, inter)
    assert [n for n in names if "grouped_gemm" in n or "split16" in n] == (
        [tc[0], "moe_split16_" + kind, tc[3], tc[1], "moe_split16_" + kind, tc[4], "moe_split16_" + kind, tc[5],
         tc[2]]), names
    ref = np_moe_experts_backward(dy, x, gu, dn, ids, w, act)
    for g, r in zip(got, ref):
        _close(g, r, "moe_experts_backward", kind)
    assert [g.dtype for g in got] == [x.dtype] * 3 + [np.float32]
    for j, s in enumerate(ids.reshape(-1)):
        if s < 0:
            assert got[3].reshape(-1)[j] == 0.0  # a dropped slot
    for ex in set(range(e)) - set(ids.reshape(-1).tolist()):  # an expert no token chose: zero weight gradients
        assert not np.asarray(got[1][ex]).astype(np.float64).any() and not np.asarray(got[2][ex]).astype(
            np.float64).any()


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_tensor_cores_is_deterministic(arch, monkeypatch) -> None:
    _arch(monkeypatch, arch)
    monkeypatch.setattr(sm90, "HOST_CTAS", 2)
    x, gu, dn, ids, w, dy = _experts_inputs(np.random.default_rng(3), "bf16", 40, 32, 24, 4, 2)
    g1 = ops.moe_experts_backward(dy, x, gu, dn, ids, w, "gelu_tanh", backend=HOST)
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "reverse")
    g2 = ops.moe_experts_backward(dy, x, gu, dn, ids, w, "gelu_tanh", backend=HOST)
    for p, q in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(p).view(np.uint8), np.asarray(q).view(np.uint8))


def test_backward_weighting_is_applied_once(monkeypatch) -> None:
    # d(h) = w * (dy_perm @ down_proj[e]): doubling one token's routing weights doubles that token's share of the
    # weight gradients; grad_x of a token whose weights are all zero is zero (the weight reaches d(h))
    _arch(monkeypatch, "sm_80")
    x, gu, dn, ids, w, dy = _experts_inputs(np.random.default_rng(5), "f16", 12, 16, 8, 3, 2)
    w = w.copy()
    w[4] = 0.0
    gx = ops.moe_experts_backward(dy, x, gu, dn, ids, w, "silu", backend=HOST)[0]
    assert not np.asarray(gx[4]).astype(np.float64).any() and np.asarray(gx[5]).astype(np.float64).any()


# --------------------------------------------------------------------------- SASS (NVRTC, no GPU)
F32OUT_SM80 = [f"grouped_gemm_tc{n}_f32out_{t}" for n in ("", "_nn") for t in ("bf16", "f16")]
F32OUT_SM90 = [f"grouped_gemm{n}_sm90_f32out_{t}" for n in ("", "_nn") for t in ("bf16", "f16")]


def _moe_sm80_sass():
    mod, text = compile_sass(ROOT / "kernels_cu" / "moe.cu", "sm_80")
    return mod, text, report().steady_state_loops(text)


def test_sass_sm80_f32out_kernels_run_hmma_with_16_byte_stores_and_no_spills() -> None:
    mod, text, loops = _moe_sm80_sass()
    for k in F32OUT_SM80:
        ops_ = kernel_ops(text, k)
        assert "HMMA.16816.F32" + (".BF16" if k.endswith("bf16") else "") in ops_, k
        assert "STG.E.128" in ops_, k  # the epilogue's fp32 stores, four columns a thread
        assert not [op for op in ops_ if op.startswith(("LDL", "STL"))], k
        assert mod.resources[k].spill_stores == 0 and mod.resources[k].spill_loads == 0
        # the same main loop as grouped_gemm_tc: 2.6 warp-instructions per MMA is the bar there
        assert loops[k]["per_mma"] <= 2.6, (k, loops[k])


@pytest.mark.parametrize("kernel", F32OUT_SM90)
def test_sass_sm90_f32out_kernels_run_hgmma_with_16_byte_stores_and_no_spills(kernel: str) -> None:
    from test_moe_sm90 import LOOP_BAR, _sass

    mod, text, loops = _sass()
    ops_ = kernel_ops(text, kernel)
    hg = {op for op in ops_ if op.startswith("HGMMA")}
    want = "HGMMA.64x256x16.F32" + ("" if kernel.endswith("_f16") else ".BF16")
    assert hg and all(op.startswith(want) for op in hg), hg
    assert "STG.E.128" in ops_ and "UTMALDG.2D" in ops_
    assert not [op for op in ops_ if op.startswith(("LDL", "STL"))]
    assert mod.resources[kernel].spill_stores == 0 and mod.resources[kernel].spill_loads == 0
    assert loops[kernel]["mma"] == 4 * sm90.BN / 8 and loops[kernel]["per_mma"] <= LOOP_BAR, loops[kernel]
