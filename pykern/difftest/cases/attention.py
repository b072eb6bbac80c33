"""Difftest cases of the attention family: flash_attention (fp32-FMA and mma.sync kernels, kernels_cu/
attention_fwd_fma.cu and attention_fwd_tc.cu), attention_backward (attention_bwd_*.cu) and the Hopper (sm_90a)
kernels, against float64 NumPy references (the references here are also the tests' oracles).

Sm_90a section: forward) and kernels_cu/attention_bwd_sm90.cu (dK/dV and dQ), against the float64 NumPy references.

These kernels are built only for `sm_90a` (TMA tensor maps, mbarrier, wgmma). Each case declares
`arch="sm_90a"`: on the host backend its run plays that arch (PYKERN_HOST_ARCH=sm_90a, the emulation of
pykern/host/pk_host_sm90.cpp); the runner reports the numba backend (no wgmma / TMA) and the nvrtc backend
(TMA tensor maps need device arrays; the cases' inputs are NumPy) as not applicable rather than running them.

The FP8 forward (kernels_cu/attention_fwd_fp8_sm90.cu: e4m3 q, k, v with per-tensor or per-(batch, kv head)
descales, bf16 out) has cases of dtype "fp8" at head_dim 64 / 128 / 256, causal and not, against float64 attention
on the dequantized inputs, and with softcap (the _softcap kernels, one case with a window).

The launch goes through the op's own helpers in pykern/ops/_attention_sm90.py (`try_forward`, `try_varlen`,
`try_backward`, `try_forward_fp8`: the tensor maps, boxes, grid and shared memory the ops use), with the window normalization of
pykern/ops/_window.py; a helper that declines (the kernel does not apply) is an error, never a fallback to
another kernel. The backward gets lse and delta = rowsum(dO * out) from float64 (as fp32), which is what the op's
pre-pass computes; the pre-pass kernels have their own cases (training.py).

The host emulation runs 384 fibers a CTA through every wgmma and mbarrier wait, so the shapes are small: one
CTA's worth of queries (or two where rows that see no key need a second tile), two or three key tiles (the
boundary tiles and a steady one), GQA 2, causal and not for every kernel.
"""
from __future__ import annotations

import functools
import math
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import numpy as np

from ..case import Case, register_case_groups
from .training import _cast, _np, _ops, f64  # the cases' shared input helpers, as moe.py and gemm_fp8.py

_f64 = f64


R = TypeVar("R")


def _once(fn: Callable[[], R]) -> Callable[[], R]:
    """fn, computed on its first call and kept. A case's float64 statistics (the lse / delta its kernels read)
    are computed when the case first runs, not when it is built: every process that collects the cases (each
    pytest worker, each `python -m pykern.difftest` call, which then runs a few of them) builds all of them."""
    return functools.lru_cache(maxsize=None)(fn)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], kind: str, scale: float = 1.0) -> np.ndarray:
    return _cast(rng.standard_normal(shape) * scale, kind)


def _sfx(kind: str) -> str:
    from ...arrays import kernel_suffix

    return kernel_suffix(kind)


# --------------------------------------------------------------------------- NumPy float64 references


def _attn_split(q: Any, k: Any, v: Any):
    q, k, v = f64(q), f64(k), f64(v)
    batched = q.ndim == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    return q, k, v, batched


def window_mask(n_q: int, n_k: int, causal: bool, window_size: tuple[int, int] = (-1, -1)) -> np.ndarray:
    """(n_q, n_k) visibility with flash-attn's semantics, aligned bottom-right: query i sees keys
    i' - left <= j <= i' + right, i' = i + n_k - n_q; -1 = unbounded; causal sets right to 0."""
    left, right = window_size
    if causal:
        right = 0
    rel = np.arange(n_k)[None, :] - (np.arange(n_q)[:, None] + (n_k - n_q))  # j - i'
    vis = np.ones((n_q, n_k), bool)
    if left >= 0:
        vis &= rel >= -left
    if right >= 0:
        vis &= rel <= right
    return vis


def _attn_mask(n_q: int, n_k: int, causal: bool, window_size: tuple[int, int] = (-1, -1)) -> np.ndarray:
    return window_mask(n_q, n_k, causal, window_size)


def softcap_scores(x: np.ndarray, softcap: float) -> np.ndarray:
    """Gemma 2 / flash-attn logit softcapping of scaled scores x: c * tanh(x / c) (c = 0: x)."""
    return softcap * np.tanh(x / softcap) if softcap > 0 else x


def _attn_probs(qq: np.ndarray, kk: np.ndarray, mask: np.ndarray, scale: float,
                softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(P, lse) of one (batch, head); rows with no visible key give P = 0 and lse = -inf."""
    sc = np.where(mask, softcap_scores(qq @ kk.T * scale, softcap), -np.inf)
    m = sc.max(axis=-1, keepdims=True) if sc.shape[-1] else np.full((sc.shape[0], 1), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(sc - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, l, out=np.zeros_like(e), where=l > 0)
    with np.errstate(divide="ignore"):
        lse = (m_safe + np.log(l))[:, 0]
    return p, lse


def np_attention_forward(q: Any, k: Any, v: Any, *, causal: bool = True, scale: float | None = None,
                         window_size: tuple[int, int] = (-1, -1),
                         softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(out like q with v's head_dim_v, lse (..., n_q, n_heads)) of softmax attention; scale defaults to
    1/sqrt(head_dim).

    causal aligns the mask bottom-right (flash_attention's convention); a query that sees no key
    has out 0 and lse -inf. window_size / softcap: flash-attn's sliding window and logit softcap."""
    q, k, v, batched = _attn_split(q, k, v)
    b, n_q, h, d = q.shape
    n_k = k.shape[1]
    rep = h // k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    mask = _attn_mask(n_q, n_k, causal, window_size)
    out = np.zeros(q.shape[:3] + v.shape[3:])
    lse = np.zeros((b, n_q, h))
    for bi in range(b):
        for hi in range(h):
            p, lse[bi, :, hi] = _attn_probs(q[bi, :, hi], k[bi, :, hi // rep], mask, scale, softcap)
            out[bi, :, hi] = p @ v[bi, :, hi // rep]
    return (out, lse) if batched else (out[0], lse[0])


def np_attention_backward(q: Any, k: Any, v: Any, grad_out: Any, *, causal: bool = True,
                          scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                          softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv) in float64 of np_attention_forward's out, given grad_out (through the softcap's
    tanh: dS is multiplied by 1 - tanh^2)."""
    q, k, v, batched = _attn_split(q, k, v)
    g = f64(grad_out) if batched else f64(grad_out)[None]
    b, n_q, h, d = q.shape
    n_k = k.shape[1]
    rep = h // k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    mask = _attn_mask(n_q, n_k, causal, window_size)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for bi in range(b):
        for hi in range(h):
            kh = hi // rep
            qq, kk, vv, go = q[bi, :, hi], k[bi, :, kh], v[bi, :, kh], g[bi, :, hi]
            p, _ = _attn_probs(qq, kk, mask, scale, softcap)
            dp = go @ vv.T
            ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
            if softcap > 0:
                ds = ds * (1.0 - np.tanh(qq @ kk.T * scale / softcap) ** 2)
            dv[bi, :, kh] += p.T @ go
            dq[bi, :, hi] = ds @ kk * scale
            dk[bi, :, kh] += ds.T @ qq * scale
    if not batched:
        return dq[0], dk[0], dv[0]
    return dq, dk, dv


def np_flash_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False,
                       scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                       softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(out (B, n_q, H, Dv), lse (B, n_q, H)); rows that see no key give 0 and -inf.
    window_size / softcap: flash-attn's sliding window (bottom-right) and logit softcap."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    batch, n_q, n_heads, head_dim = q.shape
    n_k, n_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    group = n_heads // n_kv
    k = np.repeat(k, group, axis=2)  # (B, n_k, H, D)
    v = np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    s = np.where(window_mask(n_q, n_k, causal, window_size)[None, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if n_k else np.full(s.shape[:-1] + (1,), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    den = p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", np.divide(p, den, out=np.zeros_like(p), where=den > 0), v)
    with np.errstate(divide="ignore"):
        lse = (np.log(den) + m_safe)[..., 0]  # (B, H, n_q); log(0) = -inf for empty rows
    return out, lse.transpose(0, 2, 1).copy()


# --------------------------------------------------------------------------- forward cases


def fa_kernel(head_dim: int, head_dim_v: int, kind: str, tensor_cores: bool | None = None,
              softcap: float = 0.0) -> str:
    """The kernel ops.flash_attention launches (bf16 and f16 default to the tensor-core kernels on every
    backend difftest runs: host, numba, nvrtc on sm_80+; softcap > 0 picks the _softcap kernels)."""
    cap = "_softcap" if softcap > 0 else ""
    if kind != "f32" and tensor_cores is not False:
        from ...ops.attention import tc_head_dim

        d = tc_head_dim(max(head_dim, head_dim_v))
        pad = "pad_" if d in (64, 128) and (head_dim != d or head_dim_v != d) else ""  # not the FA2 core's shape
        return f"attention_fwd_tc_{pad}d{d}{cap}{_sfx(kind)}"
    bucket = next(b for b in (64, 128, 256) if max(head_dim, head_dim_v) <= b)
    return f"attention_fwd_fma_d{bucket}{cap}{_sfx(kind)}"


def fa_inputs(rng: np.random.Generator, batch: int, n_q: int, n_k: int, n_heads: int, n_kv: int, d: int, dv: int,
              kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (_normal(rng, (batch, n_q, n_heads, d), kind), _normal(rng, (batch, n_k, n_kv, d), kind),
            _normal(rng, (batch, n_k, n_kv, dv), kind))


def _fa_case(rng: np.random.Generator, kind: str, batch: int, n_q: int, n_k: int, n_heads: int, n_kv: int, d: int,
             dv: int, causal: bool, note: str = "", tensor_cores: bool | None = None, scale: float | None = None,
             window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> Case:
    from ... import ops

    q, k, v = fa_inputs(rng, batch, n_q, n_k, n_heads, n_kv, d, dv, kind)
    win = {} if window_size == (-1, -1) and not softcap else {"window_size": window_size, "softcap": softcap}

    def run(b: str) -> dict:
        out, lse = ops.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend=b, **win,
                                       **({} if tensor_cores is None else {"tensor_cores": tensor_cores}))
        return {"out": out, "lse": lse}

    def ref() -> dict:
        out, lse = np_flash_attention(q, k, v, causal, scale, window_size, softcap)
        return {"out": out, "lse": lse}

    shape = f"b{batch}-q{n_q}-k{n_k}-h{n_heads}/{n_kv}-d{d}" + (f"v{dv}" if dv != d else "") + ("-causal" if causal else "")
    shape += "" if scale is None else f"-s{scale:g}"
    shape += "" if tensor_cores is None else ("-tc" if tensor_cores else "-fma")
    shape += "" if window_size == (-1, -1) else f"-w{window_size[0]},{window_size[1]}"
    shape += f"-cap{softcap:g}" if softcap else ""
    return Case(op="flash_attention", dtype=kind, shape=shape,
                kernels=(fa_kernel(d, dv, kind, tensor_cores, softcap),),
                run=run, reference=ref, note=note)


def _fa_cases(rng: np.random.Generator) -> Iterator[Case]:
    for causal in (False, True):
        # lengths at head_dim 64, GQA 2; n_q > n_k gives causal rows with no key
        for n_q, n_k in ((1, 1), (17, 17), (64, 64), (65, 65), (1, 65), (17, 64), (65, 17), (64, 1), (1, 300),
                         (300, 300), (65, 300), (300, 17)):
            big = "big" if max(n_q, n_k) >= 300 and n_q * n_k > 300 else ""
            yield _fa_case(rng, "f32", 1, n_q, n_k, 2, 1, 64, 64, causal, big)
        # head_dim sweep (one length pair that crosses a key tile and a query tile)
        for d in (32, 64, 80, 96, 128, 256):
            yield _fa_case(rng, "f32", 1, 17, 40, 2, 2, d, d, causal)
        # GQA ratios 1/2/4/8 and n_kv_heads = 1
        for n_kv in (8, 4, 2, 1):
            yield _fa_case(rng, "f32", 2, 17, 17, 8, n_kv, 32, 32, causal)
        yield _fa_case(rng, "f32", 1, 17, 40, 4, 2, 96, 64, causal)   # head_dim_v != head_dim
        yield _fa_case(rng, "f32", 1, 17, 33, 2, 1, 48, 130, causal)  # dv picks the bucket
        yield _fa_case(rng, "f32", 1, 300, 300, 2, 1, 256, 256, causal, "big")
        # bf16 on the fp32-FMA kernels (what sm_75 runs)
        for d, n_k in ((64, 65), (128, 40), (256, 20)):
            yield _fa_case(rng, "bf16", 2, 9, n_k, 2, 1, d, d, causal, tensor_cores=False)
        yield _fa_case(rng, "bf16", 1, 65, 300, 2, 2, 128, 128, causal, "big", tensor_cores=False)
        # bf16 on tensor cores: every compiled head_dim and padded ones (32 -> 64, 80 -> 96, 33: element-wise
        # loads), lengths off every tile (BR = 64, BC = 64/32), length 1, n_q != n_k both ways, GQA 1/4/8
        for d, n_q, n_k in ((64, 65, 70), (96, 17, 40), (128, 9, 65), (256, 65, 33), (32, 1, 1), (80, 70, 33),
                            (33, 9, 20), (100, 9, 20)):  # 100: padded to the general attention_fwd_tc_pad_d128
            yield _fa_case(rng, "bf16", 1, n_q, n_k, 2, 1, d, d, causal)
        for n_kv in (8, 2, 1):
            yield _fa_case(rng, "bf16", 1, 17, 17, 8, n_kv, 64, 64, causal)
        yield _fa_case(rng, "bf16", 2, 1, 130, 4, 1, 128, 128, causal)
        yield _fa_case(rng, "bf16", 1, 130, 1, 2, 2, 64, 64, causal)
        yield _fa_case(rng, "bf16", 1, 17, 40, 4, 2, 96, 64, causal, scale=0.3)  # head_dim_v != head_dim
        yield _fa_case(rng, "bf16", 1, 300, 260, 2, 1, 128, 128, causal, "big")


def _fa_window_cases(rng: np.random.Generator) -> Iterator[Case]:
    # Sliding windows (left only, right only, both, 0, wider than the sequence) and softcap, with and
    # without causal, n_q != n_k both ways; lengths cross several key tiles so some are skipped.
    for kind, tc in (("f32", None), ("bf16", None), ("bf16", False)):
        for n_q, n_k, causal, win, cap, d in ((150, 150, True, (20, -1), 0.0, 64), (70, 200, False, (-1, 9), 0.0, 128),
                                              (200, 70, False, (30, 30), 0.0, 64), (90, 90, True, (0, -1), 0.0, 80),
                                              (40, 40, False, (500, 500), 0.0, 64), (64, 64, False, (-1, -1), 5.0, 128),
                                              (130, 180, True, (40, -1), 2.0, 64)):
            yield _fa_case(rng, kind, 1, n_q, n_k, 4, 1 if d == 64 else 4, d, d, causal, tensor_cores=tc,
                           window_size=win, softcap=cap)
    # every softcap kernel: each head-dim bucket of each path
    for kind, tc, dims in (("bf16", None, (32, 96, 100, 256)), ("f32", None, (256,)), ("bf16", False, (128, 256))):
        for d in dims:
            yield _fa_case(rng, kind, 1, 20, 37, 2, 1, d, d, True, tensor_cores=tc, window_size=(9, -1), softcap=3.0)


def _fa_f16_cases(rng: np.random.Generator) -> Iterator[Case]:
    """float16 flash_attention: the fp32-FMA kernels at every bucket, the tensor-core kernels at every compiled
    head_dim and padded ones (element-wise loads at 33), GQA, n_q != n_k both ways, windows and softcap."""
    for causal in (False, True):
        for d, n_k in ((64, 65), (128, 40), (256, 20)):
            yield _fa_case(rng, "f16", 2, 9, n_k, 2, 1, d, d, causal, tensor_cores=False)
        for d, n_q, n_k in ((64, 65, 70), (96, 17, 40), (128, 9, 65), (256, 65, 33), (32, 1, 1), (33, 9, 20),
                            (100, 9, 20)):
            yield _fa_case(rng, "f16", 1, n_q, n_k, 2, 1, d, d, causal)
        yield _fa_case(rng, "f16", 1, 17, 17, 8, 2, 64, 64, causal)
        yield _fa_case(rng, "f16", 1, 130, 1, 2, 2, 64, 64, causal)
        yield _fa_case(rng, "f16", 1, 17, 40, 4, 2, 96, 64, causal, scale=0.3)  # head_dim_v != head_dim
    for tc in (None, False):
        for n_q, n_k, causal, win, cap, d in ((150, 150, True, (20, -1), 0.0, 64), (70, 200, False, (-1, 9), 0.0, 128),
                                              (130, 180, True, (40, -1), 2.0, 64)):
            yield _fa_case(rng, "f16", 1, n_q, n_k, 4, 1 if d == 64 else 4, d, d, causal, tensor_cores=tc,
                           window_size=win, softcap=cap)
    for tc, dims in ((None, (32, 96, 100, 128, 256)), (False, (128, 256))):
        for d in dims:
            yield _fa_case(rng, "f16", 1, 20, 37, 2, 1, d, d, True, tensor_cores=tc, window_size=(9, -1), softcap=3.0)


# --------------------------------------------------------------------------- backward cases


def attention_inputs(rng: np.random.Generator, batch: int | None, seq: int, heads: int, kv_heads: int,
                     head_dim: int, kind: str, n_k: int | None = None) -> tuple[np.ndarray, ...]:
    """q, k, v, grad_out; n_k (default seq) is the key length, seq the query length."""
    lead = () if batch is None else (batch,)
    n_k = seq if n_k is None else n_k
    q = _cast(rng.standard_normal(lead + (seq, heads, head_dim)), kind)
    k = _cast(rng.standard_normal(lead + (n_k, kv_heads, head_dim)), kind)
    v = _cast(rng.standard_normal(lead + (n_k, kv_heads, head_dim)), kind)
    g = _cast(rng.standard_normal(lead + (seq, heads, head_dim)), kind)
    return q, k, v, g


def _flash_kernels(sfx: str, given: bool, softcap: float = 0.0) -> tuple[str, ...]:
    cap = "_softcap" if softcap > 0 else ""
    pre = "attention_bwd_preprocess" + sfx if given else "attention_bwd_lse" + cap + sfx
    return (pre, "attention_bwd_fma_dkdv" + cap + sfx, "attention_bwd_fma_dq" + cap + sfx)


def _attention_cases(rng: np.random.Generator, only: Any = None) -> Iterator[Case]:
    # (kind, batch, n_q, n_k, heads, kv_heads, head_dim, causal, scale, methods, note)
    specs = only or [
        ("f32", None, 1, 1, 2, 1, 32, True, None, ("naive", "flash"), ""),
        ("f32", None, 63, 63, 1, 1, 32, True, None, ("naive", "flash"), ""),
        ("f32", None, 64, 64, 1, 1, 64, True, None, ("naive", "flash"), ""),
        ("f32", None, 65, 65, 2, 1, 32, True, None, ("naive", "flash"), ""),
        ("f32", 2, 17, 17, 2, 2, 32, True, None, ("naive", "flash"), ""),
        ("f32", None, 9, 9, 4, 2, 80, True, None, ("naive", "flash"), ""),
        ("f32", None, 9, 9, 8, 2, 32, True, None, ("naive", "flash"), ""),
        ("f32", None, 9, 9, 8, 1, 16, True, None, ("naive", "flash"), ""),
        ("f32", None, 5, 5, 3, 3, 96, True, None, ("naive", "flash"), ""),
        ("f32", None, 12, 12, 2, 1, 128, True, None, ("naive", "flash"), ""),
        ("f32", None, 6, 6, 1, 1, 256, True, None, ("naive", "flash"), ""),
        ("f32", None, 200, 200, 1, 1, 32, True, None, ("naive", "flash"), "big"),
        ("f32", None, 70, 70, 4, 1, 128, True, None, ("naive", "flash"), "big"),
        ("f32", None, 2049, 2049, 1, 1, 32, True, None, ("flash",), "big"),
        ("bf16", None, 33, 33, 2, 1, 64, True, None, ("naive", "flash"), ""),
        ("bf16", 2, 9, 9, 4, 2, 80, True, None, ("naive", "flash"), ""),
        # the general attention forms: causal=False, n_q != n_k (bottom-right causal mask), non-default scale
        ("f32", None, 1, 1, 2, 1, 32, False, None, ("naive", "flash"), ""),
        ("f32", None, 1, 9, 2, 2, 64, True, None, ("naive", "flash"), ""),
        ("f32", None, 5, 17, 2, 1, 64, True, None, ("naive", "flash"), ""),
        ("f32", None, 17, 5, 4, 2, 32, True, None, ("naive", "flash"), ""),
        ("f32", None, 3, 1, 2, 2, 32, True, 0.7, ("naive", "flash"), ""),
        ("f32", 2, 9, 23, 4, 1, 80, False, 0.3, ("naive", "flash"), ""),
        ("f32", None, 23, 9, 4, 4, 128, False, None, ("naive", "flash"), ""),
        ("f32", None, 70, 33, 2, 1, 32, True, 0.2, ("naive", "flash"), ""),
        ("f32", None, 12, 70, 4, 1, 32, True, None, ("naive", "flash"), ""),
        ("f32", None, 12, 37, 2, 1, 128, False, 0.15, ("naive", "flash"), ""),
        ("f32", None, 40, 2100, 1, 1, 32, True, None, ("flash",), "big"),
        ("bf16", 2, 7, 19, 4, 2, 64, True, 0.2, ("naive", "flash"), ""),
        ("bf16", None, 19, 7, 2, 1, 128, False, None, ("naive", "flash"), ""),
        ("bf16", None, 12, 5, 2, 2, 80, True, None, ("naive", "flash"), ""),
    ]
    for kind, batch, n_q, n_k, heads, kvh, hd, causal, scale, methods, note in specs:
        q, k, v, g = attention_inputs(rng, batch, n_q, heads, kvh, hd, kind, n_k)
        sfx = _sfx(kind)
        lens = f"s{n_q}" if n_q == n_k else f"q{n_q}k{n_k}"
        extra = ("" if causal else "-full") + ("" if scale is None else f"-scale{scale}")
        shape = f"{'' if batch is None else f'{batch}x'}{lens}-h{heads}kv{kvh}-d{hd}{extra}"
        new = n_q != n_k or not causal or scale is not None

        def ref(q=q, k=k, v=v, g=g, causal=causal, scale=scale):
            dq, dk, dv = np_attention_backward(q, k, v, g, causal=causal, scale=scale)
            return {"dq": dq, "dk": dk, "dv": dv}

        for method in methods:
            def run(be, q=q, k=k, v=v, g=g, method=method, causal=causal, scale=scale):
                dq, dk, dv = _ops().attention_backward(q, k, v, g, causal=causal, scale=scale, method=method,
                                                       backend=be)
                return {"dq": _np(dq), "dk": _np(dk), "dv": _np(dv)}

            kern = (("attention_bwd_fma_naive" + sfx, "training_zero_f32")
                    + (("training_f32_to" + sfx,) if kind != "f32" else ())) if method == "naive" \
                else _flash_kernels(sfx, False)
            yield Case(op="attention_backward", dtype=kind, shape=f"{shape}-{method}", kernels=kern,
                       run=run, reference=ref, note=note)
        if "flash" in methods and (n_q in (1, 65, 2049) or kind != "f32" or new):
            fwd = _once(lambda q=q, k=k, v=v, causal=causal, scale=scale, kind=kind: _given_out_lse(
                np_attention_forward(q, k, v, causal=causal, scale=scale), kind))

            def run_given(be, q=q, k=k, v=v, g=g, fwd=fwd, causal=causal, scale=scale):
                out, lse = fwd()
                dq, dk, dv = _ops().attention_backward(q, k, v, g, out=out, lse=lse, causal=causal, scale=scale,
                                                       method="flash", backend=be)
                return {"dq": _np(dq), "dk": _np(dk), "dv": _np(dv)}

            yield Case(op="attention_backward", dtype=kind, shape=f"{shape}-flash_given_lse",
                       kernels=_flash_kernels(sfx, True), run=run_given, reference=ref, note=note)


def _given_out_lse(out_lse64: tuple[np.ndarray, np.ndarray], kind: str) -> tuple[Any, np.ndarray]:
    """The float64 forward's out in the case's dtype and its lse in fp32: what a training step hands the
    backward as the forward's own results."""
    return _cast(out_lse64[0], kind), out_lse64[1].astype(np.float32)


def _tc_kernels(head_dim: int, given: bool, softcap: float = 0.0, kind: str = "bf16",
                deterministic: bool = False, pair: bool = False) -> tuple[str, ...]:
    """What attention_backward(method='tensor_cores') launches at this head_dim."""
    from ...ops.attention import tc_head_dim
    from ...ops.attention import FUSED_HEAD_DIMS

    d, s = tc_head_dim(head_dim), _sfx(kind)
    c = "_softcap" if softcap > 0 else ""
    if head_dim in FUSED_HEAD_DIMS and not pair:  # the fused kernel (attention_bwd_tc_fused.cu)
        pre = () if given else (f"attention_bwd_lse{c}{s}",)
        fused = f"attention_bwd_tc_fused_d{d}{c}{'_det' if deterministic else ''}{s}"
        return pre + (f"attention_bwd_tc_prep{s}", fused, f"attention_bwd_tc_dq_reduce_d{d}{s}")
    kv = ((f"attention_bwd_tc_dv_d{d}{c}{s}", f"attention_bwd_tc_dk_d{d}{c}{s}") if d == 256
          else (f"attention_bwd_tc_dkdv_d{d}{c}{s}",))
    pre = "attention_bwd_preprocess" + s if given else f"attention_bwd_lse{c}{s}"
    return (pre,) + kv + (f"attention_bwd_tc_dq_d{d}{c}{s}",)


def _attention_window_cases(rng: np.random.Generator, only: Any = None) -> Iterator[Case]:
    # Sliding windows and softcap through every backward path (naive, flash with and without the
    # forward's out/lse, tensor cores): left/right/both windows, causal and not, n_q != n_k both ways.
    # (kind, n_q, n_k, heads, kv_heads, head_dim, causal, window_size, softcap)
    specs = only or [
        ("f32", 70, 70, 2, 1, 32, True, (9, -1), 0.0),
        ("f32", 40, 90, 4, 1, 64, False, (-1, 5), 0.0),
        ("f32", 90, 40, 2, 2, 64, False, (12, 12), 0.0),
        ("f32", 33, 33, 2, 1, 128, True, (-1, -1), 3.0),
        ("f32", 50, 60, 4, 4, 80, True, (16, -1), 1.5),
        ("bf16", 70, 70, 4, 1, 64, True, (20, -1), 0.0),
        ("bf16", 40, 90, 2, 1, 80, False, (30, 10), 4.0),
        ("bf16", 130, 100, 4, 2, 128, True, (0, -1), 0.0),
        # the other tensor-core softcap kernels (head_dim 64, 128, 256)
        ("bf16", 30, 40, 2, 1, 64, True, (-1, -1), 2.0),
        ("bf16", 40, 30, 2, 2, 128, False, (6, 6), 1.0),
        ("bf16", 20, 25, 2, 1, 256, True, (10, -1), 3.0),
    ]
    for kind, n_q, n_k, heads, kvh, hd, causal, win, cap in specs:
        q, k, v, g = attention_inputs(rng, None, n_q, heads, kvh, hd, kind, n_k)
        sfx = _sfx(kind)
        shape = (f"q{n_q}k{n_k}-h{heads}kv{kvh}-d{hd}{'' if causal else '-full'}-w{win[0]},{win[1]}"
                 + (f"-cap{cap:g}" if cap else ""))
        kw = {"causal": causal, "window_size": win, "softcap": cap}

        def ref(q=q, k=k, v=v, g=g, kw=kw):
            dq, dk, dv = np_attention_backward(q, k, v, g, **kw)
            return {"dq": dq, "dk": dk, "dv": dv}

        fwd = _once(lambda q=q, k=k, v=v, kw=kw, kind=kind: _given_out_lse(np_attention_forward(q, k, v, **kw), kind))
        methods = [("naive", False), ("flash", False), ("flash", True)] + ([("tensor_cores", True)] if kind != "f32"
                                                                           else [])
        for method, given in methods:
            def run(be, q=q, k=k, v=v, g=g, kw=kw, method=method, given=given, fwd=fwd):
                extra = dict(zip(("out", "lse"), fwd())) if given else {}
                dq, dk, dv = _ops().attention_backward(q, k, v, g, method=method, backend=be, **kw, **extra)
                return {"dq": _np(dq), "dk": _np(dk), "dv": _np(dv)}

            if method == "naive":
                kern = ("attention_bwd_fma_naive" + sfx, "training_zero_f32") + (
                    ("training_f32_to" + sfx,) if kind != "f32" else ())
            elif method == "flash":
                kern = _flash_kernels(sfx, given, cap)
            else:
                kern = _tc_kernels(hd, given, cap, kind)
            yield Case(op="attention_backward", dtype=kind,
                       shape=f"{shape}-{method}{'_given_lse' if given else ''}", kernels=kern, run=run, reference=ref)


def _attention_tc_cases(rng: np.random.Generator, kind: str = "bf16", only: Any = None) -> Iterator[Case]:
    # bf16 on tensor cores: every compiled head_dim (64/96/128/256) and padded ones (32, 80, 33: element-wise
    # loads), GQA 1/4/8, causal and not, n_q != n_k both ways, lengths off every tile (64 keys, 32/64 queries)
    # and length 1. (batch, n_q, n_k, heads, kv_heads, head_dim, causal, scale, given out/lse, note)
    specs = only or [
        (None, 17, 40, 2, 1, 64, True, None, False, ""),
        (2, 70, 33, 4, 1, 80, True, 0.2, False, ""),
        (None, 33, 70, 8, 2, 96, False, None, False, ""),
        (None, 65, 65, 8, 1, 128, True, None, True, ""),
        (None, 40, 37, 2, 2, 256, True, None, False, ""),
        (None, 9, 20, 2, 1, 256, False, 0.1, True, ""),
        (None, 1, 1, 2, 1, 32, True, None, False, ""),
        (None, 1, 70, 4, 1, 64, True, None, False, ""),
        (None, 70, 1, 2, 2, 64, True, None, False, ""),
        (None, 9, 20, 4, 4, 33, False, None, False, ""),
        (None, 130, 140, 8, 2, 128, True, None, False, "big"),
    ]
    for batch, n_q, n_k, heads, kvh, hd, causal, scale, given, note in specs:
        q, k, v, g = attention_inputs(rng, batch, n_q, heads, kvh, hd, kind, n_k)
        lens = f"s{n_q}" if n_q == n_k else f"q{n_q}k{n_k}"
        extra = ("" if causal else "-full") + ("" if scale is None else f"-scale{scale}")
        shape = f"{'' if batch is None else f'{batch}x'}{lens}-h{heads}kv{kvh}-d{hd}{extra}-tc"
        out = lse = None
        if given:  # the forward's own out/lse, as a training step passes them
            q4, k4, v4 = (a if batch is not None else a[None] for a in (q, k, v))
            out, lse = _ops().flash_attention(q4, k4, v4, causal=causal, scale=scale, return_lse=True,
                                              backend="host")
            if batch is None:
                out, lse = out[0], lse[0]
            shape += "_given_lse"

        def ref(q=q, k=k, v=v, g=g, causal=causal, scale=scale):
            dq, dk, dv = np_attention_backward(q, k, v, g, causal=causal, scale=scale)
            return {"dq": dq, "dk": dk, "dv": dv}

        def run(be, q=q, k=k, v=v, g=g, causal=causal, scale=scale, out=out, lse=lse):
            dq, dk, dv = _ops().attention_backward(q, k, v, g, out=out, lse=lse, causal=causal, scale=scale,
                                                   method="tensor_cores", backend=be)
            return {"dq": _np(dq), "dk": _np(dk), "dv": _np(dv)}

        yield Case(op="attention_backward", dtype=kind, shape=shape, kernels=_tc_kernels(hd, given, kind=kind),
                   run=run, reference=ref, note=note)


def _attention_pair_cases(rng: np.random.Generator) -> Iterator[Case]:
    """The dK/dV + dQ kernel pair at head_dim 64 / 128, which sm_100 / sm_120 run instead of the fused
    kernel: the run turns the fused path off (ops.attention.fused_available) for its call."""
    from ...ops import attention as ta

    for kind in ("bf16", "f16"):
        for hd, cap in ((64, 0.0), (128, 0.0), (64, 2.0), (128, 1.0)):
            n_q, n_k, heads, kvh = 40, 70, 4, 2
            q, k, v, g = attention_inputs(rng, None, n_q, heads, kvh, hd, kind, n_k)
            kw = {"causal": True, "softcap": cap}

            def ref(q=q, k=k, v=v, g=g, kw=kw):
                dq, dk, dv = np_attention_backward(q, k, v, g, **kw)
                return {"dq": dq, "dk": dk, "dv": dv}

            def run(be, q=q, k=k, v=v, g=g, kw=kw):
                real = ta.fused_available
                ta.fused_available = lambda backend=None: False
                try:
                    dq, dk, dv = _ops().attention_backward(q, k, v, g, method="tensor_cores", backend=be, **kw)
                finally:
                    ta.fused_available = real
                return {"dq": _np(dq), "dk": _np(dk), "dv": _np(dv)}

            shape = f"q{n_q}k{n_k}-h{heads}kv{kvh}-d{hd}" + (f"-cap{cap:g}" if cap else "") + "-pair"
            yield Case(op="attention_backward", dtype=kind, shape=shape,
                       kernels=_tc_kernels(hd, False, cap, kind, pair=True), run=run, reference=ref)


def _attention_fused_cases(rng: np.random.Generator) -> Iterator[Case]:
    """The fused tensor-core backward (head_dim 64 / 128) in both dQ modes (fp32 atomics; deterministic
    per-key-tile partials), bf16 and f16, with and without a softcap: lengths that give full query tiles (the
    flat loop) and ragged ones, GQA 2, a window. Drawn last, so the other cases keep their data."""
    for kind in ("bf16", "f16"):
        for hd, cap, win, causal in ((64, 0.0, (-1, -1), False), (128, 0.0, (40, -1), True),
                                     (64, 2.0, (-1, -1), True), (128, 1.5, (-1, -1), False)):
            n_q, n_k, heads, kvh = 70, 130, 4, 2
            q, k, v, g = attention_inputs(rng, None, n_q, heads, kvh, hd, kind, n_k)
            kw = {"causal": causal, "window_size": win, "softcap": cap}
            fwd = _once(lambda q=q, k=k, v=v, kw=kw, kind=kind: _given_out_lse(np_attention_forward(q, k, v, **kw),
                                                                                kind))

            def ref(q=q, k=k, v=v, g=g, kw=kw):
                dq, dk, dv = np_attention_backward(q, k, v, g, **kw)
                return {"dq": dq, "dk": dk, "dv": dv}

            for det in (False, True):
                def run(be, q=q, k=k, v=v, g=g, kw=kw, fwd=fwd, det=det):
                    out, lse = fwd()
                    dq, dk, dv = _ops().attention_backward(q, k, v, g, out=out, lse=lse, method="tensor_cores",
                                                           deterministic=det, backend=be, **kw)
                    return {"dq": _np(dq), "dk": _np(dk), "dv": _np(dv)}

                shape = (f"q{n_q}k{n_k}-h{heads}kv{kvh}-d{hd}{'' if causal else '-full'}-w{win[0]},{win[1]}"
                         + (f"-cap{cap:g}" if cap else "") + ("-det" if det else "") + "-fused")
                yield Case(op="attention_backward", dtype=kind, shape=shape,
                           kernels=_tc_kernels(hd, True, cap, kind, det), run=run, reference=ref)


def _attention_f16_cases(rng: np.random.Generator) -> Iterator[Case]:
    """float16 attention backward on the bf16 shapes of every path: naive, flash (with and without the
    forward's out/lse), tensor cores at every compiled head_dim and a padded one, windows and softcap."""
    yield from _attention_cases(rng, (("f16", None, 33, 33, 2, 1, 64, True, None, ("naive", "flash"), ""),
                                      ("f16", 2, 9, 9, 4, 2, 80, True, None, ("naive", "flash"), ""),
                                      ("f16", 2, 7, 19, 4, 2, 64, True, 0.2, ("naive", "flash"), ""),
                                      ("f16", None, 19, 7, 2, 1, 128, False, None, ("naive", "flash"), "")))
    yield from _attention_tc_cases(rng, "f16", ((None, 17, 40, 2, 1, 64, True, None, False, ""),
                                                (2, 70, 33, 4, 1, 80, True, 0.2, False, ""),
                                                (None, 65, 65, 8, 1, 128, True, None, True, ""),
                                                (None, 9, 20, 2, 1, 256, False, 0.1, True, ""),
                                                (None, 9, 20, 4, 4, 33, False, None, False, "")))
    yield from _attention_window_cases(rng, (("f16", 70, 70, 4, 1, 64, True, (20, -1), 0.0),
                                             ("f16", 40, 90, 2, 1, 80, False, (30, 10), 4.0),
                                             ("f16", 20, 25, 2, 1, 256, True, (10, -1), 3.0),
                                             ("f16", 30, 40, 2, 1, 64, True, (-1, -1), 2.0),
                                             ("f16", 40, 30, 2, 2, 128, False, (6, 6), 1.0)))


# --------------------------------------------------------------------------- sm_90a cases

from ._fp8 import e4m3_descale, e4m3_quantize
from ._sm90 import ARCH as SM90_ARCH, declined as _declined, host_arch as _host_arch, sm90_case as _sm90_case



# --------------------------------------------------------------------------- forward (dense)
def _sm90_extra(dv: int, d: int, window: tuple[int, int], softcap: float) -> str:
    """The shape id's tail for head_dim_v != head_dim, a window and a softcap."""
    return ((f"v{dv}" if dv != d else "") + ("" if window == (-1, -1) else f"-w{window[0]},{window[1]}")
            + (f"-cap{softcap:g}" if softcap > 0 else ""))


def _sm90_forward(rng: np.random.Generator, kind: str, n_q: int, n_k: int, h: int, kvh: int, d: int,
                  causal: bool, dv: int | None = None, window: tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, batch: int = 1) -> Case:
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize

    dv = d if dv is None else dv
    q, k, v = fa_inputs(rng, batch, n_q, n_k, h, kvh, d, dv, kind)
    # a head dim between the compiled ones runs the next kernel up (the maps at the true d: sm90.forward_shape)
    name = sm90.kernel_name(*(sm90.forward_shape(d, dv) or (d, dv)), softcap, _sfx(kind))
    scale = 1.0 / np.sqrt(d)

    def run(backend: str) -> dict[str, Any]:
        out = np.empty(q.shape[:3] + (dv,), q.dtype)
        lse = np.empty(q.shape[:3], np.float32)
        wl, wr = normalize(*window, causal, n_q, n_k)
        if not sm90.try_forward(q, k, v, out, lse, (batch, n_q, n_k, h, kvh, d, dv), scale, softcap, wl, wr,
                                _sfx(kind), None, backend):
            raise _declined(name, backend)
        return {"out": out, "lse": lse}

    def ref() -> dict[str, Any]:
        out, lse = np_flash_attention(q, k, v, causal, scale, window, softcap)
        return {"out": out, "lse": lse}

    shape = f"b{batch}-q{n_q}-k{n_k}-h{h}/{kvh}-d{d}" + _sm90_extra(dv, d, window, softcap)
    return _sm90_case("flash_attention", kind, shape + ("-causal" if causal else ""), (name,), run, ref)


# --------------------------------------------------------------------------- forward (varlen)
def _sm90_varlen(rng: np.random.Generator, kind: str, lq: list[int], lk: list[int], h: int, kvh: int, d: int,
                 causal: bool, window: tuple[int, int] = (-1, -1), softcap: float = 0.0, dv: int | None = None
                 ) -> Case:
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize_serving

    dv = d if dv is None else dv
    q, k, v = (a[0] for a in fa_inputs(rng, 1, sum(lq), sum(lk), h, kvh, d, dv, kind))
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    name = sm90.kernel_name(d, dv, softcap, _sfx(kind), varlen=True)
    scale = 1.0 / np.sqrt(d)

    def run(backend: str) -> dict[str, Any]:
        out = np.empty(q.shape[:2] + (dv,), q.dtype)
        lse = np.empty(q.shape[:2], np.float32)
        wl, wr = normalize_serving(*window, causal)
        if not sm90.try_varlen(q, k, v, out, lse, cu_q, cu_k, (len(lq), max(lq), h, kvh, d, dv), scale, softcap,
                               wl, wr, _sfx(kind), None, backend):
            raise _declined(name, backend)
        return {"out": out, "lse": lse}

    def ref() -> dict[str, Any]:
        # per sequence; one with no keys gives out 0 and lse -inf (np_flash_attention's empty rows)
        out = np.zeros(q.shape[:2] + (dv,))
        lse = np.full(q.shape[:2], -np.inf)
        for b in range(len(lq)):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            o, l_ = np_flash_attention(q[None, qs], k[None, ks], v[None, ks], causal, scale, window, softcap)
            out[qs], lse[qs] = o[0], l_[0]
        return {"out": out, "lse": lse}

    shape = f"Q{lq}-K{lk}-h{h}/{kvh}-d{d}" + _sm90_extra(dv, d, window, softcap) + ("-causal" if causal else "")
    return _sm90_case("flash_attention_varlen", kind, shape.replace(" ", ""), (name,), run, ref)


# --------------------------------------------------------------------------- backward
def _sm90_backward(rng: np.random.Generator, kind: str, n_q: int, n_k: int, h: int, kvh: int, d: int,
                   causal: bool, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   dv: int | None = None) -> Case:
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize

    dv = d if dv is None else dv
    q, k, v, g = attention_inputs(rng, 1, n_q, h, kvh, d, kind, n_k)
    v, g = np.ascontiguousarray(v[..., :dv]), np.ascontiguousarray(g[..., :dv])  # head_dim_v columns
    outputs = ("dq", "dk", "dv")
    names = tuple(sm90.bwd_kernel_name(p, d, softcap, _sfx(kind), d_v=dv) for p in ("dkdv", "dq"))
    scale = 1.0 / np.sqrt(d)
    # lse and delta in float64, stored as the fp32 the kernels read (per (batch, query, head)): what the op's
    # pre-pass gives them, without its fp32 rounding of the sums
    @_once
    def stats() -> tuple[np.ndarray, np.ndarray]:
        out64, lse64 = np_flash_attention(q, k, v, causal, scale, window, softcap)
        return (lse64.astype(np.float32).reshape(-1),
                (out64 * g.astype(np.float64)).sum(axis=-1).astype(np.float32).reshape(-1))

    def run(backend: str) -> dict[str, Any]:
        lse, delta = stats()
        win = (*normalize(*window, causal, n_q, n_k), softcap)
        grads = sm90.try_backward(q, k, v, g, lse, delta, (1, n_q, n_k, h, kvh, d, dv), scale, win, kind,
                                  _sfx(kind), None, backend)
        if grads is None:
            raise _declined(",".join(names), backend)
        return dict(zip(outputs, grads))

    def ref() -> dict[str, Any]:
        dq, dk, dv = np_attention_backward(q, k, v, g, causal=causal, scale=scale, window_size=window,
                                           softcap=softcap)
        return dict(zip(outputs, (dq, dk, dv)))

    shape = f"b1-q{n_q}-k{n_k}-h{h}/{kvh}-d{d}" + _sm90_extra(dv, d, window, softcap) + ("-causal" if causal else "")
    return _sm90_case("attention_backward", kind, shape, names, run, ref)


def _sm90_fused_backward(rng: np.random.Generator, kind: str, n_q: int, n_k: int, h: int, kvh: int, d: int,
                         causal: bool, window: tuple[int, int], deterministic: bool, softcap: float = 0.0,
                         dv: int | None = None) -> Case:
    """attention_bwd_sm90_fused[_det]_d{d}[_softcap]: dK, dV and the fp32 dQ accumulator (times scale: dq as
    fp32), given the pre-pass's (batch, head, nq_pad) runs of lse * log2 e and delta (here from float64, rounded
    to fp32). At d96 the accumulator goes through the op's narrowing kernel (attention_bwd_tc_dq_reduce_d96, which
    only this kernel's accumulator reaches) into dq of the case's dtype. dv: head_dim_v (192 / 128:
    attention_bwd_sm90_fused[_det]_d192_dv128, v and dO the first 128 columns of d-wide draws)."""
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize

    q, k, v, g = attention_inputs(rng, 1, n_q, h, kvh, d, kind, n_k)
    dv = d if dv is None else dv
    v, g = np.ascontiguousarray(v[..., :dv]), np.ascontiguousarray(g[..., :dv])
    name = sm90.bwd_fused_kernel_name(d, deterministic, _sfx(kind), softcap, d_v=dv)
    reduce = f"attention_bwd_tc_dq_reduce_d{d}{_sfx(kind)}"
    scale = 1.0 / np.sqrt(d)
    nq_pad = -(-n_q // sm90.BWD_FUSED_PAD) * sm90.BWD_FUSED_PAD

    @_once
    def stats() -> tuple[np.ndarray, np.ndarray]:
        out64, lse64 = np_flash_attention(q, k, v, causal, scale, window, softcap)
        lse2 = np.zeros((1, h, nq_pad), np.float32)
        dlt = np.zeros((1, h, nq_pad), np.float32)
        lse2[:, :, :n_q] = (lse64.reshape(1, n_q, h) * np.log2(np.e)).transpose(0, 2, 1)
        dlt[:, :, :n_q] = (out64 * g.astype(np.float64)).sum(axis=-1).reshape(1, n_q, h).transpose(0, 2, 1)
        return lse2, dlt

    # d256: the accumulator's runs are the head dim's halves; 192 / 128: its 64-column thirds
    dr, runs = sm90.bwd_fused_acc_split(d, dv)

    def run(backend: str) -> dict[str, Any]:
        lse2, dlt = stats()
        dq_acc = np.zeros((1, h, runs, nq_pad, dr), np.float32)
        dk, gv = np.zeros_like(k), np.zeros_like(v)
        wl, wr = normalize(*window, causal, n_q, n_k)
        if not sm90.try_backward_fused(q, k, v, g, lse2.reshape(-1), dlt.reshape(-1), dq_acc.reshape(-1),
                                       dk.reshape(-1),
                                       gv.reshape(-1), (1, n_q, n_k, h, kvh, d, dv), nq_pad, scale, (wl, wr),
                                       deterministic, _sfx(kind), None, backend, softcap):
            raise _declined(name, backend)
        if d == 96:  # the d96 narrowing kernel has a case of its own here (nothing else launches it on the host)
            import pykern

            dq = np.zeros(q.shape, q.dtype)
            pykern.launch(reduce, max(1, -(-dq.size // 256)), 256, dq_acc, dq_acc, dq.reshape(-1), dq.size, n_q, n_k,
                          h, nq_pad, 0, 0, 0, scale, wl, wr, 0, 1, backend=backend)
        else:
            dq = (dq_acc[0, :, :, :n_q] * np.float32(scale)).transpose(2, 0, 1, 3).reshape(n_q, h, d)[None]
        return {"dq": dq, "dk": dk, "dv": gv}

    def ref() -> dict[str, Any]:
        dq, dk, dv = np_attention_backward(q, k, v, g, causal=causal, scale=scale, window_size=window,
                                           softcap=softcap)
        return {"dq": dq, "dk": dk, "dv": dv}

    shape = (f"b1-q{n_q}-k{n_k}-h{h}/{kvh}-d{d}" + _sm90_extra(dv, d, window, softcap)
             + ("-det" if deterministic else "") + ("-causal" if causal else ""))
    return _sm90_case("attention_backward", kind, shape, (name, reduce) if d == 96 else (name,), run, ref)


def _sm90_varlen_fused_backward(rng: np.random.Generator, kind: str, lq: list[int], lk: list[int], h: int,
                                kvh: int, d: int, causal: bool, window: tuple[int, int], softcap: float,
                                deterministic: bool, dv: int | None = None) -> Case:
    """attention_bwd_varlen_sm90_fused[_det]_d{d}[_softcap]: dK, dV and the fp32 dQ accumulator (heads, nq_pad,
    D) over the packed rows (times scale: dq as fp32), given the pre-pass's (heads, nq_pad) runs of lse * log2 e
    and delta over the packed rows (here from float64, rounded to fp32)."""
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize_serving

    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    dv = d if dv is None else dv  # head_dim_v (192 / 128: the _d192_dv128 kernels)
    q, g = _normal(rng, (total_q, h, d), kind), _normal(rng, (total_q, h, dv), kind)
    k, v = _normal(rng, (total_k, kvh, d), kind), _normal(rng, (total_k, kvh, dv), kind)
    name = sm90.bwd_fused_kernel_name(d, deterministic, _sfx(kind), softcap, varlen=True, d_v=dv)
    scale = 1.0 / np.sqrt(d)
    kw = {"causal": causal, "window_size": window, "softcap": softcap, "scale": scale}
    nq_pad = sm90.bwd_varlen_fused_pad(total_q)

    @_once
    def prep() -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        # The float64 reference and the lse / delta inputs the kernel reads, on the case's first run (see _once):
        # built eagerly, these cases' references were most of every process's collect_cases time.
        out64, lse64, dq64, dk64, dv64 = np_varlen_backward(q, k, v, g, cu_q, cu_k, **kw)
        lse2 = np.zeros((h, nq_pad), np.float32)
        dlt = np.zeros((h, nq_pad), np.float32)
        lse2[:, :total_q] = (lse64 * np.log2(np.e)).T  # -inf (a sequence without keys) stays -inf
        dlt[:, :total_q] = (out64 * f64(g)).sum(axis=-1).T
        return lse2, dlt, {"dq": dq64, "dk": dk64, "dv": dv64}

    # d256: the accumulator's runs are the head dim's halves; 192 / 128: its 64-column thirds
    dr, runs = sm90.bwd_fused_acc_split(d, dv)

    def run(backend: str) -> dict[str, Any]:
        lse2, dlt, _ = prep()
        dq_acc = np.zeros((h, runs, nq_pad, dr), np.float32)
        dk, gv = np.zeros_like(k), np.zeros_like(v)
        wl, wr = normalize_serving(*window, causal)
        if not sm90.try_varlen_backward_fused(q, k, v, g, lse2.reshape(-1), dlt.reshape(-1), dq_acc.reshape(-1),
                                              dk.reshape(-1), gv.reshape(-1), cu_q, cu_k,
                                              (len(lq), max(lq), max(lk), h, kvh, d, dv), nq_pad, scale, (wl, wr),
                                              softcap, deterministic, _sfx(kind), None, backend):
            raise _declined(name, backend)
        dq = (dq_acc[:, :, :total_q] * np.float32(scale)).transpose(2, 0, 1, 3).reshape(total_q, h, d)
        return {"dq": dq, "dk": dk, "dv": gv}

    shape = (f"Q{lq}-K{lk}-h{h}/{kvh}-d{d}" + _sm90_extra(dv, d, window, softcap) + ("-det" if deterministic else "")
             + ("-causal" if causal else ""))
    return _sm90_case("flash_attention_varlen_backward", kind, shape.replace(" ", ""), (name,), run,
                      lambda: prep()[2])


def _sm90_varlen_backward(rng: np.random.Generator, kind: str, lq: list[int], lk: list[int], h: int, kvh: int,
                          d: int, causal: bool, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                          dv: int | None = None) -> Case:
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize_serving

    dv = d if dv is None else dv
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, g = _normal(rng, (int(cu_q[-1]), h, d), kind), _normal(rng, (int(cu_q[-1]), h, dv), kind)
    k, v = _normal(rng, (int(cu_k[-1]), kvh, d), kind), _normal(rng, (int(cu_k[-1]), kvh, dv), kind)
    names = tuple(sm90.bwd_kernel_name(p, d, softcap, _sfx(kind), varlen=True, d_v=dv) for p in ("dkdv", "dq"))
    scale = 1.0 / np.sqrt(d)
    kw = {"causal": causal, "window_size": window, "softcap": softcap, "scale": scale}
    full = _once(lambda: np_varlen_backward(q, k, v, g, cu_q, cu_k, **kw))

    @_once
    def stats() -> tuple[np.ndarray, np.ndarray]:
        # lse (-inf for the rows of a sequence without keys) and delta in float64, stored as the kernels' fp32
        out64, lse64 = full()[:2]
        return lse64.astype(np.float32).reshape(-1), (out64 * f64(g)).sum(axis=-1).astype(np.float32).reshape(-1)

    def run(backend: str) -> dict[str, Any]:
        lse, delta = stats()
        gq, gk, gv = np.zeros(q.shape, q.dtype), np.zeros(k.shape, k.dtype), np.zeros(v.shape, v.dtype)
        wl, wr = normalize_serving(*window, causal)
        if not sm90.try_varlen_backward(q, k, v, g, lse, delta, gq.reshape(-1), gk.reshape(-1), gv.reshape(-1),
                                        cu_q, cu_k, (len(lq), max(lq), max(lk), h, kvh, d, dv), scale, wl, wr,
                                        softcap, _sfx(kind), None, backend):
            raise _declined(",".join(names), backend)
        return {"dq": gq, "dk": gk, "dv": gv}

    shape = f"Q{lq}-K{lk}-h{h}/{kvh}-d{d}" + _sm90_extra(dv, d, window, softcap) + ("-causal" if causal else "")
    return _sm90_case("flash_attention_varlen_backward", kind, shape.replace(" ", ""), names, run,
                      lambda: dict(zip(("dq", "dk", "dv"), full()[2:])))


# Shapes per head_dim (queries, keys) for the non-causal and the causal case. Key tiles: 192 keys at d64, 128 at
# d128, 64 at d256 (the forward), 128 (the backward's dK/dV CTA); queries: 128 a CTA.
SM90_FORWARD = {64: ((100, 250), (150, 100)), 128: ((100, 200), (150, 100)), 256: ((70, 150), (150, 100))}
SM90_VARLEN = {64: (([5, 90, 0], [9, 250, 3]), ([90, 1, 20], [60, 200, 0])),
          128: (([5, 90, 0], [9, 200, 3]), ([90, 1, 20], [60, 140, 0])),
          256: (([5, 70, 0], [9, 150, 3]), ([70, 1, 20], [60, 100, 0]))}
SM90_BACKWARD = {64: ((70, 150), (150, 60)), 128: ((70, 150), (150, 60))}
# The d64 forward's overlapped pair loop and its persistent walk (queries, keys; non-causal, causal): 1162 keys are a
# masked tile, the peeled one, two pairs and the tail step; causal 520 x 600 over 2 heads is 10 work tiles on the
# host's 3 CTAs, several a CTA. Drawn after every other sm_90a case, so that their inputs stay as they were.
SM90_FORWARD_D64_LOOP = ((70, 1162), (520, 600))
# The fused kernels (atomic and semaphore-ordered dQ): (n_q, n_k, heads, kv_heads, head_dim, causal, window).
# At most 8 CTAs (the host keeps 8 blocks resident while semaphores wait): off-tile lengths, several key tiles per
# query tile, GQA, a window, n_q > n_k.
SM90_FUSED_BACKWARD = ((130, 300, 2, 1, 64, True, (-1, -1)), (150, 260, 4, 2, 64, False, (60, 20)),
                       (100, 390, 4, 2, 128, False, (-1, -1)), (200, 150, 2, 1, 128, True, (-1, -1)))
# Their _softcap kernels: (n_q, n_k, heads, kv_heads, head_dim, causal, window, softcap), caps that bend most
# scores, at most 8 CTAs as above.
SM90_FUSED_BACKWARD_SOFTCAP = ((130, 300, 2, 1, 64, True, (-1, -1), 2.0), (150, 260, 2, 1, 128, False, (60, 20), 2.5))
# The varlen fused kernels: (lq, lk, heads, kv_heads, head_dim, causal, window, softcap). Key tiles that run into
# the next sequence (its keys must not reach dQ), a sequence with keys but no query, one with queries but no key,
# several key tiles per query tile; at most 8 CTAs.
SM90_VARLEN_FUSED_BACKWARD = ((([5, 130, 0, 40], [9, 200, 3, 0]), 2, 1, 64, True, (-1, -1), 0.0),
                              (([70, 1, 90], [33, 140, 20]), 2, 1, 128, False, (-1, -1), 2.0),
                              (([100, 0, 30], [150, 5, 60]), 2, 1, 64, False, (50, 20), 1.5),
                              (([60, 30], [130, 30]), 4, 2, 128, True, (-1, -1), 0.0))
# Each of those kernels and of the dense _softcap fused ones at the other causal setting (every sm_90a kernel runs
# causal and not), drawn after every other sm_90a case so that their inputs stay as they were.
SM90_FUSED_BACKWARD_SOFTCAP_OTHER = ((130, 300, 2, 1, 64, False, (-1, -1), 2.0),
                                     (150, 260, 2, 1, 128, True, (-1, -1), 2.5))
SM90_VARLEN_FUSED_BACKWARD_OTHER = ((([5, 130, 0, 40], [9, 200, 3, 0]), 2, 1, 64, False, (-1, -1), 0.0),
                                    (([70, 1, 90], [33, 140, 20]), 2, 1, 128, True, (-1, -1), 2.0),
                                    (([100, 0, 30], [150, 5, 60]), 2, 1, 64, True, (-1, -1), 1.5),
                                    (([60, 30], [130, 30]), 4, 2, 128, False, (-1, -1), 0.0))
# The fused d256 kernels (dense and varlen, with and without softcap; each causal and not): the same rows as the
# tables above (n_q, n_k, heads, kv_heads, head_dim, causal, window, softcap) / ((lq, lk), ...). 64 keys a CTA, so
# at most 8 CTAs means at most 2 key tiles a (sequence, kv head) in varlen; query tiles of 16 rows, several key
# tiles each, GQA, a window, n_q > n_k, a sequence with keys but no query and one with queries but no key.
SM90_FUSED_BACKWARD_D256 = ((100, 190, 4, 2, 256, True, (-1, -1), 0.0), (150, 130, 2, 1, 256, False, (60, 20), 0.0),
                            (130, 200, 2, 1, 256, False, (-1, -1), 2.0), (90, 150, 2, 1, 256, True, (-1, -1), 2.5))
SM90_VARLEN_FUSED_BACKWARD_D256 = ((([5, 70, 0, 40], [9, 120, 3, 0]), 2, 1, 256, True, (-1, -1), 0.0),
                                   (([70, 1, 90], [33, 100, 20]), 2, 1, 256, False, (50, 20), 0.0),
                                   (([60, 30], [100, 30]), 4, 2, 256, False, (-1, -1), 2.0),
                                   (([40, 0, 30], [70, 5, 60]), 2, 1, 256, True, (-1, -1), 1.5))
# The fused kernels at d96 (32-column boxes, 64B swizzle; consumer 1's dQ^T rows 32..63 computed twice and not
# added), with and without softcap, causal and not, atomic and _det: the dense ones (the tables above' form; cap 0
# is the plain kernel) and the varlen ones, at most 8 CTAs.
SM90_FUSED_BACKWARD_D96 = ((130, 300, 2, 1, 96, True, (-1, -1), 0.0), (150, 260, 4, 2, 96, False, (60, 20), 0.0),
                           (100, 200, 2, 1, 96, False, (-1, -1), 2.0), (160, 130, 2, 1, 96, True, (-1, -1), 2.5))
SM90_VARLEN_FUSED_BACKWARD_D96 = ((([5, 130, 0, 40], [9, 200, 3, 0]), 2, 1, 96, True, (-1, -1), 0.0),
                                  (([70, 1, 90], [33, 140, 20]), 2, 1, 96, False, (-1, -1), 2.0),
                                  (([100, 0, 30], [150, 5, 60]), 2, 1, 96, False, (50, 20), 0.0),
                                  (([60, 30], [130, 30]), 4, 2, 96, True, (-1, -1), 1.5))
# The fused kernels at 192 / head_dim_v 128 (FlashAttention-3's tiling: 96-key CTAs, 64-query tiles), causal and
# not, atomic and _det, dense and varlen: (n_q, n_k, heads, kv_heads, causal, window) / ((lq, lk), heads, kv_heads,
# causal, window). Two key tiles or more, n_q > n_k, GQA, a window; a sequence with keys but no query, one with
# queries but no key, key tiles that run into the next sequence.
SM90_FUSED_BACKWARD_192 = ((100, 200, 2, 1, False, (50, 20)), (150, 130, 4, 2, True, (-1, -1)))
SM90_VARLEN_FUSED_BACKWARD_192 = ((([5, 100, 0], [9, 200, 3]), 2, 1, False, (-1, -1)),
                                  (([90, 1, 20], [60, 150, 0]), 4, 2, True, (-1, -1)))
# Their _softcap kernels (atomic and _det, dense and varlen), the same tables' forms with the cap last: GQA 2,
# causal and not, n_q > n_k (rows that see no key); a sequence with keys but no query, one with queries but no key.
SM90_FUSED_BACKWARD_192_SOFTCAP = ((130, 200, 4, 2, False, (-1, -1), 2.0), (150, 100, 2, 1, True, (-1, -1), 2.5))
SM90_VARLEN_FUSED_BACKWARD_192_SOFTCAP = ((([5, 100, 0], [9, 200, 3]), 2, 1, False, (-1, -1), 2.0),
                                          (([70, 0, 20], [60, 150, 0]), 2, 1, True, (-1, -1), 2.5))
# The backward's _softcap kernels and its d256 kernels: (n_q, n_k, heads, kv_heads, head_dim, causal, window,
# softcap); caps that bend
# most scores (~ N(0, 1) here), a window, GQA, n_q > n_k (rows that see no key) and n_q < n_k.
SM90_BACKWARD_SOFTCAP = ((70, 150, 2, 1, 64, False, (-1, -1), 2.0), (150, 60, 4, 2, 64, True, (-1, -1), 1.5),
                         (130, 200, 2, 1, 128, False, (40, 10), 2.5), (150, 100, 2, 2, 128, True, (-1, -1), 3.0),
                         # head_dim 256 (dK/dV: 64-key CTAs, the head dim split across the consumers; dQ: 32-key
                         # tiles), with and without softcap
                         (70, 150, 2, 1, 256, False, (-1, -1), 0.0), (150, 60, 4, 2, 256, True, (-1, -1), 0.0),
                         (90, 100, 2, 1, 256, False, (30, 5), 2.0), (130, 130, 2, 2, 256, True, (-1, -1), 1.5))
# The backward's varlen kernels, with and without softcap: (lq, lk, heads, kv_heads, head_dim, causal, window,
# softcap). Ragged sequences with key / query tiles that run into the next sequence, a sequence with keys but no
# query (zero dK / dV), one with queries but no key (zero dQ), lengths 1, GQA 2.
SM90_VARLEN_BACKWARD = (
    (([5, 90, 0, 1], [9, 250, 3, 0]), 4, 2, 64, False, (-1, -1), 0.0),
    (([90, 1, 20, 0], [60, 200, 0, 7]), 2, 1, 64, True, (-1, -1), 0.0),
    (([5, 130, 0], [9, 200, 3]), 2, 1, 128, False, (-1, -1), 0.0),
    (([140, 1, 20], [60, 150, 0]), 4, 2, 128, True, (-1, -1), 0.0),
    (([5, 90, 0], [9, 250, 3]), 2, 1, 64, False, (50, 10), 2.0),
    (([90, 1, 20], [60, 200, 0]), 4, 2, 64, True, (-1, -1), 1.5),
    (([5, 130, 0], [9, 200, 3]), 2, 1, 128, False, (-1, -1), 3.0),
    (([140, 1, 20], [60, 150, 0]), 2, 1, 128, True, (30, -1), 2.5),
    (([5, 70, 0, 1], [9, 150, 3, 0]), 4, 2, 256, True, (-1, -1), 0.0),   # d256
    (([90, 1, 20], [60, 130, 0]), 2, 1, 256, False, (40, 10), 0.0),
    (([5, 70, 0], [9, 150, 3]), 2, 1, 256, False, (-1, -1), 2.0),
    (([90, 1, 20], [60, 130, 0]), 2, 2, 256, True, (30, -1), 1.5),
)
# The backward at head_dim 96 (32-column boxes, 64B swizzle) and 192 / head_dim_v 128 (the DV template parameter),
# both kernels, with and without softcap: (n_q, n_k, heads, kv_heads, head_dim, head_dim_v, causal, window,
# softcap). Off the 128-row tiles, GQA, windows, n_q > n_k (rows that see no key) and n_q < n_k.
SM90_BACKWARD_DIMS = ((70, 150, 2, 1, 96, 96, False, (-1, -1), 0.0), (150, 60, 4, 2, 96, 96, True, (-1, -1), 0.0),
                      (130, 200, 2, 1, 96, 96, False, (40, 10), 2.5), (150, 100, 2, 2, 96, 96, True, (-1, -1), 3.0),
                      (70, 150, 4, 1, 192, 128, False, (-1, -1), 0.0), (150, 60, 2, 1, 192, 128, True, (-1, -1), 0.0),
                      (130, 200, 2, 2, 192, 128, False, (50, 20), 2.0), (150, 130, 4, 2, 192, 128, True, (-1, -1), 1.5))
# The same over packed sequences: (lq, lk, heads, kv_heads, head_dim, head_dim_v, causal, window, softcap).
SM90_VARLEN_BACKWARD_DIMS = (
    (([5, 130, 0], [9, 200, 3]), 2, 1, 96, 96, False, (-1, -1), 0.0),
    (([140, 1, 20], [60, 150, 0]), 4, 2, 96, 96, True, (-1, -1), 0.0),
    (([5, 90, 0], [9, 250, 3]), 2, 1, 96, 96, False, (50, 10), 2.0),
    (([90, 1, 20], [60, 200, 0]), 2, 2, 96, 96, True, (-1, -1), 1.5),
    (([5, 140, 0, 1], [9, 300, 3, 0]), 4, 1, 192, 128, False, (-1, -1), 0.0),
    (([90, 1, 20], [60, 200, 0]), 2, 1, 192, 128, True, (50, -1), 0.0),
    (([70, 20], [260, 40]), 2, 2, 192, 128, False, (-1, -1), 2.0),
    (([130, 1, 20], [60, 300, 0]), 4, 2, 192, 128, True, (-1, -1), 2.5),
)
# softcap (the _softcap kernels) and head_dim 192 / head_dim_v 128 (d192_dv128): (n_q, n_k, heads, kv_heads,
# head_dim, head_dim_v, causal, window, softcap). Caps of 1.5..3 (scores ~ N(0, 1) here) bend most scores; the
# first two reach the steady state (tiles every row sees wholly: the lazy softmax on capped scores) and its pair
# loop at d64; the rest cover the window, n_q > n_k, GQA and the masked tiles.
SM90_SHAPES_FORWARD = (
    (130, 600, 4, 2, 64, 64, False, (-1, -1), 2.0),     # d64: masked, peeled, pair loop, GQA 2
    (150, 300, 2, 1, 64, 64, True, (-1, -1), 1.5),
    (150, 500, 2, 1, 128, 128, True, (-1, -1), 3.0),    # d128: steady tiles under the causal mask
    (200, 100, 2, 1, 128, 128, False, (40, 10), 2.5),   # window, n_q > n_k (rows that see no key)
    (90, 150, 2, 2, 256, 256, True, (-1, -1), 1.5),     # d256
    (70, 200, 2, 1, 256, 256, False, (-1, -1), 2.0),    # d256: the pair loop
    (100, 300, 4, 1, 192, 128, False, (-1, -1), 0.0),   # DeepSeek-V3's shape: steady tiles, GQA 4
    (150, 100, 2, 1, 192, 128, True, (-1, -1), 0.0),    # causal, n_q > n_k
    (130, 300, 2, 2, 192, 128, False, (100, 20), 0.0),  # window
    (150, 280, 4, 2, 192, 128, True, (60, -1), 2.5),    # softcap and window, causal, GQA 2
    (100, 200, 2, 1, 192, 128, False, (-1, -1), 2.0),
)
# softcap over packed sequences (ragged, an empty one, a sequence with no keys): (lq, lk, head_dim, causal, window,
# softcap).
SM90_VARLEN_SOFTCAP = ((([5, 90, 0], [9, 450, 3]), 64, False, (-1, -1), 2.0),
                       (([90, 1, 20], [60, 200, 0]), 64, True, (-1, -1), 1.5),
                       (([90, 1, 20], [60, 300, 0]), 128, True, (-1, -1), 3.0),
                       (([5, 90, 0], [9, 200, 3]), 128, False, (50, 10), 2.5),
                       (([70, 20], [150, 40]), 256, False, (30, 5), 1.5),
                       (([70, 1, 20], [60, 100, 0]), 256, True, (-1, -1), 2.0))
# head_dim 192 / head_dim_v 128 (DeepSeek-V3's prefill) over packed sequences, without and with softcap: (lq, lk,
# heads, kv_heads, causal, window, softcap). Ragged lengths, an empty sequence, one without keys, steady key tiles.
SM90_VARLEN_192 = ((([5, 140, 0], [9, 300, 3]), 4, 1, False, (-1, -1), 0.0),
                   (([90, 1, 20], [60, 200, 0]), 2, 1, True, (50, -1), 0.0),
                   (([70, 20], [260, 40]), 2, 2, False, (-1, -1), 2.0),
                   (([90, 1, 20], [60, 300, 0]), 4, 2, True, (-1, -1), 2.5))


# The forward at head_dim 96 (32-column boxes, 64B swizzle; 128-key tiles): (n_q, n_k, heads, kv_heads, causal,
# window, softcap), each kernel causal and not. Steady tiles (the one-step hot loop, its ping-pong turns) with GQA
# 2; causal 300 x 400 over 2 heads is 6 work tiles on the host's 3 CTAs (the persistent walk, the ring and the
# named barriers carried across tiles); a window with n_q > n_k (rows that see no key); softcap with and without
# the causal mask.
SM90_FORWARD_D96 = ((100, 300, 4, 2, False, (-1, -1), 0.0), (300, 400, 2, 1, True, (-1, -1), 0.0),
                    (200, 150, 2, 1, False, (40, 10), 2.0), (150, 280, 4, 2, True, (-1, -1), 2.5))
# The dense forward at head dims between the compiled ones, on the next kernel up (its TMA loads zero-fill the
# columns past d, its store clips there): (n_q, n_k, heads, kv_heads, head_dim, causal, window, softcap); d80 -> d96,
# d112 -> d128, d40 -> d64, d160 -> d256 (a box wholly past the head dim).
SM90_FORWARD_PADDED = ((70, 90, 2, 1, 80, True, (-1, -1), 0.0), (60, 130, 4, 2, 112, False, (-1, -1), 2.0),
                       (50, 70, 2, 1, 40, True, (20, -1), 0.0), (40, 70, 2, 1, 160, False, (-1, -1), 0.0))
# The same over packed sequences: ((lq, lk), heads, kv_heads, causal, window, softcap). Ragged lengths, an empty
# sequence, one without keys, key tiles that run into the next sequence, steady tiles.
SM90_VARLEN_D96 = ((([5, 140, 0], [9, 300, 3]), 4, 1, False, (-1, -1), 0.0),
                   (([90, 1, 20], [60, 200, 0]), 2, 1, True, (-1, -1), 0.0),
                   (([70, 20], [260, 40]), 2, 2, False, (50, 10), 2.0),
                   (([90, 1, 20], [60, 300, 0]), 4, 2, True, (-1, -1), 2.5))


# FP8 forward (kernels_cu/attention_fwd_fp8_sm90.cu): (n_q, n_k, heads, kv_heads, head_dim, causal, per-head
# descales), each head_dim causal and not, off the 128-row tiles, GQA, n_q != n_k both ways.
SM90_FP8_FORWARD = [
    (130, 200, 2, 1, 64, False, False), (150, 140, 4, 2, 64, True, True),
    (129, 384, 4, 1, 128, False, True), (200, 70, 2, 1, 128, True, False),
    (70, 200, 2, 2, 256, False, True), (140, 150, 2, 1, 256, True, False),
]
# The _softcap kernels (attention_fwd_sm90_d{D}_softcap_fp8): the same tuple plus (window, softcap), each head_dim
# causal and not, one with a window; c = 1.5 caps the scores (scale * q.k about N(0, 1) here).
SM90_FP8_FORWARD_SOFTCAP = [
    (130, 260, 2, 1, 64, False, True, (-1, -1), 1.5), (150, 140, 4, 2, 64, True, False, (-1, -1), 1.5),
    (129, 300, 4, 1, 128, False, False, (100, 40), 1.5), (200, 170, 2, 1, 128, True, True, (-1, -1), 1.5),
    (70, 200, 2, 2, 256, False, False, (-1, -1), 1.5), (140, 150, 2, 1, 256, True, True, (-1, -1), 1.5),
]


def _fp8_inputs(x: list[np.ndarray], per_head: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]] | None
                ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """q, k, v (fp32, x) quantized as FP8 callers do: (e4m3 codes, descales, float64 dequantized values), a list
    each. The descale amax / 448 of the whole tensor, or per_head(array, its index in x): (the descales, their
    broadcast against the array). The codes are float32 stand-ins where ml_dtypes is missing (the caller's
    arrays.bfloat16() has marked the case as needing it: it never runs)."""
    codes, descales, deq = [], [], []
    for i, a in enumerate(x):
        if per_head is not None:
            ds, full = per_head(a, i)
        else:
            ds = e4m3_descale([np.abs(a).max()])
            full = ds[0]
        c = e4m3_quantize(a, full, stand_in=True)
        codes.append(c)
        descales.append(ds)
        deq.append(c.astype(np.float64) * np.asarray(full, np.float64))
    return codes, descales, deq


def _sm90_fp8_forward(rng: np.random.Generator, n_q: int, n_k: int, h: int, kvh: int, d: int, causal: bool,
                      per_head: bool, window: tuple[int, int] = (-1, -1), cap: float = 0.0) -> Case:
    """flash_attention on e4m3 q, k, v through the op's helper (try_forward_fp8), against float64 attention on the
    dequantized inputs: q, k, v drawn normal, v scaled to max |v| = 1 (the tolerance row's atol is 2**-4 of it),
    each quantized as FP8 callers do (descale = amax / 448 per tensor, or per (batch, kv head)); window and
    softcap cap (> 0: the _softcap kernel) as flash_attention takes them."""
    from ... import arrays
    from ...arrays import flat_view
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize

    x = [rng.standard_normal((1, n, hh, d)).astype(np.float32) for n, hh in ((n_q, h), (n_k, kvh), (n_k, kvh))]
    x[2] /= np.abs(x[2]).max()
    # After the draws (the random stream is a full install's either way): the bf16 output's dtype, which without
    # ml_dtypes is the runner's stand-in and marks this case as needing it; then the e4m3 codes.
    bf16 = arrays.bfloat16()

    def per_kv_head(a: np.ndarray, i: int) -> tuple[np.ndarray, np.ndarray]:
        ds = e4m3_descale(np.abs(a).reshape(1, a.shape[1], kvh, a.shape[2] // kvh, d).max(axis=(1, 3, 4)))
        return ds, np.repeat(ds, a.shape[2] // kvh, axis=1)[:, None, :, None]

    codes, descales, deq = _fp8_inputs(x, per_kv_head if per_head else None)
    name = sm90.fp8_kernel_name(d, cap)
    scale = 1.0 / np.sqrt(d)
    (q, k, v), stride = codes, 1 if per_head else 0

    def run(backend: str) -> dict[str, Any]:
        out = np.empty(q.shape[:3] + (d,), bf16)
        lse = np.empty(q.shape[:3], np.float32)
        wl, wr = normalize(*window, causal, n_q, n_k)
        ds = tuple((flat_view(x_), stride) for x_ in descales)
        if not sm90.try_forward_fp8(q, k, v, out, lse, ds, (1, n_q, n_k, h, kvh, d, d), scale, wl, wr, None,
                                    backend, cap):
            raise _declined(name, backend)
        return {"out": out, "lse": lse}

    def ref() -> dict[str, Any]:
        out, lse = np_flash_attention(deq[0], deq[1], deq[2], causal, scale, window, cap)
        return {"out": out, "lse": lse}

    shape = (f"b1-q{n_q}-k{n_k}-h{h}/{kvh}-d{d}" + ("-perhead" if per_head else "")
             + (f"-w{window[0]}/{window[1]}" if window != (-1, -1) else "") + (f"-softcap{cap}" if cap else "")
             + ("-causal" if causal else ""))
    return _sm90_case("flash_attention", "fp8", shape, (name,), run, ref)


# FP8 varlen (attention_fwd_varlen_sm90_d{D}[_softcap]_fp8): (query lengths, key lengths, head_dim, causal,
# per-(sequence, kv head) descales, window, softcap), every kernel causal and not; sequences off the tiles, one
# shorter than its keys and one longer, 4 heads over 2 kv heads.
SM90_FP8_VARLEN = [
    (lq, lk, d, causal, per_head, window, cap)
    for d in (64, 128, 256)
    for cap in (0.0, 1.5)
    for (lq, lk), causal, per_head, window in (
        (((70, 150), (200, 60)), False, True, (-1, -1)),
        (((130, 40), (300, 20)), True, cap == 0.0, (-1, -1) if d != 128 or cap == 0.0 else (100, 40)),
    )
]


def _sm90_fp8_varlen(rng: np.random.Generator, lens_q: tuple[int, ...], lens_k: tuple[int, ...], d: int,
                     causal: bool, per_head: bool, window: tuple[int, int] = (-1, -1), cap: float = 0.0) -> Case:
    """flash_attention_varlen on packed e4m3 q, k, v through the op's helper (try_varlen_fp8), against float64
    attention of each sequence on its dequantized rows; inputs as _sm90_fp8_forward's, quantized per tensor or per
    (sequence, kv head)."""
    from ... import arrays
    from ...arrays import flat_view
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize_serving

    h, kvh, g = 4, 2, 2
    nb = len(lens_q)
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    x = [rng.standard_normal((n, hh, d)).astype(np.float32) for n, hh in ((cq[-1], h), (ck[-1], kvh), (ck[-1], kvh))]
    x[2] /= np.abs(x[2]).max()
    bf16 = arrays.bfloat16()

    def per_seq_kv_head(a: np.ndarray, i: int) -> tuple[np.ndarray, np.ndarray]:
        cu, hk = (cq, ck, ck)[i], a.shape[1] // kvh
        seq = np.searchsorted(cu[1:], np.arange(a.shape[0]), side="right")  # each row's sequence
        ds = e4m3_descale([[np.abs(a[cu[b]:cu[b + 1], j * hk:(j + 1) * hk]).max(initial=0.0) for j in range(kvh)]
                           for b in range(nb)])
        ds = np.where(ds > 0, ds, np.float32(1.0))  # a sequence without rows
        return ds, np.repeat(ds, hk, axis=1)[seq][:, :, None]

    codes, descales, deq = _fp8_inputs(x, per_seq_kv_head if per_head else None)
    name = sm90.fp8_varlen_kernel_name(d, cap)
    scale = 1.0 / np.sqrt(d)
    (q, k, v), stride = codes, 1 if per_head else 0

    def run(backend: str) -> dict[str, Any]:
        out = np.empty((q.shape[0], h, d), bf16)
        lse = np.empty((q.shape[0], h), np.float32)
        wl, wr = normalize_serving(*window, causal)
        ds = tuple((flat_view(x_), stride) for x_ in descales)
        if not sm90.try_varlen_fp8(q, k, v, flat_view(out), flat_view(lse), cq, ck, ds,
                                   (nb, max(lens_q), h, kvh, d), scale, cap, wl, wr, None, backend):
            raise _declined(name, backend)
        return {"out": out, "lse": lse}

    def ref() -> dict[str, Any]:
        outs, lses = [], []
        for b in range(nb):
            sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            o, l_ = np_flash_attention(deq[0][None, sq], deq[1][None, sk], deq[2][None, sk], causal, scale, window,
                                       cap)
            outs.append(o[0])
            lses.append(l_[0])
        return {"out": np.concatenate(outs), "lse": np.concatenate(lses)}

    shape = ("varlen-q" + "_".join(map(str, lens_q)) + "-k" + "_".join(map(str, lens_k)) + f"-h{h}/{kvh}-d{d}"
             + ("-perhead" if per_head else "") + (f"-w{window[0]}/{window[1]}" if window != (-1, -1) else "")
             + (f"-softcap{cap}" if cap else "") + ("-causal" if causal else ""))
    return _sm90_case("flash_attention", "fp8", shape, (name,), run, ref)


def _sm90_cases(rng: np.random.Generator) -> Iterator[Case]:
    for kind in ("bf16", "f16"):
        for d, shapes in SM90_FORWARD.items():
            for causal, (n_q, n_k) in zip((False, True), shapes):
                yield _sm90_forward(rng, kind, n_q, n_k, 2, 1, d, causal)
        for d, shapes in SM90_VARLEN.items():
            for causal, (lq, lk) in zip((False, True), shapes):
                yield _sm90_varlen(rng, kind, lq, lk, 2, 1, d, causal)
        for d, shapes in SM90_BACKWARD.items():
            for causal, (n_q, n_k) in zip((False, True), shapes):
                yield _sm90_backward(rng, kind, n_q, n_k, 2, 1, d, causal)
        for n_q, n_k, h, kvh, d, dv, causal, window, cap in SM90_SHAPES_FORWARD:
            yield _sm90_forward(rng, kind, n_q, n_k, h, kvh, d, causal, dv, window, cap)
        for (lq, lk), d, causal, window, cap in SM90_VARLEN_SOFTCAP:
            yield _sm90_varlen(rng, kind, lq, lk, 2, 1, d, causal, window, cap)
        for (lq, lk), h, kvh, causal, window, cap in SM90_VARLEN_192:
            yield _sm90_varlen(rng, kind, lq, lk, h, kvh, 192, causal, window, cap, dv=128)
        for n_q, n_k, h, kvh, d, causal, window, cap in SM90_BACKWARD_SOFTCAP:
            yield _sm90_backward(rng, kind, n_q, n_k, h, kvh, d, causal, window, cap)
        for (lq, lk), h, kvh, d, causal, window, cap in SM90_VARLEN_BACKWARD:
            yield _sm90_varlen_backward(rng, kind, lq, lk, h, kvh, d, causal, window, cap)
        for n_q, n_k, h, kvh, d, dv, causal, window, cap in SM90_BACKWARD_DIMS:
            yield _sm90_backward(rng, kind, n_q, n_k, h, kvh, d, causal, window, cap, dv)
        for (lq, lk), h, kvh, d, dv, causal, window, cap in SM90_VARLEN_BACKWARD_DIMS:
            yield _sm90_varlen_backward(rng, kind, lq, lk, h, kvh, d, causal, window, cap, dv)
        for n_q, n_k, h, kvh, d, causal, window in SM90_FUSED_BACKWARD:
            for det in (False, True):
                yield _sm90_fused_backward(rng, kind, n_q, n_k, h, kvh, d, causal, window, det)
        yield from _sm90_fused_softcap_varlen(rng, kind, SM90_FUSED_BACKWARD_SOFTCAP, SM90_VARLEN_FUSED_BACKWARD)
    for n_q, n_k, h, kvh, d, causal, per_head in SM90_FP8_FORWARD:
        yield _sm90_fp8_forward(rng, n_q, n_k, h, kvh, d, causal, per_head)
    for n_q, n_k, h, kvh, d, causal, per_head, window, cap in SM90_FP8_FORWARD_SOFTCAP:
        yield _sm90_fp8_forward(rng, n_q, n_k, h, kvh, d, causal, per_head, window, cap)
    for lens_q, lens_k, d, causal, per_head, window, cap in SM90_FP8_VARLEN:
        yield _sm90_fp8_varlen(rng, lens_q, lens_k, d, causal, per_head, window, cap)
    for kind in ("bf16", "f16"):
        yield from _sm90_fused_softcap_varlen(rng, kind, SM90_FUSED_BACKWARD_SOFTCAP_OTHER,
                                              SM90_VARLEN_FUSED_BACKWARD_OTHER)
    for kind in ("bf16", "f16"):  # d256 (the split dK/dV kernel with dQ fused), drawn last as the tables above
        yield from _sm90_fused_softcap_varlen(rng, kind, SM90_FUSED_BACKWARD_D256, SM90_VARLEN_FUSED_BACKWARD_D256)
    for kind in ("bf16", "f16"):
        for causal, (n_q, n_k) in zip((False, True), SM90_FORWARD_D64_LOOP):
            yield _sm90_forward(rng, kind, n_q, n_k, 2, 1, 64, causal)
    for kind in ("bf16", "f16"):  # drawn last, so that every case above keeps its inputs
        yield from _sm90_fused_softcap_varlen(rng, kind, SM90_FUSED_BACKWARD_D96, SM90_VARLEN_FUSED_BACKWARD_D96)
    for kind in ("bf16", "f16"):  # the d96 forward, drawn after all of the above for the same reason
        for n_q, n_k, h, kvh, causal, window, cap in SM90_FORWARD_D96:
            yield _sm90_forward(rng, kind, n_q, n_k, h, kvh, 96, causal, None, window, cap)
        for (lq, lk), h, kvh, causal, window, cap in SM90_VARLEN_D96:
            yield _sm90_varlen(rng, kind, lq, lk, h, kvh, 96, causal, window, cap)
    for kind in ("bf16", "f16"):  # 192 / 128's fused kernels, drawn after those too
        for det in (False, True):
            for n_q, n_k, h, kvh, causal, window in SM90_FUSED_BACKWARD_192:
                yield _sm90_fused_backward(rng, kind, n_q, n_k, h, kvh, 192, causal, window, det, dv=128)
            for (lq, lk), h, kvh, causal, window in SM90_VARLEN_FUSED_BACKWARD_192:
                yield _sm90_varlen_fused_backward(rng, kind, lq, lk, h, kvh, 192, causal, window, 0.0, det, dv=128)
    for kind in ("bf16", "f16"):  # and their _softcap kernels, drawn last so that every case above keeps its inputs
        for det in (False, True):
            for n_q, n_k, h, kvh, causal, window, cap in SM90_FUSED_BACKWARD_192_SOFTCAP:
                yield _sm90_fused_backward(rng, kind, n_q, n_k, h, kvh, 192, causal, window, det, cap, dv=128)
            for (lq, lk), h, kvh, causal, window, cap in SM90_VARLEN_FUSED_BACKWARD_192_SOFTCAP:
                yield _sm90_varlen_fused_backward(rng, kind, lq, lk, h, kvh, 192, causal, window, cap, det, dv=128)
    for kind in ("bf16", "f16"):  # the padded head dims, drawn last so that every case above keeps its inputs
        for n_q, n_k, h, kvh, d, causal, window, cap in SM90_FORWARD_PADDED:
            yield _sm90_forward(rng, kind, n_q, n_k, h, kvh, d, causal, None, window, cap)


def _sm90_fused_softcap_varlen(rng: np.random.Generator, kind: str, dense: Any, varlen: Any) -> Iterator[Case]:
    """The fused backward's dense (softcap) and varlen cases of the given tables, each atomic and deterministic."""
    for n_q, n_k, h, kvh, d, causal, window, cap in dense:
        for det in (False, True):
            yield _sm90_fused_backward(rng, kind, n_q, n_k, h, kvh, d, causal, window, det, cap)
    for (lq, lk), h, kvh, d, causal, window, cap in varlen:
        for det in (False, True):
            yield _sm90_varlen_fused_backward(rng, kind, lq, lk, h, kvh, d, causal, window, cap, det)


# --------------------------------------------------------------------------- flash_attention_varlen_backward

# (kind, query lengths, key lengths, heads, kv_heads, head_dim, causal, window_size, softcap): ragged packed
# sequences with an empty and a length-1 one, n_q != n_k both ways (the causal mask bottom-right per sequence),
# GQA, windows and softcap, on every compiled head_dim (80 runs the d96 kernels, padded) in bf16 and f16; float32
# (the fp32-FMA varlen kernels, any head_dim) last, so that the 16-bit cases keep their inputs: sequences over
# several CTA tiles (64 / 32 / 16 rows at head_dim <= 64 / <= 128 / > 128), a head_dim off every bucket.
VARLEN_BACKWARD = [
    ("bf16", [5, 0, 1, 70], [9, 3, 1, 66], 4, 2, 64, True, (-1, -1), 0.0),
    ("bf16", [17, 40], [40, 17], 2, 1, 64, False, (-1, -1), 2.0),
    ("bf16", [33, 1, 0], [20, 30, 5], 8, 2, 80, False, (6, 6), 0.0),
    ("bf16", [20, 0, 9], [25, 4, 9], 2, 1, 96, True, (10, -1), 1.5),
    ("bf16", [65, 3], [65, 70], 2, 2, 128, True, (-1, -1), 0.0),
    ("bf16", [12, 30], [40, 10], 4, 1, 128, False, (-1, 5), 3.0),
    ("bf16", [40, 1], [37, 2], 2, 1, 256, True, (-1, -1), 0.0),
    ("bf16", [9, 20], [20, 9], 2, 2, 256, False, (4, 4), 2.0),
    ("f16", [1, 70, 0], [1, 66, 7], 4, 1, 64, True, (-1, -1), 0.0),
    ("f16", [30, 7], [12, 7], 2, 2, 64, True, (8, -1), 2.5),
    ("f16", [20, 1], [9, 1], 2, 1, 96, False, (-1, -1), 0.0),
    ("f16", [0, 33], [3, 40], 4, 2, 96, True, (-1, -1), 1.0),
    ("f16", [70, 2], [70, 2], 2, 1, 128, True, (-1, -1), 0.0),
    ("f16", [16, 0, 25], [30, 5, 20], 2, 1, 128, False, (3, 7), 2.0),
    ("f16", [20, 3], [25, 1], 2, 2, 256, True, (-1, -1), 0.0),
    ("f16", [1, 18], [9, 18], 2, 1, 256, True, (5, -1), 1.5),
    ("f32", [5, 0, 1, 70], [9, 3, 1, 66], 4, 2, 64, True, (-1, -1), 0.0),
    ("f32", [17, 40], [40, 17], 2, 1, 96, False, (6, 6), 2.0),
    ("f32", [33, 0, 20], [20, 5, 30], 4, 1, 160, True, (10, -1), 0.0),
    ("f32", [1, 18], [9, 18], 2, 2, 40, False, (-1, 5), 1.5),
]


def varlen_backward_kernels(head_dim: int, softcap: float, kind: str) -> tuple[str, ...]:
    """What flash_attention_varlen_backward launches."""
    from ...ops.attention import tc_head_dim

    d, s, c = tc_head_dim(head_dim), _sfx(kind), "_softcap" if softcap > 0 else ""
    if kind == "f32":  # the fp32-FMA kernels at any head_dim (no dtype suffix)
        return ("attention_bwd_preprocess", f"attention_bwd_varlen_fma_dkdv{c}", f"attention_bwd_varlen_fma_dq{c}")
    kv = ((f"attention_bwd_varlen_tc_dv_d{d}{c}{s}", f"attention_bwd_varlen_tc_dk_d{d}{c}{s}") if d == 256
          else (f"attention_bwd_varlen_tc_dkdv_d{d}{c}{s}",))
    return ("attention_bwd_preprocess" + s,) + kv + (f"attention_bwd_varlen_tc_dq_d{d}{c}{s}",)


def np_varlen_backward(q: Any, k: Any, v: Any, g: Any, cu_q: np.ndarray, cu_k: np.ndarray,
                       **kw: Any) -> tuple[np.ndarray, ...]:
    """(out, lse, dq, dk, dv) in float64, sequence by sequence through the dense references."""
    q64, k64, v64, g64 = f64(q), f64(k), f64(v), f64(g)
    out, lse = np.zeros(q64.shape[:2] + v64.shape[2:]), np.full(q64.shape[:2], -np.inf)  # out: head_dim_v
    dq, dk, dv = np.zeros(q64.shape), np.zeros(k64.shape), np.zeros(v64.shape)
    for b in range(len(cu_q) - 1):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if sq.stop == sq.start:
            continue  # no query: zero gradients for the sequence's keys
        if sk.stop == sk.start:
            out[sq], lse[sq] = 0.0, -np.inf  # no key: out 0, lse -inf, zero dq
            continue
        out[sq], lse[sq] = np_attention_forward(q64[sq], k64[sk], v64[sk], **kw)
        dq[sq], dk[sk], dv[sk] = np_attention_backward(q64[sq], k64[sk], v64[sk], g64[sq], **kw)
    return out, lse, dq, dk, dv


def _attention_varlen_backward_cases(rng: np.random.Generator) -> Iterator[Case]:
    for kind, lq, lk, heads, kvh, hd, causal, win, cap in VARLEN_BACKWARD:
        cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
        q = _normal(rng, (int(cu_q[-1]), heads, hd), kind)
        k = _normal(rng, (int(cu_k[-1]), kvh, hd), kind)
        v = _normal(rng, (int(cu_k[-1]), kvh, hd), kind)
        g = _normal(rng, (int(cu_q[-1]), heads, hd), kind)
        kw = {"causal": causal, "window_size": win, "softcap": cap}
        full = _once(lambda q=q, k=k, v=v, g=g, cu_q=cu_q, cu_k=cu_k, kw=kw:
                     np_varlen_backward(q, k, v, g, cu_q, cu_k, **kw))
        shape = (f"q{','.join(map(str, lq))}k{','.join(map(str, lk))}-h{heads}kv{kvh}-d{hd}"
                 f"{'' if causal else '-full'}-w{win[0]},{win[1]}" + (f"-cap{cap:g}" if cap else ""))

        def run(be, q=q, k=k, v=v, g=g, cu_q=cu_q, cu_k=cu_k, full=full, kind=kind, kw=kw):
            out64, lse64 = full()[:2]
            out, lse = _cast(out64, kind), lse64.astype(np.float32)
            r = _ops().flash_attention_varlen_backward(q, k, v, g, cu_q, cu_k, out=out, lse=lse, backend=be, **kw)
            return {"dq": _np(r[0]), "dk": _np(r[1]), "dv": _np(r[2])}

        yield Case(op="flash_attention_varlen_backward", dtype=kind, shape=shape,
                   kernels=varlen_backward_kernels(hd, cap, kind), run=run,
                   reference=lambda full=full: dict(zip(("dq", "dk", "dv"), full()[2:])))


def _attention_dq_reduce_cases(rng: np.random.Generator) -> Iterator[Case]:
    """attention_bwd_tc_dq_reduce_d96 on its own, in the atomic mode its one caller uses (the sm_90a fused
    backward's d96 accumulator: dq = dtype(scale * acc), the (batch, head, nq_pad, 96) fp32 accumulator read as
    dQ's (batch, query, head, 96)): a portable kernel whose other case is arch-specific, so every backend, and the
    GPU check's sanitizer step, gets a case of it here. Two batches and three heads, so the row's batch and head
    come from the element index; the padded rows hold NaN, which a read of them would carry into dq."""
    import pykern

    b, n_q, h, d, nq_pad, scale = 2, 37, 3, 96, 64, 0.125
    for kind in ("bf16", "f16"):
        acc = rng.standard_normal((b, h, nq_pad, d)).astype(np.float32)
        acc[:, :, n_q:] = np.nan
        name = f"attention_bwd_tc_dq_reduce_d96{_sfx(kind)}"

        def run(backend: str, acc=acc, kind=kind, name=name) -> dict[str, Any]:
            dq = _cast(np.zeros((b, n_q, h, d)), kind)
            pykern.launch(name, max(1, -(-dq.size // 256)), 256, acc, acc, dq.reshape(-1), dq.size, n_q, n_q, h,
                          nq_pad, 0, 0, 0, scale, -1, -1, 0, 1, backend=backend)
            return {"dq": dq}

        def ref(acc=acc) -> dict[str, Any]:
            return {"dq": (acc[:, :, :n_q].astype(np.float64) * scale).transpose(0, 2, 1, 3)}

        yield Case(op="attention_backward", dtype=kind, shape=f"b{b}-q{n_q}-h{h}-d{d}-pad{nq_pad}-dq_reduce",
                   kernels=(name,), run=run, reference=ref)


cases = register_case_groups(
    "attention",
    _fa_cases, _fa_window_cases, _attention_cases, _attention_tc_cases, _attention_window_cases,
    _attention_fused_cases, _attention_pair_cases, _fa_f16_cases, _attention_f16_cases,
    _attention_varlen_backward_cases, _sm90_cases, _attention_dq_reduce_cases,
)
