"""Backend lookup and the default choice: nvrtc on a usable GPU, else numba on a GPU, else host."""
from __future__ import annotations

import importlib
import logging
import os
import warnings

from ..errors import ArgumentError, BackendUnavailable
from ..log import configure as _log_configure
from .base import Backend

log = logging.getLogger("pykern")
_log_configure()


class BackendWarning(UserWarning):
    """A GPU is present but pykern runs elsewhere (the nvrtc backend is unusable, and why)."""

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


def nvidia_gpus_listed() -> int:
    """GPUs the NVIDIA kernel driver lists in /proc (Linux): present even when the CUDA user-space
    driver is too old for the bindings, or fails to initialize. 0 where there is no such folder."""
    try:
        return sum(1 for _ in os.scandir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def default_backend_name() -> str:
    """The backend used when none is named (decided once per process).

    A GPU that the CUDA driver reports while the nvrtc backend is unusable (NVRTC missing or too new
    for the driver, ...) is never passed over silently: one BackendWarning names why and where the
    kernels run instead. PYKERN_BACKEND=nvrtc turns that into an error at the first launch.
    """
    global _default
    if _default is None:
        nv = _instance("nvrtc")
        ok, why = nv.available()
        if ok:
            _default = "nvrtc"
            log.info("pykern: backend nvrtc (GPU %s)", getattr(nv, "arch", "?"))
        else:
            gpu = getattr(nv, "arch", "")  # set once the driver has reported a device
            listed = 0 if gpu else nvidia_gpus_listed()  # a GPU the CUDA driver could not even report
            numba_be = _instance("numba")
            on_gpu = getattr(numba_be, "on_gpu", lambda: False)()
            _default = "numba" if on_gpu else "host"
            if gpu or listed or on_gpu:
                where = ("numba (its numba.cuda reference kernels on the GPU)" if on_gpu
                         else "host (the CPU emulator: far slower than the GPU)")
                warnings.warn(
                    f"pykern: a CUDA GPU{f' ({gpu})' if gpu else ''} is present"
                    f"{' (listed in /proc/driver/nvidia/gpus)' if listed else ''} but the nvrtc backend is unusable "
                    f"({why}); running on the {where} backend. Set PYKERN_BACKEND=nvrtc to make this an error",
                    BackendWarning, stacklevel=3,
                )
            log.info("pykern: backend %s (nvrtc unusable: %s)", _default, why)
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


__all__ = ["Backend", "BackendUnavailable", "BackendWarning", "NAMES", "get_backend", "default_backend_name"]


def arch_features(backend: str | None = None, device: int = 0) -> tuple[str, ...]:
    """The arch-specific (`a`) targets whose kernels can run on `backend` (default: the default one) and
    `device`: ("sm_90a",) on an H100/H200 with the nvrtc backend or with PYKERN_HOST_ARCH=sm_90a on the host
    backend, () elsewhere (numba, other GPUs). Ops call it to pick the Hopper kernels over the mma.sync ones."""
    be = get_backend(backend)
    fn = getattr(be, "arch_features", None)
    return tuple(fn(device)) if fn is not None else ()


def kernel_variant(arch: str = "sm_90a", backend: str | None = None, device: int = 0) -> bool:
    """True when kernels built for the arch-specific target `arch` are usable now (see arch_features)."""
    return arch in arch_features(backend, device)
