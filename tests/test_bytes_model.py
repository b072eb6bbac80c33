"""tools/bytes_model.py: the per-op byte counts follow the ops' definitions, and the CLI's --json parses."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from sass_helpers import tool

ROOT = Path(__file__).resolve().parent.parent
bm = tool("bytes_model")


def by_op(group: str, e: int) -> dict:
    return {r.op: r for r in bm.rows(group, e)}


def test_minimum_bytes_follow_the_op_definitions() -> None:
    f = by_op("forward", 2)
    n = bm.TOKENS * bm.FFN
    assert f["silu_gate"].min_bytes == 3 * n * 2 == f["silu_gate"].hbm_bytes
    assert f["silu_gate_backward"].min_bytes == 5 * n * 2
    t = by_op("training", 4)
    n = bm.HIDDEN * bm.FFN
    assert t["transpose_2d"].min_bytes == 2 * n * 4 == t["transpose_2d"].hbm_bytes
    rb = t["rms_norm_backward"]
    assert 1.0 < rb.hbm_bytes / rb.min_bytes < 1.1  # fused weight gradient: 3N + the blocks' partial rows
    for r in bm.rows("all", 2):
        assert r.min_bytes <= r.hbm_bytes <= r.issued_bytes, r
        assert abs(r.model_us - r.hbm_bytes / 3.35e12 * 1e6) < 1e-6


def test_cli_json() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bytes_model.py"), "--json", "--dtype", "f32"],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    assert {r["op"] for r in rows} >= {"rms_norm", "transpose_2d", "softmax_backward", "causal_attn_softmax"}
    assert all(r["dtype"] in ("f32",) or r["op"] == "causal_attn_softmax" for r in rows)


def test_norm_backwards_read_x_and_g_once() -> None:
    """The fused norm backwards: HBM bytes = the minimum + the blocks' fp32 partial rows (written, read back),
    the rows' statistics and the fp32 gradients, within 10% of the minimum at LLaMA's 8192 x 4096; the blocks
    follow the ops' own geometry (add_rms_norm_backward takes layer_norm_backward's)."""
    from pykern.ops.norm_act_loss import _lnb_fused_geometry
    from pykern.ops.training import rms_backward_geometry

    t, h = bm.TOKENS, bm.HIDDEN
    for e, kind in ((2, "bf16"), (4, "f32")):
        rows = by_op("training", e)
        assert bm.rms_bwd_blocks(t, h) == rms_backward_geometry(t, h)[0] == 264
        assert bm.ln_bwd_blocks(t, h, e) == _lnb_fused_geometry(t, h, kind)[0][0]
        rb, lb = rows["rms_norm_backward"], rows["layer_norm_backward"]
        n = t * h
        parts = bm.rms_bwd_blocks(t, h)
        assert rb.hbm_bytes == 3 * n * e + h * e + 2 * parts * h * 4 + t * 4 + h * 4
        lparts = bm.ln_bwd_blocks(t, h, e)
        assert lb.hbm_bytes == 3 * n * e + h * e + 2 * 2 * lparts * h * 4 + 8 * t + 2 * h * 4
        for r in (rb, lb):
            assert r.hbm_bytes / r.min_bytes < 1.1, r
        ab = rows["add_rms_norm_backward"]
        assert ab.hbm_bytes == 4 * n * e + h * e + 2 * lparts * h * 4 + t * 4 + h * 4
        assert ab.hbm_bytes / ab.min_bytes < 1.1, ab
    f = by_op("forward", 2)
    assert f["layer_norm"].hbm_bytes == f["layer_norm"].min_bytes == 2 * t * h * 2 + 2 * h * 2


def test_rope_reads_and_writes_x_once() -> None:
    """rope rotates q and k in one launch: HBM bytes = x read once + written once + the compact tables once; at
    8192 tokens a unit holds all 40 heads of a token, so even the issued (L1 / L2) bytes read the tables once.
    The norm-fused forward adds only its two weights; its backward reads x and the gradient once, writes one
    gradient, plus the blocks' fp32 partial rows of the two weight gradients (under 1% of the minimum)."""
    t, d, heads = bm.TOKENS, bm.HEAD_DIM, bm.HEADS + bm.KV_HEADS
    tab = 2 * t * (d // 2) * 4
    for e in (2, 4):
        rows = by_op("forward", e)
        n = t * heads * d
        r = rows["rope (q+k)"]
        assert r.min_bytes == r.hbm_bytes == r.issued_bytes == 2 * n * e + tab, r
        qn = rows["qk_norm_rope"]
        assert qn.hbm_bytes == 2 * n * e + tab + 2 * d * e, qn
        qb = rows["qk_norm_rope_backward"]
        assert qb.min_bytes == 3 * n * e + tab + 4 * d * e, qb
        assert qb.hbm_bytes / qb.min_bytes < 1.01, qb


def test_cross_entropy_cluster_reads_the_logits_once() -> None:
    """The two-sweep cross-entropy reads a 128k-wide row twice (evicted between the sweeps); the sm_90a cluster
    kernel keeps it in its cluster's shared memory: HBM bytes = the minimum (logits read once, gradient written
    once, the int64 targets), 2/3 of the two-sweep kernel's, at 8 CTAs of 31.3 KiB (bf16) / 62.6 KiB (f32) a row."""
    t, v = bm.TOKENS, bm.VOCAB
    for e in (2, 4):
        rows = by_op("training", e)
        old, new = rows["cross_entropy_fwd_bwd"], rows["cross_entropy_fwd_bwd (sm_90a cluster)"]
        assert old.hbm_bytes == 3 * t * v * e + t * 8
        assert new.min_bytes == new.hbm_bytes == new.issued_bytes == 2 * t * v * e + t * 8 == old.min_bytes
        assert f"clusters of 8 CTAs x {16032 * e / 1024:.1f} KiB" in new.note  # 128256 / 8 columns a CTA


def test_wide_rms_norm_backward_cluster_reads_x_and_g_once() -> None:
    """Rows of 32768 columns pass the 8192 one CTA holds: the one-CTA path reads x and g again for the weight
    gradient (HBM 5N + ...), the sm_90a cluster kernel (norm_sm90.cu) splits each row over 4 CTAs and reads them
    once: within 1% of the minimum, about 3/5 of the one-CTA path's bytes."""
    t, h = bm.TOKENS, bm.WIDE_HIDDEN
    for e in (2, 4):
        rows = by_op("training", e)
        old, new = rows["rms_norm_backward (wide, one CTA)"], rows["rms_norm_backward (wide, sm_90a cluster)"]
        assert new.min_bytes == old.min_bytes == 3 * t * h * e + 2 * h * e + t * 4
        assert old.hbm_bytes > 5 * t * h * e and new.hbm_bytes / new.min_bytes < 1.01, (old, new)
        assert "33 clusters of 4 CTAs x 8192 columns" in new.note
