"""SASS of the memory-bound kernels, read from the sm_80 and sm_90 cubins with cuobjdump: no GPU needed.

- every bf16 kernel of forward.cu / training.cu / norm_act_loss.cu that narrows fp32 -> bf16 does it in
  hardware (F2FP, from cvt.rn.bf16x2.f32), not in ~7 integer instructions per element;
- every f16 kernel narrows with F2FP.F16.F32.PACK_AB (cvt.rn.f16x2.f32) and widens with HADD2.F32
  (cvt.f32.f16), and the bf16 ones use no f16 conversion;
- the aligned paths of the bandwidth-bound kernels issue 128-bit global loads (transpose_2d_bf16: >= 64-bit),
  norm_act_loss.cu's row and elementwise kernels and rope (q and k, and its norm backward) 128-bit loads and
  stores in every dtype;
- silu_gate and causal_attn_softmax use MUFU.EX2 (fast exp) and no spills anywhere.
Only these three sources are compiled (through pykern's cache), for 2 archs, to keep this fast.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from sass_helpers import guard, report, source_sass, spills

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
    "norm_grad_reduce": "LDG128",
    "embedding_backward": "LDG128", "embedding_backward_bf16": "LDG128",
}
# every f16 twin moves as its bf16 one does
WIDE_LOADS.update({k.replace("_bf16", "_f16"): v for k, v in list(WIDE_LOADS.items()) if k.endswith("_bf16")})
# norm_act_loss.cu: 16-byte loads and stores (LDG.E.128 / STG.E.128) in f32, bf16 and f16
EXT_16B = [f"{k}{s}" for k in ("add_rms_norm", "add_rms_norm_backward", "layer_norm", "layer_norm_backward", "gelu",
                               "gelu_backward", "gelu_gate", "gelu_gate_backward", "rope", "rope_norm_backward")
           for s in ("", "_bf16", "_f16")]


# Row kernels that issue a thread's 16-byte loads of a row (x and g, of 2 chunks or more) before the first is used,
# norm_grad_reduce (4 partial rows a lane) and cross_entropy_fwd_bwd (CE_BATCH vectors a sweep): the most LDG.E.128 a thread has in flight (tools/sass_report.py
# load_batches: a linear scan of the listing) must reach this on every arch tested.
LOADS_IN_FLIGHT = {k: 4 for k in ("rms_norm_backward", "rms_norm_backward_bf16", "rms_norm_backward_f16",
                                  "layer_norm_backward", "layer_norm_backward_bf16", "layer_norm_backward_f16",
                                  "add_rms_norm_backward", "add_rms_norm_backward_bf16",
                                  "add_rms_norm_backward_f16",
                                  "norm_grad_reduce", "cross_entropy_fwd_bwd", "cross_entropy_fwd_bwd_bf16",
                                  "cross_entropy_fwd_bwd_f16",
                                  # rows of <= 2 chunks a thread: x / residual / probs, grad_out (and the weight)
                                  # of both chunks as raw words before the first use
                                  "rms_norm", "rms_norm_bf16", "rms_norm_f16", "add_rms_norm", "add_rms_norm_bf16",
                                  "add_rms_norm_f16", "softmax_backward", "softmax_backward_bf16",
                                  "softmax_backward_f16")}
# rope: a lane loads both 16-byte chunks of ROPE_RU = 2 heads before converting any (4 in flight); its norm
# backward x and the output gradient, 2 chunks each, of one head (4)
LOADS_IN_FLIGHT.update({f"{k}{s}": 4 for k in ("rope", "rope_norm_backward") for s in ("", "_bf16", "_f16")})


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
    assert len(f16) == 22, f16  # forward.cu 6, training.cu 7, norm_act_loss.cu 9
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


@lru_cache(maxsize=None)
def inflight() -> dict[str, dict[str, dict[str, Any]]]:
    mix()  # skips without cuobjdump / NVRTC; compiles the sources into the cache
    return sr.inflight_metrics(sorted(LOADS_IN_FLIGHT), ARCHS)


@pytest.mark.parametrize("kernel", sorted(LOADS_IN_FLIGHT))
def test_row_loads_in_flight(kernel: str) -> None:
    """The one-pass norm backwards load x and g of all their chunks (raw 16-byte words, widened afterwards, no
    branch between) before the first use; norm_grad_reduce 4 partial rows a lane; cross-entropy 4 vectors of
    the row before its online max / sum chain (1 before)."""
    got = inflight()[kernel]
    for a in ARCHS:
        assert got[a]["ldg128_max"] >= LOADS_IN_FLIGHT[kernel], f"{kernel} {a}: {got[a]}"


def test_norm_grad_reduce_stores_16_bytes() -> None:
    for a in ARCHS:
        row = mix()["norm_grad_reduce"][a]
        assert row["STG128"] > 0 and row["LDG128"] > 0, row


def test_load_batches_counts_loads_before_their_first_use() -> None:
    """The metric itself on a hand-written listing: 3 independent loads, a use, then a load whose address
    comes from an earlier load (a dependent chain: a batch of its own)."""
    text = """
        Function : k
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/                   LDG.E.128 R8, desc[UR4][R12.64] ;
        /*0020*/                   IADD3 R20, R21, 0x1, RZ ;
        /*0030*/                   LDG.E.128 R16, desc[UR4][R14.64] ;
        /*0040*/                   FADD R22, R9, R23 ;
        /*0050*/                   LDG.E.128 R24, desc[UR4][R2.64] ;
        /*0060*/                   LDG.E.128 R28, desc[UR4][R24.64] ;
        /*0070*/                   EXIT ;
    """
    assert sr.load_batches(text) == {"k": [3, 1, 1]}


# The exact GELU's vector loop (one loop per form: the tanh form's divides, MUFU.RCP, tell them apart): SASS
# instructions a loop trip issues over the elements it moves (4 f32 / 8 bf16 / f16), at most (sm_80 and sm_90).
# With libdevice's erff the same loops issued 28-29.5 (gelu), 30.6-31.8 (gelu_gate), 41.9-43.3 (gelu_backward)
# and 46.8-48.8 (gelu_gate_backward) an element; pk_gelu_tail issues 17.25-17.5, 19.25-19.9, 22.25-22.9 and
# 26.75-28.1.
GELU_EXACT_PER_ELEMENT = {"gelu": 18.0, "gelu_gate": 20.0, "gelu_backward": 23.0, "gelu_gate_backward": 28.5}


@pytest.mark.parametrize("op", sorted(GELU_EXACT_PER_ELEMENT))
def test_gelu_exact_form_instructions_per_element(op: str) -> None:
    mix()  # skips without cuobjdump / NVRTC
    for a in ARCHS:
        loops = sr.inner_loops(source_sass("norm_act_loss.cu", a))
        for suffix, per_vec in (("", 4), ("_bf16", 8), ("_f16", 8)):
            vec = [r for r in loops[op + suffix] if any(o.startswith("LDG.E.128") for o in r["ops"])]
            exact = [r for r in vec if "MUFU.RCP" not in r["ops"]]
            assert len(exact) == 1, f"{op}{suffix} {a}: no vector loop of the exact form alone: {vec}"
            got = exact[0]["insns"] / per_vec
            assert got <= GELU_EXACT_PER_ELEMENT[op], f"{op}{suffix} {a}: {got} instructions an element"
            # one ex2 an element for Phi (two in the derivatives: exp(-x^2 / 2)), no other MUFU
            mufu = {o: n for o, n in exact[0]["ops"].items() if o.startswith("MUFU")}
            assert mufu == {"MUFU.EX2": per_vec * (2 if "backward" in op else 1)}, (op + suffix, a, mufu)


# The tanh GELU's vector loop (told apart by its MUFU.RCP): s = 0.5 (1 + tanh u) = 1 / (1 + 2^(-2u log2 e)) by one
# ex2 and one rcp an element. With tanhf the same loops issued 25.4-26.25 (gelu), 27.75-28 (gelu_gate),
# 33.75-34.1 (gelu_backward) and 39-39.5 (gelu_gate_backward) an element; pk_gelu_tanh_s issues 11.25-12,
# 13.25-13.9, 18.5-19 and 22-23.25 (sm_80 and sm_90).
GELU_TANH_PER_ELEMENT = {"gelu": 12.0, "gelu_gate": 14.0, "gelu_backward": 19.0, "gelu_gate_backward": 23.25}


@pytest.mark.parametrize("op", sorted(GELU_TANH_PER_ELEMENT))
def test_gelu_tanh_form_instructions_per_element(op: str) -> None:
    mix()  # skips without cuobjdump / NVRTC
    for a in ARCHS:
        loops = sr.inner_loops(source_sass("norm_act_loss.cu", a))
        for suffix, per_vec in (("", 4), ("_bf16", 8), ("_f16", 8)):
            vec = [r for r in loops[op + suffix] if any(o.startswith("LDG.E.128") for o in r["ops"])]
            tanh = [r for r in vec if "MUFU.RCP" in r["ops"]]
            assert len(tanh) == 1, f"{op}{suffix} {a}: no vector loop of the tanh form alone: {vec}"
            got = tanh[0]["insns"] / per_vec
            assert got <= GELU_TANH_PER_ELEMENT[op], f"{op}{suffix} {a}: {got} instructions an element"
            # one ex2 and one rcp an element (value and derivative share them), no other MUFU
            mufu = {o: n for o, n in tanh[0]["ops"].items() if o.startswith("MUFU")}
            assert mufu == {"MUFU.EX2": per_vec, "MUFU.RCP": per_vec}, (op + suffix, a, mufu)

