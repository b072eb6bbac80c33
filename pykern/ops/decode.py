"""Decode attention over a KV cache: one new query token per sequence.

Kernels: `dense_attn*` and `paged_attn_merge*` in `kernels_cu/paged.cu` (the tile core of
`kernels_cu/pk_attn_tile.cuh`, shared with the paged serving ops). Every method reads the sequence length from a
uint32 device buffer and clamps it to max_seq_len, so an int `seq_len` is wrapped
into a one-element array and both forms run the same kernel with the same launch
geometry (the geometry depends on shapes only, never on the seq_len value), which
makes them agree bit for bit and lets the array form be captured in a CUDA graph.

Every method shares K/V across the GQA group: one CTA (4 warps) handles a (sequence, kv
head) and all query heads of its group (up to 2048 // head_dim of them: a larger group
takes ceil(group / rows) CTAs, each reading the K/V again). Each K/V tile is loaded from
memory and converted to fp32 once, into shared memory, and serves every head of the group.

Caches: kv_layout="NHD" (default, as every paged op and FlashInfer's single-request decode):
(max_seq_len, num_kv_heads, head_dim) per sequence, the model's natural (token, head, dim) order;
kv_layout="HND": (num_kv_heads, max_seq_len, head_dim) per sequence (transformers' KV cache order).
The default was "HND" before: a caller with an HND cache passes kv_layout="HND".

Methods:
  "warp"        one CTA per (sequence, kv head) over the whole cache (one launch).
  "multi_warp"  the cache split evenly `num_warps` ways, one CTA a part, merged by a
                second launch (log-sum-exp merge of normalized partials); one part is "warp".
  "split_k"     flash decoding: parts of `chunk_size` positions, the same merge (two
                launches; one when a single chunk covers the cache).
  "auto"        "warp" when the CTAs of one launch fill the GPU (batch * num_kv_heads
                * row chunks >= 132, an H100's SMs) or L <= 256 (L = the int seq_len, or
                max_seq_len for an array); else "split_k" with about two waves of CTAs.
                (From the launch shapes and an H100 model, not yet timed on a GPU.)

Tensor cores: with method="auto" (the default), bf16 q over bf16 caches or f16 over f16, 1..16 query heads
a kv head, head_dim 64 / 128 and no softcap (serving.tc_decode_eligible) run the tensor-core paged decode
kernel (kernels_cu/decode_tc.cu) instead, the dense cache seen as a paged cache of one page a sequence
(page_size = max_seq_len, kv_indptr = 0..M, kv_indices = 0..M-1, kv_last_page_len = the lengths as int32,
page stride = sequence stride), with PagedDecodePlan's split count for max_kv_len = max_seq_len (shapes
only, so the int and array forms still agree bit for bit). It also needs K/V strides of whole 16-byte
chunks and 16-byte aligned bases, q's and out's too (serving.tc_decode_addressable); otherwise, with an
explicit method, or with tensor_cores=False, the tile kernels above run.

Copies: the caches are read in place through their element strides (a slice of a preallocated buffer, an
NHD / HND view) by every kernel; they are copied (both made contiguous) only when the kernels cannot
address them: head_dim not unit-stride, a negative stride, or K and V with different strides. q is made
contiguous (copied only if it is not), the lengths converted to the kernel's integer type on their device.
out= must be C-contiguous and is written in place; anything else raises naming `out`.

seq_len 0 yields zeros. Output dtype is q's dtype. Supported (q, cache) dtypes:
(f32, f32), (bf16, bf16), (f16, f16), (f32, bf16), (f32, f16); accumulation is fp32.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from .. import arrays
from ._window import (
    check_softcap as _check_softcap,
    check_window_left as _check_window_left,
    normalize_serving as _normalize_serving,
)
from ..errors import ArgumentError, ArgumentTypeError
from ._common import attention_scale as _check_scale, check_enable_pdl as _check_enable_pdl
from ._common import int_in_range as _check_int
from ..arrays import flat_view as _flat

__all__ = ["decode_attention", "batched_decode_attention", "decode_plan"]

METHODS = ("auto", "warp", "multi_warp", "split_k")
MAX_HEAD_DIM = 256
_GRID_YZ_MAX = 65535
# Kernels index positions in int and step a few hundred past the end before the
# loop test; 2**30 leaves that headroom (cache offsets themselves are 64-bit).
_MAX_SEQ = 2**30
# split_k: aim for about two waves of CTAs on an H100 (132 SMs), chunks of >= 64 positions.
_SMS = 132
_SPLIT_TARGET_CTAS = 2 * _SMS
_SPLIT_MIN_CHUNK = 64
_AUTO_SHORT = 256
# multi_warp: parts of the cache (the name is historical: it used to be warps a head).
_MAX_WARPS = 16
_NT = 128  # threads a CTA (PA_NT in kernels_cu/paged.cu)
LAYOUTS = ("HND", "NHD")


def _suffix(q_kind: str, kv_kind: str) -> str:
    # dense_attn's instantiations (kernels_cu/paged.cu): same type, or f32 q over a 16-bit cache.
    if q_kind == kv_kind:
        return arrays.kernel_suffix(q_kind)
    if q_kind == "f32":
        return arrays.kernel_suffix(kv_kind) + "kv"
    qn, kn = arrays.IO_DTYPES[q_kind], arrays.IO_DTYPES[kv_kind]
    raise ArgumentTypeError(f"q: a {qn} query needs {qn} caches (expected q float32 for {kn} caches), "
                            f"got q {qn} with {kn} caches")


def _default_warps(max_seq_len: int) -> int:
    return int(min(8, max(1, max_seq_len // 128)))


def _default_chunk(ctas: int, max_seq_len: int) -> int:
    chunks = max(1, -(-_SPLIT_TARGET_CTAS // ctas))
    c = max(_SPLIT_MIN_CHUNK, -(-max_seq_len // chunks))
    return 1 << (c - 1).bit_length()


def _auto(seq_hint: int, ctas: int) -> str:
    # One CTA per (sequence, kv head) is enough once those CTAs fill the GPU or the walk
    # is short; splitting pays a second (small) launch and a partials round trip.
    if seq_hint <= _AUTO_SHORT or ctas >= _SMS:
        return "warp"
    return "split_k"


def _tiling(head_dim: int, group: int) -> tuple[int, int, int, int]:
    """(rows, tile, shared bytes, row chunks) of the tile kernel for one kv head's group."""
    from .serving import attn_tiling

    rows, tile, smem = attn_tiling(head_dim, group)
    return rows, tile, smem, -(-group // rows)


def _layout(kv_layout: Any) -> str:
    if kv_layout not in LAYOUTS:
        raise ArgumentError(f"kv_layout: expected one of {LAYOUTS}, got {kv_layout!r}")
    return kv_layout


_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _check_seq_array(name: str, a: Any, batch: int, max_seq_len: int, dtype: str = "uint32") -> Any:
    """Lengths of any integer dtype as the buffer the kernels read: uint32 for dense_attn, int32 (the
    last_page_len of one page a sequence) for the tensor-core kernel.

    Host lengths (NumPy, CPU tensors) are checked against [0, max_seq_len]; device
    lengths are converted on their device (no host round trip) and clamped by the kernel."""
    dt = arrays.dtype_name(a, name)
    if dt not in _INT_DTYPES:
        raise ArgumentTypeError(f"{name}: expected an integer array, got dtype {dt}")
    shp = arrays.shape_of(a)
    if shp != (batch,):
        raise ArgumentError(f"{name}: expected shape ({batch},), got {shp}")
    if arrays.is_host(a) and batch:
        h = arrays.host_view(a)
        lo, hi = int(h.min()), int(h.max())
        if lo < 0 or hi > max_seq_len:
            bad = lo if lo < 0 else hi
            raise ArgumentError(f"{name}: expected every length in [0, max_seq_len={max_seq_len}], got {bad}")
    return arrays.contiguous(arrays.astype(a, dtype))


def decode_plan(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    *,
    method: str = "auto",
    seq_hint: int | None = None,
    num_warps: int | None = None,
    chunk_size: int | None = None,
) -> dict[str, Any]:
    """The tile kernels' launches for a call: method, and per launch the kernel stem, grid, block, shared memory.

    (A method="auto" call whose dtypes and shape the tensor-core kernel takes runs that kernel instead, with
    PagedDecodePlan's geometry for page_size = max_seq_len; see the module doc.)

    `seq_hint` is the int seq_len when known (it picks "auto" and bounds the split-K
    grid); None means the array form, which launches for max_seq_len.
    """
    if method not in METHODS:
        raise ArgumentError(f"method: expected one of {METHODS}, got {method!r}")
    # Validate like the ops do, so a plan never divides by zero or describes an empty grid.
    batch = _check_int("batch", batch, 1, _GRID_YZ_MAX)
    num_heads = _check_int("num_heads", num_heads, 1, 2**31 - 1)
    num_kv_heads = _check_int("num_kv_heads", num_kv_heads, 1, 2**31 - 1)
    if num_heads % num_kv_heads:
        raise ArgumentError(
            f"num_kv_heads: expected a divisor of num_heads={num_heads}, got num_kv_heads={num_kv_heads}")
    head_dim = _check_int("head_dim", head_dim, 1, MAX_HEAD_DIM)
    max_seq_len = _check_int("max_seq_len", max_seq_len, 1, _MAX_SEQ)
    if seq_hint is not None:
        seq_hint = _check_int("seq_hint", seq_hint, 0, max_seq_len)
    rows, tile, smem, chunks_r = _tiling(head_dim, num_heads // num_kv_heads)
    ctas = batch * num_kv_heads * chunks_r
    if method == "auto":
        # The knobs apply when auto picks their method and are ignored otherwise.
        method = _auto(max_seq_len if seq_hint is None else seq_hint, ctas)
        num_warps = num_warps if method == "multi_warp" else None
        chunk_size = chunk_size if method == "split_k" else None
    if num_warps is not None and method != "multi_warp":
        raise ArgumentError(f"num_warps: only used by method='multi_warp', got method={method!r}")
    if chunk_size is not None and method != "split_k":
        raise ArgumentError(f"chunk_size: only used by method='split_k', got method={method!r}")
    head = {"rows": rows, "tile": tile}
    attn = ("dense_attn", (batch * num_kv_heads, chunks_r), (_NT,), smem)
    merge = ("paged_attn_merge", (-(-batch * num_heads // (_NT // 32)),), (_NT,), 0)
    if method == "warp":
        return {"method": method, **head, "num_splits": 1, "chunk_size": 0, "launches": [attn]}
    if method == "multi_warp":
        w = _default_warps(max_seq_len) if num_warps is None else _check_int("num_warps", num_warps, 1, _MAX_WARPS)
        launches = [(attn[0], attn[1] + (w,), attn[2], smem), merge] if w > 1 else [attn]
        return {"method": method, "num_warps": w, **head, "num_splits": w, "chunk_size": 0, "launches": launches}
    c = _default_chunk(ctas, max_seq_len) if chunk_size is None else _check_int("chunk_size", chunk_size, 1, 2**30)
    max_chunks = max(1, -(-max_seq_len // c))
    n_launch = max_chunks if seq_hint is None else max(1, min(max_chunks, -(-seq_hint // c)))
    if n_launch > _GRID_YZ_MAX:  # chunks are grid z
        raise ArgumentError(f"chunk_size: expected at most {_GRID_YZ_MAX} chunks (grid z limit), got "
                            f"{n_launch} chunks of {c}; use a larger chunk_size")
    launches = [(attn[0], attn[1] + (n_launch,), attn[2], smem), merge] if n_launch > 1 else [attn]
    return {"method": method, "chunk_size": c, "max_chunks": max_chunks, **head, "num_splits": n_launch,
            "launches": launches}


def _run(q: Any, kf: Any, vf: Any, strides: tuple[int, int, int], seq_buf: Any, batch: int, num_heads: int,
         num_kv_heads: int, head_dim: int, max_seq_len: int, q_kind: str, kv_kind: str, *, scale: Any, method: str,
         seq_hint: int | None, num_warps: int | None, chunk_size: int | None, backend: str | None, out: Any = None,
         stream: Any = None, window_left: int = -1, logits_soft_cap: float = 0.0) -> Any:
    """The tile kernels (dense_attn + merge) over flat K/V arrays with (sequence, position, kv head) element
    strides (the caller's view as it is, or a contiguous copy)."""
    from ..launcher import launch

    scale = _check_scale(scale, head_dim)
    wl, wr = _normalize_serving(_check_window_left(window_left), -1, True)
    cap = _check_softcap(logits_soft_cap, "logits_soft_cap")
    plan = decode_plan(batch, num_heads, num_kv_heads, head_dim, max_seq_len, method=method, seq_hint=seq_hint,
                       num_warps=num_warps, chunk_size=chunk_size)
    suf = _suffix(q_kind, kv_kind)
    dt = arrays.IO_DTYPES[q_kind]
    out = arrays.empty((batch, num_heads, head_dim), dt, like=q) if out is None else out
    stream = arrays.launch_stream(stream, q)
    qf, of = _flat(q), _flat(out)
    s_b, s_tok, s_head = strides
    splits = plan["num_splits"]
    # Workspaces of the caller's kind (torch: its allocator), on the op's stream. The
    # cu_seqlens pointers are unused (k_mode 1 reads seq_buf) but must be valid arrays.
    idx = arrays.empty((2,), "int32", like=q)
    f1 = arrays.empty((1,), "f32", like=q)
    if splits > 1:
        part_o = arrays.empty((splits * batch * num_heads * head_dim,), "f32", like=q)
        part_lse = arrays.empty((splits * batch * num_heads,), "f32", like=q)
    else:
        part_o, part_lse = f1, arrays.empty((1,), "f32", like=q)
    stem, grid, block, smem = plan["launches"][0]
    launch(stem + suf, grid, block, qf, kf, vf, of, f1, part_o, part_lse, idx, idx, seq_buf, num_heads, num_kv_heads,
           head_dim, s_b, s_tok, s_head, max_seq_len, 0, 1, wl, wr, plan["rows"], plan["tile"], splits,
           plan["chunk_size"], batch, 0, float(scale), cap, shared_mem=smem, stream=stream, backend=backend)
    if splits > 1:
        stem2, grid2, block2, _ = plan["launches"][1]
        launch(stem2 + arrays.kernel_suffix(q_kind), grid2, block2, part_o, part_lse, of, f1,
               batch * num_heads, head_dim, splits, 0, stream=stream, backend=backend)
    return out


def _cache_view(name: str, a: Any, kv_layout: str, batched: bool) -> tuple[Any, tuple[int, int, int]] | None:
    """(flat array over the view's memory from its first element, (s_b, s_tok, s_head) element strides) of a
    cache as it is (no copy: the kernels add 64-bit strides), or None where the kernels cannot address it
    (head_dim not unit-stride, negative strides, strides that are not whole elements). The stride of a
    dimension of size 1 is never multiplied by a non-zero index and counts as 0."""
    from ._kvcache import element_strides, strided_flat

    if not (isinstance(a, np.ndarray) or arrays.is_torch(a) or hasattr(a, "__cuda_array_interface__")):
        try:
            if not arrays.is_host(a):  # e.g. a DLPack device object: as before, arrays.contiguous's rules
                return None
        except Exception:
            return None
    try:
        st = element_strides(name, a)
    except ArgumentError:
        return None
    shp = arrays.shape_of(a, name)
    st = tuple(0 if n == 1 else int(x) for n, x in zip(shp, st))
    if st[-1] not in (0, 1) or any(x < 0 for x in st):
        return None
    flat = strided_flat(name, a, st, False)
    if not batched:
        st = (0,) + st
    s_tok, s_head = (st[2], st[1]) if kv_layout == "HND" else (st[1], st[2])
    return flat, (st[0], s_tok, s_head)


def _contiguous_strides(num_kv_heads: int, max_seq_len: int, head_dim: int, kv_layout: str) -> tuple[int, int, int]:
    d, s_len = head_dim, max_seq_len
    s_tok, s_head = (d, s_len * d) if kv_layout == "HND" else (num_kv_heads * d, d)
    return num_kv_heads * s_len * d, s_tok, s_head


def _caches(names: tuple[str, str], k: Any, v: Any, kv_layout: str, batched: bool, dims: tuple[int, int, int]
            ) -> tuple[Any, Any, tuple[int, int, int], bool]:
    """(flat K, flat V, their (s_b, s_tok, s_head) element strides, copied): the caches read in place where the
    kernels can address them (one stride set for both), else contiguous copies of both."""
    kv, vv = _cache_view(names[0], k, kv_layout, batched), _cache_view(names[1], v, kv_layout, batched)
    if kv is not None and vv is not None and kv[1] == vv[1]:
        return kv[0], vv[0], kv[1], False
    k, v = arrays.contiguous(k), arrays.contiguous(v)
    return _flat(k), _flat(v), _contiguous_strides(*dims, kv_layout), True


def _tc_candidate(method: str, tensor_cores: Any, q_kind: str, kv_kind: str, group: int, head_dim: int,
                  logits_soft_cap: Any) -> bool:
    """Whether method="auto" sends this shape to the tensor-core paged decode kernel (the alignment of the
    caches and the backend are checked next, tc_decode_addressable)."""
    from .serving import tc_decode_eligible

    if tensor_cores is not None and not isinstance(tensor_cores, bool):
        raise ArgumentTypeError(f"tensor_cores: expected None, True or False, got {tensor_cores!r}")
    cap = _check_softcap(logits_soft_cap, "logits_soft_cap")
    return (method == "auto" and tensor_cores is not False
            and tc_decode_eligible(q_kind, kv_kind, group, head_dim, cap))


# The tensor-core dense decode's plans (split partials, tickets, the page table 0..M), kept per geometry, device
# and stream: a decode loop calls with the same shapes every step (every layer of a patched model), and making
# a plan allocates six buffers and zero-fills two. Sharing one in stream order is safe: each launch leaves its
# tickets at zero, and the output is never the plan's (a new array each call, or the caller's out=).
_TC_PLANS: OrderedDict = OrderedDict()
_TC_PLANS_MAX = 32


def _device_key(a: Any) -> tuple:
    if arrays.is_torch(a):
        return ("torch", a.device.type, a.device.index)
    mod = type(a).__module__.split(".")[0]
    return (mod, int(a.device.id)) if mod == "cupy" else (mod,)


def _tc_plan(key: tuple, make: Any) -> tuple:
    entry = _TC_PLANS.get(key)
    if entry is None:
        entry = _TC_PLANS[key] = make()
        while len(_TC_PLANS) > _TC_PLANS_MAX:
            _TC_PLANS.popitem(last=False)
    else:
        _TC_PLANS.move_to_end(key)
    return entry


def _run_tc(q: Any, kf: Any, vf: Any, strides: tuple[int, int, int], lens: Any, batch: int, num_heads: int,
            num_kv_heads: int, head_dim: int, max_seq_len: int, q_kind: str, kv_kind: str, *, scale: Any,
            kv_layout: str, window_left: int, out: Any, stream: Any, backend: str | None, pdl: bool = False) -> Any:
    """Dense caches as a paged cache of one page a sequence, on the tensor-core decode kernel: page_size =
    max_seq_len, kv_indptr = 0..M, kv_indices = 0..M-1, kv_last_page_len = the lengths (int32; 0 gives
    zeros), the page stride = the sequence stride. The plan, from _TC_PLANS, is PagedDecodePlan's for the
    power of two at or above max_seq_len (at least 64), so a cache that grows a token a step (transformers'
    DynamicCache) reuses one plan, and its workspaces, for many steps; its split count depends on shapes
    only, so int and array lengths launch the same grid and agree bit for bit."""
    from .. import devices
    from .serving import PagedDecodePlan

    sc = _check_scale(scale, head_dim)
    span = 1 << max(6, (max_seq_len - 1).bit_length())
    key = (batch, num_heads, num_kv_heads, head_dim, span, kv_layout, q_kind, kv_kind, window_left,
           backend, _device_key(q), devices.stream_handle(arrays.launch_stream(stream, q)))
    plan, indptr = _tc_plan(key, lambda: (
        PagedDecodePlan(batch, num_heads, num_kv_heads, head_dim, span, kv_layout=kv_layout, q_dtype=q_kind,
                        kv_dtype=kv_kind, max_kv_len=span, window_left=window_left, like=q),
        arrays.arange_like(batch + 1, "int32", q)))
    res = arrays.empty((batch, num_heads, head_dim), q_kind, like=q) if out is None else out
    # the pages' size is the cache's own length: the kernel clamps a device length to it
    plan._launch(q, kf, vf, strides, indptr, indptr[:batch], lens, _flat(res), sc, 1.0, 1.0, False, stream,
                 backend, page_size=max_seq_len, pdl=pdl)
    return res


def _kv_dims(kv_shape: tuple[int, ...], kv_layout: str) -> tuple[int, int]:
    """(num_kv_heads, max_seq_len) of a cache shape in the given layout."""
    if kv_layout == "HND":
        return kv_shape[-3], kv_shape[-2]
    return kv_shape[-2], kv_shape[-3]


def _check_common(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], v_shape: tuple[int, ...], batch: int,
                  kv_layout: str, names: tuple[str, str] = ("k_cache", "v_cache")) -> None:
    kn, vn = names
    if kv_shape != v_shape:
        raise ArgumentError(f"{vn}: expected the shape of {kn} {kv_shape}, got {v_shape}")
    num_heads, head_dim = q_shape[-2], q_shape[-1]
    if num_heads < 1:
        raise ArgumentError(f"q: expected at least one head, got shape {tuple(q_shape)}")
    (num_kv_heads, max_seq_len), kv_dim = _kv_dims(kv_shape, kv_layout), kv_shape[-1]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ArgumentError(f"q: expected 1 <= head_dim <= {MAX_HEAD_DIM}, got {head_dim}")
    if kv_dim != head_dim:
        lay = "(max_seq_len, num_kv_heads, head_dim)" if kv_layout == "NHD" else "(num_kv_heads, max_seq_len, head_dim)"
        raise ArgumentError(f"{kn}: expected {lay} (kv_layout={kv_layout!r}) with head_dim {head_dim} (from q), got "
                            f"shape {kv_shape}")
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        other = "NHD" if kv_layout == "HND" else "HND"
        raise ArgumentError(
            f"{kn}: expected num_kv_heads dividing num_heads={num_heads}, got num_kv_heads={num_kv_heads} "
            f"(kv_layout={kv_layout!r}; is the cache {other!r}?)")
    if not 1 <= max_seq_len <= _MAX_SEQ:
        raise ArgumentError(f"{kn}: expected 1 <= max_seq_len <= 2**30, got {max_seq_len}")
    if not 1 <= batch <= _GRID_YZ_MAX:
        raise ArgumentError(f"q: expected 1 <= batch <= {_GRID_YZ_MAX} (grid y/z limit), got {batch}")


@arrays.stream_scoped
def decode_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    seq_len: Any,
    *,
    kv_layout: str = "NHD",
    scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    method: str = "auto",
    num_warps: int | None = None,
    chunk_size: int | None = None,
    tensor_cores: bool | None = None,
    out: Any = None,
    stream: Any = None,
    backend: str | None = None,
    enable_pdl: bool = False,
) -> Any:
    """Attention of one query token per head over the first `seq_len` cache positions.

    q: (num_heads, head_dim) float32, bfloat16 or float16; k_cache, v_cache:
    (max_seq_len, num_kv_heads, head_dim) for kv_layout="NHD" (default) or
    (num_kv_heads, max_seq_len, head_dim) for "HND" (the default before), float32, bfloat16 or float16, num_heads a multiple
    of num_kv_heads (query head h reads kv head h // (num_heads // num_kv_heads)),
    head_dim <= 256. seq_len: an int in [0, max_seq_len], or a (1,) integer array (any int dtype)
    read by the kernel at run time (clamped to max_seq_len there, and on the tensor-core path a
    device length that is negative as an int32 counts as 0; a NumPy array is also checked here). scale defaults to 1/sqrt(head_dim). Returns
    (num_heads, head_dim) in q's dtype; zeros when seq_len is 0. Cache slots past
    seq_len are never read.

    method: "warp" | "multi_warp" | "split_k" | "auto" (see the module doc).
    num_warps (multi_warp only, 1..16): parts of the cache, default min(8, max(1, max_seq_len // 128)).
    chunk_size (split_k only): positions per chunk, default the power of two >= 64 that
    gives about two waves of CTAs on 132 SMs. Both depend on shapes only, so the int and
    array forms of seq_len launch grids that give identical results.

    window_left (FlashInfer's; -1 = unbounded): the query (position seq_len - 1) sees keys
    seq_len - 1 - window_left .. seq_len - 1; only those are read. logits_soft_cap c > 0:
    scores c * tanh(scale * q.k / c). Both as paged_decode_attention.

    tensor_cores: None (default) lets method="auto" run eligible shapes (bf16 / f16, 1..16 query heads a
    kv head, head_dim 64 / 128, no softcap, 16-byte strides and bases) on the tensor-core decode kernel;
    False keeps the tile kernels. The caches are read in place through their strides (views of a bigger
    buffer included); only a cache with head_dim not unit-stride, a negative stride, or strides that differ
    between K and V is copied. q may be copied to make it contiguous. out: a C-contiguous (num_heads,
    head_dim) array of q's dtype, written in place (anything else raises naming out).
    enable_pdl: programmatic dependent launch of the tensor-core kernel on sm_90+ (as PagedDecodePlan.run);
    the tile kernels launch as usual.
    """
    _check_enable_pdl(enable_pdl)
    q_kind = arrays.io_kind("q", q, arrays.IO_KINDS)
    kv_kind = arrays.io_kind("k_cache", k_cache, arrays.IO_KINDS)
    if arrays.io_kind("v_cache", v_cache, arrays.IO_KINDS) != kv_kind:
        raise ArgumentTypeError(f"v_cache: expected the dtype of k_cache ({arrays.dtype_name(k_cache)}), "
                                f"got {arrays.dtype_name(v_cache)}")
    kv_layout = _layout(kv_layout)
    lay = "(max_seq_len, num_kv_heads, head_dim)" if kv_layout == "NHD" else "(num_kv_heads, max_seq_len, head_dim)"
    q_shape = arrays.check_ndim("q", q, (2,), "(num_heads, head_dim)")
    kv_shape = arrays.check_ndim("k_cache", k_cache, (3,), f"{lay} (kv_layout={kv_layout!r})")
    v_shape = arrays.check_ndim("v_cache", v_cache, (3,), f"{lay} (kv_layout={kv_layout!r})")
    _check_common(q_shape, kv_shape, v_shape, 1, kv_layout)
    num_heads, head_dim = q_shape
    num_kv_heads, max_seq_len = _kv_dims(kv_shape, kv_layout)
    is_int = isinstance(seq_len, (int, np.integer)) and not isinstance(seq_len, bool)
    hint: int | None = None
    if is_int:
        hint = _check_int("seq_len", seq_len, 0, max_seq_len)
    elif not hasattr(seq_len, "shape") and not hasattr(seq_len, "__cuda_array_interface__"):
        raise ArgumentTypeError(f"seq_len: expected an int or a (1,) integer array, got {type(seq_len).__name__}")
    tc = _tc_candidate(method, tensor_cores, q_kind, kv_kind, num_heads // num_kv_heads, head_dim, logits_soft_cap)
    q = arrays.contiguous(q)
    if out is not None:
        out = arrays.check_out(out, (num_heads, head_dim), arrays.dtype_name(q), q)
    kf, vf, strides, _ = _caches(("k_cache", "v_cache"), k_cache, v_cache, kv_layout, False,
                                 (num_kv_heads, max_seq_len, head_dim))
    if tc:
        from .serving import tc_decode_addressable

        tc = tc_decode_addressable(kv_kind, kf, vf, strides, backend, q, out)
    len_dt = "int32" if tc else "uint32"
    if is_int:
        seq_buf = np.array([hint], len_dt)
        seq_buf = arrays.to_like(seq_buf, q)  # host-to-device next to a device query (never device-to-host)
    else:
        seq_buf = _check_seq_array("seq_len", seq_len, 1, max_seq_len, len_dt)
    out3 = None if out is None else out.reshape(1, num_heads, head_dim)
    if tc:
        res = _run_tc(q, kf, vf, strides, seq_buf, 1, num_heads, num_kv_heads, head_dim, max_seq_len, q_kind,
                      kv_kind, scale=scale, kv_layout=kv_layout, window_left=window_left, out=out3, stream=stream,
                      backend=backend, pdl=enable_pdl)
    else:
        res = _run(q, kf, vf, strides, seq_buf, 1, num_heads, num_kv_heads, head_dim, max_seq_len, q_kind,
                   kv_kind, scale=scale, method=method, seq_hint=hint, num_warps=num_warps, chunk_size=chunk_size,
                   backend=backend, out=out3, stream=stream, window_left=window_left,
                   logits_soft_cap=logits_soft_cap)
    return out if out is not None else res.reshape(num_heads, head_dim)


@arrays.stream_scoped
def batched_decode_attention(
    q: Any,
    k_caches: Any,
    v_caches: Any,
    seq_lens: Any,
    *,
    kv_layout: str = "NHD",
    scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    method: str = "auto",
    num_warps: int | None = None,
    chunk_size: int | None = None,
    tensor_cores: bool | None = None,
    out: Any = None,
    stream: Any = None,
    backend: str | None = None,
    enable_pdl: bool = False,
) -> Any:
    """Decode attention for M sequences in one launch (two for split_k).

    q: (M, num_heads, head_dim). k_caches, v_caches: one stacked array
    (M, max_seq_len, num_kv_heads, head_dim) ("NHD", default) or (M, num_kv_heads,
    max_seq_len, head_dim) (kv_layout="HND", the default before), or a list of M per-sequence arrays
    which is stacked into a copy (NumPy only;
    keep a stacked cache to avoid that copy per step). seq_lens: (M,) integer array (any int dtype)
    read by the kernel (each length clamped to max_seq_len there; a NumPy array is
    also checked here), or a sequence of ints. Returns (M, num_heads, head_dim) in
    q's dtype; a sequence of length 0 gets zeros. window_left, logits_soft_cap, tensor_cores and
    the copy rules (caches read in place through their strides; out= contiguous, written in place) and
    enable_pdl as decode_attention.
    """
    _check_enable_pdl(enable_pdl)
    k_caches = _stack("k_caches", k_caches)
    v_caches = _stack("v_caches", v_caches)
    q_kind = arrays.io_kind("q", q, arrays.IO_KINDS)
    kv_kind = arrays.io_kind("k_caches", k_caches, arrays.IO_KINDS)
    if arrays.io_kind("v_caches", v_caches, arrays.IO_KINDS) != kv_kind:
        raise ArgumentTypeError(f"v_caches: expected the dtype of k_caches ({arrays.dtype_name(k_caches)}), "
                                f"got {arrays.dtype_name(v_caches)}")
    kv_layout = _layout(kv_layout)
    lay = ("(M, max_seq_len, num_kv_heads, head_dim)" if kv_layout == "NHD"
           else "(M, num_kv_heads, max_seq_len, head_dim)") + f" (kv_layout={kv_layout!r})"
    q_shape = arrays.check_ndim("q", q, (3,), "(M, num_heads, head_dim)")
    kv_shape = arrays.check_ndim("k_caches", k_caches, (4,), lay)
    v_shape = arrays.check_ndim("v_caches", v_caches, (4,), lay)
    batch, num_heads, head_dim = q_shape
    if kv_shape[0] != batch:
        raise ArgumentError(f"k_caches: expected {batch} sequences (from q), got {kv_shape[0]}")
    _check_common(q_shape, kv_shape, v_shape, max(batch, 1), kv_layout, ("k_caches", "v_caches"))
    if batch == 0:  # no sequence: nothing to launch, an empty result of q's kind
        if isinstance(seq_lens, (list, tuple)) and len(seq_lens):
            raise ArgumentError(f"seq_lens: expected 0 lengths (from q), got {len(seq_lens)}")
        if out is not None:
            return arrays.check_out(out, q_shape, arrays.dtype_name(q), q)
        return arrays.empty(q_shape, arrays.dtype_name(q), like=q)
    num_kv_heads, max_seq_len = _kv_dims(kv_shape, kv_layout)
    vals = None
    if isinstance(seq_lens, (list, tuple)):
        if len(seq_lens) != batch:
            raise ArgumentError(f"seq_lens: expected {batch} lengths (from q), got {len(seq_lens)}")
        vals = [_check_int(f"seq_lens[{i}]", s, 0, max_seq_len) for i, s in enumerate(seq_lens)]
    tc = _tc_candidate(method, tensor_cores, q_kind, kv_kind, num_heads // num_kv_heads, head_dim, logits_soft_cap)
    q = arrays.contiguous(q)
    if out is not None:
        out = arrays.check_out(out, q_shape, arrays.dtype_name(q), q)
    kf, vf, strides, _ = _caches(("k_caches", "v_caches"), k_caches, v_caches, kv_layout, True,
                                 (num_kv_heads, max_seq_len, head_dim))
    if tc:
        from .serving import tc_decode_addressable

        tc = tc_decode_addressable(kv_kind, kf, vf, strides, backend, q, out)
    len_dt = "int32" if tc else "uint32"
    if vals is not None:
        seq_lens = np.array(vals, len_dt)
        seq_lens = arrays.to_like(seq_lens, q)  # host-to-device next to a device query (never device-to-host)
    seq_buf = _check_seq_array("seq_lens", seq_lens, batch, max_seq_len, len_dt)
    if tc:
        return _run_tc(q, kf, vf, strides, seq_buf, batch, num_heads, num_kv_heads, head_dim, max_seq_len, q_kind,
                       kv_kind, scale=scale, kv_layout=kv_layout, window_left=window_left, out=out, stream=stream,
                       backend=backend, pdl=enable_pdl)
    return _run(q, kf, vf, strides, seq_buf, batch, num_heads, num_kv_heads, head_dim, max_seq_len, q_kind,
                kv_kind, scale=scale, method=method, seq_hint=None, num_warps=num_warps, chunk_size=chunk_size,
                backend=backend, out=out, stream=stream, window_left=window_left, logits_soft_cap=logits_soft_cap)


def _stack(name: str, caches: Any) -> Any:
    if isinstance(caches, (list, tuple)):
        if not caches:
            raise ArgumentError(f"{name}: expected at least one cache, got an empty sequence")
        if not all(isinstance(c, np.ndarray) for c in caches):
            raise ArgumentTypeError(f"{name}: a list of caches must hold NumPy arrays; pass one stacked device array")
        shapes = {c.shape for c in caches}
        if len(shapes) != 1:
            raise ArgumentError(f"{name}: expected caches of one shape, got {sorted(shapes)}")
        return np.stack(caches)
    return caches
