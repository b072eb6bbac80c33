"""Serving attention: paged KV cache with FlashInfer's conventions, KV append,
paged decode (plan/run, split-KV + merge), paged prefill and flash-attn varlen, all on the
host backend against float64 NumPy, with shuffled non-contiguous page tables and NaN in
every cache slot no sequence owns."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_helpers import need as _need  # noqa: E402
from pykern import ArgumentError, ArgumentTypeError, arrays, ops  # noqa: E402
from pykern.difftest.cases.decode import make_inputs, np_batched_decode_attention, to_nhd  # noqa: E402
from pykern.difftest.cases.serving import make_paged, make_q, np_attention, np_ragged_attention  # noqa: E402
from family_helpers import close_attention as _close  # noqa: E402


def _decode(pc, q, layout="NHD", **kw):
    return ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                      pc["kv_last_page_len"], kv_layout=layout, return_lse=True, backend="host", **kw)


def _ref_decode(pc, q):
    return np_ragged_attention(q.astype(np.float64), np.arange(q.shape[0] + 1), pc["ks"], pc["vs"])


# --------------------------------------------------------------------------- NumPy reference
def test_numpy_reference_is_softmax_and_bottom_right_causal() -> None:
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 2, 4)), rng.standard_normal((5, 1, 4)), rng.standard_normal((5, 1, 4))
    out, lse = np_attention(q, k, v, causal=True)
    for i in range(3):
        vis = 5 - 3 + i + 1  # the last 3 tokens: query i is key position 2 + i
        s = k[:vis, 0] @ q[i, 1] / 2.0
        p = np.exp(s) / np.exp(s).sum()
        np.testing.assert_allclose(out[i, 1], p @ v[:vis, 0], rtol=1e-12)
        np.testing.assert_allclose(lse[i, 1], np.log(np.exp(s).sum()), rtol=1e-12)
    out, lse = np_attention(q, k[:2], v[:2], causal=True)  # 3 queries, 2 keys: query 0 sees nothing
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all() and np.isfinite(lse[1:]).all()


def test_make_paged_is_shuffled_and_nan_outside_the_sequences() -> None:
    pc = make_paged(np.random.default_rng(1), [7, 0, 13], 5, 2, 8)
    assert list(pc["kv_indptr"]) == [0, 2, 2, 5]
    assert list(pc["kv_last_page_len"][[0, 2]]) == [2, 3]
    assert sorted(pc["kv_indices"]) != list(pc["kv_indices"])  # out of order
    owned = np.zeros(pc["k_pages"].shape[:2], bool)
    for b, n in enumerate([7, 0, 13]):
        for t in range(n):
            owned[pc["kv_indices"][pc["kv_indptr"][b] + t // 5], t % 5] = True
    assert np.isnan(pc["k_pages"][~owned]).all() and not np.isnan(pc["k_pages"][owned]).any()


# --------------------------------------------------------------------------- paged decode
@pytest.mark.parametrize("page_size", [1, 16, 5])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (8, 2), (8, 1)])
def test_paged_decode_matches_numpy(page_size: int, layout: str, heads: tuple[int, int]) -> None:
    _need("host")
    h, kvh = heads
    rng = np.random.default_rng(page_size * 100 + h * 10 + kvh)
    lens = [int(x) for x in rng.integers(1, 40, 3)] + [0]
    pc = make_paged(rng, lens, page_size, kvh, 32, layout)
    q = make_q(rng, (len(lens), h, 32))
    out, lse = _decode(pc, q, layout)
    ro, rl = _ref_decode(pc, q)
    _close(out, ro, "paged_decode_attention", "f32")
    _close(lse, rl, "paged_decode_attention", "f32")
    assert (out[-1] == 0).all() and np.isneginf(lse[-1]).all()  # the empty sequence


@pytest.mark.parametrize("page_size", [5, 16])
def test_every_last_page_len(page_size: int) -> None:
    # Sequences of 1 and 2 pages ending at every fill level 1..page_size of their last page.
    _need("host")
    rng = np.random.default_rng(page_size)
    lens = [npg * page_size + last for npg in (0, 1) for last in range(1, page_size + 1)]
    pc = make_paged(rng, lens, page_size, 1, 16, "HND")
    assert sorted(set(pc["kv_last_page_len"].tolist())) == list(range(1, page_size + 1))
    q = make_q(rng, (len(lens), 2, 16))
    out, lse = _decode(pc, q, "HND")
    ro, rl = _ref_decode(pc, q)
    _close(out, ro, "paged_decode_attention", "f32")
    _close(lse, rl, "paged_decode_attention", "f32")


@pytest.mark.parametrize("kinds", [("bf16", "bf16"), ("f32", "bf16")])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_decode_bf16(kinds: tuple[str, str], layout: str) -> None:
    _need("host")
    rng = np.random.default_rng(7)
    pc = make_paged(rng, [21, 0, 40], 5, 2, 64, layout, kinds[1])
    q = make_q(rng, (3, 8, 64), kinds[0])
    out, lse = _decode(pc, q, layout)
    assert out.dtype == q.dtype
    ro, rl = _ref_decode(pc, q)
    _close(out, ro, "paged_decode_attention", "bf16")
    _close(lse, rl, "paged_decode_attention", "bf16")


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_split_kv_merge_matches(num_splits: int, schedule: str, monkeypatch) -> None:
    _need("host")
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    rng = np.random.default_rng(num_splits)
    lens = [70, 0, 3, 33]  # some splits of the short sequences see nothing (lse -inf partials)
    pc = make_paged(rng, lens, 16, 2, 48)
    q = make_q(rng, (4, 8, 48))
    plan = ops.PagedDecodePlan(4, 8, 2, 48, 16, num_splits=num_splits)
    assert len(plan.launches()) == (2 if num_splits > 1 else 1)
    out, lse = _decode(pc, q, plan=plan)
    ro, rl = _ref_decode(pc, q)
    _close(out, ro, "paged_decode_attention", "f32")
    _close(lse, rl, "paged_decode_attention", "f32")


def test_head_dim_256_and_odd_head_dims() -> None:
    _need("host")
    for d, kind in ((256, "f32"), (80, "bf16"), (33, "f32"), (8, "bf16")):
        rng = np.random.default_rng(d)
        pc = make_paged(rng, [9, 17], 5, 1, d, "NHD", kind)
        q = make_q(rng, (2, 4, d), kind)
        out, lse = _decode(pc, q)
        ro, rl = _ref_decode(pc, q)
        _close(out, ro, "paged_decode_attention", kind)


def test_default_plan_geometry() -> None:
    # LLaMA-8B heads: 4 query heads per kv head in one CTA; batch 1 splits to fill 132 SMs.
    p1 = ops.PagedDecodePlan(1, 32, 8, 128, 16, max_kv_len=4096)
    assert p1.rows == 4 and p1.row_chunks == 1 and p1.grid == (8, 1, 32)  # min(33 for 2 waves, cap 32)
    assert ops.PagedDecodePlan(1, 32, 8, 128, 16, max_kv_len=100).num_splits == 2  # >= 64 positions a split
    assert [name for name, *_ in p1.launches()] == ["paged_attn", "paged_attn_merge"]
    p64 = ops.PagedDecodePlan(64, 32, 8, 128, 16, max_kv_len=4096)
    assert p64.grid == (512, 1, 1) and len(p64.launches()) == 1  # 512 CTAs: no split
    p70 = ops.PagedDecodePlan(1, 64, 8, 128, 16)  # 70B: group 8 still one CTA per kv head
    assert p70.rows == 8 and p70.row_chunks == 1 and p70.grid == (8, 1, 32)
    assert p70.smem <= 48 * 1024


def test_planned_run_allocates_nothing(monkeypatch) -> None:
    _need("host")
    rng = np.random.default_rng(3)
    pc = make_paged(rng, [30, 5], 16, 2, 32)
    q = make_q(rng, (2, 4, 32))
    plan = ops.PagedDecodePlan(2, 4, 2, 32, 16, num_splits=3, return_lse=True)
    calls = []
    real_empty, real_zeros = arrays.empty, arrays.zeros
    monkeypatch.setattr(arrays, "empty", lambda *a, **k: calls.append(a) or real_empty(*a, **k))
    monkeypatch.setattr(arrays, "zeros", lambda *a, **k: calls.append(a) or real_zeros(*a, **k))
    out1, lse1 = plan.run(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                          pc["kv_last_page_len"], backend="host")
    first = out1.copy()
    out2, _ = ops.paged_decode_attention(q * 2, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                         pc["kv_last_page_len"], plan=plan, return_lse=True, backend="host")
    assert calls == []  # neither step allocated an output or workspace
    assert out2 is out1 and out1 is plan.out  # the plan's own buffers, overwritten by each step
    assert not np.array_equal(first, out2)
    ro, _ = _ref_decode(pc, q * 2)
    _close(out2, ro, "paged_decode_attention", "f32")
    # the unplanned form does allocate (a plan per call): the counter sees it
    ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                               pc["kv_last_page_len"], backend="host")
    assert calls


def test_plan_rejects_a_different_shape() -> None:
    rng = np.random.default_rng(4)
    pc = make_paged(rng, [3, 5], 16, 2, 32)
    plan = ops.PagedDecodePlan(3, 4, 2, 32, 16)
    with pytest.raises(ArgumentError, match="q: expected"):
        plan.run(make_q(rng, (2, 4, 32)), pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                 pc["kv_last_page_len"], backend="host")
    plan = ops.PagedDecodePlan(2, 4, 2, 32, 8)
    with pytest.raises(ArgumentError, match="k_pages: expected .*page_size=8"):
        plan.run(make_q(rng, (2, 4, 32)), pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                 pc["kv_last_page_len"], backend="host")


# --------------------------------------------------------------------------- append, then decode
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_append_then_decode_equals_contiguous_decode(layout: str, kind: str) -> None:
    """Prefill-append 0..6 tokens per sequence, then three 1-token decode steps, all through
    append_paged_kv_cache into a shuffled page pool; each step's paged decode equals
    decode_attention on the same tokens held contiguously."""
    _need("host")
    rng = np.random.default_rng(11)
    ps, kvh, h, d, batch = 5, 2, 8, 32, 3
    total = 10
    k_all = make_q(rng, (batch, total, kvh, d), kind)
    v_all = make_q(rng, (batch, total, kvh, d), kind)
    npages = 2 * batch + 2
    shape = (npages, ps, kvh, d) if layout == "NHD" else (npages, kvh, ps, d)
    dt = np.float32 if kind == "f32" else arrays.bfloat16()
    k_pages = np.full(shape, np.nan, np.float32).astype(dt)
    v_pages = k_pages.copy()
    pool = [int(p) for p in rng.permutation(npages)]
    owned: list[list[int]] = [[] for _ in range(batch)]
    lens = [0] * batch
    prefill = [6, 0, 4]

    def grow(new: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        for b in range(batch):
            lens[b] += new[b]
            while len(owned[b]) * ps < lens[b]:
                owned[b].append(pool.pop())
        indptr = np.concatenate([[0], np.cumsum([len(o) for o in owned])]).astype(np.int64)  # int64 accepted
        indices = np.array([p for o in owned for p in o], np.int64)
        last = np.array([n - (len(o) - 1) * ps if n else 0 for n, o in zip(lens, owned)], np.int32)
        return indptr, indices, last

    for step, new in enumerate([prefill, [1, 1, 1], [1, 1, 1], [1, 0, 1]]):
        old = list(lens)
        indptr, indices, last = grow(new)
        app = np.concatenate([[0], np.cumsum(new)])
        bi, pos = ops.get_batch_indices_positions(app, lens, int(app[-1]))
        kn = np.concatenate([k_all[b, old[b]:lens[b]] for b in range(batch)])
        vn = np.concatenate([v_all[b, old[b]:lens[b]] for b in range(batch)])
        ops.append_paged_kv_cache(kn, vn, bi, pos, k_pages, v_pages, indices, indptr, last, kv_layout=layout,
                                  backend="host")
        if step == 0:
            continue
        q = make_q(rng, (batch, h, d), kind)
        paged = ops.paged_decode_attention(q, k_pages, v_pages, indptr, indices, last, kv_layout=layout,
                                           backend="host")
        # the same tokens contiguously: NHD (M, S, KVH, D) caches, NaN past each length
        kc = np.full((batch, total, kvh, d), np.nan, np.float32).astype(dt)
        vc = kc.copy()
        for b in range(batch):
            kc[b, :lens[b]] = k_all[b, :lens[b]]
            vc[b, :lens[b]] = v_all[b, :lens[b]]
        contig = ops.batched_decode_attention(q, kc, vc, np.array(lens, np.uint32), kv_layout="NHD",
                                              method="warp", backend="host")
        np.testing.assert_allclose(np.asarray(paged, np.float64), np.asarray(contig, np.float64), rtol=1e-6,
                                   atol=1e-6 if kind == "f32" else 8e-3)
        ref = np_batched_decode_attention(q.astype(np.float64), np.swapaxes(kc, 1, 2).astype(np.float64),
                                          np.swapaxes(vc, 1, 2).astype(np.float64), lens)
        _close(paged, ref, "paged_decode_attention", kind)


def test_append_writes_only_its_slots() -> None:
    _need("host")
    rng = np.random.default_rng(12)
    pc = make_paged(rng, [7, 3], 4, 2, 16, "HND")
    before_k = pc["k_pages"].copy()
    k = make_q(rng, (2, 2, 16))
    v = make_q(rng, (2, 2, 16))
    ops.append_paged_kv_cache(k, v, np.array([0, 1]), np.array([6, 0]), pc["k_pages"], pc["v_pages"],
                              pc["kv_indices"], pc["kv_indptr"], pc["kv_last_page_len"], kv_layout="HND",
                              backend="host")
    p0 = pc["kv_indices"][pc["kv_indptr"][0] + 1]
    p1 = pc["kv_indices"][pc["kv_indptr"][1]]
    np.testing.assert_array_equal(pc["k_pages"][p0, :, 2], k[0])
    np.testing.assert_array_equal(pc["v_pages"][p1, :, 0], v[1])
    changed = ~((pc["k_pages"] == before_k) | (np.isnan(pc["k_pages"]) & np.isnan(before_k)))
    assert changed.sum() == 2 * 2 * 16


# --------------------------------------------------------------------------- prefill and varlen
def _flash_per_sequence(q, ks, vs, qo, causal):
    outs = []
    for b in range(len(ks)):
        qb = q[qo[b]:qo[b + 1]]
        if qb.shape[0] == 0:
            continue
        if ks[b].shape[0] == 0:
            outs.append(np.zeros(qb.shape, np.float32))
            continue
        o = ops.flash_attention(qb[None], ks[b][None], vs[b][None], causal=causal, backend="host")
        outs.append(np.asarray(o[0], np.float32))
    return np.concatenate(outs)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_prefill_equals_per_sequence_flash_attention(layout: str, causal: bool) -> None:
    _need("host")
    rng = np.random.default_rng(21)
    kv_lens, qo_lens = [9, 0, 17, 6], [3, 0, 17, 1]  # chunked prefill, a full prefill, a decode row
    pc = make_paged(rng, kv_lens, 5, 2, 32, layout)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = make_q(rng, (int(qo[-1]), 8, 32))
    out, lse = ops.paged_prefill_attention(q, qo, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                           pc["kv_last_page_len"], causal=causal, kv_layout=layout,
                                           return_lse=True, backend="host")
    ro, rl = np_ragged_attention(q.astype(np.float64), qo, pc["ks"], pc["vs"], causal)
    _close(out, ro, "paged_prefill_attention", "f32")
    _close(lse, rl, "paged_prefill_attention", "f32")
    ks = [k.astype(np.float32) for k in pc["ks"]]
    vs = [v.astype(np.float32) for v in pc["vs"]]
    np.testing.assert_allclose(out, _flash_per_sequence(q, ks, vs, qo, causal), rtol=1e-5, atol=2e-6)


def test_paged_prefill_bf16_and_long_query_chunks() -> None:
    # 40 queries x group 2 = 80 packed rows: several row chunks of one sequence.
    _need("host")
    rng = np.random.default_rng(22)
    pc = make_paged(rng, [45, 12], 16, 2, 64, "NHD", "bf16")
    qo = np.array([0, 40, 52], np.int32)
    q = make_q(rng, (52, 4, 64), "bf16")
    out = ops.paged_prefill_attention(q, qo, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                      pc["kv_last_page_len"], backend="host")
    ro, _ = np_ragged_attention(q.astype(np.float64), qo, pc["ks"], pc["vs"], True)
    _close(out, ro, "paged_prefill_attention", "bf16")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kinds", [("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16")])
def test_varlen_equals_per_sequence_flash_attention(causal: bool, kinds: tuple[str, str]) -> None:
    _need("host")
    rng = np.random.default_rng(31)
    k_lens, q_lens = [10, 0, 23, 4], [4, 0, 23, 6]  # the last: more queries than keys (bottom-right)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)])
    cu_k = np.concatenate([[0], np.cumsum(k_lens)])
    q = make_q(rng, (int(cu_q[-1]), 4, 32), kinds[0])
    k = make_q(rng, (int(cu_k[-1]), 2, 32), kinds[1])
    v = make_q(rng, (int(cu_k[-1]), 2, 32), kinds[1])
    out, lse = ops.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, backend="host")
    ks = [k[cu_k[b]:cu_k[b + 1]].astype(np.float64) for b in range(4)]
    vs = [v[cu_k[b]:cu_k[b + 1]].astype(np.float64) for b in range(4)]
    ro, rl = np_ragged_attention(q.astype(np.float64), cu_q, ks, vs, causal)
    dtype = "f32" if kinds == ("f32", "f32") else "bf16"
    _close(out, ro, "flash_attention_varlen", dtype)
    _close(lse, rl, "flash_attention_varlen", dtype)
    if kinds[0] == kinds[1]:
        ref = _flash_per_sequence(q, [k[cu_k[b]:cu_k[b + 1]] for b in range(4)],
                                  [v[cu_k[b]:cu_k[b + 1]] for b in range(4)], cu_q, causal)
        tol = (1e-5, 2e-6) if dtype == "f32" else (2e-2, 2e-2)
        np.testing.assert_allclose(np.asarray(out, np.float32), ref.astype(np.float32), rtol=tol[0], atol=tol[1])


# --------------------------------------------------------------------------- contiguous decode layouts
@pytest.mark.parametrize("method", ["warp", "multi_warp", "split_k"])
def test_contiguous_decode_nhd_equals_hnd(method: str) -> None:
    _need("host")
    q, k, v = make_inputs(np.random.default_rng(41), 3, 8, 2, 48, 90, [90, 0, 41])
    a = ops.batched_decode_attention(q, k, v, [90, 0, 41], method=method, backend="host", kv_layout="HND")
    b = ops.batched_decode_attention(q, to_nhd(k), to_nhd(v), [90, 0, 41], kv_layout="NHD", method=method,
                                     backend="host")
    np.testing.assert_array_equal(a, b)
    ref = np_batched_decode_attention(q, k, v, [90, 0, 41])
    _close(a, ref, "batched_decode_attention", "f32")
    qs = q[0]
    c = ops.decode_attention(qs, to_nhd(k[0]), to_nhd(v[0]), 90, kv_layout="NHD", method=method, backend="host")
    _close(c, ref[0], "decode_attention", "f32")


def test_nhd_cache_passed_as_hnd_is_named() -> None:
    q = np.zeros((8, 64), np.float32)
    k = np.zeros((256, 2, 64), np.float32)  # (S, KVH, D): NHD
    with pytest.raises(ArgumentError, match="num_kv_heads=256.*NHD"):
        ops.decode_attention(q, k, k, 3, backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match="kv_layout"):
        ops.decode_attention(q, k, k, 3, kv_layout="nhd", backend="host")


# --------------------------------------------------------------------------- validation
def _bad_table_cases():
    ok = {"kv_indptr": np.array([0, 2, 3]), "kv_indices": np.array([4, 0, 2]), "kv_last_page_len": np.array([3, 5])}
    yield dict(ok, kv_indptr=np.array([0, 3, 2])), "kv_indptr: expected a non-decreasing"
    yield dict(ok, kv_indptr=np.array([0, 2, 4])), r"kv_indptr: expected kv_indptr\[-1\] <= len\(kv_indices\)=3"
    yield dict(ok, kv_indices=np.array([4, 0, 6])), r"kv_indices: expected page indices in \[0, 6\).*got 6"
    yield dict(ok, kv_indices=np.array([4, -1, 2])), "kv_indices: .* got -1"
    yield dict(ok, kv_last_page_len=np.array([0, 5])), r"kv_last_page_len: .*kv_last_page_len\[0\]=0"
    yield dict(ok, kv_last_page_len=np.array([3, 6])), r"kv_last_page_len: .*page_size=5.*\[1\]=6"
    yield dict(ok, kv_last_page_len=np.array([3, 5, 1])), r"kv_last_page_len: expected shape \(2,\)"
    yield dict(ok, kv_indices=np.array([4.0, 0, 2])), "kv_indices: expected an integer array"


@pytest.mark.parametrize("table, pattern", list(_bad_table_cases()))
def test_bad_page_tables_name_the_argument(table, pattern) -> None:
    q = np.zeros((2, 4, 8), np.float32)
    pages = np.zeros((6, 5, 2, 8), np.float32)
    with pytest.raises((ArgumentError, ArgumentTypeError), match=pattern):
        ops.paged_decode_attention(q, pages, pages, table["kv_indptr"], table["kv_indices"],
                                   table["kv_last_page_len"], backend="host")


def test_empty_sequence_last_page_len_is_ignored_and_any_int_dtype_accepted() -> None:
    _need("host")
    rng = np.random.default_rng(50)
    pc = make_paged(rng, [0, 6], 4, 1, 8)
    q = make_q(rng, (2, 2, 8))
    last = pc["kv_last_page_len"].astype(np.uint8)
    last[0] = 0
    out = ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"].astype(np.int16),
                                     pc["kv_indices"].astype(np.uint64), last, backend="host")
    ro, _ = _ref_decode(pc, q)
    _close(out, ro, "paged_decode_attention", "f32")


def test_other_argument_errors() -> None:
    q = np.zeros((2, 4, 8), np.float32)
    pages = np.zeros((6, 5, 2, 8), np.float32)
    ip, ix, last = np.array([0, 1, 2]), np.array([0, 1]), np.array([1, 1])
    with pytest.raises(ArgumentError, match="kv_layout"):
        ops.paged_decode_attention(q, pages, pages, ip, ix, last, kv_layout="NDH")
    with pytest.raises(ArgumentError,
                       match=r"q: expected shape \(batch, num_heads, 8\) \(head_dim 8 from the K/V\), got \(2, 4, 4\)"):
        ops.paged_decode_attention(q[..., :4], pages, pages, ip, ix, last)
    with pytest.raises(ArgumentError, match="q: expected num_heads a multiple of num_kv_heads=2"):
        ops.paged_decode_attention(q[:, :3], pages, pages, ip, ix, last)
    with pytest.raises(ArgumentError, match="v_pages: expected the shape"):
        ops.paged_decode_attention(q, pages, pages[:3], ip, ix, last)
    with pytest.raises(ArgumentTypeError, match="q: a bfloat16 query needs bfloat16"):
        ops.paged_decode_attention(q.astype(arrays.bfloat16()), pages, pages, ip, ix, last)
    with pytest.raises(ArgumentError, match=r"kv_indptr: expected shape \(3,\)"):
        ops.paged_decode_attention(q, pages, pages, np.array([0, 1]), ix, last)
    # prefill / varlen
    with pytest.raises(ArgumentError, match=r"qo_indptr: expected qo_indptr\[0\] == 0 and qo_indptr\[-1\] == total_q"):
        ops.paged_prefill_attention(q, np.array([0, 1, 1]), pages, pages, ip, ix, last)
    k = np.zeros((5, 2, 8), np.float32)
    with pytest.raises(ArgumentError, match=r"cu_seqlens_k: expected cu_seqlens_k\[-1\] <= total_k=5"):
        ops.flash_attention_varlen(q, k, k, np.array([0, 1, 2]), np.array([0, 3, 6]))
    with pytest.raises(ArgumentError, match=r"cu_seqlens_k: expected shape \(3,\)"):
        ops.flash_attention_varlen(q, k, k, np.array([0, 1, 2]), np.array([0, 5]))
    # append
    kv = np.zeros((2, 2, 8), np.float32)
    with pytest.raises(ArgumentError, match="positions: expected positions.*positions\\[1\\]=1 for sequence 1"):
        ops.append_paged_kv_cache(kv, kv, np.array([0, 1]), np.array([0, 1]), pages, pages, ix, ip, last)
    with pytest.raises(ArgumentError, match=r"batch_indices: expected values in \[0, 2\)"):
        ops.append_paged_kv_cache(kv, kv, np.array([0, 2]), np.array([0, 0]), pages, pages, ix, ip, last)
    with pytest.raises(ArgumentError, match=r"k: expected shape \(nnz, 2, 8\)"):
        ops.append_paged_kv_cache(kv[:, :1], kv, np.array([0, 1]), np.array([0, 0]), pages, pages, ix, ip, last)
    with pytest.raises(ArgumentTypeError, match="k: expected the dtype of k_pages"):
        ops.append_paged_kv_cache(kv.astype(arrays.bfloat16()), kv, np.array([0, 1]), np.array([0, 0]), pages,
                                  pages, ix, ip, last)


# --------------------------------------------------------------------------- numba references
def test_numba_references_agree() -> None:
    _need("numba")
    rng = np.random.default_rng(60)
    pc = make_paged(rng, [13, 0, 4], 5, 1, 16, "HND")
    q = make_q(rng, (3, 2, 16))
    plan = ops.PagedDecodePlan(3, 2, 1, 16, 5, kv_layout="HND", num_splits=2)
    out, lse = ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                          pc["kv_last_page_len"], kv_layout="HND", plan=plan, return_lse=True,
                                          backend="numba")
    ro, rl = _ref_decode(pc, q)
    _close(out, ro, "paged_decode_attention", "f32")
    _close(lse, rl, "paged_decode_attention", "f32")


# --------------------------------------------------------------------------- torch tensors
def test_torch_cpu_tensors_in_and_out() -> None:
    _need("host")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(70)
    pc = make_paged(rng, [11, 0, 6], 4, 2, 16, "NHD", "bf16")
    q = make_q(rng, (3, 4, 16), "bf16")
    tq = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16)
    tk = torch.from_numpy(pc["k_pages"].view(np.int16)).view(torch.bfloat16)
    tv = torch.from_numpy(pc["v_pages"].view(np.int16)).view(torch.bfloat16)
    out, lse = ops.paged_decode_attention(tq, tk, tv, torch.from_numpy(pc["kv_indptr"]).long(),
                                          torch.from_numpy(pc["kv_indices"]), torch.from_numpy(pc["kv_last_page_len"]),
                                          return_lse=True, backend="host")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and isinstance(lse, torch.Tensor)
    ro, rl = _ref_decode(pc, q)
    _close(out.float().numpy(), ro, "paged_decode_attention", "bf16")
    _close(lse.numpy(), rl, "paged_decode_attention", "bf16")
    with pytest.raises(ArgumentError, match="kv_indptr: expected a non-decreasing"):
        ops.paged_decode_attention(tq, tk, tv, torch.tensor([0, 3, 2, 4]), torch.from_numpy(pc["kv_indices"]),
                                   torch.from_numpy(pc["kv_last_page_len"]), backend="host")
    cu = torch.tensor([0, 5, 9])
    qv, kv = torch.randn(9, 4, 16), torch.randn(9, 2, 16)
    o = ops.flash_attention_varlen(qv, kv, kv, cu, cu, causal=True, backend="host")
    ref, _ = np_ragged_attention(qv.double().numpy(), [0, 5, 9], [kv[:5].double().numpy(), kv[5:].double().numpy()],
                                 [kv[:5].double().numpy(), kv[5:].double().numpy()], True)
    _close(o.numpy(), ref, "flash_attention_varlen", "f32")
