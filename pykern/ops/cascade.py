"""Attention-state merges for cascade (shared-prefix) and split attention, in FlashInfer's names.

A state is an attention output `v` over one segment of keys and `s`, the natural-log log-sum-exp of its scaled
scores: what `flash_attention(..., return_lse=True)`, `paged_decode_attention(..., return_lse=True)` and
`paged_prefill_attention(..., return_lse=True)` return. Merging states gives the output over the union of their
segments, exactly up to fp32 rounding, in a fixed order (bit-identical run to run). A segment with lse = -inf
weighs nothing; when every segment is empty the merge is 0 with lse -inf. Kernels in kernels_cu/cascade.cu.
"""
from __future__ import annotations

from typing import Any

from .. import arrays
from ..errors import ArgumentError, ArgumentTypeError
from ._common import launch_warp_rows as _launch

__all__ = ["merge_state", "merge_state_in_place", "merge_states", "shared_prefix_decode"]

_GRID_Y_MAX = 65535  # num_heads is the grid's y (the launch geometry is _common.launch_warp_rows')


def _check_state(v_name: str, v: Any, s_name: str, s: Any,
                 layout: str = "(seq_len, num_heads, head_dim)") -> tuple[str, tuple[int, ...]]:
    """A (v, s) pair: v of an I/O dtype with the given layout, s float32 of v's shape less its last axis."""
    k = arrays.io_kind(v_name, v, arrays.IO_KINDS)
    n = layout.count(",") + 1
    shape = tuple(arrays.shape_of(v, v_name))
    if len(shape) != n:
        raise ArgumentError(f"{v_name}: expected a {n}-D array {layout}, got shape {shape}")
    if shape[-1] < 1:
        raise ArgumentError(f"{v_name}: expected head_dim >= 1, got shape {shape}")
    if max(shape[1:]) > 2**31 - 1:  # they reach the kernel as int
        raise ArgumentError(f"{v_name}: expected every axis but the first below 2**31, got shape {shape}")
    if shape[-2] > _GRID_Y_MAX:  # num_heads is the grid's y
        raise ArgumentError(f"{v_name}: expected num_heads <= {_GRID_Y_MAX} (shape[{n - 2}]), got shape {shape}")
    if arrays.dtype_name(s, s_name) != "float32":
        raise ArgumentTypeError(f"{s_name}: expected dtype float32 (the log-sum-exp), got {arrays.dtype_name(s)}")
    s_shape = tuple(arrays.shape_of(s, s_name))
    if s_shape != shape[:-1]:
        want = layout.rsplit(",", 1)[0] + ")"
        raise ArgumentError(f"{s_name}: expected shape {shape[:-1]} {want}, the shape of {v_name} without "
                            f"head_dim, got {s_shape}")
    return k, shape


def _same_memory(name: str, a: Any, ref_name: str, like: Any) -> None:
    if not arrays.same_memory_kind(a, like):
        raise ArgumentTypeError(f"{name}: expected the same kind of array on the same device as {ref_name}, "
                                f"got {type(a).__name__}")


def _check_pair(names: tuple[str, str, str, str], v: Any, s: Any, v2: Any, s2: Any) -> tuple[str, tuple[int, ...]]:
    """Two states (v, s) and (v2, s2) of one shape and dtype, on v's kind of memory: (kind, v's shape)."""
    kind, shape = _check_state(names[0], v, names[1], s)
    k2, shape2 = _check_state(names[2], v2, names[3], s2)
    if k2 != kind:
        raise ArgumentTypeError(f"{names[2]}: expected the dtype of {names[0]} ({arrays.IO_DTYPES[kind]}), "
                                f"got {arrays.IO_DTYPES[k2]}")
    if shape2 != shape:
        raise ArgumentError(f"{names[2]}: expected the shape of {names[0]} {shape}, got {shape2}")
    for name, a in zip(names[1:], (s, v2, s2)):
        _same_memory(name, a, names[0], v)
    return kind, shape


@arrays.stream_scoped
def merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any, *, stream: Any = None,
                backend: str | None = None) -> tuple[Any, Any]:
    """(v, s): the merge of the states (v_a, s_a) and (v_b, s_b), FlashInfer's `merge_state`.

    v_a, v_b: (seq_len, num_heads, head_dim), float32 / bfloat16 / float16, the same dtype; s_a, s_b:
    (seq_len, num_heads) float32 natural-log lse. Returns v of v_a's dtype and s float32, the attention output
    and lse over both segments: with m = max(s_a, s_b), w = exp(s - m), v = (w_a v_a + w_b v_b) / (w_a + w_b)
    and s = m + log(w_a + w_b), in fp32.
    """
    kind, shape = _check_pair(("v_a", "s_a", "v_b", "s_b"), v_a, s_a, v_b, s_b)
    va, sa, vb, sb = (arrays.contiguous(x) for x in (v_a, s_a, v_b, s_b))
    v = arrays.empty(shape, arrays.IO_DTYPES[kind], like=va)
    s = arrays.empty(shape[:-1], "float32", like=va)
    if shape[0] * shape[1]:
        _launch("merge_state" + arrays.kernel_suffix(kind), shape[0], shape[1], va.reshape(-1), sa.reshape(-1),
                vb.reshape(-1), sb.reshape(-1), arrays.empty((1,), "uint8", like=va), v.reshape(-1), s.reshape(-1),
                shape[0], shape[1], shape[2], 0, stream=stream, like=va, backend=backend)
    return v, s


@arrays.stream_scoped
def merge_state_in_place(v: Any, s: Any, v_other: Any, s_other: Any, mask: Any = None, *, stream: Any = None,
                         backend: str | None = None) -> None:
    """Merge (v_other, s_other) into (v, s) in place, FlashInfer's `merge_state_in_place`.

    Shapes and dtypes as `merge_state`; v and s must be C-contiguous (they are written). `mask` (seq_len,)
    bool or uint8, optional: only the tokens where it is true are merged, the others keep their state
    (for CUDA graphs, where the set of tokens to merge changes between replays). Returns None.
    """
    kind, shape = _check_pair(("v", "s", "v_other", "s_other"), v, s, v_other, s_other)
    arrays.check_out(v, shape, arrays.IO_DTYPES[kind], v, "v")  # written in place: C-contiguous, writeable
    arrays.check_out(s, shape[:-1], "float32", v, "s")
    has_mask = mask is not None
    if has_mask:
        dt = arrays.dtype_name(mask, "mask")
        if dt not in ("bool", "uint8"):
            raise ArgumentTypeError(f"mask: expected dtype bool or uint8, got {dt}")
        if tuple(arrays.shape_of(mask, "mask")) != (shape[0],):
            raise ArgumentError(f"mask: expected shape ({shape[0]},) (seq_len), got {tuple(arrays.shape_of(mask))}")
        _same_memory("mask", mask, "v", v)
        m = arrays.contiguous(arrays.astype(mask, "uint8"))  # a bool is one byte 0 / 1 already; torch needs the dtype
    else:
        m = arrays.empty((1,), "uint8", like=v)
    vo, so = arrays.contiguous(v_other), arrays.contiguous(s_other)
    if shape[0] * shape[1]:
        vf, sf = v.reshape(-1), s.reshape(-1)
        _launch("merge_state" + arrays.kernel_suffix(kind), shape[0], shape[1], vf, sf, vo.reshape(-1),
                so.reshape(-1), m.reshape(-1), vf, sf, shape[0], shape[1], shape[2], int(has_mask), stream=stream,
                like=v, backend=backend)
    return None


@arrays.stream_scoped
def merge_states(v: Any, s: Any, *, stream: Any = None, backend: str | None = None) -> tuple[Any, Any]:
    """(v, s): the merge of num_states states a token, FlashInfer's `merge_states`.

    v: (seq_len, num_states, num_heads, head_dim), float32 / bfloat16 / float16; s: (seq_len, num_states,
    num_heads) float32 natural-log lse. Returns v (seq_len, num_heads, head_dim) of v's dtype and s
    (seq_len, num_heads) float32: the states merged in index order (see `merge_state`).
    """
    kind, shape = _check_state("v", v, "s", s, layout="(seq_len, num_states, num_heads, head_dim)")
    _same_memory("s", s, "v", v)
    seq, n_states, heads, dim = shape
    if n_states < 1:
        raise ArgumentError(f"v: expected num_states >= 1 (v.shape[1]), got shape {shape}")
    vc, sc = arrays.contiguous(v), arrays.contiguous(s)
    out = arrays.empty((seq, heads, dim), arrays.IO_DTYPES[kind], like=vc)
    lse = arrays.empty((seq, heads), "float32", like=vc)
    if seq * heads:
        _launch("merge_states" + arrays.kernel_suffix(kind), seq, heads, vc.reshape(-1), sc.reshape(-1),
                out.reshape(-1), lse.reshape(-1), seq, n_states, heads, dim, stream=stream, like=vc, backend=backend)
    return out, lse


def shared_prefix_decode(q: Any, k_shared: Any, v_shared: Any, k_pages: Any, v_pages: Any, kv_indptr: Any,
                         kv_indices: Any, kv_last_page_len: Any, *, kv_layout: str = "NHD", scale: float | None = None,
                         logits_soft_cap: float = 0.0, return_lse: bool = False, stream: Any = None,
                         backend: str | None = None) -> Any:
    """A decode step over a prefix every request shares, then each request's own tokens: two-level cascade
    attention, as FlashInfer's BatchDecodeWithSharedPrefixPagedKVCacheWrapper computes it.

    q (batch, num_qo_heads, head_dim); k_shared, v_shared the prefix's K/V once for the whole batch,
    (prefix_len, num_kv_heads, head_dim) for kv_layout "NHD" or (num_kv_heads, prefix_len, head_dim) for "HND";
    k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len each request's suffix in the paged cache (the
    arguments of paged_decode_attention, same kv_layout). The prefix is attended once with every request's query
    (flash_attention over batch queries: its K/V read once, not once per request), the suffixes by
    paged_decode_attention, and the two states merged (merge_state). Returns out (batch, num_qo_heads, head_dim),
    or (out, lse) with return_lse (natural-log lse over prefix and suffix). Equal to paged_decode_attention over
    prefix + suffix within the dtype's tolerance; a request with no suffix pages sees the prefix alone.
    """
    from .forward import flash_attention
    from .serving import paged_decode_attention

    if kv_layout not in ("NHD", "HND"):
        raise ArgumentError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    q_shape = tuple(arrays.shape_of(q, "q"))
    if len(q_shape) != 3:
        raise ArgumentError(f"q: expected a 3-D array (batch, num_qo_heads, head_dim), got shape {q_shape}")
    layout = "(prefix_len, num_kv_heads, head_dim)" if kv_layout == "NHD" else "(num_kv_heads, prefix_len, head_dim)"
    for name, a in (("k_shared", k_shared), ("v_shared", v_shared)):
        shp = tuple(arrays.shape_of(a, name))
        if len(shp) != 3:
            raise ArgumentError(f"{name}: expected a 3-D array {layout} (kv_layout={kv_layout!r}), got shape {shp}")
    if tuple(arrays.shape_of(v_shared)) != tuple(arrays.shape_of(k_shared)):
        raise ArgumentError(f"v_shared: expected the shape of k_shared {tuple(arrays.shape_of(k_shared))}, got "
                            f"{tuple(arrays.shape_of(v_shared))}")
    # the prefix goes to flash_attention as its k / v: checked here, so that an error names k_shared / v_shared
    kind = arrays.io_kind("q", q, arrays.IO_KINDS)
    for name, a in (("k_shared", k_shared), ("v_shared", v_shared)):
        arrays.same_kind(name, a, kind, "q")
        _same_memory(name, a, "q", q)  # (a meta tensor among host or CPU arrays too)
    ks, vs = (k_shared, v_shared) if kv_layout == "NHD" else (k_shared.swapaxes(0, 1), v_shared.swapaxes(0, 1))
    o_suf, s_suf = paged_decode_attention(q, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len,
                                          kv_layout=kv_layout, scale=scale, logits_soft_cap=logits_soft_cap or None,
                                          return_lse=True, stream=stream, backend=backend)
    if arrays.shape_of(ks)[0] == 0:  # no shared prefix: the suffix alone
        return (o_suf, s_suf) if return_lse else o_suf
    o_pre, s_pre = flash_attention(q.reshape((1, *q_shape)), ks.reshape((1, *arrays.shape_of(ks))),
                                   vs.reshape((1, *arrays.shape_of(vs))), causal=False, scale=scale,
                                   softcap=logits_soft_cap, return_lse=True, stream=stream, backend=backend)
    o, s = merge_state(o_pre.reshape(q_shape[0], q_shape[1], -1), s_pre.reshape(q_shape[0], q_shape[1]), o_suf,
                       s_suf, stream=stream, backend=backend)
    return (o, s) if return_lse else o
