"""One differential-test case: an op call on concrete inputs plus its NumPy float64 reference."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np

Outputs = Mapping[str, Any]


@dataclass(frozen=True)
class Case:
    """`run(backend)` calls the op and returns named outputs; `reference()` returns the same names in float64.

    `op` and `dtype` ("f32" | "bf16") select the tolerance; `kernels` lists every
    kernel name the run launches, so coverage of the registry can be checked.

    `arch` names the arch-specific target the case's kernels are built for (`// pykern: arch sm_90a`: TMA,
    wgmma), "" for portable kernels. Such a case runs on the host backend playing that arch (its `run` sets
    PYKERN_HOST_ARCH itself); the runner reports the backends that cannot run it as not applicable
    (`runner.not_applicable`).
    """

    op: str
    dtype: str
    shape: str
    kernels: tuple[str, ...]
    run: Callable[[str], Outputs]
    reference: Callable[[], Outputs]
    note: str = ""
    arch: str = ""

    @property
    def id(self) -> str:
        tail = f"-{self.note}" if self.note else ""
        return f"{self.op}[{self.dtype}]{self.shape}{tail}"


CaseGenerator = Callable[[np.random.Generator], Iterator[Case]]
_FAMILIES: dict[str, CaseGenerator] = {}


def register_cases(family: str) -> Callable[[CaseGenerator], CaseGenerator]:
    """Decorator for a family's case generator (one per module in pykern/difftest/cases/)."""

    def deco(fn: CaseGenerator) -> CaseGenerator:
        _FAMILIES[family] = fn
        return fn

    return deco


def register_case_groups(family: str, *groups: CaseGenerator) -> CaseGenerator:
    """Registers `family`'s generator as its groups of cases drawn in order from one rng (a group added at the end
    leaves the earlier groups' data as it was); returns that generator."""

    def cases(rng: np.random.Generator) -> Iterator[Case]:
        for group in groups:
            yield from group(rng)

    cases.__name__ = cases.__qualname__ = f"{family}_cases"
    return register_cases(family)(cases)


def families() -> dict[str, CaseGenerator]:
    """Every registered family generator (importing pykern.difftest.cases registers them)."""
    from . import cases  # noqa: F401  (imports register)

    return dict(_FAMILIES)
