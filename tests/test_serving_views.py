"""Serving ops on views: in-place writes go through the caller's view or raise naming the argument.

FlashInfer's combined cache (pages, 2, page_size, heads, dim) ("NHD") / (pages, 2, heads, page_size, dim)
("HND") reaches the kernels as cache[:, 0] / cache[:, 1] with its page stride (64-bit element strides),
as a (k, v) pair, or as the single 5-D array; NumPy views and CPU torch tensors on the host backend.
A stride pattern the kernels cannot address (head_dim not unit-stride, K and V of different strides)
raises naming the argument, as does a non-contiguous out=.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_helpers import need as _need  # noqa: E402
from pykern import ArgumentError, ops  # noqa: E402
from pykern.difftest.cases.serving import make_paged, make_q, np_ragged_attention  # noqa: E402
from pykern.tolerance import tolerance  # noqa: E402

PS, KVH, H, D = 4, 2, 8, 32


def _combined(pc: dict, layout: str) -> np.ndarray:
    """FlashInfer's one-array cache holding make_paged's pages, K at [:, 0] and V at [:, 1]."""
    return np.ascontiguousarray(np.stack([pc["k_pages"], pc["v_pages"]], axis=1))


def _close(out, ref, op: str = "paged_decode_attention") -> None:
    atol, rtol = tolerance(op, "f32")
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=atol, rtol=rtol)


def _table(pc: dict) -> tuple:
    return pc["kv_indptr"], pc["kv_indices"], pc["kv_last_page_len"]


def _blank_and_new(pc: dict, old: list[int], final: list[int], layout: str):
    """Zero the slots of tokens old..final of each sequence in pc's pages; return their K, V and indices."""
    kp = pc["k_pages"] if layout == "NHD" else pc["k_pages"].transpose(0, 2, 1, 3)
    vp = pc["v_pages"] if layout == "NHD" else pc["v_pages"].transpose(0, 2, 1, 3)
    want_k, want_v = pc["k_pages"].copy(), pc["v_pages"].copy()
    for b, o in enumerate(old):
        for t in range(o, final[b]):
            pg = pc["kv_indices"][pc["kv_indptr"][b] + t // PS]
            kp[pg, t % PS] = 0
            vp[pg, t % PS] = 0
    app = np.concatenate([[0], np.cumsum([f - o for o, f in zip(old, final)])])
    bi, pos = ops.get_batch_indices_positions(app, final, int(app[-1]))
    kn = np.concatenate([pc["ks"][b][o:] for b, o in enumerate(old)]).astype(np.float32)
    vn = np.concatenate([pc["vs"][b][o:] for b, o in enumerate(old)]).astype(np.float32)
    return want_k, want_v, kn, vn, bi, pos


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["views", "pair", "single"])
def test_numpy_combined_cache_append_writes_through_and_decode_reads_it(layout: str, form: str) -> None:
    _need("host")
    rng = np.random.default_rng(1)
    old, final = [3, 0, 9], [5, 2, 10]
    pc = make_paged(rng, final, PS, KVH, D, layout)
    want_k, want_v, kn, vn, bi, pos = _blank_and_new(pc, old, final, layout)
    cache = _combined(pc, layout)
    assert not np.array_equal(np.nan_to_num(cache[:, 0]), np.nan_to_num(want_k))
    if form == "views":
        ops.append_paged_kv_cache(kn, vn, bi, pos, cache[:, 0], cache[:, 1], pc["kv_indices"], pc["kv_indptr"],
                                  pc["kv_last_page_len"], kv_layout=layout, backend="host")
    else:
        arg = (cache[:, 0], cache[:, 1]) if form == "pair" else cache
        # FlashInfer's positional order: paged_kv_cache, kv_indices, kv_indptr, kv_last_page_len
        ops.append_paged_kv_cache(kn, vn, bi, pos, arg, pc["kv_indices"], pc["kv_indptr"], pc["kv_last_page_len"],
                                  kv_layout=layout, backend="host")
    np.testing.assert_array_equal(cache[:, 0], want_k)  # NaN where no sequence is: equal_nan by default
    np.testing.assert_array_equal(cache[:, 1], want_v)

    q = make_q(rng, (len(final), H, D))
    ref, _ = np_ragged_attention(q.astype(np.float64), np.arange(len(final) + 1), pc["ks"], pc["vs"])
    if form == "views":
        out = ops.paged_decode_attention(q, cache[:, 0], cache[:, 1], *_table(pc), kv_layout=layout, backend="host")
    else:
        arg = (cache[:, 0], cache[:, 1]) if form == "pair" else cache
        out = ops.paged_decode_attention(q, arg, *_table(pc), kv_layout=layout, backend="host")
    _close(out, ref)
    contiguous = ops.paged_decode_attention(q, want_k, want_v, *_table(pc), kv_layout=layout, backend="host")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(contiguous))  # same kernel, same bits
    # split-KV through a plan and paged prefill read the same views
    plan = ops.PagedDecodePlan(len(final), H, KVH, D, PS, kv_layout=layout, num_splits=3)
    _close(plan.run(q, cache[:, 0], cache[:, 1], *_table(pc), backend="host"), ref)
    qo = np.arange(len(final) + 1, dtype=np.int32)
    pre = ops.paged_prefill_attention(q, qo, cache[:, 0], cache[:, 1], *_table(pc), kv_layout=layout,
                                      backend="host")
    _close(pre, ref, "paged_prefill_attention")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_torch_combined_cache_views_are_written_through(layout: str) -> None:
    _need("host")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    old, final = [1, 6], [4, 7]
    pc = make_paged(rng, final, PS, KVH, D, layout)
    want_k, want_v, kn, vn, bi, pos = _blank_and_new(pc, old, final, layout)
    cache = torch.from_numpy(_combined(pc, layout))
    kv, vv = cache[:, 0], cache[:, 1]
    assert not kv.is_contiguous()
    t = torch.from_numpy
    ops.append_paged_kv_cache(t(kn), t(vn), t(bi), t(pos), kv, vv, t(pc["kv_indices"]), t(pc["kv_indptr"]),
                              t(pc["kv_last_page_len"]), kv_layout=layout, backend="host")
    np.testing.assert_array_equal(cache[:, 0].numpy(), want_k)
    np.testing.assert_array_equal(cache[:, 1].numpy(), want_v)
    q = t(make_q(rng, (len(final), H, D)))
    ref, _ = np_ragged_attention(q.numpy().astype(np.float64), np.arange(len(final) + 1), pc["ks"], pc["vs"])
    out = ops.paged_decode_attention(q, cache, t(pc["kv_indptr"]), t(pc["kv_indices"]), t(pc["kv_last_page_len"]),
                                     kv_layout=layout, backend="host")
    assert isinstance(out, torch.Tensor)
    _close(out.numpy(), ref)


def test_unsupported_strides_raise_naming_the_argument() -> None:
    _need("host")
    rng = np.random.default_rng(3)
    pc = make_paged(rng, [5, 3], PS, KVH, D)
    q = make_q(rng, (2, H, D))
    kn = np.zeros((1, KVH, D), np.float32)
    bi, pos = np.zeros(1, np.int32), np.zeros(1, np.int32)
    # head_dim with stride 2: the kernels need unit-stride rows
    wide_k = np.zeros(pc["k_pages"].shape[:3] + (2 * D,), np.float32)
    wide_v = wide_k.copy()
    with pytest.raises(ArgumentError, match="k_pages: expected head_dim .* unit stride"):
        ops.append_paged_kv_cache(kn, kn, bi, pos, wide_k[..., ::2], wide_v[..., ::2], pc["kv_indices"],
                                  pc["kv_indptr"], pc["kv_last_page_len"], backend="host")
    assert not wide_k.any()  # nothing was written
    with pytest.raises(ArgumentError, match="k_pages: expected head_dim .* unit stride"):
        ops.paged_decode_attention(q, wide_k[..., ::2], wide_v[..., ::2], *_table(pc), backend="host")
    # K and V of different strides
    cache = _combined(pc, "NHD")
    with pytest.raises(ArgumentError, match="v_pages: expected the strides of k_pages"):
        ops.paged_decode_attention(q, cache[:, 0], pc["v_pages"], *_table(pc), backend="host")
    # read-only destination
    ro = pc["k_pages"].copy()
    ro.flags.writeable = False
    with pytest.raises(ArgumentError, match="k_pages: the op writes into it but the array is read-only"):
        ops.append_paged_kv_cache(kn, kn, bi, pos, ro, pc["v_pages"].copy(), pc["kv_indices"], pc["kv_indptr"],
                                  pc["kv_last_page_len"], backend="host")
    # a combined cache whose second dimension is not K/V
    with pytest.raises(ArgumentError, match=r"k_pages \(paged_kv_cache\): expected"):
        ops.paged_decode_attention(q, np.zeros((3, 3, PS, KVH, D), np.float32), *_table(pc), backend="host")
    # a combined cache followed by one argument too many
    with pytest.raises(ArgumentError, match="kv_last_page_len: with a combined paged_kv_cache"):
        ops.paged_decode_attention(q, cache, *_table(pc), pc["kv_last_page_len"], backend="host")


def test_strided_out_raises_naming_out() -> None:
    _need("host")
    rng = np.random.default_rng(4)
    pc = make_paged(rng, [5, 3], PS, KVH, D)
    q = make_q(rng, (2, H, D))
    bad = np.zeros((2, H, 2 * D), np.float32)[..., ::2]
    with pytest.raises(ArgumentError, match="out: expected a C-contiguous"):
        ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], *_table(pc), out=bad, backend="host")
    with pytest.raises(ArgumentError, match="out: expected a C-contiguous"):
        ops.paged_prefill_attention(q, np.arange(3, dtype=np.int32), pc["k_pages"], pc["v_pages"], *_table(pc),
                                    out=bad, backend="host")
    assert not bad.any()
    kc = np.zeros((KVH, 16, D), np.float32)
    with pytest.raises(ArgumentError, match="out: expected a C-contiguous"):
        ops.decode_attention(q[0], kc, kc, 3, out=bad[0], backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match="out: expected a C-contiguous"):
        ops.batched_decode_attention(q, np.stack([kc, kc]), np.stack([kc, kc]), [3, 4], out=bad, backend="host",
                                     kv_layout="HND")
    # a contiguous out is written and returned
    good = np.zeros((2, H, D), np.float32)
    res = ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], *_table(pc), out=good, backend="host")
    assert res is good
    ref, _ = np_ragged_attention(q.astype(np.float64), np.arange(3), pc["ks"], pc["vs"])
    _close(good, ref)
