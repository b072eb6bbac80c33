"""Array helpers for ops: one place that knows the array kinds (NumPy, torch tensors, CuPy / numba
device arrays, DLPack host objects): shapes, dtype names, bf16, contiguity, host views, the stream
an op runs on, and allocating outputs next to the inputs. torch is never imported here: a tensor
can only exist once the caller imported it."""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import devices
from .ctypes_ import TYPESTR as _TYPESTR
from .errors import ArgumentError, ArgumentTypeError


def bfloat16() -> np.dtype:
    """ml_dtypes.bfloat16 (imported on first use; MissingDependency names the extra when absent)."""
    try:
        import ml_dtypes
    except ImportError:
        from .errors import MissingDependency

        raise MissingDependency("ml_dtypes", "test", "bfloat16 NumPy arrays") from None

    return np.dtype(ml_dtypes.bfloat16)


def torch_module() -> Any:
    """torch if something already imported it, else None: a tensor can only exist once torch is loaded,
    so asking sys.modules never imports torch on behalf of NumPy users."""
    return sys.modules.get("torch")


def is_torch(a: Any) -> bool:
    """True for a torch.Tensor (or subclass, e.g. nn.Parameter)."""
    k = _torch_types.get(type(a))
    if k is None:
        k = _classify(type(a))
    return k


# type -> whether it is torch.Tensor or a subclass, filled on first sight: one dict lookup per call on the hot
# path instead of sys.modules + isinstance. Final either way: a type seen before torch was imported cannot
# subclass torch.Tensor.
_torch_types: dict[type, bool] = {}


def _classify(t: type) -> bool:
    torch = sys.modules.get("torch")
    k = _torch_types[t] = torch is not None and issubclass(t, torch.Tensor)
    return k


def is_torch_cuda(a: Any) -> bool:
    return is_torch(a) and a.device.type == "cuda"


def _module(a: Any) -> str:
    return type(a).__module__.split(".")[0]


def torch_dtype_name(dt: Any) -> str:
    """NumPy-style name of a torch dtype: torch.float32 -> "float32", torch.bfloat16 -> "bfloat16"."""
    name = _torch_dtype_names.get(dt)
    if name is None:
        name = _torch_dtype_names[dt] = str(dt).rpartition(".")[2]
    return name


_torch_dtype_names: dict[Any, str] = {}  # torch dtype object -> name (a handful of entries)


def _host_view(a: Any) -> np.ndarray | None:
    """A NumPy view of a host array given as a foreign object (DLPack), else None."""
    if hasattr(a, "__dlpack__") and not hasattr(a, "__cuda_array_interface__"):
        try:
            return np.from_dlpack(a)
        except Exception:
            return None
    return None


def _not_an_array(a: Any, name: str | None) -> ArgumentTypeError:
    where = f"{name}: " if name else ""
    return ArgumentTypeError(
        f"{where}expected an array (NumPy, torch tensor, __cuda_array_interface__ or DLPack), got {type(a).__name__}"
    )


def np_dtype_name(dt: np.dtype) -> str:
    """dt.name, looked up: NumPy computes a dtype's name in Python on every access (microseconds, several
    times a launch), a dict lookup by the dtype object costs a tenth of one."""
    name = _np_dtype_names.get(dt)
    if name is None:
        name = _np_dtype_names[dt] = dt.name
    return name


_np_dtype_names: dict[np.dtype, str] = {}  # a handful of entries: the dtypes arrays come in


def dtype_name(a: Any, name: str | None = None) -> str:
    """NumPy dtype name of an array of any supported kind ("float32", "bfloat16", "int64", ...)."""
    if type(a) is np.ndarray or isinstance(a, np.ndarray):
        return np_dtype_name(a.dtype)
    if is_torch(a):
        return torch_dtype_name(a.dtype)
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        ts = cai["typestr"]
        return _TYPESTR.get(ts[1:], ts)
    host = _host_view(a)
    if host is not None:
        return host.dtype.name
    raise _not_an_array(a, name)


# The I/O element types of the kernel families (kernels_cu/pk_common.cuh's PK_IO_KERNELS): kind, NumPy dtype
# name, kernel-name suffix.
IO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
IO_KINDS: tuple[str, ...] = tuple(IO_DTYPES)
_IO_SUFFIX = {"f32": "", "bf16": "_bf16", "f16": "_f16"}
_IO_KIND_OF = {v: k for k, v in IO_DTYPES.items()}


def io_kind(name: str, a: Any, allowed: tuple[str, ...] = ("f32", "bf16")) -> str:
    """"f32", "bf16" or "f16" for a float32 / bfloat16 / float16 array, else an error naming the argument.

    `allowed` lists the kinds the caller's kernels exist for (IO_KINDS for the families written once over
    the element type)."""
    dt = dtype_name(a, name)
    k = _IO_KIND_OF.get(dt)
    if k not in allowed:
        want = " or ".join(IO_DTYPES[x] for x in allowed)
        raise ArgumentTypeError(f"{name}: expected dtype {want}, got {dt}")
    return k


def shape_of(a: Any, name: str | None = None) -> tuple[int, ...]:
    if isinstance(a, np.ndarray):
        return a.shape
    if is_torch(a):
        return tuple(a.shape)
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        return tuple(cai["shape"])
    host = _host_view(a)
    if host is not None:
        return host.shape
    raise _not_an_array(a, name)


def check_ndim(name: str, a: Any, ndims: tuple[int, ...], layout: str | tuple[str, ...] | None = None
               ) -> tuple[int, ...]:
    """The shape of `a`, which must have one of `ndims` dimensions, else an ArgumentError that says what is
    expected: `layout` names the axes, one string per entry of ndims (or one string for a single ndim), e.g.
    check_ndim("q", q, (3,), "(seq_len, num_heads, head_dim)") ->
    "q: expected a 3-D array (seq_len, num_heads, head_dim), got shape (2, 3, 4, 5)"."""
    shp = shape_of(a, name)
    if len(shp) not in ndims:
        raise ArgumentError(f"{name}: expected {expected_layout(ndims, layout)}, got shape {tuple(shp)}")
    return shp


def expected_layout(ndims: tuple[int, ...], layout: str | tuple[str, ...] | None = None) -> str:
    """"a 3-D array (seq_len, num_heads, head_dim)" or "a 3-D array (...) or a 4-D array (...)": the
    expected-shape phrase of check_ndim, for messages that check more than the rank."""
    names = (layout,) if isinstance(layout, str) else (layout or (None,) * len(ndims))
    if len(names) != len(ndims):
        raise ValueError(f"layout: expected {len(ndims)} strings (one per entry of ndims), got {len(names)}")
    return " or ".join(f"a {n}-D array" + (f" {lay}" if lay else "") for n, lay in zip(ndims, names))


def contiguous(a: Any) -> Any:
    """A C-contiguous version of `a`, of the same kind (copied only when needed).

    torch tensors are detached first: the ops treat `requires_grad` tensors as data
    (autograd lives in pykern.torch). A DLPack host object becomes a NumPy view, so the
    outputs allocated next to it are NumPy. Other device arrays are returned as given
    (CuPy is copied when strided); the launcher rejects a strided one by name.
    """
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a)
    if is_torch(a):
        a = a.detach()
        return a if a.is_contiguous() else a.contiguous()
    if _module(a) == "cupy":
        import cupy

        return cupy.ascontiguousarray(a)
    host = _host_view(a)
    if host is not None:
        return np.ascontiguousarray(host)
    return a


def is_host(a: Any) -> bool:
    """True when the array's memory is host memory (NumPy, CPU torch tensors, host DLPack objects)."""
    if isinstance(a, np.ndarray):
        return True
    if is_torch(a):
        return a.device.type == "cpu"
    return not hasattr(a, "__cuda_array_interface__")


class _TensorMemory:
    """NumPy's `__array_interface__` over a CPU tensor's memory, holding the tensor.

    `Tensor.numpy()` marks the tensor's storage non-resizable for as long as torch lives,
    which breaks code that frees storage by resizing it to 0 (FSDP2's parameter
    resharding). A view built from data_ptr() leaves the storage as it was; the array's
    `.base` is this object, which keeps the tensor (and so its storage) alive."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: Any, typestr: str) -> None:
        item = t.element_size()
        self.tensor = t
        self.__array_interface__ = {
            "shape": tuple(t.shape), "typestr": typestr, "version": 3,
            # torch strides count elements; NumPy's count bytes. data_ptr() includes the storage offset.
            "strides": tuple(s * item for s in t.stride()),
            "data": (t.data_ptr(), False),  # writeable, as Tensor.numpy() is
        }


# typestr of the host view of each torch dtype; 16- and 8-bit floats NumPy lacks travel as raw
# words and are reinterpreted as their ml_dtypes type (same bits).
_HOST_TYPESTR = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4", "int16": "<i2",
    "int8": "|i1", "uint8": "|u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "bool": "|b1",
    "complex64": "<c8", "complex128": "<c16",
    "bfloat16": "<u2", "float8_e4m3fn": "|u1", "float8_e5m2": "|u1",
}


def _ml_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return bfloat16()
    import ml_dtypes  # float8: ml_dtypes is already loaded by whoever made such a tensor's reference data

    return np.dtype(getattr(ml_dtypes, name))


def _tensor_host_view(t: Any) -> np.ndarray:
    if t.device.type != "cpu":
        raise ArgumentTypeError(f"expected a host array, got a tensor on {t.device}")
    if type(t).__name__ == "DTensor" or not t.layout == sys.modules["torch"].strided:
        # a DTensor's data_ptr() is not its data: the caller decides between the local shard and the full tensor
        raise ArgumentTypeError(f"expected a plain strided CPU tensor, got a {type(t).__name__} "
                                f"with layout {t.layout}; pass t.to_local() or t.full_tensor() for a DTensor")
    if t.is_conj() or t.is_neg():
        raise ArgumentTypeError("expected a tensor without a lazy conjugate/negative bit; call resolve_conj() / "
                                "resolve_neg() first")
    name = torch_dtype_name(t.dtype)
    ts = _HOST_TYPESTR.get(name)
    if ts is None:
        raise ArgumentTypeError(f"expected a tensor of a NumPy-representable dtype, got {t.dtype}")
    view = np.asarray(_TensorMemory(t, ts))
    return view.view(_ml_dtype(name)) if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2") else view


def host_view(a: Any) -> np.ndarray:
    """A NumPy view (no copy) of a host array: NumPy itself, a CPU torch tensor (bf16 as
    ml_dtypes.bfloat16 over the same bits, strides kept, writeable), or a host DLPack object.

    A tensor's view comes from data_ptr(), not Tensor.numpy(): the tensor's storage stays
    resizable (FSDP2 frees parameters by resizing their storage to 0)."""
    if isinstance(a, np.ndarray):
        return a
    if is_torch(a):
        return _tensor_host_view(a.detach())
    host = _host_view(a)
    if host is None:
        raise ArgumentTypeError(f"expected a host array, got {type(a).__name__}")
    return host


def data_address(a: Any) -> int | None:
    """The address of an array's first element (NumPy, torch, __cuda_array_interface__); None when it cannot
    be told (the ops that need an aligned base then take their general path)."""
    if isinstance(a, np.ndarray):
        return int(a.ctypes.data)
    if is_torch(a):
        return int(a.data_ptr())
    cai = getattr(a, "__cuda_array_interface__", None)
    return int(cai["data"][0]) if cai is not None else None


def aligned16(*arrs: Any) -> bool:
    """Whether every array's data address is known and 16-byte aligned (the kernels that move 16-byte chunks)."""
    for a in arrs:
        p = data_address(a)
        if p is None or p % 16:
            return False
    return True


def aligned_copy(a: Any) -> Any:
    """A copy of `a` in a fresh allocation (16-byte aligned: NumPy's, torch's and CuPy's allocators align at least
    that much), or None for a kind of array that cannot be copied here."""
    if isinstance(a, np.ndarray):
        return np.array(a, copy=True)
    if is_torch(a):
        return a.clone()
    copy = getattr(a, "copy", None)  # CuPy
    return copy() if callable(copy) and hasattr(a, "__cuda_array_interface__") else None


def launch_stream(stream: Any, like: Any) -> Any:
    """The stream an op launches on: `stream` when given; else, for a torch CUDA tensor, torch's
    current stream on the tensor's own device; for a CuPy array, CuPy's current stream on the array's
    device; else None (the backend default). Resolved once per op call so every launch of the op shares it."""
    if stream is not None:
        return stream
    if is_torch(like):
        if like.device.type == "cuda":
            return sys.modules["torch"].cuda.current_stream(like.device).cuda_stream
        return None
    if _module(like) == "cupy":
        import cupy

        dev = getattr(like, "device", None)
        if dev is None:
            return cupy.cuda.get_current_stream().ptr
        try:
            return cupy.cuda.get_current_stream(int(dev.id)).ptr
        except TypeError:  # an old CuPy without the device argument: make the array's device current
            with dev:
                return cupy.cuda.get_current_stream().ptr
    return None


def stream_scoped(fn: Any) -> Any:
    """Decorator of the ops. With torch or CuPy loaded it first checks the devices of every array
    argument, positional or keyword (devices.op_device): a meta tensor, or arrays on two CUDA devices,
    raise naming the arguments before anything is allocated. Then, with torch CUDA tensors and an
    explicit `stream=` other than torch's current one on their device, it runs the whole op with that
    stream current, so its outputs and workspaces are allocated for (and freed back to) the stream that
    uses them by torch's caching allocator, and torch-side fills land on it too. Costs a dict lookup
    when neither torch nor CuPy is loaded."""
    import functools

    modules = sys.modules

    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        if "torch" not in modules and "cupy" not in modules:
            return fn(*args, **kw)
        dev = devices.op_device(fn, args, kw)
        stream = kw.get("stream")
        if stream is None or dev is None:
            return fn(*args, **kw)
        torch = modules["torch"]
        handle = devices.stream_handle(stream)
        if handle == torch.cuda.current_stream(dev).cuda_stream:
            return fn(*args, **kw)
        with torch.cuda.stream(torch.cuda.ExternalStream(handle, device=dev)):
            return fn(*args, **kw)

    return wrapper


class DeviceView:
    """A device buffer handed to a backend: pointer, shape and dtype, read once from a torch CUDA
    tensor via data_ptr() (torch refuses __cuda_array_interface__ on requires_grad tensors and on
    bfloat16). Keeps the tensor alive for the launch. Exposes a CUDA array interface (v2, no
    stream: the op chose the stream) for backends that consume that (numba). `device` is the CUDA
    ordinal when known (None: the nvrtc backend reads it from the owner, or the pointer, when the
    machine has more than one GPU)."""

    __slots__ = ("ptr", "shape", "typestr", "owner", "device")

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, owner: Any, device: int | None = None) -> None:
        self.ptr, self.shape, self.typestr, self.owner, self.device = ptr, shape, typestr, owner, device

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, False), "version": 2,
                "strides": None}


# typestr of the torch dtypes a kernel parameter may take (bf16 travels as raw 16-bit words)
_TORCH_TYPESTR = {
    "float32": "<f4", "float64": "<f8", "bfloat16": "<u2", "float16": "<f2", "int8": "|i1", "uint8": "|u1",
    "int16": "<i2", "uint16": "<u2", "int32": "<i4", "uint32": "<u4", "int64": "<i8", "uint64": "<u8",
    "bool": "|b1",
}


def device_view_typestr(dt: Any) -> str:
    """The DeviceView typestr of a torch dtype."""
    ts = _torch_typestr.get(dt)
    if ts is None:
        dn = torch_dtype_name(dt)
        ts = _torch_typestr[dt] = _TORCH_TYPESTR.get(dn, dn)
    return ts


def device_view(t: Any) -> DeviceView:
    """DeviceView of a (contiguous) torch CUDA tensor."""
    dt = t.dtype
    ts = _torch_typestr.get(dt)
    if ts is None:
        ts = device_view_typestr(dt)
    return DeviceView(t.data_ptr(), tuple(t.shape), ts, t)


_torch_typestr: dict[Any, str] = {}  # torch dtype object -> typestr


def astype(a: Any, dtype: str) -> Any:
    """`a` converted to `dtype` ("int64", ...) with its own library, on its own device (no host trip)."""
    if dtype_name(a) == dtype:
        return a
    if isinstance(a, np.ndarray):
        return a.astype(dtype)
    if is_torch(a):
        torch = sys.modules["torch"]
        if dtype.startswith("uint") and dtype != "uint8":
            # torch's uint16/32/64 have few kernels: convert to the signed twin (same bits for the
            # values that fit) and reinterpret, which is metadata only.
            return a.detach().to(getattr(torch, dtype[1:])).view(getattr(torch, dtype))
        return a.detach().to(getattr(torch, dtype))
    if _module(a) == "cupy":
        return a.astype(dtype)
    host = _host_view(a)
    if host is not None:
        return host.astype(dtype)
    raise ArgumentTypeError(f"cannot convert a {type(a).__name__} to {dtype}; pass a {dtype} array")


def _resolve(dtype: Any) -> np.dtype:
    if type(dtype) is str:
        dt = _resolved.get(dtype)
        if dt is None:
            dt = _resolved[dtype] = (bfloat16() if dtype in ("bf16", "bfloat16")
                                     else np.dtype(IO_DTYPES.get(dtype, dtype)))
        return dt
    return np.dtype(dtype)


_resolved: dict[str, np.dtype] = {}  # the dtype spellings the ops pass ("int32", "f32", "bf16", ...)


_TORCH_DTYPES: dict[np.dtype, Any] = {}


def empty(shape: tuple[int, ...], dtype: Any, like: Any = None) -> Any:
    """Uninitialized output on the same kind of memory as `like` (NumPy, torch or CuPy).

    torch outputs come from torch's allocator on `like`'s device (CUDA-graph capturable)."""
    dt = _resolve(dtype)
    if like is None or isinstance(like, np.ndarray):
        return np.empty(shape, dt)
    if is_torch(like):
        tdt = _TORCH_DTYPES.get(dt)
        if tdt is None:  # numpy's dtype.name costs microseconds: resolved once a dtype
            torch = sys.modules["torch"]
            tdt = _TORCH_DTYPES[dt] = torch.bfloat16 if dt.name == "bfloat16" else getattr(torch, dt.name)
        return sys.modules["torch"].empty(shape, dtype=tdt, device=like.device)
    mod = _module(like)
    if mod == "numba":  # numba.cuda device arrays (GPU, or the simulator's stand-ins)
        from numba import cuda

        return cuda.device_array(shape, dtype=np.uint16 if dt.name == "bfloat16" else dt)
    if mod == "cupy":
        import cupy

        if dt.name == "bfloat16":
            return cupy.empty(shape, dtype=cupy.uint16)
        return cupy.empty(shape, dtype=dt)
    raise ArgumentTypeError(f"cannot allocate an output like {type(like).__name__}; pass NumPy, torch or CuPy arrays")


def zeros(shape: tuple[int, ...], dtype: Any, like: Any = None) -> Any:
    if like is not None and _module(like) == "numba":
        from numba import cuda

        host = np.zeros(shape, _resolve(dtype))
        return cuda.to_device(host.view(np.uint16) if host.dtype.name == "bfloat16" else host)
    return fill_zero(empty(shape, dtype, like))


def fill_zero(a: Any) -> Any:
    """Zero `a` in place with its own library, on its own device (NumPy, torch, CuPy); returns it."""
    if isinstance(a, np.ndarray):
        a.fill(0)
    else:
        a.zero_() if hasattr(a, "zero_") else a.fill(0)
    return a


def same_memory_kind(a: Any, like: Any) -> bool:
    """True when `a` is the kind of array `empty(..., like=like)` makes, on the same device."""
    if isinstance(like, np.ndarray) or like is None:
        return isinstance(a, np.ndarray)
    if is_torch(like):
        return is_torch(a) and a.device == like.device
    return _module(a) == _module(like) and not isinstance(a, np.ndarray)


def check_out(out: Any, shape: tuple[int, ...], dtype: Any, like: Any, name: str = "out") -> Any:
    """Validate a caller-provided output buffer: the shape, dtype and kind (and device) the op would
    allocate, C-contiguous and writeable. Returns it."""
    dt = np_dtype_name(_resolve(dtype))
    got = dtype_name(out, name)
    if not same_memory_kind(out, like):
        dev = f" on {like.device}" if is_torch(like) else ""
        raise ArgumentTypeError(f"{name}: expected a {type(like).__name__}{dev} like the inputs, "
                                f"got {type(out).__name__}" + (f" on {out.device}" if is_torch(out) else ""))
    if tuple(shape_of(out)) != tuple(shape):
        raise ArgumentError(f"{name}: expected shape {tuple(shape)}, got {tuple(shape_of(out))}")
    if got != dt:
        raise ArgumentTypeError(f"{name}: expected dtype {dt}, got {got}")
    if isinstance(out, np.ndarray):
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ArgumentError(f"{name}: expected a C-contiguous, writeable array, got strides {out.strides}")
        return out
    if is_torch(out):
        if not out.is_contiguous():
            raise ArgumentError(f"{name}: expected a contiguous tensor, got strides {tuple(out.stride())}")
        return out
    cai = getattr(out, "__cuda_array_interface__", None)
    if cai is not None:
        # A strided device array would be reshaped into a copy by some libraries (CuPy) and the op's
        # result written there: refuse it here, naming the argument.
        strides, item = cai.get("strides"), np.dtype(cai["typestr"]).itemsize
        if strides is not None:
            step, want = item, []
            for n in reversed(tuple(cai["shape"])):
                want.append(step)
                step *= int(n)
            got_s = [int(x) for x, n in zip(strides, cai["shape"]) if n > 1]
            if got_s != [w for w, n in zip(reversed(want), cai["shape"]) if n > 1]:
                raise ArgumentError(f"{name}: expected a C-contiguous array, got strides {tuple(strides)}")
        if cai.get("data", (0, False))[1]:
            raise ArgumentError(f"{name}: expected a writeable array, got a read-only one")
    return out


UINT_MAX = 2**32 - 1


def size(shape: tuple[int, ...]) -> int:
    """Element count of a shape, in Python ints (no 32-bit overflow)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    """A Python / NumPy int in [lo, hi] (bool, float, str, None are type errors naming the argument)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{name}: expected an int, got {type(value).__name__} {value!r:.40}")
    if not lo <= int(value) <= hi:
        raise ArgumentError(f"{name}: expected an int in [{lo}, {hi}], got {int(value)}")
    return int(value)


def check_u32(name: str, value: int) -> None:
    """A size that reaches a kernel as `unsigned int` must fit in 32 bits."""
    if value > UINT_MAX:
        raise ArgumentError(f"{name}: expected at most {UINT_MAX}, got {value}")


def same_kind(name: str, a: Any, kind: str, ref_name: str) -> None:
    """`a` must have the same I/O dtype ("f32" | "bf16" | "f16") as the argument `ref_name`."""
    k = io_kind(name, a, IO_KINDS)
    if k != kind:
        raise ArgumentTypeError(f"{name}: expected the dtype of {ref_name} ({kind}), got {k}")


def kernel_suffix(kind: str) -> str:
    """Name suffix of a kernel's instantiation for an I/O kind: "" (f32), "_bf16", "_f16"."""
    return _IO_SUFFIX[kind]


_SIGNED_TWIN = {"uint16": np.int16, "uint32": np.int32, "uint64": np.int64}


def to_like(host: np.ndarray, like: Any) -> Any:
    """`host`, a small NumPy array (indices, lengths, per-row parameters), on the memory `like` is on, of the
    kind `empty(..., like=like)` makes: NumPy (and host DLPack objects) keep it as it is, a torch tensor gets a
    tensor on its device, CuPy a CuPy array, a numba device array a numba one.

    The copy goes host-to-device, never the other way. torch: one element becomes a fill kernel (no pageable
    copy, so a CUDA graph can capture it); unsigned 16/32/64-bit words travel as their signed twin and are
    reinterpreted (torch's unsigned types have few kernels; the bits are the same)."""
    if like is None or isinstance(like, np.ndarray):
        return host
    if is_torch(like):
        torch = sys.modules["torch"]
        if like.device.type == "cpu":
            return torch.from_numpy(host)
        name = np_dtype_name(host.dtype)
        twin = _SIGNED_TWIN.get(name)
        src = host.view(twin) if twin is not None else host
        if src.size == 1:
            t = torch.full(src.shape, src.reshape(-1)[0].item(), dtype=getattr(torch, np_dtype_name(src.dtype)),
                           device=like.device)
        else:
            t = torch.as_tensor(src, device=like.device)
        return t.view(getattr(torch, name)) if twin is not None else t
    mod = _module(like)
    if mod == "cupy":
        import cupy

        return cupy.asarray(host)
    if mod == "numba":
        from numba import cuda

        return cuda.to_device(host)
    if is_host(like):
        return host
    raise ArgumentTypeError(f"cannot place a host array next to a {type(like).__name__}; pass NumPy, torch or "
                            f"CuPy arrays")


def flat_view(a: Any) -> Any:
    """`a` as the kernels index it, flat: NumPy arrays and tensors as 1-D views (the numba references index flat
    memory too); other device arrays go as they are (the launcher takes their pointer). `a` is contiguous."""
    if isinstance(a, np.ndarray) or is_torch(a):
        return a.reshape(-1)
    return a


def pad_last(a: Any, n: int) -> Any:
    """A contiguous copy of `a` with zeros appended along its last axis up to length n (>= a's), same kind and
    device (NumPy, torch, CuPy; numba device arrays through a host copy)."""
    m = shape_of(a)[-1]
    if is_torch(a):
        return sys.modules["torch"].nn.functional.pad(a.detach(), (0, n - m)).contiguous()
    if _module(a) == "numba":
        from numba import cuda

        host = a.copy_to_host()
        out = np.zeros((*host.shape[:-1], n), host.dtype)
        out[..., :m] = host
        return cuda.to_device(out)
    if _module(a) == "cupy":
        import cupy

        out = cupy.zeros((*a.shape[:-1], n), a.dtype)
    else:
        a = contiguous(a)  # NumPy, or a host DLPack object's NumPy view
        out = np.zeros((*a.shape[:-1], n), a.dtype)
    out[..., :m] = a
    return out


def narrow_last(a: Any, n: int) -> Any:
    """A contiguous copy of a[..., :n], same kind and device (NumPy, torch, CuPy; numba device arrays through a
    host copy)."""
    if is_torch(a):
        return a[..., :n].contiguous()
    if _module(a) == "numba":
        from numba import cuda

        return cuda.to_device(np.ascontiguousarray(a.copy_to_host()[..., :n]))
    if _module(a) == "cupy":
        import cupy

        return cupy.ascontiguousarray(a[..., :n])
    return np.ascontiguousarray(a[..., :n])


def arange_like(n: int, dtype: str, like: Any) -> Any:
    """0 .. n - 1 as `dtype` on the memory `like` is on (the kind `empty(..., like=like)` makes): made on its
    device where the library can (torch, CuPy: a fill kernel, no host copy), else copied host-to-device."""
    if is_torch(like):
        torch = sys.modules["torch"]
        return torch.arange(n, dtype=getattr(torch, dtype), device=like.device)
    if _module(like) == "cupy":
        import cupy

        return cupy.arange(n, dtype=dtype)
    return to_like(np.arange(n, dtype=dtype), like)


def in_place(name: str, a: Any, what: str = "the result") -> Any:
    """`a` as the kernels write into it in place (an op's `inplace=True`): it must be contiguous already (a copy
    would take the writes instead of the caller's array) and, NumPy, writeable. ArgumentError naming `name`."""
    c = contiguous(a)
    if c is not a and not (is_torch(a) and c.data_ptr() == a.data_ptr()):
        raise ArgumentError(f"{name}: inplace=True needs a contiguous array ({what} is written into it)")
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        raise ArgumentError(f"{name}: inplace=True needs a writeable array")
    return c


def view_bool(a: Any) -> Any:
    """A one-byte array (uint8 / int8 / bool) seen as bool, same memory (NumPy, torch); other kinds as they are
    (the kernels read bytes)."""
    if isinstance(a, np.ndarray):
        return a.view(np.bool_)
    if is_torch(a):
        return a.view(sys.modules["torch"].bool)
    return a


def view_uint8(a: Any) -> Any:
    """A one-byte array (bool / int8 / uint8) seen as uint8, same memory (NumPy, torch, CuPy and other kinds with
    a NumPy-style view)."""
    if isinstance(a, np.ndarray):
        return a.view(np.uint8)
    if is_torch(a):
        return a.view(sys.modules["torch"].uint8)
    return a.view("uint8")


def memory_key(a: Any) -> Any:
    """A hashable name of the memory `a` lives in, for caching small per-device buffers: "host" for NumPy, the
    device for a torch tensor; None for other kinds (no cache: allocate each time)."""
    if isinstance(a, np.ndarray):
        return "host"
    if is_torch(a):
        return a.device
    return None


def framework(like: Any) -> tuple[str, Any]:
    """("numpy" | "torch" | "cupy", the library's module) of the array `like`: where an op that composes library
    calls (matmuls, small element ops) runs them, on the caller's device. Other device arrays are taken for
    CuPy (ImportError names it when it is absent)."""
    if is_torch(like):
        return "torch", sys.modules["torch"]
    if isinstance(like, np.ndarray):
        return "numpy", np
    import cupy

    return "cupy", cupy


def host_array_view(a: Any) -> np.ndarray | None:
    """A NumPy view of a NumPy array or a CPU tensor, else None: everything else is treated as device memory
    and never read on the host (device arrays, and the numba simulator's stand-ins for them, which have no
    __cuda_array_interface__). For index arrays an op validates on the host only when they live there."""
    if isinstance(a, np.ndarray):
        return a
    if is_torch(a):
        return host_view(a) if is_host(a) else None  # is_host: the one place that says what is host memory
    return None


def dequantize_heads(a: Any, descale: Any, n_kv_heads: int, dtype: str = "bfloat16") -> Any:
    """`a` (batch, n, heads, d), an fp8 array (float8_e4m3fn), times its fp32 `descale` (one element, or (batch,
    n_kv_heads): head h takes kv head h // (heads // n_kv_heads)), as `dtype`, computed in float32 by the array's
    own library on its own device (NumPy or torch; no host trip)."""
    if is_torch(a):
        torch = sys.modules["torch"]
        x = a.detach().to(torch.float32)
        ds = descale.detach().to(device=x.device, dtype=torch.float32)
        if ds.numel() == 1:
            x = x * ds.reshape(())
        else:
            x = x * ds.reshape(x.shape[0], n_kv_heads).repeat_interleave(x.shape[2] // n_kv_heads, dim=1)[:, None, :, None]
        return x.to(getattr(torch, dtype))
    if isinstance(a, np.ndarray):
        x = a.astype(np.float32)
        ds = np.asarray(descale, dtype=np.float32)
        if ds.size == 1:
            x = x * ds.reshape(())
        else:
            x = x * np.repeat(ds.reshape(x.shape[0], n_kv_heads), x.shape[2] // n_kv_heads, axis=1)[:, None, :, None]
        return x.astype(_resolve(dtype))
    raise ArgumentTypeError(f"cannot dequantize a {type(a).__name__}: fp8 inputs are NumPy (ml_dtypes) arrays or "
                            f"torch tensors")


def dequantize_varlen(a: Any, descale: Any, cu_seqlens: Any, n_kv_heads: int, dtype: str = "bfloat16") -> Any:
    """`a` (total, heads, d), packed sequences of an fp8 array (float8_e4m3fn; sequence b is rows cu_seqlens[b] ..
    cu_seqlens[b + 1]), times its fp32 `descale` (one element, or (batch, n_kv_heads): rows of sequence b, head h
    take descale[b, h // (heads // n_kv_heads)]), as `dtype`, in float32 by the array's own library on its own
    device (a row's sequence by a search in cu_seqlens: no host trip)."""
    if is_torch(a):
        torch = sys.modules["torch"]
        x = a.detach().to(torch.float32)
        ds = descale.detach().to(device=x.device, dtype=torch.float32)
        if ds.numel() == 1:
            return (x * ds.reshape(())).to(getattr(torch, dtype))
        cu = cu_seqlens.detach() if is_torch(cu_seqlens) else torch.as_tensor(np.asarray(cu_seqlens))
        cu = cu.to(device=x.device, dtype=torch.int64)
        seq = torch.searchsorted(cu[1:], torch.arange(x.shape[0], device=x.device), right=True)
        seq = seq.clamp(max=ds.reshape(-1, n_kv_heads).shape[0] - 1)  # rows past cu_seqlens[-1] are never read
        per = ds.reshape(-1, n_kv_heads).repeat_interleave(x.shape[1] // n_kv_heads, dim=1)[seq]
        return (x * per[:, :, None]).to(getattr(torch, dtype))
    if isinstance(a, np.ndarray):
        x = a.astype(np.float32)
        ds = np.asarray(descale, dtype=np.float32)
        if ds.size == 1:
            return (x * ds.reshape(())).astype(_resolve(dtype))
        ds = ds.reshape(-1, n_kv_heads)
        seq = np.searchsorted(np.asarray(cu_seqlens, np.int64)[1:], np.arange(x.shape[0]), side="right")
        seq = np.minimum(seq, ds.shape[0] - 1)  # rows past cu_seqlens[-1] are never read
        per = np.repeat(ds, x.shape[1] // n_kv_heads, axis=1)[seq]
        return (x * per[:, :, None]).astype(_resolve(dtype))
    raise ArgumentTypeError(f"cannot dequantize a {type(a).__name__}: fp8 inputs are NumPy (ml_dtypes) arrays or "
                            f"torch tensors")

