"""The wave model of the tensor-core paged decode (pykern/ops/_decode_waves.py) against the H200 measurement it
was derived from (docs/measured/2026-11-27-h200/decode.json): one measured rate a CTA, nothing from a peer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import pykern.ops._decode_waves as waves

MEASURED = Path(__file__).resolve().parent.parent / "docs" / "measured" / "2026-11-27-h200" / "decode.json"
SLOTS = 132 * 3  # decode_tc_paged_d128_bf16: 3 CTAs an SM


def _cells() -> list[dict]:
    return [r for r in json.loads(MEASURED.read_text()) if r.get("what") == "decode" and r["kv"] == "bf16"]


def _model_s(r: dict) -> float:
    grid = r["launches"][0][1]
    ctas, s = grid[0] * grid[2], grid[2]
    cta_bytes = 2 * r["ctx"] * 128 * 2 / s + (2 * r["gqa"] * (2 * 128 + 4) if s > 1 else 0)
    return waves.grid_stream_time(ctas, SLOTS, cta_bytes) + (waves.MERGE_TAIL_S if s > 1 else 0.0)


def test_rate_is_the_measured_tail_of_batch_64() -> None:
    # 512 CTAs: a full wave of 396 at the copy speed, then 116 CTAs each at the rate of one CTA.
    cells = {(r["gqa"], r["batch"], r["ctx"]): r for r in _cells()}
    rates = []
    for ctx in (8192, 32768):
        for g in (1, 4, 8):
            r = cells[(g, 64, ctx)]
            cta = 2 * ctx * 128 * 2
            rates.append(cta / (r["pykern_us"] * 1e-6 - SLOTS * cta / waves.HBM_BPS))
    assert min(rates) > 18.5e9 and max(rates) < 20.5e9, rates
    assert waves.CTA_STREAM_BPS == pytest.approx(sum(rates) / len(rates), rel=0.02)
    from pykern.ops.serving import dtc_inflight_bytes

    assert waves.CTA_STREAM_INFLIGHT == dtc_inflight_bytes(128, 2)  # the ring of the kernel it was measured on
    assert waves.HBM_SATURATING_CTAS == pytest.approx(219.5, abs=1)


def test_model_is_a_lower_bound_of_every_measured_bf16_step() -> None:
    # No fixed latency in the model (launch, first loads, merge beyond its tail): it may undershoot short steps by
    # that, never overshoot beyond the spread of its own calibration cells.
    for r in _cells():
        t = _model_s(r)
        assert t <= 1.01 * r["pykern_us"] * 1e-6, (r["gqa"], r["batch"], r["ctx"], t)
        if r["pykern_us"] > 500:  # long steps: the fixed latency is small beside them
            assert t >= 0.98 * r["pykern_us"] * 1e-6, (r["gqa"], r["batch"], r["ctx"], t)


def test_grid_stream_time() -> None:
    b, bw, rate = 1e6, waves.HBM_BPS, waves.CTA_STREAM_BPS
    # under HBM_SATURATING_CTAS at once: each CTA at its own rate
    assert waves.grid_stream_time(100, 396, b) == pytest.approx(b / rate)
    # a saturated full wave and a saturated last one: HBM speed
    assert waves.grid_stream_time(396 + 300, 396, b) == pytest.approx(696 * b / bw)
    # a full wave and a last wave of 116: the last one at 116 CTAs' rate
    assert waves.grid_stream_time(512, 396, b) == pytest.approx(396 * b / bw + b / rate)
    # from DRIFT_WAVES full waves on the last wave overlaps the others
    n = waves.DRIFT_WAVES * 396 + 10
    assert waves.grid_stream_time(n, 396, b) == pytest.approx(n * b / bw)
    assert waves.grid_stream_time(0, 396, b) == 0.0
    # Little's law: half the bytes in flight, half the rate
    assert waves.cta_rate(16 * 1024) == pytest.approx(rate / 2)
    assert waves.wave_efficiency(512, 396) == pytest.approx(512 / (396 + bw / rate))


def test_wave_splits_take_the_fewest_within_the_margin() -> None:
    cta = 2 * 8192 * 128 * 2
    assert waves.wave_splits(512, 396, cta, 2080, 32) == 2
    assert waves.wave_splits(512, 396, cta, 2080, 1) == 1  # the cap (max_kv_len / 64 positions) holds
    assert waves.wave_splits(1024, 396, cta, 2080, 32) == 1  # a last wave of 232: saturated
    assert waves.wave_splits(400, 396, cta, 2080, 32) == 4  # 4 CTAs alone after a full wave: split them thin
    # a short step: the merge's tail outweighs what a thin last wave costs
    assert waves.wave_splits(136, 396, 2 * 64 * 128 * 2, 2080, 32) == 1
