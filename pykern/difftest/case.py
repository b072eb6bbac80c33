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
    """

    op: str
    dtype: str
    shape: str
    kernels: tuple[str, ...]
    run: Callable[[str], Outputs]
    reference: Callable[[], Outputs]
    note: str = ""

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


def families() -> dict[str, CaseGenerator]:
    """Every registered family generator (importing pykern.difftest.cases registers them)."""
    from . import cases  # noqa: F401  (imports register)

    return dict(_FAMILIES)
