"""The numba backend: runs the `pykern/reference/` numba.cuda kernels on a GPU, or on numba's CUDA simulator.

Mode is decided once per process, before `numba.cuda` is imported: a usable GPU
(driver loads, cuInit succeeds, >= 1 device) means real numba.cuda; otherwise
NUMBA_ENABLE_CUDASIM=1 is set so that the import yields the simulator. A GPU
user's numba is therefore never switched to the simulator, and a process that
imported numba.cuda in GPU mode on a machine without a GPU gets a
BackendUnavailable saying so (numba cannot switch after the import).

The launch contract matches the .cu kernels: arrays arrive flat (a pointer sees
no shape), 16-bit float arrays (`__nv_bfloat16*`, `__half*`, and `unsigned short*` as bf16 words) are
widened to float32 before the call and non-const ones narrowed back with round-to-nearest-even, and the
caller's grid/block are ignored in favour of the reference's own `config(args)`.
In the simulator, barrier-free references run thread after thread in one Python
thread (see `_sequential_module`); the rest use numba's threaded simulator.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any, Sequence

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError, BackendUnavailable, KernelExecutionError
from ..registry import KernelSpec

_SIM_ENV = "NUMBA_ENABLE_CUDASIM"


def probe_gpu() -> tuple[bool, str]:
    """(a CUDA device is usable through the driver, why not), without importing numba."""
    try:
        from cuda.bindings import driver
    except Exception as e:  # no cuda-bindings wheel: numba-cuda cannot use a GPU either
        return False, f"cuda.bindings is not importable ({type(e).__name__}: {e})"
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False, f"cuInit failed with {getattr(err, 'name', err)}"
        err, count = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS:
            return False, f"cuDeviceGetCount failed with {getattr(err, 'name', err)}"
    except Exception as e:  # DynamicLibNotFoundError when no driver is installed
        return False, f"no usable CUDA driver ({type(e).__name__}: {e})"
    if count < 1:
        return False, "the CUDA driver reports no device"
    return True, ""


def _env_asks_simulator() -> bool:
    return os.environ.get(_SIM_ENV, "").strip() not in ("", "0")


def _is_simulator(cuda: Any) -> bool:
    return getattr(getattr(cuda, "jit", None), "__module__", "").startswith("numba.cuda.simulator")


class _SimulatorCuda:
    """What reference factories receive as `cuda` in the simulator.

    The simulator swaps only *module globals* bound to numba.cuda for its
    per-launch fake module; a factory's `cuda` is a closure cell, which it never
    sees. This proxy resolves each attribute against the running launch's fake
    module (threadIdx, grid, syncthreads, shared, local, atomic, ...) and falls
    back to numba.cuda itself (jit, types) outside kernels.
    """

    def __init__(self, cuda: Any, kernel_module: Any) -> None:
        self._cuda = cuda
        self._kernel_module = kernel_module
        self._seq: Any = None  # a _Sequential while NumbaBackend runs a kernel thread by thread

    def __getattr__(self, name: str) -> Any:
        if self._seq is not None:
            return getattr(self._seq, name)
        ctx = self._kernel_module._kernel_context
        if ctx is not None:
            try:
                return getattr(ctx, name)
            except AttributeError:
                pass
        return getattr(self._cuda, name)


class _NeedsThreads(Exception):
    """A reference used a block-level primitive: it must run on the threaded simulator."""


_THREADED_ONLY = ("syncthreads", "syncwarp", "shfl", "vote", "ballot", "all_sync", "any_sync", "eq_sync", "match")


def _sequential_module(sim_api: Any) -> Any:
    """The per-launch fake `cuda` for running a barrier-free kernel one thread after another.

    numba's simulator starts a Python thread per CUDA thread and busy-polls them
    (~0.25 ms per thread plus GIL hand-offs): 40x slower than calling the body
    in a loop. References are one thread per row with no barriers, for which
    sequential execution is exact; anything block-level raises _NeedsThreads
    and the launch is redone on the threaded simulator.
    """

    class _Sequential(sim_api.FakeCUDAModule):
        def __init__(self, grid: tuple[int, int, int], block: tuple[int, int, int]) -> None:
            super().__init__(grid, block, 0)
            self._bid = self._tid = sim_api.Dim3(0, 0, 0)
            self._flat_tid = 0

        @property
        def threadIdx(self) -> Any:
            return self._tid

        @property
        def blockIdx(self) -> Any:
            return self._bid

        @property
        def laneid(self) -> int:
            return self._flat_tid % 32

        @property
        def shared(self) -> Any:
            raise _NeedsThreads("shared")

        @property
        def cg(self) -> Any:
            raise _NeedsThreads("cg")

        def __getattribute__(self, name: str) -> Any:
            if name.startswith(_THREADED_ONLY):
                raise _NeedsThreads(name)
            return super().__getattribute__(name)

    return _Sequential


def widen_bf16(bits: np.ndarray) -> np.ndarray:
    """float32 array with the values of 16-bit bf16 words (exact: they are the top half of the fp32 word)."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def narrow_bf16(values: np.ndarray) -> np.ndarray:
    """uint16 bf16 words of float32 values, round-to-nearest-even, any NaN -> canonical 0x7fff (as pk_float_to_bf16
    and the hardware cvt.rn.bf16x2.f32)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, np.uint32(0x7FFF), rounded).astype(np.uint16)


def widen_f16(bits: np.ndarray) -> np.ndarray:
    """float32 array with the values of 16-bit f16 words (exact)."""
    return bits.view(np.float16).astype(np.float32)


def narrow_f16(values: np.ndarray) -> np.ndarray:
    """uint16 f16 words of float32 values as cvt.rn.f16x2.f32 makes them: round to nearest even, inf beyond
    65504, subnormals kept, any NaN -> canonical 0x7fff."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        bits = v.astype(np.float16).view(np.uint16)
    return np.where(np.isnan(v), np.uint16(0x7FFF), bits).astype(np.uint16)


# pointee C type -> (widen, narrow) of the 16-bit float types the references see as float32
_WIDEN = {"unsigned short": (widen_bf16, narrow_bf16), "__nv_bfloat16": (widen_bf16, narrow_bf16),
          "__half": (widen_f16, narrow_f16)}


class NumbaBackend:
    """`Backend` over the numba.cuda references (GPU or simulator, decided once per process)."""

    name = "numba"

    def __init__(self) -> None:
        self._mode: str | None = None  # "gpu" | "simulator" | "unavailable"
        self._why = ""
        self._cuda: Any = None
        self._ref_cuda: Any = None
        self._lock = threading.Lock()  # the simulator cannot run two kernels at once
        self._needs_threads: set[str] = set()  # kernels that use barriers: threaded simulator only
        self._seq_cls: Any = None

    # -- mode -------------------------------------------------------------------------------------------------
    def _decide(self) -> None:
        if self._mode is not None:
            return
        loaded = sys.modules.get("numba.cuda")
        if loaded is not None and hasattr(loaded, "jit"):
            if _is_simulator(loaded):
                self._mode = "simulator"
            else:
                ok, why = probe_gpu()
                if ok:
                    self._mode = "gpu"
                else:
                    self._mode, self._why = "unavailable", (
                        f"numba.cuda was imported in GPU mode before pykern chose the simulator, and no GPU is "
                        f"usable ({why}); set {_SIM_ENV}=1 before anything imports numba.cuda"
                    )
            return
        if _env_asks_simulator():
            self._mode = "simulator"
            return
        ok, why = probe_gpu()
        if ok:
            self._mode = "gpu"
            return
        os.environ[_SIM_ENV] = "1"
        cfg = sys.modules.get("numba.core.config")
        if cfg is not None:  # numba itself already read its environment: make it read it again
            cfg.reload_config()
        self._mode, self._why = "simulator", why

    def _import(self) -> Any:
        if self._cuda is not None:
            return self._cuda
        self._decide()
        if self._mode == "unavailable":
            raise BackendUnavailable(f"numba backend: {self._why}")
        try:
            import numba.cuda as cuda
        except Exception as e:
            self._mode, self._why = "unavailable", f"numba-cuda is not importable ({type(e).__name__}: {e})"
            raise BackendUnavailable(f"numba backend: {self._why}") from e
        if _is_simulator(cuda) != (self._mode == "simulator"):
            want = "the simulator" if self._mode == "simulator" else "GPU mode"
            self._mode, self._why = "unavailable", f"numba.cuda was imported in the wrong mode (wanted {want})"
            raise BackendUnavailable(f"numba backend: {self._why}")
        if self._mode == "simulator":
            from numba.cuda.simulator import kernel as sim_kernel

            self._ref_cuda = _SimulatorCuda(cuda, sim_kernel)
        else:
            try:  # numba compiles through libNVVM, which a driver-only machine may lack
                from numba.cuda.cudadrv.nvvm import NVVM

                NVVM()
            except Exception as e:
                self._mode, self._why = "unavailable", (
                    f"numba-cuda cannot load libNVVM ({type(e).__name__}: {e}); install a CUDA toolkit or the "
                    "nvidia-cuda-nvcc wheel"
                )
                raise BackendUnavailable(f"numba backend: {self._why}") from e
            self._ref_cuda = cuda
        self._cuda = cuda
        return cuda

    def cuda_module(self) -> Any:
        """What reference factories are built with (numba.cuda, or the simulator proxy)."""
        self._import()
        return self._ref_cuda

    def available(self) -> tuple[bool, str]:
        try:
            self._import()
        except BackendUnavailable as e:
            return False, str(e)
        return True, ""

    def on_gpu(self) -> bool:
        """True when references can run on a real GPU (the default selection's fallback asks this).

        Without a usable GPU this answers from the driver probe alone, never importing numba.
        """
        self._decide()
        return self._mode == "gpu" and self.available()[0]

    @property
    def simulator(self) -> bool:
        self._decide()
        return self._mode == "simulator"

    def describe(self) -> str:
        self._decide()
        if self._mode == "simulator":
            return "numba CUDA simulator" + (f" (no GPU: {self._why})" if self._why else f" ({_SIM_ENV} set)")
        return {"gpu": "numba.cuda on GPU"}.get(self._mode or "", f"unavailable: {self._why}")

    # -- launch -----------------------------------------------------------------------------------------------
    def build(self, name: str) -> tuple[Any, Any]:
        """(jitted kernel, config) of the reference registered for kernel `name`."""
        from ..reference.base import references

        cuda_mod = self.cuda_module()
        ref = references().get(name)
        if ref is None:
            raise BackendUnavailable(
                f"numba backend: no reference registered for kernel {name!r}; add one to pykern/reference/"
            )
        return ref.build(cuda_mod)

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
        """`device` (pykern.launch(device=...)) selects the GPU for host-array launches; the simulator has one.
        `pdl`: the references are launched in stream order (an ordinary launch). `cluster`: refused unless
        trivial (the references are plain grids; numba has no clusters)."""
        if cluster is not None and tuple(cluster) != (1, 1, 1):
            raise ArgumentError(f"cluster: the numba backend launches no thread-block clusters, got {tuple(cluster)} "
                                f"(use the nvrtc or host backend for {spec.name})")
        cuda = self._import()
        kernel, config = self.build(spec.name)
        with self._lock:
            if self._mode == "simulator":
                self._launch_simulated(spec, kernel, config, args)
            elif device is not None:
                with cuda.gpus[device]:
                    self._launch_gpu(cuda, spec, kernel, config, args, stream)
            else:
                self._launch_gpu(cuda, spec, kernel, config, args, stream)

    @staticmethod
    def _scalar(p: Any, a: Any) -> tuple[Any, Any]:
        """(kernel argument, config argument) of a ctypes scalar."""
        v = a.value
        # fp32 scalars keep fp32 math in the simulator and on the GPU; ints stay Python ints so index
        # arithmetic is 64-bit in both (a NumPy uint32 would wrap silently in the simulator).
        return (np.float32(v) if p.ctype == "float" else v), v

    @staticmethod
    def _geometry(config: Any, cargs: list[Any]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        cfg = config(cargs)
        g, b = tuple(int(x) for x in cfg[0]), tuple(int(x) for x in cfg[1])
        return None if min(g, default=0) <= 0 else (g, b)  # nothing to do (e.g. zero rows)

    def _fail(self, spec: KernelSpec, geo: Any, e: Exception, where: str = "") -> KernelExecutionError:
        return KernelExecutionError(
            f"numba reference of {spec.name} failed on {self.describe()} (grid={geo[0]}, block={geo[1]}{where}): "
            f"{type(e).__name__}: {e}"
        )

    # -- simulator ----------------------------------------------------------------------------------------------
    def _host_args(self, spec: KernelSpec, args: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        kargs: list[Any] = []
        cargs: list[Any] = []
        writeback: list[Any] = []
        for i, (p, a) in enumerate(zip(spec.params, args)):
            if not p.is_pointer:
                k, c = self._scalar(p, a)
                kargs.append(k)
                cargs.append(c)
                continue
            if not isinstance(a, np.ndarray):
                raise ArgumentTypeError(
                    f"{spec.name}: argument {i} ({p.ctype} {p.name}): the numba simulator takes NumPy arrays only, "
                    f"got {type(a).__name__}"
                )
            flat = a.reshape(-1)
            widen = _WIDEN.get(p.pointee)
            # A private copy, like device memory: the caller's array changes only at write-back.
            host = widen[0](flat) if widen else flat.copy()
            if not p.is_const:
                writeback.append((flat, host, widen, _raw(flat).copy()))
            kargs.append(host)
            cargs.append(host)
        return kargs, cargs, writeback

    def _launch_simulated(self, spec: KernelSpec, kernel: Any, config: Any, args: Sequence[Any]) -> None:
        kargs, cargs, writeback = self._host_args(spec, args)
        geo = self._geometry(config, cargs)
        if geo is None:
            return
        mode = os.environ.get("PYKERN_NUMBA_SIM", "auto")
        if mode != "threads" and spec.name not in self._needs_threads:
            try:
                self._run_sequential(kernel, geo, kargs)
            except _NeedsThreads:
                self._needs_threads.add(spec.name)
                kargs, cargs, writeback = self._host_args(spec, args)  # undo partial writes: fresh copies
            except KernelExecutionError as e:
                raise self._fail(spec, geo, e.__cause__ or e, e.args[0]) from e.__cause__
            else:
                self._write_back(writeback)
                return
        try:
            kernel[geo[0], geo[1]](*kargs)  # numba's threaded simulator copies NumPy args in and out
        except Exception as e:
            raise self._fail(spec, geo, e) from e
        self._write_back(writeback)

    def _run_sequential(self, kernel: Any, geo: Any, kargs: list[Any]) -> None:
        from numba.cuda.simulator import kernelapi

        if self._seq_cls is None:
            self._seq_cls = _sequential_module(kernelapi)
        g = (tuple(geo[0]) + (1, 1))[:3]
        b = (tuple(geo[1]) + (1, 1))[:3]
        seq = self._seq_cls(g, b)
        fn = kernel.py_func
        dim3 = kernelapi.Dim3
        proxy = self._ref_cuda
        proxy._seq = seq
        try:
            for bz in range(g[2]):
                for by in range(g[1]):
                    for bx in range(g[0]):
                        seq._bid = dim3(bx, by, bz)
                        flat = 0
                        for tz in range(b[2]):
                            for ty in range(b[1]):
                                for tx in range(b[0]):
                                    seq._tid = dim3(tx, ty, tz)
                                    seq._flat_tid = flat
                                    flat += 1
                                    try:
                                        fn(*kargs)
                                    except _NeedsThreads:
                                        raise
                                    except Exception as e:
                                        where = f", at blockIdx=({bx}, {by}, {bz}) threadIdx=({tx}, {ty}, {tz})"
                                        raise KernelExecutionError(where) from e
        finally:
            proxy._seq = None

    @staticmethod
    def _write_back(writeback: list[Any]) -> None:
        for target, res, widened, orig in writeback:
            _store_changed(target, widened[1](res) if widened else res, orig)

    # -- GPU ----------------------------------------------------------------------------------------------------
    def _launch_gpu(self, cuda: Any, spec: KernelSpec, kernel: Any, config: Any, args: Sequence[Any],
                    stream: Any) -> None:
        kargs: list[Any] = []
        cargs: list[Any] = []
        writeback: list[tuple[Any, Any, bool]] = []
        for i, (p, a) in enumerate(zip(spec.params, args)):
            if not p.is_pointer:
                k, c = self._scalar(p, a)
                kargs.append(k)
                cargs.append(c)
                continue
            widen = _WIDEN.get(p.pointee)
            if isinstance(a, np.ndarray):
                flat = a.reshape(-1)
                dev = cuda.to_device(widen[0](flat) if widen else flat)
                if not p.is_const:
                    writeback.append((flat, dev, widen, _raw(flat).copy()))
            else:
                dev, wb = self._device_arg(cuda, spec, i, p, a, widen)
                if wb is not None:
                    writeback.append(wb)
            kargs.append(dev)
            cargs.append(dev)
        geo = self._geometry(config, cargs)
        if geo is None:
            return
        try:
            if stream is not None:
                s = self._stream(cuda, stream)
                kernel[geo[0], geo[1], s](*kargs)
                s.synchronize()
            else:
                kernel[geo[0], geo[1]](*kargs)
        except Exception as e:
            raise self._fail(spec, geo, e) from e
        for target, dev, widened, *orig in writeback:
            res = dev.copy_to_host()
            if isinstance(target, np.ndarray):
                _store_changed(target, widened[1](res) if widened else res, orig[0])
            else:  # a caller's device array holding 16-bit floats: narrowed on the host, copied back
                target.copy_to_device(widened[1](res).view(target.dtype))

    def _device_arg(self, cuda: Any, spec: KernelSpec, i: int, p: Any, a: Any, widen: Any) -> tuple[Any, Any]:
        label = f"{spec.name}: argument {i} ({p.ctype} {p.name})"
        try:
            dev = cuda.as_cuda_array(a).reshape(-1)
        except Exception as e:
            raise ArgumentTypeError(f"{label}: numba cannot view {type(a).__name__} as a device array ({e})") from e
        if not widen:
            return dev, None  # numba writes straight into the caller's memory
        wide = cuda.to_device(widen[0](dev.copy_to_host()))
        return wide, (None if p.is_const else (dev, wide, widen))

    @staticmethod
    def _stream(cuda: Any, stream: Any) -> Any:
        if hasattr(stream, "synchronize") and type(stream).__module__.startswith("numba"):
            return stream
        handle = stream if isinstance(stream, int) else getattr(stream, "ptr", None) or getattr(stream, "cuda_stream", None)
        if not isinstance(handle, int):
            raise ArgumentTypeError(
                f"stream: expected a numba stream, an int handle or an object with .ptr, got {type(stream).__name__}"
            )
        return cuda.external_stream(handle)


_instance: NumbaBackend | None = None


def create() -> NumbaBackend:
    """The process-wide numba backend; construction imports nothing (mode is decided on first use)."""
    global _instance
    if _instance is None:
        _instance = NumbaBackend()
    return _instance


def _raw(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def _store_changed(target: np.ndarray, new: np.ndarray, orig: np.ndarray) -> None:
    """Write back the elements the kernel changed (bitwise) only: two output arguments may view
    overlapping memory (the K and V views of one combined KV cache), and a whole-array write-back of
    one would undo the other's writes with its stale copy."""
    t, n = _raw(target), _raw(np.asarray(new).reshape(target.shape))
    changed = n != orig
    t[changed] = n[changed]
