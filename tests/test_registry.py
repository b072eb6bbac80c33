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
