"""Registration of numba.cuda reference kernels (numba is imported only when one is built)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

# factory(cuda) -> (jitted_kernel, config); config(args) -> (grid, block), where
# args are the launch arguments in the kernel's parameter order (arrays as
# numba device arrays, scalars as Python numbers).
Factory = Callable[[Any], tuple[Any, Callable[[Sequence[Any]], tuple[tuple[int, ...], tuple[int, ...]]]]]


@dataclass
class Reference:
    names: tuple[str, ...]
    factory: Factory
    _built: Any = None

    def build(self, cuda: Any) -> tuple[Any, Callable]:
        if self._built is None:
            self._built = self.factory(cuda)
        return self._built


_REFERENCES: dict[str, Reference] = {}


def reference(*names: str) -> Callable[[Factory], Factory]:
    """Register a factory as the reference of one or more kernels (e.g. the f32 and bf16 twins).

    bf16 (`unsigned short*`) arrays reach the reference widened to float32 and
    its outputs are narrowed back by the numba backend, so one fp32 body can
    serve both twins.
    """

    def deco(factory: Factory) -> Factory:
        ref = Reference(tuple(names), factory)
        for n in names:
            if n in _REFERENCES:
                raise ValueError(f"reference for kernel {n!r} registered twice")
            _REFERENCES[n] = ref
        return factory

    return deco


def references() -> dict[str, Reference]:
    """Every registered reference by kernel name (importing pykern.reference registers them)."""
    from . import _load_all

    _load_all()
    return dict(_REFERENCES)
