"""TMA tensor maps (`CUtensorMap`) from one Python call, for kernels that take `const __grid_constant__ CUtensorMap`.

`make_tensor_map(array, box, swizzle=...)` describes a tiled view of `array` for cp.async.bulk.tensor:
on the nvrtc backend it calls the driver's cuTensorMapEncodeTiled (through pykern.backends.driver) on a
device array; on the host backend it encodes the same parameters in pykern's own 128-byte layout
(pykern/host/pk_host_sm90.h, `pkrt_tmap`), which the host emulation of the TMA copies reads. Both check
the arguments as the driver does, so a map the host accepts is one the GPU accepts.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from collections import OrderedDict
from typing import Any, Sequence

from . import backends as _backends
from .ctypes_ import TYPESTR, TensorMapBytes
from .errors import ArgumentError, ArgumentTypeError

# Element sizes of the dtypes a tensor map may describe (cuTensorMapEncodeTiled's data types).
DTYPES = {"uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2, "bfloat16": 2, "uint32": 4, "int32": 4,
          "float32": 4, "uint64": 8, "int64": 8, "float64": 8}
_DRIVER_DTYPE = {"int8": "uint8", "int16": "uint16"}  # same bytes: the copy does not interpret them
SWIZZLES = {None: 0, "none": 0, 0: 0, "32B": 32, 32: 32, "64B": 64, 64: 64, "128B": 128, 128: 128}
HOST_MAGIC = 0x4D544B50  # "PKTM": pkrt_tmap.magic

# Encoded CUtensorMaps of the nvrtc backend, least recently used first. cuTensorMapEncodeTiled is a pure
# function of its arguments (no memory is read or kept: the map holds the address as a number), so the key is
# every argument the encode takes (driver, data type, global address, dims, strides, box, swizzle, OOB fill;
# rank and element strides follow from dims) and a hit returns exactly the bytes the driver would encode
# again. The same shapes at another address, or the same address with another stride, are another key.
# FlashAttention-3 and CUTLASS encode per call in C++; pykern's encode goes through cuda.bindings in Python
# (tens of microseconds for the three maps of an attention forward), hence the cache.
ENCODE_CACHE_SIZE = 512
_encoded: OrderedDict[tuple, tuple[Any, bytes]] = OrderedDict()
_encoded_lock = threading.Lock()


def clear_cache() -> None:
    """Forget every cached encoded tensor map (the next make_tensor_map of each asks the driver again)."""
    with _encoded_lock:
        _encoded.clear()


class TensorMap:
    """A tensor map ready to pass to a `CUtensorMap` kernel parameter (by value, 128 bytes, 64-aligned).

    Keeps `array` alive; the map holds its address, so the array must stay where it is."""

    def __init__(self, data: bytes, backend: str, array: Any, dims: tuple[int, ...], box: tuple[int, ...],
                 swizzle: int, dtype: str) -> None:
        self._raw = (ctypes.c_ubyte * 192)()
        addr = (ctypes.addressof(self._raw) + 63) & ~63
        self.cvalue = TensorMapBytes.from_address(addr)
        ctypes.memmove(addr, data, 128)
        self.cvalue._pk_owner = self  # the converted argument keeps the storage (and the array) alive
        self.backend, self.array, self.dtype = backend, array, dtype
        self.dims, self.box, self.swizzle = dims, box, swizzle  # innermost first, as the driver takes them

    @property
    def data(self) -> bytes:
        return bytes(ctypes.string_at(ctypes.addressof(self.cvalue), 128))

    def __repr__(self) -> str:
        return (f"<TensorMap {self.backend} {self.dtype} dims={self.dims[::-1]} box={self.box[::-1]} "
                f"swizzle={self.swizzle or 'none'}>")


def check_tiled(elem: int, address: int, dims: Sequence[int], strides: Sequence[int], box: Sequence[int],
                element_strides: Sequence[int], swizzle: int) -> None:
    """ArgumentError unless cuTensorMapEncodeTiled would accept these (innermost first; strides of dims 1..)."""
    rank = len(dims)
    if not 1 <= rank <= 5:
        raise ArgumentError(f"array: expected 1 to 5 dimensions for a tensor map, got {rank}")
    if address % 16:
        raise ArgumentError(f"array: the global address must be 16-byte aligned, got {address:#x}")
    for d, n in enumerate(dims):
        if not 1 <= n <= 1 << 32:
            raise ArgumentError(f"array: dimension sizes must be 1..2^32, got {n} (dimension {rank - 1 - d})")
    for d, st in enumerate(strides, start=1):
        if st % 16 or not 0 < st < 1 << 40:
            raise ArgumentError(f"array: strides must be multiples of 16 bytes below 2^40, got {st} bytes for "
                                f"dimension {rank - 1 - d}")
    if len(box) != rank:
        raise ArgumentError(f"box: expected {rank} sizes (one per array dimension), got {len(box)}")
    for d, b in enumerate(box):
        if not 1 <= b <= 256:
            raise ArgumentError(f"box: sizes must be 1..256, got {b} for dimension {rank - 1 - d}")
    if box[0] * elem % 16:
        raise ArgumentError(f"box: the innermost box size times the element size must be a multiple of 16 bytes, "
                            f"got {box[0]} x {elem} bytes")
    if swizzle and box[0] * elem > swizzle:
        raise ArgumentError(f"box: with a {swizzle}B swizzle the innermost box row may hold at most {swizzle} bytes, "
                            f"got {box[0]} x {elem} = {box[0] * elem}")
    for e in element_strides:
        if not 1 <= e <= 8:
            raise ArgumentError(f"element_strides: expected 1..8, got {e}")


def _host_view(array: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], str]:
    import numpy as np

    if type(array).__module__.startswith("torch"):
        if array.device.type != "cpu":
            raise ArgumentError(f"array: the host backend needs a CPU array, got a tensor on {array.device}")
        from .arrays import host_view

        array = host_view(array)
    if not isinstance(array, np.ndarray):
        raise ArgumentTypeError(f"array: expected a NumPy array (or CPU tensor) for the host backend, got "
                                f"{type(array).__name__}")
    return array.ctypes.data, array.shape, array.strides, array.dtype.name


def _device_view(array: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], str]:
    if type(array).__module__.startswith("torch"):
        if array.device.type != "cuda":
            raise ArgumentError(f"array: the nvrtc backend needs a CUDA tensor, got one on {array.device}")
        dt = array.dtype
        name = _TORCH_DTYPE_NAMES.get(dt)
        if name is None:
            name = _TORCH_DTYPE_NAMES[dt] = str(dt).removeprefix("torch.")
        es = array.element_size()
        return array.data_ptr(), tuple(array.shape), tuple([s * es for s in array.stride()]), name
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is None:
        raise ArgumentTypeError(f"array: expected a device array (__cuda_array_interface__ or a CUDA tensor) for "
                                f"the nvrtc backend, got {type(array).__name__}")
    shape = tuple(cai["shape"])
    typestr = cai["typestr"]
    name = TYPESTR.get(typestr[1:], "")
    itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 2
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        acc, out = itemsize, []
        for n in reversed(shape):
            out.append(acc)
            acc *= int(n)
        strides = out[::-1]
    return int(cai["data"][0]), shape, tuple(strides), name


_TORCH_DTYPE_NAMES: dict[Any, str] = {}


def make_tensor_map(array: Any, box: Sequence[int], swizzle: Any = None, *, backend: str | None = None,
                    oob_nan: bool = False) -> TensorMap:
    """A tiled TMA descriptor of `array` (1..5 dimensions, innermost contiguous).

    box: the tile's shape in the array's axis order (e.g. (64, 64) rows x columns); swizzle: None, "32B",
    "64B" or "128B" (the shared-memory layout the copy writes and reads; the innermost box row may span at
    most that many bytes); oob_nan: out-of-bounds elements of a load read as NaN instead of zeros (float
    types). backend: "host" or "nvrtc" (default: pykern's default backend). Kernels receive the result as
    `const __grid_constant__ CUtensorMap` and use it by address in pk_tma_load_Nd / pk_tma_store_Nd, whose
    coordinates are innermost first.
    """
    name = backend or _backends.default_backend_name()
    if name not in ("host", "nvrtc"):
        raise ArgumentError(f"backend: tensor maps exist for 'host' and 'nvrtc', got {name!r}")
    if swizzle not in SWIZZLES:
        raise ArgumentError(f"swizzle: expected None, '32B', '64B' or '128B', got {swizzle!r}")
    span = SWIZZLES[swizzle]
    address, shape, strides, dtype = (_host_view if name == "host" else _device_view)(array)
    if dtype not in DTYPES:
        raise ArgumentTypeError(f"array: dtype {dtype or '?'} has no tensor-map data type; expected one of "
                                f"{', '.join(DTYPES)}")
    elem = DTYPES[dtype]
    if isinstance(box, (str, bytes)) or not hasattr(box, "__len__"):
        raise ArgumentTypeError(f"box: expected a sequence of sizes, got {box!r}")
    box_t = tuple([int(b) for b in box])
    rank = len(shape)
    if rank and strides[-1] != elem:
        raise ArgumentError(f"array: the innermost dimension must be contiguous (stride {elem} bytes), got "
                            f"{strides[-1]} bytes")
    dims = tuple([int(n) for n in shape[::-1]])
    gstrides = tuple([int(s) for s in strides[::-1][1:]])
    ibox = box_t[::-1]
    estrides = (1,) * rank
    if name != "host":
        be: Any = _backends.get_backend("nvrtc")
        drv = be._driver or be._start()
        ddt = _DRIVER_DTYPE.get(dtype, dtype)
        # The driver by id (drivers need not hash), checked by identity on a hit: the entry keeps it alive, so
        # its id is not reused while the entry exists. A hit skips check_tiled too: its inputs are all in the key
        # (the element size follows from the data type), so they passed when the entry was made.
        key = (id(drv), ddt, address, dims, gstrides, ibox, span, bool(oob_nan))
        data = None
        with _encoded_lock:
            entry = _encoded.get(key)
            if entry is not None and entry[0] is drv:
                _encoded.move_to_end(key)
                data = entry[1]
        if data is None:
            check_tiled(elem, address, dims, gstrides, ibox, estrides, span)
            data = drv.tensor_map_encode_tiled(ddt, rank, address, dims, gstrides, ibox, estrides, span, bool(oob_nan))
            if len(data) != 128:
                raise ArgumentError(f"driver: expected a 128-byte CUtensorMap, got {len(data)} bytes")
            with _encoded_lock:
                _encoded[key] = (drv, data)
                while len(_encoded) > ENCODE_CACHE_SIZE:
                    _encoded.popitem(last=False)
        return TensorMap(data, name, array, dims, ibox, span, dtype)
    check_tiled(elem, address, dims, gstrides, ibox, estrides, span)
    data = struct.pack("<IBBBBQ5Q5Q5I3I", HOST_MAGIC, rank, elem, span // 16, int(bool(oob_nan)), address,
                       *(dims + (0,) * (5 - rank)), *((elem,) + gstrides + (0,) * (5 - rank)),
                       *(ibox + (0,) * (5 - rank)), 0, 0, 0)
    return TensorMap(data, name, array, dims, ibox, span, dtype)
