"""tools/bench_decode.py --roofline: the paged decode model built from our own SASS loop bodies (no GPU)."""
from __future__ import annotations

import pytest

from sass_helpers import tool

def _bd():
    return tool("bench_decode")


@pytest.fixture(scope="module")
def costs():
    bd = _bd()
    try:
        return bd, bd.sass_costs("paged_attn_bf16")
    except Exception as e:  # no cuobjdump / NVRTC here
        if type(e).__name__ in ("CuobjdumpUnavailable", "CompileError", "NvrtcUnavailable"):
            pytest.skip(f"no SASS: {e}")
        raise


def test_sass_costs_come_from_the_cp_async_kernel(costs) -> None:
    bd, c = costs
    # one 16-byte K+V chunk pair: two LDGSTS plus addressing (page table, division by page size)
    assert 10 < c["fill"] < 400
    assert 8 <= c["score"] < 100  # 8 bf16 FMAs a 16-byte chunk at least
    assert 1 <= c["pv"] < 20
    assert c["copies"] >= 16 and c["per_k"] > 0 and 0 < c["registers"] <= 255


def test_rows_name_a_binding_term_and_stay_under_peak(costs) -> None:
    bd, c = costs
    for g in (1, 4, 8):
        for b in (1, 16, 256):
            r = bd.roofline_row(b, g, 4096, "bf16", c)
            assert r["bind"] in ("HBM", "issue", "latency")
            assert r["t"] >= max(r["t_hbm"], r["t_issue"], r["t_lat"]) - 1e-12
            assert 0 < r["pct"] <= 100.0
            # bytes: K and V once a kv head (one row chunk for these groups) plus small extras
            assert 1.0 <= r["x_min"] < 1.2
    # more query heads a kv head: more P.V work over the same bytes -> never faster
    t = [bd.roofline_row(64, g, 4096, "bf16", c)["t"] for g in (1, 4, 8)]
    assert t[0] <= t[1] <= t[2]


@pytest.fixture(scope="module")
def tc_costs():
    bd = _bd()
    try:
        return bd, bd.tc_sass_costs()
    except Exception as e:  # no cuobjdump / NVRTC here
        if type(e).__name__ in ("CuobjdumpUnavailable", "CompileError", "NvrtcUnavailable"):
            pytest.skip(f"no SASS: {e}")
        raise


def test_tc_costs_come_from_the_hmma_tile_loop(tc_costs) -> None:
    bd, c = tc_costs
    assert c["mma"] == 32  # d128: 16 for S (8 k-steps x 2 n-tiles), 16 for P V (16 n-tiles)
    assert c["ldgsts"] >= 2 and 100 < c["loop"] < 4000 and c["rest"] > 0 and 0 < c["registers"] <= 255
    # the in-launch split merge: code after the ticket, with its partial-load loop (pa_merge_group_cta)
    assert 0 < c["fixup_loop"] < c["fixup"] < c["rest"] + c["loop"] + c["fixup"]


def test_tc_path_is_hbm_bound_where_the_grid_fills_the_gpu(costs, tc_costs) -> None:
    bd, old = costs
    _, c = tc_costs
    for g in (4, 8):
        for b, n in ((64, 8192), (256, 32768), (1, 32768), (8, 32768)):
            r = bd.tc_roofline_row(b, g, n, "bf16", c)
            assert r["bind"] == "HBM" and r["pct"] >= 85.0, (g, b, n, r)
            assert r["t_issue"] < r["t_hbm"] and r["t_tensor"] < r["t_hbm"] and r["t_smem"] < r["t_hbm"]
            o = bd.roofline_row(b, g, n, "bf16", old)
            assert o["bind"] == "issue" and o["pct"] < 50.0 < r["pct"]  # the scalar path it replaces
    # batch 1 at 1k: one launch (the last split CTA merges), so no launch term; what is left beside the
    # 1.3 us of K/V reads is the fixup tail (the ticket's release, the acq_rel ticket, lse and partial loads of
    # the last CTA), reported beside the bound: priced at HBM latency it outweighs the reads.
    r = bd.tc_roofline_row(1, 8, 1024, "bf16", c)
    assert r["launch"] == 0.0 and r["bind"] != "launch" and r["splits"] == 16
    # The last CTA merges as a whole: release, ticket, then each split's lse and partial in the same round:
    # 8 rows x 128 bf16 = 128 16-byte units (8 elements: the partial o is stored in the output's type), 1 a
    # thread, x 16 splits = 16 loads, 16 in flight: 1 round.
    assert r["tail_rt"] == 2 + 1 and r["t_tail"] > r["t_hbm"] and r["pct_tail"] < r["pct"]
    for b in (128, 256):  # no splits: no tail
        assert bd.tc_roofline_row(b, 8, 1024, "bf16", c)["t_tail"] == 0.0
    # batch 64 at 8k keys: two splits (the last wave of one split would hold 116 CTAs), so a tail, still
    # HBM-bound. At 1k keys a persistent grid: 512 items in one wave of 256 CTAs (2 items each), so one wave's
    # fixed time and one item switch instead of two waves' fixed time (one split in two waves: 83%, latency).
    r = bd.tc_roofline_row(64, 8, 8192, "bf16", c)
    assert r["splits"] == 2 and r["items_per_cta"] == 1 and r["t_tail"] > 0.0 and r["bind"] == "HBM"
    r = bd.tc_roofline_row(64, 8, 1024, "bf16", c)
    assert (r["splits"], r["items_per_cta"], r["ctas"]) == (1, 2, 256) and r["t_tail"] == 0.0, r
    assert r["bind"] == "HBM" and r["pct"] >= 85.0, r
    # every step pays each wave's fixed time (and a persistent CTA each item switch) on top of its binding term
    waves = bd._waves.fixed_waves(r["ctas"], bd.H100_SMS * r["occ"])
    assert waves == 1 and r["t_wave"] == pytest.approx(bd._waves.WAVE_START_S + bd._waves.ITEM_SWITCH_S)
    assert r["t"] == pytest.approx(r["t_hbm"] + r["t_wave"])


def test_tc_tail_round_trips_follow_the_merge(costs) -> None:
    # pa_merge_group_cta's chain: 2 (the ticket's release, the acq_rel ticket: no fence after it) + the
    # rounds of thread 0, each split's lse and 16-byte partial loaded together: its units (8 elements of a row,
    # the partial o in the output's 16-bit type; P threads share one in a small group, P the largest power of
    # two with P * next_pow2(units) <= 128) x its splits, head_dim / 8 in flight.
    bd, _ = costs
    t = bd.tc_tail_round_trips
    assert t(1, 8, 128) == (0, 0)
    assert t(16, 1, 128) == t(32, 1, 128) == (2 + 1, 1)  # 16 units, 8 threads each: 4 splits a thread
    assert t(32, 2, 128)[0] == t(32, 1, 64)[0] == 3        # 32 / 8 units: 8 / 2 splits, 16 / 8 in flight
    assert t(32, 4, 128)[0] == 2 + 1                       # 64 units, 2 threads each: 16 splits, 16 in flight
    assert t(32, 8, 128) == (2 + 2, 2)                     # a unit a thread, 32 splits, 16 in flight
    assert t(32, 16, 128) == (2 + 4, 4)                    # 2 units a thread
    assert t(40, 1, 128)[0] == 2 + 1                       # 5 splits a thread: one round, no lse chunks
    assert t(12, 3, 64)[0] == 2 + 1                        # 24 units: 4 threads a unit (32 * 4 <= 128)
    assert t(32, 16, 64)[0] == t(32, 16, 128)[0]           # half the units, half the loads in flight


def test_tc_fp8_conversion_term(costs) -> None:
    # Measured on an H200 (docs/measured/2026-11-27-h200/decode.json) the FP8 kernel then never passed ~2.7 TB/s
    # where the HBM term alone said >= 85% of peak. The missing term was the conversion pipe (published: 16
    # conversions a clock an SM). The measured kernel's tile loop (a warp, a 64-key tile, d128) widened K
    # e4m3 -> f16x2 (F2FP .UNPACK_B) -> fp32 halves (HADD2.F32) -> bf16x2 (F2FP .PACK_AB): 100 F2FP + 64
    # HADD2.F32, which binds at the H200's rates. Now Q K^T runs in f16 too (q rescaled by a power of two once a
    # CTA): the widening is one cvt a pair for K and V, 64 F2FP + P's 4 packs, and HBM binds again.
    bd, _ = costs
    c = bd.tc_sass_costs("decode_tc_paged_d128_e4m3kv_bf16")
    assert c["mma"] == 32 and c["ldgsts"] >= 2
    assert (c["cvt_f2fp"], c["cvt_hadd2_f32"]) == (64 + 4, 0), c
    b16 = bd.tc_sass_costs("decode_tc_paged_d128_bf16")
    assert (b16["cvt_f2fp"], b16["cvt_hadd2_f32"]) == (4, 0), b16  # P's bf16 packs only
    measured = dict(c, cvt_f2fp=100, cvt_hadd2_f32=64)  # the kernel measured on 2026-11-27
    try:
        bd.set_gpu("h200")  # 4.8 TB/s, 1.98 GHz
        for g in (4, 8):
            for b in (1, 8, 64, 256):
                if b == 256:  # one split then and now (smaller batches split differently since: 3 CTAs an SM)
                    r = bd.tc_roofline_row(b, g, 32768, "e4m3", measured)
                    assert r["bind"] == "cvt" and r["t_cvt"] > r["t_hbm"] > r["t_issue"], (g, b, r)
                r = bd.tc_roofline_row(b, g, 32768, "e4m3", c)
                assert r["t_cvt"] < r["t_hbm"] and r["t_issue"] < r["t_hbm"], (g, b, r)
                # HBM binds, the waves' fixed time on top (more of it where the step is short: FP8 at batch 1)
                assert r["bind"] == "HBM" and r["pct"] > (69.0 if b == 1 else 94.0), (g, b, r)
                rb = bd.tc_roofline_row(b, g, 32768, "bf16", b16)
                assert rb["bind"] == "HBM" and rb["pct"] > (82.0 if b == 1 else 97.0), (g, b, rb)
        # the term itself: every resident warp's conversions of every tile, a warp-instruction 32 conversions
        r = bd.tc_roofline_row(256, 8, 32768, "e4m3", measured)
        waves = -(-r["ctas"] // (bd.H100_SMS * r["occ"]))
        want = waves * r["occ"] * 4 * (32768 // 64) * (100 + 64) * 32 / (bd.CVT_RATE * 1.98e9)
        assert r["t_cvt"] == pytest.approx(want)
    finally:
        bd.set_gpu("h100")
    assert bd.CLOCK == 1.755e9 and bd.H100_BW == 3.35e12


def test_tc_fp8_shared_memory_term(costs) -> None:
    # FP8 K and V are read as bytes straight from the ring (ldmatrix of FP8 rows, V's .trans over byte pairs,
    # widened in registers): a 64-key d128 tile costs 16 KB copied in and 8 + 8 KB of K and V bytes read, 32 KB
    # (64 KB with V widened through a per-warp 16-bit tile, written and read back; 96 KB with K through one too,
    # which on the H200's rates tied the HBM term at batch 256).
    bd, _ = costs
    c = bd.tc_sass_costs("decode_tc_paged_d128_e4m3kv_bf16")
    assert c["mma"] == 32
    try:
        bd.set_gpu("h200")
        r = bd.tc_roofline_row(256, 8, 32768, "e4m3", c)
        waves = -(-r["ctas"] // (bd.H100_SMS * r["occ"]))
        assert r["t_smem"] == pytest.approx(waves * r["occ"] * (32768 // 64) * 32 * 1024 / (128 * 1.98e9))
        assert r["bind"] == "HBM" and r["t_smem"] < 0.35 * r["t_hbm"], r
    finally:
        bd.set_gpu("h100")


def test_tc_one_tile_ctas_count_the_fills_they_run(costs) -> None:
    # The ring fills behind `if (t0 < end)` are read from the SASS as the ranges their branches skip: STAGES - 1
    # prologue fills before the tile loop, one refill inside it, each holding the fill's 16-byte copies. A CTA
    # of one 64-key tile (batch 1 at 1k: 16 splits) runs the first prologue fill and no refill.
    bd, _ = costs
    from pykern.ops.serving import dtc_stages

    for kern, kv, eb in (("decode_tc_paged_d128_bf16", "bf16", 2), ("decode_tc_paged_d128_e4m3kv_bf16", "e4m3", 1)):
        c = bd.tc_sass_costs(kern)
        assert len(c["fill_pro"]) == dtc_stages(128, eb) - 1 and all(n > 16 for n in c["fill_pro"])
        assert 16 < c["refill"] < c["loop"], c
        one = bd.tc_roofline_row(1, 1, 1024, kv, c)
        assert one["splits"] == 16
        skipped = sum(c["fill_pro"][1:]) + c["refill"] + sum(c["fill_next"])  # one item a CTA: no next item
        want = 4 * (c["loop"] + c["rest"] - skipped) / (bd.ISSUE * bd.CLOCK)  # one CTA an SM, 4 warps
        assert one["t_issue"] == pytest.approx(want)
    # FP8 at batch 1, 1k keys: each CTA's one tile amortizes its fixed cost (loop + rest - skipped fills)
    e = bd.tc_sass_costs("decode_tc_paged_d128_e4m3kv_bf16")
    # (with bf16 q its rest includes rescaling q into f16 once an item, ~250 warp-instructions a warp, and the
    # work-item loop's code, counted as written: the item switch and the next item's Q loads, which a CTA of one
    # item skips, so an upper bound). What binds is latency: 128 CTAs of one tile each, each tile one loaded
    # latency (the measured rate a CTA with its one 16 KiB tile in flight), where HBM needs ~173 such CTAs
    # streaming at once.
    one = bd.tc_roofline_row(1, 1, 1024, "e4m3", e)
    t = max(one["t_cvt"], one["t_hbm"], one["t_lat"], one["t_issue"]) + one["t_wave"]
    assert one["t_wave"] == pytest.approx(bd._waves.WAVE_START_S)  # one wave
    assert one["pct"] == pytest.approx(100 * one["min_bytes"] / t / bd.H100_BW)
    assert one["bind"] == "latency" and max(one["t_issue"], one["t_hbm"]) < one["t_lat"], one
    cta = one["min_bytes"] * one["x_min"] / one["ctas"]
    assert one["t_lat"] == pytest.approx(cta / bd._waves.cta_rate(64 * 2 * 128))
