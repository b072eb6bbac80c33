"""Every project kernel's difftest under the host backend's other modes: random and interleaved
block+thread schedules, FMA contraction off, racecheck. One small case per kernel keeps it fast
(the full case list runs under forward and reverse in tests/test_difftest.py)."""
from __future__ import annotations

import math

import pytest

from pykern.difftest import runner

from family_helpers import difftest_cases


def _small_cases() -> list[runner.Case]:
    """For each registered kernel the smallest non-big case that launches it."""
    best: dict[str, runner.Case] = {}

    def size(c: runner.Case) -> int:
        try:
            return math.prod(int(d) for d in c.shape)
        except (TypeError, ValueError):
            return 1 << 60

    for c in difftest_cases():  # runner.collect_cases(seed=0), built once per process
        if c.note == "big":
            continue
        for k in c.kernels:
            if k not in best or size(c) < size(best[k]):
                best[k] = c
    seen, out = set(), []
    for c in best.values():
        if c.id not in seen:
            seen.add(c.id)
            out.append(c)
    return sorted(out, key=lambda c: c.id)


CASES = _small_cases()
MODES = {
    "random": runner.Label("host:random:11", "host", (("PYKERN_HOST_SCHEDULE", "random:11"),)),
    "interleave": runner.Label("host:interleave:3", "host", (("PYKERN_HOST_SCHEDULE", "interleave:3"),)),
    # FMA contraction is the default (as NVRTC); the forward/reverse runs cover it. Off, built at -O1: with no
    # contraction the level changes no result (IEEE arithmetic, no -ffast-math), and each source's build of this
    # mode takes 20-50% less CPU than at -O2 (docs/host_backend.md, PYKERN_HOST_OPT).
    "fma0": runner.Label("host:fma0", "host", (("PYKERN_HOST_FMA", "0"), ("PYKERN_HOST_OPT", "1"))),
    "racecheck": runner.Label("host:racecheck", "host", (("PYKERN_HOST_RACECHECK", "1"),)),
    "initcheck": runner.Label("host:initcheck", "host", (("PYKERN_HOST_INITCHECK", "1"),)),
}


# FMA contraction off is left out for the arch-specific (sm_90a) cases: their matrix products run in the host's
# wgmma emulation (pykern/host/pk_host_sm90.cpp, the same in every mode), only their softmax and epilogue in the
# kernel code, and the fma0 builds of their two sources would add about a minute of compiling to CI. Every other
# mode runs them (racecheck / initcheck included), as do forward and reverse in tests/test_difftest.py.
PARAMS = [(c, m) for c in CASES for m in sorted(MODES) if not (c.arch and m == "fma0")]


@pytest.mark.parametrize("case,mode", PARAMS, ids=[f"{c.id}-{m}" for c, m in PARAMS])
def test_every_kernel_under_host_mode(case: runner.Case, mode: str) -> None:
    res = runner.run_case(case, [MODES[mode]])
    assert res.passed, "\n".join(res.failures()) or f"{case.id}: verdict {res.verdict}"


def test_small_cases_cover_every_kernel() -> None:
    from pykern import registry

    covered = {k for c in CASES for k in c.kernels}
    # arch-specific (sm_90a) kernels included: their cases play sm_90a on the host (PYKERN_HOST_ARCH) themselves
    names = {s.name for s in registry.kernels() if s.source.parent.name == "kernels_cu"}
    assert names and not names - covered, sorted(names - covered)
