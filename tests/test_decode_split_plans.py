"""Split-KV in the `auto` plans: whenever batch * kv_heads CTAs leave SMs idle (below the 132 of an H100),
decode_plan's auto and PagedDecodePlan's default split each sequence's KV range so the grid covers the GPU;
at or above the SM count they do not split (no partials round trip; paged_attn and the dense plans also
save the merge launch, the tensor-core decode merges in its own launch either way)."""
from __future__ import annotations

import pytest

from pykern.ops.decode import decode_plan
from pykern.ops.serving import PagedDecodePlan

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
    else:
        assert pp.num_splits == 1 and len(pp.launches()) == 1


def test_one_kv_head_splits_up_to_the_cap() -> None:
    # 1 CTA: the split count is capped (32) and by the positions a split needs at least (64).
    pp = PagedDecodePlan(1, 8, 1, 128, 16, max_kv_len=32768, q_dtype="bf16")
    assert pp.num_splits == 32
    pp = PagedDecodePlan(1, 8, 1, 128, 16, max_kv_len=256, q_dtype="bf16")
    assert pp.num_splits == 4
