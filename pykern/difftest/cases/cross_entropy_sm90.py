"""Difftest cases for the Hopper cross-entropy, kernels_cu/cross_entropy_sm90.cu (cross_entropy_fwd_bwd_cluster,
f32 / bf16 / f16: a thread-block cluster holds each row in shared memory, the logits read once), through
ops.cross_entropy_fwd_bwd against the float64 NumPy reference (training.py's np_cross_entropy), held to the op's
tolerance rows.

Like the other sm_90a cases, each declares `arch="sm_90a"`: on the host backend its run plays that arch
(PYKERN_HOST_ARCH=sm_90a), where the op takes the cluster kernel; a backend on which the op would take the two-sweep
kernel instead (numba, other GPUs) is an error, never a fallback. Shapes: ragged vocabularies (element copies, a
last CTA's short slice), 16-byte rows, clusters of 2, 4 and 8 CTAs, ignore_index rows, every option.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..case import Case, register_cases
from ._sm90 import declined as _declined, sm90_case
from .training import _cast, np_cross_entropy

ALL = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 30.0}
_SPECS = (  # (kind, vocab, rows, options); "big": a 128k vocabulary (8 CTAs)
    ("f32", 1003, 5, {}),
    ("f32", 2048, 6, {"weight": "rand", "label_smoothing": 0.1, "z_loss": 1e-2, "return_z_loss": True}),
    ("bf16", 333, 7, ALL),
    ("bf16", 50000, 3, dict(ALL, reduction="sum")),
    ("bf16", 131072, 2, {"label_smoothing": 0.1}),
    ("f16", 255, 6, {"reduction": "none", "softcap": 5.0}),
    ("f16", 264, 5, {"weight": "rand", "reduction": "none", "label_smoothing": 0.1}),
)


def _case(kind: str, vocab: int, rows: int, o: dict, rng: np.random.Generator) -> Case:
    from ...arrays import kernel_suffix

    logits = _cast(3.0 * rng.standard_normal((rows, vocab)), kind)
    t = rng.integers(0, vocab, size=rows).astype(np.int64)
    t[1::3] = -100  # ignore_index rows between live ones
    tag = "".join(f"-{k}{v}" for k, v in o.items())
    if o.get("weight") == "rand":
        o = dict(o, weight=rng.uniform(0.25, 2.0, vocab).astype(np.float32))
        if o.get("reduction") == "none":
            o["grad_output"] = rng.standard_normal(rows).astype(np.float32)
    name = "cross_entropy_fwd_bwd_cluster" + kernel_suffix(kind)

    def run(be: str) -> dict[str, Any]:
        from ... import ops
        from ...ops.training import _cluster_usable

        if not _cluster_usable(be, logits):
            raise _declined(name, be)
        out = ops.cross_entropy_fwd_bwd(logits, t, -100, backend=be, **o)
        return {"loss": np.asarray(out[0]), "grad": np.asarray(out[1]),
                **({"z_loss": np.asarray(out[2])} if len(out) > 2 else {})}

    def ref() -> dict[str, Any]:
        out = np_cross_entropy(logits, t, -100, **o)
        return {"loss": out[0], "grad": out[1], **({"z_loss": out[2]} if len(out) > 2 else {})}

    red = () if o.get("reduction") == "none" else ("cross_entropy_loss_reduce",)
    return sm90_case("cross_entropy_fwd_bwd", kind, f"{rows}x{vocab}-pad_some-100{tag}",
                     ("cross_entropy_count", name) + red, run, ref)


@register_cases("cross_entropy_sm90")
def cases(rng: np.random.Generator) -> Iterator[Case]:
    for kind, vocab, rows, o in _SPECS:
        yield _case(kind, vocab, rows, o, rng)
