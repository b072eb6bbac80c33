"""Difftest cases for the Hopper (sm_90a) attention kernels: kernels_cu/flash_attention_sm90.cu (dense and varlen
forward) and kernels_cu/attention_backward_sm90.cu (dK/dV and dQ), against the float64 NumPy references.

These kernels are built only for `sm_90a` (TMA tensor maps, mbarrier, wgmma). Each case declares
`arch="sm_90a"`: on the host backend its run plays that arch (PYKERN_HOST_ARCH=sm_90a, the emulation of
pykern/host/pk_host_sm90.cpp); the runner reports the numba backend (no wgmma / TMA) and the nvrtc backend
(TMA tensor maps need device arrays; the cases' inputs are NumPy) as not applicable rather than running them.

The launch goes through the op's own helpers in pykern/ops/_attention_sm90.py (`try_forward`, `try_varlen`,
`try_backward`: the tensor maps, boxes, grid and shared memory the ops use), with the window normalization of
pykern/ops/_window.py; a helper that declines (the kernel does not apply) is an error, never a fallback to
another kernel. The backward gets lse and delta = rowsum(dO * out) from float64 (as fp32), which is what the op's
pre-pass computes; the pre-pass kernels have their own cases (training.py).

The host emulation runs 384 fibers a CTA through every wgmma and mbarrier wait, so the shapes are small: one
CTA's worth of queries (or two where rows that see no key need a second tile), two or three key tiles (the
boundary tiles and a steady one), GQA 2, causal and not for every kernel.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from ..case import Case, register_cases
from .forward import fa_inputs, np_flash_attention

ARCH = "sm_90a"


@contextmanager
def _host_arch(backend: str) -> Iterator[None]:
    """On the host backend: PYKERN_HOST_ARCH=sm_90a for the call (the ops' helpers then take the sm_90a kernels,
    and launching one is allowed); elsewhere nothing changes (the helpers decline and the case says so)."""
    if backend != "host":
        yield
        return
    old = os.environ.get("PYKERN_HOST_ARCH")
    os.environ["PYKERN_HOST_ARCH"] = ARCH
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYKERN_HOST_ARCH", None)
        else:
            os.environ["PYKERN_HOST_ARCH"] = old


def _declined(kernel: str, backend: str) -> Exception:
    from ...errors import ArgumentError

    return ArgumentError(f"backend: expected one that runs {ARCH} kernels (host with PYKERN_HOST_ARCH={ARCH}, "
                         f"or nvrtc on a compute-capability 9.0 GPU with device arrays) for {kernel}, got "
                         f"{backend!r}: pykern.ops._attention_sm90 declined the launch")


def _sfx(kind: str) -> str:
    from ...arrays import kernel_suffix

    return kernel_suffix(kind)


def _case(op: str, kind: str, shape: str, kernels: tuple[str, ...], run: Callable[[str], dict[str, Any]],
          reference: Callable[[], dict[str, Any]]) -> Case:
    def on_arch(backend: str) -> dict[str, Any]:
        with _host_arch(backend):
            return run(backend)

    # "-sm90a" in the shape: the id says which kernels ran (the mma.sync cases have the same shapes' names)
    return Case(op=op, dtype=kind, shape=f"{shape}-sm90a", kernels=kernels, run=on_arch, reference=reference,
                arch=ARCH)


# --------------------------------------------------------------------------- forward (dense)
def _forward(rng: np.random.Generator, kind: str, n_q: int, n_k: int, h: int, kvh: int, d: int,
             causal: bool) -> Case:
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize

    q, k, v = fa_inputs(rng, 1, n_q, n_k, h, kvh, d, d, kind)
    name = f"flash_attention_sm90_d{d}{_sfx(kind)}"
    scale = 1.0 / np.sqrt(d)

    def run(backend: str) -> dict[str, Any]:
        out = np.empty(q.shape, q.dtype)
        lse = np.empty(q.shape[:3], np.float32)
        wl, wr = normalize(-1, -1, causal, n_q, n_k)
        if not sm90.try_forward(q, k, v, out, lse, (1, n_q, n_k, h, kvh, d, d), scale, 0.0, wl, wr, _sfx(kind),
                                None, backend):
            raise _declined(name, backend)
        return {"out": out, "lse": lse}

    def ref() -> dict[str, Any]:
        out, lse = np_flash_attention(q, k, v, causal, scale)
        return {"out": out, "lse": lse}

    shape = f"b1-q{n_q}-k{n_k}-h{h}/{kvh}-d{d}" + ("-causal" if causal else "")
    return _case("flash_attention", kind, shape, (name,), run, ref)


# --------------------------------------------------------------------------- forward (varlen)
def _varlen(rng: np.random.Generator, kind: str, lq: list[int], lk: list[int], h: int, kvh: int, d: int,
            causal: bool) -> Case:
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize_serving

    q, k, v = (a[0] for a in fa_inputs(rng, 1, sum(lq), sum(lk), h, kvh, d, d, kind))
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    name = f"flash_attention_varlen_sm90_d{d}{_sfx(kind)}"
    scale = 1.0 / np.sqrt(d)

    def run(backend: str) -> dict[str, Any]:
        out = np.empty(q.shape, q.dtype)
        lse = np.empty(q.shape[:2], np.float32)
        wl, wr = normalize_serving(-1, -1, causal)
        if not sm90.try_varlen(q, k, v, out, lse, cu_q, cu_k, (len(lq), max(lq), h, kvh, d), scale, 0.0, wl, wr,
                               _sfx(kind), None, backend):
            raise _declined(name, backend)
        return {"out": out, "lse": lse}

    def ref() -> dict[str, Any]:
        # per sequence; one with no keys gives out 0 and lse -inf (np_flash_attention's empty rows)
        out = np.zeros(q.shape)
        lse = np.full(q.shape[:2], -np.inf)
        for b in range(len(lq)):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            o, l_ = np_flash_attention(q[None, qs], k[None, ks], v[None, ks], causal, scale)
            out[qs], lse[qs] = o[0], l_[0]
        return {"out": out, "lse": lse}

    shape = f"Q{lq}-K{lk}-h{h}/{kvh}-d{d}" + ("-causal" if causal else "")
    return _case("flash_attention_varlen", kind, shape.replace(" ", ""), (name,), run, ref)


# --------------------------------------------------------------------------- backward
def _backward(rng: np.random.Generator, kind: str, n_q: int, n_k: int, h: int, kvh: int, d: int,
              causal: bool) -> Case:
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize
    from .training import attention_inputs, np_attention_backward

    q, k, v, g = attention_inputs(rng, 1, n_q, h, kvh, d, kind, n_k)
    names = (f"attention_backward_sm90_dkdv_d{d}{_sfx(kind)}", f"attention_backward_sm90_dq_d{d}{_sfx(kind)}")
    scale = 1.0 / np.sqrt(d)
    # lse and delta in float64, stored as the fp32 the kernels read (per (batch, query, head)): what the op's
    # pre-pass gives them, without its fp32 rounding of the sums
    out64, lse64 = np_flash_attention(q, k, v, causal, scale)
    lse = lse64.astype(np.float32).reshape(-1)
    delta = (out64 * g.astype(np.float64)).sum(axis=-1).astype(np.float32).reshape(-1)

    def run(backend: str) -> dict[str, Any]:
        win = (*normalize(-1, -1, causal, n_q, n_k), 0.0)
        grads = sm90.try_backward(q, k, v, g, lse, delta, (1, n_q, n_k, h, kvh, d), scale, win, kind, _sfx(kind),
                                  None, backend)
        if grads is None:
            raise _declined(",".join(names), backend)
        return dict(zip(("dq", "dk", "dv"), grads))

    def ref() -> dict[str, Any]:
        dq, dk, dv = np_attention_backward(q, k, v, g, causal=causal, scale=scale)
        return {"dq": dq, "dk": dk, "dv": dv}

    shape = f"b1-q{n_q}-k{n_k}-h{h}/{kvh}-d{d}" + ("-causal" if causal else "")
    return _case("attention_backward", kind, shape, names, run, ref)


# Shapes per head_dim (queries, keys) for the non-causal and the causal case. Key tiles: 192 keys at d64, 128 at
# d128, 64 at d256 (the forward), 128 (the backward's dK/dV CTA); queries: 128 a CTA.
FORWARD = {64: ((100, 250), (150, 100)), 128: ((100, 200), (150, 100)), 256: ((70, 150), (150, 100))}
VARLEN = {64: (([5, 90, 0], [9, 250, 3]), ([90, 1, 20], [60, 200, 0])),
          128: (([5, 90, 0], [9, 200, 3]), ([90, 1, 20], [60, 140, 0])),
          256: (([5, 70, 0], [9, 150, 3]), ([70, 1, 20], [60, 100, 0]))}
BACKWARD = {64: ((70, 150), (150, 60)), 128: ((70, 150), (150, 60))}


@register_cases("sm90")
def cases(rng: np.random.Generator) -> Iterator[Case]:
    for kind in ("bf16", "f16"):
        for d, shapes in FORWARD.items():
            for causal, (n_q, n_k) in zip((False, True), shapes):
                yield _forward(rng, kind, n_q, n_k, 2, 1, d, causal)
        for d, shapes in VARLEN.items():
            for causal, (lq, lk) in zip((False, True), shapes):
                yield _varlen(rng, kind, lq, lk, 2, 1, d, causal)
        for d, shapes in BACKWARD.items():
            for causal, (n_q, n_k) in zip((False, True), shapes):
                yield _backward(rng, kind, n_q, n_k, 2, 1, d, causal)
