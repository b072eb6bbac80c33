"""tools/bench_decode.py --roofline: the paged decode model built from our own SASS loop bodies (no GPU)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bd():
    spec = importlib.util.spec_from_file_location("pk_bench_decode_t", ROOT / "tools" / "bench_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
