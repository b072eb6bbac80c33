"""A recording stand-in for the CUDA driver, so the nvrtc backend's whole path runs without a GPU.

`FakeDriver` implements pykern.backends.driver.Driver: it records every call, keeps "device
memory" in host bytearrays at fake device addresses, and at `launch_kernel` reads the
kernelParams array the backend packed and checks every parameter against the kernel's PTX
`.entry` list (count, size, alignment of the storage, and that pointers are live device
addresses), decoding each value with the spec's C type. An optional per-kernel Python
simulation then runs on the fake device memory, so copy-in, pointer passing and copy-back
are checked end to end by the results.

Several devices (`devices=8`, per-device `device_cc` / `device_attributes` / `device_max_shared`):
each has its own primary context (0xC0 + ordinal); every call records the context current at
the time (`call_contexts`, parallel to `calls`); allocations belong to the device of the context
current at mem_alloc; a module or function used in another context than the one it was loaded
in, a launch whose pointers live on another device, or a cubin of an arch the current device
cannot run raises FakeDriverError, as a real driver would fail (or silently misbehave).
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pykern import registry
from pykern.backends.driver import DriverError
from pykern.compiler import PtxParam, ptx_entries
from pykern.ctypes_ import SCALARS, size_align

ELF_MAGIC = b"\x7fELF"
_DEVICE_BASE = 0x7F00_0000_0000  # far from any host address, so a host pointer never passes as a device one
_ALLOC_ALIGN = 256  # cuMemAlloc's guarantee


class FakeDriverError(AssertionError):
    """The backend did something a real driver would reject or silently get wrong."""


@dataclass
class Launch:
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    stream: int
    values: list[Any]  # decoded per parameter: ints (pointers: device addresses), floats, bools
    pdl: bool = False  # launched with programmatic stream serialization (cuLaunchKernelEx)


@dataclass
class _Module:
    image: bytes
    entries: dict[str, tuple[PtxParam, ...]]
    ctx: Any = None  # the context it was loaded in


@dataclass
class _Function:
    module: int
    name: str
    params: tuple[PtxParam, ...]
    max_dynamic_shared: int = 48 * 1024
    ctx: Any = None
    static_smem: int = 0  # SHARED_SIZE_BYTES: counts against the 48 KB a block gets without the opt-in


_CTX_BASE = 0xC0  # primary context handle of device d: 0xC0 + d


# cuDeviceGetAttribute values of real parts (deviceQuery / cudaGetDeviceProperties), for the
# attribute queries of pykern.gpucheck and pykern.bench. Clocks in kHz, bus width in bits.
A100_SXM_ATTRIBUTES = {
    "MULTIPROCESSOR_COUNT": 108, "CLOCK_RATE": 1410000, "MEMORY_CLOCK_RATE": 1215000,
    "GLOBAL_MEMORY_BUS_WIDTH": 5120, "L2_CACHE_SIZE": 40 * 1024 * 1024, "MAX_THREADS_PER_BLOCK": 1024,
    "MAX_THREADS_PER_MULTIPROCESSOR": 2048, "MAX_BLOCKS_PER_MULTIPROCESSOR": 32, "MAX_REGISTERS_PER_BLOCK": 65536,
    "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536, "MAX_SHARED_MEMORY_PER_BLOCK": 48 * 1024,
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 163 * 1024, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 164 * 1024,
    "RESERVED_SHARED_MEMORY_PER_BLOCK": 1024, "WARP_SIZE": 32,
    "COMPUTE_CAPABILITY_MAJOR": 8, "COMPUTE_CAPABILITY_MINOR": 0,
}
H100_SXM_ATTRIBUTES = dict(
    A100_SXM_ATTRIBUTES, MULTIPROCESSOR_COUNT=132, CLOCK_RATE=1980000, MEMORY_CLOCK_RATE=2619000,
    GLOBAL_MEMORY_BUS_WIDTH=5120, L2_CACHE_SIZE=50 * 1024 * 1024, MAX_SHARED_MEMORY_PER_BLOCK_OPTIN=227 * 1024,
    MAX_SHARED_MEMORY_PER_MULTIPROCESSOR=228 * 1024, COMPUTE_CAPABILITY_MAJOR=9, COMPUTE_CAPABILITY_MINOR=0,
)


@dataclass
class FakeDriver:
    """Records calls in `calls` as (name, args) tuples; `images` maps a loaded image to its PTX.

    Device attributes come from `attributes` (A100 values by default; cc and max_shared_optin
    override theirs). Function attributes come from `func_attributes[kernel name]`, else the
    neutral values a kernel without __launch_bounds__ has. Events read a virtual clock that
    every launch advances by `launch_ms[kernel]` (default `default_launch_ms`), so timing code
    gets exact, known elapsed times.
    """

    cc: tuple[int, int] = (8, 0)
    devices: int = 1
    max_shared_optin: int = 163 * 1024  # sm_80
    # Per-device overrides of cc / attributes / max_shared_optin (ordinal -> value).
    device_cc: dict[int, tuple[int, int]] = field(default_factory=dict)
    device_attributes: dict[int, dict[str, int]] = field(default_factory=dict)
    device_max_shared: dict[int, int] = field(default_factory=dict)
    images: dict[bytes, str] = field(default_factory=dict)
    image_arch: dict[bytes, str] = field(default_factory=dict)  # image -> "sm_80" / "compute_80" when known
    call_contexts: list[Any] = field(default_factory=list)  # the current context at each call in `calls`
    alloc_device: dict[int, int] = field(default_factory=dict)  # allocation base -> device
    stream_device: dict[int, int] = field(default_factory=dict)  # stream handles known to belong to a device
    simulate: dict[str, Callable[..., None]] = field(default_factory=dict)
    fail: dict[str, str] = field(default_factory=dict)  # call name -> CUresult name to raise
    calls: list[tuple[str, tuple]] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    memory: dict[int, bytearray] = field(default_factory=dict)
    modules: dict[int, _Module] = field(default_factory=dict)
    functions: dict[int, _Function] = field(default_factory=dict)
    current: int | None = None
    attributes: dict[str, int] = field(default_factory=lambda: dict(A100_SXM_ATTRIBUTES))
    func_attributes: dict[str, dict[str, int]] = field(default_factory=dict)
    name: str = "Fake GPU"
    memory_bytes: int = 80 * 1024**3
    version: int = 12040
    launch_ms: dict[str, float] = field(default_factory=dict)
    default_launch_ms: float = 0.0
    clock_ms: float = 0.0
    events: dict[int, float | None] = field(default_factory=dict)
    _next_addr: int = _DEVICE_BASE
    _next_handle: int = 0x1000

    # -- helpers for tests ------------------------------------------------------------

    def register(self, image: bytes, ptx: str, arch: str | None = None) -> None:
        """Make `image` loadable; its kernels' layouts come from `ptx` (the same compile's PTX). With `arch`
        the fake refuses to load it on a device that cannot run that arch."""
        self.images[image] = ptx
        if arch is not None:
            self.image_arch[image] = arch

    def cc_of(self, device: int) -> tuple[int, int]:
        return self.device_cc.get(device, self.cc)

    def optin_of(self, device: int) -> int:
        return self.device_max_shared.get(device, self.max_shared_optin)

    def ctx_device(self, ctx: Any) -> int:
        """The device of a primary context handle."""
        d = (ctx or 0) - _CTX_BASE
        if not 0 <= d < self.devices:
            raise FakeDriverError(f"{ctx!r} is not a context of this fake")
        return d

    def current_device(self) -> int | None:
        return None if self.current is None else self.ctx_device(self.current)

    def device_of(self, ptr: int) -> int:
        """The device an allocation containing `ptr` lives on."""
        for base, buf in self.memory.items():
            if base <= ptr < base + max(len(buf), 1):
                return self.alloc_device.get(base, 0)
        raise FakeDriverError(f"device pointer {ptr:#x} is not inside any live allocation")

    def calls_on(self, device: int) -> list[str]:
        """Names of the calls made while device's primary context was current."""
        ctx = _CTX_BASE + device
        return [c[0] for c, cur in zip(self.calls, self.call_contexts) if cur == ctx]

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def _handle(self) -> int:
        self._next_handle += 0x10
        return self._next_handle

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        self.call_contexts.append(self.current)
        if name in self.fail:
            raise DriverError(name, self.fail[name])

    def _find(self, ptr: int, nbytes: int) -> tuple[bytearray, int]:
        for base, buf in self.memory.items():
            if base <= ptr and ptr + nbytes <= base + len(buf):
                return buf, ptr - base
        raise FakeDriverError(f"device range [{ptr:#x}, +{nbytes}) is not inside any live allocation")

    def view(self, ptr: int, dtype: Any, count: int) -> np.ndarray:
        """A NumPy view of fake device memory (what a simulated kernel reads and writes)."""
        dt = np.dtype(dtype)
        if count == 0:
            return np.empty(0, dt)
        buf, off = self._find(ptr, count * dt.itemsize)
        return np.frombuffer(buf, dt, count, off)

    def device_array(self, host: np.ndarray, stream: int | None = None, readonly: bool = False,
                     device: int | None = None) -> "FakeDeviceArray":
        """An allocation holding a copy of `host` on `device` (default: the current context's, else 0),
        exposed through __cuda_array_interface__."""
        if device is None:
            device = self.current_device() or 0
        ptr = self._alloc(max(host.nbytes, 1), device)
        self.view(ptr, np.uint8, host.nbytes)[:] = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
        return FakeDeviceArray(self, ptr, host.shape, host.dtype, stream, readonly)

    def _alloc(self, nbytes: int, device: int = 0) -> int:
        ptr = self._next_addr
        self.memory[ptr] = bytearray(nbytes)
        self.alloc_device[ptr] = device
        self._next_addr += (nbytes + _ALLOC_ALIGN - 1) // _ALLOC_ALIGN * _ALLOC_ALIGN + _ALLOC_ALIGN
        return ptr

    # -- the Driver protocol ----------------------------------------------------------

    def init(self) -> None:
        self._call("init")

    def device_count(self) -> int:
        self._call("device_count")
        return self.devices

    def _device(self, call: str, device: int) -> None:
        if not 0 <= device < self.devices:
            raise DriverError(call, "CUDA_ERROR_INVALID_DEVICE")

    def compute_capability(self, device: int) -> tuple[int, int]:
        self._call("compute_capability", device)
        self._device("cuDeviceGetAttribute", device)
        return self.cc_of(device)

    def max_shared_per_block_optin(self, device: int) -> int:
        self._call("max_shared_per_block_optin", device)
        self._device("cuDeviceGetAttribute", device)
        return self.optin_of(device)

    def primary_context(self, device: int) -> int:
        self._call("primary_context", device)
        self._device("cuDevicePrimaryCtxRetain", device)
        return _CTX_BASE + device

    def set_current(self, ctx: Any) -> None:
        self._call("set_current", ctx)
        if ctx is not None:
            self.ctx_device(ctx)  # a handle of this fake
        self.current = ctx

    def current_context(self) -> Any:
        self._call("current_context")
        return self.current

    def context_device(self) -> int | None:
        self._call("context_device")
        return self.current_device()

    def pointer_device(self, ptr: int) -> int:
        self._call("pointer_device", ptr)
        try:
            return self.device_of(ptr)
        except FakeDriverError:
            raise DriverError("cuPointerGetAttribute", "CUDA_ERROR_INVALID_VALUE") from None

    def _same_context(self, what: str, ctx: Any) -> None:
        if ctx != self.current:
            cur = "no" if self.current is None else f"{self.current:#x}"
            raise FakeDriverError(f"{what}: loaded in context {ctx:#x} (device {self.ctx_device(ctx)}), used with "
                                  f"{cur} context current (device {self.current_device()})")

    def _need_context(self, what: str) -> None:
        if self.current is None:
            raise FakeDriverError(f"{what} with no current context (set_current was never called)")

    def module_load_data(self, image: bytes) -> int:
        self._call("module_load_data", len(image))
        self._need_context("module_load_data")
        if image not in self.images:
            raise FakeDriverError("module_load_data: image was never registered with the fake")
        arch = self.image_arch.get(image)
        if arch is not None:
            dev = self.current_device()
            major, minor = self.cc_of(dev)
            kind, num = arch.split("_")[0], int(arch.split("_")[1].rstrip("af"))
            runs = num // 10 == major and num % 10 <= minor if kind == "sm" else num <= major * 10 + minor
            if kind == "sm" and arch.endswith("a"):  # arch-specific: exactly that compute capability
                runs = num == major * 10 + minor
            if not runs:
                raise DriverError("cuModuleLoadData", "CUDA_ERROR_NO_BINARY_FOR_GPU")
        if not (image.startswith(ELF_MAGIC) or b".entry" in image[:1 << 20] and image.lstrip().startswith(b"//")):
            raise FakeDriverError(f"module_load_data: expected a cubin (ELF) or PTX text, got {image[:8]!r}")
        h = self._handle()
        self.modules[h] = _Module(image, ptx_entries(self.images[image]), self.current)
        return h

    def module_get_function(self, module: Any, name: str) -> int:
        self._call("module_get_function", module, name)
        mod = self.modules.get(module)
        if mod is None:
            raise FakeDriverError(f"module_get_function: unknown module handle {module!r}")
        self._same_context("module_get_function", mod.ctx)
        if name not in mod.entries:
            raise DriverError("cuModuleGetFunction", "CUDA_ERROR_NOT_FOUND")
        h = self._handle()
        static = int(self.func_attributes.get(name, {}).get("SHARED_SIZE_BYTES", 0))
        # Without the opt-in a block has 48 KB of shared memory in all: the static part comes off the top.
        self.functions[h] = _Function(module, name, mod.entries[name], max(0, 48 * 1024 - static), mod.ctx, static)
        return h

    def set_max_dynamic_shared(self, func: Any, nbytes: int) -> None:
        self._call("set_max_dynamic_shared", func, nbytes)
        fn = self.functions[func]
        if nbytes + fn.static_smem > self.optin_of(self.ctx_device(fn.ctx)):
            raise DriverError("cuFuncSetAttribute", "CUDA_ERROR_INVALID_VALUE")
        fn.max_dynamic_shared = nbytes

    def mem_alloc(self, nbytes: int) -> int:
        self._call("mem_alloc", nbytes)
        self._need_context("mem_alloc")
        if nbytes <= 0:
            raise DriverError("cuMemAlloc", "CUDA_ERROR_INVALID_VALUE")
        return self._alloc(nbytes, self.current_device())

    def mem_free(self, ptr: int) -> None:
        self._call("mem_free", ptr)
        if ptr not in self.memory:
            raise FakeDriverError(f"mem_free of {ptr:#x}, which is not a live allocation base")
        del self.memory[ptr]
        self.alloc_device.pop(ptr, None)

    def memcpy_htod_async(self, dst: int, src_host_addr: int, nbytes: int, stream: int) -> None:
        self._call("memcpy_htod_async", dst, src_host_addr, nbytes, stream)
        buf, off = self._find(dst, nbytes)
        buf[off : off + nbytes] = ctypes.string_at(src_host_addr, nbytes)

    def memcpy_dtoh_async(self, dst_host_addr: int, src: int, nbytes: int, stream: int) -> None:
        self._call("memcpy_dtoh_async", dst_host_addr, src, nbytes, stream)
        buf, off = self._find(src, nbytes)
        ctypes.memmove(dst_host_addr, bytes(buf[off : off + nbytes]), nbytes)

    def stream_synchronize(self, stream: int) -> None:
        self._call("stream_synchronize", stream)

    def launch_kernel(
        self,
        func: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: int,
        kernel_params: int,
        pdl: bool = False,
        cluster: tuple[int, int, int] | None = None,
    ) -> None:
        self._call("launch_kernel", func, grid, block, shared_mem, stream, kernel_params,
                   *(("pdl",) if pdl else ()), *((("cluster", tuple(cluster)),) if cluster is not None else ()))
        self._need_context("launch_kernel")
        fn = self.functions.get(func)
        if fn is None:
            raise FakeDriverError(f"launch_kernel: unknown function handle {func!r}")
        self._same_context(f"launch_kernel of {fn.name}", fn.ctx)
        if pdl and self.cc_of(self.current_device())[0] < 9:
            # Programmatic stream serialization is an sm_90 launch attribute.
            raise DriverError("cuLaunchKernelEx", "CUDA_ERROR_NOT_SUPPORTED")
        if stream in self.stream_device and self.stream_device[stream] != self.current_device():
            raise FakeDriverError(f"launch_kernel of {fn.name}: stream {stream:#x} belongs to device "
                                  f"{self.stream_device[stream]}, the current context to {self.current_device()}")
        if shared_mem > fn.max_dynamic_shared:
            # A real driver refuses this launch: more than 48 KB (static included) needs the opt-in first.
            raise DriverError("cuLaunchKernel", "CUDA_ERROR_INVALID_VALUE")
        values = decode_params(fn.name, fn.params, kernel_params, self)
        self.launches.append(Launch(fn.name, tuple(grid), tuple(block), shared_mem, stream, values, pdl))
        self.clock_ms += self.launch_ms.get(fn.name, self.default_launch_ms)
        sim = self.simulate.get(fn.name)
        if sim is not None:
            sim(self, grid, block, shared_mem, *values)

    # -- device / function queries and events ------------------------------------------

    def device_attribute(self, device: int, name: str) -> int:
        self._call("device_attribute", device, name)
        self._device("cuDeviceGetAttribute", device)
        if name == "COMPUTE_CAPABILITY_MAJOR":
            return self.cc_of(device)[0]
        if name == "COMPUTE_CAPABILITY_MINOR":
            return self.cc_of(device)[1]
        if name == "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN":
            return self.optin_of(device)
        attrs = self.device_attributes.get(device, self.attributes)
        if name not in attrs:
            raise DriverError("cuDeviceGetAttribute", "CUDA_ERROR_INVALID_VALUE")
        return attrs[name]

    def device_name(self, device: int) -> str:
        self._call("device_name", device)
        self._device("cuDeviceGetName", device)
        return self.name

    def total_memory(self, device: int) -> int:
        self._call("total_memory", device)
        self._device("cuDeviceTotalMem", device)
        return self.memory_bytes

    def driver_version(self) -> int:
        self._call("driver_version")
        return self.version

    def func_attribute(self, func: Any, name: str) -> int:
        self._call("func_attribute", func, name)
        fn = self.functions.get(func)
        if fn is None:
            raise FakeDriverError(f"func_attribute: unknown function handle {func!r}")
        given = self.func_attributes.get(fn.name, {})
        if name in given:
            return given[name]
        neutral = {"MAX_THREADS_PER_BLOCK": 1024, "NUM_REGS": 32, "SHARED_SIZE_BYTES": 0, "LOCAL_SIZE_BYTES": 0,
                   "MAX_DYNAMIC_SHARED_SIZE_BYTES": fn.max_dynamic_shared}
        if name not in neutral:
            raise DriverError("cuFuncGetAttribute", "CUDA_ERROR_INVALID_VALUE")
        return neutral[name]

    def tensor_map_encode_tiled(self, dtype: str, rank: int, address: int, dims: Any, strides: Any, box: Any,
                                element_strides: Any, swizzle: int, oob_nan: bool) -> bytes:
        """Checks what cuTensorMapEncodeTiled checks (CUDA_ERROR_INVALID_VALUE otherwise); the 128 bytes
        returned record the arguments (magic "FKTM", then rank, swizzle, address, dims, strides, box)."""
        self._call("tensor_map_encode_tiled", dtype, rank, address, tuple(dims), tuple(strides), tuple(box),
                   tuple(element_strides), swizzle, oob_nan)
        elem = {"uint8": 1, "uint16": 2, "float16": 2, "bfloat16": 2, "uint32": 4, "int32": 4, "float32": 4,
                "uint64": 8, "int64": 8, "float64": 8}.get(dtype)
        problems = []
        if elem is None:
            problems.append(f"data type {dtype!r}")
        if not 1 <= rank <= 5 or not len(dims) == len(box) == len(element_strides) == rank or len(strides) != rank - 1:
            problems.append(f"rank {rank} with {len(dims)} dims, {len(strides)} strides, {len(box)} box sizes")
        if address % 16:
            problems.append(f"global address {address:#x} not 16-byte aligned")
        else:
            self._find(address, 1)  # device memory of this fake
        if any(not 1 <= d <= 1 << 32 for d in dims):
            problems.append(f"dims {dims}")
        if any(st % 16 or not 0 < st < 1 << 40 for st in strides):
            problems.append(f"strides {strides} (multiples of 16 below 2^40)")
        if any(not 1 <= b <= 256 for b in box):
            problems.append(f"box {box} (1..256)")
        if elem and box and (box[0] * elem) % 16:
            problems.append(f"inner box {box[0]} x {elem} bytes not a multiple of 16")
        if swizzle not in (0, 32, 64, 128):
            problems.append(f"swizzle {swizzle}")
        elif elem and box and swizzle and box[0] * elem > swizzle:
            problems.append(f"inner box {box[0] * elem} bytes > swizzle span {swizzle}")
        if any(not 1 <= e <= 8 for e in element_strides):
            problems.append(f"element strides {element_strides}")
        if problems:
            raise DriverError("cuTensorMapEncodeTiled", "CUDA_ERROR_INVALID_VALUE", "; ".join(problems))
        pad = lambda v, n: list(v) + [0] * (n - len(v))  # noqa: E731
        return struct.pack("<4sBBHQ5Q4Q5H", b"FKTM", rank, swizzle, 0, address, *pad(dims, 5), *pad(strides, 4),
                           *pad(box, 5)).ljust(128, b"\0")

    def event_create(self) -> int:
        self._call("event_create")
        self._need_context("event_create")
        h = self._handle()
        self.events[h] = None
        return h

    def _event(self, event: Any, what: str) -> None:
        if event not in self.events:
            raise FakeDriverError(f"{what}: unknown or destroyed event {event!r}")

    def event_record(self, event: Any, stream: int) -> None:
        self._call("event_record", event, stream)
        self._event(event, "event_record")
        self.events[event] = self.clock_ms

    def event_synchronize(self, event: Any) -> None:
        self._call("event_synchronize", event)
        self._event(event, "event_synchronize")

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        self._call("event_elapsed_ms", start, end)
        self._event(start, "event_elapsed_ms")
        self._event(end, "event_elapsed_ms")
        t0, t1 = self.events[start], self.events[end]
        if t0 is None or t1 is None:
            raise DriverError("cuEventElapsedTime", "CUDA_ERROR_INVALID_HANDLE")  # never recorded
        return float(t1 - t0)

    def event_destroy(self, event: Any) -> None:
        self._call("event_destroy", event)
        self._event(event, "event_destroy")
        del self.events[event]


def decode_params(name: str, ptx: tuple[PtxParam, ...], kernel_params: int, fake: FakeDriver) -> list[Any]:
    """Read kernelParams (void*[n]) and check each parameter against the PTX and the KernelSpec."""
    spec = registry.get(name)
    if len(spec.params) != len(ptx):
        raise FakeDriverError(f"{name}: spec has {len(spec.params)} parameters, PTX .entry has {len(ptx)}")
    if not kernel_params:
        raise FakeDriverError(f"{name}: kernelParams is NULL but the kernel takes {len(ptx)} parameters")
    slots = (ctypes.c_void_p * max(len(ptx), 1)).from_address(kernel_params)
    values: list[Any] = []
    for i, (p, q) in enumerate(zip(spec.params, ptx)):
        addr = slots[i]
        where = f"{name} parameter {i} ({p.ctype} {p.name}, PTX {q.type})"
        if not addr:
            raise FakeDriverError(f"{where}: kernelParams[{i}] is NULL")
        if addr % q.align:
            raise FakeDriverError(f"{where}: storage at {addr:#x} is not {q.align}-byte aligned")
        if size_align(p.ctype) != (q.size, q.align):
            raise FakeDriverError(f"{where}: spec says size/align {size_align(p.ctype)}, PTX {(q.size, q.align)}")
        float_ptx = q.type.startswith(".f")
        if p.is_pointer:
            if float_ptx:
                raise FakeDriverError(f"{where}: a pointer passed as a float parameter")
            v = ctypes.c_uint64.from_address(addr).value
            if v:
                fake._find(v, 1)  # must be device memory, never a host address
                on, cur = fake.device_of(v), fake.current_device()
                if cur is not None and on != cur:  # (None: decoded by a test outside any launch)
                    raise FakeDriverError(f"{where}: {v:#x} lives on device {on}, the launch runs on device {cur}")
            values.append(v)
            continue
        st = SCALARS[p.ctype]
        if st.kind == "tensormap":  # 128 bytes by value (.param .align 64 .b8 name[128])
            values.append(bytes(ctypes.string_at(addr, 128)))
            continue
        if float_ptx != (st.kind == "float"):
            raise FakeDriverError(f"{where}: the spec's kind {st.kind} disagrees with the PTX type")
        values.append(st.ctype.from_address(addr).value)
    return values


class FakeDeviceArray:
    """A device array living in a FakeDriver, seen by pykern through __cuda_array_interface__ (v3)."""

    def __init__(self, fake: FakeDriver, ptr: int, shape: tuple, dtype: np.dtype, stream: int | None,
                 readonly: bool) -> None:
        self.fake, self.ptr, self.shape, self.dtype = fake, ptr, tuple(shape), np.dtype(dtype)
        self.stream, self.readonly = stream, readonly
        typestr = "<V2" if self.dtype.name == "bfloat16" else self.dtype.str
        self._cai = {"shape": self.shape, "typestr": typestr, "data": (ptr, readonly), "version": 3, "strides": None}
        if stream is not None:
            self._cai["stream"] = stream

    @property
    def __cuda_array_interface__(self) -> dict:
        return dict(self._cai)  # a fresh dict per access, as CuPy and torch hand out

    def copy_to_host(self) -> np.ndarray:
        n = int(np.prod(self.shape, dtype=np.int64))
        return self.fake.view(self.ptr, self.dtype, n).reshape(self.shape).copy()

    def reshape(self, shape: Any) -> "FakeDeviceArray":
        """A view of the same (contiguous) memory in another shape, as CuPy's and torch's reshape."""
        new = np.empty(self.shape, np.uint8).reshape(shape).shape  # NumPy's checks and its -1
        return FakeDeviceArray(self.fake, self.ptr, new, self.dtype, self.stream, self.readonly)

    def fill(self, value: Any) -> None:
        n = int(np.prod(self.shape, dtype=np.int64))
        self.fake.view(self.ptr, self.dtype, n)[:] = value


# -- simulations of the test kernels in tests/launch_cu (what the GPU would compute) ----


def sim_axpy(fake: FakeDriver, grid: Any, block: Any, smem: int, y: int, x: int, a: float, n: int) -> None:
    threads = grid[0] * block[0]
    m = min(n, threads)  # threads past the grid never run: a too-small grid leaves the tail alone
    yv, xv = fake.view(y, np.float32, n), fake.view(x, np.float32, n)
    yv[:m] = np.float32(a) * xv[:m] + yv[:m]


def sim_all_types(fake: FakeDriver, grid: Any, block: Any, smem: int, out: int, *vals: Any) -> None:
    fake.view(out, np.float64, len(vals))[:] = [float(v) for v in vals]


def sim_smem_reverse(fake: FakeDriver, grid: Any, block: Any, smem: int, out: int, inp: int, n: int) -> None:
    b = block[0]
    if smem < 4 * b:
        raise FakeDriverError(f"pktest_smem_reverse needs {4 * b} bytes of dynamic shared memory, got {smem}")
    src, dst = fake.view(inp, np.float32, n), fake.view(out, np.float32, n)
    for blk in range(grid[0]):
        tile = np.zeros(b, np.float32)
        lo = blk * b
        k = max(0, min(b, n - lo))
        tile[:k] = src[lo : lo + k]
        for t in range(b):
            j = lo + b - 1 - t
            if j < n:
                dst[j] = tile[t]


def sim_copy_u16(fake: FakeDriver, grid: Any, block: Any, smem: int, out: int, inp: int, n: int) -> None:
    fake.view(out, np.uint16, n)[:] = fake.view(inp, np.uint16, n)


SIMULATIONS = {
    "pktest_axpy": sim_axpy,
    "pktest_all_types": sim_all_types,
    "pktest_smem_reverse": sim_smem_reverse,
    "pktest_copy_u16": sim_copy_u16,
}

LAUNCH_CU = Path(__file__).resolve().parent / "launch_cu"
TEST_SOURCE = LAUNCH_CU / "launch_test.cu"


def compile_test_kernels(arch: str = "sm_80") -> Any:
    """The test kernels compiled by pykern.compiler (cubin + its PTX); NVRTC needs no GPU."""
    from pykern import compiler

    return compiler.compile(TEST_SOURCE, arch)


@dataclass(frozen=True)
class StubModule:
    """What pykern.cache.get_module returns, reduced to what the backend reads."""

    image: bytes
    digest: str
    resources: dict = field(default_factory=dict)
    hit: bool = False
    kind: str = "cubin"


def make_fake(compiled: Any = None, arch: str = "sm_80", devices: int = 1) -> tuple[FakeDriver, Any]:
    """A FakeDriver (of `devices` identical GPUs) that knows the test kernels, plus a get_module that
    serves their cubin."""
    import hashlib

    if compiled is None:
        compiled = compile_test_kernels(arch)
    arch = compiled.arch
    major, minor = int(arch[3:-1]), int(arch[-1])
    fake = FakeDriver(cc=(major, minor), devices=devices, simulate=dict(SIMULATIONS))
    fake.register(compiled.image, compiled.ptx, arch)
    module = StubModule(compiled.image, hashlib.sha256(compiled.image).hexdigest())
    requests: list[tuple[Path, str]] = []

    def get_module(source: Any, want_arch: str, *args: Any, **kw: Any) -> StubModule:
        requests.append((Path(source), want_arch))
        if Path(source).resolve() != TEST_SOURCE:
            raise FakeDriverError(f"get_module for {source}, only the test kernels are compiled here")
        if want_arch != arch:
            raise FakeDriverError(f"get_module asked for {want_arch}, the fake device is {arch}")
        return module

    get_module.requests = requests  # type: ignore[attr-defined]
    return fake, get_module
