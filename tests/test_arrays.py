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
