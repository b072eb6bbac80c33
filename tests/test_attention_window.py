"""Sliding-window and softcap attention (flash-attn's window_size / softcap, FlashInfer's window_left /
logits_soft_cap) on the host backend, which runs the .cu kernels: forward and gradients of every path
(fp32-FMA, tensor cores, naive, flash) against float64 NumPy; varlen and paged prefill against
per-sequence flash_attention; paged and contiguous decode against flash_attention of the one query row;
that tiles outside the window are never read (NaN there stays out of every result); the empty-row
convention; the argument errors; and that window-less calls launch the kernels they always did.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_helpers import need as _need  # noqa: E402
from pykern import ops  # noqa: E402
from pykern.difftest.cases.attention import fa_inputs, np_flash_attention  # noqa: E402
from pykern.difftest.cases.serving import make_paged, make_q, np_ragged_attention  # noqa: E402
from pykern.difftest.cases.attention import (  # noqa: E402
    attention_inputs, np_attention_backward, np_attention_forward, window_mask)
from pykern.errors import ArgumentError, ArgumentTypeError  # noqa: E402
from pykern.tolerance import tolerance  # noqa: E402
from launch_spy import record_launches as _record

HOST = "host"


def _close(name: str, got, ref, op: str, dtype: str, rows=slice(None)) -> None:
    atol, rtol = tolerance(op, dtype)
    got = np.asarray(np.asarray(got)[rows], np.float64)
    ref = np.asarray(np.asarray(ref)[rows], np.float64)
    assert got.shape == ref.shape, name
    assert not np.isnan(got).any(), f"{name}: NaN"
    assert (np.isneginf(got) == np.isneginf(ref)).all(), f"{name}: -inf (no visible key) placement differs"
    fin = np.isfinite(ref)
    err = np.abs(got[fin] - ref[fin])
    bad = ~(err <= atol + rtol * np.abs(ref[fin]))
    assert not bad.any(), f"{name}: {bad.sum()} of {bad.size} off, max err {err.max():.3g}"


# --------------------------------------------------------------------------- the reference itself

def test_window_mask_is_flash_attn_semantics() -> None:
    # flash-attn: query i sees keys [i + n_k - n_q - left, i + n_k - n_q + right]; causal sets right = 0
    m = window_mask(3, 6, False, (1, 0))
    assert [list(np.flatnonzero(r)) for r in m] == [[2, 3], [3, 4], [4, 5]]
    m = window_mask(4, 2, False, (-1, 1))  # n_q > n_k: i' = i - 2
    assert [list(np.flatnonzero(r)) for r in m] == [[], [0], [0, 1], [0, 1]]
    assert (window_mask(5, 5, True, (2, 7)) == window_mask(5, 5, False, (2, 0))).all()
    assert window_mask(5, 5, False, (-1, -1)).all()


# --------------------------------------------------------------------------- forward

FWD = [
    # (kind, tensor_cores, n_q, n_k, heads, kv_heads, head_dim, causal, window_size, softcap)
    ("f32", None, 100, 100, 4, 1, 64, True, (10, -1), 0.0),     # left only, causal
    ("f32", None, 40, 130, 4, 4, 128, False, (-1, 3), 0.0),     # right only, n_q < n_k
    ("f32", None, 130, 40, 4, 1, 64, False, (7, 7), 0.0),       # both, n_q > n_k: rows with no key
    ("f32", None, 70, 70, 2, 2, 80, True, (0, -1), 0.0),        # left = 0: the diagonal only
    ("f32", None, 50, 50, 4, 1, 64, False, (-1, -1), 2.5),      # softcap alone
    ("f32", None, 90, 120, 4, 4, 128, True, (25, -1), 1.5),     # softcap and window
    ("bf16", None, 150, 150, 4, 1, 64, True, (40, -1), 0.0),    # tensor cores
    ("bf16", None, 60, 200, 4, 4, 128, False, (20, 20), 0.0),
    ("bf16", None, 200, 60, 4, 1, 80, False, (-1, 0), 0.0),     # padded 80 -> 96, n_q > n_k
    ("bf16", None, 70, 70, 2, 2, 128, False, (-1, -1), 3.0),
    ("bf16", None, 130, 170, 4, 1, 64, True, (30, -1), 2.0),
    ("bf16", False, 100, 140, 4, 4, 64, True, (12, -1), 2.0),   # bf16 on the fp32-FMA kernels (sm_75)
    ("bf16", False, 80, 60, 4, 1, 128, False, (5, 9), 0.0),
]


@pytest.mark.parametrize("spec", FWD, ids=lambda s: "{}{}-q{}-k{}-h{}/{}-d{}-{}-w{}-cap{}".format(
    s[0], "" if s[1] is None else "-fma", *s[2:7], "causal" if s[7] else "full", s[8], s[9]))
def test_forward_vs_float64(spec) -> None:
    _need(HOST)
    kind, tc, n_q, n_k, h, kvh, d, causal, win, cap = spec
    q, k, v = fa_inputs(np.random.default_rng(1), 1, n_q, n_k, h, kvh, d, d, kind)
    kw = {} if tc is None else {"tensor_cores": tc}
    out, lse = ops.flash_attention(q, k, v, causal=causal, window_size=win, softcap=cap, return_lse=True,
                                   backend=HOST, **kw)
    ro, rl = np_flash_attention(q, k, v, causal, None, win, cap)
    _close("out", out, ro, "flash_attention", kind)
    _close("lse", lse, rl, "flash_attention", kind)
    # the window matters here: the unwindowed result differs
    if win != (-1, -1):
        full, _ = np_flash_attention(q, k, v, causal, None, (-1, -1), cap)
        assert np.abs(full - ro).max() > 0.05


@pytest.mark.parametrize("kind,tc", [("f32", None), ("bf16", None), ("bf16", False)])
def test_window_wider_than_the_sequence_is_no_window(kind: str, tc) -> None:
    _need(HOST)
    q, k, v = fa_inputs(np.random.default_rng(2), 1, 40, 70, 4, 1, 64, 64, kind)
    kw = {} if tc is None else {"tensor_cores": tc}
    for causal in (False, True):
        a = ops.flash_attention(q, k, v, causal=causal, return_lse=True, backend=HOST, **kw)
        b = ops.flash_attention(q, k, v, causal=causal, window_size=(70, 500), return_lse=True, backend=HOST, **kw)
        for x, y in zip(a, b):
            assert np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_rows_without_visible_keys_are_zero_with_lse_minus_inf() -> None:
    # flash-attn: "If the row of the mask is all zero, the output will be zero"; pykern's lse is -inf there
    _need(HOST)
    for kind in ("f32", "bf16"):
        q, k, v = fa_inputs(np.random.default_rng(3), 1, 10, 4, 2, 1, 64, 64, kind)
        out, lse = ops.flash_attention(q, k, v, window_size=(0, 0), return_lse=True, backend=HOST)
        out = np.asarray(out, np.float32)
        assert not out[0, :6].any() and np.isneginf(lse[0, :6]).all()  # i' = i - 6 < 0: no key
        assert np.isfinite(lse[0, 6:]).all()
        # one key each: out is that key's value row
        np.testing.assert_allclose(out[0, 6:, :], np.asarray(v, np.float32)[0, :, [0, 0]].transpose(1, 0, 2),
                                   rtol=1e-2 if kind == "bf16" else 1e-6)


# --------------------------------------------------------------------------- backward

BWD = [
    # (kind, n_q, n_k, heads, kv_heads, head_dim, causal, window_size, softcap, methods)
    ("f32", 90, 90, 4, 1, 64, True, (12, -1), 0.0, ("naive", "flash", "flash_given")),
    ("f32", 40, 110, 4, 4, 128, False, (-1, 6), 0.0, ("flash", "flash_given")),
    ("f32", 110, 40, 2, 2, 80, False, (9, 9), 0.0, ("naive", "flash")),
    ("f32", 60, 60, 4, 1, 64, True, (-1, -1), 2.0, ("naive", "flash", "flash_given")),
    ("f32", 70, 90, 4, 4, 128, True, (20, -1), 1.5, ("flash_given",)),
    ("bf16", 130, 130, 4, 1, 64, True, (30, -1), 0.0, ("tensor_cores", "tensor_cores_given", "flash")),
    ("bf16", 60, 150, 4, 4, 128, False, (15, 15), 0.0, ("tensor_cores_given",)),
    ("bf16", 150, 60, 4, 1, 80, False, (-1, 0), 2.5, ("tensor_cores", "tensor_cores_given")),
    ("bf16", 100, 100, 2, 2, 128, True, (0, -1), 3.0, ("tensor_cores_given", "naive")),
]


@pytest.mark.parametrize("spec", BWD, ids=lambda s: "{}-q{}-k{}-h{}/{}-d{}-{}-w{}-cap{}".format(
    *s[:6], "causal" if s[6] else "full", s[7], s[8]))
def test_backward_vs_float64(spec) -> None:
    _need(HOST)
    kind, n_q, n_k, h, kvh, d, causal, win, cap, methods = spec
    q, k, v, g = attention_inputs(np.random.default_rng(4), None, n_q, h, kvh, d, kind, n_k)
    kw = {"causal": causal, "window_size": win, "softcap": cap}
    ref = np_attention_backward(q, k, v, g, **kw)
    if win != (-1, -1):  # the window changes the gradients
        assert np.abs(np_attention_backward(q, k, v, g, causal=causal, softcap=cap)[0] - ref[0]).max() > 0.05
    out, lse = ops.flash_attention(q[None], k[None], v[None], return_lse=True, backend=HOST, **kw)
    for method in methods:
        given = method.endswith("_given")
        extra = {"out": np.asarray(out)[0], "lse": np.asarray(lse)[0]} if given else {}
        grads = ops.attention_backward(q, k, v, g, method=method.replace("_given", ""), backend=HOST, **kw, **extra)
        for name, got, r in zip(("dq", "dk", "dv"), grads, ref):
            _close(f"{method}: {name}", got, r, "attention_backward", kind)


def test_forward_lse_matches_reference_with_softcap() -> None:
    _need(HOST)
    q, k, v, _ = attention_inputs(np.random.default_rng(5), 2, 30, 4, 2, 64, "f32", 45)
    out, lse = ops.flash_attention(q, k, v, causal=True, window_size=(8, -1), softcap=1.0, return_lse=True,
                                   backend=HOST)
    ro, rl = np_attention_forward(q, k, v, causal=True, window_size=(8, -1), softcap=1.0)
    _close("out", out, ro, "flash_attention", "f32")
    _close("lse", lse, rl, "flash_attention", "f32")


# --------------------------------------------------------------------------- serving ops

def _flash_rows(q, ks, vs, indptr, **kw):
    outs, lses = [], []
    for b in range(len(ks)):
        qb = q[int(indptr[b]):int(indptr[b + 1])]
        o, l_ = ops.flash_attention(qb[None], ks[b][None], vs[b][None], return_lse=True, backend=HOST, **kw)
        outs.append(np.asarray(o[0], np.float32))
        lses.append(np.asarray(l_[0]))
    return np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("causal,win,cap", [(True, (10, -1), 0.0), (False, (4, 6), 0.0), (False, (-1, 2), 2.0),
                                            (True, (0, -1), 1.5)])
def test_varlen_equals_per_sequence_flash_attention(kind: str, causal: bool, win, cap: float) -> None:
    _need(HOST)
    rng = np.random.default_rng(6)
    k_lens, q_lens = [70, 0, 23, 30], [70, 0, 9, 40]  # the last: more queries than keys
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q = make_q(rng, (int(cu_q[-1]), 4, 32), kind)
    k = make_q(rng, (int(cu_k[-1]), 2, 32), kind)
    v = make_q(rng, (int(cu_k[-1]), 2, 32), kind)
    out, lse = ops.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=win, softcap=cap,
                                          return_lse=True, backend=HOST)
    ks = [k[cu_k[b]:cu_k[b + 1]] for b in range(4)]
    vs = [v[cu_k[b]:cu_k[b + 1]] for b in range(4)]
    fo, fl = _flash_rows(q, ks, vs, cu_q, causal=causal, window_size=win, softcap=cap)
    ro, rl = np_ragged_attention(q.astype(np.float64), cu_q, [x.astype(np.float64) for x in ks],
                                 [x.astype(np.float64) for x in vs], causal, None, win, cap)
    _close("out", out, ro, "flash_attention_varlen", kind)
    _close("lse", lse, rl, "flash_attention_varlen", kind)
    _close("out vs flash_attention", out, fo, "flash_attention_varlen", kind)
    _close("lse vs flash_attention", lse, fl, "flash_attention_varlen", kind)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal,wl,cap", [(True, 12, 0.0), (False, 5, 0.0), (True, -1, 2.0), (True, 0, 1.0)])
def test_paged_prefill_equals_per_sequence_flash_attention(layout: str, causal: bool, wl: int, cap: float) -> None:
    _need(HOST)
    rng = np.random.default_rng(7)
    kv_lens, qo_lens = [60, 0, 37, 6], [20, 0, 37, 1]
    pc = make_paged(rng, kv_lens, 5, 2, 32, layout)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = make_q(rng, (int(qo[-1]), 8, 32))
    out, lse = ops.paged_prefill_attention(q, qo, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                           pc["kv_last_page_len"], causal=causal, kv_layout=layout, window_left=wl,
                                           logits_soft_cap=cap, return_lse=True, backend=HOST)
    ks = [x.astype(np.float32) for x in pc["ks"]]
    vs = [x.astype(np.float32) for x in pc["vs"]]
    fo, fl = _flash_rows(q, ks, vs, qo, causal=causal, window_size=(wl, -1), softcap=cap)
    _close("out", out, fo, "paged_prefill_attention", "f32")
    _close("lse", lse, fl, "paged_prefill_attention", "f32")


@pytest.mark.parametrize("kinds", [("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16")])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("wl,cap", [(20, 0.0), (0, 0.0), (-1, 3.0), (45, 2.0)])
def test_paged_decode_equals_flash_attention_of_the_query_row(kinds, num_splits: int, wl: int, cap: float) -> None:
    _need(HOST)
    rng = np.random.default_rng(8)
    lens = [90, 7, 0, 200]
    q_kind, kv_kind = kinds
    pc = make_paged(rng, lens, 16, 2, 64, "NHD", kv_kind)
    q = make_q(rng, (4, 8, 64), q_kind)
    plan = ops.PagedDecodePlan(4, 8, 2, 64, 16, q_dtype=q_kind, kv_dtype=kv_kind, num_splits=num_splits,
                               window_left=wl, logits_soft_cap=cap, like=q)
    out, lse = ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                          pc["kv_last_page_len"], return_lse=True, plan=plan, backend=HOST)
    dtype = "f32" if kinds == ("f32", "f32") else "bf16"
    qf = q.astype(np.float32)
    ks = [x.astype(np.float32) for x in pc["ks"]]
    vs = [x.astype(np.float32) for x in pc["vs"]]
    fo, fl = _flash_rows(qf, ks, vs, np.arange(5), causal=True, window_size=(wl, -1), softcap=cap)
    _close("out", np.asarray(out, np.float32), fo, "paged_decode_attention", dtype)
    _close("lse", lse, fl, "paged_decode_attention", dtype)
    ro, _ = np_ragged_attention(qf.astype(np.float64), np.arange(5), pc["ks"], pc["vs"], True, None, (wl, -1), cap)
    _close("out vs float64", np.asarray(out, np.float32), ro, "paged_decode_attention", dtype)
    # the op without a plan builds one with the same window
    o2 = ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                    pc["kv_last_page_len"], window_left=wl, logits_soft_cap=cap, backend=HOST)
    _close("out without plan", np.asarray(o2, np.float32), ro, "paged_decode_attention", dtype)


@pytest.mark.parametrize("method", ["warp", "multi_warp", "split_k"])
def test_contiguous_decode_with_window(method: str) -> None:
    _need(HOST)
    rng = np.random.default_rng(9)
    q = rng.standard_normal((3, 8, 64)).astype(np.float32)
    kc = rng.standard_normal((3, 300, 2, 64)).astype(np.float32)  # NHD
    vc = rng.standard_normal((3, 300, 2, 64)).astype(np.float32)
    lens = [250, 31, 0]
    out = ops.batched_decode_attention(q, kc, vc, lens, kv_layout="NHD", window_left=40, logits_soft_cap=2.0,
                                       method=method, backend=HOST)
    ref, _ = _flash_rows(q, [kc[b, :lens[b]] for b in range(3)], [vc[b, :lens[b]] for b in range(3)], np.arange(4),
                         causal=True, window_size=(40, -1), softcap=2.0)
    _close("out", out, ref, "batched_decode_attention", "f32")
    one = ops.decode_attention(q[0], kc[0], vc[0], 250, kv_layout="NHD", window_left=40, logits_soft_cap=2.0,
                               method=method, backend=HOST)
    _close("decode_attention", one, ref[0], "decode_attention", "f32")


# --------------------------------------------------------------------------- tiles outside the window are skipped
# NaN in keys/values (or queries) that no row of a tile's window reaches: a kernel that still visited
# those tiles and only masked them would multiply P = 0 by NaN (0 * NaN = NaN in P V, dP and dS), so
# finite results equal to the reference prove the tiles were never read. (The fp32-FMA forward skips a
# score chunk whose running max is still -inf, so there only tiles right of the window can show it.)

N_SKIP = 512
POISON_KV = slice(0, 128)      # keys/values no query >= 256 of a left-16 causal window sees
POISON_Q = slice(448, 512)     # queries no key < 256 is seen by


def _poisoned(kind: str, d: int, rng_seed: int = 10):
    q, k, v, g = attention_inputs(np.random.default_rng(rng_seed), None, N_SKIP, 2, 1, d, kind)
    clean = tuple(np.array(a) for a in (q, k, v, g))
    for a in (k, v):
        a[POISON_KV] = np.nan
    return (q, k, v, g), clean


@pytest.mark.parametrize("kind,tc,d", [("f32", None, 64), ("f32", None, 128), ("bf16", None, 64),
                                       ("bf16", False, 128)])
def test_forward_never_reads_tiles_outside_the_window(kind: str, tc, d: int) -> None:
    _need(HOST)
    (q, k, v, _), (cq, ck, cv, _) = _poisoned(kind, d)
    # bf16 at head_dim 64 runs the FlashAttention-2 core: tiles of 128 queries (256 .. 383 see keys 240 .. 399,
    # in the 64-key tiles 192 .. 447, only); the other kernels take 64 queries a tile (192 .. 319 see keys
    # 176 .. 335 only)
    core = kind == "bf16" and tc is None
    right, rows, nan_row = (448, slice(256, 384), 399) if core else (384, slice(192, 320), 375)
    for a in (k, v):
        a[right:] = np.nan  # right of the window as well
    kw = {"window_size": (16, 16)} | ({} if tc is None else {"tensor_cores": tc})
    out, lse = ops.flash_attention(q[None], k[None], v[None], return_lse=True, backend=HOST, **kw)
    ro, rl = np_flash_attention(cq[None], ck[None], cv[None], False, None, (16, 16))
    rows = (slice(None), rows)
    _close("out", out, ro, "flash_attention", kind, rows=rows)
    _close("lse", lse, rl, "flash_attention", kind, rows=rows)
    # the poison is live: a row whose window reaches into it (after clean keys) is NaN
    assert np.isnan(np.asarray(out, np.float32)[0, nan_row]).all()


@pytest.mark.parametrize("kind,method", [("f32", "flash"), ("bf16", "tensor_cores"), ("f32", "naive")])
def test_backward_never_reads_tiles_outside_the_window(kind: str, method: str) -> None:
    _need(HOST)
    (q, k, v, g), (cq, ck, cv, cg) = _poisoned(kind, 64)
    q[POISON_Q] = np.nan
    g[POISON_Q] = np.nan
    kw = {"causal": True, "window_size": (16, -1)}
    ro, rl = np_attention_forward(cq, ck, cv, **kw)
    out = ro.astype(np.float32) if kind == "f32" else ro.astype(q.dtype)
    dq, dk, dv = ops.attention_backward(q, k, v, g, out=out, lse=rl.astype(np.float32), method=method,
                                        backend=HOST, **kw)
    rq, rk, rv = np_attention_backward(cq, ck, cv, cg, **kw)
    _close("dq", dq, rq, "attention_backward", kind, rows=slice(256, 448))
    # keys 128 .. 143 are seen by queries whose windows hold poisoned keys (their lse/delta in the naive path)
    _close("dk", dk, rk, "attention_backward", kind, rows=slice(144, 256))
    _close("dv", dv, rv, "attention_backward", kind, rows=slice(144, 256))
    assert np.isnan(np.asarray(dq, np.float32)[130]).all() and np.isnan(np.asarray(dk, np.float32)[470]).all()


def test_serving_ops_never_read_positions_outside_the_window() -> None:
    _need(HOST)
    rng = np.random.default_rng(11)
    kv = rng.standard_normal((N_SKIP, 2, 32)).astype(np.float32)
    vv = rng.standard_normal((N_SKIP, 2, 32)).astype(np.float32)
    q = rng.standard_normal((N_SKIP, 4, 32)).astype(np.float32)
    ref, _ = np_ragged_attention(q.astype(np.float64), [0, N_SKIP], [kv.astype(np.float64)],
                                 [vv.astype(np.float64)], True, None, (16, -1))
    kp, vp = kv.copy(), vv.copy()
    kp[POISON_KV] = np.nan
    vp[POISON_KV] = np.nan
    cu = np.array([0, N_SKIP], np.int32)
    out = ops.flash_attention_varlen(q, kp, vp, cu, cu, causal=True, window_size=(16, -1), backend=HOST)
    _close("varlen", out, ref, "flash_attention_varlen", "f32", rows=slice(256, None))
    # paged: one page per 16 positions, in order
    pages_k = kp.reshape(N_SKIP // 16, 16, 2, 32)
    pages_v = vp.reshape(N_SKIP // 16, 16, 2, 32)
    indptr = np.array([0, N_SKIP // 16], np.int32)
    idx = np.arange(N_SKIP // 16, dtype=np.int32)
    last = np.array([16], np.int32)
    out = ops.paged_prefill_attention(q, cu, pages_k, pages_v, indptr, idx, last, window_left=16, backend=HOST)
    _close("paged prefill", out, ref, "paged_prefill_attention", "f32", rows=slice(256, None))
    for splits in (1, 4):
        plan = ops.PagedDecodePlan(1, 4, 2, 32, 16, num_splits=splits, window_left=16)
        out = ops.paged_decode_attention(q[-1:], pages_k, pages_v, indptr, idx, last, plan=plan, backend=HOST)
        _close(f"paged decode, {splits} splits", out, ref[-1:], "paged_decode_attention", "f32")


# --------------------------------------------------------------------------- kernels, arguments

def test_no_window_no_softcap_launches_the_plain_kernels(monkeypatch) -> None:
    _need(HOST)
    names = _record(monkeypatch)
    q, k, v = fa_inputs(np.random.default_rng(12), 1, 9, 9, 2, 1, 64, 64, "bf16")
    ops.flash_attention(q, k, v, causal=True, backend=HOST)
    ops.flash_attention(q, k, v, causal=True, window_size=(4, -1), backend=HOST)
    ops.flash_attention(q, k, v, causal=True, softcap=2.0, backend=HOST)
    assert names == ["attention_fwd_tc_d64_bf16", "attention_fwd_tc_d64_bf16",
                     "attention_fwd_tc_d64_softcap_bf16"]
    names.clear()
    qq, kk, vv, g = attention_inputs(np.random.default_rng(13), None, 9, 2, 1, 32, "f32")
    ops.attention_backward(qq, kk, vv, g, method="flash", backend=HOST)
    ops.attention_backward(qq, kk, vv, g, method="flash", softcap=1.0, backend=HOST)
    assert names == ["attention_bwd_lse", "attention_bwd_fma_dkdv", "attention_bwd_fma_dq",
                     "attention_bwd_lse_softcap", "attention_bwd_fma_dkdv_softcap",
                     "attention_bwd_fma_dq_softcap"]


def test_bad_arguments_name_them() -> None:
    q, k, v = fa_inputs(np.random.default_rng(14), 1, 4, 4, 2, 1, 32, 32, "f32")
    for bad, exc, match in (((-2, 0), ArgumentError, r"window_size\[0\]"), ((0, -5), ArgumentError, r"window_size\[1\]"),
                            ((1.0, 2), ArgumentTypeError, r"window_size\[0\]"), (3, ArgumentTypeError, "window_size"),
                            ((1, 2, 3), ArgumentTypeError, "window_size"), ((True, 1), ArgumentTypeError, "window_size"),
                            ("ab", ArgumentTypeError, "window_size")):
        with pytest.raises(exc, match=match):
            ops.flash_attention(q, k, v, window_size=bad, backend=HOST)
    for bad, exc in ((-1.0, ArgumentError), (float("nan"), ArgumentError), (float("inf"), ArgumentError),
                     ("1", ArgumentTypeError), (None, ArgumentTypeError), (1e-50, ArgumentError)):
        with pytest.raises(exc, match="softcap"):
            ops.flash_attention(q, k, v, softcap=bad, backend=HOST)
    qq, kk, vv, g = attention_inputs(np.random.default_rng(15), None, 4, 2, 1, 32, "f32")
    with pytest.raises(ArgumentError, match="window_size"):
        ops.attention_backward(qq, kk, vv, g, window_size=(-3, -1), backend=HOST)
    with pytest.raises(ArgumentError, match="softcap"):
        ops.attention_backward(qq, kk, vv, g, softcap=-0.5, backend=HOST)
    cu = np.array([0, 4], np.int32)
    with pytest.raises(ArgumentError, match="window_size"):
        ops.flash_attention_varlen(qq, kk, vv, cu, cu, window_size=(0, -2), backend=HOST)
    with pytest.raises(ArgumentError, match="window_left"):
        ops.PagedDecodePlan(1, 2, 1, 32, 16, window_left=-2)
    with pytest.raises(ArgumentError, match="logits_soft_cap"):
        ops.PagedDecodePlan(1, 2, 1, 32, 16, logits_soft_cap=-1.0)
    pc = make_paged(np.random.default_rng(16), [5], 16, 1, 32)
    args = (pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"], pc["kv_last_page_len"])
    with pytest.raises(ArgumentTypeError, match="window_left"):
        ops.paged_prefill_attention(qq[:1], np.array([0, 1], np.int32), *args, window_left=1.5, backend=HOST)
    plan = ops.PagedDecodePlan(1, 2, 1, 32, 16, window_left=3)
    with pytest.raises(ArgumentError, match="window_left"):
        ops.paged_decode_attention(qq[:1], *args, plan=plan, window_left=4, backend=HOST)
    with pytest.raises(ArgumentError, match="logits_soft_cap"):
        ops.paged_decode_attention(qq[:1], *args, plan=plan, logits_soft_cap=1.0, backend=HOST)
    with pytest.raises(ArgumentError, match="window_left"):
        ops.decode_attention(qq[0], kk[:, 0][None], vv[:, 0][None], 4, window_left=-7, backend=HOST, kv_layout="HND")
