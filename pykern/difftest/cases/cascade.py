"""Difftest cases for kernels_cu/cascade.cu and the float64 NumPy references of its ops: two states and many,
16-byte and element paths (head_dim 64 / 33), empty segments (lse -inf) alone and together, the in-place
merge with a token mask, more states than a warp has lanes."""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ...arrays import bfloat16, kernel_suffix
from ..case import Case, register_case_groups


def _f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def np_merge_states(v: Any, s: Any) -> tuple[np.ndarray, np.ndarray]:
    """v (seq, states, heads, dim), s (seq, states, heads) -> the merged (seq, heads, dim), (seq, heads)."""
    v, s = _f64(v), _f64(s)
    m = s.max(1, keepdims=True)
    with np.errstate(invalid="ignore"):
        w = np.where(s == -np.inf, 0.0, np.exp(s - np.where(m == -np.inf, 0.0, m)))
    tot = w.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        wv = np.where(w[..., None] != 0, w[..., None] * v, 0.0)  # an empty state contributes nothing
        out = np.where(tot[..., None] > 0, wv.sum(1) / np.where(tot > 0, tot, 1.0)[..., None], 0.0)
        lse = np.where(tot > 0, m[:, 0] + np.log(np.where(tot > 0, tot, 1.0)), -np.inf)
    return out, lse


def np_merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> tuple[np.ndarray, np.ndarray]:
    return np_merge_states(np.stack([_f64(v_a), _f64(v_b)], 1), np.stack([_f64(s_a), _f64(s_b)], 1))


def _cast(a: np.ndarray, kind: str) -> np.ndarray:
    return a.astype({"bf16": bfloat16(), "f16": np.float16}.get(kind, np.float32))


def _lse(rng: np.random.Generator, shape: tuple[int, ...], empty: float) -> np.ndarray:
    s = (3.0 * rng.standard_normal(shape)).astype(np.float32)
    s[rng.random(shape) < empty] = -np.inf  # empty segments
    return s


def _ops():
    from ... import ops

    return ops


def _state_cases(rng: np.random.Generator) -> Iterator[Case]:
    for kind, (seq, heads, dim), in_place in (("f32", (7, 3, 64), False), ("bf16", (5, 4, 64), False),
                                               ("f16", (3, 2, 33), False), ("f32", (4, 5, 33), True),
                                               ("bf16", (6, 2, 128), True)):
        va, vb = (_cast(rng.standard_normal((seq, heads, dim)), kind) for _ in range(2))
        sa, sb = _lse(rng, (seq, heads), 0.2), _lse(rng, (seq, heads), 0.2)
        sa[0, 0] = sb[0, 0] = -np.inf  # both empty: 0 and -inf
        mask = (rng.random(seq) < 0.6) if in_place else None

        def run(be, va=va, sa=sa, vb=vb, sb=sb, mask=mask):
            if mask is None:
                v, s = _ops().merge_state(va, sa, vb, sb, backend=be)
                return {"v": np.asarray(v), "s": np.asarray(s)}
            v, s = va.copy(), sa.copy()
            _ops().merge_state_in_place(v, s, vb, sb, mask, backend=be)
            return {"v": v, "s": s}

        def ref(va=va, sa=sa, vb=vb, sb=sb, mask=mask):
            v, s = np_merge_state(va, sa, vb, sb)
            if mask is not None:  # masked-off tokens keep their state
                v[~mask], s[~mask] = _f64(va)[~mask], _f64(sa)[~mask]
            return {"v": v, "s": s}

        yield Case(op="merge_state", dtype=kind, shape=f"{seq}x{heads}x{dim}", kernels=("merge_state" + kernel_suffix(kind),),
                   run=run, reference=ref, note="in_place-mask" if in_place else "")


def _states_cases(rng: np.random.Generator) -> Iterator[Case]:
    for kind, (seq, n, heads, dim) in (("f32", (3, 1, 2, 64)), ("f32", (4, 3, 3, 36)), ("bf16", (2, 40, 2, 64)),
                                       ("f16", (3, 5, 4, 128)), ("bf16", (2, 3, 1, 33))):
        v = _cast(rng.standard_normal((seq, n, heads, dim)), kind)
        s = _lse(rng, (seq, n, heads), 0.25)
        s[0, :, 0] = -np.inf  # every state of a row empty

        def run(be, v=v, s=s):
            o, lse = _ops().merge_states(v, s, backend=be)
            return {"v": np.asarray(o), "s": np.asarray(lse)}

        def ref(v=v, s=s):
            o, lse = np_merge_states(v, s)
            return {"v": o, "s": lse}

        yield Case(op="merge_states", dtype=kind, shape=f"{seq}x{n}x{heads}x{dim}",
                   kernels=("merge_states" + kernel_suffix(kind),), run=run, reference=ref)


cascade_cases = register_case_groups("cascade", _state_cases, _states_cases)
