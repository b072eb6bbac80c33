"""Guard on the tensor-core attention backward's SASS (no GPU needed: cuobjdump reads NVRTC's cubins).

For every backward tensor-core kernel the ops launch at head_dim 64 / 128 (recorded from real calls on the host
backend, bf16 and f16, with and without a softcap, both dQ modes), on sm_80 and sm_90: tensor-core MMAs
(HMMA), a flat steady-state loop (a backward branch whose body holds MMAs and no inner loop,
tools/sass_report.py's steady_state_loops), warp-instructions and ldmatrix per m16n8k16 MMA of that loop within
the bars, and no spills. FlashAttention-2 at d128 issues 3.35 per MMA in its backward; the bars leave room
for the window / softcap arithmetic. The older dK/dV + dQ kernels (attention_bwd_tc.cu) have no flat
loop and fail every row of this (test_old_kernels_fail_the_guard).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases.attention import attention_inputs
from sass_helpers import checked_report as _sass_report
from launch_spy import record_launches

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("sm_80", "sm_90")
# head_dim -> (warp-instructions per MMA, ldmatrix per MMA) bars of the steady-state loop
BARS = {64: (6.5, 1.0), 128: (4.5, 0.75)}


def _launched(monkeypatch, d: int, kind: str, softcap: float, deterministic: bool) -> list[str]:
    """The kernels one attention_backward call launches (on the host backend)."""
    names = record_launches(monkeypatch)
    rng = np.random.default_rng(d)
    q, k, v, g = attention_inputs(rng, None, 3, 2, 1, d, kind, 5)
    ops.attention_backward(q, k, v, g, causal=True, softcap=softcap, deterministic=deterministic, backend="host")
    return list(names)  # this call's launches: a later call in the test records into its own list


def _tc_backward_kernels(monkeypatch) -> dict[str, int]:
    """{kernel: head_dim} of every MMA kernel the backward launches at head_dim 64 / 128."""
    out: dict[str, int] = {}
    for d in BARS:
        for kind in ("bf16", "f16"):
            for cap in (0.0, 2.0):
                for det in (False, True):
                    for n in _launched(monkeypatch, d, kind, cap, det):
                        # the MMA kernels, not the tc path's prep / dQ-reduce passes (also attention_bwd_tc_*)
                        if n.startswith("attention_bwd_tc_") and not n.startswith(("attention_bwd_tc_prep",
                                                                                "attention_bwd_tc_dq_reduce")):
                            out[n] = d
    return out


def _violations(sr, kernels: dict[str, int]) -> list[tuple]:
    loops = sr.loop_metrics(sorted(kernels), ARCHS)
    mix = sr.instruction_mix(sorted(kernels), ARCHS, with_resources=True)
    bad = []
    for name, d in kernels.items():
        per_mma, ldsm_per_mma = BARS[d]
        for arch in ARCHS:
            row = mix[name][arch]
            if row["HMMA"] == 0:
                bad.append((name, arch, "no HMMA"))
            if row["spill_stores"] or row["LDL"] or row["STL"]:
                bad.append((name, arch, "spills", row["spill_stores"], row["LDL"], row["STL"]))
            loop = loops.get(name, {}).get(arch)
            if loop is None:
                bad.append((name, arch, "no flat steady-state loop"))
                continue
            if loop["per_mma"] > per_mma:
                bad.append((name, arch, "instructions per MMA", loop["per_mma"], per_mma))
            if loop["ldsm"] / loop["mma"] > ldsm_per_mma:
                bad.append((name, arch, "ldmatrix per MMA", loop["ldsm"] / loop["mma"], ldsm_per_mma))
    return bad


def test_backward_tensor_core_kernels_meet_the_bars(monkeypatch) -> None:
    sr = _sass_report()
    kernels = _tc_backward_kernels(monkeypatch)
    # the fused kernel in both dQ modes, every dtype and softcap flag: 2 x 2 x 2 x 2 = 16
    assert len(kernels) == 16 and all("_fused_" in n for n in kernels), sorted(kernels)
    bad = _violations(sr, kernels)
    assert not bad, bad


def test_old_kernels_fail_the_guard() -> None:
    # The guard can fail: the dK/dV + dQ pair the ops launched before (still used at head_dim 96 / 256)
    sr = _sass_report()
    old = {f"attention_bwd_tc_{n}_d{d}_bf16": d for d in BARS for n in ("dkdv", "dq")}
    bad = _violations(sr, old)
    assert {(b[0], b[1]) for b in bad if b[2] == "no flat steady-state loop"} == {
        (n, a) for n in old for a in ARCHS}
