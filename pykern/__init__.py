"""pykern: CUDA-C kernels for LLM training and inference, compiled at run time with NVRTC.

`import pykern` stays cheap: numba, cuda.bindings and the ops load on first use.
"""
from __future__ import annotations

from typing import Any

from .errors import (
    ArgumentError,
    ArgumentTypeError,
    BackendUnavailable,
    CacheMiss,
    CompileError,
    KernelExecutionError,
    KernelNotFound,
    LayoutMismatch,
    PykernError,
    RegistryError,
)

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "ArgumentTypeError", "BackendUnavailable", "CacheMiss", "CompileError",
    "KernelExecutionError", "KernelNotFound", "KernelSpec", "LayoutMismatch", "Param",
    "PykernError", "RegistryError", "kernels", "launch", "ops",
]


_LAZY = {
    "launch": ("launcher", "launch"),
    "kernels": ("registry", "kernels"),
    "KernelSpec": ("registry", "KernelSpec"),
    "Param": ("registry", "Param"),
    "ops": ("ops", None),
}


def __getattr__(name: str) -> Any:
    # numpy and the launcher load on first use; the result is cached as a module global.
    try:
        mod_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'pykern' has no attribute {name!r}") from None
    import importlib

    mod = importlib.import_module(f".{mod_name}", __name__)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
