"""Fleet-safe precompile and cache: interrupts, honest exit codes, one compile per key across
processes, PTX fallback, cache CLI over host builds, registry isolation, no silent CPU fallback, CLIs
without the optional extras."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pykern import cache, precompile
from cache_helpers import CU, JIT_VARS, private_sources

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def env(tmp_path, monkeypatch):
    return private_sources(tmp_path, monkeypatch,
                           unset=(*JIT_VARS, "PYKERN_LOG_LEVEL", "PYKERN_STRICT", "PYKERN_BACKEND"))


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*") if p.is_file())


# ----------------------------------------------------------------------------- 1. interrupts


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a non-interactive shell does to a background job


@pytest.mark.parametrize("sig,code,inherit_ignored", [
    (signal.SIGINT, 130, False), (signal.SIGTERM, 143, False), (signal.SIGINT, 130, True)])
def test_signal_cancels_queued_and_running_compiles(env, tmp_path, sig, code, inherit_ignored):
    # The small test kernels for every arch (~30 short compiles): far from done at the first line.
    # Only the parent is signalled (a CI runner's kill), also when it started with SIGINT ignored.
    from pykern import compiler

    cache_root = tmp_path / "cache"
    total = 2 * len(compiler.expand_archs(["all"]))
    proc = subprocess.Popen([sys.executable, "-m", "pykern.precompile", "--arch", "all", "--kernels", "pkt_*",
                             "--jobs", "2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ignore_sigint if inherit_ignored else None)
    first = proc.stderr.readline()
    while first.startswith("start  "):  # the lines as compiles start come before the first that finished
        first = proc.stderr.readline()
    assert first.startswith(f"[1/{total}]"), first
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    waited = time.monotonic() - t0
    assert proc.returncode == code, err
    assert waited < 5.0, f"took {waited:.1f} s to stop"
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if not ln.startswith(("[", "start  "))]
    assert len(lines) == 1 and f"interrupted by {signal.Signals(sig).name}" in lines[0], err
    assert out == ""  # no table: the run did not finish
    assert _leftovers(cache_root) == []  # no temp files, no lock files
    finished = list(cache.iter_entries(cache_root))
    assert 1 <= len(finished) < total
    for e in finished:  # what is there is whole
        cache.decode_entry(e.path.read_bytes())


def test_interrupt_during_bundle_export_leaves_no_half_bundle(env, tmp_path, monkeypatch, capsys):
    out = tmp_path / "bundle"
    real = cache.export_to_bundle
    calls = []

    def export_then_interrupt(*a, **k):
        calls.append(real(*a, **k))
        if len(calls) == 2:
            raise precompile._Interrupted(signal.SIGTERM)
        return calls[-1]

    monkeypatch.setattr(cache, "export_to_bundle", export_then_interrupt)
    rc = precompile.main(["--arch", "sm_80", "--kernels", "pkt_*", "--jobs", "1", "--out", str(out)])
    assert rc == 143
    assert "interrupted by SIGTERM" in capsys.readouterr().err
    assert len(calls) == 2 and list(out.rglob("*.*")) == []  # neither entries nor a manifest


# ----------------------------------------------------------------------------- 2. honest exit codes


def test_unwritable_cache_fails_naming_the_folder(env, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    root = blocker / "cache"
    rc = precompile.main(["--arch", "sm_80", "--kernels", "pkt_fill", "--jobs", "1", "--cache-dir", str(root)])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"cannot save to the cache folder {root}" in err
    assert "corrupt" not in err


def test_unsaved_compiles_fail_the_run(env, tmp_path, monkeypatch, capsys):
    # The folder passes the probe, then every store fails (a full disk): the run still says so.
    monkeypatch.setattr(cache, "write_atomic", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.warns(cache.CacheWarning):
        rc = precompile.main(["--arch", "sm_80", "--kernels", "pkt_fill", "--jobs", "1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"1 compiled modules could not be saved to the cache folder {tmp_path / 'cache'}" in err


def test_unwritable_out_after_compiling_fails(env, tmp_path, monkeypatch, capsys):
    out = tmp_path / "bundle"

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cache, "export_to_bundle", refuse)
    rc = precompile.main(["--arch", "sm_80", "--kernels", "pkt_fill", "--jobs", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and f"cannot write the bundle folder {out}" in err
    assert not (out / cache.BUNDLE_MANIFEST).exists()


# ----------------------------------------------------------------------------- 6. registry isolation


def test_untypable_kernel_is_skipped_beside_working_ones(tmp_path, monkeypatch):
    from pykern import registry
    from pykern.registry import RegistryWarning

    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "ok.cu").write_text('extern "C" __global__ void pk_ok(float* y) { y[0] = 1.0f; }\n')
    (extra / "odd.cu").write_text(
        'extern "C" __global__ void pk_fine(const float2* a, float4 b, int2 c, uint4 d, bool e, char* f,\n'
        '                                   const unsigned char* g, const __half* h, __nv_bfloat16* k) {}\n'
        '\n'
        'extern "C" __global__ void pk_odd(const MyThing* t, float* y) {}\n')
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(extra))
    monkeypatch.delenv("PYKERN_STRICT", raising=False)
    registry.refresh()
    registry._warned.clear()
    try:
        with pytest.warns(RegistryWarning, match=r"pk_odd.*odd\.cu:4.*MyThing") as rec:
            names = {k.name for k in registry.kernels()}
        assert len([w for w in rec if issubclass(w.category, RegistryWarning)]) == 1
        assert "pk_odd" not in names and {"pk_ok", "pk_fine", "rms_norm"} <= names
        fine = registry.get("pk_fine")
        assert [p.ctype for p in fine.params] == [
            "const float2*", "float4", "int2", "uint4", "bool", "char*", "const unsigned char*",
            "const __half*", "__nv_bfloat16*"]
        # The project's own ops still work (host backend, the CPU path of CI).
        import numpy as np

        import pykern.ops as ops

        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        w = np.ones(3, dtype=np.float32)
        got = ops.rms_norm(x, w, eps=1e-6, backend="host")
        ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        # Strict mode makes the same kernel an error for everyone.
        monkeypatch.setenv("PYKERN_STRICT", "1")
        registry.refresh()
        with pytest.raises(registry.RegistryError, match=r"odd\.cu:4"):
            registry.kernels()
    finally:
        registry.refresh()


def test_project_kernels_are_strict(monkeypatch):
    from pykern import registry
    from pykern.sources import KERNELS_DIR

    for f in sorted(KERNELS_DIR.glob("*.cu")):  # every shipped kernel types without a skip
        assert registry.parse_file(f) == registry.parse_file(f, strict=True)
    assert registry._is_strict(KERNELS_DIR / "forward.cu")


def test_vector_and_16bit_params_match_the_ptx(tmp_path):
    # NVRTC's PTX .entry decides: sizes and alignments of the new types must agree with it.
    from pykern import compiler

    f = tmp_path / "vec.cu"
    # No cuda_fp16.h without a toolkit: the 2-byte structs that header declares stand in for it.
    f.write_text('struct __align__(2) __half { unsigned short x; };\n'
                 'struct __align__(2) __nv_bfloat16 { unsigned short x; };\n'
                 'extern "C" __global__ void pk_vec(const float2* a, float4 b, int2 c, uint4 d, bool e,\n'
                 '    char* f, const unsigned char* g, const __half* h, __nv_bfloat16 k, float3 m, double2 n,\n'
                 '    uchar4 o, short2 p) {}\n')
    mod = compiler.compile(f, "sm_80")  # check_layout raises LayoutMismatch on any disagreement
    assert mod.kernels == ("pk_vec",)


def test_vector_argument_conversion():
    from pykern import launcher
    from pykern.errors import ArgumentTypeError
    from pykern.registry import KernelSpec, Param

    spec = KernelSpec("pk_v", Path("x.cu"), 1, (Param("b", "float4"), Param("c", "int2")))
    b, c = launcher.convert_args(spec, [(1.0, 2.0, 3.0, 4.5), [7, -8]])
    assert (b.x, b.y, b.z, b.w) == (1.0, 2.0, 3.0, 4.5) and (c.x, c.y) == (7, -8)
    with pytest.raises(ArgumentTypeError, match="argument 1 .int2 c.: expected a sequence of 2 int"):
        launcher.convert_args(spec, [(1.0, 2.0, 3.0, 4.0), 3])


def test_kernel_not_found_suggests_the_closest_names():
    from pykern import registry
    from pykern.errors import KernelNotFound

    with pytest.raises(KernelNotFound) as e:
        registry.get("rms_norm_bf61")
    msg = str(e.value)
    assert "did you mean" in msg and "rms_norm_bf16" in msg
    assert len(msg) < 300  # the closest names, not the whole registry


# ----------------------------------------------------------------------------- 3. one compile per key


def test_two_processes_compile_each_key_once(env, tmp_path):
    args = [sys.executable, "-m", "pykern.precompile", "--arch", "sm_80,sm_86", "--kernels", "pkt_*",
            "--jobs", "2", "--json"]
    e = {**os.environ, "PYKERN_LOG_LEVEL": "debug"}
    procs = [subprocess.Popen(args, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    docs = [json.loads(o) for o, _ in outs]
    compiles = sum(err.count("pykern INFO: pykern: compiled ") for _, err in outs)
    assert compiles == 4  # 2 sources x 2 archs, shared by both runs
    assert sum(d["compiled"] for d in docs) == 4 and sum(d["hits"] for d in docs) == 4
    assert _leftovers(tmp_path / "cache") == []


def test_stale_lock_of_a_dead_process_is_broken(env, tmp_path):
    root = tmp_path / "cache"
    key = cache.key_for(env / "pkt_other.cu", "sm_80")
    lock = cache._lock_path(root, key)
    lock.parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    lock.write_text(f"{dead} {cache._hostname()} {time.time()}\n")
    t0 = time.monotonic()
    mod = cache.get_module(env / "pkt_other.cu", "sm_80", cache_root=root)
    assert not mod.hit and mod.path is not None and time.monotonic() - t0 < 10
    assert not lock.exists()


def test_lock_of_a_live_process_is_waited_for_then_given_up(env, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    key = cache.key_for(env / "pkt_other.cu", "sm_80")
    lock = cache._lock_path(root, key)
    lock.parent.mkdir(parents=True)
    lock.write_text(f"{os.getppid()} {cache._hostname()} {time.time()}\n")  # alive, never finishes
    monkeypatch.setenv("PYKERN_LOCK_TIMEOUT", "1")
    t0 = time.monotonic()
    mod = cache.get_module(env / "pkt_other.cu", "sm_80", cache_root=root)
    waited = time.monotonic() - t0
    assert not mod.hit and 1.0 <= waited < 10  # waited the limit, then compiled: never forever
    # An old lock is stale whoever holds it.
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    assert "old" in cache._lock_stale(lock, 600)


# ----------------------------------------------------------------------------- 4. PTX fallback


def test_arch_all_adds_the_newest_ptx():
    from pykern import compiler

    archs = compiler.expand_archs(["all"])
    newest = max(int(a[3:]) for a in compiler.supported_archs())
    assert archs[-1] == f"compute_{newest}" and archs[:-1] == list(compiler.supported_archs())


def test_nvrtc_backend_loads_the_newest_compatible_ptx_once(tmp_path, monkeypatch, caplog):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import numpy as np

    import pykern
    from pykern import backends, registry
    from pykern.backends.nvrtc import NvrtcBackend
    from pykern.errors import BackendUnavailable

    from fake_driver import LAUNCH_CU, TEST_SOURCE, FakeDriver, sim_axpy

    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(LAUNCH_CU))
    registry.refresh()
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "build_cache"))
    for var in ("PYKERN_CUBIN_DIR", "PYKERN_DISABLE_JIT"):
        monkeypatch.delenv(var, raising=False)
    bundle = tmp_path / "bundle"
    src = cache.load_source(TEST_SOURCE)
    ptx = {}
    for arch in ("compute_75", "compute_80", "sm_80"):  # the fleet bundle: an sm_80 cubin and two PTX
        mod = cache.get_module(TEST_SOURCE, arch)
        cache.export_to_bundle(mod, src, bundle)
        ptx[arch] = mod.image
    # The target: a GPU newer than every cubin (sm_120), no JIT, an empty cache.
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("PYKERN_CUBIN_DIR", str(bundle))
    monkeypatch.setenv("PYKERN_DISABLE_JIT", "1")
    monkeypatch.setattr(cache, "_logged_ptx", set())
    drv = FakeDriver(cc=(12, 0), simulate={"pktest_axpy": sim_axpy})
    compiled_ptx = ptx["compute_80"].decode()
    drv.register(ptx["compute_80"], compiled_ptx)
    be = NvrtcBackend(driver_factory=lambda: drv)
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(40).astype(np.float32), rng.standard_normal(40).astype(np.float32)
    y0 = y.copy()
    with caplog.at_level("INFO", logger="pykern"):
        pykern.launch("pktest_axpy", 1, 64, y, x, 3.0, 40, backend="nvrtc")
        pykern.launch("pktest_axpy", 1, 64, y, x, 3.0, 40, backend="nvrtc")
        registry.refresh()  # a new spec object asks the cache again: still one log line
        pykern.launch("pktest_axpy", 1, 64, y, x, 3.0, 40, backend="nvrtc")
    np.testing.assert_allclose(y, y0 + 9.0 * x, rtol=1e-6)
    loaded = [drv.modules[h].image for h in drv.modules]
    assert loaded == [ptx["compute_80"]]  # the newest compatible PTX, not compute_75
    lines = [r.getMessage() for r in caplog.records if "loading PTX" in r.getMessage()]
    assert len(lines) == 1 and "compute_80" in lines[0] and "sm_120" in lines[0]
    registry.refresh()


# ----------------------------------------------------------------------------- 5. cache CLI


def _fake_host_build(root: Path, name: str, size: int, age: float) -> Path:
    p = root / cache.HOST_SUBDIR / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"\0" * size)
    t = time.time() - age
    os.utime(p, (t, t))
    return p


def test_prune_covers_host_builds_options_after_the_subcommand(env, tmp_path, capsys):
    root = tmp_path / "elsewhere"
    for arch in ("sm_80", "sm_100", "sm_75", "compute_90"):
        cache.get_module(env / "pkt_other.cu", arch, cache_root=root)
    old = _fake_host_build(root, "forward-0123456789abcdef01234567.so", 300_000, age=7200)
    new = _fake_host_build(root, "pk_host_runtime-0123456789abcdef01234567.o", 2_000, age=0)
    assert cache.main(["info", "--json", "--cache-dir", str(root)]) == 0  # option after the subcommand
    d = json.loads(capsys.readouterr().out)
    assert list(d["by_arch"]) == ["sm_75", "sm_80", "compute_90", "sm_100"]  # numeric, not text order
    assert d["host_builds"] == 2 and d["host_bytes"] == 302_000
    total = d["bytes"] + d["host_bytes"]
    assert cache.main(["prune", "--max-size", str(total - 1), "--cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "removed 1 " in out and not old.exists() and new.exists()  # the oldest file was the host build
    assert cache.main(["--cache-dir", str(root), "prune", "--max-size", "0"]) == 0  # before still works
    assert list(cache.iter_entries(root)) == [] and list(cache.iter_host_builds(root)) == []
    assert cache.main(["--cache-dir", str(tmp_path / "x"), "info", "--cache-dir", str(root)]) == 0
    assert str(root) in capsys.readouterr().out  # the later spelling wins


def test_host_build_key_does_not_depend_on_the_checkout_path(tmp_path, monkeypatch):
    from pykern import sources
    from pykern.host import build
    from pykern.registry import parse_file

    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PYKERN_DISABLE_JIT", raising=False)
    built = []
    for checkout in ("ci-run-1", "ci-run-2"):
        d = tmp_path / checkout / "cu"
        shutil.copytree(CU, d)
        src = sources.load(d / "pkt_other.cu")
        built.append(build.build(src.path, src.text, src.digest(), sources.include_dirs(src.path.parent),
                                 parse_file(src.path)))
    assert built[0] == built[1] and built[0].exists()
    assert len([p for p in cache.iter_host_builds(tmp_path / "cache") if p.path.suffix == ".so"]) == 1


# ----------------------------------------------------------------------------- 7. no silent CPU fallback

_GPU_NO_NVRTC = r"""
import sys, warnings, logging
sys.path.insert(0, {tests!r})
import numpy as np
import pykern
from pykern import backends
from pykern.backends import nvrtc
from pykern.errors import BackendUnavailable
from fake_driver import FakeDriver

def no_nvrtc():
    raise BackendUnavailable("NVRTC is not available (libnvrtc.so.13: cannot open shared object file)")

class NoNumbaGpu:  # the README's main install: numba absent, nothing else on the GPU
    name = "numba"
    def on_gpu(self): return False
    def available(self): return False, "numba is not installed"

from pykern import cache, compiler
cache._nvrtc_str = no_nvrtc  # no libnvrtc anywhere in this process
compiler._nvrtc = no_nvrtc
backends._instances["nvrtc"] = nvrtc.NvrtcBackend(driver_factory=lambda: FakeDriver(cc=(9, 0)), supported_archs=no_nvrtc)
backends._instances["numba"] = NoNumbaGpu()
mode = sys.argv[1]
if mode == "old-driver":  # the kernel driver lists a GPU, the CUDA driver cannot initialize
    from pykern.backends.driver import DriverError
    class OldDriver(FakeDriver):
        def init(self):
            raise BackendUnavailable("nvrtc backend: no usable CUDA driver (cuInit: CUDA_ERROR_SYSTEM_DRIVER_MISMATCH)")
    backends._instances["nvrtc"] = nvrtc.NvrtcBackend(driver_factory=OldDriver)
    backends.nvidia_gpus_listed = lambda: 1
    mode = "default"
if mode == "default":
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert backends.default_backend_name() == "host"
        assert backends.default_backend_name() == "host"
    msgs = [str(x.message) for x in w if issubclass(x.category, backends.BackendWarning)]
    assert len(msgs) == 1, msgs
    print(msgs[0])
else:  # PYKERN_BACKEND=nvrtc: an error, never a fallback
    x = np.ones(4, np.float32)
    try:
        pykern.launch("pkt_scale", 1, 4, x, x.copy(), 4)
    except BackendUnavailable as e:
        print("raised:", e)
"""


def test_gpu_present_but_nvrtc_unusable_warns_once(env, tmp_path):
    code = _GPU_NO_NVRTC.format(tests=str(Path(__file__).resolve().parent))
    r = subprocess.run([sys.executable, "-c", code, "default"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYKERN_LOG_LEVEL": "info"}, timeout=120)
    assert r.returncode == 0, r.stderr
    msg = r.stdout.strip()
    assert "a CUDA GPU (sm_90) is present but the nvrtc backend is unusable" in msg
    assert "libnvrtc.so.13" in msg and "running on the host (the CPU emulator" in msg
    assert "pykern INFO: pykern: backend host (nvrtc unusable: " in r.stderr  # PYKERN_LOG_LEVEL=info
    r = subprocess.run([sys.executable, "-c", code, "old-driver"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "a CUDA GPU is present (listed in /proc/driver/nvidia/gpus) but the nvrtc backend" in r.stdout
    assert "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH" in r.stdout
    r = subprocess.run([sys.executable, "-c", code, "strict"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYKERN_BACKEND": "nvrtc"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("raised:") and "libnvrtc.so.13" in r.stdout


# ----------------------------------------------------------------------------- 8. CLIs after the main install


def test_clis_without_the_optional_packages(tmp_path):
    # The README's main install has neither ml_dtypes nor numba: block both in every child process.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nfor m in ('ml_dtypes', 'numba'):\n    sys.modules[m] = None\n")
    e = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=e, timeout=300)

    assert run("-c", "import ml_dtypes").returncode != 0  # the block works
    for mod in ("pykern.difftest", "pykern.precompile", "pykern.cache"):
        r = run("-m", mod, "--help")
        assert r.returncode == 0 and "usage:" in r.stdout, (mod, r.stderr)
    r = run("-m", "pykern.difftest", "--list")
    assert r.returncode == 0, r.stderr
    assert "transpose_2d[f32]" in r.stdout and "Traceback" not in r.stderr
    assert "pip install 'pykern[test]'" in r.stderr  # the bf16 cases say what brings them back
    # The default run goes on with what runs here (host) and its summary names what did not and why.
    r = run("-m", "pykern.difftest", "--kernels", "transpose_2d*", "--no-big")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    summary = r.stdout.split("\nSummary: ", 1)[1]
    assert "  host   ran 12: 12 passed, 0 failed, 0 errors; skipped 6\n" in summary, summary  # f32 and f16 run without ml_dtypes
    assert "6 skipped: missing ml_dtypes: pip install 'pykern[test]'" in summary, summary
    assert "numba  not run: " in summary and "(pip install 'pykern[numba]')" in summary, summary
    # Naming a backend that cannot run stays a usage error, with the extra and the way around it.
    r = run("-m", "pykern.difftest", "--kernels", "transpose_2d", "--backends", "host,numba")
    assert r.returncode == 2 and "pip install 'pykern[numba]'" in r.stderr and "--backends host" in r.stderr


def test_remove_leftovers_only_touches_the_given_processes(tmp_path):
    root = tmp_path / "cache"
    (root / "ab").mkdir(parents=True)
    mine = [root / "ab" / ".abcd.pkc.4242.0123456789ab.tmp", root / "ab" / ".abce.lock"]
    other = [root / "ab" / ".abcf.pkc.777.0123456789ab.tmp", root / "ab" / ".abd0.lock", root / "ab" / "abcd.pkc"]
    mine[0].write_bytes(b"half")
    mine[1].write_text("4242 host 1.0\n")
    other[0].write_bytes(b"half")
    other[1].write_text("777 host 1.0\n")
    other[2].write_bytes(b"whole")
    assert cache.remove_leftovers(root, [4242]) == 2
    assert not any(p.exists() for p in mine) and all(p.exists() for p in other)


_KILLED_TAKING_A_LOCK = """
import os, signal, sys
from pathlib import Path
from pykern import cache
real_link, where = os.link, sys.argv[2]
def link(src, dst):
    if where == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real_link(src, dst)
    os.kill(os.getpid(), signal.SIGKILL)
os.link = link
cache.KeyLock(Path(sys.argv[1]), "ab" + "0" * 62).acquire()
"""


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_worker_killed_while_taking_a_lock_leaves_nothing_remove_leftovers_cannot_name(tmp_path, where):
    # A worker is terminated at any instruction; whatever it left must carry its pid, so that the
    # parent's remove_leftovers(pid) cleans it. (An O_EXCL create followed by a write once left an empty,
    # ownerless lock when the kill fell between the two.)
    root = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-c", _KILLED_TAKING_A_LOCK, str(root), where], cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL
    left = _leftovers(root)
    assert left and all(p.startswith("ab/.ab") for p in left), left
    if where == "after":
        assert (root / "ab" / f".ab{'0' * 62}.lock").read_text().split()[0].isdigit()
    assert cache.remove_leftovers(root, [12345]) == 0  # another process's pid touches nothing
    pids = {int(p.split(".")[-3]) for p in left if p.endswith(".tmp")}
    assert cache.remove_leftovers(root, sorted(pids)) == len(left)
    assert _leftovers(root) == []


def test_jobs_1_stops_after_the_compile_in_progress(env, tmp_path):
    from pykern import compiler

    total = 2 * len(compiler.expand_archs(["all"]))
    proc = subprocess.Popen([sys.executable, "-m", "pykern.precompile", "--arch", "all", "--kernels", "pkt_*",
                             "--jobs", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    while first.startswith("start  "):  # the line as a compile starts comes before the line as it ends
        first = proc.stderr.readline()
    assert first.startswith(f"[1/{total}]"), first
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - t0 < 5.0 and "Traceback" not in err
    assert _leftovers(tmp_path / "cache") == []
