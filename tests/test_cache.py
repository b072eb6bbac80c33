"""Disk cache: keys, hits, corruption, concurrency, unwritable folders, PYKERN_DISABLE_JIT, bundles, the CLI."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from pykern import cache, compiler, precompile
from pykern.errors import CacheMiss, CompileError, KernelNotFound
from cache_helpers import private_sources

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Private copies of the test sources and an empty cache folder; no bundle, JIT on."""
    src = private_sources(tmp_path, monkeypatch, on_path=False)
    monkeypatch.setattr(cache, "_logged_corrupt", set())
    monkeypatch.setattr(cache, "_warned_unwritable", False)
    return src


def _entries(root):
    return [e.path for e in cache.iter_entries(root)]


def test_miss_then_hit(env, tmp_path):
    first = cache.get_module(env / "pkt_basic.cu", "sm_80", kernel="pkt_scale")
    assert (first.hit, first.origin) == (False, "compiled")
    assert first.path == cache.entry_path(tmp_path / "cache", first.digest)
    assert first.path.parent.name == first.digest[:2]
    assert _entries(tmp_path / "cache") == [first.path]
    second = cache.get_module(env / "pkt_basic.cu", "sm_80", kernel="pkt_scale")
    assert (second.hit, second.origin) == (True, "cache")
    assert second.image == first.image and second.image[:4] == b"\x7fELF"
    assert second.resources == first.resources and second.resources["pkt_mixed"].shared_bytes == 256
    assert second.digest == first.digest and second.kernels == ("pkt_scale", "pkt_mixed")
    meta, image = cache.decode_entry(first.path.read_bytes(), first.digest)
    assert image == first.image and meta["arch"] == "sm_80" and meta["nvrtc"]


def test_ptx_entry(env):
    m = cache.get_module(env / "pkt_other.cu", "compute_90")
    assert m.kind == "ptx" and b".entry pkt_fill" in m.image and m.resources == {}
    assert cache.get_module(env / "pkt_other.cu", "compute_90").hit


def test_key_covers_header_bytes_options_defines_arch(env, tmp_path):
    src = env / "pkt_basic.cu"
    k0 = cache.key_for(src, "sm_80")
    assert cache.key_for(src, "sm_86") != k0
    assert cache.key_for(src, "sm_80", ["-lineinfo"]) != k0
    assert cache.key_for(src, "sm_80", defines={"X": 1}) != k0
    assert cache.key_for(src, "80") == k0  # same arch, other spelling
    # The same bytes elsewhere share the key: include paths are machine-specific, bytes are not.
    other = tmp_path / "elsewhere"
    shutil.copytree(env, other)
    assert cache.key_for(other / "pkt_basic.cu", "sm_80") == k0

    before = cache.get_module(src, "sm_80")
    hdr = env / "pkt_header.cuh"
    hdr.write_text(hdr.read_text().replace("2.0f", "3.0f"))
    assert cache.key_for(src, "sm_80") != k0
    after = cache.get_module(src, "sm_80")
    assert not after.hit and after.digest != before.digest and after.image != before.image


def test_bundle_key_does_not_depend_on_nvrtc(env, monkeypatch):
    src = env / "pkt_basic.cu"
    k = cache.key_for(src, "sm_80", bundle=True)
    monkeypatch.setattr(cache, "_nvrtc_str", lambda: "99.9")
    assert cache.key_for(src, "sm_80", bundle=True) == k
    assert cache.key_for(src, "sm_80") != cache.key_for(src, "sm_80", bundle=True)


def _corrupt_truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _corrupt_bitflip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) - 100] ^= 0x10  # inside the image
    p.write_bytes(bytes(data))


def _corrupt_empty(p: Path) -> None:
    p.write_bytes(b"")


@pytest.mark.parametrize("damage", [_corrupt_truncate, _corrupt_bitflip, _corrupt_empty], ids=["truncated",
                                                                                                "bitflip", "empty"])
def test_corrupt_entry_is_logged_once_recompiled_and_replaced(env, caplog, damage):
    good = cache.get_module(env / "pkt_basic.cu", "sm_80")
    damage(good.path)
    with caplog.at_level(logging.WARNING, logger="pykern"):
        again = cache.get_module(env / "pkt_basic.cu", "sm_80")
        assert (again.hit, again.origin) == (False, "compiled")
        assert again.image == good.image
        cache.decode_entry(good.path.read_bytes(), good.digest)  # replaced by a valid entry
        assert cache.get_module(env / "pkt_basic.cu", "sm_80").hit
        damage(good.path)
        assert not cache.get_module(env / "pkt_basic.cu", "sm_80").hit
    records = [r for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(records) == 1 and str(good.path) in records[0].getMessage()


def test_entry_under_the_wrong_name_is_never_loaded(env, caplog):
    a = cache.get_module(env / "pkt_basic.cu", "sm_80")
    b = cache.get_module(env / "pkt_other.cu", "sm_80")
    shutil.copyfile(b.path, a.path)  # valid bytes, but another key's kernel
    with caplog.at_level(logging.WARNING, logger="pykern"):
        again = cache.get_module(env / "pkt_basic.cu", "sm_80", kernel="pkt_scale")
    assert not again.hit and again.image == a.image and "pkt_scale" in again.kernels
    assert any("expected" in r.getMessage() for r in caplog.records)


def test_failed_compile_is_not_cached(env, tmp_path):
    bad = env / "pkt_bad.cu"
    bad.write_text('extern "C" __global__ void pkt_bad(float* y) { y[0] = nope; }\n')
    for _ in range(2):
        with pytest.raises(CompileError, match="nope"):
            cache.get_module(bad, "sm_80")
    assert _entries(tmp_path / "cache") == []
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_wrong_kernel_name(env):
    with pytest.raises(KernelNotFound, match="pkt_nope"):
        cache.get_module(env / "pkt_basic.cu", "sm_80", kernel="pkt_nope")


_RACER = """
import json, os, sys, time, hashlib
from pathlib import Path
from pykern import cache, compiler
compiler.nvrtc_version()  # load NVRTC before the start line, so the race is about the cache
go = Path(sys.argv[1])
(go.parent / f"ready.{os.getpid()}").touch()
while not go.exists():
    time.sleep(0.001)
m = cache.get_module(sys.argv[2], "sm_86", kernel="pkt_mixed")
print(json.dumps({"digest": m.digest, "image": hashlib.sha256(m.image).hexdigest(), "hit": m.hit}))
"""


@pytest.mark.parametrize("lock_wait", ["300", "0"])
def test_many_processes_compiling_one_key(env, tmp_path, lock_wait):
    # With the per-key lock one process compiles and the others wait for its entry; with no wait
    # (PYKERN_LOCK_TIMEOUT=0) they race, and the atomic publish keeps the entry whole.
    race = tmp_path / "race"
    race.mkdir()
    go = race / "go"
    n = 6
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACER, str(go), str(env / "pkt_basic.cu")], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYKERN_LOCK_TIMEOUT": lock_wait})
        for _ in range(n)
    ]
    deadline = time.monotonic() + 120
    while len(list(race.glob("ready.*"))) < n and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break  # one died before the start line; its stderr is shown below
        time.sleep(0.01)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [e for _, e in outs]
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert len({r["digest"] for r in results}) == 1 and len({r["image"] for r in results}) == 1
    if lock_wait != "0":
        assert sum(not r["hit"] for r in results) == 1
    (path,) = _entries(tmp_path / "cache")
    meta, image = cache.decode_entry(path.read_bytes(), results[0]["digest"])
    assert hashlib.sha256(image).hexdigest() == results[0]["image"]
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def _unwritable_dir(tmp_path) -> Path:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    return blocker / "cache"  # mkdir fails even for root


def test_unwritable_folder_degrades_to_memory_with_one_warning(env, tmp_path, monkeypatch):
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(_unwritable_dir(tmp_path)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = cache.get_module(env / "pkt_basic.cu", "sm_80")
        b = cache.get_module(env / "pkt_basic.cu", "sm_80")
        c = cache.get_module(env / "pkt_other.cu", "sm_80")
    ours = [w for w in caught if issubclass(w.category, cache.CacheWarning)]
    assert len(ours) == 1 and "not writable" in str(ours[0].message)
    assert (a.hit, a.path) == (False, None)
    assert (b.hit, b.origin) == (True, "memory") and b.image == a.image
    assert not c.hit and c.image[:4] == b"\x7fELF"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_folder(env, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(ro))
    try:
        with pytest.warns(cache.CacheWarning):
            assert not cache.get_module(env / "pkt_basic.cu", "sm_80").hit
        assert cache.get_module(env / "pkt_basic.cu", "sm_80").origin == "memory"
    finally:
        ro.chmod(0o755)


def test_read_only_populated_folder_still_serves_hits(env, monkeypatch):
    first = cache.get_module(env / "pkt_basic.cu", "sm_80")

    def read_only(*a, **k):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(cache, "write_atomic", read_only)
    monkeypatch.setattr(os, "utime", read_only)  # the LRU touch must not fail a hit either
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a hit writes nothing, so nothing to warn about
        again = cache.get_module(env / "pkt_basic.cu", "sm_80")
    assert again.hit and again.image == first.image
    with pytest.warns(cache.CacheWarning, match="not writable"):
        assert not cache.get_module(env / "pkt_basic.cu", "sm_86").hit


def test_disable_jit_miss_names_kernel_and_arch(env, monkeypatch):
    monkeypatch.setenv("PYKERN_DISABLE_JIT", "1")
    with pytest.raises(CacheMiss) as e:
        cache.get_module(env / "pkt_basic.cu", "sm_90a", kernel="pkt_mixed")
    assert "pkt_mixed" in str(e.value) and "sm_90a" in str(e.value)
    monkeypatch.delenv("PYKERN_DISABLE_JIT")
    cache.get_module(env / "pkt_basic.cu", "sm_90a")
    monkeypatch.setenv("PYKERN_DISABLE_JIT", "1")
    assert cache.get_module(env / "pkt_basic.cu", "sm_90a", kernel="pkt_mixed").hit


def test_bundle_folder_is_searched_first_and_needs_no_nvrtc(env, tmp_path, monkeypatch):
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(env))
    bundle = tmp_path / "bundle"
    rc = precompile.main(["--arch", "sm_80,compute_80", "--kernels", "pkt_*", "--jobs", "1", "--out", str(bundle)])
    assert rc == 0
    manifest = json.loads((bundle / cache.BUNDLE_MANIFEST).read_text())
    assert {(e["source"], e["arch"]) for e in manifest["entries"]} == {
        (f, a) for f in ("pkt_basic.cu", "pkt_other.cu") for a in ("sm_80", "compute_80")}
    files_before = sorted(p.name for p in bundle.rglob("*"))

    # A fresh machine: empty cache, no JIT, and NVRTC unusable.
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("PYKERN_CUBIN_DIR", str(bundle))
    monkeypatch.setenv("PYKERN_DISABLE_JIT", "1")

    def no_nvrtc():
        raise compiler.BackendUnavailable("no NVRTC in this test")

    monkeypatch.setattr(cache, "_nvrtc_str", no_nvrtc)
    m = cache.get_module(env / "pkt_basic.cu", "sm_80", kernel="pkt_scale")
    assert (m.hit, m.origin) == (True, "bundle") and m.image[:4] == b"\x7fELF"
    assert m.resources["pkt_mixed"].shared_bytes == 256
    assert cache.get_module(env / "pkt_other.cu", "compute_80").kind == "ptx"
    with pytest.raises(CacheMiss) as e:
        cache.get_module(env / "pkt_basic.cu", "sm_90", kernel="pkt_scale")
    assert "pkt_scale" in str(e.value) and "sm_90" in str(e.value) and str(bundle) in str(e.value)
    assert sorted(p.name for p in bundle.rglob("*")) == files_before  # never written to
    assert not (tmp_path / "empty_cache").exists()


def _no_nvrtc(monkeypatch):
    def no_nvrtc():
        raise compiler.BackendUnavailable("no NVRTC in this test")

    monkeypatch.setattr(cache, "_nvrtc_str", no_nvrtc)


def _cubins(arch):
    return tuple(a for a in cache.compatible_archs(arch) if a.startswith("sm_"))


def _ptx(arch):
    return tuple(a for a in cache.compatible_archs(arch) if a.startswith("compute_"))


def test_compatible_archs():
    assert _cubins("sm_86") == ("sm_86", "sm_86a", "sm_85", "sm_84", "sm_83", "sm_82", "sm_81", "sm_80")
    assert _cubins(89)[-1] == "sm_80" and len(_cubins(89)) == 11
    assert _cubins("sm_121") == ("sm_121", "sm_121a", "sm_120")
    # Cubins never across majors, never from a newer minor, nothing for arch-specific or family targets.
    assert _cubins("sm_90") == ("sm_90", "sm_90a")
    assert _cubins("sm_100") == ("sm_100", "sm_100a")
    assert cache.compatible_archs("sm_90a") == ("sm_90a",)
    assert cache.compatible_archs("sm_103f") == ("sm_103f",)
    # PTX: the GPU's own compute_XX, then every older one, newest first (the driver JITs it forward).
    assert _ptx("sm_100")[:4] == ("compute_100", "compute_90", "compute_89", "compute_88")
    assert _ptx("sm_86")[:3] == ("compute_86", "compute_80", "compute_75") and _ptx("sm_86")[-1] == "compute_50"
    assert cache.compatible_archs("compute_86") == _ptx("sm_86")
    assert cache.compatible_archs("sm_100").index("sm_100a") < cache.compatible_archs("sm_100").index("compute_100")


def test_bundle_serves_later_minors_of_its_major_only(env, tmp_path, monkeypatch):
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(env))
    bundle = tmp_path / "bundle"
    real_nvrtc_str = cache._nvrtc_str

    def build(arch):  # on the build machine
        monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "build_cache"))
        monkeypatch.delenv("PYKERN_CUBIN_DIR", raising=False)
        monkeypatch.delenv("PYKERN_DISABLE_JIT", raising=False)
        monkeypatch.setattr(cache, "_nvrtc_str", real_nvrtc_str)
        assert precompile.main(["--arch", arch, "--kernels", "pkt_scale", "--jobs", "1", "--out", str(bundle)]) == 0
        return cache.decode_entry(cache.entry_path(bundle, cache.key_for(src, arch, bundle=True)).read_bytes())[1]

    def target():  # no NVRTC, no JIT, an empty cache
        monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "empty_cache"))
        monkeypatch.setenv("PYKERN_CUBIN_DIR", str(bundle))
        monkeypatch.setenv("PYKERN_DISABLE_JIT", "1")
        _no_nvrtc(monkeypatch)

    src = env / "pkt_basic.cu"
    sm90 = build("sm_90")
    target()
    m = cache.get_module(src, "sm_90", kernel="pkt_scale", compatible=True)
    assert (m.origin, m.arch, m.image) == ("bundle", "sm_90", sm90)
    for newer_major in ("sm_100", "sm_120"):
        with pytest.raises(CacheMiss) as e:
            cache.get_module(src, newer_major, kernel="pkt_scale", compatible=True)
        assert f"for arch {newer_major} (archs tried: {newer_major}, {newer_major}a, compute_" in str(e.value)
    with pytest.raises(CacheMiss) as e:  # sm_90 is a newer minor than sm_89: never used for it
        cache.get_module(src, "sm_89", kernel="pkt_scale", compatible=True)
    tried = ", ".join(["sm_89", "sm_89a", *(f"sm_8{m}" for m in range(8, -1, -1)), "compute_89", "compute_88"])
    assert f"for arch sm_89 (archs tried: {tried}, " in str(e.value) and str(bundle) in str(e.value)
    with pytest.raises(CacheMiss):  # arch-specific: only an exact sm_90a entry would do
        cache.get_module(src, "sm_90a", kernel="pkt_scale", compatible=True)

    sm80 = build("sm_80")  # added to the same bundle
    assert sm80 != sm90 and sm80[:4] == b"\x7fELF"
    target()
    for later in ("sm_86", "sm_87", "sm_89"):
        m = cache.get_module(src, later, kernel="pkt_scale", compatible=True)
        assert (m.hit, m.origin, m.arch, m.image) == (True, "bundle:sm_80", "sm_80", sm80)
        assert m.resources["pkt_mixed"].shared_bytes == 256
    assert cache.get_module(src, "sm_80", compatible=True).origin == "bundle"  # exact: no suffix
    with pytest.raises(CacheMiss, match="for arch sm_86;"):  # the default asks for exactly sm_86
        cache.get_module(src, "sm_86", kernel="pkt_scale")
    assert not (tmp_path / "empty_cache").exists()


def test_exact_arch_is_preferred_then_the_newest_older_minor(env, tmp_path, monkeypatch):
    src = env / "pkt_basic.cu"
    bundle = tmp_path / "bundle"
    for arch in ("sm_80", "sm_86"):
        cache.export_to_bundle(cache.get_module(src, arch), cache.load_source(src), bundle)
    cache_86 = cache.get_module(src, "sm_86")  # also in the cache folder (a hit now)
    monkeypatch.setenv("PYKERN_CUBIN_DIR", str(bundle))
    # Exact in the bundle beats exact in the cache, which beats an older minor anywhere.
    m = cache.get_module(src, "sm_86", compatible=True)
    assert (m.origin, m.arch, m.image) == ("bundle", "sm_86", cache_86.image)
    (bundle_86,) = [p for p in bundle.rglob("*.pkc") if cache.decode_entry(p.read_bytes())[0]["arch"] == "sm_86"]
    bundle_86.unlink()
    m = cache.get_module(src, "sm_86", compatible=True)
    assert (m.origin, m.arch) == ("cache", "sm_86")
    # sm_87: nothing exact; the sm_86 entry of the cache beats the bundle's older sm_80.
    monkeypatch.setenv("PYKERN_DISABLE_JIT", "1")
    m = cache.get_module(src, "sm_87", kernel="pkt_scale", compatible=True)
    assert (m.hit, m.origin, m.arch, m.image) == (True, "cache:sm_86", "sm_86", cache_86.image)
    monkeypatch.delenv("PYKERN_DISABLE_JIT")
    # With JIT on, a compatible entry still comes before compiling ...
    assert cache.get_module(src, "sm_89", compatible=True).origin == "cache:sm_86"
    # ... and without compatible= the exact arch is compiled (what precompile asks for).
    m = cache.get_module(src, "sm_89")
    assert (m.hit, m.origin, m.arch) == (False, "compiled", "sm_89")
    assert cache.get_module(src, "sm_89", compatible=True).origin == "cache"


def _fill(env, root, archs):
    paths = []
    for i, arch in enumerate(archs):
        m = cache.get_module(env / "pkt_other.cu", arch, cache_root=root)
        os.utime(m.path, (1_000_000 + i, 1_000_000 + i))  # older first
        paths.append(m.path)
    return paths


def test_cli_info_prune_clear(env, tmp_path, capsys):
    root = tmp_path / "cli_cache"
    paths = _fill(env, root, ["sm_75", "sm_80", "sm_86"])
    assert cache.main(["--cache-dir", str(root), "info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["entries"] == 3 and d["by_arch"] == {"sm_75": 1, "sm_80": 1, "sm_86": 1}
    assert d["bytes"] == sum(p.stat().st_size for p in paths)

    cache.get_module(env / "pkt_other.cu", "sm_75", cache_root=root)  # a hit makes sm_75 most recent
    keep = paths[0].stat().st_size + paths[2].stat().st_size
    assert cache.main(["--cache-dir", str(root), "prune", "--max-size", str(keep)]) == 0
    assert "removed 1" in capsys.readouterr().out
    assert sorted(_entries(root)) == sorted([paths[0], paths[2]])  # sm_80 was least recently used

    assert cache.main(["--cache-dir", str(root), "info"]) == 0
    assert "entries      : 2" in capsys.readouterr().out
    assert cache.main(["--cache-dir", str(root), "clear"]) == 0
    assert _entries(root) == []


def test_stale_temps_and_locks_by_age(tmp_path):
    # info / clear / prune find interrupted writes (.tmp, in the cubin and host folders) and lock files by age
    root = tmp_path / "ages"
    (root / "ab").mkdir(parents=True)
    (root / cache.HOST_SUBDIR).mkdir()
    old = [root / "ab" / ".x.tmp", root / cache.HOST_SUBDIR / ".y.tmp"]
    lock, new = root / "ab" / f".k{cache.LOCK_SUFFIX}", root / "ab" / ".z.tmp"
    for p in [*old, lock, new]:
        p.write_bytes(b"")
    t = time.time() - 7200
    for p in [*old, lock]:
        os.utime(p, (t, t))
    assert sorted(cache._stale_temps(root, 3600.0)) == sorted(old)
    assert cache._stale_locks(root, 3600.0) == [lock]
    assert sorted(cache._stale_temps(root, 0)) == sorted([*old, new])
    assert cache._stale_temps(tmp_path / "none", 0) == [] and cache._stale_locks(tmp_path / "none", 0) == []


@pytest.mark.parametrize("text, n", [("0", 0), ("4096", 4096), ("1K", 1024), ("500M", 500 * 2**20),
                                     ("1.5GB", int(1.5 * 2**30)), ("2 gib", 2 * 2**30)])
def test_parse_size(text, n):
    assert cache.parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "M", "-1", "10X"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="size"):
        cache.parse_size(bad)


def test_cache_cli_runs_as_module(env, tmp_path):
    out = subprocess.run([sys.executable, "-m", "pykern.cache", "--cache-dir", str(tmp_path / "c"), "info"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "entries      : 0" in out.stdout and str(tmp_path / "c") in out.stdout
    bad = subprocess.run([sys.executable, "-m", "pykern.cache", "prune", "--max-size", "lots"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "max-size" in bad.stderr
    assert "expected a number with an optional unit K/M/G/T, got 'lots'" in bad.stderr  # not argparse's "invalid"


def test_cache_folder_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PYKERN_CACHE_DIR")
    assert cache.cache_dir() == tmp_path / "xdg" / "pykern"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "pykern"
    from pykern.host import build

    assert build.cache_root() == cache.cache_dir()  # one resolver for the cubin and host caches


def test_clear_also_deletes_host_builds(env, tmp_path, monkeypatch, capsys):
    # docs: `python -m pykern.cache clear` deletes everything; the host backend's libraries live in
    # <cache>/host/ of the same folder.
    from pykern.backends.host import HostBackend

    root = tmp_path / "cache"
    _fill(env, root, ["sm_80"])
    kdir = tmp_path / "hk"
    kdir.mkdir()
    (kdir / "hk.cu").write_text('extern "C" __global__ void pk_hk(float* y) { y[threadIdx.x] = 1.0f; }\n')
    lib = HostBackend().library(kdir / "hk.cu")
    assert lib.path.parent == root / "host"
    assert cache.main(["--cache-dir", str(root), "info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["host_builds"] == 2 and d["host_bytes"] > 0  # the library and the fiber runtime object
    assert cache.main(["--cache-dir", str(root), "clear"]) == 0
    assert "removed 3 " in capsys.readouterr().out
    assert _entries(root) == [] and list((root / "host").iterdir()) == []
