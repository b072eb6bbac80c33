"""Array helpers for ops: dtype names, bf16, and allocating outputs next to the inputs."""
from __future__ import annotations

from typing import Any

import numpy as np

from .errors import ArgumentError, ArgumentTypeError


def bfloat16() -> np.dtype:
    """ml_dtypes.bfloat16 (imported on first use; MissingDependency names the extra when absent)."""
    try:
        import ml_dtypes
    except ImportError:
        from .errors import MissingDependency

        raise MissingDependency("ml_dtypes", "test", "bfloat16 NumPy arrays") from None

    return np.dtype(ml_dtypes.bfloat16)


def dtype_name(a: Any) -> str:
    """NumPy dtype name of a NumPy or CUDA-array-interface array ("float32", "bfloat16", ...)."""
    if isinstance(a, np.ndarray):
        return a.dtype.name
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        from .ctypes_ import TYPESTR

        ts = cai["typestr"]
        return TYPESTR.get(ts[1:], ts)
    raise ArgumentTypeError(f"expected an array, got {type(a).__name__}")


def io_kind(name: str, a: Any, allowed: tuple[str, ...] = ("f32", "bf16")) -> str:
    """"f32" or "bf16" for a float32 / bfloat16 array, else an error naming the argument."""
    kinds = {"float32": "f32", "bfloat16": "bf16"}
    k = kinds.get(dtype_name(a))
    if k not in allowed:
        want = " or ".join({"f32": "float32", "bf16": "bfloat16"}[x] for x in allowed)
        raise ArgumentTypeError(f"{name}: expected dtype {want}, got {dtype_name(a)}")
    return k


def shape_of(a: Any) -> tuple[int, ...]:
    if isinstance(a, np.ndarray):
        return a.shape
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        return tuple(cai["shape"])
    raise ArgumentTypeError(f"expected an array, got {type(a).__name__}")


def check_ndim(name: str, a: Any, ndims: tuple[int, ...]) -> tuple[int, ...]:
    shp = shape_of(a)
    if len(shp) not in ndims:
        want = " or ".join(str(n) for n in ndims)
        raise ArgumentError(f"{name}: expected {want} dimensions, got shape {shp}")
    return shp


def contiguous(a: Any) -> Any:
    """A C-contiguous version of a NumPy array (device arrays are returned as given)."""
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a)
    return a


def _resolve(dtype: Any) -> np.dtype:
    if isinstance(dtype, str) and dtype in ("bf16", "bfloat16"):
        return bfloat16()
    if isinstance(dtype, str) and dtype == "f32":
        return np.dtype(np.float32)
    return np.dtype(dtype)


def empty(shape: tuple[int, ...], dtype: Any, like: Any = None) -> Any:
    """Uninitialized output on the same kind of memory as `like` (NumPy, torch or CuPy)."""
    dt = _resolve(dtype)
    if like is None or isinstance(like, np.ndarray):
        return np.empty(shape, dt)
    mod = type(like).__module__.split(".")[0]
    if mod == "torch":
        import torch

        tdt = torch.bfloat16 if dt.name == "bfloat16" else getattr(torch, dt.name)
        return torch.empty(shape, dtype=tdt, device=like.device)
    if mod == "numba":  # numba.cuda device arrays (GPU, or the simulator's stand-ins)
        from numba import cuda

        return cuda.device_array(shape, dtype=np.uint16 if dt.name == "bfloat16" else dt)
    if mod == "cupy":
        import cupy

        if dt.name == "bfloat16":
            return cupy.empty(shape, dtype=cupy.uint16)
        return cupy.empty(shape, dtype=dt)
    raise ArgumentTypeError(f"cannot allocate an output like {type(like).__name__}; pass NumPy, torch or CuPy arrays")


def zeros(shape: tuple[int, ...], dtype: Any, like: Any = None) -> Any:
    if like is not None and type(like).__module__.split(".")[0] == "numba":
        from numba import cuda

        host = np.zeros(shape, _resolve(dtype))
        return cuda.to_device(host.view(np.uint16) if host.dtype.name == "bfloat16" else host)
    out = empty(shape, dtype, like)
    if isinstance(out, np.ndarray):
        out.fill(0)
    else:
        out.zero_() if hasattr(out, "zero_") else out.fill(0)
    return out


UINT_MAX = 2**32 - 1


def size(shape: tuple[int, ...]) -> int:
    """Element count of a shape, in Python ints (no 32-bit overflow)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def check_u32(name: str, value: int) -> None:
    """A size that reaches a kernel as `unsigned int` must fit in 32 bits."""
    if value > UINT_MAX:
        raise ArgumentError(f"{name}: expected at most {UINT_MAX}, got {value}")


def same_kind(name: str, a: Any, kind: str, ref_name: str) -> None:
    """`a` must have the same I/O dtype ("f32" | "bf16") as the argument `ref_name`."""
    k = io_kind(name, a)
    if k != kind:
        raise ArgumentTypeError(f"{name}: expected the dtype of {ref_name} ({kind}), got {k}")


def kernel_suffix(kind: str) -> str:
    """Name suffix of a kernel's bf16 twin."""
    return "_bf16" if kind == "bf16" else ""
