"""Backend lookup and the default choice: nvrtc on a usable GPU, else numba on a GPU, else host."""
from __future__ import annotations

import importlib
import os
import warnings

from ..errors import ArgumentError, BackendUnavailable
from .base import Backend

NAMES = ("nvrtc", "numba", "host")
_instances: dict[str, Backend] = {}
_default: str | None = None


def _instance(name: str, what: str = "backend") -> Backend:
    be = _instances.get(name)
    if be is None:
        if name not in NAMES:
            raise ArgumentError(f"{what}: expected one of {', '.join(NAMES)}, got {name!r}")
        be = importlib.import_module(f"{__name__}.{name}").create()
        _instances[name] = be
    return be


def default_backend_name() -> str:
    """The backend used when none is named (decided once per process)."""
    global _default
    if _default is None:
        ok, why = _instance("nvrtc").available()
        if ok:
            _default = "nvrtc"
        else:
            numba_be = _instance("numba")
            on_gpu = getattr(numba_be, "on_gpu", lambda: False)()
            if on_gpu:
                warnings.warn(f"pykern: nvrtc backend unusable ({why}); falling back to numba", stacklevel=3)
                _default = "numba"
            else:
                _default = "host"
    return _default


def get_backend(name: str | None = None) -> Backend:
    """The named backend, else $PYKERN_BACKEND, else the default; raises BackendUnavailable with the reason."""
    if name is not None:
        return _instances.get(name) or _instance(name)
    env = os.environ.get("PYKERN_BACKEND")
    if env:
        # Name the variable: the caller passed no backend, so "backend: ..." would point nowhere.
        return _instances.get(env) or _instance(env, "PYKERN_BACKEND")
    return _instance(default_backend_name())


__all__ = ["Backend", "BackendUnavailable", "NAMES", "get_backend", "default_backend_name"]
