"""Which CUDA device and stream an array, an op or a launch belongs to, read from the arrays themselves.

The one place that knows how each array kind says where it lives (a torch tensor's `.device`, CuPy's
`.device.id`; other `__cuda_array_interface__` pointers are asked of the driver by the nvrtc backend)
and how a stream object gives its CUstream handle. torch and CuPy are never imported here: an array of
theirs can only exist once the caller imported them. pykern.arrays and the backends import this module;
it imports neither.
"""
from __future__ import annotations

import sys
from itertools import chain
from typing import Any, Callable, Sequence

import numpy as np

from .errors import ArgumentError, ArgumentTypeError


def stream_handle(stream: Any) -> int:
    """The CUstream handle (an int) of `stream`: None (legacy default stream), an int, or an object
    exposing `__cuda_stream__` (cuda.core protocol: (version, handle)) or `.cuda_stream` (torch)."""
    if stream is None:
        return 0
    if type(stream) is int:
        if stream < 0:
            raise ArgumentError(f"stream: expected a non-negative CUstream handle, got {stream}")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        try:
            return int(value[1])
        except (TypeError, ValueError, IndexError):
            raise ArgumentTypeError(
                f"stream: __cuda_stream__ of {type(stream).__name__} should give (version, handle), got {value!r}"
            ) from None
    handle = getattr(stream, "cuda_stream", None)
    if handle is not None:
        return int(handle)
    if isinstance(stream, np.integer) or type(stream).__name__ == "CUstream":
        return stream_handle(int(stream))
    raise ArgumentTypeError(
        "stream: expected None, an int CUstream handle, or an object with __cuda_stream__ or .cuda_stream, "
        f"got {type(stream).__name__}"
    )


# What array_device returns for memory no CUDA device holds.
HOST = -1
# What array_device returns for a torch `meta` tensor: no storage at all, so nothing can run on it.
META = -2


def _module(a: Any) -> str:
    return type(a).__module__.split(".")[0]


def array_device(a: Any) -> int | None:
    """Where `a` lives, as far as the array itself says: a CUDA ordinal, HOST (NumPy, CPU tensors, host
    DLPack objects), META (a torch meta tensor), or None for a device array that does not say (a plain
    `__cuda_array_interface__` object: its pointer's device is the driver's to tell)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        dev = a.device
        if dev.type == "cuda":
            return dev.index if dev.index is not None else torch.cuda.current_device()
        return META if dev.type == "meta" else HOST
    if isinstance(a, np.ndarray) or not hasattr(a, "__cuda_array_interface__"):
        return HOST
    if _module(a) == "cupy":
        return cupy_device(a)
    return None


def cupy_device(a: Any) -> int | None:
    """The ordinal of a CuPy array's device (None when it does not carry one)."""
    d = getattr(getattr(a, "device", None), "id", None)  # CuPy arrays carry their cupy.cuda.Device
    return None if d is None else int(d)


def where(device: int) -> str:
    """How an error names a device: "cuda:1", "meta", "the host"."""
    if device == META:
        return "meta"
    return "the host" if device == HOST else f"cuda:{device}"


def mixed_devices(first: str, d1: int, second: str, d2: int) -> ArgumentError:
    """The error for two arrays of one call on different devices."""
    return ArgumentError(
        f"{second}: expected the device of {first} ({where(d1)}), got an array on {where(d2)}: the arrays of one "
        "call must live on one CUDA device (move them with .to(device) / cupy.asarray under cupy.cuda.Device)"
    )


def meta_tensor(name: str) -> ArgumentTypeError:
    return ArgumentTypeError(f"{name}: expected a CPU or CUDA tensor, got one on the meta device (it has no data "
                             "to compute on)")


def _param_names(fn: Callable[..., Any], n: int) -> list[str]:
    """The names of `fn`'s first n positional parameters (only computed for an error message)."""
    import inspect

    try:
        names = [p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    return [names[i] if i < len(names) else f"argument {i}" for i in range(n)]


def op_device(fn: Callable[..., Any], args: Sequence[Any], kw: dict[str, Any]) -> Any:
    """The torch CUDA device of an op call (positional and keyword arguments alike), or None.

    Checked before the op allocates anything: a `meta` tensor, or torch / CuPy device arrays on two
    different CUDA devices, raise naming the arguments. CPU tensors and NumPy arrays beside CUDA ones are
    the op's business (host-side index arrays are allowed). About 150 ns per tensor argument."""
    torch = sys.modules.get("torch")
    tensor = torch.Tensor if torch is not None else ()
    cupy = "cupy" in sys.modules
    found: Any = None  # the first torch CUDA device
    first, first_d = -1, -1  # the first device array: its position (args, then kw) and device
    i = -1
    for a in chain(args, kw.values()) if kw else args:
        i += 1
        if isinstance(a, tensor):
            # is_cuda / is_meta / get_device(): ~50 ns each, where .device builds an object (~300 ns)
            if not a.is_cuda:
                if a.is_meta:
                    raise meta_tensor(_name(fn, args, kw, i))
                continue  # CPU (the op's business), or another backend torch has
            d = a.get_device()
            if found is None:
                found = a.device
        elif cupy and type(a).__module__.startswith("cupy") and hasattr(a, "__cuda_array_interface__"):
            d = cupy_device(a)
            if d is None:
                continue
        else:
            continue
        if first < 0:
            first, first_d = i, d
        elif d != first_d:
            raise mixed_devices(_name(fn, args, kw, first), first_d, _name(fn, args, kw, i), d)
    return found


def _name(fn: Callable[..., Any], args: Sequence[Any], kw: dict[str, Any], i: int) -> str:
    """The name of the i-th argument of a call (positional ones, then keywords)."""
    if i >= len(args):
        return list(kw)[i - len(args)]
    return _param_names(fn, len(args))[i]


def current_device() -> int | None:
    """torch's current CUDA device when torch is loaded and its CUDA state initialised, else None (the
    nvrtc backend then asks the driver which context is current)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:  # a torch without CUDA support
        return None
    return None


__all__ = ["HOST", "META", "array_device", "current_device", "mixed_devices", "op_device", "stream_handle", "where"]
