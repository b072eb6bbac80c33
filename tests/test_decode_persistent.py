"""The tensor-core paged decode's persistent grid (items_per_cta > 1: a CTA streams several consecutive work items
through one ring, the next item's first tiles issued while the current one merges): every item computes
exactly as with one CTA an item, so the outputs are bitwise those of the plain grid (any thread order, no race),
and the plan picks it only beyond one wave, where the wave model (pykern/ops/_decode_waves.py) has it faster."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_helpers import need as _need  # noqa: E402
from pykern import ops  # noqa: E402
from pykern.difftest.cases.serving import make_paged, make_q  # noqa: E402
from pykern.errors import ArgumentError  # noqa: E402
import pykern.ops._decode_waves as waves  # noqa: E402


def _run(pc: dict, q: np.ndarray, kind: str, ns: int, k: int, d: int, window_left: int = -1):
    n, h, _ = q.shape
    kvh = pc["k_pages"].shape[2]
    plan = ops.PagedDecodePlan(n, h, kvh, d, pc["k_pages"].shape[1], q_dtype="bf16", kv_dtype=kind, num_splits=ns,
                               items_per_cta=k, window_left=window_left)
    assert plan.items_per_cta == k and plan.tc_grid == (-(-n * kvh * ns // k), 1, 1)
    sc = pc["scales"] if kind in ("e4m3", "e5m2") else (None, None)
    out, lse = plan.run(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"], pc["kv_last_page_len"],
                        k_scale=sc[0], v_scale=sc[1], return_lse=True, backend="host")
    assert not np.asarray(plan.counters).any(), "split tickets left nonzero"
    return np.asarray(out, np.float64).copy(), np.asarray(lse).copy()


@pytest.mark.parametrize("kind,d,ns,ks,schedule", [
    ("bf16", 64, 1, (2, 5), "reverse"),
    ("bf16", 128, 2, (3,), "random:3"),
    ("e4m3", 64, 3, (4,), "forward"),
    ("e5m2", 128, 1, (2, 3), "reverse"),
])
def test_persistent_grid_is_bitwise_the_plain_grid(kind, d, ns, ks, schedule, monkeypatch) -> None:
    # Sequences of many tiles, one tile, none, and a window: items switch mid-ring, the fill skips empty items
    # and the last CTA has fewer items. Race-checked on the host backend under other thread orders.
    _need("host")
    rng = np.random.default_rng(d + ns)
    lens = [150, 0, 64, 3, 0, 90]
    pc = make_paged(rng, lens, 16, 2, d, "NHD", kind)
    q = make_q(rng, (len(lens), 8, d), "bf16")
    for wl in (-1, 40):
        base = _run(pc, q, kind, ns, 1, d, wl)
        assert np.isfinite(base[0]).all() and (base[0][1] == 0).all() and np.isneginf(base[1][4]).all()
        monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
        for k in ks:
            out, lse = _run(pc, q, kind, ns, k, d, wl)
            assert np.array_equal(out, base[0]) and np.array_equal(lse, base[1]), (k, wl)
        monkeypatch.delenv("PYKERN_HOST_RACECHECK")
        monkeypatch.delenv("PYKERN_HOST_SCHEDULE")


def test_plan_picks_a_persistent_grid_beyond_one_wave() -> None:
    P = ops.PagedDecodePlan
    # 64 sequences x 8 kv heads, 1k keys: 512 items on 396 slots (3 CTAs an SM x 132) would take two waves; a
    # persistent grid of 256 CTAs, 2 items each, is one.
    p = P(64, 32, 8, 128, 16, q_dtype="bf16", max_kv_len=1024)
    assert (p.num_splits, p.items_per_cta) == (1, 2) and p.launches()[0][1] == (256, 1, 1)
    p = P(256, 32, 8, 128, 16, q_dtype="bf16", kv_dtype="float8_e4m3fn", max_kv_len=1024)
    assert p.items_per_cta > 1 and p.num_splits == 1 and p.tc_grid[0] <= 396
    # One wave or less: a CTA an item (batch 8 splits to fill the SMs instead).
    for b in (1, 8, 32):
        assert P(b, 32, 8, 128, 16, q_dtype="bf16", max_kv_len=1024).items_per_cta == 1
    # paged_attn plans keep their grid.
    p = P(64, 32, 8, 128, 16, q_dtype="bf16", max_kv_len=1024, tensor_cores=False)
    assert p.items_per_cta == 1 and p.launches()[0][1] == p.grid


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2"])
def test_items_per_cta_must_be_a_positive_int(bad) -> None:
    with pytest.raises(ArgumentError, match="items_per_cta"):
        ops.PagedDecodePlan(4, 8, 2, 64, 16, q_dtype="bf16", items_per_cta=bad)


def test_persistent_model() -> None:
    slots = 396
    assert waves.persistent_items(396, slots, 1 << 20) == 1  # one wave already
    with pytest.raises(ValueError, match="k"):
        waves.persistent_time(512, slots, 1 << 20, 1)
    # 512 items of 512 KiB: two waves (each paying WAVE_START_S) against one wave and one item switch.
    item = 2 * 1024 * 128 * 2 * 2
    plain = waves.grid_stream_time(512, slots, item)
    pers = waves.persistent_time(512, slots, item, 2)
    assert pers < plain and waves.persistent_items(512, slots, item) == 2
    assert pers == pytest.approx(waves.WAVE_START_S + waves.ITEM_SWITCH_S + 2 * item / (waves.HBM_BPS / 256))
