"""The Hopper (sm_90a) attention forward and backward, kernels_cu/attention_fwd_sm90.cu and
attention_bwd_sm90.cu.

On the host backend playing sm_90a (PYKERN_HOST_ARCH=sm_90a: TMA, mbarrier and wgmma emulated, see
pykern/host/pk_host_sm90.cpp) the forward equals float64 NumPy within the flash_attention tolerance rows over
head_dim 64/128/256 and 192 / head_dim_v 128, with and without softcap, causal and not, windows, GQA, n_q != n_k
both ways and lengths off every tile; the op chooses it only where it applies; a pipeline mistake (a consumer
that does not wait on the `full` mbarrier, a wgmma without its fence) is reported. From the cubin NVRTC makes for
sm_90a (no GPU needed): HGMMA, UTMALDG, SYNCS and setmaxnreg in the SASS, MUFU.TANH only in the softcap kernels,
a flat steady-state loop at <= 2.0 warp-instructions per m16n8k16-equivalent at every head dim without softcap
(the softcap kernels pinned at their own figures), and no spills, for the dense and the varlen entries
(flash_attention_varlen on sm_90a: tests/test_attention_sm90_varlen.py). The backward (dK/dV and dQ kernels,
with and without softcap, head_dim 256 included: dK / dV with the head dim split across the consumers) likewise
against float64,
the same bits under every host schedule; in the SASS of
every backward kernel (dense and varlen, with and without softcap) HGMMA, UTMALDG and SYNCS, MUFU.TANH only in
the _softcap ones, no spills, and a flat steady-state loop pinned at its warp-instructions per MMA.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases.attention import fa_inputs, np_flash_attention
from pykern.errors import ArgumentError, KernelExecutionError
from pykern.ops import _attention_sm90 as sm90
from pykern.tolerance import tolerance
from launch_spy import record_launches as _record
from attn_checks import check_lse, close, sm90_host  # noqa: F401 (a fixture)
from sass_helpers import compile_sass, kernel_ops, report
from sm90_mutants import keep_families, write_mutant

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "kernels_cu" / "attention_fwd_sm90.cu"
pytestmark = pytest.mark.usefixtures("sm90_host")

HOST = "host"


# --------------------------------------------------------------------------- forward vs float64
SHAPES = [
    # (batch, n_q, n_k, heads, kv_heads, head_dim, causal)
    (1, 130, 200, 2, 1, 64, False),   # off the 128-query and 128-key tiles, GQA 2
    (1, 257, 257, 2, 2, 64, True),    # three query tiles, three key tiles: masked / steady / masked
    (2, 100, 300, 4, 1, 128, True),   # n_q < n_k, GQA 4, batch 2
    (1, 200, 70, 2, 1, 128, True),    # n_q > n_k: the first 130 rows see no key
    (1, 129, 384, 8, 2, 128, False),  # steady tiles only (every row sees every key), GQA 4
    (1, 70, 90, 2, 1, 256, True),     # d256: 64-key tiles
]


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}-d{}-{}".format(
    *s[:6], "causal" if s[6] else "full"))
def test_forward_sm90_vs_float64(shape, dtype, monkeypatch) -> None:
    b, n_q, n_k, h, kvh, d, causal = shape
    rng = np.random.default_rng(n_q * 1000 + n_k + d)
    q, k, v = fa_inputs(rng, b, n_q, n_k, h, kvh, d, d, dtype)
    names = _record(monkeypatch)
    out, lse = ops.flash_attention(q, k, v, causal=causal, return_lse=True, backend=HOST)
    assert names == [f"attention_fwd_sm90_d{d}_{dtype}"]
    ref_out, ref_lse = np_flash_attention(q, k, v, causal)
    close("out", out, ref_out, "flash_attention", dtype)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("schedule", ["reverse", "random:7"])
def test_forward_sm90_under_other_thread_schedules(schedule, monkeypatch) -> None:
    # consumers that run ahead wait on `full` before the producer issues the copy (the emulator lands it at
    # issue then); the result does not depend on the order
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    rng = np.random.default_rng(9)
    q, k, v = fa_inputs(rng, 1, 150, 150, 2, 1, 128, 128, "bf16")
    out, lse = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend=HOST)
    ref_out, ref_lse = np_flash_attention(q, k, v, True)
    close("out", out, ref_out, "flash_attention", "bf16")
    check_lse(lse, ref_lse)


def test_forward_sm90_sliding_window(monkeypatch) -> None:
    rng = np.random.default_rng(5)
    q, k, v = fa_inputs(rng, 1, 300, 300, 2, 1, 64, 64, "bf16")
    names = _record(monkeypatch)
    out, lse = ops.flash_attention(q, k, v, window_size=(100, 20), return_lse=True, backend=HOST)
    assert names == ["attention_fwd_sm90_d64_bf16"]
    ref_out, ref_lse = np_flash_attention(q, k, v, False, window_size=(100, 20))
    close("out", out, ref_out, "flash_attention", "bf16")
    check_lse(lse, ref_lse)


def test_the_op_chooses_sm90_only_where_it_applies(monkeypatch) -> None:
    rng = np.random.default_rng(1)
    names = _record(monkeypatch)
    q, k, v = fa_inputs(rng, 1, 40, 50, 2, 1, 128, 128, "bf16")
    ops.flash_attention(q, k, v, causal=True, backend=HOST)
    ops.flash_attention(q, k, v, causal=True, softcap=30.0, backend=HOST)  # softcap: sm_90a too
    ops.flash_attention(q[..., :96].copy(), k[..., :96].copy(), v[..., :96].copy(), backend=HOST)  # d96: sm_90a too
    # d80: the d96 kernel over maps of 80 columns (sm90.padded_dim)
    ops.flash_attention(q[..., :80].copy(), k[..., :80].copy(), v[..., :80].copy(), backend=HOST)
    ops.flash_attention(q, k, v[..., :64].copy(), backend=HOST)  # head_dim_v != head_dim (but 192 / 128)
    # a base that is not 16-byte aligned cannot be a TMA source: the mma.sync kernel takes it
    buf = np.zeros(q.size + 1, q.dtype)
    q_odd = buf[1:].reshape(q.shape)
    q_odd[...] = q
    ops.flash_attention(q_odd, k, v, backend=HOST)
    monkeypatch.setenv("PYKERN_HOST_ARCH", "")
    ops.flash_attention(q, k, v, causal=True, backend=HOST)  # not playing Hopper
    assert names == ["attention_fwd_sm90_d128_bf16", "attention_fwd_sm90_d128_softcap_bf16",
                     "attention_fwd_sm90_d96_bf16", "attention_fwd_sm90_d96_bf16", "attention_fwd_tc_pad_d128_bf16",
                     "attention_fwd_tc_pad_d128_bf16", "attention_fwd_tc_d128_bf16"]


def test_the_op_chooses_sm90_for_192_128_and_softcap(monkeypatch) -> None:
    # DeepSeek-V3's prefill shape and softcap take the sm_90a kernels (d192_dv128, _softcap); the other
    # head_dim_qk != head_dim_v shapes keep the padded mma.sync kernels, as does the shape off Hopper.
    rng = np.random.default_rng(3)
    names = _record(monkeypatch)
    q, k, v = fa_inputs(rng, 1, 40, 50, 2, 1, 192, 128, "f16")
    ops.flash_attention(q, k, v, backend=HOST)
    ops.flash_attention(q, k, v, softcap=20.0, backend=HOST)
    ops.flash_attention(q, k, v[..., :64].copy(), backend=HOST)  # 192 / 64
    ops.flash_attention(q[..., :128].copy(), k[..., :128].copy(), v, softcap=20.0, scale=-0.1, backend=HOST)
    ops.flash_attention(q[..., :128].copy(), k[..., :128].copy(), v, scale=-0.1, backend=HOST)  # raw-score max
    monkeypatch.setenv("PYKERN_HOST_ARCH", "")
    ops.flash_attention(q, k, v, softcap=20.0, backend=HOST)
    assert names == ["attention_fwd_sm90_d192_dv128_f16", "attention_fwd_sm90_d192_dv128_softcap_f16",
                     "attention_fwd_tc_d256_f16", "attention_fwd_sm90_d128_softcap_f16", "attention_fwd_tc_d128_f16",
                     "attention_fwd_tc_d256_softcap_f16"]


# softcap (the _softcap kernels: c * tanh(scale * q.k / c) before the mask and the softmax) and head_dim 192 with
# head_dim_v 128 (d192_dv128), through the op: (batch, n_q, n_k, heads, kv_heads, head_dim, head_dim_v, causal,
# window, softcap, scale). Caps of 1.5..5 bend most scores (they are about N(0, 1) here); n_k past two or three key
# tiles gives steady tiles (the lazy softmax on capped scores; the pair loop at d64 / d256).
SHAPES_MORE = [
    (1, 130, 600, 4, 2, 64, 64, False, (-1, -1), 2.0, None),      # masked, peeled, pair loop; GQA 2
    (2, 150, 300, 2, 1, 64, 64, True, (-1, -1), 5.0, None),       # batch 2, causal
    (1, 150, 500, 2, 1, 128, 128, True, (-1, -1), 3.0, None),     # steady tiles under the causal mask
    (1, 200, 100, 2, 1, 128, 128, False, (40, 10), 2.5, None),    # window, n_q > n_k: rows with no key
    (1, 100, 260, 2, 2, 256, 256, False, (-1, -1), 1.5, None),    # d256 pair loop
    (1, 60, 90, 2, 1, 128, 128, True, (-1, -1), 4.0, -0.125),     # a negative scale (softcap only)
    (1, 100, 300, 4, 1, 192, 128, False, (-1, -1), 0.0, None),    # GQA 4, steady tiles
    (2, 150, 100, 2, 1, 192, 128, True, (-1, -1), 0.0, None),     # causal, n_q > n_k, batch 2
    (1, 130, 300, 2, 2, 192, 128, False, (100, 20), 0.0, None),   # window
    (1, 150, 280, 4, 2, 192, 128, True, (60, -1), 2.5, None),     # both, with a left window
]


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES_MORE, ids=lambda s: "b{}-q{}-k{}-h{}/{}-d{}v{}-{}-w{},{}-cap{}".format(
    *s[:7], "causal" if s[7] else "full", *s[8], s[9]))
def test_forward_sm90_softcap_and_192_128_vs_float64(shape, dtype, monkeypatch) -> None:
    b, n_q, n_k, h, kvh, d, dv, causal, window, cap, scale = shape
    rng = np.random.default_rng(n_q * 1000 + n_k + d + dv)
    q, k, v = fa_inputs(rng, b, n_q, n_k, h, kvh, d, dv, dtype)
    names = _record(monkeypatch)
    out, lse = ops.flash_attention(q, k, v, causal=causal, window_size=window, softcap=cap, scale=scale,
                                   return_lse=True, backend=HOST)
    assert names == [sm90.kernel_name(d, dv, cap, f"_{dtype}")]
    assert np.asarray(out).shape == (b, n_q, h, dv)
    ref_out, ref_lse = np_flash_attention(q, k, v, causal, scale, window, cap)
    close("out", out, ref_out, "flash_attention", dtype)
    check_lse(lse, ref_lse)


# head dims between the compiled ones (head_dim == head_dim_v a multiple of 8 up to 256): the next compiled kernel up
# (sm90.padded_dim) over tensor maps of the true head dim, whose loads zero-fill the box columns past it and whose
# TMA store writes only the columns below it (a store past them would overwrite the next head's first columns of
# out, which the float64 comparison covers): (batch, n_q, n_k, heads, kv_heads, head_dim, causal, window, softcap)
PAD_SHAPES = [
    (1, 130, 200, 4, 2, 80, False, (-1, -1), 0.0),   # -> d96 (3 boxes of 32, the last 16 columns in bounds); GQA 2
    (1, 150, 140, 2, 1, 112, True, (-1, -1), 0.0),   # -> d128 (the second 64-column box 48 in bounds), GQA 2
    (1, 70, 90, 2, 1, 40, True, (-1, -1), 2.0),      # -> d64_softcap (one box, 40 in bounds)
    (1, 70, 150, 2, 2, 160, False, (30, 10), 0.0),   # -> d256, window (the fourth box wholly past the head dim)
    (2, 60, 80, 2, 1, 80, True, (-1, -1), 3.0),      # -> d96_softcap, batch 2
]


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("shape", PAD_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}-d{}-{}-w{},{}-cap{}".format(
    *s[:6], "causal" if s[6] else "full", *s[7], s[8]))
def test_forward_sm90_head_dims_between_the_compiled_ones_vs_float64(shape, dtype, monkeypatch) -> None:
    b, n_q, n_k, h, kvh, d, causal, window, cap = shape
    rng = np.random.default_rng(n_q * 1000 + n_k + d)
    q, k, v = fa_inputs(rng, b, n_q, n_k, h, kvh, d, d, dtype)
    names = _record(monkeypatch)
    out, lse = ops.flash_attention(q, k, v, causal=causal, window_size=window, softcap=cap, return_lse=True,
                                   backend=HOST)
    pd = {40: 64, 80: 96, 112: 128, 160: 256}[d]
    assert sm90.padded_dim(d) == pd
    assert names == [f"attention_fwd_sm90_d{pd}{'_softcap' if cap else ''}_{dtype}"]
    assert np.asarray(out).shape == (b, n_q, h, d)
    # the reference's scale is the true 1 / sqrt(d), as the op passes it
    ref_out, ref_lse = np_flash_attention(q, k, v, causal, None, window, cap)
    close("out", out, ref_out, "flash_attention", dtype)
    check_lse(lse, ref_lse)


def test_padded_head_dims_and_where_they_do_not_apply(monkeypatch) -> None:
    # every multiple of 8 up to 256 has a dense kernel (the next compiled one up); other head dims, head_dim_v !=
    # head_dim off 192 / 128, the varlen form and the backward keep their exact shapes
    assert [sm90.padded_dim(d) for d in (8, 64, 72, 96, 104, 128, 136, 248, 256)] == [64, 64, 96, 96, 128, 128, 256,
                                                                                    256, 256]
    assert [sm90.padded_dim(d) for d in (0, 4, 36, 81, 264)] == [None] * 5
    assert sm90.forward_shape(192, 128) == (192, 128) and sm90.forward_shape(80, 80) == (96, 96)
    assert sm90.forward_shape(80, 64) is None and sm90.forward_shape(192, 192) == (256, 256)
    rng = np.random.default_rng(11)
    q, k, v = fa_inputs(rng, 1, 20, 30, 2, 1, 36, 36, "bf16")  # 36: not a multiple of 8 (72-byte rows)
    names = _record(monkeypatch)
    ops.flash_attention(q, k, v, backend=HOST)
    monkeypatch.setenv("PYKERN_SM90", "0")
    ops.flash_attention(q[..., :32].copy(), k[..., :32].copy(), v[..., :32].copy(), backend=HOST)
    assert names == ["attention_fwd_tc_pad_d64_bf16", "attention_fwd_tc_pad_d64_bf16"]


def test_torch_autograd_at_d80_sm90_forward_mma_sync_backward(monkeypatch) -> None:
    """pykern.torch at head_dim 80 on sm_90a: the d96 sm_90a forward (80-column maps), the mma.sync d96 backward
    (no sm_90a backward at d80) from the forward's out and lse; out and the gradients equal float64."""
    torch = pytest.importorskip("torch")
    import pykern.torch as pt
    from pykern.difftest.cases.attention import np_attention_backward

    names = _record(monkeypatch)
    gen = torch.Generator().manual_seed(80)
    q = torch.randn(1, 90, 4, 80, generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 110, 2, 80, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    go = torch.randn(1, 90, 4, 80, generator=gen).bfloat16()
    out = pt.flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), go)
    assert names[0] == "attention_fwd_sm90_d96_bf16" and not any("sm90" in n for n in names[1:]), names
    arrs = [t.detach().float().numpy().astype(ml_dtypes.bfloat16) for t in (q, k, v, go)]
    close("out", out.detach().float().numpy(), np_flash_attention(*arrs[:3], True)[0], "flash_attention", "bf16")
    for name, got, want in zip(("dq", "dk", "dv"), grads, np_attention_backward(*arrs, causal=True)):
        close(name, got.float().numpy(), want, "attention_backward", "bf16")


def test_softcap_changes_the_result_and_matches_its_own_reference(monkeypatch) -> None:
    # the cap is applied (a test that passed with the cap ignored would be vacuous): without it the output is off
    # by far more than the tolerance
    rng = np.random.default_rng(8)
    q, k, v = fa_inputs(rng, 1, 130, 300, 2, 1, 128, 128, "bf16")
    out = np.asarray(ops.flash_attention(q, k, v, softcap=1.0, backend=HOST), np.float64)
    capped, _ = np_flash_attention(q, k, v, False, None, (-1, -1), 1.0)
    plain, _ = np_flash_attention(q, k, v, False)
    close("out", out, capped, "flash_attention", "bf16")
    assert np.abs(out - plain).max() > 0.05


def test_sm90_and_mma_sync_forwards_agree(monkeypatch) -> None:
    rng = np.random.default_rng(2)
    q, k, v = fa_inputs(rng, 1, 150, 150, 2, 1, 128, 128, "f16")
    a, la = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend=HOST)
    monkeypatch.setenv("PYKERN_HOST_ARCH", "")
    b, lb = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend=HOST)
    # both round P to f16 for P.V; they differ only in fp32 summation order and one f16 rounding of out
    assert np.abs(a.astype(np.float64) - b.astype(np.float64)).max() <= 2 * 2.0 ** -11 * np.abs(b).max()
    assert np.abs(la - lb).max() < 1e-5


# --------------------------------------------------------------------------- backward vs float64
BWD_SHAPES = [
    # (batch, n_q, n_k, heads, kv_heads, head_dim, causal)
    (None, 130, 150, 2, 1, 64, True),   # 3-D inputs, off the 128-row tiles, GQA 2
    (2, 70, 200, 4, 2, 128, False),     # n_q < n_k, GQA 2, batch 2
    (1, 100, 60, 4, 1, 128, True),      # n_q > n_k causal: 40 rows see no key; GQA 4
    (1, 1, 1, 2, 1, 64, True),          # length 1
    (2, 130, 150, 4, 2, 96, True),      # d96: 32-column boxes (64B swizzle), off the tiles, GQA 2
    (None, 70, 200, 2, 1, 96, False),   # d96, 3-D inputs, n_q < n_k
]


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "q{}-k{}-h{}/{}-d{}-{}".format(
    *s[1:6], "causal" if s[6] else "full"))
def test_backward_sm90_vs_float64(shape, dtype, monkeypatch) -> None:
    from pykern.difftest.cases.attention import attention_inputs, np_attention_backward

    b, n_q, n_k, h, kvh, d, causal = shape
    rng = np.random.default_rng(n_q * 1000 + n_k + d)
    q, k, v, g = attention_inputs(rng, b, n_q, h, kvh, d, dtype, n_k)
    names = _record(monkeypatch)
    dq, dk, dv = ops.attention_backward(q, k, v, g, causal=causal, backend=HOST)
    # the fused kernel (dK, dV and dQ's atomic partials; d96 too), between the pre-pass that zeroes its accumulator
    # and the narrowing of that accumulator
    assert names == [f"attention_bwd_lse_{dtype}", f"attention_bwd_tc_prep_{dtype}",
                     f"attention_bwd_sm90_fused_d{d}_{dtype}", f"attention_bwd_tc_dq_reduce_d{d}_{dtype}"]
    rq, rk, rv = np_attention_backward(q, k, v, g, causal=causal)
    atol, rtol = tolerance("attention_backward", dtype)
    for name, got, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        err = np.abs(np.asarray(got).astype(np.float64) - ref)
        bad = ~(err <= atol + rtol * np.abs(ref))
        assert not bad.any(), f"{name}: {bad.sum()} of {bad.size} off, max err {err.max():.3g}"


def test_backward_sm90_is_deterministic_with_the_forwards_out_and_lse(monkeypatch) -> None:
    from pykern.difftest.cases.attention import attention_inputs, np_attention_backward

    rng = np.random.default_rng(11)
    q, k, v, g = attention_inputs(rng, 1, 150, 8, 2, 128, "bf16", 150)
    out, lse = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend=HOST)
    names = _record(monkeypatch)
    r1 = ops.attention_backward(q, k, v, g, out=out, lse=lse, causal=True, deterministic=True, backend=HOST)
    # the pre-pass from out (delta) zeroes the accumulator; the _det kernel orders dQ's adds by semaphores
    assert names == ["attention_bwd_tc_prep_bf16", "attention_bwd_sm90_fused_det_d128_bf16",
                     "attention_bwd_tc_dq_reduce_d128_bf16"]
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "reverse")
    r2 = ops.attention_backward(q, k, v, g, out=out, lse=lse, causal=True, deterministic=True, backend=HOST)
    for a, b in zip(r1, r2):  # same bits: dQ's partials added in key-tile order whatever the block order
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    rq, rk, rv = np_attention_backward(q, k, v, g, causal=True)
    atol, rtol = tolerance("attention_backward", "bf16")
    for got, ref in zip(r1, (rq, rk, rv)):
        assert (np.abs(np.asarray(got).astype(np.float64) - ref) <= atol + rtol * np.abs(ref)).all()


# (batch, n_q, n_k, heads, kv_heads, head_dim, causal, window): every key tile's order among the key tiles
# that see a query tile (the semaphore's count) comes from the query tile's key span
FUSED_DET_SHAPES = [
    (1, 300, 400, 2, 1, 64, True, (-1, -1)),     # 4 key tiles, 5 query tiles of 64; GQA 2: heads in turn
    (2, 200, 256, 2, 2, 128, False, (-1, -1)),   # every key tile sees every query tile; 32-query tiles
    (1, 260, 260, 2, 1, 128, False, (100, 30)),  # a window: query tiles seen by 2 or 3 of the 3 key tiles
    # d96 (32-column boxes; consumer 1's dQ^T rows 32..63 computed twice, only its rows 64.. added)
    (1, 300, 400, 2, 1, 96, True, (-1, -1)),     # 4 key tiles, 10 query tiles of 32 in descending order
    (2, 150, 260, 4, 2, 96, False, (90, 40)),    # a window, GQA 2, batch 2, ascending order
]


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("shape", FUSED_DET_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}-d{}-{}-w{}".format(*s))
def test_backward_sm90_fused_deterministic_same_bits_under_every_block_order(shape, dtype, monkeypatch) -> None:
    """deterministic=True: the semaphore-ordered kernel; forward, reverse and random block (and thread) orders
    give the same bits, which equal float64 within the tolerance rows. The atomic kernel on the same inputs
    equals float64 too (its dQ bits may differ with the order: the adds follow the blocks)."""
    from pykern.difftest.cases.attention import attention_inputs, np_attention_backward

    b, n_q, n_k, h, kvh, d, causal, window = shape
    rng = np.random.default_rng(n_q + n_k + d)
    q, k, v, g = attention_inputs(rng, b, n_q, h, kvh, d, dtype, n_k)
    names = _record(monkeypatch)
    runs = []
    for schedule in ("forward", "reverse", "random:7"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
        runs.append(ops.attention_backward(q, k, v, g, causal=causal, window_size=window, deterministic=True,
                                           backend=HOST))
    assert f"attention_bwd_sm90_fused_det_d{d}_{dtype}" in names and not any("_dq_d" in n and "sm90" in n
                                                                             for n in names), names
    for other in runs[1:]:
        for a, b_ in zip(runs[0], other):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b_).view(np.uint16))
    ref = np_attention_backward(q, k, v, g, causal=causal, window_size=window)
    for name, got, want in zip(("dq", "dk", "dv"), runs[0], ref):
        close(name, got, want, "attention_backward", dtype)
    del names[:]
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "random:3")
    atomic = ops.attention_backward(q, k, v, g, causal=causal, window_size=window, backend=HOST)
    assert names[-2] == f"attention_bwd_sm90_fused_d{d}_{dtype}", names
    for name, got, want in zip(("dq", "dk", "dv"), atomic, ref):
        close(name, got, want, "attention_backward", dtype)


def test_backward_shared_bytes_are_the_kernels_macros(tmp_path) -> None:
    """The op's shared_mem of every sm_90a backward kernel (bwd_shared_bytes, bwd_dkdv_shared_bytes,
    bwd_fused_shared_bytes, and the steps and rows they read) equals the .cu's macro, evaluated by the host's C++
    compiler (the macros use ?:); each kernel static_asserts its own carve-up against the macro, so a layout
    change that leaves the Python figure behind fails here, not as a launch that overruns shared memory."""
    import subprocess

    from pykern.host.build import find_compiler

    src = (ROOT / "kernels_cu" / "attention_bwd_sm90.cu").read_text()
    defines = "\n".join(re.findall(r"^#define AB90_\w+(?:\(.*?\))?(?:[^\n]*\\\n)*[^\n]*$", src, re.M))
    checks = [f"static_assert(AB90_ROWS == {sm90.BWD_ROWS});"]
    for d, dv in sm90.BWD_SHAPES:
        dq_step = sm90.bwd_dq_step(d)
        checks += [
            f"static_assert(AB90_DQ_STEP({d}) == {dq_step});",
            f"static_assert(AB90_DKDV_STEP({d}, {dv}) == {sm90.bwd_dkdv_step(d, dv)});",
            f"static_assert(AB90_DKDV_ROWS({d}, {dv}) == {sm90.bwd_dkdv_rows(d, dv)});",
            f"static_assert(AB90_SMEM_BYTES({d}, {dv}, {dq_step}) == {sm90.bwd_shared_bytes(d, dq_step, dv)});",
            f"static_assert(AB90_DKDV_SMEM_BYTES({d}, {dv}, 0) == {sm90.bwd_dkdv_shared_bytes(d, dv)});",
        ]
    fused = {d: sm90.bwd_fused_shared_bytes(d) for d in sm90.BWD_FUSED_HEAD_DIMS}
    assert fused == {64: 132096, 96: 115712, 128: 148480, 256: 222208}  # the figures the .cu's comment gives
    for d, smem in fused.items():
        checks += [f"static_assert(AB90_DKDV_SMEM_BYTES({d}, {d}, {dqa}) == {smem});" for dqa in (1, 2)]
    # 192 / 128's fused kernel (FlashAttention-3's tiling, ab90_fused_kt): 96 keys, 64-query tiles, 218112 bytes
    assert sm90.bwd_fused_shared_bytes(192, 128) == 218112
    checks += [f"static_assert(AB90_KT_ROWS == {sm90.bwd_fused_rows(192, 128)} && AB90_KT_STEP == "
               f"{sm90.bwd_fused_step(192, 128)} && AB90_KT_SMEM_BYTES(192, 128) == 218112);"]
    path = tmp_path / "ab90_smem.cpp"
    path.write_text(defines + "\n" + "\n".join(checks) + "\n")
    run = subprocess.run([*find_compiler().argv, "-std=c++17", "-fsyntax-only", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "AB90_DKDV_SMEM_BYTES(D, DV, DQA)" in defines and len(checks) == 1 + 5 * len(sm90.BWD_SHAPES) + 9


@pytest.mark.parametrize("backend", ["host", "numba"])
def test_d96_dq_narrowing_kernel_scales_and_rounds_the_accumulator(backend: str) -> None:
    """attention_bwd_tc_dq_reduce_d96 (the fused d96 kernel's narrowing; the numba reference too): dq[b, i, h, :]
    = f16(scale * acc[b, h, i, :]) for the n_q rows of each (batch, head) run of nq_pad, the padded rows unread."""
    import pykern

    rng = np.random.default_rng(96)
    b, n_q, h, nq_pad, d, scale = 2, 70, 3, 128, 96, 0.125
    acc = rng.standard_normal((b, h, nq_pad, d)).astype(np.float32)
    acc[:, :, n_q:] = np.nan  # padded rows: never read
    dq = np.zeros((b, n_q, h, d), np.float16)
    pykern.launch("attention_bwd_tc_dq_reduce_d96_f16", -(-dq.size // 256), 256, acc.reshape(-1), acc.reshape(-1),
                  dq.reshape(-1), dq.size, n_q, 90, h, nq_pad, 0, 0, 0, scale, 1 << 30, 1 << 30, 0, 1, backend=backend)
    want = (acc[:, :, :n_q] * np.float32(scale)).transpose(0, 2, 1, 3).astype(np.float16)
    np.testing.assert_array_equal(dq.view(np.uint16), want.view(np.uint16))


def test_backward_sm90_fused_dq_is_the_kernels_own(monkeypatch) -> None:
    """The fused kernel's dQ is its own: with the kernel's dQ adds removed (a mutant), dQ is zero while dK and dV
    stay right, so the checks above see the fused kernel's dQ, not another kernel's."""
    import pykern.ops.attention as A

    from pykern.difftest.cases.attention import attention_inputs, np_attention_backward

    rng = np.random.default_rng(21)
    q, k, v, g = attention_inputs(rng, 1, 100, 2, 1, 64, "bf16", 130)
    calls = []
    real = A._sm90_backward_fused

    def no_adds(q_, k_, v_, g_, lse2, dlt, dq_acc, *rest, **kw):
        calls.append(1)
        # the kernel runs with a scratch accumulator: the op's own stays as the pre-pass zeroed it
        scratch = np.zeros_like(dq_acc)
        return real(q_, k_, v_, g_, lse2, dlt, scratch, *rest, **kw)

    monkeypatch.setattr(A, "_sm90_backward_fused", no_adds)
    dq, dk, dv = ops.attention_backward(q, k, v, g, causal=True, backend=HOST)
    assert calls == [1]
    assert not np.asarray(dq).astype(np.float32).any()
    rq, rk, rv = np_attention_backward(q, k, v, g, causal=True)
    close("dk", dk, rk, "attention_backward", "bf16")
    close("dv", dv, rv, "attention_backward", "bf16")


def test_backward_keeps_mma_sync_where_sm90_does_not_apply(monkeypatch) -> None:
    from pykern.difftest.cases.attention import attention_inputs

    rng = np.random.default_rng(4)
    names = _record(monkeypatch)
    q, k, v, g = attention_inputs(rng, 1, 40, 2, 1, 80, "bf16", 40)
    ops.attention_backward(q, k, v, g, softcap=20.0, backend=HOST)  # d80 (padded to 96): no sm_90a backward
    assert names == ["attention_bwd_lse_softcap_bf16", "attention_bwd_tc_dkdv_d96_softcap_bf16",
                     "attention_bwd_tc_dq_d96_softcap_bf16"]


@pytest.mark.parametrize("cap,det,causal", [(0.0, False, True), (0.0, True, False), (0.0, True, True),
                                            (2.5, True, True)])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_backward_sm90_192_128_vs_float64_same_bits_under_every_schedule(dtype: str, cap: float, det: bool,
                                                                         causal: bool, monkeypatch) -> None:
    """head_dim 192, head_dim_v 128 (DeepSeek-V3's prefill) given the forward's out and lse: the fused kernel on
    FlashAttention-3's tiling (attention_bwd_sm90_fused[_det]_d192_dv128[_softcap]: 96-key CTAs, 64-query tiles,
    dQ's partials into an accumulator of three 64-column runs a head, narrowed by the d64 pass), with softcap too;
    dq / dk / dv equal float64 (dv at 128 columns, GQA 2, n_q != n_k), and the _det kernel gives the same bits under
    the forward, reverse and random thread orders (the atomic kernel's adds land in the order the CTAs run)."""
    from pykern.difftest.cases.attention import attention_inputs, np_attention_backward

    rng = np.random.default_rng(192)
    q, k, v, g = attention_inputs(rng, 2, 140, 4, 2, 192, dtype, 150 if causal else 230)
    v, g = np.ascontiguousarray(v[..., :128]), np.ascontiguousarray(g[..., :128])
    out, lse = ops.flash_attention(q, k, v, causal=causal, softcap=cap, return_lse=True, backend=HOST)
    names = _record(monkeypatch)
    runs = []
    for schedule in ("forward", "reverse", "random:7"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
        runs.append(ops.attention_backward(q, k, v, g, out=out, lse=lse, causal=causal, softcap=cap,
                                           deterministic=det, backend=HOST))
    assert names[:3] == [f"attention_bwd_tc_prep_{dtype}",
                         f"attention_bwd_sm90_fused{'_det' if det else ''}_d192_dv128{'_softcap' if cap else ''}_{dtype}",
                         f"attention_bwd_tc_dq_reduce_d64_{dtype}"]
    ref = np_attention_backward(q, k, v, g, causal=causal, softcap=cap)
    for name, got, want in zip(("dq", "dk", "dv"), runs[0], ref):
        assert np.asarray(got).shape == want.shape
        close(name, got, want, "attention_backward", dtype)
    for other in runs[1:] if det else ():
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_backward_192_128_without_out_and_lse_pads_v() -> None:
    """Without the forward's out and lse (the lse pre-pass reads v at head_dim) and off Hopper, the backward runs
    on v and grad_out padded with zero columns to 192: the same float64 values, dv sliced back to 128 columns."""
    from pykern.difftest.cases.attention import attention_inputs, np_attention_backward

    rng = np.random.default_rng(193)
    q, k, v, g = attention_inputs(rng, 1, 70, 2, 1, 192, "bf16", 90)
    v, g = np.ascontiguousarray(v[..., :128]), np.ascontiguousarray(g[..., :128])
    grads = ops.attention_backward(q, k, v, g, causal=False, backend=HOST)
    for name, got, want in zip(("dq", "dk", "dv"), grads, np_attention_backward(q, k, v, g, causal=False)):
        assert np.asarray(got).flags.c_contiguous
        close(name, got, want, "attention_backward", "bf16")


def test_backward_head_dim_v_errors_name_v_and_grad_out() -> None:
    from pykern.difftest.cases.attention import attention_inputs

    q, k, v, g = attention_inputs(np.random.default_rng(0), 1, 8, 2, 1, 64, "bf16", 8)
    wide = np.zeros((1, 8, 1, 96), v.dtype)
    with pytest.raises(ArgumentError, match=r"v.shape\[-1\] \(head_dim_v\): expected 1 <= head_dim_v <= "
                                            r"head_dim=64 \(q and k\), got 96"):
        ops.attention_backward(q, k, wide, g, backend=HOST)
    with pytest.raises(ArgumentError, match=r"grad_out: expected the shape of out .* \(1, 8, 2, 32\), got "
                                            r"\(1, 8, 2, 64\)"):
        ops.attention_backward(q, k, np.ascontiguousarray(v[..., :32]), g, backend=HOST)


# head_dim 256: (batch, n_q, n_k, heads, kv_heads, causal, window, softcap, dtype); several 64-key CTAs of the
# fused kernel (the head dim split across its consumers) and 32-query streamed tiles, off the tiles
BWD_D256 = [
    (2, 100, 150, 4, 2, True, (-1, -1), 0.0, "bf16"),   # causal, GQA 2, batch 2
    (1, 90, 200, 4, 1, False, (60, 20), 0.0, "f16"),    # a window, GQA 4, n_q < n_k
    (1, 150, 130, 2, 2, True, (-1, -1), 2.0, "f16"),    # softcap, n_q > n_k causal: rows that see no key
    (None, 70, 70, 2, 1, False, (-1, 30), 1.5, "bf16"),  # softcap, 3-D inputs, a right window only
    # n_q a multiple of 64: the workspace is not allocated zeroed, the pre-pass's row zeroing covers all of it
    (1, 128, 100, 2, 1, False, (-1, -1), 0.0, "bf16"),
]


@pytest.mark.parametrize("case", BWD_D256, ids=lambda c: "{}-q{}-k{}-h{}/{}-c{}-w{},{}-cap{}".format(
    c[8], *c[1:6], *c[6], c[7]))
def test_backward_d256_runs_the_fused_sm90_kernel_vs_float64_det_same_bits_under_every_schedule(case,
                                                                                             monkeypatch) -> None:
    """head_dim 256: one fused kernel (attention_bwd_sm90_fused[_det]_d256[_softcap]: 64-key CTAs whose consumers
    split the head dim, dQ's partials dS K added into the fp32 accumulator, its halves read back by the d128
    convert pass); no separate dQ kernel and no mma.sync kernel runs. deterministic=True: the forward, reverse and
    a random thread order give the same bits, equal to float64; the atomic kernel equals float64 too."""
    from pykern.difftest.cases.attention import attention_inputs, np_attention_backward

    b, n_q, n_k, h, kvh, causal, win, cap, dtype = case
    rng = np.random.default_rng(256 + n_q + n_k)
    q, k, v, g = attention_inputs(rng, b, n_q, h, kvh, 256, dtype, n_k)
    names = _record(monkeypatch)
    runs = []
    for schedule in ("forward", "reverse", "random:7"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
        runs.append(ops.attention_backward(q, k, v, g, causal=causal, window_size=win, softcap=cap,
                                           deterministic=True, backend=HOST))
    c = "_softcap" if cap else ""
    assert names[:4] == [f"attention_bwd_lse{c}_{dtype}", f"attention_bwd_tc_prep_{dtype}",
                         f"attention_bwd_sm90_fused_det_d256{c}_{dtype}", f"attention_bwd_tc_dq_reduce_d128_{dtype}"]
    ref = np_attention_backward(q, k, v, g, causal=causal, window_size=win, softcap=cap)
    for name, got, want in zip(("dq", "dk", "dv"), runs[0], ref):
        close(name, got, want, "attention_backward", dtype)
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            np.testing.assert_array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
    del names[:]
    atomic = ops.attention_backward(q, k, v, g, causal=causal, window_size=win, softcap=cap, backend=HOST)
    assert names[-2] == f"attention_bwd_sm90_fused_d256{c}_{dtype}", names
    for name, got, want in zip(("dq", "dk", "dv"), atomic, ref):
        close(name, got, want, "attention_backward", dtype)


def test_backward_d256_keeps_mma_sync_with_pykern_sm90_off(monkeypatch) -> None:
    """PYKERN_SM90=0 at head_dim 256: the mma.sync _dv / _dk pair and dQ kernel, as an sm_80 GPU runs them."""
    from pykern.difftest.cases.attention import attention_inputs

    monkeypatch.setenv("PYKERN_SM90", "0")
    q, k, v, g = attention_inputs(np.random.default_rng(3), 1, 40, 2, 1, 256, "bf16", 40)
    names = _record(monkeypatch)
    ops.attention_backward(q, k, v, g, causal=True, backend=HOST)
    assert names == ["attention_bwd_lse_bf16", "attention_bwd_tc_dv_d256_bf16", "attention_bwd_tc_dk_d256_bf16",
                     "attention_bwd_tc_dq_d256_bf16"]


# The _softcap kernels (SC): scores c * tanh(scale * s / c), dS times 1 - tanh^2. (batch, n_q, n_k, heads,
# kv_heads, head_dim, causal, window, softcap); caps that bend most scores (~ N(0, 1) here).
BWD_SOFTCAP_SHAPES = [
    (None, 130, 150, 2, 1, 64, True, (-1, -1), 1.5),    # 3-D inputs, off the 128-row tiles
    (2, 70, 200, 4, 2, 128, False, (50, 20), 2.5),      # window, GQA 2, batch 2
    (1, 100, 60, 4, 1, 128, True, (-1, -1), 3.0),       # n_q > n_k causal: rows that see no key; GQA 4
    (1, 200, 200, 2, 2, 64, False, (-1, -1), 30.0),     # Gemma 2's cap: tanh nearly linear, every key tile whole
    (2, 90, 170, 4, 2, 96, True, (-1, -1), 2.0),        # d96: 32-column boxes, GQA 2, batch 2
]


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("shape", BWD_SOFTCAP_SHAPES, ids=lambda s: "q{}-k{}-h{}/{}-d{}-cap{}".format(
    *s[1:6], s[8]))
def test_backward_sm90_softcap_vs_float64(shape, dtype, monkeypatch) -> None:
    from pykern.difftest.cases.attention import attention_inputs, np_attention_backward

    b, n_q, n_k, h, kvh, d, causal, window, cap = shape
    rng = np.random.default_rng(n_q * 1000 + n_k + d)
    q, k, v, g = attention_inputs(rng, b, n_q, h, kvh, d, dtype, n_k)
    names = _record(monkeypatch)
    dq, dk, dv = ops.attention_backward(q, k, v, g, causal=causal, window_size=window, softcap=cap, backend=HOST)
    # the fused kernel's _softcap form (dQ's partials from the same dS, tanh's derivative included)
    assert names == [f"attention_bwd_lse_softcap_{dtype}", f"attention_bwd_tc_prep_{dtype}",
                     f"attention_bwd_sm90_fused_d{d}_softcap_{dtype}", f"attention_bwd_tc_dq_reduce_d{d}_{dtype}"]
    rq, rk, rv = np_attention_backward(q, k, v, g, causal=causal, window_size=window, softcap=cap)
    for name, got, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        close(name, got, ref, "attention_backward", dtype)
    # the cap matters here: without the tanh's derivative dK would be off the tolerance
    if cap < 10:
        _, rk0, _ = np_attention_backward(q, k, v, g, causal=causal, window_size=window)
        atol, rtol = tolerance("attention_backward", dtype)
        assert (np.abs(rk0 - rk) > atol + rtol * np.abs(rk)).any()


@pytest.mark.parametrize("d", [64, 96])
def test_backward_sm90_softcap_same_bits_under_every_schedule(d: int, monkeypatch) -> None:
    """deterministic=True with softcap: the semaphore-ordered fused kernel's _softcap form; forward, reverse and
    random thread orders give the same bits (the forward's out and lse given: the pre-pass computes delta)."""
    from pykern.difftest.cases.attention import attention_inputs

    rng = np.random.default_rng(12)
    q, k, v, g = attention_inputs(rng, 1, 150, 4, 2, d, "f16", 170)
    out, lse = ops.flash_attention(q, k, v, causal=True, softcap=2.0, return_lse=True, backend=HOST)
    names = _record(monkeypatch)
    runs = []
    for schedule in ("forward", "reverse", "random:5"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
        runs.append(ops.attention_backward(q, k, v, g, out=out, lse=lse, causal=True, softcap=2.0,
                                           deterministic=True, backend=HOST))
    assert names[:3] == ["attention_bwd_tc_prep_f16", f"attention_bwd_sm90_fused_det_d{d}_softcap_f16",
                         f"attention_bwd_tc_dq_reduce_d{d}_f16"]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


# --------------------------------------------------------------------------- pipeline mistakes are reported
def _mutant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str, new: str, d: int = 64) -> str:
    """A copy of the kernel source with `old` replaced (once), its kernels renamed and only the dense head_dim `d`
    family kept (a host build of a few seconds instead of the whole file's); the d bf16 name."""
    write_mutant(tmp_path, monkeypatch, SRC, old, new, "fa90_mutant.cu", ("attention_fwd_sm90_d", "fa90_mutant_d"),
                 keep=(f"attention_fwd_sm90_d{d}",))
    return f"fa90_mutant_d{d}_bf16"


def test_a_trimmed_mutant_keeps_its_family_and_every_line_above_the_entry_points(tmp_path) -> None:
    # The mutants keep one family's entry points: the kernels' code (where the edits land, and the lines their
    # messages name) must stay as it is, and the trimmed file must register that family's kernels and no other.
    from pykern.registry import parse_file

    text = SRC.read_text()
    cut = keep_families(text, ("attention_fwd_sm90_d128",))
    first = re.search(r"^PK_\w+_KERNELS\(", text, re.M).start()
    assert cut[:first] == text[:first]
    assert re.findall(r"^PK_\w+_KERNELS\((\w+),", cut, re.M) == ["attention_fwd_sm90_d128"]
    # a call spread over two lines goes whole: nothing of it may be left behind
    assert "FA90_VARLEN_SC_ARGS)" not in cut[first:] and "FA90_PAGED_ARGS)" not in cut[first:]
    (tmp_path / "trimmed.cu").write_text(cut)
    assert sorted(s.name for s in parse_file(tmp_path / "trimmed.cu")) == [
        "attention_fwd_sm90_d128_bf16", "attention_fwd_sm90_d128_f16"]
    with pytest.raises(AssertionError, match="attention_fwd_sm90_d100"):
        keep_families(text, ("attention_fwd_sm90_d100",))


def _launch_d64(name: str, qkv=None, causal: bool = True, d: int = 64) -> np.ndarray:
    """Launches the d64 (or head_dim d) bf16 kernel `name` (one head, scale 1/8) on qkv (default: standard normal,
    130 x 130)."""
    import pykern
    from pykern.tensormap import make_tensor_map

    if qkv is None:
        rng = np.random.default_rng(0)
        qkv = tuple(rng.standard_normal((1, 130, 1, 64)).astype(ml_dtypes.bfloat16) for _ in range(3))
    q, k, v = qkv
    n_q, n_k = q.shape[1], k.shape[1]
    bc, (cols, swz) = sm90._CFG[d][0], sm90.box(d)
    tq = make_tensor_map(q, (1, 128, 1, cols), swz, backend=HOST)
    tk = make_tensor_map(k, (1, bc, 1, cols), swz, backend=HOST)
    tv = make_tensor_map(v, (1, bc, 1, cols), swz, backend=HOST)
    out = np.zeros_like(q)
    to = make_tensor_map(out, (1, sm90.OUT_ROWS, 1, cols), swz, backend=HOST)  # the epilogue's TMA stores
    lse = np.zeros((1, n_q, 1), np.float32)
    pykern.launch(name, (n_q + 127) // 128, sm90.THREADS, tq, tk, tv, to, lse, 1, n_q, n_k, 1, 1, 0.125, n_k,
                  0 if causal else n_k,
                  shared_mem=sm90.shared_bytes(d), backend=HOST)
    return out


def _spiky(rng, n_q: int, n_k: int, d: int, dtype: str, spikes):
    """Standard-normal q, k, v with q[..., 0] = 4 and k[:, key, :, 0] = size at each (key, size) of spikes: every
    row's score of that key jumps by about 4 * size * scale (natural log units)."""
    q, k, v = fa_inputs(rng, 1, n_q, n_k, 1, 1, d, d, dtype)
    q = q.copy()
    k = k.copy()
    q[..., 0] = 4
    for key, size in spikes:
        k[:, key, :, 0] = size
    return q, k, v


# The steady-state loop keeps its base (no row max) while a tile's row sums stay <= 2^15 and redoes the tile
# exactly when the running max grows past that: keys visited late (low indices) with scores far above the
# earlier maximum force the redo inside the hot loop; a smaller jump (P up to about 2^10) is kept lazily.
# With softcap 50 (Gemma 2's) the capped jumps stay above the lazy bound (+22 log2 units -> about +21), so the
# _softcap kernels redo the same tiles, on the capped scores; 192 / 128 runs the d128 loop with 12 S k-steps, d96
# with 6 over 32-column boxes.
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("d, dv, cap", [(64, 64, 0.0), (128, 128, 0.0), (64, 64, 50.0), (128, 128, 50.0),
                                        (192, 128, 0.0), (192, 128, 50.0), (96, 96, 0.0), (96, 96, 50.0)])
def test_forward_sm90_when_the_running_max_grows(d, dv, cap, dtype, monkeypatch) -> None:
    bc = sm90._CFG[d][0]
    n_k = 3 * bc + 10  # a masked tile (visited first), then three steady tiles: peeled, hot loop x 2
    rng = np.random.default_rng(d)
    size_big, size_mid = 30 * np.sqrt(d) / 8, 14 * np.sqrt(d) / 8  # about +22 and +10 log2 units
    q, k, v = _spiky(rng, 70, n_k, d, dtype, [(bc + 7, size_mid), (5, size_big)])
    v = v[..., :dv].copy()
    names = _record(monkeypatch)
    out, lse = ops.flash_attention(q, k, v, softcap=cap, return_lse=True, backend=HOST)
    assert names == [sm90.kernel_name(d, dv, cap, f"_{dtype}")]
    ref_out, ref_lse = np_flash_attention(q, k, v, False, None, (-1, -1), cap)
    close("out", out, ref_out, "flash_attention", dtype)
    check_lse(lse, ref_lse)


# Every place a steady tile can fail its lazy softmax, where the hot loop runs two tiles an iteration (d64, d256):
# tiles visited last to first, i counting them from 0; the first steady tile is peeled, a next tile with odd i
# runs one step alone (alignment), then pairs (A, B), then one A step for an odd tile left over. The spikes sit in
# the tiles named: n_k = 4 * bc + 10: masked 4, peeled 3, pair (2 A, 1 B), odd tile 0; n_k = 4 * bc (no masked
# tile, non-causal): peeled 3, alignment 2, pair (1 A, 0 B).
# Each spike is about 22 log2 units above everything visited before it (a redo each). With softcap 50 at d64 (2 A,
# 1 B): a failed A, then a failed out-of-line B, which runs without the overlap there (Fa90OvlOut) and so redoes
# from the scores, not from the lazy P.
@pytest.mark.parametrize("d, n_tiles, masked, spike_tiles, cap",
                         [(64, 4, True, (1, 0), 0.0), (64, 4, False, (2, 0), 0.0), (64, 4, True, (2, 0), 0.0),
                          (256, 4, True, (1, 0), 0.0), (64, 4, True, (2, 1), 50.0)])
def test_forward_sm90_redo_at_every_step_of_the_pair_loop(d, n_tiles, masked, spike_tiles, cap) -> None:
    bc = sm90._CFG[d][0]
    n_k = n_tiles * bc + (10 if masked else 0)
    rng = np.random.default_rng(d + n_tiles)
    sizes = (30 * np.sqrt(d) / 8, 60 * np.sqrt(d) / 8)  # about +22 and +44 log2 units
    spikes = [(tile * bc + 7, size) for tile, size in zip(spike_tiles, sizes)]
    q, k, v = _spiky(rng, 70, n_k, d, "bf16", spikes)
    out, lse = ops.flash_attention(q, k, v, softcap=cap, return_lse=True, backend=HOST)
    ref_out, ref_lse = np_flash_attention(q, k, v, False, None, (-1, -1), cap)
    close("out", out, ref_out, "flash_attention", "bf16")
    check_lse(lse, ref_lse)


# The hot loop's softmax runs in place while O += P V still executes (fa90_step), so a failed lazy tile keeps
# only its lazy P, not its scores: fa90_redo rebases P where every P is finite and <= 2^100 (the spikes above, +22
# and +44 log2 units), and scores the tile again from its K slot where the max jumped further (fa90_rescore). Here
# each spike is about +144 log2 units above everything visited before it (P = 2^144 overflows fp32), at every
# redo site of both loops: the pair loop's A, B, alignment and left-over steps (d64, d256), the
# one-step loop (d128), 192 / 128 (12 S k-steps, a K slot wider than V's) and d96 (the rescore's reads of the
# 64B-swizzled 32-column boxes).
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("d, dv, n_tiles, masked, spike_tiles",
                         [(64, 64, 4, True, (1, 0)), (64, 64, 4, False, (2, 0)), (64, 64, 4, True, (2, 0)),
                          (256, 256, 4, True, (1, 0)), (128, 128, 3, True, (1, 0)), (192, 128, 3, False, (1, 0)),
                          (96, 96, 3, True, (1, 0))])
def test_forward_sm90_redo_when_the_lazy_p_overflows(d, dv, n_tiles, masked, spike_tiles, dtype) -> None:
    bc = sm90._CFG[d][0]
    n_k = n_tiles * bc + (10 if masked else 0)
    rng = np.random.default_rng(d + n_tiles + 100)
    big = 200 * np.sqrt(d) / 8  # k[..., 0] steps of `big`: scores 4 * big * scale = 100 apart (144 log2 units)
    # every key at -2 big, the spikes at -big then 0, so that the lse stays near 0 (its check is absolute)
    q, k, v = _spiky(rng, 70, n_k, d, dtype, [(key, -2 * big) for key in range(n_k)])
    for tile, size in zip(spike_tiles, (-big, 0.0)):
        k[:, tile * bc + 7, :, 0] = size
    v = v[..., :dv].copy()
    out, lse = ops.flash_attention(q, k, v, return_lse=True, backend=HOST)
    ref_out, ref_lse = np_flash_attention(q, k, v, False)
    close("out", out, ref_out, "flash_attention", dtype)
    check_lse(lse, ref_lse)


# The pair loop's A check is decided per consumer warpgroup (wgmma is .sync.aligned over the warpgroup: after a
# failed A all four warps run the pair's B step from the out-of-line copy together): a spike seen by the 16 rows
# of ONE warp only (q[..., 0] = 4 there, 0 elsewhere) in the A tile (tile 2 of masked 4, peeled 3, pair (2 A,
# 1 B), odd 0) makes that warp's check fail and the other three redo a tile whose lazy softmax they would have
# kept; the exact redo must be right for them too. Warp 1 of consumer 0 (rows 16..31), warp 3 of consumer 1
# (rows 112..127), and both at once (each warpgroup on its own named barrier).
@pytest.mark.parametrize("d, rows", [(64, [(16, 32)]), (64, [(112, 128)]), (256, [(16, 32), (112, 128)])])
def test_forward_sm90_pair_redo_when_one_warp_of_a_warpgroup_fails(d, rows) -> None:
    bc = sm90._CFG[d][0]
    rng = np.random.default_rng(d + rows[0][0])
    q, k, v = _spiky(rng, 128, 4 * bc + 10, d, "bf16", [(2 * bc + 7, 30 * np.sqrt(d) / 8)])
    q[..., 0] = 0
    for r0, r1 in rows:
        q[:, r0:r1, :, 0] = 4
    out, lse = ops.flash_attention(q, k, v, return_lse=True, backend=HOST)
    ref_out, ref_lse = np_flash_attention(q, k, v, False)
    close("out", out, ref_out, "flash_attention", "bf16")
    check_lse(lse, ref_lse)


def test_a_failed_a_check_takes_the_whole_warpgroup_to_the_redo(tmp_path, monkeypatch) -> None:
    # Warp 1's rows spike in the A tile: with the warpgroup's decision warps 0, 2 and 3 go to redo_a too, their lazy
    # P not accepted (l unchanged), so a mutant that lets only warp 1 redo there gets their rows wrong; with a
    # per-warp decision (the vote) they would have stayed in the hot loop and the mutant would be right.
    bc = sm90._CFG[64][0]
    rng = np.random.default_rng(7)
    q, k, v = _spiky(rng, 128, 4 * bc + 10, 64, "bf16", [(2 * bc + 7, 30.0)])
    q[..., 0] = 0
    q[:, 16:32, :, 0] = 4
    ref_out, _ = np_flash_attention(q, k, v, False)
    good = _launch_d64(_mutant(tmp_path, monkeypatch, "#define FA90_BR 128", "#define FA90_BR 128"), (q, k, v), False)
    close("out", good, ref_out, "flash_attention", "bf16")
    old = ("            redo_a:  // A failed: its redo, then the pair's B step out of line\n"
           "                fa90_redo<T, DQK, DV, BC, SC>(s, o, m, l, pa, sl2, pre, qs, ks + a * K_BYTES);")
    bad = _launch_d64(_mutant(tmp_path, monkeypatch, old, old.replace("                fa90_redo",
                                                                       "                if (wq == 1) fa90_redo")),
                      (q, k, v), False)
    bad = np.asarray(bad, np.float64)
    np.testing.assert_allclose(bad[:, 16:32], ref_out[:, 16:32], atol=0.05)  # warp 1 redid: right
    for r0, r1 in ((0, 16), (32, 64)):  # warps 0, 2, 3 of consumer 0 were taken to redo_a: wrong without it
        assert not np.allclose(bad[:, r0:r1], ref_out[:, r0:r1], atol=0.05), (r0, r1)


def test_the_hot_loops_exact_redo_is_exercised(tmp_path, monkeypatch) -> None:
    # without the redo after a failed lazy tile, the spiky case above comes out wrong
    rng = np.random.default_rng(64)
    bc = sm90._CFG[64][0]
    q, k, v = _spiky(rng, 70, 3 * bc + 10, 64, "bf16", [(bc + 7, 14.0), (5, 30.0)])
    ref_out, _ = np_flash_attention(q, k, v, False)
    good = _launch_d64(_mutant(tmp_path, monkeypatch, "#define FA90_BR 128", "#define FA90_BR 128"), (q, k, v), False)
    close("out", good, ref_out, "flash_attention", "bf16")
    old = "    if constexpr (!OV) {  // s holds the scores: the exact softmax of the tile\n"
    bad = _launch_d64(_mutant(tmp_path, monkeypatch, old, "    return;\n" + old), (q, k, v), False)
    assert not np.allclose(np.asarray(bad, np.float64), ref_out, atol=0.05, equal_nan=False)


@pytest.mark.parametrize("d", [256, 64, 96])
def test_the_rescore_of_an_overflowed_tile_is_exercised(d, tmp_path, monkeypatch) -> None:
    # a spike of about +144 log2 units (scale 1/8) in the pair loop's B tile (key tiles 4 masked, 3 peeled, 2 and 1
    # the pair, 0 the tail step) overflows the lazy P: without the scores computed again (fa90_rescore) the redo's
    # exact softmax would run on the overflowed P and come out wrong. d64 overlaps its hot steps (sm90.OVERLAP)
    # since it has the room, so its redo rescores there as well. d96: the one-step loop's redo, rescoring from the
    # 64B-swizzled 32-column boxes.
    rng = np.random.default_rng(65)
    bc = sm90._CFG[d][0]
    q, k, v = _spiky(rng, 70, 4 * bc + 10, d, "bf16", [(bc + 7, 200.0)])
    ref_out, _ = np_flash_attention(q, k, v, False, 0.125)
    same = _mutant(tmp_path, monkeypatch, "#define FA90_BR 128", "#define FA90_BR 128", d=d)
    close("out", _launch_d64(same, (q, k, v), False, d), ref_out, "flash_attention", "bf16")
    name = _mutant(tmp_path, monkeypatch, "        fa90_rescore<T, DQK, BC>(s, qs, kslot);\n", "", d=d)
    bad = _launch_d64(name, (q, k, v), False, d)
    assert not np.allclose(np.asarray(bad, np.float64), ref_out, atol=0.05, equal_nan=False)


def test_the_unmutated_copy_runs(tmp_path, monkeypatch) -> None:
    out = _launch_d64(_mutant(tmp_path, monkeypatch, "#define FA90_BR 128", "#define FA90_BR 128"))
    assert np.isfinite(out.astype(np.float32)).all() and np.abs(out.astype(np.float32)).max() > 0.1


def test_a_consumer_that_skips_the_full_barrier_wait_is_reported(tmp_path, monkeypatch) -> None:
    name = _mutant(tmp_path, monkeypatch, "    pk_mbarrier_wait_parity(full, parity);\n", "")
    with pytest.raises(KernelExecutionError, match=r"TMA load it issued at .*fa90_mutant\.cu:\d+ was never waited"):
        _launch_d64(name)


def test_a_wgmma_without_its_fence_is_reported(tmp_path, monkeypatch) -> None:
    # the fence before O += P V (the P registers and the rescaled O are fenced there)
    name = _mutant(tmp_path, monkeypatch, "    pk_wgmma_fence();\n#pragma unroll\n    for (int kk", "#pragma unroll\n    for (int kk")
    with pytest.raises(KernelExecutionError, match=r"wgmma.mma_async at .*fa90_mutant\.cu:\d+ without pk_wgmma_fence"):
        _launch_d64(name)


def _launch_d128_full(name: str) -> np.ndarray:
    """Launches the d128 bf16 kernel `name` over 130 queries and 384 keys, not causal (three steady key tiles:
    the first peeled off, two steps of the ping-pong loop)."""
    import pykern
    from pykern.tensormap import make_tensor_map

    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 130, 1, 128)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((1, 384, 1, 128)).astype(ml_dtypes.bfloat16) for _ in range(2))
    bc = sm90._CFG[128][0]
    tq = make_tensor_map(q, (1, 128, 1, 64), "128B", backend=HOST)
    tk = make_tensor_map(k, (1, bc, 1, 64), "128B", backend=HOST)
    tv = make_tensor_map(v, (1, bc, 1, 64), "128B", backend=HOST)
    out = np.zeros_like(q)
    to = make_tensor_map(out, (1, sm90.OUT_ROWS, 1, 64), "128B", backend=HOST)  # the epilogue's TMA stores
    lse = np.zeros((1, 130, 1), np.float32)
    pykern.launch(name, 2, sm90.THREADS, tq, tk, tv, to, lse, 1, 130, 384, 1, 1, 0.088, 384, 384,
                  shared_mem=sm90.shared_bytes(128), backend=HOST)
    return out


_OPENING = "        if (PP && c == 1 && i != i_end) pk_bar_arrive_aligned(FA90_BAR_PP, 256);\n"


def test_the_ping_pong_copy_runs(tmp_path, monkeypatch) -> None:
    # the mutants' baseline: the d128 copy with its ping-pong intact runs the launch below and matches float64
    out = _launch_d128_full(_mutant(tmp_path, monkeypatch, _OPENING, _OPENING, d=128))
    assert np.isfinite(out.astype(np.float32)).all() and np.abs(out.astype(np.float32)).max() > 0.01


@pytest.mark.parametrize("d", [128, 64])
def test_a_ping_pong_that_is_never_opened_is_a_deadlock_naming_its_barriers(d: int, tmp_path, monkeypatch) -> None:
    # Consumer 1 never gives consumer 0 its first turn: consumer 0 waits on named barrier 3 and consumer 1 on 4,
    # forever (a hang on the GPU); the host names both barriers and their arrivals (after the first thread it finds
    # stuck: a consumer at its barrier, or a producer lane at the warp sync behind its leader's mbarrier wait).
    # d64: the pair loop's steps (130 queries, 600 keys, not causal: three steady key tiles of 192, two steps).
    name = _mutant(tmp_path, monkeypatch, _OPENING, "", d=d)
    rng = np.random.default_rng(1)
    qkv = tuple(rng.standard_normal((1, n, 1, 64)).astype(ml_dtypes.bfloat16) for n in (130, 600, 600))
    with pytest.raises(KernelExecutionError, match=(
            rf"kernel fa90_mutant_d{d}_bf16: block \(\d+,0,0\): .*; 128 of 256 threads arrived at named "
            r"barrier 3 \(first at .*fa90_mutant\.cu:\d+\); 128 of 256 threads arrived at named barrier 4")):
        _launch_d128_full(name) if d == 128 else _launch_d64(name, qkv, False)


def test_a_ping_pong_hand_over_with_a_wrong_thread_count_is_reported(tmp_path, monkeypatch) -> None:
    # the overlapped step's hand-over (the d128 kernels ping-pong with the overlap on)
    old = "pk_bar_arrive_aligned(pp ^ 7, 256);  // the other's turn, while these run"
    name = _mutant(tmp_path, monkeypatch, old, old.replace("256", "224"), d=128)
    with pytest.raises(KernelExecutionError, match=(
            r"kernel fa90_mutant_d128_bf16: .*barrier\.(sync|arrive) of named barrier [34] with (256|224) threads at "
            r".*fa90_mutant\.cu:\d+, but this phase's first arrival was barrier\.(arrive|sync) with (224|256) threads")):
        _launch_d128_full(name)


# --------------------------------------------------------------------------- SASS (NVRTC, no GPU)
@lru_cache(maxsize=None)
def _sass():
    mod, text = compile_sass(SRC, "sm_90a")
    return mod, text, report().count_sass(text), report().steady_state_loops(text)


KERNELS = [f"attention_fwd_{v}sm90_d{d}_{t}" for v in ("", "varlen_") for d in (64, 96, 128, 256)
           for t in ("bf16", "f16")]
# softcap (dense and varlen) and head_dim 192 / head_dim_v 128 (dense and varlen, with and without softcap)
MORE_KERNELS = ([f"attention_fwd_{v}sm90_d{d}_softcap_{t}" for v in ("", "varlen_") for d in (64, 96, 128, 256)
                 for t in ("bf16", "f16")]
                + [f"attention_fwd_{v}sm90_d192_dv128{c}_{t}" for v in ("", "varlen_") for c in ("", "_softcap")
                   for t in ("bf16", "f16")])


def _dims(kernel: str) -> tuple[int, int]:
    """(head_dim, head_dim_v) from a kernel name: d{D} or d{D}_dv{DV}."""
    d = int(kernel.split("_d")[1].split("_")[0])
    dv = int(kernel.split("_dv")[1].split("_")[0]) if "_dv" in kernel else d
    return d, dv
BWD_SRC = ROOT / "kernels_cu" / "attention_bwd_sm90.cu"
BWD_KERNELS = [f"attention_bwd_{vl}sm90_{n}_d{d}{c}_{t}" for vl in ("", "varlen_") for n in ("dkdv", "dq")
               for d in (64, 128) for c in ("", "_softcap") for t in ("bf16", "f16")]
# head_dim 256: dK/dV with the head dim split across the consumers (64-key CTAs), dQ on 32-key tiles
BWD_KERNELS += [f"attention_bwd_{vl}sm90_{n}_d256{c}_{t}" for vl in ("", "varlen_") for n in ("dkdv", "dq")
                for c in ("", "_softcap") for t in ("bf16", "f16")]
# head_dim 96 (32-column boxes, 64B swizzle) and 192 / 128 (DV): both kernels, dense and varlen, softcap or not
BWD_KERNELS += [f"attention_bwd_{vl}sm90_{n}_{s}{c}_{t}" for vl in ("", "varlen_") for n in ("dkdv", "dq")
                for s in ("d96", "d192_dv128") for c in ("", "_softcap") for t in ("bf16", "f16")]
BWD_FUSED_KERNELS = [f"attention_bwd_{vl}sm90_fused{det}_d{d}{c}_{t}" for vl in ("", "varlen_")
                     for det in ("", "_det") for d in (64, 96, 128, 256) for c in ("", "_softcap")
                     for t in ("bf16", "f16")]
# 192 / 128 on FlashAttention-3's tiling (ab90_fused_kt), with and without softcap
BWD_FUSED_KERNELS += [f"attention_bwd_{vl}sm90_fused{det}_d192_dv128{c}_{t}" for vl in ("", "varlen_")
                      for det in ("", "_det") for c in ("", "_softcap") for t in ("bf16", "f16")]


@lru_cache(maxsize=None)
def _bwd_listing():
    return compile_sass(BWD_SRC, "sm_90a")


@lru_cache(maxsize=None)
def _bwd_sass():
    mod, text = _bwd_listing()
    return mod, report().count_sass(text), report().steady_state_loops(text)


@pytest.mark.parametrize("kernel", BWD_KERNELS + BWD_FUSED_KERNELS)
def test_backward_sass_wgmma_tma_no_spills(kernel: str) -> None:
    mod, counts, loops = _bwd_sass()
    assert counts[kernel]["HGMMA"] >= 4 and counts[kernel]["LDL"] == counts[kernel]["STL"] == 0
    res = mod.resources[kernel]
    assert res.spill_stores == 0 and res.spill_loads == 0
    # a flat loop of HGMMAs; the fused kernels' named barriers (the dS hand-off between the consumers, which
    # also waits for warp 1, the dQ tiles' issuer (and the _det kernels' semaphores), and their arrival after the dQ
    # tile's stores) and the d256 dK/dV kernels' one (the S^T / dP^T swap, also in the fused d256
    # ones) are the only barriers; 192 / 128's fused kernel has one more (both consumers past the previous tile's
    # reads of its one P^T / dS^T buffer before either rewrites it)
    fused, split = "_fused" in kernel, "_dkdv_d256" in kernel or "_d256" in kernel and "_fused" in kernel
    assert loops[kernel]["bar"] == (2 if fused else 0) + split + (fused and "_d192_dv128" in kernel)
    assert loops[kernel]["mma"] > 0
    ops_ = kernel_ops(_bwd_listing()[1], kernel)
    assert sum(op.startswith("UTMALDG.4D") for op in ops_) >= 4      # Q, dO, K, V tiles
    assert sum(op.startswith("SYNCS") for op in ops_) >= 4           # mbarrier init / arrive / try_wait
    assert ("MUFU.TANH" in ops_) == ("_softcap" in kernel)           # the tanh only where the cap is
    # dQ's partials in the fused kernels only: a tile's dQ leaves as a bulk reduce-add (UBLKRED,
    # cp.reduce.async.bulk .add.f32; d256: one a head-dim half) from a shared fp32 tile, with no per-element
    # REDG.E.ADD.F32 (red.global.add.f32) left. The _det ones poll with a strong GPU-scope load (ld.acquire.gpu) and
    # release with an integer REDG (red.release.gpu.add)
    reds = [op for op in ops_ if op.startswith("REDG")]
    assert not any(op.startswith("REDG.E.ADD.F32") for op in reds), reds[:4]
    assert any(op.startswith("UBLKRED") for op in ops_) == fused
    assert any(op.startswith("REDG.E.ADD.S32.STRONG.GPU") for op in reds) == ("_det" in kernel)
    assert any(op.startswith("LDG.E.STRONG.GPU") for op in ops_) == ("_det" in kernel)


# warp-instructions per m16n8k16-equivalent of each backward kernel's steady-state loop (one streamed tile:
# S and dP, then dV and dK (dkdv) or dQ (dq)), pinned near today's figures so that none grows. The softcap adds
# an FMUL, a tanh.approx and the derivative's FFMA + FMUL a score; the varlen kernels differ from the dense ones
# only in their row origins (the prologue), not in the loop's work. The dq kernels' steady loop is their interior
# key tiles' own (no column test; the diagonal / window-edge tiles run a masked copy of it) with the Q / dO
# descriptors in uniform registers: 2.42 -> 1.40 at d128, 4.18 -> 2.33 at d64, under the 2.0 bar at d128. The
# dkdv kernels' the same way (their interior query tiles' own loop, the K / V descriptors uniform, the tile's head
# and queries from running counters, not a division): 4.19 -> 2.61 at d128, 6.17 -> 4.01 at d64.
BWD_LOOP_BAR = {
    "dkdv_d64": 4.01, "dkdv_d128": 2.61, "dq_d64": 2.33, "dq_d128": 1.40,
    "dkdv_d64_softcap": 5.02, "dkdv_d128_softcap": 3.11, "dq_d64_softcap": 3.66, "dq_d128_softcap": 2.07,
    "dq_d256": 1.46, "dq_d256_softcap": 1.79,  # 32-key tiles
    # d256 dK/dV: 32-query tiles (consumer 0 forms P^T, consumer 1 dP^T - delta before the swap through shared
    # memory) with uniform descriptors and the unmasked tiles' own loop; 5.63 / 6.39 before those two, 7.91 / 8.43
    # with 16-query tiles, whose per-tile work weighed on half the MMAs
    "dkdv_d256": 3.18, "dkdv_d256_softcap": 3.93,
    # d96: 32-column boxes (64B swizzle), dK/dV on 32-query tiles; 192 / 128: dK/dV on 16-query tiles (160
    # accumulator registers a thread), whose fixed cost a tile weighs more
    "dkdv_d96": 3.26, "dq_d96": 1.74, "dkdv_d96_softcap": 3.93, "dq_d96_softcap": 2.63,
    "dkdv_d192_dv128": 3.1, "dq_d192_dv128": 1.12, "dkdv_d192_dv128_softcap": 3.5, "dq_d192_dv128_softcap": 1.63,
}
DQ_LOOP_BAR_D128 = 2.0  # the dq kernel's bar at d128 (FA3's design estimate is about 1.7 for its whole backward)


# the fused kernels' loop (one streamed tile: S^T, dP^T, dV, dK and dQ^T, 160 m16n8k16-equivalents a warp), pinned
# at today's figures (before fusing, the pair ran dK/dV at 4.19 / 6.17 and dQ at 2.42 / 4.18 at d128 / d64; the
# fused loop ran 3.75 / 5.13 while it swizzled every dS store's address inside the loop, 3.45 / 4.41 after that
# hoist while its K / V / K^T descriptors took an R2UR pair and a 64-bit add an HGMMA, the tile's head and queries a
# division and every tile the mask's tests: these bars fail on that SASS). The softcap adds the tanh and its
# derivative a score; varlen reads lse / delta a query at a time (a sequence's first row need not be even: no
# 8-byte pair loads).
BWD_FUSED_LOOP_BAR = {(64, "", ""): 2.66, (128, "", ""): 2.07, (64, "", "_softcap"): 3.49,
                      (128, "", "_softcap"): 2.49, (64, "varlen_", ""): 2.75, (128, "varlen_", ""): 2.14,
                      (64, "varlen_", "_softcap"): 3.57, (128, "varlen_", "_softcap"): 2.56,
                      # d96 (32-column boxes): 128 m16n8k16-equivalents a tile, dQ^T's two m64 tiles covering 128
                      # head-dim rows for 96 (the pair there ran dK/dV at 5.19 and dQ at 1.74; the fused loop 4.09
                      # before the uniform descriptors and the unmasked loop)
                      # (d96 softcap: 2.945 before dQ left as bulk reduce-adds, 2.961 since (379 instructions a
                      # tile, 376 / 377 before): the dQ tile's fence.proxy.async and barrier arrival where the REDs
                      # were, which the other shapes absorb under their bars)
                      (96, "", ""): 2.44, (96, "", "_softcap"): 2.97, (96, "varlen_", ""): 2.56,
                      (96, "varlen_", "_softcap"): 3.1,
                      # d256 (the split kernel with dQ fused; 160 m16n8k16-equivalents a warp a 32-query tile):
                      # 420 instructions a tile (det 421), against 406 for the unfused dK/dV kernel's 128 (5.28 /
                      # 845 before the uniform descriptors and the unmasked loop, 7.78 with 16-query tiles)
                      (256, "", ""): 2.64, (256, "", "_softcap"): 3.24, (256, "varlen_", ""): 2.72,
                      (256, "varlen_", "_softcap"): 3.32,
                      # 192 / 128 (FlashAttention-3's tiling: 312 m16n8k16-equivalents a warp a 64-query tile): 620
                      # instructions a tile (varlen 625), P^T / dS^T stored 2 bytes at a time; softcap 722 (varlen
                      # 727: the tanh, its derivative's FFMA and FMUL and the scaling FMUL, 4 a score)
                      (192, "", ""): 1.99, (192, "varlen_", ""): 2.01, (192, "", "_softcap"): 2.32,
                      (192, "varlen_", "_softcap"): 2.34}


@pytest.mark.parametrize("kernel", BWD_FUSED_KERNELS)
def test_backward_fused_steady_loop_within_its_bar(kernel: str) -> None:
    _, _, loops = _bwd_sass()
    loop = loops[kernel]
    if "_d192_dv128" in kernel:
        # FlashAttention-3's tiling, a 64-query tile a warp of 4 and a consumer of 48 keys: S (K = 192) and dP (128)
        # m64n48, dV^T (2 m64 tiles) and dK^T (3) m64n48 over 64 queries, dQ m64n96 over the CTA's 96 keys
        assert loop["mma"] == (192 + 128) // 16 * 6 + (2 + 3) * 4 * 6 + 6 * 12 == 312
        bar = BWD_FUSED_LOOP_BAR[(192, "varlen_" if "_varlen_" in kernel else "", "_softcap" * ("_softcap" in kernel))]
        assert loop["per_mma"] <= bar, loop
        return
    d = int(kernel.split("_d")[-1].split("_")[0])
    # S^T, dP^T, dV, dK over d, and dQ^T in m64 tiles of the head dim (d96: 128 rows); d256 (the head dim split):
    # a consumer computes one of S^T / dP^T and half of dV, dK and dQ^T, half the work
    dq_rows = -(-d // 64) * 64
    assert loop["mma"] == (4 * d + dq_rows) * sm90.bwd_dkdv_step(d) / (256 if sm90.bwd_dkdv_split(d) else 128)
    key = (d, "varlen_" if "_varlen_" in kernel else "", "_softcap" if "_softcap" in kernel else "")
    assert loop["per_mma"] <= BWD_FUSED_LOOP_BAR[key], loop


@pytest.mark.parametrize("kernel", BWD_KERNELS)
def test_backward_steady_loop_within_its_bar(kernel: str) -> None:
    _, _, loops = _bwd_sass()
    loop = loops[kernel]
    part = kernel.split("sm90_")[1].rsplit("_", 1)[0]  # e.g. dkdv_d128_softcap, dq_d192_dv128
    d = int(part.split("_d")[1].split("_")[0])
    dv = int(part.split("_dv")[1].split("_")[0]) if "_dv" in part else d
    step = sm90.bwd_dkdv_step(d, dv) if part.startswith("dkdv") else sm90.bwd_dq_step(d)
    # per warp and tile (64 * step * K / (4 * 2048) m16n8k16s a warp for K = d or dv): dkdv S^T (d), dP^T (dv),
    # dV (dv), dK (d); dq S (d), dP (dv), dQ (d). d256 dK/dV (the head dim split): S^T or dP^T (d), half of dV and
    # of dK (d / 2 each)
    if part.startswith("dkdv_d256"):
        assert loop["mma"] == 2 * d * step / 128
    else:
        assert loop["mma"] == (2 * (d + dv) if part.startswith("dkdv") else 2 * d + dv) * step / 128
    assert loop["per_mma"] <= BWD_LOOP_BAR[part], loop
    if part == "dq_d128":
        assert loop["per_mma"] <= DQ_LOOP_BAR_D128, loop


@pytest.mark.parametrize("kernel", KERNELS + MORE_KERNELS)
def test_sass_hopper_instructions_and_no_spills(kernel: str) -> None:
    mod, text, counts, loops = _sass()
    body = text.split(f"Function : {kernel}\n", 1)[1].split("Function :", 1)[0]
    ops_ = re.findall(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)", body)
    d, dv = _dims(kernel)
    bc = sm90._CFG[d][0]
    assert any(op.startswith(f"HGMMA.64x{bc}x16.F32") for op in ops_)  # S = Q K^T, SS (RS at d64: Q in registers)
    assert any(op.startswith(f"HGMMA.64x{dv}x16.F32") for op in ops_)  # O += P V, RS
    # the softcap's tanh.approx only in the _softcap kernels (the others carry no tanh)
    assert ("MUFU.TANH" in ops_) == ("_softcap" in kernel)
    assert sum(op.startswith("UTMALDG.4D") for op in ops_) >= 3        # Q, K, V tiles
    assert sum(op.startswith("SYNCS") for op in ops_) >= 4             # mbarrier init / arrive / try_wait
    assert "USETMAXREG.DEALLOC.CTAPOOL" in ops_ and "USETMAXREG.TRY_ALLOC.CTAPOOL" in ops_
    assert counts[kernel]["LDL"] == counts[kernel]["STL"] == 0
    res = mod.resources[kernel]
    assert res.spill_stores == 0 and res.spill_loads == 0


@pytest.mark.parametrize("kernel", KERNELS + MORE_KERNELS)
def test_steady_state_loop_is_flat_and_within_the_bar(kernel: str) -> None:
    _, _, _, loops = _sass()
    loop = loops[kernel]  # a loop with HGMMAs and no inner loop exists
    d, dv = _dims(kernel)
    bc = sm90._CFG[d][0]
    tiles = sm90.LOOP_TILES[d]  # tiles an iteration: the hot loop runs pairs at d64 / d256 (Fa90Cfg PAIR)
    # per warp and tile: S (BC * D / 128 m16n8k16s) and P V (BC * DV / 128)
    assert loop["mma"] == tiles * bc * (d + dv) / 128
    # The pair loop's A check is the warpgroup's (one BAR.RED on its named barrier, then the vote that tells
    # ptxas the result is warp-uniform); the others stay a warp vote.
    # With the ping-pong (sm90.PING_PONG) each tile adds its BAR.SYNC and BAR.ARV (test_steady_loop_ping_pongs_...).
    pp = 2 * tiles if sm90.PING_PONG[d] else 0
    assert loop["bar"] == (1 if tiles == 2 else 0) + pp and loop["ldsm"] == 0 and loop["ldgsts"] == 0
    # The bar: <= 2.0 warp-instructions per m16n8k16-equivalent. The lazy softmax costs 3.5 instructions a score
    # (FFMA, ex2, FADD, half an F2FP; BC/2 scores a thread), which at d64 (BC * D / 64 = BC MMAs a tile) is 1.75
    # an MMA before the fixed costs: with 192 keys a tile that leaves 48 instructions a tile for 16 HGMMAs and the
    # rest, met by running two tiles an iteration (fixed slots, one parity, the counter once a pair). Pinned
    # near today's figures (d64 1.992, varlen 1.990; d128 1.141; d256 0.779, varlen 0.775) so none of them grows.
    # d128 ping-pongs its consumer warpgroups (sm90.PING_PONG): a BAR.SYNC and a BAR.ARV a tile and their set-up,
    # 10 instructions a tile (1.180, softcap 1.680, against 1.141 / 1.641 without), its bar moved by those only.
    # d64 too: the BAR.SYNC and BAR.ARV of each tile and nothing else, their ids kept in registers across the pair
    # loop: 762 -> 766 a pair (1.995; varlen 759 -> 763, 1.987; softcap 1545 -> 1540, 4.010, varlen 1538 -> 1542,
    # 4.016), under the 2.0 bar.
    # The softcap adds an FMUL and a tanh.approx (MUFU) a score, 1.0 an MMA at d64 (BC / 2 scores a thread, BC / 2
    # MMAs a tile), 0.5 at d128, 0.25 at d256; 192 / 128 spreads the d128 softmax over 1.25 times the MMAs. Pinned
    # near their figures (softcap: d64 2.997, varlen 2.997; d128 1.641; d256 1.029, varlen 1.027; d192_dv128 0.969,
    # with softcap 1.369).
    # The intra-warpgroup overlap (sm90.OVERLAP: d128, 192 / 128, d256; d64 without softcap) adds the wgmma wait of
    # the S group and costs 2 to 4 instructions a tile (d128 302 -> 306, 1.195; 192 / 128 310 -> 314, 0.981; d256
    # 399 -> 401 a pair, 0.783, varlen 0.783; softcap d128 1.688, varlen 1.695; d256 1.037; 192 / 128 1.381). At
    # d64 the room came from the K descriptors kept across the loop (Fa90KHoist: 6 adds and their copies a pair
    # fewer) and the steps' mbarriers at literal slots: with the overlap and the tile loop (sm90.PERSISTENT) 762 a
    # pair (1.984; varlen 759, 1.977) against 764 (1.990) with neither; softcap (no overlap) 1545 (4.023; varlen
    # 1538, 4.005). The pair loop's literal mbarrier slots took d256 to 399 (0.779; varlen 401, 0.783); the dense
    # d256 tile loop (sm90.PERSISTENT) to 404 (0.789; softcap 532, 1.039), within its 0.79 / 1.04 bars.
    # d64 with softcap takes half of its exp2s on the FMA pipe (sm90.FMA_EXP2): pk_exp2_fma is 8 instructions
    # more than a MUFU.EX2, 96 exp2s a pair, so 1151 -> 1922 (5.005; varlen 1940, 5.052; a quarter took 1540,
    # 4.010): the instruction count grows while the MUFU, the one bound there, shrinks (the attention model's mufu
    # and fma terms: 1.75 -> 1.5 an MMA, issue 1.0 -> 1.25). With the overlap 1921 (5.003; varlen 1918, 4.995).
    # d64 without softcap keeps the MUFU (it would be 3.023) and its 2.0 bar.
    # d96 (32-column boxes, 64B swizzle; the d128 tiling): 287 instructions a tile (1.495; varlen 296, 1.542), softcap
    # 415 (2.161; varlen 424, 2.208): the softmax of a 128-key tile over 192 m16n8k16-equivalents, not 256.
    bar = {64: 2.0, 96: 1.55, 128: 1.2, 192: 0.99, 256: 0.79}[d]
    if "_softcap" in kernel:
        bar = {64: 5.01, 96: 2.21, 128: 1.7, 192: 1.39, 256: 1.04}[d]
    assert loop["per_mma"] <= bar, loop


_INSN = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+((?:@!?U?P\w+\s+)?[A-Z][^;]*);")


def _loop_insns(text: str, kernel: str, loop: dict) -> list[str]:
    """The steady-state loop's instructions (opcode and operands, NOPs left out) of one kernel, in order."""
    body = text.split(f"Function : {kernel}\n", 1)[1].split("Function :", 1)[0]
    lo, hi = int(loop["start"], 16), int(loop["end"], 16)
    return [m[2].strip() for m in _INSN.finditer(body) if lo <= int(m[1], 16) <= hi and not m[2].startswith("NOP")]


@pytest.mark.parametrize("kernel", KERNELS + MORE_KERNELS)
def test_steady_loop_ping_pongs_the_consumer_warpgroups(kernel: str) -> None:
    # FA3's warp scheduler barriers: each step's wgmma group is issued between a BAR.SYNC on this warpgroup's
    # named barrier and a BAR.ARV on the other's, both over the two consumer warpgroups (256 threads = 0x100) with
    # the id in a register (threadIdx.x / 128 + 2: 3 or 4, never 0, __syncthreads'); no HGMMA of the loop lies
    # outside such a turn. The kernel opens the game once, outside the loop (BAR.ARV 0x3: consumer 1 gives
    # consumer 0 the first turn). The loop before had no BAR.SYNC / BAR.ARV at all.
    d, _ = _dims(kernel)
    _, text, _, loops = _sass()
    insns = _loop_insns(text, kernel, loops[kernel])
    sync = re.compile(r"BAR\.SYNC(\.DEFER_BLOCKING)? (R\d+), 0x100$")
    arv = re.compile(r"BAR\.ARV (R\d+), 0x100$")
    if not sm90.PING_PONG[d]:  # (Fa90Cfg PP off: d256, 192 / 128) no turns, no opening
        assert not any(sync.match(i) or arv.match(i) for i in insns) and "BAR.ARV" not in text.split(
            f"Function : {kernel}\n", 1)[1].split("Function :", 1)[0]
        return
    tiles = sm90.LOOP_TILES[d]
    assert sum(bool(sync.match(i)) for i in insns) == tiles and sum(bool(arv.match(i)) for i in insns) == tiles
    inside, turns, hgmma_out = False, 0, 0
    for i in insns:
        if sync.match(i):
            assert not inside, "two BAR.SYNCs without a BAR.ARV between"
            inside, turns, group = True, turns + 1, 0
        elif arv.match(i):
            assert inside and group > 0, "a BAR.ARV without the turn's wgmmas before it"
            inside = False
        elif i.startswith("HGMMA"):
            if inside:
                group += 1
            else:
                hgmma_out += 1
    assert turns == tiles and hgmma_out == 0 and not inside
    body = text.split(f"Function : {kernel}\n", 1)[1].split("Function :", 1)[0]
    assert len(re.findall(r"BAR\.ARV 0x3, 0x100\s*;", body)) == 1


def test_torch_deterministic_algorithms_take_the_semaphore_ordered_fused_kernel(monkeypatch) -> None:
    """pykern.torch on sm_90a: torch.use_deterministic_algorithms(True) runs the _det fused kernel (dQ's adds in
    key-tile order), the default the atomic one; both gradients equal float64 within the tolerance rows."""
    torch = pytest.importorskip("torch")
    import pykern.torch as pt
    from pykern.difftest.cases.attention import np_attention_backward

    names = _record(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 70, 2, 64, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    go = torch.randn(1, 70, 2, 64, generator=gen).bfloat16()
    ref = np_attention_backward(*(t.detach().float().numpy().astype(ml_dtypes.bfloat16) for t in (q, k, v)),
                                go.float().numpy().astype(ml_dtypes.bfloat16), causal=True)
    for det in (False, True):
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(det)
        try:
            names.clear()
            out = pt.flash_attention(q, k, v, causal=True)
            grads = torch.autograd.grad(out, (q, k, v), go)
        finally:
            torch.use_deterministic_algorithms(prev)
        assert ("attention_bwd_sm90_fused_det_d64_bf16" in names) == det, names
        assert ("attention_bwd_sm90_fused_d64_bf16" in names) == (not det), names
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
            close(name, got.float().numpy(), want, "attention_backward", "bf16")


@pytest.mark.parametrize("kernel", KERNELS + MORE_KERNELS)
def test_steady_loop_overlaps_the_softmax_with_p_v(kernel: str) -> None:
    # FA3's intra-warpgroup overlap: each step issues S of the next tile, then O += P V of the previous one, as two
    # wgmma groups, waits for S alone (WARPGROUP.DEPBAR.LE gsb0, 0x1) and runs the whole softmax of the next tile
    # (its BC / 2 MUFU.EX2 a thread) before it waits for P V (0x0). The loop before waited for both at once (no
    # 0x1 at all). d64 with softcap overlaps too (sm90.OVERLAP), since half its exp2s run on the FMA pipe.
    d, _ = _dims(kernel)
    _, text, _, loops = _sass()
    insns = _loop_insns(text, kernel, loops[kernel])
    tiles, bc = sm90.LOOP_TILES[d], sm90._CFG[d][0]
    waits = [n for n, i in enumerate(insns) if i.startswith("WARPGROUP.DEPBAR.LE")]
    if not sm90.OVERLAP[d]["_softcap" in kernel]:
        assert not any(insns[n].endswith("0x1") for n in waits) and len(waits) == tiles
        return
    assert [insns[n].split()[-1] for n in waits] == ["0x1", "0x0"] * tiles, [insns[n] for n in waits]
    unders = []
    for n1, n0 in zip(waits[::2], waits[1::2]):
        issued = [i for i in insns[:n1] if i.startswith("HGMMA")]
        assert issued[-1].endswith("gsb0")  # the step's P V group, issued just before (a BAR.ARV between at d128)
        # the next tile's MUFU work (softcap tanh, exp2) under P V: all BC / 2 exp2s at d256 (both steps of the
        # pair; the softcap's B step 14); ptxas places the P V wait after 16 of 64 exp2s at d128 and 192 / 128 (the
        # rest after it), after the 64 tanh with softcap
        unders.append(sum(i.startswith("MUFU.") for i in insns[n1:n0]))
    if d == 64:
        # the A step: all 96 exp2s under P V (its warpgroup vote needs every row sum first; with softcap its 96
        # tanh and the 48 exp2s left on the MUFU, the other 48 on the FMA pipe under it too); the B step: ptxas
        # places the wait where the row sums take P V's P registers, after 9 exp2s (dense, with the tile loop's
        # registers live) to 14 (varlen); with softcap after 8 tanh (dense, paged) to 29 (varlen)
        sc = "_softcap" in kernel
        mufu_a = bc // 2 * (4 - sm90.FMA_EXP2[d][sc]) // 4 + (bc // 2 if sc else 0)
        assert unders[0] == mufu_a and unders[1] >= 8, (unders, mufu_a)
        return
    # d96: ptxas places the P V wait after 12 of its 64 exp2s (its P V group, 8 HGMMA.64x96 against d128's 8
    # 64x128, takes a quarter less time to hide the softmax under)
    floor = 12 if d == 96 else 14
    for under in unders:
        assert under >= (bc // 2 if d == 256 and "_softcap" not in kernel else floor), (under, bc // 2)


@pytest.mark.parametrize("kernel", KERNELS + MORE_KERNELS)
def test_steady_loop_takes_part_of_the_exp2s_on_the_fma_pipe(kernel: str) -> None:
    # Fa90Fex / sm90.FMA_EXP2: at d64 with softcap, one n-tile in four of each steady tile takes its exp2 from
    # pk_exp2_fma (clamp FMNMX x2, floor by FADD.RM, a degree-3 polynomial in FFMAs, 2^n by LEA into the exponent
    # bits) instead of MUFU.EX2: BC / 2 exp2s a thread a tile, fex / 4 of them on the FMA pipe. Elsewhere every
    # exp2 is a MUFU.EX2 and no FADD.RM appears. The loop before had BC / 2 MUFU.EX2 a tile at every head dim.
    d, _ = _dims(kernel)
    _, text, _, loops = _sass()
    insns = _loop_insns(text, kernel, loops[kernel])
    tiles, bc = sm90.LOOP_TILES[d], sm90._CFG[d][0]
    fex = sm90.FMA_EXP2[d]["_softcap" in kernel]
    exp2s = tiles * bc // 2
    on_fma = exp2s * fex // 4
    ops_ = [i.split()[0] for i in insns]
    assert ops_.count("MUFU.EX2") == exp2s - on_fma, (ops_.count("MUFU.EX2"), exp2s, fex)
    assert ops_.count("FADD.RM") == on_fma  # the floor: one add rounded toward -inf each
    # 2^n into the exponent: (RND + n)'s bits shifted up by 23 and added to p's, one LEA (or SHF + IADD3 / IMAD.SHL)
    shifts = sum(i.startswith("LEA ") and i.rstrip().endswith("0x17") for i in insns)
    shifts += sum(i.startswith(("SHF.L.U32", "IMAD.SHL.U32")) and "0x17" in i for i in insns)
    assert shifts >= on_fma, shifts
    assert ops_.count("FMNMX") >= 2 * on_fma  # the clamp to [-127, 127] (NaN -> 127)
