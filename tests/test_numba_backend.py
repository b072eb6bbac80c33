"""The numba backend: argument conversion, bf16 widen/narrow, write-back, simulator choice and executors."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import pykern
from pykern.backends import get_backend
from pykern.backends.numba import narrow_bf16, widen_bf16
from pykern.difftest import runner

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXTRA = HERE / "difftest_extra"


@pytest.fixture()
def test_kernels(monkeypatch: pytest.MonkeyPatch):
    """The test-only kernels on the kernel path and their references/cases loaded (once per process)."""
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(EXTRA / "cu"))
    runner.load_extra(str(EXTRA / "pk_test.py"))
    return sys.modules[next(m for m in sys.modules if m.startswith("pykern_difftest_extra_pk_test"))]


def test_bf16_widen_is_exact_and_narrow_rounds_to_nearest_even() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([
        rng.standard_normal(5000).astype(np.float32) * 100,
        np.array([0.0, -0.0, np.inf, -np.inf, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38, 1e-40], np.float32),
    ])
    want = x.astype(ml_dtypes.bfloat16)
    got = narrow_bf16(x)
    np.testing.assert_array_equal(got, want.view(np.uint16))
    np.testing.assert_array_equal(widen_bf16(got), want.astype(np.float32))
    nan = narrow_bf16(np.array([np.nan], np.float32))
    assert np.isnan(widen_bf16(nan))[0]
    assert narrow_bf16(np.array([1.0 + 2**-8], np.float32))[0] == 0x3F80  # halfway: to even (down)
    assert narrow_bf16(np.array([1.0 + 3 * 2**-8], np.float32))[0] == 0x3F82  # halfway: to even (up)


def test_launch_converts_and_writes_back(test_kernels) -> None:
    x = np.arange(70, dtype=np.float32)
    y = np.ones(70, np.float32)
    x0 = x.copy()
    # The caller's grid/block are ignored: the reference picks its own.
    pykern.launch("pk_test_axpy", 1, 1, x, y, 0.5, 70, backend="numba")
    np.testing.assert_array_equal(y, 0.5 * x0 + 1)
    np.testing.assert_array_equal(x, x0)  # const input untouched
    xb = x0.reshape(7, 10).astype(ml_dtypes.bfloat16)  # arrays arrive flat whatever their shape
    yb = np.full((7, 10), 3.0, ml_dtypes.bfloat16)
    pykern.launch("pk_test_axpy_bf16", 1, 1, xb, yb, -1.5, 70, backend="numba")
    want = (-1.5 * xb.astype(np.float32) + np.float32(3.0)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(yb.view(np.uint16), want.view(np.uint16))


def test_zero_sized_launch_is_a_no_op(test_kernels) -> None:
    y = np.zeros(0, np.float32)
    pykern.launch("pk_test_axpy", 1, 32, np.zeros(0, np.float32), y, 1.0, 0, backend="numba")


def test_sequential_and_threaded_simulators_agree(test_kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    if not get_backend("numba").simulator:
        pytest.skip("numba runs on a GPU here")
    x = np.random.default_rng(2).standard_normal((9, 40)).astype(np.float32)
    seq = test_kernels.rowsum(x, backend="numba")
    monkeypatch.setenv("PYKERN_NUMBA_SIM", "threads")
    thr = test_kernels.rowsum(x, backend="numba")
    np.testing.assert_array_equal(seq, thr)
    np.testing.assert_allclose(seq, x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)


def test_barrier_kernel_falls_back_to_threaded_simulator() -> None:
    be = get_backend("numba")
    if not be.simulator:
        pytest.skip("numba runs on a GPU here")
    from pykern.backends.numba import _NeedsThreads

    cuda = be.cuda_module()

    @cuda.jit
    def k(x, out):
        buf = cuda.shared.array(32, np.float32)
        t = cuda.threadIdx.x
        buf[t] = x[t]
        cuda.syncthreads()
        out[t] = buf[31 - t]

    x = np.arange(32, dtype=np.float32)
    out = np.zeros(32, np.float32)
    with pytest.raises(_NeedsThreads):
        be._run_sequential(k, ((1,), (32,)), [x.copy(), out.copy()])
    k[1, 32](x, out)  # numba's threaded simulator, through the same cuda proxy
    np.testing.assert_array_equal(out, x[::-1])


def test_missing_reference_names_the_kernel() -> None:
    spec = pykern.registry.KernelSpec("pk_no_such_reference", Path("x.cu"), 1, ())
    with pytest.raises(pykern.BackendUnavailable, match="pk_no_such_reference"):
        get_backend("numba").launch(spec, (1, 1, 1), (1, 1, 1), [], 0, None)


def test_reference_errors_name_kernel_and_thread(test_kernels) -> None:
    if not get_backend("numba").simulator:
        pytest.skip("numba runs on a GPU here")
    # n larger than the arrays: the reference indexes out of bounds, like a bad launch would.
    with pytest.raises(pykern.KernelExecutionError, match=r"pk_test_axpy.*threadIdx=\(4, 0, 0\).*IndexError"):
        pykern.launch("pk_test_axpy", 1, 1, np.zeros(4, np.float32), np.zeros(4, np.float32), 1.0, 5,
                      backend="numba")


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=ROOT,
                          timeout=120)


def test_mode_choice_without_gpu() -> None:
    from pykern.backends.numba import probe_gpu

    if probe_gpu()[0]:
        pytest.skip("a GPU is usable here")
    r = _run(
        "import sys\n"
        "from pykern.backends.numba import create\n"
        "be = create()\n"
        "assert be.on_gpu() is False\n"
        "assert 'numba' not in sys.modules, 'on_gpu must not import numba'\n"
        "assert be.available() == (True, ''), be.available()\n"
        "import numba.cuda\n"
        "assert numba.cuda.jit.__module__.startswith('numba.cuda.simulator')\n"
        "print(be.describe())\n"
    )
    assert r.returncode == 0, r.stderr
    assert "simulator" in r.stdout
    # numba already imported (not numba.cuda): its config is re-read, the simulator still wins.
    r = _run("import numba\nfrom pykern.backends.numba import create\nassert create().available()[0]\n"
             "import numba.cuda\nassert numba.cuda.jit.__module__.startswith('numba.cuda.simulator')\n")
    assert r.returncode == 0, r.stderr


def test_numba_cuda_imported_in_gpu_mode_without_gpu_is_unavailable() -> None:
    from pykern.backends.numba import probe_gpu

    if probe_gpu()[0]:
        pytest.skip("a GPU is usable here")
    r = _run(
        "import numba.cuda, numpy as np, pykern\n"
        "from pykern.backends import get_backend\n"
        "ok, why = get_backend('numba').available()\n"
        "assert not ok and 'NUMBA_ENABLE_CUDASIM=1' in why and 'imported in GPU mode' in why, why\n"
        "try:\n"
        "    pykern.launch('rms_norm', 1, 1, np.zeros(4, np.float32), np.ones(4, np.float32),\n"
        "                  np.zeros(4, np.float32), 1, 4, 1e-6, 0.0, backend='numba')\n"
        "except pykern.BackendUnavailable as e:\n"
        "    print('raised', e)\n"
    )
    assert r.returncode == 0, r.stderr
    assert "raised numba backend:" in r.stdout


def test_default_falls_back_to_numba_on_gpu_with_one_warning() -> None:
    # No GPU here: fake one where nvrtc is unusable but numba could run, and check the default choice.
    r = _run(
        "import warnings\n"
        "import pykern.backends as b\n"
        "from pykern.backends import numba as nb, nvrtc\n"
        "nvrtc.NvrtcBackend.available = lambda self: (False, 'NVRTC library not found')\n"
        "nb.NumbaBackend.on_gpu = lambda self: True\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert b.default_backend_name() == 'numba'\n"
        "    assert b.default_backend_name() == 'numba'\n"
        "msgs = [str(x.message) for x in w]\n"
        "assert len(msgs) == 1 and 'NVRTC library not found' in msgs[0], msgs\n"
    )
    assert r.returncode == 0, r.stderr


def test_gpu_user_is_never_switched_to_the_simulator() -> None:
    # Pretend the driver probe found a GPU: numba.cuda must be imported in GPU mode, the env left alone.
    r = _run(
        "import os, sys\n"
        "import pykern.backends.numba as nb\n"
        "nb.probe_gpu = lambda: (True, '')\n"
        "be = nb.create()\n"
        "assert be.simulator is False\n"
        "be.available()\n"
        "import numba.cuda\n"
        "assert not numba.cuda.jit.__module__.startswith('numba.cuda.simulator')\n"
        "assert 'NUMBA_ENABLE_CUDASIM' not in os.environ\n"
    )
    assert r.returncode == 0, r.stderr


def test_norm_grad_reduce_reference_sums_in_float64() -> None:
    """The reference of the weight-gradient column sum adds the fp32 partial rows in float64 and rounds once, the
    stronger side of its comparison with the kernel (fp32 sums of 32 lanes, then of the lanes): a float32 running
    sum in row order would drop every 2^-24 added to 1.0 (and end at 1.0)."""
    n, dim = 1025, 4
    partial = np.full((n, dim), 2.0**-24, np.float32)
    partial[0] = 1.0
    out = np.zeros(dim, np.float32)
    pykern.launch("norm_grad_reduce", 1, (8, 32), partial.ravel(), out, n, dim, backend="numba")
    want = partial.astype(np.float64).sum(axis=0).astype(np.float32)
    assert want[0] == np.float32(1.0 + 2.0**-14)
    np.testing.assert_array_equal(out, want)
