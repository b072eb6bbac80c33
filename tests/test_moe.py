"""Mixture-of-experts ops (kernels_cu/moe.cu) on the host backend: routing, grouped GEMM, the experts
block forward and backward against float64 NumPy; bad inputs; determinism; and from the cubins NVRTC
makes (no GPU needed) that the tensor-core grouped GEMM's steady-state loop is lean and spill-free."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pykern import ops
from pykern.arrays import bfloat16
from pykern.difftest.cases.moe import (np_grouped_gemm, np_moe_experts, np_moe_experts_backward, np_moe_route,
                                       _experts_inputs)
from pykern.errors import ArgumentError, ArgumentTypeError
from sass_helpers import checked_report as _sass_report, kernel_ops, source_sass, tanhf_lines
from family_helpers import close_elementwise as _close

ROOT = Path(__file__).resolve().parent.parent
HOST = "host"


# --------------------------------------------------------------------------- routing


def test_route_softmax_ties_go_to_the_lower_index() -> None:
    x = np.zeros((2, 8), np.float32)
    x[0, [6, 2, 4]] = 3.0  # a three-way tie for the top: 2, 4, 6 in that order
    x[1] = np.arange(8)[::-1]
    w, ids = ops.moe_route(x, 3, backend=HOST)
    assert ids.dtype == np.int32 and w.dtype == np.float32
    assert ids[0].tolist() == [2, 4, 6] and ids[1].tolist() == [0, 1, 2]
    np.testing.assert_allclose(w[0], [1 / 3] * 3, rtol=1e-6)
    rw, rids = np_moe_route(x, 3)
    np.testing.assert_array_equal(ids, rids)
    _close(w, rw, "moe_route", "f32")


def test_route_sigmoid_bias_chooses_but_does_not_weigh() -> None:
    x = np.array([[0.0, 1.0, 2.0, -1.0]], np.float32)
    bias = np.array([5.0, 0.0, 0.0, 0.0], np.float32)
    w, ids = ops.moe_route(x, 2, renormalize=False, scoring="sigmoid", bias=bias, backend=HOST)
    assert ids[0].tolist() == [0, 2]
    np.testing.assert_allclose(w[0], 1 / (1 + np.exp(-np.array([0.0, 2.0]))), rtol=1e-6)


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_softmax_bias_chooses_but_does_not_weigh(renormalize: bool) -> None:
    # vLLM's fused_topk_bias under softmax scoring: probabilities + bias choose, the probabilities weigh.
    x = np.array([[0.0, 1.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]], np.float32)
    bias = np.array([0.9, 0.0, 0.0, 0.0], np.float32)
    w, ids = ops.moe_route(x, 2, renormalize=renormalize, scoring="softmax", bias=bias, backend=HOST)
    p = np.exp(x.astype(np.float64)) / np.exp(x.astype(np.float64)).sum(1, keepdims=True)
    assert ids.tolist() == [[0, 2], [0, 1]]  # without the bias, row 0 would take experts 2 and 1
    want = np.take_along_axis(p, ids.astype(np.int64), 1)
    if renormalize:
        want = want / want.sum(1, keepdims=True)
    _close(w, want, "moe_route", "f32")
    rw, rids = np_moe_route(x, 2, renormalize, "softmax", bias)
    np.testing.assert_array_equal(ids, rids)
    _close(w, rw, "moe_route", "f32")


@pytest.mark.parametrize("kind", ["f32", "bf16", "f16"])
def test_route_matches_float64(kind: str) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((70, 130)).astype({"bf16": bfloat16(), "f16": np.float16}.get(kind, np.float32))
    w, ids = ops.moe_route(x, 8, backend=HOST)
    rw, rids = np_moe_route(x, 8)
    np.testing.assert_array_equal(ids, rids)
    _close(w, rw, "moe_route", kind)
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-5)


def test_route_bad_inputs_name_the_argument() -> None:
    x = np.zeros((3, 4), np.float32)
    with pytest.raises(ArgumentError, match="top_k"):
        ops.moe_route(x, 5, backend=HOST)
    with pytest.raises(ArgumentError, match="scoring"):
        ops.moe_route(x, 2, scoring="topk", backend=HOST)
    with pytest.raises(ArgumentError, match="bias"):
        ops.moe_route(x, 2, scoring="sigmoid", bias=np.zeros(3, np.float32), backend=HOST)
    with pytest.raises(ArgumentTypeError, match="router_logits"):
        ops.moe_route(x.astype(np.float64), 2, backend=HOST)


# --------------------------------------------------------------------------- grouped GEMM

GEMM_SHAPES = [  # (group sizes, N, K)
    ([130, 0, 5, 200], 136, 72),
    ([0, 0], 8, 8),
    ([1], 3, 5),
    ([64, 70, 0], 130, 32 * 8 + 16),  # steady state, drain, K remainder
    ([129], 256, 32 * 9),             # 9 full k-tiles, 2 column tiles
]


@pytest.mark.parametrize("kind,tc", [("f32", None), ("bf16", True), ("bf16", False), ("f16", True), ("f16", False)])
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: f"{'-'.join(map(str, s[0]))}x{s[1]}x{s[2]}")
def test_grouped_gemm_vs_float64(shape, kind, tc, monkeypatch) -> None:
    sizes, n, k = shape
    rng = np.random.default_rng(sum(sizes) + n + k)
    dt = {"bf16": bfloat16(), "f16": np.float16}.get(kind, np.float32)
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    a = rng.standard_normal((int(off[-1]), k)).astype(dt)
    b = (rng.standard_normal((len(sizes), n, k)) / np.sqrt(k)).astype(dt)
    ref = np_grouped_gemm(a, b, off)
    for sched in ("forward", "reverse"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", sched)
        out = ops.grouped_gemm(a, b, off, tensor_cores=tc, backend=HOST)
        assert out.dtype == dt and out.shape == (off[-1], n)
        _close(out, ref, "grouped_gemm", kind)


def test_grouped_gemm_misaligned_base_takes_the_element_path() -> None:
    rng = np.random.default_rng(3)
    buf = rng.standard_normal(70 * 64 + 1).astype(bfloat16())
    a = buf[1:].reshape(70, 64)  # 2-byte offset: no 16-byte copies
    assert a.ctypes.data % 16
    b = rng.standard_normal((2, 40, 64)).astype(bfloat16())
    off = np.array([0, 30, 70], np.int32)
    _close(ops.grouped_gemm(a, b, off, backend=HOST), np_grouped_gemm(a, b, off), "grouped_gemm", "bf16")


def test_grouped_gemm_bad_offsets_and_shapes_name_the_argument() -> None:
    a = np.zeros((10, 8), np.float32)
    b = np.zeros((2, 4, 8), np.float32)
    with pytest.raises(ArgumentError, match=r"offsets: expected offsets\[0\] == 0 and offsets\[-1\] == 10"):
        ops.grouped_gemm(a, b, np.array([0, 5, 9], np.int32), backend=HOST)
    with pytest.raises(ArgumentError, match="non-decreasing"):
        ops.grouped_gemm(a, b, np.array([0, 11, 10], np.int32), backend=HOST)
    with pytest.raises(ArgumentError, match=r"offsets: expected shape \(3,\)"):
        ops.grouped_gemm(a, b, np.array([0, 10], np.int32), backend=HOST)
    with pytest.raises(ArgumentTypeError, match="offsets: expected dtype int32"):
        ops.grouped_gemm(a, b, np.array([0, 5, 10], np.int64), backend=HOST)
    with pytest.raises(ArgumentError, match="b: expected shape"):
        ops.grouped_gemm(a, np.zeros((2, 4, 7), np.float32), np.array([0, 5, 10], np.int32), backend=HOST)
    with pytest.raises(ArgumentTypeError, match="b: expected the dtype of a"):
        ops.grouped_gemm(a, b.astype(bfloat16()), np.array([0, 5, 10], np.int32), backend=HOST)


# --------------------------------------------------------------------------- experts block


@pytest.mark.parametrize("kind,act,tc", [("f32", "silu", None), ("bf16", "silu", True), ("bf16", "gelu_tanh", True),
                                         ("bf16", "silu", False), ("f16", "silu", True), ("f16", "gelu_tanh", True),
                                         ("f16", "silu", False)])
def test_experts_forward_vs_float64(kind, act, tc) -> None:
    rng = np.random.default_rng(5)
    x, gu, dn, ids, w, _ = _experts_inputs(rng, kind, 150, 64, 48, 5, 2)
    out = ops.moe_experts(x, gu, dn, ids, w, act, tensor_cores=tc, backend=HOST)
    _close(out, np_moe_experts(x, gu, dn, ids, w, act), "moe_experts", kind)


def test_experts_dropped_tokens_contribute_nothing_and_int64_ids_work() -> None:
    rng = np.random.default_rng(6)
    x, gu, dn, ids, w, _ = _experts_inputs(rng, "f32", 9, 16, 8, 3, 2)
    ids[4] = -1
    out = ops.moe_experts(x, gu, dn, ids.astype(np.int64), w, backend=HOST)
    assert np.all(out[4] == 0.0)
    _close(out, np_moe_experts(x, gu, dn, ids, w), "moe_experts", "f32")


def test_experts_are_deterministic() -> None:
    rng = np.random.default_rng(7)
    x, gu, dn, ids, w, dy = _experts_inputs(rng, "bf16", 80, 32, 24, 4, 3)
    a = ops.moe_experts(x, gu, dn, ids, w, backend=HOST)
    b = ops.moe_experts(x, gu, dn, ids, w, backend=HOST)
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    g1 = ops.moe_experts_backward(dy, x, gu, dn, ids, w, backend=HOST)
    g2 = ops.moe_experts_backward(dy, x, gu, dn, ids, w, backend=HOST)
    for p, q in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(p).view(np.uint8), np.asarray(q).view(np.uint8))


@pytest.mark.parametrize("kind,act", [("f32", "silu"), ("f32", "gelu_tanh"), ("bf16", "silu"), ("f16", "gelu_tanh")])
def test_experts_backward_vs_float64(kind, act) -> None:
    rng = np.random.default_rng(8)
    x, gu, dn, ids, w, dy = _experts_inputs(rng, kind, 40, 32, 24, 4, 2)
    got = ops.moe_experts_backward(dy, x, gu, dn, ids, w, act, backend=HOST)
    ref = np_moe_experts_backward(dy, x, gu, dn, ids, w, act)
    for g, r in zip(got[:3], ref):
        assert g.dtype == x.dtype  # the gradients come back in the inputs' dtype
    for g, r in zip(got, ref):
        _close(g, r, "moe_experts_backward", kind)
    assert got[3].dtype == np.float32 and np.all(got[3][2, 1] == 0.0)  # the dropped slot


def test_align_pads_groups_and_keeps_slot_order() -> None:
    ids = np.array([[2, 0], [2, 1], [0, 2], [-1, 2]], np.int32)
    sorted_slot, slot_pos, offsets, counts = ops.moe_align(ids, 4, 4, backend=HOST)
    assert counts.tolist() == [2, 1, 4, 0]
    assert offsets.tolist() == [0, 4, 8, 12, 12]
    assert sorted_slot[:12].tolist() == [1, 4, -1, -1, 3, -1, -1, -1, 0, 2, 5, 7]
    assert slot_pos.tolist() == [8, 0, 9, 4, 1, 10, -1, 11]


def test_experts_bad_inputs_name_the_argument() -> None:
    rng = np.random.default_rng(9)
    x, gu, dn, ids, w, _ = _experts_inputs(rng, "f32", 6, 16, 8, 3, 2)
    bad = ids.copy()
    bad[1, 0] = 3
    with pytest.raises(ArgumentError, match=r"topk_ids: expected expert ids in \[0, 3\)"):
        ops.moe_experts(x, gu, dn, bad, w, backend=HOST)
    with pytest.raises(ArgumentError, match="down_proj: expected shape"):
        ops.moe_experts(x, gu, dn[:, :, :7], ids, w, backend=HOST)
    with pytest.raises(ArgumentError, match="gate_up_proj: expected shape"):
        ops.moe_experts(x, gu[:, :, :15], dn, ids, w, backend=HOST)
    with pytest.raises(ArgumentError, match="topk_weights: expected the shape of topk_ids"):
        ops.moe_experts(x, gu, dn, ids, w[:, :1], backend=HOST)
    with pytest.raises(ArgumentError, match="activation"):
        ops.moe_experts(x, gu, dn, ids, w, "relu", backend=HOST)


# --------------------------------------------------------------------------- SASS (no GPU needed)


TC_KERNELS = ["grouped_gemm_tc_bf16", "moe_gemm_act_tc_bf16", "grouped_gemm_tc_f16", "moe_gemm_act_tc_f16",
              # the backward's: B k-major (ldmatrix .trans), and the K-grouped weight gradient (both k-major)
              "grouped_gemm_tc_nn_bf16", "grouped_gemm_tc_nn_f16", "grouped_gemm_wgrad_tc_bf16", "grouped_gemm_wgrad_tc_f16"]


def test_tensor_core_grouped_gemm_steady_state_loop() -> None:
    # CUTLASS's grouped GEMM 128x128x32 (warp 64x64) issues 2.50-2.62 warp-instructions per MMA in its
    # steady-state loop; the bar here is 2.6, on sm_80 and sm_90.
    sr = _sass_report()
    loops = sr.loop_metrics(TC_KERNELS, ["sm_80", "sm_90"])
    for k in TC_KERNELS:
        for arch in ("sm_80", "sm_90"):
            row = loops[k][arch]
            assert row["per_mma"] <= 2.6, (k, arch, row)
            # per k-tile and warp: 64 MMAs, 16 ldmatrix.x4, 8 cp.async, one barrier
            tiles = row["mma"] / 64
            assert row["ldsm"] == 16 * tiles and row["ldgsts"] == 8 * tiles and row["bar"] == tiles, row
    mix = sr.instruction_mix(TC_KERNELS, ["sm_80", "sm_90"], with_resources=True)
    for k, per in mix.items():
        for arch, row in per.items():
            assert row["LDL"] == row["STL"] == 0 and row["spill_stores"] == 0, (k, arch, row)


def test_loop_metric_counts_a_known_loop() -> None:
    sr = _sass_report()
    text = "\n".join([
        "Function : k",
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
        "        /*0020*/                   LDSM.16.M88.4 R8, [R2] ;",
        "        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
        "        /*0040*/                   NOP ;",
        "        /*0050*/               @P0 BRA 0x10 ;",
        "        /*0060*/                   EXIT ;",
    ])
    row = sr.steady_state_loops(text)["k"]
    assert (row["insns"], row["mma"], row["per_mma"], row["ldsm"]) == (4, 2.0, 2.0, 1)


# every moe.cu kernel that evaluates act(gate): the forward's elementwise and fused-epilogue ones, the backward's
ACT_KERNELS = [f"moe_act{s}" for s in ("", "_bf16", "_f16")] + ["moe_act_backward", "moe_gemm_act_tc_bf16",
                                                                  "moe_gemm_act_tc_f16"]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_gelu_tanh_activation_calls_no_tanhf(arch: str) -> None:
    # gelu_tanh (forward and derivative) is norm_act_loss.cu's one-ex2 one-rcp form (pk_gelu_tanh_s), not
    # tanhf's range-selected polynomial / exp paths (which issued 64 range tests in moe_gemm_act_tc alone)
    text = source_sass("moe.cu", arch)
    for k in ACT_KERNELS:
        assert not tanhf_lines(text, k), (k, arch, tanhf_lines(text, k)[:4])
        assert "MUFU.EX2" in kernel_ops(text, k), (k, arch)  # silu's exp and gelu_tanh's 2^(-2u log2 e)


# the fp32 expf's range reduction (its FFMA.RM by 12582913 = 0x4b400001, then log2 e split in two FFMAs) and the
# IEEE division's FCHK (which branches to a called slow path); silu's fast form issues neither
_ACCURATE_EXPF = re.compile(r"FFMA\.RM .*12582913|1\.925963033500011079e-08")


def _slow_silu_lines(text: str, kernel: str) -> list[str]:
    body = text.split(f"Function : {kernel}\n", 1)[1].split("Function :", 1)[0]
    return [ln.strip() for ln in body.splitlines() if "FCHK" in ln or _ACCURATE_EXPF.search(ln)]


@pytest.mark.parametrize("src, arch, kernels", [
    ("moe.cu", "sm_80", ACT_KERNELS), ("moe.cu", "sm_90", ACT_KERNELS),
    ("grouped_gemm_sm90.cu", "sm_90a", ["moe_gemm_act_sm90_bf16", "moe_gemm_act_sm90_f16"])])
def test_silu_activation_is_one_ex2_and_one_rcp(src: str, arch: str, kernels: list[str]) -> None:
    # silu (forward, derivative, the sm_90a gate_up epilogue) as forward.cu's silu_gate: pk_exp_fast's MUFU.EX2 and
    # __fdividef's MUFU.RCP, no accurate expf and no IEEE division (64 of each in the fused epilogues before)
    text = source_sass(src, arch)
    for k in kernels:
        assert not _slow_silu_lines(text, k), (k, arch, _slow_silu_lines(text, k)[:4])
        ops_ = kernel_ops(text, k)
        assert "MUFU.EX2" in ops_ and "MUFU.RCP" in ops_, (k, arch)


def test_silu_activation_against_float64() -> None:
    # the fast silu over a dense sweep (up = 1, dh = 1): h = silu(g) and dgu = [silu'(g), silu(g)] within the f32
    # rows of moe_experts / moe_experts_backward, exact limits at the far ends (-0 / 0 below -88, g / 1 above 88)
    from pykern import launch

    g = np.concatenate([np.linspace(-30.0, 30.0, 60_001),
                        np.float32([0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5, -88.0, -100.0, 100.0, 1e30, -1e30])])
    g = g.astype(np.float32)
    inter, rows = 1, g.size
    gu = np.stack([g, np.ones_like(g)], axis=1)  # [rows, 2I]: gate, then up
    off = np.array([0, rows], np.int32)
    h = np.zeros(rows, np.float32)
    grid = ((rows + 255) // 256,)
    launch("moe_act", grid, (256,), gu.reshape(-1), h, off, rows, inter, 1, 0, backend=HOST)
    dgu = np.zeros((rows, 2), np.float32)
    launch("moe_act_backward", grid, (256,), gu.reshape(-1), np.ones(rows, np.float32), dgu.reshape(-1),
           np.zeros(rows, np.int32), np.zeros(1, np.float32), off, rows, inter, 1, 0, 0, backend=HOST)
    x = g.astype(np.float64)
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-x))
    _close(h, x * s, "moe_experts", "f32")
    _close(dgu[:, 1], x * s, "moe_experts_backward", "f32")
    _close(dgu[:, 0], s * (1.0 + x * (1.0 - s)), "moe_experts_backward", "f32")
    assert np.all(np.isfinite(h)) and np.all(np.isfinite(dgu))
    far = {-100.0: (0.0, 0.0), 100.0: (100.0, 1.0), -1e30: (0.0, 0.0), 1e30: (1e30, 1.0)}
    for v, (hv, dv) in far.items():
        i = int(np.flatnonzero(g == np.float32(v))[0])
        assert (h[i], dgu[i, 0]) == (np.float32(hv), np.float32(dv)), (v, h[i], dgu[i, 0])


def test_f16_experts_run_on_the_f16_kernels(monkeypatch) -> None:
    # float16 MoE runs pykern's own f16 instantiations (tensor-core grouped GEMM with the fused activation,
    # f16 gather / combine), never a float32 detour
    from pykern import launcher

    seen: list[str] = []
    real = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda name, *a, **k: (seen.append(name), real(name, *a, **k))[1])
    rng = np.random.default_rng(10)
    x, gu, dn, ids, w, _ = _experts_inputs(rng, "f16", 20, 32, 24, 4, 2)
    out = ops.moe_experts(x, gu, dn, ids, w, tensor_cores=True, backend=HOST)
    assert out.dtype == np.float16
    assert {"moe_gather_f16", "moe_gemm_act_tc_f16", "grouped_gemm_tc_f16", "moe_combine_f16"} <= set(seen), seen
    assert not [n for n in seen if n.endswith("_bf16")]
    _close(out, np_moe_experts(x, gu, dn, ids, w), "moe_experts", "f16")
    with pytest.raises(ArgumentError, match="tensor_cores: True needs bf16 or f16 inputs, got float32"):
        ops.grouped_gemm(np.zeros((2, 8), np.float32), np.zeros((1, 8, 8), np.float32), np.array([0, 2], np.int32),
                         tensor_cores=True, backend=HOST)


# --------------------------------------------------------------------------- tensor-core backward pieces


def _np_wgrad(a, b, off):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.stack([a[off[e]:off[e + 1]].T @ b[off[e]:off[e + 1]] for e in range(len(off) - 1)])


# (group sizes, N1 / N, K): ragged groups, an empty expert, a group of one row, full k-tiles + a remainder
_BWD_SHAPES = [([40, 0, 1, 75], 136, 72), ([1], 8, 16), ([64, 0, 200], 24, 40)]


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("shape", _BWD_SHAPES)
def test_grouped_gemm_nn_on_tensor_cores_vs_float64(kind, shape) -> None:
    # a @ b[e] with b [E, K, N]: grouped_gemm_tc_nn (B tiles k-major through ldmatrix .trans)
    sizes, n, k = shape
    rng = np.random.default_rng(11)
    dt = bfloat16() if kind == "bf16" else np.float16
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    a = rng.standard_normal((int(off[-1]), k)).astype(dt)
    b = (rng.standard_normal((len(sizes), k, n)) / np.sqrt(k)).astype(dt)
    got = ops.grouped_gemm(a, b, off, layout="nn", tensor_cores=True, backend=HOST)
    ref = np_grouped_gemm(a, np.swapaxes(np.asarray(b, np.float64), 1, 2), off)
    _close(got, ref, "grouped_gemm", kind)


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("shape", _BWD_SHAPES)
def test_grouped_gemm_wgrad_on_tensor_cores_vs_float64(kind, shape) -> None:
    sizes, n1, n2 = shape
    rng = np.random.default_rng(12)
    dt = bfloat16() if kind == "bf16" else np.float16
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    a = rng.standard_normal((int(off[-1]), n1)).astype(dt)
    b = (rng.standard_normal((int(off[-1]), n2)) / 8).astype(dt)
    got = ops.grouped_gemm_wgrad_tc(a, b, off, backend=HOST)
    ref = _np_wgrad(a, b, off)
    _close(got, ref, "grouped_gemm", kind)
    for e, s in enumerate(sizes):
        if s == 0:
            assert np.all(np.asarray(got[e], np.float64) == 0.0)  # an empty expert: a zero gradient


def test_backward_gemms_name_offsets_and_the_size_an_out_disagrees_with() -> None:
    # (found by the bad-input fuzzer) offsets that are no array were reported without naming offsets, and an
    # out whose N disagrees with b's (layout "nn": b [E, K, N]) was reported as out's fault alone
    a, b = np.zeros((5, 8), np.float16), np.zeros((5, 6), np.float16)
    for bad in ("bad", None, [0, 2, 5]):
        with pytest.raises(ArgumentTypeError, match="offsets"):
            ops.grouped_gemm_wgrad_tc(a, b, bad, backend=HOST)
    off = np.array([0, 2, 2, 5], np.int32)
    with pytest.raises(ArgumentError, match=r"out: expected shape \(5, 7\) \(M of a, N of b\), got \(5, 6\)"):
        ops.grouped_gemm(a, np.zeros((3, 8, 7), np.float16), off, out=np.zeros((5, 6), np.float16), layout="nn",
                         backend=HOST)


@pytest.mark.parametrize("kind,act", [("bf16", "silu"), ("bf16", "gelu_tanh"), ("f16", "silu"), ("f16", "gelu_tanh")])
def test_experts_backward_tensor_cores_vs_float64(kind, act, monkeypatch) -> None:
    # The default (tensor_cores=None) on the host takes the tensor-core path: d(x_perm) on grouped_gemm_tc_nn.
    from pykern import launcher

    seen: list[str] = []
    real = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda name, *a, **k: (seen.append(name), real(name, *a, **k))[1])
    rng = np.random.default_rng(8)
    x, gu, dn, ids, w, dy = _experts_inputs(rng, kind, 40, 32, 24, 4, 2)
    got = ops.moe_experts_backward(dy, x, gu, dn, ids, w, act, backend=HOST)
    assert "grouped_gemm_tc_nn" + ("_bf16" if kind == "bf16" else "_f16") in seen, seen
    for g, r in zip(got, np_moe_experts_backward(dy, x, gu, dn, ids, w, act)):
        _close(g, r, "moe_experts_backward", kind)
