from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pykern import arrays
from pykern.errors import ArgumentError, ArgumentTypeError


def test_numpy_outputs():
    out = arrays.empty((2, 3), "bf16")
    assert out.shape == (2, 3) and out.dtype.name == "bfloat16"
    z = arrays.zeros((4,), np.float32, like=np.ones(1, np.float32))
    assert z.dtype == np.float32 and not z.any()


def test_numba_device_arrays_get_numba_outputs():
    # Run in a child: the simulator must be chosen before numba.cuda is imported.
    code = (
        "import numpy as np\n"
        "from numba import cuda\n"
        "from pykern import arrays\n"
        "like = cuda.to_device(np.ones(3, np.float32))\n"
        "e = arrays.empty((2, 5), 'bf16', like=like)\n"
        "z = arrays.zeros((4,), np.float32, like=like)\n"
        "assert type(e).__module__.startswith('numba.'), type(e)\n"
        "assert e.shape == (2, 5) and e.dtype == np.uint16, (e.shape, e.dtype)\n"
        "assert z.shape == (4,) and not z.copy_to_host().any()\n"
        "print('ok')\n"
    )
    env = {"NUMBA_ENABLE_CUDASIM": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_unknown_array_kind_is_a_type_error():
    class Foreign:
        pass

    with pytest.raises(ArgumentTypeError, match="Foreign"):
        arrays.empty((1,), np.float32, like=Foreign())


def test_size_and_u32_checks():
    assert arrays.size((3, 0, 7)) == 0 and arrays.size(()) == 1
    assert arrays.size((2**20, 2**20)) == 2**40
    arrays.check_u32("dim", 2**32 - 1)
    with pytest.raises(ArgumentError, match=r"dim: expected at most 4294967295, got 4294967296"):
        arrays.check_u32("dim", 2**32)
    with pytest.raises(ArgumentTypeError, match=r"b: expected the dtype of a \(f32\), got bf16"):
        arrays.same_kind("b", np.zeros(1, arrays.bfloat16()), "f32", "a")


def test_dtype_names_are_numpys_and_resolved_spellings_are_the_same_dtype():
    # The launcher and dtype_name look names up by dtype object (NumPy computes .name in Python on every access);
    # the lookup must agree with NumPy for every dtype arrays come in, ml_dtypes' included, and the cached
    # spellings of _resolve must be the dtypes NumPy would build.
    import ml_dtypes

    dts = [np.dtype(t) for t in ("float32", "float64", "float16", "int32", "int64", "uint32", "uint64", "uint8",
                                 "int8", "bool")]
    dts += [np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)]
    for dt in dts:
        assert arrays.np_dtype_name(dt) == dt.name
        assert arrays.dtype_name(np.zeros(2, dt)) == dt.name
        assert arrays.np_dtype_name(dt) == dt.name  # cached now
    bf16 = np.dtype(ml_dtypes.bfloat16)
    for spelling, want in (("f32", np.float32), ("f16", np.float16), ("bf16", bf16), ("bfloat16", bf16),
                           ("int32", np.int32), ("uint8", np.uint8)):
        for _ in range(2):  # the second from the cache
            assert arrays.empty((1,), spelling).dtype == np.dtype(want), spelling
    with pytest.raises(TypeError):
        arrays.empty((1,), "no_such_dtype")


def test_to_like_places_a_host_array_where_another_array_lives():
    host = np.array([3, 1, 2], np.int32)
    assert arrays.to_like(host, np.zeros(1)) is host  # NumPy stays NumPy, no copy
    assert arrays.to_like(host, None) is host

    class Foreign:
        __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (0, False), "version": 3}

    with pytest.raises(ArgumentTypeError, match="Foreign"):
        arrays.to_like(host, Foreign())


def test_to_like_and_arange_like_on_torch_keep_values_dtype_and_device():
    torch = pytest.importorskip("torch")
    like = torch.zeros(1)
    t = arrays.to_like(np.array([7, 2**32 - 1], np.uint32), like)
    assert isinstance(t, torch.Tensor) and t.device == like.device
    assert arrays.host_view(t).tolist() == [7, 2**32 - 1]
    r = arrays.arange_like(4, "int32", like)
    assert r.dtype == torch.int32 and r.tolist() == [0, 1, 2, 3]
    assert arrays.memory_key(like) == like.device and arrays.memory_key(np.ones(1)) == "host"
    assert arrays.view_bool(torch.tensor([0, 1], dtype=torch.uint8)).tolist() == [False, True]


def test_arange_fill_zero_view_bool_and_flat_view_on_numpy():
    assert arrays.arange_like(3, "int32", np.zeros(1)).tolist() == [0, 1, 2]
    a = np.ones((2, 3), np.float32)
    assert arrays.fill_zero(a) is a and not a.any()
    assert arrays.view_bool(np.array([0, 1], np.uint8)).tolist() == [False, True]
    assert arrays.flat_view(np.ones((2, 3))).shape == (6,)


def test_in_place_refuses_a_copy_or_a_read_only_array():
    a = np.ones((4, 4), np.float32)
    assert arrays.in_place("x", a) is a
    with pytest.raises(ArgumentError, match="x: inplace=True needs a contiguous array"):
        arrays.in_place("x", a[:, ::2])
    ro = np.ones(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ArgumentError, match="residual: inplace=True needs a writeable array"):
        arrays.in_place("residual", ro)


def test_framework_names_the_library_an_op_composes_calls_in():
    assert arrays.framework(np.ones(2)) == ("numpy", np)
    torch = pytest.importorskip("torch")
    assert arrays.framework(torch.ones(2)) == ("torch", torch)


def test_host_array_view_reads_only_numpy_and_cpu_tensors():
    a = np.arange(3)
    assert arrays.host_array_view(a) is a

    class Stand_in:  # an array-like with no __cuda_array_interface__ (as the numba simulator's device arrays)
        def astype(self, dt):
            return self

    assert arrays.host_array_view(Stand_in()) is None
    torch = pytest.importorskip("torch")
    assert arrays.host_array_view(torch.arange(3)).tolist() == [0, 1, 2]
