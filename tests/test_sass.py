"""SASS of the memory-bound kernels, read from the sm_80 and sm_90 cubins with cuobjdump: no GPU needed.

- every bf16 kernel of forward.cu / training.cu / norm_act_loss.cu that narrows fp32 -> bf16 does it in
  hardware (F2FP, from cvt.rn.bf16x2.f32), not in ~7 integer instructions per element;
- every f16 kernel narrows with F2FP.F16.F32.PACK_AB (cvt.rn.f16x2.f32) and widens with HADD2.F32
  (cvt.f32.f16), and the bf16 ones use no f16 conversion;
- the aligned paths of the bandwidth-bound kernels issue 128-bit global loads (transpose_2d_bf16: >= 64-bit),
  and norm_act_loss.cu's row and elementwise kernels 128-bit loads and stores in every dtype;
- silu_gate and causal_attn_softmax use MUFU.EX2 (fast exp) and no spills anywhere.
Only these three sources are compiled (through pykern's cache), for 2 archs, to keep this fast.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from sass_helpers import guard, report, spills

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("sm_80", "sm_90")
SOURCES = ("forward.cu", "training.cu", "norm_act_loss.cu")

# bf16 kernels that never narrow fp32 -> bf16: bit copies or fp32 outputs (partials, accumulators).
NO_NARROWING = {
    "transpose_2d_bf16": "copies bf16 words",
    "embedding_bf16": "copies bf16 rows",
    "embedding_backward_bf16": "accumulates into an fp32 grad table",
    "rms_norm_backward_weight_bf16": "writes fp32 per-chunk partial sums",
    "norm_weight_grad_bf16": "writes fp32 per-chunk partial sums",
}
# f16 kernels that never read or write f16 values (bit copies): no conversion either way
F16_COPIES = {"transpose_2d_f16", "embedding_f16"}

# kernel -> the widest global load its aligned path must issue
WIDE_LOADS = {
    "transpose_2d": "LDG128", "transpose_2d_bf16": "LDG64",
    "causal_attn_softmax": "LDG128",
    "rms_norm": "LDG128", "rms_norm_bf16": "LDG128",
    "silu_gate": "LDG128", "silu_gate_bf16": "LDG128",
    "silu_gate_backward": "LDG128", "silu_gate_backward_bf16": "LDG128",
    "rope": "LDG128", "rope_bf16": "LDG128",
    "softmax_backward": "LDG128", "softmax_backward_bf16": "LDG128",
    "rms_norm_backward": "LDG128", "rms_norm_backward_bf16": "LDG128",
    "cross_entropy_fwd_bwd": "LDG128", "cross_entropy_fwd_bwd_bf16": "LDG128",
}
# every f16 twin moves as its bf16 one does
WIDE_LOADS.update({k.replace("_bf16", "_f16"): v for k, v in list(WIDE_LOADS.items()) if k.endswith("_bf16")})
# norm_act_loss.cu: 16-byte loads and stores (LDG.E.128 / STG.E.128) in f32, bf16 and f16
EXT_16B = [f"{k}{s}" for k in ("add_rms_norm", "add_rms_norm_backward", "layer_norm", "layer_norm_backward", "gelu",
                               "gelu_backward", "gelu_gate", "gelu_gate_backward") for s in ("", "_bf16", "_f16")]


sr = report()


def _kernels_in(sources: tuple[str, ...]) -> list[str]:
    from pykern.registry import parse_file, source_files

    return [s.name for src in source_files() if src.name in sources for s in parse_file(src)]


@lru_cache(maxsize=None)
def mix() -> dict[str, dict[str, dict[str, Any]]]:
    return guard(lambda: sr.instruction_mix(_kernels_in(SOURCES), ARCHS, with_resources=True))


def test_every_narrowing_bf16_kernel_uses_f2fp() -> None:
    m = mix()
    narrowing = [k for k in _kernels_in(SOURCES) if "bf16" in k and k not in NO_NARROWING]
    assert len(narrowing) >= 8, narrowing
    bad = [(k, a, m[k][a]["F2FP"]) for k in narrowing for a in ARCHS if m[k][a]["F2FP"] == 0]
    assert not bad, f"bf16 kernels narrowing in software (no F2FP): {bad}"


def test_non_narrowing_list_is_honest() -> None:
    """An exempt kernel must really not narrow: it stores no F2FP-able fp32 -> bf16 (it has no F2FP today)."""
    m = mix()
    for k in NO_NARROWING:
        assert k in m, f"{k} is no longer a kernel: drop it from NO_NARROWING"


def test_every_f16_kernel_converts_in_hardware() -> None:
    m = mix()
    f16 = [k for k in _kernels_in(SOURCES) if k.endswith("_f16")]
    assert len(f16) == 21, f16  # forward.cu 5, training.cu 7, norm_act_loss.cu 9
    narrowing = [k for k in f16 if k.replace("_f16", "_bf16") not in NO_NARROWING]
    bad = [(k, a, m[k][a]["F2FP_F16"]) for k in narrowing for a in ARCHS if m[k][a]["F2FP_F16"] == 0]
    assert not bad, f"f16 kernels without F2FP.F16.F32.PACK_AB: {bad}"
    reading = [k for k in f16 if k not in F16_COPIES and k != "training_f32_to_f16"]
    bad = [(k, a) for k in reading for a in ARCHS if m[k][a]["HADD2_F32"] == 0]
    assert not bad, f"f16 kernels widening without HADD2.F32: {bad}"
    copies = [(k, a, m[k][a]) for k in F16_COPIES for a in ARCHS if m[k][a]["F2FP_F16"] or m[k][a]["HADD2_F32"]]
    assert not copies, copies
    bf16 = [(k, a) for k in _kernels_in(SOURCES) if k.endswith("_bf16") for a in ARCHS
            if m[k][a]["F2FP_F16"] or m[k][a]["HADD2_F32"]]
    assert not bf16, f"bf16 kernels with f16 conversions: {bf16}"


@pytest.mark.parametrize("kernel", EXT_16B)
def test_norm_act_loss_moves_16_bytes(kernel: str) -> None:
    m = mix()
    for a in ARCHS:
        row = m[kernel][a]
        assert row["LDG128"] > 0 and row["STG128"] > 0, f"{kernel} {a}: no LDG.E.128 / STG.E.128: {row}"


@pytest.mark.parametrize("kernel", sorted(WIDE_LOADS))
def test_aligned_path_issues_wide_loads(kernel: str) -> None:
    m = mix()
    want = WIDE_LOADS[kernel]
    widths = ("LDG128",) if want == "LDG128" else ("LDG64", "LDG128")
    for a in ARCHS:
        row = m[kernel][a]
        assert sum(row[w] for w in widths) > 0, f"{kernel} {a}: no {'/'.join(widths)} global load: {row}"


@pytest.mark.parametrize("kernel", ["silu_gate", "silu_gate_bf16", "silu_gate_f16", "silu_gate_backward_bf16",
                                    "silu_gate_backward_f16", "causal_attn_softmax"])
def test_fast_exp_is_one_mufu(kernel: str) -> None:
    """ex2.approx-based exp: MUFU.EX2 per element and no accurate-expf polynomial (few FFMA per MUFU)."""
    m = mix()
    for a in ARCHS:
        row = m[kernel][a]
        assert row["MUFU"] > 0, row
        assert row["FFMA"] <= 2 * row["MUFU"] + 40, f"{kernel} {a}: {row['FFMA']} FFMA for {row['MUFU']} MUFU"


def test_no_spills() -> None:
    m = mix()
    bad = spills(m)
    assert not bad, bad
