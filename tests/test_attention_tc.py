"""Tensor-core bf16 attention (kernels_cu/attention_fwd_tc.cu, attention_bwd_tc.cu) on the host backend.

Forward and gradients against float64 NumPy over head_dim 64/80/96/128/256, GQA 1/4/8, causal and not,
n_q != n_k both ways, lengths off every tile and length 1; how the ops choose the tensor-core path; that
the backward is deterministic; and, from the cubins NVRTC makes (no GPU needed), that every kernel the
ops launch for bf16 runs on tensor cores (HMMA; ldmatrix and cp.async) on sm_80 and sm_90 with no local
memory, and spills on no arch NVRTC offers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases import forward as fwd_cases
from pykern.difftest.cases.attention import fa_inputs, np_flash_attention
from pykern.difftest.cases.attention import attention_inputs, np_attention_backward
from pykern.errors import ArgumentError
from pykern.ops import forward as fwd_mod
from launch_spy import record_launches as _record
from attn_checks import close
from sass_helpers import checked_report as _sass_report

ROOT = Path(__file__).resolve().parent.parent
HOST = "host"
TC_FWD = ([f"attention_fwd_tc_d{d}{c}{s}" for d in (64, 96, 128, 256) for c in ("", "_softcap")
           for s in ("_bf16", "_f16")]
          # the general kernels at the FlashAttention-2 core's head dims, and flash_attention_varlen's core
          + [f"attention_fwd_tc_pad_d{d}{c}{s}" for d in (64, 128) for c in ("", "_softcap") for s in ("_bf16", "_f16")]
          + [f"attention_fwd_varlen_tc_d{d}{c}{s}" for d in (64, 128) for c in ("", "_softcap")
             for s in ("_bf16", "_f16")])
TC_BWD = ([f"attention_bwd_tc_dkdv_d{d}{c}{s}" for d in (64, 96, 128) for c in ("", "_softcap")
           for s in ("_bf16", "_f16")]
          + [f"attention_bwd_tc_{n}_d256{c}{s}" for n in ("dv", "dk") for c in ("", "_softcap")
             for s in ("_bf16", "_f16")]
          + [f"attention_bwd_tc_dq_d{d}{c}{s}" for d in (64, 96, 128, 256) for c in ("", "_softcap")
             for s in ("_bf16", "_f16")]
          + [f"attention_bwd_tc_fused_d{d}{c}{m}{s}" for d in (64, 128) for c in ("", "_softcap")
             for m in ("", "_det") for s in ("_bf16", "_f16")]
          # flash_attention_varlen_backward: the dK/dV and dQ kernels with the per-sequence prologue
          + [f"attention_bwd_varlen_tc_{n}{c}{s}" for n in ("dkdv_d64", "dkdv_d96", "dkdv_d128", "dv_d256", "dk_d256",
                                                            "dq_d64", "dq_d96", "dq_d128", "dq_d256")
             for c in ("", "_softcap") for s in ("_bf16", "_f16")])
# The fused backward's fp32 helpers (no MMA): delta / lse layout + dQ workspace zeroing, dQ reduce / narrow
TC_BWD_AUX = ([f"attention_bwd_tc_prep{s}" for s in ("_bf16", "_f16")]
              + [f"attention_bwd_tc_dq_reduce_d{d}{s}" for d in (64, 96, 128) for s in ("_bf16", "_f16")])
# The fp32-FMA f16 kernels (attention_fwd_fma.cu, attention_bwd_fma.cu) that narrow fp32 -> f16 (the others
# write fp32 lse / delta only)
F16_FMA_NARROWING = ([f"attention_fwd_fma_d{d}{c}_f16" for d in (64, 128, 256) for c in ("", "_softcap")]
                     + ["attention_bwd_fma_naive_f16"]
                     + [f"attention_bwd_fma_{n}{c}_f16" for n in ("dq", "dkdv") for c in ("", "_softcap")])
F16_FMA_WIDEN_ONLY = ["attention_bwd_preprocess_f16", "attention_bwd_lse_f16", "attention_bwd_lse_softcap_f16"]


def _close(name: str, got, ref, op: str, dtype: str = "bf16") -> None:
    close(name, got, ref, op, dtype)  # attn_checks.close, bf16 unless named


# --------------------------------------------------------------------------- forward

FWD_SHAPES = [
    # (batch, n_q, n_k, heads, kv_heads, head_dim, causal)
    (1, 65, 70, 2, 1, 64, True),
    (1, 70, 33, 4, 1, 80, False),   # n_q > n_k, padded 80 -> 96
    (1, 17, 129, 8, 2, 96, True),   # n_q < n_k, GQA 4
    (2, 9, 40, 8, 1, 128, False),   # GQA 8
    (1, 33, 37, 2, 2, 256, True),   # GQA 1
    (1, 1, 1, 2, 1, 64, True),      # length 1
    (1, 1, 70, 2, 1, 128, True),
    (1, 70, 1, 2, 1, 128, True),    # most rows see no key
]


@pytest.mark.parametrize("shape", FWD_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}-d{}-{}".format(
    *s[:6], "causal" if s[6] else "full"))
def test_forward_tensor_cores_vs_float64(shape, monkeypatch) -> None:
    b, n_q, n_k, h, kvh, d, causal = shape
    rng = np.random.default_rng(n_q * 1000 + n_k + d)
    q, k, v = fa_inputs(rng, b, n_q, n_k, h, kvh, d, d, "bf16")
    names = _record(monkeypatch)
    out, lse = ops.flash_attention(q, k, v, causal=causal, return_lse=True, backend=HOST)
    assert names == [f"attention_fwd_tc_d{fwd_mod.tc_head_dim(d)}_bf16"]
    ref_out, ref_lse = np_flash_attention(q, k, v, causal)
    _close("out", out, ref_out, "flash_attention")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0) < 1e-4  # lse is fp32 from fp32 scores


def test_forward_tensor_cores_and_fma_paths_agree_and_choice(monkeypatch) -> None:
    rng = np.random.default_rng(3)
    q, k, v = fa_inputs(rng, 1, 40, 50, 4, 2, 80, 80, "bf16")
    names = _record(monkeypatch)
    a = ops.flash_attention(q, k, v, causal=True, backend=HOST)
    b = ops.flash_attention(q, k, v, causal=True, tensor_cores=False, backend=HOST)
    assert names == ["attention_fwd_tc_d96_bf16", "attention_fwd_fma_d128_bf16"]
    ref, _ = np_flash_attention(q, k, v, True)
    _close("tc", a, ref, "flash_attention")
    _close("fma", b, ref, "flash_attention")
    # f32 keeps the fp32 kernels; tensor cores cannot be asked for it
    names.clear()
    ops.flash_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), backend=HOST)
    assert names == ["attention_fwd_fma_d128"]
    with pytest.raises(ArgumentError, match="tensor_cores"):
        ops.flash_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), tensor_cores=True,
                            backend=HOST)
    with pytest.raises(ArgumentError, match="tensor_cores"):
        ops.flash_attention(q, k, v, tensor_cores="yes", backend=HOST)


@pytest.mark.parametrize("arch,expect", [("sm_75", False), ("sm_80", True), ("sm_90", True), ("sm_120", True)])
def test_tensor_cores_available_follows_the_device_arch(arch, expect, monkeypatch) -> None:
    fake = types.SimpleNamespace(name="nvrtc", arch=arch, available=lambda: (True, ""))
    monkeypatch.setattr("pykern.backends.get_backend", lambda name=None: fake)
    assert fwd_mod.tensor_cores_available("nvrtc") is expect
    dead = types.SimpleNamespace(name="nvrtc", arch="", available=lambda: (False, "no GPU"))
    monkeypatch.setattr("pykern.backends.get_backend", lambda name=None: dead)
    assert fwd_mod.tensor_cores_available("nvrtc") is False
    assert fwd_mod.tensor_cores_available  # host/numba: emulated / reference
    monkeypatch.undo()
    assert fwd_mod.tensor_cores_available(HOST) is True


def test_padded_head_dims_and_shared_memory_sizes() -> None:
    assert [fwd_mod.tc_head_dim(d) for d in (1, 32, 64, 65, 80, 96, 97, 128, 129, 256)] == \
        [64, 64, 64, 96, 96, 96, 128, 128, 256, 256]
    # (0 or 64 Q rows + 4 K/V tiles) x (D + 8) halves: 2 CTAs of d128 fit sm_80's 164 KiB
    assert fwd_mod.tc_shared_bytes(128) == 69632 and 2 * 69632 <= 164 * 1024
    assert fwd_mod.tc_shared_bytes(256) == 101376 <= 227 * 1024


# --------------------------------------------------------------------------- backward

BWD_SHAPES = [
    # (batch, n_q, n_k, heads, kv_heads, head_dim, causal, scale)
    (None, 17, 40, 2, 1, 64, True, None),
    (None, 40, 17, 4, 1, 80, False, 0.3),   # n_q > n_k, padded
    (2, 20, 33, 8, 2, 96, True, None),     # GQA 4
    (None, 33, 20, 8, 1, 128, True, None),  # GQA 8, n_q > n_k causal: rows with no key
    (None, 20, 19, 2, 2, 256, False, None),
    (None, 1, 1, 2, 1, 64, True, None),
]


@pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "q{}-k{}-h{}/{}-d{}-{}".format(
    *s[1:6], "causal" if s[6] else "full"))
def test_backward_tensor_cores_vs_float64(shape, monkeypatch) -> None:
    b, n_q, n_k, h, kvh, d, causal, scale = shape
    rng = np.random.default_rng(n_q * 1000 + n_k + d)
    q, k, v, g = attention_inputs(rng, b, n_q, h, kvh, d, "bf16", n_k)
    names = _record(monkeypatch)
    dq, dk, dv = ops.attention_backward(q, k, v, g, causal=causal, scale=scale, backend=HOST)  # method="auto"
    D = fwd_mod.tc_head_dim(d)
    # head_dim 64 / 128: the fused kernel (attention_bwd_tc_fused.cu); others the dK/dV + dQ pair
    tc = f"attention_bwd_tc_fused_d{D}_bf16" if d in (64, 128) else f"attention_bwd_tc_dq_d{D}_bf16"
    assert names[0] == "attention_bwd_lse_bf16" and tc in names
    assert not any(n.startswith(("attention_bwd_fma_dkdv", "attention_bwd_fma_dq")) for n in names)
    rq, rk, rv = np_attention_backward(q, k, v, g, causal=causal, scale=scale)
    _close("dq", dq, rq, "attention_backward")
    _close("dk", dk, rk, "attention_backward")
    _close("dv", dv, rv, "attention_backward")


def test_backward_is_deterministic_and_uses_given_out_lse(monkeypatch) -> None:
    # head_dim 96: the dK/dV + dQ kernel pair, one writer per element
    rng = np.random.default_rng(11)
    q, k, v, g = attention_inputs(rng, 1, 70, 8, 1, 96, "bf16", 70)
    out, lse = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend=HOST)
    names = _record(monkeypatch)
    r1 = ops.attention_backward(q, k, v, g, out=out, lse=lse, causal=True, backend=HOST)
    assert names[0] == "attention_bwd_preprocess_bf16" and "attention_bwd_lse_bf16" not in names
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "reverse")
    r2 = ops.attention_backward(q, k, v, g, out=out, lse=lse, causal=True, method="tensor_cores", backend=HOST)
    for a, b in zip(r1, r2):  # same bits: one writer per element, fixed summation order
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    rq, rk, rv = np_attention_backward(q, k, v, g, causal=True)
    _close("dk", r1[1], rk, "attention_backward")


# --------------------------------------------------------------------------- float16

F16_SHAPES = [
    # (batch, n_q, n_k, heads, kv_heads, head_dim, causal)
    (1, 65, 70, 2, 1, 64, True),
    (1, 70, 33, 4, 1, 80, False),   # padded 80 -> 96
    (2, 9, 40, 8, 1, 128, True),    # GQA 8
    (1, 33, 37, 2, 2, 256, True),   # the d256 _dv / _dk pair
]


@pytest.mark.parametrize("shape", F16_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}-d{}-{}".format(
    *s[:6], "causal" if s[6] else "full"))
def test_f16_forward_and_backward_on_tensor_cores_vs_float64(shape, monkeypatch) -> None:
    b, n_q, n_k, h, kvh, d, causal = shape
    D = fwd_mod.tc_head_dim(d)
    rng = np.random.default_rng(n_q * 1000 + n_k + d + 7)
    q, k, v = fa_inputs(rng, b, n_q, n_k, h, kvh, d, d, "f16")
    g = rng.standard_normal(q.shape).astype(np.float16)
    names = _record(monkeypatch)
    out, lse = ops.flash_attention(q, k, v, causal=causal, return_lse=True, backend=HOST)
    dq, dk, dv = ops.attention_backward(q, k, v, g, out=out, lse=lse, causal=causal, backend=HOST)
    kv = ([f"attention_bwd_tc_dv_d{D}_f16", f"attention_bwd_tc_dk_d{D}_f16"] if D == 256
          else [f"attention_bwd_tc_dkdv_d{D}_f16"])
    if d in (64, 128):  # the fused kernel, dQ through the fp32 workspace
        assert names == [f"attention_fwd_tc_d{D}_f16", "attention_bwd_tc_prep_f16",
                         f"attention_bwd_tc_fused_d{D}_f16", f"attention_bwd_tc_dq_reduce_d{D}_f16"]
    else:
        assert names == [f"attention_fwd_tc_d{D}_f16", "attention_bwd_preprocess_f16", *kv,
                         f"attention_bwd_tc_dq_d{D}_f16"]
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == np.float16 and lse.dtype == np.float32
    ref_out, ref_lse = np_flash_attention(q, k, v, causal)
    _close("out", out, ref_out, "flash_attention", "f16")
    _close("lse", lse, ref_lse, "flash_attention", "f16")
    rq, rk, rv = np_attention_backward(q, k, v, g, causal=causal)
    for name, got, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        _close(name, got, ref, "attention_backward", "f16")


def test_f16_finer_than_bf16_on_tensor_cores() -> None:
    # The f16 kernels must keep f16's 3 extra mantissa bits end to end (the mma reads f16, P is packed to
    # f16): their error is far below what the same inputs give through the bf16 kernels.
    rng = np.random.default_rng(21)
    q, k, v = fa_inputs(rng, 1, 64, 64, 2, 1, 64, 64, "f16")
    ref, _ = np_flash_attention(q, k, v, True)
    e16 = np.abs(ops.flash_attention(q, k, v, causal=True, backend=HOST).astype(np.float64) - ref).max()
    bf = [fwd_cases._cast(a.astype(np.float32), "bf16") for a in (q, k, v)]
    refb, _ = np_flash_attention(*bf, True)
    e_bf = np.abs(ops.flash_attention(*bf, causal=True, backend=HOST).astype(np.float64) - refb).max()
    assert e16 < e_bf / 4, (e16, e_bf)


@pytest.mark.parametrize("method", ["naive", "flash", "tensor_cores"])
def test_f16_gradients_overflow_to_inf_beyond_65504(method: str) -> None:
    # Two queries see only key 0 (P = 1): dV = dO_0 + dO_1 = 80000 > 65504 -> inf in f16, as on the GPU;
    # dS = P (dP - delta) = 0, so dq and dk stay 0.
    q = np.ones((2, 1, 16), np.float16)
    k = np.ones((1, 1, 16), np.float16)
    v = np.ones((1, 1, 16), np.float16)
    g = np.full((2, 1, 16), 40000.0, np.float16)
    dq, dk, dv = ops.attention_backward(q, k, v, g, causal=False, method=method, backend=HOST)
    assert dv.dtype == np.float16 and np.isposinf(dv).all(), dv
    assert (dq == 0).all() and (dk == 0).all()
    dq, dk, dv = ops.attention_backward(q, k, v, g / 4, causal=False, method=method, backend=HOST)
    assert (dv == 20000).all()  # 20000 is an f16 value: exact, finite


def test_f16_fma_path_on_request(monkeypatch) -> None:
    rng = np.random.default_rng(5)
    q, k, v = fa_inputs(rng, 1, 40, 50, 4, 2, 80, 80, "f16")
    names = _record(monkeypatch)
    a = ops.flash_attention(q, k, v, causal=True, backend=HOST)
    b = ops.flash_attention(q, k, v, causal=True, tensor_cores=False, backend=HOST)
    assert names == ["attention_fwd_tc_d96_f16", "attention_fwd_fma_d128_f16"]
    ref, _ = np_flash_attention(q, k, v, True)
    _close("tc", a, ref, "flash_attention", "f16")
    _close("fma", b, ref, "flash_attention", "f16")


def test_backward_method_errors() -> None:
    rng = np.random.default_rng(0)
    q, k, v, g = attention_inputs(rng, None, 4, 2, 1, 32, "f32", 4)
    with pytest.raises(ArgumentError, match="tensor_cores"):
        ops.attention_backward(q, k, v, g, method="tensor_cores", backend=HOST)


# --------------------------------------------------------------------------- SASS and resources

def test_every_16bit_attention_kernel_runs_on_tensor_cores_in_sass() -> None:
    sr = _sass_report()
    mix = sr.instruction_mix(TC_FWD + TC_BWD, ["sm_80", "sm_90"], with_resources=True)
    assert set(mix) == set(TC_FWD + TC_BWD)
    for name, per_arch in mix.items():
        f16 = name.endswith("_f16")
        for arch in ("sm_80", "sm_90"):
            row = per_arch[arch]
            assert row["HMMA"] > 0, (name, arch, row)
            # bf16: every MMA is HMMA.16816.F32.BF16; f16: HMMA.16816.F32 (f16 x f16 -> f32), no .BF16
            assert row["HMMA_BF16"] == (0 if f16 else row["HMMA"]), (name, arch, row)
            assert row["LDSM"] > 0 and row["LDGSTS"] > 0, (name, arch, row)  # ldmatrix, cp.async
            # P / dS packed to the element type in registers: F2FP.F16.F32.PACK_AB for f16, the bf16 pack else
            assert row["F2FP"] > 0, (name, arch, row)
            assert (row["F2FP_F16"] == row["F2FP"]) if f16 else (row["F2FP_F16"] == 0), (name, arch, row)
            assert row["LDL"] == row["STL"] == 0 and row["spill_stores"] == 0, (name, arch, row)
    # the fp32 FMA kernels (sm_75's bf16 path) have no tensor-core instruction: the test can tell
    old = sr.instruction_mix("attention_fwd_fma_d128_bf16", ["sm_80"])["attention_fwd_fma_d128_bf16"]["sm_80"]
    assert old["HMMA"] == 0


def test_f16_fma_attention_kernels_convert_in_hardware() -> None:
    # sm_75's f16 path (and tensor_cores=False): f16 -> fp32 by HADD2.F32 (cvt.f32.f16), fp32 -> f16 by
    # F2FP.F16.F32.PACK_AB (cvt.rn.f16x2.f32), no bf16 conversion, no spills
    sr = _sass_report()
    names = F16_FMA_NARROWING + F16_FMA_WIDEN_ONLY
    mix = sr.instruction_mix(names, ["sm_80", "sm_90"], with_resources=True)
    assert set(mix) == set(names)
    for name, per_arch in mix.items():
        for arch, row in per_arch.items():
            assert row["HADD2_F32"] > 0 and row["HMMA"] == 0, (name, arch, row)
            assert row["F2FP"] == row["F2FP_F16"], (name, arch, row)  # no bf16 pack
            assert (row["F2FP_F16"] > 0) == (name in F16_FMA_NARROWING), (name, arch, row)
            assert row["LDL"] == row["STL"] == 0 and row["spill_stores"] == 0, (name, arch, row)


@pytest.mark.slow
def test_no_spills_on_any_arch_nvrtc_offers() -> None:
    # tests/test_compiler.py already compiles every kernels_cu file for its REAL_ARCHS and fails on a
    # spill; this covers every other arch `--arch all` offers (sm_87/88/89/103/107/110/121 today).
    from pykern import compiler

    from test_compiler import REAL_ARCHS

    # `--arch all` also names the newest PTX (compute_XY): nothing is register-allocated there, so only
    # the cubin archs can spill.
    rest = [a for a in compiler.expand_archs(["all"]) if a.startswith("sm_") and a not in REAL_ARCHS]
    if not rest:
        pytest.skip("this NVRTC offers no arch beyond tests/test_compiler.py's")
    out = subprocess.run([sys.executable, "-m", "pykern.precompile", "--kernels", "*_tc_*", "--json",
                          *(x for a in rest for x in ("--arch", a))], cwd=ROOT, capture_output=True, text=True,
                         timeout=1800, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    # '*_tc_*' also names the MoE tensor-core GEMMs (moe.cu) and the tensor-core decode (decode_tc.cu), whose
    # spills on these archs this test checks too: every kernel it compiled must not spill; the attention
    # ones must all be there, and the GEMMs and decode on every arch
    cubins = [r for r in res["results"] if r["kind"] == "cubin"]
    rows = [r for r in cubins if "attention" in r["kernel"]]
    assert {r["kernel"] for r in rows} == set(TC_FWD + TC_BWD + TC_BWD_AUX)
    assert {r["arch"] for r in rows} == set(rest)
    for prefix in ("grouped_gemm_tc", "decode_tc_paged"):
        assert {r["arch"] for r in cubins if r["kernel"].startswith(prefix)} == set(rest), prefix
    bad = [(r["kernel"], r["arch"], r["spill_stores"], r["spill_loads"], r["stack_bytes"]) for r in cubins
           if r["spill_stores"] or r["spill_loads"] or r["stack_bytes"]]
    assert not bad, bad


# --------------------------------------------------------------------------- fused backward (d64 / d128)

FUSED_SHAPES = [
    # (batch, n_q, n_k, heads, kv_heads, head_dim, causal, window, softcap)
    (None, 70, 130, 4, 2, 64, False, (-1, -1), 0.0),   # full tiles: the flat loop; GQA 2
    (2, 50, 40, 4, 1, 128, True, (-1, -1), 0.0),       # n_q > n_k causal: rows that see no key; GQA 4
    (None, 40, 100, 2, 2, 128, True, (30, -1), 1.5),    # window + softcap
    (None, 1, 1, 2, 1, 64, True, (-1, -1), 0.0),        # seq 1
]


@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: "q{}-k{}-h{}/{}-d{}".format(*s[1:6]))
@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_fused_backward_both_modes_vs_float64(shape, kind, monkeypatch) -> None:
    b, n_q, n_k, h, kvh, d, causal, win, cap = shape
    rng = np.random.default_rng(n_q * 7 + n_k + d)
    q, k, v, g = attention_inputs(rng, b, n_q, h, kvh, d, kind, n_k)
    kw = {"causal": causal, "window_size": win, "softcap": cap}
    rq, rk, rv = np_attention_backward(q, k, v, g, **kw)
    for det in (False, True):
        names = _record(monkeypatch)
        dq, dk, dv = ops.attention_backward(q, k, v, g, deterministic=det, backend=HOST, **kw)
        c = "_softcap" if cap else ""
        assert f"attention_bwd_tc_fused_d{d}{c}{'_det' if det else ''}_{kind}" in names, names
        for name, got, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
            _close(f"{name} det={det}", got, ref, "attention_backward", kind)


def test_fused_backward_deterministic_mode_is_bit_identical_across_schedules(monkeypatch) -> None:
    # Several key tiles add into each dQ row: with atomics the fp32 sum follows the block order (addition is
    # not associative; on a GPU the order varies run to run); deterministic=True sums per-key-tile partials
    # in key-tile order, whatever the schedule.
    rng = np.random.default_rng(3)
    q, k, v, g = attention_inputs(rng, None, 40, 2, 1, 64, "bf16", 300)
    runs = {}
    for sched in ("forward", "reverse", "random:1", "random:2", "random:3"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", sched)
        runs[sched] = [np.asarray(x).view(np.uint16).copy()
                       for x in ops.attention_backward(q, k, v, g, causal=False, deterministic=True, backend=HOST)]
    first = runs["forward"]
    for sched, r in runs.items():
        for a, b in zip(first, r):
            np.testing.assert_array_equal(a, b, err_msg=sched)


def test_fused_backward_deterministic_workspace_in_chunks(monkeypatch) -> None:
    # A workspace cap below one key tile's partial: one launch + reduce per key tile, same bits.
    from pykern.ops import attention as ta

    rng = np.random.default_rng(4)
    q, k, v, g = attention_inputs(rng, None, 20, 2, 1, 64, "bf16", 200)
    whole = ops.attention_backward(q, k, v, g, causal=True, deterministic=True, backend=HOST)
    names = _record(monkeypatch)
    monkeypatch.setattr(ta, "DET_WORKSPACE_BYTES", 1)
    chunked = ops.attention_backward(q, k, v, g, causal=True, deterministic=True, backend=HOST)
    assert names.count("attention_bwd_tc_fused_d64_det_bf16") == 4  # 200 keys: 4 key tiles
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_deterministic_argument_is_checked() -> None:
    rng = np.random.default_rng(0)
    q, k, v, g = attention_inputs(rng, None, 4, 2, 1, 64, "bf16", 4)
    with pytest.raises(TypeError, match="deterministic"):
        ops.attention_backward(q, k, v, g, deterministic="yes", backend=HOST)
