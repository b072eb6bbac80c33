"""The driver seam: the few CUDA driver calls the nvrtc backend makes, behind one small class.

The backend only talks to a `Driver`; `CudaDriver` wraps `cuda.bindings.driver`, and the
test suite substitutes a recording fake (tests/fake_driver.py), which is how the whole
GPU path is exercised on machines without a GPU. Handles (context, module, function) are
opaque to the backend; device pointers and stream handles are plain ints.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from ..errors import BackendUnavailable, PykernError

# Beyond this much dynamic shared memory a kernel must opt in with a function attribute.
DEFAULT_MAX_DYNAMIC_SHARED = 48 * 1024


class DriverError(PykernError, RuntimeError):
    """A CUDA driver call failed; names the call and the CUresult."""

    def __init__(self, call: str, error: str, detail: str = "") -> None:
        msg = f"{call} failed: {error}" + (f" ({detail})" if detail else "")
        super().__init__(msg)
        self.call = call
        self.error = error


class Driver(Protocol):
    """What the nvrtc backend needs from the CUDA driver (and nothing more)."""

    def init(self) -> None: ...
    def device_count(self) -> int: ...
    def compute_capability(self, device: int) -> tuple[int, int]: ...
    def max_shared_per_block_optin(self, device: int) -> int: ...
    def primary_context(self, device: int) -> Any:
        """Retain the device's primary context (once per process) and return its handle."""
    def set_current(self, ctx: Any) -> None:
        """Bind `ctx` to the calling thread (None, or a null handle, unbinds)."""
    def current_context(self) -> Any:
        """The context bound to the calling thread: a handle comparing equal (==) to primary_context()'s for
        the same context; None or a null handle when there is none (cuCtxGetCurrent)."""
    def context_device(self) -> int | None:
        """The device ordinal of the current context; None when no context is current (cuCtxGetDevice)."""
    def pointer_device(self, ptr: int) -> int:
        """The device ordinal holding device pointer `ptr` (CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL); raises
        DriverError for memory the driver does not know."""
    def module_load_data(self, image: bytes) -> Any: ...
    def module_get_function(self, module: Any, name: str) -> Any: ...
    def set_max_dynamic_shared(self, func: Any, nbytes: int) -> None: ...
    def mem_alloc(self, nbytes: int) -> int: ...
    def mem_free(self, ptr: int) -> None: ...
    def memcpy_htod_async(self, dst: int, src_host_addr: int, nbytes: int, stream: int) -> None: ...
    def memcpy_dtoh_async(self, dst_host_addr: int, src: int, nbytes: int, stream: int) -> None: ...
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
        """`kernel_params` is the address of an array of pointers, one per kernel parameter. `pdl` (passed only
        when True, on sm_90+): with programmatic stream serialization, so the grid may start before the
        previous kernel of the stream completes (cuLaunchKernelEx). `cluster` (passed only for a cluster
        launch, sm_90+): CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (cuLaunchKernelEx)."""
    def stream_synchronize(self, stream: int) -> None: ...

    # -- used by pykern.gpucheck and pykern.bench (the launch path never calls these) --------
    def device_attribute(self, device: int, name: str) -> int:
        """cuDeviceGetAttribute by short name: "MULTIPROCESSOR_COUNT" is CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT."""
    def device_name(self, device: int) -> str: ...
    def total_memory(self, device: int) -> int: ...
    def driver_version(self) -> int:
        """cuDriverGetVersion: 12040 is CUDA 12.4."""
    def func_attribute(self, func: Any, name: str) -> int:
        """cuFuncGetAttribute by short name: "MAX_THREADS_PER_BLOCK", "NUM_REGS", "SHARED_SIZE_BYTES", ..."""
    def tensor_map_encode_tiled(self, dtype: str, rank: int, address: int, dims: Sequence[int],
                                strides: Sequence[int], box: Sequence[int], element_strides: Sequence[int],
                                swizzle: int, oob_nan: bool) -> bytes:
        """cuTensorMapEncodeTiled: the 128-byte CUtensorMap. dtype "bfloat16"/"float16"/"float32"/...;
        dims and box innermost first; strides: bytes of dims 1..rank-1; swizzle: span in bytes (0/32/64/128)."""
        ...
    def event_create(self) -> Any: ...
    def event_record(self, event: Any, stream: int) -> None: ...
    def event_synchronize(self, event: Any) -> None: ...
    def event_elapsed_ms(self, start: Any, end: Any) -> float: ...
    def event_destroy(self, event: Any) -> None: ...


# Device attributes pykern.gpucheck reads (short names, see Driver.device_attribute).
DEVICE_ATTRIBUTES = (
    "MULTIPROCESSOR_COUNT",
    "CLOCK_RATE",  # kHz, the maximum (boost) SM clock
    "MEMORY_CLOCK_RATE",  # kHz, the peak memory clock
    "GLOBAL_MEMORY_BUS_WIDTH",  # bits
    "L2_CACHE_SIZE",
    "MAX_THREADS_PER_BLOCK",
    "MAX_THREADS_PER_MULTIPROCESSOR",
    "MAX_BLOCKS_PER_MULTIPROCESSOR",
    "MAX_REGISTERS_PER_BLOCK",
    "MAX_REGISTERS_PER_MULTIPROCESSOR",
    "MAX_SHARED_MEMORY_PER_BLOCK",
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
    "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
    "RESERVED_SHARED_MEMORY_PER_BLOCK",
    "WARP_SIZE",
    "COMPUTE_CAPABILITY_MAJOR",
    "COMPUTE_CAPABILITY_MINOR",
)


def arch_of(cc: tuple[int, int]) -> str:
    """Compute capability (9, 0) -> "sm_90"."""
    return f"sm_{cc[0]}{cc[1]}"


class CudaDriver:
    """`Driver` over `cuda.bindings.driver` (imported here, lazily, so `import pykern` stays cheap)."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver as cu
        except Exception as e:  # not installed, or a broken install
            raise BackendUnavailable(f"nvrtc backend: cuda.bindings is not importable ({type(e).__name__}: {e})") from e
        self._cu = cu
        self._ok = cu.CUresult.CUDA_SUCCESS
        self._contexts: dict[int, Any] = {}

    def _check(self, call: str, out: Any) -> Any:
        # cuda.bindings returns (CUresult, *values); unwrap the single value when there is one.
        if isinstance(out, tuple):
            err, rest = out[0], out[1:]
        else:
            err, rest = out, ()
        if err != self._ok:
            raise DriverError(call, self._error_name(err))
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else rest

    def _error_name(self, err: Any) -> str:
        try:
            res, name = self._cu.cuGetErrorName(err)
            if res == self._ok and name:
                return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # a failing error query must not hide the original error
            pass
        return getattr(err, "name", str(err))

    def init(self) -> None:
        try:
            out = self._cu.cuInit(0)
        except Exception as e:  # DynamicLibNotFoundError (no libcuda) and friends
            raise BackendUnavailable(f"nvrtc backend: no CUDA driver ({type(e).__name__}: {e})") from e
        if out[0] != self._ok:
            raise BackendUnavailable(f"nvrtc backend: no usable CUDA driver (cuInit: {self._error_name(out[0])})")

    def device_count(self) -> int:
        return int(self._check("cuDeviceGetCount", self._cu.cuDeviceGetCount()))

    def _device(self, device: int) -> Any:
        return self._check("cuDeviceGet", self._cu.cuDeviceGet(device))

    def _attribute(self, device: int, attr: str) -> int:
        a = getattr(self._cu.CUdevice_attribute, attr)
        return int(self._check("cuDeviceGetAttribute", self._cu.cuDeviceGetAttribute(a, self._device(device))))

    def compute_capability(self, device: int) -> tuple[int, int]:
        return (
            self._attribute(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
            self._attribute(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"),
        )

    def max_shared_per_block_optin(self, device: int) -> int:
        return self._attribute(device, "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")

    def primary_context(self, device: int) -> Any:
        ctx = self._contexts.get(device)
        if ctx is None:
            # Retained for the life of the process: the primary context is shared with torch/CuPy/numba.
            ctx = self._check("cuDevicePrimaryCtxRetain", self._cu.cuDevicePrimaryCtxRetain(self._device(device)))
            self._contexts[device] = ctx
        return ctx

    def set_current(self, ctx: Any) -> None:
        # Called on every launch: skip the generic unwrapping.
        (err,) = self._cu.cuCtxSetCurrent(ctx)
        if err != self._ok:
            raise DriverError("cuCtxSetCurrent", self._error_name(err))

    def current_context(self) -> Any:
        # Called on every launch: skip the generic unwrapping. A null CUcontext means none is current.
        err, ctx = self._cu.cuCtxGetCurrent()
        if err != self._ok:
            raise DriverError("cuCtxGetCurrent", self._error_name(err))
        return ctx

    def context_device(self) -> int | None:
        err, dev = self._cu.cuCtxGetDevice()
        if err == self._cu.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            return None
        if err != self._ok:
            raise DriverError("cuCtxGetDevice", self._error_name(err))
        return int(dev)

    def pointer_device(self, ptr: int) -> int:
        attr = self._cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        return int(self._check("cuPointerGetAttribute", self._cu.cuPointerGetAttribute(attr, ptr)))

    def module_load_data(self, image: bytes) -> Any:
        return self._check("cuModuleLoadData", self._cu.cuModuleLoadData(image))

    def module_get_function(self, module: Any, name: str) -> Any:
        return self._check("cuModuleGetFunction", self._cu.cuModuleGetFunction(module, name.encode()))

    def set_max_dynamic_shared(self, func: Any, nbytes: int) -> None:
        attr = self._cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._check("cuFuncSetAttribute", self._cu.cuFuncSetAttribute(func, attr, nbytes))

    def mem_alloc(self, nbytes: int) -> int:
        return int(self._check("cuMemAlloc", self._cu.cuMemAlloc(nbytes)))

    def mem_free(self, ptr: int) -> None:
        self._check("cuMemFree", self._cu.cuMemFree(ptr))

    def memcpy_htod_async(self, dst: int, src_host_addr: int, nbytes: int, stream: int) -> None:
        self._check("cuMemcpyHtoDAsync", self._cu.cuMemcpyHtoDAsync(dst, src_host_addr, nbytes, stream))

    def memcpy_dtoh_async(self, dst_host_addr: int, src: int, nbytes: int, stream: int) -> None:
        self._check("cuMemcpyDtoHAsync", self._cu.cuMemcpyDtoHAsync(dst_host_addr, src, nbytes, stream))

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
        if pdl or cluster is not None:
            self._launch_ex(func, grid, block, shared_mem, stream, kernel_params, pdl, cluster)
            return
        # An int kernelParams is taken by cuda.bindings as the void** address itself (no repacking).
        (err,) = self._cu.cuLaunchKernel(
            func, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_mem, stream, kernel_params, 0
        )
        if err != self._ok:
            raise DriverError("cuLaunchKernel", self._error_name(err))

    def _launch_ex(self, func: Any, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
                   stream: int, kernel_params: int, pdl: bool, cluster: tuple[int, int, int] | None) -> None:
        # cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1: the launch may overlap
        # the previous kernel of the stream (and becomes a programmatic edge under stream capture); with
        # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: CTAs in thread-block clusters of these dims.
        cu = self._cu
        attrs = []
        if pdl:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        if cluster is not None:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
            attrs.append(attr)
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = shared_mem
        cfg.hStream = stream
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        (err,) = cu.cuLaunchKernelEx(cfg, func, kernel_params, 0)
        if err != self._ok:
            raise DriverError("cuLaunchKernelEx", self._error_name(err))

    def stream_synchronize(self, stream: int) -> None:
        self._check("cuStreamSynchronize", self._cu.cuStreamSynchronize(stream))

    # -- device / function queries and events (gpucheck, bench) ---------------------------

    def device_attribute(self, device: int, name: str) -> int:
        return self._attribute(device, "CU_DEVICE_ATTRIBUTE_" + name)

    def device_name(self, device: int) -> str:
        raw = self._check("cuDeviceGetName", self._cu.cuDeviceGetName(256, self._device(device)))
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        return text.split("\0", 1)[0].strip()

    def total_memory(self, device: int) -> int:
        return int(self._check("cuDeviceTotalMem", self._cu.cuDeviceTotalMem(self._device(device))))

    def driver_version(self) -> int:
        return int(self._check("cuDriverGetVersion", self._cu.cuDriverGetVersion()))

    def func_attribute(self, func: Any, name: str) -> int:
        attr = getattr(self._cu.CUfunction_attribute, "CU_FUNC_ATTRIBUTE_" + name)
        return int(self._check("cuFuncGetAttribute", self._cu.cuFuncGetAttribute(attr, func)))

    # CUtensorMapDataType names per dtype, CUtensorMapSwizzle per span in bytes.
    _TMAP_DTYPES = {"uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "int32": "INT32", "uint64": "UINT64",
                    "int64": "INT64", "float16": "FLOAT16", "float32": "FLOAT32", "float64": "FLOAT64",
                    "bfloat16": "BFLOAT16"}
    _TMAP_SWIZZLE = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}

    def tensor_map_encode_tiled(self, dtype: str, rank: int, address: int, dims: Sequence[int],
                                strides: Sequence[int], box: Sequence[int], element_strides: Sequence[int],
                                swizzle: int, oob_nan: bool) -> bytes:
        import struct

        cu = self._cu
        out = cu.cuTensorMapEncodeTiled(
            getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{self._TMAP_DTYPES[dtype]}"), rank, address,
            [cu.cuuint64_t(int(d)) for d in dims], [cu.cuuint64_t(int(x)) for x in strides],
            [cu.cuuint32_t(int(b)) for b in box], [cu.cuuint32_t(int(e)) for e in element_strides],
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{self._TMAP_SWIZZLE[swizzle]}"),
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA if oob_nan
            else cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        tm = self._check("cuTensorMapEncodeTiled", out)
        return struct.pack("<16Q", *(int(x) for x in tm.opaque))

    def event_create(self) -> Any:
        # Default flags: timing enabled (CU_EVENT_DISABLE_TIMING would make ElapsedTime fail).
        return self._check("cuEventCreate", self._cu.cuEventCreate(0))

    def event_record(self, event: Any, stream: int) -> None:
        self._check("cuEventRecord", self._cu.cuEventRecord(event, stream))

    def event_synchronize(self, event: Any) -> None:
        self._check("cuEventSynchronize", self._cu.cuEventSynchronize(event))

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        return float(self._check("cuEventElapsedTime", self._cu.cuEventElapsedTime(start, end)))

    def event_destroy(self, event: Any) -> None:
        self._check("cuEventDestroy", self._cu.cuEventDestroy(event))
