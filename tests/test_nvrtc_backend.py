"""The nvrtc backend end to end (load cubin -> get function -> pack params -> launch -> copy back)
against a recording fake driver that checks every packed parameter against the PTX .entry layout."""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper modules beside this file

import pykern  # noqa: E402
from pykern import backends, registry  # noqa: E402
from pykern.backends.driver import CudaDriver, DriverError, arch_of  # noqa: E402
from pykern.backends.nvrtc import NvrtcBackend, stream_handle, target_arch  # noqa: E402
from pykern.ctypes_ import SCALARS  # noqa: E402
from pykern.errors import ArgumentError, ArgumentTypeError, BackendUnavailable  # noqa: E402

from fake_driver import (  # noqa: E402
    LAUNCH_CU,
    FakeDriver,
    FakeDriverError,
    compile_test_kernels,
    decode_params,
    make_fake,
    sim_axpy,
)
from gpu import requires_gpu  # noqa: E402


@pytest.fixture(scope="module")
def compiled():
    return compile_test_kernels("sm_80")


@pytest.fixture(autouse=True)
def kernel_path(monkeypatch):
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(LAUNCH_CU))


@pytest.fixture
def fake(compiled, monkeypatch):
    """A FakeDriver-backed nvrtc backend installed as the process's "nvrtc" backend."""
    drv, get_module = make_fake(compiled)
    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=lambda: ("sm_80",))
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    drv.backend = be
    drv.get_module = get_module
    return drv


def _axpy_inputs(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)


def test_axpy_numpy_end_to_end(fake):
    x, y = _axpy_inputs()
    y0 = y.copy()
    pykern.launch("pktest_axpy", (4,), (256,), y, x, 2.5, 1000, backend="nvrtc")
    np.testing.assert_array_equal(y, np.float32(2.5) * x + y0)
    # x is const: copied in, never back; everything allocated is freed after the sync.
    names = fake.names()
    start = names.index("module_get_function") + 1
    assert names[start:] == [
        "func_attribute",  # the module has no compiler resources: its static shared memory from the driver
        "mem_alloc", "memcpy_htod_async", "mem_alloc", "memcpy_htod_async",
        "launch_kernel", "memcpy_dtoh_async", "stream_synchronize", "mem_free", "mem_free",
        "set_current",  # no context was current before the launch: none is after it
    ]
    before = names[:names.index("module_load_data")]
    assert before[-1] == "set_current" and "current_context" in before
    assert fake.current is None
    assert fake.memory == {}
    (launch,) = fake.launches
    assert launch.name == "pktest_axpy" and launch.grid == (4, 1, 1) and launch.block == (256, 1, 1)
    assert launch.shared_mem == 0 and launch.stream == 0
    allocs = [c[1][0] for c in fake.calls if c[0] == "memcpy_htod_async"]
    assert launch.values[:2] == allocs  # y then x: the device copies, in parameter order
    assert launch.values[2] == 2.5 and launch.values[3] == 1000
    dtoh = [c[1] for c in fake.calls if c[0] == "memcpy_dtoh_async"]
    assert dtoh == [(y.ctypes.data, allocs[0], y.nbytes, 0)]


def test_same_array_twice_is_one_device_buffer(fake):
    y, _ = _axpy_inputs(50)
    y0 = y.copy()
    pykern.launch("pktest_axpy", 1, 64, y, y, 2.0, 50, backend="nvrtc")  # y = 2*y + y, in place
    np.testing.assert_array_equal(y, np.float32(2.0) * y0 + y0)
    names = fake.names()
    assert names.count("mem_alloc") == 1 and names.count("memcpy_htod_async") == 1
    assert names.count("memcpy_dtoh_async") == 1 and names.count("mem_free") == 1
    assert fake.launches[0].values[0] == fake.launches[0].values[1]


def test_through_the_real_disk_cache(compiled, tmp_path, monkeypatch):
    """The default path: pykern.cache compiles (then finds) the cubin the fake driver loads."""
    from pykern import cache

    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path))
    seen = []
    real_get_module = cache.get_module

    def spy(*a, **kw):
        mod = real_get_module(*a, **kw)
        seen.append((mod.origin, mod.hit, kw.get("kernel")))
        return mod

    monkeypatch.setattr(cache, "get_module", spy)
    for round_ in range(2):  # a fresh backend each round, as a new process would have
        drv = FakeDriver(simulate={"pktest_axpy": sim_axpy})
        drv.register(compiled.image, compiled.ptx)  # the cache's cubin is byte-identical
        be = NvrtcBackend(driver_factory=lambda: drv)
        monkeypatch.setitem(backends._instances, "nvrtc", be)
        x, y = _axpy_inputs(40, seed=round_)
        y0 = y.copy()
        pykern.launch("pktest_axpy", 1, 64, y, x, -0.5, 40, backend="nvrtc")
        np.testing.assert_array_equal(y, np.float32(-0.5) * x + y0)
    assert seen == [("compiled", False, "pktest_axpy"), ("cache", True, "pktest_axpy")]


def test_real_kernels_pack_to_their_ptx_layout(monkeypatch):
    """Every kernel of a real kernels_cu family, launched with type-correct arguments: the fake checks
    each packed parameter against the PTX NVRTC emits for it (PTX only: no ptxas, to stay fast)."""
    import hashlib

    from pykern import compiler
    from pykern.ctypes_ import POINTEE_DTYPES
    from pykern.sources import KERNELS_DIR

    source = KERNELS_DIR / "training.cu"
    mod = compiler.compile(source, "compute_80")
    drv = FakeDriver()
    drv.register(mod.image, mod.ptx)
    stub = type("M", (), {"image": mod.image, "digest": hashlib.sha256(mod.image).hexdigest()})
    be = NvrtcBackend(driver_factory=lambda: drv, get_module=lambda src, arch, kernel=None: stub,
                      supported_archs=lambda: ("sm_75",))  # so the target is PTX (compute_75) for the sm_80 fake
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    specs = [k for k in pykern.kernels() if k.source == source.resolve()]
    assert len(specs) == len(mod.kernels) > 0
    for spec in specs:
        args, want = [], []
        for j, p in enumerate(spec.params):
            if p.is_pointer:
                args.append(np.zeros(3 + j, POINTEE_DTYPES[p.pointee][0]))
                want.append(None)  # a device address, checked by the fake
            else:
                kind = SCALARS[p.ctype].kind
                v = {"int": 7 + j, "float": 0.25 * j, "bool": True}[kind]
                args.append(v)
                want.append(v)
        pykern.launch(spec.name, 2, 64, *args, backend="nvrtc")
        got = drv.launches[-1]
        assert got.name == spec.name
        assert [g if w is not None else None for g, w in zip(got.values, want)] == want
    assert len(drv.launches) == len(specs)
    assert drv.memory == {}


def test_every_scalar_type_packed_at_its_extremes(fake):
    out = np.zeros(12, np.float64)
    vals = [-128, 255, -32768, 65535, -(2**31), 2**32 - 1, -(2**63), 2**64 - 1, 1.5, -2.25e300, True, -7]
    pykern.launch("pktest_all_types", 1, 1, out, *vals, backend="nvrtc")
    got = fake.launches[0].values[1:]
    assert got == vals
    assert out.tolist() == [float(v) for v in vals]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_in_range_scalars_round_trip_exactly(compiled, data):
    drv, get_module = make_fake(compiled)
    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=lambda: ("sm_80",))
    spec = registry.get("pktest_all_types")
    vals = []
    for p in spec.params[1:]:
        s = SCALARS[p.ctype]
        if s.kind == "int":
            vals.append(data.draw(st.integers(int(s.lo), int(s.hi))))
        elif s.kind == "bool":
            vals.append(data.draw(st.booleans()))
        elif p.ctype == "float":
            vals.append(data.draw(st.floats(width=32, allow_nan=False)))
        else:
            vals.append(data.draw(st.floats(allow_nan=False)))
    out = np.zeros(12, np.float64)
    from pykern.launcher import convert_args

    args = convert_args(spec, [out, *vals])
    be.launch(spec, (1, 1, 1), (1, 1, 1), args, 0, None)
    assert drv.launches[0].values[1:] == vals


def test_numpy_scalars_and_bf16_arrays(fake):
    src = np.arange(37, dtype=np.float32).astype(ml_dtypes.bfloat16)
    dst = np.zeros(37, ml_dtypes.bfloat16)
    pykern.launch("pktest_copy_u16", 1, 64, dst, src, np.int64(37), backend="nvrtc")
    assert dst.view(np.uint16).tolist() == src.view(np.uint16).tolist()
    x, y = _axpy_inputs(10)
    y0 = y.copy()
    pykern.launch("pktest_axpy", 1, 32, y, x, np.float32(-1.25), np.uint32(10), backend="nvrtc")
    np.testing.assert_array_equal(y, np.float32(-1.25) * x + y0)


def test_module_loaded_once_per_digest_and_function_once_per_name(fake):
    x, y = _axpy_inputs(64)
    for _ in range(3):
        pykern.launch("pktest_axpy", 1, 64, y, x, 1.0, 64, backend="nvrtc")
    pykern.launch("pktest_copy_u16", 1, 64, np.zeros(4, np.uint16), np.ones(4, np.uint16), 4, backend="nvrtc")
    assert fake.names().count("module_load_data") == 1
    assert [c[1][1] for c in fake.calls if c[0] == "module_get_function"] == ["pktest_axpy", "pktest_copy_u16"]
    assert len(fake.get_module.requests) == 2  # once per spec, not per launch
    assert len(fake.launches) == 4


def test_refreshed_registry_asks_the_cache_again_but_reuses_the_module(fake):
    x, y = _axpy_inputs(8)
    pykern.launch("pktest_axpy", 1, 8, y, x, 1.0, 8, backend="nvrtc")
    registry.refresh()
    pykern.launch("pktest_axpy", 1, 8, y, x, 1.0, 8, backend="nvrtc")
    assert len(fake.get_module.requests) == 2
    assert fake.names().count("module_load_data") == 1  # same cubin digest, same context
    assert fake.names().count("module_get_function") == 1
    assert len(fake.backend._devs[0].plans) == 1  # the stale plan was dropped


def _launched_images(drv):
    """The module image behind each launch_kernel call, in order."""
    return [drv.modules[drv.functions[c[1][0]].module].image for c in drv.calls if c[0] == "launch_kernel"]


def test_header_edit_is_picked_up_by_registry_refresh(tmp_path, monkeypatch):
    # docs/precompile.md: a .cu edit is noticed by itself; an edited header needs registry.refresh(),
    # so that launches never look at the file system beyond the one stat() of the kernel's source.
    from pykern import compiler
    from pykern.backends import nvrtc as nvrtc_backend

    kdir = tmp_path / "kernels"
    kdir.mkdir()
    hdr = kdir / "pktest_hdr.cuh"
    hdr.write_text("#define PKTEST_HDR_VALUE 1.0f\n")
    (kdir / "pktest_hdr.cu").write_text(
        '#include "pktest_hdr.cuh"\n'
        'extern "C" __global__ void pktest_hdr_fill(float* y, unsigned int n) {\n'
        "    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "    if (i < n) y[i] = PKTEST_HDR_VALUE;\n"
        "}\n"
    )
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(kdir))
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PYKERN_CUBIN_DIR", raising=False)
    monkeypatch.delenv("PYKERN_DISABLE_JIT", raising=False)
    ptx = compiler.compile(kdir / "pktest_hdr.cu", "compute_80").ptx  # the fake's parameter layouts
    drv = FakeDriver(cc=(8, 0))
    served = []

    def get_module(source, arch, kernel=None):  # the real default, plus registering its image with the fake
        mod = nvrtc_backend._default_get_module(source, arch, kernel)
        drv.register(mod.image, ptx)
        served.append(mod)
        return mod

    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=lambda: ("sm_80",))
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    y = np.zeros(8, np.float32)
    pykern.launch("pktest_hdr_fill", 1, 32, y, 8, backend="nvrtc")
    hdr.write_text("#define PKTEST_HDR_VALUE 2.0f\n")
    pykern.launch("pktest_hdr_fill", 1, 32, y, 8, backend="nvrtc")
    assert len(served) == 1  # not noticed yet: the plan is reused without touching the header
    registry.refresh()
    pykern.launch("pktest_hdr_fill", 1, 32, y, 8, backend="nvrtc")
    old, new = served
    assert (old.origin, new.origin) == ("compiled", "compiled")  # the new header bytes: a new cache key
    assert new.digest != old.digest and new.image != old.image and new.image[:4] == b"\x7fELF"
    assert drv.names().count("module_load_data") == 2
    assert _launched_images(drv) == [old.image, old.image, new.image]
    assert len(be._devs[0].plans) == 1


def test_sm80_bundle_serves_an_sm86_gpu_without_nvrtc(compiled, tmp_path, monkeypatch):
    from pykern import cache

    from fake_driver import TEST_SOURCE

    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "build_cache"))
    monkeypatch.delenv("PYKERN_CUBIN_DIR", raising=False)
    monkeypatch.delenv("PYKERN_DISABLE_JIT", raising=False)
    bundle = tmp_path / "bundle"
    cache.export_to_bundle(cache.get_module(TEST_SOURCE, "sm_80"), cache.load_source(TEST_SOURCE), bundle)

    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("PYKERN_CUBIN_DIR", str(bundle))
    monkeypatch.setenv("PYKERN_DISABLE_JIT", "1")

    def no_nvrtc(*_):
        raise BackendUnavailable("NVRTC is not available (no libnvrtc in this test)")

    monkeypatch.setattr(cache, "_nvrtc_str", no_nvrtc)
    seen = []
    real_get_module = cache.get_module

    def spy(*a, **kw):
        mod = real_get_module(*a, **kw)
        seen.append((a[1], mod.origin, mod.arch))
        return mod

    monkeypatch.setattr(cache, "get_module", spy)
    drv = FakeDriver(cc=(8, 6), simulate={"pktest_axpy": sim_axpy})  # an RTX 3090
    drv.register(compiled.image, compiled.ptx)  # the bundle's sm_80 cubin is byte-identical
    be = NvrtcBackend(driver_factory=lambda: drv, supported_archs=no_nvrtc)
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    assert be.available() == (True, "")
    x, y = _axpy_inputs(40)
    y0 = y.copy()
    pykern.launch("pktest_axpy", 1, 64, y, x, 3.0, 40, backend="nvrtc")
    np.testing.assert_array_equal(y, np.float32(3.0) * x + y0)
    assert seen == [("sm_86", "bundle:sm_80", "sm_80")]
    assert _launched_images(drv) == [compiled.image]
    assert not (tmp_path / "empty_cache").exists()


def test_device_arrays_pass_their_pointers_without_copies(fake):
    x, y = _axpy_inputs(100)
    dx, dy = fake.device_array(x, readonly=True), fake.device_array(y)
    pykern.launch("pktest_axpy", 1, 128, dy, dx, 3.0, 100, backend="nvrtc")
    launch = fake.launches[0]
    assert launch.values[:2] == [dy.ptr, dx.ptr]
    assert not {"mem_alloc", "memcpy_htod_async", "memcpy_dtoh_async", "stream_synchronize"} & set(fake.names())
    np.testing.assert_array_equal(dy.copy_to_host(), np.float32(3.0) * x + y)


def test_device_array_on_another_stream_is_synchronized_first(fake):
    x, y = _axpy_inputs(16)
    dx = fake.device_array(x, stream=7)
    dy = fake.device_array(y, stream=9)
    pykern.launch("pktest_axpy", 1, 16, dy, dx, 1.0, 16, stream=9, backend="nvrtc")
    names = fake.names()
    syncs = [c[1][0] for c in fake.calls if c[0] == "stream_synchronize"]
    assert syncs == [7]  # dy is on the launch stream already
    assert names.index("stream_synchronize") < names.index("launch_kernel")
    fake.calls.clear()
    legacy = fake.device_array(y, stream=1)  # the legacy default stream is what stream 0 means
    pykern.launch("pktest_axpy", 1, 16, legacy, fake.device_array(x), 1.0, 16, backend="nvrtc")
    assert "stream_synchronize" not in fake.names()


class _CoreStream:
    def __cuda_stream__(self):
        return (0, 99)


class _TorchStream:
    cuda_stream = 55


def test_stream_forms(fake):
    assert stream_handle(None) == 0
    assert stream_handle(12) == 12
    assert stream_handle(np.uint64(13)) == 13
    assert stream_handle(_CoreStream()) == 99
    assert stream_handle(_TorchStream()) == 55
    with pytest.raises(ArgumentError, match=r"stream: expected a non-negative CUstream handle, got -1"):
        stream_handle(-1)
    with pytest.raises(ArgumentTypeError, match=r"stream: expected None, an int .* got str"):
        stream_handle("default")
    x, y = _axpy_inputs(8)
    pykern.launch("pktest_axpy", 1, 8, y, x, 1.0, 8, stream=_CoreStream(), backend="nvrtc")
    streams = {c[1][-1] for c in fake.calls if c[0] in ("memcpy_htod_async", "memcpy_dtoh_async")}
    assert streams == {99}
    assert fake.launches[0].stream == 99
    assert ("stream_synchronize", (99,)) in fake.calls
    with pytest.raises(ArgumentTypeError, match="stream"):
        pykern.launch("pktest_axpy", 1, 8, y, x, 1.0, 8, stream=object(), backend="nvrtc")
    assert fake.memory == {}


def test_dynamic_shared_memory_opt_in_and_device_limit(fake):
    n = 300
    src = np.arange(n, dtype=np.float32)
    out = np.zeros(n, np.float32)
    pykern.launch("pktest_smem_reverse", 3, 128, out, src, n, shared_mem=512, backend="nvrtc")
    expect = np.zeros(n, np.float32)
    for b in range(3):
        lo = b * 128
        for t in range(128):
            j = lo + 127 - t
            if j < n:
                expect[j] = src[lo + t] if lo + t < n else 0.0
    np.testing.assert_array_equal(out, expect)
    assert "set_max_dynamic_shared" not in fake.names()  # <= 48 KB needs no opt-in

    big = 64 * 1024
    pykern.launch("pktest_smem_reverse", 3, 128, out, src, n, shared_mem=big, backend="nvrtc")
    pykern.launch("pktest_smem_reverse", 3, 128, out, src, n, shared_mem=big, backend="nvrtc")
    opt = [c[1][1] for c in fake.calls if c[0] == "set_max_dynamic_shared"]
    assert opt == [big]  # set once, remembered per function
    assert fake.launches[-1].shared_mem == big

    allocs = fake.names().count("mem_alloc")
    too_big = fake.max_shared_optin + 16
    with pytest.raises(ArgumentError, match=rf"shared_mem: expected at most {fake.max_shared_optin} bytes for "
                                            rf"pktest_smem_reverse on this device \(sm_80\), got {too_big}"):
        pykern.launch("pktest_smem_reverse", 3, 128, out, src, n, shared_mem=too_big, backend="nvrtc")
    assert fake.names().count("mem_alloc") == allocs  # rejected before anything was staged


def test_static_shared_memory_counts_against_the_limit(compiled):
    import hashlib

    from pykern.compiler import Resources

    drv = FakeDriver()
    drv.register(compiled.image, compiled.ptx)
    res = Resources(registers=12, spill_stores=0, spill_loads=0, shared_bytes=4096, stack_bytes=0, barriers=1)
    stub = type("M", (), {"image": compiled.image, "digest": hashlib.sha256(compiled.image).hexdigest(),
                          "resources": {"pktest_smem_reverse": res}})
    be = NvrtcBackend(driver_factory=lambda: drv, get_module=lambda *a, **k: stub, supported_archs=lambda: ("sm_80",))
    spec = registry.get("pktest_smem_reverse")
    from pykern.launcher import convert_args

    args = convert_args(spec, [np.zeros(8, np.float32), np.ones(8, np.float32), 8])
    limit = drv.max_shared_optin - 4096
    be.launch(spec, (1, 1, 1), (8, 1, 1), args, limit, None)
    pattern = (rf"shared_mem: expected at most {limit} bytes for pktest_smem_reverse on this device \(sm_80\) "
               rf"\(4096 of the {drv.max_shared_optin} go to static __shared__\), got {limit + 1}")
    with pytest.raises(ArgumentError, match=pattern):
        be.launch(spec, (1, 1, 1), (8, 1, 1), args, limit + 1, None)
    assert len(drv.launches) == 1 and drv.memory == {}


def test_empty_arrays_pass_null_and_copy_nothing(fake):
    x = np.zeros(0, np.float32)
    y = np.zeros(0, np.float32)
    pykern.launch("pktest_axpy", 1, 32, y, x, 1.0, 0, backend="nvrtc")
    assert fake.launches[0].values[:2] == [0, 0]
    assert not {"mem_alloc", "memcpy_htod_async", "memcpy_dtoh_async", "mem_free"} & set(fake.names())


def test_launch_failure_frees_and_names_the_call(fake):
    fake.fail["launch_kernel"] = "CUDA_ERROR_LAUNCH_FAILED"
    x, y = _axpy_inputs(32)
    y0 = y.copy()
    with pytest.raises(DriverError, match="launch_kernel failed: CUDA_ERROR_LAUNCH_FAILED") as ei:
        pykern.launch("pktest_axpy", 1, 32, y, x, 1.0, 32, backend="nvrtc")
    assert isinstance(ei.value, pykern.PykernError)
    assert fake.memory == {} and fake.names().count("mem_free") == 2
    np.testing.assert_array_equal(y, y0)


def test_failed_copy_in_frees_what_was_allocated(fake):
    fake.fail["memcpy_htod_async"] = "CUDA_ERROR_ILLEGAL_ADDRESS"
    x, y = _axpy_inputs(32)
    with pytest.raises(DriverError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        pykern.launch("pktest_axpy", 1, 32, y, x, 1.0, 32, backend="nvrtc")
    assert fake.memory == {} and "launch_kernel" not in fake.names()


# -- the fake's own checks bite (otherwise the tests above would prove little) -----------


def _axpy_function(fake):
    fake.backend.function(registry.get("pktest_axpy"))
    return next(h for h, f in fake.functions.items() if f.name == "pktest_axpy")


def _pack(*objs):
    arr = (ctypes.c_void_p * len(objs))(*(ctypes.addressof(o) for o in objs))
    arr.keep = objs  # the storage must outlive the pointer array
    return arr


def test_fake_rejects_misplaced_or_mistyped_parameters(fake):
    func = _axpy_function(fake)
    ptx = fake.functions[func].params
    dev = fake._alloc(64)
    y, x = ctypes.c_uint64(dev), ctypes.c_uint64(dev)
    good = _pack(y, x, ctypes.c_float(2.0), ctypes.c_uint32(16))
    assert decode_params("pktest_axpy", ptx, ctypes.addressof(good), fake) == [dev, dev, 2.0, 16]
    # a float packed as a double arrives as garbage: the decoded value shows it
    bad = _pack(y, x, ctypes.c_double(2.0), ctypes.c_uint32(16))
    assert decode_params("pktest_axpy", ptx, ctypes.addressof(bad), fake)[2] != 2.0
    # a host pointer where a device pointer belongs
    host = np.zeros(4, np.float32)
    # Held in a local: an inline temporary could be freed (and its memory reused) before decode reads it.
    host_args = _pack(ctypes.c_uint64(host.ctypes.data), x, ctypes.c_float(1), ctypes.c_uint32(1))
    with pytest.raises(FakeDriverError, match="not inside any live allocation"):
        decode_params("pktest_axpy", ptx, ctypes.addressof(host_args), fake)
    # storage that breaks the PTX alignment
    raw = (ctypes.c_uint8 * 16)()
    odd = ctypes.addressof(raw) | 1
    n = ctypes.c_uint32(1)
    arr = (ctypes.c_void_p * 4)(ctypes.addressof(y), ctypes.addressof(x), odd, ctypes.addressof(n))
    with pytest.raises(FakeDriverError, match="not 4-byte aligned"):
        decode_params("pktest_axpy", ptx, ctypes.addressof(arr), fake)
    with pytest.raises(FakeDriverError, match="kernelParams is NULL"):
        decode_params("pktest_axpy", ptx, 0, fake)


def test_fake_refuses_big_shared_memory_without_opt_in(fake):
    func = _axpy_function(fake)
    fake.set_current(fake.primary_context(0))
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        fake.launch_kernel(func, (1, 1, 1), (1, 1, 1), 64 * 1024, 0, 0)


# -- availability -----------------------------------------------------------------------


def test_no_driver_is_backend_unavailable(monkeypatch):
    be = NvrtcBackend()  # the real CudaDriver: there is no libcuda on the machines that run CI
    ok, why = be.available()
    if ok:
        pytest.skip("a CUDA driver and GPU are present")
    assert "nvrtc backend" in why and ("no CUDA driver" in why or "no GPU" in why)
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    x, y = _axpy_inputs(4)
    with pytest.raises(BackendUnavailable, match="nvrtc backend"):
        pykern.launch("pktest_axpy", 1, 4, y, x, 1.0, 4, backend="nvrtc")


def test_unavailability_is_probed_once():
    made = []

    def factory():
        made.append(1)
        raise BackendUnavailable("nvrtc backend: no CUDA driver (test)")

    be = NvrtcBackend(driver_factory=factory)
    assert be.available() == (False, "nvrtc backend: no CUDA driver (test)")
    assert be.available()[0] is False
    assert len(made) == 1


def test_no_gpu_and_bad_device():
    be = NvrtcBackend(driver_factory=lambda: FakeDriver(devices=0))
    assert be.available() == (False, "nvrtc backend: the CUDA driver reports no GPU")
    be = NvrtcBackend(driver_factory=lambda: FakeDriver(devices=1), device=3)
    assert be.available() == (False, "nvrtc backend: device 3 requested, 1 present")


def test_driver_failing_at_init_is_unavailable():
    fake = FakeDriver(fail={"init": "CUDA_ERROR_NO_DEVICE"})
    ok, why = NvrtcBackend(driver_factory=lambda: fake).available()
    assert not ok and "CUDA_ERROR_NO_DEVICE" in why


def test_arch_choice():
    assert arch_of((9, 0)) == "sm_90" and arch_of((12, 1)) == "sm_121"
    supported = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_120")
    assert target_arch("sm_86", supported) == "sm_86"
    assert target_arch("sm_89", supported) == "compute_86"  # PTX the driver JITs for the newer GPU
    assert target_arch("sm_130", supported) == "compute_120"
    with pytest.raises(BackendUnavailable, match="cannot target the GPU's sm_70"):
        target_arch("sm_70", supported)


def test_real_driver_error_names_call_and_result():
    try:
        drv = CudaDriver()
    except BackendUnavailable:
        pytest.skip("cuda.bindings is not importable")
    from cuda.bindings import driver as cu

    with pytest.raises(DriverError, match="cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"):
        drv._check("cuMemAlloc", (cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, 0))
    assert drv._check("cuMemAlloc", (cu.CUresult.CUDA_SUCCESS, 1234)) == 1234
    assert drv._check("cuMemFree", (cu.CUresult.CUDA_SUCCESS,)) is None


class _RecordingBindings:
    """Stands in for cuda.bindings.driver inside CudaDriver: records calls, returns (SUCCESS, value)."""

    def __init__(self, cu, values):
        self._cu, self._values, self.calls = cu, values, []
        self.CUresult, self.CUdevice_attribute = cu.CUresult, cu.CUdevice_attribute
        self.CUfunction_attribute = cu.CUfunction_attribute
        self.CUpointer_attribute = cu.CUpointer_attribute

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            v = self._values.get(name, ())
            return (self._cu.CUresult.CUDA_SUCCESS, *(v if isinstance(v, tuple) else (v,)))

        return call


def test_cuda_driver_wrapper_calls_the_bindings_in_order():
    try:
        drv = CudaDriver()
    except BackendUnavailable:
        pytest.skip("cuda.bindings is not importable")
    cu = drv._cu
    attrs = {
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448,
    }
    rec = _RecordingBindings(cu, {"cuDeviceGetCount": 2, "cuDeviceGet": "dev0", "cuDevicePrimaryCtxRetain": "ctx",
                                  "cuModuleLoadData": "mod", "cuModuleGetFunction": "fn", "cuMemAlloc": 4096,
                                  "cuCtxGetCurrent": "torch-ctx", "cuCtxGetDevice": 1, "cuPointerGetAttribute": 1})
    drv._cu = rec
    rec.cuDeviceGetAttribute = lambda a, d: (rec.calls.append(("cuDeviceGetAttribute", (a, d))),
                                             (cu.CUresult.CUDA_SUCCESS, attrs[a]))[1]
    drv.init()
    assert drv.device_count() == 2
    assert drv.compute_capability(0) == (9, 0)
    assert drv.max_shared_per_block_optin(0) == 232448
    assert drv.primary_context(0) == "ctx" and drv.primary_context(0) == "ctx"  # retained once
    assert drv.current_context() == "torch-ctx" and drv.context_device() == 1
    assert drv.pointer_device(4096) == 1
    drv.set_current("ctx")
    assert drv.module_load_data(b"cubin") == "mod"
    assert drv.module_get_function("mod", "k") == "fn"
    drv.set_max_dynamic_shared("fn", 65536)
    assert drv.mem_alloc(64) == 4096
    drv.memcpy_htod_async(4096, 1234, 64, 5)
    drv.launch_kernel("fn", (1, 2, 3), (4, 5, 6), 100, 5, 777)
    drv.memcpy_dtoh_async(1234, 4096, 64, 5)
    drv.stream_synchronize(5)
    drv.mem_free(4096)
    calls = [(n, a) for n, a in rec.calls if n != "cuDeviceGet"]
    assert [n for n, _ in calls].count("cuDevicePrimaryCtxRetain") == 1
    assert ("cuInit", (0,)) in calls
    assert ("cuCtxSetCurrent", ("ctx",)) in calls
    assert ("cuCtxGetCurrent", ()) in calls and ("cuCtxGetDevice", ()) in calls
    assert ("cuPointerGetAttribute", (cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, 4096)) in calls
    assert ("cuModuleLoadData", (b"cubin",)) in calls
    assert ("cuModuleGetFunction", ("mod", b"k")) in calls
    assert ("cuFuncSetAttribute", ("fn", cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                   65536)) in calls
    assert ("cuMemcpyHtoDAsync", (4096, 1234, 64, 5)) in calls
    assert ("cuLaunchKernel", ("fn", 1, 2, 3, 4, 5, 6, 100, 5, 777, 0)) in calls
    assert ("cuMemcpyDtoHAsync", (1234, 4096, 64, 5)) in calls
    assert calls[-2:] == [("cuStreamSynchronize", (5,)), ("cuMemFree", (4096,))]


def test_real_bindings_accept_the_argument_types_we_pass():
    """Without libcuda each binding converts its arguments, then fails to find the library: a
    TypeError here would mean CudaDriver passes a type cuda.bindings does not take."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        pytest.skip("cuda.bindings is not importable")
    if NvrtcBackend().available()[0]:
        pytest.skip("a driver is present: the calls would really run")
    params = (ctypes.c_void_p * 2)()
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    calls = {
        "cuLaunchKernel": lambda: cu.cuLaunchKernel(cu.CUfunction(1), 1, 1, 1, 32, 1, 1, 0, 7,
                                                    ctypes.addressof(params), 0),
        "cuMemcpyHtoDAsync": lambda: cu.cuMemcpyHtoDAsync(4096, 1234, 8, 7),
        "cuMemcpyDtoHAsync": lambda: cu.cuMemcpyDtoHAsync(1234, 4096, 8, 7),
        "cuMemFree": lambda: cu.cuMemFree(4096),
        "cuStreamSynchronize": lambda: cu.cuStreamSynchronize(7),
        "cuModuleGetFunction": lambda: cu.cuModuleGetFunction(cu.CUmodule(1), b"k"),
        "cuModuleLoadData": lambda: cu.cuModuleLoadData(b"\x7fELF"),
        "cuFuncSetAttribute": lambda: cu.cuFuncSetAttribute(cu.CUfunction(1), attr, 65536),
        "cuCtxSetCurrent": lambda: cu.cuCtxSetCurrent(cu.CUcontext(1)),
        "cuCtxSetCurrent(null)": lambda: cu.cuCtxSetCurrent(cu.CUcontext(0)),
        "cuCtxGetCurrent": lambda: cu.cuCtxGetCurrent(),
        "cuCtxGetDevice": lambda: cu.cuCtxGetDevice(),
        "cuPointerGetAttribute": lambda: cu.cuPointerGetAttribute(
            cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, 4096),
    }
    for name, call in calls.items():
        with pytest.raises(Exception) as ei:
            call()
        assert not isinstance(ei.value, TypeError), f"{name}: {ei.value}"


# -- a real GPU -------------------------------------------------------------------------


@requires_gpu
def test_gpu_smoke_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path))
    be = NvrtcBackend()
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    x, y = _axpy_inputs(5000)
    y0 = y.copy()
    pykern.launch("pktest_axpy", 20, 256, y, x, 0.5, 5000, backend="nvrtc")
    np.testing.assert_allclose(y, np.float32(0.5) * x + y0, rtol=1e-6, atol=1e-6)
    out = np.zeros(12, np.float64)
    vals = [-128, 255, -32768, 65535, -(2**31), 2**32 - 1, -(2**53), 2**53, 1.5, -2.25e300, True, -7]
    pykern.launch("pktest_all_types", 1, 32, out, *vals, backend="nvrtc")
    assert out.tolist() == [float(v) for v in vals]
    n = 1000
    src = np.arange(n, dtype=np.float32)
    rev = np.zeros(n, np.float32)
    pykern.launch("pktest_smem_reverse", 4, 256, rev, src, n, shared_mem=64 * 1024, backend="nvrtc")
    assert rev[:256].tolist() == src[:256][::-1].tolist()


def test_gpu_without_usable_nvrtc_is_not_available(compiled, monkeypatch):
    # The default backend must not be nvrtc when nothing could compile its kernels (README: "picks
    # nvrtc when a GPU, driver and NVRTC are usable; else numba on a GPU").
    monkeypatch.delenv("PYKERN_CUBIN_DIR", raising=False)
    drv, get_module = make_fake(compiled)

    def no_nvrtc():
        raise BackendUnavailable("NVRTC is not available (libnvrtc.so.13: cannot open shared object file)")

    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=no_nvrtc)
    ok, why = be.available()
    assert not ok and "libnvrtc.so.13" in why
    # A precompiled bundle serves launches without NVRTC: then the GPU path is usable.
    monkeypatch.setenv("PYKERN_CUBIN_DIR", "/some/bundle")
    assert be.available() == (True, "")


# -- shared memory: static bytes count against the 48 KB a block has without the opt-in ---------


@pytest.mark.parametrize("resources", [True, False], ids=["cubin-resources", "driver-attribute"])
def test_static_shared_memory_lowers_the_no_opt_in_limit(compiled, monkeypatch, resources):
    """S static bytes leave 48 KB - S of dynamic shared memory before the opt-in: a launch with
    48 KB - S < dynamic <= 48 KB must set MAX_DYNAMIC_SHARED_SIZE_BYTES first, or a GPU refuses it."""
    import hashlib

    from pykern.compiler import Resources

    from fake_driver import StubModule, sim_smem_reverse

    static = 8 * 1024
    drv = FakeDriver(func_attributes={"pktest_smem_reverse": {"SHARED_SIZE_BYTES": static}},
                     simulate={"pktest_smem_reverse": sim_smem_reverse})
    drv.register(compiled.image, compiled.ptx)
    res = Resources(registers=12, spill_stores=0, spill_loads=0, shared_bytes=static, stack_bytes=0, barriers=1)
    # A cubin's module carries the compiler's resources; a PTX module does not (the driver is asked).
    stub = StubModule(compiled.image, hashlib.sha256(compiled.image).hexdigest(),
                      {"pktest_smem_reverse": res} if resources else {})
    be = NvrtcBackend(driver_factory=lambda: drv, get_module=lambda *a, **k: stub, supported_archs=lambda: ("sm_80",))
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    src, out = np.arange(256, dtype=np.float32), np.zeros(256, np.float32)
    fits = 48 * 1024 - static
    pykern.launch("pktest_smem_reverse", 2, 128, out, src, 256, shared_mem=fits, backend="nvrtc")
    assert "set_max_dynamic_shared" not in drv.names()  # static + dynamic = 48 KB: no opt-in needed
    over = 44 * 1024  # <= 48 KB, yet 8 KB static + 44 KB > 48 KB
    pykern.launch("pktest_smem_reverse", 2, 128, out, src, 256, shared_mem=over, backend="nvrtc")
    assert [c[1][1] for c in drv.calls if c[0] == "set_max_dynamic_shared"] == [over]
    assert out[:128].tolist() == src[:128][::-1].tolist() and drv.launches[-1].shared_mem == over
    # the fake models the rule: without the attribute that launch is refused
    func = next(h for h, f in drv.functions.items() if f.name == "pktest_smem_reverse")
    drv.functions[func].max_dynamic_shared = fits
    drv.set_current(drv.primary_context(0))
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        drv.launch_kernel(func, (1, 1, 1), (128, 1, 1), over, 0, 0)


# -- availability: a GPU this NVRTC cannot target --------------------------------------------


NVRTC13 = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")  # no sm_70 any more


def _bundle(tmp_path, *archs):
    import json

    root = tmp_path / ("bundle_" + "_".join(archs))
    root.mkdir()
    (root / "manifest.json").write_text(json.dumps({"entries": [{"source": "forward.cu", "arch": a} for a in archs]}))
    return root


def test_gpu_that_nvrtc_cannot_target_is_not_available(tmp_path, monkeypatch):
    monkeypatch.delenv("PYKERN_CUBIN_DIR", raising=False)
    be = NvrtcBackend(driver_factory=lambda: FakeDriver(cc=(7, 0)), supported_archs=lambda: NVRTC13)
    ok, why = be.available()
    assert not ok and "cannot target the GPU's sm_70" in why and be.arch == "sm_70"
    # a precompiled bundle with sm_70 images serves it; one with only newer archs does not
    monkeypatch.setenv("PYKERN_CUBIN_DIR", str(_bundle(tmp_path, "sm_70")))
    assert be.available() == (True, "")
    monkeypatch.setenv("PYKERN_CUBIN_DIR", str(_bundle(tmp_path, "sm_80", "sm_90")))
    ok, why = be.available()
    assert not ok and "sm_70" in why
    # a newer GPU is fine (PTX of the newest older arch), and one unservable GPU of several is named
    assert NvrtcBackend(driver_factory=lambda: FakeDriver(cc=(12, 1)), supported_archs=lambda: NVRTC13).available() \
        == (True, "")
    monkeypatch.delenv("PYKERN_CUBIN_DIR")
    two = NvrtcBackend(driver_factory=lambda: FakeDriver(devices=2, device_cc={1: (7, 0)}),
                       supported_archs=lambda: NVRTC13)
    ok, why = two.available()
    assert not ok and why.endswith("(device 1)")
    judged = NvrtcBackend(driver_factory=lambda: FakeDriver(devices=2, device_cc={1: (7, 0)}),
                          supported_archs=lambda: NVRTC13, device=0)
    assert judged.available() == (True, "")


def test_untargetable_gpu_falls_back_to_another_backend(monkeypatch):
    import warnings

    monkeypatch.delenv("PYKERN_CUBIN_DIR", raising=False)
    monkeypatch.delenv("PYKERN_BACKEND", raising=False)
    be = NvrtcBackend(driver_factory=lambda: FakeDriver(cc=(7, 0)), supported_archs=lambda: NVRTC13)

    class NoNumbaGpu:
        name = "numba"

        def on_gpu(self):
            return False

    monkeypatch.setitem(backends._instances, "nvrtc", be)
    monkeypatch.setitem(backends._instances, "numba", NoNumbaGpu())
    monkeypatch.setattr(backends, "_default", None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert backends.default_backend_name() == "host"
    msgs = [str(x.message) for x in w if issubclass(x.category, backends.BackendWarning)]
    assert len(msgs) == 1 and "(sm_70)" in msgs[0] and "cannot target the GPU's sm_70" in msgs[0]
