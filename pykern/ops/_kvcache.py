"""KV-cache arrays of the serving ops: element kinds (FP8 included), strided views, FlashInfer's cache forms.

The attention and append kernels address K/V as base + page * s_page + token * s_tok + head * s_head + d
with 64-bit element strides, so a view is passed as it is: a flat array over the memory the view spans
(starting at its first element) plus its strides. Nothing is copied, and an append writes through the
view. FlashInfer's combined cache (pages, 2, page_size, heads, dim) ("NHD") or (pages, 2, heads,
page_size, dim) ("HND") is read and written through `cache[:, 0]` and `cache[:, 1]` that way.
What cannot be addressed so (head_dim not unit-stride, negative strides, K and V of different strides)
raises naming the argument: never a silent copy, never a write into a copy.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import arrays
from ..errors import ArgumentError, ArgumentTypeError

# dtype name -> kind; FP8 kinds follow ml_dtypes / torch names.
KV_KINDS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
FP8 = ("e4m3", "e5m2")
# Names a plan's kv_dtype may take.
KV_DTYPE_NAMES = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16",
                  "e4m3": "e4m3",
                  "float8_e4m3fn": "e4m3", "e5m2": "e5m2", "float8_e5m2": "e5m2"}


def kv_kind(name: str, a: Any) -> str:
    """"f32", "bf16", "f16", "e4m3" or "e5m2" for a cache array, else an error naming it."""
    dt = arrays.dtype_name(a, name)
    k = KV_KINDS.get(dt)
    if k is None:
        raise ArgumentTypeError(f"{name}: expected dtype float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, "
                                f"got {dt}")
    return k


def is_combined(cache: Any) -> bool:
    """FlashInfer's single-argument cache: a (k, v) tuple or one 5-D array with the K/V dimension at 1."""
    if isinstance(cache, (tuple, list)):
        return True
    try:
        return len(arrays.shape_of(cache)) == 5
    except Exception:
        return False


def split_cache(cache: Any, layout_name: str) -> tuple[Any, Any]:
    """(k_pages, v_pages) of FlashInfer's paged_kv_cache argument (views, no copy)."""
    if isinstance(cache, (tuple, list)):
        if len(cache) != 2:
            raise ArgumentError(f"k_pages (paged_kv_cache): expected a (k_cache, v_cache) pair, got {len(cache)} "
                                "arrays")
        return cache[0], cache[1]
    shp = arrays.shape_of(cache)
    if shp[1] != 2:
        lay = "(pages, 2, page_size, heads, dim)" if layout_name == "NHD" else "(pages, 2, heads, page_size, dim)"
        raise ArgumentError(f"k_pages (paged_kv_cache): expected {lay} for kv_layout={layout_name!r}, got shape "
                            f"{shp}")
    return cache[:, 0], cache[:, 1]


def shift_combined(cache: Any, rest: tuple[Any, ...], last_name: str) -> tuple[Any, Any, tuple[Any, ...]]:
    """FlashInfer's positional form: (cache, a, b, c, None) means k, v from `cache` and (a, b, c).

    `rest` holds the op's positional arguments after v_pages (v_pages first): with a combined cache
    they move one place left and the last must be absent."""
    if rest[-1] is not None:
        raise ArgumentError(f"{last_name}: with a combined paged_kv_cache (a (k, v) pair or a 5-D array) the "
                            f"index arrays follow it directly; got one argument too many")
    return rest[0], rest[1], rest[2:-1]


def element_strides(name: str, a: Any) -> tuple[int, ...]:
    """Strides in elements (NumPy: bytes / itemsize; None in a CUDA array interface: C order)."""
    shp = arrays.shape_of(a, name)
    if isinstance(a, np.ndarray) or (not arrays.is_torch(a) and not hasattr(a, "__cuda_array_interface__")):
        h = a if isinstance(a, np.ndarray) else arrays.host_view(a)
        item = h.dtype.itemsize
        if any(s % item for s in h.strides):
            raise ArgumentError(f"{name}: expected strides that are whole elements, got byte strides {h.strides}")
        return tuple(s // item for s in h.strides)
    if arrays.is_torch(a):
        return tuple(int(s) for s in a.stride())
    cai = a.__cuda_array_interface__
    if cai.get("strides") is None:
        out, step = [], 1
        for n in reversed(shp):
            out.append(step)
            step *= n
        return tuple(reversed(out))
    item = int(cai["typestr"][2:])
    return tuple(int(s) // item for s in cai["strides"])


def strided_flat(name: str, a: Any, strides: tuple[int, ...], raw_u8: bool, writes: bool = False) -> Any:
    """A 1-D array of the kernel's element type over the memory the view spans, starting at its first
    element (the same memory: writes go through). FP8 travels as uint8 (the kernels take bytes)."""
    shp = arrays.shape_of(a, name)
    extent = 0 if 0 in shp else 1 + sum((n - 1) * s for n, s in zip(shp, strides))
    if isinstance(a, np.ndarray) or (not arrays.is_torch(a) and not hasattr(a, "__cuda_array_interface__")):
        h = a if isinstance(a, np.ndarray) else arrays.host_view(a)
        if writes and not h.flags.writeable:
            raise ArgumentError(f"{name}: the op writes into it but the array is read-only")
        # as_strided over raw words: NumPy cannot rebuild some ml_dtypes types (float8_e5m2) from their typestr
        raw = h.view(f"u{h.dtype.itemsize}")
        flat = np.lib.stride_tricks.as_strided(raw, shape=(extent,), strides=(h.dtype.itemsize,))
        return flat if raw_u8 else flat.view(h.dtype)
    if arrays.is_torch(a):
        torch = arrays.torch_module()
        t = a.detach()
        flat = t.as_strided((extent,), (1,))
        return flat.view(torch.uint8) if raw_u8 else flat
    cai = a.__cuda_array_interface__
    if writes and cai.get("data", (0, False))[1]:
        raise ArgumentError(f"{name}: the op writes into it but the array is read-only")
    typestr = "|u1" if raw_u8 else cai["typestr"]
    return arrays.DeviceView(int(cai["data"][0]), (extent,), typestr, a)


def page_view(name: str, a: Any, layout: int, raw_u8: bool, writes: bool = False) -> tuple[Any, tuple[int, int, int]]:
    """(flat array, (s_page, s_tok, s_head)) of a 4-D page array in layout 0 ("NHD") or 1 ("HND")."""
    st = element_strides(name, a)
    shp = arrays.shape_of(a, name)
    if shp[3] > 1 and st[3] != 1:
        raise ArgumentError(f"{name}: expected head_dim (the last dimension) with unit stride, got element "
                            f"strides {st}")
    if any(s < 0 for n, s in zip(shp, st) if n > 1):
        raise ArgumentError(f"{name}: expected non-negative strides, got element strides {st}")
    s_page = st[0]
    s_tok, s_head = (st[1], st[2]) if layout == 0 else (st[2], st[1])
    return strided_flat(name, a, st, raw_u8, writes), (s_page, s_tok, s_head)


def check_scale(name: str, v: Any) -> float:
    """A dequantization scale: a finite float > 0 (None: 1)."""
    if v is None:
        return 1.0
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(
            float(v)) or float(v) <= 0.0:
        raise ArgumentError(f"{name}: expected a finite float > 0, got {v!r}")
    return float(v)
