"""Difftest cases for the Hopper (sm_90a) grouped GEMM, kernels_cu/grouped_gemm_sm90.cu (grouped_gemm_sm90,
moe_gemm_act_sm90, grouped_gemm_nn_sm90 and grouped_gemm_wgrad_sm90, bf16 and f16, and the fp32-result
grouped_gemm_sm90_f32out / grouped_gemm_nn_sm90_f32out, held to the f32 row), against the float64 NumPy references.

Like the sm_90a attention cases (sm90.py), each declares `arch="sm_90a"`: on the host backend its run plays that
arch (PYKERN_HOST_ARCH=sm_90a); numba and nvrtc (the cases' inputs are NumPy, and a tensor map needs device arrays)
report it as not applicable. The launch goes through the op's own helper, pykern/ops/_moe_sm90.py `try_launch`
(the tensor maps, persistent grid and shared memory the ops use); a helper that declines is an error, never a
fallback to another kernel (`try_launch_wgrad` for the weight gradient). Shapes: empty groups, a one-row group,
groups under and over a tile, N and K off the tiles, more tiles than the host's persistent CTAs; for the weight
gradient, groups under, at and over a k-block of 64 rows (its last k-block reaches into the next group's rows).
The split-precision products (grouped_gemm_sm90_split_f32out, grouped_gemm_wgrad_sm90_split_a / _ab) take fp32
operands as hi / lo planes (moe.cu's moe_split16 convention) and are held against the float64 product of the
planes' sum: the fp32 result to the f32 row, the weight gradients to their dtype's.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from ..case import Case, register_cases
from .moe import np_act, np_grouped_gemm
from ._sm90 import ARCH, declined as _declined, host_arch as _host_arch, sfx as _sfx
from .training import _cast, f64

_SHAPES = (  # (group sizes, N, K); act: N = 2I
    ([130, 0, 1, 70], 136, 72),
    ([0, 257, 5], 300, 136),
)
_ACTS = ("silu", "gelu_tanh")
_NN_SHAPES = (  # (group sizes, N, K): b [E, K, N]
    ([130, 0, 1, 70], 136, 72),
    ([0, 257, 5], 264, 136),
)
_WGRAD_SHAPES = (  # (group sizes, N1, N2): out [E, N1, N2]
    ([130, 0, 1, 64], 136, 72),
    ([0, 5, 200], 64, 264),
)


def np_moe_gemm_act(a: Any, b: Any, offsets: Any, activation: str) -> np.ndarray:
    """h = act(a @ gate^T) * (a @ up^T) per group, b [E, 2I, K] (gate rows first)."""
    gu = np_grouped_gemm(a, b, offsets)
    inter = f64(b).shape[1] // 2
    return np_act(gu[:, :inter], activation) * gu[:, inter:]


def _case(kind: str, sizes: list[int], n: int, k: int, act: str | None, rng: np.random.Generator,
          f32out: bool = False) -> Case:
    from ...ops import _moe_sm90 as sm90
    from ...ops.moe import ACTIVATIONS

    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    m, e = int(off[-1]), len(sizes)
    a = _cast(rng.standard_normal((m, k)), kind)
    b = _cast(rng.standard_normal((e, n, k)) / math.sqrt(k), kind)
    name = ("moe_gemm_act_sm90" if act else "grouped_gemm_sm90") + ("_f32out" if f32out else "") + _sfx(kind)
    cols = n // 2 if act else n

    def run(backend: str) -> dict[str, Any]:
        with _host_arch(backend):
            out = np.zeros((m, cols), np.float32 if f32out else a.dtype)
            if not sm90.try_launch(a, b, off, out, m, n, k, e, kind, ACTIVATIONS[act] if act else None, None,
                                   backend, f32out=f32out):
                raise _declined(name, backend)
        return {"out": out}

    def ref() -> dict[str, Any]:
        return {"out": np_moe_gemm_act(a, b, off, act) if act else np_grouped_gemm(a, b, off)}

    shape = (f"{'-'.join(map(str, sizes))}x{n}x{k}" + (f"-{act}" if act else "")
             + (f"-f32out-from-{kind}" if f32out else ""))
    # f32out: the fp32 accumulators are held to the f32 row (exact 16-bit operands, nothing rounded after them)
    return Case(op="grouped_gemm", dtype="f32" if f32out else kind, shape=shape + "-sm90a", kernels=(name,), run=run,
                reference=ref, arch=ARCH)


def _nn_case(kind: str, sizes: list[int], n: int, k: int, rng: np.random.Generator, f32out: bool = False) -> Case:
    from ...ops import _moe_sm90 as sm90

    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    m, e = int(off[-1]), len(sizes)
    a = _cast(rng.standard_normal((m, k)), kind)
    b = _cast(rng.standard_normal((e, k, n)) / math.sqrt(k), kind)
    name = "grouped_gemm_nn_sm90" + ("_f32out" if f32out else "") + _sfx(kind)

    def run(backend: str) -> dict[str, Any]:
        with _host_arch(backend):
            out = np.zeros((m, n), np.float32 if f32out else a.dtype)
            if not sm90.try_launch(a, b, off, out, m, n, k, e, kind, None, None, backend, nn=True, f32out=f32out):
                raise _declined(name, backend)
        return {"out": out}

    def ref() -> dict[str, Any]:  # a @ b[e] is the "nt" product against b transposed
        return {"out": np_grouped_gemm(a, np.swapaxes(b, 1, 2), off)}

    shape = f"{'-'.join(map(str, sizes))}x{n}x{k}-nn" + (f"-f32out-from-{kind}" if f32out else "") + "-sm90a"
    # f32out: the fp32 accumulators are held to the f32 row (exact 16-bit operands, nothing rounded after them)
    return Case(op="grouped_gemm", dtype="f32" if f32out else kind, shape=shape, kernels=(name,), run=run,
                reference=ref, arch=ARCH)


def _wgrad_case(kind: str, sizes: list[int], n1: int, n2: int, rng: np.random.Generator) -> Case:
    from ...ops import _moe_sm90 as sm90

    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    m, e = int(off[-1]), len(sizes)
    a = _cast(rng.standard_normal((m, n1)), kind)
    b = _cast(rng.standard_normal((m, n2)), kind)
    name = "grouped_gemm_wgrad_sm90" + _sfx(kind)

    def run(backend: str) -> dict[str, Any]:
        with _host_arch(backend):
            out = np.full((e, n1, n2), 7.0).astype(a.dtype)  # every element is written (an empty group: zeros)
            if not sm90.try_launch_wgrad(a, b, off, out, m, n1, n2, e, kind, None, backend):
                raise _declined(name, backend)
        return {"out": out}

    def ref() -> dict[str, Any]:
        af, bf = f64(a), f64(b)
        return {"out": np.stack([af[off[i]:off[i + 1]].T @ bf[off[i]:off[i + 1]] for i in range(e)])}

    shape = f"{'-'.join(map(str, sizes))}x{n1}x{n2}-wgrad-sm90a"
    return Case(op="grouped_gemm", dtype=kind, shape=shape, kernels=(name,), run=run, reference=ref, arch=ARCH)


def _planes(v: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """v (fp32 values) as moe_split16's planes, flat [2, v.size] of `kind`, and the value they carry (float64)."""
    scale = 2048.0 if kind == "f16" else 1.0
    v = v.astype(np.float32)
    hi = _cast(v, kind)
    lo = _cast((v - f64(hi).astype(np.float32)) * np.float32(scale), kind)
    return np.concatenate([hi.reshape(-1), lo.reshape(-1)]), f64(hi) + f64(lo) / scale


def _split_case(kind: str, sizes: list[int], n: int, k: int, rng: np.random.Generator) -> Case:
    from ...ops import _moe_sm90 as sm90

    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    m, e = int(off[-1]), len(sizes)
    a2, av = _planes(rng.standard_normal((m, k)), kind)
    b = _cast(rng.standard_normal((e, n, k)) / math.sqrt(k), kind)
    name = "grouped_gemm_sm90_split_f32out" + _sfx(kind)

    def run(backend: str) -> dict[str, Any]:
        with _host_arch(backend):
            out = np.zeros((m, n), np.float32)
            if not sm90.try_launch(a2, b, off, out, m, n, k, e, kind, None, None, backend, f32out=True, split=True):
                raise _declined(name, backend)
        return {"out": out}

    def ref() -> dict[str, Any]:
        return {"out": np_grouped_gemm(av, b, off)}

    shape = f"{'-'.join(map(str, sizes))}x{n}x{k}-split-f32out-from-{kind}-sm90a"
    return Case(op="grouped_gemm", dtype="f32", shape=shape, kernels=(name,), run=run, reference=ref, arch=ARCH)


def _split_wgrad_case(kind: str, sizes: list[int], n1: int, n2: int, split_b: bool, rng: np.random.Generator) -> Case:
    from ...ops import _moe_sm90 as sm90

    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    m, e = int(off[-1]), len(sizes)
    a2, av = _planes(rng.standard_normal((m, n1)), kind)
    if split_b:
        b, bv = _planes(rng.standard_normal((m, n2)), kind)
    else:
        b = _cast(rng.standard_normal((m, n2)), kind)
        bv = f64(b)
    name = "grouped_gemm_wgrad_sm90_split_" + ("ab" if split_b else "a") + _sfx(kind)

    def run(backend: str) -> dict[str, Any]:
        with _host_arch(backend):
            out = np.full((e, n1, n2), 7.0).astype(b.dtype)  # every element is written (an empty group: zeros)
            if not sm90.try_launch_wgrad(a2, b, off, out, m, n1, n2, e, kind, None, backend, split=2 if split_b else 1):
                raise _declined(name, backend)
        return {"out": out}

    def ref() -> dict[str, Any]:
        return {"out": np.stack([av[off[i]:off[i + 1]].T @ bv[off[i]:off[i + 1]] for i in range(e)])}

    shape = f"{'-'.join(map(str, sizes))}x{n1}x{n2}-wgrad-split-{'ab' if split_b else 'a'}-sm90a"
    return Case(op="grouped_gemm", dtype=kind, shape=shape, kernels=(name,), run=run, reference=ref, arch=ARCH)


@register_cases("moe_sm90")
def cases(rng: np.random.Generator) -> Iterator[Case]:
    for kind in ("bf16", "f16"):
        for sizes, n, k in _SHAPES:
            yield _case(kind, sizes, n, k, None, rng)
        for (sizes, n, k), act in zip(_SHAPES, _ACTS):
            yield _case(kind, sizes, n, k, act, rng)
        for sizes, n, k in _NN_SHAPES:
            yield _nn_case(kind, sizes, n, k, rng)
        # the fp32-result variants (the backward's exact-operand products): N = 300 and 136 take element stores
        # and 16-byte ones
        for sizes, n, k in _SHAPES:
            yield _case(kind, sizes, n, k, None, rng, f32out=True)
        for sizes, n, k in _NN_SHAPES:
            yield _nn_case(kind, sizes, n, k, rng, f32out=True)
        for sizes, n1, n2 in _WGRAD_SHAPES:
            yield _wgrad_case(kind, sizes, n1, n2, rng)
        # the split-precision backward products (hi / lo planes)
        for sizes, n, k in _SHAPES:
            yield _split_case(kind, sizes, n, k, rng)
        for split_b in (False, True):
            for sizes, n1, n2 in _WGRAD_SHAPES:
                yield _split_wgrad_case(kind, sizes, n1, n2, split_b, rng)
