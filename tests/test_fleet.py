"""Fleet-safe precompile and cache (issue 16): interrupts, honest exit codes, one compile per key across
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

CU = Path(__file__).parent / "cu"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def env(tmp_path, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(CU, src)
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(src))
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("PYKERN_CUBIN_DIR", "PYKERN_DISABLE_JIT", "PYKERN_LOG_LEVEL", "PYKERN_STRICT", "PYKERN_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cache, "_memory", {})
    return src


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*") if p.is_file())


# ----------------------------------------------------------------------------- 1. interrupts


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_cancels_queued_and_running_compiles(env, tmp_path, sig, code):
    # The project's kernels (1-3 s per compile) for two archs: 10 compiles, far from done at the first line.
    cache_root = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "pykern.precompile", "--arch", "sm_80,sm_90", "--jobs", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYKERN_KERNEL_PATH": ""})
    first = proc.stderr.readline()
    assert first.startswith("[1/10]"), first
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    waited = time.monotonic() - t0
    assert proc.returncode == code, err
    assert waited < 5.0, f"took {waited:.1f} s to stop"
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if not ln.startswith("[")]
    assert len(lines) == 1 and f"interrupted by {signal.Signals(sig).name}" in lines[0], err
    assert out == ""  # no table: the run did not finish
    assert _leftovers(cache_root) == []  # no temp files, no lock files
    finished = list(cache.iter_entries(cache_root))
    assert 1 <= len(finished) < 10
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
