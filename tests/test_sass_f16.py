"""SASS of the float16 instantiations of paged.cu, sampling.cu and moe.cu (cuobjdump on NVRTC's cubins, no GPU):
the f16 conversions are hardware ones, as the bf16 narrowing is (tests/test_sass.py):
- every kernel that writes f16 narrows with F2FP.F16.F32.PACK_AB (cvt.rn.f16x2.f32), and every kernel that
  reads f16 values widens with HADD2.F32 (cvt.f32.f16), not in integer code;
- the f16 copies (paged_append_kv_f16) convert nothing, f32 outputs (f16kv attention, routing weights,
  sampled tokens) pack nothing to f16, and the bf16 twins use no f16 conversion at all;
- the tensor-core grouped GEMMs run f16 MMAs (HMMA.16816.F32 without .BF16);
- no spills or local memory in any f16 instantiation on sm_80 and sm_90.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from sass_helpers import guard, report

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("sm_80", "sm_90")
SOURCES = ("paged.cu", "sampling.cu", "moe.cu")
FP8 = ("e4m3", "e5m2")

# kernels that write f16 values (narrowing from fp32)
NARROWING = {"paged_attn_f16", "dense_attn_f16", "paged_attn_merge_f16", "paged_attn_f16_e4m3kv",
             "paged_attn_f16_e5m2kv", "sampling_renorm_probs_f16", "sampling_top_k_mask_logits_f16",
             "moe_gather_f16", "moe_combine_f16", "moe_act_f16", "grouped_gemm_simt_f16", "grouped_gemm_tc_f16",
             "moe_gemm_act_tc_f16", "grouped_gemm_tc_nn_f16", "grouped_gemm_wgrad_tc_f16",
             # the split-precision backward: fp32 intermediates to hi / lo f16 planes, weight gradients in f16
             "moe_split16_f16", "grouped_gemm_wgrad_tc_split_a_f16", "grouped_gemm_wgrad_tc_split_ab_f16"}
# kernels that never write f16 values: fp32 outputs, tokens, or bit copies
NO_F16_OUTPUT = {"paged_attn_f16kv", "dense_attn_f16kv", "paged_append_kv_f16", "moe_route_f16",
                 "sampling_from_probs_f16", "sampling_from_logits_f16", "sampling_softmax_f16",
                 "sampling_chain_speculative_f16", "grouped_gemm_tc_f32out_f16", "grouped_gemm_tc_nn_f32out_f16",
                 "grouped_gemm_tc_split_f32out_f16"}
# kernels whose f16 inputs reach fp32 arithmetic (the tensor-core GEMMs feed f16 straight to the MMAs;
# the merge reads fp32 partials; the f16 append copies bits)
NOT_WIDENING = {"grouped_gemm_tc_f16", "moe_gemm_act_tc_f16", "paged_attn_merge_f16", "paged_append_kv_f16",
                "grouped_gemm_tc_nn_f16", "grouped_gemm_wgrad_tc_f16", "grouped_gemm_tc_f32out_f16",
                "grouped_gemm_tc_nn_f32out_f16", "grouped_gemm_tc_split_f32out_f16", "grouped_gemm_wgrad_tc_split_a_f16",
                "grouped_gemm_wgrad_tc_split_ab_f16"}
TENSOR_CORE = {"grouped_gemm_tc_f16", "moe_gemm_act_tc_f16", "grouped_gemm_tc_nn_f16", "grouped_gemm_wgrad_tc_f16",
               "grouped_gemm_tc_f32out_f16", "grouped_gemm_tc_nn_f32out_f16", "grouped_gemm_tc_split_f32out_f16",
               "grouped_gemm_wgrad_tc_split_a_f16", "grouped_gemm_wgrad_tc_split_ab_f16"}


sr = report()


def _kernels() -> list[str]:
    from pykern.registry import parse_file, source_files

    return [s.name for src in source_files() if src.name in SOURCES for s in parse_file(src)]


def _f16(names: list[str]) -> list[str]:
    return [k for k in names if k.endswith("_f16") or "_f16_" in k or k.endswith("_f16kv")]


@lru_cache(maxsize=None)
def mix() -> dict[str, dict[str, dict[str, Any]]]:
    names = _kernels()
    want = _f16(names) + [k for k in names if "bf16" in k]
    return guard(lambda: sr.instruction_mix(want, ARCHS, with_resources=True))


def test_the_lists_name_real_f16_kernels() -> None:
    f16 = set(_f16(_kernels()))
    # paged.cu 10, sampling.cu 6, moe.cu 9
    assert len(f16) == 31, sorted(f16)
    assert (NARROWING | NO_F16_OUTPUT | NOT_WIDENING) <= f16
    assert not NARROWING & NO_F16_OUTPUT


def test_f16_narrowing_is_f2fp() -> None:
    m = mix()
    bad = [(k, a, m[k][a]["F2FP_F16"]) for k in NARROWING for a in ARCHS if m[k][a]["F2FP_F16"] == 0]
    assert not bad, f"f16 kernels narrowing without F2FP.F16.F32.PACK_AB: {bad}"
    # fp8 appends pack with F2FP.SATFINITE.<fp8>.F32.PACK_AB (counted apart from the f16 pack only by name)
    bad = [(k, a) for k in NO_F16_OUTPUT for a in ARCHS if m[k][a]["F2FP_F16"]]
    assert not bad, f"kernels without f16 outputs that pack to f16: {bad}"


def test_f16_widening_is_hadd2_f32() -> None:
    m = mix()
    reading = [k for k in _f16(_kernels()) if k not in NOT_WIDENING]
    assert len(reading) >= 14, reading
    bad = [(k, a) for k in reading for a in ARCHS if m[k][a]["HADD2_F32"] == 0]
    assert not bad, f"f16 kernels widening without HADD2.F32: {bad}"
    copy = m["paged_append_kv_f16"]
    assert all(copy[a]["HADD2_F32"] == copy[a]["F2FP"] == 0 for a in ARCHS), copy


def test_bf16_twins_use_no_f16_conversion() -> None:
    m = mix()
    # the FP8 kernels widen fp8 through f16 (F2FP.F16.E4M3.UNPACK_B, then HADD2.F32) by design
    bf16 = [k for k in _kernels() if "bf16" in k and not any(f in k for f in FP8)]
    assert len(bf16) >= 15, bf16
    bad = [(k, a) for k in bf16 for a in ARCHS if m[k][a]["F2FP_F16"] or m[k][a]["HADD2_F32"]]
    assert not bad, f"bf16 kernels with f16 conversions: {bad}"


def test_f16_tensor_cores_are_f16_mmas() -> None:
    m = mix()
    for k in TENSOR_CORE:
        for a in ARCHS:
            row = m[k][a]
            assert row["HMMA"] > 0 and row["HMMA_BF16"] == 0, (k, a, row)
            bf = m[k.replace("_f16", "_bf16")][a]
            assert bf["HMMA"] == bf["HMMA_BF16"] == row["HMMA"], (k, a, bf, row)  # the same loop, bf16 MMAs


def test_no_spills_in_any_f16_kernel() -> None:
    m = mix()
    bad = [(k, a, m[k][a]) for k in _f16(_kernels()) for a in ARCHS
           if m[k][a]["spill_stores"] or m[k][a]["spill_loads"] or m[k][a]["LDL"] or m[k][a]["STL"]]
    assert not bad, bad
