"""References and difftest cases of the test-only kernels (tests/difftest_extra/cu, tests/wrong_cu).

Loaded through PYKERN_DIFFTEST_EXTRA (a module path or a .py file), never part of
the package. Cases are yielded only for kernels the registry holds, so the same
module serves the good folder, the wrong folder, or both on PYKERN_KERNEL_PATH.
"""
from __future__ import annotations

from typing import Any

import numpy as np

import pykern
from pykern.difftest.case import Case, register_cases
from pykern.reference.base import reference

_BLOCK = 32  # small blocks: the simulator runs each thread as a Python thread


def _grid(n: int) -> tuple[tuple[int], tuple[int]]:
    return ((int(n) + _BLOCK - 1) // _BLOCK,), (_BLOCK,)


@reference("pk_test_axpy", "pk_test_axpy_bf16")
def _axpy(cuda: Any) -> Any:
    @cuda.jit
    def k(x, y, a, n):
        i = cuda.grid(1)
        if i < n:
            y[i] = a * x[i] + y[i]

    return k, lambda args: _grid(args[3])


@reference("pk_test_rowsum")
def _rowsum(cuda: Any) -> Any:
    @cuda.jit
    def k(x, out, rows, cols):
        r = cuda.grid(1)
        if r < rows:
            acc = 0.0
            for c in range(cols):
                acc += x[r * cols + c]
            out[r] = acc

    return k, lambda args: _grid(args[2])


@reference("pk_test_scale")
def _scale(cuda: Any) -> Any:
    @cuda.jit
    def k(x, y, a, n):
        i = cuda.grid(1)
        if i < n:
            y[i] = a * x[i]

    return k, lambda args: _grid(args[3])


def axpy(x: np.ndarray, y: np.ndarray, a: float, backend: str | None = None) -> np.ndarray:
    """a * x + y into a copy of y (the case inputs stay untouched between backends)."""
    out = y.copy()
    name = "pk_test_axpy_bf16" if x.dtype.name == "bfloat16" else "pk_test_axpy"
    pykern.launch(name, (x.size + 127) // 128, 128, x, out, a, x.size, backend=backend)
    return out


def rowsum(x: np.ndarray, backend: str | None = None) -> np.ndarray:
    out = np.zeros(x.shape[0], np.float32)
    pykern.launch("pk_test_rowsum", x.shape[0], 64, x, out, x.shape[0], x.shape[1], backend=backend)
    return out


def scale(x: np.ndarray, a: float, backend: str | None = None) -> np.ndarray:
    out = np.zeros_like(x)
    pykern.launch("pk_test_scale", (x.size + 127) // 128, 128, x, out, a, x.size, backend=backend)
    return out


@register_cases("pk_test")
def cases(rng: np.random.Generator) -> Any:
    import ml_dtypes

    have = {s.name for s in pykern.kernels()}
    if "pk_test_axpy" in have:
        for n in (1, 127, 300):
            x = rng.standard_normal(n).astype(np.float32)
            y = rng.standard_normal(n).astype(np.float32)
            yield Case(op="pk_test_axpy", dtype="f32", shape=str(n), kernels=("pk_test_axpy",),
                       run=lambda be, x=x, y=y: {"y": axpy(x, y, 0.5, backend=be)},
                       reference=lambda x=x, y=y: {"y": 0.5 * x.astype(np.float64) + y})
    if "pk_test_axpy_bf16" in have:
        x = rng.standard_normal(200).astype(ml_dtypes.bfloat16)
        y = rng.standard_normal(200).astype(ml_dtypes.bfloat16)
        yield Case(op="pk_test_axpy", dtype="bf16", shape="200", kernels=("pk_test_axpy_bf16",),
                   run=lambda be, x=x, y=y: {"y": axpy(x, y, 0.5, backend=be)},
                   reference=lambda x=x, y=y: {"y": 0.5 * x.astype(np.float64) + y.astype(np.float64)})
    if "pk_test_rowsum" in have:
        for rows, cols in ((1, 1), (5, 100)):
            x = rng.standard_normal((rows, cols)).astype(np.float32)
            yield Case(op="pk_test_rowsum", dtype="f32", shape=f"{rows}x{cols}", kernels=("pk_test_rowsum",),
                       run=lambda be, x=x: {"out": rowsum(x, backend=be)},
                       reference=lambda x=x: {"out": x.astype(np.float64).sum(axis=1)})
    if "pk_test_scale" in have:
        x = rng.standard_normal(100).astype(np.float32)
        yield Case(op="pk_test_scale", dtype="f32", shape="100", kernels=("pk_test_scale",),
                   run=lambda be, x=x: {"y": scale(x, 3.0, backend=be)},
                   reference=lambda x=x: {"y": 3.0 * x.astype(np.float64)})
