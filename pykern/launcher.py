"""`pykern.launch`: check geometry and arguments against the kernel's spec, convert, hand to a backend."""
from __future__ import annotations

import math
from math import isfinite
import numbers
from typing import Any, Callable, Sequence

import numpy as np

from . import arrays, registry
from .arrays import DeviceView, np_dtype_name
from .backends import get_backend
from .ctypes_ import POINTEE_DTYPES, SCALARS, TYPESTR
from .errors import ArgumentError, ArgumentTypeError
from .registry import KernelSpec, Param

GRID_MAX = (2**31 - 1, 65535, 65535)
BLOCK_MAX = (1024, 1024, 64)
MAX_THREADS_PER_BLOCK = 1024
# The largest dynamic shared memory any supported arch grants a block (sm_90/sm_100 opt-in);
# backends check the real device limit.
MAX_SHARED_MEM = 227 * 1024
# Thread-block clusters (sm_90+): at most 8 CTAs, the portable cluster size every Hopper GPU grants.
MAX_CLUSTER = 8


def _dim3(what: str, value: Any, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    # Fast path for the common, valid spellings: an int or a tuple of 1 to 3 ints.
    fast = (value,) if type(value) is int else value
    if type(fast) is tuple and 1 <= len(fast) <= 3:
        x, y, z = (fast + (1, 1))[:3]
        if (
            type(x) is int and type(y) is int and type(z) is int
            and 1 <= x <= limits[0] and 1 <= y <= limits[1] and 1 <= z <= limits[2]
        ):
            return x, y, z
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        dims: Sequence[Any] = (value,)
    elif isinstance(value, (tuple, list)) and 1 <= len(value) <= 3:
        dims = value
    else:
        raise ArgumentTypeError(f"{what}: expected an int or a tuple of 1 to 3 ints, got {value!r}")
    out = []
    for axis, (d, lim) in enumerate(zip(dims, limits)):
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool):
            raise ArgumentTypeError(f"{what}[{axis}]: expected an int, got {type(d).__name__} {d!r}")
        if not 1 <= d <= lim:
            raise ArgumentError(f"{what}[{axis}]: expected 1 <= value <= {lim}, got {d}")
        out.append(int(d))
    while len(out) < 3:
        out.append(1)
    return out[0], out[1], out[2]


# Argument types the converters have classified (looked up per call instead of an isinstance
# against torch, which may not even be imported): _OTHER (CAI, DLPack, ...), _TORCH, _VIEW.
_OTHER, _TORCH, _VIEW = 0, 1, 2
_type_kind: dict[type, int] = {DeviceView: _VIEW}
# Set once a torch CUDA tensor reached a launch: only then does a launch without `stream`
# look for one among its arguments (torch's current stream applies), so NumPy and CAI
# launches never pay for that scan.
_torch_cuda_seen = False
# tools/bench_launch.py --ops sets this to time the CUDA path's conversion on CPU tensors (no GPU here): a CPU
# tensor then becomes a DeviceView, as a CUDA one does, instead of its zero-copy NumPy view.
_cpu_as_device = False


def _kind_of(t: type) -> int:
    torch = arrays.torch_module()
    # Final either way: a subclass of torch.Tensor cannot exist before torch is imported.
    k = _type_kind[t] = _TORCH if torch is not None and issubclass(t, torch.Tensor) else _OTHER
    return k


def _array_converter(spec: KernelSpec, i: int, p: Param) -> Callable[[Any], Any]:
    accepted = POINTEE_DTYPES[p.pointee]
    label = f"{spec.name}: argument {i} ({p.ctype} {p.name})"
    want = " or ".join(accepted)
    writes = not p.is_const

    def convert(a: Any) -> Any:
        if type(a) is np.ndarray:
            if np_dtype_name(a.dtype) not in accepted:
                raise ArgumentTypeError(f"{label}: expected a {want} array, got dtype {a.dtype.name}")
            if not a.flags.c_contiguous:
                raise ArgumentError(f"{label}: expected a C-contiguous array, got strides {a.strides}")
            if writes and not a.flags.writeable:
                raise ArgumentError(f"{label}: the kernel writes here but the array is read-only")
            return a
        k = _type_kind.get(type(a))
        if k is None:
            k = _kind_of(type(a))
        if k:
            return a if k == _VIEW else _convert_torch(a, label, accepted, want)
        cai = getattr(a, "__cuda_array_interface__", None)
        if cai is not None:
            return _check_cai(a, cai, label, accepted, want, p)
        if isinstance(a, np.ndarray):  # subclasses
            return convert(np.asarray(a))
        if hasattr(a, "__dlpack__"):
            try:
                host = np.from_dlpack(a)
            except Exception as e:  # a device tensor without the CUDA array interface
                raise ArgumentTypeError(f"{label}: cannot view DLPack object {type(a).__name__} ({e})") from None
            return convert(host)
        raise ArgumentTypeError(
            f"{label}: expected an array (NumPy, torch, __cuda_array_interface__ or DLPack), got {type(a).__name__}"
        )

    typestrs: dict[Any, str] = {}  # accepted torch dtype -> the DeviceView typestr (checked once a dtype)

    def _convert_torch(t: Any, label: str, accepted: tuple[str, ...], want: str) -> Any:
        # requires_grad tensors are data here (autograd is pykern.torch's business): never touch
        # __cuda_array_interface__, which torch refuses for them (and for bfloat16).
        dt = t.dtype
        ts = typestrs.get(dt)
        if ts is None:
            dn = arrays.torch_dtype_name(dt)
            if dn not in accepted:
                raise ArgumentTypeError(f"{label}: expected a {want} tensor, got dtype {dt}")
            ts = typestrs[dt] = arrays.device_view_typestr(dt)
        if not t.is_contiguous():
            raise ArgumentError(f"{label}: expected a contiguous tensor, got strides {tuple(t.stride())}")
        if t.is_cuda:  # the hot path: is_cuda is a flag, where .device builds an object
            global _torch_cuda_seen
            _torch_cuda_seen = True
            return DeviceView(t.data_ptr(), tuple(t.shape), ts, t)
        if _cpu_as_device and not t.is_meta:
            return DeviceView(t.data_ptr(), tuple(t.shape), ts, t)
        if t.device.type == "cpu":
            return convert(arrays.host_view(t))  # zero-copy NumPy view: the CPU backends run on it
        if t.device.type != "cuda":
            what = " (a meta tensor has no data to compute on)" if t.device.type == "meta" else ""
            raise ArgumentTypeError(f"{label}: expected a CPU or CUDA tensor, got one on {t.device}{what}")
        _torch_cuda_seen = True
        return arrays.device_view(t)

    return convert


def _check_cai(a: Any, cai: dict, label: str, accepted: tuple[str, ...], want: str, p: Param) -> Any:
    typestr = cai.get("typestr", "")
    name = TYPESTR.get(typestr[1:], typestr)
    if name not in accepted:
        raise ArgumentTypeError(f"{label}: expected a {want} array, got typestr {typestr!r}")
    shape, strides = tuple(cai.get("shape", ())), cai.get("strides")
    if strides is not None:
        itemsize = int(typestr[2:])
        expect, step = [], itemsize
        for n in reversed(shape):
            expect.append(step)
            step *= n
        if tuple(s for s, n in zip(strides, shape) if n > 1) != tuple(
            s for s, n in zip(reversed(expect), shape) if n > 1
        ):
            raise ArgumentError(f"{label}: expected a C-contiguous array, got strides {tuple(strides)}")
    if not p.is_const and cai.get("data", (0, False))[1]:
        raise ArgumentError(f"{label}: the kernel writes here but the array is read-only")
    return a


def _scalar_converter(spec: KernelSpec, i: int, p: Param) -> Callable[[Any], Any]:
    st = SCALARS[p.ctype]
    ct, lo, hi = st.ctype, st.lo, st.hi
    label = f"{spec.name}: argument {i} ({p.ctype} {p.name})"

    if st.kind == "int":

        def convert(v: Any) -> Any:
            if type(v) is not int:
                if isinstance(v, bool) or not isinstance(v, (numbers.Integral, np.integer)):
                    raise ArgumentTypeError(f"{label}: expected an integer, got {type(v).__name__} {v!r}")
                v = int(v)
            if not lo <= v <= hi:
                raise ArgumentError(f"{label}: expected {lo} <= value <= {hi}, got {v}")
            return ct(v)

    elif st.kind == "float":

        def convert(v: Any) -> Any:
            if type(v) is float:
                if lo <= v <= hi or not isfinite(v):  # inf and nan pass through as C does
                    return ct(v)
                raise ArgumentError(f"{label}: {v!r} overflows {p.ctype}")
            if isinstance(v, bool) or not isinstance(v, (numbers.Real, np.integer, np.floating)):
                raise ArgumentTypeError(f"{label}: expected a real number, got {type(v).__name__} {v!r}")
            try:
                v = float(v)
            except OverflowError:  # an int no double can hold
                text = str(v)
                text = text if len(text) <= 24 else f"{text[:12]}... ({len(text.lstrip('-'))} digits)"
                want = f"{lo:.9g} <= value <= {hi:.9g}" if math.isfinite(lo) else f"a value a {p.ctype} can hold"
                raise ArgumentError(f"{label}: expected {want}, got {text}") from None
            if math.isfinite(v) and not lo <= v <= hi:
                raise ArgumentError(f"{label}: {v!r} overflows {p.ctype}")
            return ct(v)

    elif st.kind == "vector":  # float2, int4, ...: a sequence of its components
        comp = _scalar_converter(spec, i, Param(p.name, st.component))
        count = st.count

        def convert(v: Any) -> Any:
            if isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or len(v) != count:
                raise ArgumentTypeError(f"{label}: expected a sequence of {count} {st.component} values, got {v!r}")
            return ct(*(comp(x).value for x in v))

    elif st.kind == "tensormap":  # a pykern.tensormap.TensorMap: its 128 bytes, 64-byte aligned

        def convert(v: Any) -> Any:
            c = getattr(v, "cvalue", None)
            if not isinstance(c, ct):
                raise ArgumentTypeError(
                    f"{label}: expected a tensor map from pykern.tensormap.make_tensor_map, got {type(v).__name__}")
            return c

    else:

        def convert(v: Any) -> Any:
            if not isinstance(v, (bool, np.bool_)):
                raise ArgumentTypeError(f"{label}: expected a bool, got {type(v).__name__} {v!r}")
            return ct(bool(v))

    return convert


# Keyed by id(): hashing a frozen spec walks all its params on every launch. The
# spec is kept in the entry so an id reused after garbage collection is detected.
_plans: dict[int, tuple[KernelSpec, tuple[Callable[[Any], Any], ...]]] = {}


def converters(spec: KernelSpec) -> tuple[Callable[[Any], Any], ...]:
    """One converter per parameter, built once per spec (the hot path only calls them)."""
    entry = _plans.get(id(spec))
    if entry is None or entry[0] is not spec:
        plan = tuple(
            _array_converter(spec, i, p) if p.is_pointer else _scalar_converter(spec, i, p)
            for i, p in enumerate(spec.params)
        )
        entry = _plans[id(spec)] = (spec, plan)
    return entry[1]


def convert_args(spec: KernelSpec, args: Sequence[Any]) -> list[Any]:
    plan = converters(spec)
    if len(args) != len(plan):
        sig = ", ".join(f"{p.ctype} {p.name}" for p in spec.params)
        raise ArgumentTypeError(f"{spec.name}: expected {len(plan)} arguments ({sig}), got {len(args)}")
    return [c(a) for c, a in zip(plan, args)]


def check_geometry(
    grid: Any, block: Any, shared_mem: Any
) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    g = _dim3("grid", grid, GRID_MAX)
    b = _dim3("block", block, BLOCK_MAX)
    if type(shared_mem) is int and 0 <= shared_mem <= MAX_SHARED_MEM and b[0] * b[1] * b[2] <= MAX_THREADS_PER_BLOCK:
        return g, b, shared_mem
    if b[0] * b[1] * b[2] > MAX_THREADS_PER_BLOCK:
        raise ArgumentError(f"block: expected at most {MAX_THREADS_PER_BLOCK} threads, got {b} = {b[0] * b[1] * b[2]}")
    if not isinstance(shared_mem, (int, np.integer)) or isinstance(shared_mem, bool):
        raise ArgumentTypeError(f"shared_mem: expected an int, got {type(shared_mem).__name__}")
    if not 0 <= shared_mem <= MAX_SHARED_MEM:
        raise ArgumentError(f"shared_mem: expected 0 <= bytes <= {MAX_SHARED_MEM}, got {shared_mem}")
    return g, b, int(shared_mem)


def launch(
    name: str,
    grid: Any,
    block: Any,
    *args: Any,
    shared_mem: int = 0,
    stream: Any = None,
    backend: str | None = None,
    device: int | None = None,
    pdl: bool = False,
    cluster: Any = None,
) -> None:
    """Launch kernel `name` with arguments in its parameter order (see `pykern.kernels()`).

    Arrays go to pointer parameters (dtype and contiguity checked), Python or NumPy
    numbers to value parameters (converted to the exact C type, range checked).
    Arrays: NumPy, torch tensors (CPU ones as zero-copy NumPy views; CUDA ones by
    data_ptr(), so requires_grad and bfloat16 tensors work), __cuda_array_interface__
    objects and host DLPack objects. With torch CUDA tensors and no `stream`, the launch
    goes to torch.cuda.current_stream() of their device. Nothing reaches a backend until every check passed.

    Device (nvrtc backend): the one holding the device arrays (all must share it); with only host
    arrays, `device` when given, else the caller's current device (torch's, else the current CUDA
    context's), else 0. A `device` that contradicts the arrays raises.

    pdl=True: programmatic dependent launch (nvrtc backend, sm_90+; elsewhere an ordinary launch): the
    kernel's CTAs may start while the previous kernel of the stream still runs, and wait for it inside
    (`pk_grid_dependency_wait`). Only kernels whose source names them on a `// pykern: pdl` line take it.

    cluster=(x, y, z): thread-block cluster dims (sm_90+; nvrtc: cuLaunchKernelEx with
    CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION; host: the cluster's CTAs run resident together, with DSMEM and
    barrier.cluster emulated). Each dim must divide the grid's, at most MAX_CLUSTER CTAs in all.
    """
    spec = registry.get(name)
    g, b, smem = check_geometry(grid, block, shared_mem)
    if spec.max_threads is not None and b[0] * b[1] * b[2] > spec.max_threads:
        # A GPU refuses the launch (too many resources requested): so does every backend.
        raise ArgumentError(
            f"block: {name} is declared __launch_bounds__({spec.max_threads}), got {b} = {b[0] * b[1] * b[2]} threads"
        )
    if pdl is not False:  # the common launch pays one identity test
        _check_pdl(spec, pdl)
    cl = None if cluster is None else check_cluster(cluster, g)
    converted = convert_args(spec, args)
    if stream is None and _torch_cuda_seen:
        stream = _torch_stream(converted)
    if cl is not None:  # backends take `cluster` only when asked, as `pdl`
        if pdl:
            get_backend(backend).launch(spec, g, b, converted, smem, stream, device=device, pdl=True, cluster=cl)
        else:
            get_backend(backend).launch(spec, g, b, converted, smem, stream, device=device, cluster=cl)
    elif device is None and not pdl:
        get_backend(backend).launch(spec, g, b, converted, smem, stream)
    elif pdl:  # backends take `pdl` only when asked: an ordinary launch's call stays as it was
        get_backend(backend).launch(spec, g, b, converted, smem, stream, device=device, pdl=True)
    else:
        get_backend(backend).launch(spec, g, b, converted, smem, stream, device=device)


def check_cluster(cluster: Any, grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """Validated cluster dims: each divides the grid's, at most MAX_CLUSTER CTAs in all."""
    c = _dim3("cluster", cluster, (MAX_CLUSTER, MAX_CLUSTER, MAX_CLUSTER))
    if c[0] * c[1] * c[2] > MAX_CLUSTER:
        raise ArgumentError(f"cluster: expected at most {MAX_CLUSTER} blocks, got {c} = {c[0] * c[1] * c[2]}")
    for axis in range(3):
        if grid[axis] % c[axis]:
            raise ArgumentError(f"cluster[{axis}]: expected a divisor of grid[{axis}] = {grid[axis]}, got {c[axis]}")
    return c


def _check_pdl(spec: KernelSpec, pdl: Any) -> None:
    if type(pdl) is not bool:
        raise ArgumentTypeError(f"pdl: expected a bool, got {type(pdl).__name__} {pdl!r}")
    if pdl and not spec.pdl:
        raise ArgumentError(f"pdl: {spec.name} does not wait for the previous kernel before its first access (no "
                            f"`// pykern: pdl` line of {spec.source.name} names it): launched early it could read "
                            f"that kernel's results before they are written")


def prepare(name: str, grid: Any, block: Any, *args: Any, shared_mem: int = 0, pdl: bool = False) -> tuple:
    """Everything `launch` checks and converts, without launching: (spec, grid, block, converted arguments,
    shared bytes, pdl) for `launch_prepared`. For callers that launch the same arguments again (a decode plan's
    steps): the converted arguments stand for the arrays' addresses, shapes and dtypes as they were here, so
    the caller must know those have not changed."""
    spec = registry.get(name)
    g, b, smem = check_geometry(grid, block, shared_mem)
    if spec.max_threads is not None and b[0] * b[1] * b[2] > spec.max_threads:
        raise ArgumentError(
            f"block: {name} is declared __launch_bounds__({spec.max_threads}), got {b} = {b[0] * b[1] * b[2]} threads"
        )
    _check_pdl(spec, pdl)
    return spec, g, b, convert_args(spec, args), smem, pdl


def launch_prepared(prepared: tuple, stream: Any = None, backend: str | None = None) -> bool:
    """Launch what `prepare` returned, as `launch` would have. False (nothing launched) when the kernel's
    spec changed since (an edited source): prepare again."""
    spec, g, b, converted, smem, pdl = prepared
    if registry.get(spec.name) is not spec:
        return False
    if stream is None and _torch_cuda_seen:
        stream = _torch_stream(converted)
    if pdl:
        get_backend(backend).launch(spec, g, b, converted, smem, stream, pdl=True)
    else:
        get_backend(backend).launch(spec, g, b, converted, smem, stream)
    return True


def _torch_stream(converted: Sequence[Any]) -> Any:
    """torch's current stream when a torch CUDA tensor is among the arguments, else None."""
    for c in converted:
        if type(c) is DeviceView and arrays.is_torch(c.owner):
            return arrays.launch_stream(None, c.owner)
    return None
