"""NVRTC compiler: archs, cubin/PTX output, ptxas resources, compile errors, PTX .entry vs KernelSpec."""
from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from pykern import compiler, precompile
from pykern.errors import ArgumentError, CompileError, LayoutMismatch
from pykern.registry import KernelSpec, Param, parse_file
from pykern.sources import KERNELS_DIR

CU = Path(__file__).parent / "cu"
BASIC = CU / "pkt_basic.cu"
ELF = b"\x7fELF"


def test_version_and_archs():
    major, minor = compiler.nvrtc_version()
    assert major >= 12 and minor >= 0
    archs = compiler.supported_archs()
    assert "sm_80" in archs and "sm_90" in archs
    assert all(a.startswith("sm_") for a in archs)


@pytest.mark.parametrize(
    "given, expected",
    [("sm_80", "sm_80"), ("SM_90A", "sm_90a"), (86, "sm_86"), ("100", "sm_100"), ("sm_100f", "sm_100f"),
     ("compute_80", "compute_80")],
)
def test_normalize_arch(given, expected):
    assert compiler.normalize_arch(given) == expected


@pytest.mark.parametrize("bad", ["sm80", "gfx90a", "sm_9", "compute_90x", ""])
def test_bad_arch_spelling(bad):
    with pytest.raises(ArgumentError, match="arch"):
        compiler.normalize_arch(bad)


def test_unsupported_arch_names_the_choices():
    with pytest.raises(ArgumentError) as e:
        compiler.normalize_arch("sm_99")
    assert "sm_99" in str(e.value) and "sm_80" in str(e.value)


def test_expand_all_and_dedup():
    newest = max(int(a[3:]) for a in compiler.supported_archs())
    assert compiler.expand_archs(["all"]) == [*compiler.supported_archs(), f"compute_{newest}"]
    assert compiler.expand_archs(["sm_80,sm_90a", "80", "compute_90"]) == ["sm_80", "sm_90a", "compute_90"]


def test_cubin_with_resources():
    m = compiler.compile(BASIC, "sm_80")
    assert m.kind == "cubin" and m.arch == "sm_80"
    assert m.image[:4] == ELF
    assert ".entry pkt_scale(" in m.ptx and ".target sm_80" in m.ptx
    assert set(m.resources) == {"pkt_scale", "pkt_mixed"} == set(m.kernels)
    mixed = m.resources["pkt_mixed"]
    assert mixed.shared_bytes == 64 * 4  # __shared__ float buf[64]
    assert mixed.barriers == 1
    assert m.resources["pkt_scale"].barriers == 0 and m.resources["pkt_scale"].shared_bytes == 0
    for r in m.resources.values():
        assert 0 < r.registers <= 255
        assert r.spill_bytes == 0 and r.stack_bytes == 0
    assert "--gpu-architecture=sm_80" in m.options and "-std=c++17" in m.options
    assert f"--include-path={CU}" in m.options


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100f", "sm_120"])
def test_arch_specific_and_family_cubins(arch):
    m = compiler.compile(BASIC, arch)
    assert m.kind == "cubin" and m.image[:4] == ELF
    assert set(m.resources) == {"pkt_scale", "pkt_mixed"}


def test_compute_arch_gives_ptx_without_resources():
    m = compiler.compile(BASIC, "compute_80")
    assert m.kind == "ptx"
    assert m.image.decode() == m.ptx and ".target sm_80" in m.ptx
    assert m.resources == {}  # no ptxas ran: unknown, not zero
    assert "-Xptxas" not in m.options


_EMPTY_LOG_PROBE = r"""
import sys
from pykern import compiler
m = compiler.compile(sys.argv[1], "compute_80")
assert m.log == "", repr(m.log)  # the case that matters: the log is empty, its buffer is 1 byte
# bytes([32]) is CPython's shared one-byte object, the same one `b" " * 1` returns: NVRTC writing the
# log's NUL into it showed up as b"\x00" here and a split on spaces that found none.
print(bytes([32])[0], (b" " * 1)[0], b"a b".split(bytes([32])))
"""


def test_empty_log_leaves_the_shared_space_bytes_intact():
    # In a child process: the defect corrupts an interpreter-wide object, which would poison this one.
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(compiler.__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", _EMPTY_LOG_PROBE, str(BASIC)], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "32 32 [b'a', b'b']"


def test_nvrtc_outputs_are_read_through_fresh_buffers():
    # Sizes 0 and 1 are the ones CPython would serve from shared singletons.
    class FakeNvrtc:
        seen: list = []

        def nvrtcGetProgramLogSize(self, prog):
            return (0, prog)

        def nvrtcGetProgramLog(self, prog, buf):
            self.seen.append(buf)
            buf[:] = b"\0" * len(buf)
            return (0,)

    fake = FakeNvrtc()
    assert compiler._log_text(fake, 1) == "" and compiler._log_text(fake, 0) == ""
    assert len(fake.seen) == 1 and isinstance(fake.seen[0], bytearray)  # size 0: no call at all
    assert bytes([32])[0] == 32


def cubin_max_threads(image: bytes) -> dict[str, int | None]:
    """Threads-per-block limit of each kernel in a cubin, read from its ELF `.nv.info.<kernel>` section
    (EIATTR_MAX_THREADS, what `cuobjdump -elf` prints): independent of NVRTC's PTX and of the registry."""
    import struct

    shoff = struct.unpack_from("<Q", image, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    names_at = secs[shstrndx][4]
    out: dict[str, int | None] = {}
    for sec in secs:
        start = names_at + sec[0]
        name = image[start:image.index(b"\0", start)].decode()
        if not name.startswith(".nv.info."):
            continue
        data, i, limit = image[sec[4]:sec[4] + sec[5]], 0, None
        while i + 4 <= len(data):
            fmt, attr, size = data[i], data[i + 1], struct.unpack_from("<H", data, i + 2)[0]
            if fmt == 0x04:  # EIFMT_SVAL: u16 size, then the value
                if attr == 0x05:  # EIATTR_MAX_THREADS: x, y, z
                    x, y, z = struct.unpack_from("<III", data, i + 4)
                    limit = x * y * z
                i += 4 + size
            else:  # EIFMT_NVAL / BVAL / HVAL: the value fits the 4-byte record
                i += 4
        out[name[len(".nv.info."):]] = limit
    return out


_BOUNDED = """#define PKT_NT 128
extern "C" __global__ void __launch_bounds__(PKT_NT, 2) pkt_lb(float* y) { y[threadIdx.x] = 1.0f; }
extern "C" __global__ void pkt_free(float* y) { y[0] = 2.0f; }
"""


def test_ptx_and_cubin_carry_the_launch_bounds_the_registry_reads(tmp_path):
    src = tmp_path / "lb.cu"
    src.write_text(_BOUNDED)
    assert {s.name: s.max_threads for s in parse_file(src)} == {"pkt_lb": 128, "pkt_free": None}
    m = compiler.compile(src, "sm_80")
    assert compiler.ptx_max_threads(m.ptx) == {"pkt_lb": 128, "pkt_free": None}
    assert cubin_max_threads(m.image) == {"pkt_lb": 128, "pkt_free": None}


def test_a_define_that_changes_a_launch_bound_is_a_layout_mismatch(tmp_path):
    # The registry reads the source's default (128) and cannot know a -D given to one compile; the PTX
    # check catches it, else launches would be checked against the wrong limit.
    src = tmp_path / "lb.cu"
    src.write_text(_BOUNDED.replace("#define PKT_NT 128", "#ifndef PKT_NT\n#define PKT_NT 128\n#endif"))
    assert compiler.compile(src, "compute_80").kernels == ("pkt_lb", "pkt_free")
    with pytest.raises(LayoutMismatch, match=r"pkt_lb.*registry read __launch_bounds__ as 128.*applied 64"):
        compiler.compile(src, "compute_80", defines={"PKT_NT": 64})


def test_defines_reach_the_compile(tmp_path):
    src = tmp_path / "d.cu"
    src.write_text('extern "C" __global__ void d_k(float* y) {\n#ifdef PKT_ON\n y[0] = PKT_ON;\n#endif\n}\n')
    off = compiler.compile(src, "sm_80")
    on = compiler.compile(src, "sm_80", defines={"PKT_ON": "3.5f"})
    assert "-DPKT_ON=3.5f" in on.options
    assert "st.global" in on.ptx and "st.global" not in off.ptx


def test_unannotated_functions_are_device_code(tmp_path):
    # NVRTC 13.0 (torch's CUDA 13.0 wheels) takes a generic lambda inside a kernel for a host function unless
    # unannotated functions default to __device__; 13.5 does not care. A plain helper called from a kernel
    # fails the same way on every NVRTC without the option, so this fails here if the option goes.
    src = tmp_path / "plain.cu"
    src.write_text('static float twice(float x) { return 2.0f * x; }\n'
                   'extern "C" __global__ void pkt_plain(float* y) {\n'
                   '  auto f = [&](auto v) { return twice(v); };\n  y[0] = f(y[0]);\n}\n')
    m = compiler.compile(src, "sm_80")
    assert "-default-device" in m.options and ".entry pkt_plain(" in m.ptx


def test_include_paths_and_arch_are_not_options():
    with pytest.raises(ArgumentError, match="include"):
        compiler.portable_options("sm_80", ["-I/somewhere"])
    with pytest.raises(ArgumentError, match="arch"):
        compiler.portable_options("sm_80", ["--gpu-architecture=sm_90"])
    assert compiler.portable_options("sm_80", ["-std=c++20"]) == ["--gpu-architecture=sm_80", "-default-device", "-std=c++20"]
    assert compiler.portable_options("sm_80", ["--std=c++20"]) == ["--gpu-architecture=sm_80", "-default-device", "--std=c++20"]
    with pytest.raises(ArgumentError, match="options"):
        compiler.portable_options("sm_80", "-lineinfo")  # a bare string would be split into characters


def test_compile_error_has_file_line_log_and_options(tmp_path):
    src = tmp_path / "broken.cu"
    src.write_text('extern "C" __global__ void broken(float* y) {\n  y[0] = 1.0f;\n  y[1] = undefined_name;\n}\n')
    with pytest.raises(CompileError) as e:
        compiler.compile(src, "sm_80", options=["-lineinfo"])
    err = e.value
    assert f"{src}:3:" in str(err)  # first error, as file:line
    assert f"{src}(3)" in err.log and "undefined_name" in err.log  # NVRTC's own log
    assert "--gpu-architecture=sm_80" in err.options and "-lineinfo" in err.options
    assert "-lineinfo" in str(err)


def test_missing_header_is_a_compile_error(tmp_path):
    src = tmp_path / "nohdr.cu"
    src.write_text('#include "pkt_does_not_exist.cuh"\nextern "C" __global__ void nohdr(float* y) {}\n')
    with pytest.raises(CompileError, match="pkt_does_not_exist.cuh"):
        compiler.compile(src, "sm_80")


def test_kernel_hidden_by_preprocessor_is_a_layout_mismatch(tmp_path):
    src = tmp_path / "hidden.cu"
    src.write_text('extern "C" __global__ void shown(float* y) { y[0] = 1.0f; }\n'
                   '#if 0\nextern "C" __global__ void hidden(float* y) {}\n#endif\n')
    with pytest.raises(LayoutMismatch, match="hidden"):
        compiler.compile(src, "sm_80")


def test_param_type_the_registry_misreads_is_a_layout_mismatch(tmp_path):
    # The registry reads `float v`; the preprocessor turns it into a double (8 bytes, not 4).
    src = tmp_path / "retyped.cu"
    src.write_text('#define float double\nextern "C" __global__ void retyped(int* y, float v) { y[0] = (int)v; }\n')
    with pytest.raises(LayoutMismatch) as e:
        compiler.compile(src, "sm_80")
    msg = str(e.value)
    assert "retyped" in msg and "'v'" in msg and "size 4" in msg and "size 8" in msg


def _spec(name, *ctypes):
    return KernelSpec(name, Path("x.cu"), 1, tuple(Param(f"p{i}", c) for i, c in enumerate(ctypes)))


def test_check_layout_counts_sizes_and_alignment():
    ptx = (".visible .entry k(\n\t.param .u64 .ptr .global .align 4 k_param_0,\n\t.param .u32 k_param_1,\n"
           "\t.param .align 8 .b8 k_param_2[16]\n)\n{\n\tret;\n}\n")
    entries = compiler.ptx_entries(ptx)
    assert [(p.size, p.align) for p in entries["k"]] == [(8, 8), (4, 4), (16, 8)]
    with pytest.raises(LayoutMismatch, match="expected 2 parameters"):
        compiler.check_layout(ptx, [_spec("k", "float*", "int")])
    with pytest.raises(LayoutMismatch, match="parameter 2"):
        compiler.check_layout(ptx, [_spec("k", "float*", "int", "double")])
    with pytest.raises(LayoutMismatch, match="parameter 1"):
        compiler.check_layout(ptx, [_spec("k", "float*", "unsigned short", "double")])


def test_check_layout_accepts_every_param_kind_of_the_test_source():
    m = compiler.compile(BASIC, "sm_75")
    compiler.check_layout(m.ptx, parse_file(BASIC))  # compile() already did; this makes it explicit
    sizes = [p.size for p in compiler.ptx_entries(m.ptx)["pkt_mixed"]]
    assert sizes == [8, 8, 4, 2, 1, 1, 8, 4, 4, 8]


def test_parse_resources_reads_every_field():
    log = (
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function 'a' for 'sm_75'\n"
        "ptxas info    : Function properties for a\n"
        "ptxas         .     24 bytes stack frame, 20 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 128 registers, used 1 barriers, 24 bytes cumulative stack size, "
        "32768 bytes smem, 400 bytes cmem[0]\n"
        "ptxas info    : Compile time = 1.0 ms\n"
        "ptxas info    : Compiling entry function 'b' for 'sm_75'\n"
        "ptxas info    : Function properties for b\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 4 registers, used 0 barriers\n"
    )
    r = compiler.parse_resources(log)
    assert r["a"] == compiler.Resources(128, 20, 12, 32768, 24, 1, 400)
    assert r["a"].spill_bytes == 32
    assert r["b"] == compiler.Resources(4, 0, 0, 0, 0, 0, 0)


# ---------------------------------------------------------------- the real kernels

REAL_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
REAL_FILES = sorted(KERNELS_DIR.glob("*.cu"))


def _real_pairs() -> list[tuple[Path, str]]:
    """(source, arch) to compile: every arch of REAL_ARCHS, or a `// pykern: arch sm_90a` source's own targets."""
    from pykern.registry import source_archs

    out = []
    for p in REAL_FILES:
        own = source_archs(p.read_text(encoding="utf-8"), str(p))
        out += [(p, a) for a in (own or REAL_ARCHS)]
    return out


REAL_PAIRS = _real_pairs()


@pytest.fixture(scope="module")
def real_compiles():
    """Every (file, arch) compile started at once in worker processes; each test waits for its own.

    Under pytest-xdist the tests are already spread over processes, so each compiles its own pair inline.
    The run's cache folder (tests/conftest.py) holds the results: the SASS and host tests of other files
    compile the same (file, arch) pairs, and an entry is only ever stored after compile() checked its
    layout, so a hit here proves what a fresh compile would.
    """
    from pykern import cache

    root = str(cache.cache_dir())
    if os.environ.get("PYTEST_XDIST_WORKER") or (os.cpu_count() or 1) < 2:
        yield root, None
        return
    pool = ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=multiprocessing.get_context("spawn"))
    futs = {(p, a): pool.submit(precompile._compile_job, str(p), a, (), None, root)
            for p, a in REAL_PAIRS}
    yield root, futs
    pool.shutdown(cancel_futures=True)


@pytest.mark.skipif(not REAL_FILES, reason="kernels_cu has no .cu files yet")
@pytest.mark.parametrize("path,arch", REAL_PAIRS, ids=lambda x: x.name if isinstance(x, Path) else x)
def test_real_kernels_compile_check_layout_and_do_not_spill(path, arch, real_compiles):
    # compile() checks every kernel's PTX .entry against its KernelSpec and raises LayoutMismatch.
    root, futs = real_compiles
    if futs is None:
        mod, err, _ = precompile._compile_job(str(path), arch, (), None, root)
    else:
        mod, err, _ = futs[(path, arch)].result(timeout=600)
    assert not err, err
    specs = parse_file(path)
    assert mod.kind == "cubin" and mod.image[:4] == ELF
    assert set(mod.resources) == {s.name for s in specs}
    # The thread limit the launcher checks is the one in the cubin (EIATTR_MAX_THREADS): a
    # __launch_bounds__ spelled through macros must not be lost or misread by the registry.
    assert cubin_max_threads(mod.image) == {s.name: s.max_threads for s in specs}
    spilling = {k: (r.spill_stores, r.spill_loads) for k, r in mod.resources.items() if r.spill_bytes}
    assert not spilling, f"{path.name} spills registers on {arch} (stores, loads bytes): {spilling}"


def test_the_suite_compiles_project_sources_through_the_cache():
    # compiler.compile stores nothing: a test calling it on a kernels_cu source compiles again what
    # test_real_kernels_compile_check_layout_and_do_not_spill (and the SASS tests) already cached, up to
    # minutes of CPU for an sm_90a source. sass_helpers.nvrtc_module loads the run's entry instead.
    import ast

    bad = []
    for p in sorted(Path(__file__).parent.glob("*.py")):
        text = p.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "compile"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "compiler" and node.args):
                arg = ast.get_source_segment(text, node.args[0]) or ""
                if "kernels_cu" in arg or "KERNELS_DIR" in arg:
                    bad.append(f"{p.name}:{node.lineno}: {arg}")
    assert not bad, bad


# --------------------------------------------------------------------------- ptxas's split compile (threads)

SM90_WRAPPERS = Path(__file__).parent / "sm90_cu" / "pk_sm90_wrappers.cu"


def _split(options) -> list[str]:
    """The ptxas split options among a compile's options: ["-Xptxas", "--split-compile=N"] or []."""
    opts = list(options)
    return [o for i, o in enumerate(opts) if "split-compile" in o or (o == "-Xptxas" and i + 1 < len(opts)
                                                                      and "split-compile" in opts[i + 1])]


def test_split_compile_reaches_nvrtc_with_the_env_count(monkeypatch):
    monkeypatch.setenv("PYKERN_COMPILE_THREADS", "3")
    m = compiler.compile(BASIC, "sm_80")
    assert _split(m.options) == ["-Xptxas", "--split-compile=3"]
    assert "--split-compile=3" not in compiler.portable_options("sm_80")  # never in what the key hashes
    # NVRTC's own -split-compile (the NVVM optimizer's) is never passed: it changes the PTX and the SASS.
    assert not any(o.startswith("-split-compile") for o in m.options)
    monkeypatch.setenv("PYKERN_COMPILE_THREADS", "1")
    one = compiler.compile(BASIC, "sm_80")
    assert _split(one.options) == [] and one.resources == m.resources


def test_split_compile_defaults_to_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.delenv("PYKERN_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(compiler, "available_cpus", lambda: 6)
    assert compiler.compile_threads() == 6
    assert compiler.compile_threads(share=2) == 3 and compiler.compile_threads(share=4) == 1
    assert compiler.compile_threads(share=100) == 1  # never 0
    monkeypatch.setattr(compiler, "available_cpus", lambda: 64)  # a large host: the default stops at 8 (memory)
    assert compiler.compile_threads() == compiler.DEFAULT_MAX_THREADS == 8 and compiler.compile_threads(share=16) == 4
    monkeypatch.setattr(compiler, "available_cpus", lambda: 6)
    assert compiler._split_options("sm_90a", [], 6) == ["-Xptxas", "--split-compile=6"]
    assert compiler._split_options("compute_90", [], 6) == []  # PTX: no ptxas runs
    # A caller's own split option (in `options`, so in the key) is kept as it is, and none is added.
    assert compiler._split_options("sm_90a", ["-Xptxas", "--split-compile=2"], 6) == []
    monkeypatch.setenv("PYKERN_COMPILE_THREADS", " 5 ")
    assert compiler.compile_threads(share=4) == 5  # the variable is per compile: not divided
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.undo()
        assert compiler.available_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5", "5000"])
def test_bad_compile_threads_errors_naming_the_variable(monkeypatch, bad):
    monkeypatch.setenv("PYKERN_COMPILE_THREADS", bad)
    with pytest.raises(ArgumentError, match=rf"PYKERN_COMPILE_THREADS: expected .*got '{bad}'"):
        compiler.compile(BASIC, "sm_80")


def test_split_compile_is_not_in_the_cache_key(tmp_path, monkeypatch):
    from cache_helpers import private_sources

    from pykern import cache

    src = private_sources(tmp_path, monkeypatch) / "pkt_basic.cu"
    monkeypatch.setenv("PYKERN_COMPILE_THREADS", "1")
    first = cache.get_module(src, "sm_80", use_bundle=False, jit=True)
    monkeypatch.setattr(cache, "_memory", {})
    monkeypatch.setenv("PYKERN_COMPILE_THREADS", "8")
    again = cache.get_module(src, "sm_80", use_bundle=False, jit=False)  # jit=False: a miss would raise
    assert again.hit and again.origin == "cache" and again.digest == first.digest
    assert _split(again.options) == []


def test_split_compile_keeps_sass_and_resources(monkeypatch):
    # ptxas translates functions on several threads; what it emits for each must not change. Only the
    # option line ptxas records in the cubin (.note.nv.tkinfo) differs, so the bytes are not compared.
    from sass_helpers import guard, report

    def sass_per_kernel(image: bytes) -> dict[str, str]:
        text = report().disassemble(image)
        parts = re.split(r"^\s*Function : (\S+)\s*$", text, flags=re.M)
        return dict(zip(parts[1::2], parts[2::2]))

    monkeypatch.setenv("PYKERN_COMPILE_THREADS", "1")
    one = compiler.compile(SM90_WRAPPERS, "sm_90a")
    monkeypatch.setenv("PYKERN_COMPILE_THREADS", "4")
    four = compiler.compile(SM90_WRAPPERS, "sm_90a")
    assert "--split-compile=4" in four.options and one.ptx == four.ptx
    assert one.resources == four.resources and len(one.resources) >= 3
    a, b = guard(lambda: sass_per_kernel(one.image)), sass_per_kernel(four.image)
    assert set(a) == set(one.resources) and a == b
    assert b"-split-compile 4" in four.image and b"-split-compile" not in one.image
