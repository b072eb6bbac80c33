"""Every registered kernel is launched by some difftest case, and arch-specific cases run where they can.

`pykern.kernels()` (the project's kernels_cu/) against the case list of `python -m pykern.difftest`
(`runner.collect_cases`): a kernel that no case launches fails here by name. The earlier form of this check (in
tests/test_difftest.py) left out the kernels of arch-specific sources (`// pykern: arch sm_90a`) together with its
numba-reference check, since numba has no wgmma or TMA; so the 20 sm_90a attention kernels had no case and
nothing said so. They have cases now (attention.py, mla.py, moe_sm90.py, built on the _sm90.py helpers) that
run on the host backend playing sm_90a, and are reported as not applicable, not passed, on numba and nvrtc.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import pykern
from pykern.difftest import runner
from pykern.errors import ArgumentError

from family_helpers import difftest_cases

ROOT = Path(__file__).resolve().parent.parent
CASES = list(difftest_cases())  # runner.collect_cases(seed=0), shared with tests/test_difftest.py

# kernel name -> why no difftest case launches it. A kernel is left out only on purpose, with the reason here;
# there is none today.
EXCLUDED: dict[str, str] = {}


def _project_kernels() -> list:
    """The registry's kernels from this repository's kernels_cu/ (PYKERN_KERNEL_PATH may add test kernels)."""
    return [s for s in pykern.kernels() if s.source.parent.resolve() == ROOT / "kernels_cu"]


def test_every_registered_kernel_has_a_case() -> None:
    names = [s.name for s in _project_kernels()]
    assert len(names) > 300, "the registry looks incomplete"
    covered = {k for c in CASES for k in c.kernels}
    missing = sorted(n for n in names if n not in covered and n not in EXCLUDED)
    assert missing == [], f"kernels no difftest case launches (add a case, or an entry in EXCLUDED): {missing}"
    assert sorted(set(EXCLUDED) - set(names)) == [], "EXCLUDED names kernels that are not registered"
    assert sorted(set(EXCLUDED) & covered) == [], "EXCLUDED names kernels that now have a case"


def test_arch_specific_kernels_have_cases_that_declare_the_arch() -> None:
    # A case launching a kernel of an arch-specific source says so (Case.arch), so that the runner runs it on the
    # host playing that arch and reports the other backends as not applicable; a portable case declares none.
    specs = {s.name: s for s in pykern.kernels()}
    arch_kernels = {n for n, s in specs.items() if s.archs}
    # attention_fwd_sm90.cu (dense: d64 / d96 / d128 / d256 / d192_dv128, each with and without softcap: 20; varlen:
    # the same five shapes with and without softcap: 20) and attention_bwd_sm90.cu (dK/dV and dQ, d64 / d96 / d128
    # / d192_dv128 / d256, dense and varlen, with and without softcap: 80; the fused dK/dV/dQ, d64 / d96 / d128 / d256,
    # atomic and _det, dense and varlen, with and without softcap: 64, and d192_dv128 the same: 16): 200;
    # mla_sm90.cu: 2;
    # grouped_gemm_sm90.cu (nt, act, nn, wgrad, the fp32-result nt and nn, and the split-precision f32out nt and
    # wgrad split_a / split_ab): 18; its FP8 block-scaled one (grouped_gemm_fp8_sm90, which gemm_fp8 and
    # grouped_gemm_fp8 launch): 1; cross_entropy_sm90.cu (the cluster cross-entropy, f32 / bf16 / f16): 3;
    # attention_fwd_sm90.cu's paged prefill (paged_prefill_sm90_d64 / d128 / d192_dv128, with and without softcap,
    # bf16 / f16 queries over a cache of their type, e4m3 or e5m2: 36; d256 the same, its FP8 caches staged: 12; d96
    # the same: 12): 60;
    # attention_fwd_fp8_sm90.cu (d64 / d128 / d256,
    # with and without softcap, dense and varlen): 12; norm_sm90.cu (the cluster rms_norm_backward of wide rows, f32 /
    # bf16 / f16): 3
    assert len(arch_kernels) == 299
    for c in CASES:
        archs = {a for k in c.kernels for a in specs[k].archs}
        assert c.arch == (archs.pop() if archs else ""), (c.id, c.arch, archs)
    # causal and not for every sm_90a attention kernel, in bf16 and f16 (MLA decode has no causal mask); two
    # shapes for each grouped GEMM
    for name in (n for n in arch_kernels if not n.startswith("mla_")):
        mine = [c for c in CASES if name in c.kernels]
        if "gemm" in name:
            assert len(mine) == 2 and all(c.shape.endswith("-sm90a") for c in mine), name
        elif name.startswith(("cross_entropy", "rms_norm")):  # ragged and 16-byte rows (every option)
            assert len(mine) >= 2 and all(c.shape.endswith("-sm90a") for c in mine), name
        else:
            assert {c.shape.endswith("-causal-sm90a") for c in mine} == {True, False}, name


def _sm90_case(kernel: str = "attention_fwd_sm90_d128_f16", causal: bool = True) -> runner.Case:
    return next(c for c in CASES if kernel in c.kernels and c.shape.endswith("-causal-sm90a") == causal)


def test_sm90_case_runs_on_the_host_and_is_not_applicable_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYKERN_HOST_ARCH", raising=False)
    monkeypatch.delenv("PYKERN_HOST_SCHEDULE", raising=False)
    case = _sm90_case()
    res = runner.run_case(case, runner.parse_labels("host,numba"))
    assert res.passed and res.verdict == "ok", res.failures()
    host, numba = res.labels
    assert host.status == "ok" and {c.output for c in host.checks} == {"out", "lse"}
    assert 0 < host.max_abs <= res.atol + res.rtol * 4  # f16 rounding, not zero: the kernel computed it
    assert (numba.status, numba.message) == ("skip", "not applicable (sm_90a): numba has no wgmma / TMA")
    assert runner.row(res)[-1] == "ok (numba skipped: not applicable (sm_90a): numba has no wgmma / TMA)"
    assert runner.by_backend([res])["numba"]["skip_reasons"] == {numba.message: 1}
    assert runner.not_applicable(case, runner.parse_label("nvrtc")).startswith("not applicable (sm_90a): ")
    assert runner.not_applicable(case, runner.parse_label("host:reverse")) == ""
    portable = next(c for c in CASES if not c.arch)
    assert [runner.not_applicable(portable, lb) for lb in runner.parse_labels("host,numba,nvrtc")] == ["", "", ""]
    # the case played sm_90a for its run only
    assert "PYKERN_HOST_ARCH" not in os.environ
    # only a backend that runs the sm_90a kernel passes: called off the host, the op's helper declines and the
    # case says so instead of running another kernel
    with pytest.raises(ArgumentError, match=r"attention_fwd_sm90_d128_f16, got 'numba'"):
        case.run("numba")


def test_sm90_backward_case_checks_every_gradient() -> None:
    case = _sm90_case("attention_bwd_sm90_dq_d64_bf16", causal=True)
    assert case.kernels == ("attention_bwd_sm90_dkdv_d64_bf16", "attention_bwd_sm90_dq_d64_bf16")
    ref = case.reference()
    assert set(ref) == {"dq", "dk", "dv"}
    # 150 queries on 60 keys, causal bottom-right: the first 90 query rows see no key, their dq is 0
    assert np.all(ref["dq"][:, :90] == 0) and np.abs(ref["dq"][:, 90:]).max() > 0.1
    res = runner.run_case(case, runner.parse_labels("host:forward,host:reverse"))
    assert res.passed, res.failures()
    assert res.pair_max == 0  # one writer per element, fixed order: the same bits under both schedules


def test_cli_runs_sm90_kernels_on_the_host_and_says_why_not_on_numba() -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PYKERN_KERNEL_PATH", "PYKERN_DIFFTEST_EXTRA",
                                                              "PYKERN_HOST_ARCH", "NUMBA_ENABLE_CUDASIM")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pykern.difftest", "--kernels", "attention_fwd_varlen_sm90_d64_f16",
                        "--backends", "host,numba"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("flash_attention_varlen[f16]")]
    assert len(rows) == 2 and all(ln.rstrip().endswith(
        "ok (numba skipped: not applicable (sm_90a): numba has no wgmma / TMA)") for ln in rows), rows
    block = r.stdout.split("\nSummary: ", 1)[1]
    assert "  host   ran 2: 2 passed, 0 failed, 0 errors\n" in block, block
    assert "  numba  ran 0: 0 passed, 0 failed, 0 errors; skipped 2\n" in block, block
    assert "2 skipped: not applicable (sm_90a): numba has no wgmma / TMA" in block, block
