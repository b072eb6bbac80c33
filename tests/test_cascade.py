"""Attention-state merges (pykern.ops.merge_state / merge_state_in_place / merge_states): the merge of the
states over two key segments is the attention over both, the two-level (shared-prefix) decode equals the flat
one, empty segments and NaN, the in-place mask, and bad input named before any launch."""
from __future__ import annotations

import numpy as np
import pytest

from pykern import ops
from pykern.arrays import bfloat16
from pykern.difftest.cases.cascade import np_merge_state, np_merge_states
from pykern.errors import ArgumentError, ArgumentTypeError
from family_helpers import check

HOST = "host"


def _f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_merging_two_segments_equals_attention_over_both(kind: str) -> None:
    # flash_attention over keys [A; B] == merge_state(attention over A, attention over B): the lse convention
    # of the producers and of the merge agree.
    rng = np.random.default_rng(0)
    dt = bfloat16() if kind == "bf16" else np.float32
    q = rng.standard_normal((1, 6, 4, 64)).astype(dt)
    k = rng.standard_normal((1, 50, 2, 64)).astype(dt)
    v = rng.standard_normal((1, 50, 2, 64)).astype(dt)
    full, lse = ops.flash_attention(q, k, v, return_lse=True, backend=HOST)
    oa, la = ops.flash_attention(q, k[:, :31], v[:, :31], return_lse=True, backend=HOST)
    ob, lb = ops.flash_attention(q, k[:, 31:], v[:, 31:], return_lse=True, backend=HOST)
    o, s = ops.merge_state(oa[0], la[0], ob[0], lb[0], backend=HOST)
    check({"x": _f64(o)}, {"x": _f64(full[0])}, "merge_state", kind)
    np.testing.assert_allclose(s, lse[0], rtol=1e-5, atol=1e-5)
    # merge_states over the same two states agrees with the pairwise merge
    o2, s2 = ops.merge_states(np.stack([oa[0], ob[0]], 1), np.stack([la[0], lb[0]], 1), backend=HOST)
    check({"x": _f64(o2)}, {"x": _f64(full[0])}, "merge_states", kind)
    np.testing.assert_allclose(s2, s, rtol=1e-6, atol=1e-6)


def _pages(k: np.ndarray, v: np.ndarray, page: int):
    """A paged NHD cache holding one sequence per row of k / v (batch, len, heads, dim), pages in order."""
    b, n, h, d = k.shape
    per = -(-n // page)
    kp = np.zeros((b * per, page, h, d), k.dtype)
    vp = np.zeros_like(kp)
    for i in range(b):
        for j in range(per):
            rows = slice(j * page, min(n, (j + 1) * page))
            kp[i * per + j, : rows.stop - rows.start] = k[i, rows]
            vp[i * per + j, : rows.stop - rows.start] = v[i, rows]
    indptr = np.arange(b + 1, dtype=np.int32) * per
    last = np.full(b, n - (per - 1) * page, np.int32)
    return kp, vp, indptr, np.arange(b * per, dtype=np.int32), last


def _pages_hnd(k: np.ndarray, v: np.ndarray, page: int):
    kp, vp, *rest = _pages(k, v, page)
    return (np.ascontiguousarray(kp.swapaxes(1, 2)), np.ascontiguousarray(vp.swapaxes(1, 2)), *rest)


def test_two_level_decode_equals_the_flat_decode() -> None:
    # Cascade decode: the shared prefix once for all requests (one attention with every request's query
    # against one copy of the prefix), each request's own suffix from the paged cache, merged.
    rng = np.random.default_rng(1)
    batch, hq, hk, d, prefix, suffix, page = 3, 4, 2, 64, 37, 21, 16
    dt = bfloat16()
    q = rng.standard_normal((batch, hq, d)).astype(dt)
    pk, pv = (rng.standard_normal((prefix, hk, d)).astype(dt) for _ in range(2))
    sk, sv = (rng.standard_normal((batch, suffix, hk, d)).astype(dt) for _ in range(2))
    o_pre, l_pre = ops.flash_attention(q[None], pk[None], pv[None], return_lse=True, backend=HOST)
    o_suf, l_suf = ops.paged_decode_attention(q, *_pages(sk, sv, page), return_lse=True, backend=HOST)
    o, s = ops.merge_state(o_pre[0], l_pre[0], o_suf, l_suf, backend=HOST)
    o2, s2 = ops.shared_prefix_decode(q, pk, pv, *_pages(sk, sv, page), return_lse=True, backend=HOST)
    np.testing.assert_array_equal(_f64(o2), _f64(o))  # the op is exactly these three launches
    np.testing.assert_array_equal(s2, s)
    o3 = ops.shared_prefix_decode(q, pk.swapaxes(0, 1).copy(), pv.swapaxes(0, 1).copy(),
                                  *_pages_hnd(sk, sv, page), kv_layout="HND", backend=HOST)
    check({"x": _f64(o3)}, {"x": _f64(o)}, "paged_decode_attention", "bf16")
    full_k = np.concatenate([np.broadcast_to(pk, (batch, prefix, hk, d)), sk], 1)
    full_v = np.concatenate([np.broadcast_to(pv, (batch, prefix, hk, d)), sv], 1)
    flat, flat_lse = ops.paged_decode_attention(q, *_pages(full_k, full_v, page), return_lse=True, backend=HOST)
    check({"x": _f64(o)}, {"x": _f64(flat)}, "paged_decode_attention", "bf16")
    np.testing.assert_allclose(s, flat_lse, rtol=1e-5, atol=1e-5)


def test_shared_prefix_decode_edges_and_bad_input() -> None:
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    sk, sv = (rng.standard_normal((2, 9, 2, 32)).astype(np.float32) for _ in range(2))
    empty = np.zeros((0, 2, 32), np.float32)
    alone = ops.shared_prefix_decode(q, empty, empty, *_pages(sk, sv, 4), backend=HOST)
    np.testing.assert_array_equal(alone, ops.paged_decode_attention(q, *_pages(sk, sv, 4), backend=HOST))
    pk = rng.standard_normal((5, 2, 32)).astype(np.float32)
    with pytest.raises(ArgumentError, match=r"k_shared: expected a 3-D array \(prefix_len, num_kv_heads"):
        ops.shared_prefix_decode(q, pk[None], pk, *_pages(sk, sv, 4), backend=HOST)
    with pytest.raises(ArgumentError, match="v_shared: expected the shape of k_shared"):
        ops.shared_prefix_decode(q, pk, pk[:4], *_pages(sk, sv, 4), backend=HOST)
    with pytest.raises(ArgumentError, match="kv_layout"):
        ops.shared_prefix_decode(q, pk, pk, *_pages(sk, sv, 4), kv_layout="nhd", backend=HOST)
    # the prefix's dtype and kind of array are checked here (flash_attention's errors named its own k / v)
    for bad in (pk.astype(np.float64), pk.astype(np.float16), pk.astype(np.int32)):
        with pytest.raises(ArgumentTypeError, match="k_shared: expected (the )?dtype"):
            ops.shared_prefix_decode(q, bad, pk, *_pages(sk, sv, 4), backend=HOST)
        with pytest.raises(ArgumentTypeError, match="v_shared: expected (the )?dtype"):
            ops.shared_prefix_decode(q, pk, bad, *_pages(sk, sv, 4), backend=HOST)
    torch = pytest.importorskip("torch")
    with pytest.raises(ArgumentTypeError, match="k_shared: expected the same kind of array"):
        ops.shared_prefix_decode(q, torch.from_numpy(pk).to("meta"), pk, *_pages(sk, sv, 4), backend=HOST)


def test_empty_segments_weigh_nothing_and_nan_is_never_dropped() -> None:
    va = np.full((1, 4, 8), 2.0, np.float32)
    vb = np.full((1, 4, 8), 5.0, np.float32)
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    sa = np.array([[-inf, -inf, 0.5, nan]], np.float32)
    sb = np.array([[1.0, -inf, -inf, 0.0]], np.float32)
    for be in (HOST, "numba"):
        o, s = ops.merge_state(va, sa, vb, sb, backend=be)
        assert (o[0, 0] == 5.0).all() and s[0, 0] == np.float32(1.0)  # a is empty: b alone, exactly
        assert (o[0, 1] == 0.0).all() and s[0, 1] == -inf  # both empty: 0 and -inf, as a query with no key
        assert (o[0, 2] == 2.0).all() and s[0, 2] == np.float32(0.5)
        assert np.isnan(o[0, 3]).all() and np.isnan(s[0, 3])  # a NaN lse poisons its row, never vanishes
    o, s = ops.merge_states(np.stack([va, vb], 1), np.stack([sa, sb], 1), backend=HOST)
    assert (o[0, 0] == 5.0).all() and (o[0, 1] == 0.0).all() and s[0, 1] == -inf and np.isnan(s[0, 3])
    # An empty state's v is never read into the result: NaN there (garbage of a segment with no key) is no NaN out.
    va_nan = va.copy()
    va_nan[0, :2] = np.nan
    for be in (HOST, "numba"):
        o, s = ops.merge_state(va_nan, sa, vb, sb, backend=be)
        assert (o[0, 0] == 5.0).all() and (o[0, 1] == 0.0).all()
        o, s = ops.merge_states(np.stack([va_nan, vb], 1), np.stack([sa, sb], 1), backend=be)
        assert (o[0, 0] == 5.0).all() and (o[0, 1] == 0.0).all()


@pytest.mark.parametrize("be", [HOST, "numba"])
def test_in_place_merge_follows_the_mask(be: str) -> None:
    rng = np.random.default_rng(2)
    v = rng.standard_normal((5, 2, 16)).astype(np.float32)
    s = rng.standard_normal((5, 2)).astype(np.float32)
    vo = rng.standard_normal((5, 2, 16)).astype(np.float32)
    so = rng.standard_normal((5, 2)).astype(np.float32)
    mask = np.array([True, False, True, False, True])
    want_v, want_s = np_merge_state(v, s, vo, so)
    v0, s0 = v.copy(), s.copy()
    assert ops.merge_state_in_place(v, s, vo, so, mask, backend=be) is None
    np.testing.assert_array_equal(v[~mask], v0[~mask])
    np.testing.assert_array_equal(s[~mask], s0[~mask])
    check({"x": _f64(v[mask])}, {"x": want_v[mask]}, "merge_state", "f32")
    check({"x": _f64(s[mask])}, {"x": want_s[mask]}, "merge_state", "f32")
    ops.merge_state_in_place(v0, s0, vo, so, backend=be)  # no mask: every token
    check({"x": _f64(v0)}, {"x": want_v}, "merge_state", "f32")


def test_many_states_in_index_order_bit_stable() -> None:
    rng = np.random.default_rng(3)
    v = rng.standard_normal((2, 70, 3, 40)).astype(np.float32)  # more states than a warp has lanes
    s = (4 * rng.standard_normal((2, 70, 3))).astype(np.float32)
    a = ops.merge_states(v, s, backend=HOST)
    b = ops.merge_states(v, s, backend=HOST)
    np.testing.assert_array_equal(a[0], b[0])
    want_v, want_s = np_merge_states(v, s)
    check({"x": _f64(a[0])}, {"x": want_v}, "merge_states", "f32")
    check({"x": _f64(a[1])}, {"x": want_s}, "merge_states", "f32")


def test_bad_input_names_the_argument() -> None:
    v = np.zeros((2, 3, 8), np.float32)
    s = np.zeros((2, 3), np.float32)
    with pytest.raises(ArgumentError, match=r"v_a: expected a 3-D array \(seq_len, num_heads, head_dim\)"):
        ops.merge_state(v[0], s, v, s, backend=HOST)
    with pytest.raises(ArgumentError, match=r"s_b: expected shape \(2, 3\)"):
        ops.merge_state(v, s, v, s[:, :2], backend=HOST)
    with pytest.raises(ArgumentTypeError, match="s_a: expected dtype float32"):
        ops.merge_state(v, s.astype(np.float64), v, s, backend=HOST)
    with pytest.raises(ArgumentTypeError, match="v_b: expected the dtype of v_a"):
        ops.merge_state(v, s, v.astype(np.float16), s, backend=HOST)
    with pytest.raises(ArgumentError, match="v_b: expected the shape of v_a"):
        ops.merge_state(v, s, v[:1], s[:1], backend=HOST)
    with pytest.raises(ArgumentError, match=r"mask: expected shape \(2,\)"):
        ops.merge_state_in_place(v, s, v, s, np.ones(3, bool), backend=HOST)
    with pytest.raises(ArgumentTypeError, match="mask: expected dtype bool or uint8"):
        ops.merge_state_in_place(v, s, v, s, np.ones(2, np.int32), backend=HOST)
    with pytest.raises(ArgumentError, match="v: expected"):
        ops.merge_state_in_place(v[:, :, ::2], s, v[:, :, :4], s, backend=HOST)  # strided: cannot write in place
    with pytest.raises(ArgumentError, match=r"v: expected a 4-D array \(seq_len, num_states, num_heads, head_dim\)"):
        ops.merge_states(v, s, backend=HOST)
    with pytest.raises(ArgumentError, match="num_states >= 1"):
        ops.merge_states(np.zeros((2, 0, 3, 8), np.float32), np.zeros((2, 0, 3), np.float32), backend=HOST)


def test_empty_batch_launches_nothing() -> None:
    o, s = ops.merge_state(np.zeros((0, 2, 8), np.float32), np.zeros((0, 2), np.float32),
                           np.zeros((0, 2, 8), np.float32), np.zeros((0, 2), np.float32), backend=HOST)
    assert o.shape == (0, 2, 8) and s.shape == (0, 2)
