"""Difftest cases for serving attention (kernels_cu/paged.cu), plus the NumPy float64 references.

Page tables are shuffled (sequences own non-contiguous, out-of-order pages) and every
cache slot that no sequence owns (free pages, slots past kv_last_page_len) holds NaN,
so a kernel that reads outside a sequence fails the comparison.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..case import Case, register_cases

_Q_SUFFIX = {"f32": "", "bf16": "_bf16", "f16": "_f16"}
_SUFFIX = {("f32", "f32"): "", ("bf16", "bf16"): "_bf16", ("f16", "f16"): "_f16", ("f32", "bf16"): "_bf16kv",
           ("f32", "f16"): "_f16kv",
           **{(q, f): f"{_Q_SUFFIX[q]}_{f}kv" for q in _Q_SUFFIX for f in ("e4m3", "e5m2")}}


def _round16(x: np.ndarray, kind: str) -> np.ndarray:
    """x in the 16-bit I/O type of `kind` ("bf16" / "f16"); float32 x for "f32"."""
    from ...arrays import bfloat16

    if kind == "bf16":
        return x.astype(bfloat16())
    return x.astype(np.float16) if kind == "f16" else x
_FP8_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
# Power-of-two FP8 scales: x / scale is exact, so every backend's quantization matches ml_dtypes' bit for bit.
FP8_SCALES = (0.5, 0.25)


# The finite maxima of the two formats (ml_dtypes.finfo's), so the stand-in path below needs no ml_dtypes.
_FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def fp8_dtype(kind: str) -> np.dtype:
    """The ml_dtypes float8 dtype of `kind`. Without ml_dtypes, difftest collects every case with float32
    stand-ins for the 16-bit floats (pykern.difftest.runner): asking `arrays.bfloat16()` first marks this
    case as needing ml_dtypes there, and float32 stands in for the fp8 type too (the case is skipped)."""
    from ...arrays import bfloat16

    if bfloat16() == np.dtype(np.float32):
        return np.dtype(np.float32)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, _FP8_DTYPES[kind]))


def fp8_quantize(x: np.ndarray, kind: str, scale: float) -> np.ndarray:
    """vLLM's fp8(x / scale): round to nearest even, saturated to the finite range, NaN stays NaN."""
    dt = fp8_dtype(kind)
    y = np.asarray(x, np.float32) / np.float32(scale)
    m = _FP8_MAX[kind]
    return np.clip(y, -m, m).astype(dt)


# --------------------------------------------------------------------------- NumPy references
def np_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False,
                 scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of one sequence: q (n, H, D), k (L, KVH, D), v (L, KVH, DV) -> out (n, H, DV), lse (n, H).

    Bottom-right causal: query i sees keys j <= L - n + i. A query that sees no key
    gets 0 and lse -inf. window_size=(left, right) (-1 = unbounded): keys L - n + i - left ..
    L - n + i + right (FlashInfer's window_left is the left side); softcap: c * tanh(x / c)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    n, h, d = q.shape
    length = k.shape[0]
    group = h // k.shape[1]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    out = np.zeros((n, h, v.shape[2]))
    lse = np.full((n, h), -np.inf)
    left, right = window_size
    if causal:
        right = 0
    for i in range(n):
        pos = length - n + i
        lo = 0 if left < 0 else max(0, pos - left)
        hi = length if right < 0 else max(0, min(length, pos + right + 1))
        if hi <= lo:
            continue
        for hh in range(h):
            s = k[lo:hi, hh // group] @ q[i, hh] * scale
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            m = s.max()
            p = np.exp(s - m)
            out[i, hh] = p @ v[lo:hi, hh // group] / p.sum()
            lse[i, hh] = m + np.log(p.sum())
    return out, lse


def np_ragged_attention(q: np.ndarray, qo_indptr: Any, ks: list[np.ndarray], vs: list[np.ndarray],
                        causal: bool = False, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                        softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence np_attention over q rows qo_indptr[b]:qo_indptr[b+1] (total_q, H, D)."""
    outs, lses = [], []
    for b in range(len(ks)):
        o, l_ = np_attention(q[int(qo_indptr[b]):int(qo_indptr[b + 1])], ks[b], vs[b], causal, scale,
                             window_size, softcap)
        outs.append(o)
        lses.append(l_)
    return np.concatenate(outs), np.concatenate(lses)


# --------------------------------------------------------------------------- inputs
def make_paged(rng: np.random.Generator, lens: list[int], page_size: int, num_kv_heads: int, head_dim: int,
               kv_layout: str = "NHD", kind: str = "f32", free_pages: int = 3, raw_bf16: bool = False,
               scales: tuple[float, float] = FP8_SCALES, head_dim_v: int | None = None) -> dict[str, Any]:
    """A shuffled paged cache holding sequences of the given lengths (v_pages with head_dim_v columns, default
    head_dim).

    Returns k_pages, v_pages (NaN outside the sequences), kv_indptr, kv_indices,
    kv_last_page_len (int32), and ks, vs: each sequence's tokens (L, KVH, D) as float64
    of the values stored (bf16-rounded for bf16; for FP8 kinds "e4m3" / "e5m2", fp8(x / scale) * scale
    with scales (k_scale, v_scale)), and ks_raw, vs_raw: the float32 values before FP8 quantization
    (bf16-rounded with raw_bf16)."""
    from ...arrays import bfloat16

    npages = [-(-n // page_size) for n in lens]
    total = sum(npages) + free_pages
    perm = rng.permutation(total).astype(np.int32)
    shape = (total, page_size, num_kv_heads, head_dim)
    dv = head_dim if head_dim_v is None else head_dim_v
    k_pages = np.full(shape, np.nan, np.float32)
    v_pages = np.full(shape[:3] + (dv,), np.nan, np.float32)
    indptr = np.zeros(len(lens) + 1, np.int32)
    indices, last, ks, vs, ks_raw, vs_raw = [], [], [], [], [], []
    at = 0
    for b, n in enumerate(lens):
        pages = perm[at:at + npages[b]]
        at += npages[b]
        indices.extend(int(p) for p in pages)
        indptr[b + 1] = indptr[b] + npages[b]
        last.append(n - (npages[b] - 1) * page_size if n else int(rng.integers(0, page_size + 1)))
        k = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((n, num_kv_heads, dv)).astype(np.float32)
        if kind in ("bf16", "f16") or raw_bf16:  # raw_bf16: the values a bf16 / f16 input holds
            rk = kind if kind in ("bf16", "f16") else ("f16" if raw_bf16 == "f16" else "bf16")
            k = _round16(k, rk).astype(np.float32)
            v = _round16(v, rk).astype(np.float32)
        ks_raw.append(k)
        vs_raw.append(v)
        if kind in _FP8_DTYPES:
            k = fp8_quantize(k, kind, scales[0]).astype(np.float32) * np.float32(scales[0])
            v = fp8_quantize(v, kind, scales[1]).astype(np.float32) * np.float32(scales[1])
        for t in range(n):
            k_pages[pages[t // page_size], t % page_size] = k[t]
            v_pages[pages[t // page_size], t % page_size] = v[t]
        ks.append(k.astype(np.float64))
        vs.append(v.astype(np.float64))
    if kv_layout == "HND":
        k_pages = np.ascontiguousarray(k_pages.transpose(0, 2, 1, 3))
        v_pages = np.ascontiguousarray(v_pages.transpose(0, 2, 1, 3))
    if kind in ("bf16", "f16"):
        k_pages, v_pages = _round16(k_pages, kind), _round16(v_pages, kind)
    elif kind in _FP8_DTYPES:  # exact: the pages hold fp8 values times the scale (NaN stays NaN)
        k_pages = (k_pages / np.float32(scales[0])).astype(fp8_dtype(kind))
        v_pages = (v_pages / np.float32(scales[1])).astype(fp8_dtype(kind))
    return {"k_pages": k_pages, "v_pages": v_pages, "kv_indptr": indptr,
            "kv_indices": np.array(indices, np.int32), "kv_last_page_len": np.array(last, np.int32),
            "ks": ks, "vs": vs, "ks_raw": ks_raw, "vs_raw": vs_raw, "scales": scales}


def make_q(rng: np.random.Generator, shape: tuple[int, ...], kind: str = "f32") -> np.ndarray:
    from ...arrays import bfloat16

    q = rng.standard_normal(shape).astype(np.float32)
    del bfloat16
    return _round16(q, kind)


def _dtype_name(q_kind: str, kv_kind: str) -> str:
    if q_kind == "bf16" or kv_kind == "bf16":
        return "bf16"
    if q_kind == "f16" or kv_kind == "f16":
        return "f16"
    return "fp8" if kv_kind in _FP8_DTYPES else "f32"


# --------------------------------------------------------------------------- cases
def _decode(rng: np.random.Generator, lens: list[int], page_size: int, h: int, kvh: int, d: int, layout: str = "NHD",
            q_kind: str = "f32", kv_kind: str = "f32", num_splits: int | None = None, note: str = "",
            window_left: int = -1, logits_soft_cap: float = 0.0) -> Case:
    from ... import ops

    pc = make_paged(rng, lens, page_size, kvh, d, layout, kv_kind)
    q = make_q(rng, (len(lens), h, d), q_kind)
    suf = _SUFFIX[(q_kind, kv_kind)]
    split = num_splits is not None and num_splits > 1
    kernels = ("paged_attn" + suf,) + (("paged_attn_merge" + _Q_SUFFIX[q_kind],) if split else ())

    def run(backend: str) -> dict[str, Any]:
        plan = ops.PagedDecodePlan(len(lens), h, kvh, d, page_size, kv_layout=layout, q_dtype=q_kind,
                                   kv_dtype=kv_kind, num_splits=num_splits or 1, window_left=window_left,
                                   logits_soft_cap=logits_soft_cap, like=q)
        out, lse = ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                              pc["kv_last_page_len"], kv_layout=layout, return_lse=True, plan=plan,
                                              backend=backend, **_scales(kv_kind, pc))
        return {"out": np.asarray(out, np.float32), "lse": np.asarray(lse)}

    def ref() -> dict[str, Any]:
        out, lse = np_ragged_attention(q.astype(np.float64), np.arange(len(lens) + 1), pc["ks"], pc["vs"],
                                       window_size=(window_left, -1), softcap=logits_soft_cap)
        return {"out": out, "lse": lse}

    win = (f"-wl{window_left}" if window_left >= 0 else "") + (f"-cap{logits_soft_cap:g}" if logits_soft_cap else "")
    return Case(op="paged_decode_attention", dtype=_dtype_name(q_kind, kv_kind),
                shape=f"B{len(lens)}-H{h}-KV{kvh}-D{d}-P{page_size}-{layout}-S{num_splits or 1}-{q_kind}q-{kv_kind}kv"
                      + win,
                kernels=kernels, run=run, reference=ref, note=note)


def _scales(kv_kind: str, pc: dict[str, Any]) -> dict[str, float]:
    return {"k_scale": pc["scales"][0], "v_scale": pc["scales"][1]} if kv_kind in _FP8_DTYPES else {}


def _prefill(rng: np.random.Generator, kv_lens: list[int], qo_lens: list[int], page_size: int, h: int, kvh: int,
             d: int, layout: str = "NHD", kind: str = "f32", causal: bool = True, note: str = "",
             window_left: int = -1, logits_soft_cap: float = 0.0, q_kind: str | None = None) -> Case:
    from ... import ops

    pc = make_paged(rng, kv_lens, page_size, kvh, d, layout, kind)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q_kind = q_kind or kind
    q = make_q(rng, (int(qo_indptr[-1]), h, d), q_kind)

    def run(backend: str) -> dict[str, Any]:
        out, lse = ops.paged_prefill_attention(q, qo_indptr, pc["k_pages"], pc["v_pages"], pc["kv_indptr"],
                                               pc["kv_indices"], pc["kv_last_page_len"], causal=causal,
                                               kv_layout=layout, window_left=window_left,
                                               logits_soft_cap=logits_soft_cap, return_lse=True, backend=backend,
                                               **_scales(kind, pc))
        return {"out": np.asarray(out, np.float32), "lse": np.asarray(lse)}

    def ref() -> dict[str, Any]:
        out, lse = np_ragged_attention(q.astype(np.float64), qo_indptr, pc["ks"], pc["vs"], causal,
                                       window_size=(window_left, -1), softcap=logits_soft_cap)
        return {"out": out, "lse": lse}

    win = (f"-wl{window_left}" if window_left >= 0 else "") + (f"-cap{logits_soft_cap:g}" if logits_soft_cap else "")
    # 16-bit q and cache of one type at head_dim 64 / 128, power-of-two pages: the FlashAttention-2 core
    core = q_kind == kind and kind in ("bf16", "f16") and d in (64, 128) and page_size & (page_size - 1) == 0
    name = (f"paged_prefill_tc_d{d}{'_softcap' if logits_soft_cap else ''}_{kind}" if core
            else "paged_attn" + _SUFFIX[(q_kind, kind)])
    return Case(op="paged_prefill_attention", dtype=_dtype_name(q_kind, kind),
                shape=f"KV{kv_lens}-Q{qo_lens}-H{h}-KV{kvh}-D{d}-P{page_size}-{layout}-c{int(causal)}" + win
                      + (f"-{q_kind}q-{kind}kv" if q_kind != kind else ""),
                kernels=(name,), run=run, reference=ref, note=note)


def _sm90_prefill(rng: np.random.Generator, kv_lens: list[int], qo_lens: list[int], page_size: int, h: int, kvh: int,
                  d: int, layout: str, q_kind: str, kind: str, causal: bool, window_left: int = -1,
                  logits_soft_cap: float = 0.0, d_v: int | None = None) -> Case:
    """paged_prefill_attention's sm_90a kernel (paged_prefill_sm90_*: the TMA + wgmma forward with the paged
    producer) through the op's helper, which must not decline (an arch case, `_sm90.sm90_case`)."""
    from ...ops import _attention_sm90 as sm90
    from ...ops._window import normalize_serving
    from ._sm90 import declined, sm90_case

    dv = d if d_v is None else d_v
    pc = make_paged(rng, kv_lens, page_size, kvh, d, layout, kind, head_dim_v=dv)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = make_q(rng, (int(qo_indptr[-1]), h, d), q_kind)
    name = sm90.paged_kernel_name(d, logits_soft_cap, q_kind, kind, dv)
    ksc, vsc = pc["scales"] if kind in _FP8_DTYPES else (1.0, 1.0)

    def strides_of(n: int) -> tuple[int, int, int]:
        # element strides (page, token, head) of a flat cache of n columns: NHD (pages, page_size, kvh, n), HND
        # (pages, kvh, page_size, n)
        return (page_size * kvh * n, kvh * n, n) if layout == "NHD" else (kvh * page_size * n, n, page_size * n)

    strides = strides_of(d) + (strides_of(dv) if dv != d else ())
    raw = (lambda a: a.view(np.uint8)) if kind in _FP8_DTYPES else (lambda a: a)

    def run(backend: str) -> dict[str, Any]:
        out = np.empty(q.shape[:2] + (dv,), q.dtype)
        lse = np.empty(q.shape[:2], np.float32)
        wl, wr = normalize_serving(window_left, -1, causal)
        table = (pc["kv_indptr"], pc["kv_indices"], pc["kv_last_page_len"])
        if not sm90.try_paged_prefill(q, raw(pc["k_pages"]).reshape(-1), raw(pc["v_pages"]).reshape(-1),
                                      out.reshape(-1), lse.reshape(-1), qo_indptr, table,
                                      (len(kv_lens), max(qo_lens), h, kvh, d, page_size, dv), strides, (q_kind, kind),
                                      ksc / np.sqrt(d), logits_soft_cap, vsc, wl, wr, None, backend):
            raise declined(name, backend)
        return {"out": out.astype(np.float32), "lse": lse}

    def ref() -> dict[str, Any]:
        out, lse = np_ragged_attention(q.astype(np.float64), qo_indptr, pc["ks"], pc["vs"], causal,
                                       window_size=(window_left, -1), softcap=logits_soft_cap)
        return {"out": out, "lse": lse}

    win = (f"-wl{window_left}" if window_left >= 0 else "") + (f"-cap{logits_soft_cap:g}" if logits_soft_cap else "")
    shape = (f"KV{kv_lens}-Q{qo_lens}-H{h}-KV{kvh}-D{d}" + (f"-DV{dv}" if dv != d else "") + f"-P{page_size}-{layout}" + win
             + (f"-{q_kind}q-{kind}kv" if q_kind != kind else "") + ("-causal" if causal else ""))
    return sm90_case("paged_prefill_attention", _dtype_name(q_kind, kind), shape.replace(" ", ""), (name,), run, ref)


def _varlen(rng: np.random.Generator, k_lens: list[int], q_lens: list[int], h: int, kvh: int, d: int,
            q_kind: str = "f32", kv_kind: str = "f32", causal: bool = False, note: str = "",
            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> Case:
    from ... import ops
    from ...arrays import bfloat16

    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q = make_q(rng, (int(cu_q[-1]), h, d), q_kind)
    k = make_q(rng, (int(cu_k[-1]), kvh, d), kv_kind)
    v = make_q(rng, (int(cu_k[-1]), kvh, d), kv_kind)
    del bfloat16

    def run(backend: str) -> dict[str, Any]:
        out, lse = ops.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=window_size,
                                              softcap=softcap, return_lse=True, backend=backend)
        return {"out": np.asarray(out, np.float32), "lse": np.asarray(lse)}

    def ref() -> dict[str, Any]:
        kf, vf = k.astype(np.float64), v.astype(np.float64)
        ks = [kf[cu_k[b]:cu_k[b + 1]] for b in range(len(k_lens))]
        vs = [vf[cu_k[b]:cu_k[b + 1]] for b in range(len(k_lens))]
        out, lse = np_ragged_attention(q.astype(np.float64), cu_q, ks, vs, causal, window_size=window_size,
                                       softcap=softcap)
        return {"out": out, "lse": lse}

    win = (f"-w{window_size[0]},{window_size[1]}" if window_size != (-1, -1) else "") + (
        f"-cap{softcap:g}" if softcap else "")
    core = q_kind == kv_kind and kv_kind in ("bf16", "f16") and d in (64, 128)  # the FlashAttention-2 core
    name = (f"attention_fwd_varlen_tc_d{d}{'_softcap' if softcap else ''}_{kv_kind}" if core
            else "dense_attn" + _SUFFIX[(q_kind, kv_kind)])
    return Case(op="flash_attention_varlen", dtype=_dtype_name(q_kind, kv_kind),
                shape=f"K{k_lens}-Q{q_lens}-H{h}-KV{kvh}-D{d}-c{int(causal)}-{q_kind}q-{kv_kind}kv" + win,
                kernels=(name,), run=run, reference=ref, note=note)


def _append(rng: np.random.Generator, old_lens: list[int], new_lens: list[int], page_size: int, kvh: int, d: int,
            layout: str = "NHD", kind: str = "f32", in_kind: str | None = None, combined: bool = False) -> Case:
    """Append the last new_lens tokens of each sequence into its blanked slots. FP8 pages take f32 or bf16
    (in_kind) inputs quantized by the kernel; the expected pages are make_paged's (ml_dtypes'). combined:
    the pages live in FlashInfer's one (pages, 2, ...) array, written through its [:, 0] / [:, 1] views."""
    from ... import ops
    from ...arrays import bfloat16

    in_kind = in_kind or kind
    fp8 = kind in _FP8_DTYPES
    final = [o + n for o, n in zip(old_lens, new_lens)]
    pc = make_paged(rng, final, page_size, kvh, d, layout, kind,
                    raw_bf16=in_kind if in_kind in ("bf16", "f16") else False)
    app_ptr = np.concatenate([[0], np.cumsum(new_lens)])
    bi, pos = ops.get_batch_indices_positions(app_ptr, final, int(app_ptr[-1]))
    src_k, src_v = (pc["ks_raw"], pc["vs_raw"]) if fp8 else (pc["ks"], pc["vs"])
    k_new = np.concatenate([src_k[b][o:] for b, o in enumerate(old_lens)]).astype(np.float32)
    v_new = np.concatenate([src_v[b][o:] for b, o in enumerate(old_lens)]).astype(np.float32)
    del bfloat16
    k_new, v_new = _round16(k_new, in_kind), _round16(v_new, in_kind)

    def pages_view(p: np.ndarray) -> np.ndarray:
        return p if layout == "NHD" else p.transpose(0, 2, 1, 3)

    def as_f32(p: np.ndarray) -> np.ndarray:
        return np.nan_to_num(np.asarray(p).astype(np.float32), nan=7.0)

    def run(backend: str) -> dict[str, Any]:
        kp, vp = pc["k_pages"].copy(), pc["v_pages"].copy()
        nhd_k, nhd_v = pages_view(kp), pages_view(vp)
        # Blank the slots the append must fill (they held the final values).
        for b, o in enumerate(old_lens):
            for t in range(o, final[b]):
                pg = pc["kv_indices"][pc["kv_indptr"][b] + t // page_size]
                nhd_k[pg, t % page_size] = 0
                nhd_v[pg, t % page_size] = 0
        if combined:
            cache = np.stack([kp, vp], axis=1)
            kp, vp = cache[:, 0], cache[:, 1]
        ops.append_paged_kv_cache(k_new, v_new, bi, pos, kp, vp, pc["kv_indices"], pc["kv_indptr"],
                                  pc["kv_last_page_len"], kv_layout=layout, backend=backend, **_scales(kind, pc))
        return {"k": as_f32(kp), "v": as_f32(vp)}

    def ref() -> dict[str, Any]:
        return {"k": as_f32(pc["k_pages"]).astype(np.float64), "v": as_f32(pc["v_pages"]).astype(np.float64)}

    if fp8:
        name = "paged_append_kv" + _Q_SUFFIX.get(in_kind, "") + "_" + kind
    else:
        name = "paged_append_kv" + _Q_SUFFIX[kind]
    return Case(op="append_paged_kv_cache", dtype="fp8" if fp8 else kind,
                shape=f"old{old_lens}-new{new_lens}-P{page_size}-KV{kvh}-D{d}-{layout}"
                      + (f"-{in_kind}in-{kind}" if in_kind != kind or fp8 else "") + ("-combined" if combined else ""),
                kernels=(name,), run=run, reference=ref)


def _batch_positions(app_lens: list[int], seq_lens: list[int], pad: int) -> Case:
    """The device form of get_batch_indices_positions (paged_batch_indices_positions, launched directly: the op
    computes host arrays on the host): nnz = the appended tokens + pad; uncovered tokens and negative
    positions are (-1, -1)."""
    from ...launcher import launch

    ip = np.concatenate([[0], np.cumsum(app_lens)]).astype(np.int32)
    sl = np.array(seq_lens, np.int32)
    nnz = int(ip[-1]) + pad

    def run(backend: str) -> dict[str, Any]:
        bi, pos = np.empty(nnz, np.int32), np.empty(nnz, np.int32)
        launch("paged_batch_indices_positions", (-(-nnz // 128),), (128,), ip, sl, bi, pos, len(app_lens), nnz,
               backend=backend)
        return {"batch_indices": bi, "positions": pos}

    def ref() -> dict[str, Any]:
        bi, pos = np.full(nnz, -1.0), np.full(nnz, -1.0)
        for b, n in enumerate(app_lens):
            for j in range(n):
                p = seq_lens[b] - n + j
                if p >= 0:
                    bi[ip[b] + j], pos[ip[b] + j] = b, p
        return {"batch_indices": bi, "positions": pos}

    return Case(op="get_batch_indices_positions", dtype="int32",
                shape=f"app{app_lens}-lens{seq_lens}-pad{pad}", kernels=("paged_batch_indices_positions",), run=run,
                reference=ref)


@register_cases("serving")
def cases(rng: np.random.Generator) -> Iterator[Case]:
    # decode: page sizes 1, 16 and 5; GQA 1/2/4/8; empty sequences; NHD and HND; splits.
    for ps, layout in ((1, "NHD"), (16, "HND"), (5, "NHD"), (5, "HND")):
        yield _decode(rng, [7, 0, 13], ps, 4, 2, 32, layout)
    for h, kvh in ((2, 2), (4, 2), (8, 2), (8, 1)):
        yield _decode(rng, [9, 20], 5, h, kvh, 64)
    yield _decode(rng, [37, 0, 5, 16], 16, 8, 2, 64, num_splits=3)
    yield _decode(rng, [30, 11], 5, 4, 1, 80, "HND", num_splits=4)
    for qk, kk in (("bf16", "bf16"), ("f32", "bf16")):
        yield _decode(rng, [21, 3], 16, 4, 2, 64, q_kind=qk, kv_kind=kk)
        yield _decode(rng, [21, 0, 40], 5, 8, 1, 96, "HND", q_kind=qk, kv_kind=kk, num_splits=2)
    yield _decode(rng, [70], 16, 8, 1, 256, note="big")
    # paged prefill (chunked / append) and varlen.
    yield _prefill(rng, [9, 0, 17], [3, 0, 17], 5, 4, 2, 32)
    yield _prefill(rng, [20, 6], [4, 6], 16, 2, 1, 64, "HND", causal=False)
    # sliding windows (FlashInfer's window_left on the paged ops, flash-attn's window_size on varlen) and softcap
    yield _decode(rng, [90, 3, 0, 40], 16, 8, 2, 64, window_left=20)
    yield _decode(rng, [150, 33], 5, 4, 1, 32, "HND", num_splits=3, window_left=0, logits_soft_cap=2.0)
    yield _decode(rng, [100, 9], 16, 4, 2, 64, q_kind="bf16", kv_kind="bf16", num_splits=2, window_left=50,
                  logits_soft_cap=5.0)
    yield _prefill(rng, [90, 0, 40], [30, 0, 40], 16, 4, 2, 32, window_left=15)
    yield _prefill(rng, [70, 20], [10, 20], 5, 2, 1, 64, "HND", causal=False, window_left=8, logits_soft_cap=3.0)
    yield _prefill(rng, [60], [60], 16, 4, 4, 64, kind="bf16", window_left=10, logits_soft_cap=1.5)
    yield _varlen(rng, [80, 30, 50], [80, 40, 10], 4, 2, 32, causal=True, window_size=(12, -1))
    yield _varlen(rng, [60, 25], [20, 25], 2, 1, 64, window_size=(5, 7), softcap=4.0)
    yield _varlen(rng, [70], [90], 4, 4, 48, q_kind="bf16", kv_kind="bf16", window_size=(-1, 3))
    yield _prefill(rng, [12, 7], [5, 7], 1, 4, 4, 48, kind="bf16")
    yield _varlen(rng, [10, 0, 23], [4, 0, 23], 4, 2, 32, causal=True)
    yield _varlen(rng, [8, 19], [8, 3], 2, 1, 64)
    yield _varlen(rng, [15, 5], [7, 5], 4, 2, 64, "bf16", "bf16", causal=True)
    yield _varlen(rng, [15], [6], 2, 2, 40, "f32", "bf16", causal=True)
    # the FlashAttention-2 core's varlen / paged kernels (bf16, head_dim 64 / 128, softcap or not)
    yield _varlen(rng, [150, 3], [140, 70], 4, 2, 128, "bf16", "bf16", causal=True)
    yield _varlen(rng, [70, 20], [200, 20], 2, 1, 64, "bf16", "bf16", window_size=(30, -1), softcap=2.0)
    yield _varlen(rng, [40], [90], 2, 2, 128, "bf16", "bf16", softcap=3.0)
    yield _prefill(rng, [200, 9], [140, 9], 16, 4, 2, 128, kind="bf16")
    yield _prefill(rng, [130], [130], 32, 2, 2, 128, "HND", kind="bf16", logits_soft_cap=2.0)
    yield _prefill(rng, [90, 5], [70, 5], 8, 4, 1, 64, kind="bf16")
    # the device form of get_batch_indices_positions: empty sequences, short lengths, padding past the indptr
    yield _batch_positions([2, 0, 3, 130], [2, 9, 1, 200], 3)
    yield _batch_positions([1], [5], 0)
    # append.
    yield _append(rng, [3, 0, 16], [1, 5, 2], 5, 2, 32)
    yield _append(rng, [4, 9], [1, 1], 16, 2, 64, "HND", "bf16")
    # FlashInfer's combined (pages, 2, ...) cache, written through its views
    yield _append(rng, [2, 7], [3, 1], 4, 2, 32, "NHD", combined=True)
    yield _append(rng, [5, 0], [1, 6], 4, 2, 48, "HND", "bf16", combined=True)
    # FP8 KV caches: append quantizes (f32 and bf16 inputs), attention dequantizes in registers
    for fk in ("e4m3", "e5m2"):
        yield _append(rng, [3, 0, 10], [2, 5, 1], 5, 2, 32, "NHD", fk)
        yield _append(rng, [4, 9], [1, 3], 16, 2, 40, "HND", fk, in_kind="bf16", combined=True)
        yield _decode(rng, [37, 0, 5], 16, 8, 2, 64, kv_kind=fk)
        yield _decode(rng, [30, 11], 5, 4, 1, 48, "HND", q_kind="bf16", kv_kind=fk, num_splits=3)
        yield _prefill(rng, [20, 9], [6, 9], 5, 4, 2, 32, kind=fk, q_kind="f32")
        yield _prefill(rng, [12], [12], 16, 2, 1, 16, "HND", kind=fk, q_kind="bf16", window_left=4)
    # float16: every family's f16 instantiation (f16 q over f16, FP8 caches; f32 q over an f16 cache)
    yield _decode(rng, [21, 3], 16, 4, 2, 64, q_kind="f16", kv_kind="f16")
    yield _decode(rng, [21, 0, 40], 5, 8, 1, 96, "HND", q_kind="f16", kv_kind="f16", num_splits=2, window_left=30,
                  logits_soft_cap=5.0)
    yield _decode(rng, [33, 7], 16, 4, 2, 64, q_kind="f32", kv_kind="f16", num_splits=2)
    yield _decode(rng, [30, 11], 5, 4, 1, 48, "HND", q_kind="f16", kv_kind="e4m3", num_splits=3)
    yield _prefill(rng, [20, 9], [6, 9], 5, 4, 2, 32, kind="f16", window_left=6)
    yield _prefill(rng, [12], [12], 16, 2, 1, 16, "HND", kind="e5m2", q_kind="f16")
    yield _varlen(rng, [15, 5], [7, 5], 4, 2, 64, "f16", "f16", causal=True)
    yield _varlen(rng, [15, 5], [7, 5], 4, 2, 32, "f16", "f16", causal=True)
    # the FlashAttention-2 core's f16 varlen / paged kernels (head_dim 64 / 128, softcap or not)
    yield _varlen(rng, [70, 20], [100, 20], 2, 1, 64, "f16", "f16", window_size=(30, -1), softcap=2.0)
    yield _varlen(rng, [90, 3], [60, 3], 2, 1, 128, "f16", "f16", causal=True)
    yield _varlen(rng, [40], [70], 2, 2, 128, "f16", "f16", softcap=3.0)
    yield _prefill(rng, [90, 5], [70, 5], 8, 4, 1, 64, kind="f16")
    yield _prefill(rng, [60], [60], 16, 2, 2, 64, "HND", kind="f16", window_left=10, logits_soft_cap=1.5)
    yield _prefill(rng, [130, 9], [100, 9], 16, 2, 1, 128, kind="f16")
    yield _prefill(rng, [80], [80], 32, 2, 2, 128, "HND", kind="f16", logits_soft_cap=2.0)
    yield _varlen(rng, [15], [6], 2, 2, 40, "f32", "f16", causal=True, softcap=3.0)
    yield _append(rng, [4, 9], [1, 1], 16, 2, 64, "HND", "f16")
    yield _append(rng, [3, 0, 10], [2, 5, 1], 5, 2, 32, "NHD", "e4m3", in_kind="f16", combined=True)
    yield _append(rng, [4, 9], [1, 3], 16, 2, 40, "HND", "e5m2", in_kind="f16")
    # paged_prefill_attention on sm_90a (paged_prefill_sm90_*): every kernel causal and not; page sizes that divide
    # the key tile, exceed it and divide nothing (the producer's gather takes any); ragged lengths, a sequence
    # without keys, GQA, NHD and HND, windows; FP8 caches widened by the producer, with their k / v scales
    shapes = (([150, 20], [130, 20], 16, 4, 1, "NHD", -1), ([90, 0, 40], [70, 3, 40], 3, 2, 2, "HND", 30),
              ([260], [129], 256, 2, 1, "NHD", -1))
    i = 0
    for qk in ("bf16", "f16"):
        for kk in (qk, "e4m3", "e5m2"):
            for d in (64, 128):
                for cap in (0.0, 20.0):
                    for causal in (True, False):
                        kv, qo, ps, h, kvh, layout, wl = shapes[i % len(shapes)]
                        i += 1
                        yield _sm90_prefill(rng, kv, qo, ps, h, kvh, d, layout, qk, kk, causal, wl, cap)
    # DeepSeek-V3's 192 / 128 (V pages of 128 columns with strides of their own): every kernel causal and not
    shapes = (([100, 9], [70, 9], 16, 2, 1, "NHD", -1), ([60, 0, 30], [40, 2, 30], 3, 2, 2, "HND", 20),
              ([140], [129], 256, 2, 1, "NHD", -1))
    i = 0
    for qk in ("bf16", "f16"):
        for kk in (qk, "e4m3", "e5m2"):
            for d, dv in ((192, 128),):
                for cap in (0.0, 20.0):
                    for causal in (True, False):
                        kv, qo, ps, h, kvh, layout, wl = shapes[i % len(shapes)]
                        i += 1
                        yield _sm90_prefill(rng, kv, qo, ps, h, kvh, d, layout, qk, kk, causal, wl, cap, dv)
    # head_dim 256: every kernel causal and not, two small shapes (one query tile, two key tiles or fewer); 16-bit
    # caches, then FP8 ones (their bytes staged in shared memory, then widened: fa90_gather_rows_staged), each with a
    # generator of its own, so that the cases after keep their data
    shapes = (([90, 9], [70, 9], 16, 2, 1, "NHD", -1), ([70], [40], 3, 1, 1, "HND", 20))
    for seed, fp8 in ((256, False), (2568, True)):
        r256, i = np.random.default_rng(seed), 0
        for qk in ("bf16", "f16"):
            for kk in (("e4m3", "e5m2") if fp8 else (qk,)):
                for cap in (0.0, 20.0):
                    for causal in (True, False):
                        kv, qo, ps, h, kvh, layout, wl = shapes[i % len(shapes)]
                        i += 1
                        yield _sm90_prefill(r256, kv, qo, ps, h, kvh, 256, layout, qk, kk, causal, wl, cap)
    # head_dim 96 (the gather writes PkAttnBox<96>'s 32-column, 64B-swizzled boxes): every kernel causal and not, with
    # a generator of its own; a page that divides the key tile (16), one that divides nothing (3) and one longer than
    # it (256); GQA, ragged lengths, a sequence without keys, a window; caches of the query's type and FP8
    shapes = (([150, 9], [100, 9], 16, 4, 1, "NHD", -1), ([90, 0, 40], [70, 3, 40], 3, 2, 2, "HND", 30),
              ([200], [60], 256, 2, 1, "NHD", -1))
    r96, i = np.random.default_rng(96), 0
    for qk in ("bf16", "f16"):
        for kk in (qk, "e4m3", "e5m2"):
            for cap in (0.0, 20.0):
                for causal in (True, False):
                    kv, qo, ps, h, kvh, layout, wl = shapes[i % len(shapes)]
                    i += 1
                    yield _sm90_prefill(r96, kv, qo, ps, h, kvh, 96, layout, qk, kk, causal, wl, cap)
