"""Helpers of the difftest cases of sm_90a kernels (attention, MLA decode, grouped GEMMs, FP8 GEMMs): each case
declares `arch="sm_90a"`; on the host backend its run plays that arch (PYKERN_HOST_ARCH=sm_90a, the emulation of
pykern/host/pk_host_sm90.cpp); the runner reports the numba backend (no wgmma / TMA) and the nvrtc backend (the
cases' inputs are NumPy) as not applicable. An op helper that declines the launch is an error, never a fallback."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..case import Case

ARCH = "sm_90a"


@contextmanager
def host_arch(backend: str) -> Iterator[None]:
    """On the host backend: PYKERN_HOST_ARCH=sm_90a for the call (the ops' helpers then take the sm_90a kernels,
    and launching one is allowed); elsewhere nothing changes (the helpers decline and the case says so)."""
    if backend != "host":
        yield
        return
    old = os.environ.get("PYKERN_HOST_ARCH")
    os.environ["PYKERN_HOST_ARCH"] = ARCH
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYKERN_HOST_ARCH", None)
        else:
            os.environ["PYKERN_HOST_ARCH"] = old


def declined(kernel: str, backend: str) -> Exception:
    from ...errors import ArgumentError

    return ArgumentError(f"backend: expected one that runs {ARCH} kernels (host with "
                         f"PYKERN_HOST_ARCH={ARCH}, "
                         f"or nvrtc on a compute-capability 9.0 GPU with device arrays) for {kernel}, got "
                         f"{backend!r}: the op's sm_90a helper declined the launch")


def sm90_case(op: str, kind: str, shape: str, kernels: tuple[str, ...], run: Callable[[str], dict[str, Any]],
               reference: Callable[[], dict[str, Any]]) -> Case:
    def on_arch(backend: str) -> dict[str, Any]:
        with host_arch(backend):
            return run(backend)

    # "-sm90a" in the shape: the id says which kernels ran (the mma.sync cases have the same shapes' names)
    return Case(op=op, dtype=kind, shape=f"{shape}-sm90a", kernels=kernels, run=on_arch, reference=reference,
                arch=ARCH)


def sfx(kind: str) -> str:
    from ...arrays import kernel_suffix

    return kernel_suffix(kind)
