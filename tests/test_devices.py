"""Every GPU, not just device 0: which device a launch runs on, per-device contexts and modules, the
caller's context left as it was, mixed-device and meta arguments, `device=`, and gpucheck --device.

Runs against tests/fake_driver.py with 2 and 8 fake GPUs (each with its own primary context; the fake
refuses pointers, modules and functions used in the wrong context). The `gpu`-marked tests at the end
need a machine with two real GPUs and torch.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pykern  # noqa: E402
from pykern import arrays, backends, devices, ops, registry  # noqa: E402
from pykern.backends.driver import DriverError  # noqa: E402
from pykern.backends.nvrtc import NvrtcBackend  # noqa: E402
from pykern.errors import ArgumentError, ArgumentTypeError  # noqa: E402

from fake_driver import (  # noqa: E402
    LAUNCH_CU,
    TEST_SOURCE,
    FakeDriver,
    FakeDriverError,
    StubModule,
    compile_test_kernels,
    make_fake,
)


@pytest.fixture(scope="module")
def compiled():
    return compile_test_kernels("sm_80")


@pytest.fixture(autouse=True)
def kernel_path(monkeypatch):
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(LAUNCH_CU))
    monkeypatch.delenv("PYKERN_CUBIN_DIR", raising=False)


def _install(monkeypatch, drv, get_module, supported=("sm_80",)) -> NvrtcBackend:
    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=lambda: supported)
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    return be


@pytest.fixture
def fake8(compiled, monkeypatch):
    drv, get_module = make_fake(compiled, devices=8)
    drv.backend = _install(monkeypatch, drv, get_module)
    return drv


def _axpy(drv, device, n=300, seed=0):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    return x, y, drv.device_array(x, readonly=True, device=device), drv.device_array(y, device=device)


def _ctx(d: int) -> int:
    return 0xC0 + d  # the fake's primary context of device d


# -- where a launch runs --------------------------------------------------------------------------


@pytest.mark.parametrize("device", [1, 7])
def test_device_arrays_launch_in_their_devices_context(fake8, device):
    x, y, dx, dy = _axpy(fake8, device)
    pykern.launch("pktest_axpy", 2, 256, dy, dx, 2.0, 300, backend="nvrtc")
    np.testing.assert_array_equal(dy.copy_to_host(), np.float32(2.0) * x + y)
    i = fake8.names().index("launch_kernel")
    assert fake8.call_contexts[i] == _ctx(device)
    # the module was loaded, and the function fetched, in that device's context; nothing touched another
    for name in ("module_load_data", "module_get_function"):
        assert fake8.call_contexts[fake8.names().index(name)] == _ctx(device)
    assert [c[1][0] for c in fake8.calls if c[0] == "primary_context"] == [device]
    assert fake8.current is None  # no context was current before: none is left behind


def test_modules_are_loaded_per_context(fake8):
    for device in (7, 1, 7, 1):
        x, y, dx, dy = _axpy(fake8, device)
        pykern.launch("pktest_axpy", 2, 256, dy, dx, 2.0, 300, backend="nvrtc")
        np.testing.assert_array_equal(dy.copy_to_host(), np.float32(2.0) * x + y)
    loads = [cur for (name, _), cur in zip(fake8.calls, fake8.call_contexts) if name == "module_load_data"]
    assert loads == [_ctx(7), _ctx(1)]  # once per context, never reused across them
    assert [ln.name for ln in fake8.launches] == ["pktest_axpy"] * 4
    be = fake8.backend
    assert len(be._devs[7].plans) == len(be._devs[1].plans) == 1 and be._devs[1].plans != be._devs[7].plans
    assert be._devs[0] is None  # device 0 was never opened


def test_fake_refuses_a_function_or_pointer_of_another_context(fake8):
    """The fake's own checks bite: otherwise the tests above would prove little."""
    fake8.backend.function(registry.get("pktest_axpy"), device=7)
    func = next(h for h, f in fake8.functions.items() if f.name == "pktest_axpy")
    fake8.set_current(_ctx(1))
    with pytest.raises(FakeDriverError, match=r"loaded in context 0xc7 \(device 7\).*device 1"):
        fake8.launch_kernel(func, (1, 1, 1), (1, 1, 1), 0, 0, 0)
    module = next(iter(fake8.modules))
    with pytest.raises(FakeDriverError, match="module_get_function: loaded in context"):
        fake8.module_get_function(module, "pktest_axpy")
    # a pointer of device 2 in a launch on device 7
    fake8.set_current(_ctx(7))
    _, _, dx, dy = _axpy(fake8, 2)
    import ctypes

    y, xp = ctypes.c_uint64(dy.ptr), ctypes.c_uint64(dx.ptr)
    a, n = ctypes.c_float(1.0), ctypes.c_uint32(4)
    params = (ctypes.c_void_p * 4)(*(ctypes.addressof(v) for v in (y, xp, a, n)))
    with pytest.raises(FakeDriverError, match="lives on device 2, the launch runs on device 7"):
        fake8.launch_kernel(func, (1, 1, 1), (32, 1, 1), 0, 0, ctypes.addressof(params))


def test_callers_context_is_restored(fake8):
    fake8.set_current(_ctx(0))  # e.g. torch's, on device 0
    x, y, dx, dy = _axpy(fake8, 7)
    start = len(fake8.calls)
    pykern.launch("pktest_axpy", 2, 256, dy, dx, 2.0, 300, backend="nvrtc")
    assert fake8.current == _ctx(0)
    sets = [c[1][0] for c in fake8.calls[start:] if c[0] == "set_current"]
    assert sets == [_ctx(7), _ctx(0)]
    # ... also when the launch fails
    fake8.fail["launch_kernel"] = "CUDA_ERROR_LAUNCH_FAILED"
    with pytest.raises(DriverError):
        pykern.launch("pktest_axpy", 2, 256, dy, dx, 2.0, 300, backend="nvrtc")
    assert fake8.current == _ctx(0)
    # arrays on the current context's device: no switch at all
    del fake8.fail["launch_kernel"]
    _, _, ex, ey = _axpy(fake8, 0)
    start = len(fake8.calls)
    pykern.launch("pktest_axpy", 2, 256, ey, ex, 2.0, 300, backend="nvrtc")
    assert "set_current" not in [c[0] for c in fake8.calls[start:]] and fake8.current == _ctx(0)


def test_numpy_arrays_go_to_the_current_device(fake8):
    x, y = np.ones(64, np.float32), np.zeros(64, np.float32)
    fake8.set_current(_ctx(3))  # what cupy.cuda.Device(3).use() or torch.cuda.set_device(3) leaves current
    pykern.launch("pktest_axpy", 1, 64, y, x, 2.0, 64, backend="nvrtc")
    assert (y == 2.0).all()
    allocs = [i for i, c in enumerate(fake8.calls) if c[0] == "mem_alloc"]
    assert {fake8.call_contexts[i] for i in allocs} == {_ctx(3)}
    assert fake8.launches and fake8.current == _ctx(3)
    # no context current at all: device 0
    fake8.set_current(None)
    pykern.launch("pktest_axpy", 1, 64, y, x, 2.0, 64, backend="nvrtc")
    i = max(i for i, c in enumerate(fake8.calls) if c[0] == "launch_kernel")
    assert fake8.call_contexts[i] == _ctx(0) and fake8.current is None


def test_explicit_device_argument(fake8):
    x, y = np.ones(64, np.float32), np.zeros(64, np.float32)
    fake8.set_current(_ctx(2))
    pykern.launch("pktest_axpy", 1, 64, y, x, 2.0, 64, backend="nvrtc", device=5)
    i = fake8.names().index("launch_kernel")
    assert fake8.call_contexts[i] == _ctx(5) and (y == 2.0).all() and fake8.current == _ctx(2)
    # device= agreeing with the arrays is fine; contradicting them names both
    _, _, dx, dy = _axpy(fake8, 4)
    pykern.launch("pktest_axpy", 2, 256, dy, dx, 2.0, 300, backend="nvrtc", device=4)
    n = len(fake8.launches)
    with pytest.raises(ArgumentError, match=r"device: expected 4, the device of pktest_axpy: argument 0 "
                                            r"\(float\* y\), or None, got 5"):
        pykern.launch("pktest_axpy", 2, 256, dy, dx, 2.0, 300, backend="nvrtc", device=5)
    with pytest.raises(ArgumentError, match=r"device: expected 0 <= device < 8 \(the GPUs present\), got 8"):
        pykern.launch("pktest_axpy", 1, 64, y, x, 2.0, 64, backend="nvrtc", device=8)
    with pytest.raises(ArgumentError, match="device: expected a CUDA device ordinal"):
        pykern.launch("pktest_axpy", 1, 64, y, x, 2.0, 64, backend="nvrtc", device="cuda:1")
    assert len(fake8.launches) == n and fake8.current == _ctx(2)


def test_device_argument_on_the_cpu_backends_is_accepted():
    x, y = np.ones(8, np.float32), np.zeros(8, np.float32)
    pykern.launch("pktest_axpy", 1, 8, y, x, 2.0, 8, backend="host", device=0)
    assert (y == 2.0).all()


def test_mixed_devices_raise_naming_both(fake8):
    _, _, dx, _ = _axpy(fake8, 2)
    _, _, _, dy = _axpy(fake8, 1)
    with pytest.raises(ArgumentError, match=r"pktest_axpy: argument 1 \(const float\* x\): expected the device of "
                                            r"pktest_axpy: argument 0 \(float\* y\) \(cuda:1\), got an array on "
                                            r"cuda:2"):
        pykern.launch("pktest_axpy", 2, 256, dy, dx, 2.0, 300, backend="nvrtc")
    assert not fake8.launches and "primary_context" not in fake8.names()


def test_one_gpu_asks_the_driver_nothing_per_launch(compiled, monkeypatch):
    drv, get_module = make_fake(compiled)
    _install(monkeypatch, drv, get_module)
    _, _, dx, dy = _axpy(drv, 0)
    pykern.launch("pktest_axpy", 2, 256, dy, dx, 2.0, 300, backend="nvrtc")
    start = len(drv.calls)
    pykern.launch("pktest_axpy", 2, 256, dy, dx, 2.0, 300, backend="nvrtc")
    assert drv.names()[start:] == ["current_context", "set_current", "launch_kernel", "set_current"]
    drv.set_current(_ctx(0))
    start = len(drv.calls)
    pykern.launch("pktest_axpy", 2, 256, dy, dx, 2.0, 300, backend="nvrtc")
    assert drv.names()[start:] == ["current_context", "launch_kernel"]  # the usual torch case: nothing else


def test_plain_cai_pointers_ask_the_driver_for_their_device(fake8):
    _, _, dx, dy = _axpy(fake8, 6)
    pykern.launch("pktest_axpy", 2, 256, dy, dx, 2.0, 300, backend="nvrtc")
    assert [c[1][0] for c in fake8.calls if c[0] == "pointer_device"] == [dy.ptr, dx.ptr]
    # a pointer the driver does not know is named
    bogus = types.SimpleNamespace(__cuda_array_interface__={"shape": (300,), "typestr": "<f4",
                                                            "data": (0x1234, False), "version": 3})
    with pytest.raises(ArgumentError, match=r"argument 1 \(const float\* x\): expected device memory, got pointer "
                                            r"0x1234"):
        pykern.launch("pktest_axpy", 2, 256, dy, bogus, 2.0, 300, backend="nvrtc")


def test_device_views_take_the_device_of_their_tensor(fake8):
    """What the launcher makes of a torch CUDA tensor: its get_device(), no driver query."""
    x, y, dx, dy = _axpy(fake8, 3)

    class Tensor:  # a stand-in owner with torch's get_device()
        def get_device(self) -> int:
            return 3

    vx = arrays.DeviceView(dx.ptr, (300,), "<f4", Tensor())
    vy = arrays.DeviceView(dy.ptr, (300,), "<f4", Tensor())
    pykern.launch("pktest_axpy", 2, 256, vy, vx, 2.0, 300, backend="nvrtc")
    assert "pointer_device" not in fake8.names()
    assert fake8.call_contexts[fake8.names().index("launch_kernel")] == _ctx(3)
    np.testing.assert_array_equal(dy.copy_to_host(), np.float32(2.0) * x + y)


def test_two_archs_in_one_box_get_their_own_cubins(compiled, monkeypatch):
    sm90 = compile_test_kernels("sm_90")
    drv = FakeDriver(devices=2, device_cc={0: (8, 0), 1: (9, 0)}, device_max_shared={1: 227 * 1024},
                     simulate=dict(make_fake(compiled)[0].simulate))
    drv.register(compiled.image, compiled.ptx, "sm_80")
    drv.register(sm90.image, sm90.ptx, "sm_90")
    mods = {a: StubModule(c.image, hashlib.sha256(c.image).hexdigest()) for a, c in (("sm_80", compiled),
                                                                                     ("sm_90", sm90))}
    asked = []

    def get_module(source, arch, kernel=None):
        assert Path(source).resolve() == TEST_SOURCE
        asked.append(arch)
        return mods[arch]

    be = _install(monkeypatch, drv, get_module, supported=("sm_80", "sm_90"))
    for device in (0, 1):
        src, out = np.arange(256, dtype=np.float32), np.zeros(256, np.float32)
        pykern.launch("pktest_smem_reverse", 2, 128, out, src, 256, shared_mem=100 * 1024, backend="nvrtc",
                      device=device)
        assert out[:128].tolist() == src[:128][::-1].tolist()
    assert asked == ["sm_80", "sm_90"]
    assert [be._devs[d].arch for d in (0, 1)] == ["sm_80", "sm_90"]
    # the per-device shared-memory limit: 200 KB fits the H100, not the A100
    src, out = np.arange(256, dtype=np.float32), np.zeros(256, np.float32)
    pykern.launch("pktest_smem_reverse", 2, 128, out, src, 256, shared_mem=200 * 1024, backend="nvrtc", device=1)
    with pytest.raises(ArgumentError, match=r"expected at most 166912 bytes .* \(device 0, sm_80\)"):
        pykern.launch("pktest_smem_reverse", 2, 128, out, src, 256, shared_mem=200 * 1024, backend="nvrtc",
                      device=0)
    # and the fake refuses an sm_80 cubin on the sm_90 device
    drv.set_current(_ctx(1))
    with pytest.raises(DriverError, match="CUDA_ERROR_NO_BINARY_FOR_GPU"):
        drv.module_load_data(compiled.image)


# -- meta tensors and the ops' device checks --------------------------------------------------------


def test_meta_tensor_raises_naming_the_argument():
    torch = pytest.importorskip("torch")
    x, w = torch.randn(4, 64, device="meta"), torch.randn(64)
    with pytest.raises(ArgumentTypeError, match="x: expected a CPU or CUDA tensor, got one on the meta device"):
        ops.rms_norm(x, w, backend="host")
    with pytest.raises(ArgumentTypeError, match="weight: expected a CPU or CUDA tensor, got one on the meta"):
        ops.rms_norm(torch.randn(4, 64), weight=torch.randn(64, device="meta"), backend="host")
    with pytest.raises(ArgumentTypeError, match=r"argument 0 \(float\* y\): expected a CPU or CUDA tensor, got one "
                                                r"on meta"):
        pykern.launch("pktest_axpy", 1, 8, torch.zeros(8, device="meta"), np.ones(8, np.float32), 1.0, 8,
                      backend="host")


def test_meta_input_raises_before_anything_is_allocated(monkeypatch):
    torch = pytest.importorskip("torch")

    def no_alloc(*a, **k):
        raise AssertionError("an output was allocated for a meta input")

    monkeypatch.setattr(arrays, "empty", no_alloc)
    monkeypatch.setattr(arrays, "zeros", no_alloc)
    with pytest.raises(ArgumentTypeError, match="up: expected a CPU or CUDA tensor, got one on the meta device"):
        ops.silu_gate(torch.randn(8), torch.randn(8, device="meta"), backend="host")


class _CupyArray:
    """A CuPy-like device array (module "cupy", .device.id, CAI) for the device checks."""

    __module__ = "cupy"

    def __init__(self, device: int) -> None:
        self.device = types.SimpleNamespace(id=device)
        self.__cuda_array_interface__ = {"shape": (8,), "typestr": "<f4", "data": (0x1000 * (device + 1), False),
                                         "version": 3}


def test_op_with_arrays_on_two_devices_raises_naming_both(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    with pytest.raises(ArgumentError, match=r"up: expected the device of gate \(cuda:0\), got an array on cuda:3"):
        ops.silu_gate(_CupyArray(0), _CupyArray(3))
    with pytest.raises(ArgumentError, match=r"up: expected the device of gate \(cuda:1\), got an array on cuda:2"):
        ops.silu_gate(gate=_CupyArray(1), up=_CupyArray(2))
    with pytest.raises(ArgumentError, match=r"out: expected the device of gate \(cuda:1\), got an array on cuda:0"):
        ops.silu_gate(_CupyArray(1), _CupyArray(1), out=_CupyArray(0))


def _cuda_tensor_type(torch, index: int):
    """A torch.Tensor that says it lives on cuda:index (this torch has no CUDA to make a real one)."""

    class CudaLike(torch.Tensor):
        @property
        def device(self):  # noqa: D401
            return torch.device("cuda", index)

        @property
        def is_cuda(self):
            return True

        def get_device(self):
            return index

    return CudaLike


def test_stream_scoped_sees_tensors_passed_by_keyword(monkeypatch):
    """flash_attention(q=..., k=..., v=..., stream=s): the workspaces must come from s's pool too."""
    torch = pytest.importorskip("torch")
    t = torch.zeros(4).as_subclass(_cuda_tensor_type(torch, 1))
    assert isinstance(t, torch.Tensor) and t.device == torch.device("cuda", 1)
    entered = []

    class External:
        def __init__(self, handle, device=None):
            self.handle, self.device = handle, device

    @contextlib.contextmanager
    def stream_ctx(s):
        entered.append((s.handle, s.device))
        yield

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0x11))
    monkeypatch.setattr(torch.cuda, "ExternalStream", External)
    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)

    ran = []

    @arrays.stream_scoped
    def op(q=None, k=None, v=None, *, stream=None):
        ran.append(len(entered))  # how many stream scopes were entered when the body ran
        return q

    assert op(q=t, k=t, v=t, stream=0x22) is t
    assert entered == [(0x22, torch.device("cuda", 1))] and ran == [1]
    op(t, k=t, v=t, stream=0x22)  # positional still works
    assert entered[-1] == (0x22, torch.device("cuda", 1))
    entered.clear()
    op(q=t, stream=0x11)  # already torch's current stream: nothing to enter
    assert entered == []


def test_op_device_of_torch_tensors_and_mixed_torch_devices(monkeypatch):
    torch = pytest.importorskip("torch")
    on1 = torch.zeros(4).as_subclass(_cuda_tensor_type(torch, 1))
    on2 = torch.zeros(4).as_subclass(_cuda_tensor_type(torch, 2))

    def op(q, k, v=None, *, out=None):
        pass

    assert devices.op_device(op, (on1,), {"k": on1, "v": torch.zeros(4)}) == torch.device("cuda", 1)
    assert devices.op_device(op, (torch.zeros(4), np.zeros(4)), {}) is None
    with pytest.raises(ArgumentError, match=r"v: expected the device of k \(cuda:1\), got an array on cuda:2"):
        devices.op_device(op, (torch.zeros(4), on1), {"v": on2})
    with pytest.raises(ArgumentError, match=r"k: expected the device of q \(cuda:2\), got an array on cuda:1"):
        devices.op_device(op, (on2, on1), {})


def test_launch_stream_is_the_arrays_devices_stream(monkeypatch):
    torch = pytest.importorskip("torch")
    t = torch.zeros(4).as_subclass(_cuda_tensor_type(torch, 5))
    asked = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: (asked.append(device), types.SimpleNamespace(cuda_stream=0x55))[1])
    assert arrays.launch_stream(None, t) == 0x55 and asked == [torch.device("cuda", 5)]

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(
        get_current_stream=lambda device_id=-1: (asked.append(device_id), types.SimpleNamespace(ptr=0x66))[1])
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert arrays.launch_stream(None, _CupyArray(3)) == 0x66 and asked[-1] == 3


def test_stream_handle_lives_in_devices_and_is_reexported():
    from pykern.backends import nvrtc

    assert nvrtc.stream_handle is devices.stream_handle
    assert devices.stream_handle(types.SimpleNamespace(cuda_stream=9)) == 9


def test_arrays_does_not_import_the_backends():
    import ast

    tree = ast.parse(Path(arrays.__file__).read_text())
    mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in mods if "backends" in m]


# -- gpucheck --device ------------------------------------------------------------------------------


def test_gpucheck_device_runs_everything_on_that_device(compiled, tmp_path, monkeypatch):
    import json
    import stat

    from pykern import cache
    from pykern.gpucheck import EXIT_OK, checks, cli

    drv, _ = make_fake(compiled, devices=8)
    drv.device_cc = {5: (8, 0)}
    stub = types.SimpleNamespace(image=compiled.image, kernels=compiled.kernels, resources={})
    monkeypatch.setattr(registry, "source_files", lambda: [TEST_SOURCE])
    monkeypatch.setattr(cache, "get_module", lambda src, arch, **kw: stub)
    res = {k: checks.KernelResources(k, 32, 0, 1024, 0, "test") for k in stub.kernels}
    monkeypatch.setattr(checks, "kernel_resources", lambda arch, jobs=0: (dict(res), []))
    monkeypatch.setattr(checks, "recorded_launches", lambda: ({}, []))
    envs = {}

    def difftest(cmd, timeout, env=None):
        envs["difftest"] = env
        return 0, json.dumps({"summary": {"cases": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0},
                              "cases": []}), ""

    def pytest_(cmd, timeout, cwd, env=None):
        envs["pytest"] = env
        return 5, "no tests ran", ""

    def sanitize(cmd, timeout, env=None):
        envs.setdefault("sanitizer", []).append(env)
        return 0, ""

    monkeypatch.setattr(cli, "run_difftest", difftest)
    monkeypatch.setattr(cli, "run_pytest", pytest_)
    exe = tmp_path / "compute-sanitizer"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,GPU-5uuid,6,7")
    out = tmp_path / "rep"
    rc = cli.main(["--out", str(out), "--device", "5", "--sanitizer", str(exe), "--quick", "--jobs", "1",
                   "--skip-bench"], driver_factory=lambda: drv, sanitizer_runner=sanitize)
    doc = json.loads((out / "report.json").read_text())
    assert rc == EXIT_OK, doc["failures"]
    assert doc["device"]["index"] == 5
    # every per-device driver query was about device 5 ...
    per_device = {"compute_capability", "max_shared_per_block_optin", "primary_context", "device_attribute",
                  "device_name", "total_memory"}
    asked = {c[1][0] for c in drv.calls if c[0] in per_device}
    assert asked == {5}
    # ... the modules of the limits step were loaded in its context ...
    loads = [cur for (name, _), cur in zip(drv.calls, drv.call_contexts) if name == "module_load_data"]
    assert loads and set(loads) == {_ctx(5)}
    # ... and the subprocesses see device 5 alone
    assert envs["difftest"]["CUDA_VISIBLE_DEVICES"] == "GPU-5uuid"
    assert envs["pytest"]["CUDA_VISIBLE_DEVICES"] == "GPU-5uuid"
    assert envs["sanitizer"] and {e["CUDA_VISIBLE_DEVICES"] for e in envs["sanitizer"]} == {"GPU-5uuid"}


def test_gpucheck_bench_builds_on_the_device(monkeypatch):
    torch = pytest.importorskip("torch")
    from pykern.gpucheck import benchmarks

    made = []
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: (made.append(("stream", device)), types.SimpleNamespace(cuda_stream=3))[1])
    from pykern.bench import suite

    class Ctx:
        def __init__(self, device):
            made.append(("context", device))

    monkeypatch.setattr(suite, "Context", Ctx)
    monkeypatch.setattr(suite, "workloads", lambda *a: iter(()))
    wl, stream = benchmarks.setup(True, 6)
    assert stream == 3
    next(wl, None)
    assert made[:3] == [("set_device", 6), ("stream", 6), ("context", "cuda:6")]


# -- real GPUs ----------------------------------------------------------------------------------------


def _two_real_gpus():
    try:
        import torch
    except ImportError:
        pytest.skip("needs torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs at least 2 CUDA GPUs")
    ok, why = backends.get_backend("nvrtc").available()
    if not ok:
        pytest.skip(why)
    return torch


def _current_context():
    from cuda.bindings import driver as cu

    err, ctx = cu.cuCtxGetCurrent()
    assert err == cu.CUresult.CUDA_SUCCESS
    return int(ctx)


@pytest.mark.gpu
def test_gpu_op_on_cuda1_equals_cuda0_and_leaves_torch_alone():
    torch = _two_real_gpus()
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(33, 4096, generator=g).cuda(0)
    w0 = torch.randn(4096, generator=g).cuda(0)
    ref = ops.rms_norm(x0, w0, backend="nvrtc")
    torch.cuda.synchronize(0)
    ctx_before = _current_context()
    x1, w1 = x0.to("cuda:1"), w0.to("cuda:1")
    out1 = ops.rms_norm(x1, w1, backend="nvrtc")
    assert out1.device == torch.device("cuda", 1)
    assert torch.cuda.current_device() == 0 and _current_context() == ctx_before
    torch.cuda.synchronize(1)
    same_arch = torch.cuda.get_device_capability(0) == torch.cuda.get_device_capability(1)
    if same_arch:
        assert torch.equal(out1.cpu(), ref.cpu())  # the same cubin on the same data
    else:
        from pykern.tolerance import tolerance

        atol, rtol = tolerance("rms_norm", "f32")
        torch.testing.assert_close(out1.cpu(), ref.cpu(), atol=atol, rtol=rtol)
    # torch's stream on device 1 was used: work queued after it on that stream sees the result
    assert torch.isfinite(out1).all().item()


@pytest.mark.gpu
def test_gpu_mixed_devices_raise_and_numpy_follows_the_current_device():
    torch = _two_real_gpus()
    a, b = torch.ones(8, device="cuda:0"), torch.ones(8, device="cuda:1")
    with pytest.raises(ArgumentError, match=r"up: expected the device of gate \(cuda:0\), got an array on cuda:1"):
        ops.silu_gate(a, b, backend="nvrtc")
    with torch.cuda.device(1):
        ctx = _current_context()
        out = ops.silu_gate(np.ones(8, np.float32), np.ones(8, np.float32), backend="nvrtc")
        assert _current_context() == ctx
    np.testing.assert_allclose(out, np.ones(8) / (1 + np.exp(-1.0)), rtol=1e-6)


def test_array_device_of_each_kind(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    assert devices.array_device(np.zeros(2)) == devices.HOST
    assert devices.array_device(torch.zeros(2)) == devices.HOST
    assert devices.array_device(torch.zeros(2, device="meta")) == devices.META
    assert devices.array_device(torch.zeros(2).as_subclass(_cuda_tensor_type(torch, 4))) == 4
    assert devices.array_device(_CupyArray(6)) == 6
    plain = types.SimpleNamespace(__cuda_array_interface__={"data": (0x10, False)})
    assert devices.array_device(plain) is None  # only the driver can tell
    assert [devices.where(d) for d in (devices.HOST, devices.META, 2)] == ["the host", "meta", "cuda:2"]
