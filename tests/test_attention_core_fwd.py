"""The FlashAttention-2 forward core (kernels_cu/pk_attn_core.cuh) on the host backend: flash_attention's
attention_fwd_tc_d64 / _d128, flash_attention_varlen's attention_fwd_varlen_tc_d64 / _d128 and
paged_prefill_attention's paged_prefill_tc_d64 / _d128 (16-bit caches) against
float64 NumPy (the ops' bf16 / f16 tolerance rows), over the tile boundaries the core treats apart (the
masked last tile, whole tiles in the unmasked loop, window-cut first tiles, ragged n_q / n_k), seq 1,
n_k != n_q both ways, GQA 1..8 and MQA; then bit-identical results under the forward, reverse and random
block / thread schedules and a clean racecheck run.
"""
from __future__ import annotations

import numpy as np
import pytest

from pykern import ops
from pykern.arrays import bfloat16
from pykern.difftest.cases.attention import fa_inputs, np_flash_attention
from launch_spy import record_launches as _record
from attn_checks import check_lse, close

HOST = "host"


DENSE = [
    # (batch, n_q, n_k, heads, kv_heads, head_dim, causal, window, softcap, dtype)
    (1, 200, 330, 2, 1, 64, True, (-1, -1), 0.0, "bf16"),     # causal diagonal + whole tiles, n_q < n_k
    (1, 130, 260, 4, 1, 128, False, (-1, -1), 0.0, "f16"),    # whole tiles, ragged n_q, GQA 4
    (2, 9, 40, 8, 1, 128, False, (-1, -1), 0.0, "bf16"),      # MQA (GQA 8), one ragged key tile
    (1, 300, 300, 2, 2, 64, False, (70, 20), 0.0, "f16"),     # window: masked tiles both ends, GQA 1
    (1, 150, 260, 4, 2, 64, True, (100, -1), 25.0, "bf16"),   # causal + left window + softcap
    (1, 140, 200, 2, 1, 128, False, (-1, -1), 10.0, "f16"),   # softcap
    (1, 1, 1, 2, 1, 64, True, (-1, -1), 0.0, "bf16"),         # length 1
    (1, 1, 70, 2, 1, 128, True, (-1, -1), 0.0, "f16"),
    (1, 200, 1, 2, 1, 128, True, (-1, -1), 0.0, "bf16"),      # n_q > n_k: most rows see no key
    (1, 3, 129, 8, 2, 64, False, (-1, -1), 0.0, "f16"),
]


@pytest.mark.parametrize("shape", DENSE, ids=lambda s: "b{}-q{}-k{}-h{}/{}-d{}-c{}-w{}-s{}-{}".format(*s))
def test_dense_core_vs_float64(shape, monkeypatch) -> None:
    b, n_q, n_k, h, kvh, d, causal, win, cap, kind = shape
    rng = np.random.default_rng(n_q * 1000 + n_k + d)
    q, k, v = fa_inputs(rng, b, n_q, n_k, h, kvh, d, d, kind)
    names = _record(monkeypatch)
    out, lse = ops.flash_attention(q, k, v, causal=causal, window_size=win, softcap=cap, return_lse=True,
                                   backend=HOST)
    assert names == [f"attention_fwd_tc_d{d}{'_softcap' if cap else ''}_{kind}"]
    ref_out, ref_lse = np_flash_attention(q, k, v, causal, None, win, cap)
    close("out", out, ref_out, "flash_attention", kind)
    check_lse(lse, ref_lse)


def test_misaligned_or_padded_shapes_take_the_general_kernels(monkeypatch) -> None:
    rng = np.random.default_rng(5)
    q, k, v = fa_inputs(rng, 1, 20, 30, 2, 1, 64, 64, "bf16")
    buf = np.zeros(q.size + 1, q.dtype)
    q_off = buf[1:].reshape(q.shape)  # 2 bytes off a 16-byte boundary
    q_off[...] = q
    names = _record(monkeypatch)
    a = ops.flash_attention(q_off, k, v, causal=True, backend=HOST)
    q2, k2, v2 = fa_inputs(rng, 1, 20, 30, 2, 1, 48, 48, "bf16")
    ops.flash_attention(q2, k2, v2, backend=HOST)
    assert names == ["attention_fwd_tc_pad_d64_bf16", "attention_fwd_tc_pad_d64_bf16"]
    close("out", a, np_flash_attention(q, k, v, True)[0], "flash_attention", "bf16")


def _ragged(rng, lq, lk, h, kvh, d, kind):
    q, k, v = fa_inputs(rng, 1, sum(lq), sum(lk), h, kvh, d, d, kind)
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    return q[0], k[0], v[0], cu_q, cu_k


def _np_varlen(q, k, v, cu_q, cu_k, causal, win, cap):
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b]:
            continue
        if cu_k[b + 1] == cu_k[b]:
            continue
        o, l = np_flash_attention(q[None, qs], k[None, ks], v[None, ks], causal, None, win, cap)
        out[qs], lse[qs] = o[0], l[0]
    return out, lse


VARLEN = [
    # (q lengths, k lengths, heads, kv_heads, head_dim, causal, window, softcap, dtype)
    ([5, 130, 0, 1], [9, 200, 3, 0], 4, 2, 64, True, (-1, -1), 0.0, "bf16"),
    ([70, 1, 200], [33, 150, 200], 2, 2, 128, False, (-1, -1), 0.0, "bf16"),
    ([129], [300], 8, 1, 64, True, (70, -1), 0.0, "bf16"),
    ([64, 3], [64, 130], 4, 4, 128, False, (-1, -1), 20.0, "bf16"),
    ([5, 130, 0, 1], [9, 200, 3, 0], 4, 2, 128, True, (-1, -1), 0.0, "f16"),
    ([129, 7], [300, 7], 8, 1, 64, True, (70, -1), 15.0, "f16"),
]


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"{c[8]}-d{c[4]}-h{c[2]}/{c[3]}-c{c[5]}-w{c[6]}-s{c[7]}")
def test_varlen_core_vs_float64(case, monkeypatch) -> None:
    from pykern.ops.serving import flash_attention_varlen

    lq, lk, h, kvh, d, causal, win, cap, kind = case
    q, k, v, cu_q, cu_k = _ragged(np.random.default_rng(d + sum(lq)), lq, lk, h, kvh, d, kind)
    names = _record(monkeypatch)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=win, softcap=cap,
                                      return_lse=True, backend=HOST)
    assert names == [f"attention_fwd_varlen_tc_d{d}{'_softcap' if cap else ''}_{kind}"]
    assert np.asarray(out).dtype == q.dtype
    ref_out, ref_lse = _np_varlen(q, k, v, cu_q, cu_k, causal, win, cap)
    close("out", out, ref_out, "flash_attention_varlen", kind)
    check_lse(lse, ref_lse)


def _paged(rng, lq, lk, h, kvh, d, ps, layout, kind="bf16"):
    """q, qo_indptr, pages, table of sequences of lq queries / lk positions, pages in a random order; and
    each sequence's contiguous K, V."""
    n_pages = sum(-(-n // ps) for n in lk) + 2
    shape = (n_pages, ps, kvh, d) if layout == "NHD" else (n_pages, kvh, ps, d)
    kp = rng.standard_normal(shape).astype(bfloat16() if kind == "bf16" else np.float16)
    vp = rng.standard_normal(shape).astype(kp.dtype)
    perm = rng.permutation(n_pages)
    indptr, indices, last, ks, vs, at = [0], [], [], [], [], 0
    for n in lk:
        m = -(-n // ps)
        ids = perm[at:at + m]
        at += m
        indices += list(ids)
        indptr.append(indptr[-1] + m)
        last.append(n - (m - 1) * ps if m else 0)
        tok = (lambda p: p[ids].reshape(-1, kvh, d)) if layout == "NHD" else \
            (lambda p: p[ids].transpose(0, 2, 1, 3).reshape(-1, kvh, d))
        ks.append(tok(kp)[:n])
        vs.append(tok(vp)[:n])
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), h, d)).astype(kp.dtype)
    table = (np.array(indptr, np.int32), np.array(indices, np.int32), np.array(last, np.int32))
    return q, cu_q, kp, vp, table, ks, vs


PAGED = [
    # (q lengths, kv lengths, heads, kv_heads, head_dim, page_size, layout, causal, window_left, softcap, k/v scale,
    #  dtype)
    ([5, 130, 1], [9, 200, 3], 4, 2, 64, 16, "NHD", True, -1, 0.0, None, "bf16"),
    ([70, 1], [70, 150], 2, 2, 128, 64, "HND", True, -1, 0.0, None, "bf16"),
    ([129], [300], 8, 1, 64, 1, "NHD", True, 70, 0.0, None, "bf16"),
    ([64, 3], [64, 130], 4, 4, 128, 32, "NHD", False, -1, 20.0, (0.5, 2.0), "bf16"),
    ([5, 130, 1], [9, 200, 3], 4, 2, 128, 16, "HND", True, -1, 0.0, None, "f16"),
    ([129, 3], [300, 130], 8, 1, 64, 32, "NHD", False, 70, 20.0, (0.5, 2.0), "f16"),
]


@pytest.mark.parametrize("case", PAGED, ids=lambda c: f"{c[11]}-d{c[4]}-ps{c[5]}-{c[6]}-c{c[7]}-w{c[8]}-s{c[9]}")
def test_paged_prefill_core_vs_float64(case, monkeypatch) -> None:
    from pykern.ops.serving import paged_prefill_attention

    lq, lk, h, kvh, d, ps, layout, causal, wl, cap, scales, kind = case
    q, cu_q, kp, vp, table, ks, vs = _paged(np.random.default_rng(d + ps), lq, lk, h, kvh, d, ps, layout, kind)
    ksc, vsc = scales or (None, None)
    names = _record(monkeypatch)
    out, lse = paged_prefill_attention(q, cu_q, kp, vp, *table, causal=causal, kv_layout=layout, window_left=wl,
                                       logits_soft_cap=cap, k_scale=ksc, v_scale=vsc, return_lse=True,
                                       backend=HOST)
    assert names == [f"paged_prefill_tc_d{d}{'_softcap' if cap else ''}_{kind}"]
    assert np.asarray(out).dtype == q.dtype
    ref_out, ref_lse = np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
    for b in range(len(lq)):
        s = slice(cu_q[b], cu_q[b + 1])
        kf = ks[b].astype(np.float64) * (ksc or 1.0)
        vf = vs[b].astype(np.float64) * (vsc or 1.0)
        o, l_ = np_flash_attention(q[None, s], kf[None], vf[None], causal, 1.0 / np.sqrt(d), (wl, -1), cap)
        ref_out[s], ref_lse[s] = o[0], l_[0]
    close("out", out, ref_out, "paged_prefill_attention", kind)
    check_lse(lse, ref_lse)


def _both_ops(rng):
    from pykern.ops.serving import flash_attention_varlen

    q, k, v = fa_inputs(rng, 1, 150, 200, 4, 2, 64, 64, "bf16")
    dense = ops.flash_attention(q, k, v, causal=True, window_size=(90, -1), return_lse=True, backend=HOST)
    q2, k2, v2, cu_q, cu_k = _ragged(rng, [20, 130], [70, 140], 2, 1, 128, "bf16")
    var = flash_attention_varlen(q2, k2, v2, cu_q, cu_k, causal=True, return_lse=True, backend=HOST)
    from pykern.ops.serving import paged_prefill_attention

    q3, cu_q3, kp, vp, table, _, _ = _paged(rng, [5, 130], [9, 200], 4, 2, 64, 16, "NHD")
    paged = paged_prefill_attention(q3, cu_q3, kp, vp, *table, return_lse=True, backend=HOST)
    return [np.asarray(x) for x in (*dense, *var, *paged)]


@pytest.mark.parametrize("schedule", ["reverse", "random:7"])
def test_core_results_do_not_depend_on_the_schedule(schedule, monkeypatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "forward")
    first = _both_ops(np.random.default_rng(3))
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    again = _both_ops(np.random.default_rng(3))
    for a, b in zip(first, again):  # one writer per element, a fixed order per CTA: the same bits
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.slow
def test_core_is_clean_under_racecheck(monkeypatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    rng = np.random.default_rng(4)
    for d in (64, 128):
        q, k, v = fa_inputs(rng, 1, 130, 140, 2, 1, d, d, "bf16")
        out, lse = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend=HOST)
        ref_out, ref_lse = np_flash_attention(q, k, v, True)
        close("out", out, ref_out, "flash_attention", "bf16")
    from pykern.ops.serving import flash_attention_varlen

    q, k, v, cu_q, cu_k = _ragged(rng, [3, 129], [70, 140], 2, 1, 64, "bf16")
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend=HOST)
    close("varlen", out, _np_varlen(q, k, v, cu_q, cu_k, True, (-1, -1), 0.0)[0], "flash_attention_varlen", "bf16")
    from pykern.ops.serving import paged_prefill_attention

    q, cu_q, kp, vp, table, ks, vs = _paged(rng, [3, 129], [70, 140], 2, 1, 128, 16, "NHD")
    out = paged_prefill_attention(q, cu_q, kp, vp, *table, backend=HOST)
    s = slice(cu_q[1], cu_q[2])
    ref = np_flash_attention(q[None, s], ks[1][None], vs[1][None], True)[0][0]
    close("paged", np.asarray(out)[s], ref, "paged_prefill_attention", "bf16")
