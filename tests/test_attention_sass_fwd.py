"""The tensor-core attention forward at FlashAttention-2 efficiency, judged from its SASS (no GPU needed).

For every kernel of the FlashAttention-2 core (kernels_cu/pk_attn_core.cuh) the ops launch (flash_attention,
flash_attention_varlen, paged_prefill_attention with a 16-bit cache), on sm_80 and
sm_90: tensor-core MMAs of the right input type (HMMA.16816.F32.BF16 for bf16, HMMA.16816.F32 without
.BF16 for f16), a flat steady-state loop (tools/sass_report.py steady_state_loops: a backward branch whose
body holds the MMAs and no inner loop), at most BARS[D] warp-instructions and LDSM_PER_MMA ldmatrix per
m16n8k16 MMA in it, and no spills or local memory. The general kernels (attention_fwd_tc_pad_*, _d96,
_d256: head_dims the core does not take; paged_attn for FP8 caches) are not held to these bars.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases.attention import fa_inputs
from pykern.ops import _attention_sm90 as sm90
from sass_helpers import checked_report as _sass_report

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("sm_80", "sm_90")
# warp-instructions per m16n8k16 MMA in the steady-state loop (FlashAttention-2 itself: ~4.3 at d128)
BARS = {64: 7.5, 128: 5.0}
LDSM_PER_MMA = 0.5  # K: one x4 per 2 MMAs of Q K^T; V: one x4.trans per 2 MMAs of P V
# flash_attention and the serving ops (flash_attention_varlen, paged_prefill_attention), each in bf16 and f16
FWD_CORE = [f"{v}d{d}{c}{s}" for v in ("attention_fwd_tc_", "attention_fwd_varlen_tc_", "paged_prefill_tc_")
            for d in BARS for c in ("", "_softcap") for s in ("_bf16", "_f16")]


def _launched(monkeypatch, call) -> list[str]:
    """Kernel names `call` launches (recorded, not run)."""
    from pykern import launcher

    names: list[str] = []
    monkeypatch.setattr(launcher, "launch", lambda name, *a, **kw: names.append(name))
    call()
    return names


@pytest.mark.parametrize("d", sorted(BARS))
@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_flash_attention_launches_the_core_for_its_head_dims(d, kind, softcap, monkeypatch) -> None:
    rng = np.random.default_rng(0)
    q, k, v = fa_inputs(rng, 1, 3, 5, 4, 2, d, d, kind)
    names = _launched(monkeypatch, lambda: ops.flash_attention(q, k, v, causal=True, softcap=softcap,
                                                               backend="host"))
    cap = "_softcap" if softcap else ""
    assert names == [f"attention_fwd_tc_d{d}{cap}_{kind}"]
    assert names[0] in FWD_CORE


@pytest.mark.parametrize("d", sorted(BARS))
@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_flash_attention_varlen_launches_the_core_for_its_head_dims(d, kind, softcap, monkeypatch) -> None:
    from pykern.ops.serving import flash_attention_varlen

    rng = np.random.default_rng(0)
    q, k, v = (x[0] for x in fa_inputs(rng, 1, 7, 9, 4, 2, d, d, kind))
    cu_q, cu_k = np.array([0, 3, 7], np.int32), np.array([0, 4, 9], np.int32)
    names = _launched(monkeypatch, lambda: flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, softcap=softcap,
                                                                  backend="host"))
    assert names == [f"attention_fwd_varlen_tc_d{d}{'_softcap' if softcap else ''}_{kind}"]
    assert names[0] in FWD_CORE


def test_core_kernels_are_flat_lean_tensor_core_loops() -> None:
    sr = _sass_report()
    loops = sr.loop_metrics(FWD_CORE, ARCHS)
    mix = sr.instruction_mix(FWD_CORE, ARCHS, with_resources=True)
    assert set(mix) == set(FWD_CORE)
    for name in FWD_CORE:
        d = int(name.split("_d")[1].split("_")[0])
        f16 = name.endswith("_f16")
        for arch in ARCHS:
            row = mix[name][arch]
            assert row["HMMA"] > 0, (name, arch, row)
            assert row["HMMA_BF16"] == (0 if f16 else row["HMMA"]), (name, arch, row)
            assert row["LDL"] == row["STL"] == 0 and row["spill_stores"] == 0 == row["spill_loads"], (name, arch, row)
            # a flat steady-state loop exists (a loop with inner loops is not one)
            assert arch in loops.get(name, {}), f"{name} {arch}: no flat MMA loop"
            lp = loops[name][arch]
            # the whole 64-key tile in one body: Q K^T (D/16 k-steps x 8 n-tiles) + P V (4 k-steps x D/8 n-tiles)
            assert lp["mma"] == d // 2 + d // 2, (name, arch, lp)
            assert lp["per_mma"] <= BARS[d], (name, arch, lp)
            assert lp["ldsm"] / lp["mma"] <= LDSM_PER_MMA, (name, arch, lp)
            assert lp["bar"] == 1 and lp["ldgsts"] > 0, (name, arch, lp)  # one barrier, cp.async prefetch


@pytest.mark.parametrize("d", sorted(BARS))
@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_paged_prefill_launches_the_core_for_16bit_caches(d, kind, softcap, monkeypatch) -> None:
    from pykern.ops.serving import paged_prefill_attention

    rng = np.random.default_rng(0)
    pages = [fa_inputs(rng, 3, 16, 16, 2, 2, d, d, kind)[1] for _ in range(2)]
    q = fa_inputs(rng, 1, 7, 1, 4, 2, d, d, kind)[0][0]
    args = (q, np.array([0, 3, 7], np.int32), pages[0], pages[1], np.array([0, 1, 3], np.int32),
            np.array([2, 0, 1], np.int32), np.array([5, 9], np.int32))
    names = _launched(monkeypatch, lambda: paged_prefill_attention(*args, logits_soft_cap=softcap, backend="host"))
    assert names == [f"paged_prefill_tc_d{d}{'_softcap' if softcap else ''}_{kind}"]
    assert names[0] in FWD_CORE


# The sm_90a forward (kernels_cu/attention_fwd_sm90.cu, FA3's design): every kernel stages each consumer
# warpgroup's 64 normalised rows of O in its part of the Q tile. The dense kernels then store them through the TMA
# (one UTMASTG a box of 64 head-dim columns, 32 at d96: DV / 64 of them, d96 three); the varlen and paged kernels (a
# box would run past a sequence's end into the next one's rows) carry no UTMASTG: the warpgroup's 128 threads store
# the rows with 16-byte stores, DV / 16 STG.E.128 a thread (64 rows x DV / 8 pieces over 128 threads; d96: 7 passes
# of 10 rows), all after the steady loop, and no
# 32-bit store of O. lse with plain 32-bit stores (rows g and g + 8 of the lane, quad lane 0) in every kernel.
SM90_FWD = [f"attention_fwd_{v}sm90_{s}{c}_{t}" for v in ("", "varlen_")
            for s in ("d64", "d96", "d128", "d256", "d192_dv128")
            for c in ("", "_softcap") for t in ("bf16", "f16")]
SM90_PAGED = [sm90.paged_kernel_name(d, c, q, kv, dv) for d, dv in sm90.PAGED_SHAPES for c in (0.0, 1.0)
              for q in ("bf16", "f16") for kv in (q, *sm90.PAGED_FP8)]


@lru_cache(maxsize=None)
def _sm90_sass(source: str = "attention_fwd_sm90.cu") -> tuple[str, dict]:
    """A source's sm_90a SASS and its steady-state loops, disassembled once for every case below (one cuobjdump of
    attention_fwd_sm90.cu's 88 kernels takes tens of seconds)."""
    from sass_helpers import report, source_sass

    text = source_sass(source, "sm_90a")
    return text, report().steady_state_loops(text)


def _assert_staged_stores(text: str, kernel: str, stg: list[str], loop: dict | None, dv: int) -> None:
    """The staged O epilogue (pk_attn_store_staged_o): one STG.E.128 a pass of 128 // (DV / 8) rows over the 64 rows
    (DV / 16 where the rows fill the 128 threads; 7 at DV 96: 10 rows of 12 pieces a pass), after the steady-state
    loop where there is one, and no 32-bit store but lse's two."""
    passes = -(-64 // (128 // (dv // 8)))
    assert stg.count("STG.E.128") == passes, (kernel, stg)
    assert stg.count("STG.E") == 2 and len(stg) == 2 + passes, (kernel, stg)  # lse only at 32 bits
    if loop is not None:
        body = text.split(f"Function : {kernel}\n", 1)[1].split("Function :", 1)[0]
        at = [int(a, 16) for a in re.findall(r"/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P\w+\s+)?STG\.E\.128\b", body)]
        assert len(at) == passes and min(at) > int(loop["end"], 16), (kernel, loop, at)


@pytest.mark.parametrize("kernel", SM90_FWD + SM90_PAGED)
def test_sm90_forward_epilogue_stores(kernel: str) -> None:
    from sass_helpers import kernel_ops

    text, loops = _sm90_sass()
    ops_ = kernel_ops(text, kernel)
    dv = 128 if "_dv128" in kernel else int(kernel.split("_d")[1].split("_")[0])
    stores = [op for op in ops_ if op.startswith("UTMASTG")]
    stg = [op for op in ops_ if op.startswith("STG")]
    if "_varlen_" in kernel or kernel.startswith("paged_"):
        assert stores == [], (kernel, stores)
        # the 16-byte stores are the epilogue's: after the steady-state loop
        _assert_staged_stores(text, kernel, stg, loops[kernel], dv)
    else:
        assert stores == ["UTMASTG.4D"] * (dv // sm90.box(dv)[0]), (kernel, stores)  # one a box (d96: three)
        assert stg == ["STG.E"] * 2, (kernel, stg)  # lse only: rows g and g + 8 of the lane (quad lane 0)


# The FP8 forward (kernels_cu/attention_fwd_fp8_sm90.cu): each consumer warpgroup stages its 64 normalised bf16 rows
# of O in V slot c (pk_attn_stage_o_row; the e4m3 Q tile holds half of them) and its 128 threads store them with
# 16-byte stores (pk_attn_store_staged_o), dense and varlen alike (no tensor map over out): D / 16 STG.E.128 a
# thread, after the steady loop where there is one (d64, d128), no UTMASTG, and no 32-bit store of O (the two
# 32-bit stores are lse's rows g and g + 8).
SM90_FP8_FWD = [f"attention_fwd_{v}sm90_d{d}{c}_fp8" for v in ("", "varlen_") for d in (64, 128, 256)
                for c in ("", "_softcap")]


@pytest.mark.parametrize("kernel", SM90_FP8_FWD)
def test_sm90_fp8_forward_epilogue_stores(kernel: str) -> None:
    from sass_helpers import kernel_ops

    text, loops = _sm90_sass("attention_fwd_fp8_sm90.cu")
    ops_ = kernel_ops(text, kernel)
    d = int(kernel.split("_d")[1].split("_")[0])
    stg = [op for op in ops_ if op.startswith("STG")]
    assert not [op for op in ops_ if op.startswith("UTMASTG")], kernel
    assert (kernel in loops) == (d < 256), (kernel, sorted(loops))  # d256: a tile at a time, no steady loop
    _assert_staged_stores(text, kernel, stg, loops.get(kernel), d)
