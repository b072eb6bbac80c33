"""tools/bench_moe.py: the modelled H100 table of the experts block (from our SASS loop metric and launch
geometry) and the --time path's exit without a GPU."""
from __future__ import annotations

import json
import math

import pytest

from sass_helpers import tool

bm = tool("bench_moe")
sr = tool("sass_report")


@pytest.fixture(scope="module")
def facts():
    try:
        sr.find_cuobjdump()
    except sr.CuobjdumpUnavailable as e:
        pytest.skip(str(e))
    return bm.kernel_facts()


def test_kernel_bounds_follow_the_loop_metric_and_tile_config(facts):
    loops = sr.loop_metrics([k for _, k in bm.GEMMS], ["sm_90"])
    for name, f in facts.items():
        per_mma = loops[name]["sm_90"]["per_mma"]
        assert f["per_mma"] == per_mma and 1.0 < per_mma < 4.0
        # issue bound: 4 schedulers x clock x 132 SMs / (warp-instructions per MMA) x 4096 FLOPs
        want = 4 * bm.CLOCK * 132 / per_mma * 4096 / 1e12
        assert math.isclose(f["tflops"]["issue"], want, rel_tol=1e-12)
        assert math.isclose(bm.CLOCK * 132 * 4096, 990e12, rel_tol=1e-12)
        assert math.isclose(f["tflops"]["tensor"], 990 * 2 / 3, rel_tol=1e-12)
        # shared memory: the tile config's bytes per MMA are the SASS loop's ldmatrix.x4 and cp.async bytes
        sb = f["tile_smem_bytes_per_mma"]
        assert (sb["ldmatrix"], sb["cp_async"]) == (128.0, 64.0)
        assert (f["sass_ldsm_bytes_per_mma"], f["sass_cp_async_bytes_per_mma"]) == (128.0, 64.0)
        assert math.isclose(f["tflops"]["smem"], 128 / 192 * 4096 * bm.CLOCK * 132 / 1e12, rel_tol=1e-12)
        assert f["ctas_per_sm"] >= 1 and 0 < f["occupancy"] <= 1


def test_modelled_rows_are_finite_name_their_binding_term_and_respect_every_bound(facts):
    rows = [bm.model(name, t, facts) for name in bm.SHAPES for t in bm.TOKENS]
    assert len(rows) == 8
    for r in rows:
        vals = [r["model_tflops"], r["model_ms"], *r["bounds_tflops"].values()]
        assert all(math.isfinite(v) and v > 0 for v in vals), r
        parts = r["binding"].split("=")
        assert parts and set(parts) <= set(bm.TERMS)
        low = min(r["bounds_tflops"].values())
        assert all(math.isclose(r["bounds_tflops"][t], low, rel_tol=0.005) for t in parts)
        assert r["model_tflops"] <= low * (1 + 1e-9)  # the prediction never beats a bound
        assert r["model_tflops"] < 990 * 2 / 3
    by = {(r["model"], r["tokens"]): r for r in rows}
    # Qwen3-30B-A3B at 1K tokens: ~64 slots per expert, each padded to one 128-row tile: half the rows are
    # padding, and streaming 1.2 GB of expert weights binds
    q = by[("qwen3-30b-a3b", 1024)]
    assert math.isclose(q["padding_waste"], 0.5, abs_tol=1e-9) and q["binding"] == "hbm"
    # Mixtral at 64K tokens: compute-bound, padding negligible
    m = by[("mixtral-8x7b", 65536)]
    assert m["padding_waste"] < 0.01 and "hbm" not in m["binding"]


def test_expected_tiles_is_the_binomial_expectation():
    # brute force: E[ceil(c / 4)], c ~ Binomial(10, 0.25)
    n, p, b = 10, 0.25, 4
    want = sum(math.comb(n, c) * p**c * (1 - p) ** (n - c) * -(-c // b) for c in range(n + 1))
    tiles, hit = bm.expected_tiles(n, 2, 8, b)
    assert math.isclose(tiles, want, rel_tol=1e-12) and math.isclose(hit, 1 - 0.75**10, rel_tol=1e-12)
    assert bm.expected_tiles(300, 4, 4, 128) == (3.0, 1.0)  # every token picks every expert


def test_json_output(facts, capsys):
    assert bm.main(["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["model"]) == 8 and doc["timed"] is None and set(doc["kernels"]) == {k for _, k in bm.GEMMS}


def test_time_without_a_gpu_exits_3_naming_the_need(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from pykern.bench.cli import EXIT_NO_GPU

    assert bm.main(["--time"]) == EXIT_NO_GPU == 3
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_fp8_weight_blocks_dequantize_to_the_weights():
    """--time's FP8 gate_up GEMM quantizes the experts' weights per 128 x 128 block (the scaling grouped_gemm_fp8
    takes): one scale per block, amax / 448, N padded to whole blocks; dequantized within e4m3's rounding."""
    torch = pytest.importorskip("torch")
    b = torch.randn(2, 200, 256)
    b[1, 130:, 128:] *= 1000   # a block far above the others keeps its own scale
    q, s = bm._fp8_blocks(torch, b)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (2, 200, 256) and tuple(s.shape) == (2, 2, 2)
    assert torch.equal(s[1, 1, 1], b[1, 128:200, 128:].abs().amax() / 448)
    deq = q.float() * s.repeat_interleave(128, 1)[:, :200].repeat_interleave(128, 2)
    blk = s.repeat_interleave(128, 1)[:, :200].repeat_interleave(128, 2) * 448
    assert float(((deq - b).abs() / blk).max()) <= 2.0 ** -4   # e4m3: 3 mantissa bits, half an ulp at the top
