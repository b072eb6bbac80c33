"""Argument checks and outputs of the paged kernels (kernels_cu/paged.cu), shared by the serving ops and the
attention family's varlen fallback (dense_attn): the (q, K/V) kernel suffixes, index-pointer and query checks, the
prefill outputs."""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays
from ..errors import ArgumentError, ArgumentTypeError
from ._common import GRID_YZ_MAX

NT = 128  # PA_NT in paged.cu
MAX_LEN = 2**30
# (q kind, K/V kind) -> kernel suffix (paged.cu's instantiations): same type, f32 q over a 16-bit cache,
# any q over an FP8 cache.
SUFFIX = {("f32", "f32"): "", ("bf16", "bf16"): "_bf16", ("f16", "f16"): "_f16",
          ("f32", "bf16"): "_bf16kv", ("f32", "f16"): "_f16kv",
          **{(q, f): f"{arrays.kernel_suffix(q)}_{f}kv" for q in ("f32", "bf16", "f16") for f in ("e4m3", "e5m2")}}
Q_KINDS = ("f32", "bf16", "f16")


def suffix(q_kind: str, kv_kind: str) -> str:
    try:
        return SUFFIX[(q_kind, kv_kind)]
    except KeyError:
        names = arrays.IO_DTYPES
        raise ArgumentTypeError(f"q: a {names[q_kind]} query needs {names[q_kind]} or FP8 K/V (expected q float32 "
                                f"for {names.get(kv_kind, kv_kind)} K/V), got q {names[q_kind]} with "
                                f"{names.get(kv_kind, kv_kind)} K/V") from None


def check_indptr(name: str, h: np.ndarray | None, limit: int, limit_name: str, exact: bool = False) -> None:
    if h is None:
        return
    if h.size and int(h[0]) < 0:
        raise ArgumentError(f"{name}: expected {name}[0] >= 0, got {int(h[0])}")
    if h.size > 1:
        diff = np.diff(h.astype(np.int64))
        if (diff < 0).any():
            i = int(np.argmax(diff < 0))
            raise ArgumentError(f"{name}: expected a non-decreasing array, got {name}[{i}]={int(h[i])} > "
                                f"{name}[{i + 1}]={int(h[i + 1])}")
    last = int(h[-1]) if h.size else 0
    if exact and (last != limit or int(h[0]) != 0):
        raise ArgumentError(f"{name}: expected {name}[0] == 0 and {name}[-1] == {limit_name}={limit}, "
                            f"got {int(h[0])} and {last}")
    if last > limit:
        raise ArgumentError(f"{name}: expected {name}[-1] <= {limit_name}={limit}, got {last}")


def check_q(q: Any, kvh: int, d: int, lead_name: str) -> tuple[str, int, int]:
    kind = arrays.io_kind("q", q, Q_KINDS)
    n, h, qd = arrays.check_ndim("q", q, (3,), f"({lead_name}, num_heads, head_dim)")
    if qd != d:
        raise ArgumentError(f"q: expected shape ({lead_name}, num_heads, {d}) (head_dim {d} from the K/V), got "
                            f"{(n, h, qd)}")
    if h < 1 or h % kvh:
        raise ArgumentError(f"q: expected num_heads a multiple of num_kv_heads={kvh}, got num_heads={h}")
    return kind, n, h


def dummy(like: Any, dtype: str = "f32") -> Any:
    return arrays.empty((1,), dtype, like=like)


def row_chunks(name: str, max_qo: int, group: int, rows: int) -> int:
    chunks = max(1, -(-(max_qo * group) // rows))
    if chunks > GRID_YZ_MAX:
        raise ArgumentError(f"{name}: expected at most {GRID_YZ_MAX * rows // group} queries a sequence "
                            f"(grid y limit), got {max_qo}")
    return chunks


def prefill_out(total_q: int, h: int, d: int, kind: str, like: Any, exact: bool) -> tuple[Any, Any]:
    # Rows outside qo_indptr are never written: zero them when the indptr could not be checked.
    alloc = arrays.empty if exact else arrays.zeros
    out = alloc((total_q, h, d), kind, like=like)
    lse = arrays.empty((total_q, h), "f32", like=like) if exact else arrays.zeros((total_q, h), "f32", like=like)
    return out, lse


def check_cu_seqlens(name: str, cu: Any, length: int | None, length_of: str, total: int,
                     total_name: str) -> tuple[Any, np.ndarray | None]:
    """(int32 array for the kernels, host copy or None) of flash-attn's cu_seqlens: int32, 1-D, [0] == 0,
    non-decreasing, [-1] == total (checked where the values are on the host; device arrays are trusted, as
    flash-attn trusts them, and their outputs start from zeros)."""
    from ._common import index_array

    if isinstance(cu, (list, tuple)) or arrays.dtype_name(cu, name) != "int32":
        got = type(cu).__name__ if isinstance(cu, (list, tuple)) else f"dtype {arrays.dtype_name(cu, name)}"
        raise ArgumentTypeError(f"{name}: expected an int32 array (flash-attn's cu_seqlens), got {got}")
    dev, host = index_array(name, cu, length, length_of)
    n = arrays.shape_of(dev)[0]
    if n < 2:
        raise ArgumentError(f"{name}: expected shape (batch + 1,) with batch >= 1, got {(n,)}")
    check_indptr(name, host, total, total_name, exact=True)
    return dev, host


def check_max_seqlen(name: str, value: Any, host: np.ndarray | None, cu_name: str) -> int:
    """max_seqlen_q / _k: the grid's extent. None takes the longest sequence of a host cu_seqlens; a given value
    must cover it (a shorter one would leave rows without a CTA)."""
    longest = int(np.diff(host.astype(np.int64)).max()) if host is not None else None
    if value is None:
        if longest is None:
            raise ArgumentError(f"{name}: expected an int when {cu_name} is on the device (the grid is sized from "
                                f"it without reading {cu_name} back), got None")
        return longest
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{name}: expected an int >= 0, got {type(value).__name__} {value!r}")
    value = int(value)
    if not 0 <= value <= 2**31 - 1 - 256:
        raise ArgumentError(f"{name}: expected 0 <= value <= {2**31 - 1 - 256}, got {value}")
    if longest is not None and value < longest:
        raise ArgumentError(f"{name}: expected at least the longest sequence of {cu_name} ({longest}), got {value}")
    return value
