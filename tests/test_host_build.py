"""The host backend's build: compiler errors with .cu file:line, the disk cache, source rewriting."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import pykern
from pykern.backends.host import HostBackend
from pykern.errors import BackendUnavailable, CacheMiss, CompileError
from pykern.host import build
from cache_helpers import FakeStderr

REPO = Path(__file__).resolve().parent.parent

GOOD = textwrap.dedent(
    """\
    #include "pk_common.cuh"
    extern __shared__ float ns_smem[];  // namespace scope: read per use, not at load time

    extern "C" __global__ void pk_b_scale(const float* __restrict__ x, float* y, float a, unsigned int n) {
        extern __shared__ float smem[];
        const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
        smem[threadIdx.x] = i < n ? x[i] : 0.0f;
        __syncthreads();
        if (i < n) y[i] = a * smem[threadIdx.x] + ns_smem[threadIdx.x] * 0.0f;
    }
    """
)


def _write(tmp: Path, name: str, text: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    p = tmp / name
    p.write_text(text)
    return p


def test_compile_error_names_cu_file_and_line(tmp_path: Path) -> None:
    src = _write(tmp_path / "k", "broken.cu", GOOD.replace("a * smem", "a * undefined_name * smem"))
    with pytest.raises(CompileError) as ei:
        HostBackend().library(src)
    e = ei.value
    assert f"{src}:9" in str(e).splitlines()[0]
    assert "undefined_name" in str(e)
    assert "-O2" in e.options and "-fno-strict-aliasing" in e.options
    assert f"{src}:9:" in e.log


def test_no_compiler_is_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    be = HostBackend()
    ok, why = be.available()
    assert not ok and "CXX='/nonexistent/g++'" in why
    with pytest.raises(BackendUnavailable, match="not a working C"):
        build.find_compiler()


def test_launch_through_pykern_with_rewritten_extern_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kdir = tmp_path / "k"
    _write(kdir, "scale.cu", GOOD)
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(kdir))
    x = np.arange(100, dtype=np.float32)
    y = np.zeros_like(x)
    pykern.launch("pk_b_scale", 4, 32, x, y, 2.5, 100, shared_mem=32 * 4, backend="host")
    np.testing.assert_array_equal(y, 2.5 * x)


def test_rewrite_keeps_line_numbers() -> None:
    text = "a\nextern  __shared__ __align__(16)\n  unsigned char raw [ ];\nb\n"
    out = build.rewrite_source("{" + text + "}")
    assert out.count("\n") == text.count("\n")
    assert "unsigned char* const raw = reinterpret_cast<unsigned char*>(pk_dynamic_smem());" in out


def test_cache_hit_and_key_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "cache"))
    src = _write(tmp_path / "k", "scale.cu", GOOD)
    lib1 = HostBackend().library(src)
    assert lib1.path.parent == tmp_path / "cache" / "host"
    mtime = lib1.path.stat().st_mtime_ns
    lib2 = HostBackend().library(src)  # a fresh backend: found on disk, not rebuilt
    assert lib2.path == lib1.path and lib2.path.stat().st_mtime_ns == mtime
    src.write_text(GOOD + "\n// edited\n")
    lib3 = HostBackend().library(src)
    assert lib3.path != lib1.path
    assert not [p for p in lib1.path.parent.iterdir() if p.name.endswith(".tmp")]


def test_disable_jit_turns_a_miss_into_cache_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYKERN_DISABLE_JIT", "1")
    src = _write(tmp_path / "k", "scale.cu", GOOD)
    with pytest.raises(CacheMiss, match="PYKERN_DISABLE_JIT=1"):
        HostBackend().library(src)


def test_concurrent_processes_build_one_library(tmp_path: Path) -> None:
    src = _write(tmp_path / "k", "scale.cu", GOOD)
    env = dict(os.environ, PYKERN_CACHE_DIR=str(tmp_path / "cache"))
    code = (
        "import sys; from pykern.backends.host import HostBackend; "
        f"print(HostBackend().library({str(src)!r}).path)"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1
    files = sorted(p.name for p in (tmp_path / "cache" / "host").iterdir())
    libs = [f for f in files if f.endswith(".so")]
    assert libs == [Path(paths.pop()).name]
    assert not [f for f in files if f.endswith(".tmp")]
    assert len([f for f in files if f.startswith("pk_host_runtime-") and f.endswith(".o")]) == 1


def test_concurrent_processes_run_the_compiler_once(tmp_path: Path) -> None:
    # Two pytest-xdist workers (or precompile jobs) that miss the same library at once: one builds it, the others
    # wait for its lock and load the published file. A compiler that logs each run and takes a second longer
    # keeps the three processes' misses overlapping, so without the lock each of them would run it.
    src = _write(tmp_path / "k", "scale.cu", GOOD)
    log = tmp_path / "cxx.log"
    cxx = tmp_path / "slow-cxx"
    real = build.find_compiler().argv
    cxx.write_text(
        "#!/bin/sh\n"
        'case "$*" in *" -c "*|*.host.cpp*) echo "$*" >> "$PK_CXX_LOG"; sleep 1;; esac\n'
        f'exec {" ".join(real)} "$@"\n'
    )
    cxx.chmod(0o755)
    env = dict(os.environ, PYKERN_CACHE_DIR=str(tmp_path / "cache"), CXX=str(cxx), PK_CXX_LOG=str(log))
    code = (
        "import sys; from pykern.backends.host import HostBackend; "
        f"print(HostBackend().library({str(src)!r}).path)"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({o[0].strip() for o in outs}) == 1
    runs = log.read_text().splitlines()
    assert len([r for r in runs if "pk_host_runtime.cpp" in r]) == 1, runs  # the runtime object: once
    assert len([r for r in runs if ".host.cpp" in r]) == 1, runs  # the kernel library: once
    # the one that built it says so on its stderr; the ones that waited say nothing
    assert sum("scale.cu for the host backend: built" in o[1] for o in outs) == 1, [o[1] for o in outs]
    # no lock file stays behind in the cache folder
    assert not [f.name for f in (tmp_path / "cache" / "host").iterdir() if f.name.endswith(".lock")]


def test_unwritable_cache_dir_falls_back_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(build, "_fallback_dir", None)
    src = _write(tmp_path / "k", "scale.cu", GOOD)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        lib = HostBackend().library(src)
        HostBackend().library(src)
    msgs = [str(x.message) for x in w if "host build cache" in str(x.message)]
    assert len(msgs) == 1 and "unusable" in msgs[0]
    assert lib.path.exists() and not str(lib.path).startswith(str(blocker))


def test_every_kernels_cu_file_compiles() -> None:
    from pykern.sources import KERNELS_DIR

    be = HostBackend()
    files = sorted(KERNELS_DIR.glob("*.cu"))
    assert files
    for f in files:
        lib = be.library(f)
        for spec in pykern.registry.parse_file(f):
            assert lib.fn(spec.name) is not None


def test_edited_kernel_is_picked_up_in_the_same_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Edit the body and the signature between two launches: the launcher must check the new
    # signature and the backend run the new code (a stale spec would pack the old argument list).
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "cache"))
    kdir = tmp_path / "k"
    src = _write(kdir, "edit.cu", GOOD)
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(kdir))
    x = np.arange(100, dtype=np.float32)
    y = np.zeros_like(x)
    pykern.launch("pk_b_scale", 4, 32, x, y, 2.5, 100, shared_mem=32 * 4, backend="host")
    np.testing.assert_array_equal(y, 2.5 * x)
    src.write_text(GOOD.replace("float a, unsigned int n)", "float a, float b, unsigned int n)")
                       .replace("y[i] = a * smem", "y[i] = b + a * smem"))
    pykern.launch("pk_b_scale", 4, 32, x, y, 2.5, 1.0, 100, shared_mem=32 * 4, backend="host")
    np.testing.assert_array_equal(y, 1.0 + 2.5 * x)


@pytest.mark.parametrize("tty", [True, False])
def test_first_build_says_so_on_a_terminal_and_in_a_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               tty: bool) -> None:
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "cache"))
    src = _write(tmp_path / "k", "first_use.cu", GOOD.replace("pk_b_scale", "pk_b_first_use"))
    err = FakeStderr(tty)
    monkeypatch.setattr(sys, "stderr", err)
    lib = HostBackend().library(src)
    assert lib.path.is_file() and lib.path.parent == tmp_path / "cache" / "host"
    if tty:
        assert err.parts[0] == ("pykern: compiling first_use.cu for the host backend (first use of this source; "
                                "`python -m pykern.precompile --host` builds every source ahead of time)...")
        assert err.parts[-1] == "\r\033[K"  # cleared once the library is there
    else:  # a pipe or a log: a whole line as the build starts, one more when it ends (a minute is not silent)
        lines = err.text.splitlines()
        assert lines[0] == ("pykern: compiling first_use.cu for the host backend (first use of this source; "
                            "`python -m pykern.precompile --host` builds every source ahead of time)...")
        assert re.fullmatch(r"pykern: first_use\.cu for the host backend: built in \d+\.\ds", lines[1]), lines
        assert len(lines) == 2 and "\r" not in err.text
    err.parts.clear()
    HostBackend().library(src)  # a cache hit in a fresh backend: nothing to say
    assert err.text == ""


def test_failed_first_build_on_a_terminal_ends_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "cache"))
    src = _write(tmp_path / "k", "first_bad.cu", GOOD.replace("a * smem", "a * undefined_name * smem"))
    err = FakeStderr()
    monkeypatch.setattr(sys, "stderr", err)
    with pytest.raises(CompileError):
        HostBackend().library(src)
    assert err.text.startswith("pykern: compiling first_bad.cu") and err.text.endswith(" failed\n")


# ---- PYKERN_HOST_OPT: the build's -O level ------------------------------------------------
FMA_PROBE = textwrap.dedent(
    """\
    extern "C" __global__ void pk_o_fma(const float* a, const float* b, const float* c, float* y, unsigned int n) {
        const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = a[i] * b[i] + c[i];
    }
    """
)


def test_opt_level_replaces_each_builds_own(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PYKERN_HOST_OPT", "PYKERN_HOST_FMA", "PYKERN_HOST_RACECHECK", "PYKERN_HOST_INITCHECK"):
        monkeypatch.delenv(var, raising=False)
    plain, asan = build.flags(False), build.flags(True)
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    checked = build.flags(False)
    monkeypatch.delenv("PYKERN_HOST_RACECHECK")
    assert "-O2" in plain and "-O1" in asan and "-O1" in checked  # each build's own level when unset

    monkeypatch.setenv("PYKERN_HOST_OPT", "3")
    assert build.flags(False) == tuple("-O3" if f == "-O2" else f for f in plain)
    assert build.flags(True) == tuple("-O3" if f == "-O1" else f for f in asan)
    monkeypatch.setenv("PYKERN_HOST_FMA", "0")
    monkeypatch.setenv("PYKERN_HOST_OPT", "1")
    off = build.flags(False)
    assert "-O1" in off and "-O2" not in off and "-ffp-contract=off" in off and "-fexpensive-optimizations" not in off
    monkeypatch.setenv("PYKERN_HOST_OPT", "0")
    assert "-O0" in build.flags(False)


def test_opt_level_refuses_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYKERN_HOST_FMA", raising=False)
    for bad in ("-O2", "fast", "4"):
        monkeypatch.setenv("PYKERN_HOST_OPT", bad)
        with pytest.raises(pykern.ArgumentError, match=rf"PYKERN_HOST_OPT: expected one of 0, 1, 2, 3 .*got '{bad}'"):
            build.flags(False)
    if "-ffp-contract=fast" in build.fma_flags():
        # at -O0 no compiler pass contracts a*b+c: FMA contraction on and -O0 cannot both hold
        monkeypatch.setenv("PYKERN_HOST_OPT", "0")
        with pytest.raises(pykern.ArgumentError, match=r"PYKERN_HOST_OPT: expected 1, 2 or 3 .*FMA.*got '0'"):
            build.flags(False)


@pytest.mark.skipif("-ffp-contract=fast" not in build.fma_flags(), reason="the host compiler does not contract here")
def test_opt_level_keeps_the_fma_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a*b + c with a = b = 1 + 2^-12, c = -(1 + 2^-11): the product rounds to 1 + 2^-11 (a tie, to even) and the
    # sum to 0; fused, the exact product's 2^-24 survives. So the result says whether the build contracted.
    # the run's cache: the -O2 runtime objects and the FMA-off -O1 one are those of the other host tests
    src = _write(tmp_path / "k", "ofma.cu", FMA_PROBE)
    a = np.full(4, 1 + 2.0**-12, np.float32)
    c = np.full(4, -(1 + 2.0**-11), np.float32)

    def run(fma: str, opt: str | None) -> float:
        monkeypatch.setenv("PYKERN_HOST_FMA", fma)
        if opt is None:
            monkeypatch.delenv("PYKERN_HOST_OPT", raising=False)
        else:
            monkeypatch.setenv("PYKERN_HOST_OPT", opt)
        y = np.zeros(4, np.float32)
        pykern.launch("pk_o_fma", (1,), (4,), a, a, c, y, 4, backend="host")
        assert len(set(y.tolist())) == 1, y
        return float(y[0])

    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(src.parent))
    assert run("1", None) == 2.0**-24  # the default -O2 build contracts, as NVRTC does
    assert run("1", "1") == 2.0**-24  # -O1 keeps the contraction (-fexpensive-optimizations)
    assert run("0", None) == 0.0
    assert run("0", "1") == 0.0  # the test suite's FMA-off mode: -O1, the same results as -O2
