"""Tensor-core paged decode for GQA (kernels_cu/decode_tc.cu) on the host backend against float64 NumPy:
GQA 4 / 8 / 16 and MQA, page sizes 1 and 16 with ragged last pages and empty sequences, split-KV on and
off (merged in the same launch by the last split CTA; its ticket counters left at zero), batch 1 and several, bf16 through the op and f16 through the kernels
directly, forward / reverse / random thread schedules and racecheck; the op's dispatch (which kernel
runs when); and the SASS of the new kernels (HMMA, LDGSTS.E.BYPASS.128, no spills on any arch)."""
from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_helpers import need as _need  # noqa: E402
from pykern import ops  # noqa: E402
from pykern.difftest.cases.serving import make_paged, make_q, np_ragged_attention  # noqa: E402
from pykern.difftest.cases.decode_tc import launch_f16  # noqa: E402
from pykern.ops.serving import dtc_smem_bytes  # noqa: E402
from sass_helpers import report as _report, source_sass  # noqa: E402
from launch_spy import record_launches  # noqa: E402
from family_helpers import close_attention as _close  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """Names of the kernels launched through pykern.launcher.launch during the test."""
    return record_launches(monkeypatch)


def _ref(pc: dict, q: np.ndarray, window_left: int = -1) -> tuple[np.ndarray, np.ndarray]:
    ks, vs = pc["ks"], pc["vs"]
    if window_left >= 0:  # the query (the last position) sees the last window_left + 1 keys
        ks = [k[max(0, len(k) - 1 - window_left):] for k in ks]
        vs = [v[max(0, len(v) - 1 - window_left):] for v in vs]
    return np_ragged_attention(np.asarray(q, np.float64), np.arange(q.shape[0] + 1), ks, vs)


CASES = [  # (heads, kv_heads, head_dim, page_size, lens, num_splits)
    ((8, 2), 64, 16, [70, 0, 3, 33], None),     # GQA 4, several sequences, an empty one, ragged last pages
    ((8, 2), 64, 1, [70, 0, 3, 33], 3),         # page size 1, split-KV (some splits see nothing)
    ((16, 2), 128, 16, [150, 17], 1),           # GQA 8, no split
    ((16, 2), 128, 1, [150, 17], 4),            # GQA 8, page size 1, split
    ((8, 1), 128, 16, [131], None),             # MQA (one kv head, 8 query heads), batch 1 (splits to fill)
    ((16, 1), 64, 16, [200], 2),                # MQA with a group of 16 (the whole M tile), batch 1
    ((4, 4), 128, 16, [70, 0, 3, 33], None),    # no grouping (MHA): one row of the M tile a kv head
    ((4, 2), 64, 1, [70, 9], 2),                # GQA 2, page size 1, split
]


@pytest.mark.parametrize("case", CASES, ids=[f"h{c[0][0]}kv{c[0][1]}d{c[1]}p{c[2]}s{c[4]}" for c in CASES])
def test_tc_decode_matches_float64(case, launched) -> None:
    _need("host")
    (h, kvh), d, ps, lens, ns = case
    rng = np.random.default_rng(h * 1000 + d + ps)
    pc = make_paged(rng, lens, ps, kvh, d, "NHD", "bf16")
    q = make_q(rng, (len(lens), h, d), "bf16")
    plan = ops.PagedDecodePlan(len(lens), h, kvh, d, ps, q_dtype="bf16", num_splits=ns, max_kv_len=max(lens))
    assert plan.tensor_cores
    out, lse = ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                          pc["kv_last_page_len"], plan=plan, return_lse=True, backend="host")
    assert launched[0] == f"decode_tc_paged_d{d}_bf16"
    assert launched[1:] == []  # split or not: one launch
    assert not np.asarray(plan.counters).any()
    ro, rl = _ref(pc, q)
    _close(out, ro, "paged_decode_attention", "bf16")
    _close(lse, rl, "paged_decode_attention", "bf16")
    for b, n in enumerate(lens):
        if n == 0:
            assert (np.asarray(out[b], np.float64) == 0).all() and np.isneginf(lse[b]).all()


def test_tc_decode_hnd_and_window(launched) -> None:
    _need("host")
    rng = np.random.default_rng(5)
    lens = [90, 41]
    pc = make_paged(rng, lens, 16, 2, 64, "HND", "bf16")
    q = make_q(rng, (2, 8, 64), "bf16")
    out, lse = ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                          pc["kv_last_page_len"], kv_layout="HND", window_left=20,
                                          return_lse=True, backend="host")
    assert launched[0] == "decode_tc_paged_d64_bf16"
    ro, rl = _ref(pc, q, window_left=20)
    _close(out, ro, "paged_decode_attention", "bf16")
    _close(lse, rl, "paged_decode_attention", "bf16")


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random:5"])
def test_tc_decode_schedules_agree_bitwise(schedule, monkeypatch) -> None:
    # A missing barrier in the ring or the end-of-CTA merge changes the result under some thread order.
    _need("host")
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    rng = np.random.default_rng(9)
    lens = [200, 7]
    pc = make_paged(rng, lens, 16, 2, 64, "NHD", "bf16")
    q = make_q(rng, (2, 8, 64), "bf16")
    outs = []
    for ns in (1, 3):
        plan = ops.PagedDecodePlan(2, 8, 2, 64, 16, q_dtype="bf16", num_splits=ns)
        out, lse = plan.run(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                            pc["kv_last_page_len"], return_lse=True, backend="host")
        ro, rl = _ref(pc, q)
        _close(out, ro, "paged_decode_attention", "bf16")
        outs.append((np.asarray(out, np.float64).copy(), np.asarray(lse).copy()))
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "forward")
    for ns, (o, l) in zip((1, 3), outs):
        plan = ops.PagedDecodePlan(2, 8, 2, 64, 16, q_dtype="bf16", num_splits=ns)
        o2, l2 = plan.run(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                          pc["kv_last_page_len"], return_lse=True, backend="host")
        assert np.array_equal(np.asarray(o2, np.float64), o) and np.array_equal(np.asarray(l2), l)


@pytest.mark.parametrize("kind", ["bf16", "e4m3"])
def test_tc_decode_racecheck_clean(kind: str, monkeypatch, launched) -> None:
    _need("host")
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    rng = np.random.default_rng(12)
    lens = [150, 3]
    pc = make_paged(rng, lens, 16, 1, 64, "NHD", kind)
    q = make_q(rng, (2, 4, 64), "bf16")
    sc = pc["scales"] if kind == "e4m3" else (None, None)
    for ns in (1, 2):
        plan = ops.PagedDecodePlan(2, 4, 1, 64, 16, q_dtype="bf16", kv_dtype=kind, num_splits=ns)
        out, lse = plan.run(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                            pc["kv_last_page_len"], k_scale=sc[0], v_scale=sc[1], return_lse=True, backend="host")
        assert launched[-1].startswith("decode_tc_paged_d64")
        assert not np.asarray(plan.counters).any()
        ro, rl = _ref(pc, q)
        _close(out, ro, "paged_decode_attention", "bf16")


FP8_CASES = [  # (kind, heads, kv_heads, head_dim, page_size, lens, num_splits)
    ("e4m3", 8, 2, 64, 16, [70, 0, 33], None),
    ("e5m2", 8, 2, 64, 1, [70, 0, 33], 3),
    ("e4m3", 16, 2, 128, 1, [150, 17], 4),
    ("e5m2", 16, 2, 128, 16, [150, 17], 1),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=[f"{c[0]}h{c[1]}kv{c[2]}d{c[3]}p{c[4]}s{c[6]}" for c in FP8_CASES])
def test_tc_decode_fp8_kv_matches_float64(case, launched) -> None:
    # FP8 pages (scaled: K = k_scale * fp8, V = v_scale * fp8) widened to bf16 in registers, bf16 q / out.
    _need("host")
    kind, h, kvh, d, ps, lens, ns = case
    rng = np.random.default_rng(d + ps + h)
    pc = make_paged(rng, lens, ps, kvh, d, "NHD", kind)
    q = make_q(rng, (len(lens), h, d), "bf16")
    plan = ops.PagedDecodePlan(len(lens), h, kvh, d, ps, q_dtype="bf16", kv_dtype=kind, num_splits=ns,
                               max_kv_len=max(lens))
    out, lse = ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                          pc["kv_last_page_len"], plan=plan, k_scale=pc["scales"][0],
                                          v_scale=pc["scales"][1], return_lse=True, backend="host")
    assert launched[0] == f"decode_tc_paged_d{d}_{kind}kv_bf16"
    ro, rl = _ref(pc, q)
    _close(out, ro, "paged_decode_attention", "bf16")
    _close(lse, rl, "paged_decode_attention", "bf16")


# --------------------------------------------------------------------------- f16 through the kernels
def _f16_pages(rng, lens, ps, kvh, d) -> dict:
    pc = make_paged(rng, lens, ps, kvh, d, "NHD", "f32")
    pc["k_pages"] = pc["k_pages"].astype(np.float16)
    pc["v_pages"] = pc["v_pages"].astype(np.float16)
    pc["ks"] = [k.astype(np.float16).astype(np.float64) for k in pc["ks"]]
    pc["vs"] = [v.astype(np.float16).astype(np.float64) for v in pc["vs"]]
    return pc


@pytest.mark.parametrize("d,ns,kv", [(64, 1, "f16"), (128, 3, "f16"), (128, 2, "e4m3"), (64, 1, "e5m2")])
def test_tc_decode_f16_kernels(d: int, ns: int, kv: str) -> None:
    # The op takes bf16 (f16 serving arrives with paged.cu's f16 kernels); the f16 instantiation of the
    # same template is checked here, launched as the op launches the bf16 one. The error model is the
    # tensor-core attention's (inputs exact, P rounded to f16): flash_attention's f16 row.
    _need("host")
    rng = np.random.default_rng(d + ns)
    lens, h, kvh, ps = [77, 0, 20], 8, 2, 16
    if kv == "f16":
        pc, ksc, vsc = _f16_pages(rng, lens, ps, kvh, d), 1.0, 1.0
    else:  # FP8 pages as raw bytes, widened to f16
        pc = make_paged(rng, lens, ps, kvh, d, "NHD", kv)
        pc["k_pages"], pc["v_pages"] = pc["k_pages"].view(np.uint8), pc["v_pages"].view(np.uint8)
        ksc, vsc = pc["scales"]
    q = rng.standard_normal((len(lens), h, d)).astype(np.float16)
    pc["scales"] = (ksc, vsc)
    out, lse = launch_f16(q, pc, ps, kvh, kv, ns, "host")  # checks the split tickets are back at zero
    ro, rl = _ref(pc, q)
    _close(out, ro, "flash_attention", "f16")
    _close(lse, rl, "flash_attention", "f16")
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()


# --------------------------------------------------------------------------- dispatch
def test_dispatch_picks_the_tensor_core_kernel_only_where_it_applies() -> None:
    P = ops.PagedDecodePlan
    assert P(4, 32, 8, 128, 16, q_dtype="bf16").launches()[0][0] == "decode_tc_paged_d128_bf16"
    assert P(4, 64, 8, 64, 16, q_dtype="bf16").launches()[0][0] == "decode_tc_paged_d64_bf16"
    assert P(4, 16, 8, 128, 16, q_dtype="bf16").launches()[0][0] == "decode_tc_paged_d128_bf16"  # group 2
    assert P(4, 8, 8, 128, 16, q_dtype="bf16").launches()[0][0] == "decode_tc_paged_d128_bf16"  # MHA
    assert P(4, 32, 1, 128, 16, q_dtype="bf16").launches()[0][0] == "paged_attn_bf16"  # group 32 > 16
    assert P(4, 32, 8, 96, 16, q_dtype="bf16").launches()[0][0] == "paged_attn_bf16"  # head_dim 96
    assert P(4, 32, 8, 128, 16).launches()[0][0] == "paged_attn"  # f32
    assert P(4, 32, 8, 128, 16, q_dtype="bf16", kv_dtype="float8_e4m3fn").launches()[0][0] == \
        "decode_tc_paged_d128_e4m3kv_bf16"  # FP8 K/V widened to bf16 in registers
    assert P(4, 32, 8, 64, 16, q_dtype="bf16", kv_dtype="e5m2").launches()[0][0] == "decode_tc_paged_d64_e5m2kv_bf16"
    assert P(4, 32, 8, 128, 16, kv_dtype="e4m3").launches()[0][0] == "paged_attn_e4m3kv"  # f32 q
    assert P(4, 32, 8, 128, 16, q_dtype="bf16", logits_soft_cap=30.0).launches()[0][0] == "paged_attn_bf16"
    assert P(4, 32, 8, 128, 16, q_dtype="bf16", tensor_cores=False).launches()[0][0] == "paged_attn_bf16"
    p = P(1, 32, 8, 128, 16, q_dtype="bf16", max_kv_len=4096)
    assert p.num_splits > 1 and [n for n, *_ in p.launches()] == ["decode_tc_paged_d128_bf16"]  # merged in-kernel
    assert [n for n, *_ in P(1, 32, 8, 128, 16, q_dtype="bf16", max_kv_len=4096, tensor_cores=False).launches()] == \
        ["paged_attn_bf16", "paged_attn_merge_bf16"]  # paged_attn keeps its merge launch
    assert p.launches()[0][3] == dtc_smem_bytes(128) == (2 * 2 * 64 + 16) * 136 * 2


def _off16(a: np.ndarray) -> np.ndarray:
    """A copy of the 16-bit array a whose data starts one element (2 bytes) past the start of a fresh buffer,
    so off every 16-byte boundary."""
    buf = np.zeros(a.size + 1, a.dtype)
    buf[1:] = a.reshape(-1)
    return buf[1:].reshape(a.shape)


def test_unaligned_pages_fall_back_to_paged_attn(launched) -> None:
    # Pages 2 bytes off a 16-byte boundary: the 16-byte cp.async of decode_tc cannot read them.
    _need("host")
    rng = np.random.default_rng(3)
    pc = make_paged(rng, [40, 9], 16, 2, 64, "NHD", "bf16")
    kp, vp = pc["k_pages"], pc["v_pages"]
    ku, vu = _off16(kp), _off16(vp)
    assert ku.ctypes.data % 16
    q = make_q(rng, (2, 8, 64), "bf16")
    out, lse = ops.paged_decode_attention(q, ku, vu, pc["kv_indptr"], pc["kv_indices"], pc["kv_last_page_len"],
                                          return_lse=True, backend="host")
    assert launched[0] == "paged_attn_bf16"
    ro, rl = _ref(pc, q)
    _close(out, ro, "paged_decode_attention", "bf16")


def test_unaligned_q_falls_back_to_paged_attn(launched) -> None:
    # q 2 bytes off a 16-byte boundary: decode_tc copies Q's rows as 16-byte cp.async chunks, so it runs
    # paged_attn; an aligned q of the same values runs decode_tc, and both match the reference.
    _need("host")
    rng = np.random.default_rng(4)
    pc = make_paged(rng, [40, 9], 16, 2, 64, "NHD", "bf16")
    q = make_q(rng, (2, 8, 64), "bf16")
    qu = _off16(q)
    assert qu.ctypes.data % 16
    ro, rl = _ref(pc, q)
    for qq, kern in ((qu, "paged_attn_bf16"), (q, "decode_tc_paged_d64_bf16")):
        del launched[:]
        out, lse = ops.paged_decode_attention(qq, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                              pc["kv_last_page_len"], return_lse=True, backend="host")
        assert launched[0] == kern
        _close(out, ro, "paged_decode_attention", "bf16")
        _close(lse, rl, "paged_decode_attention", "bf16")


def test_split_plan_partials_in_q_type_and_its_paged_attn_fallback(launched) -> None:
    # A split decode_tc plan keeps its partial o in q's type (bf16); the same plan, given an unaligned q at run
    # time, runs paged_attn + paged_attn_merge on fp32 partials of its own, then decode_tc again on an aligned
    # q: every run matches the reference.
    _need("host")
    rng = np.random.default_rng(5)
    pc = make_paged(rng, [40, 9], 16, 2, 64, "NHD", "bf16")
    q = make_q(rng, (2, 8, 64), "bf16")
    qu = _off16(q)
    plan = ops.PagedDecodePlan(2, 8, 2, 64, 16, q_dtype="bf16", kv_dtype="bf16", num_splits=3)
    assert plan.tensor_cores and plan.part_o.dtype == q.dtype and plan.part_o.size == 3 * 2 * 8 * 64
    ro, rl = _ref(pc, q)
    for qq, kern in ((q, "decode_tc_paged_d64_bf16"), (qu, "paged_attn_bf16"), (q, "decode_tc_paged_d64_bf16")):
        del launched[:]
        out, lse = _run_plan(plan, pc, qq)
        assert launched[0] == kern and len(launched) == (1 if kern.startswith("decode_tc") else 2), launched
        _close(out, ro, "paged_decode_attention", "bf16")
        _close(lse, rl, "paged_decode_attention", "bf16")
    assert plan._part_o_f32.dtype == np.float32 and not np.asarray(plan.counters).any()


@pytest.mark.parametrize("ns", [1, 3])
def test_unaligned_out_falls_back_to_paged_attn_and_an_aligned_one_is_written_in_place(ns: int, launched) -> None:
    # decode_tc stores out 16 bytes a unit (unsplit and in the split merge): an out= 2 bytes off a 16-byte
    # boundary runs paged_attn (+ its merge when split); an aligned out= runs decode_tc. Either way the
    # result lands in the array given (never in a copy) and matches the reference; the dense decode op too.
    _need("host")
    rng = np.random.default_rng(6)
    pc = make_paged(rng, [40, 9], 16, 2, 64, "NHD", "bf16")
    q = make_q(rng, (2, 8, 64), "bf16")
    ro, rl = _ref(pc, q)
    plan = ops.PagedDecodePlan(2, 8, 2, 64, 16, q_dtype="bf16", kv_dtype="bf16", num_splits=ns)
    for aligned, kern in ((False, "paged_attn_bf16"), (True, "decode_tc_paged_d64_bf16")):
        out = np.zeros((2, 8, 64), q.dtype) if aligned else _off16(np.zeros((2, 8, 64), q.dtype))
        assert (out.ctypes.data % 16 == 0) == aligned
        del launched[:]
        res = plan.run(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"], pc["kv_last_page_len"],
                       out=out, backend="host")
        assert res is out and launched[0] == kern, launched
        _close(out, ro, "paged_decode_attention", "bf16")
    # dense decode: one sequence's cache (HND), the same query rows
    kc = np.ascontiguousarray(pc["ks"][0].transpose(1, 0, 2)).astype(q.dtype)  # (kv heads, 40, 64), exact
    vc = np.ascontiguousarray(pc["vs"][0].transpose(1, 0, 2)).astype(q.dtype)
    for aligned, kern in ((False, "dense_attn_bf16"), (True, "decode_tc_paged_d64_bf16")):
        out = np.zeros((8, 64), q.dtype) if aligned else _off16(np.zeros((8, 64), q.dtype))
        del launched[:]
        res = ops.decode_attention(q[0], kc, vc, 40, out=out, backend="host", kv_layout="HND")
        assert launched[0].startswith(kern), launched
        _close(out, ro[0], "decode_attention", "bf16")
        assert res is out or np.shares_memory(res, out)


# --------------------------------------------------------------------------- SASS
TC_KERNELS = [f"decode_tc_paged_d{d}{kv}_{t}" for d in (64, 128) for kv in ("", "_e4m3kv", "_e5m2kv")
              for t in ("bf16", "f16")]


@lru_cache(maxsize=None)
def _sass(arch: str) -> str:
    return source_sass("decode_tc.cu", arch)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_sass_hmma_and_16_byte_cp_async_in_the_tile_loop(arch: str) -> None:
    sr = _report()
    loops = sr.steady_state_loops(_sass(arch))
    inner = sr.inner_loops(_sass(arch))
    for k in TC_KERNELS:
        d = int(k.split("_d")[1].split("_")[0])
        lp = loops[k]  # the tile loop: MMAs, no inner loop
        # S = Q K^T: d/16 k-steps x 2 n-tiles; O += P V: d/8 n-tiles (one k-step of 16 keys)
        assert lp["mma"] == d // 16 * 2 + d // 8, (k, arch, lp)
        row = next(r for r in inner[k] if r["start"] == lp["start"])
        assert row["ops"].get("LDGSTS.E.BYPASS.128", 0) >= 2, (k, arch, row["ops"])  # K and V refill
        hmma = {op: n for op, n in row["ops"].items() if op.startswith("HMMA.16816.F32")}
        # Q K^T and P V in q's type, except FP8 K/V, whose Q K^T and P V both run in f16 (K and V widen by one
        # cvt a pair; bf16 q rescaled into f16 once a CTA)
        n_bf16 = hmma.get("HMMA.16816.F32.BF16", 0)
        want = (d // 16 * 2 + d // 8) if k.endswith("bf16") and "kv_" not in k else 0
        assert n_bf16 == want and sum(hmma.values()) == lp["mma"], (k, arch, hmma)
        fp8 = "m3kv" in k or "m2kv" in k
        # V through .trans: 16 columns of 16-bit V an ldmatrix x4, 32 of FP8 V (its byte pairs as the 16-bit
        # elements), each FP8 word then one byte permute (PRMT) from (key, column pair) to (column, key pair)
        assert row["ops"].get("LDSM.16.MT88.4", 0) == (d // 32 if fp8 else d // 16), (k, arch, row["ops"])
        assert row["ops"].get("PRMT", 0) == (d // 8 if fp8 else 0), (k, arch, row["ops"])
        # FP8 V straight from the ring: no per-warp V tile written and read back in the tile loop (it doubled
        # the shared-memory bytes of a tile, 32 -> 64 KB at d128), so no shared store, no plain shared load
        assert not fp8 or not [op for op in row["ops"] if op.startswith(("STS", "LDS.")) or op == "LDS"], \
            (k, arch, row["ops"])


# Warp-instructions of the sm_90 tile loop (a warp, a 64-key tile), achieved + a small margin: the fill's page
# lookup walks pages without dividing (a lane a row, offsets shuffled to the copying lanes), FP8 widens a word at
# a time (f16: one cvt a pair; FP8 V is f16 for bf16 q too, its P V in f16), ldmatrix addresses are shared-window
# integers with immediate offsets. Before: d128 842 (16-bit) / 970 (FP8), d64 460 / 461, 8 integer divisions a
# tile; then d128 415 / 615, d64 285 / 380 (generic ldmatrix pointers, FP8 V widened to bf16 through fp32);
# then FP8 with bf16 q d128 495, d64 317 (K widened to bf16 through fp32; now Q K^T in f16 as for f16 q).
# 16-bit reads Q's A fragments from shared memory each tile (D / 16 LDSM a warp: 360 -> 371 at d128, whose 32
# registers of Q went to the work-item loop); FP8 keeps Q in registers and recomputes the item's head offset
# each fill (376 -> 399 at d128: at the register cap, held offsets spill).
LOOP_CEILING_SM90 = {"d128": 380, "d128_fp8_bf16": 415, "d128_fp8_f16": 415,
                     "d64": 255, "d64_fp8_bf16": 290, "d64_fp8_f16": 290}


def _ceiling_key(k: str) -> str:
    d = k.split("_d")[1].split("_")[0]
    if "m3kv" not in k and "m2kv" not in k:
        return f"d{d}"
    return f"d{d}_fp8_{k.rsplit('_', 1)[1]}"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tile_loop_has_no_integer_division_and_stays_lean(arch: str) -> None:
    sr = _report()
    text = _sass(arch)
    loops, funcs = sr.steady_state_loops(text), sr._instructions(text)
    for k in TC_KERNELS:
        lp = loops[k]
        lo, hi = int(lp["start"], 16), int(lp["end"], 16)
        body = [(op, mods) for a, op, mods, _ in funcs[k] if lo <= a <= hi]
        # software division / modulo (by the runtime page size): IABS, I2F, MUFU.RCP, F2I. I2F alone is the
        # pre-sm_89 FP8 widening's subnormal path, not a division.
        div = [op + mods for op, mods in body if op in ("IABS", "F2I") or (op == "MUFU" and mods.startswith(".RCP"))]
        assert not div, (k, arch, div)
        if arch == "sm_90":
            assert lp["insns"] <= LOOP_CEILING_SM90[_ceiling_key(k)], (k, lp["insns"])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_prologue_requests_the_page_table_first(arch: str) -> None:
    # The first tile's copies wait on two dependent page-table round trips (the sequence's indptr / last-page
    # entries, then its first pages' indices), so the kernel's first global requests are those three entries,
    # alone in their round: nothing else is issued ahead of them (FP8's Q, 2 * D / 8 word loads a lane, used to
    # go first and pushed them back by ~90 instructions), and the item decode before them stays short.
    sr = _report()
    funcs = sr._instructions(_sass(arch))
    for k in TC_KERNELS:
        ops = [op for _, op, _, _ in funcs[k] if op != "NOP"]
        ldg = [i for i, op in enumerate(ops) if op == "LDG"]
        first_copy = ops.index("LDGSTS")
        assert ldg[0] < 130, (k, arch, ldg[:4])  # 113 on sm_90 (FP8 before: 142, behind its Q loads)
        assert ldg[2] - ldg[0] == 2 and ldg[3] - ldg[0] > 50, (k, arch, ldg[:8])  # three, then a gap
        assert ldg[0] < first_copy, (k, arch)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_split_ticket_is_one_acq_rel_rmw_with_no_fence_after_it(arch: str) -> None:
    # The split tail's memory ordering (dtc_split_fixup): the release half of the acq_rel ticket is the one
    # MEMBAR (after the barrier that follows every thread's partial stores), the acquire half a local L1
    # invalidate (CCTL.IVALL) right after the ATOMG, and no fence after it: the merge's loads follow at once.
    sr = _report()
    funcs = sr._instructions(_sass(arch))
    for k in TC_KERNELS:
        ops = [(op, mods) for _, op, mods, _ in funcs[k] if op != "NOP"]
        at = [i for i, (op, _) in enumerate(ops) if op == "ATOMG"]
        assert len(at) == 1 and ".INC" in ops[at[0]][1], (k, arch)
        membar = [i for i, (op, _) in enumerate(ops) if op == "MEMBAR"]
        assert len(membar) == 1 and at[0] - 4 <= membar[0] < at[0] and ops[membar[0]][1] == ".ALL.GPU", (k, arch)
        assert ("CCTL", ".IVALL") in ops[at[0] + 1:at[0] + 3], (k, arch, ops[at[0]:at[0] + 3])
        bar = max(i for i, (op, _) in enumerate(ops[:membar[0]]) if op == "BAR")  # the barrier before the ticket
        assert not any(op in ("STG", "ST") for op, _ in ops[bar:at[0]]), (k, arch)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_split_partials_in_the_output_type_move_as_16_byte_accesses(arch: str) -> None:
    # The partial o is stored in T (8 elements a 16-byte access, its lse fp32): each CTA stores a unit with one
    # STG.E.128; after the ticket the merge loads, per batch of head_dim / 8 splits, one 16-byte strong load
    # (ld.relaxed.gpu.global.v4.b32) of o and one strong 32-bit load of lse per split, nothing else.
    sr = _report()
    funcs = sr._instructions(_sass(arch))
    for k in TC_KERNELS:
        d = 64 if "_d64" in k else 128
        ops = [op + mods for _, op, mods, _ in funcs[k] if op != "NOP"]
        at = next(i for i, op in enumerate(ops) if op.startswith("ATOMG"))
        loads = sorted(op for op in ops[at:] if op.startswith("LD") and ".STRONG" in op)
        assert loads == ["LDG.E.128.STRONG.GPU"] * (d // 8) + ["LDG.E.STRONG.GPU"] * (d // 8), (k, arch, loads)
        # three 16-byte stores: the partial's, the unsplit out's and the merged out's
        assert ops.count("STG.E.128") == 3, (k, arch)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_out_is_stored_16_bytes_at_a_time(arch: str) -> None:
    # Every global store of o is one 16-byte store of 8 elements (a lane's 8 two-byte stores at a 16-byte stride
    # touched every sector of a warp's 512 bytes 8 times: measured, ncu counted 32% of decode_tc's L2 sector
    # requests uncoalesced at batch 8 x 1k keys, H200, 2026-11-28); the only narrower stores are the fp32 lse.
    sr = _report()
    funcs = sr._instructions(_sass(arch))
    for k in TC_KERNELS:
        stores = sorted({op + mods for _, op, mods, _ in funcs[k] if op == "STG"})
        assert stores == ["STG.E", "STG.E.128"], (k, arch, stores)


def test_tc_split_count_fills_one_wave() -> None:
    # Below the SM count the tensor-core plan splits into the fewest CTAs (a power of two a sequence) that keep HBM
    # busy in one wave (3 CTAs an SM, 16-bit and FP8 d128): batch 8 x 8 kv heads takes 4 (256 CTAs, above the
    # ~182 that saturate HBM), which measured faster than the 6 that fill the 396 slots; never a second wave.
    P = ops.PagedDecodePlan
    p = P(8, 64, 8, 128, 16, q_dtype="bf16", max_kv_len=32768)
    assert p.num_splits == 4 and p.grid[0] * p.grid[2] <= 132 * 3
    p = P(8, 64, 8, 128, 16, q_dtype="bf16", kv_dtype="e4m3", max_kv_len=32768)
    assert p.num_splits == 4
    assert P(2, 64, 8, 128, 16, q_dtype="bf16", max_kv_len=32768).num_splits == 16
    assert P(1, 64, 8, 128, 16, q_dtype="bf16", max_kv_len=32768).num_splits == 32  # the cap
    assert P(1, 64, 8, 128, 16, q_dtype="bf16", max_kv_len=1024).num_splits == 16  # >= 64 positions a split
    # From the SM count on, splits only fill a last wave too thin to stream at HBM speed (tests/test_decode_waves.py):
    # 136 CTAs are below the ~220 that HBM needs at once, 256 are not.
    assert P(17, 64, 8, 128, 16, q_dtype="bf16", max_kv_len=32768).num_splits == 2
    assert P(32, 64, 8, 128, 16, q_dtype="bf16", max_kv_len=32768).num_splits == 1
    # 512 CTAs: two splits at 8k keys, one at 1k, where the extra wave's fixed time outweighs the thinner tail
    # (both as measured on the H200: docs/measured/2026-11-28-h200/decode.json, one_split_us)
    assert P(64, 64, 8, 128, 16, q_dtype="bf16", max_kv_len=8192).num_splits == 2
    assert P(64, 64, 8, 128, 16, q_dtype="bf16", max_kv_len=1024).num_splits == 1


# --------------------------------------------------------------------------- shared-memory banks
@pytest.mark.parametrize("kind,d", [("bf16", 64), ("bf16", 128), ("e4m3", 64), ("e5m2", 128)])
def test_ldmatrix_reads_are_bank_conflict_free(kind: str, d: int) -> None:
    # Every ldmatrix of the kernel (16-bit: Q, K, V .trans over rows of D + 8 halves; FP8: K, and V .trans of
    # byte pairs, over rows of D + 16 bytes) reads its 8 rows from distinct banks: one wavefront a matrix in
    # the host backend's bank model (pykern.backends.host.ldmatrix_bank_stats). Rows of D halves (or D bytes)
    # with no padding would put a matrix's 8 rows in the same 4 banks: 8 (or 4-8) wavefronts.
    _need("host")
    from pykern.backends.host import ldmatrix_bank_stats

    rng = np.random.default_rng(d)
    lens = [150, 9]
    pc = make_paged(rng, lens, 16, 2, d, "NHD", kind)
    q = make_q(rng, (2, 8, d), "bf16")
    sc = tuple(pc["scales"]) if kind != "bf16" else (None, None)
    plan = ops.PagedDecodePlan(2, 8, 2, d, 16, q_dtype="bf16", kv_dtype=kind, num_splits=2)
    _run_plan(plan, pc, q, sc)  # loads the library
    ldmatrix_bank_stats(reset=True)
    out, _ = _run_plan(plan, pc, q, sc)
    st = ldmatrix_bank_stats()["decode_tc"]
    # a warp's ldmatrix .x4 per 64-key tile: 16-bit d / 16 of Q, d / 16 of K, d / 16 of V; FP8 d / 32 of K and of V
    per_tile = 3 * d // 16 if kind == "bf16" else 2 * d // 32
    # 64-key tiles: each split takes ceil(n / 2) keys rounded up to whole tiles, the last one the rest; 2 kv heads
    per = [-(-n // 2 // 64) * 64 if n % 2 == 0 else -(-(n // 2 + 1) // 64) * 64 for n in lens]
    tiles = 2 * sum(-(-min(p, n) // 64) + -(-max(0, n - p) // 64) for p, n in zip(per, lens))
    assert st["phases"] == 4 * 4 * per_tile * tiles, st  # 4 matrices an .x4, 4 warps
    assert st["wavefronts"] == st["phases"] and st["worst"] == 1, st


@pytest.mark.parametrize("kind,d", [("bf16", 64), ("bf16", 128), ("e4m3", 64), ("e5m2", 128)])
def test_ring_fills_and_merge_reads_are_bank_conflict_free(kind: str, d: int) -> None:
    # The 16-byte shared-memory accesses (the host backend's 16-byte bank model: a quarter-warp a phase,
    # pykern.backends.host.shared_v4_bank_stats): the ring fill's cp.async (K, V; 16-bit also Q) and the 4-warp
    # merge's float4 reads of the warps' rows take one wavefront a phase. Before: the FP8 d64 fill's quarter-warps
    # took two consecutive 80-byte rows (groups 5 r .. 5 r + 3 mod 8: 2-way in one bank group), and the merge's
    # lanes read 16 bytes every 32 (2-way in every phase).
    _need("host")
    from pykern.backends.host import shared_v4_bank_model, shared_v4_bank_stats

    rng = np.random.default_rng(d + 1)
    pc = make_paged(rng, [150, 9], 16, 2, d, "NHD", kind)
    q = make_q(rng, (2, 8, d), "bf16")
    sc = tuple(pc["scales"]) if kind != "bf16" else (None, None)
    plan = ops.PagedDecodePlan(2, 8, 2, d, 16, q_dtype="bf16", kv_dtype=kind, num_splits=2)
    want = _run_plan(plan, pc, q, sc)  # loads the library
    shared_v4_bank_model(True)
    try:
        shared_v4_bank_stats(reset=True)
        got = _run_plan(plan, pc, q, sc)
        st = shared_v4_bank_stats()["decode_tc"]
    finally:
        shared_v4_bank_model(False)
    np.testing.assert_array_equal(got[0], want[0])
    # every CTA's fills (each tile: a 16-byte copy a thread a pass, K and V) and its merge reads were counted
    assert st["phases"] >= 4 * 2 * 2 * 4, st
    assert st["wavefronts"] == st["phases"] and st["worst"] == 1, st


# --------------------------------------------------------------------------- split-KV in one launch
def _run_plan(plan, pc, q, sc=(None, None)):
    out, lse = plan.run(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"], pc["kv_last_page_len"],
                        k_scale=sc[0], v_scale=sc[1], return_lse=True, backend="host")
    return np.asarray(out, np.float64).copy(), np.asarray(lse, np.float64).copy()


def test_split_decode_is_one_launch_and_matches_the_unsplit_one(launched) -> None:
    # The last split CTA of each (sequence, kv head) merges: no merge launch, the plan lists one launch, the
    # result agrees with one split (and both with float64), and the ticket counters are zero again after it.
    _need("host")
    rng = np.random.default_rng(21)
    lens = [300, 130, 0, 64]
    pc = make_paged(rng, lens, 16, 2, 64, "NHD", "bf16")
    q = make_q(rng, (4, 8, 64), "bf16")
    ro, rl = _ref(pc, q)
    res = {}
    for ns in (1, 5):
        plan = ops.PagedDecodePlan(4, 8, 2, 64, 16, q_dtype="bf16", num_splits=ns)
        assert len(plan.launches()) == 1 and plan.launches()[0][1] == (8 * ns, 1, 1)  # a CTA a work item
        del launched[:]
        res[ns] = _run_plan(plan, pc, q)
        assert launched == ["decode_tc_paged_d64_bf16"]
        assert np.asarray(plan.counters).shape == ((8,) if ns > 1 else (1,)) and not np.asarray(plan.counters).any()
        _close(res[ns][0], ro, "paged_decode_attention", "bf16")
        _close(res[ns][1], rl, "paged_decode_attention", "bf16")
    _close(res[5][0], res[1][0], "paged_decode_attention", "bf16")
    _close(res[5][1], res[1][1], "paged_decode_attention", "bf16")


MANY_SPLITS = [  # (kv kind, head_dim, page_size, num_splits, schedule, group)
    ("bf16", 64, 16, 16, "forward", 4),
    ("bf16", 64, 1, 32, "reverse", 4),
    ("bf16", 128, 16, 32, "interleave:3", 4),  # several blocks resident at once: tickets drawn in a mixed order
    ("e4m3", 64, 16, 24, "interleave", 4),
    # The whole-CTA merge's shapes: a group of 16 (each thread several 16-byte units), of 1 (8 threads share
    # a unit at d64, their sums added in order), of 3 (units not a multiple of the CTA), and more than 32
    # splits (two lse chunks: the running max rescales the first chunk's sums).
    ("bf16", 128, 16, 32, "interleave:3", 16),
    ("e4m3", 64, 16, 32, "reverse", 16),
    ("bf16", 64, 16, 32, "interleave", 1),
    ("bf16", 128, 16, 12, "forward", 3),
    ("bf16", 128, 16, 40, "interleave:3", 16),
]


@pytest.mark.parametrize("case", MANY_SPLITS, ids=[f"{c[0]}d{c[1]}p{c[2]}s{c[3]}g{c[5]}-{c[4]}" for c in MANY_SPLITS])
def test_many_splits_ragged_lengths(case, monkeypatch, launched) -> None:
    # 12 to 40 splits over ragged lengths: empty sequences, sequences shorter than the split count (most splits
    # see no key and still take their ticket), one just past a 64-key tile; a second step on the same plan
    # (as a CUDA graph replays it) finds the counters zero and gives the same bits; one split agrees.
    _need("host")
    kind, d, ps, ns, sched, g = case
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", sched)
    rng = np.random.default_rng(ns + d + ps + g)
    lens = [0, 1, 5, 31, 65, 400, 0]
    kvh = 2
    h = kvh * g
    pc = make_paged(rng, lens, ps, kvh, d, "NHD", kind)
    q = make_q(rng, (len(lens), h, d), "bf16")
    sc = tuple(pc["scales"]) if kind == "e4m3" else (None, None)
    plan = ops.PagedDecodePlan(len(lens), h, kvh, d, ps, q_dtype="bf16", kv_dtype=kind, num_splits=ns)
    assert plan.num_splits == ns and len(plan.launches()) == 1
    out, lse = _run_plan(plan, pc, q, sc)
    assert len(launched) == 1 and launched[0].startswith(f"decode_tc_paged_d{d}")
    assert not np.asarray(plan.counters).any()
    ro, rl = _ref(pc, q)
    _close(out, ro, "paged_decode_attention", "bf16")
    _close(lse, rl, "paged_decode_attention", "bf16")
    for b, n in enumerate(lens):
        if n == 0:
            assert (out[b] == 0).all() and np.isneginf(lse[b]).all()
    out2, lse2 = _run_plan(plan, pc, q, sc)
    assert np.array_equal(out2, out) and np.array_equal(lse2, lse)
    assert not np.asarray(plan.counters).any()
    one = ops.PagedDecodePlan(len(lens), h, kvh, d, ps, q_dtype="bf16", kv_dtype=kind, num_splits=1)
    o1, l1 = _run_plan(one, pc, q, sc)
    _close(out, o1, "paged_decode_attention", "bf16")
    _close(lse, l1, "paged_decode_attention", "bf16")


@pytest.mark.parametrize("sched,g,ns,d", [("forward", 4, 6, 64), ("interleave:5", 4, 6, 64),
                                          ("interleave:5", 16, 40, 128)])
def test_split_merge_racecheck_clean(sched: str, g: int, ns: int, d: int, monkeypatch) -> None:
    # The partials cross blocks: plain stores, __threadfence, the ticket atomic; the last CTA's fence and
    # strong (ld.relaxed.gpu) loads. Racecheck, with blocks one at a time and interleaved, reports nothing.
    _need("host")
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", sched)
    rng = np.random.default_rng(33)
    lens = [260, 0, 9]
    pc = make_paged(rng, lens, 16, 2, d, "NHD", "bf16")
    q = make_q(rng, (3, 2 * g, d), "bf16")
    plan = ops.PagedDecodePlan(3, 2 * g, 2, d, 16, q_dtype="bf16", num_splits=ns)
    out, lse = _run_plan(plan, pc, q)
    ro, rl = _ref(pc, q)
    _close(out, ro, "paged_decode_attention", "bf16")
    assert not np.asarray(plan.counters).any()
