"""Difftest cases for the Hopper (sm_90a) grouped GEMM, kernels_cu/grouped_gemm_sm90.cu (grouped_gemm_sm90 and
moe_gemm_act_sm90, bf16 and f16), against the float64 NumPy references.

Like the sm_90a attention cases (sm90.py), each declares `arch="sm_90a"`: on the host backend its run plays that
arch (PYKERN_HOST_ARCH=sm_90a); numba and nvrtc (the cases' inputs are NumPy, and a tensor map needs device arrays)
report it as not applicable. The launch goes through the op's own helper, pykern/ops/_moe_sm90.py `try_launch`
(the tensor maps, persistent grid and shared memory the ops use); a helper that declines is an error, never a
fallback to another kernel. Shapes: empty groups, a one-row group, groups under and over a tile, N and K off the
tiles, more tiles than the host's persistent CTAs.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from ..case import Case, register_cases
from .moe import np_act, np_grouped_gemm
from .sm90 import ARCH, _declined, _host_arch, _sfx
from .training import _cast, f64

_SHAPES = (  # (group sizes, N, K); act: N = 2I
    ([130, 0, 1, 70], 136, 72),
    ([0, 257, 5], 300, 136),
)
_ACTS = ("silu", "gelu_tanh")


def np_moe_gemm_act(a: Any, b: Any, offsets: Any, activation: str) -> np.ndarray:
    """h = act(a @ gate^T) * (a @ up^T) per group, b [E, 2I, K] (gate rows first)."""
    gu = np_grouped_gemm(a, b, offsets)
    inter = f64(b).shape[1] // 2
    return np_act(gu[:, :inter], activation) * gu[:, inter:]


def _case(kind: str, sizes: list[int], n: int, k: int, act: str | None, rng: np.random.Generator) -> Case:
    from ...ops import _moe_sm90 as sm90
    from ...ops.moe import ACTIVATIONS

    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    m, e = int(off[-1]), len(sizes)
    a = _cast(rng.standard_normal((m, k)), kind)
    b = _cast(rng.standard_normal((e, n, k)) / math.sqrt(k), kind)
    name = ("moe_gemm_act_sm90" if act else "grouped_gemm_sm90") + _sfx(kind)
    cols = n // 2 if act else n

    def run(backend: str) -> dict[str, Any]:
        with _host_arch(backend):
            out = np.zeros((m, cols), a.dtype)
            if not sm90.try_launch(a, b, off, out, m, n, k, e, kind, ACTIVATIONS[act] if act else None, None,
                                   backend):
                raise _declined(name, backend)
        return {"out": out}

    def ref() -> dict[str, Any]:
        return {"out": np_moe_gemm_act(a, b, off, act) if act else np_grouped_gemm(a, b, off)}

    shape = f"{'-'.join(map(str, sizes))}x{n}x{k}" + (f"-{act}" if act else "") + "-sm90a"
    return Case(op="grouped_gemm", dtype=kind, shape=shape, kernels=(name,), run=run, reference=ref, arch=ARCH)


@register_cases("moe_sm90")
def cases(rng: np.random.Generator) -> Iterator[Case]:
    for kind in ("bf16", "f16"):
        for sizes, n, k in _SHAPES:
            yield _case(kind, sizes, n, k, None, rng)
        for (sizes, n, k), act in zip(_SHAPES, _ACTS):
            yield _case(kind, sizes, n, k, act, rng)
