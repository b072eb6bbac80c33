"""The GPU backend: NVRTC cubins (via pykern.cache) loaded and launched through the CUDA driver.

Everything the driver sees goes through one `Driver` (pykern/backends/driver.py), so the
whole path — load cubin, get function, pack parameters, launch, copy NumPy arrays in and
out — runs against a recording fake in the tests. The hot path is kept lean: per device and
kernel spec a `_Plan` holds the function handle and the parameter layout, so a launch only fills
two small ctypes arrays and calls the driver.

Devices: a launch runs on the device holding its arrays (pykern.devices; the driver's pointer
attribute for plain `__cuda_array_interface__` pointers), else on `device=`, else on the caller's
current device. Each device has its own primary context, arch, shared-memory limit, modules and
plans (a module loaded in one context is invalid in another; GPUs of two archs need two cubins).
The caller's current context is put back after every launch, so torch / CuPy keep theirs. On a
machine with one GPU none of the device lookups run.
"""
from __future__ import annotations

import ctypes
import json
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..arrays import DeviceView as _DeviceView
from ..devices import cupy_device
from ..devices import current_device, stream_handle
from ..errors import ArgumentError, BackendUnavailable
from ..registry import KernelSpec
from .driver import DEFAULT_MAX_DYNAMIC_SHARED, CudaDriver, Driver, arch_of

_addressof = ctypes.addressof
_ndarray = np.ndarray

class _Plan:
    """Per-(device, spec) launch data, built once: the function handle and how to pack each parameter."""

    __slots__ = ("spec", "func", "n", "ptr_idx", "val_idx", "copy_back", "params_type", "storage_type", "smem_set",
                 "static_smem")

    def __init__(self, spec: KernelSpec, func: Any, static_smem: int = 0) -> None:
        self.spec = spec
        self.func = func
        self.static_smem = static_smem  # __shared__ arrays: the block's dynamic share is what is left
        self.n = len(spec.params)
        self.ptr_idx = _pointer_params(spec)
        self.val_idx = tuple(i for i, p in enumerate(spec.params) if not p.is_pointer)
        # Only arrays the kernel may write travel back to the host.
        self.copy_back = tuple(not spec.params[i].is_const for i in self.ptr_idx)
        self.params_type = ctypes.c_void_p * max(self.n, 1)
        self.storage_type = ctypes.c_uint64 * max(len(self.ptr_idx), 1)
        # Without the opt-in attribute a block gets 48 KB of shared memory in all, static included: a kernel
        # with S static bytes may launch with at most 48 KB - S dynamic bytes before it must opt in.
        self.smem_set = max(0, DEFAULT_MAX_DYNAMIC_SHARED - static_smem)


def _pointer_params(spec: KernelSpec) -> tuple[int, ...]:
    return tuple(i for i, p in enumerate(spec.params) if p.is_pointer)


def _span(a: np.ndarray, p: int) -> tuple[int, int]:
    """[lo, hi) host bytes a non-empty strided array reaches from its data pointer p (np.byte_bounds)."""
    lo = hi = p
    for n, st in zip(a.shape, a.strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + a.itemsize


def _first_slot(group: list) -> int:
    return group[3]


def _label(spec: KernelSpec, i: int) -> str:
    p = spec.params[i]
    return f"{spec.name}: argument {i} ({p.ctype} {p.name})"


class _Device:
    """One GPU as the backend uses it: its primary context, arch and limits, and its plans."""

    __slots__ = ("ordinal", "ctx", "arch", "max_smem", "target", "plans", "pdl")

    def __init__(self, ordinal: int, ctx: Any, arch: str, max_smem: int) -> None:
        self.ordinal, self.ctx, self.arch, self.max_smem = ordinal, ctx, arch, max_smem
        # Programmatic dependent launch exists from sm_90; before it a PDL request is an ordinary launch (the
        # kernels' griddepcontrol wrappers compile to nothing there).
        self.pdl = int(arch[3:].rstrip("abf")) >= 90  # "sm_90", "sm_100", "sm_120"
        self.target = ""  # what get_module is asked for (see target_arch)
        # Keyed by id(spec): hashing a frozen KernelSpec rehashes every Param on each lookup, and a
        # plan is only reused for the very spec object it was built for (checked with `is`).
        self.plans: dict[int, _Plan] = {}


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


def bundle_serves(arch: str) -> bool:
    """True when the PYKERN_CUBIN_DIR bundle holds images that run on a GPU of `arch` (a cubin of a
    compatible arch, or PTX of an older one), by its manifest. A bundle without a readable manifest is
    trusted, as the cache lookup will tell at the first launch."""
    from ..cache import BUNDLE_MANIFEST, bundle_dir, compatible_archs

    root = bundle_dir()
    if root is None:
        return False
    try:
        entries = json.loads((root / BUNDLE_MANIFEST).read_text())["entries"]
        archs = {e["arch"] for e in entries}
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return bool(archs & set(compatible_archs(arch)))


class NvrtcBackend:
    """`Backend` over NVRTC cubins and the CUDA driver's primary context of each device."""

    name = "nvrtc"

    def __init__(
        self,
        driver_factory: Callable[[], Driver] = CudaDriver,
        device: int | None = None,
        get_module: Callable[..., Any] | None = None,
        supported_archs: Callable[[], Sequence[str]] = _supported_archs,
    ) -> None:
        """driver_factory makes the `Driver` on first use (tests pass a fake); device is the one GPU
        available() judges (default: every GPU; launches go wherever their arrays are either way);
        get_module(source, arch, kernel=name) returns an object with `.image` and `.digest` (default:
        pykern.cache.get_module); supported_archs lists what NVRTC can emit cubins for (default:
        pykern.compiler's)."""
        self._driver_factory = driver_factory
        self._device = device
        self._get_module = get_module or _default_get_module
        self._supported_archs = supported_archs
        self._lock = threading.Lock()
        self._driver: Driver | None = None
        self._unavailable: BackendUnavailable | None = None
        self._count = 0
        self._multi = False  # more than one GPU: only then are devices looked up per launch
        self._devs: list[_Device | None] = []
        self._single: _Device | None = None  # the only GPU's state, once opened: the hot path reads it directly
        self._ctx_ordinal: dict[Any, int] = {}  # primary context -> its device
        self._ptr_idx: dict[int, tuple[KernelSpec, tuple[int, ...]]] = {}  # id(spec) -> pointer parameters
        self.arch = ""  # the (first judged) GPU's arch, for messages
        self._modules: dict[tuple[int, str], Any] = {}  # (context, cubin digest) -> module
        self._functions: dict[tuple[int, str], Any] = {}  # (module, kernel name) -> function

    # -- setup -------------------------------------------------------------------------

    def _start(self) -> Driver:
        """Init the driver and count the GPUs once; remember why not, if not."""
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
                if self._device is not None and not 0 <= self._device < count:
                    raise BackendUnavailable(f"nvrtc backend: device {self._device} requested, {count} present")
            except BackendUnavailable as e:
                self._unavailable = e
                raise
            except Exception as e:  # a driver that loads but fails to init is just as unusable
                self._unavailable = BackendUnavailable(f"nvrtc backend: CUDA driver unusable ({type(e).__name__}: {e})")
                raise self._unavailable from e
            self._count = count
            self._multi = count > 1
            self._devs = [None] * count
            self._driver = drv
            return drv

    def _open(self, ordinal: int) -> _Device:
        """The device's state: arch, shared-memory opt-in limit and retained primary context (once)."""
        drv = self._driver or self._start()
        with self._lock:
            dev = self._devs[ordinal]
            if dev is not None:
                return dev
            try:
                arch = arch_of(drv.compute_capability(ordinal))
                max_smem = drv.max_shared_per_block_optin(ordinal)
                ctx = drv.primary_context(ordinal)
            except BackendUnavailable:
                raise
            except Exception as e:
                raise BackendUnavailable(
                    f"nvrtc backend: device {ordinal} unusable ({type(e).__name__}: {e})") from e
            dev = self._devs[ordinal] = _Device(ordinal, ctx, arch, max_smem)
            if ordinal == 0 and not self._multi:
                self._single = dev
            self._ctx_ordinal[ctx] = ordinal
            if not self.arch:
                self.arch = arch
            return dev

    def available(self) -> tuple[bool, str]:
        """Usable when the driver reports the GPU(s) and every judged GPU can get kernels: NVRTC can target
        its arch (its own sm_XX, or PTX of an older one), or the PYKERN_CUBIN_DIR bundle serves it."""
        try:
            drv = self._start()
        except BackendUnavailable as e:
            return False, str(e)
        ordinals = range(self._count) if self._device is None else (self._device,)
        try:
            archs = [(d, arch_of(drv.compute_capability(d))) for d in ordinals]
        except Exception as e:
            return False, f"nvrtc backend: CUDA driver unusable ({type(e).__name__}: {e})"
        self.arch = archs[0][1]
        try:
            supported: tuple[str, ...] = tuple(self._supported_archs())
            nvrtc_error: Exception | None = None
        except Exception as e:  # BackendUnavailable, or a library that fails on first call
            supported, nvrtc_error = (), e
        for d, arch in archs:
            if nvrtc_error is None:
                try:
                    target_arch(arch, supported)
                    continue
                except BackendUnavailable as e:
                    why = str(e)
            else:
                why = f"nvrtc backend: a GPU is present but NVRTC is unusable ({nvrtc_error})"
            if bundle_serves(arch):  # a precompiled bundle serves launches without NVRTC
                continue
            if len(archs) > 1:
                why += f" (device {d})"
            return False, why
        return True, ""

    def _target_for(self, dev: _Device) -> str:
        try:
            supported = tuple(self._supported_archs())
        except Exception:  # no NVRTC here: a precompiled bundle (PYKERN_CUBIN_DIR) may still serve
            supported = (dev.arch,)
        try:
            return target_arch(dev.arch, supported)
        except BackendUnavailable as e:
            if bundle_serves(dev.arch):
                return dev.arch  # get_module(compatible=True) finds the bundle's cubin or PTX for it
            if self._multi:
                raise BackendUnavailable(f"{e} (device {dev.ordinal})") from None
            raise

    def _plan(self, dev: _Device, spec: KernelSpec) -> _Plan:
        """Build (or find) the plan of `spec` on `dev`; the caller has made dev's context current."""
        drv = self._driver
        assert drv is not None
        with self._lock:
            plan = dev.plans.get(id(spec))
            if plan is not None and plan.spec is spec:
                return plan
            # A new spec object (registry refreshed): ask the cache again, which notices edited sources.
            if not dev.target:
                dev.target = self._target_for(dev)
            target = dev.target
            if spec.archs:  # `// pykern: arch sm_90a`: only that cubin, and only on its exact GPU
                target = f"{dev.arch}a"
                if target not in spec.archs:
                    raise ArgumentError(
                        f"{spec.name}: built only for {', '.join(spec.archs)} ({spec.source.name}'s `// pykern: arch` "
                        f"line); this GPU is {dev.arch} (ask pykern.backends.arch_features() before choosing it)")
            cached = self._get_module(spec.source, target, kernel=spec.name)
            mkey = (int(dev.ctx), cached.digest)
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
            if res is not None:
                static = int(getattr(res, "shared_bytes", 0) or 0)
            else:  # PTX modules carry no compiler resources: ask the driver about the loaded function
                try:
                    static = int(drv.func_attribute(func, "SHARED_SIZE_BYTES"))
                except Exception:  # a driver seam without the query: the launch reports any excess
                    static = 0
            plan = _Plan(spec, func, static)
            # The plan holds `spec`, so its id is not reused meanwhile; a stale plan of the same
            # kernel (from before a registry refresh) is dropped so plans do not pile up.
            for key in [k for k, p in dev.plans.items() if p.spec.name == spec.name]:
                del dev.plans[key]
            dev.plans[id(spec)] = plan
            return plan

    def arch_features(self, device: int = 0) -> tuple[str, ...]:
        """The arch-specific targets whose kernels run on `device`: ("sm_90a",) on a cc 9.0 GPU (an sm_90a
        cubin runs on exactly that), ("sm_100a",) on cc 10.0, () elsewhere."""
        self._driver or self._start()
        dev = self._device_state(device, "device")
        return (f"{dev.arch}a",) if dev.arch in ("sm_90", "sm_100") else ()

    def function(self, spec: KernelSpec, device: int = 0) -> Any:
        """The driver function handle of `spec` on `device` (loading its module on first use)."""
        drv = self._driver or self._start()
        dev = self._device_state(device, "device")
        prev = drv.current_context()
        switch = prev != dev.ctx
        if switch:
            drv.set_current(dev.ctx)
        try:
            return self._plan(dev, spec).func
        finally:
            if switch:
                drv.set_current(prev)

    def _device_state(self, ordinal: Any, what: str) -> _Device:
        if type(ordinal) is not int or not 0 <= ordinal < self._count:
            if isinstance(ordinal, bool) or not isinstance(ordinal, (int, np.integer)):
                raise ArgumentError(f"{what}: expected a CUDA device ordinal (int), got {type(ordinal).__name__}")
            ordinal = int(ordinal)
            if not 0 <= ordinal < self._count:
                raise ArgumentError(f"{what}: expected 0 <= device < {self._count} (the GPUs present), got {ordinal}")
        return self._devs[ordinal] or self._open(ordinal)

    # -- which device ------------------------------------------------------------------

    def _launch_device(self, spec: KernelSpec, args: Sequence[Any], device: Any, prev: Any) -> int:
        """The device of one launch: its device arrays' (all on one device), else `device`, else the
        caller's current device (torch's, else the current context's), else 0."""
        entry = self._ptr_idx.get(id(spec))
        if entry is None or entry[0] is not spec:
            entry = self._ptr_idx[id(spec)] = (spec, _pointer_params(spec))
        drv = self._driver
        assert drv is not None
        found = -1
        first = 0
        for i in entry[1]:
            a = args[i]
            if type(a) is _ndarray:
                continue
            if type(a) is _DeviceView:
                d = a.device
                if d is None:
                    get = getattr(a.owner, "get_device", None)  # a torch tensor: its index, no driver call
                    d = get() if get is not None else self._pointer_device(drv, spec, i, a.ptr)
                    a.device = d
            else:  # a __cuda_array_interface__ object: CuPy says its device, others are asked of the driver
                d = cupy_device(a) if type(a).__module__.startswith("cupy") else None
                if d is None:
                    ptr = a.__cuda_array_interface__["data"][0]
                    if not ptr:
                        continue  # an empty array: no memory, on no device
                    d = self._pointer_device(drv, spec, i, ptr)
            if found < 0:
                found, first = d, i
            elif d != found:
                raise ArgumentError(
                    f"{_label(spec, i)}: expected the device of {_label(spec, first)} (cuda:{found}), got an "
                    f"array on cuda:{d}: the arrays of one launch must live on one CUDA device")
        if found >= 0:
            if device is not None and device != found:
                raise ArgumentError(f"device: expected {found}, the device of {_label(spec, first)}, or None, "
                                    f"got {device}")
            return found
        if device is not None:
            return self._device_state(device, "device").ordinal
        if not self._multi:
            return 0
        cur = current_device()
        if cur is not None:
            return cur
        if prev is not None:
            d = self._ctx_ordinal.get(prev)
            if d is not None:
                return d
            d = drv.context_device()  # another context than a primary one we retained (or a null one)
            if d is not None:
                return d
        return 0

    @staticmethod
    def _pointer_device(drv: Driver, spec: KernelSpec, i: int, ptr: int) -> int:
        try:
            return int(drv.pointer_device(ptr))
        except Exception as e:
            raise ArgumentError(f"{_label(spec, i)}: expected device memory, got pointer {ptr:#x}, which the "
                                f"CUDA driver does not know ({e})") from None

    # -- launch ------------------------------------------------------------------------

    def launch(
        self,
        spec: KernelSpec,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
        shared_mem: int,
        stream: Any,
        device: int | None = None,
        pdl: bool = False,
        cluster: tuple[int, int, int] | None = None,
    ) -> None:
        drv = self._driver
        if drv is None:
            drv = self._start()
        h = 0 if stream is None else stream_handle(stream)
        prev = drv.current_context()
        dev = self._single if device is None else None
        if dev is None:
            ordinal = self._launch_device(spec, args, device, prev) if self._multi or device is not None else 0
            dev = self._devs[ordinal] or self._open(ordinal)
        ctx = dev.ctx
        # The caller's context (torch's, CuPy's, none) is put back afterwards; the same primary context
        # (the usual case: torch on this device) costs no switch at all.
        switch = prev != ctx
        if switch:
            drv.set_current(ctx)
        # kernelParams[i] points at argument i's bytes: the ctypes scalar the launcher made for a
        # value, a slot of `storage` holding the device address for a pointer. Both stay referenced
        # by locals until cuLaunchKernel has copied them.
        staged: list[tuple[int, int, int, bool]] | None = None  # (host span start, bytes, device buffer, copy back)
        try:
            plan = dev.plans.get(id(spec))
            if plan is None or plan.spec is not spec:
                plan = self._plan(dev, spec)
            if shared_mem > plan.smem_set:
                self._opt_in_shared(dev, plan, shared_mem)
            params = plan.params_type()
            storage = plan.storage_type()
            base = _addressof(storage)
            # NumPy arguments by host byte span: (lo, hi, storage slot, data pointer, copy back); empty arrays
            # touch no memory and stay out (their slot keeps the null pointer the zeroed storage holds).
            spans: list[tuple[int, int, int, int, bool]] | None = None
            for k, i in enumerate(plan.ptr_idx):
                a = args[i]
                if type(a) is _ndarray:
                    if spans is None:
                        spans = []
                    n = a.nbytes
                    if n:
                        p = a.ctypes.data
                        if a.flags.c_contiguous:
                            spans.append((p, p + n, k, p, plan.copy_back[k]))
                        else:
                            lo, hi = _span(a, p)
                            spans.append((lo, hi, k, p, plan.copy_back[k]))
                    params[i] = base + 8 * k  # storage[k] is filled by _stage_in once all spans are known
                    continue
                if type(a) is _DeviceView:  # torch CUDA tensor: the op already chose the stream
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
            if spans is not None:
                staged = []
                if spans:
                    self._stage_in(drv, spans, h, storage, staged)
            if cluster is not None:  # cuLaunchKernelEx with the cluster dimension (and PDL when asked)
                drv.launch_kernel(plan.func, grid, block, shared_mem, h, _addressof(params), pdl=pdl and dev.pdl,
                                  cluster=cluster)
            elif pdl and dev.pdl:
                drv.launch_kernel(plan.func, grid, block, shared_mem, h, _addressof(params), pdl=True)
            else:
                drv.launch_kernel(plan.func, grid, block, shared_mem, h, _addressof(params))
            if staged is not None:
                for lo, n, dptr, back in staged:
                    if back:
                        drv.memcpy_dtoh_async(lo, dptr, n, h)  # the whole span, once per device buffer
                # NumPy results are host memory: the call is synchronous for them.
                drv.stream_synchronize(h)
        except BaseException:
            if staged:
                self._free(drv, staged, quiet=True)  # the launch error is the one to report
            if switch:
                drv.set_current(prev)
            raise
        if staged:
            try:
                self._free(drv, staged)
            finally:
                if switch:
                    drv.set_current(prev)
        elif switch:
            drv.set_current(prev)

    @staticmethod
    def _stage_in(drv: Driver, spans: list, h: int, storage: Any, staged: list) -> None:
        """Copy the NumPy arguments' host spans into device memory and put their device addresses in
        `storage`; `spans` holds (lo, hi, storage slot, data pointer, copy back) per non-empty array.

        Staging goes by host memory span, not by array object: a kernel reaches a view through its
        strides, so it touches the bytes between the view's lowest and highest element (its byte
        bounds), which for a strided view (the K half `cache[:, 0]` of a combined KV cache) is more
        than `nbytes` from its data pointer, and may start below it (negative strides). Arguments
        whose spans overlap get ONE device buffer over the union of their spans, each at its own
        offset in it: aliasing on the host stays aliasing on the device (the kernel's writes through
        one view are seen through the other), and the buffer is copied back once, so the K and V views
        of one cache cannot undo each other's writes. The rule is overlap of byte spans rather than a
        shared `.base`: it catches every alias however the views were made (as_strided, frombuffer,
        no common base object), and views of one base whose spans are disjoint (two separate halves
        of a large array) need no common buffer, so the bytes between them are not copied at all.
        The same array passed twice is the special case of identical spans. A buffer is copied back
        (all of its span) only if some parameter staged into it is non-const; the bytes of the span
        that the kernel did not write go back as they came. Empty arrays touch no memory: they pass
        a null pointer and join no buffer (the caller leaves them out).
        """
        # The usual launch has a few disjoint arrays (often one): check that first (no allocation, a few
        # compares) and stage them one by one; only overlapping spans take the merge below.
        m = len(spans)
        overlap = False
        for j in range(1, m):
            lo, hi = spans[j][0], spans[j][1]
            for q in range(j):
                if lo < spans[q][1] and spans[q][0] < hi:
                    overlap = True
                    break
            if overlap:
                break
        if not overlap:
            for lo, hi, k, p, back in spans:
                n = hi - lo
                dptr = drv.mem_alloc(n)
                staged.append((lo, n, dptr, back))  # before the copy: a failed copy still frees it
                drv.memcpy_htod_async(dptr, lo, n, h)  # outputs too: kernels may read-modify-write
                storage[k] = dptr + (p - lo)
            return
        spans.sort()
        groups: list[list[Any]] = []  # [lo, hi, copy back, first slot, [(slot, data pointer)]]
        for lo, hi, k, p, back in spans:
            if groups and lo < groups[-1][1]:  # overlaps the union so far (spans are half-open)
                g = groups[-1]
                if hi > g[1]:
                    g[1] = hi
                g[2] = g[2] or back
                if k < g[3]:
                    g[3] = k
                g[4].append((k, p))
            else:
                groups.append([lo, hi, back, k, [(k, p)]])
        if len(groups) > 1:
            groups.sort(key=_first_slot)  # allocate in parameter order
        for lo, hi, back, _, members in groups:
            n = hi - lo
            dptr = drv.mem_alloc(n)
            staged.append((lo, n, dptr, back))
            drv.memcpy_htod_async(dptr, lo, n, h)
            for k, p in members:
                storage[k] = dptr + (p - lo)

    @staticmethod
    def _free(drv: Driver, staged: list, quiet: bool = False) -> None:
        err: BaseException | None = None
        for _, _, dptr, _ in staged:
            if dptr:
                try:
                    drv.mem_free(dptr)
                except Exception as e:  # free the rest; report the first failure
                    err = err or e
        if err is not None and not quiet:
            raise err

    def _opt_in_shared(self, dev: _Device, plan: _Plan, shared_mem: int) -> None:
        limit = dev.max_smem - plan.static_smem
        if shared_mem > limit:
            static = ""
            if plan.static_smem:
                static = f" ({plan.static_smem} of the {dev.max_smem} go to static __shared__)"
            where = f"device {dev.ordinal}, " if self._multi else ""
            raise ArgumentError(
                f"shared_mem: expected at most {limit} bytes for {plan.spec.name} on this device "
                f"({where}{dev.arch}){static}, got {shared_mem}"
            )
        assert self._driver is not None
        self._driver.set_max_dynamic_shared(plan.func, shared_mem)
        plan.smem_set = shared_mem


def create() -> NvrtcBackend:
    """The process-wide nvrtc backend; construction never touches the driver (available() does)."""
    return NvrtcBackend()
