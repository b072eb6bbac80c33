"""Dense decode (decode_attention / batched_decode_attention) on the tensor-core paged decode kernel.

Eligible shapes (16-bit q and caches of q's type, GQA group 1..16, head_dim 64 / 128, no softcap, method
"auto") run decode_tc.cu with one page a sequence (page_size = max_seq_len, which is no power of two
here); every other shape runs the tile kernels. Either way a cache that is a strided view (a slice of a
bigger preallocated buffer, HND and NHD) is read in place: the kernel gets the view's own memory, never a
copy. Every slot of the big buffer outside the view, and every slot past a sequence's length, holds NaN,
so a read outside the view or past the end fails the float64 comparison. Host backend; NumPy and CPU
torch tensors.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_helpers import need as _need  # noqa: E402
from pykern import ArgumentError, arrays, launcher  # noqa: E402
from pykern.difftest.cases.decode import make_inputs, np_batched_decode_attention, np_decode_attention  # noqa: E402
from pykern.ops.decode import batched_decode_attention, decode_attention  # noqa: E402
from pykern.tolerance import tolerance  # noqa: E402


def _close(out: Any, ref: np.ndarray, op: str, dtype: str) -> None:
    atol, rtol = tolerance(op, dtype)
    out = np.asarray(out, np.float64) if not hasattr(out, "float") else out.float().numpy().astype(np.float64)
    assert not np.isnan(out).any()
    err = np.abs(out - ref) - (atol + rtol * np.abs(ref))
    assert err.max() <= 0, f"max excess {err.max():.3g}, max abs err {np.abs(out - ref).max():.3g}"


@pytest.fixture
def launched(monkeypatch) -> list[tuple[str, tuple]]:
    """(kernel, args) of every launch through pykern.launcher.launch during the test."""
    calls: list[tuple[str, tuple]] = []
    real = launcher.launch

    def spy(name, *a, **k):
        calls.append((name, a))
        return real(name, *a, **k)

    monkeypatch.setattr(launcher, "launch", spy)
    return calls


@pytest.fixture
def copies(monkeypatch) -> list[Any]:
    """Every array arrays.contiguous was asked for during the test (a cache among them is a copy)."""
    seen: list[Any] = []
    real = arrays.contiguous

    def spy(a):
        seen.append(a)
        return real(a)

    monkeypatch.setattr(arrays, "contiguous", spy)
    return seen


def _addr(a: Any) -> int:
    return int(a.data_ptr()) if hasattr(a, "data_ptr") else int(a.ctypes.data)


def _shares(a: Any, buf: Any) -> bool:
    if hasattr(buf, "data_ptr"):
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        return lo <= a.data_ptr() < hi
    return bool(np.shares_memory(a, buf))


def _embed(k: np.ndarray, layout: str, batched: bool, extra_seq: int = 13, extra_heads: int = 1,
           lead: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(buffer, view): k (M, KVH, S, D) placed in a NaN-filled preallocated buffer with more sequences,
    kv heads and positions; the view is the slice holding k, in `layout`, not contiguous."""
    m, kvh, s, d = k.shape
    if layout == "HND":
        buf = np.full((m + 2 * lead, kvh + extra_heads, s + extra_seq, d), np.nan, np.float32).astype(k.dtype)
        view = buf[lead:lead + m, extra_heads:extra_heads + kvh, :s]
        view[...] = k
    else:
        buf = np.full((m + 2 * lead, s + extra_seq, kvh + extra_heads, d), np.nan, np.float32).astype(k.dtype)
        view = buf[lead:lead + m, :s, extra_heads:extra_heads + kvh]
        view[...] = k.transpose(0, 2, 1, 3)
    assert not view.flags.c_contiguous
    return buf, (view if batched else view[0])


def _ref(q, k, v, lens) -> np.ndarray:
    f = np.float64
    return np_batched_decode_attention(q.astype(f), k.astype(f), v.astype(f), lens)


def _tc_name(d: int, dtype: str) -> str:
    return f"decode_tc_paged_d{d}_{dtype}"


def _assert_in_place(calls, copies, kbuf, vbuf, kview, vview) -> None:
    """The attention kernel got the views' own memory (first element) and nothing copied a cache."""
    name, args = calls[0]
    assert _addr(args[3]) == _addr(kview) and _addr(args[4]) == _addr(vview), name
    assert _shares(args[3], kbuf) and _shares(args[4], vbuf)
    assert not any(_shares(a, kbuf) or _shares(a, vbuf) for a in copies
                   if isinstance(a, np.ndarray) or hasattr(a, "data_ptr"))


# --------------------------------------------------------------------------- tensor-core path on views
SHAPES = [(1, 64), (4, 64), (8, 128), (4, 128), (1, 128), (8, 64)]  # (GQA group, head_dim)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("group, d", SHAPES, ids=[f"g{g}d{d}" for g, d in SHAPES])
def test_batched_views_take_the_tensor_cores_in_place(layout, dtype, group, d, launched, copies) -> None:
    _need("host")
    kvh, s = 2, 100  # max_seq_len 100: one page of 100 positions a sequence (no power of two)
    lens = [100, 0, 1, 65, 37]  # ragged: full, empty, one position, past one tile, inside one tile
    rng = np.random.default_rng(group * 1000 + d + (layout == "NHD"))
    q, k, v = make_inputs(rng, len(lens), group * kvh, kvh, d, s, lens, dtype, dtype)
    kbuf, kv_ = _embed(k, layout, True)
    vbuf, vv_ = _embed(v, layout, True)
    out = batched_decode_attention(q, kv_, vv_, np.array(lens, np.int64), kv_layout=layout, backend="host")
    assert out.dtype == q.dtype and out.shape == q.shape
    _close(out, _ref(q, k, v, lens), "batched_decode_attention", dtype)
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)  # seq_len 0: zeros
    assert calls_names(launched)[0] == _tc_name(d, dtype)
    _assert_in_place(launched, copies, kbuf, vbuf, kv_, vv_)
    # the lengths reach the kernel as int32 last_page_len (one page a sequence: page_size = max_seq_len)
    args = launched[0][1]
    np.testing.assert_array_equal(args[12], lens)
    assert args[12].dtype == np.int32 and args[15] == s


def calls_names(calls) -> list[str]:
    return [n for n, _ in calls]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("group, d", [(4, 64), (8, 128), (1, 64)], ids=["g4d64", "g8d128", "g1d64"])
def test_single_sequence_view_int_and_array_lengths(layout, dtype, group, d, launched, copies) -> None:
    _need("host")
    kvh, s = 2, 300
    rng = np.random.default_rng(7 * group + d)
    for sl in (250, 0, 1):
        q, k, v = make_inputs(rng, 1, group * kvh, kvh, d, s, [sl], dtype, dtype)
        kbuf, kv_ = _embed(k, layout, False)
        vbuf, vv_ = _embed(v, layout, False)
        launched.clear()
        copies.clear()
        a = decode_attention(q[0], kv_, vv_, sl, kv_layout=layout, backend="host")
        assert calls_names(launched)[0] == _tc_name(d, dtype)
        _assert_in_place(launched, copies, kbuf, vbuf, kv_, vv_)
        b = decode_attention(q[0], kv_, vv_, np.array([sl], np.uint32), kv_layout=layout, backend="host")
        np.testing.assert_array_equal(a, b)  # same plan (shapes only), same kernel: the same bits
        ref = np_decode_attention(q[0].astype(np.float64), k[0].astype(np.float64), v[0].astype(np.float64), sl)
        _close(a, ref, "decode_attention", dtype)
        if sl == 0:
            np.testing.assert_array_equal(np.asarray(a, np.float32), 0.0)


def test_long_single_sequence_splits_kv(launched) -> None:
    # One sequence, 2 kv heads: the plan splits the cache so the CTAs fill the GPU (merged in the same launch).
    _need("host")
    from pykern.ops.serving import PagedDecodePlan

    q, k, v = make_inputs(np.random.default_rng(3), None, 8, 2, 64, 700, 650, "bf16", "bf16")
    out = decode_attention(q, k, v, 650, backend="host", kv_layout="HND")
    # the plan of the power of two at or above the cache's length
    plan = PagedDecodePlan(1, 8, 2, 64, 1024, kv_layout="HND", q_dtype="bf16", max_kv_len=1024)
    assert plan.num_splits > 1
    assert calls_names(launched) == [_tc_name(64, "bf16")]
    assert launched[0][1][0] == plan.tc_grid  # the grid carries the plan's split count
    _close(out, np_decode_attention(*(x.astype(np.float64) for x in (q, k, v)), 650), "decode_attention", "bf16")
    # a short length in the long cache: most splits see nothing and weigh 0 in the merge
    q, k, v = make_inputs(np.random.default_rng(4), None, 8, 2, 64, 700, 70, "bf16", "bf16")
    _close(decode_attention(q, k, v, np.array([70], np.int32), backend="host", kv_layout="HND"),
           np_decode_attention(*(x.astype(np.float64) for x in (q, k, v)), 70), "decode_attention", "bf16")


def test_a_growing_cache_reuses_one_plan(launched) -> None:
    # transformers' DynamicCache grows a token a step: every length up to the next power of two shares the plan
    # (its workspaces, its split count), and each step's launch carries its own cache length as the page size
    # (the kernel clamps a device length to it), not the plan's larger span.
    _need("host")
    import pykern.ops.decode as dec
    from pykern import registry

    dec._TC_PLANS.clear()
    rng = np.random.default_rng(12)
    lengths = (513, 600, 1024)
    for n in lengths:
        q, k, v = make_inputs(rng, 2, 8, 2, 64, n, [n, n - 7], "bf16", "bf16")
        ref = np_batched_decode_attention(*(x.astype(np.float64) for x in (q, k, v)), [n, n - 7])
        _close(batched_decode_attention(q, k, v, np.array([n, n - 7], np.int32), backend="host", kv_layout="HND"), ref,
               "batched_decode_attention", "bf16")
    assert len(dec._TC_PLANS) == 1
    assert {call[1][0] for call in launched} == {next(iter(dec._TC_PLANS.values()))[0].tc_grid}
    at = [p.name for p in registry.get(launched[0][0]).params].index("page_size")
    assert [call[1][2 + at] for call in launched] == list(lengths)  # after grid and block


def test_window_left_on_the_tensor_core_path(launched) -> None:
    _need("host")
    lens, w = [90, 5, 64], 20
    q, k, v = make_inputs(np.random.default_rng(5), 3, 8, 2, 128, 96, lens, "bf16", "bf16")
    out = batched_decode_attention(q, k, v, lens, window_left=w, backend="host", kv_layout="HND")
    assert calls_names(launched)[0] == _tc_name(128, "bf16")
    f = np.float64
    ref = np.stack([np_decode_attention(q[i].astype(f), k[i, :, max(0, n - 1 - w):n].astype(f),
                                        v[i, :, max(0, n - 1 - w):n].astype(f), min(n, w + 1))
                    for i, n in enumerate(lens)])
    _close(out, ref, "batched_decode_attention", "bf16")


def test_tensor_core_and_tile_kernels_agree() -> None:
    _need("host")
    lens = [77, 3]
    q, k, v = make_inputs(np.random.default_rng(6), 2, 16, 2, 64, 80, lens, "bf16", "bf16")
    ref = _ref(q, k, v, lens)
    for kw in ({}, {"tensor_cores": False}, {"method": "warp"}, {"method": "split_k"}):
        _close(batched_decode_attention(q, k, v, lens, kv_layout="HND", backend="host", **kw), ref,
               "batched_decode_attention", "bf16")


# --------------------------------------------------------------------------- who runs what
def test_ineligible_shapes_keep_the_tile_kernels_and_still_read_views_in_place(launched, copies) -> None:
    _need("host")
    lens = [40, 0, 17]
    cases = [  # (q kind, kv kind, group, d, extra kwargs, kernel)
        ("f32", "f32", 4, 64, {}, "dense_attn"),
        ("f32", "bf16", 4, 64, {}, "dense_attn_bf16kv"),
        ("bf16", "bf16", 4, 80, {}, "dense_attn_bf16"),          # head_dim 80
        ("bf16", "bf16", 32, 64, {}, "dense_attn_bf16"),         # group 32 > 16
        ("bf16", "bf16", 4, 64, {"logits_soft_cap": 30.0}, "dense_attn_bf16"),
        ("f16", "f16", 4, 128, {"method": "split_k"}, "dense_attn_f16"),  # an explicit method
        ("bf16", "bf16", 4, 64, {"tensor_cores": False}, "dense_attn_bf16"),
    ]
    for qk, kk, group, d, kw, name in cases:
        q, k, v = make_inputs(np.random.default_rng(group + d), 3, 2 * group, 2, d, 48, lens, qk, kk)
        kbuf, kv_ = _embed(k, "NHD", True)
        vbuf, vv_ = _embed(v, "NHD", True)
        launched.clear()
        copies.clear()
        out = batched_decode_attention(q, kv_, vv_, lens, kv_layout="NHD", backend="host", **kw)
        assert calls_names(launched)[0] == name, (qk, kk, group, d, kw)
        _assert_in_place(launched, copies, kbuf, vbuf, kv_, vv_)
        f = np.float64
        if "logits_soft_cap" in kw:
            c = kw["logits_soft_cap"]
            ref = []
            for i, n in enumerate(lens):
                o = np.zeros((2 * group, d))
                for h in range(2 * group):
                    if n:
                        s = c * np.tanh(k[i, h // group, :n].astype(f) @ q[i, h].astype(f) / np.sqrt(d) / c)
                        p = np.exp(s - s.max())
                        o[h] = p / p.sum() @ v[i, h // group, :n].astype(f)
                ref.append(o)
            ref = np.stack(ref)
        else:
            ref = _ref(q, k, v, lens)
        _close(out, ref, "batched_decode_attention", "f32" if (qk, kk) == ("f32", "f32") else kk)


def test_odd_strides_and_unaligned_bases_fall_back_without_copying(launched, copies) -> None:
    # Whole 16-byte chunks and 16-byte aligned bases are what the tensor-core kernel's cp.async needs;
    # a view without them runs dense_attn through the same strides (scalar loads), still in place.
    _need("host")
    lens = [30, 9]
    q, k, v = make_inputs(np.random.default_rng(8), 2, 8, 2, 64, 32, lens, "bf16", "bf16")
    for pad, off in ((4, 0), (0, 1)):  # position stride 68 elements (136 bytes); a base 2 bytes in
        bufs, views = [], []
        for x in (k, v):
            n = 2 * 2 * 32 * (64 + pad)
            buf = np.full(off + n + 8, np.nan, np.float32).astype(x.dtype)
            vw = buf[off:off + n].reshape(2, 2, 32, 64 + pad)[..., :64]
            vw[...] = x
            bufs.append(buf)
            views.append(vw)
        launched.clear()
        copies.clear()
        out = batched_decode_attention(q, views[0], views[1], lens, backend="host", kv_layout="HND")
        assert calls_names(launched)[0] == "dense_attn_bf16", (pad, off)
        _assert_in_place(launched, copies, bufs[0], bufs[1], views[0], views[1])
        _close(out, _ref(q, k, v, lens), "batched_decode_attention", "bf16")


def test_unaddressable_views_are_copied_and_still_right(launched, copies) -> None:
    # head_dim not unit-stride, negative strides, K and V of different strides: the one case the caches
    # are copied (documented); the result is still the attention over the view's values.
    _need("host")
    lens = [20, 7]
    q, k, v = make_inputs(np.random.default_rng(9), 2, 8, 2, 64, 24, lens, "bf16", "bf16")
    wide = np.repeat(k, 2, axis=-1)  # k at [..., ::2]
    kw_ = wide[..., ::2]
    out = batched_decode_attention(q, kw_, v, lens, backend="host", kv_layout="HND")
    _close(out, _ref(q, k, v, lens), "batched_decode_attention", "bf16")
    assert any(a is kw_ for a in copies)
    # K a strided view, V contiguous: strides differ, both copied, then the tensor-core kernel
    _, kv_ = _embed(k, "HND", True)
    launched.clear()
    out = batched_decode_attention(q, kv_, v, lens, backend="host", kv_layout="HND")
    assert calls_names(launched)[0] == _tc_name(64, "bf16")
    _close(out, _ref(q, k, v, lens), "batched_decode_attention", "bf16")
    # reversed kv heads (a negative stride)
    kr, vr = k[:, ::-1], v[:, ::-1]
    out = batched_decode_attention(q, kr, vr, lens, backend="host", kv_layout="HND")
    _close(out, _ref(q, np.ascontiguousarray(kr), np.ascontiguousarray(vr), lens), "batched_decode_attention", "bf16")


# --------------------------------------------------------------------------- out=
def test_out_is_written_through_or_rejected_by_name(launched) -> None:
    _need("host")
    lens = [50, 0]
    q, k, v = make_inputs(np.random.default_rng(10), 2, 8, 2, 64, 64, lens, "bf16", "bf16")
    ref = _ref(q, k, v, lens)
    out = np.full(q.shape, np.nan, np.float32).astype(q.dtype)
    got = batched_decode_attention(q, k, v, lens, out=out, backend="host", kv_layout="HND")
    assert got is out and calls_names(launched)[0] == _tc_name(64, "bf16")
    _close(out, ref, "batched_decode_attention", "bf16")
    single = np.full(q.shape[1:], np.nan, np.float32).astype(q.dtype)
    assert decode_attention(q[0], k[0], v[0], 50, out=single, backend="host", kv_layout="HND") is single
    _close(single, ref[0], "decode_attention", "bf16")
    big = np.zeros((2, 8, 128), q.dtype)
    with pytest.raises(ArgumentError, match="out: expected a C-contiguous"):
        batched_decode_attention(q, k, v, lens, out=big[..., :64], backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match="out: expected a C-contiguous"):
        decode_attention(q[0], k[0], v[0], 50, out=big[0, :, :64], backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match="out: expected a C-contiguous"):
        batched_decode_attention(q, k, v, lens, out=big[..., :64], tensor_cores=False, backend="host", kv_layout="HND")


def test_strided_device_array_out_is_rejected_by_name() -> None:
    class Dev:  # a strided __cuda_array_interface__ array (never dereferenced)
        def __init__(self, strides):
            self.__cuda_array_interface__ = {"shape": (2, 8, 64), "typestr": "<f2", "data": (256, False),
                                             "strides": strides, "version": 3}

    like = Dev(None)
    assert arrays.check_out(Dev(None), (2, 8, 64), "float16", like) is not None
    assert arrays.check_out(Dev((1024, 128, 2)), (2, 8, 64), "float16", like) is not None  # C order, explicit
    with pytest.raises(ArgumentError, match="out: expected a C-contiguous"):
        arrays.check_out(Dev((2048, 256, 2)), (2, 8, 64), "float16", like)


# --------------------------------------------------------------------------- torch (CPU tensors)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_torch_views_take_the_tensor_cores_in_place(layout, launched, copies) -> None:
    _need("host")
    torch = pytest.importorskip("torch")
    lens = [61, 0, 9]
    q, k, v = make_inputs(np.random.default_rng(11), 3, 8, 2, 128, 64, lens, "bf16", "bf16")
    tq = torch.from_numpy(q.astype(np.float32)).to(torch.bfloat16)
    bufs, views = [], []
    for x in (k, v):
        xt = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        if layout == "HND":
            buf = torch.full((5, 3, 80, 128), float("nan"), dtype=torch.bfloat16)
            vw = buf[1:4, 1:3, :64]
            vw.copy_(xt)
        else:
            buf = torch.full((5, 80, 3, 128), float("nan"), dtype=torch.bfloat16)
            vw = buf[1:4, :64, 1:3]
            vw.copy_(xt.transpose(1, 2))
        assert not vw.is_contiguous()
        bufs.append(buf)
        views.append(vw)
    for lens_arg in (torch.tensor(lens, dtype=torch.int64), torch.tensor(lens, dtype=torch.int32), lens):
        launched.clear()
        copies.clear()
        out = batched_decode_attention(tq, views[0], views[1], lens_arg, kv_layout=layout, backend="host")
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        assert calls_names(launched)[0] == _tc_name(128, "bf16")
        _assert_in_place(launched, copies, bufs[0], bufs[1], views[0], views[1])
        assert launched[0][1][12].dtype == torch.int32
        _close(out, _ref(q, k, v, lens), "batched_decode_attention", "bf16")
    one = decode_attention(tq[0], views[0][0], views[1][0], 61, kv_layout=layout, backend="host")
    _close(one, _ref(q, k, v, lens)[0], "decode_attention", "bf16")


def test_numba_reference_reads_the_same_views() -> None:
    _need("numba")
    lens = [33, 0]
    q, k, v = make_inputs(np.random.default_rng(12), 2, 8, 2, 64, 40, lens, "bf16", "bf16")
    _, kv_ = _embed(k, "NHD", True)
    _, vv_ = _embed(v, "NHD", True)
    out = batched_decode_attention(q, kv_, vv_, lens, kv_layout="NHD", backend="numba")
    _close(out, _ref(q, k, v, lens), "batched_decode_attention", "bf16")


def test_large_odd_max_seq_len_is_one_page(launched) -> None:
    # page_size = max_seq_len = 5003 (prime): every position is in page 0, the splits cut it in whole tiles,
    # the last tile is partial; a view of a longer buffer (positions 5003.. are NaN).
    _need("host")
    s, sl = 5003, 5001
    q, k, v = make_inputs(np.random.default_rng(13), 1, 16, 2, 128, s, [sl], "bf16", "bf16")
    kbuf, kv_ = _embed(k, "HND", True, extra_seq=61, extra_heads=0, lead=0)
    vbuf, vv_ = _embed(v, "HND", True, extra_seq=61, extra_heads=0, lead=0)
    out = batched_decode_attention(q, kv_, vv_, np.array([sl], np.int32), backend="host", kv_layout="HND")
    name, args = launched[0]
    assert name == _tc_name(128, "bf16") and args[15] == s and args[0][0] > 2  # split (1 sequence x 2 kv heads)
    _close(out, _ref(q, k, v, [sl]), "batched_decode_attention", "bf16")


def test_schedules_agree_bitwise_on_views(monkeypatch) -> None:
    # forward / reverse / random thread orders between barriers: a shared-memory race would show here.
    _need("host")
    lens = [70, 0, 129]
    q, k, v = make_inputs(np.random.default_rng(14), 3, 8, 2, 64, 140, lens, "f16", "f16")
    _, kv_ = _embed(k, "NHD", True)
    _, vv_ = _embed(v, "NHD", True)
    outs = []
    for sched in ("forward", "reverse", "random:7"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", sched)
        outs.append(np.asarray(batched_decode_attention(q, kv_, vv_, lens, kv_layout="NHD", backend="host")))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    _close(outs[0], _ref(q, k, v, lens), "batched_decode_attention", "f16")


def test_repeated_calls_reuse_one_plan_and_never_alias_the_output(monkeypatch) -> None:
    # A decode loop calls with one geometry every step: the plan (split partials, tickets, page table) is made
    # once per geometry, device and stream, and every call still returns an array of its own.
    _need("host")
    from pykern.ops import decode as dec
    from pykern.ops import serving

    made = []
    real = serving.PagedDecodePlan.__init__

    def count(self, *a, **k):
        made.append(a[:5])
        real(self, *a, **k)

    monkeypatch.setattr(serving.PagedDecodePlan, "__init__", count)
    monkeypatch.setattr(dec, "_TC_PLANS", type(dec._TC_PLANS)())
    kvh, s, group, d = 2, 300, 4, 64  # 300 positions: the plan splits a sequence (one launch, tickets)
    rng = np.random.default_rng(5)
    outs = []
    for lens in ([300, 7], [120, 299], [300, 7]):
        q, k, v = make_inputs(rng, 2, group * kvh, kvh, d, s, lens, "bf16", "bf16")
        out = batched_decode_attention(q, k, v, np.array(lens), backend="host", kv_layout="HND")
        _close(out, _ref(q, k, v, lens), "batched_decode_attention", "bf16")
        outs.append((out, _ref(q, k, v, lens)))
    assert len(made) == 1 and len({id(o) for o, _ in outs}) == 3
    for out, ref in outs:  # later calls did not write into an earlier call's result
        _close(out, ref, "batched_decode_attention", "bf16")
    plan = next(iter(dec._TC_PLANS.values()))[0]
    assert plan.num_splits > 1 and not np.asarray(plan.counters).any()  # the tickets are back at zero
    # another geometry (a new max_seq_len) gets a plan of its own; at most _TC_PLANS_MAX are kept
    q, k, v = make_inputs(rng, 2, group * kvh, kvh, d, 64, [64, 3], "bf16", "bf16")
    batched_decode_attention(q, k, v, np.array([64, 3]), backend="host", kv_layout="HND")
    assert len(made) == 2 and len(dec._TC_PLANS) == 2
    monkeypatch.setattr(dec, "_TC_PLANS_MAX", 1)
    decode_attention(q[0], k[0], v[0], 3, backend="host", kv_layout="HND")
    assert len(dec._TC_PLANS) == 1
