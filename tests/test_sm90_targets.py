"""Arch-specific targets: `// pykern: arch sm_90a` sources, precompile, cache compatibility, the nvrtc
backend's choice on a cc 9.0 GPU (fake driver), tensor maps through the driver seam, PYKERN_HOST_ARCH."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import pykern
from pykern import backends, cache
from pykern.backends.driver import DriverError
from pykern.backends.nvrtc import NvrtcBackend
from pykern.errors import ArgumentError, RegistryError
from pykern.registry import source_archs
from pykern.tensormap import make_tensor_map

from fake_driver import FakeDriver, StubModule, decode_params

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tests" / "sm90_cu" / "pk_sm90_wrappers.cu"


def test_arch_pragma_is_read_and_checked() -> None:
    assert source_archs("// pykern: arch sm_90a\n") == ("sm_90a",)
    assert source_archs("  // pykern: archs sm_90a, SM_100A\nint x;") == ("sm_90a", "sm_100a")
    assert source_archs("int x; // no pragma\n") == ()
    with pytest.raises(RegistryError, match="arch-specific targets .* got 'sm_90'"):
        source_archs("// pykern: arch sm_90\n", "x.cu")


def test_registry_types_grid_constant_tensor_maps_and_archs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(SRC.parent))
    spec = pykern.registry.get("pk_sm90_tma_wgmma_ss")
    assert spec.archs == ("sm_90a",)
    assert [p.ctype for p in spec.params] == ["CUtensorMap", "CUtensorMap", "CUtensorMap", "float*"]
    from pykern.ctypes_ import size_align

    assert size_align("CUtensorMap") == (128, 64)


def test_cache_compatibility_of_a_targets() -> None:
    # An sm_90a cubin runs only on cc 9.0: offered to sm_90 lookups, never to 10.x or 8.x ones.
    assert "sm_90a" in cache.compatible_archs("sm_90")
    assert cache.compatible_archs("sm_90a") == ("sm_90a",)
    assert not any(a.endswith("a") and a != "sm_100a" for a in cache.compatible_archs("sm_100"))
    assert "sm_90a" not in cache.compatible_archs("sm_100") + cache.compatible_archs("sm_89") + cache.compatible_archs("sm_103")
    assert "sm_100a" not in cache.compatible_archs("sm_103")


def _precompile(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pykern.precompile", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})


def test_precompile_builds_an_sm90a_source_only_for_sm90a(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(SRC, src)
    shutil.copy(ROOT / "tests" / "cu" / "pkt_other.cu", src) if (ROOT / "tests" / "cu" / "pkt_other.cu").exists() else None
    env = {"PYKERN_KERNEL_PATH": str(src), "PYKERN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    r = _precompile("--arch", "sm_80,sm_90,sm_90a,sm_100a", "--kernels", "pk_sm90_*", "--json", env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert {row["arch"] for row in d["results"]} == {"sm_90a"}  # not sm_80 / sm_90 / sm_100a
    assert {row["kernel"] for row in d["results"]} == {"pk_sm90_tma_wgmma_ss", "pk_sm90_wgmma_rs", "pk_sm90_tma_nd"}
    # What was left out, and why, is part of the result, not a silent gap in the counts.
    assert {(Path(x["source"]).name, x["arch"]) for x in d["skipped"]} == {
        ("pk_sm90_wrappers.cu", a) for a in ("sm_80", "sm_90", "sm_100a")}
    assert all("exist only for sm_90a" in x["reason"] for x in d["skipped"])
    r = _precompile("--arch", "sm_80,sm_90a", "--kernels", "pk_sm90_*", env=env)
    assert r.returncode == 0, r.stderr
    assert "skipped for sm_80: pk_sm90_wrappers.cu: its kernels exist only for sm_90a" in r.stdout
    r = _precompile("--arch", "sm_80", "--kernels", "pk_sm90_*", env=env)
    assert r.returncode == 2 and "built only for the targets it names" in r.stderr


def test_precompile_all_adds_the_a_targets_for_the_sources_that_name_them(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(SRC, src)
    shutil.copy(ROOT / "tests" / "cu" / "pkt_other.cu", src)
    env = {"PYKERN_KERNEL_PATH": str(src), "PYKERN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    r = _precompile("--arch", "all", "--kernels", "pk_sm90_tma_nd", "--kernels", "pkt_fill", "--json", env=env)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["results"]
    assert {row["arch"] for row in rows if row["kernel"] == "pk_sm90_tma_nd"} == {"sm_90a"}
    other = {row["arch"] for row in rows if row["kernel"] == "pkt_fill"}
    assert "sm_90" in other and "sm_80" in other and not any(a.endswith("a") for a in other)  # no second copy
    help_text = _precompile("--help", env=env).stdout
    assert "`a` targets such as sm_90a" in " ".join(help_text.split())


@pytest.fixture(scope="module")
def sm90a_module():
    from pykern import compiler

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return compiler.compile(SRC, "sm_90a")
    except Exception as e:
        pytest.skip(f"NVRTC unavailable: {e}")


def _fake_backend(cc: tuple[int, int], mod, monkeypatch: pytest.MonkeyPatch) -> tuple[FakeDriver, list]:
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(SRC.parent))
    drv = FakeDriver(cc=cc, max_shared_optin=227 * 1024)
    drv.register(mod.image, mod.ptx, "sm_90a")
    asked: list = []

    def get_module(source, arch, kernel=None):
        asked.append((Path(source).name, arch))
        if arch != "sm_90a":
            raise AssertionError(f"asked for {arch}")
        return StubModule(mod.image, hashlib.sha256(mod.image).hexdigest())

    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=lambda: ("sm_80", "sm_90"))
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    return drv, asked


def test_nvrtc_on_cc90_picks_sm90a_and_passes_tensor_maps_by_value(sm90a_module, monkeypatch) -> None:
    drv, asked = _fake_backend((9, 0), sm90a_module, monkeypatch)
    assert backends.arch_features("nvrtc") == ("sm_90a",) and backends.kernel_variant("sm_90a", "nvrtc")
    a = drv.device_array(np.zeros((128, 64), ml_dtypes.bfloat16))
    d = drv.device_array(np.zeros((128, 64), np.float32))
    ma = make_tensor_map(a, (64, 64), "128B", backend="nvrtc")
    md = make_tensor_map(d, (64, 64), None, backend="nvrtc")
    call = [c for c in drv.calls if c[0] == "tensor_map_encode_tiled"][0][1]
    assert call == ("bfloat16", 2, a.ptr, (64, 128), (128,), (64, 64), (1, 1), 128, False)
    pykern.launch("pk_sm90_tma_wgmma_ss", 2, 128, ma, ma, md, d, shared_mem=33 * 1024, backend="nvrtc")
    assert asked == [("pk_sm90_wrappers.cu", "sm_90a")]
    v = drv.launches[-1].values  # decoded by the fake from kernelParams, checked against the PTX .param
    assert v[0] == ma.data and v[2] == md.data and v[0][:4] == b"FKTM" and v[3] == d.ptr


def test_nvrtc_elsewhere_refuses_sm90a_kernels(sm90a_module, monkeypatch) -> None:
    drv, _ = _fake_backend((8, 6), sm90a_module, monkeypatch)
    assert backends.arch_features("nvrtc") == () and not backends.kernel_variant("sm_90a", "nvrtc")
    a = drv.device_array(np.zeros(512, np.uint32))
    b = drv.device_array(np.zeros(2048, np.uint16))
    d = drv.device_array(np.zeros(128 * 64, np.float32))
    with pytest.raises(ArgumentError, match="built only for sm_90a.*this GPU is sm_86"):
        pykern.launch("pk_sm90_wgmma_rs", 1, 256, a, b, d, backend="nvrtc")
    assert not drv.launches


def test_fake_driver_refuses_what_the_driver_refuses(monkeypatch) -> None:
    drv = FakeDriver(cc=(9, 0))
    buf = drv.device_array(np.zeros((64, 64), np.float32))
    ok = drv.tensor_map_encode_tiled("float32", 2, buf.ptr, (64, 64), (256,), (32, 8), (1, 1), 128, False)
    assert len(ok) == 128
    for args, why in [((buf.ptr + 4, (64, 64), (256,), (32, 8), 0), "16-byte aligned"),
                      ((buf.ptr, (64, 64), (200,), (32, 8), 0), "multiples of 16"),
                      ((buf.ptr, (64, 64), (256,), (300, 8), 0), "1..256"),
                      ((buf.ptr, (64, 64), (256,), (64, 8), 128), "swizzle span")]:
        with pytest.raises(DriverError, match=why):
            drv.tensor_map_encode_tiled("float32", 2, args[0], args[1], args[2], args[3], (1, 1), args[4], False)


def test_host_arch_features(monkeypatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
    assert backends.arch_features("host") == ("sm_90a",) and backends.kernel_variant("sm_90a", "host")
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90")
    assert backends.arch_features("host") == ()
    monkeypatch.delenv("PYKERN_HOST_ARCH")
    assert not backends.kernel_variant("sm_90a", "host")
