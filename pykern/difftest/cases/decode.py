"""Difftest cases for decode attention (dense_attn in kernels_cu/paged.cu), plus the NumPy float64 reference.

Every cache slot at or past a sequence's length holds NaN, so a kernel that reads
(or multiplies a zero probability by) a slot past the end fails the comparison.
The decode shape list (seq_len, head_dim, GQA ratio, batch) is covered value by value, not as a cross product: a
seq_len sweep at one head config, a head_dim sweep at one seq_len, a GQA sweep at a
small seq_len, and batches of mixed lengths. seq_len 4097 and head_dim 256 cases
carry note="big" (host vs NumPy only).
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..case import Case, register_cases

METHODS = ("warp", "multi_warp", "split_k")
_SUFFIX = {("f32", "f32"): "", ("bf16", "bf16"): "_bf16", ("f32", "bf16"): "_bf16kv", ("f16", "f16"): "_f16",
           ("f32", "f16"): "_f16kv"}


def np_decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_len: int,
                        scale: float | None = None) -> np.ndarray:
    """float64 reference for one sequence: q (H, D), caches (KVH, S, D); zeros when seq_len is 0."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    num_heads, head_dim = q.shape
    group = num_heads // k.shape[0]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else float(scale)
    out = np.zeros((num_heads, head_dim), np.float64)
    if seq_len == 0:
        return out
    for h in range(num_heads):
        kk = k[h // group, :seq_len]
        vv = v[h // group, :seq_len]
        s = kk @ q[h] * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vv
    return out


def np_batched_decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_lens: Any,
                                scale: float | None = None) -> np.ndarray:
    """float64 reference for a batch: q (M, H, D), caches (M, KVH, S, D)."""
    return np.stack([np_decode_attention(q[i], k[i], v[i], int(seq_lens[i]), scale) for i in range(q.shape[0])])


def make_inputs(rng: np.random.Generator, batch: int | None, num_heads: int, num_kv_heads: int, head_dim: int,
                max_seq_len: int, seq_lens: Any, q_kind: str = "f32", kv_kind: str = "f32"
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random q and caches with NaN in every slot past each sequence's length.

    batch None gives the single-sequence shapes (H, D) and (KVH, S, D)."""
    from ...arrays import bfloat16

    m = 1 if batch is None else batch
    lens = [int(seq_lens)] if batch is None else [int(s) for s in seq_lens]
    q = rng.standard_normal((m, num_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((m, num_kv_heads, max_seq_len, head_dim)).astype(np.float32)
    v = rng.standard_normal((m, num_kv_heads, max_seq_len, head_dim)).astype(np.float32)
    for i, s in enumerate(lens):
        k[i, :, s:] = np.nan
        v[i, :, s:] = np.nan
    if q_kind == "bf16":
        q = q.astype(bfloat16())
    if kv_kind == "bf16":
        k, v = k.astype(bfloat16()), v.astype(bfloat16())
    if q_kind == "f16":
        q = q.astype(np.float16)
    if kv_kind == "f16":
        k, v = k.astype(np.float16), v.astype(np.float16)
    if batch is None:
        return q[0], k[0], v[0]
    return q, k, v


def kernels_of(method: str, q_kind: str, kv_kind: str, split: bool = True) -> tuple[str, ...]:
    """Kernels a call launches: the tile kernel, plus the merge when the cache is split."""
    suf = _SUFFIX[(q_kind, kv_kind)]
    if method == "warp" or not split:
        return (f"dense_attn{suf}",)
    return (f"dense_attn{suf}", "paged_attn_merge" + {"f32": "", "bf16": "_bf16", "f16": "_f16"}[q_kind])


def _dtype_name(q_kind: str, kv_kind: str) -> str:
    # The tolerance follows the least precise I/O: bf16 caches make it a bf16 case, f16 ones an f16 case.
    return "bf16" if "bf16" in (q_kind, kv_kind) else ("f16" if "f16" in (q_kind, kv_kind) else "f32")


def to_nhd(cache: np.ndarray) -> np.ndarray:
    """An "HND" cache ((..., KVH, S, D)) as the same tokens in "NHD" order ((..., S, KVH, D))."""
    return np.ascontiguousarray(np.swapaxes(cache, -3, -2))


def _kernels(method: str, batch: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
             seq_hint: int | None, q_kind: str, kv_kind: str, **kw: Any) -> tuple[str, ...]:
    from ...ops.decode import decode_plan

    plan = decode_plan(batch, num_heads, num_kv_heads, head_dim, max_seq_len, method=method, seq_hint=seq_hint, **kw)
    return kernels_of(method, q_kind, kv_kind, split=len(plan["launches"]) > 1)


def _single(rng: np.random.Generator, method: str, num_heads: int, num_kv_heads: int, head_dim: int,
            max_seq_len: int, seq_len: int, q_kind: str = "f32", kv_kind: str = "f32", note: str = "",
            indirect: bool = False, kv_layout: str = "HND", **kw: Any) -> Case:
    from ... import ops

    q, k, v = make_inputs(rng, None, num_heads, num_kv_heads, head_dim, max_seq_len, seq_len, q_kind, kv_kind)
    kk, vv = (k, v) if kv_layout == "HND" else (to_nhd(k), to_nhd(v))
    sl: Any = np.array([seq_len], np.uint32) if indirect else seq_len
    tag = f"{'ind' if indirect else 'int'}-{q_kind}q-{kv_kind}kv-{kv_layout}"
    return Case(
        op="decode_attention", dtype=_dtype_name(q_kind, kv_kind),
        shape=f"{method}-H{num_heads}-KV{num_kv_heads}-D{head_dim}-S{max_seq_len}-L{seq_len}-{tag}",
        kernels=_kernels(method, 1, num_heads, num_kv_heads, head_dim, max_seq_len, None if indirect else seq_len,
                         q_kind, kv_kind, **kw),
        run=lambda backend: {"out": np.asarray(ops.decode_attention(q, kk, vv, sl, method=method, backend=backend,
                                                                    kv_layout=kv_layout, **kw), np.float32)},
        reference=lambda: {"out": np_decode_attention(q.astype(np.float64), k.astype(np.float64),
                                                      v.astype(np.float64), seq_len)},
        note=note,
    )


def _batched(rng: np.random.Generator, method: str, num_heads: int, num_kv_heads: int, head_dim: int,
             max_seq_len: int, seq_lens: list[int], q_kind: str = "f32", kv_kind: str = "f32",
             note: str = "", as_list: bool = False, kv_layout: str = "HND") -> Case:
    from ... import ops

    m = len(seq_lens)
    q, k, v = make_inputs(rng, m, num_heads, num_kv_heads, head_dim, max_seq_len, seq_lens, q_kind, kv_kind)
    lens = np.array(seq_lens, np.uint32)
    kl, vl = (k, v) if kv_layout == "HND" else (to_nhd(k), to_nhd(v))
    kc: Any = list(kl) if as_list else kl
    vc: Any = list(vl) if as_list else vl
    return Case(
        op="batched_decode_attention", dtype=_dtype_name(q_kind, kv_kind),
        shape=f"{method}-M{m}-H{num_heads}-KV{num_kv_heads}-D{head_dim}-S{max_seq_len}-{q_kind}q-{kv_kind}kv"
              + ("-list" if as_list else "") + f"-{kv_layout}",
        kernels=_kernels(method, m, num_heads, num_kv_heads, head_dim, max_seq_len, None, q_kind, kv_kind),
        run=lambda backend: {"out": np.asarray(ops.batched_decode_attention(q, kc, vc, lens, method=method,
                                                                            kv_layout=kv_layout,
                                                                            backend=backend), np.float32)},
        reference=lambda: {"out": np_batched_decode_attention(q.astype(np.float64), k.astype(np.float64),
                                                              v.astype(np.float64), seq_lens)},
        note=note,
    )


@register_cases("decode")
def cases(rng: np.random.Generator) -> Iterator[Case]:
    for method in METHODS:
        # seq_len sweep at one small head config (GQA 2).
        for sl in (0, 1, 31, 32, 33, 127, 128, 129, 1000):
            yield _single(rng, method, 4, 2, 64, max(sl, 1) + 3, sl, indirect=(sl % 2 == 1))
        yield _single(rng, method, 2, 1, 64, 4100, 4097, note="big")
        # head_dim sweep (not multiples of 32 and unaligned vector widths included).
        for d in (32, 80, 96, 128, 33):
            yield _single(rng, method, 2, 1, d, 70, 65)
        yield _single(rng, method, 2, 1, 256, 70, 65, note="big")
        # GQA ratios 1/2/4/8 and a single kv head.
        for h, kvh in ((4, 4), (4, 2), (8, 2), (8, 1), (3, 1)):
            yield _single(rng, method, h, kvh, 64, 40, 37)
        # dtypes: bf16 everywhere, and f32 q over a bf16 cache.
        for qk, kk in (("bf16", "bf16"), ("f32", "bf16")):
            yield _single(rng, method, 4, 2, 96, 140, 129, q_kind=qk, kv_kind=kk)
            yield _single(rng, method, 4, 1, 80, 40, 33, q_kind=qk, kv_kind=kk, indirect=True)
        # float16: f16 everywhere, and f32 q over an f16 cache.
        for qk, kk in (("f16", "f16"), ("f32", "f16")):
            yield _single(rng, method, 4, 2, 96, 140, 129, q_kind=qk, kv_kind=kk, indirect=qk == "f32")
        yield _batched(rng, method, 4, 1, 64, 40, [33, 0, 7], q_kind="f16", kv_kind="f16", kv_layout="NHD")
        # batches of mixed lengths (0 included).
        yield _batched(rng, method, 4, 2, 64, 50, [33])
        yield _batched(rng, method, 4, 2, 64, 50, [0, 50, 17], as_list=True)
        yield _batched(rng, method, 2, 1, 32, 40, [int(x) for x in rng.integers(0, 41, 17)])
        yield _batched(rng, method, 4, 2, 96, 70, [65, 0, 1], q_kind="bf16", kv_kind="bf16")
        # kv_layout "NHD" ((S, KVH, D) per sequence), GQA 4 and 8.
        yield _single(rng, method, 8, 2, 64, 300, 290, kv_layout="NHD")
        yield _batched(rng, method, 8, 1, 32, 45, [44, 0, 9], kv_layout="NHD")
        yield _batched(rng, method, 4, 1, 64, 40, [33, 7], q_kind="bf16", kv_kind="bf16", kv_layout="NHD")
    # non-default geometry knobs.
    yield _single(rng, "multi_warp", 4, 2, 64, 300, 257, num_warps=3)
    yield _single(rng, "split_k", 4, 2, 64, 300, 257, chunk_size=37)
    yield _single(rng, "split_k", 4, 2, 64, 300, 0, chunk_size=32, indirect=True)
