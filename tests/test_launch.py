"""`pykern.launch` against the real registry (test kernels joined through PYKERN_KERNEL_PATH):
every bad argument or geometry is rejected, naming the argument, the expected and the actual value,
before anything reaches a backend (the nvrtc backend over the recording fake driver)."""
from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper modules beside this file

import pykern  # noqa: E402
from pykern import backends  # noqa: E402
from pykern.backends.nvrtc import NvrtcBackend  # noqa: E402
from pykern.errors import ArgumentError, ArgumentTypeError, KernelNotFound  # noqa: E402

from fake_driver import LAUNCH_CU, compile_test_kernels, make_fake  # noqa: E402

AXPY = "pktest_axpy"  # (float* y, const float* x, float a, unsigned int n)
ALL = "pktest_all_types"  # (double* out, char, unsigned char, short, unsigned short, int, unsigned int,
#                             long long, unsigned long long, float, double, bool, signed char)
ALL_OK = [-1, 1, -1, 1, -1, 1, -1, 1, 1.0, 1.0, False, -1]


@pytest.fixture(scope="module")
def compiled():
    return compile_test_kernels("sm_80")


@pytest.fixture(autouse=True)
def fake(compiled, monkeypatch):
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(LAUNCH_CU))
    drv, get_module = make_fake(compiled)
    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=lambda: ("sm_80",))
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    yield drv
    # Whatever a test did, nothing may stay allocated on the (fake) device.
    assert drv.memory == {}


def arrays(n=8):
    return np.zeros(n, np.float32), np.ones(n, np.float32)


def launch(*args, **kw):
    kw.setdefault("backend", "nvrtc")
    return pykern.launch(*args, **kw)


def rejected(fake, exc, pattern, *args, **kw):
    with pytest.raises(exc, match=pattern):
        launch(*args, **kw)
    assert fake.launches == [] and "mem_alloc" not in fake.names(), "a rejected launch reached the driver"


# -- the happy path, so the rejections below are of otherwise-valid calls ---------------


def test_valid_launch_runs(fake):
    y, x = arrays()
    launch(AXPY, 1, 32, y, x, 2.0, 8)
    assert y.tolist() == [2.0] * 8
    out = np.zeros(12)
    launch(ALL, 1, 1, out, *ALL_OK)
    assert out.tolist() == [float(v) for v in ALL_OK]


def test_test_kernels_join_the_registry():
    names = {k.name for k in pykern.kernels()}
    assert {AXPY, ALL, "pktest_smem_reverse", "pktest_copy_u16"} <= names
    spec = next(k for k in pykern.kernels() if k.name == AXPY)
    assert [(p.name, p.ctype) for p in spec.params] == [
        ("y", "float*"), ("x", "const float*"), ("a", "float"), ("n", "unsigned int")
    ]


# -- arrays -----------------------------------------------------------------------------


def test_dtype_mismatch(fake):
    y, x = arrays()
    rejected(fake, ArgumentTypeError, r"argument 1 \(const float\* x\): expected a float32 array, got dtype float64",
             AXPY, 1, 32, y, x.astype(np.float64), 1.0, 8)
    rejected(fake, ArgumentTypeError, r"argument 0 \(float\* y\): expected a float32 array, got dtype int32",
             AXPY, 1, 32, y.astype(np.int32), x, 1.0, 8)


def test_bf16_travels_as_unsigned_short_and_f16_does_not(fake):
    a = np.zeros(4, ml_dtypes.bfloat16)
    launch("pktest_copy_u16", 1, 32, a, np.ones(4, ml_dtypes.bfloat16), 4)
    assert a.astype(np.float32).tolist() == [1.0] * 4
    rejected_args = ("pktest_copy_u16", 1, 32, np.zeros(4, np.float16), a, 4)
    fake.launches.clear()
    fake.calls.clear()
    rejected(fake, ArgumentTypeError, r"argument 0 \(unsigned short\* out\): expected a uint16 or bfloat16 array, "
             r"got dtype float16", *rejected_args)


def test_non_contiguous(fake):
    y, _ = arrays()
    x = np.ones(16, np.float32)[::2]
    rejected(fake, ArgumentError, r"argument 1 \(const float\* x\): expected a C-contiguous array, got strides \(8,\)",
             AXPY, 1, 32, y, x, 1.0, 8)
    y2 = np.zeros((8, 2), np.float32).T
    rejected(fake, ArgumentError, r"argument 0 \(float\* y\): expected a C-contiguous array",
             AXPY, 1, 32, y2, x.copy(), 1.0, 8)


def test_read_only_output(fake):
    y, x = arrays()
    y.setflags(write=False)
    rejected(fake, ArgumentError, r"argument 0 \(float\* y\): the kernel writes here but the array is read-only",
             AXPY, 1, 32, y, x, 1.0, 8)


def test_read_only_input_is_fine(fake):
    y, x = arrays()
    x.setflags(write=False)
    launch(AXPY, 1, 32, y, x, 1.0, 8)
    assert y.tolist() == [1.0] * 8


def test_device_array_rejections(fake):
    y, x = arrays()
    dy = fake.device_array(y)
    dx = fake.device_array(x.astype(np.float64))
    rejected(fake, ArgumentTypeError, r"argument 1 \(const float\* x\): expected a float32 array, got typestr '<f8'",
             AXPY, 1, 32, dy, dx, 1.0, 8)
    ro = fake.device_array(y, readonly=True)
    rejected(fake, ArgumentError, r"argument 0 \(float\* y\): the kernel writes here but the array is read-only",
             AXPY, 1, 32, ro, fake.device_array(x), 1.0, 8)

    class Strided:
        __cuda_array_interface__ = {"shape": (8,), "typestr": "<f4", "data": (dy.ptr, False), "version": 3,
                                    "strides": (8,)}

    rejected(fake, ArgumentError, r"argument 0 \(float\* y\): expected a C-contiguous array, got strides \(8,\)",
             AXPY, 1, 32, Strided(), fake.device_array(x), 1.0, 8)
    for ptr in list(fake.memory):
        fake.mem_free(ptr)  # the fixture checks that nothing stays allocated


def test_not_an_array(fake):
    _, x = arrays()
    rejected(fake, ArgumentTypeError, r"argument 0 \(float\* y\): expected an array .* got list",
             AXPY, 1, 32, [0.0] * 8, x, 1.0, 8)
    rejected(fake, ArgumentTypeError, r"argument 0 \(float\* y\): expected an array .* got float",
             AXPY, 1, 32, 1.0, x, 1.0, 8)


# -- scalars ----------------------------------------------------------------------------


def test_negative_into_unsigned(fake):
    y, x = arrays()
    rejected(fake, ArgumentError, r"argument 3 \(unsigned int n\): expected 0 <= value <= 4294967295, got -1",
             AXPY, 1, 32, y, x, 1.0, -1)
    out = np.zeros(12)
    bad = list(ALL_OK)
    bad[1] = -1  # unsigned char
    rejected(fake, ArgumentError, r"argument 2 \(unsigned char uc\): expected 0 <= value <= 255, got -1",
             ALL, 1, 1, out, *bad)
    bad = list(ALL_OK)
    bad[7] = -5  # unsigned long long
    rejected(fake, ArgumentError,
             r"argument 8 \(unsigned long long ull\): expected 0 <= value <= 18446744073709551615, got -5",
             ALL, 1, 1, out, *bad)


@pytest.mark.parametrize(
    "index, value, pattern",
    [
        (0, 128, r"argument 1 \(char c\): expected -128 <= value <= 127, got 128"),
        (2, -32769, r"argument 3 \(short s\): expected -32768 <= value <= 32767, got -32769"),
        (3, 65536, r"argument 4 \(unsigned short us\): expected 0 <= value <= 65535, got 65536"),
        (4, 2**31, r"argument 5 \(int i\): expected -2147483648 <= value <= 2147483647, got 2147483648"),
        (5, 2**32, r"argument 6 \(unsigned int ui\): expected 0 <= value <= 4294967295, got 4294967296"),
        (6, -(2**63) - 1, r"argument 7 \(long long ll\): expected -9223372036854775808 <= value"),
        (7, 2**64, r"argument 8 \(unsigned long long ull\): expected 0 <= value <= 18446744073709551615, "
                   r"got 18446744073709551616"),
        (11, -129, r"argument 12 \(signed char sc\): expected -128 <= value <= 127, got -129"),
        (8, 1e39, r"argument 9 \(float f\): 1e\+39 overflows float"),
        # An int beyond any float: the launcher's error, not Python's OverflowError from float().
        (8, 10**400, r"argument 9 \(float f\): expected -3.40\d*e\+38 <= value <= 3.40\d*e\+38, got 1000"),
        (9, -(10**400), r"argument 10 \(double d\): expected a value a double can hold, got -1000"),
    ],
)
def test_out_of_range(fake, index, value, pattern):
    bad = list(ALL_OK)
    bad[index] = value
    rejected(fake, ArgumentError, pattern, ALL, 1, 1, np.zeros(12), *bad)


def test_numpy_integer_out_of_range(fake):
    y, x = arrays()
    rejected(fake, ArgumentError, r"argument 3 \(unsigned int n\): expected 0 <= value <= 4294967295, got -3",
             AXPY, 1, 32, y, x, 1.0, np.int64(-3))


def test_float_into_int(fake):
    y, x = arrays()
    rejected(fake, ArgumentTypeError, r"argument 3 \(unsigned int n\): expected an integer, got float 8.0",
             AXPY, 1, 32, y, x, 1.0, 8.0)
    rejected(fake, ArgumentTypeError, r"argument 3 \(unsigned int n\): expected an integer, got float32 ",
             AXPY, 1, 32, y, x, 1.0, np.float32(8))
    rejected(fake, ArgumentTypeError, r"argument 3 \(unsigned int n\): expected an integer, got bool True",
             AXPY, 1, 32, y, x, 1.0, True)


def test_non_number_into_float_and_bool(fake):
    y, x = arrays()
    rejected(fake, ArgumentTypeError, r"argument 2 \(float a\): expected a real number, got str '1'",
             AXPY, 1, 32, y, x, "1", 8)
    bad = list(ALL_OK)
    bad[10] = 1  # bool takes a bool, not an int
    rejected(fake, ArgumentTypeError, r"argument 11 \(bool b\): expected a bool, got int 1",
             ALL, 1, 1, np.zeros(12), *bad)


def test_int_into_float_is_converted(fake):
    y, x = arrays()
    launch(AXPY, 1, 32, y, x, 3, 8)
    assert y.tolist() == [3.0] * 8


def test_wrong_argument_count(fake):
    y, x = arrays()
    sig = r"\(float\* y, const float\* x, float a, unsigned int n\)"
    rejected(fake, ArgumentTypeError, rf"pktest_axpy: expected 4 arguments {sig}, got 3", AXPY, 1, 32, y, x, 1.0)
    rejected(fake, ArgumentTypeError, rf"pktest_axpy: expected 4 arguments {sig}, got 5", AXPY, 1, 32, y, x, 1.0, 8, 9)


def test_unknown_kernel(fake):
    rejected(fake, KernelNotFound, r"no kernel named 'pktest_nope'", "pktest_nope", 1, 1)


# -- geometry ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grid, block, smem, exc, pattern",
    [
        ((1, 65536), 32, 0, ArgumentError, r"grid\[1\]: expected 1 <= value <= 65535, got 65536"),
        ((1, 1, 65536), 32, 0, ArgumentError, r"grid\[2\]: expected 1 <= value <= 65535, got 65536"),
        (2**31, 32, 0, ArgumentError, r"grid\[0\]: expected 1 <= value <= 2147483647, got 2147483648"),
        (0, 32, 0, ArgumentError, r"grid\[0\]: expected 1 <= value <= 2147483647, got 0"),
        ((1, 1, 1, 1), 32, 0, ArgumentTypeError,
         r"grid: expected an int or a tuple of 1 to 3 ints, got \(1, 1, 1, 1\)"),
        (1.0, 32, 0, ArgumentTypeError, r"grid: expected an int or a tuple of 1 to 3 ints, got 1.0"),
        ((2, 2.0), 32, 0, ArgumentTypeError, r"grid\[1\]: expected an int, got float 2.0"),
        (1, 1025, 0, ArgumentError, r"block\[0\]: expected 1 <= value <= 1024, got 1025"),
        (1, (1, 1, 65), 0, ArgumentError, r"block\[2\]: expected 1 <= value <= 64, got 65"),
        (1, (32, 32, 2), 0, ArgumentError, r"block: expected at most 1024 threads, got \(32, 32, 2\) = 2048"),
        (1, 32, -1, ArgumentError, r"shared_mem: expected 0 <= bytes <= 232448, got -1"),
        (1, 32, 232449, ArgumentError, r"shared_mem: expected 0 <= bytes <= 232448, got 232449"),
        (1, 32, 1.5, ArgumentTypeError, r"shared_mem: expected an int, got float"),
    ],
)
def test_geometry_limits(fake, grid, block, smem, exc, pattern):
    y, x = arrays()
    rejected(fake, exc, pattern, AXPY, grid, block, y, x, 1.0, 8, shared_mem=smem)


def test_geometry_edges_accepted(fake):
    y, x = arrays()
    launch(AXPY, (1, 65535, 1), (1024, 1, 1), y, x, 1.0, 8)
    launch(AXPY, np.int64(1), (8, 8, 16), y, x, 1.0, 8, shared_mem=np.int32(0))
    assert [ln.grid for ln in fake.launches] == [(1, 65535, 1), (1, 1, 1)]
    assert [ln.block for ln in fake.launches] == [(1024, 1, 1), (8, 8, 16)]


def test_device_shared_limit_is_the_backends_check(fake):
    # Under the launcher's cap but over this (fake sm_80) device's opt-in limit.
    n = 8
    rejected(fake, ArgumentError,
             r"shared_mem: expected at most 166912 bytes for pktest_smem_reverse on this device \(sm_80\), got 200000",
             "pktest_smem_reverse", 1, 8, np.zeros(n, np.float32), np.ones(n, np.float32), n, shared_mem=200_000)


# -- backend choice ---------------------------------------------------------------------


def test_pykern_backend_env_picks_the_backend(fake, monkeypatch):
    y, x = arrays()
    monkeypatch.setenv("PYKERN_BACKEND", "nvrtc")
    pykern.launch(AXPY, 1, 32, y, x, 2.0, 8)  # no backend=: the variable decides
    assert len(fake.launches) == 1 and y.tolist() == [2.0] * 8
    monkeypatch.setenv("PYKERN_BACKEND", "host")
    assert backends.get_backend().name == "host"
    assert backends.get_backend("nvrtc").name == "nvrtc"  # an explicit backend= wins over the variable


def test_bad_pykern_backend_names_the_variable(fake, monkeypatch):
    monkeypatch.setenv("PYKERN_BACKEND", "cuda")
    y, x = arrays()
    with pytest.raises(ArgumentError, match=r"^PYKERN_BACKEND: expected one of nvrtc, numba, host, got 'cuda'"):
        pykern.launch(AXPY, 1, 32, y, x, 1.0, 8)
    with pytest.raises(ArgumentError, match=r"^backend: expected one of nvrtc, numba, host, got 'gpu'"):
        pykern.launch(AXPY, 1, 32, y, x, 1.0, 8, backend="gpu")
    assert fake.launches == []


def test_default_backend_without_a_gpu_is_host():
    import subprocess

    code = (
        "import os; os.environ.pop('PYKERN_BACKEND', None)\n"
        "from pykern.backends import get_backend, numba as nb\n"
        "if nb.probe_gpu()[0]: print('gpu')\n"
        "else: print(get_backend().name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "gpu":
        pytest.skip("a GPU is usable here")
    assert out.stdout.strip() == "host"
