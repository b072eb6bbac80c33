"""The wave model of the tensor-core paged decode (pykern/ops/_decode_waves.py) against the H200 measurement it
was fit on (docs/measured/2026-11-28-h200/decode.json): a CTA's rate and a wave's fixed time of our own kernel,
nothing from a peer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import pykern.ops._decode_waves as waves

MEASURED = Path(__file__).resolve().parent.parent / "docs" / "measured" / "2026-11-28-h200" / "decode.json"
SLOTS = 132 * 3  # decode_tc_paged_d128_bf16: 3 CTAs an SM


def _cells() -> list[dict]:
    return [r for r in json.loads(MEASURED.read_text()) if r.get("what") == "decode" and r["kv"] == "bf16"]


def _model_s(r: dict) -> float:
    grid = r["launches"][0][1]
    ctas, s = grid[0] * grid[2], grid[2]
    cta_bytes = 2 * r["ctx"] * 128 * 2 / s + (2 * r["gqa"] * (2 * 128 + 4) if s > 1 else 0)
    return waves.grid_stream_time(ctas, SLOTS, cta_bytes) + (waves.MERGE_TAIL_S if s > 1 else 0.0)


def _pairs() -> list[tuple[float, float, float, float]]:
    """(one-split model, measured, two-split model, measured) seconds of the batch-64 bf16 steps."""
    out = []
    for r in _cells():
        if "one_split_us" not in r:
            continue
        assert r["launches"][0][1] == [512, 1, 2], r["launches"]  # the split the plan chose
        cta = 2 * r["ctx"] * 128 * 2
        rate = waves.CTA_STREAM_BPS  # read now: the default argument was bound at import
        t1 = waves.grid_stream_time(512, SLOTS, cta, rate)
        t2 = waves.grid_stream_time(1024, SLOTS, cta / 2 + 2 * r["gqa"] * (2 * 128 + 4), rate) + waves.MERGE_TAIL_S
        out.append((t1, r["one_split_us"] * 1e-6, t2, r["pykern_us"] * 1e-6))
    return out


def _fit_error(rate: float, wave: float, monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(waves, "CTA_STREAM_BPS", rate)
    monkeypatch.setattr(waves, "WAVE_START_S", wave)
    return sum(((m - t) / t) ** 2 for p in _pairs() for m, t in (p[:2], p[2:]))


def test_constants_are_the_fit_of_the_one_and_two_split_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # 18 steps: GQA 1/4/8 x 1k/8k/32k keys at batch 64, one split and two. The constants sit at the least-squares
    # minimum: moving either by 5% either way fits worse.
    assert len(_pairs()) == 9
    rate, wave = waves.CTA_STREAM_BPS, waves.WAVE_START_S
    best = _fit_error(rate, wave, monkeypatch)
    for dr, dw in ((1.05, 1), (0.95, 1), (1, 1.05), (1, 0.95)):
        assert _fit_error(rate * dr, wave * dw, monkeypatch) > best, (dr, dw)
    monkeypatch.undo()
    for m1, t1, m2, t2 in _pairs():
        assert m1 == pytest.approx(t1, rel=0.08) and m2 == pytest.approx(t2, rel=0.08)
    from pykern.ops.serving import dtc_inflight_bytes

    assert waves.CTA_STREAM_INFLIGHT == dtc_inflight_bytes(128, 2)  # the ring of the kernel it was measured on
    assert waves.HBM_SATURATING_CTAS == pytest.approx(182, abs=1)


def test_model_orders_one_and_two_splits_as_measured() -> None:
    # At 1k keys the second split's extra wave costs more than the thinner tail saves (measured: one split faster
    # by 7-11 us); at 8k and 32k two splits win by 10-12%. The model agrees in every cell.
    for m1, t1, m2, t2 in _pairs():
        assert (m2 < m1 * (1 - waves.MIN_GAIN)) == (t2 < t1), (m1, t1, m2, t2)


def test_model_is_near_every_measured_bf16_step() -> None:
    # No launch latency in the model: it may undershoot short steps by that, never overshoot by more than the
    # spread of its own fit; long steps within a few percent.
    for r in _cells():
        t = _model_s(r)
        assert t <= 1.03 * r["pykern_us"] * 1e-6, (r["gqa"], r["batch"], r["ctx"], t)
        if r["pykern_us"] > 200:
            assert t >= 0.93 * r["pykern_us"] * 1e-6, (r["gqa"], r["batch"], r["ctx"], t)


SWEEP = MEASURED.parent.parent / "2026-11-28-h200-b" / "decode_splits.json"


def test_plan_split_count_below_the_sms_is_the_measured_best() -> None:
    # Batch 1 and 8 (8 and 64 CTAs), 1k and 8k keys, bf16, GQA 4, each timed at 1 to 32 splits: the plan's count
    # is the fastest measured, or within MIN_GAIN of it.
    from pykern.ops.serving import PagedDecodePlan

    rows = [r for r in json.loads(SWEEP.read_text()) if r.get("what") == "decode"]
    assert len(rows) == 4
    for r in rows:
        us = {int(k): v for k, v in r["splits_us"].items()}
        s = PagedDecodePlan(r["batch"], 8 * r["gqa"], 8, 128, 16, q_dtype="bf16", max_kv_len=r["ctx"],
                            num_sms=132).num_splits
        assert us[s] <= min(us.values()) * (1 + waves.MIN_GAIN), (r["batch"], r["ctx"], s, us)


def test_grid_stream_time() -> None:
    b, bw, rate, w = 1e6, waves.HBM_BPS, waves.CTA_STREAM_BPS, waves.WAVE_START_S
    # under HBM_SATURATING_CTAS at once: each CTA at its own rate
    assert waves.grid_stream_time(100, 396, b) == pytest.approx(w + b / rate)
    # a saturated full wave and a saturated last one: HBM speed, and two waves' fixed time
    assert waves.grid_stream_time(396 + 300, 396, b) == pytest.approx(2 * w + 696 * b / bw)
    # a full wave and a last wave of 116: the last one at 116 CTAs' rate
    assert waves.grid_stream_time(512, 396, b) == pytest.approx(2 * w + 396 * b / bw + b / rate)
    # from DRIFT_WAVES full waves on the last wave overlaps the others
    n = waves.DRIFT_WAVES * 396 + 10
    assert waves.grid_stream_time(n, 396, b) == pytest.approx(waves.DRIFT_WAVES * w + n * b / bw)
    assert waves.grid_stream_time(0, 396, b) == 0.0
    # Little's law: half the bytes in flight, half the rate
    assert waves.cta_rate(16 * 1024) == pytest.approx(rate / 2)


def test_wave_splits_take_the_fewest_within_the_margin() -> None:
    cta = 2 * 8192 * 128 * 2
    assert waves.wave_splits(512, 396, cta, 2080, 32) == 2
    assert waves.wave_splits(512, 396, 2 * 1024 * 128 * 2, 2080, 32) == 1  # 1k keys: one split (measured faster)
    assert waves.wave_splits(512, 396, cta, 2080, 1) == 1  # the cap (max_kv_len / 64 positions) holds
    assert waves.wave_splits(1024, 396, cta, 2080, 32) == 1  # a last wave of 232: saturated
    assert waves.wave_splits(400, 396, cta, 2080, 32) == 4  # 4 CTAs alone after a full wave: split them thin
    # a short step: the merge's tail outweighs what a thin last wave costs
    assert waves.wave_splits(136, 396, 2 * 64 * 128 * 2, 2080, 32) == 1
