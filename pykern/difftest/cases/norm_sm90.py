"""Difftest cases for the Hopper rms_norm_backward of wide rows, kernels_cu/norm_sm90.cu (rms_norm_backward_cluster,
f32 / bf16 / f16: a thread-block cluster splits each row past one CTA's 8192 columns, the row sums combined through
distributed shared memory), through ops.rms_norm_backward against the float64 NumPy reference (training.py's
np_rms_norm_backward), held to the op's tolerance rows.

Like the other sm_90a cases, each declares `arch="sm_90a"`: on the host backend its run plays that arch
(PYKERN_HOST_ARCH=sm_90a), where the op takes the cluster kernel; a backend on which the op would take the one-CTA
kernels instead (numba, other GPUs) is an error, never a fallback. Shapes: ragged widths (the element path, a last
CTA's short slice), 16-byte rows, clusters of 2, 4 and 8 CTAs, Gemma's offset, one and several partial rows.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..case import Case, register_cases
from ._sm90 import declined as _declined, sm90_case
from .training import _cast, np_rms_norm_backward

_SPECS = (  # (kind, rows, dim, offset)
    ("f32", 2, 8200, 0.0),     # 2 CTAs of 4112 columns, 16-byte path
    ("f32", 2, 65536, 0.0),    # 8 CTAs
    ("bf16", 3, 16384, 1.0),   # 2 CTAs, Gemma's (1 + weight)
    ("bf16", 1, 32768, 0.0),   # 4 CTAs, one row: the partial row is grad_weight itself
    ("f16", 3, 8201, 0.0),     # ragged: the element path, the last CTA's slice short
    ("f16", 2, 20000, 0.0),    # 4 CTAs of 5008 columns, the last one's 4976
)


def _case(kind: str, rows: int, dim: int, offset: float, rng: np.random.Generator) -> Case:
    from ...arrays import kernel_suffix

    x = _cast(rng.standard_normal((rows, dim)), kind)
    w = _cast(1.0 + 0.5 * rng.standard_normal(dim), kind)
    g = _cast(rng.standard_normal((rows, dim)), kind)
    name = "rms_norm_backward_cluster" + kernel_suffix(kind)

    def run(be: str) -> dict[str, Any]:
        from ... import ops
        from ...ops.training import _cluster_usable

        if not _cluster_usable(be, x):
            raise _declined(name, be)
        gx, gw = ops.rms_norm_backward(x, w, g, 1e-6, offset=offset, backend=be)
        return {"grad_x": np.asarray(gx), "grad_weight": np.asarray(gw)}

    def ref() -> dict[str, Any]:
        gx, gw = np_rms_norm_backward(x, w, g, 1e-6, offset=offset)
        return {"grad_x": gx, "grad_weight": gw}

    red = ("norm_grad_reduce",) if rows > 1 else ()
    tag = "-offset1" if offset else ""
    return sm90_case("rms_norm_backward", kind, f"{rows}x{dim}{tag}", (name,) + red, run, ref)


@register_cases("norm_sm90")
def cases(rng: np.random.Generator) -> Iterator[Case]:
    for kind, rows, dim, offset in _SPECS:
        yield _case(kind, rows, dim, offset, rng)
