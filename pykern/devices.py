"""Which CUDA device and stream an array, an op or a launch belongs to, read from the arrays themselves.

The one place that knows how each array kind says where it lives (a torch tensor's `.device`, CuPy's
`.device.id`; other `__cuda_array_interface__` pointers are asked of the driver by the nvrtc backend)
and how a stream object gives its CUstream handle. torch and CuPy are never imported here: an array of
theirs can only exist once the caller imported them. pykern.arrays and the backends import this module;
it imports neither.
"""
from __future__ import annotations

import sys
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
        return _cupy_device(a)
    return None


def _cupy_device(a: Any) -> int | None:
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
    the op's business (host-side index arrays are allowed). Costs one isinstance per argument."""
    torch = sys.modules.get("torch")
    tensor = torch.Tensor if torch is not None else ()
    cupy = "cupy" in sys.modules
    found: Any = None  # the first torch CUDA device
    first: tuple[Any, int] | None = None  # (where it was: index or keyword, ordinal)
    items: Any = enumerate(args)
    for pass_ in (0, 1):
        for key, a in items:
            if isinstance(a, tensor):
                t = a.device.type
                if t == "cpu":
                    continue
                if t == "meta":
                    raise meta_tensor(_name(fn, key, len(args)))
                if t != "cuda":
                    continue
                d = a.device.index
                if d is None:
                    d = torch.cuda.current_device()
                if found is None:
                    found = a.device
            elif cupy and type(a).__module__.startswith("cupy") and hasattr(a, "__cuda_array_interface__"):
                d = _cupy_device(a)
                if d is None:
                    continue
            else:
                continue
            if first is None:
                first = (key, d)
            elif d != first[1]:
                raise mixed_devices(_name(fn, first[0], len(args)), first[1], _name(fn, key, len(args)), d)
        if pass_ == 0:
            if not kw:
                break
            items = kw.items()
    return found


def _name(fn: Callable[..., Any], key: Any, n: int) -> str:
    return key if isinstance(key, str) else _param_names(fn, n)[key]


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
