from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import pykern
from pykern import registry
from pykern.errors import KernelNotFound, RegistryError

HERE = Path(__file__).parent


@pytest.fixture
def kpath(monkeypatch, tmp_path):
    def use(*dirs):
        monkeypatch.setenv("PYKERN_KERNEL_PATH", ":".join(str(d) for d in dirs))
        registry.refresh()

    yield use
    registry.refresh()


def test_specs_are_parsed_from_source(kpath):
    kpath(HERE / "registry_cu")
    spec = registry.get("pk_reg_plain")
    assert [(p.name, p.ctype) for p in spec.params] == [
        ("x", "const float*"), ("y", "float*"), ("n", "unsigned int"), ("eps", "float"),
    ]
    assert spec.source == (HERE / "registry_cu" / "sigs.cu").resolve()
    assert spec.line == 2
    b = registry.get("pk_reg_bounds")
    assert [p.ctype for p in b.params] == [
        "const unsigned short*", "unsigned long long", "long long", "int", "unsigned char",
        "double", "bool", "unsigned int", "unsigned long long",
    ]
    assert b.params[0].is_pointer and b.params[0].is_const and b.params[0].pointee == "unsigned short"
    assert registry.get("pk_reg_empty").params == ()
    with pytest.raises(KernelNotFound, match="pk_reg_commented"):
        registry.get("pk_reg_commented")
    names = [k.name for k in pykern.kernels()]
    assert names == sorted(names) and "pk_reg_plain" in names


def test_every_shipped_kernel_is_typed():
    specs = pykern.kernels()
    assert all(s.source.suffix == ".cu" for s in specs)
    for s in specs:
        assert s.params, f"{s.name} takes no parameters"


def test_duplicate_kernel_names_file_and_line(kpath, tmp_path, monkeypatch):
    monkeypatch.setenv("PYKERN_STRICT", "1")
    (tmp_path / "a.cu").write_text('extern "C" __global__ void pk_dup(float* x) {}\n')
    (tmp_path / "b.cu").write_text('\n\nextern "C" __global__ void pk_dup(float* y) {}\n')
    kpath(tmp_path)
    with pytest.raises(RegistryError, match=r"pk_dup.*a\.cu:1.*b\.cu:3"):
        pykern.kernels()


@pytest.mark.parametrize(
    "decl",
    ["float** pp", "float& r", "__half2 h", "MyStruct s", "float x[4]"],
)
def test_untypable_signature_names_file_and_line(kpath, tmp_path, decl, monkeypatch):
    monkeypatch.setenv("PYKERN_STRICT", "1")
    (tmp_path / "bad.cu").write_text(
        textwrap.dedent(f"""
        // line 2
        extern "C" __global__ void pk_bad(int n, {decl}) {{}}
        """)
    )
    kpath(tmp_path)
    with pytest.raises(RegistryError, match=r"bad\.cu:3"):
        pykern.kernels()


def test_kernel_path_must_be_a_folder(kpath, tmp_path):
    kpath(tmp_path / "missing")
    with pytest.raises(RegistryError, match="PYKERN_KERNEL_PATH"):
        pykern.kernels()


def test_import_is_lazy():
    import subprocess
    import sys

    code = "import sys, pykern; print(sorted(m for m in ('numpy','numba','cuda','ml_dtypes') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_get_picks_up_an_edited_signature(kpath, tmp_path):
    # The launcher validates against registry.get(): a stale spec after an edit would pack the
    # arguments of the old signature for the new kernel.
    f = tmp_path / "edit.cu"
    f.write_text('extern "C" __global__ void pk_edit(float* x) {}\n')
    kpath(tmp_path)
    first = registry.get("pk_edit")
    assert [p.ctype for p in first.params] == ["float*"]
    f.write_text('extern "C" __global__ void pk_edit(float* x, unsigned int n) {}\n')
    assert [p.ctype for p in registry.get("pk_edit").params] == ["float*", "unsigned int"]
    assert [p.ctype for p in next(k for k in pykern.kernels() if k.name == "pk_edit").params] == [
        "float*", "unsigned int",
    ]
    # An unchanged source keeps its spec object (backends key their per-kernel plans on it).
    assert registry.get("pk_edit") is registry.get("pk_edit")


def test_get_forgets_a_removed_kernel(kpath, tmp_path):
    f = tmp_path / "gone.cu"
    f.write_text('extern "C" __global__ void pk_gone(float* x) {}\n')
    kpath(tmp_path)
    registry.get("pk_gone")
    f.write_text('extern "C" __global__ void pk_renamed(float* x) {}\n')
    with pytest.raises(KernelNotFound, match="pk_gone"):
        registry.get("pk_gone")
    assert registry.get("pk_renamed").params[0].name == "x"


def test_non_utf8_source_names_the_file(kpath, tmp_path, monkeypatch):
    monkeypatch.setenv("PYKERN_STRICT", "1")
    (tmp_path / "latin.cu").write_bytes(b'// caf\xe9\nextern "C" __global__ void pk_latin(float* x) {}\n')
    kpath(tmp_path)
    with pytest.raises(RegistryError, match=r"latin\.cu: not UTF-8"):
        pykern.kernels()


# ---- __launch_bounds__ through macros ------------------------------------------------------------
# Hand-computed from kernels_cu: FA_THREADS 256 (attention_fwd_fma.cu), FATC_THREADS 128
# (pk_attn_tc.cuh, included), PKFA_THREADS 256 (pk_attn_core.cuh, included), PA_NT 128 (paged.cu).
_MACRO_BOUNDS = {
    "attention_fwd_fma_d64": 256, "attention_fwd_fma_d128_bf16": 256, "attention_fwd_fma_d256": 256,
    "attention_fwd_tc_d64_bf16": 256, "attention_fwd_tc_pad_d64_bf16": 128, "attention_fwd_tc_d256_bf16": 128,
    "attention_bwd_tc_dkdv_d64_bf16": 128, "attention_bwd_tc_dq_d256_bf16": 128,
    "paged_attn": 128, "dense_attn_bf16kv": 128, "paged_attn_merge": 128, "paged_append_kv_bf16": 128,
}


def test_macro_launch_bounds_of_the_shipped_kernels():
    got = {s.name: s.max_threads for s in pykern.kernels()}
    assert {k: got[k] for k in _MACRO_BOUNDS} == _MACRO_BOUNDS


def test_every_shipped_kernel_with_launch_bounds_has_its_limit():
    import re

    from pykern.sources import KERNELS_DIR

    bounded = set()
    for cu in KERNELS_DIR.glob("*.cu"):
        text = cu.read_text()
        bounded |= set(re.findall(r'__global__ void __launch_bounds__\([^\n]*?\)\s+(\w+)\(', text))
        # a PK_IO_KERNELS / PK_IO16_KERNELS call always passes its bounds: each instantiation has them
        macros = "|".join([*registry.IO_INSTANTIATIONS, *registry.KV_INSTANTIATIONS])
        for macro, name in re.findall(rf"^({macros})\((\w+),", text, re.M):
            bounded |= {name + sfx for sfx, _, _ in registry.instantiations(macro)}
    assert len(bounded) > 80
    missing = sorted(s.name for s in pykern.kernels() if s.name in bounded and s.max_threads is None)
    assert not missing


def _write(tmp_path, text, name="lb.cu"):
    (tmp_path / name).write_text(textwrap.dedent(text))


def test_launch_bounds_forms(kpath, tmp_path):
    (tmp_path / "lb_defs.cuh").write_text("#pragma once\n#define LB_WARPS 4\n#define LB_THREADS (LB_WARPS * 32)\n")
    _write(tmp_path, """\
        #include "lb_defs.cuh"
        #define LB_BIG (1 << 9)   /* 512 */
        #define PK_BOUNDS(n, m) __launch_bounds__(n, m)
        #define PK_B256 __launch_bounds__(0x100u)
        #if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        #define LB_MINB 1
        #else
        #define LB_MINB 2
        #endif
        extern "C" __global__ void __launch_bounds__(LB_THREADS, LB_MINB) lb_hdr(float* x) {}
        extern "C" __global__ void __launch_bounds__((4 * 32) + 64) lb_expr(float* x) {}
        extern "C" __global__ void PK_BOUNDS(LB_BIG, 1) lb_fn(float* x) {}
        extern "C" __global__ void PK_B256 lb_obj(float* x) {}
        extern "C" __global__ void lb_none(float* x) {}
        extern "C" __global__ void __launch_bounds__(\\
            LB_THREADS / 2) lb_split(float* x) {}
        """)
    kpath(tmp_path)
    got = {n: registry.get(n).max_threads for n in ("lb_hdr", "lb_expr", "lb_fn", "lb_obj", "lb_none", "lb_split")}
    assert got == {"lb_hdr": 128, "lb_expr": 192, "lb_fn": 512, "lb_obj": 256, "lb_none": None, "lb_split": 64}
    assert [p.name for p in registry.get("lb_fn").params] == ["x"]  # PK_BOUNDS(...) is not the kernel


def test_launch_bounds_the_registry_cannot_read(kpath, tmp_path, monkeypatch):
    # Defined twice with different values (under #if): unknown, never a guess.
    _write(tmp_path, """\
        #ifdef BIG
        #define LB_T 512
        #else
        #define LB_T 128
        #endif
        extern "C" __global__ void __launch_bounds__(LB_T) lb_amb(float* x) {}
        """)
    kpath(tmp_path)
    with pytest.warns(registry.RegistryWarning, match=r"lb_amb.*cannot read __launch_bounds__.*LB_T"):
        assert registry.get("lb_amb").max_threads is None
    monkeypatch.setenv("PYKERN_STRICT", "1")
    registry.refresh()
    with pytest.raises(RegistryError, match=r"lb\.cu:6: kernel 'lb_amb': cannot read __launch_bounds__"):
        registry.get("lb_amb")


def test_too_many_threads_for_a_macro_bound_raises_before_launch():
    import numpy as np

    from pykern.errors import ArgumentError

    spec = registry.get("paged_attn_merge")  # __launch_bounds__(PA_NT): 128
    args = [np.zeros(4, np.float32) if p.is_pointer else 1 for p in spec.params]
    for backend in ("host", "numba"):
        with pytest.raises(ArgumentError, match=r"block: paged_attn_merge is declared __launch_bounds__\(128\).*256 threads"):
            pykern.launch("paged_attn_merge", 1, 256, *args, backend=backend)


# --------------------------------------------------------------------------- element-type instantiations


def test_io_kernel_macros_yield_one_typed_kernel_per_element_type(kpath, tmp_path):
    (tmp_path / "io.cu").write_text(textwrap.dedent('''\
        #include "pk_common.cuh"
        template <typename T> __device__ void pk_io_a_impl(const T* x, T* y, float* s, long long n) {}
        template <typename T> __device__ void pk_io_b_impl(const T* x, unsigned int n) {}
        // PK_IO_KERNELS(pk_io_commented, (64), (const T* x), (x))
        PK_IO_KERNELS(pk_io_a, (256, 1),
                      (const T* __restrict__ x, T* y, float* s, long long n),
                      (x, y, s, n))

        PK_IO16_KERNELS(pk_io_b, (128), (const T* x, unsigned int n), (x, n))
    '''))
    kpath(tmp_path)
    got = {s.name: s for s in registry.parse_file(tmp_path / "io.cu")}
    assert list(got) == ["pk_io_a", "pk_io_a_bf16", "pk_io_a_f16", "pk_io_b_bf16", "pk_io_b_f16"]
    assert [p.ctype for p in got["pk_io_a"].params] == ["const float*", "float*", "float*", "long long"]
    assert [p.ctype for p in got["pk_io_a_bf16"].params] == [
        "const __nv_bfloat16*", "__nv_bfloat16*", "float*", "long long"]
    assert [p.ctype for p in got["pk_io_a_f16"].params] == ["const __half*", "__half*", "float*", "long long"]
    assert [p.ctype for p in got["pk_io_b_f16"].params] == ["const __half*", "unsigned int"]
    assert {s.max_threads for n, s in got.items() if n.startswith("pk_io_a")} == {256}
    assert got["pk_io_b_f16"].max_threads == 128 and got["pk_io_a_f16"].line == 5


def test_malformed_io_kernel_macro_names_the_file(kpath, tmp_path):
    (tmp_path / "bad.cu").write_text('PK_IO_KERNELS(pk_bad, 256, (const T* x), (x))\n')
    with pytest.raises(RegistryError, match=r"bad\.cu.*line 1.*PK_IO_KERNELS\(name, \(bounds\)"):
        registry.parse_file(tmp_path / "bad.cu", strict=True)


@pytest.mark.parametrize("source", ["forward.cu", "paged.cu"])
def test_compiled_symbols_are_the_registry_names(source):
    # The macros in pk_common.cuh and registry.IO_INSTANTIATIONS / KV_INSTANTIATIONS must agree: NVRTC's
    # module (and the host backend's library) export exactly the names the registry lists.
    from pykern.errors import PykernError
    from pykern.sources import KERNELS_DIR
    from sass_helpers import nvrtc_module

    src = KERNELS_DIR / source
    try:
        mod = nvrtc_module(src, "sm_80")  # the entry test_compiler's sm_80 compile of the source stores
    except PykernError as e:
        pytest.skip(f"NVRTC unavailable: {e}")
    assert sorted(mod.kernels) == sorted(s.name for s in registry.parse_file(src))
    assert {"rms_norm_f16", "rms_norm_bf16", "paged_attn_f16_e4m3kv", "dense_attn_f16kv"} & set(mod.kernels)


def test_16bit_float_pointers_take_only_their_own_dtype():
    import numpy as np

    from pykern.arrays import bfloat16
    from pykern.errors import ArgumentTypeError

    x16 = np.ones((2, 8), np.float16)
    xb = np.ones((2, 8), bfloat16())
    with pytest.raises(ArgumentTypeError, match=r"x.*float16"):
        pykern.launch("rms_norm_f16", 1, 32, xb, xb[0], np.empty_like(xb), 2, 8, 1e-6, 0.0, backend="host")
    with pytest.raises(ArgumentTypeError, match=r"x.*bfloat16"):
        pykern.launch("rms_norm_bf16", 1, 32, x16, x16[0], np.empty_like(x16), 2, 8, 1e-6, 0.0, backend="host")
    out = np.empty((2, 8), np.uint16)  # raw 16-bit words are still accepted
    pykern.launch("rms_norm_f16", 1, (32, 2), x16.view(np.uint16), x16[0].view(np.uint16), out, 2, 8, 0.0, 0.0,
                  backend="host")
    np.testing.assert_array_equal(out.view(np.float16), x16)


def test_parameter_list_macro(kpath, tmp_path):
    # A family states its parameter list (and bounds) once in an object-like macro; every call that names
    # it gets those parameters, with T and TKS (the K/V storage type) replaced per instantiation.
    (tmp_path / "pl_defs.cuh").write_text("#pragma once\n#define PL_NT (2 * 64)\n")
    _write(tmp_path, """\
        #include "pl_defs.cuh"
        #define PL_BOUNDS (PL_NT, 1)
        #define PL_PARAMS                                   \\
            (const T* __restrict__ q, const TKS* k, T* out, \\
             long long n, float scale)
        #define PL_ARGS (q, k, out, n, scale)
        PK_IO_KERNELS(pl_same, PL_BOUNDS, PL_PARAMS, PL_ARGS)
        PK_KV16_KERNELS(pl_mixed, (64), PL_PARAMS, PL_ARGS)
        PK_FP8KV_KERNELS(pl_fp8, PL_BOUNDS, PL_PARAMS, PL_ARGS)
        PK_FP8_KERNELS(pl_app, PL_BOUNDS, PL_PARAMS, PL_ARGS)
        PK_FP8KV16_KERNELS(pl_fp8h, PL_BOUNDS, PL_PARAMS, PL_ARGS)
        """, name="pl.cu")
    specs = {s.name: s for s in registry.parse_file(tmp_path / "pl.cu", strict=True)}
    sig = {n: tuple(p.ctype for p in s.params) for n, s in specs.items()}
    assert sig["pl_same"] == ("const float*", "const float*", "float*", "long long", "float")
    assert sig["pl_same_f16"] == ("const __half*", "const __half*", "__half*", "long long", "float")
    assert sig["pl_mixed_f16kv"] == ("const float*", "const __half*", "float*", "long long", "float")
    assert sig["pl_mixed_bf16kv"][1] == "const __nv_bfloat16*"
    assert sig["pl_fp8_f16_e5m2kv"] == ("const __half*", "const unsigned char*", "__half*", "long long", "float")
    assert sig["pl_fp8_e4m3kv"][:2] == ("const float*", "const unsigned char*")
    assert {"pl_app_e4m3", "pl_app_bf16_e5m2", "pl_app_f16_e4m3"} <= set(sig)
    # 16-bit queries only over FP8 (the sm_90a paged prefill): no f32-query instantiation
    assert sorted(n for n in sig if n.startswith("pl_fp8h")) == [
        "pl_fp8h_bf16_e4m3kv", "pl_fp8h_bf16_e5m2kv", "pl_fp8h_f16_e4m3kv", "pl_fp8h_f16_e5m2kv"]
    assert sig["pl_fp8h_bf16_e4m3kv"][:2] == ("const __nv_bfloat16*", "const unsigned char*")
    assert [p.name for p in specs["pl_same_bf16"].params] == ["q", "k", "out", "n", "scale"]
    assert specs["pl_same"].max_threads == 128 and specs["pl_mixed_bf16kv"].max_threads == 64
    assert specs["pl_fp8_f16_e4m3kv"].max_threads == 128
    assert len(specs) == 3 + 2 + 6 + 6 + 4


def test_parameter_list_macro_through_a_function_like_macro(kpath, tmp_path):
    # Lists that differ only in a type are written once: the named object-like macro may be a call of a
    # function-like one, expanded (nested macros too) before the list is read.
    _write(tmp_path, """\
        #define PL_PTR(X) const X* __restrict__
        #define PL_KV(KV) (PL_PTR(T) q, const KV* k, T* out, long long n)
        #define PL_16 PL_KV(T)
        #define PL_8 PL_KV(unsigned char)
        #define PL_ARGS (q, k, out, n)
        PK_IO16_KERNELS(pl_16, (64), PL_16, PL_ARGS)
        PK_IO16_KERNELS(pl_8, (64), PL_8, PL_ARGS)
        """, name="pl_fn.cu")
    specs = {s.name: s for s in registry.parse_file(tmp_path / "pl_fn.cu", strict=True)}
    sig = {n: tuple(p.ctype for p in s.params) for n, s in specs.items()}
    assert sig["pl_16_bf16"] == ("const __nv_bfloat16*", "const __nv_bfloat16*", "__nv_bfloat16*", "long long")
    assert sig["pl_8_f16"] == ("const __half*", "const unsigned char*", "__half*", "long long")
    assert [p.name for p in specs["pl_8_bf16"].params] == ["q", "k", "out", "n"]
    assert len(specs) == 4


def test_parameter_list_macro_must_be_a_parenthesized_list(kpath, tmp_path):
    _write(tmp_path, """\
        #define PL_FN(x) (const T* x)
        #define PL_BARE const T* x
        PK_IO_KERNELS(pl_a, (64), PL_BARE, (x))
        """, name="pl_bad.cu")
    with pytest.raises(RegistryError, match=r"pl_bad\.cu.*line 3.*PK_IO_KERNELS\(name, \(bounds\)"):
        registry.parse_file(tmp_path / "pl_bad.cu", strict=True)
    _write(tmp_path, "PK_IO_KERNELS(pl_b, (64), PL_UNDEFINED, (x))\n", name="pl_undef.cu")
    with pytest.raises(RegistryError, match=r"PL_UNDEFINED"):
        registry.parse_file(tmp_path / "pl_undef.cu", strict=True)
