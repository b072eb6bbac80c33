"""tools/sass_report.py: SASS opcode classification, and the tensor-core instruction mix of the bf16 flash kernels."""
from __future__ import annotations

import pytest

from sass_helpers import report

sr = report()

SAMPLE = """
	code for sm_80
		Function : kern_a
	.headerflags	@"EF_CUDA_SM80 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM80)"
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;    /* 0x00000a00ff017624 */
        /*0010*/                   LDG.E.128 R4, [R2.64] ;                    /* 0x0 */
        /*0020*/              @!P0 LDG.E.U16 R8, [R2.64] ;                    /* 0x0 */
        /*0030*/                   LDG.E R9, [R2.64] ;                        /* 0x0 */
        /*0040*/                   LDG.E.64 R10, [R2.64] ;                    /* 0x0 */
        /*0050*/                   HMMA.16816.F32.BF16 R12, R4, R8, R12 ;     /* 0x0 */
        /*0060*/                   LDSM.16.MT88.4 R4, [R3] ;                  /* 0x0 */
        /*0070*/                   LDGSTS.E.BYPASS.128 [R5], [R2.64] ;        /* 0x0 */
        /*0080*/                   STG.E.U16 [R2.64], R4 ;                    /* 0x0 */
        /*0090*/                   NOP ;                                      /* 0x0 */
		Function : kern_b
        /*0000*/               @P1 STL [R1], R3 ;                             /* 0x0 */
        /*0010*/                   F2FP.BF16.PACK_AB R3, R4, R5 ;              /* 0x0 */
        /*0020*/                   MUFU.EX2 R3, R4 ;                          /* 0x0 */
        /*0030*/                   EXIT ;                                     /* 0x0 */
"""


def test_count_sass_classifies_opcodes_and_widths():
    c = sr.count_sass(SAMPLE)
    a, b = c["kern_a"], c["kern_b"]
    assert (a["LDG128"], a["LDGsub"], a["LDG32"], a["LDG64"]) == (1, 1, 1, 1)
    assert (a["HMMA"], a["LDSM"], a["LDGSTS"], a["STGsub"]) == (1, 1, 1, 1)
    assert a["total"] == 9  # NOP not counted
    assert (b["STL"], b["F2FP"], b["MUFU"], b["total"], b["HMMA"]) == (1, 1, 1, 4, 0)


def _need_cuobjdump():
    try:
        return sr.find_cuobjdump()
    except sr.CuobjdumpUnavailable as e:
        pytest.skip(str(e))


def test_instruction_mix_of_a_scalar_kernel_has_no_hmma():
    _need_cuobjdump()
    mix = sr.instruction_mix("attention_fwd_fma_d64", ["sm_80"], with_resources=True)
    row = mix["attention_fwd_fma_d64"]["sm_80"]
    assert row["HMMA"] == 0 and row["FFMA"] > 0 and row["total"] > 100
    assert row["registers"] > 0


def test_sources_built_for_arch_specific_targets_are_reported_at_them(tmp_path):
    """`--arch sm_90` over every kernel: a `// pykern: arch sm_90a` source is compiled for sm_90a (what an sm_90
    GPU runs), not for sm_90 (its wgmma would not compile), and left out at archs it is not built for."""
    only = tmp_path / "a.cu"
    only.write_text("// pykern: arch sm_90a\nextern \"C\" __global__ void k() {}\n")
    plain = tmp_path / "b.cu"
    plain.write_text("extern \"C\" __global__ void k2() {}\n")
    assert sr._targets(only, ["sm_80", "sm_90", "sm_90a"]) == [("sm_90", "sm_90a"), ("sm_90a", "sm_90a")]
    assert sr._targets(plain, ["sm_80", "sm_90"]) == [("sm_80", "sm_80"), ("sm_90", "sm_90")]
