"""pykern.tensormap's cache of encoded CUtensorMaps (nvrtc backend, tests/fake_driver.py, no GPU).

The cache must never hand out a map of other memory or another layout: every argument of the encode is in its
key, so a new address, stride, shape, dtype, box, swizzle, OOB fill or driver encodes again, and a hit returns
the very bytes the driver encoded for those arguments. The fake's encode records its arguments in the bytes
("FKTM", rank, swizzle, address, dims, strides, box), so equal bytes mean equal arguments.
"""
from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

from pykern import backends, tensormap
from pykern.backends.nvrtc import NvrtcBackend
from pykern.errors import ArgumentError
from pykern.tensormap import make_tensor_map

from fake_driver import FakeDeviceArray, FakeDriver, FakeDriverError

BF16 = np.dtype(ml_dtypes.bfloat16)


def _backend(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    drv = FakeDriver(cc=(9, 0), max_shared_optin=227 * 1024)

    def get_module(source, arch, kernel=None):
        raise FakeDriverError("nothing is compiled here")

    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=lambda: ("sm_80", "sm_90"))
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    return drv


@pytest.fixture
def drv(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    tensormap.clear_cache()
    yield _backend(monkeypatch)
    tensormap.clear_cache()


def _encodes(drv: FakeDriver) -> list[tuple]:
    return [c[1] for c in drv.calls if c[0] == "tensor_map_encode_tiled"]


def _decoded(tm: tensormap.TensorMap) -> tuple:
    """(rank, swizzle, address, dims, strides, box) from the fake's bytes."""
    f = struct.unpack_from("<4sBBHQ5Q4Q5H", tm.data)
    assert f[0] == b"FKTM"
    return f[1], f[2], f[4], f[5:10], f[10:14], f[14:19]


def _strided(drv: FakeDriver, base: FakeDeviceArray, shape: tuple, strides: tuple) -> FakeDeviceArray:
    """A view of base's memory with explicit byte strides (as a CuPy / torch strided view hands out)."""
    v = FakeDeviceArray(drv, base.ptr, shape, base.dtype, None, False)
    v._cai["strides"] = strides
    return v


def test_same_array_hits_and_returns_the_bytes_a_fresh_encode_gives(drv) -> None:
    a = drv.device_array(np.zeros((2, 256, 4, 64), BF16))
    m1 = make_tensor_map(a, (1, 128, 1, 64), "128B", backend="nvrtc")
    m2 = make_tensor_map(a, (1, 128, 1, 64), "128B", backend="nvrtc")
    assert len(_encodes(drv)) == 1
    assert m2.data == m1.data and m2.array is a
    assert _decoded(m2) == (4, 128, a.ptr, (64, 4, 256, 2, 0), (128, 512, 131072, 0), (64, 1, 128, 1, 0))
    tensormap.clear_cache()
    m3 = make_tensor_map(a, (1, 128, 1, 64), "128B", backend="nvrtc")
    assert len(_encodes(drv)) == 2 and m3.data == m1.data
    # Each map owns its 64-byte aligned copy of the bytes: a kernel parameter never shares storage.
    assert m3.cvalue is not m1.cvalue and bytes(m1.cvalue) == m1.data


def test_same_shape_at_a_new_address_encodes_a_new_map(drv) -> None:
    a = drv.device_array(np.zeros((1, 128, 2, 64), BF16))
    b = drv.device_array(np.zeros((1, 128, 2, 64), BF16))
    ma = make_tensor_map(a, (1, 64, 1, 64), "128B", backend="nvrtc")
    mb = make_tensor_map(b, (1, 64, 1, 64), "128B", backend="nvrtc")
    assert a.ptr != b.ptr and len(_encodes(drv)) == 2
    assert _decoded(ma)[2] == a.ptr and _decoded(mb)[2] == b.ptr
    # A view at an offset into a's memory (same shape): another address, another map.
    off = FakeDeviceArray(drv, a.ptr + 128, (1, 64, 2, 64), BF16, None, False)
    mo = make_tensor_map(off, (1, 64, 1, 64), "128B", backend="nvrtc")
    assert len(_encodes(drv)) == 3 and _decoded(mo)[2] == a.ptr + 128


def test_changed_stride_shape_dtype_box_swizzle_or_fill_misses(drv) -> None:
    a = drv.device_array(np.zeros((4, 256, 64), BF16))
    base = make_tensor_map(a, (1, 64, 64), "128B", backend="nvrtc")
    n = len(_encodes(drv))
    # Same address and shape, another row stride (a strided view): its own map with its own strides.
    wide = _strided(drv, a, (4, 128, 64), (256 * 128 * 2 // 2, 256, 2))
    narrow = _strided(drv, a, (4, 128, 64), (256 * 128 * 2 // 2, 128, 2))
    mw = make_tensor_map(wide, (1, 64, 64), "128B", backend="nvrtc")
    mn = make_tensor_map(narrow, (1, 64, 64), "128B", backend="nvrtc")
    assert len(_encodes(drv)) == n + 2
    assert _decoded(mw)[4][:2] == (256, 32768) and _decoded(mn)[4][:2] == (128, 32768)
    variants = [
        (a.reshape((8, 128, 64)), (1, 64, 64), "128B", False),  # same bytes, other shape
        (FakeDeviceArray(drv, a.ptr, (4, 256, 64), np.dtype(np.float16), None, False), (1, 64, 64), "128B", False),
        (a, (1, 32, 64), "128B", False),  # another box
        (a, (1, 64, 32), "64B", False),  # another swizzle (and box row)
        (a, (1, 64, 64), "128B", True),  # NaN out-of-bounds fill
    ]
    maps = []
    for arr, box, sw, nan in variants:
        maps.append(make_tensor_map(arr, box, sw, backend="nvrtc", oob_nan=nan))
    assert len(_encodes(drv)) == n + 2 + len(variants)
    assert _decoded(maps[0])[3][:3] == (64, 128, 8)
    assert _encodes(drv)[-4][0] == "float16" and _encodes(drv)[-1][-1] is True
    assert _decoded(maps[2])[5][:2] == (64, 32) and _decoded(maps[3])[1] == 64
    # ... and the original still hits, with its own bytes.
    again = make_tensor_map(a, (1, 64, 64), "128B", backend="nvrtc")
    assert len(_encodes(drv)) == n + 2 + len(variants) and again.data == base.data


def test_int8_shares_uint8_maps_but_not_other_widths(drv) -> None:
    a = drv.device_array(np.zeros((64, 64), np.int8))
    u = FakeDeviceArray(drv, a.ptr, (64, 64), np.dtype(np.uint8), None, False)
    mi = make_tensor_map(a, (16, 64), None, backend="nvrtc")
    mu = make_tensor_map(u, (16, 64), None, backend="nvrtc")
    assert len(_encodes(drv)) == 1 and mi.data == mu.data and mi.dtype == "int8" and mu.dtype == "uint8"


def test_another_driver_encodes_again(drv, monkeypatch) -> None:
    a = drv.device_array(np.zeros((128, 64), BF16))
    m1 = make_tensor_map(a, (64, 64), "128B", backend="nvrtc")
    drv2 = _backend(monkeypatch)  # a new backend over another driver (another process's view, a restart)
    a2 = drv2.device_array(np.zeros((128, 64), BF16))
    assert a2.ptr == a.ptr  # the fakes hand out the same first address
    m2 = make_tensor_map(a2, (64, 64), "128B", backend="nvrtc")
    assert len(_encodes(drv)) == 1 and len(_encodes(drv2)) == 1 and m2.data == m1.data


def test_invalid_arguments_still_raise_after_a_valid_hit(drv) -> None:
    a = drv.device_array(np.zeros((128, 64), BF16))
    make_tensor_map(a, (64, 64), "128B", backend="nvrtc")
    with pytest.raises(ArgumentError, match="1..256"):
        make_tensor_map(a, (300, 64), "128B", backend="nvrtc")
    with pytest.raises(ArgumentError, match="at most 64 bytes"):
        make_tensor_map(a, (64, 64), "64B", backend="nvrtc")
    unaligned = FakeDeviceArray(drv, a.ptr + 2, (127, 64), BF16, None, False)
    with pytest.raises(ArgumentError, match="16-byte aligned"):
        make_tensor_map(unaligned, (64, 64), "128B", backend="nvrtc")
    assert len(_encodes(drv)) == 1


def test_cache_is_bounded_least_recently_used_first(drv, monkeypatch) -> None:
    monkeypatch.setattr(tensormap, "ENCODE_CACHE_SIZE", 3)
    arrs = [drv.device_array(np.zeros((64, 64), np.float32)) for _ in range(4)]
    for a in arrs[:3]:
        make_tensor_map(a, (32, 8), None, backend="nvrtc")
    make_tensor_map(arrs[0], (32, 8), None, backend="nvrtc")  # refreshes arrs[0]
    make_tensor_map(arrs[3], (32, 8), None, backend="nvrtc")  # evicts arrs[1], the least recently used
    assert len(tensormap._encoded) == 3 and len(_encodes(drv)) == 4
    make_tensor_map(arrs[0], (32, 8), None, backend="nvrtc")
    assert len(_encodes(drv)) == 4
    m1 = make_tensor_map(arrs[1], (32, 8), None, backend="nvrtc")
    assert len(_encodes(drv)) == 5 and _decoded(m1)[2] == arrs[1].ptr


def test_host_backend_maps_are_not_cached(drv) -> None:
    a = np.zeros((128, 64), np.float32)
    m1 = make_tensor_map(a, (32, 8), None, backend="host")
    b = np.ones((128, 64), np.float32)
    m2 = make_tensor_map(b, (32, 8), None, backend="host")
    assert not tensormap._encoded and m1.data != m2.data
    assert struct.unpack_from("<Q", m2.data, 8)[0] == b.ctypes.data
