"""Split-KV in the `auto` plans: whenever batch * kv_heads CTAs leave SMs idle (below the 132 of an H100),
decode_plan's auto and PagedDecodePlan's default split each sequence's KV range so the grid covers the GPU.
At or above the SM count the scalar plans do not split (no partials round trip, no merge launch); the
tensor-core decode splits only where its last wave would hold too few CTAs to stream at HBM speed
(pykern/ops/_decode_waves.py)."""
from __future__ import annotations

import pytest

import pykern.ops._decode_waves as waves
from pykern.ops.decode import decode_plan
from pykern.ops.serving import PagedDecodePlan, dtc_smem_bytes

SMS = 132


def _grid_ctas(launch: tuple) -> int:
    n = 1
    for g in launch[1]:
        n *= g
    return n


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("ctx", [1024, 4096, 32768])
@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 17, 32, 64, 128, 256])
def test_auto_splits_exactly_when_ctas_leave_sms_idle(batch: int, ctx: int, group: int) -> None:
    kvh = 8
    p = decode_plan(batch, kvh * group, kvh, 128, ctx, method="auto", seq_hint=ctx)
    if batch * kvh < SMS:
        assert p["method"] == "split_k" and p["num_splits"] > 1, (batch, p)
        # the split grid covers every SM, unless splits would drop below 64 positions
        assert _grid_ctas(p["launches"][0]) >= min(SMS, batch * kvh * (ctx // 64)), p
        assert p["launches"][1][0] == "paged_attn_merge"
    else:
        assert p["method"] == "warp" and len(p["launches"]) == 1, (batch, p)

    pp = PagedDecodePlan(batch, kvh * group, kvh, 128, 16, max_kv_len=ctx, q_dtype="bf16", num_sms=SMS)
    if batch * kvh < SMS:
        assert pp.num_splits > 1 and batch * kvh * pp.num_splits >= min(SMS, batch * kvh * (ctx // 64)), pp.num_splits
        attn = "decode_tc_paged_d128_bf16"  # bf16 q, head_dim 128, a group of 1 to 16: tensor cores
        assert [k for k, *_ in pp.launches()] == [attn]  # the last split CTA merges: one launch
    elif pp.items_per_cta > 1:
        # a persistent grid: one wave, unsplit, taken where the model has it faster than the waves by a margin
        slots = SMS * min(3, 228 * 1024 // (dtc_smem_bytes(128) + 1024))
        kv = 2 * ctx * 128 * 2
        assert pp.num_splits == 1 and pp.tc_grid[0] <= slots and len(pp.launches()) == 1
        tp = waves.persistent_time(batch * kvh, slots, kv, pp.items_per_cta)
        assert tp < waves.grid_stream_time(batch * kvh, slots, kv) * (1 - waves.PERSIST_MIN_GAIN), (tp, pp.items_per_cta)
    else:
        assert len(pp.launches()) == 1 and 1 <= pp.num_splits <= waves.MAX_WAVE_SPLITS
        slots = SMS * min(3, 228 * 1024 // (dtc_smem_bytes(128) + 1024))
        kv = 2 * ctx * 128 * 2
        t = [waves.grid_stream_time(batch * kvh * s, slots, kv / s) for s in (1, pp.num_splits)]
        if pp.num_splits > 1:  # a split is taken only for what the waves gain beyond the merge's tail
            assert t[1] + waves.MERGE_TAIL_S < t[0] * (1 - waves.MIN_GAIN), (pp.num_splits, t)
        # ... and the grid it leaves streams at HBM speed from a full wave on (or its last wave is tiny), but for
        # short steps, where another wave's fixed time costs more than a thin last wave (batch 64 x 1k: measured
        # faster with one split)
        eff = waves.wave_efficiency(batch * kvh * pp.num_splits, slots)
        assert eff > 0.93 or (ctx <= 1024 and pp.num_splits == 1 and eff > 0.85), (pp.num_splits, t, eff)
    pf = PagedDecodePlan(batch, kvh * group, kvh, 128, 16, max_kv_len=ctx, q_dtype="f32", num_sms=SMS)
    assert not pf.tensor_cores and (pf.num_splits == 1) == (batch * kvh >= SMS)


def test_tensor_core_splits_fill_the_last_wave() -> None:
    # 8 kv heads, d128: 3 CTAs an SM (396 slots), bf16 and FP8. One split at batch 64 is a full wave of 396 and
    # a last wave of 116: measured (H200, 2026-11-28) at 85% of copy speed at 8k-32k keys, where two splits (a
    # last wave of 232) reached 95-98%; at 1k keys one split was the faster of the two (the second split's
    # extra wave costs its fixed time), and a persistent grid of one wave is modelled faster still: (splits,
    # items a CTA).
    for g in (1, 4, 8):
        for ctx in (1024, 8192, 32768):
            def bf(b: int, kv: str = "bf16") -> tuple[int, int]:
                p = PagedDecodePlan(b, 8 * g, 8, 128, 16, max_kv_len=ctx, q_dtype="bf16", kv_dtype=kv)
                return p.num_splits, p.items_per_cta

            e4 = lambda b: bf(b, "float8_e4m3fn")  # noqa: E731
            if ctx == 1024:  # beyond one wave a persistent grid: 512 items in 256 CTAs, 2048 in 342
                assert bf(50) == bf(64) == e4(64) == (1, 2) and bf(128) == (1, 3) and bf(256) == e4(256) == (1, 6)
            else:
                assert bf(64) == (2, 1), (g, ctx)
                # 400 CTAs: 4 would run alone after the first wave; split 4 ways, or persistent where that models
                # faster by the margin
                assert bf(50) in ((4, 1), (1, 2)), (g, ctx, bf(50))
            assert bf(32) == bf(48) == (1, 1) and bf(96)[0] == bf(128)[0] == bf(256)[0] == 1, (g, ctx)
            for b in (32, 50, 64, 128):
                # FP8 CTAs stream half the bytes: short steps take no split (a persistent grid or a thin last wave)
                assert e4(b)[0] == (1 if ctx <= 8192 else bf(b)[0]) or ctx == 32768, (b, ctx, e4(b))
    # an explicit num_splits is kept
    assert PagedDecodePlan(64, 32, 8, 128, 16, q_dtype="bf16", num_splits=1).num_splits == 1


def test_one_kv_head_splits_up_to_the_cap() -> None:
    # 1 CTA: the split count is capped (32) and by the positions a split needs at least (64).
    pp = PagedDecodePlan(1, 8, 1, 128, 16, max_kv_len=32768, q_dtype="bf16")
    assert pp.num_splits == 32
    pp = PagedDecodePlan(1, 8, 1, 128, 16, max_kv_len=256, q_dtype="bf16")
    assert pp.num_splits == 4
