"""The host backend's sanitizer build (PYKERN_HOST_SANITIZE=1: AddressSanitizer + UBSan).

ASan must be the first library loaded, so these run Python in a subprocess through
`pykern.backends.host.run_sanitized`, which preloads it.
"""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np
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


# Every registered kernel's difftest cases (all but the "big" ones) on the sanitized host
# backend, compared with the NumPy reference within the tolerance table.
_ALL_CASES = """
import sys
from pykern.backends import get_backend
from pykern.difftest import runner
get_backend("host").prebuild()  # compile the ASan builds in parallel first
cases = [c for c in runner.collect_cases(seed=0) if c.note != "big"]
label = runner.parse_label("host")
bad, kernels = [], set()
for case in cases:
    res = runner.run_case(case, [label])
    kernels.update(case.kernels)
    if not res.passed:
        bad.append(f"{case.id}: {res.failures()}")
print(f"SANITIZED {len(cases)} cases, {len(kernels)} kernels, {len(bad)} failed", flush=True)
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""


def test_every_kernel_case_runs_clean_under_the_sanitizer() -> None:
    from pykern.difftest import runner

    if not runner.collect_cases(seed=0):
        pytest.skip("no difftest cases registered yet")
    rc, out, err = _run(_ALL_CASES, timeout=900)
    assert rc == 0, out + err[-6000:]
    assert "SANITIZED" in out
    n_cases = int(out.split("SANITIZED")[1].split("cases,")[0])
    assert n_cases > 0
