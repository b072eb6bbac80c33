"""The GPU backend: NVRTC cubins (via pykern.cache) loaded and launched through the CUDA driver.

Everything the driver sees goes through one `Driver` (pykern/backends/driver.py), so the
whole path — load cubin, get function, pack parameters, launch, copy NumPy arrays in and
out — runs against a recording fake in the tests. The hot path is kept lean: per kernel
spec a `_Plan` holds the function handle and the parameter layout, so a launch only fills
two small ctypes arrays and calls the driver.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..arrays import DeviceView as _DeviceView
from ..errors import ArgumentError, ArgumentTypeError, BackendUnavailable
from ..registry import KernelSpec
from .driver import DEFAULT_MAX_DYNAMIC_SHARED, CudaDriver, Driver, arch_of

_addressof = ctypes.addressof
_ndarray = np.ndarray


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


class _Plan:
    """Per-spec launch data, built once: the function handle and how to pack each parameter."""

    __slots__ = ("spec", "func", "n", "ptr_idx", "val_idx", "copy_back", "params_type", "storage_type", "smem_set",
                 "static_smem")

    def __init__(self, spec: KernelSpec, func: Any, static_smem: int = 0) -> None:
        self.spec = spec
        self.func = func
        self.static_smem = static_smem  # __shared__ arrays: the block's dynamic share is what is left
        self.n = len(spec.params)
        self.ptr_idx = tuple(i for i, p in enumerate(spec.params) if p.is_pointer)
        self.val_idx = tuple(i for i, p in enumerate(spec.params) if not p.is_pointer)
        # Only arrays the kernel may write travel back to the host.
        self.copy_back = tuple(not spec.params[i].is_const for i in self.ptr_idx)
        self.params_type = ctypes.c_void_p * max(self.n, 1)
        self.storage_type = ctypes.c_uint64 * max(len(self.ptr_idx), 1)
        self.smem_set = DEFAULT_MAX_DYNAMIC_SHARED


def _default_get_module(source: Any, arch: str, kernel: str | None = None) -> Any:
    from .. import cache  # compiles (or finds on disk) the cubin; heavy, so imported on first launch

    # compatible: an sm_80 cubin in the bundle or cache runs on this sm_86 GPU, so use it before compiling.
    return cache.get_module(source, arch, kernel=kernel, compatible=True)


def target_arch(device_arch: str, supported: Sequence[str]) -> str:
    """What to compile for: the device's own sm_XX when NVRTC knows it, else PTX (compute_XX) of the
    newest arch NVRTC knows below it, which the driver JIT-compiles for the newer GPU."""
    if device_arch in supported:
        return device_arch
    num = int(device_arch[3:])
    older = [int(a[3:]) for a in supported if int(a[3:]) <= num]
    if not older:
        raise BackendUnavailable(
            f"nvrtc backend: this NVRTC cannot target the GPU's {device_arch} (it knows {', '.join(supported)})"
        )
    return f"compute_{max(older)}"


def _supported_archs() -> tuple[str, ...]:
    from .. import compiler

    return compiler.supported_archs()


class NvrtcBackend:
    """`Backend` over NVRTC cubins and the CUDA driver's primary context of one device."""

    name = "nvrtc"

    def __init__(
        self,
        driver_factory: Callable[[], Driver] = CudaDriver,
        device: int = 0,
        get_module: Callable[..., Any] | None = None,
        supported_archs: Callable[[], Sequence[str]] = _supported_archs,
    ) -> None:
        """driver_factory makes the `Driver` on first use (tests pass a fake); get_module(source, arch,
        kernel=name) returns an object with `.image` and `.digest` (default: pykern.cache.get_module);
        supported_archs lists what NVRTC can emit cubins for (default: pykern.compiler's)."""
        self._driver_factory = driver_factory
        self._device = device
        self._get_module = get_module or _default_get_module
        self._supported_archs = supported_archs
        self._target = ""  # what get_module is asked for (see target_arch)
        self._lock = threading.Lock()
        self._driver: Driver | None = None
        self._unavailable: BackendUnavailable | None = None
        self._ctx: Any = None
        self.arch = ""
        self._max_smem = DEFAULT_MAX_DYNAMIC_SHARED
        self._modules: dict[tuple[int, str], Any] = {}  # (context, cubin digest) -> module
        self._functions: dict[tuple[int, str], Any] = {}  # (module, kernel name) -> function
        # Keyed by id(spec): hashing a frozen KernelSpec rehashes every Param on each lookup, and a
        # plan is only reused for the very spec object it was built for (checked with `is`).
        self._plans: dict[int, _Plan] = {}

    # -- setup -------------------------------------------------------------------------

    def _start(self) -> Driver:
        """Init the driver and retain the primary context once; remember why not, if not."""
        with self._lock:
            if self._driver is not None:
                return self._driver
            if self._unavailable is not None:
                raise self._unavailable
            try:
                drv = self._driver_factory()
                drv.init()
                count = drv.device_count()
                if count < 1:
                    raise BackendUnavailable("nvrtc backend: the CUDA driver reports no GPU")
                if not 0 <= self._device < count:
                    raise BackendUnavailable(f"nvrtc backend: device {self._device} requested, {count} present")
                self.arch = arch_of(drv.compute_capability(self._device))
                self._max_smem = drv.max_shared_per_block_optin(self._device)
                self._ctx = drv.primary_context(self._device)
            except BackendUnavailable as e:
                self._unavailable = e
                raise
            except Exception as e:  # a driver that loads but fails to init is just as unusable
                self._unavailable = BackendUnavailable(f"nvrtc backend: CUDA driver unusable ({type(e).__name__}: {e})")
                raise self._unavailable from e
            self._driver = drv
            return drv

    def available(self) -> tuple[bool, str]:
        try:
            self._start()
        except BackendUnavailable as e:
            return False, str(e)
        from ..cache import bundle_dir

        if bundle_dir() is None:  # a precompiled bundle serves launches without NVRTC
            try:
                self._supported_archs()
            except Exception as e:  # BackendUnavailable, or a library that fails on first call
                return False, f"nvrtc backend: a GPU is present but NVRTC is unusable ({e})"
        return True, ""

    def _plan(self, spec: KernelSpec) -> _Plan:
        drv = self._start()
        with self._lock:
            plan = self._plans.get(id(spec))
            if plan is not None and plan.spec is spec:
                return plan
            # A new spec object (registry refreshed): ask the cache again, which notices edited sources.
            drv.set_current(self._ctx)
            if not self._target:
                try:
                    supported = tuple(self._supported_archs())
                except Exception:  # no NVRTC here: a precompiled bundle (PYKERN_CUBIN_DIR) may still serve
                    supported = (self.arch,)
                self._target = target_arch(self.arch, supported)
            cached = self._get_module(spec.source, self._target, kernel=spec.name)
            mkey = (int(self._ctx), cached.digest)
            module = self._modules.get(mkey)
            if module is None:
                module = drv.module_load_data(cached.image)
                self._modules[mkey] = module
            fkey = (int(module), spec.name)
            func = self._functions.get(fkey)
            if func is None:
                func = drv.module_get_function(module, spec.name)
                self._functions[fkey] = func
            res = (getattr(cached, "resources", None) or {}).get(spec.name)
            plan = _Plan(spec, func, int(getattr(res, "shared_bytes", 0) or 0))
            # The plan holds `spec`, so its id is not reused meanwhile; a stale plan of the same
            # kernel (from before a registry refresh) is dropped so plans do not pile up.
            for key in [k for k, p in self._plans.items() if p.spec.name == spec.name]:
                del self._plans[key]
            self._plans[id(spec)] = plan
            return plan

    def function(self, spec: KernelSpec) -> Any:
        """The driver function handle of `spec` (loading its module on first use)."""
        return self._plan(spec).func

    # -- launch ------------------------------------------------------------------------

    def launch(
        self,
        spec: KernelSpec,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
        shared_mem: int,
        stream: Any,
    ) -> None:
        plan = self._plans.get(id(spec))
        if plan is None or plan.spec is not spec:
            plan = self._plan(spec)
        drv: Driver = self._driver  # type: ignore[assignment]  # set by _plan
        h = 0 if stream is None else stream_handle(stream)
        drv.set_current(self._ctx)
        if shared_mem > plan.smem_set:
            self._opt_in_shared(plan, shared_mem)

        # kernelParams[i] points at argument i's bytes: the ctypes scalar the launcher made for a
        # value, a slot of `storage` holding the device address for a pointer. Both stay referenced
        # by locals until cuLaunchKernel has copied them.
        params = plan.params_type()
        storage = plan.storage_type()
        base = _addressof(storage)
        staged: list[list[Any]] | None = None  # [array, device pointer, copy back]
        try:
            for k, i in enumerate(plan.ptr_idx):
                a = args[i]
                if type(a) is _ndarray:
                    if staged is None:
                        staged = []
                    ptr = self._stage_in(drv, a, h, plan.copy_back[k], staged)
                elif type(a) is _DeviceView:  # torch CUDA tensor: the op already chose the stream
                    ptr = a.ptr
                else:
                    cai = a.__cuda_array_interface__
                    ptr = cai["data"][0]
                    s = cai.get("stream")
                    if s is not None and s != h and not (s == 1 and h == 0):
                        drv.stream_synchronize(s)  # the producer's work must finish before ours reads
                storage[k] = ptr
                params[i] = base + 8 * k
            for i in plan.val_idx:
                params[i] = _addressof(args[i])
            drv.launch_kernel(plan.func, grid, block, shared_mem, h, _addressof(params))
            if staged:
                for a, dptr, back in staged:
                    if back and dptr:
                        drv.memcpy_dtoh_async(a.ctypes.data, dptr, a.nbytes, h)
                # NumPy results are host memory: the call is synchronous for them.
                drv.stream_synchronize(h)
        except BaseException:
            if staged:
                self._free(drv, staged, quiet=True)  # the launch error is the one to report
            raise
        if staged:
            self._free(drv, staged)

    @staticmethod
    def _stage_in(drv: Driver, a: np.ndarray, h: int, back: bool, staged: list) -> int:
        for entry in staged:
            if entry[0] is a:
                # The same array twice (in-place use): one device copy, as on the GPU the kernel
                # sees one buffer; copied back once if any of its parameters may write.
                entry[2] = entry[2] or back
                return entry[1]
        n = a.nbytes
        if n == 0:
            staged.append([a, 0, back])
            return 0  # nothing to read or write: a null pointer is what an empty device array is
        dptr = drv.mem_alloc(n)
        staged.append([a, dptr, back])
        drv.memcpy_htod_async(dptr, a.ctypes.data, n, h)  # outputs too: kernels may read-modify-write
        return dptr

    @staticmethod
    def _free(drv: Driver, staged: list, quiet: bool = False) -> None:
        err: BaseException | None = None
        for _, dptr, _ in staged:
            if dptr:
                try:
                    drv.mem_free(dptr)
                except Exception as e:  # free the rest; report the first failure
                    err = err or e
        if err is not None and not quiet:
            raise err

    def _opt_in_shared(self, plan: _Plan, shared_mem: int) -> None:
        limit = self._max_smem - plan.static_smem
        if shared_mem > limit:
            static = ""
            if plan.static_smem:
                static = f" ({plan.static_smem} of the {self._max_smem} go to static __shared__)"
            raise ArgumentError(
                f"shared_mem: expected at most {limit} bytes for {plan.spec.name} on this device "
                f"({self.arch}){static}, got {shared_mem}"
            )
        assert self._driver is not None
        self._driver.set_max_dynamic_shared(plan.func, shared_mem)
        plan.smem_set = shared_mem


def create() -> NvrtcBackend:
    """The process-wide nvrtc backend; construction never touches the driver (available() does)."""
    return NvrtcBackend()
