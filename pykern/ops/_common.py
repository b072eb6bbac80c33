"""Argument checks shared by op families (no family imports another's private names: they live here)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import arrays
from ..errors import ArgumentError, ArgumentTypeError


def dtype_is(name: str, a: Any, want: str) -> None:
    """ArgumentTypeError naming `name` unless `a`'s dtype is `want`."""
    got = arrays.dtype_name(a, name)
    if got != want:
        raise ArgumentTypeError(f"{name}: expected dtype {want}, got {got}")


def host_values(a: Any) -> np.ndarray | None:
    """The values of a host array (NumPy, CPU tensor) for validation, or None for device memory (never
    copied back: the kernels treat bad values safely and the caller keeps the device path sync-free)."""
    if not arrays.is_host(a):
        return None
    return arrays.host_view(a)


def check_offsets(offsets: Any, n_groups: int, m: int) -> Any:
    """Grouped-GEMM row offsets: int32 [n_groups + 1]; on the host also 0 first, `m` last and non-decreasing
    (device offsets are used as they are: the kernels treat decreasing ones as empty groups). Returns them
    contiguous."""
    dtype_is("offsets", offsets, "int32")
    if tuple(arrays.shape_of(offsets)) != (n_groups + 1,):
        raise ArgumentError(f"offsets: expected shape ({n_groups + 1},) (the groups of b + 1), "
                            f"got {tuple(arrays.shape_of(offsets))}")
    offsets = arrays.contiguous(offsets)
    v = host_values(offsets)
    if v is not None:
        if int(v[0]) != 0 or int(v[-1]) != m:
            raise ArgumentError(f"offsets: expected offsets[0] == 0 and offsets[-1] == {m} (rows of a), "
                                f"got {int(v[0])} and {int(v[-1])}")
        if n_groups and bool((np.diff(v.astype(np.int64)) < 0).any()):
            bad = int(np.argmax(np.diff(v.astype(np.int64)) < 0))
            raise ArgumentError(f"offsets: expected non-decreasing row starts, got offsets[{bad}] = {int(v[bad])} "
                                f"> offsets[{bad + 1}] = {int(v[bad + 1])}")
    return offsets


def norm_offset(offset: Any) -> float:
    """The validated `offset` of the RMSNorm ops (a finite number: 0 LLaMA, 1 Gemma)."""
    ok = isinstance(offset, (int, float, np.floating, np.integer)) and not isinstance(offset, bool)
    if not ok or not math.isfinite(float(offset)):
        raise ArgumentError(f"offset: expected a finite number, got {offset!r}")
    return float(offset)


def device_like(host: np.ndarray, like: Any) -> Any:
    """`host` on the same kind of memory as `like` (NumPy stays NumPy; the nvrtc backend stages it)."""
    if like is None or isinstance(like, np.ndarray):
        return host
    out = arrays.empty(host.shape, host.dtype, like)
    if type(out).__module__.split(".")[0] == "torch":
        import torch

        out.copy_(torch.from_numpy(host))
    else:
        out.set(host)  # CuPy
    return out


def ids_like(ids: Any, like: Any) -> Any:
    """Contiguous int64 indices next to `like`: converted on their own device; host indices for a
    device op are copied host-to-device (never the other way)."""
    ids = arrays.contiguous(arrays.astype(ids, "int64"))
    if arrays.is_host(ids) and not arrays.is_host(like):
        return device_like(np.ascontiguousarray(arrays.host_view(ids)), like)
    return ids
