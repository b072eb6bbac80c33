"""The host backend's sanitizer build (PYKERN_HOST_SANITIZE=1: AddressSanitizer + UBSan).

ASan must be the first library loaded, so these run Python in a subprocess through
`pykern.backends.host.run_sanitized`, which preloads it.
"""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from pykern.backends.host import HostBackend, run_sanitized, sanitizer_preload
from pykern.errors import BackendUnavailable

REPO = Path(__file__).resolve().parent.parent
HOST_KERNELS = REPO / "tests" / "host_kernels"

pytestmark = pytest.mark.skipif(sanitizer_preload() is None, reason="the C++ compiler ships no libasan.so")


def _run(code: str, timeout: float = 600) -> tuple[int, str, str]:
    env = dict(os.environ, PYKERN_KERNEL_PATH=str(HOST_KERNELS))
    r = run_sanitized(code=textwrap.dedent(code), env=env, cwd=REPO, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def _line_of(marker: str) -> int:
    lines = (HOST_KERNELS / "emu.cu").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if marker in line)


def test_oob_write_is_caught_with_cu_line_kernel_block_and_thread() -> None:
    rc, out, err = _run(
        """
        import numpy as np, pykern
        out = np.zeros(100, np.float32)
        pykern.launch("pk_t_inb", 4, 32, out, 100, backend="host")
        assert (out == 1).all()
        y = np.zeros(32, np.float32)
        pykern.launch("pk_t_alias", 1, 32, y, y, backend="host")  # one array, two params: one copy
        assert (y == 10).all(), y
        print("in-bounds ok", flush=True)
        pykern.launch("pk_t_oob", 4, 32, out, 100, backend="host")
        print("out-of-bounds write NOT caught", flush=True)
        """
    )
    assert "in-bounds ok" in out, err
    assert "NOT caught" not in out
    assert rc == 86, err
    assert "heap-buffer-overflow" in err and "WRITE of size 4" in err
    assert f"emu.cu:{_line_of('if (i <= n) out[i] = 1.0f;')}" in err
    assert "happened in kernel pk_t_oob, block (3,0,0), thread (4,0,0)" in err


def test_oob_dynamic_shared_read_is_caught() -> None:
    rc, out, err = _run(
        """
        import numpy as np, pykern
        out = np.zeros(64, np.float32)
        pykern.launch("pk_t_oob_smem", 1, 64, out, shared_mem=64 * 4, backend="host")
        print("NOT caught", flush=True)
        """
    )
    assert rc == 86 and "NOT caught" not in out, err
    assert "READ of size 4" in err
    assert f"emu.cu:{_line_of('smem[threadIdx.x + 1]')}" in err


def test_undefined_behaviour_is_caught_by_ubsan() -> None:
    rc, out, err = _run(
        """
        import numpy as np, pykern
        out = np.zeros(32, np.int32)
        pykern.launch("pk_t_ub_shift", 1, 32, out, 1, backend="host")
        print("NOT caught", flush=True)
        """
    )
    assert rc != 0 and "NOT caught" not in out, err
    assert "shift exponent" in err and f"emu.cu:{_line_of('1 << (s + (int)threadIdx.x)')}" in err


def test_in_process_sanitize_without_preload_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    if hasattr(ctypes.CDLL(None), "__asan_init"):
        pytest.skip("this process already runs under ASan")
    monkeypatch.setenv("PYKERN_HOST_SANITIZE", "1")
    with pytest.raises(BackendUnavailable, match="run_sanitized"):
        HostBackend().library(HOST_KERNELS / "emu.cu")

# Every kernel's difftest cases under this build: tests/test_difftest.py::test_all_cases_under_sanitizer.


def test_mul24_sad_are_clean_and_float_cast_overflow_is_caught() -> None:
    rc, out, err = _run(
        """
        import numpy as np, pykern
        a = np.array([0x7FFFFFFF, -0x80000000, 0x00800000, -5], np.int32)
        b = np.array([-0x80000000, 0x7FFFFFFF, 0x00800000, 7], np.int32)
        m, s = np.zeros(4, np.int32), np.zeros(4, np.uint32)
        pykern.launch("pk_h_mul24_sad", 1, 32, a, b, m, s, 4, backend="host")
        print("mul24/sad ok", flush=True)
        pykern.launch("pk_h_float_cast", 1, 32, np.array([1.5, 3e9], np.float32), np.zeros(2, np.int32), 2,
                      backend="host")
        print("NOT caught", flush=True)
        """
    )
    assert "mul24/sad ok" in out, err
    assert rc != 0 and "NOT caught" not in out, err
    assert "outside the range of representable values" in err and "hazards.cu:" in err, err
