"""paged_prefill_attention on the Hopper (sm_90a) forward: kernels_cu/attention_fwd_sm90.cu's paged producer
(paged_prefill_sm90_*, fa90_forward with a cache element type KV).

On the host backend playing sm_90a (PYKERN_HOST_ARCH=sm_90a) the op launches the paged sm_90a kernel for bf16 / f16
queries over a cache of their type or an FP8 (e4m3 / e5m2) cache, at head_dim 64 / 128 and 192 / 128 (V pages of
128 columns with strides of their own; off sm_90a padded to 192 for paged_attn), at head_dim 256 (an FP8
cache's bytes staged in shared memory by cp.async, then widened), and at head_dim 96 over a cache of the query's
type or FP8 (the gather writes 32-column, 64B-swizzled boxes), for every page size (1,
3, 16, 128, 256: pages shorter than, not dividing, and longer than the key tile), ragged sequence lengths, GQA,
causal and not, window_left and softcap, NHD and HND; its outputs equal float64 NumPy within the
paged_prefill_attention tolerance rows and its lse the reference's. PYKERN_SM90=0 keeps the mma.sync / CUDA-core
kernels. The result is the same under every host schedule (the producer's gather and the consumers meet only
through the mbarriers). From the cubin NVRTC makes for sm_90a (no GPU needed): each paged kernel has HGMMA, SYNCS,
UTMALDG (Q) and LDGSTS (the 16-bit gather; FP8 caches: 8-byte loads and the widening, at d256 cp.async to the
staging buffer, 8-byte shared loads and the widening), no spills, and the steady
loop of the varlen kernel it shares its consumers with.
"""
from __future__ import annotations

import numpy as np
import pytest

from functools import lru_cache
from pathlib import Path
import re

from pykern import ops
from pykern.ops import _attention_sm90 as sm90
from pykern.difftest.cases.serving import make_paged, make_q, np_ragged_attention
from launch_spy import record_launches as _record
from attn_checks import check_lse, close, sm90_host  # noqa: F401 (a fixture)
from sass_helpers import compile_sass, report

pytestmark = pytest.mark.usefixtures("sm90_host")
HOST = "host"


def _run(rng, kv_lens, qo_lens, page_size, h, kvh, d, q_kind, kv_kind, causal=True, layout="NHD", window_left=-1,
         cap=0.0, d_v=None):
    pc = make_paged(rng, kv_lens, page_size, kvh, d, layout, kv_kind, head_dim_v=d_v)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = make_q(rng, (int(qo[-1]), h, d), q_kind)
    scales = {"k_scale": pc["scales"][0], "v_scale": pc["scales"][1]} if kv_kind in ("e4m3", "e5m2") else {}
    out, lse = ops.paged_prefill_attention(q, qo, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                           pc["kv_last_page_len"], causal=causal, kv_layout=layout,
                                           window_left=window_left, logits_soft_cap=cap, return_lse=True,
                                           backend=HOST, **scales)
    ref_out, ref_lse = np_ragged_attention(q.astype(np.float64), qo, pc["ks"], pc["vs"], causal,
                                           window_size=(window_left, -1), softcap=cap)
    return out, lse, ref_out, ref_lse


CASES = [
    # (kv_lens, qo_lens, page_size, heads, kv_heads, head_dim, q kind, kv kind, causal, layout, window_left, cap)
    ([300, 17], [140, 17], 16, 4, 1, 128, "bf16", "bf16", True, "NHD", -1, 0.0),   # GQA 4, ragged, 2 key tiles
    ([200, 5, 90], [70, 5, 90], 3, 2, 2, 64, "f16", "f16", True, "HND", -1, 0.0),   # page 3 divides nothing
    ([400], [130], 256, 2, 1, 64, "bf16", "bf16", False, "NHD", -1, 0.0),           # page longer than the tile
    ([333, 64], [200, 1], 128, 4, 2, 128, "f16", "f16", True, "NHD", 100, 0.0),     # window, page 128
    ([260], [129], 1, 2, 1, 64, "bf16", "bf16", True, "NHD", -1, 30.0),             # page 1, softcap
    # softcap, 5 steady key tiles after the ragged one: the first, then two pairs of the hot loop (its ping-pong and
    # FMA-pipe exp2s)
    ([1000], [130], 64, 2, 1, 64, "f16", "f16", False, "NHD", -1, 30.0),
    ([290, 40], [150, 40], 16, 4, 1, 128, "bf16", "e4m3", True, "NHD", -1, 0.0),    # FP8 e4m3, k/v scales
    ([210, 0], [100, 3], 8, 2, 1, 64, "f16", "e5m2", True, "HND", -1, 20.0),        # FP8 e5m2, a sequence w/o keys
    # DeepSeek-V3's prefill shape: q / k 192 (three boxes), v 128 (two), V pages with strides of their own
    ([170, 30], [140, 30], 16, 4, 1, (192, 128), "bf16", "bf16", True, "NHD", -1, 0.0),
    ([120, 0, 45], [90, 2, 45], 5, 2, 2, (192, 128), "f16", "f16", False, "HND", -1, 20.0),
    ([180], [130], 1, 2, 1, (192, 128), "bf16", "e5m2", True, "NHD", 60, 0.0),       # page 1, window, FP8
    ([140, 10], [129, 10], 256, 2, 1, (192, 128), "f16", "e4m3", True, "HND", -1, 30.0),
    # head_dim 256 (the producer in 24 registers beside the consumers' 240; FP8 caches staged, then widened)
    ([150, 9], [130, 9], 16, 2, 1, 256, "bf16", "bf16", True, "NHD", -1, 0.0),     # 2 query tiles, 3 key tiles
    ([100], [60], 3, 2, 2, 256, "f16", "f16", False, "HND", 40, 25.0),             # page 3, window, softcap
    ([90, 9], [70, 9], 16, 2, 1, 256, "bf16", "e4m3", True, "NHD", -1, 0.0),      # FP8 e4m3, 2 key tiles
    ([70, 0], [50, 2], 3, 2, 2, 256, "f16", "e5m2", False, "HND", 30, 25.0),      # e5m2, page 3, window, softcap
    # head_dim 96 (the gather writes PkAttnBox<96>'s 32-column, 64B-swizzled boxes: 4 pieces a row, 32 rows a pass)
    ([300, 17], [140, 17], 16, 4, 1, 96, "bf16", "bf16", True, "NHD", -1, 0.0),    # GQA 4, ragged, 3 key tiles
    ([200, 0, 90], [70, 3, 90], 3, 2, 2, 96, "f16", "f16", False, "HND", -1, 20.0),  # page 3, no keys, softcap
    ([260], [129], 256, 2, 1, 96, "f16", "f16", True, "NHD", 100, 0.0),            # page over the tile, window
    ([150], [60], 1, 2, 1, 96, "bf16", "bf16", True, "HND", -1, 30.0),              # page 1, softcap
    ([290, 40], [150, 40], 16, 4, 1, 96, "bf16", "e4m3", True, "NHD", -1, 0.0),     # FP8 e4m3, k/v scales
    ([210, 0], [100, 3], 8, 2, 1, 96, "f16", "e5m2", False, "HND", 50, 20.0),       # e5m2, no keys, window, softcap
]


def _dims(d):
    """(head_dim, head_dim_v) of a CASES entry's head_dim (an int, or the pair)."""
    return d if isinstance(d, tuple) else (d, d)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "kv{}-q{}-p{}-h{}/{}-d{}-{}-{}kv-{}-{}-wl{}-cap{:g}".format(
    *c[:5], "{}_{}".format(*c[5]) if isinstance(c[5], tuple) else c[5], c[6], c[7], "causal" if c[8] else "full", *c[9:]))
def test_paged_prefill_sm90_vs_float64(case, monkeypatch) -> None:
    kv_lens, qo_lens, ps, h, kvh, dd, qk, kvk, causal, layout, wl, cap = case
    d, dv = _dims(dd)
    rng = np.random.default_rng(sum(kv_lens) * 7 + ps + d)
    names = _record(monkeypatch)
    out, lse, ref_out, ref_lse = _run(rng, kv_lens, qo_lens, ps, h, kvh, d, qk, kvk, causal, layout, wl, cap, dv)
    tail = f"_{kvk}kv" if kvk in ("e4m3", "e5m2") else ""
    shape = f"d{d}" if d == dv else f"d{d}_dv{dv}"
    assert names == [f"paged_prefill_sm90_{shape}{'_softcap' if cap else ''}_{qk}{tail}"]
    assert np.asarray(out).shape == (sum(qo_lens), h, dv)
    close("out", out, ref_out, "paged_prefill_attention", "bf16" if "bf16" in (qk, kvk) else qk)
    check_lse(lse, ref_lse)


def test_paged_prefill_narrower_v_off_sm90_pads_v(monkeypatch) -> None:
    # PYKERN_SM90=0 at 192 / 128: paged_attn reads K and V at one head dim, so V's pages are padded with zero columns
    # to 192 and out sliced back to 128 (a caller's out= gets those columns); scores and lse as on sm_90a
    monkeypatch.setenv("PYKERN_SM90", "0")
    rng = np.random.default_rng(12)
    names = _record(monkeypatch)
    out, lse, ref_out, ref_lse = _run(rng, [90, 12], [60, 12], 16, 2, 1, 192, "bf16", "bf16", d_v=128)
    assert np.asarray(out).shape == (72, 2, 128)
    close("out", out, ref_out, "paged_prefill_attention", "bf16")
    check_lse(lse, ref_lse)
    pc = make_paged(np.random.default_rng(13), [40], 16, 1, 192, "HND", "f16", head_dim_v=128)
    q = make_q(np.random.default_rng(14), (10, 2, 192), "f16")
    qo = np.array([0, 10], np.int32)
    mine = np.full((10, 2, 128), np.nan, np.float16)
    got = ops.paged_prefill_attention(q, qo, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                      pc["kv_last_page_len"], kv_layout="HND", out=mine, backend=HOST)
    assert got is mine
    ref_out, _ = np_ragged_attention(q.astype(np.float64), qo, pc["ks"], pc["vs"], True)
    close("out", mine, ref_out, "paged_prefill_attention", "f16")
    assert names == ["paged_attn_bf16", "paged_attn_f16"]


def test_paged_prefill_v_wider_than_k_is_an_error() -> None:
    from pykern.errors import ArgumentError

    rng = np.random.default_rng(15)
    pc = make_paged(rng, [20], 16, 1, 64, "NHD", "bf16", head_dim_v=128)
    q = make_q(rng, (4, 2, 64), "bf16")
    with pytest.raises(ArgumentError, match=r"v_pages: expected the shape of k_pages \(5, 16, 1, 64\) with a last "
                                            r"dimension \(head_dim_v\) in \[1, 64\], got \(5, 16, 1, 128\)"):
        ops.paged_prefill_attention(q, np.array([0, 4], np.int32), pc["k_pages"], pc["v_pages"], pc["kv_indptr"],
                                    pc["kv_indices"], pc["kv_last_page_len"], backend=HOST)


def test_paged_prefill_sm90_reads_flashinfers_combined_cache(monkeypatch) -> None:
    # FlashInfer's (pages, 2, page_size, kv_heads, D) cache through its K and V views (s_page twice a K page's)
    rng = np.random.default_rng(11)
    pc = make_paged(rng, [170, 33], 16, 2, 64, "NHD", "bf16")
    combined = np.ascontiguousarray(np.stack([pc["k_pages"], pc["v_pages"]], axis=1))
    qo = np.array([0, 100, 133], np.int32)
    q = make_q(rng, (133, 4, 64), "bf16")
    names = _record(monkeypatch)
    out, lse = ops.paged_prefill_attention(q, qo, combined[:, 0], combined[:, 1], pc["kv_indptr"], pc["kv_indices"],
                                           pc["kv_last_page_len"], return_lse=True, backend=HOST)
    assert names == ["paged_prefill_sm90_d64_bf16"]
    ref_out, ref_lse = np_ragged_attention(q.astype(np.float64), qo, pc["ks"], pc["vs"], True)
    close("out", out, ref_out, "paged_prefill_attention", "bf16")
    check_lse(lse, ref_lse)


def test_paged_prefill_sm90_off_keeps_the_other_kernels(monkeypatch) -> None:
    # PYKERN_SM90=0: the FlashAttention-2 core (16-bit cache of q's type, power-of-two pages) and paged_attn (FP8)
    monkeypatch.setenv("PYKERN_SM90", "0")
    rng = np.random.default_rng(5)
    names = _record(monkeypatch)
    out, lse, ref_out, ref_lse = _run(rng, [150, 20], [130, 20], 16, 4, 1, 128, "bf16", "bf16")
    close("out", out, ref_out, "paged_prefill_attention", "bf16")
    out, lse, ref_out, ref_lse = _run(rng, [150, 20], [130, 20], 16, 4, 1, 64, "f16", "e4m3")
    close("out", out, ref_out, "paged_prefill_attention", "f16")
    assert names == ["paged_prefill_tc_d128_bf16", "paged_attn_f16_e4m3kv"]


def test_paged_prefill_d256_sm90_off_keeps_paged_attn(monkeypatch) -> None:
    # head_dim 256 with PYKERN_SM90=0: paged_attn for an FP8 cache and a 16-bit one (paged_prefill_tc stops at 128)
    monkeypatch.setenv("PYKERN_SM90", "0")
    rng = np.random.default_rng(9)
    names = _record(monkeypatch)
    out, lse, ref_out, ref_lse = _run(rng, [70, 5], [40, 5], 16, 2, 1, 256, "bf16", "e4m3")
    close("out", out, ref_out, "paged_prefill_attention", "bf16")
    check_lse(lse, ref_lse)
    out, lse, ref_out, ref_lse = _run(rng, [70, 5], [40, 5], 16, 2, 1, 256, "f16", "f16")
    close("out", out, ref_out, "paged_prefill_attention", "f16")
    assert names == ["paged_attn_bf16_e4m3kv", "paged_attn_f16"]


def test_paged_prefill_d256_fp8_shared_memory_and_strides() -> None:
    # the FP8 d256 kernels take the staging buffer (BC rows of K's and V's bytes) beyond the forward's shared memory,
    # within the 227 KiB an sm_90 CTA may have; the others take the forward's
    assert sm90.paged_shared_bytes(256, 256, "e4m3") == sm90.shared_bytes(256) + 64 * 512 <= 227 * 1024
    assert sm90.paged_shared_bytes(256, 256, "bf16") == sm90.shared_bytes(256)
    assert sm90.paged_shared_bytes(128, 128, "e5m2") == sm90.shared_bytes(128)
    # its 16-byte cp.async pieces need strides in whole 16 elements: 8 (enough for the 8-byte loads elsewhere)
    # declines, nothing launched
    rng = np.random.default_rng(10)
    q = make_q(rng, (4, 2, 256), "bf16")
    flat = np.zeros(4 * 16 * 256 + 8, np.uint8)
    out, lse = np.empty((4, 2, 256), q.dtype), np.empty((4, 2), np.float32)
    table = (np.array([0, 1], np.int32), np.array([0], np.int32), np.array([4], np.int32))
    args = (q, flat, flat, out.reshape(-1), lse.reshape(-1), np.array([0, 4], np.int32), table,
            (1, 4, 2, 1, 256, 16))
    assert not sm90.try_paged_prefill(*args, (16 * 264, 264, 8), ("bf16", "e4m3"), 0.1, 0.0, 1.0, 64, 0, None, HOST)


def test_paged_prefill_sm90_only_where_it_applies(monkeypatch) -> None:
    # f32 queries, head_dim 32 (no sm_90a instantiation) keep paged_attn; bf16 at head_dim 128 takes sm_90a
    rng = np.random.default_rng(6)
    names = _record(monkeypatch)
    _run(rng, [40], [10], 16, 2, 1, 64, "f32", "e5m2")
    _run(rng, [40], [10], 16, 2, 1, 32, "bf16", "bf16")
    assert names == ["paged_attn_e5m2kv", "paged_attn_bf16"]


@pytest.mark.parametrize("shape", [(64, None), (192, 128), (96, None)], ids=["d64", "d192_dv128", "d96"])
@pytest.mark.parametrize("schedule", ["reverse", "random:7"])
def test_paged_prefill_sm90_under_other_thread_schedules(schedule, shape, monkeypatch) -> None:
    # the producer's 128 gathering threads and the consumers in any order: the same bits as the forward order
    # (192 / 128: the K pass and the V pass of the gather; d96: 32-column boxes)
    rng = np.random.default_rng(8)
    d, dv = shape
    args = ([200, 30], [140, 30], 5, 2, 1, d, "bf16", "e4m3")
    out0, lse0, _, _ = _run(np.random.default_rng(8), *args, d_v=dv)
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    out1, lse1, _, _ = _run(rng, *args, d_v=dv)
    np.testing.assert_array_equal(np.asarray(out0).view(np.uint16), np.asarray(out1).view(np.uint16))
    np.testing.assert_array_equal(lse0, lse1)


# --------------------------------------------------------------------------- SASS (NVRTC, no GPU)
SRC = Path(__file__).resolve().parent.parent / "kernels_cu" / "attention_fwd_sm90.cu"
PAGED = [sm90.paged_kernel_name(d, c, q, kv, dv) for d, dv in sm90.PAGED_SHAPES for c in (0.0, 1.0)
         for q in ("bf16", "f16") for kv in (q, "e4m3", "e5m2")]


@lru_cache(maxsize=None)
def _sass():
    mod, text = compile_sass(SRC, "sm_90a")
    return mod, text, report().count_sass(text), report().steady_state_loops(text)


def test_every_paged_kernel_is_checked() -> None:
    import pykern

    assert sorted(PAGED) == sorted(k.name for k in pykern.kernels() if k.name.startswith("paged_prefill_sm90"))


@pytest.mark.parametrize("kernel", PAGED)
def test_paged_sass_hopper_instructions_and_no_spills(kernel: str) -> None:
    mod, text, counts, loops = _sass()
    body = text.split(f"Function : {kernel}\n", 1)[1].split("Function :", 1)[0]
    ops_ = re.findall(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)", body)
    d = int(kernel.split("_d")[1].split("_")[0])
    dv = int(kernel.split("_dv")[1].split("_")[0]) if "_dv" in kernel else d
    assert any(op.startswith(f"HGMMA.64x{sm90._CFG[d][0]}x16.F32") for op in ops_)  # S = Q K^T
    assert any(op.startswith(f"HGMMA.64x{dv}x16.F32") for op in ops_)  # O += P V
    assert any(op.startswith("UTMALDG.4D") for op in ops_)  # Q
    assert sum(op.startswith("SYNCS") for op in ops_) >= 4  # mbarrier init / arrive / try_wait
    fp8 = kernel.endswith("kv")
    staged = fp8 and d in sm90.PAGED_FP8_STAGED
    # the gather: cp.async for a 16-bit cache; 8-byte loads for FP8 (widened in registers, then stored); at d256 FP8
    # cp.async to the staging buffer, then 8-byte shared loads widened and stored
    assert any(op.startswith("LDGSTS") for op in ops_) == (not fp8 or staged)
    if fp8:
        assert any(op.startswith("LDG.E.64") for op in ops_) != staged
        assert any(op.startswith("LDS.64") for op in ops_) or not staged
        assert any(op.startswith("STS.128") for op in ops_)
    assert counts[kernel]["LDL"] == counts[kernel]["STL"] == 0
    res = mod.resources[kernel]
    assert res.spill_stores == 0 and res.spill_loads == 0
    # the consumers' steady loop is the varlen kernel's (its bar: tests/test_attention_sm90.py)
    varlen = kernel.replace("paged_prefill_sm90", "attention_fwd_varlen_sm90").split("_e")[0]
    assert loops[kernel]["mma"] == loops[varlen]["mma"]
    # the varlen kernel's ping-pong (a BAR.SYNC and a BAR.ARV a tile; d64 with softcap too, in its 232 consumer
    # registers); the pair loop's (d64, d256) warpgroup check is a BAR.RED
    tiles = sm90.LOOP_TILES[d]
    pp = sm90.PING_PONG[d]
    assert loops[kernel]["bar"] == (1 if tiles == 2 else 0) + (2 * tiles if pp else 0), loops[kernel]
    assert loops[kernel]["per_mma"] <= loops[varlen]["per_mma"] + 0.01, (loops[kernel], loops[varlen])
    if d == 96:  # the varlen d96 loop: 296 instructions a tile (1.542; dense 1.495), softcap 424 (2.208; dense 2.161)
        assert loops[kernel]["per_mma"] <= (2.21 if "_softcap" in kernel else 1.55), loops[kernel]
