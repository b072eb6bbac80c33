"""flash_attention_varlen_backward (kernels_cu/attention_bwd_tc.cu, attention_bwd_varlen_tc_*; float32:
kernels_cu/attention_bwd_fma.cu, attention_bwd_varlen_fma_*) on the host backend.

dq, dk, dv of packed sequences against float64 sequence by sequence (the difftest cases: ragged lengths with an
empty and a length-1 sequence, n_q != n_k both ways under the bottom-right causal mask, GQA, windows, softcap,
every compiled head_dim, bf16, f16 and float32); the same bits under the host's forward and reverse schedules; the
host playing sm_90a launches the same mma.sync kernels; bad cu_seqlens / max_seqlen raise before any launch;
float32 with device cu_seqlens runs the same kernels, nothing read back.
"""
from __future__ import annotations

import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases.attention import (
    VARLEN_BACKWARD, _attention_varlen_backward_cases, np_varlen_backward, varlen_backward_kernels,
)
from pykern.difftest.cases.training import _cast
from pykern.errors import ArgumentError, ArgumentTypeError

from family_helpers import check
from launch_spy import record_launches

HOST = "host"


def _cases() -> list:
    return list(_attention_varlen_backward_cases(np.random.default_rng(0)))


@pytest.mark.parametrize("i", range(len(VARLEN_BACKWARD)), ids=[c.shape + "-" + c.dtype for c in _cases()])
def test_gradients_match_float64(i: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYKERN_HOST_ARCH", raising=False)
    case = _cases()[i]
    names = record_launches(monkeypatch)
    got = case.run(HOST)
    check(got, case.reference(), case.op, case.dtype)
    assert tuple(names) == case.kernels  # the varlen kernels, nothing dense


def _inputs(kind: str = "bf16", lq=(5, 0, 1, 70), lk=(9, 3, 1, 66), h: int = 4, kvh: int = 2, d: int = 64,
            causal: bool = True, seed: int = 1):
    rng = np.random.default_rng(seed)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, g = (_cast(rng.standard_normal((int(cq[-1]), h, d)), kind) for _ in range(2))
    k, v = (_cast(rng.standard_normal((int(ck[-1]), kvh, d)), kind) for _ in range(2))
    out64, lse64, *grads = np_varlen_backward(q, k, v, g, cq, ck, causal=causal)
    return (q, k, v, g, cq, ck, _cast(out64, kind), lse64.astype(np.float32)), grads


def test_same_bits_under_forward_and_reverse_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    # One writer per output element: the thread order inside a CTA must not change a bit (a missing barrier
    # around the shared tiles would).
    monkeypatch.delenv("PYKERN_HOST_ARCH", raising=False)
    (q, k, v, g, cq, ck, out, lse), _ = _inputs(d=128, lq=(65, 3, 0), lk=(65, 70, 2), h=2, kvh=1)
    runs = []
    for sched in ("forward", "reverse", "random:7"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", sched)
        runs.append(ops.flash_attention_varlen_backward(q, k, v, g, cq, ck, out=out, lse=lse, causal=True,
                                                        backend=HOST))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


@pytest.mark.parametrize("d", [64, 96, 128])
def test_host_playing_sm90a_runs_the_varlen_kernels(d: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # On Hopper the varlen backward at d64 / d96 / d128 is the fused sm_90a wgmma kernel (attention_bwd_sm90.cu with VL and
    # DQA: the pre-pass, the kernel, the dQ narrowing; more in tests/test_attention_sm90_varlen.py); PYKERN_SM90=0
    # gives the mma.sync pair, as on an sm_80 GPU.
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
    (q, k, v, g, cq, ck, out, lse), ref = _inputs(d=d)
    names = record_launches(monkeypatch)
    dq, dk, dv = ops.flash_attention_varlen_backward(q, k, v, g, cq, ck, out=out, lse=lse, causal=True,
                                                     backend=HOST)
    check({"dq": dq, "dk": dk, "dv": dv}, dict(zip(("dq", "dk", "dv"), ref)), "flash_attention_varlen_backward",
          "bf16")
    assert names == ["attention_bwd_tc_prep_bf16", f"attention_bwd_varlen_sm90_fused_d{d}_bf16",
                     f"attention_bwd_tc_dq_reduce_d{d}_bf16"]
    monkeypatch.setenv("PYKERN_SM90", "0")
    names.clear()
    ops.flash_attention_varlen_backward(q, k, v, g, cq, ck, out=out, lse=lse, causal=True, backend=HOST)
    assert tuple(names) == varlen_backward_kernels(d, 0.0, "bf16")


def test_max_seqlen_larger_than_needed_and_empty_batch_members(monkeypatch: pytest.MonkeyPatch) -> None:
    # A larger max_seqlen only adds CTAs that exit; sequences with no query or no key give zero gradients.
    monkeypatch.delenv("PYKERN_HOST_ARCH", raising=False)
    (q, k, v, g, cq, ck, out, lse), ref = _inputs(lq=(0, 7, 4), lk=(5, 0, 4), h=2, kvh=1)
    dq, dk, dv = ops.flash_attention_varlen_backward(q, k, v, g, cq, ck, out=out, lse=lse, max_seqlen_q=300,
                                                     max_seqlen_k=200, causal=True, backend=HOST)
    check({"dq": dq, "dk": dk, "dv": dv}, dict(zip(("dq", "dk", "dv"), ref)), "flash_attention_varlen_backward",
          "bf16")
    assert not np.asarray(dk, np.float32)[:5].any() and not np.asarray(dq, np.float32)[:7].any()
    assert np.asarray(dk, np.float32)[5:].any()


def _bad(monkeypatch: pytest.MonkeyPatch, exc: type, match: str, **change) -> None:
    (q, k, v, g, cq, ck, out, lse), _ = _inputs(lq=(3, 4), lk=(5, 2), h=2, kvh=1)
    kw = dict(q=q, k=k, v=v, grad_out=g, cu_seqlens_q=cq, cu_seqlens_k=ck, out=out, lse=lse, causal=True)
    kw.update(change)
    names = record_launches(monkeypatch)
    with pytest.raises(exc, match=match):
        ops.flash_attention_varlen_backward(**kw, backend=HOST)
    assert names == []  # before any launch


@pytest.mark.parametrize("name,value,exc,match", [
    ("cu_seqlens_q", np.array([0, 3, 7], np.int64), ArgumentTypeError, "cu_seqlens_q: expected an int32 array"),
    ("cu_seqlens_k", [0, 5, 7], ArgumentTypeError, "cu_seqlens_k: expected an int32 array"),
    ("cu_seqlens_q", np.array([0, 5, 4], np.int32), ArgumentError, "cu_seqlens_q: expected a non-decreasing"),
    ("cu_seqlens_k", np.array([0, 7], np.int32), ArgumentError, r"cu_seqlens_k: expected shape \(3,\)"),
    ("cu_seqlens_q", np.array([0, 3, 6], np.int32), ArgumentError, "cu_seqlens_q: .*total_q=7, got 0 and 6"),
    ("cu_seqlens_k", np.array([1, 5, 7], np.int32), ArgumentError, "cu_seqlens_k: expected cu_seqlens_k.0. == 0"),
    ("cu_seqlens_q", np.array([0], np.int32), ArgumentError, "cu_seqlens_q: expected shape .batch . 1,."),
    ("max_seqlen_q", 3, ArgumentError, r"max_seqlen_q: expected at least the longest sequence .* \(4\), got 3"),
    ("max_seqlen_k", 2.0, ArgumentTypeError, "max_seqlen_k: expected an int"),
    ("lse", np.zeros((7, 3), np.float32), ArgumentError, r"lse: expected shape \(7, 2\)"),
    ("q", np.zeros((7, 2, 64), np.float64), ArgumentTypeError, "q: expected dtype bfloat16 or float16 or float32, got float64"),
    ("q", np.zeros((7, 2, 64), np.float32), ArgumentTypeError, r"k: expected the dtype of q \(f32\), got bf16"),
])
def test_bad_input_names_the_argument(name, value, exc, match, monkeypatch: pytest.MonkeyPatch) -> None:
    _bad(monkeypatch, exc, match, **{name: value})


# float32: the fp32-FMA varlen kernels (every arch; the tensor-core kernels take bf16 / f16 only), one launch each
# for the whole batch; empty sequences (no query or no key) get zero gradients.
@pytest.mark.parametrize("causal,window,cap,d,d_v", [
    (True, (-1, -1), 0.0, 64, 64),
    (False, (3, 2), 0.0, 96, 96),
    (True, (-1, -1), 2.5, 40, 40),
    (True, (-1, -1), 0.0, 64, 48),  # head_dim_v < head_dim: v, dO and out padded to head_dim, dV sliced back
])
def test_float32_gradients_match_float64(causal, window, cap, d, d_v, monkeypatch: pytest.MonkeyPatch) -> None:
    from pykern.difftest.cases.attention import np_varlen_backward as ref

    monkeypatch.delenv("PYKERN_HOST_ARCH", raising=False)
    rng = np.random.default_rng(5)
    lq, lk, h, kvh = (5, 0, 1, 33, 4), (9, 3, 1, 30, 0), 4, 2
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), h, d)).astype(np.float32)
    k = rng.standard_normal((int(ck[-1]), kvh, d)).astype(np.float32)
    v = rng.standard_normal((int(ck[-1]), kvh, d_v)).astype(np.float32)
    g = rng.standard_normal((int(cq[-1]), h, d_v)).astype(np.float32)
    out64, lse64, *want = ref(q, k, v, g, cq, ck, causal=causal, window_size=window, softcap=cap)
    names = record_launches(monkeypatch)
    got = ops.flash_attention_varlen_backward(q, k, v, g, cq, ck, out=out64.astype(np.float32),
                                              lse=lse64.astype(np.float32), causal=causal, window_size=window,
                                              softcap=cap, backend=HOST)
    for name, x, w in zip(("dq", "dk", "dv"), got, want):
        assert x.dtype == np.float32 and x.shape == w.shape, name
    check(dict(zip(("dq", "dk", "dv"), got)), dict(zip(("dq", "dk", "dv"), want)), "flash_attention_varlen_backward",
          "f32")
    assert not got[0][int(cq[4]):].any()  # the last sequence has queries but no key: dq = 0
    assert not got[1][int(ck[1]):int(ck[2])].any() and not got[2][int(ck[1]):int(ck[2])].any()  # keys, no query
    assert got[0][:int(cq[1])].any() and got[1][:int(ck[1])].any()
    sfx = "_softcap" if cap > 0 else ""  # the f32 kernels carry no dtype suffix
    assert names == ["attention_bwd_preprocess", "attention_bwd_varlen_fma_dkdv" + sfx,
                     "attention_bwd_varlen_fma_dq" + sfx]


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_device_cu_seqlens_run_the_same_kernels_and_rows_past_the_end_stay_zero(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Device cu_seqlens (as flash-attn's callers and transformers pass them): no host copy, so nothing is checked
    # or read back; max_seqlen_q / _k size the grid. No device here: check_cu_seqlens reports no host copy, as it
    # does for device memory. Trusted as flash-attn trusts them, they may end before total_q / total_k: the rows
    # past the end belong to no sequence and keep the zeros the outputs start from.
    from pykern.ops import _common, _prefill

    monkeypatch.delenv("PYKERN_HOST_ARCH", raising=False)
    monkeypatch.setattr(_prefill, "check_cu_seqlens", lambda name, cu, length, length_of, *_: (
        _common.index_array(name, cu, length, length_of)[0], None))
    lq, lk = (5, 0, 1, 40, 3), (9, 3, 1, 36, 0)  # the last sequence's rows lie past cu_seqlens[-2]
    (q, k, v, g, cq, ck, out, lse), want = _inputs(kind=kind, lq=lq, lk=lk, causal=True)
    short_q, short_k = cq[:-1], ck[:-1]  # batch 4: the last 3 query rows are in no sequence
    want[0][int(short_q[-1]):] = 0.0
    names = record_launches(monkeypatch)
    got = ops.flash_attention_varlen_backward(q, k, v, g, short_q, short_k, out=out, lse=lse, max_seqlen_q=45,
                                              max_seqlen_k=40, causal=True, backend=HOST)
    check(dict(zip(("dq", "dk", "dv"), got)), dict(zip(("dq", "dk", "dv"), want)), "flash_attention_varlen_backward",
          kind)
    assert not np.asarray(got[0], np.float32)[int(short_q[-1]):].any()
    assert tuple(names) == varlen_backward_kernels(64, 0.0, kind)
    with pytest.raises(ArgumentError, match="max_seqlen_q: expected an int when cu_seqlens_q is on the device"):
        ops.flash_attention_varlen_backward(q, k, v, g, short_q, short_k, out=out, lse=lse, max_seqlen_k=40,
                                            backend=HOST)


def test_float32_grid_limit_counts_its_own_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fp32 kernels' tiles are 256 / group_lanes rows (16 at head_dim 256), not the tensor-core kernels' 64: the
    # 1-D grid's limit is checked with them, before any launch (here 2 * 16 * ceil((2^31 - 257) / 16) CTAs; 64-row
    # tiles would fit).
    q = np.zeros((4, 16, 256), np.float32)
    k = np.zeros((4, 16, 256), np.float32)
    cu = np.array([0, 2, 4], np.int32)
    names = record_launches(monkeypatch)
    with pytest.raises(ArgumentError, match=r"max_seqlen_q: batch \* heads \* tiles = 4294966784 CTAs exceeds"):
        ops.flash_attention_varlen_backward(q, k, k, q, cu, cu, out=q, lse=np.zeros((4, 16), np.float32),
                                            max_seqlen_q=2**31 - 257, max_seqlen_k=2, backend=HOST)
    assert names == []
