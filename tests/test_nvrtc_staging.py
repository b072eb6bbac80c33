"""How the nvrtc backend stages NumPy arguments into device memory: by host byte span.

A kernel reaches a view through its strides, so the device copy must cover the view's byte bounds
(not `nbytes` from its data pointer), and views whose spans overlap (the K and V halves of one
combined paged KV cache) must share one device buffer that is copied back once. The "kernels" here
are Python simulations on the fake driver's device memory that address their pointers the way the
CUDA code does (base pointer + element offsets), so an undersized or split staging shows up as an
out-of-allocation access or as lost writes in the host arrays.
"""
from __future__ import annotations

import ctypes
import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper modules beside this file

import pykern  # noqa: E402
from pykern import backends, registry  # noqa: E402
from pykern.backends.nvrtc import NvrtcBackend  # noqa: E402

from fake_driver import LAUNCH_CU, FakeDriver, FakeDriverError, compile_test_kernels, make_fake  # noqa: E402


_byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds  # NumPy 2 moved it; NumPy 1 has np.byte_bounds


@pytest.fixture(scope="module")
def compiled():
    return compile_test_kernels("sm_80")


@pytest.fixture
def fake(compiled, monkeypatch):
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(LAUNCH_CU))
    drv, get_module = make_fake(compiled)
    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=lambda: ("sm_80",))
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    drv.backend = be
    return drv


def _device(fake: FakeDriver, ptr: int, dtype) -> tuple[np.ndarray, int]:
    """(the whole allocation holding ptr as `dtype` elements, ptr's element index in it): a simulated
    kernel indexes base + offset, negative offsets included; past the allocation it is an error."""
    dt = np.dtype(dtype)
    for base, buf in fake.memory.items():
        if base <= ptr < base + len(buf):
            assert (ptr - base) % dt.itemsize == 0
            return np.frombuffer(buf, dt, len(buf) // dt.itemsize), (ptr - base) // dt.itemsize
    raise FakeDriverError(f"device pointer {ptr:#x} is not inside any live allocation")


def _offsets(shape, strides) -> np.ndarray:
    """Element offsets of every element of a (shape, element strides) view, in C order."""
    off = np.zeros(shape, np.int64)
    for ax, (n, s) in enumerate(zip(shape, strides)):
        idx = [None] * len(shape)
        idx[ax] = slice(None)
        off = off + (np.arange(n, dtype=np.int64) * s)[tuple(idx)]
    return off.reshape(-1)


def _strided_copy_sim(shape, out_strides, in_strides, add):
    """pktest_copy_u16 as a kernel that takes its views' strides: out[e] = in[e] + add, element by element."""
    def sim(fake, grid, block, smem, out, inp, n):
        o, oi = _device(fake, out, np.uint16)
        s, si = _device(fake, inp, np.uint16)
        o_off, i_off = oi + _offsets(shape, out_strides), si + _offsets(shape, in_strides)
        if o_off.min() < 0 or o_off.max() >= o.size or i_off.min() < 0 or i_off.max() >= s.size:
            raise FakeDriverError("the strided kernel reaches past its allocation")
        o[o_off] = s[i_off] + np.uint16(add)
    return sim


def _launch_direct(fake, name, args):
    """The backend's launch itself: the launcher admits only C-contiguous NumPy arrays, the backend
    stages whatever it is given (ops hand it strided flats of views; other callers may hand views)."""
    spec = registry.get(name)
    fake.backend.launch(spec, (1, 1, 1), (64, 1, 1), args, 0, None)


def _elem_strides(a):
    return tuple(s // a.itemsize for s in a.strides)


def test_strided_view_and_its_interleaved_twin_share_one_buffer_over_their_span(fake):
    # A combined cache (pages, 2, page, dim): out = the K half, in = the V half, interleaved page by page.
    cache = np.arange(3 * 2 * 4 * 5, dtype=np.uint16).reshape(3, 2, 4, 5)
    out, inp = cache[:, 0], cache[:, 1]
    assert not out.flags.c_contiguous and _byte_bounds(out)[1] - out.ctypes.data > out.nbytes
    expect = cache.copy()
    expect[:, 0] = expect[:, 1] + 1000
    fake.simulate["pktest_copy_u16"] = _strided_copy_sim(out.shape, _elem_strides(out), _elem_strides(inp), 1000)
    _launch_direct(fake, "pktest_copy_u16", [out, inp, ctypes.c_longlong(out.size)])
    np.testing.assert_array_equal(cache, expect)  # every K element written, every V element as it was
    # One buffer over the union of the two spans (here: the whole cache), in once, back once, freed.
    allocs = [c[1] for c in fake.calls if c[0] == "mem_alloc"]
    assert allocs == [(cache.nbytes,)]
    (htod,) = [c[1] for c in fake.calls if c[0] == "memcpy_htod_async"]
    assert htod[1:3] == (cache.ctypes.data, cache.nbytes)
    dptr = htod[0]
    assert [c[1] for c in fake.calls if c[0] == "memcpy_dtoh_async"] == [(cache.ctypes.data, dptr, cache.nbytes, 0)]
    assert fake.launches[0].values[:2] == [dptr, dptr + inp.ctypes.data - cache.ctypes.data]
    assert fake.memory == {}


def test_negative_strides_are_staged_from_their_lowest_byte(fake):
    base = np.arange(40, dtype=np.uint16)
    out = base[::-3]  # data pointer at the last element, the span runs down from it
    src = np.arange(out.size, dtype=np.uint16) * 7
    lo, hi = _byte_bounds(out)
    assert lo < out.ctypes.data
    expect = base.copy()
    expect[::-3] = src + 1
    fake.simulate["pktest_copy_u16"] = _strided_copy_sim(out.shape, _elem_strides(out), (1,), 1)
    _launch_direct(fake, "pktest_copy_u16", [out, src, ctypes.c_longlong(out.size)])
    np.testing.assert_array_equal(base, expect)
    allocs = [c[1][0] for c in fake.calls if c[0] == "mem_alloc"]
    assert allocs == [hi - lo, src.nbytes]  # parameter order; the view's buffer covers exactly its span
    htod = [c[1] for c in fake.calls if c[0] == "memcpy_htod_async"]
    assert htod[0][1:3] == (lo, hi - lo)
    assert fake.launches[0].values[0] == htod[0][0] + (out.ctypes.data - lo)
    assert [c[1][:3] for c in fake.calls if c[0] == "memcpy_dtoh_async"] == [(lo, htod[0][0], hi - lo)]


def test_disjoint_views_of_one_base_keep_separate_buffers_and_const_ones_stay_home(fake):
    # Two halves of one array that do not overlap: two buffers, the bytes between them never copied.
    base = np.arange(64, dtype=np.uint16)
    out, inp = base[40:50], base[0:10]
    expect = base.copy()
    expect[40:50] = expect[0:10] + 5
    fake.simulate["pktest_copy_u16"] = _strided_copy_sim((10,), (1,), (1,), 5)
    pykern.launch("pktest_copy_u16", 1, 64, out, inp, 10, backend="nvrtc")
    np.testing.assert_array_equal(base, expect)
    assert [c[1][0] for c in fake.calls if c[0] == "mem_alloc"] == [out.nbytes, inp.nbytes]
    # only the written one goes back
    assert [c[1][0] for c in fake.calls if c[0] == "memcpy_dtoh_async"] == [out.ctypes.data]


def test_overlapping_contiguous_flats_are_one_buffer(fake):
    # What the ops hand the launcher for the K and V views of a combined cache: C-contiguous 1-D arrays over
    # each view's span (pykern.ops._kvcache.strided_flat), which overlap. Here `y` overlaps `x` by half.
    buf = np.arange(48, dtype=np.float32)
    y, x = buf[16:48], buf[0:32]
    y0, x0 = y.copy(), x.copy()
    pykern.launch("pktest_axpy", 1, 64, y, x, 2.0, 32, backend="nvrtc")
    # The kernel sees one memory: y[i] = 2 * x[i] + y[i], where x[i] for i >= 16 is y[i - 16], written by
    # thread i - 16 in no set order on a GPU; y[:16] reads only bytes nobody writes.
    np.testing.assert_array_equal(y[:16], np.float32(2.0) * x0[:16] + y0[:16])
    np.testing.assert_array_equal(buf[:16], x0[:16])  # the const-only bytes below y untouched
    assert [c[1][0] for c in fake.calls if c[0] == "mem_alloc"] == [buf.nbytes]
    assert [c[1][2] for c in fake.calls if c[0] == "memcpy_dtoh_async"] == [buf.nbytes]
    v = fake.launches[0].values
    assert v[0] - v[1] == y.ctypes.data - x.ctypes.data


# -- the real op: append_paged_kv_cache into a combined (pages, 2, page, heads, dim) NumPy cache ---------


@pytest.fixture(scope="module")
def paged_ptx():
    from pykern.sources import KERNELS_DIR
    from sass_helpers import nvrtc_module

    # through the run's cache (test_streams loads the same PTX); a compute_XX image is the PTX text
    return nvrtc_module(KERNELS_DIR / "paged.cu", "compute_80")


def _sim_append(fake, grid, block, smem, k, v, bi, pos, kp, vp, indices, indptr, batch, kvh, d, page_size,
                s_page, s_tok, s_head, ksc, vsc):
    """paged_append_kv (f32): token t's heads go to slot pos % page_size of its sequence's page, addressed
    through the element strides the op passes (what kernels_cu/paged.cu does)."""
    nnz = grid[0]
    K, ko = _device(fake, k, np.float32)
    V, vo = _device(fake, v, np.float32)
    B, bo = _device(fake, bi, np.int32)
    P, po = _device(fake, pos, np.int32)
    KP, kpo = _device(fake, kp, np.float32)
    VP, vpo = _device(fake, vp, np.float32)
    IDX, io = _device(fake, indices, np.int32)
    IP, ipo = _device(fake, indptr, np.int32)
    for t in range(nnz):
        b, p = int(B[bo + t]), int(P[po + t])
        page = int(IDX[io + int(IP[ipo + b]) + p // page_size])
        for h in range(kvh):
            dst = page * s_page + (p % page_size) * s_tok + h * s_head
            src = (t * kvh + h) * d
            for arr, off, val, vo_ in ((KP, kpo, K, ko), (VP, vpo, V, vo)):
                if off + dst < 0 or off + dst + d > arr.size:
                    raise FakeDriverError("paged_append_kv writes past its allocation")
                arr[off + dst: off + dst + d] = val[vo_ + src: vo_ + src + d]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_into_combined_numpy_cache_lands_every_token(paged_ptx, monkeypatch, layout):
    drv = FakeDriver()
    drv.register(paged_ptx.image, paged_ptx.image.decode())
    stub = type("M", (), {"image": paged_ptx.image, "digest": hashlib.sha256(paged_ptx.image).hexdigest()})
    be = NvrtcBackend(driver_factory=lambda: drv, get_module=lambda src, arch, kernel=None: stub,
                      supported_archs=lambda: ("sm_75",))
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    drv.simulate["paged_append_kv"] = _sim_append
    from pykern.ops.serving import append_paged_kv_cache, get_batch_indices_positions

    pages, page_size, kvh, d = 5, 4, 2, 8
    shape = (pages, 2, page_size, kvh, d) if layout == "NHD" else (pages, 2, kvh, page_size, d)
    cache = np.zeros(shape, np.float32)
    # Two sequences: 6 tokens on pages [3, 0] (appending 3), 5 tokens on pages [4, 1] (appending 5).
    kv_indptr = np.array([0, 2, 4], np.int32)
    kv_indices = np.array([3, 0, 4, 1], np.int32)
    last = np.array([2, 1], np.int32)
    append_indptr = np.array([0, 3, 8], np.int32)
    seq_lens = np.array([6, 5], np.int32)
    nnz = 8
    bi, pos = get_batch_indices_positions(append_indptr, seq_lens, nnz)
    rng = np.random.default_rng(3)
    # k and v overlapping inputs (const, one buffer, never copied back)
    kv = rng.standard_normal(nnz * kvh * d + 16).astype(np.float32)
    k, v = kv[: nnz * kvh * d].reshape(nnz, kvh, d), kv[16:].reshape(nnz, kvh, d)
    kv0 = kv.copy()
    expect = cache.copy()
    for t in range(nnz):
        b, p = int(bi[t]), int(pos[t])
        page, slot = int(kv_indices[kv_indptr[b] + p // page_size]), p % page_size
        if layout == "NHD":
            expect[page, 0, slot], expect[page, 1, slot] = k[t], v[t]
        else:
            expect[page, 0, :, slot], expect[page, 1, :, slot] = k[t], v[t]
    append_paged_kv_cache(k, v, bi, pos, cache, kv_indices, kv_indptr, last, kv_layout=layout, backend="nvrtc")
    np.testing.assert_array_equal(cache, expect)  # every K and V element written, nothing else
    np.testing.assert_array_equal(kv, kv0)
    (launch,) = drv.launches
    assert launch.name == "paged_append_kv"
    kp, vp = launch.values[4:6]
    assert vp - kp == cache[0, 1].ctypes.data - cache.ctypes.data  # one buffer: V at its host offset from K
    dtoh = [c[1] for c in drv.calls if c[0] == "memcpy_dtoh_async"]
    # back once: the union of the K span (from the cache's start) and the V span (to its end)
    assert dtoh == [(cache.ctypes.data, kp, cache.nbytes, 0)]
    assert drv.memory == {}
