"""Decode attention: NumPy reference, argument checks, launch plans, and the
.cu kernels on the host backend (all methods, both schedules, int vs indirect seq_len),
against the numba references where that backend is available."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu.py beside this file

from gpu import requires_gpu  # noqa: E402
from pykern import ArgumentError, ArgumentTypeError  # noqa: E402
from pykern.difftest.cases.decode import (  # noqa: E402
    make_inputs,
    np_batched_decode_attention,
    np_decode_attention,
)
from pykern.ops.decode import batched_decode_attention, decode_attention, decode_plan  # noqa: E402
from pykern.tolerance import tolerance  # noqa: E402

METHODS = ("warp", "multi_warp", "split_k")


from family_helpers import need as _need  # noqa: E402


def _close(out: np.ndarray, ref: np.ndarray, op: str, dtype: str) -> None:
    atol, rtol = tolerance(op, dtype)
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any()
    err = np.abs(out - ref) - (atol + rtol * np.abs(ref))
    assert err.max() <= 0, f"max excess {err.max():.3g}, max abs err {np.abs(out - ref).max():.3g}"


# --------------------------------------------------------------------------- NumPy reference
def test_numpy_reference_matches_explicit_softmax() -> None:
    rng = np.random.default_rng(1)
    q, k, v = make_inputs(rng, None, 4, 2, 8, 10, 7)
    out = np_decode_attention(q, k, v, 7)
    for h in range(4):
        s = np.array([q[h].astype(np.float64) @ k[h // 2, t] for t in range(7)]) / np.sqrt(8)
        p = np.exp(s) / np.exp(s).sum()
        np.testing.assert_allclose(out[h], p @ v[h // 2, :7].astype(np.float64), rtol=1e-12)
    assert not np.isnan(out).any()  # the NaN slots past seq_len are outside the window


def test_numpy_reference_seq_len_zero_is_zero() -> None:
    q, k, v = make_inputs(np.random.default_rng(2), None, 2, 1, 4, 3, 0)
    assert np.isnan(k).all()
    np.testing.assert_array_equal(np_decode_attention(q, k, v, 0), 0.0)


def test_numpy_reference_single_position_returns_v() -> None:
    q, k, v = make_inputs(np.random.default_rng(3), None, 4, 1, 16, 5, 1)
    np.testing.assert_allclose(np_decode_attention(q, k, v, 1), np.repeat(v[:, 0], 4, axis=0), rtol=1e-12)


# --------------------------------------------------------------------------- argument checks
def _small(dtype_q: str = "f32", dtype_kv: str = "f32") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return make_inputs(np.random.default_rng(4), None, 4, 2, 32, 16, 16, dtype_q, dtype_kv)


def test_default_layout_is_nhd_as_the_paged_ops() -> None:
    # the default was "HND": an NHD cache (FlashInfer's and every paged op's default) was read as HND, which
    # for num_kv_heads dividing num_heads gave a wrong answer with no error
    _need("host")
    # HND (2 kv heads, 4 positions, 32); its NHD twin (4, 2, 32) read as HND is 4 kv heads of 2 positions, which
    # fits q's 4 heads and seq_len 2
    q, k, v = make_inputs(np.random.default_rng(40), None, 4, 2, 32, 4, 2)
    ref = np_decode_attention(q, k, v, 2)
    k_nhd, v_nhd = np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(v.transpose(1, 0, 2))
    _close(decode_attention(q, k_nhd, v_nhd, 2, backend="host"), ref, "decode_attention", "f32")
    _close(decode_attention(q, k, v, 2, kv_layout="HND", backend="host"), ref, "decode_attention", "f32")
    bq = np.stack([q, q])
    bref = np_batched_decode_attention(bq, np.stack([k, k]), np.stack([v, v]), [2, 1])
    _close(batched_decode_attention(bq, np.stack([k_nhd, k_nhd]), np.stack([v_nhd, v_nhd]), np.array([2, 1]),
                                    backend="host"), bref, "batched_decode_attention", "f32")


def test_seq_len_above_max_is_an_error_before_launch() -> None:
    q, k, v = _small()
    with pytest.raises(ArgumentError, match="seq_len.*16.*17"):
        decode_attention(q, k, v, 17, backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match="seq_len.*max_seq_len=16.*17"):
        decode_attention(q, k, v, np.array([17], np.uint32), backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match="seq_len"):
        decode_attention(q, k, v, -1, backend="host", kv_layout="HND")


@pytest.mark.parametrize(
    "mutate, err, pattern",
    [
        (lambda q, k, v: (q, k, v[:, :8]), ArgumentError, "v_cache"),
        (lambda q, k, v: (q[:3], k, v), ArgumentError, "num_kv_heads"),
        (lambda q, k, v: (q[:, :16], k, v), ArgumentError, "head_dim"),
        (lambda q, k, v: (q.astype(np.float64), k, v), ArgumentTypeError, "q: expected dtype"),
        (lambda q, k, v: (q, k, v.astype(np.float16)), ArgumentTypeError, "v_cache"),
        (lambda q, k, v: (q[None], k, v), ArgumentError,
         r"q: expected a 2-D array \(num_heads, head_dim\), got shape \(1, 4, 32\)"),
    ],
)
def test_bad_arguments_name_the_argument(mutate, err, pattern) -> None:
    q, k, v = mutate(*_small())
    with pytest.raises(err, match=pattern):
        decode_attention(q, k, v, 4, backend="host", kv_layout="HND")


def test_head_dim_above_256_rejected() -> None:
    q, k, v = make_inputs(np.random.default_rng(5), None, 1, 1, 257, 2, 2)
    with pytest.raises(ArgumentError, match="head_dim <= 256.*257"):
        decode_attention(q, k, v, 1, backend="host", kv_layout="HND")


def test_bf16_query_with_f32_cache_rejected() -> None:
    from pykern.arrays import bfloat16

    q, k, v = _small()
    with pytest.raises(ArgumentTypeError, match="q: a bfloat16 query"):
        decode_attention(q.astype(bfloat16()), k, v, 4, backend="host", kv_layout="HND")


def test_seq_len_array_checks() -> None:
    q, k, v = _small()
    # any integer dtype is taken, as torch and FlashInfer index with int64; a float one is not
    with pytest.raises(ArgumentTypeError, match="seq_len: expected an integer array, got dtype float32"):
        decode_attention(q, k, v, np.array([3], np.float32), backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match=r"seq_len: expected shape \(1,\)"):
        decode_attention(q, k, v, np.array([3, 3], np.uint32), backend="host", kv_layout="HND")
    qb = np.stack([q, q])
    kb, vb = np.stack([k, k]), np.stack([v, v])
    with pytest.raises(ArgumentError, match=r"seq_lens: expected shape \(2,\)"):
        batched_decode_attention(qb, kb, vb, np.array([1], np.uint32), backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match=r"seq_lens\[1\]"):
        batched_decode_attention(qb, kb, vb, [1, 99], backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match="k_caches: expected caches of one shape"):
        batched_decode_attention(qb, [k, k[:, :8]], [v, v], [1, 1], backend="host", kv_layout="HND")


def test_method_knobs_checked() -> None:
    q, k, v = _small()
    with pytest.raises(ArgumentError, match="method: expected one of"):
        decode_attention(q, k, v, 4, method="flash", backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match="num_warps: only used by method='multi_warp'"):
        decode_attention(q, k, v, 4, method="warp", num_warps=4, backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match="chunk_size"):
        decode_attention(q, k, v, 4, method="split_k", chunk_size=0, backend="host", kv_layout="HND")
    with pytest.raises(ArgumentError, match="num_warps"):
        decode_attention(q, k, v, 4, method="multi_warp", num_warps=17, backend="host", kv_layout="HND")


# --------------------------------------------------------------------------- launch plans
def test_llama8b_step_plans() -> None:
    # 32 heads, 8 kv heads, head_dim 128, a 4096-long cache: the geometry the report quotes.
    # One CTA per (sequence, kv head) holds the 4 query heads of its group (K/V read once).
    # Shared memory: a 2-slot cp.async ring of K and V tiles in the cache type (f32 rows of
    # 128 * 4 bytes + 16 padding) plus fp32 q rows, scores and 3 row statistics.
    smem = 2 * 2 * 16 * (128 * 4 + 16) + 4 * (4 * 128 + 4 * 16 + 3 * 4)
    warp = decode_plan(1, 32, 8, 128, 4096, method="warp")
    assert warp["launches"] == [("dense_attn", (8, 1), (128,), smem)]
    assert warp["rows"] == 4 and warp["tile"] == 16
    mw = decode_plan(1, 32, 8, 128, 4096, method="multi_warp")
    assert mw["launches"] == [("dense_attn", (8, 1, 8), (128,), smem), ("paged_attn_merge", (8,), (128,), 0)]
    sk = decode_plan(1, 32, 8, 128, 4096, method="split_k")
    # 8 CTAs -> 33 chunks for two waves of 132 SMs -> chunks of 128 positions
    assert sk["chunk_size"] == 128 and sk["max_chunks"] == 32
    assert sk["launches"] == [("dense_attn", (8, 1, 32), (128,), smem), ("paged_attn_merge", (8,), (128,), 0)]
    assert decode_plan(1, 32, 8, 128, 4096, method="auto")["method"] == "split_k"
    assert decode_plan(1, 32, 8, 128, 4096, method="auto", seq_hint=200)["method"] == "warp"
    assert decode_plan(1, 32, 8, 128, 4096, method="auto", seq_hint=1000)["method"] == "split_k"  # not multi_warp
    assert decode_plan(17, 32, 8, 128, 4096, method="auto")["method"] == "warp"  # 136 CTAs fill 132 SMs
    assert decode_plan(16, 32, 8, 128, 4096, method="auto")["method"] == "split_k"


def test_plans_respect_grid_limits_and_gqa_groups() -> None:
    # all heads of a group in one CTA while group * head_dim <= 2048; else ceil(group / rows) CTAs
    for heads, kv, d, chunks in ((32, 8, 64, 1), (12, 1, 128, 1), (64, 8, 128, 1), (64, 1, 128, 4),
                                 (48, 3, 256, 2), (7, 7, 64, 1)):
        plan = decode_plan(2, heads, kv, d, 100, method="warp")
        assert plan["launches"][0][1] == (2 * kv, chunks)
        assert plan["rows"] * d <= 2048 and plan["rows"] * chunks >= heads // kv
    # the int form bounds the split-K grid by seq_len; the array form by max_seq_len
    assert decode_plan(2, 4, 2, 64, 1000, method="split_k", chunk_size=100, seq_hint=250)["launches"][0][1] == (
        4, 1, 3)
    assert decode_plan(2, 4, 2, 64, 1000, method="split_k", chunk_size=100)["launches"][0][1] == (4, 1, 10)
    # a single chunk needs no merge
    assert len(decode_plan(2, 4, 2, 64, 1000, method="split_k", chunk_size=100, seq_hint=90)["launches"]) == 1


# --------------------------------------------------------------------------- kernels on the host
@pytest.fixture
def schedule(request, monkeypatch):
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", request.param)
    return request.param


@pytest.mark.parametrize("schedule", ["forward", "reverse"], indirect=True)
@pytest.mark.parametrize("method", METHODS)
def test_methods_match_reference_and_each_other(method: str, schedule: str) -> None:
    _need("host")
    rng = np.random.default_rng(10)
    # GQA 4, head_dim 80 (vector path with a partial last slot), lengths straddling warp multiples
    q, k, v = make_inputs(rng, 3, 8, 2, 80, 140, [129, 0, 33])
    out = batched_decode_attention(q, k, v, np.array([129, 0, 33], np.uint32), method=method, backend="host",
                                   kv_layout="HND")
    ref = np_batched_decode_attention(q, k, v, [129, 0, 33])
    _close(out, ref, "batched_decode_attention", "f32")
    np.testing.assert_array_equal(out[1], 0.0)
    other = batched_decode_attention(q, k, v, [129, 0, 33], method="warp", backend="host", kv_layout="HND")
    np.testing.assert_allclose(out, other, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_int_and_indirect_seq_len_agree_exactly(method: str) -> None:
    _need("host")
    q, k, v = make_inputs(np.random.default_rng(11), None, 4, 1, 33, 100, 97)
    a = decode_attention(q, k, v, 97, method=method, backend="host", kv_layout="HND")
    b = decode_attention(q, k, v, np.array([97], np.uint32), method=method, backend="host", kv_layout="HND")
    np.testing.assert_array_equal(a, b)
    _close(a, np_decode_attention(q, k, v, 97), "decode_attention", "f32")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kinds", [("bf16", "bf16"), ("f32", "bf16")])
def test_bf16_caches(method: str, kinds: tuple[str, str]) -> None:
    _need("host")
    q, k, v = make_inputs(np.random.default_rng(12), None, 4, 2, 64, 70, 65, *kinds)
    out = decode_attention(q, k, v, 65, method=method, backend="host", kv_layout="HND")
    assert out.dtype == q.dtype
    ref = np_decode_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), 65)
    _close(out.astype(np.float64), ref, "decode_attention", "bf16")


@pytest.mark.parametrize("method", METHODS)
def test_kernel_clamps_seq_len_to_max(method: str) -> None:
    # A device buffer is not checked by the op; the kernel must clamp. Launch directly
    # with a length above max_seq_len and compare with seq_len == max_seq_len.
    _need("host")
    import pykern

    q, k, v = make_inputs(np.random.default_rng(13), None, 2, 1, 32, 40, 40)
    plan = decode_plan(1, 2, 1, 32, 40, method=method, chunk_size=16 if method == "split_k" else None,
                       num_warps=3 if method == "multi_warp" else None)
    big = np.array([1000], np.uint32)
    out = np.full((2, 32), np.nan, np.float32)
    splits = plan["num_splits"]
    po, pl = np.empty(max(1, splits * 2 * 32), np.float32), np.empty(max(1, splits * 2), np.float32)
    idx, f1 = np.zeros(2, np.int32), np.zeros(1, np.float32)
    stem, grid, block, smem = plan["launches"][0]
    pykern.launch(stem, grid, block, q, k, v, out, f1, po, pl, idx, idx, big, 2, 1, 32, 40 * 32, 32, 40 * 32, 40,
                  0, 1, 2**30, 2**30, plan["rows"], plan["tile"], splits, plan["chunk_size"], 1, 0,
                  1.0 / np.sqrt(32), 0.0, shared_mem=smem, backend="host")  # unbounded window, no softcap
    if splits > 1:
        s2, g2, b2, _ = plan["launches"][1]
        pykern.launch(s2, g2, b2, po, pl, out, f1, 2, 32, splits, 0, backend="host")
    _close(out, np_decode_attention(q, k, v, 40), "decode_attention", "f32")


def test_multi_warp_and_split_knobs() -> None:
    _need("host")
    q, k, v = make_inputs(np.random.default_rng(14), None, 4, 4, 96, 300, 257)
    ref = np_decode_attention(q, k, v, 257)
    for kw in ({"method": "multi_warp", "num_warps": 3}, {"method": "multi_warp", "num_warps": 16},
               {"method": "split_k", "chunk_size": 37}, {"method": "split_k", "chunk_size": 1000}):
        _close(decode_attention(q, k, v, 257, kv_layout="HND", backend="host", **kw), ref, "decode_attention", "f32")


@pytest.mark.parametrize("method", METHODS)
def test_unaligned_cache_takes_the_scalar_path(method: str) -> None:
    # head_dim 64 would use 16-byte loads; a cache starting 4 bytes into a buffer must not.
    _need("host")
    q, k, v = make_inputs(np.random.default_rng(17), None, 4, 2, 64, 30, 29)
    kb = np.empty(k.size + 1, np.float32)
    vb = np.empty(v.size + 1, np.float32)
    ku = kb[1:].reshape(k.shape)
    vu = vb[1:].reshape(v.shape)
    ku[...] = k
    vu[...] = v
    assert ku.ctypes.data % 16 and ku.flags.c_contiguous
    out = decode_attention(q, ku, vu, 29, method=method, backend="host", kv_layout="HND")
    _close(out, np_decode_attention(q, k, v, 29), "decode_attention", "f32")


def test_auto_method_runs_and_matches() -> None:
    _need("host")
    q, k, v = make_inputs(np.random.default_rng(18), None, 2, 1, 32, 600, 300)
    ref = np_decode_attention(q, k, v, 300)
    a = decode_attention(q, k, v, 300, backend="host", kv_layout="HND")  # int 300 -> multi_warp
    b = decode_attention(q, k, v, np.array([300], np.uint32), backend="host",
                         kv_layout="HND")  # max_seq_len 600 -> multi_warp
    _close(a, ref, "decode_attention", "f32")
    np.testing.assert_array_equal(a, b)
    c = decode_attention(q, k, v, 100, backend="host", kv_layout="HND")  # int 100 -> warp
    _close(c, np_decode_attention(q, k, v, 100), "decode_attention", "f32")


@pytest.mark.parametrize("head_dim", [8, 20, 24, 40, 48, 136, 200])
@pytest.mark.parametrize("kinds", [("f32", "f32"), ("bf16", "bf16")])
def test_lane_layouts_for_odd_head_dims(head_dim: int, kinds: tuple[str, str]) -> None:
    # Covers every lane layout: 8/16/32 lanes per cache row (several rows per warp
    # step), partly idle row groups, two vectors per lane, and the scalar path.
    _need("host")
    q, k, v = make_inputs(np.random.default_rng(head_dim), 2, 4, 2, head_dim, 45, [43, 9], *kinds)
    ref = np_batched_decode_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), [43, 9])
    for method in METHODS:
        out = batched_decode_attention(q, k, v, [43, 9], method=method, backend="host", kv_layout="HND")
        _close(out.astype(np.float64), ref, "batched_decode_attention", kinds[0])


def test_list_of_caches_is_stacked() -> None:
    _need("host")
    q, k, v = make_inputs(np.random.default_rng(15), 3, 2, 1, 32, 20, [20, 1, 7])
    a = batched_decode_attention(q, list(k), list(v), [20, 1, 7], method="warp", backend="host", kv_layout="HND")
    b = batched_decode_attention(q, k, v, np.array([20, 1, 7], np.uint32), method="warp", backend="host",
                                 kv_layout="HND")
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", METHODS)
def test_numba_reference_agrees(method: str) -> None:
    _need("numba")
    q, k, v = make_inputs(np.random.default_rng(16), 2, 4, 2, 40, 50, [37, 0])
    out = batched_decode_attention(q, k, v, [37, 0], method=method, backend="numba", kv_layout="HND")
    _close(out, np_batched_decode_attention(q, k, v, [37, 0]), "batched_decode_attention", "f32")


@settings(max_examples=25, deadline=None)
@given(
    group=st.sampled_from([1, 2, 3, 4, 8]),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.integers(1, 256),
    lens=st.lists(st.integers(0, 70), min_size=1, max_size=4),
    extra=st.integers(0, 5),
    method=st.sampled_from(METHODS),
    kinds=st.sampled_from([("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16")]),
    seed=st.integers(0, 2**31),
)
def test_random_shapes_match_numpy(group, num_kv_heads, head_dim, lens, extra, method, kinds, seed) -> None:
    _need("host")
    s = max(lens) + extra or 1
    q, k, v = make_inputs(np.random.default_rng(seed), len(lens), group * num_kv_heads, num_kv_heads, head_dim, s,
                          lens, *kinds)
    out = batched_decode_attention(q, k, v, lens, method=method, backend="host", kv_layout="HND")
    ref = np_batched_decode_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), lens)
    _close(out.astype(np.float64), ref, "batched_decode_attention", "f32" if kinds == ("f32", "f32") else "bf16")


@requires_gpu
@pytest.mark.parametrize("kinds", [("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16")])
def test_gpu_methods_match_reference(kinds: tuple[str, str]) -> None:
    # The same NaN-padded inputs on the real GPU: every method, int and indirect forms.
    dtype = "f32" if kinds == ("f32", "f32") else "bf16"
    for h, kvh, d, s, sl in ((32, 8, 128, 4100, 4097), (8, 1, 80, 300, 129), (4, 4, 33, 40, 0)):
        q, k, v = make_inputs(np.random.default_rng(d), None, h, kvh, d, s, sl, *kinds)
        ref = np_decode_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), sl)
        for method in METHODS:
            a = decode_attention(q, k, v, sl, method=method, backend="nvrtc", kv_layout="HND")
            b = decode_attention(q, k, v, np.array([sl], np.uint32), method=method, backend="nvrtc", kv_layout="HND")
            np.testing.assert_array_equal(a, b)
            _close(a.astype(np.float64), ref, "decode_attention", dtype)



# --------------------------------------------------------------------------- launch bounds
_BOUND = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\((\d+)[^)]*\) )?(\w+)\(')


def test_every_plan_block_fits_the_kernels_launch_bounds() -> None:
    # A block with more threads than a kernel's __launch_bounds__ fails to launch on a GPU.
    # The host backend has no register file, so read the bounds the registry parsed from the source
    # (paged.cu's families are macro instantiations; the registry expands their bounds).
    import pykern

    specs = [s for s in pykern.kernels() if s.source.name == "paged.cu"]
    unbounded = sorted(s.name for s in specs if s.max_threads is None)
    assert not unbounded, f"kernels without __launch_bounds__: {unbounded}"
    bounds = {s.name: s.max_threads for s in specs}
    assert bounds["dense_attn_f16"] == bounds["paged_attn_merge"] == 128
    checked = 0
    for group in (1, 2, 3, 4, 8, 16):
        for head_dim in (1, 64, 96, 256):
            for method, knob in [("warp", {}), ("split_k", {})] + [
                    ("multi_warp", {"num_warps": w}) for w in range(1, 17)]:
                plan = decode_plan(2, 16 * group, 16, head_dim, 4096, method=method, **knob)
                for stem, _grid, block, smem in plan["launches"]:
                    assert smem <= 48 * 1024  # no opt-in needed on any arch
                    for suffix in ("", "_bf16", "_bf16kv", "_f16", "_f16kv"):
                        if stem + suffix in bounds:
                            checked += 1
                            assert block[0] <= bounds[stem + suffix], (stem + suffix, knob, block)
    assert checked


def test_split_k_chunks_beyond_the_grid_z_limit_are_rejected_by_name() -> None:
    # split_k puts chunks on grid z (<= 65535); kv heads * batch go on grid x (no such limit).
    with pytest.raises(ArgumentError, match="chunk_size"):
        decode_plan(1, 4, 4, 4, 2**20, method="split_k", chunk_size=8)
    for method in ("warp", "multi_warp", "split_k"):
        for _stem, grid, _block, _smem in decode_plan(1, 65536, 65536, 4, 16, method=method)["launches"]:
            assert all(g <= 65535 for g in grid[1:]), (method, grid)
