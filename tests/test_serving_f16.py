"""float16 in the serving and decode ops (kernels_cu/paged.cu's _f16 / _f16kv / _f16_<fp8>kv instantiations):
NumPy float16 and torch.float16 in and out, f32 queries over an f16 cache, f16 queries over FP8 caches,
the f16 append (a bit copy, also as raw 16-bit words), all on the host backend against float64 references on
the same f16-rounded inputs, within the f16 rows of the tolerance table."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_helpers import need as _need  # noqa: E402
from pykern import ArgumentTypeError, ops  # noqa: E402
import pykern  # noqa: E402
from pykern.difftest.cases.decode import make_inputs, np_batched_decode_attention  # noqa: E402
from pykern.difftest.cases.serving import make_paged, make_q, np_ragged_attention  # noqa: E402
from test_serving import _close, _decode, _ref_decode  # noqa: E402


@pytest.mark.parametrize("kinds,tensor_cores", [(("f16", "f16"), True), (("f16", "f16"), False),
                                                (("f32", "f16"), True)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_f16(kinds, tensor_cores, num_splits) -> None:
    _need("host")
    qk, kk = kinds
    rng = np.random.default_rng(11)
    pc = make_paged(rng, [21, 0, 40], 5, 2, 64, "HND", kk)
    assert pc["k_pages"].dtype == np.float16
    q = make_q(rng, (3, 8, 64), qk)
    plan = ops.PagedDecodePlan(3, 8, 2, 64, 5, kv_layout="HND", q_dtype=qk, kv_dtype="float16", num_splits=num_splits,
                               like=q, tensor_cores=tensor_cores)
    # A group of 4 f16 query heads takes the tensor-core decode; f32 queries and tensor_cores=False paged_attn.
    want = "paged_attn_f16" if qk == "f16" else "paged_attn_f16kv"
    assert plan.launches()[0][0] == ("decode_tc_paged_d64_f16" if qk == "f16" and tensor_cores else want)
    if num_splits > 1 and not (qk == "f16" and tensor_cores):  # the tensor-core kernel merges in its launch
        assert plan.launches()[1][0] == "paged_attn_merge" + ("_f16" if qk == "f16" else "")
    assert len(plan.launches()) == (2 if num_splits > 1 and not (qk == "f16" and tensor_cores) else 1)
    out, lse = _decode(pc, q, "HND", plan=plan)
    assert out.dtype == (np.float16 if qk == "f16" else np.float32)
    ro, rl = _ref_decode(pc, q)
    _close(out, ro, "paged_decode_attention", "f16")
    _close(lse, rl, "paged_decode_attention", "f16")


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_f16_queries_over_fp8_caches(fp8) -> None:
    _need("host")
    rng = np.random.default_rng(12)
    pc = make_paged(rng, [30, 11], 16, 1, 48, "NHD", fp8)
    q = make_q(rng, (2, 4, 48), "f16")
    out, lse = _decode(pc, q, k_scale=pc["scales"][0], v_scale=pc["scales"][1], plan=None)
    assert out.dtype == np.float16
    ro, rl = _ref_decode(pc, q)
    _close(out, ro, "paged_decode_attention", "f16")
    qo = np.array([0, 6, 15], np.int32)
    qp = make_q(rng, (15, 4, 48), "f16")
    pc2 = make_paged(rng, [20, 9], 5, 1, 48, "NHD", fp8)
    o2 = ops.paged_prefill_attention(qp, qo, pc2["k_pages"], pc2["v_pages"], pc2["kv_indptr"], pc2["kv_indices"],
                                     pc2["kv_last_page_len"], k_scale=pc2["scales"][0], v_scale=pc2["scales"][1],
                                     backend="host")
    r2, _ = np_ragged_attention(qp.astype(np.float64), qo, pc2["ks"], pc2["vs"], True)
    _close(o2, r2, "paged_prefill_attention", "f16")


def test_paged_prefill_and_varlen_f16() -> None:
    _need("host")
    rng = np.random.default_rng(13)
    pc = make_paged(rng, [20, 0, 9], 5, 2, 32, "NHD", "f16")
    qo = np.array([0, 6, 6, 15], np.int32)
    q = make_q(rng, (15, 4, 32), "f16")
    out, lse = ops.paged_prefill_attention(q, qo, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                           pc["kv_last_page_len"], window_left=6, return_lse=True, backend="host")
    assert out.dtype == np.float16
    ro, rl = np_ragged_attention(q.astype(np.float64), qo, pc["ks"], pc["vs"], True, window_size=(6, -1))
    _close(out, ro, "paged_prefill_attention", "f16")
    _close(lse, rl, "paged_prefill_attention", "f16")
    cu_q, cu_k = np.array([0, 7, 12], np.int32), np.array([0, 15, 20], np.int32)
    for qk in ("f16", "f32"):
        qv = make_q(rng, (12, 4, 64), qk)
        k, v = make_q(rng, (20, 2, 64), "f16"), make_q(rng, (20, 2, 64), "f16")
        o = ops.flash_attention_varlen(qv, k, v, cu_q, cu_k, causal=True, softcap=3.0, backend="host")
        assert o.dtype == qv.dtype
        kf, vf = k.astype(np.float64), v.astype(np.float64)
        ref, _ = np_ragged_attention(qv.astype(np.float64), cu_q, [kf[:15], kf[15:]], [vf[:15], vf[15:]], True,
                                     softcap=3.0)
        _close(o, ref, "flash_attention_varlen", "f16")


def test_decode_attention_f16() -> None:
    _need("host")
    rng = np.random.default_rng(14)
    for qk, kk in (("f16", "f16"), ("f32", "f16")):
        for method in ("warp", "split_k"):
            q, k, v = make_inputs(rng, 3, 4, 2, 64, 40, [33, 0, 7], qk, kk)
            assert k.dtype == np.float16
            out = ops.batched_decode_attention(q, k, v, [33, 0, 7], method=method, backend="host", kv_layout="HND")
            assert out.dtype == q.dtype
            ref = np_batched_decode_attention(q, k, v, [33, 0, 7])
            _close(out, ref, "batched_decode_attention", "f16")
            o1 = ops.decode_attention(q[0], k[0], v[0], 33, method=method, backend="host", kv_layout="HND")
            _close(o1, ref[0], "decode_attention", "f16")
    q, k, v = make_inputs(rng, 1, 4, 2, 64, 40, [33], "f16", "f32")
    with pytest.raises(ArgumentTypeError, match=r"q: a float16 query needs float16 caches"):
        ops.batched_decode_attention(q, k, v, [33], backend="host", kv_layout="HND")
    pc = make_paged(rng, [5], 4, 2, 16, "NHD", "bf16")
    with pytest.raises(ArgumentTypeError, match=r"q: a float16 query needs float16 or FP8 K/V"):
        ops.paged_decode_attention(make_q(rng, (1, 4, 16), "f16"), pc["k_pages"], pc["v_pages"], pc["kv_indptr"],
                                   pc["kv_indices"], pc["kv_last_page_len"], backend="host")


@pytest.mark.parametrize("target", ["f16", "e4m3"])
def test_append_f16(target) -> None:
    _need("host")
    rng = np.random.default_rng(15)
    final, old = [9, 6], [4, 6]
    pc = make_paged(rng, final, 4, 2, 32, "NHD", target, raw_bf16="f16")
    app = np.array([0, 5, 5])
    bi, pos = ops.get_batch_indices_positions(app, final, 5)
    src = pc["ks_raw"] if target == "e4m3" else pc["ks"]
    k_new = np.concatenate([src[0][4:]]).astype(np.float16)
    v_new = np.concatenate([(pc["vs_raw"] if target == "e4m3" else pc["vs"])[0][4:]]).astype(np.float16)
    kp, vp = pc["k_pages"].copy(), pc["v_pages"].copy()
    for t in range(4, 9):
        pg = pc["kv_indices"][t // 4]
        kp[pg, t % 4] = 0
        vp[pg, t % 4] = 0
    sc = {"k_scale": pc["scales"][0], "v_scale": pc["scales"][1]} if target == "e4m3" else {}
    ops.append_paged_kv_cache(k_new, v_new, bi, pos, kp, vp, pc["kv_indices"], pc["kv_indptr"],
                              pc["kv_last_page_len"], backend="host", **sc)
    raw = "u1" if target == "e4m3" else "u2"
    np.testing.assert_array_equal(kp.view(raw), pc["k_pages"].view(raw))
    np.testing.assert_array_equal(vp.view(raw), pc["v_pages"].view(raw))
    if target == "f16":
        # the kernel itself takes raw 16-bit words for a __half* (a bit copy: every pattern survives)
        words = np.arange(0, 2**16, 2**16 // 64, dtype=np.uint16).reshape(1, 2, 32)
        pages = np.zeros((1, 1, 2, 32), np.uint16)
        pykern.launch("paged_append_kv_f16", 1, 128, words, words, np.zeros(1, np.int32), np.zeros(1, np.int32),
                      pages, pages.copy(), np.zeros(1, np.int32), np.array([0, 1], np.int32), 1, 2, 32, 1, 64, 64,
                      32, 1.0, 1.0, backend="host")
        np.testing.assert_array_equal(pages[0, 0], words[0])


def test_torch_float16_in_and_out() -> None:
    _need("host")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(16)
    pc = make_paged(rng, [11, 0, 6], 4, 2, 16, "NHD", "f16")
    q = make_q(rng, (3, 4, 16), "f16")
    t = torch.from_numpy
    out, lse = ops.paged_decode_attention(t(q), t(pc["k_pages"]), t(pc["v_pages"]), t(pc["kv_indptr"]).long(),
                                          t(pc["kv_indices"]), t(pc["kv_last_page_len"]), return_lse=True,
                                          backend="host")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    ro, rl = _ref_decode(pc, q)
    _close(out.float().numpy(), ro, "paged_decode_attention", "f16")
    _close(lse.numpy(), rl, "paged_decode_attention", "f16")
    cache = torch.stack([t(pc["k_pages"]), t(pc["v_pages"])], dim=1)  # FlashInfer's combined form
    o2 = ops.paged_decode_attention(t(q), cache, t(pc["kv_indptr"]), t(pc["kv_indices"]), t(pc["kv_last_page_len"]),
                                    backend="host")
    assert torch.equal(o2, out)
